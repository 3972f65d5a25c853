//! The fused ops against the textbook formulas under plain burn autodiff, and the kernels against
//! the portable fallback on the same backend: values and gradients in f32, relative error
//! (max |difference| / max |reference|) at most 1e-5. Shapes are awkward on purpose: the full
//! Qwen3 vocabulary (151,936), token counts that are no multiple of the chunk or the thread block,
//! responses longer than a block, an empty mask row, and ratios beyond both clip bounds.
//! Output memory is poisoned with NaN before each run, so an unwritten element fails.
//!
//! Runs on flex always and on wgpu with `--features wgpu` (in CI: Mesa's lavapipe; without a
//! Vulkan adapter the wgpu test skips loudly, or fails under `CONRUB_REQUIRE_WGPU=1`).

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use conrub_kernels::reference::{
    naive_clipped_surrogate, naive_entropy, naive_token_logprobs, relative_error,
};
use conrub_kernels::{clipped_surrogate, fallback, token_logprobs, Clip, GrpoOps, Reduce};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr_free::normal;

/// Qwen3's vocabulary, the size the CPU backends are checked at.
const VOCAB: usize = 151_936;
/// The vocabulary of the lavapipe checks: 32 row blocks of 256 plus a remainder of 3, so every
/// path of the kernels (whole blocks, the partial last block, the first and last ids) runs at a
/// twentieth of the full head's cost on a software Vulkan device.
#[cfg(feature = "wgpu")]
const WGPU_VOCAB: usize = 8_195;
const TOL: f64 = 1e-5;

mod rand_distr_free {
    use rand::Rng;
    /// Box-Muller normal sample.
    pub fn normal(rng: &mut impl Rng, mean: f32, std: f32) -> f32 {
        let u1: f32 = rng.random_range(f32::EPSILON..1.0);
        let u2: f32 = rng.random();
        mean + std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert!(
        got.iter().all(|x| x.is_finite()),
        "non-finite output (unwritten, poisoned memory?)"
    );
    relative_error(got, want)
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    let e = rel_err(got, want);
    println!("  {what}: relative error {e:.2e}");
    assert!(e <= TOL, "{what}: relative error {e:.3e} > {TOL:.0e}");
}

/// Fills freed device memory with NaN so that reused buffers start poisoned.
fn poison<B: Backend>(sizes: &[usize], device: &B::Device) {
    for &n in sizes {
        let t = Tensor::<B, 1>::full([n], f32::NAN, device);
        let _ = t.into_data();
    }
}

fn float1<B: Backend>(t: burn::tensor::ops::FloatTensor<B>) -> Tensor<B, 1> {
    Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(t))
}

/// `[log p(target), entropy, log-sum-exp]` per row, in f64 on the host.
fn host_row_stats(x: &[f32], targets: &[i64], vocab: usize) -> [Vec<f32>; 3] {
    let mut want = [Vec::new(), Vec::new(), Vec::new()];
    for (r, t) in targets.iter().enumerate() {
        let row: Vec<f64> = x[r * vocab..(r + 1) * vocab]
            .iter()
            .map(|v| *v as f64)
            .collect();
        let m = row.iter().cloned().fold(f64::MIN, f64::max);
        let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
        let lse = m + s.ln();
        let px: f64 = row.iter().map(|v| (v - m).exp() / s * v).sum();
        want[0].push((row[*t as usize] - lse) as f32);
        want[1].push((lse - px) as f32);
        want[2].push(lse as f32);
    }
    want
}

fn random<B: Backend, const D: usize>(
    rng: &mut ChaCha8Rng,
    shape: [usize; D],
    mean: f32,
    std: f32,
    device: &B::Device,
) -> Tensor<B, D> {
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| normal(rng, mean, std)).collect();
    Tensor::from_data(TensorData::new(v, shape), device)
}

/// `token_logprobs` (values, entropy, gradients of hidden and head) against `log_softmax.gather`
/// under autodiff, for a token count that leaves a partial last chunk.
///
/// Values are held to 1e-5 against f64 on the host. Gradients are held to `grad_tol` against f64
/// and against burn's textbook autodiff on the same backend: 1e-5 on CPU; on wgpu the hidden-state
/// gradient is a 151,936-term f32 dot product inside burn's matmul (ours and the textbook's alike),
/// which lands ~5e-5 from f64 on lavapipe, so the bound there is 1e-4.
pub fn token_logprobs_matches_autodiff<B: GrpoOps>(
    device: &B::Device,
    vocab: usize,
    tokens: usize,
    hidden: usize,
    chunk: usize,
    grad_tol: f64,
) {
    type A<B> = Autodiff<B>;
    let mut rng = ChaCha8Rng::seed_from_u64(tokens as u64);
    let h0 = random::<B, 2>(&mut rng, [tokens, hidden], 0.0, 1.0, device);
    let w0 = random::<B, 2>(&mut rng, [vocab, hidden], 0.0, 0.5, device);
    // Targets include the first and last vocabulary ids.
    let mut t: Vec<i64> = (0..tokens)
        .map(|_| rng.random_range(0..vocab as i64))
        .collect();
    t[0] = 0;
    t[tokens - 1] = vocab as i64 - 1;
    let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(t, [tokens]), device);
    let g = random::<B, 1>(&mut rng, [tokens], 0.0, 1.0, device);

    let run = |fused: bool| {
        let h = Tensor::<A<B>, 2>::from_inner(h0.clone()).require_grad();
        let w = Tensor::<A<B>, 2>::from_inner(w0.clone()).require_grad();
        let tt = Tensor::<A<B>, 1, Int>::from_inner(targets.clone());
        let (lp, ent) = if fused {
            poison::<B>(&[tokens, tokens * 3, chunk * vocab, vocab * hidden], device);
            let out = token_logprobs(h.clone(), w.clone(), tt, chunk);
            (out.logprobs, Some(out.entropy))
        } else {
            (naive_token_logprobs(h.clone(), w.clone(), tt), None)
        };
        let grads = (lp.clone() * Tensor::from_inner(g.clone()))
            .sum()
            .backward();
        let gh = h.grad(&grads).unwrap();
        let gw = w.grad(&grads).unwrap();
        (
            host(lp.inner()),
            ent.map(|e| host(e.inner())),
            host(gh),
            host(gw),
        )
    };
    let (lp, ent, gh, gw) = run(true);
    let (lp_ref, _, gh_ref, gw_ref) = run(false);
    // Entropy against f64 on the host (burn's f32 reductions are not precise enough to judge it).
    let (hh, wh) = (host(h0.clone()), host(w0.clone()));
    let mut logits = vec![0f32; tokens * vocab];
    for t in 0..tokens {
        for v in 0..vocab {
            logits[t * vocab + v] = (0..hidden)
                .map(|k| hh[t * hidden + k] as f64 * wh[v * hidden + k] as f64)
                .sum::<f64>() as f32;
        }
    }
    let tv: Vec<i64> = targets.into_data().convert::<i64>().into_vec().unwrap();
    let want = host_row_stats(&logits, &tv, vocab);
    println!(
        "  textbook log-probabilities on this backend vs f64: {:.2e}",
        rel_err(&lp_ref, &want[0])
    );
    assert_close("log-probabilities vs f64", &lp, &want[0]);
    // f64 gradients: d h[t] = g[t] (W[target_t] - sum_v p W[v]); d W[v] = sum_t g[t] (1[v = target_t] - p) h[t].
    let gv = host(g.clone());
    let mut gh64 = vec![0f64; tokens * hidden];
    let mut gw64 = vec![0f64; vocab * hidden];
    for t in 0..tokens {
        let row = &logits[t * vocab..(t + 1) * vocab];
        let lse = (want[2][t]) as f64;
        let lse = {
            let m = row.iter().fold(f64::MIN, |m, x| m.max(*x as f64));
            let s: f64 = row.iter().map(|x| (*x as f64 - m).exp()).sum();
            let _ = lse;
            m + s.ln()
        };
        for v in 0..vocab {
            let d = gv[t] as f64 * ((v as i64 == tv[t]) as u8 as f64 - (row[v] as f64 - lse).exp());
            for k in 0..hidden {
                gh64[t * hidden + k] += d * wh[v * hidden + k] as f64;
                gw64[v * hidden + k] += d * hh[t * hidden + k] as f64;
            }
        }
    }
    let f32s = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
    let (gh64, gw64) = (f32s(gh64), f32s(gw64));
    let check = |what: &str, a: &[f32], b: &[f32], truth: &[f32], tol: f64| {
        let (e, ef, et) = (rel_err(a, b), rel_err(a, truth), rel_err(b, truth));
        println!("  {what}: fused vs textbook autodiff {e:.2e}, fused vs f64 {ef:.2e}, textbook vs f64 {et:.2e}");
        assert!(
            e <= tol && ef <= tol,
            "{what}: {e:.3e} / {ef:.3e} > {tol:.0e}"
        );
    };
    check("log-probabilities", &lp, &lp_ref, &want[0], TOL);
    check("d hidden", &gh, &gh_ref, &gh64, grad_tol);
    check("d head weight", &gw, &gw_ref, &gw64, grad_tol);
    assert_close("entropy vs f64", &ent.unwrap(), &want[1]);
    let naive_ent = host(naive_entropy(h0, w0));
    println!(
        "  (textbook entropy in f32 on this backend vs f64: {:.2e})",
        rel_err(&naive_ent, &want[1])
    );
}

/// The backend's row hooks against the fallback on the same backend, on a strided (transposed)
/// logits view.
pub fn row_hooks_match_fallback<B: GrpoOps>(device: &B::Device, vocab: usize, rows: usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(7 + rows as u64);
    // `[vocab, rows]` transposed to a `[rows, vocab]` view with strides (1, rows).
    let logits = random::<B, 2>(&mut rng, [vocab, rows], 0.0, 3.0, device).transpose();
    let t: Vec<i64> = (0..rows)
        .map(|_| rng.random_range(0..vocab as i64))
        .collect();
    let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(t, [rows]), device);
    let g = random::<B, 1>(&mut rng, [rows], 0.0, 1.0, device);
    let prim = |x: Tensor<B, 2>| x.into_primitive().tensor();
    poison::<B>(&[rows, rows, rows, rows * vocab], device);
    let want = host_row_stats(
        &host(logits.clone()),
        &targets
            .clone()
            .into_data()
            .convert::<i64>()
            .into_vec()
            .unwrap(),
        vocab,
    );
    let got = B::logits_row_stats(prim(logits.clone()), targets.clone().into_primitive());
    let fb =
        fallback::logits_row_stats::<B>(prim(logits.clone()), targets.clone().into_primitive());
    for (i, (name, (a, b))) in ["log-probabilities", "entropy", "log-sum-exp"]
        .iter()
        .zip(got.into_iter().zip(fb))
        .enumerate()
    {
        let (a, b) = (host(float1::<B>(a)), host(float1::<B>(b)));
        assert_close(&format!("row {name}, backend hook vs f64"), &a, &want[i]);
        // burn's own f32 reductions on wgpu lose ~1e-4 on the entropy (a difference of two sums over
        // 151,936 terms): the fallback is held to its own precision there, the hook to 1e-5.
        let e = rel_err(&b, &want[i]);
        println!("  row {name}, fallback vs f64: relative error {e:.2e}");
        assert!(
            e <= if i == 1 { 5e-4 } else { TOL },
            "fallback {name}: {e:.3e}"
        );
    }
    let lse =
        fallback::logits_row_stats::<B>(prim(logits.clone()), targets.clone().into_primitive())[2]
            .clone();
    let gl = B::logits_grad(
        prim(logits.clone()),
        targets.clone().into_primitive(),
        lse.clone(),
        g.clone().into_primitive().tensor(),
    );
    let gl_ref = fallback::logits_grad::<B>(
        prim(logits),
        targets.into_primitive(),
        lse,
        g.into_primitive().tensor(),
    );
    let (a, b): (Tensor<B, 2>, Tensor<B, 2>) = (
        Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(gl)),
        Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(gl_ref)),
    );
    assert_close("logit gradients", &host(a), &host(b));
}

/// Whether `tok` is the host rule's draw for `u` up to f32 rounding of the cumulative sums:
/// `u x total` falls inside `tok`'s interval of the f64 cumulative distribution widened by
/// `1e-5 x total` (the kernel adds 151,936 f32 weights in chunks; the host adds f64 in order).
fn draw_within_rounding(row: &[f32], inv_t: f64, u: f64, tok: usize) -> bool {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w: Vec<f64> = row
        .iter()
        .map(|&x| ((x as f64 - max) * inv_t).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let before: f64 = w[..tok].iter().sum();
    let target = u * total;
    let slack = 1e-5 * total;
    before - slack <= target && target < before + w[tok] + slack
}

/// Whether `tok` is the restricted (top-k / top-p) draw `u` of `row` up to f32 rounding: the
/// host rule's kept prefix (descending logit, ties by id) in f64, widened by one id where the
/// top-p share is within 1e-5 of its threshold, must hold `tok`, and the weight before `tok` in
/// that order must bracket `u x kept` within 1e-5 of the kept weight.
fn restricted_draw_within_rounding(
    row: &[f32],
    params: &conrub_kernels::sampling::SampleParams,
    u: f64,
    tok: usize,
) -> bool {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let inv_t = 1.0 / params.temperature;
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(params.top_k.unwrap_or(row.len()).min(row.len()));
    let w: Vec<f64> = idx
        .iter()
        .map(|&i| ((row[i] as f64 - max) * inv_t).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut keep = w.len();
    if params.top_p < 1.0 {
        let mut acc = 0.0;
        for (n, x) in w.iter().enumerate() {
            acc += x / total;
            if acc >= params.top_p - 1e-5 {
                keep = (n + 2).min(w.len());
                break;
            }
        }
    }
    // Min-p's boundary within f32 rounding of the threshold: any count from `lo` to `hi`
    // (top-p's already widened by one).
    let (mut lo, mut hi) = (keep.saturating_sub(1).max(1), keep);
    if params.min_p > 0.0 {
        let count = |m: f64| w.iter().take_while(|&&x| x >= m).count().max(1);
        let strict = count(params.min_p * (1.0 + 1e-5));
        let loose = count(params.min_p * (1.0 - 1e-5));
        hi = hi.min(loose);
        lo = lo.min(strict).min(hi);
    }
    let keep = hi;
    let Some(pos) = idx[..keep].iter().position(|&i| i == tok) else {
        return false;
    };
    // Both ends of the widened prefix as the kept weight.
    let lo_total: f64 = w[..lo].iter().sum();
    let hi_total: f64 = w[..keep].iter().sum();
    let before: f64 = w[..pos].iter().sum();
    [lo_total, hi_total].iter().any(|&kept| {
        let slack = 1e-5 * kept;
        let target = u * kept;
        before - slack <= target && target < before + w[pos] + slack
    })
}

/// `DecodeOps::sample_rows` against the host rule ([`conrub_kernels::sampling::sample_row`]) at
/// `vocab`, on a strided (transposed) view: greedy takes the host's token with its
/// log-probability; a draw from the whole distribution (temperature 1 and 0.7) takes the host's
/// token wherever the host's f64 sums are not within f32 rounding of a token boundary, and a
/// token whose interval holds the draw up to that rounding everywhere; log-probabilities within
/// 1e-4 of the f64 value of the token drawn. Rows: wide and peaked logits, a row with masked
/// (-inf) ids at both ends, draws near 0 and near 1.
pub fn sampling_matches_host_rule<B: GrpoOps>(device: &B::Device, vocab: usize) {
    use conrub_kernels::sampling::{sample_row, SampleParams};
    let rows = 6;
    let mut rng = ChaCha8Rng::seed_from_u64(11 + vocab as u64);
    let std = [3.0, 1.0, 6.0, 0.3, 3.0, 2.0];
    let mut host_rows: Vec<Vec<f32>> = (0..rows)
        .map(|r| (0..vocab).map(|_| normal(&mut rng, 0.0, std[r])).collect())
        .collect();
    let masked = vocab.min(40);
    for x in host_rows[4][..masked / 2].iter_mut() {
        *x = f32::NEG_INFINITY;
    }
    for x in host_rows[4][vocab - masked / 2..].iter_mut() {
        *x = f32::NEG_INFINITY;
    }
    // `[vocab, rows]` transposed to a `[rows, vocab]` view with strides (1, rows).
    let col_major: Vec<f32> = (0..vocab)
        .flat_map(|v| host_rows.iter().map(move |r| r[v]))
        .collect();
    let logits =
        Tensor::<B, 2>::from_data(TensorData::new(col_major, [vocab, rows]), device).transpose();
    // Draws near both ends: 1 - 1e-9 rounds to 1.0 in f32 (the kernel keeps it inside).
    let uniforms = [1e-7, 0.25, 0.5, 0.75, 0.999_999, 1.0 - 1e-9];
    let modes = SampleParams::checked_modes(vocab);
    for params in &modes {
        poison::<B>(&[rows, rows], device);
        let (tok, lp) = B::sample_rows(logits.clone().into_primitive().tensor(), params, &uniforms);
        let tok: Vec<i64> = Tensor::<B, 1, Int>::from_primitive(tok)
            .into_data()
            .convert::<i64>()
            .into_vec()
            .unwrap();
        let lp = host(float1::<B>(lp));
        let mut exact = 0;
        for r in 0..rows {
            let row = &host_rows[r];
            let (want_tok, want_lp) = sample_row(row, params, uniforms[r]);
            let t = tok[r] as usize;
            assert!(t < vocab, "{params:?} row {r}: token {t} out of range");
            if t == want_tok as usize {
                exact += 1;
                assert!(
                    (lp[r] - want_lp).abs() < 1e-4,
                    "{params:?} row {r}: log-prob {} vs host {want_lp}",
                    lp[r]
                );
                continue;
            }
            assert!(
                !params.greedy,
                "greedy row {r}: token {t} vs host {want_tok}"
            );
            let inv_t = 1.0 / params.temperature;
            if params.restricted(vocab) {
                assert!(
                    restricted_draw_within_rounding(row, params, uniforms[r], t),
                    "{params:?} row {r}: token {t} is not the draw {} (host {want_tok})",
                    uniforms[r]
                );
                continue;
            }
            assert!(
                draw_within_rounding(row, inv_t, uniforms[r], t),
                "{params:?} row {r}: token {t} is not the draw {} (host {want_tok})",
                uniforms[r]
            );
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = row
                .iter()
                .map(|&x| ((x as f64 - max) * inv_t).exp())
                .sum::<f64>()
                .ln();
            let own = (row[t] as f64 - max) * inv_t - lse;
            assert!(
                (lp[r] as f64 - own).abs() < 1e-4,
                "{params:?} row {r}: log-prob {} vs {own}",
                lp[r]
            );
        }
        println!("  sampling {params:?} at vocab {vocab}: {exact}/{rows} tokens equal to the host rule's, the rest within f32 rounding");
    }
}

/// The repetition penalty where the logits are (`penalize_rows_by_tensors`: one gather and one
/// scatter of the seen `(row, id)` pairs) against the host rule, to `ulps`, on a strided
/// `[rows, vocab]` view: rows that saw nothing, one id, the row's top id, `-inf` ids, ids at
/// both ends of the vocabulary and a long history.
pub fn penalty_matches_host_rule<B: Backend>(device: &B::Device, vocab: usize, ulps: i64) {
    use conrub_kernels::sampling::{penalize_row, penalize_rows_by_tensors};
    let rows = 4;
    let mut rng = ChaCha8Rng::seed_from_u64(5 + vocab as u64);
    let mut host_rows: Vec<Vec<f32>> = (0..rows)
        .map(|_| (0..vocab).map(|_| normal(&mut rng, 0.0, 3.0)).collect())
        .collect();
    host_rows[2][1] = f32::NEG_INFINITY;
    let top = |r: &Vec<f32>| (0..vocab).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap() as u32;
    let long: Vec<u32> = (0..vocab.min(3000) as u32)
        .map(|i| (i * 7919) % vocab as u32)
        .collect();
    let mut long = long;
    long.sort_unstable();
    long.dedup();
    let seen: Vec<Vec<u32>> = vec![
        vec![],
        vec![top(&host_rows[1])],
        vec![0, 1, (vocab - 1) as u32, top(&host_rows[2])],
        long,
    ];
    let col_major: Vec<f32> = (0..vocab)
        .flat_map(|v| host_rows.iter().map(move |r| r[v]))
        .collect();
    let logits =
        Tensor::<B, 2>::from_data(TensorData::new(col_major, [vocab, rows]), device).transpose();
    let views: Vec<&[u32]> = seen.iter().map(Vec::as_slice).collect();
    for penalty in [1.3f32, 0.8] {
        let got = penalize_rows_by_tensors(logits.clone(), &views, penalty)
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .unwrap();
        for (r, row) in host_rows.iter().enumerate() {
            let mut want = row.clone();
            penalize_row(&mut want, &seen[r], penalty);
            let got = &got[r * vocab..(r + 1) * vocab];
            // Within `ulps` units in the last place: 0 on the CPU; Vulkan lets a GPU's f32
            // division be off by up to 2.5.
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| (a.to_bits() as i64 - b.to_bits() as i64).abs() <= ulps);
            assert!(
                same,
                "penalty {penalty} row {r}: differs from the host rule"
            );
        }
    }
}

/// `clipped_surrogate` (loss, gradient, clip counts) against the textbook formula under autodiff.
pub fn surrogate_matches_autodiff<B: GrpoOps>(device: &B::Device, len: usize) {
    type A<B> = Autodiff<B>;
    let n = 6;
    let mut rng = ChaCha8Rng::seed_from_u64(100 + len as u64);
    let logp0 = random::<B, 2>(&mut rng, [n, len], -2.0, 1.0, device);
    let delta = random::<B, 2>(&mut rng, [n, len], 0.0, 0.35, device);
    let old0 = logp0.clone() - delta;
    let adv_v = vec![1.2f32, -0.7, 0.5, -1.5, 0.0, 0.9];
    let adv = Tensor::<B, 1>::from_data(TensorData::new(adv_v.clone(), [n]), device);
    // Row 2 has no tokens; the others end at different lengths.
    let lens = [len, len / 2 + 1, 0, len - 1, 3, len / 3];
    let mut m = vec![0f32; n * len];
    for (i, l) in lens.iter().enumerate() {
        for j in 0..*l {
            m[i * len + j] = 1.0;
        }
    }
    let mask = Tensor::<B, 2>::from_data(TensorData::new(m.clone(), [n, len]), device);
    let g = random::<B, 1>(&mut rng, [n], 0.0, 1.0, device);
    let clip = Clip {
        low: 0.2,
        high: 0.28,
    };
    // Expected clip counts, from the host copies.
    let (lp_h, old_h) = (host(logp0.clone()), host(old0.clone()));
    let mut want_low = vec![0f32; n];
    let mut want_high = vec![0f32; n];
    for i in 0..n {
        for j in 0..len {
            let r = ((lp_h[i * len + j] - old_h[i * len + j]) as f64).exp();
            if m[i * len + j] > 0.0 {
                want_low[i] += (r < 0.8 && adv_v[i] < 0.0) as u8 as f32;
                want_high[i] += (r > 1.28 && adv_v[i] > 0.0) as u8 as f32;
            }
        }
    }
    assert!(
        want_low.iter().sum::<f32>() > 0.0 && want_high.iter().sum::<f32>() > 0.0,
        "both clip sides are hit"
    );
    for reduce in [Reduce::MeanPerResponse, Reduce::SumPerResponse] {
        let run = |fused: bool| {
            let lp = Tensor::<A<B>, 2>::from_inner(logp0.clone()).require_grad();
            let old = Tensor::<A<B>, 2>::from_inner(old0.clone());
            let a = Tensor::<A<B>, 1>::from_inner(adv.clone());
            let mk = Tensor::<A<B>, 2>::from_inner(mask.clone());
            let (loss, counts) = if fused {
                poison::<B>(&[n, n, n, n * len], device);
                let out = clipped_surrogate(lp.clone(), old, a, mk, clip, reduce);
                (
                    out.per_response,
                    Some((host(out.clip_low.inner()), host(out.clip_high.inner()))),
                )
            } else {
                (
                    naive_clipped_surrogate(lp.clone(), old, a, mk, clip, reduce),
                    None,
                )
            };
            let grads = (loss.clone() * Tensor::from_inner(g.clone()))
                .sum()
                .backward();
            (host(loss.inner()), host(lp.grad(&grads).unwrap()), counts)
        };
        let (loss, grad, counts) = run(true);
        let (loss_ref, grad_ref, _) = run(false);
        assert_close(&format!("{reduce:?} loss"), &loss, &loss_ref);
        assert_close(&format!("{reduce:?} d logp"), &grad, &grad_ref);
        assert_eq!(loss[2], 0.0, "the empty row contributes nothing");
        let (low, high) = counts.unwrap();
        assert_eq!(low, want_low, "low clip counts");
        assert_eq!(high, want_high, "high clip counts");
    }
}

#[cfg(feature = "flex")]
mod flex {
    use burn::backend::Flex;

    #[test]
    fn token_logprobs_on_flex() {
        super::token_logprobs_matches_autodiff::<Flex>(
            &Default::default(),
            super::VOCAB,
            37,
            24,
            16,
            1e-5,
        );
    }

    #[test]
    fn sampling_on_flex() {
        super::sampling_matches_host_rule::<Flex>(&Default::default(), super::VOCAB);
        super::penalty_matches_host_rule::<Flex>(&Default::default(), super::VOCAB, 0);
    }

    #[test]
    fn row_hooks_on_flex() {
        super::row_hooks_match_fallback::<Flex>(&Default::default(), super::VOCAB, 5);
    }

    #[test]
    fn surrogate_on_flex() {
        for len in [45, 300] {
            super::surrogate_matches_autodiff::<Flex>(&Default::default(), len);
        }
    }
}

/// libtorch's CPU device runs the portable fallback (`scripts/test-tch.sh`).
#[cfg(feature = "tch")]
mod tch {
    use burn::backend::LibTorch;

    #[test]
    fn token_logprobs_on_tch() {
        super::token_logprobs_matches_autodiff::<LibTorch<f32>>(
            &Default::default(),
            super::VOCAB,
            37,
            24,
            16,
            1e-5,
        );
    }

    #[test]
    fn row_hooks_on_tch() {
        super::row_hooks_match_fallback::<LibTorch<f32>>(&Default::default(), super::VOCAB, 5);
    }

    #[test]
    fn surrogate_on_tch() {
        for len in [45, 300] {
            super::surrogate_matches_autodiff::<LibTorch<f32>>(&Default::default(), len);
        }
    }
}

/// burn-ndarray runs the fused host head, like flex. The gradient bound is 1e-4 as on wgpu: the
/// textbook reference's hidden-state gradient is a 151,936-term f32 dot product in ndarray's
/// matmul, 5.1e-5 from f64 (the host head's is 1.3e-6 from f64).
#[cfg(feature = "ndarray")]
mod ndarray {
    use burn::backend::NdArray;

    #[test]
    fn token_logprobs_on_ndarray() {
        super::token_logprobs_matches_autodiff::<NdArray>(
            &Default::default(),
            super::VOCAB,
            37,
            24,
            16,
            1e-4,
        );
    }
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use burn::backend::wgpu::{Wgpu, WgpuDevice};
    use burn::tensor::backend::Backend;

    /// One test, so the kernels compile once per process; it names the adapter it ran on.
    #[test]
    fn kernels_on_wgpu() {
        if !conrub_kernels::wgpu_adapter_or_skip("kernels_on_wgpu") {
            return;
        }
        let device = WgpuDevice::DefaultDevice;
        println!(
            "wgpu kernels on backend `{}` (device {device:?})",
            <Wgpu as Backend>::name(&device)
        );
        super::row_hooks_match_fallback::<Wgpu>(&device, super::WGPU_VOCAB, 5);
        super::token_logprobs_matches_autodiff::<Wgpu>(
            &device,
            super::WGPU_VOCAB,
            37,
            24,
            16,
            1e-4,
        );
        for len in [45, 300] {
            super::surrogate_matches_autodiff::<Wgpu>(&device, len);
        }
        // The sampling kernel at the full vocabulary (two reads per logit), and at widths below
        // and just above one cube of units (empty chunks, a one-id last chunk).
        for vocab in [super::VOCAB, 100, 257] {
            super::sampling_matches_host_rule::<Wgpu>(&device, vocab);
        }
        // The repetition penalty's gather and scatter on the CubeCL backend.
        super::penalty_matches_host_rule::<Wgpu>(&device, super::VOCAB, 3);
        println!(
            "wgpu kernels: every check passed on `{}`",
            <Wgpu as Backend>::name(&device)
        );
    }
}
