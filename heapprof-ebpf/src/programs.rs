//! The programs and maps (see the crate documentation for the flow).

use aya_ebpf::{
    bindings::{BPF_F_USER_STACK, BPF_NOEXIST},
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::{map, uprobe, uretprobe},
    maps::{HashMap, PerCpuArray, PerCpuHashMap, StackTrace},
    programs::{ProbeContext, RetProbeContext, tracing::StackIdContext as _},
};
use heapprof_common::{
    AllocKind, Config, DropReason, InFlight, LiveBlock, LiveKey, STACK_ID_UNKNOWN, SiteCounters,
    StackKey,
};

// Capacities are placeholders: the daemon sets them from its flags before loading.
#[map(name = "IN_FLIGHT")]
static IN_FLIGHT: HashMap<u64, InFlight> = HashMap::with_max_entries(16384, 0);
#[map(name = "LIVE")]
static LIVE: HashMap<LiveKey, LiveBlock> = HashMap::with_max_entries(1 << 20, 0);
#[map(name = "SITES")]
static SITES: PerCpuHashMap<StackKey, SiteCounters> = PerCpuHashMap::with_max_entries(65536, 0);
#[map(name = "STACKS")]
static STACKS: StackTrace = StackTrace::with_max_entries(65536, 0);
#[map(name = "DROPS")]
static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(DropReason::COUNT, 0);

/// Written by the daemon before loading (read-only data).
#[unsafe(no_mangle)]
static CONFIG: Config = Config {
    page_size: 4096,
    ignore_tgid: 0,
    _pad: 0,
};

const EEXIST: i32 = 17;

#[inline(always)]
fn count_drop(reason: DropReason) {
    if let Some(slot) = DROPS.get_ptr_mut(reason as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *slot += 1 };
    }
}

/// Starts tracking an allocator call, or deepens the nesting of the one in progress.
#[inline(always)]
fn enter(kind: AllocKind, size: u64, old_ptr: u64, out_ptr: u64) {
    let tid = bpf_get_current_pid_tgid();
    if ignored(tid) {
        return;
    }
    if let Some(state) = IN_FLIGHT.get_ptr_mut(&tid) {
        // SAFETY: the entry belongs to this thread; nothing else writes it.
        unsafe {
            if (*state).depth > 0 {
                // Nested inside another allocator call of this thread: the outer call is the user's.
                (*state).depth += 1;
                return;
            }
        }
    }
    let state = InFlight {
        size,
        old_ptr,
        out_ptr,
        depth: 1,
        kind: kind as u32,
    };
    if IN_FLIGHT.insert(&tid, &state, 0).is_err() {
        count_drop(DropReason::InFlightFull);
    }
}

/// Adds `delta` to the counters of `site`, creating them on first use.
#[inline(always)]
fn add_to_site(
    site: &StackKey,
    alloc_objects: u64,
    alloc_bytes: u64,
    free_objects: u64,
    free_bytes: u64,
) -> bool {
    let mut counters = SITES.get_ptr_mut(site);
    if counters.is_none() {
        let zero = SiteCounters::default();
        // Another CPU may have created it meanwhile: NOEXIST then fails harmlessly.
        let _ = SITES.insert(site, &zero, BPF_NOEXIST as u64);
        counters = SITES.get_ptr_mut(site);
    }
    match counters {
        Some(counters) => {
            // SAFETY: this CPU's copy of a per-CPU value.
            unsafe {
                (*counters).alloc_objects += alloc_objects;
                (*counters).alloc_bytes += alloc_bytes;
                (*counters).free_objects += free_objects;
                (*counters).free_bytes += free_bytes;
            }
            true
        }
        None => false,
    }
}

/// Credits the free of a tracked block to the site that allocated it.
#[inline(always)]
fn release(tgid: u32, ptr: u64) {
    if ptr == 0 {
        return;
    }
    let key = LiveKey { ptr, tgid, _pad: 0 };
    // SAFETY: the value is copied out before the entry is removed.
    let Some(block) = (unsafe { LIVE.get(&key) }).copied() else {
        // Allocated before tracing began (or not tracked): ignored, never negative.
        return;
    };
    let _ = LIVE.remove(&key);
    add_to_site(&block.site, 0, 0, 1, block.size);
}

/// Whether the calling process is the one the daemon asked to ignore (itself).
#[inline(always)]
fn ignored(pid_tgid: u64) -> bool {
    // SAFETY: CONFIG is a plain global; volatile so the loader's value is read, not the default.
    let ignore = unsafe { core::ptr::read_volatile(&CONFIG.ignore_tgid) };
    ignore != 0 && (pid_tgid >> 32) as u32 == ignore
}

#[inline(always)]
fn page_size() -> u64 {
    // SAFETY: CONFIG is a plain global; volatile so the loader's value is read, not the default.
    let page = unsafe { core::ptr::read_volatile(&CONFIG.page_size) };
    if page == 0 { 4096 } else { page }
}

#[inline(always)]
fn arg(ctx: &ProbeContext, n: usize) -> u64 {
    ctx.arg::<u64>(n).unwrap_or(0)
}

#[uprobe]
pub fn malloc_enter(ctx: ProbeContext) -> u32 {
    enter(AllocKind::Malloc, arg(&ctx, 0), 0, 0);
    0
}

#[uprobe]
pub fn calloc_enter(ctx: ProbeContext) -> u32 {
    enter(
        AllocKind::Calloc,
        arg(&ctx, 0).wrapping_mul(arg(&ctx, 1)),
        0,
        0,
    );
    0
}

#[uprobe]
pub fn realloc_enter(ctx: ProbeContext) -> u32 {
    enter(AllocKind::Realloc, arg(&ctx, 1), arg(&ctx, 0), 0);
    0
}

#[uprobe]
pub fn reallocarray_enter(ctx: ProbeContext) -> u32 {
    let size = arg(&ctx, 1).wrapping_mul(arg(&ctx, 2));
    enter(AllocKind::Reallocarray, size, arg(&ctx, 0), 0);
    0
}

#[uprobe]
pub fn posix_memalign_enter(ctx: ProbeContext) -> u32 {
    enter(AllocKind::PosixMemalign, arg(&ctx, 2), 0, arg(&ctx, 0));
    0
}

#[uprobe]
pub fn aligned_alloc_enter(ctx: ProbeContext) -> u32 {
    enter(AllocKind::AlignedAlloc, arg(&ctx, 1), 0, 0);
    0
}

#[uprobe]
pub fn memalign_enter(ctx: ProbeContext) -> u32 {
    enter(AllocKind::Memalign, arg(&ctx, 1), 0, 0);
    0
}

#[uprobe]
pub fn valloc_enter(ctx: ProbeContext) -> u32 {
    enter(AllocKind::Valloc, arg(&ctx, 0), 0, 0);
    0
}

#[uprobe]
pub fn pvalloc_enter(ctx: ProbeContext) -> u32 {
    // glibc hands out whole pages (and one page for a request of 0).
    let page = page_size();
    let mut size = arg(&ctx, 0);
    size = if size == 0 {
        page
    } else {
        (size + page - 1) / page * page
    };
    enter(AllocKind::Pvalloc, size, 0, 0);
    0
}

#[uretprobe]
pub fn alloc_return(ctx: RetProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(state) = IN_FLIGHT.get_ptr_mut(&pid_tgid) else {
        // The entry happened before the probes were attached.
        return 0;
    };
    // SAFETY: this thread's own entry.
    let state = unsafe {
        (*state).depth -= 1;
        if (*state).depth > 0 {
            return 0;
        }
        *state
    };
    let _ = IN_FLIGHT.remove(&pid_tgid);
    let tgid = (pid_tgid >> 32) as u32;
    let returned: u64 = ctx.ret();

    let Some(kind) = AllocKind::from_u32(state.kind) else {
        return 0;
    };
    let ptr = match kind {
        AllocKind::PosixMemalign => {
            if returned != 0 {
                return 0; // an error code: nothing allocated
            }
            // SAFETY: bpf_probe_read_user checks the user address.
            match unsafe { bpf_probe_read_user(state.out_ptr as *const u64) } {
                Ok(ptr) => ptr,
                Err(_) => {
                    count_drop(DropReason::OutPtrUnreadable);
                    return 0;
                }
            }
        }
        AllocKind::Realloc | AllocKind::Reallocarray => {
            // Success (or realloc(p, 0), which frees p and returns NULL): the old block is gone.
            if state.old_ptr != 0 && (returned != 0 || state.size == 0) {
                release(tgid, state.old_ptr);
            }
            returned
        }
        _ => returned,
    };
    if ptr == 0 {
        return 0;
    }

    // At return the caller's frame pointer is restored and the IP is the return
    // address, so the first frame is the allocator's immediate caller.
    let stack_id = match ctx.get_stackid(&STACKS, BPF_F_USER_STACK as u64) {
        Ok(id) => id as u32,
        Err(err) => {
            count_drop(if err == -EEXIST {
                DropReason::StackCollision
            } else {
                DropReason::StackLost
            });
            STACK_ID_UNKNOWN
        }
    };
    let site = StackKey {
        tgid,
        stack_id,
        kind: kind as u32,
        _pad: 0,
    };
    if !add_to_site(&site, 1, state.size, 0, 0) {
        count_drop(DropReason::SiteTableFull);
        return 0;
    }
    let key = LiveKey { ptr, tgid, _pad: 0 };
    let block = LiveBlock {
        size: state.size,
        site,
    };
    let mut inserted = LIVE.insert(&key, &block, BPF_NOEXIST as u64);
    if inserted == Err(-EEXIST) {
        // Still recorded at this address: it was freed by a path we did not see (the
        // allocator reused it). Close it so its site's in-use stays right. Checked only
        // on this rare failure, so the common path costs one map operation.
        release(tgid, ptr);
        inserted = LIVE.insert(&key, &block, BPF_NOEXIST as u64);
    }
    if inserted.is_err() {
        count_drop(DropReason::LiveTableFull);
    }
    0
}

#[uprobe]
pub fn free_enter(ctx: ProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if ignored(pid_tgid) {
        return 0;
    }
    // SAFETY: read-only look at this thread's own entry.
    if let Some(state) = unsafe { IN_FLIGHT.get(&pid_tgid) } {
        if state.depth > 0 {
            // free called by realloc(p, 0): the realloc is the user's call.
            return 0;
        }
    }
    release((pid_tgid >> 32) as u32, arg(&ctx, 0));
    0
}
