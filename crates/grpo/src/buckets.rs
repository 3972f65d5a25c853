//! The gradient all-reduce of a data-parallel optimizer step: every parameter's gradient,
//! flattened in the module's parameter order, packed into buckets of about
//! [`RankSlot::bucket_bytes`], each summed over ranks with one [`crate::Collective`] call. A rank
//! without a gradient for a parameter (no rows in this mini-batch) sends zeros, and one last
//! bucket of presence flags says which parameters got a gradient on any rank: those, and only
//! those, are updated, as on one device.

use std::collections::VecDeque;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use crate::error::Result;
use crate::learner::RankSlot;

type Flat<B> = Tensor<<B as AutodiffBackend>::InnerBackend, 1>;

/// Takes every parameter's gradient out of `grads`, flattened (zeros where missing).
struct Flatten<B: AutodiffBackend> {
    grads: GradientsParams,
    flat: Vec<Flat<B>>,
    present: Vec<f32>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Flatten<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let numel = param.lazy_shape().num_elements();
        let (flat, present) = match self.grads.remove::<B::InnerBackend, D>(param.id) {
            Some(g) => (g.reshape([numel]), 1.0),
            None => {
                let device = param.val().device();
                (Tensor::zeros([numel], &device), 0.0)
            }
        };
        self.flat.push(flat);
        self.present.push(present);
    }
}

/// Puts the summed gradients back, shaped as their parameters, where any rank had one.
struct Unflatten<B: AutodiffBackend> {
    sums: VecDeque<(Flat<B>, bool)>,
    out: GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Unflatten<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let (sum, present) = self.sums.pop_front().expect("one sum per parameter");
        if present {
            let id: ParamId = param.id;
            self.out
                .register::<B::InnerBackend, D>(id, sum.reshape(param.lazy_shape()));
        }
    }
}

/// The sum over the group's ranks of every rank's `grads` of `module`, and the bytes this rank
/// sent.
pub(crate) fn all_reduce<B, M>(
    module: &M,
    grads: GradientsParams,
    slot: &RankSlot<B::InnerBackend>,
) -> Result<(GradientsParams, u64)>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let mut f = Flatten::<B> {
        grads,
        flat: Vec::new(),
        present: Vec::new(),
    };
    module.visit(&mut f);
    let Flatten { flat, present, .. } = f;
    let device = match flat.first() {
        Some(t) => t.device(),
        None => return Ok((GradientsParams::new(), 0)),
    };
    let limit = (slot.bucket_bytes / 4).max(1);
    let mut bytes = 0u64;
    let mut sums: Vec<Flat<B>> = Vec::with_capacity(flat.len());
    let mut pending: Vec<Flat<B>> = Vec::new();
    let mut pending_len = 0usize;
    let mut flush = |pending: &mut Vec<Flat<B>>, len: &mut usize| -> Result<()> {
        if pending.is_empty() {
            return Ok(());
        }
        let lens: Vec<usize> = pending.iter().map(|t| t.dims()[0]).collect();
        let bucket = Tensor::cat(std::mem::take(pending), 0);
        bytes += (*len * 4) as u64;
        let sum = slot.collective.all_reduce_sum(slot.rank, bucket)?;
        let mut at = 0;
        for l in lens {
            sums.push(sum.clone().slice(at..at + l));
            at += l;
        }
        *len = 0;
        Ok(())
    };
    for t in flat {
        let n = t.dims()[0];
        if pending_len > 0 && pending_len + n > limit {
            flush(&mut pending, &mut pending_len)?;
        }
        pending_len += n;
        pending.push(t);
    }
    flush(&mut pending, &mut pending_len)?;
    let n = present.len();
    let flags = Tensor::<B::InnerBackend, 1>::from_floats(present.as_slice(), &device);
    let flags: Vec<f32> = slot
        .collective
        .all_reduce_sum(slot.rank, flags)?
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 flags");
    bytes += (n * 4) as u64;
    let mut u = Unflatten::<B> {
        sums: sums
            .into_iter()
            .zip(flags.iter().map(|&p| p > 0.0))
            .collect(),
        out: GradientsParams::new(),
    };
    module.visit(&mut u);
    Ok((u.out, bytes))
}
