//! Prints the decide function library as the store loads it, its marked steps inlined, with
//! `LIBRARY_VERSION` where the store puts its version. `scripts/decide-instructions` loads it into a
//! Redis of its own to count what each decision costs.

fn main() {
    print!("{}", allot_region_agent::limiter::decide_library());
}
