//! The rubric task of `conrub train`: the records of `data.rubrics`, scored by the criterion judge
//! of `[judge]`, ties broken by its pairwise judge, validated on `[eval]`'s held-out prompts.

use std::path::Path;
use std::sync::Arc;

use conrub_config::TrainConfig;
use conrub_grpo::{HeldOutPrompt, JudgeRewards, PairwiseTieBreaker, RewardSource, Validator};
use conrub_judge::{CriterionJudge, Judges};
use conrub_kernels::GrpoOps;
use conrub_rubric::{read_rubrics, RubricRecord, RubricSet};

use crate::error::{Result, TrainerError};

/// The rubric records, their judges and the validator of `[eval]`.
pub(crate) struct RubricTask {
    pub records: Vec<RubricRecord>,
    pub judges: Judges,
    pub rewards: JudgeRewards,
    pub tie_breaker: PairwiseTieBreaker,
    pub validator: Option<Validator>,
}

/// Reads and checks the records, builds the judges (an in-process judge on `device`) and the
/// validator.
pub(crate) fn rubric_task<B: GrpoOps>(cfg: &TrainConfig, device: &B::Device) -> Result<RubricTask> {
    let path = cfg.rubrics_path()?;
    let rubrics = read_rubrics(&path)?;
    check_records(&path, &rubrics.records)?;
    let judges = cfg.judge()?.build_on::<B>(device, &rubrics)?;
    let rewards = judge_rewards(cfg, judges.criterion.clone());
    let tie_breaker = PairwiseTieBreaker::new(judges.pairwise.clone(), cfg.learner.seed);
    let validator = validator::<B>(cfg, &judges, device)?;
    Ok(RubricTask {
        records: rubrics.iter().cloned().collect(),
        judges,
        rewards,
        tie_breaker,
        validator,
    })
}

/// Refuses a rubric file that `conrub rubrics validate` rejects (its errors name line and field).
pub fn check_rubrics(path: &Path) -> Result<()> {
    check_records(path, &conrub_rubric::read_jsonl(path)?)
}

/// Refuses `path`'s `records` (with their line numbers) as `conrub rubrics validate` does.
fn check_records(path: &Path, records: &[(usize, RubricRecord)]) -> Result<()> {
    let report = conrub_rubric::validate_records(records);
    if report.is_ok() {
        return Ok(());
    }
    let errors: Vec<String> = report
        .to_string()
        .lines()
        .filter_map(|l| l.strip_prefix("error: "))
        .map(|l| format!("  {}: {l}", path.display()))
        .collect();
    Err(TrainerError::Input {
        path: path.to_path_buf(),
        message: format!(
            "{} errors that `conrub rubrics validate` rejects; training refuses them:\n{}",
            report.errors(),
            errors.join("\n")
        ),
    })
}

/// `[eval]`'s judges (in process on `device`, or clients) and held-out prompts: the validator,
/// or `None` without `[eval]`.
fn validator<B: GrpoOps>(
    cfg: &TrainConfig,
    judges: &Judges,
    device: &B::Device,
) -> Result<Option<Validator>> {
    let Some(e) = &cfg.eval else {
        return Ok(None);
    };
    let data = cfg.resolve(&e.settings.data);
    let mut examples = conrub_eval::read_eval_examples(&data)?;
    if let Some(n) = e.settings.limit {
        examples.truncate(n);
    }
    if examples.is_empty() {
        let why = format!("[eval] data: {} has no examples", data.display());
        return Err(TrainerError::Setup(why));
    }
    let grader = e
        .grader
        .build_on::<B>(device, &RubricSet::from_records("eval", vec![])?)
        .map_err(|err| TrainerError::Setup(format!("[eval.grader]: {err}")))?;
    let examples = examples
        .into_iter()
        .map(|e| HeldOutPrompt {
            prompt: e.prompt,
            criteria: e.criteria,
        })
        .collect();
    Ok(Some(Validator {
        cfg: e.settings.clone(),
        examples,
        mode: cfg.reward.mode,
        training: judges.criterion.clone(),
        grader: grader.criterion,
        seed: cfg.learner.seed,
    }))
}

/// The kernel warm-up's judging: a lexical judge with no keyword file, for the rewards and the
/// ties alike, so that no server is called.
pub(crate) fn lexical_judging(
    cfg: &TrainConfig,
) -> (
    Arc<dyn RewardSource<RubricRecord>>,
    Arc<dyn conrub_grpo::TieBreaker>,
) {
    let judge = Arc::new(conrub_judge::LexicalJudge::default());
    let rewards = judge_rewards(cfg, judge.clone());
    let breaker = PairwiseTieBreaker::new(judge, cfg.learner.seed);
    (Arc::new(rewards), Arc::new(breaker))
}

/// Rubric rewards from `judge` with the config's scoring mode, length penalty, dropout and seed.
fn judge_rewards(cfg: &TrainConfig, judge: Arc<dyn CriterionJudge>) -> JudgeRewards {
    JudgeRewards {
        judge,
        mode: cfg.reward.mode,
        penalty: cfg.reward.length_penalty(cfg.learner.max_response_tokens),
        dropout: cfg.reward.dropout,
        seed: cfg.learner.seed,
    }
}
