//! Seeded bootstrap standard deviations of mean scores (`conrub eval` and the learner's validation
//! rounds report them next to each score).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Standard deviation of the clipped mean over `resamples` bootstrap resamples (seeded).
pub fn bootstrap_std(scores: &[f64], resamples: usize, seed: u64) -> f64 {
    bootstrap_std_clipped(scores, resamples, seed, (0.0, 1.0))
}

/// Standard deviation over `resamples` seeded bootstrap resamples of the mean clipped to `range`.
pub fn bootstrap_std_clipped(
    scores: &[f64],
    resamples: usize,
    seed: u64,
    range: (f64, f64),
) -> f64 {
    if scores.len() < 2 || resamples < 2 {
        return 0.0;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = scores.len();
    let means: Vec<f64> = (0..resamples)
        .map(|_| {
            let s: f64 = (0..n).map(|_| scores[rng.random_range(0..n)]).sum();
            (s / n as f64).clamp(range.0, range.1)
        })
        .collect();
    let m = means.iter().sum::<f64>() / resamples as f64;
    (means.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (resamples - 1) as f64).sqrt()
}
