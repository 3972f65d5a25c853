//! Probe judges: a linear probe on the hidden states of a small in-process model, distilled from
//! the criterion verdicts of a big judge (its cache, or a labels file), that labels criteria with
//! no generation.
//!
//! - [`examples`]: labelled rows from labels files and judge caches; the split by prompt.
//! - [`features`]: the prompt layout, hidden-state pooling over each criterion's span (the same
//!   whatever the batch) and the resumable feature store.
//! - [`linear`]: the probe (multinomial logistic regression) and its file.
//! - [`metrics`]: agreement with the teacher (accuracy, macro-F1, kappa, calibration).
//! - [`distill`]: the whole distillation, with its layer and pooling sweep.
//! - [`judge`]: the probe as a [`crate::CriterionJudge`], with abstention to a fallback judge.

pub mod examples;
pub mod metrics;
mod pooling;

#[cfg(feature = "local")]
pub mod distill;
#[cfg(feature = "local")]
pub mod features;
#[cfg(feature = "local")]
pub mod judge;
#[cfg(feature = "local")]
pub mod linear;

pub use examples::{
    examples_from_caches, read_labels, split_by_prompt, CacheHarvest, LabelledExample,
};
pub use metrics::{agreement, Agreement, ClassAgreement};
pub use pooling::Pooling;

#[cfg(feature = "local")]
pub use distill::{candidate_layers, distill, DistillConfig, DistillReport, SweepRow};
#[cfg(feature = "local")]
pub use features::{
    model_digest, FeatureSpec, FeatureStore, ProbeFeaturizer, StoreMeta, MEAN_SPAN_VERSION,
};
#[cfg(feature = "local")]
pub use judge::{Abstention, FeatureSpecFilter, ProbeJudge};
#[cfg(feature = "local")]
pub use linear::{LinearProbe, ProbeMeta, ProbeTraining, PROBE_FORMAT};
