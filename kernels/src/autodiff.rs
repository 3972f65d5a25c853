//! The op families under `Autodiff<B>`: the forward runs on `B` (kernels where `B` has them) and a
//! hand-written backward is registered; only `logprobs` (and with them, when asked, their
//! entropies) and the surrogate loss carry gradients.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};

use crate::prim::float;
use crate::{
    AttentionKernels, AttentionLayout, AttentionOps, Clip, DecodeOps, LossOps, PagedLayout, Reduce,
};

#[derive(Debug)]
struct AttentionBackward;

impl<B: AttentionOps> Backward<B, 3> for AttentionBackward {
    /// `q`, `k`, `v`, `key_valid`, `out`, `lse`, layout.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        AttentionLayout,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, key_valid, out, lse, layout) = ops.state;
        let gs = B::attention_backward(q, k, v, key_valid, out, lse, grad, layout);
        for (node, g) in ops.parents.into_iter().zip(gs) {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// Registers the hidden-state and head gradients of a log-prob op on the parents that track one.
fn register_head_grads<B: LossOps>(
    grads: &mut Gradients,
    parents: [Option<NodeId>; 2],
    gs: [Option<FloatTensor<B>>; 2],
) {
    for (node, g) in parents.into_iter().zip(gs) {
        if let (Some(node), Some(g)) = (node, g) {
            grads.register::<B>(node, g);
        }
    }
}

#[derive(Debug)]
struct TokenLogprobsBackward;

impl<B: LossOps> Backward<B, 2> for TokenLogprobsBackward {
    /// Checkpointed hidden states and head, targets, log-sum-exp per token, chunk size.
    type State = (NodeId, NodeId, IntTensor<B>, FloatTensor<B>, usize);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_h, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (h_id, w_id, targets, lse, chunk) = ops.state;
        let hidden: FloatTensor<B> = checkpointer.retrieve_node_output(h_id);
        let weight: FloatTensor<B> = checkpointer.retrieve_node_output(w_id);
        let (gh, gw) = B::token_logprobs_backward(
            hidden,
            weight,
            targets,
            lse,
            grad,
            chunk,
            (node_h.is_some(), node_w.is_some()),
        );
        register_head_grads::<B>(
            grads,
            [node_h.map(|n| n.id), node_w.map(|n| n.id)],
            [gh, gw],
        );
    }
}

/// The backward of [`LossOps::token_logprobs_with_entropy`]: its one tracked output is the
/// log-probabilities and the entropies packed `[2 x tokens]`, so the gradient arrives packed too.
#[derive(Debug)]
struct TokenLogprobsEntropyBackward;

impl<B: LossOps> Backward<B, 2> for TokenLogprobsEntropyBackward {
    /// Checkpointed hidden states and head, targets, log-sum-exp and entropy per token, chunk
    /// size.
    type State = (
        NodeId,
        NodeId,
        IntTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        usize,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_h, node_w] = ops.parents;
        let packed: burn::tensor::Tensor<B, 1> = float(grads.consume::<B>(&ops.node));
        let n = packed.dims()[0] / 2;
        let g_lp = packed.clone().slice(0..n).into_primitive().tensor();
        let g_ent = packed.slice(n..2 * n).into_primitive().tensor();
        let (h_id, w_id, targets, lse, entropy, chunk) = ops.state;
        let hidden: FloatTensor<B> = checkpointer.retrieve_node_output(h_id);
        let weight: FloatTensor<B> = checkpointer.retrieve_node_output(w_id);
        let (gh, gw) = B::token_logprobs_entropy_backward(
            hidden,
            weight,
            targets,
            lse,
            entropy,
            (g_lp, g_ent),
            chunk,
            (node_h.is_some(), node_w.is_some()),
        );
        register_head_grads::<B>(
            grads,
            [node_h.map(|n| n.id), node_w.map(|n| n.id)],
            [gh, gw],
        );
    }
}

#[derive(Debug)]
struct SurrogateBackward;

impl<B: LossOps> Backward<B, 1> for SurrogateBackward {
    /// `logp`, `logp_old`, advantages, mask, clip range, reduction.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        (f64, f64),
        bool,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(node) = node else { return };
        let (logp, logp_old, adv, mask, (low, high), mean) = ops.state;
        let scale = if mean {
            let m: burn::tensor::Tensor<B, 2> = float(mask.clone());
            let [n, _] = m.dims();
            let count = m.sum_dim(1).clamp_min(1.0).reshape([n]);
            (float::<B, 1>(grad) / count).into_primitive().tensor()
        } else {
            grad
        };
        let g = B::surrogate_backward(logp, logp_old, adv, mask, Clip { low, high }, scale);
        grads.register::<B>(node.id, g);
    }
}

impl<B: LossOps, C: CheckpointStrategy> LossOps for Autodiff<B, C> {
    fn token_logprobs(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        chunk_tokens: usize,
    ) -> [FloatTensor<Self>; 3] {
        let [lp, ent, lse] = B::token_logprobs(
            hidden.primitive.clone(),
            weight.primitive.clone(),
            targets.clone(),
            chunk_tokens,
        );
        let untracked = |t: FloatTensor<B>| <Autodiff<B, C> as AutodiffBackend>::from_inner(t);
        match TokenLogprobsBackward
            .prepare::<C>([hidden.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let h = prep.checkpoint(&hidden);
                let w = prep.checkpoint(&weight);
                let lp = prep.finish((h, w, targets, lse.clone(), chunk_tokens), lp);
                [lp, untracked(ent), untracked(lse)]
            }
            OpsKind::UnTracked(prep) => [prep.finish(lp), untracked(ent), untracked(lse)],
        }
    }

    fn token_logprobs_with_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        chunk_tokens: usize,
    ) -> [FloatTensor<Self>; 3] {
        // The forward runs the driver its backward runs (`fallback`, with the backend's hooks),
        // so both read the same logits: the CPU host head computes f32 logits from bf16 inputs,
        // the driver's product may round them to bf16, and probabilities from one with the
        // log-sum-exp of the other would be off by percents.
        let [lp, ent, lse] = crate::loss::token_logprobs::<B>(
            hidden.primitive.clone(),
            weight.primitive.clone(),
            targets.clone(),
            chunk_tokens,
        );
        let n = float::<B, 1>(lp.clone()).dims()[0];
        let packed = burn::tensor::Tensor::<B, 1>::cat(vec![float(lp), float(ent.clone())], 0)
            .into_primitive()
            .tensor();
        let untracked = |t: FloatTensor<B>| <Autodiff<B, C> as AutodiffBackend>::from_inner(t);
        let packed = match TokenLogprobsEntropyBackward
            .prepare::<C>([hidden.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let h = prep.checkpoint(&hidden);
                let w = prep.checkpoint(&weight);
                prep.finish((h, w, targets, lse.clone(), ent, chunk_tokens), packed)
            }
            OpsKind::UnTracked(prep) => prep.finish(packed),
        };
        let packed: burn::tensor::Tensor<Self, 1> = float(packed);
        [
            packed.clone().slice(0..n).into_primitive().tensor(),
            packed.slice(n..2 * n).into_primitive().tensor(),
            untracked(lse),
        ]
    }

    fn clipped_surrogate(
        logp: FloatTensor<Self>,
        logp_old: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        clip: Clip,
        reduce: Reduce,
    ) -> [FloatTensor<Self>; 3] {
        let [loss, low, high] = B::surrogate_forward(
            logp.primitive.clone(),
            logp_old.primitive.clone(),
            advantages.primitive.clone(),
            mask.primitive.clone(),
            clip,
            reduce,
        );
        let untracked = |t: FloatTensor<B>| <Autodiff<B, C> as AutodiffBackend>::from_inner(t);
        match SurrogateBackward
            .prepare::<C>([logp.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = (
                    logp.primitive,
                    logp_old.primitive,
                    advantages.primitive,
                    mask.primitive,
                    (clip.low, clip.high),
                    reduce == Reduce::MeanPerResponse,
                );
                [prep.finish(state, loss), untracked(low), untracked(high)]
            }
            OpsKind::UnTracked(prep) => [prep.finish(loss), untracked(low), untracked(high)],
        }
    }
}

impl<B: AttentionOps, C: CheckpointStrategy> AttentionOps for Autodiff<B, C> {
    fn check_attention_kernels(
        device: &Self::Device,
        kernels: AttentionKernels,
    ) -> Result<(), crate::KernelError> {
        B::check_attention_kernels(device, kernels)
    }

    /// Runs on `B` (its kernel where it has one); the output carries no gradient.
    fn paged_decode_attention(
        q: FloatTensor<Self>,
        k_pool: FloatTensor<Self>,
        v_pool: FloatTensor<Self>,
        tables: IntTensor<Self>,
        lens: IntTensor<Self>,
        layout: PagedLayout,
    ) -> FloatTensor<Self> {
        let out = B::paged_decode_attention(
            q.primitive,
            k_pool.primitive,
            v_pool.primitive,
            tables,
            lens,
            layout,
        );
        <Autodiff<B, C> as AutodiffBackend>::from_inner(out)
    }

    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_valid: FloatTensor<Self>,
        layout: AttentionLayout,
    ) -> FloatTensor<Self> {
        let [out, lse] = B::attention_forward(
            q.primitive.clone(),
            k.primitive.clone(),
            v.primitive.clone(),
            key_valid.primitive.clone(),
            layout,
        );
        match AttentionBackward
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = (
                    q.primitive,
                    k.primitive,
                    v.primitive,
                    key_valid.primitive,
                    out.clone(),
                    lse,
                    layout,
                );
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

impl<B: DecodeOps, C: CheckpointStrategy> DecodeOps for Autodiff<B, C> {
    fn device_memory_reserved(device: &Self::Device) -> Option<u64> {
        B::device_memory_reserved(device)
    }

    fn compiles_kernels() -> bool {
        B::compiles_kernels()
    }
}
