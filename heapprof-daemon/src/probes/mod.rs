//! Loading the BPF programs and attaching them to the allocator functions.

pub mod kernel;
pub mod libc;
pub mod placement;
pub mod stats;

use std::num::NonZeroU32;

use anyhow::{Context as _, Result};
use aya::{
    Ebpf, EbpfLoader,
    programs::{RawTracePoint, UProbe, uprobe::UProbeScope},
};
use heapprof_common::{Config, kernel::names as kernel_names, names};

pub use self::libc::Libc;

/// The BPF object built by aya-build from heapprof-ebpf.
static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/heapprof"));

/// Capacities of the BPF maps (from the command line).
#[derive(Debug, Clone, Copy)]
pub struct Capacities {
    /// Live-block table entries.
    pub live_blocks: u32,
    /// Per-site counter entries.
    pub sites: u32,
    /// Stack-trace map entries.
    pub stacks: u32,
    /// Concurrent allocator calls (threads).
    pub threads: u32,
}

/// Loads the BPF object for user mode with the given capacities and sampling rate
/// (0: every allocation), tracing process `target` or all (`None`). Nothing is attached yet.
pub fn load(capacities: Capacities, sample_rate: u64, target: Option<u32>) -> Result<Ebpf> {
    let config = Config {
        page_size: page_size(),
        ignore_tgid: std::process::id(),
        target_tgid: target.unwrap_or(0),
        sample_rate,
    };
    EbpfLoader::new()
        .override_global(names::CONFIG, &config, true)
        .map_max_entries(names::LIVE, capacities.live_blocks)
        .map_max_entries(names::SITES, capacities.sites)
        .map_max_entries(names::STACKS, capacities.stacks)
        .map_max_entries(names::IN_FLIGHT, capacities.threads)
        // One entry per process that called exec while traced.
        .map_max_entries(
            names::EXEC_GEN,
            if target.is_some() {
                1
            } else {
                capacities.threads
            },
        )
        // The kernel-mode tables are not used: one entry each.
        .map_max_entries(kernel_names::KERNEL_LIVE, 1)
        .map_max_entries(kernel_names::KERNEL_SITES, 1)
        .map_max_entries(kernel_names::KERNEL_STACKS, 1)
        .map_max_entries(kernel_names::TRACED, 1)
        .map_max_entries(kernel_names::COMMS, 1)
        .load(BPF_OBJECT)
        .context("loading the BPF programs into the kernel (needs root or CAP_BPF+CAP_PERFMON)")
}

pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { ::libc::sysconf(::libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096)
}

fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe> {
    let program: &mut UProbe = ebpf
        .program_mut(name)
        .with_context(|| format!("BPF program {name} missing from the object"))?
        .try_into()
        .with_context(|| format!("BPF program {name} is not a uprobe"))?;
    if program.fd().is_err() {
        program
            .load()
            .with_context(|| format!("verifying BPF program {name}"))?;
    }
    Ok(program)
}

/// Attaches entry probes on every allocator function of `libc`, the shared return
/// probe at the same addresses and the probe on free. `pid` limits them to one process.
pub fn attach(ebpf: &mut Ebpf, libc: &Libc, pid: Option<u32>) -> Result<usize> {
    let scope = || match pid.and_then(NonZeroU32::new) {
        Some(pid) => UProbeScope::OneProcess(pid),
        None => UProbeScope::AllProcesses,
    };
    let attach_err = |what: &str| format!("attaching a uprobe to {what} in {}", libc.display);
    let mut count = 0;
    for (kind, function) in &libc.allocators {
        // Entry and return probes share one spot, so one trap serves both.
        let offset = function.probe_offset();
        log::debug!("{}: probes at {}", kind.symbol(), function.placement);
        uprobe(ebpf, names::entry_program(*kind))?
            .attach([offset], &libc.path, scope())
            .with_context(|| attach_err(kind.symbol()))?;
        uprobe(ebpf, names::PROG_ALLOC_RETURN)?
            .attach([offset], &libc.path, scope())
            .with_context(|| attach_err(&format!("the return of {}", kind.symbol())))?;
        count += 2;
    }
    let exec: &mut RawTracePoint = ebpf
        .program_mut(names::PROG_EXEC)
        .with_context(|| format!("BPF program {} missing from the object", names::PROG_EXEC))?
        .try_into()
        .with_context(|| format!("BPF program {} is not a raw tracepoint", names::PROG_EXEC))?;
    exec.load()
        .with_context(|| format!("verifying BPF program {}", names::PROG_EXEC))?;
    exec.attach(names::EXEC_TRACEPOINT)
        .with_context(|| format!("attaching to the {} tracepoint", names::EXEC_TRACEPOINT))?;
    count += 1;
    log::debug!("free: probe at {}", libc.free.placement);
    uprobe(ebpf, names::PROG_FREE)?
        .attach([libc.free.probe_offset()], &libc.path, scope())
        .with_context(|| attach_err("free"))?;
    count += 1;
    for (alias, first) in &libc.aliases {
        log::debug!(
            "{} is the same function as {} in {}: traced once, reported as {}",
            alias.symbol(),
            first.symbol(),
            libc.display,
            first.symbol()
        );
    }
    Ok(count)
}
