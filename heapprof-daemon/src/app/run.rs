//! The event loop of a running session.

use std::{io::Write as _, process::ExitCode, time::Duration};

use anyhow::{Context as _, Result};
use aya::maps::{MapData, RingBuf};
use heapprof_common::{ExecEvent, unwind::MappingsRequest};
use tokio::{
    io::unix::AsyncFd,
    time::{Instant, Interval, MissedTickBehavior},
};

use super::Started;
use crate::{
    cli::{Cli, Target},
    launch::{ChildEvent, PausedChild, Relayed, SignalRelay},
    memory_peaks,
    pprof::retention::Pruner,
    profiles_file::{Kind, ProfilesFile},
    push::{PushConfig, PushMetrics, Pusher},
    stats_file::{self, StartFigures},
};

/// Prints the `limit` sites holding the most in the final profile at `path`, read back
/// from the file, so the table and the profile cannot disagree.
fn print_top(path: &std::path::Path, limit: usize) -> Result<()> {
    let profile = crate::report::model::Profile::load(path)?;
    let index = profile.sample_index("inuse_space")?;
    let mut out = std::io::stdout().lock();
    writeln!(out)?;
    crate::report::top::write(
        &mut out,
        &profile,
        index,
        limit,
        crate::report::stacks::ProcessFilter::All,
        crate::report::stacks::Grouping::Site,
    )?;
    Ok(())
}

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
    let mut records = Vec::new();
    while let Some(item) = guard.get_inner_mut().next() {
        if item.len() >= std::mem::size_of::<T>() {
            // SAFETY: the BPF side writes whole records of plain integers; read unaligned.
            records.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<T>()) });
        }
    }
    guard.clear_ready();
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
        mut session,
        child,
        target_exit,
        mut sigint,
        mut sigterm,
        mut bpf_log,
        figures,
        mut system,
    } = started;
    // Before the ready file: a reader that waits for that finds this one made.
    let mut profiles_file = match &cli.profiles_json {
        Some(path) => Some(ProfilesFile::create(path).context("--profiles-json")?),
        None => None,
    };
    let mut pusher = match push {
        Some(config) => {
            log::info!("pushing profiles to {}", config.describe());
            Some(Pusher::start(
                config,
                PushMetrics::shared(),
                cli.push_only(),
            )?)
        }
        None => None,
    };
    // Ready once every process is served: with the system-wide preload, once those
    // running before heapprofd have been asked to join.
    let mut ready_file = cli.ready_file.as_deref();
    if !system
        .as_ref()
        .is_some_and(crate::system_preload::SystemPreload::asks_running)
    {
        say_ready_once(&mut ready_file)?;
    }
    let child_pid = child.as_ref().map(|c| c.pid);
    let mut child_events = child.map(PausedChild::release);
    let mut ticks = profile_ticks(cli.interval);
    let deadline = cli.duration.map(|d| Instant::now() + d);
    let far_future = Instant::now() + Duration::from_secs(100 * 365 * 86400);
    let mut exit_code = ExitCode::SUCCESS;
    let mut relay = child_pid.map(SignalRelay::new);
    let mut exec_events = session.take_exec_events();
    let mut mapping_requests = session.take_mapping_requests();
    let mut pruner = Pruner::new(&cli.output_dir(), cli.retention());
    // Interval profiles not written (the final one's failure ends the run).
    let mut failed_writes = 0u64;

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
                let read = session.read_due_images();
                if let Some(file) = profiles_file.as_mut() {
                    for image in read {
                        file.append_image_read(image);
                    }
                }
            }
            () = async { match bpf_log.as_mut() { Some(log) => log.forward().await, None => std::future::pending().await } } => {}
            _ = ticks.tick() => {
                // The dump and the tidying after it (retiring exited processes reads
                // the live table) are one heavy job: a push's build waits for both.
                let _turn = memory_peaks::one_at_a_time();
                if let Some(log) = bpf_log.as_mut() {
                    log.flush();
                }
                match session.dump() {
                    Ok(written) => {
                        if let Some(file) = profiles_file.as_mut() {
                            file.append(&written, Kind::Interval);
                        }
                        if let Some(pusher) = pusher.as_mut() {
                            pusher.offer(&written.path);
                        }
                        pruner.after_write(&written.path);
                    }
                    Err(err) => {
                        log::error!("cannot write a profile: {err:#}");
                        failed_writes += 1;
                        if let Some(file) = profiles_file.as_mut() {
                            file.append_failure(&err);
                        }
                    }
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
                    Some(ChildEvent::Exec { resume }) => {
                        if let Some(pid) = child_pid {
                            session.exec_hold(pid);
                        }
                        drop(resume);
                    }
                    Some(ChildEvent::KernelSigcont { resume }) => {
                        let hold = child_pid.is_some_and(|pid| session.loader_hold(pid));
                        let _ = resume.send(hold);
                    }
                    Some(ChildEvent::Exiting { resume }) => {
                        if let Some(relay) = relay.as_mut() {
                            relay.command_exiting();
                        }
                        // The process still has its address space: read its mappings now.
                        session.before_exit(child_pid);
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
    // New programs no longer load the library (those joined leave by themselves once
    // heapprofd's pidfd says it has exited); the joins sent meanwhile are counted.
    if let Some(mut system) = system.take() {
        let removed = system.remove_entry();
        for event in system.drain().await {
            session.system_event(&system, event);
        }
        if let Err(err) = removed.and(system.remove()) {
            log::error!("{err:#}");
        }
    }
    // The programs' last lines before the final profile's drop report.
    if let Some(log) = bpf_log.as_mut() {
        log.flush();
    }
    let written = {
        let _turn = memory_peaks::one_at_a_time();
        session.dump()
    };
    if let Ok(written) = &written {
        if let Some(file) = profiles_file.as_mut() {
            file.append(written, Kind::Final);
        }
        pruner.after_write(&written.path);
    }
    if cli.top > 0
        && let Ok(written) = &written
        && let Err(err) = print_top(&written.path, cli.top)
    {
        log::warn!("cannot summarize the sites: {err:#}");
    }
    // Read while the session keeps the kernel's statistics on.
    let bpf_run_time = cli
        .bpf_stats
        .then(|| stats_file::BpfRunTime::read(&figures.programs));
    let (stack_lookups, unwind_tables) = session.unwind_figures();
    let system_preload = cli
        .system_preload(target)
        .then(|| session.system_figures())
        .flatten();
    let left = session.leave_joined();
    drop(session); // detaches every probe
    let written = written.context("writing the final profile");
    // Read back before the push: with --push alone, handing it over deletes it.
    let stats = match (&written, &cli.stats_json) {
        (Ok(written), Some(_)) => {
            let measured = Measured {
                bpf_run_time,
                stack_lookups,
                unwind_tables,
                system_preload,
                failed_writes,
                left,
            };
            Some(run_stats(&written.path, figures, measured))
        }
        _ => None,
    };
    // Last, the pushes still waiting get the push timeout to go out.
    let mut push_figures = Vec::new();
    if let Some(mut pusher) = pusher {
        if let Ok(written) = &written {
            pusher.offer(&written.path);
        }
        push_figures = pusher.finish();
        if cli.push_only() {
            let _ = std::fs::remove_dir(cli.output_dir());
        }
    }
    let stats = match (stats, &cli.stats_json) {
        (Some(stats), Some(path)) => stats
            .and_then(|mut stats| {
                stats.push = push_figures;
                stats_file::write(path, &stats)
            })
            .with_context(|| format!("--stats-json {}", path.display())),
        _ => Ok(()),
    };
    written?;
    stats?;
    Ok(exit_code)
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

/// What the session measured at its end, for `--stats-json`.
struct Measured {
    bpf_run_time: Option<stats_file::BpfRunTime>,
    stack_lookups: Option<stats_file::Lookups>,
    unwind_tables: Option<crate::unwind::table_upload::TableUsage>,
    system_preload: Option<stats_file::SystemPreloadFigures>,
    failed_writes: u64,
    left: Option<stats_file::Leaving>,
}

/// What `--stats-json` says but the push: the final profile at `profile`, read back,
/// and the rest.
fn run_stats(
    profile: &std::path::Path,
    figures: StartFigures,
    measured: Measured,
) -> Result<stats_file::RunStats> {
    let (totals, comments) = stats_file::ProfileTotals::read(profile)?;
    let stats = stats_file::RunStats {
        final_profile: totals,
        dropped: stats_file::dropped(&comments),
        joined: figures.joining,
        left: measured.left,
        kernel_memory: stats_file::KernelMemory::of(&figures.kernel_memory),
        single_stepped_probes: crate::allocators::registry::single_stepped_probes(),
        session_links: crate::allocators::registry::session_links(),
        bpf_run_time: measured.bpf_run_time,
        stack_lookups: measured.stack_lookups,
        unwind_tables: measured.unwind_tables,
        system_preload: measured.system_preload,
        failed_profile_writes: measured.failed_writes,
        push: Vec::new(),
    };
    Ok(stats)
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
