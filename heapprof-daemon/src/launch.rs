//! Launch mode: start a command paused, attach, then let it exec.
//!
//! The child is forked before the probes exist and waits on a pipe; once the
//! probes are attached to its pid it execs, so its first allocation (inside the
//! dynamic loader, before main) is already traced. A tracer thread seizes the
//! child with ptrace, asking only for the exit event: at that stop the process
//! still has its address space, so the daemon can read its mappings and take the
//! final counts before the kernel tears it down. Every other stop is passed on.

use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
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
}

/// A forked child waiting for the go signal before exec.
#[derive(Debug)]
pub struct PausedChild {
    /// The child's pid.
    pub pid: u32,
    go: OwnedFd,
    exec_error: OwnedFd,
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

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two fresh descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Forks a child that will exec `command` once released. Call before starting threads.
pub fn fork_paused(command: &[String]) -> Result<PausedChild> {
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

    let (go_read, go_write) = pipe().context("creating the launch pipe")?;
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
            let mut byte = 0u8;
            let n = libc::read(go_read.as_raw_fd(), (&raw mut byte).cast(), 1);
            if n != 1 {
                // The daemon gave up before releasing us.
                libc::_exit(125);
            }
            libc::execv(program.as_ptr(), argv.as_ptr());
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
    })
}

impl PausedChild {
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

    fn trace(self, events: mpsc::UnboundedSender<ChildEvent>) {
        let Self {
            pid,
            go,
            exec_error,
        } = self;
        let pid = pid as libc::pid_t;
        // SAFETY: plain ptrace request on our own child.
        let seized = unsafe {
            libc::ptrace(
                libc::PTRACE_SEIZE,
                pid,
                0,
                libc::PTRACE_O_TRACEEXIT as libc::c_long,
            )
        } == 0;
        if !seized {
            log::warn!(
                "cannot hold the child at exit ({}); symbols of code loaded after the last profile may be missing",
                io::Error::last_os_error()
            );
        }
        // SAFETY: writing one byte to our own pipe.
        unsafe { libc::write(go.as_raw_fd(), b"g".as_ptr().cast(), 1) };
        drop(go);

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
            if libc::WIFEXITED(status) {
                let code = libc::WEXITSTATUS(status);
                if code == 127 {
                    report_exec_error(&exec_error);
                }
                let _ = events.send(ChildEvent::Exited(code));
                return;
            }
            if libc::WIFSIGNALED(status) {
                let _ = events.send(ChildEvent::Exited(128 + libc::WTERMSIG(status)));
                return;
            }
            if !libc::WIFSTOPPED(status) {
                continue;
            }
            let event = (status >> 16) & 0xff;
            // SAFETY (all ptrace calls below): requests on our own seized, stopped child.
            if event == libc::PTRACE_EVENT_EXIT {
                let (resume, resumed) = oneshot::channel();
                if events.send(ChildEvent::Exiting { resume }).is_ok() {
                    // Either answered or dropped: both mean go on.
                    let _ = resumed.blocking_recv();
                }
                unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, 0) };
            } else if event == libc::PTRACE_EVENT_STOP {
                // Group stop under PTRACE_SEIZE: stay stopped, as without a tracer.
                unsafe { libc::ptrace(libc::PTRACE_LISTEN, pid, 0, 0) };
            } else {
                // A signal on its way to the child: deliver it unchanged.
                let signal = libc::WSTOPSIG(status);
                unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, signal as libc::c_long) };
            }
        }
    }
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
