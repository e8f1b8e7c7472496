//! Tracing sessions: from attached probes to profiles on disk.
//!
//! `user` profiles the C library's allocator in processes; `kernel` profiles the
//! kernel heap from the kmem tracepoints. Both write the same kind of profile and
//! share what follows: drop reporting and the `--top` summary.

pub mod kernel;
mod user;

use heapprof_common::DropReason;

pub use user::{UserSession, UserSessionConfig};

use crate::{health::stats::RunTimeStats, pprof::ProfileBuilder};

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
