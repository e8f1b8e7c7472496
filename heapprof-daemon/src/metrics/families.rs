//! The metric families: names, help and labels, encoded from the published figures
//! on every scrape.
//!
//! A collector rather than prometheus-client's live `Counter`s and `Gauge`s: each
//! profile replaces the whole set of processes (with `--all` those idle in the last
//! interval leave it), and the counters are heapprofd's own cumulative totals, which a
//! live `Counter` could only follow by increments.

use std::{
    fmt,
    sync::{Arc, Mutex},
};

use heapprof_common::DropReason;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
    registry::Unit,
};

use super::{ProcessFigures, Published, TableFigure, lock};
use crate::health::stats::ProgramStats;

/// Encodes the figures last published.
#[derive(Debug)]
pub(super) struct SnapshotCollector {
    state: Arc<Mutex<Published>>,
}

impl SnapshotCollector {
    pub(super) fn new(state: Arc<Mutex<Published>>) -> Self {
        Self { state }
    }
}

/// The labels of a process's series.
fn process_labels(p: &ProcessFigures) -> [(&'static str, ProcessLabel<'_>); 3] {
    [
        ("pid", ProcessLabel::Pid(p.pid)),
        ("comm", ProcessLabel::Text(&p.comm)),
        ("container", ProcessLabel::Text(&p.container)),
    ]
}

/// A process label's value: a number or text.
#[derive(Debug, Clone, Copy)]
enum ProcessLabel<'a> {
    Pid(u32),
    Text(&'a str),
}

impl prometheus_client::encoding::EncodeLabelValue for ProcessLabel<'_> {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder,
    ) -> Result<(), fmt::Error> {
        match self {
            ProcessLabel::Pid(pid) => pid.encode(encoder),
            ProcessLabel::Text(text) => text.encode(encoder),
        }
    }
}

/// The label value of a drop reason, stable across releases (dashboards use it): its
/// stable name, as profile comments and `--stats-json` give it.
const fn reason_label(reason: DropReason) -> &'static str {
    reason.name()
}

/// One family: its descriptor (HELP, TYPE, UNIT), then one sample per label set.
fn family<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    metric_type: MetricType,
    samples: impl IntoIterator<Item = (L, M)>,
) -> Result<(), fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, unit, metric_type)?;
    for (labels, value) in samples {
        value.encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

fn gauges<'a>(
    processes: &'a [ProcessFigures],
    value: impl Fn(&ProcessFigures) -> Option<u64> + 'a,
) -> impl Iterator<Item = ([(&'static str, ProcessLabel<'a>); 3], ConstGauge<u64>)> + 'a {
    processes
        .iter()
        .filter_map(move |p| Some((process_labels(p), ConstGauge::new(value(p)?))))
}

fn counters<'a>(
    processes: &'a [ProcessFigures],
    value: impl Fn(&ProcessFigures) -> u64 + 'a,
) -> impl Iterator<Item = ([(&'static str, ProcessLabel<'a>); 3], ConstCounter<u64>)> + 'a {
    processes
        .iter()
        .map(move |p| (process_labels(p), ConstCounter::new(value(p))))
}

/// The samples of a table family, one per table: `--metrics` exposes entries,
/// capacities and kernel memory alike.
fn table_gauges(
    figures: &[TableFigure],
) -> impl Iterator<Item = ([(&'static str, &'static str); 1], ConstGauge<u64>)> + '_ {
    figures
        .iter()
        .map(|t| ([("table", t.table)], ConstGauge::new(t.value)))
}

impl Collector for SnapshotCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let state = lock(&self.state);
        encode_process_families(&mut encoder, &state.processes)?;
        encode_dropped(&mut encoder, &state)?;
        encode_table_families(&mut encoder, &state)?;
        encode_program_families(&mut encoder, &state.programs)?;
        encode_resident_memory(&mut encoder, state.resident_bytes)
    }
}

/// The per-process families: bytes and blocks in use, allocated, and the exact peak.
fn encode_process_families(
    encoder: &mut DescriptorEncoder,
    processes: &[ProcessFigures],
) -> Result<(), fmt::Error> {
    let bytes = Some(&Unit::Bytes);
    family(
        encoder,
        "inuse",
        "Heap bytes in use per process (allocated while traced and not freed), as in the profile of the same interval",
        bytes,
        MetricType::Gauge,
        gauges(processes, |p| Some(p.inuse_bytes)),
    )?;
    family(
        encoder,
        "inuse_objects",
        "Heap blocks in use per process",
        None,
        MetricType::Gauge,
        gauges(processes, |p| Some(p.inuse_objects)),
    )?;
    family(
        encoder,
        "allocated",
        "Heap bytes allocated per process since tracing began",
        bytes,
        MetricType::Counter,
        counters(processes, |p| p.allocated_bytes),
    )?;
    family(
        encoder,
        "allocated_objects",
        "Heap blocks allocated per process since tracing began",
        None,
        MetricType::Counter,
        counters(processes, |p| p.allocated_objects),
    )?;
    family(
        encoder,
        "peak_inuse",
        "Exact peak of heap bytes in use per process (exact mode without --no-peak only)",
        bytes,
        MetricType::Gauge,
        gauges(processes, |p| p.peak_inuse_bytes),
    )
}

/// The drop counters by reason; without samples until the first profile.
fn encode_dropped(encoder: &mut DescriptorEncoder, state: &Published) -> Result<(), fmt::Error> {
    let drops = state.profiled.then_some(state.drops);
    family(
        encoder,
        "dropped",
        "Events heapprofd could not record fully, by reason (as in the profiles' comments)",
        None,
        MetricType::Counter,
        drops.into_iter().flat_map(|drops| {
            DropReason::ALL.into_iter().map(move |reason| {
                (
                    [("reason", reason_label(reason))],
                    ConstCounter::new(drops[reason as usize]),
                )
            })
        }),
    )
}

/// The families of heapprofd's own tables: entries, capacities, kernel memory.
fn encode_table_families(
    encoder: &mut DescriptorEncoder,
    state: &Published,
) -> Result<(), fmt::Error> {
    family(
        encoder,
        "table_entries",
        "Entries in heapprofd's tables (live_blocks: blocks in use that the live-block table holds)",
        None,
        MetricType::Gauge,
        table_gauges(&state.tables),
    )?;
    family(
        encoder,
        "table_capacity",
        "Capacity of heapprofd's tables (the --max-* flags)",
        None,
        MetricType::Gauge,
        table_gauges(&state.capacities),
    )?;
    family(
        encoder,
        "table_kernel_memory",
        "Kernel memory of heapprofd's tables' BPF maps, allocated at start for their capacities",
        Some(&Unit::Bytes),
        MetricType::Gauge,
        table_gauges(&state.kernel_memory),
    )
}

/// The kernel's BPF statistics of heapprofd's programs: run time and runs.
fn encode_program_families(
    encoder: &mut DescriptorEncoder,
    programs: &[ProgramStats],
) -> Result<(), fmt::Error> {
    family(
        encoder,
        "bpf_run",
        "Time the kernel spent running each of heapprofd's BPF programs (kernel BPF statistics)",
        Some(&Unit::Seconds),
        MetricType::Counter,
        programs.iter().map(|p| {
            (
                [("program", p.name.as_str())],
                ConstCounter::new(p.run_time.as_secs_f64()),
            )
        }),
    )?;
    family(
        encoder,
        "bpf_runs",
        "Runs of each of heapprofd's BPF programs (kernel BPF statistics)",
        None,
        MetricType::Counter,
        programs
            .iter()
            .map(|p| ([("program", p.name.as_str())], ConstCounter::new(p.runs))),
    )
}

/// heapprofd's own resident memory: a descriptor always, a sample once known.
fn encode_resident_memory(
    encoder: &mut DescriptorEncoder,
    resident_bytes: Option<u64>,
) -> Result<(), fmt::Error> {
    // No labels: the one sample is encoded without a label set (not as `{}`).
    let metric = encoder.encode_descriptor(
        "resident_memory",
        "heapprofd's own resident memory (/proc/self/statm) when it last wrote a profile",
        Some(&Unit::Bytes),
        MetricType::Gauge,
    )?;
    if let Some(resident) = resident_bytes {
        ConstGauge::new(resident).encode(metric)?;
    }
    Ok(())
}
