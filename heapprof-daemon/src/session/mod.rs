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
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Result;
use heapprof_common::DropReason;
use serde::{Deserialize, Serialize};

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

/// A time as nanoseconds since the epoch (0 before it), as profiles give times.
fn epoch_nanos(time: SystemTime) -> i64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
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

/// What a written profile holds, as its session counts it: the `wrote` line's words
/// and, for programs, the same figures as numbers (`--profiles-json`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Contents {
    /// Its sites (one sample each, with its labels).
    pub sites: usize,
    /// Objects (blocks) allocated since tracing began (estimates when sampled).
    pub allocated_blocks: u64,
    /// Bytes allocated.
    pub allocated_bytes: u64,
    /// Objects in use now.
    pub inuse_blocks: u64,
    /// Bytes in use now.
    pub inuse_bytes: u64,
    /// How the log words it (`N sites, A blocks / B bytes allocated, ...`).
    pub words: String,
}

/// The mappings of a process's new image, read after an exec (what an `image_read`
/// line of `--profiles-json` says).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRead {
    /// The process.
    pub pid: u32,
    /// Which image: the process's execs seen since tracing began (the first image
    /// traced is 0).
    pub exec_generation: u32,
    /// Whether a probed allocator is mapped in it. `false` on a read that is tried
    /// again later (the loader may not have mapped the allocator yet), and on the
    /// last read of an image that has none.
    pub probed_allocator: bool,
}

/// A profile a dump wrote: where, when, what it holds and how long each stage took.
#[derive(Debug, Clone)]
pub struct Written {
    /// The file.
    pub path: PathBuf,
    /// When the file was in place.
    pub at: SystemTime,
    /// What it holds.
    pub contents: Contents,
    /// The whole dump, from its start to the file in place.
    pub total: Duration,
    /// Reading the maps and symbolizing.
    pub read: Duration,
    /// Building and compressing the profile.
    pub build: Duration,
    /// Writing the file.
    pub write: Duration,
}

impl Written {
    /// The dump's times as the log gives them: `X ms (read+symbolize A, build+compress
    /// B, write C)`.
    pub fn describe_times(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        format!(
            "{:.1} ms (read+symbolize {:.1}, build+compress {:.1}, write {:.1})",
            ms(self.total),
            ms(self.read),
            ms(self.build),
            ms(self.write),
        )
    }
}

/// The end both sessions' dumps share: writes the profile, publishes the figures to
/// `metrics` (taking the `snapshot` only then), and logs
/// `wrote PATH: CONTENTS; TIMES`, where `contents` says what the profile holds.
///
/// The figures are published even when the write failed (a full disk), so that
/// monitoring goes on; the error is returned after.
fn write_profile(
    to_write: ProfileToWrite<'_>,
    times: DumpTimes,
    metrics: Option<&mut Exporter>,
    snapshot: impl FnOnce() -> Snapshot,
    contents: impl FnOnce() -> Contents,
) -> Result<Written> {
    let name = writer::profile_file_name(SystemTime::now(), to_write.sequence);
    let result = writer::write_compressed(to_write.output, &name, to_write.profile);
    let total = times.started.elapsed();
    let at = SystemTime::now();
    if let Some(exporter) = metrics {
        exporter.publish(snapshot(), result.is_ok().then_some(total));
    }
    let written = Written {
        path: result?,
        at,
        contents: contents(),
        total,
        read: times.read,
        build: times.built.saturating_sub(times.read),
        write: total.saturating_sub(times.built),
    };
    log::info!(
        "wrote {}: {}; {}",
        written.path.display(),
        written.contents.words,
        written.describe_times(),
    );
    Ok(written)
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
