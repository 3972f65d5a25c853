//! The kernels and configurations an H200 run launches, and their launches on the offline
//! runtime: each goes through the launch function the backend uses, with placeholder tensors
//! (the sizes are runtime values; only dtypes and the geometry shape the generated source).

use burn::tensor::DType;
use cubecl::prelude::*;
use cubecl::zspace::{Shape, Strides};

use super::runtime::OfflineCuda;
use crate::cube_attention::{launch_dkdv, launch_dq, launch_forward};
use crate::cube_flash::Dims;
use crate::{cube, cube_flash, cube_paged, AttentionLayout, Clip, PagedLayout, Reduce};

/// Float dtypes a kernel is generated for: f32 (full precision), bf16 (`--precision bf16` and
/// mixed runs' attention), f16.
const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
/// Head dimensions: 128 (the qwen3 and llama families at every size), 64 and 256 (smaller and
/// larger heads).
const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// One kernel at one configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelConfig {
    /// The kernel's function name in `kernels/src`.
    pub kernel: &'static str,
    /// Its float dtype.
    pub dtype: DType,
    /// Its head dimension, for the attention kernels.
    pub head_dim: Option<usize>,
}

/// The row kernels (log-probabilities, the clipped-ratio loss and the rollout's sampling).
pub const ROW_KERNELS: [&str; 6] = [
    "row_stats_kernel",
    "logits_grad_kernel",
    "surrogate_forward_kernel",
    "surrogate_backward_kernel",
    "sample_kernel",
    "sample_restricted_kernel",
];
/// The tensor-core attention kernels, per 16-bit dtype and head dimension (f32 attention keeps
/// the portable kernels).
pub const TENSOR_CORE_KERNELS: [&str; 3] = [
    "flash_forward_kernel",
    "flash_dq_kernel",
    "flash_dkdv_kernel",
];
/// The attention kernels, per head dimension (`+split`: the same kernel's flash-decoding variant).
pub const ATTENTION_KERNELS: [&str; 6] = [
    "attention_forward_kernel",
    "attention_dq_kernel",
    "attention_dkdv_kernel",
    "paged_decode_kernel",
    "paged_decode_kernel+split",
    "paged_combine_kernel",
];

fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "other",
    }
}

impl KernelConfig {
    /// Every kernel of this crate at every dtype and head dimension: 6 row kernels x 3 dtypes,
    /// 6 portable attention kernels x 3 dtypes x 3 head dimensions, and 3 tensor-core attention
    /// kernels x 2 dtypes (bf16, f16) x 3 head dimensions.
    pub fn all() -> Vec<Self> {
        let mut out = Vec::new();
        for dtype in FLOATS {
            if dtype != DType::F32 {
                for head_dim in HEAD_DIMS {
                    for kernel in TENSOR_CORE_KERNELS {
                        out.push(Self {
                            kernel,
                            dtype,
                            head_dim: Some(head_dim),
                        });
                    }
                }
            }
            for kernel in ROW_KERNELS {
                out.push(Self {
                    kernel,
                    dtype,
                    head_dim: None,
                });
            }
            for head_dim in HEAD_DIMS {
                for kernel in ATTENTION_KERNELS {
                    out.push(Self {
                        kernel,
                        dtype,
                        head_dim: Some(head_dim),
                    });
                }
            }
        }
        out
    }

    /// `kernel/dtype[/dHEAD_DIM]`: a file-name-safe label.
    pub fn label(&self) -> String {
        match self.head_dim {
            Some(d) => format!("{}/{}/d{d}", self.kernel, dtype_name(self.dtype)),
            None => format!("{}/{}", self.kernel, dtype_name(self.dtype)),
        }
    }

    /// `bf16, head_dim 128`: the configuration in words.
    pub fn describe(&self) -> String {
        match self.head_dim {
            Some(d) => format!("{}, head_dim {d}", dtype_name(self.dtype)),
            None => dtype_name(self.dtype).to_string(),
        }
    }
}

/// A placeholder tensor of `shape` and `dtype` (contiguous; nothing is ever read or written).
fn arg(
    client: &ComputeClient<OfflineCuda>,
    shape: &[usize],
    dtype: DType,
) -> TensorArg<OfflineCuda> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    let handle = client.empty(shape.iter().product::<usize>() * dtype.size());
    // SAFETY: the offline runtime compiles kernels and never runs them.
    unsafe {
        TensorArg::from_raw_parts(handle, Strides::new(&strides), Shape::from(shape.to_vec()))
    }
}

/// Launches `config` on the offline runtime (see the module docs).
pub(crate) fn launch(client: &ComputeClient<OfflineCuda>, config: &KernelConfig) {
    let f = config.dtype;
    let (i, full) = (DType::I32, DType::F32);
    let float: StorageType = f.into();
    let dtypes = [float, DType::I32.into()];
    let t = |shape: &[usize], dtype| arg(client, shape, dtype);
    let (rows, vocab, len) = (4, 1024, 64);
    let d = config.head_dim.unwrap_or(128);
    let (b, heads, kv_heads, n) = (1, 4, 2, 128);
    let dims = Dims {
        b,
        heads,
        kv_heads,
        t: n,
        s: n,
        d,
    };
    let layout = AttentionLayout::new(0, 1.0 / (d as f64).sqrt());
    let q = || t(&[b, heads, n, d], f);
    let kv = || t(&[b, kv_heads, n, d], f);
    let per_row = || t(&[b, heads, n], full);
    // The arguments of the attention kernels, portable and tensor-core alike.
    let forward_args = || [q(), kv(), kv(), t(&[b, n], full), q(), per_row()];
    let dq_args = || {
        let (valid, out, lse) = (t(&[b, n], full), q(), per_row());
        [q(), kv(), kv(), valid, out, lse, q(), q(), per_row()]
    };
    let dkdv_args = || {
        let valid = t(&[b, n], full);
        [
            q(),
            kv(),
            kv(),
            valid,
            per_row(),
            per_row(),
            q(),
            kv(),
            kv(),
        ]
    };
    match config.kernel {
        "row_stats_kernel" => cube::launch_row_stats(
            client,
            rows,
            [
                t(&[rows, vocab], f),
                t(&[rows], i),
                t(&[rows], f),
                t(&[rows], f),
                t(&[rows], f),
            ],
            dtypes,
        ),
        "logits_grad_kernel" => cube::launch_logits_grad(
            client,
            [rows, vocab],
            [
                t(&[rows, vocab], f),
                t(&[rows], i),
                t(&[rows], f),
                t(&[rows], f),
                t(&[rows, vocab], f),
            ],
            dtypes,
        ),
        "surrogate_forward_kernel" => cube::launch_surrogate_forward(
            client,
            rows,
            [
                t(&[rows, len], f),
                t(&[rows, len], f),
                t(&[rows], f),
                t(&[rows, len], f),
                t(&[rows], f),
                t(&[rows], f),
                t(&[rows], f),
            ],
            (Clip::default(), Reduce::MeanPerResponse),
            float,
        ),
        "surrogate_backward_kernel" => cube::launch_surrogate_backward(
            client,
            [rows, len],
            [
                t(&[rows, len], f),
                t(&[rows, len], f),
                t(&[rows], f),
                t(&[rows, len], f),
                t(&[rows], f),
                t(&[rows, len], f),
            ],
            Clip::default(),
            float,
        ),
        // The drawing variant (greedy is the same kernel without step 3's scan), and the
        // top-k/top-p one.
        "sample_kernel" | "sample_restricted_kernel" => crate::cube_sampling::launch_sample(
            client,
            [rows, vocab],
            [
                t(&[rows, vocab], f),
                t(&[rows], full),
                t(&[rows], i),
                t(&[rows], full),
            ],
            &crate::sampling::Decoding::draw(
                1.0,
                (config.kernel == "sample_restricted_kernel").then_some(20),
                1.0,
            ),
            dtypes,
        ),
        "attention_forward_kernel" => launch_forward(client, &dims, layout, float, forward_args()),
        "attention_dq_kernel" => launch_dq(client, &dims, layout, float, dq_args()),
        "attention_dkdv_kernel" => launch_dkdv(client, &dims, layout, float, dkdv_args()),
        "paged_decode_kernel" | "paged_decode_kernel+split" => {
            let (slots, block_size, blocks) = (256, 16, 16);
            // The split variant: 4 splits of 64 keys (flash-decoding's first kernel).
            let splits = (config.kernel == "paged_decode_kernel+split").then_some((4, 64));
            let parts = splits.unwrap_or((1, 0)).0;
            cube_paged::launch_paged_decode(
                client,
                [rows, heads, d],
                PagedLayout::new(block_size, layout.scale),
                splits,
                [
                    t(&[rows, heads, 1, d], f),
                    t(&[slots, kv_heads * d], f),
                    t(&[slots, kv_heads * d], f),
                    t(&[rows, blocks], i),
                    t(&[rows], i),
                    t(&[rows, heads, 1, d], f),
                    t(&[rows, heads, parts, d], full),
                    t(&[rows, heads, parts, 2], full),
                ],
                dtypes,
            )
        }
        "paged_combine_kernel" => cube_paged::launch_paged_combine(
            client,
            [rows, heads, d],
            [
                t(&[rows, heads, 4, d], full),
                t(&[rows, heads, 4, 2], full),
                t(&[rows, heads, 1, d], f),
            ],
            float,
        ),
        // The tensor-core kernels (`tensor_cores = true`: WMMA tiles).
        "flash_forward_kernel" => {
            cube_flash::launch_flash_forward(client, &dims, layout, float, true, forward_args())
        }
        "flash_dq_kernel" => {
            cube_flash::launch_flash_dq(client, &dims, layout, float, true, dq_args())
        }
        "flash_dkdv_kernel" => {
            cube_flash::launch_flash_dkdv(client, &dims, layout, float, true, dkdv_args())
        }
        other => panic!("no launch for kernel {other}"),
    }
}
