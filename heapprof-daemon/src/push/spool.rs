//! The uploads waiting for a backend, oldest first, bounded in bytes: on disk with
//! `--push-spool` (they survive a restart of heapprofd), in memory otherwise. When an
//! upload does not fit, the oldest are dropped until it does, and counted.
//!
//! On disk each upload is one file, `NNNNNNNNNNNNNNNN.upload` (a sequence number, so
//! that name order is arrival order): one JSON line (series, times) then the gzip'd
//! pprof. It is written beside its name and renamed, so a crash leaves whole files.

use std::{
    collections::VecDeque,
    io::Write as _,
    os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::series::{Series, Upload};

/// Suffix of a spooled upload's file.
const SUFFIX: &str = ".upload";

/// A spool that cannot be used.
#[derive(Debug, Error)]
pub enum SpoolError {
    /// The directory cannot be created or read.
    #[error("push spool {dir}: {err}")]
    Directory {
        /// The directory.
        dir: PathBuf,
        /// Why.
        err: std::io::Error,
    },
    /// An upload cannot be written or read.
    #[error("push spool file {path}: {err}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        err: std::io::Error,
    },
}

/// The first line of a spooled upload's file.
#[derive(Debug, Serialize, Deserialize)]
struct Header {
    series: Series,
    time_nanos: i64,
    duration_nanos: i64,
}

/// One waiting upload: in memory, or the number of its file.
#[derive(Debug)]
enum Entry {
    Memory(Upload),
    Disk { sequence: u64, size: u64 },
}

/// The waiting uploads.
#[derive(Debug)]
pub struct Spool {
    dir: Option<PathBuf>,
    entries: VecDeque<Entry>,
    /// Bytes the entries take (their files' sizes, or their pprofs' in memory).
    bytes: u64,
    cap: u64,
    next_sequence: u64,
}

impl Spool {
    /// A spool in memory of at most `cap` bytes.
    pub fn in_memory(cap: u64) -> Self {
        Spool {
            dir: None,
            entries: VecDeque::new(),
            bytes: 0,
            cap,
            next_sequence: 0,
        }
    }

    /// The spool in `dir` (created with mode 0700 if missing) of at most `cap` bytes,
    /// with the uploads an earlier run left there.
    pub fn on_disk(dir: &Path, cap: u64) -> Result<Self, SpoolError> {
        let dir_error = |err| SpoolError::Directory {
            dir: dir.to_owned(),
            err,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(dir_error)?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(dir_error)? {
            let entry = entry.map_err(dir_error)?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if let Some(sequence) = name
                .strip_suffix(SUFFIX)
                .and_then(|n| u64::from_str_radix(n, 16).ok())
            {
                let size = entry.metadata().map_or(0, |m| m.len());
                found.push((sequence, size));
            } else if name.ends_with(".partial") {
                // A write cut short by a crash: never whole, never renamed.
                let _ = std::fs::remove_file(entry.path());
            }
        }
        found.sort_unstable();
        let mut spool = Spool {
            dir: Some(dir.to_owned()),
            entries: VecDeque::new(),
            bytes: 0,
            cap,
            next_sequence: found.last().map_or(0, |&(sequence, _)| sequence + 1),
        };
        for (sequence, size) in found {
            spool.bytes += size;
            spool.entries.push_back(Entry::Disk { sequence, size });
        }
        Ok(spool)
    }

    /// Uploads waiting.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes they take.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether the uploads outlive heapprofd.
    pub fn is_on_disk(&self) -> bool {
        self.dir.is_some()
    }

    /// Adds `upload` last, dropping the oldest uploads to make room; returns how many
    /// were dropped (the upload itself when it alone is over the cap).
    pub fn push(&mut self, upload: Upload) -> Result<u64, SpoolError> {
        let mut dropped = 0;
        let entry = match &self.dir {
            None => Entry::Memory(upload),
            Some(dir) => {
                let sequence = self.next_sequence;
                self.next_sequence += 1;
                let size = write_file(&file_path(dir, sequence), &upload)?;
                Entry::Disk { sequence, size }
            }
        };
        let size = entry_size(&entry);
        if size > self.cap {
            self.remove(entry);
            return Ok(1);
        }
        while self.bytes + size > self.cap && self.pop_front() {
            dropped += 1;
        }
        self.bytes += size;
        self.entries.push_back(entry);
        Ok(dropped)
    }

    /// The oldest upload, read back; `None` when none waits. A file that cannot be
    /// read back is dropped (and returned as the error, for the log and the count).
    pub fn front(&mut self) -> Option<Result<Upload, SpoolError>> {
        let upload = match self.entries.front()? {
            // A clone shares the profile's bytes.
            Entry::Memory(upload) => Ok(upload.clone()),
            Entry::Disk { sequence, .. } => {
                let dir = self.dir.as_deref()?;
                let result = read_file(&file_path(dir, *sequence));
                if result.is_err() {
                    self.pop_front();
                }
                result
            }
        };
        Some(upload)
    }

    /// Removes the oldest upload (sent, or dropped); false when none waits.
    pub fn pop_front(&mut self) -> bool {
        match self.entries.pop_front() {
            Some(entry) => {
                self.bytes -= entry_size(&entry);
                self.remove(entry);
                true
            }
            None => false,
        }
    }

    fn remove(&self, entry: Entry) {
        if let (Entry::Disk { sequence, .. }, Some(dir)) = (entry, &self.dir) {
            let _ = std::fs::remove_file(file_path(dir, sequence));
        }
    }
}

fn entry_size(entry: &Entry) -> u64 {
    match entry {
        Entry::Memory(upload) => upload.pprof_gz.len() as u64,
        Entry::Disk { size, .. } => *size,
    }
}

fn file_path(dir: &Path, sequence: u64) -> PathBuf {
    dir.join(format!("{sequence:016x}{SUFFIX}"))
}

/// Writes `upload` whole at `path`; returns the file's size.
fn write_file(path: &Path, upload: &Upload) -> Result<u64, SpoolError> {
    let file_error = |err| SpoolError::File {
        path: path.to_owned(),
        err,
    };
    let header = Header {
        series: upload.series.clone(),
        time_nanos: upload.time_nanos,
        duration_nanos: upload.duration_nanos,
    };
    let mut header = serde_json::to_vec(&header).map_err(|err| file_error(err.into()))?;
    header.push(b'\n');
    let partial = path.with_extension("partial");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&partial)
        .map_err(file_error)?;
    // The header, then the profile as shared: no copy of it is made.
    let written = file
        .write_all(&header)
        .and_then(|()| file.write_all(&upload.pprof_gz))
        .and_then(|()| file.sync_data());
    drop(file);
    if let Err(err) = written.and_then(|()| std::fs::rename(&partial, path)) {
        let _ = std::fs::remove_file(&partial);
        return Err(file_error(err));
    }
    Ok((header.len() + upload.pprof_gz.len()) as u64)
}

fn read_file(path: &Path) -> Result<Upload, SpoolError> {
    let file_error = |err| SpoolError::File {
        path: path.to_owned(),
        err,
    };
    let bytes = Bytes::from(std::fs::read(path).map_err(file_error)?);
    let split = bytes
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| file_error(std::io::Error::other("no header line")))?;
    let header: Header =
        serde_json::from_slice(&bytes[..split]).map_err(|err| file_error(err.into()))?;
    Ok(Upload {
        series: header.series,
        time_nanos: header.time_nanos,
        duration_nanos: header.duration_nanos,
        pprof_gz: bytes.slice(split + 1..),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upload(n: u8, size: usize) -> Upload {
        Upload {
            series: Series {
                service_name: format!("s{n}"),
                labels: vec![("pid".into(), n.to_string())],
            },
            time_nanos: i64::from(n),
            duration_nanos: 1,
            pprof_gz: Bytes::from(vec![n; size]),
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("heapprofd-spool-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn uploads_come_back_in_order_and_across_a_restart() {
        let dir = scratch("order");
        let mut spool = Spool::on_disk(&dir, 1 << 20).expect("spool");
        for n in 0..3 {
            assert_eq!(spool.push(upload(n, 100)).expect("pushed"), 0);
        }
        assert_eq!(
            spool.front().expect("one").expect("readable"),
            upload(0, 100)
        );
        assert!(spool.pop_front());
        drop(spool);
        let mut spool = Spool::on_disk(&dir, 1 << 20).expect("reopened");
        assert_eq!(spool.len(), 2);
        assert_eq!(
            spool.front().expect("one").expect("readable"),
            upload(1, 100)
        );
        spool.push(upload(3, 100)).expect("pushed");
        let mut order = Vec::new();
        while let Some(next) = spool.front() {
            order.push(next.expect("readable").time_nanos);
            spool.pop_front();
        }
        assert_eq!(order, [1, 2, 3]);
        assert_eq!(spool.bytes(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_cap_drops_the_oldest_first() {
        let dir = scratch("cap");
        let mut disk = Spool::on_disk(&dir, 1000).expect("spool");
        let mut memory = Spool::in_memory(250);
        let mut dropped = (0, 0);
        for n in 0..10 {
            dropped.0 += disk.push(upload(n, 200)).expect("pushed");
            dropped.1 += memory.push(upload(n, 100)).expect("pushed");
            assert!(disk.bytes() <= 1000 && memory.bytes() <= 250);
        }
        assert_eq!(memory.len(), 2);
        assert_eq!(dropped.1, 8);
        assert_eq!(dropped.0 + disk.len() as u64, 10);
        assert_eq!(
            disk.front().expect("one").expect("readable").time_nanos,
            10 - disk.len() as i64
        );
        assert_eq!(
            std::fs::read_dir(&dir).expect("dir").count(),
            disk.len(),
            "dropped uploads leave the disk"
        );
        assert_eq!(memory.push(upload(99, 300)).expect("pushed"), 1, "too big");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
