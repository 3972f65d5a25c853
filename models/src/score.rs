//! Teacher-forced scoring: log-probabilities and argmax of given sequences.

use burn::tensor::activation::log_softmax;
use burn::tensor::{DType, Int, Tensor, TensorData};
use conrub_contracts::{check_sequences, PaddedBatch, Padding};
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::model::CausalLm;

/// Teacher-forced scores of one sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequenceScores {
    /// `log p(x[t+1] | x[..=t])` for `t = 0..T-1` (length `T - 1`).
    pub token_logprobs: Vec<f32>,
    /// Argmax of the logits at every position (length `T`).
    pub argmax: Vec<u32>,
}

/// Scores every sequence with one right-padded forward pass.
pub fn score_sequences<B: conrub_kernels::KernelOps>(
    model: &CausalLm<B>,
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
    let logits = model.forward(&padded.to_device(device)).cast(DType::F32);
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
