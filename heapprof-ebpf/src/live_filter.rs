//! Sampling's filter in front of the live table (`LIVE_FILTER`), shared by user and
//! kernel mode: a counter per slot of spans (`heapprof_common::live::filter_slot`)
//! holding how many entries of `LIVE` (or, before 5.12 in kernel mode, of
//! `KERNEL_LIVE`) its spans have. Every entry is counted from before its insert until
//! after its removal, so a free whose slot holds 0 has nothing recorded and skips the
//! table's lookup: most frees, when sampling. Each mode decides from its own
//! configuration whether it samples; exact sessions leave the filter alone (nearly
//! every free finds its block) and the daemon sizes it to one value.

use heapprof_common::live::{filter_place, filter_slot};

use crate::{atomic::add_32, maps::LIVE_FILTER};

/// The slot counting the entry at `ptr` of `tgid` (kernel mode: of its space), when
/// `sampling`.
#[inline(always)]
pub fn slot(sampling: bool, ptr: u64, tgid: u32) -> Option<*mut u32> {
    if !sampling {
        return None;
    }
    let (index, counter) = filter_place(filter_slot(ptr, tgid));
    let pair = LIVE_FILTER.get_ptr_mut(index)?;
    // SAFETY: a counter of the map value.
    Some(unsafe { (&raw mut (*pair).counts).cast::<u32>().add(counter & 1) })
}

/// Adds `delta` (`u32::MAX` takes one away) to a slot, if any.
#[inline(always)]
pub fn add(slot: Option<*mut u32>, delta: u32) {
    if let Some(slot) = slot {
        // SAFETY: a map value, only changed atomically.
        unsafe { add_32(slot, delta) };
    }
}

/// Whether `slot` says no entry of its spans is recorded (never without a slot).
#[inline(always)]
pub fn empty(slot: Option<*mut u32>) -> bool {
    // SAFETY: a map value; a plain read of a counter changed atomically.
    slot.is_some_and(|slot| unsafe { core::ptr::read_volatile(slot) } == 0)
}
