//! Loading the BPF programs and attaching them to the allocator functions.

pub mod forks;
pub mod kernel;
pub mod ldso_hook;
pub mod libc;
pub mod session;

use std::num::NonZeroU32;

use anyhow::{Context as _, Result};
use aya::{
    Ebpf, EbpfLoader,
    maps::Array,
    programs::{RawTracePoint, TracePoint, UProbe, uprobe::UProbeScope},
    sys::UProbeMultiFeature,
};
use heapprof_common::{
    Config, Control, kernel::names as kernel_names, live, names, unwind::UnwindMode,
};

pub use self::ldso_hook::DynamicLoader;
use crate::{cgroup::CgroupFilter, unwind::table_upload::TableCapacities};

/// The BPF object built by aya-build from heapprof-ebpf.
pub(crate) static BPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/heapprof"));

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

/// How user stacks are unwound, and the unwind tables' capacities.
#[derive(Debug, Clone, Copy)]
pub struct UnwindSettings {
    /// The unwinding method.
    pub mode: UnwindMode,
    /// Capacities of the tables.
    pub tables: TableCapacities,
    /// Processes whose mappings the unwinder keeps.
    pub processes: u32,
    /// Launch mode: hold the command at each loader event until its mappings are loaded.
    pub hold_at_loader_events: bool,
    /// The benchmark's trap floor: the uprobe programs do nothing.
    pub empty_programs: bool,
    /// The benchmark's baseline of stacks found, nothing counted.
    pub stacks_only: bool,
    /// Launched commands get the preload library.
    pub preload: bool,
    /// A launched command's forks are traced too (their mappings need room).
    pub follow_forks: bool,
    /// Where the fork tracepoint's record holds the child's pid, when forks are
    /// followed and tracefs tells (see [`forks`]).
    pub fork_child_pid_offset: Option<u32>,
}

/// Loads the BPF object for user mode with the given capacities and sampling rate
/// (0: every allocation), keeping each process's in-use peak if `track_peak` (exact
/// mode only), tracing process `target` or all (`None`; only those of `cgroup` when
/// given). Nothing is attached yet: the allocators' probes join as they are found.
pub fn load_bpf_object(
    capacities: Capacities,
    sample_rate: u64,
    track_peak: bool,
    cgroup: Option<CgroupFilter>,
    target: Option<u32>,
    unwind: UnwindSettings,
) -> Result<Ebpf> {
    let config = user_config(capacities, sample_rate, track_peak, cgroup, target, &unwind);
    let mut loader = EbpfLoader::new();
    loader.override_global(names::CONFIG, &config, true);
    size_user_maps(&mut loader, &config, capacities, target, &unwind);
    size_unused_kernel_maps(&mut loader);
    let ebpf = loader
        .load(BPF_OBJECT)
        .context("loading the BPF programs into the kernel (needs root or CAP_BPF+CAP_PERFMON)")?;
    // Sampled: the uprobe session program, while every map is still in `ebpf`. x86-64
    // only: there an unsampled call's frame is known by its return address's slot.
    // With `--empty-programs` it is the sampled trap floor: one trap per call.
    if cfg!(target_arch = "x86_64") && sample_rate > 0 {
        session::prepare(BPF_OBJECT, &ebpf);
    }
    Ok(ebpf)
}

/// The programs' global configuration for user mode (see [`load_bpf_object`]).
fn user_config(
    capacities: Capacities,
    sample_rate: u64,
    track_peak: bool,
    cgroup: Option<CgroupFilter>,
    target: Option<u32>,
    unwind: &UnwindSettings,
) -> Config {
    Config {
        page_size: crate::sys::page_size(),
        ignore_tgid: std::process::id(),
        target_tgid: target.unwrap_or(0),
        sample_rate,
        unwind_mode: unwind.mode as u32,
        hold_at_loader_events: u32::from(unwind.hold_at_loader_events),
        empty_programs: u32::from(unwind.empty_programs),
        stacks_only: u32::from(unwind.stacks_only),
        track_peak: u32::from(track_peak && sample_rate == 0),
        cgroup_id: cgroup.map_or(0, |c| c.id),
        cgroup_level: cgroup.map_or(0, |c| c.level),
        preload: u32::from(unwind.preload),
        live_buckets: live::buckets_for(capacities.live_blocks),
        max_sites: capacities.sites,
        in_flight_slots: capacities.threads.max(1).next_power_of_two(),
        usage_slots: unwind.processes.max(1).next_power_of_two(),
        fork_child_pid_offset: unwind.fork_child_pid_offset.unwrap_or(0),
    }
}

/// Sizes the user-mode maps: the capacities asked for, with the unwind tables and
/// the per-process maps shrunk to one entry where nothing would fill them.
fn size_user_maps(
    loader: &mut EbpfLoader<'_>,
    config: &Config,
    capacities: Capacities,
    target: Option<u32>,
    unwind: &UnwindSettings,
) {
    // Frame pointers need no tables: one entry each.
    let tables = if unwind.mode == UnwindMode::FramePointers {
        TableCapacities {
            rows: 1,
            rules: 1,
            objects: 1,
        }
    } else {
        unwind.tables
    };
    // One process with `--pid`; a launched command's forks have mappings of their own.
    let processes = match target {
        Some(_) if !unwind.follow_forks => 1,
        _ => unwind.processes,
    };
    loader
        .map_max_entries(names::LIVE, config.live_buckets)
        .map_max_entries(names::LIVE_FILTER, live::filter_values(config.sample_rate))
        .map_max_entries(names::SITES, capacities.sites)
        .map_max_entries(names::SITE_COUNTERS, capacities.sites)
        .map_max_entries(names::SITE_IDS_FREE, capacities.sites)
        .map_max_entries(names::STACKS, capacities.stacks)
        .map_max_entries(names::IN_FLIGHT, capacities.threads)
        .map_max_entries(names::IN_FLIGHT_SLOTS, config.in_flight_slots)
        // One entry per process that called exec while traced.
        .map_max_entries(
            names::EXEC_GEN,
            if target.is_some() && !unwind.follow_forks {
                1
            } else {
                capacities.threads
            },
        )
        .map_max_entries(names::PROCESS_MAPPINGS, processes)
        // Every traced process, forked children of a launched command included.
        .map_max_entries(names::PROCESS_USAGE, unwind.processes)
        .map_max_entries(names::USAGE_SLOTS, config.usage_slots)
        .map_max_entries(names::UNWIND_ROWS, tables.rows)
        .map_max_entries(names::UNWIND_RULES, tables.rules)
        .map_max_entries(names::UNWIND_OBJECTS, tables.objects)
        .map_max_entries(names::MAPPINGS_REQUESTED, processes.max(16))
        // Forks and thread creations (a thread's entry is harmless, never looked up).
        .map_max_entries(
            names::FORK_ORIGINS,
            if unwind.fork_child_pid_offset.is_some() {
                unwind.processes.saturating_mul(4).max(256)
            } else {
                1
            },
        );
}

/// The kernel-mode tables are not used in user mode: one entry each.
fn size_unused_kernel_maps(loader: &mut EbpfLoader<'_>) {
    loader
        .map_max_entries(kernel_names::KERNEL_SITES, 1)
        .map_max_entries(kernel_names::KERNEL_SITE_COUNTERS, 1)
        .map_max_entries(kernel_names::KERNEL_SITE_IDS, 1)
        .map_max_entries(kernel_names::KERNEL_LIVE, 1)
        .map_max_entries(kernel_names::KERNEL_STACKS, 1)
        .map_max_entries(kernel_names::TRACED, 1)
        .map_max_entries(kernel_names::COMMS, 1);
}

/// The uprobe program `name`, loaded into the kernel on first use.
pub(crate) fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe> {
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

fn raw_tracepoint(ebpf: &mut Ebpf, program: &str, tracepoint: &str) -> Result<()> {
    let raw: &mut RawTracePoint = ebpf
        .program_mut(program)
        .with_context(|| format!("BPF program {program} missing from the object"))?
        .try_into()
        .with_context(|| format!("BPF program {program} is not a raw tracepoint"))?;
    raw.load()
        .with_context(|| format!("verifying BPF program {program}"))?;
    raw.attach(tracepoint)
        .with_context(|| format!("attaching to the {tracepoint} tracepoint"))?;
    Ok(())
}

/// How the allocator probes are attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMethod {
    /// Two multi-uprobe links (Linux 6.6+; with `--pid`, kernels whose link filter
    /// covers a whole process): one for the entries, one for the returns. Attaching and
    /// detaching are one step each instead of one per probe, which is what makes
    /// detaching fast.
    MultiLink,
    /// One perf event per probe (older kernels). The kernel closes them one at a time,
    /// each waiting for RCU grace periods under a global lock (`event_mutex` in
    /// `perf_uprobe_destroy`): about 0.1 s per probe, 1.6 s for heapprofd's 17 here,
    /// whether they are closed in turn or side by side.
    PerfEvents,
}

/// How to attach uprobes (`--attach`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AttachChoice {
    /// Multi-uprobe links when the kernel supports them, perf events otherwise.
    Auto,
    /// One perf event per probe, on any kernel.
    PerfEvents,
}

/// Which method to use: what this kernel supports for the given scope, unless the
/// user chose perf events.
pub fn attach_method(choice: AttachChoice, pid: Option<u32>) -> AttachMethod {
    if choice == AttachChoice::PerfEvents {
        return AttachMethod::PerfEvents;
    }
    let feature = if pid.is_some() {
        UProbeMultiFeature::ProcessScopedPidFilter
    } else {
        UProbeMultiFeature::LinkCreation
    };
    match aya::sys::is_uprobe_multi_supported(feature) {
        Ok(true) => AttachMethod::MultiLink,
        Ok(false) => AttachMethod::PerfEvents,
        Err(err) => {
            log::debug!("cannot tell whether multi-uprobe links work ({err}); using perf events");
            AttachMethod::PerfEvents
        }
    }
}

/// Attaches the dynamic loader's hook (when there is a loader to probe) and the
/// process tracepoints, with `method` for the hook. `pid` limits the uprobe to one
/// process. Returns the probes attached. The programs stay inert until [`arm`].
pub fn attach_process_events(
    ebpf: &mut Ebpf,
    loader: Option<&DynamicLoader>,
    pid: Option<u32>,
    method: AttachMethod,
) -> Result<usize> {
    let scope = match pid.and_then(NonZeroU32::new) {
        Some(pid) => UProbeScope::OneProcess(pid),
        None => UProbeScope::AllProcesses,
    };
    let mut probes = 2;
    if let Some(loader) = loader {
        let name = match method {
            AttachMethod::MultiLink => names::PROG_LOADER_STATE_MULTI,
            AttachMethod::PerfEvents => names::PROG_LOADER_STATE,
        };
        probes += 1;
        uprobe(ebpf, name)?
            .attach([loader.hook_offset], &loader.path, scope)
            .with_context(|| format!("attaching a uprobe to {}", loader.display))?;
    }
    raw_tracepoint(ebpf, names::PROG_EXEC, names::EXEC_TRACEPOINT)?;
    raw_tracepoint(ebpf, names::PROG_THREAD_EXIT, names::EXIT_TRACEPOINT)?;
    Ok(probes)
}

/// With the preload library: applies a thread's queued records when it is switched
/// out, calls `futex` or starts an exec (see `heapprof_common::preload::QueueState`).
pub fn attach_thread_switch(ebpf: &mut Ebpf) -> Result<()> {
    raw_tracepoint(ebpf, names::PROG_SWITCH, names::SWITCH_TRACEPOINT)?;
    // `futex` and the execs alone where the kernel has their tracepoints: a program on
    // every system call's entry runs for every process of the host.
    let futex = syscall_tracepoints(ebpf, names::PROG_FUTEX_ENTRY, &[names::FUTEX_TRACEPOINT]);
    let exec = syscall_tracepoints(ebpf, names::PROG_EXEC_ENTRY, &names::EXEC_ENTRY_TRACEPOINTS);
    match futex.and(exec) {
        Ok(()) => Ok(()),
        Err(err) => {
            // The raw program handles both; one of the others attached does its
            // calls' work twice, which applies nothing twice.
            log::debug!("no system call tracepoints ({err:#}): a program on every system call");
            raw_tracepoint(ebpf, names::PROG_SYSCALL, names::SYSCALL_TRACEPOINT)
        }
    }
}

/// Sessions with uprobe session links: attaches the program that clears each CPU's
/// cached thread id at every context switch, then lets the session program use the
/// cache (`Control::thread_cache`; see `heapprof-ebpf`'s `current_thread`).
pub fn cache_thread_on_cpu(ebpf: &mut Ebpf) -> Result<()> {
    raw_tracepoint(
        ebpf,
        names::PROG_THREAD_ON_CPU_RESET,
        names::SWITCH_TRACEPOINT,
    )?;
    set_control(ebpf, |control| control.thread_cache = 1)
        .context("turning the per-CPU thread id on")
}

/// Sets a switch of `CONTROL` (`set` changes its value; the daemon alone writes it).
fn set_control(ebpf: &mut Ebpf, set: impl FnOnce(&mut Control)) -> Result<()> {
    let mut control: Array<_, Control> = ebpf
        .map_mut(names::CONTROL)
        .with_context(|| format!("BPF map {} missing from the object", names::CONTROL))?
        .try_into()
        .with_context(|| format!("BPF map {} has an unexpected type", names::CONTROL))?;
    let mut value = control.get(&0, 0)?;
    set(&mut value);
    control.set(0, &value, 0)?;
    Ok(())
}

/// Loads tracepoint program `program` and attaches it to each of `tracepoints` in the
/// `syscalls` category.
fn syscall_tracepoints(ebpf: &mut Ebpf, program: &str, tracepoints: &[&str]) -> Result<()> {
    let category = names::SYSCALLS_CATEGORY;
    let loaded: &mut TracePoint = ebpf
        .program_mut(program)
        .with_context(|| format!("BPF program {program} missing"))?
        .try_into()
        .with_context(|| format!("BPF program {program} is not a tracepoint"))?;
    loaded
        .load()
        .with_context(|| format!("verifying BPF program {program}"))?;
    for name in tracepoints {
        loaded
            .attach(category, name)
            .with_context(|| format!("attaching to the tracepoint {category}:{name}"))?;
    }
    Ok(())
}

/// Lets the programs count: called once the first probes are attached. Probes attached
/// later (a new process's allocator) count from their attachment: their specs are in
/// place before them.
pub fn arm(ebpf: &mut Ebpf) -> Result<()> {
    set_control(ebpf, |control| control.armed = 1).context("arming the BPF programs")
}
