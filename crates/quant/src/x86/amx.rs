//! AMX (Advanced Matrix Extensions) products of bf16 weights with
//! bf16-rounded activations, for the `Amx` level: `tdpbf16ps` multiplies a
//! 16 x 32 tile of weights (16 weight rows, 32 elements of `k`) by a tile of
//! 16 activation rows packed in AMX's pair layout, into 16 x 16 f32
//! accumulators.
//!
//! Owns: the OS permission request for the tile data state
//! ([`request_tile_permission`], once per process, at level detection), the
//! packing of activations ([`pack_acts`]) and the GEMM ([`dot_rows`]).
//!
//! Numerics (batch invariance): an output element `(i, r)` is the
//! accumulator tile element of weight row `r` and activation row `i`, which
//! starts at zero and takes the `k / 32` steps in order; each step depends
//! only on that weight row and that activation row. Nothing else (the
//! number of rows, the tile an element falls in, padding rows and columns,
//! which are zero or duplicates) touches it, so every `m` and every split of
//! the weight rows gives the same bits. Requires `k % 32 == 0`.
//!
//! Tile state: [`dot_rows`] loads its configuration on entry and releases
//! the tiles before it returns; no tile register is live between calls.

use super::Prefetch;
use crate::gemm::OutMat;
use std::arch::asm;

/// Elements of `k` per tile step (64 bytes of bf16).
pub(crate) const K_STEP: usize = 32;
/// Rows (weight rows, activation rows) per tile.
const T: usize = 16;

/// Asks Linux for the AMX tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`); true if granted. Without it the first tile
/// instruction would kill the process.
#[cfg(target_os = "linux")]
pub(crate) fn request_tile_permission() -> bool {
    const SYS_ARCH_PRCTL: usize = 158;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let ret: isize;
    // SAFETY: the arch_prctl system call reads only its two integer
    // arguments; `syscall` clobbers rcx and r11, declared below.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// Other systems: no tile state is requested, so the level is not used.
#[cfg(not(target_os = "linux"))]
pub(crate) fn request_tile_permission() -> bool {
    false
}

/// Bytes of packed activations for `m` rows of `k` (`k % 32 == 0`): whole
/// groups of 16 rows.
pub(crate) fn packed_len(m: usize, k: usize) -> usize {
    m.div_ceil(T) * T * k
}

/// Packs `m` rows of `k` bf16 activations (`x`, row-major) into `dst`
/// (`packed_len(m, k)` elements): for each group of 16 rows and each step
/// of 32 elements, a 16 x 16 tile of pairs whose row `p`, column `c` holds
/// elements `2p, 2p + 1` of the step for activation row `c`; rows past `m`
/// are zero.
pub(crate) fn pack_acts(x: &[u16], m: usize, k: usize, dst: &mut Vec<u16>) {
    dst.clear();
    dst.resize(packed_len(m, k), 0);
    let steps = k / K_STEP;
    for g in 0..m.div_ceil(T) {
        for c in 0..T.min(m - g * T) {
            let row = &x[(g * T + c) * k..(g * T + c + 1) * k];
            for s in 0..steps {
                let tile = &mut dst[(g * steps + s) * T * 2 * T..][..2 * T * T];
                for p in 0..T {
                    let e = s * K_STEP + 2 * p;
                    tile[p * 2 * T + 2 * c] = row[e];
                    tile[p * 2 * T + 2 * c + 1] = row[e + 1];
                }
            }
        }
    }
}

/// The 64-byte tile configuration (palette 1): tiles 0-3 accumulators,
/// 4-5 weights, 6-7 activations, each 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// [`CONFIG`] for `m` activation rows: below 16, the accumulator and
/// activation tiles hold only `m` columns (`4m` bytes a row), which costs the
/// TMUL less (on Sapphire Rapids a `tdpbf16ps` with one column takes about
/// half the time of a full one); each element's arithmetic is the same.
fn config_for(m: usize) -> TileConfig {
    let n = if m < T { (4 * m) as u16 } else { 64 };
    let mut colsb = CONFIG.colsb;
    for t in [0, 1, 2, 3, 6, 7] {
        colsb[t] = n;
    }
    TileConfig { colsb, ..CONFIG }
}

/// `tileloadd tmm$n, [p + stride]`.
macro_rules! tile_load {
    ($n:literal, $p:expr, $stride:expr) => {
        asm!(concat!("tileloadd tmm", $n, ", [{p} + {s}*1]"), p = in(reg) $p, s = in(reg) $stride, options(nostack, readonly))
    };
}

/// `tilestored [p + stride], tmm$n`.
macro_rules! tile_store {
    ($n:literal, $p:expr, $stride:expr) => {
        asm!(concat!("tilestored [{p} + {s}*1], tmm", $n), p = in(reg) $p, s = in(reg) $stride, options(nostack))
    };
}

/// `tdpbf16ps tmm$c, tmm$a, tmm$b`.
macro_rules! tile_dp {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem)
        )
    };
}

/// First weight row of 16-row group `g`: whole groups, the last one moved
/// back to end at `n_rows` (its rows overlap the previous group's and get the
/// same values); `g` past the last group repeats it, so that groups can go in
/// pairs. `n_rows >= 16`.
fn group_start(g: usize, n_rows: usize) -> usize {
    (g.min(n_rows.div_ceil(T) - 1) * T).min(n_rows - T)
}

/// `out[i][r] = dot(w row r, x row i)` through AMX tiles: `w` holds
/// `n_rows` rows of `k` bf16 (`k % 32 == 0`), `packed` the activations
/// from [`pack_acts`] for `m` rows.
///
/// # Safety
/// The CPU supports AMX-TILE and AMX-BF16 and the process holds the tile
/// permission ([`request_tile_permission`] returned true); lengths as
/// described; `out` holds every `(i, r)` for `i < m`, `r < n_rows`, and no
/// other thread writes those elements.
pub(crate) unsafe fn dot_rows(
    w: &[u8],
    n_rows: usize,
    k: usize,
    packed: &[u16],
    m: usize,
    out: OutMat,
) {
    if n_rows < T {
        // Too few rows for a tile: pad a copy with zero rows.
        let mut padded = vec![0u8; T * k * 2];
        padded[..w.len()].copy_from_slice(w);
        let mut res = vec![0.0f32; m * T];
        let view = OutMat {
            ptr: res.as_mut_ptr(),
            stride: T,
        };
        // SAFETY: 16 rows now; `res` holds m rows of 16.
        unsafe { dot_rows(&padded, T, k, packed, m, view) };
        for i in 0..m {
            for r in 0..n_rows {
                // SAFETY: (i, r) is inside the caller's output.
                unsafe { out.set(i, r, res[i * T + r]) };
            }
        }
        return;
    }
    let rb = 2 * k;
    let steps = k / K_STEP;
    let m_groups = m.div_ceil(T);
    let tile_elems = 2 * T * T;
    let mut acc = [0.0f32; 4 * T * T];
    let wp = w.as_ptr();
    // SAFETY: tile instructions per the contract; every tile load reads 16
    // rows of 64 bytes inside `w` (groups end at or before `n_rows`, steps
    // before `k`) or inside `packed` (`m_groups` groups of `steps` tiles);
    // stores go to `acc`.
    unsafe {
        let config = config_for(m);
        asm!("ldtilecfg [{}]", in(reg) &config as *const TileConfig, options(nostack, readonly));
        for p in 0..n_rows.div_ceil(T).div_ceil(2) {
            let pair = [group_start(2 * p, n_rows), group_start(2 * p + 1, n_rows)];
            let (a0, a1) = (wp.add(pair[0] * rb), wp.add(pair[1] * rb));
            // Decode reads each weight once: fetch this pair's next steps.
            let next = Prefetch {
                base: a0,
                len: if m_groups <= 2 { rb * T } else { 0 },
            };
            let mut mg = 0;
            while mg < m_groups {
                let two = mg + 1 < m_groups;
                let b0 = packed.as_ptr().add(mg * steps * tile_elems);
                let b1 = packed
                    .as_ptr()
                    .add((mg + two as usize) * steps * tile_elems);
                zero_accumulators();
                for s in 0..steps {
                    if next.len > 0 {
                        for r in 0..T {
                            next.lines(r * rb + (s + 4) * 64, 1);
                            Prefetch { base: a1, ..next }.lines(r * rb + (s + 4) * 64, 1);
                        }
                    }
                    step(
                        [a0.add(s * 64), a1.add(s * 64)],
                        rb,
                        [b0.add(s * tile_elems), b1.add(s * tile_elems)],
                        two,
                    );
                }
                store_tiles(&mut acc, pair, mg, two, m, out);
                mg += 2;
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    }
}

/// Zeroes accumulator tiles 0-3.
///
/// # Safety
/// Inside a tile configuration.
#[inline(always)]
unsafe fn zero_accumulators() {
    // SAFETY: per this function's contract.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
    }
}

/// One step of `k`: weight tiles 4-5 from `weights` (16 rows `stride`
/// bytes apart), activation tile 6 from `acts[0]` into accumulators 0-1,
/// and when `two` activation tile 7 from `acts[1]` into accumulators 2-3.
///
/// # Safety
/// Inside a tile configuration; each pointer starts 16 rows of 64
/// readable bytes (the weights' `stride` apart, the activations' 64).
#[inline(always)]
unsafe fn step(weights: [*const u8; 2], stride: usize, acts: [*const u16; 2], two: bool) {
    // SAFETY: per this function's contract.
    unsafe {
        tile_load!("4", weights[0], stride);
        tile_load!("5", weights[1], stride);
        tile_load!("6", acts[0], 64usize);
        tile_dp!("0", "4", "6");
        tile_dp!("1", "5", "6");
        if two {
            tile_load!("7", acts[1], 64usize);
            tile_dp!("2", "4", "7");
            tile_dp!("3", "5", "7");
        }
    }
}

/// Stores accumulator tiles 0-3 to `acc` and writes the elements they hold
/// to `out`: tile `t` is (weight group `pair[t % 2]`, activation group `mg
/// + t / 2`), tiles 2-3 only when `two`.
///
/// # Safety
/// Inside a tile configuration with tiles 0-3 live; `out` holds the
/// elements of those groups (as [`dot_rows`]'s contract).
#[inline(always)]
unsafe fn store_tiles(
    acc: &mut [f32; 4 * T * T],
    pair: [usize; 2],
    mg: usize,
    two: bool,
    m: usize,
    out: OutMat,
) {
    // SAFETY: per this function's contract; each store writes 16 rows of
    // 64 bytes inside `acc`.
    unsafe {
        let ap = acc.as_mut_ptr();
        tile_store!("0", ap, 64usize);
        tile_store!("1", ap.add(T * T), 64usize);
        tile_store!("2", ap.add(2 * T * T), 64usize);
        tile_store!("3", ap.add(3 * T * T), 64usize);
        let tiles = [
            (pair[0], mg),
            (pair[1], mg),
            (pair[0], mg + 1),
            (pair[1], mg + 1),
        ];
        for (t, &(r0, g)) in tiles.iter().enumerate().take(if two { 4 } else { 2 }) {
            let tile = &acc[t * T * T..(t + 1) * T * T];
            for c in 0..T.min(m - g * T) {
                for r in 0..T {
                    out.set(g * T + c, r0 + r, tile[r * T + c]);
                }
            }
        }
    }
}

/// Writes bf16 weight tiles for [`dot_rows_fused`].
pub(crate) trait TileSource {
    /// Writes elements `32 s..32 s + 32` of weight rows `r0..r0 + 16` as
    /// bf16 to `dst`, 64 bytes a row; `slot` (0 or 1) says which group of
    /// the pair the rows are, so a source may keep state per row of each.
    ///
    /// # Safety
    /// Rows `r0..r0 + 16` and step `s` exist; `dst` holds 16 x 32 values.
    unsafe fn fill(&mut self, r0: usize, s: usize, slot: usize, dst: *mut u16);

    /// The bytes of weight rows `r0..r1` (adjacent in memory), to prefetch
    /// while the rows before them are multiplied.
    fn rows(&self, r0: usize, r1: usize) -> Prefetch;
}

/// 16 x 32 bf16 values, aligned for the tile loads.
#[repr(C, align(64))]
struct TileBuf([u16; 2 * T * T]);

/// [`dot_rows`] for weights that `src` produces a tile at a time, for up to
/// 32 activation rows: each step's two weight tiles are written to an L1
/// buffer just before their loads (alternating buffers, so the writes of
/// one step overlap the products of the previous one), never to a panel.
/// The source rows of the next pair of groups are prefetched, spread over
/// the steps (the 32 rows a step reads are 32 short interleaved streams,
/// which the hardware prefetchers follow poorly). Each element's arithmetic
/// is [`dot_rows`]'s on the weights `src` writes: the same bits.
///
/// # Safety
/// As [`dot_rows`], with `16 <= n_rows` and `m <= 32`; the caller enables
/// the features `src` needs (this inlines into it).
#[inline(always)]
pub(crate) unsafe fn dot_rows_fused<S: TileSource>(
    n_rows: usize,
    k: usize,
    packed: &[u16],
    m: usize,
    out: OutMat,
    src: &mut S,
) {
    debug_assert!(n_rows >= T && m <= 2 * T);
    let steps = k / K_STEP;
    let tile_elems = 2 * T * T;
    let two = m > T;
    let mut acc = [0.0f32; 4 * T * T];
    let mut bufs = [
        TileBuf([0; 2 * T * T]),
        TileBuf([0; 2 * T * T]),
        TileBuf([0; 2 * T * T]),
        TileBuf([0; 2 * T * T]),
    ];
    // SAFETY: tile instructions per the contract; weight tiles load from
    // `bufs` (16 rows of 64 bytes each), activation tiles from `packed`
    // (one or two groups of `steps` tiles); `src` writes rows and steps
    // that exist (groups end at or before `n_rows`, steps before `k`).
    unsafe {
        let config = config_for(m);
        asm!("ldtilecfg [{}]", in(reg) &config as *const TileConfig, options(nostack, readonly));
        let b0 = packed.as_ptr();
        let b1 = packed
            .as_ptr()
            .add(if two { steps * tile_elems } else { 0 });
        let pairs = n_rows.div_ceil(T).div_ceil(2);
        for p in 0..pairs {
            let pair = [group_start(2 * p, n_rows), group_start(2 * p + 1, n_rows)];
            let next = if p + 1 < pairs {
                let r0 = group_start(2 * p + 2, n_rows);
                src.rows(r0, (r0 + 2 * T).min(n_rows))
            } else {
                Prefetch {
                    base: std::ptr::null(),
                    len: 0,
                }
            };
            let per_step = next.per_step(steps);
            zero_accumulators();
            for s in 0..steps {
                next.lines(s * per_step, per_step);
                let (w0, w1) = bufs.split_at_mut(2);
                let (d0, d1) = if s % 2 == 0 {
                    (w0[0].0.as_mut_ptr(), w0[1].0.as_mut_ptr())
                } else {
                    (w1[0].0.as_mut_ptr(), w1[1].0.as_mut_ptr())
                };
                src.fill(pair[0], s, 0, d0);
                src.fill(pair[1], s, 1, d1);
                step(
                    [d0 as *const u8, d1 as *const u8],
                    64,
                    [b0.add(s * tile_elems), b1.add(s * tile_elems)],
                    two,
                );
            }
            store_tiles(&mut acc, pair, 0, two, m, out);
        }
        asm!("tilerelease", options(nostack, nomem));
    }
}
