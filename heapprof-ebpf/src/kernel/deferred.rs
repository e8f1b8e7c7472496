//! Frees no per-object tracepoint shows: `kvfree_call_rcu` (`kfree_rcu()`, whose
//! objects the kernel frees later, often in bulk) and `kmem_cache_free_bulk`
//! (`kfree_bulk`), as fentry programs, or kprobes where fentry cannot be used.

use core::ffi::c_void;

use aya_ebpf::{
    EbpfContext as _,
    helpers::{bpf_loop, bpf_probe_read_kernel, generated::bpf_get_func_arg},
    macros::{fentry, kprobe, map},
    maps::PerCpuArray,
    programs::{FEntryContext, ProbeContext},
};
use heapprof_common::kernel::{DeferredFreePath, FuncArgs, KernelSpace, rcu_freed_object};

use super::{
    config::{KERNEL_CONFIG, config_u32},
    live_objects::release,
};

/// Objects each fentry program freed for the profile, by [`DeferredFreePath`].
#[map(name = "KERNEL_DEFERRED_FREES")]
static KERNEL_DEFERRED_FREES: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(DeferredFreePath::COUNT as u32, 0);

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
