//! Learner step throughput on the CPU demo model (random Qwen3, hidden 64, 2 layers, the full
//! 151,936-token vocabulary): rollout, scoring and update measured separately, in response tokens/s.
//! The same update (forward, TRL's GRPO loss, backward, AdamW) in PyTorch on the same model shape
//! and batch is timed in the same run by `benches/torch_update.py` when python3 with torch,
//! transformers and trl is available.
//!
//! `cargo bench --bench learner`

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use conrub_grpo::{Aggregation, ClipRange, Policy, PolicyLoss, SurrogateBatch, TokenBatch, Update, UpdateConfig};
use conrub_qwen3::SamplingConfig;
use conrub_judge::{score_jobs, CriterionRequest, LexicalJudge, ScoreJob};
use conrub_qwen3::{Qwen3Config, Qwen3ForCausalLM};
use conrub_rubric::{read_rubrics, LengthPenalty, ScoringMode};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

type B = Autodiff<Flex>;
const ROWS: usize = 64;
const PROMPT: usize = 40;
const RESPONSE: usize = 48;

fn demo_config() -> Qwen3Config {
    let mut c = Qwen3Config::tiny(151_936);
    c.num_key_value_heads = Some(2);
    c.head_dim = Some(16);
    c
}

fn bench(c: &mut Criterion) {
    let dev = Default::default();
    let cfg = demo_config();
    let model = Qwen3ForCausalLM::<B>::random(&cfg, 0.02, 0, &dev);
    let prompts: Vec<Vec<u32>> = (0..ROWS).map(|i| (0..PROMPT).map(|t| ((i * 7919 + t * 104_729) % 150_000) as u32).collect()).collect();
    let tokens = (ROWS * RESPONSE) as u64;
    let mut g = c.benchmark_group("learner-demo-model");
    g.throughput(Throughput::Elements(tokens)).sample_size(10).measurement_time(Duration::from_secs(20));

    let inner = model.valid();
    let settings = SamplingConfig { max_new_tokens: RESPONSE, seed: 1, ..Default::default() };
    g.bench_function("rollout", |b| b.iter(|| inner.sample(&prompts, &settings, &dev).unwrap()));

    let samples = inner.sample(&prompts, &settings, &dev).unwrap();
    let tf = TokenBatch::<B>::new(prompts.iter().map(Vec::as_slice).zip(samples.iter().map(|s| s.tokens.as_slice())), &dev);
    let rubrics = read_rubrics(std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/data/samples/rubrics.jsonl"))).unwrap();
    let judge = Arc::new(LexicalJudge::from_file(std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/data/samples/lexical-keywords.jsonl"))).unwrap());
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
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    g.bench_function("scoring-lexical", |b| {
        b.iter(|| rt.block_on(score_jobs(judge.as_ref(), &jobs, &LengthPenalty::default(), None, 64, &|_| {})))
    });

    // The learner's update stages: fused log-probs, the policy loss, backward, global clipping
    // (the published max_grad_norm = 1) and AdamW.
    let old = inner.response_logprobs(&tf.inner()).logprobs;
    let adv: Vec<f32> = (0..ROWS).map(|i| ((i % 8) as f32 - 3.5) / 2.3).collect();
    let advantages = burn::tensor::Tensor::<B, 1>::from_data(burn::tensor::TensorData::new(adv, [ROWS]), &dev);
    let loss = PolicyLoss { clip: ClipRange::default(), aggregation: Aggregation::SequenceMean, kl_beta: 0.0, max_response_tokens: RESPONSE };
    let mut policy = model.clone();
    let mut update = Update::<B, Qwen3ForCausalLM<B>>::new(UpdateConfig { lr: 3e-6, weight_decay: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, max_grad_norm: 1.0 });
    g.bench_function("update", |b| {
        b.iter(|| {
            let batch = SurrogateBatch {
                logp: policy.response_logprobs(&tf).logprobs,
                logp_old: burn::tensor::Tensor::from_inner(old.clone()),
                advantages: advantages.clone(),
                mask: tf.mask.clone(),
                logp_ref: None,
            };
            let out = loss.compute(batch);
            let grads = GradientsParams::from_grads(out.loss.backward(), &policy);
            let (next, norm) = update.apply(policy.clone(), grads);
            policy = next;
            norm.into_scalar()
        })
    });
    g.finish();

    // PyTorch baseline of the update, same run.
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_update.py");
    let start = Instant::now();
    match std::process::Command::new("python3").args([script, &ROWS.to_string(), &PROMPT.to_string(), &RESPONSE.to_string()]).output() {
        Ok(o) if o.status.success() => println!("{}", String::from_utf8_lossy(&o.stdout).trim()),
        Ok(o) => println!("torch baseline skipped: {}", String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("")),
        Err(e) => println!("torch baseline skipped: {e}"),
    }
    println!("(torch baseline wall time incl. start-up {:.1} s)", start.elapsed().as_secs_f64());
}

criterion_group!(benches, bench);
criterion_main!(benches);
