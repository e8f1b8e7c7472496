//! `--profiles-json FILE`: one JSON line per profile written, appended as each is
//! written, for the programs that would otherwise read the log's `wrote` lines (the
//! benchmark's dump and shutdown timings, the soak, tests). The log keeps saying the
//! same to people; these lines are the interface, and their keys are what must not
//! change.

use std::{
    fs::File,
    io::Write as _,
    path::{Path, PathBuf},
    time::UNIX_EPOCH,
};

use anyhow::{Context as _, Result};
use serde::Serialize;

use crate::session::Written;

/// Why a profile was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// On `--interval`.
    Interval,
    /// The last one, as the session ends.
    Final,
}

/// One line of the file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Record {
    /// The profile's file.
    pub path: PathBuf,
    /// Why it was written.
    pub kind: Kind,
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

impl Record {
    /// The line for `written`, written for `kind`.
    pub fn of(written: &Written, kind: Kind) -> Self {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let contents = &written.contents;
        Record {
            path: written.path.clone(),
            kind,
            unix_time: written
                .at
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
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
}

impl ProfilesFile {
    /// Creates (empties) the file at `path`: a reader never sees an earlier run's lines.
    pub fn create(path: &Path) -> Result<Self> {
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        Ok(ProfilesFile {
            path: path.to_owned(),
            file,
        })
    }

    /// Appends the line of `written` (one `write`, the newline included, so a reader
    /// that takes whole lines only never sees part of one). A failure is logged: the
    /// profile itself was written.
    pub fn append(&mut self, written: &Written, kind: Kind) {
        if let Err(err) = self.try_append(&Record::of(written, kind)) {
            log::warn!("--profiles-json {}: {err:#}", self.path.display());
        }
    }

    fn try_append(&mut self, record: &Record) -> Result<()> {
        let mut line = serde_json::to_vec(record).context("encoding the record")?;
        line.push(b'\n');
        self.file.write_all(&line).context("writing")
    }
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
}
