//! User mode's start: the BPF object loaded, the allocators probed (the preload
//! library's copy first), the loader's hook and the process events attached, the
//! programs armed, the session ready.

use anyhow::{Context as _, Result, bail};

use heapprof_common::{names as map_names, unwind::UnwindMode};

use super::{
    in_process::{join_in_process, load_in_process, probes_chosen},
    initial_allocators::probe_initial_allocators,
    metrics_endpoint::serve_metrics,
};
use crate::{
    allocators::{AllocatorProbes, ProbeSettings, spec::CustomFunction},
    cli::{Cli, Target},
    health::{self, bpf_log::BpfLog},
    inject,
    launch::{self, PausedChild},
    metrics::server::Endpoint,
    pprof,
    preload::PreloadLibrary,
    probes,
    session::{UserSession, UserSessionConfig},
    stats_file::{JoinedBy, Joining, StartFigures},
    system_preload::SystemPreload,
    unwind::table_upload::TableCapacities,
};

/// The one process user mode watches: the pid given, or the program launched.
pub(super) fn user_pid(target: &Target, child: Option<&PausedChild>) -> Option<u32> {
    match (target, child) {
        (Target::Pid(pid), _) => Some(*pid),
        (Target::Launch(_), Some(child)) => Some(child.pid),
        _ => None,
    }
}

/// User mode: the BPF object loaded, the allocators probed, the loader's hook and the
/// process events attached, the session ready; logs the readiness line last.
pub(super) fn start_user(
    cli: &Cli,
    target: &Target,
    mut child: Option<&mut PausedChild>,
    preload: Option<PreloadLibrary>,
    endpoint: Option<Endpoint>,
    method: probes::AttachMethod,
) -> Result<(
    UserSession,
    Option<BpfLog>,
    StartFigures,
    Option<SystemPreload>,
)> {
    pprof::writer::prepare_output_dir(&cli.output_dir())?;
    let sample_rate = cli.sample_rate.unwrap_or(0);
    let pid = user_pid(target, child.as_deref());
    let tables = TableCapacities {
        rows: cli.max_unwind_rows,
        rules: cli.max_unwind_rules,
        objects: cli.max_unwind_objects,
    };
    let program = match target {
        Target::Launch(command) => command
            .first()
            .and_then(|program| launch::resolve_program(program).ok()),
        _ => None,
    };
    let injecting = cli.injects(target);
    let system = cli.system_preload(target);
    // The system-wide preload probes no process it does not have to: the loader's hook
    // would be a breakpoint in every process (valgrind stops at it). New objects' unwind
    // tables then load when stacks meet them.
    let loader = if system {
        None
    } else {
        find_loader_hook(target, program.as_deref())?
    };
    let preload = if system {
        Some(PreloadLibrary::install_system()?)
    } else {
        preload
    };
    let mut preloading = preload.is_some();
    let fork_offset = fork_child_pid_offset(cli, target);
    let mut ebpf = load_user_bpf(
        cli,
        pid,
        child.is_some(),
        preloading || injecting,
        tables,
        fork_offset,
    )?;
    let bpf_log = BpfLog::init(&mut ebpf);
    let settings = ProbeSettings {
        custom: cli
            .allocator
            .iter()
            .flat_map(|spec| spec.0.clone())
            .collect(),
        placement: cli.probe_placement,
        method,
        pid,
        // Each process the system-wide library does not serve is probed alone, with
        // links whose filter covers its threads where the kernel's does.
        per_process: system.then(|| probes::attach_method(cli.attach, Some(std::process::id()))),
        sampled: sample_rate > 0,
    };
    if let Some(name) = duplicate(&settings.custom) {
        bail!("--allocator names {name} twice; give each function once");
    }
    let mut allocators = AllocatorProbes::new(&mut ebpf, settings)?;
    // With the preload library, the C library's standard names are left to it.
    if let Some(library) = preload {
        allocators.add_preload(&mut ebpf, library)?;
        if let Some(child) = child.as_mut() {
            child.hand_over(replies_map(&ebpf)?);
        }
    }
    // The library is loaded and probed now, but joins once the programs are armed:
    // its first report registers its thread's queue.
    let mut joining = None;
    let loaded = match (target, injecting) {
        (Target::Pid(pid), true) => {
            load_in_process(*pid, &mut ebpf, &mut allocators, &mut joining)?
        }
        (Target::Pid(pid), false) => {
            joining = Some(Joining {
                pid: *pid,
                how: JoinedBy::Probes,
                reason: Some(probes_chosen(cli).to_owned()),
            });
            None
        }
        _ => None,
    };
    preloading |= loaded.is_some();
    log_sampling(sample_rate, preloading);
    probe_initial_allocators(
        cli,
        target,
        program.as_deref(),
        preloading,
        &mut ebpf,
        &mut allocators,
    )?;
    let process_probes = probes::attach_process_events(&mut ebpf, loader.as_ref(), pid, method)?;
    if fork_offset.is_some() {
        probes::forks::attach(&mut ebpf)?;
    }
    // Sampled, the library reports each record at once (see `queue_record` in the C
    // interposer), so no queue waits for a context switch or a futex call.
    if preloading && sample_rate == 0 {
        probes::attach_thread_switch(&mut ebpf)?;
    }
    probes::arm(&mut ebpf)?;
    let replies = loaded.as_ref().map(|_| replies_map(&ebpf)).transpose()?;
    let system_replies = system.then(|| replies_map(&ebpf)).transpose()?;
    let config = UserSessionConfig {
        target: target.clone(),
        output: cli.output_dir(),
        sample_rate,
        bpf_stats: cli.bpf_stats,
        unwind_tables: (cli.unwind.mode() != UnwindMode::FramePointers).then_some(tables),
        retain_exited: cli.retain_exited,
        system_preload: system,
    };
    let programs = StartFigures::programs_of(&ebpf);
    let mut session = UserSession::new(config, ebpf, allocators)?;
    // The processes running now are asked to join once the socket listens: until their
    // copy asks, the session leaves them alone (they count from their join).
    // `--inject off` keeps them on their allocator's probes.
    let running = (system && cli.inject == inject::InjectMode::Auto).then(|| {
        crate::system_preload::running::candidates(heapprof_common::preload::SYSTEM_LIBRARY)
    });
    if let Some(pids) = &running {
        session.await_system_ask(pids);
    }
    session.prime_processes();
    // Joined once the process's mappings and unwind tables are in place, so that its
    // first reports are unwound whole.
    if let (Some(injection), Some(replies)) = (loaded, replies) {
        joining = Some(join_in_process(
            injection,
            &replies,
            &mut session,
            sample_rate,
        ));
    }
    require_allocator_probed(&session, target)?;
    // Said once the session stands: where no allocator can be probed either, the
    // error alone is the one line.
    if let Some(Joining {
        pid,
        how: JoinedBy::Probes,
        reason: Some(reason),
    }) = &joining
    {
        log::warn!(
            "pid {pid}: cannot join it in-process ({reason}); using the allocator's probes, \
             which trap into the kernel at every call"
        );
    }
    let map_memory = health::map_memory::tables();
    log::info!("{}", health::map_memory::describe(&map_memory));
    if let Some(endpoint) = endpoint {
        session.export_metrics(serve_metrics(cli, target, endpoint, &map_memory));
    }
    // Last: from here on, new programs ask to join, and the session answers them.
    let system = system_replies
        .map(|replies| {
            let mut started = SystemPreload::start(replies, sample_rate, session.system_joined())?;
            started.ask_running(running.unwrap_or_default())?;
            log::info!(
                "system-wide preload: {} is in {} until heapprofd exits; dynamic programs \
                 join heapprofd in-process (those running now once heapprofd has loaded it \
                 into them), and each process it does not serve (static, another mount \
                 namespace, one it cannot load into) gets its allocator's probes for \
                 itself alone",
                heapprof_common::preload::SYSTEM_LIBRARY,
                crate::system_preload::PRELOAD_LIST
            );
            anyhow::Ok(started)
        })
        .transpose()?;
    // Logged last: once it is printed, heapprofd is fully ready (tests wait for it).
    log::info!(
        "{} probes on {} ({}), profiles every {:?} in {}",
        session.allocator_probes() + process_probes,
        session.allocator_names(),
        match target {
            Target::Pid(pid) => format!("pid {pid}"),
            Target::Launch(command) => format!("`{}`, pid {}", command.join(" "), pid.unwrap_or(0)),
            Target::All => "all processes".to_owned(),
        },
        cli.interval,
        cli.output_dir().display()
    );
    let figures = StartFigures {
        programs,
        kernel_memory: map_memory,
        joining,
    };
    Ok((session, bpf_log, figures, system))
}

/// `--pid`: a process with no allocator heapprofd can probe is an error, with the last
/// note saying why when there is one.
fn require_allocator_probed(session: &UserSession, target: &Target) -> Result<()> {
    if let Target::Pid(pid) = target
        && session.allocator_probes() == 0
    {
        match session.allocator_notes().last() {
            Some(note) => bail!("{note}"),
            None => bail!(
                "process {pid}: heapprofd found no allocator to probe in it; name its \
                 allocator's functions with --allocator"
            ),
        }
    }
    Ok(())
}

/// The dynamic loader whose hook tells when objects are mapped (new unwind tables, new
/// allocators): the target's, the launched program's, or the system's.
fn find_loader_hook(
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

/// Says where sampling is decided, and so what it saves.
fn log_sampling(sample_rate: u64, preloading: bool) {
    if sample_rate != 0 && preloading {
        log::info!(
            "sampling about one allocation per {sample_rate} bytes, decided in the process \
             by heapprofd's library: the calls it skips cost no probe"
        );
    } else if sample_rate != 0 {
        log::info!(
            "sampling about one allocation per {sample_rate} bytes: every allocator call \
             still traps into the kernel, where the probes decide; sampling saves the stack \
             walk and table updates of the calls it skips, and their return trap where the \
             kernel has uprobe session links (said below)"
        );
    }
}

/// Where the fork tracepoint's record holds the child's pid, where forks are followed
/// (a launched command's, and every process's with `--all`) and unwound with tables.
fn fork_child_pid_offset(cli: &Cli, target: &Target) -> Option<u32> {
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
fn load_user_bpf(
    cli: &Cli,
    pid: Option<u32>,
    launched: bool,
    preloading: bool,
    tables: TableCapacities,
    fork_child_pid_offset: Option<u32>,
) -> Result<aya::Ebpf> {
    let capacities = probes::Capacities {
        live_blocks: cli.live_blocks(),
        sites: cli.max_sites,
        stacks: cli.max_stacks,
        threads: cli.max_threads,
    };
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

/// A function `--allocator` names twice, across its values.
fn duplicate(functions: &[CustomFunction]) -> Option<&str> {
    functions.iter().enumerate().find_map(|(i, f)| {
        functions[..i]
            .iter()
            .any(|g| g.name == f.name)
            .then_some(f.name.as_str())
    })
}

/// A descriptor of the map where the preload library finds its answers, for the
/// launched command.
fn replies_map(ebpf: &aya::Ebpf) -> Result<std::os::fd::OwnedFd> {
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
