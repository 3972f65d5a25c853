//! The learning loop end to end on a tiny random Qwen3: rewards that favour one token must rise,
//! and two runs with the same seed must be bit-identical.

use std::sync::Arc;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use conrub_grpo::{
    InProcessEngine, Learner, LearnerConfig, ObjectiveSettings, OptimizerSettings,
    PairwiseTieBreaker, RolloutBatch, RolloutEngine, RolloutRequest, SystemSettings, TextCodec,
    TieMode,
};
use conrub_judge::LexicalJudge;
use conrub_models::{CausalLm, ModelConfig};
use conrub_parallel::Sharding;
use conrub_rewards::{GroupScores, JudgeRewards, RewardSource};
use conrub_rollout::{EngineConfig, FinishReason, Generation};
use conrub_rubric::{
    score_labels, Criterion, Label, LengthPenalty, Message, ResponseScore, RubricRecord,
    ScoringMode,
};
use conrub_trainer::Trainee;

type B = Autodiff<Flex>;

/// Token `i` is the word `t{i}`; prompts are a few ids derived from the question.
struct WordCodec;

impl TextCodec for WordCodec {
    fn encode_prompt(&self, messages: &[Message]) -> conrub_contracts::Result<Vec<u32>> {
        Ok(messages[0]
            .content
            .bytes()
            .take(5)
            .map(|b| (b % 60) as u32)
            .collect())
    }
    fn decode(&self, ids: &[u32]) -> conrub_contracts::Result<String> {
        Ok(ids
            .iter()
            .map(|i| format!("t{i}"))
            .collect::<Vec<_>>()
            .join(" "))
    }
}

const SAYS_T7: &str = "The response says t7.";
const SAYS_T9: &str = "The response says t9.";

fn records() -> Vec<RubricRecord> {
    (0..4)
        .map(|i| RubricRecord {
            id: format!("p{i}"),
            question: vec![Message::user(format!("question {i} about tokens"))],
            reference_answer: None,
            ground_truth: None,
            source: None,
            criteria: vec![Criterion::content(SAYS_T7), Criterion::content(SAYS_T9)],
            provenance: None,
        })
        .collect()
}

fn judge() -> Arc<LexicalJudge> {
    Arc::new(
        LexicalJudge::default()
            .with_keywords(SAYS_T7, &["t7"], &[])
            .with_keywords(SAYS_T9, &["t9"], &["t3"]),
    )
}

fn learner_with(
    config: &ModelConfig,
    init_seed: u64,
    cfg: LearnerConfig,
) -> Learner<B, CausalLm<B>> {
    let judge = judge();
    let rewards = JudgeRewards {
        judge: judge.clone(),
        mode: ScoringMode::ThreeState,
        penalty: LengthPenalty::disabled(),
        dropout: None,
        seed: cfg.seed,
    };
    learner_rewarded(config, init_seed, cfg, rewards)
}

fn learner_rewarded(
    config: &ModelConfig,
    init_seed: u64,
    cfg: LearnerConfig,
    rewards: impl RewardSource + 'static,
) -> Learner<B, CausalLm<B>> {
    let model = CausalLm::<B>::random(config, 0.1, init_seed, &Default::default());
    let ties = PairwiseTieBreaker::new(judge(), cfg.seed);
    let engine = InProcessEngine {
        prompts_per_call: cfg.system.rollout_prompts_per_call,
        engine: EngineConfig::default(),
    };
    Learner::builder(model, cfg, Default::default())
        .rollout(engine)
        .codec(WordCodec)
        .rewards(rewards)
        .tie_breaker(ties)
        .build()
        .unwrap()
}

/// One binary criterion per token: is its id even? (Varied rewards for a random policy over any
/// vocabulary.)
struct EvenIds;

#[async_trait::async_trait]
impl RewardSource for EvenIds {
    async fn score_group(
        &self,
        _record: &RubricRecord,
        responses: &[String],
        lengths: &[u32],
        _step: u64,
    ) -> GroupScores {
        let scores = responses
            .iter()
            .zip(lengths)
            .map(|(r, &len)| {
                let labels: Vec<Label> = r
                    .split(' ')
                    .map(|t| {
                        if t.trim_start_matches('t').parse::<u32>().unwrap_or(1) % 2 == 0 {
                            Label::Yes
                        } else {
                            Label::No
                        }
                    })
                    .collect();
                ResponseScore::Scored(
                    score_labels(
                        &labels,
                        labels.len(),
                        ScoringMode::Binary,
                        len,
                        &LengthPenalty::disabled(),
                    )
                    .unwrap(),
                )
            })
            .collect();
        GroupScores {
            scores,
            criteria: vec![],
            judge_retries: 0,
            judge_latency_ms: 0.0,
            judge_deferred: 0,
        }
    }
}

fn learner(cfg: LearnerConfig) -> Learner<B, CausalLm<B>> {
    learner_with(&ModelConfig::tiny(64), 5, cfg)
}

fn config() -> LearnerConfig {
    LearnerConfig {
        group_size: 8,
        max_response_tokens: 6,
        mini_batches: 2,
        seed: 7,
        optimizer: OptimizerSettings {
            lr: 3e-3,
            weight_decay: 0.0,
            ..Default::default()
        },
        system: SystemSettings {
            rollout_prompts_per_call: 4,
            micro_batch_tokens: 64,
            ..Default::default()
        },
        ..Default::default()
    }
}

async fn run(steps: usize, cfg: LearnerConfig) -> Vec<conrub_grpo::StepMetrics> {
    let recs = records();
    let mut l = learner(cfg);
    let refs: Vec<&RubricRecord> = recs.iter().collect();
    let mut out = Vec::new();
    for _ in 0..steps {
        out.push(l.step(&refs).await.unwrap().metrics);
    }
    out
}

#[tokio::test]
async fn reward_rises_and_telemetry_is_complete() {
    let m = run(14, config()).await;
    let first: f64 = m[..3].iter().map(|x| x.reward_mean).sum::<f64>() / 3.0;
    let last: f64 = m[m.len() - 3..].iter().map(|x| x.reward_mean).sum::<f64>() / 3.0;
    eprintln!(
        "reward per step: {:?}",
        m.iter()
            .map(|x| (x.reward_mean * 1000.0).round() / 1000.0)
            .collect::<Vec<_>>()
    );
    assert!(
        last > first + 0.1,
        "reward should rise: first {first:.3}, last {last:.3}"
    );
    for x in &m {
        assert_eq!((x.responses, x.scored, x.unscored), (32, 32, 0));
        assert_eq!(x.optimizer_steps, 2, "two mini-batches, one PPO epoch");
        assert_eq!(x.grad_norms.len(), 2);
        assert!(x.grad_norms.iter().all(|g| g.is_finite()));
        assert_eq!(
            x.truncated, 32,
            "no stop ids: every response hits the limit"
        );
        assert_eq!(x.reward_histogram.iter().sum::<u64>(), 32);
        assert_eq!(x.ties.groups, 4);
        // Rollout engine telemetry: 4 prompts x 8 rows per call, each prompt prefilled once.
        assert!(
            x.rollout_decode_steps > 0 && x.rollout_kv_blocks > 0 && x.rollout_peak_kv_blocks > 0,
            "{x:?}"
        );
        assert_eq!(
            (x.rollout_peak_running_rows, x.rollout_preemptions),
            (32, 0)
        );
        assert!(x.rollout_prefill_tokens > 0 && x.rollout_mean_running_rows > 0.0);
    }
    // Once every response earns the full reward, groups tie exactly and go to the pairwise judge.
    let end = m.last().unwrap();
    assert!(
        end.ties.tied_groups > 0 && end.ties.pairwise_calls == 8 * end.ties.tied_groups,
        "{:?}",
        end.ties
    );
}

/// `learner.mask_truncated` in the learner: every response of this config hits the length
/// limit (no stop ids), so masking them leaves nothing in the loss: a zero loss, zero gradient
/// norms and unchanged weights, where the same step without the mask updates the policy.
#[tokio::test]
async fn masked_truncated_responses_leave_the_loss() {
    let recs = records();
    let refs: Vec<&RubricRecord> = recs.iter().collect();
    for mask_truncated in [false, true] {
        let mut l = learner(LearnerConfig {
            objective: ObjectiveSettings {
                mask_truncated,
                ..config().objective.clone()
            },
            ..config()
        });
        let before = weights(l.policy());
        let m = l.step(&refs).await.unwrap().metrics;
        assert_eq!(m.truncated, 32);
        assert_eq!(m.optimizer_steps, 2);
        let moved = weight_gap(&before, &weights(l.policy())) > 0.0;
        if mask_truncated {
            assert_eq!(m.loss, 0.0, "{m:?}");
            assert!(m.grad_norms.iter().all(|g| *g == 0.0), "{:?}", m.grad_norms);
            assert!(!moved, "the weights moved");
        } else {
            assert!(m.grad_norms.iter().all(|g| *g > 0.0), "{:?}", m.grad_norms);
            assert!(moved);
        }
    }
}

/// A learning rate that blows the weights up: the next step's gradient norm is not finite, and
/// under `on_nonfinite = "stop"` that step stops with an error naming it before its update; under
/// `"skip-step"` the optimizer step is dropped and counted, and the run stops once more than
/// `max_skipped_steps` were dropped in a row. The weights never become non-finite.
#[tokio::test]
async fn nonfinite_gradients_stop_or_skip_the_step() {
    let recs = records();
    let refs: Vec<&RubricRecord> = recs.iter().collect();
    let blow_up = LearnerConfig {
        mini_batches: 1,
        optimizer: OptimizerSettings {
            lr: 1e30,
            ..config().optimizer.clone()
        },
        ..config()
    };
    let mut l = learner(blow_up.clone());
    l.step(&refs).await.unwrap();
    let e = l.step(&refs).await.unwrap_err().to_string();
    assert!(
        e.starts_with("step 1: the gradient norm is NaN") && e.contains("before writing it"),
        "{e}"
    );
    assert!(weights(l.policy()).iter().all(|w| w.is_finite()));

    let mut l = learner(LearnerConfig {
        system: SystemSettings {
            on_nonfinite: conrub_grpo::OnNonFinite::SkipStep,
            max_skipped_steps: 1,
            ..blow_up.system.clone()
        },
        ..blow_up
    });
    l.step(&refs).await.unwrap();
    let m = l.step(&refs).await.unwrap().metrics;
    assert_eq!((m.optimizer_steps, m.skipped_optimizer_steps), (0, 1));
    assert!(m.grad_norms.is_empty());
    let e = l.step(&refs).await.unwrap_err().to_string();
    assert!(
        e.starts_with("step 2: ") && e.contains("2 optimizer steps skipped in a row"),
        "{e}"
    );
    assert!(weights(l.policy()).iter().all(|w| w.is_finite()));
}

#[tokio::test]
async fn same_seed_same_run_bit_for_bit() {
    let cfg = LearnerConfig {
        tie_mode: TieMode::GrpoDpo,
        ppo_epochs: 2,
        ..config()
    };
    let a = run(2, cfg.clone()).await;
    let b = run(2, cfg).await;
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.reward_mean.to_bits(), y.reward_mean.to_bits());
        assert_eq!(x.loss.to_bits(), y.loss.to_bits());
        assert_eq!(
            x.grad_norms.iter().map(|g| g.to_bits()).collect::<Vec<_>>(),
            y.grad_norms.iter().map(|g| g.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(x.optimizer_steps, 4);
    }
}

#[tokio::test]
async fn resume_continues_bit_identically() {
    let cfg = LearnerConfig {
        ppo_epochs: 2,
        objective: ObjectiveSettings {
            kl_beta: 0.05,
            ..config().objective.clone()
        },
        ..config()
    };
    let recs = records();
    let refs: Vec<&RubricRecord> = recs.iter().collect();

    let straight = run(4, cfg.clone()).await;

    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let mut first = learner(cfg.clone());
    for _ in 0..2 {
        first.step(&refs).await.unwrap();
    }
    conrub_grpo::save_state(&first, serde_json::json!({"next_prompt": 8}), &state).unwrap();
    drop(first);
    assert!(!dir.path().join("state.tmp").exists() && !dir.path().join("state.old").exists());
    // A crash between the two renames of a later save leaves this state only in `state.old`.
    std::fs::rename(&state, dir.path().join("state.old")).unwrap();
    // A learner from a different initialisation: everything must come from the state directory.
    let mut resumed = learner_with(&ModelConfig::tiny(64), 99, cfg);
    let saved = conrub_grpo::load_state(&mut resumed, &state).unwrap();
    assert_eq!(
        (saved.step, saved.data_cursor["next_prompt"].as_u64()),
        (2, Some(8))
    );
    for want in &straight[2..] {
        let got = resumed.step(&refs).await.unwrap().metrics;
        assert_eq!(got.step, want.step);
        assert_eq!(
            got.reward_mean.to_bits(),
            want.reward_mean.to_bits(),
            "step {}",
            want.step
        );
        assert_eq!(
            got.loss.to_bits(),
            want.loss.to_bits(),
            "step {}",
            want.step
        );
        assert_eq!(
            got.kl.map(f64::to_bits),
            want.kl.map(f64::to_bits),
            "step {}",
            want.step
        );
        assert_eq!(
            got.grad_norms
                .iter()
                .map(|g| g.to_bits())
                .collect::<Vec<_>>(),
            want.grad_norms
                .iter()
                .map(|g| g.to_bits())
                .collect::<Vec<_>>(),
            "step {}",
            want.step
        );
    }
}

/// With the full Qwen3 vocabulary the tied embedding's gradient has 9.7M elements, where
/// burn-flex's own `sum()` combines threads in a varying order. Clipped steps (the clip
/// coefficient depends on that norm) must still give byte-identical checkpoints.
#[tokio::test]
async fn clipped_steps_on_the_full_vocabulary_write_identical_checkpoints() {
    let mut model = ModelConfig::tiny(151_936);
    model.num_hidden_layers = 1;
    let cfg = LearnerConfig {
        max_response_tokens: 3,
        mini_batches: 4,
        optimizer: OptimizerSettings {
            max_grad_norm: 0.2,
            ..config().optimizer.clone()
        },
        system: SystemSettings {
            rollout_prompts_per_call: 2,
            ..config().system.clone()
        },
        ..config()
    };
    let recs = records();
    let refs: Vec<&RubricRecord> = recs[..2].iter().collect();
    let dir = tempfile::tempdir().unwrap();
    let mut norms = Vec::new();
    let mut bytes = Vec::new();
    for run in 0..2 {
        let mut l = learner_rewarded(&model, 3, cfg.clone(), EvenIds);
        let mut n = Vec::new();
        for _ in 0..2 {
            n.extend(l.step(&refs).await.unwrap().metrics.grad_norms);
        }
        // The exported weights (the training state's record files also hold burn's random
        // parameter ids, so they differ between any two processes).
        let out = dir.path().join(format!("run{run}"));
        conrub_models::save_pretrained(
            &l.policy().valid(),
            &model,
            None,
            None,
            &out,
            conrub_models::SaveDtype::F32,
        )
        .unwrap();
        bytes.push(std::fs::read(out.join("model.safetensors")).unwrap());
        norms.push(n);
    }
    assert_eq!(norms[0].len(), 8);
    assert!(
        norms[0].iter().any(|&g| g > 0.2),
        "some steps must be clipped: {:?}",
        norms[0]
    );
    assert_eq!(
        norms[0].iter().map(|g| g.to_bits()).collect::<Vec<_>>(),
        norms[1].iter().map(|g| g.to_bits()).collect::<Vec<_>>()
    );
    assert!(bytes[0] == bytes[1], "exported weights differ");
}

#[test]
fn aggregation_and_reward_scaling_parse_as_documented() {
    let cfg: LearnerConfig =
        serde_json::from_str(r#"{"aggregation": "dr-grpo", "scale_rewards": "none"}"#).unwrap();
    assert_eq!(
        (cfg.objective.aggregation, cfg.scale_rewards),
        (
            conrub_grpo::Aggregation::DrGrpo,
            conrub_grpo::ScaleRewards::None
        )
    );
    let e = serde_json::from_str::<LearnerConfig>(r#"{"aggregation": "token-mean"}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sequence-mean") && e.contains("global-token-mean") && e.contains("dr-grpo"),
        "{e}"
    );
    let e = serde_json::from_str::<LearnerConfig>(r#"{"scale_rewards": "batch"}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`group`") && e.contains("`none`"), "{e}");
}

/// `learner.activation_checkpointing` reaches the policy through
/// `Policy::enable_activation_checkpointing` (an embedder sets it on the learner, not on the
/// model), and two steps with it match two steps without it (the same gradients up to f32
/// summation order).
#[tokio::test]
async fn checkpointing_set_on_the_learner_reaches_the_policy_and_keeps_the_run() {
    let recs = records();
    let refs: Vec<&RubricRecord> = recs.iter().collect();
    let mut runs = Vec::new();
    for on in [false, true] {
        let mut l = learner(LearnerConfig {
            system: SystemSettings {
                activation_checkpointing: on,
                ..config().system.clone()
            },
            ..config()
        });
        assert_eq!(l.policy().execution().activation_checkpointing, on);
        let mut m = Vec::new();
        for _ in 0..2 {
            m.push(l.step(&refs).await.unwrap().metrics);
        }
        runs.push(m);
    }
    for (off, on) in runs[0].iter().zip(&runs[1]) {
        assert_eq!(
            off.reward_mean, on.reward_mean,
            "step {}: same rollouts",
            off.step
        );
        assert!(
            (off.loss - on.loss).abs() <= 1e-5 * off.loss.abs().max(1e-3),
            "step {}: loss {} vs {}",
            off.step,
            off.loss,
            on.loss
        );
        for (a, b) in off.grad_norms.iter().zip(&on.grad_norms) {
            assert!(
                (a - b).abs() <= 1e-4 * a.abs().max(1e-6),
                "step {}: grad norm {a} vs {b}",
                off.step
            );
        }
    }
}

/// An engine outside the policy (what an inference server looks like to the learner): it answers
/// every prompt with fixed responses and records the weight syncs it is sent.
struct ScriptedEngine {
    /// The versions of `sync_weights` calls in order, -1 for `release`.
    syncs: Arc<std::sync::Mutex<Vec<i64>>>,
    /// Drop the last log-probability of row 0 (a malformed reply).
    malformed: bool,
}

type Inner = <CausalLm<B> as AutodiffModule<B>>::InnerModule;

impl RolloutEngine<Flex, Inner> for ScriptedEngine {
    fn rollout(
        &self,
        _policy: &Inner,
        request: &RolloutRequest<'_>,
        _device: &burn::tensor::Device<Flex>,
    ) -> conrub_contracts::Result<RolloutBatch> {
        let mut batch = RolloutBatch::new(request.group_size, request.prompts.to_vec());
        for _ in request.prompts {
            for r in 0..request.group_size as u32 {
                // Row r says t7 when r is even: rewards differ inside every group.
                let tokens = vec![if r % 2 == 0 { 7 } else { 5 }, 11, 3 + r];
                batch.push(Generation {
                    logprobs: vec![-0.5; tokens.len()],
                    tokens,
                    finish_reason: FinishReason::Stop,
                });
            }
        }
        if self.malformed {
            batch.logprobs[0].pop();
        }
        Ok(batch)
    }

    fn sync_weights(
        &self,
        _policy: &Inner,
        version: u64,
    ) -> conrub_contracts::Result<conrub_grpo::WeightSync> {
        self.syncs.lock().unwrap().push(version as i64);
        Ok(conrub_grpo::WeightSync {
            secs: 0.5,
            bytes: 100,
        })
    }

    fn release(&self) -> conrub_contracts::Result<()> {
        self.syncs.lock().unwrap().push(-1);
        Ok(())
    }
}

/// The learner's log-probs of the scripted engine's responses to `recs` against `engine_lp`
/// per token: the sum and max of `|d|`, the sum of `exp(d) - d - 1`, and the token count.
fn gap_to(policy: &CausalLm<B>, recs: &[RubricRecord], engine_lp: f64) -> (f64, f64, f64, f64) {
    use conrub_grpo::{Policy, TextCodec};
    let inner = policy.valid();
    let (mut sum, mut max, mut k3, mut tokens) = (0f64, 0f64, 0f64, 0f64);
    for rec in recs {
        let prompt = WordCodec.encode_prompt(&rec.question).unwrap();
        for r in 0..8u32 {
            let response = vec![if r % 2 == 0 { 7 } else { 5 }, 11, 3 + r];
            let batch = conrub_grpo::TokenBatch::<Flex>::new(
                [(prompt.as_slice(), response.as_slice())],
                &Default::default(),
            );
            let lp: Vec<f32> = inner
                .response_logprobs(&batch)
                .logprobs
                .into_data()
                .to_vec()
                .unwrap();
            for l in lp {
                let d = l as f64 - engine_lp;
                sum += d.abs();
                max = max.max(d.abs());
                k3 += d.exp() - d - 1.0;
                tokens += 1.0;
            }
        }
    }
    (sum, max, k3, tokens)
}

/// A learner whose rollouts come from `engine`.
fn scripted_learner(engine: ScriptedEngine) -> Learner<B, CausalLm<B>> {
    let model = CausalLm::<B>::random(&ModelConfig::tiny(64), 0.1, 1, &Default::default());
    Learner::builder(model, config(), Default::default())
        .rollout(engine)
        .tie_breaker(PairwiseTieBreaker::new(judge(), 7))
        .codec(WordCodec)
        .rewards(JudgeRewards {
            judge: judge(),
            mode: ScoringMode::ThreeState,
            penalty: LengthPenalty::disabled(),
            dropout: None,
            seed: 7,
        })
        .build()
        .unwrap()
}

#[tokio::test]
async fn an_external_engine_supplies_the_rollouts_and_gets_a_sync_after_every_step() {
    let recs = records();
    let refs: Vec<&RubricRecord> = recs.iter().collect();
    let syncs = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut l = scripted_learner(ScriptedEngine {
        syncs: syncs.clone(),
        malformed: false,
    });
    for step in 0..3 {
        // The learner's own log-probs of the engine's tokens before the step: the engine said
        // -0.5 for each, so the gap is known exactly.
        let (sum, max, k3, tokens) = gap_to(l.policy(), &recs, -0.5);
        let out = l.step(&refs).await.unwrap();
        let m = &out.metrics;
        assert_eq!((m.responses, m.truncated), (32, 0), "step {step}");
        assert_eq!(out.responses[0][0], "t7 t11 t3");
        // No engine telemetry from this engine: the in-process counters stay 0.
        assert_eq!((m.rollout_decode_steps, m.rollout_kv_blocks), (0, 0));
        assert!(m.grad_norms.iter().all(|g| *g > 0.0), "it trains on them");
        // Two syncs a step (before the rollout, a no-op for a synced engine, and after).
        assert_eq!((m.weight_sync_secs, m.weight_sync_bytes), (1.0, 200));
        let near = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1e-3);
        assert!(
            near(m.rollout_logprob_diff_mean, sum / tokens),
            "step {step}"
        );
        assert!(near(m.rollout_logprob_diff_max, max), "step {step}");
        assert!(near(m.rollout_kl, k3 / tokens), "step {step}");
    }
    assert_eq!(*syncs.lock().unwrap(), vec![0, -1, 1, 1, -1, 2, 2, -1, 3]);

    let mut l = scripted_learner(ScriptedEngine {
        syncs: Default::default(),
        malformed: true,
    });
    let err = l.step(&refs).await.unwrap_err().to_string();
    assert!(err.contains("not one per token"), "{err}");
}

/// Every float parameter of `policy`, flattened in module order.
fn weights(policy: &CausalLm<B>) -> Vec<f32> {
    struct All(Vec<f32>);
    impl burn::module::ModuleVisitor<B> for All {
        fn visit_float<const D: usize>(
            &mut self,
            param: &burn::module::Param<burn::tensor::Tensor<B, D>>,
        ) {
            let v = param.val().into_data().convert::<f32>();
            self.0.extend(v.iter::<f32>());
        }
    }
    let mut all = All(Vec::new());
    burn::module::Module::visit(policy, &mut all);
    all.0
}

fn five_records() -> Vec<RubricRecord> {
    let mut recs = records();
    recs.push(RubricRecord {
        id: "p4".into(),
        question: vec![Message::user("a fifth question, about t7")],
        ..recs[0].clone()
    });
    recs
}

/// The learner of rank `rank` (or of one device) for the data-parallel tests: the same weights,
/// settings and judges on every rank.
fn dp_builder(
    cfg: &LearnerConfig,
    device: &burn::backend::flex::FlexDevice,
    even_ids: bool,
) -> conrub_grpo::LearnerBuilder<B, CausalLm<B>> {
    let model = CausalLm::<B>::random(&ModelConfig::tiny(64), 0.1, 3, device);
    let b = Learner::builder(model, cfg.clone(), *device)
        .rollout(InProcessEngine {
            prompts_per_call: cfg.system.rollout_prompts_per_call,
            engine: EngineConfig::default(),
        })
        .codec(WordCodec)
        .tie_breaker(PairwiseTieBreaker::new(judge(), cfg.seed));
    if even_ids {
        b.rewards(EvenIds)
    } else {
        b.rewards(JudgeRewards {
            judge: judge(),
            mode: ScoringMode::ThreeState,
            penalty: LengthPenalty::disabled(),
            dropout: None,
            seed: cfg.seed,
        })
    }
}

/// `steps` steps on `world` ranks (1: a plain learner): every step's output, and the weights.
/// With `states`, the state before each step is saved to `states/<step>` (one device only).
async fn dp_run(
    cfg: &LearnerConfig,
    world: usize,
    even_ids: bool,
    steps: usize,
    states: Option<&std::path::Path>,
) -> (Vec<conrub_grpo::StepOutput>, Vec<f32>) {
    let recs = five_records();
    let refs: Vec<&RubricRecord> = recs.iter().collect();
    let mut outs = Vec::new();
    if world == 1 {
        let mut l = dp_builder(cfg, &Default::default(), even_ids)
            .build()
            .unwrap();
        for s in 0..steps {
            if let Some(dir) = states {
                conrub_grpo::save_state(&l, serde_json::Value::Null, &dir.join(s.to_string()))
                    .unwrap();
            }
            outs.push(l.step(&refs).await.unwrap());
        }
        return (outs, weights(l.policy()));
    }
    let mut dp = dp_group_of(cfg, world, even_ids);
    for _ in 0..steps {
        outs.push(dp.step(&refs).await.unwrap());
    }
    dp.check_replicas().unwrap();
    (outs, weights(dp.learner().policy()))
}

fn dp_group_of(
    cfg: &LearnerConfig,
    world: usize,
    even_ids: bool,
) -> conrub_grpo::DataParallel<B, CausalLm<B>> {
    sharded_group(cfg, world, even_ids, Sharding::None)
}

fn sharded_group(
    cfg: &LearnerConfig,
    world: usize,
    even_ids: bool,
    sharding: Sharding,
) -> conrub_grpo::DataParallel<B, CausalLm<B>> {
    let devices = vec![Default::default(); world];
    let collective = Arc::new(conrub_parallel::HostCollective::new(world));
    conrub_grpo::DataParallel::build_sharded(&devices, collective, 4096, sharding, |_, d| {
        Ok(dp_builder(cfg, d, even_ids))
    })
    .unwrap()
}

/// Each step of `world` ranks started from the one-device run's state before that step (saved
/// in `states`): the step itself compared, without the drift of earlier steps.
async fn dp_steps_from(
    cfg: &LearnerConfig,
    world: usize,
    even_ids: bool,
    states: &std::path::Path,
    steps: usize,
) -> Vec<conrub_grpo::StepOutput> {
    let recs = five_records();
    let refs: Vec<&RubricRecord> = recs.iter().collect();
    let mut dp = dp_group_of(cfg, world, even_ids);
    let mut outs = Vec::new();
    for s in 0..steps {
        dp.load_state(&states.join(s.to_string())).unwrap();
        outs.push(dp.step(&refs).await.unwrap());
    }
    outs
}

/// Advantages, tie status and every pair's verdicts of a step (its timings aside).
fn verdicts(outcomes: &[conrub_grpo::GroupOutcome]) -> Vec<String> {
    outcomes
        .iter()
        .map(|o| {
            let pairs: Vec<String> = o
                .pairs
                .iter()
                .map(|p| {
                    let c = p.comparison.as_ref();
                    let answers = c.map(|c| (&c.forward.answer, &c.backward.answer));
                    format!(
                        "{} {} {:?} {:?} {answers:?}",
                        p.a, p.b, p.outcome, p.winner_longer
                    )
                })
                .collect();
            format!("{:?} {:?} {pairs:?}", o.advantages, o.status)
        })
        .collect()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / a.abs().max(b.abs()).max(1e-12)
}

/// The data-parallel tests' settings: 5 groups of 4 over the ranks, two mini-batches of several
/// micro-batches, gradient clipping active.
fn dp_config() -> LearnerConfig {
    LearnerConfig {
        group_size: 4,
        max_response_tokens: 6,
        mini_batches: 2,
        seed: 11,
        optimizer: OptimizerSettings {
            lr: 3e-3,
            weight_decay: 0.01,
            max_grad_norm: 0.05,
            ..Default::default()
        },
        system: SystemSettings {
            rollout_prompts_per_call: 2,
            micro_batch_tokens: 40,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// 2 and 3 simulated ranks against one device: the same rewards, tie verdicts and advantages
/// exactly, losses within 1e-6 and weights within 1e-5 (relative), for each aggregation and tie
/// mode, with 5 groups over the ranks, several micro-batches and gradient clipping active.
#[tokio::test]
async fn data_parallel_ranks_train_as_one_device() {
    use conrub_grpo::Aggregation;
    let base = dp_config();
    let cases = [
        (
            Aggregation::SequenceMean,
            TieMode::Pairwise,
            true,
            &[2usize, 3][..],
        ),
        (
            Aggregation::GlobalTokenMean,
            TieMode::GrpoDpo,
            false,
            &[2][..],
        ),
        (Aggregation::DrGrpo, TieMode::Pairwise, false, &[3][..]),
    ];
    for (aggregation, tie_mode, even_ids, worlds) in cases {
        let cfg = LearnerConfig {
            tie_mode,
            objective: ObjectiveSettings {
                aggregation,
                ..base.clone().objective.clone()
            },
            ..base.clone()
        };
        let what = format!("{aggregation:?}, {tie_mode:?}");
        let states = tempfile::tempdir().unwrap();
        let (one, w1) = dp_run(&cfg, 1, even_ids, 3, Some(states.path())).await;
        assert!(
            one.iter()
                .flat_map(|o| &o.metrics.grad_norms)
                .any(|g| *g > 0.05),
            "{what}: clipping is active"
        );
        for &world in worlds {
            let (many, wn) = dp_run(&cfg, world, even_ids, 3, None).await;
            let synced = dp_steps_from(&cfg, world, even_ids, states.path(), 3).await;
            for (s, ((a, b), c)) in one.iter().zip(&many).zip(&synced).enumerate() {
                let at = format!("{what}, {world} ranks, step {s}");
                for (b, run) in [(b, "free run"), (c, "from one device's state")] {
                    assert_eq!(a.responses, b.responses, "{at}, {run}: responses");
                    assert_eq!(a.scores, b.scores, "{at}, {run}: rewards");
                    assert_eq!(
                        verdicts(&a.outcomes),
                        verdicts(&b.outcomes),
                        "{at}, {run}: advantages, verdicts"
                    );
                    let (ma, mb) = (&a.metrics, &b.metrics);
                    assert_eq!(ma.ties, mb.ties, "{at}, {run}: tie counts");
                    assert_eq!((mb.ranks, ma.ranks), (world, 1), "{at}");
                    assert!(mb.allreduce_bytes > 0, "{at}: the gradients were reduced");
                    for (x, y) in ma.grad_norms.iter().zip(&mb.grad_norms) {
                        assert!(rel(*x, *y) < 1e-5, "{at}, {run}: grad norm {x} vs {y}");
                    }
                }
                // The step's loss from the same state: within 1e-6. A free run drifts by f32
                // rounding (summation order), amplified over steps; its weights are bounded below.
                let (la, lc) = (a.metrics.loss, c.metrics.loss);
                eprintln!(
                    "{at}: loss rel {:e}, free run {:e}",
                    rel(la, lc),
                    rel(la, b.metrics.loss)
                );
                assert!(rel(la, lc) < 1e-6, "{at}: loss {la} vs {lc}");
            }
            let scale = w1.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
            let diff = w1
                .iter()
                .zip(&wn)
                .fold(0f64, |m, (x, y)| m.max((x - y).abs() as f64));
            assert!(
                diff / scale < 1e-5,
                "{what}, {world} ranks: weights differ by {diff}"
            );
        }
    }
}

/// The largest relative difference of two weight vectors (scaled by the largest weight).
fn weight_gap(a: &[f32], b: &[f32]) -> f64 {
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    let diff = a
        .iter()
        .zip(b)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs() as f64));
    diff / scale
}

/// Sharded groups of 3 ranks against one device (`optimizer`; `gradients` with activation
/// checkpointing, so each layer's gradients are reduce-scattered as the backward makes them;
/// `full`, whose ranks keep a third of the parameters and gather each layer as it runs):
/// the same responses, rewards, verdicts and advantages exactly, each step's loss from the same
/// state within 1e-6 (1e-5 with `gradients` and `full`: their sums are added in another order),
/// gradient norms within 1e-5 and weights after 3 steps within 1e-5
/// (relative). Each rank's optimizer file holds its own parameters' moments only (disjoint,
/// together all of them, balanced), and a state saved by 3 ranks sharding `optimizer`
/// resumes on 2 ranks sharding `full` and ends within 1e-5 of the straight run. A step
/// with fewer groups than ranks trains as one device too.
#[tokio::test]
async fn sharded_ranks_train_as_one_device() {
    let recs = five_records();
    let refs: Vec<&RubricRecord> = recs.iter().collect();
    let base = dp_config();
    for (sharding, checkpointing) in [
        (Sharding::Optimizer, false),
        (Sharding::Gradients, true),
        (Sharding::Full, true),
    ] {
        let cfg = LearnerConfig {
            system: SystemSettings {
                activation_checkpointing: checkpointing,
                ..base.clone().system.clone()
            },
            ..base.clone()
        };
        let states = tempfile::tempdir().unwrap();
        let (one, w1) = dp_run(&cfg, 1, true, 3, Some(states.path())).await;
        let mut group = sharded_group(&cfg, 3, true, sharding);
        let mut many = Vec::new();
        for _ in 0..3 {
            many.push(group.step(&refs).await.unwrap());
        }
        group.check_replicas().unwrap();
        if sharding == Sharding::Full {
            // Each rank holds about a third of the parameters' elements (the rest placeholders).
            let whole = weights(&group.whole_policy(None).unwrap()).len();
            for l in group.learners() {
                let held = weights(l.policy()).len();
                assert!(
                    held * 2 < whole,
                    "a full rank holds {held} of {whole} elements"
                );
            }
        }
        let wn = weights(&group.whole_policy(None).unwrap());
        let mut synced = Vec::new();
        let mut from_state = sharded_group(&cfg, 3, true, sharding);
        for s in 0..3 {
            from_state
                .load_state(&states.path().join(s.to_string()))
                .unwrap();
            synced.push(from_state.step(&refs).await.unwrap());
        }
        for (s, ((a, b), c)) in one.iter().zip(&many).zip(&synced).enumerate() {
            let at = format!("{sharding:?}, step {s}");
            for (b, run) in [(b, "free run"), (c, "from one device's state")] {
                assert_eq!(a.responses, b.responses, "{at}, {run}: responses");
                assert_eq!(a.scores, b.scores, "{at}, {run}: rewards");
                assert_eq!(verdicts(&a.outcomes), verdicts(&b.outcomes), "{at}, {run}");
                let mb = &b.metrics;
                assert!(
                    mb.reduce_scatter_bytes > 0 && mb.all_gather_bytes > 0,
                    "{at}: gradients reduce-scattered, weights gathered"
                );
                for (x, y) in a.metrics.grad_norms.iter().zip(&mb.grad_norms) {
                    assert!(rel(*x, *y) < 1e-5, "{at}, {run}: grad norm {x} vs {y}");
                }
            }
            // The second mini-batch's loss follows the first's update, whose gradient sums
            // are added in another order when each micro-batch's pieces are reduced apart
            // (`gradients`): f32 rounding, amplified by the step.
            let tol = if sharding.shards_gradients() {
                1e-5
            } else {
                1e-6
            };
            let (la, lc) = (a.metrics.loss, c.metrics.loss);
            eprintln!("{at}: loss from the same state within {:e}", rel(la, lc));
            assert!(rel(la, lc) < tol, "{at}: loss {la} vs {lc}");
        }
        let gap = weight_gap(&w1, &wn);
        eprintln!("{sharding:?}: weights after 3 steps within {gap:e} of one device");
        assert!(gap < 1e-5, "{sharding:?}: weights differ by {gap:e}");
        // Each rank's optimizer file: its own parameters only.
        let saved = tempfile::tempdir().unwrap();
        group
            .save(serde_json::Value::Null, saved.path())
            .and_then(|draft| draft.seal())
            .unwrap();
        let manifest: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(saved.path().join("manifest.json")).unwrap(),
        )
        .unwrap();
        let shards = manifest["sharding"]["shards"].as_array().unwrap();
        let params = manifest["parameters"].as_array().unwrap().len();
        let mut seen: Vec<u64> = shards
            .iter()
            .flat_map(|s| {
                s["parameters"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|i| i.as_u64().unwrap())
            })
            .collect();
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..params as u64).collect::<Vec<_>>(),
            "disjoint and complete"
        );
        let elements: Vec<u64> = shards
            .iter()
            .map(|s| s["elements"].as_u64().unwrap())
            .collect();
        let (lo, hi) = (
            elements.iter().min().unwrap(),
            elements.iter().max().unwrap(),
        );
        assert!(*hi < 2 * *lo, "balanced by bytes: {elements:?}");
        if sharding == Sharding::Full {
            // Each rank's parameters in a file of their own; read back by 2 ranks sharding
            // `gradients` (each whole) and by 2 sharding `full` (each its new share): the same
            // weights, bit for bit.
            let files = manifest["policy_shards"].as_array().unwrap();
            assert_eq!(files.len(), 3, "{manifest}");
            for (mode, cfg) in [(Sharding::Gradients, &cfg), (Sharding::Full, &cfg)] {
                let mut other = sharded_group(cfg, 2, true, mode);
                other.load_state(saved.path()).unwrap();
                let got = weights(&other.whole_policy(None).unwrap());
                assert!(got == wn, "{mode:?} from a full state: other weights");
            }
        }
    }
    // 3 ranks sharding `optimizer` for 2 steps, saved; 2 ranks sharding `full` resume for the
    // third.
    let (_, straight) = dp_run(&base, 1, true, 3, None).await;
    let saved = tempfile::tempdir().unwrap();
    let mut first = sharded_group(&base, 3, true, Sharding::Optimizer);
    for _ in 0..2 {
        first.step(&refs).await.unwrap();
    }
    first
        .save(serde_json::Value::Null, saved.path())
        .and_then(|draft| draft.seal())
        .unwrap();
    let checkpointed = LearnerConfig {
        system: SystemSettings {
            activation_checkpointing: true,
            ..base.clone().system.clone()
        },
        ..base.clone()
    };
    let mut second = sharded_group(&checkpointed, 2, true, Sharding::Full);
    let state = second.load_state(saved.path()).unwrap();
    assert_eq!(state.step, 2);
    second.step(&refs).await.unwrap();
    let gap = weight_gap(&straight, &weights(&second.whole_policy(None).unwrap()));
    eprintln!("resumed 3 -> 2 ranks, optimizer -> full: within {gap:e} of the straight run");
    assert!(
        gap < 1e-5,
        "resumed across world sizes and modes: weights differ by {gap:e}"
    );
    // A step of 2 groups on 3 ranks (the short last step of an epoch): the rank without a group
    // joins every collective with zeros, and the step is one device's.
    let two = &refs[..2];
    let mut one = dp_builder(&base, &Default::default(), true)
        .build()
        .unwrap();
    let a = one.step(two).await.unwrap();
    for sharding in [Sharding::None, Sharding::Gradients, Sharding::Full] {
        let cfg = LearnerConfig {
            system: SystemSettings {
                activation_checkpointing: sharding == Sharding::Full,
                ..base.clone().system.clone()
            },
            ..base.clone()
        };
        let mut group = sharded_group(&cfg, 3, true, sharding);
        let b = group.step(two).await.unwrap();
        assert_eq!((&a.responses, &a.scores), (&b.responses, &b.scores));
        assert!(rel(a.metrics.loss, b.metrics.loss) < 1e-5, "{sharding:?}");
        let gap = weight_gap(
            &weights(one.policy()),
            &weights(&group.whole_policy(None).unwrap()),
        );
        assert!(gap < 1e-5, "{sharding:?}, a rank without a group: {gap:e}");
    }
}

/// Exports the policy's weights as raw f32 bytes (`weights.bin`).
struct WeightHooks;

impl conrub_trainer::RunHooks<CausalLm<B>> for WeightHooks {
    fn export(
        &mut self,
        policy: &CausalLm<B>,
        dir: &std::path::Path,
    ) -> conrub_trainer::Result<()> {
        std::fs::create_dir_all(dir).unwrap();
        let bytes: Vec<u8> = weights(policy)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        std::fs::write(dir.join("weights.bin"), bytes).unwrap();
        Ok(())
    }
}

/// An export that writes part of a checkpoint and then fails, as a full disk would.
struct DiskFullHooks;

impl conrub_trainer::RunHooks<CausalLm<B>> for DiskFullHooks {
    fn export(
        &mut self,
        _policy: &CausalLm<B>,
        dir: &std::path::Path,
    ) -> conrub_trainer::Result<()> {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("model.safetensors"), vec![0u8; 4096]).unwrap();
        Err(conrub_trainer::TrainerError::io(
            dir.join("model.safetensors"),
            "No space left on device (os error 28)",
        ))
    }
}

/// A checkpoint whose writing fails (a full disk) stops the run with an error that says so, and
/// its partial copy is removed rather than left filling the disk.
#[tokio::test]
async fn a_failed_checkpoint_write_leaves_no_partial_copy() {
    let recs = records();
    let tmp = tempfile::tempdir().unwrap();
    let mut l = learner(config());
    let run = conrub_trainer::RunConfig {
        max_steps: Some(1),
        ..dp_run_config(tmp.path(), 1)
    };
    let err = conrub_trainer::train(&mut l, &recs, &run, None, None, &mut DiskFullHooks)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("checkpoint-000001")
            && err.contains("its partial copy was removed (is the disk full?)")
            && err.contains("No space left on device"),
        "{err}"
    );
    let left: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

fn dp_run_config(dir: &std::path::Path, max_steps: u64) -> conrub_trainer::RunConfig {
    conrub_trainer::RunConfig {
        epochs: 4,
        prompts_per_step: 5,
        checkpoint_every: 2,
        max_steps: Some(max_steps),
        output_dir: dir.to_path_buf(),
        keep_checkpoints: None,
        sample_groups: 16,
        tensorboard: true,
        checkpoint_in_background: true,
        overwrite: false,
        set_aside: false,
    }
}

fn dp_group(cfg: &LearnerConfig, world: usize) -> conrub_grpo::DataParallel<B, CausalLm<B>> {
    dp_group_of(cfg, world, true)
}

/// metrics.jsonl without its timing fields.
fn metrics_without_times(dir: &std::path::Path) -> Vec<serde_json::Value> {
    fn strip(v: &mut serde_json::Value) {
        if let Some(o) = v.as_object_mut() {
            o.retain(|k, _| !k.contains("secs") && !k.ends_with("_ms"));
            o.values_mut().for_each(strip);
        }
    }
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            strip(&mut v);
            v
        })
        .collect()
}

/// Two identical 2-rank runs export identical bytes; a 2-rank run stopped after its step-2
/// checkpoint and resumed on 2 ranks ends with the straight run's metrics and weights exactly;
/// the same checkpoint resumes on 1 rank.
#[tokio::test]
async fn data_parallel_runs_repeat_and_resume_exactly() {
    let cfg = LearnerConfig {
        group_size: 4,
        max_response_tokens: 6,
        mini_batches: 2,
        seed: 5,
        optimizer: OptimizerSettings {
            lr: 3e-3,
            max_grad_norm: 0.05,
            ..Default::default()
        },
        system: SystemSettings {
            rollout_prompts_per_call: 2,
            micro_batch_tokens: 40,
            ..Default::default()
        },
        ..Default::default()
    };
    let recs = five_records();
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    for dir in [&a, &b] {
        let mut group = dp_group(&cfg, 2);
        conrub_trainer::train(
            &mut group,
            &recs,
            &dp_run_config(dir, 4),
            None,
            None,
            &mut WeightHooks,
        )
        .await
        .unwrap();
    }
    let last =
        |d: &std::path::Path| std::fs::read(d.join("checkpoint-000004/weights.bin")).unwrap();
    assert_eq!(last(&a), last(&b), "two identical runs");
    assert_eq!(metrics_without_times(&a), metrics_without_times(&b));

    // Stopped after step 2 (its checkpoint is the last thing written), then resumed.
    let mut group = dp_group(&cfg, 2);
    conrub_trainer::train(
        &mut group,
        &recs,
        &dp_run_config(&c, 2),
        None,
        None,
        &mut WeightHooks,
    )
    .await
    .unwrap();
    let ckpt = c.join("checkpoint-000002");
    let mut group = dp_group(&cfg, 2);
    conrub_trainer::train(
        &mut group,
        &recs,
        &dp_run_config(&c, 4),
        Some(&ckpt),
        None,
        &mut WeightHooks,
    )
    .await
    .unwrap();
    assert_eq!(last(&a), last(&c), "resumed on 2 ranks");
    assert_eq!(metrics_without_times(&a), metrics_without_times(&c));

    // The replicated state resumes on one device too (the same run directory, from step 2).
    let mut one = dp_builder(&cfg, &Default::default(), true).build().unwrap();
    let summary = conrub_trainer::train(
        &mut one,
        &recs,
        &dp_run_config(&c, 4),
        Some(&ckpt),
        None,
        &mut WeightHooks,
    )
    .await
    .unwrap();
    assert_eq!((summary.steps_run, summary.total_steps), (2, 4));
    assert_eq!(
        metrics_without_times(&a)[..2],
        metrics_without_times(&c)[..2]
    );
}

/// Panics while scoring the fifth prompt from step 1 on (rank 1 holds it on 2 ranks).
struct FailsOnP4(EvenIds);

#[async_trait::async_trait]
impl RewardSource for FailsOnP4 {
    async fn score_group(
        &self,
        record: &RubricRecord,
        responses: &[String],
        lengths: &[u32],
        step: u64,
    ) -> GroupScores {
        assert!(
            !(record.id == "p4" && step >= 1),
            "judge budget exhausted on {}",
            record.id
        );
        self.0.score_group(record, responses, lengths, step).await
    }
}

/// A rank that fails stops every rank within seconds with that rank's error, and the last
/// complete checkpoint stays intact.
#[tokio::test]
async fn a_failing_rank_stops_the_group_with_its_error() {
    let cfg = LearnerConfig {
        group_size: 4,
        max_response_tokens: 6,
        ..Default::default()
    };
    let recs = five_records();
    let tmp = tempfile::tempdir().unwrap();
    let devices = vec![Default::default(); 2];
    let collective = Arc::new(conrub_parallel::HostCollective::new(2));
    let mut group = conrub_grpo::DataParallel::build(&devices, collective, 4096, |_, d| {
        Ok(dp_builder(&cfg, d, true).rewards(FailsOnP4(EvenIds)))
    })
    .unwrap();
    let run = conrub_trainer::RunConfig {
        checkpoint_every: 1,
        ..dp_run_config(tmp.path(), 4)
    };
    let started = std::time::Instant::now();
    let err = conrub_trainer::train(&mut group, &recs, &run, None, None, &mut WeightHooks)
        .await
        .unwrap_err()
        .to_string();
    assert!(started.elapsed().as_secs() < 30, "{:?}", started.elapsed());
    // The epoch order decides which rank holds p4; the error names it and says why.
    assert!(
        err.contains(" panicked: judge budget exhausted on p4") && err.contains("rank "),
        "{err}"
    );
    let ckpt = tmp.path().join("checkpoint-000001");
    assert!(ckpt.join("weights.bin").is_file() && !tmp.path().join("checkpoint-000002").exists());
    let mut fresh = dp_builder(&cfg, &Default::default(), true).build().unwrap();
    let state = conrub_grpo::load_state(&mut fresh, &ckpt.join("training_state")).unwrap();
    assert_eq!(state.step, 1);
}

/// A grader whose labels depend on the validation round: all criteria `correct` in the round
/// listed in `good`, `missing` otherwise, `wrong` in `bad` (rounds counted by requests seen).
struct RoundGrader {
    requests_per_round: usize,
    seen: std::sync::atomic::AtomicUsize,
    scores: Vec<Label>,
}

#[async_trait::async_trait]
impl conrub_judge::CriterionJudge for RoundGrader {
    fn id(&self) -> String {
        "round-grader".into()
    }

    async fn judge(&self, r: &conrub_judge::CriterionRequest) -> conrub_judge::CriterionVerdict {
        let n = self.seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let label = self.scores[(n / self.requests_per_round).min(self.scores.len() - 1)];
        conrub_judge::CriterionVerdict::labelled(
            vec![label; r.criteria.len()],
            vec![],
            1,
            std::time::Duration::ZERO,
        )
    }
}

/// Validation rounds after steps 2, 4 and 6 with grader scores 0, +1, -1: the round after step 4
/// is the best, gets a checkpoint although `checkpoint_every` is 0, is recorded in
/// `best-checkpoint.json`, and survives `keep_checkpoints = 1`; a resume from step 4 keeps the
/// record and the eval lines up to it.
#[tokio::test]
async fn validation_keeps_the_grader_best_checkpoint() {
    use conrub_grpo::ValidationDecoding;
    use conrub_trainer::{ValidationConfig, Validator};
    let dir = tempfile::tempdir().unwrap();
    let recs = records();
    let examples: Vec<conrub_trainer::HeldOutPrompt> = recs
        .iter()
        .take(2)
        .map(|r| conrub_trainer::HeldOutPrompt {
            prompt: r.question.clone(),
            criteria: r.criterion_texts(),
        })
        .collect();
    let validator = |scores: Vec<Label>| Validator {
        cfg: ValidationConfig {
            every: 2,
            data: "unused".into(),
            samples: 2,
            decoding: ValidationDecoding::Greedy,
            max_new_tokens: Some(4),
            limit: None,
            bootstrap_resamples: 100,
        },
        examples: examples.clone(),
        mode: ScoringMode::ThreeState,
        training: judge(),
        grader: Arc::new(RoundGrader {
            requests_per_round: 4,
            seen: Default::default(),
            scores,
        }),
        seed: 7,
    };
    let run = conrub_trainer::RunConfig {
        epochs: 12,
        prompts_per_step: 2,
        checkpoint_every: 0,
        max_steps: Some(6),
        output_dir: dir.path().to_path_buf(),
        keep_checkpoints: Some(1),
        sample_groups: 16,
        tensorboard: true,
        checkpoint_in_background: true,
        overwrite: false,
        set_aside: false,
    };
    let v = validator(vec![Label::Missing, Label::Correct, Label::Wrong]);
    let mut l = learner(config());
    let summary = conrub_trainer::train(&mut l, &recs, &run, None, Some(&v), &mut WeightHooks)
        .await
        .unwrap();
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(dir.path().join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["kind"] == "eval")
        .collect();
    let grader: Vec<f64> = lines
        .iter()
        .map(|e| e["grader"]["score"].as_f64().unwrap())
        .collect();
    assert_eq!(grader, vec![0.0, 1.0, -1.0]);
    assert_eq!(
        lines
            .iter()
            .map(|e| e["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![2, 4, 6]
    );
    for e in &lines {
        assert_eq!(e["responses"], 4);
        assert_eq!(e["training"]["scored"], 4);
        assert_eq!(e["grader"]["labels"].as_object().unwrap().len(), 1);
    }
    let best = summary.best.expect("a best round");
    assert_eq!((best.step, best.grader_score), (4, 1.0));
    let record: conrub_trainer::BestCheckpoint = serde_json::from_str(
        &std::fs::read_to_string(conrub_trainer::best_checkpoint_path(dir.path())).unwrap(),
    )
    .unwrap();
    assert_eq!(record, best);
    let mut kept: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    kept.sort();
    assert_eq!(kept, vec!["checkpoint-000004", "checkpoint-000006"]);

    // Resumed from the best checkpoint with a grader that now scores -1 everywhere: the record
    // stays (nothing beats it), the eval lines after step 4 are written again.
    let v = validator(vec![Label::Wrong]);
    let mut l = learner(config());
    let ckpt = dir.path().join("checkpoint-000004");
    let summary =
        conrub_trainer::train(&mut l, &recs, &run, Some(&ckpt), Some(&v), &mut WeightHooks)
            .await
            .unwrap();
    assert_eq!(summary.best.map(|b| b.step), Some(4));
    let steps: Vec<u64> = std::fs::read_to_string(dir.path().join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "eval")
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, vec![2, 4, 6]);
}

/// A replica whose weights differ from rank 0's is an error naming it.
#[test]
fn a_drifted_data_parallel_replica_is_named() {
    use conrub_grpo::DataParallel;
    use conrub_parallel::HostCollective;
    struct Ids;
    impl TextCodec for Ids {
        fn encode_prompt(&self, _: &[Message]) -> conrub_contracts::Result<Vec<u32>> {
            Ok(vec![1, 2])
        }
        fn decode(&self, ids: &[u32]) -> conrub_contracts::Result<String> {
            Ok(format!("{ids:?}"))
        }
    }
    struct Zero;
    #[async_trait::async_trait]
    impl RewardSource for Zero {
        async fn score_group(
            &self,
            _: &RubricRecord,
            _: &[String],
            _: &[u32],
            _: u64,
        ) -> GroupScores {
            unreachable!("no step is taken")
        }
    }
    let devices = vec![Default::default(); 3];
    let group = DataParallel::<B, CausalLm<B>>::build(
        &devices,
        Arc::new(HostCollective::new(3)),
        1 << 20,
        |rank, device| {
            // Rank 2 starts from other weights.
            let seed = if rank == 2 { 9 } else { 1 };
            let model = CausalLm::random(&ModelConfig::tiny(32), 0.1, seed, device);
            let cfg = LearnerConfig {
                tie_mode: TieMode::Off,
                ..Default::default()
            };
            Ok(Learner::builder(model, cfg, *device)
                .codec(Ids)
                .rewards(Zero))
        },
    )
    .unwrap();
    let e = group.check_replicas().unwrap_err().to_string();
    assert!(
        e.contains("rank 2's parameters differ from rank 0's"),
        "{e}"
    );
}

/// An estimator registered by name and chosen by `learner.estimator` is the one the learner
/// runs: all-zero advantages leave the weights where they were (no gradient reaches AdamW, weight
/// decay 0), while the built-in `group-relative` on the same run moves them; the ties go to the
/// tie breaker either way.
#[tokio::test]
async fn the_config_chooses_a_registered_estimator_by_name() {
    struct Zero;
    impl conrub_grpo::AdvantageEstimator for Zero {
        fn advantages(&self, rewards: &[Option<f64>]) -> Vec<f64> {
            vec![0.0; rewards.len()]
        }
    }
    let recs = records();
    let refs: Vec<&RubricRecord> = recs.iter().collect();
    let step_with = |estimator: &str| {
        let cfg = LearnerConfig {
            estimator: estimator.into(),
            tie_mode: TieMode::Off,
            ..config()
        };
        let mut registry = conrub_grpo::Registry::<B>::builtin();
        registry.register_estimator("zero", |_| Ok(Box::new(Zero)));
        let model = CausalLm::<B>::random(&ModelConfig::tiny(64), 0.1, 5, &Default::default());
        let engine = InProcessEngine {
            prompts_per_call: cfg.system.rollout_prompts_per_call,
            engine: EngineConfig::default(),
        };
        let judge = judge();
        let rewards = JudgeRewards {
            judge,
            mode: ScoringMode::ThreeState,
            penalty: LengthPenalty::disabled(),
            dropout: None,
            seed: cfg.seed,
        };
        Learner::builder(model, cfg, Default::default())
            .rollout(engine)
            .codec(WordCodec)
            .rewards(rewards)
            .registry(registry)
            .build()
    };
    let before = weights(step_with("zero").unwrap().policy());
    let mut zero = step_with("zero").unwrap();
    let m = zero.step(&refs).await.unwrap().metrics;
    assert!(m.reward_std_population > 0.0, "the rewards vary: {m:?}");
    assert_eq!(
        weights(zero.policy()),
        before,
        "zero advantages moved the weights"
    );
    let mut grpo = step_with("group-relative").unwrap();
    grpo.step(&refs).await.unwrap();
    assert_ne!(weights(grpo.policy()), before);
    let e = step_with("rloo").err().unwrap().to_string();
    assert!(
        e.contains("learner.estimator") && e.contains("group-relative, zero"),
        "{e}"
    );
}

/// The kernel warm-up's walk (`Learner::walk_shapes`, `DataParallel::walk_shapes`) makes
/// passes through the learner and its engine at every class of shape and leaves no trace: the
/// steps after it equal, bit for bit, those of a twin that did not walk, on one device and on 3
/// ranks sharding everything (whose passes are collectives the ranks make together).
#[tokio::test]
async fn the_shape_walk_leaves_no_trace() {
    let recs = five_records();
    let refs: Vec<&RubricRecord> = recs.iter().collect();
    let cfg = dp_config();
    let lens = [3, 5, 9];
    // A step's metrics without its timing fields.
    fn strip(v: &mut serde_json::Value) {
        if let Some(o) = v.as_object_mut() {
            o.retain(|k, _| !k.contains("secs") && !k.ends_with("_ms") && !k.contains("per_sec"));
            o.values_mut().for_each(strip);
        }
    }
    let metrics = |o: &conrub_grpo::StepOutput| {
        let mut v = serde_json::to_value(&o.metrics).unwrap();
        strip(&mut v);
        v
    };
    let (mut walked, mut plain) = (
        dp_builder(&cfg, &Default::default(), true).build().unwrap(),
        dp_builder(&cfg, &Default::default(), true).build().unwrap(),
    );
    let (a, b) = (
        walked.step(&refs).await.unwrap(),
        plain.step(&refs).await.unwrap(),
    );
    assert_eq!(metrics(&a), metrics(&b));
    let (micro, engine) = walked.walk_shapes(&lens, refs.len()).unwrap();
    assert!(
        micro >= 5 && engine >= 5,
        "{micro} micro-batches, {engine} engine passes"
    );
    let (a, b) = (
        walked.step(&refs).await.unwrap(),
        plain.step(&refs).await.unwrap(),
    );
    assert_eq!(metrics(&a), metrics(&b));
    assert_eq!(weights(walked.policy()), weights(plain.policy()));

    let mut walked = sharded_group(&cfg, 3, true, Sharding::Full);
    let mut plain = sharded_group(&cfg, 3, true, Sharding::Full);
    let (m, e) = walked.walk_shapes(&lens, refs.len()).unwrap();
    // A rank's steps hold 2 of the 5 groups: fewer whole-step rows, the same engine calls.
    assert!(
        m >= 5 && e == engine,
        "{m} micro-batches, {e} engine passes"
    );
    let (a, b) = (
        walked.step(&refs).await.unwrap(),
        plain.step(&refs).await.unwrap(),
    );
    assert_eq!(metrics(&a), metrics(&b));
}
