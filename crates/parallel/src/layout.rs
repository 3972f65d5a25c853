//! Who owns which parameter of a sharded group ([`ShardLayout`]), and what a rank's collectives
//! moved in a step ([`CommStats`]): the plain data the sharded paths, the buckets and a rank's
//! slot share.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// The owner of every float parameter of a policy, in the module's parameter order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    owners: Vec<usize>,
    sizes: Vec<usize>,
    shapes: Vec<Vec<usize>>,
    world: usize,
}

impl ShardLayout {
    /// Parameters of `sizes` elements (all of one dtype, so elements stand for bytes) over
    /// `world` ranks: largest first (the earlier parameter first on equal sizes), each to the
    /// rank owning the fewest elements so far (the lower rank on equal loads).
    pub fn balanced(sizes: &[usize], world: usize) -> Self {
        let shapes: Vec<Vec<usize>> = sizes.iter().map(|&n| vec![n]).collect();
        Self::of_shapes(&shapes, world)
    }

    /// [`ShardLayout::balanced`] of parameters with these shapes.
    pub fn of_shapes(shapes: &[Vec<usize>], world: usize) -> Self {
        assert!(world > 0, "a layout over no ranks");
        let sizes: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
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
            sizes,
            shapes: shapes.to_vec(),
            world,
        }
    }

    /// [`ShardLayout::balanced`] over the float parameters of `module` (whole, not released).
    pub fn of<B: Backend, M: Module<B>>(module: &M, world: usize) -> Self {
        let shapes: Vec<Vec<usize>> = param_ids(module).into_iter().map(|(_, s)| s).collect();
        Self::of_shapes(&shapes, world)
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

    /// The shape of parameter `i`.
    pub fn shape(&self, i: usize) -> &[usize] {
        &self.shapes[i]
    }

    /// Elements `rank` owns.
    pub fn owned_elements(&self, rank: usize) -> usize {
        self.owned(rank).map(|i| self.sizes[i]).sum()
    }

    /// The parameters `rank` owns, by index, in parameter order.
    pub fn owned(&self, rank: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.owners.len()).filter(move |&i| self.owners[i] == rank)
    }

    /// One flag per parameter: whether `rank` owns it.
    pub fn owned_flags(&self, rank: usize) -> Vec<bool> {
        self.owners.iter().map(|&o| o == rank).collect()
    }
}

/// Every float parameter's id and shape, in the module's parameter order.
pub fn param_ids<B: Backend, M: Module<B>>(module: &M) -> Vec<(ParamId, Vec<usize>)> {
    struct Ids(Vec<(ParamId, Vec<usize>)>);
    impl<B: Backend> ModuleVisitor<B> for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push((param.id, param.lazy_shape().to_vec()));
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// Bytes a rank put into each collective kind during a step, and the seconds it spent there.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommStats {
    pub allreduce_bytes: u64,
    pub allreduce_secs: f64,
    pub reduce_scatter_bytes: u64,
    pub reduce_scatter_secs: f64,
    pub all_gather_bytes: u64,
    pub all_gather_secs: f64,
}

impl CommStats {
    /// Adds `other`'s bytes and seconds.
    pub fn add(&mut self, other: &CommStats) {
        self.allreduce_bytes += other.allreduce_bytes;
        self.allreduce_secs += other.allreduce_secs;
        self.reduce_scatter_bytes += other.reduce_scatter_bytes;
        self.reduce_scatter_secs += other.reduce_scatter_secs;
        self.all_gather_bytes += other.all_gather_bytes;
        self.all_gather_secs += other.all_gather_secs;
    }

    /// Each collective kind's larger bytes and seconds of `self` and `other` (the busiest rank's,
    /// over a step's ranks).
    pub fn busiest(self, other: CommStats) -> CommStats {
        CommStats {
            allreduce_bytes: self.allreduce_bytes.max(other.allreduce_bytes),
            allreduce_secs: self.allreduce_secs.max(other.allreduce_secs),
            reduce_scatter_bytes: self.reduce_scatter_bytes.max(other.reduce_scatter_bytes),
            reduce_scatter_secs: self.reduce_scatter_secs.max(other.reduce_scatter_secs),
            all_gather_bytes: self.all_gather_bytes.max(other.all_gather_bytes),
            all_gather_secs: self.all_gather_secs.max(other.all_gather_secs),
        }
    }
}
