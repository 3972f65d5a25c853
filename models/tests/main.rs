//! The integration tests of `conrub-models`, one module per file, in one test binary (hub.rs,
//! which sets process-wide environment variables, is a binary of its own). Run one file's tests
//! with a filter: `cargo test -p conrub-models --test models parity::`.

mod chat_template;
mod parity;
mod policy;
mod precision;
mod training;
