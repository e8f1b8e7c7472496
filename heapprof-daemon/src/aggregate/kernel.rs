//! Reading the kernel-mode maps into per-site counts.

use std::{collections::HashMap, sync::Arc};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuHashMap},
};
use heapprof_common::{
    DropReason,
    kernel::{KernelCounters, KernelSiteKey, KernelStack, names as kernel_names},
    names,
};

use super::take;

/// Counts of one kernel site, summed over CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSite {
    /// Process, kind, stack and call site.
    pub key: KernelSiteKey,
    /// Cumulative counters.
    pub counters: KernelCounters,
}

impl KernelSite {
    /// The profile's six values, in [`crate::pprof::builder::KERNEL_SAMPLE_TYPES`] order:
    /// objects and handed-out bytes allocated, the same in use, then requested bytes
    /// allocated and in use.
    pub fn values(&self) -> [u64; 6] {
        let c = &self.counters;
        [
            c.alloc_objects,
            c.alloc_bytes,
            c.alloc_objects.saturating_sub(c.free_objects),
            c.alloc_bytes.saturating_sub(c.free_bytes),
            c.alloc_requested,
            c.alloc_requested.saturating_sub(c.free_requested),
        ]
    }
}

/// Owns the kernel-mode maps the daemon reads.
pub struct KernelMaps {
    sites: PerCpuHashMap<MapData, KernelSiteKey, KernelCounters>,
    stacks: BpfHashMap<MapData, u64, KernelStack>,
    traced: BpfHashMap<MapData, u32, u32>,
    comms: BpfHashMap<MapData, u32, [u8; 16]>,
    drops: PerCpuArray<MapData, u64>,
    /// Stacks already read, by hash (kernel stacks never change meaning).
    stack_cache: HashMap<u64, Arc<[u64]>>,
}

impl KernelMaps {
    /// Takes the maps out of a loaded object.
    pub fn new(ebpf: &mut Ebpf) -> Result<Self> {
        Ok(Self {
            sites: take(ebpf, kernel_names::KERNEL_SITES)?,
            stacks: take(ebpf, kernel_names::KERNEL_STACKS)?,
            traced: take(ebpf, kernel_names::TRACED)?,
            comms: take(ebpf, kernel_names::COMMS)?,
            drops: take(ebpf, names::DROPS)?,
            stack_cache: HashMap::new(),
        })
    }

    /// Counts allocations made in the context of `pid` (when the programs filter by process).
    pub fn trace_process(&mut self, pid: u32) -> Result<()> {
        self.traced
            .insert(&pid, &1, 0)
            .with_context(|| format!("adding pid {pid} to the traced processes"))
    }

    /// Every site with its counters summed over CPUs, sorted by key.
    pub fn read_sites(&self) -> Result<Vec<KernelSite>> {
        let mut sites = Vec::new();
        for entry in self.sites.iter() {
            let (key, per_cpu) = entry.context("reading the kernel site table")?;
            let mut total = KernelCounters::default();
            for c in per_cpu.iter() {
                total.alloc_objects += c.alloc_objects;
                total.alloc_bytes += c.alloc_bytes;
                total.alloc_requested += c.alloc_requested;
                total.free_objects += c.free_objects;
                total.free_bytes += c.free_bytes;
                total.free_requested += c.free_requested;
            }
            sites.push(KernelSite {
                key,
                counters: total,
            });
        }
        sites.sort_by_key(|s| s.key);
        Ok(sites)
    }

    /// The kernel stack with hash `stack` (return addresses, innermost first); empty
    /// when none was stored.
    pub fn stack(&mut self, stack: u64) -> Arc<[u64]> {
        if stack == 0 {
            return Arc::from(Vec::new());
        }
        if let Some(frames) = self.stack_cache.get(&stack) {
            return Arc::clone(frames);
        }
        let frames: Arc<[u64]> = match self.stacks.get(&stack, 0) {
            Ok(trace) => {
                let len = (trace.len as usize).min(trace.frames.len());
                trace.frames[..len].into()
            }
            Err(_) => return Arc::from(Vec::new()),
        };
        self.stack_cache.insert(stack, Arc::clone(&frames));
        frames
    }

    /// How full the site, stack and live-block tables are, from the sites just read
    /// (whose stacks have been read: see [`KernelMaps::stack`]).
    pub fn occupancy(&self, sites: &[KernelSite]) -> super::Occupancy {
        let stacks: std::collections::HashSet<u64> = sites
            .iter()
            .map(|s| s.key.stack)
            .filter(|stack| self.stack_cache.contains_key(stack))
            .collect();
        super::Occupancy {
            // A block that did not fit in the live table is counted as freed at once.
            live_blocks: sites.iter().map(|s| s.values()[2]).sum(),
            sites: sites.len() as u64,
            stacks: stacks.len() as u64,
        }
    }

    /// The command name the programs recorded for `tgid`.
    pub fn comm(&self, tgid: u32) -> Option<String> {
        let raw = self.comms.get(&tgid, 0).ok()?;
        let len = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
        Some(String::from_utf8_lossy(&raw[..len]).into_owned())
    }

    /// Drop counters summed over CPUs, indexed by [`DropReason`].
    pub fn read_drops(&self) -> Result<[u64; DropReason::COUNT as usize]> {
        super::read_drops(&self.drops)
    }
}
