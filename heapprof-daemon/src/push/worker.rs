//! One target's push loop: takes the profiles the session hands over, splits them
//! into uploads, queues them in the spool and sends the oldest first, retrying with
//! exponential backoff while the backend fails. It logs one line when the backend
//! starts failing and one when it works again, never one per profile.

use std::{path::PathBuf, time::Duration};

use bytes::Bytes;

use tokio::{sync::mpsc, time::Instant};

use crate::stats_file::PushFigures;

use super::{
    ca::CaFile,
    metrics::TargetMetrics,
    series,
    spool::Spool,
    target::{Header, PushTarget, read_token},
    transport::{Outcome, Transport},
};

/// The first wait after a failed push; it doubles with each failure after.
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
/// The longest wait between two pushes to a failing backend: a backend that comes
/// back is used again within this.
const MAX_BACKOFF: Duration = Duration::from_secs(15);

/// A written profile, gzip'd pprof, shared by every target's worker.
pub type Job = Bytes;

/// The headers of every push: the fixed ones and the token file's, read again
/// before each push so that a rotated token is used.
#[derive(Debug)]
pub struct Headers {
    fixed: Vec<Header>,
    token_file: Option<PathBuf>,
    token: Option<String>,
    token_error_said: bool,
}

impl Headers {
    /// `fixed` headers, and `token` read from `token_file` at start.
    pub fn new(fixed: Vec<Header>, token_file: Option<PathBuf>, token: Option<String>) -> Self {
        Headers {
            fixed,
            token_file,
            token,
            token_error_said: false,
        }
    }

    fn current(&mut self, target: &str) -> Vec<Header> {
        if let Some(file) = &self.token_file {
            match read_token(file) {
                Ok(token) => {
                    self.token = Some(token);
                    self.token_error_said = false;
                }
                Err(err) if !self.token_error_said => {
                    log::warn!("push to {target}: {err}; using the token read before");
                    self.token_error_said = true;
                }
                Err(_) => {}
            }
        }
        let mut headers = self.fixed.clone();
        if let Some(token) = &self.token {
            headers.push(Header {
                name: "authorization".into(),
                value: format!("Bearer {token}"),
            });
        }
        headers
    }
}

/// Everything one target's loop needs.
#[derive(Debug)]
pub struct Worker {
    /// Where to.
    pub target: PushTarget,
    /// The uploads waiting.
    pub spool: Spool,
    /// Sent with each push.
    pub headers: Headers,
    /// `--push-service-name`.
    pub service_name: Option<String>,
    /// `--push-timeout`; also how long the uploads still waiting at exit are tried.
    pub timeout: Duration,
    /// `--push-ca-file`: trusted besides the system's roots.
    pub ca: Option<CaFile>,
    /// `--push-otlp-original-payload`.
    pub original_payload: bool,
    /// Its counters.
    pub metrics: TargetMetrics,
}

/// Runs `worker` until `jobs` is closed and the spool is sent, or the exit's time
/// for it (the push timeout) is up.
pub async fn run(mut worker: Worker, mut jobs: mpsc::Receiver<Job>) -> PushFigures {
    let name = worker.target.display.clone();
    let mut transport = match Transport::new(
        worker.target.clone(),
        worker.timeout,
        worker.ca.as_ref(),
        worker.original_payload,
    ) {
        Ok(transport) => transport,
        Err(err) => {
            log::error!("{err}; profiles are written locally only");
            while jobs.recv().await.is_some() {
                worker.metrics.dropped.inc();
            }
            return figures(&worker);
        }
    };
    if !worker.spool.is_empty() {
        log::info!(
            "push to {name}: {} profiles an earlier run left in the spool are sent first",
            worker.spool.len()
        );
    }
    let mut attempts = Attempts::new();
    let mut closed_at: Option<Instant> = None;
    loop {
        update_gauges(&worker);
        let drain_deadline = closed_at.map(|at| at + worker.timeout);
        if drain_deadline.is_some() && worker.spool.is_empty() {
            break;
        }
        tokio::select! {
            job = jobs.recv(), if closed_at.is_none() => match job {
                Some(job) => accept(&mut worker, &job),
                None => {
                    closed_at = Some(Instant::now());
                    if attempts.failing.is_none() {
                        attempts.next = Instant::now();
                    }
                }
            },
            () = tokio::time::sleep_until(attempts.next), if !worker.spool.is_empty() => {
                send_front(&mut worker, &mut transport, &name, &mut attempts).await;
            }
            () = tokio::time::sleep_until(drain_deadline.unwrap_or(attempts.next)), if drain_deadline.is_some() => break,
        }
    }
    finish(&worker, &name, attempts.failing.as_deref())
}

/// When the next push is tried, and how the backend has been answering.
struct Attempts {
    /// The wait after the next failure.
    backoff: Duration,
    /// When the oldest upload is tried next.
    next: Instant,
    /// Why the backend fails, while it does.
    failing: Option<String>,
}

impl Attempts {
    fn new() -> Self {
        Attempts {
            backoff: FIRST_BACKOFF,
            next: Instant::now(),
            failing: None,
        }
    }
}

/// Pushes the oldest upload in the spool and acts on the backend's answer: sent or
/// rejected, it leaves the spool; a failure to retry keeps it and backs off. A
/// spooled upload that cannot be read is dropped.
async fn send_front(
    worker: &mut Worker,
    transport: &mut Transport,
    name: &str,
    attempts: &mut Attempts,
) {
    let Some(front) = worker.spool.front() else {
        return;
    };
    let upload = match front {
        Ok(upload) => upload,
        Err(err) => {
            log::warn!("push to {name}: dropping a spooled profile: {err}");
            worker.metrics.dropped.inc();
            return;
        }
    };
    let headers = worker.headers.current(name);
    match transport.send(&upload, &headers).await {
        Outcome::Sent => {
            worker.spool.pop_front();
            worker.metrics.sent.inc();
            attempts.backoff = FIRST_BACKOFF;
            attempts.next = Instant::now();
            if attempts.failing.take().is_some() {
                log::info!(
                    "push to {name} works again; {} profiles waiting are being sent",
                    worker.spool.len()
                );
            }
        }
        Outcome::Retry(why) => {
            worker.metrics.failed.inc();
            if attempts.failing.is_none() {
                log::warn!(
                    "push to {name} failed: {why}; profiles wait in {} and are retried \
                     with backoff (local profiles are still written)",
                    spool_description(&worker.spool)
                );
            }
            attempts.failing = Some(why);
            attempts.next = Instant::now() + attempts.backoff;
            attempts.backoff = (attempts.backoff * 2).min(MAX_BACKOFF);
        }
        Outcome::Rejected(why) => {
            worker.metrics.failed.inc();
            worker.metrics.dropped.inc();
            worker.spool.pop_front();
            log::warn!("push to {name}: the backend rejected a profile, dropped: {why}");
        }
    }
}

/// Splits a written profile into uploads and queues them.
fn accept(worker: &mut Worker, job: &Job) {
    let name = &worker.target.display;
    let uploads = match series::split(job, worker.service_name.as_deref()) {
        Ok(uploads) => uploads,
        Err(err) => {
            log::warn!("push to {name}: cannot read a profile, not pushed: {err}");
            worker.metrics.dropped.inc();
            return;
        }
    };
    for upload in uploads {
        match worker.spool.push(upload) {
            Ok(dropped) => {
                worker.metrics.spooled.inc();
                if dropped > 0 {
                    worker.metrics.dropped.inc_by(dropped);
                    log::warn!(
                        "push to {name}: the spool is full ({} bytes): dropped the {dropped} oldest profiles",
                        worker.spool.bytes()
                    );
                }
            }
            Err(err) => {
                worker.metrics.dropped.inc();
                log::warn!("push to {name}: a profile not spooled, dropped: {err}");
            }
        }
    }
}

fn update_gauges(worker: &Worker) {
    let to_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    worker
        .metrics
        .waiting
        .set(to_i64(worker.spool.len() as u64));
    worker
        .metrics
        .waiting_bytes
        .set(to_i64(worker.spool.bytes()));
}

fn spool_description(spool: &Spool) -> &'static str {
    if spool.is_on_disk() {
        "the spool (--push-spool)"
    } else {
        "memory (no --push-spool: lost at exit)"
    }
}

/// The exit's summary line, and the figures it gives; what is left in memory is
/// counted as dropped.
fn finish(worker: &Worker, name: &str, failing: Option<&str>) -> PushFigures {
    let left = worker.spool.len();
    if left > 0 && !worker.spool.is_on_disk() {
        worker.metrics.dropped.inc_by(left as u64);
    }
    let left_words = match (left, worker.spool.is_on_disk()) {
        (0, _) => String::new(),
        (n, true) => format!("; {n} stay in the spool for the next run"),
        (n, false) => format!("; {n} not pushed are lost (no --push-spool)"),
    };
    let failing_words = failing.map_or_else(String::new, |why| format!(" (failing: {why})"));
    log::info!(
        "push to {name}: {}{left_words}{failing_words}",
        worker.metrics.describe()
    );
    figures(worker)
}

/// The target's figures so far (for `--stats-json`).
fn figures(worker: &Worker) -> PushFigures {
    let metrics = &worker.metrics;
    PushFigures {
        target: worker.target.display.clone(),
        sent: metrics.sent.get(),
        failed_pushes: metrics.failed.get(),
        spooled: metrics.spooled.get(),
        dropped: metrics.dropped.get(),
        left: worker.spool.len() as u64,
    }
}
