//! The programs' site table as the daemon sees it: `SITES` (each site's key and
//! index), `SITE_COUNTERS` (per-CPU counters by index) and `SITE_IDS_FREE` (indices
//! given back), read in batches.

use std::{collections::HashMap, os::fd::OwnedFd, sync::atomic::Ordering};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuValues, Queue},
};
use heapprof_common::{SiteCounters, SiteId, StackKey, WalkEpoch, names};

use super::{batch, read_entries, take, take_with_fd};
use crate::bpf_array::MappedArray;

/// A site in the table: its key, index and counters summed over CPUs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TableSite {
    /// Process, image, stack and function.
    pub key: StackKey,
    /// Its index in `SITE_COUNTERS`.
    pub id: SiteId,
    /// Its counters.
    pub counters: SiteCounters,
}

/// The site table.
pub(crate) struct SiteTable {
    ids: BpfHashMap<MapData, StackKey, SiteId>,
    ids_fd: OwnedFd,
    counters: PerCpuArray<MapData, SiteCounters>,
    counters_fd: OwnedFd,
    free: Queue<MapData, SiteId>,
    /// `WALK_EPOCH`, whose [`WalkEpoch::Sites`] counter says when indices were given
    /// back: walks the programs remember keep a site index.
    epoch: MappedArray<u64>,
    retirements: u64,
    cpus: usize,
}

impl SiteTable {
    /// Takes the table's maps out of a loaded object.
    pub(crate) fn take(ebpf: &mut Ebpf, cpus: usize) -> Result<Self> {
        let (ids, ids_fd) = take_with_fd(ebpf, names::SITES)?;
        let counters_fd = array_fd(ebpf, names::SITE_COUNTERS)?;
        Ok(Self {
            ids,
            ids_fd,
            counters: take(ebpf, names::SITE_COUNTERS)?,
            counters_fd,
            free: take(ebpf, names::SITE_IDS_FREE)?,
            epoch: MappedArray::map(ebpf, names::WALK_EPOCH)?,
            retirements: 0,
            cpus,
        })
    }

    /// Every site's key and index, in no order.
    pub(crate) fn ids(&self) -> Result<Vec<(StackKey, SiteId)>> {
        let mut ids = Vec::new();
        self.for_each_id(|key, id| ids.push((key, id)))?;
        Ok(ids)
    }

    /// Calls `each` with every site's key and index, in no order: in batches where the
    /// kernel reads them so, else one lookup at a time.
    fn for_each_id(&self, mut each: impl FnMut(StackKey, SiteId)) -> Result<()> {
        let table = &self.ids;
        read_entries(
            &self.ids_fd,
            None,
            |key: StackKey, id: &[SiteId]| {
                if let Some(&id) = id.first() {
                    each(key, id);
                }
            },
            |each| {
                // A key deleted during the walk is skipped.
                for (key, id) in table.iter().filter_map(Result::ok) {
                    each(key, &[id]);
                }
                Ok(())
            },
        )
    }

    /// Every site with its counters summed over CPUs, sorted by index; `peaks` gives
    /// each process's count of new in-use peaks, read before the counters, which
    /// resolves what each site held at its process's peak (see [`SiteCounters`]);
    /// `expected` sites are made room for at once.
    ///
    /// The sites are the one list this builds: the counters, read in index order, are
    /// added to them as they come. Tables indexed by site (counters, peaks) beside the
    /// list took as much memory again at 100k sites.
    pub(crate) fn read(
        &self,
        peaks: &HashMap<u32, u64>,
        expected: usize,
    ) -> Result<Vec<TableSite>> {
        let mut sites: Vec<TableSite> = Vec::with_capacity(expected);
        self.for_each_id(|key, id| {
            sites.push(TableSite {
                key,
                id,
                counters: SiteCounters::default(),
            });
        })?;
        sites.sort_unstable_by_key(|site| site.id);
        let len = sites.last().map_or(0, |site| site.id as usize + 1);
        let add = |site: &mut TableSite, per_cpu: &[SiteCounters]| {
            let peaks = peaks.get(&site.key.tgid).copied().unwrap_or(0);
            per_cpu
                .iter()
                .for_each(|c| super::add_cpu(&mut site.counters, c, peaks));
        };
        // An array's batches come in index order: a merge with the sorted sites.
        let mut next = 0;
        let batched = batch::for_each_batch_upto(
            &self.counters_fd,
            Some(self.cpus),
            len,
            |indices: &[u32], values: &[SiteCounters]| {
                for (&index, per_cpu) in indices.iter().zip(values.chunks_exact(self.cpus.max(1))) {
                    while sites.get(next).is_some_and(|site| site.id < index) {
                        next += 1;
                    }
                    // Every key with this index (one, unless the table changed meanwhile).
                    for site in sites[next..].iter_mut().take_while(|s| s.id == index) {
                        add(site, per_cpu);
                    }
                }
            },
        )
        .context("reading the site counters in batches")?;
        if !batched {
            for site in &mut sites {
                let per_cpu = self
                    .counters
                    .get(&site.id, 0)
                    .context("reading the site counters")?;
                add(site, &per_cpu);
            }
        }
        Ok(sites)
    }

    /// Removes `sites` from the table (their processes or images are gone, so nothing
    /// counts at them any more): their keys go, their counters are zeroed, the walks
    /// the programs remember are retired, then their indices are given back. Returns
    /// how many were removed.
    pub(crate) fn remove(&mut self, sites: &[(StackKey, SiteId)]) -> usize {
        let mut freed = Vec::with_capacity(sites.len());
        for (key, id) in sites {
            if self.ids.remove(key).is_err() {
                continue;
            }
            let zero = PerCpuValues::try_from(vec![SiteCounters::default(); self.cpus.max(1)]);
            if let Ok(zero) = zero {
                let _ = self.counters.set(*id, zero, 0);
            }
            freed.push(*id);
        }
        if freed.is_empty() {
            return 0;
        }
        self.retirements += 1;
        if let Some(epoch) = self.epoch.word(WalkEpoch::Sites as usize, 0) {
            epoch.store(self.retirements, Ordering::Release);
        }
        for &id in &freed {
            // A full queue only loses the index for reuse.
            if self.free.push(&id, 0).is_err() {
                log::debug!("site index {id} not given back: the free list is full");
            }
        }
        freed.len()
    }
}

/// A second descriptor of the array `name`, for batch reads.
pub(crate) fn array_fd(ebpf: &Ebpf, name: &str) -> Result<OwnedFd> {
    use std::os::fd::AsFd as _;
    match ebpf.map(name) {
        Some(aya::maps::Map::PerCpuArray(data) | aya::maps::Map::Array(data)) => data
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .with_context(|| format!("duplicating the descriptor of BPF map {name}")),
        Some(_) => anyhow::bail!("BPF map {name} is not an array"),
        None => anyhow::bail!("BPF map {name} missing from the object"),
    }
}
