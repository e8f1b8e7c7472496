//! The BPF programs' own log lines (aya-log), shown by the daemon's logger.
//!
//! The programs log only rare events, once per kind per run: the first drop of each
//! kind, naming its table, and the first stack cut short for each reason (a CFI table
//! miss among them). Their records arrive in the `AYA_LOGS` ring buffer, which the
//! event loop drains when it becomes readable; each is logged again through the
//! daemon's `log` logger as `[bpf] message`, at the level the program gave it, under
//! the target [`TARGET`]. The programs log numbers (`first drop: reason=R tables=T`),
//! worded here from the texts the daemon's own drop reports use.

use aya::Ebpf;
use aya_log::EbpfLogger;
use heapprof_common::{DropReason, unwind::GapReason};
use log::{Log, Metadata, Record};
use tokio::io::{Interest, unix::AsyncFd};

/// The `log` target of the programs' lines.
pub const TARGET: &str = "heapprof_daemon::bpf";

/// Re-logs the programs' records through `L` as `[bpf] message` under [`TARGET`].
#[derive(Debug, Clone, Copy)]
pub struct Forward<L>(pub L);

impl<L: Log> Log for Forward<L> {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        self.0.enabled(
            &Metadata::builder()
                .level(metadata.level())
                .target(TARGET)
                .build(),
        )
    }

    fn log(&self, record: &Record<'_>) {
        // aya-log names the program's module as the target and its source file and line:
        // meaningless to users, so replaced.
        let message = record.args().to_string();
        let message = describe_event(&message).unwrap_or(message);
        self.0.log(
            &Record::builder()
                .level(record.level())
                .target(TARGET)
                .args(format_args!("[bpf] {message}"))
                .build(),
        );
    }

    fn flush(&self) {
        self.0.flush();
    }
}

/// The words for a line the programs log as numbers (heapprof-ebpf/src/log.rs):
/// `first drop: reason=R tables=T` and `first gap: reason=R pid=P pc=HEX`. `None` for
/// any other line, which is shown as it is.
fn describe_event(message: &str) -> Option<String> {
    let field = |rest: &str, name: &str| -> Option<String> {
        rest.split(' ')
            .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
            .map(str::to_owned)
    };
    if let Some(rest) = message.strip_prefix("first drop: ") {
        let reason = *DropReason::ALL.get(field(rest, "reason")?.parse::<usize>().ok()?)?;
        let kernel = field(rest, "tables")? == "1";
        let what = match reason.table(kernel) {
            Some(table) => format!("{table}: {}", reason.describe()),
            None => reason.describe().to_owned(),
        };
        return Some(format!(
            "{what}; {}; later drops are counted, not logged",
            reason.remedy()
        ));
    }
    if let Some(rest) = message.strip_prefix("first gap: ") {
        let reason = GapReason::from_u32(field(rest, "reason")?.parse().ok()?)?;
        let pid: u32 = field(rest, "pid")?.parse().ok()?;
        let pc = u64::from_str_radix(&field(rest, "pc")?, 16).ok()?;
        let (what, later) = match reason {
            GapReason::NoTable | GapReason::NoRule => ("CFI table miss", "misses"),
            _ => ("stack not unwound to its end", "gaps"),
        };
        return Some(format!(
            "{what}: pid {pid} at {pc:#x}, {}; later {later} are counted, not logged",
            reason.describe()
        ));
    }
    None
}

type Logger = EbpfLogger<Forward<&'static dyn Log>>;

/// The reader of the programs' log ring. It must live as long as the programs: its
/// descriptor is the ring's, which the programs were relocated to.
pub enum BpfLog {
    /// Drained when the event loop sees the ring readable.
    Watched(AsyncFd<Logger>),
    /// The event loop could not watch it: drained on each interval and at the end.
    Unwatched(Logger),
}

impl BpfLog {
    /// Takes the log ring out of `ebpf` (before its programs are loaded or after; either
    /// way the reader must then be kept). `None`, said at debug level, when the object
    /// has no log ring.
    pub fn init(ebpf: &mut Ebpf) -> Option<BpfLog> {
        let logger = match EbpfLogger::init_with_logger(ebpf, Forward(log::logger())) {
            Ok(logger) => logger,
            Err(err) => {
                log::debug!("no log lines from the BPF programs: {err}");
                return None;
            }
        };
        // SAFETY: the AsyncFd owns the logger, whose descriptor (the ring's) stays open
        // and unchanged until it is dropped; flushing does not replace it.
        match unsafe { AsyncFd::register_with_interest(logger, Interest::READABLE) } {
            Ok(fd) => Some(BpfLog::Watched(fd)),
            Err(err) => {
                let (logger, err) = err.into_parts();
                log::debug!("the BPF programs' log lines are read on each interval: {err}");
                Some(BpfLog::Unwatched(logger))
            }
        }
    }

    /// Waits until the ring has records and logs them (never returns when unwatched).
    pub async fn forward(&mut self) {
        let BpfLog::Watched(fd) = self else {
            return std::future::pending().await;
        };
        match fd.readable_mut().await {
            Ok(mut guard) => {
                guard.get_inner_mut().flush();
                guard.clear_ready();
            }
            Err(err) => {
                log::debug!("cannot watch the BPF programs' log ring: {err}");
                std::future::pending::<()>().await;
            }
        }
    }

    /// Logs every record ready now.
    pub fn flush(&mut self) {
        match self {
            BpfLog::Watched(fd) => fd.get_mut().flush(),
            BpfLog::Unwatched(logger) => logger.flush(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use log::{Level, LevelFilter};

    use super::*;

    /// Keeps what it is given, as (level, target, message).
    #[derive(Default)]
    struct Capture {
        lines: Mutex<Vec<(Level, String, String)>>,
        max: Option<LevelFilter>,
    }

    impl Log for Capture {
        fn enabled(&self, metadata: &Metadata<'_>) -> bool {
            self.max.is_none_or(|max| metadata.level() <= max)
        }

        fn log(&self, record: &Record<'_>) {
            if let Ok(mut lines) = self.lines.lock() {
                lines.push((
                    record.level(),
                    record.target().to_owned(),
                    record.args().to_string(),
                ));
            }
        }

        fn flush(&self) {}
    }

    #[test]
    fn records_are_relabelled_with_their_level_kept() {
        let capture = Capture::default();
        let forward = Forward(&capture);
        forward.log(
            &Record::builder()
                .level(Level::Warn)
                .target("heapprof::log")
                .file(Some("heapprof-ebpf/src/log.rs"))
                .line(Some(90))
                .args(format_args!("LIVE table full: {}", 1))
                .build(),
        );
        let lines = capture.lines.lock().map(|l| l.clone()).unwrap_or_default();
        assert_eq!(
            lines,
            [(
                Level::Warn,
                TARGET.to_owned(),
                "[bpf] LIVE table full: 1".to_owned()
            )]
        );
    }

    #[test]
    fn the_programs_numbers_are_worded_from_the_daemons_texts() {
        assert_eq!(
            describe_event("first drop: reason=0 tables=0").as_deref(),
            Some(
                "LIVE: live-block table full (counted as allocated, not as in use); \
                 raise --max-live-blocks; later drops are counted, not logged"
            )
        );
        let kernel = describe_event("first drop: reason=1 tables=1").unwrap_or_default();
        assert!(
            kernel.starts_with("KERNEL_SITES: site table full") && kernel.contains("--max-sites"),
            "{kernel}"
        );
        let truncated = describe_event("first drop: reason=3 tables=0").unwrap_or_default();
        assert!(
            truncated.starts_with("stacks deeper than the frame limit"),
            "{truncated}"
        );
        assert_eq!(
            describe_event("first gap: reason=2 pid=42 pc=7f00dead").as_deref(),
            Some(
                "CFI table miss: pid 42 at 0x7f00dead, no CFI rule for the address; \
                 later misses are counted, not logged"
            )
        );
        let gap = describe_event("first gap: reason=0 pid=7 pc=10").unwrap_or_default();
        assert!(
            gap.starts_with("stack not unwound to its end: pid 7 at 0x10"),
            "{gap}"
        );
        // Anything else, or numbers out of range, is shown as the program wrote it.
        assert_eq!(describe_event("something else"), None);
        assert_eq!(describe_event("first drop: reason=99 tables=0"), None);
        assert_eq!(describe_event("first gap: reason=9 pid=1 pc=1"), None);
    }

    #[test]
    fn enabled_asks_the_inner_logger_about_the_bpf_target() {
        let capture = Capture {
            max: Some(LevelFilter::Info),
            ..Capture::default()
        };
        let forward = Forward(&capture);
        let metadata = |level| Metadata::builder().level(level).target("heapprof").build();
        assert!(forward.enabled(&metadata(Level::Warn)));
        assert!(forward.enabled(&metadata(Level::Info)));
        assert!(!forward.enabled(&metadata(Level::Debug)));
    }
}
