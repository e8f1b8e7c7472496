//! Which allocations count: not heapprofd's own, only the cgroup's with `--cgroup`,
//! and only the traced processes' (and their children's) for `--pid` or a command.

use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid,
    macros::{map, tracepoint},
    maps::{HashMap, PerCpuArray},
    programs::TracePointContext,
};
use heapprof_common::kernel::KernelEvent;

use super::{
    config::{KERNEL_CONFIG, config_u32, layout},
    record::field,
};

#[map(name = "TRACED")]
static TRACED: HashMap<u32, u32> = HashMap::with_max_entries(65536, 0);
/// The process of each CPU's last allocation found in `TRACED` (see [`counted`]).
#[map(name = "LAST_TRACED")]
static LAST_TRACED: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Whether allocations made in the current context count.
#[inline(always)]
pub(super) fn counted(tgid: u32) -> bool {
    let ignore = config_u32(&KERNEL_CONFIG.ignore_tgid);
    if ignore != 0 && tgid == ignore {
        return false;
    }
    // SAFETY: a plain global, read as `config_u32` reads them.
    let cgroup = unsafe { core::ptr::read_volatile(&KERNEL_CONFIG.cgroup_id) };
    if !crate::maps::in_cgroup(cgroup, config_u32(&KERNEL_CONFIG.cgroup_level)) {
        return false;
    }
    if config_u32(&KERNEL_CONFIG.filter_processes) == 0 {
        return true;
    }
    // The process of this CPU's last counted allocation: a process stays in TRACED
    // once added, so it counts again without the hash lookup.
    let last = LAST_TRACED.get_ptr_mut(0);
    // SAFETY: this CPU's slot.
    let last_tgid = last.map_or(0, |last| unsafe { *last });
    if last_tgid == tgid && tgid != 0 {
        return true;
    }
    // SAFETY: a lookup whose value is not used.
    let traced = unsafe { TRACED.get(&tgid) }.is_some();
    if traced && let Some(last) = last {
        // SAFETY: this CPU's slot.
        unsafe { *last = tgid };
    }
    traced
}

/// A launched command's children count as the command: a traced process's fork
/// adds the child to `TRACED`.
#[tracepoint]
pub fn sched_process_fork(ctx: TracePointContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // SAFETY: a lookup whose value is not used.
    if unsafe { TRACED.get(&tgid) }.is_none() {
        return 0;
    }
    if let Some(child) = field(&ctx, layout(KernelEvent::ProcessFork).ptr) {
        let _ = TRACED.insert(&(child as u32), &1, 0);
    }
    0
}
