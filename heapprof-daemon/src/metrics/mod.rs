//! Prometheus metrics (`--metrics ADDR`): per-process heap figures and heapprofd's
//! own, served at `/metrics` in the OpenMetrics text format (which Prometheus reads).
//!
//! The session hands a [`Snapshot`] to its [`Exporter`] each time it writes a profile,
//! built from the very figures the profile was built from, so a scrape between two
//! profiles returns what the last profile holds. `families` encodes the snapshot with
//! prometheus-client at scrape time, `select` bounds how many processes are exported,
//! `server` is the HTTP endpoint.

mod families;
mod select;
pub mod server;

use std::{
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use heapprof_common::DropReason;
use prometheus_client::{
    metrics::histogram::{Histogram, exponential_buckets},
    registry::{Registry, Unit},
};

use self::{families::SnapshotCollector, select::Selection};
use crate::health::stats::ProgramStats;

/// Prefix of every metric name.
const PREFIX: &str = "heapprofd";

/// One process's heap figures, as the profile of the same interval gives them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessFigures {
    /// Process id (`0` stands for the kernel in kernel mode).
    pub pid: u32,
    /// Command name (`kernel` in kernel mode).
    pub comm: String,
    /// Container id from the process's cgroup; empty when none is known.
    pub container: String,
    /// Bytes in use (the sum of the profile's `inuse_space` for this process).
    pub inuse_bytes: u64,
    /// Blocks in use (`inuse_objects`).
    pub inuse_objects: u64,
    /// Bytes allocated since tracing began (`alloc_space`).
    pub allocated_bytes: u64,
    /// Blocks allocated since tracing began (`alloc_objects`).
    pub allocated_objects: u64,
    /// The exact in-use peak, when it is kept (exact user mode, without `--no-peak`).
    pub peak_inuse_bytes: Option<u64>,
    /// Changes whenever the process allocates or frees (blocks counted as allocated
    /// plus freed): with `--all`, a process whose activity did not change since the
    /// last profile is not exported.
    pub activity: u64,
}

/// How full one of heapprofd's tables is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableFigure {
    /// The table's label value (`live_blocks`, `sites`, `stacks`, `unwind_rows`, ...).
    pub table: &'static str,
    /// Entries in it.
    pub value: u64,
}

impl TableFigure {
    /// The figures of the tables every session has, from their occupancy.
    pub fn of_occupancy(occupancy: &crate::aggregate::Occupancy) -> Vec<TableFigure> {
        vec![
            TableFigure {
                table: "live_blocks",
                value: occupancy.live_blocks,
            },
            TableFigure {
                table: "sites",
                value: occupancy.sites,
            },
            TableFigure {
                table: "stacks",
                value: occupancy.stacks,
            },
        ]
    }
}

/// Everything a profile interval exports, taken when the profile is written.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Every process with counts in the profile; [`Exporter::publish`] selects the
    /// exported ones.
    pub processes: Vec<ProcessFigures>,
    /// The drop counters the profile's comments record, indexed by [`DropReason`].
    pub drops: [u64; DropReason::COUNT as usize],
    /// Entries of the tables whose occupancy is known.
    pub tables: Vec<TableFigure>,
    /// The BPF programs' run-time statistics (empty when they could not be enabled).
    pub programs: Vec<ProgramStats>,
}

/// What the metrics export, fixed for the whole run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `--all` in user mode: export only the processes seen allocating or freeing
    /// since the last profile.
    pub active_only: bool,
    /// Most processes exported (`--metrics-top`), those with the most bytes in use.
    pub top: usize,
    /// Capacity of each table (`--max-*` flags).
    pub capacities: Vec<TableFigure>,
    /// Kernel memory of each table's BPF maps, in bytes (see
    /// `health::map_memory`), most of it allocated at start for the capacities.
    pub kernel_memory: Vec<TableFigure>,
    /// `--push`: the push's counters, served with the rest.
    pub push: Option<crate::push::PushMetrics>,
}

/// The figures last published, which every scrape encodes.
#[derive(Debug, Default)]
struct Published {
    /// False until the first profile: until then only capacities are known.
    profiled: bool,
    processes: Vec<ProcessFigures>,
    drops: [u64; DropReason::COUNT as usize],
    tables: Vec<TableFigure>,
    capacities: Vec<TableFigure>,
    kernel_memory: Vec<TableFigure>,
    programs: Vec<ProgramStats>,
    resident_bytes: Option<u64>,
}

/// Locks the published figures. A panic while they were held leaves them whole
/// (every update replaces fields), so a poisoned lock is used as it is.
fn lock(state: &Mutex<Published>) -> MutexGuard<'_, Published> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The session's side: publishes each interval's snapshot for the scrapes.
#[derive(Debug)]
pub struct Exporter {
    state: Arc<Mutex<Published>>,
    write_seconds: Histogram,
    selection: Selection,
}

/// A new exporter and the registry that the HTTP endpoint encodes.
pub fn new(settings: Settings) -> (Exporter, Arc<Registry>) {
    let state = Arc::new(Mutex::new(Published {
        capacities: settings.capacities.clone(),
        kernel_memory: settings.kernel_memory.clone(),
        ..Published::default()
    }));
    // 1 ms to ~16 s: a profile of a small process takes milliseconds, one of
    // thousands of processes with cold symbol caches seconds.
    let write_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 15));
    let mut registry = Registry::with_prefix(PREFIX);
    registry.register_with_unit(
        "profile_write",
        "Time to write one profile: reading the BPF maps, symbolizing, building, encoding and writing the file",
        Unit::Seconds,
        write_seconds.clone(),
    );
    registry.register_collector(Box::new(SnapshotCollector::new(Arc::clone(&state))));
    if let Some(push) = &settings.push {
        push.register(&mut registry);
    }
    let exporter = Exporter {
        state,
        write_seconds,
        selection: Selection::new(settings.active_only, settings.top),
    };
    (exporter, Arc::new(registry))
}

impl Exporter {
    /// Publishes the figures of the profile just written (`write_time` is how long it
    /// took; `None` when the write failed, whose figures are published all the same).
    pub fn publish(&mut self, snapshot: Snapshot, write_time: Option<Duration>) {
        if let Some(time) = write_time {
            self.write_seconds.observe(time.as_secs_f64());
        }
        let processes = self.selection.select(snapshot.processes);
        let resident_bytes = own_resident_bytes();
        let mut state = lock(&self.state);
        state.profiled = true;
        state.processes = processes;
        state.drops = snapshot.drops;
        state.tables = snapshot.tables;
        state.programs = snapshot.programs;
        state.resident_bytes = resident_bytes;
    }
}

/// heapprofd's own resident memory: the second field of `/proc/self/statm`, in pages.
fn own_resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page_size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page_size).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).expect("encoding");
        text
    }

    fn process(pid: u32, inuse_bytes: u64) -> ProcessFigures {
        ProcessFigures {
            pid,
            comm: format!("p{pid}"),
            inuse_bytes,
            inuse_objects: 2,
            allocated_bytes: 3 * inuse_bytes,
            allocated_objects: 6,
            activity: 8,
            ..ProcessFigures::default()
        }
    }

    #[test]
    fn every_family_is_described_before_the_first_profile() {
        let push = crate::push::PushMetrics::default();
        // A family is described once it has a series: the push's have one per target.
        push.target("http://pyroscope:4040/ingest").sent.inc();
        let (_exporter, registry) = new(Settings {
            active_only: false,
            top: 10,
            capacities: vec![TableFigure {
                table: "sites",
                value: 65536,
            }],
            kernel_memory: vec![TableFigure {
                table: "live_blocks",
                value: 45 << 20,
            }],
            push: Some(push),
        });
        let text = scrape(&registry);
        for (family, kind) in [
            ("heapprofd_inuse_bytes", "gauge"),
            ("heapprofd_inuse_objects", "gauge"),
            ("heapprofd_allocated_bytes", "counter"),
            ("heapprofd_allocated_objects", "counter"),
            ("heapprofd_peak_inuse_bytes", "gauge"),
            ("heapprofd_dropped", "counter"),
            ("heapprofd_table_entries", "gauge"),
            ("heapprofd_table_capacity", "gauge"),
            ("heapprofd_table_kernel_memory_bytes", "gauge"),
            ("heapprofd_bpf_run_seconds", "counter"),
            ("heapprofd_bpf_runs", "counter"),
            ("heapprofd_profile_write_seconds", "histogram"),
            ("heapprofd_resident_memory_bytes", "gauge"),
            ("heapprofd_push_sent", "counter"),
            ("heapprofd_push_dropped", "counter"),
            ("heapprofd_push_spool_bytes", "gauge"),
        ] {
            assert!(
                text.contains(&format!("# TYPE {family} {kind}\n"))
                    && text.contains(&format!("# HELP {family} ")),
                "{family} not described:\n{text}"
            );
        }
        assert!(text.contains("heapprofd_table_capacity{table=\"sites\"} 65536\n"));
        assert!(
            text.contains("heapprofd_table_kernel_memory_bytes{table=\"live_blocks\"} 47185920\n")
        );
        assert!(!text.contains("heapprofd_dropped_total{"), "{text}");
        assert!(
            text.contains("heapprofd_push_sent_total{target=\"http://pyroscope:4040/ingest\"} 1\n"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn a_published_snapshot_is_what_a_scrape_returns() {
        let (mut exporter, registry) = new(Settings {
            active_only: false,
            top: 10,
            capacities: Vec::new(),
            kernel_memory: Vec::new(),
            push: None,
        });
        let mut drops = [0; DropReason::COUNT as usize];
        drops[DropReason::StackTableFull as usize] = 7;
        let mut with_peak = process(42, 1000);
        with_peak.peak_inuse_bytes = Some(4096);
        with_peak.container = "abc\"def".into();
        exporter.publish(
            Snapshot {
                processes: vec![with_peak, process(43, 10)],
                drops,
                tables: vec![TableFigure {
                    table: "live_blocks",
                    value: 5,
                }],
                programs: vec![ProgramStats {
                    name: "malloc_entry".into(),
                    runs: 10,
                    run_time: Duration::from_millis(1500),
                }],
            },
            Some(Duration::from_millis(3)),
        );
        let text = scrape(&registry);
        for line in [
            "heapprofd_inuse_bytes{pid=\"42\",comm=\"p42\",container=\"abc\\\"def\"} 1000\n",
            "heapprofd_inuse_bytes{pid=\"43\",comm=\"p43\",container=\"\"} 10\n",
            "heapprofd_allocated_bytes_total{pid=\"43\",comm=\"p43\",container=\"\"} 30\n",
            "heapprofd_allocated_objects_total{pid=\"43\",comm=\"p43\",container=\"\"} 6\n",
            "heapprofd_inuse_objects{pid=\"43\",comm=\"p43\",container=\"\"} 2\n",
            "heapprofd_peak_inuse_bytes{pid=\"42\",comm=\"p42\",container=\"abc\\\"def\"} 4096\n",
            "heapprofd_dropped_total{reason=\"stack_table_full\"} 7\n",
            "heapprofd_dropped_total{reason=\"live_table_full\"} 0\n",
            "heapprofd_table_entries{table=\"live_blocks\"} 5\n",
            "heapprofd_bpf_run_seconds_total{program=\"malloc_entry\"} 1.5\n",
            "heapprofd_bpf_runs_total{program=\"malloc_entry\"} 10\n",
            "heapprofd_profile_write_seconds_count 1\n",
        ] {
            assert!(text.contains(line), "no {line:?} in:\n{text}");
        }
        // The process without a peak has no peak sample.
        assert!(!text.contains("heapprofd_peak_inuse_bytes{pid=\"43\""));
        assert_eq!(
            text.matches("heapprofd_dropped_total{").count(),
            DropReason::COUNT as usize
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with("heapprofd_resident_memory_bytes ")),
            "{text}"
        );
    }
}
