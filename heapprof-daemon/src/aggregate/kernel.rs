//! Reading the kernel-mode maps into per-site counts.

use std::{collections::HashSet, os::fd::OwnedFd};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{HashMap as BpfHashMap, MapData, PerCpuArray},
};
use heapprof_common::{
    DropReason, SiteId,
    kernel::{
        CACHE_NAME_LEN, DeferredFreePath, KernelAllocKind, KernelCounters, KernelSiteKey,
        KernelStack, kmalloc_cache_limit, names as kernel_names,
    },
    names,
};

use super::{
    batch, possible_cpus, read_entries, read_missing_stacks, sampling::scale, sites::array_fd,
    stacks::StackStore, take, take_with_fd,
};

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

    /// [`KernelSite::values`] scaled to estimates of the real counts when the
    /// allocations were sampled at `sample_rate` bytes (0: as they are), as user
    /// mode scales them; requested bytes by the factor of the handed-out bytes they
    /// go with (sampling is decided on those).
    pub fn scaled_values(&self, sample_rate: u64) -> [u64; 6] {
        let values = self.values();
        if sample_rate == 0 {
            return values;
        }
        let [
            alloc_objects,
            alloc_bytes,
            inuse_objects,
            inuse_bytes,
            alloc_req,
            inuse_req,
        ] = values;
        let (alloc_objects_s, alloc_bytes_s) = scale(alloc_objects, alloc_bytes, sample_rate);
        let (inuse_objects_s, inuse_bytes_s) = scale(inuse_objects, inuse_bytes, sample_rate);
        let like = |requested: u64, scaled: u64, bytes: u64| {
            if bytes == 0 {
                requested
            } else {
                (requested as f64 * scaled as f64 / bytes as f64).round() as u64
            }
        };
        [
            alloc_objects_s,
            alloc_bytes_s,
            inuse_objects_s,
            inuse_bytes_s,
            like(alloc_req, alloc_bytes_s, alloc_bytes),
            like(inuse_req, inuse_bytes_s, inuse_bytes),
        ]
    }
}

/// Owns the kernel-mode maps the daemon reads.
pub struct KernelMaps {
    /// Each site's index in `counters`.
    sites: BpfHashMap<MapData, KernelSiteKey, SiteId>,
    counters: PerCpuArray<MapData, KernelCounters>,
    stacks: BpfHashMap<MapData, u64, KernelStack>,
    traced: BpfHashMap<MapData, u32, u32>,
    comms: BpfHashMap<MapData, u32, [u8; 16]>,
    cache_names: BpfHashMap<MapData, u64, [u8; CACHE_NAME_LEN]>,
    /// Cache names read so far, by hash (a cache keeps its name).
    cache_names_read: std::collections::HashMap<u64, String>,
    drops: PerCpuArray<MapData, u64>,
    /// Objects the fentry programs freed, by [`DeferredFreePath`].
    deferred_frees: PerCpuArray<MapData, u64>,
    /// The site, counter and stack tables again, for batch reads.
    sites_fd: OwnedFd,
    counters_fd: OwnedFd,
    stacks_fd: OwnedFd,
    /// Possible CPUs: the values per entry of the per-CPU site table.
    cpus: usize,
    /// Stacks already read (kernel stacks never change meaning).
    stack_store: StackStore,
    /// Stacks of the sites read last that the programs could not store: looked up
    /// one by one, but never a reason to read the whole table again.
    unstored: HashSet<u64>,
}

impl KernelMaps {
    /// Takes the maps out of a loaded object.
    pub fn new(ebpf: &mut Ebpf) -> Result<Self> {
        let (sites, sites_fd) = take_with_fd(ebpf, kernel_names::KERNEL_SITES)?;
        let (stacks, stacks_fd) = take_with_fd(ebpf, kernel_names::KERNEL_STACKS)?;
        let counters_fd = array_fd(ebpf, kernel_names::KERNEL_SITE_COUNTERS)?;
        Ok(Self {
            sites,
            counters: take(ebpf, kernel_names::KERNEL_SITE_COUNTERS)?,
            counters_fd,
            stacks,
            traced: take(ebpf, kernel_names::TRACED)?,
            comms: take(ebpf, kernel_names::COMMS)?,
            cache_names: take(ebpf, kernel_names::CACHE_NAMES)?,
            cache_names_read: std::collections::HashMap::new(),
            drops: take(ebpf, names::DROPS)?,
            deferred_frees: take(ebpf, kernel_names::KERNEL_DEFERRED_FREES)?,
            sites_fd,
            stacks_fd,
            cpus: possible_cpus()?,
            stack_store: StackStore::new(),
            unstored: HashSet::new(),
        })
    }

    /// Counts allocations made in the context of `pid` (when the programs filter by process).
    pub fn trace_process(&mut self, pid: u32) -> Result<()> {
        self.traced
            .insert(&pid, &1, 0)
            .with_context(|| format!("adding pid {pid} to the traced processes"))
    }

    /// Every site with its counters summed over CPUs, sorted by key; their stacks
    /// are read into [`KernelMaps::stacks`].
    pub fn read_sites(&mut self) -> Result<Vec<KernelSite>> {
        let mut ids: Vec<(KernelSiteKey, SiteId)> = Vec::new();
        let table = &self.sites;
        read_entries(
            &self.sites_fd,
            None,
            |key: KernelSiteKey, id: &[SiteId]| {
                if let Some(&id) = id.first() {
                    ids.push((key, id));
                }
            },
            |each| {
                for (key, id) in table.iter().filter_map(Result::ok) {
                    each(key, &[id]);
                }
                Ok(())
            },
        )?;
        let len = ids
            .iter()
            .map(|&(_, id)| id as usize + 1)
            .max()
            .unwrap_or(0);
        let mut totals = vec![KernelCounters::default(); len];
        let add = |totals: &mut [KernelCounters], index: usize, per_cpu: &[KernelCounters]| {
            if let Some(total) = totals.get_mut(index) {
                for c in per_cpu {
                    total.alloc_objects += c.alloc_objects;
                    total.alloc_bytes += c.alloc_bytes;
                    total.alloc_requested += c.alloc_requested;
                    total.free_objects += c.free_objects;
                    total.free_bytes += c.free_bytes;
                    total.free_requested += c.free_requested;
                }
            }
        };
        let cpus = self.cpus.max(1);
        let batched = batch::for_each_batch_upto(
            &self.counters_fd,
            Some(cpus),
            len,
            |indices: &[u32], values: &[KernelCounters]| {
                for (&index, per_cpu) in indices.iter().zip(values.chunks_exact(cpus)) {
                    add(&mut totals, index as usize, per_cpu);
                }
            },
        )
        .context("reading the kernel site counters in batches")?;
        if !batched {
            for &(_, id) in &ids {
                let per_cpu = self
                    .counters
                    .get(&id, 0)
                    .context("reading the kernel site counters")?;
                add(&mut totals, id as usize, &per_cpu);
            }
        }
        let mut sites: Vec<KernelSite> = ids
            .into_iter()
            .map(|(key, id)| KernelSite {
                key,
                counters: totals.get(id as usize).copied().unwrap_or_default(),
            })
            .collect();
        sites.sort_by_key(|s| s.key);
        self.read_stacks(&sites)?;
        Ok(sites)
    }

    /// Reads the stacks of `sites` not stored yet (see [`read_missing_stacks`]).
    fn read_stacks(&mut self, sites: &[KernelSite]) -> Result<()> {
        let missing = sites.iter().map(|s| s.key.stack).collect();
        read_missing_stacks(
            &mut self.stack_store,
            &mut self.unstored,
            missing,
            &self.stacks_fd,
            &self.stacks,
            kernel_frames,
        )
    }

    /// The kernel stacks of the sites read so far (return addresses, innermost
    /// first); a stack that was not stored has no frames.
    pub fn stacks(&self) -> &StackStore {
        &self.stack_store
    }

    /// How full the site, stack and live-block tables are, from the sites just read
    /// (whose stacks have been read with them).
    pub fn occupancy(&self, sites: &[KernelSite]) -> super::Occupancy {
        let stacks: HashSet<u64> = sites
            .iter()
            .map(|s| s.key.stack)
            .filter(|&stack| self.stack_store.contains(stack))
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

    /// What `site`'s objects were cut from, as `slabtop` names it: the slab cache
    /// (`dentry`), kmalloc's size class (`kmalloc-192`, `kmalloc-1k`; larger requests
    /// are `kmalloc-large`, whole pages), or `None` for pages and unnamed caches.
    pub fn cache(&mut self, site: &KernelSiteKey, page_size: u64) -> Option<String> {
        match KernelAllocKind::from_u32(site.kind)? {
            KernelAllocKind::Kmalloc => Some(kmalloc_cache_name(site.class, page_size)),
            KernelAllocKind::KmemCacheAlloc if site.class != 0 => {
                if let Some(name) = self.cache_names_read.get(&site.class) {
                    return Some(name.clone());
                }
                let raw = self.cache_names.get(&site.class, 0).ok()?;
                let len = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
                let name = String::from_utf8_lossy(&raw[..len]).into_owned();
                self.cache_names_read.insert(site.class, name.clone());
                Some(name)
            }
            _ => None,
        }
    }

    /// How many tracked objects each fentry program freed so far, summed over CPUs,
    /// indexed by [`DeferredFreePath`].
    pub fn read_deferred_frees(&self) -> Result<[u64; DeferredFreePath::COUNT]> {
        let mut totals = [0u64; DeferredFreePath::COUNT];
        for path in DeferredFreePath::ALL {
            let per_cpu = self
                .deferred_frees
                .get(&(path as u32), 0)
                .with_context(|| format!("reading the count of {}", path.function()))?;
            totals[path as usize] = per_cpu.iter().sum();
        }
        Ok(totals)
    }

    /// Drop counters summed over CPUs, indexed by [`DropReason`].
    pub fn read_drops(&self) -> Result<[u64; DropReason::COUNT as usize]> {
        super::read_drops(&self.drops)
    }
}

/// The name of the kmalloc cache that hands out `bytes`-byte objects, as
/// `/proc/slabinfo` writes it (the accounted `kmalloc-cg-*` and reclaimable
/// `kmalloc-rcl-*` twins are named after the plain cache of their size).
pub fn kmalloc_cache_name(bytes: u64, page_size: u64) -> String {
    if bytes > kmalloc_cache_limit(page_size) {
        "kmalloc-large".to_owned()
    } else if bytes >= 1024 && bytes.is_multiple_of(1024) {
        format!("kmalloc-{}k", bytes / 1024)
    } else {
        format!("kmalloc-{bytes}")
    }
}

/// The frames a kernel stack-table entry holds, innermost first.
fn kernel_frames(stack: &KernelStack) -> &[u64] {
    &stack.frames[..(stack.len as usize).min(stack.frames.len())]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampled_sites_scale_as_user_mode_sites() {
        let site = KernelSite {
            key: KernelSiteKey::default(),
            counters: KernelCounters {
                alloc_objects: 4,
                alloc_bytes: 256,
                alloc_requested: 200,
                free_objects: 3,
                free_bytes: 192,
                free_requested: 150,
            },
        };
        assert_eq!(site.scaled_values(0), site.values());
        let rate = 512 * 1024;
        let [
            objects,
            bytes,
            inuse_objects,
            inuse_bytes,
            requested,
            inuse_requested,
        ] = site.scaled_values(rate);
        assert_eq!((objects, bytes), scale(4, 256, rate));
        assert_eq!((inuse_objects, inuse_bytes), scale(1, 64, rate));
        // Requested bytes by the factor of the handed-out bytes.
        assert!(requested.abs_diff(bytes * 200 / 256) <= 1, "{requested}");
        assert!(
            inuse_requested.abs_diff(inuse_bytes * 50 / 64) <= 1,
            "{inuse_requested}"
        );
    }

    #[test]
    fn kmalloc_sizes_are_named_as_slabinfo_names_their_caches() {
        let names: Vec<String> = [8, 96, 192, 1024, 2048, 8192, 8193, 16384]
            .into_iter()
            .map(|bytes| kmalloc_cache_name(bytes, 4096))
            .collect();
        assert_eq!(
            names,
            [
                "kmalloc-8",
                "kmalloc-96",
                "kmalloc-192",
                "kmalloc-1k",
                "kmalloc-2k",
                "kmalloc-8k",
                "kmalloc-large",
                "kmalloc-large"
            ]
        );
    }
}
