//! An OpenAI-compatible chat-completions client (SGLang, vLLM, OpenAI) with bounded concurrency,
//! per-call timeouts, jittered exponential backoff, and retries on transport errors, 408/429/5xx and
//! unparseable output.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use conrub_base::{retry, Attempt, Backoff};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::error::{JudgeError, Result};

use conrub_settings::judge::{
    default_backoff_base, default_backoff_max, default_concurrency, default_kwargs,
    default_max_tokens, default_retries, default_timeout,
};

/// Client settings (the `[judge]` table of a judge config, minus the judge kind).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientConfig {
    /// Base URLs ending in `/v1`, e.g. `http://judge-0:30000/v1`; calls are spread over them and a
    /// retry goes to the next one.
    pub urls: Vec<String>,
    /// Model name sent with every request.
    pub model: String,
    /// Name of the environment variable that holds the API key (sent as a bearer token). The key
    /// itself never appears in configs or logs.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Concurrent requests in flight (default 16).
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Per-call timeout in seconds (default 120).
    #[serde(default = "default_timeout")]
    pub timeout_secs: f64,
    /// Retries after the first attempt (default 8).
    #[serde(default = "default_retries")]
    pub max_retries: u32,
    /// `max_tokens` per call.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// Sampling temperature (0: deterministic judging).
    #[serde(default)]
    pub temperature: f64,
    /// First backoff ceiling in seconds; doubles per retry, full jitter.
    #[serde(default = "default_backoff_base")]
    pub backoff_base_secs: f64,
    /// Largest backoff in seconds.
    #[serde(default = "default_backoff_max")]
    pub backoff_max_secs: f64,
    /// Sent as `chat_template_kwargs` (SGLang/vLLM); default turns a hybrid-thinking model's thinking off. Set to an
    /// empty table to omit it (e.g. for the OpenAI API).
    #[serde(default = "default_kwargs")]
    pub chat_template_kwargs: Option<Value>,
}

impl ClientConfig {
    /// Settings for one URL and model with every default.
    pub fn new(url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            urls: vec![url.into()],
            model: model.into(),
            api_key_env: None,
            concurrency: default_concurrency(),
            timeout_secs: default_timeout(),
            max_retries: default_retries(),
            max_tokens: default_max_tokens(),
            temperature: 0.0,
            backoff_base_secs: default_backoff_base(),
            backoff_max_secs: default_backoff_max(),
            chat_template_kwargs: default_kwargs(),
        }
    }

    /// Checks ranges, naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.urls.is_empty() {
            return Err(JudgeError::config(
                "urls",
                "at least one base URL is needed",
            ));
        }
        for u in &self.urls {
            if !(u.starts_with("http://") || u.starts_with("https://")) {
                return Err(JudgeError::config(
                    "urls",
                    format!("`{}` is not an http(s) URL", conrub_base::shown_url(u)),
                ));
            }
        }
        if self.model.trim().is_empty() {
            return Err(JudgeError::config("model", "must not be empty"));
        }
        if self.concurrency == 0 {
            return Err(JudgeError::config("concurrency", "must be at least 1"));
        }
        if !(self.timeout_secs > 0.0) {
            return Err(JudgeError::config("timeout_secs", "must be > 0"));
        }
        if !(self.backoff_base_secs >= 0.0 && self.backoff_max_secs >= self.backoff_base_secs) {
            return Err(JudgeError::config(
                "backoff_base_secs",
                "need 0 <= backoff_base_secs <= backoff_max_secs",
            ));
        }
        Ok(())
    }
}

/// Counters of a client since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ClientStats {
    /// HTTP requests sent.
    pub requests: u64,
    /// Attempts after the first, over all calls.
    pub retries: u64,
    /// Calls that ended without a valid answer.
    pub failures: u64,
    /// Transport errors (timeouts, refused or dropped connections).
    pub transport_errors: u64,
    /// Responses with a retryable status (408, 429, 5xx).
    pub retryable_status: u64,
    /// Outputs the parser rejected.
    pub parse_errors: u64,
    /// Sum of call latencies in milliseconds (first attempt to final answer).
    pub latency_ms_total: f64,
    /// Calls finished.
    pub calls: u64,
}

/// Why a logical call gave no answer within its retry budget (transport errors, refusals or
/// unparseable output, the last one named).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CallError(pub String);

/// The result of one logical call.
#[derive(Debug, Clone)]
pub struct CallOutcome<T> {
    /// The parsed answer or the final error.
    pub result: std::result::Result<T, CallError>,
    /// Raw text of every completion received, in order.
    pub raw_outputs: Vec<String>,
    /// Attempts made.
    pub attempts: u32,
    /// Wall time including backoff.
    pub latency: Duration,
}

/// The client.
pub struct ChatClient {
    cfg: ClientConfig,
    http: reqwest::Client,
    permits: Semaphore,
    next_url: AtomicUsize,
    api_key: Option<String>,
    requests: AtomicU64,
    retries: AtomicU64,
    failures: AtomicU64,
    transport_errors: AtomicU64,
    retryable_status: AtomicU64,
    parse_errors: AtomicU64,
    latency_us: AtomicU64,
    calls: AtomicU64,
}

impl std::fmt::Debug for ChatClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is never printed.
        f.debug_struct("ChatClient")
            .field(
                "urls",
                &self
                    .cfg
                    .urls
                    .iter()
                    .map(|u| conrub_base::shown_url(u))
                    .collect::<Vec<_>>(),
            )
            .field("model", &self.cfg.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl ChatClient {
    /// Builds a client; reads the API key from `api_key_env` if set (an unset variable is an error).
    pub fn new(cfg: ClientConfig) -> Result<Self> {
        cfg.validate()?;
        let api_key = match &cfg.api_key_env {
            Some(var) if !var.is_empty() => Some(std::env::var(var).map_err(|_| {
                JudgeError::config(
                    "api_key_env",
                    format!("environment variable {var} is not set"),
                )
            })?),
            _ => None,
        };
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(cfg.concurrency)
            .connect_timeout(Duration::from_secs_f64(cfg.timeout_secs.min(30.0)))
            .build()
            .map_err(JudgeError::Http)?;
        Ok(Self {
            permits: Semaphore::new(cfg.concurrency),
            cfg,
            http,
            next_url: AtomicUsize::new(0),
            api_key,
            requests: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            transport_errors: AtomicU64::new(0),
            retryable_status: AtomicU64::new(0),
            parse_errors: AtomicU64::new(0),
            latency_us: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        })
    }

    /// The settings.
    pub fn config(&self) -> &ClientConfig {
        &self.cfg
    }

    /// Counters so far.
    pub fn stats(&self) -> ClientStats {
        ClientStats {
            requests: self.requests.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            transport_errors: self.transport_errors.load(Ordering::Relaxed),
            retryable_status: self.retryable_status.load(Ordering::Relaxed),
            parse_errors: self.parse_errors.load(Ordering::Relaxed),
            latency_ms_total: self.latency_us.load(Ordering::Relaxed) as f64 / 1e3,
            calls: self.calls.load(Ordering::Relaxed),
        }
    }

    async fn send_once(&self, url: &str, messages: &[Value]) -> Attempt<String, String> {
        let mut body = json!({
            "model": self.cfg.model,
            "messages": messages,
            "temperature": self.cfg.temperature,
            "max_tokens": self.cfg.max_tokens,
        });
        if let Some(kw) = self
            .cfg
            .chat_template_kwargs
            .as_ref()
            .filter(|k| k.as_object().is_some_and(|o| !o.is_empty()))
        {
            body["chat_template_kwargs"] = kw.clone();
        }
        let target = conrub_base::endpoint(url, "chat/completions");
        // What messages name: never the user, password or query of the URL.
        let endpoint = conrub_base::shown_url(&target);
        let mut req = self
            .http
            .post(&target)
            .timeout(Duration::from_secs_f64(self.cfg.timeout_secs))
            .json(&body);
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        let _permit = self
            .permits
            .acquire()
            .await
            .expect("semaphore never closed");
        self.requests.fetch_add(1, Ordering::Relaxed);
        let transport = |e: reqwest::Error| {
            let kind = if e.is_timeout() {
                "timed out"
            } else if e.is_connect() {
                "connection failed"
            } else {
                "connection error"
            };
            Attempt::Retry(format!("{endpoint}: {kind}: {}", root_cause(&e)), None)
        };
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                self.transport_errors.fetch_add(1, Ordering::Relaxed);
                return transport(e);
            }
        };
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.trim().parse::<f64>().ok())
            .map(Duration::from_secs_f64);
        let text = match resp.text().await {
            Ok(t) => t,
            Err(e) => {
                self.transport_errors.fetch_add(1, Ordering::Relaxed);
                return transport(e);
            }
        };
        let snippet: String = text.chars().take(200).collect();
        if status.as_u16() == 408 || status.as_u16() == 429 || status.is_server_error() {
            self.retryable_status.fetch_add(1, Ordering::Relaxed);
            return Attempt::Retry(format!("{endpoint}: HTTP {status}: {snippet}"), retry_after);
        }
        if !status.is_success() {
            let hint = if status.as_u16() == 401 || status.as_u16() == 403 {
                match &self.cfg.api_key_env {
                    Some(v) => format!(" (check the key in ${v})"),
                    None => " (set api_key_env to send a key)".to_string(),
                }
            } else {
                String::new()
            };
            return Attempt::Fatal(format!("{endpoint}: HTTP {status}{hint}: {snippet}"));
        }
        let Ok(v) = serde_json::from_str::<Value>(&text) else {
            return Attempt::Retry(format!("{endpoint}: response is not JSON: {snippet}"), None);
        };
        match v
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
        {
            Some(c) => Attempt::Done(c.to_string()),
            None => Attempt::Retry(
                format!("{endpoint}: no choices[0].message.content in the response: {snippet}"),
                None,
            ),
        }
    }

    /// Sends `system` + `user`, parses the answer with `parse`, and retries within the budget. After
    /// unparseable output, the next attempt shows the model its previous answer and the problem.
    pub async fn chat_parsed<T>(
        &self,
        system: &str,
        user: &str,
        parse: impl Fn(&str) -> std::result::Result<T, crate::parse::OutputError>,
    ) -> CallOutcome<T> {
        let start = Instant::now();
        let base = vec![
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": user}),
        ];
        // Attempts run one after another; the locks only let each attempt's future own no
        // borrow of the loop's state.
        let messages = Mutex::new(base.clone());
        let raw_outputs = Mutex::new(Vec::new());
        let first_url = self.next_url.fetch_add(1, Ordering::Relaxed);
        let backoff = Backoff::exponential(
            self.cfg.backoff_base_secs,
            self.cfg.backoff_max_secs,
            self.cfg.max_retries,
        )
        .with_jitter(rand::random::<f64>);
        let (base, parse, messages_ref, raw_ref) = (&base, &parse, &messages, &raw_outputs);
        let outcome = retry(&backoff, tokio::time::sleep, |n| async move {
            if n > 1 {
                self.retries.fetch_add(1, Ordering::Relaxed);
            }
            let url = &self.cfg.urls[(first_url + n as usize - 1) % self.cfg.urls.len()];
            let sent = messages_ref.lock().expect("not poisoned").clone();
            let content = match self.send_once(url, &sent).await {
                Attempt::Done(content) => content,
                Attempt::Retry(e, floor) => return Attempt::Retry(e, floor),
                Attempt::Fatal(e) => return Attempt::Fatal(e),
            };
            let parsed = parse(&content);
            if let Err(e) = &parsed {
                self.parse_errors.fetch_add(1, Ordering::Relaxed);
                let mut again = base.clone();
                again.push(json!({"role": "assistant", "content": content}));
                again.push(json!({"role": "user", "content": format!(
                    "That reply could not be used ({e}). Answer again with only the JSON, exactly in the format asked for."
                )}));
                *messages_ref.lock().expect("not poisoned") = again;
            }
            raw_ref.lock().expect("not poisoned").push(content);
            match parsed {
                Ok(v) => Attempt::Done(v),
                Err(e) => Attempt::Retry(format!("unparseable output: {e}"), None),
            }
        })
        .await;
        let raw_outputs = raw_outputs.into_inner().expect("not poisoned");
        let (result, attempts) = match outcome {
            Ok((v, attempts)) => (Ok(v), attempts),
            Err(g) if g.exhausted => (
                Err(CallError(format!(
                    "gave up after {} attempts: {}",
                    g.attempts, g.error
                ))),
                g.attempts,
            ),
            Err(g) => (Err(CallError(g.error)), g.attempts),
        };
        let latency = start.elapsed();
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.latency_us
            .fetch_add(latency.as_micros() as u64, Ordering::Relaxed);
        if result.is_err() {
            self.failures.fetch_add(1, Ordering::Relaxed);
        }
        CallOutcome {
            result,
            raw_outputs,
            attempts,
            latency,
        }
    }
}

fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}
