//! The static-batch generator the engine is tested and benchmarked against: the simplest
//! schedule over the same paged pass, so a difference between the two is the engine's doing.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use conrub_kernels::sampling::SeenIds;
use conrub_kernels::KernelOps;
use rand_chacha::ChaCha8Rng;

use conrub_contracts::{
    check_sequences, sample_token, sequence_rng, ForwardBatch, Generation, PaddedBatch, Padding,
    PagedKv, PagedModel, PagedPass, PagedRead, Result, SamplingConfig,
};

use crate::engine::DEFAULT_BLOCK_SIZE;

/// `[rows, vocab]` logits as row-major f32 on the host.
fn to_host<B: Backend>(logits: Tensor<B, 2>) -> Vec<f32> {
    logits
        .cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 logits")
}

/// One continuation per prompt, scheduled as a static batch: every prompt (a group's shared
/// prompt once per row) left padded and prefilled in one pass, every row holding blocks for its
/// longest sequence (`prompt + max_new_tokens`) from the start, one decode step for all live rows
/// at a time, and the `[rows, vocab]` logits copied to the host and sampled there with
/// [`sample_token`] and [`sequence_rng`]. Finished rows leave the batch; nothing is preempted,
/// shared or bucketed. Same tokens as [`crate::generate`] under the same config (greedy, or the
/// same seed), which the engine's tests check.
pub fn generate_static<B: KernelOps, M: PagedModel<B>>(
    model: &M,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    device: &B::Device,
) -> Result<Vec<Generation>> {
    cfg.validate()?;
    check_sequences(prompts, model.vocab_size(), "prompts")?;
    let mut out: Vec<Generation> = prompts.iter().map(|_| Generation::new()).collect();
    if prompts.is_empty() || cfg.max_new_tokens == 0 {
        return Ok(out);
    }
    let mut rngs: Vec<ChaCha8Rng> = (0..prompts.len())
        .map(|i| sequence_rng(cfg.seed, cfg.first_stream + i as u64))
        .collect();
    let penalty = cfg.decoding.repetition_penalty();
    let mut seen: Vec<SeenIds> = prompts
        .iter()
        .map(|p| SeenIds::for_penalty(p, penalty))
        .collect();
    let padded = PaddedBatch::new(prompts, 0, Padding::Left);
    let bs = DEFAULT_BLOCK_SIZE;
    // Row r owns blocks r * per_row .. (r + 1) * per_row: its slot of position p is fixed.
    let per_row = (padded.len + cfg.max_new_tokens).div_ceil(bs);
    let mut kv = PagedKv::new(model.kv_layout(), prompts.len() * per_row, bs, device);
    let slot = |row: usize, pos: usize| (row * per_row * bs + pos) as u32;
    let table = |row: usize| {
        (row * per_row..(row + 1) * per_row)
            .map(|b| b as u32)
            .collect()
    };

    let (mut write_slots, mut write_rows) = (Vec::new(), Vec::new());
    for (r, &len) in padded.lengths.iter().enumerate() {
        let pad = padded.len - len;
        for c in pad..padded.len {
            write_slots.push(slot(r, c - pad));
            write_rows.push((r * padded.len + c) as i64);
        }
    }
    let n = write_rows.len();
    let prefill = PagedPass {
        write_slots,
        write_rows: padded
            .has_padding()
            .then(|| Tensor::<B, 1, Int>::from_data(TensorData::new(write_rows, [n]), device)),
        read: None,
        prefix: None,
    };
    let v = model.vocab_size();
    let mut host = to_host(model.forward_paged(&padded.to_device(device), &mut kv, &prefill));

    // Rows of the current batch, as indices into `prompts`.
    let mut active: Vec<usize> = (0..prompts.len()).collect();
    loop {
        let mut next = Vec::with_capacity(active.len());
        let mut still = Vec::with_capacity(active.len());
        for (row, &seq) in active.iter().enumerate() {
            let row_logits = &host[row * v..(row + 1) * v];
            let (tok, lp) = sample_token(row_logits, seen[seq].ids(), cfg, &mut rngs[seq]);
            seen[seq].insert(tok);
            if out[seq].push(tok, lp, cfg) {
                still.push(seq);
                next.push(tok as i64);
            }
        }
        if still.is_empty() {
            break;
        }
        active = still;
        let rows = active.len();
        // The position of each row's new token (its last sampled one).
        let pos: Vec<usize> = active
            .iter()
            .map(|&s| prompts[s].len() + out[s].tokens.len() - 1)
            .collect();
        let step = ForwardBatch {
            input_ids: Tensor::<B, 2, Int>::from_data(TensorData::new(next, [rows, 1]), device),
            position_ids: Tensor::<B, 2, Int>::from_data(
                TensorData::new(pos.iter().map(|&p| p as i64).collect(), [rows, 1]),
                device,
            ),
            key_mask: None,
        };
        let tables: Vec<Vec<u32>> = active.iter().map(|&s| table(s)).collect();
        let lens: Vec<usize> = pos.iter().map(|p| p + 1).collect();
        let pass = PagedPass {
            write_slots: active.iter().zip(&pos).map(|(&s, &p)| slot(s, p)).collect(),
            write_rows: None,
            read: Some(PagedRead::new(&tables, per_row, bs, &lens, device)),
            prefix: None,
        };
        host = to_host(model.forward_paged(&step, &mut kv, &pass));
    }
    Ok(out)
}
