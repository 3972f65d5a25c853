//! `conrub allreduce-check`: the data-parallel collectives on a group of devices. Every rank
//! fills buckets of `--mb` MiB with its own values, the backend's collective (NCCL between CUDA
//! devices, the host one elsewhere) sums them (all-reduce, and reduce-scatter then all-gather as
//! a sharded run does), and the results are checked against the host collective on the same
//! buckets (exactly for the host one; within f32 rounding for NCCL). It
//! prints bytes per rank, seconds and GB/s of both, as `scripts/gpu-check.sh` reports them.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Result};
use burn::tensor::{Tensor, TensorData};
use clap::Args;
use conrub_kernels::reference::seeded_uniform;
use conrub_parallel::{Collective, HostCollective};

use crate::backend::{run_on_devices, DevicesTask, RankCollective};

/// Arguments of `allreduce-check`.
#[derive(Args, Clone)]
pub struct AllreduceArgs {
    /// The ranks' devices, all of one backend: `cuda:0,cuda:1` (`cpu,cpu` simulates two ranks).
    #[arg(long, value_delimiter = ',', default_value = "cpu,cpu")]
    pub devices: Vec<String>,
    /// MiB of f32 values per bucket.
    #[arg(long, default_value_t = 64.0)]
    pub mb: f64,
    /// Buckets per round (one optimizer step's all-reduce).
    #[arg(long, default_value_t = 4)]
    pub buckets: usize,
    /// Timed rounds after one warm-up (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub iters: usize,
}

/// One round on every rank: each bucket all-reduced, and reduce-scattered then all-gathered;
/// returns every rank's results (sum, gathered sum, per bucket) as host f32.
fn round<B: burn::tensor::backend::Backend>(
    collective: &Arc<dyn Collective<B>>,
    devices: &[B::Device],
    inputs: &[Vec<Vec<f32>>],
) -> Result<Vec<Vec<Vec<f32>>>> {
    let world = devices.len();
    std::thread::scope(|s| {
        let threads: Vec<_> = devices
            .iter()
            .zip(inputs)
            .enumerate()
            .map(|(rank, (device, buckets))| {
                let collective = collective.clone();
                s.spawn(move || -> Result<Vec<Vec<f32>>> {
                    let tensors: Vec<Tensor<B, 1>> = buckets
                        .iter()
                        .map(|b| Tensor::from_data(TensorData::new(b.clone(), [b.len()]), device))
                        .collect();
                    let mut out = Vec::with_capacity(2 * tensors.len());
                    for t in tensors {
                        // The all-reduce, then the same bucket reduce-scattered over the ranks
                        // in equal parts and gathered back (a sharded run's two collectives):
                        // both must give the sum.
                        let n = t.dims()[0];
                        let counts: Vec<usize> = (0..world)
                            .map(|r| n / world + usize::from(r < n % world))
                            .collect();
                        let sum = collective.all_reduce_sum(rank, t.clone())?;
                        let mine = collective.reduce_scatter_sum(rank, t, &counts)?;
                        let whole = collective.all_gather_parts(rank, mine, &counts, device)?;
                        for t in [sum, whole] {
                            out.push(t.into_data().convert::<f32>().into_vec().expect("f32"));
                        }
                    }
                    Ok(out)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("no panic"))
            .collect()
    })
}

impl DevicesTask for AllreduceArgs {
    fn run<B: RankCollective>(self, devices: Vec<B::Device>) -> Result<()> {
        let world = devices.len();
        let n = ((self.mb * (1 << 20) as f64) as usize / 4).max(1);
        let inputs: Vec<Vec<Vec<f32>>> = (0..world)
            .map(|r| {
                (0..self.buckets)
                    .map(|b| seeded_uniform(n, (r * 1000 + b) as u64, 1.0))
                    .collect()
            })
            .collect();
        let host: Arc<dyn Collective<B>> = Arc::new(HostCollective::new(world));
        let backend = B::rank_collective(&devices);
        let mut report = Vec::new();
        let mut results = Vec::new();
        for (name, c) in [("backend", &backend), ("host", &host)] {
            round::<B>(c, &devices, &inputs)?;
            let mut secs = Vec::new();
            let mut last = Vec::new();
            for _ in 0..self.iters.max(1) {
                let t = Instant::now();
                last = round::<B>(c, &devices, &inputs)?;
                secs.push(t.elapsed().as_secs_f64());
            }
            secs.sort_by(f64::total_cmp);
            let s = secs[secs.len() / 2];
            // The all-reduce's bucket, the reduce-scatter's bucket and the all-gather's part.
            let bytes = ((2 * n + n.div_ceil(world)) * 4 * self.buckets) as f64;
            report.push(format!(
                "{name} collective (all-reduce, reduce-scatter, all-gather): {world} ranks, {:.1} MB per rank per round, {:.4} s, {:.2} GB/s per rank",
                bytes / 1e6,
                s,
                bytes / s / 1e9
            ));
            results.push(last);
        }
        // Every rank holds the same sums, and the backend's equal the host's.
        let mut worst = 0f32;
        for ranks in &results {
            for r in ranks {
                for (a, b) in r.iter().flatten().zip(results[1][0].iter().flatten()) {
                    worst = worst.max((a - b).abs());
                }
            }
        }
        for l in &report {
            outln!("{l}");
        }
        // The gathered reduce-scatter equals the all-reduce on every rank.
        let mut split = 0f32;
        for ranks in &results {
            for r in ranks {
                for pair in r.chunks(2) {
                    for (a, b) in pair[0].iter().zip(&pair[1]) {
                        split = split.max((a - b).abs());
                    }
                }
            }
        }
        outln!("max |backend - host| over every rank's results: {worst:.3e}");
        outln!("max |all-gathered reduce-scatter - all-reduce|: {split:.3e}");
        ensure!(
            worst <= 1e-5 * world as f32,
            "the backend's collectives differ from the host's by {worst:e}"
        );
        ensure!(
            split <= 1e-5 * world as f32,
            "reduce-scatter + all-gather differs from the all-reduce by {split:e}"
        );
        Ok(())
    }
}

/// `conrub allreduce-check`.
pub fn run(args: AllreduceArgs) -> Result<()> {
    let devices = args.devices.clone();
    run_on_devices(&devices, args)
}
