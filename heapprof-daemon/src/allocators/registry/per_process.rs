//! `--preload system`: the processes the system-wide library joins; and the probes
//! attached for one process alone (each process that library does not serve, and each
//! of a launched command's descendants that its library does not serve), detached
//! when the process joins, execs or exits.

use std::collections::HashSet;

use anyhow::Context as _;
use aya::Ebpf;

use super::AllocatorProbes;
use crate::probes::uprobe;

impl AllocatorProbes {
    /// `--preload system`: the processes the system-wide library joins (its calls are
    /// its), as the answering thread marks them.
    pub fn system_joined(&self) -> crate::system_preload::JoinedSet {
        std::sync::Arc::clone(&self.system_joined)
    }

    /// `--preload system`: leaves `pids` (processes that ran before heapprofd) alone
    /// until their copy of the library asks to join, they exec or exit, or
    /// [`Self::drop_process_probes`] is called for them.
    pub fn await_ask(&mut self, pids: impl IntoIterator<Item = u32>) {
        self.awaiting_ask.extend(pids);
    }

    /// Processes that got probes for themselves alone over the run (`--preload system`).
    pub fn processes_probed_alone(&self) -> u64 {
        self.processes_probed_alone
    }

    /// Processes left alone over the run because they opted out of the system-wide
    /// preload (`--preload system`).
    pub fn processes_opted_out(&self) -> u64 {
        self.opted_out.len() as u64
    }

    /// Processes with probes attached for themselves alone (`--preload system`, and
    /// launch mode's descendants).
    pub fn processes_with_own_probes(&self) -> impl Iterator<Item = u32> + '_ {
        self.process_links.keys().copied()
    }

    /// Forgets processes that have exited: the probes attached for each alone are
    /// detached (their links would otherwise stay until heapprofd exits).
    pub fn forget_processes(&mut self, ebpf: &mut Ebpf, pids: &HashSet<u32>) {
        if let Ok(mut joined) = self.system_joined.lock() {
            joined.retain(|pid| !pids.contains(pid));
        }
        for pid in pids {
            self.drop_process_probes(ebpf, *pid);
        }
    }

    /// Detaches the probes attached for `pid` alone: it joined the system-wide library
    /// (its calls are the library's from now on), or it exec'd (its new image is
    /// looked at afresh; a pid-filtered probe would follow it into the new image). It
    /// is no longer awaiting its ask either (see [`Self::await_ask`]).
    pub fn drop_process_probes(&mut self, ebpf: &mut Ebpf, pid: u32) {
        self.awaiting_ask.remove(&pid);
        let Some(links) = self.process_links.remove(&pid) else {
            return;
        };
        for (program, link) in links {
            let detached = uprobe(ebpf, program).and_then(|p| {
                p.detach(link)
                    .with_context(|| format!("detaching {program} from pid {pid}"))
            });
            if let Err(err) = detached {
                log::debug!("{err:#}");
            }
        }
        self.attached.retain(|(_, only), _| *only != pid);
        self.serving.remove(&pid);
        self.preload_fallbacks.remove(&pid);
    }
}
