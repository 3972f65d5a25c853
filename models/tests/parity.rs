//! Parity with Hugging Face transformers (float64 reference, see testdata/generate_fixtures.py for
//! Qwen3 and testdata/generate_family_fixtures.py for Llama and Qwen2), padding, paged-KV and
//! loading tests on the CPU backend with f32 compute: burn-flex, or libtorch's CPU device with
//! feature `tch` (`scripts/test-tch.sh`). Every family meets the same tolerances.

use std::path::{Path, PathBuf};

use burn::tensor::{DType, Tensor};
use conrub_models::{
    save_pretrained, score_sequences, CausalLm, ForwardBatch, PaddedBatch, Padding, Pretrained,
    SaveDtype,
};
use conrub_rollout::{Decoding, FinishReason, SamplingConfig, SamplingParams};
use safetensors::SafeTensors;

#[cfg(not(feature = "tch"))]
type B = burn::backend::Flex;
#[cfg(feature = "tch")]
type B = burn::backend::LibTorch<f32>;

/// Every fixture, `family/name`.
const MODELS: &[&str] = &[
    "qwen3/tied-gqa-f32",
    "qwen3/untied-mqa-bf16",
    "qwen3/tied-mha-bf16-sharded",
    "llama/untied-gqa-llama3rope-bf16",
    "llama/tied-mha-bias-f32",
    "qwen2/tied-gqa-f32",
    "qwen2/untied-mqa-bf16",
];

/// One fixture of each family with an untied head and one with a tied head.
const PER_FAMILY: &[(&str, &str)] = &[
    ("qwen3/tied-gqa-f32", "qwen3/untied-mqa-bf16"),
    (
        "llama/tied-mha-bias-f32",
        "llama/untied-gqa-llama3rope-bf16",
    ),
    ("qwen2/tied-gqa-f32", "qwen2/untied-mqa-bf16"),
];

fn testdata(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata")
        .join(name)
}

fn load(name: &str) -> Pretrained<B> {
    Pretrained::<B>::load_dir(&testdata(name), &Default::default()).unwrap()
}

struct Reference {
    json: serde_json::Value,
    bytes: Vec<u8>,
}

impl Reference {
    fn open(name: &str) -> Self {
        let dir = testdata(name);
        Self {
            json: serde_json::from_str(
                &std::fs::read_to_string(dir.join("reference.json")).unwrap(),
            )
            .unwrap(),
            bytes: std::fs::read(dir.join("reference.safetensors")).unwrap(),
        }
    }
    fn f64s(&self, key: &str) -> (Vec<usize>, Vec<f64>) {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(key).unwrap();
        let data = t
            .data()
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        (t.shape().to_vec(), data)
    }
    fn ids(&self, key: &str) -> Vec<Vec<u32>> {
        serde_json::from_value(self.json[key].clone()).unwrap()
    }
    fn id_list(&self, key: &str) -> Vec<u32> {
        serde_json::from_value(self.json[key].clone()).unwrap()
    }
}

fn host<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn logits_and_logprobs_match_transformers_float64() {
    let device = Default::default();
    for name in MODELS {
        let qwen = load(name);
        let reference = Reference::open(name);
        for (i, seq) in reference.ids("sequences").iter().enumerate() {
            let batch = ForwardBatch::<B>::contiguous(std::slice::from_ref(seq), 0, &device);
            let logits = host(qwen.model.forward(&batch));
            let (shape, expected) = reference.f64s(&format!("logits.{i}"));
            assert_eq!(shape, vec![seq.len(), qwen.config.vocab_size]);
            let d = max_abs_diff(&logits, &expected);
            eprintln!("{name} seq {i}: max |logit diff| {d:e}");
            assert!(d < 1e-4, "{name} seq {i}: max |logit diff| {d:e}");
            // Guard against a vacuous comparison: the logits must vary.
            let spread = expected.iter().cloned().fold(f64::MIN, f64::max)
                - expected.iter().cloned().fold(f64::MAX, f64::min);
            assert!(spread > 1.0, "{name}: reference logits are nearly constant");

            let scores =
                score_sequences(&qwen.model, std::slice::from_ref(seq), 0, &device).unwrap();
            let (_, expected_lp) = reference.f64s(&format!("next_logprobs.{i}"));
            let d = max_abs_diff(&scores[0].token_logprobs, &expected_lp);
            assert!(d < 1e-4, "{name} seq {i}: max |logprob diff| {d:e}");
            assert_eq!(scores[0].argmax.len(), seq.len());
        }
    }
}

#[test]
fn greedy_generation_matches_transformers() {
    let device = Default::default();
    for name in MODELS {
        let qwen = load(name);
        let reference = Reference::open(name);
        let prompt = reference.id_list("greedy_prompt");
        let expected = reference.id_list("greedy_tokens");
        let cfg = SamplingConfig {
            decoding: Decoding::Greedy,
            max_new_tokens: expected.len(),
            ..Default::default()
        };
        let out = conrub_rollout::generate(&qwen.model, &[prompt], &cfg, &device).unwrap();
        assert_eq!(out[0].tokens, expected, "{name}");
        assert_eq!(out[0].finish_reason, FinishReason::Length);
        assert!(out[0]
            .logprobs
            .iter()
            .all(|&lp| lp <= 0.0 && lp.is_finite()));
    }
}

#[test]
fn padded_batches_equal_unbatched() {
    for (_, name) in PER_FAMILY {
        padded_batch_equals_unbatched(name);
    }
}

fn padded_batch_equals_unbatched(name: &str) {
    let device = Default::default();
    let qwen = load(name);
    let seqs = Reference::open(name).ids("sequences");
    let singles: Vec<Vec<f32>> = seqs
        .iter()
        .map(|s| {
            host(qwen.model.forward(&ForwardBatch::contiguous(
                std::slice::from_ref(s),
                0,
                &device,
            )))
        })
        .collect();
    let v = qwen.config.vocab_size;
    for padding in [Padding::Left, Padding::Right] {
        let batch = PaddedBatch::new(&seqs, 7, padding);
        let logits = host(qwen.model.forward(&batch.to_device(&device)));
        for (r, seq) in seqs.iter().enumerate() {
            let offset = match padding {
                Padding::Left => batch.len - seq.len(),
                Padding::Right => 0,
            };
            let start = (r * batch.len + offset) * v;
            let got = &logits[start..start + seq.len() * v];
            let d = got
                .iter()
                .zip(&singles[r])
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(d < 1e-5, "{name} {padding:?} row {r}: {d:e}");
        }
    }
}

#[test]
fn paged_prefill_and_decoding_equal_the_full_forward() {
    use conrub_rollout::{PagedKv, PagedModel, PagedPass, PagedRead};
    let device = Default::default();
    let bs = 4;
    for name in MODELS {
        let qwen = load(name);
        let v = qwen.config.vocab_size;
        let seqs = Reference::open(name).ids("sequences");
        // Two rows of different lengths, each prefilled alone, then decoded together one token
        // per step across block boundaries. The rows own interleaved blocks, as in a busy pool.
        let full = [&seqs[0], &seqs[1]];
        let mut done = [5usize, 9];
        let steps = 7;
        let blocks = (done[1] + steps).div_ceil(bs);
        let table = |r: usize| {
            (0..blocks)
                .map(|j| (j * 2 + r) as u32)
                .collect::<Vec<u32>>()
        };
        let slot = |r: usize, p: usize| table(r)[p / bs] * bs as u32 + (p % bs) as u32;
        let mut kv = PagedKv::<B>::new(qwen.model.kv_layout(), 2 * blocks, bs, &device);
        let expected = |r: usize, t: usize| {
            let logits = host(qwen.model.forward(&ForwardBatch::contiguous(
                &[full[r][..t].to_vec()],
                0,
                &device,
            )));
            logits[(t - 1) * v..t * v].to_vec()
        };
        let check = |got: &[f32], want: &[f32], what: String| {
            let d = got
                .iter()
                .zip(want)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(d < 2e-5, "{name} {what}: {d:e}");
        };
        for (r, &len) in done.iter().enumerate() {
            let pass = PagedPass::prefill((0..len).map(|p| slot(r, p)).collect());
            let batch = ForwardBatch::contiguous(&[full[r][..len].to_vec()], 0, &device);
            let got = host(qwen.model.forward_paged(&batch, &mut kv, &pass));
            check(&got, &expected(r, len), format!("prefill of row {r}"));
        }
        for _ in 0..steps {
            let ids: Vec<i64> = (0..2).map(|r| full[r][done[r]] as i64).collect();
            let pos: Vec<i64> = done.iter().map(|&p| p as i64).collect();
            let step = ForwardBatch::<B> {
                input_ids: Tensor::from_data(burn::tensor::TensorData::new(ids, [2, 1]), &device),
                position_ids: Tensor::from_data(
                    burn::tensor::TensorData::new(pos, [2, 1]),
                    &device,
                ),
                key_mask: None,
            };
            let lens: Vec<usize> = done.iter().map(|p| p + 1).collect();
            let pass = PagedPass {
                write_slots: (0..2).map(|r| slot(r, done[r])).collect(),
                write_rows: None,
                read: Some(PagedRead::new(
                    &[table(0), table(1)],
                    blocks,
                    bs,
                    &lens,
                    &device,
                )),
                prefix: None,
            };
            let got = host(qwen.model.forward_paged(&step, &mut kv, &pass));
            for r in 0..2 {
                done[r] += 1;
                let what = format!("row {r} after {} tokens", done[r]);
                check(&got[r * v..(r + 1) * v], &expected(r, done[r]), what);
            }
        }
    }
}

#[test]
fn batched_generation_matches_single_and_stops_per_sequence() {
    let device = Default::default();
    let qwen = load("qwen3/tied-gqa-f32");
    let prompts = vec![vec![11, 42, 7, 199, 3], vec![9], vec![100, 101, 102]];
    let cfg = SamplingConfig {
        decoding: Decoding::Sample(SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            top_k: Some(50),
            min_p: 0.0,
            repetition_penalty: 1.0,
        }),
        max_new_tokens: 12,
        seed: 1234,
        ..Default::default()
    };
    let batched = conrub_rollout::generate(&qwen.model, &prompts, &cfg, &device).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        // Sequence i draws from stream (seed, i): a batch of i + 1 copies of the same prompt gives
        // row i the same stream in a different batch (other prompts, lengths and padding).
        let rows = vec![p.clone(); i + 1];
        let single = conrub_rollout::generate(&qwen.model, &rows, &cfg, &device).unwrap();
        assert_eq!(single[i].tokens, batched[i].tokens, "row {i}");
        for (a, b) in single[i].logprobs.iter().zip(&batched[i].logprobs) {
            assert!((a - b).abs() < 1e-4);
        }
    }
    // Stop ids end a sequence early (the stop token is kept) while the others go on.
    let first = batched[0].tokens[3];
    let cfg_stop = SamplingConfig {
        stop_ids: vec![first],
        ..cfg.clone()
    };
    let stopped = conrub_rollout::generate(&qwen.model, &prompts, &cfg_stop, &device).unwrap();
    let cut = batched[0].tokens.iter().position(|&t| t == first).unwrap();
    assert_eq!(stopped[0].tokens, batched[0].tokens[..=cut].to_vec());
    assert_eq!(stopped[0].finish_reason, FinishReason::Stop);
    for (s, b) in stopped.iter().zip(&batched) {
        let cut = b.tokens.iter().position(|&t| t == first);
        match cut {
            Some(c) => assert_eq!(s.tokens, b.tokens[..=c].to_vec()),
            None => assert_eq!(s.tokens, b.tokens),
        }
    }
    // Same seed, same output; different seed, (almost surely) different output.
    let again = conrub_rollout::generate(&qwen.model, &prompts, &cfg, &device).unwrap();
    assert_eq!(again, batched);
    let other = conrub_rollout::generate(
        &qwen.model,
        &prompts,
        &SamplingConfig { seed: 99, ..cfg },
        &device,
    )
    .unwrap();
    assert_ne!(other, batched);
}

#[test]
fn tied_head_reuses_the_embedding() {
    let qwen = load("qwen3/tied-gqa-f32");
    assert!(qwen.model.is_tied());
    let untied = load("qwen3/untied-mqa-bf16");
    assert!(!untied.model.is_tied());
    // Parameter count equals the checkpoint's element count: the embedding is not duplicated.
    use burn::module::Module;
    let stored: usize = {
        let bytes =
            std::fs::read(testdata("qwen3/tied-gqa-f32").join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        st.tensors()
            .iter()
            .map(|(_, t)| t.shape().iter().product::<usize>())
            .sum()
    };
    assert_eq!(qwen.model.num_params(), stored);
    // Gradients of the logits reach the embedding through the head.
    type A = burn::backend::Autodiff<B>;
    let device = Default::default();
    let model = Pretrained::<A>::load_dir(&testdata("qwen3/tied-gqa-f32"), &device)
        .unwrap()
        .model;
    let batch = ForwardBatch::<A>::contiguous(&[vec![1, 2, 3]], 0, &device);
    let hidden = model.forward_hidden(&batch).detach();
    let logits = model.logits(hidden);
    let grads = logits.sum().backward();
    let g = model
        .embedding()
        .grad(&grads)
        .expect("embedding receives the head gradient");
    let total: f32 = g.abs().sum().into_scalar();
    assert!(total > 0.0);
}

fn rewrite_checkpoint(
    src: &str,
    edit: impl Fn(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let from = testdata(src);
    std::fs::copy(from.join("config.json"), dir.path().join("config.json")).unwrap();
    let bytes = std::fs::read(from.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        dir.path().join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    dir
}

#[test]
fn bad_checkpoints_name_the_tensor() {
    let device = Default::default();
    let missing = rewrite_checkpoint("qwen3/tied-gqa-f32", |t| {
        t.retain(|x| x.0 != "model.layers.1.self_attn.k_norm.weight")
    });
    let err = Pretrained::<B>::load_dir(missing.path(), &device)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model.layers.1.self_attn.k_norm.weight") && err.contains("missing"),
        "{err}"
    );

    let extra = rewrite_checkpoint("qwen3/tied-gqa-f32", |t| {
        let mut x = t[0].clone();
        x.0 = "model.layers.9.mlp.up_proj.weight".into();
        t.push(x);
    });
    let err = Pretrained::<B>::load_dir(extra.path(), &device)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model.layers.9.mlp.up_proj.weight") && err.contains("unexpected"),
        "{err}"
    );

    // A Qwen2 checkpoint without a q/k/v bias, and a Llama one without its attention biases.
    for (fixture, tensor) in [
        ("qwen2/tied-gqa-f32", "model.layers.0.self_attn.v_proj.bias"),
        (
            "llama/tied-mha-bias-f32",
            "model.layers.1.self_attn.o_proj.bias",
        ),
    ] {
        let missing = rewrite_checkpoint(fixture, |t| t.retain(|x| x.0 != tensor));
        let err = Pretrained::<B>::load_dir(missing.path(), &device)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains(tensor) && err.contains("missing"), "{err}");
    }
    // A Qwen3 checkpoint read as Llama has q/k norms no Llama has.
    let relabelled = rewrite_checkpoint("qwen3/tied-gqa-f32", |_| {});
    let config = relabelled.path().join("config.json");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("\"qwen3\"", "\"llama\"");
    std::fs::write(&config, text).unwrap();
    let err = Pretrained::<B>::load_dir(relabelled.path(), &device)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("self_attn.k_norm.weight") && err.contains("not part of a llama model"),
        "{err}"
    );

    let misshaped = rewrite_checkpoint("qwen3/tied-gqa-f32", |t| {
        let x = t.iter_mut().find(|x| x.0 == "model.norm.weight").unwrap();
        x.2 = vec![x.2[0] / 2];
        x.3.truncate(x.3.len() / 2);
    });
    let err = Pretrained::<B>::load_dir(misshaped.path(), &device)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model.norm.weight") && err.contains("shape"),
        "{err}"
    );

    let empty = tempfile::tempdir().unwrap();
    let err = Pretrained::<B>::load_dir(empty.path(), &device)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("config.json"), "{err}");
}

#[test]
fn save_pretrained_round_trips() {
    let device = Default::default();
    let each = PER_FAMILY
        .iter()
        .flat_map(|(tied, untied)| [(*tied, SaveDtype::F32), (*untied, SaveDtype::Bf16)]);
    for (name, dtype) in each {
        let qwen = load(name);
        let out = tempfile::tempdir().unwrap();
        save_pretrained(&qwen.model, &qwen.config, None, None, out.path(), dtype).unwrap();
        let again = Pretrained::<B>::load_dir(out.path(), &device).unwrap();
        assert_eq!(
            again.config.tie_word_embeddings,
            qwen.config.tie_word_embeddings
        );
        assert_eq!(
            again.config.family().unwrap(),
            qwen.config.family().unwrap()
        );
        assert_eq!(
            again.config.architecture().unwrap(),
            qwen.config.architecture().unwrap()
        );
        let batch = ForwardBatch::<B>::contiguous(&[vec![4, 8, 15, 16, 23, 42]], 0, &device);
        // bf16 -> f32 -> bf16 is exact, so both round trips reproduce the logits bit for bit.
        assert_eq!(
            host(qwen.model.forward(&batch)),
            host(again.model.forward(&batch)),
            "{name}"
        );
        // The tied checkpoint stays tied: no lm_head.weight is written.
        let bytes = std::fs::read(out.path().join("model.safetensors")).unwrap();
        let names: Vec<String> = SafeTensors::deserialize(&bytes)
            .unwrap()
            .names()
            .into_iter()
            .map(String::from)
            .collect();
        assert_eq!(
            names.contains(&"lm_head.weight".to_string()),
            !qwen.config.tie_word_embeddings
        );
    }
}

#[test]
fn random_model_is_seeded() {
    let device = Default::default();
    let cfg = conrub_models::ModelConfig::tiny(64);
    let a = CausalLm::<B>::random(&cfg, 0.1, 5, &device);
    let b = CausalLm::<B>::random(&cfg, 0.1, 5, &device);
    let batch = ForwardBatch::<B>::contiguous(&[vec![1, 2, 3]], 0, &device);
    assert_eq!(host(a.forward(&batch)), host(b.forward(&batch)));
}
