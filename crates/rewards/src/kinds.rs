//! `[[reward.functions]]`: a weighted mix of reward functions, each built by its kind from a
//! registry ([`RewardKinds`]).
//!
//! | kind | what it gives a response | options |
//! |---|---|---|
//! | `rubric` | the criterion judge's exact reward (`[judge]`, `reward.mode`, length penalty, dropout); registered from the judge by [`RewardKinds::register_rubric`] | none |
//! | `exact` | 1 when the extracted answer equals the prompt's `ground_truth`, else 0 | `extract`, `pattern`, `case_sensitive` |
//! | `numeric` | 1 when the extracted answer's last number is within the tolerance of `ground_truth`, else 0 | `extract`, `pattern`, `tolerance`, `relative_tolerance` |
//! | `regex` | 1 when `pattern` is found in the response, else 0 | `pattern` |
//! | `format` | 1 when the whole response matches `pattern`, else 0 | `pattern` |
//! | `http` | a reward server's float ([`HttpReward`]) | `url`, `timeout_secs`, `max_retries`, `backoff_base_secs`, `backoff_max_secs`, `api_key_env` |
//!
//! The mix ([`WeightedRewards`]) is itself a [`RewardSource`]: every function scores the group
//! (concurrently), and a response's reward is `0.0 + w_1 v_1 + w_2 v_2 + ...` in the list's
//! order ([`MixedScore`]). A response that any function leaves unscored is unscored, never
//! given 0 for that part.
//!
//! Ties: a group is an exact tie when its mixed rewards are equal bit for bit (the learner's one
//! test). Equal parts always give equal mixes (one evaluation order); a server's floats are
//! compared bit for bit too, with no tolerance, and `-0.0` counts as `0.0`.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use conrub_rubric::{
    AnswerCheck, MixedScore, ResponseScore, RewardFunctionSpec, RewardPart, RubricRecord,
};
use futures::future::join_all;

use crate::error::{Result, RewardError};
use crate::http::HttpReward;
use crate::source::{GroupScores, RewardSource};
use crate::task::TaskPrompt;

/// Builds a reward function from its `[[reward.functions]]` entry; `at` names the entry in
/// errors (`reward.functions[1]`).
pub type RewardFactory<T> =
    Arc<dyn Fn(&RewardFunctionSpec, &str) -> Result<Arc<dyn RewardSource<T>>> + Send + Sync>;

/// The reward function kinds a run may name: the built-in ones, and whatever an embedder (or
/// `conrub-trainer`, for `rubric`) registers.
pub struct RewardKinds<T: TaskPrompt> {
    kinds: BTreeMap<String, RewardFactory<T>>,
}

impl<T: TaskPrompt> Clone for RewardKinds<T> {
    fn clone(&self) -> Self {
        Self {
            kinds: self.kinds.clone(),
        }
    }
}

/// The kinds [`RewardKinds::builtin`] holds.
pub const BUILTIN_REWARD_KINDS: &[&str] = &["exact", "numeric", "regex", "format", "http"];

impl<T: TaskPrompt + 'static> RewardKinds<T> {
    /// No kind at all.
    pub fn empty() -> Self {
        Self {
            kinds: BTreeMap::new(),
        }
    }

    /// `exact`, `numeric`, `regex`, `format` and `http`.
    pub fn builtin() -> Self {
        let mut kinds = Self::empty();
        for kind in ["exact", "numeric", "regex", "format"] {
            kinds.register(kind, |spec, at| {
                let check = AnswerCheck::from_spec(spec, at)?.expect("a verifiable kind");
                Ok(Arc::new(VerifiableReward { check }))
            });
        }
        kinds.register("http", |spec, at| {
            Ok(Arc::new(HttpReward::from_spec(spec, at)?))
        });
        kinds
    }

    /// Registers (or replaces) `kind`.
    pub fn register(
        &mut self,
        kind: &str,
        factory: impl Fn(&RewardFunctionSpec, &str) -> Result<Arc<dyn RewardSource<T>>>
            + Send
            + Sync
            + 'static,
    ) -> &mut Self {
        self.kinds.insert(kind.to_string(), Arc::new(factory));
        self
    }

    /// The registered kinds, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.kinds.keys().map(String::as_str).collect()
    }

    /// The mix of `specs` (`[[reward.functions]]`, checked: a known kind, a finite weight other
    /// than 0, unique names, the kind's own options).
    pub fn build(&self, specs: &[RewardFunctionSpec]) -> Result<WeightedRewards<T>> {
        if specs.is_empty() {
            return Err(config("reward.functions", "the list is empty".into()));
        }
        let mut functions = Vec::with_capacity(specs.len());
        for (i, spec) in specs.iter().enumerate() {
            let at = format!("reward.functions[{i}]");
            let factory = self.kinds.get(&spec.kind).ok_or_else(|| {
                let why = format!(
                    "`{}` is not a reward function kind (registered: {})",
                    spec.kind,
                    self.names().join(", ")
                );
                config(&format!("{at}.kind"), why)
            })?;
            if !spec.weight.is_finite() || spec.weight == 0.0 {
                let why = format!("{} is not a finite weight other than 0", spec.weight);
                return Err(config(&format!("{at}.weight"), why));
            }
            if specs[..i].iter().any(|s| s.name() == spec.name()) {
                let why = format!(
                    "a second function named `{}` (give each of them a `name`)",
                    spec.name()
                );
                return Err(config(&format!("{at}.name"), why));
            }
            functions.push(WeightedFunction {
                name: spec.name().to_string(),
                weight: spec.weight,
                source: factory(spec, &at)?,
            });
        }
        Ok(WeightedRewards { functions })
    }
}

impl RewardKinds<RubricRecord> {
    /// Registers kind `rubric`: `judged`, the rubric records' rewards from the criterion judge
    /// of `[judge]` ([`JudgeRewards`](crate::JudgeRewards) with `reward.mode`, the length
    /// penalty and dropout). The entry takes no options of its own.
    pub fn register_rubric(&mut self, judged: Arc<dyn RewardSource<RubricRecord>>) -> &mut Self {
        self.register("rubric", move |spec, at| {
            if let Some(key) = spec.options.keys().next() {
                return Err(RewardError::Config {
                    key: format!("{at}.{key}"),
                    message: "a `rubric` function has no options of its own: it is the judge of \
                              `[judge]` with `reward.mode`, the length penalty and dropout"
                        .into(),
                });
            }
            Ok(judged.clone())
        })
    }
}

fn config(key: &str, message: String) -> RewardError {
    RewardError::Config {
        key: key.into(),
        message,
    }
}

/// One function of a mix.
pub struct WeightedFunction<T: TaskPrompt> {
    /// Its name in samples and errors.
    pub name: String,
    /// Its weight.
    pub weight: f64,
    /// What scores.
    pub source: Arc<dyn RewardSource<T>>,
}

/// A weighted mix of reward functions: a [`RewardSource`] whose responses get
/// [`ResponseScore::Mixed`] rewards.
pub struct WeightedRewards<T: TaskPrompt> {
    functions: Vec<WeightedFunction<T>>,
}

impl<T: TaskPrompt> WeightedRewards<T> {
    /// A mix of `functions` in this order.
    pub fn new(functions: Vec<WeightedFunction<T>>) -> Self {
        Self { functions }
    }

    /// The functions, in order.
    pub fn functions(&self) -> &[WeightedFunction<T>] {
        &self.functions
    }
}

#[async_trait]
impl<T: TaskPrompt> RewardSource<T> for WeightedRewards<T> {
    async fn score_group(
        &self,
        prompt: &T,
        responses: &[String],
        lengths: &[u32],
        step: u64,
    ) -> GroupScores {
        let each = self
            .functions
            .iter()
            .map(|f| f.source.score_group(prompt, responses, lengths, step));
        let groups = join_all(each).await;
        let scores = (0..responses.len())
            .map(|i| self.mix_response(&groups, i))
            .collect();
        GroupScores {
            scores,
            criteria: groups
                .iter()
                .find(|g| !g.criteria.is_empty())
                .map(|g| g.criteria.clone())
                .unwrap_or_default(),
            judge_retries: groups.iter().map(|g| g.judge_retries).sum(),
            judge_latency_ms: groups.iter().map(|g| g.judge_latency_ms).sum(),
            judge_deferred: groups.iter().map(|g| g.judge_deferred).sum(),
        }
    }

    fn check_prompt(&self, prompt: &T) -> Result<()> {
        for f in &self.functions {
            f.source.check_prompt(prompt).map_err(|e| {
                RewardError::Unscorable(format!("reward function `{}`: {e}", f.name))
            })?;
        }
        Ok(())
    }
}

impl<T: TaskPrompt> WeightedRewards<T> {
    /// Response `i`'s mixed score from every function's group scores.
    fn mix_response(&self, groups: &[GroupScores], i: usize) -> ResponseScore {
        let mut parts = Vec::with_capacity(self.functions.len());
        for (f, g) in self.functions.iter().zip(groups) {
            let score = match g.scores.get(i) {
                Some(ResponseScore::Unscored(u)) => {
                    let why = format!("reward function `{}`: {}", f.name, u.message);
                    return ResponseScore::unscored(why, u.attempts);
                }
                Some(s) => s.clone(),
                None => {
                    let why = format!(
                        "reward function `{}` gave {} scores for {} responses",
                        f.name,
                        g.scores.len(),
                        groups.first().map_or(0, |g| g.scores.len()).max(i + 1)
                    );
                    return ResponseScore::unscored(why, 1);
                }
            };
            parts.push(RewardPart {
                name: f.name.clone(),
                weight: f.weight,
                score,
            });
        }
        match MixedScore::mix(parts) {
            Some(m) => ResponseScore::Mixed(m),
            None => ResponseScore::unscored("the weighted sum of the parts is not finite", 1),
        }
    }
}

/// A verifiable check as a reward source: each response gets exactly 1 or 0.
pub struct VerifiableReward {
    /// The check.
    pub check: AnswerCheck,
}

#[async_trait]
impl<T: TaskPrompt> RewardSource<T> for VerifiableReward {
    async fn score_group(
        &self,
        prompt: &T,
        responses: &[String],
        _lengths: &[u32],
        _step: u64,
    ) -> GroupScores {
        let truth = prompt.ground_truth();
        let scores = responses
            .iter()
            .map(|r| match self.check.passes(r, truth) {
                Ok(pass) => ResponseScore::exact(i64::from(pass), 1),
                Err(why) => ResponseScore::unscored(why.to_string(), 1),
            })
            .collect();
        GroupScores::direct(scores)
    }

    fn check_prompt(&self, prompt: &T) -> Result<()> {
        self.check
            .check_ground_truth(prompt.ground_truth())
            .map_err(|e| RewardError::Unscorable(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::is_exact_tie;
    use conrub_rubric::{Message, UnscoredReason};

    struct Prompt {
        messages: Vec<Message>,
        truth: Option<String>,
    }

    impl TaskPrompt for Prompt {
        fn id(&self) -> &str {
            "p"
        }
        fn messages(&self) -> &[Message] {
            &self.messages
        }
        fn ground_truth(&self) -> Option<&str> {
            self.truth.as_deref()
        }
    }

    fn prompt(truth: Option<&str>) -> Prompt {
        Prompt {
            messages: vec![Message::user("How many mg?")],
            truth: truth.map(str::to_string),
        }
    }

    /// Gives response `i` the exact reward `num[i] / den`; `None` leaves it unscored.
    struct Fixed(Vec<Option<i64>>, i64);

    #[async_trait]
    impl RewardSource<Prompt> for Fixed {
        async fn score_group(&self, _: &Prompt, _: &[String], _: &[u32], _: u64) -> GroupScores {
            let scores = self
                .0
                .iter()
                .map(|n| match n {
                    Some(n) => ResponseScore::exact(*n, self.1),
                    None => ResponseScore::Unscored(UnscoredReason {
                        message: "judge timed out".into(),
                        attempts: 3,
                    }),
                })
                .collect();
            GroupScores {
                criteria: vec!["c1".into()],
                judge_retries: 2,
                ..GroupScores::direct(scores)
            }
        }
    }

    fn kinds() -> RewardKinds<Prompt> {
        let mut kinds = RewardKinds::builtin();
        kinds.register("fixed", |spec, _| {
            let nums = spec.options["nums"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_i64())
                .collect();
            Ok(Arc::new(Fixed(nums, 3)))
        });
        kinds
    }

    fn score(specs: &[RewardFunctionSpec], truth: Option<&str>, responses: &[&str]) -> GroupScores {
        let mix = kinds().build(specs).unwrap();
        let responses: Vec<String> = responses.iter().map(|s| s.to_string()).collect();
        let lengths = vec![5; responses.len()];
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(mix.score_group(&prompt(truth), &responses, &lengths, 0))
    }

    #[test]
    fn the_mix_is_the_weighted_sum_in_list_order() {
        let specs = [
            RewardFunctionSpec::new("fixed", 0.7).with("nums", vec![2, -1, 2]),
            RewardFunctionSpec::new("numeric", 0.3),
        ];
        let g = score(&specs, Some("300"), &["300 mg", "300 mg", "30 mg"]);
        let by_hand: [f64; 3] = [
            0.0 + 0.7 * (2.0 / 3.0) + 0.3 * 1.0,
            0.0 + 0.7 * (-1.0 / 3.0) + 0.3 * 1.0,
            0.0 + 0.7 * (2.0 / 3.0) + 0.3 * 0.0,
        ];
        for (s, want) in g.scores.iter().zip(by_hand) {
            assert_eq!(s.reward().unwrap().to_bits(), want.to_bits(), "{s:?}");
            let ResponseScore::Mixed(m) = s else {
                panic!("{s:?}")
            };
            assert_eq!(m.parts.len(), 2);
            assert_eq!(
                (m.parts[0].name.as_str(), m.parts[0].weight),
                ("fixed", 0.7)
            );
            assert_eq!(m.parts[1].name, "numeric");
        }
        // The judge-like part's criteria and retries carry over.
        assert_eq!(g.criteria, vec!["c1".to_string()]);
        assert_eq!(g.judge_retries, 2);
    }

    #[test]
    fn a_part_left_unscored_leaves_the_response_unscored() {
        let specs = [
            RewardFunctionSpec::new("fixed", 0.5).with("nums", vec![Some(1), None]),
            RewardFunctionSpec::new("regex", 0.5).with("pattern", "mg"),
        ];
        let g = score(&specs, None, &["1 mg", "2 mg"]);
        assert!(g.scores[0].is_scored());
        let ResponseScore::Unscored(u) = &g.scores[1] else {
            panic!("{:?}", g.scores[1])
        };
        assert_eq!(u.attempts, 3);
        assert!(
            u.message.contains("`fixed`: judge timed out"),
            "{}",
            u.message
        );
    }

    #[test]
    fn equal_parts_tie_bit_for_bit_and_negative_zero_counts_as_zero() {
        // Two responses with the same part values: the same bits, an exact tie.
        let specs = [
            RewardFunctionSpec::new("fixed", 0.1).with("nums", vec![1, 1]),
            RewardFunctionSpec::new("exact", 0.2),
        ];
        let g = score(&specs, Some("B"), &["b", "B."]);
        let r: Vec<Option<f64>> = g.scores.iter().map(ResponseScore::reward).collect();
        assert!(is_exact_tie(&r, 2), "{r:?}");
        // A negative weight on a zero part gives -0.0, which the sum from 0.0 turns into 0.0.
        let specs = [RewardFunctionSpec::new("regex", -1.0).with("pattern", "x")];
        let g = score(&specs, None, &["y"]);
        assert_eq!(g.scores[0].reward().unwrap().to_bits(), 0.0f64.to_bits());
        // Floats are compared bit for bit: 0.1 + 0.2 is not 0.3.
        let r = [Some(0.1 + 0.2), Some(0.3)];
        assert!(!is_exact_tie(&r, 2));
    }

    #[test]
    fn the_list_is_checked_and_prompts_are_checked_up_front() {
        let err = |specs: &[RewardFunctionSpec]| match kinds().build(specs) {
            Ok(_) => panic!("accepted {specs:?}"),
            Err(e) => e.to_string(),
        };
        let e = err(&[RewardFunctionSpec::new("nope", 1.0)]);
        assert!(
            e.contains("reward.functions[0].kind") && e.contains("exact"),
            "{e}"
        );
        let e = err(&[
            RewardFunctionSpec::new("exact", 1.0),
            RewardFunctionSpec::new("exact", 1.0),
        ]);
        assert!(e.contains("reward.functions[1].name"), "{e}");
        let e = err(&[RewardFunctionSpec::new("regex", 0.0).with("pattern", "a")]);
        assert!(e.contains("reward.functions[0].weight"), "{e}");
        assert!(err(&[]).contains("reward.functions"));
        let mix = kinds()
            .build(&[RewardFunctionSpec::new("numeric", 1.0)])
            .unwrap();
        let e = mix.check_prompt(&prompt(None)).unwrap_err().to_string();
        assert!(e.contains("`numeric`") && e.contains("ground_truth"), "{e}");
        assert!(mix.check_prompt(&prompt(Some("12"))).is_ok());
    }
}
