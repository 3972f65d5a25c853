//! The integration tests of `conrub-kernels`, one module per file, in one test binary: each file
//! used to be its own binary, and each of those that run on wgpu monomorphized burn's wgpu backend
//! again (about 70-100 s of CI's 2-core test build apiece). Run one file's tests with a filter:
//! `cargo test -p conrub-kernels --test kernels paged::` (`--features wgpu` for the wgpu ones,
//! `--features cuda-compile` for `offline_compile`).

mod attention;
mod attention_wgpu;
mod offline_compile;
mod paged;
mod parity;
