//! The processes that ran before heapprofd (`--all --preload system`): each gets the
//! system-wide library by ptrace (`crate::inject::system`), whose start then asks on the
//! socket as a new program's does. Until its copy has asked, a process is neither
//! probed nor joined (it counts from its join, as if heapprofd had attached then: see
//! `AllocatorProbes::await_ask`). One that cannot be asked is handed back to the
//! probes.

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use tokio::sync::mpsc;

use super::Event;
use crate::{
    inject::{
        Injection,
        system::{SystemAskError, never_asked},
    },
    procmaps::{is_valgrind_tool, parse_maps_line},
};

/// The processes heapprofd asks to join at its start: every process that sees the
/// system-wide library heapprofd installed at `library` (its own mount namespace's
/// file, or the same one bound into it: a container's process sees another) and runs on
/// glibc, except pid 1 (the init system: a stall of it stalls the host), heapprofd
/// itself, valgrind's tools, and processes that already run another copy of
/// heapprofd's library (launched with it, or joined by `--pid`), and processes that
/// opted out ([`super::opt_out`]).
pub fn candidates(library: &str) -> Vec<u32> {
    let own = std::process::id();
    let Some(ours) = file_id(Path::new(library)) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .filter(|pid| *pid != 1 && *pid != own)
        .filter(|pid| {
            file_id(&Path::new(&format!("/proc/{pid}/root")).join(library.trim_start_matches('/')))
                == Some(ours)
        })
        .filter(|pid| maps_allow(*pid) && !super::opt_out::opted_out(*pid))
        .collect();
    pids.sort_unstable();
    pids
}

/// A file's (device, inode).
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Whether `pid`'s mappings make it one to ask: glibc's C library, no other copy of
/// heapprofd's library, not a valgrind tool. (A kernel thread maps nothing.)
fn maps_allow(pid: u32) -> bool {
    if std::fs::read_link(format!("/proc/{pid}/exe"))
        .is_ok_and(|exe| is_valgrind_tool(&exe.to_string_lossy()))
    {
        return false;
    }
    let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
        return false;
    };
    if maps_another_library(&maps) {
        return false;
    }
    maps.lines()
        .filter_map(|l| parse_maps_line(l).ok())
        .any(|line| {
            Path::new(&line.path)
                .file_name()
                .is_some_and(|name| name == "libc.so.6")
        })
}

/// Whether the mappings `maps` (a /proc/PID/maps text) hold a copy of heapprofd's
/// launch or `--pid` library: another heapprofd serves that process's allocator calls.
pub(super) fn maps_another_library(maps: &str) -> bool {
    maps.lines()
        .filter_map(|l| parse_maps_line(l).ok())
        .any(|line| crate::preload::is_library(&line.path))
}

/// The thread that asks each of `pids` in turn, until `stop`; says [`Event::NotAsked`]
/// for each one the socket will never hear from, then [`Event::RunningAsked`].
pub(super) fn ask_all(
    pids: &[u32],
    library: &str,
    stop: &Arc<AtomicBool>,
    events: &mpsc::UnboundedSender<Event>,
) {
    let (mut asked, mut tried) = (0, 0);
    for &pid in pids {
        if stop.load(Ordering::Acquire) {
            break;
        }
        tried += 1;
        let outcome = Injection::start(pid)
            .map_err(SystemAskError::NotAsked)
            .and_then(|injection| injection.ask_system(library));
        let not_asked = match outcome {
            Ok(answer) if never_asked(answer) => Some(
                heapprof_common::preload::JoinRefused::NotAsked
                    .describe()
                    .to_owned(),
            ),
            // Its answer (joined, or why not) reached the socket too.
            Ok(_) => None,
            Err(SystemAskError::NotAsked(reason)) => Some(reason.0),
            Err(SystemAskError::Unknown(reason)) => {
                log::debug!("pid {pid}: asking it to join: {reason}");
                None
            }
        };
        match not_asked {
            Some(reason) => {
                if events.send(Event::NotAsked(pid, reason)).is_err() {
                    return;
                }
            }
            None => asked += 1,
        }
    }
    let _ = events.send(Event::RunningAsked { asked, tried });
}
