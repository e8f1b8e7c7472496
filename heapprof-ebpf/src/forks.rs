//! Forks of traced processes unwound with their origin's mappings until their own are
//! loaded (see `heapprof_common::unwind::ForkOrigin`): a child shares its parent's
//! code at the same addresses until it execs, and a short-lived one (a shell's fork
//! before its exec) is gone before the daemon could read its own mappings.

use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid,
    macros::{map, tracepoint},
    maps::LruHashMap,
    programs::TracePointContext,
};
use heapprof_common::unwind::{ForkOrigin, ProcessMappings};

use crate::maps::{EXEC_GEN, PROCESS_MAPPINGS, fork_child_pid_offset, ignored, target_tgid};

/// Each fork's origin, by the child's tgid (sized by the daemon). Entries are
/// overwritten or removed at the next fork that gives the number out again, so a
/// stale one never outlives its process's number.
#[map(name = "FORK_ORIGINS")]
static FORK_ORIGINS: LruHashMap<u32, ForkOrigin> = LruHashMap::with_max_entries(4096, 0);

/// The exec generation of process `tgid` (0 before its first exec under tracing).
#[inline(always)]
fn exec_gen_of(tgid: u32) -> u32 {
    // SAFETY: a plain value copied out of the map.
    unsafe { EXEC_GEN.get(&tgid) }.copied().unwrap_or(0)
}

/// A process (or a thread: the record does not tell, and a thread's entry is never
/// looked up, since lookups are by tgid) was forked: the child's origin is written, or
/// a stale entry of its number removed.
#[tracepoint]
pub fn process_fork(ctx: TracePointContext) -> u32 {
    let offset = fork_child_pid_offset();
    let pid_tgid = bpf_get_current_pid_tgid();
    if offset == 0 || ignored(pid_tgid) {
        return 0;
    }
    // SAFETY: read_at reads the record through bpf_probe_read_kernel, which checks it.
    let Ok(child) = (unsafe { ctx.read_at::<u32>(offset as usize) }) else {
        return 0;
    };
    let parent = (pid_tgid >> 32) as u32;
    // SAFETY: lookups whose values are copied.
    let parent_has_mappings = unsafe { PROCESS_MAPPINGS.get(&parent) }.is_some();
    // SAFETY: as above.
    let parent_origin = unsafe { FORK_ORIGINS.get(&parent) }.copied();
    match ForkOrigin::of_fork(
        parent,
        exec_gen_of(parent),
        parent_has_mappings,
        parent_origin.as_ref(),
        target_tgid(),
        exec_gen_of(child),
    ) {
        Some(origin) => {
            let _ = FORK_ORIGINS.insert(&child, &origin, 0);
        }
        None => {
            let _ = FORK_ORIGINS.remove(&child);
        }
    }
    0
}

/// Whether process `tgid` descends from the target by forks seen (with one target:
/// its forks are traced as it is).
#[inline(always)]
pub fn descends_from_target(tgid: u32) -> bool {
    // SAFETY: a lookup whose value is not used.
    unsafe { FORK_ORIGINS.get(&tgid) }.is_some()
}

/// Traced process `tgid` replaced its image (now `exec_gen`): what it was forked from
/// no longer applies, but its entry stays as its mark (see `ForkOrigin::at_exec`).
/// Returns the origin that held for the replaced image, if one did.
#[inline(always)]
pub fn exec(tgid: u32, exec_gen: u32) -> Option<ForkOrigin> {
    // SAFETY: a plain value copied out of the map.
    let replaced = unsafe { FORK_ORIGINS.get(&tgid) }.copied()?;
    let _ = FORK_ORIGINS.insert(&tgid, &ForkOrigin::at_exec(tgid, exec_gen), 0);
    replaced
        .holds_for(exec_gen.wrapping_sub(1))
        .then_some(replaced)
}

/// The mappings that unwind process `tgid`'s image `exec_gen` when it has none of its
/// own: its fork origin's, with that process's tgid (the rule cache's key).
#[inline(always)]
pub fn origin_mappings(tgid: u32, exec_gen: u32) -> Option<(u32, &'static ProcessMappings)> {
    // SAFETY: a plain value copied out of the map.
    let origin = unsafe { FORK_ORIGINS.get(&tgid) }.copied()?;
    // The child still runs the image it was forked with, and the origin too (an
    // exec of the origin replaced its entry with its new image's mappings).
    if !origin.holds_for(exec_gen) || exec_gen_of(origin.tgid) != origin.exec_gen {
        return None;
    }
    let origin_tgid = origin.tgid;
    // SAFETY: the value is only read; the daemon replaces whole entries.
    let mappings = unsafe { PROCESS_MAPPINGS.get(&origin_tgid) }?;
    Some((origin_tgid, mappings))
}
