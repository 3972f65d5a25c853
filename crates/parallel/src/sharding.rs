//! Sharded data parallel ([`Sharding`]): which rank owns which parameter, and the gradient sum
//! of an optimizer step when each rank keeps its own parameters' part.
//!
//! Ownership is by whole parameter tensors ([`ShardLayout::balanced`]): largest first, each to
//! the rank with the fewest bytes so far, so every rank owns about `1/N` of the bytes (the
//! largest tensor, a tied embedding, bounds the imbalance). An owner keeps its parameters'
//! AdamW moments (burn's AdamW makes state only for parameters that get a gradient, and a rank
//! gets gradients for its own only) and, with `gradients`, their running gradient sum.
//!
//! An optimizer step of a sharded rank ([`ShardedSum`]):
//! 1. gradients are reduce-scattered: once per optimizer step (`optimizer`), or each piece as
//!    the backward makes it (`gradients`: a layer's with activation checkpointing; ranks with
//!    fewer micro-batches send zeros, so every rank makes the same calls), over the parameters
//!    the piece holds ([`ShardedSum`]);
//! 2. the global gradient norm is the square root of the per-parameter squared norms, each
//!    computed by its owner and summed in parameter order, as one device sums them;
//! 3. the owner clips and steps its parameters; the updated weights are all-gathered
//!    ([`crate::buckets::all_gather_weights`]).
//!
//! With `full` a rank keeps only its own parameters ([`release`]: the others become one-element
//! placeholders with the same ids) and step 3 gathers nothing. Whole values come back through
//! [`RankGather`] (a [`ParamGather`]: all-gathers of the asked parameters, bucket by bucket):
//! the whole policy at the start of a step for its rollouts and old log-probabilities, one
//! segment at a time in the backward (`Policy::backward` into `Gradients::Gathered`). Between steps the
//! group assembles the whole policy from its ranks on the host side ([`Assembly`]) for
//! checkpoints, exports and validation.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use burn::module::{AutodiffModule, Module, ModuleMapper, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};

pub use conrub_contracts::Sharding;

use conrub_contracts::{GatheredParam, ParamGather};

use crate::buckets::{
    bucket_ranges, gather_bucket, limit, owned_values, reduce_scatter, restore, take_flat, Flat,
};
use crate::error::Result;
pub use crate::layout::{param_ids, CommStats, ShardLayout};
use crate::rank::RankSlot;
use crate::sum::fixed_order_sum;

/// What a rank puts first in the exchange before each reduce-scatter of a sharded step.
const PIECE: f64 = 1.0;
/// A rank's backward pass has handed over all its pieces.
const END: f64 = 0.0;
/// A rank has no backward pass of its own this round (fewer micro-batches than another).
const IDLE: f64 = 2.0;

/// An optimizer step's gradient sum on a sharded rank: the reduced sums of the parameters it
/// owns, and which parameters any rank had a gradient for so far.
///
/// Before each reduce-scatter the ranks exchange which parameters their piece holds (one flag
/// each, on the host): the reduce-scatter covers their union only, so a layer's piece moves that
/// layer's gradients, not the model's. With `gradients`, a rank that has no pass of its own in a
/// round ([`ShardedSum::idle_pass`]) joins each of the others' reduce-scatters with zeros until
/// they say the pass ended ([`ShardedSum::end_pass`]).
pub struct ShardedSum<B: AutodiffBackend> {
    owned: Vec<Option<Flat<B>>>,
    anywhere: Vec<bool>,
}

impl<B: AutodiffBackend> Default for ShardedSum<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: AutodiffBackend> ShardedSum<B> {
    /// An empty sum.
    pub fn new() -> Self {
        Self {
            owned: Vec::new(),
            anywhere: Vec::new(),
        }
    }

    /// Sizes the sums for `n` parameters on first use.
    fn sized(&mut self, n: usize) {
        if self.owned.is_empty() {
            self.owned = (0..n).map(|_| None).collect();
            self.anywhere = vec![false; n];
        }
    }

    /// Reduce-scatters `grads` (one piece of this rank's backward pass, or the whole optimizer
    /// step's sum; empty for a rank with nothing to add) and adds this rank's sums in.
    pub fn add<M: AutodiffModule<B>>(
        &mut self,
        module: &M,
        grads: GradientsParams,
        slot: &RankSlot<B::InnerBackend>,
        layout: &ShardLayout,
        comm: &mut CommStats,
    ) -> Result<()> {
        let (flat, _) = take_flat::<B, M>(module, grads);
        let mut message = vec![PIECE];
        message.extend(flat.iter().map(|g| f64::from(u8::from(g.is_some()))));
        let all = slot.collective.all_gather(slot.rank, message)?;
        let union = union_of(&all, layout.sizes().len())?;
        let device = module.devices().first().cloned().unwrap_or_default();
        self.scatter(flat, &union, &device, slot, layout, comm)
    }

    /// After this rank's backward pass handed over its last piece.
    pub fn end_pass(&self, slot: &RankSlot<B::InnerBackend>) -> Result<()> {
        slot.collective.all_gather(slot.rank, vec![END])?;
        Ok(())
    }

    /// A round without a pass of this rank's own: zeros for every piece the others reduce,
    /// until they end their pass.
    pub fn idle_pass<M: AutodiffModule<B>>(
        &mut self,
        module: &M,
        slot: &RankSlot<B::InnerBackend>,
        layout: &ShardLayout,
        comm: &mut CommStats,
    ) -> Result<()> {
        let n = layout.sizes().len();
        let device = module.devices().first().cloned().unwrap_or_default();
        loop {
            let all = slot.collective.all_gather(slot.rank, vec![IDLE])?;
            if all.iter().any(|m| m[0] == END) {
                return Ok(());
            }
            let union = union_of(&all, n)?;
            let flat = (0..n).map(|_| None).collect();
            self.scatter(flat, &union, &device, slot, layout, comm)?;
        }
    }

    /// The reduce-scatter of `flat` over the parameters in `union`, added into this rank's sums.
    fn scatter(
        &mut self,
        flat: Vec<Option<Flat<B>>>,
        union: &[bool],
        device: &burn::tensor::Device<B::InnerBackend>,
        slot: &RankSlot<B::InnerBackend>,
        layout: &ShardLayout,
        comm: &mut CommStats,
    ) -> Result<()> {
        self.sized(layout.sizes().len());
        let mine = reduce_scatter::<B>(flat, union, device, slot, layout, comm)?;
        for (acc, new) in self.owned.iter_mut().zip(mine) {
            *acc = match (acc.take(), new) {
                (Some(a), Some(b)) => Some(a + b),
                (a, b) => a.or(b),
            };
        }
        for (a, u) in self.anywhere.iter_mut().zip(union) {
            *a |= u;
        }
        Ok(())
    }

    /// The step's gradients of the parameters this rank owns, where any rank had one, their
    /// global norm (`[1]`, f32, as one device computes it from the same sums), and which
    /// parameters any rank had a gradient for.
    pub fn finish<M: AutodiffModule<B>>(
        mut self,
        module: &M,
        slot: &RankSlot<B::InnerBackend>,
        layout: &ShardLayout,
    ) -> Result<(GradientsParams, Tensor<B::InnerBackend, 1>, Vec<bool>)> {
        self.sized(layout.sizes().len());
        let device = module.devices().first().cloned().unwrap_or_default();
        let norm = global_norm::<B>(&self.owned, &self.anywhere, slot, layout, &device)?;
        Ok((restore::<B, M>(module, self.owned), norm, self.anywhere))
    }
}

/// The parameters any rank's piece holds, from an exchange's messages (`PIECE` and one flag per
/// parameter; `IDLE` ranks hold none). Ranks that disagree on whether a pass goes on (`PIECE`
/// beside `END`) made different backward passes: an error, not a hang.
fn union_of(messages: &[Vec<f64>], n: usize) -> Result<Vec<bool>> {
    let mut union = vec![false; n];
    let (pieces, ends) = messages.iter().fold((0, 0), |(p, e), m| {
        (p + usize::from(m[0] == PIECE), e + usize::from(m[0] == END))
    });
    if pieces > 0 && ends > 0 {
        return Err(crate::error::ParallelError::Stage(
            "sharded ranks' backward passes hand over different pieces (one rank ended its pass \
             while another sent a piece)"
                .into(),
        ));
    }
    for m in messages.iter().filter(|m| m[0] == PIECE) {
        for (u, &bit) in union.iter_mut().zip(&m[1..]) {
            *u |= bit > 0.0;
        }
    }
    Ok(union)
}

/// The global L2 norm of the step's gradients: each owner's per-parameter squared norms
/// (fixed-order sums), gathered, laid out in parameter order and summed as
/// [`crate::update::global_grad_norm`] does on one device.
fn global_norm<B: AutodiffBackend>(
    owned: &[Option<Flat<B>>],
    anywhere: &[bool],
    slot: &RankSlot<B::InnerBackend>,
    layout: &ShardLayout,
    device: &burn::tensor::Device<B::InnerBackend>,
) -> Result<Tensor<B::InnerBackend, 1>> {
    let squares: Vec<Tensor<B::InnerBackend, 1>> = owned
        .iter()
        .flatten()
        .map(|g| fixed_order_sum(g.clone().cast(DType::F32).square()))
        .collect();
    let mine: Vec<f64> = if squares.is_empty() {
        Vec::new()
    } else {
        Tensor::cat(squares, 0)
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("f32 squares")
            .into_iter()
            .map(f64::from)
            .collect()
    };
    let all = slot.collective.all_gather(slot.rank, mine)?;
    let mut next = vec![0usize; layout.world()];
    let mut ordered: Vec<f32> = Vec::new();
    for (i, &any) in anywhere.iter().enumerate() {
        if any {
            let r = layout.owner(i);
            ordered.push(all[r][next[r]] as f32);
            next[r] += 1;
        }
    }
    if ordered.is_empty() {
        return Ok(Tensor::<B::InnerBackend, 1>::zeros([1], device).cast(DType::F32));
    }
    Ok(
        Tensor::<B::InnerBackend, 1>::from_floats(ordered.as_slice(), device)
            .cast(DType::F32)
            .sum()
            .sqrt(),
    )
}

/// `module` with the parameters `rank` does not own replaced by placeholders (one element of
/// the parameter's dtype, same id and gradient flag): a `sharding = "full"` rank at rest. Their
/// whole values come back through [`RankGather`] when a segment runs.
pub fn release<B: Backend, M: Module<B>>(module: M, layout: &ShardLayout, rank: usize) -> M {
    struct Release<'a> {
        layout: &'a ShardLayout,
        rank: usize,
        at: usize,
    }
    impl<B: Backend> ModuleMapper<B> for Release<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let i = self.at;
            self.at += 1;
            if self.layout.owner(i) == self.rank {
                return param;
            }
            let require_grad = param.is_require_grad();
            let (id, value, mapper) = param.consume();
            let (device, dtype) = (value.device(), value.dtype());
            drop(value);
            let mut placeholder = Tensor::<B, D>::zeros([1; D], &device);
            if placeholder.dtype() != dtype {
                placeholder = placeholder.cast(dtype);
            }
            if require_grad {
                placeholder = placeholder.require_grad();
            }
            Param::from_mapped_value(id, placeholder, mapper)
        }
    }
    module.map(&mut Release {
        layout,
        rank,
        at: 0,
    })
}

/// Position of every float parameter of `module` by id.
pub fn index_of<B: Backend, M: Module<B>>(module: &M) -> HashMap<ParamId, usize> {
    param_ids(module)
        .into_iter()
        .enumerate()
        .map(|(i, (id, _))| (id, i))
        .collect()
}

/// The indices of `ids` in `index`; an unknown id is an error (a module that is not the policy).
fn positions(
    index: &HashMap<ParamId, usize>,
    ids: &[ParamId],
) -> conrub_contracts::Result<Vec<usize>> {
    ids.iter()
        .map(|id| {
            index.get(id).copied().ok_or_else(|| {
                conrub_contracts::ContractError::Stage(format!(
                    "gathering parameter {id}, which the sharded policy does not have"
                ))
            })
        })
        .collect()
}

/// A `sharding = "full"` rank's source of whole parameters: each request is all-gathered from
/// the owners bucket by bucket (this rank sends the ones it owns).
pub struct RankGather<'a, B: AutodiffBackend> {
    slot: &'a RankSlot<B::InnerBackend>,
    layout: &'a ShardLayout,
    index: HashMap<ParamId, usize>,
    own: Vec<Option<Flat<B>>>,
    device: burn::tensor::Device<B::InnerBackend>,
    matrices: Option<DType>,
    /// Bytes sent and seconds spent.
    pub comm: CommStats,
}

impl<'a, B: AutodiffBackend> RankGather<'a, B> {
    /// Gathers for the rank of `slot`, whose released policy is `module`.
    pub fn new<M: AutodiffModule<B>>(
        module: &M,
        slot: &'a RankSlot<B::InnerBackend>,
        layout: &'a ShardLayout,
    ) -> Self {
        Self {
            slot,
            layout,
            index: index_of(module),
            own: owned_values(module, layout.owned_flags(slot.rank)),
            device: module.devices().first().cloned().unwrap_or_default(),
            matrices: None,
            comm: CommStats::default(),
        }
    }

    /// Weight matrices come back cast to `matrices` (when set), each bucket as it arrives, so
    /// the whole f32 weights never exist at once: at most one f32 bucket beside the cast ones.
    pub fn casting(mut self, matrices: Option<DType>) -> Self {
        self.matrices = matrices;
        self
    }
}

impl<B: AutodiffBackend> ParamGather<B> for RankGather<'_, B> {
    fn gather(&mut self, ids: &[ParamId]) -> conrub_contracts::Result<Vec<GatheredParam<B>>> {
        let at = positions(&self.index, ids)?;
        let n = self.layout.sizes().len();
        let mut include = vec![false; n];
        for &i in &at {
            include[i] = true;
        }
        let t = Instant::now();
        let mut got: Vec<Option<Flat<B>>> = (0..n).map(|_| None).collect();
        for bucket in bucket_ranges(self.layout.sizes(), limit(self.slot), |i| include[i]) {
            let members = gather_bucket::<B>(
                &bucket,
                &self.own,
                self.slot,
                self.layout,
                &self.device,
                &mut self.comm,
            )
            .map_err(|e| conrub_contracts::ContractError::Stage(e.to_string()))?;
            for (i, v) in members {
                got[i] = Some(narrowed::<B>(v, self.layout.shape(i), self.matrices));
            }
        }
        self.comm.all_gather_secs += t.elapsed().as_secs_f64();
        Ok(at
            .into_iter()
            .map(|i| GatheredParam {
                values: got[i].take().expect("every asked parameter was gathered"),
                shape: self.layout.shape(i).to_vec(),
            })
            .collect())
    }
}

/// A gathered parameter (a slice of its bucket) on its own: a matrix cast to `matrices`, a
/// vector copied, so the bucket's f32 buffer goes once its members are taken. Without
/// `matrices`, the slice as it is.
fn narrowed<B: AutodiffBackend>(v: Flat<B>, shape: &[usize], matrices: Option<DType>) -> Flat<B> {
    match matrices {
        None => v,
        Some(dtype) if shape.len() >= 2 => v.cast(dtype),
        Some(_) => {
            let device = v.device();
            Tensor::from_data(v.into_data(), &device)
        }
    }
}

/// The whole policy of a `sharding = "full"` group assembled on the host side from every rank's
/// own parameters (moved to one device), for what runs outside a step: checkpoints, exports,
/// validation. No collective: the ranks are this process's.
pub struct Assembly<B: AutodiffBackend> {
    index: HashMap<ParamId, usize>,
    values: Vec<Option<Flat<B>>>,
    layout: Arc<ShardLayout>,
}

impl<B: AutodiffBackend> Assembly<B> {
    /// Every rank's own parameters (`modules`, rank order; the first names the ids) on `device`,
    /// weight matrices cast to `matrices` (when set) on their owner's device before they move.
    pub fn new<M: AutodiffModule<B>>(
        modules: &[&M],
        layout: Arc<ShardLayout>,
        device: &burn::tensor::Device<B::InnerBackend>,
        matrices: Option<DType>,
    ) -> Self {
        let n = layout.sizes().len();
        let mut values: Vec<Option<Flat<B>>> = (0..n).map(|_| None).collect();
        for (rank, module) in modules.iter().enumerate() {
            let owned = layout.owned_flags(rank);
            for (i, v) in owned_values(*module, owned).into_iter().enumerate() {
                if let Some(v) = v {
                    let v = match matrices {
                        Some(dtype) if layout.shape(i).len() >= 2 => v.cast(dtype),
                        _ => v,
                    };
                    values[i] = Some(v.to_device(device));
                }
            }
        }
        Self {
            index: index_of(modules[0]),
            values,
            layout,
        }
    }
}

impl<B: AutodiffBackend> ParamGather<B> for Assembly<B> {
    fn gather(&mut self, ids: &[ParamId]) -> conrub_contracts::Result<Vec<GatheredParam<B>>> {
        let at = positions(&self.index, ids)?;
        Ok(at
            .into_iter()
            .map(|i| GatheredParam {
                values: self.values[i]
                    .clone()
                    .expect("every parameter has an owner"),
                shape: self.layout.shape(i).to_vec(),
            })
            .collect())
    }
}

/// Which parameters of `module` `rank` owns: by id, and by index in the module's order.
pub fn owned_by<B: Backend, M: Module<B>>(
    module: &M,
    layout: &ShardLayout,
    rank: usize,
) -> (HashSet<ParamId>, HashSet<usize>) {
    param_ids(module)
        .into_iter()
        .enumerate()
        .filter(|(i, _)| layout.owner(*i) == rank)
        .map(|(i, (id, _))| (id, i))
        .unzip()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three ranks of a two-layer module, each released to its own parameters: a gather on
    /// every rank (threads, the host collective) gives every parameter's whole value, bit for
    /// bit, and the host-side assembly the same.
    #[test]
    fn released_ranks_gather_the_whole_module() {
        use burn::backend::{Autodiff, Flex};
        use burn::nn::{Linear, LinearConfig};
        type B = Autodiff<Flex>;
        #[derive(Module, Debug)]
        struct Two<B: Backend> {
            a: Linear<B>,
            b: Linear<B>,
        }
        let device = Default::default();
        let whole = Two::<B> {
            a: LinearConfig::new(3, 5).init(&device),
            b: LinearConfig::new(5, 2).init(&device),
        };
        let values = |m: &Two<B>| -> Vec<f32> {
            owned_values::<B, _>(m, vec![true; 4])
                .into_iter()
                .flat_map(|v| v.unwrap().into_data().to_vec::<f32>().unwrap())
                .collect()
        };
        // Read first: burn initializes lazily, and a clone of an uninitialized parameter draws
        // its own values.
        let want = values(&whole);
        let world = 3;
        let layout = Arc::new(ShardLayout::of(&whole, world));
        assert_eq!(layout.shape(0), &[3, 5]);
        let collective = Arc::new(crate::HostCollective::new(world));
        let ranks: Vec<Two<B>> = (0..world)
            .map(|r| release(whole.clone(), &layout, r))
            .collect();
        let held = |m: &Two<B>| {
            param_ids(m)
                .iter()
                .map(|(_, s)| s.iter().product::<usize>())
                .sum::<usize>()
        };
        assert!(ranks.iter().all(|m| held(m) < held(&whole)));
        std::thread::scope(|s| {
            for (r, m) in ranks.iter().enumerate() {
                let (layout, collective, want) = (&layout, collective.clone(), &want);
                s.spawn(move || {
                    let slot = RankSlot {
                        rank: r,
                        collective,
                        bucket_bytes: 24,
                        sharding: Sharding::Full,
                        layout: Some(layout.clone()),
                    };
                    let mut source = RankGather::new(m, &slot, layout);
                    let got = conrub_contracts::gathered(m, &mut source).unwrap();
                    assert_eq!(&values(&got), want, "rank {r}");
                    assert!(source.comm.all_gather_bytes > 0);
                    // Cast as each bucket arrives: matrices bf16, vectors f32.
                    let bf16 = Some(DType::BF16);
                    let mut source = RankGather::new(m, &slot, layout).casting(bf16);
                    let got = conrub_contracts::gathered_as(m, &mut source, bf16).unwrap();
                    assert_eq!(got.b.weight.val().dtype(), DType::BF16);
                    assert_eq!(got.b.bias.as_ref().unwrap().val().dtype(), DType::F32);
                });
            }
        });
        let refs: Vec<&Two<B>> = ranks.iter().collect();
        let mut parts = Assembly::<B>::new(&refs, layout.clone(), &device, None);
        let got = conrub_contracts::gathered(refs[0], &mut parts).unwrap();
        assert_eq!(values(&got), want);
        // Assembled with bf16 matrices (an export in bf16): weights bf16, biases f32.
        let mut parts = Assembly::<B>::new(&refs, layout.clone(), &device, Some(DType::BF16));
        let got = conrub_contracts::gathered_as(refs[0], &mut parts, Some(DType::BF16)).unwrap();
        assert_eq!(got.a.weight.val().dtype(), DType::BF16);
        assert_eq!(got.a.bias.as_ref().unwrap().val().dtype(), DType::F32);
    }

    #[test]
    fn ownership_is_balanced_by_size_largest_first() {
        let l = ShardLayout::balanced(&[100, 10, 60, 50, 5, 5], 2);
        // 100 -> 0; 60 -> 1; 50 -> 1 (60 < 100); 10 -> 0 (100 < 110); 5 -> 1 ... balanced.
        assert_eq!(l.owner(0), 0);
        assert_eq!(l.owner(2), 1);
        assert_eq!(l.owner(3), 1);
        let (a, b) = (l.owned_elements(0), l.owned_elements(1));
        assert_eq!(a + b, 230);
        assert!(a.abs_diff(b) <= 10, "{a} vs {b}");
        // More ranks than parameters: some own nothing, none owns twice while another is empty.
        let l = ShardLayout::balanced(&[4, 4], 3);
        assert_eq!((l.owner(0), l.owner(1)), (0, 1));
        assert_eq!(l.owned_elements(2), 0);
    }
}
