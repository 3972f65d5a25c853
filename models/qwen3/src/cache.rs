//! Key/value cache for incremental decoding.

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor};

/// Per-layer key and value buffers, each `[batch, kv_heads, capacity, head_dim]`; only the first
/// `len` positions (see [`KvCache::len`]) hold data.
pub type LayerCache<B> = (Option<Tensor<B, 4>>, Option<Tensor<B, 4>>);

/// Positions added to a buffer whenever it must grow (at least; growth is geometric).
const GROW_BLOCK: usize = 256;

/// Writes `new` (`[batch, heads, n, dim]`) at positions `len..len + n` of `buf`, growing it when
/// full, and returns the updated buffer. Growth doubles the capacity, so a long decode copies the
/// cache O(log n) times instead of once per step as concatenation would.
pub(crate) fn append<B: Backend>(
    buf: Option<Tensor<B, 4>>,
    new: Tensor<B, 4>,
    len: usize,
) -> Tensor<B, 4> {
    let [b, h, n, d] = new.dims();
    let needed = len + n;
    let buf = match buf {
        Some(buf) if buf.dims()[2] >= needed => buf,
        old => {
            let capacity = needed
                .max(2 * old.as_ref().map(|t| t.dims()[2]).unwrap_or(0))
                .next_multiple_of(GROW_BLOCK);
            let fresh = Tensor::<B, 4>::zeros([b, h, capacity, d], &new.device()).cast(new.dtype());
            match old {
                Some(old) => fresh.slice_assign(
                    [0..b, 0..h, 0..len, 0..d],
                    old.slice([0..b, 0..h, 0..len, 0..d]),
                ),
                None => fresh,
            }
        }
    };
    buf.slice_assign([0..b, 0..h, len..needed, 0..d], new)
}

/// Cached keys and values of every layer plus the validity of every cached position.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    layers: Vec<LayerCache<B>>,
    len: usize,
    /// Validity of cached positions as 0/1 integers. Kept as Int, not Bool: burn-flex 0.21 stores
    /// Bool tensors made from host data and Bool tensors produced by comparisons in two different
    /// dtypes and refuses to concatenate them.
    key_mask: Option<Tensor<B, 2, Int>>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for a model with `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: (0..num_layers).map(|_| (None, None)).collect(),
            len: 0,
            key_mask: None,
        }
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn layer_mut(&mut self, i: usize) -> &mut LayerCache<B> {
        &mut self.layers[i]
    }

    /// Validity of all cached positions followed by the new ones, `[batch, len + new]`, or `None`
    /// when nothing is padded.
    pub(crate) fn combined_mask(
        &self,
        new_mask: Option<Tensor<B, 2, Bool>>,
        batch: usize,
        new: usize,
        device: &B::Device,
    ) -> Option<Tensor<B, 2, Bool>> {
        let ones = |n: usize| Tensor::<B, 2, Int>::ones([batch, n], device);
        let new_mask = new_mask.map(|m| m.int());
        let full = match (self.key_mask.clone(), new_mask) {
            (None, None) => None,
            (Some(old), None) => Some(Tensor::cat(vec![old, ones(new)], 1)),
            (None, Some(m)) if self.len == 0 => Some(m),
            (None, Some(m)) => Some(Tensor::cat(vec![ones(self.len), m], 1)),
            (Some(old), Some(m)) => Some(Tensor::cat(vec![old, m], 1)),
        };
        full.map(|m| m.equal_elem(1))
    }

    pub(crate) fn commit(&mut self, new: usize, full_mask: Option<Tensor<B, 2, Bool>>) {
        self.len += new;
        self.key_mask = full_mask.map(|m| m.int());
    }

    /// Keeps only the given batch rows (e.g. the sequences still generating).
    pub fn retain_rows(&mut self, rows: &[usize], device: &B::Device) {
        let idx = Tensor::<B, 1, Int>::from_ints(
            rows.iter()
                .map(|&r| r as i64)
                .collect::<Vec<_>>()
                .as_slice(),
            device,
        );
        for (k, v) in self.layers.iter_mut() {
            *k = k.take().map(|t| t.select(0, idx.clone()));
            *v = v.take().map(|t| t.select(0, idx.clone()));
        }
        self.key_mask = self.key_mask.take().map(|m| m.select(0, idx));
    }
}
