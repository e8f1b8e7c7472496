//! Names of the maps and programs, shared so that a rename cannot desynchronize the two sides.

/// Per-thread allocator call state (`HashMap<u64, InFlight>`, keyed by pid_tgid). An
/// entry lives as long as its thread: updating it in place costs less than an insert
/// and a delete per call. A thread's exit removes it (the daemon sweeps too).
pub const IN_FLIGHT: &str = "IN_FLIGHT";
/// Per-thread allocator call state by thread id (`Array<InFlightSlot>`, a power of
/// two of slots; mapped by the daemon): a thread's record when it owns the slot
/// its id picks, which spares its calls the hash lookups of [`IN_FLIGHT`].
pub const IN_FLIGHT_SLOTS: &str = "IN_FLIGHT_SLOTS";
/// How each probed function's calls are read (`Array<ProbeSpec>`, indexed by
/// [`crate::ProbeSlot`]). Filled by the daemon before a function's probes are
/// attached, so that allocators found later (a new process's static binary, a
/// preloaded library) join a running session.
pub const PROBES: &str = "PROBES";
/// The probe slot by its probe's page offset (`Array<u32>`,
/// [`crate::page_slots::PAGE_OFFSET_ENTRIES`] entries; see [`crate::page_slots`]):
/// the session program's way to its slot without the attach-cookie helper. Filled by
/// the daemon with [`PROBES`].
pub const SLOT_BY_PAGE_OFFSET: &str = "SLOT_BY_PAGE_OFFSET";
/// This CPU's current thread id as the session program last read it (`PerCpuArray<u64>`,
/// one slot; 0: not known), cleared by [`PROG_THREAD_ON_CPU_RESET`] at every context
/// switch.
pub const THREAD_ON_CPU: &str = "THREAD_ON_CPU";
/// Switches set by the daemon at run time (`Array<crate::Control>`, one value).
pub const CONTROL: &str = "CONTROL";
/// The live-block table (`Array<live::LiveBucket>`, one per bucket; see
/// [`crate::live`]).
pub const LIVE: &str = "LIVE";
/// Sampling's filter in front of [`LIVE`] (`Array<live::FilterPair>`,
/// [`crate::live::FILTER_SLOTS`] counters, one value when exact; user and kernel
/// mode both count their entries there; mapped by the daemon, which takes the
/// entries it removes off it too).
pub const LIVE_FILTER: &str = "LIVE_FILTER";
/// The sites (`HashMap<StackKey, SiteId>`): each site's index in
/// [`SITE_COUNTERS`].
pub const SITES: &str = "SITES";
/// Per-site counters (`PerCpuArray<SiteCounters>`, indexed by [`crate::SiteId`]):
/// a free finds its site's counters by the index its live block keeps, with no
/// hash lookup.
pub const SITE_COUNTERS: &str = "SITE_COUNTERS";
/// The next site index never handed out (`Array<u64>`, one slot).
pub const SITE_IDS_NEXT: &str = "SITE_IDS_NEXT";
/// Site indices the daemon has freed (`Queue<u32>`): those of retired sites, their
/// counters zeroed, handed out before new ones.
pub const SITE_IDS_FREE: &str = "SITE_IDS_FREE";
/// User stacks (`HashMap<u64, UserStack>`, keyed by the hash in `StackKey::stack`).
pub const STACKS: &str = "STACKS";
/// Drop counters (`PerCpuArray<u64>`, indexed by [`crate::DropReason`]).
pub const DROPS: &str = "DROPS";
/// The `Config` global.
pub const CONFIG: &str = "CONFIG";
/// Per-CPU bytes left until the next sampled allocation (`PerCpuArray<u64>`, one slot).
pub const SAMPLER: &str = "SAMPLER";
/// Exec generation per process (`HashMap<u32, u32>`, keyed by tgid; absent = 0).
pub const EXEC_GEN: &str = "EXEC_GEN";
/// Per-process in-use bytes and peak ([`crate::ProcessUsage`]), keyed by tgid.
pub const PROCESS_USAGE: &str = "PROCESS_USAGE";
/// Per-process in-use bytes and peak by process id (`Array<ProcessUsageSlot>`, a
/// power of two of slots; mapped by the daemon): a process's usage when it owns the
/// slot its id picks, which spares its calls the hash lookups of
/// [`PROCESS_USAGE`].
pub const USAGE_SLOTS: &str = "USAGE_SLOTS";
/// [`crate::ExecEvent`]s for the daemon (`RingBuf`).
pub const EXEC_EVENTS: &str = "EXEC_EVENTS";
/// Raw tracepoint on `sched_process_exec` (needs no tracefs).
pub const PROG_EXEC: &str = "process_exec";
/// The tracepoint it attaches to.
pub const EXEC_TRACEPOINT: &str = "sched_process_exec";
/// Executable mappings per process (`HashMap<u32, unwind::ProcessMappings>`).
pub const PROCESS_MAPPINGS: &str = "PROCESS_MAPPINGS";
/// Where each object's rows are (`Array<unwind::UnwindObject>`).
pub const UNWIND_OBJECTS: &str = "UNWIND_OBJECTS";
/// Every object's rows (`Array<unwind::UnwindRow>`).
pub const UNWIND_ROWS: &str = "UNWIND_ROWS";
/// The deduplicated rules (`Array<unwind::UnwindRule>`).
pub const UNWIND_RULES: &str = "UNWIND_RULES";
/// What the walks the programs remember depend on (`Array<u64>`, indexed by
/// [`crate::WalkEpoch`]): walks remembered before a change are not trusted after it.
pub const WALK_EPOCH: &str = "WALK_EPOCH";
/// Per-CPU counts of what became of the allocations' stack walks
/// (`PerCpuArray<u64>`, indexed by [`crate::WalkOutcome`]).
pub const WALK_STATS: &str = "WALK_STATS";
/// Per-CPU cache of resolved rules (`PerCpuArray<unwind::CachedRule>`).
pub const RULE_CACHE: &str = "RULE_CACHE";
/// Where stacks were cut short (`LruHashMap<unwind::UnwindGap, u64>`, counts).
pub const UNWIND_GAPS: &str = "UNWIND_GAPS";
/// [`crate::unwind::MappingsRequest`]s for the daemon (`RingBuf`).
pub const MAPPINGS_REQUESTS: &str = "MAPPINGS_REQUESTS";
/// When each process last asked for its mappings (`LruHashMap<u32, u64>`, ns).
pub const MAPPINGS_REQUESTED: &str = "MAPPINGS_REQUESTED";
/// The mappings a fork shares with its traced parent until its own are loaded
/// (`LruHashMap<u32, unwind::ForkOrigin>`, keyed by the child's tgid).
pub const FORK_ORIGINS: &str = "FORK_ORIGINS";
/// Tracepoint program on `sched:sched_process_fork` that writes `FORK_ORIGINS`.
pub const PROG_FORK: &str = "process_fork";
/// The tracepoint it attaches to, in [`SCHED_CATEGORY`].
pub const FORK_TRACEPOINT: &str = "sched_process_fork";
/// The tracepoint category of the scheduler's events.
pub const SCHED_CATEGORY: &str = "sched";
/// Signals sent to hold a launched command at a loader event (`Array<u64>`, one
/// slot): the tracer tells its own from any other SIGCONT by this count.
pub const LOADER_SYNCS: &str = "LOADER_SYNCS";
/// The multi-uprobe form of [`PROG_LOADER_STATE`].
pub const PROG_LOADER_STATE_MULTI: &str = "loader_state_multi";
/// Uprobe on the dynamic loader's `_dl_debug_state`, which it calls after mapping
/// or unmapping objects (the debuggers' hook).
pub const PROG_LOADER_STATE: &str = "loader_state";
/// Raw tracepoint on `sched_process_exit`: a thread's call state goes with it.
pub const PROG_THREAD_EXIT: &str = "thread_exit";
/// The tracepoint it attaches to.
pub const EXIT_TRACEPOINT: &str = "sched_process_exit";
/// Processes served by the preload library (`HashMap<u32, preload::Preloaded>`,
/// keyed by tgid).
pub const PRELOADED: &str = "PRELOADED";
/// Where each thread of those keeps its [`crate::preload::ReportQueue`] and how
/// much of it was applied (`HashMap<u64, preload::QueueState>`, keyed by
/// pid_tgid).
pub const REPORT_QUEUES: &str = "REPORT_QUEUES";
/// Raw tracepoint on `sched_switch`: a preloaded thread's queued records are
/// applied when it is switched out.
pub const PROG_SWITCH: &str = "thread_switch";
/// Raw tracepoint on `sched_switch` in sessions with uprobe session links: clears the
/// CPU's cached thread id ([`THREAD_ON_CPU`]), so that the session program calls the
/// helper for it once per thread and switch instead of once per allocator call.
pub const PROG_THREAD_ON_CPU_RESET: &str = "thread_on_cpu_reset";
/// The tracepoint it attaches to.
pub const SWITCH_TRACEPOINT: &str = "sched_switch";
/// Raw tracepoint on every system call's entry: a preloaded thread's queued
/// records are applied when it calls `futex`, before it wakes another thread, and
/// when it calls `execve` or `execveat`, while its image is still mapped.
pub const PROG_SYSCALL: &str = "thread_syscall";
/// The tracepoint it attaches to.
pub const SYSCALL_TRACEPOINT: &str = "sys_enter";
/// Tracepoint program on the entry of `futex` alone (`syscalls:sys_enter_futex`,
/// kernels with `CONFIG_FTRACE_SYSCALLS`): as [`PROG_SYSCALL`], without running a
/// program at every other system call of the host. With [`PROG_EXEC_ENTRY`],
/// [`PROG_SYSCALL`] where either is missing.
pub const PROG_FUTEX_ENTRY: &str = "futex_entry";
/// The tracepoint it attaches to, in [`SYSCALLS_CATEGORY`].
pub const FUTEX_TRACEPOINT: &str = "sys_enter_futex";
/// Tracepoint program on the entries of `execve` and `execveat`: as [`PROG_SYSCALL`]
/// for those calls.
pub const PROG_EXEC_ENTRY: &str = "exec_entry";
/// The tracepoints it attaches to, in [`SYSCALLS_CATEGORY`].
pub const EXEC_ENTRY_TRACEPOINTS: [&str; 2] = ["sys_enter_execve", "sys_enter_execveat"];
/// The tracepoint category of the system calls' own tracepoints.
pub const SYSCALLS_CATEGORY: &str = "syscalls";
/// The answers to the preload library's allocation reports (a memory-mappable
/// `Array<preload::StackReply>`; see [`crate::preload::REPLY_SLOTS`]).
pub const REPLIES: &str = "REPLIES";
/// Uprobe on the preload library's probe site.
pub const PROG_PRELOAD: &str = "preload_report";
/// Uretprobe shared by every function that returns a block.
pub const PROG_ALLOC_RETURN: &str = "alloc_return";
/// The entry uprobe of every probed function (one perf event each), the function
/// told apart by its attach cookie (a [`crate::ProbeSlot`]).
pub const PROG_ENTRY: &str = "entry";
/// The multi-uprobe entry program: every probed function of an object in one link.
pub const PROG_ENTRY_MULTI: &str = "entry_multi";
/// The multi-uprobe form of [`PROG_ALLOC_RETURN`].
pub const PROG_ALLOC_RETURN_MULTI: &str = "alloc_return_multi";
/// The uprobe session program (sampled sessions, Linux 6.13+): an object's entries and
/// returns in one link, loaded by the daemon itself with the session attach type.
pub const PROG_ENTRY_SESSION: &str = "entry_session";
