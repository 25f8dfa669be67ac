//! Vectorised kernels of the direct (stride-1) convolution in [`crate::nn::conv`].
//!
//! A stride-1 convolution over zero-padded planes of width `Wp` is a 1-D correlation over the
//! flattened plane: output pixel `(y, x)` at `p = y·Wp + x` reads input `p + ki·Wp + kj`, so every
//! tap `(c, ki, kj)` is one offset into the flat input and a whole output plane is
//!
//! ```text
//!     out[p] = Σ_t coef_t · src[off_t + p]          (forward)
//!     acc_t  = Σ_p a[p] · src[off_t + p]            (∂W: one dot product per tap)
//!     ∂col_t[p] = Σ_o w[o, t] · ∂y_o[p],   ∂x[off_t + p] += ∂col_t[p]   (∂x)
//! ```
//!
//! over contiguous runs of `p`, the columns `x ≥ W'` of each row computing values that are thrown
//! away (and, in `∂y`, held at zero). [`Direct`] holds that geometry and runs one sample through
//! it. The loops run on register tiles of fixed width, written once and compiled per tier
//! ([`crate::kernels::isa`]): AVX-512 or AVX2 FMAs, or separate multiplies and adds on the portable tier.

use crate::kernels::grow;
use crate::kernels::isa::{madd, Isa};

/// Shape of the register tile of [`correlate`]: `P` output planes × `CH` positions, eight 16-lane
/// accumulators either way (enough independent FMA chains to keep both FMA units busy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tile {
    /// 2 planes × 64 positions.
    Pairs,
    /// 4 planes × 32 positions.
    Quads,
}

impl Tile {
    pub fn planes(self) -> usize {
        match self {
            Tile::Pairs => 2,
            Tile::Quads => 4,
        }
    }
    pub fn width(self) -> usize {
        match self {
            Tile::Pairs => 64,
            Tile::Quads => 32,
        }
    }
    /// The tile that wastes least on rounding `planes` planes of `len` positions up to whole tiles.
    fn best(planes: usize, len: usize) -> Tile {
        let work = |t: Tile| planes.next_multiple_of(t.planes()) * len.next_multiple_of(t.width());
        if work(Tile::Quads) < work(Tile::Pairs) {
            Tile::Quads
        } else {
            Tile::Pairs
        }
    }
}

/// Slack after the padded input planes: the widest tile may read this far past the last plane.
const SLACK: usize = 64;
/// Lanes of one accumulator of [`dot_lanes`] (one 16-lane vector).
pub const LANES: usize = 16;
/// Taps whose dot products [`dot_lanes`] accumulates together (independent FMA chains).
pub const GROUP: usize = 8;

/// A stride-1 convolution `C×H×W → O×H'×W'` with a `k×k` kernel and `padding`, laid out for the
/// kernels below: planes padded to `Hp×Wp`, outputs computed over `Lw = (H'−1)·Wp + W'` flat
/// positions, `∂y` kept in the same flat layout (zero at the positions `x ≥ W'`).
#[derive(Debug, Clone)]
pub struct Direct {
    c: usize,
    o: usize,
    k: usize,
    pad: usize,
    /// Input `H, W`, padded width `Wp`, output `H', W'`.
    h: usize,
    w: usize,
    wp: usize,
    oh: usize,
    ow: usize,
    /// `Hp·Wp`.
    plane: usize,
    /// `Lw`.
    lw: usize,
    /// Forward tile, and `Lw` rounded up to its width.
    fwd: Tile,
    fwd_len: usize,
    /// Tile of `∂col = Wᵀ·∂y` (one plane per tap), and `Lw` rounded up to its width.
    bwd: Tile,
    bwd_len: usize,
    /// Stride of the `∂y` planes: `Lw` rounded up to cover both `bwd_len` and whole [`LANES`].
    dy_plane: usize,
    /// Offset in the padded input of every tap `(c, ki, kj)`, padded with zeros (dummy taps whose
    /// `∂W` sums are never read) to a multiple of [`GROUP`].
    offsets: Vec<usize>,
    /// Offset of each `∂y` plane, the taps of `∂col`.
    dy_offsets: Vec<usize>,
}

/// One task's buffers for [`Direct`]. The padding borders and the `∂y` positions `x ≥ W'` are
/// written once (zero, on allocation) and never again, so they stay zero.
#[derive(Debug, Clone, Default)]
pub struct Scratch {
    /// Per sample of the task: padded input planes `C × Hp·Wp`, plus [`SLACK`] zeros.
    xp: Vec<f32>,
    /// Forward outputs, `O` (rounded up to whole tiles) `× fwd_len`.
    yw: Vec<f32>,
    /// Per sample of the task: `∂y` planes `O` (rounded up to even, the last one then all zero)
    /// `× dy_plane`, each value at `y·Wp + x`.
    dyp: Vec<f32>,
    /// `∂col`, `C·k·k` (rounded up to whole tiles) `× bwd_len`.
    dcol: Vec<f32>,
    /// `∂x` over the padded planes, `C × Hp·Wp`, plus [`SLACK`].
    dxp: Vec<f32>,
    /// `∂W` lane partials, `O` (rounded up to even) `× taps`, then `∂bias` lane partials (`O`).
    lanes: Vec<[f32; LANES]>,
}

impl Direct {
    pub fn new(input: [usize; 3], o: usize, k: usize, pad: usize) -> Direct {
        let [c, h, w] = input;
        let (hp, wp) = (h + 2 * pad, w + 2 * pad);
        assert!(k >= 1 && k <= hp && k <= wp, "direct convolution: kernel {k} does not fit {hp}×{wp}");
        let (oh, ow) = (hp - k + 1, wp - k + 1);
        let (lw, plane, ckk) = ((oh - 1) * wp + ow, hp * wp, c * k * k);
        let (fwd, bwd) = (Tile::best(o, lw), Tile::best(ckk, lw));
        let bwd_len = lw.next_multiple_of(bwd.width());
        let dy_plane = bwd_len.max(lw.next_multiple_of(LANES));
        let mut offsets: Vec<usize> =
            (0..c).flat_map(|c| (0..k).flat_map(move |ki| (0..k).map(move |kj| c * plane + ki * wp + kj))).collect();
        offsets.resize(ckk.next_multiple_of(GROUP), 0);
        Direct {
            c,
            o,
            k,
            pad,
            h,
            w,
            wp,
            oh,
            ow,
            plane,
            lw,
            fwd,
            fwd_len: lw.next_multiple_of(fwd.width()),
            bwd,
            bwd_len,
            dy_plane,
            offsets,
            dy_offsets: (0..o).map(|o| o * dy_plane).collect(),
        }
    }

    fn ckk(&self) -> usize {
        self.c * self.k * self.k
    }

    /// Lane partials of a task: `∂W` of `O` rounded up to even, then `∂bias`.
    fn lanes(&self) -> usize {
        self.o.next_multiple_of(2) * self.offsets.len() + self.o
    }

    /// Floats of one sample's padded input, and of its `∂y` planes.
    fn x_stride(&self) -> usize {
        self.c * self.plane + SLACK
    }
    fn dy_stride(&self) -> usize {
        self.o.next_multiple_of(2) * self.dy_plane
    }

    /// Sizes a task's buffers for up to `samples` samples (only grows; new space is zero).
    pub fn reserve(&self, s: &mut Scratch, samples: usize, dx: bool) {
        grow(&mut s.xp, samples * self.x_stride());
        grow(&mut s.yw, self.o.next_multiple_of(self.fwd.planes()) * self.fwd_len);
        grow(&mut s.dyp, samples * self.dy_stride());
        grow(&mut s.lanes, self.lanes());
        if dx {
            grow(&mut s.dcol, self.ckk().next_multiple_of(self.bwd.planes()) * self.bwd_len);
            grow(&mut s.dxp, self.c * self.plane + SLACK);
        }
    }

    /// Forward weights in tile order: for each tile of output channels, for each tap `(c, ki, kj)`,
    /// the weights of the tile's channels (zero for channels past `O`).
    pub fn forward_weights(&self, w: &[f32], out: &mut Vec<f32>) {
        let ckk = self.ckk();
        tile_weights(self.fwd.planes(), self.o, ckk, |o, t| w[o * ckk + t], out);
    }

    /// `∂col` weights in tile order: for each tile of taps `(c, ki, kj)`, for each output channel
    /// `o`, `w[o, c, ki, kj]` of the tile's taps.
    pub fn backward_weights(&self, w: &[f32], out: &mut Vec<f32>) {
        let ckk = self.ckk();
        tile_weights(self.bwd.planes(), ckk, self.o, |t, o| w[o * ckk + t], out);
    }

    /// Copies one sample `x` (`C×H×W`) into the interior of the padded planes.
    fn pad_input(&self, x: &[f32], xp: &mut [f32]) {
        for (c, x) in x.chunks_exact(self.h * self.w).enumerate() {
            for (iy, row) in x.chunks_exact(self.w).enumerate() {
                let at = c * self.plane + (iy + self.pad) * self.wp + self.pad;
                xp[at..at + self.w].copy_from_slice(row);
            }
        }
    }

    /// `y = W ⋆ x + bias` for one sample (`x: C×H×W → y: O×H'×W'`), `weights` from
    /// [`Direct::forward_weights`].
    pub fn forward(&self, s: &mut Scratch, weights: &[f32], bias: &[f32], x: &[f32], y: &mut [f32]) {
        let xp = &mut s.xp[..self.x_stride()];
        self.pad_input(x, xp);
        correlate(self.fwd, &mut s.yw, self.fwd_len, xp, &self.offsets[..self.ckk()], weights);
        let (ow, pix) = (self.ow, self.oh * self.ow);
        for ((yw, y), &b) in s.yw.chunks_exact(self.fwd_len).zip(y.chunks_exact_mut(pix)).zip(bias) {
            for (y, yw) in y.chunks_exact_mut(ow).zip(yw.chunks(self.wp)) {
                y.iter_mut().zip(&yw[..ow]).for_each(|(y, &v)| *y = v + b);
            }
        }
    }

    /// One task's backward pass: its `∂W` then `∂bias` into `g` (`O·C·k·k + O`, summed over its
    /// samples `x`, `∂y`) and, when asked, each sample's `∂x` (`C×H×W`) with `weights` from
    /// [`Direct::backward_weights`]: `∂col = Wᵀ·∂y`, then `∂x = col2im(∂col)`, each tap's plane
    /// added at its offset. The `∂W` accumulators stay in registers across the task's samples.
    pub fn backward(
        &self,
        s: &mut Scratch,
        weights: &[f32],
        (x, dy): (&[f32], &[f32]),
        dx: Option<&mut [f32]>,
        g: &mut [f32],
    ) {
        let (ow, pix, n) = (self.ow, self.oh * self.ow, self.dy_plane);
        let (xs, dys) = (self.x_stride(), self.dy_stride());
        let samples = x.len() / (self.c * self.h * self.w);
        for (x, xp) in x.chunks_exact(self.c * self.h * self.w).zip(s.xp.chunks_exact_mut(xs)) {
            self.pad_input(x, xp);
        }
        for (dy, dyp) in dy.chunks_exact(self.o * pix).zip(s.dyp.chunks_exact_mut(dys)) {
            for (dyp, dy) in dyp.chunks_exact_mut(n).zip(dy.chunks_exact(pix)) {
                for (oy, row) in dy.chunks_exact(ow).enumerate() {
                    dyp[oy * self.wp..oy * self.wp + ow].copy_from_slice(row);
                }
            }
        }
        let lanes = self.lw.next_multiple_of(LANES);
        let taps = self.offsets.len();
        s.lanes[..self.lanes()].fill([0.0; LANES]);
        let (dw, db) = s.lanes.split_at_mut(self.o.next_multiple_of(2) * taps);
        let xp = Runs { data: &s.xp, stride: xs, count: samples };
        for (pair, acc) in dw.chunks_exact_mut(2 * taps).enumerate() {
            let plane = |i: usize| Runs { data: &s.dyp[(2 * pair + i) * n..], stride: dys, count: samples };
            dot_lanes(acc, [plane(0), plane(1)], lanes, xp, &self.offsets);
        }
        for (o, db) in db.iter_mut().enumerate() {
            for dyp in s.dyp.chunks_exact(dys).take(samples) {
                sum_into_lanes(db, &dyp[o * n..o * n + lanes]);
            }
        }
        let ckk = self.ckk();
        let (gw, gb) = g.split_at_mut(self.o * ckk);
        for (gw, lanes) in gw.chunks_exact_mut(ckk).zip(dw.chunks_exact(taps)) {
            gw.iter_mut().zip(lanes).for_each(|(g, l)| *g = sum_lanes(l));
        }
        gb.iter_mut().zip(db.iter()).for_each(|(g, l)| *g = sum_lanes(l));
        let Some(dx) = dx else { return };
        for (dyp, dx) in s.dyp.chunks_exact(dys).zip(dx.chunks_exact_mut(self.c * self.h * self.w)) {
            correlate(self.bwd, &mut s.dcol, self.bwd_len, dyp, &self.dy_offsets, weights);
            let dxp = &mut s.dxp[..self.c * self.plane + SLACK];
            dxp.fill(0.0);
            add_planes(dxp, &s.dcol, self.bwd_len, &self.offsets[..ckk], self.lw);
            for (dxp, dx) in dxp.chunks_exact(self.plane).zip(dx.chunks_exact_mut(self.h * self.w)) {
                for (iy, row) in dx.chunks_exact_mut(self.w).enumerate() {
                    let at = (iy + self.pad) * self.wp + self.pad;
                    row.copy_from_slice(&dxp[at..at + self.w]);
                }
            }
        }
    }
}

/// `dst[offs[t] + p] += planes[t·stride + p]` for every tap `t` and `p < len`, taps in order.
pub fn add_planes(dst: &mut [f32], planes: &[f32], stride: usize, offs: &[usize], len: usize) {
    add_planes_on(Isa::active(), dst, planes, stride, offs, len)
}

fn add_planes_on(isa: Isa, dst: &mut [f32], planes: &[f32], stride: usize, offs: &[usize], len: usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier's features were detected at run time.
        Isa::Avx512 => unsafe { avx512::add_planes(dst, planes, stride, offs, len) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { avx2::add_planes(dst, planes, stride, offs, len) },
        _ => add_planes_body(dst, planes, stride, offs, len),
    }
}

#[inline(always)]
fn add_planes_body(dst: &mut [f32], planes: &[f32], stride: usize, offs: &[usize], len: usize) {
    for (&off, plane) in offs.iter().zip(planes.chunks_exact(stride)) {
        dst[off..off + len].iter_mut().zip(&plane[..len]).for_each(|(d, &v)| *d += v);
    }
}

/// `out[tile][t][j] = w(tile·planes + j, t)` for `taps` taps, zero for planes past `n`.
fn tile_weights(planes: usize, n: usize, taps: usize, w: impl Fn(usize, usize) -> f32, out: &mut Vec<f32>) {
    out.clear();
    for first in (0..n).step_by(planes) {
        for t in 0..taps {
            out.extend((first..first + planes).map(|i| if i < n { w(i, t) } else { 0.0 }));
        }
    }
}

/// For each tile of `tile.planes()` output planes (each `len` long, a multiple of `tile.width()`)
/// in `out`: `out[j][p] = Σ_t w[t][j] · src[offs[t] + p]`, the taps summed in order. `w` holds, per
/// tile, `offs.len()` rows of `tile.planes()` weights. Panics if a tap reads past `src`.
pub fn correlate(tile: Tile, out: &mut [f32], len: usize, src: &[f32], offs: &[usize], w: &[f32]) {
    correlate_on(Isa::active(), tile, out, (len, src, offs), w)
}

fn correlate_on(isa: Isa, tile: Tile, out: &mut [f32], (len, src, offs): (usize, &[f32], &[usize]), w: &[f32]) {
    assert!(len.is_multiple_of(tile.width()) && w.len() * len == out.len() * offs.len(), "correlate: shapes");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier's features were detected at run time.
        Isa::Avx512 => unsafe { avx512::correlate(tile, out, len, src, offs, w) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { avx2::correlate(tile, out, len, src, offs, w) },
        // Eight 4-lane accumulators.
        _ => match tile {
            Tile::Pairs => correlate_body::<false, 2, 16>(out, len, src, offs, w),
            Tile::Quads => correlate_body::<false, 4, 8>(out, len, src, offs, w),
        },
    }
}

/// `count` runs of floats spaced `stride` apart in `data`: one per sample of a task.
#[derive(Debug, Clone, Copy)]
pub struct Runs<'a> {
    pub data: &'a [f32],
    pub stride: usize,
    pub count: usize,
}

/// For a pair of `∂y` planes `a` and every tap `t`, summed over the samples `n < count`:
/// `acc[i][t][l] += Σ_j a[i]ₙ[j·LANES + l] · srcₙ[offs[t] + j·LANES + l]` for `j·LANES < len`,
/// lane-wise partial dot products (`acc` is `2 × offs.len()`), reduced over the lanes by the caller.
/// `len` is a multiple of [`LANES`], `offs.len()` of [`GROUP`].
pub fn dot_lanes(acc: &mut [[f32; LANES]], a: [Runs; 2], len: usize, src: Runs, offs: &[usize]) {
    dot_lanes_on(Isa::active(), acc, a, len, src, offs)
}

fn dot_lanes_on(isa: Isa, acc: &mut [[f32; LANES]], a: [Runs; 2], len: usize, src: Runs, offs: &[usize]) {
    let ok = len.is_multiple_of(LANES) && acc.len() == 2 * offs.len() && offs.len().is_multiple_of(GROUP);
    assert!(ok && a[0].count == src.count && a[1].count == src.count, "dot_lanes: shapes");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier's features were detected at run time.
        Isa::Avx512 => unsafe { avx512::dot_lanes(acc, a, len, src, offs) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { avx2::dot_lanes(acc, a, len, src, offs) },
        _ => dot_lanes_body::<false, 1>(acc, a, len, src, offs),
    }
}

/// The kernels compiled for one x86-64 tier, with register tiles of eight of its vectors: `CH` of
/// [`correlate_body`] is 4 (pairs) or 2 (quads) vectors, and [`dot_lanes_body`] holds `G` taps of
/// two planes (a tap's 16 lane partials take one zmm or two ymm).
macro_rules! tier {
    ($name:ident, $features:literal, $vec:literal, $g:literal) => {
        #[cfg(target_arch = "x86_64")]
        mod $name {
            use super::*;

            #[target_feature(enable = $features)]
            pub(super) unsafe fn add_planes(
                dst: &mut [f32],
                planes: &[f32],
                stride: usize,
                offs: &[usize],
                len: usize,
            ) {
                add_planes_body(dst, planes, stride, offs, len)
            }

            #[target_feature(enable = $features)]
            pub(super) unsafe fn correlate(
                tile: Tile,
                out: &mut [f32],
                len: usize,
                src: &[f32],
                offs: &[usize],
                w: &[f32],
            ) {
                match tile {
                    Tile::Pairs => correlate_body::<true, 2, { 4 * $vec }>(out, len, src, offs, w),
                    Tile::Quads => correlate_body::<true, 4, { 2 * $vec }>(out, len, src, offs, w),
                }
            }

            #[target_feature(enable = $features)]
            pub(super) unsafe fn dot_lanes(
                acc: &mut [[f32; LANES]],
                a: [Runs; 2],
                len: usize,
                src: Runs,
                offs: &[usize],
            ) {
                dot_lanes_body::<true, $g>(acc, a, len, src, offs)
            }
        }
    };
}
tier!(avx512, "avx512f,fma", 16, 8);
tier!(avx2, "avx2,fma", 8, 2);

/// `CH` positions of `P` planes per register tile; `CH` divides every tile width, so the layout
/// (widths of [`Tile`]) is the same on every tier and only the register blocking differs.
#[inline(always)]
fn correlate_body<const FMA: bool, const P: usize, const CH: usize>(
    out: &mut [f32],
    len: usize,
    src: &[f32],
    offs: &[usize],
    w: &[f32],
) {
    for (out, w) in out.chunks_exact_mut(P * len).zip(w.chunks_exact(offs.len() * P)) {
        for p in (0..len).step_by(CH) {
            let mut acc = [[0.0f32; CH]; P];
            for (&off, w) in offs.iter().zip(w.chunks_exact(P)) {
                let s: &[f32; CH] = src[off + p..off + p + CH].try_into().expect("a chunk");
                for j in 0..P {
                    for l in 0..CH {
                        acc[j][l] = madd::<FMA>(w[j], s[l], acc[j][l]);
                    }
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                out[j * len + p..j * len + p + CH].copy_from_slice(acc);
            }
        }
    }
}

/// [`dot_lanes`] taking `G` taps (dividing [`GROUP`]) at a time: every partial is the same sum in
/// the same order whatever `G`.
#[inline(always)]
fn dot_lanes_body<const FMA: bool, const G: usize>(
    acc: &mut [[f32; LANES]],
    [a0, a1]: [Runs; 2],
    len: usize,
    src: Runs,
    offs: &[usize],
) {
    let (acc0, acc1) = acc.split_at_mut(offs.len());
    let groups = acc0.chunks_exact_mut(G).zip(acc1.chunks_exact_mut(G)).zip(offs.chunks_exact(G));
    for ((acc0, acc1), offs) in groups {
        let acc0: &mut [[f32; LANES]; G] = acc0.try_into().expect("a group");
        let acc1: &mut [[f32; LANES]; G] = acc1.try_into().expect("a group");
        let (mut t0, mut t1) = (*acc0, *acc1);
        for n in 0..src.count {
            let (a0, a1) = (&a0.data[n * a0.stride..][..len], &a1.data[n * a1.stride..][..len]);
            // Filled by a loop rather than `array::from_fn`, which stays a call: every accumulator
            // would be spilled around it, once per sample.
            let mut srcs: [&[f32]; G] = [&[]; G];
            for (s, &off) in srcs.iter_mut().zip(offs) {
                *s = &src.data[n * src.stride + off..][..len];
            }
            for (j, (a0, a1)) in a0.chunks_exact(LANES).zip(a1.chunks_exact(LANES)).enumerate() {
                let a0: &[f32; LANES] = a0.try_into().expect("a vector");
                let a1: &[f32; LANES] = a1.try_into().expect("a vector");
                for g in 0..G {
                    let s: &[f32; LANES] = srcs[g][j * LANES..(j + 1) * LANES].try_into().expect("a vector");
                    for l in 0..LANES {
                        t0[g][l] = madd::<FMA>(a0[l], s[l], t0[g][l]);
                        t1[g][l] = madd::<FMA>(a1[l], s[l], t1[g][l]);
                    }
                }
            }
        }
        (*acc0, *acc1) = (t0, t1);
    }
}

/// `acc[l] += Σ_j a[j·LANES + l]` (`a.len()` a multiple of [`LANES`]).
pub fn sum_into_lanes(acc: &mut [f32; LANES], a: &[f32]) {
    for a in a.chunks_exact(LANES) {
        acc.iter_mut().zip(a).for_each(|(s, &v)| *s += v);
    }
}

/// `Σ_l v[l]`, pairwise (the order is fixed, so the result is too).
pub fn sum_lanes(v: &[f32; LANES]) -> f32 {
    let mut v = *v;
    let mut half = LANES / 2;
    while half > 0 {
        for l in 0..half {
            v[l] += v[l + half];
        }
        half /= 2;
    }
    v[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::rng::Rng;

    /// Every tier against f64 loops; the tiers with FMA give the same bits (the same fused
    /// operations in the same order, only the register blocking differs).
    #[test]
    fn kernels_match_scalar_loops_on_every_tier() {
        let mut rng = Rng::from_keys(&[9]);
        let src: Vec<f32> = (0..3 * 64 + 40).map(|_| rng.uniform(1.0)).collect();
        let offs: Vec<usize> = (0..11).map(|t| (t * 7) % 40).collect();
        let mut fused: Vec<Vec<f32>> = vec![];
        for isa in Isa::available() {
            let mut outs = vec![];
            for tile in [Tile::Pairs, Tile::Quads] {
                let (planes, len) = (2 * tile.planes(), 3 * 64);
                let w: Vec<f32> = (0..planes * offs.len()).map(|t| ((t * 37 % 23) as f32 - 11.0) / 7.0).collect();
                let mut out = vec![f32::NAN; planes * len];
                correlate_on(isa, tile, &mut out, (len, &src, &offs), &w);
                for (i, &v) in out.iter().enumerate() {
                    let (j, p) = (i / len, i % len);
                    let (first, jj) = (j / tile.planes() * tile.planes(), j % tile.planes());
                    let wt = |t: usize| w[(first * offs.len()) + t * tile.planes() + jj] as f64;
                    let want: f64 = offs.iter().enumerate().map(|(t, &o)| wt(t) * src[o + p] as f64).sum();
                    assert!((v as f64 - want).abs() < 1e-5, "{isa} {tile:?} plane {j} [{p}]: {v} vs {want}");
                }
                outs.extend(out);
            }
            let n = 5 * LANES;
            let a: Vec<f32> = (0..2 * n).map(|t| ((t * 29 % 31) as f32 - 15.0) / 9.0).collect();
            let offs: Vec<usize> = (0..2 * GROUP).map(|t| (t * 13) % 90).collect();
            let mut acc = vec![[1.0f32; LANES]; 2 * offs.len()];
            let one = |data| Runs { data, stride: 0, count: 1 };
            dot_lanes_on(isa, &mut acc, [one(&a[..n]), one(&a[n..])], n, one(&src), &offs);
            for (i, a) in a.chunks_exact(n).enumerate() {
                for (t, &o) in offs.iter().enumerate() {
                    let dot: f64 = a.iter().enumerate().map(|(p, &v)| v as f64 * src[o + p] as f64).sum();
                    let got = sum_lanes(&acc[i * offs.len() + t]) as f64;
                    assert!((got - LANES as f64 - dot).abs() < 1e-4, "{isa} dot_lanes[{i}][{t}]: {got} vs {dot}");
                }
            }
            outs.extend(acc.iter().flatten());
            let mut dst = vec![0.5f32; 200];
            add_planes_on(isa, &mut dst, &src[..3 * 64], 64, &[0, 7, 100], 50);
            for (i, &d) in dst.iter().enumerate() {
                let want: f32 = 0.5
                    + [0, 7, 100]
                        .iter()
                        .enumerate()
                        .filter(|(_, &o)| (o..o + 50).contains(&i))
                        .map(|(t, &o)| src[t * 64 + i - o])
                        .sum::<f32>();
                assert!((d - want).abs() < 1e-6, "{isa} add_planes[{i}]: {d} vs {want}");
            }
            if isa != Isa::Portable {
                fused.push(outs);
            }
        }
        for other in fused.iter().skip(1) {
            assert!(other == &fused[0], "the FMA tiers disagree");
        }
    }
}
