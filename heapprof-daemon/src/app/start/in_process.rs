//! `--pid`: joining the running process in-process (heapprofd's library loaded into it
//! by injection, then asked to redirect its allocator calls), or the reason it keeps
//! the allocator's probes.

use std::os::fd::OwnedFd;

use anyhow::{Context as _, Result};

use crate::{
    allocators::AllocatorProbes,
    cli::Cli,
    inject,
    preload::PreloadLibrary,
    session::UserSession,
    stats_file::{JoinedBy, Joining},
};

/// The reason `--pid` uses the allocator's probes when it does not try to inject.
pub(super) fn probes_chosen(cli: &Cli) -> &'static str {
    if cli.stacks_only {
        "--stacks-only (a benchmark baseline)"
    } else if cli.empty_programs {
        "--empty-programs (a benchmark baseline)"
    } else {
        "--inject off"
    }
}

/// `--pid --inject auto`: loads the preload library into the running process and
/// probes it; `None`, with the reason on one line, where it cannot (the process then
/// gets the allocator's probes).
pub(super) fn load_in_process(
    pid: u32,
    ebpf: &mut aya::Ebpf,
    allocators: &mut AllocatorProbes,
    joining: &mut Option<Joining>,
) -> Result<Option<inject::Injection>> {
    let image = crate::preload::injectable_image()?;
    let entries = inject::entries(&image).context("the preload library has no entry points")?;
    let attempt = (|| {
        inject::system::refuse_if_system_joined(pid)?;
        let mut injection = inject::Injection::start(pid)?;
        let file = injection.load(&image, entries)?;
        let library =
            PreloadLibrary::injected(file).map_err(|err| inject::NotJoined(format!("{err:#}")))?;
        allocators
            .add_preload(ebpf, library)
            .map_err(|err| inject::NotJoined(format!("probing its copy: {err:#}")))?;
        Ok(injection)
    })();
    match attempt {
        Ok(injection) => Ok(Some(injection)),
        Err(reason) => {
            *joining = Some(cannot_join(pid, &reason));
            Ok(None)
        }
    }
}

/// Has the loaded library join: it redirects the process's allocator calls to itself.
/// Where it refuses, the library is forgotten and the process gets the probes. Returns
/// how the process was joined.
pub(super) fn join_in_process(
    injection: inject::Injection,
    replies: &OwnedFd,
    session: &mut UserSession,
    sample_rate: u64,
) -> Joining {
    use std::os::fd::AsFd as _;
    let pid = injection.pid();
    match injection.join(replies.as_fd(), sample_rate, inject::Children::Left) {
        Ok(joined) => {
            log::info!(
                "pid {pid}: joined in-process: heapprofd's library serves its allocator \
                 calls ({} slots redirected; they are put back at exit)",
                joined.slots
            );
            session.set_joined(Some(joined));
            Joining {
                pid,
                how: JoinedBy::Injected,
                reason: None,
            }
        }
        Err(reason) => {
            session.probe_instead_of_preload(pid);
            cannot_join(pid, &reason)
        }
    }
}

/// How `pid` is joined where it cannot be joined in-process (said once the session stands).
fn cannot_join(pid: u32, reason: &inject::NotJoined) -> Joining {
    Joining {
        pid,
        how: JoinedBy::Probes,
        reason: Some(reason.to_string()),
    }
}
