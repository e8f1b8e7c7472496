//! The allocators of the traced processes: which functions to probe, where, and what
//! their arguments mean to the BPF programs.
//!
//! - `api`: the functions heapprofd knows (C's malloc family, C++'s `operator
//!   new`/`delete`, jemalloc, tcmalloc, mimalloc) and where each keeps its size and block;
//! - `spec`: custom allocators named with `--allocator`;
//! - `scan`: which of those an ELF object defines, and where their probes go;
//! - `frame_depth`: how far below its entry a function's own code takes the stack;
//! - `serving`: which object a process's `malloc` binds to;
//! - `registry`: the probed functions' slots, shared with the programs, their probes,
//!   and the processes whose allocator cannot be seen.

pub mod api;
pub mod frame_depth;
pub mod registry;
pub mod scan;
pub mod serving;
pub mod spec;

pub use self::registry::{AllocatorProbes, ProbeSettings, ProcessView, SlotInfo};
