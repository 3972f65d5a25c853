//! Learner step throughput on the CPU demo model (random Qwen3, hidden 64, 2 layers, the full
//! 151,936-token vocabulary): rollout, scoring and update measured separately, in response tokens/s.
//! The update is timed twice in one process: with the fused host head (what the CPU backends run)
//! and with the chunked tensor-op fallback it replaced (`set_host_head(false)`). The same update
//! (forward, TRL's GRPO loss, backward, AdamW) in PyTorch on the same model shape and batch is then
//! timed by `benches/torch_update.py` (its fastest log-prob variant), and the last line reads
//! `update: conrub X tok/s, torch Y tok/s, ratio Z`. The bench fails when torch is missing.
//! Python: `$CONRUB_TORCH_PYTHON`, else `.tch/venv/bin/python3` (what `scripts/test-tch.sh` sets
//! up, with `transformers` and `trl` added), else `python3`.
//!
//! `cargo bench --bench learner`

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use conrub_grpo::{
    Aggregation, Clip, Policy, PolicyLoss, SurrogateBatch, TokenBatch, Update, UpdateConfig,
};
use conrub_judge::{score_jobs, CriterionRequest, LexicalJudge, ScoreJob};
use conrub_kernels::KernelOps;
use conrub_models::{CausalLm, ModelConfig};
use conrub_rollout::SamplingConfig;
use conrub_rubric::{read_rubrics, LengthPenalty, ScoringMode};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

type B = Autodiff<Flex>;
const ROWS: usize = 64;
const PROMPT: usize = 40;
const RESPONSE: usize = 48;

fn demo_config() -> ModelConfig {
    let mut c = ModelConfig::tiny(151_936);
    c.num_key_value_heads = Some(2);
    c.head_dim = Some(16);
    c
}

fn bench(c: &mut Criterion) {
    let dev = Default::default();
    let cfg = demo_config();
    let model = CausalLm::<B>::random(&cfg, 0.02, 0, &dev);
    let prompts: Vec<Vec<u32>> = (0..ROWS)
        .map(|i| {
            (0..PROMPT)
                .map(|t| ((i * 7919 + t * 104_729) % 150_000) as u32)
                .collect()
        })
        .collect();
    let tokens = (ROWS * RESPONSE) as u64;
    let mut g = c.benchmark_group("learner-demo-model");
    g.throughput(Throughput::Elements(tokens))
        .sample_size(10)
        .measurement_time(Duration::from_secs(20));

    let inner = model.valid();
    let settings = SamplingConfig {
        max_new_tokens: RESPONSE,
        seed: 1,
        ..Default::default()
    };
    g.bench_function("rollout", |b| {
        b.iter(|| inner.sample(&prompts, &settings, &dev).unwrap())
    });

    let samples = inner.sample(&prompts, &settings, &dev).unwrap();
    let rubrics = read_rubrics(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/data/samples/rubrics.jsonl"
    )))
    .unwrap();
    let judge = Arc::new(
        LexicalJudge::from_file(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/data/samples/lexical-keywords.jsonl"
        )))
        .unwrap(),
    );
    let record = rubrics.iter().next().unwrap();
    let jobs: Vec<ScoreJob> = samples
        .iter()
        .map(|s| ScoreJob {
            request: CriterionRequest {
                question: record.question_text(),
                response: format!("{:?}", s.tokens),
                criteria: record.criterion_texts(),
                mode: ScoringMode::ThreeState,
            },
            response_tokens: Some(s.tokens.len() as u32),
        })
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    g.bench_function("scoring-lexical", |b| {
        b.iter(|| {
            rt.block_on(score_jobs(
                judge.as_ref(),
                &jobs,
                &LengthPenalty::default(),
                None,
                64,
                &|_| {},
            ))
        })
    });

    g.finish();

    // The update (timed by hand: a step takes seconds), on flex with the fused host head and with
    // the chunked fallback it replaced, and on ndarray with `--features ndarray`.
    let rows: Vec<(&[u32], &[u32])> = prompts
        .iter()
        .map(Vec::as_slice)
        .zip(samples.iter().map(|s| s.tokens.as_slice()))
        .collect();
    let before = time_update::<Flex>(
        &cfg,
        &rows,
        "flex, chunked tensor-op fallback: the head before the fused host head",
        false,
    );
    let ours = time_update::<Flex>(&cfg, &rows, "flex, fused host head", true);
    println!("fused host head / fallback on flex: {:.2}x", ours / before);
    #[cfg(feature = "ndarray")]
    {
        let nd =
            time_update::<burn::backend::NdArray>(&cfg, &rows, "ndarray, fused host head", true);
        println!(
            "ndarray / flex (both with the fused host head): {:.2}x",
            nd / ours
        );
    }

    // PyTorch baseline of the update, same run.
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_update.py");
    let python = torch_python();
    let start = Instant::now();
    let o = std::process::Command::new(&python)
        .args([
            script,
            &ROWS.to_string(),
            &PROMPT.to_string(),
            &RESPONSE.to_string(),
        ])
        .output()
        .unwrap_or_else(|e| {
            panic!("the PyTorch baseline needs {python} with torch, transformers and trl: {e}")
        });
    let stdout = String::from_utf8_lossy(&o.stdout);
    println!("{}", stdout.trim());
    assert!(
        o.status.success(),
        "the PyTorch baseline failed ({python} needs torch, transformers and trl; scripts/test-tch.sh sets up torch in .tch/venv): {}",
        String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("")
    );
    println!(
        "(torch baseline wall time incl. start-up {:.1} s)",
        start.elapsed().as_secs_f64()
    );
    let torch: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("best: "))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|x| x.parse().ok())
        .expect("torch_update.py ends with `best: NAME TOKENS_PER_S`");
    println!(
        "update: conrub {ours:.1} tok/s, torch {torch:.1} tok/s, ratio {:.2}",
        ours / torch
    );
}

/// Response tokens/s of the learner's update stages (fused log-probs, the policy loss, backward,
/// global clipping at the published max_grad_norm = 1, AdamW) on `Autodiff<Bk>`: one warm-up step,
/// then three timed.
fn time_update<Bk: KernelOps>(
    cfg: &ModelConfig,
    rows: &[(&[u32], &[u32])],
    label: &str,
    host_head: bool,
) -> f64
where
    CausalLm<Autodiff<Bk>>: Policy<Autodiff<Bk>>,
{
    type A<Bk> = Autodiff<Bk>;
    conrub_kernels::set_host_head(host_head);
    let dev = Default::default();
    let mut policy = CausalLm::<A<Bk>>::random(cfg, 0.02, 0, &dev);
    let tf = TokenBatch::<A<Bk>>::new(rows.iter().copied(), &dev);
    let old = policy.valid().response_logprobs(&tf.inner()).logprobs;
    let adv: Vec<f32> = (0..rows.len())
        .map(|i| ((i % 8) as f32 - 3.5) / 2.3)
        .collect();
    let advantages = burn::tensor::Tensor::<A<Bk>, 1>::from_data(
        burn::tensor::TensorData::new(adv, [rows.len()]),
        &dev,
    );
    let loss = PolicyLoss {
        clip: Clip::default(),
        aggregation: Aggregation::SequenceMean,
        kl_beta: 0.0,
        max_response_tokens: RESPONSE,
        tis_cap: None,
        kl_estimator: conrub_grpo::KlEstimator::K3,
        importance: conrub_grpo::ImportanceLevel::Token,
    };
    let mut update = Update::<A<Bk>, CausalLm<A<Bk>>>::new(UpdateConfig::recipe());
    let mut step = || {
        let batch = SurrogateBatch {
            logp: policy.response_logprobs(&tf).logprobs,
            logp_old: burn::tensor::Tensor::from_inner(old.clone()),
            advantages: advantages.clone(),
            mask: tf.mask.clone(),
            logp_ref: None,
            logp_engine: None,
        };
        let out = loss.compute(batch);
        let grads = GradientsParams::from_grads(out.loss.backward(), &policy);
        let (next, norm) = update.apply(policy.clone(), grads);
        policy = next;
        norm.into_scalar()
    };
    step();
    let t = Instant::now();
    for _ in 0..3 {
        step();
    }
    let per = t.elapsed().as_secs_f64() / 3.0;
    let tokens: usize = rows.iter().map(|r| r.1.len()).sum();
    let tps = tokens as f64 / per;
    println!(
        "update ({label}): {:.1} ms/step, {tps:.1} response tokens/s",
        per * 1e3
    );
    tps
}

/// The interpreter for the PyTorch baseline.
fn torch_python() -> String {
    if let Ok(p) = std::env::var("CONRUB_TORCH_PYTHON") {
        return p;
    }
    let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/.tch/venv/bin/python3");
    if std::path::Path::new(venv).exists() {
        venv.to_string()
    } else {
        "python3".to_string()
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
