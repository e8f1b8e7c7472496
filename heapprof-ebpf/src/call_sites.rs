//! Which function a caller called, read back from the process's code at the call's
//! return address (x86-64; see `heapprof_common::x86_calls`).

/// Whether the call instruction before `return_address` called the function whose
/// first instruction is at `entry`: directly, through its PLT stub's GOT slot, or
/// through a GOT slot (`-fno-plt`). False when the code cannot be read or the call is
/// one whose target the code does not name (through a register).
#[cfg(not(bpf_target_arch = "aarch64"))]
#[inline(always)]
pub fn calls(return_address: u64, entry: u64) -> bool {
    use heapprof_common::x86_calls::{CallBefore, call_before, jump_slot, starts_with_endbr64};

    use crate::regs::user_word;

    if return_address < 8 {
        return false;
    }
    let slot = match call_before(return_address, user_word(return_address - 8)) {
        CallBefore::Direct(target) if target == entry => return true,
        CallBefore::Direct(stub) => {
            let word = user_word(stub);
            match jump_slot(stub, word) {
                Some(slot) => slot,
                None if starts_with_endbr64(word) => {
                    match jump_slot(stub + 4, user_word(stub + 4)) {
                        Some(slot) => slot,
                        None => return false,
                    }
                }
                None => return false,
            }
        }
        CallBefore::ThroughSlot(slot) => slot,
        CallBefore::Unknown => return false,
    };
    user_word(slot) == entry
}

/// arm64 has no session links (see `ProbeSpec::session`), so no caller is asked.
#[cfg(bpf_target_arch = "aarch64")]
#[inline(always)]
pub fn calls(_return_address: u64, _entry: u64) -> bool {
    false
}
