//! Which probe a session program runs for, told by the probe's address alone.
//!
//! A probe's address and its file offset agree in their low 12 bits in every process:
//! objects are mapped at page-aligned file offsets, and pages are 4 KiB or a multiple.
//! The daemon keeps a table from those bits to the one probe slot whose function is
//! probed there (`SLOT_BY_PAGE_OFFSET`), and the session program reads it instead of
//! calling the attach-cookie helper, which cost an unsampled call about a tenth of its
//! program. Where two probed functions share the bits, the entry says so and the
//! program calls the helper.
//!
//! An entry only ever goes from [`NO_SLOT`] to one slot to [`SHARED`], is written
//! before the probe's link is made, and slots are never reused within a session: a run
//! can never read a slot other than its own.

use crate::ProbeSlot;

/// Entries of the table: one per page offset.
pub const PAGE_OFFSET_ENTRIES: u32 = 4096;

/// An entry no probe has: the program asks the helper.
pub const NO_SLOT: u32 = 0;

/// An entry two probes or more share: the program asks the helper.
pub const SHARED: u32 = u32::MAX;

/// The table entry for the probe at `address` (a probe's address in a process, or its
/// file offset).
pub const fn index(address: u64) -> u32 {
    (address % PAGE_OFFSET_ENTRIES as u64) as u32
}

/// The entry once `slot`'s probe joins one that held `current`.
pub const fn with_slot(current: u32, slot: ProbeSlot) -> u32 {
    let own = slot.saturating_add(1);
    if own == SHARED {
        SHARED
    } else if current == NO_SLOT || current == own {
        own
    } else {
        SHARED
    }
}

/// The slot an entry names, if it names one.
pub const fn slot(entry: u32) -> Option<ProbeSlot> {
    if entry == NO_SLOT || entry == SHARED {
        None
    } else {
        Some(entry - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_and_its_file_offset_share_an_entry() {
        // libjemalloc's malloc probe at file offset 0x23917, mapped at a page boundary.
        assert_eq!(index(0x23917), index(0x7f3a_5c02_3917));
        assert_eq!(index(0x23917), 0x917);
        assert_ne!(index(0x23917), index(0x23918));
    }

    #[test]
    fn the_first_probe_owns_the_entry_and_a_second_shares_it() {
        let first = with_slot(NO_SLOT, 0);
        assert_eq!(slot(first), Some(0));
        assert_eq!(with_slot(first, 0), first, "the same probe again");
        let shared = with_slot(first, 7);
        assert_eq!(shared, SHARED);
        assert_eq!(slot(shared), None);
        assert_eq!(with_slot(shared, 0), SHARED, "never back to one slot");
        assert_eq!(slot(NO_SLOT), None);
    }

    #[test]
    fn no_slot_can_name_the_shared_entry() {
        assert_eq!(with_slot(NO_SLOT, u32::MAX - 1), SHARED);
        assert_eq!(with_slot(NO_SLOT, u32::MAX), SHARED);
        assert_eq!(slot(with_slot(NO_SLOT, 4095)), Some(4095));
    }
}
