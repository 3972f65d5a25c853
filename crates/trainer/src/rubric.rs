//! The rubric task of `conrub train`: the records of `data.rubrics`, scored by the criterion judge
//! of `[judge]`, ties broken by its pairwise judge, validated on `[eval]`'s held-out prompts.

use std::path::Path;
use std::sync::Arc;

use conrub_config::TrainConfig;
use conrub_grpo::PairwiseTieBreaker;
use conrub_judge::{CriterionJudge, JudgeBuild, Judges};
use conrub_kernels::KernelOps;
use conrub_rewards::{GroupScores, JudgeRewards, RewardError, RewardKinds, RewardSource};
use conrub_rubric::{RubricRecord, RubricSet};

use crate::data::{check_records, TaskData};
use crate::error::{Result, TrainerError};
use crate::validation::{HeldOutPrompt, Validator};

/// The rubric records, their judges and the validator of `[eval]`.
pub(crate) struct RubricTask {
    pub records: Vec<RubricRecord>,
    /// Where the records came from, for the opening line.
    pub describe: String,
    pub judges: Judges,
    pub rewards: Arc<dyn RewardSource<RubricRecord>>,
    pub tie_breaker: PairwiseTieBreaker,
    pub validator: Option<Validator>,
}

/// Builds the judges of the checked records (an in-process judge on `device`), the rewards (the
/// judge alone, or the mix of `[[reward.functions]]` built from `kinds`) and the validator.
pub(crate) fn rubric_task<B: KernelOps>(
    cfg: &TrainConfig,
    device: &B::Device,
    kinds: RewardKinds<RubricRecord>,
    checked: CheckedData,
) -> Result<RubricTask> {
    let data = checked.data;
    let judges = cfg.judge()?.build_on::<B>(device, &data.task)?;
    let rewards = rewards(cfg, judges.criterion.clone(), kinds)?;
    let tie_breaker = PairwiseTieBreaker::new(judges.pairwise.clone(), cfg.learner.seed);
    let validator = validator::<B>(cfg, &judges, device)?;
    Ok(RubricTask {
        records: data.task.iter().cloned().collect(),
        describe: data.describe,
        judges,
        rewards,
        tie_breaker,
        validator,
    })
}

/// The run's rewards: the rubric judge alone without `[[reward.functions]]`, else their mix,
/// with the judge registered as kind `rubric`.
fn rewards(
    cfg: &TrainConfig,
    judge: Arc<dyn CriterionJudge>,
    mut kinds: RewardKinds<RubricRecord>,
) -> Result<Arc<dyn RewardSource<RubricRecord>>> {
    let judged = Arc::new(judge_rewards(cfg, judge));
    if cfg.reward.functions.is_empty() {
        return Ok(judged);
    }
    let judged_by_rubric = cfg.reward.functions.iter().any(|f| f.kind == "rubric");
    kinds.register_rubric(judged);
    let mix = kinds.build(&cfg.reward.functions)?;
    if judged_by_rubric {
        return Ok(Arc::new(mix));
    }
    // No rubric part: the tie breaker still compares on the record's criteria.
    Ok(Arc::new(WithRecordCriteria(mix)))
}

/// A reward source whose groups carry the record's whole rubric when the source judged none
/// (a mix without a `rubric` function), so that tied groups are compared on it.
struct WithRecordCriteria<R>(R);

#[async_trait::async_trait]
impl<R: RewardSource<RubricRecord>> RewardSource<RubricRecord> for WithRecordCriteria<R> {
    async fn score_group(
        &self,
        record: &RubricRecord,
        responses: &[String],
        lengths: &[u32],
        step: u64,
    ) -> GroupScores {
        let mut scores = self.0.score_group(record, responses, lengths, step).await;
        if scores.criteria.is_empty() {
            scores.criteria = record.criterion_texts();
        }
        scores
    }

    fn check_prompt(&self, record: &RubricRecord) -> std::result::Result<(), RewardError> {
        self.0.check_prompt(record)
    }
}

/// Builds the reward functions of `[[reward.functions]]` with `kinds` (the judge stood in for
/// by the lexical test double, which calls nothing) and refuses the records they cannot score,
/// naming file and line: what a run checks before any judge or policy loads.
fn check_rewards(
    cfg: &TrainConfig,
    data: &crate::data::TaskData,
    kinds: RewardKinds<RubricRecord>,
) -> Result<()> {
    if cfg.reward.functions.is_empty() {
        return Ok(());
    }
    let stand_in = Arc::new(conrub_judge::LexicalJudge::default());
    let rewards = rewards(cfg, stand_in, kinds)?;
    for file in &data.files {
        check_prompts(&file.path, &file.records, rewards.as_ref())?;
    }
    Ok(())
}

/// Refuses records a reward function cannot score (a verifiable check's missing or malformed
/// `ground_truth`), naming the file and line.
fn check_prompts(
    path: &Path,
    records: &[(usize, RubricRecord)],
    rewards: &dyn RewardSource<RubricRecord>,
) -> Result<()> {
    /// The records an error lists (the count covers all of them).
    const SHOWN: usize = 10;
    let bad: Vec<String> = records
        .iter()
        .filter_map(|(line, r)| {
            let e = rewards.check_prompt(r).err()?;
            Some(format!(
                "  {}:{line}: record `{}`: {e}",
                path.display(),
                r.id
            ))
        })
        .collect();
    if bad.is_empty() {
        return Ok(());
    }
    let more = match bad.len().saturating_sub(SHOWN) {
        0 => String::new(),
        n => format!("\n  ... and {n} more"),
    };
    Err(TrainerError::Input {
        path: path.to_path_buf(),
        message: format!(
            "{} records the reward functions cannot score:\n{}{more}",
            bad.len(),
            bad[..bad.len().min(SHOWN)].join("\n")
        ),
    })
}

/// Refuses a rubric file that `conrub rubrics validate` rejects (its errors name line and field).
pub fn check_rubrics(path: &Path) -> Result<()> {
    check_records(path, &conrub_rubric::read_jsonl(path)?)
}

/// The task's records, read and checked once ([`check_data`]): a run built from them
/// ([`Trainer::from_checked`](crate::Trainer::from_checked)) does not read the files again.
pub struct CheckedData {
    data: TaskData,
}

/// Reads and checks every file of the task (`data.rubrics` or `[[data.train]]`) as training
/// will, before anything loads: records `conrub rubrics validate` rejects, ids shared by two
/// files, weights that draw nothing. The `[[reward.functions]]` are built with the built-in
/// kinds (an unknown kind or option, a bad pattern, an unset API key variable) and the records
/// they cannot score refused.
pub fn check_data(cfg: &TrainConfig) -> Result<CheckedData> {
    check_data_with(cfg, RewardKinds::builtin())
}

/// [`check_data`] with the reward function kinds `[[reward.functions]]` may name.
pub fn check_data_with(cfg: &TrainConfig, kinds: RewardKinds<RubricRecord>) -> Result<CheckedData> {
    let data = crate::data::read_task(cfg)?;
    check_rewards(cfg, &data, kinds)?;
    Ok(CheckedData { data })
}

/// `[eval]`'s judges (in process on `device`, or clients) and held-out prompts: the validator,
/// or `None` without `[eval]`.
fn validator<B: KernelOps>(
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
