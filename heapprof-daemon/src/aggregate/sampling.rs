//! Turning sampled counts back into estimates of the real ones.
//!
//! With Poisson sampling by bytes at mean rate R, an allocation of s bytes is recorded
//! with probability 1 - exp(-s/R). Each recorded allocation therefore stands for
//! 1 / (1 - exp(-s/R)) allocations. As Go's runtime does, a site's average block size
//! stands in for s, separately for allocated and in-use counts.

/// Unbiased estimates of (objects, bytes) from `objects` sampled blocks totalling
/// `bytes`, at mean sampling rate `rate` bytes (0: not sampled, returned as they are).
pub fn scale(objects: u64, bytes: u64, rate: u64) -> (u64, u64) {
    if rate == 0 || objects == 0 {
        return (objects, bytes);
    }
    let average = bytes as f64 / objects as f64;
    let probability = -(-average / rate as f64).exp_m1();
    if probability <= 0.0 {
        // Zero-byte blocks can be recorded only by the draw that follows another pick.
        return (objects, bytes);
    }
    let scale = 1.0 / probability;
    (
        (objects as f64 * scale).round() as u64,
        (bytes as f64 * scale).round() as u64,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsampled_counts_are_unchanged() {
        assert_eq!(scale(10, 1000, 0), (10, 1000));
        assert_eq!(scale(0, 0, 4096), (0, 0));
    }

    #[test]
    fn small_blocks_scale_up_by_the_inverse_probability() {
        // 64-byte blocks at a 512 KiB rate: p = 1 - exp(-64/524288) ≈ 1/8192.5
        let (objects, bytes) = scale(1, 64, 512 * 1024);
        assert!((8190..=8195).contains(&objects), "{objects}");
        assert!(
            bytes.abs_diff(objects * 64) < 64,
            "{bytes} vs {objects} x 64"
        );
    }

    #[test]
    fn huge_blocks_are_always_sampled_and_not_scaled() {
        assert_eq!(scale(3, 3 << 30, 4096), (3, 3 << 30));
    }
}
