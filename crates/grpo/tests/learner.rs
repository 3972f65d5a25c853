//! The learning loop end to end on a tiny random Qwen3: rewards that favour one token must rise,
//! and two runs with the same seed must be bit-identical.

use std::sync::Arc;

use burn::backend::{Autodiff, Flex};
use conrub_grpo::{JudgeRewards, Learner, LearnerConfig, PairwiseTieBreaker, TextCodec, TieMode};
use conrub_judge::LexicalJudge;
use conrub_qwen3::{Qwen3Config, Qwen3ForCausalLM};
use conrub_rubric::{Criterion, LengthPenalty, Message, RubricRecord, RubricSet, ScoringMode};

type B = Autodiff<Flex>;

/// Token `i` is the word `t{i}`; prompts are a few ids derived from the question.
struct WordCodec;

impl TextCodec for WordCodec {
    fn encode_prompt(&self, messages: &[Message]) -> Result<Vec<u32>, String> {
        Ok(messages[0].content.bytes().take(5).map(|b| (b % 60) as u32).collect())
    }
    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        Ok(ids.iter().map(|i| format!("t{i}")).collect::<Vec<_>>().join(" "))
    }
}

fn records() -> Vec<RubricRecord> {
    (0..4)
        .map(|i| {
            let mut c = Criterion::content("The response says t7.");
            c.keywords = vec!["t7".into()];
            let mut d = Criterion::content("The response says t9.");
            d.keywords = vec!["t9".into()];
            d.contradictions = vec!["t3".into()];
            RubricRecord {
                id: format!("p{i}"),
                question: vec![Message::user(format!("question {i} about tokens"))],
                reference_answer: None,
                source: None,
                criteria: vec![c, d],
                provenance: None,
            }
        })
        .collect()
}

fn learner(cfg: LearnerConfig) -> Learner<B, Qwen3ForCausalLM<B>> {
    let config = Qwen3Config::tiny(64);
    let model = Qwen3ForCausalLM::<B>::random(&config, 0.1, 5, &Default::default());
    Learner::new(model, cfg, Default::default()).unwrap()
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
    let set = RubricSet::from_records("mem", recs.clone()).unwrap();
    let judge = Arc::new(LexicalJudge::new(&set));
    let rewards = JudgeRewards { judge: judge.clone(), mode: ScoringMode::ThreeState, penalty: LengthPenalty::disabled(), dropout: None, seed: 7 };
    let ties = PairwiseTieBreaker::new(judge, 7);
    let mut l = learner(cfg);
    let refs: Vec<&RubricRecord> = recs.iter().collect();
    let mut out = Vec::new();
    for _ in 0..steps {
        out.push(l.step(&refs, &WordCodec, &rewards, &ties, &[]).await.unwrap().metrics);
    }
    out
}

#[tokio::test]
async fn reward_rises_and_telemetry_is_complete() {
    let m = run(14, config()).await;
    let first: f64 = m[..3].iter().map(|x| x.reward_mean).sum::<f64>() / 3.0;
    let last: f64 = m[m.len() - 3..].iter().map(|x| x.reward_mean).sum::<f64>() / 3.0;
    eprintln!("reward per step: {:?}", m.iter().map(|x| (x.reward_mean * 1000.0).round() / 1000.0).collect::<Vec<_>>());
    assert!(last > first + 0.1, "reward should rise: first {first:.3}, last {last:.3}");
    for x in &m {
        assert_eq!((x.responses, x.scored, x.unscored), (32, 32, 0));
        assert_eq!(x.optimizer_steps, 2, "two mini-batches, one PPO epoch");
        assert_eq!(x.grad_norms.len(), 2);
        assert!(x.grad_norms.iter().all(|g| g.is_finite()));
        assert_eq!(x.truncated, 32, "no stop ids: every response hits the limit");
        assert_eq!(x.reward_histogram.iter().sum::<u64>(), 32);
        assert_eq!(x.ties.groups, 4);
    }
    // Once every response earns the full reward, groups tie exactly and go to the pairwise judge.
    let end = m.last().unwrap();
    assert!(end.ties.tied_groups > 0 && end.ties.pairwise_calls == 8 * end.ties.tied_groups, "{:?}", end.ties);
}

#[tokio::test]
async fn same_seed_same_run_bit_for_bit() {
    let cfg = LearnerConfig { tie_mode: TieMode::GrpoDpo, ppo_epochs: 2, ..config() };
    let a = run(2, cfg.clone()).await;
    let b = run(2, cfg).await;
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.reward_mean.to_bits(), y.reward_mean.to_bits());
        assert_eq!(x.loss.to_bits(), y.loss.to_bits());
        assert_eq!(x.grad_norms.iter().map(|g| g.to_bits()).collect::<Vec<_>>(), y.grad_norms.iter().map(|g| g.to_bits()).collect::<Vec<_>>());
        assert_eq!(x.optimizer_steps, 4);
    }
}

#[tokio::test]
async fn resume_continues_bit_identically() {
    let cfg = LearnerConfig { kl_beta: 0.05, ppo_epochs: 2, ..config() };
    let recs = records();
    let set = RubricSet::from_records("mem", recs.clone()).unwrap();
    let judge = Arc::new(LexicalJudge::new(&set));
    let rewards = JudgeRewards { judge: judge.clone(), mode: ScoringMode::ThreeState, penalty: LengthPenalty::disabled(), dropout: None, seed: 7 };
    let ties = PairwiseTieBreaker::new(judge, 7);
    let refs: Vec<&RubricRecord> = recs.iter().collect();

    let straight = run(4, cfg.clone()).await;

    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let mut first = learner(cfg.clone());
    for _ in 0..2 {
        first.step(&refs, &WordCodec, &rewards, &ties, &[]).await.unwrap();
    }
    conrub_grpo::save_state(&first, serde_json::json!({"next_prompt": 8}), &state).unwrap();
    drop(first);
    // A learner from a different initialisation: everything must come from the state directory.
    let config = Qwen3Config::tiny(64);
    let other = Qwen3ForCausalLM::<B>::random(&config, 0.1, 99, &Default::default());
    let mut resumed = Learner::new(other, cfg, Default::default()).unwrap();
    let saved = conrub_grpo::load_state(&mut resumed, &state).unwrap();
    assert_eq!((saved.step, saved.data_cursor["next_prompt"].as_u64()), (2, Some(8)));
    for want in &straight[2..] {
        let got = resumed.step(&refs, &WordCodec, &rewards, &ties, &[]).await.unwrap().metrics;
        assert_eq!(got.step, want.step);
        assert_eq!(got.reward_mean.to_bits(), want.reward_mean.to_bits(), "step {}", want.step);
        assert_eq!(got.loss.to_bits(), want.loss.to_bits(), "step {}", want.step);
        assert_eq!(got.kl.map(f64::to_bits), want.kl.map(f64::to_bits), "step {}", want.step);
        assert_eq!(
            got.grad_norms.iter().map(|g| g.to_bits()).collect::<Vec<_>>(),
            want.grad_norms.iter().map(|g| g.to_bits()).collect::<Vec<_>>(),
            "step {}",
            want.step
        );
    }
    assert!(!dir.path().join("state.tmp").exists() && !dir.path().join("state.old").exists());
}
