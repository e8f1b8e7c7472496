//! x86-64 call instructions read back from a return address: where the call that
//! pushed it went. Pure functions over words of code, so that the BPF programs
//! (which read the words from the process) and the tests share them.
//!
//! Used to tell a tail call from a new call at the same stack pointer (see the BPF
//! crate's `calls` module): the word at the stack pointer is the return address of
//! whichever call the caller made, and the instruction before it says which function
//! that was, directly or through a PLT stub and its GOT slot.

/// What the call instruction ending at a return address names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallBefore {
    /// `call rel32` (`e8`): the target itself (a function, or a PLT stub).
    Direct(u64),
    /// `call *disp32(%rip)` (`ff 15`, `-fno-plt`): the slot holding the target.
    ThroughSlot(u64),
    /// Anything else: an indirect call through a register or other memory, or no call.
    Unknown,
}

/// The call that ends at `return_address`, from `before`: the 8 bytes before it, read
/// as a little-endian word at `return_address - 8`.
pub fn call_before(return_address: u64, before: u64) -> CallBefore {
    let bytes = before.to_le_bytes();
    let displacement = i32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) as i64 as u64;
    if bytes[3] == 0xe8 {
        CallBefore::Direct(return_address.wrapping_add(displacement))
    } else if bytes[2] == 0xff && bytes[3] == 0x15 {
        CallBefore::ThroughSlot(return_address.wrapping_add(displacement))
    } else {
        CallBefore::Unknown
    }
}

/// The slot an indirect jump at `address` goes through, from `word`, the 8 bytes read
/// there: `jmp *disp32(%rip)` (`ff 25`, a PLT stub's) or its `bnd` form (`f2 ff 25`, an
/// MPX-era `.plt.sec` stub's).
pub fn jump_slot(address: u64, word: u64) -> Option<u64> {
    let bytes = word.to_le_bytes();
    if bytes[0] == 0xff && bytes[1] == 0x25 {
        let displacement = i32::from_le_bytes([bytes[2], bytes[3], bytes[4], bytes[5]]);
        return Some(
            address
                .wrapping_add(6)
                .wrapping_add(displacement as i64 as u64),
        );
    }
    if bytes[0] == 0xf2 && bytes[1] == 0xff && bytes[2] == 0x25 {
        let displacement = i32::from_le_bytes([bytes[3], bytes[4], bytes[5], bytes[6]]);
        return Some(
            address
                .wrapping_add(7)
                .wrapping_add(displacement as i64 as u64),
        );
    }
    None
}

/// Whether `word` starts with `endbr64` (`f3 0f 1e fa`), which a stub of an object
/// built for indirect-branch tracking (`.plt.sec`) begins with before its jump.
pub fn starts_with_endbr64(word: u64) -> bool {
    word as u32 == 0xfa1e_0ff3
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The little-endian word of `bytes` placed to end at the word's end (as the 8
    /// bytes before a return address are read).
    fn ending_with(bytes: &[u8]) -> u64 {
        let mut word = [0x90u8; 8];
        word[8 - bytes.len()..].copy_from_slice(bytes);
        u64::from_le_bytes(word)
    }

    #[test]
    fn a_direct_call_names_its_target() {
        // libstdc++'s `_Znwm`: `a9587: call 99df0 <malloc@plt>`, returning to a958c.
        let before = ending_with(&[0xe8, 0x64, 0x08, 0xff, 0xff]);
        assert_eq!(call_before(0xa958c, before), CallBefore::Direct(0x99df0));
    }

    #[test]
    fn a_call_through_the_got_names_its_slot() {
        // `call *0x2000(%rip)` returning to 0x1006: the slot is at 0x3006.
        let before = ending_with(&[0xff, 0x15, 0x00, 0x20, 0x00, 0x00]);
        assert_eq!(call_before(0x1006, before), CallBefore::ThroughSlot(0x3006));
    }

    #[test]
    fn register_calls_and_other_code_are_unknown() {
        // `call *%rax` (ff d0), `call *%r12` (41 ff d4), a `ret` and nops.
        for tail in [&[0xff, 0xd0][..], &[0x41, 0xff, 0xd4], &[0xc3], &[]] {
            assert_eq!(call_before(0x4000, ending_with(tail)), CallBefore::Unknown);
        }
    }

    #[test]
    fn plt_stubs_name_their_got_slot() {
        // A classic `.plt` entry at 0x99df0: `jmp *0x12345(%rip)` (ff 25), push, jmp.
        let stub = u64::from_le_bytes([0xff, 0x25, 0x45, 0x23, 0x01, 0x00, 0x68, 0x01]);
        assert_eq!(jump_slot(0x99df0, stub), Some(0x99df0 + 6 + 0x12345));
        // The `bnd jmp` form, 7 bytes, with a negative displacement.
        let bnd = u64::from_le_bytes([0xf2, 0xff, 0x25, 0xf0, 0xff, 0xff, 0xff, 0x90]);
        assert_eq!(jump_slot(0x5000, bnd), Some(0x5000 + 7 - 0x10));
        // A function's own code is no stub.
        let code = u64::from_le_bytes([0x48, 0x81, 0xff, 0x00, 0x10, 0x00, 0x00, 0x77]);
        assert_eq!(jump_slot(0x5000, code), None);
    }

    #[test]
    fn endbr64_is_recognised() {
        let sec = u64::from_le_bytes([0xf3, 0x0f, 0x1e, 0xfa, 0xf2, 0xff, 0x25, 0x00]);
        assert!(starts_with_endbr64(sec));
        assert!(!starts_with_endbr64(0x25ff));
    }
}
