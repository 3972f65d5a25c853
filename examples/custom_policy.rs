//! Embed the conrub GRPO learner in your own burn project: a user-defined model (a bigram table),
//! a user-defined task and reward, no judge and no tokenizer. (`examples/verifiable_reward.rs`
//! embeds the whole `conrub_trainer::Trainer` instead of driving the learner step by step.)
//!
//! `cargo run --release --example custom_policy`
//!
//! The reward is the fraction of even token ids in a response; GRPO raises it within a few steps.

use async_trait::async_trait;
use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use conrub_grpo::{
    Learner, LearnerConfig, OptimizerSettings, Policy, ResponseLogprobs, TextCodec, TieMode,
    TokenBatch,
};
use conrub_rewards::{GroupScores, RewardSource, TaskPrompt};
use conrub_rubric::{score_labels, Label, LengthPenalty, Message, ResponseScore, ScoringMode};

const VOCAB: usize = 16;

/// Next-token logits depend only on the previous token.
#[derive(Module, Debug)]
struct Bigram<B: Backend> {
    table: Param<Tensor<B, 2>>,
}

impl<B: Backend> Bigram<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            table: Param::from_tensor(Tensor::zeros([VOCAB, VOCAB], device)),
        }
    }
}

/// Two methods: log-probs of given responses, and next-token logits. Sampling (temperature, top-p,
/// top-k, seeded per-row streams, stop ids) comes from the trait's default.
impl<B: Backend> Policy<B> for Bigram<B> {
    fn response_logprobs(&self, batch: &TokenBatch<B>) -> ResponseLogprobs<B> {
        let [n, r] = batch.targets.dims();
        // The token before each response slot is the one at its predicting position.
        let prev = batch
            .tokens
            .clone()
            .gather(1, batch.positions.clone())
            .reshape([n * r]);
        let logp = log_softmax(self.table.val().select(0, prev), 1);
        let picked = logp
            .gather(1, batch.targets.clone().reshape([n * r, 1]))
            .reshape([n, r]);
        ResponseLogprobs {
            logprobs: picked * batch.mask.clone(),
            entropy: None,
        }
    }

    fn next_token_logits(&self, sequences: &[Vec<u32>], device: &B::Device) -> Tensor<B, 2> {
        let last: Vec<i64> = sequences
            .iter()
            .map(|s| *s.last().unwrap_or(&0) as i64)
            .collect();
        self.table.val().select(
            0,
            Tensor::<B, 1, Int>::from_data(TensorData::new(last, [sequences.len()]), device),
        )
    }
}

/// Prompts are one token; responses are shown as their ids.
struct Ids;

impl TextCodec for Ids {
    fn encode_prompt(&self, messages: &[Message]) -> conrub_contracts::Result<Vec<u32>> {
        Ok(vec![(messages[0].content.len() % VOCAB) as u32])
    }
    fn decode(&self, ids: &[u32]) -> conrub_contracts::Result<String> {
        Ok(ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "))
    }
}

/// The task's prompts: an id and the messages, nothing else.
struct Prompt {
    id: String,
    messages: Vec<Message>,
}

impl TaskPrompt for Prompt {
    fn id(&self) -> &str {
        &self.id
    }
    fn messages(&self) -> &[Message] {
        &self.messages
    }
}

/// One binary "criterion" per token: is it even?
struct EvenTokens;

#[async_trait]
impl RewardSource<Prompt> for EvenTokens {
    async fn score_group(
        &self,
        _prompt: &Prompt,
        responses: &[String],
        lengths: &[u32],
        _step: u64,
    ) -> GroupScores {
        let scores = responses
            .iter()
            .zip(lengths)
            .map(|(r, &len)| {
                let labels: Vec<Label> = r
                    .split(' ')
                    .map(|t| {
                        if t.parse::<u32>().unwrap_or(1) % 2 == 0 {
                            Label::Yes
                        } else {
                            Label::No
                        }
                    })
                    .collect();
                ResponseScore::Scored(
                    score_labels(
                        &labels,
                        labels.len(),
                        ScoringMode::Binary,
                        len,
                        &LengthPenalty::disabled(),
                    )
                    .unwrap(),
                )
            })
            .collect();
        GroupScores::direct(scores)
    }
}

fn main() {
    type B = Autodiff<Flex>;
    let device = Default::default();
    let cfg = LearnerConfig {
        group_size: 8,
        max_response_tokens: 10,
        tie_mode: TieMode::Off,
        optimizer: OptimizerSettings {
            lr: 0.2,
            weight_decay: 0.0,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut learner = Learner::<B, _, Prompt>::builder(Bigram::new(&device), cfg, device)
        .codec(Ids)
        .rewards(EvenTokens)
        .build()
        .expect("valid config");
    let prompts: Vec<Prompt> = (0..4)
        .map(|i| Prompt {
            id: format!("p{i}"),
            messages: vec![Message::user("x".repeat(i + 1))],
        })
        .collect();
    let refs: Vec<&Prompt> = prompts.iter().collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    for _ in 0..15 {
        let out = rt.block_on(learner.step(&refs)).expect("step");
        println!(
            "step {:2}  reward {:.3}",
            out.metrics.step + 1,
            out.metrics.reward_mean
        );
    }
}
