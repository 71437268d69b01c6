//! This workspace's own binaries (`allocator`, `allotctl`, `region-agent`, `allot`), for tests that
//! run them as real processes.

use std::path::PathBuf;

/// The path of the workspace binary `name`, built in the same profile as the running test: the
/// directory above the test executable's `deps/`. `cargo nextest run --workspace` (scripts/test)
/// builds every binary; a missing one is a clear failure naming the build command, never a skip.
pub fn workspace_binary(name: &str) -> PathBuf {
    let test_exe = std::env::current_exe().expect("allot-testkit: the test executable's path");
    let profile_dir = test_exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("allot-testkit: the test executable lives in target/<profile>/deps");
    let path = profile_dir.join(name);
    assert!(
        path.is_file(),
        "allot-testkit: the workspace binary {name} is not built at {}; build it with \
         `cargo build --workspace --bins` (scripts/test runs `cargo nextest run --workspace`, which does)",
        path.display()
    );
    path
}
