//! A session's directory of profiles read in time order into a compact [`Session`]:
//! the model the timeline, the leak suspects and the HTML page are drawn from.
//!
//! A session directory holds `heap-YYYYMMDDTHHMMSS.mmmZ-NNNN.pb.gz` files (their names
//! sort chronologically); other files are ignored. Each profile is read, reduced to its
//! in-use figures per process and per site ([`Snapshot`]) and dropped, so a long
//! session costs memory for its sites, not for its stacks; only the last profile is
//! kept whole (the HTML page's top table).
//!
//! A file that cannot be decoded (a truncated copy, a disk that filled up) is skipped
//! with a warning on standard error: the rest of the session still tells its story.
//! A directory with no readable profile, or profiles without the sample types the
//! reports need, is an error.

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};

use super::{
    model::Profile,
    stacks::{ProcessFilter, site_description},
};
use crate::memstats::ProcessMemory;

/// In-use figures of a process or a site in one profile.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Values {
    /// `inuse_space`.
    pub bytes: i64,
    /// `inuse_objects`.
    pub objects: i64,
    /// The sample type the report ranks by (`--sample-index`; `inuse_space` by default).
    pub tracked: i64,
}

impl Values {
    /// Adds `other` to these.
    pub fn add(&mut self, other: Values) {
        self.bytes += other.bytes;
        self.objects += other.objects;
        self.tracked += other.tracked;
    }
}

/// One process in one profile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessPoint {
    /// Its command name (from the samples' labels or the memory comment).
    pub comm: String,
    /// The sum over its samples.
    pub inuse: Values,
    /// RSS, heap segment, faults and the exact peak, when the profile recorded them.
    pub memory: Option<ProcessMemory>,
}

/// A site of one process: sites of different processes are different series.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SiteKey {
    /// The process (0 for samples without a pid label).
    pub pid: u32,
    /// Index into the session's site names ([`Session::site_name`]).
    pub site: usize,
}

/// What the session reports keep of one profile.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// The file's name.
    pub file_name: String,
    /// Seconds since the session's first (readable) profile.
    pub seconds: f64,
    /// The processes present: those with samples or recorded memory figures.
    pub processes: BTreeMap<u32, ProcessPoint>,
    /// In-use per site; a site absent here held nothing at this time.
    pub sites: HashMap<SiteKey, Values>,
    /// The kernel's slab totals (kernel-mode profiles).
    pub kernel_memory: Option<crate::memstats::KernelMemory>,
}

impl Snapshot {
    /// The in-use of a site, 0 when absent.
    pub fn site(&self, key: SiteKey) -> Values {
        self.sites.get(&key).copied().unwrap_or_default()
    }

    /// The sum over all processes.
    pub fn total(&self) -> Values {
        let mut total = Values::default();
        for process in self.processes.values() {
            total.add(process.inuse);
        }
        total
    }
}

/// A session's profiles, reduced to what the timeline, suspects and page show.
#[derive(Debug, Clone)]
pub struct Session {
    /// The directory.
    pub dir: PathBuf,
    /// The sample type ranked and tested for growth (`--sample-index`).
    pub tracked: String,
    /// One per readable profile, in time order.
    pub snapshots: Vec<Snapshot>,
    /// The last readable profile, whole.
    pub last: Profile,
    /// Site names, indexed by [`SiteKey::site`].
    site_names: Vec<String>,
}

impl Session {
    /// The description of a site (`malloc in b <- a <- main`).
    pub fn site_name(&self, site: usize) -> &str {
        self.site_names
            .get(site)
            .map_or("[unknown]", String::as_str)
    }

    /// Every process present in some profile, in pid order.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .snapshots
            .iter()
            .flat_map(|s| s.processes.keys().copied())
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// The command name of a process, as last seen.
    pub fn comm(&self, pid: u32) -> &str {
        self.snapshots
            .iter()
            .rev()
            .find_map(|s| s.processes.get(&pid).filter(|p| !p.comm.is_empty()))
            .map_or("?", |p| p.comm.as_str())
    }

    /// The series of a site: (seconds, values) for each profile in which its process
    /// is present (0 where the site held nothing).
    pub fn site_series(&self, key: SiteKey) -> Vec<(f64, Values)> {
        self.snapshots
            .iter()
            .filter(|s| s.processes.contains_key(&key.pid))
            .map(|s| (s.seconds, s.site(key)))
            .collect()
    }

    /// Every site of the session, each once.
    pub fn site_keys(&self) -> Vec<SiteKey> {
        let mut keys: Vec<SiteKey> = self
            .snapshots
            .iter()
            .flat_map(|s| s.sites.keys().copied())
            .collect();
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    /// The session's length: seconds from the first profile to the last.
    pub fn span_seconds(&self) -> f64 {
        self.snapshots.last().map_or(0.0, |s| s.seconds)
    }
}

/// The profiles of a session directory, in time order (their names sort so).
pub fn profile_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let metadata = std::fs::metadata(dir).with_context(|| {
        format!(
            "cannot read {}; give the session's output directory",
            dir.display()
        )
    })?;
    if !metadata.is_dir() {
        bail!(
            "{} is a file, but the timeline, suspects and --html read a whole session: give the session's output directory (heapprofd -o DIR)",
            dir.display()
        );
    }
    let files = super::input::profiles_in(dir)?;
    if files.is_empty() {
        bail!(
            "no profiles (heap-*.pb.gz) in {}; give the output directory of a heapprofd session",
            dir.display()
        );
    }
    Ok(files)
}

/// Reads the session in `dir`: the sample type `tracked` (an in-use type) is ranked,
/// `filter` picks the processes. `visit(index, count, profile)` sees each readable
/// profile whole before it is reduced (`index` among the `count` files), for reports
/// that draw some of them.
pub fn load(
    dir: &Path,
    tracked: &str,
    filter: ProcessFilter,
    mut visit: impl FnMut(usize, usize, &Profile) -> Result<()>,
) -> Result<Session> {
    if !tracked.starts_with("inuse_") {
        bail!(
            "the timeline, suspects and --html follow in-use memory: give --sample-index inuse_space or inuse_objects, not {tracked}"
        );
    }
    let files = profile_files(dir)?;
    let mut interner = Interner::default();
    let mut snapshots = Vec::with_capacity(files.len());
    let mut first_time = None;
    let mut last = None;
    for (index, path) in files.iter().enumerate() {
        let profile = match Profile::load(path) {
            Ok(profile) => profile,
            Err(err) => {
                // `{:#}` of an anyhow error prints the causes too (an I/O error's kind).
                let err = anyhow::Error::new(err);
                eprintln!("heapprofd: warning: skipping a profile: {err:#}");
                continue;
            }
        };
        visit(index, files.len(), &profile)?;
        let start = *first_time.get_or_insert(profile.time_nanos);
        let mut snapshot = reduce(&profile, tracked, filter, &mut interner)?;
        snapshot.seconds = (profile.time_nanos - start) as f64 / 1e9;
        snapshots.push(snapshot);
        last = Some(profile);
    }
    let Some(last) = last else {
        bail!(
            "none of the {} profiles in {} could be read (see the warnings above)",
            files.len(),
            dir.display()
        );
    };
    if let ProcessFilter::Pid(pid) = filter
        && snapshots.iter().all(|s| s.processes.is_empty())
    {
        bail!(
            "process {pid} is in no profile of {}; leave out --pid, or give one of the pids `heapprofd report {} --format timeline` lists",
            dir.display(),
            dir.display()
        );
    }
    Ok(Session {
        dir: dir.to_owned(),
        tracked: tracked.to_owned(),
        snapshots,
        last,
        site_names: interner.names,
    })
}

/// Site names numbered once for the whole session.
#[derive(Default)]
struct Interner {
    ids: HashMap<String, usize>,
    names: Vec<String>,
}

impl Interner {
    fn id(&mut self, name: String) -> usize {
        if let Some(&id) = self.ids.get(&name) {
            return id;
        }
        let id = self.names.len();
        self.names.push(name.clone());
        self.ids.insert(name, id);
        id
    }
}

/// One profile's in-use figures per process and site.
fn reduce(
    profile: &Profile,
    tracked: &str,
    filter: ProcessFilter,
    interner: &mut Interner,
) -> Result<Snapshot> {
    let bytes = profile.sample_index("inuse_space")?;
    let objects = profile.sample_index("inuse_objects")?;
    let tracked = profile.sample_index(tracked)?;
    let admits = |pid: u32| match filter {
        ProcessFilter::All => true,
        ProcessFilter::Pid(wanted) => pid == wanted,
    };
    let mut snapshot = Snapshot {
        file_name: profile
            .path
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        kernel_memory: profile.kernel_memory,
        ..Snapshot::default()
    };
    for sample in &profile.samples {
        let pid = sample.pid.unwrap_or(0);
        if !admits(pid) {
            continue;
        }
        let values = Values {
            bytes: sample.values[bytes],
            objects: sample.values[objects],
            tracked: sample.values[tracked],
        };
        let process = snapshot.processes.entry(pid).or_default();
        if process.comm.is_empty()
            && let Some(comm) = &sample.comm
        {
            process.comm.clone_from(comm);
        }
        process.inuse.add(values);
        if values != Values::default() {
            let site = interner.id(site_description(sample));
            snapshot
                .sites
                .entry(SiteKey { pid, site })
                .or_default()
                .add(values);
        }
    }
    for memory in profile.processes.iter().filter(|m| admits(m.pid)) {
        let process = snapshot.processes.entry(memory.pid).or_default();
        if process.comm.is_empty() {
            process.comm.clone_from(&memory.comm);
        }
        process.memory = Some(memory.clone());
    }
    Ok(snapshot)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::pprof::builder::SAMPLE_TYPES;

    /// A session built from per-profile site values of one process (pid 1), one
    /// profile per second: `series[site][profile]` in bytes (objects: bytes / 16).
    pub(crate) fn session(names: &[&str], series: &[Vec<i64>]) -> Session {
        let count = series.iter().map(Vec::len).max().unwrap_or(0);
        let snapshots = (0..count)
            .map(|i| {
                let mut snapshot = Snapshot {
                    file_name: format!("heap-{i:04}.pb.gz"),
                    seconds: i as f64,
                    ..Snapshot::default()
                };
                let mut total = Values::default();
                for (site, values) in series.iter().enumerate() {
                    let bytes = values.get(i).copied().unwrap_or(0);
                    let values = Values {
                        bytes,
                        objects: bytes / 16,
                        tracked: bytes,
                    };
                    total.add(values);
                    snapshot.sites.insert(SiteKey { pid: 1, site }, values);
                }
                snapshot.processes.insert(
                    1,
                    ProcessPoint {
                        comm: "prog".into(),
                        inuse: total,
                        memory: None,
                    },
                );
                snapshot
            })
            .collect();
        Session {
            dir: PathBuf::from("dir"),
            tracked: "inuse_space".into(),
            snapshots,
            last: empty_profile(),
            site_names: names.iter().map(|n| (*n).to_owned()).collect(),
        }
    }

    /// A profile without samples.
    pub(crate) fn empty_profile() -> Profile {
        Profile {
            path: PathBuf::from("p"),
            time_nanos: 0,
            duration_nanos: 0,
            sample_types: SAMPLE_TYPES.map(|(t, _)| t.to_owned()).to_vec(),
            period: 1,
            comments: vec![],
            samples: vec![],
            mappings: vec![],
            processes: vec![],
            kernel_memory: None,
        }
    }

    /// Writes a session of `count` profiles, one a second, to `dir`: pid 7 leaks 4 KiB
    /// a second at a C++ template's site and churns at another; pid 9 holds 100 bytes.
    /// Returns the files' names.
    pub(crate) fn write_session(dir: &Path, count: u32) -> Vec<String> {
        use crate::{
            memstats::ProcessMemory,
            pprof::{LabelValue, ProfileBuilder, writer::write_profile},
            symbolize::Frame,
        };
        let frame = |name: &str| Frame {
            function: name.into(),
            file: None,
            line: 0,
        };
        (0..count)
            .map(|i| {
                let second = 1_000_000_000_i64;
                let mut builder = ProfileBuilder::new(
                    1_700_000_000 * second + i64::from(i) * second,
                    0,
                    &SAMPLE_TYPES,
                );
                let malloc = builder.location(1, 0x10, 0, None, &[frame("malloc")]);
                let leak = builder.location(1, 0x20, 0, None, &[frame("f<std::map<int, int>>")]);
                let churn = builder.location(1, 0x30, 0, None, &[frame("churn")]);
                let main = builder.location(1, 0x40, 0, None, &[frame("main")]);
                let labels = |pid: i64| {
                    [
                        ("pid", LabelValue::Num(pid)),
                        ("comm", LabelValue::Str("prog")),
                    ]
                };
                let leaked = 4096 * u64::from(i + 1);
                builder.sample(
                    &[malloc, leak, main],
                    &[u64::from(i + 1), leaked, u64::from(i + 1), leaked],
                    &labels(7),
                );
                let churned = if i % 2 == 0 { 9000 } else { 1000 };
                builder.sample(
                    &[malloc, churn, main],
                    &[50, 50_000, 5, churned],
                    &labels(7),
                );
                builder.sample(&[malloc, main], &[1, 100, 1, 100], &labels(9));
                builder.comment(
                    &ProcessMemory {
                        pid: 7,
                        comm: "prog".into(),
                        vm_rss: 1 << 20,
                        rss_anon: 1 << 19,
                        peak_inuse: Some(leaked + 9000),
                        ..ProcessMemory::default()
                    }
                    .to_comment(),
                );
                let name = format!("heap-20231114T2213{i:02}.000Z-{:04}.pb.gz", i + 1);
                write_profile(dir, &name, &builder.finish().expect("valid")).expect("written");
                name
            })
            .collect()
    }

    #[test]
    fn reads_a_written_session_skipping_a_corrupt_profile() {
        let dir = tempfile::tempdir().expect("tempdir");
        let names = write_session(dir.path(), 5);
        // Sorts between the third and fourth; not a profile.
        std::fs::write(
            dir.path().join("heap-20231114T221302.500Z-0099.pb.gz"),
            b"junk",
        )
        .expect("write");
        std::fs::write(dir.path().join("README"), b"not read").expect("write");
        let mut visited = Vec::new();
        let session = load(
            dir.path(),
            "inuse_space",
            ProcessFilter::All,
            |index, count, p| {
                visited.push((index, count, p.samples.len()));
                Ok(())
            },
        )
        .expect("loaded");
        assert_eq!(visited.len(), 5, "the corrupt file is skipped: {visited:?}");
        assert_eq!(visited[4], (5, 6, 3));
        assert_eq!(session.snapshots.len(), 5);
        assert_eq!(session.snapshots[4].file_name, names[4]);
        assert!((session.snapshots[4].seconds - 4.0).abs() < 1e-9);
        assert_eq!(session.pids(), [7, 9]);
        let process = &session.snapshots[0].processes[&7];
        assert_eq!(process.inuse.bytes, 4096 + 9000);
        assert_eq!(process.memory.as_ref().map(|m| m.vm_rss), Some(1 << 20));
        assert!(session.snapshots[0].processes[&9].memory.is_none());

        let one = load(
            dir.path(),
            "inuse_space",
            ProcessFilter::Pid(9),
            |_, _, _| Ok(()),
        )
        .expect("loaded");
        assert_eq!(one.pids(), [9]);
        let err = load(
            dir.path(),
            "inuse_space",
            ProcessFilter::Pid(1),
            |_, _, _| Ok(()),
        )
        .expect_err("no such process");
        assert!(
            format!("{err:#}").contains("process 1 is in no profile"),
            "{err:#}"
        );
    }

    #[test]
    fn a_file_or_an_empty_directory_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = profile_files(dir.path()).expect_err("empty");
        assert!(format!("{err:#}").contains("no profiles"), "{err:#}");
        let file = dir.path().join("heap-1.pb.gz");
        std::fs::write(&file, b"not a profile").expect("write");
        std::fs::write(dir.path().join("notes.txt"), b"x").expect("write");
        let err = profile_files(&file).expect_err("a file");
        assert!(
            format!("{err:#}").contains("give the session's output directory"),
            "{err:#}"
        );
        assert_eq!(profile_files(dir.path()).expect("listed"), [file]);
        // Its only profile is corrupt: skipped, and then there is nothing to report.
        let err = load(dir.path(), "inuse_space", ProcessFilter::All, |_, _, _| {
            Ok(())
        })
        .expect_err("unreadable");
        assert!(format!("{err:#}").contains("could be read"), "{err:#}");
        let err = load(dir.path(), "alloc_space", ProcessFilter::All, |_, _, _| {
            Ok(())
        })
        .expect_err("not in-use");
        assert!(format!("{err:#}").contains("--sample-index"), "{err:#}");
    }
}
