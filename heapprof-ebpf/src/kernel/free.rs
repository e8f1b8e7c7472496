//! The free programs: slab frees on raw tracepoints, each with a second copy that
//! frees what the kernel skipped the first for, their tracepoint forms where raw
//! tracepoints cannot be used, and the page frees.

use aya_ebpf::{
    macros::{map, raw_tracepoint, tracepoint},
    maps::PerCpuArray,
    programs::{RawTracePointContext, TracePointContext},
};
use heapprof_common::kernel::{KernelEvent, KernelSpace};

use super::{config::layout, live_objects::release, record::field};

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
