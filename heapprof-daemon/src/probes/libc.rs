//! Finding the C library a target uses and its allocator entry points.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use blazesym::inspect::{Inspector, source::Elf, source::Source};
use heapprof_common::AllocKind;

use super::placement::{self, Arch, Placement, PlacementMode};
use crate::procmaps::parse_maps_line;

/// One probed function of the library.
#[derive(Debug, Clone)]
pub struct Function {
    /// File offset of the function's first instruction (the address profiles show).
    pub offset: u64,
    /// Where its probes go, relative to `offset`.
    pub placement: Placement,
}

impl Function {
    /// File offset the probes are attached at.
    pub fn probe_offset(&self) -> u64 {
        self.offset + self.placement.offset
    }
}

/// A C library and where its allocator functions are.
#[derive(Debug, Clone)]
pub struct Libc {
    /// Path this process can open (through `/proc/PID/root` for another process's library).
    pub path: PathBuf,
    /// The path as the target names it, for messages.
    pub display: String,
    /// One entry per distinct address: the first kind found there and its function.
    /// Aliases (glibc's aligned_alloc = memalign) are attached once, under the first name.
    pub allocators: Vec<(AllocKind, Function)>,
    /// Kinds sharing an address with an earlier one, and that one.
    pub aliases: Vec<(AllocKind, AllocKind)>,
    /// `free`.
    pub free: Function,
    /// The library's executable code, as file offsets `[start, end)`: return addresses
    /// in it belong to the allocator's own calls (see the BPF side's call matching).
    pub text: (u64, u64),
}

impl Libc {
    /// The function of `kind` (aliases resolve to their first name).
    fn function(&self, kind: AllocKind) -> Option<&Function> {
        let kind = self
            .aliases
            .iter()
            .find(|(alias, _)| *alias == kind)
            .map_or(kind, |(_, first)| *first);
        self.allocators
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, f)| f)
    }

    /// File offset of the function of `kind` (aliases resolve to their first name).
    pub fn offset_of(&self, kind: AllocKind) -> Option<u64> {
        self.function(kind).map(|f| f.offset)
    }

    /// File offset of the probe spot of `kind`'s function.
    pub fn probe_offset_of(&self, kind: AllocKind) -> Option<u64> {
        self.function(kind).map(Function::probe_offset)
    }
}

/// Longest function body read for probe placement; longer ones are read this far and
/// placed at their entry, since branches beyond it could not be checked.
const MAX_FUNCTION_BYTES: usize = 64 * 1024;

/// Places the probes of the function at file offset `offset` with symbol size `size`.
fn place_probes(
    file: &[u8],
    arch: Option<Arch>,
    offset: u64,
    size: Option<usize>,
    return_probe: bool,
    mode: PlacementMode,
) -> Placement {
    let entry = Placement::entry;
    if mode == PlacementMode::Entry {
        return entry("entry: --probe-placement=entry");
    }
    let Some(arch) = arch else {
        return entry("entry: instruction set not decoded");
    };
    let size = match size {
        Some(size) if size > 0 && size <= MAX_FUNCTION_BYTES => size,
        _ => return entry("entry: the function's size is unknown or too large"),
    };
    let start = usize::try_from(offset).unwrap_or(usize::MAX);
    match file.get(start..start.saturating_add(size)) {
        Some(code) => placement::place(arch, code, return_probe),
        None => entry("entry: the function lies outside the file"),
    }
}

/// Whether a file name looks like a C library (glibc's libc.so.6 / libc-2.x.so, musl's loader).
fn is_libc_name(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.starts_with("libc.so")
        || (name.starts_with("libc-") && name.ends_with(".so"))
        || name.starts_with("ld-musl-")
}

/// The libc mapped by `pid`, opened through the process's own root.
pub fn find_in_process(pid: u32) -> Result<(PathBuf, String)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .with_context(|| format!("reading /proc/{pid}/maps"))?;
    for line in maps.lines().filter_map(|l| parse_maps_line(l).ok()) {
        if line.executable && is_libc_name(&line.path) && !line.path.ends_with(" (deleted)") {
            let open_path = open_mapped(pid, &line)?;
            return Ok((open_path, line.path));
        }
    }
    bail!(
        "process {pid} maps no C library (statically linked?); name the allocator's library with --libc PATH"
    )
}

/// Opens the file of a maps line through the process's root and checks that it is the
/// file mapped there (device and inode): the path is the process's to choose, and a
/// symlink in its root could point anywhere, the host's files included. The file stays
/// open for the daemon's lifetime, and its `/proc/self/fd/N` path, which cannot be
/// swapped any more, is returned for reading and attaching.
pub(crate) fn open_mapped(pid: u32, line: &crate::procmaps::MapsLine) -> Result<PathBuf> {
    use std::os::{fd::IntoRawFd as _, unix::fs::MetadataExt as _};
    let path = format!("/proc/{pid}/root{}", line.path);
    let file = std::fs::File::open(&path).with_context(|| {
        format!("opening the C library of process {pid} ({path}); run heapprofd as root")
    })?;
    let meta = file.metadata().with_context(|| format!("reading {path}"))?;
    let dev = (libc::major(meta.dev()), libc::minor(meta.dev()));
    if (dev, meta.ino()) != (line.dev, line.inode) {
        bail!(
            "{} in process {pid}'s root is not the file mapped as its C library (a replaced \
             file or a planted symlink); pass the library with --libc PATH",
            line.path
        );
    }
    // Deliberately kept open until exit: one descriptor per session.
    let fd = file.into_raw_fd();
    Ok(PathBuf::from(format!("/proc/self/fd/{fd}")))
}

/// The system's C library at its usual places, for a launched command or `--all` when
/// heapprofd itself maps none (a static build, as deployed to boards).
pub fn find_system() -> Result<PathBuf> {
    let triple = format!("{}-linux-gnu", std::env::consts::ARCH);
    let candidates = [
        format!("/lib/{triple}/libc.so.6"),
        format!("/usr/lib/{triple}/libc.so.6"),
        "/lib64/libc.so.6".to_owned(),
        "/usr/lib64/libc.so.6".to_owned(),
        "/lib/libc.so.6".to_owned(),
        "/usr/lib/libc.so.6".to_owned(),
        // musl: the C library is the dynamic loader.
        format!("/lib/ld-musl-{}.so.1", std::env::consts::ARCH),
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|path| path.is_file())
        // The canonical path is the one processes' maps show (/lib is often a symlink).
        .map(|path| std::fs::canonicalize(&path).unwrap_or(path))
        .with_context(|| {
            format!(
                "no C library at the usual places ({}); name it with --libc PATH",
                candidates.join(", ")
            )
        })
}

/// Resolves the allocator symbols of the library at `path` and places their probes.
pub fn resolve(path: &Path, display: &str, mode: PlacementMode) -> Result<Libc> {
    let mut magic = [0u8; 4];
    let read_magic =
        std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic));
    if let Err(err) = read_magic
        && err.kind() != std::io::ErrorKind::UnexpectedEof
    {
        bail!("cannot read C library {display}: {err}; pass an existing library to --libc");
    }
    if &magic != b"\x7fELF" {
        bail!(
            "{display} is not an ELF file; point --libc at the shared C library (e.g. /lib/x86_64-linux-gnu/libc.so.6)"
        );
    }
    let mut names: Vec<&str> = AllocKind::ALL.iter().map(|k| k.symbol()).collect();
    names.push("free");
    let inspector = Inspector::new();
    let mut elf = Elf::new(path);
    // Exported symbols are what we need; blazesym's DWARF path does not fall back to them.
    elf.debug_syms = false;
    let src = Source::Elf(elf);
    let found = inspector
        .lookup(&src, &names)
        .with_context(|| format!("reading the symbols of {display}"))?;
    let symbol = |index: usize| -> Option<(u64, Option<usize>)> {
        found
            .get(index)?
            .iter()
            .find_map(|sym| Some((sym.file_offset?, sym.size)))
    };

    let free_symbol = symbol(names.len() - 1);
    let malloc_symbol = symbol(0);
    let (Some((free_offset, free_size)), Some(_)) = (free_symbol, malloc_symbol) else {
        bail!(
            "{display} has no malloc/free symbols; point --libc at the library that provides the program's allocator"
        );
    };
    let file = std::fs::read(path).with_context(|| format!("reading {display}"))?;
    let arch = Arch::of_elf_header(&file);
    let free = Function {
        offset: free_offset,
        placement: place_probes(&file, arch, free_offset, free_size, false, mode),
    };
    let mut by_offset: HashMap<u64, AllocKind> = HashMap::new();
    let mut allocators = Vec::new();
    let mut aliases = Vec::new();
    for (index, kind) in AllocKind::ALL.iter().enumerate() {
        let Some((offset, size)) = symbol(index) else {
            log::debug!("{display} does not export {}", kind.symbol());
            continue;
        };
        match by_offset.get(&offset) {
            Some(first) => aliases.push((*kind, *first)),
            None => {
                by_offset.insert(offset, *kind);
                let placement = place_probes(&file, arch, offset, size, true, mode);
                allocators.push((*kind, Function { offset, placement }));
            }
        }
    }
    let text = executable_file_range(&file).with_context(|| {
        format!("{display} has no executable segment; point --libc at a shared library")
    })?;
    Ok(Libc {
        path: path.to_owned(),
        display: display.to_owned(),
        allocators,
        aliases,
        free,
        text,
    })
}

/// The file range `[start, end)` covered by the ELF file's executable load segments.
fn executable_file_range(file: &[u8]) -> Option<(u64, u64)> {
    use object::{
        Endianness,
        elf::{PF_X, PT_LOAD},
        read::elf::{ElfFile64, ProgramHeader as _},
    };
    let elf = ElfFile64::<Endianness>::parse(file).ok()?;
    let endian = elf.endian();
    elf.elf_program_headers()
        .iter()
        .filter(|ph| ph.p_type(endian) == PT_LOAD && ph.p_flags(endian).contains(PF_X))
        .map(|ph| {
            let start = ph.p_offset(endian);
            (start, start.saturating_add(ph.p_filesz(endian)))
        })
        .reduce(|(a, b), (c, d)| (a.min(c), b.max(d)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognizes_libc_names() {
        assert!(is_libc_name("/usr/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(is_libc_name("/lib/libc-2.31.so"));
        assert!(is_libc_name("/lib/ld-musl-aarch64.so.1"));
        assert!(!is_libc_name("/usr/lib/libcrypto.so.3"));
        assert!(!is_libc_name("/usr/lib/libcap.so.2"));
    }

    #[test]
    fn resolves_own_libc_with_aliases_attached_once() {
        let (path, _) = find_in_process(std::process::id()).expect("the test binary maps a libc");
        let libc = resolve(&path, "own libc", PlacementMode::Auto).expect("libc resolves");
        let kinds: Vec<_> = libc.allocators.iter().map(|(k, _)| *k).collect();
        assert!(kinds.contains(&AllocKind::Malloc));
        assert!(kinds.contains(&AllocKind::Calloc));
        assert!(kinds.contains(&AllocKind::Realloc));
        let mut offsets: Vec<_> = libc.allocators.iter().map(|(_, f)| f.offset).collect();
        offsets.sort_unstable();
        offsets.dedup();
        assert_eq!(
            offsets.len(),
            libc.allocators.len(),
            "one probe per distinct address"
        );
        assert!(libc.free.offset > 0);
        let (start, end) = libc.text;
        assert!(
            libc.allocators
                .iter()
                .chain([(AllocKind::Malloc, libc.free.clone())].iter())
                .all(|(_, f)| (start..end).contains(&f.probe_offset())),
            "the probed functions lie in the executable range {start:#x}..{end:#x}"
        );
    }

    #[test]
    fn places_probes_within_the_functions_or_at_entry_when_asked() {
        let (path, _) = find_in_process(std::process::id()).expect("the test binary maps a libc");
        let auto = resolve(&path, "own libc", PlacementMode::Auto).expect("libc resolves");
        let entry = resolve(&path, "own libc", PlacementMode::Entry).expect("libc resolves");
        for (kind, function) in &auto.allocators {
            assert!(
                function.placement.offset < 64,
                "{kind:?}: {}",
                function.placement
            );
        }
        assert!(
            entry
                .allocators
                .iter()
                .chain([(AllocKind::Malloc, entry.free.clone())].iter())
                .all(|(_, f)| f.placement.offset == 0 && f.probe_offset() == f.offset)
        );
    }

    #[test]
    fn opens_a_mapped_library_only_if_it_is_the_mapped_file() {
        use std::os::unix::fs::MetadataExt as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let real = dir.path().join("libc.so.6");
        let other = dir.path().join("secret");
        std::fs::write(&real, "library").expect("write");
        std::fs::write(&other, "not for profilers").expect("write");
        let meta = std::fs::metadata(&real).expect("stat");
        let dev = (libc::major(meta.dev()), libc::minor(meta.dev()));
        let line = |path: &Path| crate::procmaps::MapsLine {
            start: 0x1000,
            end: 0x2000,
            executable: true,
            offset: 0,
            dev,
            inode: meta.ino(),
            path: path.display().to_string(),
        };
        let opened = open_mapped(std::process::id(), &line(&real)).expect("the mapped file opens");
        assert_eq!(std::fs::read_to_string(opened).expect("read"), "library");
        // The process's root now has a symlink where its maps name the library.
        std::fs::remove_file(&real).expect("remove");
        std::os::unix::fs::symlink(&other, &real).expect("symlink");
        let err = open_mapped(std::process::id(), &line(&real))
            .expect_err("a planted symlink is refused")
            .to_string();
        assert!(
            err.contains("planted symlink") && err.contains("--libc"),
            "{err}"
        );
    }

    #[test]
    fn rejects_non_elf_and_symbol_less_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let text = dir.path().join("notes.txt");
        std::fs::write(&text, "hello").expect("write");
        let err = resolve(&text, "notes.txt", PlacementMode::Auto)
            .expect_err("text is not a libc")
            .to_string();
        assert!(err.contains("not an ELF"), "{err}");
        let exe = std::env::current_exe().expect("test exe");
        // The test binary is ELF but does not define malloc/free itself.
        let err = resolve(&exe, "test binary", PlacementMode::Auto)
            .expect_err("no malloc")
            .to_string();
        assert!(err.contains("no malloc/free"), "{err}");
    }
}
