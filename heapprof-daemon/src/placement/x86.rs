//! x86-64: iced-x86 decodes the function; moves and products of the arguments are
//! followed through the instructions before the first one the kernel emulates.

use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, OpAccess,
    OpKind, Register,
};

use super::{Arch, MAX_SKIPPED_INSTRUCTIONS, Needs, Placement, Tracked, Value};

/// The kernel's x86 uprobe code emulates these instead of single-stepping them
/// (arch/x86/kernel/uprobes.c: branch_setup_xol_ops, push_setup_xol_ops).
/// Prefixed forms are left out: the kernel rejects several of them.
pub(super) fn emulated(bytes: &[u8]) -> Option<&'static str> {
    match bytes {
        [0x50..=0x57] | [0x41, 0x50..=0x57] => Some("push"),
        [0x70..=0x7f, _] | [0x0f, 0x80..=0x8f, _, _, _, _] => Some("conditional jump"),
        [0xeb, _] | [0xe9, _, _, _, _] => Some("jmp"),
        [0xe8, _, _, _, _] => Some("call"),
        [0x90] => Some("nop"),
        _ => None,
    }
}

/// DWARF's number of a general-purpose register (any width names its full register).
fn number(register: Register) -> Option<u8> {
    Some(match register.full_register() {
        Register::RAX => 0,
        Register::RDX => 1,
        Register::RCX => 2,
        Register::RBX => 3,
        Register::RSI => 4,
        Register::RDI => 5,
        Register::RBP => 6,
        Register::RSP => 7,
        Register::R8 => 8,
        Register::R9 => 9,
        Register::R10 => 10,
        Register::R11 => 11,
        Register::R12 => 12,
        Register::R13 => 13,
        Register::R14 => 14,
        Register::R15 => 15,
        _ => return None,
    })
}

const RSP: u8 = 7;

/// Whether an operand access writes the register or memory.
pub(crate) fn writes(access: OpAccess) -> bool {
    matches!(
        access,
        OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
    )
}

/// The registers' values, followed through instructions that fall through.
struct Registers {
    tracked: Tracked,
    info: InstructionInfoFactory,
}

impl Registers {
    fn at_entry() -> Registers {
        Registers {
            tracked: Tracked::at_entry(Arch::X86_64, 16),
            info: InstructionInfoFactory::new(),
        }
    }

    fn register_operand(instruction: &Instruction, operand: u32) -> Option<u8> {
        (instruction.op_kind(operand) == OpKind::Register)
            .then(|| number(instruction.op_register(operand)))
            .flatten()
    }

    /// Applies `instruction`; false if it writes the stack pointer.
    fn apply(&mut self, instruction: &Instruction) -> bool {
        let operands = (
            Self::register_operand(instruction, 0),
            Self::register_operand(instruction, 1),
        );
        match (instruction.code(), operands) {
            (Code::Mov_r64_rm64 | Code::Mov_rm64_r64, (Some(to), Some(from))) if to != RSP => {
                self.tracked.set(to, self.tracked.get(from));
                return true;
            }
            (Code::Mul_rm64, (Some(by), _)) => {
                // rdx:rax = rax * operand.
                self.tracked
                    .set(0, self.tracked.get(0).times(self.tracked.get(by)));
                self.tracked.set(1, Value::Unknown);
                return true;
            }
            (Code::Imul_r64_rm64, (Some(to), Some(by))) if to != RSP => {
                let value = self.tracked.get(to).times(self.tracked.get(by));
                self.tracked.set(to, value);
                return true;
            }
            _ => {}
        }
        for used in self.info.info(instruction).used_registers() {
            if !writes(used.access()) {
                continue;
            }
            match number(used.register()) {
                Some(RSP) => return false,
                Some(register) => self.tracked.set(register, Value::Unknown),
                None => {}
            }
        }
        true
    }
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

/// Whether a direct branch of the function lands in `(0, offset]`, or an indirect
/// jump makes that unknowable: why the spot cannot be used.
fn branch_into(instructions: &[Instruction], offset: u64) -> Option<&'static str> {
    for instruction in instructions {
        match instruction.flow_control() {
            FlowControl::IndirectBranch => {
                return Some("entry: the function has an indirect jump");
            }
            FlowControl::UnconditionalBranch
            | FlowControl::ConditionalBranch
            | FlowControl::Call => {
                let target = instruction.near_branch_target();
                if target > 0 && target <= offset {
                    return Some(
                        "entry: a branch in the function lands in the skipped instructions",
                    );
                }
            }
            _ => {}
        }
    }
    None
}

pub(super) fn place(code: &[u8], needs: Needs) -> Placement {
    let entry = |reason: &str| Placement::entry(Arch::X86_64, code, needs, reason);
    let Some(instructions) = decode_all(code) else {
        return entry("entry: the function does not decode");
    };
    let mut registers = Registers::at_entry();
    let mut spot = None;
    for instruction in instructions.iter().take(MAX_SKIPPED_INSTRUCTIONS + 1) {
        let start = instruction.ip() as usize;
        let bytes = &code[start..start + instruction.len()];
        if let Some(what) = emulated(bytes) {
            spot = Some((instruction.ip(), what));
            break;
        }
        if instruction.flow_control() != FlowControl::Next {
            return entry("entry: a branch comes before any emulated instruction");
        }
        if !registers.apply(instruction) {
            return entry(
                "entry: an instruction before the first emulated one writes the stack pointer",
            );
        }
    }
    let Some((offset, what)) = spot else {
        return entry("entry: no emulated instruction near the start");
    };
    if offset == 0 {
        return entry(&format!("entry: the first instruction is a {what}"));
    }
    let Some(located) = registers.tracked.locate(needs) else {
        return entry(
            "entry: a value the probe reads is overwritten before the first emulated instruction",
        );
    };
    if let Some(reason) = branch_into(&instructions, offset) {
        return entry(reason);
    }
    Placement::moved(Arch::X86_64, offset, what, needs, located)
}
