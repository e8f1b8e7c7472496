//! The preload library's reports (launch mode's interposer; see
//! `heapprof_common::preload`): one uprobe on its probe site, where each call brings
//! an allocation with the caller's registers, the thread's queued records, or both.
//!
//! An allocation report is answered, in the thread's slot of the `REPLIES` map (which
//! the process maps), with the places of the stack words its walk read, so the
//! library can queue later allocations at the same stack instead of calling the probe
//! site.

use core::ffi::c_void;

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_loop, bpf_probe_read_user, bpf_probe_read_user_buf},
    macros::{map, uprobe},
    maps::PerCpuArray,
    programs::ProbeContext,
};
use heapprof_common::{
    DropReason, StackKey,
    preload::{
        Kind, Meta, Preloaded, QUEUE_WORDS, QueueState, REPLY_SLOTS, Record, ReportQueue,
        StackReply,
    },
    size_class,
};

use crate::{
    calls,
    maps::{
        EXEC_GEN, PRELOADED, REPLIES, REPLY_SCRATCH, REPORT_QUEUES, STACK_SCRATCH, armed,
        count_drop, empty_programs, ignored, unwind_mode,
    },
    regs,
    sites::{self, Frees, NewSite, Usage},
    unwind,
    usage::UsageBatch,
};

/// A report queue's copy, with room past its end (an extended record's last word is
/// read at most two words after the last place the verifier can tell a record
/// starts), and where its application stands.
#[repr(C)]
pub struct QueueScratch {
    /// The copy.
    queue: ReportQueue,
    /// Never read as part of a record.
    slack: [u64; 2],
    /// The application's state. Kept here, not on the stack of the program that calls
    /// `bpf_loop`: kernels up to 6.1 count the loop's callback as a call from that
    /// program, and the chain of its frame, the callback's (at least 32 bytes), the
    /// record's and the live-block insert's must fit 512 bytes.
    cursor: QueueCursor,
}

/// Per-CPU room to copy a report queue into (too big for the BPF stack). Programs on
/// one CPU do not interleave: tracing programs do not run while one runs on the CPU.
#[map(name = "QUEUE_SCRATCH")]
pub static QUEUE_SCRATCH: PerCpuArray<QueueScratch> = PerCpuArray::with_max_entries(1, 0);

/// Where the queue's records are being applied, for [`heapprof_apply_record`].
#[repr(C)]
pub struct QueueCursor {
    tgid: u32,
    exec_gen: u32,
    /// The next record's first word.
    index: u32,
    /// Words in the queue.
    len: u32,
    /// The records' change of the process's in-use bytes.
    usage: UsageBatch,
    /// The thread's last allocation (see `QueueState::last_block`).
    last_block: u64,
}

impl QueueCursor {
    /// Whether freeing `block` frees the thread's last allocation, which is then
    /// forgotten.
    #[inline(always)]
    fn take_last_block(&mut self, block: u64) -> bool {
        let last = block != 0 && block == self.last_block;
        if last {
            self.last_block = 0;
        }
        last
    }
}

/// The image generation of process `tgid` (0 before its first exec is seen).
#[inline(always)]
fn exec_gen_of(tgid: u32) -> u32 {
    // SAFETY: a plain value read out of the map.
    unsafe { EXEC_GEN.get(&tgid) }.copied().unwrap_or(0)
}

/// Applies what is new in the queue at `address` (a user address) of thread
/// `pid_tgid`: its words from where the last application of the same generation
/// stopped (see `heapprof_common::preload::QueueState`) to its length. Returns the
/// thread's queue state, if it has one.
#[inline(always)]
fn apply_queue(pid_tgid: u64, address: u64) -> Option<*mut QueueState> {
    let state_ptr = REPORT_QUEUES.get_ptr_mut(&pid_tgid)?;
    // SAFETY: a map value; only this thread's programs, which do not interleave, use it.
    let state = unsafe { &mut *state_ptr };
    if address == 0 {
        return Some(state_ptr); // set aside during an exec (see `exec_starts`)
    }
    if state.address == 0 {
        // The old image reports again: its exec failed, and the queue is back in use.
        state.address = address;
    }
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: bpf_probe_read_user checks the user address.
    let Ok(header) = (unsafe { bpf_probe_read_user(address as *const [u32; 2]) }) else {
        count_drop(DropReason::FreeQueueUnreadable);
        return Some(state_ptr);
    };
    let (len, generation) = (header[0].min(QUEUE_WORDS as u32), header[1]);
    let start = if state.generation == generation {
        state.applied.min(len)
    } else {
        0
    };
    state.generation = generation;
    state.applied = len;
    if start >= len {
        return Some(state_ptr);
    }
    let scratch = QUEUE_SCRATCH.get_ptr_mut(0)?;
    let mut words = u64::from(len - start);
    // The length keeps its bounds in every copy the compiler makes (see
    // `unwind::copy_to_window`).
    // SAFETY: arithmetic on a register.
    unsafe { core::arch::asm!("{n} &= 0x7f", n = inout(reg) words, options(nostack)) };
    if words == 0 || words > QUEUE_WORDS as u64 {
        return Some(state_ptr);
    }
    // SAFETY: the words of this CPU's scratch queue viewed as bytes, the length bounded
    // by their size; programs on one CPU do not interleave.
    let bytes = unsafe {
        core::slice::from_raw_parts_mut(
            (&raw mut (*scratch).queue.words).cast::<u8>(),
            words as usize * 8,
        )
    };
    let first = address + 8 + u64::from(start) * 8;
    // SAFETY: bpf_probe_read_user_buf checks the user address.
    if unsafe { bpf_probe_read_user_buf(first as *const u8, bytes) }.is_err() {
        count_drop(DropReason::FreeQueueUnreadable);
        return Some(state_ptr);
    }
    // SAFETY: this CPU's scratch slot, as above.
    let cursor = unsafe { &mut (*scratch).cursor };
    cursor.tgid = tgid;
    cursor.exec_gen = exec_gen_of(tgid);
    cursor.index = 0;
    cursor.len = words as u32;
    cursor.usage = UsageBatch::start(tgid);
    cursor.last_block = state.last_block;
    // SAFETY: the callback is a BPF subprogram; it takes no context (the cursor is in
    // this CPU's scratch slot).
    unsafe {
        bpf_loop(
            QUEUE_WORDS as u32,
            apply_record as *mut c_void,
            core::ptr::null_mut(),
            0,
        );
    }
    cursor.usage.apply(tgid);
    state.last_block = cursor.last_block;
    Some(state_ptr)
}

/// `bpf_loop`'s callback: one record (see [`heapprof_apply_record`]).
extern "C" fn apply_record(_index: u64, _context: *mut c_void) -> i64 {
    // As in the unwinder's callback: the global function keeps the verifier from
    // checking the loop's body once per iteration. The mask, which the verifier needs,
    // is kept in assembly on the register: a volatile read of a local would give this
    // callback a stack frame of its own.
    let mut stop = heapprof_apply_record();
    // SAFETY: arithmetic on a register.
    unsafe { core::arch::asm!("{r} &= 1", r = inout(reg) stop, options(nostack)) };
    stop
}

/// Applies the record at the cursor in this CPU's `QUEUE_SCRATCH` (see
/// `heapprof_common::preload::Record`) and moves the cursor past it; returns 1 after
/// the last. A global function: the verifier checks it once, on its own.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_apply_record() -> i64 {
    let Some(scratch) = QUEUE_SCRATCH.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: this CPU's scratch slot, which `apply_queue` filled; programs on one CPU
    // do not interleave.
    let (queue, cursor) = unsafe { (&(*scratch).queue, &mut (*scratch).cursor) };
    // Map keys must be on this function's stack (see `unwind::fallback_step`).
    let tgid = cursor.tgid;
    let at = cursor.index as usize;
    if at >= cursor.len as usize || at >= QUEUE_WORDS {
        return 1;
    }
    let header = queue.words[at];
    if header & Record::EXTENDED == 0 {
        cursor.index += 1;
        let temporary = cursor.take_last_block(header);
        let mut usage = Usage::Batch(&mut cursor.usage);
        sites::release_into(tgid, header, temporary, &mut usage, Frees::Queued);
        return 0;
    }
    let words = Record::EXTENDED_WORDS as usize;
    if at + words > cursor.len as usize || at + words > QUEUE_WORDS {
        return 1;
    }
    cursor.index += Record::EXTENDED_WORDS;
    let block = queue.words[at + 1];
    if header & Record::FREE != 0 {
        let temporary = cursor.take_last_block(block);
        let mut usage = Usage::Batch(&mut cursor.usage);
        sites::release_into(tgid, block, temporary, &mut usage, Frees::Queued);
        return 0;
    }
    let size = header >> Record::SIZE_SHIFT;
    let site = StackKey {
        tgid,
        exec_gen: cursor.exec_gen,
        stack: queue.words[at + 2],
        slot: ((header >> Record::FUNCTION_SHIFT) & Record::FUNCTION_MASK) as u32,
        size_class: size_class(size),
    };
    cursor.last_block = block;
    let mut usage = Usage::Batch(&mut cursor.usage);
    sites::allocated_into(
        tgid,
        (block, size),
        &site,
        NewSite::Stored,
        &mut usage,
        Frees::Queued,
    );
    0
}

/// Counts the allocation `block` of `size` bytes by preload function `function`,
/// unwinding from the caller's registers; answers the report in `REPLIES` slot
/// `slot` (0: none) when the walk allows.
#[inline(always)]
fn allocated(
    pid_tgid: u64,
    function: u32,
    (block, size): (u64, u64),
    caller: (u64, u64, u64),
    slot: u32,
) {
    let answer = slot != 0 && slot < REPLY_SLOTS;
    let tgid = (pid_tgid >> 32) as u32;
    let Some(scratch) = STACK_SCRATCH.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's scratch slot; programs on one CPU do not interleave.
    let stack = unsafe { &mut *scratch };
    let exec_gen = exec_gen_of(tgid);
    let hash = unwind::unwind(pid_tgid, exec_gen, unwind_mode(), caller, stack, answer);
    let allocation = NewBlock {
        site: StackKey {
            tgid,
            exec_gen,
            stack: hash,
            // The library's functions take the first slots.
            slot: function,
            size_class: size_class(size),
        },
        block,
        size,
    };
    if heapprof_count_block(&allocation) != 0 && answer {
        send_answer(slot, hash);
    }
}

/// An allocation to count, for [`heapprof_count_block`].
#[repr(C)]
pub struct NewBlock {
    site: StackKey,
    block: u64,
    size: u64,
}

/// Counts `allocation`, whose stack is in this CPU's `STACK_SCRATCH`; returns 1 if
/// its site counted it. A global function: the counting's locals get a frame of
/// their own instead of adding to the probe's, which the unwinder's calls share (the
/// combined stack of a call chain is limited to 512 bytes).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_count_block(allocation: *const NewBlock) -> i64 {
    if allocation.is_null() {
        return 0;
    }
    // SAFETY: the caller's own value; map keys are copied to this function's stack
    // (see `unwind::fallback_step`).
    let (site, block, size) =
        unsafe { ((*allocation).site, (*allocation).block, (*allocation).size) };
    let Some(stack) = STACK_SCRATCH.get(0) else {
        return 0;
    };
    i64::from(
        sites::allocated_into(
            site.tgid,
            (block, size),
            &site,
            NewSite::Stack(stack),
            &mut Usage::direct(),
            Frees::Queued,
        )
        .is_some(),
    )
}

/// Copies this CPU's answer, if the walk allowed one, into the thread's slot.
#[inline(always)]
fn send_answer(slot: u32, hash: u64) {
    let (Some(scratch), Some(target)) = (REPLY_SCRATCH.get_ptr_mut(0), REPLIES.get_ptr_mut(slot))
    else {
        return;
    };
    // SAFETY: this CPU's scratch slot (programs on one CPU do not interleave), and the
    // thread's slot, which only its own reports write and it reads after they return.
    unsafe {
        let reply = &mut (*scratch).reply;
        if reply.status != StackReply::KNOWN {
            return;
        }
        reply.hash = hash;
        core::ptr::copy_nonoverlapping(reply as *const StackReply, target, 1);
    }
}

#[inline(always)]
fn on_report(ctx: &ProbeContext) {
    let pid_tgid = bpf_get_current_pid_tgid();
    if ignored(pid_tgid) || !armed() {
        return;
    }
    let tgid = (pid_tgid >> 32) as u32;
    let [block, size, ra, sp, fp, reports, meta] = regs::preload_args(ctx);
    let kind = ((meta >> Meta::KIND_SHIFT) & 0xff) as u32;
    // A signal handler's report while its thread changes its queue: the queue is left
    // alone (its new records come with a later report).
    let queue_busy = meta & Meta::QUEUE_BUSY != 0;
    if meta & Meta::REGISTER_QUEUE != 0 && !queue_busy {
        let state = QueueState {
            address: reports,
            generation: 0,
            applied: 0,
            last_block: 0,
        };
        if REPORT_QUEUES.insert(&pid_tgid, &state, 0).is_err() {
            count_drop(DropReason::InFlightFull);
        }
    }
    match Kind::from_u32(kind) {
        Some(Kind::Hello) => {
            let code = Preloaded {
                text_start: block,
                text_end: size,
            };
            let _ = PRELOADED.insert(&tgid, &code, 0);
        }
        Some(Kind::Flush) => {
            apply_queue(pid_tgid, reports);
            if meta & Meta::UNREGISTER_QUEUE != 0 {
                let _ = REPORT_QUEUES.remove(&pid_tgid);
            }
        }
        Some(Kind::Free) => {
            let temporary = if queue_busy {
                false
            } else {
                apply_queue(pid_tgid, reports).is_some_and(|state| {
                    // SAFETY: as in `apply_queue`.
                    let state = unsafe { &mut *state };
                    let last = block != 0 && state.last_block == block;
                    if last {
                        state.last_block = 0;
                    }
                    last
                })
            };
            sites::release_into(tgid, block, temporary, &mut Usage::direct(), Frees::OnTime);
        }
        Some(Kind::Alloc) => {
            if !queue_busy && let Some(state) = apply_queue(pid_tgid, reports) {
                // SAFETY: as in `apply_queue`.
                unsafe { (*state).last_block = block };
            }
            if calls::report_is_nested(pid_tgid, ra, sp) {
                return;
            }
            let function = (meta & Meta::FUNCTION_MASK) as u32;
            let slot = ((meta >> Meta::SLOT_SHIFT) & 0xffff) as u32;
            allocated(pid_tgid, function, (block, size), (ra, fp, sp), slot);
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

/// A thread is switched out or calls `futex`: what its queue holds is applied, so that
/// a thread that waits after allocating is not left out of interval profiles and
/// peaks, and a thread it wakes cannot get its frees applied first.
#[inline(always)]
pub fn apply_pending(pid_tgid: u64) {
    // SAFETY: a plain value read out of the map.
    if let Some(state) = unsafe { REPORT_QUEUES.get(&pid_tgid) } {
        let address = state.address;
        apply_queue(pid_tgid, address);
    }
}

/// A thread calls `execve` or `execveat`: its queue is applied while its image is still
/// mapped, and its address set aside (0). Once the kernel has replaced the image, but
/// before `sched_process_exec`, the thread can be switched out, and the queue's address
/// then names nothing or another mapping of the new image; and the records not yet
/// applied would go unseen with the old image. A failed exec returns to the old image,
/// whose next report gives the address back (`apply_queue`).
#[inline(always)]
pub fn exec_starts(pid_tgid: u64) {
    apply_pending(pid_tgid);
    if let Some(state) = REPORT_QUEUES.get_ptr_mut(&pid_tgid) {
        // SAFETY: a map value; only this thread's programs, which do not interleave,
        // use it.
        unsafe { (*state).address = 0 };
    }
}

/// A thread exits: the records still in its queue are applied (its process's memory
/// is still there at this tracepoint), and its entries go.
#[inline(always)]
pub fn thread_exit(pid_tgid: u64) {
    // SAFETY: a plain value read out of the map.
    let Some(queue) = (unsafe { REPORT_QUEUES.get(&pid_tgid) }).map(|state| state.address) else {
        return;
    };
    apply_queue(pid_tgid, queue);
    let _ = REPORT_QUEUES.remove(&pid_tgid);
    let tgid = (pid_tgid >> 32) as u32;
    if pid_tgid as u32 == tgid {
        let _ = PRELOADED.remove(&tgid);
    }
}
