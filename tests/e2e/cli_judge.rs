//! End-to-end tests of `conrub rubrics`, `conrub score` and `conrub judge-pair`: the bundled sample
//! data, the lexical judge, a scripted OpenAI-compatible server on loopback, and the in-process
//! judge on a tiny Qwen3 with the real tokenizer.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use conrub_judge::testing::ScriptedServer;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn sample(name: &str) -> String {
    root().join("data/samples").join(name).display().to_string()
}

fn conrub(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("binary runs")
}

fn ok(args: &[&str]) -> Output {
    let out = conrub(args);
    assert!(
        out.status.success(),
        "conrub {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn rows(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn validate_accepts_samples_and_names_the_problem() {
    let out = ok(&["rubrics", "validate", &sample("rubrics.jsonl")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("8 records, 52 criteria (36 content + 16 global controls)"),
        "{text}"
    );

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    let first = std::fs::read_to_string(sample("rubrics.jsonl"))
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_string();
    let mut v: serde_json::Value = serde_json::from_str(&first).unwrap();
    v["criteria"][2]["text"] = "The response does not recommend ibuprofen.".into();
    std::fs::write(&bad, format!("{first}\n{v}\n")).unwrap();
    let out = conrub(&["rubrics", "validate", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("line 2 (id med-0001): id: duplicate id (first on line 1)"),
        "{text}"
    );
    assert!(
        text.contains("line 2 (id med-0001): criteria[2].text: rewards absence"),
        "{text}"
    );

    std::fs::write(&bad, "{\"id\": \"x\", \"question\": \"q\", \"criteria\": [{\"text\": \"t\", \"kind\": \"content\", \"reference_coverage\": \"maybe\"}]}\n").unwrap();
    let out = conrub(&["rubrics", "validate", bad.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.jsonl:1: criteria[0].reference_coverage: unknown variant `maybe`"),
        "{err}"
    );
}

#[test]
fn import_each_public_format() {
    let dir = tempfile::tempdir().unwrap();
    for (format, records) in [("rar", 2), ("rubrichub", 2), ("healthbench", 2)] {
        let out_path = dir.path().join(format!("{format}.jsonl"));
        let out = ok(&[
            "rubrics",
            "import",
            "--format",
            format,
            &sample(&format!("{format}.jsonl")),
            out_path.to_str().unwrap(),
        ]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("validation: 0 errors"), "{text}");
        let recs = rows(&out_path);
        assert_eq!(recs.len(), records);
        for r in &recs {
            assert_eq!(r["provenance"]["format"], format);
            let n = r["criteria"].as_array().unwrap().len();
            assert_eq!(r["criteria"][n - 1]["kind"], "global_control");
        }
    }
    let err = String::from_utf8_lossy(
        &conrub(&["rubrics", "import", "--format", "csv", "a", "b"]).stderr,
    )
    .into_owned();
    assert!(
        err.contains("allowed: rar, rubrichub, healthbench"),
        "{err}"
    );
}

#[test]
fn score_with_the_lexical_judge_and_token_counts() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("scores.jsonl");
    let tok = root().join("models/testdata/qwen3-tokenizer");
    let out = ok(&[
        "score",
        "--rubrics",
        &sample("rubrics.jsonl"),
        "--responses",
        &sample("responses.jsonl"),
        "--judge",
        &root()
            .join("configs/judge-lexical.toml")
            .display()
            .to_string(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--max-response-tokens",
        "50",
        "--length-buffer",
        "20",
        "--out",
        out_path.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("scored 6/6 responses"), "{err}");
    assert!(err.contains("unscored: 0 of 6 responses"), "{err}");
    let r = rows(&out_path);
    assert_eq!(r.len(), 6);
    // The good chest-pain answer beats the dismissive one; the unsafe ibuprofen answer is negative.
    let reward = |i: usize| r[i]["reward"]["value"].as_f64().unwrap();
    assert!(reward(0) > reward(1));
    assert!(reward(4) < 0.0);
    for x in &r {
        let tokens = x["response_tokens"].as_u64().unwrap();
        let pen = x["length_penalty"].as_f64().unwrap();
        let want = if tokens <= 30 {
            0.0
        } else if tokens > 50 {
            -1.0
        } else {
            (30.0 - tokens as f64) / 20.0
        };
        assert!((pen - want).abs() < 1e-12, "{tokens} tokens: penalty {pen}");
        let mean = x["criteria_mean"].as_f64().unwrap();
        assert!((x["reward"]["value"].as_f64().unwrap() - (mean + pen)).abs() < 1e-12);
    }
}

fn write_judge_config(dir: &Path, url: &str) -> PathBuf {
    let p = dir.join("judge.toml");
    std::fs::write(
        &p,
        format!(
            "kind = \"openai\"\nurl = \"{url}\"\nmodel = \"scripted\"\ntimeout_secs = 2\nmax_retries = 2\nbackoff_base_secs = 0.01\nbackoff_max_secs = 0.02\ncache = \"cache/judge.sqlite\"\n"
        ),
    )
    .unwrap();
    p
}

#[test]
fn score_and_judge_pair_against_a_loopback_server_with_cache() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(ScriptedServer::start(10, 0));
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_judge_config(dir.path(), &server.url);
    let responses = dir.path().join("responses.jsonl");
    std::fs::write(
        &responses,
        concat!(
            "{\"prompt_id\": \"med-0003\", \"responses\": [\"Metformin.\", \"[[garbage]] answer\", \"[[500-twice]] answer\"], \"response_tokens\": 5}\n",
            "{\"prompt_id\": \"med-0006\", \"response\": \"[[all-correct]] HbA1c.\"}\n",
        ),
    )
    .unwrap();
    let out1 = dir.path().join("a.jsonl");
    let args = |out: &Path| {
        vec![
            "score".to_string(),
            "--rubrics".into(),
            sample("rubrics.jsonl"),
            "--responses".into(),
            responses.display().to_string(),
            "--judge".into(),
            cfg.display().to_string(),
            "--out".into(),
            out.display().to_string(),
        ]
    };
    let a1: Vec<String> = args(&out1);
    let out = ok(&a1.iter().map(String::as_str).collect::<Vec<_>>());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("scored 3/4 responses (1 unscored)"), "{err}");
    assert!(
        err.contains(
            "unscored: 1 of 4 responses (no valid judge output within the retry budget); first: "
        ),
        "{err}"
    );
    assert!(
        err.contains(":1 (prompt_id `med-0003`, response 1) after 3 attempts: "),
        "{err}"
    );
    let r = rows(&out1);
    // med-0003 has 4 content criteria + 2 controls: correct, missing, wrong, correct, missing, wrong.
    assert_eq!(r[0]["reward"]["value"], 0.0);
    assert_eq!(r[1]["status"], "unscored");
    assert_eq!(r[1]["attempts"], 3);
    let raw = std::fs::read_to_string(&out1).unwrap();
    let unscored_line = raw.lines().nth(1).unwrap();
    assert_eq!(
        unscored_line.matches("\"attempts\"").count(),
        1,
        "one `attempts` key: {unscored_line}"
    );
    assert!(
        r[1].get("reward").is_none(),
        "unscored rows carry no reward"
    );
    assert_eq!(r[2]["attempts"], 3);
    assert_eq!(r[3]["reward"]["value"], 1.0);
    let calls = server.requests();

    let out2 = dir.path().join("b.jsonl");
    let a2: Vec<String> = args(&out2);
    let out = ok(&a2.iter().map(String::as_str).collect::<Vec<_>>());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("3 from cache"), "{err}");
    assert_eq!(
        server.requests(),
        calls + 3,
        "only the unscored response is asked again (3 attempts)"
    );
    let r2 = rows(&out2);
    for (x, y) in r.iter().zip(&r2) {
        assert_eq!(x["labels"], y["labels"]);
        assert_eq!(x["reward"], y["reward"]);
    }

    let (fa, fb) = (dir.path().join("a.txt"), dir.path().join("b.txt"));
    std::fs::write(&fa, "A vague answer.").unwrap();
    std::fs::write(&fb, "A good answer: metformin.").unwrap();
    let out = ok(&[
        "judge-pair",
        "--rubrics",
        &sample("rubrics.jsonl"),
        "--prompt-id",
        "med-0003",
        "--a",
        fa.to_str().unwrap(),
        "--b",
        fb.to_str().unwrap(),
        "--judge",
        cfg.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("A shown first: verdict B"), "{text}");
    assert!(text.contains("B shown first: verdict A"), "{text}");
    assert!(
        text.contains("accepted: PreferB (advantages A -1, B +1)"),
        "{text}"
    );
    assert!(text.contains("raw: ```json"), "{text}");
}

#[test]
fn score_fails_when_nothing_could_be_scored_but_writes_the_rows() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(ScriptedServer::start(10, 0));
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_judge_config(dir.path(), &server.url);
    let responses = dir.path().join("responses.jsonl");
    std::fs::write(&responses, "{\"prompt_id\": \"med-0003\", \"responses\": [\"[[garbage]] one\", \"[[garbage]] two\"]}\n").unwrap();
    let out_path = dir.path().join("scores.jsonl");
    let out = conrub(&[
        "score",
        "--rubrics",
        &sample("rubrics.jsonl"),
        "--responses",
        responses.to_str().unwrap(),
        "--judge",
        cfg.to_str().unwrap(),
        "--out",
        out_path.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "every response unscored must fail the command: {err}"
    );
    assert!(err.contains("scored 0/2 responses (2 unscored)"), "{err}");
    assert!(err.contains("unscored: 2 of 2 responses"), "{err}");
    assert!(err.contains("error: no response could be scored (2 of 2 unscored); the unscored rows were written to"), "{err}");
    let r = rows(&out_path);
    assert_eq!(r.len(), 2, "the output is written before the command fails");
    assert!(
        r.iter()
            .all(|x| x["status"] == "unscored" && x["attempts"] == 3),
        "{r:?}"
    );
}

#[test]
fn score_with_the_in_process_judge_in_logprob_margin_mode() {
    use burn::backend::Flex;
    use conrub_models::{save_pretrained, CausalLm, ModelConfig, SaveDtype};
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("tiny-judge");
    let config = ModelConfig::tiny(151_936);
    let model = CausalLm::<Flex>::random(&config, 0.5, 11, &Default::default());
    save_pretrained(
        &model,
        &config,
        None,
        Some(&root().join("models/testdata/qwen3-tokenizer")),
        &model_dir,
        SaveDtype::F32,
    )
    .unwrap();
    let cfg = dir.path().join("judge.toml");
    std::fs::write(&cfg, "kind = \"local\"\nmodel = \"tiny-judge\"\n[local]\nmode = \"logprob-margin\"\nbatch_size = 4\n").unwrap();
    let out_path = dir.path().join("s.jsonl");
    let out = ok(&[
        "score",
        "--rubrics",
        &sample("rubrics.jsonl"),
        "--responses",
        &sample("responses.jsonl"),
        "--judge",
        cfg.to_str().unwrap(),
        "--mode",
        "binary",
        "--out",
        out_path.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("scored 6/6 responses"));
    for r in rows(&out_path) {
        let labels = r["labels"].as_array().unwrap();
        assert!(labels.iter().all(|l| l == "yes" || l == "no"));
        assert_eq!(r["margins"].as_array().unwrap().len(), labels.len());
    }
}

/// The probe path end to end: `conrub score` with a served judge (a scripted server) fills its
/// cache; `conrub judge distill --cache` trains a probe on a tiny Qwen3 from it and prints one
/// JSON report; `conrub score` with `kind = "probe"` scores every sample response from it; a
/// rerun of the distillation computes no feature again; errors name the file or the flag.
#[test]
fn distill_a_probe_from_a_judge_cache_and_score_with_it() {
    use burn::backend::Flex;
    use conrub_models::{save_pretrained, CausalLm, ModelConfig, SaveDtype};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(ScriptedServer::start(0, 0));
    let dir = tempfile::tempdir().unwrap();
    let served = write_judge_config(dir.path(), &server.url);
    let scored = dir.path().join("served.jsonl");
    ok(&[
        "score",
        "--rubrics",
        &sample("rubrics.jsonl"),
        "--responses",
        &sample("responses.jsonl"),
        "--judge",
        served.to_str().unwrap(),
        "--out",
        scored.to_str().unwrap(),
    ]);
    let cache = dir.path().join("cache/judge.sqlite");
    assert!(cache.exists());

    let model_dir = dir.path().join("tiny-probe");
    let config = ModelConfig::tiny(151_936);
    let model = CausalLm::<Flex>::random(&config, 0.5, 5, &Default::default());
    let tokenizer = root().join("models/testdata/qwen3-tokenizer");
    save_pretrained(
        &model,
        &config,
        None,
        Some(&tokenizer),
        &model_dir,
        SaveDtype::F32,
    )
    .unwrap();
    let out_dir = dir.path().join("probe");
    let distill = |extra: &[&str]| {
        let mut args = vec![
            "judge",
            "distill",
            "--cache",
            cache.to_str().unwrap(),
            "--model",
            model_dir.to_str().unwrap(),
            "--out",
            out_dir.to_str().unwrap(),
            "--holdout",
            "0.34",
            "--json",
        ];
        args.extend(extra);
        let out = ok(&args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let last = stdout.lines().last().unwrap().to_string();
        let report: serde_json::Value = serde_json::from_str(&last).unwrap();
        (report, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (report, log) = distill(&[]);
    // 6 responses of 5 prompts; every criterion is a row; prompts, not rows, are held out.
    let rows_total = report["train"]["rows"].as_u64().unwrap()
        + report["heldout_counts"]["rows"].as_u64().unwrap();
    assert_eq!(report["caches"]["used_verdicts"], 6, "{report}");
    let criteria: usize = rows(&scored)
        .iter()
        .map(|r| r["labels"].as_array().unwrap().len())
        .sum();
    assert_eq!(rows_total, criteria as u64, "{report}");
    assert_eq!(
        report["train"]["prompts"].as_u64().unwrap()
            + report["heldout_counts"]["prompts"].as_u64().unwrap(),
        5
    );
    for k in ["accuracy", "macro_f1", "kappa", "per_class", "ece"] {
        assert!(report["heldout"].get(k).is_some(), "{k}: {report}");
    }
    assert_eq!(report["chosen_by"], "sweep");
    assert_eq!(report["sweep"].as_array().unwrap().len(), 4);
    assert!(
        log.contains("held out (") && log.contains("wrote "),
        "{log}"
    );
    assert_eq!(report["features_reused"], 0);
    let (again, _) = distill(&[]);
    assert_eq!(again["features_computed"], 0);
    assert_eq!(again["features_reused"].as_u64().unwrap(), rows_total);

    let probe_cfg = dir.path().join("probe.toml");
    std::fs::write(
        &probe_cfg,
        "kind = \"probe\"\nmodel = \"tiny-probe\"\nprobe = \"probe/probe.safetensors\"\n",
    )
    .unwrap();
    let out_path = dir.path().join("probe.jsonl");
    let out = ok(&[
        "score",
        "--rubrics",
        &sample("rubrics.jsonl"),
        "--responses",
        &sample("responses.jsonl"),
        "--judge",
        probe_cfg.to_str().unwrap(),
        "--out",
        out_path.to_str().unwrap(),
    ]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("scored 6/6 responses"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for r in rows(&out_path) {
        assert!(r["labels"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l == "correct" || l == "missing" || l == "wrong"));
    }

    // Bad input names what is wrong.
    let labels = dir.path().join("labels.jsonl");
    std::fs::write(&labels, "{\"prompt_id\":\"a\",\"prompt\":\"q\",\"criterion\":\"c\",\"response\":\"r\",\"label\":\"maybe\"}\n").unwrap();
    let out = conrub(&[
        "judge",
        "distill",
        "--labels",
        labels.to_str().unwrap(),
        "--model",
        model_dir.to_str().unwrap(),
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("labels.jsonl:1: label: `maybe`"), "{err}");
    let out = conrub(&[
        "judge",
        "distill",
        "--cache",
        "nope.sqlite",
        "--model",
        "m",
        "--out",
        "o",
        "--holdout",
        "1.5",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--holdout: 1.5"));
}

/// `score --out` onto one of its own inputs is refused before anything is judged, and the input
/// is left as it was (issue 53, item 2).
#[test]
fn score_refuses_to_write_over_its_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let responses = dir.path().join("responses.jsonl");
    let text = "{\"prompt_id\": \"med-0003\", \"response\": \"rest and fluids\"}\n";
    std::fs::write(&responses, text).unwrap();
    let rubrics = dir.path().join("rubrics.jsonl");
    std::fs::copy(sample("rubrics.jsonl"), &rubrics).unwrap();
    let judge = dir.path().join("judge.toml");
    std::fs::write(&judge, "kind = \"lexical\"\n").unwrap();
    let args = |out: &Path| {
        vec![
            "score".to_string(),
            "--rubrics".into(),
            rubrics.display().to_string(),
            "--responses".into(),
            responses.display().to_string(),
            "--judge".into(),
            judge.display().to_string(),
            "--out".into(),
            out.display().to_string(),
        ]
    };
    for (input, flag) in [
        (&responses, "--responses"),
        (&rubrics, "--rubrics"),
        (&judge, "--judge"),
    ] {
        let before = std::fs::read(input).unwrap();
        // Another spelling of the same path is the same file.
        let spelled = dir.path().join(".").join(input.file_name().unwrap());
        let a = args(&spelled);
        let out = conrub(&a.iter().map(String::as_str).collect::<Vec<_>>());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag}: {err}");
        assert!(
            err.contains(&format!("the output is the {flag} file")),
            "{err}"
        );
        assert_eq!(
            std::fs::read(input).unwrap(),
            before,
            "{flag} was rewritten"
        );
    }
    let fresh = dir.path().join("scores.jsonl");
    let a = args(&fresh);
    ok(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(rows(&fresh).len(), 1);
}
