//! The figures a user-mode profile exports as metrics (`--metrics`).

use std::collections::BTreeMap;

use super::{UserSession, images::Image};
use crate::{
    aggregate::Site,
    metrics::{ProcessFigures, Snapshot, TableFigure},
    session::{Drops, program_figures},
};

impl UserSession {
    /// The metrics of the profile built from `sites` and `drops`: per process the
    /// sums of its samples' values, exactly as the profile holds them.
    pub(super) fn metrics_snapshot(&self, sites: &[Site], drops: &Drops) -> Snapshot {
        let rate = self.config.sample_rate;
        // (figures, exec generation the labels come from) per process.
        let mut by_pid: BTreeMap<u32, (ProcessFigures, Option<u32>)> = BTreeMap::new();
        for site in sites {
            let image = Image::of(&site.key);
            let (figures, labelled) = by_pid.entry(image.pid).or_insert_with(|| {
                (
                    ProcessFigures {
                        pid: image.pid,
                        peak_inuse_bytes: self
                            .memory
                            .get(image.pid)
                            .and_then(|memory| memory.peak_inuse),
                        ..ProcessFigures::default()
                    },
                    None,
                )
            });
            let [alloc_objects, alloc_bytes, inuse_objects, inuse_bytes, ..] = site.values(rate);
            figures.allocated_objects += alloc_objects;
            figures.allocated_bytes += alloc_bytes;
            figures.inuse_objects += inuse_objects;
            figures.inuse_bytes += inuse_bytes;
            figures.activity += site.counters.alloc_objects + site.counters.free_objects;
            // The name and container of the process's newest image (an exec renames it).
            if labelled.is_none_or(|generation| image.exec_gen > generation)
                && let Some(info) = self.images.get(&image)
            {
                figures.comm.clone_from(&info.comm);
                figures.container = info
                    .cgroup
                    .as_ref()
                    .and_then(|cgroup| cgroup.container.clone())
                    .unwrap_or_default();
                *labelled = Some(image.exec_gen);
            }
        }
        let occupancy = self.maps.occupancy(sites);
        let mut tables = TableFigure::of_occupancy(&occupancy);
        if let Some(unwinder) = self.images.unwinder() {
            let usage = unwinder.usage();
            tables.extend([
                TableFigure {
                    table: "unwind_rows",
                    value: usage.rows.into(),
                },
                TableFigure {
                    table: "unwind_rules",
                    value: usage.rules.into(),
                },
                TableFigure {
                    table: "unwind_objects",
                    value: usage.objects.into(),
                },
            ]);
        }
        Snapshot {
            processes: by_pid.into_values().map(|(figures, _)| figures).collect(),
            drops: *drops,
            tables,
            programs: program_figures(self.run_time_stats.as_ref(), &self.ebpf),
        }
    }
}
