//! Paged KV cache: one pool of fixed-size blocks per device, shared by every layer's keys and
//! values, and the per-pass inputs that tell a forward pass where its new keys go and which keys
//! each row reads.
//!
//! A sequence's positions live in blocks of [`PagedKv::block_size`] slots named by its block
//! table: position `p` is slot `table[p / block_size] * block_size + p % block_size` of every
//! layer's `[slots, kv_heads * head_dim]` key and value tensors. Blocks are handed out and counted
//! by [`BlockAllocator`]; several sequences may share a block (a prompt's k responses share its
//! prompt blocks), and a shared block is copied before it is written ([`PagedKv::copy_block`]).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use conrub_kernels::KernelOps;

/// The shape of a model's cached keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Layers with a KV cache.
    pub layers: usize,
    /// Key (and value) width of one position in one layer: `kv_heads * head_dim`.
    pub width: usize,
    /// Element type of the cache (the model's compute dtype).
    pub dtype: DType,
}

impl KvLayout {
    /// Device bytes of one block of `block_size` positions (keys and values of every layer).
    pub fn block_bytes(&self, block_size: usize) -> u64 {
        (self.layers * 2 * block_size * self.width * self.dtype.size()) as u64
    }
}

/// One layer's keys and values in the pool, each `[num_blocks * block_size, width]`. A pass takes
/// them out (`Option::take`), writes its new rows, reads, and puts them back.
pub type PagedLayer<B> = (Option<Tensor<B, 2>>, Option<Tensor<B, 2>>);

/// Keys and values of every layer in one pool of blocks.
#[derive(Debug)]
pub struct PagedKv<B: Backend> {
    /// Per layer: keys and values, each `[num_blocks * block_size, kv_heads * head_dim]`. `None`
    /// only while a write is in flight.
    layers: Vec<PagedLayer<B>>,
    block_size: usize,
    num_blocks: usize,
    width: usize,
    dtype: DType,
}

impl<B: KernelOps> PagedKv<B> {
    /// A zeroed pool of `num_blocks` blocks of `block_size` positions for a model of `layout`.
    pub fn new(layout: KvLayout, num_blocks: usize, block_size: usize, device: &B::Device) -> Self {
        let KvLayout {
            layers: num_layers,
            width,
            dtype,
        } = layout;
        let slots = num_blocks * block_size;
        let zeros = || Some(Tensor::<B, 2>::zeros([slots, width], device).cast(dtype));
        Self {
            layers: (0..num_layers).map(|_| (zeros(), zeros())).collect(),
            block_size,
            num_blocks,
            width,
            dtype,
        }
    }

    /// Every layer's keys and values, for a model's forward pass.
    pub fn layers_mut(&mut self) -> &mut [PagedLayer<B>] {
        &mut self.layers
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Device bytes of the pool.
    pub fn bytes(&self) -> u64 {
        (self.layers.len() * 2 * self.num_blocks * self.block_size * self.width * self.dtype.size())
            as u64
    }

    /// Copies the first `len` positions of block `from` into block `to` in every layer (the copy
    /// of copy-on-write).
    pub fn copy_block(&mut self, from: u32, to: u32, len: usize) {
        if len == 0 {
            return;
        }
        let bs = self.block_size;
        let src = (from as usize * bs) as i64;
        let dst: Vec<u32> = (0..len as u32).map(|i| to * bs as u32 + i).collect();
        for (k, v) in self.layers.iter_mut() {
            for t in [k, v] {
                let pool = t.take().expect("pool present");
                let device = pool.device();
                let idx = Tensor::<B, 1, Int>::arange(src..src + len as i64, &device);
                let rows = pool.clone().select(0, idx);
                *t = Some(conrub_kernels::kv_write(pool, &dst, rows));
            }
        }
    }
}

impl<B: KernelOps> PagedKv<B> {
    /// Keys and values of `slots` in every layer, copied to the host (a preempted sequence's
    /// state).
    pub fn read_slots(&self, slots: &[u32]) -> Vec<(TensorData, TensorData)> {
        self.layers
            .iter()
            .map(|(k, v)| {
                let pool = k.as_ref().expect("pool present");
                let idx = Tensor::<B, 1, Int>::from_data(
                    TensorData::new(
                        slots.iter().map(|&s| s as i64).collect::<Vec<_>>(),
                        [slots.len()],
                    ),
                    &pool.device(),
                );
                let read = |t: &Option<Tensor<B, 2>>| {
                    t.as_ref()
                        .expect("pool present")
                        .clone()
                        .select(0, idx.clone())
                        .into_data()
                };
                (read(k), read(v))
            })
            .collect()
    }

    /// Writes what [`PagedKv::read_slots`] returned into `slots` (as many as were read).
    pub fn write_slots(&mut self, slots: &[u32], data: Vec<(TensorData, TensorData)>) {
        for ((k, v), (kd, vd)) in self.layers.iter_mut().zip(data) {
            for (t, d) in [(k, kd), (v, vd)] {
                let pool = t.take().expect("pool present");
                let rows = Tensor::<B, 2>::from_data(d, &pool.device());
                *t = Some(conrub_kernels::kv_write(pool, slots, rows));
            }
        }
    }
}

/// What one forward pass does with the paged cache.
#[derive(Debug, Clone)]
pub struct PagedPass<B: Backend> {
    /// Pool slot of every real new token, in row-major order of the batch's real tokens.
    pub write_slots: Vec<u32>,
    /// Flat indices (`row * seq + column`) of the real new tokens among the batch's `rows x seq`
    /// positions; `None` when every position is real.
    pub write_rows: Option<Tensor<B, 1, Int>>,
    /// For decode steps: the block table and length of every row, read in place by
    /// [`conrub_kernels::paged_decode_attention`]. `None` for a prefill, which attends to its own
    /// new keys (and to `prefix`).
    pub read: Option<PagedRead<B>>,
    /// For a prefill: cached positions every row of the batch reads before its own tokens (a
    /// prompt shared by all rows, prefilled once). `None`: no prefix.
    pub prefix: Option<PagedPrefix<B>>,
}

impl<B: Backend> PagedPass<B> {
    /// A prefill of unpadded tokens into `write_slots`, without a prefix.
    pub fn prefill(write_slots: Vec<u32>) -> Self {
        Self {
            write_slots,
            write_rows: None,
            read: None,
            prefix: None,
        }
    }
}

/// Cached positions that every row of a prefill reads first.
#[derive(Debug, Clone)]
pub struct PagedPrefix<B: Backend> {
    /// `[len]` pool slots of the prefix positions `0..len`, in order.
    pub slots: Tensor<B, 1, Int>,
    /// Prefix length.
    pub len: usize,
}

impl<B: Backend> PagedPrefix<B> {
    /// The prefix held at `slots` (positions `0..slots.len()`).
    pub fn new(slots: &[u32], device: &B::Device) -> Self {
        let ids: Vec<i64> = slots.iter().map(|&s| s as i64).collect();
        Self {
            slots: Tensor::from_data(TensorData::new(ids, [slots.len()]), device),
            len: slots.len(),
        }
    }
}

/// What a decode step reads: every row's block table and how many keys it attends to.
#[derive(Debug, Clone)]
pub struct PagedRead<B: Backend> {
    /// `[rows, blocks]` block ids, each row padded with block 0.
    pub tables: Tensor<B, 2, Int>,
    /// `[rows]` keys per row (its cached positions and the new one).
    pub lens: Tensor<B, 1, Int>,
    /// Positions per block.
    pub block_size: usize,
}

impl<B: Backend> PagedRead<B> {
    /// The decode-step read of rows whose block tables are `tables` (each padded with block 0 to
    /// `blocks` entries) and which hold `lens[r]` valid positions (the new one included): the
    /// tables and lengths go to the device once per step, a few words a row.
    pub fn new(
        tables: &[Vec<u32>],
        blocks: usize,
        block_size: usize,
        lens: &[usize],
        device: &B::Device,
    ) -> Self {
        let n = tables.len();
        let mut flat = Vec::with_capacity(n * blocks);
        for t in tables {
            flat.extend(t.iter().map(|&b| b as i64));
            flat.extend(std::iter::repeat_n(0i64, blocks - t.len()));
        }
        let tables = Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [n, blocks]), device);
        let lens = Tensor::<B, 1, Int>::from_data(
            TensorData::new(lens.iter().map(|&l| l as i64).collect::<Vec<_>>(), [n]),
            device,
        );
        Self {
            tables,
            lens,
            block_size,
        }
    }
}

/// Free list and reference counts of a pool's blocks.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    free: Vec<u32>,
    refs: Vec<u32>,
    peak_in_use: usize,
}

impl BlockAllocator {
    /// All `num_blocks` blocks free.
    pub fn new(num_blocks: usize) -> Self {
        Self {
            free: (0..num_blocks as u32).rev().collect(),
            refs: vec![0; num_blocks],
            peak_in_use: 0,
        }
    }

    /// Blocks not held by anyone.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Blocks held by at least one owner.
    pub fn in_use(&self) -> usize {
        self.refs.len() - self.free.len()
    }

    /// Most blocks ever in use at once.
    pub fn peak_in_use(&self) -> usize {
        self.peak_in_use
    }

    /// A free block with one owner, or `None` when the pool is exhausted. Lowest ids first.
    pub fn alloc(&mut self) -> Option<u32> {
        let b = self.free.pop()?;
        self.refs[b as usize] = 1;
        self.peak_in_use = self.peak_in_use.max(self.in_use());
        Some(b)
    }

    /// One more owner of `block`.
    pub fn share(&mut self, block: u32) {
        debug_assert!(self.refs[block as usize] > 0, "sharing a free block");
        self.refs[block as usize] += 1;
    }

    /// Owners of `block`.
    pub fn owners(&self, block: u32) -> u32 {
        self.refs[block as usize]
    }

    /// One owner fewer; the block is free again when none is left.
    pub fn release(&mut self, block: u32) {
        let r = &mut self.refs[block as usize];
        debug_assert!(*r > 0, "releasing a free block");
        *r -= 1;
        if *r == 0 {
            self.free.push(block);
        }
    }

    /// Releases every block of `table` and empties it.
    pub fn release_all(&mut self, table: &mut Vec<u32>) {
        for b in table.drain(..) {
            self.release(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_counted_shared_and_freed() {
        let mut a = BlockAllocator::new(3);
        let (x, y) = (a.alloc().unwrap(), a.alloc().unwrap());
        assert_eq!((x, y, a.free(), a.in_use()), (0, 1, 1, 2));
        a.share(x);
        a.release(x);
        assert_eq!((a.owners(x), a.free()), (1, 1));
        let mut table = vec![x, y];
        a.release_all(&mut table);
        assert!(table.is_empty());
        assert_eq!((a.free(), a.peak_in_use()), (3, 2));
        assert!(
            a.alloc().is_some()
                && a.alloc().is_some()
                && a.alloc().is_some()
                && a.alloc().is_none()
        );
    }
}
