//! Walks remembered per CPU, so that an allocation at a stack walked before costs one
//! copy of the stack and a comparison instead of a walk.
//!
//! A walk depends on nothing but the caller's registers (return address, stack
//! pointer, and the frame pointer if the walk used it), the unwind rules of the
//! addresses it visits (fixed while the process's mappings are: the
//! [`WALK_EPOCH`] counts the daemon's mapping writes) and the stack words it reads.
//! The walk notes the places and values of those words (`unwind::note_read`); while
//! they are all unchanged, a new walk would find the same frames, hence the same hash.
//! Programs in loops allocate from the same few spots with the same stacks, so most
//! allocations of a deep stack skip the walk's rule lookups and steps.

use aya_ebpf::{helpers::bpf_probe_read_user_buf, macros::map, maps::PerCpuArray};
use heapprof_common::{
    WalkOutcome,
    preload::{REPLY_READS, StackReply},
};

use crate::maps::{
    REPLY_SCRATCH, STACK_WINDOW, STACK_WINDOW_BYTES, STACK_WINDOW_WORDS, walk_epoch,
};

/// Remembered walks per CPU (a power of two), placed by their starting registers.
const ENTRIES: u32 = 128;

/// One remembered walk.
#[repr(C)]
pub struct CachedWalk {
    /// The thread (0: the entry is empty).
    pid_tgid: u64,
    /// The caller's registers at the walk's start.
    pc: u64,
    sp: u64,
    fp: u64,
    /// The walk's stack hash.
    hash: u64,
    /// [`WALK_EPOCH`] when the walk was made.
    epoch: u64,
    /// The process image the walk was made in.
    exec_gen: u32,
    /// Words read (at most `REPLY_READS`).
    reads: u32,
    /// Whether the walk used the caller's frame pointer register.
    uses_fp: u32,
    /// Bytes above `sp` that hold every word read.
    span: u32,
    /// The words' places, in words above `sp`.
    places: [u16; REPLY_READS],
    /// The words' values.
    values: [u64; REPLY_READS],
}

#[map(name = "WALK_CACHE")]
static WALK_CACHE: PerCpuArray<CachedWalk> = PerCpuArray::with_max_entries(ENTRIES, 0);

/// Per-CPU counts of the cache's outcomes, indexed by `WalkOutcome`.
#[map(name = "WALK_STATS")]
static WALK_STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(WalkOutcome::COUNT, 0);

/// Counts an outcome.
#[inline(always)]
fn count(outcome: WalkOutcome) {
    if let Some(slot) = WALK_STATS.get_ptr_mut(outcome as u32) {
        // SAFETY: this CPU's slot; programs on one CPU do not interleave.
        unsafe { *slot += 1 };
    }
}

/// A walk's start: the thread, its image and the caller's registers.
#[repr(C)]
pub struct WalkStart {
    /// The thread.
    pub pid_tgid: u64,
    /// The caller's return address, frame pointer and stack pointer.
    pub pc: u64,
    /// As above.
    pub fp: u64,
    /// As above.
    pub sp: u64,
    /// The process image.
    pub exec_gen: u32,
    /// Explicit padding.
    pub _pad: u32,
    /// [`WALK_EPOCH`] read before the walk, set by [`epoch_now`] callers.
    pub epoch: u64,
}

/// The daemon's count of mapping writes, read before a walk starts: a walk made
/// while mappings change is remembered with the count before the change, so it is
/// not trusted after it.
#[inline(always)]
pub fn epoch_now() -> u64 {
    walk_epoch()
}

/// The slot of a walk starting at `start`.
#[inline(always)]
fn slot_of(start: &WalkStart) -> u32 {
    let mix =
        (start.pc ^ start.sp.rotate_left(20) ^ start.pid_tgid).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (mix >> 57) as u32 & (ENTRIES - 1)
}

/// The hash of the remembered walk from `start`, if its words are unchanged: one copy
/// of the stack above the stack pointer and a comparison. A global function: the
/// verifier checks its loop once, on its own.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_walk_cached(start: *const WalkStart, hash: *mut u64) -> i64 {
    if start.is_null() || hash.is_null() {
        return 0;
    }
    // SAFETY: the caller's own values.
    let start = unsafe { &*start };
    let Some(entry) = WALK_CACHE.get(slot_of(start)) else {
        return 0;
    };
    if entry.pid_tgid != start.pid_tgid
        || entry.pc != start.pc
        || entry.sp != start.sp
        || entry.exec_gen != start.exec_gen
        || entry.epoch != start.epoch
        || (entry.uses_fp != 0 && entry.fp != start.fp)
    {
        return 0;
    }
    let Some(window) = STACK_WINDOW.get_ptr_mut(0) else {
        return 0;
    };
    // The length keeps its bounds in every copy the compiler makes (see
    // `unwind::copy_to_window`): ((span - 1) & 4095) + 1.
    let mut len = u64::from(entry.span);
    if len == 0 || len > STACK_WINDOW_BYTES as u64 {
        return 0;
    }
    // SAFETY: arithmetic on a register.
    unsafe {
        core::arch::asm!(
            "{len} += -1",
            "{len} &= 0xfff",
            "{len} += 1",
            len = inout(reg) len,
            options(nostack)
        );
    }
    // SAFETY: a prefix of this CPU's window, viewed as bytes; programs on one CPU do
    // not interleave.
    let bytes = unsafe {
        core::slice::from_raw_parts_mut((*window).words.as_mut_ptr().cast::<u8>(), len as usize)
    };
    // SAFETY: bpf_probe_read_user_buf checks the user address.
    if unsafe { bpf_probe_read_user_buf(start.sp as *const u8, bytes) }.is_err() {
        return 0;
    }
    let reads = (entry.reads as usize).min(REPLY_READS);
    for index in 0..REPLY_READS {
        if index >= reads {
            break;
        }
        let place = entry.places[index] as usize & (STACK_WINDOW_WORDS - 1);
        // SAFETY: as above; the place is masked into the window.
        if unsafe { (*window).words[place] } != entry.values[index] {
            return 0;
        }
    }
    // SAFETY: the caller's own value.
    unsafe { *hash = entry.hash };
    1
}

/// The hash of the remembered walk from `start`, if it still holds.
#[inline(always)]
pub fn cached(start: &WalkStart) -> Option<u64> {
    let mut hash = 0;
    if heapprof_walk_cached(start, &mut hash) != 0 {
        count(WalkOutcome::Remembered);
        Some(hash)
    } else {
        None
    }
}

/// Remembers the walk just made from `start` with hash `hash`, from the places and
/// values it noted in this CPU's reply scratch, if its stack words all lie in one
/// window above the stack pointer. A global function, as [`heapprof_walk_cached`].
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_walk_remember(start: *const WalkStart, hash: u64) -> i64 {
    if start.is_null() {
        return 0;
    }
    // SAFETY: the caller's own value.
    let start = unsafe { &*start };
    let (Some(scratch), Some(entry)) =
        (REPLY_SCRATCH.get(0), WALK_CACHE.get_ptr_mut(slot_of(start)))
    else {
        return 0;
    };
    // SAFETY: this CPU's slot; programs on one CPU do not interleave.
    let entry = unsafe { &mut *entry };
    let reply = &scratch.reply;
    if reply.status != StackReply::KNOWN || scratch.base != start.sp {
        return 0;
    }
    let reads = (reply.reads as usize).min(REPLY_READS);
    let mut span = 0u32;
    // Emptied first: a walk that cannot be remembered leaves no stale one in its slot.
    entry.pid_tgid = 0;
    for index in 0..REPLY_READS {
        if index >= reads {
            break;
        }
        let offset = reply.offsets[index];
        if offset < 0 || offset as usize + 8 > STACK_WINDOW_BYTES || offset & 7 != 0 {
            return 0;
        }
        entry.places[index] = (offset / 8) as u16;
        entry.values[index] = scratch.values[index];
        span = span.max(offset as u32 + 8);
    }
    entry.pc = start.pc;
    entry.sp = start.sp;
    entry.fp = start.fp;
    entry.hash = hash;
    entry.epoch = start.epoch;
    entry.exec_gen = start.exec_gen;
    entry.reads = reads as u32;
    entry.uses_fp = reply.uses_fp;
    // A walk that read nothing (its first frame ended it) still copies a word.
    entry.span = span.max(8);
    entry.pid_tgid = start.pid_tgid;
    1
}

/// Remembers the walk just made (see [`heapprof_walk_remember`]).
#[inline(always)]
pub fn remember(start: &WalkStart, hash: u64) {
    count(if heapprof_walk_remember(start, hash) != 0 {
        WalkOutcome::Walked
    } else {
        WalkOutcome::NotRememberable
    });
}
