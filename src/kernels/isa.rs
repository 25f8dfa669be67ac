//! Instruction-set tiers of the compute kernels, chosen once per process.
//!
//! Every hot kernel exists in three tiers: [`Isa::Avx512`] (AVX-512F with FMA), [`Isa::Avx2`]
//! (AVX2 with FMA: AMD Zen 1–3, Intel Haswell and later) and [`Isa::Portable`] (whatever the
//! target compiles to without extra features: SSE2 on x86-64, NEON on aarch64). The tier is picked
//! once, at the first kernel call or by [`Isa::select`], from what the CPU supports; a lower one can
//! be forced (the recipe's `runtime.isa`, `lbbsp train --isa` or `LBBSP_ISA`) to compare tiers or
//! to reproduce a run of another host. Within a tier, results are the same bits whatever the thread count or batch
//! split; across tiers they agree to float rounding (the portable tier has no fused multiply-add).
//!
//! The kernels share one shape over the tiers through `Simd`, a vector of `LANES` floats with the
//! handful of operations a register tile needs. Kernel bodies are `#[inline(always)]` generic
//! functions instantiated inside `#[target_feature]` entry points, so each tier's copy is compiled
//! for its instruction set. NEON kernels would slot in as one more `Simd` implementation behind
//! `cfg(target_arch = "aarch64")` and one more variant.

use crate::error::{Error, Result};
use std::sync::OnceLock;

/// An instruction-set tier of the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Isa {
    /// AVX-512F + FMA (x86-64).
    Avx512,
    /// AVX2 + FMA (x86-64).
    Avx2,
    /// No extra instruction-set features: the target's baseline.
    Portable,
}

/// What a user may ask for: a tier, or the best the CPU has. Written as its name (`auto`, `avx512`,
/// `avx2`, `portable`) in recipes and on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IsaChoice {
    #[default]
    Auto,
    Exactly(Isa),
}

static ACTIVE: OnceLock<Isa> = OnceLock::new();

impl Isa {
    /// Every tier, best first.
    pub const ALL: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Portable];

    /// The name used on the command line, in `LBBSP_ISA`, in run headers and summaries.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }

    /// Whether this CPU can run the tier.
    pub fn supported(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx512 | Isa::Avx2 => false,
            Isa::Portable => true,
        }
    }

    /// The best tier this CPU supports.
    pub fn best() -> Isa {
        Isa::ALL.into_iter().find(|t| t.supported()).unwrap_or(Isa::Portable)
    }

    /// The tiers this CPU supports, best first: the ones tests and benchmarks can force.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|t| t.supported()).collect()
    }

    /// The tier in use: the one [`Isa::select`] chose, else (fixed on first use) the best the CPU has.
    pub fn active() -> Isa {
        *ACTIVE.get_or_init(Isa::best)
    }

    /// Fixes the tier for this process, before any kernel runs: `Auto` takes the best the CPU has.
    /// Errors if the CPU lacks the tier, or if kernels already run on another one.
    pub fn select(choice: IsaChoice) -> Result<Isa> {
        let want = choice.resolve()?;
        let got = *ACTIVE.get_or_init(|| want);
        if got != want {
            return Err(Error::Config {
                field: "isa".into(),
                msg: format!(
                    "kernels already run on the {} tier in this process; choose the tier before the first computation",
                    got.name()
                ),
            });
        }
        Ok(got)
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for IsaChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<IsaChoice> {
        match s {
            "auto" => Ok(IsaChoice::Auto),
            _ => Isa::ALL.into_iter().find(|t| t.name() == s).map(IsaChoice::Exactly).ok_or_else(|| Error::Config {
                field: "isa".into(),
                msg: format!("unknown instruction-set tier {s:?}: use auto, avx512, avx2 or portable"),
            }),
        }
    }
}

impl std::fmt::Display for IsaChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

crate::error::serde_as_string!(IsaChoice);

impl IsaChoice {
    /// Its name: `auto` or the tier's.
    pub fn name(self) -> &'static str {
        match self {
            IsaChoice::Auto => "auto",
            IsaChoice::Exactly(t) => t.name(),
        }
    }

    /// The tier this choice means on this CPU.
    pub fn resolve(self) -> Result<Isa> {
        match self {
            IsaChoice::Auto => Ok(Isa::best()),
            IsaChoice::Exactly(t) if t.supported() => Ok(t),
            IsaChoice::Exactly(t) => Err(Error::Config {
                field: "isa".into(),
                msg: format!(
                    "this CPU cannot run the {} tier; it supports {}",
                    t.name(),
                    Isa::available().iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
                ),
            }),
        }
    }
}

/// The CPU's model name as the OS reports it (`/proc/cpuinfo`), or the architecture where it does
/// not: for benchmark and run reports.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// Asks for the cache line at `p` in a state ready for writing; no effect where the target has no
/// such hint. Never faults, whatever `p`.
#[inline(always)]
pub(crate) fn prefetch_for_write(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it reads nothing and cannot fault (PREFETCHW runs as a no-op on
    // CPUs without it).
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_ET0 }>(p as *const i8)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `a·b + c`: fused (one rounding) on the tiers with FMA, a multiply then an add on the portable one,
/// where a fused multiply-add would be a slow library call.
#[inline(always)]
pub(crate) fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// A vector of `LANES` floats: what a register tile of a kernel is made of. Implementations are
/// zero-sized tokens; every method is `#[inline(always)]` so that it compiles inside the caller's
/// `#[target_feature]` entry point.
pub(crate) trait Simd: Copy {
    type V: Copy;
    const LANES: usize;
    /// Whether [`Simd::madd`] is fused (one rounding).
    const FMA: bool;
    /// # Safety
    /// The CPU must support the tier (all methods).
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    /// # Safety
    /// `p` must be valid for `LANES` reads (no alignment needed).
    unsafe fn load(p: *const f32) -> Self::V;
    /// # Safety
    /// `p` must be valid for `LANES` writes (no alignment needed).
    unsafe fn store(p: *mut f32, v: Self::V);
    /// `a·b + c`, fused where the tier has FMA.
    unsafe fn madd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
}

/// AVX2 + FMA: 8 lanes in a ymm register.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Simd for Avx2 {
    type V = std::arch::x86_64::__m256;
    const LANES: usize = 8;
    const FMA: bool = true;
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        std::arch::x86_64::_mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        std::arch::x86_64::_mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        std::arch::x86_64::_mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn madd(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::arch::x86_64::_mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
        std::arch::x86_64::_mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
        std::arch::x86_64::_mm256_add_ps(a, b)
    }
}

/// The portable tier: 4 lanes as a plain array, which the compiler maps onto the target's baseline
/// vectors (SSE2 on x86-64, NEON on aarch64); multiply and add stay separate.
#[derive(Clone, Copy)]
pub(crate) struct Portable;

impl Simd for Portable {
    type V = [f32; 4];
    const LANES: usize = 4;
    const FMA: bool = false;
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        [0.0; 4]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        [x; 4]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        std::ptr::read_unaligned(p as *const [f32; 4])
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        std::ptr::write_unaligned(p as *mut [f32; 4], v)
    }
    #[inline(always)]
    unsafe fn madd(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        let mut r = c;
        for l in 0..4 {
            r[l] = a[l] * b[l] + c[l];
        }
        r
    }
    #[inline(always)]
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
        let mut r = a;
        for l in 0..4 {
            r[l] = a[l] * b[l];
        }
        r
    }
    #[inline(always)]
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
        let mut r = a;
        for l in 0..4 {
            r[l] = a[l] + b[l];
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_the_portable_tier_runs_everywhere() {
        for t in Isa::ALL {
            assert_eq!(t.name().parse::<IsaChoice>().unwrap(), IsaChoice::Exactly(t));
        }
        assert_eq!("auto".parse::<IsaChoice>().unwrap(), IsaChoice::Auto);
        let err = "avx3".parse::<IsaChoice>().unwrap_err().to_string();
        assert!(err.contains("avx512, avx2 or portable"), "{err}");
        assert!(Isa::Portable.supported());
        assert_eq!(Isa::available()[0], Isa::best());
        assert_eq!(*Isa::available().last().unwrap(), Isa::Portable);
    }
}
