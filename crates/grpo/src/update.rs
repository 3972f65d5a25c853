//! The update stage: global gradient-norm clipping and the optimizer step.
//!
//! burn's `GradientClipping::Norm` clips every parameter tensor by its own norm; the method (like
//! PyTorch's `clip_grad_norm_`) clips all gradients together by their global L2 norm, and reports
//! that norm before clipping. Everything stays on the device: the norm is a `[1]` tensor, the clip
//! coefficient multiplies the gradients on the device, and the caller reads the norms when it reads
//! the step's other metrics (one transfer per step, not one per parameter).
//!
//! Every sum has a fixed order, so two runs give the same bits: large tensors are summed as
//! `[rows, 65,536]` row sums (each row in order), then the row sums; burn-flex's parallel `sum()`
//! of 4M+ elements combines rayon chunks in an order that depends on work stealing.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

use conrub_parallel::fixed_order_sum;

use crate::schedule::LrSchedule;

struct SquaredNorms<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    parts: Vec<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredNorms<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            self.parts
                .push(fixed_order_sum(g.cast(DType::F32).square()));
        }
    }
}

struct Scale<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    factor: Tensor<B::InnerBackend, 1>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let factor = self.factor.clone().cast(g.dtype()).reshape([1; D]);
            self.grads.register(param.id, g * factor);
        }
    }
}

/// The global L2 norm of the gradients of `module`'s float parameters, on the device.
///
/// # Shapes
/// `[1]`, f32.
pub fn global_grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
) -> Tensor<B::InnerBackend, 1> {
    let mut v = SquaredNorms::<B> {
        grads,
        parts: Vec::new(),
    };
    module.visit(&mut v);
    if v.parts.is_empty() {
        let device = module.devices().first().cloned().unwrap_or_default();
        return Tensor::<B, 1>::zeros([1], &device).inner().cast(DType::F32);
    }
    Tensor::cat(v.parts, 0).sum().sqrt()
}

/// Clips all gradients together to global norm `max_norm` (PyTorch's rule: scale by
/// `max_norm / (norm + 1e-6)` when that is below 1), on the device. Returns the norm before
/// clipping (`[1]`).
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> Tensor<B::InnerBackend, 1> {
    let norm = global_grad_norm(module, grads);
    scale_to_norm(module, grads, norm.clone(), max_norm);
    norm
}

/// Scales `grads`, whose global norm is `norm`, by [`clip_global_norm`]'s coefficient.
fn scale_to_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    norm: Tensor<B::InnerBackend, 1>,
    max_norm: f64,
) {
    let coef = (norm.add_scalar(1e-6).recip() * max_norm).clamp_max(1.0);
    let mut v = Scale::<B> {
        grads,
        factor: coef,
    };
    module.visit(&mut v);
}

struct NonFinite<B: AutodiffBackend> {
    parts: Vec<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for NonFinite<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let x = param.val().inner().cast(DType::F32);
        // `x - x` is 0 for a finite value and NaN for NaN or an infinity.
        self.parts.push((x.clone() - x).sum());
    }
}

/// 0 when every float parameter of `module` is finite, else NaN (one reduction per parameter,
/// one scalar read).
pub fn nonfinite_probe<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> f64 {
    let mut v = NonFinite::<B> { parts: Vec::new() };
    module.visit(&mut v);
    if v.parts.is_empty() {
        return 0.0;
    }
    Tensor::cat(v.parts, 0)
        .sum()
        .into_data()
        .convert::<f64>()
        .into_vec::<f64>()
        .expect("a sum")[0]
}

/// Settings of the update stage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpdateConfig {
    /// Learning rate (a [`LrSchedule`] set with [`Update::set_schedule`] replaces it).
    pub lr: f64,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    /// Global gradient-norm clip (0 disables clipping; the norm is still reported).
    pub max_grad_norm: f64,
}

impl UpdateConfig {
    /// The recipe's optimizer (`configs/`: learning rate 3e-6, weight decay 0.1, betas 0.9 /
    /// 0.999, epsilon 1e-8, gradients clipped at norm 1): what benches and checks that time or
    /// test one update use.
    pub fn recipe() -> Self {
        Self {
            lr: 3e-6,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            max_grad_norm: 1.0,
        }
    }
}

/// The update stage: global clipping, then AdamW at the rate its schedule gives (constant
/// `cfg.lr` unless [`Update::set_schedule`]).
pub struct Update<B: AutodiffBackend, P: AutodiffModule<B>> {
    pub(crate) optim: OptimizerAdaptor<AdamW, P, B>,
    cfg: UpdateConfig,
    schedule: LrSchedule,
    /// Optimizer steps so far (skipped ones included): the schedule's position.
    pub(crate) taken: u64,
}

impl<B: AutodiffBackend, P: AutodiffModule<B>> Update<B, P> {
    /// A fresh AdamW.
    pub fn new(cfg: UpdateConfig) -> Self {
        let optim = AdamWConfig::new()
            .with_beta_1(cfg.beta1 as f32)
            .with_beta_2(cfg.beta2 as f32)
            .with_epsilon(cfg.eps as f32)
            .with_weight_decay(cfg.weight_decay as f32)
            .init::<B, P>();
        Self {
            optim,
            cfg,
            schedule: LrSchedule::constant(cfg.lr),
            taken: 0,
        }
    }

    /// Takes the rates from `schedule` from now on (its position is kept).
    pub fn set_schedule(&mut self, schedule: LrSchedule) {
        self.schedule = schedule;
    }

    /// Optimizer steps taken so far, one dropped for a non-finite gradient included.
    pub fn optimizer_steps(&self) -> u64 {
        self.taken
    }

    /// The rate the next optimizer step takes.
    pub fn next_lr(&self) -> f64 {
        self.schedule.lr(self.taken)
    }

    /// The rate of the last optimizer step taken (of the first, before any).
    pub fn last_lr(&self) -> f64 {
        self.schedule.lr(self.taken.saturating_sub(1))
    }

    /// The next optimizer step's rate, counting the step.
    fn advance(&mut self) -> f64 {
        let lr = self.next_lr();
        self.taken += 1;
        lr
    }

    /// Clips `grads` and takes one optimizer step; returns the new policy and the gradient norm
    /// before clipping.
    ///
    /// # Shapes
    /// The norm is `[1]` (f32, on the device).
    pub fn apply(
        &mut self,
        policy: P,
        mut grads: GradientsParams,
    ) -> (P, Tensor<B::InnerBackend, 1>) {
        let norm = if self.cfg.max_grad_norm > 0.0 {
            clip_global_norm(&policy, &mut grads, self.cfg.max_grad_norm)
        } else {
            global_grad_norm(&policy, &grads)
        };
        let lr = self.advance();
        (self.optim.step(lr, policy, grads), norm)
    }

    /// [`Update::apply`] when the gradients' global norm is finite; else the policy unchanged
    /// and no optimizer step (a NaN or infinite loss or gradient shows in the norm). Returns the
    /// policy, the norm (read to the host: one scalar per optimizer step) and whether it stepped.
    pub fn apply_if_finite(&mut self, policy: P, grads: GradientsParams) -> (P, f64, bool) {
        let norm = global_grad_norm(&policy, &grads);
        self.apply_with_norm(policy, grads, norm)
    }

    /// [`Update::apply_if_finite`] with the gradients' global norm given (`[1]`): a sharded
    /// rank holds only its own parameters' gradients, and the norm spans every rank's
    /// (`crate::sharding`).
    pub(crate) fn apply_with_norm(
        &mut self,
        policy: P,
        mut grads: GradientsParams,
        norm: Tensor<B::InnerBackend, 1>,
    ) -> (P, f64, bool) {
        let value = norm
            .clone()
            .into_data()
            .convert::<f64>()
            .into_vec::<f64>()
            .expect("a norm")[0];
        let lr = self.advance();
        if !value.is_finite() {
            return (policy, value, false);
        }
        if self.cfg.max_grad_norm > 0.0 {
            scale_to_norm(&policy, &mut grads, norm, self.cfg.max_grad_norm);
        }
        (self.optim.step(lr, policy, grads), value, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::TensorData;

    type B = Autodiff<Flex>;

    fn scalar(t: Tensor<Flex, 1>) -> f64 {
        t.into_data().convert::<f64>().into_vec::<f64>().unwrap()[0]
    }

    #[test]
    fn global_norm_spans_all_parameters_and_clipping_scales_them_together() {
        let dev = Default::default();
        let lin: Linear<B> = LinearConfig::new(3, 2).init(&dev);
        let x = Tensor::<B, 2>::from_data(
            TensorData::new(vec![1.0f32, -2.0, 0.5, 3.0, 0.0, 1.0], [2, 3]),
            &dev,
        );
        let loss = lin.forward(x).sum();
        let mut grads = GradientsParams::from_grads(loss.backward(), &lin);
        // d(sum(xW + b))/dW[i][j] = sum over rows of x[., i]; db[j] = rows.
        let col = [4.0f64, -2.0, 1.5];
        let want = (2.0 * col.iter().map(|c| c * c).sum::<f64>() + 2.0 * 4.0).sqrt();
        let norm = scalar(global_grad_norm::<B, _>(&lin, &grads));
        assert!((norm - want).abs() < 1e-5, "{norm} vs {want}");
        // Per-tensor clipping would clip W and b separately; the global rule keeps their ratio.
        let before = scalar(clip_global_norm::<B, _>(&lin, &mut grads, 1.0));
        assert!((before - want).abs() < 1e-5);
        let after = scalar(global_grad_norm::<B, _>(&lin, &grads));
        assert!((after - 1.0).abs() < 1e-5, "{after}");
        let b = grads
            .get::<Flex, 1>(lin.bias.as_ref().unwrap().id)
            .unwrap()
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .unwrap();
        assert!((b[0] as f64 - 2.0 / (want + 1e-6)).abs() < 1e-6);
        // Below the threshold nothing changes.
        let untouched = scalar(clip_global_norm::<B, _>(&lin, &mut grads, 10.0));
        assert!((untouched - 1.0).abs() < 1e-5);
        assert!((scalar(global_grad_norm::<B, _>(&lin, &grads)) - 1.0).abs() < 1e-5);
    }

    #[test]
    fn fixed_order_sum_does_not_depend_on_the_thread_count() {
        // 9.7M elements, the size of the demo's tied embedding gradient (burn-flex's own `sum()`
        // of it adds per-thread partial sums in an order set by rayon's work stealing).
        let dev = Default::default();
        let n = 151_936 * 64;
        let data: Vec<f32> = (0..n as u64)
            .map(|i| {
                (i.wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407)
                    >> 40) as f32
                    / (1u64 << 24) as f32
            })
            .collect();
        let want: f64 = data.iter().map(|&x| x as f64).sum();
        let t = Tensor::<Flex, 2>::from_data(TensorData::new(data, [151_936, 64]), &dev);
        let in_pool = |threads: usize, f: &(dyn Fn() -> f64 + Sync)| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(f)
        };
        let ours: Vec<u64> = [1, 2, 3, 5, 8]
            .iter()
            .map(|&k| in_pool(k, &|| scalar(fixed_order_sum(t.clone()))).to_bits())
            .collect();
        assert!(ours.iter().all(|&b| b == ours[0]), "{ours:?}");
        assert!(
            (f64::from_bits(ours[0]) - want).abs() < 1e-3 * want.abs().max(1.0),
            "{} vs {want}",
            f64::from_bits(ours[0])
        );
        for _ in 0..10 {
            assert_eq!(scalar(fixed_order_sum(t.clone())).to_bits(), ours[0]);
        }
    }
}
