//! A held thread's registers, per architecture: reading and writing them with ptrace,
//! setting up a remote call, and giving an interrupted system call back.
//!
//! x86-64: `PTRACE_GETREGS`; the system call number is `orig_rax`, which the kernel
//! also uses to restart an interrupted call when the registers are put back.
//! arm64: the `NT_PRSTATUS` and `NT_ARM_SYSTEM_CALL` register sets. The kernel
//! restarts a call with the first argument it saved at entry (`orig_x0`), which the
//! remote calls' own system calls overwrite and ptrace cannot set: heapprofd restarts
//! the call itself instead (the `svc` again, its first argument as `/proc` showed it).

use std::io;

/// The kernel's errors for a system call a signal interrupted, to be restarted
/// (ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK).
#[cfg(target_arch = "aarch64")]
const RESTART_ERRORS: [i64; 4] = [-512, -513, -514, -516];
#[cfg(target_arch = "aarch64")]
const RESTART_BLOCK: i64 = -516;

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
        if unsafe { libc::ptrace(libc::PTRACE_GETREGS, tid, 0, &raw mut regs) } != 0 {
            return Err(request_error("GETREGS"));
        }
        Ok(Self { regs })
    }

    /// Writes them back.
    pub fn write(&self, tid: i32) -> Result<(), (&'static str, io::Error)> {
        // SAFETY: PTRACE_SETREGS reads one user_regs_struct.
        if unsafe { libc::ptrace(libc::PTRACE_SETREGS, tid, 0, &raw const self.regs) } != 0 {
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

    /// Registers that call `function(args)` with the stack at `sp` (16-byte aligned)
    /// and return to address 0; and where the return address must be written.
    pub fn call(&self, function: u64, args: &[u64], sp: u64) -> (Self, Option<u64>) {
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
    pub fn to_give_back(&self, _first_argument: Option<u64>) -> Self {
        *self
    }
}

#[cfg(target_arch = "aarch64")]
const NT_PRSTATUS: libc::c_int = 1;
#[cfg(target_arch = "aarch64")]
const NT_ARM_SYSTEM_CALL: libc::c_int = 0x404;
#[cfg(target_arch = "aarch64")]
const NR_RESTART_SYSCALL: u64 = 128;

#[cfg(target_arch = "aarch64")]
fn regset<T>(
    request: libc::c_uint,
    tid: i32,
    kind: libc::c_int,
    value: *mut T,
) -> Result<(), (&'static str, io::Error)> {
    let mut io = libc::iovec {
        iov_base: value.cast(),
        iov_len: std::mem::size_of::<T>(),
    };
    // SAFETY: the iovec points at one T, the size the kernel fills or reads.
    if unsafe { libc::ptrace(request, tid, kind as libc::c_long, &raw mut io) } != 0 {
        return Err(request_error(if request == libc::PTRACE_GETREGSET {
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
        regset(libc::PTRACE_GETREGSET, tid, NT_PRSTATUS, &raw mut regs)?;
        let mut syscall: i32 = -1;
        regset(
            libc::PTRACE_GETREGSET,
            tid,
            NT_ARM_SYSTEM_CALL,
            &raw mut syscall,
        )?;
        Ok(Self { regs, syscall })
    }

    /// Writes them back.
    pub fn write(&self, tid: i32) -> Result<(), (&'static str, io::Error)> {
        let mut regs = self.regs;
        regset(libc::PTRACE_SETREGSET, tid, NT_PRSTATUS, &raw mut regs)?;
        let mut syscall = self.syscall;
        regset(
            libc::PTRACE_SETREGSET,
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

    /// The system call the thread was stopped in (or had just returned from), with
    /// its second argument (the first is the result by now).
    pub fn syscall(&self) -> Option<(i64, u64)> {
        let result = self.regs.regs[0] as i64;
        (self.syscall >= 0 && result >= -4095)
            .then_some((i64::from(self.syscall), self.regs.regs[1]))
    }

    /// Registers that call `function(args)` with the stack at `sp` (16-byte aligned)
    /// and return to address 0 (the link register).
    pub fn call(&self, function: u64, args: &[u64], sp: u64) -> (Self, Option<u64>) {
        let mut regs = self.regs;
        regs.sp = sp;
        regs.pc = function;
        for (slot, value) in regs.regs.iter_mut().zip(args) {
            *slot = *value;
        }
        regs.regs[30] = 0;
        (
            Self {
                regs,
                // Not in a system call any more: nothing to restart on the way out.
                syscall: -1,
            },
            None,
        )
    }

    /// What to put back. A call the kernel would restart is restarted here: the
    /// `svc` again (x8 still holds its number) with `first_argument` in x0, or the
    /// kernel's restart_syscall for a call with a restart block.
    pub fn to_give_back(&self, first_argument: Option<u64>) -> Self {
        let result = self.regs.regs[0] as i64;
        if self.syscall < 0 || !RESTART_ERRORS.contains(&result) {
            return *self;
        }
        let mut regs = self.regs;
        regs.pc -= 4;
        if result == RESTART_BLOCK {
            regs.regs[8] = NR_RESTART_SYSCALL;
        } else if let Some(first) = first_argument {
            regs.regs[0] = first;
        } else {
            return *self;
        }
        Self { regs, syscall: -1 }
    }
}
