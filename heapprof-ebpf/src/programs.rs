//! The programs and maps (see the crate documentation for the flow).

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_NOEXIST},
    helpers::{bpf_get_current_pid_tgid, bpf_get_prandom_u32, bpf_probe_read_user},
    macros::{map, raw_tracepoint, uprobe, uretprobe},
    maps::{HashMap, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{ProbeContext, RawTracePointContext, RetProbeContext},
};
use heapprof_common::{
    AllocKind, Config, DropReason, ExecEvent, InFlight, LiveBlock, LiveKey, MAX_STACK_DEPTH,
    MAX_STACK_SPAN, SiteCounters, StackKey, UserStack,
};

// Capacities are placeholders: the daemon sets them from its flags before loading.
#[map(name = "IN_FLIGHT")]
static IN_FLIGHT: HashMap<u64, InFlight> = HashMap::with_max_entries(16384, 0);
#[map(name = "LIVE")]
static LIVE: HashMap<LiveKey, LiveBlock> = HashMap::with_max_entries(1 << 20, 0);
#[map(name = "SITES")]
static SITES: PerCpuHashMap<StackKey, SiteCounters> = PerCpuHashMap::with_max_entries(65536, 0);
// Written only when a site is new, so allocated on demand rather than preallocated
// (a preallocated table of 1 KiB stacks would pin tens of MiB of kernel memory).
#[map(name = "STACKS")]
static STACKS: HashMap<u64, UserStack> = HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);
/// Per-CPU room to assemble a stack (too big for the 512-byte BPF stack).
#[map(name = "STACK_SCRATCH")]
static STACK_SCRATCH: PerCpuArray<UserStack> = PerCpuArray::with_max_entries(1, 0);
#[map(name = "DROPS")]
static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(DropReason::COUNT, 0);
#[map(name = "SAMPLER")]
static SAMPLER: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);
#[map(name = "EXEC_GEN")]
static EXEC_GEN: HashMap<u32, u32> = HashMap::with_max_entries(16384, 0);
#[map(name = "EXEC_EVENTS")]
static EXEC_EVENTS: RingBuf = RingBuf::with_byte_size(64 * 1024, 0);

/// Written by the daemon before loading (read-only data).
#[unsafe(no_mangle)]
static CONFIG: Config = Config {
    page_size: 4096,
    ignore_tgid: 0,
    target_tgid: 0,
    sample_rate: 0,
};

const EEXIST: i32 = 17;
/// Multiplier of the stack hash (2^64 / golden ratio).
const HASH_MULTIPLIER: u64 = 0x9e37_79b9_7f4a_7c15;

/// The return address (the caller's next instruction), frame pointer and stack pointer
/// at a return probe: the caller's frame pointer is restored by then.
#[inline(always)]
fn caller_registers(ctx: &RetProbeContext) -> (u64, u64, u64) {
    #[cfg(bpf_target_arch = "x86_64")]
    // SAFETY: ctx.regs is the probe's pt_regs, readable by the program.
    unsafe {
        let regs = &*ctx.regs;
        (regs.rip, regs.rbp, regs.rsp)
    }
    #[cfg(bpf_target_arch = "aarch64")]
    // SAFETY: the kernel's arm64 pt_regs begins with user_pt_regs.
    unsafe {
        let regs = &*(ctx.regs as *const aya_ebpf::bindings::user_pt_regs);
        (regs.pc, regs.regs[29], regs.sp)
    }
    #[cfg(not(any(bpf_target_arch = "x86_64", bpf_target_arch = "aarch64")))]
    {
        let _ = ctx;
        (0, 0, 0)
    }
}

/// Walks the caller's frame-pointer chain into the per-CPU scratch stack and hashes it
/// with the process id; returns the site key and the stack (stored by [`add_to_site`]
/// when the site is new).
///
/// The walk is the kernel's user-stack walk (frame record = saved frame pointer, then
/// return address, on x86-64 and arm64) with one difference: a frame pointer is only
/// followed while it points into the stack above the stack pointer and grows. Chains
/// end in code built without frame pointers (glibc's start code), and reading their
/// garbage faults more often than not: that fault cost ~0.6 µs per allocation.
#[inline(always)]
fn record_stack(
    ctx: &RetProbeContext,
    tgid: u32,
    kind: AllocKind,
) -> Option<(StackKey, &'static UserStack)> {
    // SAFETY: a plain value copied out of the map.
    let exec_gen = unsafe { EXEC_GEN.get(&tgid) }.copied().unwrap_or(0);
    let scratch = STACK_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's scratch slot; programs on one CPU do not interleave.
    let stack = unsafe { &mut *scratch };
    let (ip, mut fp, sp) = caller_registers(ctx);
    stack.frames[0] = ip;
    stack.len = 1;
    let mut hash = (u64::from(tgid) ^ ip).wrapping_mul(HASH_MULTIPLIER);
    // The depth lives in the scratch memory, not in a register that outlives the loop:
    // every way out of the loop then leaves the verifier the same state to continue
    // from, so it checks the rest of the program once instead of once per exit.
    for depth in 1..MAX_STACK_DEPTH as usize {
        if fp < sp || fp - sp > MAX_STACK_SPAN || fp & 7 != 0 {
            break;
        }
        // SAFETY: bpf_probe_read_user checks the user address.
        let Ok(record) = (unsafe { bpf_probe_read_user(fp as *const [u64; 2]) }) else {
            break;
        };
        if record[1] == 0 {
            break;
        }
        stack.frames[depth] = record[1];
        stack.len = depth as u32 + 1;
        hash = (hash ^ record[1]).wrapping_mul(HASH_MULTIPLIER);
        hash ^= hash >> 29;
        if record[0] <= fp {
            break;
        }
        fp = record[0];
        if depth == MAX_STACK_DEPTH as usize - 1 {
            count_drop(DropReason::StackTruncated);
        }
    }
    let site = StackKey {
        tgid,
        exec_gen,
        stack: hash,
        kind: kind as u32,
        _pad: 0,
    };
    Some((site, stack))
}

/// Counts an event that could not be fully recorded.
#[inline(always)]
pub(crate) fn count_drop(reason: DropReason) {
    if let Some(slot) = DROPS.get_ptr_mut(reason as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *slot += 1 };
    }
}

/// Starts tracking an allocator call, or deepens the nesting of the one in progress.
///
/// A thread's entry stays in IN_FLIGHT between calls and is rewritten in place: one
/// lookup per call instead of an insert at entry and a delete at return.
#[inline(always)]
fn enter(kind: AllocKind, size: u64, old_ptr: u64, out_ptr: u64) {
    let tid = bpf_get_current_pid_tgid();
    if ignored(tid) {
        return;
    }
    let existing = IN_FLIGHT.get_ptr_mut(&tid);
    if let Some(state) = existing {
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
        sampled: sampled(size) as u32,
        _pad: 0,
    };
    match existing {
        // SAFETY: as above.
        Some(slot) => unsafe { *slot = state },
        None => {
            if IN_FLIGHT.insert(&tid, &state, 0).is_err() {
                count_drop(DropReason::InFlightFull);
            }
        }
    }
}

/// Whether an allocation of `size` bytes is recorded: always, unless sampling, where
/// allocations are picked by a Poisson process over bytes (each byte equally likely,
/// mean one pick every `sample_rate` bytes), as in Go and tcmalloc.
#[inline(always)]
fn sampled(size: u64) -> bool {
    // SAFETY: CONFIG is a plain global; volatile so the loader's value is read.
    let rate = unsafe { core::ptr::read_volatile(&CONFIG.sample_rate) };
    if rate == 0 {
        return true;
    }
    let Some(remaining) = SAMPLER.get_ptr_mut(0) else {
        return true;
    };
    // SAFETY: this CPU's slot; programs on one CPU do not interleave.
    unsafe {
        if *remaining == 0 {
            *remaining = exponential(rate);
        }
        if size < *remaining {
            *remaining -= size;
            false
        } else {
            *remaining = exponential(rate);
            true
        }
    }
}

/// A draw from the exponential distribution with mean `mean` (at least 1), in integer
/// arithmetic: -ln(u) * mean with u uniform in (0, 1], from a binary logarithm.
/// Branch-free, so the verifier walks it once.
#[inline(always)]
fn exponential(mean: u64) -> u64 {
    // SAFETY: a helper without arguments or preconditions.
    let x = u64::from(unsafe { bpf_get_prandom_u32() } | 1);
    // Integer part of log2(x) by halving; `(high + mask) >> bits` is 1 when high != 0.
    let mut msb = 0u64;
    let mut y = x;
    for bits in [16u64, 8, 4, 2, 1] {
        let shift = (((y >> bits) + ((1 << bits) - 1)) >> bits) * bits;
        y >>= shift;
        msb += shift;
    }
    // Fractional part, 12 bits, by repeated squaring of the mantissa in Q1.31
    // (a square at or above 2.0 yields a 1 bit and is halved).
    let mut mantissa = x << (31 - msb);
    let mut fraction = 0u64;
    for _ in 0..12 {
        mantissa = (mantissa * mantissa) >> 31;
        let bit = mantissa >> 32;
        mantissa >>= bit;
        fraction = (fraction << 1) | bit;
    }
    // -log2(x / 2^32) in Q.12, then times ln 2 (2839/4096) and the mean.
    let neg_log2 = (32 << 12) - ((msb << 12) | fraction);
    let draw = (((mean * neg_log2) >> 12) * 2839) >> 12;
    draw | u64::from(draw == 0)
}

/// Adds to the counters of `site`, creating them on first use; a new site's stack,
/// when given, is stored then (one site lookup per call on the common path).
#[inline(always)]
fn add_to_site(
    site: &StackKey,
    new_stack: Option<&UserStack>,
    alloc_objects: u64,
    alloc_bytes: u64,
    free_objects: u64,
    free_bytes: u64,
) -> bool {
    let mut counters = SITES.get_ptr_mut(site);
    if counters.is_none() {
        if let Some(stack) = new_stack {
            // Another kind at the same stack may have stored it already.
            match STACKS.insert(&site.stack, stack, BPF_NOEXIST as u64) {
                Ok(()) => {}
                Err(err) if err == -EEXIST => {}
                Err(_) => count_drop(DropReason::StackTableFull),
            }
        }
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
    add_to_site(&block.site, None, 0, 0, 1, block.size);
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
        if (*state).depth == 0 {
            // Return of a call entered before the probes were attached.
            return 0;
        }
        (*state).depth -= 1;
        if (*state).depth > 0 {
            return 0;
        }
        *state
    };
    let tgid = (pid_tgid >> 32) as u32;
    let returned: u64 = ctx.ret();

    let Some(kind) = AllocKind::from_u32(state.kind) else {
        return 0;
    };
    let resizes = matches!(kind, AllocKind::Realloc | AllocKind::Reallocarray);
    if state.sampled == 0 && !resizes {
        return 0;
    }
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
    if ptr == 0 || state.sampled == 0 {
        return 0;
    }

    let Some((site, stack)) = record_stack(&ctx, tgid, kind) else {
        return 0;
    };
    if !add_to_site(&site, Some(stack), 1, state.size, 0, 0) {
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
        // Its free cannot be matched: count it as released now, so that in-use stays
        // what is tracked instead of growing by blocks that may be long gone.
        count_drop(DropReason::LiveTableFull);
        add_to_site(&site, None, 0, 0, 1, state.size);
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

/// A process replaced its image: later allocations get the next exec generation, so
/// that their frames are read with the new mappings and the old image's with the old.
/// A raw tracepoint, so that user mode needs no tracefs.
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn process_exec(_ctx: RawTracePointContext) -> i32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: CONFIG is a plain global; volatile so the loader's value is read.
    let target = unsafe { core::ptr::read_volatile(&CONFIG.target_tgid) };
    if ignored(pid_tgid) || (target != 0 && target != tgid) {
        return 0;
    }
    let exec_gen = match EXEC_GEN.get_ptr_mut(&tgid) {
        // SAFETY: only this process's exec writes its entry, and it runs once at a time.
        Some(slot) => unsafe {
            *slot += 1;
            *slot
        },
        None => {
            if EXEC_GEN.insert(&tgid, &1, 0).is_err() {
                count_drop(DropReason::ExecTableFull);
                return 0;
            }
            1
        }
    };
    // The exec kills the other threads, possibly inside an allocator call: the thread
    // now holding the leader's id must not inherit a nesting depth from one of them.
    if let Some(state) = IN_FLIGHT.get_ptr_mut(&pid_tgid) {
        // SAFETY: this thread's own entry.
        unsafe { (*state).depth = 0 };
    }
    // Lost only when the daemon is far behind; it then reads the maps on its next dump.
    let _ = EXEC_EVENTS.output(&ExecEvent { tgid, exec_gen }, 0);
    0
}
