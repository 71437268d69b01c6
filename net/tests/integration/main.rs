//! Networking's integration tests (the bounded accept loop, the router), in one binary.

mod router;
mod serve;
