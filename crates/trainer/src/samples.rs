//! What the policy said, on disk: the rollouts of each step and the answers of each validation
//! round, for reading (`conrub samples`) and for spotting reward hacking in the text itself.
//!
//! - `samples/step-NNNNNN.jsonl` (`NNNNNN` the metrics' 0-based `step`): one [`GroupSample`] a
//!   line for the step's first `run.sample_groups` groups.
//! - `samples/eval-step-NNNNNN.jsonl` (`NNNNNN` the steps done, as the eval line's `step`): one
//!   [`EvalSample`] a line for every answer of the round.
//!
//! Each file is written whole and renamed into place, so a kill leaves a step's file complete or
//! absent; a resumed run writes the steps it repeats again, with the same content.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use conrub_contracts::FinishReason;
use conrub_judge::PairOutcome;
use conrub_rubric::{Label, ResponseScore};
use serde::{Deserialize, Serialize};

use conrub_grpo::{PairRecord, StepOutput, TieStatus};
use conrub_rewards::TaskPrompt;

use crate::error::{Result, TrainerError};

/// The folder of a run's samples.
pub fn samples_dir(output_dir: &Path) -> PathBuf {
    output_dir.join("samples")
}

/// The samples file of training step `step` (0-based, as the metrics' `step`).
pub fn step_samples_path(output_dir: &Path, step: u64) -> PathBuf {
    samples_dir(output_dir).join(format!("step-{step:06}.jsonl"))
}

/// The samples file of the validation round after `steps_done` steps.
pub fn eval_samples_path(output_dir: &Path, steps_done: u64) -> PathBuf {
    samples_dir(output_dir).join(format!("eval-step-{steps_done:06}.jsonl"))
}

/// Removes the samples an earlier attempt wrote after `steps_done` steps (a run resumed from
/// that state writes them again; the metrics log drops their lines the same way).
pub fn remove_samples_after(output_dir: &Path, steps_done: u64) -> Result<()> {
    let dir = samples_dir(output_dir);
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(TrainerError::io(&dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| TrainerError::io(&dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let number = |prefix: &str| {
            name.strip_prefix(prefix)
                .and_then(|n| n.strip_suffix(".jsonl"))
                .and_then(|n| n.parse::<u64>().ok())
        };
        // Step files are numbered by the 0-based step, eval files by the steps done.
        let later = match (number("step-"), number("eval-step-")) {
            (Some(step), _) => step >= steps_done,
            (_, Some(done)) => done > steps_done,
            _ => false,
        };
        if later {
            std::fs::remove_file(entry.path()).map_err(|e| TrainerError::io(entry.path(), e))?;
        }
    }
    Ok(())
}

/// One group of a training step: its prompt, what the judges said and the advantages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupSample {
    /// The step (0-based, as the metrics' `step`).
    pub step: u64,
    /// The group's place in the step (over every rank).
    pub group: usize,
    /// The prompt's id.
    pub prompt_id: String,
    /// The prompt as the judges saw it.
    pub prompt: String,
    /// The criteria the responses were scored against (after rubric dropout), in label order.
    pub criteria: Vec<String>,
    /// Whether the group was an exact tie and what became of it.
    pub tie_status: TieStatus,
    /// The pairs the pairwise judge compared (tied groups), with both verdicts.
    pub pairs: Vec<PairRecord>,
    /// The group's responses, in sampling order.
    pub responses: Vec<ResponseSample>,
}

/// One response of a group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponseSample {
    /// Its place in the group.
    pub index: usize,
    /// The decoded text.
    pub text: String,
    /// Tokens generated (the stop token included).
    pub tokens: usize,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// The reward, `None` when unscored.
    pub reward: Option<f64>,
    /// The reward's parts: each criterion's label and score, the criterion mean, the length
    /// penalty and the exact reward; or why it is unscored.
    pub score: ResponseScore,
    /// The sequence advantage it was trained with.
    pub advantage: f64,
}

/// One answer of a validation round with both judges' verdicts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalSample {
    /// Steps done when the round ran (the eval line's `step`).
    pub step: u64,
    /// The held-out prompt's place in the round.
    pub prompt_index: usize,
    /// Which of the prompt's samples this is.
    pub sample: usize,
    /// The prompt as the judges saw it.
    pub prompt: String,
    /// The criteria both judges graded.
    pub criteria: Vec<String>,
    /// The answer.
    pub text: String,
    /// Tokens generated.
    pub tokens: usize,
    /// Cut at the length limit.
    pub truncated: bool,
    /// The training judge's verdict.
    pub training: JudgedAnswer,
    /// The grader's verdict.
    pub grader: JudgedAnswer,
}

/// One judge's verdict on a validation answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JudgedAnswer {
    /// The judge's id.
    pub judge: String,
    /// One label per criterion, `None` when the judge gave none.
    pub labels: Option<Vec<Label>>,
    /// The criterion mean (the round's score of this answer), `None` when unscored.
    pub score: Option<f64>,
    /// Why it is unscored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The first `groups` groups of `out` as [`GroupSample`]s; `records` are the step's prompts,
/// in the order the step took them.
pub fn group_samples<T: TaskPrompt>(
    out: &StepOutput,
    records: &[&T],
    groups: usize,
) -> Vec<GroupSample> {
    let n = groups.min(out.outcomes.len()).min(records.len());
    (0..n)
        .map(|g| {
            let outcome = &out.outcomes[g];
            let responses = out.responses[g]
                .iter()
                .enumerate()
                .map(|(i, text)| ResponseSample {
                    index: i,
                    text: text.clone(),
                    tokens: out.response_tokens[g][i],
                    finish_reason: out.finish_reasons[g][i],
                    reward: out.scores[g][i].reward(),
                    score: out.scores[g][i].clone(),
                    advantage: outcome.advantages[i],
                })
                .collect();
            GroupSample {
                step: out.metrics.step,
                group: g,
                prompt_id: records[g].id().to_string(),
                prompt: records[g].text(),
                criteria: out.criteria[g].clone(),
                tie_status: outcome.status,
                pairs: outcome.pairs.clone(),
                responses,
            }
        })
        .collect()
}

/// Writes `lines` to `path` whole (a temporary file renamed into place), creating the folder.
pub fn write_samples<S: Serialize>(path: &Path, lines: &[S]) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| TrainerError::io(dir, e))?;
    }
    Ok(conrub_rubric::io::write_jsonl_atomic(path, lines)?)
}

/// Reads a samples file; errors name the file and line.
pub fn read_samples<S: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<S>> {
    let lines = conrub_rubric::io::read_jsonl(path)?;
    Ok(lines.into_iter().map(|(_, s)| s).collect())
}

/// A response's score in one line: the reward and its parts.
fn score_head(score: &ResponseScore) -> String {
    match score {
        ResponseScore::Scored(s) if s.labels.is_empty() => {
            format!(
                "reward {:+.3} (exact {}/{})",
                s.reward.value(),
                s.reward.num,
                s.reward.den
            )
        }
        ResponseScore::Scored(s) => format!(
            "reward {:+.3} (criteria {:+.3}, length {:+.3})  labels {}",
            s.reward.value(),
            s.criteria_mean,
            s.length_penalty,
            s.labels.iter().map(|l| mark(*l)).collect::<String>()
        ),
        ResponseScore::Unscored(u) => {
            format!("unscored after {} attempts: {}", u.attempts, u.message)
        }
        ResponseScore::Value(v) => format!("reward {:+.3}", v.reward),
        ResponseScore::Mixed(m) => {
            let parts: Vec<String> = m
                .parts
                .iter()
                .map(|p| {
                    let value = p.score.reward().unwrap_or(f64::NAN);
                    match p.score.labels() {
                        [] => format!("{} x {} {value:+.3}", p.weight, p.name),
                        labels => format!(
                            "{} x {} {value:+.3} [{}]",
                            p.weight,
                            p.name,
                            labels.iter().map(|l| mark(*l)).collect::<String>()
                        ),
                    }
                })
                .collect();
            format!("reward {:+.3} = {}", m.reward, parts.join(" + "))
        }
    }
}

/// A label's one-letter mark in [`format_group`]: `+` correct or yes, `-` wrong or no, `.`
/// missing.
fn mark(label: Label) -> char {
    match label.score().signum() {
        1 => '+',
        -1 => '-',
        _ => '.',
    }
}

/// `text` indented by `pad`, every line.
fn indented(text: &str, pad: &str) -> String {
    text.lines()
        .map(|l| format!("{pad}{l}\n"))
        .collect::<String>()
}

/// A group for reading: the prompt, the criteria numbered, then each response with its reward,
/// parts, advantage, labels (one mark per criterion, in order) and text; the pair verdicts of a
/// tied group.
pub fn format_group(g: &GroupSample) -> String {
    let mut out = String::new();
    let tie = match g.tie_status {
        TieStatus::NotTied => "not tied",
        TieStatus::Tied => "tied",
        TieStatus::TiedUnbroken => "tied (tie breaking off)",
    };
    let _ = writeln!(
        out,
        "=== step {} · group {} · {} · {} ===",
        g.step, g.group, g.prompt_id, tie
    );
    out.push_str(&indented(&g.prompt, "  > "));
    for (i, c) in g.criteria.iter().enumerate() {
        let _ = writeln!(out, "  c{:<2} {c}", i + 1);
    }
    for r in &g.responses {
        let head = score_head(&r.score);
        let finish = match r.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        };
        let _ = writeln!(
            out,
            "  --- #{}  {head}  advantage {:+.3}  {} tokens, {finish}",
            r.index, r.advantage, r.tokens
        );
        out.push_str(&indented(&r.text, "    "));
    }
    for p in &g.pairs {
        let verdict = match p.outcome {
            PairOutcome::PreferA => format!("#{} preferred in both orders", p.a),
            PairOutcome::PreferB => format!("#{} preferred in both orders", p.b),
            PairOutcome::Same => "same".into(),
            PairOutcome::OrderFlip => "order flip (the two orders disagree)".into(),
            PairOutcome::Invalid => "invalid (an order gave no valid answer)".into(),
        };
        let _ = writeln!(out, "  pair #{} vs #{}: {verdict}", p.a, p.b);
    }
    out
}

/// A validation answer for reading: both judges' scores and labels, then the text.
pub fn format_eval(s: &EvalSample) -> String {
    let judged = |j: &JudgedAnswer| match (&j.score, &j.labels) {
        (Some(score), Some(labels)) => format!(
            "{} {:+.3} {}",
            j.judge,
            score,
            labels.iter().map(|l| mark(*l)).collect::<String>()
        ),
        _ => format!(
            "{} unscored: {}",
            j.judge,
            j.error.as_deref().unwrap_or("no labels")
        ),
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "=== eval after step {} · prompt {} · sample {} · {} tokens{} ===",
        s.step,
        s.prompt_index,
        s.sample,
        s.tokens,
        if s.truncated { ", truncated" } else { "" }
    );
    out.push_str(&indented(&s.prompt, "  > "));
    let _ = writeln!(out, "  training judge: {}", judged(&s.training));
    let _ = writeln!(out, "  grader:         {}", judged(&s.grader));
    out.push_str(&indented(&s.text, "    "));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use conrub_rubric::{LengthPenalty, ScoringMode, UnscoredReason};

    fn group() -> GroupSample {
        let scored = conrub_rubric::score_labels(
            &[Label::Correct, Label::Missing, Label::Wrong],
            3,
            ScoringMode::ThreeState,
            10,
            &LengthPenalty::disabled(),
        )
        .unwrap();
        GroupSample {
            step: 3,
            group: 1,
            prompt_id: "p7".into(),
            prompt: "Chest pain at rest?\nSince this morning.".into(),
            criteria: vec!["urgent care".into(), "ECG".into(), "no reassurance".into()],
            tie_status: TieStatus::NotTied,
            pairs: vec![],
            responses: vec![
                ResponseSample {
                    index: 0,
                    text: "Go to the emergency department now.".into(),
                    tokens: 10,
                    finish_reason: FinishReason::Stop,
                    reward: Some(0.0),
                    score: ResponseScore::Scored(scored),
                    advantage: 0.625,
                },
                ResponseSample {
                    index: 1,
                    text: "It is".into(),
                    tokens: 48,
                    finish_reason: FinishReason::Length,
                    reward: None,
                    score: ResponseScore::Unscored(UnscoredReason {
                        message: "judge timed out".into(),
                        attempts: 3,
                    }),
                    advantage: 0.0,
                },
            ],
        }
    }

    /// A line written is the line read back, and the readable form shows every part.
    #[test]
    fn samples_round_trip_and_read_as_text() {
        let dir = tempfile::tempdir().unwrap();
        let path = step_samples_path(dir.path(), 3);
        assert!(path.ends_with("samples/step-000003.jsonl"));
        write_samples(&path, &[group()]).unwrap();
        let back: Vec<GroupSample> = read_samples(&path).unwrap();
        assert_eq!(back, vec![group()]);
        let text = format_group(&back[0]);
        for want in [
            "=== step 3 · group 1 · p7 · not tied ===",
            "  > Chest pain at rest?\n  > Since this morning.\n",
            "  c1  urgent care\n",
            "  --- #0  reward +0.000 (criteria +0.000, length +0.000)  labels +.-  advantage +0.625  10 tokens, stop\n    Go to the emergency department now.\n",
            "  --- #1  unscored after 3 attempts: judge timed out  advantage +0.000  48 tokens, length\n",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        // A resume after 2 steps drops step 2's file (the third step), keeps step 1's and the
        // eval round after step 2.
        for name in [
            "step-000001.jsonl",
            "eval-step-000002.jsonl",
            "eval-step-000004.jsonl",
        ] {
            std::fs::write(samples_dir(dir.path()).join(name), "").unwrap();
        }
        remove_samples_after(dir.path(), 2).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(samples_dir(dir.path()))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["eval-step-000002.jsonl", "step-000001.jsonl"]);
        write_samples(&path, &[group()]).unwrap();
        std::fs::write(&path, "{\"step\": 1}\n").unwrap();
        let e = read_samples::<GroupSample>(&path).unwrap_err().to_string();
        assert!(e.contains("step-000003.jsonl:1: "), "{e}");
    }
}
