//! Score responses with a judge from your own code.
//!
//! `cargo run --release --example score -- data/samples/rubrics.jsonl configs/judge-lexical.toml`
//!
//! Reads the rubric file, builds the judge from its config (openai or lexical; the in-process judge
//! needs a backend, see `JudgeConfig::build_local`), grades two answers to the first prompt in
//! three-state mode and prints their rewards.

use conrub_judge::JudgeBuild;
use std::path::PathBuf;

use conrub_judge::{score_jobs, CriterionRequest, JudgeConfig, ScoreJob};
use conrub_rubric::{read_rubrics, LengthPenalty, ScoringMode};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let rubrics_path = PathBuf::from(
        args.next()
            .unwrap_or_else(|| "data/samples/rubrics.jsonl".into()),
    );
    let judge_path = PathBuf::from(
        args.next()
            .unwrap_or_else(|| "configs/judge-lexical.toml".into()),
    );
    let rubrics = read_rubrics(&rubrics_path)?;
    let judges = JudgeConfig::from_file(&judge_path)?.build(&rubrics)?;
    let record = rubrics.iter().next().ok_or("empty rubric file")?;
    let answers = [
        "This may be a heart attack: call emergency services now, do not drive, and chew an aspirin if you are not allergic.",
        "Probably indigestion; wait and see.",
    ];
    let jobs: Vec<ScoreJob> = answers
        .iter()
        .map(|a| ScoreJob {
            request: CriterionRequest {
                question: record.question_text(),
                response: a.to_string(),
                criteria: record.criterion_texts(),
                mode: ScoringMode::ThreeState,
            },
            response_tokens: None,
        })
        .collect();
    let rt = tokio::runtime::Runtime::new()?;
    let (results, summary) = rt.block_on(score_jobs(
        judges.criterion.as_ref(),
        &jobs,
        &LengthPenalty::default(),
        None,
        16,
        &|_| {},
    ));
    for (a, r) in answers.iter().zip(&results) {
        match r.score.reward() {
            Some(x) => println!("{x:+.3}  {a}"),
            None => println!("unscored  {a}"),
        }
    }
    println!(
        "{} scored, {} unscored, judge {}",
        summary.scored,
        summary.unscored,
        judges.criterion.id()
    );
    Ok(())
}
