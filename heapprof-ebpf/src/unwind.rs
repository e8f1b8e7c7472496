//! Unwinding user stacks with the daemon's CFI tables (`heapprof_common::unwind`).
//!
//! From the caller's registers at the allocator's return, each step finds the frame's
//! rule (the process's mapping for the address, then the mapping's object's rows by
//! binary search, then the rule), computes the canonical frame address (the caller's
//! stack pointer) and reads the caller's return address and frame pointer from the
//! stack. Where no table covers an address (JIT code, a mapping not loaded yet), `auto`
//! mode takes one frame-pointer step instead. A stack that cannot be completed keeps
//! the frames found so far, and the address where it stopped is counted in
//! `UNWIND_GAPS` with the reason, so the daemon can name the object and offset.
//!
//! The lookups' pure parts (the binary search's steps, whether a mapping holds an
//! address and a row gives it a rule, the address in the object's file) are
//! `heapprof_common::unwind`'s, tested there.

use core::ffi::c_void;

use aya_ebpf::{
    helpers::{bpf_ktime_get_ns, bpf_loop, bpf_probe_read_user, bpf_probe_read_user_buf},
    macros::map,
    maps::PerCpuArray,
};
use heapprof_common::{
    DropReason, MAX_STACK_DEPTH, MAX_STACK_SPAN, UserStack,
    unwind::{
        CACHED_RULE_FOUND, CfaRule, ExecMapping, GapReason, MAPPING_SEARCH_STEPS,
        MAX_PROCESS_MAPPINGS, MappingsRequest, NO_OBJECT, ProcessMappings, ROW_SEARCH_STEPS,
        RULE_CACHE_ENTRIES, RegRule, RequestReason, SearchRange, UnwindGap, UnwindMode, UnwindRule,
        object_address,
    },
};

use heapprof_common::preload::{REPLY_READS, StackReply};

use crate::maps::{
    MAPPINGS_REQUESTED, MAPPINGS_REQUESTS, PROCESS_MAPPINGS, REPLY_SCRATCH, RULE_CACHE,
    ReplyScratch, STACK_REACH, STACK_SCRATCH, STACK_WINDOW, STACK_WINDOW_BYTES, STACK_WINDOW_WORDS,
    StackReach, UNWIND_GAPS, UNWIND_OBJECTS, UNWIND_ROWS, UNWIND_RULES, count_drop, count_only,
};

/// Multiplier of the stack hash (2^64 / golden ratio).
const HASH_MULTIPLIER: u64 = 0x9e37_79b9_7f4a_7c15;

/// A process asks for its mappings at most this often (ns).
const REQUEST_INTERVAL_NS: u64 = 1_000_000_000;

/// User addresses fit in 48 bits; arm64 return addresses signed with pointer
/// authentication carry the code above them.
#[cfg(bpf_target_arch = "aarch64")]
const ADDRESS_MASK: u64 = (1 << 48) - 1;
#[cfg(not(bpf_target_arch = "aarch64"))]
const ADDRESS_MASK: u64 = u64::MAX;

/// Whether the stack pointer after a frame-pointer step is known: on x86-64 a frame
/// record sits right below the caller's stack pointer (`push %rbp` after the call); on
/// arm64 it sits at the bottom of the frame, so the caller's stack pointer is unknown.
#[cfg(bpf_target_arch = "aarch64")]
const FP_STEP_KNOWS_SP: bool = false;
#[cfg(not(bpf_target_arch = "aarch64"))]
const FP_STEP_KNOWS_SP: bool = true;

/// The registers of the frame being unwound.
#[repr(C)]
#[derive(Clone, Copy)]
struct Frame {
    /// Where the frame executes (a return address, except for the first frame).
    pc: u64,
    /// Address to look the rule up at: `pc` for the first frame, which is exactly at
    /// the return from the allocator, `pc - 1` (inside the call) for the others.
    lookup: u64,
    sp: u64,
    fp: u64,
    /// Whether `sp` is known (see [`FP_STEP_KNOWS_SP`]).
    sp_known: bool,
}

/// [`Walk::flags`]: the walk notes the places of the stack words it reads, for an
/// answer to the preload library (see `heapprof_common::preload::StackReply`).
const NOTING_READS: u32 = 1;
/// The walk's frames depend on more than the caller's registers and the words read
/// (a mapping lookup, an unaligned read, too many reads), or it was cut short.
const UNANSWERABLE: u32 = 2;
/// The walk used the caller's frame pointer register.
const USES_FP: u32 = 4;
/// A walk without mappings of its process's own has looked for its fork origin's.
const ORIGIN_TRIED: u32 = 8;

/// [`Walk::fp_source`] when the frame pointer is still the caller's register; 0 when
/// it is a constant or its source was noted; else the stack address it was read from.
/// A saved frame pointer is noted only once a rule uses it: in code built without
/// frame pointers it is any value, and noting it would make the answer fail whenever
/// that value changes, for nothing.
const FP_FROM_CALLER: u64 = 1;

// `copy_to_window`'s length arithmetic is written for a 4 KiB window.
const _: () = assert!(STACK_WINDOW_BYTES == 4096);

/// Why a stack ended.
enum Stop {
    /// At its outermost frame: complete.
    Complete,
    /// Cut short at the frame's address, for this reason.
    Cut(GapReason),
}

fn read_user(address: u64) -> Option<u64> {
    // SAFETY: bpf_probe_read_user checks the user address.
    unsafe { bpf_probe_read_user(address as *const u64) }.ok()
}

/// Reads the 8 bytes at `address` of the user stack through the walk's window: one
/// `bpf_probe_read_user` copies up to 4 KiB, costing mostly its fixed part (~100 ns
/// here), little per byte. A copy never reaches past what is known to be mapped: a
/// copy that reached past the stack's top would fault whole and have to be made again,
/// the costliest case of all (a main thread allocating near its stack's top hit it on
/// every allocation). So the first copy of a walk reaches as far as the previous walk
/// of the same thread on this CPU read ([`crate::maps::StackReach`]), and otherwise
/// each copy goes to the end of its address's 4 KiB block, which lies within one page.
#[inline(always)]
fn stack_read(walk: &mut Walk, address: u64) -> Option<u64> {
    let value = stack_read_unnoted(walk, address)?;
    note_read(walk, address, value);
    Some(value)
}

/// [`stack_read`], without noting the place (see [`FP_FROM_CALLER`]).
#[inline(always)]
fn stack_read_unnoted(walk: &mut Walk, address: u64) -> Option<u64> {
    if address & 7 != 0 {
        walk.flags |= UNANSWERABLE;
        return read_user(address);
    }
    let mut offset = address.wrapping_sub(walk.window_base);
    if offset >= u64::from(walk.window_len) {
        if !fill_window(walk, address) {
            return read_user(address);
        }
        offset = 0;
    }
    let window = STACK_WINDOW.get(0)?;
    Some(window.words[(offset / 8) as usize & (STACK_WINDOW_WORDS - 1)])
}

/// The walk uses the frame's frame pointer: its source is noted.
#[inline(always)]
fn use_fp(walk: &mut Walk) {
    match walk.fp_source {
        0 => {}
        FP_FROM_CALLER => walk.flags |= USES_FP,
        // The frame pointer was read from there: it is the word's value.
        address => note_read(walk, address, walk.frame.fp),
    }
    walk.fp_source = 0;
}

/// Notes the place and value of a word the walk reads, when it does so for an answer.
#[inline(always)]
fn note_read(walk: &mut Walk, address: u64, value: u64) {
    if walk.flags & (NOTING_READS | UNANSWERABLE) != NOTING_READS {
        return;
    }
    let Some(scratch) = REPLY_SCRATCH.get_ptr_mut(0) else {
        walk.flags |= UNANSWERABLE;
        return;
    };
    // SAFETY: this CPU's slot; programs on one CPU do not interleave.
    let scratch = unsafe { &mut *scratch };
    let index = scratch.reply.reads as usize;
    let offset = address.wrapping_sub(scratch.base) as i64;
    if index >= REPLY_READS || offset < i64::from(i32::MIN) || offset > i64::from(i32::MAX) {
        walk.flags |= UNANSWERABLE;
        return;
    }
    scratch.reply.offsets[index] = offset as i32;
    scratch.values[index] = value;
    scratch.reply.reads = index as u32 + 1;
}

/// Copies the stack from `address` into this CPU's window: up to the walk's known
/// reach, at most the window's size, else to the end of the address's 4 KiB block.
/// A reach that proves wrong (the thread switched stacks) is dropped.
#[inline(always)]
fn fill_window(walk: &mut Walk, address: u64) -> bool {
    let to_block_end = STACK_WINDOW_BYTES - (address as usize & (STACK_WINDOW_BYTES - 1));
    let to_reach = walk.reach.wrapping_sub(address) as usize;
    if walk.reach > address && to_reach > to_block_end {
        if copy_to_window(walk, address, to_reach.min(STACK_WINDOW_BYTES)) {
            return true;
        }
        walk.reach = 0;
    }
    copy_to_window(walk, address, to_block_end)
}

/// Copies `len` bytes of the stack at `address` into this CPU's window. A read that
/// faults anywhere fails whole.
#[inline(always)]
fn copy_to_window(walk: &mut Walk, address: u64, len: usize) -> bool {
    let Some(window) = STACK_WINDOW.get_ptr_mut(0) else {
        return false;
    };
    if len > STACK_WINDOW_BYTES || len == 0 {
        return false;
    }
    // The compiler may hand the read a copy of the length it spilled before the
    // checks, whose bounds Linux 6.1's verifier does not know. Computed in assembly,
    // which the compiler cannot see into, the length carries its bounds in every
    // copy: ((len - 1) & 4095) + 1 is len for 1..=4096 and within them for any value.
    let mut len = len as u64;
    // SAFETY: arithmetic on a register.
    unsafe {
        core::arch::asm!(
            "{len} += -1",
            "{len} &= 0xfff",
            "{len} += 1",
            len = inout(reg) len,
            options(nostack)
        );
    }
    let len = len as usize;
    // SAFETY: a prefix of this CPU's slot, viewed as bytes; programs on one CPU do not
    // interleave.
    let bytes =
        unsafe { core::slice::from_raw_parts_mut((*window).words.as_mut_ptr().cast::<u8>(), len) };
    // SAFETY: bpf_probe_read_user_buf checks the user address.
    if unsafe { bpf_probe_read_user_buf(address as *const u8, bytes) }.is_err() {
        return false;
    }
    walk.window_base = address;
    walk.window_len = len as u32;
    walk.reach = walk.reach.max(address + len as u64);
    true
}

/// A binary search in progress: the last entry whose start is at most `key` lies in
/// `[low, low + len)`. Its steps run as a `bpf_loop` callback: a loop unrolled by the
/// verifier would be verified again on every path through the frame step.
#[repr(C)]
struct Search {
    /// The process's mappings (mapping search) or unused (row search).
    mappings: *const ProcessMappings,
    /// The object's first row (row search).
    first_row: u32,
    /// The candidates left (heapprof-common's steps).
    range: SearchRange,
    /// Explicit padding.
    _pad: u32,
    /// What is searched for.
    key: u64,
}

/// One step of the search over a process's mappings.
extern "C" fn mapping_step(_index: u64, context: *mut c_void) -> i64 {
    // SAFETY: `find_mapping` passes its own `Search`, alive for the whole loop.
    let search = unsafe { &mut *context.cast::<Search>() };
    if search.range.done() {
        return 1;
    }
    let middle = search.range.middle() as usize & (MAX_PROCESS_MAPPINGS - 1);
    // SAFETY: a map value pointer, valid while the program runs.
    let start = unsafe { (*search.mappings).mappings[middle].start };
    search.range.narrow(start, search.key);
    0
}

/// One step of the search over an object's rows.
extern "C" fn row_step(_index: u64, context: *mut c_void) -> i64 {
    // SAFETY: `find_rule` passes its own `Search`, alive for the whole loop.
    let search = unsafe { &mut *context.cast::<Search>() };
    if search.range.done() {
        return 1;
    }
    let Some(row) = UNWIND_ROWS.get(search.first_row.wrapping_add(search.range.middle())) else {
        search.range.len = 0;
        return 1;
    };
    search.range.narrow(u64::from(row.pc), search.key);
    0
}

/// The mapping holding `address`, by binary search over the sorted mappings.
#[inline(always)]
fn find_mapping(mappings: &ProcessMappings, address: u64) -> Option<&ExecMapping> {
    let count = mappings.count;
    if count == 0 || count as usize > MAX_PROCESS_MAPPINGS {
        return None;
    }
    let mut search = Search {
        mappings,
        first_row: 0,
        range: SearchRange::new(count),
        _pad: 0,
        key: address,
    };
    // SAFETY: the callback is a BPF subprogram taking the context pointer given here,
    // which stays valid for the call.
    unsafe {
        bpf_loop(
            MAPPING_SEARCH_STEPS,
            mapping_step as *mut c_void,
            (&raw mut search).cast(),
            0,
        );
    }
    let mapping = &mappings.mappings[search.range.low as usize & (MAX_PROCESS_MAPPINGS - 1)];
    mapping.contains(address).then_some(mapping)
}

/// The rule of `address` in the object of `mapping`: `Err` names why there is none.
#[inline(always)]
fn find_rule(mapping: &ExecMapping, address: u64) -> Result<UnwindRule, GapReason> {
    if mapping.object == NO_OBJECT {
        return Err(GapReason::NoTable);
    }
    let object = UNWIND_OBJECTS
        .get(mapping.object)
        .ok_or(GapReason::NoTable)?;
    let vaddr = object_address(address, mapping.bias).ok_or(GapReason::NoRule)?;
    if object.rows == 0 {
        return Err(GapReason::NoRule);
    }
    let mut search = Search {
        mappings: core::ptr::null(),
        first_row: object.first_row,
        range: SearchRange::new(object.rows),
        _pad: 0,
        key: vaddr,
    };
    // SAFETY: as in `find_mapping`.
    unsafe {
        bpf_loop(
            ROW_SEARCH_STEPS,
            row_step as *mut c_void,
            (&raw mut search).cast(),
            0,
        );
    }
    if search.range.len == 0 {
        return Err(GapReason::NoRule);
    }
    let row = UNWIND_ROWS
        .get(object.first_row.wrapping_add(search.range.low))
        .ok_or(GapReason::NoRule)?;
    if !row.covers(vaddr) {
        return Err(GapReason::NoRule);
    }
    UNWIND_RULES.get(row.rule).copied().ok_or(GapReason::NoRule)
}

/// One step with the frame's CFI rule.
#[inline(always)]
fn cfi_step(walk: &mut Walk, rule: &UnwindRule) -> Result<(), Stop> {
    let frame = walk.frame;
    let cfa = match CfaRule::from_u8(rule.cfa) {
        Some(CfaRule::SpOffset) if frame.sp_known => {
            frame.sp.wrapping_add(rule.cfa_offset as i64 as u64)
        }
        Some(CfaRule::FpOffset) => {
            use_fp(walk);
            frame.fp.wrapping_add(rule.cfa_offset as i64 as u64)
        }
        Some(CfaRule::PltX86) if frame.sp_known => {
            frame.sp + 8 + 8 * u64::from(frame.pc & 15 >= 11)
        }
        Some(CfaRule::End) => return Err(Stop::Complete),
        _ => return Err(Stop::Cut(GapReason::Unsupported)),
    };
    // A return address still in the link register cannot be the caller's: this frame
    // made a call (or is the allocator's caller, which did).
    if RegRule::from_u8(rule.ra) != Some(RegRule::AtCfa) {
        return Err(if RegRule::from_u8(rule.ra) == Some(RegRule::Undefined) {
            Stop::Complete
        } else {
            Stop::Cut(GapReason::Unsupported)
        });
    }
    let return_address = stack_read(walk, cfa.wrapping_add(rule.ra_offset as i64 as u64))
        .ok_or(Stop::Cut(GapReason::Unreadable))?
        & ADDRESS_MASK;
    let fp = match RegRule::from_u8(rule.fp) {
        Some(RegRule::AtCfa) => {
            let address = cfa.wrapping_add(rule.fp_offset as i64 as u64);
            walk.fp_source = address;
            stack_read_unnoted(walk, address).ok_or(Stop::Cut(GapReason::Unreadable))?
        }
        Some(RegRule::Same) => frame.fp,
        _ => {
            walk.fp_source = 0;
            0
        }
    };
    if return_address == 0 {
        return Err(Stop::Complete);
    }
    walk.frame = Frame {
        pc: return_address,
        lookup: return_address - 1,
        sp: cfa,
        fp,
        sp_known: true,
    };
    Ok(())
}

/// One step along the frame-pointer chain, for code without CFI: the frame record
/// (saved frame pointer, return address) is at the frame pointer on x86-64 and arm64.
/// It is followed only while it points into the stack above the stack pointer and
/// grows: chains end in code built without frame pointers, and their garbage faults.
#[inline(always)]
fn fp_step(walk: &mut Walk) -> bool {
    let Frame { sp, fp, .. } = walk.frame;
    use_fp(walk);
    if fp < sp || fp - sp > MAX_STACK_SPAN || fp & 7 != 0 {
        return false;
    }
    let (Some(next_fp), Some(return_address)) = (stack_read(walk, fp), stack_read(walk, fp + 8))
    else {
        return false;
    };
    let return_address = return_address & ADDRESS_MASK;
    if return_address == 0 || next_fp <= fp {
        return false;
    }
    walk.frame = Frame {
        pc: return_address,
        lookup: return_address - 1,
        sp: fp + 16,
        fp: next_fp,
        sp_known: FP_STEP_KNOWS_SP,
    };
    true
}

/// A frame-pointer step taken where CFI could not help; kept only if it leads to an
/// address in a known executable mapping (code without frame pointers keeps anything
/// in its frame-pointer register, and the chain then yields garbage, not frames).
#[inline(always)]
fn fallback_step(walk: &mut Walk) -> bool {
    // Whether it is taken depends on the mappings, not only on the stack.
    walk.flags |= UNANSWERABLE;
    let before = walk.frame;
    if fp_step(walk) {
        // The key must be on this function's stack: `walk` is a global function's
        // argument, memory that Linux 6.1's verifier refuses as a map key.
        let tgid = walk.mappings_tgid;
        // SAFETY: the value is only read; the daemon replaces whole entries.
        match unsafe { PROCESS_MAPPINGS.get(&tgid) } {
            None => return true,
            Some(mappings) if find_mapping(mappings, walk.frame.lookup).is_some() => return true,
            Some(_) => {}
        }
    }
    walk.frame = before;
    false
}

/// The rule of `address` in process `tgid`, without the cache.
#[inline(always)]
fn resolve_uncached(tgid: u32, address: u64) -> Result<UnwindRule, GapReason> {
    // SAFETY: the value is only read; the daemon replaces whole entries.
    let mappings = unsafe { PROCESS_MAPPINGS.get(&tgid) }.ok_or(GapReason::NoMapping)?;
    let mapping = find_mapping(mappings, address).ok_or(GapReason::NoMapping)?;
    find_rule(mapping, address)
}

/// The rule of `address` in process `tgid` (whose mappings are at `version`), from
/// this CPU's cache when it has it. Most allocations come from few call sites, so a
/// hit (one array lookup and three comparisons) replaces a hash lookup and two binary
/// searches for most frames.
#[inline(always)]
fn resolve(tgid: u32, version: u32, address: u64) -> Result<UnwindRule, GapReason> {
    let hash = (address ^ (address >> 17)).wrapping_mul(HASH_MULTIPLIER);
    let slot = (hash >> 52) as u32 & (RULE_CACHE_ENTRIES - 1);
    let Some(entry) = RULE_CACHE.get_ptr_mut(slot) else {
        return resolve_uncached(tgid, address);
    };
    // SAFETY: this CPU's slot; programs on one CPU do not interleave.
    let entry = unsafe { &mut *entry };
    if entry.pc == address && entry.tgid == tgid && entry.version == version {
        return if entry.gap == CACHED_RULE_FOUND {
            Ok(entry.rule)
        } else {
            Err(GapReason::from_u32(entry.gap).unwrap_or(GapReason::NoRule))
        };
    }
    let result = resolve_uncached(tgid, address);
    entry.pc = address;
    entry.tgid = tgid;
    entry.version = version;
    match result {
        Ok(rule) => {
            entry.rule = rule;
            entry.gap = CACHED_RULE_FOUND;
        }
        Err(reason) => entry.gap = reason as u32,
    }
    result
}

/// A process without mappings of its own takes its fork origin's, once per walk:
/// here, in the frame's global function, rather than where the walk starts, whose
/// stack frame the allocation programs share with theirs.
#[inline(always)]
fn origin_step(walk: &mut Walk) {
    if walk.has_mappings != 0 || walk.flags & ORIGIN_TRIED != 0 {
        return;
    }
    walk.flags |= ORIGIN_TRIED;
    if let Some((origin, mappings)) = crate::forks::origin_mappings(walk.tgid, walk.exec_gen) {
        walk.mappings_tgid = origin;
        walk.version = mappings.version;
        walk.has_mappings = 1;
    }
}

/// One frame: CFI where a table covers it; else, unless `cfi_only`, frame pointers.
#[inline(always)]
fn step(walk: &mut Walk) -> Result<(), Stop> {
    origin_step(walk);
    let cfi_only = walk.mode == UnwindMode::Cfi as u32;
    let resolved = if walk.has_mappings != 0 {
        resolve(walk.mappings_tgid, walk.version, walk.frame.lookup)
    } else {
        Err(GapReason::NoMapping)
    };
    let gap = match resolved {
        Ok(rule) => {
            return match cfi_step(walk, &rule) {
                // An SP-based rule after a frame-pointer step on arm64: frame pointers on.
                Err(Stop::Cut(GapReason::Unsupported))
                    if !walk.frame.sp_known && !cfi_only && fallback_step(walk) =>
                {
                    Ok(())
                }
                other => other,
            };
        }
        Err(reason) => reason,
    };
    if !cfi_only && fallback_step(walk) {
        return Ok(());
    }
    Err(Stop::Cut(gap))
}

/// Counts a stack cut short at `pc` of process `tgid`'s image `exec_gen`.
#[inline(always)]
fn record_gap(tgid: u32, exec_gen: u32, reason: GapReason, pc: u64) {
    count_only(DropReason::StackIncomplete);
    crate::log::first_gap(reason, pc, tgid);
    let key = UnwindGap {
        tgid,
        exec_gen,
        pc,
        reason: reason as u32,
        _pad: 0,
    };
    match UNWIND_GAPS.get_ptr_mut(&key) {
        // SAFETY: a counter; a lost increment under a race only undercounts a report.
        Some(count) => unsafe { *count += 1 },
        None => {
            let _ = UNWIND_GAPS.insert(&key, &1, 0);
        }
    }
}

/// Asks the daemon for `tgid`'s mappings, at most once per [`REQUEST_INTERVAL_NS`].
#[inline(always)]
pub fn request_mappings(tgid: u32, reason: RequestReason) {
    // SAFETY: a helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: a plain value copied out of the map.
    if let Some(last) = unsafe { MAPPINGS_REQUESTED.get(&tgid) }
        && now.wrapping_sub(*last) < REQUEST_INTERVAL_NS
    {
        return;
    }
    let _ = MAPPINGS_REQUESTED.insert(&tgid, &now, 0);
    let _ = MAPPINGS_REQUESTS.output(
        &MappingsRequest {
            tgid,
            reason: reason as u32,
        },
        0,
    );
}

/// The state of a stack walk, kept in this CPU's `WALK_SCRATCH` slot while `bpf_loop`
/// calls [`walk_one`] once per frame (not on the BPF stack, whose 512 bytes the
/// callers' frames and the callbacks' share): plain scalars, so a frame needs no map
/// lookup for the process's mappings unless a rule is not in the cache.
#[repr(C)]
struct Walk {
    frame: Frame,
    hash: u64,
    tgid: u32,
    /// The process whose mappings unwind this one: itself, or its fork origin.
    mappings_tgid: u32,
    exec_gen: u32,
    /// The process's mappings' version, when it has mappings (`has_mappings`).
    version: u32,
    has_mappings: u32,
    mode: u32,
    /// Frames recorded so far.
    depth: u32,
    /// The stack addresses `[window_base, window_base + window_len)` are in this CPU's
    /// `STACK_WINDOW` (see [`stack_read`]).
    window_base: u64,
    /// The end of the stack known to be mapped (see [`crate::maps::StackReach`]), or 0.
    reach: u64,
    window_len: u32,
    /// [`NOTING_READS`] and the other walk flags.
    flags: u32,
    /// Where the frame pointer came from (see [`FP_FROM_CALLER`]).
    fp_source: u64,
}

/// Per-CPU room for a stack walk's state: declared beside [`Walk`], which only this
/// module reads and writes, so the maps module need not know the walk's layout.
#[map(name = "WALK_SCRATCH")]
static WALK_SCRATCH: PerCpuArray<Walk> = PerCpuArray::with_max_entries(1, 0);

/// `bpf_loop`'s callback: one frame (see [`heapprof_unwind_frame`]).
extern "C" fn walk_one(_index: u64, _context: *mut c_void) -> i64 {
    // The verifier wants a callback's return known to be 0 or 1; a global function's
    // is any number to it. The compiler knows better and would drop the mask: a
    // volatile read hides the value from it.
    let stop = heapprof_unwind_frame();
    // SAFETY: reads a local.
    unsafe { core::ptr::read_volatile(&stop) & 1 }
}

/// Unwinds one frame of this CPU's walk and records it; returns 1 to stop.
///
/// A global function (public, unmangled): the verifier checks it once, on its own,
/// where a loop's body, or a static function, is checked again in every context it is
/// reached from. Unrolled over 127 frames the body passed the verifier's limit of a
/// million instructions; as a `bpf_loop` callback it took the verifier 2 s.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_unwind_frame() -> i64 {
    let Some(walk) = WALK_SCRATCH.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: this CPU's walk, set up by `unwind`; programs on one CPU do not
    // interleave.
    let walk = unsafe { &mut *walk };
    let stepped = if walk.mode == UnwindMode::FramePointers as u32 {
        if fp_step(walk) {
            Ok(())
        } else {
            Err(Stop::Complete)
        }
    } else {
        step(walk)
    };
    match stepped {
        Ok(()) => {}
        Err(Stop::Complete) => return 1,
        Err(Stop::Cut(reason)) => {
            walk.flags |= UNANSWERABLE;
            if reason == GapReason::NoMapping {
                request_mappings(walk.tgid, RequestReason::UnknownAddress);
            }
            record_gap(walk.tgid, walk.exec_gen, reason, walk.frame.pc);
            return 1;
        }
    }
    let Some(stack) = STACK_SCRATCH.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: this CPU's scratch slot; programs on one CPU do not interleave.
    let stack = unsafe { &mut *stack };
    let depth = walk.depth as usize;
    if depth >= MAX_STACK_DEPTH as usize {
        walk.flags |= UNANSWERABLE;
        count_drop(DropReason::StackTruncated);
        return 1;
    }
    stack.frames[depth] = walk.frame.pc;
    stack.len = walk.depth + 1;
    walk.depth += 1;
    let hash = (walk.hash ^ walk.frame.pc).wrapping_mul(HASH_MULTIPLIER);
    walk.hash = hash ^ (hash >> 29);
    0
}

/// Unwinds the stack of thread `pid_tgid` from the caller's registers at the allocator's return
/// (`pc`, `fp`, `sp`) into `stack` (this CPU's `STACK_SCRATCH` slot); returns the
/// stack's hash (seeded with the process).
///
/// With `answer`, the walk also notes where it read the stack, into this CPU's
/// `REPLY_SCRATCH`, whose status then says whether the walk can be answered (see
/// `heapprof_common::preload::StackReply`); the hash is left for the caller to set.
#[inline(always)]
pub fn unwind(
    pid_tgid: u64,
    exec_gen: u32,
    mode: u32,
    (pc, fp, sp): (u64, u64, u64),
    stack: &mut UserStack,
    answer: bool,
) -> u64 {
    let tgid = (pid_tgid >> 32) as u32;
    let mappings = walk_mappings(tgid, mode);
    let reach_slot = STACK_REACH.get_ptr_mut(0);
    // SAFETY: this CPU's slot; programs on one CPU do not interleave.
    let reach = reach_slot
        .map(|slot| unsafe { &*slot })
        .filter(|slot| slot.pid_tgid == pid_tgid)
        .map_or(0, |slot| slot.end);
    stack.frames[0] = pc;
    stack.len = 1;
    let first_hash = (u64::from(tgid) ^ pc).wrapping_mul(HASH_MULTIPLIER);
    let Some(walk) = WALK_SCRATCH.get_ptr_mut(0) else {
        return first_hash;
    };
    // SAFETY: this CPU's slot; programs on one CPU do not interleave. Set field by
    // field, so that no copy of it is made on the stack.
    let walk = unsafe { &mut *walk };
    walk.frame.pc = pc;
    walk.frame.lookup = pc;
    walk.frame.sp = sp;
    walk.frame.fp = fp;
    walk.frame.sp_known = true;
    walk.hash = first_hash;
    walk.tgid = tgid;
    walk.mappings_tgid = tgid;
    walk.exec_gen = exec_gen;
    walk.version = mappings.map_or(0, |m| m.version);
    walk.has_mappings = u32::from(mappings.is_some());
    walk.mode = mode;
    walk.depth = 1;
    walk.window_base = 0;
    walk.reach = reach;
    walk.window_len = 0;
    walk.flags = 0;
    walk.fp_source = FP_FROM_CALLER;
    let reply_slot = if answer {
        start_noting_reads(walk, sp)
    } else {
        None
    };
    walk_frames();
    end_walk(walk, pid_tgid, reach_slot, reply_slot);
    walk.hash
}

/// The mappings that unwind the stacks of process `tgid` by CFI (none in frame-pointer
/// `mode`); without them, asks the daemon for them.
#[inline(always)]
fn walk_mappings(tgid: u32, mode: u32) -> Option<&'static ProcessMappings> {
    if mode == UnwindMode::FramePointers as u32 {
        return None;
    }
    // SAFETY: the value is only read; the daemon replaces whole entries.
    let mappings = unsafe { PROCESS_MAPPINGS.get(&tgid) };
    if mappings.is_none() {
        // A fork unwinds with its origin's meanwhile (see `origin_step`).
        request_mappings(tgid, RequestReason::UnknownAddress);
    }
    mappings
}

/// Readies this CPU's `REPLY_SCRATCH` for a walk from the stack pointer `sp` that notes
/// where it reads the stack; returns the slot (`None`: no slot, nothing noted).
#[inline(always)]
fn start_noting_reads(walk: &mut Walk, sp: u64) -> Option<*mut ReplyScratch> {
    let slot = REPLY_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot; programs on one CPU do not interleave.
    unsafe {
        (*slot).reply.status = 0;
        (*slot).reply.reads = 0;
        (*slot).base = sp;
    }
    walk.flags |= NOTING_READS;
    Some(slot)
}

/// Walks the frames of this CPU's `WALK_SCRATCH`: [`walk_one`] per frame, at most
/// [`MAX_STACK_DEPTH`] of them.
#[inline(always)]
fn walk_frames() {
    // SAFETY: the callback is a BPF subprogram; it takes no context.
    unsafe {
        bpf_loop(
            MAX_STACK_DEPTH,
            walk_one as *mut c_void,
            core::ptr::null_mut(),
            0,
        );
    }
}

/// After the walk of thread `pid_tgid`: keeps how far its stack is known to be mapped
/// in `reach_slot`, and, when it noted its reads into `reply_slot`, says whether its
/// answer holds and whether it used frame pointers.
#[inline(always)]
fn end_walk(
    walk: &Walk,
    pid_tgid: u64,
    reach_slot: Option<*mut StackReach>,
    reply_slot: Option<*mut ReplyScratch>,
) {
    if let Some(slot) = reach_slot {
        // SAFETY: this CPU's slot; programs on one CPU do not interleave.
        unsafe {
            (*slot).pid_tgid = pid_tgid;
            (*slot).end = walk.reach;
        }
    }
    if let Some(slot) = reply_slot
        && walk.flags & UNANSWERABLE == 0
    {
        // SAFETY: as above.
        unsafe {
            (*slot).reply.status = StackReply::KNOWN;
            (*slot).reply.uses_fp = u32::from(walk.flags & USES_FP != 0);
        }
    }
}
