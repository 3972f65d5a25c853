//! The gradient path of a rank: where each backward pass's gradients go, what a rank with fewer
//! passes than the others does meanwhile, and how an optimizer step's sum is reduced before the
//! step and the weights shared after it. The learner picks its path once, when it is built
//! ([`GradientPath::of`]), and calls it; it never asks which sharding mode it is in.
//!
//! | path | sharding | each backward | before the step | after the step |
//! |---|---|---|---|---|
//! | [`GradientPath::Local`] | one device | added into a running sum | nothing | nothing |
//! | [`GradientPath::AllReduce`] | `none` | added into a running sum | bucketed all-reduce | nothing |
//! | [`GradientPath::ScatterAtStep`] | `optimizer` | added into a running sum | reduce-scatter to owners | owners' weights all-gathered |
//! | [`GradientPath::ScatterEach`] | `gradients` | each piece reduce-scattered | nothing | owners' weights all-gathered |
//! | [`GradientPath::GatheredLayers`] | `full` | layers gathered, pieces reduce-scattered | nothing | nothing (each keeps its own) |

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use conrub_contracts::{Gradients, Policy, ResponseLogprobs, TokenBatch};

use crate::buckets;
use crate::error::Result;
use crate::rank::RankSlot;
use crate::sharding::{CommStats, RankGather, ShardLayout, ShardedSum};

/// Where a rank's gradients go (see the module's table). Cheap to clone: a slot is a few `Arc`s.
#[derive(Clone)]
pub enum GradientPath<B: AutodiffBackend> {
    /// A learner on one device: a running sum, no collective.
    Local,
    /// A replica of a group that shards nothing: a running sum, all-reduced in buckets.
    AllReduce(RankSlot<B::InnerBackend>),
    /// `sharding = "optimizer"`: a running sum, reduce-scattered to the owners at the step.
    ScatterAtStep(RankSlot<B::InnerBackend>),
    /// `sharding = "gradients"`: each backward piece reduce-scattered as it is made.
    ScatterEach(RankSlot<B::InnerBackend>),
    /// `sharding = "full"`: whole layers gathered for each backward, pieces reduce-scattered;
    /// a rank keeps only its own parameters.
    GatheredLayers(RankSlot<B::InnerBackend>),
}

/// An optimizer step's gradients so far, as the path keeps them: this rank's running sum, or
/// its reduced part of the group's sum.
pub struct StepSum<B: AutodiffBackend> {
    local: GradientsParams,
    sharded: ShardedSum<B>,
}

/// An optimizer step's reduced gradients: the parameters this rank steps, the global norm when
/// the path computed it across ranks (a sharded sum; otherwise the optimizer takes the norm of
/// `grads`), and which parameters any rank had a gradient for (what the step changes).
pub struct Reduced<B: AutodiffBackend> {
    /// The gradients this rank applies.
    pub grads: GradientsParams,
    /// The global gradient norm (`[1]`, f32) of a sharded sum.
    pub norm: Option<Tensor<B::InnerBackend, 1>>,
    updated: Vec<bool>,
}

impl<B: AutodiffBackend> GradientPath<B> {
    /// The path of a learner in `slot` (none: one device).
    pub fn of(slot: Option<RankSlot<B::InnerBackend>>) -> Self {
        let Some(slot) = slot else {
            return Self::Local;
        };
        let sharding = slot.sharding;
        match slot.sharded() {
            None => Self::AllReduce(slot),
            Some(_) if sharding.shards_parameters() => Self::GatheredLayers(slot),
            Some(_) if sharding.shards_gradients() => Self::ScatterEach(slot),
            Some(_) => Self::ScatterAtStep(slot),
        }
    }

    /// An empty sum for the next optimizer step.
    pub fn begin(&self) -> StepSum<B> {
        StepSum {
            local: GradientsParams::new(),
            sharded: ShardedSum::new(),
        }
    }

    /// The backward passes this rank makes in a round where it has `passes` of its own: as many,
    /// or, when every pass is a collective call, the most any rank has (one host exchange); the
    /// difference is made of [`GradientPath::idle_pass`]es.
    pub fn rounds(&self, passes: usize) -> Result<usize> {
        match self {
            Self::ScatterEach(slot) | Self::GatheredLayers(slot) => {
                let all = slot.collective.all_gather(slot.rank, vec![passes as f64])?;
                Ok(all.iter().map(|v| v[0] as usize).max().unwrap_or(passes))
            }
            _ => Ok(passes),
        }
    }

    /// The gradients of `loss` on `tokens` through `policy`, into `sum`.
    pub fn backward<P>(
        &self,
        policy: &P,
        tokens: &TokenBatch<B>,
        loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>,
        sum: &mut StepSum<B>,
        comm: &mut CommStats,
    ) -> Result<()>
    where
        P: Policy<B> + AutodiffModule<B>,
    {
        let (slot, gathered) = match self {
            Self::Local | Self::AllReduce(_) | Self::ScatterAtStep(_) => {
                return Ok(policy.backward(tokens, loss, Gradients::Sum(&mut sum.local))?);
            }
            Self::ScatterEach(slot) => (slot, false),
            Self::GatheredLayers(slot) => (slot, true),
        };
        let layout = layout_of(slot);
        let sharded = &mut sum.sharded;
        let mut failed = None;
        let mut source_comm = CommStats::default();
        let mut scatter = |piece| {
            if failed.is_none() {
                failed = sharded.add(policy, piece, slot, layout, comm).err();
            }
        };
        let done = if gathered {
            let mut source = RankGather::new(policy, slot, layout);
            let into = Gradients::Gathered {
                pieces: &mut scatter,
                source: &mut source,
            };
            let done = policy.backward(tokens, loss, into);
            source_comm = source.comm;
            done
        } else {
            policy.backward(tokens, loss, Gradients::Pieces(&mut scatter))
        };
        comm.add(&source_comm);
        match (failed, done) {
            (Some(e), _) => Err(e),
            (None, Err(e)) => Err(e.into()),
            (None, Ok(())) => sum.sharded.end_pass(slot),
        }
    }

    /// A round in which this rank has no backward pass of its own (fewer than another rank):
    /// it joins the others' reduce-scatters with zeros. A `full` rank instead runs a backward
    /// pass of zero loss on one token, since the others' passes gather each layer from every
    /// rank, this one included, in the same order. Nothing to do on the other paths.
    pub fn idle_pass<P>(
        &self,
        policy: &P,
        device: &B::Device,
        sum: &mut StepSum<B>,
        comm: &mut CommStats,
    ) -> Result<()>
    where
        P: Policy<B> + AutodiffModule<B>,
    {
        match self {
            Self::GatheredLayers(_) => {
                let one = TokenBatch::<B>::bucketed([(&[0u32][..], &[0u32][..])], device);
                let mut zero = |lp: ResponseLogprobs<B>| lp.logprobs.sum() * 0.0;
                self.backward(policy, &one, &mut zero, sum, comm)
            }
            Self::ScatterEach(slot) => {
                let layout = layout_of(slot);
                sum.sharded.idle_pass(policy, slot, layout, comm)
            }
            _ => Ok(()),
        }
    }

    /// The optimizer step's sum reduced over the group as the path says: this rank's own
    /// (one device), all-reduced (replicas), or this rank's owned part with the global norm.
    pub fn reduce<M: AutodiffModule<B>>(
        &self,
        module: &M,
        sum: StepSum<B>,
        comm: &mut CommStats,
    ) -> Result<Reduced<B>> {
        let StepSum { local, mut sharded } = sum;
        let slot = match self {
            Self::Local => return Ok(Reduced::whole(local)),
            Self::AllReduce(slot) => {
                return Ok(Reduced::whole(buckets::all_reduce(
                    module, local, slot, comm,
                )?));
            }
            Self::ScatterAtStep(slot) => {
                let layout = layout_of(slot);
                sharded.add(module, local, slot, layout, comm)?;
                slot
            }
            Self::ScatterEach(slot) | Self::GatheredLayers(slot) => slot,
        };
        let layout = layout_of(slot);
        let (grads, norm, updated) = sharded.finish(module, slot, layout)?;
        Ok(Reduced {
            grads,
            norm: Some(norm),
            updated,
        })
    }

    /// After the optimizer applied `reduced` to `module` (`stepped`: it did; a step skipped for
    /// a non-finite norm changed nothing): on `optimizer` and `gradients` ranks, every rank's
    /// updated parameters are all-gathered from their owners, so each holds the whole policy.
    pub fn share_updated<M: AutodiffModule<B>>(
        &self,
        module: M,
        reduced: &Reduced<B>,
        stepped: bool,
        comm: &mut CommStats,
    ) -> Result<M> {
        match self {
            Self::ScatterAtStep(slot) | Self::ScatterEach(slot) if stepped => {
                let layout = layout_of(slot);
                buckets::all_gather_weights(module, &reduced.updated, slot, layout, comm)
            }
            _ => Ok(module),
        }
    }
}

impl<B: AutodiffBackend> Reduced<B> {
    /// Gradients of every parameter, whose norm the optimizer takes.
    fn whole(grads: GradientsParams) -> Self {
        Self {
            grads,
            norm: None,
            updated: Vec::new(),
        }
    }
}

/// The layout of a sharded path's slot (`GradientPath::of` picks a sharded path only for a slot
/// that has one).
fn layout_of<B: burn::tensor::backend::Backend>(slot: &RankSlot<B>) -> &ShardLayout {
    slot.sharded().expect("a sharded path's slot has a layout")
}
