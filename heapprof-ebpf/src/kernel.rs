//! Kernel mode: the `kmem:*` tracepoints into per-stack kernel heap counters.
//!
//! Every field is read at the offset the daemon found in the event's tracefs format
//! file (`KERNEL_CONFIG`), so neither BTF nor kernel headers are needed and the
//! layouts of 5.10, 6.1 and later kernels all work with one object.

use core::ffi::c_void;

use aya_ebpf::{
    EbpfContext as _,
    bindings::{BPF_F_NO_PREALLOC, BPF_NOEXIST},
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_loop, bpf_probe_read_kernel,
        bpf_probe_read_kernel_str_bytes,
        generated::{bpf_get_func_arg, bpf_get_stack},
    },
    macros::{fentry, kprobe, map, raw_tracepoint, tracepoint},
    maps::{Array, HashMap, PerCpuArray, Queue},
    programs::{FEntryContext, ProbeContext, RawTracePointContext, TracePointContext},
};
use heapprof_common::{
    DropReason, SiteId,
    kernel::{
        CACHE_NAME_LEN, DeferredFreePath, EventLayout, FieldRef, FuncArgs, KernelAllocKind,
        KernelConfig, KernelCounters, KernelEvent, KernelLiveBlock, KernelLiveKey, KernelSiteKey,
        KernelSpace, KernelStack, MAX_KERNEL_STACK_DEPTH, pack_sizes, rcu_freed_object,
        unpack_sizes,
    },
    live::LiveEntry,
};

use crate::{
    atomic::add_32,
    live::{self, Inserted},
    maps::count_kernel_drop,
    sampling::sampled_at,
};

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
static KERNEL_LIVE: HashMap<KernelLiveKey, KernelLiveBlock> = HashMap::with_max_entries(1 << 20, 0);
/// Each site's index in `KERNEL_SITE_COUNTERS` (one hash lookup per allocation; a
/// free finds its counters by the index in its live entry).
#[map(name = "KERNEL_SITES")]
static KERNEL_SITES: HashMap<KernelSiteKey, SiteId> = HashMap::with_max_entries(65536, 0);
#[map(name = "KERNEL_SITE_COUNTERS")]
static KERNEL_SITE_COUNTERS: PerCpuArray<KernelCounters> = PerCpuArray::with_max_entries(65536, 0);
/// The site indices not handed out yet, filled by the daemon (indices are never given
/// back: kernel sites are never removed).
#[map(name = "KERNEL_SITE_IDS")]
static KERNEL_SITE_IDS: Queue<SiteId> = Queue::with_max_entries(65536, 0);
// Written only when a site is new: allocated on demand, as the user-mode stacks.
#[map(name = "KERNEL_STACKS")]
static KERNEL_STACKS: HashMap<u64, KernelStack> =
    HashMap::with_max_entries(32768, BPF_F_NO_PREALLOC);
#[map(name = "KERNEL_STACK_SCRATCH")]
static KERNEL_STACK_SCRATCH: PerCpuArray<KernelStack> = PerCpuArray::with_max_entries(1, 0);
/// The first [`RECORD_HEAD`] bytes of an allocation event's record, copied with one
/// helper call: its fields are then read from here, not one helper call each.
#[map(name = "KERNEL_RECORD_SCRATCH")]
static KERNEL_RECORD_SCRATCH: PerCpuArray<[u64; RECORD_HEAD / 8]> =
    PerCpuArray::with_max_entries(1, 0);
// Written only when a site is new.
#[map(name = "CACHE_NAMES")]
static CACHE_NAMES: HashMap<u64, [u8; CACHE_NAME_LEN]> =
    HashMap::with_max_entries(4096, BPF_F_NO_PREALLOC);
#[map(name = "TRACED")]
static TRACED: HashMap<u32, u32> = HashMap::with_max_entries(65536, 0);
/// The process of each CPU's last allocation found in `TRACED` (see [`counted`]).
#[map(name = "LAST_TRACED")]
static LAST_TRACED: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);
#[map(name = "COMMS")]
static COMMS: HashMap<u32, [u8; 16]> = HashMap::with_max_entries(65536, 0);
/// Sampling only: how many kernel entries of `LIVE` each slot's addresses have (see
/// [`filter_slot`]). A free whose slot holds 0 has nothing to release and skips the
/// table's lookup, which most frees then are: only sampled objects are tracked.
#[map(name = "KERNEL_LIVE_FILTER")]
static KERNEL_LIVE_FILTER: Array<u32> = Array::with_max_entries(LIVE_FILTER_SLOTS, 0);
/// Slots of [`KERNEL_LIVE_FILTER`] (256 KiB).
const LIVE_FILTER_SLOTS: u32 = 1 << 16;

/// Objects each fentry program freed for the profile, by [`DeferredFreePath`].
#[map(name = "KERNEL_DEFERRED_FREES")]
static KERNEL_DEFERRED_FREES: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(DeferredFreePath::COUNT as u32, 0);

const NO_FIELD: FieldRef = FieldRef { offset: 0, size: 0 };
const NO_LAYOUT: EventLayout = EventLayout {
    ptr: NO_FIELD,
    call_site: NO_FIELD,
    bytes_req: NO_FIELD,
    bytes_alloc: NO_FIELD,
    order: NO_FIELD,
    name: NO_FIELD,
};

/// Written by the daemon before loading (read-only data).
#[unsafe(no_mangle)]
static KERNEL_CONFIG: KernelConfig = KernelConfig {
    events: [NO_LAYOUT; KernelEvent::COUNT],
    page_size: 4096,
    ignore_tgid: 0,
    filter_processes: 0,
    cgroup_id: 0,
    cgroup_level: 0,
    func_args: FuncArgs::Helper as u32,
    sample_rate: 0,
};

const EEXIST: i32 = 17;
/// Bytes of an allocation record copied at once: every field the programs read of the
/// kmem allocation events lies in them on 5.10 to 6.18 (the largest, 6.18's
/// `kmem_cache_alloc`, ends its last read field at 48), and so does the cache's name
/// (6.18's starts at 64, right after the fixed fields), whose hash is then computed
/// from the copy instead of a string read per allocation.
const RECORD_HEAD: usize = 96;
/// Multiplier of the stack hash (2^64 / golden ratio).
const HASH_MULTIPLIER: u64 = 0x9e37_79b9_7f4a_7c15;

#[inline(always)]
fn layout(event: KernelEvent) -> EventLayout {
    // SAFETY: a plain global; volatile so the loader's value is read, not the default.
    unsafe { core::ptr::read_volatile(&KERNEL_CONFIG.events[event as usize]) }
}

#[inline(always)]
fn config_u64(field: &u64) -> u64 {
    // SAFETY: a field of the read-only global; volatile as above.
    unsafe { core::ptr::read_volatile(field) }
}

#[inline(always)]
fn config_u32(field: &u32) -> u32 {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(field) }
}

/// The head of the record, copied into this CPU's scratch slot with one helper call
/// (`None` if the copy fails: then [`field`] reads each field itself).
#[inline(always)]
fn record_head(ctx: &TracePointContext) -> Option<*const u8> {
    let head = KERNEL_RECORD_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: bpf_probe_read_kernel checks the source; the destination is this CPU's
    // slot of RECORD_HEAD bytes. The record lives in the tracing buffer, which holds
    // at least RECORD_HEAD bytes past its start.
    let copied = unsafe {
        aya_ebpf::helpers::generated::bpf_probe_read_kernel(
            head.cast(),
            RECORD_HEAD as u32,
            ctx.as_ptr(),
        )
    };
    (copied == 0).then_some(head.cast_const().cast())
}

/// Reads one field from the copied head of the record, or from the record itself when
/// there is no copy; `None` when the event lacks the field.
#[inline(always)]
fn head_field(ctx: &TracePointContext, head: Option<*const u8>, field: FieldRef) -> Option<u64> {
    let Some(head) = head else {
        return self::field(ctx, field);
    };
    let offset = field.offset as usize;
    if offset > RECORD_HEAD - 8 {
        return self::field(ctx, field);
    }
    // SAFETY: `offset + 8 <= RECORD_HEAD` bytes of this CPU's slot; the format file
    // places fields at their natural alignment.
    unsafe {
        match field.size {
            8 => Some(core::ptr::read(head.add(offset).cast::<u64>())),
            4 => Some(u64::from(core::ptr::read(head.add(offset).cast::<u32>()))),
            _ => None,
        }
    }
}

/// Reads one field of the record, `None` when the event lacks it.
#[inline(always)]
fn field(ctx: &TracePointContext, field: FieldRef) -> Option<u64> {
    let offset = field.offset as usize;
    // SAFETY: read_at reads kernel memory through bpf_probe_read_kernel, which checks it.
    unsafe {
        match field.size {
            8 => ctx.read_at::<u64>(offset).ok(),
            4 => ctx.read_at::<u32>(offset).ok().map(u64::from),
            _ => None,
        }
    }
}

/// Reads the `__data_loc` string `name` of the record into `out` (zero-padded, cut at
/// its size); false when the event has no name.
#[inline(always)]
fn read_cache_name(
    ctx: &TracePointContext,
    head: Option<*const u8>,
    name: FieldRef,
    out: &mut [u8; CACHE_NAME_LEN],
) -> bool {
    let Some(location) = head_field(ctx, head, name) else {
        return false;
    };
    let offset = (location & 0xffff) as usize;
    let source = (ctx.as_ptr() as usize).wrapping_add(offset) as *const u8;
    // SAFETY: bpf_probe_read_kernel_str_bytes checks the kernel address.
    unsafe { bpf_probe_read_kernel_str_bytes(source, out) }.is_ok()
}

/// The hash of a cache name (its words, zero-padded), never 0.
#[inline(always)]
fn name_hash(name: &[u8; CACHE_NAME_LEN]) -> u64 {
    let mut hash = HASH_MULTIPLIER;
    for word in name.as_chunks::<8>().0 {
        hash = (hash ^ u64::from_le_bytes(*word)).wrapping_mul(HASH_MULTIPLIER);
        hash ^= hash >> 29;
    }
    hash | 1
}

/// The [`name_hash`] of the `__data_loc` string at `location` (offset in the low 16
/// bits, length with its NUL in the high 16) computed from the record's copied head,
/// as it would be of the name read into a zeroed `[u8; CACHE_NAME_LEN]` (at most
/// `CACHE_NAME_LEN - 1` characters); `None` when the name is not wholly in the copy.
#[inline(always)]
fn head_name_hash(head: *const u8, location: u64) -> Option<u64> {
    let offset = (location & 0xffff) as usize;
    if offset > RECORD_HEAD - CACHE_NAME_LEN || !offset.is_multiple_of(8) {
        return None;
    }
    let kept = ((location >> 16) & 0xffff)
        .saturating_sub(1)
        .min(CACHE_NAME_LEN as u64 - 1);
    let mut hash = HASH_MULTIPLIER;
    for i in 0..CACHE_NAME_LEN / 8 {
        let start = 8 * i as u64;
        // SAFETY: `offset + CACHE_NAME_LEN <= RECORD_HEAD` bytes of this CPU's slot,
        // 8-byte aligned.
        let word = unsafe { core::ptr::read(head.add(offset + 8 * i).cast::<u64>()) };
        let mask = if kept >= start + 8 {
            u64::MAX
        } else if kept <= start {
            0
        } else {
            (1u64 << (8 * (kept - start))) - 1
        };
        hash = (hash ^ (word & mask)).wrapping_mul(HASH_MULTIPLIER);
        hash ^= hash >> 29;
    }
    Some(hash | 1)
}

/// The class of a `kmem_cache_alloc` site: the hash of its cache's name (0: the
/// event has none), from the record's copied head where the name lies in it.
#[inline(always)]
fn cache_class(ctx: &TracePointContext, head: Option<*const u8>, name: FieldRef) -> u64 {
    let Some(location) = head_field(ctx, head, name) else {
        return 0;
    };
    if let Some(head) = head
        && let Some(hash) = head_name_hash(head, location)
    {
        return hash;
    }
    let mut cache_name = [0u8; CACHE_NAME_LEN];
    if read_cache_name(ctx, head, name, &mut cache_name) {
        name_hash(&cache_name)
    } else {
        0
    }
}

/// Whether allocations made in the current context count.
#[inline(always)]
fn counted(tgid: u32) -> bool {
    let ignore = config_u32(&KERNEL_CONFIG.ignore_tgid);
    if ignore != 0 && tgid == ignore {
        return false;
    }
    // SAFETY: a plain global, read as `config_u32` reads them.
    let cgroup = unsafe { core::ptr::read_volatile(&KERNEL_CONFIG.cgroup_id) };
    if !crate::maps::in_cgroup(cgroup, config_u32(&KERNEL_CONFIG.cgroup_level)) {
        return false;
    }
    if config_u32(&KERNEL_CONFIG.filter_processes) == 0 {
        return true;
    }
    // The process of this CPU's last counted allocation: a process stays in TRACED
    // once added, so it counts again without the hash lookup.
    let last = LAST_TRACED.get_ptr_mut(0);
    // SAFETY: this CPU's slot.
    let last_tgid = last.map_or(0, |last| unsafe { *last });
    if last_tgid == tgid && tgid != 0 {
        return true;
    }
    // SAFETY: a lookup whose value is not used.
    let traced = unsafe { TRACED.get(&tgid) }.is_some();
    if traced && let Some(last) = last {
        // SAFETY: this CPU's slot.
        unsafe { *last = tgid };
    }
    traced
}

/// Takes the kernel stack into the per-CPU scratch slot; returns its hash (0: no stack).
#[inline(always)]
fn take_stack(ctx: &TracePointContext) -> (u64, Option<&'static KernelStack>) {
    let Some(scratch) = KERNEL_STACK_SCRATCH.get_ptr_mut(0) else {
        return (0, None);
    };
    // SAFETY: this CPU's slot; tracing programs on one CPU do not nest.
    let stack = unsafe { &mut *scratch };
    let size = (MAX_KERNEL_STACK_DEPTH * 8) as u32;
    // SAFETY: the buffer is `size` bytes of map memory; flags 0 asks for the kernel stack.
    let copied = unsafe { bpf_get_stack(ctx.as_ptr(), stack.frames.as_mut_ptr().cast(), size, 0) };
    if copied <= 0 {
        count_kernel_drop(DropReason::StackUnavailable);
        return (0, None);
    }
    let len = (copied as usize / 8).min(MAX_KERNEL_STACK_DEPTH);
    stack.len = len as u32;
    if len == MAX_KERNEL_STACK_DEPTH {
        count_kernel_drop(DropReason::StackTruncated);
    }
    let mut hash = HASH_MULTIPLIER;
    for i in 0..MAX_KERNEL_STACK_DEPTH {
        if i >= stack.len as usize {
            break;
        }
        hash = (hash ^ stack.frames[i]).wrapping_mul(HASH_MULTIPLIER);
        hash ^= hash >> 29;
    }
    (hash | u64::from(hash == 0), Some(stack))
}

/// The index of `site`, giving it one (and storing its stack, its cache's name and
/// its process's name) on first use; `None` when the site table is full.
#[inline(always)]
fn site_id(
    site: &KernelSiteKey,
    new_stack: Option<&KernelStack>,
    cache_name: Option<(&TracePointContext, Option<*const u8>, FieldRef)>,
) -> Option<SiteId> {
    // SAFETY: a plain value copied out of the map.
    if let Some(id) = unsafe { KERNEL_SITES.get(site) } {
        return Some(*id);
    }
    if let Some((ctx, head, name)) = cache_name {
        // Read only for a new site; shared by every site of the cache: the first one
        // stores it.
        let mut bytes = [0u8; CACHE_NAME_LEN];
        if read_cache_name(ctx, head, name, &mut bytes) {
            let _ = CACHE_NAMES.insert(&site.class, &bytes, BPF_NOEXIST as u64);
        }
    }
    if let Some(stack) = new_stack {
        match KERNEL_STACKS.insert(&site.stack, stack, BPF_NOEXIST as u64) {
            Ok(()) => {}
            Err(err) if err == -EEXIST => {}
            Err(_) => count_kernel_drop(DropReason::StackTableFull),
        }
    }
    if let Ok(comm) = bpf_get_current_comm() {
        let _ = COMMS.insert(&site.tgid, &comm, 0);
    }
    // None: every index is handed out (the table is full).
    let id = KERNEL_SITE_IDS.pop().ok().flatten()?;
    if KERNEL_SITES.insert(site, &id, BPF_NOEXIST as u64).is_ok() {
        return Some(id);
    }
    // Another CPU gave it one meanwhile: this index goes back.
    let _ = KERNEL_SITE_IDS.push(&id, 0);
    // SAFETY: as above.
    unsafe { KERNEL_SITES.get(site) }.copied()
}

/// Adds `delta` to the counters of site `id`.
#[inline(always)]
fn add_to_site(id: SiteId, delta: &KernelCounters) {
    if let Some(counters) = KERNEL_SITE_COUNTERS.get_ptr_mut(id) {
        // SAFETY: this CPU's copy of a per-CPU value; programs on one CPU do not
        // interleave.
        unsafe {
            (*counters).alloc_objects += delta.alloc_objects;
            (*counters).alloc_bytes += delta.alloc_bytes;
            (*counters).alloc_requested += delta.alloc_requested;
            (*counters).free_objects += delta.free_objects;
            (*counters).free_bytes += delta.free_bytes;
            (*counters).free_requested += delta.free_requested;
        }
    }
}

/// Credits the free of an object of site `site` with `sizes` ([`pack_sizes`]).
#[inline(always)]
fn credit_free(site: SiteId, sizes: u64) {
    let (bytes, requested) = unpack_sizes(sizes);
    add_to_site(
        site,
        &KernelCounters {
            free_objects: 1,
            free_bytes: bytes,
            free_requested: requested,
            ..KernelCounters::default()
        },
    );
}

/// The slot of [`KERNEL_LIVE_FILTER`] that counts `key`'s entry, when sampling.
#[inline(always)]
fn filter_slot(key: &KernelLiveKey) -> Option<*mut u32> {
    if config_u64(&KERNEL_CONFIG.sample_rate) == 0 {
        return None;
    }
    let hash = (key.addr ^ u64::from(key.space)).wrapping_mul(HASH_MULTIPLIER);
    KERNEL_LIVE_FILTER.get_ptr_mut((hash >> 48) as u32 % LIVE_FILTER_SLOTS)
}

/// Counts an entry added to (`1`) or removed from (`u32::MAX`, minus one) `KERNEL_LIVE`
/// in its filter slot, when sampling.
#[inline(always)]
fn count_in_filter(key: &KernelLiveKey, delta: u32) {
    if let Some(slot) = filter_slot(key) {
        // SAFETY: a slot of the array, only changed atomically.
        unsafe { add_32(slot, delta) };
    }
}

/// The address an object is recorded at in `LIVE`: a slab object's own, a page's
/// frame number shifted as if it were an address (the table's homes cover 32 bytes:
/// unshifted, 32 neighbouring pages would share one home of 9 slots).
#[inline(always)]
fn array_address(addr: u64, space: KernelSpace) -> u64 {
    match space {
        KernelSpace::Slab => addr,
        KernelSpace::Pages => addr << 12,
    }
}

/// Credits the free of a tracked object (`addr` in `space`) to the site that
/// allocated it; untracked objects (allocated before tracing, or not counted) are
/// ignored. Returns whether the object was tracked.
#[inline(always)]
fn release<const ARRAY: bool>(addr: u64, space: KernelSpace) -> bool {
    let key = KernelLiveKey {
        addr,
        space: space as u32,
        _pad: 0,
    };
    if let Some(slot) = filter_slot(&key)
        // SAFETY: a slot of the array; a plain read of a counter changed atomically.
        && unsafe { core::ptr::read_volatile(slot) } == 0
    {
        return false;
    }
    if ARRAY {
        // None also when another CPU freed it first: counted once.
        let Some(entry) = live::zeroed::remove(key.space, array_address(addr, space)) else {
            return false;
        };
        count_in_filter(&key, u32::MAX);
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
    count_in_filter(&key, u32::MAX);
    credit_free(block.site, block.sizes);
    true
}

#[inline(always)]
fn on_alloc<const ARRAY: bool>(ctx: &TracePointContext, event: KernelEvent) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if !counted(tgid) {
        return 0;
    }
    let layout = layout(event);
    let head = record_head(ctx);
    let Some(addr) = head_field(ctx, head, layout.ptr) else {
        return 0;
    };
    let (space, kind, bytes, requested, call_site, class) = match event.allocates() {
        Some(KernelAllocKind::Pages) => {
            // A failed page allocation reports pfn -1.
            if addr == u64::MAX || (layout.ptr.size == 4 && addr == u64::from(u32::MAX)) {
                return 0;
            }
            let order = head_field(ctx, head, layout.order).unwrap_or(0);
            if order >= 32 {
                return 0;
            }
            let bytes = config_u64(&KERNEL_CONFIG.page_size) << order;
            if !sampled_at(bytes, config_u64(&KERNEL_CONFIG.sample_rate)) {
                return 0;
            }
            (
                KernelSpace::Pages,
                KernelAllocKind::Pages,
                bytes,
                bytes,
                0,
                order,
            )
        }
        Some(kind) => {
            if addr == 0 {
                return 0; // failed allocation
            }
            let bytes = head_field(ctx, head, layout.bytes_alloc).unwrap_or(0);
            // Sampling is decided before anything else is read (the cache's name), and
            // before the stack is taken: a skipped allocation costs the draw only, and
            // its free finds nothing in LIVE.
            if !sampled_at(bytes, config_u64(&KERNEL_CONFIG.sample_rate)) {
                return 0;
            }
            let requested = head_field(ctx, head, layout.bytes_req).unwrap_or(bytes);
            let call_site = head_field(ctx, head, layout.call_site).unwrap_or(0);
            let class = match kind {
                KernelAllocKind::KmemCacheAlloc => cache_class(ctx, head, layout.name),
                _ => bytes,
            };
            (KernelSpace::Slab, kind, bytes, requested, call_site, class)
        }
        None => return 0,
    };
    let (stack_hash, stack) = take_stack(ctx);
    let site = KernelSiteKey {
        tgid,
        kind: kind as u32,
        stack: stack_hash,
        call_site,
        class,
    };
    let named = kind == KernelAllocKind::KmemCacheAlloc && class != 0;
    let Some(id) = site_id(&site, stack, named.then_some((ctx, head, layout.name))) else {
        count_kernel_drop(DropReason::SiteTableFull);
        return 0;
    };
    add_to_site(
        id,
        &KernelCounters {
            alloc_objects: 1,
            alloc_bytes: bytes,
            alloc_requested: requested,
            ..KernelCounters::default()
        },
    );
    let key = KernelLiveKey {
        addr,
        space: space as u32,
        _pad: 0,
    };
    let block = KernelLiveBlock {
        site: id,
        _pad: 0,
        sizes: pack_sizes(bytes, requested),
    };
    if ARRAY {
        let entry = LiveEntry {
            ptr: array_address(addr, space),
            size: block.sizes,
            tgid: key.space,
            site: id,
        };
        match live::zeroed::insert(entry.tgid, &entry) {
            Inserted::New => count_in_filter(&key, 1),
            // Still recorded at this address: it was freed on a path without a
            // tracepoint (bulk frees). Closed so its site's in-use stays right; the
            // filter's count stands for the new entry.
            Inserted::Replaced(old) => credit_free(old.site, old.size),
            Inserted::Full => {
                // Its free cannot be matched: released now, so in-use stays what is
                // tracked.
                count_kernel_drop(DropReason::LiveTableFull);
                credit_free(id, block.sizes);
            }
        }
        return 0;
    }
    let mut inserted = KERNEL_LIVE.insert(&key, &block, BPF_NOEXIST as u64);
    if inserted == Err(-EEXIST) {
        // Still recorded at this address: it was freed on a path without a tracepoint
        // (bulk frees). Closed so its site's in-use stays right.
        let _ = release::<false>(addr, space);
        inserted = KERNEL_LIVE.insert(&key, &block, BPF_NOEXIST as u64);
    }
    if inserted.is_ok() {
        count_in_filter(&key, 1);
    } else {
        // Its free cannot be matched: released now, so in-use stays what is tracked.
        count_kernel_drop(DropReason::LiveTableFull);
        credit_free(id, block.sizes);
    }
    0
}

#[inline(always)]
fn on_free<const ARRAY: bool>(
    ctx: &TracePointContext,
    event: KernelEvent,
    space: KernelSpace,
) -> u32 {
    // Frees count in every context: an object often dies in another process, an RCU
    // callback or a worker.
    let Some(addr) = field(ctx, layout(event).ptr) else {
        return 0;
    };
    if addr == 0 && matches!(space, KernelSpace::Slab) {
        return 0;
    }
    let _ = release::<ARRAY>(addr, space);
    0
}

#[tracepoint]
pub fn kmalloc(ctx: TracePointContext) -> u32 {
    on_alloc::<true>(&ctx, KernelEvent::Kmalloc)
}

/// [`kmalloc`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[tracepoint]
pub fn kmalloc_hashed(ctx: TracePointContext) -> u32 {
    on_alloc::<false>(&ctx, KernelEvent::Kmalloc)
}

#[tracepoint]
pub fn kmalloc_node(ctx: TracePointContext) -> u32 {
    on_alloc::<true>(&ctx, KernelEvent::KmallocNode)
}

/// [`kmalloc_node`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[tracepoint]
pub fn kmalloc_node_hashed(ctx: TracePointContext) -> u32 {
    on_alloc::<false>(&ctx, KernelEvent::KmallocNode)
}

#[tracepoint]
pub fn kmem_cache_alloc(ctx: TracePointContext) -> u32 {
    on_alloc::<true>(&ctx, KernelEvent::KmemCacheAlloc)
}

/// [`kmem_cache_alloc`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[tracepoint]
pub fn kmem_cache_alloc_hashed(ctx: TracePointContext) -> u32 {
    on_alloc::<false>(&ctx, KernelEvent::KmemCacheAlloc)
}

#[tracepoint]
pub fn kmem_cache_alloc_node(ctx: TracePointContext) -> u32 {
    on_alloc::<true>(&ctx, KernelEvent::KmemCacheAllocNode)
}

/// [`kmem_cache_alloc_node`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[tracepoint]
pub fn kmem_cache_alloc_node_hashed(ctx: TracePointContext) -> u32 {
    on_alloc::<false>(&ctx, KernelEvent::KmemCacheAllocNode)
}

#[tracepoint]
pub fn mm_page_alloc(ctx: TracePointContext) -> u32 {
    on_alloc::<true>(&ctx, KernelEvent::PageAlloc)
}

/// [`mm_page_alloc`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[tracepoint]
pub fn mm_page_alloc_hashed(ctx: TracePointContext) -> u32 {
    on_alloc::<false>(&ctx, KernelEvent::PageAlloc)
}

#[tracepoint]
pub fn kfree(ctx: TracePointContext) -> u32 {
    on_free::<true>(&ctx, KernelEvent::Kfree, KernelSpace::Slab)
}

/// [`kfree`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[tracepoint]
pub fn kfree_hashed(ctx: TracePointContext) -> u32 {
    on_free::<false>(&ctx, KernelEvent::Kfree, KernelSpace::Slab)
}

#[tracepoint]
pub fn kmem_cache_free(ctx: TracePointContext) -> u32 {
    on_free::<true>(&ctx, KernelEvent::KmemCacheFree, KernelSpace::Slab)
}

/// [`kmem_cache_free`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[tracepoint]
pub fn kmem_cache_free_hashed(ctx: TracePointContext) -> u32 {
    on_free::<false>(&ctx, KernelEvent::KmemCacheFree, KernelSpace::Slab)
}

/// The object each first copy of a raw free program is freeing on this CPU, by
/// [`RawFree`]: the second copy, which runs right after it on every event, passes
/// over that one and frees the others (events the kernel skipped the first for).
#[map(name = "KERNEL_FREE_SEEN")]
static KERNEL_FREE_SEEN: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);

/// The raw free programs' slots in [`KERNEL_FREE_SEEN`].
#[derive(Clone, Copy)]
enum RawFree {
    Kfree = 0,
    KmemCacheFree = 1,
}

/// `kmem:kfree` as a raw tracepoint: `ptr` is its second argument.
#[raw_tracepoint(tracepoint = "kfree")]
pub fn kfree_raw(ctx: RawTracePointContext) -> i32 {
    first_free::<true>(ctx.arg::<u64>(1), RawFree::Kfree);
    0
}

/// [`kfree_raw`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[raw_tracepoint(tracepoint = "kfree")]
pub fn kfree_raw_hashed(ctx: RawTracePointContext) -> i32 {
    first_free::<false>(ctx.arg::<u64>(1), RawFree::Kfree);
    0
}

/// The second copy of [`kfree_raw`].
#[raw_tracepoint(tracepoint = "kfree")]
pub fn kfree_raw_nested(ctx: RawTracePointContext) -> i32 {
    nested_free::<true>(ctx.arg::<u64>(1), RawFree::Kfree);
    0
}

/// [`kfree_raw_nested`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[raw_tracepoint(tracepoint = "kfree")]
pub fn kfree_raw_nested_hashed(ctx: RawTracePointContext) -> i32 {
    nested_free::<false>(ctx.arg::<u64>(1), RawFree::Kfree);
    0
}

/// `kmem:kmem_cache_free` as a raw tracepoint: `ptr` is its second argument.
#[raw_tracepoint(tracepoint = "kmem_cache_free")]
pub fn kmem_cache_free_raw(ctx: RawTracePointContext) -> i32 {
    first_free::<true>(ctx.arg::<u64>(1), RawFree::KmemCacheFree);
    0
}

/// [`kmem_cache_free_raw`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[raw_tracepoint(tracepoint = "kmem_cache_free")]
pub fn kmem_cache_free_raw_hashed(ctx: RawTracePointContext) -> i32 {
    first_free::<false>(ctx.arg::<u64>(1), RawFree::KmemCacheFree);
    0
}

/// The second copy of [`kmem_cache_free_raw`].
#[raw_tracepoint(tracepoint = "kmem_cache_free")]
pub fn kmem_cache_free_raw_nested(ctx: RawTracePointContext) -> i32 {
    nested_free::<true>(ctx.arg::<u64>(1), RawFree::KmemCacheFree);
    0
}

/// [`kmem_cache_free_raw_nested`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[raw_tracepoint(tracepoint = "kmem_cache_free")]
pub fn kmem_cache_free_raw_nested_hashed(ctx: RawTracePointContext) -> i32 {
    nested_free::<false>(ctx.arg::<u64>(1), RawFree::KmemCacheFree);
    0
}

/// The first copy: notes the object, then frees it.
#[inline(always)]
fn first_free<const ARRAY: bool>(addr: u64, slot: RawFree) {
    if let Some(seen) = KERNEL_FREE_SEEN.get_ptr_mut(slot as u32) {
        // SAFETY: this CPU's slot; written before the free, so a nested event sees it.
        unsafe { *seen = addr };
    }
    release_slab_ptr::<ARRAY>(addr);
}

/// The second copy: frees the object unless the first copy is freeing it.
#[inline(always)]
fn nested_free<const ARRAY: bool>(addr: u64, slot: RawFree) {
    if let Some(seen) = KERNEL_FREE_SEEN.get_ptr(slot as u32)
        // SAFETY: this CPU's slot.
        && unsafe { *seen } == addr
    {
        return;
    }
    release_slab_ptr::<ARRAY>(addr);
}

/// Releases the slab object a free event names (0 is ignored).
#[inline(always)]
fn release_slab_ptr<const ARRAY: bool>(addr: u64) {
    if addr != 0 {
        let _ = release::<ARRAY>(addr, KernelSpace::Slab);
    }
}

#[tracepoint]
pub fn mm_page_free(ctx: TracePointContext) -> u32 {
    on_free::<true>(&ctx, KernelEvent::PageFree, KernelSpace::Pages)
}

/// [`mm_page_free`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[tracepoint]
pub fn mm_page_free_hashed(ctx: TracePointContext) -> u32 {
    on_free::<false>(&ctx, KernelEvent::PageFree, KernelSpace::Pages)
}

#[tracepoint]
pub fn mm_page_free_batched(ctx: TracePointContext) -> u32 {
    on_free::<true>(&ctx, KernelEvent::PageFreeBatched, KernelSpace::Pages)
}

/// [`mm_page_free_batched`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[tracepoint]
pub fn mm_page_free_batched_hashed(ctx: TracePointContext) -> u32 {
    on_free::<false>(&ctx, KernelEvent::PageFreeBatched, KernelSpace::Pages)
}

/// The most objects one bulk free can release here (`bpf_loop`'s bound; the kernel's
/// own batches hold at most a page of pointers).
const MAX_BULK_OBJECTS: u32 = 1 << 16;

/// Releases the slab object at `addr` (0 is ignored) and counts it for `path` when
/// it was tracked.
#[inline(always)]
fn release_slab<const ARRAY: bool>(addr: u64, path: DeferredFreePath) {
    if addr == 0 {
        return;
    }
    if release::<ARRAY>(addr, KernelSpace::Slab)
        && let Some(count) = KERNEL_DEFERRED_FREES.get_ptr_mut(path as u32)
    {
        // SAFETY: this CPU's slot of a per-CPU array.
        unsafe { *count += 1 };
    }
}

/// Argument `n` of the traced function, as a raw 64-bit value (0 if unreadable).
///
/// Not `FEntryContext::arg`: a direct read of the context is checked against the
/// argument's BTF type, and the verifier refuses pointers to anything but a struct
/// (`arg1 type FUNC_PROTO is not a struct`, `arg2 type PTR is not a struct`).
#[inline(always)]
fn raw_arg(ctx: &FEntryContext, n: u32) -> u64 {
    let mut value = 0u64;
    if config_u32(&KERNEL_CONFIG.func_args) == FuncArgs::SavedArray as u32 {
        // The context is the array of the arguments the trampoline saved.
        let slot = (ctx.as_ptr() as *const u64).wrapping_add(n as usize);
        // SAFETY: bpf_probe_read_kernel checks the address.
        return unsafe { bpf_probe_read_kernel(slot) }.unwrap_or(0);
    }
    // SAFETY: the helper writes one u64 into `value`, or fails on an index beyond the
    // function's arguments.
    if unsafe { bpf_get_func_arg(ctx.as_ptr(), n, &mut value) } != 0 {
        return 0;
    }
    value
}

/// `kvfree_call_rcu(head, arg)`, which `kfree_rcu()` and `kvfree_rcu()` call: the
/// owner releases the object, which the kernel frees after a grace period, often in a
/// bulk free that fires no per-object tracepoint. It is freed for the profile now (its
/// address cannot be handed out again before the real free). Which object `arg`
/// names differs by kernel version: see [`rcu_freed_object`].
#[fentry(function = "kvfree_call_rcu")]
pub fn rcu_free(ctx: FEntryContext) -> u32 {
    let object = rcu_freed_object(raw_arg(&ctx, 0), raw_arg(&ctx, 1));
    release_slab::<true>(object, DeferredFreePath::Rcu);
    0
}

/// [`rcu_free`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[fentry(function = "kvfree_call_rcu")]
pub fn rcu_free_hashed(ctx: FEntryContext) -> u32 {
    let object = rcu_freed_object(raw_arg(&ctx, 0), raw_arg(&ctx, 1));
    release_slab::<false>(object, DeferredFreePath::Rcu);
    0
}

/// `kmem_cache_free_bulk(cache, count, pointers)` (also `kfree_bulk`, an inline call
/// of it): every object of the array is freed, with no per-object tracepoint.
#[fentry(function = "kmem_cache_free_bulk")]
pub fn bulk_free(ctx: FEntryContext) -> u32 {
    free_bulk(raw_arg(&ctx, 1), raw_arg(&ctx, 2));
    0
}

/// [`rcu_free`] as a kprobe, where fentry cannot be used (no BTF, or no BPF
/// trampolines): the arguments come from the registers.
#[kprobe(function = "kvfree_call_rcu")]
pub fn rcu_free_kprobe(ctx: ProbeContext) -> u32 {
    let head = ctx.arg::<u64>(0).unwrap_or(0);
    let arg = ctx.arg::<u64>(1).unwrap_or(0);
    release_slab::<true>(rcu_freed_object(head, arg), DeferredFreePath::Rcu);
    0
}

/// [`rcu_free_kprobe`] for kernels before 5.12 (see `KERNEL_LIVE`).
#[kprobe(function = "kvfree_call_rcu")]
pub fn rcu_free_kprobe_hashed(ctx: ProbeContext) -> u32 {
    let head = ctx.arg::<u64>(0).unwrap_or(0);
    let arg = ctx.arg::<u64>(1).unwrap_or(0);
    release_slab::<false>(rcu_freed_object(head, arg), DeferredFreePath::Rcu);
    0
}

/// [`bulk_free`] as a kprobe.
#[kprobe(function = "kmem_cache_free_bulk")]
pub fn bulk_free_kprobe(ctx: ProbeContext) -> u32 {
    free_bulk(
        ctx.arg::<u64>(1).unwrap_or(0),
        ctx.arg::<u64>(2).unwrap_or(0),
    );
    0
}

/// Frees the `count` objects of the pointer array at `pointers`.
#[inline(always)]
fn free_bulk(count: u64, pointers: u64) {
    let count = count.min(u64::from(MAX_BULK_OBJECTS)) as u32;
    let mut pointers = pointers;
    if pointers == 0 || count == 0 {
        return;
    }
    // SAFETY: the callback takes the context pointer given here, valid for the call.
    unsafe {
        bpf_loop(
            count,
            release_bulk_entry as *mut c_void,
            (&raw mut pointers).cast(),
            0,
        );
    }
}

/// `bpf_loop`'s callback: releases entry `index` of the pointer array at `*context`.
extern "C" fn release_bulk_entry(index: u64, context: *mut c_void) -> i64 {
    // SAFETY: the context is the array address `bulk_free` passed.
    let array = unsafe { *context.cast::<u64>() };
    let entry = array.wrapping_add(index.wrapping_mul(8));
    // SAFETY: bpf_probe_read_kernel checks the kernel address.
    match unsafe { bpf_probe_read_kernel(entry as *const u64) } {
        Ok(addr) => {
            // bpf_loop (5.17+) implies the array's atomic instructions (5.12+).
            release_slab::<true>(addr, DeferredFreePath::Bulk);
            0
        }
        Err(_) => 1,
    }
}

/// A launched command's children count as the command: a traced process's fork
/// adds the child to `TRACED`.
#[tracepoint]
pub fn sched_process_fork(ctx: TracePointContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // SAFETY: a lookup whose value is not used.
    if unsafe { TRACED.get(&tgid) }.is_none() {
        return 0;
    }
    if let Some(child) = field(&ctx, layout(KernelEvent::ProcessFork).ptr) {
        let _ = TRACED.insert(&(child as u32), &1, 0);
    }
    0
}
