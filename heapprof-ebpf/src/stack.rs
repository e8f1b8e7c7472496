//! The user stack of an allocation, taken at the allocator's return.

use aya_ebpf::programs::RetProbeContext;
use heapprof_common::{ProbeSlot, StackKey, UserStack};

use crate::{
    maps::{STACK_SCRATCH, unwind_mode},
    regs, unwind,
    walk_cache::{self, WalkStart},
};

/// The stack of an allocation: its site, and the frames when they were walked now.
pub struct Recorded {
    /// The site: process, image, stack hash and function.
    pub site: StackKey,
    /// The frames (this CPU's scratch stack), `None` when a walk remembered on this CPU
    /// gave the hash: its site is then known, its stack stored with it.
    pub frames: Option<&'static UserStack>,
}

/// Where the walk of the caller's stack at this return starts.
#[inline(always)]
pub fn walk_start(ctx: &RetProbeContext, pid_tgid: u64, exec_gen: u32) -> WalkStart {
    let (pc, fp, sp) = regs::at_return(ctx);
    WalkStart {
        pid_tgid,
        pc,
        fp,
        sp,
        exec_gen,
        _pad: 0,
        epoch: walk_cache::epoch_now(),
    }
}

/// The site of the allocation whose return starts at `start`, by function `slot`, from
/// a walk this CPU remembers (see `walk_cache`), if one still holds.
#[inline(always)]
pub fn remembered(start: &WalkStart, slot: ProbeSlot) -> Option<StackKey> {
    let hash = walk_cache::cached(start)?;
    Some(site_key(start, hash, slot))
}

#[inline(always)]
fn site_key(start: &WalkStart, hash: u64, slot: ProbeSlot) -> StackKey {
    StackKey {
        tgid: (start.pid_tgid >> 32) as u32,
        exec_gen: start.exec_gen,
        stack: hash,
        slot,
        _pad: 0,
    }
}

/// Unwinds the caller's stack from `start` into the per-CPU scratch stack and hashes it
/// with the process id, remembering the walk when it depended only on the registers
/// and the stack words it read. At the return the caller's frame is intact, so its
/// return address is the first frame and its registers the unwinder's starting point.
#[inline(always)]
pub fn walk(start: &WalkStart, slot: ProbeSlot) -> Option<Recorded> {
    let scratch = STACK_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's scratch slot; programs on one CPU do not interleave.
    let stack = unsafe { &mut *scratch };
    let hash = unwind::unwind(
        start.pid_tgid,
        start.exec_gen,
        unwind_mode(),
        (start.pc, start.fp, start.sp),
        stack,
        true,
    );
    walk_cache::remember(start, hash);
    Some(Recorded {
        site: site_key(start, hash, slot),
        frames: Some(stack),
    })
}
