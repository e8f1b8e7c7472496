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

#![allow(
    clippy::unnecessary_cast,
    reason = "ptrace requests are c_uint on glibc, c_int (or either) on musl"
)]

use std::{
    fs::File,
    io,
    os::unix::fs::FileExt as _,
    time::{Duration, Instant},
};

use thiserror::Error;

use super::regs::{Registers, ptrace};

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

/// The signal mask while the thread is held: every signal but those of a fault. The
/// kernel delivers a fault's signal even when it is blocked, but then resets the
/// process's handler of it to the default first (`force_sig_info_to_task`), and a
/// call's return to address 0 *is* a fault: a JVM lost the SIGSEGV handler its
/// safepoints need and died (found by the injection stress test). Unblocked, the
/// signal still stops the thread for ptrace before any handler runs, and is dropped
/// there.
const HELD_MASK: u64 = !((1u64 << (libc::SIGSEGV - 1))
    | (1u64 << (libc::SIGBUS - 1))
    | (1u64 << (libc::SIGILL - 1))
    | (1u64 << (libc::SIGFPE - 1))
    | (1u64 << (libc::SIGTRAP - 1)));

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
    /// The return stub's page (see [`super::regs::stub`]), and the process's munmap
    /// that removes it, if heapprofd mapped it (0: the library's page).
    stub: Option<u64>,
    munmap: u64,
    /// Stopped at the stub's marker: a system-call stop.
    at_syscall_stop: bool,
    /// The descriptors the stub closes if heapprofd dies.
    guards: super::regs::Guards,
    /// arm64: the floating-point and SIMD registers when the thread was held (the
    /// stub's frame restores them; so does giving the thread back).
    #[cfg(target_arch = "aarch64")]
    saved_fpsimd: Option<super::regs::Fpsimd>,
}

fn ptrace_error(request: &'static str, tid: i32) -> TraceError {
    TraceError::Ptrace {
        request,
        tid,
        source: io::Error::last_os_error(),
    }
}

/// The test of heapprofd killed in the middle of a remote call
/// (`tests/inject.rs`): with `HEAPPROFD_TEST_KILL_IN_REMOTE_CALL=N` heapprofd
/// SIGKILLs itself once its Nth remote call is running, leaving the thread to
/// finish it alone.
fn die_here_if_tested() {
    static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let Some(wanted) = std::env::var_os("HEAPPROFD_TEST_KILL_IN_REMOTE_CALL")
        .and_then(|v| v.to_str().and_then(|v| v.parse::<u32>().ok()))
    else {
        return;
    };
    if CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1 == wanted {
        // SAFETY: kill(2) of this process.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

/// What stopped a held thread.
enum Stop {
    /// The stop PTRACE_INTERRUPT asked for (or another ptrace event stop).
    Event,
    /// A system call's entry or exit (PTRACE_SYSCALL).
    Syscall,
    /// A signal is about to be delivered.
    Signal(i32),
}

/// Waits for `tid` to stop, at most until `deadline`.
fn wait_stop(tid: i32, deadline: Instant, function: u64) -> Result<Stop, TraceError> {
    // Spun on at first: a thread stopped at a call's return to address 0 crashes if
    // heapprofd dies before it takes it back, so that moment is kept short.
    let mut spins = 0u32;
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
            if spins < 20_000 {
                spins += 1;
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
            continue;
        }
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            return Err(TraceError::Gone(tid));
        }
        if libc::WIFSTOPPED(status) {
            if status >> 16 != 0 {
                return Ok(Stop::Event);
            }
            if libc::WSTOPSIG(status) == libc::SIGTRAP | 0x80 {
                return Ok(Stop::Syscall);
            }
            return Ok(Stop::Signal(libc::WSTOPSIG(status)));
        }
    }
}

/// The signal mask of the stopped thread `tid`.
fn signal_mask(tid: i32) -> Result<u64, TraceError> {
    let mut mask = 0u64;
    // SAFETY: PTRACE_GETSIGMASK writes 8 bytes to `mask`.
    if unsafe {
        ptrace(
            libc::PTRACE_GETSIGMASK as u32,
            tid,
            std::mem::size_of::<u64>(),
            &raw mut mask as usize,
        )
    } != 0
    {
        return Err(ptrace_error("GETSIGMASK", tid));
    }
    Ok(mask)
}

/// Sets the signal mask of the stopped thread `tid`.
fn set_signal_mask(tid: i32, mask: u64) -> Result<(), TraceError> {
    // SAFETY: PTRACE_SETSIGMASK reads 8 bytes from `mask`.
    if unsafe {
        ptrace(
            libc::PTRACE_SETSIGMASK as u32,
            tid,
            std::mem::size_of::<u64>(),
            &raw const mask as usize,
        )
    } != 0
    {
        return Err(ptrace_error("SETSIGMASK", tid));
    }
    Ok(())
}

impl Tracee {
    /// Seizes thread `tid` of process `pid` and stops it. The caller checks with
    /// [`Tracee::syscall`] whether it stopped at a safe point.
    pub fn seize(pid: u32, tid: i32) -> Result<Self, TraceError> {
        // System-call stops are told apart from signals (the return stub's marker).
        let options = libc::PTRACE_O_TRACESYSGOOD as libc::c_long;
        // SAFETY: plain ptrace requests on a thread id; failures are returned.
        if unsafe { ptrace(libc::PTRACE_SEIZE as u32, tid, 0, options as usize) } != 0 {
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
            stub: None,
            munmap: 0,
            at_syscall_stop: false,
            guards: super::regs::Guards::NONE,
            #[cfg(target_arch = "aarch64")]
            saved_fpsimd: None,
        };
        tracee.interrupt()?;
        tracee.saved = tracee.registers()?;
        // Without it there is no stub (its frame needs it), only calls returning to 0.
        #[cfg(target_arch = "aarch64")]
        match super::regs::read_fpsimd(tid) {
            Ok(state) => tracee.saved_fpsimd = Some(state),
            Err((request, err)) => log::debug!("thread {tid}: {request} NT_PRFPREG: {err}"),
        }
        tracee.saved_mask = signal_mask(tid)?;
        set_signal_mask(tid, HELD_MASK)?;
        Ok(tracee)
    }

    /// Stops the seized thread (PTRACE_INTERRUPT) and waits, at most 2 seconds, for
    /// that stop; the system calls it passes on the way are let run, the signals that
    /// arrive first are kept for when it is given back.
    fn interrupt(&mut self) -> Result<(), TraceError> {
        let tid = self.tid;
        // SAFETY: plain ptrace requests on a thread id; failures are returned.
        if unsafe { ptrace(libc::PTRACE_INTERRUPT as u32, tid, 0, 0) } != 0 {
            return Err(ptrace_error("INTERRUPT", tid));
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match wait_stop(tid, deadline, 0)? {
                Stop::Event => return Ok(()),
                Stop::Syscall => {
                    // SAFETY: as above.
                    unsafe { ptrace(libc::PTRACE_CONT as u32, tid, 0, 0) };
                }
                // A signal arrived first: kept for later, the interrupt still comes.
                Stop::Signal(signal) => {
                    self.pending.push(signal);
                    // SAFETY: as above.
                    unsafe { ptrace(libc::PTRACE_CONT as u32, tid, 0, 0) };
                }
            }
        }
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

    /// The thread's stack pointer where it was seized.
    pub fn stack_pointer(&self) -> u64 {
        self.saved.stack_pointer()
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
        let stub = self.stub;
        let (regs, return_slot) = self.saved.call(function, args, sp, stub.unwrap_or(0));
        if let Some(slot) = return_slot {
            self.write(slot, &stub.unwrap_or(0).to_le_bytes())?;
        }
        self.set_registers(&regs)?;
        self.at_syscall_stop = false;
        // Through the stub, its marker is a system call: stop at those.
        let resume = if stub.is_some() {
            libc::PTRACE_SYSCALL as u32
        } else {
            libc::PTRACE_CONT as u32
        };
        let deadline = Instant::now() + timeout;
        // SAFETY: plain ptrace request.
        if unsafe { ptrace(resume, self.tid, 0, 0) } != 0 {
            return Err(ptrace_error("CONT", self.tid));
        }
        die_here_if_tested();
        loop {
            let stop = wait_stop(self.tid, deadline, function).map_err(|err| match err {
                TraceError::TimedOut(function, _) => TraceError::TimedOut(function, timeout),
                other => other,
            })?;
            match stop {
                Stop::Syscall => {
                    if let Some(stub) = stub {
                        let now = self.registers()?;
                        if let Some(result) = now.stub_result(stub) {
                            self.at_syscall_stop = true;
                            return Ok(result);
                        }
                    }
                }
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
                // Blocked signals stop a traced thread only when forced; any that
                // came is kept for the thread's return.
                Stop::Signal(signal) => self.pending.push(signal),
                Stop::Event => {}
            }
            // SAFETY: plain ptrace request.
            unsafe { ptrace(resume, self.tid, 0, 0) };
        }
    }

    /// From now on remote calls return into a stub in a page of the process (see
    /// [`super::regs::stub`]): if heapprofd dies while the thread runs one, the
    /// thread resumes where it was instead of faulting. `mmap`/`munmap`: the
    /// process's functions; the page goes when the thread is given back.
    pub fn install_stub(&mut self, mmap: u64, munmap: u64) -> Result<(), TraceError> {
        const PROT_READ_EXEC: u64 = 5;
        const MAP_PRIVATE_ANONYMOUS: u64 = 0x22;
        let bytes = super::regs::stub::BYTES;
        let page = self.call(
            mmap,
            &[0, bytes, PROT_READ_EXEC, MAP_PRIVATE_ANONYMOUS, u64::MAX, 0],
            Duration::from_secs(5),
        )?;
        if page == 0 || page as i64 == -1 || page % 4096 != 0 {
            return Err(TraceError::Memory {
                tid: self.tid,
                address: page,
                source: io::Error::other("mmap of the return stub's page failed"),
            });
        }
        self.munmap = munmap;
        self.stub = Some(page);
        let written = self.fill_stub(page);
        if written.is_err() {
            self.remove_stub();
        }
        written
    }

    /// Moves the return stub into the library's area at `area`, removing pages
    /// heapprofd mapped for it (that call returns into the new stub).
    pub fn stub_in(&mut self, area: u64) -> Result<(), TraceError> {
        self.fill_stub(area)?;
        let old = self.stub.replace(area);
        let munmap = std::mem::take(&mut self.munmap);
        let bytes = super::regs::stub::BYTES;
        if let Some(page) = old.filter(|_| munmap != 0)
            && let Err(err) = self.call(munmap, &[page, bytes], Duration::from_secs(5))
        {
            log::debug!(
                "thread {}: removing the mapped return stub: {err}",
                self.tid
            );
        }
        Ok(())
    }

    /// Writes the stub's code, the thread's context and its signal mask at `page`.
    #[cfg(target_arch = "x86_64")]
    fn fill_stub(&self, page: u64) -> Result<(), TraceError> {
        use super::regs::stub;
        let context: Vec<u8> = self
            .saved
            .stub_context()
            .iter()
            .flat_map(|word| word.to_le_bytes())
            .collect();
        self.write(page, &stub::code())
            .and_then(|()| self.write(page + stub::CONTEXT, &context))
            .and_then(|()| self.write(page + stub::MASK, &self.saved_mask.to_le_bytes()))
            .and_then(|()| self.write(page + stub::GUARDS, &self.guards.encode()))
    }

    /// Writes the stub's code, its guards and the signal frame that resumes the thread
    /// (registers, mask and floating-point state as they were when it was held) at
    /// `area`.
    #[cfg(target_arch = "aarch64")]
    fn fill_stub(&self, area: u64) -> Result<(), TraceError> {
        use super::regs::stub;
        let Some(fpsimd) = &self.saved_fpsimd else {
            return Err(TraceError::Memory {
                tid: self.tid,
                address: area,
                source: io::Error::other("no floating-point state read for the stub's frame"),
            });
        };
        let frame = self.saved.stub_frame(self.saved_mask, fpsimd);
        self.write(area + stub::FRAME, &frame)
            .and_then(|()| self.write(area + stub::GUARDS, &self.guards.encode()))
            .and_then(|()| self.write(area, &stub::code()))
    }

    /// What the stub closes now.
    pub fn guards(&self) -> super::regs::Guards {
        self.guards
    }

    /// Says which descriptors the stub closes if heapprofd dies from now on (one write:
    /// heapprofd's death leaves the old state or the new one). Without a stub, nothing.
    pub fn guard(&mut self, guards: super::regs::Guards) -> Result<(), TraceError> {
        self.guards = guards;
        if let Some(page) = self.stub {
            return self.write(page + super::regs::stub::GUARDS, &guards.encode());
        }
        Ok(())
    }

    /// Unmaps the stub's page if heapprofd mapped it (that call returns to address 0).
    fn remove_stub(&mut self) {
        if self.munmap == 0 {
            self.stub = None;
            return;
        }
        if let Some(page) = self.stub.take() {
            let munmap = self.munmap;
            let bytes = super::regs::stub::BYTES;
            if let Err(err) = self.call(munmap, &[page, bytes], Duration::from_secs(5)) {
                log::debug!("thread {}: removing the return stub: {err}", self.tid);
            }
        }
    }

    fn give_back(&mut self) -> Result<(), TraceError> {
        if self.released {
            return Ok(());
        }
        self.remove_stub();
        self.released = true;
        let registers = if self.at_syscall_stop {
            self.saved.resumed()
        } else {
            self.saved.given_back(self.first_argument)
        };
        let restored = self.set_registers(&registers);
        #[cfg(target_arch = "aarch64")]
        if let Some(state) = &self.saved_fpsimd
            && let Err((request, err)) = super::regs::write_fpsimd(self.tid, state)
        {
            log::debug!("thread {}: {request} NT_PRFPREG: {err}", self.tid);
        }
        let mask = self.saved_mask;
        // SAFETY: PTRACE_SETSIGMASK reads 8 bytes from `mask`.
        unsafe {
            ptrace(
                libc::PTRACE_SETSIGMASK as u32,
                self.tid,
                std::mem::size_of::<u64>(),
                &raw const mask as usize,
            )
        };
        let first = self.pending.first().copied().unwrap_or(0);
        // SAFETY: plain ptrace request; the first pending signal is delivered with it.
        let detached = unsafe { ptrace(libc::PTRACE_DETACH as u32, self.tid, 0, first as usize) };
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
