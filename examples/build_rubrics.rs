//! Embedding consensus rubric construction: runs `conrub_construct::build` on three prompts against
//! scripted generator and reviewer servers on loopback (stand-ins for three vendor APIs and a
//! reviewer), then prints the dataset card. Point a `BuildConfig` at real endpoints instead
//! (see `configs/build.toml`).
//!
//! `cargo run --example build_rubrics`

use std::sync::Arc;

use conrub_construct::testing::BuildServers;
use conrub_construct::{build, BuildRequest, InputFormat, Progress};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let servers = BuildServers::start(0).await;
    let dir = tempfile::tempdir()?;
    let input = dir.path().join("prompts.jsonl");
    // The scripted servers follow the plan in each question (see `conrub_construct::testing`).
    let prompts = [
        ("p1", "A: t1 t2 t3 t4 t5 a1\nB: t1 t2 t3 t4 t5\nC: t1 t2+ t3 t4:no t5\naudit: t5=rewrite\ndims: t1=safety"),
        ("p2", "A: t1 t2 t3 t4 t5\nB: t1 t2 t3 t4 t5\nC: t1 t2 t3 t4 t5\nreview: C=6"),
        ("p3", "A: t1 t2 t3 t4 t5 n1\nB: t1 t2 t3 t4 t5 n1\nC: t1 t2 t3 t4 t5 n1\naudit: t3=drop"),
    ];
    let lines: Vec<String> = prompts
        .iter()
        .map(|(id, plan)| {
            serde_json::json!({"id": id, "question": format!("What should I know?\n[[plan\n{plan}\n]]"),
                "reference_answer": "A reference answer.", "source": "demo"})
            .to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n"))?;
    let cfg = servers.config(30.0, "");
    let req = BuildRequest {
        input,
        format: InputFormat::Prompts,
        out_dir: dir.path().join("out"),
        limit: None,
    };
    let progress = Arc::new(Progress::default());
    let summary = build(cfg, &req, progress.clone()).await?;
    println!("{}", progress.line());
    println!(
        "{}",
        std::fs::read_to_string(summary.out_dir.join("card.md"))?
    );
    for line in std::fs::read_to_string(summary.out_dir.join("rubrics.jsonl"))?.lines() {
        let r: conrub_rubric::RubricRecord = serde_json::from_str(line)?;
        println!("{}: {:?}", r.id, r.criterion_texts());
    }
    Ok(())
}
