//! The teacher-forcing batch a [`Policy`](crate::Policy) scores: prompts and responses on the
//! device, with the position that predicts each response token.

use std::ops::Range;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};

use crate::shapes::bucket_len;

/// Teacher-forcing inputs on the device: `prompt ++ response` right-padded with id 0, and for each
/// response slot the position that predicts it.
///
/// # Shapes
/// - `tokens`: `[rows, S]`, `S` the longest `prompt ++ response`.
/// - `positions`, `targets`: `[rows, R]`, `R` the longest response (at least 1); response token
///   `j` of row `i` is `targets[i, j]`, predicted at position `positions[i, j] = prompt_len(i) - 1 + j`
///   (0 on padding slots).
/// - `mask`: `[rows, R]`, 1 for real response tokens.
#[derive(Debug, Clone)]
pub struct TokenBatch<B: Backend> {
    /// Token ids `[rows, S]`.
    pub tokens: Tensor<B, 2, Int>,
    /// Predicting positions `[rows, R]`.
    pub positions: Tensor<B, 2, Int>,
    /// Target ids `[rows, R]`.
    pub targets: Tensor<B, 2, Int>,
    /// Response mask `[rows, R]`.
    pub mask: Tensor<B, 2>,
}

impl<B: Backend> TokenBatch<B> {
    /// Uploads `(prompt, response)` rows (four transfers), padded to the longest of each.
    /// Every prompt must be non-empty.
    pub fn new<'a>(
        rows: impl IntoIterator<Item = (&'a [u32], &'a [u32])>,
        device: &B::Device,
    ) -> Self {
        Self::padded(rows, |s, r| (s, r), device)
    }

    /// [`TokenBatch::new`] with both widths rounded up to their length bucket
    /// ([`bucket_len`]; the learner's train batch: its micro-batches are slices
    /// of it at bucketed widths). Padding is on the right, hidden from real tokens by the causal
    /// mask and from the loss by the response mask.
    pub fn bucketed<'a>(
        rows: impl IntoIterator<Item = (&'a [u32], &'a [u32])>,
        device: &B::Device,
    ) -> Self {
        Self::padded(rows, |s, r| (bucket_len(s), bucket_len(r)), device)
    }

    /// [`TokenBatch::new`] padded to at least `(S, R)` columns: a layout whose widths another,
    /// longer batch would have (the kernel warm-up's made-up rows cut as a real step's are).
    pub fn padded_to<'a>(
        rows: impl IntoIterator<Item = (&'a [u32], &'a [u32])>,
        (s, r): (usize, usize),
        device: &B::Device,
    ) -> Self {
        Self::padded(rows, |ls, lr| (s.max(ls), r.max(lr)), device)
    }

    /// The rows padded to `widths(longest sequence, longest response)` columns (at least the
    /// longest).
    fn padded<'a>(
        rows: impl IntoIterator<Item = (&'a [u32], &'a [u32])>,
        widths: impl Fn(usize, usize) -> (usize, usize),
        device: &B::Device,
    ) -> Self {
        let rows: Vec<(&[u32], &[u32])> = rows.into_iter().collect();
        let n = rows.len();
        let longest_s = rows
            .iter()
            .map(|(p, r)| p.len() + r.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let longest_r = rows.iter().map(|(_, r)| r.len()).max().unwrap_or(0).max(1);
        let (s, r_len) = widths(longest_s, longest_r);
        let (s, r_len) = (s.max(longest_s), r_len.max(longest_r));
        let mut tokens = vec![0i64; n * s];
        let mut positions = vec![0i64; n * r_len];
        let mut targets = vec![0i64; n * r_len];
        let mut mask = vec![0f32; n * r_len];
        for (i, (p, r)) in rows.iter().enumerate() {
            assert!(!p.is_empty(), "row {i}: empty prompt");
            for (j, &t) in p.iter().chain(r.iter()).enumerate() {
                tokens[i * s + j] = t as i64;
            }
            for (j, &t) in r.iter().enumerate() {
                positions[i * r_len + j] = (p.len() - 1 + j) as i64;
                targets[i * r_len + j] = t as i64;
                mask[i * r_len + j] = 1.0;
            }
        }
        Self {
            tokens: Tensor::from_data(TensorData::new(tokens, [n, s]), device),
            positions: Tensor::from_data(TensorData::new(positions, [n, r_len]), device),
            targets: Tensor::from_data(TensorData::new(targets, [n, r_len]), device),
            mask: Tensor::from_data(TensorData::new(mask, [n, r_len]), device),
        }
    }

    /// Rows `rows`, cut to `seq_len` token columns and `response_len` response slots (a view on
    /// the device; nothing is copied from the host).
    pub fn slice(&self, rows: Range<usize>, seq_len: usize, response_len: usize) -> Self {
        Self {
            tokens: self.tokens.clone().slice([rows.clone(), 0..seq_len]),
            positions: self
                .positions
                .clone()
                .slice([rows.clone(), 0..response_len]),
            targets: self.targets.clone().slice([rows.clone(), 0..response_len]),
            mask: self.mask.clone().slice([rows, 0..response_len]),
        }
    }

    /// The rows at `index`, in that order.
    ///
    /// # Shapes
    /// `index` is `[m]`; every tensor keeps its width and gets `m` rows.
    pub fn select(&self, index: Tensor<B, 1, Int>) -> Self {
        Self {
            tokens: self.tokens.clone().select(0, index.clone()),
            positions: self.positions.clone().select(0, index.clone()),
            targets: self.targets.clone().select(0, index.clone()),
            mask: self.mask.clone().select(0, index),
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.mask.dims()[0]
    }
}

impl<B: AutodiffBackend> TokenBatch<B> {
    /// The same tensors on the inner backend (no copy, no tape).
    pub fn inner(&self) -> TokenBatch<B::InnerBackend> {
        TokenBatch {
            tokens: self.tokens.clone().inner(),
            positions: self.positions.clone().inner(),
            targets: self.targets.clone().inner(),
            mask: self.mask.clone().inner(),
        }
    }
}
