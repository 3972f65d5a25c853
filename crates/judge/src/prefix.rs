//! One forward layout shared by the in-process judges that read the model's state after a prompt
//! instead of generating: the prompts of one response differ only in their criterion suffix, so
//! the common prefix (system prompt, question, response) runs once into a paged KV cache and every
//! suffix row reads it. One response with `c` criteria costs one prefix pass and `⌈c / batch⌉`
//! suffix passes.
//!
//! Where the prompts split depends on which prompts run together (criteria that all open with
//! "The response" share those tokens too), so nothing a caller reads may depend on it: a caller
//! that pools over a span gives each prompt's span start ([`criterion_start`], a function of the
//! prompt alone), the shared prefix ends at or before every such start, and each row's span
//! ([`SuffixRows::span`]) covers the same tokens whatever the batch.

use burn::tensor::{Bool, Int, Tensor, TensorData};
use conrub_kernels::KernelOps;
use conrub_models::{ChatOptions, Message, Pretrained};
use conrub_rollout::{
    ForwardBatch, PaddedBatch, Padding, PagedKv, PagedModel, PagedPass, PagedPrefix,
    DEFAULT_BLOCK_SIZE,
};

/// Length of the longest common prefix of `a` and `b`.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Where a one-criterion prompt's own part begins: the first token where `seq` departs from
/// `blank`, the same prompt rendered with an empty criterion (the criterion's first token, or the
/// template token it merged into), and at most `seq`'s last token, so that every prompt keeps a
/// token of its own. It depends on the prompt alone, never on the prompts it runs with.
pub(crate) fn criterion_start(seq: &[u32], blank: &[u32]) -> usize {
    common_prefix(seq, blank).min(seq.len().saturating_sub(1))
}

/// How prompts run together: the prefix run once for all of them and where each one's span
/// begins. A pure function of the token ids, so that it can be checked without a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Length of the shared prefix (run once).
    pub prefix: usize,
    /// Per prompt, the offset its span begins at (never before `prefix`, never past its last
    /// token): its span is its tokens from there to its end.
    pub starts: Vec<usize>,
}

impl Layout {
    /// The layout of `seqs`: their longest common prefix, leaving at least one token of each and,
    /// with `starts` (one per prompt), ending at or before every prompt's start. Each prompt's span
    /// begins at its start (clamped to its last token), which keeps it independent of the batch;
    /// without `starts` it begins where the shared prefix ends, which depends on the batch (fit
    /// only for callers that read the last token alone).
    pub fn new(seqs: &[Vec<u32>], starts: Option<&[usize]>) -> Self {
        if let Some(s) = starts {
            assert_eq!(s.len(), seqs.len(), "one span start per prompt");
        }
        let own: Option<Vec<usize>> = starts.map(|s| {
            s.iter()
                .zip(seqs)
                .map(|(&start, seq)| start.min(seq.len().saturating_sub(1)))
                .collect()
        });
        let shortest = seqs.iter().map(Vec::len).min().unwrap_or(0);
        let limit = own
            .iter()
            .flatten()
            .copied()
            .fold(shortest.saturating_sub(1), usize::min);
        let mut prefix = 0;
        while prefix < limit && seqs.iter().all(|s| s[prefix] == seqs[0][prefix]) {
            prefix += 1;
        }
        Self {
            prefix,
            starts: own.unwrap_or_else(|| vec![prefix; seqs.len()]),
        }
    }
}

/// Row-major `[rows, padded.len]`: the tokens of each row's span in a batch of suffixes that
/// follow a `prefix`-token prefix, i.e. its real tokens at or after its span start (`starts`, one
/// per row, counted from the start of the whole prompt).
fn span_mask(padded: &PaddedBatch, prefix: usize, starts: &[usize]) -> Vec<bool> {
    let len = padded.len;
    padded
        .mask
        .iter()
        .zip(&padded.positions)
        .enumerate()
        .map(|(k, (&real, &pos))| real && prefix + pos as usize >= starts[k / len])
        .collect()
}

/// The token ids of a (system, user) prompt under the model's chat template, thinking off, ready
/// for the assistant's answer.
pub(crate) fn chat_ids<B: KernelOps>(
    model: &Pretrained<B>,
    system: &str,
    user: &str,
) -> conrub_models::Result<Vec<u32>> {
    let tok = model
        .tokenizer
        .as_ref()
        .ok_or_else(|| conrub_models::ModelError::ModelDir {
            dir: model.dir.clone(),
            message: "no tokenizer.json".into(),
        })?;
    let msgs = [Message::system(system), Message::user(user)];
    tok.apply_chat_template(
        &msgs,
        ChatOptions {
            add_generation_prompt: true,
            enable_thinking: Some(false),
        },
    )
}

/// Prompts whose common prefix has run, ready to run their suffixes on top of it.
pub(crate) struct SharedPrefix<B: KernelOps> {
    /// The cache holding the prefix.
    kv: PagedKv<B>,
    /// Reads the prefix, caches nothing.
    pass: PagedPass<B>,
    /// Each prompt's tokens after the prefix.
    suffixes: Vec<Vec<u32>>,
    /// Prefix length and span starts.
    layout: Layout,
}

/// Left-padded suffix rows of a [`SharedPrefix`], for one pass.
pub(crate) struct SuffixRows<B: KernelOps> {
    /// The rows, positions continuing after the prefix.
    pub batch: ForwardBatch<B>,
    /// Row-major `[rows, len]`: the tokens of each row's span (its real tokens from its span
    /// start on, see [`Layout`]; every real token of its suffix when no starts were given). Never
    /// empty, and the same tokens of the prompt whatever the batch when starts were given.
    pub span: Vec<bool>,
    /// Padded length.
    pub len: usize,
}

impl<B: KernelOps> SharedPrefix<B> {
    /// Runs the longest common prefix of `seqs` (leaving at least one token of each to run, and
    /// ending at or before each prompt's span start where `starts` gives them, see [`Layout`])
    /// through the model's first `layers` layers (all when `None`: later passes may only ask
    /// for layers up to it).
    pub fn new(
        model: &Pretrained<B>,
        seqs: &[Vec<u32>],
        starts: Option<&[usize]>,
        layers: Option<usize>,
        device: &B::Device,
    ) -> Self {
        let layout = Layout::new(seqs, starts);
        let prefix = layout.prefix;
        let bs = DEFAULT_BLOCK_SIZE;
        let mut kv = PagedKv::new(
            model.model.kv_layout(),
            prefix.div_ceil(bs).max(1),
            bs,
            device,
        );
        let slots: Vec<u32> = (0..prefix as u32).collect();
        let deepest = layers.unwrap_or(model.model.num_layers());
        let shared = (prefix > 0).then(|| {
            let head = ForwardBatch::contiguous(&[seqs[0][..prefix].to_vec()], 0, device);
            let write = PagedPass::prefill(slots.clone());
            let _ = model
                .model
                .forward_layers_paged(&head, &mut kv, &write, &[deepest]);
            PagedPrefix::new(&slots, device)
        });
        Self {
            kv,
            pass: PagedPass {
                prefix: shared,
                ..PagedPass::prefill(Vec::new())
            },
            suffixes: seqs.iter().map(|s| s[prefix..].to_vec()).collect(),
            layout,
        }
    }

    /// Suffix rows `rows` of the prompts, padded for one pass.
    pub fn rows(
        &self,
        rows: std::ops::Range<usize>,
        pad_id: u32,
        device: &B::Device,
    ) -> SuffixRows<B> {
        let starts = &self.layout.starts[rows.clone()];
        let padded = PaddedBatch::new(&self.suffixes[rows], pad_id, Padding::Left);
        let n = padded.batch;
        let ints = |v: Vec<i64>| {
            Tensor::<B, 2, Int>::from_data(TensorData::new(v, [n, padded.len]), device)
        };
        let span = span_mask(&padded, self.layout.prefix, starts);
        let prefix = self.layout.prefix as i64;
        SuffixRows {
            batch: ForwardBatch {
                input_ids: ints(padded.ids.iter().map(|&x| x as i64).collect()),
                position_ids: ints(padded.positions.iter().map(|&p| p + prefix).collect()),
                key_mask: padded.has_padding().then(|| {
                    Tensor::<B, 2, Bool>::from_data(
                        TensorData::new(padded.mask.clone(), [n, padded.len]),
                        device,
                    )
                }),
            },
            span,
            len: padded.len,
        }
    }

    /// The cache and pass a suffix batch runs with.
    pub fn cache(&mut self) -> (&mut PagedKv<B>, &PagedPass<B>) {
        (&mut self.kv, &self.pass)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// System prompt, question, response and `CRITERION:` of one response's prompts.
    const HEAD: [u32; 6] = [1, 2, 3, 4, 5, 6];
    /// Label definitions, answer cue and the chat template's end.
    const TAIL: [u32; 3] = [90, 91, 92];

    /// The one-criterion prompt of `criterion` (an empty one gives the blank prompt).
    fn prompt(criterion: &[u32]) -> Vec<u32> {
        [&HEAD[..], criterion, &TAIL[..]].concat()
    }

    /// The token ids that row `row` of `batch` pools over, laid out as the probe features are.
    fn pooled(batch: &[Vec<u32>], row: usize) -> Vec<u32> {
        let blank = prompt(&[]);
        let starts: Vec<usize> = batch.iter().map(|s| criterion_start(s, &blank)).collect();
        let layout = Layout::new(batch, Some(&starts[..]));
        assert!(
            layout.starts.iter().all(|&s| s >= layout.prefix),
            "{layout:?}"
        );
        let suffixes: Vec<Vec<u32>> = batch.iter().map(|s| s[layout.prefix..].to_vec()).collect();
        let padded = PaddedBatch::new(&suffixes, 0, Padding::Left);
        let span = span_mask(&padded, layout.prefix, &layout.starts);
        let len = padded.len;
        (row * len..(row + 1) * len)
            .filter(|&k| span[k])
            .map(|k| padded.ids[k])
            .collect()
    }

    #[test]
    fn the_pooled_span_of_a_prompt_does_not_depend_on_its_batch() {
        // `a` and `b` open with the same words ("The response mentions"), `c` with others.
        let a = prompt(&[10, 11, 12, 20]);
        let b = prompt(&[10, 11, 12, 21]);
        let c = prompt(&[30, 31]);
        let own = a[HEAD.len()..].to_vec();
        let batches = [
            vec![a.clone(), b.clone()],
            vec![b, a.clone()],
            vec![a.clone(), c],
            vec![a.clone()],
        ];
        for batch in &batches {
            let row = batch.iter().position(|s| *s == a).unwrap();
            assert_eq!(pooled(batch, row), own, "{batch:?}");
        }
        // Without span starts the span begins where the batch's shared prefix ends: after the
        // words shared with `b`, at the criterion with `c`, at the last token alone.
        let old = |batch: &[Vec<u32>]| Layout::new(batch, None).starts[0];
        assert_eq!(old(&batches[0][..]), HEAD.len() + 3);
        assert_eq!(old(&batches[2][..]), HEAD.len());
        assert_eq!(old(&batches[3][..]), a.len() - 1);
    }

    #[test]
    fn the_shared_prefix_ends_at_or_before_every_criterion_start() {
        let blank = prompt(&[]);
        let a = prompt(&[10, 11, 12, 20]);
        let b = prompt(&[10, 11, 12, 21]);
        assert_eq!(criterion_start(&a, &blank), HEAD.len());
        let starts = [HEAD.len(), HEAD.len()];
        let layout = Layout::new(&[a.clone(), b], Some(&starts[..]));
        assert_eq!(layout.prefix, HEAD.len());
        // A criterion opening with the template's next token departs from the blank prompt one
        // token late: its span starts there in every batch, and no prefix runs past it.
        let d = prompt(&[90, 40]);
        let start = criterion_start(&d, &blank);
        assert_eq!(start, HEAD.len() + 1);
        let own = d[start..].to_vec();
        assert_eq!(pooled(std::slice::from_ref(&d), 0), own);
        let layout = Layout::new(std::slice::from_ref(&d), Some(&[start][..]));
        assert_eq!((layout.prefix, layout.starts), (start, vec![start]));
        assert_eq!(pooled(&[a, d], 1), own);
        // An empty criterion keeps one token of its own: the last.
        assert_eq!(criterion_start(&blank, &blank), blank.len() - 1);
        assert_eq!(pooled(&[blank], 0), vec![TAIL[2]]);
    }

    #[test]
    fn without_starts_the_prefix_is_the_longest_common_prefix() {
        let a = prompt(&[10, 11, 12, 20]);
        let b = prompt(&[10, 11, 12, 21]);
        let layout = Layout::new(&[a.clone(), b], None);
        assert_eq!(layout.prefix, HEAD.len() + 3);
        assert_eq!(layout.starts, vec![layout.prefix; 2]);
        // One token of each prompt is left to run.
        assert_eq!(
            Layout::new(std::slice::from_ref(&a), None).prefix,
            a.len() - 1
        );
        let nested = [vec![1, 2, 3], vec![1, 2, 3, 4]];
        assert_eq!(Layout::new(&nested, None).prefix, 2);
        assert_eq!(
            Layout::new(&[], None),
            Layout {
                prefix: 0,
                starts: Vec::new()
            }
        );
    }
}
