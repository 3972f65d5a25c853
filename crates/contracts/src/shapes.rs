//! The shapes a run's kernels see, drawn from small documented sets so that a run's compiled
//! kernels and autotune keys are finite and a long run stops compiling early (padding to the
//! bucket, masked as before):
//!
//! - [`bucket_len`]: sequence lengths (the engine's prefill, left-padded under a key mask; the
//!   learner's micro-batch widths, right-padded under the causal and response masks);
//! - [`bucket_rows`]: the rows of a decode step (extra rows decode a dummy token into a scratch
//!   block and are dropped before sampling);
//! - [`attended_blocks`]: the KV blocks a decode step reads per row.
//!
//! [`ShapeBounds`] and [`EngineShapes`] list what a run can reach of them, one shape per class
//! ([`dim_class`]): the kernel warm-up walks those lists.

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

/// The width a micro-batch of `rows` rows whose longest row is `longest` tokens is padded to:
/// its length bucket ([`bucket_len`]), but never past `max(longest, budget / rows)`, so a micro-batch
/// that the learner's micro-batch plan fits in `budget` padded tokens still fits after bucketing (the
/// memory plan counts on it). Where that cap binds, the width is `budget / rows`: one more
/// shape per row count.
pub fn padded_width(longest: usize, rows: usize, budget: usize) -> usize {
    bucket_len(longest).min((budget / rows.max(1)).max(longest))
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

/// What a dimension decides of the kernels that see it, as far as the warm-up's walk assumes:
/// its power-of-two ceiling (autotune keys anchor sizes to powers of two) and how many times 2
/// divides it, up to 16 (vector widths are chosen by divisibility). Two shapes whose dimensions
/// share their classes are taken to compile and tune alike; the lavapipe test
/// `a_demo_on_wgpu_compiles_once_and_keeps_its_kernels` checks the assumption on a run.
pub fn dim_class(n: usize) -> (usize, u32) {
    (n.max(1).next_power_of_two(), n.trailing_zeros().min(4))
}

/// One learner micro-batch's shape: its rows, its padded `prompt ++ response` width and its
/// response width (the layout `TokenBatch::slice` cuts), and the widths of the step's layout it
/// is cut from (the strides of its slices).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MicroShape {
    /// Rows.
    pub rows: usize,
    /// Token width.
    pub width: usize,
    /// Response width.
    pub responses: usize,
    /// The step layout's token width.
    pub step_width: usize,
    /// The step layout's response width.
    pub step_responses: usize,
}

/// The kinds of slice `width` columns wide cut from a layout of one of `parents`' widths: the
/// divisibility by 2 (up to 16) it keeps of the parent's stride (what a strided view's vector
/// width depends on) and whether it is a strided view at all (a narrower slice than its
/// parent), each with a parent width that gives it.
fn slice_strides(width: usize, parents: &[usize]) -> Vec<((u32, bool), usize)> {
    let mut out: Vec<((u32, bool), usize)> = Vec::new();
    for &p in parents.iter().filter(|&&p| p >= width) {
        let kind = (
            width.trailing_zeros().min(p.trailing_zeros()).min(4),
            p > width,
        );
        if !out.iter().any(|o| o.0 == kind) {
            out.push((kind, p));
        }
    }
    out
}

/// The length buckets of `lo..=hi`.
fn buckets(lo: usize, hi: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut n = lo.max(1);
    while n <= hi.max(1) {
        let b = bucket_len(n);
        out.push(b);
        n = b + 1;
    }
    out
}

/// What bounds a run's shapes: its groups, budgets and the lengths its prompts and responses
/// can take.
#[derive(Debug, Clone, PartialEq)]
pub struct ShapeBounds {
    /// Responses per prompt.
    pub group_size: usize,
    /// Padded tokens per micro-batch (`learner.micro_batch_tokens`).
    pub micro_batch_tokens: usize,
    /// The shortest and longest prompt in tokens.
    pub prompt_tokens: (usize, usize),
    /// The response limit.
    pub max_response_tokens: usize,
}

impl ShapeBounds {
    /// Every micro-batch shape a step can cut (the planner's rule: rows of one group while
    /// rows x longest fits the budget, one row at least; widths by [`padded_width`]), one per
    /// class of its dimensions and their products ([`dim_class`]).
    pub fn micro_batches(&self) -> Vec<MicroShape> {
        let (budget, g) = (self.micro_batch_tokens.max(1), self.group_size.max(1));
        let (shortest, longest) = (self.prompt_tokens.0.max(1), self.prompt_tokens.1.max(1));
        let mut classes = std::collections::BTreeMap::new();
        let mut widths = std::collections::BTreeSet::new();
        // A step's layout: the buckets of its longest sequence and longest response.
        let step_widths = buckets(shortest + 1, longest + self.max_response_tokens.max(1));
        let step_responses = buckets(1, self.max_response_tokens.max(1));
        for rows in 1..=g {
            widths.clear();
            for s in shortest + 1..=longest + self.max_response_tokens.max(1) {
                if rows > 1 && rows * s > budget {
                    break;
                }
                widths.insert(padded_width(s, rows, budget));
            }
            for &width in &widths {
                let most = self.max_response_tokens.min(width - shortest).max(1);
                let mut r = 1;
                while r <= most {
                    let responses = bucket_len(r);
                    let key =
                        [rows, width, responses, rows * width, rows * responses].map(dim_class);
                    for (ts, step_width) in slice_strides(width, &step_widths) {
                        for (tr, step_responses) in slice_strides(responses, &step_responses) {
                            let shape = MicroShape {
                                rows,
                                width,
                                responses,
                                step_width,
                                step_responses,
                            };
                            classes.insert((key, ts, tr), shape);
                        }
                    }
                    r = responses + 1;
                }
            }
        }
        let mut out: Vec<MicroShape> = classes.into_values().collect();
        out.sort();
        out
    }

    /// The response widths a whole step's batch can take (its longest response's bucket), one
    /// per class.
    pub fn step_response_widths(&self) -> Vec<usize> {
        let mut classes = std::collections::BTreeMap::new();
        let mut r = 1;
        while r <= self.max_response_tokens.max(1) {
            let width = bucket_len(r);
            classes.insert(dim_class(width), width);
            r = width + 1;
        }
        classes.into_values().collect()
    }
}

/// The rollout engine's shapes a run can reach: prefills of each prompt length, copies of a
/// prompt's partly filled last block, decode steps of each row bucket with each count of
/// attended blocks, and samplings of each row count (one per class of its dimensions,
/// [`dim_class`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineShapes {
    /// Prompt lengths to prefill (each pads to its bucket).
    pub prefills: Vec<usize>,
    /// Decode steps: rows (a row bucket) and attended blocks per row.
    pub decodes: Vec<(usize, usize)>,
    /// Rows a sampling call takes.
    pub samplings: Vec<usize>,
    /// Positions a copy of a shared, partly filled last block holds (a prompt's length modulo
    /// the block size: what the first write after the prompt copies).
    pub block_copies: Vec<usize>,
}

impl EngineShapes {
    /// For prompts of `prompt_lens` tokens, `max_new_tokens` new tokens, calls of at most
    /// `rows` sequences decoded `max_rows` at a time in blocks of `block_size` positions.
    pub fn reachable(
        prompt_lens: &[usize],
        max_new_tokens: usize,
        rows: usize,
        max_rows: usize,
        block_size: usize,
    ) -> Self {
        // A prefill of `l` tokens pads to its bucket and writes its `l` real rows.
        let mut prefills = std::collections::BTreeMap::new();
        for &l in prompt_lens {
            let b = bucket_len(l);
            prefills.insert((dim_class(b), dim_class(l), dim_class(b - l)), l);
        }
        let longest = prompt_lens.iter().copied().max().unwrap_or(1) + max_new_tokens;
        let most_rows = rows.min(max_rows).max(1);
        let mut samplings = std::collections::BTreeMap::new();
        for n in 1..=most_rows {
            samplings.insert(dim_class(n), n);
        }
        let row_buckets: std::collections::BTreeSet<usize> =
            (1..=most_rows).map(bucket_rows).collect();
        let mut blocks = std::collections::BTreeMap::new();
        for b in 1..=longest.div_ceil(block_size.max(1)).max(1) {
            let a = attended_blocks(b);
            blocks.insert((dim_class(a), dim_class(a * block_size)), a);
        }
        let mut decodes = std::collections::BTreeMap::new();
        for &r in &row_buckets {
            for &a in blocks.values() {
                decodes.insert((dim_class(r), dim_class(a), dim_class(r * a)), (r, a));
            }
        }
        let mut block_copies = std::collections::BTreeMap::new();
        for &l in prompt_lens {
            let part = l % block_size.max(1);
            if part > 0 {
                block_copies.insert(dim_class(part), part);
            }
        }
        Self {
            prefills: prefills.into_values().collect(),
            decodes: decodes.into_values().collect(),
            samplings: samplings.into_values().collect(),
            block_copies: block_copies.into_values().collect(),
        }
    }
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
    fn the_engine_walk_reaches_every_class_a_call_can() {
        let (lens, new, bs) = ([3usize, 20, 40, 41], 50, 16);
        let s = EngineShapes::reachable(&lens, new, 12, 8, bs);
        let has = |list: &[usize], x: usize| list.iter().any(|&y| dim_class(y) == dim_class(x));
        for l in lens {
            assert!(
                s.prefills
                    .iter()
                    .any(|&p| (dim_class(bucket_len(p)), dim_class(p))
                        == (dim_class(bucket_len(l)), dim_class(l))),
                "prefill {l}"
            );
        }
        for n in 1..=8 {
            assert!(has(&s.samplings, n), "sampling {n}");
            for b in 1..=(41 + new).div_ceil(bs) {
                let (r, a) = (bucket_rows(n), attended_blocks(b));
                assert!(
                    s.decodes.iter().any(|&(r2, a2)| {
                        (dim_class(r2), dim_class(a2), dim_class(r2 * a2))
                            == (dim_class(r), dim_class(a), dim_class(r * a))
                    }),
                    "decode of {n} rows over {b} blocks"
                );
            }
        }
        // No more rows than a call has, or the engine decodes at once.
        assert!(s.samplings.iter().all(|&n| n <= 8));
        assert_eq!(s.prefills.len(), 4);
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
