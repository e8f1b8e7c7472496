//! One thread of a running process, held with ptrace while heapprofd runs functions of
//! the process on it ("remote calls"), then given back exactly as it was.
//!
//! The thread is chosen waiting in a system call ([`super::threads`]), so it holds
//! no allocator, loader or stdio lock; the other threads keep running. While it runs
//! a function for heapprofd every signal but a fault's is blocked for it (a signal
//! for the process goes to another thread, and one sent to it stays pending until it
//! is given back; see [`CALL_MASK`] for the faults'). A
//! remote call starts the function with a return address of 0: its return is a fault
//! at address 0, which ptrace reports before any handler runs, and which is then
//! dropped. Between calls, and when it is given back, the thread has its own
//! registers and signal mask again, so an interrupted system call restarts as if
//! nothing had happened, also when heapprofd is killed while it holds the thread.

use std::{
    fs::File,
    io,
    os::unix::fs::FileExt as _,
    time::{Duration, Instant},
};

use thiserror::Error;

/// Why a remote call or holding a thread failed.
#[derive(Debug, Error)]
pub enum TraceError {
    /// A ptrace request failed.
    #[error("ptrace {request} on thread {tid}: {source}")]
    Ptrace {
        /// The request's name.
        request: &'static str,
        /// The thread.
        tid: i32,
        /// The kernel's answer.
        source: io::Error,
    },
    /// The thread (or its process) ended while held.
    #[error("thread {0} ended while heapprofd held it")]
    Gone(i32),
    /// The function faulted somewhere other than its return.
    #[error("the function at {function:#x} stopped with signal {signal} at {at:#x}")]
    Faulted {
        /// The function called.
        function: u64,
        /// The signal.
        signal: i32,
        /// Where.
        at: u64,
    },
    /// The function did not return in time.
    #[error("the function at {0:#x} did not return within {1:?}")]
    TimedOut(u64, Duration),
    /// Reading or writing the process's memory failed.
    #[error("accessing the memory of thread {tid} at {address:#x}: {source}")]
    Memory {
        /// The thread.
        tid: i32,
        /// Where.
        address: u64,
        /// Why.
        source: io::Error,
    },
}

/// The architecture's registers, as ptrace reads and writes them.
#[cfg(target_arch = "x86_64")]
type Registers = libc::user_regs_struct;

/// Bytes below the thread's stack pointer left alone: the x86-64 red zone, and more.
const RED_ZONE: u64 = 256;
/// Scratch memory for strings and results, below the red zone.
pub const SCRATCH_BYTES: u64 = 4096;

/// The signal mask while the thread runs a function for heapprofd: every signal but
/// those of a fault. The kernel delivers a fault's signal even when it is blocked,
/// but then resets the process's handler of it to the default first (for every
/// thread: `force_sig_info_to_task`), and a remote call's return *is* a fault. With
/// SIGSEGV blocked at its return, a JVM lost the SIGSEGV handler its safepoints
/// need and died at its next one, and redis its crash report's handler.
/// Unblocked, the signal still stops the thread for ptrace before any handler runs,
/// and is dropped there.
const CALL_MASK: u64 = !((1u64 << (libc::SIGSEGV - 1))
    | (1u64 << (libc::SIGBUS - 1))
    | (1u64 << (libc::SIGILL - 1))
    | (1u64 << (libc::SIGFPE - 1))
    | (1u64 << (libc::SIGTRAP - 1)));

/// Errors of the kernel for a system call a signal interrupted, to be restarted.
const RESTART_ERRORS: [i64; 5] = [-512, -513, -514, -516, -4];

/// A thread held with ptrace; given back when dropped.
pub struct Tracee {
    pid: i32,
    tid: i32,
    saved: Registers,
    saved_mask: u64,
    memory: File,
    /// Signals that arrived for the thread while it was held, given back with it.
    pending: Vec<i32>,
    released: bool,
}

fn ptrace_error(request: &'static str, tid: i32) -> TraceError {
    TraceError::Ptrace {
        request,
        tid,
        source: io::Error::last_os_error(),
    }
}

/// What stopped a held thread.
enum Stop {
    /// The stop PTRACE_INTERRUPT asked for (or another ptrace event stop).
    Event,
    /// A signal is about to be delivered.
    Signal(i32),
}

/// Waits for `tid` to stop, at most until `deadline`.
fn wait_stop(tid: i32, deadline: Instant, function: u64) -> Result<Stop, TraceError> {
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid out pointer.
        let got = unsafe { libc::waitpid(tid, &mut status, libc::__WALL | libc::WNOHANG) };
        if got < 0 {
            return Err(TraceError::Gone(tid));
        }
        if got == 0 {
            if Instant::now() >= deadline {
                return Err(TraceError::TimedOut(function, Duration::ZERO));
            }
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            return Err(TraceError::Gone(tid));
        }
        if libc::WIFSTOPPED(status) {
            if status >> 16 != 0 {
                return Ok(Stop::Event);
            }
            return Ok(Stop::Signal(libc::WSTOPSIG(status)));
        }
    }
}

impl Tracee {
    /// Seizes thread `tid` of process `pid` and stops it. The caller checks with
    /// [`Tracee::syscall`] whether it stopped at a safe point.
    pub fn seize(pid: u32, tid: i32) -> Result<Self, TraceError> {
        // SAFETY: plain ptrace requests on a thread id; failures are returned.
        if unsafe { libc::ptrace(libc::PTRACE_SEIZE, tid, 0, 0) } != 0 {
            return Err(ptrace_error("SEIZE", tid));
        }
        let mut tracee = Self {
            pid: pid as i32,
            tid,
            // SAFETY: a plain-integer C struct, all zeros is a valid value.
            saved: unsafe { std::mem::zeroed() },
            saved_mask: 0,
            memory: File::options()
                .read(true)
                .write(true)
                .open(format!("/proc/{pid}/task/{tid}/mem"))
                .map_err(|source| TraceError::Memory {
                    tid,
                    address: 0,
                    source,
                })?,
            pending: Vec::new(),
            released: false,
        };
        // SAFETY: as above.
        if unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0) } != 0 {
            return Err(ptrace_error("INTERRUPT", tid));
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match wait_stop(tid, deadline, 0)? {
                Stop::Event => break,
                // A signal arrived first: kept for later, the interrupt still comes.
                Stop::Signal(signal) => {
                    tracee.pending.push(signal);
                    // SAFETY: as above.
                    unsafe { libc::ptrace(libc::PTRACE_CONT, tid, 0, 0) };
                }
            }
        }
        tracee.saved = tracee.registers()?;
        let mut mask = 0u64;
        // SAFETY: PTRACE_GETSIGMASK writes 8 bytes to `mask`.
        if unsafe {
            libc::ptrace(
                libc::PTRACE_GETSIGMASK,
                tid,
                std::mem::size_of::<u64>(),
                &raw mut mask,
            )
        } != 0
        {
            return Err(ptrace_error("GETSIGMASK", tid));
        }
        tracee.saved_mask = mask;
        Ok(tracee)
    }

    /// The system call the thread was stopped in, with its first two arguments, if it
    /// was interrupted in one (or had just returned from one).
    pub fn syscall(&self) -> Option<(i64, [u64; 2])> {
        let regs = &self.saved;
        let number = regs.orig_rax as i64;
        let result = regs.rax as i64;
        (number >= 0 && (RESTART_ERRORS.contains(&result) || result >= -4095))
            .then_some((number, [regs.rdi, regs.rsi]))
    }

    fn registers(&self) -> Result<Registers, TraceError> {
        // SAFETY: a plain-integer C struct, filled by the kernel.
        let mut regs: Registers = unsafe { std::mem::zeroed() };
        // SAFETY: PTRACE_GETREGS writes one user_regs_struct.
        if unsafe { libc::ptrace(libc::PTRACE_GETREGS, self.tid, 0, &raw mut regs) } != 0 {
            return Err(ptrace_error("GETREGS", self.tid));
        }
        Ok(regs)
    }

    fn set_registers(&self, regs: &Registers) -> Result<(), TraceError> {
        // SAFETY: PTRACE_SETREGS reads one user_regs_struct.
        if unsafe { libc::ptrace(libc::PTRACE_SETREGS, self.tid, 0, std::ptr::from_ref(regs)) } != 0
        {
            return Err(ptrace_error("SETREGS", self.tid));
        }
        Ok(())
    }

    /// The thread's stack pointer where it was seized.
    pub fn stack_pointer(&self) -> u64 {
        self.saved.rsp
    }

    /// The scratch memory's first address: below the thread's stack pointer and red
    /// zone, untouched by the thread while it is held.
    pub fn scratch(&self) -> u64 {
        (self.saved.rsp - RED_ZONE - SCRATCH_BYTES) & !0xf
    }

    /// Writes `bytes` at `address` of the process.
    pub fn write(&self, address: u64, bytes: &[u8]) -> Result<(), TraceError> {
        self.memory
            .write_all_at(bytes, address)
            .map_err(|source| TraceError::Memory {
                tid: self.tid,
                address,
                source,
            })
    }

    /// Reads `buffer.len()` bytes at `address` of the process.
    pub fn read(&self, address: u64, buffer: &mut [u8]) -> Result<(), TraceError> {
        self.memory
            .read_exact_at(buffer, address)
            .map_err(|source| TraceError::Memory {
                tid: self.tid,
                address,
                source,
            })
    }

    /// Calls `function(args...)` on the thread and returns what it returned; between
    /// calls the thread is parked as it was (see [`Tracee::park`]).
    pub fn call(
        &mut self,
        function: u64,
        args: &[u64],
        timeout: Duration,
    ) -> Result<u64, TraceError> {
        let result = self.run(function, args, timeout);
        match result {
            // The thread is stopped at the function's return or fault: parked again.
            Ok(_) | Err(TraceError::Faulted { .. }) => self.park().and(result),
            // It runs the function still, or it is gone.
            Err(_) => result,
        }
    }

    /// Puts the thread back in the state it was seized in, registers and signal mask,
    /// stopped in a ptrace event stop instead of the stop at the function's return.
    ///
    /// heapprofd may die at any moment (SIGKILL), and the kernel then lets its held
    /// thread go from the stop it is in. From the return's stop that would deliver its
    /// SIGSEGV (the stop's signal) and resume at address 0, with every signal blocked:
    /// the process dies. From this stop the thread resumes its system call as if
    /// nothing had happened. PTRACE_INTERRUPT before PTRACE_CONT: the kernel traps the
    /// thread into the event stop before it returns to user space, so it runs none of
    /// its code and drops the return's signal.
    fn park(&mut self) -> Result<(), TraceError> {
        self.set_registers(&self.saved)?;
        self.set_mask(self.saved_mask)?;
        // SAFETY: plain ptrace requests.
        if unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, self.tid, 0, 0) } != 0 {
            return Err(ptrace_error("INTERRUPT", self.tid));
        }
        // SAFETY: as above.
        if unsafe { libc::ptrace(libc::PTRACE_CONT, self.tid, 0, 0) } != 0 {
            return Err(ptrace_error("CONT", self.tid));
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match wait_stop(self.tid, deadline, 0)? {
                Stop::Event => return Ok(()),
                Stop::Signal(signal) => {
                    self.pending.push(signal);
                    // SAFETY: as above.
                    unsafe { libc::ptrace(libc::PTRACE_CONT, self.tid, 0, 0) };
                }
            }
        }
    }

    fn set_mask(&self, mask: u64) -> Result<(), TraceError> {
        // SAFETY: PTRACE_SETSIGMASK reads 8 bytes from `mask`.
        if unsafe {
            libc::ptrace(
                libc::PTRACE_SETSIGMASK,
                self.tid,
                std::mem::size_of::<u64>(),
                &raw const mask,
            )
        } != 0
        {
            return Err(ptrace_error("SETSIGMASK", self.tid));
        }
        Ok(())
    }

    fn run(&mut self, function: u64, args: &[u64], timeout: Duration) -> Result<u64, TraceError> {
        let mut regs = self.saved;
        // The call's stack: below the scratch memory, 16-byte aligned at the call.
        let mut sp = (self.scratch() - 64) & !0xf;
        sp -= 8;
        self.write(sp, &0u64.to_le_bytes())?;
        regs.rsp = sp;
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
        self.set_mask(CALL_MASK)?;
        self.set_registers(&regs)?;
        let deadline = Instant::now() + timeout;
        // SAFETY: plain ptrace request.
        if unsafe { libc::ptrace(libc::PTRACE_CONT, self.tid, 0, 0) } != 0 {
            return Err(ptrace_error("CONT", self.tid));
        }
        loop {
            let stop = wait_stop(self.tid, deadline, function).map_err(|err| match err {
                TraceError::TimedOut(function, _) => TraceError::TimedOut(function, timeout),
                other => other,
            })?;
            match stop {
                Stop::Signal(libc::SIGSEGV) => {
                    let now = self.registers()?;
                    if now.rip == 0 {
                        return Ok(now.rax);
                    }
                    return Err(TraceError::Faulted {
                        function,
                        signal: libc::SIGSEGV,
                        at: now.rip,
                    });
                }
                Stop::Signal(
                    signal @ (libc::SIGBUS | libc::SIGILL | libc::SIGFPE | libc::SIGABRT),
                ) => {
                    let now = self.registers()?;
                    return Err(TraceError::Faulted {
                        function,
                        signal,
                        at: now.rip,
                    });
                }
                Stop::Signal(signal) => {
                    // Blocked signals still stop a traced thread only when forced;
                    // keep any for the thread's return and go on.
                    self.pending.push(signal);
                    // SAFETY: plain ptrace request.
                    unsafe { libc::ptrace(libc::PTRACE_CONT, self.tid, 0, 0) };
                }
                Stop::Event => {
                    // SAFETY: plain ptrace request.
                    unsafe { libc::ptrace(libc::PTRACE_CONT, self.tid, 0, 0) };
                }
            }
        }
    }

    fn give_back(&mut self) -> Result<(), TraceError> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        let restored = self.set_registers(&self.saved);
        let mask = self.saved_mask;
        // SAFETY: PTRACE_SETSIGMASK reads 8 bytes from `mask`.
        unsafe {
            libc::ptrace(
                libc::PTRACE_SETSIGMASK,
                self.tid,
                std::mem::size_of::<u64>(),
                &raw const mask,
            )
        };
        let first = self.pending.first().copied().unwrap_or(0);
        // SAFETY: plain ptrace request; the first pending signal is delivered with it.
        let detached =
            unsafe { libc::ptrace(libc::PTRACE_DETACH, self.tid, 0, first as libc::c_long) };
        for signal in self.pending.iter().skip(1) {
            // SAFETY: sends a signal to the thread it was meant for.
            unsafe { libc::syscall(libc::SYS_tgkill, self.pid, self.tid, *signal) };
        }
        restored?;
        if detached != 0 {
            return Err(ptrace_error("DETACH", self.tid));
        }
        Ok(())
    }
}

impl Drop for Tracee {
    fn drop(&mut self) {
        if let Err(err) = self.give_back() {
            log::warn!("giving thread {} back: {err}", self.tid);
        }
    }
}
