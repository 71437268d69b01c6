//! The drills, the model checker and `allot dev`, tested: one module per subject, in one binary
//! (this crate is optimised, and a binary per file compiled its dependencies again for each).

mod dev;
mod drills;
mod model;
mod scenarios;
mod seed_sweeps;
