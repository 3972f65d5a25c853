//! The rollout engine (paged KV pool, continuous batching, shared prompts, preemption, sampling
//! on the device) against the static-batch reference over the same paged pass
//! (`generate_static`), and against itself under other batch compositions and memory budgets.

use burn::backend::Flex;
use conrub_models::{CausalLm, ModelConfig};
use conrub_rollout::{
    generate_static, rollout, Decoding, EngineConfig, Generation, Rollout, SamplingConfig,
    SamplingParams,
};

type B = Flex;

fn model(vocab: usize) -> CausalLm<B> {
    CausalLm::random(&ModelConfig::tiny(vocab), 0.5, 3, &Default::default())
}

/// Four prompts of lengths 3, 6, 9 and 13 (not multiples of the block size), each twice: two
/// groups of two share a prompt.
fn prompts() -> Vec<Vec<u32>> {
    let base: Vec<Vec<u32>> = [3usize, 6, 9, 13]
        .iter()
        .map(|&n| {
            (0..n as u32)
                .map(|i| (i * 37 + n as u32 * 11) % 500 + 1)
                .collect()
        })
        .collect();
    base.iter().flat_map(|p| [p.clone(), p.clone()]).collect()
}

fn run(
    m: &CausalLm<B>,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    engine: &EngineConfig,
) -> Rollout {
    rollout(m, prompts, cfg, engine, &Default::default()).unwrap()
}

fn tokens(g: &[Generation]) -> Vec<Vec<u32>> {
    g.iter().map(|x| x.tokens.clone()).collect()
}

/// Blocks that hold every row of `prompts` at full length (`max_new` new tokens).
fn full_blocks(prompts: &[Vec<u32>], max_new: usize, bs: usize) -> usize {
    prompts
        .iter()
        .map(|p| (p.len() + max_new).div_ceil(bs))
        .sum()
}

#[test]
fn greedy_equals_the_static_batch_reference() {
    let m = model(512);
    let p = prompts();
    let cfg = SamplingConfig {
        stop_ids: vec![7],
        ..SamplingConfig::greedy(20)
    };
    let reference = generate_static(&m, &p, &cfg, &Default::default()).unwrap();
    for bs in [4, 16] {
        let out = run(
            &m,
            &p,
            &cfg,
            &EngineConfig {
                block_size: bs,
                ..Default::default()
            },
        );
        assert_eq!(
            tokens(&out.generations),
            tokens(&reference),
            "block size {bs}"
        );
        for (a, b) in out.generations.iter().zip(&reference) {
            assert_eq!(a.finish_reason, b.finish_reason);
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-4, "logprob {x} vs static {y}");
            }
        }
    }
}

#[test]
fn a_prompt_is_prefilled_once_for_its_group() {
    let m = model(512);
    let p = prompts();
    let cfg = SamplingConfig {
        max_new_tokens: 6,
        seed: 5,
        ..Default::default()
    };
    let out = run(
        &m,
        &p,
        &cfg,
        &EngineConfig {
            block_size: 4,
            ..Default::default()
        },
    );
    let s = &out.stats;
    assert_eq!(
        (s.sequences, s.distinct_prompts, s.prompt_prefills),
        (8, 4, 4)
    );
    assert_eq!(
        s.prefill_tokens,
        3 + 6 + 9 + 13,
        "each prompt's tokens once"
    );
    assert_eq!((s.preemptions, s.swapped_tokens), (0, 0));
    assert_eq!(s.generated_tokens, 8 * 6);
    assert_eq!(
        s.host_bytes_read,
        (8 * 6 * 12) as u64,
        "ids and log-probs only"
    );
    // Shared prompt blocks: fewer blocks than every row holding its own prompt.
    assert!(s.peak_kv_blocks < full_blocks(&p, 6, 4), "{s:?}");
}

/// A sequence's tokens depend on its prompt and stream only: not on the other rows, on how many
/// run at once, on the budget, or on preemption. Also on the full vocabulary with near-uniform
/// logits (N(0, 0.02) weights), where a 1e-7 change of the logits would move sampled tokens.
#[test]
fn seeded_sampling_is_independent_of_batch_schedule_and_budget() {
    let peaked = model(512);
    let flat = CausalLm::<B>::random(&ModelConfig::tiny(151_936), 0.02, 3, &Default::default());
    for (m, cfg) in [(
        &flat,
        SamplingConfig {
            max_new_tokens: 24,
            seed: 13,
            ..Default::default()
        },
    )]
    .into_iter()
    .chain(
        [
            SamplingConfig {
                max_new_tokens: 24,
                seed: 11,
                ..Default::default()
            },
            SamplingConfig {
                decoding: Decoding::Sample(SamplingParams {
                    temperature: 0.8,
                    top_p: 0.9,
                    top_k: Some(40),
                    min_p: 0.0,
                    repetition_penalty: 1.2,
                }),
                max_new_tokens: 24,
                seed: 12,
                ..Default::default()
            },
        ]
        .map(|c| (&peaked, c)),
    ) {
        let p = prompts();
        let unlimited = run(
            m,
            &p,
            &cfg,
            &EngineConfig {
                block_size: 4,
                ..Default::default()
            },
        );
        // The first row alone (stream 0, as in the batch).
        let alone = run(
            m,
            &p[..1],
            &cfg,
            &EngineConfig {
                block_size: 4,
                ..Default::default()
            },
        );
        assert_eq!(alone.generations[0].tokens, unlimited.generations[0].tokens);
        // At most three rows at once.
        let narrow = run(
            m,
            &p,
            &cfg,
            &EngineConfig {
                block_size: 4,
                max_rows: 3,
                ..Default::default()
            },
        );
        assert_eq!(tokens(&narrow.generations), tokens(&unlimited.generations));
        assert_eq!(narrow.stats.peak_running_rows, 3);
        // A pool that holds a quarter of the rows at full length: preemption, same tokens.
        let quarter = full_blocks(&p, 24, 4) / 4;
        let tight = run(
            m,
            &p,
            &cfg,
            &EngineConfig {
                block_size: 4,
                kv_blocks: Some(quarter),
                ..Default::default()
            },
        );
        assert_eq!(
            tokens(&tight.generations),
            tokens(&unlimited.generations),
            "{:?}",
            tight.stats
        );
        assert!(
            tight.stats.preemptions > 0 && tight.stats.swapped_tokens > 0,
            "{:?}",
            tight.stats
        );
        assert!(tight.stats.peak_kv_blocks <= quarter);
        for (a, b) in tight.generations.iter().zip(&unlimited.generations) {
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-4, "logprob {x} vs {y}");
            }
        }
    }
}

#[test]
fn a_pool_too_small_for_one_sequence_is_an_error_that_says_so() {
    let m = model(512);
    let cfg = SamplingConfig {
        max_new_tokens: 40,
        ..Default::default()
    };
    let e = rollout(
        &m,
        &prompts()[6..7],
        &cfg,
        &EngineConfig {
            block_size: 4,
            kv_blocks: Some(5),
            ..Default::default()
        },
        &Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("kv_blocks") && e.contains("raise the KV budget"),
        "{e}"
    );
}

/// A prefill that reads a cached prefix (`PagedPass::prefix`, what the local judge uses for the
/// prompt its criteria share) gives the logits of the full sequences run without any cache, for
/// left-padded suffixes of different lengths.
#[test]
fn a_prefill_over_a_cached_prefix_equals_the_uncached_forward() {
    use conrub_rollout::{
        ForwardBatch, PaddedBatch, Padding, PagedKv, PagedModel, PagedPass, PagedPrefix,
    };
    let m = model(512);
    let device = Default::default();
    let prefix: Vec<u32> = (0..13u32).map(|i| (i * 29 + 5) % 500 + 1).collect();
    let suffixes: Vec<Vec<u32>> = [1usize, 4, 6]
        .iter()
        .map(|&n| {
            (0..n as u32)
                .map(|i| (i * 41 + n as u32) % 500 + 1)
                .collect()
        })
        .collect();
    let full: Vec<Vec<u32>> = suffixes
        .iter()
        .map(|s| prefix.iter().chain(s).copied().collect())
        .collect();
    let want = m.forward_last(&PaddedBatch::new(&full, 0, Padding::Left).to_device(&device));

    let bs = 4;
    let mut kv = PagedKv::new(m.kv_layout(), prefix.len().div_ceil(bs), bs, &device);
    let slots: Vec<u32> = (0..prefix.len() as u32).collect();
    let head = ForwardBatch::contiguous(std::slice::from_ref(&prefix), 0, &device);
    let _ = m.forward_paged(&head, &mut kv, &PagedPass::prefill(slots.clone()));
    let padded = PaddedBatch::new(&suffixes, 0, Padding::Left);
    let mut batch = padded.to_device(&device);
    batch.position_ids = batch.position_ids.add_scalar(prefix.len() as i64);
    let pass = PagedPass {
        prefix: Some(PagedPrefix::new(&slots, &device)),
        ..PagedPass::prefill(Vec::new())
    };
    let got = m.forward_paged(&batch, &mut kv, &pass);
    let (got, want) = (
        got.into_data().convert::<f32>().into_vec::<f32>().unwrap(),
        want.into_data().convert::<f32>().into_vec::<f32>().unwrap(),
    );
    let d = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(d < 1e-4, "max |logit difference| {d:e}");
}
