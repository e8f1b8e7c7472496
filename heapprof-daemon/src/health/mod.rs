//! The loaded BPF programs' health, as the daemon measures and reports it: the
//! kernel's run-time statistics of the programs and how they looked up stacks
//! (stats.rs), the runs the kernel skipped of each (skipped_runs.rs), the kernel
//! memory their maps hold (map_memory.rs), and the programs' own log lines
//! (bpf_log.rs).
//!
//! Apart from `probes/`, which loads and attaches the programs: these modules only
//! read what the loaded programs and their maps show.

pub mod bpf_log;
pub mod map_memory;
pub mod skipped_runs;
pub mod stats;
