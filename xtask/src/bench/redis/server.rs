//! A redis-server of the benchmark: on a loopback port, pinned to CPU 0, without
//! persistence; bare, or launched by heapprofd.

use std::{
    io::Read as _,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::bench::{Bench, process::interrupt};

/// Loopback port of the benchmark's redis (outside redis's default 6379).
pub(super) const PORT: &str = "16399";

/// redis-server's arguments after `redis-server`: loopback [`PORT`], no persistence.
const SERVER_ARGS: [&str; 10] = [
    "--port",
    PORT,
    "--bind",
    "127.0.0.1",
    "--save",
    "",
    "--appendonly",
    "no",
    "--loglevel",
    "warning",
];

/// A redis-server on [`PORT`], pinned to CPU 0, without persistence; bare or launched by
/// heapprofd.
pub(super) struct Redis {
    /// `taskset` (which becomes redis-server), or heapprofd in launch mode.
    child: Child,
    /// redis-server's pid.
    pid: u32,
    /// Launch mode: heapprofd's log, read to its end by a thread.
    log: Option<JoinHandle<String>>,
    /// Launch mode: where heapprofd writes its figures at exit (`--stats-json`).
    stats: Option<PathBuf>,
}

impl Redis {
    /// Starts a bare redis-server.
    pub(super) fn start() -> Result<Redis> {
        Self::start_with(Command::new("taskset"))
    }

    /// Starts a bare redis-server with `taskset`, which `command` runs (itself, or
    /// `nsenter ... -- taskset` to start it in another mount namespace; whatever it is,
    /// it execs taskset, which execs redis-server: the same pid).
    pub(super) fn start_with(mut command: Command) -> Result<Redis> {
        let child = command
            .args(["-c", "0", "redis-server"])
            .args(SERVER_ARGS)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server")?;
        // taskset execs redis-server: the same pid.
        let pid = child.id();
        let redis = Redis {
            child,
            pid,
            log: None,
            stats: None,
        };
        wait_for_pong()?;
        Ok(redis)
    }

    /// Starts redis-server under `heapprofd FLAGS -o DIR -- taskset -c 0 redis-server`
    /// (heapprofd itself not pinned, as in the attach modes).
    pub(super) fn launch(bench: &Bench, flags: &[&str]) -> Result<Redis> {
        let stats = bench.stats_path();
        let mut child = Command::new(&bench.heapprofd)
            .args(flags)
            .arg("-o")
            .arg(bench.dir.join("profiles"))
            .arg("--stats-json")
            .arg(&stats)
            .args(["--", "taskset", "-c", "0", "redis-server"])
            .args(SERVER_ARGS)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting heapprofd -- redis-server")?;
        let mut stderr = child.stderr.take().context("heapprofd stderr")?;
        let log = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });
        let pid = child.id();
        let mut redis = Redis {
            child,
            pid,
            log: Some(log),
            stats: Some(stats),
        };
        if let Err(err) = wait_for_pong() {
            let log = redis.stop().map(|(_, log)| log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(6).collect();
            bail!(
                "{err:#}; heapprofd's last lines (newest first): {}",
                tail.join(" | ")
            );
        }
        redis.pid = server_pid().context("redis-cli info server gave no process_id")?;
        Ok(redis)
    }

    pub(super) fn pid(&self) -> u32 {
        self.pid
    }

    /// Launch mode: where heapprofd writes its figures at exit.
    pub(super) fn stats(&self) -> Option<&Path> {
        self.stats.as_deref()
    }

    /// Launch mode: SIGINT to heapprofd (which passes it to redis and writes its final
    /// profile); its exit status (redis's: 0 on SIGINT) and its log. `None` and an empty
    /// log for a bare redis.
    pub(super) fn stop(&mut self) -> Result<(Option<ExitStatus>, String)> {
        let Some(log) = self.log.take() else {
            return Ok((None, String::new()));
        };
        interrupt(&self.child);
        let status = self.child.wait()?;
        Ok((Some(status), log.join().unwrap_or_default()))
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        if self.log.is_some() && self.pid != self.child.id() {
            // A launched redis whose heapprofd did not stop it: end it too.
            // SAFETY: plain kill(2) of a process of ours.
            unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until redis answers PING on [`PORT`].
fn wait_for_pong() -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let pong = Command::new("redis-cli")
            .args(["-p", PORT, "ping"])
            .output()
            .is_ok_and(|o| o.stdout.starts_with(b"PONG"));
        if pong {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("redis-server did not answer on port {PORT} within 10 s (is the port taken?)")
}

/// The pid redis-server reports (`INFO server`).
fn server_pid() -> Option<u32> {
    let output = Command::new("redis-cli")
        .args(["-p", PORT, "info", "server"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("process_id:"))?
        .trim()
        .parse()
        .ok()
}
