//! How far below its entry a function's own code moves the stack pointer: the bound
//! the BPF programs put on where a call made by the function's body can enter (see
//! `heapprof_common::ProbeSpec::frame_bytes`).
//!
//! x86-64 only: the sum of every `push` and every `sub $imm, %rsp` (or `lea
//! -imm(%rsp), %rsp`) in the function. A sum over all of its code bounds every path
//! through it: pushes in a loop are popped in it (a call's arguments), and a `sub`
//! or `lea` that lowers it inside a loop (stack-clash probing, one page a turn)
//! makes the depth unknown. So does anything else that lowers the stack pointer by
//! an amount the code does not state (`sub %reg, %rsp`, an alignment `and`,
//! `enter`, a move into it). Instructions that raise it (`pop`, `add`, `leave`, an
//! epilogue's `lea`/`mov` from the frame pointer) only undo what the sum counted.

use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpKind,
    Register,
};

use crate::placement::x86::writes;

/// The bytes the function `code` (its whole extent) can push or reserve below its
/// entry's stack pointer, or `None` if its code does not say.
pub fn x86_frame_bytes(code: &[u8]) -> Option<u32> {
    let mut decoder = Decoder::with_ip(64, code, 0, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut total: u64 = 0;
    // Where a `sub` or `lea` lowers the stack pointer, and the ranges loops span.
    let mut reserves = Vec::new();
    let mut loops = Vec::new();
    while decoder.can_decode() {
        let instruction = decoder.decode();
        if instruction.is_invalid() {
            return None;
        }
        let lowered = lowers_by(&instruction, &mut info)?;
        if lowered > 0 && instruction.mnemonic() != Mnemonic::Push {
            reserves.push(instruction.ip());
        }
        if matches!(
            instruction.flow_control(),
            FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch
        ) && instruction.near_branch_target() <= instruction.ip()
        {
            loops.push(instruction.near_branch_target()..=instruction.ip());
        }
        total = total.checked_add(lowered)?;
    }
    if reserves
        .iter()
        .any(|ip| loops.iter().any(|turn| turn.contains(ip)))
    {
        return None;
    }
    u32::try_from(total).ok()
}

/// How much `instruction` lowers the stack pointer (0 if it does not), or `None`
/// if by an amount it does not state.
fn lowers_by(instruction: &Instruction, info: &mut InstructionInfoFactory) -> Option<u64> {
    let to_rsp = instruction.op_count() > 0
        && instruction.op0_kind() == OpKind::Register
        && instruction.op0_register() == Register::RSP;
    match instruction.mnemonic() {
        Mnemonic::Push | Mnemonic::Pushfq => Some(8),
        Mnemonic::Pop | Mnemonic::Popfq | Mnemonic::Leave | Mnemonic::Ret | Mnemonic::Call => {
            Some(0)
        }
        Mnemonic::Sub if to_rsp => immediate(instruction).map(|imm| (imm as i64).max(0) as u64),
        Mnemonic::Add if to_rsp => {
            immediate(instruction).map(|imm| (imm as i64).min(0).unsigned_abs())
        }
        // An epilogue's restore from the frame pointer raises it.
        Mnemonic::Lea if to_rsp && instruction.memory_base() == Register::RBP => Some(0),
        Mnemonic::Mov
            if to_rsp
                && instruction.op1_kind() == OpKind::Register
                && instruction.op1_register() == Register::RBP =>
        {
            Some(0)
        }
        Mnemonic::Lea
            if to_rsp
                && instruction.memory_base() == Register::RSP
                && instruction.memory_index() == Register::None =>
        {
            Some(
                (instruction.memory_displacement64() as i64)
                    .min(0)
                    .unsigned_abs(),
            )
        }
        _ => {
            let writes_rsp = info
                .info(instruction)
                .used_registers()
                .iter()
                .any(|used| used.register() == Register::RSP && writes(used.access()));
            (!writes_rsp).then_some(0)
        }
    }
}

/// The immediate second operand of `instruction`, sign-extended, if it has one.
fn immediate(instruction: &Instruction) -> Option<u64> {
    matches!(
        instruction.op1_kind(),
        OpKind::Immediate8to64 | OpKind::Immediate32to64 | OpKind::Immediate8 | OpKind::Immediate32
    )
    .then(|| instruction.immediate(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_function_without_pushes_has_no_frame() {
        // jemalloc's malloc fast path: compares, loads and a tail jump.
        let code = [
            0x48, 0x81, 0xff, 0x00, 0x10, 0x00, 0x00, // cmp $0x1000,%rdi
            0x77, 0x02, // ja +2
            0x31, 0xc0, // xor %eax,%eax
            0xc3, // ret
        ];
        assert_eq!(x86_frame_bytes(&code), Some(0));
    }

    #[test]
    fn pushes_and_reserved_space_add_up() {
        // jemalloc's calloc: six pushes and `sub $0x88,%rsp`, undone before `ret`.
        let code = [
            0x41, 0x57, 0x41, 0x56, 0x41, 0x55, 0x41, 0x54, 0x55, 0x53, // push r15..rbx
            0x48, 0x81, 0xec, 0x88, 0x00, 0x00, 0x00, // sub $0x88,%rsp
            0x48, 0x81, 0xc4, 0x88, 0x00, 0x00, 0x00, // add $0x88,%rsp
            0x5b, 0x5d, 0x41, 0x5c, 0x41, 0x5d, 0x41, 0x5e, 0x41, 0x5f, // pops
            0xc3,
        ];
        assert_eq!(x86_frame_bytes(&code), Some(6 * 8 + 0x88));
    }

    #[test]
    fn an_unstated_amount_is_unknown() {
        // `sub %rax,%rsp` (alloca), `and $-32,%rsp` (realignment).
        assert_eq!(x86_frame_bytes(&[0x48, 0x29, 0xc4, 0xc3]), None);
        assert_eq!(x86_frame_bytes(&[0x48, 0x83, 0xe4, 0xe0, 0xc3]), None);
        // `mov %rax,%rsp`.
        assert_eq!(x86_frame_bytes(&[0x48, 0x89, 0xc4, 0xc3]), None);
    }

    #[test]
    fn a_stack_probing_loop_is_unknown() {
        // -fstack-clash-protection's probe of a large frame, a page a turn.
        let code = [
            0x4c, 0x8d, 0x9c, 0x24, 0x00, 0x00, 0xff, 0xff, // lea -0x10000(%rsp),%r11
            0x48, 0x81, 0xec, 0x00, 0x10, 0x00, 0x00, // sub $0x1000,%rsp
            0x48, 0x83, 0x0c, 0x24, 0x00, // orq $0x0,(%rsp)
            0x4c, 0x39, 0xdc, // cmp %r11,%rsp
            0x75, 0xef, // jne (the sub)
            0xc3,
        ];
        assert_eq!(x86_frame_bytes(&code), None);
    }

    #[test]
    fn pushes_in_a_loop_count_once() {
        let code = [
            0x53, // push %rbx
            0x6a, 0x01, // push $1
            0x58, // pop %rax
            0xff, 0xcb, // dec %ebx
            0x75, 0xf9, // jne (push $1)
            0x5b, // pop %rbx
            0xc3,
        ];
        assert_eq!(x86_frame_bytes(&code), Some(16));
    }

    #[test]
    fn an_epilogue_from_the_frame_pointer_counts_nothing() {
        let code = [
            0x55, // push %rbp
            0x48, 0x89, 0xe5, // mov %rsp,%rbp
            0x48, 0x83, 0xec, 0x10, // sub $0x10,%rsp
            0x48, 0x8d, 0x65, 0xf8, // lea -0x8(%rbp),%rsp
            0xc9, // leave
            0xc3,
        ];
        assert_eq!(x86_frame_bytes(&code), Some(8 + 0x10));
    }
}
