//! Allocation sites: the kernel stack taken and hashed, each site's index (handed out
//! from a queue the daemon fills), its per-CPU counters, and what a new site stores
//! once (its stack, its cache's name, its process's name).

use aya_ebpf::{
    EbpfContext as _,
    bindings::{BPF_F_NO_PREALLOC, BPF_NOEXIST},
    helpers::{bpf_get_current_comm, generated::bpf_get_stack},
    macros::map,
    maps::{HashMap, PerCpuArray, Queue},
    programs::TracePointContext,
};
use heapprof_common::{
    DropReason, SiteId,
    kernel::{
        CACHE_NAME_LEN, FieldRef, KernelCounters, KernelSiteKey, KernelStack,
        MAX_KERNEL_STACK_DEPTH, site_cache_slot, unpack_sizes,
    },
};

use super::{
    config::{EEXIST, HASH_MULTIPLIER},
    record::read_cache_name,
};
use crate::maps::count_kernel_drop;

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
/// A site's index as cached in [`KERNEL_SITE_CACHE`].
#[repr(C)]
#[derive(Clone, Copy)]
struct CachedSite {
    site: KernelSiteKey,
    id: SiteId,
    /// 0 until the slot is first written (a zeroed key is a possible site).
    filled: u32,
}

/// Each CPU's recent sites by [`site_cache_slot`], direct-mapped: a hit costs an
/// inlined array lookup and a compare instead of `KERNEL_SITES`' hash lookup (a hash
/// of the 32-byte key, a bucket walk, a `memcmp`, often cache misses in a table sized
/// for every site). Indices are never reused, so a cached index stays right. One
/// entry here: the kernel-mode loader sizes it (user mode does not use it).
#[map(name = "KERNEL_SITE_CACHE")]
static KERNEL_SITE_CACHE: PerCpuArray<CachedSite> = PerCpuArray::with_max_entries(1, 0);

// Written only when a site is new: allocated on demand, as the user-mode stacks.
#[map(name = "KERNEL_STACKS")]
static KERNEL_STACKS: HashMap<u64, KernelStack> =
    HashMap::with_max_entries(32768, BPF_F_NO_PREALLOC);
#[map(name = "KERNEL_STACK_SCRATCH")]
static KERNEL_STACK_SCRATCH: PerCpuArray<KernelStack> = PerCpuArray::with_max_entries(1, 0);

// Written only when a site is new.
#[map(name = "CACHE_NAMES")]
static CACHE_NAMES: HashMap<u64, [u8; CACHE_NAME_LEN]> =
    HashMap::with_max_entries(4096, BPF_F_NO_PREALLOC);

#[map(name = "COMMS")]
static COMMS: HashMap<u32, [u8; 16]> = HashMap::with_max_entries(65536, 0);

/// Takes the kernel stack into the per-CPU scratch slot; returns its hash (0: no stack).
#[inline(always)]
pub(super) fn take_stack(ctx: &TracePointContext) -> (u64, Option<&'static KernelStack>) {
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
pub(super) fn site_id(
    site: &KernelSiteKey,
    new_stack: Option<&KernelStack>,
    cache_name: Option<(&TracePointContext, Option<*const u8>, FieldRef)>,
) -> Option<SiteId> {
    let cached = KERNEL_SITE_CACHE.get_ptr_mut(site_cache_slot(site));
    if let Some(cached) = cached {
        // SAFETY: this CPU's slot; only the allocation programs use it, and tracing
        // programs on one CPU do not nest.
        let cached = unsafe { &*cached };
        if cached.filled != 0 && same_site(&cached.site, site) {
            return Some(cached.id);
        }
    }
    // SAFETY: a plain value copied out of the map.
    let id = match unsafe { KERNEL_SITES.get(site) } {
        Some(id) => *id,
        None => new_site_id(site, new_stack, cache_name)?,
    };
    if let Some(cached) = cached {
        // SAFETY: as above.
        unsafe {
            *cached = CachedSite {
                site: *site,
                id,
                filled: 1,
            };
        }
    }
    Some(id)
}

/// Field by field: a derived `==` may compile to a `memcmp` call, which BPF lacks.
#[inline(always)]
fn same_site(a: &KernelSiteKey, b: &KernelSiteKey) -> bool {
    a.stack == b.stack
        && a.call_site == b.call_site
        && a.class == b.class
        && a.tgid == b.tgid
        && a.kind == b.kind
}

/// [`site_id`] for a site not in `KERNEL_SITES`.
#[inline(always)]
fn new_site_id(
    site: &KernelSiteKey,
    new_stack: Option<&KernelStack>,
    cache_name: Option<(&TracePointContext, Option<*const u8>, FieldRef)>,
) -> Option<SiteId> {
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
pub(super) fn add_to_site(id: SiteId, delta: &KernelCounters) {
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
pub(super) fn credit_free(site: SiteId, sizes: u64) {
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
