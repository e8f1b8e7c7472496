//! `heapprofd --all --preload system`: the system-wide preload, for a fleet daemon
//! that costs what launch mode costs.
//!
//! heapprofd installs its library's system build (the interposer built with
//! `HP_SYSTEM_PRELOAD`, which exports no allocation function) at
//! [`SYSTEM_LIBRARY`](heapprof_common::preload::SYSTEM_LIBRARY), listens on
//! [`SYSTEM_SOCKET`](heapprof_common::preload::SYSTEM_SOCKET) and adds the library to
//! `/etc/ld.so.preload`. Each dynamic program starting from then on loads it; its start
//! asks heapprofd to join ([`socket`]), heapprofd reads the process's mappings and
//! unwind tables and sends the join, and the copy redirects the process's allocator
//! calls to itself, as a `--pid` join does. A process whose copy does not join (or
//! that has none: static programs, other mount namespaces) gets its allocator's probes
//! for itself alone (see `AllocatorProbes::check_process`).
//!
//! At exit the entry is removed (and the socket); the library file stays, so that an
//! entry left by a heapprofd that was killed names a file that exists, whose copies
//! find no socket to join and stay inert.

pub mod entry;
pub mod opt_out;
pub mod running;
pub mod socket;

use std::{
    collections::HashSet,
    os::fd::{AsFd as _, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, Result};
use heapprof_common::preload::{SYSTEM_LIBRARY, SYSTEM_SOCKET, SystemJoin};
use tokio::sync::mpsc;

/// The system's preload list.
pub const PRELOAD_LIST: &str = "/etc/ld.so.preload";

/// The processes the system-wide library has joined (or is joining): shared by the
/// thread that answers them and the session, whose probes leave them alone.
pub type JoinedSet = Arc<Mutex<HashSet<u32>>>;

/// Whether `pid` is in `set`.
pub fn contains(set: &JoinedSet, pid: u32) -> bool {
    set.lock().is_ok_and(|set| set.contains(&pid))
}

/// What the system-wide preload has to say to the session.
pub enum Event {
    /// A process asks to be joined, and waits in its start: read its mappings and
    /// unwind tables now, then say so on `ready` (its join is sent then, or after
    /// [`MAPPINGS_WAIT`] whatever the session is doing).
    Asking(u32, std::sync::mpsc::SyncSender<()>),
    /// The join was sent: its answer is awaited with [`SystemPreload::await_answer`].
    Sent(socket::Asking),
    /// A process's copy answered its join: slots redirected, or why it did not join.
    Answered(u32, Result<i64>),
    /// A process that ran before heapprofd could not be asked to join (why): its
    /// allocator's probes must count it.
    NotAsked(u32, String),
    /// Every process that ran before heapprofd was asked (`asked` of `tried` reached
    /// the socket; their answers come as [`Event::Answered`]).
    RunningAsked {
        /// Processes whose copy asked.
        asked: usize,
        /// Processes heapprofd tried.
        tried: usize,
    },
}

/// How long a process asking waits for the session to read its mappings before its
/// join is sent all the same (the session may be busy writing a profile): a program
/// started then has its first stacks symbolized only if it lives until they are read.
pub const MAPPINGS_WAIT: Duration = Duration::from_millis(800);

/// The installed entry, and the thread that answers the processes asking.
pub struct SystemPreload {
    list: PathBuf,
    closer: socket::Closer,
    answering: Option<std::thread::JoinHandle<()>>,
    events: mpsc::UnboundedReceiver<Event>,
    answers: mpsc::UnboundedSender<Event>,
    joined: JoinedSet,
    /// Answers awaited in the background, not heard of yet.
    awaiting: std::cell::Cell<usize>,
    /// The thread asking the processes that ran before heapprofd, and its stop.
    asking_running: Option<std::thread::JoinHandle<()>>,
    stop_asking_running: Arc<AtomicBool>,
    running_pending: std::cell::Cell<bool>,
    removed: bool,
}

impl SystemPreload {
    /// Listens on the socket, starts the thread that answers (at once, whatever the
    /// session is doing: a program's start waits for it), and adds the library to the
    /// preload list: from now on new programs ask to join. `replies` is the answers'
    /// map; `joined` the set the session's probes consult.
    pub fn start(replies: OwnedFd, sample_rate: u64, joined: JoinedSet) -> Result<Self> {
        let listener = socket::Listener::bind(Path::new(SYSTEM_SOCKET))?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd =
            unsafe { libc::syscall(libc::SYS_pidfd_open, std::process::id() as libc::pid_t, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).context(
                "pidfd_open of heapprofd itself (Linux 5.3+), which joined processes watch",
            );
        }
        // SAFETY: a new descriptor we own.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let join = SystemJoin {
            sample_rate,
            // --all traces every process: a forked child stays joined.
            flags: SystemJoin::CHILDREN,
        };
        let (sender, events) = mpsc::unbounded_channel();
        let closer = listener.closer();
        let answering = {
            let sender = sender.clone();
            let joined = Arc::clone(&joined);
            std::thread::Builder::new()
                .name("system-preload".into())
                .spawn(move || answer_all(&listener, join, &replies, &pidfd, &joined, &sender))
                .context("starting the thread that answers the system-wide preload")?
        };
        let list = PathBuf::from(PRELOAD_LIST);
        let added = entry::add(&list, SYSTEM_LIBRARY).with_context(|| {
            format!(
                "adding {SYSTEM_LIBRARY} to {PRELOAD_LIST} (needs root; or drop --preload system)"
            )
        });
        let started = Self {
            list,
            closer,
            answering: Some(answering),
            events,
            answers: sender,
            joined,
            awaiting: std::cell::Cell::new(0),
            asking_running: None,
            stop_asking_running: Arc::new(AtomicBool::new(false)),
            running_pending: std::cell::Cell::new(false),
            removed: false,
        };
        if !added? {
            log::info!(
                "{PRELOAD_LIST} names {SYSTEM_LIBRARY} already (left by a heapprofd that did \
                 not exit cleanly); it is removed at exit"
            );
        }
        Ok(started)
    }

    /// Asks each of `pids` (processes that ran before heapprofd, marked in the joined
    /// set before the session first read them: see [`running`]) to join, in a thread of
    /// its own; the event loop meanwhile reads each one's mappings as it asks.
    pub fn ask_running(&mut self, pids: Vec<u32>) -> Result<()> {
        let stop = Arc::clone(&self.stop_asking_running);
        let events = self.answers.clone();
        let thread = std::thread::Builder::new()
            .name("system-running".into())
            .spawn(move || running::ask_all(&pids, SYSTEM_LIBRARY, &stop, &events))
            .context("starting the thread that joins the processes running before heapprofd")?;
        self.asking_running = Some(thread);
        self.running_pending.set(true);
        Ok(())
    }

    /// Whether processes that ran before heapprofd are being asked still (until the
    /// session hears [`Event::RunningAsked`]).
    pub fn asks_running(&self) -> bool {
        self.running_pending.get()
    }

    /// The next thing the session must hear of.
    pub async fn next(&mut self) -> Event {
        match self.events.recv().await {
            Some(event) => self.heard(event),
            None => std::future::pending().await,
        }
    }

    /// Counts an answer awaited in the background as heard.
    fn heard(&self, event: Event) -> Event {
        match event {
            Event::Answered(..) => self.awaiting.set(self.awaiting.get().saturating_sub(1)),
            Event::RunningAsked { .. } => self.running_pending.set(false),
            _ => {}
        }
        event
    }

    /// Waits for `asking`'s answer in the background; it comes as an [`Event::Answered`].
    pub fn await_answer(&self, asking: socket::Asking) {
        let answers = self.answers.clone();
        self.awaiting.set(self.awaiting.get() + 1);
        tokio::spawn(async move {
            let pid = asking.pid;
            let _ = answers.send(Event::Answered(pid, asking.answer().await));
        });
    }

    /// The events not heard of yet, at the session's end: each join sent is followed by
    /// its answer (awaited here), so that the last figures count every process.
    pub async fn drain(&mut self) -> Vec<Event> {
        self.stop_asking_running.store(true, Ordering::Release);
        // The process it asks now is answered meanwhile (or in the copy's own time).
        if let Some(thread) = self.asking_running.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        let mut drained = Vec::new();
        loop {
            let event = match self.events.try_recv() {
                Ok(event) => event,
                // Answers awaited in the background arrive within their own wait.
                Err(_) if self.awaiting.get() > 0 => {
                    match tokio::time::timeout(Duration::from_secs(3), self.events.recv()).await {
                        Ok(Some(event)) => event,
                        _ => break,
                    }
                }
                Err(_) => break,
            };
            match self.heard(event) {
                Event::Sent(asking) => {
                    let pid = asking.pid;
                    drained.push(Event::Answered(pid, asking.answer().await));
                }
                other => drained.push(other),
            }
        }
        drained
    }

    /// `pid` did not join after all: the session's probes count it.
    pub fn declined(&self, pid: u32) {
        if let Ok(mut set) = self.joined.lock() {
            set.remove(&pid);
        }
    }

    /// Removes the entry from the preload list: new programs no longer load the
    /// library. (Done again by [`Self::remove`], which finds it gone.)
    pub fn remove_entry(&self) -> Result<()> {
        self.stop_asking_running.store(true, Ordering::Release);
        entry::remove(&self.list, SYSTEM_LIBRARY)
            .with_context(|| format!("removing {SYSTEM_LIBRARY} from {PRELOAD_LIST}"))
    }

    /// Removes the entry from the preload list (new programs no longer load the
    /// library), stops answering and removes the socket. Joined processes leave by
    /// themselves once heapprofd's pidfd says it has exited.
    pub fn remove(mut self) -> Result<()> {
        self.removed = true;
        let removed = entry::remove(&self.list, SYSTEM_LIBRARY)
            .with_context(|| format!("removing {SYSTEM_LIBRARY} from {PRELOAD_LIST}"));
        self.stop_answering();
        removed
    }

    fn stop_answering(&mut self) {
        self.stop_asking_running.store(true, Ordering::Release);
        if let Some(thread) = self.asking_running.take() {
            let _ = thread.join();
        }
        self.closer.close();
        if let Some(thread) = self.answering.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for SystemPreload {
    /// On an error path: the entry goes all the same.
    fn drop(&mut self) {
        if !self.removed
            && let Err(err) = entry::remove(&self.list, SYSTEM_LIBRARY)
        {
            log::error!("cannot remove {SYSTEM_LIBRARY} from {PRELOAD_LIST}: {err:#}");
        }
        self.stop_answering();
    }
}

/// Whether `pid` was started under another heapprofd's library (launch mode), which
/// is mapped before any program's start asks. (One that cannot be read is asked.)
fn served_by_another_heapprofd(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .is_ok_and(|maps| running::maps_another_library(&maps))
}

/// The answering thread: marks each process that asks as joined (so that the session
/// never probes it meanwhile), has the session read its mappings (waiting at most
/// [`MAPPINGS_WAIT`]), sends its join, and hands the connection to the session, which
/// waits for its answer.
fn answer_all(
    listener: &socket::Listener,
    join: SystemJoin,
    replies: &OwnedFd,
    pidfd: &OwnedFd,
    joined: &JoinedSet,
    events: &mpsc::UnboundedSender<Event>,
) {
    while let Some(asking) = listener.accept() {
        let pid = asking.pid;
        if served_by_another_heapprofd(pid) {
            // Its copy, answered nothing, stays inert: a second set of wrappers would
            // send the first's calls through its own, and each heapprofd would see
            // the other's frames. Its allocator's probes count it here.
            drop(asking);
            let why = anyhow::anyhow!("it runs under another heapprofd's library");
            if events.send(Event::Answered(pid, Err(why))).is_err() {
                return;
            }
            continue;
        }
        if let Ok(mut set) = joined.lock() {
            set.insert(pid);
        }
        let (ready, mappings_read) = std::sync::mpsc::sync_channel(1);
        if events.send(Event::Asking(pid, ready)).is_err() {
            return;
        }
        let _ = mappings_read.recv_timeout(MAPPINGS_WAIT);
        let event = match asking.send(join, replies.as_fd(), pidfd.as_fd()) {
            Ok(()) => Event::Sent(asking),
            Err(err) => Event::Answered(pid, Err(err)),
        };
        if events.send(event).is_err() {
            return;
        }
    }
}
