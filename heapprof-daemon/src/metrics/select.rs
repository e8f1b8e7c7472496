//! Which processes are exported: a bound on the series heapprofd creates.
//!
//! With `--all` every process on the machine that ever allocated stays in the
//! profiles; as series that would grow without bound (and every short-lived process
//! would leave a stale one behind). So only processes seen allocating or freeing
//! since the last profile are exported, and at most `--metrics-top` of them, those
//! with the most bytes in use.

use std::collections::HashMap;

use super::ProcessFigures;

/// Selects the exported processes, remembering each one's activity between profiles.
#[derive(Debug)]
pub(super) struct Selection {
    active_only: bool,
    top: usize,
    /// Each process's activity at the last profile.
    last: HashMap<u32, u64>,
}

impl Selection {
    pub(super) fn new(active_only: bool, top: usize) -> Self {
        Self {
            active_only,
            top,
            last: HashMap::new(),
        }
    }

    /// The processes to export of those in this profile, most bytes in use first.
    pub(super) fn select(&mut self, mut processes: Vec<ProcessFigures>) -> Vec<ProcessFigures> {
        // Rebuilt from this profile alone, so forgotten processes leave it.
        let last = std::mem::replace(
            &mut self.last,
            processes.iter().map(|p| (p.pid, p.activity)).collect(),
        );
        if self.active_only {
            processes.retain(|p| last.get(&p.pid) != Some(&p.activity));
        }
        processes.sort_by(|a, b| b.inuse_bytes.cmp(&a.inuse_bytes).then(a.pid.cmp(&b.pid)));
        processes.truncate(self.top);
        processes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(pid: u32, inuse_bytes: u64, activity: u64) -> ProcessFigures {
        ProcessFigures {
            pid,
            inuse_bytes,
            activity,
            ..ProcessFigures::default()
        }
    }

    fn pids(processes: &[ProcessFigures]) -> Vec<u32> {
        processes.iter().map(|p| p.pid).collect()
    }

    #[test]
    fn with_all_only_processes_active_since_the_last_profile_are_exported() {
        let mut selection = Selection::new(true, 100);
        let first = selection.select(vec![process(1, 10, 5), process(2, 20, 7)]);
        assert_eq!(pids(&first), [2, 1], "all are new: all active");
        // 1 allocated or freed, 2 did not, 3 is new.
        let second = selection.select(vec![process(1, 10, 6), process(2, 20, 7), process(3, 5, 1)]);
        assert_eq!(pids(&second), [1, 3]);
        // 2 comes back once it is active again.
        let third = selection.select(vec![process(1, 10, 6), process(2, 20, 9)]);
        assert_eq!(pids(&third), [2]);
    }

    #[test]
    fn at_most_top_processes_by_bytes_in_use() {
        let mut selection = Selection::new(false, 2);
        let chosen = selection.select(vec![
            process(1, 10, 1),
            process(2, 30, 1),
            process(3, 20, 1),
            process(4, 20, 1),
        ]);
        assert_eq!(pids(&chosen), [2, 3]);
        // Without --all an idle process stays.
        let again = selection.select(vec![process(1, 10, 1)]);
        assert_eq!(pids(&again), [1]);
    }
}
