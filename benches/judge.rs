//! Judge throughput.
//!
//! - HTTP: judged responses per second through our client (prompt rendering, request, parsing,
//!   optional SQLite cache) against an instant scripted server on loopback at concurrency 16,
//!   next to the baseline of bare reqwest POSTs with the same concurrency to the same server: the
//!   ratio is the overhead of our stack, not of a model.
//! - In-process: criteria per second of the local judge on a tiny Qwen3 (hidden 64, the full
//!   151,936-token vocabulary), cheap log-probability-margin mode next to the generate mode, and
//!   of a probe judge (a linear probe distilled on the same model, `conrub judge distill`) on the
//!   same requests. Group `judge-probe-vs-generative` counts response tokens scored per second
//!   (the unit), probe against the generative judge on the same model.
//!
//! `cargo bench --bench judge`

use std::sync::Arc;
use std::time::Duration;

use burn::backend::Flex;
use conrub_judge::probe::{
    distill, DistillConfig, LabelledExample, Pooling, ProbeFeaturizer, ProbeJudge,
};
use conrub_judge::testing::ScriptedServer;
use conrub_judge::{
    score_jobs, ChatClient, ClientConfig, CriterionJudge, CriterionRequest, JudgeCache, LocalJudge,
    LocalJudgeConfig, LocalMode, OpenAiJudge, PromptSet, ScoreJob,
};
use conrub_models::{CausalLm, ChatTokenizer, ModelConfig, Pretrained};
use conrub_rubric::{Label, LengthPenalty, ScoringMode};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const N: usize = 256;

fn jobs(tag: &str) -> Vec<ScoreJob> {
    (0..N)
        .map(|i| ScoreJob {
            request: CriterionRequest {
                question: "A 70-year-old on warfarin hit her head two hours ago and feels fine. Does she need to be seen?".into(),
                response: format!("{tag} Yes, she should be assessed today; anticoagulants raise the risk of bleeding. ({i})"),
                criteria: (0..12).map(|c| format!("The response states requirement number {c} clearly.")).collect(),
                mode: ScoringMode::ThreeState,
            },
            response_tokens: Some(300),
        })
        .collect()
}

fn http(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let server = rt.block_on(ScriptedServer::start(0, 0));
    let cfg = ClientConfig {
        urls: vec![server.url.clone()],
        concurrency: 16,
        ..ClientConfig::new("x", "bench")
    };
    let mut g = c.benchmark_group("judge-http");
    g.throughput(Throughput::Elements(N as u64))
        .sample_size(10)
        .measurement_time(Duration::from_secs(8));

    // Baseline: bare POSTs of the same prompt size, 16 in flight, body read but not parsed.
    let http = reqwest::Client::new();
    let sem = Arc::new(tokio::sync::Semaphore::new(16));
    let (system, user) = PromptSet::default().render_criteria(
        ScoringMode::ThreeState,
        "q",
        &jobs("")[0].request.response,
        &jobs("")[0].request.criteria,
    );
    let body = serde_json::json!({"model": "bench", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]});
    let endpoint = format!("{}/chat/completions", server.url);
    g.bench_function("bare-reqwest-baseline", |b| {
        b.iter(|| {
            rt.block_on(async {
                let calls = (0..N).map(|_| {
                    let (http, sem, body, endpoint) =
                        (http.clone(), sem.clone(), body.clone(), endpoint.clone());
                    async move {
                        let _p = sem.acquire().await.unwrap();
                        http.post(&endpoint)
                            .json(&body)
                            .send()
                            .await
                            .unwrap()
                            .bytes()
                            .await
                            .unwrap()
                    }
                });
                futures::future::join_all(calls).await
            })
        })
    });

    let client = Arc::new(ChatClient::new(cfg.clone()).unwrap());
    let judge = OpenAiJudge::new(client, PromptSet::default(), None);
    let work = jobs("");
    g.bench_function("openai-judge-no-cache", |b| {
        b.iter(|| {
            rt.block_on(score_jobs(
                &judge,
                &work,
                &LengthPenalty::default(),
                None,
                64,
                &|_| {},
            ))
        })
    });

    let dir = tempfile::tempdir().unwrap();
    let mut round = 0usize;
    g.bench_function("openai-judge-cache-writes", |b| {
        b.iter(|| {
            // A fresh response text each round so every call misses and writes.
            round += 1;
            let work = jobs(&format!("round {round}"));
            let cache = Arc::new(JudgeCache::open(&dir.path().join("w.sqlite")).unwrap());
            let judge = OpenAiJudge::new(
                Arc::new(ChatClient::new(cfg.clone()).unwrap()),
                PromptSet::default(),
                Some(cache),
            );
            rt.block_on(score_jobs(
                &judge,
                &work,
                &LengthPenalty::default(),
                None,
                64,
                &|_| {},
            ))
        })
    });

    let cache = Arc::new(JudgeCache::open(&dir.path().join("hits.sqlite")).unwrap());
    let judge = OpenAiJudge::new(
        Arc::new(ChatClient::new(cfg.clone()).unwrap()),
        PromptSet::default(),
        Some(cache),
    );
    rt.block_on(score_jobs(
        &judge,
        &work,
        &LengthPenalty::default(),
        None,
        64,
        &|_| {},
    ));
    g.bench_function("openai-judge-all-cache-hits", |b| {
        b.iter(|| {
            rt.block_on(score_jobs(
                &judge,
                &work,
                &LengthPenalty::default(),
                None,
                64,
                &|_| {},
            ))
        })
    });
    g.finish();
}

fn local(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let tok_dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/testdata/qwen3-tokenizer");
    let model = || {
        let config = ModelConfig::tiny(151_936);
        Pretrained::<Flex> {
            model: CausalLm::random(&config, 0.5, 3, &Default::default()),
            config,
            generation_config: None,
            tokenizer: Some(ChatTokenizer::from_dir(&tok_dir).unwrap()),
            dir: "tiny".into(),
        }
    };
    let reqs: Vec<CriterionRequest> = jobs("").into_iter().take(4).map(|j| j.request).collect();
    let criteria = (reqs.len() * reqs[0].criteria.len()) as u64;
    let mut g = c.benchmark_group("judge-local-tiny");
    g.throughput(Throughput::Elements(criteria))
        .sample_size(10)
        .measurement_time(Duration::from_secs(10));
    let margin = LocalJudge::new(
        model(),
        Default::default(),
        PromptSet::default(),
        LocalJudgeConfig {
            mode: LocalMode::LogprobMargin,
            batch_size: 8,
            ..Default::default()
        },
        None,
    )
    .unwrap();
    g.bench_function("logprob-margin", |b| {
        b.iter(|| rt.block_on(margin.judge_batch(&reqs)))
    });
    let generate = LocalJudge::new(
        model(),
        Default::default(),
        PromptSet::default(),
        LocalJudgeConfig {
            mode: LocalMode::Generate,
            batch_size: 4,
            max_new_tokens: 48,
            max_retries: 0,
            seed: 0,
            ..Default::default()
        },
        None,
    )
    .unwrap();
    g.bench_function("generate-48-tokens", |b| {
        b.iter(|| rt.block_on(generate.judge_batch(&reqs)))
    });
    let probe = probe_judge(model);
    g.bench_function("probe", |b| {
        b.iter(|| rt.block_on(probe.judge_batch(&reqs)))
    });
    g.finish();

    // The same two judges per response token scored.
    let tok = ChatTokenizer::from_dir(&tok_dir).unwrap();
    let tokens: usize = reqs
        .iter()
        .map(|r| tok.encode(&r.response).unwrap().len())
        .sum();
    let mut g = c.benchmark_group("judge-probe-vs-generative");
    g.throughput(Throughput::Elements(tokens as u64))
        .sample_size(10)
        .measurement_time(Duration::from_secs(10));
    g.bench_function("generative-judge-48-tokens", |b| {
        b.iter(|| rt.block_on(generate.judge_batch(&reqs)))
    });
    g.bench_function("probe-judge", |b| {
        b.iter(|| rt.block_on(probe.judge_batch(&reqs)))
    });
    g.finish();
}

/// A probe distilled on `model` from labels by a fixed rule (criterion index mod 3), written to a
/// temporary directory, as a judge on a second copy of the model.
fn probe_judge(model: impl Fn() -> Pretrained<Flex>) -> ProbeJudge<Flex> {
    let dir = tempfile::tempdir().unwrap();
    let rows: Vec<LabelledExample> = jobs("")
        .into_iter()
        .take(8)
        .enumerate()
        .flat_map(|(i, j)| {
            let r = j.request;
            r.criteria
                .into_iter()
                .enumerate()
                .map(move |(c, criterion)| LabelledExample {
                    prompt_id: format!("p{i}"),
                    prompt: r.question.clone(),
                    criterion,
                    response: r.response.clone(),
                    label: [Label::Correct, Label::Missing, Label::Wrong][c % 3],
                })
        })
        .collect();
    let featurizer =
        || ProbeFeaturizer::new(model(), Default::default(), PromptSet::default(), 16).unwrap();
    let cfg = DistillConfig {
        layer: Some(1),
        pooling: Some(Pooling::Mean),
        ..Default::default()
    };
    let f = featurizer();
    distill(
        &f,
        "tiny",
        ScoringMode::ThreeState,
        &rows,
        &cfg,
        dir.path(),
        &mut |_, _| {},
    )
    .unwrap();
    ProbeJudge::new(
        featurizer(),
        &dir.path().join("probe.safetensors"),
        None,
        None,
        None,
    )
    .unwrap()
}

criterion_group!(benches, http, local);
criterion_main!(benches);
