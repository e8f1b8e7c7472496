//! Forks of traced processes unwound with their origin's mappings until their own are
//! read (see `heapprof_common::unwind::ForkOrigin`): the program on
//! `sched:sched_process_fork` that records each fork's origin.
//!
//! A classic tracepoint, whose record gives the child's pid where tracefs says (the
//! layout differs between kernels). tracefs is mounted where it is not (as kernel mode
//! does: a host without systemd has none); where that fails it is left out, and a
//! fork's first stacks stop where they did before: at its first frame outside the
//! mappings read.

use anyhow::{Context as _, Result};
use aya::{Ebpf, programs::TracePoint};
use heapprof_common::names;

use crate::tracefs;

/// Where the fork event's record holds `child_pid`, or why it is not known.
pub fn child_pid_offset() -> Result<u32> {
    let root = tracefs::root()?;
    let format = tracefs::event_format(&root, names::SCHED_CATEGORY, names::FORK_TRACEPOINT)?
        .context("the kernel has no sched_process_fork tracepoint")?;
    let field = format
        .field("child_pid")
        .context("sched_process_fork's record has no child_pid field")?;
    anyhow::ensure!(
        field.size == 4 && field.offset > 0,
        "sched_process_fork's child_pid is {} bytes at offset {}, not a 32-bit pid",
        field.size,
        field.offset
    );
    Ok(field.offset)
}

/// Attaches [`names::PROG_FORK`] to `sched:sched_process_fork`.
pub fn attach(ebpf: &mut Ebpf) -> Result<()> {
    let program: &mut TracePoint = ebpf
        .program_mut(names::PROG_FORK)
        .with_context(|| format!("BPF program {} missing", names::PROG_FORK))?
        .try_into()
        .with_context(|| format!("BPF program {} is not a tracepoint", names::PROG_FORK))?;
    program
        .load()
        .with_context(|| format!("verifying BPF program {}", names::PROG_FORK))?;
    program
        .attach(names::SCHED_CATEGORY, names::FORK_TRACEPOINT)
        .with_context(|| {
            format!(
                "attaching to the tracepoint {}:{}",
                names::SCHED_CATEGORY,
                names::FORK_TRACEPOINT
            )
        })?;
    Ok(())
}
