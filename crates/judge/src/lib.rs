//! Judges for rubric rewards: they label responses, they never compute rewards or advantages.
//!
//! - [`judge`]: the [`CriterionJudge`] and [`PairwiseJudge`] traits, verdict types, and the
//!   bidirectional comparison that accepts only order-consistent preferences.
//! - [`prompts`]: our prompt text for binary, three-state, pairwise and one-criterion judging.
//! - [`parse`]: a robust parser for real-world judge output.
//! - [`client`]: an OpenAI-compatible chat-completions client (tokio + reqwest) with concurrency
//!   limits, timeouts and bounded, jittered retries.
//! - [`cache`]: a persistent SQLite judge cache, so reruns make no calls.
//! - [`openai`], [`local`], [`lexical`]: the served, in-process (a burn `conrub_models` model) and test-double judges.
//! - [`probe`]: probe judges distilled from a big judge's verdicts (`conrub judge distill`).
//! - [`config`]: the judge TOML config; [`scoring`]: judging and scoring many responses.

pub mod cache;
pub mod client;
pub mod config;
pub mod error;
pub mod judge;
pub mod lexical;
#[cfg(feature = "local")]
pub mod local;
pub mod openai;
pub mod parse;
#[cfg(feature = "local")]
mod prefix;
pub mod probe;
pub mod prompts;
pub mod scoring;
#[cfg(feature = "testing")]
pub mod testing;

pub use cache::{CacheKey, CacheStats, JudgeCache};
pub use client::{CallError, CallOutcome, ChatClient, ClientConfig, ClientStats};
pub use config::{
    client_config, BuildJudge, JudgeBuild, JudgeConfig, JudgeKind, JudgeSpec, Judges,
    LexicalSettings, LocalSettings, OpenAiSettings, ProbeSettings,
};
pub use error::{JudgeError, Result};
pub use judge::{
    compare_both_orders, BidirectionalComparison, CriterionJudge, CriterionRequest,
    CriterionVerdict, PairOutcome, PairRequest, PairVerdict, PairwiseJudge,
};
pub use lexical::{KeywordEntry, LexicalJudge};
#[cfg(feature = "local")]
pub use local::{LocalJudge, LocalJudgeConfig, LocalMode};
pub use openai::OpenAiJudge;
pub use parse::{json_values, parse_labels, parse_pair, OutputError, PairAnswer, Preference};
pub use prompts::{PromptSet, PromptTemplate};
pub use scoring::{score_jobs, score_verdict, ScoreJob, ScoredJob, ScoringSummary};
