//! Global gradient-norm clipping. burn's `GradientClipping::Norm` clips every parameter tensor by
//! its own norm; the method (like PyTorch's `clip_grad_norm_`) clips all gradients together by their
//! global L2 norm, and reports that norm before clipping.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, ElementConversion, Tensor};

struct SquaredNorm<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    total: f64,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredNorm<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            // Squares summed in f32 at least, whatever the gradient dtype (bf16 on CUDA).
            let s: f64 = g.cast(DType::F32).square().sum().into_scalar().elem();
            self.total += s;
        }
    }
}

struct Scale<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    factor: f64,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads.register(param.id, g * self.factor);
        }
    }
}

/// The global L2 norm of the gradients of `module`'s float parameters (in f64).
pub fn global_grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M, grads: &GradientsParams) -> f64 {
    let mut v = SquaredNorm::<B> { grads, total: 0.0, _b: std::marker::PhantomData };
    module.visit(&mut v);
    v.total.sqrt()
}

/// Scales every gradient by `factor` (e.g. `1 / micro_batches` after accumulation).
pub fn scale_grads<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M, grads: &mut GradientsParams, factor: f64) {
    let mut v = Scale::<B> { grads, factor, _b: std::marker::PhantomData };
    module.visit(&mut v);
}

/// Clips all gradients together to global norm `max_norm` (PyTorch's rule: scale by
/// `max_norm / (norm + 1e-6)` when that is below 1). Returns the norm before clipping.
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M, grads: &mut GradientsParams, max_norm: f64) -> f64 {
    let norm = global_grad_norm(module, grads);
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        scale_grads(module, grads, coef);
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::TensorData;

    type B = Autodiff<Flex>;

    #[test]
    fn global_norm_spans_all_parameters_and_clipping_scales_them_together() {
        let dev = Default::default();
        let lin: Linear<B> = LinearConfig::new(3, 2).init(&dev);
        let x = Tensor::<B, 2>::from_data(TensorData::new(vec![1.0f32, -2.0, 0.5, 3.0, 0.0, 1.0], [2, 3]), &dev);
        let loss = lin.forward(x).sum();
        let mut grads = GradientsParams::from_grads(loss.backward(), &lin);
        // d(sum(xW + b))/dW[i][j] = sum over rows of x[., i]; db[j] = rows.
        let col = [4.0f64, -2.0, 1.5];
        let want = (2.0 * col.iter().map(|c| c * c).sum::<f64>() + 2.0 * 4.0).sqrt();
        let norm = global_grad_norm::<B, _>(&lin, &grads);
        assert!((norm - want).abs() < 1e-5, "{norm} vs {want}");
        // Per-tensor clipping would clip W and b separately; the global rule keeps their ratio.
        let before = clip_global_norm::<B, _>(&lin, &mut grads, 1.0);
        assert!((before - want).abs() < 1e-5);
        let after = global_grad_norm::<B, _>(&lin, &grads);
        assert!((after - 1.0).abs() < 1e-5, "{after}");
        let b = grads.get::<Flex, 1>(lin.bias.as_ref().unwrap().id).unwrap().into_data().convert::<f32>().into_vec::<f32>().unwrap();
        assert!((b[0] as f64 - 2.0 / (want + 1e-6)).abs() < 1e-6);
        // Below the threshold nothing changes.
        let untouched = clip_global_norm::<B, _>(&lin, &mut grads, 10.0);
        assert!((untouched - 1.0).abs() < 1e-5);
        assert!((global_grad_norm::<B, _>(&lin, &grads) - 1.0).abs() < 1e-5);
    }
}
