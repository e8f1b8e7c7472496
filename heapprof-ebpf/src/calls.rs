//! Which probe hits are the user's allocator calls: matching returns to entries.
//!
//! Allocator functions call each other (glibc's realloc calls malloc and free, and
//! jumps to malloc for `realloc(NULL, n)`; reallocarray jumps to realloc), and only the
//! outermost call of a thread is the user's. Each thread keeps one [`InFlight`]: the
//! call in progress, with the stack pointer at its entry.
//!
//! Why stack pointers, not a nesting depth: a depth counts on every return arriving.
//! Returns go missing: a call that entered between the attachment of the entry probes
//! and of the return probe, a `longjmp` or a cancellation out of the allocator, a return
//! probe the kernel could not arm. A depth then stays above zero and every later call
//! of the thread looks nested, silencing it for good. Stack pointers say for themselves
//! whether a call can be inside another, so a missed return costs at most that call:
//! - **Entry, below the recorded call's entry** (deeper on the same stack, within
//!   [`MAX_NESTING_SPAN`]) **and called from the code of the recorded call's object**
//!   (the return address is in that library's or binary's text): nested, not the
//!   user's call. The recorded call's object, not the new one's: a custom pool in the
//!   program that gets a new chunk from malloc makes one allocation, the pool's.
//! - **Entry at the same stack pointer:** the same return-address slot. Either a tail
//!   call from the recorded call, which forwards its arguments (the recorded call stays
//!   the user's; the kernel reports its return where the callee returns), or a new
//!   call from the same frame after a missed return (it replaces the record).
//! - **Any other entry** (above the recorded entry, on another stack, or from the
//!   user's code, as a signal handler's call would be): the recorded call is gone or
//!   interrupted; this call replaces it.
//! - **Return at the recorded call's stack pointer** completes it. A return deeper
//!   down is a nested call's; a return above it means the recorded call's return was
//!   missed (its frame is gone), which clears the record.
//! - **free below the recorded entry, from the allocator's code:** realloc's internal
//!   free, not counted (the realloc is).
//!
//! **Unsampled calls through a session link** (`ProbeSpec::session`, sampling only):
//! the entry skips the return of a plain allocation it does not sample, and of a
//! resize it does not sample whose old block the live table does not hold, so no return
//! says when the call ends. Its record stays as [`CALL_UNRECORDED`], only to recognise
//! what happens inside it, and without reading the user stack at its entry (that
//! read was as dear as the rest of the program):
//! - an entry at the same stack pointer, with the same arguments, of another function
//!   is its tail call (glibc's `memalign` jumping to `malloc`) when the caller's
//!   callee-saved registers are those of the unsampled call's entry (a tail call
//!   restores them before it jumps) and the caller's call instruction, read back
//!   from the return address, did not call the entered function itself (a caller
//!   that called it directly, or through its PLT stub or GOT slot, made a new call);
//! - an entry below it, within the unsampled function's frame (`ProbeSpec::frame_bytes`,
//!   what its code pushes and reserves, plus the call's return address) or within that
//!   of the last call found nested in it, is nested in it when its return address lies
//!   in that function's own code (its symbol's extent): only a live frame of
//!   that function can have made the call, and a later frame of it would have
//!   entered through its probe and replaced the record. (A free is never taken for
//!   nested in it: see [`free_call`].) A call from the object's other code (strdup's
//!   malloc after an unsampled malloc) is the user's.
//!
//! Neither check reads a return address that another session's return probe could
//! have replaced with the kernel's trampoline: a tail call's registers and a nested
//! call's own return address are the call instructions' own.
//!
//! Anything else ends it, as any entry ends an abandoned call. It counts nothing: the
//! thread's last block is cleared at the entry, as an unsampled call's return did.
//!
//! Besides, the programs stay inert until the daemon has attached every probe (the
//! `Control::armed` switch), so that attaching to a busy process starts with whole calls only,
//! and a thread's record is removed when the thread exits.

use aya_ebpf::programs::{ProbeContext, RetProbeContext};
use heapprof_common::{
    CALL_ACTIVE, CALL_DONE, CALL_UNRECORDED, DropReason, InFlight, MAX_NESTING_SPAN,
    MAX_UNRECORDED_NESTING_SPAN, NO_NESTED_SLOT, NO_REGISTER, ProbeRole, ProbeSlot, ProbeSpec,
};

use crate::{
    call_sites,
    maps::{EXEC_GEN, count_drop, probe_spec},
    regs::{self, RETURN_SP_OFFSET},
    sampling::sampled,
    sites, threads,
};

/// The arguments of an allocator call that matter for counting.
#[derive(Clone, Copy)]
pub struct Call {
    /// The function called.
    pub slot: ProbeSlot,
    /// Bytes requested (after calloc's multiplication, pvalloc's rounding).
    pub size: u64,
    /// The block being resized, or 0.
    pub old_ptr: u64,
    /// Where the new block is written (posix_memalign's out-pointer), or 0.
    pub out_ptr: u64,
}

/// The call being entered: its stack pointer, and its return address once read. A
/// read of the user stack is the dearest step of an entry, so each entry reads its
/// return address at most once, and only where a check needs it.
struct Entering<'a> {
    ctx: &'a ProbeContext,
    sp: u64,
    return_address: Option<u64>,
}

impl<'a> Entering<'a> {
    #[inline(always)]
    fn new(ctx: &'a ProbeContext, sp: u64) -> Self {
        Self {
            ctx,
            sp,
            return_address: None,
        }
    }

    /// The call's return address (0 if unreadable).
    #[inline(always)]
    fn return_address(&mut self) -> u64 {
        match self.return_address {
            Some(address) => address,
            None => {
                let address = regs::return_address_at_entry(self.ctx, self.sp);
                self.return_address = Some(address);
                address
            }
        }
    }
}

/// Whether the call being entered was made by the code of the object of the call
/// recorded in `state`: its return address, placed in that object's file through the
/// recorded load address, lies in the object's executable code.
#[inline(always)]
fn called_by_recorded_object(entering: &mut Entering<'_>, state: &InFlight) -> bool {
    let Some(spec) = probe_spec(state.slot) else {
        return false;
    };
    let return_address = entering.return_address();
    let offset = return_address.wrapping_sub(state.object_base);
    offset >= spec.text_start && offset < spec.text_end
}

/// Whether an entry at `sp` is nested in the call recorded in `state` (see the module
/// documentation). An entry at the stack pointer of a call already found nested is
/// that call's tail call (mimalloc's `mi_malloc_aligned` jumps to
/// `mi_heap_malloc_aligned`): its return address is the nested call's, which that
/// call's return probe has replaced with the kernel's trampoline.
#[inline(always)]
fn nested(entering: &mut Entering<'_>, state: &mut InFlight) -> bool {
    let sp = entering.sp;
    if sp >= state.entry_sp || state.entry_sp - sp > MAX_NESTING_SPAN {
        return false;
    }
    if sp == state.nested_sp || called_by_recorded_object(entering, state) {
        state.nested_sp = sp;
        return true;
    }
    false
}

/// Where a probed function is loaded, from a call's entry: the address of file offset 0
/// of its object, and that of the function's first instruction.
#[derive(Clone, Copy)]
struct Placed {
    object_base: u64,
    entry: u64,
}

impl Placed {
    /// Where the function `spec` is loaded, from its probe's address `ip`.
    #[inline(always)]
    fn at(ip: u64, spec: &ProbeSpec) -> Placed {
        let object_base = ip.wrapping_sub(spec.probe_offset);
        Placed {
            object_base,
            entry: object_base.wrapping_add(spec.function_start),
        }
    }
}

/// The spec of the function in `slot` if an entry at `sp` is where a call its body
/// makes can enter, in its call that entered at `entry_sp`: below it, by at most the
/// function's frame and the call's return address.
#[inline(always)]
fn frame_holds(slot: ProbeSlot, entry_sp: u64, sp: u64) -> Option<&'static ProbeSpec> {
    let spec = probe_spec(slot)?;
    (sp < entry_sp && entry_sp - sp <= u64::from(spec.frame_bytes) + 8).then_some(spec)
}

/// Whether `return_address` was pushed by a call in the code of the function `spec`,
/// whose object is loaded at `object_base`.
#[inline(always)]
fn made_by(spec: &ProbeSpec, return_address: u64, object_base: u64) -> bool {
    let offset = return_address.wrapping_sub(object_base);
    // A return address follows its call: past the function's start, at most its end.
    offset > spec.function_start && offset <= spec.function_end
}

/// Whether the entry of `call` (the function `placed`) is inside the unsampled call
/// recorded in `state` ([`CALL_UNRECORDED`]; see the module documentation).
#[inline(always)]
fn inside_unrecorded(
    entering: &mut Entering<'_>,
    call: &Call,
    placed: Placed,
    state: &mut InFlight,
) -> bool {
    let sp = entering.sp;
    if sp == state.entry_sp {
        // A tail call forwards the arguments to another function, returning where the
        // unsampled call returns. A new call from the same frame after the unsampled
        // one returned follows the caller's own work, or calls the function itself.
        // The reads of the caller's code come last: the cheap checks rule out almost
        // every new call.
        return call.slot != state.slot
            && call.size == state.size
            && call.old_ptr == state.old_ptr
            && regs::callee_saved(entering.ctx) == state.caller_registers
            && !call_sites::calls(entering.return_address(), placed.entry);
    }
    if sp > state.entry_sp || state.entry_sp - sp > MAX_UNRECORDED_NESTING_SPAN {
        return false;
    }
    // Where the call enters says which body could have made it; the return address,
    // read only then, says whether one did. (Most entries below an unsampled call are
    // the user's next calls, from deeper frames, outside both.)
    let recorded = frame_holds(state.slot, state.entry_sp, sp);
    let last_nested = if state.nested_slot == NO_NESTED_SLOT {
        None
    } else {
        frame_holds(state.nested_slot, state.nested_sp, sp)
    };
    if recorded.is_none() && last_nested.is_none() {
        return false;
    }
    let return_address = entering.return_address();
    let nested = recorded.is_some_and(|spec| made_by(spec, return_address, state.object_base))
        || last_nested.is_some_and(|spec| made_by(spec, return_address, state.nested_base));
    if nested {
        state.nested_slot = call.slot;
        state.nested_base = placed.object_base;
        state.nested_sp = sp;
    }
    nested
}

/// An allocator function's entry probe in thread `tid`, whose call record is
/// `existing` (armed programs only): records the call if it is the user's. Returns
/// whether the call's return probe has anything to do: a session link (`spec.session`)
/// then skips the return of the calls it has not.
#[inline(always)]
pub fn enter(
    ctx: &ProbeContext,
    spec: &ProbeSpec,
    (tid, existing): (u64, Option<*mut InFlight>),
    call: Call,
) -> bool {
    let (ip, sp) = regs::at_entry(ctx);
    // The stack pointer at the function's entry, before the pushes the probe follows.
    let sp = sp.wrapping_add(u64::from(spec.sp_adjust));
    let mut entering = Entering::new(ctx, sp);
    let placed = Placed::at(ip, spec);
    let mut exec_gen = 0;
    let mut last_block = 0;
    let mut returns_awaited = 0;
    if let Some(state) = existing {
        // SAFETY: the entry belongs to this thread; nothing else writes it.
        let state = unsafe { &mut *state };
        exec_gen = state.exec_gen;
        last_block = state.last_block;
        returns_awaited = state.returns_awaited;
        if inside_recorded(&mut entering, &call, placed, state) {
            return false;
        }
    }
    let sampled = sampled(call.size);
    // A call through a session link that is not sampled, and whose return has nothing
    // to count.
    let unrecorded = !sampled && return_has_nothing(spec, tid, &call);
    let state = InFlight {
        size: call.size,
        old_ptr: call.old_ptr,
        out_ptr: call.out_ptr,
        entry_sp: sp,
        object_base: placed.object_base,
        nested_sp: 0,
        active: if unrecorded {
            CALL_UNRECORDED
        } else {
            CALL_ACTIVE
        },
        slot: call.slot,
        sampled: sampled as u32,
        exec_gen,
        last_block: if unrecorded { 0 } else { last_block },
        caller_registers: if unrecorded {
            regs::callee_saved(ctx)
        } else {
            0
        },
        nested_base: 0,
        nested_slot: NO_NESTED_SLOT,
        returns_awaited: returns_awaited.saturating_add(u32::from(!unrecorded)),
    };
    match existing {
        // SAFETY: as above.
        Some(slot) => unsafe { *slot = state },
        None => {
            let tgid = (tid >> 32) as u32;
            let state = InFlight {
                // SAFETY: a plain value copied out of the map.
                exec_gen: unsafe { EXEC_GEN.get(&tgid) }.copied().unwrap_or(0),
                ..state
            };
            if !threads::create(tid, &state) {
                // Without a record its return could count nothing.
                count_drop(DropReason::InFlightFull);
                return false;
            }
        }
    }
    !unrecorded
}

/// Whether the entry of `call` belongs to the call recorded in `state` (a tail call of
/// a recorded call, a call nested in it, or one inside an unsampled call): then it is
/// not the user's, and records nothing.
#[inline(always)]
fn inside_recorded(
    entering: &mut Entering<'_>,
    call: &Call,
    placed: Placed,
    state: &mut InFlight,
) -> bool {
    if state.active == CALL_ACTIVE {
        if entering.sp == state.entry_sp {
            // A tail call forwarding the recorded call's arguments.
            return call.size == state.size && call.old_ptr == state.old_ptr;
        }
        return nested(entering, state);
    }
    state.active == CALL_UNRECORDED && inside_unrecorded(entering, call, placed, state)
}

/// For an unsampled `call` of thread `tid` to the function `spec`: whether its return
/// has nothing to count (an unsampled return only cleared the thread's last block),
/// so that a session link may skip it. A plain allocation, or a resize of a block the
/// live table does not hold (its return would release the old block;
/// realloc(NULL, n) has none). The filter cannot miss the block: it is counted from
/// before its insert, and the call still owns it.
#[inline(always)]
fn return_has_nothing(spec: &ProbeSpec, tid: u64, call: &Call) -> bool {
    spec.session != 0
        && if spec.role == ProbeRole::Alloc as u32 {
            spec.out_reg == NO_REGISTER
        } else {
            spec.role == ProbeRole::Realloc as u32
                && !sites::maybe_tracked((tid >> 32) as u32, call.old_ptr)
        }
}

/// The shared return probe: the recorded call, if this is its return.
#[inline(always)]
pub fn returned(ctx: &RetProbeContext, pid_tgid: u64) -> Option<InFlight> {
    let state = threads::record(pid_tgid)?;
    // SAFETY: this thread's own entry.
    let state = unsafe { &mut *state };
    if state.active != CALL_ACTIVE {
        return None; // a call that entered before the probes were armed
    }
    let (_, _, sp) = regs::at_return(ctx);
    let expected = state.entry_sp.wrapping_add(RETURN_SP_OFFSET);
    if sp != expected {
        if sp > expected {
            // The recorded call's frame is gone: its return was missed.
            state.active = CALL_DONE;
        }
        return None; // a nested call's return, or one whose entry was not seen
    }
    state.active = CALL_DONE;
    let call = *state;
    // The thread allocates again: its last block, if still in use, was not temporary.
    state.last_block = 0;
    Some(call)
}

/// Whether a thread whose call record is `record` may have a session link's return to
/// come: one of its calls asked for its return and has not seen it, or it has no
/// record to say.
#[inline(always)]
pub fn return_awaited(record: Option<*mut InFlight>) -> bool {
    record.is_none_or(|state| {
        // SAFETY: this thread's own entry.
        unsafe { (*state).returns_awaited != 0 }
    })
}

/// A session link's return ran in the thread whose call record is `record`: one fewer
/// to come.
#[inline(always)]
pub fn return_arrived(record: Option<*mut InFlight>) {
    if let Some(state) = record {
        // SAFETY: this thread's own entry.
        unsafe { (*state).returns_awaited = (*state).returns_awaited.saturating_sub(1) };
    }
}

/// Notes `block` as thread `pid_tgid`'s last allocation (see `InFlight::last_block`).
#[inline(always)]
pub fn note_last_block(pid_tgid: u64, block: u64) {
    if let Some(state) = threads::record(pid_tgid) {
        // SAFETY: this thread's own entry.
        unsafe { (*state).last_block = block };
    }
}

/// What free's entry probe learns from the thread's call record.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum FreeCall {
    /// The allocator's own free (realloc's), which the enclosing call accounts for.
    Nested,
    /// The user's free of the thread's last allocation: a temporary block.
    Temporary,
    /// The user's free of another block.
    Other,
}

/// free's entry probe (`spec`) for block `ptr`, in the thread whose call record is
/// `record`: whether the free is the allocator's own, or frees the thread's last
/// allocation.
#[inline(always)]
pub fn free_call(
    ctx: &ProbeContext,
    spec: &ProbeSpec,
    ptr: u64,
    record: Option<*mut InFlight>,
) -> FreeCall {
    let Some(state) = record else {
        return FreeCall::Other;
    };
    // SAFETY: this thread's own entry.
    let state = unsafe { &mut *state };
    if state.active != CALL_DONE {
        let (_, sp) = regs::at_entry(ctx);
        let sp = sp.wrapping_add(u64::from(spec.sp_adjust));
        // Inside an unsampled plain allocation, a free is not looked for (two reads of
        // the user stack, half the program's time on the probes): it could only free a
        // block no recorded call made (the allocator's own: the calls nested in another
        // are never recorded) or one the user frees (a `new` handler's), so the
        // user's free it is taken for finds nothing to release, or the right block.
        if state.active == CALL_ACTIVE && nested(&mut Entering::new(ctx, sp), state) {
            return FreeCall::Nested;
        }
        if sp >= state.entry_sp {
            // A call from the recorded call's frame or above: the recorded call is over.
            state.active = CALL_DONE;
        }
    }
    if ptr != 0 && state.last_block == ptr {
        state.last_block = 0;
        return FreeCall::Temporary;
    }
    FreeCall::Other
}

/// A preload library report with the caller's return address `ra` and stack pointer
/// `sp`: whether it is an allocation made inside an allocator call that the probes
/// recorded (a custom pool's function getting a chunk from malloc), which that call
/// accounts for.
#[inline(always)]
pub fn report_is_nested(pid_tgid: u64, ra: u64, sp: u64) -> bool {
    let Some(state) = threads::record(pid_tgid) else {
        return false;
    };
    // SAFETY: this thread's own entry.
    let state = unsafe { &*state };
    if state.active != CALL_ACTIVE || sp >= state.entry_sp || state.entry_sp - sp > MAX_NESTING_SPAN
    {
        return false;
    }
    let Some(spec) = probe_spec(state.slot) else {
        return false;
    };
    let offset = ra.wrapping_sub(state.object_base);
    offset >= spec.text_start && offset < spec.text_end
}

/// A thread replaced its process's image (exec), leaving any allocator call for good:
/// its record must not survive, and its later stacks belong to image `exec_gen`.
#[inline(always)]
pub fn exec(pid_tgid: u64, exec_gen: u32) {
    if let Some(state) = threads::record(pid_tgid) {
        // SAFETY: this thread's own entry.
        unsafe {
            (*state).active = CALL_DONE;
            (*state).exec_gen = exec_gen;
            // The old image's calls never return.
            (*state).returns_awaited = 0;
        }
    }
}

/// A thread exits: its record goes (a later thread may reuse its id).
#[inline(always)]
pub fn forget(pid_tgid: u64) {
    threads::forget(pid_tgid);
}
