//! The registers a probe sees, per architecture.

#[cfg(not(bpf_target_arch = "aarch64"))]
use aya_ebpf::helpers::bpf_probe_read_user;
use aya_ebpf::programs::{ProbeContext, RetProbeContext};

/// Where the stack pointer is at a call's return, relative to its entry: x86-64's
/// `ret` pops the return address; arm64 keeps it in the link register.
#[cfg(bpf_target_arch = "aarch64")]
pub const RETURN_SP_OFFSET: u64 = 0;
/// Where the stack pointer is at a call's return, relative to its entry: x86-64's
/// `ret` pops the return address; arm64 keeps it in the link register.
#[cfg(not(bpf_target_arch = "aarch64"))]
pub const RETURN_SP_OFFSET: u64 = 8;

/// The `futex` system call's number (the generic table arm64 shares).
#[cfg(bpf_target_arch = "aarch64")]
pub const FUTEX_SYSCALL: i64 = 98;
/// The `futex` system call's number (x86-64's table).
#[cfg(not(bpf_target_arch = "aarch64"))]
pub const FUTEX_SYSCALL: i64 = 202;

/// The `execve` and `execveat` system calls' numbers (the generic table arm64 shares).
#[cfg(bpf_target_arch = "aarch64")]
pub const EXECVE_SYSCALL: i64 = 221;
#[cfg(bpf_target_arch = "aarch64")]
pub const EXECVEAT_SYSCALL: i64 = 281;
/// The `execve` and `execveat` system calls' numbers (x86-64's table).
#[cfg(not(bpf_target_arch = "aarch64"))]
pub const EXECVE_SYSCALL: i64 = 59;
#[cfg(not(bpf_target_arch = "aarch64"))]
pub const EXECVEAT_SYSCALL: i64 = 322;

/// User addresses fit in 48 bits; arm64 return addresses signed with pointer
/// authentication carry the code above them.
#[cfg(bpf_target_arch = "aarch64")]
const ADDRESS_MASK: u64 = (1 << 48) - 1;

/// The instruction pointer (the probe's address) and stack pointer at an entry probe.
/// Probes sit where the stack pointer still has its value at the function's entry
/// (probe placement never skips an instruction that writes it).
#[inline(always)]
pub fn at_entry(ctx: &ProbeContext) -> (u64, u64) {
    #[cfg(bpf_target_arch = "x86_64")]
    // SAFETY: ctx.regs is the probe's pt_regs, readable by the program.
    unsafe {
        let regs = &*ctx.regs;
        (regs.rip, regs.rsp)
    }
    #[cfg(bpf_target_arch = "aarch64")]
    // SAFETY: the kernel's arm64 pt_regs begins with user_pt_regs.
    unsafe {
        let regs = &*(ctx.regs as *const aya_ebpf::bindings::user_pt_regs);
        (regs.pc, regs.sp)
    }
    #[cfg(not(any(bpf_target_arch = "x86_64", bpf_target_arch = "aarch64")))]
    {
        let _ = ctx;
        (0, 0)
    }
}

/// The return address of the call being entered (0 if unreadable): at the stack
/// pointer on x86-64, in the link register on arm64.
#[inline(always)]
pub fn return_address_at_entry(ctx: &ProbeContext, sp: u64) -> u64 {
    #[cfg(bpf_target_arch = "aarch64")]
    // SAFETY: the kernel's arm64 pt_regs begins with user_pt_regs.
    unsafe {
        let _ = sp;
        let regs = &*(ctx.regs as *const aya_ebpf::bindings::user_pt_regs);
        regs.regs[30] & ADDRESS_MASK
    }
    #[cfg(not(bpf_target_arch = "aarch64"))]
    {
        let _ = ctx;
        user_word(sp)
    }
}

/// The caller's callee-saved registers at an entry probe, folded into one word: x86-64's
/// rbx, rbp and r12-r15; arm64's x19-x29. A function restores them before it returns
/// or makes a tail call, and a caller keeps its own values in them between its calls,
/// so the word tells a tail call (the same) from a later call that follows other work
/// (almost always different), without reading the user stack.
#[inline(always)]
pub fn callee_saved(ctx: &ProbeContext) -> u64 {
    #[cfg(bpf_target_arch = "x86_64")]
    // SAFETY: ctx.regs is the probe's pt_regs, readable by the program.
    unsafe {
        let regs = &*ctx.regs;
        fold(&[regs.rbx, regs.rbp, regs.r12, regs.r13, regs.r14, regs.r15])
    }
    #[cfg(bpf_target_arch = "aarch64")]
    // SAFETY: the kernel's arm64 pt_regs begins with user_pt_regs.
    unsafe {
        let regs = &*(ctx.regs as *const aya_ebpf::bindings::user_pt_regs);
        fold(&[
            regs.regs[19],
            regs.regs[20],
            regs.regs[21],
            regs.regs[22],
            regs.regs[23],
            regs.regs[24],
            regs.regs[25],
            regs.regs[26],
            regs.regs[27],
            regs.regs[28],
            regs.regs[29],
        ])
    }
    #[cfg(not(any(bpf_target_arch = "x86_64", bpf_target_arch = "aarch64")))]
    {
        let _ = ctx;
        0
    }
}

/// Folds `words` into one, each rotated by its own amount, so that two registers
/// swapping values or changing by the same bits do not cancel out.
#[cfg(any(bpf_target_arch = "x86_64", bpf_target_arch = "aarch64"))]
#[inline(always)]
fn fold(words: &[u64]) -> u64 {
    let mut folded = 0u64;
    let mut rotation = 0u32;
    for word in words {
        folded ^= word.rotate_left(rotation);
        rotation += 11;
    }
    folded
}

/// The word of user memory at `address` (0 if unreadable).
///
/// A function of its own (a BPF-to-BPF call) with 8 bytes of stack, for the cost of the
/// copy's destination check (hardened usercopy, `__check_object_size`): a frame of 64
/// bytes or more is on the JIT's per-CPU private stack (Linux 6.13+, x86-64), which the
/// check takes for heap memory (`is_vmalloc_addr`, `__virt_addr_valid`, the folio's
/// flags: two thirds of the read's time, as much as the rest of an unsampled call's
/// program on the probes); a small frame stays on the task's stack, which it accepts at
/// once. The call costs a few instructions.
#[cfg(not(bpf_target_arch = "aarch64"))]
#[inline(never)]
pub fn user_word(address: u64) -> u64 {
    // SAFETY: bpf_probe_read_user checks the user address.
    unsafe { bpf_probe_read_user(address as *const u64) }.unwrap_or(0)
}

/// The caller's state at a return probe: the return address (the caller's next
/// instruction), frame pointer and stack pointer, all restored by then.
#[inline(always)]
pub fn at_return(ctx: &RetProbeContext) -> (u64, u64, u64) {
    #[cfg(bpf_target_arch = "x86_64")]
    // SAFETY: ctx.regs is the probe's pt_regs, readable by the program.
    unsafe {
        let regs = &*ctx.regs;
        (regs.rip, regs.rbp, regs.rsp)
    }
    #[cfg(bpf_target_arch = "aarch64")]
    // SAFETY: the kernel's arm64 pt_regs begins with user_pt_regs.
    unsafe {
        let regs = &*(ctx.regs as *const aya_ebpf::bindings::user_pt_regs);
        (regs.pc, regs.regs[29], regs.sp)
    }
    #[cfg(not(any(bpf_target_arch = "x86_64", bpf_target_arch = "aarch64")))]
    {
        let _ = ctx;
        (0, 0, 0)
    }
}

/// Register `n` of those an entry program can read a value from
/// ([`heapprof_common::VALUE_REGISTERS`]: x86-64's general-purpose registers in DWARF
/// order; arm64's x0 to x7 and x19 to x26), 0 for [`heapprof_common::NO_REGISTER`] or
/// any other number.
///
/// One constant-offset read of the context per register, which is all the verifier
/// accepts there, chosen by comparisons in the order functions use them (the argument
/// registers first): an entry reads two or three registers, where a copy of all
/// sixteen to index cost a few ns per call.
#[inline(always)]
pub fn value_register(ctx: &ProbeContext, n: u8) -> u64 {
    #[cfg(bpf_target_arch = "x86_64")]
    // SAFETY: ctx.regs is the probe's pt_regs, readable by the program.
    unsafe {
        let r = &*ctx.regs;
        match n {
            5 => r.rdi,
            4 => r.rsi,
            1 => r.rdx,
            2 => r.rcx,
            8 => r.r8,
            9 => r.r9,
            0 => r.rax,
            3 => r.rbx,
            6 => r.rbp,
            7 => r.rsp,
            10 => r.r10,
            11 => r.r11,
            12 => r.r12,
            13 => r.r13,
            14 => r.r14,
            15 => r.r15,
            _ => 0,
        }
    }
    #[cfg(bpf_target_arch = "aarch64")]
    // SAFETY: the kernel's arm64 pt_regs begins with user_pt_regs.
    unsafe {
        let r = &*(ctx.regs as *const aya_ebpf::bindings::user_pt_regs);
        // Each arm a constant index: the verifier refuses a variable offset into the
        // context.
        match n {
            0 => r.regs[0],
            1 => r.regs[1],
            2 => r.regs[2],
            3 => r.regs[3],
            4 => r.regs[4],
            5 => r.regs[5],
            6 => r.regs[6],
            7 => r.regs[7],
            8 => r.regs[19],
            9 => r.regs[20],
            10 => r.regs[21],
            11 => r.regs[22],
            12 => r.regs[23],
            13 => r.regs[24],
            14 => r.regs[25],
            15 => r.regs[26],
            _ => 0,
        }
    }
    #[cfg(not(any(bpf_target_arch = "x86_64", bpf_target_arch = "aarch64")))]
    {
        let _ = (ctx, n);
        0
    }
}

/// The seven values a call of the preload library's probe site passes (see
/// `heapprof_common::preload`): x86-64's rdi, rsi, rdx, rcx, r8, r9 and rax; arm64's
/// x0 to x6.
#[inline(always)]
pub fn preload_args(ctx: &ProbeContext) -> [u64; 7] {
    #[cfg(bpf_target_arch = "x86_64")]
    // SAFETY: ctx.regs is the probe's pt_regs, readable by the program.
    unsafe {
        let r = &*ctx.regs;
        [r.rdi, r.rsi, r.rdx, r.rcx, r.r8, r.r9, r.rax]
    }
    #[cfg(bpf_target_arch = "aarch64")]
    // SAFETY: the kernel's arm64 pt_regs begins with user_pt_regs.
    unsafe {
        let r = &*(ctx.regs as *const aya_ebpf::bindings::user_pt_regs);
        [
            r.regs[0], r.regs[1], r.regs[2], r.regs[3], r.regs[4], r.regs[5], r.regs[6],
        ]
    }
    #[cfg(not(any(bpf_target_arch = "x86_64", bpf_target_arch = "aarch64")))]
    {
        let _ = ctx;
        [0; 7]
    }
}
