//! Consensus rubric construction at scale: 5,000 prompts against instant scripted loopback
//! servers (three generators and a reviewer, in this process), the build in a child process so
//! that its peak memory is its own. Reports prompts/s and peak RSS of a cold build (every call
//! answered over HTTP) and of a rerun (every call from the cache), next to a named baseline: the
//! same number of bare client round trips to an instant server, no pipeline, no cache.
//!
//! `cargo bench --bench construct [-- PROMPTS]`

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use conrub_construct::testing::BuildServers;
use conrub_construct::{build, BuildConfig, BuildRequest, InputFormat};
use conrub_judge::testing::{Reply, ScriptedServer};
use conrub_judge::{ChatClient, ClientConfig};

const CALLS_PER_PROMPT: usize = 8;

fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|k| k.parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// CPU seconds (user + system) this process has used (Linux, 100 ticks per second).
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = after
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    if f.len() > 12 {
        (f[11] + f[12]) / 100.0
    } else {
        f64::NAN
    }
}

fn write_prompts(path: &Path, n: usize) {
    let shared: Vec<String> = (1..=22).map(|i| format!("t{i}")).collect();
    let shared = shared.join(" ");
    let dims =
        "t1=safety t2=safety t3=safety t4=management t5=management t6=management t7=management \
                t8=practical t9=practical t10=practical t11=communication t12=communication";
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let q = format!(
                "Prompt {i}: a patient asks about condition {i}; what should they know and do?\n[[plan\n\
                 A: {shared} t23 a{i} a2\nB: {shared} t23 b1 b2 b3\nC: {shared} t23:no c1\ndims: {dims}\n]]"
            );
            serde_json::json!({"id": format!("q{i:05}"), "question": q, "reference_answer": format!("Reference answer {i}."),
                "source": if i % 10 < 7 { "rar-medicine" } else { "rubrichub-medical" }})
            .to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n")).unwrap();
}

fn child(config: &str, input: &str, out: &str) {
    let cfg = BuildConfig::from_file(Path::new(config)).unwrap();
    let req = BuildRequest {
        input: input.into(),
        format: InputFormat::Prompts,
        out_dir: out.into(),
        limit: None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let t = Instant::now();
    let s = rt.block_on(build(cfg, &req, Default::default())).unwrap();
    let secs = t.elapsed().as_secs_f64();
    let cached: u64 = s.roles.values().map(|r| r.cached).sum();
    println!(
        "RESULT {secs} {} {} {} {} {}",
        peak_rss_mb(),
        s.stats.counts.prompts,
        s.stats.records,
        cached,
        cpu_secs()
    );
}

fn child_baseline(url: &str, calls: usize, concurrency: usize) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut cfg = ClientConfig::new(url, "floor");
    cfg.concurrency = concurrency;
    let client = Arc::new(ChatClient::new(cfg).unwrap());
    let t = Instant::now();
    rt.block_on(async {
        use futures::StreamExt;
        let user = "x".repeat(1500);
        futures::stream::iter(0..calls)
            .map(|_| {
                let c = client.clone();
                let user = user.clone();
                async move {
                    c.chat_parsed("system", &user, |t| {
                        Ok::<_, conrub_judge::OutputError>(t.len())
                    })
                    .await
                    .result
                    .unwrap()
                }
            })
            .buffer_unordered(concurrency)
            .collect::<Vec<_>>()
            .await
    });
    println!(
        "RESULT {} {} {calls} 0 0 {}",
        t.elapsed().as_secs_f64(),
        peak_rss_mb(),
        cpu_secs()
    );
}

type Run = (f64, f64, u64, u64, u64, f64);

fn run_child(args: &[&str]) -> Run {
    let out = Command::new(std::env::current_exe().unwrap())
        .arg("--child")
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("RESULT "))
        .unwrap_or_else(|| panic!("child failed: {}", String::from_utf8_lossy(&out.stderr)));
    let f: Vec<&str> = line.split_whitespace().collect();
    (
        f[1].parse().unwrap(),
        f[2].parse().unwrap(),
        f[3].parse().unwrap(),
        f[4].parse().unwrap(),
        f[5].parse().unwrap(),
        f[6].parse().unwrap(),
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        match args[i + 1].as_str() {
            "build" => child(&args[i + 2], &args[i + 3], &args[i + 4]),
            _ => child_baseline(
                &args[i + 2],
                args[i + 3].parse().unwrap(),
                args[i + 4].parse().unwrap(),
            ),
        }
        return;
    }
    let n: usize = args
        .iter()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("prompts.jsonl");
    write_prompts(&input, n);
    let servers = rt.block_on(BuildServers::start(0));
    let floor = rt.block_on(ScriptedServer::with_script(|_| {
        Reply::Text("{\"criteria\": [\"The response a b c d.\"]}".into())
    }));
    let config = dir.path().join("build.toml");
    let concurrency = 64;
    let toml = servers
        .config_toml(120.0, "[build]\nprompt_concurrency = 256\n")
        .replace("concurrency = 32", &format!("concurrency = {concurrency}"));
    std::fs::write(&config, toml).unwrap();
    let out = dir.path().join("out");
    let (c, i, o) = (
        config.display().to_string(),
        input.display().to_string(),
        out.display().to_string(),
    );

    println!("rubrics build: {n} prompts, {CALLS_PER_PROMPT} calls each, instant loopback servers, endpoint concurrency {concurrency}");
    let cold = run_child(&["build", &c, &i, &o]);
    let answered = servers.answered();
    let warm = run_child(&["build", &c, &i, &o]);
    let floor_run = run_child(&[
        "baseline",
        &floor.url,
        &(n * CALLS_PER_PROMPT).to_string(),
        &(4 * concurrency).to_string(),
    ]);
    println!(
        "{:<34} {:>9} {:>11} {:>12} {:>10} {:>12}",
        "run", "seconds", "prompts/s", "calls/s", "peak RSS", "CPU seconds"
    );
    let row = |name: &str, (s, m, _, _, _, cpu): Run| {
        println!(
            "{name:<34} {s:>9.2} {:>11.0} {:>12.0} {m:>7.0} MB {cpu:>12.2}",
            n as f64 / s,
            (n * CALLS_PER_PROMPT) as f64 / s
        );
    };
    row("cold build (all calls over HTTP)", cold);
    row("rerun (all calls from the cache)", warm);
    row("baseline: bare client round trips", floor_run);
    println!(
        "cold build: {} prompts -> {} rubrics, {answered} requests answered; rerun: {} calls from the cache, {} new requests",
        cold.2,
        cold.3,
        warm.4,
        servers.answered() - answered
    );
    println!(
        "ratio cold build / bare round trips: {:.2}x wall, {:.2}x CPU; build CPU per prompt {:.2} ms cold ({:.2} ms per call, \
         bare round trip {:.2} ms), {:.2} ms from the cache; the servers run in the parent process and share the 2 cores",
        cold.0 / floor_run.0,
        cold.5 / floor_run.5,
        1e3 * cold.5 / n as f64,
        1e3 * cold.5 / (n * CALLS_PER_PROMPT) as f64,
        1e3 * floor_run.5 / (n * CALLS_PER_PROMPT) as f64,
        1e3 * warm.5 / n as f64
    );
}
