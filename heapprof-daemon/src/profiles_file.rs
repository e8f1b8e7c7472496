//! `--profiles-json FILE`: one JSON line per profile written, appended as each is
//! written, for the programs that would otherwise read the log's `wrote` lines (the
//! benchmark's dump and shutdown timings, the soak, tests). The log keeps saying the
//! same to people; these lines are the interface, and their keys are what must not
//! change.
//!
//! Every line has a `kind`. `interval` and `final` are profiles written ([`Record`]);
//! two more kinds say, as they happen, what a program watching a session otherwise
//! had to read out of the log's wording: `write_failed`, a profile that could not be
//! written ([`WriteFailure`]), and `image_read`, the mappings of a process's new image
//! read after an exec ([`ImageRead`]). A reader of profiles takes the first two kinds
//! and passes over the others.

use std::{
    fs::File,
    io::Write as _,
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result};
use serde::{Deserialize, Serialize};

pub use crate::session::ImageRead;
use crate::session::Written;

/// Why a profile was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// On `--interval`.
    Interval,
    /// The last one, as the session ends.
    Final,
}

/// One line of the file, told apart by its `kind`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Line {
    /// A profile written on `--interval`.
    Interval(Record),
    /// The last profile, written as the session ended.
    Final(Record),
    /// A profile that could not be written (the session goes on).
    WriteFailed(WriteFailure),
    /// A process's new image read after an exec.
    ImageRead(ImageRead),
}

impl Line {
    /// The profile written, for a line that says one was.
    pub fn written(&self) -> Option<&Record> {
        match self {
            Line::Interval(record) | Line::Final(record) => Some(record),
            Line::WriteFailed(_) | Line::ImageRead(_) => None,
        }
    }
}

/// A profile written (lines of kind `interval` and `final`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// The profile's file.
    pub path: PathBuf,
    /// When the file was in place, in seconds since the Unix epoch (with a fraction).
    pub unix_time: f64,
    /// Its sites (samples).
    pub sites: usize,
    /// Objects allocated since tracing began (estimates when sampled).
    pub allocated_blocks: u64,
    /// Bytes allocated.
    pub allocated_bytes: u64,
    /// Objects in use.
    pub inuse_blocks: u64,
    /// Bytes in use.
    pub inuse_bytes: u64,
    /// The whole dump, in milliseconds: the three stages below.
    pub dump_ms: f64,
    /// Reading the BPF maps and symbolizing.
    pub read_ms: f64,
    /// Building and compressing the profile.
    pub build_ms: f64,
    /// Writing the file.
    pub write_ms: f64,
}

/// A profile that could not be written (kind `write_failed`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WriteFailure {
    /// When the write was given up, in seconds since the Unix epoch.
    pub unix_time: f64,
    /// The session's failed writes so far, this one included.
    pub failures: u64,
    /// Why, as the log says it (for people: a reader keys by the kind, not by this).
    pub error: String,
}

/// Seconds since the Unix epoch at `at`, with a fraction.
fn unix_time(at: SystemTime) -> f64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Record {
    /// The record of `written`.
    pub fn of(written: &Written) -> Self {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let contents = &written.contents;
        Record {
            path: written.path.clone(),
            unix_time: unix_time(written.at),
            sites: contents.sites,
            allocated_blocks: contents.allocated_blocks,
            allocated_bytes: contents.allocated_bytes,
            inuse_blocks: contents.inuse_blocks,
            inuse_bytes: contents.inuse_bytes,
            dump_ms: ms(written.total),
            read_ms: ms(written.read),
            build_ms: ms(written.build),
            write_ms: ms(written.write),
        }
    }
}

/// The open file.
#[derive(Debug)]
pub struct ProfilesFile {
    path: PathBuf,
    file: File,
    /// Profiles not written so far.
    failures: u64,
}

impl ProfilesFile {
    /// Creates (empties) the file at `path`: a reader never sees an earlier run's lines.
    pub fn create(path: &Path) -> Result<Self> {
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        Ok(ProfilesFile {
            path: path.to_owned(),
            file,
            failures: 0,
        })
    }

    /// Appends the line of `written` (one `write`, the newline included, so a reader
    /// that takes whole lines only never sees part of one). A failure is logged: the
    /// profile itself was written.
    pub fn append(&mut self, written: &Written, kind: Kind) {
        let record = Record::of(written);
        self.append_line(&match kind {
            Kind::Interval => Line::Interval(record),
            Kind::Final => Line::Final(record),
        });
    }

    /// Appends the line of a profile that could not be written, for `error`.
    pub fn append_failure(&mut self, error: &anyhow::Error) {
        self.failures += 1;
        self.append_line(&Line::WriteFailed(WriteFailure {
            unix_time: unix_time(SystemTime::now()),
            failures: self.failures,
            error: format!("{error:#}"),
        }));
    }

    /// Appends the line of an image read.
    pub fn append_image_read(&mut self, read: ImageRead) {
        self.append_line(&Line::ImageRead(read));
    }

    fn append_line(&mut self, line: &Line) {
        if let Err(err) = self.try_append(line) {
            log::warn!("--profiles-json {}: {err:#}", self.path.display());
        }
    }

    fn try_append(&mut self, record: &Line) -> Result<()> {
        let mut line = serde_json::to_vec(record).context("encoding the record")?;
        line.push(b'\n');
        self.file.write_all(&line).context("writing")
    }
}

/// Every whole line of the file at `path` (one a writer is still writing, without its
/// newline, is left out), for programs that follow a session.
pub fn read(path: &Path) -> Result<Vec<Line>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let whole = text.rfind('\n').map_or("", |end| &text[..end]);
    whole
        .lines()
        .map(|line| {
            serde_json::from_str(line)
                .with_context(|| format!("{}: a line that is not a record: {line}", path.display()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::session::Contents;

    fn written(path: &str, at_secs: u64) -> Written {
        Written {
            path: PathBuf::from(path),
            at: UNIX_EPOCH + Duration::from_millis(at_secs * 1000 + 250),
            contents: Contents {
                sites: 3,
                allocated_blocks: 10,
                allocated_bytes: 1000,
                inuse_blocks: 4,
                inuse_bytes: 400,
                words: "3 sites".into(),
            },
            total: Duration::from_millis(12),
            read: Duration::from_millis(7),
            build: Duration::from_millis(4),
            write: Duration::from_millis(1),
        }
    }

    #[test]
    fn each_profile_is_one_whole_line_with_its_kind_and_figures() {
        let dir = tempfile::tempdir().expect("scratch");
        let path = dir.path().join("profiles.jsonl");
        std::fs::write(&path, "a line of an earlier run\n").expect("stale file");
        let mut file = ProfilesFile::create(&path).expect("created");
        file.append(&written("/p/heap-1.pb.gz", 100), Kind::Interval);
        file.append(&written("/p/heap-2.pb.gz", 200), Kind::Final);
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(text.ends_with('\n'));
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|line| serde_json::from_str(line).expect("one JSON object a line"))
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(lines[0]["path"], "/p/heap-1.pb.gz");
        assert_eq!(lines[0]["kind"], "interval");
        assert_eq!(lines[1]["kind"], "final");
        assert_eq!(lines[1]["unix_time"], 200.25);
        assert_eq!(lines[0]["sites"], 3);
        assert_eq!(lines[0]["allocated_blocks"], 10);
        assert_eq!(lines[0]["inuse_bytes"], 400);
        assert_eq!(lines[0]["dump_ms"], 12.0);
        assert_eq!(lines[0]["read_ms"], 7.0);
        assert_eq!(lines[0]["build_ms"], 4.0);
        assert_eq!(lines[0]["write_ms"], 1.0);
    }

    #[test]
    fn failed_writes_and_images_read_are_lines_of_their_own_kinds_read_back() {
        let dir = tempfile::tempdir().expect("scratch");
        let path = dir.path().join("profiles.jsonl");
        let mut file = ProfilesFile::create(&path).expect("created");
        file.append_image_read(ImageRead {
            pid: 42,
            exec_generation: 1,
            probed_allocator: true,
        });
        file.append_failure(&anyhow::anyhow!("no space left on device"));
        file.append(&written("/p/heap-1.pb.gz", 100), Kind::Interval);
        file.append_failure(&anyhow::anyhow!("no space left on device"));
        let text = std::fs::read_to_string(&path).expect("read");
        let kinds: Vec<serde_json::Value> = text
            .lines()
            .map(|line| {
                serde_json::from_str::<serde_json::Value>(line).expect("JSON")["kind"].clone()
            })
            .collect();
        assert_eq!(
            kinds,
            ["image_read", "write_failed", "interval", "write_failed"]
        );
        let lines = read(&path).expect("read back");
        assert_eq!(
            lines[0],
            Line::ImageRead(ImageRead {
                pid: 42,
                exec_generation: 1,
                probed_allocator: true
            })
        );
        let failures: Vec<u64> = lines
            .iter()
            .filter_map(|line| match line {
                Line::WriteFailed(failure) => Some(failure.failures),
                _ => None,
            })
            .collect();
        assert_eq!(failures, [1, 2], "each failure counts those before it");
        let written: Vec<&Record> = lines.iter().filter_map(Line::written).collect();
        assert_eq!(written.len(), 1);
        assert_eq!(written[0].path, PathBuf::from("/p/heap-1.pb.gz"));
    }

    #[test]
    fn a_line_still_being_written_is_not_read() {
        let dir = tempfile::tempdir().expect("scratch");
        let path = dir.path().join("profiles.jsonl");
        let mut file = ProfilesFile::create(&path).expect("created");
        file.append(&written("/p/heap-1.pb.gz", 100), Kind::Interval);
        let mut partial = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .expect("open");
        partial.write_all(b"{\"kind\":\"fin").expect("write");
        assert_eq!(read(&path).expect("read").len(), 1);
    }
}
