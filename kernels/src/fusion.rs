//! `GrpoOps` for burn's fusion wrapper (`burn::backend::Wgpu` and `Cuda` are `Fusion<CubeBackend>`):
//! each row hook is registered in the fusion stream as a custom operation that runs the inner
//! backend's kernel when the stream executes. The chunked drivers and the matmuls stay ordinary
//! fused tensor ops.

use std::marker::PhantomData;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use crate::{Clip, GrpoOps, Reduce};

/// Which hook a custom operation runs.
#[derive(Clone, Copy, Debug)]
enum Hook {
    Contiguous,
    RowStats,
    LogitsGrad,
    SurrogateForward(Clip, Reduce),
    SurrogateBackward(Clip),
}

#[derive(Clone, Debug)]
struct HookOp<B> {
    desc: CustomOpIr,
    hook: Hook,
    _b: PhantomData<B>,
}

impl<B: FusionBackend + GrpoOps> Operation<B::FusionRuntime> for HookOp<B> {
    fn execute(&self, h: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let ins = &self.desc.inputs;
        let outs = &self.desc.outputs;
        let f = |h: &mut HandleContainer<_>, i: usize| h.get_float_tensor::<B>(&ins[i]);
        match self.hook {
            Hook::Contiguous => {
                let t = f(h, 0);
                h.register_float_tensor::<B>(&outs[0].id, B::contiguous(t));
            }
            Hook::RowStats => {
                let logits = f(h, 0);
                let targets = h.get_int_tensor::<B>(&ins[1]);
                for (o, t) in outs.iter().zip(B::logits_row_stats(logits, targets)) {
                    h.register_float_tensor::<B>(&o.id, t);
                }
            }
            Hook::LogitsGrad => {
                let logits = f(h, 0);
                let targets = h.get_int_tensor::<B>(&ins[1]);
                let (lse, grad) = (f(h, 2), f(h, 3));
                h.register_float_tensor::<B>(&outs[0].id, B::logits_grad(logits, targets, lse, grad));
            }
            Hook::SurrogateForward(clip, reduce) => {
                let (a, b, c, d) = (f(h, 0), f(h, 1), f(h, 2), f(h, 3));
                for (o, t) in outs.iter().zip(B::surrogate_forward(a, b, c, d, clip, reduce)) {
                    h.register_float_tensor::<B>(&o.id, t);
                }
            }
            Hook::SurrogateBackward(clip) => {
                let (a, b, c, d, e) = (f(h, 0), f(h, 1), f(h, 2), f(h, 3), f(h, 4));
                h.register_float_tensor::<B>(&outs[0].id, B::surrogate_backward(a, b, c, d, clip, e));
            }
        }
    }
}

/// Registers `hook` on `inputs` with float outputs of `shapes` (dtype `dtype`) and returns them.
fn register<B: FusionBackend + GrpoOps>(
    name: &'static str,
    hook: Hook,
    inputs: Vec<FloatTensor<Fusion<B>>>,
    shapes: &[Shape],
    dtype: DType,
) -> Vec<FloatTensor<Fusion<B>>> {
    let client = inputs[0].client.clone();
    let streams = OperationStreams::with_inputs(inputs.iter());
    let outs: Vec<TensorIr> = shapes.iter().map(|s| TensorIr::uninit(client.create_empty_handle(), s.clone(), dtype)).collect();
    let ins: Vec<TensorIr> = inputs.into_iter().map(|t| t.into_ir()).collect();
    let desc = CustomOpIr::new(name, &ins, &outs);
    client.register(streams, OperationIr::Custom(desc.clone()), HookOp::<B> { desc, hook, _b: PhantomData })
}

impl<B: FusionBackend + GrpoOps> GrpoOps for Fusion<B> {
    fn contiguous(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
        let shape = tensor.shape.clone();
        let dtype = tensor.dtype;
        let mut out = register::<B>("conrub_contiguous", Hook::Contiguous, vec![tensor], &[shape], dtype);
        out.remove(0)
    }

    fn logits_row_stats(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> [FloatTensor<Self>; 3] {
        let rows = logits.shape.dims::<2>()[0];
        let dtype = logits.dtype;
        let out = register::<B>("conrub_row_stats", Hook::RowStats, vec![logits, targets], &[Shape::new([rows]), Shape::new([rows]), Shape::new([rows])], dtype);
        out.try_into().expect("three outputs")
    }

    fn logits_grad(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let shape = logits.shape.clone();
        let dtype = logits.dtype;
        let mut out = register::<B>("conrub_logits_grad", Hook::LogitsGrad, vec![logits, targets, lse, grad], &[shape], dtype);
        out.remove(0)
    }

    fn surrogate_forward(
        logp: FloatTensor<Self>,
        logp_old: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        clip: Clip,
        reduce: Reduce,
    ) -> [FloatTensor<Self>; 3] {
        let rows = logp.shape.dims::<2>()[0];
        let dtype = logp.dtype;
        let s = Shape::new([rows]);
        let out = register::<B>(
            "conrub_surrogate_forward",
            Hook::SurrogateForward(clip, reduce),
            vec![logp, logp_old, advantages, mask],
            &[s.clone(), s.clone(), s],
            dtype,
        );
        out.try_into().expect("three outputs")
    }

    fn surrogate_backward(
        logp: FloatTensor<Self>,
        logp_old: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        clip: Clip,
        scale: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let shape = logp.shape.clone();
        let dtype = logp.dtype;
        let mut out = register::<B>(
            "conrub_surrogate_backward",
            Hook::SurrogateBackward(clip),
            vec![logp, logp_old, advantages, mask, scale],
            &[shape],
            dtype,
        );
        out.remove(0)
    }
}
