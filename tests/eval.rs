//! `conrub eval mcq` end to end on a tiny model with the real tokenizer and the bundled samples.

use std::path::Path;
use std::process::Command;

use burn::backend::Flex;
use conrub_qwen3::{save_pretrained, Qwen3Config, Qwen3ForCausalLM, SaveDtype};

/// A tiny random Qwen3 with the full vocabulary and the real tokenizer, saved under `dir/tiny`.
fn tiny_model(dir: &Path, seed: u64) -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let model = dir.join("tiny");
    let config = Qwen3Config::tiny(151_936);
    let m = Qwen3ForCausalLM::<Flex>::random(&config, 0.02, seed, &Default::default());
    save_pretrained(&m, &config, None, Some(&root.join("models/qwen3/testdata/qwen3-tokenizer")), &model, SaveDtype::F32).unwrap();
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
            .args(["eval", "mcq", "--format", format, "--max-new-tokens", "6", "--batch-size", "3"])
            .arg("--data")
            .arg(root.join(format!("data/samples/eval/{format}.jsonl")))
            .arg("--model")
            .arg(&model)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{format}: {}", String::from_utf8_lossy(&o.stderr));
        let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
        let rows: Vec<serde_json::Value> =
            std::fs::read_to_string(out.join("examples.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(rows.len(), 3);
        let s = &report["summary"];
        assert_eq!(s["n"], 3);
        let correct = rows.iter().filter(|r| r["correct"] == true).count();
        let invalid = rows.iter().filter(|r| r["extracted"].is_null()).count();
        assert_eq!(s["correct"].as_u64().unwrap() as usize, correct);
        assert_eq!(s["invalid"].as_u64().unwrap() as usize, invalid);
        assert!(rows.iter().all(|r| r["response_tokens"].as_u64().unwrap() <= 6));
        assert_eq!(report["settings"]["decoding"], "greedy");
        let gold: Vec<&str> = rows.iter().map(|r| r["gold"].as_str().unwrap()).collect();
        let want: &[&str] = match format {
            "medmcqa" => &["B", "C", "A"],
            "pubmedqa" => &["yes", "no", "maybe"],
            _ => &["C", "D", "B"],
        };
        assert_eq!(gold, want, "{format}: gold labels read from the rows");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(["eval", "compare"])
        .arg(dir.path().join("medmcqa/report.json"))
        .arg(dir.path().join("mmlu/report.json"))
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && table.contains("accuracy") && table.contains("B - A"), "{table}");
}

#[test]
fn rubric_grading_report_on_healthbench_samples() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 4);
    let out = dir.path().join("hb");
    let o = Command::new(env!("CARGO_BIN_EXE_conrub"))
        .args(["eval", "rubric", "--samples", "2", "--max-new-tokens", "6", "--seed", "5"])
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
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["kind"], "rubric");
    assert_eq!(report["summary"]["examples"], 4, "2 examples x 2 samples");
    let score = report["summary"]["score"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&score));
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.join("examples.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 4);
    assert_eq!(rows[0]["items"].as_array().unwrap().len(), 4, "every rubric item graded, the negative one included");
    assert_eq!(rows[2]["items"].as_array().unwrap().len(), 2);
    assert!(report["summary"]["by_example_tag"].get("theme:emergency_referrals").is_some());
}
