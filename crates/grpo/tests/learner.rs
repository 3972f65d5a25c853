//! The learning loop end to end on a tiny random Qwen3: rewards that favour one token must rise,
//! and two runs with the same seed must be bit-identical.

use std::sync::Arc;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use conrub_grpo::{
    GroupScores, InProcessEngine, JudgeRewards, Learner, LearnerConfig, PairwiseTieBreaker,
    RewardSource, RolloutBatch, RolloutEngine, RolloutRequest, TextCodec, TieMode,
};
use conrub_judge::LexicalJudge;
use conrub_qwen3::{Qwen3Config, Qwen3ForCausalLM};
use conrub_rollout::{EngineConfig, FinishReason, Generation};
use conrub_rubric::{
    score_labels, Criterion, Label, LengthPenalty, Message, ResponseScore, RubricRecord,
    ScoringMode,
};

type B = Autodiff<Flex>;

/// Token `i` is the word `t{i}`; prompts are a few ids derived from the question.
struct WordCodec;

impl TextCodec for WordCodec {
    fn encode_prompt(&self, messages: &[Message]) -> conrub_grpo::Result<Vec<u32>> {
        Ok(messages[0]
            .content
            .bytes()
            .take(5)
            .map(|b| (b % 60) as u32)
            .collect())
    }
    fn decode(&self, ids: &[u32]) -> conrub_grpo::Result<String> {
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
    config: &Qwen3Config,
    init_seed: u64,
    cfg: LearnerConfig,
) -> Learner<B, Qwen3ForCausalLM<B>> {
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
    config: &Qwen3Config,
    init_seed: u64,
    cfg: LearnerConfig,
    rewards: impl RewardSource + 'static,
) -> Learner<B, Qwen3ForCausalLM<B>> {
    let model = Qwen3ForCausalLM::<B>::random(config, 0.1, init_seed, &Default::default());
    let ties = PairwiseTieBreaker::new(judge(), cfg.seed);
    let engine = InProcessEngine {
        prompts_per_call: cfg.rollout_prompts_per_call,
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
        }
    }
}

fn learner(cfg: LearnerConfig) -> Learner<B, Qwen3ForCausalLM<B>> {
    learner_with(&Qwen3Config::tiny(64), 5, cfg)
}

fn config() -> LearnerConfig {
    LearnerConfig {
        group_size: 8,
        max_response_tokens: 6,
        rollout_prompts_per_call: 4,
        lr: 3e-3,
        weight_decay: 0.0,
        mini_batches: 2,
        micro_batch_tokens: 64,
        seed: 7,
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
        kl_beta: 0.05,
        ppo_epochs: 2,
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
    let mut resumed = learner_with(&Qwen3Config::tiny(64), 99, cfg);
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
    let mut model = Qwen3Config::tiny(151_936);
    model.num_hidden_layers = 1;
    let cfg = LearnerConfig {
        max_response_tokens: 3,
        max_grad_norm: 0.2,
        mini_batches: 4,
        rollout_prompts_per_call: 2,
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
        conrub_qwen3::save_pretrained(
            &l.policy().valid(),
            &model,
            None,
            None,
            &out,
            conrub_qwen3::SaveDtype::F32,
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
        (cfg.aggregation, cfg.scale_rewards),
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
            activation_checkpointing: on,
            ..config()
        });
        assert_eq!(l.policy().exec.activation_checkpointing, on);
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
    syncs: Arc<std::sync::Mutex<Vec<u64>>>,
    /// Drop the last log-probability of row 0 (a malformed reply).
    malformed: bool,
}

type Inner = <Qwen3ForCausalLM<B> as AutodiffModule<B>>::InnerModule;

impl RolloutEngine<Flex, Inner> for ScriptedEngine {
    fn rollout(
        &self,
        _policy: &Inner,
        request: &RolloutRequest<'_>,
        _device: &burn::tensor::Device<Flex>,
    ) -> conrub_grpo::Result<RolloutBatch> {
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

    fn sync_weights(&self, _policy: &Inner, step: u64) -> conrub_grpo::Result<()> {
        self.syncs.lock().unwrap().push(step);
        Ok(())
    }
}

/// A learner whose rollouts come from `engine`.
fn scripted_learner(engine: ScriptedEngine) -> Learner<B, Qwen3ForCausalLM<B>> {
    let model = Qwen3ForCausalLM::<B>::random(&Qwen3Config::tiny(64), 0.1, 1, &Default::default());
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
        let out = l.step(&refs).await.unwrap();
        let m = &out.metrics;
        assert_eq!((m.responses, m.truncated), (32, 0), "step {step}");
        assert_eq!(out.responses[0][0], "t7 t11 t3");
        // No engine telemetry from this engine: the in-process counters stay 0.
        assert_eq!((m.rollout_decode_steps, m.rollout_kv_blocks), (0, 0));
        assert!(m.grad_norms.iter().all(|g| *g > 0.0), "it trains on them");
    }
    assert_eq!(*syncs.lock().unwrap(), vec![1, 2, 3]);

    let mut l = scripted_learner(ScriptedEngine {
        syncs: Default::default(),
        malformed: true,
    });
    let err = l.step(&refs).await.unwrap_err().to_string();
    assert!(err.contains("not one per token"), "{err}");
}
