//! x86-64: iced-x86 decodes the function; moves and products of the arguments are
//! followed through the instructions before the first one the kernel emulates.

use heapprof_common::NO_REGISTER;
use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, OpAccess,
    OpKind, Register,
};

use super::{Arch, MAX_SKIPPED_INSTRUCTIONS, Needs, Placement, ValueRegisters};

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

/// What a register holds, in terms of the call's arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Value {
    Unknown,
    Argument(u8),
    /// The low 64 bits of the product of two arguments.
    Product(u8, u8),
}

fn product(a: Value, b: Value) -> Value {
    match (a, b) {
        (Value::Argument(a), Value::Argument(b)) => Value::Product(a, b),
        _ => Value::Unknown,
    }
}

fn writes(access: OpAccess) -> bool {
    matches!(
        access,
        OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
    )
}

/// The registers' values, followed through an instruction that falls through.
struct Registers {
    values: [Value; 16],
    info: InstructionInfoFactory,
}

impl Registers {
    fn at_entry() -> Registers {
        let mut values = [Value::Unknown; 16];
        for index in 0..6 {
            let register = Arch::X86_64.argument_register(index);
            values[usize::from(register)] = Value::Argument(index);
        }
        Registers {
            values,
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
                self.values[usize::from(to)] = self.values[usize::from(from)];
                return true;
            }
            (Code::Mul_rm64, (Some(by), _)) => {
                // rdx:rax = rax * operand.
                self.values[0] = product(self.values[0], self.values[usize::from(by)]);
                self.values[1] = Value::Unknown;
                return true;
            }
            (Code::Imul_r64_rm64, (Some(to), Some(by))) if to != RSP => {
                let value = product(self.values[usize::from(to)], self.values[usize::from(by)]);
                self.values[usize::from(to)] = value;
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
                Some(register) => self.values[usize::from(register)] = Value::Unknown,
                None => {}
            }
        }
        true
    }

    /// A register holding `value`, the argument's own first.
    fn find(&self, value: Value) -> Option<u8> {
        if let Value::Argument(index) = value {
            let own = Arch::X86_64.argument_register(index);
            if self.values.get(usize::from(own)) == Some(&value) {
                return Some(own);
            }
        }
        (0..16u8).find(|&r| self.values[usize::from(r)] == value)
    }

    /// Where `needs` are now, if all are somewhere.
    fn locate(&self, needs: Needs) -> Option<ValueRegisters> {
        let register = |arg: Option<u8>| match arg {
            None => Some(NO_REGISTER),
            Some(index) => self.find(Value::Argument(index)),
        };
        let (size, count) = match (needs.size, needs.count) {
            (Some(size), Some(count)) => {
                let product = self
                    .find(Value::Product(count, size))
                    .or_else(|| self.find(Value::Product(size, count)));
                match product {
                    Some(register) => (register, NO_REGISTER),
                    None => (register(needs.size)?, register(needs.count)?),
                }
            }
            _ => (register(needs.size)?, register(needs.count)?),
        };
        Some(ValueRegisters {
            size,
            count,
            ptr: register(needs.ptr)?,
            out: register(needs.out)?,
        })
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
    let Some(located) = registers.locate(needs) else {
        return entry(
            "entry: a value the probe reads is overwritten before the first emulated instruction",
        );
    };
    if let Some(reason) = branch_into(&instructions, offset) {
        return entry(reason);
    }
    let moved = located != ValueRegisters::at_entry(Arch::X86_64, needs);
    Placement {
        offset,
        reason: if moved {
            format!("{what}, the values read from the registers they were moved to")
        } else {
            format!("{what}, after instructions that keep the values read")
        },
        emulated: true,
        registers: located,
    }
}
