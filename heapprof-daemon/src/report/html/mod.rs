//! `heapprofd report DIR --html OUT.html`: one self-contained page of a session.
//!
//! The page fetches nothing (no CDN, fonts or scripts from elsewhere): the charts are
//! inline SVG drawn here ([`super::chart`]), the flamegraphs are inferno's SVGs
//! embedded as `data:` URLs in an `<iframe>` (their own script keeps working there:
//! click to zoom, search), and a few lines of inline script switch between them.
//!
//! Sections, top to bottom:
//! - the in-use timeline: the total, with the top sites (or, for a session of several
//!   processes without `--pid`, the top processes) stacked, and the peak marked;
//! - RSS (`VmRSS`, `RssAnon`) and the `[heap]` segment beside the heap's in-use bytes;
//! - the peak: heapprofd's exact peak when recorded, else the largest profile;
//! - the leak suspects ([`super::suspects`]);
//! - a flamegraph of any profile: at most [`MAX_FLAMEGRAPHS`] evenly spaced ones plus
//!   the last, which is shown first;
//! - the top sites of the last profile, and with several processes, a table of them.
//!
//! The charts sit at fixed places ([`LAYOUT`]) so that a test can find them in a
//! screenshot. The page's script records errors in the DOM (`window.onerror` fills
//! `#errors` and sets `data-errors` on `<html>`) and sets `data-report-ready="yes"` on
//! `<html>` when it finished.

use std::{collections::BTreeSet, fmt::Write as _, path::Path};

use anyhow::{Context as _, Result};
use base64::Engine as _;

mod charts;

use charts::{Peak, inuse_chart, legend, peak, rss_chart};

use super::{
    ReportArgs, chart, flamegraph,
    model::Profile,
    session::{self, Session},
    stacks::{self, ProcessFilter},
    suspects, timeline,
    units::{self, escape_html},
};

/// Flamegraphs embedded besides the last profile's (evenly spaced over the session).
pub const MAX_FLAMEGRAPHS: usize = 30;

/// A rectangle on the page, in CSS pixels from its top left corner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rect {
    /// Left edge.
    pub left: u32,
    /// Top edge.
    pub top: u32,
    /// Width.
    pub width: u32,
    /// Height.
    pub height: u32,
}

/// Where the page puts its charts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// The in-use timeline chart.
    pub inuse: Rect,
    /// The RSS chart.
    pub rss: Rect,
}

/// The charts' fixed places: side by side under a header of fixed height, for a
/// window at least 1260 pixels wide.
pub const LAYOUT: Layout = Layout {
    inuse: Rect {
        left: 12,
        top: 76,
        width: 610,
        height: 330,
    },
    rss: Rect {
        left: 636,
        top: 76,
        width: 610,
        height: 330,
    },
};

impl Rect {
    /// The plot inside a chart at this place: the chart less its margins.
    pub fn plot(&self) -> Rect {
        let (left, right, top, bottom) = chart::MARGINS;
        Rect {
            left: self.left + left,
            top: self.top + top,
            width: self.width - left - right,
            height: self.height - top - bottom,
        }
    }
}

/// One embedded flamegraph.
struct Flame {
    /// The `<select>` label.
    label: String,
    /// `data:image/svg+xml;base64,...`.
    url: String,
    /// The SVG's height in pixels (the frame is sized to it).
    height: u32,
}

/// Reads the session of `args.input` and writes its page to `page`.
pub fn write_page(args: &ReportArgs, filter: ProcessFilter, page: &Path) -> Result<()> {
    let mut flames = Vec::new();
    let mut first_time = None;
    let tracked = args.sample_index.as_str();
    let session = session::load(&args.input, tracked, filter, |index, count, profile| {
        let start = *first_time.get_or_insert(profile.time_nanos);
        // The last file is drawn after loading: it may be unreadable, and then the
        // last readable profile is the one shown first.
        if index + 1 < count && embedded(index, count) {
            flames.push(flame(profile, tracked, filter, start)?);
        }
        Ok(())
    })?;
    let start = first_time.unwrap_or(session.last.time_nanos);
    let last_flame = flame(&session.last, tracked, filter, start)?;
    if flames.last().is_some_and(|f| f.label == last_flame.label) {
        flames.pop();
    }
    flames.push(last_flame);
    let html = render(&session, args.top, filter, &flames)?;
    std::fs::write(page, html).with_context(|| {
        format!(
            "cannot write {}; choose another --html OUT.html",
            page.display()
        )
    })
}

/// Whether file `index` of `count` gets a flamegraph: [`MAX_FLAMEGRAPHS`] evenly spaced.
fn embedded(index: usize, count: usize) -> bool {
    if count <= MAX_FLAMEGRAPHS + 1 {
        return true;
    }
    let chosen: BTreeSet<usize> = (0..MAX_FLAMEGRAPHS)
        .map(|k| k * (count - 1) / MAX_FLAMEGRAPHS)
        .collect();
    chosen.contains(&index)
}

/// The flamegraph of one profile, ready to embed.
fn flame(profile: &Profile, tracked: &str, filter: ProcessFilter, start: i64) -> Result<Flame> {
    let index = profile.sample_index(tracked)?;
    let stacks: Vec<(String, i64)> = stacks::folded(profile, index, filter).into_iter().collect();
    let name = profile
        .path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let when = units::seconds((profile.time_nanos - start) as f64 / 1e9);
    let title = format!("{tracked} at {when} ({name})");
    let unit = if tracked.ends_with("space") {
        "bytes"
    } else {
        "objects"
    };
    let svg = flamegraph::render(&stacks, &title, unit)
        .with_context(|| format!("drawing the flamegraph of {name}"))?;
    let svg = framed(&String::from_utf8_lossy(&svg));
    Ok(Flame {
        label: format!("{when}: {name}"),
        height: svg_height(&svg).unwrap_or(600),
        url: format!("data:image/svg+xml;base64,{}", base64(svg.as_bytes())),
    })
}

/// inferno's script saves the zoom in the URL with `history.replaceState`, which a
/// `data:` frame may not do (the browser throws): the calls are made to fail quietly.
fn framed(svg: &str) -> String {
    const CALL: &str = "history.replaceState(";
    if !svg.contains(CALL) {
        return svg.to_owned();
    }
    let replaced = svg.replace(CALL, "heapprofdReplaceState(");
    let helper = "function heapprofdReplaceState(state, title, url) {\n\
                  try { history.replaceState(state, title, url); } catch (e) { /* a data: frame */ }\n\
                  }\n";
    match replaced.find("function init(") {
        Some(at) => format!("{}{helper}{}", &replaced[..at], &replaced[at..]),
        None => svg.to_owned(),
    }
}

/// The `height` of the first `<svg>` element.
fn svg_height(svg: &str) -> Option<u32> {
    let tag_start = svg.find("<svg")?;
    let tag = &svg[tag_start..tag_start + svg[tag_start..].find('>')?];
    let value = tag.split(" height=\"").nth(1)?.split('"').next()?;
    value
        .trim_end_matches("px")
        .parse::<f64>()
        .ok()
        .map(|h| h.ceil() as u32)
}

/// Standard base64 with padding (for `data:` URLs).
fn base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The one process the page follows (`--pid`, or the session's only one).
fn single_process(session: &Session, filter: ProcessFilter) -> Option<u32> {
    match filter {
        ProcessFilter::Pid(pid) => Some(pid),
        ProcessFilter::All => match session.pids().as_slice() {
            [pid] => Some(*pid),
            _ => None,
        },
    }
}

/// The whole page.
fn render(
    session: &Session,
    top: usize,
    filter: ProcessFilter,
    flames: &[Flame],
) -> Result<String> {
    let single = single_process(session, filter);
    let peak = peak(session, single);
    let inuse = inuse_chart(session, single, peak.as_ref());
    let rss = rss_chart(session, single);
    let tracked = &session.tracked;
    let mut html = String::new();
    let title = format!("heapprofd report: {}", session.dir.display());
    let _ = write!(
        html,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>{}</title><style>{STYLE}</style>\
         <script>{ERROR_SCRIPT}</script></head><body>",
        escape_html(&title)
    );
    let who = match single {
        Some(pid) => format!("process {pid} ({})", session.comm(pid)),
        None => format!("{} processes", session.pids().len()),
    };
    let _ = write!(
        html,
        "<div id=\"head\"><h1>{}</h1><p>{} profile{} over {}, {}; values: {}.</p></div>",
        escape_html(&title),
        session.snapshots.len(),
        if session.snapshots.len() == 1 {
            ""
        } else {
            "s"
        },
        escape_html(&units::seconds(session.span_seconds())),
        escape_html(&who),
        escape_html(tracked)
    );
    let _ = write!(
        html,
        "<div id=\"charts\"><div class=\"chart\" style=\"left:{}px\">{}</div>\
         <div class=\"chart\" style=\"left:{}px\">{}</div></div>",
        LAYOUT.inuse.left,
        inuse.svg(),
        LAYOUT.rss.left,
        rss.svg()
    );
    html.push_str("<div id=\"rest\">");
    losses_section(&mut html, session);
    let _ = write!(
        html,
        "<div class=\"legends\"><div>{}</div><div>{}</div></div>",
        legend(&inuse),
        legend(&rss)
    );
    peak_section(&mut html, session, peak.as_ref());
    super::peak::html_section(&mut html, &session.last, top, filter);
    suspects_section(&mut html, session, top);
    flame_section(&mut html, flames);
    top_section(&mut html, session, top, filter)?;
    kernel_sections(&mut html, &session.last, filter);
    super::sizes::html_section(&mut html, &session.last, filter);
    if single.is_none() {
        processes_section(&mut html, session);
    }
    let _ = writeln!(
        html,
        "<section id=\"error-box\" hidden><h2>Script errors</h2><ul id=\"errors\"></ul></section></div>\
         <script type=\"application/json\" id=\"flame-data\">{}</script>\
         <script>{PAGE_SCRIPT}</script></body></html>",
        flame_json(flames)
    );
    Ok(html)
}

/// What the session's last profile lost, first on the page (see [`super::losses`]).
fn losses_section(html: &mut String, session: &Session) {
    let losses = super::losses::losses(&session.last.comments);
    if losses.is_empty() {
        return;
    }
    html.push_str(
        "<section id=\"losses\"><h2>Lost data</h2><p class=\"note\">The last profile is \
         incomplete: its totals and peak are lower than the program's.</p><ul>",
    );
    for loss in &losses {
        let _ = write!(html, "<li>{}</li>", escape_html(&loss.line()));
    }
    html.push_str("</ul></section>");
}

fn peak_section(html: &mut String, session: &Session, peak: Option<&Peak>) {
    html.push_str("<h2 id=\"peak\">Peak</h2>");
    let Some(peak) = peak else {
        html.push_str("<p>No profile.</p>");
        return;
    };
    let amount = suspects::amount(&session.tracked, peak.value);
    // Blocks that were never tracked make the count a lower bound, not an exact one.
    let count = if super::losses::losses(&session.last.comments)
        .iter()
        .any(|loss| loss.untracked_blocks)
    {
        "heapprofd's count, too low: blocks were lost, see Lost data"
    } else {
        "heapprofd's exact count"
    };
    let text = if peak.exact {
        match peak.after {
            Some(after) => format!(
                "{amount} in use at most ({count}), reached between {} and {} after the first profile.",
                units::seconds(after),
                units::seconds(peak.seconds)
            ),
            None => format!("{amount} in use at most ({count}), reached by the first profile."),
        }
    } else {
        format!(
            "{amount} in use in the largest profile, at {} (between profiles it may have been higher; \
             heapprofd's exact peak was not recorded).",
            units::seconds(peak.seconds)
        )
    };
    let _ = write!(html, "<p id=\"peak-text\">{}</p>", escape_html(&text));
}

fn suspects_section(html: &mut String, session: &Session, top: usize) {
    let found = suspects::find(session, top);
    let _ = write!(
        html,
        "<h2>Leak suspects</h2><p class=\"note\">Sites whose {} grew steadily: ranked by slope × tau \
         (Kendall's rank correlation with time); tau ≥ {}, growth ≥ {:.0}% of the mean, still growing \
         in the later half, at least {} profiles.</p>",
        escape_html(&session.tracked),
        suspects::MIN_TAU,
        suspects::MIN_RELATIVE_GROWTH * 100.0,
        suspects::MIN_PROFILES
    );
    if found.is_empty() {
        html.push_str("<p id=\"no-suspects\">No suspects.</p>");
        return;
    }
    html.push_str(
        "<table id=\"suspects\"><tr><th>rank</th><th>pid</th><th>first</th><th>last</th>\
         <th>growth</th><th>slope</th><th>tau</th><th>site</th></tr>",
    );
    let tracked = &session.tracked;
    let undercounted = super::losses::frees_undercounted(&session.last.comments);
    for (rank, s) in found.iter().enumerate() {
        let t = &s.trend;
        let note = if undercounted {
            format!(
                " <span class=\"note\">({})</span>",
                super::losses::FREES_UNDERCOUNTED
            )
        } else {
            String::new()
        };
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}/s</td><td>{:.2}</td><td class=\"site\">{}{note}</td></tr>",
            rank + 1,
            s.key.pid,
            escape_html(&suspects::amount(tracked, t.first)),
            escape_html(&suspects::amount(tracked, t.last)),
            escape_html(&suspects::amount(tracked, t.last - t.first)),
            escape_html(&suspects::amount(tracked, t.slope)),
            t.tau,
            escape_html(session.site_name(s.key.site))
        );
    }
    html.push_str("</table>");
}

fn flame_section(html: &mut String, flames: &[Flame]) {
    html.push_str("<h2>Flamegraph</h2>");
    let Some(last) = flames.last() else {
        return;
    };
    let _ = write!(
        html,
        "<p class=\"note\">{} of the session's profiles are embedded (at most {MAX_FLAMEGRAPHS} evenly \
         spaced, and the last). Click a frame to zoom in.</p><select id=\"flame-select\">",
        flames.len()
    );
    for (i, flame) in flames.iter().enumerate() {
        let selected = if i + 1 == flames.len() {
            " selected"
        } else {
            ""
        };
        let _ = write!(
            html,
            "<option value=\"{i}\"{selected}>{}</option>",
            escape_html(&flame.label)
        );
    }
    let _ = write!(
        html,
        "</select><br><iframe id=\"flame\" title=\"flamegraph\" src=\"{}\" style=\"height:{}px\"></iframe>",
        last.url, last.height
    );
}

/// The flamegraphs for the script: `[{"url": ..., "height": ...}]`. The URLs are
/// base64 (no character needs escaping in JSON or before `</script>`).
fn flame_json(flames: &[Flame]) -> String {
    let items: Vec<String> = flames
        .iter()
        .map(|f| format!("{{\"url\":\"{}\",\"height\":{}}}", f.url, f.height))
        .collect();
    format!("[{}]", items.join(","))
}

fn top_section(
    html: &mut String,
    session: &Session,
    top: usize,
    filter: ProcessFilter,
) -> Result<()> {
    let last = &session.last;
    let index = last.sample_index(&session.tracked)?;
    let total = last
        .samples
        .iter()
        .filter(|s| match filter {
            ProcessFilter::All => true,
            ProcessFilter::Pid(pid) => s.pid == Some(pid),
        })
        .map(|s| s.values[index])
        .sum::<i64>();
    let _ = write!(
        html,
        "<h2>Top sites of the last profile</h2><p class=\"note\">{}, by {}; total {}.</p>\
         <table id=\"top\"><tr><th>rank</th><th>{}</th><th>%</th>",
        escape_html(
            &session
                .snapshots
                .last()
                .map_or_else(String::new, |s| s.file_name.clone())
        ),
        escape_html(&session.tracked),
        escape_html(&suspects::amount(&session.tracked, total as f64)),
        escape_html(&session.tracked),
    );
    let others: Vec<(usize, &str)> = ["inuse_objects", "alloc_space", "alloc_objects"]
        .into_iter()
        .filter(|t| *t != session.tracked)
        .filter_map(|t| last.sample_index(t).ok().map(|i| (i, t)))
        .collect();
    for (_, name) in &others {
        let _ = write!(html, "<th>{}</th>", escape_html(name));
    }
    html.push_str("<th>site</th></tr>");
    for (rank, site) in stacks::top_sites(last, index, top, filter)
        .iter()
        .enumerate()
    {
        let value = site.values[index];
        let share = if total > 0 {
            100.0 * value as f64 / total as f64
        } else {
            0.0
        };
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{share:.1}</td>",
            rank + 1,
            escape_html(&suspects::amount(&session.tracked, value as f64))
        );
        for (i, name) in &others {
            let _ = write!(
                html,
                "<td>{}</td>",
                escape_html(&suspects::amount(name, site.values[*i] as f64))
            );
        }
        let _ = write!(
            html,
            "<td class=\"site\">{}</td></tr>",
            escape_html(&site.description)
        );
    }
    html.push_str("</table>");
    Ok(())
}

/// Kernel profiles: the last profile's memory per slab cache, as `slabtop` and
/// `perf kmem --alloc` show it (objects, bytes, requested, waste), and per page order
/// when it counted pages.
fn kernel_sections(html: &mut String, last: &Profile, filter: ProcessFilter) {
    let index = |name: &str| last.sample_types.iter().position(|t| t == name);
    let (
        Some(alloc_objects),
        Some(alloc_space),
        Some(inuse_objects),
        Some(inuse_space),
        Some(requested),
    ) = (
        index("alloc_objects"),
        index("alloc_space"),
        index("inuse_objects"),
        index("inuse_space"),
        index("alloc_requested_space"),
    )
    else {
        return;
    };
    for (by, title, what) in [
        (stacks::Grouping::Cache, "Slab caches", "cache"),
        (stacks::Grouping::Order, "Page orders", "order"),
    ] {
        let mut rows = stacks::top_groups(last, alloc_space, 0, filter, by);
        // Slab samples in the order table, pages in the cache table: not rows of theirs.
        rows.retain(|row| !row.description.starts_with('('));
        if rows.is_empty() {
            continue;
        }
        rows.sort_by(|a, b| {
            b.values[inuse_space]
                .cmp(&a.values[inuse_space])
                .then_with(|| b.values[alloc_space].cmp(&a.values[alloc_space]))
        });
        let _ = write!(
            html,
            "<h2>{title}</h2><table id=\"{what}s\"><tr><th>{what}</th><th>objects in use</th>\
             <th>bytes in use</th><th>objects allocated</th><th>bytes allocated</th>\
             <th>requested</th><th>waste %</th></tr>"
        );
        for row in &rows {
            let v = &row.values;
            let waste = units::waste_percent(v[requested], v[alloc_space]).unwrap_or(0.0);
            let _ = write!(
                html,
                "<tr><td class=\"site\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
                 <td>{}</td><td>{waste:.1}</td></tr>",
                escape_html(&row.description),
                v[inuse_objects],
                escape_html(&units::bytes(v[inuse_space] as f64)),
                v[alloc_objects],
                escape_html(&units::bytes(v[alloc_space] as f64)),
                escape_html(&units::bytes(v[requested] as f64)),
            );
        }
        html.push_str("</table>");
    }
}

fn processes_section(html: &mut String, session: &Session) {
    html.push_str(
        "<h2>Processes</h2><table id=\"processes\"><tr><th>pid</th><th>comm</th><th>largest</th>\
         <th>last</th><th>last VmRSS</th><th>exact peak</th></tr>",
    );
    let tracked = &session.tracked;
    for pid in timeline::top_processes(session, 0) {
        let largest = session
            .snapshots
            .iter()
            .filter_map(|s| s.processes.get(&pid))
            .map(|p| p.inuse.tracked)
            .max()
            .unwrap_or(0);
        let last = session
            .snapshots
            .iter()
            .rev()
            .find_map(|s| s.processes.get(&pid));
        let memory = last.and_then(|p| p.memory.as_ref());
        let _ = write!(
            html,
            "<tr><td>{pid}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape_html(session.comm(pid)),
            escape_html(&suspects::amount(tracked, largest as f64)),
            escape_html(&suspects::amount(
                tracked,
                last.map_or(0.0, |p| p.inuse.tracked as f64)
            )),
            memory.map_or_else(String::new, |m| escape_html(&units::bytes(m.vm_rss as f64))),
            memory
                .and_then(|m| m.peak_inuse)
                .map_or_else(String::new, |p| escape_html(&units::bytes(p as f64))),
        );
    }
    html.push_str("</table>");
}

const STYLE: &str = "\
body{margin:0;font:14px sans-serif;color:#222;background:#fff}\
#head{position:absolute;left:0;top:0;width:1236px;height:72px;padding:0 12px;overflow:hidden}\
#head h1{font-size:20px;margin:10px 0 4px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}\
#head p{margin:0;color:#444}\
#charts{position:absolute;left:0;top:76px;width:1260px;height:330px}\
.chart{position:absolute;top:0}\
#rest{position:absolute;left:0;top:410px;right:0;padding:0 12px 24px}\
.legends{display:flex;gap:14px}\
.legends>div{width:610px}\
ul.legend{list-style:none;margin:0;padding:0;font-size:12px}\
ul.legend li{margin:2px 0;overflow-wrap:anywhere}\
.swatch{display:inline-block;width:14px;height:10px;margin-right:6px;vertical-align:middle}\
h2{font-size:16px;margin:22px 0 6px}\
.note{color:#555;font-size:12px;margin:4px 0}\
#losses{color:#a00}\
table{border-collapse:collapse;font-size:12px}\
th,td{border-bottom:1px solid #ddd;padding:3px 8px;text-align:right;vertical-align:top}\
td.site,th:last-child{text-align:left;font-family:monospace;overflow-wrap:anywhere}\
#flame{width:100%;max-width:1240px;border:1px solid #ccc;margin-top:6px}\
.bar{display:inline-block;height:10px;background:#4a7bd0}\
#error-box h2{color:#b00020}";

/// Runs first: errors anywhere on the page are written into it, for people and tests.
const ERROR_SCRIPT: &str = "\
window.onerror = function (message, source, line) {\
  var list = document.getElementById('errors');\
  var text = String(message) + ' (' + source + ':' + line + ')';\
  if (list) { var item = document.createElement('li'); item.textContent = text; list.appendChild(item); }\
  var box = document.getElementById('error-box');\
  if (box) { box.hidden = false; }\
  var count = Number(document.documentElement.getAttribute('data-errors') || '0') + 1;\
  document.documentElement.setAttribute('data-errors', String(count));\
  document.documentElement.setAttribute('data-last-error', text);\
};";

/// Switches the flamegraph; marks the page ready when done.
const PAGE_SCRIPT: &str = "\
(function () {\
  'use strict';\
  var flames = JSON.parse(document.getElementById('flame-data').textContent);\
  var select = document.getElementById('flame-select');\
  var frame = document.getElementById('flame');\
  if (select && frame) {\
    select.addEventListener('change', function () {\
      var flame = flames[Number(select.value)];\
      if (flame) { frame.src = flame.url; frame.style.height = flame.height + 'px'; }\
    });\
  }\
  document.documentElement.setAttribute('data-report-ready', 'yes');\
})();";

#[cfg(test)]
mod tests;
