//! Everything that can fail on bad input or a missing requirement, before anything
//! runs: checks, the C library, loading and attaching the BPF programs. What is
//! common to both modes is here (signals, checks, watching a `--pid` target); each
//! mode's start is a room of its own.

mod in_process;
mod initial_allocators;
mod kernel_mode;
mod metrics_endpoint;
mod user_mode;
mod user_object;

use std::os::fd::{FromRawFd as _, OwnedFd};

use anyhow::{Context as _, Result};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{Signal, SignalKind, signal},
};

use self::{
    kernel_mode::start_kernel,
    user_mode::{start_user, user_pid},
};
use super::AnySession;
use crate::{
    cli::{Cli, Target},
    health::bpf_log::BpfLog,
    launch::PausedChild,
    metrics::server::Endpoint,
    preflight,
    preload::PreloadLibrary,
    probes,
    stats_file::StartFigures,
    system_preload::SystemPreload,
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

/// The BPF tables' sizes the command line asks for, in user and kernel mode alike.
fn map_capacities(cli: &Cli) -> probes::Capacities {
    probes::Capacities {
        live_blocks: cli.live_blocks(),
        sites: cli.max_sites,
        stacks: cli.max_stacks,
        threads: cli.max_threads,
    }
}
