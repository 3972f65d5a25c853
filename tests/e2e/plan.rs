//! `conrub plan` end to end: the binary on the shipped train configs, JSON shape, the published
//! run's targets, and errors that name the file and the key.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn config(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("configs")
        .join(name)
}

fn conrub(args: &[&str]) -> Output {
    // An empty hub cache: the published model's shape comes from the built-in table, whatever
    // the machine has cached.
    let home = tempfile::tempdir().unwrap();
    Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", home.path())
        .env_remove("HF_HUB_CACHE")
        .output()
        .expect("binary runs")
}

fn plan_json(config: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["plan", "--config", config.to_str().unwrap(), "--json"];
    args.extend_from_slice(extra);
    let out = conrub(&args);
    assert!(
        out.status.success(),
        "conrub {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn failure(args: &[&str]) -> String {
    let out = conrub(args);
    assert!(!out.status.success(), "conrub {args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const MIXED: [&str; 4] = [
    "--set",
    "precision=\"bf16-mixed\"",
    "--set",
    "learner.activation_checkpointing=true",
];
const F32_PLAIN: [&str; 4] = [
    "--set",
    "precision=\"f32\"",
    "--set",
    "learner.activation_checkpointing=false",
];

#[test]
fn published_config_json_shape_and_targets() {
    let v = plan_json(&config("conrub-med-qwen3-4b.toml"), &MIXED);
    assert!(v.is_object());
    assert!(
        v["fits"].is_boolean() && v["training_fits"].is_boolean() && v["rollout_fits"].is_boolean(),
        "{v:#}"
    );
    assert!(v["peak_gb"].as_f64().unwrap() > 0.0);
    let parts = v["parts"].as_object().unwrap();
    for key in [
        "weights_f32",
        "gradients",
        "adamw_moments",
        "bf16_weight_copies",
        "layer_inputs",
        "layer_activations",
        "lm_head_chunk",
        "kv_cache",
        "rollout_weights_bf16",
    ] {
        assert!(parts[key].as_f64().unwrap() > 0.0, "parts.{key}: {v:#}");
    }
    let peak = v["peak_gb"].as_f64().unwrap();
    assert_eq!(
        peak,
        v["training_peak_gb"]
            .as_f64()
            .unwrap()
            .max(v["rollout_peak_gb"].as_f64().unwrap())
    );
    // The inputs used.
    let inputs = &v["inputs"];
    assert_eq!(inputs["precision"], "bf16-mixed");
    assert_eq!(inputs["activation_checkpointing"], true);
    assert_eq!(inputs["micro_batch_tokens"], 65536);
    assert_eq!(inputs["max_prompt_tokens"], 1024);
    assert_eq!(inputs["max_response_tokens"], 8192);
    assert_eq!(inputs["group_size"], 8);
    assert_eq!(inputs["prompts_per_step"], 32);
    assert_eq!(inputs["gpu_memory_gb"], 141.0);
    assert_eq!(inputs["model"]["hidden_size"], 2560);
    assert_eq!(inputs["model"]["num_hidden_layers"], 36);
    assert_eq!(v["parameters"], 4_022_468_096u64);
    assert_eq!(v["model"]["path"], "Qwen/Qwen3-4B-Instruct-2507");
    assert!(
        v["model"]["source"].as_str().unwrap().contains("built-in"),
        "{v:#}"
    );
    // Acceptance: bf16-mixed + checkpointing trains Qwen3-4B in 141 GB with >= 16k-token micro-batches.
    assert!(v["training_fits"].as_bool().unwrap(), "{v:#}");
    assert!(
        v["max_micro_batch_tokens"].as_u64().unwrap() >= 16384,
        "{v:#}"
    );
    assert!(v["max_rollout_rows"].as_u64().unwrap() >= 8, "{v:#}");

    // With the rollout call and micro-batch the plan suggests, the whole run fits.
    let per_call = v["max_rollout_prompts_per_call"]
        .as_u64()
        .unwrap()
        .to_string();
    let micro = v["max_micro_batch_tokens"].as_u64().unwrap().to_string();
    let per_call_set = format!("learner.rollout_prompts_per_call={per_call}");
    let micro_set = format!("learner.micro_batch_tokens={micro}");
    let fitted = plan_json(
        &config("conrub-med-qwen3-4b.toml"),
        &[&MIXED[..], &["--set", &per_call_set, "--set", &micro_set]].concat(),
    );
    assert_eq!(fitted["fits"], true, "{fitted:#}");
}

#[test]
fn f32_without_checkpointing_does_not_fit_and_still_exits_zero() {
    let v = plan_json(&config("conrub-med-qwen3-4b.toml"), &F32_PLAIN);
    assert_eq!(v["fits"], false);
    assert_eq!(v["training_fits"], false);
    assert_eq!(v["inputs"]["precision"], "f32");
    assert!(v["parts"].get("bf16_weight_copies").is_none());
    assert!(v["peak_gb"].as_f64().unwrap() > 141.0);
    // A larger device moves the limits up.
    let mixed = plan_json(&config("conrub-med-qwen3-4b.toml"), &MIXED);
    let big = plan_json(
        &config("conrub-med-qwen3-4b.toml"),
        &[&MIXED[..], &["--gpu-memory-gb", "282"]].concat(),
    );
    assert!(big["max_micro_batch_tokens"].as_u64() > mixed["max_micro_batch_tokens"].as_u64());
    assert!(big["max_rollout_rows"].as_u64() > mixed["max_rollout_rows"].as_u64());
}

#[test]
fn human_table_names_the_parts_and_the_verdict() {
    let c = config("conrub-med-qwen3-4b.toml");
    let out = conrub(&[&["plan", "--config", c.to_str().unwrap()][..], &MIXED].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "weights (f32 master)",
        "gradients (f32)",
        "AdamW moments",
        "bf16 weight copies",
        "LM head chunk",
        "rollout KV pool",
        "KV pool:",
        "training peak",
        "rollout peak",
        "fits",
        "max_micro_batch_tokens",
        "max_rollout_rows",
        "Qwen/Qwen3-4B-Instruct-2507",
    ] {
        assert!(text.contains(needle), "missing `{needle}`:\n{text}");
    }
}

#[test]
fn random_and_local_models_plan() {
    // The demo's tiny random Qwen3 fits easily, the whole step in one micro-batch.
    let v = plan_json(&config("demo-cpu.toml"), &["--gpu-memory-gb", "16"]);
    assert_eq!(v["fits"], true, "{v:#}");
    assert_eq!(v["inputs"]["model"]["hidden_size"], 64);
    assert_eq!(v["model"]["source"], "[model.random]");
    // A local checkpoint directory, relative to the config file: its config.json gives the shape.
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("ckpt")).unwrap();
    std::fs::write(
        dir.path().join("ckpt/config.json"),
        conrub_models::config::QWEN3_0_6B_CONFIG,
    )
    .unwrap();
    let toml = dir.path().join("train.toml");
    std::fs::write(&toml, "device = \"cuda:0\"\n[model]\npath = \"ckpt\"\n[learner]\nmicro_batch_tokens = 32768\n[run]\nprompts_per_step = 4\n").unwrap();
    let v = plan_json(&toml, &["--max-prompt-tokens", "512"]);
    assert_eq!(v["parameters"], 596_049_920u64);
    assert_eq!(v["inputs"]["max_prompt_tokens"], 512);
    assert_eq!(v["inputs"]["prompts_per_step"], 4);
    assert!(
        v["model"]["source"]
            .as_str()
            .unwrap()
            .ends_with("config.json"),
        "{v:#}"
    );
}

#[test]
fn errors_name_the_file_and_the_key() {
    let c = config("conrub-med-qwen3-4b.toml");
    let c = c.to_str().unwrap();
    let err = failure(&["plan", "--config", "no/such/train.toml"]);
    assert!(err.contains("no/such/train.toml"), "{err}");
    let err = failure(&["plan", "--config", c, "--set", "precision=\"fp8\""]);
    assert!(
        err.contains("precision") && err.contains("fp8") && err.contains("bf16-mixed"),
        "{err}"
    );
    let err = failure(&[
        "plan",
        "--config",
        c,
        "--set",
        "learner.micro_batch_tokens=\"many\"",
    ]);
    assert!(
        err.contains("micro_batch_tokens") && err.contains("conrub-med-qwen3-4b.toml"),
        "{err}"
    );
    let err = failure(&[
        "plan",
        "--config",
        c,
        "--set",
        "model.path=\"Qwen/Qwen9-1T\"",
    ]);
    assert!(
        err.contains("model.path") && err.contains("Qwen/Qwen3-4B"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[learner\nmicro_batch_tokens = 1\n").unwrap();
    let err = failure(&["plan", "--config", bad.to_str().unwrap()]);
    assert!(err.contains("bad.toml"), "{err}");
}

/// `conrub plan` and `conrub train` read one schema: the same bad key is the same error from both,
/// and a judge key of another kind names `judge.<key>` and both kinds.
#[test]
fn plan_and_train_give_the_same_config_errors() {
    let c = config("demo-cpu.toml");
    let c = c.to_str().unwrap();
    let error_line = |args: &[&str]| {
        failure(args)
            .lines()
            .find(|l| l.starts_with("error: "))
            .map(str::to_string)
            .unwrap_or_default()
    };
    for (set, expect) in [
        (
            "learner.new_knob=1",
            "learner.new_knob: unknown field `new_knob`",
        ),
        ("future_key=1", "future_key: unknown field `future_key`"),
        (
            "judge.urls=[]",
            "judge.urls: not a key of kind = \"lexical\" (it belongs to kind = \"openai\")",
        ),
        ("learner.lr=-1.0", "learner.lr: must be a finite number > 0"),
    ] {
        let plan = error_line(&["plan", "--config", c, "--set", set]);
        let train = error_line(&["train", "--config", c, "--set", set]);
        assert_eq!(plan, train, "--set {set}");
        assert!(
            plan.contains("demo-cpu.toml: ") && plan.contains(expect),
            "{plan}"
        );
    }
}

/// The published run on eight 80 GB H100s (`conrub-med-qwen3-4b-h100x8.toml`: the policy on
/// four, sharded): a replica per rank does not fit and the plan names the first mode that does;
/// the configured mode fits. Per rank, each mode shrinks what it shards by the four ranks:
/// AdamW moments from `optimizer` on, the summed gradients from `gradients` on, the master
/// weights with `full`; the rest stays. Qwen3-32B on eight 141 GB devices fits only with `full`,
/// Qwen3-8B on eight H100s with `gradients`.
#[test]
fn sharding_makes_the_published_run_fit_80_gb_h100s() {
    let h100 = config("conrub-med-qwen3-4b-h100x8.toml");
    let at_80 = ["--gpu-memory-gb", "80"];
    let mode = |m: &str| {
        plan_json(
            &h100,
            &[&at_80[..], &["--set", &format!("sharding=\"{m}\"")]].concat(),
        )
    };
    let none = mode("none");
    assert_eq!(none["fits"], false, "{none}");
    assert_eq!(none["sharding_that_fits"], "optimizer");
    let configured = plan_json(&h100, &at_80);
    assert_eq!(configured["sharding"], "gradients");
    assert_eq!(configured["fits"], true, "{configured}");
    assert_eq!(configured["ranks"], 4);
    let part = |v: &serde_json::Value, p: &str| v["parts"][p].as_f64().unwrap();
    let modes = ["none", "optimizer", "gradients", "full"].map(mode);
    let quarter = |a: f64, b: f64| (b - a / 4.0).abs() < 0.002 * a;
    for (i, v) in modes.iter().enumerate() {
        let (w, m, g) = (
            part(v, "weights_f32"),
            part(v, "adamw_moments"),
            part(v, "gradients"),
        );
        let (w0, m0, g0) = (
            part(&none, "weights_f32"),
            part(&none, "adamw_moments"),
            part(&none, "gradients"),
        );
        assert!(
            if i >= 1 { quarter(m0, m) } else { m == m0 },
            "moments in mode {i}: {m} of {m0}"
        );
        assert!(
            if i >= 2 { quarter(g0, g) } else { g == g0 },
            "gradients in mode {i}: {g} of {g0}"
        );
        assert!(
            if i >= 3 { quarter(w0, w) } else { w == w0 },
            "weights in mode {i}: {w} of {w0}"
        );
        assert_eq!(
            part(v, "layer_inputs"),
            part(&none, "layer_inputs"),
            "activations stay"
        );
        if i > 0 {
            let before = modes[i - 1]["training_peak_gb"].as_f64().unwrap();
            assert!(
                v["training_peak_gb"].as_f64().unwrap() < before,
                "mode {i} lowers the peak"
            );
        }
    }
    let b32 = plan_json(&config("qwen3-32b-h200x8.toml"), &[]);
    assert_eq!(
        (b32["sharding"].as_str(), b32["fits"].as_bool()),
        (Some("full"), Some(true))
    );
    assert_eq!(b32["by_sharding"]["gradients"]["fits"], false);
    let b8 = plan_json(&config("qwen3-8b-h100x8.toml"), &at_80);
    assert_eq!(
        (b8["sharding"].as_str(), b8["fits"].as_bool()),
        (Some("gradients"), Some(true))
    );
    assert_eq!(b8["by_sharding"]["optimizer"]["fits"], false);
}
