//! Everything that can fail on bad input or a missing requirement, before anything
//! runs: checks, the C library, loading and attaching the BPF programs.

use std::os::fd::{FromRawFd as _, OwnedFd};

use anyhow::{Context as _, Result};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{Signal, SignalKind, signal},
};

use heapprof_common::unwind::UnwindMode;

use super::AnySession;
use crate::{
    cli::{Cli, Target},
    launch::{self, PausedChild},
    pprof, preflight, probes,
    session::{
        Session, SessionConfig,
        kernel::{KernelSession, KernelSessionConfig},
    },
    tracefs,
    unwind::loader::TableCapacities,
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
}

/// Everything that can fail on bad input or a missing requirement: checks, libc, load, attach.
pub fn start(cli: &Cli, target: &Target, child: Option<PausedChild>) -> Result<Started> {
    let sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    preflight::check_privileges()?;
    preflight::check_bpf()?;
    if cli.kernel {
        let target_exit = watch_target(target, true)?;
        let session = start_kernel(cli, target, child.as_ref())?;
        return Ok(Started {
            session: AnySession::Kernel(Box::new(session)),
            child,
            target_exit,
            sigint,
            sigterm,
        });
    }
    preflight::check_uprobes()?;
    // Opened before anything is attached: a target that exits at any later moment is
    // then seen as an exit (final profile, status 0), never as a failure to find it.
    let target_exit = watch_target(target, false)?;
    pprof::writer::prepare_output_dir(&cli.output)?;

    let (libc_path, libc_maps_path) = match (&cli.libc, target) {
        (Some(path), _) => (path.clone(), path.display().to_string()),
        (None, Target::Pid(pid)) => probes::libc::find_in_process(*pid)?,
        // A launched command and other processes use the system's C library, the one heapprofd runs on.
        (None, _) => match probes::libc::find_in_process(std::process::id()) {
            Ok(own) => own,
            // A static heapprofd maps no C library of its own.
            Err(_) => {
                let system = probes::libc::find_system()?;
                let label = system.display().to_string();
                (system, label)
            }
        },
    };
    let libc = probes::libc::resolve(&libc_path, &libc_maps_path, cli.probe_placement)?;

    let capacities = probes::Capacities {
        live_blocks: cli.max_live_blocks,
        sites: cli.max_sites,
        stacks: cli.max_stacks,
        threads: cli.max_threads,
    };
    let sample_rate = cli.sample_rate.unwrap_or(0);
    let pid = match (target, &child) {
        (Target::Pid(pid), _) => Some(*pid),
        (Target::Launch(_), Some(child)) => Some(child.pid),
        _ => None,
    };
    let unwind_mode = cli.unwind.mode();
    let tables = TableCapacities {
        rows: cli.max_unwind_rows,
        rules: cli.max_unwind_rules,
        objects: cli.max_unwind_objects,
    };
    let unwinding = probes::UnwindSettings {
        mode: unwind_mode,
        tables,
        processes: cli.max_processes,
        hold_at_loader_events: child.is_some()
            && unwind_mode != UnwindMode::FramePointers
            && !cli.empty_programs,
        empty_programs: cli.empty_programs,
    };
    // The loader's hook tells when objects are mapped; frame pointers need no tables.
    let loader = match (unwind_mode, target) {
        (UnwindMode::FramePointers, _) => None,
        (_, Target::Pid(pid)) => probes::loader::of_process(*pid)?,
        // A script (a shebang, a wrapper) execs its interpreter: the system's loader.
        (_, Target::Launch(command)) => command
            .first()
            .and_then(|program| launch::resolve_program(program).ok())
            .and_then(|program| probes::loader::of_executable(&program))
            .or_else(probes::loader::system),
        (_, Target::All) => probes::loader::system(),
    };
    match &loader {
        Some(loader) => log::debug!(
            "dynamic loader {}: _dl_debug_state at {:#x}",
            loader.display,
            loader.hook_offset
        ),
        None if unwind_mode != UnwindMode::FramePointers => log::debug!(
            "no dynamic loader hook: new objects' unwind tables load when stacks meet them"
        ),
        None => {}
    }
    let cgroup = cgroup_filter(cli)?;
    let mut ebpf = probes::load(
        capacities,
        sample_rate,
        !cli.no_peak,
        cgroup,
        pid,
        &libc,
        unwinding,
    )?;
    let attached = probes::attach(&mut ebpf, &libc, loader.as_ref(), pid, cli.attach)?;
    log::debug!("uprobes attached as {:?}", attached.method);
    probes::arm(&mut ebpf, &libc)?;
    let probes = attached.probes;
    let config = SessionConfig {
        target: target.clone(),
        output: cli.output.clone(),
        libc,
        libc_maps_path,
        sample_rate,
        bpf_stats: cli.bpf_stats,
        unwind_tables: (unwind_mode != UnwindMode::FramePointers).then_some(tables),
        retain_exited: cli.retain_exited,
    };
    let mut session = Session::new(config, ebpf)?;
    session.prime_processes();
    // Logged last: once it is printed, heapprofd is fully ready (tests wait for it).
    log::info!(
        "{probes} probes on {} ({}), profiles every {:?} in {}",
        session.libc_display(),
        match target {
            Target::Pid(pid) => format!("pid {pid}"),
            Target::Launch(command) => format!("`{}`, pid {}", command.join(" "), pid.unwrap_or(0)),
            Target::All => "all processes".to_owned(),
        },
        cli.interval,
        cli.output.display()
    );
    Ok(Started {
        session: AnySession::User(Box::new(session)),
        child,
        target_exit,
        sigint,
        sigterm,
    })
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
fn start_kernel(cli: &Cli, target: &Target, child: Option<&PausedChild>) -> Result<KernelSession> {
    let tracing = tracefs::root()?;
    let selection = probes::kernel::EventSelection {
        pages: cli.pages,
        follow_forks: matches!(target, Target::Launch(_)),
    };
    let events = probes::kernel::resolve_events(&tracing, selection)?;
    pprof::writer::prepare_output_dir(&cli.output)?;
    let capacities = probes::Capacities {
        live_blocks: cli.max_live_blocks,
        sites: cli.max_sites,
        stacks: cli.max_stacks,
        threads: cli.max_threads,
    };
    let filter = !matches!(target, Target::All);
    let mut ebpf = probes::kernel::load(capacities, &events, filter, cgroup_filter(cli)?)?;
    let config = KernelSessionConfig {
        target: target.clone(),
        output: cli.output.clone(),
        events: events.iter().map(|(event, _)| *event).collect(),
        bpf_stats: cli.bpf_stats,
    };
    let attached = probes::kernel::attach(&mut ebpf, &events)?;
    let mut session = KernelSession::new(config, ebpf)?;
    let pid = match (target, child) {
        (Target::Pid(pid), _) => Some(*pid),
        (Target::Launch(_), Some(child)) => Some(child.pid),
        _ => None,
    };
    if let Some(pid) = pid {
        session.trace_process(pid)?;
    }
    let names: Vec<&str> = events.iter().map(|(event, _)| event.name()).collect();
    // Logged last: once it is printed, heapprofd is fully ready (tests wait for it).
    log::info!(
        "{attached} probes on kernel tracepoints ({}) for {}, profiles every {:?} in {}",
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
        cli.output.display()
    );
    Ok(session)
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
