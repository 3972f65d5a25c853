//! Token sampling from logits: one rule ([`sample_row`], what `conrub_models::sample_token`
//! applies on the host), and [`crate::DecodeOps::sample_rows`], which applies it to a `[rows, vocab]`
//! tensor where the logits are and returns only token ids and log-probabilities: as tensor ops by
//! default ([`sample_rows_by_tensors`], cumulative sums in f32), on burn-flex straight on the
//! logits' buffer with the host rule ([`sample_rows_flex`]), on the CubeCL backends with a
//! kernel of ours (`cube_sampling.rs`: greedy and whole-distribution draws in two reads of each
//! logit; top-k and top-p draws without a sort).
//!
//! Greedy takes the argmax and reports the model's own log-probability; sampling scales by the
//! temperature, keeps the `top_k` most likely tokens and then the smallest prefix (by descending
//! probability) whose mass reaches `top_p`, and draws by inverting the cumulative distribution at
//! `u x total` for the row's uniform draw `u`. Every row is computed on its own. A repetition
//! penalty, when set, changes the logits of the ids a row has seen before any of this
//! ([`penalize_row`] on the host, [`penalize_rows_by_tensors`] where the logits are), so each
//! sampler above draws from, and reports the log-probability under, the penalized distribution.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};

pub use conrub_settings::{Decoding, SamplingParams};

/// Whether a draw is restricted to a prefix of the order (top-k below `vocab`, top-p below 1,
/// or min-p).
pub fn restricted(cfg: &Decoding, vocab: usize) -> bool {
    match cfg {
        Decoding::Greedy => false,
        Decoding::Sample(p) => p.top_k.is_some_and(|k| k < vocab) || p.top_p < 1.0 || p.min_p > 0.0,
    }
}

/// The settings every sampler is checked at against [`sample_row`] (its unit test here,
/// `kernels/tests/parity.rs` on each backend) for `vocab` ids: greedy; the whole distribution
/// at temperature 1 and 0.7; top-k 1, 5 and 50; top-p 0.6 at temperature 0.8 and 0.9 at 0.7;
/// top-k 12 with top-p 0.9; top-k `vocab / 3` with top-p 0.5; min-p 0.1 alone, and 0.05 after
/// top-k 50 and top-p 0.9 at temperature 0.8.
pub fn checked_modes(vocab: usize) -> Vec<Decoding> {
    vec![
        Decoding::Greedy,
        Decoding::draw(1.0, None, 1.0),
        Decoding::draw(0.7, None, 1.0),
        Decoding::draw(1.0, Some(1), 1.0),
        Decoding::draw(1.0, Some(5), 1.0),
        Decoding::draw(1.0, Some(50), 1.0),
        Decoding::draw(0.8, None, 0.6),
        Decoding::draw(0.7, None, 0.9),
        Decoding::draw(1.0, Some(12), 0.9),
        Decoding::draw(1.0, Some(vocab / 3), 0.5),
        Decoding::draw(1.0, None, 1.0).with_min_p(0.1),
        Decoding::draw(0.8, Some(50), 0.9).with_min_p(0.05),
    ]
}

/// Picks the next token from one row of logits with the uniform draw `u` in `[0, 1)` (unused
/// when greedy); returns `(token, logprob)`.
pub fn sample_row(logits: &[f32], cfg: &Decoding, u: f64) -> (u32, f32) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if cfg.is_greedy() {
        let (tok, _) = logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
                if x > best.1 {
                    (i, x)
                } else {
                    best
                }
            });
        let lse = logsumexp(logits.iter().map(|&x| x as f64), max as f64);
        return (tok as u32, (logits[tok] as f64 - lse) as f32);
    }
    let inv_t = 1.0 / cfg.params().temperature;
    let scaled = |x: f32| (x as f64 - max as f64) * inv_t;
    if !restricted(cfg, logits.len()) {
        // Full distribution: one pass for the normaliser, one for the inverse CDF. Each weight is
        // computed once and kept for the scan (the same values summed in the same order as
        // recomputing them, so the same token, at one exponential per logit instead of up to two).
        let weights: Vec<f64> = logits.iter().map(|&x| scaled(x).exp()).collect();
        let total: f64 = weights.iter().sum();
        let target = u * total;
        let mut acc = 0.0;
        let mut tok = logits.len() - 1;
        for (i, &w) in weights.iter().enumerate() {
            acc += w;
            if acc > target {
                tok = i;
                break;
            }
        }
        while logits[tok] == f32::NEG_INFINITY && tok > 0 {
            tok -= 1;
        }
        return (tok as u32, (scaled(logits[tok]) - total.ln()) as f32);
    }
    // Candidates sorted by descending logit (ties by id), then top-k, then top-p.
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if let Some(k) = cfg.params().top_k.filter(|&k| k < idx.len()) {
        idx.select_nth_unstable_by(k - 1, by_logit);
        idx.truncate(k);
    }
    idx.sort_unstable_by(by_logit);
    let weights: Vec<f64> = idx
        .iter()
        .map(|&i| scaled(logits[i as usize]).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut keep = weights.len();
    if cfg.params().top_p < 1.0 {
        let mut acc = 0.0;
        for (n, w) in weights.iter().enumerate() {
            acc += w / total;
            if acc >= cfg.params().top_p {
                keep = n + 1;
                break;
            }
        }
    }
    if cfg.params().min_p > 0.0 {
        // Weights are relative to the most likely id's (1): min-p keeps those at or above it.
        let ln_min_p = cfg.params().min_p.ln();
        let likely = idx[..keep]
            .iter()
            .take_while(|&&i| scaled(logits[i as usize]) >= ln_min_p)
            .count();
        keep = keep.min(likely.max(1));
    }
    let kept_total: f64 = weights[..keep].iter().sum();
    let target = u * kept_total;
    let mut acc = 0.0;
    let mut choice = keep - 1;
    for (n, w) in weights[..keep].iter().enumerate() {
        acc += w;
        if acc > target {
            choice = n;
            break;
        }
    }
    (idx[choice], (weights[choice] / kept_total).ln() as f32)
}

/// The repetition penalty (Hugging Face's `repetition_penalty`, vLLM's and SGLang's): a logit of an
/// id already seen is divided by `penalty` when positive and multiplied by it otherwise, in f32,
/// before any other step of the rule. 1 leaves the logit alone.
pub fn penalized_logit(x: f32, penalty: f32) -> f32 {
    if x < 0.0 {
        x * penalty
    } else {
        x / penalty
    }
}

/// Applies the repetition penalty to `row` at the ids of `seen` (each once, however often it
/// occurs there; ids are distinct when they come from [`SeenIds`]).
pub fn penalize_row(row: &mut [f32], seen: &[u32], penalty: f32) {
    for &id in seen {
        let x = &mut row[id as usize];
        *x = penalized_logit(*x, penalty);
    }
}

/// The ids a sequence has seen (its prompt's and its new tokens), each once, in the order first
/// seen: what the repetition penalty penalizes. The default tracks nothing (no penalty).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SeenIds {
    ids: Vec<u32>,
    set: std::collections::HashSet<u32>,
    tracking: bool,
}

impl SeenIds {
    /// The distinct ids of `prompt`, and of every id inserted after.
    pub fn new(prompt: &[u32]) -> Self {
        let mut seen = Self {
            tracking: true,
            ..Self::default()
        };
        prompt.iter().for_each(|&t| seen.insert(t));
        seen
    }

    /// [`SeenIds::new`] under a repetition penalty other than 1, else a set that stays empty:
    /// what every sampler keeps per sequence.
    pub fn for_penalty(prompt: &[u32], penalty: f32) -> Self {
        match penalty != 1.0 {
            true => Self::new(prompt),
            false => Self::default(),
        }
    }

    /// Adds `id` (a new token) when it is not seen yet (nothing when not tracking).
    pub fn insert(&mut self, id: u32) {
        if self.tracking && self.set.insert(id) {
            self.ids.push(id);
        }
    }

    /// The distinct ids, in the order first seen.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

/// [`penalize_row`] on every row of `logits` `[rows, vocab]` (cast to f32) where the logits are:
/// the seen ids of all rows as one `[n, 2]` index of `(row, id)` pairs, their logits gathered,
/// penalized by the same f32 operations and written back (no `[rows, vocab]` mask is uploaded).
pub fn penalize_rows_by_tensors<B: Backend>(
    logits: Tensor<B, 2>,
    seen: &[&[u32]],
    penalty: f32,
) -> Tensor<B, 2> {
    let logits = logits.cast(DType::F32);
    let pairs: Vec<i64> = seen
        .iter()
        .enumerate()
        .flat_map(|(r, ids)| ids.iter().flat_map(move |&id| [r as i64, id as i64]))
        .collect();
    let n = pairs.len() / 2;
    if n == 0 || penalty == 1.0 {
        return logits;
    }
    let index = Tensor::<B, 2, Int>::from_data(TensorData::new(pairs, [n, 2]), &logits.device());
    let x: Tensor<B, 1> = logits.clone().gather_nd(index.clone());
    let negative = x.clone().lower_elem(0.0);
    let penalized = x
        .clone()
        .div_scalar(penalty)
        .mask_where(negative, x.mul_scalar(penalty));
    logits.scatter_nd(index, penalized, burn::tensor::IndexingUpdateOp::Assign)
}

fn logsumexp(xs: impl Iterator<Item = f64>, max: f64) -> f64 {
    max + xs.map(|x| (x - max).exp()).sum::<f64>().ln()
}

/// [`sample_row`]'s rule as tensor ops on any backend (the default of
/// [`crate::DecodeOps::sample_rows`]). `uniforms[r]` is row `r`'s draw (unused when greedy).
pub fn sample_rows_by_tensors<B: Backend>(
    logits: Tensor<B, 2>,
    cfg: &Decoding,
    uniforms: &[f64],
) -> (Tensor<B, 1, Int>, Tensor<B, 1>) {
    let logits = logits.cast(DType::F32);
    let [n, v] = logits.dims();
    let device = logits.device();
    let max = logits.clone().max_dim(1);
    if cfg.is_greedy() {
        let tok = logits.clone().argmax(1);
        let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
        let lp = logits.gather(1, tok.clone()) - lse;
        return (tok.reshape([n]), lp.reshape([n]));
    }
    assert_eq!(uniforms.len(), n, "one uniform draw per row");
    let u = Tensor::<B, 2>::from_data(
        TensorData::new(
            uniforms.iter().map(|&x| x as f32).collect::<Vec<_>>(),
            [n, 1],
        ),
        &device,
    )
    .cast(DType::F32);
    let z = (logits - max).div_scalar(cfg.params().temperature);
    let top_k = cfg.params().top_k.filter(|&k| k < v);
    if !restricted(cfg, v) {
        // The whole vocabulary in id order.
        let c = z.clone().exp().cumsum(1);
        let total = c.clone().slice([0..n, v - 1..v]);
        let target = u * total.clone();
        let tok = c
            .lower_equal(target)
            .int()
            .sum_dim(1)
            .clamp_max((v - 1) as i64);
        let lp = z.gather(1, tok.clone()) - total.log();
        return (tok.reshape([n]), lp.reshape([n]));
    }
    // Candidates by descending probability: top-k, then the top-p prefix.
    let (vals, idx) = match top_k {
        Some(k) => z.topk_with_indices(k, 1),
        None => z.sort_descending_with_indices(1),
    };
    let m = vals.dims()[1];
    let w = vals.clone().exp();
    let c = w.clone().cumsum(1);
    let total = c.clone().slice([0..n, m - 1..m]);
    let mut keep = if cfg.params().top_p < 1.0 {
        // The first n whose cumulative share reaches top_p closes the prefix: keep = n + 1.
        let share = c.clone() / total;
        (share.lower_elem(cfg.params().top_p).int().sum_dim(1) + 1).clamp_max(m as i64)
    } else {
        Tensor::<B, 2, Int>::full([n, 1], m as i64, &device)
    };
    if cfg.params().min_p > 0.0 {
        // `vals` are `(x - max) / T`, 0 for the most likely id: min-p keeps those >= ln(min_p).
        let likely = vals
            .greater_equal_elem(cfg.params().min_p.ln())
            .int()
            .sum_dim(1)
            .clamp_min(1);
        keep = keep.min_pair(likely);
    }
    let last = keep - 1;
    let kept_total = c.clone().gather(1, last.clone());
    let target = u * kept_total.clone();
    let choice = c.lower_equal(target).int().sum_dim(1).min_pair(last);
    let tok = idx.gather(1, choice.clone());
    let lp = (w.gather(1, choice) / kept_total).log();
    (tok.reshape([n]), lp.reshape([n]))
}

/// [`sample_rows_by_tensors`] on primitives: the default of [`crate::DecodeOps::sample_rows`].
pub fn sample_rows_by_tensor_ops<B: Backend>(
    logits: FloatTensor<B>,
    params: &Decoding,
    uniforms: &[f64],
) -> (IntTensor<B>, FloatTensor<B>) {
    let (t, l) = sample_rows_by_tensors::<B>(
        Tensor::from_primitive(TensorPrimitive::Float(logits)),
        params,
        uniforms,
    );
    (t.into_primitive(), l.into_primitive().tensor())
}

/// A device tensor of draws `[rows]` read back to the host (the default of
/// [`crate::DecodeOps::sample_rows_on`], which then samples with the host's copy).
pub fn host_uniforms<B: Backend>(uniforms: FloatTensor<B>) -> Vec<f64> {
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(uniforms))
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 draws")
        .into_iter()
        .map(f64::from)
        .collect()
}

/// [`sample_row`] on every row of a burn-flex `[rows, vocab]` tensor, reading its buffer in place
/// (no copy of the logits), rows split over the available cores.
#[cfg(feature = "flex")]
pub fn sample_rows_flex(
    logits: Tensor<burn::backend::Flex, 2>,
    cfg: &Decoding,
    uniforms: &[f64],
) -> (
    Tensor<burn::backend::Flex, 1, Int>,
    Tensor<burn::backend::Flex, 1>,
) {
    let [n, v] = logits.dims();
    let device = logits.device();
    let t = logits
        .cast(DType::F32)
        .into_primitive()
        .tensor()
        .to_contiguous();
    let off = t.layout().start_offset();
    let data = &t.storage::<f32>()[off..off + n * v];
    let mut out = vec![(0u32, 0f32); n];
    let threads = std::thread::available_parallelism()
        .map_or(1, |p| p.get())
        .min(n.max(1));
    let per = n.div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        for (c, chunk) in out.chunks_mut(per).enumerate() {
            s.spawn(move || {
                for (i, slot) in chunk.iter_mut().enumerate() {
                    let r = c * per + i;
                    *slot = sample_row(
                        &data[r * v..(r + 1) * v],
                        cfg,
                        if cfg.is_greedy() { 0.0 } else { uniforms[r] },
                    );
                }
            });
        }
    });
    let toks: Vec<i64> = out.iter().map(|x| x.0 as i64).collect();
    let lps: Vec<f32> = out.iter().map(|x| x.1).collect();
    (
        Tensor::from_data(TensorData::new(toks, [n]), &device),
        Tensor::from_data(TensorData::new(lps, [n]), &device),
    )
}

#[cfg(test)]
mod rule_tests {
    use super::*;

    /// Min-p by hand: at temperature 1 the ids' likelihoods relative to the most likely one are
    /// `exp(x - 2)`: 1, 0.368, 0.135, 0.0067. Min-p 0.3 keeps the first two (weights 1 and
    /// 0.368), so `u = 0.9` (target 0.9 x 1.368 = 1.231) draws id 1 with log-probability
    /// `ln(0.368 / 1.368)`; min-p 0.1 keeps three, min-p 1 the most likely id alone; after
    /// top-k 2, min-p 0.1 changes nothing.
    #[test]
    fn min_p_keeps_ids_at_least_that_likely_relative_to_the_top() {
        let logits = [0.0f32, 1.0, 2.0, -3.0];
        let e1 = (-1f64).exp();
        let e2 = (-2f64).exp();
        let (tok, lp) = sample_row(
            &logits,
            &Decoding::draw(1.0, None, 1.0).with_min_p(0.3),
            0.9,
        );
        assert_eq!(tok, 1);
        assert!((lp as f64 - (e1 / (1.0 + e1)).ln()).abs() < 1e-6, "{lp}");
        // u = 0.99 of three kept: past 1 + e^-1, so id 0, the third most likely.
        let three = Decoding::draw(1.0, None, 1.0).with_min_p(0.1);
        let (tok, lp) = sample_row(&logits, &three, 0.99);
        assert_eq!(tok, 0);
        assert!(
            (lp as f64 - (e2 / (1.0 + e1 + e2)).ln()).abs() < 1e-6,
            "{lp}"
        );
        let (tok, lp) = sample_row(
            &logits,
            &Decoding::draw(1.0, None, 1.0).with_min_p(1.0),
            0.99,
        );
        assert_eq!((tok, lp), (2, 0.0));
        let k2 = Decoding::draw(1.0, Some(2), 1.0);
        for u in [0.1, 0.5, 0.9] {
            assert_eq!(
                sample_row(&logits, &k2.with_min_p(0.1), u),
                sample_row(&logits, &k2, u)
            );
        }
        // At temperature 0.5 the ratios square: e^-2 = 0.135 < 0.3, so min-p 0.3 keeps one.
        let cold = Decoding::draw(0.5, None, 1.0).with_min_p(0.3);
        assert_eq!(sample_row(&logits, &cold, 0.99), (2, 0.0));
    }

    /// The repetition penalty by hand: logits `[2, -1, 0.5, 1.9]` having seen ids 0, 1 and 1
    /// again, at penalty 2, become `[1, -2, 0.5, 1.9]` (the positive one halved, the negative one
    /// doubled, a repeat penalized once): greedy then takes id 3 instead of 0, with the log-softmax
    /// of the penalized row; penalty 1 changes nothing.
    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
        let logits = [2.0f32, -1.0, 0.5, 1.9];
        let seen = SeenIds::new(&[0, 1, 1]);
        assert_eq!(seen.ids(), &[0, 1]);
        let mut row = logits;
        penalize_row(&mut row, seen.ids(), 2.0);
        assert_eq!(row, [1.0, -2.0, 0.5, 1.9]);
        let (tok, lp) = sample_row(&row, &Decoding::Greedy, 0.0);
        let lse = [1.0f64, -2.0, 0.5, 1.9]
            .iter()
            .map(|x| x.exp())
            .sum::<f64>()
            .ln();
        assert_eq!(tok, 3);
        assert!((lp as f64 - (1.9f32 as f64 - lse)).abs() < 1e-6, "{lp}");
        assert_eq!(sample_row(&logits, &Decoding::Greedy, 0.0).0, 0);
        let mut same = logits;
        penalize_row(&mut same, seen.ids(), 1.0);
        assert_eq!(same, logits);
        // Below 1 it rewards repeats: id 1's logit -1 becomes -0.5, id 0's 2 becomes 4.
        let mut lower = logits;
        penalize_row(&mut lower, seen.ids(), 0.5);
        assert_eq!(lower, [4.0, -0.5, 0.5, 1.9]);
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use burn::backend::Flex;

    /// The tensor version (what CubeCL backends run) picks what the row rule picks, for every
    /// mode, on logits far enough apart that f32 and f64 sums agree; so does the flex one.
    #[test]
    fn tensor_and_flex_samplers_follow_the_row_rule() {
        let logits: Vec<f32> = (0..50)
            .map(|i| ((i * 37 % 50) as f32 * 0.13) - 3.0)
            .collect();
        let rows = 8;
        let all: Vec<f32> = (0..rows)
            .flat_map(|r| logits.iter().map(move |x| x + r as f32 * 0.01))
            .collect();
        let cfgs = crate::sampling::checked_modes(50);
        for cfg in &cfgs {
            for round in 0..5 {
                let u: Vec<f64> = (0..rows)
                    .map(|r| ((r * 7 + round * 13) % 40) as f64 / 40.0 + 0.01)
                    .collect();
                let t = Tensor::<Flex, 2>::from_data(
                    TensorData::new(all.clone(), [rows, 50]),
                    &Default::default(),
                );
                let (tt, tl) = sample_rows_by_tensors(t.clone(), cfg, &u);
                let (ft, fl) = sample_rows_flex(t, cfg, &u);
                let host = |x: Tensor<Flex, 1, Int>| {
                    x.into_data().convert::<i64>().into_vec::<i64>().unwrap()
                };
                let hostf =
                    |x: Tensor<Flex, 1>| x.into_data().convert::<f32>().into_vec::<f32>().unwrap();
                let (tt, ft, tl, fl) = (host(tt), host(ft), hostf(tl), hostf(fl));
                for r in 0..rows {
                    let (tok, lp) = sample_row(&all[r * 50..(r + 1) * 50], cfg, u[r]);
                    assert_eq!((tt[r] as u32, ft[r] as u32), (tok, tok), "{cfg:?} row {r}");
                    assert!(
                        (tl[r] - lp).abs() < 1e-4 && fl[r] == lp,
                        "{cfg:?} row {r}: {} {} vs {lp}",
                        tl[r],
                        fl[r]
                    );
                }
            }
        }
    }

    /// The repetition penalty on a tensor gives each row exactly what [`penalize_row`] gives
    /// (negative, positive and the largest logits among the seen ids, a row that saw nothing),
    /// and penalty 1 is the identity.
    #[test]
    fn tensor_penalty_is_the_row_penalty() {
        let (rows, v) = (3, 40);
        let all: Vec<f32> = (0..rows * v)
            .map(|i| ((i * 29 % 40) as f32 * 0.17) - 3.1)
            .collect();
        let seen: [Vec<u32>; 3] = [vec![0, 5, 17, 39], vec![], vec![2, 3, 4, 31, 8]];
        let views: Vec<&[u32]> = seen.iter().map(Vec::as_slice).collect();
        for penalty in [1.3f32, 0.7, 1.0] {
            let t = Tensor::<Flex, 2>::from_data(
                TensorData::new(all.clone(), [rows, v]),
                &Default::default(),
            );
            let got = penalize_rows_by_tensors(t, &views, penalty)
                .into_data()
                .into_vec::<f32>()
                .unwrap();
            let mut want = all.clone();
            for (r, ids) in seen.iter().enumerate() {
                penalize_row(&mut want[r * v..(r + 1) * v], ids, penalty);
            }
            assert_eq!(got, want, "penalty {penalty}");
        }
    }
}
