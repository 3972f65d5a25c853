//! Gradient sets added parameter by parameter: how a micro-batch's gradients join the running sum
//! of an optimizer step (`conrub_contracts::Gradients::Sum`), and how a model that
//! computes its gradients a layer at a time (activation checkpointing) adds each layer's.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

/// `sum + new` over `module`'s parameters: each gradient of `new` is added into `sum` (a
/// parameter in one of them only keeps its gradient); parameters outside `module` are left in
/// `sum` as they are.
pub fn add_gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    mut sum: GradientsParams,
    mut new: GradientsParams,
) -> GradientsParams {
    module.visit(&mut Add {
        sum: &mut sum,
        new: &mut new,
    });
    sum
}

struct Add<'a> {
    sum: &'a mut GradientsParams,
    new: &'a mut GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Add<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.new.remove::<B::InnerBackend, D>(param.id) {
            let total = match self.sum.remove::<B::InnerBackend, D>(param.id) {
                Some(old) => old + g,
                None => g,
            };
            self.sum.register(param.id, total);
        }
    }
}
