//! The Qwen3 `Policy` implementation against the model's own (HF-parity-tested) teacher-forced
//! scoring, and gradient flow through it.

use std::path::PathBuf;

use burn::backend::{Autodiff, Flex};
use conrub_grpo::{sample_by_recomputation, Policy, TokenBatch};
use conrub_models::{score_sequences, Pretrained};
use conrub_rollout::{FinishReason, SamplingConfig};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/qwen3/tied-gqa-f32")
}

type Rows = (Vec<Vec<u32>>, Vec<Vec<u32>>);

fn rollouts() -> Rows {
    (
        vec![vec![11, 42, 7], vec![5, 9, 200, 31, 8, 77], vec![3]],
        vec![
            vec![199, 3, 50, 61],
            vec![12],
            vec![90, 91, 92, 93, 94, 95, 96],
        ],
    )
}

fn batch<B: burn::tensor::backend::Backend>(
    (prompts, responses): &Rows,
    dev: &B::Device,
) -> TokenBatch<B> {
    TokenBatch::new(
        prompts
            .iter()
            .map(Vec::as_slice)
            .zip(responses.iter().map(Vec::as_slice)),
        dev,
    )
}

#[test]
fn response_logprobs_match_teacher_forced_scoring() {
    let dev = Default::default();
    let m = Pretrained::<Flex>::load_dir(&fixture(), &dev).unwrap();
    let rows = rollouts();
    let b = batch::<Flex>(&rows, &dev);
    let r = b.positions.dims()[1];
    let got: Vec<f32> = m
        .model
        .response_logprobs(&b)
        .logprobs
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap();
    let sequences: Vec<Vec<u32>> = rows
        .0
        .iter()
        .zip(&rows.1)
        .map(|(p, x)| p.iter().chain(x).copied().collect())
        .collect();
    let reference = score_sequences(&m.model, &sequences, 0, &dev).unwrap();
    for (i, (p, resp)) in rows.0.iter().zip(&rows.1).enumerate() {
        for j in 0..r {
            let x = got[i * r + j];
            if j < resp.len() {
                let want = reference[i].token_logprobs[p.len() - 1 + j];
                assert!((x - want).abs() < 1e-5, "row {i} token {j}: {x} vs {want}");
            } else {
                assert_eq!(x, 0.0, "padding slots are zero");
            }
        }
    }
    // A slice of the batch (a micro-batch) gives the same values for its rows.
    let sub = b.slice(1..3, 8, 7);
    let part: Vec<f32> = m
        .model
        .response_logprobs(&sub)
        .logprobs
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap();
    for (k, x) in part.iter().enumerate() {
        assert!(
            (x - got[r + k]).abs() < 1e-5,
            "slot {k}: {x} vs {}",
            got[r + k]
        );
    }
}

#[test]
fn gradients_reach_the_tied_embedding_and_sampling_reports_truncation() {
    let dev = Default::default();
    let m = Pretrained::<Autodiff<Flex>>::load_dir(&fixture(), &dev).unwrap();
    let loss = m
        .model
        .response_logprobs(&batch(&rollouts(), &dev))
        .logprobs
        .sum();
    let grads = loss.backward();
    let g = m
        .model
        .embedding()
        .grad(&grads)
        .expect("embedding gradient");
    let norm: f32 = g.abs().sum().into_scalar();
    assert!(norm > 0.0);

    let cfg = SamplingConfig {
        max_new_tokens: 5,
        seed: 3,
        ..Default::default()
    };
    let inner = Pretrained::<Flex>::load_dir(&fixture(), &dev).unwrap();
    let prompts = [vec![11, 42], vec![7]];
    let s = inner.model.sample(&prompts, &cfg, &dev).unwrap();
    assert!(s.iter().all(|x| x.finish_reason == FinishReason::Length
        && x.tokens.len() == 5
        && x.logprobs.len() == 5));
    assert_eq!(
        s,
        inner.model.sample(&prompts, &cfg, &dev).unwrap(),
        "seeded"
    );
    // The default sampler (no KV cache, the prefix recomputed per token) follows the same rules
    // and streams, so it draws the same tokens as the KV-cache engine.
    let slow = sample_by_recomputation(&inner.model, &prompts, &cfg, &dev).unwrap();
    for (a, b) in s.iter().zip(&slow) {
        assert_eq!(a.tokens, b.tokens);
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
    }
}
