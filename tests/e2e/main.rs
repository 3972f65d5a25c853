//! The root crate's end-to-end tests, one module per file, in one test binary (`e2e`): each file
//! used to be its own binary, and each linked the whole CLI with burn's wgpu backend and the CUDA
//! compiler again (most of CI's 2-core test build). Run one file's tests with a filter:
//! `cargo test --features wgpu,cuda-compile --test e2e train::`.

mod cli;
mod cli_judge;
mod cpu_profile;
mod demo;
mod eval;
mod plan;
mod rubrics_build;
mod sampling;
mod tfevents;
mod train;
#[cfg(feature = "wgpu")]
mod wgpu;
