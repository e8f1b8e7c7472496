//! Sites (an index per process x stack x function, and per-CPU counters by index)
//! and the blocks they allocated.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_get_current_pid_tgid};
use heapprof_common::{
    DropReason, LiveKey, SiteId, StackKey, StaleFree, UserStack, live::LiveEntry,
};

use crate::{
    atomic::fetch_add,
    live::{self, Inserted},
    live_filter,
    maps::{
        SITE_COUNTERS, SITE_IDS_FREE, SITE_IDS_NEXT, SITES, STACKS, STALE_FREES, STALE_PENDING,
        count_drop, count_late_free, count_only, max_sites, sample_rate,
    },
};

/// When sampling, the slot of `LIVE_FILTER` counting the block at `ptr` of `tgid`
/// (see `crate::live_filter`).
#[inline(always)]
fn filter_slot(ptr: u64, tgid: u32) -> Option<*mut u32> {
    live_filter::slot(sample_rate() != 0, ptr, tgid)
}

/// Whether the block at `ptr` of `tgid` may be in the live table: sampling's filter
/// has an entry of its spans (always, when not sampling; never for a null block).
#[inline(always)]
pub fn maybe_tracked(tgid: u32, ptr: u64) -> bool {
    ptr != 0 && !live_filter::empty(filter_slot(ptr, tgid))
}

/// Whether any late free is expected (one array lookup spares the others a hash
/// lookup on every queued free).
#[inline(always)]
fn stale_frees_pending() -> bool {
    STALE_PENDING.get(0).is_some_and(|pending| *pending != 0)
}

/// The current thread's id (`pid_tgid`'s low half): the thread whose records are
/// being applied, a probe's or its own queue's.
#[inline(always)]
fn current_thread() -> u32 {
    bpf_get_current_pid_tgid() as u32
}

/// Adds `delta` (two's complement to take away) to the late frees expected in all.
#[inline(always)]
fn add_pending(delta: u64) {
    if let Some(pending) = STALE_PENDING.get_ptr_mut(0) {
        // SAFETY: a map value, only accessed atomically.
        unsafe { fetch_add(pending, delta) };
    }
}

/// Notes that a free of `key` waiting in some thread's queue is stale, and that the
/// current thread's allocation took the address.
#[inline(always)]
fn expect_stale_free(key: &LiveKey) {
    let replacer = current_thread();
    match STALE_FREES.get_ptr_mut(key) {
        // SAFETY: fields of a map value; a lost update under a race between CPUs only
        // lets one late free through, as without this map.
        Some(stale) => unsafe {
            (*stale).count += 1;
            (*stale).replacer = replacer;
        },
        None => {
            let _ = STALE_FREES.insert(key, &StaleFree { count: 1, replacer }, 0);
        }
    }
    add_pending(1);
}

/// Consumes an expected late free of `key`; returns whether this free was one. A free
/// from the thread whose allocation took the address last cannot be: that thread's
/// earlier frees were applied before its allocation, so this one frees the new block,
/// and the frees still expected there were never seen (they are forgotten).
#[inline(always)]
fn consume_stale_free(key: &LiveKey) -> bool {
    let Some(stale) = STALE_FREES.get_ptr_mut(key) else {
        return false;
    };
    // SAFETY: fields of a map value, as in `expect_stale_free`.
    let (count, replacer) = unsafe { ((*stale).count, (*stale).replacer) };
    let late = replacer != current_thread();
    if late && count > 1 {
        // SAFETY: as above.
        unsafe { (*stale).count = count - 1 };
    } else {
        let _ = STALE_FREES.remove(key);
    }
    let forgotten = if late { 1 } else { u64::from(count) };
    add_pending(forgotten.wrapping_neg());
    if late {
        count_late_free();
    }
    late
}

const EEXIST: i32 = 17;

/// What to do when a site has no index yet.
#[derive(Clone, Copy)]
pub enum NewSite<'a> {
    /// Give it one, storing the site's stack, just walked.
    Stack(&'a UserStack),
    /// Give it one; the stack is stored already (or could not be).
    Stored,
    /// None: the caller has the stack walked and counts the call then.
    Refuse,
}

/// A new site index: one the daemon freed, else the next never handed out; `None`
/// when the site table is full.
#[inline(always)]
fn new_site_id() -> Option<SiteId> {
    if let Ok(Some(id)) = SITE_IDS_FREE.pop() {
        return Some(id);
    }
    let next = SITE_IDS_NEXT.get_ptr_mut(0)?;
    // SAFETY: a map value, only accessed atomically.
    let id = unsafe { fetch_add(next, 1) };
    (id < u64::from(max_sites())).then_some(id as SiteId)
}

/// The index of `site`, giving it one on first use as `new` says (one hash lookup on
/// the common path).
#[inline(always)]
pub fn site_id(site: &StackKey, new: NewSite<'_>) -> Option<SiteId> {
    // SAFETY: a plain value copied out of the map.
    if let Some(id) = unsafe { SITES.get(site) } {
        return Some(*id);
    }
    match new {
        NewSite::Refuse => return None,
        NewSite::Stored => {}
        NewSite::Stack(stack) => {
            // Another kind at the same stack may have stored it already.
            match STACKS.insert(&site.stack, stack, BPF_NOEXIST as u64) {
                Ok(()) => {}
                Err(err) if err == -EEXIST => {}
                Err(_) => count_drop(DropReason::StackTableFull),
            }
        }
    }
    let id = new_site_id()?;
    if SITES.insert(site, &id, BPF_NOEXIST as u64).is_ok() {
        return Some(id);
    }
    // Another CPU gave it one meanwhile (or the table is full): this one goes back.
    let _ = SITE_IDS_FREE.push(&id, 0);
    // SAFETY: as above.
    unsafe { SITES.get(site) }.copied()
}

/// A change of one site's counters.
#[derive(Clone, Copy)]
pub struct SiteChange {
    /// Blocks and bytes allocated.
    pub allocated: (u64, u64),
    /// Blocks and bytes freed.
    pub freed: (u64, u64),
    /// Whether the freed block was temporary (see `SiteCounters::temp_objects`).
    pub temporary: bool,
}

impl SiteChange {
    /// A block of `size` bytes allocated.
    #[inline(always)]
    pub const fn alloc(size: u64) -> Self {
        Self {
            allocated: (1, size),
            freed: (0, 0),
            temporary: false,
        }
    }

    /// A block of `size` bytes freed.
    #[inline(always)]
    pub const fn free(size: u64, temporary: bool) -> Self {
        Self {
            allocated: (0, 0),
            freed: (1, size),
            temporary,
        }
    }
}

/// Applies `change` to the counters of site `id`. `peaks` is the process's count of
/// new in-use peaks before the change: the first change since the latest peak saves
/// the site's value at it (see `SiteCounters`).
#[inline(always)]
pub fn add_to_site(id: SiteId, change: SiteChange, peaks: u64) {
    if let Some(counters) = SITE_COUNTERS.get_ptr_mut(id) {
        // SAFETY: this CPU's copy of a per-CPU value; programs on one CPU do not
        // interleave.
        let counters = unsafe { &mut *counters };
        if counters.peak_generation != peaks {
            counters.peak_objects = counters.alloc_objects.wrapping_sub(counters.free_objects);
            counters.peak_bytes = counters.alloc_bytes.wrapping_sub(counters.free_bytes);
            counters.peak_generation = peaks;
        }
        counters.alloc_objects += change.allocated.0;
        counters.alloc_bytes += change.allocated.1;
        counters.free_objects += change.freed.0;
        counters.free_bytes += change.freed.1;
        if change.temporary {
            counters.temp_objects += change.freed.0;
            counters.temp_bytes += change.freed.1;
        }
    }
}

/// Where a change of a process's in-use bytes goes: straight to its total, or into
/// a batch that is added at its end (see [`crate::usage::UsageBatch`]).
pub enum Usage<'a> {
    /// `PROCESS_USAGE`/`USAGE_SLOTS`, one atomic update per block; the process's
    /// entry is looked up once per call ([`Usage::direct`]).
    Direct(crate::usage::Process),
    /// A batch of one thread's records.
    Batch(&'a mut crate::usage::UsageBatch),
}

impl Usage<'_> {
    /// Straight to the process's total.
    #[inline(always)]
    pub const fn direct() -> Self {
        Usage::Direct(crate::usage::Process::new())
    }

    /// The process's count of new in-use peaks so far (0 when peaks are not kept).
    #[inline(always)]
    fn peaks(&mut self, tgid: u32) -> u64 {
        match self {
            Usage::Direct(process) => process.peaks(tgid),
            Usage::Batch(batch) => batch.peaks(),
        }
    }

    #[inline(always)]
    fn grow(&mut self, tgid: u32, bytes: u64) {
        match self {
            Usage::Direct(process) => process.grow(tgid, bytes),
            Usage::Batch(batch) => batch.grow(bytes),
        }
    }

    #[inline(always)]
    fn shrink(&mut self, tgid: u32, bytes: u64) {
        match self {
            Usage::Direct(process) => process.shrink(tgid, bytes),
            Usage::Batch(batch) => batch.shrink(bytes),
        }
    }
}

/// Whether a free may reach the program late, from a thread's queue (the preload
/// library's), after the allocator gave its address to another thread: see
/// [`STALE_FREES`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Frees {
    /// Frees are seen when they happen (the allocator's probes).
    OnTime,
    /// Frees wait in their thread's queue.
    Queued,
}

/// Credits the free of a tracked block to the site that allocated it; `temporary`
/// when the block was its thread's last allocation.
#[inline(always)]
pub fn release(tgid: u32, ptr: u64, temporary: bool) {
    release_into(tgid, ptr, temporary, &mut Usage::direct(), Frees::OnTime);
}

/// [`release`], with the in-use change going to `usage`. A queued free of an address
/// that another thread's allocation was seen to take before it is that free's late
/// arrival: the block it freed was closed then, so it is consumed without effect.
#[inline(always)]
pub fn release_into(tgid: u32, ptr: u64, temporary: bool, usage: &mut Usage<'_>, frees: Frees) {
    if ptr == 0 {
        return;
    }
    if frees == Frees::Queued
        && stale_frees_pending()
        && consume_stale_free(&LiveKey { ptr, tgid, _pad: 0 })
    {
        return;
    }
    let filter = filter_slot(ptr, tgid);
    if live_filter::empty(filter) {
        return; // an unsampled block's free, most of them when sampling
    }
    // Not found: allocated before tracing began (or not tracked): ignored, never negative.
    if let Some(block) = live::remove(tgid, ptr) {
        live_filter::add(filter, u32::MAX);
        let peaks = usage.peaks(tgid);
        add_to_site(block.site, SiteChange::free(block.size, temporary), peaks);
        usage.shrink(tgid, block.size);
    }
}

/// Counts a new block at `site` and remembers it until its free; a new site is
/// given an index as `new` says. Returns the site's index if it counted the block.
#[inline(always)]
pub fn allocated(
    tgid: u32,
    ptr: u64,
    size: u64,
    site: &StackKey,
    new: NewSite<'_>,
) -> Option<SiteId> {
    allocated_into(
        tgid,
        (ptr, size),
        site,
        new,
        &mut Usage::direct(),
        Frees::OnTime,
    )
}

/// [`allocated`], with the in-use change going to `usage`.
#[inline(always)]
pub fn allocated_into(
    tgid: u32,
    block: (u64, u64),
    site: &StackKey,
    new: NewSite<'_>,
    usage: &mut Usage<'_>,
    frees: Frees,
) -> Option<SiteId> {
    let Some(id) = site_id(site, new) else {
        if !matches!(new, NewSite::Refuse) {
            count_drop(DropReason::SiteTableFull);
        }
        return None;
    };
    allocated_at(tgid, block, id, usage, frees);
    Some(id)
}

/// Counts a new block at site `id` and remembers it until its free.
#[inline(always)]
pub fn allocated_at(
    tgid: u32,
    (ptr, size): (u64, u64),
    id: SiteId,
    usage: &mut Usage<'_>,
    frees: Frees,
) {
    // Read before this block's own growth can raise a new peak, which it is part of.
    let peaks = usage.peaks(tgid);
    add_to_site(id, SiteChange::alloc(size), peaks);
    let block = LiveEntry {
        ptr,
        size,
        tgid,
        site: id,
    };
    // Counted before the insert, so that no free finds the block with its slot at 0.
    let filter = filter_slot(ptr, tgid);
    live_filter::add(filter, 1);
    match live::insert(tgid, &block) {
        Inserted::New => {}
        Inserted::Replaced(old) => {
            // The old entry's count is gone with it.
            live_filter::add(filter, u32::MAX);
            // Still recorded at this address: it was freed by a path we did not see (the
            // allocator reused it), or its free waits in another thread's queue. Closed
            // now, so its site's in-use stays right.
            // Counted as unseen; a late free from a queue takes it back.
            count_only(DropReason::FreeUnseen);
            add_to_site(old.site, SiteChange::free(old.size, false), peaks);
            usage.shrink(tgid, old.size);
            if frees == Frees::Queued {
                expect_stale_free(&LiveKey { ptr, tgid, _pad: 0 });
            }
        }
        Inserted::Full => {
            // Its free cannot be matched: count it as released now, so that in-use stays
            // what is tracked instead of growing by blocks that may be long gone.
            count_drop(DropReason::LiveTableFull);
            live_filter::add(filter, u32::MAX);
            add_to_site(id, SiteChange::free(size, false), peaks);
            return;
        }
    }
    usage.grow(tgid, size);
}
