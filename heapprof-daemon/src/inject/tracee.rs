//! One thread of a running process, held with ptrace while heapprofd runs functions of
//! the process on it ("remote calls"), then given back exactly as it was.
//!
//! The thread is chosen waiting in a system call ([`super::threads`]), so it holds
//! no allocator, loader or stdio lock; the other threads keep running. While it is
//! held every signal is blocked for it (a signal for the process goes to another
//! thread, and one sent to it stays pending until it is given back). A remote call
//! starts the function with a return address of 0: its return is a fault at address
//! 0, which ptrace reports before any handler runs, and which is then dropped.
//! Giving the thread back restores its registers and signal mask, so an interrupted
//! system call restarts as if nothing had happened.

use std::{
    fs::File,
    io,
    os::unix::fs::FileExt as _,
    time::{Duration, Instant},
};

use thiserror::Error;

use super::regs::Registers;

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

/// Bytes below the thread's stack pointer left alone: the x86-64 red zone, and more.
const RED_ZONE: u64 = 256;
/// Scratch memory for strings and results, below the red zone.
pub const SCRATCH_BYTES: u64 = 4096;

/// A thread held with ptrace; given back when dropped.
pub struct Tracee {
    pid: i32,
    tid: i32,
    saved: Registers,
    saved_mask: u64,
    /// The interrupted system call's first argument (arm64 restarts it with it).
    first_argument: Option<u64>,
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
            saved: Registers::empty(),
            saved_mask: 0,
            first_argument: None,
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
        let all = !0u64;
        // SAFETY: PTRACE_SETSIGMASK reads 8 bytes from `all`.
        if unsafe {
            libc::ptrace(
                libc::PTRACE_SETSIGMASK,
                tid,
                std::mem::size_of::<u64>(),
                &raw const all,
            )
        } != 0
        {
            return Err(ptrace_error("SETSIGMASK", tid));
        }
        Ok(tracee)
    }

    /// The system call the thread was stopped in (or had just returned from), with
    /// its second argument.
    pub fn syscall(&self) -> Option<(i64, u64)> {
        self.saved.syscall()
    }

    /// The first argument of the system call the thread was interrupted in, as `/proc`
    /// showed it before the thread was held: arm64 restarts the call with it.
    pub fn set_first_argument(&mut self, value: u64) {
        self.first_argument = Some(value);
    }

    fn registers(&self) -> Result<Registers, TraceError> {
        Registers::read(self.tid).map_err(|(request, source)| TraceError::Ptrace {
            request,
            tid: self.tid,
            source,
        })
    }

    fn set_registers(&self, regs: &Registers) -> Result<(), TraceError> {
        regs.write(self.tid)
            .map_err(|(request, source)| TraceError::Ptrace {
                request,
                tid: self.tid,
                source,
            })
    }

    /// The scratch memory's first address: below the thread's stack pointer and red
    /// zone, untouched by the thread while it is held.
    pub fn scratch(&self) -> u64 {
        (self.saved.stack_pointer() - RED_ZONE - SCRATCH_BYTES) & !0xf
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

    /// Calls `function(args...)` on the thread and returns what it returned.
    pub fn call(
        &mut self,
        function: u64,
        args: &[u64],
        timeout: Duration,
    ) -> Result<u64, TraceError> {
        // The call's stack: below the scratch memory, 16-byte aligned at the call.
        let sp = (self.scratch() - 64) & !0xf;
        let (regs, return_slot) = self.saved.call(function, args, sp);
        if let Some(slot) = return_slot {
            self.write(slot, &0u64.to_le_bytes())?;
        }
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
                    if now.pc() == 0 {
                        return Ok(now.result());
                    }
                    return Err(TraceError::Faulted {
                        function,
                        signal: libc::SIGSEGV,
                        at: now.pc(),
                    });
                }
                Stop::Signal(
                    signal @ (libc::SIGBUS | libc::SIGILL | libc::SIGFPE | libc::SIGABRT),
                ) => {
                    let now = self.registers()?;
                    return Err(TraceError::Faulted {
                        function,
                        signal,
                        at: now.pc(),
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
        let restored = self.set_registers(&self.saved.to_give_back(self.first_argument));
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
