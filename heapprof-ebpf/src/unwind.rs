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

use aya_ebpf::helpers::{bpf_ktime_get_ns, bpf_probe_read_user};
use heapprof_common::{
    DropReason, MAX_STACK_DEPTH, MAX_STACK_SPAN, UserStack,
    unwind::{
        CfaRule, ExecMapping, GapReason, MAPPING_SEARCH_STEPS, MAX_PROCESS_MAPPINGS,
        MappingsRequest, NO_OBJECT, ProcessMappings, ROW_SEARCH_STEPS, RULE_NONE, RegRule,
        RequestReason, UnwindGap, UnwindMode, UnwindRule,
    },
};

use crate::maps::{
    MAPPINGS_REQUESTED, MAPPINGS_REQUESTS, PROCESS_MAPPINGS, UNWIND_GAPS, UNWIND_OBJECTS,
    UNWIND_ROWS, UNWIND_RULES, count_drop,
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

/// The mapping holding `address`, by binary search over the sorted mappings.
#[inline(always)]
fn find_mapping(mappings: &ProcessMappings, address: u64) -> Option<&ExecMapping> {
    let count = mappings.count as usize;
    if count == 0 || count > MAX_PROCESS_MAPPINGS {
        return None;
    }
    let mut low = 0usize;
    let mut len = count;
    for _ in 0..MAPPING_SEARCH_STEPS {
        if len <= 1 {
            break;
        }
        let half = len / 2;
        let middle = (low + half) & (MAX_PROCESS_MAPPINGS - 1);
        // Branch-free, so the verifier follows one path through the loop.
        low += half * usize::from(mappings.mappings[middle].start <= address);
        len -= half;
    }
    let mapping = &mappings.mappings[low & (MAX_PROCESS_MAPPINGS - 1)];
    (mapping.start <= address && address < mapping.end).then_some(mapping)
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
    let vaddr = address.wrapping_sub(mapping.bias);
    if object.rows == 0 || vaddr > u64::from(u32::MAX) {
        return Err(GapReason::NoRule);
    }
    let vaddr = vaddr as u32;
    let mut low = 0u32;
    let mut len = object.rows;
    for _ in 0..ROW_SEARCH_STEPS {
        if len <= 1 {
            break;
        }
        let half = len / 2;
        let Some(row) = UNWIND_ROWS.get(object.first_row.wrapping_add(low + half)) else {
            return Err(GapReason::NoRule);
        };
        low += half * u32::from(row.pc <= vaddr);
        len -= half;
    }
    let row = UNWIND_ROWS
        .get(object.first_row.wrapping_add(low))
        .ok_or(GapReason::NoRule)?;
    if row.pc > vaddr || row.rule == RULE_NONE {
        return Err(GapReason::NoRule);
    }
    UNWIND_RULES.get(row.rule).copied().ok_or(GapReason::NoRule)
}

/// One step with the frame's CFI rule.
#[inline(always)]
fn cfi_step(frame: &mut Frame, rule: &UnwindRule) -> Result<(), Stop> {
    let cfa = match CfaRule::from_u8(rule.cfa) {
        Some(CfaRule::SpOffset) if frame.sp_known => {
            frame.sp.wrapping_add(rule.cfa_offset as i64 as u64)
        }
        Some(CfaRule::FpOffset) => frame.fp.wrapping_add(rule.cfa_offset as i64 as u64),
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
    let return_address = read_user(cfa.wrapping_add(rule.ra_offset as i64 as u64))
        .ok_or(Stop::Cut(GapReason::Unreadable))?
        & ADDRESS_MASK;
    frame.fp = match RegRule::from_u8(rule.fp) {
        Some(RegRule::AtCfa) => read_user(cfa.wrapping_add(rule.fp_offset as i64 as u64))
            .ok_or(Stop::Cut(GapReason::Unreadable))?,
        Some(RegRule::Same) => frame.fp,
        _ => 0,
    };
    if return_address == 0 {
        return Err(Stop::Complete);
    }
    frame.sp = cfa;
    frame.sp_known = true;
    frame.pc = return_address;
    frame.lookup = return_address - 1;
    Ok(())
}

/// One step along the frame-pointer chain, for code without CFI: the frame record
/// (saved frame pointer, return address) is at the frame pointer on x86-64 and arm64.
/// It is followed only while it points into the stack above the stack pointer and
/// grows: chains end in code built without frame pointers, and their garbage faults.
#[inline(always)]
fn fp_step(frame: &mut Frame) -> bool {
    let fp = frame.fp;
    if fp < frame.sp || fp - frame.sp > MAX_STACK_SPAN || fp & 7 != 0 {
        return false;
    }
    // SAFETY: bpf_probe_read_user checks the user address.
    let Ok(record) = (unsafe { bpf_probe_read_user(fp as *const [u64; 2]) }) else {
        return false;
    };
    let return_address = record[1] & ADDRESS_MASK;
    if return_address == 0 || record[0] <= fp {
        return false;
    }
    frame.fp = record[0];
    frame.sp = fp + 16;
    frame.sp_known = FP_STEP_KNOWS_SP;
    frame.pc = return_address;
    frame.lookup = return_address - 1;
    true
}

/// A frame-pointer step taken where CFI could not help; kept only if it leads to an
/// address in a known executable mapping (code without frame pointers keeps anything
/// in its frame-pointer register, and the chain then yields garbage, not frames).
#[inline(always)]
fn fallback_step(mappings: Option<&ProcessMappings>, frame: &mut Frame) -> bool {
    let before = *frame;
    if fp_step(frame) && mappings.is_none_or(|m| find_mapping(m, frame.lookup).is_some()) {
        return true;
    }
    *frame = before;
    false
}

/// One frame: CFI where a table covers it; else, unless `cfi_only`, frame pointers.
#[inline(always)]
fn step(mappings: Option<&ProcessMappings>, frame: &mut Frame, cfi_only: bool) -> Result<(), Stop> {
    let gap = match mappings.and_then(|m| find_mapping(m, frame.lookup)) {
        None => GapReason::NoMapping,
        Some(mapping) => match find_rule(mapping, frame.lookup) {
            Ok(rule) => {
                return match cfi_step(frame, &rule) {
                    // An SP-based rule after a frame-pointer step on arm64: frame pointers on.
                    Err(Stop::Cut(GapReason::Unsupported))
                        if !frame.sp_known && !cfi_only && fallback_step(mappings, frame) =>
                    {
                        Ok(())
                    }
                    other => other,
                };
            }
            Err(reason) => reason,
        },
    };
    if !cfi_only && fallback_step(mappings, frame) {
        return Ok(());
    }
    Err(Stop::Cut(gap))
}

/// Counts a stack cut short at `pc` of process `tgid`'s image `exec_gen`.
#[inline(always)]
fn record_gap(tgid: u32, exec_gen: u32, reason: GapReason, pc: u64) {
    count_drop(DropReason::StackIncomplete);
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

/// Unwinds the stack of `tgid` from the caller's registers at the allocator's return
/// (`pc`, `fp`, `sp`) into `stack`; returns the stack's hash (seeded with the process).
#[inline(always)]
pub fn unwind(
    tgid: u32,
    exec_gen: u32,
    mode: u32,
    (pc, fp, sp): (u64, u64, u64),
    stack: &mut UserStack,
) -> u64 {
    let frame_pointers_only = mode == UnwindMode::FramePointers as u32;
    let cfi_only = mode == UnwindMode::Cfi as u32;
    // SAFETY: the value is only read; the daemon replaces whole entries.
    let mappings = if frame_pointers_only {
        None
    } else {
        let mappings = unsafe { PROCESS_MAPPINGS.get(&tgid) };
        if mappings.is_none() {
            request_mappings(tgid, RequestReason::UnknownAddress);
        }
        mappings
    };
    let mut frame = Frame {
        pc,
        lookup: pc,
        sp,
        fp,
        sp_known: true,
    };
    stack.frames[0] = pc;
    stack.len = 1;
    let mut hash = (u64::from(tgid) ^ pc).wrapping_mul(HASH_MULTIPLIER);
    // The depth lives in the scratch memory, not in a register that outlives the loop:
    // every way out of the loop then leaves the verifier the same state to continue
    // from, so it checks the rest of the program once instead of once per exit.
    for depth in 1..MAX_STACK_DEPTH as usize {
        let stepped = if frame_pointers_only {
            if fp_step(&mut frame) {
                Ok(())
            } else {
                Err(Stop::Complete)
            }
        } else {
            step(mappings, &mut frame, cfi_only)
        };
        match stepped {
            Ok(()) => {}
            Err(Stop::Complete) => break,
            Err(Stop::Cut(reason)) => {
                if reason == GapReason::NoMapping && mappings.is_some() {
                    request_mappings(tgid, RequestReason::UnknownAddress);
                }
                record_gap(tgid, exec_gen, reason, frame.pc);
                break;
            }
        }
        stack.frames[depth] = frame.pc;
        stack.len = depth as u32 + 1;
        hash = (hash ^ frame.pc).wrapping_mul(HASH_MULTIPLIER);
        hash ^= hash >> 29;
        if depth == MAX_STACK_DEPTH as usize - 1 {
            count_drop(DropReason::StackTruncated);
        }
    }
    hash
}
