//! The user stack of an allocation, taken at the allocator's return.

use aya_ebpf::programs::RetProbeContext;
use heapprof_common::{ProbeSlot, SiteId, StackKey, UserStack, size_class};

use crate::{
    maps::{STACK_SCRATCH, unwind_mode},
    regs,
    sites::{self, NewSite},
    unwind,
    walk_cache::{self, WalkStart},
};

/// The stack of an allocation, walked.
pub struct Recorded {
    /// The site: process, image, stack hash and function.
    pub site: StackKey,
    /// The frames (this CPU's scratch stack).
    pub frames: &'static UserStack,
    /// Whether `walk_cache` remembers the walk.
    pub remembered: bool,
}

/// Where the walk of the caller's stack at the return of a call of function `slot`
/// for `size` bytes starts.
#[inline(always)]
pub fn walk_start(
    ctx: &RetProbeContext,
    pid_tgid: u64,
    exec_gen: u32,
    slot: ProbeSlot,
    size: u64,
) -> WalkStart {
    let (pc, fp, sp) = regs::at_return(ctx);
    WalkStart {
        pid_tgid,
        pc,
        fp,
        sp,
        exec_gen,
        slot,
        size_class: size_class(size),
        epoch: walk_cache::epoch_now(),
    }
}

/// The site of the allocation whose return starts at `start`, from a walk this CPU
/// remembers (see `walk_cache`), if one still holds and the site has an index.
#[inline(always)]
pub fn remembered(start: &WalkStart) -> Option<SiteId> {
    let hit = walk_cache::cached(start)?;
    if hit.known != 0 {
        return Some(hit.site);
    }
    let id = sites::site_id(&site_key(start, hit.hash), NewSite::Refuse)?;
    walk_cache::note_site(start, id);
    Some(id)
}

#[inline(always)]
fn site_key(start: &WalkStart, hash: u64) -> StackKey {
    StackKey {
        tgid: (start.pid_tgid >> 32) as u32,
        exec_gen: start.exec_gen,
        stack: hash,
        slot: start.slot,
        size_class: start.size_class,
    }
}

/// The benchmark's `stacks_only` baseline: the stack of the allocation whose return
/// starts at `start` is found, from a remembered walk or by a walk (remembered for the
/// next time), and nothing is counted.
#[inline(always)]
pub fn find_only(start: &WalkStart) {
    if walk_cache::cached(start).is_none() {
        let _ = walk(start);
    }
}

/// Unwinds the caller's stack from `start` into the per-CPU scratch stack and hashes it
/// with the process id, remembering the walk when it depended only on the registers
/// and the stack words it read. At the return the caller's frame is intact, so its
/// return address is the first frame and its registers the unwinder's starting point.
#[inline(always)]
pub fn walk(start: &WalkStart) -> Option<Recorded> {
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
    let remembered = walk_cache::remember(start, hash);
    Some(Recorded {
        site: site_key(start, hash),
        frames: stack,
        remembered,
    })
}
