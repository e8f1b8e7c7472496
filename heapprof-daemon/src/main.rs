//! heapprofd: an eBPF heap profiler writing Go-pprof heap profiles.
//!
//! Uprobes on the C library's allocator feed BPF maps with per-stack live and
//! cumulative counts; this daemon reads them on an interval and at exit, symbolizes
//! the stacks and writes gzip'd `profile.proto` heap profiles.

use std::{
    os::fd::{FromRawFd as _, OwnedFd},
    process::ExitCode,
    time::Duration,
};

use anyhow::{Context as _, Result};
use aya::maps::{MapData, RingBuf};
use clap::Parser as _;
use heapprof_common::ExecEvent;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{Signal, SignalKind, signal},
    time::Instant,
};

use heapprof_daemon::{
    cli::{Cli, Target},
    launch::{self, ChildEvent, PausedChild, Relayed, SignalRelay},
    pprof, preflight, probes,
    session::{
        self, Session, SessionConfig,
        kernel::{KernelSession, KernelSessionConfig},
    },
    tracefs,
};

/// Exit status for bad input and unmet requirements.
const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return command_line_error(err),
    };
    init_logging();
    let target = match cli.target() {
        Ok(target) => target,
        Err(message) => return usage_error(anyhow::anyhow!(message)),
    };
    // Fork before any thread exists (the runtime, the tracer).
    let child = match &target {
        Target::Launch(command) => match launch::fork_paused(command) {
            Ok(child) => Some(child),
            Err(err) => return usage_error(err),
        },
        _ => None,
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => return usage_error(anyhow::Error::new(err).context("starting the runtime")),
    };
    runtime.block_on(async {
        let started = match start(&cli, &target, child) {
            Ok(started) => started,
            Err(err) => return usage_error(err),
        };
        match run(&cli, &target, started).await {
            Ok(code) => code,
            Err(err) => {
                eprintln!("heapprofd: error: {err:#}");
                ExitCode::FAILURE
            }
        }
    })
}

/// A bad command line gets one line (clap's own message names the flag and the value)
/// and status 2; help and version are printed as clap prints them.
fn command_line_error(err: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        err.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
    ) {
        let _ = err.print();
        return ExitCode::SUCCESS;
    }
    // clap's message can span lines (a list of missing flags): joined, without its
    // usage and help hints.
    let rendered = err.render().to_string();
    let message = rendered
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    let message = message.strip_prefix("error: ").unwrap_or(&message);
    eprintln!("heapprofd: error: {message}; see heapprofd --help");
    ExitCode::from(EXIT_USAGE)
}

fn usage_error(err: anyhow::Error) -> ExitCode {
    eprintln!("heapprofd: error: {err:#}");
    ExitCode::from(EXIT_USAGE)
}

fn init_logging() {
    use std::io::Write as _;
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format(|buf, record| match record.level() {
            log::Level::Info => writeln!(buf, "heapprofd: {}", record.args()),
            level => writeln!(
                buf,
                "heapprofd: {}: {}",
                level.as_str().to_lowercase(),
                record.args()
            ),
        })
        .init();
}

/// A user-space or a kernel session.
enum AnySession {
    User(Box<Session>),
    Kernel(Box<KernelSession>),
}

impl AnySession {
    fn dump(&mut self) -> Result<std::path::PathBuf> {
        match self {
            AnySession::User(session) => session.dump(),
            AnySession::Kernel(session) => session.dump(),
        }
    }

    fn top_sites(&mut self, limit: usize) -> Result<Vec<session::TopSite>> {
        match self {
            AnySession::User(session) => session.top_sites(limit),
            AnySession::Kernel(session) => session.top_sites(limit),
        }
    }

    /// Housekeeping on each interval: user mode forgets exited threads and processes.
    /// (Kernel objects outlive the processes that allocated them: nothing to retire.)
    fn tidy(&mut self, target: &Target) {
        if let AnySession::User(session) = self {
            session.remove_exited_threads();
            if matches!(target, Target::All)
                && let Err(err) = session.retire_exited()
            {
                log::warn!("cannot clear exited processes: {err:#}");
            }
        }
    }

    /// User mode: the BPF side's exec notifications, for the event loop to watch.
    fn take_exec_events(&mut self) -> Option<AsyncFd<RingBuf<MapData>>> {
        let AnySession::User(session) = self else {
            return None;
        };
        let ring = session.take_exec_events()?;
        // SAFETY: the AsyncFd owns the ring buffer, whose descriptor stays open and
        // unchanged until it is dropped.
        match unsafe { AsyncFd::register(ring) } {
            Ok(fd) => Some(fd),
            Err(err) => {
                log::warn!(
                    "cannot watch for execs ({err}); images are read on each interval instead"
                );
                None
            }
        }
    }

    fn exec_seen(&mut self, event: ExecEvent) {
        if let AnySession::User(session) = self {
            session.exec_seen(event);
        }
    }

    fn next_exec_read(&self) -> Option<Instant> {
        match self {
            AnySession::User(session) => session.next_exec_read().map(Instant::from_std),
            AnySession::Kernel(_) => None,
        }
    }

    fn read_due_images(&mut self) {
        if let AnySession::User(session) = self {
            session.read_due_images();
        }
    }

    /// Called while a launched command is held at its exit.
    fn before_exit(&mut self) {
        if let AnySession::User(session) = self
            && let Err(err) = session.refresh_unmapped()
        {
            log::warn!("cannot read the exiting process's mappings: {err:#}");
        }
    }
}

/// A session ready to run, with what tells it that its target has ended.
struct Started {
    session: AnySession,
    /// Launch mode: the command, held before exec.
    child: Option<PausedChild>,
    /// `--pid` mode: readable once the target exits.
    target_exit: Option<AsyncFd<OwnedFd>>,
    /// Installed before readiness is announced, so a signal sent right after it is caught.
    sigint: Signal,
    sigterm: Signal,
}

/// Everything that can fail on bad input or a missing requirement: checks, libc, load, attach.
fn start(cli: &Cli, target: &Target, child: Option<PausedChild>) -> Result<Started> {
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
    let mut ebpf = probes::load(capacities, sample_rate, pid, &libc)?;
    let attached = probes::attach(&mut ebpf, &libc, pid, cli.attach)?;
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
    let mut ebpf = probes::kernel::load(capacities, &events, filter)?;
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

fn print_top(top: &[session::TopSite]) {
    println!("\nTop allocation sites (in use at the end / allocated in total):");
    println!(
        "{:>12} {:>9} {:>13} {:>10}  SITE",
        "LIVE BYTES", "LIVE", "TOTAL BYTES", "TOTAL"
    );
    for site in top {
        println!(
            "{:>12} {:>9} {:>13} {:>10}  {}",
            site.inuse_bytes,
            site.inuse_objects,
            site.alloc_bytes,
            site.alloc_objects,
            site.description
        );
    }
}

/// Waits for exec notifications and takes every one that is ready.
async fn drain_exec_events(fd: &mut AsyncFd<RingBuf<MapData>>) -> Vec<ExecEvent> {
    let mut guard = match fd.readable_mut().await {
        Ok(guard) => guard,
        Err(err) => {
            log::warn!("cannot watch for execs: {err}");
            return std::future::pending().await;
        }
    };
    let mut events = Vec::new();
    while let Some(item) = guard.get_inner_mut().next() {
        if item.len() >= std::mem::size_of::<ExecEvent>() {
            // SAFETY: the BPF side writes whole ExecEvents (plain integers); read unaligned.
            events.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<ExecEvent>()) });
        }
    }
    guard.clear_ready();
    events
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

async fn run(cli: &Cli, target: &Target, started: Started) -> Result<ExitCode> {
    let Started {
        mut session,
        child,
        target_exit,
        mut sigint,
        mut sigterm,
    } = started;
    let child_pid = child.as_ref().map(|c| c.pid);
    let mut child_events = child.map(PausedChild::release);
    let mut ticks = tokio::time::interval_at(Instant::now() + cli.interval, cli.interval);
    let deadline = cli.duration.map(|d| Instant::now() + d);
    let far_future = Instant::now() + Duration::from_secs(100 * 365 * 86400);
    let mut exit_code = ExitCode::SUCCESS;
    let mut relay = child_pid.map(SignalRelay::new);
    let mut exec_events = session.take_exec_events();

    loop {
        let next_exec_read = session.next_exec_read();
        tokio::select! {
            events = async { match exec_events.as_mut() { Some(fd) => drain_exec_events(fd).await, None => std::future::pending().await } } => {
                for event in events {
                    session.exec_seen(event);
                }
            }
            _ = tokio::time::sleep_until(next_exec_read.unwrap_or(far_future)), if next_exec_read.is_some() => {
                session.read_due_images();
            }
            _ = ticks.tick() => {
                if let Err(err) = session.dump() {
                    log::error!("cannot write a profile: {err:#}");
                }
                session.tidy(target);
            }
            signal = async { tokio::select! { _ = sigint.recv() => libc::SIGINT, _ = sigterm.recv() => libc::SIGTERM } } => {
                // Launch mode passes the signal on: the command's exit ends the run.
                match relay.as_mut().map(|relay| relay.on_signal(signal, Instant::now().into_std())) {
                    Some(Relayed::Passed | Relayed::Repeat) => {}
                    Some(Relayed::StopNow) | None => break,
                }
            }
            _ = tokio::time::sleep_until(relay.as_ref().and_then(SignalRelay::warning_due).map_or(far_future, Instant::from_std)), if relay.as_ref().is_some_and(|r| r.warning_due().is_some()) => {
                if let Some(relay) = relay.as_mut() {
                    relay.warn_still_running();
                }
            }
            _ = tokio::time::sleep_until(deadline.unwrap_or(far_future)), if deadline.is_some() => {
                log::info!("--duration reached");
                break;
            }
            event = async { match child_events.as_mut() { Some(events) => events.recv().await, None => std::future::pending().await } } => {
                match event {
                    Some(ChildEvent::Exiting { resume }) => {
                        // The process still has its address space: read its mappings now.
                        session.before_exit();
                        drop(resume);
                    }
                    Some(ChildEvent::Exited(code)) => {
                        log::info!("the command exited with status {code}");
                        exit_code = ExitCode::from(u8::try_from(code).unwrap_or(1));
                        break;
                    }
                    None => break,
                }
            }
            _ = async { match &target_exit { Some(fd) => { let _ = fd.readable().await; }, None => std::future::pending().await } } => {
                log::info!("the target process exited");
                break;
            }
        }
    }
    let written = session.dump();
    if cli.top > 0 {
        match session.top_sites(cli.top) {
            Ok(top) => print_top(&top),
            Err(err) => log::warn!("cannot summarize the sites: {err:#}"),
        }
    }
    drop(session); // detaches every probe
    written.context("writing the final profile")?;
    Ok(exit_code)
}
