//! `--push`: sending every profile heapprofd writes to continuous-profiling backends
//! (Grafana Pyroscope's `/ingest`, OTLP profiles over HTTP or gRPC, Parca's
//! `WriteRaw`).
//!
//! The session hands each written profile to [`Pusher::offer`], which only queues it
//! (a bounded channel; a full one drops the profile, counted) so that pushing never
//! delays a profile or the event loop. The pushes run on a thread of their own with
//! its own runtime, since the daemon's runtime is single-threaded: splitting,
//! encoding and the spool's file writes would otherwise run on the event loop's
//! thread. Each target has its own loop (`worker`), spool and counters.
//!
//! The rooms: `target` (the flags, checked), `ca` (`--push-ca-file`), `series` (a
//! profile's per-process uploads), `scan`, `processes` and `wire` (a profile read as
//! it inflates: told one process from several, cut into its processes' profiles,
//! read field by field), `profile_error` (a profile that cannot be read),
//! `pyroscope`, `otlp` and `parca` (the protocols' encodings), `grpc` (a call of an
//! encoded request), `transport` (one send), `spool` (the bounded queue), `worker`
//! (the retry loop), `metrics`, `error_text`.

pub mod ca;
mod error_text;
mod grpc;
pub mod metrics;
pub mod otlp;
pub mod parca;
mod processes;
pub mod profile_error;
pub mod pyroscope;
mod scan;
pub mod series;
pub mod spool;
pub mod target;
pub mod transport;
mod wire;
mod worker;

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result};
use bytes::Bytes;
use tokio::sync::mpsc;

pub use self::metrics::PushMetrics;
use self::{
    ca::CaFile,
    metrics::TargetMetrics,
    spool::Spool,
    target::{Header, PushTarget, TargetError},
    worker::{Headers, Job, Worker},
};
use crate::{cli::Cli, stats_file::PushFigures};

/// Profiles handed over and not yet taken by a target's loop: a loop busy encoding
/// or writing its spool falls behind by at most this many before profiles are dropped.
const QUEUE: usize = 8;

/// The most a target's uploads may take in memory without `--push-spool`.
const MEMORY_SPOOL: u64 = 8 << 20;

/// The push flags, checked at start-up.
#[derive(Debug, Clone)]
pub struct PushConfig {
    targets: Vec<PushTarget>,
    headers: Vec<Header>,
    token_file: Option<PathBuf>,
    token: Option<String>,
    timeout: Duration,
    ca: Option<CaFile>,
    original_payload: bool,
    spool: Option<PathBuf>,
    spool_size: u64,
    service_name: Option<String>,
}

impl PushConfig {
    /// The push the flags ask for, `None` without `--push`, or the first mistake.
    pub fn from_cli(cli: &Cli) -> Result<Option<Self>, TargetError> {
        if cli.push.is_empty() {
            return Ok(None);
        }
        let targets = cli
            .push
            .iter()
            .map(|url| PushTarget::parse(url))
            .collect::<Result<Vec<_>, _>>()?;
        let headers = cli
            .push_header
            .iter()
            .map(|text| Header::parse(text))
            .collect::<Result<Vec<_>, _>>()?;
        let token = cli
            .push_token_file
            .as_deref()
            .map(target::read_token)
            .transpose()?;
        let ca = cli.push_ca_file.as_deref().map(CaFile::read).transpose()?;
        Ok(Some(PushConfig {
            targets,
            headers,
            token_file: cli.push_token_file.clone(),
            token,
            timeout: cli.push_timeout,
            ca,
            original_payload: cli.push_otlp_original_payload,
            spool: cli.push_spool.clone(),
            spool_size: cli.push_spool_size,
            service_name: cli.push_service_name.clone(),
        }))
    }

    /// One line per target for the start-up log.
    pub fn describe(&self) -> String {
        self.targets
            .iter()
            .map(|t| format!("{} ({})", t.display, t.protocol.name()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The session's side of the push: hands profiles over, and waits for the pushes at exit.
#[derive(Debug)]
pub struct Pusher {
    senders: Vec<(mpsc::Sender<Job>, TargetMetrics, String)>,
    thread: Option<std::thread::JoinHandle<Vec<PushFigures>>>,
    /// `--push` without `-o`: each profile is deleted once handed over.
    delete_after: bool,
    full_said: bool,
}

impl Pusher {
    /// Opens the spools and starts the push thread. Fails (at start-up) when a spool
    /// directory cannot be used.
    pub fn start(config: PushConfig, metrics: &PushMetrics, push_only: bool) -> Result<Self> {
        let mut workers = Vec::new();
        let mut senders = Vec::new();
        for target in config.targets {
            let spool = match &config.spool {
                Some(dir) => {
                    let dir = dir.join(spool_dir_name(&target));
                    Spool::on_disk(&dir, config.spool_size)
                        .with_context(|| "choose a writable --push-spool directory".to_owned())?
                }
                None => Spool::in_memory(MEMORY_SPOOL),
            };
            let target_metrics = metrics.target(&target.display);
            let (sender, receiver) = mpsc::channel(QUEUE);
            senders.push((sender, target_metrics.clone(), target.display.clone()));
            workers.push((
                Worker {
                    target,
                    spool,
                    headers: Headers::new(
                        config.headers.clone(),
                        config.token_file.clone(),
                        config.token.clone(),
                    ),
                    service_name: config.service_name.clone(),
                    timeout: config.timeout,
                    ca: config.ca.clone(),
                    original_payload: config.original_payload,
                    metrics: target_metrics,
                },
                receiver,
            ));
        }
        let thread = std::thread::Builder::new()
            .name("heapprofd-push".into())
            .spawn(move || run_workers(workers))
            .context("starting the push thread")?;
        Ok(Pusher {
            senders,
            thread: Some(thread),
            delete_after: push_only,
            full_said: false,
        })
    }

    /// Hands the profile just written at `path` to every target (never waits).
    pub fn offer(&mut self, path: &Path) {
        let bytes = match std::fs::read(path) {
            Ok(bytes) => Bytes::from(bytes),
            Err(err) => {
                log::warn!("push: cannot read {} back: {err}", path.display());
                for (_, metrics, _) in &self.senders {
                    metrics.dropped.inc();
                }
                return;
            }
        };
        if self.delete_after {
            let _ = std::fs::remove_file(path);
        }
        for (sender, metrics, name) in &self.senders {
            match sender.try_send(bytes.clone()) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(_)) => {
                    metrics.dropped.inc();
                    if !self.full_said {
                        log::warn!(
                            "push to {name} falls behind the profiles ({QUEUE} waiting to be \
                             spooled): dropping the newest; a longer --interval helps"
                        );
                    }
                    self.full_said = true;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    metrics.dropped.inc();
                }
            }
        }
    }

    /// Ends the pushes: each target sends what waits for at most its timeout, then
    /// logs its summary. Blocks until then (called once the session has ended).
    /// Returns each target's figures.
    pub fn finish(mut self) -> Vec<PushFigures> {
        self.senders.clear();
        match self.thread.take().map(std::thread::JoinHandle::join) {
            Some(Ok(figures)) => figures,
            Some(Err(_)) => {
                log::error!("the push thread panicked");
                Vec::new()
            }
            None => Vec::new(),
        }
    }
}

/// The push thread: one loop per target on a runtime of its own.
fn run_workers(workers: Vec<(Worker, mpsc::Receiver<Job>)>) -> Vec<PushFigures> {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            log::error!(
                "push: cannot start its runtime ({err}); profiles are written locally only"
            );
            return Vec::new();
        }
    };
    runtime.block_on(async {
        let tasks: Vec<_> = workers
            .into_iter()
            .map(|(worker, jobs)| tokio::spawn(worker::run(worker, jobs)))
            .collect();
        let mut figures = Vec::new();
        for task in tasks {
            match task.await {
                Ok(target) => figures.push(target),
                Err(err) => log::error!("push: a target's loop ended abnormally: {err}"),
            }
        }
        figures
    })
}

/// The spool subdirectory of `target`: its URL in file-name characters, so that a
/// restart with the same `--push` finds its own uploads, whatever the flags' order.
fn spool_dir_name(target: &PushTarget) -> String {
    target
        .display
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(120)
        .collect()
}
