//! Single-precision matrix multiply used by every layer.
//!
//! Row-major `C (m×n) = alpha · op(A) · op(B) + beta · C`, where `op` optionally transposes.
//!
//! Every tier ([`crate::kernels::isa`]) runs the same blocked product: `op(B)` is packed into `NR`-column
//! panels and `op(A)` into `MR`-row panels (the transposes happen during packing), and an `MR×NR`
//! register tile (broadcast A times loaded B) is updated per `k` step. The tile is 12×32 on
//! AVX-512 (24 zmm accumulators), 6×16 on AVX2 (12 ymm) and 4×8 on the portable tier (8 vectors of
//! 4), so that the accumulators and one row of B fill the tier's registers without spilling.
//! Columns of `C` are split over the `team` in `NR`-aligned chunks (rows when `C` is narrow),
//! each thread packing into its own reused buffers, so a steady-state call allocates nothing. On
//! AVX-512 the packing uses register transposes (`src/pack.rs`), the tile prefetches what its
//! epilogue touches, and `A·Bᵀ` with both operands
//! row-major (a fully connected layer's forward pass) skips the packing: `src/dot.rs` takes dot
//! products of their contiguous rows.
//!
//! Each element of `C` is the same sum in the same order whatever the thread count or the other rows
//! of `A`: the reduction over `k` is blocked identically for every tile.

use crate::kernels::dot;
use crate::kernels::isa::Isa;
use crate::kernels::team;
#[cfg(target_arch = "x86_64")]
use pack::{MR, NR};

#[cfg(target_arch = "x86_64")]
mod pack;

/// A strided read-only view of `op(X)`: element `(i, j)` is at `i·rs + j·cs`. The GEMM's own
/// (its packing reads either layout of either operand); layers speak ndarray.
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    pub(crate) data: &'a [f32],
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

/// Whether an operand is used as stored or transposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trans {
    N,
    T,
}

/// `C = alpha · op(A) · op(B) + beta · C`, all row-major; `op(A)` is `m×k`, `op(B)` is `k×n`.
///
/// With `beta == 0`, `C` is overwritten (its old contents, even NaN, are ignored).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    ta: Trans,
    tb: Trans,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) {
    product(Isa::active(), ta, tb, (m, n, k), alpha, a, b, beta, c);
}

/// [`gemm`] on a given tier (which the CPU must support), whatever tier the process uses: for
/// tests and benchmarks that compare tiers.
#[allow(clippy::too_many_arguments)]
pub fn gemm_on(
    isa: Isa,
    (ta, tb): (Trans, Trans),
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) {
    assert!(isa.supported(), "gemm_on: this CPU cannot run the {isa} tier");
    product(isa, ta, tb, (m, n, k), alpha, a, b, beta, c);
}

#[allow(clippy::too_many_arguments)]
fn product(
    isa: Isa,
    ta: Trans,
    tb: Trans,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) {
    assert_eq!(a.len(), m * k, "gemm: A has {} elements, expected {m}×{k}", a.len());
    assert_eq!(b.len(), k * n, "gemm: B has {} elements, expected {k}×{n}", b.len());
    assert_eq!(c.len(), m * n, "gemm: C has {} elements, expected {m}×{n}", c.len());
    if m == 0 || n == 0 {
        return;
    }
    let av = match ta {
        Trans::N => View { data: a, rs: k, cs: 1 },
        Trans::T => View { data: a, rs: 1, cs: m },
    };
    let bv = match tb {
        Trans::N => View { data: b, rs: n, cs: 1 },
        Trans::T => View { data: b, rs: 1, cs: k },
    };
    let engine = Engine::of(isa);
    prepare_callers();
    let threads = if m * n * k < 1 << 17 { 1 } else { rayon::current_num_threads().min(team::size()) };
    let cptr = SendPtr(c.as_mut_ptr());
    // SAFETY (both closures): `split` hands out disjoint blocks of rows × columns of C, and each
    // block's rows `i0..i0+rows` and columns `j0..j0+cols` lie inside `c` (length m·n, asserted).
    if ta == Trans::N && tb == Trans::T && (1..=dot::MAX_K).contains(&k) {
        // x·Wᵀ: dot products of contiguous rows, no packing (the choice depends on k only, so a row
        // of C is the same whatever m).
        let prefer = if n * k >= WEIGHTS_WORTH_KEEPING { Prefer::Cols } else { Prefer::Tiles };
        return split(m, n, threads, (engine.dot_tile(), prefer), &|i0, rows, j0, cols| unsafe {
            let at = (cptr.get().add(i0 * n + j0), n);
            match engine {
                #[cfg(target_arch = "x86_64")]
                Engine::Avx512 => dot::nt(rows, cols, k, alpha, a, b, beta, at.0, n, i0, j0),
                #[cfg(target_arch = "x86_64")]
                Engine::Avx2 => dot::generic::nt_avx2((rows, cols, k), alpha, (a, b), beta, at, (i0, j0)),
                Engine::Portable => dot::generic::nt_portable((rows, cols, k), alpha, (a, b), beta, at, (i0, j0)),
            }
        });
    }
    split(m, n, threads, (engine.tile(), Prefer::Tiles), &|i0, rows, j0, cols| unsafe {
        engine.run(rows, cols, k, alpha, av, bv, beta, cptr.get().add(i0 * n + j0), n, i0, j0)
    });
}

/// Weights (floats) from which [`Prefer::Cols`] keeps a layer's rows of W on one thread: smaller
/// weights fit in both cores' caches, so keeping them in place buys nothing and can cost balance.
const WEIGHTS_WORTH_KEEPING: usize = 1 << 16;

/// How a product's blocks are cut over the team.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Prefer {
    /// Whichever split gives the busiest thread fewer tiles.
    Tiles,
    /// Columns of C (`x·Wᵀ`: rows of W), when that costs the busiest thread at most ~10% more tiles:
    /// each thread then reads only its own rows of W, which stay in that core's caches from one
    /// step to the next instead of crossing to the other core.
    Cols,
}

/// Runs `block(i0, rows, j0, cols)` over blocks of an `m×n` product on up to `threads` threads of
/// the `team`: column blocks of whole `tile.1`-wide panels (each thread then reads or packs a
/// disjoint part of op(B)) or row blocks of whole `tile.0`-row panels, as `prefer` says.
fn split(
    m: usize,
    n: usize,
    threads: usize,
    (tile, prefer): ((usize, usize), Prefer),
    block: &(dyn Fn(usize, usize, usize, usize) + Sync),
) {
    if threads <= 1 {
        return block(0, m, 0, n);
    }
    let (panels_m, panels_n) = (m.div_ceil(tile.0), n.div_ceil(tile.1));
    let (by_cols, by_rows) = (panels_n.div_ceil(threads) * panels_m, panels_m.div_ceil(threads) * panels_n);
    let cols = match prefer {
        Prefer::Cols => by_cols * 10 <= by_rows * 11,
        Prefer::Tiles => by_cols <= by_rows,
    };
    if cols {
        let per = panels_n.div_ceil(threads) * tile.1;
        team::run(n.div_ceil(per), &|t| block(0, m, t * per, per.min(n - t * per)));
    } else {
        let per = panels_m.div_ceil(threads) * tile.0;
        team::run(m.div_ceil(per), &|t| block(t * per, per.min(m - t * per), 0, n));
    }
}

struct SendPtr(*mut f32);
// SAFETY: used only to hand disjoint blocks of one `&mut [f32]` to team tasks.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(&self) -> *mut f32 {
        self.0
    }
}

/// Depth of one packed block: an MR×KC panel of A and a KC×NR panel of B stay in L1 together.
const KC: usize = 256;
/// Rows of A packed at once (L2-resident; a multiple of every tier's MR).
const MC: usize = 144;
/// Columns of B packed at once (a multiple of every tier's NR).
const NC: usize = 1024;

/// The GEMM of one tier.
#[derive(Clone, Copy)]
enum Engine {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

/// Register tiles of the generic engines: `MR` rows × `NV` vectors.
#[cfg(target_arch = "x86_64")]
const AVX2_TILE: (usize, usize) = (6, 2);
const PORTABLE_TILE: (usize, usize) = (4, 2);

impl Engine {
    fn of(isa: Isa) -> Engine {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => Engine::Avx512,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => Engine::Avx2,
            _ => Engine::Portable,
        }
    }

    /// Rows of A × rows of B in the register tile of the dot-product kernel (`src/dot.rs`).
    fn dot_tile(self) -> (usize, usize) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Engine::Avx512 => (dot::RM, dot::RN),
            #[cfg(target_arch = "x86_64")]
            Engine::Avx2 => dot::generic::AVX2_TILE,
            Engine::Portable => dot::generic::PORTABLE_TILE,
        }
    }

    /// Rows × columns of the register tile.
    fn tile(self) -> (usize, usize) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Engine::Avx512 => (MR, NR),
            #[cfg(target_arch = "x86_64")]
            Engine::Avx2 => {
                (AVX2_TILE.0, AVX2_TILE.1 * <crate::kernels::isa::Avx2 as crate::kernels::isa::Simd>::LANES)
            }
            Engine::Portable => {
                (PORTABLE_TILE.0, PORTABLE_TILE.1 * <crate::kernels::isa::Portable as crate::kernels::isa::Simd>::LANES)
            }
        }
    }

    /// The block of C at rows `i0..i0+m`, columns `j0..j0+n` of the whole product; `c` points at
    /// its first element and has row stride `ldc`.
    ///
    /// # Safety
    /// The block (`m` rows of `n` columns at stride `ldc` from `c`) must
    /// be valid for writes and touched by no one else during the call. Only a raw pointer describes it: the blocks of the
    /// column split interleave in memory, so a slice spanning one would overlap the others'.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
        self,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: View,
        b: View,
        beta: f32,
        c: *mut f32,
        ldc: usize,
        i0: usize,
        j0: usize,
    ) {
        if k == 0 {
            // No depth: C = beta·C on every tier (the kernels below assume k ≥ 1).
            for r in 0..m {
                let row = std::slice::from_raw_parts_mut(c.add(r * ldc), n);
                row.iter_mut().for_each(|v| *v = if beta == 0.0 { 0.0 } else { beta * *v });
            }
            return;
        }
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512F was detected at run time.
            Engine::Avx512 => {
                PACK.with_borrow_mut(|p| unsafe { avx512::run(p, (m, n, k), alpha, a, b, beta, (c, ldc), (i0, j0)) })
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 and FMA were detected at run time.
            Engine::Avx2 => PACK
                .with_borrow_mut(|p| unsafe { tiled::run_avx2(p, (m, n, k), alpha, a, b, beta, (c, ldc), (i0, j0)) }),
            Engine::Portable => PACK.with_borrow_mut(|p| unsafe {
                tiled::run::<crate::kernels::isa::Portable, { PORTABLE_TILE.0 }, { PORTABLE_TILE.1 }>(
                    p,
                    (m, n, k),
                    alpha,
                    a,
                    b,
                    beta,
                    (c, ldc),
                    (i0, j0),
                )
            }),
        }
    }
}

/// Per-thread packing buffers, grown on first use and reused.
#[derive(Default)]
struct Packed {
    a: Vec<f32>,
    b: Vec<f32>,
}

thread_local! {
    static PACK: std::cell::RefCell<Packed> = std::cell::RefCell::new(Packed::default());
}

thread_local! {
    /// Whether this thread's packing buffers are sized (see [`prepare_callers`]).
    static PREPARED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Sizes this thread's packing buffers for the largest block, once: GEMM blocks run on the calling
/// thread and on the `team`'s helpers, so a steady-state call never allocates, whichever thread
/// takes which block.
pub fn prepare_thread() {
    PACK.with_borrow_mut(|p| {
        aligned(&mut p.a, 0, KC * MC);
        aligned(&mut p.b, 0, KC * NC);
    })
}

/// Sizes the packing buffers of every thread that may call [`gemm`]: the first call from a thread
/// also sizes those of every worker of its rayon pool (a GEMM inside a rayon task makes that worker
/// the caller, whichever worker it is, maybe many steps into a run) and marks them done.
fn prepare_callers() {
    if PREPARED.get() {
        return;
    }
    let prepare = || {
        prepare_thread();
        PREPARED.set(true);
    };
    prepare();
    // A team helper (a GEMM inside a team task) has no rayon pool of its own to prepare.
    if !team::is_helper() && rayon::current_num_threads() > 1 {
        rayon::broadcast(|_| prepare());
    }
}

/// A 64-byte aligned window of `len ≤ cap` elements of `v`; the first call on a thread sizes `v` for
/// the largest block (`cap`), so which shapes a thread happens to run later never reallocates.
fn aligned(v: &mut Vec<f32>, len: usize, cap: usize) -> &mut [f32] {
    debug_assert!(len <= cap);
    if v.len() < cap + 16 {
        v.resize(cap + 16, 0.0);
    }
    let off = v.as_ptr().align_offset(64).min(15);
    &mut v[off..off + len]
}

/// The blocked product of the AVX2 and portable tiers: one generic body over [`Simd`], its packing
/// and its register tile, compiled once per tier.
mod tiled {
    use super::{aligned, Packed, View, KC, MC, NC};
    use crate::kernels::isa::Simd;

    /// [`run`] compiled for AVX2 + FMA.
    ///
    /// # Safety
    /// As [`run`]; the CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn run_avx2(
        pack: &mut Packed,
        mnk: (usize, usize, usize),
        alpha: f32,
        a: View,
        b: View,
        beta: f32,
        c: (*mut f32, usize),
        at: (usize, usize),
    ) {
        run::<crate::kernels::isa::Avx2, { super::AVX2_TILE.0 }, { super::AVX2_TILE.1 }>(
            pack, mnk, alpha, a, b, beta, c, at,
        )
    }

    /// The blocked product for one C block (see [`super::Engine::run`]) with an `MR × NV·LANES`
    /// register tile.
    ///
    /// # Safety
    /// The CPU must support `S`'s tier; `c` must point at `m` rows of `n` columns at stride `ldc`,
    /// valid for writes and used by no one else during the call.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn run<S: Simd, const MR: usize, const NV: usize>(
        pack: &mut Packed,
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        a: View,
        b: View,
        beta: f32,
        (c, ldc): (*mut f32, usize),
        (i0, j0): (usize, usize),
    ) {
        let nr = NV * S::LANES;
        debug_assert!(NC.is_multiple_of(nr) && MC.is_multiple_of(MR), "NC and MC hold whole panels of every tier");
        // Depth blocks of equal size, as on AVX-512.
        let kc_max = k.div_ceil(k.div_ceil(KC));
        let bp = aligned(&mut pack.b, kc_max * NC.min(n.div_ceil(nr) * nr), KC * NC);
        let ap = aligned(&mut pack.a, kc_max * MC.min(m.div_ceil(MR) * MR), KC * MC);
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for pc in (0..k).step_by(kc_max) {
                let kc = kc_max.min(k - pc);
                pack_b(nr, b, (pc, kc), (j0 + jc, nc), bp);
                let beta_blk = if pc == 0 { beta } else { 1.0 };
                for ic in (0..m).step_by(MC) {
                    let mc = MC.min(m - ic);
                    pack_a::<MR>(a, (i0 + ic, mc), (pc, kc), ap);
                    for jr in (0..nc).step_by(nr) {
                        let cols = nr.min(nc - jr);
                        let bpan = bp.as_ptr().add(jr * kc);
                        for ir in (0..mc).step_by(MR) {
                            let rows = MR.min(mc - ir);
                            let apan = ap.as_ptr().add(ir * kc);
                            let cp = c.add((ic + ir) * ldc + jc + jr);
                            tile::<S, MR, NV>(kc, (apan, bpan), (cp, ldc), (rows, cols), (alpha, beta_blk));
                        }
                    }
                }
            }
        }
    }

    /// Packs rows `i0..i0+mc` × depth `p0..p0+kc` of op(A) into MR-row panels (`kc·MR` each,
    /// depth-major, the last one zero-padded).
    #[inline(always)]
    fn pack_a<const MR: usize>(a: View, (i0, mc): (usize, usize), (p0, kc): (usize, usize), out: &mut [f32]) {
        for (pi, panel) in out.chunks_exact_mut(kc * MR).take(mc.div_ceil(MR)).enumerate() {
            let rows = MR.min(mc - pi * MR);
            let first = (i0 + pi * MR) * a.rs + p0 * a.cs;
            if a.cs == 1 {
                // Rows contiguous over the depth: gather MR of them per depth step.
                let src: [&[f32]; MR] = std::array::from_fn(|r| &a.data[first + r.min(rows - 1) * a.rs..][..kc]);
                for (p, out) in panel.chunks_exact_mut(MR).enumerate() {
                    for r in 0..MR {
                        out[r] = if r < rows { src[r][p] } else { 0.0 };
                    }
                }
            } else {
                // Rows adjacent at each depth (a transposed A).
                for (p, out) in panel.chunks_exact_mut(MR).enumerate() {
                    let at = first + p * a.cs;
                    if rows == MR {
                        out.copy_from_slice(&a.data[at..at + MR]);
                    } else {
                        out[..rows].copy_from_slice(&a.data[at..at + rows]);
                        out[rows..].fill(0.0);
                    }
                }
            }
        }
    }

    /// Packs depth `p0..p0+kc` × columns `j0..j0+nc` of op(B) into `nr`-column panels (`kc·nr` each,
    /// depth-major, the last one zero-padded).
    #[inline(always)]
    fn pack_b(nr: usize, b: View, (p0, kc): (usize, usize), (j0, nc): (usize, usize), out: &mut [f32]) {
        for (pj, panel) in out.chunks_exact_mut(kc * nr).take(nc.div_ceil(nr)).enumerate() {
            let cols = nr.min(nc - pj * nr);
            let first = p0 * b.rs + (j0 + pj * nr) * b.cs;
            if b.cs == 1 {
                for (p, out) in panel.chunks_exact_mut(nr).enumerate() {
                    let at = first + p * b.rs;
                    out[..cols].copy_from_slice(&b.data[at..at + cols]);
                    out[cols..].fill(0.0);
                }
            } else {
                // A transposed B: each column contiguous over the depth, scattered into the panel.
                for j in 0..nr {
                    if j < cols {
                        let src = &b.data[first + j * b.cs..][..kc];
                        for (p, &v) in src.iter().enumerate() {
                            panel[p * nr + j] = v;
                        }
                    } else {
                        (0..kc).for_each(|p| panel[p * nr + j] = 0.0);
                    }
                }
            }
        }
    }

    /// One depth step of a tile: the row of packed B at `b` times each of the MR values of packed A
    /// at `a`. A function rather than a closure: a closure may stay a call, and the accumulators
    /// would then live in memory.
    #[inline(always)]
    unsafe fn step<S: Simd, const MR: usize, const NV: usize>(
        acc: &mut [[S::V; NV]; MR],
        a: *const f32,
        b: *const f32,
    ) {
        let mut bv = [S::zero(); NV];
        for (v, bv) in bv.iter_mut().enumerate() {
            *bv = S::load(b.add(v * S::LANES));
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let ar = S::splat(*a.add(r));
            for v in 0..NV {
                acc[v] = S::madd(ar, bv[v], acc[v]);
            }
        }
    }

    /// One register tile: `C[rows×cols] = alpha · Ap·Bp + beta · C` (beta 0 ignores C). Edge tiles
    /// compute the whole tile and store their real part with the same arithmetic lane by lane.
    #[inline(always)]
    unsafe fn tile<S: Simd, const MR: usize, const NV: usize>(
        kc: usize,
        (a, b): (*const f32, *const f32),
        (c, ldc): (*mut f32, usize),
        (rows, cols): (usize, usize),
        (alpha, beta): (f32, f32),
    ) {
        let mut acc = [[S::zero(); NV]; MR];
        let nr = NV * S::LANES;
        // C's lines are fetched (for writing) during the first steps, one row end per step: the
        // hardware prefetchers do not follow MR rows at a stride, and the epilogue's stores would
        // wait for each line. The rest of the depth runs without the check, two steps at a time.
        let first = kc.min(2 * rows);
        for p in 0..first {
            crate::kernels::isa::prefetch_for_write(c.add(p / 2 * ldc + (p % 2) * (cols - 1)));
            step::<S, MR, NV>(&mut acc, a.add(p * MR), b.add(p * nr));
        }
        let mut p = first;
        while p + 2 <= kc {
            step::<S, MR, NV>(&mut acc, a.add(p * MR), b.add(p * nr));
            step::<S, MR, NV>(&mut acc, a.add((p + 1) * MR), b.add((p + 1) * nr));
            p += 2;
        }
        if p < kc {
            step::<S, MR, NV>(&mut acc, a.add(p * MR), b.add(p * nr));
        }
        if rows == MR && cols == nr {
            let (va, vb) = (S::splat(alpha), S::splat(beta));
            for (r, acc) in acc.iter().enumerate() {
                for (v, &x) in acc.iter().enumerate() {
                    let p = c.add(r * ldc + v * S::LANES);
                    let x = S::mul(va, x);
                    S::store(p, if beta == 0.0 { x } else { S::madd(vb, S::load(p), x) });
                }
            }
        } else {
            let mut row = [0.0f32; 64];
            debug_assert!(nr <= row.len());
            for (r, acc) in acc.iter().enumerate().take(rows) {
                for (v, &x) in acc.iter().enumerate() {
                    S::store(row.as_mut_ptr().add(v * S::LANES), x);
                }
                for (j, &x) in row.iter().enumerate().take(cols) {
                    let p = c.add(r * ldc + j);
                    let x = alpha * x;
                    *p = if beta == 0.0 {
                        x
                    } else if S::FMA {
                        beta.mul_add(*p, x)
                    } else {
                        beta * *p + x
                    };
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::pack::{pack_a_cols, pack_a_rows, pack_b_rows, pack_b_transposed};
    use super::{aligned, Packed, View, KC, MC, MR, NC, NR};
    use std::arch::x86_64::*;

    /// The blocked product for one C block (see [`super::Engine::run`]).
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `c` must point at `m` rows of `n` columns at stride `ldc`,
    /// valid for writes and used by no one else during the call.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn run(
        pack: &mut Packed,
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        a: View,
        b: View,
        beta: f32,
        (c, ldc): (*mut f32, usize),
        (i0, j0): (usize, usize),
    ) {
        // Depth blocks of equal size (784 = 3 × 262 rather than 256 + 256 + 256 + 16): a thin last
        // block would pay a full C-tile update for little work.
        let kc_max = k.div_ceil(k.div_ceil(KC));
        let bp = aligned(&mut pack.b, kc_max * NC.min(n.div_ceil(NR) * NR), KC * NC);
        let ap = aligned(&mut pack.a, kc_max * MC.min(m.div_ceil(MR) * MR), KC * MC);
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for pc in (0..k).step_by(kc_max) {
                let kc = kc_max.min(k - pc);
                if b.cs == 1 {
                    pack_b_rows(b, pc, kc, j0 + jc, nc, bp);
                } else {
                    pack_b_transposed(b, pc, kc, j0 + jc, nc, bp);
                }
                // The first depth block applies the caller's beta; later ones accumulate.
                let beta_blk = if pc == 0 { beta } else { 1.0 };
                for ic in (0..m).step_by(MC) {
                    let mc = MC.min(m - ic);
                    if a.cs == 1 {
                        pack_a_rows(a, i0 + ic, mc, pc, kc, ap);
                    } else {
                        pack_a_cols(a, i0 + ic, mc, pc, kc, ap);
                    }
                    for jr in (0..nc).step_by(NR) {
                        let cols = NR.min(nc - jr);
                        let bpan = bp.as_ptr().add(jr * kc);
                        for ir in (0..mc).step_by(MR) {
                            let rows = MR.min(mc - ir);
                            let apan = ap.as_ptr().add(ir * kc);
                            let off = (ic + ir) * ldc + jc + jr;
                            tile(kc, apan, bpan, c.add(off), ldc, (rows, cols), alpha, beta_blk);
                        }
                    }
                }
            }
        }
    }

    /// One MR×NR tile: `C[rows×cols] = alpha · Ap·Bp + beta · C` (beta 0 ignores C).
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile(
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        (rows, cols): (usize, usize),
        alpha: f32,
        beta: f32,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        // The lines of C the epilogue touches are fetched while the tile computes, one 16-lane row half per depth step: the hardware
        // prefetchers do not follow 12 rows at a stride, fetching them all at once overflows the miss
        // buffers, and C's lines come in owned (a store to a line not in cache waits for it).
        let (mut a, mut b) = (a, b);
        for step in 0..kc {
            if step < 2 * rows && 16 * (step % 2) < cols {
                _mm_prefetch::<_MM_HINT_ET0>(c.add(step / 2 * ldc + 16 * (step % 2)) as *const i8);
            }
            let b0 = _mm512_loadu_ps(b);
            let b1 = _mm512_loadu_ps(b.add(16));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let ar = _mm512_set1_ps(*a.add(r));
                acc_r[0] = _mm512_fmadd_ps(ar, b0, acc_r[0]);
                acc_r[1] = _mm512_fmadd_ps(ar, b1, acc_r[1]);
            }
            a = a.add(MR);
            b = b.add(NR);
        }
        let va = _mm512_set1_ps(alpha);
        let vb = _mm512_set1_ps(beta);
        let mask_lo: __mmask16 = if cols >= 16 { 0xffff } else { (1u32 << cols) as u16 - 1 };
        let mask_hi: __mmask16 = if cols >= 32 {
            0xffff
        } else if cols <= 16 {
            0
        } else {
            (1u32 << (cols - 16)) as u16 - 1
        };
        for (r, acc_r) in acc.iter().enumerate().take(rows) {
            let cr = c.add(r * ldc);
            for (h, mask) in [(0usize, mask_lo), (1, mask_hi)] {
                if mask == 0 {
                    continue;
                }
                let p = cr.add(16 * h);
                let mut v = _mm512_mul_ps(va, acc_r[h]);
                if beta != 0.0 {
                    v = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(mask, p), v);
                }
                _mm512_mask_storeu_ps(p, mask, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random `A` (`m×k`) and `B` (`k×n`) in ±1 from stream `key`.
    fn operands(key: u64, m: usize, n: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
        let mut rng = crate::data::rng::Rng::from_keys(&[key]);
        let a = (0..m * k).map(|_| rng.uniform(1.0)).collect();
        let b = (0..k * n).map(|_| rng.uniform(1.0)).collect();
        (a, b)
    }

    fn naive(ta: Trans, tb: Trans, m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
        let at = |i: usize, p: usize| if ta == Trans::N { a[i * k + p] } else { a[p * m + i] };
        let bt = |p: usize, j: usize| if tb == Trans::N { b[p * n + j] } else { b[j * k + p] };
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
            }
        }
        c
    }

    #[test]
    fn all_transpose_combinations_match_naive_on_every_tier() {
        let mut rng = crate::data::rng::Rng::from_keys(&[3]);
        for &(m, n, k) in &[
            (1, 1, 1),
            (5, 7, 3),
            (70, 33, 65),
            (129, 64, 40),
            (13, 97, 300),
            (150, 1100, 20),
            (9, 11, 16),
            (3, 10, 1024),
            (5, 6, 1025),
            (4, 0, 3),
            (6, 5, 0),
        ] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.uniform(1.0)).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.uniform(1.0)).collect();
            let c0: Vec<f32> = (0..m * n).map(|_| rng.uniform(1.0)).collect();
            for isa in Isa::available() {
                for ta in [Trans::N, Trans::T] {
                    for tb in [Trans::N, Trans::T] {
                        let want = naive(ta, tb, m, n, k, &a, &b);
                        let mut c = vec![f32::NAN; m * n];
                        gemm_on(isa, (ta, tb), (m, n, k), 1.0, &a, &b, 0.0, &mut c);
                        for (x, y) in c.iter().zip(&want) {
                            assert!(
                                (x - y).abs() < 1e-4 * (k as f32).max(1.0),
                                "{isa} {ta:?}{tb:?} {m}x{n}x{k}: {x} vs {y}"
                            );
                        }
                        // alpha and beta: C = 0.5·AB + 2·C0.
                        let mut c = c0.clone();
                        gemm_on(isa, (ta, tb), (m, n, k), 0.5, &a, &b, 2.0, &mut c);
                        for ((x, y), z) in c.iter().zip(&want).zip(&c0) {
                            let w = 0.5 * y + 2.0 * z;
                            assert!(
                                (x - w).abs() < 1e-4 * (k as f32).max(1.0),
                                "{isa} {ta:?}{tb:?} {m}x{n}x{k} beta: {x} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The tiers with FMA compute every element as the same fused operations in the same order (the
    /// dot-product kernel's 16 lane sums and reduction tree included): the same bits.
    #[test]
    fn fma_tiers_give_the_same_bits() {
        let fused: Vec<Isa> = Isa::available().into_iter().filter(|&t| t != Isa::Portable).collect();
        for &(m, n, k) in &[(128, 512, 784), (37, 45, 29), (64, 10, 1100), (9, 300, 17)] {
            let (a, b) = operands(6, m, n, k);
            for tr in [(Trans::N, Trans::N), (Trans::N, Trans::T), (Trans::T, Trans::N), (Trans::T, Trans::T)] {
                let results: Vec<Vec<f32>> = fused
                    .iter()
                    .map(|&isa| {
                        let mut c = vec![0.0; m * n];
                        gemm_on(isa, tr, (m, n, k), 1.0, &a, &b, 0.0, &mut c);
                        c
                    })
                    .collect();
                for (isa, c) in fused.iter().zip(&results).skip(1) {
                    assert!(c == &results[0], "{isa} and {} differ on {m}×{n}×{k} {tr:?}", fused[0]);
                }
            }
        }
    }

    /// `x·Wᵀ` on every tier is, bit for bit, the order AVX-512's dot-product kernel defines: 16 lane
    /// sums over the depth (a zero-padded last step), lane `j` + lane `j + 8`, then `+ 4`, `+ 2`,
    /// `+ 1`; fused on the FMA tiers, a rounded product then a rounded sum on the portable one. So
    /// a host without AVX-512 checks its tiers against the AVX-512 tier's results too.
    #[test]
    fn the_dot_kernel_keeps_the_sixteen_lane_order_on_every_tier() {
        let reference = |a: &[f32], b: &[f32], fused: bool| {
            let mut lanes = [0.0f32; 16];
            for d in 0..a.len().div_ceil(16) * 16 {
                let (x, y) = if d < a.len() { (a[d], b[d]) } else { (0.0, 0.0) };
                lanes[d % 16] = if fused { x.mul_add(y, lanes[d % 16]) } else { x * y + lanes[d % 16] };
            }
            let mut half = 8;
            while half > 0 {
                for j in 0..half {
                    lanes[j] += lanes[j + half];
                }
                half /= 2;
            }
            lanes[0]
        };
        for &(m, n, k) in &[(128, 512, 784), (7, 13, 29), (3, 10, 1024), (20, 9, 5), (16, 16, 16)] {
            let (a, b) = operands(9, m, n, k);
            for isa in Isa::available() {
                let mut c = vec![0.0; m * n];
                gemm_on(isa, (Trans::N, Trans::T), (m, n, k), 1.0, &a, &b, 0.0, &mut c);
                for i in 0..m {
                    for j in 0..n {
                        let want = reference(&a[i * k..(i + 1) * k], &b[j * k..(j + 1) * k], isa != Isa::Portable);
                        assert_eq!(c[i * n + j].to_bits(), want.to_bits(), "{isa} {m}×{n}×{k} at ({i}, {j})");
                    }
                }
            }
        }
    }

    #[test]
    fn same_bits_whatever_the_thread_count_on_every_tier() {
        let (m, n, k) = (200, 300, 700);
        let (a, b) = operands(4, m, n, k);
        for isa in Isa::available() {
            for tr in [(Trans::N, Trans::T), (Trans::T, Trans::N)] {
                let run = |threads: usize| {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    let mut c = vec![0.0; m * n];
                    pool.install(|| gemm_on(isa, tr, (m, n, k), 1.0, &a, &b, 0.0, &mut c));
                    c
                };
                let one = run(1);
                assert_eq!(one, run(2), "{isa}");
                assert_eq!(one, run(3), "{isa}");
            }
            // A row of C does not depend on the other rows of A.
            let mut full = vec![0.0; m * n];
            gemm_on(isa, (Trans::N, Trans::T), (m, n, k), 1.0, &a, &b, 0.0, &mut full);
            let mut c1 = vec![0.0; n];
            gemm_on(isa, (Trans::N, Trans::T), (1, n, k), 1.0, &a[5 * k..6 * k], &b, 0.0, &mut c1);
            assert_eq!(&full[5 * n..6 * n], &c1[..], "{isa}");
        }
    }
}
