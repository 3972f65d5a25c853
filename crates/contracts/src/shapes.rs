//! The shapes a run's kernels see, drawn from small documented sets so that a run's compiled
//! kernels and autotune keys are finite and a long run stops compiling early (padding to the
//! bucket, masked as before):
//!
//! - [`bucket_len`]: sequence lengths (the engine's prefill, left-padded under a key mask; the
//!   learner's micro-batch widths, right-padded under the causal and response masks);
//! - [`bucket_rows`]: the rows of a decode step (extra rows decode a dummy token into a scratch
//!   block and are dropped before sampling);
//! - [`attended_blocks`]: the KV blocks a decode step reads per row.

/// Length buckets: 16 and below pad to 16; above, 8 sizes per doubling (a multiple of
/// `next_power_of_two(n) / 16`: 18, 20, .., 32, 36, .., 64, 72, .., 2048, 2304, ..), at most 12.5%
/// of padding. 81 buckets cover every length up to 16,384.
pub fn bucket_len(n: usize) -> usize {
    if n <= 16 {
        return 16;
    }
    let step = n.next_power_of_two() / 16;
    n.div_ceil(step) * step
}

/// Row-count buckets of a decode step: powers of two up to 8, then multiples of 8 (at most 7
/// dummy rows; 35 sizes up to 256 rows).
pub fn bucket_rows(n: usize) -> usize {
    if n <= 8 {
        return n.max(1).next_power_of_two();
    }
    n.next_multiple_of(8)
}

/// Blocks a decode step reads per row when its longest row has `blocks`: rounded up to a power
/// of two up to 8, then to a multiple of a sixteenth of the next power of two (at most 12.5% more
/// than needed), so a run sees a bounded number of attention shapes (8 per doubling of length).
pub fn attended_blocks(blocks: usize) -> usize {
    if blocks <= 8 {
        return blocks.max(1).next_power_of_two();
    }
    blocks.next_multiple_of(blocks.next_power_of_two() / 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_buckets_are_few_and_pad_little() {
        assert_eq!(bucket_len(1), 16);
        assert_eq!(bucket_len(16), 16);
        assert_eq!(bucket_len(17), 18);
        assert_eq!(bucket_len(33), 36);
        assert_eq!(bucket_len(2048), 2048);
        assert_eq!(bucket_len(2049), 2304);
        assert_eq!(bucket_len(8192 + 256), 9216);
        let mut buckets = std::collections::BTreeSet::new();
        for n in 1..=16_384usize {
            let b = bucket_len(n);
            assert!(b >= n && bucket_len(b) == b, "{n} -> {b}");
            assert!(n <= 16 || (b - n) * 8 <= n, "{n} -> {b}");
            buckets.insert(b);
        }
        assert_eq!(buckets.len(), 81);
    }

    #[test]
    fn row_buckets() {
        assert_eq!(
            (1..=10).map(bucket_rows).collect::<Vec<_>>(),
            vec![1, 2, 4, 4, 8, 8, 8, 8, 16, 16]
        );
        assert_eq!((bucket_rows(17), bucket_rows(255)), (24, 256));
        let sizes: std::collections::BTreeSet<_> = (1..=256).map(bucket_rows).collect();
        assert_eq!(sizes.len(), 35);
    }

    #[test]
    fn attended_lengths_come_in_a_few_sizes() {
        assert_eq!(
            (1..=8).map(attended_blocks).collect::<Vec<_>>(),
            vec![1, 2, 4, 4, 8, 8, 8, 8]
        );
        assert_eq!(
            (
                attended_blocks(9),
                attended_blocks(10),
                attended_blocks(17),
                attended_blocks(576)
            ),
            (9, 10, 18, 576)
        );
        for b in 1..5000 {
            let a = attended_blocks(b);
            assert!(
                a >= b && (b <= 8 || a as f64 <= b as f64 * 1.125 + 1.0),
                "{b} -> {a}"
            );
        }
        let sizes: std::collections::BTreeSet<usize> = (1..=1024).map(attended_blocks).collect();
        assert!(sizes.len() <= 4 + 8 * 7, "{}", sizes.len());
    }
}
