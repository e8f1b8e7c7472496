//! The socket where heapprofd answers the system-wide library (`--preload system`):
//! each new dynamic program's copy connects from its start, heapprofd sends the join
//! ([`SystemJoin`], with the answers' map and heapprofd's pidfd as `SCM_RIGHTS`
//! descriptors), and the copy answers with its join's result.
//!
//! `SOCK_SEQPACKET` keeps the messages whole. The socket is root's: a copy joins only
//! a peer whose credentials say uid 0 (see the interposer's `system.c`).

use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use heapprof_common::preload::SystemJoin;
use tokio::io::unix::AsyncFd;

/// How long heapprofd waits for a copy's answer (the copy itself waits one second
/// for the join message).
const ANSWER_WAIT: Duration = Duration::from_secs(2);

/// The listening socket, removed when dropped.
pub struct Listener {
    fd: std::sync::Arc<OwnedFd>,
    path: PathBuf,
}

/// A process that asked to be joined.
pub struct Asking {
    /// The process (from the connection's credentials).
    pub pid: u32,
    connection: OwnedFd,
}

impl Listener {
    /// Binds `path` (mode 0666: every program may ask). A socket that answers there
    /// belongs to another heapprofd: an error. One that refuses was left by a
    /// heapprofd that was killed, and is replaced.
    pub fn bind(path: &Path) -> Result<Self> {
        if let Some(dir) = path.parent() {
            use std::os::unix::fs::DirBuilderExt as _;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .with_context(|| format!("creating {}", dir.display()))?;
        }
        if connect(path).is_ok() {
            bail!(
                "another heapprofd serves the system-wide preload (its socket {} answers): \
                 stop it first (systemctl stop heapprofd), or drop --preload system",
                path.display()
            );
        }
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => return Err(err).with_context(|| format!("removing {}", path.display())),
        }
        let fd = seqpacket(0)?;
        let address = address(path)?;
        // SAFETY: a valid socket and a sockaddr_un of the given length.
        let bound = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const address).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as u32,
            )
        };
        if bound != 0 {
            return Err(io::Error::last_os_error())
                .with_context(|| format!("binding {}", path.display()));
        }
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
            .with_context(|| format!("opening {} to every program", path.display()))?;
        // SAFETY: a bound socket.
        if unsafe { libc::listen(fd.as_raw_fd(), 512) } != 0 {
            return Err(io::Error::last_os_error())
                .with_context(|| format!("listening on {}", path.display()));
        }
        Ok(Self {
            fd: std::sync::Arc::new(fd),
            path: path.to_owned(),
        })
    }

    /// The next process asking to be joined (blocking); `None` once [`Self::close`]d.
    pub fn accept(&self) -> Option<Asking> {
        loop {
            // SAFETY: a listening socket; the peer's address is not asked for.
            let fd = unsafe {
                libc::accept4(
                    self.fd.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC,
                )
            };
            if fd < 0 {
                let err = io::Error::last_os_error();
                match err.raw_os_error() {
                    Some(libc::EINTR | libc::ECONNABORTED | libc::EMFILE | libc::ENFILE) => {
                        log::debug!("accepting on {}: {err}", self.path.display());
                        if matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        continue;
                    }
                    // Shut down by `close`.
                    _ => return None,
                }
            }
            // SAFETY: a new descriptor we own.
            let connection = unsafe { OwnedFd::from_raw_fd(fd) };
            match peer_pid(&connection) {
                Ok(pid) => return Some(Asking { pid, connection }),
                Err(err) => log::debug!("a process asked to join, but: {err}"),
            }
        }
    }

    /// A handle that ends [`Self::accept`] from another thread.
    pub fn closer(&self) -> Closer {
        Closer(std::sync::Arc::clone(&self.fd))
    }
}

/// Ends a [`Listener`]'s `accept`, waiting in another thread.
pub struct Closer(std::sync::Arc<OwnedFd>);

impl Closer {
    /// Shuts the socket down: `accept` returns `None`.
    pub fn close(&self) {
        // SAFETY: shutdown of a socket we hold open.
        unsafe { libc::shutdown(self.0.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Asking {
    /// Sends the join: `join`, with the answers' map and heapprofd's pidfd.
    pub fn send(
        &self,
        join: SystemJoin,
        replies: BorrowedFd<'_>,
        pidfd: BorrowedFd<'_>,
    ) -> Result<()> {
        let fds = [replies.as_raw_fd(), pidfd.as_raw_fd()];
        let payload = [join.sample_rate.to_ne_bytes(), join.flags.to_ne_bytes()].concat();
        crate::sys::send_with_descriptors(
            self.connection.as_raw_fd(),
            &payload,
            &fds,
            libc::MSG_NOSIGNAL,
        )
        .context("sending the join")
    }

    /// The copy's answer: the slots it redirected, or why it did not join (negative,
    /// see the interposer's `join.h`); an error if it gave up waiting or died.
    pub async fn answer(self) -> Result<i64> {
        // SAFETY: F_SETFL on a descriptor we own.
        unsafe { libc::fcntl(self.connection.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
        // SAFETY: the AsyncFd owns the connection, open and unchanged until dropped.
        let fd = unsafe { AsyncFd::register(self.connection) }.context("watching the answer")?;
        let read = async {
            loop {
                let mut guard = fd.readable().await?;
                let mut value = [0u8; 8];
                // SAFETY: reads at most 8 bytes into `value`.
                let got = unsafe {
                    libc::recv(
                        fd.get_ref().as_raw_fd(),
                        value.as_mut_ptr().cast(),
                        value.len(),
                        0,
                    )
                };
                if got == 8 {
                    return Ok(i64::from_ne_bytes(value));
                }
                let err = io::Error::last_os_error();
                if got < 0 && err.kind() == io::ErrorKind::WouldBlock {
                    guard.clear_ready();
                    continue;
                }
                return Err(if got == 0 {
                    io::Error::new(io::ErrorKind::UnexpectedEof, "it closed without answering")
                } else {
                    err
                });
            }
        };
        match tokio::time::timeout(ANSWER_WAIT, read).await {
            Ok(answer) => answer.context("reading the answer"),
            Err(_) => bail!("no answer within {ANSWER_WAIT:?}"),
        }
    }

    /// The connection, for tests of the protocol.
    #[cfg(test)]
    fn descriptor(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd as _;
        self.connection.as_fd()
    }
}

/// A new `SOCK_SEQPACKET` Unix socket, with `flags` (`SOCK_NONBLOCK`).
fn seqpacket(flags: i32) -> Result<OwnedFd> {
    // SAFETY: plain socket creation.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | flags,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error()).context("creating a Unix socket");
    }
    // SAFETY: a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `path` as a Unix socket address.
fn address(path: &Path) -> Result<libc::sockaddr_un> {
    use std::os::unix::ffi::OsStrExt as _;
    // SAFETY: a zeroed sockaddr_un is valid.
    let mut address: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    address.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= address.sun_path.len() {
        bail!("{}: too long for a Unix socket", path.display());
    }
    for (to, from) in address.sun_path.iter_mut().zip(bytes) {
        *to = *from as libc::c_char;
    }
    Ok(address)
}

/// A connection to `path` (blocking), as the library makes one.
pub fn connect(path: &Path) -> Result<OwnedFd> {
    let fd = seqpacket(libc::SOCK_NONBLOCK)?;
    let address = address(path)?;
    // SAFETY: a valid socket and address. Non-blocking: a listener's backlog accepts
    // at once, a missing or refusing one fails at once.
    let connected = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&raw const address).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as u32,
        )
    };
    if connected != 0 {
        return Err(io::Error::last_os_error())
            .with_context(|| format!("connecting to {}", path.display()));
    }
    Ok(fd)
}

/// The process at the other end of `connection`.
fn peer_pid(connection: &OwnedFd) -> Result<u32> {
    // SAFETY: a zeroed ucred is valid.
    let mut credentials: libc::ucred = unsafe { std::mem::zeroed() };
    let mut length = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred of `length` bytes.
    let got = unsafe {
        libc::getsockopt(
            connection.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut credentials).cast(),
            &raw mut length,
        )
    };
    if got != 0 {
        return Err(io::Error::last_os_error()).context("reading its credentials");
    }
    u32::try_from(credentials.pid)
        .ok()
        .filter(|pid| *pid != 0)
        .context("its pid is not visible from heapprofd's namespace")
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd as _;

    use super::*;

    #[tokio::test]
    async fn a_process_asking_gets_the_join_and_its_answer_is_read() {
        let dir = std::env::temp_dir().join(format!("heapprofd-socket-{}", std::process::id()));
        let path = dir.join("system.sock");
        let listener = Listener::bind(&path).expect("bind");
        let client = connect(&path).expect("connect");
        let asking = listener.accept().expect("a connection");
        assert_eq!(asking.pid, std::process::id());
        let (replies, pidfd) = (
            asking.descriptor().try_clone_to_owned().expect("dup"),
            client.try_clone().expect("dup"),
        );
        let join = SystemJoin {
            sample_rate: 524_288,
            flags: SystemJoin::CHILDREN,
        };
        asking
            .send(join, replies.as_fd(), pidfd.as_fd())
            .expect("send");
        // The client's side: the join and two descriptors, then the answer.
        let mut received = SystemJoin::default();
        let mut io = libc::iovec {
            iov_base: (&raw mut received).cast(),
            iov_len: 16,
        };
        let mut control = [0u64; 8];
        // SAFETY: zeroed msghdr pointing at live buffers.
        let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
        message.msg_iov = &raw mut io;
        message.msg_iovlen = 1;
        message.msg_control = control.as_mut_ptr().cast();
        message.msg_controllen = std::mem::size_of_val(&control) as _;
        // SAFETY: as above.
        let got =
            unsafe { libc::recvmsg(client.as_raw_fd(), &raw mut message, libc::MSG_CMSG_CLOEXEC) };
        assert_eq!(got, 16);
        assert_eq!(received, join);
        // SAFETY: the control buffer holds what recvmsg wrote.
        let header = unsafe { &*libc::CMSG_FIRSTHDR(&raw const message) };
        assert_eq!(header.cmsg_type, libc::SCM_RIGHTS);
        // SAFETY: CMSG_LEN is a pure computation.
        let two_descriptors = unsafe { libc::CMSG_LEN(8) } as usize;
        assert_eq!(header.cmsg_len as usize, two_descriptors);
        let answer = 12i64.to_ne_bytes();
        // SAFETY: sends 8 bytes of a live buffer.
        let sent = unsafe { libc::send(client.as_raw_fd(), answer.as_ptr().cast(), 8, 0) };
        assert_eq!(sent, 8);
        assert_eq!(asking.answer().await.expect("answer"), 12);
        assert!(
            Listener::bind(&path).is_err(),
            "a second heapprofd is refused while this one listens"
        );
        drop(listener);
        assert!(!path.exists(), "the socket goes with the listener");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
