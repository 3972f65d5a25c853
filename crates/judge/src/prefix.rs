//! One forward layout shared by the in-process judges that read the model's state after a prompt
//! instead of generating: the prompts of one response differ only in their criterion suffix, so
//! the common prefix (system prompt, question, response) runs once into a paged KV cache and every
//! suffix row reads it. One response with `c` criteria costs one prefix pass and `⌈c / batch⌉`
//! suffix passes.

use burn::tensor::{Bool, Int, Tensor, TensorData};
use conrub_kernels::GrpoOps;
use conrub_qwen3::{ChatOptions, Message, Qwen3};
use conrub_rollout::{
    ForwardBatch, PaddedBatch, Padding, PagedKv, PagedModel, PagedPass, PagedPrefix,
    DEFAULT_BLOCK_SIZE,
};

/// The token ids of a (system, user) prompt under the model's chat template, thinking off, ready
/// for the assistant's answer.
pub(crate) fn chat_ids<B: GrpoOps>(
    model: &Qwen3<B>,
    system: &str,
    user: &str,
) -> conrub_qwen3::Result<Vec<u32>> {
    let tok = model
        .tokenizer
        .as_ref()
        .ok_or_else(|| conrub_qwen3::Qwen3Error::ModelDir {
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
pub(crate) struct SharedPrefix<B: GrpoOps> {
    /// The cache holding the prefix.
    kv: PagedKv<B>,
    /// Reads the prefix, caches nothing.
    pass: PagedPass<B>,
    /// Each prompt's tokens after the prefix.
    suffixes: Vec<Vec<u32>>,
    /// Prefix length.
    prefix: usize,
}

/// Left-padded suffix rows of a [`SharedPrefix`], for one pass.
pub(crate) struct SuffixRows<B: GrpoOps> {
    /// The rows, positions continuing after the prefix.
    pub batch: ForwardBatch<B>,
    /// Row-major `[rows, len]` validity of `batch`'s tokens.
    pub mask: Vec<bool>,
    /// Padded length.
    pub len: usize,
}

impl<B: GrpoOps> SharedPrefix<B> {
    /// Runs the longest common prefix of `seqs` (leaving at least one token of each to run)
    /// through the model's first `layers` layers (all when `None`: later passes may only ask
    /// for layers up to it).
    pub fn new(
        model: &Qwen3<B>,
        seqs: &[Vec<u32>],
        layers: Option<usize>,
        device: &B::Device,
    ) -> Self {
        let shortest = seqs.iter().map(Vec::len).min().unwrap_or(0);
        let mut prefix = 0;
        while prefix + 1 < shortest && seqs.iter().all(|s| s[prefix] == seqs[0][prefix]) {
            prefix += 1;
        }
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
            prefix,
        }
    }

    /// Suffix rows `rows` of the prompts, padded for one pass.
    pub fn rows(
        &self,
        rows: std::ops::Range<usize>,
        pad_id: u32,
        device: &B::Device,
    ) -> SuffixRows<B> {
        let padded = PaddedBatch::new(&self.suffixes[rows], pad_id, Padding::Left);
        let n = padded.batch;
        let ints = |v: Vec<i64>| {
            Tensor::<B, 2, Int>::from_data(TensorData::new(v, [n, padded.len]), device)
        };
        let prefix = self.prefix as i64;
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
            mask: padded.mask,
            len: padded.len,
        }
    }

    /// The cache and pass a suffix batch runs with.
    pub fn cache(&mut self) -> (&mut PagedKv<B>, &PagedPass<B>) {
        (&mut self.kv, &self.pass)
    }
}
