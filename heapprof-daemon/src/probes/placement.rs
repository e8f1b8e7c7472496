//! Where in an allocator function to put its probes.
//!
//! A uprobe on an instruction the kernel cannot emulate is single-stepped out of line,
//! which costs about ten times more than an emulated one (glibc's `free` starts with
//! `test %rdi,%rdi`: ~10 µs per call against ~0.9 µs a few bytes later). So the probe goes
//! to the first instruction the kernel emulates, when that is provably equivalent to the
//! entry:
//! - every instruction before it falls through (no branch, call or return), so every
//!   call passes the new spot, before anything else happens;
//! - none of them writes an argument register (the programs read the arguments) or the
//!   stack pointer (the programs match calls and returns by it, and the kernel hijacks
//!   the return address at the stack pointer when a return probe shares the spot), nor
//!   arm64's return-address register when a return probe shares the spot;
//! - no branch in the function lands inside the skipped bytes or on the new spot, so it
//!   fires once per call. An indirect jump makes that unknowable: entry.
//!
//! Whenever the code is not understood, the answer is the entry.

use std::fmt;

use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, OpAccess, Register,
};

/// Instruction set of the probed library.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// x86-64.
    X86_64,
    /// AArch64 (arm64).
    Aarch64,
}

impl Arch {
    /// The instruction set of an ELF file from its header, if one we can decode.
    pub fn of_elf_header(header: &[u8]) -> Option<Arch> {
        // e_machine, little-endian, at offset 18.
        match header.get(18..20)? {
            [62, 0] => Some(Arch::X86_64),
            [183, 0] => Some(Arch::Aarch64),
            _ => None,
        }
    }
}

/// How probes are placed (`--probe-placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlacementMode {
    /// Always at the function's first instruction.
    Entry,
    /// At the first instruction the kernel emulates, when provably equivalent.
    Auto,
}

/// Where a function's probes go, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Bytes from the function's start.
    pub offset: u64,
    /// What is at that spot, or why the entry was kept (for the log).
    pub reason: String,
}

impl Placement {
    /// The function's first instruction, for `reason`.
    pub fn entry(reason: impl Into<String>) -> Placement {
        Placement {
            offset: 0,
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "+{} ({})", self.offset, self.reason)
    }
}

/// How far past the entry a probe may move.
const MAX_SKIPPED_INSTRUCTIONS: usize = 8;

/// Chooses the probe spot in `code`, the function's bytes from its first instruction
/// (the whole function, so branches back into the skipped bytes can be seen).
/// `return_probe` says whether a return probe shares the spot.
pub fn place(arch: Arch, code: &[u8], return_probe: bool) -> Placement {
    match arch {
        // x86-64 keeps only the stack pointer for a return probe, which is always kept.
        Arch::X86_64 => x86::place(code),
        Arch::Aarch64 => arm64::place(code, return_probe),
    }
}

mod x86 {
    use super::*;

    /// The kernel's x86 uprobe code emulates these instead of single-stepping them
    /// (arch/x86/kernel/uprobes.c: branch_setup_xol_ops, push_setup_xol_ops).
    /// Prefixed forms are left out: the kernel rejects several of them.
    fn emulated(bytes: &[u8]) -> Option<&'static str> {
        match bytes {
            [0x50..=0x57] | [0x41, 0x50..=0x57] => Some("push"),
            [0x70..=0x7f, _] | [0x0f, 0x80..=0x8f, _, _, _, _] => Some("conditional jump"),
            [0xeb, _] | [0xe9, _, _, _, _] => Some("jmp"),
            [0xe8, _, _, _, _] => Some("call"),
            [0x90] => Some("nop"),
            _ => None,
        }
    }

    const ARGUMENT_REGISTERS: [Register; 6] = [
        Register::RDI,
        Register::RSI,
        Register::RDX,
        Register::RCX,
        Register::R8,
        Register::R9,
    ];

    fn writes(access: OpAccess) -> bool {
        matches!(
            access,
            OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
        )
    }

    fn decode_all(code: &[u8]) -> Option<Vec<Instruction>> {
        let mut decoder = Decoder::with_ip(64, code, 0, DecoderOptions::NONE);
        let mut instructions = Vec::new();
        while decoder.can_decode() {
            let instruction = decoder.decode();
            if instruction.is_invalid() {
                return None;
            }
            instructions.push(instruction);
        }
        Some(instructions)
    }

    pub(super) fn place(code: &[u8]) -> Placement {
        let Some(instructions) = decode_all(code) else {
            return Placement::entry("entry: the function does not decode");
        };
        let mut info = InstructionInfoFactory::new();
        let mut candidate = None;
        for instruction in instructions.iter().take(MAX_SKIPPED_INSTRUCTIONS + 1) {
            let start = instruction.ip() as usize;
            let bytes = &code[start..start + instruction.len()];
            if let Some(what) = emulated(bytes) {
                candidate = Some((instruction.ip(), what));
                break;
            }
            if instruction.flow_control() != FlowControl::Next {
                return Placement::entry("entry: a branch comes before any emulated instruction");
            }
            let protected = |register: Register| {
                ARGUMENT_REGISTERS.contains(&register) || register == Register::RSP
            };
            let clobbers =
                info.info(instruction).used_registers().iter().any(|used| {
                    writes(used.access()) && protected(used.register().full_register())
                });
            if clobbers {
                return Placement::entry(
                    "entry: an instruction before the first emulated one writes an argument register or the stack pointer",
                );
            }
        }
        let Some((offset, what)) = candidate else {
            return Placement::entry("entry: no emulated instruction near the start");
        };
        if offset == 0 {
            return Placement::entry(format!("entry: the first instruction is a {what}"));
        }
        for instruction in &instructions {
            match instruction.flow_control() {
                FlowControl::IndirectBranch => {
                    return Placement::entry("entry: the function has an indirect jump");
                }
                FlowControl::UnconditionalBranch
                | FlowControl::ConditionalBranch
                | FlowControl::Call => {
                    let target = instruction.near_branch_target();
                    if target > 0 && target <= offset {
                        return Placement::entry(
                            "entry: a branch in the function lands in the skipped instructions",
                        );
                    }
                }
                _ => {}
            }
        }
        Placement {
            offset,
            reason: format!("{what}, after instructions that keep the arguments"),
        }
    }
}

mod arm64 {
    use super::*;

    /// Instructions the arm64 kernel simulates rather than single-steps
    /// (arch/arm64/kernel/probes/decode-insn.c): PC-relative branches, adr/adrp and
    /// literal loads. Anything newer kernels added is left out: unsure means entry.
    fn simulated(word: u32) -> Option<&'static str> {
        if word & 0xff00_0010 == 0x5400_0000 {
            Some("b.cond")
        } else if word & 0x7e00_0000 == 0x3400_0000 {
            Some("cbz/cbnz")
        } else if word & 0x7e00_0000 == 0x3600_0000 {
            Some("tbz/tbnz")
        } else if word & 0x7c00_0000 == 0x1400_0000 {
            Some("b/bl")
        } else if word & 0x1f00_0000 == 0x1000_0000 {
            Some("adr/adrp")
        } else {
            None
        }
    }

    /// Instructions known to write nothing but flags (cmp/cmn/tst: subs/adds/ands
    /// into the zero register), and `bti`. `paciasp` writes only the link register,
    /// so it may be skipped when no return probe shares the spot.
    fn skippable(word: u32, return_probe: bool) -> bool {
        let rd_is_zero = word & 0x1f == 0x1f;
        let flag_setting_arith =
            // subs/adds (immediate), (shifted register), ands (immediate/shifted register)
            (word & 0x5f00_0000 == 0x5100_0000 && word & 0x2000_0000 != 0)
                || (word & 0x5f20_0000 == 0x4b00_0000 && word & 0x2000_0000 != 0)
                || word & 0x7f80_0000 == 0x7200_0000
                || word & 0x7f20_0000 == 0x6a00_0000;
        let bti = word & 0xffff_ff3f == 0xd503_241f;
        let paciasp = word == 0xd503_233f;
        (flag_setting_arith && rd_is_zero) || bti || (paciasp && !return_probe)
    }

    /// The target of a direct branch at `pc`, if the word is one.
    fn branch_target(word: u32, pc: i64) -> Option<i64> {
        let sign_extend = |value: u32, bits: u32| -> i64 {
            let shift = 64 - bits;
            ((i64::from(value)) << shift) >> shift
        };
        if word & 0x7c00_0000 == 0x1400_0000 {
            Some(pc + 4 * sign_extend(word & 0x03ff_ffff, 26))
        } else if word & 0xff00_0010 == 0x5400_0000 || word & 0x7e00_0000 == 0x3400_0000 {
            // b.cond, cbz/cbnz: imm19 at bit 5.
            Some(pc + 4 * sign_extend((word >> 5) & 0x7ffff, 19))
        } else if word & 0x7e00_0000 == 0x3600_0000 {
            // tbz/tbnz: imm14 at bit 5.
            Some(pc + 4 * sign_extend((word >> 5) & 0x3fff, 14))
        } else {
            None
        }
    }

    /// br/braa/eret...: register-indirect jumps (blr returns past itself, ret leaves).
    fn indirect_jump(word: u32) -> bool {
        word & 0xfe60_0000 == 0xd600_0000
    }

    pub(super) fn place(code: &[u8], return_probe: bool) -> Placement {
        let words: Vec<u32> = code
            .as_chunks::<4>()
            .0
            .iter()
            .map(|c| u32::from_le_bytes(*c))
            .collect();
        let mut candidate = None;
        for (index, &word) in words.iter().enumerate().take(MAX_SKIPPED_INSTRUCTIONS + 1) {
            if let Some(what) = simulated(word) {
                candidate = Some((index as u64 * 4, what));
                break;
            }
            if !skippable(word, return_probe) {
                return Placement::entry(
                    "entry: an instruction before the first simulated one may change state",
                );
            }
        }
        let Some((offset, what)) = candidate else {
            return Placement::entry("entry: no simulated instruction near the start");
        };
        if offset == 0 {
            return Placement::entry(format!("entry: the first instruction is a {what}"));
        }
        for (index, &word) in words.iter().enumerate() {
            if indirect_jump(word) {
                return Placement::entry("entry: the function has an indirect jump");
            }
            if let Some(target) = branch_target(word, index as i64 * 4)
                && target > 0
                && target <= offset as i64
            {
                return Placement::entry(
                    "entry: a branch in the function lands in the skipped instructions",
                );
            }
        }
        Placement {
            offset,
            reason: format!("{what}, after instructions that keep the arguments"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// glibc 2.36's free: test %rdi,%rdi; je +0xbf; push %rbp; lea -0x10(%rdi),%rsi; ret
    const GLIBC_FREE: &[u8] = &[
        0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0x00, 0x00, 0x00, 0x55, 0x48, 0x8d, 0x77, 0xf0, 0xc3,
    ];

    #[test]
    fn x86_free_moves_past_the_null_test() {
        let placement = place(Arch::X86_64, GLIBC_FREE, false);
        assert_eq!(placement.offset, 3, "{placement}");
        assert!(placement.reason.contains("conditional jump"));
    }

    #[test]
    fn x86_push_at_entry_stays() {
        // glibc's malloc: push %r12; push %rbp; ret
        let placement = place(Arch::X86_64, &[0x41, 0x54, 0x55, 0xc3], true);
        assert_eq!(placement.offset, 0, "{placement}");
    }

    #[test]
    fn x86_cmpb_then_push_moves_even_with_a_return_probe() {
        // glibc's posix_memalign: cmpb $0,0x10(%rip); push %r12; ret
        let code = [0x80, 0x3d, 0x10, 0x00, 0x00, 0x00, 0x00, 0x41, 0x54, 0xc3];
        assert_eq!(place(Arch::X86_64, &code, true).offset, 7);
    }

    #[test]
    fn x86_argument_or_stack_writes_keep_the_entry() {
        // mov %rsi,%rdi; push %rbx: the first argument is gone at the push.
        assert_eq!(
            place(Arch::X86_64, &[0x48, 0x89, 0xf7, 0x53, 0xc3], false).offset,
            0
        );
        // sub $8,%rsp; push %rbx: the return address is no longer at the stack pointer,
        // and the stack pointer no longer tells where the call began (with or without
        // a return probe: free's nesting check uses it too).
        let code = [0x48, 0x83, 0xec, 0x08, 0x53, 0xc3];
        assert_eq!(place(Arch::X86_64, &code, true).offset, 0);
        assert_eq!(place(Arch::X86_64, &code, false).offset, 0);
    }

    #[test]
    fn x86_branch_back_into_skipped_bytes_keeps_the_entry() {
        // test %rdi,%rdi; je +0; jmp back to the je (offset 3).
        let code = [
            0x48, 0x85, 0xff, 0x0f, 0x84, 0x00, 0x00, 0x00, 0x00, 0xeb, 0xf8,
        ];
        let placement = place(Arch::X86_64, &code, false);
        assert_eq!(placement.offset, 0, "{placement}");
        // An indirect jump anywhere: unknowable.
        let code = [0x48, 0x85, 0xff, 0x74, 0x02, 0xff, 0xe0, 0xc3];
        assert_eq!(place(Arch::X86_64, &code, false).offset, 0);
    }

    #[test]
    fn x86_garbage_keeps_the_entry() {
        assert_eq!(place(Arch::X86_64, &[0x0f, 0xff, 0xff], false).offset, 0);
        assert_eq!(place(Arch::X86_64, &[], false).offset, 0);
    }

    fn words(words: &[u32]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    #[test]
    fn arm64_cbz_at_entry_stays_and_cmp_is_skipped() {
        // cbz x0, +8; ret
        assert_eq!(
            place(Arch::Aarch64, &words(&[0xb400_0040, 0xd65f_03c0]), false).offset,
            0
        );
        // cmp x0, #0 (subs xzr, x0, #0); b.eq +8; ret
        let code = words(&[0xf100_001f, 0x5400_0040, 0xd65f_03c0]);
        assert_eq!(place(Arch::Aarch64, &code, false).offset, 4);
    }

    #[test]
    fn arm64_paciasp_is_skipped_only_without_a_return_probe() {
        // paciasp; b.eq +8; ret
        let code = words(&[0xd503_233f, 0x5400_0040, 0xd65f_03c0]);
        assert_eq!(place(Arch::Aarch64, &code, false).offset, 4);
        assert_eq!(place(Arch::Aarch64, &code, true).offset, 0);
    }

    #[test]
    fn arm64_unknown_instructions_keep_the_entry() {
        // stp x29, x30, [sp, #-16]!; b.eq +8
        let code = words(&[0xa9bf_7bfd, 0x5400_0040]);
        assert_eq!(place(Arch::Aarch64, &code, false).offset, 0);
        // cmp; b.eq; b back to the b.eq (offset 4)
        let code = words(&[0xf100_001f, 0x5400_0040, 0x17ff_ffff]);
        assert_eq!(place(Arch::Aarch64, &code, false).offset, 0);
    }

    #[test]
    fn reads_the_elf_machine() {
        let mut header = [0u8; 20];
        header[18] = 62;
        assert_eq!(Arch::of_elf_header(&header), Some(Arch::X86_64));
        header[18] = 183;
        assert_eq!(Arch::of_elf_header(&header), Some(Arch::Aarch64));
        header[18] = 40;
        assert_eq!(Arch::of_elf_header(&header), None);
    }
}
