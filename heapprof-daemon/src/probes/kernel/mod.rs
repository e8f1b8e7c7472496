//! Kernel mode: event layouts from tracefs, loading and attaching the tracepoint programs.
//!
//! The rooms, by job: `events` (which kmem events a session uses and where their
//! fields are, from tracefs), `load` (loading the BPF object for kernel mode),
//! `attach` (the tracepoint and raw-tracepoint programs), `deferred` (the fentry or
//! kprobe programs that see `kfree_rcu` and bulk frees) and `verifier_log` (the
//! verifier's reason for a refusal, found in its log).

mod attach;
mod deferred;
mod events;
mod load;
mod verifier_log;

pub use self::{
    attach::attach,
    deferred::{DeferredFreeWatch, DeferredFrees, attach_deferred_frees, freed_key, watch_key},
    events::{EventSelection, LayoutError, event_layout, resolve_events},
    load::{load_bpf_object, program},
    verifier_log::verifier_reason,
};
