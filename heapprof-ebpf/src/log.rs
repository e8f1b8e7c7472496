//! Rare events, logged once per run through aya-log (the daemon's logger shows them).
//!
//! Only paths that already lost something call in here: the first drop of each
//! [`DropReason`], and the first stack cut short for each [`GapReason`] (a CFI table
//! miss among them). A flood of drops must not flood the log ring, so each kind is
//! logged once: a plain flag in `LOGGED` (an array lookup, which the verifier inlines)
//! turns every later event away, and a `BPF_NOEXIST` insert into `LOG_CLAIMS` lets only
//! one of the CPUs that see the first event at once write the line. The writing itself
//! is in global functions, verified once each, out of the callers' code.
//!
//! aya-log-ebpf's macros take the program's context but do not use it (the records go
//! to a ring buffer), so no context is threaded through: the functions pass `&()`.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    macros::map,
    maps::{Array, HashMap},
};
use aya_log_ebpf::{info, warn};
use heapprof_common::{DropReason, unwind::GapReason};

/// One flag per drop reason, then one per gap reason.
const SLOTS: u32 = DropReason::COUNT + GAP_REASONS;
/// Number of [`GapReason`]s.
const GAP_REASONS: u32 = 5;
const _: () = assert!(GapReason::Unreadable as u32 + 1 == GAP_REASONS);

/// Whether each kind was logged (read first, so repeated events cost one array read).
#[map(name = "LOGGED")]
static LOGGED: Array<u32> = Array::with_max_entries(SLOTS, 0);
/// The kinds logged, claimed atomically (one insert succeeds per key).
#[map(name = "LOG_CLAIMS")]
static LOG_CLAIMS: HashMap<u32, u32> = HashMap::with_max_entries(SLOTS, 0);

/// Whether this is the first event of kind `slot` in this run (true once).
#[inline(always)]
fn first_time(slot: u32) -> bool {
    let Some(flag) = LOGGED.get_ptr_mut(slot) else {
        return false;
    };
    // SAFETY: a map value, valid while the program runs; a racing writer only writes 1.
    unsafe {
        if core::ptr::read_volatile(flag) != 0 {
            return false;
        }
        core::ptr::write_volatile(flag, 1);
    }
    LOG_CLAIMS.insert(&slot, &1, BPF_NOEXIST as u64).is_ok()
}

/// Where a drop was counted: which set of tables.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Tables {
    /// User mode's tables (`LIVE`, `SITES`, `STACKS`).
    User = 0,
    /// Kernel mode's (`KERNEL_LIVE`, `KERNEL_SITES`, `KERNEL_STACKS`).
    Kernel = 1,
}

/// Logs the first drop for `reason` (a rare path: the caller has just counted a drop).
#[inline(always)]
pub fn first_drop(reason: DropReason, tables: Tables) {
    if first_time(reason as u32) {
        heapprof_log_drop(reason as u32, tables as u32);
    }
}

/// Logs the first stack cut short for `reason`, at `pc` of process `tgid`.
#[inline(always)]
pub fn first_gap(reason: GapReason, pc: u64, tgid: u32) {
    if first_time(DropReason::COUNT + reason as u32) {
        heapprof_log_gap(reason as u32, pc, tgid);
    }
}

/// Writes the line of a first drop. Global (public, unmangled): verified once, on its
/// own, and not inlined into the programs that count drops.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_log_drop(reason: u32, tables: u32) -> i64 {
    let ctx = &();
    let kernel = tables == Tables::Kernel as u32;
    match reason {
        r if r == DropReason::LiveTableFull as u32 => {
            if kernel {
                warn!(
                    ctx,
                    "KERNEL_LIVE table full: an object is counted as allocated, not as in use (raise --max-live-blocks); later drops are counted, not logged"
                );
            } else {
                warn!(
                    ctx,
                    "LIVE table full: a block is counted as allocated, not as in use (raise --max-live-blocks); later drops are counted, not logged"
                );
            }
        }
        r if r == DropReason::SiteTableFull as u32 => {
            if kernel {
                warn!(
                    ctx,
                    "KERNEL_SITES table full: an allocation is not counted (raise --max-sites); later drops are counted, not logged"
                );
            } else {
                warn!(
                    ctx,
                    "SITES table full: an allocation is not counted (raise --max-sites); later drops are counted, not logged"
                );
            }
        }
        r if r == DropReason::StackTableFull as u32 => {
            if kernel {
                warn!(
                    ctx,
                    "KERNEL_STACKS table full: a new site is counted with an unknown stack (raise --max-stacks); later drops are counted, not logged"
                );
            } else {
                warn!(
                    ctx,
                    "STACKS table full: a new site is counted with an unknown stack (raise --max-stacks); later drops are counted, not logged"
                );
            }
        }
        r if r == DropReason::StackTruncated as u32 => warn!(
            ctx,
            "a stack deeper than the frame limit: its outermost frames are cut; later ones are counted, not logged"
        ),
        r if r == DropReason::InFlightFull as u32 => warn!(
            ctx,
            "IN_FLIGHT table full: an allocator call is not counted (raise --max-threads); later drops are counted, not logged"
        ),
        r if r == DropReason::OutPtrUnreadable as u32 => warn!(
            ctx,
            "posix_memalign's result could not be read: the call is not counted; later ones are counted, not logged"
        ),
        r if r == DropReason::StackUnavailable as u32 => warn!(
            ctx,
            "the kernel could not take an allocation's stack: counted at its call site; later ones are counted, not logged"
        ),
        r if r == DropReason::ExecTableFull as u32 => warn!(
            ctx,
            "EXEC_GEN table full: a process's allocations after an exec count as its previous image's (raise --max-threads); later drops are counted, not logged"
        ),
        r if r == DropReason::UsageTableFull as u32 => warn!(
            ctx,
            "PROCESS_USAGE table full: a process's in-use peak is not recorded (raise --max-processes); later drops are counted, not logged"
        ),
        _ => {}
    }
    0
}

/// Writes the line of the first stack cut short for a reason (see [`heapprof_log_drop`]).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_log_gap(reason: u32, pc: u64, tgid: u32) -> i64 {
    let ctx = &();
    match reason {
        r if r == GapReason::NoMapping as u32 => info!(
            ctx,
            "stack not unwound to its end: pid {} at {:x}, no executable mapping known there (not loaded yet, or JIT code); later gaps are counted, not logged",
            tgid,
            pc
        ),
        r if r == GapReason::NoTable as u32 => info!(
            ctx,
            "CFI table miss: pid {} at {:x}, the object's unwind table is not loaded and frame pointers did not lead on; later misses are counted, not logged",
            tgid,
            pc
        ),
        r if r == GapReason::NoRule as u32 => info!(
            ctx,
            "CFI table miss: pid {} at {:x}, no unwind row for the address; later misses are counted, not logged",
            tgid,
            pc
        ),
        r if r == GapReason::Unsupported as u32 => info!(
            ctx,
            "stack not unwound to its end: pid {} at {:x}, an unwind rule heapprofd cannot follow; later gaps are counted, not logged",
            tgid,
            pc
        ),
        r if r == GapReason::Unreadable as u32 => info!(
            ctx,
            "stack not unwound to its end: pid {} at {:x}, a saved register could not be read from the stack; later gaps are counted, not logged",
            tgid,
            pc
        ),
        _ => {}
    }
    0
}
