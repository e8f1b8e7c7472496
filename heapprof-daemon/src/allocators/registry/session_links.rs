//! Uprobe session links for sampled sessions: one program at an allocator function's
//! entry and return, whose entry skips the return probe of the calls it does not
//! record (Linux 6.13+; the kernel's first refusal ends the attempts).

use std::{
    os::fd::OwnedFd,
    sync::atomic::{AtomicU8, Ordering},
};

use aya::Ebpf;

use super::{AllocatorProbes, ProbePoints};
use crate::{
    allocators::{api::Family, scan},
    probes::{self, AttachMethod, session},
    procmaps::ObjectFile,
};

/// Whether this process's sampled session attaches through uprobe session links: 0 not
/// tried (exact mode, no multi-uprobe links, nothing attached yet), 1 used, 2 refused by
/// the kernel. Kept here, as [`SINGLE_STEPPED`], for `--stats-json` at exit.
static SESSION_LINKS: AtomicU8 = AtomicU8::new(0);

/// Whether the allocator probes went through uprobe session links: `None` if they were
/// never tried, else whether the kernel took them.
pub fn session_links() -> Option<bool> {
    match SESSION_LINKS.load(Ordering::Relaxed) {
        1 => Some(true),
        2 => Some(false),
        _ => None,
    }
}

/// Whether `function`'s entry may skip the return probe of a call it does not sample
/// (`ProbeSpec::session`): a plain allocation, or a resize (whose entry then skips it
/// only where the live table does not hold the old block), not an out-pointer's (whose
/// block is read at the return) nor an in-place resize's, of a known allocator
/// (an `--allocator` pool gets its chunks from `malloc`, nested deep below its entry),
/// with its return probe at its entry and its symbol's size known (a call nested in an
/// unsampled one is told by its return address in the function's code), on x86-64
/// (arm64's session links are not used: see `ProbeSpec::session`).
pub(super) fn session_eligible(function: &scan::FoundFunction) -> bool {
    use heapprof_common::ProbeRole;
    cfg!(target_arch = "x86_64")
        && match function.signature.role {
            ProbeRole::Alloc => function.signature.out.is_none(),
            ProbeRole::Realloc => true,
            ProbeRole::Free | ProbeRole::ResizeInPlace => false,
        }
        && function.family != Family::Custom
        && function.placement.exits.is_empty()
        && function.placement.sp_adjust == 0
        // The calls nested in an unsampled one are told by the function's extent.
        && function.size.is_some()
}

/// The session program, once tried.
pub(super) enum SessionProgram {
    /// Not needed yet (or not wanted: exact mode, perf events).
    Untried,
    /// Loaded: sampled objects attach through it.
    Loaded(OwnedFd),
    /// The kernel refused it or its link: objects get the entry and return links.
    Refused,
}

impl AllocatorProbes {
    /// Sampled sessions: attaches `points` of `object` through one uprobe session link,
    /// whose entry skips the return probe of the calls it does not record. Returns
    /// whether it did; if not (exact mode, a function whose return probes sit on its
    /// exits, a kernel without session links), the caller attaches the entry and
    /// return links. The kernel's first refusal is logged once and ends the attempts.
    pub(super) fn attach_session(
        &mut self,
        ebpf: &mut Ebpf,
        object: &ObjectFile,
        points: &[ProbePoints],
    ) -> bool {
        if !self.settings.sampled {
            return false;
        }
        if matches!(self.session_program, SessionProgram::Untried) {
            self.session_program = match session::take_prepared() {
                Some(Ok(fd)) => SessionProgram::Loaded(fd),
                Some(Err(refusal)) => {
                    self.session_refused(&refusal.to_string(), refusal.errno);
                    SessionProgram::Refused
                }
                None => SessionProgram::Refused,
            };
        }
        let SessionProgram::Loaded(program) = &self.session_program else {
            return false;
        };
        // Session links are multi-uprobe links (`--attach perf-events` asked for none),
        // and run the return program where the entry's probe is.
        if self.settings.method != AttachMethod::MultiLink
            || points
                .iter()
                .any(|p| !p.returns.is_empty() && p.returns != [p.entry])
        {
            return false;
        }
        if self.session_links.is_empty() {
            // Before the first link: the session program may then take its thread's id
            // from the CPU's cache, which this program keeps true.
            if let Err(err) = probes::cache_thread_on_cpu(ebpf) {
                log::debug!("no per-CPU thread id ({err:#}): the session program asks the kernel");
            }
        }
        let offsets: Vec<u64> = points.iter().map(|p| p.entry).collect();
        let cookies: Vec<u64> = points.iter().map(|p| u64::from(p.slot)).collect();
        let pid = self.settings.pid.unwrap_or(0);
        match session::attach(program, &object.open_path, &offsets, &cookies, pid) {
            Ok(link) => {
                if self.session_links.is_empty() {
                    SESSION_LINKS.store(1, Ordering::Relaxed);
                    log::info!(
                        "uprobe session links: unsampled allocations skip their return probe"
                    );
                }
                self.session_links.push(link);
                self.probes +=
                    points.len() + points.iter().filter(|p| !p.returns.is_empty()).count();
                true
            }
            Err(err) if self.session_links.is_empty() => {
                self.session_refused(
                    &format!("attaching a session link to {}: {err}", object.path),
                    err.raw_os_error(),
                );
                self.session_program = SessionProgram::Refused;
                false
            }
            Err(err) => {
                log::debug!(
                    "{}: no session link ({err}); entry and return links instead",
                    object.path
                );
                false
            }
        }
    }

    /// The kernel refused the session program or its first link: said once.
    fn session_refused(&mut self, why: &str, errno: Option<i32>) {
        SESSION_LINKS.store(2, Ordering::Relaxed);
        let errno = errno.map_or_else(String::new, |e| format!(" (errno {e})"));
        log::info!(
            "uprobe session links unavailable{errno}: unsampled allocations still take their \
             return probe ({why})"
        );
    }
}
