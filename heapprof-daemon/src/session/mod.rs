//! Tracing sessions: from attached probes to profiles on disk.
//!
//! `user` profiles the C library's allocator in processes; `kernel` profiles the
//! kernel heap from the kmem tracepoints. Both write the same kind of profile and
//! share what follows: drop reporting and the `--top` summary.

pub mod kernel;
mod user;

use std::collections::HashMap;

use heapprof_common::DropReason;

pub use user::{Session, SessionConfig};

use crate::{pprof::ProfileBuilder, probes::stats::RunTimeStats};

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
) -> Vec<crate::probes::stats::ProgramStats> {
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
        builder.comment(&format!(
            "dropped: {} = {}",
            reason.describe(),
            drops[reason as usize]
        ));
    }
}

/// One line of the `--top` summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopSite {
    /// `function (file:line) <- caller <- caller`.
    pub description: String,
    /// Bytes in use.
    pub inuse_bytes: u64,
    /// Blocks in use.
    pub inuse_objects: u64,
    /// Bytes allocated in total.
    pub alloc_bytes: u64,
    /// Blocks allocated in total.
    pub alloc_objects: u64,
}

/// Sites merged by description, for the `--top` summary.
#[derive(Debug, Default)]
struct TopSites(HashMap<String, TopSite>);

impl TopSites {
    /// Adds one site's allocated objects and bytes, in-use objects and bytes.
    fn add(
        &mut self,
        description: String,
        [alloc_objects, alloc_bytes, inuse_objects, inuse_bytes]: [u64; 4],
    ) {
        let entry = self.0.entry(description.clone()).or_insert(TopSite {
            description,
            inuse_bytes: 0,
            inuse_objects: 0,
            alloc_bytes: 0,
            alloc_objects: 0,
        });
        entry.inuse_bytes += inuse_bytes;
        entry.inuse_objects += inuse_objects;
        entry.alloc_bytes += alloc_bytes;
        entry.alloc_objects += alloc_objects;
    }

    /// The `limit` sites holding the most memory, then allocating the most.
    fn top(self, limit: usize) -> Vec<TopSite> {
        let mut top: Vec<TopSite> = self.0.into_values().collect();
        top.sort_by(|a, b| {
            (b.inuse_bytes, b.alloc_bytes, &a.description).cmp(&(
                a.inuse_bytes,
                a.alloc_bytes,
                &b.description,
            ))
        });
        top.truncate(limit);
        top
    }
}
