//! Data layouts shared by heapprofd's BPF programs and its user-space daemon.
//!
//! This crate is the single source of truth for every key and value that crosses
//! the kernel/user boundary: map names, map value layouts, allocator kinds and
//! drop-counter indices. It is `no_std` so that the BPF programs can use it; the
//! `user` feature adds the `aya::Pod` implementations the daemon needs to read maps.
#![no_std]

pub mod kernel;
pub mod live;
pub mod names;
pub mod page_slots;
pub mod preload;
pub mod unwind;
pub mod walk_cache;
pub mod x86_calls;

/// Maximum number of user-space frames recorded per stack.
pub const MAX_STACK_DEPTH: u32 = 127;

/// A user call stack as the BPF side records it: return addresses, innermost first.
/// Stored once per distinct (process, stack) in `STACKS`, keyed by its hash.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UserStack {
    /// Frames in use.
    pub len: u32,
    /// Explicit padding, always zero.
    pub _pad: u32,
    /// Return addresses; `frames[0]` is the allocator's return address in its caller.
    pub frames: [u64; MAX_STACK_DEPTH as usize],
}

/// Largest distance above the stack pointer at which a frame pointer is followed.
/// A frame-pointer chain that leaves the stack ends in code built without frame
/// pointers; reading such garbage can fault, and a fault costs more than the walk.
pub const MAX_STACK_SPAN: u64 = 32 << 20;

/// What a probed function does with memory: the roles of an allocator's API.
///
/// Every probed function (the C library's malloc family, jemalloc's `mallocx` family,
/// tcmalloc's `tc_*`, mimalloc's `mi_*`, C++ `operator new`/`delete`, or a custom pool's
/// functions named with `--allocator`) is one of these, with a [`ProbeSpec`] saying
/// where its arguments are.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProbeRole {
    /// Returns a new block (or writes it through an out-pointer argument).
    Alloc = 0,
    /// Releases the block in an argument.
    Free = 1,
    /// Moves a block: releases the old one once the call succeeds, returns the new one.
    /// A request for 0 bytes that returns NULL frees the old block (C's `realloc`).
    Realloc = 2,
    /// Resizes a block where it is and returns its usable size (jemalloc's `xallocx`):
    /// when that reaches the requested size, the block now counts as that size.
    ResizeInPlace = 3,
}

impl ProbeRole {
    /// Converts a value read from a map back into a role.
    pub const fn from_u32(value: u32) -> Option<ProbeRole> {
        Some(match value {
            0 => ProbeRole::Alloc,
            1 => ProbeRole::Free,
            2 => ProbeRole::Realloc,
            3 => ProbeRole::ResizeInPlace,
            _ => return None,
        })
    }

    /// Whether the function returns through the shared return probe.
    pub const fn returns_a_block(self) -> bool {
        !matches!(self, ProbeRole::Free)
    }
}

/// A [`ProbeSpec`] register number meaning "none".
pub const NO_REGISTER: u8 = u8::MAX;

/// How many registers an entry program can read a value from: x86-64's sixteen
/// general-purpose registers in DWARF numbering (rax 0, rdx 1, rcx 2, rbx 3, rsi 4,
/// rdi 5, rbp 6, rsp 7, r8 8 ... r15 15); on arm64 the argument registers x0 to x7
/// (0 to 7) and the callee-saved x19 to x26 (8 to 15), where functions keep their
/// arguments across calls.
pub const VALUE_REGISTERS: usize = 16;

/// How the programs read one probed function's call: its role, which registers hold
/// the size, the count, the block and the out-pointer at the probe's spot (the
/// argument registers at a function's entry; others where the function's first
/// instructions moved them), and where the object it lives in has its code. Indexed by
/// [`ProbeSlot`] in `PROBES`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeSpec {
    /// File offset of the function's probe spot in its object. With the probe's
    /// address in a process, it places the object's code there without reading the
    /// process's mappings.
    pub probe_offset: u64,
    /// The object's executable code, as file offsets `[start, end)`: a call whose
    /// return address lies in it was made by the allocator itself (nested).
    pub text_start: u64,
    /// End of the executable code (exclusive).
    pub text_end: u64,
    /// The function's own code, as file offsets `[start, end)` (its symbol's extent;
    /// `end` 0 when the symbol has no size): a call whose return address lies in it
    /// was made by the function's body, so the function's frame is live.
    pub function_start: u64,
    /// End of the function's code (exclusive), or 0.
    pub function_end: u64,
    /// The size when no register holds it (`size=N` of a fixed-size pool).
    pub fixed_size: u64,
    /// A [`ProbeRole`].
    pub role: u32,
    /// The register with the size in bytes, or [`NO_REGISTER`] (then
    /// [`ProbeSpec::fixed_size`]).
    pub size_reg: u8,
    /// The register the size is multiplied by (calloc's count), or [`NO_REGISTER`].
    pub count_reg: u8,
    /// The register with the block released or resized, or [`NO_REGISTER`].
    pub ptr_reg: u8,
    /// The register with where the new block is written (posix_memalign, which
    /// returns 0 on success), or [`NO_REGISTER`] when the function returns it.
    pub out_reg: u8,
    /// Nonzero: the size is rounded up to whole pages, and 0 to one page (pvalloc).
    pub round_to_pages: u32,
    /// Nonzero once the daemon filled the slot.
    pub in_use: u32,
    /// Nonzero when the function is in a shared library (not a program): in processes
    /// the preload library serves, the library's calls of it from its own code are
    /// internal (mimalloc's `posix_memalign` calling `mi_posix_memalign`).
    pub in_library: u32,
    /// Bytes the stack pointer is below its value at the function's entry at the probe
    /// spot (arm64: a probe placed after `stp x29, x30, [sp, #-N]!`); the entry program
    /// adds them back. Such a function's return probes sit on its exits.
    pub sp_adjust: u32,
    /// The most bytes the function's own code pushes or reserves below its entry's
    /// stack pointer ([`UNKNOWN_FRAME_BYTES`] if its code does not say): a call its
    /// body makes enters at most that far, plus the call's return address, below.
    pub frame_bytes: u32,
    /// Nonzero when the function's entry and return run one program through a uprobe
    /// session link (`BPF_TRACE_UPROBE_SESSION`, Linux 6.13+), whose entry may skip the
    /// return of a call it does not record (an unsampled allocation, a nested call).
    /// Set only for plain allocation and resize functions (not out-pointers, not
    /// in-place resizes, not `--allocator` ones; of known extent) on x86-64, where the calls
    /// made inside a skipped call can be recognised (see [`InFlight::caller_registers`]).
    pub session: u32,
}

/// Per-thread state of the allocator call in progress, keyed by `pid_tgid`.
///
/// Written at the entry of the thread's outermost allocator call and consumed at its
/// return, so that allocator functions calling each other (`realloc(NULL, n)` runs
/// malloc's code) are counted once, as the user's call.
///
/// Returns are matched to entries by stack pointer, not by counting nesting depth: a
/// return that never comes (a probe attached between a call's entry and its return,
/// a `longjmp` or cancellation out of the allocator, a return probe the kernel could
/// not arm) must not leave the thread looking nested forever. See the BPF crate's
/// `calls` module for the rules.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct InFlight {
    /// Requested size in bytes (already multiplied for calloc/reallocarray).
    pub size: u64,
    /// The block being resized by realloc/reallocarray, or 0.
    pub old_ptr: u64,
    /// posix_memalign's out-pointer, or 0.
    pub out_ptr: u64,
    /// The stack pointer at the call's entry: the slot of its return address on
    /// x86-64; on arm64 the stack pointer it returns with.
    pub entry_sp: u64,
    /// Where the called function's object is loaded: the probe's address minus its
    /// file offset. Calls made from that object's code are nested in this one.
    pub object_base: u64,
    /// The stack pointer of the last call found nested in this one, or 0. A probed
    /// function that a nested call jumps to (a tail call) enters at the same stack
    /// pointer, with a return address a return probe may have replaced. Below a
    /// [`CALL_UNRECORDED`] call, the entry of [`InFlight::nested_slot`]'s call.
    pub nested_sp: u64,
    /// [`CALL_ACTIVE`] while the call is in progress, [`CALL_DONE`] once it returned (or
    /// was found abandoned), [`CALL_UNRECORDED`] for an unsampled call whose return a
    /// session link skips (see [`InFlight::caller_registers`]).
    pub active: u32,
    /// The called function's [`ProbeSlot`].
    pub slot: u32,
    /// Whether the call's new block is recorded (always, unless sampling).
    pub sampled: u32,
    /// The thread's process image (its exec generation, see `EXEC_GEN`), looked up
    /// when the thread's record is created and set at the thread's exec: the return
    /// probe needs it for every stack and finds it here instead of in a second table.
    pub exec_gen: u32,
    /// The block of the thread's last allocation, until it is freed or the thread
    /// allocates again (0: none): a free of it is a temporary allocation's.
    pub last_block: u64,
    /// [`CALL_UNRECORDED`]: the caller's callee-saved registers at the call's entry,
    /// folded into one word (no read of the user stack: the dearest step of an
    /// unsampled call). A tail call the function makes restores them before it jumps,
    /// so an entry at the same stack pointer with other registers is a new call.
    pub caller_registers: u64,
    /// [`CALL_UNRECORDED`]: where the object of the last call found nested in it
    /// ([`InFlight::nested_slot`]) is loaded.
    pub nested_base: u64,
    /// [`CALL_UNRECORDED`]: the [`ProbeSlot`] of the last call found nested in it, or
    /// [`NO_NESTED_SLOT`]. A call whose return address lies in that function's code
    /// is nested too (libstdc++'s nothrow `new` calling `new`, which calls `malloc`).
    pub nested_slot: u32,
    /// Session links: how many of the thread's calls asked for their return and have
    /// not seen it. While none has, a session program's run is an entry, told without
    /// the kernel call that reads the probe's address. A return the kernel drops (a
    /// `longjmp` out of the allocator) leaves it high, which costs only that call.
    pub returns_awaited: u32,
}

/// [`InFlight::active`]: no call in progress.
pub const CALL_DONE: u32 = 0;
/// [`InFlight::active`]: a call in progress whose return probe will complete it.
pub const CALL_ACTIVE: u32 = 1;
/// [`InFlight::active`]: an unsampled call whose return probe was skipped (uprobe
/// session links): it counts nothing, and matters only to tell its nested and tail
/// calls, which must not be taken for the user's, while its frame is live.
pub const CALL_UNRECORDED: u32 = 2;

/// [`ProbeSpec::frame_bytes`]: the function's code does not say how deep its frame goes.
pub const UNKNOWN_FRAME_BYTES: u32 = u32::MAX;

/// [`InFlight::nested_slot`]: no call found nested yet.
pub const NO_NESTED_SLOT: u32 = u32::MAX;

/// How deep below an unsampled call whose return was skipped ([`CALL_UNRECORDED`]) a
/// call can still be nested in it: the known allocators' functions that call another
/// probed function (mimalloc's `mi_new` calling `mi_malloc`) do so from a frame or two
/// down.
pub const MAX_UNRECORDED_NESTING_SPAN: u64 = 1 << 10;

/// A thread's call record in `IN_FLIGHT_SLOTS`, the array slot its thread id picks
/// (the id modulo the array's size), with the thread owning it (0: free). A thread
/// whose slot another owns keeps its record in `IN_FLIGHT` instead.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct InFlightSlot {
    /// The owner's pid_tgid, or 0.
    pub owner: u64,
    /// Its record.
    pub state: InFlight,
}

/// Most functions probed in one session, over every allocator object (`PROBES`).
pub const MAX_PROBE_SLOTS: u32 = 4096;

/// Index of a probed function (one function in one object) in `PROBES`, and the
/// attach cookie of the entry programs.
pub type ProbeSlot = u32;

/// How deep below an allocator call's entry a nested allocator call can start: glibc's
/// internal calls (realloc calling malloc or free) are a few hundred bytes deeper. A
/// call further down is on another stack (a signal stack, a reused thread id).
pub const MAX_NESTING_SPAN: u64 = 64 << 10;

/// Identifies one allocation site: a process image, a call stack and the entry point.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackKey {
    /// Process (thread-group) id.
    pub tgid: u32,
    /// How many times the process had called exec (while traced) when the block was
    /// allocated: the frames are addresses in that image, and only its mappings
    /// symbolize them (see `EXEC_GEN`).
    pub exec_gen: u32,
    /// Hash of the process id and the stack's frames: the key of its [`UserStack`] in
    /// `STACKS` (absent there if the stack table was full).
    pub stack: u64,
    /// The [`ProbeSlot`] of the allocator function the user called.
    pub slot: u32,
    /// The power-of-two class of the requested size ([`size_class`]): a stack that
    /// allocates several sizes is one site per class, so profiles carry size
    /// histograms per stack at no cost per call beyond the class's computation.
    pub size_class: u32,
}

/// Size classes: class 0 holds requests of 0 bytes, class `k > 0` those in
/// `[2^(k-1), 2^k)`.
pub const SIZE_CLASSES: u32 = 65;

/// The power-of-two class of a request of `size` bytes (its bit length).
#[inline(always)]
pub const fn size_class(size: u64) -> u32 {
    // A binary search rather than `leading_zeros`, which the BPF target lacks, and
    // without branches: a branch per step on a size that varies from call to call
    // is mispredicted often. `((rest >> step) + 2^step - 1) >> step` is 1 exactly
    // when `rest >> step` is nonzero, as `rest` is below `2^(2 * step)` at each step.
    let mut class = 0u64;
    let mut rest = size;
    let mut step = 32u64;
    while step > 0 {
        let shift = (((rest >> step) + ((1 << step) - 1)) >> step) * step;
        rest >>= shift;
        class += shift;
        step /= 2;
    }
    // `rest` is now 0 or 1.
    (class + rest) as u32
}

/// The smallest request of size class `class` (0 for class 0).
pub const fn size_class_floor(class: u32) -> u64 {
    if class == 0 || class > 64 {
        0
    } else {
        1 << (class - 1)
    }
}

/// A site's index in `SITE_COUNTERS`, given by the programs when they first meet the
/// site (`SITES` maps the site's key to it) and handed out again by the daemon once
/// the site is retired (`SITE_IDS_FREE`).
pub type SiteId = u32;

/// Cumulative counters of one allocation site. In-use = allocated - freed.
///
/// The programs keep one copy per CPU and the daemon sums them. The peak fields
/// record what the site held at its process's in-use peak without a write to every
/// site at each new peak: the process counts its new peaks
/// ([`ProcessUsage::peaks`]), and a copy changed for the first time since the latest
/// one first saves its in-use value and that count. A copy whose saved count is the
/// process's current one held its saved value at the peak; any other copy has not
/// changed since, so it holds its current value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SiteCounters {
    /// Blocks allocated at this site since tracing began.
    pub alloc_objects: u64,
    /// Bytes allocated at this site since tracing began.
    pub alloc_bytes: u64,
    /// Blocks from this site freed since tracing began.
    pub free_objects: u64,
    /// Bytes from this site freed since tracing began.
    pub free_bytes: u64,
    /// Blocks from this site that were temporary: freed by the thread that allocated
    /// them before it allocated again (heaptrack's definition).
    pub temp_objects: u64,
    /// Their bytes.
    pub temp_bytes: u64,
    /// The process's count of new peaks when this copy saved its value (0: never).
    pub peak_generation: u64,
    /// This copy's in-use blocks (allocated - freed, wrapping) at that peak.
    pub peak_objects: u64,
    /// This copy's in-use bytes at that peak.
    pub peak_bytes: u64,
}

impl SiteCounters {
    /// This copy's in-use blocks and bytes at the process's peak number `peaks` (0:
    /// no peak yet), wrapping (a block may be freed on another CPU than the one
    /// that counted it).
    pub fn at_peak(&self, peaks: u64) -> (u64, u64) {
        if peaks == 0 {
            (0, 0)
        } else if self.peak_generation == peaks {
            (self.peak_objects, self.peak_bytes)
        } else {
            (
                self.alloc_objects.wrapping_sub(self.free_objects),
                self.alloc_bytes.wrapping_sub(self.free_bytes),
            )
        }
    }
}

/// A block, identified by its process and address (the key of `STALE_FREES`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LiveKey {
    /// The block's address in the process.
    pub ptr: u64,
    /// Process (thread-group) id.
    pub tgid: u32,
    /// Explicit padding, always zero.
    pub _pad: u32,
}

/// Reasons an event could not be fully recorded, the indices of the per-CPU
/// `DROPS` array. Every one of them is reported to the user.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// The live-block table was full: the block counts as allocated, not as in use (its
    /// free could not be matched, so "in use" stays what was tracked, never a false leak).
    LiveTableFull = 0,
    /// The per-site counter map was full: the allocation is not counted at all.
    SiteTableFull = 1,
    /// The stack table was full: counted, with an unknown stack.
    StackTableFull = 2,
    /// The stack was deeper than [`MAX_STACK_DEPTH`]: counted, outermost frames cut.
    StackTruncated = 3,
    /// The per-thread in-flight table was full: the call is not counted.
    InFlightFull = 4,
    /// posix_memalign's result could not be read from user memory: the call is not counted.
    OutPtrUnreadable = 5,
    /// The kernel could not take the stack of a kernel allocation: counted at its call site.
    StackUnavailable = 6,
    /// The exec-generation table was full: a process's allocations after an exec are
    /// counted as its previous image's, whose mappings may not symbolize them.
    ExecTableFull = 7,
    /// A user stack could not be unwound to its end: counted with the frames found,
    /// and the address where it stopped is reported (`UNWIND_GAPS`).
    StackIncomplete = 8,
    /// The per-process usage table was full: a process's in-use total and peak are
    /// not recorded (its sites are counted as usual).
    UsageTableFull = 9,
    /// The preload library's queue of a thread's frees could not be read: those frees
    /// are not counted (their blocks stay in use).
    FreeQueueUnreadable = 10,
    /// A block was still recorded when the allocator handed out its address again:
    /// its free was not seen (a pointer to `free` saved before a `--pid` join, an
    /// allocator's own free, a path without probes). It counted as in use until then.
    /// Counted when the address comes back, less the frees that then arrive late from
    /// another thread's queue ([`LATE_FREES_SLOT`]).
    FreeUnseen = 11,
}

/// The slot of `DROPS` after the reasons: queued frees that arrived after their
/// address had been allocated again (matched, not lost). The daemon takes them off
/// [`DropReason::FreeUnseen`], which counted them when the address came back.
pub const LATE_FREES_SLOT: u32 = DropReason::COUNT;

/// What `STALE_FREES` holds for a block closed because its address was allocated
/// again while it was still recorded.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StaleFree {
    /// Late frees of the address expected (each closed block's own).
    pub count: u32,
    /// The thread (`pid_tgid`'s low half) whose allocation took the address last. Its
    /// own queued frees are applied in order, so one of that address from it frees the
    /// new block: the expected free was never seen.
    pub replacer: u32,
}

impl DropReason {
    /// Number of reasons (size of the `DROPS` array).
    pub const COUNT: u32 = 12;

    /// Every reason, indexed by discriminant.
    pub const ALL: [DropReason; 12] = [
        DropReason::LiveTableFull,
        DropReason::SiteTableFull,
        DropReason::StackTableFull,
        DropReason::StackTruncated,
        DropReason::InFlightFull,
        DropReason::OutPtrUnreadable,
        DropReason::StackUnavailable,
        DropReason::ExecTableFull,
        DropReason::StackIncomplete,
        DropReason::UsageTableFull,
        DropReason::FreeQueueUnreadable,
        DropReason::FreeUnseen,
    ];

    /// The BPF table whose filling up causes this drop, in user mode (`kernel`
    /// false) or kernel mode; `None` for a drop that is not a full table.
    pub const fn table(self, kernel: bool) -> Option<&'static str> {
        match (self, kernel) {
            (DropReason::LiveTableFull, false) => Some(names::LIVE),
            (DropReason::LiveTableFull, true) => Some(kernel::names::KERNEL_LIVE),
            (DropReason::SiteTableFull, false) => Some(names::SITES),
            (DropReason::SiteTableFull, true) => Some(kernel::names::KERNEL_SITES),
            (DropReason::StackTableFull, false) => Some(names::STACKS),
            (DropReason::StackTableFull, true) => Some(kernel::names::KERNEL_STACKS),
            (DropReason::InFlightFull, _) => Some(names::IN_FLIGHT),
            (DropReason::ExecTableFull, _) => Some(names::EXEC_GEN),
            (DropReason::UsageTableFull, _) => Some(names::PROCESS_USAGE),
            _ => None,
        }
    }

    /// What the user can do about it, for logs.
    pub const fn remedy(self) -> &'static str {
        match self {
            DropReason::LiveTableFull => "raise --max-live-blocks",
            DropReason::SiteTableFull => "raise --max-sites",
            DropReason::StackTableFull => "raise --max-stacks",
            DropReason::StackTruncated => "the frame limit is fixed",
            DropReason::InFlightFull => "raise --max-threads",
            DropReason::OutPtrUnreadable => "the program passed an unreadable pointer",
            DropReason::StackUnavailable => "the kernel could not walk the stack",
            DropReason::ExecTableFull => "raise --max-threads",
            DropReason::StackIncomplete => {
                "where they stop is logged and in the profile's comments"
            }
            DropReason::UsageTableFull => "raise --max-processes",
            DropReason::FreeQueueUnreadable => "the program overwrote heapprofd's preload state",
            DropReason::FreeUnseen => {
                "frees through a pointer saved before --pid joined are not seen (--inject off \
                 probes the allocator itself)"
            }
        }
    }

    /// Its stable name: profile comments and `--stats-json` key drops by it, so that
    /// rewording [`DropReason::describe`] changes no reader.
    pub const fn name(self) -> &'static str {
        match self {
            DropReason::LiveTableFull => "live_table_full",
            DropReason::SiteTableFull => "site_table_full",
            DropReason::StackTableFull => "stack_table_full",
            DropReason::StackTruncated => "stack_truncated",
            DropReason::InFlightFull => "in_flight_full",
            DropReason::OutPtrUnreadable => "out_ptr_unreadable",
            DropReason::StackUnavailable => "stack_unavailable",
            DropReason::ExecTableFull => "exec_table_full",
            DropReason::StackIncomplete => "stack_incomplete",
            DropReason::UsageTableFull => "usage_table_full",
            DropReason::FreeQueueUnreadable => "free_queue_unreadable",
            DropReason::FreeUnseen => "free_unseen",
        }
    }

    /// A short description for logs and profile comments.
    pub const fn describe(self) -> &'static str {
        match self {
            DropReason::LiveTableFull => {
                "live-block table full (counted as allocated, not as in use)"
            }
            DropReason::SiteTableFull => "site table full (allocations not counted)",
            DropReason::StackTableFull => "stack table full (counted, stack unknown)",
            DropReason::StackTruncated => {
                "stacks deeper than the frame limit (counted, outer frames cut)"
            }
            DropReason::InFlightFull => "in-flight table full (calls not counted)",
            DropReason::OutPtrUnreadable => "posix_memalign result unreadable (not counted)",
            DropReason::StackUnavailable => "kernel stack not available (counted at the call site)",
            DropReason::ExecTableFull => {
                "exec-generation table full (allocations after an exec may be mis-symbolized)"
            }
            DropReason::StackIncomplete => {
                "stacks not unwound to their end (counted with the frames found)"
            }
            DropReason::UsageTableFull => {
                "process usage table full (in-use peak not recorded for some processes)"
            }
            DropReason::FreeQueueUnreadable => {
                "a thread's queued frees unreadable (those blocks stay in use)"
            }
            DropReason::FreeUnseen => {
                "frees not seen (blocks in use until the allocator handed out their address again)"
            }
        }
    }
}

/// The counters in `WALK_EPOCH`, each written by one part of the daemon.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WalkEpoch {
    /// Mapping writes (the unwind tables' loader): a walk depends on the rules of the
    /// addresses it visits.
    Mappings = 0,
    /// Site retirements (the aggregator): a remembered walk keeps its site's index,
    /// which a retired site gives back.
    Sites = 1,
}

impl WalkEpoch {
    /// Number of counters (size of `WALK_EPOCH`).
    pub const COUNT: u32 = 2;
}

/// What became of an allocation's stack walk in attach mode (the per-CPU counters of
/// `WALK_STATS`, indexed by these).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WalkOutcome {
    /// A walk remembered on the CPU still held: no walk.
    Remembered = 0,
    /// Walked, and remembered for the next allocation there.
    Walked = 1,
    /// Walked; the walk cannot be remembered (it depended on more than the stack's
    /// words, read too many of them, or was cut short).
    NotRememberable = 2,
}

impl WalkOutcome {
    /// Number of outcomes (size of `WALK_STATS`).
    pub const COUNT: u32 = 3;
}

/// One process's in-use bytes as the programs count them (blocks allocated while
/// tracing and not yet freed), and the highest value they reached. Updated with
/// atomic operations, so the peak is exact across CPUs: every allocation's new total
/// is compared with it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessUsage {
    /// Bytes in use now.
    pub inuse_bytes: u64,
    /// The most bytes ever in use at once since tracing began.
    pub peak_bytes: u64,
    /// How many times `peak_bytes` was raised: the generation of the peak that site
    /// counters compare theirs with (see [`SiteCounters`]).
    pub peaks: u64,
}

/// A process's usage in `USAGE_SLOTS`, the array slot its id picks (the id modulo the
/// array's size), with the process owning it (0: free; the daemon zeroes a slot before
/// it frees it). A process whose slot another owns keeps its usage in
/// `PROCESS_USAGE` instead.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessUsageSlot {
    /// The owner's tgid, or 0.
    pub owner: u64,
    /// Its usage.
    pub usage: ProcessUsage,
}

/// Settings written by the daemon into the BPF programs' read-only data before loading.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Config {
    /// Page size of the traced system, for pvalloc's rounding.
    pub page_size: u64,
    /// A process whose calls are ignored: the daemon itself, whose own
    /// allocations would otherwise feed back into the profile in `--all` mode.
    pub ignore_tgid: u32,
    /// The one process traced (`--pid`, a launched command), or 0 for all: execs of
    /// other processes are not recorded.
    pub target_tgid: u32,
    /// Mean bytes between recorded allocations (Poisson sampling by bytes, as Go's and
    /// tcmalloc's heap profilers); 0 records every allocation.
    pub sample_rate: u64,
    /// How user stacks are unwound: an [`unwind::UnwindMode`].
    pub unwind_mode: u32,
    /// Launch mode: at each loader event of `target_tgid` the programs hold the command
    /// (a SIGCONT the tracer intercepts) until the daemon has loaded its mappings, so
    /// that code runs only once its unwind tables are in place.
    pub hold_at_loader_events: u32,
    /// Benchmark baseline: the uprobe programs return at once, so only the traps cost
    /// (the read-only value lets the verifier drop everything else as dead code).
    pub empty_programs: u32,
    /// Benchmark baseline: the uprobe programs match returns to calls and find each
    /// allocation's stack (a remembered walk's check, or a walk), then count nothing:
    /// what an exact profile of stacks costs at the least, beyond the traps.
    pub stacks_only: u32,
    /// Keep each process's in-use bytes and their high-water mark (`PROCESS_USAGE`):
    /// exact mode only, since sampled sizes are not the process's bytes.
    pub track_peak: u32,
    /// Nonzero: only processes in this cgroup v2 subtree are traced (`--cgroup`); the
    /// id of its root, an ancestor of theirs at [`Config::cgroup_level`].
    pub cgroup_id: u64,
    /// The depth of that cgroup below the hierarchy's root (the root is 0).
    pub cgroup_level: u32,
    /// Nonzero when launched commands get the preload library: its functions take
    /// the first slots, in [`preload::FUNCTIONS`] order, and the allocator's probes
    /// look up `PRELOADED` (otherwise they skip that lookup).
    pub preload: u32,
    /// Buckets of the live-block table (see [`live`]).
    pub live_buckets: u32,
    /// Capacity of the site table (`SITE_COUNTERS`): site indices stay below it.
    pub max_sites: u32,
    /// Slots of `IN_FLIGHT_SLOTS` (a power of two).
    pub in_flight_slots: u32,
    /// Slots of `USAGE_SLOTS` (a power of two).
    pub usage_slots: u32,
    /// Where `sched_process_fork`'s record holds `child_pid` (from tracefs; the
    /// layout differs between kernels), or 0 when the fork program is not attached.
    pub fork_child_pid_offset: u32,
}

/// The switches the daemon sets at run time: the one value of `CONTROL`, read whole by
/// a program's one lookup.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Control {
    /// Nonzero once the daemon has attached all the programs: they ignore every call
    /// until then, so that no call is half seen (an entry without its return probe, a
    /// free without the entry probes).
    pub armed: u32,
    /// Nonzero once the program that clears each CPU's cached thread id at every
    /// context switch is attached (`THREAD_ON_CPU`), so that the session program may
    /// take its thread's id from there.
    pub thread_cache: u32,
}

/// Sent to the daemon when a traced process calls exec: its mappings are replaced, and
/// the daemon reads the new ones while they are current.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecEvent {
    /// The process.
    pub tgid: u32,
    /// Its new exec generation (see [`StackKey::exec_gen`]).
    pub exec_gen: u32,
    /// The fork origin that unwound the replaced image (generation `exec_gen - 1`),
    /// tgid 0 when none did: a fork that execs at once is gone from `FORK_ORIGINS` (its
    /// entry becomes its mark) before the daemon reads its sites, which it symbolizes
    /// with that origin's mappings.
    pub replaced_origin: unwind::ForkOrigin,
}

/// Largest `--sample-rate`: keeps the BPF side's fixed-point arithmetic in range.
pub const MAX_SAMPLE_RATE: u64 = 1 << 40;

#[cfg(feature = "user")]
#[expect(
    clippy::undocumented_unsafe_blocks,
    reason = "a list of Pod impls: the one SAFETY comment at its head covers each"
)]
mod pod {
    // SAFETY: all of these are repr(C), Copy, made only of integers, with explicit padding.
    unsafe impl aya::Pod for super::Control {}
    unsafe impl aya::Pod for super::InFlight {}
    unsafe impl aya::Pod for super::InFlightSlot {}
    unsafe impl aya::Pod for super::StackKey {}
    unsafe impl aya::Pod for super::SiteCounters {}
    unsafe impl aya::Pod for super::LiveKey {}
    unsafe impl aya::Pod for super::live::LiveBucket {}
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::UserStack {}
    unsafe impl aya::Pod for super::ExecEvent {}
    unsafe impl aya::Pod for super::ProcessUsage {}
    unsafe impl aya::Pod for super::ProcessUsageSlot {}
    unsafe impl aya::Pod for super::ProbeSpec {}
    unsafe impl aya::Pod for super::preload::Preloaded {}
    unsafe impl aya::Pod for super::unwind::UnwindRule {}
    unsafe impl aya::Pod for super::unwind::UnwindRow {}
    unsafe impl aya::Pod for super::unwind::UnwindObject {}
    unsafe impl aya::Pod for super::unwind::ExecMapping {}
    unsafe impl aya::Pod for super::unwind::ProcessMappings {}
    unsafe impl aya::Pod for super::unwind::UnwindGap {}
    unsafe impl aya::Pod for super::unwind::MappingsRequest {}
    unsafe impl aya::Pod for super::unwind::ForkOrigin {}
}

#[cfg(test)]
mod tests {
    extern crate std;

    use std::vec;

    use super::*;

    /// Every drop reason has a name of its own, an identifier (no spaces).
    #[test]
    fn drop_reasons_have_distinct_names() {
        for reason in DropReason::ALL {
            let same = DropReason::ALL.iter().filter(|r| r.name() == reason.name());
            assert_eq!(same.count(), 1, "{}", reason.name());
            assert!(
                reason
                    .name()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{}",
                reason.name()
            );
        }
    }

    /// The class is the bit length, for every power of two, its neighbours and the
    /// extremes.
    #[test]
    fn size_class_is_the_bit_length() {
        let mut sizes = vec![0u64, 1, 2, 3, u64::MAX];
        for bit in 0..64 {
            let power = 1u64 << bit;
            sizes.extend([power - 1, power, power + 1, power | (power >> 1)]);
        }
        for size in sizes {
            assert_eq!(
                size_class(size),
                64 - size.leading_zeros(),
                "size class of {size:#x}"
            );
        }
    }
}
