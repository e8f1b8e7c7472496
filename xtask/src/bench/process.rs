//! Process control of the benchmark: starting a workload held on its "go" line,
//! following a tool's output, waiting with resource usage, and the other tracers
//! on the machine that would spoil the figures.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

/// Waits until a just-started workload is blocked reading stdin: its libc is mapped and
/// tracers can attach.
pub(super) fn wait_until_waiting(pid: u32) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next());
        if state == Some("S") && libc_of(pid).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    bail!("workload {pid} never started waiting on its input")
}

/// The libc a process maps, from its /proc/PID/maps.
pub(super) fn libc_of(pid: u32) -> Result<String> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            p.rsplit('/')
                .next()
                .is_some_and(|n| n.starts_with("libc.so"))
        })
        .map(str::to_owned)
        .context("the workload maps no libc.so")
}

/// Lines a child prints (stdout or stderr), as they come.
pub(super) fn lines_of(stream: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    receiver
}

/// Waits until heapprofd creates its `--ready-file` `ready` (its probes are attached
/// and armed), keeping what it logs meanwhile in `seen`; fails if it exits first.
pub(super) fn wait_until_ready(
    ready: &Path,
    child: &mut Child,
    lines: &mpsc::Receiver<String>,
    seen: &mut Vec<String>,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        seen.extend(lines.try_iter());
        if ready.exists() {
            return Ok(());
        }
        if let Some(status) = child.try_wait().context("waiting for heapprofd")? {
            bail!(
                "heapprofd exited ({status}) before it was ready; its output:\n{}",
                seen.join("\n")
            );
        }
        if Instant::now() >= deadline {
            bail!(
                "heapprofd was not ready within 120 s; its output:\n{}",
                seen.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits until the tool prints a line holding `needle`, keeping its lines in `seen`.
pub(super) fn wait_for_line(
    lines: &mpsc::Receiver<String>,
    needle: &str,
    seen: &mut Vec<String>,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                let found = line.contains(needle);
                seen.push(line);
                if found {
                    return Ok(());
                }
            }
            Err(_) => bail!(
                "the tool never printed `{needle}`; its output:\n{}",
                seen.join("\n")
            ),
        }
    }
}

/// Waits for `pid`, returning its CPU seconds and peak RSS (KiB).
pub(super) fn wait_with_usage(pid: u32) -> Result<(f64, u64)> {
    let mut status = 0;
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 on our own child with valid pointers.
    let waited = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut usage) };
    if waited < 0 {
        bail!("wait4({pid}): {}", std::io::Error::last_os_error());
    }
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok((
        seconds(usage.ru_utime) + seconds(usage.ru_stime),
        usage.ru_maxrss as u64,
    ))
}

pub(super) fn interrupt(child: &Child) {
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
}

/// Other users of uprobes on the machine, checked between runs (when none of this
/// benchmark's tools is running): heapprofd and bpftrace processes, uprobe_multi BPF
/// links, perf-event uprobes (per bpftool, when installed). A tracer on the C library
/// (a test suite's `heapprofd --all`) traps the workloads' allocator calls too, bare runs
/// included, and makes the figures meaningless. Empty when there are none.
pub(super) fn foreign_tracers() -> Vec<String> {
    let mut found = Vec::new();
    let me = std::process::id();
    for entry in std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
    {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        let comm = comm.trim();
        if pid != me && (comm == "heapprofd" || comm == "bpftrace") {
            found.push(format!("{comm} (pid {pid})"));
        }
    }
    let bpftool = |object: &str| -> Option<String> {
        let output = Command::new("bpftool")
            .args(["-j", object, "show"])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())?;
        Some(String::from_utf8_lossy(&output.stdout).into_owned())
    };
    if let Some(links) = bpftool("link") {
        // Older bpftools print the link type as a number: 12 is BPF_LINK_TYPE_UPROBE_MULTI.
        let numeric = links
            .match_indices("\"type\":12")
            .filter(|(at, m)| !links[at + m.len()..].starts_with(|c: char| c.is_ascii_digit()))
            .count();
        let multi = numeric + links.matches("\"type\":\"uprobe_multi\"").count();
        if multi > 0 {
            found.push(format!("{multi} uprobe_multi BPF links"));
        }
    }
    if let Some(perf) = bpftool("perf") {
        let uprobes = perf.matches("uprobe\"").count();
        if uprobes > 0 {
            found.push(format!("{uprobes} perf-event uprobes with BPF programs"));
        }
    }
    found
}

/// Adds a warning to `warnings` when other tracers are active before a section.
pub(super) fn note_foreign_tracers(section: &str, warnings: &mut Vec<String>) {
    let foreign = foreign_tracers();
    if !foreign.is_empty() {
        eprintln!(
            "xtask:   warning: other tracers are active: {}",
            foreign.join(", ")
        );
        warnings.push(format!(
            "{section}: WARNING: other tracers were active at its start ({})",
            foreign.join(", ")
        ));
    }
}

/// The 1-minute load average.
pub(super) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// Starts a workload and waits until it blocks on its "go" line.
pub(super) fn start_workload(command: &mut Command) -> Result<Child> {
    let target = command
        .stdin(Stdio::piped())
        .spawn()
        .context("starting a workload")?;
    wait_until_waiting(target.id())?;
    Ok(target)
}

/// Lets a waiting workload start.
pub(super) fn send_go(target: &mut Child) -> Result<()> {
    let mut stdin = target.stdin.take().context("workload stdin")?;
    stdin.write_all(b"go\n")?;
    Ok(())
}

/// A running heapprofd with its log so far and the rest to come.
pub(super) struct Daemon {
    pub(super) child: Child,
    pub(super) lines: mpsc::Receiver<String>,
    pub(super) log: Vec<String>,
    /// Where it writes its figures at exit (`--stats-json`).
    pub(super) stats: PathBuf,
    /// Where it appends a line per profile written (`--profiles-json`).
    pub(super) profiles: PathBuf,
}

/// CPU seconds (user + system) of process `pid` so far.
pub(super) fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which may hold spaces: utime and stime are the
    // 14th and 15th fields, the 12th and 13th after it.
    let rest = stat.rsplit_once(')').context("malformed stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> Result<f64> {
        Ok(fields.get(i).context("short stat")?.parse::<u64>()? as f64)
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok((ticks(11)? + ticks(12)?) / hz)
}

/// Runs `runs` rounds of every mode in `modes`, interleaved in rotated order, so that
/// the machine's drift hits all modes alike. Returns each mode's passes (by index in
/// `modes`) and why a mode failed when it did: a failing mode is reported and left out
/// of the later rounds.
pub(super) fn rotated_rounds<M: Copy, P>(
    section: &str,
    modes: &[M],
    runs: usize,
    name: impl Fn(M) -> &'static str,
    rate: impl Fn(&P) -> f64,
    mut pass: impl FnMut(M) -> Result<P>,
) -> (Vec<Vec<P>>, Vec<Option<String>>) {
    let count = modes.len();
    let mut passes: Vec<Vec<P>> = modes.iter().map(|_| Vec::new()).collect();
    let mut failures: Vec<Option<String>> = vec![None; count];
    for round in 0..runs {
        for i in 0..count {
            let index = (i + round) % count;
            let mode = modes[index];
            if failures[index].is_some() {
                continue;
            }
            match pass(mode) {
                Ok(done) => {
                    eprintln!(
                        "xtask:   round {} {:<32} {:9.0} requests/s",
                        round + 1,
                        name(mode),
                        rate(&done)
                    );
                    passes[index].push(done);
                }
                Err(err) => {
                    eprintln!("xtask:   {section}, {} failed: {err:#}", name(mode));
                    failures[index] = Some(format!("{err:#}"));
                }
            }
        }
    }
    (passes, failures)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for heapprofd: `script` run by sh, its stderr followed.
    fn tool(script: &str) -> (Child, mpsc::Receiver<String>) {
        let mut child = Command::new("sh")
            .args(["-c", script])
            .stderr(Stdio::piped())
            .spawn()
            .expect("sh");
        let lines = lines_of(child.stderr.take().expect("stderr"));
        (child, lines)
    }

    #[test]
    fn ready_once_the_file_appears_and_not_when_the_tool_exits_first() {
        let dir = std::env::temp_dir().join(format!("xtask-ready-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let ready = dir.join("1.ready");
        let script = format!(
            "echo starting >&2; sleep 0.1; touch '{}'; sleep 5",
            ready.display()
        );
        let (mut child, lines) = tool(&script);
        let mut seen = Vec::new();
        wait_until_ready(&ready, &mut child, &lines, &mut seen).expect("ready");
        let _ = child.kill();
        let _ = child.wait();

        let never = dir.join("2.ready");
        let (mut child, lines) = tool("echo cannot attach >&2; exit 2");
        let mut seen = Vec::new();
        let error = wait_until_ready(&never, &mut child, &lines, &mut seen)
            .expect_err("exited before it was ready");
        assert!(
            format!("{error:#}").contains("before it was ready"),
            "{error:#}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
