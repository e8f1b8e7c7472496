//! Loading the BPF object for kernel mode: the events' layouts and the filters into
//! `KERNEL_CONFIG`, the maps sized, the site indices handed to the programs, and
//! which copy of a program (array or hashed live table) this kernel runs.

use anyhow::{Context as _, Result};
use aya::{Ebpf, EbpfLoader, maps::Queue};
use heapprof_common::{
    kernel::{
        ATOMICS_SINCE, EventLayout, FuncArgs, HASHED_PROGRAMS, HASHED_SUFFIX,
        KERNEL_SITE_CACHE_SLOTS, KernelConfig, KernelEvent, names as kernel_names,
    },
    live, names,
};

use super::super::{BPF_OBJECT, Capacities};
use crate::sys::{page_size, running_kernel};

/// Loads the BPF object for kernel mode: the user-mode tables shrink to one entry.
/// `sample_rate` (bytes, 0: every allocation) is `--sample-rate`.
pub fn load_bpf_object(
    capacities: Capacities,
    events: &[(KernelEvent, EventLayout)],
    filter_processes: bool,
    cgroup: Option<crate::cgroup::CgroupFilter>,
    sample_rate: u64,
) -> Result<Ebpf> {
    let func_args = if running_kernel().is_some_and(|v| v >= FUNC_ARG_HELPERS) {
        FuncArgs::Helper
    } else {
        FuncArgs::SavedArray
    };
    let mut config = KernelConfig {
        page_size: page_size(),
        ignore_tgid: std::process::id(),
        filter_processes: u32::from(filter_processes),
        cgroup_id: cgroup.map_or(0, |c| c.id),
        cgroup_level: cgroup.map_or(0, |c| c.level),
        func_args: func_args as u32,
        sample_rate,
        ..KernelConfig::default()
    };

    for (event, layout) in events {
        config.events[*event as usize] = *layout;
    }
    // The live objects go to user mode's live-block table, which reads its size from
    // user mode's settings; or, before 5.12, to KERNEL_LIVE (see `program`).
    let (live_buckets, hashed_blocks) = if live_array() {
        (live::buckets_for(capacities.live_blocks), 1)
    } else {
        (1, capacities.live_blocks)
    };
    let user_config = heapprof_common::Config {
        live_buckets,
        ..heapprof_common::Config::default()
    };
    EbpfLoader::new()
        .override_global(kernel_names::KERNEL_CONFIG, &config, true)
        .override_global(names::CONFIG, &user_config, true)
        .map_max_entries(names::LIVE, live_buckets)
        // Sampling's filter counts the objects of either table (see `KERNEL_LIVE`).
        .map_max_entries(names::LIVE_FILTER, live::filter_values(sample_rate))
        .map_max_entries(kernel_names::KERNEL_LIVE, hashed_blocks)
        .map_max_entries(kernel_names::KERNEL_SITES, capacities.sites)
        .map_max_entries(kernel_names::KERNEL_SITE_COUNTERS, capacities.sites)
        .map_max_entries(kernel_names::KERNEL_SITE_IDS, capacities.sites)
        .map_max_entries(kernel_names::KERNEL_STACKS, capacities.stacks)
        .map_max_entries(kernel_names::KERNEL_SITE_CACHE, KERNEL_SITE_CACHE_SLOTS)
        .map_max_entries(names::SITES, 1)
        .map_max_entries(names::SITE_COUNTERS, 1)
        .map_max_entries(names::SITE_IDS_FREE, 1)
        .map_max_entries(names::STACKS, 1)
        .map_max_entries(names::IN_FLIGHT, 1)
        .map_max_entries(names::EXEC_GEN, 1)
        .map_max_entries(names::PROCESS_MAPPINGS, 1)
        .map_max_entries(names::UNWIND_OBJECTS, 1)
        .map_max_entries(names::UNWIND_ROWS, 1)
        .map_max_entries(names::UNWIND_RULES, 1)
        .map_max_entries(names::UNWIND_GAPS, 1)
        .map_max_entries(names::MAPPINGS_REQUESTED, 1)
        .map_max_entries(names::FORK_ORIGINS, 1)
        .load(BPF_OBJECT)
        .context("loading the BPF programs into the kernel (needs root or CAP_BPF+CAP_PERFMON)")
        .and_then(|mut ebpf| {
            fill_site_ids(&mut ebpf, capacities.sites)?;
            Ok(ebpf)
        })
}

/// Whether the live objects go to user mode's live-block table, whose atomic
/// instructions the kernel takes (5.12+; an unknown version is taken as new).
fn live_array() -> bool {
    running_kernel().is_none_or(|version| version >= ATOMICS_SINCE)
}

/// The program that does `name`'s work on this kernel: `name` itself, or before
/// 5.12 its copy keeping the live objects in a hash map (`HASHED_PROGRAMS`).
pub fn program(name: &str) -> std::borrow::Cow<'_, str> {
    if !live_array() && HASHED_PROGRAMS.contains(&name) {
        std::borrow::Cow::Owned(format!("{name}{HASHED_SUFFIX}"))
    } else {
        std::borrow::Cow::Borrowed(name)
    }
}

/// Fills `KERNEL_SITE_IDS` with every site index, before any program is attached.
fn fill_site_ids(ebpf: &mut Ebpf, sites: u32) -> Result<()> {
    let map = ebpf
        .map_mut(kernel_names::KERNEL_SITE_IDS)
        .with_context(|| format!("BPF map {} missing", kernel_names::KERNEL_SITE_IDS))?;
    let mut ids: Queue<_, heapprof_common::SiteId> = Queue::try_from(map)
        .with_context(|| format!("BPF map {} is not a queue", kernel_names::KERNEL_SITE_IDS))?;
    for id in 0..sites {
        ids.push(&id, 0)
            .with_context(|| format!("filling {}", kernel_names::KERNEL_SITE_IDS))?;
    }
    Ok(())
}

/// The first kernel with `bpf_get_func_arg()` and `bpf_loop()` (5.17).
pub(super) const FUNC_ARG_HELPERS: (u32, u32) = (5, 17);
