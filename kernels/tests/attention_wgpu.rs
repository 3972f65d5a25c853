//! The CubeCL causal-attention kernels on wgpu against a naive reference on the CPU.
//!
//! For each case the kernels run twice on `burn::backend::Wgpu` (`Fusion<CubeBackend>`): through
//! `KernelOps::attention_forward` / `attention_backward` directly (values, `lse`, gradients), and
//! through the public, differentiable `causal_attention` under `Autodiff<Wgpu>`. The reference is
//! plain burn tensor ops under `Autodiff<Flex>` on the host (K/V repeated per query head, scores
//! plus a -1e30 bias, softmax, times V) for `out` and the gradients of `sum(out * d_out)`, and
//! f64 loops for `lse`. Rows that see no key have `d_out = 0` and are compared only for the
//! contract (`out = 0`, `lse = -1e30`, `dq = 0`); the rest is held to max |diff| / max |ref| <=
//! 1e-4 in f32 and 2e-2 for 16-bit inputs. `q`, `k` and `v` arrive as `swap_dims(1, 2)` views
//! of `[b, t, heads, d]` tensors (the layout a projection produces), so strides matter; freed
//! device memory is poisoned with NaN before each run, so an unwritten element fails.
//!
//! Without a Vulkan adapter the tests skip loudly (or fail under `CONRUB_REQUIRE_WGPU=1`).
#![cfg(feature = "wgpu")]

use burn::backend::wgpu::{Wgpu, WgpuDevice};
use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use conrub_kernels::{
    causal_attention, AttentionKernels, AttentionLayout, AttentionOps, ATTENTION_MASKED_LSE,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

type W = Wgpu;
type AW = Autodiff<Wgpu>;
type RA = Autodiff<Flex>;

const TOL_F32: f64 = 1e-4;
const TOL_16: f64 = 2e-2;

#[derive(Clone, Debug)]
struct Case {
    name: &'static str,
    b: usize,
    heads: usize,
    kv_heads: usize,
    t: usize,
    past: usize,
    /// Keys after the last query's position (never seen).
    extra_keys: usize,
    d: usize,
    /// Leading padding keys per batch row (`key_valid = 0`).
    pad: Vec<usize>,
    /// Interior padding keys (`key_valid = 0`) for every batch row.
    holes: Vec<usize>,
    /// The kernels that run it.
    kernels: AttentionKernels,
}

impl Case {
    fn s(&self) -> usize {
        self.past + self.t + self.extra_keys
    }
    fn valid(&self) -> Vec<f32> {
        let s = self.s();
        let mut m = vec![1f32; self.b * s];
        for bi in 0..self.b {
            for j in 0..self.pad[bi].min(s) {
                m[bi * s + j] = 0.0;
            }
            for &j in &self.holes {
                m[bi * s + j] = 0.0;
            }
        }
        m
    }
    /// `[b, t]`: whether query row i sees at least one key.
    fn row_visible(&self, valid: &[f32]) -> Vec<bool> {
        let s = self.s();
        let mut r = vec![false; self.b * self.t];
        for bi in 0..self.b {
            for i in 0..self.t {
                r[bi * self.t + i] = (0..=self.past + i).any(|j| valid[bi * s + j] > 0.5);
            }
        }
        r
    }
    fn layout(&self) -> AttentionLayout {
        AttentionLayout {
            past: self.past,
            scale: 1.0 / (self.d as f64).sqrt(),
            kernels: self.kernels,
        }
    }
}

/// Box-Muller normal sample.
fn normal(rng: &mut impl Rng, std: f32) -> f32 {
    let u1: f32 = rng.random_range(f32::EPSILON..1.0);
    let u2: f32 = rng.random();
    std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

fn float<B: Backend, const D: usize>(t: burn::tensor::ops::FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> burn::tensor::ops::FloatTensor<B> {
    t.into_primitive().tensor()
}

/// Fills freed device memory with NaN so that reused buffers start poisoned.
fn poison<B: Backend>(sizes: &[usize], device: &B::Device) {
    for &n in sizes {
        let _ = Tensor::<B, 1>::full([n], f32::NAN, device).into_data();
    }
}

/// Host inputs: `q` `[b, t, heads, d]`, `k`, `v` `[b, s, kv, d]`, `d_out` `[b, heads, t, d]` (zero on
/// rows that see no key), `key_valid` `[b, s]`.
struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_out: Vec<f32>,
    valid: Vec<f32>,
    visible: Vec<bool>,
}

fn inputs(c: &Case, seed: u64) -> Inputs {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let s = c.s();
    let mut gen = |n: usize, std: f32| (0..n).map(|_| normal(&mut rng, std)).collect::<Vec<f32>>();
    let q = gen(c.b * c.t * c.heads * c.d, 1.5);
    let k = gen(c.b * s * c.kv_heads * c.d, 1.5);
    let v = gen(c.b * s * c.kv_heads * c.d, 1.0);
    let mut d_out = gen(c.b * c.heads * c.t * c.d, 1.0);
    let valid = c.valid();
    let visible = c.row_visible(&valid);
    for bi in 0..c.b {
        for h in 0..c.heads {
            for i in 0..c.t {
                if !visible[bi * c.t + i] {
                    let o = ((bi * c.heads + h) * c.t + i) * c.d;
                    d_out[o..o + c.d].fill(0.0);
                }
            }
        }
    }
    Inputs {
        q,
        k,
        v,
        d_out,
        valid,
        visible,
    }
}

/// `[out, lse, dq, dk, dv]` in the logical layouts `[b, h, t, d]`, `[b, h, t]`, `[b, kv, s, d]`.
type Results = [Vec<f32>; 5];

/// The naive reference: burn ops under `Autodiff<Flex>` for out and the gradients, f64 for lse.
fn reference(c: &Case, x: &Inputs) -> Results {
    let dev = Default::default();
    let s = c.s();
    let g = c.heads / c.kv_heads;
    let scale = c.layout().scale;
    let q =
        Tensor::<RA, 4>::from_data(TensorData::new(x.q.clone(), [c.b, c.t, c.heads, c.d]), &dev)
            .require_grad();
    let k = Tensor::<RA, 4>::from_data(
        TensorData::new(x.k.clone(), [c.b, s, c.kv_heads, c.d]),
        &dev,
    )
    .require_grad();
    let v = Tensor::<RA, 4>::from_data(
        TensorData::new(x.v.clone(), [c.b, s, c.kv_heads, c.d]),
        &dev,
    )
    .require_grad();
    let rep = |t: Tensor<RA, 4>| {
        t.swap_dims(1, 2)
            .unsqueeze_dim::<5>(2)
            .repeat_dim(2, g)
            .reshape([c.b, c.heads, s, c.d])
    };
    let mut bias = vec![0f32; c.b * c.t * s];
    for bi in 0..c.b {
        for i in 0..c.t {
            for j in 0..s {
                if j > c.past + i || x.valid[bi * s + j] < 0.5 {
                    bias[(bi * c.t + i) * s + j] = -1.0e30;
                }
            }
        }
    }
    let bias = Tensor::<RA, 4>::from_data(TensorData::new(bias, [c.b, 1, c.t, s]), &dev);
    let scores = q
        .clone()
        .swap_dims(1, 2)
        .matmul(rep(k.clone()).swap_dims(2, 3))
        .mul_scalar(scale)
        + bias;
    let out = softmax(scores, 3).matmul(rep(v.clone()));
    let d_out = Tensor::<RA, 4>::from_data(
        TensorData::new(x.d_out.clone(), [c.b, c.heads, c.t, c.d]),
        &dev,
    );
    let grads = (out.clone() * d_out).sum().backward();
    let dq = host(q.grad(&grads).unwrap().swap_dims(1, 2));
    let dk = host(k.grad(&grads).unwrap().swap_dims(1, 2));
    let dv = host(v.grad(&grads).unwrap().swap_dims(1, 2));
    // lse in f64 on the host.
    let mut lse = vec![ATTENTION_MASKED_LSE; c.b * c.heads * c.t];
    for bi in 0..c.b {
        for h in 0..c.heads {
            let hk = h / g;
            for i in 0..c.t {
                let qo = ((bi * c.t + i) * c.heads + h) * c.d;
                let sc: Vec<f64> = (0..=c.past + i)
                    .filter(|&j| x.valid[bi * s + j] > 0.5)
                    .map(|j| {
                        let ko = ((bi * s + j) * c.kv_heads + hk) * c.d;
                        (0..c.d)
                            .map(|e| x.q[qo + e] as f64 * x.k[ko + e] as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                if !sc.is_empty() {
                    let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                    lse[(bi * c.heads + h) * c.t + i] =
                        (m + sc.iter().map(|v| (v - m).exp()).sum::<f64>().ln()) as f32;
                }
            }
        }
    }
    [host(out.inner()), lse, dq, dk, dv]
}

/// `q`, `k`, `v`, `key_valid`, `d_out` on the device.
type DeviceInputs = (
    Tensor<W, 4>,
    Tensor<W, 4>,
    Tensor<W, 4>,
    Tensor<W, 2>,
    Tensor<W, 4>,
);

/// Device tensors of the inputs in `dtype` (`key_valid` in f32), in the host layouts; the callers
/// pass `q`, `k`, `v` on as `swap_dims(1, 2)` views.
fn device_inputs(c: &Case, x: &Inputs, dtype: DType, dev: &WgpuDevice) -> DeviceInputs {
    let s = c.s();
    let mk = |v: &Vec<f32>, shape: [usize; 4]| {
        Tensor::<W, 4>::from_data(TensorData::new(v.clone(), shape), dev).cast(dtype)
    };
    let q = mk(&x.q, [c.b, c.t, c.heads, c.d]);
    let k = mk(&x.k, [c.b, s, c.kv_heads, c.d]);
    let v = mk(&x.v, [c.b, s, c.kv_heads, c.d]);
    let d_out = mk(&x.d_out, [c.b, c.heads, c.t, c.d]);
    let valid = Tensor::<W, 2>::from_data(TensorData::new(x.valid.clone(), [c.b, s]), dev);
    (q, k, v, valid, d_out)
}

/// The inputs as the device holds them (rounded to `dtype`), back on the host.
fn rounded(c: &Case, x: &Inputs, dtype: DType, dev: &WgpuDevice) -> Inputs {
    let (q, k, v, _, d_out) = device_inputs(c, x, dtype, dev);
    let f = |t: Tensor<W, 4>| host(t.cast(DType::F32));
    Inputs {
        q: f(q),
        k: f(k),
        v: f(v),
        d_out: f(d_out),
        valid: x.valid.clone(),
        visible: x.visible.clone(),
    }
}

fn poison_for(c: &Case, dev: &WgpuDevice) {
    let (s, n) = (c.s(), c.b * c.heads * c.t * c.d);
    let nk = c.b * c.kv_heads * s * c.d;
    poison::<W>(
        &[n, n, nk, nk, c.b * c.heads * c.t, c.b * c.heads * c.t],
        dev,
    );
}

/// `KernelOps::attention_forward` / `attention_backward` on `Wgpu` directly.
fn run_direct(c: &Case, x: &Inputs, dtype: DType, dev: &WgpuDevice) -> Results {
    let (q, k, v, valid, d_out) = device_inputs(c, x, dtype, dev);
    let (q, k, v) = (q.swap_dims(1, 2), k.swap_dims(1, 2), v.swap_dims(1, 2));
    poison_for(c, dev);
    let [out, lse] = W::attention_forward(
        prim(q.clone()),
        prim(k.clone()),
        prim(v.clone()),
        prim(valid.clone()),
        c.layout(),
    );
    let (out, lse): (Tensor<W, 4>, Tensor<W, 3>) = (float(out), float(lse));
    assert_eq!(out.dtype(), dtype, "out has q's dtype");
    assert_eq!(lse.dtype(), DType::F32, "lse is f32");
    poison_for(c, dev);
    let [dq, dk, dv] = W::attention_backward(
        prim(q),
        prim(k),
        prim(v),
        prim(valid),
        prim(out.clone()),
        prim(lse.clone()),
        prim(d_out),
        c.layout(),
    );
    let (dq, dk, dv): (Tensor<W, 4>, Tensor<W, 4>, Tensor<W, 4>) =
        (float(dq), float(dk), float(dv));
    for t in [&dq, &dk, &dv] {
        assert_eq!(t.dtype(), dtype, "gradients have the inputs' dtype");
    }
    [host(out), host(lse), host(dq), host(dk), host(dv)]
}

/// `causal_attention` under `Autodiff<Wgpu>`: out and the gradients of `sum(out * d_out)`.
fn run_autodiff(c: &Case, x: &Inputs, dtype: DType, dev: &WgpuDevice) -> [Vec<f32>; 4] {
    let (q, k, v, valid, d_out) = device_inputs(c, x, dtype, dev);
    let q = Tensor::<AW, 4>::from_inner(q).require_grad();
    let k = Tensor::<AW, 4>::from_inner(k).require_grad();
    let v = Tensor::<AW, 4>::from_inner(v).require_grad();
    poison_for(c, dev);
    let out = causal_attention(
        q.clone().swap_dims(1, 2),
        k.clone().swap_dims(1, 2),
        v.clone().swap_dims(1, 2),
        Tensor::<AW, 2>::from_inner(valid),
        c.layout(),
    );
    let grads = (out.clone() * Tensor::<AW, 4>::from_inner(d_out))
        .sum()
        .backward();
    let g = |t: &Tensor<AW, 4>| host(t.grad(&grads).expect("gradient").swap_dims(1, 2));
    [host(out.inner()), g(&q), g(&k), g(&v)]
}

/// max |got - want| / max |want| over the entries `keep` selects.
fn rel_err(got: &[f32], want: &[f32], keep: &impl Fn(usize) -> bool) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut diff, mut scale) = (0f64, 0f64);
    for i in (0..got.len()).filter(|&i| keep(i)) {
        assert!(
            got[i].is_finite(),
            "non-finite output at {i} (unwritten, poisoned memory?)"
        );
        diff = diff.max((got[i] as f64 - want[i] as f64).abs());
        scale = scale.max((want[i] as f64).abs());
    }
    diff / scale.max(1e-30)
}

/// Appends `what`'s relative error to `log`; past `tol` prints the log and the worst entries and
/// fails.
fn check(
    log: &mut String,
    what: &str,
    got: &[f32],
    want: &[f32],
    keep: impl Fn(usize) -> bool,
    tol: f64,
) -> f64 {
    let e = rel_err(got, want, &keep);
    log.push_str(&format!(" {what} {e:.1e}"));
    if e > tol {
        println!("{log}");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let bad: Vec<usize> = (0..got.len())
            .filter(|&i| keep(i) && ((got[i] - want[i]).abs() as f64) > tol * scale as f64)
            .collect();
        let show: Vec<(usize, f32, f32)> =
            bad.iter().take(8).map(|&i| (i, got[i], want[i])).collect();
        println!(
            "    {} of {} entries off, first (index, got, want): {show:?}",
            bad.len(),
            got.len()
        );
    }
    assert!(e <= tol, "{what}: relative error {e:.3e} > {tol:.0e}");
    e
}

/// Runs one case both ways and returns the largest relative error seen.
fn run_case(c: &Case, dtype: DType, dev: &WgpuDevice) -> f64 {
    let tol = if dtype == DType::F32 { TOL_F32 } else { TOL_16 };
    let mut log = format!("  case `{}` ({dtype:?}): {c:?}\n", c.name);
    let x0 = inputs(c, (c.t * 1000 + c.d * 10 + c.heads) as u64);
    let x = if dtype == DType::F32 {
        x0
    } else {
        rounded(c, &x0, dtype, dev)
    };
    let want = reference(c, &x);
    let (t, d) = (c.t, c.d);
    let vis = |row: usize| x.visible[(row / (c.heads * t)) * t + row % t];
    // Entry e of a [b, h, t, d] tensor lies in row e / d; of a [b, h, t] tensor in row e.
    let keep_rows = |e: usize| vis(e / d);
    let keep_lse = |e: usize| vis(e);
    let mut worst = 0f64;
    let masked = x.visible.iter().filter(|v| !**v).count();
    let got = run_direct(c, &x, dtype, dev);
    log.push_str(&format!("    ({masked} of {} (batch, row) pairs see no key)\n    AttentionOps::attention_{{forward, backward}}:", c.b * t));
    worst = worst.max(check(&mut log, "out", &got[0], &want[0], keep_rows, tol));
    worst = worst.max(check(&mut log, "lse", &got[1], &want[1], keep_lse, tol));
    worst = worst.max(check(&mut log, "dq", &got[2], &want[2], keep_rows, tol));
    worst = worst.max(check(&mut log, "dk", &got[3], &want[3], |_| true, tol));
    worst = worst.max(check(&mut log, "dv", &got[4], &want[4], |_| true, tol));
    for e in (0..got[0].len()).filter(|&e| !keep_rows(e)) {
        assert_eq!(got[0][e], 0.0, "out of a row that sees no key is 0");
        assert_eq!(got[2][e], 0.0, "dq of a row that sees no key is 0");
    }
    for e in (0..got[1].len()).filter(|&e| !keep_lse(e)) {
        assert_eq!(
            got[1][e], ATTENTION_MASKED_LSE,
            "lse of a row that sees no key"
        );
    }
    let got = run_autodiff(c, &x, dtype, dev);
    log.push_str("\n    causal_attention under Autodiff<Wgpu>:");
    worst = worst.max(check(&mut log, "out", &got[0], &want[0], keep_rows, tol));
    worst = worst.max(check(&mut log, "dq", &got[1], &want[2], keep_rows, tol));
    worst = worst.max(check(&mut log, "dk", &got[2], &want[3], |_| true, tol));
    worst = worst.max(check(&mut log, "dv", &got[3], &want[4], |_| true, tol));
    println!("{log}\n    worst {worst:.2e}");
    worst
}

fn device(test: &str) -> Option<WgpuDevice> {
    if !conrub_kernels::wgpu_adapter_or_skip(test) {
        return None;
    }
    let device = WgpuDevice::DefaultDevice;
    println!(
        "{test}: backend `{}` (device {device:?})",
        <W as Backend>::name(&device)
    );
    Some(device)
}

#[allow(clippy::too_many_arguments)]
fn case(
    name: &'static str,
    b: usize,
    heads: usize,
    kv_heads: usize,
    t: usize,
    past: usize,
    d: usize,
    pad: &[usize],
) -> Case {
    Case {
        name,
        b,
        heads,
        kv_heads,
        t,
        past,
        extra_keys: 0,
        d,
        pad: pad.to_vec(),
        holes: vec![],
        kernels: AttentionKernels::Portable,
    }
}

#[test]
fn attention_f32_head_dim_64() {
    let Some(dev) = device("attention_f32_head_dim_64") else {
        return;
    };
    let mut worst = 0f64;
    let cases = [
        // Left padding: batch row 1's first 5 keys are padding, so its rows 0..5 see no key.
        Case {
            holes: vec![20],
            ..case(
                "left padding, GQA 2, t = s = 37",
                2,
                4,
                2,
                37,
                0,
                64,
                &[0, 5],
            )
        },
        // Decode-like: 5 queries after 30 cached keys; row 1 pads past the cache, so its first 3
        // rows see nothing; every query head shares one key/value head.
        case("past 30, t 5, GQA 8", 2, 8, 1, 5, 30, 64, &[2, 33]),
        // Multi-head (group 1), keys beyond the last query, t and s no multiple of 16/32/64.
        Case {
            extra_keys: 4,
            ..case("MHA, past 7, 4 unseen keys", 2, 2, 2, 37, 7, 64, &[3, 0])
        },
    ];
    for c in &cases {
        worst = worst.max(run_case(c, DType::F32, &dev));
    }
    println!("attention_f32_head_dim_64: every check passed, worst relative error {worst:.2e}");
}

#[test]
fn attention_f32_head_dim_128() {
    let Some(dev) = device("attention_f32_head_dim_128") else {
        return;
    };
    let mut worst = 0f64;
    let cases = [
        // Longer than one block of 64 rows and one key tile; GQA 4.
        case("t = s = 100, GQA 4, padding", 2, 8, 2, 100, 0, 128, &[0, 9]),
        case("past 30, t 5, GQA 2", 1, 4, 2, 5, 30, 128, &[0]),
        // Ten key tiles per cube: more loop iterations per unit than lavapipe allows without the
        // kernels' partial unrolling (see `unroll_factor` in cube_attention.rs).
        case("t = s = 300, GQA 2", 1, 2, 1, 300, 0, 128, &[7]),
    ];
    for c in &cases {
        worst = worst.max(run_case(c, DType::F32, &dev));
    }
    println!("attention_f32_head_dim_128: every check passed, worst relative error {worst:.2e}");
}

#[test]
fn attention_f32_other_head_dims() {
    let Some(dev) = device("attention_f32_other_head_dims") else {
        return;
    };
    let mut worst = 0f64;
    let cases = [
        case("head_dim 256", 1, 2, 1, 20, 3, 256, &[2]),
        case("head_dim 40", 2, 4, 4, 19, 0, 40, &[0, 1]),
    ];
    for c in &cases {
        worst = worst.max(run_case(c, DType::F32, &dev));
    }
    println!("attention_f32_other_head_dims: every check passed, worst relative error {worst:.2e}");
}

/// 16-bit inputs (loads cast to f32, stores cast back): bf16 where the device has it, else f16.
/// burn's wgpu backend compiles WGSL, which has no bf16, so on lavapipe this runs in f16.
#[test]
fn attention_half_precision() {
    let Some(dev) = device("attention_half_precision") else {
        return;
    };
    let dtype = [DType::BF16, DType::F16]
        .into_iter()
        .find(|&d| W::supports_dtype(&dev, d));
    let Some(dtype) = dtype else {
        conrub_kernels::skip_or_fail(
            "attention_half_precision",
            "the wgpu device supports neither bf16 nor f16",
        );
        return;
    };
    println!("attention_half_precision: running in {dtype:?}");
    let c = case("16-bit, GQA 2, left padding", 2, 4, 2, 37, 0, 64, &[0, 4]);
    let worst = run_case(&c, dtype, &dev);
    println!("attention_half_precision: every check passed in {dtype:?}, worst relative error {worst:.2e}");
}

/// The tensor-core kernels' algorithm (`cube_flash.rs`: tiles staged in shared memory, 16-row
/// warp products, the online softmax by one unit per row, causal tiles skipped, the split dQ and
/// dK/dV backward) with its products computed by plain units: lavapipe has no cooperative
/// matrices, so this is what CI can run of those kernels. Same reference, same tolerances.
#[test]
fn tiled_kernels_match_the_reference() {
    let Some(dev) = device("tiled_kernels_match_the_reference") else {
        return;
    };
    let tiled = |c: Case| Case {
        kernels: AttentionKernels::TiledUnits,
        ..c
    };
    let mut worst = 0f64;
    let cases = [
        // Several query and key tiles, GQA 4, left padding and a hole.
        tiled(Case {
            holes: vec![20],
            ..case("tiled: t = s = 70, GQA 4", 2, 4, 1, 70, 0, 32, &[0, 9])
        }),
        // Queries after cached keys (some rows see nothing), keys past the last query: whole
        // key cubes that no query sees (their dK/dV are zeros without a query tile).
        tiled(Case {
            extra_keys: 40,
            ..case("tiled: past 30, t 21, MHA", 2, 2, 2, 21, 30, 32, &[2, 33])
        }),
        // head_dim 64, two query heads on one key/value head. (head_dim 128 does not fit
        // lavapipe's 32 KiB of shared memory even at 16 x 16 tiles, and `TiledUnits` refuses
        // rather than run the portable kernels: it runs in sm_90's compile check and on a GPU.)
        tiled(case("tiled: head_dim 64, GQA 2", 1, 2, 1, 24, 0, 64, &[3])),
    ];
    for c in &cases {
        worst = worst.max(run_case(c, DType::F32, &dev));
    }
    let half = [DType::BF16, DType::F16]
        .into_iter()
        .find(|&d| W::supports_dtype(&dev, d));
    if let Some(dtype) = half {
        let c = tiled(case("tiled: 16-bit, GQA 2", 2, 4, 2, 37, 0, 32, &[0, 4]));
        worst = worst.max(run_case(&c, dtype, &dev));
    }
    println!(
        "tiled_kernels_match_the_reference: every check passed, worst relative error {worst:.2e}"
    );
}

/// A device without cooperative matrices (lavapipe) has the tiled kernels but not the
/// tensor-core ones: `tensor-core` is an error naming what is missing, `auto` and `portable`
/// resolve to the portable kernels, and a `TensorCore` layout there runs the portable kernels.
#[test]
fn kernel_selection_follows_the_device() {
    use conrub_kernels::AttentionKernelChoice;
    let Some(dev) = device("kernel_selection_follows_the_device") else {
        return;
    };
    assert_eq!(
        conrub_kernels::resolve_attention_kernels::<W>(AttentionKernelChoice::Portable, &dev),
        Ok(AttentionKernels::Portable)
    );
    assert_eq!(
        conrub_kernels::resolve_attention_kernels::<W>(AttentionKernelChoice::Auto, &dev),
        Ok(AttentionKernels::Portable)
    );
    let err =
        conrub_kernels::resolve_attention_kernels::<W>(AttentionKernelChoice::TensorCore, &dev)
            .expect_err("lavapipe has no cooperative matrices")
            .to_string();
    assert!(
        err.contains("tensor-core") && err.contains("cooperative matrices") && err.contains("cmma"),
        "{err}"
    );
    assert_eq!(
        <W as AttentionOps>::check_attention_kernels(&dev, AttentionKernels::TiledUnits),
        Ok(())
    );
    // Asked for anyway, the tensor-core layout falls back to the portable kernels there.
    let c = Case {
        kernels: AttentionKernels::TensorCore,
        ..case("tensor-core layout on lavapipe", 1, 2, 1, 20, 0, 64, &[0])
    };
    run_case(&c, DType::F32, &dev);
}
