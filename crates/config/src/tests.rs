use std::collections::BTreeSet;
use std::path::Path;

use super::*;

/// A config that sets every key of the schema (an `Option` left unset would hide its sub-keys),
/// with one judge kind; the other kinds' keys come from their own tables.
const FULL: &str = r#"
device = "cpu"
sharding = "gradients"
precision = "bf16-mixed"
attention_kernels = "tensor-core"
kernel_cache = "kernels"

[model]
path = "meta-llama/Llama-3.2-1B-Instruct"
enable_thinking = false
save_dtype = "bf16"
max_shard_size = "2GiB"

[model.random]
family = "llama"
tokenizer = "tok"
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 16
std = 0.02
seed = 0

[data]
rubrics = "rubrics.jsonl"
max_prompt_tokens = 1024
overlong_prompts = "drop"
train = [{ path = "more.jsonl", format = "rar", weight = 0.5 }]

[reward]
mode = "three-state"
length_penalty = true
length_buffer_tokens = 16
min_scored_share = 0.5
max_unscored_steps = 3
dropout = { min_fraction = 0.3, max_fraction = 0.5, keep_global_controls = false }
functions = [{ kind = "rubric", weight = 0.7 }, { kind = "numeric", weight = 0.3, tolerance = 0.5 }]

[learner]
estimator = "group-relative"
loss = "clipped-surrogate"
group_size = 8
max_response_tokens = 48
temperature = 1.0
top_p = 1.0
top_k = 50
stop = ["</answer>"]
rollout_prompts_per_call = 8
lr = 0.002
lr_schedule = "cosine"
lr_warmup_steps = 2
min_lr_ratio = 0.1
weight_decay = 0.0
beta1 = 0.9
beta2 = 0.999
adam_eps = 1e-8
max_grad_norm = 1.0
clip = { low = 0.2, high = 0.28 }
aggregation = "sequence-mean"
scale_rewards = "group"
kl_beta = 0.0
kl_estimator = "k2"
entropy_coeff = 0.001
repetition_penalty = 1.05
mask_truncated = true
tis_cap = 2.0
tie_mode = "pairwise"
dynamic_sampling = false
dynamic_sampling_rounds = 3
dpo_beta = 2.0
ppo_epochs = 1
mini_batches = 2
micro_batch_tokens = 8192
activation_checkpointing = false
seed = 1234
on_nonfinite = "stop"
max_skipped_steps = 3

[run]
epochs = 1
prompts_per_step = 8
checkpoint_every = 6
max_steps = 3
output_dir = "runs/x"
keep_checkpoints = 2
sample_groups = 4
tensorboard = true

[warmup]
steps = 2
lr = 0.01

[rollout]
kv_cache_gb = 1.0
block_size = 16
max_rows = 256
"#;

/// Dotted key paths of a JSON object (arrays and scalars are leaves); panics on a `null` (but
/// `devices`), which would be an unset option whose keys the walk cannot see.
fn key_paths(prefix: &str, v: &serde_json::Value, out: &mut BTreeSet<String>) {
    let serde_json::Value::Object(map) = v else {
        return;
    };
    for (k, v) in map {
        let path = format!("{prefix}{k}");
        // `devices` is the alternative of `device`, `learner.lr_warmup_ratio` of
        // `learner.lr_warmup_steps` (the example sets the other; both is an error).
        assert!(
            !v.is_null() || path == "devices" || path == "learner.lr_warmup_ratio",
            "`{path}` is unset in the full example: set it"
        );
        // Tables are documented through their keys; a free-form map is one key.
        if v.is_object() && path != "judge.chat_template_kwargs" && path != "judge.fallback" {
            key_paths(&format!("{path}."), v, out);
        } else {
            out.insert(path);
        }
    }
}

/// Every key of the schema, from a parse of [`FULL`] and of one judge table per kind.
fn schema_keys() -> BTreeSet<String> {
    let table: toml::Table = toml::from_str(FULL).unwrap();
    let schema: TrainConfig = serde_path_to_error::deserialize(toml::Value::Table(table)).unwrap();
    let mut keys = BTreeSet::new();
    key_paths("", &serde_json::to_value(&schema).unwrap(), &mut keys);
    let judges = [
        "kind = \"openai\"\nurl = \"http://a/v1\"\nmodel = \"m\"\napi_key_env = \"K\"\ncache = \"c\"\n[prompts]\ncriteria_binary = \"a\"\ncriteria_three_state = \"a\"\npairwise = \"a\"\nsingle_binary = \"a\"\nsingle_three_state = \"a\"\n",
        "kind = \"local\"\nmodel = \"m\"\ndevice = \"cpu\"\ncache = \"c\"\n",
        "kind = \"lexical\"\nkeywords = \"k\"\n",
        "kind = \"probe\"\nmodel = \"m\"\nprobe = \"p\"\ndevice = \"cpu\"\ncache = \"c\"\nlayer = 1\npooling = \"mean\"\nabstain_below = 0.6\n[fallback]\nkind = \"lexical\"\n",
    ];
    for text in judges {
        let t: toml::Table = toml::from_str(text).unwrap();
        let judge = JudgeConfig::from_table(t, Path::new("."), "judge.").unwrap();
        let mut v = serde_json::to_value(&judge.spec).unwrap();
        // `prompts` of the local kind are the same keys as openai's.
        if let Some(o) = v.as_object_mut() {
            if o["kind"] == "local" || o["kind"] == "probe" {
                o.remove("prompts");
            }
        }
        key_paths("judge.", &v, &mut keys);
    }
    // `[eval]`: its settings, and the grader (a judge table like `[judge]`).
    let eval: ValidationConfig =
        toml::from_str("every = 1\ndata = \"d\"\nmax_new_tokens = 8\nlimit = 2\n").unwrap();
    key_paths("eval.", &serde_json::to_value(&eval).unwrap(), &mut keys);
    keys.insert("eval.grader".into());
    assert!(keys.contains("learner.clip.low") && keys.contains("judge.local.mode"));
    assert!(keys.contains("eval.decoding") && keys.contains("judge.abstain_below"));
    keys
}

#[test]
fn the_full_example_is_one_valid_config() {
    let table: toml::Table = toml::from_str(FULL).unwrap();
    // Both `path` and `[model.random]` are set to reach every key: the one error.
    let e = TrainConfig::from_table(table.clone(), Path::new("x/train.toml")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "x/train.toml: model: needs exactly one of `path` or `[model.random]`"
    );
    let mut table = table;
    table["model"].as_table_mut().unwrap().remove("path");
    let cfg = TrainConfig::from_table(table, Path::new("x/train.toml")).unwrap();
    assert_eq!(cfg.precision, Precision::Bf16Mixed);
    assert_eq!(cfg.attention_kernels, AttentionKernelChoice::TensorCore);
    assert_eq!(cfg.model.save_dtype, SaveDtype::Bf16);
    assert_eq!(cfg.learner.sampling.top_k, Some(50));
    assert_eq!(cfg.resolve(Path::new("r.jsonl")), Path::new("x/r.jsonl"));
    assert!(cfg.judge.is_none());
    assert!(cfg
        .judge()
        .unwrap_err()
        .to_string()
        .contains("judge: missing"));
}

/// configs/README.md documents every key of the schema (as `` `key` `` in its tables).
#[test]
fn configs_readme_lists_every_key() {
    let readme_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/README.md");
    let readme = std::fs::read_to_string(&readme_path).unwrap();
    let missing: Vec<String> = schema_keys()
        .into_iter()
        .filter(|k| !readme.contains(&format!("`{k}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "configs/README.md does not document these keys: {missing:?}"
    );
}

fn error_of(text: &str) -> String {
    let table: toml::Table = toml::from_str(text).unwrap();
    TrainConfig::from_table(table, Path::new("t.toml"))
        .unwrap_err()
        .to_string()
}

#[test]
fn errors_name_the_file_and_the_key() {
    let random = "[model.random]\ntokenizer = \"t\"\nhidden_size = 64\nintermediate_size = 128\nnum_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\nhead_dim = 16\n";
    let e = error_of(&format!("{random}[learner]\nnew_knob = 1\n"));
    assert!(
        e.starts_with("t.toml: learner.new_knob: unknown field `new_knob`"),
        "{e}"
    );
    // An embedder's own estimator name is a valid config (`conrub train` checks it against the
    // built-in registry: `conrub_grpo::Registry::check_names`).
    let table: toml::Table =
        toml::from_str(&format!("{random}[learner]\nestimator = \"rloo\"\n")).unwrap();
    TrainConfig::from_table(table, Path::new("t.toml")).unwrap();
    let e = error_of(&format!("sharding = \"zero3\"\n{random}"));
    assert!(
        e.starts_with("t.toml: sharding: unknown variant `zero3`, expected one of `none`, `optimizer`, `gradients`, `full`"),
        "{e}"
    );
    let e = error_of(&format!(
        "{random}[learner]\ndynamic_sampling = true\ntie_mode = \"grpo-dpo\"\n"
    ));
    assert!(
        e.starts_with("t.toml: learner.dynamic_sampling: needs learner.tie_mode = \"off\" (it is \"grpo-dpo\")"),
        "{e}"
    );
    let e = error_of(&format!("future_key = 1\n{random}"));
    assert!(e.starts_with("t.toml: future_key: unknown field"), "{e}");
    let e = error_of(&format!("precision = \"bf16\"\n{random}"));
    assert!(
        e.starts_with("t.toml: precision: ") && e.contains("bf16-mixed"),
        "{e}"
    );
    let e = error_of(&format!("attention_kernels = \"fast\"\n{random}"));
    assert!(
        e.starts_with("t.toml: attention_kernels: ") && e.contains("tensor-core"),
        "{e}"
    );
    let e = error_of(&format!("{random}[learner]\nlr = -1.0\n"));
    assert_eq!(e, "t.toml: learner.lr: must be a finite number > 0");
    let e = error_of(&format!("{random}[learner]\nstop = [\"\"]\n"));
    assert_eq!(
        e,
        "t.toml: learner.stop: stop strings must be non-empty and hold no U+FFFD replacement character"
    );
    let e = error_of(&format!("{random}[rollout]\nmax_rows = 0\n"));
    assert_eq!(e, "t.toml: rollout.max_rows: must be at least 1");
    let e = error_of(&format!("{random}[rollout]\nengine = \"sglang\"\n"));
    assert_eq!(
        e,
        "t.toml: rollout.urls: engine = \"sglang\" needs the servers' URLs"
    );
    let e = error_of(&format!("{random}[rollout]\nurls = [\"http://s:1\"]\n"));
    assert_eq!(e, "t.toml: rollout.urls: only for engine = \"sglang\"");
    let e = error_of(&format!(
        "{random}[rollout]\nengine = \"sglang\"\nurls = [\"s:1\"]\n"
    ));
    assert_eq!(e, "t.toml: rollout.urls: \"s:1\" is not an http(s) URL");
    let e = error_of(&format!("{random}[learner]\ntis_cap = 0.0\n"));
    assert_eq!(e, "t.toml: learner.tis_cap: must be a positive number");
    let e = error_of(&format!("{random}[run]\nkeep_checkpoints = 0\n"));
    assert_eq!(
        e,
        "t.toml: run.keep_checkpoints: must be at least 1 (unset keeps every checkpoint)"
    );
    // A judge key of another kind names `judge.<key>` and both kinds.
    let e = error_of(&format!("{random}[judge]\nkind = \"lexical\"\nurls = []\n"));
    assert_eq!(
        e,
        "t.toml: judge.urls: not a key of kind = \"lexical\" (it belongs to kind = \"openai\")"
    );
    let e = error_of(&format!(
        "{random}[judge]\nkind = \"local\"\nmodel = \"m\"\ndevice = \"cpu\"\n"
    ));
    assert!(
        e.starts_with("t.toml: judge.device: \"cpu\": `conrub train` runs"),
        "{e}"
    );
}

/// `[learner.clip]` with one bound keeps the documented default of the other; an unscored
/// budget outside its range names its key.
#[test]
fn partial_tables_take_defaults_and_budgets_are_checked() {
    let mut table: toml::Table = toml::from_str(FULL).unwrap();
    table["model"].as_table_mut().unwrap().remove("path");
    apply_override(&mut table, "learner.clip={ low = 0.1 }").unwrap();
    let cfg = TrainConfig::from_table(table.clone(), Path::new("t.toml")).unwrap();
    assert_eq!(
        (
            cfg.learner.objective.clip.low,
            cfg.learner.objective.clip.high
        ),
        (0.1, 0.28)
    );
    assert_eq!(cfg.learner_config().min_scored_share, 0.5);
    apply_override(&mut table, "reward.min_scored_share=1.5").unwrap();
    let e = TrainConfig::from_table(table, Path::new("t.toml"))
        .unwrap_err()
        .to_string();
    assert_eq!(e, "t.toml: reward.min_scored_share: must be in [0, 1]");
}

/// `model.max_shard_size` takes bytes or a size with a unit, and names itself when it is neither.
#[test]
fn shard_sizes_parse_with_units() {
    let mut table: toml::Table = toml::from_str(FULL).unwrap();
    table["model"].as_table_mut().unwrap().remove("path");
    let cfg = TrainConfig::from_table(table.clone(), Path::new("t.toml")).unwrap();
    assert_eq!(cfg.model.max_shard_bytes(), 2 << 30);
    for (text, bytes) in [
        ("\"5GB\"", 5_000_000_000u64),
        ("\"500MB\"", 500_000_000),
        ("1234", 1234),
    ] {
        let mut t = table.clone();
        apply_override(&mut t, &format!("model.max_shard_size={text}")).unwrap();
        let cfg = TrainConfig::from_table(t, Path::new("t.toml")).unwrap();
        assert_eq!(cfg.model.max_shard_bytes(), bytes, "{text}");
    }
    apply_override(&mut table, "model.max_shard_size=\"5 parsecs\"").unwrap();
    let e = TrainConfig::from_table(table, Path::new("t.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("t.toml: model.max_shard_size: `5 parsecs`: unknown unit `parsecs`"),
        "{e}"
    );
}

/// `--set warmup.steps=0` turns off a config's `[warmup]` table; a bad rate still names its key.
#[test]
fn warmup_steps_zero_turns_the_table_off() {
    let mut table: toml::Table = toml::from_str(FULL).unwrap();
    table["model"].as_table_mut().unwrap().remove("path");
    let cfg = TrainConfig::from_table(table.clone(), Path::new("t.toml")).unwrap();
    assert_eq!(cfg.warmup.as_ref().map(|w| w.steps), Some(2));
    let mut off = table.clone();
    apply_override(&mut off, "warmup.steps=0").unwrap();
    let cfg = TrainConfig::from_table(off, Path::new("t.toml")).unwrap();
    assert_eq!(cfg.warmup, None);
    apply_override(&mut table, "warmup.lr=0.0").unwrap();
    let e = TrainConfig::from_table(table, Path::new("t.toml"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "t.toml: warmup.lr: needs a finite lr > 0 (or `steps = 0` for no warm-up)"
    );
}

#[test]
fn overrides_set_nested_keys() {
    let mut t = toml::Table::new();
    apply_override(&mut t, "learner.lr=1e-6").unwrap();
    apply_override(&mut t, "device=cuda:1").unwrap();
    assert_eq!(t["learner"]["lr"].as_float(), Some(1e-6));
    assert_eq!(t["device"].as_str(), Some("cuda:1"));
    let e = apply_override(&mut t, "learner").unwrap_err().to_string();
    assert_eq!(e, "--set learner: expected KEY=VALUE");
    let e = apply_override(&mut t, "device.x=1")
        .unwrap_err()
        .to_string();
    assert_eq!(e, "--set device.x=1: `device` is not a table");
}

#[test]
fn devices_replace_device_and_must_share_a_backend() {
    let cfg = |text: &str| {
        let text = format!("{text}[model]\npath = \"m\"\n");
        let table: toml::Table = toml::from_str(&text).unwrap();
        TrainConfig::from_table(table, Path::new("t.toml"))
    };
    let two = cfg("devices = [\"cpu\", \"cpu\"]\n").unwrap();
    assert_eq!((two.devices.len(), two.device.as_str()), (2, "cpu"));
    assert_eq!(cfg("").unwrap().devices, vec!["cpu".to_string()]);
    let e = cfg("device = \"cpu\"\ndevices = [\"cpu\"]\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("t.toml: devices: give `device` or `devices`, not both"),
        "{e}"
    );
    let e = cfg("devices = [\"cuda:0\", \"wgpu\"]\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("devices: \"cuda:0\" and \"wgpu\": every rank runs on one backend"),
        "{e}"
    );
    let e = cfg("devices = []\n").unwrap_err().to_string();
    assert!(e.contains("devices: needs at least one device"), "{e}");
    let mut c = cfg("").unwrap();
    c.set_devices(vec!["cuda:0".into(), "cuda:1".into()])
        .unwrap();
    assert_eq!((c.device.as_str(), c.devices.len()), ("cuda:0", 2));
    // A plan is per rank: the step's prompts over the ranks, the first ones taking one more.
    let mut c = cfg("[run]\nprompts_per_step = 5\n").unwrap();
    c.set_devices(vec!["cpu".into(), "cpu".into()]).unwrap();
    assert_eq!(c.prompts_per_rank(), 3);
}

#[test]
fn data_train_lists_files_with_formats_and_weights() {
    let dir = tempfile::tempdir().unwrap();
    let base = "device = \"cpu\"\n[model.random]\ntokenizer = \"t\"\nhidden_size = 8\nintermediate_size = 8\nnum_hidden_layers = 1\nnum_attention_heads = 1\nnum_key_value_heads = 1\nhead_dim = 8\n";
    let write = |text: &str| {
        let p = dir.path().join("c.toml");
        std::fs::write(&p, format!("{base}{text}")).unwrap();
        p
    };
    let cfg = TrainConfig::from_file(
        &write("[[data.train]]\npath = \"a.jsonl\"\n[[data.train]]\npath = \"b.jsonl\"\nformat = \"rar\"\nweight = 0.5\n"),
        &[],
    )
    .unwrap();
    let files = cfg.train_files().unwrap();
    assert_eq!(files.len(), 2);
    assert_eq!(files[0].path, dir.path().join("a.jsonl"));
    assert_eq!((files[0].format, files[0].weight), (None, 1.0));
    assert_eq!(
        (files[1].format, files[1].weight),
        (Some(conrub_rubric::ImportFormat::Rar), 0.5)
    );
    // data.rubrics is the one-file spelling.
    let cfg = TrainConfig::from_file(&write("[data]\nrubrics = \"r.jsonl\"\n"), &[]).unwrap();
    assert_eq!(
        cfg.train_files().unwrap()[0].path,
        dir.path().join("r.jsonl")
    );
    let err = |text: &str| match TrainConfig::from_file(&write(text), &[]) {
        Ok(cfg) => cfg.train_files().unwrap_err().to_string(),
        Err(e) => e.to_string(),
    };
    let e = err("[data]\nrubrics = \"r.jsonl\"\n[[data.train]]\npath = \"a.jsonl\"\n");
    assert!(e.contains("data.train") && e.contains("once"), "{e}");
    let e = err("[[data.train]]\npath = \"a.jsonl\"\nweight = 0\n");
    assert!(e.contains("data.train[0].weight"), "{e}");
    let e = err("[[data.train]]\npath = \"a.jsonl\"\nformat = \"csv\"\n");
    assert!(e.contains("format") && e.contains("healthbench"), "{e}");
    let e = err("[[data.train]]\npath = \"a.jsonl\"\nwieght = 2\n");
    assert!(e.contains("wieght"), "{e}");
    let e = err("");
    assert!(
        e.contains("data.rubrics") && e.contains("[[data.train]]"),
        "{e}"
    );
}
