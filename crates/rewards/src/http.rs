//! A reward served over HTTP (`kind = "http"` in `[[reward.functions]]`).
//!
//! One POST per group to `url`, with a JSON body
//! `{"prompt_id", "prompt", "responses": [..], "ground_truth": string | null, "step"}`; the server
//! answers `{"rewards": [..]}`, one number (or `null`: that response is unscored) per response.
//! Transport errors, timeouts, 408, 429, 5xx and answers of the wrong shape are retried with
//! exponential backoff (`backoff_base_secs` doubling up to `backoff_max_secs`); other 4xx are
//! not. A group the server never answers is unscored, never given 0: the learner leaves such
//! responses out, as it does a judge's failures. An API key is read from the environment
//! variable `api_key_env` names and sent as a bearer token; it is never logged.

use std::time::Duration;

use async_trait::async_trait;
use conrub_base::{retry, Attempt, Backoff};
use conrub_rubric::{ResponseScore, RewardFunctionSpec};
use serde::Deserialize;
use serde_json::json;

use crate::error::{Result, RewardError};
use crate::source::{GroupScores, RewardSource};
use crate::task::TaskPrompt;

fn default_timeout() -> f64 {
    30.0
}
fn default_retries() -> u32 {
    3
}
fn default_backoff_base() -> f64 {
    0.5
}
fn default_backoff_max() -> f64 {
    10.0
}

/// The options of an `http` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpOptions {
    url: String,
    #[serde(default = "default_timeout")]
    timeout_secs: f64,
    #[serde(default = "default_retries")]
    max_retries: u32,
    #[serde(default = "default_backoff_base")]
    backoff_base_secs: f64,
    #[serde(default = "default_backoff_max")]
    backoff_max_secs: f64,
    #[serde(default)]
    api_key_env: Option<String>,
}

/// A reward server's client.
pub struct HttpReward {
    url: String,
    /// The URL as messages show it: no user, password, query or fragment.
    shown: String,
    client: reqwest::Client,
    backoff: Backoff,
    api_key: Option<String>,
}

/// What a server answers.
#[derive(Deserialize)]
struct Answer {
    rewards: Vec<Option<f64>>,
}

/// Why an attempt failed, and whether another may help.
struct Failed {
    message: String,
    retry: bool,
}

impl HttpReward {
    /// The client of an `http` entry; `at` names it in errors.
    pub fn from_spec(spec: &RewardFunctionSpec, at: &str) -> Result<Self> {
        let o: HttpOptions = spec.options(at)?;
        let bad = |key: &str, why: String| RewardError::Config {
            key: format!("{at}.{key}"),
            message: why,
        };
        if !(o.url.starts_with("http://") || o.url.starts_with("https://")) {
            return Err(bad(
                "url",
                format!("{:?} is not an http(s) URL", conrub_base::shown_url(&o.url)),
            ));
        }
        let seconds = |key: &str, v: f64| {
            Duration::try_from_secs_f64(v)
                .ok()
                .filter(|d| key != "timeout_secs" || !d.is_zero())
                .ok_or_else(|| bad(key, format!("{v} is not a usable number of seconds")))
        };
        let timeout = seconds("timeout_secs", o.timeout_secs)?;
        let backoff_base = seconds("backoff_base_secs", o.backoff_base_secs)?;
        let backoff_max = seconds("backoff_max_secs", o.backoff_max_secs)?;
        let api_key = match &o.api_key_env {
            Some(var) => Some(std::env::var(var).map_err(|_| {
                bad(
                    "api_key_env",
                    format!("the environment variable {var} is not set"),
                )
            })?),
            None => None,
        };
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| bad("url", format!("building the HTTP client: {e}")))?;
        Ok(Self {
            shown: conrub_base::shown_url(&o.url),
            url: o.url,
            client,
            backoff: Backoff::exponential(
                backoff_base.as_secs_f64(),
                backoff_max.as_secs_f64(),
                o.max_retries,
            ),
            api_key,
        })
    }

    /// One POST and its answer.
    async fn attempt(
        &self,
        body: &serde_json::Value,
        n: usize,
    ) -> std::result::Result<Vec<Option<f64>>, Failed> {
        let mut request = self.client.post(&self.url).json(body);
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let response = request.send().await.map_err(|e| Failed {
            message: format!("POST {}: {}", self.shown, without_url(e)),
            retry: true,
        })?;
        let status = response.status();
        if !status.is_success() {
            let retry = status.is_server_error() || matches!(status.as_u16(), 408 | 429);
            let message = format!("POST {}: HTTP {status}", self.shown);
            return Err(Failed { message, retry });
        }
        let answer: Answer = response.json().await.map_err(|e| Failed {
            message: format!(
                "the answer of {} is not {{\"rewards\": [..]}}: {e}",
                self.shown
            ),
            retry: true,
        })?;
        if answer.rewards.len() != n {
            let message = format!(
                "{} answered {} rewards for {n} responses",
                self.shown,
                answer.rewards.len()
            );
            return Err(Failed {
                message,
                retry: true,
            });
        }
        Ok(answer.rewards)
    }
}

/// A reqwest error's text without the URL it repeats.
fn without_url(e: reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else {
        "failed"
    };
    format!("{kind} ({})", e.without_url())
}

#[async_trait]
impl<T: TaskPrompt> RewardSource<T> for HttpReward {
    async fn score_group(
        &self,
        prompt: &T,
        responses: &[String],
        _lengths: &[u32],
        step: u64,
    ) -> GroupScores {
        let body = json!({
            "prompt_id": prompt.id(),
            "prompt": prompt.text(),
            "responses": responses,
            "ground_truth": prompt.ground_truth(),
            "step": step,
        });
        let max_retries = self.backoff.max_retries;
        let body = &body;
        let outcome = retry(&self.backoff, tokio::time::sleep, |n| async move {
            match self.attempt(body, responses.len()).await {
                Ok(rewards) => Attempt::Done(rewards),
                Err(f) if !f.retry => Attempt::Fatal(f.message),
                Err(f) => {
                    if n <= max_retries {
                        tracing::debug!("reward server, attempt {n}: {}", f.message);
                    }
                    Attempt::Retry(f.message, None)
                }
            }
        })
        .await;
        let (outcome, attempts) = match outcome {
            Ok((rewards, n)) => (Ok(rewards), n),
            Err(g) => (Err(g.error), g.attempts),
        };
        let retries = attempts - 1;
        let scores = match outcome {
            Ok(rewards) => rewards
                .into_iter()
                .map(|r| {
                    r.and_then(ResponseScore::value).unwrap_or_else(|| {
                        ResponseScore::unscored("the reward server gave no reward", attempts)
                    })
                })
                .collect(),
            Err(why) => {
                let why = format!("{why} (after {attempts} attempts)");
                vec![ResponseScore::unscored(why, attempts); responses.len()]
            }
        };
        GroupScores {
            judge_retries: retries,
            ..GroupScores::direct(scores)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use conrub_rubric::{Message, RubricRecord};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// A loopback reward server: fails the first `failures` requests with 503, then gives each
    /// response its length in characters (and `null` for an empty one).
    async fn server(failures: usize) -> (String, Arc<AtomicUsize>) {
        use axum::{extract::State, http::StatusCode, routing::post, Json, Router};
        let calls = Arc::new(AtomicUsize::new(0));
        async fn score(
            State((calls, failures)): State<(Arc<AtomicUsize>, usize)>,
            Json(body): Json<serde_json::Value>,
        ) -> std::result::Result<Json<serde_json::Value>, StatusCode> {
            if calls.fetch_add(1, Ordering::SeqCst) < failures {
                return Err(StatusCode::SERVICE_UNAVAILABLE);
            }
            assert_eq!(body["prompt_id"], "p1");
            assert_eq!(body["ground_truth"], "4");
            let rewards: Vec<serde_json::Value> = body["responses"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| match r.as_str().unwrap().len() {
                    0 => serde_json::Value::Null,
                    n => json!(n as f64 / 10.0),
                })
                .collect();
            Ok(Json(json!({ "rewards": rewards })))
        }
        let app = Router::new()
            .route("/score", post(score))
            .with_state((calls.clone(), failures));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/score", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (url, calls)
    }

    fn record() -> RubricRecord {
        RubricRecord {
            id: "p1".into(),
            question: vec![Message::user("2 + 2?")],
            reference_answer: None,
            ground_truth: Some("4".into()),
            source: None,
            criteria: vec![],
            provenance: None,
        }
    }

    fn client(url: &str, retries: u32) -> HttpReward {
        let spec = RewardFunctionSpec::new("http", 1.0)
            .with("url", url)
            .with("max_retries", retries)
            .with("backoff_base_secs", 0.01)
            .with("timeout_secs", 5.0);
        HttpReward::from_spec(&spec, "reward.functions[0]").unwrap()
    }

    async fn score(reward: &HttpReward, step: u64) -> GroupScores {
        let responses = ["four".to_string(), String::new(), "4".to_string()];
        RewardSource::<RubricRecord>::score_group(reward, &record(), &responses, &[1, 1, 1], step)
            .await
    }

    #[tokio::test]
    async fn a_server_that_fails_then_recovers() {
        // Two failures, two retries: the third attempt is answered.
        let (url, calls) = server(2).await;
        let g = score(&client(&url, 2), 0).await;
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        assert_eq!(g.judge_retries, 2);
        assert_eq!(g.scores[0].reward(), Some(0.4));
        assert!(!g.scores[1].is_scored(), "null is unscored, not 0");
        assert_eq!(g.scores[2].reward(), Some(0.1));

        // Three failures, one retry: the group is unscored, never 0; the next group (the
        // server is back) is scored.
        let (url, calls) = server(3).await;
        let reward = client(&url, 1);
        let g = score(&reward, 0).await;
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        for s in &g.scores {
            let ResponseScore::Unscored(u) = s else {
                panic!("{s:?}")
            };
            assert_eq!(u.attempts, 2);
            assert!(u.message.contains("503"), "{}", u.message);
        }
        let g = score(&reward, 1).await; // call 3 fails, call 4 is answered
        assert_eq!(g.scores[0].reward(), Some(0.4));
    }

    #[tokio::test]
    async fn a_dead_server_leaves_responses_unscored() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/score", listener.local_addr().unwrap());
        drop(listener);
        let g = score(&client(&url, 1), 0).await;
        assert!(g.scores.iter().all(|s| !s.is_scored()), "{:?}", g.scores);
    }

    #[test]
    fn options_are_checked() {
        let err =
            |spec: RewardFunctionSpec| match HttpReward::from_spec(&spec, "reward.functions[1]") {
                Ok(_) => panic!("accepted {spec:?}"),
                Err(e) => e.to_string(),
            };
        let e = err(RewardFunctionSpec::new("http", 1.0));
        assert!(e.contains("url"), "{e}");
        let e = err(RewardFunctionSpec::new("http", 1.0).with("url", "localhost:8000"));
        assert!(e.contains("reward.functions[1].url"), "{e}");
        let spec = RewardFunctionSpec::new("http", 1.0)
            .with("url", "http://x")
            .with("api_key_env", "CONRUB_TEST_UNSET_REWARD_KEY");
        let e = err(spec);
        assert!(e.contains("CONRUB_TEST_UNSET_REWARD_KEY"), "{e}");
        for (key, v) in [
            ("timeout_secs", 0.0),
            ("timeout_secs", 1e20),
            ("backoff_max_secs", -1.0),
        ] {
            let e = err(RewardFunctionSpec::new("http", 1.0)
                .with("url", "http://x")
                .with(key, v));
            assert!(e.contains(&format!("reward.functions[1].{key}")), "{e}");
        }
        let r = HttpReward::from_spec(
            &RewardFunctionSpec::new("http", 1.0)
                .with("url", "https://user:pw@rm.example:8443/score?key=s3cret#x")
                .with("backoff_base_secs", 1e9)
                .with("backoff_max_secs", 5.0),
            "x",
        )
        .unwrap();
        assert_eq!(r.shown, "https://rm.example:8443/score");
        assert_eq!(r.backoff.ceiling(40), Duration::from_secs(5));
    }
}
