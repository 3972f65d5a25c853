//! The openings the kernels share, as `#[cube]` helpers: where a cube's rows of a head start
//! and end for the attention kernels (portable and tiled, queries and keys) and a row kernel's
//! place in its row. A helper expands inline into the kernel, statement for statement as the
//! kernel wrote it before, so the generated code, and `conrub kernels-compile`'s register and
//! spill table, are those of the kernels that spelt it out (each helper keeps the order of its
//! statements; values that size shared memory stay comptime in the kernel).

use cubecl::prelude::*;

/// A query row of a cube of an attention kernel: head `h` of batch row `bi` (its key/value head
/// `hk`), `t` queries, the cube's first row `i0`, this unit's query row `i` (valid when
/// `row_ok`), the keys the cube's rows see (`0..kend`) and this row sees (`0..my_end`).
#[derive(CubeType, Clone)]
pub(crate) struct QueryRow {
    pub h: usize,
    pub bi: usize,
    pub t: usize,
    pub hk: usize,
    pub i0: usize,
    pub i: usize,
    pub row_ok: bool,
    pub kend: usize,
    pub my_end: usize,
}

/// The portable attention kernels' query row for unit `unit` (one row per unit, `rows` rows a
/// cube: the forward and the dQ kernels).
#[cube]
pub(crate) fn unit_query_row<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    past: u32,
    unit: usize,
    #[comptime] rows: usize,
) -> QueryRow {
    let h = CUBE_POS_Y as usize;
    let bi = CUBE_POS_Z as usize;
    let t = q.shape(2);
    let group = q.shape(1) / k.shape(1);
    let hk = h / group;
    let past = past as usize;
    let i0 = CUBE_POS_X as usize * rows;
    let i = i0 + unit;
    let row_ok = i < t;
    let mut last = i0 + rows;
    if last > t {
        last = t;
    }
    let kend = past + last;
    let my_end = past + i + 1;
    QueryRow {
        h,
        bi,
        t,
        hk,
        i0,
        i,
        row_ok,
        kend,
        my_end,
    }
}

/// A query row of the tiled (tensor-core) kernels, where lanes `0..edge` of each warp of
/// `warp_size` lanes own one row of the softmax: the row, this unit's `warp` and `lane`, and
/// whether the lane owns its row.
#[derive(CubeType, Clone)]
pub(crate) struct WarpQueryRow {
    pub warp: usize,
    pub lane: usize,
    pub owner: bool,
    pub r: usize,
    pub row: QueryRow,
}

/// The tiled attention kernels' query row (the forward and the dQ kernels).
#[cube]
pub(crate) fn warp_query_row<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    past: u32,
    #[comptime] rows: usize,
    #[comptime] warp_size: usize,
    #[comptime] edge: usize,
) -> WarpQueryRow {
    let unit = UNIT_POS_X as usize;
    let warp = unit / warp_size;
    let lane = unit % warp_size;
    let h = CUBE_POS_Y as usize;
    let bi = CUBE_POS_Z as usize;
    let t = q.shape(2);
    let hk = h / (q.shape(1) / k.shape(1));
    let past = past as usize;
    let i0 = CUBE_POS_X as usize * rows;
    let mut last = i0 + rows;
    if last > t {
        last = t;
    }
    let kend = past + last;
    let owner = lane < edge;
    let r = warp * edge + lane;
    let i = i0 + r;
    let row_ok = owner && i < t;
    let my_end = past + i + 1;
    WarpQueryRow {
        warp,
        lane,
        owner,
        r,
        row: QueryRow {
            h,
            bi,
            t,
            hk,
            i0,
            i,
            row_ok,
            kend,
            my_end,
        },
    }
}

/// The keys of a cube of a dK/dV kernel: key/value head `hk` of batch row `bi`, `t` queries
/// against `s` keys, `group` query heads per key/value head, the cache's `past` keys, and the
/// cube's first key `j0` (`rows` keys a cube).
#[derive(CubeType, Clone)]
pub(crate) struct KeyBlock {
    pub hk: usize,
    pub bi: usize,
    pub t: usize,
    pub s: usize,
    pub group: usize,
    pub past: usize,
    pub j0: usize,
}

/// The dK/dV kernels' keys (portable and tiled).
#[cube]
pub(crate) fn key_block<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    past: u32,
    #[comptime] rows: usize,
) -> KeyBlock {
    let hk = CUBE_POS_Y as usize;
    let bi = CUBE_POS_Z as usize;
    let t = q.shape(2);
    let s = k.shape(2);
    let group = q.shape(1) / k.shape(1);
    let past = past as usize;
    let j0 = CUBE_POS_X as usize * rows;
    KeyBlock {
        hk,
        bi,
        t,
        s,
        group,
        past,
        j0,
    }
}

/// The first query row that sees key `j0` (the cache's `past` keys come before the queries).
#[cube]
pub(crate) fn first_query(j0: usize, past: usize) -> usize {
    let mut i_start = 0usize;
    if j0 > past {
        i_start = j0 - past;
    }
    i_start
}

/// A row kernel's place (one cube a row of a `[rows, len]` tensor `x`): the row, this unit, the
/// row's length, where it starts and the stride between its columns.
#[derive(CubeType, Clone)]
pub(crate) struct RowStart {
    pub row: usize,
    pub unit: usize,
    pub len: usize,
    pub base: usize,
    pub cs: usize,
}

/// The row kernels' opening (the log-prob row statistics and both sampling kernels).
#[cube]
pub(crate) fn row_start<F: Float>(x: &Tensor<F>) -> RowStart {
    let row = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let len = x.shape(1);
    let base = row * x.stride(0);
    let cs = x.stride(1);
    RowStart {
        row,
        unit,
        len,
        base,
        cs,
    }
}
