//! The op families for burn's fusion wrapper (`burn::backend::Wgpu` and `Cuda` are `Fusion<CubeBackend>`):
//! each row hook and the attention forward and backward are registered in the fusion stream as
//! custom operations that run the inner backend's kernels when the stream executes (each output
//! with its own dtype: attention's `lse` is f32 whatever `q`'s dtype). The chunked drivers and the
//! matmuls stay ordinary fused tensor ops.

use std::marker::PhantomData;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use crate::sampling::Decoding;
use crate::{
    AttentionKernels, AttentionLayout, AttentionOps, Clip, DecodeOps, KernelOps, LossOps,
    PagedLayout, Reduce,
};

/// Which hook a custom operation runs.
#[derive(Clone, Copy, Debug)]
enum Hook {
    Contiguous,
    RowStats,
    LogitsGrad,
    SurrogateForward(Clip, Reduce),
    SurrogateBackward(Clip),
    AttentionForward(AttentionLayout),
    AttentionBackward(AttentionLayout),
    PagedDecode(PagedLayout),
    Sample(Decoding),
}

#[derive(Clone, Debug)]
struct HookOp<B> {
    desc: CustomOpIr,
    hook: Hook,
    _b: PhantomData<B>,
}

impl<B: FusionBackend + KernelOps> Operation<B::FusionRuntime> for HookOp<B> {
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
                h.register_float_tensor::<B>(
                    &outs[0].id,
                    B::logits_grad(logits, targets, lse, grad),
                );
            }
            Hook::SurrogateForward(clip, reduce) => {
                let (a, b, c, d) = (f(h, 0), f(h, 1), f(h, 2), f(h, 3));
                for (o, t) in outs
                    .iter()
                    .zip(B::surrogate_forward(a, b, c, d, clip, reduce))
                {
                    h.register_float_tensor::<B>(&o.id, t);
                }
            }
            Hook::SurrogateBackward(clip) => {
                let (a, b, c, d, e) = (f(h, 0), f(h, 1), f(h, 2), f(h, 3), f(h, 4));
                h.register_float_tensor::<B>(
                    &outs[0].id,
                    B::surrogate_backward(a, b, c, d, clip, e),
                );
            }
            Hook::AttentionForward(layout) => {
                let (q, k, v, valid) = (f(h, 0), f(h, 1), f(h, 2), f(h, 3));
                for (o, t) in outs
                    .iter()
                    .zip(B::attention_forward(q, k, v, valid, layout))
                {
                    h.register_float_tensor::<B>(&o.id, t);
                }
            }
            Hook::AttentionBackward(layout) => {
                let (q, k, v, valid) = (f(h, 0), f(h, 1), f(h, 2), f(h, 3));
                let (out, lse, d_out) = (f(h, 4), f(h, 5), f(h, 6));
                for (o, t) in outs.iter().zip(B::attention_backward(
                    q, k, v, valid, out, lse, d_out, layout,
                )) {
                    h.register_float_tensor::<B>(&o.id, t);
                }
            }
            Hook::PagedDecode(layout) => {
                let (q, k, v) = (f(h, 0), f(h, 1), f(h, 2));
                let (tables, lens) = (
                    h.get_int_tensor::<B>(&ins[3]),
                    h.get_int_tensor::<B>(&ins[4]),
                );
                h.register_float_tensor::<B>(
                    &outs[0].id,
                    B::paged_decode_attention(q, k, v, tables, lens, layout),
                );
            }
            Hook::Sample(params) => {
                let (logits, uniforms) = (f(h, 0), f(h, 1));
                let (tokens, logp) = B::sample_rows_on(logits, uniforms, &params);
                h.register_int_tensor::<B>(&outs[0].id, tokens);
                h.register_float_tensor::<B>(&outs[1].id, logp);
            }
        }
    }
}

/// Registers `hook` on `inputs` with float outputs of the given shapes and dtypes and returns them.
fn register<B: FusionBackend + KernelOps>(
    name: &'static str,
    hook: Hook,
    inputs: Vec<FloatTensor<Fusion<B>>>,
    outputs: &[(Shape, DType)],
) -> Vec<FloatTensor<Fusion<B>>> {
    let client = inputs[0].client.clone();
    let streams = OperationStreams::with_inputs(inputs.iter());
    let outs: Vec<TensorIr> = outputs
        .iter()
        .map(|(s, dtype)| TensorIr::uninit(client.create_empty_handle(), s.clone(), *dtype))
        .collect();
    let ins: Vec<TensorIr> = inputs.into_iter().map(|t| t.into_ir()).collect();
    let desc = CustomOpIr::new(name, &ins, &outs);
    client.register(
        streams,
        OperationIr::Custom(desc.clone()),
        HookOp::<B> {
            desc,
            hook,
            _b: PhantomData,
        },
    )
}

impl<B: FusionBackend + KernelOps> LossOps for Fusion<B> {
    fn contiguous(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
        let shape = tensor.shape.clone();
        let dtype = tensor.dtype;
        let mut out = register::<B>(
            "conrub_contiguous",
            Hook::Contiguous,
            vec![tensor],
            &[(shape, dtype)],
        );
        out.remove(0)
    }

    fn logits_row_stats(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> [FloatTensor<Self>; 3] {
        let rows = logits.shape.dims::<2>()[0];
        let dtype = logits.dtype;
        let out = register::<B>(
            "conrub_row_stats",
            Hook::RowStats,
            vec![logits, targets],
            &[
                (Shape::new([rows]), dtype),
                (Shape::new([rows]), dtype),
                (Shape::new([rows]), dtype),
            ],
        );
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
        let mut out = register::<B>(
            "conrub_logits_grad",
            Hook::LogitsGrad,
            vec![logits, targets, lse, grad],
            &[(shape, dtype)],
        );
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
            &[(s.clone(), dtype), (s.clone(), dtype), (s, dtype)],
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
            &[(shape, dtype)],
        );
        out.remove(0)
    }
}

impl<B: FusionBackend + KernelOps> AttentionOps for Fusion<B> {
    fn check_attention_kernels(
        device: &Self::Device,
        kernels: AttentionKernels,
    ) -> Result<(), crate::KernelError> {
        B::check_attention_kernels(device, kernels)
    }

    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_valid: FloatTensor<Self>,
        layout: AttentionLayout,
    ) -> [FloatTensor<Self>; 2] {
        let [b, heads, t, _] = q.shape.dims::<4>();
        let out = (q.shape.clone(), q.dtype);
        let lse = (Shape::new([b, heads, t]), DType::F32);
        let outs = register::<B>(
            "conrub_attention_forward",
            Hook::AttentionForward(layout),
            vec![q, k, v, key_valid],
            &[out, lse],
        );
        outs.try_into().expect("two outputs")
    }

    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_valid: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        layout: AttentionLayout,
    ) -> [FloatTensor<Self>; 3] {
        let grads = [
            (q.shape.clone(), q.dtype),
            (k.shape.clone(), k.dtype),
            (v.shape.clone(), v.dtype),
        ];
        let outs = register::<B>(
            "conrub_attention_backward",
            Hook::AttentionBackward(layout),
            vec![q, k, v, key_valid, out, lse, d_out],
            &grads,
        );
        outs.try_into().expect("three outputs")
    }

    fn paged_decode_attention(
        q: FloatTensor<Self>,
        k_pool: FloatTensor<Self>,
        v_pool: FloatTensor<Self>,
        tables: IntTensor<Self>,
        lens: IntTensor<Self>,
        layout: PagedLayout,
    ) -> FloatTensor<Self> {
        let out = (q.shape.clone(), q.dtype);
        let mut outs = register::<B>(
            "conrub_paged_decode",
            Hook::PagedDecode(layout),
            vec![q, k_pool, v_pool, tables, lens],
            &[out],
        );
        outs.remove(0)
    }
}

impl<B: FusionBackend + KernelOps> DecodeOps for Fusion<B> {
    fn device_memory_reserved(device: &Self::Device) -> Option<u64> {
        B::device_memory_reserved(device)
    }

    fn compiles_kernels() -> bool {
        B::compiles_kernels()
    }

    fn sample_rows(
        logits: FloatTensor<Self>,
        params: &Decoding,
        uniforms: &[f64],
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        let rows = logits.shape.dims::<2>()[0];
        if rows == 0 {
            return crate::sampling::sample_rows_by_tensor_ops::<Self>(logits, params, uniforms);
        }
        let u = crate::cube_sampling::uniforms_tensor::<Self>(
            rows,
            params,
            uniforms,
            &logits.client.device().clone(),
        );
        Self::sample_rows_on(logits, u, params)
    }

    fn sample_rows_on(
        logits: FloatTensor<Self>,
        uniforms: FloatTensor<Self>,
        params: &Decoding,
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        let rows = Shape::new([logits.shape.dims::<2>()[0]]);
        let int = <B::IntElem as burn::tensor::Element>::dtype();
        let mut outs = register::<B>(
            "conrub_sample",
            Hook::Sample(*params),
            vec![logits, uniforms],
            &[(rows.clone(), int), (rows, DType::F32)],
        );
        let logp = outs.pop().expect("two outputs");
        (outs.pop().expect("two outputs"), logp)
    }
}
