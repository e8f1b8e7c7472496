//! Where each thread's call record ([`InFlight`]) lives: in the slot of
//! `IN_FLIGHT_SLOTS` its thread id picks, which the thread owns until it exits, or, if
//! another live thread owns that slot, in the hash map `IN_FLIGHT`. Every allocator
//! call reads its thread's record two or three times; an array slot is found with no
//! kernel call, a hash entry with a bucket walk each time.

use heapprof_common::{InFlight, InFlightSlot};

use crate::{
    atomic::{compare_exchange, exchange},
    maps::{IN_FLIGHT, IN_FLIGHT_SLOTS, in_flight_slots},
};

/// The slot thread `pid_tgid` would own.
#[inline(always)]
fn slot_of(pid_tgid: u64) -> Option<*mut InFlightSlot> {
    let slots = in_flight_slots();
    IN_FLIGHT_SLOTS.get_ptr_mut(pid_tgid as u32 & (slots - 1))
}

/// The record of thread `pid_tgid`, if it has one.
#[inline(always)]
pub fn record(pid_tgid: u64) -> Option<*mut InFlight> {
    if let Some(slot) = slot_of(pid_tgid) {
        // SAFETY: a map value; its owner is only changed atomically.
        if unsafe { core::ptr::read_volatile(&raw const (*slot).owner) } == pid_tgid {
            // SAFETY: as above; only the owner's programs use the record.
            return Some(unsafe { &raw mut (*slot).state });
        }
    }
    IN_FLIGHT.get_ptr_mut(&pid_tgid)
}

/// Gives thread `pid_tgid`, which has no record, the record `state`: its slot if free,
/// else an entry of the hash map. Returns whether there was room.
#[inline(always)]
pub fn create(pid_tgid: u64, state: &InFlight) -> bool {
    if let Some(slot) = slot_of(pid_tgid) {
        // SAFETY: a map value; the owner is claimed atomically, and the record is then
        // this thread's alone.
        unsafe {
            if compare_exchange(&raw mut (*slot).owner, 0, pid_tgid) == 0 {
                (*slot).state = *state;
                return true;
            }
        }
    }
    IN_FLIGHT.insert(&pid_tgid, state, 0).is_ok()
}

/// Thread `pid_tgid` exits: its record goes (a later thread may reuse its id).
#[inline(always)]
pub fn forget(pid_tgid: u64) {
    if let Some(slot) = slot_of(pid_tgid) {
        // SAFETY: as in `record`; the slot is given up with an atomic store.
        unsafe {
            if core::ptr::read_volatile(&raw const (*slot).owner) == pid_tgid {
                (*slot).state.active = heapprof_common::CALL_DONE;
                exchange(&raw mut (*slot).owner, 0);
                return;
            }
        }
    }
    let _ = IN_FLIGHT.remove(&pid_tgid);
}
