//! Rollouts on SGLang servers, behind the learner's [`conrub_contracts::RolloutEngine`] interface
//! (`[rollout] engine = "sglang"`).
//!
//! Per learner step:
//! - **Weights first.** Before the step's first `/generate`, every server must hold the policy's
//!   weights: the engine writes them as a Hugging Face directory (`weights_dir/step-NNNNNN`,
//!   written under `.tmp` and renamed; the last two kept), POSTs `/update_weights_from_disk`
//!   with that path and the version `step-NNNNNN` to every server, and checks each answer. It
//!   does so before the first rollout of a run (a warm-up, a resume or a local model may differ
//!   from what the server loaded) and after every step's updates. A failed update is an error:
//!   the run never trains on rollouts of stale weights.
//! - **Generation.** One `/generate` per group ([`protocol`]): the prompt's token ids,
//!   `n` = group size, the run's temperature, top-p, top-k, length limit and stop ids, with
//!   log-probs. Groups go round-robin to the servers, at most `concurrency` in flight. Each
//!   reply is checked (output count, ids inside the vocabulary, one log-prob per id, the finish
//!   reason against the length and stop ids, the weight version where the server reports it);
//!   anything else is an error naming the server and the field. Refusals (HTTP 429/5xx),
//!   transport errors and timeouts are retried with doubling backoff, then fail naming the URL.
//! - **Colocation.** With `colocate`, the servers release their GPU memory once every rank's
//!   rollouts are done (`/release_memory_occupation`) and resume it before the weight update
//!   (`/resume_memory_occupation`): the learner trains on the GPUs the servers decode on.
//!
//! The learner recomputes the old log-probs itself (the servers' numerics differ from the
//! trainer's) and reports the gap to the servers' in each step's metrics; `learner.tis_cap`
//! turns on the truncated importance-sampling correction.

mod engine;
mod error;
pub mod protocol;
#[cfg(feature = "testing")]
pub mod testing;

pub use engine::{SglangConfig, SglangEngine, WeightWriter};
pub use error::{RemoteError, Result};
