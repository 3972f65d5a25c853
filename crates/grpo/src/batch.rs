//! The data of one step: the host-side [`RolloutBatch`] that rollout produces, and the
//! device-resident [`TrainBatch`] built from it once per step, from which every micro-batch of every
//! PPO epoch is sliced on the device.

use std::ops::Range;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use conrub_rollout::{bucket_len, FinishReason, Generation, RolloutStats};

/// The responses of one rollout, `group_size` per prompt, in prompt-major order (row `r` answers
/// prompt `r / group_size`).
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutBatch {
    /// Responses per prompt (k).
    pub group_size: usize,
    /// Prompt ids, one per group (chat-templated, non-empty).
    pub prompts: Vec<Vec<u32>>,
    /// Response ids per row (the stop token included when one was sampled).
    pub responses: Vec<Vec<u32>>,
    /// Per row: the log-probability of each response token under the distribution it was drawn
    /// from (the engine's; the learner recomputes its own for the loss).
    pub logprobs: Vec<Vec<f32>>,
    /// Per row: why the response ended.
    pub finish_reasons: Vec<FinishReason>,
    /// What the engine did (fields an engine does not measure stay 0).
    pub telemetry: RolloutStats,
}

impl RolloutBatch {
    /// An empty batch for `prompts`, `group_size` rows each.
    pub fn new(group_size: usize, prompts: Vec<Vec<u32>>) -> Self {
        Self {
            group_size,
            prompts,
            responses: Vec::new(),
            logprobs: Vec::new(),
            finish_reasons: Vec::new(),
            telemetry: RolloutStats::default(),
        }
    }

    /// Appends the next row.
    pub fn push(&mut self, generation: Generation) {
        self.responses.push(generation.tokens);
        self.logprobs.push(generation.logprobs);
        self.finish_reasons.push(generation.finish_reason);
    }

    /// Appends the groups of `other` (the next rank's, in a data-parallel step) and merges its
    /// telemetry.
    pub fn append(&mut self, other: RolloutBatch) {
        debug_assert_eq!(self.group_size, other.group_size);
        self.prompts.extend(other.prompts);
        self.responses.extend(other.responses);
        self.logprobs.extend(other.logprobs);
        self.finish_reasons.extend(other.finish_reasons);
        self.telemetry.merge(&other.telemetry);
    }

    /// Per row: the response hit the length limit without a stop token.
    pub fn truncated(&self) -> impl Iterator<Item = bool> + '_ {
        self.finish_reasons
            .iter()
            .map(|f| *f == FinishReason::Length)
    }

    /// Checks that the batch answers `prompts` prompts with `group_size` rows each, every row
    /// with a log-probability per token and a finish reason.
    pub fn check_shape(&self, prompts: usize, group_size: usize) -> crate::error::Result<()> {
        let rows = prompts * group_size;
        let per_token = self
            .responses
            .iter()
            .zip(&self.logprobs)
            .all(|(r, l)| r.len() == l.len());
        if self.group_size == group_size
            && self.prompts.len() == prompts
            && self.rows() == rows
            && self.logprobs.len() == rows
            && self.finish_reasons.len() == rows
            && per_token
        {
            return Ok(());
        }
        Err(crate::error::GrpoError::Stage(format!(
            "rollout returned {} prompts x {} rows (group size {}, {} log-prob rows{}, {} finish reasons) for {prompts} prompts x {group_size}",
            self.prompts.len(),
            self.rows(),
            self.group_size,
            self.logprobs.len(),
            if per_token { "" } else { ", some not one per token" },
            self.finish_reasons.len(),
        )))
    }
    /// Number of responses.
    pub fn rows(&self) -> usize {
        self.responses.len()
    }

    /// The prompt of `row`.
    pub fn prompt(&self, row: usize) -> &[u32] {
        &self.prompts[row / self.group_size]
    }

    /// Response lengths in tokens.
    pub fn lengths(&self) -> Vec<u32> {
        self.responses.iter().map(|r| r.len() as u32).collect()
    }
}

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
        Self::padded(rows, |w| w, device)
    }

    /// [`TokenBatch::new`] with both widths rounded up to their length bucket
    /// ([`conrub_rollout::bucket_len`]; the learner's train batch: its micro-batches are slices
    /// of it at bucketed widths). Padding is on the right, hidden from real tokens by the causal
    /// mask and from the loss by the response mask.
    pub fn bucketed<'a>(
        rows: impl IntoIterator<Item = (&'a [u32], &'a [u32])>,
        device: &B::Device,
    ) -> Self {
        Self::padded(rows, bucket_len, device)
    }

    /// The rows padded to `width(longest)` columns (S and R alike; at least the longest).
    fn padded<'a>(
        rows: impl IntoIterator<Item = (&'a [u32], &'a [u32])>,
        width: impl Fn(usize) -> usize,
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
        let (s, r_len) = (
            width(longest_s).max(longest_s),
            width(longest_r).max(longest_r),
        );
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

/// Everything the update needs, on the device, built once per step.
///
/// # Shapes
/// - `tokens`: see [`TokenBatch`] (`[rows, S]`, `[rows, R]`).
/// - `logp_old`, `logp_ref`: `[rows, R]`, 0 on padding slots.
/// - `advantages`: `[rows]`, one sequence-level advantage per response.
#[derive(Debug, Clone)]
pub struct TrainBatch<B: Backend> {
    /// Teacher-forcing inputs.
    pub tokens: TokenBatch<B>,
    /// Log-probabilities under the policy that sampled the responses.
    pub logp_old: Tensor<B, 2>,
    /// Log-probabilities under the frozen reference (only with a KL term).
    pub logp_ref: Option<Tensor<B, 2>>,
    /// The rollout engine's log-probabilities of the sampled tokens (only with `tis_cap`).
    pub logp_engine: Option<Tensor<B, 2>>,
    /// Sequence advantages.
    pub advantages: Tensor<B, 1>,
    /// Per row: `prompt ++ response` length (host copy, for planning micro-batches).
    pub seq_lens: Vec<usize>,
    /// Per row: response length (host copy).
    pub response_lens: Vec<usize>,
    /// `learner.micro_batch_tokens`: a micro-batch's padded width never takes it past this
    /// (see [`padded_width`]).
    pub micro_batch_tokens: usize,
}

impl<B: Backend> TrainBatch<B> {
    /// The token and response widths a micro-batch of `rows` is cut to: [`padded_width`] of its
    /// longest rows, never wider than the batch.
    pub fn widths(&self, rows: impl IntoIterator<Item = usize> + Clone) -> (usize, usize) {
        micro_batch_widths(
            (&self.seq_lens, &self.response_lens),
            rows,
            self.micro_batch_tokens,
            (self.tokens.tokens.dims()[1], self.tokens.mask.dims()[1]),
        )
    }

    /// Rows `rows` as a smaller batch, padding cut to the bucket of the longest row inside it.
    pub fn slice(&self, rows: Range<usize>) -> Self {
        let (seq_len, response_len) = self.widths(rows.clone());
        Self {
            tokens: self.tokens.slice(rows.clone(), seq_len, response_len),
            logp_old: self.logp_old.clone().slice([rows.clone(), 0..response_len]),
            logp_ref: self
                .logp_ref
                .as_ref()
                .map(|t| t.clone().slice([rows.clone(), 0..response_len])),
            logp_engine: self
                .logp_engine
                .as_ref()
                .map(|t| t.clone().slice([rows.clone(), 0..response_len])),
            advantages: self.advantages.clone().slice([rows.clone()]),
            seq_lens: self.seq_lens[rows.clone()].to_vec(),
            response_lens: self.response_lens[rows].to_vec(),
            micro_batch_tokens: self.micro_batch_tokens,
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.seq_lens.len()
    }

    /// Real response tokens in the batch.
    pub fn response_tokens(&self) -> usize {
        self.response_lens.iter().sum()
    }
}

/// The longest of `lens` over `rows` (at least 1).
pub(crate) fn longest(lens: &[usize], rows: impl IntoIterator<Item = usize>) -> usize {
    rows.into_iter().map(|r| lens[r]).max().unwrap_or(1).max(1)
}

/// The width a micro-batch of `rows` rows whose longest row is `longest` tokens is padded to:
/// its length bucket (`conrub_rollout::bucket_len`), but never past `max(longest, budget / rows)`, so a micro-batch
/// that [`plan_micro_batches`] fits in `budget` padded tokens still fits after bucketing (the
/// memory plan counts on it). Where that cap binds, the width is `budget / rows`: one more
/// shape per row count.
pub fn padded_width(longest: usize, rows: usize, budget: usize) -> usize {
    bucket_len(longest).min((budget / rows.max(1)).max(longest))
}

/// A micro-batch's `(tokens, responses)` widths: [`padded_width`] of its longest sequence, the
/// bucket of its longest response, neither past the full batch's `full` widths.
pub(crate) fn micro_batch_widths(
    (seq_lens, response_lens): (&[usize], &[usize]),
    rows: impl IntoIterator<Item = usize> + Clone,
    budget: usize,
    full: (usize, usize),
) -> (usize, usize) {
    let count = rows.clone().into_iter().count();
    let s = longest(seq_lens, rows.clone());
    let r = longest(response_lens, rows);
    (
        padded_width(s, count, budget).min(full.0).max(s),
        bucket_len(r).min(full.1).max(r),
    )
}

/// Splits `rows` into consecutive micro-batches whose padded size (rows x longest
/// `prompt ++ response`) stays within `token_budget`; a micro-batch has at least one row.
///
/// A micro-batch never holds rows of two groups (rows `g * group_size ..`): data-parallel ranks
/// own whole groups, so every rank's micro-batches are exactly one device's, padded alike, and
/// the ranks' forward passes equal one device's bit for bit. The cost is at most one partly
/// filled micro-batch per group.
pub fn plan_micro_batches(
    seq_lens: &[usize],
    rows: Range<usize>,
    token_budget: usize,
    group_size: usize,
) -> Vec<Range<usize>> {
    let group_size = group_size.max(1);
    let mut out = Vec::new();
    let (mut start, mut longest) = (rows.start, 0usize);
    for r in rows.clone() {
        let joined = longest.max(seq_lens[r]);
        let new_group = r % group_size == 0;
        if r > start && (new_group || joined * (r - start + 1) > token_budget) {
            out.push(start..r);
            start = r;
            longest = seq_lens[r];
        } else {
            longest = joined;
        }
    }
    if start < rows.end {
        out.push(start..rows.end);
    }
    out
}

/// Pads `[rows, r]` with zero columns to `[rows, width]`.
pub(crate) fn pad_columns<B: Backend>(t: Tensor<B, 2>, width: usize) -> Tensor<B, 2> {
    let [rows, r] = t.dims();
    if r >= width {
        return t;
    }
    let zeros = Tensor::zeros([rows, width - r], &t.device());
    Tensor::cat(vec![t, zeros], 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn layout_and_slices_agree_with_the_rows() {
        let dev = Default::default();
        let prompts: [&[u32]; 3] = [&[11, 42, 7], &[5, 9], &[3]];
        let responses: [&[u32]; 3] = [&[199, 3], &[12, 13, 14, 15], &[]];
        let b =
            TokenBatch::<Flex>::new(prompts.iter().copied().zip(responses.iter().copied()), &dev);
        assert_eq!(b.tokens.dims(), [3, 6]);
        assert_eq!(b.positions.dims(), [3, 4]);
        let pos: Vec<i64> = b
            .positions
            .clone()
            .into_data()
            .convert::<i64>()
            .into_vec()
            .unwrap();
        assert_eq!(pos, vec![2, 3, 0, 0, 1, 2, 3, 4, 0, 0, 0, 0]);
        let s = b.slice(0..1, 5, 2);
        let toks: Vec<i64> = s.tokens.into_data().convert::<i64>().into_vec().unwrap();
        assert_eq!(toks, vec![11, 42, 7, 199, 3]);
        let mask: Vec<f32> = b.mask.into_data().convert::<f32>().into_vec().unwrap();
        assert_eq!(mask.iter().sum::<f32>(), 6.0);
    }

    #[test]
    fn micro_batches_respect_the_padded_budget() {
        let lens = [10, 10, 30, 5, 5, 5, 5];
        assert_eq!(
            plan_micro_batches(&lens, 0..7, 30, 7),
            vec![0..2, 2..3, 3..7]
        );
        assert_eq!(plan_micro_batches(&lens, 3..7, 10, 7), vec![3..5, 5..7]);
        // A row longer than the budget still forms its own micro-batch.
        assert_eq!(plan_micro_batches(&lens, 1..3, 4, 7), vec![1..2, 2..3]);
        assert!(plan_micro_batches(&lens, 2..2, 4, 7).is_empty());
    }

    #[test]
    fn the_token_budget_caps_the_width() {
        // The memory plan's rows x width: a bucket never takes a micro-batch past its budget.
        assert_eq!(padded_width(17, 4, 1000), 18);
        assert_eq!(padded_width(2049, 2, 4400), 2200);
        assert_eq!(padded_width(5000, 1, 4000), 5000);
    }

    #[test]
    fn bucketed_batches_pad_right_and_slices_take_their_buckets() {
        let dev = Default::default();
        let prompts: [&[u32]; 2] = [&[11; 12], &[5; 3]];
        let responses: [&[u32]; 2] = [&[7; 9], &[8; 2]];
        let b = TokenBatch::<Flex>::bucketed(
            prompts.iter().copied().zip(responses.iter().copied()),
            &dev,
        );
        assert_eq!(b.tokens.dims(), [2, 22]);
        assert_eq!(b.positions.dims(), [2, 16]);
        let mask: Vec<f32> = b.mask.into_data().convert::<f32>().into_vec().unwrap();
        assert_eq!(mask.iter().sum::<f32>(), 11.0);
        let widths = |rows: std::ops::Range<usize>| {
            micro_batch_widths((&[21, 5], &[9, 2]), rows, 1000, (22, 16))
        };
        assert_eq!(widths(0..2), (22, 16));
        assert_eq!(widths(1..2), (16, 16));
    }

    #[test]
    fn micro_batches_stay_inside_their_group() {
        let lens = [5; 9];
        // Groups of 3 (rows 0-2, 3-5, 6-8); the budget alone would take 4 rows.
        assert_eq!(
            plan_micro_batches(&lens, 0..9, 20, 3),
            vec![0..3, 3..6, 6..9]
        );
        // A range starting inside a group, and a budget of 2 rows.
        assert_eq!(
            plan_micro_batches(&lens, 1..8, 10, 3),
            vec![1..3, 3..5, 5..6, 6..8]
        );
    }
}
