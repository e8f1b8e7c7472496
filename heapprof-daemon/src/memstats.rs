//! Memory figures recorded beside the heap in every profile: each process's RSS,
//! heap segment and page faults, and in kernel mode the slab totals.
//!
//! They travel as profile comments, one line per process, so that `go tool pprof`
//! keeps reading the files and `heapprofd report` can plot heap against RSS (the gap
//! is fragmentation and memory malloc never sees). The line formats are defined here
//! only, for both the writer and the reader.

use std::{fmt::Write as _, fs, io};

/// The first word of a process memory comment.
const PROCESS_TAG: &str = "process-memory";
/// The first word of a kernel memory comment.
const KERNEL_TAG: &str = "kernel-memory";

/// One process's memory at the time of a profile, in bytes and fault counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessMemory {
    /// Process id.
    pub pid: u32,
    /// Command name (`/proc/PID/comm`).
    pub comm: String,
    /// Resident set size (`VmRSS`).
    pub vm_rss: u64,
    /// Resident anonymous memory (`RssAnon`): the heap, stacks and anonymous mmaps.
    pub rss_anon: u64,
    /// Size of the `[heap]` segment (brk area); 0 when the allocator uses none.
    pub heap: u64,
    /// Minor page faults since the process started.
    pub minor_faults: u64,
    /// Major page faults since the process started.
    pub major_faults: u64,
    /// The highest in-use bytes heapprofd saw in the process (exact mode).
    pub peak_inuse: Option<u64>,
}

impl ProcessMemory {
    /// Reads the figures of a live process from `/proc`.
    pub fn read(pid: u32) -> io::Result<Self> {
        let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
        let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
        let maps = fs::read_to_string(format!("/proc/{pid}/maps"))?;
        let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        let (minor_faults, major_faults) = parse_faults(&stat).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidData, "unexpected /proc/PID/stat")
        })?;
        Ok(Self {
            pid,
            comm: comm.trim_end().to_owned(),
            vm_rss: status_kib(&status, "VmRSS:").unwrap_or(0) * 1024,
            rss_anon: status_kib(&status, "RssAnon:").unwrap_or(0) * 1024,
            heap: heap_segment(&maps),
            minor_faults,
            major_faults,
            peak_inuse: None,
        })
    }

    /// The comment line carrying these figures.
    pub fn to_comment(&self) -> String {
        let mut line = format!(
            "{PROCESS_TAG} pid={} vm_rss={} rss_anon={} heap={} minflt={} majflt={}",
            self.pid, self.vm_rss, self.rss_anon, self.heap, self.minor_faults, self.major_faults
        );
        if let Some(peak) = self.peak_inuse {
            let _ = write!(line, " peak_inuse={peak}");
        }
        // Last, because a command name may hold spaces.
        let _ = write!(line, " comm={}", self.comm);
        line
    }

    /// Parses a line written by [`ProcessMemory::to_comment`]; `None` for any other line.
    pub fn parse_comment(line: &str) -> Option<Self> {
        let rest = line.strip_prefix(PROCESS_TAG)?.strip_prefix(' ')?;
        let (fields, comm) = match rest.split_once(" comm=") {
            Some((fields, comm)) => (fields, comm),
            None => (rest, ""),
        };
        let mut memory = Self {
            comm: comm.to_owned(),
            ..Self::default()
        };
        for field in fields.split(' ') {
            let (key, value) = field.split_once('=')?;
            let value: u64 = value.parse().ok()?;
            match key {
                "pid" => memory.pid = u32::try_from(value).ok()?,
                "vm_rss" => memory.vm_rss = value,
                "rss_anon" => memory.rss_anon = value,
                "heap" => memory.heap = value,
                "minflt" => memory.minor_faults = value,
                "majflt" => memory.major_faults = value,
                "peak_inuse" => memory.peak_inuse = Some(value),
                _ => {} // Fields added later are skipped by older readers.
            }
        }
        Some(memory)
    }
}

/// The kernel's slab memory at the time of a kernel-mode profile, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelMemory {
    /// `Slab` in `/proc/meminfo`.
    pub slab: u64,
    /// `SUnreclaim` in `/proc/meminfo`: slab memory that cannot be reclaimed.
    pub slab_unreclaimable: u64,
}

impl KernelMemory {
    /// Reads `/proc/meminfo`.
    pub fn read() -> io::Result<Self> {
        let meminfo = fs::read_to_string("/proc/meminfo")?;
        Ok(Self {
            slab: status_kib(&meminfo, "Slab:").unwrap_or(0) * 1024,
            slab_unreclaimable: status_kib(&meminfo, "SUnreclaim:").unwrap_or(0) * 1024,
        })
    }

    /// The comment line carrying these figures.
    pub fn to_comment(&self) -> String {
        format!(
            "{KERNEL_TAG} slab={} sunreclaim={}",
            self.slab, self.slab_unreclaimable
        )
    }

    /// Parses a line written by [`KernelMemory::to_comment`]; `None` for any other line.
    pub fn parse_comment(line: &str) -> Option<Self> {
        let rest = line.strip_prefix(KERNEL_TAG)?.strip_prefix(' ')?;
        let mut memory = Self::default();
        for field in rest.split(' ') {
            let (key, value) = field.split_once('=')?;
            let value: u64 = value.parse().ok()?;
            match key {
                "slab" => memory.slab = value,
                "sunreclaim" => memory.slab_unreclaimable = value,
                _ => {}
            }
        }
        Some(memory)
    }
}

/// A `Key:   N kB` line of `/proc/PID/status` or `/proc/meminfo`, in KiB.
fn status_kib(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// Minor and major faults: fields 10 and 12 of `/proc/PID/stat`, counted after the
/// command name, which is in parentheses and may hold spaces and parentheses.
fn parse_faults(stat: &str) -> Option<(u64, u64)> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // after_comm starts at field 3 (state).
    let minor = fields.get(10 - 3)?.parse().ok()?;
    let major = fields.get(12 - 3)?.parse().ok()?;
    Some((minor, major))
}

/// The size of the `[heap]` mapping in a maps file.
fn heap_segment(maps: &str) -> u64 {
    maps.lines()
        .filter(|line| line.ends_with("[heap]"))
        .filter_map(|line| {
            let range = line.split_whitespace().next()?;
            let (start, end) = range.split_once('-')?;
            let start = u64::from_str_radix(start, 16).ok()?;
            let end = u64::from_str_radix(end, 16).ok()?;
            end.checked_sub(start)
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_comments_round_trip() {
        let memory = ProcessMemory {
            pid: 42,
            comm: "my (odd) prog".into(),
            vm_rss: 1 << 20,
            rss_anon: 1 << 19,
            heap: 135_168,
            minor_faults: 300,
            major_faults: 2,
            peak_inuse: Some(65_536),
        };
        let line = memory.to_comment();
        assert_eq!(ProcessMemory::parse_comment(&line), Some(memory.clone()));
        let without_peak = ProcessMemory {
            peak_inuse: None,
            ..memory
        };
        assert_eq!(
            ProcessMemory::parse_comment(&without_peak.to_comment()),
            Some(without_peak)
        );
        assert_eq!(ProcessMemory::parse_comment("target: pid 4"), None);
        let kernel = KernelMemory {
            slab: 10,
            slab_unreclaimable: 4,
        };
        assert_eq!(
            KernelMemory::parse_comment(&kernel.to_comment()),
            Some(kernel)
        );
    }

    #[test]
    fn reads_this_process() {
        let memory = ProcessMemory::read(std::process::id()).expect("own /proc");
        assert!(memory.vm_rss > 0 && memory.rss_anon > 0, "{memory:?}");
        assert!(memory.minor_faults > 0, "{memory:?}");
        assert!(!memory.comm.is_empty());
    }

    #[test]
    fn faults_are_counted_after_the_command_name() {
        let stat = "77 (a) b (c) S 1 77 77 0 -1 4194560 1234 0 5 0 0 0";
        assert_eq!(parse_faults(stat), Some((1234, 5)));
        let maps = "55d0a0000000-55d0a0021000 rw-p 00000000 00:00 0   [heap]\n";
        assert_eq!(heap_segment(maps), 0x21000);
    }
}
