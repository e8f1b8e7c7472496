//! `--metrics`: the Prometheus endpoint, served from the start, with the table
//! capacities and kernel memory both modes report.

use heapprof_common::unwind::UnwindMode;

use crate::{
    cli::{Cli, Target},
    health,
    metrics::{self, TableFigure, server::Endpoint},
};

/// `--metrics`: serves the endpoint from now on (its task runs whenever the event
/// loop waits); returns the exporter the session publishes its profiles to.
pub(super) fn serve_metrics(
    cli: &Cli,
    target: &Target,
    endpoint: Endpoint,
    map_memory: &[health::map_memory::TableMemory],
) -> metrics::Exporter {
    let table = |table, value: u32| TableFigure {
        table,
        value: value.into(),
    };
    let mut capacities = vec![
        table("live_blocks", cli.live_blocks()),
        table("sites", cli.max_sites),
        table("stacks", cli.max_stacks),
    ];
    if !cli.kernel && cli.unwind.mode() != UnwindMode::FramePointers {
        capacities.extend([
            table("unwind_rows", cli.max_unwind_rows),
            table("unwind_rules", cli.max_unwind_rules),
            table("unwind_objects", cli.max_unwind_objects),
        ]);
    }
    let (exporter, registry) = metrics::new(metrics::Settings {
        active_only: !cli.kernel && *target == Target::All,
        top: cli.metrics_top,
        capacities,
        kernel_memory: map_memory
            .iter()
            .map(|t| TableFigure {
                table: t.table,
                value: t.bytes,
            })
            .collect(),
        push: (!cli.push.is_empty()).then(|| crate::push::PushMetrics::shared().clone()),
    });
    match endpoint.local_addr() {
        Ok(addr) => log::info!("metrics at http://{addr}/metrics"),
        Err(err) => log::warn!("metrics: cannot tell the address served: {err}"),
    }
    endpoint.spawn(registry);
    exporter
}
