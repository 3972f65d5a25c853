//! The in-process judge on a tiny random Qwen3 (and Llama and Qwen2 architectures) with the real
//! Qwen3 tokenizer (full vocabulary).

use conrub_models::FamilyModel;
use std::path::PathBuf;
use std::sync::Arc;

use burn::backend::Flex;
use burn::tensor::activation::log_softmax;
use burn::tensor::DType;
use conrub_judge::{
    CriterionJudge, CriterionRequest, JudgeCache, LocalJudge, LocalJudgeConfig, LocalMode,
    PromptSet,
};
use conrub_models::{
    CausalLm, ChatOptions, ChatTokenizer, Family, Message, ModelConfig, PaddedBatch, Padding,
    Precision, Pretrained,
};
use conrub_rubric::{Label, ScoringMode};

type B = Flex;

fn tokenizer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/testdata/qwen3-tokenizer")
}

fn tiny_model(seed: u64) -> Pretrained<B> {
    tiny_model_of(Family::Qwen3, seed)
}

/// A tiny random model of `family`'s architecture with the Qwen3 tokenizer and chat template.
fn tiny_model_of(family: Family, seed: u64) -> Pretrained<B> {
    let dev = Default::default();
    let mut config = ModelConfig::tiny(151_936);
    config.model_type = family.model_type().into();
    config.architectures = Some(vec![family.hf_architecture().into()]);
    // A larger init spreads the next-token distribution so label margins are not all ~0.
    let model = CausalLm::random(&config, 0.5, seed, &dev);
    Pretrained {
        model,
        config,
        generation_config: None,
        tokenizer: Some(ChatTokenizer::from_dir(&tokenizer_dir()).unwrap()),
        dir: "tiny-random".into(),
    }
}

fn requests() -> Vec<CriterionRequest> {
    let criteria = vec![
        "The response recommends calling emergency services.".to_string(),
        "The response mentions chewing aspirin if not allergic.".to_string(),
        "The response explains that chest pain at rest is urgent.".to_string(),
    ];
    [
        "Call 911 now and chew an aspirin.",
        "Rest and see a doctor next week.",
        "It is probably indigestion.",
    ]
    .iter()
    .enumerate()
    .map(|(i, r)| CriterionRequest {
        question: "I have had crushing chest pain for 20 minutes. What should I do?".into(),
        response: r.to_string(),
        criteria: criteria.clone(),
        mode: if i == 1 {
            ScoringMode::Binary
        } else {
            ScoringMode::ThreeState
        },
    })
    .collect()
}

/// The label decision recomputed from one unpadded forward pass over the full sequence.
fn reference_label(
    model: &Pretrained<B>,
    prompts: &PromptSet,
    r: &CriterionRequest,
    criterion: &str,
) -> (Label, f64) {
    let (s, u) = prompts.render_single(r.mode, &r.question, &r.response, criterion);
    let tok = model.tokenizer.as_ref().unwrap();
    let ids = tok
        .apply_chat_template(
            &[Message::system(s.as_str()), Message::user(u.as_str())],
            ChatOptions {
                add_generation_prompt: true,
                enable_thinking: Some(false),
            },
        )
        .unwrap();
    let dev = Default::default();
    let batch =
        PaddedBatch::new(std::slice::from_ref(&ids), 0, Padding::Right).to_device::<B>(&dev);
    let logits = model.model.forward(&batch).cast(DType::F32);
    let t = ids.len();
    let last = log_softmax(logits.slice([0..1, t - 1..t]).reshape([151_936]), 0);
    let lp: Vec<f32> = last.into_data().convert::<f32>().into_vec().unwrap();
    let lse = |ids: &[u32]| {
        let m = ids
            .iter()
            .map(|&i| lp[i as usize] as f64)
            .fold(f64::NEG_INFINITY, f64::max);
        m + ids
            .iter()
            .map(|&i| (lp[i as usize] as f64 - m).exp())
            .sum::<f64>()
            .ln()
    };
    let mut scored: Vec<(Label, f64)> = r
        .mode
        .labels()
        .iter()
        .map(|l| {
            let w = l.as_str();
            let cap = format!("{}{}", w[..1].to_uppercase(), &w[1..]);
            let ids: Vec<u32> = [w.to_string(), cap]
                .iter()
                .map(|v| tok.encode(v).unwrap()[0])
                .collect();
            (*l, lse(&ids))
        })
        .collect();
    scored.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
    (scored[0].0, scored[0].1 - scored[1].1)
}

#[tokio::test]
async fn logprob_margin_matches_an_unbatched_reference_and_is_batch_invariant() {
    for family in Family::ALL {
        margins_match_the_reference(family).await;
    }
}

/// The judge on `family`'s architecture against the unbatched reference, at batch sizes 1 and 4.
async fn margins_match_the_reference(family: Family) {
    let prompts = PromptSet::default();
    let reqs = requests();
    let reference = tiny_model_of(family, 7);
    let want: Vec<Vec<(Label, f64)>> = reqs
        .iter()
        .map(|r| {
            r.criteria
                .iter()
                .map(|c| reference_label(&reference, &prompts, r, c))
                .collect()
        })
        .collect();
    for batch_size in [1, 4] {
        let cfg = LocalJudgeConfig {
            mode: LocalMode::LogprobMargin,
            batch_size,
            ..Default::default()
        };
        let judge = LocalJudge::new(
            tiny_model_of(family, 7),
            Default::default(),
            prompts.clone(),
            cfg,
            None,
        )
        .unwrap();
        let verdicts = judge.judge_batch(&reqs).await;
        for (v, w) in verdicts.iter().zip(&want) {
            let labels = v.labels.as_ref().expect("cheap mode always labels");
            assert_eq!(
                labels,
                &w.iter().map(|x| x.0).collect::<Vec<_>>(),
                "{family:?}, batch {batch_size}"
            );
            for (m, (_, wm)) in v.margins.iter().zip(w) {
                assert!(*m >= 0.0);
                assert!(
                    (m - wm).abs() < 1e-4,
                    "{family:?}: margin {m} vs reference {wm} (batch {batch_size})"
                );
            }
        }
        // Binary requests get binary labels.
        assert!(verdicts[1]
            .labels
            .as_ref()
            .unwrap()
            .iter()
            .all(|l| matches!(l, Label::Yes | Label::No)));
    }
}

/// `precision = "bf16-mixed"` runs the judge model in bf16 (its margins move, by less than bf16
/// rounding of a random model's log-probabilities can explain) and names itself apart, so a
/// shared cache never replays f32 verdicts for it.
#[tokio::test]
async fn bf16_mixed_judge_runs_in_bf16_and_caches_apart() {
    let prompts = PromptSet::default();
    let reqs = requests();
    let judge_at = |precision| {
        let cfg = LocalJudgeConfig {
            mode: LocalMode::LogprobMargin,
            batch_size: 4,
            precision,
            ..Default::default()
        };
        LocalJudge::new(
            tiny_model(7),
            Default::default(),
            prompts.clone(),
            cfg,
            None,
        )
        .unwrap()
    };
    let (f32_judge, bf16_judge) = (judge_at(Precision::F32), judge_at(Precision::Bf16Mixed));
    assert_ne!(
        CriterionJudge::id(&f32_judge),
        CriterionJudge::id(&bf16_judge)
    );
    assert!(CriterionJudge::id(&bf16_judge).ends_with(":bf16-mixed"));
    let (a, b) = (
        f32_judge.judge_batch(&reqs).await,
        bf16_judge.judge_batch(&reqs).await,
    );
    let (mut worst, mut moved) = (0.0f64, false);
    for (x, y) in a.iter().zip(&b) {
        assert!(y.labels.is_some());
        for (m, n) in x.margins.iter().zip(&y.margins) {
            worst = worst.max((m - n).abs());
            moved |= m != n;
        }
    }
    assert!(
        moved,
        "bf16-mixed margins equal f32's bit for bit: the precision was not applied"
    );
    assert!(
        worst < 0.25,
        "bf16-mixed margins differ from f32 by up to {worst}"
    );
}

#[tokio::test]
async fn generate_mode_parses_or_ends_unscored_and_the_cache_replays() {
    let dir = tempfile::tempdir().unwrap();
    let cache = Arc::new(JudgeCache::open(&dir.path().join("c.sqlite")).unwrap());
    let cfg = LocalJudgeConfig {
        mode: LocalMode::Generate,
        max_new_tokens: 6,
        max_retries: 1,
        batch_size: 4,
        seed: 3,
        ..Default::default()
    };
    let judge = LocalJudge::new(
        tiny_model(1),
        Default::default(),
        PromptSet::default(),
        cfg,
        Some(cache.clone()),
    )
    .unwrap();
    let reqs = requests();
    let verdicts = judge.judge_batch(&reqs).await;
    for v in &verdicts {
        // A random model writes no valid JSON: a greedy attempt and one sampled retry, both kept.
        assert!(v.labels.is_none());
        assert_eq!(v.attempts, 2);
        assert_eq!(v.raw_outputs.len(), 2);
        assert!(
            v.error
                .as_deref()
                .unwrap()
                .starts_with("unparseable output"),
            "{:?}",
            v.error
        );
    }
    assert_eq!(cache.len().unwrap(), 0, "failures are not cached");

    let cfg = LocalJudgeConfig {
        mode: LocalMode::LogprobMargin,
        ..Default::default()
    };
    let judge = LocalJudge::new(
        tiny_model(1),
        Default::default(),
        PromptSet::default(),
        cfg,
        Some(cache.clone()),
    )
    .unwrap();
    let first = judge.judge_batch(&reqs).await;
    assert_eq!(cache.len().unwrap(), 3);
    let again = judge.judge_batch(&reqs).await;
    for (a, b) in first.iter().zip(&again) {
        assert!(b.cached);
        assert_eq!(a.labels, b.labels);
    }
}
