//! The allocation programs (`kmalloc`, `kmem_cache_alloc`, their `_node` forms,
//! `mm_page_alloc`): the filters and the sampling draw first, then the stack and the
//! site, its counters, and the object recorded until its free.

use aya_ebpf::{
    bindings::BPF_NOEXIST, helpers::bpf_get_current_pid_tgid, macros::tracepoint,
    programs::TracePointContext,
};
use heapprof_common::{
    DropReason, SiteId,
    kernel::{
        EventLayout, FieldRef, KernelAllocKind, KernelCounters, KernelEvent, KernelLiveBlock,
        KernelLiveKey, KernelSiteKey, KernelSpace, pack_sizes,
    },
    live::LiveEntry,
};

use super::{
    config::{EEXIST, KERNEL_CONFIG, config_u64, layout},
    live_objects::{KERNEL_LIVE, array_address, filter_slot, release},
    record::{cache_class, head_field, record_head},
    sites::{add_to_site, credit_free, site_id, take_stack},
    traced::counted,
};
use crate::{
    live::{self, Inserted},
    live_filter,
    maps::count_kernel_drop,
    sampling::sampled_at,
};

/// What an allocation event says of the allocation, once it passed the filters and
/// the sampling draw.
struct Allocation {
    addr: u64,
    space: KernelSpace,
    kind: KernelAllocKind,
    bytes: u64,
    requested: u64,
    call_site: u64,
    /// The site's class: the hash of the cache's name (`kmem_cache_alloc`), the bytes
    /// handed out (kmalloc) or the page order.
    class: u64,
}

#[inline(always)]
fn on_alloc<const ARRAY: bool>(ctx: &TracePointContext, event: KernelEvent) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if !counted(tgid) {
        return 0;
    }
    let layout = layout(event);
    let head = record_head(ctx);
    let Some(alloc) = sampled_allocation(ctx, head, &layout, event) else {
        return 0;
    };
    let Some(id) = site_of(ctx, head, layout.name, tgid, &alloc) else {
        return 0;
    };
    add_to_site(
        id,
        &KernelCounters {
            alloc_objects: 1,
            alloc_bytes: alloc.bytes,
            alloc_requested: alloc.requested,
            ..KernelCounters::default()
        },
    );
    let block = KernelLiveBlock {
        site: id,
        _pad: 0,
        sizes: pack_sizes(alloc.bytes, alloc.requested),
    };
    // Counted before the insert, so that no free finds the object with its slot at 0.
    let filter = filter_slot(alloc.addr, alloc.space);
    live_filter::add(filter, 1);
    if ARRAY {
        record_in_array(&alloc, &block, filter);
    } else {
        record_in_hash(&alloc, &block, filter);
    }
    0
}

/// The allocation the event's record describes, `None` when it failed, is not an
/// allocation event or the sampling draw skips it.
#[inline(always)]
fn sampled_allocation(
    ctx: &TracePointContext,
    head: Option<*const u8>,
    layout: &EventLayout,
    event: KernelEvent,
) -> Option<Allocation> {
    let addr = head_field(ctx, head, layout.ptr)?;
    match event.allocates()? {
        KernelAllocKind::Pages => sampled_pages(ctx, head, layout, addr),
        kind => sampled_slab(ctx, head, layout, addr, kind),
    }
}

/// [`sampled_allocation`] of a page allocation at page frame `addr`.
#[inline(always)]
fn sampled_pages(
    ctx: &TracePointContext,
    head: Option<*const u8>,
    layout: &EventLayout,
    addr: u64,
) -> Option<Allocation> {
    // A failed page allocation reports pfn -1.
    if addr == u64::MAX || (layout.ptr.size == 4 && addr == u64::from(u32::MAX)) {
        return None;
    }
    let order = head_field(ctx, head, layout.order).unwrap_or(0);
    if order >= 32 {
        return None;
    }
    let bytes = config_u64(&KERNEL_CONFIG.page_size) << order;
    if !sampled_at(bytes, config_u64(&KERNEL_CONFIG.sample_rate)) {
        return None;
    }
    Some(Allocation {
        addr,
        space: KernelSpace::Pages,
        kind: KernelAllocKind::Pages,
        bytes,
        requested: bytes,
        call_site: 0,
        class: order,
    })
}

/// [`sampled_allocation`] of a slab allocation (`kind`) at `addr`.
#[inline(always)]
fn sampled_slab(
    ctx: &TracePointContext,
    head: Option<*const u8>,
    layout: &EventLayout,
    addr: u64,
    kind: KernelAllocKind,
) -> Option<Allocation> {
    if addr == 0 {
        return None; // failed allocation
    }
    let bytes = head_field(ctx, head, layout.bytes_alloc).unwrap_or(0);
    // Sampling is decided before anything else is read (the cache's name), and
    // before the stack is taken: a skipped allocation costs the draw only, and
    // its free finds nothing in LIVE.
    if !sampled_at(bytes, config_u64(&KERNEL_CONFIG.sample_rate)) {
        return None;
    }
    let requested = head_field(ctx, head, layout.bytes_req).unwrap_or(bytes);
    let call_site = head_field(ctx, head, layout.call_site).unwrap_or(0);
    let class = match kind {
        KernelAllocKind::KmemCacheAlloc => cache_class(ctx, head, layout.name),
        _ => bytes,
    };
    Some(Allocation {
        addr,
        space: KernelSpace::Slab,
        kind,
        bytes,
        requested,
        call_site,
        class,
    })
}

/// The site of `alloc` in process `tgid`, with the stack taken now (and the cache's
/// name, the record's field `name`, for a named `kmem_cache_alloc` site);
/// `None`, counted as a drop, when the site table is full.
#[inline(always)]
fn site_of(
    ctx: &TracePointContext,
    head: Option<*const u8>,
    name: FieldRef,
    tgid: u32,
    alloc: &Allocation,
) -> Option<SiteId> {
    let (stack_hash, stack) = take_stack(ctx);
    let site = KernelSiteKey {
        tgid,
        kind: alloc.kind as u32,
        stack: stack_hash,
        call_site: alloc.call_site,
        class: alloc.class,
    };
    let named = alloc.kind == KernelAllocKind::KmemCacheAlloc && alloc.class != 0;
    let Some(id) = site_id(&site, stack, named.then_some((ctx, head, name))) else {
        count_kernel_drop(DropReason::SiteTableFull);
        return None;
    };
    Some(id)
}

/// Records the object `alloc` as `block` in the live array (kernels from 5.12 on);
/// `filter` is its live filter slot, already counting it.
#[inline(always)]
fn record_in_array(alloc: &Allocation, block: &KernelLiveBlock, filter: Option<*mut u32>) {
    let entry = LiveEntry {
        ptr: array_address(alloc.addr, alloc.space),
        size: block.sizes,
        tgid: alloc.space as u32,
        site: block.site,
    };
    match live::zeroed::insert(entry.tgid, &entry) {
        Inserted::New => {}
        Inserted::Replaced(old) => {
            // The old entry's count is gone with it (same address, same slot).
            live_filter::add(filter, u32::MAX);
            // Still recorded at this address: it was freed on a path without a
            // tracepoint (bulk frees). Closed so its site's in-use stays right.
            credit_free(old.site, old.size);
        }
        Inserted::Full => {
            // Its free cannot be matched: released now, so in-use stays what is
            // tracked.
            live_filter::add(filter, u32::MAX);
            count_kernel_drop(DropReason::LiveTableFull);
            credit_free(block.site, block.sizes);
        }
    }
}

/// Records the object `alloc` as `block` in `KERNEL_LIVE` (the hash map of kernels
/// before 5.12); `filter` is its live filter slot, already counting it.
#[inline(always)]
fn record_in_hash(alloc: &Allocation, block: &KernelLiveBlock, filter: Option<*mut u32>) {
    let key = KernelLiveKey {
        addr: alloc.addr,
        space: alloc.space as u32,
        _pad: 0,
    };
    let mut inserted = KERNEL_LIVE.insert(&key, block, BPF_NOEXIST as u64);
    if inserted == Err(-EEXIST) {
        // Still recorded at this address: it was freed on a path without a tracepoint
        // (bulk frees). Closed so its site's in-use stays right (and its count taken
        // off the slot, which this object's count keeps above 0 meanwhile).
        let _ = release::<false>(alloc.addr, alloc.space);
        inserted = KERNEL_LIVE.insert(&key, block, BPF_NOEXIST as u64);
    }
    if inserted.is_err() {
        // Its free cannot be matched: released now, so in-use stays what is tracked.
        live_filter::add(filter, u32::MAX);
        count_kernel_drop(DropReason::LiveTableFull);
        credit_free(block.site, block.sizes);
    }
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
