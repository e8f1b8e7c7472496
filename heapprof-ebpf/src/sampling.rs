//! Poisson sampling by bytes (`--sample-rate`), as Go's and tcmalloc's heap profilers.

use aya_ebpf::helpers::bpf_get_prandom_u32;

use crate::maps::{SAMPLER, sample_rate};

/// Whether an allocation of `size` bytes is recorded: always, unless sampling, where
/// allocations are picked by a Poisson process over bytes (each byte equally likely,
/// mean one pick every `sample_rate` bytes), as in Go and tcmalloc.
#[inline(always)]
pub fn sampled(size: u64) -> bool {
    sampled_at(size, sample_rate())
}

/// [`sampled`] at mean rate `rate` bytes (0: every allocation is recorded).
#[inline(always)]
pub fn sampled_at(size: u64, rate: u64) -> bool {
    if rate == 0 {
        return true;
    }
    let Some(remaining) = SAMPLER.get_ptr_mut(0) else {
        return true;
    };
    // SAFETY: this CPU's slot; programs on one CPU do not interleave.
    unsafe {
        if *remaining == 0 {
            *remaining = exponential(rate);
        }
        if size < *remaining {
            *remaining -= size;
            false
        } else {
            *remaining = exponential(rate);
            true
        }
    }
}

/// A draw from the exponential distribution with mean `mean` (at least 1), in integer
/// arithmetic: -ln(u) * mean with u uniform in (0, 1], from a binary logarithm.
/// Branch-free, so the verifier walks it once.
#[inline(always)]
fn exponential(mean: u64) -> u64 {
    // SAFETY: a helper without arguments or preconditions.
    let x = u64::from(unsafe { bpf_get_prandom_u32() } | 1);
    // Integer part of log2(x) by halving; `(high + mask) >> bits` is 1 when high != 0.
    let mut msb = 0u64;
    let mut y = x;
    for bits in [16u64, 8, 4, 2, 1] {
        let shift = (((y >> bits) + ((1 << bits) - 1)) >> bits) * bits;
        y >>= shift;
        msb += shift;
    }
    // Fractional part, 12 bits, by repeated squaring of the mantissa in Q1.31
    // (a square at or above 2.0 yields a 1 bit and is halved).
    let mut mantissa = x << (31 - msb);
    let mut fraction = 0u64;
    for _ in 0..12 {
        mantissa = (mantissa * mantissa) >> 31;
        let bit = mantissa >> 32;
        mantissa >>= bit;
        fraction = (fraction << 1) | bit;
    }
    // -log2(x / 2^32) in Q.12, then times ln 2 (2839/4096) and the mean.
    let neg_log2 = (32 << 12) - ((msb << 12) | fraction);
    let draw = (((mean * neg_log2) >> 12) * 2839) >> 12;
    draw | u64::from(draw == 0)
}
