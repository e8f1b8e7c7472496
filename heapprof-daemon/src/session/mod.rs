//! Tracing sessions: from attached probes to profiles on disk.
//!
//! `user` profiles the C library's allocator in processes; `kernel` profiles the
//! kernel heap from the kmem tracepoints. Both write the same kind of profile and
//! share what follows: drop reporting, the `--top` summary, and the end of a dump
//! (writing the profile, publishing the metrics, logging what was written).

pub mod kernel;
mod user;

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use anyhow::Result;
use heapprof_common::DropReason;

pub use user::{UserSession, UserSessionConfig};

use crate::{
    health::stats::RunTimeStats,
    metrics::{Exporter, Snapshot},
    pprof::{ProfileBuilder, writer},
};

/// Drop counters summed over CPUs, indexed by [`DropReason`].
pub type Drops = [u64; DropReason::COUNT as usize];

/// Logs the drops that are new since the last report, once each.
#[derive(Debug, Default)]
struct DropLog {
    reported: Drops,
}

impl DropLog {
    fn report(&mut self, drops: &Drops) {
        for reason in DropReason::ALL {
            let (now, before) = (drops[reason as usize], self.reported[reason as usize]);
            if now > before {
                log::warn!(
                    "{} events: {} ({})",
                    now - before,
                    reason.describe(),
                    reason.remedy()
                );
            }
        }
        self.reported = *drops;
    }
}

/// The BPF programs' run-time statistics for the metrics, when they are on.
fn program_figures(
    stats: Option<&RunTimeStats>,
    ebpf: &aya::Ebpf,
) -> Vec<crate::health::stats::ProgramStats> {
    stats.map(|stats| stats.read_all(ebpf)).unwrap_or_default()
}

/// Turns the BPF run-time statistics on for the metrics when `--bpf-stats` has not
/// already. Metrics go on without them on kernels that lack them (before 5.8).
fn enable_stats_for_metrics(stats: &mut Option<RunTimeStats>) {
    if stats.is_none() {
        match RunTimeStats::enable() {
            Ok(enabled) => *stats = Some(enabled),
            Err(err) => log::warn!(
                "metrics: no BPF run time (heapprofd_bpf_run_seconds_total stays empty): {err:#}"
            ),
        }
    }
}

/// Records every drop counter in the profile's comments.
fn comment_drops(builder: &mut ProfileBuilder, drops: &Drops) {
    for reason in DropReason::ALL {
        // With the reason's stable name, by which readers find it (report/losses.rs).
        builder.comment(&crate::report::losses::drop_comment(
            reason,
            drops[reason as usize],
        ));
    }
}

/// When the stages of one dump ended, counted from its start.
struct DumpTimes {
    started: Instant,
    /// The maps read and the sites symbolized.
    read: Duration,
    /// The profile built and compressed.
    built: Duration,
}

/// A built profile, and where and under which number a session writes it.
struct ProfileToWrite<'a> {
    /// The session's `--output` directory.
    output: &'a Path,
    /// The profile's number in the session (the file name's suffix).
    sequence: u32,
    /// The compressed profile.
    profile: &'a [u8],
}

/// The end both sessions' dumps share: writes the profile, publishes the figures to
/// `metrics` (taking the `snapshot` only then), and logs
/// `wrote PATH: SUMMARY; TIMES`, where `summary` says what the profile holds.
///
/// The figures are published even when the write failed (a full disk), so that
/// monitoring goes on; the error is returned after.
fn write_profile(
    to_write: ProfileToWrite<'_>,
    times: DumpTimes,
    metrics: Option<&mut Exporter>,
    snapshot: impl FnOnce() -> Snapshot,
    summary: impl FnOnce() -> String,
) -> Result<PathBuf> {
    let name = writer::profile_file_name(SystemTime::now(), to_write.sequence);
    let result = writer::write_compressed(to_write.output, &name, to_write.profile);
    let written = times.started.elapsed();
    if let Some(exporter) = metrics {
        exporter.publish(snapshot(), result.is_ok().then_some(written));
    }
    let path = result?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    log::info!(
        "wrote {}: {}; {:.1} ms (read+symbolize {:.1}, build+compress {:.1}, write {:.1})",
        path.display(),
        summary(),
        ms(written),
        ms(times.read),
        ms(times.built - times.read),
        ms(written - times.built),
    );
    Ok(path)
}

/// The first `N` columns of `rows` summed, as the logged totals of a profile's sites.
fn column_totals<const N: usize, const M: usize>(
    rows: impl IntoIterator<Item = [u64; M]>,
) -> [u64; N] {
    let mut totals = [0u64; N];
    for row in rows {
        for (total, value) in totals.iter_mut().zip(row) {
            *total += value;
        }
    }
    totals
}

#[cfg(test)]
mod tests {
    use super::column_totals;

    #[test]
    fn column_totals_sum_the_first_columns_only() {
        let totals: [u64; 2] = column_totals([[1, 2, 3], [10, 20, 30]]);
        assert_eq!(totals, [11, 22]);
        let none: [u64; 2] = column_totals(Vec::<[u64; 3]>::new());
        assert_eq!(none, [0, 0]);
    }
}
