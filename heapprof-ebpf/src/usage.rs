//! Each process's in-use bytes and their high-water mark: in the slot of
//! `USAGE_SLOTS` its id picks, which the process owns until the daemon retires it, or,
//! if another process owns that slot, in the hash map `PROCESS_USAGE` (every
//! allocation and free changes it: an array slot is found with no kernel call).
//!
//! Sites are per-CPU counters, summed by the daemon when it reads them; a peak cannot
//! be summed that way, since the CPUs' highs happen at different moments. So the
//! process total is one shared counter changed with atomic adds: the value each add
//! returns is the exact total at that instant, and the peak is the largest of them,
//! kept with compare-and-swap.

use aya_ebpf::bindings::BPF_NOEXIST;
use heapprof_common::{DropReason, ProcessUsage, ProcessUsageSlot};

use crate::{
    atomic::{compare_exchange, fetch_add},
    maps::{PROCESS_USAGE, USAGE_SLOTS, count_drop, track_peak, usage_slots},
};

/// Compare-and-swap attempts to raise the peak: each failure means another CPU moved
/// it, and its value is re-read; more than a few in a row is contention the next
/// allocation settles.
const PEAK_ATTEMPTS: usize = 4;

/// A process's usage for the changes one call makes, looked up once (an allocation
/// reads its peak count, then adds its block; a free the same with its block).
pub struct Process {
    /// The usage, once looked up (null: not yet, or the table is full).
    usage: *mut ProcessUsage,
}

impl Process {
    /// Nothing looked up yet.
    #[inline(always)]
    pub const fn new() -> Self {
        Self {
            usage: core::ptr::null_mut(),
        }
    }

    /// `tgid`'s usage, created on first use; `None` when peaks are not kept.
    #[inline(always)]
    fn get(&mut self, tgid: u32) -> Option<*mut ProcessUsage> {
        if !track_peak() {
            return None;
        }
        if self.usage.is_null() {
            self.usage = usage_of(tgid).unwrap_or(core::ptr::null_mut());
        }
        (!self.usage.is_null()).then_some(self.usage)
    }

    /// How many times `tgid`'s peak was raised (0 when peaks are not kept or it has
    /// none yet): read before a site changes, see `heapprof_common::SiteCounters`.
    #[inline(always)]
    pub fn peaks(&mut self, tgid: u32) -> u64 {
        match self.get(tgid) {
            // SAFETY: a map value whose fields are only accessed atomically.
            Some(usage) => unsafe { core::ptr::read_volatile(&raw const (*usage).peaks) },
            None => 0,
        }
    }

    /// Adds a new block's bytes to `tgid`'s total and raises its peak.
    #[inline(always)]
    pub fn grow(&mut self, tgid: u32, bytes: u64) {
        if let Some(usage) = self.get(tgid) {
            // SAFETY: a map value, valid for the program's run.
            unsafe { add_and_raise_peak(usage, bytes) };
        }
    }

    /// Takes a freed block's bytes off `tgid`'s total.
    #[inline(always)]
    pub fn shrink(&mut self, tgid: u32, bytes: u64) {
        if let Some(usage) = self.get(tgid) {
            // SAFETY: a map value whose fields are only accessed atomically.
            unsafe { fetch_add(&raw mut (*usage).inuse_bytes, bytes.wrapping_neg()) };
        }
    }
}

/// The slot process `tgid` would own.
#[inline(always)]
fn slot_of(tgid: u32) -> Option<*mut ProcessUsageSlot> {
    USAGE_SLOTS.get_ptr_mut(tgid & (usage_slots() - 1))
}

/// `tgid`'s usage, if it has any yet.
#[inline(always)]
fn find(tgid: u32) -> Option<*mut ProcessUsage> {
    if let Some(slot) = slot_of(tgid) {
        // SAFETY: a map value; its owner is only changed atomically.
        if unsafe { core::ptr::read_volatile(&raw const (*slot).owner) } == u64::from(tgid) {
            // SAFETY: as above.
            return Some(unsafe { &raw mut (*slot).usage });
        }
    }
    PROCESS_USAGE.get_ptr_mut(&tgid)
}

/// `tgid`'s usage, created on first use: its slot if free (the daemon zeroes a slot
/// before it frees it), else an entry of `PROCESS_USAGE`.
#[inline(always)]
fn usage_of(tgid: u32) -> Option<*mut ProcessUsage> {
    if let Some(usage) = find(tgid) {
        return Some(usage);
    }
    if let Some(slot) = slot_of(tgid) {
        // SAFETY: a map value; the owner is claimed atomically.
        unsafe {
            let owner = compare_exchange(&raw mut (*slot).owner, 0, u64::from(tgid));
            if owner == 0 || owner == u64::from(tgid) {
                return Some(&raw mut (*slot).usage);
            }
        }
    }
    let mut usage = PROCESS_USAGE.get_ptr_mut(&tgid);
    if usage.is_none() {
        // Another CPU may create it first: NOEXIST then fails harmlessly.
        let _ = PROCESS_USAGE.insert(&tgid, &ProcessUsage::default(), BPF_NOEXIST as u64);
        usage = PROCESS_USAGE.get_ptr_mut(&tgid);
    }
    if usage.is_none() {
        count_drop(DropReason::UsageTableFull);
    }
    usage
}

/// The atomic part of [`grow`]: adds `bytes` and raises the peak to the new total.
///
/// # Safety
/// `usage` points to a live map value whose fields are only accessed atomically.
#[inline(always)]
unsafe fn add_and_raise_peak(usage: *mut ProcessUsage, bytes: u64) {
    // SAFETY: a field of a live map value, only accessed atomically, as the caller
    // promises.
    let total = unsafe { fetch_add(&raw mut (*usage).inuse_bytes, bytes) }.wrapping_add(bytes);
    // SAFETY: the same `usage`, as the caller promises.
    if unsafe { raise_peak(usage, total) } {
        // SAFETY: a field of the same value, only accessed atomically.
        unsafe { fetch_add(&raw mut (*usage).peaks, 1) };
    }
}

/// Raises the peak of `usage` to `total` with compare-and-swap; returns whether it
/// did.
///
/// # Safety
/// As [`add_and_raise_peak`].
#[inline(always)]
unsafe fn raise_peak(usage: *mut ProcessUsage, total: u64) -> bool {
    // SAFETY: `usage` is a live map value, as the caller promises; only a place is
    // computed.
    let peak = unsafe { &raw mut (*usage).peak_bytes };
    // SAFETY: an aligned field of that value; a volatile read is one load.
    let mut seen = unsafe { core::ptr::read_volatile(peak) };
    for _ in 0..PEAK_ATTEMPTS {
        if total <= seen {
            return false;
        }
        // SAFETY: the same field, only changed atomically, as the caller promises.
        let found = unsafe { compare_exchange(peak, seen, total) };
        if found == seen {
            return true;
        }
        seen = found;
    }
    false
}

/// The in-use change of a batch of one thread's records (the preload library's
/// queue), applied in order: added to the process's total once at the batch's end,
/// the peak raised to the total before it plus the batch's highest running sum, as
/// if no other thread's change had come between the records. The new peaks within
/// the batch are counted as they come, from the total and peak read at its start, so
/// that its sites save their values at the right record (see
/// `heapprof_common::SiteCounters`).
#[repr(C)]
#[derive(Default)]
pub struct UsageBatch {
    /// Bytes added so far (wrapping: frees subtract).
    delta: u64,
    /// The highest value `delta` reached (signed), at least 0.
    high: u64,
    /// The process's total when the batch started.
    base: u64,
    /// Its peak then, raised as the batch's running total passes it.
    peak: u64,
    /// Its count of new peaks then, plus the batch's own.
    peaks: u64,
    /// The batch's own new peaks.
    new_peaks: u64,
}

impl UsageBatch {
    /// A batch of `tgid`'s records starts.
    #[inline(always)]
    pub fn start(tgid: u32) -> Self {
        let mut batch = Self::default();
        if !track_peak() {
            return batch;
        }
        if let Some(usage) = find(tgid) {
            // SAFETY: a map value whose fields are only accessed atomically.
            unsafe {
                batch.base = core::ptr::read_volatile(&raw const (*usage).inuse_bytes);
                batch.peak = core::ptr::read_volatile(&raw const (*usage).peak_bytes);
                batch.peaks = core::ptr::read_volatile(&raw const (*usage).peaks);
            }
        }
        batch
    }

    /// The process's count of new peaks at this point of the batch.
    #[inline(always)]
    pub fn peaks(&self) -> u64 {
        self.peaks
    }

    /// A block of `bytes` comes.
    #[inline(always)]
    pub fn grow(&mut self, bytes: u64) {
        self.delta = self.delta.wrapping_add(bytes);
        if (self.delta as i64) > (self.high as i64) {
            self.high = self.delta;
        }
        let total = self.base.wrapping_add(self.delta);
        if track_peak() && total > self.peak {
            self.peak = total;
            self.peaks += 1;
            self.new_peaks += 1;
        }
    }

    /// A block of `bytes` goes.
    #[inline(always)]
    pub fn shrink(&mut self, bytes: u64) {
        self.delta = self.delta.wrapping_sub(bytes);
    }

    /// Adds the batch to `tgid`'s total and raises its peak.
    #[inline(always)]
    pub fn apply(&self, tgid: u32) {
        if !track_peak() || (self.delta == 0 && self.high == 0) {
            return;
        }
        let Some(usage) = usage_of(tgid) else {
            return;
        };
        // SAFETY: a map value, valid for the program's run; its fields are only
        // accessed atomically.
        unsafe {
            let before = fetch_add(&raw mut (*usage).inuse_bytes, self.delta);
            raise_peak(usage, before.wrapping_add(self.high));
            if self.new_peaks != 0 {
                fetch_add(&raw mut (*usage).peaks, self.new_peaks);
            }
        }
    }
}

/// A process replaced its image: its blocks went with the old address space.
#[inline(always)]
pub fn reset(tgid: u32) {
    if let Some(usage) = find(tgid) {
        // SAFETY: as in `grow`.
        unsafe { core::ptr::write_volatile(&raw mut (*usage).inuse_bytes, 0) };
    }
}
