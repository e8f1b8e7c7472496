//! The allocation programs (`kmalloc`, `kmem_cache_alloc`, their `_node` forms,
//! `mm_page_alloc`): the filters and the sampling draw first, then the stack and the
//! site, its counters, and the object recorded until its free.

use aya_ebpf::{
    bindings::BPF_NOEXIST, helpers::bpf_get_current_pid_tgid, macros::tracepoint,
    programs::TracePointContext,
};
use heapprof_common::{
    DropReason,
    kernel::{
        KernelAllocKind, KernelCounters, KernelEvent, KernelLiveBlock, KernelLiveKey,
        KernelSiteKey, KernelSpace, pack_sizes,
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
    // Counted before the insert, so that no free finds the object with its slot at 0.
    let filter = filter_slot(addr, space);
    live_filter::add(filter, 1);
    if ARRAY {
        let entry = LiveEntry {
            ptr: array_address(addr, space),
            size: block.sizes,
            tgid: key.space,
            site: id,
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
                credit_free(id, block.sizes);
            }
        }
        return 0;
    }
    let mut inserted = KERNEL_LIVE.insert(&key, &block, BPF_NOEXIST as u64);
    if inserted == Err(-EEXIST) {
        // Still recorded at this address: it was freed on a path without a tracepoint
        // (bulk frees). Closed so its site's in-use stays right (and its count taken
        // off the slot, which this object's count keeps above 0 meanwhile).
        let _ = release::<false>(addr, space);
        inserted = KERNEL_LIVE.insert(&key, &block, BPF_NOEXIST as u64);
    }
    if inserted.is_err() {
        // Its free cannot be matched: released now, so in-use stays what is tracked.
        live_filter::add(filter, u32::MAX);
        count_kernel_drop(DropReason::LiveTableFull);
        credit_free(id, block.sizes);
    }
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
