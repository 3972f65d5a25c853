//! Sampling on the device: a decode step returns token ids and their log-probabilities (two
//! words per row) instead of copying `[rows, vocab]` logits to the host.
//!
//! The rule is [`crate::sample_token`]'s (`conrub_kernels::sampling`), applied by
//! `KernelOps::sample_rows`: on burn-flex to the logits' buffer in place, elsewhere as tensor ops
//! whose cumulative sums run in f32 (a draw within rounding of a boundary between two tokens may
//! then pick the other one than the f64 host rule would). The uniform draw of each row comes
//! from its sequence's own stream on the host, one per token, and every row is computed on its
//! own, so a row's token never depends on the other rows.

use burn::tensor::{Int, Tensor, TensorPrimitive};
use conrub_kernels::KernelOps;

use conrub_contracts::SamplingConfig;

/// Tokens `[rows]` and their log-probabilities `[rows]` (f32) drawn from `logits` `[rows, vocab]`
/// under `cfg`. `uniforms[r]` in `[0, 1)` is row `r`'s draw (unused when greedy); `seen[r]` the
/// distinct ids row `r` has seen, penalized first under a repetition penalty (empty otherwise).
pub fn sample_on_device<B: KernelOps>(
    logits: Tensor<B, 2>,
    seen: &[&[u32]],
    cfg: &SamplingConfig,
    uniforms: &[f64],
) -> (Tensor<B, 1, Int>, Tensor<B, 1>) {
    assert!(
        cfg.decoding.is_greedy() || uniforms.len() == logits.dims()[0],
        "one uniform draw per row"
    );
    let penalty = cfg.decoding.repetition_penalty();
    let logits = if penalty != 1.0 {
        assert_eq!(seen.len(), logits.dims()[0], "one seen set per row");
        conrub_kernels::sampling::penalize_rows_by_tensors(logits, seen, penalty)
    } else {
        logits
    };
    let (tok, lp) = B::sample_rows(logits.into_primitive().tensor(), &cfg.decoding, uniforms);
    (
        Tensor::from_primitive(tok),
        Tensor::from_primitive(TensorPrimitive::Float(lp)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;
    use conrub_contracts::{sample_token, sequence_rng, Decoding, SamplingParams};
    use rand::Rng;

    fn on_device(logits: &[f32], seen: &[u32], cfg: &SamplingConfig, u: f64) -> (u32, f32) {
        let v = logits.len();
        let t = Tensor::<Flex, 2>::from_data(
            TensorData::new(logits.to_vec(), [1, v]),
            &Default::default(),
        );
        let (tok, lp) = sample_on_device(t, &[seen], cfg, &[u]);
        (
            tok.into_data().convert::<i64>().into_vec::<i64>().unwrap()[0] as u32,
            lp.into_data().convert::<f32>().into_vec::<f32>().unwrap()[0],
        )
    }

    /// The device rule is the host rule: with the same uniform draw both pick the same token and
    /// log-probability, for every mode (logits far enough apart that f32 and f64 agree).
    #[test]
    fn device_draws_equal_host_draws_for_the_same_uniform() {
        let logits: Vec<f32> = (0..50)
            .map(|i| ((i * 37 % 50) as f32 * 0.13) - 3.0)
            .collect();
        let cfgs = [
            SamplingConfig::greedy(1),
            SamplingConfig::default(),
            SamplingConfig {
                decoding: Decoding::Sample(SamplingParams {
                    temperature: 0.7,
                    top_p: 1.0,
                    top_k: None,
                    min_p: 0.0,
                    repetition_penalty: 1.0,
                }),
                ..Default::default()
            },
            SamplingConfig {
                decoding: Decoding::Sample(SamplingParams {
                    temperature: 1.0,
                    top_p: 1.0,
                    top_k: Some(5),
                    min_p: 0.0,
                    repetition_penalty: 1.0,
                }),
                ..Default::default()
            },
            SamplingConfig {
                decoding: Decoding::Sample(SamplingParams {
                    temperature: 0.8,
                    top_p: 0.6,
                    top_k: None,
                    min_p: 0.0,
                    repetition_penalty: 1.0,
                }),
                ..Default::default()
            },
            SamplingConfig {
                decoding: Decoding::Sample(SamplingParams {
                    temperature: 1.0,
                    top_p: 0.9,
                    top_k: Some(12),
                    min_p: 0.0,
                    repetition_penalty: 1.0,
                }),
                ..Default::default()
            },
            SamplingConfig {
                decoding: Decoding::Sample(SamplingParams {
                    temperature: 1.0,
                    top_p: 1.0,
                    top_k: Some(1),
                    min_p: 0.0,
                    repetition_penalty: 1.0,
                }),
                ..Default::default()
            },
            SamplingConfig {
                decoding: Decoding::Sample(SamplingParams {
                    temperature: 1.0,
                    top_p: 1.0,
                    top_k: Some(1),
                    min_p: 0.0,
                    repetition_penalty: 3.0,
                }),
                ..Default::default()
            },
            SamplingConfig {
                decoding: Decoding::Sample(SamplingParams {
                    temperature: 0.8,
                    top_p: 0.9,
                    top_k: None,
                    min_p: 0.02,
                    repetition_penalty: 1.3,
                }),
                ..Default::default()
            },
        ];
        // Seen ids: the most likely one (id 27, logit 3.37; next id 4, 3.24), positive and
        // negative ones: penalty 3 moves the top-1 draw off id 27.
        let seen = [27u32, 3, 7, 19, 11];
        let top = |penalty: f64| {
            let cfg = SamplingConfig {
                decoding: Decoding::Sample(SamplingParams {
                    temperature: 1.0,
                    top_p: 1.0,
                    top_k: Some(1),
                    min_p: 0.0,
                    repetition_penalty: penalty,
                }),
                ..Default::default()
            };
            on_device(&logits, &seen, &cfg, 0.5).0
        };
        assert_eq!((top(1.0), top(3.0)), (27, 4));
        for cfg in &cfgs {
            for seed in 0..40 {
                // The host sampler draws exactly one f64 per non-greedy token: replay it.
                let mut rng = sequence_rng(seed, 0);
                let u = if cfg.decoding.is_greedy() {
                    0.0
                } else {
                    sequence_rng(seed, 0).random::<f64>()
                };
                let (ht, hl) = sample_token(&logits, &seen, cfg, &mut rng);
                let (dt, dl) = on_device(&logits, &seen, cfg, u);
                assert_eq!(ht, dt, "{cfg:?} seed {seed}");
                assert!((hl - dl).abs() < 1e-4, "{cfg:?} seed {seed}: {hl} vs {dl}");
            }
        }
    }

    #[test]
    fn rows_are_independent() {
        let a: Vec<f32> = (0..40).map(|i| (i as f32 * 0.31).sin()).collect();
        let b: Vec<f32> = (0..40).map(|i| (i as f32 * 0.17).cos() * 2.0).collect();
        let cfg = SamplingConfig {
            decoding: Decoding::Sample(SamplingParams {
                temperature: 1.0,
                top_p: 0.8,
                top_k: None,
                min_p: 0.0,
                repetition_penalty: 1.0,
            }),
            ..Default::default()
        };
        let both = Tensor::<Flex, 2>::from_data(
            TensorData::new([a.clone(), b].concat(), [2, 40]),
            &Default::default(),
        );
        let (tok, _) = sample_on_device(both, &[&[], &[]], &cfg, &[0.3, 0.9]);
        let toks = tok.into_data().convert::<i64>().into_vec::<i64>().unwrap();
        assert_eq!(toks[0] as u32, on_device(&a, &[], &cfg, 0.3).0);
    }
}
