//! A held thread's registers, per architecture: reading and writing them with ptrace,
//! setting up a remote call, and giving an interrupted system call back.
//!
//! x86-64: `PTRACE_GETREGS`; the system call number is `orig_rax`, which the kernel
//! also uses to restart an interrupted call when the registers are put back.
//! arm64: the `NT_PRSTATUS` and `NT_ARM_SYSTEM_CALL` register sets. The kernel
//! prepares the restart of an interrupted call before the ptrace stop (pc back on the
//! `svc`, x0 its first argument again, no system call pending), so the registers as
//! saved restart it when they are put back.

#![allow(
    clippy::unnecessary_cast,
    reason = "ptrace requests are c_uint on glibc, c_int (or either) on musl"
)]

use std::io;

/// The kernel's errors for a system call a signal interrupted, to be restarted
/// (ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK).
#[cfg(target_arch = "x86_64")]
const RESTART_ERRORS: [i64; 4] = [-512, -513, -514, -516];
#[cfg(target_arch = "x86_64")]
const RESTART_BLOCK: i64 = -516;

/// One ptrace request: `request` as the C library declares it (glibc and musl differ
/// in its type, and musl even among its constants), `addr` and `data` as words.
///
/// # Safety
/// `addr` and `data` must be what `request` expects (pointers to live buffers of
/// the right size where it reads or writes memory).
pub unsafe fn ptrace(request: u32, tid: i32, addr: usize, data: usize) -> libc::c_long {
    // SAFETY: the caller's contract; the request number is passed as the C type.
    unsafe { libc::ptrace(request as _, tid, addr, data) }
}

fn request_error(request: &'static str) -> (&'static str, io::Error) {
    (request, io::Error::last_os_error())
}

/// A thread's registers and the system call the kernel thinks it is in (-1: none).
#[derive(Clone, Copy)]
pub struct Registers {
    #[cfg(target_arch = "x86_64")]
    regs: libc::user_regs_struct,
    #[cfg(target_arch = "aarch64")]
    regs: libc::user_regs_struct,
    #[cfg(target_arch = "aarch64")]
    syscall: i32,
}

impl Registers {
    /// All zeros, until a stopped thread's are read.
    pub fn empty() -> Self {
        Self {
            // SAFETY: a plain-integer C struct, all zeros is a valid value.
            regs: unsafe { std::mem::zeroed() },
            #[cfg(target_arch = "aarch64")]
            syscall: -1,
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Registers {
    /// Reads thread `tid`'s registers (it is in a ptrace stop).
    pub fn read(tid: i32) -> Result<Self, (&'static str, io::Error)> {
        // SAFETY: a plain-integer C struct, filled by the kernel.
        let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        // SAFETY: PTRACE_GETREGS writes one user_regs_struct.
        if unsafe { ptrace(libc::PTRACE_GETREGS as u32, tid, 0, &raw mut regs as usize) } != 0 {
            return Err(request_error("GETREGS"));
        }
        Ok(Self { regs })
    }

    /// Writes them back.
    pub fn write(&self, tid: i32) -> Result<(), (&'static str, io::Error)> {
        // SAFETY: PTRACE_SETREGS reads one user_regs_struct.
        if unsafe {
            ptrace(
                libc::PTRACE_SETREGS as u32,
                tid,
                0,
                &raw const self.regs as usize,
            )
        } != 0
        {
            return Err(request_error("SETREGS"));
        }
        Ok(())
    }

    /// The stack pointer.
    pub fn stack_pointer(&self) -> u64 {
        self.regs.rsp
    }

    /// The program counter.
    pub fn pc(&self) -> u64 {
        self.regs.rip
    }

    /// The return value register.
    pub fn result(&self) -> u64 {
        self.regs.rax
    }

    /// The system call the thread was stopped in (or had just returned from), with
    /// its second argument (the first may be the result by now).
    pub fn syscall(&self) -> Option<(i64, u64)> {
        let number = self.regs.orig_rax as i64;
        let result = self.regs.rax as i64;
        (number >= 0 && result >= -4095).then_some((number, self.regs.rsi))
    }

    /// Registers that call `function(args)` with the stack at `sp` (16-byte aligned);
    /// and where the return address (`_return_to`, written there by the caller) goes.
    pub fn call(
        &self,
        function: u64,
        args: &[u64],
        sp: u64,
        _return_to: u64,
    ) -> (Self, Option<u64>) {
        let mut regs = self.regs;
        regs.rsp = sp - 8;
        regs.rip = function;
        let slots = [
            &mut regs.rdi,
            &mut regs.rsi,
            &mut regs.rdx,
            &mut regs.rcx,
            &mut regs.r8,
            &mut regs.r9,
        ];
        for (slot, value) in slots.into_iter().zip(args) {
            *slot = *value;
        }
        regs.rax = 0;
        // Not in a system call any more: the kernel must not restart one on the way out.
        regs.orig_rax = u64::MAX;
        (Self { regs }, Some(sp - 8))
    }

    /// What to put back: the registers as saved; the kernel restarts an interrupted
    /// call from `orig_rax` and the argument registers, which the saved set holds.
    pub fn given_back(&self, _first_argument: Option<u64>) -> Self {
        *self
    }
    /// The registers that resume the thread as it was, the kernel's restart of an
    /// interrupted call done by hand (the `syscall` instruction again, its number in
    /// rax), with no system call for the kernel to restart: for a thread given back
    /// from a system-call stop, and for the return stub's context.
    pub fn resumed(&self) -> Self {
        const NR_RESTART_SYSCALL: u64 = 219;
        let mut regs = self.regs;
        let result = regs.rax as i64;
        if (regs.orig_rax as i64) >= 0 && RESTART_ERRORS.contains(&result) {
            regs.rip -= 2;
            regs.rax = if result == RESTART_BLOCK {
                NR_RESTART_SYSCALL
            } else {
                regs.orig_rax
            };
        }
        regs.orig_rax = u64::MAX;
        Self { regs }
    }

    /// The result of a remote call, if these registers are the stub's marker stop.
    pub fn stub_result(&self, stub: u64) -> Option<u64> {
        const ENOSYS: i64 = -38;
        const GETPID: u64 = 39;
        (self.regs.rip == stub + stub::MARKER_END
            && self.regs.orig_rax == GETPID
            && self.regs.rax as i64 == ENOSYS)
            .then_some(self.regs.rdi)
    }

    /// The stub's context: what its code restores, in its order.
    pub fn stub_context(&self) -> [u64; stub::CONTEXT_WORDS] {
        let r = self.resumed().regs;
        [
            r.r15, r.r14, r.r13, r.r12, r.r11, r.r10, r.r9, r.r8, r.rbp, r.rdi, r.rsi, r.rdx,
            r.rcx, r.rbx, r.rax, r.eflags, r.rsp, r.rip,
        ]
    }
}

/// What the return stub closes if heapprofd dies (see [`stub::GUARDS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guards {
    /// The running call's result is a descriptor (closed if it is not negative).
    pub result_is_fd: bool,
    /// Descriptors of the process heapprofd has not closed yet.
    pub fds: [Option<i32>; 2],
    /// Where a running `socketpair` writes its pair (preset to -1, -1).
    pub pair_at: Option<u64>,
}

impl Guards {
    /// Nothing to close.
    pub const NONE: Guards = Guards {
        result_is_fd: false,
        fds: [None, None],
        pair_at: None,
    };

    /// Their bytes at the stub's `GUARDS`: the flag, the two descriptors (-1: none), a
    /// pad, the pair's address (0: none).
    pub fn encode(&self) -> [u8; 24] {
        let mut bytes = [0u8; 24];
        bytes[0..4].copy_from_slice(&u32::from(self.result_is_fd).to_le_bytes());
        for (i, fd) in self.fds.iter().enumerate() {
            let at = 4 + 4 * i;
            bytes[at..at + 4].copy_from_slice(&fd.unwrap_or(-1).to_le_bytes());
        }
        bytes[16..24].copy_from_slice(&self.pair_at.unwrap_or(0).to_le_bytes());
        bytes
    }
}

/// The return stub (x86-64): remote calls return into it instead of to address 0.
/// With heapprofd there, its first system call (`getpid`, the marker) stops the
/// thread and heapprofd takes over. If heapprofd has died meanwhile (SIGKILL), the
/// thread goes on into the rest: it restores its signal mask and every register
/// from the stub's context and resumes where it was held, instead of faulting.
#[cfg(target_arch = "x86_64")]
pub mod stub {
    /// Bytes the stub takes where heapprofd maps it: one page.
    pub const BYTES: u64 = 4096;
    /// Where the marker's stop leaves the program counter.
    pub const MARKER_END: u64 = 10;
    /// Offset of the context in the stub's page.
    pub const CONTEXT: u64 = 0x100;
    /// Words of the context.
    pub const CONTEXT_WORDS: usize = 18;
    /// Offset of the saved signal mask.
    pub const MASK: u64 = CONTEXT + CONTEXT_WORDS as u64 * 8;

    /// The descriptors the stub closes before it resumes the thread, so that
    /// heapprofd's death in the middle of its calls leaves none in the process. One
    /// write changes each state (a [`super::Guards::encode`]d whole): heapprofd's death
    /// comes between two writes, never inside one.
    pub const GUARDS: u64 = 0x1c0;

    fn rel32(target: u64, next: u64) -> [u8; 4] {
        (target.wrapping_sub(next) as u32).to_le_bytes()
    }

    /// Appends an instruction with a %rip-relative operand to `target`: `opcode`, the
    /// displacement, then `immediate` (the displacement counts from the end).
    fn rip_relative(c: &mut Vec<u8>, opcode: &[u8], target: u64, immediate: &[u8]) {
        c.extend(opcode);
        let next = (c.len() + 4 + immediate.len()) as u64;
        c.extend(rel32(target, next));
        c.extend(immediate);
    }

    /// `close(%edi)` unless %edi is negative: 11 bytes.
    const CLOSE_EDI: [u8; 11] = [
        0x85, 0xff, // test %edi,%edi
        0x78, 0x07, // js +7
        0xb8, 3, 0, 0, 0, // mov $3,%eax (close)
        0x0f, 0x05, // syscall
    ];

    /// The stub's code, to be placed at the start of its page.
    pub fn code() -> Vec<u8> {
        let mut c = Vec::with_capacity(192);
        c.extend([0x48, 0x89, 0xc7]); // mov %rax,%rdi: the result
        c.extend([0xb8, 39, 0, 0, 0]); // mov $39,%eax (getpid)
        c.extend([0x0f, 0x05]); // syscall: the marker
        // heapprofd is gone: the guarded descriptors first (every register is
        // restored below).
        rip_relative(&mut c, &[0x83, 0x3d], GUARDS, &[0]); // cmpl $0,result_is_fd
        c.extend([0x74, CLOSE_EDI.len() as u8]); // je: not a descriptor
        c.extend(CLOSE_EDI); // the result, still in %edi
        for slot in 0..2 {
            rip_relative(&mut c, &[0x8b, 0x3d], GUARDS + 4 + 4 * slot, &[]); // mov fd,%edi
            c.extend(CLOSE_EDI);
        }
        rip_relative(&mut c, &[0x48, 0x8b, 0x1d], GUARDS + 16, &[]); // mov pair_at,%rbx
        c.extend([0x48, 0x85, 0xdb]); // test %rbx,%rbx
        c.extend([0x74, (2 + CLOSE_EDI.len() + 3 + CLOSE_EDI.len()) as u8]); // je: none
        c.extend([0x8b, 0x3b]); // mov (%rbx),%edi
        c.extend(CLOSE_EDI);
        c.extend([0x8b, 0x7b, 0x04]); // mov 4(%rbx),%edi
        c.extend(CLOSE_EDI);
        c.extend([0xb8, 14, 0, 0, 0]); // mov $14,%eax (rt_sigprocmask)
        c.extend([0xbf, 2, 0, 0, 0]); // mov $2,%edi (SIG_SETMASK)
        rip_relative(&mut c, &[0x48, 0x8d, 0x35], MASK, &[]); // lea MASK(%rip),%rsi
        c.extend([0x31, 0xd2]); // xor %edx,%edx
        c.extend([0x41, 0xba, 8, 0, 0, 0]); // mov $8,%r10d
        c.extend([0x0f, 0x05]); // syscall
        rip_relative(&mut c, &[0x48, 0x8d, 0x25], CONTEXT, &[]); // lea CONTEXT(%rip),%rsp
        // pop r15..r8, rbp, rdi, rsi, rdx, rcx, rbx, rax; popfq
        c.extend([
            0x41, 0x5f, 0x41, 0x5e, 0x41, 0x5d, 0x41, 0x5c, 0x41, 0x5b, 0x41, 0x5a, 0x41, 0x59,
            0x41, 0x58, 0x5d, 0x5f, 0x5e, 0x5a, 0x59, 0x5b, 0x58, 0x9d,
        ]);
        rip_relative(&mut c, &[0x48, 0x8b, 0x25], CONTEXT + 16 * 8, &[]); // mov CONTEXT[16],%rsp
        rip_relative(&mut c, &[0xff, 0x25], CONTEXT + 17 * 8, &[]); // jmp *CONTEXT[17]
        c
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn the_stubs_offsets_are_where_its_code_says() {
            let code = super::code();
            assert!(
                code.len() <= super::CONTEXT as usize,
                "{} bytes",
                code.len()
            );
            assert_eq!(&code[8..10], &[0x0f, 0x05], "the marker ends at MARKER_END");
            // The displacements land where the data is: decode each rip-relative one.
            let target = |at: usize, end: usize| {
                let rel = i32::from_le_bytes(code[at..at + 4].try_into().expect("4 bytes"));
                (end as i64 + i64::from(rel)) as u64
            };
            assert_eq!(&code[10..12], &[0x83, 0x3d]);
            assert_eq!(target(12, 17), super::GUARDS, "cmpl $0,result_is_fd");
            let tail = code.len();
            assert_eq!(&code[tail - 6..tail - 4], &[0xff, 0x25]);
            assert_eq!(target(tail - 4, tail), super::CONTEXT + 17 * 8, "jmp *rip");
        }

        #[test]
        fn guards_encode_as_the_stub_reads_them() {
            let guards = crate::inject::regs::Guards {
                result_is_fd: true,
                fds: [Some(7), None],
                pair_at: Some(0x1122_3344_5566_7788),
            };
            let bytes = guards.encode();
            assert_eq!(&bytes[0..4], &[1, 0, 0, 0]);
            assert_eq!(&bytes[4..8], &7i32.to_le_bytes());
            assert_eq!(&bytes[8..12], &(-1i32).to_le_bytes());
            assert_eq!(&bytes[16..24], &0x1122_3344_5566_7788u64.to_le_bytes());
            assert_eq!(crate::inject::regs::Guards::NONE.encode()[4..12], [0xff; 8]);
        }
    }
}

#[cfg(target_arch = "aarch64")]
const NT_PRSTATUS: libc::c_int = 1;
#[cfg(target_arch = "aarch64")]
const NT_PRFPREG: libc::c_int = 2;
#[cfg(target_arch = "aarch64")]
const NT_ARM_SYSTEM_CALL: libc::c_int = 0x404;

#[cfg(target_arch = "aarch64")]
fn regset<T>(
    request: u32,
    tid: i32,
    kind: libc::c_int,
    value: *mut T,
) -> Result<(), (&'static str, io::Error)> {
    let mut io = libc::iovec {
        iov_base: value.cast(),
        iov_len: std::mem::size_of::<T>(),
    };
    // SAFETY: the iovec points at one T, the size the kernel fills or reads.
    if unsafe { ptrace(request, tid, kind as usize, &raw mut io as usize) } != 0 {
        return Err(request_error(if request == libc::PTRACE_GETREGSET as u32 {
            "GETREGSET"
        } else {
            "SETREGSET"
        }));
    }
    Ok(())
}

#[cfg(target_arch = "aarch64")]
impl Registers {
    /// Reads thread `tid`'s registers (it is in a ptrace stop).
    pub fn read(tid: i32) -> Result<Self, (&'static str, io::Error)> {
        // SAFETY: a plain-integer C struct, filled by the kernel.
        let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        regset(
            libc::PTRACE_GETREGSET as u32,
            tid,
            NT_PRSTATUS,
            &raw mut regs,
        )?;
        let mut syscall: i32 = -1;
        regset(
            libc::PTRACE_GETREGSET as u32,
            tid,
            NT_ARM_SYSTEM_CALL,
            &raw mut syscall,
        )?;
        Ok(Self { regs, syscall })
    }

    /// Writes them back.
    pub fn write(&self, tid: i32) -> Result<(), (&'static str, io::Error)> {
        let mut regs = self.regs;
        regset(
            libc::PTRACE_SETREGSET as u32,
            tid,
            NT_PRSTATUS,
            &raw mut regs,
        )?;
        let mut syscall = self.syscall;
        regset(
            libc::PTRACE_SETREGSET as u32,
            tid,
            NT_ARM_SYSTEM_CALL,
            &raw mut syscall,
        )
    }

    /// The stack pointer.
    pub fn stack_pointer(&self) -> u64 {
        self.regs.sp
    }

    /// The program counter.
    pub fn pc(&self) -> u64 {
        self.regs.pc
    }

    /// The return value register.
    pub fn result(&self) -> u64 {
        self.regs.regs[0]
    }

    /// The system call the thread was stopped in (its number is still in x8: the
    /// kernel has put pc back on the `svc` for the restart), with its second argument.
    pub fn syscall(&self) -> Option<(i64, u64)> {
        Some((self.regs.regs[8] as i64, self.regs.regs[1]))
    }

    /// Registers that call `function(args)` with the stack at `sp` (16-byte aligned)
    /// and return to `return_to` (the link register: the stub, or 0).
    pub fn call(
        &self,
        function: u64,
        args: &[u64],
        sp: u64,
        return_to: u64,
    ) -> (Self, Option<u64>) {
        let mut regs = self.regs;
        regs.sp = sp;
        regs.pc = function;
        for (slot, value) in regs.regs.iter_mut().zip(args) {
            *slot = *value;
        }
        regs.regs[30] = return_to;
        (
            Self {
                regs,
                // Not in a system call any more: nothing to restart on the way out.
                syscall: -1,
            },
            None,
        )
    }

    /// The registers that resume the thread as it was: the kernel prepared the
    /// restart of an interrupted call in them, and no system call is pending.
    pub fn resumed(&self) -> Self {
        Self {
            regs: self.regs,
            syscall: -1,
        }
    }

    /// The result of a remote call, if these registers are the stub's marker stop
    /// (the entry of its `getpid`, x0 still the call's result).
    pub fn stub_result(&self, stub: u64) -> Option<u64> {
        const GETPID: i32 = 172;
        (self.regs.pc == stub + stub::MARKER_END && self.syscall == GETPID)
            .then_some(self.regs.regs[0])
    }

    /// The stub's signal frame: these registers as resumed, the signal mask `mask` and
    /// the floating-point and SIMD state `fpsimd`, for `rt_sigreturn` to restore.
    pub fn stub_frame(&self, mask: u64, fpsimd: &Fpsimd) -> Vec<u8> {
        let regs = self.resumed().regs;
        let general = stub::GeneralRegisters {
            x: &regs.regs,
            sp: regs.sp,
            pc: regs.pc,
            pstate: regs.pstate,
        };
        stub::frame(&general, mask, fpsimd)
    }

    /// What to put back: the registers as saved (the restart is prepared in them).
    pub fn given_back(&self, _first_argument: Option<u64>) -> Self {
        *self
    }
}

#[cfg(target_arch = "aarch64")]
pub use aarch64_stub::Fpsimd;

/// Reads thread `tid`'s floating-point and SIMD registers (it is in a ptrace stop).
#[cfg(target_arch = "aarch64")]
pub fn read_fpsimd(tid: i32) -> Result<Fpsimd, (&'static str, io::Error)> {
    let mut state: Fpsimd = [0; stub::FPSIMD_STATE_BYTES];
    regset(
        libc::PTRACE_GETREGSET as u32,
        tid,
        NT_PRFPREG,
        &raw mut state,
    )?;
    Ok(state)
}

/// Writes them back (remote calls may have used them: string functions do).
#[cfg(target_arch = "aarch64")]
pub fn write_fpsimd(tid: i32, state: &Fpsimd) -> Result<(), (&'static str, io::Error)> {
    let mut state = *state;
    regset(
        libc::PTRACE_SETREGSET as u32,
        tid,
        NT_PRFPREG,
        &raw mut state,
    )
}

/// The return stub (arm64): remote calls return into it (the link register) instead
/// of to address 0. With heapprofd there, its first system call (`getpid`, the
/// marker) stops the thread and heapprofd takes over. If heapprofd has died meanwhile,
/// the thread goes on: it closes the guarded descriptors, then `rt_sigreturn`s from a
/// signal frame heapprofd wrote beside the code, which puts back every register, the
/// floating-point state and the signal mask, and resumes where the thread was held (no
/// register would be free to do it by hand: a jump needs one).
#[cfg(target_arch = "aarch64")]
pub use aarch64_stub as stub;

/// (Built on every architecture, so that its unit tests run on any host.)
pub mod aarch64_stub {
    #![cfg_attr(
        not(target_arch = "aarch64"),
        allow(dead_code, reason = "used on arm64; unit-tested everywhere")
    )]

    /// A thread's floating-point and SIMD registers as ptrace gives them
    /// (`NT_PRFPREG`, `struct user_fpsimd_state`): v0-v31, then fpsr and fpcr, then 8
    /// reserved bytes.
    pub type Fpsimd = [u8; FPSIMD_STATE_BYTES];

    /// Bytes the stub takes: its code, the guards and the signal frame (two pages).
    pub const BYTES: u64 = 8192;
    /// Where the marker's stop leaves the program counter.
    pub const MARKER_END: u64 = 12;
    /// The descriptors the stub closes before it resumes the thread (as on x86-64,
    /// [`super::Guards::encode`]d).
    pub const GUARDS: u64 = 0x1c0;
    /// Offset of the signal frame (`struct rt_sigframe`: a siginfo, then a ucontext),
    /// 16-byte aligned as `rt_sigreturn` requires of the stack pointer.
    pub const FRAME: u64 = 0x200;
    /// `struct user_fpsimd_state`'s size.
    pub const FPSIMD_STATE_BYTES: usize = 528;

    // The ucontext's layout (arch/arm64/include/uapi/asm/ucontext.h, sigcontext.h),
    // from the frame's start: after a 128-byte siginfo, uc_flags, uc_link, uc_stack
    // (ss_sp, ss_flags, ss_size), uc_sigmask, 120 bytes of glibc's wider sigset, then
    // the 16-byte aligned sigcontext: fault_address, x0-x30, sp, pc, pstate, and 4096
    // bytes of records.
    const UCONTEXT: usize = 128;
    const STACK_FLAGS: usize = UCONTEXT + 16 + 8;
    const SIGMASK: usize = UCONTEXT + 40;
    const SIGCONTEXT: usize = UCONTEXT + 176;
    const REGS: usize = SIGCONTEXT + 8;
    const SP: usize = SIGCONTEXT + 256;
    const PC: usize = SP + 8;
    const PSTATE: usize = PC + 8;
    const RECORDS: usize = SIGCONTEXT + 288;
    /// The frame's size, which `rt_sigreturn` checks it may read whole.
    pub const FRAME_BYTES: usize = RECORDS + 4096;
    /// The FPSIMD record, which the kernel requires: its magic and size.
    const FPSIMD_MAGIC: u32 = 0x4650_8001;
    const FPSIMD_RECORD_BYTES: usize = 16 + 512;

    /// An arm64 thread's general registers, as `NT_PRSTATUS` gives them.
    pub struct GeneralRegisters<'a> {
        /// x0-x30.
        pub x: &'a [u64; 31],
        pub sp: u64,
        pub pc: u64,
        pub pstate: u64,
    }

    /// The signal frame that resumes a thread with registers `regs`, signal mask
    /// `mask` and floating-point state `fpsimd`.
    pub fn frame(regs: &GeneralRegisters<'_>, mask: u64, fpsimd: &Fpsimd) -> Vec<u8> {
        let mut f = vec![0u8; FRAME_BYTES];
        let mut put = |at: usize, bytes: &[u8]| f[at..at + bytes.len()].copy_from_slice(bytes);
        // An invalid mode: the kernel's sigaltstack of the frame's stack fails, and the
        // thread keeps its alternate signal stack (which ptrace cannot read).
        put(STACK_FLAGS, &3u32.to_le_bytes());
        put(SIGMASK, &mask.to_le_bytes());
        for (i, value) in regs.x.iter().enumerate() {
            put(REGS + 8 * i, &value.to_le_bytes());
        }
        put(SP, &regs.sp.to_le_bytes());
        put(PC, &regs.pc.to_le_bytes());
        put(PSTATE, &regs.pstate.to_le_bytes());
        // struct fpsimd_context: magic, size, fpsr, fpcr, v0-v31; a zero header ends
        // the records.
        put(RECORDS, &FPSIMD_MAGIC.to_le_bytes());
        put(RECORDS + 4, &(FPSIMD_RECORD_BYTES as u32).to_le_bytes());
        put(RECORDS + 8, &fpsimd[512..520]);
        put(RECORDS + 16, &fpsimd[..512]);
        f
    }

    const SVC0: u32 = 0xd400_0001;
    const CLOSE: u32 = 57;
    const GETPID: u32 = 172;
    const RT_SIGRETURN: u32 = 139;

    /// A tiny assembler: instructions appended at their byte offsets.
    struct Code(Vec<u32>);

    impl Code {
        fn at(&self) -> i64 {
            self.0.len() as i64 * 4
        }
        fn push(&mut self, instruction: u32) {
            self.0.push(instruction);
        }
        /// Offset from here to `target`, in instructions, in `bits` bits.
        fn words_to(&self, target: u64, bits: u32) -> u32 {
            (((target as i64 - self.at()) >> 2) as u32) & ((1 << bits) - 1)
        }
        /// `movz xd, #imm`
        fn movz(&mut self, rd: u32, imm: u32) {
            self.push(0xd280_0000 | (imm << 5) | rd);
        }
        /// `ldr wt, target` (`x`: `ldr xt`), pc-relative.
        fn ldr_literal(&mut self, rt: u32, target: u64, x: bool) {
            let op = if x { 0x5800_0000 } else { 0x1800_0000 };
            self.push(op | (self.words_to(target, 19) << 5) | rt);
        }
        /// `cbz wt, target` (`x`: `cbz xt`).
        fn cbz(&mut self, rt: u32, target: u64, x: bool) {
            let op = if x { 0xb400_0000 } else { 0x3400_0000 };
            self.push(op | (self.words_to(target, 19) << 5) | rt);
        }
        /// `tbnz wt, #31, target`: taken when wt is negative.
        fn tbnz_negative(&mut self, rt: u32, target: u64) {
            self.push(0x3700_0000 | (31 << 19) | (self.words_to(target, 14) << 5) | rt);
        }
        /// `mov x8, #close; svc #0`: closes w0.
        fn close_w0(&mut self) {
            self.movz(8, CLOSE);
            self.push(SVC0);
        }
    }

    /// The stub's code, to be placed at the start of its area.
    pub fn code() -> Vec<u8> {
        let mut c = Code(Vec::with_capacity(32));
        c.push(0xaa00_03e9); // mov x9, x0: the result
        c.movz(8, GETPID);
        c.push(SVC0); // the marker
        // heapprofd is gone: the guarded descriptors first (the frame restores every
        // register). The branch targets are the fixed offsets of this sequence.
        c.ldr_literal(10, GUARDS, false); // result_is_fd
        c.cbz(10, 36, false);
        c.tbnz_negative(9, 36);
        c.push(0x2a09_03e0); // mov w0, w9
        c.close_w0();
        for (slot, end) in [(0u64, 52u64), (1, 68)] {
            c.ldr_literal(0, GUARDS + 4 + 4 * slot, false);
            c.tbnz_negative(0, end);
            c.close_w0();
        }
        c.ldr_literal(10, GUARDS + 16, true); // pair_at
        c.cbz(10, 108, true);
        c.push(0xb940_0140); // ldr w0, [x10]
        c.tbnz_negative(0, 92);
        c.close_w0();
        c.push(0xb940_0540); // ldr w0, [x10, #4]
        c.tbnz_negative(0, 108);
        c.close_w0();
        let here = c.at();
        let to_frame = FRAME as i64 - here;
        // adr x10, FRAME
        c.push(
            0x1000_000a
                | (((to_frame & 3) as u32) << 29)
                | ((((to_frame >> 2) as u32) & 0x7ffff) << 5),
        );
        c.push(0x9100_015f); // mov sp, x10
        c.movz(8, RT_SIGRETURN);
        c.push(SVC0);
        c.push(0); // udf: never reached
        c.0.iter().flat_map(|i| i.to_le_bytes()).collect()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// The instruction at byte `at` of `code`.
        fn word(code: &[u8], at: usize) -> u32 {
            u32::from_le_bytes(code[at..at + 4].try_into().expect("4 bytes"))
        }

        /// Where the pc-relative 19-bit immediate of the instruction at `at` points.
        fn imm19_target(code: &[u8], at: usize) -> u64 {
            let imm = (word(code, at) >> 5) & 0x7ffff;
            let signed = ((imm << 13) as i32) >> 13;
            (at as i64 + i64::from(signed) * 4) as u64
        }

        #[test]
        fn the_stubs_code_points_where_its_data_is() {
            let code = code();
            assert!(code.len() as u64 <= GUARDS, "{} bytes", code.len());
            assert_eq!(word(&code, 8), SVC0, "the marker's svc ends at MARKER_END");
            assert_eq!(MARKER_END, 12);
            assert_eq!(imm19_target(&code, 12), GUARDS, "ldr w10, result_is_fd");
            assert_eq!(imm19_target(&code, 36), GUARDS + 4, "ldr w0, fds[0]");
            assert_eq!(imm19_target(&code, 52), GUARDS + 8, "ldr w0, fds[1]");
            assert_eq!(imm19_target(&code, 68), GUARDS + 16, "ldr x10, pair_at");
            // The branches land on instruction starts inside the code.
            assert_eq!(imm19_target(&code, 16), 36, "cbz w10");
            assert_eq!(imm19_target(&code, 72), 108, "cbz x10");
            for (at, target) in [(20, 36), (40, 52), (56, 68), (80, 92), (96, 108)] {
                let imm = (word(&code, at) >> 5) & 0x3fff;
                assert_eq!(at as u32 + imm * 4, target, "tbnz at {at}");
            }
            // adr x10, FRAME; mov sp, x10; rt_sigreturn.
            let adr = word(&code, 108);
            let imm = (((adr >> 5) & 0x7ffff) << 2) | ((adr >> 29) & 3);
            assert_eq!(108 + u64::from(imm), FRAME);
            assert_eq!(word(&code, 116), 0xd280_0000 | (RT_SIGRETURN << 5) | 8);
            assert_eq!(word(&code, 120), SVC0);
            assert_eq!(FRAME % 16, 0, "rt_sigreturn requires an aligned stack");
            assert!(FRAME + FRAME_BYTES as u64 <= BYTES, "the frame fits");
        }

        #[test]
        fn the_frame_holds_what_rt_sigreturn_reads() {
            let x: [u64; 31] = std::array::from_fn(|i| 0x1000 + i as u64);
            let regs = GeneralRegisters {
                x: &x,
                sp: 0x7fff_0000,
                pc: 0x40_1234,
                pstate: 0x6000_0000,
            };
            let mut fpsimd = [0u8; FPSIMD_STATE_BYTES];
            fpsimd[0] = 0xaa; // v0's first byte
            fpsimd[512..516].copy_from_slice(&0x11u32.to_le_bytes()); // fpsr
            fpsimd[516..520].copy_from_slice(&0x22u32.to_le_bytes()); // fpcr
            let f = frame(&regs, 0x8000_0001, &fpsimd);
            let u64_at = |at: usize| u64::from_le_bytes(f[at..at + 8].try_into().expect("8"));
            let u32_at = |at: usize| u32::from_le_bytes(f[at..at + 4].try_into().expect("4"));
            assert_eq!(f.len(), 128 + 176 + 288 + 4096);
            assert_eq!(u64_at(128 + 40), 0x8000_0001, "uc_sigmask");
            assert_eq!(u32_at(128 + 24), 3, "uc_stack.ss_flags: an invalid mode");
            assert_eq!(u64_at(304 + 8), 0x1000, "x0");
            assert_eq!(u64_at(304 + 8 + 30 * 8), 0x1000 + 30, "x30");
            assert_eq!(u64_at(304 + 256), 0x7fff_0000, "sp");
            assert_eq!(u64_at(304 + 264), 0x40_1234, "pc");
            assert_eq!(u64_at(304 + 272), 0x6000_0000, "pstate");
            let records = 304 + 288;
            assert_eq!(u32_at(records), 0x4650_8001, "FPSIMD magic");
            assert_eq!(u32_at(records + 4), 528, "FPSIMD record size");
            assert_eq!((u32_at(records + 8), u32_at(records + 12)), (0x11, 0x22));
            assert_eq!(f[records + 16], 0xaa, "v0");
            assert_eq!(u64_at(records + 528), 0, "the records end");
        }
    }
}
