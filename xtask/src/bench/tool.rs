//! The tool under test in one run of a workload: the bpftrace baselines or heapprofd,
//! started on the workload's process, waited for until its probes are on, and its
//! figures read once the workload has ended.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc::Receiver,
};

use anyhow::{Context as _, Result, bail};

use super::{
    Bench, Mode, Run,
    baselines::{empty_probes_script, memleak_script},
    figures::DaemonStats,
    process::{interrupt, libc_of, lines_of, wait_for_line, wait_until_ready, wait_with_usage},
    ready_file,
};

/// A tool attached to a workload and ready: its process, its output's lines and the
/// lines read so far.
pub(super) struct Tool {
    child: Child,
    lines: Receiver<String>,
    log: Vec<String>,
}

impl Tool {
    /// Starts the tool of `mode` on `pid`: `None` for bare runs, bpftrace with the
    /// mode's script, or heapprofd writing its figures to `stats`.
    pub(super) fn spawn(
        bench: &Bench,
        mode: Mode,
        pid: u32,
        stats: &Path,
    ) -> Result<Option<Child>> {
        let child = match mode.heapprofd_flags() {
            None if mode == Mode::Bare => return Ok(None),
            None => {
                let libc = libc_of(pid)?;
                let script = if mode == Mode::EmptyProbes {
                    empty_probes_script(&libc)
                } else {
                    memleak_script(&libc)
                };
                Command::new("bpftrace")
                    .args(["-p", &pid.to_string(), "-e", &script])
                    .env("BPFTRACE_MAP_KEYS_MAX", "1048576")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .context("starting bpftrace")?
            }
            Some(flags) => bench
                .heapprofd_command(flags, pid, stats)
                .spawn()
                .context("starting heapprofd")?,
        };
        Ok(Some(child))
    }

    /// Reads `child`'s output and waits until it is ready (bpftrace's "ready" line,
    /// heapprofd's ready file beside `stats`). When it never gets ready, the workload
    /// `target` waiting for it is killed.
    pub(super) fn attach(
        mut child: Child,
        mode: Mode,
        stats: &Path,
        target: &mut Child,
    ) -> Result<Tool> {
        let lines = match (child.stdout.take(), child.stderr.take()) {
            (Some(out), _) => lines_of(out),
            (None, Some(err)) => lines_of(err),
            (None, None) => bail!("no output from the tool"),
        };
        let mut log = Vec::new();
        let ready = if mode.is_bpftrace() {
            wait_for_line(&lines, "ready", &mut log)
        } else {
            wait_until_ready(&ready_file(stats), &mut child, &lines, &mut log)
        };
        if let Err(err) = ready {
            let _ = target.kill();
            let _ = target.wait();
            return Err(err);
        }
        Ok(Tool { child, lines, log })
    }

    /// Once the workload has ended: stops bpftrace (heapprofd ends with its target),
    /// waits for the tool and, for heapprofd, puts its CPU, peak RSS and `stats`'
    /// figures in `run`.
    pub(super) fn finish(mut self, mode: Mode, stats: &Path, run: &mut Run) -> Result<()> {
        if mode.is_bpftrace() {
            interrupt(&self.child);
        }
        let (cpu, rss) = wait_with_usage(self.child.id())?;
        self.log.extend(self.lines.try_iter());
        if !mode.is_bpftrace() {
            let figures = DaemonStats::read(stats)?;
            run.daemon_cpu = Some(cpu);
            run.daemon_rss_kib = Some(rss);
            run.allocations = Some(figures.final_profile.allocated_blocks);
            run.profile = Some(figures.final_profile.path);
            run.unwind_tables = figures.unwind_tables;
            run.single_stepped = Some(figures.single_stepped_probes);
        }
        Ok(())
    }
}
