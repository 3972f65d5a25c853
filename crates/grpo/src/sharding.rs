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

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};

pub use conrub_contracts::Sharding;

use crate::buckets::{reduce_scatter, restore, take_flat, Flat};
use crate::error::Result;
use crate::learner::RankSlot;
use crate::update::fixed_order_sum;

/// The owner of every float parameter of a policy, in the module's parameter order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    owners: Vec<usize>,
    sizes: Vec<usize>,
    world: usize,
}

impl ShardLayout {
    /// Parameters of `sizes` elements (all of one dtype, so elements stand for bytes) over
    /// `world` ranks: largest first (the earlier parameter first on equal sizes), each to the
    /// rank owning the fewest elements so far (the lower rank on equal loads).
    pub fn balanced(sizes: &[usize], world: usize) -> Self {
        assert!(world > 0, "a layout over no ranks");
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
        let mut load = vec![0usize; world];
        let mut owners = vec![0usize; sizes.len()];
        for i in order {
            let r = (0..world).min_by_key(|&r| (load[r], r)).expect("a rank");
            owners[i] = r;
            load[r] += sizes[i];
        }
        Self {
            owners,
            sizes: sizes.to_vec(),
            world,
        }
    }

    /// [`ShardLayout::balanced`] over the float parameters of `module`.
    pub fn of<B: Backend, M: Module<B>>(module: &M, world: usize) -> Self {
        let sizes: Vec<usize> = param_ids(module).into_iter().map(|(_, n)| n).collect();
        Self::balanced(&sizes, world)
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The rank owning parameter `i`.
    pub fn owner(&self, i: usize) -> usize {
        self.owners[i]
    }

    /// Element count of every parameter.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Elements `rank` owns.
    pub fn owned_elements(&self, rank: usize) -> usize {
        self.owners
            .iter()
            .zip(&self.sizes)
            .filter(|(o, _)| **o == rank)
            .map(|(_, n)| n)
            .sum()
    }
}

/// Every float parameter's id and element count, in the module's parameter order.
pub(crate) fn param_ids<B: Backend, M: Module<B>>(module: &M) -> Vec<(ParamId, usize)> {
    struct Ids(Vec<(ParamId, usize)>);
    impl<B: Backend> ModuleVisitor<B> for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push((param.id, param.lazy_shape().num_elements()));
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// Bytes a rank put into each collective kind during a step, and the seconds it spent there.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct CommStats {
    pub allreduce_bytes: u64,
    pub allreduce_secs: f64,
    pub reduce_scatter_bytes: u64,
    pub reduce_scatter_secs: f64,
    pub all_gather_bytes: u64,
    pub all_gather_secs: f64,
}

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
pub(crate) struct ShardedSum<B: AutodiffBackend> {
    owned: Vec<Option<Flat<B>>>,
    anywhere: Vec<bool>,
}

impl<B: AutodiffBackend> ShardedSum<B> {
    pub fn new() -> Self {
        Self {
            owned: Vec::new(),
            anywhere: Vec::new(),
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
        let n = layout.sizes().len();
        if self.owned.is_empty() {
            self.owned = (0..n).map(|_| None).collect();
            self.anywhere = vec![false; n];
        }
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
        let n = layout.sizes().len();
        if self.owned.is_empty() {
            self.owned = (0..n).map(|_| None).collect();
            self.anywhere = vec![false; n];
        }
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
        return Err(crate::error::GrpoError::Stage(
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

/// Which parameters of `module` `rank` owns, by id.
pub(crate) fn owned_ids<B: Backend, M: Module<B>>(
    module: &M,
    layout: &ShardLayout,
    rank: usize,
) -> std::collections::HashSet<ParamId> {
    param_ids(module)
        .into_iter()
        .enumerate()
        .filter(|(i, _)| layout.owner(*i) == rank)
        .map(|(_, (id, _))| id)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
