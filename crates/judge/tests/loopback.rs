//! The OpenAI-compatible judge against a real HTTP server on loopback, scripted to answer
//! correctly, slowly, with garbage, with 500s and 429s, and to drop connections.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use conrub_judge::testing::{dead_server, ScriptedServer};
use conrub_judge::{
    compare_both_orders, score_jobs, ChatClient, ClientConfig, CriterionRequest, JudgeCache,
    OpenAiJudge, PairOutcome, PromptSet, ScoreJob,
};
use conrub_rubric::{Label, LengthPenalty, ResponseScore, ScoringMode};

fn config(urls: Vec<String>) -> ClientConfig {
    ClientConfig {
        urls,
        // Generous for a loaded 2-core CI machine; the slow behaviours sleep well past it.
        timeout_secs: 1.0,
        max_retries: 3,
        backoff_base_secs: 0.005,
        backoff_max_secs: 0.02,
        ..ClientConfig::new("x", "judge-model")
    }
}

fn job(response: &str, n: usize, mode: ScoringMode) -> ScoreJob {
    ScoreJob {
        request: CriterionRequest {
            question: "A 58-year-old has crushing chest pain for 20 minutes. What now?".into(),
            response: response.into(),
            criteria: (0..n)
                .map(|i| format!("The response states point {i}."))
                .collect(),
            mode,
        },
        response_tokens: Some(100),
    }
}

/// A hang detector (not a speed assertion): every test must finish.
async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("judging hung")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewards_are_right_retries_bounded_and_failures_unscored() {
    let server = ScriptedServer::start(3_000, 0).await;
    let client = Arc::new(ChatClient::new(config(vec![server.url.clone()])).unwrap());
    let judge = OpenAiJudge::new(client.clone(), PromptSet::default(), None);
    let cases = [
        // (response, expected attempts, scored)
        ("A plain, correct answer.", 1, true),
        ("[[slow-once]] answer", 2, true),
        ("[[garbage-once]] answer", 2, true),
        ("[[500-twice]] answer", 3, true),
        ("[[429-once]] answer", 2, true),
        ("[[drop-once]] answer", 2, true),
        ("[[garbage]] answer", 4, false),
        ("[[wrong-length]] answer", 4, false),
        ("[[500]] answer", 4, false),
        ("[[slow]] answer", 4, false),
    ];
    let jobs: Vec<ScoreJob> = cases
        .iter()
        .map(|(r, _, _)| job(r, 6, ScoringMode::ThreeState))
        .collect();
    let penalty = LengthPenalty::default();
    let (results, summary) = bounded(score_jobs(&judge, &jobs, &penalty, None, 64, &|_| {})).await;
    for ((response, attempts, scored), r) in cases.iter().zip(&results) {
        assert_eq!(
            r.verdict.attempts, *attempts,
            "{response}: {:?}",
            r.verdict.error
        );
        assert_eq!(
            server.attempts_for(response),
            *attempts,
            "{response}: server-side attempts"
        );
        match (&r.score, scored) {
            (ResponseScore::Scored(s), true) => {
                // correct, missing, wrong, correct, missing, wrong -> (2 - 2) / 6 = 0.
                assert_eq!(
                    s.labels,
                    [Label::Correct, Label::Missing, Label::Wrong].repeat(2)
                );
                assert_eq!(s.reward.value(), 0.0);
            }
            (ResponseScore::Unscored(u), false) => {
                assert_eq!(u.attempts, 4);
                assert!(
                    u.message.starts_with("gave up after 4 attempts"),
                    "{}",
                    u.message
                );
            }
            (other, _) => panic!("{response}: unexpected {other:?}"),
        }
    }
    // Raw outputs are kept for audit, including the rejected ones.
    let garbage = &results[6].verdict;
    assert_eq!(garbage.raw_outputs.len(), 4);
    assert!(garbage.raw_outputs[0].contains("cannot evaluate"));
    assert!(results[7]
        .verdict
        .error
        .as_deref()
        .unwrap()
        .contains("expected 6 labels, got 5"));
    assert_eq!((summary.scored, summary.unscored), (6, 4));
    let stats = client.stats();
    assert_eq!(stats.failures, 4);
    assert_eq!(stats.requests as usize, server.requests());
    assert_eq!(
        stats.requests,
        cases.iter().map(|c| c.1 as u64).sum::<u64>()
    );
    assert_eq!(stats.retries, stats.requests - cases.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_run_is_served_from_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("judge-cache.sqlite");
    let server = ScriptedServer::start(10, 0).await;
    let jobs: Vec<ScoreJob> = (0..40)
        .map(|i| {
            job(
                &format!(
                    "answer {i} [[{}]]",
                    if i % 4 == 0 {
                        "garbage-once"
                    } else {
                        "all-correct"
                    }
                ),
                4,
                ScoringMode::Binary,
            )
        })
        .collect();
    let run = || async {
        let client = Arc::new(ChatClient::new(config(vec![server.url.clone()])).unwrap());
        let cache = Arc::new(JudgeCache::open(&db).unwrap());
        let judge = OpenAiJudge::new(client, PromptSet::default(), Some(cache));
        bounded(score_jobs(
            &judge,
            &jobs,
            &LengthPenalty::disabled(),
            None,
            16,
            &|_| {},
        ))
        .await
    };
    let (first, s1) = run().await;
    let calls = server.requests();
    assert_eq!(calls, 50, "40 responses, 10 of them retried once");
    assert_eq!(s1.cached, 0);
    let (second, s2) = run().await;
    assert_eq!(server.requests(), calls, "the rerun made no HTTP call");
    assert_eq!(s2.cached, 40);
    for (a, b) in first.iter().zip(&second) {
        assert_eq!(a.score, b.score);
        assert_eq!(a.verdict.labels, b.verdict.labels);
    }
    // A different mode (or prompt, model, criteria) is a different key.
    let client = Arc::new(ChatClient::new(config(vec![server.url.clone()])).unwrap());
    let judge = OpenAiJudge::new(
        client,
        PromptSet::default(),
        Some(Arc::new(JudgeCache::open(&db).unwrap())),
    );
    let three: Vec<ScoreJob> = jobs[..3]
        .iter()
        .map(|j| ScoreJob {
            request: CriterionRequest {
                mode: ScoringMode::ThreeState,
                ..j.request.clone()
            },
            ..j.clone()
        })
        .collect();
    bounded(score_jobs(
        &judge,
        &three,
        &LengthPenalty::disabled(),
        None,
        16,
        &|_| {},
    ))
    .await;
    assert!(server.requests() > calls);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_spreads_over_urls_and_a_dead_url_costs_only_retries() {
    let good = ScriptedServer::start(10, 0).await;
    let (dead_url, accepted, _h) = dead_server().await;
    let client = Arc::new(ChatClient::new(config(vec![dead_url, good.url.clone()])).unwrap());
    let judge = OpenAiJudge::new(client.clone(), PromptSet::default(), None);
    let jobs: Vec<ScoreJob> = (0..20)
        .map(|i| job(&format!("answer {i}"), 3, ScoringMode::ThreeState))
        .collect();
    let (results, summary) = bounded(score_jobs(
        &judge,
        &jobs,
        &LengthPenalty::disabled(),
        None,
        16,
        &|_| {},
    ))
    .await;
    assert_eq!(summary.scored, 20);
    assert_eq!(good.requests(), 20);
    let dead_hits = accepted.load(Ordering::SeqCst);
    assert!(
        (8..=12).contains(&dead_hits),
        "about half the first attempts went to the dead URL: {dead_hits}"
    );
    assert_eq!(
        results.iter().filter(|r| r.verdict.attempts == 2).count(),
        dead_hits
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_is_capped_and_used() {
    let server = ScriptedServer::start(10, 40).await;
    let mut cfg = config(vec![server.url.clone()]);
    cfg.concurrency = 4;
    cfg.timeout_secs = 5.0;
    let judge = OpenAiJudge::new(
        Arc::new(ChatClient::new(cfg).unwrap()),
        PromptSet::default(),
        None,
    );
    let jobs: Vec<ScoreJob> = (0..24)
        .map(|i| job(&format!("answer {i}"), 2, ScoringMode::Binary))
        .collect();
    let (_, summary) = bounded(score_jobs(
        &judge,
        &jobs,
        &LengthPenalty::disabled(),
        None,
        64,
        &|_| {},
    ))
    .await;
    assert_eq!(summary.scored, 24);
    assert_eq!(server.state.max_in_flight.load(Ordering::SeqCst), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_carries_settings_and_the_key_from_the_environment() {
    let server = ScriptedServer::start(10, 0).await;
    std::env::set_var("CONRUB_TEST_JUDGE_KEY", "sk-test-123");
    let mut cfg = config(vec![server.url.clone()]);
    cfg.api_key_env = Some("CONRUB_TEST_JUDGE_KEY".into());
    let client = ChatClient::new(cfg).unwrap();
    assert!(
        !format!("{client:?}").contains("sk-test-123"),
        "the key is never printed"
    );
    let judge = OpenAiJudge::new(Arc::new(client), PromptSet::default(), None);
    let (r, _) = bounded(score_jobs(
        &judge,
        &[job("x", 2, ScoringMode::ThreeState)],
        &LengthPenalty::disabled(),
        None,
        1,
        &|_| {},
    ))
    .await;
    assert!(r[0].score.is_scored());
    assert_eq!(
        server.state.last_auth.lock().unwrap().as_deref(),
        Some("Bearer sk-test-123")
    );
    let body = server.state.last_body.lock().unwrap().clone().unwrap();
    assert_eq!(body["model"], "judge-model");
    assert_eq!(body["temperature"], 0.0);
    assert_eq!(body["chat_template_kwargs"]["enable_thinking"], false);
    assert_eq!(body["messages"][0]["role"], "system");
    assert!(body["messages"][1]["content"]
        .as_str()
        .unwrap()
        .contains("The response states point 1."));
    let mut missing = config(vec![server.url.clone()]);
    missing.api_key_env = Some("CONRUB_TEST_NO_SUCH_VAR".into());
    assert!(ChatClient::new(missing)
        .unwrap_err()
        .to_string()
        .contains("CONRUB_TEST_NO_SUCH_VAR is not set"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_retryable_status_fails_at_once() {
    // Nothing listens on /v2: the server answers 404, which no retry can fix.
    let server = ScriptedServer::start(10, 0).await;
    let url = server.url.replace("/v1", "/v2");
    let judge = OpenAiJudge::new(
        Arc::new(ChatClient::new(config(vec![url])).unwrap()),
        PromptSet::default(),
        None,
    );
    let (r, _) = bounded(score_jobs(
        &judge,
        &[job("x", 2, ScoringMode::ThreeState)],
        &LengthPenalty::disabled(),
        None,
        1,
        &|_| {},
    ))
    .await;
    assert_eq!(r[0].verdict.attempts, 1);
    assert!(
        r[0].verdict.error.as_deref().unwrap().contains("404"),
        "{:?}",
        r[0].verdict.error
    );
}

/// Issue 53, item 3: a user and password or an `api_key=` query in a judge URL reach the server
/// (the query after the API path, not before it) and never an error, a log or a sample file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_in_the_url_are_used_and_never_shown() {
    let server = ScriptedServer::start(10, 0).await;
    let secret = |u: &str| u.replace("http://", "http://someone:hunter2@") + "?api_key=SECRET";
    let score = |url: String| async move {
        let client = ChatClient::new(config(vec![url])).unwrap();
        assert!(!format!("{client:?}").contains("hunter2"));
        let judge = OpenAiJudge::new(Arc::new(client), PromptSet::default(), None);
        let jobs = [job("x", 2, ScoringMode::ThreeState)];
        let none = LengthPenalty::disabled();
        bounded(score_jobs(&judge, &jobs, &none, None, 1, &|_| {}))
            .await
            .0
    };
    let r = score(secret(&server.url)).await;
    assert!(r[0].score.is_scored(), "{:?}", r[0].verdict.error);
    // A 404 (the path is wrong) and a dropped connection: the errors name the server only.
    let (dead, _, _) = dead_server().await;
    for url in [secret(&server.url.replace("/v1", "/v2")), secret(&dead)] {
        let r = score(url).await;
        let error = r[0].verdict.error.clone().expect("failed");
        assert!(error.contains("127.0.0.1"), "{error}");
        for leak in ["someone", "hunter2", "SECRET", "api_key"] {
            assert!(!error.contains(leak), "{leak} in {error}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pairwise_in_both_orders() {
    let server = ScriptedServer::start(10, 0).await;
    let judge = OpenAiJudge::new(
        Arc::new(ChatClient::new(config(vec![server.url.clone()])).unwrap()),
        PromptSet::default(),
        None,
    );
    let crit = vec![
        "The response names the diagnosis.".to_string(),
        "The response gives a dose.".to_string(),
    ];
    let c = bounded(compare_both_orders(
        &judge,
        "q",
        &crit,
        "a vague answer",
        "a good answer",
    ))
    .await;
    assert_eq!(c.outcome, PairOutcome::PreferB);
    assert_eq!(c.forward.answer.as_ref().unwrap().criteria.len(), 2);
    let c = bounded(compare_both_orders(
        &judge,
        "q",
        &crit,
        "[[prefer-first]] one",
        "[[prefer-first]] two",
    ))
    .await;
    assert_eq!(c.outcome, PairOutcome::OrderFlip);
    let c = bounded(compare_both_orders(
        &judge, "q", &crit, "same one", "same two",
    ))
    .await;
    assert_eq!(c.outcome, PairOutcome::Same);
    let c = bounded(compare_both_orders(
        &judge,
        "q",
        &crit,
        "[[500]] x",
        "good y",
    ))
    .await;
    assert_eq!(c.outcome, PairOutcome::Invalid);
}
