//! [`SglangEngine`]: the learner's [`RolloutEngine`] on one or more SGLang servers.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use conrub_base::{retry, Attempt, Backoff};
use conrub_contracts::{Policy, RolloutBatch, RolloutEngine, RolloutRequest, WeightSync};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::error::{RemoteError, Result};
use crate::protocol::{generate_body, parse_group, Expect};

/// The longest wait between two attempts of one request, in seconds.
const MAX_BACKOFF_SECS: f64 = 30.0;

/// Settings of the SGLang engine (`[rollout]` with `engine = "sglang"`).
#[derive(Debug, Clone, PartialEq)]
pub struct SglangConfig {
    /// Base URLs of the servers (`http://host:30000`); group `g` of a step goes to server
    /// `g % urls.len()`.
    pub urls: Vec<String>,
    /// Seconds one HTTP call may take.
    pub timeout_secs: f64,
    /// Retries after a failed attempt (refused, timed out, 5xx, 429), with doubling backoff.
    pub max_retries: u32,
    /// Seconds before the first retry (doubling, at most 30).
    pub backoff_secs: f64,
    /// `/generate` calls in flight at once, over all servers.
    pub concurrency: usize,
    /// The servers share the learner's GPUs: they release their memory before each update
    /// stage and resume it before the weight update (SGLang's `--enable-memory-saver`).
    pub colocate: bool,
    /// The policy's vocabulary size (returned ids are checked against it).
    pub vocab_size: usize,
    /// Where the weights for the servers are written (`step-NNNNNN/`, the last two kept). The
    /// servers must see this path (same machine, or a shared file system).
    pub weights_dir: PathBuf,
}

impl SglangConfig {
    fn check(&self) -> Result<()> {
        let bad = |key: &str, message: &str| {
            Err(RemoteError::Config {
                key: key.into(),
                message: message.into(),
            })
        };
        if self.urls.is_empty() {
            return bad("urls", "an sglang engine needs at least one server URL");
        }
        if let Some(u) = self.urls.iter().find(|u| !u.starts_with("http")) {
            return bad(
                "urls",
                &format!("{:?} is not an http(s) URL", conrub_base::shown_url(u)),
            );
        }
        if !(self.timeout_secs > 0.0) || self.concurrency == 0 {
            return bad(
                "timeout_secs",
                "timeout_secs and concurrency must be positive",
            );
        }
        Ok(())
    }
}

/// Writes `policy` as a Hugging Face directory (the servers' `model_path`) into the given
/// directory and returns the bytes written.
pub type WeightWriter<P> = Arc<
    dyn Fn(&P, &Path) -> std::result::Result<u64, Box<dyn std::error::Error + Send + Sync>>
        + Send
        + Sync,
>;

/// Rollouts on SGLang servers (see the crate docs). Cheap to clone: clones share the servers'
/// state, so data-parallel ranks can share one engine (it syncs and releases once for all).
pub struct SglangEngine<P> {
    inner: Arc<Inner<P>>,
}

impl<P> Clone for SglangEngine<P> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<P> {
    cfg: SglangConfig,
    http: reqwest::Client,
    /// The process's runtime (the caller's), where the HTTP calls run.
    runtime: tokio::runtime::Handle,
    writer: WeightWriter<P>,
    state: Mutex<SyncState>,
}

#[derive(Default)]
struct SyncState {
    /// Learner steps behind the weights every server holds (`None`: not known).
    version: Option<u64>,
    /// The servers' memory is released (colocation) until the next sync.
    released: bool,
    /// Weight directories written, oldest first.
    kept: VecDeque<PathBuf>,
}

/// The version string sent with a weight update and expected in replies.
fn version_name(version: u64) -> String {
    format!("step-{version:06}")
}

impl<P> SglangEngine<P> {
    /// An engine on `cfg.urls`, writing weights with `writer`, its HTTP calls on `runtime`: the
    /// process's multi-threaded runtime (the trainer's), which must outlive the engine. A call
    /// blocks its thread until the runtime's workers finish it, so call it from the learner (a
    /// plain thread or `Runtime::block_on`), never from a task on one of those workers. Nothing
    /// is sent yet.
    pub fn new(
        cfg: SglangConfig,
        writer: WeightWriter<P>,
        runtime: tokio::runtime::Handle,
    ) -> Result<Self> {
        cfg.check()?;
        // Calls block a plain thread on the handle while the caller waits: a current-thread
        // runtime would have no worker left to drive them.
        if runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread {
            return Err(RemoteError::Config {
                key: "engine".into(),
                message: "needs a multi-threaded tokio runtime (this one is current-thread)".into(),
            });
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs_f64(cfg.timeout_secs))
            .build()
            .map_err(|e| RemoteError::Config {
                key: "engine".into(),
                message: format!("no HTTP client: {e}"),
            })?;
        Ok(Self {
            inner: Arc::new(Inner {
                cfg,
                http,
                runtime,
                writer,
                state: Mutex::new(SyncState::default()),
            }),
        })
    }

    /// The settings.
    pub fn config(&self) -> &SglangConfig {
        &self.inner.cfg
    }

    /// Runs `f` on the runtime from a plain thread, so the caller may itself be inside it (the
    /// learner's step is).
    fn block<T: Send>(&self, f: impl std::future::Future<Output = T> + Send) -> T {
        let rt = &self.inner.runtime;
        std::thread::scope(|s| {
            s.spawn(|| rt.block_on(f))
                .join()
                .expect("the HTTP thread does not panic")
        })
    }

    /// POSTs `body` to `url + path`, retrying transport errors, timeouts, 429 and 5xx with
    /// backoff; the JSON reply of a 2xx, else an error naming the URL.
    async fn post(&self, url: &str, path: &str, body: &Value) -> Result<(u16, Value)> {
        let cfg = &self.inner.cfg;
        let endpoint = conrub_base::endpoint(url, path);
        let backoff = Backoff::exponential(cfg.backoff_secs, MAX_BACKOFF_SECS, cfg.max_retries);
        let outcome = retry(&backoff, tokio::time::sleep, |_| async {
            let why = match self.inner.http.post(&endpoint).json(body).send().await {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let retry = status == 429 || status >= 500;
                    match r.text().await {
                        Ok(text) if !retry => return Attempt::Done((status, text)),
                        Ok(text) => format!("{path}: HTTP {status}: {}", clip(&text)),
                        Err(e) => format!("{path}: reading the reply: {e}"),
                    }
                }
                Err(e) if e.is_timeout() => {
                    format!("{path}: no reply within {} s", cfg.timeout_secs)
                }
                Err(e) => format!("{path}: {e}"),
            };
            Attempt::Retry(why, None)
        })
        .await;
        let (status, text) = match outcome {
            Ok((reply, _)) => reply,
            Err(g) => {
                return Err(RemoteError::Server {
                    url: url.to_string(),
                    message: format!("{} (after {} attempts)", g.error, g.attempts),
                })
            }
        };
        if text.trim().is_empty() {
            return Ok((status, Value::Null));
        }
        let v = serde_json::from_str(&text).map_err(|e| RemoteError::Reply {
            url: url.to_string(),
            field: format!("{path} (body)"),
            message: format!("not JSON ({e}): {}", clip(&text)),
        })?;
        Ok((status, v))
    }

    /// POSTs to every server; an error status or `success: false` is a failure naming it.
    async fn post_all(&self, path: &str, body: &Value, dir: Option<&Path>) -> Result<()> {
        let calls = self.inner.cfg.urls.iter().map(|url| async move {
            let (status, reply) = self.post(url, path, body).await?;
            let ok = (200..300).contains(&status)
                && reply.get("success").and_then(Value::as_bool) != Some(false);
            if ok {
                return Ok(());
            }
            let message = reply
                .get("message")
                .cloned()
                .unwrap_or_else(|| reply.clone());
            let message = format!("HTTP {status}: {message}");
            Err(match dir {
                Some(path) => RemoteError::WeightUpdate {
                    url: url.clone(),
                    path: path.to_path_buf(),
                    message,
                },
                None => RemoteError::Server {
                    url: url.clone(),
                    message: format!("{path}: {message}"),
                },
            })
        });
        futures::future::try_join_all(calls).await.map(|_| ())
    }

    /// Writes `policy` for `version`, tells every server to load it, and keeps two versions.
    fn write_and_load(&self, policy: &P, version: u64, state: &mut SyncState) -> Result<u64> {
        let root = &self.inner.cfg.weights_dir;
        let dir = root.join(version_name(version));
        let tmp = dir.with_extension("tmp");
        let write = |e: String| RemoteError::Write {
            path: dir.clone(),
            message: e,
        };
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| write(e.to_string()))?;
        let bytes = (self.inner.writer)(policy, &tmp).map_err(|e| write(e.to_string()))?;
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| write(e.to_string()))?;
        }
        std::fs::rename(&tmp, &dir).map_err(|e| write(e.to_string()))?;
        let model_path = std::path::absolute(&dir).map_err(|e| write(e.to_string()))?;
        if state.released {
            self.block(self.post_all("/resume_memory_occupation", &json!({}), None))?;
            state.released = false;
        }
        let body = json!({
            "model_path": model_path,
            "weight_version": version_name(version),
            "abort_all_requests": false,
        });
        // Until every server confirms, no version is known: a retry syncs again.
        state.version = None;
        self.block(self.post_all("/update_weights_from_disk", &body, Some(&model_path)))?;
        state.version = Some(version);
        state.kept.retain(|d| d != &dir);
        state.kept.push_back(dir);
        while state.kept.len() > 2 {
            if let Some(old) = state.kept.pop_front() {
                let _ = std::fs::remove_dir_all(old);
            }
        }
        Ok(bytes)
    }
}

/// The first 300 characters of a body, for messages.
fn clip(text: &str) -> String {
    let t: String = text.chars().take(300).collect();
    if t.len() < text.len() {
        format!("{t}...")
    } else {
        t
    }
}

impl<B: Backend, P: Policy<B>> RolloutEngine<B, P> for SglangEngine<P> {
    fn rollout(
        &self,
        _policy: &P,
        request: &RolloutRequest<'_>,
        _device: &B::Device,
    ) -> conrub_contracts::Result<RolloutBatch> {
        let cfg = &self.inner.cfg;
        let version = self.inner.state.lock().expect("state lock").version;
        let want = version.map(version_name);
        let gate = Semaphore::new(cfg.concurrency);
        let k = request.group_size;
        let calls = request.prompts.iter().enumerate().map(|(i, prompt)| {
            let url = &cfg.urls[(request.first_group + i) % cfg.urls.len()];
            let (gate, want) = (&gate, want.as_deref());
            async move {
                let _permit = gate.acquire().await.expect("the semaphore stays open");
                let body = generate_body(prompt, k, request.sampling);
                let (status, reply) = self.post(url, "/generate", &body).await?;
                if !(200..300).contains(&status) {
                    return Err(RemoteError::Server {
                        url: url.clone(),
                        message: format!("/generate: HTTP {status}: {}", clip(&reply.to_string())),
                    });
                }
                let expect = Expect {
                    url,
                    n: k,
                    vocab_size: cfg.vocab_size,
                    sampling: request.sampling,
                    weight_version: want,
                };
                parse_group(&reply, &expect)
            }
        });
        let groups = self.block(futures::future::try_join_all(calls))?;
        let mut batch = RolloutBatch::new(k, request.prompts.to_vec());
        for g in groups.into_iter().flatten() {
            batch.telemetry.generated_tokens += g.tokens.len();
            batch.push(g);
        }
        batch.telemetry.sequences = batch.rows();
        batch.telemetry.distinct_prompts = request.prompts.len();
        Ok(batch)
    }

    fn sync_weights(&self, policy: &P, version: u64) -> conrub_contracts::Result<WeightSync> {
        let mut state = self.inner.state.lock().expect("state lock");
        if state.version == Some(version) {
            return Ok(WeightSync::default());
        }
        let t0 = Instant::now();
        let bytes = self.write_and_load(policy, version, &mut state)?;
        Ok(WeightSync {
            secs: t0.elapsed().as_secs_f64(),
            bytes,
        })
    }

    fn release(&self) -> conrub_contracts::Result<()> {
        if !self.inner.cfg.colocate {
            return Ok(());
        }
        let mut state = self.inner.state.lock().expect("state lock");
        if !state.released {
            self.block(self.post_all("/release_memory_occupation", &json!({}), None))?;
            state.released = true;
        }
        Ok(())
    }
}
