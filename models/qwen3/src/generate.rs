//! Teacher-forced scoring, and the dense-cache generator the rollout engine is checked against.

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use conrub_rollout::{
    check_sequences, sample_token, sequence_rng, ForwardBatch, Generation, PaddedBatch, Padding,
    SamplingConfig,
};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::cache::KvCache;
use crate::error::Result;
use crate::model::Qwen3ForCausalLM;

/// `[batch, vocab]` logits as row-major f32 on the host.
fn to_host<B: Backend>(logits: Tensor<B, 2>) -> Vec<f32> {
    logits
        .cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 logits")
}

/// The engine before `conrub_rollout`'s, kept as the reference it is tested and benchmarked
/// against: every prompt in one static batch, left padded with `pad_id` and prefilled together
/// (a group's shared prompt once per row), a dense KV cache per row that grows by doubling, and
/// `[rows, vocab]` logits copied to the host every step and sampled there. Finished sequences
/// are dropped from the batch and the cache.
pub fn generate_dense<B: conrub_kernels::GrpoOps>(
    model: &Qwen3ForCausalLM<B>,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    pad_id: u32,
    device: &B::Device,
) -> Result<Vec<Generation>> {
    cfg.validate()?;
    check_sequences(prompts, model.vocab_size(), "prompts")?;
    let mut out: Vec<Generation> = prompts.iter().map(|_| Generation::new()).collect();
    if prompts.is_empty() || cfg.max_new_tokens == 0 {
        return Ok(out);
    }
    let mut rngs: Vec<ChaCha8Rng> = (0..prompts.len())
        .map(|i| sequence_rng(cfg.seed, i))
        .collect();
    let padded = PaddedBatch::new(prompts, pad_id, Padding::Left);
    let mut cache = KvCache::new(model.num_layers());
    // Left padding puts every prompt's last token in the last column.
    let v = model.vocab_size();
    let mut host = to_host(model.forward_last(&padded.to_device(device), Some(&mut cache)));

    // Rows of the current batch, as indices into `prompts`.
    let mut active: Vec<usize> = (0..prompts.len()).collect();
    loop {
        let mut next = Vec::with_capacity(active.len());
        let mut still = Vec::with_capacity(active.len());
        for (row, &seq) in active.iter().enumerate() {
            let (tok, lp) = sample_token(&host[row * v..(row + 1) * v], cfg, &mut rngs[seq]);
            if out[seq].push(tok, lp, cfg) {
                still.push(row);
                next.push(tok);
            }
        }
        if still.is_empty() {
            break;
        }
        if still.len() != active.len() {
            cache.retain_rows(&still, device);
            active = still.iter().map(|&r| active[r]).collect();
        }
        let n = active.len();
        let ids: Vec<i64> = next.iter().map(|&t| t as i64).collect();
        let pos: Vec<i64> = active
            .iter()
            .map(|&s| (prompts[s].len() + out[s].tokens.len() - 1) as i64)
            .collect();
        let step = ForwardBatch {
            input_ids: Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, 1]), device),
            position_ids: Tensor::<B, 2, Int>::from_data(TensorData::new(pos, [n, 1]), device),
            key_mask: None,
        };
        host = to_host(model.forward_last(&step, Some(&mut cache)));
    }
    Ok(out)
}

/// Teacher-forced scores of one sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequenceScores {
    /// `log p(x[t+1] | x[..=t])` for `t = 0..T-1` (length `T - 1`).
    pub token_logprobs: Vec<f32>,
    /// Argmax of the logits at every position (length `T`).
    pub argmax: Vec<u32>,
}

/// Scores every sequence with one right-padded forward pass.
pub fn score_sequences<B: conrub_kernels::GrpoOps>(
    model: &Qwen3ForCausalLM<B>,
    seqs: &[Vec<u32>],
    pad_id: u32,
    device: &B::Device,
) -> Result<Vec<SequenceScores>> {
    if seqs.is_empty() {
        return Ok(Vec::new());
    }
    check_sequences(seqs, model.vocab_size(), "ids")?;
    let padded = PaddedBatch::new(seqs, pad_id, Padding::Right);
    let (b, t) = (padded.batch, padded.len);
    let logits = model
        .forward(&padded.to_device(device), None)
        .cast(DType::F32);
    let argmax: Vec<i64> = logits
        .clone()
        .argmax(2)
        .reshape([b * t])
        .into_data()
        .convert::<i64>()
        .into_vec()
        .expect("int data");
    let logp = log_softmax(logits, 2);
    let targets: Vec<i64> = (0..b)
        .flat_map(|r| (0..t).map(move |c| (r, c)))
        .map(|(r, c)| {
            if c + 1 < t {
                padded.ids[r * t + c + 1] as i64
            } else {
                0
            }
        })
        .collect();
    let idx = Tensor::<B, 3, Int>::from_data(TensorData::new(targets, [b, t, 1]), device);
    let gathered: Vec<f32> = logp
        .gather(2, idx)
        .reshape([b * t])
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 data");
    Ok((0..b)
        .map(|r| {
            let len = padded.lengths[r];
            SequenceScores {
                token_logprobs: gathered[r * t..r * t + len - 1].to_vec(),
                argmax: argmax[r * t..r * t + len]
                    .iter()
                    .map(|&x| x as u32)
                    .collect(),
            }
        })
        .collect())
}
