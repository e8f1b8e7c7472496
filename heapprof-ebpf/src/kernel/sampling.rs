//! Sampling's filter over the tracked objects' addresses: a counter per slot of
//! addresses, so that the free of an object that was not sampled (most frees, when
//! sampling) skips the live table's lookup.

use aya_ebpf::{macros::map, maps::Array};
use heapprof_common::kernel::KernelLiveKey;

use super::config::{HASH_MULTIPLIER, KERNEL_CONFIG, config_u64};
use crate::atomic::add_32;

/// Sampling only: how many kernel entries of `LIVE` each slot's addresses have (see
/// [`filter_slot`]). A free whose slot holds 0 has nothing to release and skips the
/// table's lookup, which most frees then are: only sampled objects are tracked.
#[map(name = "KERNEL_LIVE_FILTER")]
static KERNEL_LIVE_FILTER: Array<u32> = Array::with_max_entries(LIVE_FILTER_SLOTS, 0);
/// Slots of [`KERNEL_LIVE_FILTER`] (256 KiB).
const LIVE_FILTER_SLOTS: u32 = 1 << 16;

/// The slot of [`KERNEL_LIVE_FILTER`] that counts `key`'s entry, when sampling.
#[inline(always)]
pub(super) fn filter_slot(key: &KernelLiveKey) -> Option<*mut u32> {
    if config_u64(&KERNEL_CONFIG.sample_rate) == 0 {
        return None;
    }
    let hash = (key.addr ^ u64::from(key.space)).wrapping_mul(HASH_MULTIPLIER);
    KERNEL_LIVE_FILTER.get_ptr_mut((hash >> 48) as u32 % LIVE_FILTER_SLOTS)
}

/// Counts an entry added to (`1`) or removed from (`u32::MAX`, minus one) `KERNEL_LIVE`
/// in its filter slot, when sampling.
#[inline(always)]
pub(super) fn count_in_filter(key: &KernelLiveKey, delta: u32) {
    if let Some(slot) = filter_slot(key) {
        // SAFETY: a slot of the array, only changed atomically.
        unsafe { add_32(slot, delta) };
    }
}
