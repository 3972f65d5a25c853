//! The `[rollout]` table: which engine generates the rollouts and its settings.

use serde::{Deserialize, Serialize};

use crate::error::{Result, SettingsError};

/// Positions per KV block unless `rollout.block_size` says otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// Sequences decoded at once at most unless `rollout.max_rows` says otherwise.
pub const DEFAULT_MAX_ROWS: usize = 256;

/// Which engine generates the rollouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RolloutEngineKind {
    /// conrub-rollout's paged engine, in process on the policy's own weights.
    #[default]
    Paged,
    /// SGLang servers (`urls`), given the policy's weights after every step.
    Sglang,
}

/// `[rollout]`: the rollout engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutSection {
    /// `paged` (in process, the default) or `sglang`.
    pub engine: RolloutEngineKind,
    /// `sglang`: the servers' base URLs (`http://host:30000`); groups are spread over them.
    pub urls: Vec<String>,
    /// `sglang`: seconds one HTTP call may take (a whole group's generation).
    pub timeout_secs: f64,
    /// `sglang`: retries of a refused or timed-out call, with doubling backoff from 1 s.
    pub max_retries: u32,
    /// `sglang`: `/generate` calls (groups) in flight at once over all servers.
    pub concurrency: usize,
    /// `sglang`: the servers run on the learner's GPUs (`--enable-memory-saver`) and release
    /// their memory during the update stage.
    pub colocate: bool,
    /// KV pool in decimal GB. Unset: on devices with a known size (`cuda`, or `--gpu-memory-gb`)
    /// the memory plan's budget rule (90% of what the rollout leaves free); elsewhere enough for
    /// every row of a call at full length.
    pub kv_cache_gb: Option<f64>,
    /// Positions per KV block.
    pub block_size: usize,
    /// Sequences decoded at once at most.
    pub max_rows: usize,
}

impl Default for RolloutSection {
    fn default() -> Self {
        Self {
            engine: RolloutEngineKind::Paged,
            urls: Vec::new(),
            timeout_secs: 600.0,
            max_retries: 3,
            concurrency: 64,
            colocate: false,
            kv_cache_gb: None,
            block_size: DEFAULT_BLOCK_SIZE,
            max_rows: DEFAULT_MAX_ROWS,
        }
    }
}

impl RolloutSection {
    /// Checks the values; errors name the key.
    pub fn validate(&self) -> Result<()> {
        if let Some(gb) = self.kv_cache_gb {
            if !(gb.is_finite() && gb > 0.0) {
                return Err(SettingsError::key(
                    "rollout.kv_cache_gb",
                    format!("{gb} must be a positive number of GB"),
                ));
            }
        }
        let sglang = self.engine == RolloutEngineKind::Sglang;
        if sglang && self.urls.is_empty() {
            let m = "engine = \"sglang\" needs the servers' URLs";
            return Err(SettingsError::key("rollout.urls", m));
        }
        if !sglang && (!self.urls.is_empty() || self.colocate) {
            let key = if self.colocate { "colocate" } else { "urls" };
            let m = "only for engine = \"sglang\"";
            return Err(SettingsError::key(format!("rollout.{key}"), m));
        }
        if let Some(u) = self.urls.iter().find(|u| !u.starts_with("http")) {
            return Err(SettingsError::key(
                "rollout.urls",
                format!("{u:?} is not an http(s) URL"),
            ));
        }
        if !(self.timeout_secs > 0.0) {
            return Err(SettingsError::key("rollout.timeout_secs", "must be > 0"));
        }
        for (key, v) in [
            ("block_size", self.block_size),
            ("max_rows", self.max_rows),
            ("concurrency", self.concurrency),
        ] {
            if v == 0 {
                return Err(SettingsError::key(
                    format!("rollout.{key}"),
                    "must be at least 1",
                ));
            }
        }
        Ok(())
    }
}
