//! The page's charts: the in-use timeline (the top sites or processes stacked, the
//! peak marked), and RSS or, for a kernel session, the slab beside the in-use bytes;
//! with the peak they mark and their legends.

use std::fmt::Write as _;

use super::LAYOUT;
use crate::report::{
    chart::{Chart, Marker, Series, Unit},
    session::{self, Session},
    suspects,
    timeline::{self, memory_sum},
    units::escape_html,
};

/// Bands stacked on the in-use chart; the rest is one "other" band.
const MAX_BANDS: usize = 8;

/// Colours of the bands, saturated enough to tell apart (and to find in a screenshot).
const PALETTE: [&str; MAX_BANDS] = [
    "#e4572e", "#2e86ab", "#f3a712", "#4caf50", "#9c27b0", "#00897b", "#d81b60", "#3f51b5",
];
/// The colour of the "other" band.
const OTHER_COLOR: &str = "#c9b98f";

/// The peak to report: its value, when, and how it was found.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Peak {
    pub(super) value: f64,
    pub(super) seconds: f64,
    /// Seconds of the profile before it (the peak happened in between), if any.
    pub(super) after: Option<f64>,
    pub(super) exact: bool,
}

/// heapprofd's exact peak (one process, in bytes) when the last profile recorded it;
/// else the largest total among the profiles.
pub(super) fn peak(session: &Session, single: Option<u32>) -> Option<Peak> {
    let snapshots = &session.snapshots;
    if let Some(pid) = single
        && session.tracked == "inuse_space"
    {
        let recorded = |i: usize| {
            snapshots[i]
                .processes
                .get(&pid)
                .and_then(|p| p.memory.as_ref())
                .and_then(|m| m.peak_inuse)
        };
        let last = (0..snapshots.len()).rev().find_map(recorded);
        if let Some(value) = last {
            // The first profile whose recorded peak reached it: it happened in the
            // interval before.
            let index = (0..snapshots.len())
                .find(|&i| recorded(i).is_some_and(|p| p >= value))
                .unwrap_or(snapshots.len() - 1);
            return Some(Peak {
                value: value as f64,
                seconds: snapshots[index].seconds,
                after: index.checked_sub(1).map(|i| snapshots[i].seconds),
                exact: true,
            });
        }
    }
    let (index, value) = snapshots
        .iter()
        .enumerate()
        .map(|(i, s)| (i, s.total().tracked))
        .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))?;
    Some(Peak {
        value: value as f64,
        seconds: snapshots[index].seconds,
        after: None,
        exact: false,
    })
}

/// The in-use chart: the top sites of the one process, or the top processes, stacked.
pub(super) fn inuse_chart(session: &Session, single: Option<u32>, peak: Option<&Peak>) -> Chart {
    let times: Vec<f64> = session.snapshots.iter().map(|s| s.seconds).collect();
    let (bands, other_label) = named_bands(session, single);
    // What the named bands add up to, at each profile.
    let mut named = vec![0.0; times.len()];
    let mut stacked: Vec<Series> = bands
        .into_iter()
        .enumerate()
        .map(|(index, (label, values))| {
            for (sum, v) in named.iter_mut().zip(&values) {
                *sum += v;
            }
            Series {
                label,
                values: values.into_iter().map(Some).collect(),
                color: PALETTE[index % PALETTE.len()].to_owned(),
                dashed: false,
            }
        })
        .collect();
    let totals: Vec<f64> = session
        .snapshots
        .iter()
        .map(|s| tracked_value(s.total()))
        .collect();
    stacked.extend(other_band(other_label, &totals, &named));
    let unit = if session.tracked.ends_with("space") {
        Unit::Bytes
    } else {
        Unit::Count
    };
    Chart {
        id: "chart-inuse".into(),
        title: format!("In use ({})", session.tracked),
        width: LAYOUT.inuse.width,
        height: LAYOUT.inuse.height,
        lines: vec![Series {
            label: "total".into(),
            values: totals.into_iter().map(Some).collect(),
            color: "#222".into(),
            dashed: false,
        }],
        times,
        stacked,
        marker: peak.map(|p| Marker {
            seconds: p.seconds,
            value: p.value,
            label: format!("peak {}", suspects::amount(&session.tracked, p.value)),
        }),
        note: None,
        unit,
    }
}

/// The tracked value of `values`, as the charts plot it.
fn tracked_value(values: session::Values) -> f64 {
    values.tracked as f64
}

/// The in-use chart's named bands, each a label and its values at every profile:
/// the top sites of the one process, or the top processes. With the label of the
/// band of the rest.
fn named_bands(session: &Session, single: Option<u32>) -> (Vec<(String, Vec<f64>)>, &'static str) {
    match single {
        Some(pid) => {
            let bands = timeline::top_sites(session, Some(pid), MAX_BANDS)
                .into_iter()
                .map(|key| {
                    let values = session
                        .snapshots
                        .iter()
                        .map(|s| tracked_value(s.site(key)))
                        .collect();
                    (session.site_name(key.site).to_owned(), values)
                })
                .collect();
            (bands, "other sites")
        }
        None => {
            let bands = timeline::top_processes(session, MAX_BANDS)
                .into_iter()
                .map(|pid| {
                    let values = session
                        .snapshots
                        .iter()
                        .map(|s| {
                            s.processes
                                .get(&pid)
                                .map_or(0.0, |p| tracked_value(p.inuse))
                        })
                        .collect();
                    (format!("{} ({pid})", session.comm(pid)), values)
                })
                .collect();
            (bands, "other processes")
        }
    }
}

/// The band of what the named bands leave out of the totals, if anything ever is.
fn other_band(label: &str, totals: &[f64], named: &[f64]) -> Option<Series> {
    let other: Vec<Option<f64>> = totals
        .iter()
        .zip(named)
        .map(|(t, n)| Some((t - n).max(0.0)))
        .collect();
    other.iter().flatten().any(|&v| v > 0.0).then(|| Series {
        label: label.into(),
        values: other,
        color: OTHER_COLOR.into(),
        dashed: false,
    })
}

/// The RSS chart: heap in-use bytes filled, RSS, anonymous RSS and the `[heap]`
/// segment as lines (summed over processes unless one is chosen).
pub(super) fn rss_chart(session: &Session, single: Option<u32>) -> Chart {
    let times: Vec<f64> = session.snapshots.iter().map(|s| s.seconds).collect();
    let memory: Vec<Option<crate::memstats::ProcessMemory>> = session
        .snapshots
        .iter()
        .map(|s| match single {
            Some(pid) => s.processes.get(&pid).and_then(|p| p.memory.clone()),
            None => memory_sum(s),
        })
        .collect();
    let inuse: Vec<Option<f64>> = session
        .snapshots
        .iter()
        .map(|s| {
            Some(match single {
                Some(pid) => s.processes.get(&pid).map_or(0.0, |p| p.inuse.bytes as f64),
                None => s.total().bytes as f64,
            })
        })
        .collect();
    let line = |label: &str,
                color: &str,
                dashed: bool,
                field: fn(&crate::memstats::ProcessMemory) -> u64| Series {
        label: label.into(),
        values: memory
            .iter()
            .map(|m| m.as_ref().map(|m| field(m) as f64))
            .collect(),
        color: color.into(),
        dashed,
    };
    let recorded = memory.iter().any(Option::is_some);
    if !recorded && session.snapshots.iter().any(|s| s.kernel_memory.is_some()) {
        return slab_chart(session, times, inuse);
    }
    let whose = match single {
        Some(pid) => format!("{} ({pid})", session.comm(pid)),
        None => "all processes".into(),
    };
    Chart {
        id: "chart-rss".into(),
        title: format!("RSS beside the heap: {whose}"),
        width: LAYOUT.rss.width,
        height: LAYOUT.rss.height,
        stacked: vec![Series {
            label: "heap in use (inuse_space)".into(),
            values: inuse,
            color: "#7fb3d5".into(),
            dashed: false,
        }],
        lines: if recorded {
            vec![
                line("VmRSS", "#c0392b", false, |m| m.vm_rss),
                line("RssAnon", "#e67e22", false, |m| m.rss_anon),
                line("[heap] segment", "#8e44ad", true, |m| m.heap),
            ]
        } else {
            vec![]
        },
        times,
        marker: None,
        note: (!recorded).then(|| "no RSS recorded in these profiles".to_owned()),
        unit: Unit::Bytes,
    }
}

/// The kernel-mode counterpart of the RSS chart: the traced kernel heap filled, the
/// kernel's slab totals (`Slab`, `SUnreclaim`) as lines.
fn slab_chart(session: &Session, times: Vec<f64>, inuse: Vec<Option<f64>>) -> Chart {
    let line =
        |label: &str, color: &str, field: fn(&crate::memstats::KernelMemory) -> u64| Series {
            label: label.into(),
            values: session
                .snapshots
                .iter()
                .map(|s| s.kernel_memory.as_ref().map(|m| field(m) as f64))
                .collect(),
            color: color.into(),
            dashed: false,
        };
    Chart {
        id: "chart-rss".into(),
        title: "Slab beside the traced kernel heap".into(),
        width: LAYOUT.rss.width,
        height: LAYOUT.rss.height,
        stacked: vec![Series {
            label: "traced kernel heap in use (inuse_space)".into(),
            values: inuse,
            color: "#7fb3d5".into(),
            dashed: false,
        }],
        lines: vec![
            line("Slab", "#c0392b", |m| m.slab),
            line("SUnreclaim", "#e67e22", |m| m.slab_unreclaimable),
        ],
        times,
        marker: None,
        note: None,
        unit: Unit::Bytes,
    }
}

/// A legend: a swatch and a label per series.
pub(super) fn legend(chart: &Chart) -> String {
    let mut html = String::from("<ul class=\"legend\">");
    for series in chart.lines.iter().chain(chart.stacked.iter().rev()) {
        let style = if series.dashed {
            format!("border-top:3px dashed {}", series.color)
        } else {
            format!("background:{}", series.color)
        };
        let _ = write!(
            html,
            "<li><span class=\"swatch\" style=\"{}\"></span>{}</li>",
            escape_html(&style),
            escape_html(&series.label)
        );
    }
    html.push_str("</ul>");
    html
}
