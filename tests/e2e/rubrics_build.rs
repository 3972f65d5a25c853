//! `conrub rubrics build` as a process: a SIGKILL in the middle of a build and a restart repeat
//! no answered call (counted at the servers) and write the same bytes as an uninterrupted build;
//! a failing endpoint makes the command exit non-zero after writing its artifacts.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use conrub_construct::testing::BuildServers;
use conrub_judge::JudgeCache;

const FILES: [&str; 6] = [
    "rubrics.jsonl",
    "raw.jsonl",
    "clusters.jsonl",
    "validation.json",
    "stats.json",
    "card.md",
];

/// Per-call timeout of every build here: far beyond any wait of the tests, so that a held request
/// is never given up (and retried, or failed) before the test kills its client.
const CALL_TIMEOUT_SECS: f64 = 900.0;

/// Only a guard against a hang: the waits below are for conditions that become true and stay true,
/// so on a slow machine they are reached later, never missed.
const WAIT_LIMIT: Duration = Duration::from_secs(600);

fn write_inputs(
    dir: &Path,
    servers: &BuildServers,
    prompts: usize,
    plan_extra: &str,
) -> (String, String) {
    let topics = "t1 t2 t3 t4 t5 t6 t7";
    let lines: Vec<String> = (0..prompts)
        .map(|i| {
            let q = format!("Prompt {i}: how is condition {i} managed?\n[[plan\nA: {topics} a{i}\nB: {topics}\nC: {topics} c1\n{plan_extra}\n]]");
            serde_json::json!({"id": format!("q{i:03}"), "question": q, "reference_answer": format!("Reference {i}."), "source": "demo"})
                .to_string()
        })
        .collect();
    let input = dir.join("prompts.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let config = dir.join("build.toml");
    std::fs::write(
        &config,
        servers.config_toml(CALL_TIMEOUT_SECS, "[build]\nprompt_concurrency = 4\n"),
    )
    .unwrap();
    (input.display().to_string(), config.display().to_string())
}

fn spawn(input: &str, config: &str, out: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args([
            "rubrics",
            "build",
            "--quiet",
            "--config",
            config,
            "--out",
            &out.display().to_string(),
            input,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("binary runs")
}

/// Polls `done` (a condition that stays true once true) until it holds; panics with `what` and the
/// state `now` describes after [`WAIT_LIMIT`].
async fn wait_until(what: &str, mut done: impl FnMut() -> bool, now: impl Fn() -> String) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < WAIT_LIMIT,
            "{what}: not reached after {WAIT_LIMIT:?} ({})",
            now()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn finish(child: Child) -> std::process::Output {
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "build failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_build_resumes_without_repeating_calls_and_writes_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();

    // An uninterrupted build on its own servers: the reference bytes and call count.
    let clean_servers = BuildServers::start(0).await;
    let (input, config) = write_inputs(dir.path(), &clean_servers, 12, "");
    let clean_out = dir.path().join("clean");
    let child = spawn(&input, &config, &clean_out);
    let out = tokio::task::spawn_blocking(move || finish(child))
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("12 prompts -> 12 rubrics"), "{text}");
    let clean_calls = clean_servers.answered();
    assert_eq!(
        clean_calls,
        12 * 8,
        "3 generations, 3 reviews, a grouping and an audit per prompt"
    );

    // The same build on fresh servers, killed once the reviewer has answered exactly 10 calls and
    // every answered call is in the cache.
    let servers = BuildServers::start(0).await;
    let crash_dir = dir.path().join("crash");
    std::fs::create_dir_all(&crash_dir).unwrap();
    let (input, config) = write_inputs(&crash_dir, &servers, 12, "");
    let out_dir = crash_dir.join("out");
    servers.reviewer.hold_after(10);
    let mut child = spawn(&input, &config, &out_dir);
    let state = || {
        let s: Vec<String> = servers
            .all()
            .iter()
            .map(|s| format!("{}/{}/{}", s.requests(), s.answered(), s.held()))
            .collect();
        format!(
            "requests/answered/held per server (generators A B C, reviewer): {}",
            s.join(" ")
        )
    };
    // The reviewer let its 10 calls through and holds the next one (the flag stays set).
    wait_until(
        "the reviewer holds a request",
        || servers.reviewer.state.holding.load(Ordering::SeqCst),
        &state,
    )
    .await;
    // From now on every server holds every new request, so answers can only come from requests
    // already let through; once none is left on any server, no answer can come before the kill.
    for g in &servers.generators {
        g.hold_after(0);
    }
    wait_until(
        "no request is being answered",
        || servers.all().iter().all(|s| s.settled()),
        &state,
    )
    .await;
    let paid_before_kill = servers.answered();
    assert_eq!(
        servers.reviewer.answered(),
        10,
        "the reviewer stops at its hold point"
    );
    // The client caches each answer after receiving it; the count only grows, up to what was paid.
    let mut cache = None;
    let cached = std::cell::Cell::new(0);
    wait_until(
        "every answered call is in the cache",
        || {
            if cache.is_none() {
                cache = JudgeCache::open(&out_dir.join("cache.sqlite")).ok();
            }
            cached.set(cache.as_ref().and_then(|c| c.len().ok()).unwrap_or(0) as usize);
            cached.get() == paid_before_kill
        },
        || format!("{paid_before_kill} answered, {} cached", cached.get()),
    )
    .await;
    drop(cache);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(
        servers.answered(),
        paid_before_kill,
        "nothing was answered after the servers settled"
    );
    assert!(
        paid_before_kill > 10 && paid_before_kill < clean_calls,
        "killed mid-run: {paid_before_kill} of {clean_calls}"
    );
    assert!(
        !out_dir.join("rubrics.jsonl").exists(),
        "nothing is written before the end"
    );

    // Restart: the held requests are refused unanswered (their client is gone).
    for s in servers.all() {
        s.hold_after(usize::MAX);
    }
    let child = spawn(&input, &config, &out_dir);
    let out = tokio::task::spawn_blocking(move || finish(child))
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("reviewer 60 calls (10 cached"), "{text}");
    assert_eq!(
        servers.answered(),
        clean_calls,
        "the restart paid only for what the killed run had not received"
    );
    for s in servers.all() {
        assert_eq!(s.max_repeats(), 1, "a request body was answered twice");
    }
    for f in FILES {
        assert_eq!(
            std::fs::read(out_dir.join(f)).unwrap(),
            std::fs::read(clean_out.join(f)).unwrap(),
            "{f} differs"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_calls_exit_non_zero_after_writing_the_artifacts() {
    let dir = tempfile::tempdir().unwrap();
    let servers = BuildServers::start(0).await;
    let (input, config) = write_inputs(dir.path(), &servers, 2, "B!: fail");
    let out_dir = dir.path().join("out");
    let child = spawn(&input, &config, &out_dir);
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("2 prompts stopped on failed model calls")
            && err.contains("run the same command again"),
        "{err}"
    );
    for f in FILES.iter().chain(&["manifest.json"]) {
        assert!(out_dir.join(f).exists(), "{f} missing");
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args([
            "rubrics", "build", "--config", &config, "--out", "x", "--format", "parquet", &input,
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr)
        .contains("format: `parquet` is not a known input format"));
}
