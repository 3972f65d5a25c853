//! A scripted SGLang server on loopback (feature `testing`), for tests: it speaks the subset of
//! the native API the engine uses, samples from a fixed distribution so its log-probs are known,
//! reads the weights it is told to load and records their checksum, and injects faults.
//!
//! Sampling: each new token is one of 8 equally likely ids, `10..=16` and the request's first
//! stop id, so every reported log-prob is `-ln 8` ([`SCRIPTED_LOGPROB`]). Draws are a fixed
//! function of the prompt, the sample index and the number of `/generate` calls so far.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// The log-probability the scripted server reports for every token: `ln(1/8)`.
pub const SCRIPTED_LOGPROB: f64 = -2.0794415416798357;

/// A fault the server injects until told otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `/generate` answers HTTP 503 (a server that refuses work).
    Refuse,
    /// `/generate` sleeps for the given milliseconds before answering.
    Slow(u64),
    /// `/generate` answers a body that is not JSON.
    Malformed,
    /// `/generate` answers one output fewer than asked.
    WrongCount,
    /// `/update_weights_from_disk` answers `success: false` (HTTP 400).
    FailUpdate,
    /// `/generate` reports the weight version before the last update.
    Stale,
    /// `/generate` returns a token id past every vocabulary.
    OutOfVocab,
}

/// What the server was asked, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A `/generate` call (one group) answered with the weights of this version.
    Generate {
        /// The version the server held.
        version: String,
        /// Tokens it returned, over the group's outputs.
        tokens: usize,
    },
    /// A weight update: the version and the SHA-256 of the `model.safetensors` it loaded.
    Update {
        /// `weight_version` of the request.
        version: String,
        /// Hex SHA-256 of the file.
        sha256: String,
    },
    /// `/release_memory_occupation`.
    Release,
    /// `/resume_memory_occupation`.
    Resume,
}

/// The server's state: its log, the fault it injects, its weights.
#[derive(Default)]
pub struct ServerState {
    /// Everything it was asked, in order.
    pub events: Mutex<Vec<Event>>,
    /// The injected fault, if any.
    pub fault: Mutex<Option<Fault>>,
    version: Mutex<(String, String)>,
    calls: Mutex<u64>,
}

impl ServerState {
    /// The log so far.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap().clone()
    }

    /// Injects `fault` (or none) from now on.
    pub fn set_fault(&self, fault: Option<Fault>) {
        *self.fault.lock().unwrap() = fault;
    }
}

/// A running scripted server; stopped when dropped.
pub struct ScriptedSglang {
    /// Its base URL, `http://127.0.0.1:PORT`.
    pub url: String,
    /// Its state.
    pub state: Arc<ServerState>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for ScriptedSglang {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl ScriptedSglang {
    /// Starts a server on a free loopback port, on its own thread and runtime.
    pub fn start() -> Self {
        let state = Arc::new(ServerState::default());
        *state.version.lock().unwrap() = ("default".into(), "default".into());
        let (tx, rx) = std::sync::mpsc::channel::<SocketAddr>();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let st = state.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let app = Router::new()
                    .route("/generate", post(generate))
                    .route("/update_weights_from_disk", post(update))
                    .route("/release_memory_occupation", post(release))
                    .route("/resume_memory_occupation", post(resume))
                    .with_state(st);
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(listener.local_addr().unwrap()).unwrap();
                axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stopped.await;
                    })
                    .await
                    .unwrap();
            });
        });
        let addr = rx.recv().expect("the server starts");
        Self {
            url: format!("http://{addr}"),
            state,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

fn fault(s: &ServerState) -> Option<Fault> {
    *s.fault.lock().unwrap()
}

async fn generate(State(s): State<Arc<ServerState>>, Json(body): Json<Value>) -> Response {
    let f = fault(&s);
    match f {
        Some(Fault::Refuse) => {
            return (StatusCode::SERVICE_UNAVAILABLE, "overloaded").into_response()
        }
        Some(Fault::Slow(ms)) => tokio::time::sleep(Duration::from_millis(ms)).await,
        Some(Fault::Malformed) => {
            return (StatusCode::OK, "{\"text\": [unfinished").into_response()
        }
        _ => {}
    }
    let prompt: Vec<u64> = body["input_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let p = &body["sampling_params"];
    let n = p["n"].as_u64().unwrap_or(1) as usize;
    let max = p["max_new_tokens"].as_u64().unwrap_or(16) as usize;
    let stop = p["stop_token_ids"][0].as_u64().unwrap_or(2);
    let call = {
        let mut c = s.calls.lock().unwrap();
        *c += 1;
        *c
    };
    let (current, previous) = s.version.lock().unwrap().clone();
    let version = if f == Some(Fault::Stale) {
        previous
    } else {
        current
    };
    let seed = prompt
        .iter()
        .fold(call, |h, t| h.wrapping_mul(31).wrapping_add(*t));
    let outputs: Vec<Value> = (0..n.saturating_sub(usize::from(f == Some(Fault::WrongCount))))
        .map(|i| {
            let mut x = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(i as u64 * 2 + 1);
            let mut ids = Vec::new();
            while ids.len() < max {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let pick = (x >> 33) % 8;
                let id = if pick == 7 { stop } else { 10 + pick };
                ids.push(id);
                if id == stop {
                    break;
                }
            }
            if f == Some(Fault::OutOfVocab) {
                ids[0] = 1 << 30;
            }
            let reason = if ids.last() == Some(&stop) {
                json!({"type": "stop", "matched": stop})
            } else {
                json!({"type": "length", "length": ids.len()})
            };
            let lps: Vec<Value> = ids
                .iter()
                .map(|t| json!([SCRIPTED_LOGPROB, t, null]))
                .collect();
            json!({"text": "", "output_ids": ids, "meta_info": {
                "id": format!("{call}-{i}"),
                "prompt_tokens": prompt.len(),
                "completion_tokens": ids.len(),
                "finish_reason": reason,
                "output_token_logprobs": lps,
                "weight_version": version,
            }})
        })
        .collect();
    let tokens = outputs
        .iter()
        .map(|o| o["output_ids"].as_array().map_or(0, Vec::len))
        .sum();
    s.events
        .lock()
        .unwrap()
        .push(Event::Generate { version, tokens });
    Json(Value::Array(outputs)).into_response()
}

/// The weights of a model folder as a server reads them: `model.safetensors`, or the index and
/// every shard it lists (in name order), concatenated; the error is the reply's message.
fn weight_bytes(dir: &std::path::Path) -> std::result::Result<Vec<u8>, String> {
    let read = |p: &std::path::Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    if single.exists() || !index.exists() {
        return read(&single);
    }
    let mut bytes = read(&index)?;
    let parsed: Value =
        serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", index.display()))?;
    let shards: std::collections::BTreeSet<&str> = parsed["weight_map"]
        .as_object()
        .map(|m| m.values().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for shard in shards {
        bytes.extend(read(&dir.join(shard))?);
    }
    Ok(bytes)
}

async fn update(State(s): State<Arc<ServerState>>, Json(body): Json<Value>) -> Response {
    let version = body["weight_version"].as_str().unwrap_or("").to_string();
    let dir = std::path::Path::new(body["model_path"].as_str().unwrap_or("")).to_path_buf();
    if fault(&s) == Some(Fault::FailUpdate) {
        let reply = json!({"success": false, "message": "Failed to update weights: out of memory"});
        return (StatusCode::BAD_REQUEST, Json(reply)).into_response();
    }
    let bytes = match weight_bytes(&dir) {
        Ok(b) => b,
        Err(message) => {
            let reply = json!({"success": false, "message": message});
            return (StatusCode::BAD_REQUEST, Json(reply)).into_response();
        }
    };
    let sha256: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    {
        let mut v = s.version.lock().unwrap();
        *v = (version.clone(), v.0.clone());
    }
    s.events.lock().unwrap().push(Event::Update {
        version: version.clone(),
        sha256,
    });
    let message =
        format!("Succeeded to update model weights. Weight version updated to {version}.");
    Json(json!({"success": true, "message": message, "num_paused_requests": 0})).into_response()
}

async fn release(State(s): State<Arc<ServerState>>) -> Response {
    s.events.lock().unwrap().push(Event::Release);
    StatusCode::OK.into_response()
}

async fn resume(State(s): State<Arc<ServerState>>) -> Response {
    s.events.lock().unwrap().push(Event::Resume);
    StatusCode::OK.into_response()
}
