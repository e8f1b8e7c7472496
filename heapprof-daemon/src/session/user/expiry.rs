//! `--retain-exited`: when an exited process is forgotten.
//!
//! A process counts as exited from when the session finds it gone (within an
//! interval of its exit). Once it has been gone for the retention time, everything
//! the session keeps of it is dropped, so that the daemon's memory stays flat while
//! processes come and go.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

/// When each exited process, not yet forgotten, was found gone.
#[derive(Debug, Default)]
pub(super) struct ExitLedger {
    exited: HashMap<u32, Instant>,
}

impl ExitLedger {
    /// `pid` was found gone at `now`. A pid found gone again (reused, then exited)
    /// takes the later time: its data is kept longer, never shorter.
    pub fn exited(&mut self, pid: u32, now: Instant) {
        self.exited.insert(pid, now);
    }

    /// Whether `pid` is waiting to be forgotten.
    pub fn contains(&self, pid: u32) -> bool {
        self.exited.contains_key(&pid)
    }

    /// Takes the processes gone for at least `retain` at `now`. A pid that `alive`
    /// says runs again belongs to a new process, which may share the old one's
    /// entries: it waits until that one is gone too.
    pub fn take_expired(
        &mut self,
        retain: Duration,
        now: Instant,
        alive: impl Fn(u32) -> bool,
    ) -> HashSet<u32> {
        let expired: HashSet<u32> = self
            .exited
            .iter()
            .filter(|&(&pid, &at)| now.saturating_duration_since(at) >= retain && !alive(pid))
            .map(|(&pid, _)| pid)
            .collect();
        self.exited.retain(|pid, _| !expired.contains(pid));
        expired
    }
}

/// Whether a process `pid` exists.
pub(super) fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_are_forgotten_after_the_retention_time() {
        let start = Instant::now();
        let retain = Duration::from_secs(10);
        let mut ledger = ExitLedger::default();
        ledger.exited(1, start);
        ledger.exited(2, start + Duration::from_secs(5));
        let dead = |_| false;
        assert!(
            ledger
                .take_expired(retain, start + Duration::from_secs(9), dead)
                .is_empty()
        );
        assert_eq!(
            ledger.take_expired(retain, start + Duration::from_secs(10), dead),
            HashSet::from([1])
        );
        assert!(!ledger.contains(1) && ledger.contains(2));
        assert_eq!(
            ledger.take_expired(retain, start + Duration::from_secs(60), dead),
            HashSet::from([2])
        );
        assert!(ledger.exited.is_empty(), "nothing kept once forgotten");
    }

    #[test]
    fn a_reused_pid_waits_for_the_new_process() {
        let start = Instant::now();
        let retain = Duration::from_secs(1);
        let mut ledger = ExitLedger::default();
        ledger.exited(7, start);
        let later = start + Duration::from_secs(5);
        assert!(
            ledger
                .take_expired(retain, later, |pid| pid == 7)
                .is_empty()
        );
        // The new process exits in turn: the later time counts.
        ledger.exited(7, later);
        assert!(
            ledger
                .take_expired(retain, later + Duration::from_millis(500), |_| false)
                .is_empty()
        );
        assert_eq!(
            ledger.take_expired(retain, later + retain, |_| false),
            HashSet::from([7])
        );
    }
}
