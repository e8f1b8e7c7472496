//! Launch mode's preload library: the interposer heapprofd puts in the `LD_PRELOAD`
//! of the commands it starts (`--preload auto`).
//!
//! The library (the C interposer in `heapprof-daemon/interposer/`, built by the build
//! script and embedded here) wraps the malloc family and C++'s operators and reports
//! each allocation with one call of its probe site, a 5-byte NOP that Linux 6.18 turns
//! into a call instead of a trap; frees ride along in a per-thread queue, and sampling
//! is decided in the process. See `heapprof_common::preload` for the interface.
//!
//! Each session installs its own copy of the file: uprobes go on a file, so the probe
//! on this copy sees only the processes of this session's command tree (children
//! inherit `LD_PRELOAD`), never those of another heapprofd. The copy is removed when
//! the session ends.

use std::{
    ffi::OsString,
    io::Write as _,
    os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use heapprof_common::preload::{PROBE_SITE_SYMBOL, REPLIES_FD, REPLIES_FD_ENV, SAMPLE_RATE_ENV};
use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};

/// The library, built for the target's architecture.
static LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libheapprofd_preload.so"));

/// The system-wide build of the library (`--preload system`): no allocation function
/// exported, it joins a running heapprofd from its start or stays inert.
static SYSTEM_BUILD: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libheapprofd_system.so"));

/// The library's file name.
const FILE_NAME: &str = "libheapprofd_preload.so";

/// The name of the memfd heapprofd writes the library into when it joins a running
/// process (`crate::inject`).
pub const INJECTED_MEMFD_NAME: &str = "heapprofd-preload";
/// How the process's maps name that copy: `/memfd:NAME (deleted)`.
pub const INJECTED_PATH_PREFIX: &str = "/memfd:heapprofd-preload";

/// Whether `path` is a copy of the library, this session's or another's: a process
/// another heapprofd launched maps it ahead of its allocator, one it joined maps it
/// from a memfd ([`crate::inject`]).
pub fn is_library(path: &str) -> bool {
    std::path::Path::new(path)
        .file_name()
        .is_some_and(|name| name == FILE_NAME)
        || path.starts_with(INJECTED_PATH_PREFIX)
}

/// Whether `path` is any build of heapprofd's interposer: a copy [`is_library`] names,
/// or the system-wide build (`--preload system`) a program started while such a
/// heapprofd ran, whose wrappers call the allocator on the program's behalf. (That
/// build is not [`is_library`]'s: it is in every program, joined or inert.)
pub fn is_interposer(path: &str) -> bool {
    let path = path.strip_suffix(" (deleted)").unwrap_or(path);
    is_library(path)
        || std::path::Path::new(path).file_name()
            == std::path::Path::new(heapprof_common::preload::SYSTEM_LIBRARY).file_name()
}

/// `--preload`: whether launched commands get the interposer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PreloadMode {
    /// Launched commands get the preload library (one cheap probe per allocation);
    /// processes it cannot serve fall back to the allocator's probes.
    Auto,
    /// The allocator's probes only (an entry and a return trap per allocation).
    Off,
    /// `--all`: every dynamic program starting from now on loads heapprofd's library
    /// (from /etc/ld.so.preload, removed at exit) and joins this heapprofd in-process.
    System,
}

/// This session's copy of the library.
#[derive(Debug)]
pub struct PreloadLibrary {
    /// The directory of an installed copy (removed with it); `None` for the copy in
    /// a running process, held open by `_held`.
    dir: Option<PathBuf>,
    path: PathBuf,
    _held: Option<std::fs::File>,
    /// File offset of the probe site.
    pub probe_offset: u64,
    /// File offsets of the wrapped functions, by symbol.
    pub functions: Vec<(String, u64)>,
}

impl PreloadLibrary {
    /// Writes this session's copy of the library, readable by every user (a command
    /// may change its user), in a directory only root can write.
    pub fn install() -> Result<Self> {
        let (probe_offset, functions) = symbol_offsets(LIBRARY)?;
        let dir = session_dir()?;
        let path = dir.join(FILE_NAME);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&path)
            .with_context(|| format!("writing the preload library to {}", path.display()))?;
        file.write_all(LIBRARY)
            .with_context(|| format!("writing the preload library to {}", path.display()))?;
        Ok(Self {
            dir: Some(dir),
            path,
            _held: None,
            probe_offset,
            functions,
        })
    }

    /// `--preload system`: installs the system build at
    /// [`SYSTEM_LIBRARY`](heapprof_common::preload::SYSTEM_LIBRARY) (root-owned, readable
    /// by all). A file already there with the same bytes is kept (processes map it, and
    /// the probe goes on it); another is replaced whole (written beside it, renamed).
    pub fn install_system() -> Result<Self> {
        use heapprof_common::preload::SYSTEM_LIBRARY;
        let (probe_offset, functions) = symbol_offsets(SYSTEM_BUILD)?;
        let path = PathBuf::from(SYSTEM_LIBRARY);
        let context = || format!("installing the system-wide preload library at {SYSTEM_LIBRARY}");
        if std::fs::read(&path).ok().as_deref() != Some(SYSTEM_BUILD) {
            let dir = path.parent().with_context(context)?;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .with_context(context)?;
            let partial = dir.join(format!(".libheapprofd-system.so.{}", std::process::id()));
            let written = (|| {
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o644)
                    .open(&partial)?;
                file.write_all(SYSTEM_BUILD)?;
                file.sync_all()?;
                std::fs::rename(&partial, &path)
            })();
            if written.is_err() {
                let _ = std::fs::remove_file(&partial);
            }
            written.with_context(context)?;
        }
        Ok(Self {
            dir: None,
            path,
            _held: None,
            probe_offset,
            functions,
        })
    }

    /// The copy heapprofd loaded into a running process (`--pid`, see
    /// [`crate::inject`]), known by a descriptor of its file.
    pub fn injected(file: std::fs::File) -> Result<Self> {
        let (probe_offset, functions) = symbol_offsets(LIBRARY)?;
        let path = PathBuf::from(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&file)
        ));
        Ok(Self {
            dir: None,
            path,
            _held: Some(file),
            probe_offset,
            functions,
        })
    }

    /// Where the library is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The environment variables a launched command gets: `LD_PRELOAD` with the
    /// library first (ahead of a preloaded allocator, which it then wraps), and the
    /// sample rate.
    pub fn environment(&self, sample_rate: u64) -> Vec<(OsString, OsString)> {
        let mut preload = OsString::from(&self.path);
        if let Some(existing) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
            preload.push(":");
            preload.push(existing);
        }
        let mut variables = vec![
            ("LD_PRELOAD".into(), preload),
            (REPLIES_FD_ENV.into(), REPLIES_FD.to_string().into()),
        ];
        if sample_rate != 0 {
            variables.push((SAMPLE_RATE_ENV.into(), sample_rate.to_string().into()));
        }
        variables
    }
}

impl Drop for PreloadLibrary {
    fn drop(&mut self) {
        // Processes still running keep their mapping of the deleted file.
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_file(&self.path);
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A new directory for this session: under `/run/heapprofd` when heapprofd may write
/// there (root), else in the temporary directory; created fresh (never an existing
/// one someone else could have prepared).
fn session_dir() -> Result<PathBuf> {
    let id = std::process::id();
    let run = Path::new("/run/heapprofd");
    let parent = if std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(run)
        .is_ok()
    {
        run.to_owned()
    } else {
        std::env::temp_dir()
    };
    for attempt in 0..100u32 {
        let dir = parent.join(format!("preload-{id}-{attempt}"));
        match std::fs::DirBuilder::new().mode(0o755).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(err) => {
                return Err(err).with_context(|| {
                    format!(
                        "creating {} for the preload library (or run with --preload off)",
                        dir.display()
                    )
                });
            }
        }
    }
    bail!(
        "cannot create a directory for the preload library in {}: clean up old \
         preload-{id}-* directories there, or run with --preload off",
        parent.display()
    )
}

/// The symbol heapprofd marks in the copy it injects into a running process.
const INJECTED_MARK_SYMBOL: &str = "heapprofd_injected";

/// The library as heapprofd loads it into a running process: marked so that its
/// constructor leaves the start to `heapprofd_join` (see the interposer's `lifecycle.c`).
pub fn injectable_image() -> Result<Vec<u8>> {
    let file = object::File::parse(LIBRARY).context("reading the embedded preload library")?;
    let symbol = file
        .dynamic_symbols()
        .find(|s| s.name() == Ok(INJECTED_MARK_SYMBOL))
        .context("the embedded preload library has no injection mark")?;
    let offset = file
        .segments()
        .find_map(|segment| {
            let (start, size) = (segment.address(), segment.size());
            let (offset, file_size) = segment.file_range();
            let at = symbol.address();
            (at >= start && at + 4 <= start + size.min(file_size))
                .then(|| (at - start + offset) as usize)
        })
        .context("the preload library's injection mark is not in its file")?;
    let mut image = LIBRARY.to_vec();
    let mark = image
        .get_mut(offset..offset + 4)
        .context("the preload library's injection mark is past its end")?;
    mark.copy_from_slice(b"INJT");
    Ok(image)
}

/// The file offsets of the probe site and of the wrapped functions.
fn symbol_offsets(library: &[u8]) -> Result<(u64, Vec<(String, u64)>)> {
    let file = object::File::parse(library).context("reading the embedded preload library")?;
    let file_offset = |address: u64| {
        file.segments().find_map(|segment| {
            let (start, size) = (segment.address(), segment.size());
            let (offset, _) = segment.file_range();
            (address >= start && address < start + size).then(|| address - start + offset)
        })
    };
    let mut probe = None;
    let mut functions = Vec::new();
    // The system build's wrappers are hidden: found in the symbol table.
    let wrapped = |name: &str| {
        heapprof_common::preload::FUNCTIONS
            .iter()
            .any(|(function, _)| *function == name)
    };
    for symbol in file.symbols() {
        let (Ok(name), Some(offset)) = (symbol.name(), file_offset(symbol.address())) else {
            continue;
        };
        if symbol.is_definition() && wrapped(name) && !functions.iter().any(|(n, _)| n == name) {
            functions.push((name.to_owned(), offset));
        }
    }
    for symbol in file.dynamic_symbols() {
        let (Ok(name), Some(offset)) = (symbol.name(), file_offset(symbol.address())) else {
            continue;
        };
        if name == PROBE_SITE_SYMBOL {
            probe = Some(offset);
        } else if symbol.is_definition() && !functions.iter().any(|(n, _)| n == name) {
            functions.push((name.to_owned(), offset));
        }
    }
    let probe = probe.context("the embedded preload library has no probe site")?;
    Ok((probe, functions))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_library_has_its_probe_site_and_every_wrapped_function() {
        let (probe, functions) = symbol_offsets(LIBRARY).expect("symbols");
        let at = probe as usize;
        let nop5 = [0x0f, 0x1f, 0x44, 0x00, 0x00];
        if cfg!(target_arch = "x86_64") {
            assert_eq!(
                LIBRARY.get(at..at + 5),
                Some(&nop5[..]),
                "the probe site is a NOP5"
            );
        }
        for (name, _) in heapprof_common::preload::FUNCTIONS {
            assert!(
                functions.iter().any(|(n, _)| n == name),
                "{name} is not exported by the preload library"
            );
        }
    }

    #[test]
    fn the_library_needs_only_functions_every_c_library_has() {
        let file = object::File::parse(LIBRARY).expect("ELF");
        // Bound at load: every C library (glibc 2.34+, musl) exports them.
        let required = [
            "__errno_location",
            "close",
            "dl_iterate_phdr",
            "dladdr",
            "dlsym",
            "environ",
            "fcntl",
            "getenv",
            "getpid",
            "memset",
            "mmap",
            "mprotect",
            "poll",
            "recvmsg",
            "pthread_getspecific",
            "pthread_key_create",
            "pthread_setspecific",
            "readlink",
            "strlen",
            "syscall",
            "sysconf",
        ];
        // Weak: one C library has the one, another the other.
        let optional = ["__register_atfork", "pthread_atfork"];
        for symbol in file.dynamic_symbols().filter(|s| s.is_undefined()) {
            let name = symbol.name().expect("name");
            let allowed = if symbol.is_weak() {
                optional.contains(&name)
            } else {
                required.contains(&name)
            };
            assert!(
                name.is_empty() || allowed,
                "the preload library needs {name} (weak: {}), which a C library may not have",
                symbol.is_weak()
            );
        }
    }

    #[test]
    fn the_library_goes_first_in_ld_preload() {
        let library = PreloadLibrary {
            dir: Some(PathBuf::from("/nonexistent")),
            path: PathBuf::from("/nonexistent/lib.so"),
            _held: None,
            probe_offset: 0,
            functions: Vec::new(),
        };
        let environment = library.environment(4096);
        let preload = &environment[0].1;
        assert!(preload.to_string_lossy().starts_with("/nonexistent/lib.so"));
        assert!(
            environment
                .iter()
                .any(|(k, v)| k == SAMPLE_RATE_ENV && v == "4096")
        );
    }
}
