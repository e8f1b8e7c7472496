//! Launch mode: start a command paused, attach, then let it exec.
//!
//! The child is forked before the probes exist and waits on a socket; once the
//! probes are attached to its pid it execs (with the preload library, it is handed
//! the map of the library's answers first, at a fixed descriptor), so its first allocation (inside the
//! dynamic loader, before main) is already traced. A tracer thread seizes the
//! child with ptrace, asking only for the exit event: at that stop the process
//! still has its address space, so the daemon can read its mappings and take the
//! final counts before the kernel tears it down. Every other stop is passed on.
//!
//! The rooms: this one holds the paused child, from its fork to its release;
//! [`tracer`] the thread that holds it at its exec, loader events and exit; [`signals`]
//! how SIGINT and SIGTERM reach the command.

mod signals;
mod tracer;

pub use signals::{REPEAT_WINDOW, Relayed, SIGNAL_GRACE, SignalRelay};

use std::{
    ffi::{CString, OsString},
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
};

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
}
