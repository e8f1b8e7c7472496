//! `cargo xtask soak --minutes N [--all]`: heapprofd under a churn workload for a long
//! time.
//!
//! With `--all`, processes come and go instead: a shell in a cgroup of its own starts
//! two short churn processes at a time, one after another, for the whole soak, and
//! heapprofd traces that cgroup with `--all --cgroup` and `--retain-exited`, which must
//! keep its memory flat although it sees hundreds of processes.
//!
//! The workload (heapprof-daemon/tests/programs/load.c, `churn`) replaces blocks of a
//! fixed pool through 64 call stacks in threads that come and go, so everything the
//! daemon tracks is bounded: its memory must be too. Each interval profile's line in
//! heapprofd's `--profiles-json` gives the table occupancy (sites; live blocks =
//! blocks in use), and the daemon's resident memory is read as soon as it appears. The verdict is on its anonymous memory
//! (heap and stacks): resident file pages also grow as symbolization touches more of
//! the mapped ELF files, and the kernel can drop them again at will, so they say
//! nothing of a leak (they are reported beside it). It compares the last quarter
//! with the second (the first is warm-up).

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{
    is_root,
    profiles_json::{Follower, Kind, Written},
    step, workspace_root,
};

/// Growth of the resident memory still called flat: the larger of these.
const FLAT_BYTES: u64 = 1 << 20;
const FLAT_FRACTION: f64 = 0.05;

/// One interval's reading.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Sample {
    seconds: f64,
    /// Anonymous resident memory (RssAnon), the verdict's measure.
    rss_kib: u64,
    /// All resident memory (VmRSS), file pages included.
    total_rss_kib: u64,
    sites: u64,
    allocated: u64,
    live_blocks: u64,
    dump_ms: f64,
}

impl Sample {
    /// The reading at the interval profile `written` of heapprofd, process `pid`,
    /// `started` when the soak did: the profile's figures and the memory heapprofd
    /// has now.
    fn read(pid: u32, started: Instant, written: &Written) -> Self {
        Sample {
            seconds: started.elapsed().as_secs_f64(),
            rss_kib: status_kib(pid, "RssAnon:"),
            total_rss_kib: status_kib(pid, "VmRSS:"),
            sites: written.sites,
            allocated: written.allocated_blocks,
            live_blocks: written.inuse_blocks,
            dump_ms: written.dump_ms,
        }
    }

    /// Logs the reading's line.
    fn log(&self) {
        eprintln!(
            "xtask: soak {:>7.1} s: heapprofd anonymous RSS {:>6} KiB (all {:>6} KiB), {} sites, {} live blocks, {} allocations counted, dump {:.1} ms",
            self.seconds,
            self.rss_kib,
            self.total_rss_kib,
            self.sites,
            self.live_blocks,
            self.allocated,
            self.dump_ms
        );
    }
}

/// A memory figure of `/proc/PID/status` in KiB (`field` with its colon).
fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

fn median(mut values: Vec<u64>) -> u64 {
    values.sort_unstable();
    values.get(values.len() / 2).copied().unwrap_or(0)
}

/// The verdict: (median RSS of the second quarter, of the last quarter, flat?).
fn verdict(samples: &[Sample]) -> (u64, u64, bool) {
    let quarter = (samples.len() / 4).max(1);
    let second: Vec<u64> = samples
        .iter()
        .skip(quarter)
        .take(quarter)
        .map(|s| s.rss_kib)
        .collect();
    let last: Vec<u64> = samples
        .iter()
        .skip(samples.len().saturating_sub(quarter))
        .map(|s| s.rss_kib)
        .collect();
    let (early, late) = (median(second), median(last));
    let allowed_kib = (FLAT_BYTES / 1024).max((early as f64 * FLAT_FRACTION) as u64);
    (early, late, late <= early + allowed_kib)
}

/// Where the cgroup v2 hierarchy is mounted (`/sys/fs/cgroup`, or its `unified`
/// directory in a hybrid layout).
fn cgroup2_mount() -> Option<std::path::PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().find_map(|line| {
        let (before, after) = line.split_once(" - ")?;
        (after.split_whitespace().next()? == "cgroup2").then(|| {
            before
                .split_whitespace()
                .nth(4)
                .map(std::path::PathBuf::from)
        })?
    })
}

/// The `--all` soak's workload: a cgroup, and a shell in it starting short churn
/// processes for as long as it lives. Both go when dropped.
struct ComingAndGoing {
    cgroup: std::path::PathBuf,
    shell: std::process::Child,
}

impl ComingAndGoing {
    fn start(workload: &Path) -> Result<(Self, String)> {
        let mount = cgroup2_mount().context("no cgroup v2 hierarchy is mounted")?;
        let name = format!("heapprofd-soak-{}", std::process::id());
        let cgroup = mount.join(&name);
        std::fs::create_dir(&cgroup)
            .with_context(|| format!("creating the cgroup {}", cgroup.display()))?;
        let load = workload.display();
        let script = format!(
            "echo $$ > {}/cgroup.procs && while :; do {load} churn 1 & {load} churn 1; wait; done",
            cgroup.display()
        );
        let shell = Command::new("sh")
            .args(["-c", &script])
            .stdout(Stdio::null())
            .spawn()
            .context("starting the workload's shell")?;
        Ok((Self { cgroup, shell }, format!("/{name}")))
    }
}

impl Drop for ComingAndGoing {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.shell.id() as i32, libc::SIGKILL) };
        let _ = self.shell.wait();
        if let Ok(procs) = std::fs::read_to_string(self.cgroup.join("cgroup.procs")) {
            for pid in procs
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
            {
                // SAFETY: kill(2); the cgroup holds only the workload's processes.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        for _ in 0..50 {
            if std::fs::remove_dir(&self.cgroup).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// Runs the soak for `minutes` with `heapprofd`; writes target/soak/soak.{txt,csv}.
/// `all`: processes coming and going under `--all` (see the module documentation).
pub fn soak(heapprofd: &Path, minutes: u32, all: bool) -> Result<()> {
    if !is_root() {
        bail!("the soak loads BPF programs: run it as root (sudo -E cargo xtask soak)");
    }
    if minutes == 0 {
        bail!("--minutes must be at least 1");
    }
    let root = workspace_root();
    let out = root.join("target/soak");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let workload = compile_workload(&root, &out)?;
    let schedule = Schedule::new(minutes);
    let profiles = out.join("profiles.jsonl");
    let mut command = Command::new(heapprofd);
    command
        .args(["--interval", &format!("{}s", schedule.interval), "-o"])
        .arg(out.join("profiles"))
        .arg("--profiles-json")
        .arg(&profiles);
    let _coming_and_going = add_workload(&mut command, &workload, &schedule, all)?;
    let log_path = out.join("heapprofd.log");
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let mut daemon = command
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", heapprofd.display()))?;
    let (status, samples) = follow(&mut daemon, &profiles)?;
    if !status.success() {
        bail!("heapprofd failed ({status}); its log is in target/soak/heapprofd.log");
    }
    if samples.len() < 4 {
        bail!("only {} interval readings: soak longer", samples.len());
    }
    write_csv(&out.join("soak.csv"), &samples)?;
    let (early, late, flat) = verdict(&samples);
    let summary = summary(&samples, minutes, all, (early, late, flat));
    std::fs::write(out.join("soak.txt"), &summary)?;
    print!("{summary}");
    if !flat {
        bail!("heapprofd's memory grew from {early} KiB to {late} KiB under a bounded workload");
    }
    Ok(())
}

/// Compiles the churn workload (heapprof-daemon/tests/programs/load.c) into
/// `out/load`; returns its path.
fn compile_workload(root: &Path, out: &Path) -> Result<PathBuf> {
    let workload = out.join("load");
    let status = Command::new("gcc")
        .args(["-O2", "-g", "-fno-omit-frame-pointer", "-pthread", "-o"])
        .arg(&workload)
        .arg(root.join("heapprof-daemon/tests/programs/load.c"))
        .status()
        .context("running gcc")?;
    if !status.success() {
        bail!("compiling load.c failed");
    }
    Ok(workload)
}

/// How long the soak runs and how often heapprofd writes a profile.
struct Schedule {
    minutes: u32,
    /// Seconds between interval profiles.
    interval: u64,
    /// The soak's length in seconds.
    seconds: u64,
}

impl Schedule {
    /// The schedule of a soak of `minutes`.
    fn new(minutes: u32) -> Self {
        // About 60 readings, at most one a second and at least one every 30 s.
        let interval = (u64::from(minutes)).clamp(1, 30);
        let seconds = u64::from(minutes) * 60;
        Self {
            minutes,
            interval,
            seconds,
        }
    }
}

/// Adds what heapprofd traces to its `command`: with `all`, the cgroup of processes
/// coming and going, started here and returned (it lives as long as the soak
/// holds it); otherwise the `workload` as heapprofd's command.
fn add_workload(
    command: &mut Command,
    workload: &Path,
    schedule: &Schedule,
    all: bool,
) -> Result<Option<ComingAndGoing>> {
    let Schedule {
        minutes,
        interval,
        seconds,
    } = *schedule;
    if all {
        step(&format!(
            "soak: {minutes} min of processes coming and going under heapprofd --all \
             --retain-exited, a profile every {interval} s"
        ));
        let (coming_and_going, cgroup) = ComingAndGoing::start(workload)?;
        command.args([
            "--all",
            "--cgroup",
            &cgroup,
            "--retain-exited",
            &format!("{interval}s"),
            "--duration",
            &format!("{seconds}s"),
        ]);
        Ok(Some(coming_and_going))
    } else {
        step(&format!(
            "soak: {minutes} min of churn under heapprofd, a profile every {interval} s"
        ));
        command
            .arg("--")
            .arg(workload)
            .args(["churn", &seconds.to_string()]);
        Ok(None)
    }
}

/// Follows the running `daemon`'s `profiles` (its `--profiles-json`) until it exits,
/// taking a [`Sample`] at each interval profile; returns its exit status and the
/// samples.
fn follow(daemon: &mut Child, profiles: &Path) -> Result<(ExitStatus, Vec<Sample>)> {
    let pid = daemon.id();
    let started = Instant::now();
    let mut follower = Follower::new(profiles);
    let mut samples = Vec::new();
    let status = loop {
        let exited = daemon.try_wait().context("waiting for heapprofd")?;
        for written in follower.new_lines()? {
            // The final profile is taken after the workload's exit: not a steady-state
            // reading. A line found only once heapprofd is gone has no memory to read.
            if written.kind != Kind::Interval || exited.is_some() {
                continue;
            }
            let sample = Sample::read(pid, started, &written);
            sample.log();
            samples.push(sample);
        }
        if let Some(status) = exited {
            break status;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    Ok((status, samples))
}

/// Writes the samples as CSV to `path`.
fn write_csv(path: &Path, samples: &[Sample]) -> Result<()> {
    let mut csv =
        String::from("seconds,anon_rss_kib,rss_kib,sites,live_blocks,allocations,dump_ms\n");
    for s in samples {
        let _ = writeln!(
            csv,
            "{:.1},{},{},{},{},{},{:.1}",
            s.seconds, s.rss_kib, s.total_rss_kib, s.sites, s.live_blocks, s.allocated, s.dump_ms
        );
    }
    std::fs::write(path, csv)?;
    Ok(())
}

/// The soak's summary (soak.txt) from its `samples` and their [`verdict`].
fn summary(samples: &[Sample], minutes: u32, all: bool, verdict: (u64, u64, bool)) -> String {
    let (early, late, flat) = verdict;
    let max_rss = samples.iter().map(|s| s.rss_kib).max().unwrap_or(0);
    let first_total = samples.first().map_or(0, |s| s.total_rss_kib);
    let last_total = samples.last().map_or(0, |s| s.total_rss_kib);
    let max_sites = samples.iter().map(|s| s.sites).max().unwrap_or(0);
    let max_live = samples.iter().map(|s| s.live_blocks).max().unwrap_or(0);
    let total = samples.last().map_or(0, |s| s.allocated);
    let what = if all {
        "processes coming and going under --all --retain-exited"
    } else {
        "churn in one process"
    };
    format!(
        "soak ({what}): {minutes} min, {} readings, {total} allocations counted\n\
         heapprofd anonymous RSS: median {early} KiB in the second quarter, {late} KiB in the last, max {max_rss} KiB: {}\n\
         heapprofd RSS with file pages: {first_total} KiB at the first reading, {last_total} KiB at the last\n\
         tables: at most {max_sites} sites (of 65536) and {max_live} live blocks (of the live table's capacity)\n\
         readings: target/soak/soak.csv\n",
        samples.len(),
        if flat { "flat" } else { "GROWING" },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_beyond_the_margin_is_not_flat() {
        let at = |rss_kib| Sample {
            rss_kib,
            ..Sample::default()
        };
        let flat: Vec<Sample> = [9000, 20000, 20100, 20000, 20300, 20200, 20100, 20400]
            .into_iter()
            .map(at)
            .collect();
        assert!(verdict(&flat).2);
        let growing: Vec<Sample> = [9000, 20000, 20000, 22000, 24000, 26000, 28000, 30000]
            .into_iter()
            .map(at)
            .collect();
        assert!(!verdict(&growing).2);
    }
}
