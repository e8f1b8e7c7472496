//! heapprofd's `--profiles-json` file, read as heapprofd writes it: one JSON line per
//! profile written (the daemon's `profiles_file.rs`), which the benchmark and the
//! soak follow instead of the log's `wrote` lines. Lines of the other kinds are
//! passed over.

use std::{
    io::Read as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use serde::Deserialize;

/// Why heapprofd wrote a profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// On its interval.
    Interval,
    /// The last one, as the session ended.
    Final,
}

/// One profile written: only the figures xtask reads.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Written {
    /// The file.
    pub path: PathBuf,
    /// Why it was written.
    pub kind: Kind,
    /// When the file was in place, in seconds since the Unix epoch.
    pub unix_time: f64,
    /// Its sites.
    pub sites: u64,
    /// Objects allocated since tracing began.
    pub allocated_blocks: u64,
    /// Objects in use.
    pub inuse_blocks: u64,
    /// The whole dump, in milliseconds.
    pub dump_ms: f64,
    /// Its stages: reading the BPF maps and symbolizing,
    pub read_ms: f64,
    /// building and compressing the profile,
    pub build_ms: f64,
    /// writing the file.
    pub write_ms: f64,
}

impl Written {
    /// The dump's times as heapprofd's log gives them: `X ms (read+symbolize A,
    /// build+compress B, write C)`.
    pub fn describe_times(&self) -> String {
        format!(
            "{:.1} ms (read+symbolize {:.1}, build+compress {:.1}, write {:.1})",
            self.dump_ms, self.read_ms, self.build_ms, self.write_ms
        )
    }
}

/// Follows the file at a path: each call to [`Follower::new_lines`] returns the
/// records completed since the last one.
pub struct Follower {
    path: PathBuf,
    /// Bytes read so far, whole lines only.
    consumed: usize,
}

impl Follower {
    /// Follows `path` (which need not exist yet: heapprofd creates it at its start).
    pub fn new(path: &Path) -> Self {
        Follower {
            path: path.to_owned(),
            consumed: 0,
        }
    }

    /// The records written since the last call; none while the file does not exist. A
    /// line still being written is left for the next call.
    pub fn new_lines(&mut self) -> Result<Vec<Written>> {
        let mut bytes = Vec::new();
        match std::fs::File::open(&self.path) {
            Ok(mut file) => {
                file.read_to_end(&mut bytes)
                    .with_context(|| format!("reading {}", self.path.display()))?;
            }
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(err) => {
                return Err(err).with_context(|| format!("opening {}", self.path.display()));
            }
        }
        let fresh = bytes.get(self.consumed..).unwrap_or_default();
        let whole = fresh.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let records =
            parse(&fresh[..whole]).with_context(|| format!("reading {}", self.path.display()))?;
        self.consumed += whole;
        Ok(records)
    }
}

/// The kinds of line that are profiles written; heapprofd writes lines of other kinds
/// too (a failed write, an image read), which xtask does not follow.
const PROFILE_KINDS: [&str; 2] = ["interval", "final"];

/// Any line's kind.
#[derive(Deserialize)]
struct LineKind {
    kind: String,
}

/// Every profile's record of a whole file's contents.
fn parse(text: &[u8]) -> Result<Vec<Written>> {
    let mut records = Vec::new();
    for line in text.split(|&b| b == b'\n').filter(|line| !line.is_empty()) {
        let LineKind { kind } =
            serde_json::from_slice(line).context("a line that is not a JSON object of a kind")?;
        if PROFILE_KINDS.contains(&kind.as_str()) {
            records.push(
                serde_json::from_slice(line).context("a line that is not a profile's record")?,
            );
        }
    }
    Ok(records)
}

/// Every record of the file at `path` (heapprofd has exited).
pub fn read(path: &Path) -> Result<Vec<Written>> {
    let bytes = std::fs::read(path).with_context(|| {
        format!(
            "heapprofd wrote no --profiles-json {} (was it given the flag?)",
            path.display()
        )
    })?;
    parse(&bytes).with_context(|| format!("reading {}", path.display()))
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    /// A line as heapprofd writes it, with more keys than xtask reads.
    fn line(path: &str, kind: &str, sites: u64) -> String {
        format!(
            "{{\"path\":\"{path}\",\"kind\":\"{kind}\",\"unix_time\":1790000000.5,\"sites\":{sites},\
             \"allocated_blocks\":10,\"allocated_bytes\":100,\"inuse_blocks\":4,\"inuse_bytes\":40,\
             \"dump_ms\":12.34,\"read_ms\":7.0,\"build_ms\":4.0,\"write_ms\":1.26}}\n"
        )
    }

    #[test]
    fn whole_lines_are_taken_as_they_come_and_a_partial_one_waits() {
        let dir = std::env::temp_dir().join(format!("xtask-profiles-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let path = dir.join("profiles.jsonl");
        let _ = std::fs::remove_file(&path);
        let mut follower = Follower::new(&path);
        assert!(follower.new_lines().expect("no file yet").is_empty());

        let mut file = std::fs::File::create(&path).expect("created");
        let first = line("/p/1.pb.gz", "interval", 64);
        let second = line("/p/2.pb.gz", "final", 65);
        let (head, tail) = second.split_at(20);
        file.write_all(first.as_bytes()).expect("write");
        file.write_all(head.as_bytes()).expect("write");
        let records = follower.new_lines().expect("one whole line");
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].path, Path::new("/p/1.pb.gz"));
        assert_eq!(records[0].kind, Kind::Interval);
        assert_eq!(records[0].sites, 64);
        assert_eq!(records[0].inuse_blocks, 4);
        assert_eq!(
            records[0].describe_times(),
            "12.3 ms (read+symbolize 7.0, build+compress 4.0, write 1.3)"
        );
        file.write_all(tail.as_bytes()).expect("write");
        let records = follower.new_lines().expect("the rest");
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].kind, Kind::Final);
        assert_eq!(records[0].unix_time, 1_790_000_000.5);
        assert!(follower.new_lines().expect("nothing new").is_empty());
        assert_eq!(read(&path).expect("whole file").len(), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn lines_of_other_kinds_are_passed_over() {
        let text = [
            "{\"kind\":\"image_read\",\"pid\":7,\"exec_generation\":1,\"probed_allocator\":true}\n"
                .to_owned(),
            line("/p/1.pb.gz", "interval", 3),
            "{\"kind\":\"write_failed\",\"unix_time\":1.0,\"failures\":1,\"error\":\"full\"}\n"
                .to_owned(),
            line("/p/2.pb.gz", "final", 4),
        ]
        .concat();
        let records = parse(text.as_bytes()).expect("parsed");
        let kinds: Vec<Kind> = records.iter().map(|r| r.kind).collect();
        assert_eq!(kinds, [Kind::Interval, Kind::Final]);
    }
}
