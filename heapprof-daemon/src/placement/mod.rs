//! Where in an allocator function to put its probes, and where the values its entry
//! program reads are there.
//!
//! A uprobe on an instruction the kernel cannot emulate is single-stepped out of line,
//! which costs about ten times more than an emulated one (glibc's `free` starts with
//! `test %rdi,%rdi`: ~10 µs per call against ~0.9 µs a few bytes later). So the probe goes
//! to the first instruction the kernel emulates, when that is provably equivalent to the
//! entry:
//! - every instruction before it falls through (no branch, call or return), so every
//!   call passes the new spot, before anything else happens;
//! - none of them writes the stack pointer (the programs match calls and returns by
//!   it, and the kernel hijacks the return address at the stack pointer when a return
//!   probe shares the spot), nor arm64's return-address register when a return probe
//!   shares the spot;
//! - every value the probe reads (the size, the count, the block, the out-pointer) is
//!   still in a register there. On x86-64 the moves are followed: jemalloc's and
//!   mimalloc's fast paths copy arguments to other registers before their first
//!   branch, and glibc's `reallocarray` multiplies its count by its size into the
//!   register it then passes on, which is the product the program would compute;
//! - no branch in the function lands inside the skipped bytes or on the new spot, so it
//!   fires once per call. An indirect jump makes that unknowable: entry.
//!
//! Whenever the code is not understood, the answer is the entry. Every placement says
//! whether the kernel emulates the instruction at the spot: one it does not is
//! single-stepped on every call, which the daemon warns about.

use std::fmt;

use heapprof_common::NO_REGISTER;
use iced_x86::{Decoder, DecoderOptions};

use crate::arch::Arch;

/// What placement needs of an instruction set: which registers hold the values.
impl Arch {
    /// The register the programs read as value register `index` (see
    /// [`heapprof_common::VALUE_REGISTERS`]): x86-64's sixteen in DWARF numbering;
    /// arm64's x0-x7 (the arguments) and x19-x26 (the callee-saved registers functions
    /// keep their arguments in across calls).
    fn value_register(self, index: u8) -> u8 {
        match self {
            Arch::X86_64 => index,
            Arch::Aarch64 if index < 8 => index,
            Arch::Aarch64 => index + 11,
        }
    }

    /// The register that holds argument `index` (0-based) at a function's entry, in
    /// the numbering of [`ValueRegisters`].
    fn argument_register(self, index: u8) -> u8 {
        match self {
            // rdi, rsi, rdx, rcx, r8, r9 in DWARF numbering.
            Arch::X86_64 => [5, 4, 1, 2, 8, 9]
                .get(usize::from(index))
                .copied()
                .unwrap_or(NO_REGISTER),
            Arch::Aarch64 if index < 8 => index,
            Arch::Aarch64 => NO_REGISTER,
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

/// The arguments (0-based) an entry program reads, from the function's signature.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    /// The size.
    pub size: Option<u8>,
    /// The count the size is multiplied by.
    pub count: Option<u8>,
    /// The block freed, moved or resized.
    pub ptr: Option<u8>,
    /// Where the new block is written.
    pub out: Option<u8>,
}

/// Where the values an entry program reads are at the probe spot: value-register
/// indices (x86-64: DWARF's numbers, rax 0 to r15 15; arm64: x0-x7 as 0-7, x19-x26
/// as 8-15), or [`NO_REGISTER`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValueRegisters {
    /// The size, or the product of count and size when `count` is [`NO_REGISTER`]
    /// although the signature has a count.
    pub size: u8,
    /// The count.
    pub count: u8,
    /// The block.
    pub ptr: u8,
    /// The out-pointer.
    pub out: u8,
}

impl ValueRegisters {
    /// The argument registers of `needs` at a function's entry.
    pub fn at_entry(arch: Arch, needs: Needs) -> ValueRegisters {
        let register = |arg: Option<u8>| arg.map_or(NO_REGISTER, |a| arch.argument_register(a));
        ValueRegisters {
            size: register(needs.size),
            count: register(needs.count),
            ptr: register(needs.ptr),
            out: register(needs.out),
        }
    }
}

/// Where a function's probes go, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Bytes from the function's start.
    pub offset: u64,
    /// What is at that spot, or why the entry was kept (for the log).
    pub reason: String,
    /// Whether the kernel emulates the instruction there; `false`: it is single-stepped
    /// out of line on every call (or the instruction is unknown).
    pub emulated: bool,
    /// Where the values the entry program reads are there.
    pub registers: ValueRegisters,
    /// Bytes the stack pointer is below its value at the entry, at the spot.
    pub sp_adjust: u32,
    /// Where the return probe goes, in bytes from the function's start: empty for the
    /// spot itself, else every exit (arm64: the spot is past the instruction that
    /// saves the return address, so a return probe there would not see the return).
    pub exits: Vec<u64>,
}

impl Placement {
    /// The function's first instruction, for `reason`. `code` is the function's bytes
    /// (as much as is known), to tell whether the kernel emulates that instruction.
    pub fn entry(arch: Arch, code: &[u8], needs: Needs, reason: impl Into<String>) -> Placement {
        Placement {
            offset: 0,
            reason: reason.into(),
            emulated: emulated_at(arch, code, 0).is_some(),
            registers: ValueRegisters::at_entry(arch, needs),
            sp_adjust: 0,
            exits: Vec::new(),
        }
    }
}

impl Placement {
    /// The emulated instruction `what` at `offset`, where the values read are in
    /// `located`.
    fn moved(
        arch: Arch,
        offset: u64,
        what: &str,
        needs: Needs,
        located: ValueRegisters,
    ) -> Placement {
        let moved = located != ValueRegisters::at_entry(arch, needs);
        Placement {
            offset,
            reason: if moved {
                format!("{what}, the values read from the registers they were moved to")
            } else {
                format!("{what}, after instructions that keep the values read")
            },
            emulated: true,
            registers: located,
            sp_adjust: 0,
            exits: Vec::new(),
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "+{} ({})", self.offset, self.reason)?;
        if !self.exits.is_empty() {
            let exits: Vec<String> = self.exits.iter().map(|e| format!("+{e}")).collect();
            write!(f, ", return probes on its exits {}", exits.join(" "))?;
        }
        if !self.emulated {
            write!(f, ", single-stepped")?;
        }
        Ok(())
    }
}

/// How far past the entry a probe may move.
const MAX_SKIPPED_INSTRUCTIONS: usize = 24;

/// Chooses the probe spot in `code`, the function's bytes from its first instruction
/// (the whole function, so branches back into the skipped bytes can be seen), for an
/// entry program that reads `needs`. `return_probe` says whether a return probe shares
/// the spot.
pub fn place(arch: Arch, code: &[u8], needs: Needs, return_probe: bool) -> Placement {
    match arch {
        // x86-64 keeps only the stack pointer for a return probe, which is always kept.
        Arch::X86_64 => x86::place(code, needs),
        Arch::Aarch64 => arm64::place(code, needs, return_probe),
    }
}

/// What the kernel emulates at `offset` of `code`, if it does.
fn emulated_at(arch: Arch, code: &[u8], offset: usize) -> Option<&'static str> {
    let rest = code.get(offset..)?;
    match arch {
        Arch::X86_64 => {
            let mut decoder = Decoder::with_ip(64, rest, 0, DecoderOptions::NONE);
            let instruction = decoder.decode();
            if instruction.is_invalid() {
                return None;
            }
            x86::emulated(rest.get(..instruction.len())?)
        }
        Arch::Aarch64 => {
            let word = rest.first_chunk::<4>()?;
            arm64::simulated(u32::from_le_bytes(*word))
        }
    }
}

mod arm64;
pub(crate) mod x86;

/// What a register holds, in terms of the call's arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Value {
    Unknown,
    Argument(u8),
    /// The low 64 bits of the product of two arguments.
    Product(u8, u8),
}

impl Value {
    /// The low 64 bits of `self` times `other`, when both are arguments.
    fn times(self, other: Value) -> Value {
        match (self, other) {
            (Value::Argument(a), Value::Argument(b)) => Value::Product(a, b),
            _ => Value::Unknown,
        }
    }
}

/// The registers' values as a decoder follows them from a function's entry, by
/// register number ([`ValueRegisters`]' numbering, up to `count`); the programs can
/// read the first [`heapprof_common::VALUE_REGISTERS`].
#[derive(Clone)]
struct Tracked {
    arch: Arch,
    values: Vec<Value>,
}

impl Tracked {
    fn at_entry(arch: Arch, count: usize) -> Tracked {
        let mut tracked = Tracked {
            arch,
            values: vec![Value::Unknown; count],
        };
        for index in 0..8 {
            tracked.set(arch.argument_register(index), Value::Argument(index));
        }
        tracked
    }

    fn get(&self, register: u8) -> Value {
        self.values
            .get(usize::from(register))
            .copied()
            .unwrap_or(Value::Unknown)
    }

    fn set(&mut self, register: u8, value: Value) {
        if let Some(slot) = self.values.get_mut(usize::from(register)) {
            *slot = value;
        }
    }

    /// A readable register holding `value` (its value-register index), the
    /// argument's own first.
    fn find(&self, value: Value) -> Option<u8> {
        if let Value::Argument(index) = value {
            let own = self.arch.argument_register(index);
            if self.get(own) == value {
                return Some(own);
            }
        }
        (0..heapprof_common::VALUE_REGISTERS as u8)
            .find(|&i| self.get(self.arch.value_register(i)) == value)
    }

    /// Where `needs` are now, if all are in readable registers: a count and a size
    /// multiplied together are read as the size.
    fn locate(&self, needs: Needs) -> Option<ValueRegisters> {
        let register = |arg: Option<u8>| match arg {
            None => Some(NO_REGISTER),
            Some(index) => self.find(Value::Argument(index)),
        };
        let product = match (needs.size, needs.count) {
            (Some(size), Some(count)) => self
                .find(Value::Product(count, size))
                .or_else(|| self.find(Value::Product(size, count))),
            _ => None,
        };
        let (size, count) = match product {
            Some(product) => (product, NO_REGISTER),
            None => (register(needs.size)?, register(needs.count)?),
        };
        Some(ValueRegisters {
            size,
            count,
            ptr: register(needs.ptr)?,
            out: register(needs.out)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hex bytes as written by objdump.
    fn hex(text: &str) -> Vec<u8> {
        text.split_whitespace()
            .map(|byte| u8::from_str_radix(byte, 16).expect("hex byte"))
            .collect()
    }

    const FREE: Needs = Needs {
        size: None,
        count: None,
        ptr: Some(0),
        out: None,
    };
    const MALLOC: Needs = Needs {
        size: Some(0),
        count: None,
        ptr: None,
        out: None,
    };
    const CALLOC: Needs = Needs {
        size: Some(1),
        count: Some(0),
        ptr: None,
        out: None,
    };
    const REALLOCARRAY: Needs = Needs {
        size: Some(2),
        count: Some(1),
        ptr: Some(0),
        out: None,
    };

    /// DWARF numbers of the x86-64 registers the tests name.
    const RAX: u8 = 0;
    const RSI: u8 = 4;
    const RDI: u8 = 5;

    /// glibc 2.36's free: test %rdi,%rdi; je +0xbf; push %rbp; lea -0x10(%rdi),%rsi; ret
    const GLIBC_FREE: &str = "48 85 ff 0f 84 bf 00 00 00 55 48 8d 77 f0 c3";

    #[test]
    fn x86_free_moves_past_the_null_test() {
        let placement = place(Arch::X86_64, &hex(GLIBC_FREE), FREE, false);
        assert_eq!(placement.offset, 3, "{placement}");
        assert!(placement.reason.contains("conditional jump"));
        assert!(placement.emulated);
        assert_eq!(placement.registers.ptr, RDI);
    }

    #[test]
    fn x86_writes_to_registers_the_probe_does_not_read_are_skipped() {
        // jemalloc 5.3's free (Debian): nine instructions computing into rax, rdx and
        // rcx, then jne at +0x30. rdx and rcx are argument registers, but free reads
        // only its first argument.
        let code = hex(
            "48 89 f8 48 8b 15 0e 53 0a 00 48 89 f9 48 c1 e8 1a 48 81 e1 00 00 00 c0 \
             25 f0 00 00 00 64 48 03 04 25 00 00 00 00 48 01 d0 48 3b 88 b0 01 00 00 \
             0f 85 8a 00 00 00",
        );
        let placement = place(Arch::X86_64, &code, FREE, false);
        assert_eq!(placement.offset, 0x30, "{placement}");
        assert_eq!(placement.registers.ptr, RDI);
        // Were the size in rdx (a third argument) read, the entry would stay.
        let needs = Needs {
            size: Some(2),
            ..FREE
        };
        let placement = place(Arch::X86_64, &code, needs, false);
        assert_eq!(placement.offset, 0, "{placement}");
        assert!(!placement.emulated, "mov %rdi,%rax is single-stepped");
    }

    #[test]
    fn x86_moved_arguments_are_read_where_they_were_moved() {
        // mimalloc 2.0's malloc: mov tls(%rip),%rax; mov %rdi,%rsi;
        // mov %fs:(%rax),%rdi; cmp $0x400,%rsi; ja
        let code = hex("48 8b 05 49 b4 00 00 48 89 fe 64 48 8b 38 48 81 fe 00 04 00 00 77 29");
        let placement = place(Arch::X86_64, &code, MALLOC, true);
        assert_eq!(placement.offset, 0x15, "{placement}");
        assert_eq!(placement.registers.size, RSI);
        // mimalloc's calloc: the count moved to rax, the size kept in rsi.
        let code = hex("48 8b 15 c9 ad 00 00 48 89 f8 64 48 8b 3a 48 83 f8 01 74 08");
        let placement = place(Arch::X86_64, &code, CALLOC, true);
        assert_eq!(placement.offset, 0x12, "{placement}");
        assert_eq!(
            (placement.registers.count, placement.registers.size),
            (RAX, RSI)
        );
    }

    #[test]
    fn x86_a_product_of_count_and_size_is_the_size() {
        // glibc's reallocarray: mov %rsi,%rax; mul %rdx; mov %rax,%rsi; jo; jmp realloc
        let code = hex("48 89 f0 48 f7 e2 48 89 c6 70 05 e9 40 b8 f8 ff");
        let placement = place(Arch::X86_64, &code, REALLOCARRAY, true);
        assert_eq!(placement.offset, 9, "{placement}");
        let registers = placement.registers;
        // rax and rsi both hold the product there.
        assert!([RAX, RSI].contains(&registers.size), "{registers:?}");
        assert_eq!(
            (registers.count, registers.ptr, registers.out),
            (NO_REGISTER, RDI, NO_REGISTER)
        );
        // A product of anything else is no size.
        let code = hex("48 89 f0 48 f7 e7 48 89 c6 70 05 e9 40 b8 f8 ff");
        assert_eq!(place(Arch::X86_64, &code, REALLOCARRAY, true).offset, 0);
    }

    #[test]
    fn x86_push_at_entry_stays() {
        // glibc's malloc: push %r12; push %rbp; ret
        let placement = place(Arch::X86_64, &hex("41 54 55 c3"), MALLOC, true);
        assert_eq!(placement.offset, 0, "{placement}");
        assert!(placement.emulated);
    }

    #[test]
    fn x86_cmpb_then_push_moves_even_with_a_return_probe() {
        // glibc's posix_memalign: cmpb $0,0x10(%rip); push %r12; ret
        let code = hex("80 3d 10 00 00 00 00 41 54 c3");
        assert_eq!(place(Arch::X86_64, &code, MALLOC, true).offset, 7);
    }

    #[test]
    fn x86_argument_or_stack_writes_keep_the_entry() {
        // mov %rsi,%rdi; push %rbx: the first argument is gone at the push.
        let placement = place(Arch::X86_64, &hex("48 89 f7 53 c3"), FREE, false);
        assert_eq!(placement.offset, 0, "{placement}");
        assert!(!placement.emulated);
        // A 32-bit copy is not the 64-bit value: mov %edi,%eax; xor %edi,%edi; push %rbx.
        let placement = place(Arch::X86_64, &hex("89 f8 31 ff 53 c3"), MALLOC, false);
        assert_eq!(placement.offset, 0, "{placement}");
        // sub $8,%rsp; push %rbx: the return address is no longer at the stack pointer,
        // and the stack pointer no longer tells where the call began (with or without
        // a return probe: free's nesting check uses it too).
        let code = hex("48 83 ec 08 53 c3");
        assert_eq!(place(Arch::X86_64, &code, MALLOC, true).offset, 0);
        assert_eq!(place(Arch::X86_64, &code, FREE, false).offset, 0);
        // mov %rdi,%rsp: copying into the stack pointer is no move to follow.
        let code = hex("48 89 fc 53 c3");
        assert_eq!(place(Arch::X86_64, &code, FREE, false).offset, 0);
    }

    #[test]
    fn x86_branch_back_into_skipped_bytes_keeps_the_entry() {
        // test %rdi,%rdi; je +0; jmp back to the je (offset 3).
        let code = hex("48 85 ff 0f 84 00 00 00 00 eb f8");
        let placement = place(Arch::X86_64, &code, FREE, false);
        assert_eq!(placement.offset, 0, "{placement}");
        // An indirect jump anywhere: unknowable.
        let code = hex("48 85 ff 74 02 ff e0 c3");
        assert_eq!(place(Arch::X86_64, &code, FREE, false).offset, 0);
    }

    #[test]
    fn x86_garbage_keeps_the_entry() {
        let placement = place(Arch::X86_64, &[0x0f, 0xff, 0xff], FREE, false);
        assert_eq!(placement.offset, 0);
        assert!(!placement.emulated);
        assert_eq!(place(Arch::X86_64, &[], FREE, false).offset, 0);
    }

    fn words(words: &[u32]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    #[test]
    fn arm64_cbz_at_entry_stays_and_cmp_is_skipped() {
        // cbz x0, +8; ret
        let placement = place(
            Arch::Aarch64,
            &words(&[0xb400_0040, 0xd65f_03c0]),
            FREE,
            false,
        );
        assert_eq!(placement.offset, 0);
        assert!(placement.emulated);
        // cmp x0, #0 (subs xzr, x0, #0); b.eq +8; ret
        let code = words(&[0xf100_001f, 0x5400_0040, 0xd65f_03c0]);
        let placement = place(Arch::Aarch64, &code, FREE, false);
        assert_eq!(placement.offset, 4);
        assert_eq!(placement.registers.ptr, 0);
    }

    #[test]
    fn arm64_paciasp_moves_the_return_probes_to_the_exits() {
        // paciasp; b.eq +8; autiasp; ret
        let code = words(&[0xd503_233f, 0x5400_0040, 0xd503_23bf, 0xd65f_03c0]);
        assert_eq!(place(Arch::Aarch64, &code, FREE, false).offset, 4);
        let placement = place(Arch::Aarch64, &code, MALLOC, true);
        assert_eq!(
            (placement.offset, placement.exits.clone()),
            (4, vec![12]),
            "{placement}"
        );
        // Without a known exit, the entry.
        let code = words(&[0xd503_233f, 0x5400_0040]);
        assert_eq!(place(Arch::Aarch64, &code, MALLOC, true).offset, 0);
    }

    #[test]
    fn arm64_unknown_instructions_keep_the_entry() {
        // stp x29, x30, [sp, #-16]!; b.eq +8
        let code = words(&[0xa9bf_7bfd, 0x5400_0040]);
        let placement = place(Arch::Aarch64, &code, MALLOC, true);
        assert_eq!(placement.offset, 0);
        assert!(!placement.emulated, "stp is single-stepped");
        // cmp; b.eq; b back to the b.eq (offset 4)
        let code = words(&[0xf100_001f, 0x5400_0040, 0x17ff_ffff]);
        assert_eq!(place(Arch::Aarch64, &code, FREE, false).offset, 0);
    }

    #[test]
    fn arm64_writes_to_registers_the_probe_does_not_read_are_skipped() {
        // mimalloc 2.0's free (Debian arm64): mov x3, x0; cbz x0
        let placement = place(
            Arch::Aarch64,
            &words(&[0xaa00_03e3, 0xb400_0360]),
            FREE,
            false,
        );
        assert_eq!(
            (placement.offset, placement.registers.ptr),
            (4, 0),
            "{placement}"
        );
        // jemalloc's sdallocx: cmp x1, #1, lsl #12; ccmp w2, #0, #0, ls; b.ne
        let code = words(&[0xf140_043f, 0x7a40_9840, 0x5400_03a1]);
        assert_eq!(place(Arch::Aarch64, &code, FREE, false).offset, 8);
        // mimalloc's mi_heap_malloc_small(heap, size): four instructions computing into
        // x2 and x3 from the size in x1, then cbz x3.
        let code = words(&[
            0x9100_1c22,
            0x927d_f042,
            0x8b02_0002,
            0xf940_0442,
            0xf940_0843,
            0xb400_0103,
        ]);
        let size_in_x1 = Needs {
            size: Some(1),
            ..MALLOC
        };
        let placement = place(Arch::Aarch64, &code, size_in_x1, true);
        assert_eq!(
            (placement.offset, placement.registers.size),
            (20, 1),
            "{placement}"
        );
        // A read value overwritten: the entry stays (here the size, were it in x2).
        let size_in_x2 = Needs {
            size: Some(2),
            ..MALLOC
        };
        assert_eq!(place(Arch::Aarch64, &code, size_in_x2, true).offset, 0);
    }

    #[test]
    fn arm64_moves_and_products_are_followed() {
        // mov x3, x0; mov x0, x1; b.eq: the block is read from x3.
        let code = words(&[0xaa00_03e3, 0xaa01_03e0, 0x5400_0080]);
        let placement = place(Arch::Aarch64, &code, FREE, false);
        assert_eq!(
            (placement.offset, placement.registers.ptr),
            (8, 3),
            "{placement}"
        );
        // mul x2, x1, x2 (count in x1, size in x2); cbz x2: the size is the product.
        let code = words(&[0x9b02_7c22, 0xb400_0102]);
        let needs = Needs {
            size: Some(2),
            count: Some(1),
            ..MALLOC
        };
        let placement = place(Arch::Aarch64, &code, needs, true);
        assert_eq!(
            (
                placement.offset,
                placement.registers.size,
                placement.registers.count
            ),
            (4, 2, NO_REGISTER),
            "{placement}"
        );
    }

    #[test]
    fn arm64_a_pushed_frame_moves_the_return_probes_to_the_exits() {
        // glibc 2.36's malloc (Debian arm64): stp x29, x30, [sp, #-64]!; mov x29, sp;
        // stp x23, x24, [sp, #48]; adrp: the stack pointer moves, and the link
        // register is saved where a return probe at the adrp could no longer replace
        // it; then ldp x29, x30, [sp], #64; ret.
        let prologue = [0xa9bc_7bfd, 0x9100_03fd, 0xa903_63f7, 0x9000_08b7];
        let code = words(&[&prologue[..], &[0xa8c4_7bfd, 0xd65f_03c0]].concat());
        let placement = place(Arch::Aarch64, &code, MALLOC, true);
        assert_eq!(
            (
                placement.offset,
                placement.sp_adjust,
                placement.exits.clone()
            ),
            (12, 64, vec![20]),
            "{placement}"
        );
        assert!(placement.emulated);
        // free has no return probe: its probe moves, the exits do not matter.
        let placement = place(Arch::Aarch64, &words(&prologue), FREE, false);
        assert_eq!((placement.offset, placement.sp_adjust), (12, 64));
        // With no exit to be seen, the entry.
        let placement = place(Arch::Aarch64, &words(&prologue), MALLOC, true);
        assert_eq!(placement.offset, 0, "{placement}");
        assert!(!placement.emulated);
        // sub sp, sp, #32 is a push too.
        let code = words(&[0xd100_83ff, 0xb400_0040, 0x9100_83ff, 0xd65f_03c0]);
        let placement = place(Arch::Aarch64, &code, MALLOC, true);
        assert_eq!(
            (placement.offset, placement.sp_adjust),
            (4, 32),
            "{placement}"
        );
        // A store without write-back moves nothing: str x19, [sp, #16]; cbz x0.
        let code = words(&[0xf900_0bf3, 0xb400_0040]);
        assert_eq!(place(Arch::Aarch64, &code, FREE, false).offset, 4);
    }

    #[test]
    fn arm64_a_retry_loop_back_into_the_skipped_instructions_is_followed() {
        // mimalloc 2.0's mi_new_aligned_nothrow (Debian arm64): the arguments kept in
        // x21 and x20, moved back to x0 and x1 before the call, where the new-handler
        // retry branches back to (+0x18).
        let code = words(&[
            0xa9bd_7bfd,
            0x9100_03fd,
            0xa901_53f3,
            0xaa01_03f4,
            0xf900_13f5,
            0xaa00_03f5,
            0xaa14_03e1,
            0xaa15_03e0,
            0x97ff_d037,
            0xaa00_03f3,
            0xb400_00c0,
            0xf940_13f5,
            0xaa13_03e0,
            0xa941_53f3,
            0xa8c3_7bfd,
            0xd65f_03c0,
            0x97ff_fecb,
            0xb400_0060,
            0xd63f_0000,
            0x17ff_fff3,
            0x9000_0021,
            0x5280_0180,
            0x9110_e021,
            0x9400_0ae8,
            0x17ff_fff3,
        ]);
        let placement = place(Arch::Aarch64, &code, MALLOC, true);
        assert_eq!(
            (
                placement.offset,
                placement.sp_adjust,
                placement.exits.clone()
            ),
            (0x20, 48, vec![0x3c]),
            "{placement}"
        );
        assert_eq!(placement.registers.size, 0);
        // Were x21 written on the retry's way (mov x21, x0 before the loop back), the
        // size would be unknown there: the entry.
        let mut changed = code.clone();
        changed[18 * 4..19 * 4].copy_from_slice(&0xaa00_03f5u32.to_le_bytes());
        assert_eq!(place(Arch::Aarch64, &changed, MALLOC, true).offset, 0);
    }

    #[test]
    fn arm64_exits_are_returns_and_tail_calls_after_the_pop() {
        // stp x29, x30, [sp, #-16]!; adrp x1; cbz x0, +12; ldp x29, x30, [sp], #16;
        // b <outside>; ldp x29, x30, [sp], #16; ret
        let prologue = [0xa9bf_7bfd, 0x9000_0001, 0xb400_0060];
        let tail = [0xa8c1_7bfd, 0x1400_0100];
        let ret = [0xa8c1_7bfd, 0xd65f_03c0];
        let code = words(&[&prologue[..], &tail, &ret].concat());
        let placement = place(Arch::Aarch64, &code, MALLOC, true);
        assert_eq!(placement.exits, vec![16, 24], "{placement}");
        // A tail call with the frame still pushed: the exits are not known.
        let code = words(&[&prologue[..], &[0xd503_201f, 0x1400_0100], &ret].concat());
        assert_eq!(place(Arch::Aarch64, &code, MALLOC, true).offset, 0);
        // A conditional branch out of the function.
        let code = words(&[&prologue[..], &[0xb400_1000], &ret].concat());
        assert_eq!(place(Arch::Aarch64, &code, MALLOC, true).offset, 0);
        // retaa, and ret through another register.
        for exit in [0xd65f_0bff, 0xd65f_0020] {
            let code = words(&[&prologue[..], &[0xa8c1_7bfd, exit]].concat());
            let placement = place(Arch::Aarch64, &code, MALLOC, true);
            assert_eq!(placement.offset, 0, "{placement}");
        }
        // A call (bl) out of the function is no exit.
        let code = words(&[&prologue[..], &[0x9400_0100], &ret].concat());
        assert_eq!(place(Arch::Aarch64, &code, MALLOC, true).exits, vec![20]);
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
