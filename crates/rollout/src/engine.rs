//! The rollout engine: every generation (the learner's rollouts, `conrub generate`, `eval`, the
//! local judge) runs here, over a paged KV cache of a fixed size.
//!
//! - **Block KV cache** ([`PagedKv`]): one pool of `kv_blocks` blocks of `block_size`
//!   positions, sized by a memory budget ([`EngineConfig::with_kv_bytes`]), a block table per
//!   sequence.
//! - **Continuous batching**: waiting sequences are admitted while blocks are free (and at most
//!   `max_rows` run at once); each iteration prefills what was admitted, then runs one decode step
//!   for every running sequence, and a finished sequence's blocks go to the next one at once.
//! - **Preemption**: when a running sequence needs a block and none is free, the most recently
//!   admitted one gives its blocks back and waits at the front of the queue; its cached keys and
//!   values go to host memory and come back into fresh blocks when it is admitted again, so it
//!   goes on from where it was with exactly the state it had. (Recomputing them with a prefill
//!   would be cheaper in host memory but not exact: a prefill reduces over other lengths than
//!   the decode steps did, and on a near-uniform 151,936-token distribution a 1e-7 change of the
//!   logits moves sampled tokens.) A step never fails for lack of KV memory unless one sequence
//!   alone does not fit the pool.
//! - **Shared prompt prefix**: sequences with the same prompt (a GRPO group) share the prompt's
//!   blocks; the prompt is prefilled once, alone and unpadded (the same computation whatever else
//!   is scheduled), and its last-position logits serve every sequence's first token. A shared block is copied before a sequence writes into it (copy-on-write: only
//!   the prompt's last, partly filled block is ever written again).
//! - **On-device sampling** ([`crate::sample_on_device`]): a decode step returns token ids and
//!   log-probabilities only.
//!
//! Sequence `i` draws from [`sequence_rng`]`(seed, i)`, one draw per sampled token, so its tokens
//! do not depend on which sequences share its batch, when it was admitted or whether it was
//! preempted.

use std::collections::{HashMap, VecDeque};

use burn::tensor::{DType, Int, Tensor, TensorData};
use conrub_kernels::sampling::SeenIds;
use conrub_kernels::KernelOps;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use conrub_contracts::{
    attended_blocks, bucket_len, bucket_rows, check_sequences, sequence_rng, BlockAllocator,
    ContractError, EngineShapes, ForwardBatch, Generation, KvLayout, PaddedBatch, Padding, PagedKv,
    PagedModel, PagedPass, PagedRead, Result, RolloutStats, SamplingConfig,
};

use crate::device_sampling::sample_on_device;

/// Positions per KV block unless told otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = conrub_settings::DEFAULT_BLOCK_SIZE;
/// Sequences decoded together at most unless told otherwise.
pub const DEFAULT_MAX_ROWS: usize = conrub_settings::DEFAULT_MAX_ROWS;

/// Settings of the engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Positions per KV block.
    pub block_size: usize,
    /// Blocks in the pool; `None` sizes it so that every sequence fits at full length at once
    /// (no preemption; what a budget-free call wants).
    pub kv_blocks: Option<usize>,
    /// Sequences decoded together at most.
    pub max_rows: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE,
            kv_blocks: None,
            max_rows: DEFAULT_MAX_ROWS,
        }
    }
}

impl EngineConfig {
    /// The pool that `bytes` of KV memory hold for a model of `layout` (at least one block).
    pub fn with_kv_bytes(mut self, bytes: u64, layout: KvLayout) -> Self {
        let per_block = layout.block_bytes(self.block_size).max(1);
        self.kv_blocks = Some(((bytes / per_block) as usize).max(1));
        self
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        if self.block_size == 0 {
            return Err(ContractError::arg("block_size", "must be at least 1"));
        }
        if self.kv_blocks == Some(0) {
            return Err(ContractError::arg("kv_blocks", "must be at least 1"));
        }
        if self.max_rows == 0 {
            return Err(ContractError::arg("max_rows", "must be at least 1"));
        }
        Ok(())
    }
}

/// The engine's output: one generation per prompt, in order, and what it took.
#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    /// One per prompt.
    pub generations: Vec<Generation>,
    /// Telemetry.
    pub stats: RolloutStats,
}

/// One sequence's state.
struct Seq {
    /// Index among the distinct prompts.
    prompt: usize,
    /// Block table.
    blocks: Vec<u32>,
    /// Positions held in the cache.
    cached: usize,
    /// Whether it has ever been admitted (its first token comes from the prompt's logits).
    started: bool,
    /// Keys and values of every layer moved to the host while it is preempted.
    swapped: Option<Vec<(TensorData, TensorData)>>,
    rng: ChaCha8Rng,
    /// The ids it has seen (prompt and new tokens), kept only under a repetition penalty.
    seen: SeenIds,
}

/// A prompt's prefilled blocks, kept while sequences of it still wait to be admitted.
struct CachedPrompt<B: KernelOps> {
    blocks: Vec<u32>,
    /// Next-token logits after the prompt, `[vocab]` (f32).
    logits: Tensor<B, 1>,
}

/// The rows of one decode step, padding rows included.
struct DecodeRows {
    tokens: Vec<i64>,
    positions: Vec<i64>,
    write_slots: Vec<u32>,
    lens: Vec<usize>,
    tables: Vec<Vec<u32>>,
}

/// Samples one token per row of `logits` on the device and reads the ids and log-probabilities
/// back.
fn sample_and_read<B: KernelOps>(
    logits: Tensor<B, 2>,
    seen: &[&[u32]],
    cfg: &SamplingConfig,
    uniforms: &[f64],
) -> Result<(Vec<i64>, Vec<f32>)> {
    let (tok, lp) = sample_on_device(logits, seen, cfg, uniforms);
    // One read of both: ids as f32 would lose precision above 2^24, so two reads.
    let toks: Vec<i64> = tok
        .into_data()
        .convert::<i64>()
        .into_vec()
        .map_err(|e| ContractError::Readback(format!("{e:?}")))?;
    let lps: Vec<f32> = lp
        .into_data()
        .convert::<f32>()
        .into_vec()
        .map_err(|e| ContractError::Readback(format!("{e:?}")))?;
    Ok((toks, lps))
}

fn blocks_for(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size)
}

/// The state of one engine call.
struct Engine<'a, B: KernelOps, M: PagedModel<B>> {
    model: &'a M,
    cfg: &'a SamplingConfig,
    engine: &'a EngineConfig,
    device: &'a B::Device,
    prompts: Vec<&'a [u32]>,
    seqs: Vec<Seq>,
    out: Vec<Generation>,
    kv: PagedKv<B>,
    alloc: BlockAllocator,
    cache: HashMap<usize, CachedPrompt<B>>,
    /// Sequences of each distinct prompt not admitted yet.
    unstarted: Vec<usize>,
    waiting: VecDeque<usize>,
    /// In admission order (oldest first).
    running: Vec<usize>,
    /// A pool block outside the allocator's: the padding rows of a decode step write there.
    scratch: u32,
    stats: RolloutStats,
}

/// Generates one continuation per prompt with the engine (see the module docs).
pub fn rollout<B: KernelOps, M: PagedModel<B>>(
    model: &M,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    engine: &EngineConfig,
    device: &B::Device,
) -> Result<Rollout> {
    cfg.validate()?;
    engine.validate()?;
    check_sequences(prompts, model.vocab_size(), "prompts")?;
    let mut distinct: HashMap<&[u32], usize> = HashMap::new();
    let mut unique: Vec<&[u32]> = Vec::new();
    let mut seqs = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let id = *distinct.entry(p.as_slice()).or_insert_with(|| {
            unique.push(p.as_slice());
            unique.len() - 1
        });
        seqs.push(Seq {
            prompt: id,
            blocks: Vec::new(),
            cached: 0,
            started: false,
            swapped: None,
            rng: sequence_rng(cfg.seed, cfg.first_stream + i as u64),
            seen: SeenIds::for_penalty(p, cfg.decoding.repetition_penalty()),
        });
    }
    let bs = engine.block_size;
    let full: usize = prompts
        .iter()
        .map(|p| blocks_for(p.len() + cfg.max_new_tokens, bs))
        .sum::<usize>()
        + unique
            .iter()
            .map(|p| blocks_for(p.len(), bs))
            .sum::<usize>();
    let num_blocks = engine.kv_blocks.unwrap_or(full.max(1));
    // One block more than the allocator hands out: the scratch block of padding rows.
    let kv = PagedKv::new(model.kv_layout(), num_blocks + 1, bs, device);
    let mut unstarted = vec![0usize; unique.len()];
    for s in &seqs {
        unstarted[s.prompt] += 1;
    }
    let stats = RolloutStats {
        sequences: prompts.len(),
        distinct_prompts: unique.len(),
        kv_blocks: num_blocks,
        block_size: bs,
        kv_pool_bytes: kv.bytes(),
        ..Default::default()
    };
    let mut e = Engine {
        model,
        cfg,
        engine,
        device,
        prompts: unique,
        out: prompts.iter().map(|_| Generation::new()).collect(),
        seqs,
        kv,
        alloc: BlockAllocator::new(num_blocks),
        cache: HashMap::new(),
        unstarted,
        waiting: (0..prompts.len()).collect(),
        running: Vec::new(),
        scratch: num_blocks as u32,
        stats,
    };
    if cfg.max_new_tokens > 0 {
        e.run()?;
    }
    let mut stats = e.stats;
    stats.peak_kv_blocks = e.alloc.peak_in_use();
    let steps = stats.steps.len().max(1) as f64;
    stats.mean_running_rows = stats.steps.iter().map(|s| s.0 as f64).sum::<f64>() / steps;
    Ok(Rollout {
        generations: e.out,
        stats,
    })
}

/// One continuation per prompt with a pool that holds every sequence at full length (no
/// preemption) and the default block size and rows; [`rollout`] takes a memory budget and reports
/// telemetry.
pub fn generate<B: KernelOps, M: PagedModel<B>>(
    model: &M,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    device: &B::Device,
) -> Result<Vec<Generation>> {
    rollout(model, prompts, cfg, &EngineConfig::default(), device).map(|r| r.generations)
}

/// The kernel warm-up's walk through the engine's shapes ([`EngineShapes`]): each prefill
/// length, each copy of a partly filled block, each
/// decode step's rows and attended blocks, each sampling's rows (from a prompt's logits, as a
/// first token is, and from a decode step's); on a pool of its own whose blocks every row shares
/// (the values computed are thrown away). Returns the passes made.
pub fn walk_shapes<B: KernelOps, M: PagedModel<B>>(
    model: &M,
    shapes: &EngineShapes,
    cfg: &SamplingConfig,
    engine: &EngineConfig,
    device: &B::Device,
) -> Result<usize> {
    cfg.validate()?;
    engine.validate()?;
    let bs = engine.block_size;
    let blocks = shapes
        .prefills
        .iter()
        .map(|&l| blocks_for(l, bs))
        .chain(shapes.decodes.iter().map(|d| d.1))
        .max()
        .unwrap_or(1)
        .max(1);
    let mut e = Engine {
        model,
        cfg,
        engine,
        device,
        prompts: Vec::new(),
        seqs: Vec::new(),
        out: Vec::new(),
        kv: PagedKv::new(model.kv_layout(), blocks + 1, bs, device),
        alloc: BlockAllocator::new(blocks),
        cache: HashMap::new(),
        unstarted: Vec::new(),
        waiting: VecDeque::new(),
        running: Vec::new(),
        scratch: blocks as u32,
        stats: RolloutStats::default(),
    };
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut passes = 0;
    let mut first = None;
    for &len in &shapes.prefills {
        let logits = e.prefill(&vec![0; len.max(1)], &table[..blocks_for(len.max(1), bs)]);
        let v = logits.dims()[1];
        first = Some(logits.reshape([v]));
        passes += 1;
    }
    for &n in &shapes.block_copies {
        e.kv.copy_block(0, e.scratch, n);
        passes += 1;
    }
    let greedy = cfg.decoding.is_greedy();
    let sample = |logits: Tensor<B, 2>, n: usize| {
        let uniforms = if greedy { Vec::new() } else { vec![0.5; n] };
        sample_and_read(logits, &vec![&[0u32][..]; n], cfg, &uniforms)
    };
    if let Some(row) = first {
        for &n in &shapes.samplings {
            sample(Tensor::stack::<2>(vec![row.clone(); n], 0), n)?;
            passes += 1;
        }
    }
    let mut sampled = std::collections::BTreeSet::new();
    for &(rows, attended) in &shapes.decodes {
        // Every real row count of this bucket samples from it once.
        let counts: Vec<usize> = shapes
            .samplings
            .iter()
            .copied()
            .filter(|&n| bucket_rows(n) == rows && sampled.insert(n))
            .collect();
        let len = attended * bs;
        let decode = |e: &mut Engine<'_, B, M>, n: usize| {
            let rows = DecodeRows {
                tokens: vec![0; rows],
                positions: vec![len as i64 - 1; rows],
                write_slots: vec![e.scratch * bs as u32; rows],
                lens: vec![len; rows],
                tables: vec![table[..attended].to_vec(); rows],
            };
            e.decode_pass(rows, attended, n)
        };
        if counts.is_empty() {
            let _ = decode(&mut e, rows).into_data();
            passes += 1;
        }
        for n in counts {
            let logits = decode(&mut e, n);
            sample(logits, n)?;
            passes += 1;
        }
    }
    Ok(passes)
}

impl<B: KernelOps, M: PagedModel<B>> Engine<'_, B, M> {
    fn run(&mut self) -> Result<()> {
        while !(self.waiting.is_empty() && self.running.is_empty()) {
            self.admit()?;
            if !self.running.is_empty() {
                self.decode_step()?;
            }
        }
        Ok(())
    }

    /// Gives up cached prompts (no sequence waits for them any more, or blocks are needed).
    fn drop_cached_prompts(&mut self, all: bool) {
        let done: Vec<usize> = self
            .cache
            .keys()
            .copied()
            .filter(|&p| all || self.unstarted[p] == 0)
            .collect();
        for p in done {
            let mut c = self.cache.remove(&p).expect("cached");
            self.alloc.release_all(&mut c.blocks);
        }
    }

    /// Admits waiting sequences while blocks are free: prefills the prompts they need (each once,
    /// alone), brings preempted ones back from the host, and samples the first token of every
    /// sequence admitted for the first time.
    fn admit(&mut self) -> Result<()> {
        self.drop_cached_prompts(false);
        let bs = self.engine.block_size;
        let mut free = self.alloc.free();
        let mut prompt_prefills: Vec<usize> = Vec::new();
        let mut restore: Vec<usize> = Vec::new();
        let mut fresh: Vec<usize> = Vec::new();
        while let Some(&id) = self.waiting.front() {
            if self.running.len() + restore.len() + fresh.len() >= self.engine.max_rows {
                break;
            }
            let s = &self.seqs[id];
            let prompt_ready =
                self.cache.contains_key(&s.prompt) || prompt_prefills.contains(&s.prompt);
            // One block more than the cached positions: room for the next decode step.
            let need = match (&s.swapped, prompt_ready) {
                (Some(_), _) => blocks_for(s.cached, bs) + 1,
                (None, true) => 1,
                (None, false) => blocks_for(self.prompts[s.prompt].len(), bs) + 1,
            };
            if need > free {
                if self.running.is_empty() && restore.is_empty() && fresh.is_empty() {
                    if !self.cache.is_empty() {
                        self.drop_cached_prompts(true);
                        free = self.alloc.free();
                        continue;
                    }
                    return Err(ContractError::arg(
                        "kv_blocks",
                        format!(
                            "{} blocks of {bs} positions cannot hold one sequence of {} tokens; raise the KV budget",
                            self.alloc.free(),
                            self.prompts[s.prompt].len() + self.cfg.max_new_tokens
                        ),
                    ));
                }
                break;
            }
            free -= need;
            self.waiting.pop_front();
            if s.swapped.is_some() {
                restore.push(id);
            } else {
                if !prompt_ready {
                    prompt_prefills.push(s.prompt);
                }
                fresh.push(id);
            }
        }
        for p in prompt_prefills {
            let ids = self.prompts[p].to_vec();
            let table: Vec<u32> = (0..blocks_for(ids.len(), bs))
                .map(|_| {
                    self.alloc
                        .alloc()
                        .expect("blocks were counted at admission")
                })
                .collect();
            let logits = self.prefill(&ids, &table);
            let v = logits.dims()[1];
            self.stats.prefill_tokens += ids.len();
            self.stats.prompt_prefills += 1;
            self.cache.insert(
                p,
                CachedPrompt {
                    blocks: table,
                    logits: logits.reshape([v]),
                },
            );
        }
        for id in restore {
            self.swap_in(id);
            self.running.push(id);
        }
        // First tokens of fresh sequences, from their prompt's logits.
        if !fresh.is_empty() {
            let rows: Vec<Tensor<B, 1>> = fresh
                .iter()
                .map(|&id| self.cache[&self.seqs[id].prompt].logits.clone())
                .collect();
            let logits = Tensor::stack::<2>(rows, 0);
            for &id in &fresh {
                let p = self.seqs[id].prompt;
                let blocks = self.cache[&p].blocks.clone();
                for &b in &blocks {
                    self.alloc.share(b);
                }
                let s = &mut self.seqs[id];
                s.blocks = blocks;
                s.cached = self.prompts[p].len();
                s.started = true;
                self.unstarted[p] -= 1;
            }
            let go_on = self.sample(&fresh, logits)?;
            for (id, more) in fresh.into_iter().zip(go_on) {
                if more {
                    self.running.push(id);
                } else {
                    self.finish(id);
                }
            }
        }
        Ok(())
    }

    /// Pool slot of position `pos` of a block table.
    fn slot(table: &[u32], pos: usize, bs: usize) -> u32 {
        table[pos / bs] * bs as u32 + (pos % bs) as u32
    }

    /// Pool slots of positions `0..len` of a block table.
    fn slots(table: &[u32], len: usize, bs: usize) -> Vec<u32> {
        (0..len).map(|p| Self::slot(table, p, bs)).collect()
    }

    /// Prefills one prompt into the blocks `table`, left-padded to its length bucket under a key
    /// mask (only its real positions are written); returns its next-token logits `[1, vocab]`
    /// (f32).
    fn prefill(&mut self, ids: &[u32], table: &[u32]) -> Tensor<B, 2> {
        let len = bucket_len(ids.len());
        let pad = len - ids.len();
        let padded = PaddedBatch::to_len(&[ids.to_vec()], 0, Padding::Left, len);
        let mut pass = PagedPass::prefill(Self::slots(table, ids.len(), self.engine.block_size));
        if pad > 0 {
            let rows: Vec<i64> = (pad as i64..len as i64).collect();
            pass.write_rows = Some(Tensor::from_data(
                TensorData::new(rows, [ids.len()]),
                self.device,
            ));
        }
        self.stats.tokens_computed += len;
        self.stats.tokens_needed += ids.len();
        self.model
            .forward_paged(&padded.to_device(self.device), &mut self.kv, &pass)
            .cast(DType::F32)
    }

    /// Moves a sequence's cached keys and values to the host and frees its blocks.
    fn swap_out(&mut self, id: usize) {
        let bs = self.engine.block_size;
        let s = &self.seqs[id];
        let slots = Self::slots(&s.blocks, s.cached, bs);
        self.seqs[id].swapped = Some(self.kv.read_slots(&slots));
        self.stats.swapped_tokens += slots.len();
        self.finish(id);
    }

    /// Brings a preempted sequence's keys and values back into fresh blocks.
    fn swap_in(&mut self, id: usize) {
        let bs = self.engine.block_size;
        let cached = self.seqs[id].cached;
        let table: Vec<u32> = (0..blocks_for(cached, bs))
            .map(|_| {
                self.alloc
                    .alloc()
                    .expect("blocks were counted at admission")
            })
            .collect();
        let data = self.seqs[id].swapped.take().expect("swapped out");
        self.kv.write_slots(&Self::slots(&table, cached, bs), data);
        self.seqs[id].blocks = table;
    }

    /// Samples one token per sequence of `ids` from `logits` `[ids, vocab]`; returns per sequence
    /// whether it goes on.
    fn sample(&mut self, ids: &[usize], logits: Tensor<B, 2>) -> Result<Vec<bool>> {
        let uniforms: Vec<f64> = if self.cfg.decoding.is_greedy() {
            Vec::new()
        } else {
            ids.iter()
                .map(|&id| self.seqs[id].rng.random::<f64>())
                .collect()
        };
        let seen: Vec<&[u32]> = ids.iter().map(|&id| self.seqs[id].seen.ids()).collect();
        let (toks, lps) = sample_and_read(logits, &seen, self.cfg, &uniforms)?;
        let n = ids.len();
        self.stats.host_bytes_read += (n * 12) as u64;
        self.stats.generated_tokens += n;
        Ok(ids
            .iter()
            .zip(toks.iter().zip(&lps))
            .map(|(&id, (&t, &l))| {
                self.seqs[id].seen.insert(t as u32);
                self.out[id].push(t as u32, l, self.cfg)
            })
            .collect())
    }

    fn finish(&mut self, id: usize) {
        let mut blocks = std::mem::take(&mut self.seqs[id].blocks);
        self.alloc.release_all(&mut blocks);
    }

    /// Moves the newest running sequence to the host and puts it first in the queue.
    fn preempt_newest(&mut self) -> usize {
        let id = self.running.pop().expect("a running sequence");
        self.swap_out(id);
        self.waiting.push_front(id);
        self.stats.preemptions += 1;
        id
    }

    /// A block for sequence `id`'s next position: a new one at a block boundary, a private copy
    /// of a shared last block. `Err(())` when the pool is empty.
    fn make_room(&mut self, id: usize) -> std::result::Result<(), ()> {
        let bs = self.engine.block_size;
        let pos = self.seqs[id].cached;
        if pos.is_multiple_of(bs) {
            let b = self.alloc.alloc().ok_or(())?;
            self.seqs[id].blocks.push(b);
        } else {
            let last = *self.seqs[id].blocks.last().expect("a partly filled block");
            if self.alloc.owners(last) > 1 {
                let b = self.alloc.alloc().ok_or(())?;
                self.kv.copy_block(last, b, pos % bs);
                self.alloc.release(last);
                *self.seqs[id].blocks.last_mut().expect("non-empty") = b;
            }
        }
        Ok(())
    }

    /// One decode step for every running sequence.
    fn decode_step(&mut self) -> Result<()> {
        let bs = self.engine.block_size;
        // Room for every sequence's next position, oldest first; preempt the newest when the
        // pool is empty.
        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i];
            match self.make_room(id) {
                Ok(()) => i += 1,
                Err(()) => {
                    if !self.cache.is_empty() {
                        self.drop_cached_prompts(true);
                        continue;
                    }
                    let gone = self.preempt_newest();
                    if gone == id {
                        // It was the newest itself: the ones before it have room.
                        break;
                    }
                }
            }
        }
        if self.running.is_empty() {
            return Ok(());
        }
        let ids = self.running.clone();
        let n = ids.len();
        let mut tokens = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        let mut write_slots = Vec::with_capacity(n);
        let mut lens = Vec::with_capacity(n);
        let mut tables = Vec::with_capacity(n);
        for &id in &ids {
            let s = &self.seqs[id];
            tokens.push(*self.out[id].tokens.last().expect("a sampled token") as i64);
            positions.push(s.cached as i64);
            write_slots.push(Self::slot(&s.blocks, s.cached, bs));
            lens.push(s.cached + 1);
            tables.push(s.blocks.clone());
        }
        let blocks = attended_blocks(tables.iter().map(Vec::len).max().unwrap_or(1));
        // Padding rows up to the row bucket: a dummy token at position 0, written to and read
        // from the scratch block; their logits are dropped before sampling.
        let rows = bucket_rows(n);
        for _ in n..rows {
            tokens.push(0);
            positions.push(0);
            write_slots.push(self.scratch * bs as u32);
            lens.push(1);
            tables.push(vec![self.scratch]);
        }
        self.stats.tokens_computed += rows;
        self.stats.tokens_needed += n;
        let logits = self.decode_pass(
            DecodeRows {
                tokens,
                positions,
                write_slots,
                lens,
                tables,
            },
            blocks,
            n,
        );
        for &id in &ids {
            self.seqs[id].cached += 1;
        }
        self.stats.decode_steps += 1;
        self.stats.peak_running_rows = self.stats.peak_running_rows.max(n);
        self.stats
            .steps
            .push((n as u32, self.alloc.in_use() as u32));
        let go_on = self.sample(&ids, logits)?;
        let mut still = Vec::with_capacity(n);
        for (id, more) in ids.into_iter().zip(go_on) {
            if more {
                still.push(id);
            } else {
                self.finish(id);
            }
        }
        self.running = still;
        Ok(())
    }

    /// The forward pass of a decode step over `rows` (padded to their row bucket), each
    /// attending `blocks` blocks; the logits of the first `n` rows (the real ones).
    fn decode_pass(&mut self, rows: DecodeRows, blocks: usize, n: usize) -> Tensor<B, 2> {
        let count = rows.tokens.len();
        let read = PagedRead::new(
            &rows.tables,
            blocks,
            self.engine.block_size,
            &rows.lens,
            self.device,
        );
        let pass = PagedPass {
            write_slots: rows.write_slots,
            write_rows: None,
            read: Some(read),
            prefix: None,
        };
        let batch = ForwardBatch {
            input_ids: Tensor::<B, 2, Int>::from_data(
                TensorData::new(rows.tokens, [count, 1]),
                self.device,
            ),
            position_ids: Tensor::<B, 2, Int>::from_data(
                TensorData::new(rows.positions, [count, 1]),
                self.device,
            ),
            key_mask: None,
        };
        let logits = self.model.forward_paged(&batch, &mut self.kv, &pass);
        if count > n {
            let vocab = logits.dims()[1];
            logits.slice([0..n, 0..vocab])
        } else {
            logits
        }
    }
}
