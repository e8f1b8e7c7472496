//! Launch mode's answer to SIGINT and SIGTERM (see [`SignalRelay`]).

use std::time::{Duration, Instant};

/// How long a launched command may take to end after a passed signal before heapprofd
/// says that it has not.
pub const SIGNAL_GRACE: Duration = Duration::from_secs(2);

/// Repeats of a signal this soon after the first are the same request: `timeout`
/// signals its child and then the child's process group, so heapprofd gets two copies;
/// a person pressing Ctrl-C again to stop at once takes longer than this.
pub const REPEAT_WINDOW: Duration = Duration::from_millis(250);

/// Launch mode's answer to SIGINT and SIGTERM: the first is passed to the command,
/// whose exit then ends the run (final profile, the command's status); a second one
/// stops heapprofd at once.
#[derive(Debug)]
pub struct SignalRelay {
    pid: u32,
    passed: Option<PassedSignal>,
    /// The command has begun to exit: its end, and the run's, are moments away.
    exiting: bool,
}

#[derive(Debug, Clone, Copy)]
struct PassedSignal {
    signal: i32,
    at: Instant,
    warned: bool,
}

/// What to do about a signal, per [`SignalRelay::on_signal`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relayed {
    /// Passed to the command: wait for it to end.
    Passed,
    /// A copy of the signal already passed: nothing more to do.
    Repeat,
    /// A second request: stop now.
    StopNow,
}

impl SignalRelay {
    /// A relay to the launched command `pid`.
    pub fn new(pid: u32) -> Self {
        Self {
            pid,
            passed: None,
            exiting: false,
        }
    }

    /// Handles SIGINT/SIGTERM received at `now`.
    pub fn on_signal(&mut self, signal: i32, now: Instant) -> Relayed {
        match self.passed {
            None => {
                log::info!(
                    "passing signal {signal} to pid {}; a second one stops heapprofd at once",
                    self.pid
                );
                pass_signal(self.pid, signal);
                // An ignored signal is known at once: say so now rather than after
                // the grace period, and name the usual cause.
                let ignored = ignores_signal(self.pid, signal);
                if ignored {
                    log::warn!(
                        "the command (pid {}) ignores signal {signal}: it inherited SIG_IGN \
                         (a shell without job control starts background commands so, for \
                         SIGINT and SIGQUIT); heapprofd traces it until it exits; send the \
                         signal again to stop heapprofd now, or SIGTERM to end both",
                        self.pid
                    );
                }
                self.passed = Some(PassedSignal {
                    signal,
                    at: now,
                    warned: ignored,
                });
                Relayed::Passed
            }
            Some(passed) if now.duration_since(passed.at) < REPEAT_WINDOW => {
                log::debug!("signal {signal} again right away: the same request");
                Relayed::Repeat
            }
            // The repeat window is measured when the loop gets to the signal, which
            // may be long after it arrived (reading an exiting command's mappings
            // comes first): once the command exits, a copy cannot mean "stop at once".
            Some(_) if self.exiting => {
                log::debug!("signal {signal} again while the command exits: waiting for it");
                Relayed::Repeat
            }
            Some(_) => {
                log::warn!(
                    "signal {signal} again: stopping now (the command, pid {}, keeps running)",
                    self.pid
                );
                Relayed::StopNow
            }
        }
    }

    /// The command has begun to exit (it is held at its exit).
    pub fn command_exiting(&mut self) {
        self.exiting = true;
    }

    /// When to say that the command has not ended, if that is still to be said.
    pub fn warning_due(&self) -> Option<Instant> {
        self.passed
            .filter(|passed| !passed.warned)
            .map(|passed| passed.at + SIGNAL_GRACE)
    }

    /// Says that the command has not ended after the signal (once).
    pub fn warn_still_running(&mut self) {
        if let Some(passed) = self.passed.as_mut().filter(|passed| !passed.warned) {
            passed.warned = true;
            log::warn!(
                "the command (pid {}) is still running {} s after signal {} (it ignores or \
                 handles it); heapprofd traces it until it exits; send the signal again to \
                 stop heapprofd now",
                self.pid,
                SIGNAL_GRACE.as_secs(),
                passed.signal
            );
        }
    }
}

/// Passes SIGINT/SIGTERM to the launched command, then SIGCONT as `timeout` does: a
/// stopped command would otherwise keep the signal pending and never end.
fn pass_signal(pid: u32, signal: i32) {
    // SAFETY: plain kill(2) of our own child.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
        libc::kill(pid as libc::pid_t, libc::SIGCONT);
    }
}

/// Whether process `pid` ignores `signal` (its disposition is SIG_IGN), per
/// `/proc/PID/status`. False when that cannot be read.
fn ignores_signal(pid: u32, signal: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| ignored_signals(&status))
        .is_some_and(|mask| signal_in_mask(mask, signal))
}

/// The `SigIgn:` mask of a `/proc/PID/status` text.
fn ignored_signals(status: &str) -> Option<u64> {
    let hex = status
        .lines()
        .find_map(|line| line.strip_prefix("SigIgn:"))?
        .trim();
    u64::from_str_radix(hex, 16).ok()
}

/// Whether `signal` (1-based) is in a kernel signal mask, whose bit N-1 is signal N.
fn signal_in_mask(mask: u64, signal: i32) -> bool {
    (1..=64).contains(&signal) && mask & (1 << (signal - 1)) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ignored_signal_is_read_from_the_status_mask() {
        let status = "Name:\tbusy\nSigPnd:\t0000000000000000\nSigBlk:\t0000000000000000\n\
                      SigIgn:\t0000000080001006\nSigCgt:\t0000000100000000\n";
        let mask = ignored_signals(status).expect("a SigIgn line");
        assert_eq!(mask, 0x8000_1006);
        for ignored in [libc::SIGINT, libc::SIGQUIT, libc::SIGPIPE, 32] {
            assert!(signal_in_mask(mask, ignored), "signal {ignored}");
        }
        for caught in [libc::SIGHUP, libc::SIGTERM, libc::SIGUSR1, 0, 65] {
            assert!(!signal_in_mask(mask, caught), "signal {caught}");
        }
        assert_eq!(ignored_signals("Name:\tx\n"), None);
    }

    /// A relay that has passed SIGTERM at the returned instant to a command, which
    /// got it and ended.
    fn relay_after_a_passed_sigterm() -> (SignalRelay, Instant) {
        let mut command = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("starting sleep");
        let mut relay = SignalRelay::new(command.id());
        let start = Instant::now();
        assert_eq!(relay.on_signal(libc::SIGTERM, start), Relayed::Passed);
        let status = command.wait().expect("waiting for sleep");
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGTERM),
            "the command got the signal"
        );
        (relay, start)
    }

    #[test]
    fn relay_passes_the_first_signal_takes_quick_copies_as_one_and_stops_on_a_second() {
        let (mut relay, start) = relay_after_a_passed_sigterm();
        assert_eq!(
            relay.on_signal(libc::SIGTERM, start + REPEAT_WINDOW / 2),
            Relayed::Repeat,
            "timeout's second copy"
        );
        assert_eq!(relay.warning_due(), Some(start + SIGNAL_GRACE));
        relay.warn_still_running();
        assert_eq!(relay.warning_due(), None, "said once");
        assert_eq!(
            relay.on_signal(libc::SIGINT, start + REPEAT_WINDOW * 2),
            Relayed::StopNow
        );
    }

    #[test]
    fn a_late_copy_while_the_command_exits_is_not_a_second_request() {
        let (mut relay, start) = relay_after_a_passed_sigterm();
        relay.command_exiting();
        assert_eq!(
            relay.on_signal(libc::SIGTERM, start + REPEAT_WINDOW * 4),
            Relayed::Repeat,
            "timeout's copy, handled after the command's exit event"
        );
    }
}
