//! Layouts shared with the kernel-mode programs (`heapprofd --kernel`).
//!
//! Kernel mode reads the `kmem:*` tracepoints. Their record layouts differ between
//! kernel versions (6.1 merged the `_node` events, 6.2 split kmalloc from
//! kmem_cache_alloc, later kernels added fields), and many board kernels have no BTF,
//! so the BPF programs do not hard-code any offset: the daemon parses each event's
//! tracefs `format` file and hands the field positions over in [`KernelConfig`].

/// The tracepoints kernel mode attaches to, in a fixed order (index into
/// [`KernelConfig::events`]).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KernelEvent {
    /// `kmem:kmalloc`
    Kmalloc = 0,
    /// `kmem:kmalloc_node` (kernels before 6.1)
    KmallocNode = 1,
    /// `kmem:kmem_cache_alloc`
    KmemCacheAlloc = 2,
    /// `kmem:kmem_cache_alloc_node` (kernels before 6.1)
    KmemCacheAllocNode = 3,
    /// `kmem:kfree`
    Kfree = 4,
    /// `kmem:kmem_cache_free`
    KmemCacheFree = 5,
    /// `kmem:mm_page_alloc` (with `--pages`)
    PageAlloc = 6,
    /// `kmem:mm_page_free` (with `--pages`)
    PageFree = 7,
    /// `kmem:mm_page_free_batched` (with `--pages`; order 0 pages)
    PageFreeBatched = 8,
    /// `sched:sched_process_fork`: follows the children of a launched command.
    ProcessFork = 9,
}

impl KernelEvent {
    /// Number of events.
    pub const COUNT: usize = 10;

    /// Every event, indexed by discriminant.
    pub const ALL: [KernelEvent; Self::COUNT] = [
        KernelEvent::Kmalloc,
        KernelEvent::KmallocNode,
        KernelEvent::KmemCacheAlloc,
        KernelEvent::KmemCacheAllocNode,
        KernelEvent::Kfree,
        KernelEvent::KmemCacheFree,
        KernelEvent::PageAlloc,
        KernelEvent::PageFree,
        KernelEvent::PageFreeBatched,
        KernelEvent::ProcessFork,
    ];

    /// The tracefs category of the event.
    pub const fn category(self) -> &'static str {
        match self {
            KernelEvent::ProcessFork => "sched",
            _ => "kmem",
        }
    }

    /// The tracefs name of the event; the BPF program handling it has the same name.
    pub const fn name(self) -> &'static str {
        match self {
            KernelEvent::Kmalloc => "kmalloc",
            KernelEvent::KmallocNode => "kmalloc_node",
            KernelEvent::KmemCacheAlloc => "kmem_cache_alloc",
            KernelEvent::KmemCacheAllocNode => "kmem_cache_alloc_node",
            KernelEvent::Kfree => "kfree",
            KernelEvent::KmemCacheFree => "kmem_cache_free",
            KernelEvent::PageAlloc => "mm_page_alloc",
            KernelEvent::PageFree => "mm_page_free",
            KernelEvent::PageFreeBatched => "mm_page_free_batched",
            KernelEvent::ProcessFork => "sched_process_fork",
        }
    }

    /// The raw-tracepoint programs that handle the event in place of its tracepoint
    /// program, in attach order (empty: none): the slab frees, whose pointer is the
    /// second argument of the tracepoint on every kernel (`kfree(call_site, ptr)`,
    /// `kmem_cache_free(call_site, ptr, ...)`). The kernel skips a tracepoint program
    /// while any other tracing program runs on the CPU (a free in an interrupt that
    /// came during an allocation's program is lost and its object stays in use), a
    /// raw-tracepoint program only while the same program runs: of the two copies,
    /// the second frees what the first was skipped for, and passes over what the
    /// first has freed.
    pub const fn raw_programs(self) -> &'static [&'static str] {
        match self {
            KernelEvent::Kfree => &[names::PROG_KFREE_RAW, names::PROG_KFREE_RAW_NESTED],
            KernelEvent::KmemCacheFree => &[
                names::PROG_KMEM_CACHE_FREE_RAW,
                names::PROG_KMEM_CACHE_FREE_RAW_NESTED,
            ],
            _ => &[],
        }
    }

    /// The kind of memory an allocation event hands out, `None` for other events.
    pub const fn allocates(self) -> Option<KernelAllocKind> {
        match self {
            KernelEvent::Kmalloc | KernelEvent::KmallocNode => Some(KernelAllocKind::Kmalloc),
            KernelEvent::KmemCacheAlloc | KernelEvent::KmemCacheAllocNode => {
                Some(KernelAllocKind::KmemCacheAlloc)
            }
            KernelEvent::PageAlloc => Some(KernelAllocKind::Pages),
            _ => None,
        }
    }
}

/// What a kernel allocation site hands out; part of its key and its leaf frame.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KernelAllocKind {
    /// kmalloc and friends (kzalloc, kcalloc, kmalloc_array, large kmalloc).
    Kmalloc = 0,
    /// An object of a named slab cache.
    KmemCacheAlloc = 1,
    /// Whole pages from the page allocator (2^order pages).
    Pages = 2,
}

impl KernelAllocKind {
    /// Every kind, indexed by discriminant.
    pub const ALL: [KernelAllocKind; 3] = [
        KernelAllocKind::Kmalloc,
        KernelAllocKind::KmemCacheAlloc,
        KernelAllocKind::Pages,
    ];

    /// The name of the leaf frame of this kind's samples.
    pub const fn function(self) -> &'static str {
        match self {
            KernelAllocKind::Kmalloc => "kmalloc",
            KernelAllocKind::KmemCacheAlloc => "kmem_cache_alloc",
            KernelAllocKind::Pages => "alloc_pages",
        }
    }

    /// Converts a discriminant read from a map back into a kind.
    pub const fn from_u32(value: u32) -> Option<KernelAllocKind> {
        if (value as usize) < Self::ALL.len() {
            Some(Self::ALL[value as usize])
        } else {
            None
        }
    }
}

/// Kernel functions that only pass an allocation through (the allocator's entries and
/// wrappers), by name prefix: a site is named after the first frame above them.
pub const ALLOCATOR_FRAME_PREFIXES: [&str; 12] = [
    "kmalloc",
    "__kmalloc",
    "kmem_cache_alloc",
    "__kmem_cache_alloc",
    "kvmalloc",
    "__kvmalloc",
    "kzalloc",
    "kcalloc",
    "alloc_pages",
    "__alloc_pages",
    "__alloc_frozen_pages",
    "folio_alloc",
];

/// The suffix of the wrappers 6.10+ kernels add for allocation profiling
/// (`kmalloc_noprof`, `kmem_cache_alloc_lru_noprof`, ...).
pub const ALLOCATOR_FRAME_SUFFIX: &str = "_noprof";

/// Whether the kernel function `name` is an allocator entry or wrapper (see
/// [`ALLOCATOR_FRAME_PREFIXES`]); the pseudo-frames of [`KernelAllocKind`] are too.
pub fn is_allocator_frame(name: &str) -> bool {
    // Compiler clones (`.isra.0`, `.constprop.0`) are the same function.
    let name = match name.find('.') {
        Some(dot) => &name[..dot],
        None => name,
    };
    name.ends_with(ALLOCATOR_FRAME_SUFFIX)
        || ALLOCATOR_FRAME_PREFIXES
            .iter()
            .any(|prefix| name.starts_with(prefix))
}

/// Writes the pprof `drop_frames` expression matching exactly the frames of
/// [`is_allocator_frame`] (pprof readers drop them and every frame below, so the
/// flat cost lands on the allocator's caller).
pub fn allocator_frames_regex(out: &mut impl core::fmt::Write) -> core::fmt::Result {
    out.write_str("(")?;
    for (i, prefix) in ALLOCATOR_FRAME_PREFIXES.iter().enumerate() {
        if i > 0 {
            out.write_str("|")?;
        }
        out.write_str(prefix)?;
    }
    write!(out, ").*|.*{ALLOCATOR_FRAME_SUFFIX}(\\..*)?")
}

/// Where one field sits in a tracepoint record. `size == 0` means the event lacks it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FieldRef {
    /// Byte offset from the start of the record.
    pub offset: u16,
    /// Size in bytes: 4 or 8 (0: absent).
    pub size: u16,
}

/// The fields kernel mode reads from one event; each is absent where the event lacks it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventLayout {
    /// The object's address (`ptr`), or the page frame number (`pfn`) of page events,
    /// or the child's pid of a fork event (`child_pid`).
    pub ptr: FieldRef,
    /// The allocator's caller (`call_site`).
    pub call_site: FieldRef,
    /// Bytes asked for (`bytes_req`).
    pub bytes_req: FieldRef,
    /// Bytes handed out, after slab rounding (`bytes_alloc`).
    pub bytes_alloc: FieldRef,
    /// Page order (`order`) of page events.
    pub order: FieldRef,
    /// The slab cache's name (`name`, a `__data_loc char[]`: offset in the low 16
    /// bits, length in the high 16) of `kmem_cache_alloc`.
    pub name: FieldRef,
}

/// Settings of the kernel-mode programs, written into their read-only data before loading.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelConfig {
    /// Field positions of each event, indexed by [`KernelEvent`].
    pub events: [EventLayout; KernelEvent::COUNT],
    /// Page size, for page events (bytes = page size << order).
    pub page_size: u64,
    /// The daemon's own process, whose allocations (reading the maps) are ignored.
    pub ignore_tgid: u32,
    /// Nonzero: only allocations made in the context of a process in `TRACED` count.
    pub filter_processes: u32,
    /// Nonzero: only allocations in the context of a task in this cgroup v2 subtree
    /// count (`--cgroup`); see [`crate::Config::cgroup_id`].
    pub cgroup_id: u64,
    /// The depth of that cgroup below the hierarchy's root.
    pub cgroup_level: u32,
    /// How the fentry programs read their function's arguments: a [`FuncArgs`].
    pub func_args: u32,
    /// Nonzero: record a Poisson sample of the allocations, one per this many
    /// handed-out bytes on average (`--sample-rate`); 0: every allocation.
    pub sample_rate: u64,
}

/// How the fentry programs read the raw arguments of the function they are attached
/// to. Reading them straight from the context is checked against the arguments' BTF
/// types, which refuses pointers to anything but a struct (`rcu_callback_t`, `void **`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FuncArgs {
    /// `bpf_get_func_arg()` (Linux 5.17+).
    #[default]
    Helper = 0,
    /// `bpf_probe_read_kernel()` of the argument array the trampoline saved, whose
    /// address is the context (kernels before 5.17; needs CAP_PERFMON, which
    /// lets a pointer be handed to a helper as a number).
    SavedArray = 1,
}

/// The paths on which the fentry programs see objects freed without a per-object
/// tracepoint; index of their per-CPU counter in `KERNEL_DEFERRED_FREES`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeferredFreePath {
    /// `kvfree_call_rcu` (`kfree_rcu()`, `kvfree_rcu()`).
    Rcu = 0,
    /// `kmem_cache_free_bulk` (`kfree_bulk()`).
    Bulk = 1,
}

impl DeferredFreePath {
    /// Number of paths.
    pub const COUNT: usize = 2;

    /// Every path, indexed by discriminant.
    pub const ALL: [DeferredFreePath; Self::COUNT] =
        [DeferredFreePath::Rcu, DeferredFreePath::Bulk];

    /// The kernel function the path's fentry program is attached to.
    pub const fn function(self) -> &'static str {
        match self {
            DeferredFreePath::Rcu => names::RCU_FREE_FUNCTION,
            DeferredFreePath::Bulk => names::BULK_FREE_FUNCTION,
        }
    }

    /// The fentry program's name.
    pub const fn program(self) -> &'static str {
        match self {
            DeferredFreePath::Rcu => names::PROG_RCU_FREE,
            DeferredFreePath::Bulk => names::PROG_BULK_FREE,
        }
    }

    /// The kprobe program doing the same, for kernels where the fentry program
    /// cannot be used (no BTF, or no BPF trampolines: arm64 before 6.4).
    pub const fn kprobe_program(self) -> &'static str {
        match self {
            DeferredFreePath::Rcu => names::PROG_RCU_FREE_KPROBE,
            DeferredFreePath::Bulk => names::PROG_BULK_FREE_KPROBE,
        }
    }
}

/// `kfree_rcu(ptr, field)` on kernels before 6.3 passes `kvfree_call_rcu` the field's
/// offset in place of a callback; offsets are below this (the kernel's own
/// `KVFREE_RCU_OFFSET`), code addresses never are.
pub const KVFREE_RCU_OFFSET: u64 = 4096;

/// The object `kvfree_call_rcu(head, arg)` releases. Before 6.3 its second argument
/// is an `rcu_callback_t`: the `rcu_head`'s offset in the object (`kfree_rcu(ptr,
/// field)`: the object is `head - offset`), or the object itself when `head` is NULL
/// (the headless `kvfree_rcu(ptr)`). From 6.3 it is the object (`void *ptr`), which
/// as a kernel address is never below [`KVFREE_RCU_OFFSET`]: one rule reads both.
#[inline(always)]
pub const fn rcu_freed_object(head: u64, arg: u64) -> u64 {
    if head != 0 && arg < KVFREE_RCU_OFFSET {
        head.wrapping_sub(arg)
    } else {
        arg
    }
}

/// Identifies one kernel allocation site.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelSiteKey {
    /// The process in whose context the allocation was made (0: kernel threads count too).
    pub tgid: u32,
    /// [`KernelAllocKind`].
    pub kind: u32,
    /// Hash of the kernel stack: its key in `KERNEL_STACKS`, 0 when no stack was taken.
    pub stack: u64,
    /// The allocator's caller from the event (0 for page events): the site's only frame
    /// when the stack is missing.
    pub call_site: u64,
    /// What the objects were cut from, by kind: the hash of the slab cache's name (its
    /// key in `CACHE_NAMES`), kmalloc's handed-out size (its size class), or the page
    /// order. A stack that allocates from several classes is one site per class.
    pub class: u64,
}

/// Slots of each CPU's cache of recent sites (`names::KERNEL_SITE_CACHE`), a power of
/// two: a hit finds a site's index without the `KERNEL_SITES` hash lookup.
pub const KERNEL_SITE_CACHE_SLOTS: u32 = 1024;

/// The slot of [`KERNEL_SITE_CACHE_SLOTS`] that caches `site`'s index.
#[inline(always)]
pub const fn site_cache_slot(site: &KernelSiteKey) -> u32 {
    let mixed = site.stack
        ^ site.call_site.rotate_left(21)
        ^ site.class.rotate_left(42)
        ^ ((site.tgid as u64) << 32 | site.kind as u64);
    // The product's top bits depend on every bit of `mixed`.
    (mixed.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - KERNEL_SITE_CACHE_SLOTS.trailing_zeros()))
        as u32
}

/// Longest slab cache name kept (longer names are cut; the kernel's own are shorter).
pub const CACHE_NAME_LEN: usize = 32;

/// The handed-out sizes kmalloc serves from its own slab caches (`kmalloc-8` to
/// `kmalloc-8k` on 4 KiB pages: two pages); larger requests get whole pages.
pub const fn kmalloc_cache_limit(page_size: u64) -> u64 {
    2 * page_size
}

/// Cumulative counters of one kernel site. In use = allocated - freed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelCounters {
    /// Objects allocated.
    pub alloc_objects: u64,
    /// Bytes handed out (slab-rounded).
    pub alloc_bytes: u64,
    /// Bytes asked for.
    pub alloc_requested: u64,
    /// Objects freed.
    pub free_objects: u64,
    /// Handed-out bytes freed.
    pub free_bytes: u64,
    /// Asked-for bytes freed.
    pub free_requested: u64,
}

/// Address space of a live kernel object.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelSpace {
    /// Slab objects, by address (kmalloc and kmem_cache objects share it: kfree frees both).
    Slab = 0,
    /// Pages, by page frame number.
    Pages = 1,
}

/// The first kernel whose verifier takes atomic instructions that return a value
/// (exchange, compare-and-exchange, fetch-and-add), which user mode's live-block
/// table (`LIVE`) is changed with; before it a program holding one is refused.
pub const ATOMICS_SINCE: (u32, u32) = (5, 12);

/// The suffix of the copies of [`HASHED_PROGRAMS`] for kernels before
/// [`ATOMICS_SINCE`], which keep the live objects in `KERNEL_LIVE`, a hash map.
pub const HASHED_SUFFIX: &str = "_hashed";

/// The programs that record or free objects, and so have a copy for kernels before
/// [`ATOMICS_SINCE`] (named with [`HASHED_SUFFIX`]). The bulk-free programs have
/// none: they need `bpf_loop()`, 5.17+.
pub const HASHED_PROGRAMS: [&str; 15] = [
    "kmalloc",
    "kmalloc_node",
    "kmem_cache_alloc",
    "kmem_cache_alloc_node",
    "mm_page_alloc",
    "kfree",
    "kmem_cache_free",
    "mm_page_free",
    "mm_page_free_batched",
    names::PROG_KFREE_RAW,
    names::PROG_KFREE_RAW_NESTED,
    names::PROG_KMEM_CACHE_FREE_RAW,
    names::PROG_KMEM_CACHE_FREE_RAW_NESTED,
    names::PROG_RCU_FREE,
    names::PROG_RCU_FREE_KPROBE,
];

/// Key of the live kernel-object table.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KernelLiveKey {
    /// Object address, or page frame number.
    pub addr: u64,
    /// [`KernelSpace`].
    pub space: u32,
    /// Explicit padding, always zero.
    pub _pad: u32,
}

/// A kernel object allocated while tracing and not yet freed: 16 bytes, its site by
/// index (a free credits the counters without looking the site's key up).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelLiveBlock {
    /// The index of the site that allocated it (in `KERNEL_SITE_COUNTERS`).
    pub site: crate::SiteId,
    /// Explicit padding, always zero.
    pub _pad: u32,
    /// Bytes handed out and asked for ([`pack_sizes`]).
    pub sizes: u64,
}

/// A kernel object's handed-out and requested bytes, packed into one word of its
/// live entry (32 bits each: no slab object nor page block comes near 4 GiB).
#[inline(always)]
pub const fn pack_sizes(bytes: u64, requested: u64) -> u64 {
    let bytes = if bytes > u32::MAX as u64 {
        u32::MAX as u64
    } else {
        bytes
    };
    let requested = if requested > bytes { bytes } else { requested };
    bytes | requested << 32
}

/// The handed-out and requested bytes of [`pack_sizes`].
#[inline(always)]
pub const fn unpack_sizes(size: u64) -> (u64, u64) {
    (size & 0xffff_ffff, size >> 32)
}

/// Maximum number of kernel frames recorded per stack.
pub const MAX_KERNEL_STACK_DEPTH: usize = 64;

/// A kernel call stack: return addresses, innermost first.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KernelStack {
    /// Frames in use.
    pub len: u32,
    /// Explicit padding, always zero.
    pub _pad: u32,
    /// Kernel addresses.
    pub frames: [u64; MAX_KERNEL_STACK_DEPTH],
}

/// Names of the kernel-mode maps.
pub mod names {
    /// Each site's index in [`KERNEL_SITE_COUNTERS`] (`HashMap<KernelSiteKey, SiteId>`).
    pub const KERNEL_SITES: &str = "KERNEL_SITES";
    /// Per-site counters by index (`PerCpuArray<KernelCounters>`): a free finds its
    /// site's counters by the index its live entry holds, without a hash lookup.
    pub const KERNEL_SITE_COUNTERS: &str = "KERNEL_SITE_COUNTERS";
    /// The site indices not handed out yet (`Queue<SiteId>`), filled by the daemon
    /// before the programs are attached: popped without an atomic instruction that
    /// returns a value, which kernels before 5.12 refuse in any program.
    pub const KERNEL_SITE_IDS: &str = "KERNEL_SITE_IDS";
    /// Live objects on kernels before 5.12 (`HashMap<KernelLiveKey,
    /// KernelLiveBlock>`); from 5.12 they are in `LIVE`, user mode's live-block table.
    pub const KERNEL_LIVE: &str = "KERNEL_LIVE";
    /// Each CPU's cache of its recent sites' indices (`PerCpuArray`, one entry in
    /// the object: the kernel-mode loader sizes it to [`super::KERNEL_SITE_CACHE_SLOTS`]).
    pub const KERNEL_SITE_CACHE: &str = "KERNEL_SITE_CACHE";
    /// Kernel stacks (`HashMap<u64, KernelStack>`, by hash).
    pub const KERNEL_STACKS: &str = "KERNEL_STACKS";
    /// Processes whose allocations count when filtering (`HashMap<u32, u32>`).
    pub const TRACED: &str = "TRACED";
    /// Command name of each process with a site (`HashMap<u32, [u8; 16]>`).
    pub const COMMS: &str = "COMMS";
    /// Slab cache names by the hash in [`super::KernelSiteKey::class`]
    /// (`HashMap<u64, [u8; CACHE_NAME_LEN]>`).
    pub const CACHE_NAMES: &str = "CACHE_NAMES";
    /// The `KernelConfig` global.
    pub const KERNEL_CONFIG: &str = "KERNEL_CONFIG";
    /// Fentry program on [`RCU_FREE_FUNCTION`]: an object released with `kfree_rcu()`
    /// is freed for the profile.
    pub const PROG_RCU_FREE: &str = "rcu_free";
    /// The kernel function `kfree_rcu()` and `kvfree_rcu()` call.
    pub const RCU_FREE_FUNCTION: &str = "kvfree_call_rcu";
    /// Fentry program on [`BULK_FREE_FUNCTION`]: every object of a bulk free is freed.
    pub const PROG_BULK_FREE: &str = "bulk_free";
    /// The kernel function behind `kmem_cache_free_bulk()` and `kfree_bulk()`.
    pub const BULK_FREE_FUNCTION: &str = "kmem_cache_free_bulk";
    /// Kprobe program on [`RCU_FREE_FUNCTION`], where fentry cannot be used.
    pub const PROG_RCU_FREE_KPROBE: &str = "rcu_free_kprobe";
    /// Kprobe program on [`BULK_FREE_FUNCTION`], where fentry cannot be used.
    pub const PROG_BULK_FREE_KPROBE: &str = "bulk_free_kprobe";
    /// Raw-tracepoint program on `kmem:kfree`, used in place of the tracepoint
    /// program `kfree` (see [`super::KernelEvent::raw_programs`]).
    pub const PROG_KFREE_RAW: &str = "kfree_raw";
    /// Its second copy, attached after it: handles the frees that come while the
    /// first runs on the CPU (an interrupt's), which the kernel skips for the first.
    pub const PROG_KFREE_RAW_NESTED: &str = "kfree_raw_nested";
    /// Raw-tracepoint program on `kmem:kmem_cache_free`, in place of
    /// `kmem_cache_free`.
    pub const PROG_KMEM_CACHE_FREE_RAW: &str = "kmem_cache_free_raw";
    /// Its second copy (see [`PROG_KFREE_RAW_NESTED`]).
    pub const PROG_KMEM_CACHE_FREE_RAW_NESTED: &str = "kmem_cache_free_raw_nested";
    /// Objects each fentry program freed for the profile, per CPU
    /// (`PerCpuArray<u64>`, indexed by [`super::DeferredFreePath`]).
    pub const KERNEL_DEFERRED_FREES: &str = "KERNEL_DEFERRED_FREES";
}

#[cfg(feature = "user")]
#[expect(
    clippy::undocumented_unsafe_blocks,
    reason = "a list of Pod impls: the one SAFETY comment at its head covers each"
)]
mod pod {
    // SAFETY: all of these are repr(C), Copy, made only of integers, with explicit padding.
    unsafe impl aya::Pod for super::KernelConfig {}
    unsafe impl aya::Pod for super::KernelSiteKey {}
    unsafe impl aya::Pod for super::KernelCounters {}
    unsafe impl aya::Pod for super::KernelLiveKey {}
    unsafe impl aya::Pod for super::KernelLiveBlock {}
    unsafe impl aya::Pod for super::KernelStack {}
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::string::String;

    use super::*;

    #[test]
    fn allocator_entries_and_wrappers_are_told_from_their_callers() {
        for name in [
            "kmalloc",
            "kmem_cache_alloc",
            "alloc_pages",
            "kmem_cache_alloc_noprof",
            "__kmalloc_node_noprof",
            "kmalloc_trace",
            "__kvmalloc_node_noprof",
            "kmem_cache_alloc_lru_noprof.isra.0",
            "__alloc_frozen_pages_noprof",
        ] {
            assert!(is_allocator_frame(name), "{name}");
        }
        for name in ["getname_flags", "do_epoll_ctl", "alloc_inode", "__d_alloc"] {
            assert!(!is_allocator_frame(name), "{name}");
        }
        let mut regex = String::new();
        allocator_frames_regex(&mut regex).expect("writes");
        assert!(regex.starts_with("(kmalloc|__kmalloc|"), "{regex}");
        assert!(regex.ends_with(").*|.*_noprof(\\..*)?"), "{regex}");
    }

    #[test]
    fn site_cache_slots_stay_in_the_cache_and_spread() {
        // A loop's sites: a few stacks, each from some call sites and classes.
        let mut used = std::collections::BTreeSet::new();
        let mut sites = 0;
        for stack in 0..16u64 {
            for call_site in 0..4u64 {
                for class in [0, 64, 192, 0x5bd1_e995_1234_5677] {
                    let site = KernelSiteKey {
                        tgid: 4242,
                        kind: KernelAllocKind::Kmalloc as u32,
                        stack: stack.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
                        call_site: 0xffff_ffff_8100_0000 + call_site * 0x40,
                        class,
                    };
                    let slot = site_cache_slot(&site);
                    assert!(slot < KERNEL_SITE_CACHE_SLOTS);
                    used.insert(slot);
                    sites += 1;
                }
            }
        }
        // 256 sites in 1024 slots: uniform slots would leave about 225 distinct.
        assert!(
            used.len() > sites * 3 / 4,
            "{} slots for {sites} sites",
            used.len()
        );
        // The process and the kind are part of the slot's choice too.
        let site = KernelSiteKey {
            tgid: 1,
            stack: 7,
            ..KernelSiteKey::default()
        };
        let other = KernelSiteKey { tgid: 2, ..site };
        let kind = KernelSiteKey { kind: 1, ..site };
        assert_ne!(site_cache_slot(&site), site_cache_slot(&other));
        assert_ne!(site_cache_slot(&site), site_cache_slot(&kind));
    }

    #[test]
    fn live_entries_keep_both_sizes() {
        assert_eq!(unpack_sizes(pack_sizes(192, 150)), (192, 150));
        assert_eq!(
            unpack_sizes(pack_sizes(4096 << 10, 4096 << 10)),
            (4096 << 10, 4096 << 10)
        );
        // Never more requested than handed out, nor more than 32 bits of either.
        assert_eq!(unpack_sizes(pack_sizes(64, 65)), (64, 64));
        assert_eq!(
            unpack_sizes(pack_sizes(1 << 40, 1)),
            (u64::from(u32::MAX), 1)
        );
    }

    #[test]
    fn the_object_kvfree_call_rcu_releases() {
        let object = 0xffff_8880_0123_4500;
        // Before 6.3: kfree_rcu(ptr, rcu) with the rcu_head 0x40 into the object.
        assert_eq!(rcu_freed_object(object + 0x40, 0x40), object);
        assert_eq!(rcu_freed_object(object, 0), object);
        // Before 6.3, headless: the object in place of the callback.
        assert_eq!(rcu_freed_object(0, object), object);
        // 6.3 and later: (head, ptr), with or without a head.
        assert_eq!(rcu_freed_object(object + 0x40, object), object);
        assert_eq!(rcu_freed_object(0, object), object);
    }
}
