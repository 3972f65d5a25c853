//! Fused causal attention against the textbook formula under plain burn autodiff, on flex: the
//! output and the gradients of `sum(out * d_out)` with respect to q, k and v. Cases cover left
//! padding, lengths that are no multiple of the 256-row query block, queries after a KV prefix
//! (`past > 0`), GQA groups 1/2/4/8 and head_dim 64 and 128, plus bf16 inputs. Rows that see no key
//! are excluded from the comparison (the two definitions differ there on purpose) and get zero
//! `d_out`, as in the model, where padding positions never reach the loss.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use conrub_kernels::reference::{naive_causal_attention, relative_error, seeded_uniform};
use conrub_kernels::{causal_attention, AttentionLayout};

type A = Autodiff<Flex>;

#[derive(Debug, Clone, Copy)]
struct Case {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    t: usize,
    past: usize,
    head_dim: usize,
    /// Leading padding keys of the last batch row.
    pad: usize,
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap()
}

/// Keeps the elements of visible query rows only (`[b, heads, t, d]` layout).
fn visible_rows(x: &[f32], c: &Case, visible: &[bool]) -> Vec<f32> {
    let per_row = c.head_dim;
    x.chunks(per_row)
        .enumerate()
        .filter(|(i, _)| {
            let row = i % c.t;
            let b = i / (c.t * c.heads);
            visible[b * c.t + row]
        })
        .flat_map(|(_, r)| r.to_vec())
        .collect()
}

struct Outputs {
    out: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

fn run(c: Case, fused: bool, dtype: DType) -> (Outputs, Vec<bool>) {
    let dev = Default::default();
    let s = c.past + c.t;
    let (b, nh, nkv, d) = (c.batch, c.heads, c.kv_heads, c.head_dim);
    let mk = |n: usize, shape: [usize; 4], seed: u64| {
        Tensor::<A, 4>::from_data(TensorData::new(seeded_uniform(n, seed, 1.0), shape), &dev)
            .cast(dtype)
            .require_grad()
    };
    let q = mk(b * nh * c.t * d, [b, nh, c.t, d], 11);
    let k = mk(b * nkv * s * d, [b, nkv, s, d], 12);
    let v = mk(b * nkv * s * d, [b, nkv, s, d], 13);
    let mut valid = vec![1.0f32; b * s];
    for j in 0..c.pad {
        valid[(b - 1) * s + j] = 0.0;
    }
    // A query row sees a key when some valid key lies at or before its position.
    let visible: Vec<bool> = (0..b)
        .flat_map(|r| {
            let valid = &valid;
            (0..c.t).map(move |i| (0..=c.past + i).any(|j| valid[r * s + j] > 0.5))
        })
        .collect();
    let key_valid = Tensor::<A, 2>::from_data(TensorData::new(valid, [b, s]), &dev);
    let layout = AttentionLayout::new(c.past, 1.0 / (d as f64).sqrt());
    let out = if fused {
        causal_attention(q.clone(), k.clone(), v.clone(), key_valid, layout)
    } else {
        naive_causal_attention(q.clone(), k.clone(), v.clone(), key_valid, layout)
    };
    let mut g = seeded_uniform(b * nh * c.t * d, 14, 1.0);
    for (i, x) in g.iter_mut().enumerate() {
        let row = (i / d) % c.t;
        let bi = i / (d * c.t * nh);
        if !visible[bi * c.t + row] {
            *x = 0.0;
        }
    }
    let d_out = Tensor::<A, 4>::from_data(TensorData::new(g, [b, nh, c.t, d]), &dev).cast(dtype);
    let grads = (out.clone().cast(DType::F32) * d_out.cast(DType::F32))
        .sum()
        .backward();
    let outputs = Outputs {
        out: host(out.inner()),
        dq: host(q.grad(&grads).unwrap()),
        dk: host(k.grad(&grads).unwrap()),
        dv: host(v.grad(&grads).unwrap()),
    };
    (outputs, visible)
}

fn check(c: Case, dtype: DType, tol: f64) {
    let (fused, visible) = run(c, true, dtype);
    let (naive, _) = run(c, false, DType::F32);
    let rows = |x: &[f32]| visible_rows(x, &c, &visible);
    let errs = [
        ("out", relative_error(&rows(&fused.out), &rows(&naive.out))),
        ("dq", relative_error(&rows(&fused.dq), &rows(&naive.dq))),
        ("dk", relative_error(&fused.dk, &naive.dk)),
        ("dv", relative_error(&fused.dv, &naive.dv)),
    ];
    println!("{c:?} {dtype:?}: {errs:?}");
    for (what, e) in errs {
        assert!(
            e <= tol,
            "{c:?} {dtype:?}: {what} relative error {e:.3e} > {tol:.0e}"
        );
    }
    // Rows that see no key output exactly zero.
    let [b, nh, t, d] = [c.batch, c.heads, c.t, c.head_dim];
    for bi in 0..b {
        for h in 0..nh {
            for i in 0..t {
                if !visible[bi * t + i] {
                    let at = ((bi * nh + h) * t + i) * d;
                    assert!(
                        fused.out[at..at + d].iter().all(|&x| x == 0.0),
                        "row {bi}/{h}/{i} sees no key but is not zero"
                    );
                }
            }
        }
    }
}

#[test]
fn fused_attention_matches_the_naive_formula_in_f32() {
    let cases = [
        // group 1, two query blocks (300 = 256 + 44), left padding, head_dim 64.
        Case {
            batch: 2,
            heads: 2,
            kv_heads: 2,
            t: 300,
            past: 0,
            head_dim: 64,
            pad: 37,
        },
        // group 2, head_dim 128.
        Case {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            t: 100,
            past: 0,
            head_dim: 128,
            pad: 9,
        },
        // group 4, a length that is no multiple of anything.
        Case {
            batch: 1,
            heads: 8,
            kv_heads: 2,
            t: 37,
            past: 0,
            head_dim: 64,
            pad: 0,
        },
        // group 8, queries after a 30-key prefix whose first 12 keys are padding.
        Case {
            batch: 2,
            heads: 8,
            kv_heads: 1,
            t: 5,
            past: 30,
            head_dim: 128,
            pad: 12,
        },
        // group 2 after a prefix, across a block boundary.
        Case {
            batch: 1,
            heads: 4,
            kv_heads: 2,
            t: 260,
            past: 7,
            head_dim: 64,
            pad: 3,
        },
    ];
    for c in cases {
        check(c, DType::F32, 1e-4);
    }
}

#[test]
fn fused_attention_in_bf16_stays_close_to_f32() {
    // bf16 inputs round q, k and v to 8 bits of mantissa; scores, softmax and accumulation are f32.
    check(
        Case {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            t: 70,
            past: 0,
            head_dim: 64,
            pad: 5,
        },
        DType::BF16,
        3e-2,
    );
}

/// CPU backends have only the portable kernels: `tensor-core` is refused with the backend's
/// name, `auto` and `portable` resolve to the portable kernels.
#[test]
fn cpu_backends_refuse_the_tensor_core_kernels() {
    use burn::backend::Flex;
    use conrub_kernels::{AttentionKernelChoice, AttentionKernels, AttentionOps};
    let dev = Default::default();
    assert_eq!(
        conrub_kernels::resolve_attention_kernels::<Flex>(AttentionKernelChoice::Auto, &dev),
        Ok(AttentionKernels::Portable)
    );
    assert_eq!(
        conrub_kernels::resolve_attention_kernels::<Flex>(AttentionKernelChoice::Portable, &dev),
        Ok(AttentionKernels::Portable)
    );
    let err =
        conrub_kernels::resolve_attention_kernels::<Flex>(AttentionKernelChoice::TensorCore, &dev)
            .unwrap_err()
            .to_string();
    assert!(
        err.starts_with("attention_kernels = \"tensor-core\"") && err.contains("CubeCL"),
        "{err}"
    );
    assert!(Flex::check_attention_kernels(&dev, AttentionKernels::TiledUnits).is_err());
    assert_eq!(
        AttentionKernelChoice::parse("tensor-core"),
        Some(AttentionKernelChoice::TensorCore)
    );
    assert_eq!(AttentionKernelChoice::parse("fast"), None);
}
