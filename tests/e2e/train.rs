//! `conrub train` end to end on the CPU demo config (shrunk with `--set`): metrics and plots are
//! written, a resumed run continues bit-identically, and the exported Hugging Face directory reloads
//! through our loader with the trained weights.

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::backend::Flex;
use burn::module::Module;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use conrub_models::{CausalLm, ForwardBatch, Pretrained};

use crate::demo::untimed;

pub(crate) fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The arguments of a shrunk demo run into `out`, then `extra`.
fn train_args(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "train".into(),
        "--config".into(),
        root().join("configs/demo-cpu.toml").display().to_string(),
    ];
    for s in [
        format!("run.output_dir=\"{}\"", out.display()),
        "learner.group_size=4".into(),
        "learner.max_response_tokens=12".into(),
        "reward.length_buffer_tokens=4".into(),
        "run.prompts_per_step=4".into(),
        "run.checkpoint_every=2".into(),
        "warmup.steps=2".into(),
    ] {
        args.push("--set".into());
        args.push(s);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn train(out: &Path, extra: &[&str]) -> String {
    let args = train_args(out, extra);
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(&args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "conrub {args:?}: {err}");
    err
}

pub(crate) fn lines(out: &Path, kind: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == kind)
        .collect()
}

fn steps(out: &Path) -> Vec<serde_json::Value> {
    lines(out, "step")
}

/// Every line of a JSONL file.
pub(crate) fn jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .collect()
}

#[test]
fn train_resume_and_export() {
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight");
    let log = train(&straight, &["--set", "run.max_steps=4"]);
    assert!(
        log.contains("step 4/4") && log.contains("warm-up: 2 steps"),
        "{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.starts_with("warm-up: 1/2 steps, loss ") && l.contains(", ETA ")),
        "warm-up shows progress with an ETA: {log}"
    );
    let a = steps(&straight);
    assert_eq!(a.len(), 4);
    // Curves are drawn at the final checkpoint (4 points each) and again by `conrub plot`.
    let curves = [
        "reward.svg",
        "tie_rate.svg",
        "accepted_pairs.svg",
        "response_length.svg",
    ];
    let data_line = |f: &str| -> String {
        std::fs::read_to_string(straight.join(f))
            .unwrap()
            .lines()
            .find(|l| l.contains("<polyline") && l.contains("#0000FF"))
            .unwrap_or_else(|| panic!("{f}: no data line"))
            .to_string()
    };
    for f in curves {
        assert_eq!(
            data_line(f).matches(',').count(),
            4,
            "{f}: one point per step"
        );
        std::fs::remove_file(straight.join(f)).unwrap();
    }
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(["plot", straight.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let printed = String::from_utf8_lossy(&o.stdout);
    for f in curves {
        assert!(printed.contains(f), "{printed}");
        assert_eq!(data_line(f).matches(',').count(), 4, "{f} redrawn");
    }
    for key in [
        "reward_mean",
        "reward_histogram",
        "ties",
        "clip_low",
        "clip_high",
        "grad_norms",
        "truncated",
        "judge_latency_ms",
        "response_len_p90",
        "entropy",
    ] {
        assert!(a[0].get(key).is_some(), "metrics lack {key}");
    }

    // Three steps (a kill after step 3: its step line and a partial summary of epoch 1 are
    // written), then resume from the step-2 checkpoint for the next two.
    let split = dir.path().join("split");
    train(&split, &["--set", "run.max_steps=3"]);
    assert_eq!(
        lines(&split, "epoch").len(),
        2,
        "epoch 0 and the partial epoch 1"
    );
    let ckpt: PathBuf = split.join("checkpoint-000002");
    assert!(
        ckpt.join("model.safetensors").exists() && ckpt.join("training_state/state.json").exists()
    );
    // The resumed run exports in f32, sharded at 16 MB (the demo's 151,936 x 64 tied embedding
    // alone is 39 MB: a shard of its own).
    train(
        &split,
        &[
            "--set",
            "run.max_steps=4",
            "--set",
            "model.save_dtype=\"f32\"",
            "--set",
            "model.max_shard_size=\"16MB\"",
            "--resume",
            ckpt.to_str().unwrap(),
        ],
    );
    let b = steps(&split);
    assert_eq!(
        b.len(),
        4,
        "no duplicate or missing step lines after resume"
    );
    assert_eq!(
        lines(&split, "epoch"),
        lines(&straight, "epoch"),
        "one summary per epoch, as in the straight run"
    );
    for (x, y) in a.iter().zip(&b) {
        for key in [
            "reward_mean",
            "loss",
            "grad_norms",
            "response_len_mean",
            "clip_low",
            "clip_high",
        ] {
            assert_eq!(x[key], y[key], "step {}: {key}", x["step"]);
        }
    }
    // Issue 53, item 14: another folder's checkpoint, resumed into a fresh output_dir (no
    // metrics.jsonl there), continues the same run: its step 2 is the straight run's.
    let elsewhere = dir.path().join("elsewhere");
    let resume = [
        "--set",
        "run.max_steps=3",
        "--resume",
        ckpt.to_str().unwrap(),
    ];
    let log = train(&elsewhere, &resume);
    assert!(
        log.contains("the metrics of the 2 steps before the resume"),
        "{log}"
    );
    let c = steps(&elsewhere);
    assert_eq!(c.len(), 1, "{c:?}");
    assert_eq!(
        (&c[0]["step"], &c[0]["loss"]),
        (&a[2]["step"], &a[2]["loss"])
    );

    // Exports are bf16 in one file unless told otherwise.
    let default_export = straight.join("checkpoint-000004");
    let bytes = std::fs::read(default_export.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, emb) = st
        .tensors()
        .into_iter()
        .find(|(n, _)| n == "model.embed_tokens.weight")
        .unwrap();
    assert_eq!(emb.dtype(), safetensors::Dtype::BF16);
    // The exported HF directory (f32, sharded with an index) holds exactly the trained policy.
    let last = split.join("checkpoint-000004");
    assert!(!last.join("model.safetensors").exists());
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(last.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shards: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(shards.len() >= 2, "{shards:?}");
    let on_disk: u64 = shards
        .iter()
        .map(|s| std::fs::metadata(last.join(s)).unwrap().len())
        .sum();
    assert!(on_disk >= index["metadata"]["total_size"].as_u64().unwrap());
    let dev = Default::default();
    let hf = Pretrained::<Flex>::load_dir(&last, &dev).unwrap();
    let state = CausalLm::<Flex>::random(&hf.config, 0.02, 77, &dev)
        .load_file(
            last.join("training_state/policy"),
            &NamedMpkFileRecorder::<FullPrecisionSettings>::new(),
            &dev,
        )
        .unwrap();
    let ids = vec![vec![151644u32, 872, 198, 3838, 374, 264, 3092, 30]];
    let batch = ForwardBatch::contiguous(&ids, 0, &dev);
    let x: Vec<f32> = hf
        .model
        .forward(&batch)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap();
    let y: Vec<f32> = state
        .forward(&batch)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap();
    assert_eq!(x, y, "identical logits");

    // `conrub eval` takes the checkpoint folder as the model and names its step.
    let out = dir.path().join("eval");
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args([
            "eval",
            "mcq",
            "--format",
            "medmcqa",
            "--max-new-tokens",
            "4",
        ])
        .arg("--data")
        .arg(root().join("data/samples/eval/medmcqa.jsonl"))
        .arg("--model")
        .arg(&last)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["model"]["checkpoint_step"], 4);
    assert_eq!(report["summary"]["n"], 3);
}

/// The shrunk demo on a tiny random Llama and a tiny random Qwen2 (`model.random.family`): two
/// steps, a Hugging Face export of the family's layout, and the export reloads through the family
/// registry with the trained weights.
#[test]
fn llama_and_qwen2_train_export_and_reload() {
    use conrub_models::Family;
    for (family, arch, norms, biases) in [
        (Family::Llama, "LlamaForCausalLM", false, false),
        (Family::Qwen2, "Qwen2ForCausalLM", false, true),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join(family.model_type());
        // With a stop string ("e", frequent in the random model's text): no response the
        // judges read holds it, and the cut ones end with finish reason `stop`.
        let log = train(
            &out,
            &[
                "--set",
                &format!("model.random.family=\"{family}\""),
                "--set",
                "run.max_steps=2",
                "--set",
                "learner.stop=[\"e\"]",
            ],
        );
        assert!(log.contains("step 2/2"), "{family}: {log}");
        assert_eq!(steps(&out).len(), 2, "{family}");
        let responses: Vec<serde_json::Value> = (0..2)
            .flat_map(|s| jsonl(&out.join(format!("samples/step-{s:06}.jsonl"))))
            .flat_map(|g| g["responses"].as_array().unwrap().clone())
            .collect();
        assert_eq!(responses.len(), 32);
        assert!(responses
            .iter()
            .all(|r| !r["text"].as_str().unwrap().contains('e')));
        assert!(
            responses.iter().any(|r| r["finish_reason"] == "stop"),
            "{family}: no response was cut"
        );
        let export = out.join("checkpoint-000002");
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(export.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["model_type"], family.model_type());
        assert_eq!(config["architectures"][0], arch);
        let bytes = std::fs::read(export.join("model.safetensors")).unwrap();
        let names: Vec<String> = safetensors::SafeTensors::deserialize(&bytes)
            .unwrap()
            .names()
            .into_iter()
            .map(String::from)
            .collect();
        let has = |suffix: &str| names.iter().any(|n| n.ends_with(suffix));
        assert_eq!(has("self_attn.q_norm.weight"), norms, "{family}: {names:?}");
        assert_eq!(has("self_attn.q_proj.bias"), biases, "{family}: {names:?}");
        assert!(!has("self_attn.o_proj.bias"), "{family}");
        let reloaded = Pretrained::<Flex>::load_dir(&export, &Default::default()).unwrap();
        assert_eq!(reloaded.config.family().unwrap(), family);
        // The export holds the trained weights: they differ from the random start.
        let start: CausalLm<Flex> =
            CausalLm::random(&reloaded.config, 0.02, 0, &Default::default());
        let batch = ForwardBatch::<Flex>::contiguous(&[vec![9, 8, 7, 6]], 0, &Default::default());
        let (a, b) = (
            reloaded
                .model
                .forward(&batch)
                .into_data()
                .to_vec::<f32>()
                .unwrap(),
            start.forward(&batch).into_data().to_vec::<f32>().unwrap(),
        );
        assert!(a.iter().all(|x| x.is_finite()));
        assert_ne!(a, b, "{family}: the export is not the trained model");
    }
}

/// A rollout KV pool that holds about a quarter of a step's rows at full length: the engine
/// queues and preempts, and the run writes the same per-step rewards and lengths as with the
/// default pool (every row at once).
#[test]
fn a_tiny_kv_budget_gives_the_same_run() {
    let dir = tempfile::tempdir().unwrap();
    let (wide, tight) = (dir.path().join("wide"), dir.path().join("tight"));
    // Same block size in both runs (it sets the attended key lengths): only the budget differs.
    let longer = [
        "--set",
        "run.max_steps=2",
        "--set",
        "learner.max_response_tokens=32",
        "--set",
        "rollout.block_size=4",
    ];
    train(&wide, &longer);
    // Demo model: 2 layers x 2 KV heads x 16 x (k, v) x 4 bytes = 512 bytes a position. The 16
    // rows of a step (4 prompts of ~30-40 tokens x 4, 32 new tokens) hold ~1,100 positions at
    // full length unshared, ~650 with their prompts shared; the pool gets 68 blocks of 4 (272
    // positions, 140 KB): a quarter of the rows.
    let log = train(
        &tight,
        &[&longer[..], &["--set", "rollout.kv_cache_gb=0.00014"]].concat(),
    );
    assert!(
        log.contains("rollout KV pool: 68 blocks of 4 positions"),
        "{log}"
    );
    let (a, b) = (steps(&wide), steps(&tight));
    assert_eq!((a.len(), b.len()), (2, 2));
    for (x, y) in a.iter().zip(&b) {
        // The mean next-token entropy over the response tokens is a function of the sampled
        // tokens themselves: equal to the last digit, the responses are the same.
        for key in [
            "reward_mean",
            "reward_histogram",
            "response_len_mean",
            "response_len_max",
            "truncated",
            "response_tokens",
            "entropy",
            "loss",
            "grad_norms",
        ] {
            assert_eq!(x[key], y[key], "step {}: {key}", x["step"]);
        }
        assert_eq!(x["rollout_preemptions"], 0, "{x}");
        assert!(y["rollout_preemptions"].as_u64().unwrap() > 0, "{y}");
        assert!(y["rollout_peak_kv_blocks"].as_u64().unwrap() <= 68);
        assert!(
            y["rollout_mean_running_rows"].as_f64() < x["rollout_mean_running_rows"].as_f64(),
            "{x}\n{y}"
        );
    }
}

#[test]
fn config_errors_name_the_key_and_the_allowed_values() {
    let run = |set: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
            .args([
                "train",
                "--config",
                root().join("configs/demo-cpu.toml").to_str().unwrap(),
                "--set",
                set,
            ])
            .output()
            .unwrap();
        assert!(!o.status.success());
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let e = run("learner.lrr=0.1");
    assert!(
        e.contains("lrr") && e.contains("expected one of") && e.contains("`lr`"),
        "{e}"
    );
    let e = run("learner.tie_mode=\"sometimes\"");
    assert!(
        e.contains("sometimes") && e.contains("pairwise") && e.contains("grpo-dpo"),
        "{e}"
    );
    let e = run("learner.group_size=1");
    assert!(
        e.contains("learner.group_size: must be from 2 to 4096"),
        "{e}"
    );
    let e = run("reward.mode=\"ternary\"");
    assert!(e.contains("ternary") && e.contains("three-state"), "{e}");
    let e = run("learner.aggregation=\"token-mean\"");
    assert!(
        e.contains("token-mean") && e.contains("global-token-mean") && e.contains("dr-grpo"),
        "{e}"
    );
    // The demo's judge is lexical: `device` is a key of the local kind only.
    let e = run("judge.device=\"cuda:1\"");
    assert!(
        e.contains(
            "judge.device: not a key of kind = \"lexical\" (it belongs to kind = \"local\")"
        ),
        "{e}"
    );
}

/// The shrunk demo on libtorch's CPU device (feature `tch`, run by `scripts/test-tch.sh`): it
/// trains four steps, its losses, rewards and gradient norms are finite, and it resumes
/// bit-identically from a checkpoint like the flex run above.
#[cfg(feature = "tch")]
#[test]
fn demo_trains_on_libtorch() {
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("tch");
    let log = train(
        &straight,
        &["--set", "run.max_steps=4", "--device", "tch:cpu"],
    );
    assert!(log.contains("step 4/4"), "{log}");
    let a = steps(&straight);
    assert_eq!(a.len(), 4);
    for s in &a {
        for key in ["reward_mean", "loss"] {
            assert!(
                s[key].as_f64().is_some_and(f64::is_finite),
                "step {}: {key} = {}",
                s["step"],
                s[key]
            );
        }
        assert!(
            s["grad_norms"].as_array().is_some_and(
                |g| !g.is_empty() && g.iter().all(|x| x.as_f64().is_some_and(f64::is_finite))
            ),
            "{}",
            s["grad_norms"]
        );
    }
    let split = dir.path().join("split");
    train(&split, &["--set", "run.max_steps=2", "--device", "tch:cpu"]);
    train(
        &split,
        &[
            "--set",
            "run.max_steps=4",
            "--device",
            "tch:cpu",
            "--resume",
            split.join("checkpoint-000002").to_str().unwrap(),
        ],
    );
    for (x, y) in a.iter().zip(&steps(&split)) {
        for key in ["reward_mean", "loss", "grad_norms"] {
            assert_eq!(x[key], y[key], "step {}: {key}", x["step"]);
        }
    }
}

/// `--devices cpu,cpu`: two simulated data-parallel ranks from the command line. The first step
/// (the same weights on both) gives the one-device run's rewards and ties exactly; the metrics say
/// how many ranks ran and what the all-reduce moved; a 2-rank `full`-sharded run killed with
/// SIGKILL and resumed from its checkpoint repeats the straight 2-rank run; mixing backends is an
/// error naming both, and `full` without activation checkpointing is refused.
#[test]
fn data_parallel_ranks_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    train(&one, &["--set", "run.max_steps=1"]);
    let log = train(&two, &["--set", "run.max_steps=2", "--devices", "cpu,cpu"]);
    assert!(log.contains("data parallel: 2 ranks on cpu, cpu"), "{log}");
    let (a, b) = (steps(&one), steps(&two));
    assert_eq!(b.len(), 2);
    for key in ["reward_mean", "ties", "responses", "response_tokens"] {
        assert_eq!(a[0][key], b[0][key], "{key}");
    }
    assert_eq!(
        (a[0]["ranks"].as_u64(), b[0]["ranks"].as_u64()),
        (Some(1), Some(2))
    );
    assert!(b[0]["allreduce_bytes"].as_u64().unwrap() > 0);
    assert!(two.join("checkpoint-000002/config.json").is_file());

    // Two ranks sharding everything (`sharding = "full"`: parameters, gradients and AdamW,
    // layers gathered one at a time) under a cosine schedule with warm-up, each run after a
    // kernel warm-up on the group itself, killed with SIGKILL once step 2's checkpoint is
    // complete, then resumed with `--resume auto`: the straight run's metrics (timing aside)
    // and exported weights (assembled from both ranks), byte for byte, and every step's rate
    // the schedule's formula.
    let straight = dir.path().join("straight");
    let four = [
        "--set",
        "run.max_steps=4",
        "--devices",
        "cpu,cpu",
        "--set",
        "sharding=\"full\"",
        "--set",
        "learner.activation_checkpointing=true",
        "--kernel-warmup",
        "always",
        "--set",
        "learner.lr_schedule=\"cosine\"",
        "--set",
        "learner.lr_warmup_steps=3",
        "--set",
        "learner.min_lr_ratio=0.1",
    ];
    let log = train(&straight, &four);
    assert!(log.contains("(sharding = \"full\")"), "{log}");
    assert!(
        log.contains("1 GRPO step of 4 prompts x 4 responses on 2 ranks"),
        "{log}"
    );
    let s = steps(&straight);
    for key in ["reward_mean", "ties", "responses", "response_tokens"] {
        assert_eq!(a[0][key], s[0][key], "sharded: {key}");
    }
    for key in ["reduce_scatter_bytes", "all_gather_bytes"] {
        assert!(s[0][key].as_u64().unwrap() > 0, "sharded: {key}");
    }
    let manifest = straight.join("checkpoint-000004/training_state/manifest.json");
    let manifest = std::fs::read_to_string(manifest).unwrap();
    assert!(
        manifest.contains("optimizer-rank-00001-of-00002.mpk"),
        "{manifest}"
    );
    let killed = dir.path().join("killed");
    let ckpt = killed.join("checkpoint-000002");
    let mut child = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(train_args(&killed, &four))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    // A checkpoint directory appears whole (it is renamed from `.tmp` when complete).
    while !ckpt.is_dir() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before the kill"
        );
        assert!(
            started.elapsed().as_secs() < 600,
            "no checkpoint after 10 minutes"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL on Unix
    child.wait().unwrap();
    assert!(ckpt.join("training_state/state.json").is_file());
    assert!(
        !killed.join("checkpoint-000004").exists(),
        "killed too late to test anything"
    );
    let resume = [&four[..], &["--resume", "auto"]].concat();
    let log = train(&killed, &resume);
    assert!(
        log.contains(&format!(
            "--resume auto: continuing from {}",
            ckpt.display()
        )),
        "{log}"
    );
    let (x, y) = (steps(&straight), steps(&killed));
    assert_eq!((x.len(), y.len()), (4, 4));
    for (x, y) in x.iter().zip(&y) {
        for key in [
            "reward_mean",
            "loss",
            "grad_norms",
            "response_tokens",
            "ties",
            "lr",
        ] {
            assert_eq!(x[key], y[key], "step {}: {key}", x["step"]);
        }
    }
    // The demo's lr 0.002 over 4 steps x 2 mini-batches = 8 optimizer steps, 3 of warm-up, then
    // half a cosine to 0.1 x lr at the last (k = 7); a step logs the rate of its last optimizer
    // step.
    let rate = |k: u64| {
        if k < 3 {
            return 0.002 * (k + 1) as f64 / 3.0;
        }
        let p = ((k - 3) as f64 / 4.0).min(1.0);
        0.002 * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * p).cos()))
    };
    let mut taken = 0;
    for s in &y {
        taken +=
            s["optimizer_steps"].as_u64().unwrap() + s["skipped_optimizer_steps"].as_u64().unwrap();
        let lr = s["lr"].as_f64().unwrap();
        assert!(
            (lr - rate(taken - 1)).abs() < 1e-12,
            "step {}: lr {lr}, optimizer steps {taken}",
            s["step"]
        );
    }
    assert_eq!(taken, 8, "two optimizer steps a step");
    let weights = |d: &Path| std::fs::read(d.join("checkpoint-000004/model.safetensors")).unwrap();
    assert!(
        weights(&straight) == weights(&killed),
        "exported weights differ"
    );

    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(["train", "--config"])
        .arg(root().join("configs/demo-cpu.toml"))
        .args(["--devices", "cpu,wgpu"])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        e.contains("devices: \"cpu\" and \"wgpu\": every rank runs on one backend"),
        "{e}"
    );
    // Parameter sharding gathers through the per-layer backward: without activation
    // checkpointing it is refused before any step, saying what to set.
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(train_args(
            &dir.path().join("full"),
            &["--devices", "cpu,cpu"],
        ))
        .args(["--set", "sharding=\"full\""])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        e.contains("sharding = \"full\"")
            && e.contains("set learner.activation_checkpointing = true"),
        "{e}"
    );
    assert!(!dir.path().join("full/metrics.jsonl").exists());
}

/// `[rollout] engine = "sglang"` against the scripted server: one weight update before the first
/// rollout and one after every step, between the steps' generate calls, each the step's exported
/// weights (checksums); the memory released and resumed around each update stage; the learner's
/// rows are the server's tokens; a failed weight update mid-run ends it with the server's error,
/// leaving the last checkpoint intact, and `--resume` syncs first and continues.
#[test]
fn sglang_rollouts_with_a_weight_update_after_every_step() {
    use conrub_remote::testing::{Event, Fault, ScriptedSglang};
    use sha2::Digest;
    let server = ScriptedSglang::start();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let urls = format!("rollout.urls=[\"{}\"]", server.url);
    let args = [
        "--set",
        "rollout.engine=\"sglang\"",
        "--set",
        &urls,
        "--set",
        "rollout.colocate=true",
        "--set",
        "model.save_dtype=\"bf16\"",
        "--set",
        "run.checkpoint_every=1",
        "--set",
        "run.max_steps=3",
    ];
    let log = train(&out, &args);
    assert!(
        log.contains(&format!("rollouts on SGLang: {}", server.url)),
        "{log}"
    );
    let events = server.state.events();
    let mut seen = Vec::new();
    let mut tokens_per_step = vec![0usize];
    for e in &events {
        match e {
            Event::Generate { version, tokens } => {
                *tokens_per_step.last_mut().unwrap() += tokens;
                seen.push(format!("generate {version}"));
            }
            Event::Update { version, .. } => {
                tokens_per_step.push(0);
                seen.push(format!("update {version}"));
            }
            Event::Release => seen.push("release".into()),
            Event::Resume => seen.push("resume".into()),
        }
    }
    seen.dedup();
    let want = [
        "update step-000000",
        "generate step-000000",
        "release",
        "resume",
        "update step-000001",
        "generate step-000001",
        "release",
        "resume",
        "update step-000002",
        "generate step-000002",
        "release",
        "resume",
        "update step-000003",
    ];
    assert_eq!(seen, want);
    let sha = |p: &Path| -> String {
        let d = sha2::Sha256::digest(std::fs::read(p).unwrap());
        d.iter().map(|b| format!("{b:02x}")).collect()
    };
    for e in &events {
        if let Event::Update { version, sha256 } = e {
            let step: u64 = version["step-".len()..].parse().unwrap();
            if step > 0 {
                let ckpt = out.join(format!("checkpoint-{step:06}/model.safetensors"));
                assert_eq!(sha256, &sha(&ckpt), "{version}");
            }
        }
    }
    let m = steps(&out);
    for (s, m) in m.iter().enumerate() {
        // The rows are the server's: their token count, and the gap to its log-prob of -ln 8.
        assert_eq!(
            m["response_tokens"].as_u64(),
            Some(tokens_per_step[s + 1] as u64)
        );
        assert!(m["rollout_logprob_diff_mean"].as_f64().unwrap() > 0.0);
        assert!(m["weight_sync_bytes"].as_u64().unwrap() > 0);
    }
    let kept = std::fs::read_dir(out.join("rollout-weights"))
        .unwrap()
        .count();
    assert_eq!(kept, 2, "two weight versions kept");

    // Two data-parallel ranks share the engine: one update per version, every group generated.
    let before = server.state.events().len();
    let two = [
        &args[..args.len() - 1],
        &["run.max_steps=2", "--devices", "cpu,cpu"],
    ]
    .concat();
    train(&dir.path().join("ranks"), &two);
    let ev = &server.state.events()[before..];
    let updates: Vec<&str> = ev
        .iter()
        .filter_map(|e| match e {
            Event::Update { version, .. } => Some(version.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(updates, ["step-000000", "step-000001", "step-000002"]);
    let generates = ev.iter().filter(|e| matches!(e, Event::Generate { .. }));
    assert_eq!(generates.count(), 8, "4 groups a step, over both ranks");
    let releases = ev.iter().filter(|e| matches!(e, Event::Release)).count();
    assert_eq!(releases, 2, "one release a step");

    // A weight update that fails after step 1: the run stops with the server's error.
    let failing = dir.path().join("failing");
    let five: Vec<&str> = args[..args.len() - 1]
        .iter()
        .copied()
        .chain(["run.max_steps=5"])
        .collect();
    let before = server.state.events().len();
    let child = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(train_args(&failing, &five))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let updated_1 = |ev: &[Event]| {
        ev.iter()
            .any(|e| matches!(e, Event::Update { version, .. } if version == "step-000001"))
    };
    while !updated_1(&server.state.events()[before..]) {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    server.state.set_fault(Some(Fault::FailUpdate));
    let o = child.wait_with_output().unwrap();
    server.state.set_fault(None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains(&format!("{}: weight update to ", server.url))
            && err.contains("out of memory"),
        "{err}"
    );
    let ckpt = failing.join("checkpoint-000001");
    assert!(ckpt.join("training_state/state.json").is_file());
    assert!(!failing.join("checkpoint-000002").exists());
    let before = server.state.events().len();
    let resume = [&five[..], &["--resume", ckpt.to_str().unwrap()]].concat();
    train(&failing, &resume);
    let first = server.state.events()[before].clone();
    assert!(
        matches!(&first, Event::Update { version, .. } if version == "step-000001"),
        "a resume syncs before its first rollout: {first:?}"
    );
    assert_eq!(steps(&failing).len(), 5);
}

/// `[eval] every = 2` on a 6-step run: three `kind = "eval"` lines after steps 2, 4 and 6, each
/// with the training judge's and the grader's scores (bootstrap deviations, label shares, length),
/// the validation chart, and `best-checkpoint.json` naming the checkpoint of the grader's best
/// round, which `run.keep_checkpoints = 1` keeps although it is not the newest. A grader that
/// always fails (a closed port) leaves the run going and its fields unscored.
#[test]
fn validation_during_training_with_a_grader() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("eval");
    // Held-out prompts: four of the sample rubrics (a real run holds out prompts it never trains
    // on; here the point is the plumbing and the scores moving).
    let data = root().join("data/samples/rubrics.jsonl");
    let data = format!("eval.data=\"{}\"", data.display());
    let common = [
        "--set",
        "run.checkpoint_every=0",
        "--set",
        "eval.every=2",
        "--set",
        &data,
        "--set",
        "eval.samples=2",
        "--set",
        "eval.decoding=\"sampled\"",
        "--set",
        "eval.limit=4",
        "--set",
        "eval.max_new_tokens=32",
    ];
    let mut args = vec![
        "--set",
        "run.max_steps=6",
        "--set",
        "run.keep_checkpoints=1",
    ];
    args.extend(common);
    // The grader: the lexical judge without a keyword file (each criterion matched by its own
    // words), so its scores differ from the training judge's.
    args.extend(["--set", "eval.grader.kind=\"lexical\""]);
    let log = train(&out, &args);
    let evals = lines(&out, "eval");
    assert_eq!(
        evals
            .iter()
            .map(|e| e["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![2, 4, 6],
        "{log}"
    );
    for e in &evals {
        assert_eq!(
            (e["prompts"].as_u64(), e["responses"].as_u64()),
            (Some(4), Some(8))
        );
        assert_eq!(e["decoding"], "sampled");
        assert!(e["response_len_mean"].as_f64().unwrap() > 0.0);
        for judge in ["training", "grader"] {
            let j = &e[judge];
            assert_eq!(
                (j["scored"].as_u64(), j["unscored"].as_u64()),
                (Some(8), Some(0))
            );
            let s = j["score"].as_f64().unwrap();
            assert!((-1.0..=1.0).contains(&s), "{j}");
            assert!(j["score_std"].as_f64().unwrap() >= 0.0);
            let shares: f64 = j["labels"]
                .as_object()
                .unwrap()
                .values()
                .map(|v| v.as_f64().unwrap())
                .sum();
            assert!((shares - 1.0).abs() < 1e-9, "{j}");
        }
    }
    eprintln!(
        "{:#?}",
        evals
            .iter()
            .map(|e| (
                e["step"].clone(),
                e["training"]["score"].clone(),
                e["grader"]["score"].clone()
            ))
            .collect::<Vec<_>>()
    );
    assert!(log.contains("eval after step 4: 4 prompts x 2"), "{log}");
    // Each round's answers with both judges' labels and scores; their mean is the round's score.
    for e in &evals {
        let step = e["step"].as_u64().unwrap();
        let answers = jsonl(&out.join(format!("samples/eval-step-{step:06}.jsonl")));
        assert_eq!(answers.len(), 8);
        for judge in ["training", "grader"] {
            let mean = answers
                .iter()
                .map(|a| a[judge]["score"].as_f64().unwrap())
                .sum::<f64>()
                / 8.0;
            let want = e[judge]["score"].as_f64().unwrap();
            assert!((mean - want).abs() < 1e-12, "{judge} {mean} vs {want}");
            for a in &answers {
                assert_eq!(
                    a[judge]["labels"].as_array().unwrap().len(),
                    a["criteria"].as_array().unwrap().len()
                );
            }
        }
        assert!(answers
            .iter()
            .all(|a| a["text"].is_string() && a["step"] == step));
    }
    let svg = std::fs::read_to_string(out.join("eval.svg")).unwrap();
    assert!(svg.contains("training judge") && svg.contains("grader"));
    // The best round (the first of equal scores) is recorded, and its checkpoint survives
    // pruning to one checkpoint.
    let best: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("best-checkpoint.json")).unwrap())
            .unwrap();
    let top = evals
        .iter()
        .map(|e| e["grader"]["score"].as_f64().unwrap())
        .fold(f64::NEG_INFINITY, f64::max);
    let first_best = evals
        .iter()
        .find(|e| e["grader"]["score"].as_f64().unwrap() == top)
        .unwrap();
    assert_eq!(best["step"], first_best["step"], "{best}");
    assert_eq!(best["grader_score"].as_f64().unwrap(), top);
    let kept: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    let best_dir = format!("checkpoint-{:06}", best["step"].as_u64().unwrap());
    assert!(kept.contains(&best_dir), "{kept:?}");
    assert!(kept.contains(&"checkpoint-000006".to_string()), "{kept:?}");
    assert!(kept.len() <= 2, "{kept:?}");
    assert!(log.contains("best checkpoint by the grader: "), "{log}");

    // A grader on a port nothing listens on: every call fails, the run goes on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("eval.grader.url=\"http://127.0.0.1:{port}/v1\"");
    let failing = dir.path().join("failing");
    let mut args = vec!["--set", "run.max_steps=2"];
    args.extend(common);
    args.extend([
        "--set",
        "eval.grader.kind=\"openai\"",
        "--set",
        "eval.grader.model=\"grader\"",
        "--set",
        &url,
        "--set",
        "eval.grader.max_retries=0",
        "--set",
        "eval.grader.timeout_secs=5",
    ]);
    let log = train(&failing, &args);
    let evals = lines(&failing, "eval");
    assert_eq!(evals.len(), 1, "{log}");
    let g = &evals[0]["grader"];
    assert!(
        g["score"].is_null() && g["scored"] == 0 && g["unscored"] == 8,
        "{g}"
    );
    assert!(g["error"].as_str().unwrap().contains("127.0.0.1"), "{g}");
    assert_eq!(evals[0]["training"]["scored"], 8);
    assert!(log.contains("grader unscored (8 of 8: "), "{log}");
    assert!(!failing.join("best-checkpoint.json").exists());
    assert_eq!(steps(&failing).len(), 2);
}

/// The kernel warm-up leaves no trace in the run: with `--kernel-warmup always` (on the CPU, where
/// `auto` never runs it) every step's rewards, loss, gradient norms, lengths and tie counts equal
/// those of the same run without it, bit for bit, and the metrics file opens with one
/// `kernel_warmup` line saying what ran.
#[test]
fn kernel_warmup_leaves_the_run_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let (plain, warmed) = (dir.path().join("plain"), dir.path().join("warmed"));
    train(&plain, &["--set", "run.max_steps=2"]);
    let log = train(
        &warmed,
        &["--set", "run.max_steps=2", "--kernel-warmup", "always"],
    );
    assert!(
        log.contains("kernel warm-up: 2 supervised steps of 4 answers, 1 GRPO step of 4 prompts x 4 responses in "),
        "{log}"
    );
    assert!(lines(&plain, "kernel_warmup").is_empty());
    let w = lines(&warmed, "kernel_warmup");
    assert_eq!(w.len(), 1);
    assert_eq!(w[0]["resumed"], false);
    let first = std::fs::read_to_string(warmed.join("metrics.jsonl")).unwrap();
    assert!(first.starts_with("{\"kind\":\"kernel_warmup\""), "{first}");
    let keys = [
        "reward_mean",
        "loss",
        "grad_norms",
        "response_len_mean",
        "reward_histogram",
        "ties",
        "clip_low",
        "clip_high",
        "entropy",
    ];
    let (a, b) = (steps(&plain), steps(&warmed));
    assert_eq!(a.len(), 2);
    assert_eq!(b.len(), 2);
    for (x, y) in a.iter().zip(&b) {
        for k in keys {
            assert_eq!(x[k], y[k], "step {}: {k}", x["step"]);
        }
    }
}

/// Every file under `dir` with its bytes, by path relative to `dir`.
fn files(dir: &Path) -> std::collections::BTreeMap<PathBuf, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_path_buf();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// A run folder belongs to one run: a fresh run into a folder holding an earlier run is refused
/// before anything is written (the earlier metrics and checkpoints stay byte for byte, pruning
/// included), a folder locked by a live process is refused naming it, a lock left by a process
/// that no longer runs is taken over, and `--overwrite` starts over.
#[test]
fn run_folders_are_owned() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    train(
        &out,
        &[
            "--set",
            "run.max_steps=2",
            "--set",
            "run.checkpoint_every=1",
        ],
    );
    let before = files(&out);
    assert!(before.keys().any(|p| p.starts_with("checkpoint-000001")));
    let rerun = |extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
            .args(train_args(&out, extra))
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (ok, err) = rerun(&[
        "--set",
        "run.max_steps=1",
        "--set",
        "run.keep_checkpoints=1",
    ]);
    assert!(!ok, "{err}");
    assert!(
        err.contains("holds an earlier run (checkpoint-000001, checkpoint-000002, metrics.jsonl, samples, tensorboard)")
            && err.contains("--resume")
            && err.contains("--overwrite"),
        "{err}"
    );
    assert_eq!(files(&out), before, "nothing of the earlier run changed");

    // Locked by a live process (this test's): refused, naming it.
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into());
    let lock = |pid: u32| {
        std::fs::write(
            out.join("run.lock"),
            serde_json::json!({ "pid": pid, "host": host }).to_string(),
        )
        .unwrap()
    };
    lock(std::process::id());
    let (ok, err) = rerun(&["--resume", out.join("checkpoint-000002").to_str().unwrap()]);
    assert!(!ok);
    assert!(
        err.contains(&format!(
            "in use by process {} on {host}",
            std::process::id()
        )),
        "{err}"
    );

    // A lock of a process that no longer runs is taken over; --overwrite starts over.
    lock(4_194_305);
    // (More prompts per step than records: every step takes all of them, and says so.)
    let (ok, err) = rerun(&[
        "--set",
        "run.max_steps=1",
        "--set",
        "run.prompts_per_step=1000",
        "--overwrite",
    ]);
    assert!(ok, "{err}");
    assert!(
        err.contains("taking over the lock of process 4194305"),
        "{err}"
    );
    assert!(
        err.contains("warning: run.prompts_per_step = 1000 but there are "),
        "{err}"
    );
    assert_eq!(steps(&out).len(), 1);
    assert!(!out.join("checkpoint-000002").exists());
    assert!(!out.join("run.lock").exists(), "released at the end");
}

/// Training that goes non-finite stops loudly before it is saved: a warm-up whose loss overflows
/// stops at that warm-up step (no checkpoint), and an infinite learning rate is refused by the
/// config check. (A GRPO step whose gradients are not finite: `models/tests/learner.rs`.)
#[test]
fn nonfinite_training_stops_before_it_is_saved() {
    let dir = tempfile::tempdir().unwrap();
    let run = |out: &Path, extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
            .args(train_args(out, extra))
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let checkpoints = |out: &Path| -> Vec<String> {
        let mut c: Vec<String> = std::fs::read_dir(out)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("checkpoint-"))
                    .collect()
            })
            .unwrap_or_default();
        c.sort();
        c
    };

    let out = dir.path().join("warm-up");
    let (ok, err) = run(
        &out,
        &[
            "--set",
            "warmup.lr=1e30",
            "--set",
            "warmup.steps=8",
            "--set",
            "run.max_steps=2",
        ],
    );
    assert!(!ok, "{err}");
    assert!(
        err.contains("warm-up step ") && err.contains("the supervised loss is"),
        "{err}"
    );
    assert!(checkpoints(&out).is_empty());

    let (ok, err) = run(&dir.path().join("inf"), &["--set", "learner.lr=inf"]);
    assert!(!ok);
    assert!(
        err.contains("learner.lr: must be a finite number > 0"),
        "{err}"
    );
}

/// A judge that answers nothing (a closed port): every response is unscored, so no step updates
/// the policy, and the third such step in a row stops the run (non-zero) with the judge's error.
#[test]
fn a_dead_judge_stops_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let judge = format!(
        "judge={{ kind = \"openai\", url = \"http://127.0.0.1:{port}/v1\", model = \"m\", max_retries = 0, timeout_secs = 5.0 }}"
    );
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(train_args(
            &out,
            &["--set", &judge, "--set", "run.max_steps=6"],
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("step 2: 3 steps in a row scored less than reward.min_scored_share = 0.5")
            && err.contains("the judge's last error: "),
        "{err}"
    );
    let s = steps(&out);
    assert_eq!(s.len(), 2, "{err}");
    for x in &s {
        assert_eq!(
            (x["scored"].as_u64(), x["optimizer_steps"].as_u64()),
            (Some(0), Some(0))
        );
    }
}

/// `--resume` checks what it reads: a flipped byte in each state file, a truncated optimizer
/// file, a folder that is not a checkpoint, a checkpoint of another model (intermediate size,
/// layer count) and a changed `group_size` each fail, naming the cause, before anything trains;
/// the untouched checkpoint then resumes.
#[test]
fn resume_checks_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    train(&out, &["--set", "run.max_steps=2"]);
    let ckpt = out.join("checkpoint-000002");
    let state = ckpt.join("training_state");
    let resume = |extra: &[&str]| {
        let mut args = vec![
            "--set",
            "run.max_steps=3",
            "--resume",
            ckpt.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
            .args(train_args(&out, &args))
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let expect = |extra: &[&str], needle: &str| {
        let (ok, err) = resume(extra);
        assert!(!ok, "{extra:?} should fail: {err}");
        assert!(
            err.contains(needle),
            "{extra:?}: wanted {needle:?} in {err}"
        );
        assert_eq!(steps(&out).len(), 2, "nothing trained: {err}");
    };
    for file in ["policy.mpk", "optimizer.mpk"] {
        let path = state.join(file);
        let good = std::fs::read(&path).unwrap();
        let mut bad = good.clone();
        let at = bad.len() / 2;
        bad[at] ^= 0x40;
        std::fs::write(&path, &bad).unwrap();
        expect(
            &[],
            &format!("corrupted: {file} does not match the SHA-256 its manifest recorded"),
        );
        if file == "optimizer.mpk" {
            std::fs::write(&path, &good[..good.len() - 100]).unwrap();
            expect(
                &[],
                &format!("corrupted: {file} is {} bytes", good.len() - 100),
            );
        }
        std::fs::write(&path, &good).unwrap();
    }
    let (ok, err) = {
        let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
            .args(train_args(
                &out,
                &[
                    "--set",
                    "run.max_steps=3",
                    "--resume",
                    out.to_str().unwrap(),
                ],
            ))
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    assert!(!ok && err.contains("not a checkpoint"), "{err}");
    expect(
        &["--set", "model.random.intermediate_size=96"],
        "another model: ",
    );
    expect(
        &["--set", "model.random.num_hidden_layers=3"],
        "another model: the checkpoint's policy has ",
    );
    expect(
        &["--set", "learner.group_size=2"],
        "learner.group_size was 4 for this run, now 2",
    );
    let (ok, err) = resume(&[]);
    assert!(ok, "{err}");
    assert_eq!(steps(&out).len(), 3);
}

/// `train` refuses rubric records that `conrub rubrics validate` rejects (here a duplicate id),
/// naming file and line, before anything loads.
#[test]
fn train_refuses_what_rubrics_validate_rejects() {
    let dir = tempfile::tempdir().unwrap();
    let sample = std::fs::read_to_string(root().join("data/samples/rubrics.jsonl")).unwrap();
    let mut lines: Vec<serde_json::Value> = sample
        .lines()
        .take(2)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    lines[1]["id"] = lines[0]["id"].clone();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
    let rubrics = format!("data.rubrics=\"{}\"", bad.display());
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(train_args(&dir.path().join("run"), &["--set", &rubrics]))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("`conrub rubrics validate` rejects")
            && err.contains(&format!("{}: line 2 (id ", bad.display()))
            && err.contains("duplicate id (first on line 1)"),
        "{err}"
    );
    assert!(!dir.path().join("run").exists(), "nothing written");
}

/// What would abort or panic mid-run is refused before anything loads: a response length whose
/// step cannot fit the host's memory (the memory plan, checked on the CPU too) and a zero head
/// width (an error naming the key).
#[test]
fn impossible_runs_are_refused_before_loading() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
            .args(train_args(&dir.path().join("run"), extra))
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (ok, err) = run(&["--set", "learner.max_response_tokens=100000000"]);
    assert!(!ok);
    assert!(
        err.contains("the run does not fit in the ") && err.contains("GB of host memory"),
        "{err}"
    );
    assert!(
        !err.contains("warm-up"),
        "refused before the warm-up: {err}"
    );
    let (ok, err) = run(&["--set", "model.random.head_dim=0"]);
    assert!(!ok);
    assert!(
        err.contains("model.random") && err.contains("head_dim"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    // An output folder that is a file, or an empty name (which would mean the config's folder).
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let (ok, err) = run(&["--set", &format!("run.output_dir=\"{}\"", file.display())]);
    assert!(!ok);
    assert!(err.contains("is a file, not a folder"), "{err}");
    assert!(
        !err.contains("warm-up"),
        "refused before the warm-up: {err}"
    );
    let (ok, err) = run(&["--set", "run.output_dir=\"\""]);
    assert!(!ok);
    assert!(err.contains("run.output_dir: is empty"), "{err}");
    // Prompts over data.max_prompt_tokens stop the run when told to (dropping them is the
    // default, unit-tested in conrub-trainer), naming the first and its length.
    let (ok, err) = run(&[
        "--set",
        "data.max_prompt_tokens=20",
        "--set",
        "data.overlong_prompts=\"error\"",
    ]);
    assert!(!ok);
    assert!(
        err.contains("data.max_prompt_tokens: prompt ") && err.contains("tokens, over 20"),
        "{err}"
    );
    assert!(!dir.path().join("run/metrics.jsonl").exists());
}

/// The embedding example (`examples/verifiable_reward.rs`), compiled into this test: the Trainer
/// with the example's own task type and exact-match reward, no rubric records and no judge.
#[allow(dead_code)]
#[path = "../../examples/verifiable_reward.rs"]
mod verifiable_reward;

#[test]
fn the_embedding_example_trains_three_steps_on_its_own_reward() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let (summary, scored) = verifiable_reward::train(3, &out).expect("the example trains");
    assert_eq!((summary.total_steps, summary.steps_run), (3, 3));
    // 4 prompts x 4 responses a step, every one scored by the example's reward.
    assert_eq!(scored, 3 * 4 * 4);
    let steps = steps(&out);
    assert_eq!(steps.len(), 3);
    for s in &steps {
        // Exact-match rewards are 0 or 1: a step's mean is a multiple of 1/16, and no response
        // is unscored.
        let mean = s["reward_mean"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&mean), "{s}");
        assert!(((mean * 16.0) - (mean * 16.0).round()).abs() < 1e-9, "{s}");
        assert_eq!(s["unscored"].as_u64(), Some(0), "{s}");
    }
    // The run's checkpoint is the policy's own export (a Hugging Face directory).
    let ckpt = summary.last_checkpoint.expect("a final checkpoint");
    assert!(ckpt.join("config.json").is_file() && ckpt.join("model.safetensors").is_file());
}

/// An embedder's trainer whose ties need a breaker it was not given, or whose folder holds an
/// earlier run, stops before the supervised warm-up, with an error naming what to change.
#[test]
fn an_embedded_trainer_checks_before_it_trains() {
    use conrub_trainer::{load_policy, Trainer};
    type B = burn::backend::Flex;
    let tmp = tempfile::tempdir().unwrap();
    let start = |cfg: conrub_config::TrainConfig| {
        let device = Default::default();
        let policy = load_policy::<B>(&cfg, &device).unwrap();
        let reward = verifiable_reward::ExactNumber::default();
        let prompts = verifiable_reward::problems(4);
        let trainer = Trainer::new(cfg, vec![device], policy, prompts, reward).unwrap();
        trainer.run().unwrap_err().to_string()
    };
    let out = tmp.path().join("ties");
    let mut cfg = verifiable_reward::config(1, &out).unwrap();
    cfg.learner.tie_mode = conrub_grpo::TieMode::Pairwise;
    let e = start(cfg);
    assert!(
        e.contains("learner.tie_mode") && e.contains("with_tie_breaker"),
        "{e}"
    );
    assert!(!out.exists(), "nothing is written: {e}");
    let out = tmp.path().join("taken");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("metrics.jsonl"), "{}\n").unwrap();
    let e = start(verifiable_reward::config(1, &out).unwrap());
    assert!(e.contains("earlier run"), "{e}");
    assert_eq!(
        std::fs::read_to_string(out.join("metrics.jsonl")).unwrap(),
        "{}\n"
    );
}

/// The demo's records with a numeric `ground_truth` each (a dose, a day count, ...), in `dir`.
fn records_with_ground_truth(dir: &Path) -> PathBuf {
    let truths = ["300", "5", "500", "0", "2", "3", "50", "3"];
    let text = std::fs::read_to_string(root().join("data/samples/rubrics.jsonl")).unwrap();
    let lines: Vec<String> = text
        .lines()
        .zip(truths)
        .map(|(l, t)| {
            let mut r: serde_json::Value = serde_json::from_str(l).unwrap();
            r["ground_truth"] = t.into();
            r.to_string()
        })
        .collect();
    assert_eq!(lines.len(), 8);
    let path = dir.join("rubrics-gt.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// A loopback reward server on a thread: answers 503 to its first `failures` requests, then
/// `{"rewards": [...]}` with each response's length in characters mod 3, halved.
fn reward_server(failures: usize) -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/score", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for (n, stream) in listener.incoming().enumerate() {
            let mut stream = stream.unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap();
                }
                if line == "\r\n" || line.is_empty() {
                    break;
                }
            }
            let mut body = vec![0u8; length];
            reader.read_exact(&mut body).unwrap();
            let (status, answer) = if n < failures {
                ("503 Service Unavailable", String::new())
            } else {
                let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
                let rewards: Vec<f64> = body["responses"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|r| (r.as_str().unwrap().chars().count() % 3) as f64 / 2.0)
                    .collect();
                (
                    "200 OK",
                    serde_json::json!({ "rewards": rewards }).to_string(),
                )
            };
            let reply = format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                answer.len()
            );
            stream.write_all(reply.as_bytes()).unwrap();
        }
    });
    url
}

/// `[[reward.functions]]` from the command line: the lexical rubric judge (0.7) and a numeric
/// match (0.3) train the demo, each response's reward the weighted sum of its parts; records
/// without the ground truth are refused by line; a reward server that fails once leaves that
/// group unscored (no reward, not 0) and the run goes on.
#[test]
fn reward_functions_mix_a_judge_a_numeric_match_and_a_server() {
    let dir = tempfile::tempdir().unwrap();
    let records = records_with_ground_truth(dir.path());
    let data = format!("data.rubrics=\"{}\"", records.display());
    let mix = "reward.functions=[{kind=\"rubric\", weight=0.7}, \
               {kind=\"numeric\", weight=0.3, tolerance=0.5}]";
    let out = dir.path().join("mix");
    let log = train(
        &out,
        &["--set", &data, "--set", mix, "--set", "run.epochs=1"],
    );
    assert!(
        log.contains("rewards 0.7 x rubric + 0.3 x numeric"),
        "{log}"
    );
    let metrics = steps(&out);
    assert_eq!(metrics.len(), 2);
    for m in &metrics {
        let step = m["step"].as_u64().unwrap();
        let groups = jsonl(&out.join(format!("samples/step-{step:06}.jsonl")));
        let mut rewards = vec![];
        for g in &groups {
            let criteria = g["criteria"].as_array().unwrap().len();
            assert!(criteria > 0, "the rubric part's criteria are kept: {g}");
            for r in g["responses"].as_array().unwrap() {
                let s = &r["score"];
                assert_eq!(s["status"], "mixed", "{r}");
                let parts = s["parts"].as_array().unwrap();
                let names: Vec<&str> = parts.iter().map(|p| p["name"].as_str().unwrap()).collect();
                assert_eq!(names, ["rubric", "numeric"]);
                assert_eq!(
                    parts[0]["score"]["labels"].as_array().unwrap().len(),
                    criteria
                );
                let judged = parts[0]["score"]["reward"]["value"].as_f64().unwrap();
                let numeric = parts[1]["score"]["reward"]["value"].as_f64().unwrap();
                assert!(numeric == 0.0 || numeric == 1.0, "{r}");
                if !r["text"]
                    .as_str()
                    .unwrap()
                    .chars()
                    .any(|c| c.is_ascii_digit())
                {
                    assert_eq!(numeric, 0.0, "no number, no match: {r}");
                }
                let by_hand = 0.0 + 0.7 * judged + 0.3 * numeric;
                assert_eq!(s["reward"].as_f64().unwrap().to_bits(), by_hand.to_bits());
                assert_eq!(r["reward"], s["reward"]);
                rewards.push(by_hand);
            }
        }
        let mean = rewards.iter().sum::<f64>() / rewards.len() as f64;
        assert!((mean - m["reward_mean"].as_f64().unwrap()).abs() < 1e-12);
        assert_eq!(m["unscored"], 0);
    }

    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args([
            "samples",
            out.to_str().unwrap(),
            "--step",
            "1",
            "--group",
            "0",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.matches("= 0.7 x rubric ").count() == 4 && text.contains(" + 0.3 x numeric "),
        "{text}"
    );

    // The demo's own records have no ground truth: refused before training, by line.
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(train_args(&dir.path().join("refused"), &["--set", mix]))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("8 records the reward functions cannot score")
            && err.contains("rubrics.jsonl:1: record `med-0001`: reward function `numeric`")
            && err.contains("ground_truth"),
        "{err}"
    );

    // A reward server that fails its first request (no retries): one group of the first step
    // is unscored, the rest are scored by the server's floats.
    let url = reward_server(1);
    let http = format!(
        "reward.functions=[{{kind=\"http\", url=\"{url}\", max_retries=0, timeout_secs=20}}]"
    );
    let out = dir.path().join("http");
    train(&out, &["--set", &http, "--set", "run.epochs=1"]);
    let metrics = steps(&out);
    assert_eq!(metrics.len(), 2);
    assert_eq!(
        (
            metrics[0]["unscored"].as_u64(),
            metrics[1]["unscored"].as_u64()
        ),
        (Some(4), Some(0))
    );
    let groups = jsonl(&out.join("samples/step-000000.jsonl"));
    let unscored: Vec<&serde_json::Value> = groups
        .iter()
        .filter(|g| g["responses"][0]["score"]["status"] == "unscored")
        .collect();
    assert_eq!(unscored.len(), 1);
    for r in unscored[0]["responses"].as_array().unwrap() {
        assert!(r["reward"].is_null(), "unscored, not 0: {r}");
        let why = r["score"]["message"].as_str().unwrap();
        assert!(why.contains("`http`") && why.contains("503"), "{why}");
    }
    for g in groups
        .iter()
        .filter(|g| g["responses"][0]["score"]["status"] != "unscored")
    {
        for r in g["responses"].as_array().unwrap() {
            let want = (r["text"].as_str().unwrap().chars().count() % 3) as f64 / 2.0;
            assert_eq!(r["reward"].as_f64(), Some(want), "{r}");
        }
    }
}

/// The demo config with `[[data.train]]` tables (`files`: path, optional format, weight) in
/// place of `data.rubrics`, written to `dir` with absolute paths.
fn demo_config_with_files(dir: &Path, files: &[(&str, Option<&str>, f64)]) -> PathBuf {
    let demo = std::fs::read_to_string(root().join("configs/demo-cpu.toml")).unwrap();
    let configs = root().join("configs");
    let mut text: String = demo
        .lines()
        .filter(|l| !l.starts_with("rubrics = "))
        .map(|l| l.replace("\"../", &format!("\"{}/../", configs.display())))
        .collect::<Vec<_>>()
        .join("\n");
    for (path, format, weight) in files {
        text += &format!(
            "\n[[data.train]]\npath = \"{}\"\nweight = {weight}\n",
            root().join(path).display()
        );
        if let Some(f) = format {
            text += &format!("format = \"{f}\"\n");
        }
    }
    let path = dir.join("mixed.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `[[data.train]]`: the demo's rubric JSONL mixed with the RaR sample (imported, weight 2):
/// the task holds both files' prompts, the RaR ones twice (`id~2`); an id two files share is
/// refused, naming both places.
#[test]
fn data_train_mixes_files_by_weight() {
    let dir = tempfile::tempdir().unwrap();
    let config = demo_config_with_files(
        dir.path(),
        &[
            ("data/samples/rubrics.jsonl", None, 1.0),
            ("data/samples/rar.jsonl", Some("rar"), 2.0),
        ],
    );
    let rar = std::fs::read_to_string(root().join("data/samples/rar.jsonl"))
        .unwrap()
        .lines()
        .count();
    let out = dir.path().join("run");
    let mut args = train_args(&out, &["--set", "run.max_steps=1"]);
    args[2] = config.display().to_string();
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(&args)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{log}");
    let prompts = 8 + 2 * rar;
    assert!(
        log.contains(&format!("{prompts} prompts from 1 x "))
            && log.contains(&format!(
                "2 x {}",
                root().join("data/samples/rar.jsonl").display()
            )),
        "{log}"
    );

    let config = demo_config_with_files(
        dir.path(),
        &[
            ("data/samples/rubrics.jsonl", None, 1.0),
            ("data/samples/rubrics.jsonl", None, 0.5),
        ],
    );
    args[2] = config.display().to_string();
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(&args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("line 1: prompt id `med-0001` is already used at")
            && err.contains("rubrics.jsonl:1"),
        "{err}"
    );
}

/// `v` without the judges' measured latencies (`latency_ms` keys at any depth).
fn without_latencies(v: serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => m
            .into_iter()
            .filter(|(k, _)| k != "latency_ms")
            .map(|(k, v)| (k, without_latencies(v)))
            .collect(),
        serde_json::Value::Array(a) => a.into_iter().map(without_latencies).collect(),
        other => other,
    }
}

/// Training from parquet (the demo's rubrics and the RaR sample as pyarrow writes them,
/// scripts/make-parquet-samples.py) gives the same run as from the same records in JSONL: step
/// lines (timings aside) and every sample written.
#[test]
fn parquet_trains_as_its_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, rubrics: &str, rar: &str| {
        let sub = dir.path().join(name);
        std::fs::create_dir_all(&sub).unwrap();
        let config = demo_config_with_files(&sub, &[(rubrics, None, 1.0), (rar, Some("rar"), 2.0)]);
        let out = sub.join("run");
        let mut args = train_args(&out, &["--set", "run.max_steps=2"]);
        args[2] = config.display().to_string();
        let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
            .args(&args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let samples: Vec<_> = (0..2)
            .map(|s| {
                let path = out.join(format!("samples/step-{s:06}.jsonl"));
                jsonl(&path)
                    .into_iter()
                    .map(without_latencies)
                    .collect::<Vec<_>>()
            })
            .collect();
        let steps: Vec<_> = steps(&out).into_iter().map(untimed).collect();
        (steps, samples)
    };
    let jsonl = run(
        "jsonl",
        "data/samples/rubrics.jsonl",
        "data/samples/rar.jsonl",
    );
    let parquet = run(
        "parquet",
        "data/samples/parquet/rubrics.parquet",
        "data/samples/parquet/rar.parquet",
    );
    assert_eq!(jsonl.0.len(), 2);
    assert!(!jsonl.1[0].is_empty());
    assert_eq!(jsonl, parquet);
}

/// `run.checkpoint_in_background` (the default) seals each checkpoint on a thread of its own
/// while the next steps train; the checkpoints it leaves are byte for byte those of a run that
/// seals before every next step, and the log says how long each part took.
#[test]
fn checkpoints_sealed_in_the_background_equal_sealed_ones() {
    let dir = tempfile::tempdir().unwrap();
    let three = [
        "--set",
        "run.max_steps=3",
        "--set",
        "run.checkpoint_every=1",
    ];
    let background = dir.path().join("background");
    let log = train(&background, &three);
    let sealed = log
        .lines()
        .filter(|l| l.contains("made durable in") && l.ends_with("on a background thread"))
        .count();
    assert_eq!(sealed, 3, "{log}");
    let foreground = dir.path().join("foreground");
    let sync = [&three[..], &["--set", "run.checkpoint_in_background=false"]].concat();
    let log = train(&foreground, &sync);
    assert!(
        log.lines()
            .any(|l| l.contains("made durable in") && !l.contains("background")),
        "{log}"
    );
    for step in 1..=3 {
        let name = format!("checkpoint-{step:06}");
        let (a, b) = (
            files(&background.join(&name)),
            files(&foreground.join(&name)),
        );
        assert!(a.contains_key(Path::new("training_state/manifest.json")));
        assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
        for (path, bytes) in &a {
            // The training state's files carry the parameters' ids, which each process draws
            // anew: the manifest is compared without its digests, the weights through the
            // export.
            let file = path.file_name().unwrap().to_string_lossy();
            if file.ends_with(".mpk") {
                assert_eq!(bytes.len(), b[path].len(), "{name}/{}", path.display());
            } else if file == "manifest.json" {
                let strip = |raw: &[u8]| {
                    let mut m: serde_json::Value = serde_json::from_slice(raw).unwrap();
                    for f in m["files"].as_object_mut().unwrap().values_mut() {
                        f.as_object_mut().unwrap().remove("sha256");
                    }
                    m
                };
                assert_eq!(strip(bytes), strip(&b[path]), "{name}/manifest.json");
            } else {
                assert!(bytes == &b[path], "{name}/{} differs", path.display());
            }
        }
    }
    for d in [&background, &foreground] {
        let leftovers: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".tmp") || n.ends_with(".old"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }
}

/// `learner.kl_in_reward`: every step line says the mean penalty taken from the rewards (k3:
/// never negative), exactly 0 at the first step, whose policy is the reference. (The shrunk
/// demo's policy does not move in three steps; the penalty's arithmetic is checked by hand in
/// `conrub-grpo`, and the full demo's first three steps log 0, 0.099 and 0.348.)
#[test]
fn kl_in_reward_logs_the_penalty_of_every_step() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("kl");
    let set = [
        "learner.kl_in_reward=0.5",
        "learner.kl_estimator=\"k3\"",
        "run.max_steps=3",
    ];
    let args: Vec<&str> = set.iter().flat_map(|s| ["--set", s]).collect();
    train(&out, &args);
    let penalties: Vec<f64> = steps(&out)
        .iter()
        .map(|m| {
            m["reward_kl_penalty"]
                .as_f64()
                .expect("a penalty on every step line")
        })
        .collect();
    assert_eq!(penalties.len(), 3);
    assert!(
        penalties.iter().all(|p| p.is_finite() && *p >= 0.0),
        "{penalties:?}"
    );
    assert_eq!(penalties[0], 0.0);
}

/// Per group of a samples file: whether its scored rewards differ.
fn groups_varied(path: &Path) -> Vec<bool> {
    jsonl(path)
        .iter()
        .map(|g| {
            let rewards: Vec<f64> = g["responses"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|r| r["reward"].as_f64())
                .collect();
            rewards.iter().any(|r| r.to_bits() != rewards[0].to_bits())
        })
        .collect()
}

/// `learner.dynamic_sampling` (with `tie_mode = "off"`): each step line counts the groups
/// dropped, the prompts drawn beyond the step's 4 and the rounds, which add up
/// (`prompts + dropped = 4 + drawn`); every group trained on (the samples) has rewards that
/// differ, and a step that kept fewer than 4 spent its rounds. A resume continues the data cursor
/// (`prompts_drawn` in the state) and the run; two ranks draw what one device draws; pairwise
/// ties are refused with it.
#[test]
fn dynamic_sampling_drops_groups_without_variance_and_draws_more() {
    let dir = tempfile::tempdir().unwrap();
    let on = [
        "--set",
        "learner.tie_mode=\"off\"",
        "--set",
        "learner.dynamic_sampling=true",
        "--set",
        "learner.dynamic_sampling_rounds=2",
    ];
    let with = |extra: &[&'static str]| -> Vec<&'static str> { [&on[..], extra].concat() };
    let straight = dir.path().join("straight");
    train(&straight, &with(&["--set", "run.max_steps=3"]));
    let s = steps(&straight);
    assert_eq!(s.len(), 3);
    let count = |m: &serde_json::Value, key: &str| {
        m[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} on every step line: {m}"))
    };
    let mut dropped = 0;
    for (n, m) in s.iter().enumerate() {
        let (d, x, r) = (
            count(m, "dynamic_groups_dropped"),
            count(m, "dynamic_prompts_drawn"),
            count(m, "dynamic_rounds"),
        );
        let prompts = count(m, "prompts");
        assert_eq!(prompts + d, 4 + x, "{m}");
        assert!(x <= 2 * 4 && (1..=3).contains(&r), "{m}");
        let varied = groups_varied(&straight.join(format!("samples/step-{n:06}.jsonl")));
        assert_eq!(varied.len() as u64, prompts, "{m}");
        if varied.iter().all(|v| *v) {
            assert!(
                prompts == 4 || r == 3,
                "kept {prompts} with rounds left: {m}"
            );
        } else {
            // No group of any round varied: the step trains on its first 4 (all ties).
            assert!(varied.iter().all(|v| !*v) && prompts == 4 && d == x, "{m}");
        }
        dropped += d;
    }
    assert!(dropped > 0, "no group was dropped: {s:?}");

    // Two steps, then `--resume auto` to three: the straight run, and the cursor counts the
    // prompts the first two steps drew.
    let resumed = dir.path().join("resumed");
    train(&resumed, &with(&["--set", "run.max_steps=2"]));
    let state =
        std::fs::read_to_string(resumed.join("checkpoint-000002/training_state/state.json"))
            .unwrap();
    let state: serde_json::Value = serde_json::from_str(&state).unwrap();
    let drawn = 8 + count(&s[0], "dynamic_prompts_drawn") + count(&s[1], "dynamic_prompts_drawn");
    assert_eq!(state["data_cursor"]["prompts_drawn"].as_u64(), Some(drawn));
    train(
        &resumed,
        &with(&["--set", "run.max_steps=3", "--resume", "auto"]),
    );
    let r = steps(&resumed);
    assert_eq!(
        r.into_iter().map(untimed).collect::<Vec<_>>(),
        s.iter().cloned().map(untimed).collect::<Vec<_>>()
    );

    // Two simulated ranks refill their shares from one reserve: the first step draws, drops
    // and trains what one device did.
    let two = dir.path().join("two");
    train(
        &two,
        &with(&["--set", "run.max_steps=1", "--devices", "cpu,cpu"]),
    );
    let t = steps(&two);
    for key in [
        "prompts",
        "responses",
        "response_tokens",
        "ties",
        "dynamic_groups_dropped",
        "dynamic_prompts_drawn",
        "dynamic_rounds",
    ] {
        assert_eq!(t[0][key], s[0][key], "two ranks: {key}");
    }
    let (a, b) = (s[0]["reward_mean"].as_f64(), t[0]["reward_mean"].as_f64());
    assert!((a.unwrap() - b.unwrap()).abs() < 1e-12, "{a:?} {b:?}");

    // The default tie mode (pairwise) with dynamic sampling is refused before anything runs.
    let refused = dir.path().join("refused");
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(train_args(
            &refused,
            &["--set", "learner.dynamic_sampling=true"],
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains(
            "learner.dynamic_sampling: needs learner.tie_mode = \"off\" (it is \"pairwise\")"
        ),
        "{err}"
    );
    assert!(!refused.join("metrics.jsonl").exists());
}

/// `learner.repetition_penalty`: a first step at penalty 2 rolls out other responses than at 1
/// (the tiny policy's samples repeat tokens of the prompt and their own), and a penalty of 0 is
/// refused naming the key.
#[test]
fn repetition_penalty_changes_the_rollouts() {
    let dir = tempfile::tempdir().unwrap();
    let texts = |out: &Path| -> Vec<String> {
        jsonl(&out.join("samples/step-000000.jsonl"))
            .iter()
            .flat_map(|g| g["responses"].as_array().unwrap().clone())
            .map(|r| r["text"].as_str().unwrap().to_string())
            .collect()
    };
    let (plain, penalized) = (dir.path().join("plain"), dir.path().join("penalized"));
    train(&plain, &["--set", "run.max_steps=1"]);
    train(
        &penalized,
        &[
            "--set",
            "run.max_steps=1",
            "--set",
            "learner.repetition_penalty=2.0",
        ],
    );
    let (a, b) = (texts(&plain), texts(&penalized));
    assert_eq!(a.len(), b.len());
    assert!(a.iter().zip(&b).any(|(x, y)| x != y), "{a:?}");
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(train_args(
            &dir.path().join("zero"),
            &["--set", "learner.repetition_penalty=0"],
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("learner.repetition_penalty: 0 must be a number in [1e-30, 1e30]"),
        "{err}"
    );
}

/// `learner.entropy_coeff` (with `global-token-mean`, one mini-batch): the first step's rollouts
/// are the plain run's, and its logged loss is the plain loss less `coeff x` the logged mean
/// entropy (the bonus aggregated as the loss is: the token mean), to f32 rounding; the update
/// differs.
#[test]
fn entropy_coeff_takes_the_entropy_bonus_from_the_loss() {
    let dir = tempfile::tempdir().unwrap();
    let base = [
        "--set",
        "run.max_steps=1",
        "--set",
        "learner.aggregation=\"global-token-mean\"",
        "--set",
        "learner.mini_batches=1",
    ];
    let (plain, bonus) = (dir.path().join("plain"), dir.path().join("bonus"));
    train(&plain, &base);
    train(
        &bonus,
        &[&base[..], &["--set", "learner.entropy_coeff=0.05"]].concat(),
    );
    let (a, b) = (&steps(&plain)[0], &steps(&bonus)[0]);
    for key in ["reward_mean", "response_tokens"] {
        assert_eq!(a[key], b[key], "{key}");
    }
    // The bonus run's log-probs and entropies come from the portable driver, the plain run's
    // from the CPU's fused host head: equal to f32 rounding.
    let f = |m: &serde_json::Value, k: &str| m[k].as_f64().unwrap();
    assert!((f(a, "entropy") - f(b, "entropy")).abs() < 1e-5 * f(a, "entropy"));
    let want = f(a, "loss") - 0.05 * f(b, "entropy");
    assert!(
        (f(b, "loss") - want).abs() < 1e-5,
        "loss {} vs {want} (plain {}, entropy {})",
        f(b, "loss"),
        f(a, "loss"),
        f(a, "entropy")
    );
    assert_ne!(a["grad_norms"], b["grad_norms"]);
}

/// Issue 53, item 12: a closed stdout and stderr (`conrub train ... 2>&1 | head -3`, a dead
/// `tee`) ended the run with a panic (exit 101) after step 0, before any checkpoint, and
/// `rubrics validate --json | head -c 10` printed one. Here both pipes are closed before conrub
/// writes a byte: the run trains, checkpoints and exits 0.
#[test]
fn closed_output_pipes_neither_panic_nor_stop_a_run() {
    use std::process::Stdio;
    let closed = |args: &[String]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_conrub"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        drop(child.stderr.take());
        child.wait().unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let shrink = [
        "--set",
        "run.max_steps=2",
        "--set",
        "learner.max_response_tokens=8",
    ];
    let status = closed(&train_args(&out, &shrink));
    assert!(status.success(), "train: {status}");
    assert_eq!(steps(&out).len(), 2);
    assert!(
        out.join("checkpoint-000002").is_dir(),
        "the last checkpoint is written"
    );
    let rubrics = root()
        .join("data/samples/rubrics.jsonl")
        .display()
        .to_string();
    let validate = ["rubrics", "validate", "--json", &rubrics].map(String::from);
    let status = closed(&validate);
    assert!(status.success(), "rubrics validate --json: {status}");
}
