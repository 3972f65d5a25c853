//! What data-parallel ranks share during a step: the gradient all-reduce (one per optimizer step,
//! over flattened buckets), the reduce-scatter and all-gather of sharded runs
//! ([`crate::Sharding`]), and a few host numbers (response lengths, metric sums).
//!
//! [`Collective`] is the interface; [`HostCollective`] is the implementation for ranks that are
//! threads of one process on any backend (the CPU backends, wgpu, or a CUDA device without NCCL):
//! every rank's bucket goes to the host and is combined there in rank order, so a run is
//! reproducible bit for bit. A rank that fails calls [`Collective::abort`]; every rank waiting in
//! (or later entering) a collective then returns an error naming it, so no rank waits forever.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::error::{ParallelError, Result};

/// The collectives of one group of data-parallel ranks (`rank` is `0..world_size()`; every rank
/// makes the same calls in the same order).
pub trait Collective<B: Backend>: Send + Sync {
    /// Ranks in the group.
    fn world_size(&self) -> usize;

    /// The element-wise sum over ranks of `bucket` (the same length on every rank), on the
    /// device and in the dtype of `bucket`; every rank gets the same sum.
    fn all_reduce_sum(&self, rank: usize, bucket: Tensor<B, 1>) -> Result<Tensor<B, 1>>;

    /// The element-wise sum over ranks of `bucket`, of which this rank keeps its slice: the
    /// bucket is `counts[0]` elements for rank 0, then `counts[1]` for rank 1, and so on (the
    /// same `counts` on every rank). `None` when `counts[rank]` is 0.
    ///
    /// The default all-reduces the whole bucket and slices it (NCCL through CubeCL's client,
    /// which has no reduce-scatter: the same result for twice the traffic).
    fn reduce_scatter_sum(
        &self,
        rank: usize,
        bucket: Tensor<B, 1>,
        counts: &[usize],
    ) -> Result<Option<Tensor<B, 1>>> {
        let sum = self.all_reduce_sum(rank, bucket)?;
        let start: usize = counts[..rank].iter().sum();
        // A copy of this rank's slice (a view would keep the whole bucket alive): `sum` is
        // still held while it is made, so the product cannot be done in place.
        let mine = (counts[rank] > 0).then(|| {
            sum.clone()
                .slice(start..start + counts[rank])
                .mul_scalar(1.0)
        });
        drop(sum);
        Ok(mine)
    }

    /// Every rank's `part` concatenated in rank order: rank `r` gives `counts[r]` elements
    /// (`None` for none), every rank gets the whole, on `device` in f32.
    ///
    /// The default all-reduces a zero buffer holding this rank's part at its place (the same
    /// values, as `x + 0 = x`, for twice the traffic of an all-gather).
    fn all_gather_parts(
        &self,
        rank: usize,
        part: Option<Tensor<B, 1>>,
        counts: &[usize],
        device: &B::Device,
    ) -> Result<Tensor<B, 1>> {
        let total: usize = counts.iter().sum();
        let start: usize = counts[..rank].iter().sum();
        let mut pieces = Vec::with_capacity(3);
        if start > 0 {
            pieces.push(Tensor::<B, 1>::zeros([start], device));
        }
        if let Some(p) = part {
            pieces.push(p.cast(burn::tensor::DType::F32));
        }
        let end = start + counts[rank];
        if end < total {
            pieces.push(Tensor::<B, 1>::zeros([total - end], device));
        }
        self.all_reduce_sum(rank, Tensor::cat(pieces, 0))
    }

    /// Every rank's `values`, in rank order.
    fn all_gather(&self, rank: usize, values: Vec<f64>) -> Result<Vec<Vec<f64>>>;

    /// Marks the group failed because of `rank`'s `error`: every collective call, waiting or
    /// future, returns [`ParallelError::RankFailed`] naming `rank`.
    fn abort(&self, rank: usize, error: &str);
}

/// One rendezvous of all ranks: each deposits a payload, the last to arrive combines them, and
/// every rank of the round gets the combined value.
struct Rendezvous<T, R> {
    world: usize,
    timeout: Duration,
    state: Mutex<Round<T, R>>,
    wake: Condvar,
}

struct Round<T, R> {
    /// Rounds completed.
    round: u64,
    slots: Vec<Option<T>>,
    arrived: usize,
    /// The combined value of round `round - 1`, until every waiting rank has taken it.
    last: Option<Arc<R>>,
    /// Ranks of round `round - 1` that have yet to take `last`.
    waiting: usize,
    /// `(rank, error)` of the first rank that failed.
    aborted: Option<(usize, String)>,
}

impl<T, R> Rendezvous<T, R> {
    fn new(world: usize, timeout: Duration) -> Self {
        Self {
            world,
            timeout,
            state: Mutex::new(Round {
                round: 0,
                slots: (0..world).map(|_| None).collect(),
                arrived: 0,
                last: None,
                waiting: 0,
                aborted: None,
            }),
            wake: Condvar::new(),
        }
    }

    fn failed(rank: usize, error: &str) -> ParallelError {
        ParallelError::RankFailed {
            rank,
            message: error.to_string(),
        }
    }

    /// Deposits `payload` for `rank` and returns the round's combined value.
    fn exchange(
        &self,
        rank: usize,
        payload: T,
        combine: impl FnOnce(Vec<T>) -> R,
    ) -> Result<Arc<R>> {
        assert!(rank < self.world, "rank {rank} of {}", self.world);
        let mut s = self.state.lock().expect("collective state");
        if let Some((r, e)) = &s.aborted {
            return Err(Self::failed(*r, e));
        }
        let round = s.round;
        debug_assert!(
            s.slots[rank].is_none(),
            "rank {rank} entered round {round} twice"
        );
        s.slots[rank] = Some(payload);
        s.arrived += 1;
        if s.arrived == self.world {
            let all: Vec<T> = s
                .slots
                .iter_mut()
                .map(|p| p.take().expect("every rank"))
                .collect();
            let out = Arc::new(combine(all));
            s.last = (self.world > 1).then(|| out.clone());
            s.waiting = self.world - 1;
            s.arrived = 0;
            s.round += 1;
            self.wake.notify_all();
            return Ok(out);
        }
        let deadline = Instant::now() + self.timeout;
        while s.round == round {
            if let Some((r, e)) = &s.aborted {
                return Err(Self::failed(*r, e));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<usize> =
                    (0..self.world).filter(|&r| s.slots[r].is_none()).collect();
                return Err(ParallelError::CollectiveTimeout {
                    rank,
                    secs: self.timeout.as_secs_f64(),
                    missing,
                });
            }
            s = self.wake.wait_timeout(s, left).expect("collective state").0;
        }
        // The last rank to take the value lets it go (a round's buffer is not held until the
        // next round of its kind).
        s.waiting -= 1;
        let out = if s.waiting == 0 {
            s.last.take()
        } else {
            s.last.clone()
        };
        Ok(out.expect("a completed round has a value"))
    }

    fn abort(&self, rank: usize, error: &str) {
        let mut s = self.state.lock().expect("collective state");
        if s.aborted.is_none() {
            s.aborted = Some((rank, error.to_string()));
        }
        self.wake.notify_all();
    }
}

/// [`Collective`] for ranks that are threads of one process: buckets are summed on the host, in
/// rank order (bit-reproducible on every backend). A rank that has not arrived after `timeout`
/// makes the waiting ranks fail with [`ParallelError::CollectiveTimeout`] naming it.
pub struct HostCollective {
    reduce: Rendezvous<Vec<f32>, Vec<f32>>,
    parts: Rendezvous<Vec<f32>, Vec<f32>>,
    gather: Rendezvous<Vec<f64>, Vec<Vec<f64>>>,
}

impl HostCollective {
    /// How long a rank waits for the others in one collective unless told otherwise: an hour,
    /// since ranks meet after rollouts and judging, which may differ by minutes; a failing rank
    /// aborts the group at once instead.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3600);

    /// A group of `world` ranks.
    pub fn new(world: usize) -> Self {
        Self::with_timeout(world, Self::DEFAULT_TIMEOUT)
    }

    /// A group of `world` ranks whose waits end after `timeout`.
    pub fn with_timeout(world: usize, timeout: Duration) -> Self {
        assert!(world > 0, "a collective of no ranks");
        Self {
            reduce: Rendezvous::new(world, timeout),
            parts: Rendezvous::new(world, timeout),
            gather: Rendezvous::new(world, timeout),
        }
    }
}

impl<B: Backend> Collective<B> for HostCollective {
    fn world_size(&self) -> usize {
        self.reduce.world
    }

    fn all_reduce_sum(&self, rank: usize, bucket: Tensor<B, 1>) -> Result<Tensor<B, 1>> {
        let (device, dtype) = (bucket.device(), bucket.dtype());
        let sum = self
            .reduce
            .exchange(rank, to_host(bucket)?, sum_in_rank_order)?;
        Ok(to_device::<B>(sum.as_ref().clone(), &device, dtype))
    }

    fn reduce_scatter_sum(
        &self,
        rank: usize,
        bucket: Tensor<B, 1>,
        counts: &[usize],
    ) -> Result<Option<Tensor<B, 1>>> {
        let (device, dtype) = (bucket.device(), bucket.dtype());
        let host = to_host(bucket)?;
        assert_eq!(
            host.len(),
            counts.iter().sum::<usize>(),
            "reduce-scatter counts"
        );
        let sum = self.reduce.exchange(rank, host, sum_in_rank_order)?;
        let start: usize = counts[..rank].iter().sum();
        let mine = &sum[start..start + counts[rank]];
        Ok((!mine.is_empty()).then(|| to_device::<B>(mine.to_vec(), &device, dtype)))
    }

    fn all_gather_parts(
        &self,
        rank: usize,
        part: Option<Tensor<B, 1>>,
        counts: &[usize],
        device: &B::Device,
    ) -> Result<Tensor<B, 1>> {
        let host = match part {
            Some(p) => to_host(p)?,
            None => Vec::new(),
        };
        assert_eq!(host.len(), counts[rank], "all-gather part of rank {rank}");
        let whole = self.parts.exchange(rank, host, |all| all.concat())?;
        Ok(to_device::<B>(
            whole.as_ref().clone(),
            device,
            burn::tensor::DType::F32,
        ))
    }

    fn all_gather(&self, rank: usize, values: Vec<f64>) -> Result<Vec<Vec<f64>>> {
        Ok(self
            .gather
            .exchange(rank, values, |all| all)?
            .as_ref()
            .clone())
    }

    fn abort(&self, rank: usize, error: &str) {
        self.reduce.abort(rank, error);
        self.parts.abort(rank, error);
        self.gather.abort(rank, error);
    }
}

/// A bucket's values on the host, as f32.
fn to_host<B: Backend>(bucket: Tensor<B, 1>) -> Result<Vec<f32>> {
    bucket
        .into_data()
        .convert::<f32>()
        .into_vec()
        .map_err(|e| ParallelError::Stage(format!("collective readback: {e:?}")))
}

/// `values` on `device` in `dtype`.
fn to_device<B: Backend>(
    values: Vec<f32>,
    device: &B::Device,
    dtype: burn::tensor::DType,
) -> Tensor<B, 1> {
    let n = values.len();
    let t = Tensor::<B, 1>::from_data(TensorData::new(values, [n]), device);
    if t.dtype() == dtype {
        t
    } else {
        t.cast(dtype)
    }
}

/// The element-wise sum of every rank's bucket, rank 0 first.
fn sum_in_rank_order(all: Vec<Vec<f32>>) -> Vec<f32> {
    let n = all[0].len();
    let mut out = vec![0f32; n];
    for part in &all {
        assert_eq!(part.len(), n, "buckets of different lengths");
        for (o, x) in out.iter_mut().zip(part) {
            *o += *x;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    type B = burn::backend::Flex;

    fn on_ranks<T: Send>(world: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let f = &f;
            let hs: Vec<_> = (0..world).map(|r| s.spawn(move || f(r))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn sums_in_rank_order_and_gathers_in_rank_order() {
        let c = HostCollective::new(3);
        let out = on_ranks(3, |r| {
            let mut sums = Vec::new();
            for round in 0..4 {
                let t = Tensor::<B, 1>::from_floats(
                    [r as f32 + 1.0, round as f32, 0.1 * r as f32],
                    &Default::default(),
                );
                let s = Collective::<B>::all_reduce_sum(&c, r, t).unwrap();
                sums.push(s.into_data().convert::<f32>().into_vec::<f32>().unwrap());
                let g = Collective::<B>::all_gather(&c, r, vec![r as f64, round as f64]).unwrap();
                assert_eq!(
                    g,
                    (0..3)
                        .map(|q| vec![q as f64, round as f64])
                        .collect::<Vec<_>>()
                );
            }
            sums
        });
        let want = |round: usize| vec![6.0f32, 3.0 * round as f32, 0.0 + 0.1 + 0.2];
        for sums in &out {
            for (round, s) in sums.iter().enumerate() {
                assert_eq!(s, &want(round), "round {round}");
            }
        }
    }

    /// Only the required methods, delegating to a host collective: what NCCL's collective
    /// gets, so its reduce-scatter and all-gather are the trait's defaults over all-reduce.
    struct AllReduceOnly(HostCollective);

    impl Collective<B> for AllReduceOnly {
        fn world_size(&self) -> usize {
            Collective::<B>::world_size(&self.0)
        }
        fn all_reduce_sum(&self, rank: usize, bucket: Tensor<B, 1>) -> Result<Tensor<B, 1>> {
            self.0.all_reduce_sum(rank, bucket)
        }
        fn all_gather(&self, rank: usize, values: Vec<f64>) -> Result<Vec<Vec<f64>>> {
            Collective::<B>::all_gather(&self.0, rank, values)
        }
        fn abort(&self, rank: usize, error: &str) {
            Collective::<B>::abort(&self.0, rank, error)
        }
    }

    fn host(t: Tensor<B, 1>) -> Vec<f32> {
        t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
    }

    /// Reduce-scatter and all-gather on 3 ranks, the host's own and the defaults over
    /// all-reduce (NCCL's), give the same values: each rank its slice of the sum (none for a
    /// rank owning nothing), every rank every part in rank order.
    #[test]
    fn reduce_scatter_and_all_gather_agree_with_their_all_reduce_defaults() {
        let counts = [2usize, 0, 3];
        let host_c = HostCollective::new(3);
        let fallback = AllReduceOnly(HostCollective::new(3));
        let cs: [&dyn Collective<B>; 2] = [&host_c, &fallback];
        for c in cs {
            let out = on_ranks(3, |r| {
                let dev = Default::default();
                let bucket: Vec<f32> = (0..5).map(|i| (r * 10 + i) as f32).collect();
                let t = Tensor::<B, 1>::from_floats(bucket.as_slice(), &dev);
                let mine = c.reduce_scatter_sum(r, t, &counts).unwrap().map(host);
                let part: Vec<f32> = (0..counts[r]).map(|i| (100 * r + i) as f32).collect();
                let part =
                    (!part.is_empty()).then(|| Tensor::<B, 1>::from_floats(part.as_slice(), &dev));
                let whole = host(c.all_gather_parts(r, part, &counts, &dev).unwrap());
                (mine, whole)
            });
            // Column i of the sum: (0 + 10 + 20) + 3i.
            let sum: Vec<f32> = (0..5).map(|i| 30.0 + 3.0 * i as f32).collect();
            assert_eq!(out[0].0.as_deref(), Some(&sum[0..2]));
            assert_eq!(out[1].0, None);
            assert_eq!(out[2].0.as_deref(), Some(&sum[2..5]));
            for (_, whole) in &out {
                assert_eq!(whole, &vec![0.0, 1.0, 200.0, 201.0, 202.0]);
            }
        }
    }

    #[test]
    fn an_abort_wakes_every_waiting_rank_with_the_failing_rank() {
        let c = HostCollective::new(3);
        let started = Instant::now();
        let out = on_ranks(3, |r| {
            if r == 2 {
                std::thread::sleep(Duration::from_millis(50));
                Collective::<B>::abort(&c, 2, "out of memory");
                return None;
            }
            Some(
                Collective::<B>::all_gather(&c, r, vec![1.0])
                    .unwrap_err()
                    .to_string(),
            )
        });
        assert!(started.elapsed() < Duration::from_secs(5));
        for e in out.into_iter().flatten() {
            assert!(e.contains("rank 2") && e.contains("out of memory"), "{e}");
        }
    }

    #[test]
    fn a_rank_that_never_comes_is_a_timeout_naming_it() {
        let c = HostCollective::with_timeout(2, Duration::from_millis(100));
        let e = Collective::<B>::all_gather(&c, 0, vec![1.0])
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 1"), "{e}");
    }
}
