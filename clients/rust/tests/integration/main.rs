//! The Rust client's tests against a real agent, and the TypeScript and Python clients' suites
//! run against one, in one binary.

mod common;

mod agent;
mod other_languages;
