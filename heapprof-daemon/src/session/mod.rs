//! Tracing sessions: from attached probes to profiles on disk.
//!
//! `user` profiles the C library's allocator in processes; `kernel` profiles the
//! kernel heap from the kmem tracepoints. Both write the same kind of profile.

pub mod kernel;
mod user;

pub use user::{Session, SessionConfig, TopSite};
