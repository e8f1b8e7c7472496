//! The end of a session: the system-wide preload taken down, the final profile, its
//! top sites, `--stats-json`, and the last pushes.

use std::{io::Write as _, path::Path};

use anyhow::{Context as _, Result};

use super::{AnySession, outputs::Outputs};
use crate::{
    cli::{Cli, Target},
    health::bpf_log::BpfLog,
    memory_peaks,
    stats_file::{self, StartFigures},
    system_preload::SystemPreload,
};

/// What the loop leaves for the end of the session.
pub(super) struct Ending {
    pub(super) session: AnySession,
    pub(super) system: Option<SystemPreload>,
    pub(super) bpf_log: Option<BpfLog>,
    pub(super) figures: StartFigures,
    pub(super) outputs: Outputs,
}

/// Ends the session: writes the final profile (whose failure is the run's error),
/// then `--stats-json`, then lets the pushes go out.
pub(super) async fn finish(cli: &Cli, target: &Target, ending: Ending) -> Result<()> {
    let Ending {
        mut session,
        system,
        mut bpf_log,
        figures,
        mut outputs,
    } = ending;
    if let Some(system) = system {
        take_down_system_preload(system, &mut session).await;
    }
    // The programs' last lines before the final profile's drop report.
    if let Some(log) = bpf_log.as_mut() {
        log.flush();
    }
    let written = {
        let _turn = memory_peaks::one_at_a_time();
        session.dump()
    };
    outputs.final_profile(&written);
    if cli.top > 0
        && let Ok(written) = &written
        && let Err(err) = print_top(&written.path, cli.top)
    {
        log::warn!("cannot summarize the sites: {err:#}");
    }
    // Read while the session keeps the kernel's statistics on.
    let measured = Measured {
        bpf_run_time: cli
            .bpf_stats
            .then(|| stats_file::BpfRunTime::read(&figures.programs)),
        unwind: session.unwind_figures(),
        system_preload: cli
            .system_preload(target)
            .then(|| session.system_figures())
            .flatten(),
        failed_writes: outputs.failed_writes(),
        left: session.leave_joined(),
    };
    drop(session); // detaches every probe
    let written = written.context("writing the final profile");
    // Read back before the push: with --push alone, handing it over deletes it.
    let stats = match (&written, &cli.stats_json) {
        (Ok(written), Some(_)) => Some(run_stats(&written.path, figures, measured)),
        _ => None,
    };
    // Last, the pushes still waiting get the push timeout to go out.
    let push_figures = outputs.finish_push(cli, &written);
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
    stats
}

/// New programs no longer load the library (those joined leave by themselves once
/// heapprofd's pidfd says it has exited); the joins sent meanwhile are counted.
async fn take_down_system_preload(mut system: SystemPreload, session: &mut AnySession) {
    let removed = system.remove_entry();
    for event in system.drain().await {
        session.system_event(&system, event);
    }
    if let Err(err) = removed.and(system.remove()) {
        log::error!("{err:#}");
    }
}

/// Prints the `limit` sites holding the most in the final profile at `path`, read back
/// from the file, so the table and the profile cannot disagree.
fn print_top(path: &Path, limit: usize) -> Result<()> {
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

/// What the session measured at its end, for `--stats-json`.
struct Measured {
    bpf_run_time: Option<stats_file::BpfRunTime>,
    /// The stack lookups (with `--bpf-stats`) and the unwind tables.
    unwind: (
        Option<stats_file::Lookups>,
        Option<crate::unwind::table_upload::TableUsage>,
    ),
    system_preload: Option<stats_file::SystemPreloadFigures>,
    failed_writes: u64,
    left: Option<stats_file::Leaving>,
}

/// What `--stats-json` says but the push: the final profile at `profile`, read back,
/// and the rest.
fn run_stats(
    profile: &Path,
    figures: StartFigures,
    measured: Measured,
) -> Result<stats_file::RunStats> {
    let (totals, comments) = stats_file::ProfileTotals::read(profile)?;
    let (stack_lookups, unwind_tables) = measured.unwind;
    let stats = stats_file::RunStats {
        final_profile: totals,
        dropped: stats_file::dropped(&comments),
        joined: figures.joining,
        left: measured.left,
        kernel_memory: stats_file::KernelMemory::of(&figures.kernel_memory),
        single_stepped_probes: crate::allocators::registry::single_stepped_probes(),
        session_links: crate::allocators::registry::session_links(),
        bpf_run_time: measured.bpf_run_time,
        stack_lookups,
        unwind_tables,
        system_preload: measured.system_preload,
        failed_profile_writes: measured.failed_writes,
        push: Vec::new(),
    };
    Ok(stats)
}
