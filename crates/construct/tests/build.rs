//! End-to-end builds against three scripted generator servers and a scripted reviewer on
//! loopback, with overlapping and disjoint criteria, tag disagreements, malformed answers, a
//! timeout, rejected samples, a refusal, duplicates, quotas and a failing generator.

use std::collections::BTreeMap;

use conrub_construct::testing::BuildServers;
use conrub_construct::{build, BuildRequest, InputFormat};
use conrub_rubric::{read_jsonl, Coverage, CriterionKind, RubricRecord};
use serde_json::{json, Value};

fn prompt(id: &str, reference: Option<&str>, plan: &str) -> String {
    let q = format!("Question {id}: what should a patient know?\n[[plan\n{plan}\n]]");
    let mut v = json!({"id": id, "question": q, "source": if id.starts_with("p-cap") { "stratum-b" } else { "stratum-a" }});
    if let Some(r) = reference {
        v["reference_answer"] = json!(r);
    }
    v.to_string()
}

fn prompts() -> Vec<String> {
    vec![
        prompt(
            "p-overlap",
            Some("Reference answer."),
            "A: t1 t2 t3 t4 t5 a1 a2\nB: t1 t2+ t3 t4 t5 b1\nC: t1 t2 t3 t4:no t5 a1\nA!: malformed\nB!: garbage-once\n\
             audit: t3=rewrite t5=drop\ndims: t1=safety",
        ),
        prompt("p-timeout", None, "A: t1 t2 t3 t4 t5 n1\nB: t1 t2 t3 t4 t5 n1\nC: t1 t2 t3 t4 t5 n1\nA!: slow-once\naudit: t5=rewrite>t1"),
        prompt("p-rejected", Some("R."), "A: t1 t2 t3 t4 t5\nB: t1 t2 t3 t4 t5\nC: t1 t2 t3 t4 t5\nreview: C=6"),
        prompt("p-contradiction", Some("R."), "A: t1 t2 t3 t4 t5\nB: t1 t2 t3 t4 t5\nC: t1 t2 t3 t4 t5\nreview: B=contradiction"),
        prompt("p-refuse", Some("R."), "A: t1 t2 t3 t4 t5\nB: t1 t2 t3 t4 t5\nC: t1 t2 t3 t4 t5\naudit: refuse\ngroup: garbage-once"),
        prompt(
            "p-cap",
            Some("R."),
            "A: t1 t2 t3 t4 t5 t6 t7 t8 t9 t10 t11 t12 t13 t14\nB: t1 t2 t3 t4 t5 t6 t7 t8 t9 t10 t11 t12 t13 t14\n\
             C: t1 t2 t3 t4 t5 t6 t7 t8 t9 t10 t11 t12 t13 t14\ngroup: unknown-ids\n\
             dims: t1=safety t2=safety t3=safety t4=safety t5=management t6=management t7=management t8=management \
             t9=management t10=practical t11=practical t12=practical t13=communication t14=communication",
        ),
        prompt("p-few", Some("R."), "A: t1 t2 t3 t4 t5\nB: t1 t2 t3 t4 t5\nC: t1 t2 t3 t4 t5\nC!: few"),
        prompt("p-fail", Some("R."), "A: t1 t2 t3 t4 t5\nB: t1 t2 t3 t4 t5\nC: t1 t2 t3 t4 t5\nA!: fail"),
    ]
}

fn texts(r: &RubricRecord) -> Vec<&str> {
    r.criteria
        .iter()
        .filter(|c| c.kind == CriterionKind::Content)
        .map(|c| c.text.as_str())
        .collect()
}

fn read_all(dir: &std::path::Path) -> BTreeMap<String, Vec<u8>> {
    [
        "rubrics.jsonl",
        "raw.jsonl",
        "clusters.jsonl",
        "validation.json",
        "stats.json",
        "card.md",
    ]
    .iter()
    .map(|f| (f.to_string(), std::fs::read(dir.join(f)).unwrap()))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consensus_build_keeps_exactly_the_agreed_criteria_and_reruns_from_the_cache() {
    let servers = BuildServers::start(3000).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("prompts.jsonl");
    std::fs::write(&input, prompts().join("\n")).unwrap();
    let out = dir.path().join("out");
    let cfg = servers.config(2.0, "");
    let req = BuildRequest {
        input: input.clone(),
        format: InputFormat::Prompts,
        out_dir: out.clone(),
        limit: None,
    };
    let summary = build(cfg.clone(), &req, Default::default()).await.unwrap();

    let records: Vec<RubricRecord> = read_jsonl(&out.join("rubrics.jsonl"))
        .unwrap()
        .into_iter()
        .map(|(_, r)| r)
        .collect();
    let by_id: BTreeMap<&str, &RubricRecord> = records.iter().map(|r| (r.id.as_str(), r)).collect();
    assert_eq!(
        by_id.keys().copied().collect::<Vec<_>>(),
        ["p-cap", "p-overlap", "p-refuse", "p-timeout"]
    );

    // Overlap: t4 has a tag disagreement, a1/a2/b1 lack support, t5 is dropped by the audit, t3 is
    // rewritten, and t2's representative is B's longer text.
    let o = by_id["p-overlap"];
    assert_eq!(
        texts(o),
        [
            "The response explains fact t1 about this case.",
            "The response states fact t2 about this case in clear words.",
            "The response clearly explains fact t3 about this case."
        ]
    );
    assert!(o.criteria[..3]
        .iter()
        .all(|c| c.reference_coverage == Some(Coverage::Yes)));
    assert_eq!(o.criteria[0].provenance.generators, ["A", "B", "C"]);
    assert_eq!(o.criteria[2].provenance.cluster_id.as_deref(), Some("K3"));
    assert_eq!(o.criteria.len(), 5);
    assert_eq!(o.criteria[3].kind, CriterionKind::GlobalControl);

    // Timeout then success; no reference (null tags); the rewrite of t5 duplicates t1; the
    // "does not mention" cluster is dropped by the deterministic check although the audit kept it.
    let t = by_id["p-timeout"];
    assert_eq!(
        texts(t),
        (1..=4)
            .map(|i| format!("The response explains fact t{i} about this case."))
            .collect::<Vec<_>>()
    );
    assert!(t.criteria.iter().all(|c| c.reference_coverage.is_none()));

    // Refused audit, asked again blind: everything is `other`, capped at 2.
    assert_eq!(texts(by_id["p-refuse"]).len(), 2);
    // Dimension quotas and the cap of 10.
    let cap: Vec<String> = texts(by_id["p-cap"])
        .iter()
        .map(|t| t.split_whitespace().nth(4).unwrap().to_string())
        .collect();
    assert_eq!(
        cap,
        ["t1", "t2", "t3", "t5", "t6", "t7", "t8", "t10", "t11", "t12"]
    );

    let c = &summary.stats.counts;
    let expect = [
        ("prompts", 8),
        ("prompts_kept", 4),
        ("prompts_dropped", 3),
        ("prompts_failed", 1),
        ("samples_failed", 1),
        ("candidates_empty", 2),
        ("candidates_malformed", 1),
        ("candidates_under_specified", 1),
        ("candidates_duplicate", 1),
        ("samples_under_specified", 1),
        ("samples_rejected_score", 1),
        ("samples_rejected_contradiction", 1),
        ("grouping_unknown_ids", 1),
        ("grouping_repeated_ids", 1),
        ("clusters_partial_support", 3),
        ("clusters_tag_disagreement", 1),
        ("audit_refusals", 1),
        ("audit_drop", 1),
        ("audit_rewrite", 2),
        ("negatives_dropped", 1),
        ("duplicates_removed", 1),
        ("over_quota", 7),
        ("content_criteria", 19),
        ("global_controls", 8),
    ];
    let got: BTreeMap<&str, u64> = c.pairs().into_iter().collect();
    for (k, v) in expect {
        assert_eq!(got[k], v, "count {k}");
    }
    let clusters: Vec<Value> = std::fs::read_to_string(out.join("clusters.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let refuse = clusters.iter().find(|c| c["id"] == "p-refuse").unwrap();
    assert_eq!(refuse["clusters"][2]["outcome"], "over_quota");
    let rej = clusters.iter().find(|c| c["id"] == "p-rejected").unwrap();
    assert_eq!(rej["outcome"]["stage"], "review");
    assert_eq!(rej["samples"]["C"]["status"], "rejected_score");
    let raw: Vec<Value> = std::fs::read_to_string(out.join("raw.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        raw[0]["generate"]["B"]["attempts"], 2,
        "garbage once, then valid"
    );
    assert_eq!(
        raw[0]["generate"]["B"]["raw_outputs"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_eq!(raw[1]["generate"]["A"]["attempts"], 2, "timed out once");
    assert!(raw[4]["audit_blind"].is_object());
    assert!(raw[7]["generate"]["A"]["error"]
        .as_str()
        .unwrap()
        .contains("HTTP 500"));
    let stats: Value =
        serde_json::from_slice(&std::fs::read(out.join("stats.json")).unwrap()).unwrap();
    assert_eq!(stats["by_source"]["stratum-b"]["kept"], 1);
    assert_eq!(stats["validation_errors"], 0);
    assert_eq!(stats["three_generator_support"], 1.0);
    let card = std::fs::read_to_string(out.join("card.md")).unwrap();
    assert!(
        card.contains("| 5 consensus | clusters_tag_disagreement | 1 |"),
        "{card}"
    );
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["models"]["generator-B"]["model"], "gen-b");
    assert!(manifest["prompt_versions"]["audit_blind"].is_string());

    // A rerun answers everything from the cache except the calls that failed, and writes the same bytes.
    let before = read_all(&out);
    let answered: Vec<usize> = servers.all().iter().map(|s| s.answered()).collect();
    let again = build(cfg, &req, Default::default()).await.unwrap();
    let after: Vec<usize> = servers.all().iter().map(|s| s.answered()).collect();
    assert_eq!(
        after[0] - answered[0],
        4,
        "only p-fail's generator A is asked again (1 + 3 retries)"
    );
    assert_eq!(&after[1..], &answered[1..]);
    assert_eq!(
        again.roles["reviewer"].cached,
        again.roles["reviewer"].calls
    );
    assert_eq!(read_all(&out), before);
    // Apart from generator A (its failing and timed-out calls), no request body was ever answered twice.
    assert!(servers.all()[1..].iter().all(|s| s.max_repeats() == 1));
}
