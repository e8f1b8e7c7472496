//! Everything that can fail on bad input or a missing requirement, before anything
//! runs: checks, the C library, loading and attaching the BPF programs.

use std::os::fd::{FromRawFd as _, OwnedFd};

use anyhow::{Context as _, Result, bail};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{Signal, SignalKind, signal},
};

use heapprof_common::{names as map_names, unwind::UnwindMode};

use super::AnySession;
use crate::{
    allocators::{AllocatorProbes, ProbeSettings, spec::CustomFunction},
    cli::{Cli, Target},
    health::{self, bpf_log::BpfLog},
    inject,
    launch::{self, PausedChild},
    metrics::{self, TableFigure, server::Endpoint},
    pprof, preflight,
    preload::PreloadLibrary,
    probes,
    procmaps::ObjectCache,
    session::{
        UserSession, UserSessionConfig,
        kernel::{KernelSession, KernelSessionConfig},
    },
    stats_file::{JoinedBy, Joining, StartFigures},
    system_preload::SystemPreload,
    tracefs,
    unwind::table_upload::TableCapacities,
};

/// A session ready to run, with what tells it that its target has ended.
pub struct Started {
    pub(super) session: AnySession,
    /// Launch mode: the command, held before exec.
    pub(super) child: Option<PausedChild>,
    /// `--pid` mode: readable once the target exits.
    pub(super) target_exit: Option<AsyncFd<OwnedFd>>,
    /// Installed before readiness is announced, so a signal sent right after it is caught.
    pub(super) sigint: Signal,
    pub(super) sigterm: Signal,
    /// The BPF programs' log lines, when the object has them.
    pub(super) bpf_log: Option<BpfLog>,
    /// What `--stats-json` reports of the start.
    pub(super) figures: StartFigures,
    /// `--preload system`: the entry in /etc/ld.so.preload and the socket processes
    /// ask to join on.
    pub(super) system: Option<SystemPreload>,
}

/// Everything that can fail on bad input or a missing requirement: checks, libc, load, attach.
pub fn start(
    cli: &Cli,
    target: &Target,
    mut child: Option<PausedChild>,
    preload: Option<PreloadLibrary>,
) -> Result<Started> {
    let sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    preflight::check_privileges()?;
    preflight::check_bpf()?;
    // Before anything is attached: an address in use ends the run before it starts.
    let endpoint = cli.metrics.map(Endpoint::bind).transpose()?;
    let (session, target_exit, bpf_log, figures, system) = if cli.kernel {
        let target_exit = watch_target(target, true)?;
        let (session, bpf_log, figures) = start_kernel(cli, target, child.as_ref(), endpoint)?;
        (
            AnySession::Kernel(Box::new(session)),
            target_exit,
            bpf_log,
            figures,
            None,
        )
    } else {
        // Decided first: what the trial uprobe's refusal means depends on it.
        let method = probes::attach_method(cli.attach, user_pid(target, child.as_ref()));
        log::debug!("uprobes attached as {method:?}");
        preflight::check_uprobes(method)?;
        // Opened before anything is attached: a target that exits at any later moment is
        // then seen as an exit (final profile, status 0), never as a failure to find it.
        let target_exit = watch_target(target, false)?;
        let (session, bpf_log, figures, system) =
            start_user(cli, target, child.as_mut(), preload, endpoint, method)?;
        (
            AnySession::User(Box::new(session)),
            target_exit,
            bpf_log,
            figures,
            system,
        )
    };
    Ok(Started {
        session,
        child,
        target_exit,
        sigint,
        sigterm,
        bpf_log,
        figures,
        system,
    })
}

/// User mode: the BPF object loaded, the allocators probed, the loader's hook and the
/// process events attached, the session ready; logs the readiness line last.
/// The one process user mode watches: the pid given, or the program launched.
fn user_pid(target: &Target, child: Option<&PausedChild>) -> Option<u32> {
    match (target, child) {
        (Target::Pid(pid), _) => Some(*pid),
        (Target::Launch(_), Some(child)) => Some(child.pid),
        _ => None,
    }
}

fn start_user(
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

/// The reason `--pid` uses the allocator's probes when it does not try to inject.
fn probes_chosen(cli: &Cli) -> &'static str {
    if cli.stacks_only {
        "--stacks-only (a benchmark baseline)"
    } else if cli.empty_programs {
        "--empty-programs (a benchmark baseline)"
    } else {
        "--inject off"
    }
}

/// `--pid --inject auto`: loads the preload library into the running process and
/// probes it; `None`, with the reason on one line, where it cannot (the process then
/// gets the allocator's probes).
fn load_in_process(
    pid: u32,
    ebpf: &mut aya::Ebpf,
    allocators: &mut AllocatorProbes,
    joining: &mut Option<Joining>,
) -> Result<Option<inject::Injection>> {
    let image = crate::preload::injectable_image()?;
    let entries = inject::entries(&image).context("the preload library has no entry points")?;
    let attempt = (|| {
        let mut injection = inject::Injection::start(pid)?;
        let file = injection.load(&image, entries)?;
        let library =
            PreloadLibrary::injected(file).map_err(|err| inject::NotJoined(format!("{err:#}")))?;
        allocators
            .add_preload(ebpf, library)
            .map_err(|err| inject::NotJoined(format!("probing its copy: {err:#}")))?;
        Ok(injection)
    })();
    match attempt {
        Ok(injection) => Ok(Some(injection)),
        Err(reason) => {
            *joining = Some(cannot_join(pid, &reason));
            Ok(None)
        }
    }
}

/// Has the loaded library join: it redirects the process's allocator calls to itself.
/// Where it refuses, the library is forgotten and the process gets the probes. Returns
/// how the process was joined.
fn join_in_process(
    injection: inject::Injection,
    replies: &OwnedFd,
    session: &mut UserSession,
    sample_rate: u64,
) -> Joining {
    use std::os::fd::AsFd as _;
    let pid = injection.pid();
    match injection.join(replies.as_fd(), sample_rate, inject::Children::Left) {
        Ok(joined) => {
            log::info!(
                "pid {pid}: joined in-process: heapprofd's library serves its allocator \
                 calls ({} slots redirected; they are put back at exit)",
                joined.slots
            );
            session.set_joined(Some(joined));
            Joining {
                pid,
                how: JoinedBy::Injected,
                reason: None,
            }
        }
        Err(reason) => {
            session.probe_instead_of_preload(pid);
            cannot_join(pid, &reason)
        }
    }
}

/// How `pid` is joined where it cannot be joined in-process (said once the session stands).
fn cannot_join(pid: u32, reason: &inject::NotJoined) -> Joining {
    Joining {
        pid,
        how: JoinedBy::Probes,
        reason: Some(reason.to_string()),
    }
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
    let cgroup = cgroup_filter(cli)?;
    probes::load_bpf_object(
        capacities,
        cli.sample_rate.unwrap_or(0),
        !cli.no_peak,
        cgroup,
        pid,
        unwinding,
    )
}

/// Probes the allocators known before anything runs ([`initial_allocators`]); `--libc`
/// naming a library without an allocator is an error.
fn probe_initial_allocators(
    cli: &Cli,
    target: &Target,
    program: Option<&std::path::Path>,
    preloading: bool,
    ebpf: &mut aya::Ebpf,
    allocators: &mut AllocatorProbes,
) -> Result<()> {
    let mut objects = ObjectCache::default();
    // The system-wide preload probes each process it does not serve for itself alone,
    // as it is read: nothing for every process (the C library's vendor functions, say,
    // would trap in the joined processes too). `--libc`, named by the user, stays.
    let system = cli.system_preload(target);
    for (path, executable) in initial_allocators(cli, target, program)? {
        if system && cli.libc.as_deref() != Some(path.as_path()) {
            continue;
        }
        let label = path.display().to_string();
        let object = objects
            .open(&path, &label)
            .with_context(|| format!("opening {label}"))?;
        let probed = allocators
            .probe_found_object(ebpf, &object, executable, executable || !preloading)
            .with_context(|| format!("probing the allocator in {label}"))?;
        if probed == 0 && !preloading && cli.libc.as_deref() == Some(path.as_path()) {
            bail!(
                "{label} has no malloc/free symbols; point --libc at the library that \
                 provides the program's allocator"
            );
        }
    }
    Ok(())
}

/// `--metrics`: serves the endpoint from now on (its task runs whenever the event
/// loop waits); returns the exporter the session publishes its profiles to.
fn serve_metrics(
    cli: &Cli,
    target: &Target,
    endpoint: Endpoint,
    map_memory: &[health::map_memory::TableMemory],
) -> metrics::Exporter {
    let table = |table, value: u32| TableFigure {
        table,
        value: value.into(),
    };
    let mut capacities = vec![
        table("live_blocks", cli.live_blocks()),
        table("sites", cli.max_sites),
        table("stacks", cli.max_stacks),
    ];
    if !cli.kernel && cli.unwind.mode() != UnwindMode::FramePointers {
        capacities.extend([
            table("unwind_rows", cli.max_unwind_rows),
            table("unwind_rules", cli.max_unwind_rules),
            table("unwind_objects", cli.max_unwind_objects),
        ]);
    }
    let (exporter, registry) = metrics::new(metrics::Settings {
        active_only: !cli.kernel && *target == Target::All,
        top: cli.metrics_top,
        capacities,
        kernel_memory: map_memory
            .iter()
            .map(|t| TableFigure {
                table: t.table,
                value: t.bytes,
            })
            .collect(),
        push: (!cli.push.is_empty()).then(|| crate::push::PushMetrics::shared().clone()),
    });
    match endpoint.local_addr() {
        Ok(addr) => log::info!("metrics at http://{addr}/metrics"),
        Err(err) => log::warn!("metrics: cannot tell the address served: {err}"),
    }
    endpoint.spawn(registry);
    exporter
}

/// `--pid` mode: a descriptor readable once the target exits, opened before anything is
/// attached, so that a target exiting at any later moment is an exit (final profile,
/// status 0), never a failure to find it.
fn watch_target(target: &Target, kernel_mode: bool) -> Result<Option<AsyncFd<OwnedFd>>> {
    match target {
        Target::Pid(pid) => {
            preflight::check_pid(*pid, kernel_mode)?;
            Ok(Some(
                pidfd(*pid).with_context(|| format!("watching process {pid}"))?,
            ))
        }
        _ => Ok(None),
    }
}

/// Kernel mode: tracefs and event layouts, kernel symbols, load, attach.
fn start_kernel(
    cli: &Cli,
    target: &Target,
    child: Option<&PausedChild>,
    endpoint: Option<Endpoint>,
) -> Result<(KernelSession, Option<BpfLog>, StartFigures)> {
    let tracing = tracefs::root()?;
    let selection = probes::kernel::EventSelection {
        pages: cli.pages,
        follow_forks: matches!(target, Target::Launch(_)),
    };
    let events = probes::kernel::resolve_events(&tracing, selection)?;
    pprof::writer::prepare_output_dir(&cli.output_dir())?;
    let capacities = probes::Capacities {
        live_blocks: cli.live_blocks(),
        sites: cli.max_sites,
        stacks: cli.max_stacks,
        threads: cli.max_threads,
    };
    let filter = !matches!(target, Target::All);
    let mut ebpf = probes::kernel::load_bpf_object(
        capacities,
        &events,
        filter,
        cgroup_filter(cli)?,
        cli.sample_rate.unwrap_or(0),
    )?;
    if let Some(rate) = cli.sample_rate {
        log::info!(
            "sampling about one kernel allocation per {rate} bytes, decided in the \
             tracepoint programs before the stack is taken; values are scaled estimates"
        );
    }
    let bpf_log = BpfLog::init(&mut ebpf);
    let config = KernelSessionConfig {
        target: target.clone(),
        output: cli.output_dir(),
        events: events.iter().map(|(event, _)| *event).collect(),
        bpf_stats: cli.bpf_stats,
        sample_rate: cli.sample_rate.unwrap_or(0),
    };
    let mut attached = probes::kernel::attach(&mut ebpf, &events)?;
    let deferred_frees = probes::kernel::attach_deferred_frees(&mut ebpf);
    attached += deferred_frees.seen.len();
    if let Some(undercounted) = deferred_frees.undercounted() {
        log::warn!("{undercounted}");
    }
    let programs = StartFigures::programs_of(&ebpf);
    let mut session = KernelSession::new(config, ebpf, deferred_frees)?;
    let pid = match (target, child) {
        (Target::Pid(pid), _) => Some(*pid),
        (Target::Launch(_), Some(child)) => Some(child.pid),
        _ => None,
    };
    if let Some(pid) = pid {
        session.trace_process(pid)?;
    }
    let map_memory = health::map_memory::tables();
    log::info!("{}", health::map_memory::describe(&map_memory));
    if let Some(endpoint) = endpoint {
        session.export_metrics(serve_metrics(cli, target, endpoint, &map_memory));
    }
    let mut names: Vec<&str> = events.iter().map(|(event, _)| event.name()).collect();
    names.extend(session.deferred_frees().seen.iter().copied());
    // Logged last: once it is printed, heapprofd is fully ready (tests wait for it).
    log::info!(
        "{attached} probes on kernel tracepoints and functions ({}) for {}, profiles every {:?} in {}",
        names.join(" "),
        match target {
            Target::Pid(pid) => format!("pid {pid}"),
            Target::Launch(command) => format!(
                "`{}`, pid {}, and its children",
                command.join(" "),
                pid.unwrap_or(0)
            ),
            Target::All => "all processes".to_owned(),
        },
        cli.interval,
        cli.output_dir().display()
    );
    let figures = StartFigures {
        programs,
        kernel_memory: map_memory,
        joining: None,
    };
    Ok((session, bpf_log, figures))
}

/// A pidfd that becomes readable when `pid` exits.
fn pidfd(pid: u32) -> Result<AsyncFd<OwnedFd>> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("pidfd_open");
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // SAFETY: the AsyncFd owns the OwnedFd, which stays open and unchanged until it is dropped.
    unsafe { AsyncFd::register(fd) }.map_err(|err| anyhow::anyhow!("registering the pidfd: {err}"))
}

/// The cgroup subtree `--cgroup` names, resolved to what the programs compare.
fn cgroup_filter(cli: &Cli) -> Result<Option<crate::cgroup::CgroupFilter>> {
    cli.cgroup
        .as_deref()
        .map(crate::cgroup::CgroupFilter::resolve)
        .transpose()
        .map_err(anyhow::Error::new)
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

/// Allocator objects probed before anything runs, with whether each is a program:
/// `--libc`; for a launched command, its program (a static binary, a statically linked
/// allocator) and the system's C library; for `--all`, the system's C library and the
/// allocator libraries installed at the usual places, so that processes starting later
/// are counted from their first call. Everything else joins as processes are read.
fn initial_allocators(
    cli: &Cli,
    target: &Target,
    program: Option<&std::path::Path>,
) -> Result<Vec<(std::path::PathBuf, bool)>> {
    let mut objects = Vec::new();
    if let Some(libc) = &cli.libc {
        if !libc.is_file() {
            bail!(
                "--libc {}: no such file; give the path of the allocator library",
                libc.display()
            );
        }
        objects.push((libc.clone(), false));
    }
    if matches!(target, Target::Pid(_)) {
        return Ok(objects);
    }
    // The system's C library, the one heapprofd runs on (a static heapprofd has none).
    let own = probes::libc::find_in_process(std::process::id())
        .map(|(_, maps_path)| std::path::PathBuf::from(maps_path));
    match own.or_else(|_| probes::libc::find_system()) {
        Ok(libc) => objects.push((libc, false)),
        Err(err) => log::debug!("{err:#}"),
    }
    match target {
        Target::Launch(_) => {
            if let Some(program) = program {
                objects.push((program.to_owned(), true));
            }
        }
        Target::All => objects.extend(
            crate::allocators::serving::system_allocators()
                .into_iter()
                .map(|path| (path, false)),
        ),
        Target::Pid(_) => {}
    }
    let mut seen = std::collections::HashSet::new();
    objects.retain(|(path, _)| seen.insert(std::fs::canonicalize(path).unwrap_or(path.clone())));
    Ok(objects)
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
