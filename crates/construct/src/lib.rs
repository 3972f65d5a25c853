//! Consensus rubric construction (docs/METHOD.md §3): three different generator LLMs propose
//! criteria, a separate reviewer checks each sample, groups the candidates and audits the
//! survivors, and plain code decides consensus, deduplication and the final cap.
//!
//! - [`config`]: the build TOML (generators `A`, `B`, `C`, the reviewer, settings, quotas, caps).
//! - [`input`]: prompt files, dedup and seeded per-stratum quotas.
//! - [`prompts`]: our prompt wording for the four roles; [`parse`]: their answers.
//! - [`stages`]: the deterministic steps; [`pipeline`]: one prompt through steps 1-7.
//! - [`calls`]: model calls through the persistent cache (resumable, byte-identical reruns).
//! - [`artifacts`], [`build`]: the output folder and a whole run.
//! - `testing` (feature): scripted generator and reviewer servers for loopback tests and benches.

pub mod artifacts;
pub mod build;
pub mod calls;
pub mod config;
pub mod counts;
pub mod error;
pub mod input;
pub mod parse;
pub mod pipeline;
pub mod prompts;
pub mod stages;
#[cfg(feature = "testing")]
pub mod testing;

pub use build::{build, BuildRequest, BuildSummary};
pub use config::BuildConfig;
pub use counts::StageCounts;
pub use error::{ConstructError, Result};
pub use input::{read_prompts, InputFormat, PromptInput};
pub use pipeline::{Builder, Progress, PromptResult};
pub use prompts::ConstructPrompts;
