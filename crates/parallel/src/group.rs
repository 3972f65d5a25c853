//! A data-parallel group in one process: a worker per device (in conrub, a learner), the
//! group's collective, how a step's prompt groups are split over the ranks, the run of every
//! rank on a thread of its own with the failing rank's own error, and the check that replicas
//! did not drift. What a rank does in a step is the worker's business (`conrub_grpo`'s
//! `DataParallel` makes its learners one).

use std::future::Future;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::collective::Collective;
use crate::error::{ParallelError, Result};
use crate::threads::on_rank_threads;

/// The ranks of a group, rank 0 first, and the collective they share.
pub struct RankGroup<W, B: Backend> {
    ranks: Vec<W>,
    collective: Arc<dyn Collective<B>>,
}

impl<W: Send, B: Backend> RankGroup<W, B> {
    /// A group of `ranks` (rank `i` at index `i`) over `collective`, which must have as many.
    pub fn new(ranks: Vec<W>, collective: Arc<dyn Collective<B>>) -> Result<Self> {
        if ranks.len() != collective.world_size() {
            return Err(ParallelError::Stage(format!(
                "{} ranks for a collective of {}",
                ranks.len(),
                collective.world_size()
            )));
        }
        Ok(Self { ranks, collective })
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// Every rank's worker, rank 0 first.
    pub fn ranks(&self) -> &[W] {
        &self.ranks
    }

    /// Every rank's worker, mutably (between collective calls: no rank is running).
    pub fn ranks_mut(&mut self) -> &mut [W] {
        &mut self.ranks
    }

    /// Runs `work(rank, worker, item)` for every rank at once, each on a thread of its own
    /// (rank `i` gets `items[i]`), and returns the outputs in rank order. A rank that fails or
    /// panics aborts the collective, so the others stop at their next collective call; the
    /// error returned is that rank's own, not the "rank r failed" of the ranks it stopped.
    pub fn run<'a, I, O, E, F, Fut>(
        &'a mut self,
        items: Vec<I>,
        work: F,
    ) -> std::result::Result<Vec<O>, E>
    where
        I: Send,
        O: Send,
        E: Send + std::fmt::Display + From<ParallelError>,
        F: Fn(usize, &'a mut W, I) -> Fut + Sync,
        Fut: Future<Output = std::result::Result<O, E>>,
    {
        let collective = &self.collective;
        let first_failed = Mutex::new(None);
        let abort = |rank: usize, message: &str| {
            first_failed
                .lock()
                .expect("no rank panics while holding it")
                .get_or_insert(rank);
            collective.abort(rank, message);
        };
        let pairs: Vec<(&'a mut W, I)> = self.ranks.iter_mut().zip(items).collect();
        let results = on_rank_threads(
            pairs,
            |rank, (worker, item)| work(rank, worker, item),
            &abort,
        );
        let first = first_failed
            .into_inner()
            .expect("no rank panics while holding it");
        own_error(results, first)
    }
}

/// Every rank's output, or the error of rank `first` (the first to fail), else the first error.
fn own_error<O, E>(
    results: Vec<std::result::Result<O, E>>,
    first: Option<usize>,
) -> std::result::Result<Vec<O>, E> {
    if results.iter().all(|r| r.is_ok()) {
        return Ok(results
            .into_iter()
            .map(|r| r.ok().expect("checked"))
            .collect());
    }
    let own = first.filter(|&r| results.get(r).is_some_and(|r| r.is_err()));
    let mut errors: Vec<(usize, E)> = results
        .into_iter()
        .enumerate()
        .filter_map(|(rank, r)| r.err().map(|e| (rank, e)))
        .collect();
    let at = own
        .and_then(|own| errors.iter().position(|(rank, _)| *rank == own))
        .unwrap_or(0);
    Err(errors.swap_remove(at).1)
}

/// Contiguous group ranges of `groups` over `world` ranks; the first `groups % world` ranks take
/// one more.
pub fn split_groups(groups: usize, world: usize) -> Vec<Range<usize>> {
    let (base, extra) = (groups / world, groups % world);
    let mut start = 0;
    (0..world)
        .map(|r| {
            let n = base + usize::from(r < extra);
            let range = start..start + n;
            start += n;
            range
        })
        .collect()
}

/// Compares a checksum of every replica's parameters (rank 0 first) with rank 0's; a difference
/// is an error naming the rank that drifted.
pub fn check_replicas<B: Backend, M: Module<B>>(replicas: &[&M]) -> Result<()> {
    let sums: Vec<u64> = replicas.iter().map(|m| checksum(*m)).collect();
    match sums.iter().position(|s| *s != sums[0]) {
        None => Ok(()),
        Some(rank) => Err(ParallelError::Stage(format!(
            "rank {rank}'s parameters differ from rank 0's (checksum {:016x} vs {:016x})",
            sums[rank], sums[0]
        ))),
    }
}

/// FNV-1a over the bits of every float parameter, in the module's order.
fn checksum<B: Backend, M: Module<B>>(module: &M) -> u64 {
    struct Sum(u64);
    impl<B: Backend> ModuleVisitor<B> for Sum {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            for x in data.iter::<f32>() {
                for b in x.to_bits().to_le_bytes() {
                    self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
                }
            }
        }
    }
    let mut s = Sum(0xcbf2_9ce4_8422_2325);
    module.visit(&mut s);
    s.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostCollective;
    use burn::backend::Flex;

    #[test]
    fn groups_split_contiguously_with_the_remainder_first() {
        assert_eq!(split_groups(5, 2), vec![0..3, 3..5]);
        assert_eq!(split_groups(5, 3), vec![0..2, 2..4, 4..5]);
        assert_eq!(split_groups(2, 3), vec![0..1, 1..2, 2..2]);
    }

    #[test]
    fn a_failing_rank_stops_the_others_and_its_own_error_is_returned() {
        let collective: Arc<dyn Collective<Flex>> = Arc::new(HostCollective::new(3));
        let mut group = RankGroup::new(vec![0usize; 3], collective.clone()).unwrap();
        // Ranks 0 and 2 wait in an all-gather that rank 1 never joins: it fails instead, and
        // they stop with "rank 1 failed"; the group returns rank 1's own error.
        let out = group.run(vec![(); 3], |rank, runs, ()| {
            let collective = collective.clone();
            async move {
                *runs += 1;
                if rank == 1 {
                    return Err(ParallelError::Stage("rank one's own error".into()));
                }
                collective.all_gather(rank, vec![rank as f64])?;
                Ok(rank)
            }
        });
        let err = out.map(|_| ()).unwrap_err().to_string();
        assert_eq!(err, "stage output: rank one's own error");
        assert_eq!(group.ranks(), &[1, 1, 1]);

        let fresh: Arc<dyn Collective<Flex>> = Arc::new(HostCollective::new(2));
        let mut group = RankGroup::new(vec![10usize, 20], fresh).unwrap();
        let out: Result<Vec<usize>> =
            group.run(vec![1, 2], |rank, w, x| async move { Ok(*w + x + rank) });
        assert_eq!(out.unwrap(), vec![11, 23]);
    }

    #[test]
    fn replicas_that_drifted_are_named() {
        let device = Default::default();
        let replica =
            |w: f32| Param::from_tensor(Tensor::<Flex, 2>::from_floats([[1.0, w]], &device));
        let (a, b) = (replica(2.0), replica(2.0));
        assert!(check_replicas(&[&a, &b]).is_ok());
        let c = replica(2.5);
        let err = check_replicas(&[&a, &b, &c]).unwrap_err().to_string();
        assert!(
            err.contains("rank 2's parameters differ from rank 0's"),
            "{err}"
        );
    }
}
