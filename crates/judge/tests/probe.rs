//! Probe judges on a tiny random Qwen3 (saved to a directory, so the probe's model hash covers its
//! weights) with the real Qwen3 tokenizer.
//!
//! The labelled set follows a rule that a model's features can carry: every criterion of the
//! bundled sample rubrics gets three responses, one per label. The teacher labels a criterion
//! `correct` when the response endorses the criterion's content (it opens with "Yes, I recommend
//! this:"), `wrong` when it rejects it ("No, never do this:") and `missing` when the response is
//! about something else. The labels thus depend on the response, never on the criterion alone
//! (each criterion carries all three labels), and the split holds prompts out, never rows.

use conrub_judge::JudgeBuild;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use burn::backend::Flex;
use conrub_judge::probe::{
    distill, Abstention, DistillConfig, LabelledExample, LinearProbe, ProbeFeaturizer, ProbeJudge,
};
use conrub_judge::testing::{Reply, ScriptedServer};
use conrub_judge::{CriterionJudge, CriterionRequest, JudgeConfig, PromptSet};
use conrub_models::{save_pretrained, CausalLm, ModelConfig, Pretrained, SaveDtype};
use conrub_rubric::{read_rubrics, Label, RubricRecord, RubricSet, ScoringMode};

type B = Flex;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A tiny random Qwen3 (full vocabulary) written as a Hugging Face directory under `dir`.
fn save_tiny_model(dir: &Path, seed: u64) -> PathBuf {
    let config = ModelConfig::tiny(151_936);
    let model = CausalLm::<B>::random(&config, 0.5, seed, &Default::default());
    let tokenizer = root().join("models/testdata/qwen3-tokenizer");
    let out = dir.join(format!("tiny-{seed}"));
    save_pretrained(
        &model,
        &config,
        None,
        Some(&tokenizer),
        &out,
        SaveDtype::F32,
    )
    .unwrap();
    out
}

fn featurizer(model_dir: &Path) -> ProbeFeaturizer<B> {
    let model = Pretrained::<B>::load_dir(model_dir, &Default::default()).unwrap();
    ProbeFeaturizer::new(model, Default::default(), PromptSet::default(), 16).unwrap()
}

fn records() -> Vec<RubricRecord> {
    read_rubrics(&root().join("data/samples/rubrics.jsonl"))
        .unwrap()
        .iter()
        .cloned()
        .collect()
}

/// The rule's rows (see the file's doc comment).
fn rule_rows() -> Vec<LabelledExample> {
    let mut rows = Vec::new();
    for r in records() {
        let question = conrub_rubric::record::messages_text(&r.question);
        for c in r.criterion_texts() {
            let content = c.trim_start_matches("The response ").trim_end_matches('.');
            for (label, response) in [
                (Label::Correct, format!("Yes, I recommend this: {content}.")),
                (Label::Wrong, format!("No, never do this: {content}.")),
                (
                    Label::Missing,
                    "Let us talk about something else: the weather is mild today.".to_string(),
                ),
            ] {
                rows.push(LabelledExample {
                    prompt_id: r.id.clone(),
                    prompt: question.clone(),
                    criterion: c.clone(),
                    response,
                    label,
                });
            }
        }
    }
    rows
}

#[test]
fn the_probe_learns_the_rule_from_features_and_not_from_leakage() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = save_tiny_model(dir.path(), 1);
    let f = featurizer(&model_dir);
    let rows = rule_rows();
    let cfg = DistillConfig {
        holdout: 0.5,
        ..Default::default()
    };
    let out = dir.path().join("probe");
    let report = distill(
        &f,
        "tiny",
        ScoringMode::ThreeState,
        &rows,
        &cfg,
        &out,
        &mut |_, _| {},
    )
    .unwrap();
    eprintln!(
        "rule: held out {} rows, kappa {:.3}, accuracy {:.3}, macro-F1 {:.3}; sweep {:?}",
        report.heldout.rows,
        report.heldout.kappa,
        report.heldout.accuracy,
        report.heldout.macro_f1,
        report
            .sweep
            .iter()
            .map(|s| (
                s.layer,
                s.pooling.as_str(),
                (s.kappa * 1000.0).round() / 1000.0
            ))
            .collect::<Vec<_>>()
    );
    // Held out by prompt: 4 of the 8 prompts, every row of each.
    assert_eq!(report.heldout_counts.prompts, 4);
    assert_eq!(report.train.prompts + report.heldout_counts.prompts, 8);
    assert_eq!(
        report.train.rows + report.heldout_counts.rows,
        rows.len() as u64
    );
    // The sweep tried every candidate layer with both poolings, on training prompts only.
    assert_eq!(report.sweep.len(), 4);
    // Mean pooling reads each criterion's own span (from where its prompt departs from the
    // template), whatever it is batched with: kappa 0.540, macro-F1 0.701 on this 2-layer random
    // model, against about 0 for the shuffled labels below. (Before the span was fixed it began
    // where the batch's criteria first differed, and the same rows gave 0.760.)
    assert!(report.heldout.kappa > 0.45, "{:?}", report.heldout);
    assert!(report.heldout.macro_f1 > 0.6, "{:?}", report.heldout);
    assert!(out.join("probe.safetensors").exists() && out.join("report.json").exists());

    // A rerun computes no feature again.
    let again = distill(
        &f,
        "tiny",
        ScoringMode::ThreeState,
        &rows,
        &cfg,
        &out,
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(
        (again.features_computed, again.features_reused),
        (0, rows.len() as u64)
    );
    assert_eq!(again.heldout, report.heldout);

    // The same features with the labels shuffled across rows (three seeds): chance agreement.
    let mut kappas = Vec::new();
    for seed in [7, 8, 9] {
        let mut shuffled = rows.clone();
        let order = conrub_rubric::seeded_permutation(rows.len(), seed);
        for (row, &from) in shuffled.iter_mut().zip(&order) {
            row.label = rows[from].label;
        }
        let control = distill(
            &f,
            "tiny",
            ScoringMode::ThreeState,
            &shuffled,
            &cfg,
            &dir.path().join(format!("control-{seed}")),
            &mut |_, _| {},
        )
        .unwrap();
        kappas.push(control.heldout.kappa);
    }
    let mean = kappas.iter().sum::<f64>() / kappas.len() as f64;
    eprintln!("shuffled: kappas {kappas:.3?}, mean {mean:.3}");
    assert!(mean.abs() < 0.1, "{kappas:?}");
    assert!(kappas.iter().all(|k| k.abs() < 0.25), "{kappas:?}");
}

/// The sample responses with their rubrics, as three-state requests.
fn sample_requests() -> Vec<CriterionRequest> {
    let records = records();
    std::fs::read_to_string(root().join("data/samples/responses.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let r = records.iter().find(|r| r.id == v["prompt_id"]).unwrap();
            CriterionRequest {
                question: conrub_rubric::record::messages_text(&r.question),
                response: v["response"].as_str().unwrap().to_string(),
                criteria: r.criterion_texts(),
                mode: ScoringMode::ThreeState,
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_judge_scores_refuses_and_abstains() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = save_tiny_model(dir.path(), 1);
    let out = dir.path().join("probe");
    let cfg = DistillConfig {
        layer: Some(2),
        pooling: Some(conrub_judge::probe::Pooling::Mean),
        ..Default::default()
    };
    let report = distill(
        &featurizer(&model_dir),
        "tiny",
        ScoringMode::ThreeState,
        &rule_rows(),
        &cfg,
        &out,
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(report.chosen_by, "given");
    assert_eq!(report.probe.format, conrub_judge::probe::PROBE_FORMAT);
    assert_eq!(report.probe.precision, conrub_models::Precision::F32);
    let probe_file = out.join("probe.safetensors");

    // Every criterion of every bundled sample response gets a label.
    let requests = sample_requests();
    let judge = ProbeJudge::new(featurizer(&model_dir), &probe_file, None, None, None).unwrap();
    let verdicts = judge.judge_batch(&requests).await;
    for (r, v) in requests.iter().zip(&verdicts) {
        let labels = v.labels.as_ref().unwrap_or_else(|| panic!("{:?}", v.error));
        assert_eq!(labels.len(), r.criteria.len());
    }

    // Another model (same shape, other weights) is refused, naming both.
    let other = save_tiny_model(dir.path(), 2);
    let e = ProbeJudge::new(featurizer(&other), &probe_file, None, None, None)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("does not fit this judge") && e.contains("another model"),
        "{e}"
    );

    // A judge whose model runs at another precision than the probe was distilled at is refused,
    // naming the setting (no forward pass needed).
    let model = Pretrained::<B>::load_dir(&model_dir, &Default::default()).unwrap();
    let exec = conrub_models::Execution {
        precision: conrub_models::Precision::Bf16Mixed,
        ..model.model.execution()
    };
    let bf16 = ProbeFeaturizer::new(
        model.with_execution(exec),
        Default::default(),
        PromptSet::default(),
        16,
    )
    .unwrap();
    let e = ProbeJudge::new(bf16, &probe_file, None, None, None)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("precision") && e.contains("bf16-mixed") && e.contains("f32"),
        "{e}"
    );

    // Abstention: the criteria whose top probability is under the threshold, and only those,
    // go to the fallback, a scripted server that counts them and answers `wrong` for each.
    let (probe, meta) = LinearProbe::load(&probe_file).unwrap();
    let f = featurizer(&model_dir);
    let spec = conrub_judge::probe::FeatureSpec {
        layer: meta.layer,
        pooling: meta.pooling,
    };
    let mut tops: Vec<Vec<f64>> = Vec::new();
    for r in &requests {
        let feats = f
            .features(r.mode, &r.question, &r.response, &r.criteria, &[spec])
            .unwrap();
        tops.push(
            feats
                .iter()
                .map(|x| probe.probabilities(x).into_iter().fold(0.0, f64::max))
                .collect(),
        );
    }
    let mut all: Vec<f64> = tops.iter().flatten().copied().collect();
    all.sort_by(f64::total_cmp);
    let below = all[all.len() / 2];
    let expected: Vec<Vec<bool>> = tops
        .iter()
        .map(|t| t.iter().map(|&p| p < below).collect())
        .collect();
    let n_expected: usize = expected.iter().flatten().filter(|&&d| d).count();
    assert!(n_expected > 0 && n_expected < all.len());

    let counted = Arc::new(AtomicUsize::new(0));
    let c = counted.clone();
    let server = ScriptedServer::with_script(move |req| {
        let n: usize = req
            .user
            .split_once("CRITERIA (")
            .and_then(|(_, rest)| rest.split_once(')'))
            .and_then(|(n, _)| n.parse().ok())
            .expect("a criteria count");
        c.fetch_add(n, Ordering::SeqCst);
        Reply::Text(serde_json::json!(vec!["wrong"; n]).to_string())
    })
    .await;
    let fallback = JudgeConfig::from_toml(
        &format!(
            "kind = \"openai\"\nurl = \"{}\"\nmodel = \"m\"\nmax_retries = 0\n",
            server.url
        ),
        Path::new("."),
    )
    .unwrap()
    .build(&RubricSet::from_records("none", vec![]).unwrap())
    .unwrap();
    let judge = ProbeJudge::new(
        f,
        &probe_file,
        None,
        Some(Abstention {
            below,
            fallback: fallback.criterion,
        }),
        None,
    )
    .unwrap();
    let verdicts = judge.judge_batch(&requests).await;
    assert_eq!(counted.load(Ordering::SeqCst), n_expected);
    for ((v, deferred), r) in verdicts.iter().zip(&expected).zip(&requests) {
        let labels = v.labels.as_ref().unwrap_or_else(|| panic!("{:?}", v.error));
        assert_eq!(labels.len(), r.criteria.len());
        assert_eq!(v.deferred as usize, deferred.iter().filter(|&&d| d).count());
        let raw: Vec<serde_json::Value> = serde_json::from_str(&v.raw_outputs[0]).unwrap();
        for ((label, &d), raw) in labels.iter().zip(deferred).zip(&raw) {
            assert_eq!(raw["by"], if d { "fallback" } else { "probe" }, "{raw}");
            if d {
                assert_eq!(*label, Label::Wrong);
            }
        }
    }
}
