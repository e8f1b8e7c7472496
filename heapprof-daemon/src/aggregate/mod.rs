//! Reading the BPF maps into per-site counts.
//!
//! The BPF side keeps cumulative counters per site (process x stack x function);
//! in-use is allocated minus freed. Reading is a batched walk over the site table
//! plus the stacks not seen before ([`batch`]), so a dump costs in proportion to the
//! number of sites, never to the number of allocations. The stacks are kept in
//! the daemon once read ([`stacks`]): the BPF side's copy of an exited process's
//! stacks goes with its sites.

mod batch;
pub mod kernel;
mod live;
pub mod sampling;
mod sites;
pub mod stacks;

use std::{
    collections::{HashMap, HashSet},
    os::fd::{AsFd as _, OwnedFd},
    sync::atomic::Ordering,
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf, Pod,
    maps::{HashMap as BpfHashMap, Map, MapData, PerCpuArray},
};
use heapprof_common::{
    DropReason, InFlight, InFlightSlot, ProcessUsage, ProcessUsageSlot, SiteCounters, SiteId,
    StackKey, UserStack, names, unwind::ForkOrigin,
};
use live::LiveTable;
use sites::SiteTable;
use stacks::StackStore;

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

    /// The profile's values, in the order of `pprof::builder::USER_SAMPLE_TYPES`:
    /// allocated, in-use, temporary and at-the-peak objects and bytes, scaled to
    /// estimates of the real counts when sampling at `sample_rate`.
    pub fn values(&self, sample_rate: u64) -> [u64; 8] {
        let c = &self.counters;
        let scaled = |objects, bytes| sampling::scale(objects, bytes, sample_rate);
        let (alloc_objects, alloc_bytes) = scaled(c.alloc_objects, c.alloc_bytes);
        let (inuse_objects, inuse_bytes) = scaled(self.inuse_objects(), self.inuse_bytes());
        let (temp_objects, temp_bytes) = scaled(c.temp_objects, c.temp_bytes);
        // A site's value at the peak cannot be negative; wrapped sums of CPUs' copies
        // that are would be a counting error.
        let positive = |v: u64| if (v as i64) < 0 { 0 } else { v };
        let (peak_objects, peak_bytes) = scaled(positive(c.peak_objects), positive(c.peak_bytes));
        [
            alloc_objects,
            alloc_bytes,
            inuse_objects,
            inuse_bytes,
            temp_objects,
            temp_bytes,
            peak_objects,
            peak_bytes,
        ]
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
    sites: SiteTable,
    stacks: BpfHashMap<MapData, u64, UserStack>,
    live: LiveTable,
    drops: PerCpuArray<MapData, u64>,
    in_flight: BpfHashMap<MapData, u64, InFlight>,
    in_flight_slots: crate::bpf_array::ArrayHandle<InFlightSlot>,
    exec_gen: BpfHashMap<MapData, u32, u32>,
    fork_origins: BpfHashMap<MapData, u32, ForkOrigin>,
    usage: BpfHashMap<MapData, u32, ProcessUsage>,
    usage_slots: crate::bpf_array::MappedArray<ProcessUsageSlot>,
    /// The stack table again, for batch reads.
    stacks_fd: OwnedFd,
    /// Stacks already read; a hash names one stack for as long as its process lives.
    stack_store: StackStore,
    /// Sites of processes that have exited: allocations kept, in-use cleared.
    retired: HashMap<StackKey, SiteCounters>,
    /// Sites in the last read, to size the next one.
    last_read: usize,
    /// Stacks of the sites read last that the programs could not store (stack table
    /// full): looked up one by one, but never a reason to read the whole table again.
    unstored: HashSet<u64>,
}

/// Stacks missing from the store above which the whole stack table is read in
/// batches rather than one lookup per stack.
const BATCH_STACKS_FROM: usize = 256;

pub(crate) fn take<T: TryFrom<aya::maps::Map>>(ebpf: &mut Ebpf, name: &str) -> Result<T>
where
    T::Error: std::error::Error + Send + Sync + 'static,
{
    let map = ebpf
        .take_map(name)
        .with_context(|| format!("BPF map {name} missing from the object"))?;
    T::try_from(map).with_context(|| format!("BPF map {name} has an unexpected type"))
}

/// Takes a hash map out of a loaded object together with a second descriptor of it,
/// for the system calls aya has no method for (batch lookups).
pub(crate) fn take_with_fd<T: TryFrom<Map>>(ebpf: &mut Ebpf, name: &str) -> Result<(T, OwnedFd)>
where
    T::Error: std::error::Error + Send + Sync + 'static,
{
    let data = match ebpf.map(name) {
        Some(Map::HashMap(data) | Map::PerCpuHashMap(data)) => data,
        Some(_) => bail!("BPF map {name} is not a hash map"),
        None => bail!("BPF map {name} missing from the object"),
    };
    let fd = data
        .fd()
        .as_fd()
        .try_clone_to_owned()
        .with_context(|| format!("duplicating the descriptor of BPF map {name}"))?;
    Ok((take(ebpf, name)?, fd))
}

/// The number of possible CPUs: the values per entry of a per-CPU map.
pub(crate) fn possible_cpus() -> Result<usize> {
    aya::util::nr_cpus()
        .map(|cpus| cpus.get() as usize)
        .map_err(|(what, err)| anyhow::anyhow!("reading {what}: {err}"))
}

/// Every entry of a hash map, `(key, values)`, values per CPU for a per-CPU map
/// (`per_cpu`), batched where the kernel can (see [`batch`]), otherwise through
/// `walk`, which reads the map key by key.
pub(crate) fn read_entries<K: Pod, V: Pod>(
    fd: &OwnedFd,
    per_cpu: Option<usize>,
    mut each: impl FnMut(K, &[V]),
    walk: impl FnOnce(&mut dyn FnMut(K, &[V])) -> Result<()>,
) -> Result<()> {
    let slots = per_cpu.map_or(1, |cpus| cpus.max(1));
    let batched = batch::for_each_batch(fd, per_cpu, |keys: &[K], values: &[V]| {
        for (key, values) in keys.iter().zip(values.chunks_exact(slots)) {
            each(*key, values);
        }
    })
    .context("reading a BPF table in batches")?;
    if batched {
        return Ok(());
    }
    walk(&mut each)
}

/// Reads into `store` the stacks of `wanted` (the hashes of the sites' stacks; 0
/// is no stack) that it does not hold. When many are missing (the first profile of
/// a large program), or when looking them up one by one would cost more than
/// reading the whole table (many sites whose stacks the programs could not store),
/// the table is read in batches; otherwise each is looked up. `unstored` keeps the
/// hashes still missing afterwards, which alone never make the table be read whole.
pub(crate) fn read_missing_stacks<S: Pod>(
    store: &mut StackStore,
    unstored: &mut HashSet<u64>,
    mut wanted: Vec<u64>,
    fd: &OwnedFd,
    table: &BpfHashMap<MapData, u64, S>,
    frames: fn(&S) -> &[u64],
) -> Result<()> {
    wanted.retain(|&stack| stack != 0 && !store.contains(stack));
    wanted.sort_unstable();
    wanted.dedup();
    let missing = wanted;
    let new = missing.iter().filter(|h| !unstored.contains(h)).count();
    // The table holds about the stacks stored plus the new ones.
    let walk = missing.len() >= BATCH_STACKS_FROM
        && (new >= BATCH_STACKS_FROM || missing.len() * 2 >= store.len() + new);
    if walk {
        store.reserve(new, new * 4);
        let batched = batch::for_each_batch(fd, None, |hashes, stacks| {
            store.insert_many(
                hashes
                    .iter()
                    .zip(stacks)
                    .filter(|(hash, _)| missing.binary_search(hash).is_ok())
                    .map(|(&hash, stack)| (hash, frames(stack))),
            );
        })
        .context("reading the stack table in batches")?;
        if !batched {
            for entry in table.iter() {
                let (hash, stack) = entry.context("reading the stack table")?;
                if missing.binary_search(&hash).is_ok() {
                    store.insert(hash, frames(&stack));
                }
            }
        }
    } else {
        for &hash in &missing {
            if let Ok(stack) = table.get(&hash, 0) {
                store.insert(hash, frames(&stack));
            }
        }
    }
    *unstored = missing
        .into_iter()
        .filter(|&hash| !store.contains(hash))
        .collect();
    Ok(())
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
    // Counted unseen when their address came back, these frees arrived after all.
    let late: u64 = map
        .get(&heapprof_common::LATE_FREES_SLOT, 0)
        .context("reading the late frees' counter")?
        .iter()
        .sum();
    let unseen = &mut drops[DropReason::FreeUnseen as usize];
    *unseen = unseen.saturating_sub(late);
    Ok(drops)
}

impl Maps {
    /// Takes the maps out of a loaded object.
    pub fn new(ebpf: &mut Ebpf) -> Result<Self> {
        let (stacks, stacks_fd) = take_with_fd(ebpf, names::STACKS)?;
        let cpus = possible_cpus()?;
        Ok(Self {
            sites: SiteTable::take(ebpf, cpus)?,
            stacks,
            live: LiveTable::of(ebpf)?,
            drops: take(ebpf, names::DROPS)?,
            in_flight: take(ebpf, names::IN_FLIGHT)?,
            in_flight_slots: crate::bpf_array::ArrayHandle::of(ebpf, names::IN_FLIGHT_SLOTS)?,
            exec_gen: take(ebpf, names::EXEC_GEN)?,
            fork_origins: take(ebpf, names::FORK_ORIGINS)?,
            usage: take(ebpf, names::PROCESS_USAGE)?,
            usage_slots: crate::bpf_array::MappedArray::map(ebpf, names::USAGE_SLOTS)?,
            stacks_fd,
            stack_store: StackStore::new(),
            retired: HashMap::new(),
            last_read: 0,
            unstored: HashSet::new(),
        })
    }

    /// Every site with its counters summed over CPUs, including retired ones, sorted
    /// by key; their stacks are read into [`Maps::stacks`].
    pub fn read_sites(&mut self) -> Result<Vec<Site>> {
        let started = std::time::Instant::now();
        let peaks: HashMap<u32, u64> = self
            .process_usage()
            .into_iter()
            .map(|(pid, usage)| (pid, usage.peaks))
            .collect();
        let in_table = self.sites.read(&peaks, self.last_read)?;
        // Converted where they lie (a vector's `map` and `collect` reuse its memory):
        // a second list of 100k sites beside the first cost 10 MiB at the peak.
        let mut sites: Vec<Site> = in_table
            .into_iter()
            .map(|site| Site {
                key: site.key,
                counters: site.counters,
            })
            .collect();
        sites.reserve_exact(self.retired.len());
        sites.extend(
            self.retired
                .iter()
                .map(|(&key, &counters)| Site { key, counters }),
        );
        // Unstable: a stable sort's scratch would be another 8 MiB at 100k sites; the
        // duplicates it leaves in either order are summed.
        sites.sort_unstable_by_key(|s| s.key);
        // A key both retired and back in the table (a reused pid) is one site.
        sites.dedup_by(|later, earlier| {
            let same = later.key == earlier.key;
            if same {
                add_counters(&mut earlier.counters, &later.counters);
            }
            same
        });
        self.last_read = sites.len();
        let read = started.elapsed();
        let stored = self.stack_store.len();
        self.read_stacks(&sites)?;
        log::debug!(
            "read {} sites in {:.1} ms, {} new stacks in {:.1} ms ({} stacks, {} frames stored)",
            sites.len(),
            read.as_secs_f64() * 1e3,
            self.stack_store.len() - stored,
            (started.elapsed() - read).as_secs_f64() * 1e3,
            self.stack_store.len(),
            self.stack_store.nodes_in_use(),
        );
        Ok(sites)
    }

    /// Reads the stacks of `sites` not stored yet (see [`read_missing_stacks`]).
    fn read_stacks(&mut self, sites: &[Site]) -> Result<()> {
        let missing = sites.iter().map(|s| s.key.stack).collect();
        read_missing_stacks(
            &mut self.stack_store,
            &mut self.unstored,
            missing,
            &self.stacks_fd,
            &self.stacks,
            user_frames,
        )
    }

    /// Reads one stack into the store, if the programs stored it.
    fn read_stack(&mut self, hash: u64) {
        if self.stack_store.contains(hash) {
            return;
        }
        if let Ok(stack) = self.stacks.get(&hash, 0) {
            self.stack_store.insert(hash, user_frames(&stack));
        }
    }

    /// The stacks of the sites read so far (see [`Maps::read_sites`]); a stack the
    /// programs could not store (stack table full) has no frames.
    pub fn stacks(&self) -> &StackStore {
        &self.stack_store
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
            if self.stack_store.contains(site.key.stack) {
                stacks.insert(site.key.stack);
            }
        }
        occupancy.stacks = stacks.len() as u64;
        occupancy
    }

    /// The processes with sites still in the BPF table (not retired).
    pub fn traced_pids(&self) -> Result<HashSet<u32>> {
        Ok(self
            .sites
            .ids()?
            .into_iter()
            .map(|(key, _)| key.tgid)
            .collect())
    }

    /// Drop counters summed over CPUs, indexed by [`DropReason`].
    pub fn read_drops(&self) -> Result<[u64; DropReason::COUNT as usize]> {
        read_drops(&self.drops)
    }

    /// Removes the per-thread call state of threads that have exited (the BPF side keeps
    /// a thread's record between calls, and its exit removes it: this catches the ones
    /// it missed). Returns how many records are left.
    pub fn remove_exited_threads(&mut self) -> usize {
        let exited = |pid_tgid: u64| {
            let (tgid, tid) = (pid_tgid >> 32, pid_tgid & 0xffff_ffff);
            !std::path::Path::new(&format!("/proc/{tgid}/task/{tid}")).exists()
        };
        let keys: Vec<u64> = self.in_flight.keys().filter_map(|k| k.ok()).collect();
        let mut left = keys.len();
        for pid_tgid in keys {
            if exited(pid_tgid) && self.in_flight.remove(&pid_tgid).is_ok() {
                left -= 1;
            }
        }
        let slots = match self.in_flight_slots.map() {
            Ok(slots) => slots,
            Err(err) => {
                log::debug!("sweeping the threads' slots: {err:#}");
                return left;
            }
        };
        for index in 0..slots.len() {
            // The owner is the slot's first word.
            let Some(owner) = slots.word(index, 0) else {
                continue;
            };
            let pid_tgid = owner.load(Ordering::Acquire);
            if pid_tgid == 0 {
                continue;
            }
            // Given up only if still that thread's: the programs claim slots atomically.
            if !exited(pid_tgid)
                || owner
                    .compare_exchange(pid_tgid, 0, Ordering::AcqRel, Ordering::Relaxed)
                    .is_err()
            {
                left += 1;
            }
        }
        left
    }

    /// The exec generation of process `tgid` now (0 before its first exec under tracing).
    pub fn exec_generation(&self, tgid: u32) -> u32 {
        self.exec_gen.get(&tgid, 0).unwrap_or(0)
    }

    /// Where process `tgid`'s image `exec_gen` was forked from, while the programs
    /// unwound it with that process's mappings (see [`ForkOrigin`]).
    pub fn fork_origin(&self, tgid: u32, exec_gen: u32) -> Option<ForkOrigin> {
        self.fork_origins
            .get(&tgid, 0)
            .ok()
            .filter(|origin| origin.holds_for(exec_gen))
    }

    /// Forgets the exec generation of a process that has exited (its pid may be reused).
    pub fn forget_exec_generation(&mut self, pid: u32) {
        let _ = self.exec_gen.remove(&pid);
    }

    /// Each process's in-use total and peak as the programs keep them (exact mode).
    pub fn process_usage(&self) -> HashMap<u32, ProcessUsage> {
        let mut usage: HashMap<u32, ProcessUsage> =
            self.usage.iter().filter_map(|e| e.ok()).collect();
        for index in 0..self.usage_slots.len() {
            if let Some(slot) = self.usage_slots.read(index)
                && slot.owner != 0
            {
                usage.insert(slot.owner as u32, slot.usage);
            }
        }
        usage
    }

    /// Forgets the usage of process `pid`, which has exited: its slot is zeroed, then
    /// freed for another process.
    fn forget_usage(&mut self, pid: u32) {
        let _ = self.usage.remove(&pid);
        let index = pid as usize & (self.usage_slots.len().max(1) - 1);
        let (Some(owner), Some(inuse), Some(peak)) = (
            self.usage_slots.word(index, 0),
            self.usage_slots.word(index, 8),
            self.usage_slots.word(index, 16),
        ) else {
            return;
        };
        if owner.load(Ordering::Acquire) == u64::from(pid) {
            inuse.store(0, Ordering::Relaxed);
            peak.store(0, Ordering::Relaxed);
            owner.store(0, Ordering::Release);
        }
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
        let removed = self.live.remove_where(|block| dead.contains(&block.tgid))?;
        let sites = self.retire_sites(|key| dead.contains(&key.tgid))?;
        for pid in dead {
            let _ = self.exec_gen.remove(pid);
            self.forget_usage(*pid);
        }
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
        for &stack in &stacks {
            self.stack_store.forget(stack);
        }
        // Gone with their retirement already; a process that left no site still
        // may have entries.
        for pid in pids {
            let _ = self.exec_gen.remove(pid);
            self.forget_usage(*pid);
        }
        before - self.retired.len()
    }

    /// Retires the images that processes have replaced by exec: `current` maps each
    /// process to its generation now; sites of earlier generations keep their
    /// allocations, and their memory, gone with the old address space, is no longer
    /// in use. `sites`, just read, are updated to match. Returns how many sites were
    /// retired.
    pub fn retire_replaced_images(
        &mut self,
        current: &HashMap<u32, u32>,
        sites: &mut [Site],
    ) -> Result<usize> {
        let replaced = |key: &StackKey| {
            current
                .get(&key.tgid)
                .is_some_and(|&generation| key.exec_gen < generation)
        };
        if !sites
            .iter()
            .any(|s| replaced(&s.key) && !self.retired.contains_key(&s.key))
        {
            return Ok(0);
        }
        // Live blocks first: once they are gone, no free can be credited to a retired site.
        let replaced_ids: HashSet<SiteId> = self
            .sites
            .ids()?
            .into_iter()
            .filter(|(key, _)| replaced(key))
            .map(|(_, id)| id)
            .collect();
        let removed = self
            .live
            .remove_where(|block| replaced_ids.contains(&block.site))?;
        let count = self.retire_sites_in(sites, replaced)?;
        log::debug!("retired {count} sites of replaced images, {removed} live blocks removed");
        Ok(count)
    }

    /// Moves the sites matching `retire` out of the BPF table into `retired`, with
    /// everything freed. Their stacks stay readable from the daemon's cache.
    fn retire_sites(&mut self, retire: impl Fn(&StackKey) -> bool) -> Result<usize> {
        let mut sites = self.read_sites()?;
        self.retire_sites_in(&mut sites, retire)
    }

    /// [`Maps::retire_sites`] over sites just read, which are updated to match.
    fn retire_sites_in(
        &mut self,
        sites: &mut [Site],
        retire: impl Fn(&StackKey) -> bool,
    ) -> Result<usize> {
        // Their indices, read again: rare, and no map of every site's index is kept.
        let mut ids: HashMap<StackKey, SiteId> = self
            .sites
            .ids()?
            .into_iter()
            .filter(|(key, _)| retire(key))
            .collect();
        let mut leaving = Vec::new();
        for site in sites {
            if !retire(&site.key) {
                continue;
            }
            let Some(id) = ids.remove(&site.key) else {
                continue; // retired already
            };
            let counters = &mut site.counters;
            counters.free_objects = counters.alloc_objects;
            counters.free_bytes = counters.alloc_bytes;
            self.retired.insert(site.key, *counters);
            // Keep the frames for later profiles; the kernel's copy can go.
            self.read_stack(site.key.stack);
            let _ = self.stacks.remove(&site.key.stack);
            leaving.push((site.key, id));
        }
        // No writer is left: the process (or its image) is gone.
        Ok(self.sites.remove(&leaving))
    }
}

/// Adds one earlier read's counters (summed over CPUs, their peak values resolved)
/// to a total.
fn add_counters(total: &mut SiteCounters, more: &SiteCounters) {
    total.alloc_objects += more.alloc_objects;
    total.alloc_bytes += more.alloc_bytes;
    total.free_objects += more.free_objects;
    total.free_bytes += more.free_bytes;
    total.temp_objects += more.temp_objects;
    total.temp_bytes += more.temp_bytes;
    total.peak_objects = total.peak_objects.wrapping_add(more.peak_objects);
    total.peak_bytes = total.peak_bytes.wrapping_add(more.peak_bytes);
}

/// Adds one CPU's copy of a site's counters to its total, with what the copy held at
/// its process's peak number `peaks` (see [`SiteCounters`]): in the total,
/// `peak_objects`/`peak_bytes` are the site's values at that peak.
fn add_cpu(total: &mut SiteCounters, cpu: &SiteCounters, peaks: u64) {
    let (objects, bytes) = cpu.at_peak(peaks);
    add_counters(
        total,
        &SiteCounters {
            peak_objects: objects,
            peak_bytes: bytes,
            peak_generation: peaks,
            ..*cpu
        },
    );
    total.peak_generation = peaks;
}

/// The frames a stack-table entry holds, innermost first.
fn user_frames(stack: &UserStack) -> &[u64] {
    &stack.frames[..(stack.len as usize).min(stack.frames.len())]
}
