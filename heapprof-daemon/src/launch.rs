//! Launch mode: start a command paused, attach, then let it exec.
//!
//! The child is forked before the probes exist and waits on a socket; once the
//! probes are attached to its pid it execs (with the preload library, it is handed
//! the map of the library's answers first, at a fixed descriptor), so its first allocation (inside the
//! dynamic loader, before main) is already traced. A tracer thread seizes the
//! child with ptrace, asking only for the exit event: at that stop the process
//! still has its address space, so the daemon can read its mappings and take the
//! final counts before the kernel tears it down. Every other stop is passed on.

use std::{
    ffi::{CString, OsString},
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use heapprof_common::preload::{REPLIES_FD, SYSTEM_OPT_OUT_ENV, SYSTEM_OPT_OUT_VALUE};
use tokio::sync::{mpsc, oneshot};

/// What the tracer thread reports.
#[derive(Debug)]
pub enum ChildEvent {
    /// The child is about to exit and is held until `resume` is answered (or dropped).
    Exiting {
        /// Answer to let the child finish exiting.
        resume: oneshot::Sender<()>,
    },
    /// The child is gone; its exit status as a shell reports it (128+N for signal N).
    Exited(i32),
    /// The child completed an exec and is held until `resume` is answered (or dropped),
    /// so that a new program's allocator (a static binary's) is probed before it runs.
    Exec {
        /// Answer to let the child run its new program.
        resume: oneshot::Sender<()>,
    },
    /// The child stopped at a SIGCONT sent by the kernel, which the BPF programs send to
    /// hold it at a loader event until its mappings are loaded. Answer whether it was
    /// such a hold (the signal is then suppressed) or another SIGCONT (delivered).
    KernelSigcont {
        /// Answer `true` to suppress the signal; dropping it delivers the signal.
        resume: oneshot::Sender<bool>,
    },
}

/// A forked child waiting for the go signal before exec.
#[derive(Debug)]
pub struct PausedChild {
    /// The child's pid.
    pub pid: u32,
    go: OwnedFd,
    exec_error: OwnedFd,
    /// Handed to the child with the go signal, at [`REPLIES_FD`].
    handed: Option<OwnedFd>,
}

/// Finds `program` the way execvp would, so that a typo is reported before anything starts.
pub fn resolve_program(program: &str) -> Result<PathBuf> {
    let is_executable = |path: &Path| {
        std::fs::metadata(path).is_ok_and(|m| {
            m.is_file() && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
        })
    };
    if program.contains('/') {
        let path = PathBuf::from(program);
        if is_executable(&path) {
            return Ok(path);
        }
        bail!("cannot run `{program}`: no such executable file; check the command after `--`");
    }
    let search = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&search)
        .map(|dir| dir.join(program))
        .find(|p| is_executable(p))
        .with_context(|| {
            format!("cannot run `{program}`: not found in PATH; check the command after `--`")
        })
}

/// A connected pair of Unix stream sockets (the go signal can carry a descriptor).
fn socket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid array of two ints.
    let made = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if made != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair returned two fresh descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Room for one descriptor's control message.
#[repr(C)]
struct FdMessage {
    header: libc::cmsghdr,
    fd: libc::c_int,
}

/// Sends the go byte on `socket`, with `fd` attached if given.
fn send_go(socket: &OwnedFd, fd: Option<&OwnedFd>) -> io::Result<()> {
    let mut byte = *b"g";
    let mut data = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: plain-integer structures, zero is a valid value.
    let mut control: FdMessage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &raw mut data;
    message.msg_iovlen = 1;
    if let Some(fd) = fd {
        // SAFETY: CMSG_LEN and CMSG_SPACE only compute sizes.
        control.header.cmsg_len = unsafe { libc::CMSG_LEN(size_of::<libc::c_int>() as u32) } as _;
        control.header.cmsg_level = libc::SOL_SOCKET;
        control.header.cmsg_type = libc::SCM_RIGHTS;
        control.fd = fd.as_raw_fd();
        message.msg_control = (&raw mut control).cast();
        // SAFETY: as above, a size computation.
        message.msg_controllen = unsafe { libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) } as _;
    }
    // SAFETY: the message points to live buffers of the sizes given.
    if unsafe { libc::sendmsg(socket.as_raw_fd(), &message, libc::MSG_NOSIGNAL) } != 1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// In the child: waits for the go byte; a descriptor sent with it is moved to
/// `REPLIES_FD`. Returns whether the byte came. Only async-signal-safe calls.
///
/// # Safety
/// Called in the forked child only, before exec.
unsafe fn receive_go(socket: libc::c_int) -> bool {
    let mut byte = 0u8;
    let mut data = libc::iovec {
        iov_base: (&raw mut byte).cast(),
        iov_len: 1,
    };
    // SAFETY: plain-integer structures, zero is a valid value.
    let mut control: FdMessage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &raw mut data;
    message.msg_iovlen = 1;
    message.msg_control = (&raw mut control).cast();
    message.msg_controllen = size_of::<FdMessage>() as _;
    // SAFETY: the message points to live buffers of the sizes given.
    let received = unsafe { libc::recvmsg(socket, &mut message, libc::MSG_CMSG_CLOEXEC) };
    if received != 1 {
        return false;
    }
    if message.msg_controllen as usize >= size_of::<libc::cmsghdr>()
        && control.header.cmsg_level == libc::SOL_SOCKET
        && control.header.cmsg_type == libc::SCM_RIGHTS
    {
        // dup2 leaves the copy open across exec; the received one closes there.
        // SAFETY: plain descriptor calls.
        unsafe {
            if control.fd == REPLIES_FD {
                libc::fcntl(REPLIES_FD, libc::F_SETFD, 0);
            } else {
                libc::dup2(control.fd, REPLIES_FD);
            }
        }
    }
    true
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two fresh descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The environment of the launched command: heapprofd's own, with `changes` set and
/// the system-wide preload's opt-out. The command (with its children) is this
/// heapprofd's to profile: a system-wide heapprofd (`--all --preload system`) leaves it
/// alone, since two copies of the library cannot both serve one process, and the
/// system copy's own allocations would count as the command's on the probes.
fn environment(changes: &[(OsString, OsString)]) -> Result<Vec<CString>> {
    let mut changes = changes.to_vec();
    changes.push((SYSTEM_OPT_OUT_ENV.into(), SYSTEM_OPT_OUT_VALUE.into()));
    let mut variables: Vec<(OsString, OsString)> = std::env::vars_os()
        .filter(|(key, _)| !changes.iter().any(|(changed, _)| changed == key))
        .collect();
    variables.extend(changes);
    variables
        .into_iter()
        .map(|(key, value)| {
            let mut entry = key.into_encoded_bytes();
            entry.push(b'=');
            entry.extend(value.into_encoded_bytes());
            CString::new(entry).context("an environment variable contains a NUL byte")
        })
        .collect()
}

/// Forks a child that will exec `command` once released, with heapprofd's environment
/// and `environment` set. Call before starting threads.
pub fn fork_paused(
    command: &[String],
    environment_changes: &[(OsString, OsString)],
) -> Result<PausedChild> {
    let program = resolve_program(command.first().context("empty command")?)?;
    // Everything the child needs is allocated before fork: after it, only async-signal-safe calls.
    let program = CString::new(program.into_os_string().into_encoded_bytes())
        .context("command contains a NUL byte")?;
    let args: Vec<CString> = command
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect::<Result<_, _>>()
        .context("an argument contains a NUL byte")?;
    let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let variables = environment(environment_changes)?;
    let mut envp: Vec<*const libc::c_char> = variables.iter().map(|v| v.as_ptr()).collect();
    envp.push(std::ptr::null());

    let (go_read, go_write) = socket_pair().context("creating the launch socket")?;
    let (err_read, err_write) = pipe().context("creating the launch pipe")?;
    // SAFETY: the process is still single-threaded here (called before the runtime starts).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error()).context("fork");
    }
    if pid == 0 {
        // Child. SAFETY: only async-signal-safe calls until exec or _exit.
        unsafe {
            libc::close(go_write.as_raw_fd());
            libc::close(err_read.as_raw_fd());
            if !receive_go(go_read.as_raw_fd()) {
                // The daemon gave up before releasing us.
                libc::_exit(125);
            }
            // Rust's runtime ignores SIGPIPE in heapprofd; the command must not inherit
            // that (a pipeline's writer would get EPIPE instead of ending), just as
            // std::process::Command restores it. Every other disposition is
            // heapprofd's own inherited one: no handler is installed before this fork.
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            libc::execve(program.as_ptr(), argv.as_ptr(), envp.as_ptr());
            let errno = *libc::__errno_location();
            libc::write(
                err_write.as_raw_fd(),
                (&raw const errno).cast(),
                size_of::<i32>(),
            );
            libc::_exit(127);
        }
    }
    drop(go_read);
    drop(err_write);
    Ok(PausedChild {
        pid: pid as u32,
        go: go_write,
        exec_error: err_read,
        handed: None,
    })
}

impl PausedChild {
    /// Hands `fd` to the child with the go signal: it execs with it at
    /// [`REPLIES_FD`].
    pub fn hand_over(&mut self, fd: OwnedFd) {
        self.handed = Some(fd);
    }

    /// Starts the tracer thread, which lets the child exec and reports its exit.
    pub fn release(self) -> mpsc::UnboundedReceiver<ChildEvent> {
        let (events, receiver) = mpsc::unbounded_channel();
        let spawned = std::thread::Builder::new()
            .name("heapprofd-child".into())
            .spawn(move || self.trace(events));
        if let Err(err) = spawned {
            log::error!("cannot start the tracer thread: {err}");
        }
        receiver
    }

    /// The tracer thread: seizes the child, lets it exec, then answers its stops
    /// until it is gone.
    fn trace(self, events: mpsc::UnboundedSender<ChildEvent>) {
        let Self {
            pid,
            go,
            exec_error,
            handed,
        } = self;
        let pid = pid as libc::pid_t;
        seize(pid);
        if let Err(err) = send_go(&go, handed.as_ref()) {
            log::error!("cannot release the command: {err}");
        }
        drop((go, handed));

        loop {
            let mut status = 0;
            // SAFETY: waiting for our own child.
            let waited = unsafe { libc::waitpid(pid, &mut status, libc::__WALL) };
            if waited < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                log::error!("waiting for the child: {}", io::Error::last_os_error());
                let _ = events.send(ChildEvent::Exited(1));
                return;
            }
            if let Some(code) = exit_status(status, &exec_error) {
                let _ = events.send(ChildEvent::Exited(code));
                return;
            }
            if libc::WIFSTOPPED(status) {
                answer_stop(pid, status, &events);
            }
        }
    }
}

/// Seizes the child with ptrace, asking for its exit and exec events only.
fn seize(pid: libc::pid_t) {
    // SAFETY: plain ptrace request on our own child.
    let seized = unsafe {
        libc::ptrace(
            libc::PTRACE_SEIZE,
            pid,
            0,
            (libc::PTRACE_O_TRACEEXIT | libc::PTRACE_O_TRACEEXEC) as libc::c_long,
        )
    } == 0;
    if !seized {
        log::warn!(
            "cannot hold the child at exit ({}); symbols of code loaded after the last profile may be missing",
            io::Error::last_os_error()
        );
    }
}

/// The child's exit status as a shell reports it (128+N for signal N), once it has
/// ended; an exec that failed is said here.
fn exit_status(status: libc::c_int, exec_error: &OwnedFd) -> Option<i32> {
    if libc::WIFEXITED(status) {
        let code = libc::WEXITSTATUS(status);
        if code == 127 {
            report_exec_error(exec_error);
        }
        return Some(code);
    }
    libc::WIFSIGNALED(status).then(|| 128 + libc::WTERMSIG(status))
}

/// Lets the stopped child go on: after the session's answer at its exit, its exec and
/// the programs' hold at a loader event; stopped still at a group stop, as without a
/// tracer; with any other signal delivered unchanged.
fn answer_stop(pid: libc::pid_t, status: libc::c_int, events: &mpsc::UnboundedSender<ChildEvent>) {
    let event = (status >> 16) & 0xff;
    if event == libc::PTRACE_EVENT_EXIT {
        held_until_answered(events, |resume| ChildEvent::Exiting { resume });
        continue_child(pid, 0);
    } else if event == libc::PTRACE_EVENT_EXEC {
        held_until_answered(events, |resume| ChildEvent::Exec { resume });
        continue_child(pid, 0);
    } else if event == libc::PTRACE_EVENT_STOP {
        if is_stop_signal(libc::WSTOPSIG(status)) {
            // A group stop (SIGSTOP, SIGTSTP...): stay stopped, as without a tracer.
            // SAFETY: a request on our own seized child, stopped; it passes no memory.
            unsafe { libc::ptrace(libc::PTRACE_LISTEN, pid, 0, 0) };
        } else {
            // A notification trap (WSTOPSIG is SIGTRAP): a seized tracee traps like
            // this when it gets SIGCONT, as `timeout` sends after its signal. It is
            // not a group stop: answering with PTRACE_LISTEN would hold it stopped
            // for good, with its pending SIGINT/SIGTERM never delivered.
            continue_child(pid, 0);
        }
    } else {
        // A signal on its way to the child: deliver it unchanged, unless it is the
        // programs' hold at a loader event (answered by the session).
        let mut signal = libc::WSTOPSIG(status);
        if signal == libc::SIGCONT && sent_by_kernel(pid) {
            let (resume, resumed) = oneshot::channel();
            if events.send(ChildEvent::KernelSigcont { resume }).is_ok()
                && resumed.blocking_recv() == Ok(true)
            {
                signal = 0;
            }
        }
        continue_child(pid, signal);
    }
}

/// Tells the session of a hold (`event`, made with the answer's sender) and waits for
/// its answer; a dropped answer means go on too.
fn held_until_answered(
    events: &mpsc::UnboundedSender<ChildEvent>,
    event: impl FnOnce(oneshot::Sender<()>) -> ChildEvent,
) {
    let (resume, resumed) = oneshot::channel();
    if events.send(event(resume)).is_ok() {
        let _ = resumed.blocking_recv();
    }
}

/// Resumes the stopped child, delivering `signal` (0 for none).
fn continue_child(pid: libc::pid_t, signal: libc::c_int) {
    // SAFETY: a request on our own seized child, stopped; it passes no memory, only a
    // signal number.
    unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, signal as libc::c_long) };
}

/// How long a launched command may take to end after a passed signal before heapprofd
/// says that it has not.
pub const SIGNAL_GRACE: Duration = Duration::from_secs(2);

/// Repeats of a signal this soon after the first are the same request: `timeout`
/// signals its child and then the child's process group, so heapprofd gets two copies;
/// a person pressing Ctrl-C again to stop at once takes longer than this.
pub const REPEAT_WINDOW: Duration = Duration::from_millis(250);

/// Launch mode's answer to SIGINT and SIGTERM: the first is passed to the command,
/// whose exit then ends the run (final profile, the command's status); a second one
/// stops heapprofd at once.
#[derive(Debug)]
pub struct SignalRelay {
    pid: u32,
    passed: Option<PassedSignal>,
    /// The command has begun to exit: its end, and the run's, are moments away.
    exiting: bool,
}

#[derive(Debug, Clone, Copy)]
struct PassedSignal {
    signal: i32,
    at: Instant,
    warned: bool,
}

/// What to do about a signal, per [`SignalRelay::on_signal`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relayed {
    /// Passed to the command: wait for it to end.
    Passed,
    /// A copy of the signal already passed: nothing more to do.
    Repeat,
    /// A second request: stop now.
    StopNow,
}

impl SignalRelay {
    /// A relay to the launched command `pid`.
    pub fn new(pid: u32) -> Self {
        Self {
            pid,
            passed: None,
            exiting: false,
        }
    }

    /// Handles SIGINT/SIGTERM received at `now`.
    pub fn on_signal(&mut self, signal: i32, now: Instant) -> Relayed {
        match self.passed {
            None => {
                log::info!(
                    "passing signal {signal} to pid {}; a second one stops heapprofd at once",
                    self.pid
                );
                pass_signal(self.pid, signal);
                // An ignored signal is known at once: say so now rather than after
                // the grace period, and name the usual cause.
                let ignored = ignores_signal(self.pid, signal);
                if ignored {
                    log::warn!(
                        "the command (pid {}) ignores signal {signal}: it inherited SIG_IGN \
                         (a shell without job control starts background commands so, for \
                         SIGINT and SIGQUIT); heapprofd traces it until it exits; send the \
                         signal again to stop heapprofd now, or SIGTERM to end both",
                        self.pid
                    );
                }
                self.passed = Some(PassedSignal {
                    signal,
                    at: now,
                    warned: ignored,
                });
                Relayed::Passed
            }
            Some(passed) if now.duration_since(passed.at) < REPEAT_WINDOW => {
                log::debug!("signal {signal} again right away: the same request");
                Relayed::Repeat
            }
            // The repeat window is measured when the loop gets to the signal, which
            // may be long after it arrived (reading an exiting command's mappings
            // comes first): once the command exits, a copy cannot mean "stop at once".
            Some(_) if self.exiting => {
                log::debug!("signal {signal} again while the command exits: waiting for it");
                Relayed::Repeat
            }
            Some(_) => {
                log::warn!(
                    "signal {signal} again: stopping now (the command, pid {}, keeps running)",
                    self.pid
                );
                Relayed::StopNow
            }
        }
    }

    /// The command has begun to exit (it is held at its exit).
    pub fn command_exiting(&mut self) {
        self.exiting = true;
    }

    /// When to say that the command has not ended, if that is still to be said.
    pub fn warning_due(&self) -> Option<Instant> {
        self.passed
            .filter(|passed| !passed.warned)
            .map(|passed| passed.at + SIGNAL_GRACE)
    }

    /// Says that the command has not ended after the signal (once).
    pub fn warn_still_running(&mut self) {
        if let Some(passed) = self.passed.as_mut().filter(|passed| !passed.warned) {
            passed.warned = true;
            log::warn!(
                "the command (pid {}) is still running {} s after signal {} (it ignores or \
                 handles it); heapprofd traces it until it exits; send the signal again to \
                 stop heapprofd now",
                self.pid,
                SIGNAL_GRACE.as_secs(),
                passed.signal
            );
        }
    }
}

/// Passes SIGINT/SIGTERM to the launched command, then SIGCONT as `timeout` does: a
/// stopped command would otherwise keep the signal pending and never end.
fn pass_signal(pid: u32, signal: i32) {
    // SAFETY: plain kill(2) of our own child.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
        libc::kill(pid as libc::pid_t, libc::SIGCONT);
    }
}

/// Whether process `pid` ignores `signal` (its disposition is SIG_IGN), per
/// `/proc/PID/status`. False when that cannot be read.
fn ignores_signal(pid: u32, signal: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| ignored_signals(&status))
        .is_some_and(|mask| signal_in_mask(mask, signal))
}

/// The `SigIgn:` mask of a `/proc/PID/status` text.
fn ignored_signals(status: &str) -> Option<u64> {
    let hex = status
        .lines()
        .find_map(|line| line.strip_prefix("SigIgn:"))?
        .trim();
    u64::from_str_radix(hex, 16).ok()
}

/// Whether `signal` (1-based) is in a kernel signal mask, whose bit N-1 is signal N.
fn signal_in_mask(mask: u64, signal: i32) -> bool {
    (1..=64).contains(&signal) && mask & (1 << (signal - 1)) != 0
}

/// Whether the signal the stopped tracee `pid` is about to receive was sent by the
/// kernel (`SI_KERNEL`), as BPF's `bpf_send_signal` does, rather than by a process.
fn sent_by_kernel(pid: libc::pid_t) -> bool {
    // SAFETY: zeroed siginfo is a valid out-parameter.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: a request on our own stopped tracee, writing into `info`.
    let read = unsafe { libc::ptrace(libc::PTRACE_GETSIGINFO, pid, 0, &raw mut info) };
    read == 0 && info.si_code == libc::SI_KERNEL
}

/// The signals whose default action is to stop the process (a group stop).
fn is_stop_signal(signal: i32) -> bool {
    matches!(
        signal,
        libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU
    )
}

fn report_exec_error(exec_error: &OwnedFd) {
    let mut errno = 0i32;
    // SAFETY: reading at most 4 bytes into errno; the write end is closed, so this does not block.
    let n = unsafe {
        libc::read(
            exec_error.as_raw_fd(),
            (&raw mut errno).cast(),
            size_of::<i32>(),
        )
    };
    if n == size_of::<i32>() as isize {
        log::error!(
            "cannot execute the command: {}",
            io::Error::from_raw_os_error(errno)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ignored_signal_is_read_from_the_status_mask() {
        let status = "Name:\tbusy\nSigPnd:\t0000000000000000\nSigBlk:\t0000000000000000\n\
                      SigIgn:\t0000000080001006\nSigCgt:\t0000000100000000\n";
        let mask = ignored_signals(status).expect("a SigIgn line");
        assert_eq!(mask, 0x8000_1006);
        for ignored in [libc::SIGINT, libc::SIGQUIT, libc::SIGPIPE, 32] {
            assert!(signal_in_mask(mask, ignored), "signal {ignored}");
        }
        for caught in [libc::SIGHUP, libc::SIGTERM, libc::SIGUSR1, 0, 65] {
            assert!(!signal_in_mask(mask, caught), "signal {caught}");
        }
        assert_eq!(ignored_signals("Name:\tx\n"), None);
    }

    #[test]
    fn the_launched_command_keeps_out_of_the_system_preload() {
        let changes = [("LD_PRELOAD".into(), "/x/lib.so".into())];
        let entries: Vec<String> = environment(&changes)
            .expect("environment")
            .into_iter()
            .map(|entry| entry.into_string().expect("utf-8"))
            .collect();
        let expected = format!("{SYSTEM_OPT_OUT_ENV}={SYSTEM_OPT_OUT_VALUE}");
        assert_eq!(entries.iter().filter(|e| **e == expected).count(), 1);
        assert!(entries.iter().any(|e| e == "LD_PRELOAD=/x/lib.so"));
    }

    /// A relay that has passed SIGTERM at the returned instant to a command, which
    /// got it and ended.
    fn relay_after_a_passed_sigterm() -> (SignalRelay, Instant) {
        let mut command = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("starting sleep");
        let mut relay = SignalRelay::new(command.id());
        let start = Instant::now();
        assert_eq!(relay.on_signal(libc::SIGTERM, start), Relayed::Passed);
        let status = command.wait().expect("waiting for sleep");
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGTERM),
            "the command got the signal"
        );
        (relay, start)
    }

    #[test]
    fn relay_passes_the_first_signal_takes_quick_copies_as_one_and_stops_on_a_second() {
        let (mut relay, start) = relay_after_a_passed_sigterm();
        assert_eq!(
            relay.on_signal(libc::SIGTERM, start + REPEAT_WINDOW / 2),
            Relayed::Repeat,
            "timeout's second copy"
        );
        assert_eq!(relay.warning_due(), Some(start + SIGNAL_GRACE));
        relay.warn_still_running();
        assert_eq!(relay.warning_due(), None, "said once");
        assert_eq!(
            relay.on_signal(libc::SIGINT, start + REPEAT_WINDOW * 2),
            Relayed::StopNow
        );
    }

    #[test]
    fn a_late_copy_while_the_command_exits_is_not_a_second_request() {
        let (mut relay, start) = relay_after_a_passed_sigterm();
        relay.command_exiting();
        assert_eq!(
            relay.on_signal(libc::SIGTERM, start + REPEAT_WINDOW * 4),
            Relayed::Repeat,
            "timeout's copy, handled after the command's exit event"
        );
    }
}
