//! `conrub eval mcq` end to end on a tiny model with the real tokenizer and the bundled samples.

use std::path::Path;
use std::process::Command;

use burn::backend::Flex;
use conrub_models::{save_pretrained, CausalLm, ModelConfig, SaveDtype};

/// A tiny random Qwen3 with the full vocabulary and the real tokenizer, saved under `dir/tiny`.
fn tiny_model(dir: &Path, seed: u64) -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let model = dir.join("tiny");
    let config = ModelConfig::tiny(151_936);
    let m = CausalLm::<Flex>::random(&config, 0.02, seed, &Default::default());
    save_pretrained(
        &m,
        &config,
        None,
        Some(&root.join("models/testdata/qwen3-tokenizer")),
        &model,
        SaveDtype::F32,
    )
    .unwrap();
    model
}

#[test]
fn mcq_reports_are_consistent_for_every_format() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 3);
    for format in ["medmcqa", "pubmedqa", "mmlu"] {
        let out = dir.path().join(format);
        let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
            .args([
                "eval",
                "mcq",
                "--format",
                format,
                "--max-new-tokens",
                "6",
                "--batch-size",
                "3",
            ])
            .arg("--data")
            .arg(root.join(format!("data/samples/eval/{format}.jsonl")))
            .arg("--model")
            .arg(&model)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{format}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap())
                .unwrap();
        let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.join("examples.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 3);
        let s = &report["summary"];
        assert_eq!(s["n"], 3);
        let correct = rows.iter().filter(|r| r["correct"] == true).count();
        let invalid = rows.iter().filter(|r| r["extracted"].is_null()).count();
        assert_eq!(s["correct"].as_u64().unwrap() as usize, correct);
        assert_eq!(s["invalid"].as_u64().unwrap() as usize, invalid);
        assert!(rows
            .iter()
            .all(|r| r["response_tokens"].as_u64().unwrap() <= 6));
        assert_eq!(report["settings"]["decoding"], "greedy");
        let gold: Vec<&str> = rows.iter().map(|r| r["gold"].as_str().unwrap()).collect();
        let want: &[&str] = match format {
            "medmcqa" => &["B", "C", "A"],
            "pubmedqa" => &["yes", "no", "maybe"],
            _ => &["C", "D", "B"],
        };
        assert_eq!(gold, want, "{format}: gold labels read from the rows");
        if format == "medmcqa" {
            assert_eq!(report["by_subject"]["Pharmacology"]["n"], 2);
            assert_eq!(report["by_subject"]["Medicine"]["n"], 1);
        }
    }
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(["eval", "compare"])
        .arg(dir.path().join("medmcqa/report.json"))
        .arg(dir.path().join("mmlu/report.json"))
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && table.contains("accuracy") && table.contains("B - A"),
        "{table}"
    );
}

#[test]
fn rubric_grading_report_on_healthbench_samples() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 4);
    let out = dir.path().join("hb");
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args([
            "eval",
            "rubric",
            "--samples",
            "2",
            "--max-new-tokens",
            "6",
            "--seed",
            "5",
        ])
        .arg("--data")
        .arg(root.join("data/samples/healthbench.jsonl"))
        .arg("--model")
        .arg(&model)
        .arg("--grader")
        .arg(root.join("configs/judge-lexical.toml"))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["kind"], "rubric");
    assert_eq!(report["summary"]["examples"], 4, "2 examples x 2 samples");
    let score = report["summary"]["score"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&score));
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.join("examples.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 4);
    assert_eq!(
        rows[0]["items"].as_array().unwrap().len(),
        4,
        "every rubric item graded, the negative one included"
    );
    assert_eq!(rows[2]["items"].as_array().unwrap().len(), 2);
    assert!(report["summary"]["by_example_tag"]
        .get("theme:emergency_referrals")
        .is_some());
}

/// The grader is a scripted OpenAI-compatible server on loopback. It labels criterion `i` by `i % 3`
/// (binary: yes, no, no; three-state: correct, missing, wrong), so every score is known by hand.
/// A rerun answers from the grader cache and makes no call.
#[test]
fn rubric_grading_through_a_loopback_grader_is_exact_and_cached() {
    use conrub_judge::testing::ScriptedServer;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(ScriptedServer::start(10, 0));
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 5);
    let grader = dir.path().join("grader.toml");
    std::fs::write(
        &grader,
        format!("kind = \"openai\"\nurl = \"{}\"\nmodel = \"scripted\"\ntimeout_secs = 5\nmax_retries = 1\ncache = \"cache/grader.sqlite\"\n", server.url),
    )
    .unwrap();
    // One HealthBench row and one of our rubric records in the same file.
    let data = dir.path().join("mixed.jsonl");
    let hb = std::fs::read_to_string(root.join("data/samples/healthbench.jsonl"))
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_string();
    let ours = std::fs::read_to_string(root.join("data/samples/rubrics.jsonl"))
        .unwrap()
        .lines()
        .nth(2)
        .unwrap()
        .to_string();
    std::fs::write(&data, format!("{hb}\n{ours}\n")).unwrap();
    let run = |out: &Path| {
        let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
            .args(["eval", "rubric", "--max-new-tokens", "4", "--seed", "1"])
            .arg("--data")
            .arg(&data)
            .arg("--model")
            .arg(&model)
            .arg("--grader")
            .arg(&grader)
            .arg("--out")
            .arg(out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap())
                .unwrap();
        report
    };
    let first = run(&dir.path().join("a"));
    let calls = server.requests();
    assert_eq!(calls, 4, "2 responses x (points + three-state)");
    // HealthBench row: items 10, 9, 5, -6 graded yes, no, no, yes: (10 - 6) / 24.
    // Our record med-0003: 4 content criteria, 1 point each, graded yes, no, no, yes: 2 / 4.
    let s = &first["summary"];
    assert!(
        (s["score"].as_f64().unwrap() - (4.0 / 24.0 + 0.5) / 2.0).abs() < 1e-12,
        "{s}"
    );
    // Three-state: HealthBench row has 3 positive items + 2 controls: +1, 0, -1, +1, 0 -> 1/5;
    // med-0003 has 4 + 2 criteria: +1, 0, -1, +1, 0, -1 -> 0.
    let t = &first["three_state"];
    assert!((t["mean"].as_f64().unwrap() - 0.1).abs() < 1e-12, "{t}");
    assert!(
        (t["labels"]["wrong"].as_f64().unwrap() - 3.0 / 11.0).abs() < 1e-12,
        "{t}"
    );
    assert_eq!(first["timings"]["grader_calls"], 4);
    assert_eq!(first["model"]["checkpoint_step"], serde_json::Value::Null);

    let second = run(&dir.path().join("b"));
    assert_eq!(server.requests(), calls, "the rerun makes no grader calls");
    assert_eq!(second["timings"]["grader_calls"], 0);
    assert_eq!(second["timings"]["grader_answers_from_cache"], 4);
    assert_eq!(second["summary"], first["summary"]);
    assert_eq!(second["three_state"], first["three_state"]);
}
