//! The training paths of the model against each other on flex under autodiff: fused attention vs
//! the naive graph, and activation checkpointing on vs off, compared on the logits and on the
//! gradient of every parameter (f32; differences are summation order only). The batch is left
//! padded, longer than the fused op's 256-row query block, with GQA.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor, TensorData};
use conrub_models::{
    AttentionImpl, CausalLm, Execution, ModelConfig, PaddedBatch, Padding, Precision,
};

type A = Autodiff<Flex>;

fn config() -> ModelConfig {
    let mut c = ModelConfig::tiny(300);
    c.num_attention_heads = 4;
    c.num_key_value_heads = Some(2);
    c.head_dim = Some(16);
    c
}

/// Logits of the real tokens and every parameter's gradient of `sum(logits * w)`; with
/// activation checkpointing through [`CausalLm::layerwise_gradients`].
fn run(exec: Execution) -> (Vec<f32>, Vec<Vec<f32>>) {
    let dev = Default::default();
    let model = CausalLm::<A>::random(&config(), 0.05, 3, &dev).with_execution(exec);
    let seqs: Vec<Vec<u32>> = [270usize, 301, 40]
        .iter()
        .enumerate()
        .map(|(r, &n)| (0..n).map(|i| ((i * 37 + r * 11) % 300) as u32).collect())
        .collect();
    let padded = PaddedBatch::new(&seqs, 0, Padding::Left);
    let batch = padded.to_device::<A>(&dev);
    let v = config().vocab_size;
    let (b, t) = (padded.batch, padded.len);
    // Padding positions get weight 0, as the learner's mask does.
    let mut w = Vec::with_capacity(b * t * v);
    for (i, &real) in padded.mask.iter().enumerate() {
        w.extend((0..v).map(|j| {
            if real {
                (((i * 31 + j * 7) % 19) as f32 - 9.0) / 9.0
            } else {
                0.0
            }
        }));
    }
    let weights = Tensor::<A, 3>::from_data(TensorData::new(w, [b, t, v]), &dev);
    let mut logits = None;
    let mut loss = |hidden: Tensor<A, 3>| {
        let l = model.logits(hidden);
        logits = Some(l.clone().detach());
        (l.cast(DType::F32) * weights.clone()).sum()
    };
    let grads = if exec.activation_checkpointing {
        model.layerwise_gradients(&batch, &mut loss)
    } else {
        let l = loss(model.forward_hidden(&batch));
        GradientsParams::from_grads(l.backward(), &model)
    };
    let all: Vec<f32> = logits
        .unwrap()
        .inner()
        .cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap();
    let real: Vec<f32> = all
        .chunks(v)
        .zip(&padded.mask)
        .filter(|(_, &m)| m)
        .flat_map(|(r, _)| r.to_vec())
        .collect();
    // Gradients of the model's own parameters, in visiting order.
    struct Collect<'a> {
        grads: &'a GradientsParams,
        out: Vec<Vec<f32>>,
    }
    impl ModuleVisitor<A> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
            let g = self
                .grads
                .get::<Flex, D>(param.id)
                .expect("every parameter gets a gradient");
            assert_eq!(g.dtype(), DType::F32, "master-weight gradients are f32");
            self.out
                .push(g.into_data().convert::<f32>().into_vec().unwrap());
        }
    }
    let mut c = Collect {
        grads: &grads,
        out: Vec::new(),
    };
    model.visit(&mut c);
    (real, c.out)
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let max = b
        .iter()
        .fold(0.0f64, |m, &x| m.max(x.abs() as f64))
        .max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f64, |m, (&x, &y)| m.max((x - y).abs() as f64))
        / max
}

fn compare(name: &str, a: Execution, b: Execution, tol: f64) {
    let (la, ga) = run(a);
    let (lb, gb) = run(b);
    assert_eq!(ga.len(), gb.len());
    let logit_err = rel(&la, &lb);
    let grad_err = ga
        .iter()
        .zip(&gb)
        .map(|(x, y)| rel(x, y))
        .fold(0.0, f64::max);
    println!("{name}: logits {logit_err:.2e}, worst parameter gradient {grad_err:.2e} over {} parameters", ga.len());
    assert!(logit_err <= tol, "{name}: logits differ by {logit_err:.3e}");
    assert!(
        grad_err <= tol,
        "{name}: gradients differ by {grad_err:.3e}"
    );
}

#[test]
fn fused_attention_trains_like_the_naive_graph() {
    let naive = Execution {
        attention: AttentionImpl::Naive,
        ..Default::default()
    };
    let fused = Execution {
        attention: AttentionImpl::Fused,
        ..Default::default()
    };
    compare("fused vs naive attention", fused, naive, 1e-4);
}

#[test]
fn activation_checkpointing_gives_the_same_gradients() {
    let plain = Execution::default();
    let checkpointed = Execution {
        activation_checkpointing: true,
        ..Default::default()
    };
    compare("checkpointing on vs off", checkpointed, plain, 1e-5);
    // Also with the naive attention graph inside the recomputed layer.
    let naive = Execution {
        attention: AttentionImpl::Naive,
        ..Default::default()
    };
    let naive_ckpt = Execution {
        attention: AttentionImpl::Naive,
        activation_checkpointing: true,
        ..Default::default()
    };
    compare(
        "checkpointing on vs off (naive attention)",
        naive_ckpt,
        naive,
        1e-5,
    );
}

#[test]
fn mixed_precision_gradients_reach_f32_master_weights() {
    let mixed = Execution {
        precision: Precision::Bf16Mixed,
        activation_checkpointing: true,
        ..Default::default()
    };
    let (lm, gm) = run(mixed);
    let (lf, gf) = run(Execution::default());
    // bf16 activations: a few parts in a thousand of the logits' range.
    let logit_err = rel(&lm, &lf);
    let grad_err = gm
        .iter()
        .zip(&gf)
        .map(|(x, y)| rel(x, y))
        .fold(0.0, f64::max);
    println!("bf16-mixed vs f32: logits {logit_err:.2e}, worst parameter gradient {grad_err:.2e}");
    assert!(logit_err < 3e-2, "{logit_err}");
    assert!(grad_err < 1e-1, "{grad_err}");
}
