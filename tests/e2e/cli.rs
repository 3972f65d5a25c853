//! End-to-end tests of the `conrub` binary against the HF fixtures of `models/testdata`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn testdata(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/testdata")
        .join(name)
}

fn conrub(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("binary runs")
}

fn json_ok(args: &[&str]) -> serde_json::Value {
    let out = conrub(args);
    assert!(
        out.status.success(),
        "conrub {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn stderr_of_failure(args: &[&str]) -> String {
    let out = conrub(args);
    assert!(!out.status.success(), "conrub {args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn reference(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(testdata(name).join("reference.json")).unwrap())
        .unwrap()
}

fn ids_arg(v: &serde_json::Value) -> String {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn generate_greedy_json_matches_transformers() {
    // Every family through the one registry.
    for name in [
        "qwen3/tied-gqa-f32",
        "qwen3/untied-mqa-bf16",
        "llama/untied-gqa-llama3rope-bf16",
        "qwen2/tied-gqa-f32",
    ] {
        let r = reference(name);
        let model = testdata(name);
        let out = json_ok(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--ids",
            &ids_arg(&r["greedy_prompt"]),
            "--greedy",
            "--max-new-tokens",
            "20",
            "--json",
        ]);
        assert_eq!(out["new_tokens"], r["greedy_tokens"], "{name}");
        assert_eq!(out["finish_reason"], "length");
        assert!(out["text"].is_null(), "no tokenizer files: text is null");
        let lps = out["token_logprobs"].as_array().unwrap();
        assert_eq!(lps.len(), 20);
        assert!(lps.iter().all(|x| x.as_f64().unwrap() < 0.0));
    }
}

#[test]
fn generate_sampling_is_seeded_and_stops_on_stop_ids() {
    let model = testdata("qwen3/tied-gqa-f32");
    let m = model.to_str().unwrap();
    let args = |seed: &str| {
        json_ok(&[
            "generate",
            "--model",
            m,
            "--ids",
            "1,2,3",
            "--temperature",
            "0.9",
            "--top-p",
            "0.9",
            "--top-k",
            "40",
            "--seed",
            seed,
            "--max-new-tokens",
            "16",
            "--json",
        ])
    };
    let a = args("7");
    assert_eq!(a, args("7"));
    assert_ne!(a["new_tokens"], args("8")["new_tokens"]);
    let first = a["new_tokens"][2].as_u64().unwrap().to_string();
    let stopped = json_ok(&[
        "generate",
        "--model",
        m,
        "--ids",
        "1,2,3",
        "--temperature",
        "0.9",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "7",
        "--max-new-tokens",
        "16",
        "--stop-ids",
        &first,
        "--json",
    ]);
    assert_eq!(stopped["finish_reason"], "stop");
    let n = stopped["new_tokens"].as_array().unwrap().len();
    assert!(n <= 3);
    assert_eq!(
        stopped["new_tokens"].as_array().unwrap()[..],
        a["new_tokens"].as_array().unwrap()[..n]
    );
}

#[test]
fn logprobs_json_matches_transformers() {
    for name in [
        "qwen3/tied-mha-bf16-sharded",
        "llama/tied-mha-bias-f32",
        "qwen2/untied-mqa-bf16",
    ] {
        logprobs_match_transformers(name);
    }
}

fn logprobs_match_transformers(name: &str) {
    let r = reference(name);
    let seq = &r["sequences"][1];
    let out = json_ok(&[
        "logprobs",
        "--model",
        testdata(name).to_str().unwrap(),
        "--ids",
        &ids_arg(seq),
        "--json",
    ]);
    let got = out["token_logprobs"].as_array().unwrap();
    assert_eq!(got.len(), seq.as_array().unwrap().len() - 1);
    assert_eq!(
        out["argmax"].as_array().unwrap().len(),
        seq.as_array().unwrap().len()
    );
    // The float64 transformers reference.
    let bytes = std::fs::read(testdata(name).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let expected: Vec<f64> = st
        .tensor("next_logprobs.1")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    for (g, e) in got.iter().zip(&expected) {
        assert!((g.as_f64().unwrap() - e).abs() < 1e-4, "{name}: {g} vs {e}");
    }
    // `--precision bf16-mixed`: bf16 activations move the log-probs, within bf16's resolution.
    let mixed = json_ok(&[
        "logprobs",
        "--model",
        testdata(name).to_str().unwrap(),
        "--ids",
        &ids_arg(seq),
        "--json",
        "--precision",
        "bf16-mixed",
    ]);
    let mixed = mixed["token_logprobs"].as_array().unwrap();
    let worst = mixed
        .iter()
        .zip(&expected)
        .map(|(g, e)| (g.as_f64().unwrap() - e).abs())
        .fold(0.0, f64::max);
    assert!(
        worst > 0.0 && worst < 0.1,
        "bf16-mixed log-probs differ by {worst}"
    );
}

#[test]
fn tokenize_matches_chat_fixtures() {
    let tok = testdata("qwen3-tokenizer");
    let cases: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(testdata("chat_template_cases.json")).unwrap(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    for case in cases
        .iter()
        .filter(|c| c["add_generation_prompt"] == true && c["enable_thinking"] != true)
    {
        let path = dir.path().join("messages.json");
        std::fs::write(&path, case["messages"].to_string()).unwrap();
        let mut args = vec![
            "tokenize",
            "--model",
            tok.to_str().unwrap(),
            "--messages",
            path.to_str().unwrap(),
            "--json",
        ];
        if case["enable_thinking"] == false {
            args.push("--no-thinking");
        }
        assert_eq!(json_ok(&args)["ids"], case["ids"], "{}", case["name"]);
    }
    let out = json_ok(&[
        "tokenize",
        "--model",
        tok.to_str().unwrap(),
        "--text",
        "Hello, doctor",
        "--json",
    ]);
    assert_eq!(out["ids"], serde_json::json!([9707, 11, 10668]));
}

#[test]
fn bad_input_gives_clear_errors() {
    let m = testdata("qwen3/tied-gqa-f32");
    let m = m.to_str().unwrap();
    let err = stderr_of_failure(&["generate", "--model", m, "--ids", "1,x,3"]);
    assert!(err.contains("--ids") && err.contains("`x`"), "{err}");
    let err = stderr_of_failure(&["generate", "--model", m, "--ids", "999999"]);
    assert!(
        err.contains("999999") && err.contains("vocabulary"),
        "{err}"
    );
    let err = stderr_of_failure(&["generate", "--model", m, "--prompt", "hello"]);
    assert!(
        err.contains("tokenizer.json") && err.contains("--ids"),
        "{err}"
    );
    let err = stderr_of_failure(&["generate", "--model", m, "--ids", "1", "--top-p", "1.5"]);
    assert!(err.contains("top_p"), "{err}");
    let err = stderr_of_failure(&["logprobs", "--model", m, "--ids", "1", "--precision", "fp8"]);
    assert!(
        err.contains("`fp8` is not a precision (allowed: f32, bf16-mixed)"),
        "{err}"
    );
    let err = stderr_of_failure(&["logprobs", "--model", m, "--ids", "1", "--device", "tpu"]);
    assert!(err.contains("unknown device `tpu`"), "{err}");
    let err = stderr_of_failure(&[
        "logprobs",
        "--model",
        m,
        "--ids",
        "1",
        "--attention-kernels",
        "fast",
    ]);
    assert!(
        err.contains(
            "`fast` is not an attention kernel choice (allowed: auto, tensor-core, portable)"
        ),
        "{err}"
    );
    // The CPU has only the portable kernels: asking for tensor cores names why.
    let err = stderr_of_failure(&[
        "logprobs",
        "--model",
        m,
        "--ids",
        "1",
        "--attention-kernels",
        "tensor-core",
    ]);
    assert!(
        err.contains("--attention-kernels: attention_kernels = \"tensor-core\"")
            && err.contains("no `tensor-core` attention kernels"),
        "{err}"
    );
    #[cfg(not(feature = "cuda"))]
    {
        let err = stderr_of_failure(&[
            "logprobs", "--model", m, "--ids", "1,2", "--device", "cuda:0",
        ]);
        assert!(err.contains("--features cuda"), "{err}");
    }
    let err = stderr_of_failure(&["generate", "--model", "Qwen/Qwen3-0.6B", "--ids", "1"]);
    assert!(
        err.contains("HF_HUB_OFFLINE") && err.contains("local directory"),
        "{err}"
    );
    assert!(
        !err.contains("stack backtrace") && !err.contains("panicked"),
        "{err}"
    );
}

/// A model whose weights hold a NaN is refused when loaded, naming the tensor, instead of
/// printing `null` log-probabilities; `rubrics import` will not write over its input.
#[test]
fn nonfinite_weights_and_self_overwrites_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for e in std::fs::read_dir(testdata("qwen3/tied-gqa-f32")).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, model.join(p.file_name().unwrap())).unwrap();
        }
    }
    let st = model.join("model.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let name = "model.norm.weight";
    let start = header[name]["data_offsets"][0].as_u64().unwrap() as usize + 8 + header_len;
    bytes[start..start + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&st, bytes).unwrap();
    let logprobs = || {
        stderr_of_failure(&[
            "logprobs",
            "--model",
            model.to_str().unwrap(),
            "--ids",
            "1,2,3",
            "--json",
        ])
    };
    let err = logprobs();
    assert!(
        err.contains(name) && err.contains("1 of 64 values are not finite"),
        "{err}"
    );

    // A header whose offsets lie (one tensor 4 bytes longer than its shape): named too.
    let mut bytes =
        std::fs::read(testdata("qwen3/tied-gqa-f32").join("model.safetensors")).unwrap();
    let header = &mut bytes[8..8 + header_len];
    let at = header
        .windows(13)
        .position(|w| w == b"361856,362112")
        .expect("the norm's offsets in the header");
    header[at..at + 13].copy_from_slice(b"361856,362116");
    std::fs::write(&st, bytes).unwrap();
    let err = logprobs();
    assert!(
        err.contains(name)
            && err
                .contains("data_offsets [361856, 362116] lie outside the file's 362112 data bytes"),
        "{err}"
    );

    let rubrics = dir.path().join("in.jsonl");
    let original = "{\"prompt\": \"q\", \"rubric\": []}\n";
    std::fs::write(&rubrics, original).unwrap();
    let path = rubrics.to_str().unwrap();
    let err = stderr_of_failure(&["rubrics", "import", "--format", "rar", path, path]);
    assert!(err.contains("the output is the input file"), "{err}");
    assert_eq!(std::fs::read_to_string(&rubrics).unwrap(), original);
}

/// `conrub allreduce-check` on three simulated CPU ranks: the all-reduce, and the reduce-scatter
/// then all-gather of the same buckets (uneven parts), equal the host collective's and each
/// other (what `scripts/gpu-check.sh` runs over NCCL).
#[test]
fn allreduce_check_covers_the_sharded_collectives() {
    let out = conrub(&[
        "allreduce-check",
        "--devices",
        "cpu,cpu,cpu",
        "--mb",
        "0.01",
        "--buckets",
        "2",
        "--iters",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("(all-reduce, reduce-scatter, all-gather): 3 ranks"),
        "{stdout}"
    );
    assert!(
        stdout.contains("max |all-gathered reduce-scatter - all-reduce|: 0.000e0"),
        "{stdout}"
    );
}
