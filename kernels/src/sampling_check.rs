//! The sampling rule's device check, shared by the parity tests (`kernels/tests/parity.rs`, on
//! flex and lavapipe) and `conrub kernels-check` (on a GPU, `scripts/gpu-check.sh`): a backend's
//! [`DecodeOps::sample_rows`] against the host rule [`sample_row`] over
//! [`Decoding::checked_modes`], and the repetition penalty where the logits are
//! ([`penalize_rows_by_tensors`]) against [`penalize_row`].

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};

use crate::sampling::{penalize_row, penalize_rows_by_tensors, sample_row, Decoding};
use crate::{DecodeOps, KernelError};

/// What one mode's check found.
#[derive(Debug, Clone)]
pub struct ModeCheck {
    /// The settings checked.
    pub params: Decoding,
    /// Rows whose token equals the host rule's (the others were within f32 rounding of a token
    /// boundary and drew a neighbour whose interval holds the draw up to that rounding).
    pub exact: usize,
    /// Rows checked.
    pub rows: usize,
}

/// `n` normal values of standard deviation `std` from the stream `seed` (Box-Muller over an
/// xorshift generator: no dependency, the same values on every machine).
fn normals(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut unit = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    };
    (0..n)
        .map(|_| {
            let (u1, u2) = (unit(), unit());
            std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
        })
        .collect()
}

/// The check's rows (wide and peaked logits, a row with masked `-inf` ids at both ends) on the
/// host, and as a strided `[rows, vocab]` view (a `[vocab, rows]` tensor transposed) on `device`.
fn check_rows<B: Backend>(
    device: &B::Device,
    vocab: usize,
    seed: u64,
) -> (Vec<Vec<f32>>, Tensor<B, 2>) {
    let std = [3.0, 1.0, 6.0, 0.3, 3.0, 2.0];
    let mut rows: Vec<Vec<f32>> = std
        .iter()
        .enumerate()
        .map(|(r, &sd)| normals(vocab, seed + r as u64, sd))
        .collect();
    let masked = vocab.min(40);
    for x in rows[4][..masked / 2].iter_mut() {
        *x = f32::NEG_INFINITY;
    }
    for x in rows[4][vocab - masked / 2..].iter_mut() {
        *x = f32::NEG_INFINITY;
    }
    let n = rows.len();
    let col_major: Vec<f32> = (0..vocab)
        .flat_map(|v| rows.iter().map(move |r| r[v]))
        .collect();
    let logits =
        Tensor::<B, 2>::from_data(TensorData::new(col_major, [vocab, n]), device).transpose();
    (rows, logits)
}

/// Fills and frees buffers of NaN so a kernel that leaves an output unwritten reads garbage.
fn poison<B: Backend>(n: usize, device: &B::Device) {
    let _ = Tensor::<B, 1>::full([n], f32::NAN, device).into_data();
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
fn restricted_draw_within_rounding(row: &[f32], params: &Decoding, u: f64, tok: usize) -> bool {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let inv_t = 1.0 / params.params().temperature;
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(params.params().top_k.unwrap_or(row.len()).min(row.len()));
    let w: Vec<f64> = idx
        .iter()
        .map(|&i| ((row[i] as f64 - max) * inv_t).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut keep = w.len();
    if params.params().top_p < 1.0 {
        let mut acc = 0.0;
        for (n, x) in w.iter().enumerate() {
            acc += x / total;
            if acc >= params.params().top_p - 1e-5 {
                keep = (n + 2).min(w.len());
                break;
            }
        }
    }
    // Min-p's boundary within f32 rounding of the threshold: any count from `lo` to `hi`
    // (top-p's already widened by one).
    let (mut lo, mut hi) = (keep.saturating_sub(1).max(1), keep);
    if params.params().min_p > 0.0 {
        let count = |m: f64| w.iter().take_while(|&&x| x >= m).count().max(1);
        let strict = count(params.params().min_p * (1.0 + 1e-5));
        let loose = count(params.params().min_p * (1.0 - 1e-5));
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

/// [`DecodeOps::sample_rows`] on `device` against the host rule at `vocab`, for every one of
/// [`Decoding::checked_modes`]: greedy takes the host's token with its log-probability; a
/// draw takes the host's token wherever the host's f64 sums are not within f32 rounding of a
/// token boundary, and otherwise a token whose interval holds the draw up to that rounding; the
/// log-probability of the token drawn within 1e-4 of its f64 value. Draws near 0 and near 1.
/// The first disagreement is the error.
pub fn check_sample_rows<B: DecodeOps>(
    device: &B::Device,
    vocab: usize,
) -> Result<Vec<ModeCheck>, KernelError> {
    let (host_rows, logits) = check_rows::<B>(device, vocab, 11 + vocab as u64);
    let rows = host_rows.len();
    // 1 - 1e-9 rounds to 1.0 in f32 (the kernel keeps it inside).
    let uniforms = [1e-7, 0.25, 0.5, 0.75, 0.999_999, 1.0 - 1e-9];
    let mut report = Vec::new();
    for params in crate::sampling::checked_modes(vocab) {
        poison::<B>(rows * 2, device);
        let (tok, lp) =
            B::sample_rows(logits.clone().into_primitive().tensor(), &params, &uniforms);
        let tok: Vec<i64> = Tensor::<B, 1, Int>::from_primitive(tok)
            .into_data()
            .convert::<i64>()
            .into_vec()
            .map_err(|e| KernelError::Check(format!("{e:?}")))?;
        let lp: Vec<f32> = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(lp))
            .into_data()
            .convert::<f32>()
            .into_vec()
            .map_err(|e| KernelError::Check(format!("{e:?}")))?;
        let mut exact = 0;
        for r in 0..rows {
            let row = &host_rows[r];
            let (want_tok, want_lp) = sample_row(row, &params, uniforms[r]);
            let t = tok[r] as usize;
            let fail = |what: String| {
                Err(KernelError::Check(format!(
                    "{params:?} at vocab {vocab}, row {r}: {what}"
                )))
            };
            if t >= vocab {
                return fail(format!("token {t} out of range"));
            }
            if t == want_tok as usize {
                exact += 1;
                if (lp[r] - want_lp).abs() >= 1e-4 {
                    return fail(format!("log-prob {} vs host {want_lp}", lp[r]));
                }
                continue;
            }
            if params.is_greedy() {
                return fail(format!("greedy token {t} vs host {want_tok}"));
            }
            let inv_t = 1.0 / params.params().temperature;
            if crate::sampling::restricted(&params, vocab) {
                if !restricted_draw_within_rounding(row, &params, uniforms[r], t) {
                    return fail(format!(
                        "token {t} is not the draw {} (host {want_tok})",
                        uniforms[r]
                    ));
                }
                continue;
            }
            if !draw_within_rounding(row, inv_t, uniforms[r], t) {
                return fail(format!(
                    "token {t} is not the draw {} (host {want_tok})",
                    uniforms[r]
                ));
            }
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = row
                .iter()
                .map(|&x| ((x as f64 - max) * inv_t).exp())
                .sum::<f64>()
                .ln();
            let own = (row[t] as f64 - max) * inv_t - lse;
            if (lp[r] as f64 - own).abs() >= 1e-4 {
                return fail(format!("log-prob {} vs {own}", lp[r]));
            }
        }
        report.push(ModeCheck {
            params,
            exact,
            rows,
        });
    }
    Ok(report)
}

/// The repetition penalty on `device` ([`penalize_rows_by_tensors`]: one gather and one scatter
/// of the seen `(row, id)` pairs) against [`penalize_row`], to `ulps` units in the last place (0
/// on the CPU and lavapipe; Vulkan and CUDA's fast paths may round a GPU's f32 division within
/// 2.5), at penalties 1.3 and 0.8, on the strided view: rows that saw nothing, the row's top id,
/// a `-inf` id, ids at both ends of the vocabulary, and a long history.
pub fn check_penalty<B: Backend>(
    device: &B::Device,
    vocab: usize,
    ulps: i64,
) -> Result<(), KernelError> {
    let (host_rows, logits) = check_rows::<B>(device, vocab, 5 + vocab as u64);
    let top = |r: &Vec<f32>| {
        (0..vocab)
            .max_by(|&a, &b| r[a].total_cmp(&r[b]))
            .unwrap_or(0) as u32
    };
    let mut long: Vec<u32> = (0..vocab.min(3000) as u32)
        .map(|i| (i * 7919) % vocab as u32)
        .collect();
    long.sort_unstable();
    long.dedup();
    let edges = vec![0, (vocab - 1) as u32, top(&host_rows[4]), 1];
    let seen: Vec<Vec<u32>> = vec![
        vec![],
        vec![top(&host_rows[1])],
        edges.clone(),
        long,
        edges,
        vec![top(&host_rows[5]), 2],
    ];
    let mut seen: Vec<Vec<u32>> = seen
        .into_iter()
        .map(|mut s| {
            s.sort_unstable();
            s.dedup();
            s
        })
        .collect();
    seen.truncate(host_rows.len());
    let views: Vec<&[u32]> = seen.iter().map(Vec::as_slice).collect();
    for penalty in [1.3f32, 0.8] {
        let got: Vec<f32> = penalize_rows_by_tensors(logits.clone(), &views, penalty)
            .into_data()
            .convert::<f32>()
            .into_vec()
            .map_err(|e| KernelError::Check(format!("{e:?}")))?;
        for (r, row) in host_rows.iter().enumerate() {
            let mut want = row.clone();
            penalize_row(&mut want, &seen[r], penalty);
            let got = &got[r * vocab..(r + 1) * vocab];
            let far = got.iter().zip(&want).position(|(a, b)| {
                a.to_bits() != b.to_bits() && (a.to_bits() as i64 - b.to_bits() as i64).abs() > ulps
            });
            if let Some(id) = far {
                return Err(KernelError::Check(format!(
                    "repetition penalty {penalty} at vocab {vocab}, row {r}, id {id}: {} vs the host rule's {}",
                    got[id], want[id]
                )));
            }
        }
    }
    Ok(())
}
