//! The shared pre-norm decoder of every family ([`crate::Family`]): RMSNorm, rotate-half RoPE
//! (plain or `llama3`-scaled), grouped-query attention with optional per-head q/k norms (Qwen3)
//! and projection biases (Qwen2, Llama's `attention_bias`), SwiGLU MLP, and the causal-LM head
//! (tied or untied). A family differs only in its [`crate::Architecture`].

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::optim::GradientsParams;
use burn::tensor::activation::{silu, softmax};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};
use conrub_kernels::gradients::add_gradients;
use conrub_kernels::{
    causal_attention, paged_decode_attention, AttentionKernels, AttentionLayout, KernelOps,
    PagedLayout,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::batch::attention_bias;
use crate::config::ModelConfig;
use crate::family::Architecture;
use conrub_contracts::{
    gathered, ForwardBatch, KvLayout, PagedKv, PagedModel, PagedPass, ParamGather,
};
pub use conrub_contracts::{to_dtype, AttentionImpl, Execution, Precision};

/// Applies `lin` to `[batch, seq, in]` as one 2-D matrix product in `x`'s dtype (the weight is
/// cast to it under mixed precision). burn's `Linear` on a 3-D input runs a broadcast batched
/// matmul, which CPU backends execute as one product per sequence (each re-reading the whole
/// weight); flattening first makes decode steps read every weight once.
fn project<B: Backend>(lin: &Linear<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    let [b, t, d] = x.dims();
    let dtype = x.dtype();
    let mut y = x
        .reshape([b * t, d])
        .matmul(to_dtype(lin.weight.val(), dtype));
    if let Some(bias) = &lin.bias {
        y = y + to_dtype(bias.val(), dtype).unsqueeze();
    }
    let out = y.dims()[1];
    y.reshape([b, t, out])
}

/// Initial weights: N(0, `std`) drawn on the host from one ChaCha8 stream per model seed, in a
/// fixed parameter order. Neither burn's `Initializer` (lazy: draws happen at first use) nor the
/// backend's global RNG (shared by every thread) makes a seed reproduce the same weights.
struct WeightInit {
    rng: ChaCha8Rng,
    std: f64,
}

impl WeightInit {
    fn new(seed: u64, std: f64) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
            std,
        }
    }

    /// Box-Muller pairs; `1 - u` keeps the logarithm's argument in (0, 1].
    fn normal<B: Backend, const D: usize>(
        &mut self,
        shape: [usize; D],
        device: &B::Device,
    ) -> Tensor<B, D> {
        let n: usize = shape.iter().product();
        let mut v = Vec::with_capacity(n + 1);
        while v.len() < n {
            let r = (-2.0 * (1.0 - self.rng.random::<f64>()).ln()).sqrt() * self.std;
            let theta = std::f64::consts::TAU * self.rng.random::<f64>();
            v.push((r * theta.cos()) as f32);
            v.push((r * theta.sin()) as f32);
        }
        v.truncate(n);
        Tensor::from_data(TensorData::new(v, shape), device)
    }

    /// A `d_in -> d_out` projection with normal weights and zero bias.
    fn linear<B: Backend>(
        &mut self,
        d_in: usize,
        d_out: usize,
        bias: bool,
        device: &B::Device,
    ) -> Linear<B> {
        Linear {
            weight: Param::from_tensor(self.normal([d_in, d_out], device)),
            bias: bias.then(|| Param::from_tensor(Tensor::zeros([d_out], device))),
        }
    }
}

/// Root-mean-square norm as the HF decoders compute it: statistics in f32, scale applied after
/// casting back.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// Per-feature scale (`weight` in HF checkpoints).
    pub(crate) weight: Param<Tensor<B, 1>>,
    /// Epsilon from `config.json`'s `rms_norm_eps`.
    pub(crate) eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    /// A norm of width `dim` with unit scale.
    pub fn new(dim: usize, eps: f64, device: &B::Device) -> Self {
        Self {
            weight: Param::from_tensor(Tensor::ones([dim], device)),
            eps,
        }
    }

    /// Normalises over the last dimension.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dtype = x.dtype();
        let x32 = x.cast(DType::F32);
        let inv_rms = (x32.clone().square().mean_dim(D - 1) + self.eps)
            .sqrt()
            .recip();
        let normed = to_dtype(x32 * inv_rms, dtype);
        normed * to_dtype(self.weight.val(), dtype).unsqueeze()
    }
}

/// Rotary position embedding in Hugging Face's rotate-half form: dimension `i` is rotated with
/// dimension `i + head_dim/2` by the angle `position * inv_freq[i]`, `inv_freq[i] =
/// theta^(-2i/head_dim)`, rescaled band by band under `llama3` scaling (`llama3_factor > 0`).
#[derive(Module, Debug, Clone)]
pub struct RotaryEmbedding {
    /// Per-head width.
    pub(crate) head_dim: usize,
    /// Base frequency.
    pub(crate) theta: f64,
    /// `llama3` scaling's stretch of the low frequencies; 0 without scaling.
    pub(crate) llama3_factor: f64,
    /// `llama3`: lower edge of the interpolated band.
    pub(crate) llama3_low_freq_factor: f64,
    /// `llama3`: upper edge of the interpolated band.
    pub(crate) llama3_high_freq_factor: f64,
    /// `llama3`: the base model's context length.
    pub(crate) llama3_original_context: f64,
}

/// `cos`/`sin` tables for one forward pass, materialised per head (`[batch, seq, heads, head_dim]`)
/// so the rotation is made of same-shape elementwise products, plus the rotate-half matrix.
#[derive(Debug, Clone)]
pub struct RopeTables<B: Backend> {
    cos_q: Tensor<B, 4>,
    sin_q: Tensor<B, 4>,
    cos_k: Tensor<B, 4>,
    sin_k: Tensor<B, 4>,
    rotate_half: Tensor<B, 2>,
}

impl RotaryEmbedding {
    /// The rotation of `head_dim`-wide heads under `rope`.
    pub fn new(head_dim: usize, rope: &crate::family::Rope) -> Self {
        let l = rope.llama3;
        Self {
            head_dim,
            theta: rope.theta,
            llama3_factor: l.map_or(0.0, |l| l.factor),
            llama3_low_freq_factor: l.map_or(0.0, |l| l.low_freq_factor),
            llama3_high_freq_factor: l.map_or(0.0, |l| l.high_freq_factor),
            llama3_original_context: l.map_or(0.0, |l| l.original_max_position_embeddings),
        }
    }

    /// Inverse frequencies, rounded to f32 the way the reference computes them.
    fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim as f64;
        (0..self.head_dim / 2)
            .map(|i| (1.0 / self.theta.powf((2 * i) as f64 / d)) as f32)
            .map(|f| self.llama3_scaled(f))
            .collect()
    }

    /// `llama3` scaling of one inverse frequency (the identity without it): wavelengths above
    /// `original / low_freq_factor` are stretched by `factor`, those below `original /
    /// high_freq_factor` kept, and the band between interpolated linearly in `original /
    /// wavelength`.
    fn llama3_scaled(&self, inv_freq: f32) -> f32 {
        if self.llama3_factor <= 0.0 {
            return inv_freq;
        }
        let (factor, low, high, original) = (
            self.llama3_factor,
            self.llama3_low_freq_factor,
            self.llama3_high_freq_factor,
            self.llama3_original_context,
        );
        let f = inv_freq as f64;
        let wavelen = 2.0 * std::f64::consts::PI / f;
        let scaled = if wavelen > original / low {
            f / factor
        } else if wavelen < original / high {
            f
        } else {
            let smooth = (original / wavelen - low) / (high - low);
            (1.0 - smooth) * f / factor + smooth * f
        };
        scaled as f32
    }

    /// `[head_dim, head_dim]` matrix `R` with `x · R = rotate_half(x) = [-x2, x1]`. Every output is
    /// one input times ±1 plus exact zeros, so the product is exact; as a matrix product it avoids
    /// slicing the last dimension, which CPU backends handle as slow strided copies.
    fn rotate_half_matrix<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2> {
        let d = self.head_dim;
        let half = d / 2;
        let mut r = vec![0.0f32; d * d];
        for j in 0..half {
            r[(j + half) * d + j] = -1.0;
            r[j * d + j + half] = 1.0;
        }
        Tensor::from_data(burn::tensor::TensorData::new(r, [d, d]), device)
    }

    /// Tables for the given positions `[batch, seq]`, for `q_heads` query and `kv_heads` key heads.
    pub fn tables<B: Backend>(
        &self,
        positions: Tensor<B, 2, Int>,
        q_heads: usize,
        kv_heads: usize,
    ) -> RopeTables<B> {
        let [b, t] = positions.dims();
        let device = positions.device();
        let half = self.head_dim / 2;
        let inv = Tensor::<B, 1>::from_floats(self.inv_freq().as_slice(), &device)
            .cast(DType::F32)
            .reshape([1, 1, half]);
        let pos = positions.float().cast(DType::F32).reshape([b, t, 1]);
        let freqs = pos * inv;
        let emb = Tensor::cat(vec![freqs.clone(), freqs], 2).reshape([b, t, 1, self.head_dim]);
        let (cos, sin) = (emb.clone().cos(), emb.sin());
        RopeTables {
            cos_q: cos.clone().repeat_dim(2, q_heads),
            sin_q: sin.clone().repeat_dim(2, q_heads),
            cos_k: cos.repeat_dim(2, kv_heads),
            sin_k: sin.repeat_dim(2, kv_heads),
            rotate_half: self.rotate_half_matrix(&device),
        }
    }

    /// Rotates `x` of shape `[batch, seq, heads, head_dim]` (contiguous) with per-head tables.
    fn rotate<B: Backend>(
        x: Tensor<B, 4>,
        cos: &Tensor<B, 4>,
        sin: &Tensor<B, 4>,
        r: &Tensor<B, 2>,
    ) -> Tensor<B, 4> {
        let [b, t, h, d] = x.dims();
        let dtype = x.dtype();
        let rotated = x
            .clone()
            .reshape([b * t * h, d])
            .matmul(r.clone().cast(dtype))
            .reshape([b, t, h, d]);
        x * cos.clone().cast(dtype) + rotated * sin.clone().cast(dtype)
    }
}

impl<B: Backend> RopeTables<B> {
    /// Rotates queries `[batch, seq, q_heads, head_dim]`.
    pub fn apply_q(&self, q: Tensor<B, 4>) -> Tensor<B, 4> {
        RotaryEmbedding::rotate(q, &self.cos_q, &self.sin_q, &self.rotate_half)
    }

    /// Rotates keys `[batch, seq, kv_heads, head_dim]`.
    pub fn apply_k(&self, k: Tensor<B, 4>) -> Tensor<B, 4> {
        RotaryEmbedding::rotate(k, &self.cos_k, &self.sin_k, &self.rotate_half)
    }
}

/// One layer of a paged pool and what a pass does with it: where its new keys and values go
/// and, for a decode step or a prefill over a cached prefix, what it reads.
pub(crate) type KvSlot<'a, B> = (
    &'a mut (Option<Tensor<B, 2>>, Option<Tensor<B, 2>>),
    &'a PagedPass<B>,
);

/// Grouped-query self-attention, with per-head RMSNorm on queries and keys where the family has
/// them.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// Query projection, `hidden -> heads * head_dim`.
    pub(crate) q_proj: Linear<B>,
    /// Key projection, `hidden -> kv_heads * head_dim`.
    pub(crate) k_proj: Linear<B>,
    /// Value projection, `hidden -> kv_heads * head_dim`.
    pub(crate) v_proj: Linear<B>,
    /// Output projection, `heads * head_dim -> hidden`.
    pub(crate) o_proj: Linear<B>,
    /// Per-head query norm (applied before RoPE; Qwen3).
    pub(crate) q_norm: Option<RmsNorm<B>>,
    /// Per-head key norm (applied before RoPE; Qwen3).
    pub(crate) k_norm: Option<RmsNorm<B>>,
    /// Query heads.
    pub(crate) num_heads: usize,
    /// Key/value heads.
    pub(crate) num_kv_heads: usize,
    /// Per-head width.
    pub(crate) head_dim: usize,
}

impl<B: Backend> Attention<B> {
    fn new(
        config: &ModelConfig,
        arch: &Architecture,
        init: &mut WeightInit,
        device: &B::Device,
    ) -> Self {
        let (h, nh, nkv, hd) = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads(),
            config.head_dim(),
        );
        let (qkv, o) = (arch.qkv_bias, arch.o_bias);
        let norm = || {
            arch.qk_norm
                .then(|| RmsNorm::new(hd, config.rms_norm_eps, device))
        };
        Self {
            q_proj: init.linear(h, nh * hd, qkv, device),
            k_proj: init.linear(h, nkv * hd, qkv, device),
            v_proj: init.linear(h, nkv * hd, qkv, device),
            o_proj: init.linear(nh * hd, h, o, device),
            q_norm: norm(),
            k_norm: norm(),
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
        }
    }

    /// `x`: `[batch, seq, hidden]`; `mask`: what the new tokens may attend to.
    fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &RopeTables<B>,
        mask: &AttentionMask<B>,
        cache: Option<KvSlot<'_, B>>,
    ) -> Tensor<B, 3>
    where
        B: KernelOps,
    {
        let [b, t, _] = x.dims();
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q = project(&self.q_proj, x.clone()).reshape([b, t, nh, hd]);
        let k = project(&self.k_proj, x.clone()).reshape([b, t, nkv, hd]);
        let v = project(&self.v_proj, x).reshape([b, t, nkv, hd]);
        // Norm and rotate in the contiguous [batch, seq, heads, dim] layout, then move heads first.
        let (q, k) = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => (qn.forward(q), kn.forward(k)),
            _ => (q, k),
        };
        let q = rope.apply_q(q).swap_dims(1, 2);
        let k = rope.apply_k(k);
        let scale = 1.0 / (hd as f64).sqrt();
        if let Some((layer, pass)) = cache {
            // New keys and values into their pool slots, then attend: a prefill to its own keys,
            // a decode step to every row's cached keys read through its block table.
            let w = nkv * hd;
            let (mut kr, mut vr) = (k.clone().reshape([b * t, w]), v.clone().reshape([b * t, w]));
            if let Some(rows) = &pass.write_rows {
                kr = kr.select(0, rows.clone());
                vr = vr.select(0, rows.clone());
            }
            let (mut kp, mut vp) = (
                layer.0.take().expect("pool present"),
                layer.1.take().expect("pool present"),
            );
            if !pass.write_slots.is_empty() {
                kp = conrub_kernels::kv_write(kp, &pass.write_slots, kr);
                vp = conrub_kernels::kv_write(vp, &pass.write_slots, vr);
            }
            let out = match &pass.read {
                Some(read) => {
                    let layout = PagedLayout::new(read.block_size, scale);
                    paged_decode_attention(
                        q,
                        kp.clone(),
                        vp.clone(),
                        read.tables.clone(),
                        read.lens.clone(),
                        layout,
                    )
                }
                None => {
                    let key_valid = mask.fused.clone().unwrap_or_else(|| {
                        Tensor::<B, 2>::ones([b, t], &kp.device()).cast(DType::F32)
                    });
                    let (k, v, key_valid, past) = match &pass.prefix {
                        // A shared cached prefix: every row reads its positions first.
                        Some(prefix) => {
                            let p = prefix.len;
                            let read = |pool: &Tensor<B, 2>| {
                                pool.clone()
                                    .select(0, prefix.slots.clone())
                                    .reshape([1, p, nkv, hd])
                                    .expand([b, p, nkv, hd])
                            };
                            let ones = Tensor::<B, 2>::ones([b, p], &kp.device()).cast(DType::F32);
                            (
                                Tensor::cat(vec![read(&kp), k], 1),
                                Tensor::cat(vec![read(&vp), v], 1),
                                Tensor::cat(vec![ones, key_valid], 1),
                                p,
                            )
                        }
                        None => (k, v, key_valid, 0),
                    };
                    causal_attention(
                        q,
                        k.swap_dims(1, 2),
                        v.swap_dims(1, 2),
                        key_valid,
                        AttentionLayout {
                            past,
                            scale,
                            kernels: mask.kernels,
                        },
                    )
                }
            };
            layer.0 = Some(kp);
            layer.1 = Some(vp);
            let out = out.swap_dims(1, 2).reshape([b, t, nh * hd]);
            return project(&self.o_proj, out);
        }
        let k = k.swap_dims(1, 2);
        let v = v.swap_dims(1, 2);
        let s = k.dims()[2];
        let out = match &mask.fused {
            Some(key_valid) => causal_attention(
                q,
                k,
                v,
                key_valid.clone(),
                AttentionLayout {
                    past: 0,
                    scale,
                    kernels: mask.kernels,
                },
            ),
            None => {
                let group = nh / nkv;
                // Query head h reads key/value head h / group: fold the group into the query rows
                // so no repeated copy of K and V is made.
                let q = q.reshape([b, nkv, group * t, hd]);
                let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale);
                let dtype = scores.dtype();
                let mut scores = scores.reshape([b, nh, t, s]).cast(DType::F32);
                if let Some(bias) = &mask.bias {
                    scores = scores + bias.clone();
                }
                let probs = softmax(scores, 3)
                    .cast(dtype)
                    .reshape([b, nkv, group * t, s]);
                probs.matmul(v).reshape([b, nh, t, hd])
            }
        };
        let out = out.swap_dims(1, 2).reshape([b, t, nh * hd]);
        project(&self.o_proj, out)
    }
}

/// What the new tokens of one pass may attend to, in the form the chosen attention takes.
#[derive(Debug, Clone)]
pub struct AttentionMask<B: Backend> {
    /// Naive path: additive bias `[batch, 1, new, keys]` (None = everything visible).
    pub(crate) bias: Option<Tensor<B, 4>>,
    /// Fused path: key validity `[batch, keys]` (1 = real token), causality implied.
    pub(crate) fused: Option<Tensor<B, 2>>,
    /// The fused path's kernels ([`Execution::attention_kernels`]).
    pub(crate) kernels: AttentionKernels,
}

/// SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// Gate projection.
    pub(crate) gate_proj: Linear<B>,
    /// Up projection.
    pub(crate) up_proj: Linear<B>,
    /// Down projection.
    pub(crate) down_proj: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn new(config: &ModelConfig, init: &mut WeightInit, device: &B::Device) -> Self {
        let (h, i) = (config.hidden_size, config.intermediate_size);
        Self {
            gate_proj: init.linear(h, i, false, device),
            up_proj: init.linear(h, i, false, device),
            down_proj: init.linear(i, h, false, device),
        }
    }

    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let gate = silu(project(&self.gate_proj, x.clone()));
        project(&self.down_proj, gate * project(&self.up_proj, x))
    }
}

/// One pre-norm decoder layer.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    /// Norm before attention.
    pub(crate) input_layernorm: RmsNorm<B>,
    /// Self-attention.
    pub(crate) self_attn: Attention<B>,
    /// Norm before the MLP.
    pub(crate) post_attention_layernorm: RmsNorm<B>,
    /// Feed-forward block.
    pub(crate) mlp: Mlp<B>,
}

impl<B: Backend> DecoderLayer<B> {
    fn new(
        config: &ModelConfig,
        arch: &Architecture,
        init: &mut WeightInit,
        device: &B::Device,
    ) -> Self {
        Self {
            input_layernorm: RmsNorm::new(config.hidden_size, config.rms_norm_eps, device),
            self_attn: Attention::new(config, arch, init, device),
            post_attention_layernorm: RmsNorm::new(config.hidden_size, config.rms_norm_eps, device),
            mlp: Mlp::new(config, init, device),
        }
    }

    /// `x + attn(norm(x))`, then `+ mlp(norm(.))`.
    fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &RopeTables<B>,
        mask: &AttentionMask<B>,
        cache: Option<KvSlot<'_, B>>,
    ) -> Tensor<B, 3>
    where
        B: KernelOps,
    {
        let x = x.clone()
            + self
                .self_attn
                .forward(self.input_layernorm.forward(x), rope, mask, cache);
        x.clone() + self.mlp.forward(self.post_attention_layernorm.forward(x))
    }
}

/// The causal language model of every family.
///
/// With `tie_word_embeddings` the head has no weight of its own: logits are computed against the
/// embedding parameter itself, so training updates one tensor, as in the reference.
#[derive(Module, Debug)]
pub struct CausalLm<B: Backend> {
    /// Token embedding `[vocab, hidden]` (`model.embed_tokens.weight`).
    pub(crate) embed_tokens: Param<Tensor<B, 2>>,
    /// Decoder layers.
    pub(crate) layers: Vec<DecoderLayer<B>>,
    /// Final norm.
    pub(crate) norm: RmsNorm<B>,
    /// Untied LM head `[vocab, hidden]` (HF layout); `None` when tied to `embed_tokens`.
    pub(crate) lm_head: Option<Param<Tensor<B, 2>>>,
    /// Rotary embedding parameters.
    pub(crate) rope: RotaryEmbedding,
    /// Precision, attention and checkpointing settings (not stored in checkpoints).
    pub(crate) exec: Execution,
}

impl<B: Backend> CausalLm<B> {
    /// The architecture with N(0, 0.02) weights (HF's `initializer_range`, seed 0), to be trained
    /// or loaded.
    pub fn new(config: &ModelConfig, device: &B::Device) -> Self {
        Self::random(config, 0.02, 0, device)
    }

    /// A model with random weights drawn from N(0, `std`) (norm scales are 1, biases 0), for
    /// tests, benches and demos; load real checkpoints with [`crate::load_weights`] or
    /// [`crate::Pretrained::load`]. The weights depend only on the config, `std` and `seed` (not
    /// on other threads or on burn's global RNG).
    ///
    /// # Panics
    /// When `config` fails its family's checks ([`ModelConfig::validate`]; configs read from
    /// files are checked as they are read).
    pub fn random(config: &ModelConfig, std: f64, seed: u64, device: &B::Device) -> Self {
        let arch = config
            .architecture()
            .unwrap_or_else(|e| panic!("CausalLm::random: {e}"));
        let mut init = WeightInit::new(seed, std);
        let (v, h) = (config.vocab_size, config.hidden_size);
        let embed_tokens = Param::from_tensor(init.normal([v, h], device));
        let layers = (0..config.num_hidden_layers)
            .map(|_| DecoderLayer::new(config, &arch, &mut init, device))
            .collect();
        let lm_head =
            (!config.tie_word_embeddings).then(|| Param::from_tensor(init.normal([v, h], device)));
        Self {
            embed_tokens,
            layers,
            norm: RmsNorm::new(h, config.rms_norm_eps, device),
            lm_head,
            rope: RotaryEmbedding::new(config.head_dim(), &arch.rope),
            exec: Execution::default(),
        }
    }

    /// The same model running with `exec`.
    pub fn with_execution(mut self, exec: Execution) -> Self {
        self.exec = exec;
        self
    }

    /// How the model runs (precision, attention, checkpointing).
    pub fn execution(&self) -> Execution {
        self.exec
    }

    /// Whether the LM head is the token embedding.
    pub fn is_tied(&self) -> bool {
        self.lm_head.is_none()
    }

    /// The token embedding `[vocab, hidden]` (the parameter itself: gradients of a loss reach it
    /// through this tensor).
    pub fn embedding(&self) -> Tensor<B, 2> {
        self.embed_tokens.val()
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.embed_tokens.dims()[0]
    }

    /// The LM head weight `[vocab, hidden]`: the embedding itself when tied.
    pub fn head_weight(&self) -> Tensor<B, 2> {
        match &self.lm_head {
            Some(w) => w.val(),
            None => self.embed_tokens.val(),
        }
    }

    /// The dtype of activations: bf16 under [`Precision::Bf16Mixed`], else the embedding's dtype.
    pub fn compute_dtype(&self) -> DType {
        match self.exec.precision {
            Precision::Bf16Mixed => DType::BF16,
            Precision::F32 => self.embed_tokens.val().dtype(),
        }
    }
}

impl<B: KernelOps> CausalLm<B> {
    /// Token embeddings `[batch, seq, hidden]` of `batch`'s new tokens, in the compute dtype.
    fn embed(&self, batch: &ForwardBatch<B>) -> Tensor<B, 3> {
        let [b, t] = batch.input_ids.dims();
        let h = self.embed_tokens.dims()[1];
        let ids = batch.input_ids.clone().reshape([b * t]);
        to_dtype(self.embed_tokens.val().select(0, ids), self.compute_dtype()).reshape([b, t, h])
    }

    /// RoPE tables and the attention mask of one uncached pass over `batch`.
    fn pass_context(
        &self,
        batch: &ForwardBatch<B>,
        key_mask: Option<Tensor<B, 2, burn::tensor::Bool>>,
    ) -> (RopeTables<B>, AttentionMask<B>) {
        let [b, t] = batch.input_ids.dims();
        let attn = &self.layers[0].self_attn;
        let rope = self.rope.tables(
            batch.position_ids.clone(),
            attn.num_heads,
            attn.num_kv_heads,
        );
        let device = batch.input_ids.device();
        let mask = if t > 1 && self.exec.attention == AttentionImpl::Fused {
            let valid = match &key_mask {
                Some(m) => m.clone().float().cast(DType::F32),
                None => Tensor::<B, 2>::ones([b, t], &device).cast(DType::F32),
            };
            AttentionMask {
                bias: None,
                fused: Some(valid),
                kernels: self.exec.attention_kernels,
            }
        } else {
            AttentionMask {
                bias: attention_bias(b, t, 0, key_mask, &device),
                fused: None,
                kernels: self.exec.attention_kernels,
            }
        };
        (rope, mask)
    }

    /// Final hidden states `[batch, seq, hidden]` (after the last norm, in the compute dtype) of
    /// `batch`, a whole sequence per row (no cache: generation goes through the paged pass).
    pub fn forward_hidden(&self, batch: &ForwardBatch<B>) -> Tensor<B, 3> {
        let mut x = self.embed(batch);
        let (rope, mask) = self.pass_context(batch, batch.key_mask.clone());
        for layer in &self.layers {
            x = layer.forward(x, &rope, &mask, None);
        }
        self.norm.forward(x)
    }

    /// Final hidden states of `batch`'s new tokens with the paged cache `kv`: `pass` says where
    /// the new keys and values go and, for a decode step, which cached keys each row reads (see
    /// `conrub_rollout`). A prefill (`pass.read` is `None`) attends to its own tokens under
    /// `batch.key_mask`; a decode step is one new token per row.
    pub fn forward_hidden_paged(
        &self,
        batch: &ForwardBatch<B>,
        kv: &mut PagedKv<B>,
        pass: &PagedPass<B>,
    ) -> Tensor<B, 3> {
        let n = self.num_layers();
        self.forward_layers_paged(batch, kv, pass, &[n])
            .pop()
            .expect("one layer asked for")
    }

    /// Hidden states `[batch, seq, hidden]` of `batch`'s new tokens at each of `layers`, in that
    /// order, numbered as Hugging Face's `output_hidden_states`: `0` is the embedding, `l` the
    /// residual stream after `l` decoder layers, and `num_layers` the final norm's output. Only
    /// the layers up to the deepest one asked for run, so only their cache slots in `kv` are
    /// written (a probe over layer 14 of 28 costs half a forward). See
    /// [`CausalLm::forward_hidden_paged`] for `kv` and `pass`.
    pub fn forward_layers_paged(
        &self,
        batch: &ForwardBatch<B>,
        kv: &mut PagedKv<B>,
        pass: &PagedPass<B>,
        layers: &[usize],
    ) -> Vec<Tensor<B, 3>> {
        let n = self.num_layers();
        assert!(
            layers.iter().all(|&l| l <= n),
            "layers {layers:?} asked of a model with {n}"
        );
        let deepest = layers.iter().copied().max().unwrap_or(0);
        let t = batch.input_ids.dims()[1];
        let mut x = self.embed(batch);
        let attn = &self.layers[0].self_attn;
        let rope = self.rope.tables(
            batch.position_ids.clone(),
            attn.num_heads,
            attn.num_kv_heads,
        );
        let fused = batch.key_mask.clone().map(|m| m.float().cast(DType::F32));
        let mask = AttentionMask {
            bias: None,
            fused,
            kernels: self.exec.attention_kernels,
        };
        debug_assert!(
            pass.read.is_none() || t == 1,
            "decode steps feed one token per row"
        );
        let mut out: Vec<Option<Tensor<B, 3>>> = vec![None; layers.len()];
        let mut keep = |depth: usize, x: &Tensor<B, 3>| {
            for (o, &l) in out.iter_mut().zip(layers) {
                if l == depth {
                    *o = Some(x.clone());
                }
            }
        };
        if n > 0 {
            keep(0, &x);
        }
        let slots = kv.layers_mut().iter_mut();
        for (depth, (layer, slot)) in self.layers.iter().zip(slots).enumerate().take(deepest) {
            x = layer.forward(x, &rope, &mask, Some((slot, pass)));
            if depth + 1 < n {
                keep(depth + 1, &x);
            }
        }
        if deepest == n {
            keep(n, &self.norm.forward(x));
        }
        out.into_iter()
            .map(|o| o.expect("every layer kept"))
            .collect()
    }

    /// Next-token logits `[batch, vocab]` (last column) of a paged pass
    /// ([`CausalLm::forward_hidden_paged`]).
    pub fn forward_last_paged(
        &self,
        batch: &ForwardBatch<B>,
        kv: &mut PagedKv<B>,
        pass: &PagedPass<B>,
    ) -> Tensor<B, 2> {
        let hidden = self.forward_hidden_paged(batch, kv, pass);
        let [b, t, h] = hidden.dims();
        let logits = self.logits(hidden.slice([0..b, t - 1..t, 0..h]));
        let v = logits.dims()[2];
        logits.reshape([b, v])
    }

    /// Logits `[batch, seq, vocab]` for hidden states `[batch, seq, hidden]`, through the backend's
    /// [`KernelOps::chunk_logits`]: by default `(W · hᵀ)ᵀ`, so the `[vocab, hidden]` weight is used in
    /// its stored layout (backends that need contiguous matmul operands, such as ndarray, would
    /// otherwise copy the whole head, 622 MB for Qwen3-0.6B, on every call); burn-flex reads the
    /// head through its strides and returns contiguous logits.
    pub fn logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, t, h] = hidden.dims();
        let w = to_dtype(self.head_weight(), hidden.dtype());
        let v = w.dims()[0];
        let rows = hidden.reshape([b * t, h]).into_primitive().tensor();
        let logits: Tensor<B, 2> = Tensor::from_primitive(TensorPrimitive::Float(B::chunk_logits(
            rows,
            w.into_primitive().tensor(),
        )));
        logits.reshape([b, t, v])
    }

    /// Logits `[batch, seq, vocab]` of the new tokens.
    pub fn forward(&self, batch: &ForwardBatch<B>) -> Tensor<B, 3> {
        self.logits(self.forward_hidden(batch))
    }

    /// Logits `[batch, vocab]` of the last column only (the next-token distribution of a
    /// left-padded batch): the head runs on one position per row instead of all of them.
    pub fn forward_last(&self, batch: &ForwardBatch<B>) -> Tensor<B, 2> {
        let hidden = self.forward_hidden(batch);
        let [b, t, h] = hidden.dims();
        let logits = self.logits(hidden.slice([0..b, t - 1..t, 0..h]));
        let v = logits.dims()[2];
        logits.reshape([b, v])
    }
}

/// The rollout engine drives every family through its paged pass.
impl<B: KernelOps> PagedModel<B> for CausalLm<B> {
    fn kv_layout(&self) -> KvLayout {
        let a = &self.layers[0].self_attn;
        KvLayout {
            layers: self.num_layers(),
            width: a.num_kv_heads * a.head_dim,
            dtype: self.compute_dtype(),
        }
    }

    fn vocab_size(&self) -> usize {
        CausalLm::vocab_size(self)
    }

    fn forward_paged(
        &self,
        batch: &ForwardBatch<B>,
        kv: &mut PagedKv<B>,
        pass: &PagedPass<B>,
    ) -> Tensor<B, 2> {
        self.forward_last_paged(batch, kv, pass)
    }
}

impl<B: KernelOps + AutodiffBackend> CausalLm<B> {
    /// Gradients of `loss(hidden)` with respect to every parameter, where `hidden` is
    /// [`CausalLm::forward_hidden`] of `batch` (no cache), computed one decoder layer at a
    /// time: activation checkpointing per layer.
    ///
    /// 1. A forward pass without a graph keeps only each layer's input (`layers x tokens x hidden`).
    /// 2. The head's segment (final norm and `loss`) runs its backward from a leaf at the last
    ///    layer's output.
    /// 3. From the top, each layer's forward runs again from its saved input and its own backward
    ///    turns the gradient at its output into the gradient at its input (plus its parameters').
    /// 4. The embedding gets the gradient at the first layer's input.
    ///
    /// Only one layer's activations are alive at any time, for one extra forward pass. Every
    /// backward is an ordinary top-level one: burn 0.21 cannot nest a backward inside another
    /// (its graph cleanup locks every graph, the running one included), and its
    /// `BalancedCheckpointing` recomputes single cheap ops only, keeping matmul outputs.
    /// The gradients equal a plain backward's up to f32 summation order.
    pub fn layerwise_gradients(
        &self,
        batch: &ForwardBatch<B>,
        loss: &mut dyn FnMut(Tensor<B, 3>) -> Tensor<B, 1>,
    ) -> GradientsParams {
        self.layerwise_gradients_into(batch, loss, GradientsParams::new())
    }

    /// [`CausalLm::layerwise_gradients`] added into `sum` (an optimizer step's running
    /// sum over its micro-batches), each segment's gradients as soon as its backward made them:
    /// the micro-batch's whole set of gradients never exists next to the sum, only the head's or
    /// one layer's. Returns the new sum.
    pub fn layerwise_gradients_into(
        &self,
        batch: &ForwardBatch<B>,
        loss: &mut dyn FnMut(Tensor<B, 3>) -> Tensor<B, 1>,
        sum: GradientsParams,
    ) -> GradientsParams {
        let mut acc = Some(sum);
        self.layerwise_gradients_each(batch, loss, &mut |new| {
            let sum = acc.take().expect("a running sum");
            acc = Some(add_gradients(self, sum, new));
        });
        acc.expect("a running sum")
    }

    /// [`CausalLm::layerwise_gradients`] handed to `sink` a segment at a time, as each
    /// segment's backward makes them: the head's (final norm, and a tied embedding's head
    /// part), each decoder layer's from the top, the embedding's.
    pub fn layerwise_gradients_each(
        &self,
        batch: &ForwardBatch<B>,
        loss: &mut dyn FnMut(Tensor<B, 3>) -> Tensor<B, 1>,
        sink: &mut dyn FnMut(GradientsParams),
    ) {
        self.layerwise(
            batch,
            &mut |_, hidden| loss(hidden),
            sink,
            &mut Segments::Own,
        )
        .expect("a model's own segments need no gathering");
    }

    /// [`CausalLm::layerwise_gradients_each`] of a model whose parameters are sharded
    /// (`sharding = "full"`): the embedding, final norm and head are gathered from `source` once
    /// for the pass, each decoder layer for its forward and again for its recomputation and
    /// backward, each copy dropped when its segment is done. `loss` gets the gathered model
    /// (its head) with the hidden states.
    pub(crate) fn layerwise_gradients_gathered(
        &self,
        batch: &ForwardBatch<B>,
        loss: &mut dyn FnMut(&Self, Tensor<B, 3>) -> Tensor<B, 1>,
        sink: &mut dyn FnMut(GradientsParams),
        source: &mut dyn ParamGather<B>,
    ) -> conrub_contracts::Result<()> {
        self.layerwise(batch, loss, sink, &mut Segments::Gathered(source))
    }

    /// The stages of a layer-by-layer backward, each segment's parameters from `segments`.
    fn layerwise(
        &self,
        batch: &ForwardBatch<B>,
        loss: &mut dyn FnMut(&Self, Tensor<B, 3>) -> Tensor<B, 1>,
        sink: &mut dyn FnMut(GradientsParams),
        segments: &mut Segments<'_, B>,
    ) -> conrub_contracts::Result<()> {
        let key_mask = batch.key_mask.clone();
        let (rope, mask) = self.pass_context(batch, key_mask);
        // The embedding, final norm and head (no decoder layers).
        let shell = segments.fetch(&self.without_layers())?;
        // 1. No graph: untracked parameters.
        let mut inputs = Vec::with_capacity(self.layers.len());
        let mut x = shell.clone().no_grad().embed(batch);
        for layer in &self.layers {
            inputs.push(x.clone());
            let untracked = segments.fetch(&layer.clone().no_grad())?;
            x = untracked.forward(x, &rope, &mask, None);
        }
        // 2. The head's segment.
        let leaf = x.detach().require_grad();
        let grads = loss(&shell, shell.norm.forward(leaf.clone())).backward();
        let mut upstream = leaf
            .grad(&grads)
            .expect("the loss depends on the hidden states");
        sink(GradientsParams::from_grads(grads, &shell));
        // 3. Layers from the top.
        for (layer, input) in self.layers.iter().zip(inputs).rev() {
            let layer = segments.fetch(layer)?;
            let leaf = input.detach().require_grad();
            let y = layer.forward(leaf.clone(), &rope, &mask, None);
            let grads = (y * Tensor::from_inner(upstream)).sum().backward();
            upstream = leaf
                .grad(&grads)
                .expect("a layer's output depends on its input");
            sink(GradientsParams::from_grads(grads, &layer));
        }
        // 4. The embedding (tied heads add to what the head's segment gave it).
        let grads = (shell.embed(batch) * Tensor::from_inner(upstream))
            .sum()
            .backward();
        sink(GradientsParams::from_grads(grads, &shell));
        Ok(())
    }

    /// The model without its decoder layers: the embedding, final norm and head.
    fn without_layers(&self) -> Self {
        Self {
            embed_tokens: self.embed_tokens.clone(),
            layers: Vec::new(),
            norm: self.norm.clone(),
            lm_head: self.lm_head.clone(),
            rope: self.rope.clone(),
            exec: self.exec,
        }
    }
}

/// Where a layer-by-layer backward takes each segment's parameters from.
enum Segments<'a, B: AutodiffBackend> {
    /// The model's own (every parameter whole).
    Own,
    /// Gathered from the ranks that own them.
    Gathered(&'a mut dyn ParamGather<B>),
}

impl<B: AutodiffBackend> Segments<'_, B> {
    /// `segment` with whole parameters.
    fn fetch<M: Module<B>>(&mut self, segment: &M) -> conrub_contracts::Result<M> {
        match self {
            Segments::Own => Ok(segment.clone()),
            Segments::Gathered(source) => gathered(segment, *source),
        }
    }
}
