//! A scripted OpenAI-compatible chat-completions server on loopback, for tests and benchmarks.
//!
//! The server reads the response under judgement (between `RESPONSE:\n<<<\n` and `\n>>>`, or the
//! first candidate of a pairwise prompt) and looks for a `[[behaviour]]` tag in it:
//!
//! | tag | answer |
//! |---|---|
//! | none | valid labels: criterion `i` gets `correct`, `missing`, `wrong` for `i % 3` = 0, 1, 2 (binary: `yes`, `no`, `no`) |
//! | `[[all-correct]]` | every criterion `correct` (binary `yes`) |
//! | `[[garbage]]` | prose without JSON, every time |
//! | `[[garbage-once]]` | prose first, valid labels afterwards |
//! | `[[wrong-length]]` | one label too few, every time |
//! | `[[slow-once]]` | sleeps `slow_ms` on the first attempt, then answers |
//! | `[[slow]]` | sleeps `slow_ms` every time |
//! | `[[500]]` / `[[500-twice]]` | HTTP 500 always / on the first two attempts |
//! | `[[429-once]]` | HTTP 429 with `Retry-After: 0` on the first attempt |
//! | `[[drop-once]]` | the first attempt's body is cut off mid-stream (connection dropped) |
//! | `[[prefer-first]]` | pairwise: always `A` (position bias) |
//!
//! Pairwise prompts: the candidate containing `good` wins, otherwise `same`.
//!
//! [`ScriptedServer::with_script`] serves any other behaviour: a function from the request's
//! messages to a [`Reply`] (used by the rubric construction tests). Every server counts the
//! requests it answered per request body, and can be told to hold requests ([`ScriptedServer::hold_after`])
//! so that a test can kill its client at a known point.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

/// Shared state and counters of a scripted server.
#[derive(Default)]
pub struct ServerState {
    /// Attempts seen per judged response text.
    pub attempts: Mutex<HashMap<String, u32>>,
    /// Requests received.
    pub requests: AtomicUsize,
    /// Requests being handled right now.
    pub in_flight: AtomicUsize,
    /// Most requests handled at once.
    pub max_in_flight: AtomicUsize,
    /// Last request body.
    pub last_body: Mutex<Option<Value>>,
    /// Last `Authorization` header.
    pub last_auth: Mutex<Option<String>>,
    /// Milliseconds `slow` behaviours sleep.
    pub slow_ms: u64,
    /// Milliseconds every request sleeps (simulated model latency).
    pub base_latency_ms: u64,
    /// Requests answered (a response was produced, not held or cut off by the client).
    pub answered: AtomicUsize,
    /// Times each distinct request body (model + messages) was answered.
    pub answered_bodies: Mutex<HashMap<String, u32>>,
    /// Once `admitted` reaches this, new requests wait until it is raised (`usize::MAX`: never).
    pub hold_after: AtomicUsize,
    /// Requests let through to be answered (answered, being answered, or cut off by their client).
    /// A request is admitted only while this is below `hold_after`, in one atomic step, so that
    /// concurrent requests cannot push the answers past the hold point.
    pub admitted: AtomicUsize,
    /// True while a request is being held.
    pub holding: AtomicBool,
    /// Requests held so far (each held request counted once, when it starts waiting).
    pub held: AtomicUsize,
    script: Option<Script>,
}

/// A scripted answer.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A completion with this content.
    Text(String),
    /// An HTTP error with this status and body.
    Status(u16, String),
    /// Sleep this many milliseconds, then reply.
    Sleep(u64, Box<Reply>),
}

/// What a script sees of one request.
#[derive(Debug, Clone)]
pub struct ScriptRequest {
    /// The system message.
    pub system: String,
    /// The first user message.
    pub user: String,
    /// All messages (a correction retry has four).
    pub messages: usize,
    /// How many times this server has seen this system + user pair, this one included.
    pub attempt: u32,
}

/// A function from a request to its reply.
pub type Script = Arc<dyn Fn(&ScriptRequest) -> Reply + Send + Sync>;

/// A running scripted server.
pub struct ScriptedServer {
    /// `http://127.0.0.1:PORT/v1`.
    pub url: String,
    /// Its counters.
    pub state: Arc<ServerState>,
    handle: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedServer {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

fn between<'a>(text: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let i = text.find(start)? + start.len();
    let j = text[i..].find(end)? + i;
    Some(&text[i..j])
}

fn behaviour(text: &str) -> &str {
    between(text, "[[", "]]").unwrap_or("")
}

fn completion(content: &str) -> Response {
    Json(json!({
        "id": "cmpl-test",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    }))
    .into_response()
}

async fn handle(
    State(st): State<Arc<ServerState>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    st.requests.fetch_add(1, Ordering::SeqCst);
    let admit = |n: usize| (n < st.hold_after.load(Ordering::SeqCst)).then_some(n + 1);
    if st
        .admitted
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, admit)
        .is_err()
    {
        // Held until released, then refused without being answered: its client is meant to be
        // killed meanwhile.
        st.held.fetch_add(1, Ordering::SeqCst);
        st.holding.store(true, Ordering::SeqCst);
        while st.admitted.load(Ordering::SeqCst) >= st.hold_after.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        return (StatusCode::SERVICE_UNAVAILABLE, "held").into_response();
    }
    let now = st.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    st.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let key = format!(
        "{}|{}",
        body.get("model").unwrap_or(&Value::Null),
        body.get("messages").unwrap_or(&Value::Null)
    );
    let resp = match st.script.clone() {
        Some(script) => scripted(&st, &script, &body).await,
        None => answer(&st, &headers, body).await,
    };
    // Counted as answered only if the client is still there to receive it (a dropped connection
    // cancels this future before this point).
    st.answered.fetch_add(1, Ordering::SeqCst);
    *st.answered_bodies.lock().unwrap().entry(key).or_insert(0) += 1;
    st.in_flight.fetch_sub(1, Ordering::SeqCst);
    resp
}

async fn scripted(st: &ServerState, script: &Script, body: &Value) -> Response {
    let text = |i: usize| {
        body.pointer(&format!("/messages/{i}/content"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let (system, user) = (text(0), text(1));
    let attempt = {
        let mut m = st.attempts.lock().unwrap();
        let a = m.entry(format!("{system}\u{0}{user}")).or_insert(0);
        *a += 1;
        *a
    };
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    let mut reply = script(&ScriptRequest {
        system,
        user,
        messages,
        attempt,
    });
    loop {
        match reply {
            Reply::Text(t) => return completion(&t),
            Reply::Status(code, body) => {
                return (
                    StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                    body,
                )
                    .into_response();
            }
            Reply::Sleep(ms, next) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                reply = *next;
            }
        }
    }
}

async fn answer(st: &ServerState, headers: &HeaderMap, body: Value) -> Response {
    *st.last_auth.lock().unwrap() = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    // The user prompt is the second message (a correction retry appends more).
    let user = body
        .pointer("/messages/1/content")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    *st.last_body.lock().unwrap() = Some(body);
    if st.base_latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(st.base_latency_ms)).await;
    }
    let pairwise = user.contains("RESPONSE A:");
    let subject = if pairwise {
        between(&user, "RESPONSE A:\n<<<\n", "\n>>>")
    } else {
        between(&user, "RESPONSE:\n<<<\n", "\n>>>")
    }
    .unwrap_or("")
    .to_string();
    let attempt = {
        let mut m = st.attempts.lock().unwrap();
        let a = m.entry(subject.clone()).or_insert(0);
        *a += 1;
        *a
    };
    let n: usize = between(&user, "CRITERIA (", "):")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let binary = user.contains("\"yes\"");
    let tag = behaviour(&subject);
    match tag {
        "slow" => tokio::time::sleep(Duration::from_millis(st.slow_ms)).await,
        "slow-once" if attempt == 1 => tokio::time::sleep(Duration::from_millis(st.slow_ms)).await,
        "500" => return (StatusCode::INTERNAL_SERVER_ERROR, "upstream exploded").into_response(),
        "500-twice" if attempt <= 2 => {
            return (StatusCode::SERVICE_UNAVAILABLE, "warming up").into_response()
        }
        "429-once" if attempt == 1 => {
            return (
                StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", "0")],
                "slow down",
            )
                .into_response();
        }
        "drop-once" if attempt == 1 => {
            let chunks: Vec<Result<&'static str, std::io::Error>> = vec![
                Ok("{\"choices\": [{\"message\": {\"content\": \"[\\\"cor"),
                Err(std::io::Error::other("connection reset")),
            ];
            return Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .header("content-length", "500")
                .body(Body::from_stream(futures::stream::iter(chunks)))
                .unwrap();
        }
        "garbage" => {
            return completion(
                "I am sorry, but I cannot evaluate this response without more context.",
            )
        }
        "garbage-once" if attempt == 1 => {
            return completion(
                "Let me think about each criterion carefully. Overall the answer is decent.",
            )
        }
        _ => {}
    }
    if pairwise {
        let second = between(&user, "RESPONSE B:\n<<<\n", "\n>>>").unwrap_or("");
        let verdict =
            if tag == "prefer-first" || (subject.contains("good") && !second.contains("good")) {
                "A"
            } else if second.contains("good") && !subject.contains("good") {
                "B"
            } else {
                "same"
            };
        let per: Vec<&str> = vec![verdict; n];
        return completion(&format!(
            "```json\n{}\n```",
            json!({"criteria": per, "verdict": verdict, "confidence": 0.8, "reason": "scripted"})
        ));
    }
    let count = if tag == "wrong-length" {
        n.saturating_sub(1)
    } else {
        n
    };
    let labels: Vec<&str> = (0..count)
        .map(|i| match (tag == "all-correct", binary, i % 3) {
            (true, true, _) => "yes",
            (true, false, _) => "correct",
            (false, true, 0) => "yes",
            (false, true, _) => "no",
            (false, false, 0) => "correct",
            (false, false, 1) => "missing",
            _ => "wrong",
        })
        .collect();
    completion(&format!("Here are the labels:\n{}", json!(labels)))
}

impl ScriptedServer {
    /// Starts a server on an ephemeral loopback port (inside the current tokio runtime).
    pub async fn start(slow_ms: u64, base_latency_ms: u64) -> Self {
        Self::serve(ServerState {
            slow_ms,
            base_latency_ms,
            hold_after: AtomicUsize::new(usize::MAX),
            ..Default::default()
        })
        .await
    }

    /// Starts a server that answers with `script`.
    pub async fn with_script(
        script: impl Fn(&ScriptRequest) -> Reply + Send + Sync + 'static,
    ) -> Self {
        Self::serve(ServerState {
            script: Some(Arc::new(script)),
            hold_after: AtomicUsize::new(usize::MAX),
            ..Default::default()
        })
        .await
    }

    async fn serve(state: ServerState) -> Self {
        let state = Arc::new(state);
        let app = Router::new()
            .route("/v1/chat/completions", post(handle))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr: SocketAddr = listener.local_addr().expect("local addr");
        let handle = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            url: format!("http://{addr}/v1"),
            state,
            handle,
        }
    }

    /// Attempts the server saw for a judged response text.
    pub fn attempts_for(&self, response: &str) -> u32 {
        self.state
            .attempts
            .lock()
            .unwrap()
            .get(response)
            .copied()
            .unwrap_or(0)
    }

    /// Requests received so far.
    pub fn requests(&self) -> usize {
        self.state.requests.load(Ordering::SeqCst)
    }

    /// Requests answered so far.
    pub fn answered(&self) -> usize {
        self.state.answered.load(Ordering::SeqCst)
    }

    /// Requests held so far (see [`ScriptedServer::hold_after`]).
    pub fn held(&self) -> usize {
        self.state.held.load(Ordering::SeqCst)
    }

    /// True when every request received so far has been answered or is held: none is being
    /// answered. Once [`ScriptedServer::hold_after`] holds every new request, this becomes true
    /// after the last admitted request is answered, and from then on no answer can come until
    /// the hold is raised.
    pub fn settled(&self) -> bool {
        // Answered and held are read before requests: each request is counted in `requests`
        // before it is answered or held, so a request being answered always shows as a shortfall.
        let (answered, held) = (self.answered(), self.held());
        answered + held == self.requests()
    }

    /// The most times any one request body was answered (1 when nothing was asked twice).
    pub fn max_repeats(&self) -> u32 {
        self.state
            .answered_bodies
            .lock()
            .unwrap()
            .values()
            .copied()
            .max()
            .unwrap_or(0)
    }

    /// Holds every request that arrives once `n` requests have been let through (so exactly `n`
    /// are answered, unless a client cuts one off); `usize::MAX` releases them (they are refused
    /// with 503, unanswered). `0` holds every new request.
    pub fn hold_after(&self, n: usize) {
        self.state.hold_after.store(n, Ordering::SeqCst);
        self.state.holding.store(false, Ordering::SeqCst);
    }
}

/// A loopback port that accepts connections and closes them at once; returns its URL and a
/// counter of accepted connections.
pub async fn dead_server() -> (String, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    let handle = tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            drop(sock);
        }
    });
    (format!("http://{addr}/v1"), accepted, handle)
}
