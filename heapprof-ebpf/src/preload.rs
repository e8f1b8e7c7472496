//! The preload library's reports (launch mode's interposer; see
//! `heapprof_common::preload`): one uprobe on its probe site, where each call brings
//! an allocation with the caller's registers, the thread's queued frees, or both.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user_buf},
    macros::uprobe,
    programs::ProbeContext,
};
use heapprof_common::{
    DropReason, StackKey,
    preload::{FREE_QUEUE_LEN, FreeQueue, Kind, Meta, Preloaded},
};

use crate::{
    calls,
    maps::{
        EXEC_GEN, FREE_QUEUES, PRELOADED, QUEUE_SCRATCH, STACK_SCRATCH, armed, count_drop,
        empty_programs, ignored, unwind_mode,
    },
    regs, sites, unwind,
};

/// Applies the first `count` frees of the queue at `queue` (a user address) for
/// process `tgid`. With `with_count`, the count is the queue's own (a thread exiting).
#[inline(always)]
fn apply_frees(tgid: u32, queue: u64, count: u32, with_count: bool) {
    let Some(scratch) = QUEUE_SCRATCH.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's scratch slot; programs on one CPU do not interleave.
    let copy = unsafe { &mut *scratch };
    let len = if with_count {
        size_of::<FreeQueue>()
    } else {
        count as usize * 8
    };
    if len == 0 {
        return;
    }
    // SAFETY: a plain-integer struct viewed as bytes, the length bounded by its size.
    let bytes = unsafe {
        core::slice::from_raw_parts_mut(
            (copy as *mut FreeQueue).cast::<u8>(),
            len.min(size_of::<FreeQueue>()),
        )
    };
    // SAFETY: bpf_probe_read_user_buf checks the user address.
    if unsafe { bpf_probe_read_user_buf(queue as *const u8, bytes) }.is_err() {
        count_drop(DropReason::FreeQueueUnreadable);
        return;
    }
    let count = if with_count { copy.count } else { count }.min(FREE_QUEUE_LEN as u32);
    for index in 0..FREE_QUEUE_LEN {
        if index as u32 >= count {
            break;
        }
        sites::release(tgid, copy.frees[index]);
    }
}

/// Counts the allocation `block` of `size` bytes by preload function `function`,
/// unwinding from the caller's registers.
#[inline(always)]
fn allocated(pid_tgid: u64, function: u32, block: u64, size: u64, caller: (u64, u64, u64)) {
    let tgid = (pid_tgid >> 32) as u32;
    let Some(scratch) = STACK_SCRATCH.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's scratch slot; programs on one CPU do not interleave.
    let stack = unsafe { &mut *scratch };
    // SAFETY: a plain value read out of the map.
    let exec_gen = unsafe { EXEC_GEN.get(&tgid) }.copied().unwrap_or(0);
    let hash = unwind::unwind(pid_tgid, exec_gen, unwind_mode(), caller, stack);
    let site = StackKey {
        tgid,
        exec_gen,
        stack: hash,
        // The library's functions take the first slots.
        slot: function,
        _pad: 0,
    };
    sites::allocated(tgid, block, size, &site, stack);
}

#[inline(always)]
fn on_report(ctx: &ProbeContext) {
    let pid_tgid = bpf_get_current_pid_tgid();
    if ignored(pid_tgid) || !armed() {
        return;
    }
    let tgid = (pid_tgid >> 32) as u32;
    let [block, size, ra, sp, fp, queue, meta] = regs::preload_args(ctx);
    let kind = ((meta >> Meta::KIND_SHIFT) & 0xff) as u32;
    let count = ((meta >> Meta::COUNT_SHIFT) & 0xff) as u32;
    if meta & Meta::REGISTER_QUEUE != 0 && FREE_QUEUES.insert(&pid_tgid, &queue, 0).is_err() {
        count_drop(DropReason::InFlightFull);
    }
    match Kind::from_u32(kind) {
        Some(Kind::Hello) => {
            let code = Preloaded {
                text_start: block,
                text_end: size,
            };
            let _ = PRELOADED.insert(&tgid, &code, 0);
        }
        Some(Kind::Flush) => apply_frees(tgid, queue, count, false),
        Some(Kind::Alloc) => {
            apply_frees(tgid, queue, count, false);
            if calls::report_is_nested(pid_tgid, ra, sp) {
                return;
            }
            let function = (meta & Meta::FUNCTION_MASK) as u32;
            allocated(pid_tgid, function, block, size, (ra, fp, sp));
        }
        None => {}
    }
}

#[uprobe]
pub fn preload_report(ctx: ProbeContext) -> u32 {
    if empty_programs() {
        return 0;
    }
    on_report(&ctx);
    0
}

/// A thread exits: the frees still in its queue are applied (its process's memory is
/// still there at this tracepoint), and its entries go.
#[inline(always)]
pub fn thread_exit(pid_tgid: u64) {
    // SAFETY: a plain value read out of the map.
    let Some(queue) = (unsafe { FREE_QUEUES.get(&pid_tgid) }).copied() else {
        return;
    };
    let _ = FREE_QUEUES.remove(&pid_tgid);
    let tgid = (pid_tgid >> 32) as u32;
    apply_frees(tgid, queue, 0, true);
    if pid_tgid as u32 == tgid {
        let _ = PRELOADED.remove(&tgid);
    }
}
