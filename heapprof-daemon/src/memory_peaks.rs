//! heapprofd's memory-heavy jobs take turns: an interval's dump with the tidying
//! after it (its tables of every site read, sorted and encoded; the live table read
//! to retire exited processes) and a push's OTLP request (every sample translated
//! into a request of up to tens of MB). Each alone keeps the daemon within its
//! memory goal; at once, they add up (docs/performance.md, "While pushing"). A dump
//! waits at most for one request's build, and a build for one dump; sending a built
//! request (which may wait on a slow backend) is never held up.

use std::sync::{Mutex, MutexGuard, PoisonError};

static HEAVY_JOB: Mutex<()> = Mutex::new(());

/// Held while one memory-heavy job runs; the next waits for it to drop.
pub struct HeavyJob {
    _turn: MutexGuard<'static, ()>,
}

/// Waits for any other memory-heavy job to end, then holds the turn until the
/// returned value is dropped. Never hold it across an `.await`.
pub fn one_at_a_time() -> HeavyJob {
    // A panic in another job leaves nothing to repair: the lock guards no data.
    HeavyJob {
        _turn: HEAVY_JOB.lock().unwrap_or_else(PoisonError::into_inner),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{
        sync::atomic::{AtomicUsize, Ordering},
        thread,
        time::Duration,
    };

    #[test]
    fn jobs_never_overlap() {
        static RUNNING: AtomicUsize = AtomicUsize::new(0);
        static MOST: AtomicUsize = AtomicUsize::new(0);
        let workers: Vec<_> = (0..4)
            .map(|_| {
                thread::spawn(|| {
                    for _ in 0..20 {
                        let _turn = one_at_a_time();
                        let now = RUNNING.fetch_add(1, Ordering::SeqCst) + 1;
                        MOST.fetch_max(now, Ordering::SeqCst);
                        thread::sleep(Duration::from_micros(200));
                        RUNNING.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().expect("worker");
        }
        assert_eq!(MOST.load(Ordering::SeqCst), 1);
    }
}
