//! What sharding saves, measured: a data-parallel step of 4 simulated ranks (threads of one
//! process, flex) of a small random Qwen3 whose weights dwarf its activations, with a counting
//! allocator, once per sharding mode, after a first step (AdamW's moments exist by then).
//!
//! - The heap held after the step (the state a rank keeps between steps) falls from `none` to
//!   `optimizer` by the AdamW moments the ranks no longer keep, and to `full` by those and the
//!   master weights: within 15% of what `conrub plan` predicts per rank (its `adamw_moments`
//!   and `weights_f32` parts), times the 4 ranks.
//! - The peak heap of the step is lower in every sharded mode than with replicas.
//!
//! - The peak falls from `none` to `full` as the plan predicts (4 x its per-rank fall), within
//!   15% (from 0.97 to 1.12 in the runs seen).
//!
//! The ranks are threads of one process, so the process peak is measured: how many ranks are at
//! their own peak at once (each holds an embedding-sized gradient transient for a moment) varies
//! from run to run by one such tensor per rank (the `none` peak by about 8 MB here). The
//! `optimizer` and `gradients` peaks are printed and held below `none`'s, not to the plan: it
//! predicts them within 20 MB of `none`'s, and they fall by 70 MB and more (the plan is
//! pessimistic there). Alone in its binary: another test's allocations would count.

#[path = "../../../benches/common/peak.rs"]
mod peak;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use burn::backend::{Autodiff, Flex};
use conrub_grpo::{
    DataParallel, InProcessEngine, Learner, LearnerConfig, SystemSettings, TextCodec, TieMode,
};
use conrub_memory::{MemoryPlan, MemoryPlanInput};
use conrub_models::{CausalLm, ModelConfig};
use conrub_parallel::{HostCollective, Sharding};
use conrub_rewards::{GroupScores, RewardSource, TaskPrompt};
use conrub_rollout::EngineConfig;
use conrub_rubric::{Message, ResponseScore};

type B = Autodiff<Flex>;

const RANKS: usize = 4;
const PROMPTS: usize = 8;
const GROUP: usize = 4;
const RESPONSE: usize = 4;
/// Bytes per collective bucket.
const BUCKET_BYTES: usize = 1 << 16;

/// One prompt.
struct Prompt {
    id: String,
    messages: Vec<Message>,
}

impl TaskPrompt for Prompt {
    fn id(&self) -> &str {
        &self.id
    }
    fn messages(&self) -> &[Message] {
        &self.messages
    }
}

/// Token `i` is the word `t{i}`; a prompt is its first four bytes.
struct Words;

impl TextCodec for Words {
    fn encode_prompt(&self, messages: &[Message]) -> conrub_contracts::Result<Vec<u32>> {
        Ok(messages[0]
            .content
            .bytes()
            .take(4)
            .map(|b| u32::from(b % 60))
            .collect())
    }
    fn decode(&self, ids: &[u32]) -> conrub_contracts::Result<String> {
        Ok(ids.iter().map(|i| format!("t{i} ")).collect())
    }
}

/// 1 for a response whose first token is even, else 0 (rewards that differ within groups).
struct FirstEven;

#[async_trait::async_trait]
impl RewardSource<Prompt> for FirstEven {
    async fn score_group(
        &self,
        _prompt: &Prompt,
        responses: &[String],
        _lengths: &[u32],
        _step: u64,
    ) -> GroupScores {
        GroupScores::direct(
            responses
                .iter()
                .map(|r| {
                    let first: u32 = r[1..].split(' ').next().unwrap().parse().unwrap();
                    ResponseScore::exact(i64::from(first.is_multiple_of(2)), 1)
                })
                .collect(),
        )
    }
}

/// A Qwen3 with a large vocabulary and few, narrow layers: 2.2 M parameters, most of them the
/// tied embedding.
fn model_config() -> ModelConfig {
    let mut c = ModelConfig::tiny(16_384);
    c.hidden_size = 128;
    c.intermediate_size = 256;
    c
}

fn learner_config() -> LearnerConfig {
    LearnerConfig {
        group_size: GROUP,
        max_response_tokens: RESPONSE,
        tie_mode: TieMode::Off,
        seed: 5,
        system: SystemSettings {
            rollout_prompts_per_call: PROMPTS,
            // One row per micro-batch: an optimizer step sums several.
            micro_batch_tokens: 8,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The peak heap (bytes) of a step of 4 ranks sharding as `sharding` says (after a first step:
/// the AdamW moments exist), and the heap held after it.
fn measured(sharding: Sharding, prompts: &[Prompt]) -> (f64, f64) {
    let cfg = LearnerConfig {
        system: SystemSettings {
            // `full` gathers one layer at a time in the per-layer backward (`conrub train` sets it).
            activation_checkpointing: sharding.shards_parameters(),
            ..learner_config().system.clone()
        },
        ..learner_config()
    };
    let devices = vec![Default::default(); RANKS];
    let collective = Arc::new(HostCollective::new(RANKS));
    let mut group =
        DataParallel::build_sharded(&devices, collective, BUCKET_BYTES, sharding, |_, d| {
            let model = CausalLm::<B>::random(&model_config(), 0.02, 7, d);
            Ok(Learner::builder(model, cfg.clone(), *d)
                .rollout(InProcessEngine {
                    prompts_per_call: cfg.system.rollout_prompts_per_call,
                    engine: EngineConfig::default(),
                })
                .codec(Words)
                .rewards(FirstEven))
        })
        .unwrap();
    let refs: Vec<&Prompt> = prompts.iter().collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(group.step(&refs)).unwrap();
    // The lower of two steps' peaks: a step whose ranks happen to peak at the same moment
    // reads high (see the module's notes).
    let mut lowest = f64::INFINITY;
    for _ in 0..2 {
        peak::PEAK.store(peak::CURRENT.load(Ordering::SeqCst), Ordering::SeqCst);
        rt.block_on(group.step(&refs)).unwrap();
        lowest = lowest.min(peak::PEAK.load(Ordering::SeqCst) as f64);
    }
    (lowest, peak::CURRENT.load(Ordering::SeqCst) as f64)
}

/// The plan of one rank of this run under `sharding`.
fn plan(sharding: Sharding) -> MemoryPlan {
    let cfg = learner_config();
    let mut input = MemoryPlanInput::new(model_config().shape());
    input.micro_batch_tokens = cfg.system.micro_batch_tokens;
    input.group_size = GROUP;
    input.prompts_per_step = PROMPTS / RANKS;
    input.rollout_prompts_per_call = PROMPTS;
    input.max_prompt_tokens = 4;
    input.max_response_tokens = RESPONSE;
    input.ranks = RANKS;
    input.sharding = sharding;
    input.bucket_bytes = BUCKET_BYTES as f64;
    MemoryPlan::new(input)
}

fn part(plan: &MemoryPlan, name: &str) -> f64 {
    plan.parts.iter().find(|p| p.name == name).unwrap().bytes
}

#[test]
fn sharding_lowers_the_heap_as_the_plan_predicts() {
    let prompts: Vec<Prompt> = (0..PROMPTS)
        .map(|i| Prompt {
            id: format!("p{i}"),
            messages: vec![Message::user(format!("q{i} about tokens"))],
        })
        .collect();
    let modes = [
        Sharding::None,
        Sharding::Optimizer,
        Sharding::Gradients,
        Sharding::Full,
    ];
    // A first group allocates what the process keeps once (thread pools, lazy tables).
    measured(Sharding::None, &prompts);
    let got: Vec<(f64, f64)> = modes.iter().map(|&m| measured(m, &prompts)).collect();
    for (m, (peak, held)) in modes.iter().zip(&got) {
        println!(
            "{m:?}: peak {:.1} MB, held after the step {:.1} MB (4 ranks)",
            peak / 1e6,
            held / 1e6
        );
    }
    let saved = got[0].1 - got[1].1;
    let predicted = RANKS as f64
        * (part(&plan(Sharding::None), "adamw_moments")
            - part(&plan(Sharding::Optimizer), "adamw_moments"));
    let ratio = saved / predicted;
    println!(
        "none -> optimizer: {:.1} MB less held, the plan {:.1} MB (x {RANKS} ranks), ratio {ratio:.3}",
        saved / 1e6,
        predicted / 1e6
    );
    assert!((0.85..=1.15).contains(&ratio), "held state: ratio {ratio}");
    // `full` also keeps a quarter of the f32 weights (the rest are one-element placeholders).
    let saved = got[0].1 - got[3].1;
    let kept = |m| part(&plan(m), "adamw_moments") + part(&plan(m), "weights_f32");
    let predicted = RANKS as f64 * (kept(Sharding::None) - kept(Sharding::Full));
    let ratio = saved / predicted;
    println!(
        "none -> full: {:.1} MB less held, the plan {:.1} MB (x {RANKS} ranks), ratio {ratio:.3}",
        saved / 1e6,
        predicted / 1e6
    );
    assert!(
        (0.85..=1.15).contains(&ratio),
        "held state, full: ratio {ratio}"
    );
    // The step's peak, none -> full: the ranks peak together (their collectives keep them in
    // step), so the process peak falls by the ranks' per-rank fall.
    let fall = got[0].0 - got[3].0;
    let predicted = RANKS as f64 * (plan(Sharding::None).peak - plan(Sharding::Full).peak);
    let ratio = fall / predicted;
    println!(
        "none -> full: the peak falls {:.1} MB, the plan {:.1} MB (x {RANKS} ranks), ratio {ratio:.3}",
        fall / 1e6,
        predicted / 1e6
    );
    assert!((0.85..=1.15).contains(&ratio), "peak, full: ratio {ratio}");
    // Sharded, the step peaks lower than with replicas (by 40 MB and more in every run seen;
    // `optimizer` against `gradients` moves by an embedding-sized tensor per rank from run to
    // run, so their order is printed, not held).
    for i in 1..modes.len() {
        assert!(
            got[i].0 < got[0].0,
            "{:?} peaks at {} bytes, none at {}",
            modes[i],
            got[i].0,
            got[0].0
        );
    }
}
