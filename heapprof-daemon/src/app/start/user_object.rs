//! User mode's BPF object: loaded with the command line's capacities, and what its
//! loading depends on (the dynamic loader's hook, the fork record's layout); the
//! descriptor of its map of answers, which the preload library reads.

use anyhow::{Context as _, Result, bail};
use heapprof_common::{names as map_names, unwind::UnwindMode};

use crate::{
    cli::{Cli, Target},
    probes,
    unwind::table_upload::TableCapacities,
};

/// The dynamic loader whose hook tells when objects are mapped (new unwind tables, new
/// allocators): the target's, the launched program's, or the system's.
pub(super) fn find_loader_hook(
    target: &Target,
    program: Option<&std::path::Path>,
) -> Result<Option<probes::DynamicLoader>> {
    let loader = match target {
        Target::Pid(pid) => probes::ldso_hook::of_process(*pid)?,
        // A script (a shebang, a wrapper) execs its interpreter: the system's loader.
        Target::Launch(_) => program
            .and_then(probes::ldso_hook::of_executable)
            .or_else(probes::ldso_hook::system),
        Target::All => probes::ldso_hook::system(),
    };
    match &loader {
        Some(loader) => log::debug!(
            "dynamic loader {}: _dl_debug_state at {:#x}",
            loader.display,
            loader.hook_offset
        ),
        None => log::debug!(
            "no dynamic loader hook: new objects' unwind tables load when stacks meet them, \
             and new allocators are found when the process's mappings are next read"
        ),
    }
    Ok(loader)
}

/// Where the fork tracepoint's record holds the child's pid, where forks are followed
/// (a launched command's, and every process's with `--all`) and unwound with tables.
pub(super) fn fork_child_pid_offset(cli: &Cli, target: &Target) -> Option<u32> {
    if matches!(target, Target::Pid(_)) || cli.unwind.mode() == UnwindMode::FramePointers {
        return None;
    }
    match probes::forks::child_pid_offset() {
        Ok(offset) => Some(offset),
        Err(err) => {
            log::info!(
                "a fork's stacks are unwound only once its own mappings are read ({err:#}); \
                 a short-lived fork's may stop at their first frame"
            );
            None
        }
    }
}

/// Loads the user-mode BPF object with the command line's capacities, tracing `pid`
/// (all processes when `None`); `launched`: a command is held at each loader event;
/// `fork_child_pid_offset`: see [`fork_child_pid_offset`].
pub(super) fn load_user_bpf(
    cli: &Cli,
    pid: Option<u32>,
    launched: bool,
    preloading: bool,
    tables: TableCapacities,
    fork_child_pid_offset: Option<u32>,
) -> Result<aya::Ebpf> {
    let capacities = super::map_capacities(cli);
    // A launched command is held at each loader event until its new objects' unwind
    // tables and allocators are in place.
    let unwinding = probes::UnwindSettings {
        mode: cli.unwind.mode(),
        tables,
        processes: cli.max_processes,
        hold_at_loader_events: launched && !cli.empty_programs,
        empty_programs: cli.empty_programs,
        stacks_only: cli.stacks_only,
        preload: preloading,
        follow_forks: launched,
        fork_child_pid_offset,
    };
    if cli.stacks_only {
        log::info!(
            "stacks only (a benchmark baseline): the probes match calls and find each \
             allocation's stack, then count nothing; the profiles stay empty"
        );
    }
    let cgroup = cli.cgroup_filter()?;
    probes::load_bpf_object(
        capacities,
        cli.sample_rate.unwrap_or(0),
        !cli.no_peak,
        cgroup,
        pid,
        unwinding,
    )
}

/// A descriptor of the map where the preload library finds its answers, for the
/// launched command.
pub(super) fn replies_map(ebpf: &aya::Ebpf) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::AsFd as _;
    let name = map_names::REPLIES;
    let map = ebpf
        .map(name)
        .with_context(|| format!("BPF map {name} missing from the object"))?;
    let aya::maps::Map::Array(data) = map else {
        bail!("BPF map {name} is not an array");
    };
    data.fd()
        .as_fd()
        .try_clone_to_owned()
        .with_context(|| format!("duplicating the descriptor of BPF map {name}"))
}
