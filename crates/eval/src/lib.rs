//! Evaluation (docs/METHOD.md §8). This first part holds the scoring rules, independent of models and
//! graders:
//! - [`rubric_score`]: HealthBench-style example scores (points met over total positive points,
//!   negative items counted when the undesirable behaviour is present), the clipped mean and its
//!   seeded bootstrap standard deviation, and breakdowns by tag.
//! - [`mcq`]: answer extraction from free-form multiple-choice responses, accuracy with a Wilson
//!   interval, and the invalid-output rate.
//! - [`three_state`]: our three-state score of the same responses (mean of +1 / 0 / -1 labels).
//! - [`examples`]: rubric evaluation data (HealthBench rows or our rubric records).

pub mod error;
pub mod examples;
pub mod mcq;
pub mod mcq_data;
pub mod rubric_score;
pub mod three_state;

pub use error::EvalError;
pub use examples::{read_eval_examples, EvalExample};
pub use mcq::{extract_choice, McqSummary};
pub use mcq_data::{load_items, McqFormat, McqItem};
pub use rubric_score::{
    bootstrap_std, bootstrap_std_clipped, example_score, summarize, GradedItem, RubricSummary,
};
pub use three_state::{summarize_three_state, three_state_score, ThreeStateSummary};
