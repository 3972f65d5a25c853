//! Rubric records and the scoring rules of the ConRub method (docs/METHOD.md §2, §4, §9).
//!
//! - [`record`]: the per-prompt rubric record (criteria with kind, reference-coverage tag and
//!   provenance) as serde types.
//! - [`io`]: JSONL reading and atomic writing (the workspace's one temporary-file-and-rename helper,
//!   [`AtomicFile`]: fsync of the file, rename, fsync of the directory), with errors that name the
//!   file, line and field.
//! - [`parquet`]: parquet rows read as the JSON objects of the same data's JSONL lines.
//! - [`validate`]: the independent validator behind `conrub rubrics validate`.
//! - [`import`]: adapters for the RaR, RubricHub (verl rows) and HealthBench formats.
//! - [`score`]: binary and three-state rewards as exact rationals, the soft overlength penalty,
//!   and the distinct *unscored* state.
//! - [`dropout`]: seeded rubric dropout shared by a whole group.
//! - [`verifiable`]: `[[reward.functions]]` entries and the verifiable checks (exact or numeric
//!   match against a record's `ground_truth`, regex, format).
//!
//! This crate never talks to a model: judges produce [`Label`]s, this crate turns them into rewards.

pub mod bootstrap;
pub mod dropout;
pub mod error;
pub mod import;
pub mod io;
pub mod parquet;
pub mod record;
pub mod score;
pub mod validate;
pub mod verifiable;

pub use dropout::{seeded_permutation, stable_seed, CriterionSubset, RubricDropout};
pub use error::{Result, RubricError};
pub use import::{import_file, ImportFormat, ImportReport};
pub use io::{
    read_jsonl, read_rubrics, write_bytes_atomic, write_jsonl_atomic, AtomicFile, RubricSet,
};
pub use record::{
    messages_text, Coverage, Criterion, CriterionKind, CriterionProvenance, Message, RubricRecord,
    SourceProvenance,
};
pub use score::{
    score_labels, Label, LengthPenalty, MixedScore, ResponseScore, Reward, RewardPart, ScoringMode,
    UnscoredReason, ValueScore,
};
pub use validate::{validate_records, ValidationIssue, ValidationReport};
pub use verifiable::{parse_number, AnswerCheck, Extract, RewardFunctionSpec};
