//! Reading the BPF maps into per-site counts.
//!
//! The BPF side keeps cumulative counters per site (process x stack x function);
//! in-use is allocated minus freed. Reading is a walk over the site table plus the
//! stacks not seen before, so a dump costs in proportion to the number of sites,
//! never to the number of allocations.

pub mod kernel;
pub mod sampling;

use std::collections::{HashMap, HashSet};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuHashMap},
};
use heapprof_common::{
    DropReason, InFlight, LiveBlock, LiveKey, ProcessUsage, SiteCounters, StackKey, UserStack,
    names,
};

/// Counts of one site, summed over CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Site {
    /// Process, stack and function.
    pub key: StackKey,
    /// Cumulative counters.
    pub counters: SiteCounters,
}

impl Site {
    /// Blocks allocated here and not freed.
    pub fn inuse_objects(&self) -> u64 {
        self.counters
            .alloc_objects
            .saturating_sub(self.counters.free_objects)
    }
    /// Bytes allocated here and not freed.
    pub fn inuse_bytes(&self) -> u64 {
        self.counters
            .alloc_bytes
            .saturating_sub(self.counters.free_bytes)
    }

    /// The profile's four values (allocated objects and bytes, in-use objects and
    /// bytes), scaled to estimates of the real counts when sampling at `sample_rate`.
    pub fn values(&self, sample_rate: u64) -> [u64; 4] {
        let (alloc_objects, alloc_bytes) = sampling::scale(
            self.counters.alloc_objects,
            self.counters.alloc_bytes,
            sample_rate,
        );
        let (inuse_objects, inuse_bytes) =
            sampling::scale(self.inuse_objects(), self.inuse_bytes(), sample_rate);
        [alloc_objects, alloc_bytes, inuse_objects, inuse_bytes]
    }
}

/// Entries in the BPF tables that grow with the traced programs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Occupancy {
    /// Blocks in the live-block table.
    pub live_blocks: u64,
    /// Sites in the site table.
    pub sites: u64,
    /// Stacks in the stack table (those of the sites; a stack whose site did not fit
    /// is not counted).
    pub stacks: u64,
}

/// Owns the maps the daemon reads.
pub struct Maps {
    sites: PerCpuHashMap<MapData, StackKey, SiteCounters>,
    stacks: BpfHashMap<MapData, u64, UserStack>,
    live: BpfHashMap<MapData, LiveKey, LiveBlock>,
    drops: PerCpuArray<MapData, u64>,
    in_flight: BpfHashMap<MapData, u64, InFlight>,
    exec_gen: BpfHashMap<MapData, u32, u32>,
    usage: BpfHashMap<MapData, u32, ProcessUsage>,
    /// Stacks already read, by hash; an entry is never replaced while its process lives.
    stack_cache: HashMap<u64, std::sync::Arc<[u64]>>,
    /// Sites of processes that have exited: allocations kept, in-use cleared.
    retired: HashMap<StackKey, SiteCounters>,
}

pub(crate) fn take<T: TryFrom<aya::maps::Map>>(ebpf: &mut Ebpf, name: &str) -> Result<T>
where
    T::Error: std::error::Error + Send + Sync + 'static,
{
    let map = ebpf
        .take_map(name)
        .with_context(|| format!("BPF map {name} missing from the object"))?;
    T::try_from(map).with_context(|| format!("BPF map {name} has an unexpected type"))
}

/// The per-CPU drop counters summed over CPUs, indexed by [`DropReason`].
pub(crate) fn read_drops(
    map: &PerCpuArray<MapData, u64>,
) -> Result<[u64; DropReason::COUNT as usize]> {
    let mut drops = [0u64; DropReason::COUNT as usize];
    for reason in DropReason::ALL {
        let per_cpu = map
            .get(&(reason as u32), 0)
            .context("reading the drop counters")?;
        drops[reason as usize] = per_cpu.iter().sum();
    }
    Ok(drops)
}

impl Maps {
    /// Takes the maps out of a loaded object.
    pub fn new(ebpf: &mut Ebpf) -> Result<Self> {
        Ok(Self {
            sites: take(ebpf, names::SITES)?,
            stacks: take(ebpf, names::STACKS)?,
            live: take(ebpf, names::LIVE)?,
            drops: take(ebpf, names::DROPS)?,
            in_flight: take(ebpf, names::IN_FLIGHT)?,
            exec_gen: take(ebpf, names::EXEC_GEN)?,
            usage: take(ebpf, names::PROCESS_USAGE)?,
            stack_cache: HashMap::new(),
            retired: HashMap::new(),
        })
    }

    /// Every site with its counters summed over CPUs, including retired ones.
    pub fn read_sites(&self) -> Result<Vec<Site>> {
        let mut sites: HashMap<StackKey, SiteCounters> = self.retired.clone();
        for entry in self.sites.iter() {
            let (key, per_cpu) = entry.context("reading the site table")?;
            let total = sites.entry(key).or_default();
            for counters in per_cpu.iter() {
                total.alloc_objects += counters.alloc_objects;
                total.alloc_bytes += counters.alloc_bytes;
                total.free_objects += counters.free_objects;
                total.free_bytes += counters.free_bytes;
            }
        }
        let mut sites: Vec<Site> = sites
            .into_iter()
            .map(|(key, counters)| Site { key, counters })
            .collect();
        sites.sort_by_key(|s| s.key);
        Ok(sites)
    }

    /// How full the site, stack and live-block tables are, from the sites just read
    /// (walking the live table itself would cost a system call per block).
    pub fn occupancy(&self, sites: &[Site]) -> Occupancy {
        // Retired sites have left the BPF tables (a key retired and in use again,
        // after a pid was reused, is left out: rare, and off by one).
        let in_tables = sites.iter().filter(|s| !self.retired.contains_key(&s.key));
        let mut stacks = HashSet::new();
        let mut occupancy = Occupancy::default();
        for site in in_tables {
            occupancy.sites += 1;
            // Every live-table entry is a block counted in use at its site: the
            // programs count a block that did not fit as freed at once.
            occupancy.live_blocks += site.inuse_objects();
            if self.stack_cache.contains_key(&site.key.stack) {
                stacks.insert(site.key.stack);
            }
        }
        occupancy.stacks = stacks.len() as u64;
        occupancy
    }

    /// The processes with sites still in the BPF table (not retired).
    pub fn traced_pids(&self) -> HashSet<u32> {
        self.sites
            .keys()
            .filter_map(|key| key.ok())
            .map(|key| key.tgid)
            .collect()
    }

    /// The user stack (return addresses, innermost first) with hash `stack`; empty
    /// when it was not stored (stack table full).
    pub fn stack(&mut self, stack: u64) -> std::sync::Arc<[u64]> {
        if let Some(frames) = self.stack_cache.get(&stack) {
            return std::sync::Arc::clone(frames);
        }
        let frames: std::sync::Arc<[u64]> = match self.stacks.get(&stack, 0) {
            Ok(trace) => {
                let len = (trace.len as usize).min(trace.frames.len());
                trace.frames[..len].into()
            }
            // Not stored: not cached either, a later read may find it.
            Err(_) => return std::sync::Arc::from(Vec::new()),
        };
        self.stack_cache
            .insert(stack, std::sync::Arc::clone(&frames));
        frames
    }

    /// Drop counters summed over CPUs, indexed by [`DropReason`].
    pub fn read_drops(&self) -> Result<[u64; DropReason::COUNT as usize]> {
        read_drops(&self.drops)
    }

    /// Removes the per-thread call state of threads that have exited (the BPF side keeps
    /// a thread's entry between calls). Returns how many entries are left.
    pub fn remove_exited_threads(&mut self) -> usize {
        let keys: Vec<u64> = self.in_flight.keys().filter_map(|k| k.ok()).collect();
        let mut left = keys.len();
        for pid_tgid in keys {
            let (tgid, tid) = (pid_tgid >> 32, pid_tgid & 0xffff_ffff);
            if !std::path::Path::new(&format!("/proc/{tgid}/task/{tid}")).exists()
                && self.in_flight.remove(&pid_tgid).is_ok()
            {
                left -= 1;
            }
        }
        left
    }

    /// The exec generation of process `tgid` now (0 before its first exec under tracing).
    pub fn exec_generation(&self, tgid: u32) -> u32 {
        self.exec_gen.get(&tgid, 0).unwrap_or(0)
    }

    /// Forgets the exec generation of a process that has exited (its pid may be reused).
    pub fn forget_exec_generation(&mut self, pid: u32) {
        let _ = self.exec_gen.remove(&pid);
    }

    /// Each process's in-use total and peak as the programs keep them (exact mode).
    pub fn process_usage(&self) -> HashMap<u32, ProcessUsage> {
        self.usage.iter().filter_map(|e| e.ok()).collect()
    }

    /// Every process that has called exec while traced, with its current generation.
    pub fn exec_generations(&self) -> HashMap<u32, u32> {
        self.exec_gen.iter().filter_map(|e| e.ok()).collect()
    }

    /// Removes every trace of processes that have exited from the BPF maps: their
    /// allocations are kept (retired, in-use zero since the process's memory is gone),
    /// their live blocks and counters leave the tables.
    pub fn retire_processes(&mut self, dead: &HashSet<u32>) -> Result<()> {
        if dead.is_empty() {
            return Ok(());
        }
        let stale_live: Vec<LiveKey> = self
            .live
            .keys()
            .filter_map(|k| k.ok())
            .filter(|k| dead.contains(&k.tgid))
            .collect();
        let sites = self.retire_sites(|key| dead.contains(&key.tgid))?;
        for pid in dead {
            let _ = self.exec_gen.remove(pid);
            let _ = self.usage.remove(pid);
        }
        let removed = self.remove_live(&stale_live);
        log::debug!(
            "retired {} exited process(es): {sites} sites, {removed} live blocks removed",
            dead.len(),
        );
        Ok(())
    }

    /// Forgets the retired sites of processes `pids` (exited long enough ago, see
    /// `--retain-exited`) and their cached stacks: later profiles no longer show
    /// them. Returns how many sites were forgotten.
    pub fn forget_processes(&mut self, pids: &HashSet<u32>) -> usize {
        let mut stacks = HashSet::new();
        let before = self.retired.len();
        self.retired.retain(|key, _| {
            let forget = pids.contains(&key.tgid);
            if forget {
                stacks.insert(key.stack);
            }
            !forget
        });
        // A stack's hash covers its process: only theirs can go, unless a site kept
        // shares it (a hash collision).
        for key in self.retired.keys() {
            stacks.remove(&key.stack);
        }
        for stack in &stacks {
            self.stack_cache.remove(stack);
        }
        // Gone with their retirement already; a process that left no site still
        // may have entries.
        for pid in pids {
            let _ = self.exec_gen.remove(pid);
            let _ = self.usage.remove(pid);
        }
        before - self.retired.len()
    }

    /// Retires the images that processes have replaced by exec: `current` maps each
    /// process to its generation now; sites of earlier generations keep their
    /// allocations, and their memory, gone with the old address space, is no longer
    /// in use. Returns how many sites were retired.
    pub fn retire_replaced_images(&mut self, current: &HashMap<u32, u32>) -> Result<usize> {
        let replaced = |key: &StackKey| {
            current
                .get(&key.tgid)
                .is_some_and(|&generation| key.exec_gen < generation)
        };
        if !self
            .read_sites()?
            .iter()
            .any(|s| replaced(&s.key) && !self.retired.contains_key(&s.key))
        {
            return Ok(0);
        }
        // Live blocks first: once they are gone, no free can be credited to a retired site.
        let stale_live: Vec<LiveKey> = self
            .live
            .iter()
            .filter_map(|e| e.ok())
            .filter(|(_, block)| replaced(&block.site))
            .map(|(key, _)| key)
            .collect();
        let removed = self.remove_live(&stale_live);
        let sites = self.retire_sites(replaced)?;
        log::debug!("retired {sites} sites of replaced images, {removed} live blocks removed");
        Ok(sites)
    }

    fn remove_live(&mut self, keys: &[LiveKey]) -> usize {
        keys.iter().filter(|k| self.live.remove(k).is_ok()).count()
    }

    /// Moves the sites matching `retire` out of the BPF table into `retired`, with
    /// everything freed. Their stacks stay readable from the daemon's cache.
    fn retire_sites(&mut self, retire: impl Fn(&StackKey) -> bool) -> Result<usize> {
        let mut count = 0;
        for site in self.read_sites()? {
            if retire(&site.key) && self.sites.get(&site.key, 0).is_ok() {
                let mut counters = site.counters;
                counters.free_objects = counters.alloc_objects;
                counters.free_bytes = counters.alloc_bytes;
                self.retired.insert(site.key, counters);
                // Keep the frames for later profiles; the kernel's copy can go.
                self.stack(site.key.stack);
                let _ = self.stacks.remove(&site.key.stack);
                // No writer is left: the process (or its image) is gone.
                let _ = self.sites.remove(&site.key);
                count += 1;
            }
        }
        Ok(count)
    }
}
