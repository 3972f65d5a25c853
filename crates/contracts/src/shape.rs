//! The model's shape as the model reports it: what the memory planner and the learner's
//! telemetry need to know of an architecture, without naming it.

use serde::Serialize;

/// The dimensions of a decoder-only transformer that its memory depends on, as the model reports
/// them (each family of `models/` turns its `config.json` into one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ModelShape {
    /// Vocabulary size `V`.
    pub vocab_size: usize,
    /// Model width `H`.
    pub hidden_size: usize,
    /// MLP width `I`.
    pub intermediate_size: usize,
    /// Decoder layers `L`.
    pub num_hidden_layers: usize,
    /// Query heads `n_h`.
    pub num_attention_heads: usize,
    /// Key/value heads `n_kv`.
    pub num_key_value_heads: usize,
    /// Per-head width `d`.
    pub head_dim: usize,
    /// Whether the LM head is the token embedding.
    pub tie_word_embeddings: bool,
    /// Per-head RMSNorm of queries and keys (the qwen3 family).
    pub qk_norm: bool,
    /// Biases on the q, k and v projections (the qwen2 family).
    pub qkv_bias: bool,
    /// A bias on the output projection.
    pub o_bias: bool,
}

impl ModelShape {
    /// Parameters of one decoder layer: q, k, v, o projections with their biases, the q/k norms
    /// where the family has them, two layer norms, and the SwiGLU MLP.
    pub fn layer_parameters(&self) -> u64 {
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let q = (self.num_attention_heads * self.head_dim) as u64;
        let kv = (self.num_key_value_heads * self.head_dim) as u64;
        let qk_norms = if self.qk_norm {
            2 * self.head_dim as u64
        } else {
            0
        };
        let biases = if self.qkv_bias { q + 2 * kv } else { 0 } + if self.o_bias { h } else { 0 };
        h * q + 2 * h * kv + q * h + qk_norms + biases + 2 * h + 3 * h * i
    }

    /// All parameters: embedding, untied head, layers, final norm.
    pub fn parameters(&self) -> u64 {
        let vh = (self.vocab_size * self.hidden_size) as u64;
        let head = if self.tie_word_embeddings { 0 } else { vh };
        vh + head
            + self.num_hidden_layers as u64 * self.layer_parameters()
            + self.hidden_size as u64
    }

    /// Elements of the largest parameter tensor.
    pub fn largest_tensor(&self) -> u64 {
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let q = (self.num_attention_heads * self.head_dim) as u64;
        (self.vocab_size as u64 * h).max(h * i).max(h * q)
    }

    /// KV cache bytes per row and position, all layers: `2 L n_kv d c_kv`.
    pub fn kv_bytes_per_position(&self, c_kv: f64) -> f64 {
        2.0 * (self.num_hidden_layers * self.num_key_value_heads * self.head_dim) as f64 * c_kv
    }

    /// Bytes the autodiff tape keeps per token for one decoder layer with activations of `c` bytes:
    /// normed input `H`; q, k, v projections; q and k after their norms and after RoPE; the
    /// attention output `n_h d` and its lse (`n_h` f32); o projection `H`; residual `H`; post-norm
    /// `H`; gate, up, silu(gate), product (`I` each); down projection `H`. RMSNorm statistics are
    /// f32: one inverse RMS per normed row, and below f32 the f32 copy of each norm's input
    /// (`2H + (n_h + n_kv) d`).
    pub fn layer_activation_bytes(&self, c: f64) -> f64 {
        let (h, i, d) = (
            self.hidden_size as f64,
            self.intermediate_size as f64,
            self.head_dim as f64,
        );
        let (nh, nkv) = (
            self.num_attention_heads as f64,
            self.num_key_value_heads as f64,
        );
        let compute = 5.0 * h + 4.0 * (nh + nkv) * d + 4.0 * i;
        let lse = nh;
        let inv_rms = 2.0 + nh + nkv;
        let f32_copies = if c < 4.0 {
            2.0 * h + (nh + nkv) * d
        } else {
            0.0
        };
        c * compute + 4.0 * (lse + inv_rms + f32_copies)
    }

    /// Bytes alive per token inside one layer of an untracked (inference) forward: the residual
    /// stream, normed input and projections `3H + (n_h + 2 n_kv) d`, and three `I`-wide MLP tensors,
    /// plus below f32 the norms' f32 copies (`2H`).
    pub fn inference_bytes_per_token(&self, c: f64) -> f64 {
        let (h, i, d) = (
            self.hidden_size as f64,
            self.intermediate_size as f64,
            self.head_dim as f64,
        );
        let (nh, nkv) = (
            self.num_attention_heads as f64,
            self.num_key_value_heads as f64,
        );
        let f32_copies = if c < 4.0 { 2.0 * h } else { 0.0 };
        c * (3.0 * h + (nh + 2.0 * nkv) * d + 3.0 * i) + 4.0 * f32_copies
    }
}
