//! The fused LM head on the host: per token `log p(target)`, entropy and log-sum-exp of
//! `hidden · weightᵀ`, and the backward of `sum_t grad[t] · log p(target_t)`, computed one
//! vocabulary tile at a time so that no `[tokens, vocab]` buffer ever exists.
//!
//! What the CPU backends run instead of [`crate::loss`]'s chain of whole-chunk tensor ops
//! (each of which allocated, faulted in and freed a `[chunk, vocab]` buffer):
//! - the vocabulary is split into one contiguous range per core; each core walks its range in
//!   tiles of a few hundred rows of the head, so a tile of the head, a block of hidden states and
//!   the `[block, tile]` logits all stay in the core's L2 cache;
//! - forward: a `gemm` per (tile, row block), then one pass over the logits that keeps a running
//!   max, `sum e^(x - max)` and `sum x e^(x - max)` per token (an online softmax, the sums in f64
//!   across tiles); the per-core partial statistics are merged at the end;
//! - backward: the tile's logits are recomputed, turned in place into
//!   `grad · (onehot(target) - softmax)`, and multiplied into the hidden-state gradient (one
//!   accumulator per core, summed at the end) and the head's gradient (each core owns its rows).
//!
//! The exponential is a branch-free polynomial that the compiler vectorises (AVX2 + FMA where the
//! processor has them, chosen at run time): relative error below 3e-7 over the range used.
//! Inputs are f32 row-major slices; tokens with `grad = 0` still cost their share of the work.

use std::ops::Range;
use std::thread;

/// Hidden-state rows per block of a tile's product.
const ROW_BLOCK: usize = 128;

/// Rows of the head per tile: about 64 KiB of the head at any hidden size (512 rows at hidden 64,
/// never fewer than 16).
fn tile_rows(hidden: usize) -> usize {
    (16_384 / hidden.max(1)).clamp(16, 512)
}

/// Worker threads for `tokens` tokens: every core when the work is worth it, one otherwise.
fn workers(tokens: usize, vocab: usize) -> usize {
    let cores = thread::available_parallelism().map_or(1, |p| p.get());
    if tokens * vocab < 1 << 20 {
        1
    } else {
        cores.min(vocab.div_ceil(16)).max(1)
    }
}

/// The vocabulary range of part `p` of `parts`.
fn part_range(vocab: usize, parts: usize, p: usize) -> (usize, usize) {
    (p * vocab / parts, (p + 1) * vocab / parts)
}

/// Shapes of one call.
#[derive(Debug, Clone, Copy)]
pub struct HeadShape {
    /// Tokens (rows of `hidden`).
    pub tokens: usize,
    /// Hidden size (columns of `hidden` and of the head).
    pub hidden: usize,
    /// Vocabulary size (rows of the head).
    pub vocab: usize,
}

/// Per-token statistics of the forward, each `[tokens]`.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadStats {
    /// `log p(target)`.
    pub logprobs: Vec<f32>,
    /// Entropy of the next-token distribution.
    pub entropy: Vec<f32>,
    /// Log-sum-exp of the logits (what the backward needs).
    pub lse: Vec<f32>,
}

/// A row-major f32 matrix operand: its elements and `(row stride, column stride)`.
type Operand<'a> = (&'a [f32], isize, isize);

/// `dst[m, n] (+)= lhs[m, k] · rhs[k, n]` on one thread (`dst` row-major with row stride `n`;
/// accumulated into when `accumulate`). Every element the strides reach must lie in its slice.
fn gemm_f32(
    dst: &mut [f32],
    (m, n, k): (usize, usize, usize),
    lhs: Operand,
    rhs: Operand,
    accumulate: bool,
) {
    let reach = |(data, rs, cs): Operand, rows: usize, cols: usize| {
        rows == 0
            || cols == 0
            || ((rows - 1) as isize * rs + (cols - 1) as isize * cs) < data.len() as isize
    };
    assert!(
        dst.len() >= m * n && reach(lhs, m, k) && reach(rhs, k, n),
        "gemm operands out of bounds"
    );
    // SAFETY: the assertion covers every element the strides reach (strides are non-negative).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.0.as_ptr(),
            lhs.2,
            lhs.1,
            rhs.0.as_ptr(),
            rhs.2,
            rhs.1,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `logits[rows, n] = h[rows, hidden] · w[n, hidden]ᵀ`.
fn tile_logits(out: &mut [f32], h: &[f32], w: &[f32], rows: usize, n: usize, hidden: usize) {
    gemm_f32(
        out,
        (rows, n, hidden),
        (h, hidden as isize, 1),
        (w, 1, hidden as isize),
        false,
    );
}

/// `gh[rows, hidden] += d[rows, n] · w[n, hidden]`.
fn acc_hidden_grad(gh: &mut [f32], d: &[f32], w: &[f32], rows: usize, n: usize, hidden: usize) {
    gemm_f32(
        gh,
        (rows, hidden, n),
        (d, n as isize, 1),
        (w, hidden as isize, 1),
        true,
    );
}

/// `gw[n, hidden] += d[rows, n]ᵀ · h[rows, hidden]` (`d` read transposed through its strides).
fn acc_head_grad(gw: &mut [f32], d: &[f32], h: &[f32], rows: usize, n: usize, hidden: usize) {
    gemm_f32(
        gw,
        (n, hidden, rows),
        (d, 1, n as isize),
        (h, hidden as isize, 1),
        true,
    );
}

/// `e^x` for `x` in roughly `[-87, 88]` (clamped there): `2^n · e^r` with `n = round(x / ln 2)`,
/// `r = x - n ln 2` split in two parts (|r| <= ln2 / 2) and a degree-7 Taylor polynomial for
/// `e^r`, whose truncation error is below 6e-9. No branches and no calls, so loops vectorise.
#[inline(always)]
fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = if x < -87.0 { -87.0 } else { x };
    let x = if x > 88.0 { 88.0 } else { x };
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // The low bits of `shifted` hold n (two's complement); 2^n is (n + 127) in the exponent field.
    let scale = f32::from_bits(shifted.to_bits().wrapping_add(127) << 23);
    p * scale
}

const LANES: usize = 8;

/// `(max, sum e^(x - max), sum x e^(x - max))` of one row of logits.
#[inline(always)]
fn row_softmax_sums(row: &[f32]) -> (f32, f32, f32) {
    let mut mx = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            mx[l] = if c[l] > mx[l] { c[l] } else { mx[l] };
        }
    }
    let mut m = mx
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    for &x in tail {
        m = if x > m { x } else { m };
    }
    let mut s = [0f32; LANES];
    let mut sx = [0f32; LANES];
    for c in row.chunks_exact(LANES) {
        for l in 0..LANES {
            let e = exp_approx(c[l] - m);
            s[l] += e;
            sx[l] += c[l] * e;
        }
    }
    let (mut s1, mut sx1) = (s.iter().sum::<f32>(), sx.iter().sum::<f32>());
    for &x in tail {
        let e = exp_approx(x - m);
        s1 += e;
        sx1 += x * e;
    }
    (m, s1, sx1)
}

/// `row[j] = -g · e^(row[j] - lse)`: the softmax part of the logits' gradient, in place.
#[inline(always)]
fn row_softmax_grad(row: &mut [f32], lse: f32, g: f32) {
    for x in row.iter_mut() {
        *x = -g * exp_approx(*x - lse);
    }
}

/// A core's running statistics over its part of the vocabulary.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f64>,
    sum_x: Vec<f64>,
    /// The target's logit where the target lies in this part, else NaN.
    target: Vec<f32>,
}

/// Calls `f(vs..ve, rs..re)` for every (head tile, hidden-state row block) of the vocabulary range
/// `v0..v1`: tiles of `tile` head rows on the outside (each stays in cache while every row block
/// passes over it), blocks of [`ROW_BLOCK`] tokens inside.
#[inline(always)]
fn for_each_tile(
    v0: usize,
    v1: usize,
    tokens: usize,
    tile: usize,
    mut f: impl FnMut(std::ops::Range<usize>, std::ops::Range<usize>),
) {
    for vs in (v0..v1).step_by(tile) {
        for rs in (0..tokens).step_by(ROW_BLOCK) {
            f(vs..(vs + tile).min(v1), rs..(rs + ROW_BLOCK).min(tokens));
        }
    }
}

#[inline(always)]
fn forward_part_body(
    h: &[f32],
    w: &[f32],
    targets: &[u32],
    shape: HeadShape,
    (v0, v1): (usize, usize),
) -> Partial {
    let HeadShape { tokens, hidden, .. } = shape;
    let tile = tile_rows(hidden);
    let mut p = Partial {
        max: vec![f32::NEG_INFINITY; tokens],
        sum: vec![0.0; tokens],
        sum_x: vec![0.0; tokens],
        target: vec![f32::NAN; tokens],
    };
    let mut buf = vec![0f32; ROW_BLOCK.min(tokens) * tile];
    for_each_tile(
        v0,
        v1,
        tokens,
        tile,
        |Range { start: vs, end: ve }, Range { start: rs, end: re }| {
            let (n, rows) = (ve - vs, re - rs);
            tile_logits(
                &mut buf,
                &h[rs * hidden..re * hidden],
                &w[vs * hidden..ve * hidden],
                rows,
                n,
                hidden,
            );
            for r in 0..rows {
                let t = rs + r;
                let row = &buf[r * n..(r + 1) * n];
                let (m, s, sx) = row_softmax_sums(row);
                let old = p.max[t];
                if m > old {
                    let scale = (old as f64 - m as f64).exp();
                    p.sum[t] = p.sum[t] * scale + s as f64;
                    p.sum_x[t] = p.sum_x[t] * scale + sx as f64;
                    p.max[t] = m;
                } else {
                    let scale = (m as f64 - old as f64).exp();
                    p.sum[t] += s as f64 * scale;
                    p.sum_x[t] += sx as f64 * scale;
                }
                let target = targets[t] as usize;
                if (vs..ve).contains(&target) {
                    p.target[t] = row[target - vs];
                }
            }
        },
    );
    p
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn backward_part_body(
    h: &[f32],
    w: &[f32],
    targets: &[u32],
    lse: &[f32],
    grad: &[f32],
    shape: HeadShape,
    (v0, v1): (usize, usize),
    mut gh: Option<&mut [f32]>,
    mut gw: Option<&mut [f32]>,
) {
    let HeadShape { tokens, hidden, .. } = shape;
    let tile = tile_rows(hidden);
    let mut buf = vec![0f32; ROW_BLOCK.min(tokens) * tile];
    for_each_tile(
        v0,
        v1,
        tokens,
        tile,
        |Range { start: vs, end: ve }, Range { start: rs, end: re }| {
            if grad[rs..re].iter().all(|&g| g == 0.0) {
                return;
            }
            let (n, rows) = (ve - vs, re - rs);
            let (wt, hb) = (&w[vs * hidden..ve * hidden], &h[rs * hidden..re * hidden]);
            tile_logits(&mut buf, hb, wt, rows, n, hidden);
            for r in 0..rows {
                let t = rs + r;
                let row = &mut buf[r * n..(r + 1) * n];
                row_softmax_grad(row, lse[t], grad[t]);
                let target = targets[t] as usize;
                if (vs..ve).contains(&target) {
                    row[target - vs] += grad[t];
                }
            }
            if let Some(gh) = gh.as_deref_mut() {
                acc_hidden_grad(&mut gh[rs * hidden..re * hidden], &buf, wt, rows, n, hidden);
            }
            if let Some(gw) = gw.as_deref_mut() {
                acc_head_grad(
                    &mut gw[(vs - v0) * hidden..(ve - v0) * hidden],
                    &buf,
                    hb,
                    rows,
                    n,
                    hidden,
                );
            }
        },
    );
}

/// Defines `fn $name(args) -> ret` that runs `$body(args)` compiled for AVX2 + FMA when the
/// processor has them (the `#[inline(always)]` loops inside are then vectorised 8 lanes wide), and
/// as compiled for the baseline target otherwise.
macro_rules! best_simd {
    ($(#[$meta:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty = $body:ident) => {
        $(#[$meta])*
        fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                $(#[$meta])*
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: the processor has the features `avx2` is compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

best_simd! {
    fn forward_part(h: &[f32], w: &[f32], targets: &[u32], shape: HeadShape, range: (usize, usize)) -> Partial = forward_part_body
}

best_simd! {
    #[allow(clippy::too_many_arguments)]
    fn backward_part(
        h: &[f32],
        w: &[f32],
        targets: &[u32],
        lse: &[f32],
        grad: &[f32],
        shape: HeadShape,
        range: (usize, usize),
        gh: Option<&mut [f32]>,
        gw: Option<&mut [f32]>,
    ) -> () = backward_part_body
}

fn check(h: &[f32], w: &[f32], targets: &[u32], shape: HeadShape) {
    assert_eq!(
        h.len(),
        shape.tokens * shape.hidden,
        "hidden states are not [tokens, hidden]"
    );
    assert_eq!(
        w.len(),
        shape.vocab * shape.hidden,
        "head is not [vocab, hidden]"
    );
    assert_eq!(targets.len(), shape.tokens, "one target per token");
    if let Some(&t) = targets.iter().find(|&&t| t as usize >= shape.vocab) {
        panic!("target {t} outside the vocabulary of {}", shape.vocab);
    }
}

/// Forward: `log p(target)`, entropy and log-sum-exp per token of `h` `[tokens, hidden]` against
/// the head `w` `[vocab, hidden]` (row-major f32).
pub fn forward(h: &[f32], w: &[f32], targets: &[u32], shape: HeadShape) -> HeadStats {
    forward_in_parts(h, w, targets, shape, workers(shape.tokens, shape.vocab))
}

fn forward_in_parts(
    h: &[f32],
    w: &[f32],
    targets: &[u32],
    shape: HeadShape,
    parts: usize,
) -> HeadStats {
    check(h, w, targets, shape);
    let tokens = shape.tokens;
    if tokens == 0 || shape.vocab == 0 {
        return HeadStats {
            logprobs: vec![f32::NAN; tokens],
            entropy: vec![f32::NAN; tokens],
            lse: vec![f32::NAN; tokens],
        };
    }
    let partials: Vec<Partial> = if parts == 1 {
        vec![forward_part(h, w, targets, shape, (0, shape.vocab))]
    } else {
        thread::scope(|s| {
            let handles: Vec<_> = (0..parts)
                .map(|p| {
                    s.spawn(move || {
                        forward_part(h, w, targets, shape, part_range(shape.vocab, parts, p))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|j| j.join().expect("head forward worker panicked"))
                .collect()
        })
    };
    let mut out = HeadStats {
        logprobs: vec![0.0; tokens],
        entropy: vec![0.0; tokens],
        lse: vec![0.0; tokens],
    };
    for t in 0..tokens {
        let m = partials
            .iter()
            .map(|p| p.max[t])
            .fold(f32::NEG_INFINITY, f32::max) as f64;
        let (mut s, mut sx) = (0f64, 0f64);
        let mut target = f32::NAN;
        for p in &partials {
            let scale = (p.max[t] as f64 - m).exp();
            s += p.sum[t] * scale;
            sx += p.sum_x[t] * scale;
            if !p.target[t].is_nan() {
                target = p.target[t];
            }
        }
        let lse = m + s.ln();
        out.lse[t] = lse as f32;
        out.logprobs[t] = (target as f64 - lse) as f32;
        out.entropy[t] = (lse - sx / s) as f32;
    }
    out
}

/// Backward of `sum_t grad[t] · log p(target_t)`: the gradient of `h` (when `want_hidden`) and of
/// the head (when `want_head`), row-major like their inputs. `lse` is the forward's.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    h: &[f32],
    w: &[f32],
    targets: &[u32],
    lse: &[f32],
    grad: &[f32],
    shape: HeadShape,
    want_hidden: bool,
    want_head: bool,
) -> (Option<Vec<f32>>, Option<Vec<f32>>) {
    backward_in_parts(
        h,
        w,
        targets,
        lse,
        grad,
        shape,
        (want_hidden, want_head),
        workers(shape.tokens, shape.vocab),
    )
}

#[allow(clippy::too_many_arguments)]
fn backward_in_parts(
    h: &[f32],
    w: &[f32],
    targets: &[u32],
    lse: &[f32],
    grad: &[f32],
    shape: HeadShape,
    (want_hidden, want_head): (bool, bool),
    parts: usize,
) -> (Option<Vec<f32>>, Option<Vec<f32>>) {
    check(h, w, targets, shape);
    assert_eq!(lse.len(), shape.tokens, "one log-sum-exp per token");
    assert_eq!(grad.len(), shape.tokens, "one gradient per token");
    let HeadShape {
        tokens,
        hidden,
        vocab,
    } = shape;
    let mut gw = want_head.then(|| vec![0f32; vocab * hidden]);
    if !want_hidden && !want_head || tokens == 0 {
        return (want_hidden.then(|| vec![0f32; tokens * hidden]), gw);
    }
    let mut gh_parts: Vec<Vec<f32>> = if want_hidden {
        (0..parts).map(|_| vec![0f32; tokens * hidden]).collect()
    } else {
        Vec::new()
    };
    // Each part owns its rows of the head's gradient.
    let mut gw_parts: Vec<Option<&mut [f32]>> = match gw.as_deref_mut() {
        Some(all) => {
            let mut rest = all;
            let mut out = Vec::with_capacity(parts);
            for p in 0..parts {
                let (a, b) = part_range(vocab, parts, p);
                let (mine, tail) = rest.split_at_mut((b - a) * hidden);
                out.push(Some(mine));
                rest = tail;
            }
            out
        }
        None => (0..parts).map(|_| None).collect(),
    };
    let mut gh_iter: Vec<Option<&mut [f32]>> = if want_hidden {
        gh_parts
            .iter_mut()
            .map(|v| Some(v.as_mut_slice()))
            .collect()
    } else {
        (0..parts).map(|_| None).collect()
    };
    if parts == 1 {
        backward_part(
            h,
            w,
            targets,
            lse,
            grad,
            shape,
            (0, vocab),
            gh_iter.pop().flatten(),
            gw_parts.pop().flatten(),
        );
    } else {
        thread::scope(|s| {
            let handles: Vec<_> = gh_iter
                .into_iter()
                .zip(gw_parts)
                .enumerate()
                .map(|(p, (gh, gw))| {
                    s.spawn(move || {
                        backward_part(
                            h,
                            w,
                            targets,
                            lse,
                            grad,
                            shape,
                            part_range(vocab, parts, p),
                            gh,
                            gw,
                        )
                    })
                })
                .collect();
            for j in handles {
                j.join().expect("head backward worker panicked");
            }
        });
    }
    let gh = want_hidden.then(|| {
        let mut it = gh_parts.into_iter();
        let mut acc = it.next().unwrap_or_default();
        for part in it {
            for (a, b) in acc.iter_mut().zip(part) {
                *a += b;
            }
        }
        acc
    });
    (gh, gw)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    }

    /// f64 reference: logits, softmax, log p, entropy and the two gradients.
    #[allow(clippy::type_complexity)]
    fn reference(
        h: &[f32],
        w: &[f32],
        targets: &[u32],
        grad: &[f32],
        s: HeadShape,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (mut lp, mut ent) = (vec![0.0; s.tokens], vec![0.0; s.tokens]);
        let (mut gh, mut gw) = (
            vec![0.0; s.tokens * s.hidden],
            vec![0.0; s.vocab * s.hidden],
        );
        for t in 0..s.tokens {
            let logits: Vec<f64> = (0..s.vocab)
                .map(|v| {
                    (0..s.hidden)
                        .map(|k| h[t * s.hidden + k] as f64 * w[v * s.hidden + k] as f64)
                        .sum()
                })
                .collect();
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = logits.iter().map(|x| (x - m).exp()).sum();
            let lse = m + z.ln();
            lp[t] = logits[targets[t] as usize] - lse;
            ent[t] = -logits
                .iter()
                .map(|x| (x - lse).exp() * (x - lse))
                .sum::<f64>();
            for v in 0..s.vocab {
                let d = grad[t] as f64
                    * ((v == targets[t] as usize) as u8 as f64 - (logits[v] - lse).exp());
                for k in 0..s.hidden {
                    gh[t * s.hidden + k] += d * w[v * s.hidden + k] as f64;
                    gw[v * s.hidden + k] += d * h[t * s.hidden + k] as f64;
                }
            }
        }
        (lp, ent, gh, gw)
    }

    fn max_err(a: &[f32], b: &[f64]) -> f64 {
        let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
        a.iter()
            .zip(b)
            .fold(0f64, |m, (x, y)| m.max((*x as f64 - y).abs()))
            / scale
    }

    #[test]
    fn exp_approx_is_accurate() {
        let mut worst = 0f64;
        for i in 0..200_000 {
            let x = -87.0 + 175.0 * i as f32 / 200_000.0;
            let e = (x as f64).exp();
            worst = worst.max((exp_approx(x) as f64 - e).abs() / e);
        }
        assert!(worst < 3e-7, "relative error {worst}");
        assert_eq!(exp_approx(0.0), 1.0);
        assert!(exp_approx(-1000.0) < 1e-37);
    }

    /// Odd sizes (tiles, row blocks and lanes all with remainders), several workers' ranges, and a
    /// zero gradient on some tokens.
    #[test]
    fn matches_an_f64_reference() {
        for (tokens, hidden, vocab) in [(3, 5, 7), (131, 24, 1_337), (260, 64, 2_100)] {
            let s = HeadShape {
                tokens,
                hidden,
                vocab,
            };
            let h = data(tokens * hidden, 1, 1.5);
            let w = data(vocab * hidden, 2, 1.0);
            let targets: Vec<u32> = (0..tokens)
                .map(|t| ((t * 7919 + 3) % vocab) as u32)
                .collect();
            let grad: Vec<f32> = (0..tokens)
                .map(|t| {
                    if t % 5 == 0 {
                        0.0
                    } else {
                        (t as f32 * 0.37).sin()
                    }
                })
                .collect();
            let (lp, ent, gh, gw) = reference(&h, &w, &targets, &grad, s);
            for parts in [1, 3] {
                let out = forward_in_parts(&h, &w, &targets, s, parts);
                assert!(
                    max_err(&out.logprobs, &lp) < 2e-6,
                    "{tokens}x{hidden}x{vocab} logprobs {}",
                    max_err(&out.logprobs, &lp)
                );
                assert!(
                    max_err(&out.entropy, &ent) < 2e-6,
                    "entropy {}",
                    max_err(&out.entropy, &ent)
                );
                for want in [(true, true), (true, false), (false, true)] {
                    let (a, b) =
                        backward_in_parts(&h, &w, &targets, &out.lse, &grad, s, want, parts);
                    assert_eq!((a.is_some(), b.is_some()), want);
                    if let Some(a) = a {
                        assert!(max_err(&a, &gh) < 2e-5, "d hidden {}", max_err(&a, &gh));
                    }
                    if let Some(b) = b {
                        assert!(max_err(&b, &gw) < 2e-5, "d head {}", max_err(&b, &gw));
                    }
                }
            }
        }
    }

    #[test]
    fn large_logits_stay_finite() {
        let s = HeadShape {
            tokens: 4,
            hidden: 2,
            vocab: 300,
        };
        let h = vec![40.0, -40.0, 1.0, 1.0, -30.0, 60.0, 0.0, 0.0];
        let w = data(600, 3, 2.0);
        let targets = vec![0, 299, 150, 7];
        let out = forward(&h, &w, &targets, s);
        let (lp, ent, _, _) = reference(&h, &w, &targets, &[0.0; 4], s);
        for t in 0..4 {
            assert!(
                (out.logprobs[t] as f64 - lp[t]).abs() < 1e-4 * lp[t].abs().max(1.0),
                "{t}: {} vs {}",
                out.logprobs[t],
                lp[t]
            );
            assert!(
                (out.entropy[t] as f64 - ent[t]).abs() < 1e-4,
                "{t}: {} vs {}",
                out.entropy[t],
                ent[t]
            );
        }
    }
}
