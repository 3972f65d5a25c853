//! Memory plan of a `conrub train` run: the predicted peak device memory, and the largest
//! micro-batch and rollout call that fit. Pure arithmetic on the model shape and the run settings;
//! no tensor is made.
//!
//! The model follows what the training code does (byte counts are `f64`, in bytes):
//!
//! - Parameters `P` are counted from the shape ([`ModelShape::parameters`]). Master weights,
//!   gradients and AdamW's two moments are f32 under both precisions: `4P`, `4P`, `8P`.
//! - `bf16-mixed` casts each weight to bf16 where it is used: with activation checkpointing only one
//!   layer's copy and the head's `V x H` copy are alive at once, without it every layer's copy stays
//!   alive until the backward.
//! - A micro-batch holds `rows = max(1, micro_batch_tokens / s)` full-length rows of `s` = max
//!   prompt + max response tokens (rows are padded to the longest, as `plan_micro_batches` does),
//!   so it has `n = rows x s` tokens. Per token and layer the autodiff tape keeps
//!   [`ModelShape::layer_activation_bytes`]. With checkpointing each layer keeps only its input
//!   (`L n H c`) and one layer's tape exists during its recompute and backward, times
//!   [`LAYER_BACKWARD_FACTOR`] for that layer's gradients; without it every layer's tape is kept
//!   (plus one layer's gradients during the backward).
//! - Fused attention keeps `O(n)` per layer (output and lse); the portable block-wise path's
//!   transient is one block of [`ATTENTION_QUERY_BLOCK`] query rows against `s` keys for every
//!   head and row of the micro-batch in f32, [`ATTENTION_BLOCK_COPIES`] times, plus the backward's
//!   f32 `dk`/`dv` accumulators.
//! - The LM head runs a chunk of tokens at a time: `chunk x V x 4` bytes of f32 logits,
//!   [`LM_HEAD_COPIES`] times (logits, their gradient), plus the final hidden states. The head's
//!   backward and a layer's attention never run at once, so only the larger of the two counts.
//! - The backward makes gradients top down while it frees the tape, so at its start (the tape's
//!   peak) only the head's and one layer's gradients exist. When an optimizer step sums several
//!   micro-batches, the running sum (`4P`) is alive through every micro-batch; with activation
//!   checkpointing each segment's gradients are added into it as they are made (one layer's
//!   set beside it), without, the micro-batch's whole set (a second `4P`) exists until it is
//!   added in.
//! - The rollout (no autodiff) keeps master weights and AdamW moments allocated, frees the
//!   gradients, and under `bf16-mixed` samples with a bf16 copy of the weights (`2P`). The rollout
//!   engine (`conrub_rollout`) holds its KV cache in one pool of blocks of
//!   `kv_block_size` positions at `2 L n_kv d c` bytes each, allocated once: `kv_cache_gb` when
//!   set, otherwise the engine's budget rule [`MemoryPlan::kv_pool_bytes`]: [`AUTO_KV_SHARE`] of
//!   what the rollout leaves free, and never more than every row of a call at full length. The
//!   engine queues what does not fit and preempts, so the pool needs to hold only one full-length
//!   row; `max_rollout_rows` is how many it holds at once. Its transient is the larger of a
//!   decode step (one token's activations per row, the logits and the sampler's f32 copies: the
//!   decode attention kernel `conrub_kernels::paged_decode_attention` reads the pool in place)
//!   and a prefill pass.
//! - Training and rollout do not overlap: the peak is the larger of the two.
//! - Data-parallel ranks (`ranks`): the plan is per rank. With `sharding` a rank keeps `1/N` of
//!   what the mode shards ([`Sharding`]): AdamW moments (`optimizer` on), the summed gradients
//!   (`gradients` on; each piece the backward makes is reduce-scattered at once, so one layer's
//!   set, or a micro-batch's without checkpointing, stands beside the sum), the master weights
//!   (`full`: during a backward pass the embedding, norm and head gathered in f32 and one
//!   decoder layer at a time; for the rollout the whole weights gathered, matrices in the
//!   compute dtype; at a checkpoint the export's whole weights in the save dtype on the first
//!   rank, [`Phase::Checkpoint`]). [`MemoryPlan::by_sharding`]
//!   plans every mode.
//!
//! A flat [`RUNTIME_RESERVE_BYTES`] stands for the CUDA context, kernels and allocator slack.

use std::fmt::Write as _;

use conrub_config::TrainConfig;
pub use conrub_contracts::{ModelShape, Precision, Sharding};
use serde::Serialize;

/// One decimal gigabyte.
pub const GB: f64 = 1e9;
/// GPU memory assumed unless told otherwise (an H200: 141 GB).
pub const DEFAULT_GPU_MEMORY_GB: f64 = 141.0;
/// Longest prompt assumed when the config does not say.
pub const DEFAULT_MAX_PROMPT_TOKENS: usize = 1024;
/// `max_micro_batch_tokens` is searched in multiples of this.
pub const MICRO_BATCH_STEP: usize = 1024;
/// One layer's tape during its backward counts this many times (its activations plus the part of
/// their gradients alive at once). Fitted to the peaks `benches/attention.rs` measures on flex
/// (T = 2k..8k, with and without checkpointing: 1.65 puts the plan within +13% / -1% of them).
pub const LAYER_BACKWARD_FACTOR: f64 = 1.65;
/// Query rows per block of the portable attention (`conrub_kernels`' `QUERY_BLOCK`).
pub const ATTENTION_QUERY_BLOCK: usize = 256;
/// f32 copies of one attention block's scores alive at once (scores and probabilities; fitted
/// with [`LAYER_BACKWARD_FACTOR`]).
pub const ATTENTION_BLOCK_COPIES: f64 = 2.0;
/// f32 `[chunk, vocab]` tensors of the chunked LM head alive at once (logits and their gradient;
/// fitted with [`LAYER_BACKWARD_FACTOR`]).
pub const LM_HEAD_COPIES: f64 = 2.0;
/// `[tokens, hidden]` tensors around the head: the final hidden states, their response-position
/// gather, and its gradient.
pub const FINAL_HIDDEN_COPIES: f64 = 3.0;
/// f32 copies of the largest parameter alive during the AdamW step.
pub const OPTIMIZER_STEP_COPIES: f64 = 3.0;
/// Share of the memory a rollout leaves free that the engine's KV pool takes when
/// `kv_cache_gb` is not set (the rest is slack for fragmentation).
pub const AUTO_KV_SHARE: f64 = 0.9;
/// f32 `[rows, vocab]` tensors of on-device sampling alive at once (logits, exponentials, their
/// cumulative sums).
pub const SAMPLING_COPIES: f64 = 3.0;
/// Device bytes per token of the train batch (ids, targets/positions as i64, mask and old
/// log-probs as f32); 4 more with a reference model.
pub const TRAIN_BATCH_BYTES_PER_TOKEN: f64 = 28.0;
/// CUDA context, compiled kernels, workspaces and allocator slack.
pub const RUNTIME_RESERVE_BYTES: f64 = 2e9;

/// What a memory plan is computed from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryPlanInput {
    /// Model dimensions.
    pub model: ModelShape,
    /// Compute precision (`f32` or `bf16-mixed`).
    pub precision: Precision,
    /// Whether decoder layers are recomputed in the backward.
    pub activation_checkpointing: bool,
    /// `learner.micro_batch_tokens` (padded tokens per micro-batch).
    pub micro_batch_tokens: usize,
    /// Tokens per chunk of the LM head (`conrub_kernels::DEFAULT_CHUNK_TOKENS`).
    pub chunk_tokens: usize,
    /// `learner.group_size` (responses per prompt).
    pub group_size: usize,
    /// `run.prompts_per_step`.
    pub prompts_per_step: usize,
    /// `learner.mini_batches` (optimizer steps per PPO epoch; each sums its micro-batches'
    /// gradients).
    pub mini_batches: usize,
    /// `learner.rollout_prompts_per_call` (prompts sampled together).
    pub rollout_prompts_per_call: usize,
    /// Longest prompt in tokens.
    pub max_prompt_tokens: usize,
    /// `learner.max_response_tokens`.
    pub max_response_tokens: usize,
    /// Whether a reference model is kept (`learner.kl_beta != 0`).
    pub keep_reference: bool,
    /// `rollout.kv_cache_gb`: the engine's KV pool in decimal GB (`None`: the budget rule).
    pub kv_cache_gb: Option<f64>,
    /// `rollout.block_size`: positions per KV block.
    pub kv_block_size: usize,
    /// `rollout.max_rows`: sequences the engine decodes at once at most.
    pub rollout_max_rows: usize,
    /// The rollouts run in this process (conrub-rollout's engine). `false` when inference
    /// servers generate them: no rollout parts and no KV pool on the learner's side.
    pub rollout_in_process: bool,
    /// Device memory in decimal GB.
    pub gpu_memory_gb: f64,
    /// Data-parallel ranks (1 on one device).
    pub ranks: usize,
    /// How the ranks divide the training state (see [`Sharding`]); ignored on one rank.
    pub sharding: Sharding,
    /// Bytes per bucket of a collective call (`learner.allreduce_bucket_mb`): a sharded rank
    /// holds the old and the gathered copy of one bucket of weights at once.
    pub bucket_bytes: f64,
    /// Bytes per weight the checkpoint export writes (`model.save_dtype`: 4 for f32, 2 for
    /// bf16): a `full` group assembles its whole policy in it on the first rank's device.
    pub export_bytes_per_weight: f64,
}

impl MemoryPlanInput {
    /// The defaults of `conrub train` (the `[learner]` and `[run]` defaults of a train config,
    /// f32, prompts up to [`DEFAULT_MAX_PROMPT_TOKENS`], a 141 GB device) for `model`.
    /// `conrub_config`'s tests hold these to the run config's own defaults.
    pub fn new(model: ModelShape) -> Self {
        Self {
            model,
            precision: Precision::F32,
            activation_checkpointing: false,
            micro_batch_tokens: 16_384,
            chunk_tokens: conrub_kernels::DEFAULT_CHUNK_TOKENS,
            group_size: 8,
            prompts_per_step: 32,
            mini_batches: 1,
            rollout_prompts_per_call: 32,
            max_prompt_tokens: DEFAULT_MAX_PROMPT_TOKENS,
            max_response_tokens: 8192,
            keep_reference: false,
            kv_cache_gb: None,
            kv_block_size: conrub_rollout::DEFAULT_BLOCK_SIZE,
            rollout_max_rows: conrub_rollout::DEFAULT_MAX_ROWS,
            rollout_in_process: true,
            gpu_memory_gb: DEFAULT_GPU_MEMORY_GB,
            ranks: 1,
            sharding: Sharding::None,
            bucket_bytes: 64.0 * (1u64 << 20) as f64,
            export_bytes_per_weight: 4.0,
        }
    }

    /// The inputs of a run config `cfg` for a model of `shape` on a device of `gpu_memory_gb`;
    /// `max_prompt_tokens` overrides `data.max_prompt_tokens` (default 1,024).
    pub fn for_run(
        cfg: &TrainConfig,
        shape: ModelShape,
        gpu_memory_gb: f64,
        max_prompt_tokens: Option<usize>,
    ) -> MemoryPlanInput {
        let l = &cfg.learner;
        let mut input = MemoryPlanInput::new(shape);
        input.precision = cfg.precision;
        input.activation_checkpointing = l.system.activation_checkpointing;
        input.micro_batch_tokens = l.system.micro_batch_tokens;
        input.mini_batches = l.mini_batches;
        input.group_size = l.group_size;
        input.max_response_tokens = l.max_response_tokens;
        input.rollout_prompts_per_call = l.system.rollout_prompts_per_call;
        // Each data-parallel rank holds its share of the step's groups (the first ranks one
        // more when they do not divide): the plan is per rank.
        input.prompts_per_step = cfg.prompts_per_rank();
        input.keep_reference = l.objective.kl_beta != 0.0 || l.kl_in_reward != 0.0;
        input.max_prompt_tokens = max_prompt_tokens
            .or(cfg.data.max_prompt_tokens)
            .unwrap_or(DEFAULT_MAX_PROMPT_TOKENS);
        input.kv_cache_gb = cfg.rollout.kv_cache_gb;
        input.kv_block_size = cfg.rollout.block_size;
        input.rollout_max_rows = cfg.rollout.max_rows;
        input.rollout_in_process = cfg.rollout.engine == conrub_config::RolloutEngineKind::Paged;
        input.gpu_memory_gb = gpu_memory_gb;
        input.ranks = cfg.devices.len().max(1);
        input.sharding = cfg.sharding;
        input.bucket_bytes = l.system.allreduce_bucket_bytes() as f64;
        input.export_bytes_per_weight = cfg.model.save_dtype.bytes() as f64;
        input
    }

    /// Full-length sequence: longest prompt + longest response.
    pub fn sequence_tokens(&self) -> usize {
        self.max_prompt_tokens + self.max_response_tokens
    }

    /// Rows of a step's train batch: prompts per step x group size.
    pub fn step_rows(&self) -> usize {
        self.prompts_per_step * self.group_size
    }

    /// Rows of one sampling call: `min(rollout_prompts_per_call, prompts_per_step) x group_size`.
    pub fn rollout_rows(&self) -> usize {
        self.rollout_prompts_per_call
            .min(self.prompts_per_step)
            .max(1)
            * self.group_size
    }

    /// Rows the engine decodes at once at most: `min(rollout_rows, rollout_max_rows)`.
    pub fn decode_rows(&self) -> usize {
        self.rollout_rows().min(self.rollout_max_rows.max(1))
    }

    /// Bytes of one KV block.
    pub fn kv_block_bytes(&self) -> f64 {
        self.kv_block_size.max(1) as f64 * self.model.kv_bytes_per_position(self.compute_bytes())
    }

    /// KV blocks of one full-length row.
    pub fn full_row_blocks(&self) -> usize {
        self.sequence_tokens()
            .div_ceil(self.kv_block_size.max(1))
            .max(1)
    }

    /// Full-length rows that fit one micro-batch's budget (at least one; at most the step's
    /// rows). Micro-batches never span two groups, so fewer may be used: the peak is bounded
    /// by this many.
    pub fn micro_batch_rows(&self) -> usize {
        let s = self.sequence_tokens().max(1);
        (self.micro_batch_tokens / s).clamp(1, self.step_rows().max(1))
    }

    /// Micro-batches whose gradients one optimizer step sums: the mini-batch's rows
    /// (`step_rows / mini_batches`, rounded up), each group in micro-batches of
    /// [`Self::micro_batch_rows`].
    pub fn micro_batches_per_optimizer_step(&self) -> usize {
        let group = self.group_size.max(1);
        let mini = self.step_rows().max(1).div_ceil(self.mini_batches.max(1));
        let rows = self.micro_batch_rows().min(group);
        mini.div_ceil(group) * group.min(mini).div_ceil(rows)
    }

    /// Device memory in bytes.
    pub fn gpu_bytes(&self) -> f64 {
        self.gpu_memory_gb * GB
    }

    /// The share of a sharded state one rank keeps: `1 / ranks` when `shards(sharding)`
    /// says the part is sharded and there are several ranks, else 1.
    fn share(&self, shards: fn(Sharding) -> bool) -> f64 {
        if self.ranks > 1 && shards(self.sharding) {
            1.0 / self.ranks as f64
        } else {
            1.0
        }
    }

    fn compute_bytes(&self) -> f64 {
        self.precision.compute_bytes() as f64
    }
}

/// When a part is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// For the whole run.
    Always,
    /// Through a training step (micro-batches and optimizer step).
    Training,
    /// While one micro-batch runs its forward and backward (at the start of the backward, when
    /// the tape is whole).
    MicroBatch,
    /// Within a micro-batch, while the LM head runs its backward (exclusive of [`Phase::LayerBackward`]).
    HeadBackward,
    /// Within a micro-batch, while a decoder layer runs its attention (exclusive of [`Phase::HeadBackward`]).
    LayerBackward,
    /// At the end of a micro-batch's backward, when its gradients are added to the earlier
    /// micro-batches' (only when an optimizer step sums several).
    GradientSum,
    /// During the AdamW step (after the micro-batches).
    OptimizerStep,
    /// During a rollout call.
    Rollout,
    /// While a checkpoint's export holds the whole policy (a `full` group's, assembled on the
    /// first rank's device).
    Checkpoint,
}

impl Phase {
    /// The name printed in the table.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Always => "always",
            Phase::Training => "training",
            Phase::MicroBatch => "micro-batch",
            Phase::HeadBackward => "head backward",
            Phase::LayerBackward => "layer backward",
            Phase::GradientSum => "gradient sum",
            Phase::OptimizerStep => "optimizer step",
            Phase::Rollout => "rollout",
            Phase::Checkpoint => "checkpoint",
        }
    }
}

/// One line of the plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Part {
    /// Key in the JSON output.
    pub name: &'static str,
    /// Description in the table.
    pub label: String,
    /// When it is allocated.
    pub phase: Phase,
    /// Bytes.
    pub bytes: f64,
}

/// The predicted memory of a run (see the module docs for the model).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryPlan {
    /// What it was computed from.
    pub input: MemoryPlanInput,
    /// Parameter count.
    pub parameters: u64,
    /// Rows of one micro-batch.
    pub micro_batch_rows: usize,
    /// Tokens of one micro-batch (rows x sequence tokens).
    pub micro_batch_tokens_used: usize,
    /// Rows of one rollout call.
    pub rollout_rows: usize,
    /// Blocks of the engine's KV pool (see [`MemoryPlan::kv_pool_bytes`]).
    pub kv_pool_blocks: usize,
    /// The parts; within a phase they add up.
    pub parts: Vec<Part>,
    /// `always + training + max(micro-batch + max(head backward, layer backward), gradient sum,
    /// optimizer step)`.
    pub training_peak: f64,
    /// `always + rollout`.
    pub rollout_peak: f64,
    /// `always + checkpoint` (only a `full` group's export holds more than `always`).
    pub checkpoint_peak: f64,
    /// `max(training_peak, rollout_peak, checkpoint_peak)`.
    pub peak: f64,
    /// Largest `micro_batch_tokens` (a multiple of [`MICRO_BATCH_STEP`]) whose training peak fits;
    /// 0 when not even one full-length row does. Capped at the whole step in one micro-batch.
    pub max_micro_batch_tokens: usize,
    /// Full-length rows the KV pool holds at once (the engine queues and preempts the rest; 0:
    /// not even one, and the rollout cannot run).
    pub max_rollout_rows: usize,
}

/// The plan does not fit the device: the message holds the table and what to change.
#[derive(Debug, Clone, PartialEq)]
pub struct DoesNotFit(pub String);

impl std::fmt::Display for DoesNotFit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DoesNotFit {}

fn part(name: &'static str, label: impl Into<String>, phase: Phase, bytes: f64) -> Part {
    Part {
        name,
        label: label.into(),
        phase,
        bytes,
    }
}

fn training_parts(i: &MemoryPlanInput) -> Vec<Part> {
    let m = &i.model;
    let c = i.compute_bytes();
    let p = m.parameters() as f64;
    let (v, h, l) = (
        m.vocab_size as f64,
        m.hidden_size as f64,
        m.num_hidden_layers as f64,
    );
    let (nh, nkv, d) = (
        m.num_attention_heads as f64,
        m.num_key_value_heads as f64,
        m.head_dim as f64,
    );
    let s = i.sequence_tokens() as f64;
    let n = (i.micro_batch_rows() * i.sequence_tokens()) as f64;
    let layer = m.layer_activation_bytes(c);
    let layer_params = m.layer_parameters() as f64;
    let mixed = i.precision == Precision::Bf16Mixed;
    let summing = i.micro_batches_per_optimizer_step() > 1;
    let mut parts = vec![part(
        "train_batch",
        "train batch (ids, mask, old log-probs)",
        Phase::Training,
        (i.step_rows() as f64)
            * s
            * (TRAIN_BATCH_BYTES_PER_TOKEN + if i.keep_reference { 4.0 } else { 0.0 }),
    )];
    let grad_share = i.share(Sharding::shards_gradients);
    if summing {
        let label = if grad_share < 1.0 {
            "gradients summed over the micro-batches (f32, own 1/N)"
        } else {
            "gradients summed over the step's micro-batches (f32)"
        };
        parts.push(part(
            "gradients",
            label,
            Phase::Training,
            4.0 * p * grad_share,
        ));
    }
    if i.share(Sharding::shards_parameters) < 1.0 {
        // A backward pass gathers the embedding, final norm and head once and keeps them, and
        // each decoder layer for its forward and again for its backward, one at a time, in the
        // parameters' dtype (f32).
        let head = if m.tie_word_embeddings {
            v * h
        } else {
            2.0 * v * h
        };
        parts.push(part(
            "gathered_embedding_head",
            "gathered embedding, norm and head (f32, per backward pass)",
            Phase::MicroBatch,
            4.0 * (head + h),
        ));
        parts.push(part(
            "gathered_layer_weights",
            "gathered weights (one layer, f32)",
            Phase::MicroBatch,
            4.0 * layer_params,
        ));
    }
    if mixed {
        let (label, bytes) = if i.activation_checkpointing {
            (
                "bf16 weight copies (one layer + head)",
                2.0 * (layer_params + v * h),
            )
        } else {
            (
                "bf16 weight copies (all layers + head)",
                2.0 * (l * layer_params + v * h + h),
            )
        };
        parts.push(part("bf16_weight_copies", label, Phase::MicroBatch, bytes));
    }
    parts.push(part(
        "layer_inputs",
        "layer inputs (residual stream, every layer)",
        Phase::MicroBatch,
        l * n * h * c,
    ));
    if i.activation_checkpointing {
        parts.push(part(
            "layer_activations",
            "one layer's activations + grads (recompute)",
            Phase::MicroBatch,
            n * layer * LAYER_BACKWARD_FACTOR,
        ));
    } else {
        parts.push(part(
            "layer_activations",
            "activations of every layer (+ one layer's grads)",
            Phase::MicroBatch,
            n * layer * (l + LAYER_BACKWARD_FACTOR - 1.0),
        ));
    }
    // The backward makes the gradients top down while it frees the tape: at its start (the peak
    // of the tape) only the head's and one layer's exist.
    parts.push(part(
        "backward_gradients",
        "gradients made so far (head + one layer, f32)",
        Phase::MicroBatch,
        4.0 * (v * h + layer_params),
    ));
    let norm_f32 = if c < 4.0 { n * h * 4.0 } else { 0.0 } + n * 4.0;
    parts.push(part(
        "final_hidden",
        "final hidden states + grad",
        Phase::MicroBatch,
        n * h * c * FINAL_HIDDEN_COPIES + norm_f32,
    ));
    parts.push(part(
        "lm_head_chunk",
        format!("LM head chunk ({} tokens x vocab, f32)", i.chunk_tokens),
        Phase::HeadBackward,
        (i.chunk_tokens as f64).min(n) * v * 4.0 * LM_HEAD_COPIES,
    ));
    let block = (ATTENTION_QUERY_BLOCK as f64).min(s);
    parts.push(part(
        "attention_transient",
        "attention block transient (f32 scores, dk/dv)",
        Phase::LayerBackward,
        n * nh * block * 4.0 * ATTENTION_BLOCK_COPIES + 3.0 * n * nkv * d * 4.0,
    ));
    let largest = m.largest_tensor() as f64 * 4.0;
    if summing && grad_share < 1.0 {
        // Each piece the backward makes is reduce-scattered at once
        // (`Gradients::Pieces`): with checkpointing a segment's (a layer's, or the
        // head's, counted in the micro-batch's backward gradients), without the whole set.
        let (label, bytes) = if i.activation_checkpointing {
            (
                "one segment's gradients (f32) until reduce-scattered",
                4.0 * layer_params + largest,
            )
        } else {
            (
                "one micro-batch's gradients (f32) until reduce-scattered",
                4.0 * p + largest,
            )
        };
        parts.push(part(
            "micro_batch_gradients",
            label,
            Phase::GradientSum,
            bytes,
        ));
    } else if summing && i.activation_checkpointing {
        // Each segment's gradients go into the running sum as its backward makes them
        // (`Gradients::Sum`): one layer's set (or the head's, counted in the
        // micro-batch's backward gradients) beside the sum, never a whole model's.
        parts.push(part(
            "micro_batch_gradients",
            "one layer's gradients (f32) into the sum + transient",
            Phase::GradientSum,
            4.0 * layer_params + largest,
        ));
    } else if summing {
        parts.push(part(
            "micro_batch_gradients",
            "one micro-batch's gradients (f32) + sum transient",
            Phase::GradientSum,
            4.0 * p + largest,
        ));
    } else {
        parts.push(part(
            "micro_batch_gradients",
            "the micro-batch's gradients (f32)",
            Phase::OptimizerStep,
            4.0 * p,
        ));
    }
    parts.push(part(
        "optimizer_step_transient",
        "AdamW step transient (largest tensor)",
        Phase::OptimizerStep,
        largest * OPTIMIZER_STEP_COPIES,
    ));
    if i.share(Sharding::shards_optimizer) < 1.0 && !i.sharding.shards_parameters() {
        // The updated weights come back a bucket at a time (a parameter larger than a bucket
        // is a bucket of its own): its old and its gathered copy.
        parts.push(part(
            "weight_all_gather",
            "weight all-gather (old + new copy of one bucket)",
            Phase::OptimizerStep,
            2.0 * i.bucket_bytes.max(largest),
        ));
    }
    parts
}

/// The training peak of a list of parts: `always + training + max(micro-batch + max(head
/// backward, layer backward), gradient sum, optimizer step)`.
pub fn training_peak_of_parts(parts: &[Part]) -> f64 {
    let s = |ph: Phase| sum(parts, ph);
    let micro = s(Phase::MicroBatch) + s(Phase::HeadBackward).max(s(Phase::LayerBackward));
    s(Phase::Always)
        + s(Phase::Training)
        + micro
            .max(s(Phase::GradientSum))
            .max(s(Phase::OptimizerStep))
}

/// The engine's transient at `rows` running rows: the larger of a decode step at full length and
/// a prefill pass.
fn rollout_transient(i: &MemoryPlanInput) -> f64 {
    let m = &i.model;
    let c = i.compute_bytes();
    let rows = i.decode_rows() as f64;
    let (v, nh) = (m.vocab_size as f64, m.num_attention_heads as f64);
    // Decode: the paged attention kernel reads the pool in place (nothing gathered, scores in
    // shared memory), so one token's activations per row, the block tables, the logits and the
    // sampler's f32 copies.
    let table = (conrub_rollout::attended_blocks(i.full_row_blocks()) * 8) as f64;
    let decode =
        rows * (m.inference_bytes_per_token(c) + table) + rows * v * (c + 4.0 * SAMPLING_COPIES);
    // Prefill: one prompt (the engine prefills each alone) through one layer, its attention
    // blocks, and one row of logits.
    let p = i.max_prompt_tokens.max(1) as f64;
    let block = (ATTENTION_QUERY_BLOCK as f64).min(p);
    let prefill = p * m.inference_bytes_per_token(c)
        + nh * block * p * 4.0 * ATTENTION_BLOCK_COPIES
        + v * (c + 4.0);
    decode.max(prefill)
}

fn always_parts(i: &MemoryPlanInput) -> Vec<Part> {
    let p = i.model.parameters() as f64;
    let (weights, moments) = (
        i.share(Sharding::shards_parameters),
        i.share(Sharding::shards_optimizer),
    );
    let own = |label: &str, share: f64| {
        if share < 1.0 {
            format!("{label}, own 1/N")
        } else {
            label.to_string()
        }
    };
    let mut parts = vec![
        part(
            "weights_f32",
            own("weights (f32 master)", weights),
            Phase::Always,
            4.0 * p * weights,
        ),
        part(
            "adamw_moments",
            own("AdamW moments (f32, 2 per weight)", moments),
            Phase::Always,
            8.0 * p * moments,
        ),
    ];
    if i.keep_reference {
        parts.push(part(
            "reference_weights",
            "reference model (f32, kl_beta > 0)",
            Phase::Always,
            4.0 * p,
        ));
    }
    parts.push(part(
        "runtime_reserve",
        "runtime reserve (CUDA context, kernels, slack)",
        Phase::Always,
        RUNTIME_RESERVE_BYTES,
    ));
    parts
}

/// The weights the engine samples with beside the master weights: a bf16 copy under
/// `bf16-mixed`; with `sharding = "full"` the whole weights gathered for the rollout phase and
/// released after (in the compute dtype).
fn rollout_weights(i: &MemoryPlanInput) -> f64 {
    let p = i.model.parameters() as f64;
    if i.share(Sharding::shards_parameters) < 1.0 {
        p * i.compute_bytes()
    } else if i.precision == Precision::Bf16Mixed {
        2.0 * p
    } else {
        0.0
    }
}

/// The engine's KV pool: `kv_cache_gb` when set, else [`AUTO_KV_SHARE`] of what the rollout
/// leaves free, capped at every row of a call at full length plus its prompts; whole blocks.
fn kv_pool_bytes(i: &MemoryPlanInput) -> f64 {
    if !i.rollout_in_process {
        return 0.0;
    }
    let block = i.kv_block_bytes();
    let bytes = match i.kv_cache_gb {
        Some(gb) => gb * GB,
        None => {
            let always: f64 = always_parts(i).iter().map(|p| p.bytes).sum();
            let room = (i.gpu_bytes() - always - rollout_weights(i) - rollout_transient(i))
                .max(0.0)
                * AUTO_KV_SHARE;
            let prompts = i.rollout_prompts_per_call.min(i.prompts_per_step).max(1);
            let need = (i.rollout_rows() * i.full_row_blocks()
                + prompts * i.max_prompt_tokens.div_ceil(i.kv_block_size.max(1)))
                as f64
                * block;
            room.min(need)
        }
    };
    (bytes / block).floor() * block
}

fn rollout_parts(i: &MemoryPlanInput) -> Vec<Part> {
    let mut parts = Vec::new();
    if !i.rollout_in_process {
        return parts;
    }
    if i.share(Sharding::shards_parameters) < 1.0 {
        parts.push(part(
            "rollout_weights_gathered",
            "rollout weights (gathered whole, released after)",
            Phase::Rollout,
            rollout_weights(i),
        ));
    } else if i.precision == Precision::Bf16Mixed {
        parts.push(part(
            "rollout_weights_bf16",
            "rollout weights (bf16 copy)",
            Phase::Rollout,
            rollout_weights(i),
        ));
    }
    let pool = kv_pool_bytes(i);
    let blocks = (pool / i.kv_block_bytes()).round() as usize;
    let c = i.precision.compute_bytes();
    parts.push(part(
        "kv_cache",
        format!(
            "rollout KV pool ({blocks} blocks x {}, {})",
            i.kv_block_size,
            if c == 2 { "bf16" } else { "f32" }
        ),
        Phase::Rollout,
        pool,
    ));
    parts.push(part(
        "rollout_transient",
        format!(
            "rollout transient ({} rows decoding, or a prefill)",
            i.decode_rows()
        ),
        Phase::Rollout,
        rollout_transient(i),
    ));
    parts
}

fn sum(parts: &[Part], phase: Phase) -> f64 {
    parts
        .iter()
        .filter(|p| p.phase == phase)
        .map(|p| p.bytes)
        .sum()
}

fn training_peak_of(i: &MemoryPlanInput) -> f64 {
    let parts: Vec<Part> = always_parts(i)
        .into_iter()
        .chain(training_parts(i))
        .collect();
    training_peak_of_parts(&parts)
}

/// A `full` group's export: the whole policy assembled on the first rank's device, in the
/// export's dtype.
fn checkpoint_parts(i: &MemoryPlanInput) -> Vec<Part> {
    if i.share(Sharding::shards_parameters) == 1.0 {
        return Vec::new();
    }
    vec![part(
        "export_weights_assembled",
        "export weights (assembled whole on the first rank, save dtype)",
        Phase::Checkpoint,
        i.model.parameters() as f64 * i.export_bytes_per_weight,
    )]
}

fn rollout_peak_of(i: &MemoryPlanInput) -> f64 {
    let parts: Vec<Part> = always_parts(i)
        .into_iter()
        .chain(rollout_parts(i))
        .collect();
    sum(&parts, Phase::Always) + sum(&parts, Phase::Rollout)
}

/// The largest micro-batch budget, in [`MICRO_BATCH_STEP`]s, whose training peak fits `gpu`
/// (0 when none does), as the largest budget that holds as many rows as the largest fitting one.
///
/// The peak grows with the rows a budget holds, but for one drop: once a micro-batch is a whole
/// optimizer step's rows (`k1` below; at the latest the whole step, `whole_step`), nothing is
/// summed across micro-batches and the running sum of gradients goes. So the budgets split into
/// two ranges, each bisected (a scan of every row count took minutes for a `group_size` near
/// 2^63); the range above the drop is tried first.
fn largest_fitting_budget(input: &MemoryPlanInput, gpu: f64, whole_step: usize) -> usize {
    let at = |k: usize| MemoryPlanInput {
        micro_batch_tokens: k * MICRO_BATCH_STEP,
        ..input.clone()
    };
    let fits = |k: usize| training_peak_of(&at(k)) <= gpu;
    if fits(whole_step) {
        return whole_step;
    }
    // The first budget whose micro-batch is a whole optimizer step (`whole_step` at the latest).
    let k1 = first_true(1, whole_step, |k| {
        at(k).micro_batches_per_optimizer_step() == 1
    });
    let widest = |lo: usize, hi: usize| {
        // The largest fitting budget in [lo, hi), `lo` fitting; then the widest with its rows.
        let k = first_true(lo + 1, hi, |k| !fits(k)) - 1;
        let rows = at(k).micro_batch_rows();
        ((rows + 1) * input.sequence_tokens().max(1) - 1) / MICRO_BATCH_STEP
    };
    if k1 < whole_step && fits(k1) {
        return widest(k1, whole_step);
    }
    if k1 > 1 && fits(1) {
        return widest(1, k1);
    }
    0
}

/// The first `k` in `[lo, hi)` where `pred` holds, `pred` false then true over the range; `hi`
/// when it holds nowhere.
fn first_true(lo: usize, hi: usize, pred: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (lo, hi);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

impl MemoryPlan {
    /// Computes the plan.
    pub fn new(input: MemoryPlanInput) -> Self {
        let gpu = input.gpu_bytes();
        let rows = input.rollout_rows();
        let parts: Vec<Part> = always_parts(&input)
            .into_iter()
            .chain(training_parts(&input))
            .chain(rollout_parts(&input))
            .chain(checkpoint_parts(&input))
            .collect();
        let training_peak = training_peak_of(&input);
        let rollout_peak = rollout_peak_of(&input);
        let checkpoint_peak = sum(&parts, Phase::Always) + sum(&parts, Phase::Checkpoint);
        let kv_pool_blocks = (kv_pool_bytes(&input) / input.kv_block_bytes()).round() as usize;
        let s = input.sequence_tokens().max(1);
        let step_rows = input.step_rows().max(1);
        let whole_step = step_rows.saturating_mul(s).div_ceil(MICRO_BATCH_STEP);
        let max_micro_batch_tokens =
            MICRO_BATCH_STEP * largest_fitting_budget(&input, gpu, whole_step);
        let max_rollout_rows = kv_pool_blocks / input.full_row_blocks();
        Self {
            parameters: input.model.parameters(),
            micro_batch_rows: input.micro_batch_rows(),
            micro_batch_tokens_used: input.micro_batch_rows() * input.sequence_tokens(),
            rollout_rows: rows,
            kv_pool_blocks,
            parts,
            training_peak,
            rollout_peak,
            checkpoint_peak,
            peak: training_peak.max(rollout_peak).max(checkpoint_peak),
            max_micro_batch_tokens,
            max_rollout_rows,
            input,
        }
    }

    /// Whether the training step fits the device.
    pub fn training_fits(&self) -> bool {
        self.training_peak <= self.input.gpu_bytes()
    }

    /// Whether the rollout fits the device: its peak does, and the KV pool holds at least one
    /// full-length row (always, when servers generate the rollouts).
    pub fn rollout_fits(&self) -> bool {
        !self.input.rollout_in_process
            || (self.rollout_peak <= self.input.gpu_bytes() && self.max_rollout_rows >= 1)
    }

    /// The engine's KV pool in bytes (whole blocks): `kv_cache_gb` when set, else
    /// [`AUTO_KV_SHARE`] of the memory the rollout leaves free, capped at every row of a call at
    /// full length. `conrub train` gives the engine this pool on devices with a known size.
    pub fn kv_pool_bytes(&self) -> f64 {
        self.kv_pool_blocks as f64 * self.input.kv_block_bytes()
    }

    /// Whether the whole run fits the device.
    pub fn fits(&self) -> bool {
        self.peak <= self.input.gpu_bytes()
    }

    /// Largest `rollout_prompts_per_call` whose rollout fits (0 when not even one prompt's group).
    pub fn max_rollout_prompts_per_call(&self) -> usize {
        self.max_rollout_rows / self.input.group_size.max(1)
    }

    /// `Ok` when the plan fits `gpu_bytes` of device memory (recomputed for that size when it
    /// differs from the input's); otherwise the table and the settings that would fit. For
    /// `conrub train` to call before the first step.
    pub fn check(&self, gpu_bytes: u64) -> Result<(), DoesNotFit> {
        let gb = gpu_bytes as f64 / GB;
        let plan = if (gb - self.input.gpu_memory_gb).abs() > 1e-9 {
            MemoryPlan::new(MemoryPlanInput {
                gpu_memory_gb: gb,
                ..self.input.clone()
            })
        } else {
            self.clone()
        };
        if plan.fits() {
            return Ok(());
        }
        let mut msg = format!(
            "the memory plan predicts a peak of {:.1} GB on a {:.1} GB device:\n{}",
            plan.peak / GB,
            gb,
            plan.table()
        );
        msg.push_str(&plan.advice());
        Err(DoesNotFit(msg))
    }

    /// The plan of the same run under each sharding mode, `none` first (one rank: only
    /// `none`).
    pub fn by_sharding(&self) -> Vec<(Sharding, MemoryPlan)> {
        let modes: &[Sharding] = if self.input.ranks > 1 {
            &Sharding::ALL
        } else {
            &[Sharding::None]
        };
        modes
            .iter()
            .map(|&sharding| {
                let plan = if sharding == self.input.sharding {
                    self.clone()
                } else {
                    MemoryPlan::new(MemoryPlanInput {
                        sharding,
                        ..self.input.clone()
                    })
                };
                (sharding, plan)
            })
            .collect()
    }

    /// The first sharding mode past the configured one whose plan fits, when this one does not.
    pub fn sharding_that_fits(&self) -> Option<(Sharding, MemoryPlan)> {
        if self.fits() || self.input.ranks < 2 {
            return None;
        }
        let at = Sharding::ALL
            .iter()
            .position(|&m| m == self.input.sharding)
            .unwrap_or(0);
        self.by_sharding()
            .into_iter()
            .skip(at + 1)
            .find(|(_, p)| p.fits())
    }

    /// What to change so that the run fits (empty when it fits).
    pub fn advice(&self) -> String {
        let mut out = String::new();
        if let Some((mode, plan)) = self.sharding_that_fits() {
            let _ = writeln!(
                out,
                "set sharding = \"{}\" (now \"{}\"): its peak is {:.1} GB per rank",
                mode.name(),
                self.input.sharding.name(),
                plan.peak / GB
            );
        }
        if !self.training_fits() {
            if self.max_micro_batch_tokens > 0 {
                let _ = writeln!(
                    out,
                    "set learner.micro_batch_tokens <= {} (now {})",
                    self.max_micro_batch_tokens, self.input.micro_batch_tokens
                );
            } else {
                let mut options = Vec::new();
                if self.input.precision == Precision::F32 {
                    options.push("precision = \"bf16-mixed\"");
                }
                if !self.input.activation_checkpointing {
                    options.push("learner.activation_checkpointing = true");
                }
                options.extend([
                    "shorter sequences (learner.max_response_tokens)",
                    "a larger device",
                ]);
                let _ = writeln!(
                    out,
                    "not even one full-length row ({} tokens) fits a training micro-batch: use {}",
                    self.input.sequence_tokens(),
                    options.join(", ")
                );
            }
        }
        if !self.rollout_fits() {
            let row = self.input.full_row_blocks() as f64 * self.input.kv_block_bytes();
            let room = self.input.gpu_bytes() - (self.rollout_peak - self.kv_pool_bytes());
            if self.input.kv_cache_gb.is_some() && room >= row {
                let _ = writeln!(out, "set rollout.kv_cache_gb <= {:.2} (now {:.2}; the rest of the rollout takes {:.2} GB)", room / GB, self.kv_pool_bytes() / GB, (self.rollout_peak - self.kv_pool_bytes()) / GB);
            } else {
                let _ = writeln!(
                    out,
                    "the rollout KV pool cannot hold one full-length row ({} tokens, {:.2} GB) in a rollout call: use shorter sequences, fewer rows decoded at once (rollout.max_rows, now {}), or a larger device",
                    self.input.sequence_tokens(),
                    row / GB,
                    self.input.rollout_max_rows
                );
            }
        }
        out
    }

    /// The human-readable table: parts in GB with their phase, the peaks, the fit, and the
    /// largest micro-batch and rollout call.
    pub fn table(&self) -> String {
        let gb = |b: f64| format!("{:>9.2}", b / GB);
        let mut out = String::new();
        let _ = writeln!(out, "{:<52} {:<15} {:>9}", "part", "phase", "GB");
        for p in &self.parts {
            let _ = writeln!(
                out,
                "{:<52} {:<15} {}",
                p.label,
                p.phase.as_str(),
                gb(p.bytes)
            );
        }
        let _ = writeln!(
            out,
            "{:<52} {:<15} {}",
            "training peak",
            "always+training",
            gb(self.training_peak)
        );
        let _ = writeln!(
            out,
            "{:<52} {:<15} {}",
            "rollout peak",
            "always+rollout",
            gb(self.rollout_peak)
        );
        if self.parts.iter().any(|p| p.phase == Phase::Checkpoint) {
            let _ = writeln!(
                out,
                "{:<52} {:<15} {}",
                "checkpoint peak",
                "always+checkpoint",
                gb(self.checkpoint_peak)
            );
        }
        let _ = writeln!(out, "{:<52} {:<15} {}", "peak", "", gb(self.peak));
        let _ = writeln!(
            out,
            "{:<52} {:<15} {}",
            "GPU memory",
            "",
            gb(self.input.gpu_bytes())
        );
        let verdict = match (self.training_fits(), self.rollout_fits()) {
            (true, true) => "yes".to_string(),
            (false, true) => "no (training)".to_string(),
            (true, false) => "no (rollout)".to_string(),
            (false, false) => "no (training and rollout)".to_string(),
        };
        let _ = writeln!(out, "{:<52} {:<15} {:>9}", "fits", "", verdict);
        let _ = writeln!(
            out,
            "{:<52} {:<15} {:>9}",
            "max_micro_batch_tokens", "", self.max_micro_batch_tokens
        );
        let _ = writeln!(
            out,
            "{:<52} {:<15} {:>9}",
            "max_rollout_rows (full-length rows in the KV pool)".to_string(),
            "",
            self.max_rollout_rows
        );
        if self.input.ranks > 1 {
            let _ = writeln!(out, "per rank of {}, by sharding mode:", self.input.ranks);
            for (mode, p) in self.by_sharding() {
                let now = if mode == self.input.sharding {
                    " (this run)"
                } else {
                    ""
                };
                let fits = if p.fits() { "fits" } else { "does not fit" };
                let _ = writeln!(
                    out,
                    "  sharding = {:<12} peak {:>8.2} GB  {fits}{now}",
                    format!("\"{}\"", mode.name()),
                    p.peak / GB,
                );
            }
        }
        out
    }

    /// One JSON object: `fits`, the peaks and `parts` in GB, the maxima, and the inputs.
    pub fn to_json(&self) -> serde_json::Value {
        let gb = |b: f64| (b / GB * 1000.0).round() / 1000.0;
        let parts: serde_json::Map<String, serde_json::Value> = self
            .parts
            .iter()
            .map(|p| (p.name.to_string(), gb(p.bytes).into()))
            .collect();
        let phases: serde_json::Map<String, serde_json::Value> = self
            .parts
            .iter()
            .map(|p| (p.name.to_string(), p.phase.as_str().into()))
            .collect();
        let modes: serde_json::Map<String, serde_json::Value> = self
            .by_sharding()
            .into_iter()
            .map(|(mode, p)| {
                let v = serde_json::json!({
                    "fits": p.fits(),
                    "peak_gb": gb(p.peak),
                    "training_peak_gb": gb(p.training_peak),
                    "rollout_peak_gb": gb(p.rollout_peak),
                    "max_micro_batch_tokens": p.max_micro_batch_tokens,
                });
                (mode.name().to_string(), v)
            })
            .collect();
        serde_json::json!({
            "sharding": self.input.sharding.name(),
            "ranks": self.input.ranks,
            "by_sharding": modes,
            "sharding_that_fits": self.sharding_that_fits().map(|(m, _)| m.name()),
            "fits": self.fits(),
            "training_fits": self.training_fits(),
            "rollout_fits": self.rollout_fits(),
            "peak_gb": gb(self.peak),
            "training_peak_gb": gb(self.training_peak),
            "rollout_peak_gb": gb(self.rollout_peak),
            "checkpoint_peak_gb": gb(self.checkpoint_peak),
            "gpu_memory_gb": self.input.gpu_memory_gb,
            "parts": parts,
            "part_phases": phases,
            "max_micro_batch_tokens": self.max_micro_batch_tokens,
            "max_rollout_rows": self.max_rollout_rows,
            "max_rollout_prompts_per_call": self.max_rollout_prompts_per_call(),
            "parameters": self.parameters,
            "micro_batch_rows": self.micro_batch_rows,
            "micro_batch_tokens_used": self.micro_batch_tokens_used,
            "rollout_rows": self.rollout_rows,
            "sequence_tokens": self.input.sequence_tokens(),
            "kv_pool_blocks": self.kv_pool_blocks,
            "kv_pool_gb": gb(self.kv_pool_bytes()),
            "kv_block_size": self.input.kv_block_size,
            "inputs": &self.input,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memory plan's defaults are the learner's and the loop's own.
    #[test]
    fn the_memory_plan_defaults_are_the_run_defaults() {
        let shape = conrub_models::ModelConfig::tiny(64).shape();
        let plan = MemoryPlanInput::new(shape);
        let (l, r) = (
            conrub_contracts::LearnerConfig::default(),
            conrub_contracts::RunConfig::default(),
        );
        assert_eq!(
            plan.activation_checkpointing,
            l.system.activation_checkpointing
        );
        assert_eq!(plan.micro_batch_tokens, l.system.micro_batch_tokens);
        assert_eq!(plan.group_size, l.group_size);
        assert_eq!(plan.prompts_per_step, r.prompts_per_step);
        assert_eq!(plan.mini_batches, l.mini_batches);
        assert_eq!(
            plan.rollout_prompts_per_call,
            l.system.rollout_prompts_per_call
        );
        assert_eq!(plan.max_response_tokens, l.max_response_tokens);
        assert_eq!(plan.keep_reference, l.objective.kl_beta != 0.0);
        assert_eq!(plan.kv_block_size, conrub_rollout::DEFAULT_BLOCK_SIZE);
        assert_eq!(plan.rollout_max_rows, conrub_rollout::DEFAULT_MAX_ROWS);
        assert_eq!(plan.bucket_bytes, l.system.allreduce_bucket_bytes() as f64);
    }

    /// The 4B shape (hidden 2,560, 36 layers, 32 query and 8 KV heads of 128, tied, the
    /// 151,936-token vocabulary) under the published run's settings; `tests/e2e/plan.rs` checks the
    /// released shapes by name.
    fn published(precision: Precision, checkpointing: bool, micro: usize) -> MemoryPlanInput {
        let shape = ModelShape {
            vocab_size: 151_936,
            hidden_size: 2560,
            intermediate_size: 9728,
            num_hidden_layers: 36,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            tie_word_embeddings: true,
            qk_norm: true,
            qkv_bias: false,
            o_bias: false,
        };
        MemoryPlanInput {
            precision,
            activation_checkpointing: checkpointing,
            micro_batch_tokens: micro,
            ..MemoryPlanInput::new(shape)
        }
    }

    #[test]
    fn the_kv_pool_follows_the_engine_budget_rule() {
        let input = published(Precision::Bf16Mixed, true, 65536);
        // The 4B shape in bf16: 36 layers x 8 KV heads x 128 x 2 x 2 bytes = 144 KiB per position.
        assert_eq!(input.model.kv_bytes_per_position(2.0), 147_456.0);
        assert_eq!(input.kv_block_bytes(), 16.0 * 147_456.0);
        assert_eq!(input.full_row_blocks(), 576);
        let plan = MemoryPlan::new(input.clone());
        // What the rollout leaves free, 90% of it, in whole blocks.
        let always: f64 = always_parts(&input).iter().map(|p| p.bytes).sum();
        let room =
            (input.gpu_bytes() - always - rollout_weights(&input) - rollout_transient(&input))
                * AUTO_KV_SHARE;
        assert!(
            plan.kv_pool_bytes() <= room && plan.kv_pool_bytes() > room - input.kv_block_bytes()
        );
        assert_eq!(plan.max_rollout_rows, plan.kv_pool_blocks / 576);
        assert!(
            plan.rollout_fits() && plan.rollout_peak <= input.gpu_bytes(),
            "{}",
            plan.table()
        );
        // A set budget is taken as it is (whole blocks), and one that leaves no room is refused
        // with the largest that fits.
        let set = MemoryPlan::new(MemoryPlanInput {
            kv_cache_gb: Some(10.0),
            ..input.clone()
        });
        assert_eq!(set.kv_pool_blocks, (10e9 / input.kv_block_bytes()) as usize);
        let huge = MemoryPlan::new(MemoryPlanInput {
            kv_cache_gb: Some(200.0),
            ..input.clone()
        });
        assert!(!huge.rollout_fits());
        assert!(
            huge.advice().contains("set rollout.kv_cache_gb <="),
            "{}",
            huge.advice()
        );
        // A small call needs no more than its rows at full length.
        let small = MemoryPlan::new(MemoryPlanInput {
            rollout_prompts_per_call: 1,
            group_size: 2,
            ..input
        });
        assert_eq!(small.kv_pool_blocks, 2 * 576 + 64);
    }

    #[test]
    fn maxima_are_the_boundaries() {
        let input = published(Precision::Bf16Mixed, true, 16384);
        let plan = MemoryPlan::new(input.clone());
        let gpu = input.gpu_bytes();
        let at = |tokens: usize| {
            training_peak_of(&MemoryPlanInput {
                micro_batch_tokens: tokens,
                ..input.clone()
            })
        };
        assert!(at(plan.max_micro_batch_tokens) <= gpu);
        assert!(at(plan.max_micro_batch_tokens + MICRO_BATCH_STEP) > gpu);
        assert!(plan.max_rollout_rows * input.full_row_blocks() <= plan.kv_pool_blocks);
        assert!((plan.max_rollout_rows + 1) * input.full_row_blocks() > plan.kv_pool_blocks);
        assert!(rollout_peak_of(&input) <= gpu);
        let fitting = MemoryPlan::new(MemoryPlanInput {
            micro_batch_tokens: plan.max_micro_batch_tokens,
            rollout_prompts_per_call: plan.max_rollout_prompts_per_call(),
            ..input
        });
        assert!(fitting.fits(), "{}", fitting.table());
        assert!(fitting.check(141_000_000_000).is_ok());
        assert!(fitting.advice().is_empty());
    }
}
