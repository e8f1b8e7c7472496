//! heapprofd's daemon as a library: the binary (`main.rs`) wires these modules
//! together; the integration tests use them to decode and check profiles.

pub mod aggregate;
pub mod allocators;
pub mod app;
pub mod arch;
mod bpf_array;
pub mod cgroup;
pub mod cli;
pub mod environ;
pub mod health;
pub mod inject;
pub mod launch;
mod mapped_file;
pub mod memory_peaks;
pub mod memstats;
pub mod metrics;
pub mod placement;
pub mod pprof;
pub mod preflight;
pub mod preload;
pub mod probes;
pub mod procmaps;
pub mod profiles_file;
#[cfg(test)]
mod proptests;
pub mod push;
pub mod report;
pub mod session;
pub mod stats_file;
pub mod symbolize;
mod sys;
pub mod system_preload;
#[cfg(test)]
mod test_rng;
pub mod tracefs;
pub mod unwind;
