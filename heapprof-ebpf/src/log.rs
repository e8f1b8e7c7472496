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
//!
//! The lines carry numbers only: the daemon words them from the same texts as its
//! drop reports (`DropReason::describe`, `remedy`, `table`; `GapReason::describe`).

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

/// Writes the line of a first drop: numbers only, which the daemon words from
/// [`DropReason`]'s own texts (heapprof-daemon/src/health/bpf_log.rs reads this
/// format). Global (public, unmangled): verified once, on its own, and not inlined
/// into the programs that count drops.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_log_drop(reason: u32, tables: u32) -> i64 {
    warn!(&(), "first drop: reason={} tables={}", reason, tables);
    0
}

/// Writes the line of the first stack cut short for a reason, as numbers (see
/// [`heapprof_log_drop`]).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_log_gap(reason: u32, pc: u64, tgid: u32) -> i64 {
    info!(&(), "first gap: reason={} pid={} pc={:x}", reason, tgid, pc);
    0
}
