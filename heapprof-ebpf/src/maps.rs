//! The user-mode maps, the daemon's settings, and the drop counters.

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_F_NO_PREALLOC},
    helpers::generated::bpf_get_current_ancestor_cgroup_id,
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, Queue, RingBuf},
};
use heapprof_common::{
    Config, Control, DropReason, InFlight, InFlightSlot, LiveKey, MAX_PROBE_SLOTS, ProbeSlot,
    ProbeSpec, ProcessUsage, ProcessUsageSlot, SiteCounters, SiteId, StackKey, StaleFree,
    UserStack, WalkEpoch,
    live::{FILTER_SLOTS, FilterPair, LiveBucket},
    page_slots::{self, PAGE_OFFSET_ENTRIES},
    preload::{Preloaded, QueueState, REPLY_READS, REPLY_SLOTS, StackReply},
    unwind::{
        CachedRule, ProcessMappings, RULE_CACHE_ENTRIES, UnwindGap, UnwindObject, UnwindRow,
        UnwindRule,
    },
};

use crate::log::Tables;

// Capacities are placeholders: the daemon sets them from its flags before loading.
#[map(name = "IN_FLIGHT")]
pub static IN_FLIGHT: HashMap<u64, InFlight> = HashMap::with_max_entries(16384, 0);
/// Threads' call records by thread id (see `crate::threads`); mapped by the daemon.
#[map(name = "IN_FLIGHT_SLOTS")]
pub static IN_FLIGHT_SLOTS: Array<InFlightSlot> = Array::with_max_entries(1, BPF_F_MMAPABLE);
#[map(name = "PROBES")]
pub static PROBES: Array<ProbeSpec> = Array::with_max_entries(MAX_PROBE_SLOTS, 0);
/// The probe slot by page offset (see `heapprof_common::page_slots`), for the session
/// program.
#[map(name = "SLOT_BY_PAGE_OFFSET")]
pub static SLOT_BY_PAGE_OFFSET: Array<u32> = Array::with_max_entries(PAGE_OFFSET_ENTRIES, 0);
#[map(name = "CONTROL")]
pub static CONTROL: Array<Control> = Array::with_max_entries(1, 0);
/// The live-block table, one bucket each (see `crate::live`); mapped by the daemon.
#[map(name = "LIVE")]
pub static LIVE: Array<LiveBucket> = Array::with_max_entries(1, BPF_F_MMAPABLE);
/// Sampling only: the entries of `LIVE` each slot's spans have (see
/// `heapprof_common::live::filter_slot`), so that a free of an unsampled block skips
/// the table; mapped by the daemon, which takes off the entries it removes.
#[map(name = "LIVE_FILTER")]
pub static LIVE_FILTER: Array<FilterPair> =
    Array::with_max_entries(FILTER_SLOTS / 2, BPF_F_MMAPABLE);
/// Each site's index in `SITE_COUNTERS`.
#[map(name = "SITES")]
pub static SITES: HashMap<StackKey, SiteId> = HashMap::with_max_entries(65536, 0);
/// Per-site counters, by site index.
#[map(name = "SITE_COUNTERS")]
pub static SITE_COUNTERS: PerCpuArray<SiteCounters> = PerCpuArray::with_max_entries(65536, 0);
/// The next site index never handed out.
#[map(name = "SITE_IDS_NEXT")]
pub static SITE_IDS_NEXT: Array<u64> = Array::with_max_entries(1, 0);
/// Site indices the daemon freed, handed out first.
#[map(name = "SITE_IDS_FREE")]
pub static SITE_IDS_FREE: Queue<SiteId> = Queue::with_max_entries(65536, 0);
// Written only when a site is new, so allocated on demand rather than preallocated
// (a preallocated table of 1 KiB stacks would pin tens of MiB of kernel memory).
#[map(name = "STACKS")]
pub static STACKS: HashMap<u64, UserStack> = HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);
/// Per-CPU room to assemble a stack (too big for the 512-byte BPF stack).
#[map(name = "STACK_SCRATCH")]
pub static STACK_SCRATCH: PerCpuArray<UserStack> = PerCpuArray::with_max_entries(1, 0);
#[map(name = "DROPS")]
/// Indexed by [`DropReason`], then [`heapprof_common::LATE_FREES_SLOT`].
pub static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(DropReason::COUNT + 1, 0);
/// This CPU's current thread id, cleared at every context switch (see
/// `crate::user::current_thread`).
#[map(name = "THREAD_ON_CPU")]
pub static THREAD_ON_CPU: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);
#[map(name = "SAMPLER")]
pub static SAMPLER: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);
#[map(name = "EXEC_GEN")]
pub static EXEC_GEN: HashMap<u32, u32> = HashMap::with_max_entries(16384, 0);
/// Per-process in-use bytes and peak (exact mode), keyed by tgid.
#[map(name = "PROCESS_USAGE")]
pub static PROCESS_USAGE: HashMap<u32, ProcessUsage> = HashMap::with_max_entries(4096, 0);
/// The same by process id (see `crate::usage`); mapped by the daemon.
#[map(name = "USAGE_SLOTS")]
pub static USAGE_SLOTS: Array<ProcessUsageSlot> = Array::with_max_entries(1, BPF_F_MMAPABLE);
#[map(name = "EXEC_EVENTS")]
pub static EXEC_EVENTS: RingBuf = RingBuf::with_byte_size(64 * 1024, 0);

// Unwind tables (see heapprof_common::unwind). Mappings are written per process, so
// allocated on demand; the tables are sized by the daemon's flags.
#[map(name = "PROCESS_MAPPINGS")]
pub static PROCESS_MAPPINGS: HashMap<u32, ProcessMappings> =
    HashMap::with_max_entries(1024, BPF_F_NO_PREALLOC);
#[map(name = "UNWIND_OBJECTS")]
pub static UNWIND_OBJECTS: Array<UnwindObject> = Array::with_max_entries(4096, 0);
// Memory-mapped by the daemon, which copies whole tables in.
#[map(name = "UNWIND_ROWS")]
pub static UNWIND_ROWS: Array<UnwindRow> = Array::with_max_entries(1 << 21, BPF_F_MMAPABLE);
#[map(name = "UNWIND_RULES")]
pub static UNWIND_RULES: Array<UnwindRule> = Array::with_max_entries(65536, BPF_F_MMAPABLE);
/// Words of a stack window (4 KiB: 98% of python3's allocations are within 4 KiB of
/// the stack pointer at malloc).
pub const STACK_WINDOW_WORDS: usize = 512;
/// Bytes of a stack window.
pub const STACK_WINDOW_BYTES: usize = STACK_WINDOW_WORDS * 8;

/// A copy of part of a user stack (see `unwind::stack_read`).
#[repr(C)]
pub struct StackWindow {
    /// The stack's words.
    pub words: [u64; STACK_WINDOW_WORDS],
}

#[map(name = "STACK_WINDOW")]
pub static STACK_WINDOW: PerCpuArray<StackWindow> = PerCpuArray::with_max_entries(1, 0);
/// How far up the stack the last walk on this CPU read, and whose stack it was: the
/// stack between a thread's stack pointer and an address read before is mapped.
#[repr(C)]
pub struct StackReach {
    /// The thread.
    pub pid_tgid: u64,
    /// The end of what it read.
    pub end: u64,
}

#[map(name = "STACK_REACH")]
pub static STACK_REACH: PerCpuArray<StackReach> = PerCpuArray::with_max_entries(1, 0);
#[map(name = "RULE_CACHE")]
pub static RULE_CACHE: PerCpuArray<CachedRule> =
    PerCpuArray::with_max_entries(RULE_CACHE_ENTRIES, 0);
#[map(name = "UNWIND_GAPS")]
pub static UNWIND_GAPS: LruHashMap<UnwindGap, u64> = LruHashMap::with_max_entries(4096, 0);
#[map(name = "MAPPINGS_REQUESTED")]
pub static MAPPINGS_REQUESTED: LruHashMap<u32, u64> = LruHashMap::with_max_entries(4096, 0);
#[map(name = "MAPPINGS_REQUESTS")]
pub static MAPPINGS_REQUESTS: RingBuf = RingBuf::with_byte_size(64 * 1024, 0);
#[map(name = "LOADER_SYNCS")]
pub static LOADER_SYNCS: Array<u64> = Array::with_max_entries(1, 0);
/// Processes the preload library serves (see `preload`), keyed by tgid.
#[map(name = "PRELOADED")]
pub static PRELOADED: HashMap<u32, Preloaded> = HashMap::with_max_entries(4096, 0);
/// Where each thread of those keeps its `ThreadReports`, keyed by pid_tgid.
#[map(name = "REPORT_QUEUES")]
pub static REPORT_QUEUES: HashMap<u64, QueueState> = HashMap::with_max_entries(16384, 0);

/// A [`StackReply`] being written by a walk, with the stack pointer its offsets are
/// from and the values of the words read (for `crate::walk_cache`).
#[repr(C)]
pub struct ReplyScratch {
    /// The answer, as the library will read it.
    pub reply: StackReply,
    /// The caller's stack pointer at the walk's start.
    pub base: u64,
    /// The words read, in the order of `reply.offsets`.
    pub values: [u64; REPLY_READS],
}

/// Per-CPU room for the answer to a preload report (see `unwind::unwind`'s `answer`).
#[map(name = "REPLY_SCRATCH")]
pub static REPLY_SCRATCH: PerCpuArray<ReplyScratch> = PerCpuArray::with_max_entries(1, 0);

/// Late frees expected: addresses whose block was closed when another thread's
/// allocation took the address while its free still waited in a preload queue (see
/// `sites::release_into`), with how many such frees are to come.
#[map(name = "STALE_FREES")]
pub static STALE_FREES: LruHashMap<LiveKey, StaleFree> = LruHashMap::with_max_entries(16384, 0);
/// How many late frees `STALE_FREES` expects in all (0: no queued free looks there).
#[map(name = "STALE_PENDING")]
pub static STALE_PENDING: Array<u64> = Array::with_max_entries(1, 0);

/// The answers to preload reports, one slot per thread, mapped by the launched
/// processes (see `heapprof_common::preload::REPLY_SLOTS`).
#[map(name = "REPLIES")]
pub static REPLIES: Array<StackReply> = Array::with_max_entries(REPLY_SLOTS, BPF_F_MMAPABLE);

/// The daemon's counts of what remembered walks depend on (see `walk_cache`), by
/// `WalkEpoch`; mapped by the daemon.
#[map(name = "WALK_EPOCH")]
pub static WALK_EPOCH: Array<u64> = Array::with_max_entries(WalkEpoch::COUNT, BPF_F_MMAPABLE);

/// The daemon's counts of mapping writes and site retirements, as one number that
/// changes with either (see `walk_cache`).
#[inline(always)]
pub fn walk_epoch() -> u64 {
    let read = |epoch: WalkEpoch| {
        WALK_EPOCH.get(epoch as u32).map_or(0, |count| {
            // SAFETY: a map value the daemon stores whole.
            unsafe { core::ptr::read_volatile(count) }
        })
    };
    read(WalkEpoch::Mappings).wrapping_add(read(WalkEpoch::Sites).rotate_left(32))
}

/// Written by the daemon before loading (read-only data).
#[unsafe(no_mangle)]
static CONFIG: Config = Config {
    page_size: 4096,
    ignore_tgid: 0,
    target_tgid: 0,
    sample_rate: 0,
    unwind_mode: 0,
    hold_at_loader_events: 0,
    empty_programs: 0,
    stacks_only: 0,
    track_peak: 0,
    cgroup_id: 0,
    cgroup_level: 0,
    preload: 0,
    live_buckets: 1,
    max_sites: 1,
    in_flight_slots: 1,
    usage_slots: 1,
    fork_child_pid_offset: 0,
};

// CONFIG is read with volatile loads: the compiler would otherwise fold the defaults
// above into the code, and the loader's values would never be seen.

/// Page size of the traced system.
#[inline(always)]
pub fn page_size() -> u64 {
    // SAFETY: a plain global (see above).
    let page = unsafe { core::ptr::read_volatile(&CONFIG.page_size) };
    if page == 0 { 4096 } else { page }
}

/// The process to ignore (the daemon), or 0.
#[inline(always)]
pub fn ignored_tgid() -> u32 {
    // SAFETY: a plain global (see above).
    unsafe { core::ptr::read_volatile(&CONFIG.ignore_tgid) }
}

/// Where `sched_process_fork`'s record holds the child's pid, or 0 (no fork program).
#[inline(always)]
pub fn fork_child_pid_offset() -> u32 {
    // SAFETY: a plain global (see above).
    unsafe { core::ptr::read_volatile(&CONFIG.fork_child_pid_offset) }
}

/// The one process traced, or 0 for all.
#[inline(always)]
pub fn target_tgid() -> u32 {
    // SAFETY: a plain global (see above).
    unsafe { core::ptr::read_volatile(&CONFIG.target_tgid) }
}

/// Mean bytes between sampled allocations; 0 records every one.
#[inline(always)]
pub fn sample_rate() -> u64 {
    // SAFETY: a plain global (see above).
    unsafe { core::ptr::read_volatile(&CONFIG.sample_rate) }
}

/// How user stacks are unwound: an `UnwindMode`.
#[inline(always)]
pub fn unwind_mode() -> u32 {
    // SAFETY: a plain global (see above).
    unsafe { core::ptr::read_volatile(&CONFIG.unwind_mode) }
}

/// Whether loader events of the target hold it until its mappings are loaded.
#[inline(always)]
pub fn hold_at_loader_events() -> bool {
    // SAFETY: a plain global (see above).
    unsafe { core::ptr::read_volatile(&CONFIG.hold_at_loader_events) != 0 }
}

/// Whether the uprobe programs are to do nothing (the benchmark's trap floor).
#[inline(always)]
pub fn empty_programs() -> bool {
    // SAFETY: a plain global (see above).
    unsafe { core::ptr::read_volatile(&CONFIG.empty_programs) != 0 }
}

/// Whether the uprobe programs are to find stacks but count nothing (the benchmark's
/// baseline of the least an exact profile costs).
#[inline(always)]
pub fn stacks_only() -> bool {
    // SAFETY: a plain global (see above).
    unsafe { core::ptr::read_volatile(&CONFIG.stacks_only) != 0 }
}

/// Where the preload library's code is in process `tgid`, if it serves the process.
/// Without the library in the session, no lookup is made.
#[inline(always)]
pub fn preloaded(tgid: u32) -> Option<Preloaded> {
    // SAFETY: a plain global (see above).
    if unsafe { core::ptr::read_volatile(&CONFIG.preload) } == 0 {
        return None;
    }
    // SAFETY: a plain value read out of the map.
    unsafe { PRELOADED.get(&tgid) }.copied()
}

/// Buckets of the live-block table (at least 1).
#[inline(always)]
pub fn live_buckets() -> u32 {
    // SAFETY: a plain global (see above).
    unsafe { core::ptr::read_volatile(&CONFIG.live_buckets) }.max(1)
}

/// Slots of `IN_FLIGHT_SLOTS` (a power of two, at least 1).
#[inline(always)]
pub fn in_flight_slots() -> u32 {
    // SAFETY: a plain global (see above).
    unsafe { core::ptr::read_volatile(&CONFIG.in_flight_slots) }.max(1)
}

/// Slots of `USAGE_SLOTS` (a power of two, at least 1).
#[inline(always)]
pub fn usage_slots() -> u32 {
    // SAFETY: a plain global (see above).
    unsafe { core::ptr::read_volatile(&CONFIG.usage_slots) }.max(1)
}

/// Capacity of the site table: site indices stay below it.
#[inline(always)]
pub fn max_sites() -> u32 {
    // SAFETY: a plain global (see above).
    unsafe { core::ptr::read_volatile(&CONFIG.max_sites) }
}

/// Whether each process's in-use total and peak are kept.
#[inline(always)]
pub fn track_peak() -> bool {
    // SAFETY: a plain global (see above).
    unsafe { core::ptr::read_volatile(&CONFIG.track_peak) != 0 }
}

/// How the calls of the function in `slot` are read, once the daemon has filled it.
#[inline(always)]
pub fn probe_spec(slot: ProbeSlot) -> Option<&'static ProbeSpec> {
    PROBES.get(slot).filter(|spec| spec.in_use != 0)
}

/// The slot of the probe at `address` by its page offset, if only one probe has it
/// (see `heapprof_common::page_slots`).
#[inline(always)]
pub fn slot_by_page_offset(address: u64) -> Option<ProbeSlot> {
    SLOT_BY_PAGE_OFFSET
        .get(page_slots::index(address))
        .and_then(|entry| page_slots::slot(*entry))
}

/// The daemon's switches (all off until it sets them), in one lookup.
#[inline(always)]
pub fn control() -> Control {
    CONTROL.get(0).copied().unwrap_or_default()
}

/// Whether the daemon has attached every probe (see [`Control::armed`]).
#[inline(always)]
pub fn armed() -> bool {
    control().armed != 0
}

/// Whether the calling process is the one the daemon asked to ignore (itself), or
/// outside the cgroup subtree traced.
#[inline(always)]
pub fn ignored(pid_tgid: u64) -> bool {
    let ignore = ignored_tgid();
    if ignore != 0 && (pid_tgid >> 32) as u32 == ignore {
        return true;
    }
    // SAFETY: plain globals (see above).
    let (cgroup, level) = unsafe {
        (
            core::ptr::read_volatile(&CONFIG.cgroup_id),
            core::ptr::read_volatile(&CONFIG.cgroup_level),
        )
    };
    !in_cgroup(cgroup, level)
}

/// Whether the current task is in the cgroup v2 subtree whose root `cgroup` sits at
/// depth `level` (always, when `cgroup` is 0).
#[inline(always)]
pub fn in_cgroup(cgroup: u64, level: u32) -> bool {
    // SAFETY: a helper without arguments to check; an ancestor above the task's own
    // depth is 0, which no cgroup has.
    cgroup == 0 || unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) } == cgroup
}

/// Counts an event that could not be fully recorded (user mode's tables); the first
/// of each reason is logged.
#[inline(always)]
pub fn count_drop(reason: DropReason) {
    count_only(reason);
    crate::log::first_drop(reason, Tables::User);
}

/// Counts a drop of kernel mode's tables; the first of each reason is logged.
#[inline(always)]
pub fn count_kernel_drop(reason: DropReason) {
    count_only(reason);
    crate::log::first_drop(reason, Tables::Kernel);
}

/// Counts a queued free that arrived after its address was allocated again (see
/// [`heapprof_common::LATE_FREES_SLOT`]).
#[inline(always)]
pub fn count_late_free() {
    if let Some(slot) = DROPS.get_ptr_mut(heapprof_common::LATE_FREES_SLOT) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *slot += 1 };
    }
}

/// Counts a drop without logging it (the caller logs what it knows better).
#[inline(always)]
pub fn count_only(reason: DropReason) {
    if let Some(slot) = DROPS.get_ptr_mut(reason as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *slot += 1 };
    }
}
