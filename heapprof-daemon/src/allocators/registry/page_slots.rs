//! The session program's table of probe slots by page offset (`SLOT_BY_PAGE_OFFSET`,
//! see `heapprof_common::page_slots`), kept beside `PROBES`.

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{Array, MapData},
};
use heapprof_common::{
    ProbeSlot, names,
    page_slots::{self, NO_SLOT, PAGE_OFFSET_ENTRIES},
};

/// The table, and the daemon's copy of it (the daemon is its only writer).
pub(super) struct PageSlots {
    map: Array<MapData, u32>,
    entries: Vec<u32>,
}

impl PageSlots {
    /// Takes the table out of the loaded programs.
    pub(super) fn new(ebpf: &mut Ebpf) -> Result<Self> {
        let map = ebpf
            .take_map(names::SLOT_BY_PAGE_OFFSET)
            .and_then(|map| Array::try_from(map).ok())
            .with_context(|| {
                format!("BPF map {} missing or mistyped", names::SLOT_BY_PAGE_OFFSET)
            })?;
        Ok(Self {
            map,
            entries: vec![NO_SLOT; PAGE_OFFSET_ENTRIES as usize],
        })
    }

    /// Notes the probe of `slot` at file offset `probe_offset`. Called before the
    /// probe's link is made, so that no run reads an entry that does not know it.
    pub(super) fn note(&mut self, slot: ProbeSlot, probe_offset: u64) -> Result<()> {
        let index = page_slots::index(probe_offset);
        let Some(entry) = self.entries.get_mut(index as usize) else {
            return Ok(());
        };
        let updated = page_slots::with_slot(*entry, slot);
        if updated != *entry {
            self.map
                .set(index, &updated, 0)
                .with_context(|| format!("writing {}", names::SLOT_BY_PAGE_OFFSET))?;
            *entry = updated;
        }
        Ok(())
    }
}
