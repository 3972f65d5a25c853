//! Model calls through the persistent cache. A cached entry holds the parsed answer together with
//! every raw output and the attempt count of the call that produced it, so a rerun from the cache
//! writes exactly the artifacts the first run wrote.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use conrub_judge::{CacheKey, ChatClient, JudgeCache};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A finished call as stored in the cache and written to the raw-output artifact.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallRecord<T> {
    /// The parsed answer.
    pub answer: T,
    /// Raw text of every completion received, in order (rejected ones first).
    pub raw_outputs: Vec<String>,
    /// HTTP attempts made.
    pub attempts: u32,
}

/// The raw side of one call, as written to `raw.jsonl`; with `error` set, a call that ended
/// without a usable answer (not cached: a rerun asks again).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CallLog {
    /// HTTP attempts.
    pub attempts: u32,
    /// Every raw output received.
    pub raw_outputs: Vec<String>,
    /// The final error of a failed call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl CallLog {
    /// The log of a finished call.
    pub fn of<T>(r: &CallRecord<T>) -> Self {
        Self {
            attempts: r.attempts,
            raw_outputs: r.raw_outputs.clone(),
            error: None,
        }
    }

    /// The final error (empty for a finished call).
    pub fn error(&self) -> &str {
        self.error.as_deref().unwrap_or("")
    }
}

/// Counters of one role.
#[derive(Debug, Default)]
pub struct RoleCounters {
    /// Logical calls.
    pub calls: AtomicU64,
    /// Answered from the cache.
    pub cached: AtomicU64,
    /// Ended without an answer.
    pub failed: AtomicU64,
}

/// A model role: its client, cache and counters.
pub struct Role {
    /// `generator-A`, ..., `reviewer`.
    pub name: String,
    /// The endpoint client.
    pub client: Arc<ChatClient>,
    /// Counters.
    pub counters: RoleCounters,
}

impl Role {
    /// A role on a client.
    pub fn new(name: impl Into<String>, client: Arc<ChatClient>) -> Self {
        Self {
            name: name.into(),
            client,
            counters: RoleCounters::default(),
        }
    }

    /// Calls the model (or reads the cache) and parses the answer. The cache key covers the
    /// model, sampling settings, call kind, template version and the full rendered messages.
    pub async fn call<T: Serialize + DeserializeOwned>(
        &self,
        cache: &JudgeCache,
        kind: &str,
        version: &str,
        (system, user): &(String, String),
        parse: impl Fn(&str) -> Result<T, conrub_judge::OutputError>,
    ) -> Result<(CallRecord<T>, bool), CallLog> {
        let cfg = self.client.config();
        let sampling = format!("t={} max_tokens={}", cfg.temperature, cfg.max_tokens);
        let key = CacheKey::of(&[
            "conrub-construct",
            kind,
            &cfg.model,
            &sampling,
            version,
            system,
            user,
        ]);
        self.counters.calls.fetch_add(1, Ordering::Relaxed);
        if let Some((record, _)) = cache.get_parsed::<CallRecord<T>>(&key) {
            self.counters.cached.fetch_add(1, Ordering::Relaxed);
            return Ok((record, true));
        }
        let out = self.client.chat_parsed(system, user, parse).await;
        match out.result {
            Ok(answer) => {
                let record = CallRecord {
                    answer,
                    raw_outputs: out.raw_outputs,
                    attempts: out.attempts,
                };
                let last = record.raw_outputs.last().map_or("", String::as_str);
                cache.put_parsed(&key, &cfg.model, kind, &record, last);
                Ok((record, false))
            }
            Err(error) => {
                self.counters.failed.fetch_add(1, Ordering::Relaxed);
                Err(CallLog {
                    error: Some(error.0),
                    raw_outputs: out.raw_outputs,
                    attempts: out.attempts,
                })
            }
        }
    }
}
