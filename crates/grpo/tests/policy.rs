//! The Qwen3 `Policy` implementation against the model's own (HF-parity-tested) teacher-forced
//! scoring, and gradient flow through it.

use std::path::PathBuf;

use burn::backend::{Autodiff, Flex};
use conrub_grpo::{Policy, RolloutTokens, SampleSettings};
use conrub_qwen3::{score_sequences, Qwen3};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/qwen3/testdata/tied-gqa-f32")
}

fn rollouts() -> RolloutTokens {
    RolloutTokens {
        prompts: vec![vec![11, 42, 7], vec![5, 9, 200, 31, 8, 77], vec![3]],
        responses: vec![vec![199, 3, 50, 61], vec![12], vec![90, 91, 92, 93, 94, 95, 96]],
    }
}

#[test]
fn response_logprobs_match_teacher_forced_scoring() {
    let dev = Default::default();
    let m = Qwen3::<Flex>::load_dir(&fixture(), &dev).unwrap();
    let r = rollouts();
    let tf = r.teacher_forcing();
    let got: Vec<f32> = m.model.response_logprobs(&tf, &dev).into_data().convert::<f32>().into_vec().unwrap();
    let reference = score_sequences(&m.model, &tf.sequences, 0, &dev).unwrap();
    for (i, (p, resp)) in r.prompts.iter().zip(&r.responses).enumerate() {
        for j in 0..tf.response_len {
            let x = got[i * tf.response_len + j];
            if j < resp.len() {
                let want = reference[i].token_logprobs[p.len() - 1 + j];
                assert!((x - want).abs() < 1e-5, "row {i} token {j}: {x} vs {want}");
            } else {
                assert_eq!(x, 0.0, "padding slots are zero");
            }
        }
    }
}

#[test]
fn gradients_reach_the_tied_embedding_and_sampling_reports_truncation() {
    let dev = Default::default();
    let m = Qwen3::<Autodiff<Flex>>::load_dir(&fixture(), &dev).unwrap();
    let tf = rollouts().teacher_forcing();
    let loss = m.model.response_logprobs(&tf, &dev).sum();
    let grads = loss.backward();
    let g = m.model.embed_tokens.grad(&grads).expect("embedding gradient");
    let norm: f32 = g.abs().sum().into_scalar();
    assert!(norm > 0.0);

    let settings = SampleSettings { max_new_tokens: 5, temperature: 1.0, top_p: 1.0, top_k: None, seed: 3, stop_ids: vec![] };
    let inner = Qwen3::<Flex>::load_dir(&fixture(), &dev).unwrap();
    let s = inner.model.sample(&[vec![11, 42], vec![7]], &settings, &dev).unwrap();
    assert!(s.iter().all(|x| x.truncated && x.tokens.len() == 5 && x.logprobs.len() == 5));
    assert_eq!(s, inner.model.sample(&[vec![11, 42], vec![7]], &settings, &dev).unwrap(), "seeded");
}
