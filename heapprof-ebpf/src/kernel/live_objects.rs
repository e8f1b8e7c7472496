//! The objects tracked from their allocation to their free, each with its site's
//! index and sizes, and their release, which credits the free to that site.
//!
//! The live objects are in user mode's live-block table (`LIVE`: one array changed
//! with atomic exchanges, no bucket lock, free list or kernel call per insert and
//! removal as a hash map costs), each entry with its site's index. Kernels before
//! 5.12 refuse any program holding an atomic instruction that returns a value, even
//! unreached: for them every program that records or frees has a copy (its name with
//! `HASHED_SUFFIX`) keeping the live objects in `KERNEL_LIVE`, a hash map. The const
//! parameter `ARRAY` of the functions here and in the program rooms chooses.

use aya_ebpf::{macros::map, maps::HashMap};
use heapprof_common::kernel::{KernelLiveBlock, KernelLiveKey, KernelSpace};

use super::{
    config::{KERNEL_CONFIG, config_u64},
    sites::credit_free,
};
use crate::{live, live_filter};

// Capacities are placeholders: the daemon sets them from its flags before loading.
// The live objects are in user mode's live-block table (`LIVE`: one array changed
// with atomic exchanges, no bucket lock, free list or kernel call per insert and
// removal as a hash map costs), each entry with its site's index. Kernels before
// 5.12 refuse any program holding an atomic instruction that returns a value, even
// unreached: for them every program that records or frees has a copy (its name with
// `HASHED_SUFFIX`) keeping the live objects in `KERNEL_LIVE`, a hash map. The const
// parameter `ARRAY` of the functions below chooses.
/// Live objects, each with its site's index (kernels before 5.12).
#[map(name = "KERNEL_LIVE")]
pub(super) static KERNEL_LIVE: HashMap<KernelLiveKey, KernelLiveBlock> =
    HashMap::with_max_entries(1 << 20, 0);

/// The address an object is recorded at in `LIVE`: a slab object's own, a page's
/// frame number shifted as if it were an address (the table's homes cover 32 bytes:
/// unshifted, 32 neighbouring pages would share one home of 9 slots).
#[inline(always)]
pub(super) fn array_address(addr: u64, space: KernelSpace) -> u64 {
    match space {
        KernelSpace::Slab => addr,
        KernelSpace::Pages => addr << 12,
    }
}

/// When sampling, the slot of `LIVE_FILTER` counting the object at `addr` in `space`:
/// that of its entry in `LIVE`, whichever table holds it (see `crate::live_filter`).
#[inline(always)]
pub(super) fn filter_slot(addr: u64, space: KernelSpace) -> Option<*mut u32> {
    let sampling = config_u64(&KERNEL_CONFIG.sample_rate) != 0;
    live_filter::slot(sampling, array_address(addr, space), space as u32)
}

/// Credits the free of a tracked object (`addr` in `space`) to the site that
/// allocated it; untracked objects (allocated before tracing, or not counted) are
/// ignored. Returns whether the object was tracked.
#[inline(always)]
pub(super) fn release<const ARRAY: bool>(addr: u64, space: KernelSpace) -> bool {
    let key = KernelLiveKey {
        addr,
        space: space as u32,
        _pad: 0,
    };
    let filter = filter_slot(addr, space);
    if live_filter::empty(filter) {
        return false; // an unsampled object's free, most of them when sampling
    }
    if ARRAY {
        // None also when another CPU freed it first: counted once.
        let Some(entry) = live::zeroed::remove(key.space, array_address(addr, space)) else {
            return false;
        };
        live_filter::add(filter, u32::MAX);
        credit_free(entry.site, entry.size);
        return true;
    }
    // SAFETY: the value is copied out before the entry is removed.
    let Some(block) = (unsafe { KERNEL_LIVE.get(&key) }).copied() else {
        return false;
    };
    if KERNEL_LIVE.remove(&key).is_err() {
        // Another CPU freed it first (a double free would be the kernel's bug): count once.
        return false;
    }
    live_filter::add(filter, u32::MAX);
    credit_free(block.site, block.sizes);
    true
}
