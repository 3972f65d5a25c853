//! The collectives of a data-parallel optimizer step over flattened gradient buckets.
//!
//! Every parameter's gradient is flattened in the module's parameter order and packed into
//! buckets of about [`RankSlot::bucket_bytes`], one collective call each:
//! - [`all_reduce`] (`sharding = "none"`): every rank gets every sum;
//! - [`reduce_scatter`] (sharded runs): a bucket is laid out owner by owner
//!   ([`ShardLayout`]), and each rank gets the sums of the parameters it owns;
//! - [`all_gather_weights`] (sharded runs, after the owners' updates): every rank gets every
//!   updated parameter, bucket by bucket.
//!
//! A rank without a gradient for a parameter (no rows in this mini-batch) sends zeros, made one
//! bucket at a time; a bucket of presence flags says which parameters got a gradient on any
//! rank: those, and only those, are updated, as on one device.

use std::ops::Range;
use std::time::Instant;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

use crate::error::Result;
use crate::layout::{CommStats, ShardLayout};
use crate::rank::RankSlot;

pub type Flat<B> = Tensor<<B as AutodiffBackend>::InnerBackend, 1>;

/// Takes every parameter's gradient out of `grads`, flattened (`None` where missing), with its
/// element count, in the module's parameter order.
struct Take<B: AutodiffBackend> {
    grads: GradientsParams,
    flat: Vec<Option<Flat<B>>>,
    sizes: Vec<usize>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Take<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let numel = param.lazy_shape().num_elements();
        let g = self.grads.remove::<B::InnerBackend, D>(param.id);
        // The gradient's own size: a released parameter (`sharding = "full"`) is a placeholder.
        self.flat.push(g.map(|g| {
            let n = g.shape().num_elements();
            g.reshape([n])
        }));
        self.sizes.push(numel);
    }
}

/// Every parameter's flattened gradient (`None` where `grads` has none) and element count.
pub fn take_flat<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: GradientsParams,
) -> (Vec<Option<Flat<B>>>, Vec<usize>) {
    let mut t = Take::<B> {
        grads,
        flat: Vec::new(),
        sizes: Vec::new(),
    };
    module.visit(&mut t);
    (t.flat, t.sizes)
}

/// Puts flattened gradients back, shaped as their parameters (`None`: no gradient).
struct Restore<B: AutodiffBackend> {
    flat: std::vec::IntoIter<Option<Flat<B>>>,
    out: GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Restore<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.flat.next().expect("one entry per parameter") {
            self.out
                .register::<B::InnerBackend, D>(param.id, g.reshape(param.lazy_shape()));
        }
    }
}

/// Gradients of `module` from one flattened entry per parameter.
pub fn restore<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    flat: Vec<Option<Flat<B>>>,
) -> GradientsParams {
    let mut r = Restore::<B> {
        flat: flat.into_iter(),
        out: GradientsParams::new(),
    };
    module.visit(&mut r);
    r.out
}

/// Consecutive runs of parameters (by index) of at most `limit` elements each (a larger
/// parameter is a bucket of its own); `include` leaves parameters out.
pub fn bucket_ranges(
    sizes: &[usize],
    limit: usize,
    include: impl Fn(usize) -> bool,
) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut len = 0usize;
    for (i, &n) in sizes.iter().enumerate().filter(|(i, _)| include(*i)) {
        match out.last_mut() {
            Some(last) if len + n <= limit => {
                last.push(i);
                len += n;
            }
            _ => {
                out.push(vec![i]);
                len = n;
            }
        }
    }
    out
}

/// Elements per bucket of `slot`.
pub fn limit<B: burn::tensor::backend::Backend>(slot: &RankSlot<B>) -> usize {
    (slot.bucket_bytes / 4).max(1)
}

/// The entry of parameter `i`, or zeros of its size.
fn or_zeros<B: AutodiffBackend>(
    flat: &mut [Option<Flat<B>>],
    i: usize,
    n: usize,
    device: &burn::tensor::Device<B::InnerBackend>,
) -> Flat<B> {
    flat[i]
        .take()
        .unwrap_or_else(|| Tensor::<B::InnerBackend, 1>::zeros([n], device).cast(DType::F32))
}

/// Element ranges of `lens` laid end to end.
fn spans(lens: impl IntoIterator<Item = usize>) -> Vec<Range<usize>> {
    let mut at = 0;
    lens.into_iter()
        .map(|l| {
            at += l;
            at - l..at
        })
        .collect()
}

/// The sum over the group's ranks of the presence flags `present` (one per parameter): which
/// parameters got a gradient on any rank.
pub fn any_rank<B: AutodiffBackend>(
    present: &[bool],
    slot: &RankSlot<B::InnerBackend>,
    device: &burn::tensor::Device<B::InnerBackend>,
    comm: &mut CommStats,
) -> Result<Vec<bool>> {
    let t = Instant::now();
    let flags: Vec<f32> = present.iter().map(|&p| f32::from(u8::from(p))).collect();
    let flags = Tensor::<B::InnerBackend, 1>::from_floats(flags.as_slice(), device);
    let sum: Vec<f32> = slot
        .collective
        .all_reduce_sum(slot.rank, flags)?
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 flags");
    comm.allreduce_bytes += (present.len() * 4) as u64;
    comm.allreduce_secs += t.elapsed().as_secs_f64();
    Ok(sum.iter().map(|&p| p > 0.0).collect())
}

/// The sum over the group's ranks of every rank's `grads` of `module` (`sharding = "none"`).
pub fn all_reduce<B, M>(
    module: &M,
    grads: GradientsParams,
    slot: &RankSlot<B::InnerBackend>,
    comm: &mut CommStats,
) -> Result<GradientsParams>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let (mut flat, sizes) = take_flat::<B, M>(module, grads);
    let Some(device) = module.devices().first().cloned() else {
        return Ok(GradientsParams::new());
    };
    let present: Vec<bool> = flat.iter().map(Option::is_some).collect();
    let t = Instant::now();
    let mut sums: Vec<Option<Flat<B>>> = (0..sizes.len()).map(|_| None).collect();
    for bucket in bucket_ranges(&sizes, limit(slot), |_| true) {
        let parts: Vec<Flat<B>> = bucket
            .iter()
            .map(|&i| or_zeros::<B>(&mut flat, i, sizes[i], &device))
            .collect();
        let sum = slot
            .collective
            .all_reduce_sum(slot.rank, Tensor::cat(parts, 0))?;
        let lens = bucket.iter().map(|&i| sizes[i]);
        for (&i, span) in bucket.iter().zip(spans(lens)) {
            sums[i] = Some(sum.clone().slice(span));
        }
        comm.allreduce_bytes += bucket.iter().map(|&i| sizes[i] * 4).sum::<usize>() as u64;
    }
    comm.allreduce_secs += t.elapsed().as_secs_f64();
    let anywhere = any_rank::<B>(&present, slot, &device, comm)?;
    for (s, keep) in sums.iter_mut().zip(anywhere) {
        if !keep {
            *s = None;
        }
    }
    Ok(restore::<B, M>(module, sums))
}

/// The members of `bucket` in the order its buffer holds them: owner by owner, rank 0 first
/// (parameter order within an owner), and each rank's element count.
fn by_owner(bucket: &[usize], sizes: &[usize], layout: &ShardLayout) -> (Vec<usize>, Vec<usize>) {
    let mut order = bucket.to_vec();
    order.sort_by_key(|&i| layout.owner(i));
    let mut counts = vec![0usize; layout.world()];
    for &i in &order {
        counts[layout.owner(i)] += sizes[i];
    }
    (order, counts)
}

/// Reduce-scatters the gradients `flat` (one entry per parameter, `None` where this rank has
/// none) over the parameters in `include` (the same on every rank): entry `i` of the result is
/// the sum over ranks of parameter `i`'s gradient when this rank owns it and it is included
/// (zeros count), `None` otherwise.
pub fn reduce_scatter<B: AutodiffBackend>(
    mut flat: Vec<Option<Flat<B>>>,
    include: &[bool],
    device: &burn::tensor::Device<B::InnerBackend>,
    slot: &RankSlot<B::InnerBackend>,
    layout: &ShardLayout,
    comm: &mut CommStats,
) -> Result<Vec<Option<Flat<B>>>> {
    let sizes = layout.sizes();
    let mut mine: Vec<Option<Flat<B>>> = (0..sizes.len()).map(|_| None).collect();
    let t = Instant::now();
    for bucket in bucket_ranges(sizes, limit(slot), |i| include[i]) {
        let (order, counts) = by_owner(&bucket, sizes, layout);
        let parts: Vec<Flat<B>> = order
            .iter()
            .map(|&i| or_zeros::<B>(&mut flat, i, sizes[i], device))
            .collect();
        let sum = slot
            .collective
            .reduce_scatter_sum(slot.rank, Tensor::cat(parts, 0), &counts)?;
        comm.reduce_scatter_bytes += (counts.iter().sum::<usize>() * 4) as u64;
        let Some(sum) = sum else { continue };
        let owned: Vec<usize> = order
            .into_iter()
            .filter(|&i| layout.owner(i) == slot.rank)
            .collect();
        let lens = owned.iter().map(|&i| sizes[i]);
        for (&i, span) in owned.iter().zip(spans(lens)) {
            mine[i] = Some(sum.clone().slice(span));
        }
    }
    comm.reduce_scatter_secs += t.elapsed().as_secs_f64();
    Ok(mine)
}

/// Every float parameter's value, flattened in f32, in the module's order.
struct Values<B: AutodiffBackend> {
    wanted: Vec<bool>,
    at: usize,
    out: Vec<Option<Flat<B>>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Values<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let v = self.wanted[self.at].then(|| {
            let numel = param.lazy_shape().num_elements();
            param.val().inner().reshape([numel]).cast(DType::F32)
        });
        self.out.push(v);
        self.at += 1;
    }
}

/// The values (flattened, f32) of the parameters of `module` flagged in `wanted`, by index.
pub fn owned_values<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    wanted: Vec<bool>,
) -> Vec<Option<Flat<B>>> {
    let mut v = Values::<B> {
        wanted,
        at: 0,
        out: Vec::new(),
    };
    module.visit(&mut v);
    v.out
}

/// All-gathers one bucket of parameters from their owners: this rank sends its own (`own`,
/// by index), every rank gets every member. Returns each member's index and whole value.
pub fn gather_bucket<B: AutodiffBackend>(
    bucket: &[usize],
    own: &[Option<Flat<B>>],
    slot: &RankSlot<B::InnerBackend>,
    layout: &ShardLayout,
    device: &burn::tensor::Device<B::InnerBackend>,
    comm: &mut CommStats,
) -> Result<Vec<(usize, Flat<B>)>> {
    let sizes = layout.sizes();
    let (order, counts) = by_owner(bucket, sizes, layout);
    let mine: Vec<Flat<B>> = order
        .iter()
        .filter(|&&i| layout.owner(i) == slot.rank)
        .map(|&i| own[i].clone().expect("an owner holds its parameters"))
        .collect();
    let part = (!mine.is_empty()).then(|| Tensor::cat(mine, 0));
    let whole = slot
        .collective
        .all_gather_parts(slot.rank, part, &counts, device)?;
    comm.all_gather_bytes += (counts[slot.rank] * 4) as u64;
    let lens = order.iter().map(|&i| sizes[i]);
    Ok(order
        .iter()
        .zip(spans(lens))
        .map(|(&i, span)| (i, whole.clone().slice(span)))
        .collect())
}

/// Replaces the parameters that have an entry with it (shaped as `shapes` says, else as the
/// parameter; cast as the parameter).
struct Replace<'a, B: AutodiffBackend> {
    with: Vec<Option<Flat<B>>>,
    shapes: Option<&'a [Vec<usize>]>,
    at: usize,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Replace<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let i = self.at;
        let entry = self.with[i].take();
        self.at += 1;
        let Some(v) = entry else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let (shape, dtype) = match self.shapes {
            Some(shapes) => (burn::tensor::Shape::from(shapes[i].clone()), tensor.dtype()),
            None => (tensor.shape(), tensor.dtype()),
        };
        drop(tensor);
        let inner = v.reshape(shape);
        let inner = if inner.dtype() == dtype {
            inner
        } else {
            inner.cast(dtype)
        };
        Param::from_mapped_value(id, Tensor::from_inner(inner).require_grad(), mapper)
    }
}

/// `module` with every parameter that has an entry in `with` (flattened) replaced by it,
/// shaped as `shapes` says (a placeholder takes the whole shape it stands for).
pub fn replace_shaped<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: M,
    with: Vec<Option<Flat<B>>>,
    shapes: &[Vec<usize>],
) -> M {
    module.map(&mut Replace::<B> {
        with,
        shapes: Some(shapes),
        at: 0,
    })
}

/// After the owners' updates: every parameter in `updated` gathered from its owner, so every
/// rank holds the same weights again (the owner's own values too come from the gathered bucket:
/// the replicas are the same bits, and no parameter is held twice). The module takes each
/// bucket's parameters as soon as the bucket arrives, so the old and the new copy of at most one
/// bucket coexist. Returns the new module.
pub fn all_gather_weights<B, M>(
    mut module: M,
    updated: &[bool],
    slot: &RankSlot<B::InnerBackend>,
    layout: &ShardLayout,
    comm: &mut CommStats,
) -> Result<M>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let Some(device) = module.devices().first().cloned() else {
        return Ok(module);
    };
    let sizes = layout.sizes();
    let t = Instant::now();
    for bucket in bucket_ranges(sizes, limit(slot), |i| updated[i]) {
        let mut wanted = vec![false; sizes.len()];
        for &i in bucket.iter().filter(|&&i| layout.owner(i) == slot.rank) {
            wanted[i] = true;
        }
        let own = owned_values(&module, wanted);
        let mut with: Vec<Option<Flat<B>>> = (0..sizes.len()).map(|_| None).collect();
        for (i, v) in gather_bucket::<B>(&bucket, &own, slot, layout, &device, comm)? {
            with[i] = Some(v);
        }
        module = module.map(&mut Replace::<B> {
            with,
            shapes: None,
            at: 0,
        });
    }
    comm.all_gather_secs += t.elapsed().as_secs_f64();
    Ok(module)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_consecutive_parameters_within_the_limit() {
        let sizes = [3, 4, 10, 1, 1, 2];
        assert_eq!(
            bucket_ranges(&sizes, 8, |_| true),
            vec![vec![0, 1], vec![2], vec![3, 4, 5]]
        );
        assert_eq!(
            bucket_ranges(&sizes, 8, |i| i != 1),
            vec![vec![0], vec![2], vec![3, 4, 5]]
        );
    }

    #[test]
    fn a_bucket_is_laid_out_owner_by_owner() {
        let sizes = [5, 1, 1, 5];
        let layout = ShardLayout::balanced(&sizes, 2);
        let (order, counts) = by_owner(&[0, 1, 2, 3], &sizes, &layout);
        assert_eq!(counts.iter().sum::<usize>(), 12);
        let owners: Vec<usize> = order.iter().map(|&i| layout.owner(i)).collect();
        assert!(owners.windows(2).all(|w| w[0] <= w[1]), "{owners:?}");
    }
}
