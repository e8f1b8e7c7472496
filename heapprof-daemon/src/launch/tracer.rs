//! The tracer thread of a launched command: it seizes the child with ptrace, lets it
//! exec, and holds it at the stops the session answers (its exec, a loader event,
//! its exit) until the session has read what it needs.

use std::{io, os::fd::OwnedFd};

use tokio::sync::{mpsc, oneshot};

use super::{ChildEvent, PausedChild, report_exec_error, send_go};

impl PausedChild {
    /// The tracer thread: seizes the child, lets it exec, then answers its stops
    /// until it is gone.
    pub(super) fn trace(self, events: mpsc::UnboundedSender<ChildEvent>) {
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
