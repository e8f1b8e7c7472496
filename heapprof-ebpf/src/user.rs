//! The user-mode programs: allocator entry and return probes, process events.
//!
//! One entry program serves every probed function of every allocator, told apart by
//! the attach cookie (a [`ProbeSlot`]) whose [`ProbeSpec`] says what the function does
//! and where its arguments are. Kernels with multi-uprobe links (6.6+) attach it once
//! per object; older ones one perf event per function. Both forms run [`on_entry`].
//! Sampled sessions on kernels with uprobe session links (6.13+) attach
//! [`entry_session`] instead, one program for the entries and the returns, whose entry
//! skips the return probe of the calls it does not record.

use aya_ebpf::{
    EbpfContext as _,
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_pid_tgid, bpf_get_func_ip, bpf_probe_read_user,
        bpf_send_signal_thread,
    },
    macros::{raw_tracepoint, tracepoint, uprobe, uretprobe},
    programs::{ProbeContext, RawTracePointContext, RetProbeContext, TracePointContext},
};
use heapprof_common::{
    DropReason, ExecEvent, InFlight, NO_REGISTER, ProbeRole, ProbeSlot, ProbeSpec,
    unwind::{MappingsRequest, RequestReason},
};

use crate::{
    calls::{self, Call, FreeCall},
    maps::{
        EXEC_EVENTS, EXEC_GEN, LOADER_SYNCS, MAPPINGS_REQUESTS, PRELOADED, PROCESS_MAPPINGS,
        REPORT_QUEUES, THREAD_ON_CPU, armed, control, count_drop, empty_programs,
        hold_at_loader_events, ignored, page_size, preloaded, probe_spec, slot_by_page_offset,
        stacks_only, target_tgid,
    },
    regs,
    sites::{self, Frees, NewSite, Usage},
    stack, threads,
    walk_cache::{self, WalkStart},
};

/// The signal that holds a launched command at a loader event. Its tracer intercepts
/// it (a ptraced process stops before any signal is delivered) and suppresses it; were
/// it ever delivered, SIGCONT's default action does nothing.
const SIGCONT: u32 = 18;

/// The size a call asks for: its size register (or the spec's fixed size), times its
/// count register, rounded to pages for pvalloc.
#[inline(always)]
fn requested_size(ctx: &ProbeContext, spec: &ProbeSpec) -> u64 {
    let mut size = if spec.size_reg == NO_REGISTER {
        spec.fixed_size
    } else {
        regs::value_register(ctx, spec.size_reg)
    };
    if spec.count_reg != NO_REGISTER {
        size = size.wrapping_mul(regs::value_register(ctx, spec.count_reg));
    }
    if spec.round_to_pages != 0 {
        // glibc hands out whole pages (and one page for a request of 0).
        let page = page_size();
        size = if size == 0 {
            page
        } else {
            size.div_ceil(page) * page
        };
    }
    size
}

/// Whether a probe hit in a process the preload library serves is a call the library
/// reports: made by the library (its forwarding of the program's call) or inside an
/// allocator library (a function it calls on the way). The program's own calls of
/// allocator functions the library does not wrap (jemalloc's `mallocx`, `mi_*`, a pool
/// or a static allocator in the program) come from outside.
#[inline(always)]
fn preload_call(ctx: &ProbeContext, spec: &ProbeSpec, pid_tgid: u64) -> bool {
    let Some(library) = preloaded((pid_tgid >> 32) as u32) else {
        return false;
    };
    let (ip, sp) = regs::at_entry(ctx);
    let caller = regs::return_address_at_entry(ctx, sp.wrapping_add(u64::from(spec.sp_adjust)));
    if caller >= library.text_start && caller < library.text_end {
        return true;
    }
    let offset = caller.wrapping_sub(ip.wrapping_sub(spec.probe_offset));
    spec.in_library != 0 && offset >= spec.text_start && offset < spec.text_end
}

/// The entry probe of the function in `slot`, once the programs are armed, in a thread
/// that is not ignored: free's accounting, or the call matching. `pid_tgid` is the
/// thread's id and `record` its call record, which the caller reads once (the id's
/// read is a helper call, and the record's a table lookup the session program makes
/// anyway). Returns whether the call's return probe has anything to do (see
/// [`calls::enter`]).
#[inline(always)]
fn on_entry(
    ctx: &ProbeContext,
    slot: ProbeSlot,
    pid_tgid: u64,
    record: Option<*mut InFlight>,
) -> bool {
    let Some(spec) = probe_spec(slot) else {
        return false;
    };
    let Some(role) = ProbeRole::from_u32(spec.role) else {
        return false;
    };
    if preload_call(ctx, spec, pid_tgid) {
        return false;
    }
    let old_ptr = regs::value_register(ctx, spec.ptr_reg);
    if role == ProbeRole::Free {
        on_free(ctx, spec, pid_tgid, old_ptr, record);
        return false;
    }
    let out_ptr = regs::value_register(ctx, spec.out_reg);
    calls::enter(
        ctx,
        spec,
        (pid_tgid, record),
        Call {
            slot,
            size: requested_size(ctx, spec),
            old_ptr,
            out_ptr,
        },
    )
}

/// A free function's probe: credits the block to its site, unless an allocator call
/// in progress made it (realloc's own free).
#[inline(always)]
fn on_free(
    ctx: &ProbeContext,
    spec: &ProbeSpec,
    pid_tgid: u64,
    ptr: u64,
    record: Option<*mut InFlight>,
) {
    let temporary = match calls::free_call(ctx, spec, ptr, record) {
        FreeCall::Nested => return,
        FreeCall::Temporary => true,
        FreeCall::Other => false,
    };
    if stacks_only() {
        return;
    }
    sites::release((pid_tgid >> 32) as u32, ptr, temporary);
}

/// The shared return probe: counts the user's call when it returns.
#[inline(always)]
fn on_return(ctx: &RetProbeContext, pid_tgid: u64) {
    let Some(state) = calls::returned(ctx, pid_tgid) else {
        return;
    };
    let tgid = (pid_tgid >> 32) as u32;
    let returned: u64 = ctx.ret();
    let Some(spec) = probe_spec(state.slot) else {
        return;
    };
    let Some(role) = ProbeRole::from_u32(spec.role) else {
        return;
    };
    let resizes = matches!(role, ProbeRole::Realloc | ProbeRole::ResizeInPlace);
    if state.sampled == 0 && !resizes {
        return;
    }
    let ptr = match role {
        ProbeRole::Free => return,
        ProbeRole::Alloc if spec.out_reg != NO_REGISTER => {
            if returned != 0 {
                return; // an error code: nothing allocated
            }
            // SAFETY: bpf_probe_read_user checks the user address.
            match unsafe { bpf_probe_read_user(state.out_ptr as *const u64) } {
                Ok(ptr) => ptr,
                Err(_) => {
                    count_drop(DropReason::OutPtrUnreadable);
                    return;
                }
            }
        }
        ProbeRole::Alloc => returned,
        ProbeRole::Realloc => {
            // Success (or realloc(p, 0), which frees p and returns NULL): the old block is gone.
            if state.old_ptr != 0 && (returned != 0 || state.size == 0) && !stacks_only() {
                sites::release(tgid, state.old_ptr, state.old_ptr == state.last_block);
            }
            returned
        }
        ProbeRole::ResizeInPlace => {
            // The usable size: below the request, the block kept its old size.
            if returned < state.size {
                return;
            }
            if !stacks_only() {
                sites::release(tgid, state.old_ptr, false);
            }
            state.old_ptr
        }
    };
    if ptr == 0 {
        return;
    }
    calls::note_last_block(pid_tgid, ptr);
    if state.sampled == 0 {
        return;
    }
    let start = stack::walk_start(ctx, pid_tgid, state.exec_gen, state.slot, state.size);
    if stacks_only() {
        stack::find_only(&start);
        return;
    }
    count_at_site(&start, tgid, ptr, state.size);
}

/// Counts the sampled block `ptr` of `size` bytes of process `tgid` at the site of
/// the stack `start` begins: a remembered walk's, or a new walk's (remembered for the
/// next call when it can be).
#[inline(always)]
fn count_at_site(start: &WalkStart, tgid: u32, ptr: u64, size: u64) {
    if let Some(site) = stack::remembered(start) {
        sites::allocated_at(tgid, (ptr, size), site, &mut Usage::direct(), Frees::OnTime);
        return;
    }
    if let Some(recorded) = stack::walk(start)
        && let Some(site) = sites::allocated(
            tgid,
            ptr,
            size,
            &recorded.site,
            NewSite::Stack(recorded.frames),
        )
        && recorded.remembered
    {
        walk_cache::note_site(start, site);
    }
}

/// The attach cookie of a multi-uprobe: the probed function's slot.
#[inline(always)]
fn cookie_slot(ctx: &ProbeContext) -> ProbeSlot {
    // SAFETY: the helper reads the cookie of the link that ran this program.
    unsafe { bpf_get_attach_cookie(ctx.as_ptr()) as ProbeSlot }
}

/// An entry probe's run on a kernel without session links.
#[inline(always)]
fn classic_entry(ctx: &ProbeContext) {
    if empty_programs() || !armed() {
        return;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    if ignored(pid_tgid) {
        return;
    }
    on_entry(ctx, cookie_slot(ctx), pid_tgid, threads::record(pid_tgid));
}

#[uprobe]
pub fn entry(ctx: ProbeContext) -> u32 {
    classic_entry(&ctx);
    0
}

#[uprobe(multi)]
pub fn entry_multi(ctx: ProbeContext) -> u32 {
    classic_entry(&ctx);
    0
}

/// The entries and returns of an object's functions through one uprobe session link
/// (`BPF_TRACE_UPROBE_SESSION`, Linux 6.13+; sampled sessions only). The kernel runs
/// it at a call's entry and, unless the entry returned nonzero, again at its return.
///
/// A run is an entry while none of the thread's calls awaits its return
/// (`InFlight::returns_awaited`, counted when an entry returns 0): nearly every run, as
/// only the sampled calls ask for their return. Otherwise the instruction pointer
/// tells: at an entry it is the probe's address (`bpf_get_func_ip`, which a session
/// program gets at both), at a return the caller's return address, which follows a
/// call instruction and so is never a probed function's first instruction or a
/// placement past one. (The kfunc `bpf_session_is_return` says the same; this needs no
/// kernel BTF.) A helper call costs about 19 ns as a run's first and 5-12 ns after
/// (`docs/performance.md`), against about 50 ns for the rest of an unsampled call's
/// program, so the count spares this one. An entry finds its function's slot by its probe's page
/// offset (`SLOT_BY_PAGE_OFFSET`) where only one probe has that offset, sparing the
/// attach-cookie helper as well.
///
/// Loaded by the daemon itself (aya loads multi-uprobe programs for
/// `BPF_TRACE_UPROBE_MULTI` only), never by aya: `bpf_get_func_ip` does not exist
/// before 5.15, and the other programs must load everywhere. Written out instead of
/// with `#[uprobe(multi)]`, whose wrapper returns 0 whatever the program returns: the
/// return value is the whole point here (in the section aya's macro would give it).
#[unsafe(no_mangle)]
#[unsafe(link_section = "uprobe.multi")]
pub fn entry_session(ctx: *mut core::ffi::c_void) -> u32 {
    if empty_programs() {
        // The sampled trap floor: one trap per call, no return probe at all (the
        // least any sampler on probes pays, since every call must be seen).
        return 1;
    }
    let control = control();
    if control.armed == 0 {
        // Nothing counts yet, and no call asked for its return.
        return 1;
    }
    let pid_tgid = current_thread(control.thread_cache != 0);
    let record = threads::record(pid_tgid);
    if calls::return_awaited(record) {
        let (ip, _) = regs::at_entry(&ProbeContext::new(ctx));
        // SAFETY: the helper reads the probe's address from the program's run context.
        if ip != unsafe { bpf_get_func_ip(ctx) } {
            calls::return_arrived(record);
            session_return(ctx, pid_tgid);
            return 0;
        }
    }
    session_entry(ctx, pid_tgid, record)
}

/// [`entry_session`] at an entry: 1 when the return has nothing to do. A function of
/// its own (a BPF-to-BPF call), as is [`session_return`]: the two paths inlined in one
/// frame would exceed the 512 bytes of stack the verifier allows a chain of calls
/// before 6.18 ("combined stack size of 3 calls is 560" on 6.12).
#[inline(never)]
fn session_entry(ctx: *mut core::ffi::c_void, pid_tgid: u64, record: Option<*mut InFlight>) -> u32 {
    if ignored(pid_tgid) {
        return 1;
    }
    let ctx = ProbeContext::new(ctx);
    let (ip, _) = regs::at_entry(&ctx);
    let slot = slot_by_page_offset(ip).unwrap_or_else(|| cookie_slot(&ctx));
    u32::from(!on_entry(&ctx, slot, pid_tgid, record))
}

/// [`entry_session`] at a return.
#[inline(never)]
fn session_return(ctx: *mut core::ffi::c_void, pid_tgid: u64) {
    on_return(&RetProbeContext::new(ctx), pid_tgid);
}

#[uretprobe]
pub fn alloc_return(ctx: RetProbeContext) -> u32 {
    if empty_programs() {
        return 0;
    }
    on_return(&ctx, bpf_get_current_pid_tgid());
    0
}

#[uretprobe(multi)]
pub fn alloc_return_multi(ctx: RetProbeContext) -> u32 {
    if empty_programs() {
        return 0;
    }
    on_return(&ctx, bpf_get_current_pid_tgid());
    0
}

/// The dynamic loader mapped or unmapped objects (it calls `_dl_debug_state`, the
/// debuggers' hook, at start-up once the program's libraries are mapped and around
/// every `dlopen`/`dlclose`, before the new objects' code runs): the daemon reads the
/// process's mappings. A launched command is held until they are loaded.
#[inline(always)]
fn on_loader_event() {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if ignored(pid_tgid) || !armed() {
        return;
    }
    if hold_at_loader_events() && tgid == target_tgid() {
        if let Some(count) = LOADER_SYNCS.get_ptr_mut(0) {
            // SAFETY: the loader serializes its events (its load lock).
            unsafe { *count += 1 };
        }
        // SAFETY: signals the current thread, the one in the loader.
        unsafe { bpf_send_signal_thread(SIGCONT) };
        return;
    }
    let _ = MAPPINGS_REQUESTS.output(
        &MappingsRequest {
            tgid,
            reason: RequestReason::Loader as u32,
        },
        0,
    );
}

#[uprobe]
pub fn loader_state(_ctx: ProbeContext) -> u32 {
    on_loader_event();
    0
}

#[uprobe(multi)]
pub fn loader_state_multi(_ctx: ProbeContext) -> u32 {
    on_loader_event();
    0
}

/// A process replaced its image: later allocations get the next exec generation, so
/// that their frames are read with the new mappings and the old image's with the old.
/// A raw tracepoint, so that user mode needs no tracefs.
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn process_exec(_ctx: RawTracePointContext) -> i32 {
    // An exec from a thread other than the leader takes the leader's id, maybe with
    // no switch since.
    forget_thread_on_cpu();
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let target = target_tgid();
    // With one target (a launched command), its forks' execs are followed too.
    if ignored(pid_tgid)
        || (target != 0 && target != tgid && !crate::forks::descends_from_target(tgid))
    {
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
    // Whatever it was forked from, the new image shares none of its code.
    let replaced_origin = crate::forks::exec(tgid, exec_gen).unwrap_or_default();
    // The exec kills the other threads, possibly inside an allocator call: the thread
    // now holding the leader's id must not inherit a call in progress from one of them.
    calls::exec(pid_tgid, exec_gen);
    // The new image says for itself whether the preload library serves it; the old
    // image's queue of this thread is gone with it.
    let _ = PRELOADED.remove(&tgid);
    let _ = REPORT_QUEUES.remove(&pid_tgid);
    // The old image's mappings are gone; the daemon loads the new ones.
    let _ = PROCESS_MAPPINGS.remove(&tgid);
    // So are its blocks (the daemon retires them from the live table).
    crate::usage::reset(tgid);
    // Lost only when the daemon is far behind; it then reads the maps on its next dump.
    let event = ExecEvent {
        tgid,
        exec_gen,
        replaced_origin,
    };
    let _ = EXEC_EVENTS.output(&event, 0);
    0
}

/// The current thread's id (`pid_tgid`): from this CPU's cache while no context switch
/// has cleared it, else from the helper, which then fills the cache. A helper call is
/// a run's dearest step (about 19 ns as its first call); the current task changes only
/// through a switch, which [`thread_on_cpu_reset`] sees. The cache is used only once
/// the daemon has attached that program (`Control::thread_cache`, `cache_on`), and
/// filled only by armed programs, after it.
#[inline(always)]
fn current_thread(cache_on: bool) -> u64 {
    if !cache_on {
        return bpf_get_current_pid_tgid();
    }
    let Some(cached) = THREAD_ON_CPU.get_ptr_mut(0) else {
        return bpf_get_current_pid_tgid();
    };
    // SAFETY: this CPU's slot; the program runs with migration disabled, and a task
    // that preempts it is switched in and out through `thread_on_cpu_reset`.
    let known = unsafe { *cached };
    if known != 0 {
        return known;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    // SAFETY: as above.
    unsafe { *cached = pid_tgid };
    pid_tgid
}

/// Forgets this CPU's cached thread id ([`current_thread`]).
#[inline(always)]
fn forget_thread_on_cpu() {
    if let Some(cached) = THREAD_ON_CPU.get_ptr_mut(0) {
        // SAFETY: this CPU's slot.
        unsafe { *cached = 0 };
    }
}

/// A context switch: the CPU's cached thread id is no longer its current thread's.
/// Attached in sessions with uprobe session links.
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn thread_on_cpu_reset(_ctx: RawTracePointContext) -> i32 {
    forget_thread_on_cpu();
    0
}

/// A thread is switched out: a preloaded thread's queued records are applied (see
/// `preload::apply_pending`). Attached in sessions that use the library only.
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn thread_switch(_ctx: RawTracePointContext) -> i32 {
    if empty_programs() || !armed() {
        return 0;
    }
    crate::preload::apply_pending(bpf_get_current_pid_tgid());
    0
}

/// A system call's entry: a preloaded thread that calls `futex` has its queued
/// records applied first. It may be about to wake another thread (a mutex, condition
/// variable or barrier with waiters), and whatever that thread frees next must not
/// come off the in-use total before the blocks this one allocated earlier are added,
/// or the peak would miss them. One that calls `execve` or `execveat` has them applied
/// while its image is still there (see `preload::exec_starts`). Every other call
/// returns at once.
#[raw_tracepoint(tracepoint = "sys_enter")]
pub fn thread_syscall(ctx: RawTracePointContext) -> i32 {
    // sys_enter's arguments are (struct pt_regs *, long id).
    let id: i64 = ctx.arg(1);
    let exec = id == crate::regs::EXECVE_SYSCALL || id == crate::regs::EXECVEAT_SYSCALL;
    if (id != crate::regs::FUTEX_SYSCALL && !exec) || empty_programs() || !armed() {
        return 0;
    }
    if exec {
        crate::preload::exec_starts(bpf_get_current_pid_tgid());
    } else {
        crate::preload::apply_pending(bpf_get_current_pid_tgid());
    }
    0
}

/// `futex`'s entry alone (`syscalls:sys_enter_futex`): as [`thread_syscall`], attached
/// instead of it where the kernel has the tracepoint, so that the host's other system
/// calls run no program.
#[tracepoint]
pub fn futex_entry(_ctx: TracePointContext) -> i32 {
    if empty_programs() || !armed() {
        return 0;
    }
    crate::preload::apply_pending(bpf_get_current_pid_tgid());
    0
}

/// The entry of `execve` and of `execveat` (`syscalls:sys_enter_execve*`): as
/// [`thread_syscall`] for those calls, attached beside [`futex_entry`].
#[tracepoint]
pub fn exec_entry(_ctx: TracePointContext) -> i32 {
    if empty_programs() || !armed() {
        return 0;
    }
    crate::preload::exec_starts(bpf_get_current_pid_tgid());
    0
}

/// A thread exits: its call record goes with it, so that a thread reusing its id later
/// starts clean (the thread may have died inside an allocator call).
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn thread_exit(_ctx: RawTracePointContext) -> i32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    calls::forget(pid_tgid);
    crate::preload::thread_exit(pid_tgid);
    0
}
