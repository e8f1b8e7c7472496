//! The user stack of an allocation, taken at the allocator's return.

use aya_ebpf::programs::RetProbeContext;
use heapprof_common::{ProbeSlot, StackKey, UserStack};

use crate::{
    maps::{STACK_SCRATCH, unwind_mode},
    regs, unwind,
};

/// Unwinds the caller's stack (of thread `pid_tgid`, in its process's image
/// `exec_gen`) into the per-CPU scratch stack and hashes it with the process id;
/// returns the site key and the stack (stored with the site when the site is new). At
/// the return the caller's frame is intact, so its return address is the first frame
/// and its registers the unwinder's starting point.
#[inline(always)]
pub fn record_stack(
    ctx: &RetProbeContext,
    pid_tgid: u64,
    exec_gen: u32,
    slot: ProbeSlot,
) -> Option<(StackKey, &'static UserStack)> {
    let tgid = (pid_tgid >> 32) as u32;
    let scratch = STACK_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's scratch slot; programs on one CPU do not interleave.
    let stack = unsafe { &mut *scratch };
    let hash = unwind::unwind(
        pid_tgid,
        exec_gen,
        unwind_mode(),
        regs::at_return(ctx),
        stack,
        false,
    );
    let site = StackKey {
        tgid,
        exec_gen,
        stack: hash,
        slot,
        _pad: 0,
    };
    Some((site, stack))
}
