//! Decode attention over a paged KV pool as one CubeCL kernel (CUDA, HIP and wgpu from one
//! source), used by `AttentionOps::paged_decode_attention` for `CubeBackend`. Nothing is gathered: the
//! kernel reads each row's block table and the pool in place.
//!
//! One cube per (query head, row) of `units` units. The cube walks the row's keys a tile at a
//! time:
//! 1. units look up the pool slot of each key of the tile in the row's block table (shared);
//! 2. units stage the tile's keys of the row's key/value head into shared memory (f32),
//!    neighbouring units reading neighbouring channels of one key, so loads are coalesced;
//! 3. each unit scores one key of the tile against the scaled query (staged once, shared);
//! 4. every unit takes the tile's maximum, rescales its running sum, and accumulates `p · v` for
//!    the channels it owns (`c = unit + i · units`), reading the values straight from the pool
//!    (neighbouring units, neighbouring channels).
//!
//! Every unit runs the same online softmax over the same scores, so each ends with the same
//! denominator and writes its own channels: no reduction across units is needed. Scores, softmax
//! and accumulation are f32 whatever F is.
//!
//! Shared memory: `(tile · head_dim + head_dim + 2 · tile) · 4` bytes, the tile sized to the
//! device's limit (at most 48 KiB, at most 64 keys): 62 keys at head_dim 128 under lavapipe's
//! 32 KiB. Lavapipe's loop limiter (65,535 iterations per invocation, see `cube_attention`)
//! allows about `65,535 / (tile · head_dim / units + 3 · tile)` tiles: some 9,000 keys per row at
//! head_dim 128; GPU drivers have no such limit.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::ir::HardwareProperties;
use cubecl::prelude::*;

use crate::attention::PagedLayout;
use crate::cube_attention::{to_dtype, unroll_factor, MAX_HEAD_DIM, MAX_SHARED_BYTES};

/// Units per cube, at most.
const UNITS: usize = 64;
/// Keys per staged tile, at most.
const MAX_TILE: usize = 64;
/// The running maximum before any key.
const NEG: f32 = crate::ATTENTION_MASKED_LSE;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn paged_decode_kernel<F: Float, I: Numeric>(
    q: &Tensor<F>,
    k_pool: &Tensor<F>,
    v_pool: &Tensor<F>,
    tables: &Tensor<I>,
    lens: &Tensor<I>,
    out: &mut Tensor<F>,
    part_acc: &mut Tensor<f32>,
    part_ml: &mut Tensor<f32>,
    block_size: u32,
    scale: f32,
    split_keys: u32,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
    #[comptime] tile: usize,
    #[comptime] unroll: usize,
    #[comptime] split: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let h = CUBE_POS_X as usize;
    let r = CUBE_POS_Y as usize;
    let z = CUBE_POS_Z as usize;
    let unit = UNIT_POS_X as usize;
    let heads = q.shape(1);
    let kv_heads = k_pool.shape(1) / head_dim;
    let hk = h / (heads / kv_heads);
    let bs = block_size as usize;
    let mut len = u32::cast_from(lens[r * lens.stride(0)]) as usize;
    // With splits, cube z walks keys [z · split_keys, (z + 1) · split_keys) of the row.
    let mut first = 0usize;
    if split {
        first = z * split_keys as usize;
        let end = first + split_keys as usize;
        if len > end {
            len = end;
        }
    }
    let tb = r * tables.stride(0);
    let t1 = tables.stride(1);
    let k0 = k_pool.stride(0);
    let k1 = k_pool.stride(1);
    let v0 = v_pool.stride(0);
    let v1 = v_pool.stride(1);
    let kc = hk * head_dim;

    let mut qs = SharedMemory::<f32>::new(head_dim);
    let mut ks = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut ps = SharedMemory::<f32>::new(tile);
    let mut slot = SharedMemory::<u32>::new(tile);

    let qb = r * q.stride(0) + h * q.stride(1);
    let mut c = unit;
    while c < head_dim {
        qs[c] = f32::cast_from(q[qb + c * q.stride(3)]) * scale;
        c += units;
    }

    let per_unit = comptime!(head_dim.div_ceil(units));
    let mut acc = Array::<f32>::new(per_unit);
    #[unroll]
    for i in 0..per_unit {
        acc[i] = f32::new(0.0);
    }
    let mut m = f32::new(NEG);
    let mut l = f32::new(0.0);
    let mut j0 = first;
    while j0 < len {
        // 1. Slots of the tile's keys.
        let mut jj = unit;
        while jj < tile {
            let p = j0 + jj;
            let mut s = 0u32;
            if p < len {
                let b = u32::cast_from(tables[tb + (p / bs) * t1]);
                s = b * block_size + u32::cast_from(p % bs);
            }
            slot[jj] = s;
            jj += units;
        }
        sync_cube();
        // 2. The tile's keys, channel-fastest.
        let mut idx = unit;
        while idx < comptime!(tile * head_dim) {
            let j = idx / head_dim;
            let mut x = f32::new(0.0);
            if j0 + j < len {
                x = f32::cast_from(k_pool[slot[j] as usize * k0 + (kc + idx % head_dim) * k1]);
            }
            ks[idx] = x;
            idx += units;
        }
        sync_cube();
        // 3. One score per key.
        let mut jj = unit;
        while jj < tile {
            let mut sc = f32::new(NEG);
            if j0 + jj < len {
                let mut dot = f32::new(0.0);
                for c0 in 0..comptime!(head_dim / unroll) {
                    #[unroll]
                    for u in 0..unroll {
                        let c = c0 * unroll + u;
                        dot += qs[c] * ks[jj * head_dim + c];
                    }
                }
                sc = dot;
            }
            ps[jj] = sc;
            jj += units;
        }
        sync_cube();
        // 4. Online softmax over the tile, values of this unit's channels.
        let mut n = len - j0;
        if n > tile {
            n = tile;
        }
        let mut tmax = f32::new(NEG);
        for jj in 0..n {
            tmax = f32::max(tmax, ps[jj]);
        }
        let mn = f32::max(m, tmax);
        let alpha = (m - mn).exp();
        l *= alpha;
        #[unroll]
        for i in 0..per_unit {
            acc[i] = acc[i] * alpha;
        }
        for jj in 0..n {
            let p = (ps[jj] - mn).exp();
            l += p;
            let vb = slot[jj] as usize * v0;
            #[unroll]
            for i in 0..per_unit {
                let c = unit + i * units;
                if c < head_dim {
                    acc[i] += p * f32::cast_from(v_pool[vb + (kc + c) * v1]);
                }
            }
        }
        m = mn;
        sync_cube();
        j0 += tile;
    }

    if split {
        // The split's unnormalised sum and its max and denominator, for the combine.
        let pb = r * part_acc.stride(0) + h * part_acc.stride(1) + z * part_acc.stride(2);
        #[unroll]
        for i in 0..per_unit {
            let c = unit + i * units;
            if c < head_dim {
                part_acc[pb + c * part_acc.stride(3)] = acc[i];
            }
        }
        if unit == 0 {
            let mb = r * part_ml.stride(0) + h * part_ml.stride(1) + z * part_ml.stride(2);
            part_ml[mb] = m;
            part_ml[mb + part_ml.stride(3)] = l;
        }
    } else {
        let mut inv = f32::new(0.0);
        if l > f32::new(0.0) {
            inv = f32::new(1.0) / l;
        }
        let ob = r * out.stride(0) + h * out.stride(1);
        #[unroll]
        for i in 0..per_unit {
            let c = unit + i * units;
            if c < head_dim {
                out[ob + c * out.stride(3)] = F::cast_from(acc[i] * inv);
            }
        }
    }
}

/// The combine of flash-decoding: one cube per (query head, row), units over the channels. With
/// `M` the largest split max, `out = Σ_z e^(m_z − M) acc_z / Σ_z e^(m_z − M) l_z` (splits past the
/// row's keys have `l = 0` and add nothing; a row with no key gets 0, as unsplit).
#[cube(launch)]
fn paged_combine_kernel<F: Float>(
    part_acc: &Tensor<f32>,
    part_ml: &Tensor<f32>,
    out: &mut Tensor<F>,
    #[comptime] head_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let h = CUBE_POS_X as usize;
    let r = CUBE_POS_Y as usize;
    let splits = part_ml.shape(2);
    let mb = r * part_ml.stride(0) + h * part_ml.stride(1);
    let ms = part_ml.stride(2);
    let l1 = part_ml.stride(3);
    let mut big = f32::new(NEG);
    for z in 0..splits {
        big = f32::max(big, part_ml[mb + z * ms]);
    }
    let mut total = f32::new(0.0);
    for z in 0..splits {
        total += (part_ml[mb + z * ms] - big).exp() * part_ml[mb + z * ms + l1];
    }
    let mut inv = f32::new(0.0);
    if total > f32::new(0.0) {
        inv = f32::new(1.0) / total;
    }
    let pb = r * part_acc.stride(0) + h * part_acc.stride(1);
    let ob = r * out.stride(0) + h * out.stride(1);
    let mut c = UNIT_POS_X as usize;
    while c < head_dim {
        let mut sum = f32::new(0.0);
        for z in 0..splits {
            let w = (part_ml[mb + z * ms] - big).exp();
            sum += w * part_acc[pb + z * part_acc.stride(2) + c * part_acc.stride(3)];
        }
        out[ob + c * out.stride(3)] = F::cast_from(sum * inv);
        c += CUBE_DIM_X as usize;
    }
}

/// Units per cube and keys per tile for `head_dim` on a device.
pub(crate) fn geometry(hw: &HardwareProperties, head_dim: usize) -> (usize, usize) {
    let mut units = UNITS;
    while units > 1 && (units as u32 > hw.max_cube_dim.0 || units as u32 > hw.max_units_per_cube) {
        units /= 2;
    }
    let budget = hw.max_shared_memory_size.clamp(4 * 1024, MAX_SHARED_BYTES);
    let tile = ((budget / 4).saturating_sub(head_dim) / (head_dim + 2)).clamp(1, MAX_TILE);
    (units, tile)
}

/// The kernel's launch (see `AttentionOps::paged_decode_attention`; shapes are checked by the caller).
pub(crate) fn paged_decode<R: CubeRuntime>(
    q: CubeTensor<R>,
    k_pool: CubeTensor<R>,
    v_pool: CubeTensor<R>,
    tables: CubeTensor<R>,
    lens: CubeTensor<R>,
    layout: PagedLayout,
) -> CubeTensor<R> {
    let [rows, heads, _, d] = q.shape().dims::<4>();
    assert!(
        (1..=MAX_HEAD_DIM).contains(&d),
        "paged_decode_attention: head_dim {d} outside 1..={MAX_HEAD_DIM}"
    );
    let dtype = q.dtype;
    let (k_pool, v_pool) = (to_dtype(k_pool, dtype), to_dtype(v_pool, dtype));
    assert_eq!(
        lens.dtype, tables.dtype,
        "paged_decode_attention: tables and lens differ in dtype"
    );
    let out = empty_device_dtype::<R>(
        q.client.clone(),
        q.device.clone(),
        Shape::new([rows, heads, 1, d]),
        dtype,
    );
    if rows * heads == 0 {
        return out;
    }
    let dtypes = [dtype.into(), tables.dtype.into()];
    let client = q.client.clone();
    let (_, tile) = geometry(&client.properties().hardware, d);
    let keys_max = tables.shape().dims::<2>()[1] * layout.block_size;
    let splits = kv_splits(
        &client.properties().hardware,
        layout,
        rows * heads,
        keys_max,
        tile,
    );
    let f32_zeros = |shape: [usize; 4]| {
        empty_device_dtype::<R>(
            q.client.clone(),
            q.device.clone(),
            Shape::new(shape),
            DType::F32,
        )
    };
    let (part_acc, part_ml) = match splits {
        Some((n, _)) => (
            f32_zeros([rows, heads, n, d]),
            f32_zeros([rows, heads, n, 2]),
        ),
        None => (f32_zeros([1, 1, 1, 1]), f32_zeros([1, 1, 1, 1])),
    };
    let args = [
        q.into_tensor_arg(),
        k_pool.into_tensor_arg(),
        v_pool.into_tensor_arg(),
        tables.into_tensor_arg(),
        lens.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        part_acc.clone().into_tensor_arg(),
        part_ml.clone().into_tensor_arg(),
    ];
    launch_paged_decode(&client, [rows, heads, d], layout, splits, args, dtypes);
    if splits.is_some() {
        launch_paged_combine(
            &client,
            [rows, heads, d],
            [
                part_acc.into_tensor_arg(),
                part_ml.into_tensor_arg(),
                out.clone().into_tensor_arg(),
            ],
            dtype.into(),
        );
    }
    out
}

/// Keys per split below which splitting is not worth a second kernel.
const MIN_SPLIT_KEYS: usize = 256;
/// Splits of one row, at most.
const MAX_SPLITS: usize = 64;

/// `Some((splits, keys per split))` when the rows' keys are split (flash-decoding), `None` when
/// each (head, row) runs in one cube. `layout.kv_splits` > 0 asks for that many (1: never; at
/// most [`MAX_SPLITS`] and one per tile);
/// 0 splits only when `cubes` (heads x rows) leave the device's SMs short of two cubes each and
/// rows may hold at least two splits of [`MIN_SPLIT_KEYS`]. `keys_max` bounds every row's keys
/// (the block table's width times the block size); a split's keys are a multiple of `tile`.
pub fn kv_splits(
    hw: &HardwareProperties,
    layout: PagedLayout,
    cubes: usize,
    keys_max: usize,
    tile: usize,
) -> Option<(usize, usize)> {
    let wanted = match layout.kv_splits {
        0 => {
            let target = 2 * hw.num_streaming_multiprocessors.unwrap_or(0) as usize;
            if cubes == 0 || cubes >= target {
                return None;
            }
            target
                .div_ceil(cubes)
                .min(keys_max / MIN_SPLIT_KEYS)
                .min(MAX_SPLITS)
        }
        n => n.min(keys_max.div_ceil(tile)).min(MAX_SPLITS),
    };
    if wanted < 2 {
        return None;
    }
    let split_keys = keys_max.div_ceil(wanted).next_multiple_of(tile);
    Some((keys_max.div_ceil(split_keys), split_keys))
}

/// Launches [`paged_decode_kernel`] for `[rows, heads, head_dim]`: `[q, k_pool, v_pool, tables,
/// lens, out, part_acc, part_ml]`, dtypes `[float, int]`, split as [`kv_splits`] says (the
/// partial tensors are written only when split, `out` only when not). The backend and the
/// offline CUDA compile both launch here.
pub(crate) fn launch_paged_decode<R: Runtime>(
    client: &ComputeClient<R>,
    [rows, heads, d]: [usize; 3],
    layout: PagedLayout,
    splits: Option<(usize, usize)>,
    [q, k_pool, v_pool, tables, lens, out, part_acc, part_ml]: [TensorArg<R>; 8],
    dtypes: [StorageType; 2],
) {
    let (units, tile) = geometry(&client.properties().hardware, d);
    let (n, split_keys) = splits.unwrap_or((1, 0));
    paged_decode_kernel::launch::<R>(
        client,
        CubeCount::Static(heads as u32, rows as u32, n as u32),
        CubeDim::new_1d(units as u32),
        q,
        k_pool,
        v_pool,
        tables,
        lens,
        out,
        part_acc,
        part_ml,
        layout.block_size as u32,
        layout.scale as f32,
        split_keys as u32,
        d,
        units,
        tile,
        unroll_factor(d),
        splits.is_some(),
        dtypes,
    );
}

/// Launches [`paged_combine_kernel`]: `[part_acc, part_ml, out]`.
pub(crate) fn launch_paged_combine<R: Runtime>(
    client: &ComputeClient<R>,
    [rows, heads, d]: [usize; 3],
    [part_acc, part_ml, out]: [TensorArg<R>; 3],
    dtype: StorageType,
) {
    let units = d.min(UNITS).next_power_of_two().min(UNITS);
    paged_combine_kernel::launch::<R>(
        client,
        CubeCount::Static(heads as u32, rows as u32, 1),
        CubeDim::new_1d(units as u32),
        part_acc,
        part_ml,
        out,
        d,
        dtype,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hw(sms: Option<u32>) -> HardwareProperties {
        HardwareProperties {
            load_width: 128,
            plane_size_min: 32,
            plane_size_max: 32,
            max_bindings: 1024,
            max_shared_memory_size: 48 * 1024,
            max_cube_count: (u32::MAX, u32::MAX, u32::MAX),
            max_units_per_cube: 1024,
            max_cube_dim: (1024, 1024, 64),
            num_streaming_multiprocessors: sms,
            num_tensor_cores: None,
            min_tensor_cores_dim: None,
            num_cpu_cores: None,
            max_vector_size: cubecl::ir::VectorSize::MAX,
        }
    }

    #[test]
    fn keys_are_split_only_where_the_batch_leaves_the_device_idle() {
        let auto = PagedLayout::new(16, 1.0);
        // An H100 (132 SMs): one row of 32,768 keys and 32 heads fills 32 cubes of 264 wanted.
        let (n, keys) = kv_splits(&hw(Some(132)), auto, 32, 32_768, 64).unwrap();
        assert_eq!(n, 9);
        assert!(keys % 64 == 0 && n * keys >= 32_768 && (n - 1) * keys < 32_768);
        // 64 rows x 32 heads already give 2,048 cubes: no split.
        assert_eq!(kv_splits(&hw(Some(132)), auto, 2048, 2048, 64), None);
        // Short rows are not split (fewer than two splits of 256 keys).
        assert_eq!(kv_splits(&hw(Some(132)), auto, 32, 300, 64), None);
        // No SM count (lavapipe, CPU runtimes): no split unless asked.
        assert_eq!(kv_splits(&hw(None), auto, 1, 32_768, 64), None);
        let asked = PagedLayout {
            kv_splits: 4,
            ..auto
        };
        assert_eq!(kv_splits(&hw(None), asked, 1, 1000, 64), Some((4, 256)));
        // Never more splits than tiles, and 1 means never.
        assert_eq!(kv_splits(&hw(None), asked, 1, 100, 64), Some((2, 64)));
        assert_eq!(kv_splits(&hw(None), asked, 1, 64, 64), None);
        let never = PagedLayout {
            kv_splits: 1,
            ..auto
        };
        assert_eq!(kv_splits(&hw(Some(132)), never, 1, 32_768, 64), None);
    }
}
