//! What a rollout engine reports about a call.

use serde::{Deserialize, Serialize};

/// What one call of the engine did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RolloutStats {
    /// Sequences generated.
    pub sequences: usize,
    /// Distinct prompts among them.
    pub distinct_prompts: usize,
    /// Prompt prefills run (once per distinct prompt unless its cached blocks were given up under
    /// memory pressure).
    pub prompt_prefills: usize,
    /// Prompt tokens that went through a prefill pass.
    pub prefill_tokens: usize,
    /// Cached positions of preempted sequences moved to host memory (and back).
    pub swapped_tokens: usize,
    /// Decode steps.
    pub decode_steps: usize,
    /// Tokens sampled.
    pub generated_tokens: usize,
    /// Times a running sequence gave its blocks back.
    pub preemptions: usize,
    /// Blocks in the pool.
    pub kv_blocks: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Device bytes of the pool.
    pub kv_pool_bytes: u64,
    /// Most blocks in use at once.
    pub peak_kv_blocks: usize,
    /// Most sequences decoded in one step.
    pub peak_running_rows: usize,
    /// Mean sequences per decode step.
    pub mean_running_rows: f64,
    /// Bytes read back to the host by decode steps (token ids and log-probabilities).
    pub host_bytes_read: u64,
    /// Per decode step: `(running rows, KV blocks in use)`.
    pub steps: Vec<(u32, u32)>,
    /// Token positions the forward passes computed: prefills padded to their length bucket
    /// ([`bucket_len`](crate::bucket_len)) and decode steps padded to their row bucket
    /// ([`bucket_rows`](crate::bucket_rows)).
    #[serde(default)]
    pub tokens_computed: usize,
    /// The real tokens among `tokens_computed` (prompt tokens prefilled, rows decoded).
    #[serde(default)]
    pub tokens_needed: usize,
}

impl RolloutStats {
    /// Adds `other` (a later call) into these totals.
    pub fn merge(&mut self, other: &RolloutStats) {
        let steps = self.decode_steps + other.decode_steps;
        self.mean_running_rows = if steps == 0 {
            0.0
        } else {
            (self.mean_running_rows * self.decode_steps as f64
                + other.mean_running_rows * other.decode_steps as f64)
                / steps as f64
        };
        self.sequences += other.sequences;
        self.distinct_prompts += other.distinct_prompts;
        self.prompt_prefills += other.prompt_prefills;
        self.prefill_tokens += other.prefill_tokens;
        self.swapped_tokens += other.swapped_tokens;
        self.decode_steps = steps;
        self.generated_tokens += other.generated_tokens;
        self.preemptions += other.preemptions;
        self.kv_blocks = self.kv_blocks.max(other.kv_blocks);
        self.block_size = other.block_size;
        self.kv_pool_bytes = self.kv_pool_bytes.max(other.kv_pool_bytes);
        self.peak_kv_blocks = self.peak_kv_blocks.max(other.peak_kv_blocks);
        self.peak_running_rows = self.peak_running_rows.max(other.peak_running_rows);
        self.host_bytes_read += other.host_bytes_read;
        self.steps.extend_from_slice(&other.steps);
        self.tokens_computed += other.tokens_computed;
        self.tokens_needed += other.tokens_needed;
    }
}
