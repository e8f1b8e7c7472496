//! The memory figures of the traced processes recorded in each profile: RSS, heap
//! segment and page faults from `/proc`, and the exact in-use peak from the programs.

use std::collections::{BTreeMap, HashMap};

use heapprof_common::ProcessUsage;

use crate::memstats::ProcessMemory;

/// The last figures read of each process with sites; an exited process keeps its
/// last reading, so that the profiles written after its exit still show it.
#[derive(Debug, Default)]
pub(super) struct MemoryRecords {
    by_pid: BTreeMap<u32, ProcessMemory>,
}

impl MemoryRecords {
    /// Reads the figures of each of `pids` that still runs, and takes each one's peak
    /// from `usage` (the programs' table; empty when peaks are not kept).
    pub(super) fn refresh(
        &mut self,
        pids: impl IntoIterator<Item = u32>,
        usage: &HashMap<u32, ProcessUsage>,
    ) {
        for pid in pids {
            if let Ok(mut memory) = ProcessMemory::read(pid) {
                memory.peak_inuse = self.by_pid.get(&pid).and_then(|m| m.peak_inuse);
                self.by_pid.insert(pid, memory);
            }
        }
        self.take_peaks(usage);
    }

    /// Records the peaks in `usage` (read before the programs' entries of exited
    /// processes are removed). A peak never goes down: a reused entry starts again.
    pub(super) fn take_peaks(&mut self, usage: &HashMap<u32, ProcessUsage>) {
        for (pid, usage) in usage {
            let memory = self.by_pid.entry(*pid).or_insert_with(|| ProcessMemory {
                pid: *pid,
                ..ProcessMemory::default()
            });
            memory.peak_inuse = Some(memory.peak_inuse.unwrap_or(0).max(usage.peak_bytes));
        }
    }

    /// The processes with figures.
    pub(super) fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.by_pid.keys().copied()
    }

    /// Drops the figures of `pids` (forgotten processes).
    pub(super) fn forget(&mut self, pids: &std::collections::HashSet<u32>) {
        self.by_pid.retain(|pid, _| !pids.contains(pid));
    }

    /// The figures of `pid`, if any were read.
    pub(super) fn get(&self, pid: u32) -> Option<&ProcessMemory> {
        self.by_pid.get(&pid)
    }
}
