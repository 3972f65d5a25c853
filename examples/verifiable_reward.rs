//! Embed the conrub Trainer with a task of your own: arithmetic questions whose reward is an exact
//! match on the number in the answer (a verifiable reward: no rubrics, no judge, no server).
//!
//! `cargo run --release --example verifiable_reward -- [STEPS] [OUTPUT_DIR]`
//!
//! The policy is a tiny random Qwen3 with the real tokenizer (`[model.random]`, no download); the
//! run config is the same typed `TrainConfig` that `conrub train` reads, here from a string. The
//! task is a `Vec<Problem>` (`Problem` implements `TaskPrompt`) and its reward source is
//! `ExactNumber` (it implements `RewardSource<Problem>`); everything else (the supervised warm-up
//! on the reference answers, rollouts, GRPO steps, checkpoints, `metrics.jsonl`) is the
//! Trainer's.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use conrub_config::TrainConfig;
use conrub_rewards::{GroupScores, RewardSource, TaskPrompt};
use conrub_rubric::{Message, ResponseScore};
use conrub_trainer::{load_policy, RunSummary, Trainer};

/// The run: a small model, short answers, vanilla GRPO ties (a 0/1 reward ties often, and this
/// task has no judge to break them).
const CONFIG: &str = r#"
device = "cpu"

[model.random]
tokenizer = "../models/testdata/qwen3-tokenizer"
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 16
std = 0.02
seed = 0

[warmup]
steps = 20
lr = 0.01

[learner]
group_size = 4
max_response_tokens = 6
rollout_prompts_per_call = 8
lr = 0.002
weight_decay = 0.0
tie_mode = "off"
seed = 7

[run]
epochs = 1
prompts_per_step = 4
checkpoint_every = 0
"#;

/// One question with its answer.
#[derive(Debug, Clone)]
pub struct Problem {
    id: String,
    messages: Vec<Message>,
    answer: i64,
    answer_text: String,
}

impl Problem {
    fn sum(a: i64, b: i64) -> Self {
        Self {
            id: format!("sum-{a}-{b}"),
            messages: vec![Message::user(format!(
                "What is {a} + {b}? Reply with the number only."
            ))],
            answer: a + b,
            answer_text: (a + b).to_string(),
        }
    }
}

impl TaskPrompt for Problem {
    fn id(&self) -> &str {
        &self.id
    }

    fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The supervised warm-up trains on the bare number.
    fn reference_answer(&self) -> Option<&str> {
        Some(&self.answer_text)
    }
}

/// Reward 1 when the last integer in the response is the answer, else 0 (exact, so exact ties
/// are recognised as such).
#[derive(Default)]
pub struct ExactNumber {
    /// Responses scored so far.
    pub scored: AtomicUsize,
}

impl ExactNumber {
    fn last_integer(text: &str) -> Option<i64> {
        text.split(|c: char| !(c.is_ascii_digit() || c == '-'))
            .filter_map(|t| t.parse().ok())
            .next_back()
    }
}

#[async_trait]
impl RewardSource<Problem> for ExactNumber {
    async fn score_group(
        &self,
        prompt: &Problem,
        responses: &[String],
        _lengths: &[u32],
        _step: u64,
    ) -> GroupScores {
        self.scored.fetch_add(responses.len(), Ordering::Relaxed);
        let scores = responses
            .iter()
            .map(|r| {
                let right = Self::last_integer(r) == Some(prompt.answer);
                ResponseScore::exact(right as i64, 1)
            })
            .collect();
        GroupScores::direct(scores)
    }
}

/// The task: sums of small numbers, in a fixed order.
pub fn problems(n: usize) -> Vec<Problem> {
    (0..n as i64)
        .map(|i| Problem::sum(3 + i % 7, 11 + (i * 5) % 13))
        .collect()
}

/// The run config: `CONFIG`, stopping after `steps` steps, writing to `output_dir`.
pub fn config(steps: u64, output_dir: &Path) -> conrub_trainer::Result<TrainConfig> {
    let table: toml::Table = toml::from_str(CONFIG).expect("the example's config is TOML");
    // Relative paths in the config resolve against this file's folder.
    let anchor = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/verifiable_reward.toml");
    let mut cfg = TrainConfig::from_table(table, &anchor)?;
    cfg.run.max_steps = Some(steps);
    cfg.run.output_dir = output_dir.to_path_buf();
    Ok(cfg)
}

/// Trains `steps` steps into `output_dir`; returns the run's summary and how many responses the
/// reward scored.
pub fn train(steps: u64, output_dir: &Path) -> conrub_trainer::Result<(RunSummary, usize)> {
    let cfg = config(steps, output_dir)?;
    type B = burn::backend::Flex;
    let device = Default::default();
    let policy = load_policy::<B>(&cfg, &device)?;
    let reward = Arc::new(ExactNumber::default());
    let trainer = Trainer::new(cfg, vec![device], policy, problems(16), reward.clone())?;
    let summary = trainer.run()?;
    Ok((summary, reward.scored.load(Ordering::Relaxed)))
}

fn main() {
    let mut args = std::env::args().skip(1);
    let steps = args
        .next()
        .map_or(3, |s| s.parse().expect("STEPS is a number"));
    let out = args
        .next()
        .map_or_else(|| PathBuf::from("runs/verifiable-reward"), PathBuf::from);
    match train(steps, &out) {
        Ok((summary, scored)) => println!(
            "{} steps, {scored} responses scored; metrics in {}",
            summary.total_steps,
            out.join("metrics.jsonl").display()
        ),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
