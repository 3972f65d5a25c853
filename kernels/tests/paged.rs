//! `paged_decode_attention` against an f64 reference on the host: the portable fallback on flex,
//! and (feature `wgpu`) the CubeCL kernel on `burn::backend::Wgpu` (`Fusion<CubeBackend>`, so the
//! fusion hook is exercised too).
//!
//! Every case reads a pool whose blocks are handed out in shuffled order and whose other blocks
//! hold random keys, so a wrong slot, a key past a row's length or a wrong key/value head changes
//! the output. Queries arrive as `swap_dims` views, as the model produces them. Tolerances:
//! max |diff| / max |ref| <= 1e-5 (fallback, f32), 1e-4 (kernel, f32), 2e-2 (16-bit inputs).

use burn::backend::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use conrub_kernels::{paged_decode_attention, KernelOps, PagedLayout};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug)]
struct Case {
    name: &'static str,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    /// Keys per row (0: a row that attends to nothing).
    lens: Vec<usize>,
    /// `PagedLayout::kv_splits` (0: the backend chooses).
    kv_splits: usize,
}

struct Inputs {
    /// `[rows, heads, head_dim]`.
    q: Vec<f32>,
    /// `[slots, kv_heads * head_dim]`.
    k: Vec<f32>,
    v: Vec<f32>,
    slots: usize,
    /// Per row, padded with 0 to `blocks`.
    tables: Vec<Vec<u32>>,
    blocks: usize,
}

fn inputs(c: &Case, seed: u64) -> Inputs {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let need: Vec<usize> = c.lens.iter().map(|l| l.div_ceil(c.block_size)).collect();
    let blocks = need.iter().copied().max().unwrap_or(1).max(1);
    // Three spare blocks that no row owns, then every block in shuffled order.
    let num_blocks = need.iter().sum::<usize>() + 3;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(&mut rng);
    let mut next = ids.into_iter();
    let tables = need
        .iter()
        .map(|&n| {
            let mut t: Vec<u32> = (0..n).map(|_| next.next().unwrap()).collect();
            t.resize(blocks, 0);
            t
        })
        .collect();
    let slots = num_blocks * c.block_size;
    let width = c.kv_heads * c.head_dim;
    let mut normal = |n: usize| {
        (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0) * 1.7)
            .collect::<Vec<f32>>()
    };
    Inputs {
        q: normal(c.lens.len() * c.heads * c.head_dim),
        k: normal(slots * width),
        v: normal(slots * width),
        slots,
        tables,
        blocks,
    }
}

fn reference(c: &Case, x: &Inputs) -> Vec<f32> {
    let (d, width) = (c.head_dim, c.kv_heads * c.head_dim);
    let group = c.heads / c.kv_heads;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0f32; c.lens.len() * c.heads * d];
    for (r, &len) in c.lens.iter().enumerate() {
        for h in 0..c.heads {
            let kc = (h / group) * d;
            let q = &x.q[(r * c.heads + h) * d..][..d];
            let slot =
                |p: usize| x.tables[r][p / c.block_size] as usize * c.block_size + p % c.block_size;
            let scores: Vec<f64> = (0..len)
                .map(|p| {
                    (0..d)
                        .map(|i| q[i] as f64 * x.k[slot(p) * width + kc + i] as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for i in 0..d {
                let o: f64 = (0..len)
                    .map(|p| e[p] / z * x.v[slot(p) * width + kc + i] as f64)
                    .sum();
                out[(r * c.heads + h) * d + i] = o as f32;
            }
        }
    }
    out
}

/// Drops NaN-filled tensors so that freed device memory is poisoned before the run.
fn poison<B: Backend>(len: usize, device: &B::Device) {
    let t = Tensor::<B, 1>::from_data(TensorData::new(vec![f32::NAN; len], [len]), device);
    let _ = t.into_data();
}

fn run<B: KernelOps>(c: &Case, x: &Inputs, dtype: DType, device: &B::Device) -> Vec<f32> {
    let (rows, d, width) = (c.lens.len(), c.head_dim, c.kv_heads * c.head_dim);
    poison::<B>(4 * (x.k.len() + x.q.len()), device);
    let f = |v: &Vec<f32>, shape: [usize; 2]| {
        Tensor::<B, 2>::from_data(TensorData::new(v.clone(), shape), device).cast(dtype)
    };
    // The query as the model makes it: `[rows, 1, heads, d]` with heads moved first (a view).
    let q = Tensor::<B, 1>::from_data(TensorData::new(x.q.clone(), [x.q.len()]), device)
        .cast(dtype)
        .reshape([rows, 1, c.heads, d])
        .swap_dims(1, 2);
    let flat: Vec<i64> = x.tables.iter().flatten().map(|&b| b as i64).collect();
    let tables = Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [rows, x.blocks]), device);
    let lens = Tensor::<B, 1, Int>::from_data(
        TensorData::new(c.lens.iter().map(|&l| l as i64).collect::<Vec<_>>(), [rows]),
        device,
    );
    let layout = PagedLayout {
        kv_splits: c.kv_splits,
        ..PagedLayout::new(c.block_size, 1.0 / (d as f64).sqrt())
    };
    let out = paged_decode_attention(
        q,
        f(&x.k, [x.slots, width]),
        f(&x.v, [x.slots, width]),
        tables,
        lens,
        layout,
    );
    assert_eq!(out.dims(), [rows, c.heads, 1, d], "{}", c.name);
    assert_eq!(out.dtype(), dtype, "{}", c.name);
    out.cast(DType::F32).into_data().to_vec::<f32>().unwrap()
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let max_ref = want
        .iter()
        .fold(0f64, |m, &w| m.max(w.abs() as f64))
        .max(1e-30);
    let max_diff = got.iter().zip(want).fold(0f64, |m, (&g, &w)| {
        if g.is_nan() {
            f64::INFINITY
        } else {
            m.max((g as f64 - w as f64).abs())
        }
    });
    max_diff / max_ref
}

/// Inputs rounded to `dtype` (so 16-bit runs are compared with the reference of what they saw).
fn rounded(x: &Inputs, dtype: DType) -> Inputs {
    let r = |v: &Vec<f32>| {
        Tensor::<Flex, 1>::from_data(TensorData::new(v.clone(), [v.len()]), &Default::default())
            .cast(dtype)
            .cast(DType::F32)
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    };
    Inputs {
        q: r(&x.q),
        k: r(&x.k),
        v: r(&x.v),
        slots: x.slots,
        tables: x.tables.clone(),
        blocks: x.blocks,
    }
}

fn check<B: KernelOps>(backend: &str, cases: &[Case], dtype: DType, tol: f64, device: &B::Device) {
    for (i, c) in cases.iter().enumerate() {
        let x = rounded(&inputs(c, 7 + i as u64), dtype);
        let want = reference(c, &x);
        let got = run::<B>(c, &x, dtype, device);
        let err = rel_err(&got, &want);
        println!("{backend} {dtype:?} {}: relative error {err:.2e}", c.name);
        assert!(
            err <= tol,
            "{backend} {dtype:?} {}: relative error {err:.2e} > {tol:.0e}",
            c.name
        );
        // A row with no keys gives zeros.
        for (r, &len) in c.lens.iter().enumerate() {
            if len == 0 {
                let row = &got[r * c.heads * c.head_dim..][..c.heads * c.head_dim];
                assert!(
                    row.iter().all(|&v| v == 0.0),
                    "{backend} {}: row {r} has no keys but a non-zero output",
                    c.name
                );
            }
        }
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "GQA 4, head_dim 64, ragged rows",
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            block_size: 16,
            lens: vec![1, 16, 17, 40, 0],
            kv_splits: 0,
        },
        // Several key tiles per row (the kernel's online softmax across tiles).
        Case {
            name: "GQA 4, head_dim 128, 700 keys",
            heads: 4,
            kv_heads: 1,
            head_dim: 128,
            block_size: 16,
            lens: vec![700, 63, 130],
            kv_splits: 0,
        },
        Case {
            name: "MHA, head_dim 40, block 4",
            heads: 2,
            kv_heads: 2,
            head_dim: 40,
            block_size: 4,
            lens: vec![9, 3, 4],
            kv_splits: 0,
        },
    ]
}

#[test]
fn the_fallback_matches_the_reference() {
    check::<Flex>("flex", &cases(), DType::F32, 1e-5, &Default::default());
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    use burn::backend::wgpu::{Wgpu, WgpuDevice};
    type W = Wgpu;

    fn device(test: &str) -> Option<WgpuDevice> {
        conrub_kernels::wgpu_adapter_or_skip(test).then_some(WgpuDevice::DefaultDevice)
    }

    #[test]
    fn the_kernel_matches_the_reference_in_f32() {
        let Some(dev) = device("the_kernel_matches_the_reference_in_f32") else {
            return;
        };
        let mut all = cases();
        all.push(Case {
            name: "head_dim 256, GQA 2",
            heads: 2,
            kv_heads: 1,
            head_dim: 256,
            block_size: 16,
            lens: vec![33, 70],
            kv_splits: 0,
        });
        check::<W>("wgpu", &all, DType::F32, 1e-4, &dev);
    }

    /// Flash-decoding: each row's keys split across cubes, then combined. Rows shorter than the
    /// first split, rows with no key and splits past a row's end all occur.
    #[test]
    fn split_keys_match_the_reference() {
        let Some(dev) = device("split_keys_match_the_reference") else {
            return;
        };
        let split = |c: Case, kv_splits| Case { kv_splits, ..c };
        let all = cases();
        let splits = vec![
            split(all[0].clone(), 3),
            split(all[1].clone(), 5),
            split(all[2].clone(), 2),
        ];
        check::<W>("wgpu split", &splits, DType::F32, 1e-4, &dev);
        // The CPU fallback has no splits: the setting changes nothing there.
        check::<Flex>("flex split", &splits, DType::F32, 1e-5, &Default::default());
    }

    /// WGSL has no bf16, so lavapipe runs this in f16.
    #[test]
    fn the_kernel_matches_the_reference_in_half_precision() {
        let Some(dev) = device("the_kernel_matches_the_reference_in_half_precision") else {
            return;
        };
        let Some(dtype) = [DType::BF16, DType::F16]
            .into_iter()
            .find(|&d| <W as Backend>::supports_dtype(&dev, d))
        else {
            conrub_kernels::skip_or_fail(
                "the_kernel_matches_the_reference_in_half_precision",
                "the wgpu device supports neither bf16 nor f16",
            );
            return;
        };
        check::<W>("wgpu", &cases()[..1], dtype, 2e-2, &dev);
    }
}
