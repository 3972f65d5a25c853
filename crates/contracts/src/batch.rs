//! Token batches: padded host-side construction and the device tensors a forward pass consumes
//! (the model crates and the engine share them).

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor, TensorData};

/// Which side of a shorter sequence receives the padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Padding {
    /// Pad before the tokens (what generation uses, so every sequence ends at the last column).
    Left,
    /// Pad after the tokens (convenient for teacher-forced scoring).
    Right,
}

/// A padded batch of token sequences on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct PaddedBatch {
    /// Row-major `[batch, len]` token ids (padding filled with `pad_id`).
    pub ids: Vec<u32>,
    /// Row-major `[batch, len]` validity: `true` for real tokens.
    pub mask: Vec<bool>,
    /// Row-major `[batch, len]` position ids: index among the row's real tokens (0 on padding).
    pub positions: Vec<i64>,
    /// Number of rows.
    pub batch: usize,
    /// Padded length.
    pub len: usize,
    /// Real length of each row.
    pub lengths: Vec<usize>,
    /// Side of the padding.
    pub padding: Padding,
}

impl PaddedBatch {
    /// Pads `seqs` to a common length.
    pub fn new(seqs: &[Vec<u32>], pad_id: u32, padding: Padding) -> Self {
        Self::to_len(seqs, pad_id, padding, 0)
    }

    /// Pads `seqs` to `len` columns, or to the longest of them where that is longer (the rollout
    /// engine's prefill pads to a length bucket, [`crate::bucket_len`]).
    pub fn to_len(seqs: &[Vec<u32>], pad_id: u32, padding: Padding, len: usize) -> Self {
        let len = seqs.iter().map(Vec::len).max().unwrap_or(0).max(len);
        let batch = seqs.len();
        let mut ids = Vec::with_capacity(batch * len);
        let mut mask = Vec::with_capacity(batch * len);
        let mut positions = Vec::with_capacity(batch * len);
        for seq in seqs {
            let pad = len - seq.len();
            let (before, after) = match padding {
                Padding::Left => (pad, 0),
                Padding::Right => (0, pad),
            };
            ids.extend(std::iter::repeat_n(pad_id, before));
            mask.extend(std::iter::repeat_n(false, before));
            positions.extend(std::iter::repeat_n(0, before));
            ids.extend_from_slice(seq);
            mask.extend(std::iter::repeat_n(true, seq.len()));
            positions.extend(0..seq.len() as i64);
            ids.extend(std::iter::repeat_n(pad_id, after));
            mask.extend(std::iter::repeat_n(false, after));
            positions.extend(std::iter::repeat_n(0, after));
        }
        Self {
            ids,
            mask,
            positions,
            batch,
            len,
            lengths: seqs.iter().map(Vec::len).collect(),
            padding,
        }
    }

    /// Whether any row is padded.
    pub fn has_padding(&self) -> bool {
        self.lengths.iter().any(|&l| l != self.len)
    }

    /// The device tensors of this batch (as the first chunk of a sequence: positions start at 0).
    pub fn to_device<B: Backend>(&self, device: &B::Device) -> ForwardBatch<B> {
        let shape = [self.batch, self.len];
        let ids: Vec<i64> = self.ids.iter().map(|&i| i as i64).collect();
        ForwardBatch {
            input_ids: Tensor::from_data(TensorData::new(ids, shape), device),
            position_ids: Tensor::from_data(TensorData::new(self.positions.clone(), shape), device),
            key_mask: self
                .has_padding()
                .then(|| Tensor::from_data(TensorData::new(self.mask.clone(), shape), device)),
        }
    }
}

/// The device inputs of one forward pass over new tokens.
#[derive(Debug, Clone)]
pub struct ForwardBatch<B: Backend> {
    /// Token ids `[batch, new]`.
    pub input_ids: Tensor<B, 2, Int>,
    /// Position ids `[batch, new]` (RoPE positions; skip padding).
    pub position_ids: Tensor<B, 2, Int>,
    /// Validity of the new tokens `[batch, new]`; `None` means all are real.
    pub key_mask: Option<Tensor<B, 2, Bool>>,
}

impl<B: Backend> ForwardBatch<B> {
    /// An unpadded batch whose positions continue from `start`.
    pub fn contiguous(ids: &[Vec<u32>], start: usize, device: &B::Device) -> Self {
        let b = ids.len();
        let t = ids.first().map(Vec::len).unwrap_or(0);
        let flat: Vec<i64> = ids.iter().flatten().map(|&i| i as i64).collect();
        let pos: Vec<i64> = (0..b)
            .flat_map(|_| (start..start + t).map(|p| p as i64))
            .collect();
        Self {
            input_ids: Tensor::from_data(TensorData::new(flat, [b, t]), device),
            position_ids: Tensor::from_data(TensorData::new(pos, [b, t]), device),
            key_mask: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn left_padding_positions_skip_pads() {
        let b = PaddedBatch::new(&[vec![5, 6, 7], vec![8]], 0, Padding::Left);
        assert_eq!(b.ids, vec![5, 6, 7, 0, 0, 8]);
        assert_eq!(b.mask, vec![true, true, true, false, false, true]);
        assert_eq!(b.positions, vec![0, 1, 2, 0, 0, 0]);
        assert!(b.has_padding());
    }

    #[test]
    fn right_padding() {
        let b = PaddedBatch::new(&[vec![1], vec![2, 3]], 9, Padding::Right);
        assert_eq!(b.ids, vec![1, 9, 2, 3]);
        assert_eq!(b.positions, vec![0, 0, 0, 1]);
        assert_eq!(b.lengths, vec![1, 2]);
    }
}
