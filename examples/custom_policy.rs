//! Embed the conrub GRPO learner in your own burn project: a user-defined model (a bigram table),
//! a user-defined reward, no judge and no tokenizer.
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
use conrub_grpo::{GroupScores, Learner, LearnerConfig, NoTieBreaker, Policy, RewardSource, Sample, SampleSettings, TeacherForcing, TextCodec, TieMode};
use conrub_rubric::{score_labels, Label, LengthPenalty, Message, ResponseScore, RubricRecord, ScoringMode};
use rand::{Rng, SeedableRng};

const VOCAB: usize = 16;

/// Next-token logits depend only on the previous token.
#[derive(Module, Debug)]
struct Bigram<B: Backend> {
    table: Param<Tensor<B, 2>>,
}

impl<B: Backend> Bigram<B> {
    fn new(device: &B::Device) -> Self {
        Self { table: Param::from_tensor(Tensor::zeros([VOCAB, VOCAB], device)) }
    }
}

impl<B: Backend> Policy<B> for Bigram<B> {
    fn response_logprobs(&self, tf: &TeacherForcing, device: &B::Device) -> Tensor<B, 2> {
        let (n, r) = (tf.rows, tf.response_len);
        // The token before each response slot is the one at its predicting position.
        let prev: Vec<i64> = (0..n * r).map(|k| tf.sequences[k / r].get(tf.positions[k] as usize).copied().unwrap_or(0) as i64).collect();
        let prev = Tensor::<B, 1, Int>::from_data(TensorData::new(prev, [n * r]), device);
        let logp = log_softmax(self.table.val().select(0, prev), 1);
        let targets = Tensor::<B, 2, Int>::from_data(TensorData::new(tf.targets.clone(), [n * r, 1]), device);
        let mask = Tensor::<B, 2>::from_data(TensorData::new(tf.mask.clone(), [n, r]), device);
        logp.gather(1, targets).reshape([n, r]) * mask
    }

    fn sample(&self, prompts: &[Vec<u32>], s: &SampleSettings, _device: &B::Device) -> Result<Vec<Sample>, String> {
        let table: Vec<f32> = self.table.val().into_data().convert::<f32>().into_vec().map_err(|e| format!("{e:?}"))?;
        Ok(prompts
            .iter()
            .enumerate()
            .map(|(row, p)| {
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(s.seed ^ (row as u64).wrapping_mul(0x9e37_79b9));
                let (mut prev, mut tokens, mut logprobs) = (*p.last().unwrap_or(&0) as usize, Vec::new(), Vec::new());
                for _ in 0..s.max_new_tokens {
                    let logits = &table[prev * VOCAB..(prev + 1) * VOCAB];
                    let m = logits.iter().cloned().fold(f32::MIN, f32::max);
                    let z: f32 = logits.iter().map(|l| (l - m).exp()).sum();
                    let mut u = rng.random::<f32>() * z;
                    let mut next = VOCAB - 1;
                    for (i, l) in logits.iter().enumerate() {
                        u -= (l - m).exp();
                        if u <= 0.0 {
                            next = i;
                            break;
                        }
                    }
                    logprobs.push(logits[next] - m - z.ln());
                    tokens.push(next as u32);
                    prev = next;
                }
                Sample { tokens, logprobs, truncated: true }
            })
            .collect())
    }
}

/// Prompts are one token; responses are shown as their ids.
struct Ids;

impl TextCodec for Ids {
    fn encode_prompt(&self, messages: &[Message]) -> Result<Vec<u32>, String> {
        Ok(vec![(messages[0].content.len() % VOCAB) as u32])
    }
    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        Ok(ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "))
    }
}

/// One binary "criterion" per token: is it even?
struct EvenTokens;

#[async_trait]
impl RewardSource for EvenTokens {
    async fn score_group(&self, _record: &RubricRecord, responses: &[String], lengths: &[u32], _step: u64) -> GroupScores {
        let scores = responses
            .iter()
            .zip(lengths)
            .map(|(r, &len)| {
                let labels: Vec<Label> = r.split(' ').map(|t| if t.parse::<u32>().unwrap_or(1) % 2 == 0 { Label::Yes } else { Label::No }).collect();
                ResponseScore::Scored(score_labels(&labels, labels.len(), ScoringMode::Binary, len, &LengthPenalty::disabled()).unwrap())
            })
            .collect();
        GroupScores { scores, criteria: vec![], judge_retries: 0, judge_latency_ms: 0.0 }
    }
}

fn main() {
    type B = Autodiff<Flex>;
    let device = Default::default();
    let cfg = LearnerConfig { group_size: 8, max_response_tokens: 10, lr: 0.2, weight_decay: 0.0, tie_mode: TieMode::Off, ..Default::default() };
    let mut learner = Learner::<B, _>::new(Bigram::new(&device), cfg, device).expect("valid config");
    let records: Vec<RubricRecord> = (0..4)
        .map(|i| RubricRecord {
            id: format!("p{i}"),
            question: vec![Message::user("x".repeat(i + 1))],
            reference_answer: None,
            source: None,
            criteria: vec![],
            provenance: None,
        })
        .collect();
    let refs: Vec<&RubricRecord> = records.iter().collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    for _ in 0..15 {
        let out = rt.block_on(learner.step(&refs, &Ids, &EvenTokens, &NoTieBreaker, &[])).expect("step");
        println!("step {:2}  reward {:.3}", out.metrics.step + 1, out.metrics.reward_mean);
    }
}
