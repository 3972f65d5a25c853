//! The demo end to end: README's main job unshrunk (the CPU demo's golden metrics, samples and
//! dashboard), and the shrunk demo on wgpu with its kernel cache. Their own module, named to
//! sort early: the test runner starts tests in name order, and these, the longest of the binary,
//! should start first and run beside the many short ones instead of after them.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::tfevents;
use crate::train::{jsonl, lines, root};
#[cfg(feature = "wgpu")]
use crate::wgpu::{conrub_with_cache, metrics_lines};

/// Fields of a metrics line that measure time, not training: left out of golden comparisons.
fn is_timing(key: &str) -> bool {
    key.contains("_secs") || key == "judge_latency_ms"
}

/// The line without its timing fields.
pub(crate) fn untimed(mut line: serde_json::Value) -> serde_json::Value {
    if let Some(m) = line.as_object_mut() {
        m.retain(|k, _| !is_timing(k));
    }
    line
}

/// README's main job, unshrunk. On a CPU profile that has a golden (`tests/golden/demo-cpu/`,
/// named by [`cpu_profile::key`]) it writes exactly that golden's metrics, timings aside. The
/// numbers depend on the CPU (see `cpu_profile.rs`), so on another profile the run is compared
/// with a golden in what does not: the same lines, kinds, steps, epochs, fields, group counts
/// and rates; a notice on stderr names the profile, `CONRUB_REQUIRE_GOLDEN=1` makes it a
/// failure, and `CONRUB_RECORD_GOLDEN=1` writes this profile's golden from the run.
#[test]
fn the_demo_writes_its_golden_metrics() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("demo");
    let args = [
        "train".to_string(),
        "--config".into(),
        root().join("configs/demo-cpu.toml").display().to_string(),
        "--set".into(),
        format!("run.output_dir=\"{}\"", out.display()),
    ];
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(&args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "conrub {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let read = |p: &Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .map(|l| untimed(serde_json::from_str(l).unwrap()))
            .collect()
    };
    let profile = crate::cpu_profile::key();
    let goldens = root().join("tests/golden/demo-cpu");
    let golden = goldens.join(format!("{profile}.jsonl"));
    if std::env::var_os("CONRUB_RECORD_GOLDEN").is_some() {
        std::fs::copy(out.join("metrics.jsonl"), &golden).unwrap();
    }
    let got = read(&out.join("metrics.jsonl"));
    if golden.exists() {
        let want = read(&golden);
        assert_eq!(got.len(), want.len(), "metrics lines");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g,
                w,
                "metrics.jsonl line {} differs from {}",
                i + 1,
                golden.display()
            );
        }
    } else {
        let known = golden_files(&goldens);
        assert!(
            std::env::var_os("CONRUB_REQUIRE_GOLDEN").is_none(),
            "no golden for this CPU profile, {profile} (CONRUB_REQUIRE_GOLDEN is set); known: {known:?}"
        );
        eprintln!(
            "NOTICE: no golden for this CPU profile, {profile}: the demo's numbers depend on \
             the CPU, so its metrics were compared with {} in their shape only (lines, steps, \
             fields, counts, rates); CONRUB_RECORD_GOLDEN=1 records this profile's",
            known[0].display()
        );
        same_shape(&got, &read(&known[0]));
    }
    demo_samples_agree_with_the_metrics(&out, &got);
    dashboard_holds_every_scalar(&out);
}

/// The goldens of `dir`, sorted (at least one).
fn golden_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no golden in {}", dir.display());
    files
}

/// `got` has `want`'s lines in what the CPU does not change: each line's kind, fields, step and
/// epoch, the groups and responses a step scored, its rate, and every reward a finite mean in
/// [-1, 1].
fn same_shape(got: &[serde_json::Value], want: &[serde_json::Value]) {
    assert_eq!(got.len(), want.len(), "metrics lines");
    let keys =
        |v: &serde_json::Value| -> Vec<String> { v.as_object().unwrap().keys().cloned().collect() };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let at = format!("metrics.jsonl line {}", i + 1);
        assert_eq!(keys(g), keys(w), "{at}: fields");
        for field in ["kind", "step", "epoch", "steps", "lr", "responses"] {
            assert_eq!(g.get(field), w.get(field), "{at}: {field}");
        }
        assert_eq!(g["ties"]["groups"], w["ties"]["groups"], "{at}: groups");
        if let Some(r) = g.get("reward_mean").and_then(|r| r.as_f64()) {
            assert!(
                r.is_finite() && (-1.0..=1.0).contains(&r),
                "{at}: reward {r}"
            );
        }
    }
}

/// The numeric leaves of a JSON value under `prefix`, nested names joined by `/`.
fn numeric_leaves(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, f64)>) {
    match v {
        serde_json::Value::Number(n) => out.push((prefix.to_string(), n.as_f64().unwrap())),
        serde_json::Value::Bool(b) => out.push((prefix.to_string(), *b as u8 as f64)),
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                numeric_leaves(&format!("{prefix}/{k}"), v, out);
            }
        }
        _ => {}
    }
}

/// The run's one TensorBoard event file, read by the tests' own reader, holds every number of
/// every step line (as a 32-bit `simple_value`, at the steps done), each step's reward
/// histogram of all 64 rewards and its first group as text.
fn dashboard_holds_every_scalar(out: &Path) {
    let files = tfevents::files(out);
    assert_eq!(files.len(), 1, "{files:?}");
    let events = tfevents::read(&files[0]);
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    assert!(
        events.iter().all(|e| e.wall_time > 1.6e9),
        "wall times are Unix seconds"
    );
    let at =
        |step: i64| -> Vec<&tfevents::Event> { events.iter().filter(|e| e.step == step).collect() };
    for line in lines(out, "step") {
        let done = line["step"].as_i64().unwrap() + 1;
        let mut line = line.clone();
        let m = line.as_object_mut().unwrap();
        m.remove("kind");
        m.remove("epoch");
        let mut want = Vec::new();
        numeric_leaves("train", &line, &mut want);
        assert!(want.len() > 40, "{want:?}");
        let here = at(done);
        let scalars: std::collections::HashMap<&str, f32> = here
            .iter()
            .flat_map(|e| e.scalars.iter().map(|(t, v)| (t.as_str(), *v)))
            .collect();
        for (tag, x) in &want {
            assert_eq!(
                scalars.get(tag.as_str()),
                Some(&(*x as f32)),
                "step {done}: {tag}"
            );
        }
        let histogram = here
            .iter()
            .flat_map(|e| &e.histograms)
            .find(|(t, _)| t == "train/reward")
            .expect("a reward histogram");
        assert_eq!(histogram.1.iter().sum::<f64>(), 64.0);
        assert!(here
            .iter()
            .flat_map(|e| &e.texts)
            .any(|(t, text)| t == "samples/first_group" && text.contains("=== step ")));
    }
}

/// Every step of the demo wrote each of its 8 groups to `samples/step-NNNNNN.jsonl`: rewards,
/// finish reasons, token counts and tie counts add up to the step's metrics line, and
/// `conrub samples` prints a step for reading.
fn demo_samples_agree_with_the_metrics(out: &Path, metrics: &[serde_json::Value]) {
    for m in metrics.iter().filter(|m| m["kind"] == "step") {
        let step = m["step"].as_u64().unwrap();
        let groups = jsonl(&out.join(format!("samples/step-{step:06}.jsonl")));
        assert_eq!(groups.len(), 8, "step {step}");
        let responses: Vec<&serde_json::Value> = groups
            .iter()
            .flat_map(|g| g["responses"].as_array().unwrap())
            .collect();
        assert_eq!(responses.len(), 64);
        let rewards: Vec<f64> = responses
            .iter()
            .map(|r| r["reward"].as_f64().unwrap())
            .collect();
        let mean = rewards.iter().sum::<f64>() / 64.0;
        assert!(
            (mean - m["reward_mean"].as_f64().unwrap()).abs() < 1e-12,
            "step {step}"
        );
        let truncated = responses
            .iter()
            .filter(|r| r["finish_reason"] == "length")
            .count();
        assert_eq!(
            truncated as u64,
            m["truncated"].as_u64().unwrap(),
            "step {step}"
        );
        let tokens: u64 = responses
            .iter()
            .map(|r| r["tokens"].as_u64().unwrap())
            .sum();
        assert_eq!(
            tokens,
            m["response_tokens"].as_u64().unwrap(),
            "step {step}"
        );
        let tied = groups
            .iter()
            .filter(|g| g["tie_status"] != "not_tied")
            .count();
        assert_eq!(
            tied as u64,
            m["ties"]["tied_groups"].as_u64().unwrap(),
            "step {step}"
        );
        for g in &groups {
            assert!(g["prompt_id"].is_string() && g["prompt"].is_string(), "{g}");
            let criteria = g["criteria"].as_array().unwrap().len();
            for r in g["responses"].as_array().unwrap() {
                assert_eq!(r["score"]["labels"].as_array().unwrap().len(), criteria);
                assert!(r["advantage"].is_f64() && r["text"].is_string(), "{r}");
            }
        }
    }
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args([
            "samples",
            out.to_str().unwrap(),
            "--step",
            "11",
            "--group",
            "2",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.starts_with("=== step 11 · group 2 · "), "{text}");
    assert_eq!(text.matches("  --- #").count(), 8, "{text}");
}

/// The shrunk demo on wgpu at the full 151,936-token vocabulary (the real tokenizer):
/// `kernels-warmup` on a cold kernel cache compiles and autotunes (its step, then its walk
/// through the run's other shapes), and then `train` on the same `--kernel-cache` (its second
/// process) compiles and autotunes nothing in any of its three steps, whose response lengths
/// differ from the warm-up's (issue 53's item 18 reproduced with two prompts a step), runs no
/// warm-up of its own (the cache is warm), loads its kernels from the cache, and reports the
/// device memory its pools hold.
#[cfg(feature = "wgpu")]
#[test]
fn a_demo_on_wgpu_compiles_once_and_keeps_its_kernels() {
    if !conrub_kernels::wgpu_adapter_or_skip("a_demo_on_wgpu_compiles_once_and_keeps_its_kernels") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("kernels");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/demo-cpu.toml");
    let config = config.to_str().unwrap();
    // One prompt a step, another each step: later steps meet prompt lengths (prefills, decode
    // blocks, micro-batch widths) the warm-up's own step did not, so they load kernels only its
    // walk compiled. Groups of two short responses keep the walk's classes (and lavapipe's
    // compile time, about 5 minutes on 2 cores) small; the classes themselves are the unit
    // tests' (`the_engine_walk_reaches_every_class_a_call_can`,
    // `the_warm_up_walks_every_class_of_micro_batch_the_planner_cuts`).
    let shrink = [
        "--set",
        "run.max_steps=3",
        "--set",
        "run.prompts_per_step=1",
        "--set",
        "warmup.steps=2",
        "--set",
        "learner.group_size=2",
        "--set",
        "learner.max_response_tokens=4",
    ];
    let warmup = [
        &["kernels-warmup", "--config", config, "--device", "wgpu"][..],
        &shrink[..],
    ]
    .concat();
    let log = conrub_with_cache(&cache, &warmup, None);
    let compiled: u64 = log
        .lines()
        .find_map(|l| {
            l.strip_prefix("kernel warm-up: ")
                .and_then(|l| l.split(": ").nth(1))
                .and_then(|l| l.split(' ').next())
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or_else(|| panic!("no warm-up summary: {log}"));
    assert!(compiled > 0, "a cold cache compiles: {log}");

    let out = dir.path().join("run");
    let out_dir = format!("run.output_dir=\"{}\"", out.display());
    let train = [
        &[
            "train", "--config", config, "--device", "wgpu", "--set", &out_dir,
        ][..],
        &shrink[..],
    ]
    .concat();
    let log = conrub_with_cache(&cache, &train, None);
    assert!(
        metrics_lines(&out, "kernel_warmup").is_empty(),
        "no warm-up on a warm cache: {log}"
    );
    let steps = metrics_lines(&out, "step");
    assert_eq!(steps.len(), 3);
    for s in &steps {
        assert_eq!(s["kernel_compiles"], 0, "{s}");
        assert_eq!(s["autotune_runs"], 0, "{s}");
        // The device memory the backend's pools hold, one entry per rank (CubeCL reports it).
        let memory = s["device_memory_reserved_bytes"]
            .as_array()
            .expect("reported on wgpu");
        assert!(memory.len() == 1 && memory[0].as_u64().unwrap() > 0, "{s}");
    }
    assert!(
        steps[0]["kernel_cache_loads"].as_u64().unwrap() > 0,
        "step 0 loads its kernels from the cache: {}",
        steps[0]
    );
    // A later step met shapes step 0 had not: kernels the warm-up's walk compiled.
    assert!(
        steps[1..]
            .iter()
            .any(|s| s["kernel_cache_loads"].as_u64().unwrap() > 0),
        "later steps load the walk's kernels: {steps:?}"
    );
    assert!(
        log.contains("kernels: 0 compiled (cache misses)"),
        "the run compiled nothing at all: {log}"
    );
}
