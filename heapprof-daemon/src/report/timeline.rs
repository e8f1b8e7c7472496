//! The in-use timeline of a session as CSV, and the choice of the processes and sites
//! it (and the HTML page's charts) follow.
//!
//! Columns, one row per profile × (process or site), long form:
//!
//! | column | meaning |
//! |---|---|
//! | `seconds` | time of the profile since the session's first profile (3 decimals) |
//! | `profile` | the profile's file name |
//! | `pid` | the process; `*` on the row of all processes together (only when the session has several) |
//! | `comm` | its command name (`*` with pid `*`) |
//! | `site` | `*` for the process's total; else a site (`malloc in b <- a <- main`) |
//! | `inuse_bytes` | in-use bytes (`inuse_space`) |
//! | `inuse_objects` | in-use objects |
//! | `vm_rss`, `rss_anon`, `heap` | the process's RSS, anonymous RSS and `[heap]` segment size, bytes |
//! | `minflt`, `majflt` | its page faults since it started |
//! | `peak_inuse` | the highest in-use bytes heapprofd saw in it so far (exact mode) |
//! | *tracked* | only when `--sample-index` is another in-use type (e.g. `inuse_requested_space`): its value |
//! | `slab`, `sunreclaim` | kernel profiles only: `Slab` and `SUnreclaim` of `/proc/meminfo` when the profile was written, bytes (on the rows of whole processes) |
//!
//! The memory columns are filled on process rows whose profile recorded them, and
//! empty otherwise (site rows, older profiles). On the all-processes row they are the
//! sums over the processes (shared pages counted once per process), and `peak_inuse`
//! stays empty (the processes peaked at different times).
//!
//! Site rows: for each process, the `--top` N sites with the largest value of the
//! tracked type in any profile, in that order, on every profile in which the process
//! is present (0 where the site held nothing). Rows of a profile come in pid order.

use std::{collections::HashMap, fmt::Write as _, io::Write};

use anyhow::{Context as _, Result};

use super::{
    session::{Session, SiteKey, Snapshot, Values},
    units::csv_cell,
};
use crate::memstats::ProcessMemory;

/// The largest value of the tracked type each process reached in any profile, in
/// pid order.
pub fn process_peaks(session: &Session) -> Vec<(u32, i64)> {
    let mut peaks: HashMap<u32, i64> = HashMap::new();
    for snapshot in &session.snapshots {
        for (&pid, process) in &snapshot.processes {
            let peak = peaks.entry(pid).or_insert(i64::MIN);
            *peak = (*peak).max(process.inuse.tracked);
        }
    }
    let mut peaks: Vec<(u32, i64)> = peaks.into_iter().collect();
    peaks.sort_unstable();
    peaks
}

/// The processes holding the most (largest tracked value in any profile), most first.
pub fn top_processes(session: &Session, limit: usize) -> Vec<u32> {
    let mut peaks = process_peaks(session);
    peaks.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut pids: Vec<u32> = peaks.into_iter().map(|(pid, _)| pid).collect();
    if limit > 0 {
        pids.truncate(limit);
    }
    pids
}

/// The `limit` sites of process `pid` (`None`: of all processes) with the largest
/// tracked value in any profile, most first (0: all sites).
pub fn top_sites(session: &Session, pid: Option<u32>, limit: usize) -> Vec<SiteKey> {
    let mut largest: HashMap<SiteKey, i64> = HashMap::new();
    for snapshot in &session.snapshots {
        for (key, values) in &snapshot.sites {
            if pid.is_none_or(|pid| key.pid == pid) {
                let entry = largest.entry(*key).or_insert(i64::MIN);
                *entry = (*entry).max(values.tracked);
            }
        }
    }
    let mut keys: Vec<(SiteKey, i64)> = largest.into_iter().filter(|(_, v)| *v > 0).collect();
    keys.sort_by(|a, b| {
        b.1.cmp(&a.1)
            .then_with(|| session.site_name(a.0.site).cmp(session.site_name(b.0.site)))
            .then(a.0.cmp(&b.0))
    });
    let mut keys: Vec<SiteKey> = keys.into_iter().map(|(key, _)| key).collect();
    if limit > 0 {
        keys.truncate(limit);
    }
    keys
}

/// The memory figures of all processes of a snapshot together (sums; no peak), or
/// `None` when none recorded any.
pub fn memory_sum(snapshot: &Snapshot) -> Option<ProcessMemory> {
    let mut recorded = snapshot
        .processes
        .values()
        .filter_map(|p| p.memory.as_ref())
        .peekable();
    recorded.peek()?;
    let mut sum = ProcessMemory::default();
    for memory in recorded {
        sum.vm_rss += memory.vm_rss;
        sum.rss_anon += memory.rss_anon;
        sum.heap += memory.heap;
        sum.minor_faults += memory.minor_faults;
        sum.major_faults += memory.major_faults;
    }
    Some(sum)
}

/// Writes the timeline CSV (see the module's documentation) with `top` sites per process.
pub fn write_csv(session: &Session, top: usize, out: &mut dyn Write) -> Result<()> {
    let pids = session.pids();
    let several = pids.len() > 1;
    let sites: Vec<(u32, Vec<SiteKey>)> = pids
        .iter()
        .map(|&pid| (pid, top_sites(session, Some(pid), top)))
        .collect();
    let columns = Columns::of(session);
    let mut text = columns.header(session);
    for snapshot in &session.snapshots {
        if several {
            let sum = memory_sum(snapshot);
            let all = Row {
                pid: "*",
                comm: "*",
                site: "*",
                values: snapshot.total(),
                memory: sum.as_ref(),
            };
            columns.write_row(&mut text, snapshot, &all);
        }
        for (pid, keys) in &sites {
            write_process_rows(&mut text, &columns, session, snapshot, *pid, keys);
        }
    }
    out.write_all(text.as_bytes())
        .context("writing the timeline")
}

/// Writes a profile's rows of process `pid`: its total, then each of its `keys`
/// sites; none when the process is not in the profile.
fn write_process_rows(
    text: &mut String,
    columns: &Columns,
    session: &Session,
    snapshot: &Snapshot,
    pid: u32,
    keys: &[SiteKey],
) {
    let Some(process) = snapshot.processes.get(&pid) else {
        return;
    };
    let pid_text = pid.to_string();
    let comm = session.comm(pid);
    let total = Row {
        pid: &pid_text,
        comm,
        site: "*",
        values: process.inuse,
        memory: process.memory.as_ref(),
    };
    columns.write_row(text, snapshot, &total);
    for key in keys {
        let site = Row {
            pid: &pid_text,
            comm,
            site: session.site_name(key.site),
            values: snapshot.site(*key),
            memory: None,
        };
        columns.write_row(text, snapshot, &site);
    }
}

/// The optional columns of a session's timeline.
struct Columns {
    /// The tracked type's column, when `--sample-index` is another in-use type.
    tracked: bool,
    /// `slab` and `sunreclaim`, when a profile recorded the kernel's memory.
    kernel: bool,
}

/// One row's own cells: who, where, and the figures.
struct Row<'a> {
    pid: &'a str,
    comm: &'a str,
    /// `*` for a process's (or all processes') total.
    site: &'a str,
    values: Values,
    /// The memory figures, on the rows of processes whose profile recorded them.
    memory: Option<&'a ProcessMemory>,
}

impl Columns {
    /// The optional columns `session` needs.
    fn of(session: &Session) -> Columns {
        Columns {
            tracked: !matches!(session.tracked.as_str(), "inuse_space" | "inuse_objects"),
            kernel: session
                .snapshots
                .iter()
                .any(|snapshot| snapshot.kernel_memory.is_some()),
        }
    }

    /// The header line.
    fn header(&self, session: &Session) -> String {
        let mut text = String::from(
            "seconds,profile,pid,comm,site,inuse_bytes,inuse_objects,vm_rss,rss_anon,heap,minflt,majflt,peak_inuse",
        );
        if self.tracked {
            text.push(',');
            text.push_str(&csv_cell(&session.tracked));
        }
        if self.kernel {
            text.push_str(",slab,sunreclaim");
        }
        text.push('\n');
        text
    }

    /// Appends `row` of profile `snapshot` as one line.
    fn write_row(&self, text: &mut String, snapshot: &Snapshot, row: &Row) {
        let _ = write!(
            text,
            "{:.3},{},{},{},{},{},{}",
            snapshot.seconds,
            csv_cell(&snapshot.file_name),
            row.pid,
            csv_cell(row.comm),
            csv_cell(row.site),
            row.values.bytes,
            row.values.objects
        );
        write_memory_cells(text, row.memory);
        if self.tracked {
            let _ = write!(text, ",{}", row.values.tracked);
        }
        if self.kernel {
            match snapshot.kernel_memory.as_ref().filter(|_| row.site == "*") {
                Some(k) => {
                    let _ = write!(text, ",{},{}", k.slab, k.slab_unreclaimable);
                }
                None => text.push_str(",,"),
            }
        }
        text.push('\n');
    }
}

/// Appends the memory cells (`vm_rss` to `peak_inuse`): empty without figures.
fn write_memory_cells(text: &mut String, memory: Option<&ProcessMemory>) {
    match memory {
        Some(m) => {
            let _ = write!(
                text,
                ",{},{},{},{},{},{}",
                m.vm_rss,
                m.rss_anon,
                m.heap,
                m.minor_faults,
                m.major_faults,
                m.peak_inuse.map(|p| p.to_string()).unwrap_or_default()
            );
        }
        None => text.push_str(",,,,,,"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::session::tests::session;

    #[test]
    fn one_row_per_profile_and_process_or_top_site() {
        let mut s = session(
            &[
                "malloc in grow <- main",
                "operator new in f<std::map<int, int>>",
            ],
            &[vec![0, 100, 200], vec![50, 60, 0]],
        );
        s.snapshots[2].processes.get_mut(&1).expect("pid 1").memory = Some(ProcessMemory {
            pid: 1,
            comm: "prog".into(),
            vm_rss: 4096,
            rss_anon: 2048,
            heap: 1024,
            minor_faults: 7,
            major_faults: 1,
            peak_inuse: Some(260),
        });
        let mut out = Vec::new();
        write_csv(&s, 1, &mut out).expect("written");
        let text = String::from_utf8(out).expect("utf8");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1 + 3 * 2, "{text}");
        assert!(lines[0].starts_with("seconds,profile,pid,comm,site,inuse_bytes"));
        assert_eq!(
            lines[1], "0.000,heap-0000.pb.gz,1,prog,*,50,3,,,,,,",
            "{text}"
        );
        assert_eq!(
            lines[2], "0.000,heap-0000.pb.gz,1,prog,malloc in grow <- main,0,0,,,,,,",
            "{text}"
        );
        assert_eq!(
            lines[5], "2.000,heap-0002.pb.gz,1,prog,*,200,12,4096,2048,1024,7,1,260",
            "{text}"
        );
        // With every site, the template's name is quoted (it holds a comma).
        let mut out = Vec::new();
        write_csv(&s, 0, &mut out).expect("written");
        let text = String::from_utf8(out).expect("utf8");
        assert!(
            text.contains(",\"operator new in f<std::map<int, int>>\",50,3,"),
            "{text}"
        );
    }

    #[test]
    fn several_processes_get_a_total_row() {
        let mut s = session(&["a"], &[vec![10, 20]]);
        for snapshot in &mut s.snapshots {
            let mut other = snapshot.processes[&1].clone();
            other.comm = "other".into();
            snapshot.processes.insert(2, other);
        }
        let mut out = Vec::new();
        write_csv(&s, 5, &mut out).expect("written");
        let text = String::from_utf8(out).expect("utf8");
        assert!(text.contains("1.000,heap-0001.pb.gz,*,*,*,40,2,"), "{text}");
        assert!(
            text.contains("1.000,heap-0001.pb.gz,2,other,*,20,1,"),
            "{text}"
        );
        assert_eq!(top_processes(&s, 1).len(), 1);
    }

    #[test]
    fn kernel_sessions_add_the_slab_totals_to_process_rows() {
        let mut s = session(&["kmem_cache_alloc in getname_flags"], &[vec![10, 20]]);
        s.snapshots[1].kernel_memory = Some(crate::memstats::KernelMemory {
            slab: 8192,
            slab_unreclaimable: 4096,
        });
        let mut out = Vec::new();
        write_csv(&s, 1, &mut out).expect("written");
        let text = String::from_utf8(out).expect("utf8");
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].ends_with(",peak_inuse,slab,sunreclaim"), "{text}");
        assert!(
            lines[1].ends_with(",,"),
            "no figures in the first profile: {text}"
        );
        assert!(lines[3].ends_with(",8192,4096"), "{text}");
        assert!(lines[4].ends_with(",,"), "site rows stay empty: {text}");
    }
}
