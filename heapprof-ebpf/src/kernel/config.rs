//! What the daemon sets before loading (`KERNEL_CONFIG`: the events' field positions,
//! the process and cgroup filters, the sampling rate), read volatile so the loader's
//! values are seen, and the constants the kernel programs share.

use heapprof_common::kernel::{EventLayout, FieldRef, FuncArgs, KernelConfig, KernelEvent};

const NO_FIELD: FieldRef = FieldRef { offset: 0, size: 0 };
const NO_LAYOUT: EventLayout = EventLayout {
    ptr: NO_FIELD,
    call_site: NO_FIELD,
    bytes_req: NO_FIELD,
    bytes_alloc: NO_FIELD,
    order: NO_FIELD,
    name: NO_FIELD,
};

/// Written by the daemon before loading (read-only data).
#[unsafe(no_mangle)]
pub(super) static KERNEL_CONFIG: KernelConfig = KernelConfig {
    events: [NO_LAYOUT; KernelEvent::COUNT],
    page_size: 4096,
    ignore_tgid: 0,
    filter_processes: 0,
    cgroup_id: 0,
    cgroup_level: 0,
    func_args: FuncArgs::Helper as u32,
    sample_rate: 0,
};

pub(super) const EEXIST: i32 = 17;

/// Multiplier of the stack hash (2^64 / golden ratio).
pub(super) const HASH_MULTIPLIER: u64 = 0x9e37_79b9_7f4a_7c15;

#[inline(always)]
pub(super) fn layout(event: KernelEvent) -> EventLayout {
    // SAFETY: a plain global; volatile so the loader's value is read, not the default.
    unsafe { core::ptr::read_volatile(&KERNEL_CONFIG.events[event as usize]) }
}

#[inline(always)]
pub(super) fn config_u64(field: &u64) -> u64 {
    // SAFETY: a field of the read-only global; volatile as above.
    unsafe { core::ptr::read_volatile(field) }
}

#[inline(always)]
pub(super) fn config_u32(field: &u32) -> u32 {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(field) }
}
