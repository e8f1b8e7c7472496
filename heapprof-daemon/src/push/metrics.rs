//! The push's counters, by target: served with the daemon's other metrics
//! (`--metrics`) and summed up in the log at exit.

use prometheus_client::{
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::{Registry, Unit},
};

/// The label set of one target's series: `target="URL"` (without credentials).
type TargetLabels = Vec<(String, String)>;

/// Every target's counters.
#[derive(Debug, Clone, Default)]
pub struct PushMetrics {
    sent: Family<TargetLabels, Counter>,
    failed: Family<TargetLabels, Counter>,
    spooled: Family<TargetLabels, Counter>,
    dropped: Family<TargetLabels, Counter>,
    waiting: Family<TargetLabels, Gauge>,
    waiting_bytes: Family<TargetLabels, Gauge>,
}

impl PushMetrics {
    /// The process's counters: the session's metrics endpoint and the push thread
    /// both reach them, without the start-up passing them along.
    pub fn shared() -> &'static PushMetrics {
        static SHARED: std::sync::OnceLock<PushMetrics> = std::sync::OnceLock::new();
        SHARED.get_or_init(PushMetrics::default)
    }

    /// Registers the families in `registry` (under its `heapprofd` prefix).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "push_sent",
            "Profiles (one per process with --all) a push backend took",
            self.sent.clone(),
        );
        registry.register(
            "push_failed",
            "Pushes that failed (each retry counts): unreachable, timed out, refused or rejected",
            self.failed.clone(),
        );
        registry.register(
            "push_spooled",
            "Profiles queued in the push spool for a backend (each once; most leave it at once)",
            self.spooled.clone(),
        );
        registry.register(
            "push_dropped",
            "Profiles never pushed: the spool full (oldest first), rejected by the backend, or left in memory at exit",
            self.dropped.clone(),
        );
        registry.register(
            "push_spool_profiles",
            "Profiles waiting in the push spool now",
            self.waiting.clone(),
        );
        registry.register_with_unit(
            "push_spool",
            "Size of the profiles waiting in the push spool now",
            Unit::Bytes,
            self.waiting_bytes.clone(),
        );
    }

    /// The counters of the target shown as `target`.
    pub fn target(&self, target: &str) -> TargetMetrics {
        let labels = vec![("target".to_owned(), target.to_owned())];
        TargetMetrics {
            sent: self.sent.get_or_create(&labels).clone(),
            failed: self.failed.get_or_create(&labels).clone(),
            spooled: self.spooled.get_or_create(&labels).clone(),
            dropped: self.dropped.get_or_create(&labels).clone(),
            waiting: self.waiting.get_or_create(&labels).clone(),
            waiting_bytes: self.waiting_bytes.get_or_create(&labels).clone(),
        }
    }
}

/// One target's counters (shared with the families: a clone counts in them).
#[derive(Debug, Clone)]
pub struct TargetMetrics {
    /// Profiles the backend took.
    pub sent: Counter,
    /// Failed pushes.
    pub failed: Counter,
    /// Profiles queued.
    pub spooled: Counter,
    /// Profiles never pushed.
    pub dropped: Counter,
    /// Profiles waiting now.
    pub waiting: Gauge,
    /// Their bytes.
    pub waiting_bytes: Gauge,
}

impl TargetMetrics {
    /// `N sent, N failed pushes, N spooled, N dropped`, for the log.
    pub fn describe(&self) -> String {
        format!(
            "{} sent, {} failed pushes, {} spooled, {} dropped",
            self.sent.get(),
            self.failed.get(),
            self.spooled.get(),
            self.dropped.get()
        )
    }
}
