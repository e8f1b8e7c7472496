//! Slots in `PROBES`: which slot each newly probed function takes (a fresh one, its
//! spec written, or the one it has from being probed for another process), and the
//! record of what each fresh slot holds once its probes are attached.

use std::sync::atomic::Ordering;

use anyhow::{Context as _, Result, bail};
use heapprof_common::{MAX_PROBE_SLOTS, ProbeSlot, UNKNOWN_FRAME_BYTES};

use super::{
    AllocatorProbes, ProbePoints, SINGLE_STEPPED, SlotInfo, return_offsets,
    session_links::session_eligible,
};
use crate::{
    allocators::{api::Family, scan::FoundFunction},
    procmaps::ObjectFile,
};

/// The slots given to an object's newly probed functions.
pub(super) struct SlotPlan<'a> {
    /// Where each function's programs attach, and its slot.
    pub(super) points: Vec<ProbePoints>,
    /// The functions that took a fresh slot, recorded once their probes are attached.
    pub(super) fresh: Vec<(&'a FoundFunction, ProbeSlot)>,
}

impl AllocatorProbes {
    /// Fails if the `new` functions of `object` need more fresh slots than `PROBES`
    /// has left (a function probed for another process keeps its slot).
    pub(super) fn check_slots_left(
        &self,
        object: &ObjectFile,
        new: &[FoundFunction],
    ) -> Result<()> {
        let first = self.slots.len();
        let fresh = new
            .iter()
            .filter(|f| !self.slot_of.contains_key(&(object.id, f.offset)))
            .count();
        if first + fresh > MAX_PROBE_SLOTS as usize {
            bail!(
                "the probe table is full ({MAX_PROBE_SLOTS} functions): {} is not probed",
                object.path
            );
        }
        Ok(())
    }

    /// Gives each of the `new` functions of `object` its slot, in order: the one it
    /// has, or the next fresh one with its spec written (`text`: the object's code).
    pub(super) fn assign_slots<'a>(
        &mut self,
        object: &ObjectFile,
        new: &'a [FoundFunction],
        executable: bool,
        text: (u64, u64),
    ) -> Result<SlotPlan<'a>> {
        let mut points = Vec::new();
        let mut next_slot = self.slots.len();
        let mut fresh = Vec::new();
        for function in new {
            let slot = match self.slot_of.get(&(object.id, function.offset)) {
                Some(slot) => {
                    // Probed for another process already: its spec is in place.
                    points.push(ProbePoints {
                        slot: *slot,
                        entry: function.probe_offset(),
                        returns: return_offsets(function),
                    });
                    continue;
                }
                None => next_slot as ProbeSlot,
            };
            next_slot += 1;
            fresh.push((function, slot));
            self.write_spec(slot, function, object, executable, text)?;
            points.push(ProbePoints {
                slot,
                entry: function.probe_offset(),
                returns: return_offsets(function),
            });
        }
        Ok(SlotPlan { points, fresh })
    }

    /// Writes the spec of `function` (of `object`, whose code is `text`) into the fresh
    /// `slot` and notes its probe's page offset, before any probe can run it. Says
    /// where its probes go, and warns when the kernel single-steps them.
    fn write_spec(
        &mut self,
        slot: ProbeSlot,
        function: &FoundFunction,
        object: &ObjectFile,
        executable: bool,
        text: (u64, u64),
    ) -> Result<()> {
        let mut spec = function.signature.spec(
            function.probe_offset(),
            (function.placement.registers, function.placement.sp_adjust),
            text,
        );
        spec.in_library = u32::from(!executable);
        (spec.function_start, spec.function_end) = function.extent();
        spec.frame_bytes = function.frame_bytes.unwrap_or(UNKNOWN_FRAME_BYTES);
        spec.session = u32::from(session_eligible(function));
        self.specs
            .set(slot, &spec, 0)
            .context("writing the probe specs")?;
        self.page_slots.note(slot, function.probe_offset())?;
        log::debug!(
            "{} in {}: slot {slot}, probes at {}, frame {}",
            function.name,
            object.path,
            function.placement,
            function
                .frame_bytes
                .map_or("unknown".to_owned(), |bytes| format!("{bytes} bytes"))
        );
        if !function.placement.emulated {
            SINGLE_STEPPED.fetch_add(1, Ordering::Relaxed);
            log::warn!(
                "{} in {}: the probe at +{} is single-stepped by the kernel on every call \
                 (about 10x an emulated probe's cost): {}",
                function.name,
                object.path,
                function.placement.offset,
                function.placement.reason
            );
        }
        Ok(())
    }

    /// Records what the `fresh` slots of `object` hold, once their probes are attached.
    pub(super) fn record_slots(
        &mut self,
        object: &ObjectFile,
        fresh: Vec<(&FoundFunction, ProbeSlot)>,
    ) {
        for (function, slot) in fresh {
            self.slot_of.insert((object.id, function.offset), slot);
            self.slots.push(SlotInfo {
                function: function.name.clone(),
                object: object.id,
                object_path: object.path.clone(),
                offset: function.offset,
            });
            if function.family == Family::Custom {
                self.custom_found.insert(function.name.clone());
            }
        }
    }
}
