//! The event loop of a running session.

use std::{process::ExitCode, time::Duration};

use anyhow::{Context as _, Result};
use aya::maps::{MapData, RingBuf};
use heapprof_common::{ExecEvent, unwind::MappingsRequest};
use tokio::{
    io::unix::AsyncFd,
    time::{Instant, Interval, MissedTickBehavior},
};

use super::{
    AnySession, Started,
    finish::{Ending, finish},
    outputs::Outputs,
};
use crate::{
    cli::{Cli, Target},
    launch::{ChildEvent, PausedChild, Relayed, SignalRelay},
    push::PushConfig,
    system_preload::SystemPreload,
};

/// The profiles' ticks: one each `interval`, the first an interval from now. A dump
/// slower than the interval (`--all` on a busy host: every process read and
/// symbolized) puts the next tick a whole interval after it, rather than firing the
/// missed ones back to back. Back to back, the loop never waited, so the runtime never
/// read its signal pipe: SIGINT and SIGTERM went unseen for as long as dumps stayed
/// slow (seen: 20-second dumps at `--interval 200ms` ignored a SIGINT for 13 minutes).
fn profile_ticks(interval: Duration) -> Interval {
    let mut ticks = tokio::time::interval_at(Instant::now() + interval, interval);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticks
}

/// Waits for records in a ring buffer of the BPF side and takes every one that is
/// ready. `T` must be the plain-integer record the BPF side writes.
async fn drain_ring<T: Copy>(fd: &mut AsyncFd<RingBuf<MapData>>) -> Vec<T> {
    let mut guard = match fd.readable_mut().await {
        Ok(guard) => guard,
        Err(err) => {
            log::warn!("cannot watch a BPF ring buffer: {err}");
            return std::future::pending().await;
        }
    };
    let records = read_records(guard.get_inner_mut());
    guard.clear_ready();
    records
}

/// Takes every record waiting in a ring buffer of the BPF side, without waiting.
/// `T` must be the plain-integer record the BPF side writes.
fn read_records<T: Copy>(ring: &mut RingBuf<MapData>) -> Vec<T> {
    let mut records = Vec::new();
    while let Some(item) = ring.next() {
        if item.len() >= std::mem::size_of::<T>() {
            // SAFETY: the BPF side writes whole records of plain integers; read unaligned.
            records.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<T>()) });
        }
    }
    records
}

/// Runs a started session until it ends; returns the exit status.
pub async fn run(
    cli: &Cli,
    target: &Target,
    started: Started,
    push: Option<PushConfig>,
) -> Result<ExitCode> {
    let Started {
        session,
        child,
        target_exit,
        sigint,
        sigterm,
        bpf_log,
        figures,
        system,
    } = started;
    let outputs = Outputs::open(cli, push)?;
    // Ready once every process is served: with the system-wide preload, once those
    // running before heapprofd have been asked to join.
    let mut ready_file = cli.ready_file.as_deref();
    if !system.as_ref().is_some_and(SystemPreload::asks_running) {
        say_ready_once(&mut ready_file)?;
    }
    let child_pid = child.as_ref().map(|c| c.pid);
    let mut state = LoopState {
        exec_events: None,
        mapping_requests: None,
        session,
        outputs,
        system,
        bpf_log,
        child_pid,
        child_events: child.map(PausedChild::release),
        relay: child_pid.map(SignalRelay::new),
        target_exit,
        sigint,
        sigterm,
    };
    state.exec_events = state.session.take_exec_events();
    state.mapping_requests = state.session.take_mapping_requests();
    let exit_code = event_loop(cli, target, &mut state, ready_file).await?;
    let LoopState {
        mut session,
        mut exec_events,
        system,
        bpf_log,
        outputs,
        ..
    } = state;
    // The loop may end before it reads the exec events of forks that exec'd right
    // before the command exited: they carry the fork origins that symbolize those
    // forks' first images in the final profile.
    if let Some(fd) = exec_events.as_mut() {
        for event in read_records::<ExecEvent>(fd.get_mut()) {
            session.exec_seen(event);
        }
    }
    let ending = Ending {
        session,
        system,
        bpf_log,
        figures,
        outputs,
    };
    finish(cli, target, ending).await?;
    Ok(exit_code)
}

/// What the event loop watches and acts on.
struct LoopState {
    session: AnySession,
    outputs: Outputs,
    system: Option<SystemPreload>,
    bpf_log: Option<crate::health::bpf_log::BpfLog>,
    /// Launch mode: the command, its events and the signals passed on to it.
    child_pid: Option<u32>,
    child_events: Option<tokio::sync::mpsc::UnboundedReceiver<ChildEvent>>,
    relay: Option<SignalRelay>,
    /// `--pid`: readable once the target has exited.
    target_exit: Option<AsyncFd<std::os::fd::OwnedFd>>,
    sigint: tokio::signal::unix::Signal,
    sigterm: tokio::signal::unix::Signal,
    exec_events: Option<AsyncFd<RingBuf<MapData>>>,
    mapping_requests: Option<AsyncFd<RingBuf<MapData>>>,
}

/// Serves the session's events until it ends (the command or the target exits, a
/// signal, `--duration`); returns the exit status. `ready_file` is created once the
/// system-wide preload has asked the processes running before heapprofd, if not yet.
async fn event_loop(
    cli: &Cli,
    target: &Target,
    state: &mut LoopState,
    mut ready_file: Option<&std::path::Path>,
) -> Result<ExitCode> {
    // Each watched thing its own borrow: the select's arms wait on them at once.
    let LoopState {
        session,
        outputs,
        system,
        bpf_log,
        child_pid,
        child_events,
        relay,
        target_exit,
        sigint,
        sigterm,
        exec_events,
        mapping_requests,
    } = state;
    let mut ticks = profile_ticks(cli.interval);
    let deadline = cli.duration.map(|d| Instant::now() + d);
    let far_future = Instant::now() + Duration::from_secs(100 * 365 * 86400);
    loop {
        let next_exec_read = session.next_exec_read();
        tokio::select! {
            // A program waiting in its start for the system-wide preload's join (not
            // biased: a stream of exec events must not starve the signals).
            event = async { match system.as_mut() { Some(system) => system.next().await, None => std::future::pending().await } } => {
                if let Some(system) = system.as_ref() {
                    session.system_event(system, event);
                    if !system.asks_running() {
                        say_ready_once(&mut ready_file)?;
                    }
                }
            }
            events = async { match exec_events.as_mut() { Some(fd) => drain_ring::<ExecEvent>(fd).await, None => std::future::pending().await } } => {
                for event in events {
                    session.exec_seen(event);
                }
            }
            requests = async { match mapping_requests.as_mut() { Some(fd) => drain_ring::<MappingsRequest>(fd).await, None => std::future::pending().await } } => {
                for request in requests {
                    session.mappings_requested(request);
                }
            }
            _ = tokio::time::sleep_until(next_exec_read.unwrap_or(far_future)), if next_exec_read.is_some() => {
                outputs.images_read(session.read_due_images());
            }
            () = async { match bpf_log.as_mut() { Some(log) => log.forward().await, None => std::future::pending().await } } => {}
            _ = ticks.tick() => outputs.interval_profile(session, bpf_log.as_mut(), target),
            signal = async { tokio::select! { _ = sigint.recv() => libc::SIGINT, _ = sigterm.recv() => libc::SIGTERM } } => {
                // Launch mode passes the signal on: the command's exit ends the run.
                match relay.as_mut().map(|relay| relay.on_signal(signal, Instant::now().into_std())) {
                    Some(Relayed::Passed | Relayed::Repeat) => {}
                    Some(Relayed::StopNow) | None => return Ok(ExitCode::SUCCESS),
                }
            }
            _ = tokio::time::sleep_until(relay.as_ref().and_then(SignalRelay::warning_due).map_or(far_future, Instant::from_std)), if relay.as_ref().is_some_and(|r| r.warning_due().is_some()) => {
                if let Some(relay) = relay.as_mut() {
                    relay.warn_still_running();
                }
            }
            _ = tokio::time::sleep_until(deadline.unwrap_or(far_future)), if deadline.is_some() => {
                log::info!("--duration reached");
                return Ok(ExitCode::SUCCESS);
            }
            event = async { match child_events.as_mut() { Some(events) => events.recv().await, None => std::future::pending().await } } => {
                match on_command_event(event, *child_pid, session, relay.as_mut()) {
                    CommandFlow::Running => {}
                    CommandFlow::Exited(code) => return Ok(code),
                    CommandFlow::Gone => return Ok(ExitCode::SUCCESS),
                }
            }
            _ = async { match target_exit { Some(fd) => { let _ = fd.readable().await; }, None => std::future::pending().await } } => {
                log::info!("the target process exited");
                return Ok(ExitCode::SUCCESS);
            }
        }
    }
}

/// What a launched command's event means for the session.
enum CommandFlow {
    /// It goes on (held at an exec, a loader event or its exit, and let go).
    Running,
    /// It exited with this status: the session ends with it.
    Exited(ExitCode),
    /// Its watcher is gone: the session ends.
    Gone,
}

/// Answers an event of the launched command `pid`, which is held until its `resume`
/// is answered or dropped.
fn on_command_event(
    event: Option<ChildEvent>,
    pid: Option<u32>,
    session: &mut AnySession,
    relay: Option<&mut SignalRelay>,
) -> CommandFlow {
    match event {
        Some(ChildEvent::Exec { resume }) => {
            if let Some(pid) = pid {
                session.exec_hold(pid);
            }
            drop(resume);
        }
        Some(ChildEvent::KernelSigcont { resume }) => {
            let hold = pid.is_some_and(|pid| session.loader_hold(pid));
            let _ = resume.send(hold);
        }
        Some(ChildEvent::Exiting { resume }) => {
            if let Some(relay) = relay {
                relay.command_exiting();
            }
            // The process still has its address space: read its mappings now.
            session.before_exit(pid);
            drop(resume);
        }
        Some(ChildEvent::Exited(code)) => {
            log::info!("the command exited with status {code}");
            return CommandFlow::Exited(ExitCode::from(u8::try_from(code).unwrap_or(1)));
        }
        None => return CommandFlow::Gone,
    }
    CommandFlow::Running
}

/// Creates `--ready-file` if it is still to be made (then forgets it).
fn say_ready_once(ready_file: &mut Option<&std::path::Path>) -> Result<()> {
    match ready_file.take() {
        Some(path) => say_ready(path).with_context(|| format!("--ready-file {}", path.display())),
        None => Ok(()),
    }
}

/// Creates `--ready-file` (whole at once: written beside it, then renamed), holding
/// heapprofd's pid.
fn say_ready(path: &std::path::Path) -> Result<()> {
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = std::path::PathBuf::from(partial);
    std::fs::write(&partial, format!("{}\n", std::process::id()))
        .with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, path).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_dump_slower_than_the_interval_is_followed_by_a_wait_not_a_burst() {
        let interval = Duration::from_millis(200);
        let mut ticks = profile_ticks(interval);
        let start = Instant::now();
        ticks.tick().await;
        assert_eq!(
            start.elapsed(),
            interval,
            "the first profile waits an interval"
        );
        // A dump that took fifty intervals: the tick it overran fires at once...
        tokio::time::advance(interval * 50).await;
        let late = Instant::now();
        ticks.tick().await;
        assert_eq!(late.elapsed(), Duration::ZERO);
        // ...and the next one an interval later, where the loop waits (and the
        // runtime reads its signals), instead of the 49 missed ticks in a row.
        let after = Instant::now();
        ticks.tick().await;
        assert_eq!(after.elapsed(), interval);
    }
}
