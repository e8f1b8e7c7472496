//! `/proc/PID/maps`: parsing, and the file-backed regions of a process.
//!
//! Paths in a maps file are chosen by the process (it can name its mappings), so
//! they are only labels here: the object itself is opened through
//! `/proc/PID/map_files/START-END`, which is the mapped file whatever its name and
//! whichever mount namespace it lives in. The open descriptor keeps the file
//! usable for symbolization after the process has exited.

use std::{
    collections::HashMap,
    fs::File,
    io,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::Arc,
};

use thiserror::Error;

/// One line of a maps file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapsLine {
    /// First address of the region.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// Whether the region is executable.
    pub executable: bool,
    /// Offset in the file of `start`.
    pub offset: u64,
    /// Device (major, minor) of the file.
    pub dev: (u32, u32),
    /// Inode of the file (0 for anonymous memory).
    pub inode: u64,
    /// The path as the kernel prints it (may be empty, `[heap]`, or end in ` (deleted)`).
    pub path: String,
}

/// A maps line that could not be parsed.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("malformed /proc maps line: {0:?}")]
pub struct MapsParseError(pub String);

/// Parses one maps line: `start-end perms offset dev inode   path`.
pub fn parse_maps_line(line: &str) -> Result<MapsLine, MapsParseError> {
    let bad = || MapsParseError(line.to_owned());
    let mut fields = line.splitn(6, ' ');
    let range = fields.next().ok_or_else(bad)?;
    let perms = fields.next().ok_or_else(bad)?;
    let offset = fields.next().ok_or_else(bad)?;
    let dev = fields.next().ok_or_else(bad)?;
    let inode = fields.next().ok_or_else(bad)?;
    let path = fields.next().unwrap_or("").trim_start().to_owned();
    let (start, end) = range.split_once('-').ok_or_else(bad)?;
    let hex = |s: &str| u64::from_str_radix(s, 16).map_err(|_| bad());
    let (start, end) = (hex(start)?, hex(end)?);
    let (major, minor) = dev.split_once(':').ok_or_else(bad)?;
    let hex32 = |s: &str| u32::from_str_radix(s, 16).map_err(|_| bad());
    let dev = (hex32(major)?, hex32(minor)?);
    if end < start || perms.len() != 4 {
        return Err(bad());
    }
    Ok(MapsLine {
        start,
        end,
        executable: perms.as_bytes()[2] == b'x',
        offset: hex(offset)?,
        dev,
        inode: inode.parse().map_err(|_| bad())?,
        path,
    })
}

/// An object file mapped by a traced process, held open.
#[derive(Debug)]
pub struct ObjectFile {
    /// The path the process gave it (a label for the profile, not for opening).
    pub path: String,
    /// GNU build-id as lowercase hex, if the file has one.
    pub build_id: Option<String>,
    /// A path to the open descriptor, valid while this value lives.
    pub open_path: PathBuf,
    /// Device and inode: the file's identity, whatever path names it.
    pub id: (u64, u64),
    _file: File,
}

/// An executable file-backed region of a process.
#[derive(Debug, Clone)]
pub struct Region {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// File offset of `start`.
    pub offset: u64,
    /// The mapped object.
    pub object: Arc<ObjectFile>,
}

impl Region {
    /// The file offset of `addr`, which must lie in the region.
    pub fn file_offset(&self, addr: u64) -> u64 {
        addr - self.start + self.offset
    }

    /// `addr` for people when it has no symbol: `object+0xOFFSET`, the object's file
    /// name and the file offset, which mean the same in every run.
    pub fn describe(&self, addr: u64) -> String {
        let path = &self.object.path;
        let name = path.rsplit('/').next().unwrap_or(path);
        format!("{name}+{:#x}", self.file_offset(addr))
    }
}

/// The executable regions of one process, sorted by address.
#[derive(Debug, Default, Clone)]
pub struct ProcessMaps {
    /// File-backed: sorted, non-overlapping.
    pub regions: Vec<Region>,
    /// Executable memory without a file (JIT code), `(start, end)`, sorted. The
    /// kernel's own (`[vdso]`, `[uprobes]`) are left out.
    pub anonymous_code: Vec<(u64, u64)>,
}

impl ProcessMaps {
    /// The region holding `addr`.
    pub fn find(&self, addr: u64) -> Option<&Region> {
        let index = self.regions.partition_point(|r| r.start <= addr);
        let region = self.regions.get(index.checked_sub(1)?)?;
        (addr < region.end).then_some(region)
    }
}

/// Opens the objects of processes, sharing one descriptor per (device, inode).
#[derive(Debug, Default)]
pub struct ObjectCache {
    objects: HashMap<(u64, u64), Arc<ObjectFile>>,
}

impl ObjectCache {
    /// Reads the executable file-backed regions of `pid`; fails (`ESRCH`) if the process
    /// exits while they are opened.
    pub fn read_process(&mut self, pid: u32) -> io::Result<ProcessMaps> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
        let mut regions = Vec::new();
        let mut anonymous_code = Vec::new();
        for line in text.lines() {
            let Ok(line) = parse_maps_line(line) else {
                log::debug!("pid {pid}: skipping unparsable maps line {line:?}");
                continue;
            };
            if !line.executable || line.path.starts_with('[') {
                continue;
            }
            if line.inode == 0 {
                anonymous_code.push((line.start, line.end));
                continue;
            }
            let map_file = format!("/proc/{pid}/map_files/{:x}-{:x}", line.start, line.end);
            match self.open(Path::new(&map_file), &line.path) {
                Ok(object) => regions.push(Region {
                    start: line.start,
                    end: line.end,
                    offset: line.offset,
                    object,
                }),
                // Gone while being read: what was read is not all it had (a fork's
                // origin may stand in for it, see `session::user::images`).
                Err(err) if err.raw_os_error() == Some(libc::ESRCH) => return Err(err),
                Err(err) => log::debug!("pid {pid}: cannot open {map_file}: {err}"),
            }
        }
        regions.sort_by_key(|r| r.start);
        anonymous_code.sort_unstable();
        Ok(ProcessMaps {
            regions,
            anonymous_code,
        })
    }

    /// Takes out of the cache the objects nothing else holds (no process known
    /// maps them any more) and returns them: they close when dropped.
    pub fn release_unused(&mut self) -> Vec<Arc<ObjectFile>> {
        let unused: Vec<(u64, u64)> = self
            .objects
            .iter()
            .filter(|(_, object)| Arc::strong_count(object) == 1)
            .map(|(key, _)| *key)
            .collect();
        unused
            .iter()
            .filter_map(|key| self.objects.remove(key))
            .collect()
    }

    /// Opens the object at `map_file` (named `label` in profiles), or returns the one
    /// already open with the same device and inode.
    pub fn open(&mut self, map_file: &Path, label: &str) -> io::Result<Arc<ObjectFile>> {
        let file = File::open(map_file)?;
        let meta = file.metadata()?;
        let key = (meta.dev(), meta.ino());
        if let Some(object) = self.objects.get(&key) {
            return Ok(Arc::clone(object));
        }
        let open_path = PathBuf::from(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&file)
        ));
        let build_id = blazesym::helper::read_elf_build_id(&open_path)
            .ok()
            .flatten()
            .map(|id| id.iter().map(|b| format!("{b:02x}")).collect());
        let object = Arc::new(ObjectFile {
            path: label.trim_end_matches(" (deleted)").to_owned(),
            build_id,
            open_path,
            id: key,
            _file: file,
        });
        self.objects.insert(key, Arc::clone(&object));
        Ok(object)
    }
}

/// Reads `/proc/PID/comm` (the process name), or `?` when it is gone.
pub fn process_name(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim_end().to_owned())
        .unwrap_or_else(|_| "?".to_owned())
}

/// The kernel's mark of a process forked and not exec'd since (`PF_FORKNOEXEC`),
/// cleared by an exec once it has replaced the address space.
const PF_FORKNOEXEC: u32 = 0x40;

/// Whether process `pid` is a fork that has not replaced its image by an exec since,
/// or `None` when it is gone. An exec shows its new image in `/proc` (maps, name,
/// executable) before `sched_process_exec` counts it, and clears this mark first.
pub fn forked_without_exec(pid: u32) -> Option<bool> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_flags(&stat).map(|flags| flags & PF_FORKNOEXEC != 0)
}

/// The task's flags: field 9 of `/proc/PID/stat`, counted after the command name,
/// which is in parentheses and may hold spaces and parentheses.
fn parse_flags(stat: &str) -> Option<u32> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // after_comm starts at field 3 (state).
    after_comm.split_whitespace().nth(9 - 3)?.parse().ok()
}

/// The path `pid` was started as, where it differs from its executable's, `exe` (the
/// file a symlink points to, as `/proc/PID/exe` and the maps file give it): `exe`'s
/// directory joined with the process name, when that names the same file. That is
/// what the user ran where a link beside the program gives it another name (Debian's
/// `redis-server` -> `redis-check-rdb`), and the kernel names the process after the
/// path it was started as.
///
/// `None` when the name is the file's own, or names no such file: a name the process
/// gave itself, a name cut short at 15 bytes, a link in another directory.
pub fn started_as(pid: u32, exe: &str, comm: &str) -> Option<String> {
    let candidate = beside(exe, comm)?;
    // Looked up in the process's own root, as `exe` is a path in its mount namespace.
    let linked = std::fs::metadata(format!("/proc/{pid}/root{candidate}")).ok()?;
    let executable = std::fs::metadata(format!("/proc/{pid}/exe")).ok()?;
    ((linked.dev(), linked.ino()) == (executable.dev(), executable.ino())).then_some(candidate)
}

/// `name` in `path`'s directory, when it is another plain file name than `path`'s.
fn beside(path: &str, name: &str) -> Option<String> {
    let (dir, own) = path.rsplit_once('/')?;
    let plain = !name.is_empty() && name != "." && name != ".." && !name.contains('/');
    (plain && name != own).then(|| format!("{dir}/{name}"))
}

/// Whether `exe` is one of valgrind's tools (`/usr/libexec/valgrind/memcheck-amd64-linux`,
/// `.../dhat-arm64-linux`), which run a program's code by translating it.
pub fn is_valgrind_tool(exe: &str) -> bool {
    exe.contains("/valgrind/") && exe.ends_with("-linux")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_name_is_looked_for_beside_the_executable() {
        assert_eq!(
            beside("/usr/bin/redis-check-rdb", "redis-server").as_deref(),
            Some("/usr/bin/redis-server")
        );
        assert_eq!(beside("/usr/bin/redis-server", "redis-server"), None);
        for odd in ["", ".", "..", "a/b"] {
            assert_eq!(beside("/usr/bin/prog", odd), None, "{odd:?}");
        }
        assert_eq!(beside("relative", "name"), None);
    }

    #[test]
    fn a_program_started_through_a_link_beside_it_is_named_as_the_link() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let program = dir.path().join("real-sleep");
        std::fs::copy("/bin/sleep", &program).expect("a copy of sleep");
        let link = dir.path().join("linked-sleep");
        std::os::unix::fs::symlink("real-sleep", &link).expect("a symlink");
        let mut child = std::process::Command::new(&link)
            .arg("30")
            .spawn()
            .expect("sleep started");
        let pid = child.id();
        // exec has happened once /proc/PID/exe names the program, not this test binary.
        let mut exe = String::new();
        for _ in 0..500 {
            exe = std::fs::read_link(format!("/proc/{pid}/exe"))
                .map(|path| path.display().to_string())
                .unwrap_or_default();
            if exe.ends_with("/real-sleep") {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let comm = process_name(pid);
        let named = started_as(pid, &exe, &comm);
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(comm, "linked-sleep");
        assert_eq!(named, Some(link.display().to_string()));
        assert_eq!(started_as(pid, &exe, "real-sleep"), None);
    }

    #[test]
    fn the_flags_are_counted_after_a_name_with_spaces_and_parentheses() {
        let stat = "4242 (a) b (c) S 1 4242 4242 0 -1 4194368 120 0 0 0 0 0 0 0 20 0 1 0";
        assert_eq!(parse_flags(stat), Some(4194368));
        assert_eq!(parse_flags("4242 (short) S 1"), None);
    }

    #[test]
    fn a_fork_is_marked_until_an_exec_replaces_its_image() {
        let mut fds = [0; 2];
        // SAFETY: fds has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "a pipe");
        let program = std::ffi::CString::new("/bin/sleep").expect("a path");
        let seconds = std::ffi::CString::new("30").expect("an argument");
        let argv = [program.as_ptr(), seconds.as_ptr(), std::ptr::null()];
        // SAFETY: the child calls only async-signal-safe functions (read, execv, _exit).
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: as above; the buffer and argv outlive the calls.
            unsafe {
                let mut byte = 0u8;
                libc::read(fds[0], (&raw mut byte).cast(), 1);
                libc::execv(program.as_ptr(), argv.as_ptr());
                libc::_exit(127);
            }
        }
        assert!(pid > 0, "fork failed");
        let forked = forked_without_exec(pid as u32);
        // SAFETY: writes one byte from a live buffer.
        unsafe { libc::write(fds[1], b"x".as_ptr().cast(), 1) };
        // The exec clears the mark before it renames the process.
        for _ in 0..500 {
            if process_name(pid as u32) == "sleep" {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let after_exec = forked_without_exec(pid as u32);
        // SAFETY: the child is this test's; its status is collected.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        assert_eq!(forked, Some(true), "before its exec");
        assert_eq!(after_exec, Some(false), "after its exec");
        assert_eq!(forked_without_exec(pid as u32), None, "gone");
    }

    #[test]
    fn parses_file_backed_and_anonymous_lines() {
        let line = parse_maps_line(
            "7f1c2a428000-7f1c2a5bd000 r-xp 00028000 fe:01 1843213                    /usr/lib/x86_64-linux-gnu/libc.so.6",
        )
        .expect("valid line");
        assert_eq!(line.start, 0x7f1c2a428000);
        assert_eq!(line.end, 0x7f1c2a5bd000);
        assert!(line.executable);
        assert_eq!(line.offset, 0x28000);
        assert_eq!(line.dev, (0xfe, 1));
        assert_eq!(line.inode, 1843213);
        assert_eq!(line.path, "/usr/lib/x86_64-linux-gnu/libc.so.6");

        let anon = parse_maps_line("7ffd1000-7ffd2000 rw-p 00000000 00:00 0").expect("anon line");
        assert!(!anon.executable);
        assert_eq!(anon.path, "");

        let spaces =
            parse_maps_line("1000-2000 r-xp 0 08:01 12 /tmp/a b (deleted)").expect("spaces");
        assert_eq!(spaces.path, "/tmp/a b (deleted)");
    }

    #[test]
    fn rejects_malformed_lines() {
        for bad in [
            "",
            "zz-10 r-xp 0 0 0",
            "10-5 r-xp 0 00:00 0",
            "10-20 rx 0 00:00 0",
            "10-20 r-xp 0 00:00 x",
            "10-20 r-xp 0 0000 1",
        ] {
            assert!(parse_maps_line(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn reads_own_regions_and_finds_addresses() {
        let maps = ObjectCache::default()
            .read_process(std::process::id())
            .expect("own maps");
        let here = reads_own_regions_and_finds_addresses as *const () as u64;
        let region = maps
            .find(here)
            .expect("own code is in an executable region");
        assert!(
            region.object.build_id.is_some(),
            "test binary has a build-id"
        );
        assert!(maps.find(0).is_none());
    }

    #[test]
    fn releases_only_the_objects_nothing_holds() {
        let mut cache = ObjectCache::default();
        let maps = cache.read_process(std::process::id()).expect("own maps");
        assert!(!maps.regions.is_empty());
        assert!(cache.release_unused().is_empty(), "all mapped");
        let count = cache.objects.len();
        drop(maps);
        let released = cache.release_unused();
        assert_eq!(released.len(), count);
        assert!(cache.objects.is_empty());
    }
}
