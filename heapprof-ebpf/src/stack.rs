//! The user stack of an allocation, taken at the allocator's return.

use aya_ebpf::{helpers::bpf_probe_read_user, programs::RetProbeContext};
use heapprof_common::{
    AllocKind, DropReason, MAX_STACK_DEPTH, MAX_STACK_SPAN, StackKey, UserStack,
};

use crate::{
    maps::{EXEC_GEN, STACK_SCRATCH, count_drop},
    regs,
};

/// Multiplier of the stack hash (2^64 / golden ratio).
const HASH_MULTIPLIER: u64 = 0x9e37_79b9_7f4a_7c15;

/// Walks the caller's frame-pointer chain into the per-CPU scratch stack and hashes it
/// with the process id; returns the site key and the stack (stored with the site when
/// the site is new).
///
/// The walk is the kernel's user-stack walk (frame record = saved frame pointer, then
/// return address, on x86-64 and arm64) with one difference: a frame pointer is only
/// followed while it points into the stack above the stack pointer and grows. Chains
/// end in code built without frame pointers (glibc's start code), and reading their
/// garbage faults more often than not: that fault cost ~0.6 µs per allocation.
#[inline(always)]
pub fn record_stack(
    ctx: &RetProbeContext,
    tgid: u32,
    kind: AllocKind,
) -> Option<(StackKey, &'static UserStack)> {
    // SAFETY: a plain value copied out of the map.
    let exec_gen = unsafe { EXEC_GEN.get(&tgid) }.copied().unwrap_or(0);
    let scratch = STACK_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's scratch slot; programs on one CPU do not interleave.
    let stack = unsafe { &mut *scratch };
    let (ip, mut fp, sp) = regs::at_return(ctx);
    stack.frames[0] = ip;
    stack.len = 1;
    let mut hash = (u64::from(tgid) ^ ip).wrapping_mul(HASH_MULTIPLIER);
    // The depth lives in the scratch memory, not in a register that outlives the loop:
    // every way out of the loop then leaves the verifier the same state to continue
    // from, so it checks the rest of the program once instead of once per exit.
    for depth in 1..MAX_STACK_DEPTH as usize {
        if fp < sp || fp - sp > MAX_STACK_SPAN || fp & 7 != 0 {
            break;
        }
        // SAFETY: bpf_probe_read_user checks the user address.
        let Ok(record) = (unsafe { bpf_probe_read_user(fp as *const [u64; 2]) }) else {
            break;
        };
        if record[1] == 0 {
            break;
        }
        stack.frames[depth] = record[1];
        stack.len = depth as u32 + 1;
        hash = (hash ^ record[1]).wrapping_mul(HASH_MULTIPLIER);
        hash ^= hash >> 29;
        if record[0] <= fp {
            break;
        }
        fp = record[0];
        if depth == MAX_STACK_DEPTH as usize - 1 {
            count_drop(DropReason::StackTruncated);
        }
    }
    let site = StackKey {
        tgid,
        exec_gen,
        stack: hash,
        kind: kind as u32,
        _pad: 0,
    };
    Some((site, stack))
}
