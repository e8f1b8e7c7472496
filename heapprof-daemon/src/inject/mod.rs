//! `--pid` at launch mode's cost: heapprofd's preload library loaded into a process
//! that is already running (`--inject auto`).
//!
//! A probe on the allocator traps into the kernel at every call; the preload library
//! costs one cheap probe per allocation at a new stack and nothing at a known one
//! (see [`crate::preload`]). A running process never had it in its `LD_PRELOAD`, so
//! heapprofd puts it there itself:
//!
//! 1. One thread of the process waiting in a system call (it holds no allocator,
//!    loader or stdio lock; [`waiting`] picks it) is held with ptrace ([`tracee`]); the
//!    others keep running.
//! 2. On it, heapprofd calls the process's own functions: `memfd_create`, into which
//!    it writes the library (a container's process cannot see heapprofd's files),
//!    then `dlopen` of `/proc/self/fd/N`. A library left by an earlier session is
//!    used again instead.
//! 3. The probe site is probed (by the caller), then the library's `heapprofd_join`
//!    gets the answers' map and heapprofd's pidfd over a socket pair and points the
//!    slots the process calls its allocator through (its objects' GOT) at its
//!    wrappers (`interposer/got.c`).
//! 4. At the end, `heapprofd_leave` puts the slots back. If heapprofd dies first, the
//!    library sees its pidfd readable and leaves by itself.
//!
//! Anything that stops this on the way is a [`NotJoined`] reason, said on one line,
//! and the process gets the allocator's probes as before.

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod regs;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub mod system;

use regs::Guards;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod tracee;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod waiting;

use std::{
    fs::File,
    os::{
        fd::{AsFd, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::fs::MetadataExt as _,
    },
    time::Duration,
};

#[cfg(target_arch = "x86_64")]
use object::ObjectSection as _;
use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};

use heapprof_common::preload::JoinRefused;

use crate::procmaps::parse_maps_line;

/// `--inject`: whether `--pid` loads heapprofd's library into the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum InjectMode {
    /// Load the preload library into the process (ptrace, dlopen) and redirect its
    /// allocator calls there; where it cannot, say why and use the allocator's probes.
    Auto,
    /// The allocator's probes only (an entry and a return trap per allocation).
    Off,
}

/// Why heapprofd did not join a process in-process: one line for the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotJoined(pub String);

impl std::fmt::Display for NotJoined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn not_joined(reason: impl Into<String>) -> NotJoined {
    NotJoined(reason.into())
}

use crate::preload::{
    INJECTED_MEMFD_NAME as MEMFD_NAME, INJECTED_PATH_PREFIX as MEMFD_PATH_PREFIX,
};

/// How long a remote call may take (`dlopen` runs the loader).
const CALL_TIMEOUT: Duration = Duration::from_secs(20);

/// The process's functions heapprofd calls.
#[derive(Debug, Default, Clone, Copy)]
struct Functions {
    dlopen: u64,
    dlerror: u64,
    memfd_create: u64,
    socketpair: u64,
    close: u64,
    mmap: u64,
    munmap: u64,
    /// glibc's `__restore_rt`, the return address of every signal handler installed
    /// through its `sigaction` (0: not found).
    restorer: u64,
}

/// `__restore_rt` on x86-64 glibc: `mov $15, %rax; syscall` (rt_sigreturn).
#[cfg(target_arch = "x86_64")]
const RESTORER_CODE: [u8; 9] = [0x48, 0xc7, 0xc0, 0x0f, 0x00, 0x00, 0x00, 0x0f, 0x05];

/// The library as loaded in the process.
#[derive(Debug, Clone, Copy)]
pub struct LoadedAt {
    /// Where its first byte is mapped.
    pub base: u64,
    /// `heapprofd_join`'s and `heapprofd_leave`'s addresses.
    join: u64,
    leave: u64,
    /// Where the return stub's page is.
    resume_area: Option<u64>,
}

/// The library's entry points, as offsets from its first byte.
#[derive(Debug, Clone, Copy)]
pub struct Entries {
    /// `heapprofd_join`.
    pub join: u64,
    /// `heapprofd_leave`.
    pub leave: u64,
    /// `heapprofd_resume_area`: the page for the return stub (x86-64), if any.
    pub resume_area: Option<u64>,
}

/// A process being joined: one of its threads held until this is dropped.
pub struct Injection {
    pid: u32,
    thread: tracee::Tracee,
    functions: Functions,
    loaded: Option<LoadedAt>,
    /// heapprofd's read-only descriptor of the library's copy in the process, handed to
    /// the library so that an exec takes it along.
    library: Option<File>,
}

/// Whether the forked children of a joined process stay joined (`heapprofd_join`'s
/// flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum Children {
    /// Their calls pass on, unreported: heapprofd traces the process alone (`--pid`).
    Left = 0,
    /// They report as the process does.
    Joined = 1,
}

/// How a joined process was left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Left {
    /// The library put this many slots back.
    SlotsRestored(u64),
    /// The image the library joined is gone (the process exec'd): nothing was called.
    /// A following exec's new image stops by itself once heapprofd has exited.
    Replaced,
}

/// A process the library joined.
#[derive(Debug)]
pub struct Joined {
    pid: u32,
    at: LoadedAt,
    /// The (device, inode) of the library's copy: an exec (or the process's exit and
    /// its pid's reuse) leaves it unmapped there, and nothing is called at `at` then.
    library: Option<(u64, u64)>,
    /// The allocator slots redirected to the library.
    pub slots: u64,
}

impl Injection {
    /// The process.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Holds a thread of `pid` at a safe point and finds the functions heapprofd will
    /// call there.
    pub fn start(pid: u32) -> Result<Self, NotJoined> {
        let functions = find_functions(pid)?;
        let thread = waiting::hold_waiting_thread(pid, functions.restorer)?;
        Ok(Self {
            pid,
            thread,
            functions,
            loaded: None,
            library: None,
        })
    }

    /// Calls into the process return into a stub from now on, so that heapprofd's
    /// death in the middle of one leaves the thread to resume where it was: the stub
    /// goes in the library's own page where the library is loaded, else in a page
    /// mapped for it (the mmap itself is the one call without it).
    fn protect_calls(&mut self) {
        let result = match self.loaded.and_then(|at| at.resume_area) {
            Some(area) => self.thread.stub_in(area),
            None if self.functions.mmap != 0 && self.functions.munmap != 0 => self
                .thread
                .install_stub(self.functions.mmap, self.functions.munmap),
            None => return,
        };
        if let Err(err) = result {
            log::debug!("pid {}: no return stub: {err}", self.pid);
        }
    }

    /// Loads `image` (the library, marked as injected) into the process, or finds the
    /// copy an earlier session loaded; returns a descriptor of the loaded file, on
    /// which the caller puts the probe.
    pub fn load(&mut self, image: &[u8], entries: Entries) -> Result<File, NotJoined> {
        if let Some((file, base)) = loaded_copy(self.pid, image) {
            self.loaded = Some(entries.at(base));
            self.library = reopen_read_only(&file);
            self.protect_calls();
            return Ok(file);
        }
        self.protect_calls();
        let scratch = self.thread.scratch();
        let name = format!("{MEMFD_NAME}\0");
        self.write(scratch, name.as_bytes())?;
        const MFD_CLOEXEC: u64 = 1;
        // From here to its close, heapprofd's death leaves no memfd in the process.
        self.guard(Guards {
            result_is_fd: true,
            ..Guards::NONE
        })?;
        let fd = self.call(self.functions.memfd_create, &[scratch, MFD_CLOEXEC])? as i32;
        if fd < 0 {
            self.guard(Guards::NONE)?;
            return Err(not_joined("memfd_create failed in the process"));
        }
        self.guard(Guards {
            fds: [Some(fd), None],
            ..Guards::NONE
        })?;
        let written = self.write_library(fd, image);
        let file = match written {
            Ok(file) => file,
            Err(err) => {
                self.close_guarded(fd);
                return Err(err);
            }
        };
        let path = format!("/proc/self/fd/{fd}\0");
        self.write(scratch, path.as_bytes())?;
        const RTLD_NOW: u64 = 2;
        let handle = self.call(self.functions.dlopen, &[scratch, RTLD_NOW]);
        self.close_guarded(fd);
        if handle? == 0 {
            return Err(not_joined(format!(
                "dlopen of heapprofd's library failed in the process: {}",
                self.dlerror()
            )));
        }
        let inode = file.metadata().map(|m| (m.dev(), m.ino())).ok();
        let base = inode
            .and_then(|id| mapped_base(self.pid, id))
            .ok_or_else(|| not_joined("heapprofd's library is not in the process's mappings"))?;
        self.loaded = Some(entries.at(base));
        self.library = reopen_read_only(&file);
        // The library's page takes over from the mapped one.
        self.protect_calls();
        Ok(file)
    }

    /// Starts the library: hands it `replies` (the answers' map), heapprofd's pidfd
    /// and its own file, and has it redirect the process's allocator slots. Its forked
    /// children pass their calls on unless `children` says heapprofd traces them too.
    pub fn join(
        mut self,
        replies: BorrowedFd<'_>,
        sample_rate: u64,
        children: Children,
    ) -> Result<Joined, NotJoined> {
        let at = self
            .loaded
            .ok_or_else(|| not_joined("heapprofd's library was not loaded"))?;
        let scratch = self.thread.scratch();
        const AF_UNIX: u64 = 1;
        const SOCK_DGRAM_CLOEXEC: u64 = 2 | 0o2_000_000;
        // From here to their close, heapprofd's death leaves neither end in the process.
        self.write(scratch, &[0xff; 8])?;
        self.guard(Guards {
            pair_at: Some(scratch),
            ..Guards::NONE
        })?;
        let made = self.call(
            self.functions.socketpair,
            &[AF_UNIX, SOCK_DGRAM_CLOEXEC, 0, scratch],
        )? as i32;
        if made != 0 {
            return Err(not_joined("socketpair failed in the process"));
        }
        let mut pair = [0u8; 8];
        self.read(scratch, &mut pair)?;
        let ours = i32::from_le_bytes([pair[0], pair[1], pair[2], pair[3]]);
        let theirs = i32::from_le_bytes([pair[4], pair[5], pair[6], pair[7]]);
        self.guard(Guards {
            fds: [Some(ours), Some(theirs)],
            ..Guards::NONE
        })?;
        let library = self.library.as_ref().map(AsFd::as_fd);
        let sent = send_descriptors(self.pid, ours, replies, library);
        let result = match sent {
            Ok(()) => self.call(at.join, &[theirs as u64, sample_rate, children as u64]),
            Err(err) => Err(err),
        };
        self.close_guarded(ours);
        self.close_guarded(theirs);
        let result = result? as i64;
        if result < 0 {
            return Err(not_joined(match JoinRefused::from_result(result) {
                Some(reason) => reason.describe().to_owned(),
                None => format!("the library refused to join ({result})"),
            }));
        }
        Ok(Joined {
            pid: self.pid,
            at,
            library: self
                .library
                .as_ref()
                .and_then(|file| file.metadata().ok())
                .map(|m| (m.dev(), m.ino())),
            slots: result as u64,
        })
    }

    /// Says which of the process's descriptors the return stub closes if heapprofd
    /// dies from now on.
    fn guard(&mut self, guards: Guards) -> Result<(), NotJoined> {
        self.thread
            .guard(guards)
            .map_err(|err| not_joined(err.to_string()))
    }

    /// Closes the process's descriptor `fd`, first taken off the stub's guards (were
    /// heapprofd to die during the call, the call still closes it, and the stub must
    /// not close the number again: another thread may have it by then).
    fn close_guarded(&mut self, fd: i32) {
        let mut guards = self.thread.guards();
        for slot in &mut guards.fds {
            if *slot == Some(fd) {
                *slot = None;
            }
        }
        if self.guard(guards).is_ok() {
            let _ = self.call(self.functions.close, &[fd as u64]);
        }
    }

    fn call(&mut self, function: u64, args: &[u64]) -> Result<u64, NotJoined> {
        self.thread
            .call(function, args, CALL_TIMEOUT)
            .map_err(|err| not_joined(format!("a call in the process failed: {err}")))
    }

    fn write(&self, address: u64, bytes: &[u8]) -> Result<(), NotJoined> {
        self.thread
            .write(address, bytes)
            .map_err(|err| not_joined(err.to_string()))
    }

    fn read(&self, address: u64, buffer: &mut [u8]) -> Result<(), NotJoined> {
        self.thread
            .read(address, buffer)
            .map_err(|err| not_joined(err.to_string()))
    }

    /// Writes the library into the process's memfd `fd`; returns heapprofd's own
    /// descriptor of it.
    fn write_library(&self, fd: i32, image: &[u8]) -> Result<File, NotJoined> {
        use std::io::Write as _;
        let path = format!("/proc/{}/fd/{fd}", self.pid);
        let mut file = File::options()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|err| not_joined(format!("opening {path}: {err}")))?;
        file.write_all(image)
            .map_err(|err| not_joined(format!("writing heapprofd's library to {path}: {err}")))?;
        Ok(file)
    }

    /// The loader's last error in the process.
    fn dlerror(&mut self) -> String {
        if self.functions.dlerror == 0 {
            return "no dlerror".to_owned();
        }
        let Ok(text) = self.call(self.functions.dlerror, &[]) else {
            return "unknown".to_owned();
        };
        if text == 0 {
            return "unknown".to_owned();
        }
        let mut buffer = vec![0u8; 256];
        if self.read(text, &mut buffer).is_err() {
            return "unknown".to_owned();
        }
        let end = buffer.iter().position(|b| *b == 0).unwrap_or(buffer.len());
        String::from_utf8_lossy(&buffer[..end]).into_owned()
    }
}

impl Entries {
    fn at(self, base: u64) -> LoadedAt {
        LoadedAt {
            base,
            join: base + self.join,
            leave: base + self.leave,
            resume_area: self.resume_area.map(|offset| base + offset),
        }
    }
}

impl Joined {
    /// The joined process.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Has the library put the slots back; returns how many it restored.
    pub fn leave(&self) -> Result<Left, NotJoined> {
        let mut injection = Injection::start(self.pid)?;
        // Checked with a thread held: an exec from now on ends that thread first.
        if self
            .library
            .is_none_or(|id| mapped_base(self.pid, id) != Some(self.at.base))
        {
            return Ok(Left::Replaced);
        }
        injection.loaded = Some(self.at);
        injection.protect_calls();
        injection.call(self.at.leave, &[]).map(Left::SlotsRestored)
    }
}

/// Finds the functions heapprofd calls in the objects `pid` maps (the C library, or
/// libdl for a glibc older than 2.34).
fn find_functions(pid: u32) -> Result<Functions, NotJoined> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(|err| not_joined(format!("reading its maps: {err}")))?;
    let lines: Vec<_> = maps
        .lines()
        .filter_map(|l| parse_maps_line(l).ok())
        .collect();
    if lines
        .iter()
        .any(|l| crate::preload::is_library(&l.path) && !l.path.starts_with(MEMFD_PATH_PREFIX))
    {
        return Err(not_joined(
            "it already runs with heapprofd's preload library from a launch",
        ));
    }
    let mut functions = Functions::default();
    let mut seen = std::collections::HashSet::new();
    for line in &lines {
        let name = line.path.rsplit('/').next().unwrap_or("");
        if !is_c_library(name) || line.offset != 0 || !seen.insert((line.dev, line.inode)) {
            continue;
        }
        let path = format!("/proc/{pid}/map_files/{:x}-{:x}", line.start, line.end);
        let Ok(data) = std::fs::read(&path) else {
            continue;
        };
        let Ok(file) = object::File::parse(&*data) else {
            continue;
        };
        functions.take_from(&file, line.start - lowest_load(&file));
    }
    functions.check()?;
    Ok(functions)
}

/// Whether the object file `name` may hold the functions heapprofd calls: the C
/// library (glibc's or musl's) or libdl.
fn is_c_library(name: &str) -> bool {
    name.starts_with("libc.so")
        || name.starts_with("libc-")
        || name.starts_with("ld-musl")
        || name.starts_with("libdl.so")
}

impl Functions {
    /// Takes the addresses of the functions not found yet from `file`, an object
    /// loaded at `base` (the first object to define a function gives it).
    fn take_from(&mut self, file: &object::File<'_>, base: u64) {
        for symbol in file.dynamic_symbols() {
            let (Ok(name), true) = (symbol.name(), symbol.is_definition()) else {
                continue;
            };
            let name = name.split('@').next().unwrap_or(name);
            let address = base + symbol.address();
            let slot = match name {
                "dlopen" => &mut self.dlopen,
                "dlerror" => &mut self.dlerror,
                "memfd_create" => &mut self.memfd_create,
                "socketpair" => &mut self.socketpair,
                "close" => &mut self.close,
                "mmap" => &mut self.mmap,
                "munmap" => &mut self.munmap,
                _ => continue,
            };
            if *slot == 0 {
                *slot = address;
            }
        }
        #[cfg(target_arch = "x86_64")]
        if self.restorer == 0
            && let Some(text) = file.section_by_name(".text")
            && let Ok(code) = text.data()
            && let Some(at) = code
                .windows(RESTORER_CODE.len())
                .position(|w| w == RESTORER_CODE)
        {
            self.restorer = base + text.address() + at as u64;
        }
    }

    /// Why heapprofd cannot join with the functions found, if a needed one is missing.
    fn check(&self) -> Result<(), NotJoined> {
        if self.close == 0 {
            return Err(not_joined(
                "it maps no C library heapprofd can call (a static program, or Go)",
            ));
        }
        if self.dlopen == 0 {
            return Err(not_joined(
                "its C library has no dlopen (glibc before 2.34 without libdl loaded, or a \
                 static program)",
            ));
        }
        if self.memfd_create == 0 || self.socketpair == 0 {
            return Err(not_joined(
                "its C library lacks memfd_create or socketpair (glibc before 2.27)",
            ));
        }
        Ok(())
    }
}

/// The lowest address an ELF file's loadable segments ask for, page-aligned.
fn lowest_load(file: &object::File<'_>) -> u64 {
    file.segments().map(|s| s.address()).min().unwrap_or(0) & !0xfff
}

/// A copy of the library an earlier session loaded into `pid`, if it is this build's:
/// a descriptor of it and where it starts.
fn loaded_copy(pid: u32, image: &[u8]) -> Option<(File, u64)> {
    mapped_from_start(pid, |line| line.path.starts_with(MEMFD_PATH_PREFIX))
        .into_iter()
        .find_map(|(start, mapped)| {
            let file = File::open(&mapped).ok()?;
            let same = std::fs::read(format!("/proc/self/fd/{}", file.as_raw_fd()))
                .is_ok_and(|bytes| bytes == image);
            same.then_some((file, start))
        })
}

/// The objects `pid` maps from their first byte (file offset 0) that `wanted` picks,
/// in address order: where each starts, and its `/proc/PID/map_files` path, which
/// opens the very file mapped even where its name now names another, or none.
pub(super) fn mapped_from_start(
    pid: u32,
    wanted: impl Fn(&crate::procmaps::MapsLine) -> bool,
) -> Vec<(u64, String)> {
    let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
        return Vec::new();
    };
    maps.lines()
        .filter_map(|l| parse_maps_line(l).ok())
        .filter(|line| line.offset == 0 && wanted(line))
        .map(|line| {
            let mapped = format!("/proc/{pid}/map_files/{:x}-{:x}", line.start, line.end);
            (line.start, mapped)
        })
        .collect()
}

/// A read-only descriptor of the same file (through /proc, which reopens a memfd).
fn reopen_read_only(file: &File) -> Option<File> {
    File::open(format!("/proc/self/fd/{}", file.as_raw_fd())).ok()
}

/// Where the object with (device, inode) `id` starts in `pid`.
fn mapped_base(pid: u32, id: (u64, u64)) -> Option<u64> {
    mapped_from_start(pid, |line| line.inode == id.1)
        .into_iter()
        .find(|(_, mapped)| std::fs::metadata(mapped).is_ok_and(|m| (m.dev(), m.ino()) == id))
        .map(|(start, _)| start)
}

/// Sends the answers' map and heapprofd's own pidfd through the process's socket `fd`
/// (heapprofd takes a copy of it with `pidfd_getfd`).
fn send_descriptors(
    pid: u32,
    fd: i32,
    replies: BorrowedFd<'_>,
    library: Option<BorrowedFd<'_>>,
) -> Result<(), NotJoined> {
    let open_pidfd = |pid: u32| -> Result<OwnedFd, NotJoined> {
        // SAFETY: a plain system call; the result is checked.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(not_joined(format!(
                "pidfd_open: {} (Linux 5.3+ needed)",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: a new descriptor we own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    };
    let target = open_pidfd(pid)?;
    let ours = open_pidfd(std::process::id())?;
    // SAFETY: a plain system call; the result is checked.
    let socket = unsafe { libc::syscall(libc::SYS_pidfd_getfd, target.as_raw_fd(), fd, 0) };
    if socket < 0 {
        return Err(not_joined(format!(
            "pidfd_getfd: {} (Linux 5.6+ needed)",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: a new descriptor we own.
    let socket = unsafe { OwnedFd::from_raw_fd(socket as i32) };
    let mut fds = vec![replies.as_raw_fd(), ours.as_raw_fd()];
    fds.extend(library.map(|fd| fd.as_raw_fd()));
    crate::sys::send_with_descriptors(socket.as_raw_fd(), &[0], &fds, 0)
        .map_err(|err| not_joined(format!("sending descriptors to the process: {err}")))
}

/// The library's entry points in `image`.
pub fn entries(image: &[u8]) -> Option<Entries> {
    let file = object::File::parse(image).ok()?;
    Some(Entries {
        join: symbol_offset(&file, "heapprofd_join")?,
        leave: symbol_offset(&file, "heapprofd_leave")?,
        resume_area: symbol_offset(&file, "heapprofd_resume_area"),
    })
}

/// Where the dynamic symbol `wanted` is, as an offset from the object's first byte.
fn symbol_offset(file: &object::File<'_>, wanted: &str) -> Option<u64> {
    file.dynamic_symbols()
        .find(|s| s.name() == Ok(wanted))
        .map(|s| s.address() - lowest_load(file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_library_has_its_entry_points() {
        let image = crate::preload::injectable_image().expect("image");
        let entries = entries(&image).expect("entries");
        assert!(entries.join > 0 && entries.leave > 0 && entries.join != entries.leave);
    }
}
