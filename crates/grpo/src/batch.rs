//! The data of one step: the host-side [`RolloutBatch`](conrub_contracts::RolloutBatch) that rollout produces, and the
//! device-resident [`TrainBatch`] built from it once per step, from which every micro-batch of every
//! PPO epoch is sliced on the device.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use conrub_contracts::{bucket_len, padded_width, TokenBatch};

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
    /// Per row: whether the loss counts it (false: a response cut at the length limit under
    /// `learner.mask_truncated`).
    pub loss_rows: Vec<bool>,
}

/// `mask` with the rows `keep` says false zeroed (`learner.mask_truncated`: those responses
/// add no gradient and no tokens to a token mean).
///
/// # Shapes
/// `mask`: `[rows, R]`, `keep`: `rows` long.
pub fn mask_rows<B: Backend>(mask: Tensor<B, 2>, keep: &[bool]) -> Tensor<B, 2> {
    if keep.iter().all(|&k| k) {
        return mask;
    }
    let [n, r] = mask.dims();
    let rows: Vec<f32> = keep.iter().map(|&k| k as u8 as f32).collect();
    let rows = Tensor::<B, 1>::from_data(TensorData::new(rows, [n]), &mask.device());
    let dtype = mask.dtype();
    mask * rows.reshape([n, 1]).expand([n, r]).cast(dtype)
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
            response_lens: self.response_lens[rows.clone()].to_vec(),
            micro_batch_tokens: self.micro_batch_tokens,
            loss_rows: self.loss_rows[rows].to_vec(),
        }
    }

    /// The response mask of the rows the loss counts ([`mask_rows`]).
    pub fn loss_mask(&self) -> Tensor<B, 2> {
        mask_rows(self.tokens.mask.clone(), &self.loss_rows)
    }

    /// Response tokens of the rows the loss counts.
    pub fn loss_tokens(&self) -> usize {
        self.response_lens
            .iter()
            .zip(&self.loss_rows)
            .filter(|(_, &k)| k)
            .map(|(l, _)| l)
            .sum()
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

/// Row ids as a device index.
pub(crate) fn row_index<B: Backend>(rows: &[usize], device: &B::Device) -> Tensor<B, 1, Int> {
    let ids: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    Tensor::from_data(TensorData::new(ids, [rows.len()]), device)
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

    /// The kernel warm-up walks one micro-batch shape per class (`ShapeBounds::micro_batches`):
    /// every micro-batch the planner cuts from random steps falls in a walked class.
    #[test]
    fn the_warm_up_walks_every_class_of_micro_batch_the_planner_cuts() {
        use conrub_contracts::{dim_class, ShapeBounds};
        let bounds = ShapeBounds {
            group_size: 6,
            micro_batch_tokens: 300,
            prompt_tokens: (5, 70),
            max_response_tokens: 90,
        };
        // A micro-batch's class: its dimensions' and the divisibility its slices keep of the
        // step layout's widths (their strides).
        let stride =
            |w: usize, parent: usize| w.trailing_zeros().min(parent.trailing_zeros()).min(4);
        let key = |rows: usize, (w, r): (usize, usize), (sw, sr): (usize, usize)| {
            (
                [rows, w, r, rows * w, rows * r].map(dim_class),
                stride(w, sw),
                stride(r, sr),
            )
        };
        let walked: std::collections::BTreeSet<_> = bounds
            .micro_batches()
            .iter()
            .map(|m| {
                key(
                    m.rows,
                    (m.width, m.responses),
                    (m.step_width, m.step_responses),
                )
            })
            .collect();
        // xorshift64: a uniform draw from `lo..=hi`.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut draw = |lo: usize, hi: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            lo + (state % (hi - lo + 1) as u64) as usize
        };
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..3000 {
            let groups = draw(1, 3);
            let (mut seq, mut resp) = (Vec::new(), Vec::new());
            for _ in 0..groups {
                let prompt = draw(5, 70);
                let long = draw(0, 9) < 3;
                for _ in 0..6 {
                    let r = if long { draw(60, 90) } else { draw(0, 90) };
                    seq.push(prompt + r);
                    resp.push(r);
                }
            }
            let full = (
                bucket_len(*seq.iter().max().unwrap()),
                bucket_len(*resp.iter().max().unwrap().max(&1)),
            );
            for m in plan_micro_batches(&seq, 0..seq.len(), 300, 6) {
                let (w, r) = micro_batch_widths((&seq, &resp), m.clone(), 300, full);
                let k = key(m.len(), (w, r), full);
                assert!(
                    walked.contains(&k),
                    "rows {m:?} cut to ({w}, {r}) is not walked"
                );
                seen.insert(k);
            }
        }
        assert!(
            seen.len() > 20,
            "the random steps met {} classes",
            seen.len()
        );
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
