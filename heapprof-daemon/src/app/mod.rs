//! The daemon's life: starting a session (checks, C library, load, attach) and
//! running it (profiles on an interval, signals, the target's exit, exec and loader
//! events) until it ends with a final profile.

mod finish;
mod outputs;
mod run;
mod start;

use anyhow::Result;
use aya::maps::{MapData, RingBuf};
use heapprof_common::{ExecEvent, unwind::MappingsRequest};
use tokio::{io::unix::AsyncFd, time::Instant};

pub use self::{
    run::run,
    start::{Started, start},
};
use crate::{
    cli::Target,
    session::{UserSession, kernel::KernelSession},
};

/// A user-space or a kernel session.
pub(crate) enum AnySession {
    User(Box<UserSession>),
    Kernel(Box<KernelSession>),
}

impl AnySession {
    /// User mode: the stack lookups (with `--bpf-stats`) and the unwind tables, for
    /// `--stats-json`.
    fn unwind_figures(
        &self,
    ) -> (
        Option<crate::stats_file::Lookups>,
        Option<crate::unwind::table_upload::TableUsage>,
    ) {
        match self {
            AnySession::User(session) => session.unwind_figures(),
            AnySession::Kernel(_) => (None, None),
        }
    }

    /// `--pid --inject auto`: leaves the process joined in-process; how, for
    /// `--stats-json`.
    fn leave_joined(&mut self) -> Option<crate::stats_file::Leaving> {
        match self {
            AnySession::User(session) => session.leave_joined(),
            AnySession::Kernel(_) => None,
        }
    }

    /// `--preload system`: how the processes were served, for `--stats-json`.
    fn system_figures(&self) -> Option<crate::stats_file::SystemPreloadFigures> {
        match self {
            AnySession::User(session) => Some(session.system_figures()),
            AnySession::Kernel(_) => None,
        }
    }

    fn dump(&mut self) -> Result<crate::session::Written> {
        match self {
            AnySession::User(session) => session.dump(),
            AnySession::Kernel(session) => session.dump(),
        }
    }

    /// Housekeeping on each interval: user mode forgets exited threads and processes.
    /// (Kernel objects outlive the processes that allocated them: nothing to retire.)
    fn tidy(&mut self, target: &Target) {
        if let AnySession::User(session) = self {
            session.remove_exited_threads();
            if matches!(target, Target::All)
                && let Err(err) = session.retire_exited()
            {
                log::warn!("cannot clear exited processes: {err:#}");
            }
        }
    }

    /// User mode: the BPF side's exec notifications, for the event loop to watch.
    fn take_exec_events(&mut self) -> Option<AsyncFd<RingBuf<MapData>>> {
        let AnySession::User(session) = self else {
            return None;
        };
        watch_ring(
            session.take_exec_events()?,
            "execs; images are read on each interval instead",
        )
    }

    /// User mode: the BPF side's requests for mappings, for the event loop to watch.
    fn take_mapping_requests(&mut self) -> Option<AsyncFd<RingBuf<MapData>>> {
        let AnySession::User(session) = self else {
            return None;
        };
        watch_ring(
            session.take_mapping_requests()?,
            "requests for mappings; new objects' unwind tables load on each interval instead",
        )
    }

    fn mappings_requested(&mut self, request: MappingsRequest) {
        if let AnySession::User(session) = self {
            session.mappings_requested(request);
        }
    }

    /// A launched command stopped at a kernel-sent SIGCONT: whether it was the
    /// programs' hold at a loader event (now answered).
    fn loader_hold(&mut self, pid: u32) -> bool {
        match self {
            AnySession::User(session) => session.loader_hold(pid),
            AnySession::Kernel(_) => false,
        }
    }

    /// A launched command is held right after an exec.
    fn exec_hold(&mut self, pid: u32) {
        if let AnySession::User(session) = self {
            session.exec_hold(pid);
        }
    }

    fn exec_seen(&mut self, event: ExecEvent) {
        if let AnySession::User(session) = self {
            session.exec_seen(event);
        }
    }

    fn next_exec_read(&self) -> Option<Instant> {
        match self {
            AnySession::User(session) => session.next_exec_read().map(Instant::from_std),
            AnySession::Kernel(_) => None,
        }
    }

    /// Reads the exec'd images whose time has come; returns those read.
    fn read_due_images(&mut self) -> Vec<crate::session::ImageRead> {
        match self {
            AnySession::User(session) => session.read_due_images(),
            AnySession::Kernel(_) => Vec::new(),
        }
    }

    /// `--preload system`: what the system-wide preload has to say.
    fn system_event(
        &mut self,
        system: &crate::system_preload::SystemPreload,
        event: crate::system_preload::Event,
    ) {
        let AnySession::User(session) = self else {
            return;
        };
        match event {
            crate::system_preload::Event::Asking(pid, ready) => {
                session.system_join_asked(pid);
                let _ = ready.try_send(());
            }
            crate::system_preload::Event::Sent(asking) => system.await_answer(asking),
            crate::system_preload::Event::Answered(pid, answer) => {
                if !session.system_join_answered(pid, &answer) {
                    system.declined(pid);
                    session.probe_unjoined(pid);
                }
            }
            crate::system_preload::Event::NotAsked(pid, reason) => {
                session.system_not_asked(pid, &reason);
                system.declined(pid);
                session.probe_unjoined(pid);
            }
            crate::system_preload::Event::RunningAsked { asked, tried } => {
                session.system_running_asked(asked);
                log::info!(
                    "system-wide preload: {asked} of the {tried} processes running before \
                     heapprofd asked to join; the others get their allocator's probes"
                );
            }
        }
    }

    /// Called while a launched command `pid` is held at its exit.
    fn before_exit(&mut self, pid: Option<u32>) {
        if let AnySession::User(session) = self {
            if let Some(pid) = pid {
                // Its final mappings: an allocator still not seen is not there.
                session.refresh_process(pid);
            }
            if let Err(err) = session.refresh_unmapped() {
                log::warn!("cannot read the exiting process's mappings: {err:#}");
            }
        }
    }
}

/// An event-loop watch on a ring buffer of the BPF side, or `None` (said once) if it
/// cannot be watched.
fn watch_ring(ring: RingBuf<MapData>, what: &str) -> Option<AsyncFd<RingBuf<MapData>>> {
    // SAFETY: the AsyncFd owns the ring buffer, whose descriptor stays open and
    // unchanged until it is dropped.
    match unsafe { AsyncFd::register(ring) } {
        Ok(fd) => Some(fd),
        Err(err) => {
            log::warn!("cannot watch for {what} ({err})");
            None
        }
    }
}
