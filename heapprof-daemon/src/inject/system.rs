//! `--all --preload system` for the processes that ran before heapprofd: the
//! system-wide library (the copy new programs get from `/etc/ld.so.preload`) loaded
//! into each by ptrace, from its path. Its start asks heapprofd on the socket, as a new
//! program's does, and the join follows the same road (see `crate::system_preload`).
//!
//! A copy already mapped (loaded while an earlier heapprofd ran, or while a killed
//! one's entry stayed) is asked again instead of loaded. Only processes in heapprofd's
//! mount namespace are asked: the path is heapprofd's.

use heapprof_common::preload::JoinRefused;

use super::{Injection, NotJoined, mapped_from_start, not_joined, symbol_offset};

/// Why a process that ran before heapprofd was not asked to join.
#[derive(Debug)]
pub enum SystemAskError {
    /// It was not: nothing reached the socket, and its allocator's probes must count it.
    NotAsked(NotJoined),
    /// A call in it failed after its copy may have asked (it exited or exec'd, most
    /// likely): the socket's answer, if one came, says what happened.
    Unknown(NotJoined),
}

impl Injection {
    /// Has the system-wide library at `path` ask heapprofd to join: loads it (`dlopen`
    /// of the path) unless a copy is mapped already, which is asked again. Returns the
    /// copy's answer: the slots redirected, or a [`JoinRefused`] code.
    pub fn ask_system(mut self, path: &str) -> Result<i64, SystemAskError> {
        let (base, ask, resume_area, again) = match mapped_copy(self.pid, path) {
            Some((base, image)) => {
                let (ask, resume_area) = ask_entry(&image).map_err(SystemAskError::NotAsked)?;
                (base, ask, resume_area, true)
            }
            None => {
                let image = std::fs::read(path).map_err(|err| {
                    SystemAskError::NotAsked(not_joined(format!("reading {path}: {err}")))
                })?;
                let (ask, resume_area) = ask_entry(&image).map_err(SystemAskError::NotAsked)?;
                let base = self.dlopen_system(path)?;
                (base, ask, resume_area, false)
            }
        };
        if let Some(area) = resume_area
            && let Err(err) = self.thread.stub_in(base + area)
        {
            log::debug!("pid {}: no return stub: {err}", self.pid);
        }
        let asked = self.call(base + ask, &[u64::from(again)]);
        let answer = asked.map_err(|err| {
            // A copy asked again may have asked before failing; a fresh one did in dlopen.
            SystemAskError::Unknown(err)
        })? as i64;
        Ok(answer)
    }

    /// Loads the library at `path` into the process; returns where it starts. Its
    /// start asks heapprofd to join, inside the `dlopen`.
    fn dlopen_system(&mut self, path: &str) -> Result<u64, SystemAskError> {
        self.protect_calls();
        let scratch = self.thread.scratch();
        let mut name = path.as_bytes().to_vec();
        name.push(0);
        self.write(scratch, &name)
            .map_err(SystemAskError::NotAsked)?;
        const RTLD_NOW: u64 = 2;
        let handle = self
            .call(self.functions.dlopen, &[scratch, RTLD_NOW])
            .map_err(SystemAskError::Unknown)?;
        if handle == 0 {
            return Err(SystemAskError::NotAsked(not_joined(format!(
                "dlopen of {path} failed in the process: {}",
                self.dlerror()
            ))));
        }
        // No copy was mapped before the dlopen (see `ask_system`), so one found now is
        // the one it loaded, whose start asked. None found: the dlopen gave back a copy
        // already loaded that `mapped_copy` did not recognize, whose start ran long ago
        // and asked nothing, so the probes must count the process.
        mapped_copy(self.pid, path)
            .map(|(base, _)| base)
            .ok_or_else(|| {
                SystemAskError::NotAsked(not_joined(format!(
                    "{path} is not in its mappings after its dlopen"
                )))
            })
    }
}

/// `heapprofd_system_ask`'s and the resume area's offsets in the library `image`.
fn ask_entry(image: &[u8]) -> Result<(u64, Option<u64>), NotJoined> {
    let file = object::File::parse(image)
        .map_err(|err| not_joined(format!("the system-wide library: {err}")))?;
    let ask = symbol_offset(&file, "heapprofd_system_ask").ok_or_else(|| {
        not_joined("its copy of the system-wide library has no heapprofd_system_ask (an older heapprofd's)")
    })?;
    Ok((ask, symbol_offset(&file, "heapprofd_resume_area")))
}

/// A copy of the library at `path` that `pid` maps already (the file may have been
/// replaced since: its own bytes, read through `map_files`, give its entries): where it
/// starts, and its bytes.
///
/// A copy is recognized by its file name, which is heapprofd's own: not by the whole
/// path, which `/proc/PID/maps` shows otherwise under nested overlay mounts (seen:
/// `/heapprofd-preload/libheapprofd-system.so` for a file opened as
/// `/var/lib/heapprofd-preload/libheapprofd-system.so`, in a private mount namespace
/// whose `/var/lib` is an overlay upon another), nor by device and inode, which are
/// the lower file system's there. A copy missed that way was never asked again, and
/// its process was neither joined nor probed.
fn mapped_copy(pid: u32, path: &str) -> Option<(u64, Vec<u8>)> {
    let name = std::path::Path::new(path).file_name()?.to_str()?;
    mapped_from_start(pid, |line| names_copy(&line.path, name))
        .into_iter()
        .find_map(|(start, mapped)| std::fs::read(mapped).ok().map(|image| (start, image)))
}

/// Refuses a `--pid` join of a process whose copy of the system-wide build is joined to
/// a heapprofd (`--all --preload system`): its allocator calls already go through that
/// copy's wrappers, whose GOT slots a second library would find moved (and a heapprofd
/// killed with both in the process could leave it hung). Its allocator's probes count
/// it instead. A joined copy holds that heapprofd's answers' map (a BPF map) open; an
/// inert one (no heapprofd ran, or a killed one left the entry) holds nothing.
pub fn refuse_if_system_joined(pid: u32) -> Result<(), NotJoined> {
    let name = std::path::Path::new(heapprof_common::preload::SYSTEM_LIBRARY)
        .file_name()
        .and_then(|name| name.to_str())
        .unwrap_or_default();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let mapped = maps
        .lines()
        .filter_map(|line| crate::procmaps::parse_maps_line(line).ok())
        .any(|line| names_copy(&line.path, name));
    let holds_bpf_map = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|to| to == *"anon_inode:bpf-map"))
    };
    if mapped && holds_bpf_map() {
        return Err(not_joined(
            "the system-wide preload's library serves it already (a heapprofd --all \
             --preload system joined it)",
        ));
    }
    Ok(())
}

/// Whether a mapping's path (as `/proc/PID/maps` shows it) is a file named `name`,
/// there or deleted.
fn names_copy(mapped: &str, name: &str) -> bool {
    let mapped = mapped.strip_suffix(" (deleted)").unwrap_or(mapped);
    mapped.starts_with('/')
        && std::path::Path::new(mapped)
            .file_name()
            .is_some_and(|file| file == name)
}

impl SystemAskError {
    /// The reason, for the log.
    pub fn reason(&self) -> &NotJoined {
        match self {
            SystemAskError::NotAsked(reason) | SystemAskError::Unknown(reason) => reason,
        }
    }
}

/// Whether a copy's answer to `heapprofd_system_ask` means heapprofd's socket never
/// heard of it (so its allocator's probes must count it).
pub fn never_asked(answer: i64) -> bool {
    JoinRefused::from_result(answer) == Some(JoinRefused::NotAsked)
}

#[cfg(test)]
mod tests {
    use super::names_copy;

    #[test]
    fn a_copy_is_known_by_its_file_name_wherever_maps_shows_it() {
        let name = "libheapprofd-system.so";
        for mapped in [
            "/var/lib/heapprofd-preload/libheapprofd-system.so",
            "/heapprofd-preload/libheapprofd-system.so",
            "/var/lib/heapprofd-preload/libheapprofd-system.so (deleted)",
        ] {
            assert!(names_copy(mapped, name), "{mapped}");
        }
        for mapped in [
            "/var/lib/heapprofd-preload/libheapprofd-system.so.1",
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
            "[heap]",
            "libheapprofd-system.so",
        ] {
            assert!(!names_copy(mapped, name), "{mapped}");
        }
    }
}
