//! Per-site counters and the live-block table.

use aya_ebpf::bindings::BPF_NOEXIST;
use heapprof_common::{DropReason, LiveBlock, LiveKey, SiteCounters, StackKey, UserStack};

use crate::{
    maps::{LIVE, SITES, STACKS, count_drop},
    usage,
};

const EEXIST: i32 = 17;

/// Adds to the counters of `site`, creating them on first use; a new site's stack,
/// when given, is stored then (one site lookup per call on the common path).
#[inline(always)]
pub fn add_to_site(
    site: &StackKey,
    new_stack: Option<&UserStack>,
    alloc_objects: u64,
    alloc_bytes: u64,
    free_objects: u64,
    free_bytes: u64,
) -> bool {
    let mut counters = SITES.get_ptr_mut(site);
    if counters.is_none() {
        if let Some(stack) = new_stack {
            // Another kind at the same stack may have stored it already.
            match STACKS.insert(&site.stack, stack, BPF_NOEXIST as u64) {
                Ok(()) => {}
                Err(err) if err == -EEXIST => {}
                Err(_) => count_drop(DropReason::StackTableFull),
            }
        }
        let zero = SiteCounters::default();
        // Another CPU may have created it meanwhile: NOEXIST then fails harmlessly.
        let _ = SITES.insert(site, &zero, BPF_NOEXIST as u64);
        counters = SITES.get_ptr_mut(site);
    }
    match counters {
        Some(counters) => {
            // SAFETY: this CPU's copy of a per-CPU value.
            unsafe {
                (*counters).alloc_objects += alloc_objects;
                (*counters).alloc_bytes += alloc_bytes;
                (*counters).free_objects += free_objects;
                (*counters).free_bytes += free_bytes;
            }
            true
        }
        None => false,
    }
}

/// Where a change of a process's in-use bytes goes: straight to its total, or into
/// a batch that is added at its end (see [`usage::UsageBatch`]).
pub enum Usage<'a> {
    /// `PROCESS_USAGE`, one atomic update per block.
    Direct,
    /// A batch of one thread's records.
    Batch(&'a mut usage::UsageBatch),
}

impl Usage<'_> {
    #[inline(always)]
    fn grow(&mut self, tgid: u32, bytes: u64) {
        match self {
            Usage::Direct => usage::grow(tgid, bytes),
            Usage::Batch(batch) => batch.grow(bytes),
        }
    }

    #[inline(always)]
    fn shrink(&mut self, tgid: u32, bytes: u64) {
        match self {
            Usage::Direct => usage::shrink(tgid, bytes),
            Usage::Batch(batch) => batch.shrink(bytes),
        }
    }
}

/// Credits the free of a tracked block to the site that allocated it.
#[inline(always)]
pub fn release(tgid: u32, ptr: u64) {
    release_into(tgid, ptr, &mut Usage::Direct);
}

/// [`release`], with the in-use change going to `usage`.
#[inline(always)]
pub fn release_into(tgid: u32, ptr: u64, usage: &mut Usage<'_>) {
    if ptr == 0 {
        return;
    }
    let key = LiveKey { ptr, tgid, _pad: 0 };
    // SAFETY: the value is copied out before the entry is removed.
    let Some(block) = (unsafe { LIVE.get(&key) }).copied() else {
        // Allocated before tracing began (or not tracked): ignored, never negative.
        return;
    };
    let _ = LIVE.remove(&key);
    add_to_site(&block.site, None, 0, 0, 1, block.size);
    usage.shrink(tgid, block.size);
}

/// Counts a new block at `site` and remembers it until its free; `stack` is stored
/// if the site is new (a site known by its hash alone has its stack stored already).
/// Returns whether the site counted it.
#[inline(always)]
pub fn allocated(
    tgid: u32,
    ptr: u64,
    size: u64,
    site: &StackKey,
    stack: Option<&UserStack>,
) -> bool {
    allocated_into(tgid, (ptr, size), site, stack, &mut Usage::Direct)
}

/// [`allocated`], with the in-use change going to `usage`.
#[inline(always)]
pub fn allocated_into(
    tgid: u32,
    (ptr, size): (u64, u64),
    site: &StackKey,
    stack: Option<&UserStack>,
    usage: &mut Usage<'_>,
) -> bool {
    if !add_to_site(site, stack, 1, size, 0, 0) {
        count_drop(DropReason::SiteTableFull);
        return false;
    }
    let key = LiveKey { ptr, tgid, _pad: 0 };
    let block = LiveBlock { size, site: *site };
    let mut inserted = LIVE.insert(&key, &block, BPF_NOEXIST as u64);
    if inserted == Err(-EEXIST) {
        // Still recorded at this address: it was freed by a path we did not see (the
        // allocator reused it). Close it so its site's in-use stays right. Checked only
        // on this rare failure, so the common path costs one map operation.
        release_into(tgid, ptr, usage);
        inserted = LIVE.insert(&key, &block, BPF_NOEXIST as u64);
    }
    if inserted.is_err() {
        // Its free cannot be matched: count it as released now, so that in-use stays
        // what is tracked instead of growing by blocks that may be long gone.
        count_drop(DropReason::LiveTableFull);
        add_to_site(site, None, 0, 0, 1, size);
        return true;
    }
    usage.grow(tgid, size);
    true
}
