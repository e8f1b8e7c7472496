//! User mode's start: the BPF object loaded, the allocators probed (the preload
//! library's copy first), the loader's hook and the process events attached, the
//! programs armed, the session ready.

use anyhow::{Result, bail};

use heapprof_common::unwind::UnwindMode;

use super::{
    in_process::{join_in_process, load_in_process, probes_chosen},
    initial_allocators::probe_initial_allocators,
    metrics_endpoint::serve_metrics,
    user_object::{find_loader_hook, fork_child_pid_offset, load_user_bpf, replies_map},
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
    child: Option<&mut PausedChild>,
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
    let mut armed = arm_probes(cli, target, child, preload, method)?;
    let (pid, process_probes, bpf_log) = (armed.pid, armed.process_probes, armed.bpf_log.take());
    let programs = StartFigures::programs_of(&armed.ebpf);
    let (mut session, joining, system) = stand_session(cli, target, armed)?;
    require_allocator_probed(&session, target)?;
    // Said once the session stands: where no allocator can be probed either, the
    // error alone is the one line.
    warn_if_on_probes(joining.as_ref());
    let map_memory = health::map_memory::tables();
    log::info!("{}", health::map_memory::describe(&map_memory));
    if let Some(endpoint) = endpoint {
        session.export_metrics(serve_metrics(cli, target, endpoint, &map_memory));
    }
    // Last: from here on, new programs ask to join, and the session answers them.
    let system = match system {
        Some((replies, running)) => Some(start_system_preload(
            replies,
            cli.sample_rate.unwrap_or(0),
            &session,
            running,
        )?),
        None => None,
    };
    // Logged last: once it is printed, heapprofd is fully ready.
    log_ready(cli, target, pid, &session, process_probes);
    let figures = StartFigures {
        programs,
        kernel_memory: map_memory,
        joining,
    };
    Ok((session, bpf_log, figures, system))
}

/// The BPF side of a user-mode start, armed: what the session is made of.
struct ArmedProbes {
    ebpf: aya::Ebpf,
    allocators: AllocatorProbes,
    bpf_log: Option<BpfLog>,
    /// The one process watched (`--pid`, the launched command).
    pid: Option<u32>,
    /// `--pid`: heapprofd's library loaded into the process, to be joined.
    loaded: Option<inject::Injection>,
    joining: Option<Joining>,
    /// The loader's hook and the process events.
    process_probes: usize,
    tables: TableCapacities,
    /// `--preload system`.
    system: bool,
}

/// Loads the BPF object, probes the allocators (the preload library's copy first),
/// loads heapprofd's library into a `--pid` target where it may, attaches the process
/// events and arms the programs.
fn arm_probes(
    cli: &Cli,
    target: &Target,
    mut child: Option<&mut PausedChild>,
    preload: Option<PreloadLibrary>,
    method: probes::AttachMethod,
) -> Result<ArmedProbes> {
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
    let system = cli.system_preload(target);
    let (loader, preload) = loader_and_library(target, program.as_deref(), system, preload)?;
    let mut preloading = preload.is_some();
    let fork_offset = fork_child_pid_offset(cli, target);
    let mut ebpf = load_user_bpf(
        cli,
        pid,
        child.is_some(),
        preloading || cli.injects(target),
        tables,
        fork_offset,
    )?;
    let bpf_log = BpfLog::init(&mut ebpf);
    let settings = probe_settings(cli, target, pid, method, system)?;
    let mut allocators = AllocatorProbes::new(&mut ebpf, settings)?;
    // With the preload library, the C library's standard names are left to it.
    if let Some(library) = preload {
        allocators.add_preload(&mut ebpf, library)?;
        if let Some(child) = child.as_mut() {
            child.hand_over(replies_map(&ebpf)?);
        }
    }
    let (loaded, joining) = load_into_target(cli, target, &mut ebpf, &mut allocators)?;
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
    let process_probes = attach_process_events_and_arm(
        &mut ebpf,
        loader.as_ref(),
        pid,
        method,
        fork_offset.is_some(),
        preloading && sample_rate == 0,
    )?;
    Ok(ArmedProbes {
        ebpf,
        allocators,
        bpf_log,
        pid,
        loaded,
        joining,
        process_probes,
        tables,
        system,
    })
}

/// The loader's hook to probe, and the preload library to use: the system-wide
/// preload installs its own and probes no loader (the hook would be a breakpoint in
/// every process, and valgrind stops at it; new objects' unwind tables then load
/// when stacks meet them).
fn loader_and_library(
    target: &Target,
    program: Option<&std::path::Path>,
    system: bool,
    preload: Option<PreloadLibrary>,
) -> Result<(Option<probes::DynamicLoader>, Option<PreloadLibrary>)> {
    if system {
        return Ok((None, Some(PreloadLibrary::install_system()?)));
    }
    Ok((find_loader_hook(target, program)?, preload))
}

/// What `--preload system` starts with once the session stands: the map its answers
/// go through, and the processes running now, to be asked to join.
type SystemStart = (std::os::fd::OwnedFd, Vec<u32>);

/// Makes the session of the armed probes, reads the processes running now, and joins
/// a `--pid` target into which heapprofd's library was loaded.
fn stand_session(
    cli: &Cli,
    target: &Target,
    armed: ArmedProbes,
) -> Result<(UserSession, Option<Joining>, Option<SystemStart>)> {
    let ArmedProbes {
        ebpf,
        allocators,
        loaded,
        mut joining,
        tables,
        system,
        ..
    } = armed;
    let sample_rate = cli.sample_rate.unwrap_or(0);
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
    let system = system_replies.map(|replies| (replies, running.unwrap_or_default()));
    Ok((session, joining, system))
}

/// Attaches what follows the processes (the loader's hook and exits; `forks`: the
/// fork tracepoint; `thread_switch`: an exact session's queues applied at each
/// switch), then arms the programs. Returns the probes attached.
fn attach_process_events_and_arm(
    ebpf: &mut aya::Ebpf,
    loader: Option<&probes::DynamicLoader>,
    pid: Option<u32>,
    method: probes::AttachMethod,
    forks: bool,
    thread_switch: bool,
) -> Result<usize> {
    let process_probes = probes::attach_process_events(ebpf, loader, pid, method)?;
    if forks {
        probes::forks::attach(ebpf)?;
    }
    // Sampled, the library reports each record at once (see `queue_record` in the C
    // interposer), so no queue waits for a context switch or a futex call.
    if thread_switch {
        probes::attach_thread_switch(ebpf)?;
    }
    probes::arm(ebpf)?;
    Ok(process_probes)
}

/// How the allocators are probed: the command line's functions, the one process
/// watched (`pid`), and each process probed alone: with the system-wide preload
/// (`system`), each process it does not serve; in launch mode, each of the command's
/// descendants that its library does not serve.
fn probe_settings(
    cli: &Cli,
    target: &Target,
    pid: Option<u32>,
    method: probes::AttachMethod,
    system: bool,
) -> Result<ProbeSettings> {
    let settings = ProbeSettings {
        custom: cli
            .allocator
            .iter()
            .flat_map(|spec| spec.0.clone())
            .collect(),
        placement: cli.probe_placement,
        method,
        pid,
        // Links whose filter covers the process's threads where the kernel's does.
        per_process: system.then(|| probes::attach_method(cli.attach, Some(std::process::id()))),
        descendants_alone: matches!(target, Target::Launch(_)),
        sampled: cli.sample_rate.unwrap_or(0) > 0,
    };
    if let Some(name) = duplicate(&settings.custom) {
        bail!("--allocator names {name} twice; give each function once");
    }
    Ok(settings)
}

/// `--pid`: loads heapprofd's library into the process where `--inject` allows it
/// (it joins once the programs are armed: its first report registers its thread's
/// queue), or says that the allocator's probes serve it. Returns the library loaded,
/// if any, and how the process is joined so far.
fn load_into_target(
    cli: &Cli,
    target: &Target,
    ebpf: &mut aya::Ebpf,
    allocators: &mut AllocatorProbes,
) -> Result<(Option<inject::Injection>, Option<Joining>)> {
    let Target::Pid(pid) = target else {
        return Ok((None, None));
    };
    if !cli.injects(target) {
        let joining = Joining {
            pid: *pid,
            how: JoinedBy::Probes,
            reason: Some(probes_chosen(cli).to_owned()),
        };
        return Ok((None, Some(joining)));
    }
    let mut joining = None;
    let loaded = load_in_process(*pid, ebpf, allocators, &mut joining)?;
    Ok((loaded, joining))
}

/// Warns that a `--pid` process could not be joined in-process, and what that costs.
fn warn_if_on_probes(joining: Option<&Joining>) {
    if let Some(Joining {
        pid,
        how: JoinedBy::Probes,
        reason: Some(reason),
    }) = joining
    {
        log::warn!(
            "pid {pid}: cannot join it in-process ({reason}); using the allocator's probes, \
             which trap into the kernel at every call"
        );
    }
}

/// `--preload system`: listens for new programs asking to join, and asks those running
/// now (`running`).
fn start_system_preload(
    replies: std::os::fd::OwnedFd,
    sample_rate: u64,
    session: &UserSession,
    running: Vec<u32>,
) -> Result<SystemPreload> {
    let mut started = SystemPreload::start(replies, sample_rate, session.system_joined())?;
    started.ask_running(running)?;
    log::info!(
        "system-wide preload: {} is in {} until heapprofd exits; dynamic programs \
         join heapprofd in-process (those running now once heapprofd has loaded it \
         into them), and each process it does not serve (static, another mount \
         namespace, one it cannot load into) gets its allocator's probes for \
         itself alone",
        heapprof_common::preload::SYSTEM_LIBRARY,
        crate::system_preload::PRELOAD_LIST
    );
    Ok(started)
}

/// Says what is probed and where profiles go: the start's last line.
fn log_ready(
    cli: &Cli,
    target: &Target,
    pid: Option<u32>,
    session: &UserSession,
    process_probes: usize,
) {
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

/// A function `--allocator` names twice, across its values.
fn duplicate(functions: &[CustomFunction]) -> Option<&str> {
    functions.iter().enumerate().find_map(|(i, f)| {
        functions[..i]
            .iter()
            .any(|g| g.name == f.name)
            .then_some(f.name.as_str())
    })
}
