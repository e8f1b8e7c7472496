//! Which allocator functions an ELF object defines, where, and where their probes go.

use std::{collections::HashMap, path::Path};

use object::{
    Endianness, Object as _, ObjectSymbol as _, SymbolKind,
    elf::{PF_X, PT_INTERP, PT_LOAD},
    read::elf::{ElfFile64, ProgramHeader as _},
};

use super::{
    api::{self, Family, Signature},
    spec::CustomFunction,
};
use crate::{
    arch::Arch,
    mapped_file::MappedFile,
    placement::{self, Placement, PlacementMode},
};

/// One allocator function of an object.
#[derive(Debug, Clone)]
pub struct FoundFunction {
    /// Its symbol (the lowest-ranked of the names at its address).
    pub name: String,
    /// Where it is probed.
    pub family: Family,
    /// What it does.
    pub signature: Signature,
    /// File offset of its first instruction (the address profiles show).
    pub offset: u64,
    /// Bytes of its code, from its symbol (the largest of its names'), if given.
    pub size: Option<u64>,
    /// How far below its entry its own code moves the stack pointer, if known (x86-64;
    /// see [`super::frame_depth`]).
    pub frame_bytes: Option<u32>,
    /// Where its probes go, relative to `offset`.
    pub placement: Placement,
}

impl FoundFunction {
    /// File offset the probes are attached at.
    pub fn probe_offset(&self) -> u64 {
        self.offset + self.placement.offset
    }

    /// Its code as file offsets `[start, end)`, or `(start, 0)` if its size is unknown.
    pub fn extent(&self) -> (u64, u64) {
        (self.offset, self.size.map_or(0, |size| self.offset + size))
    }
}

/// What an object holds of allocators.
#[derive(Debug, Clone, Default)]
pub struct ObjectScan {
    /// Its allocator functions, one per address: aliases (glibc's `aligned_alloc` and
    /// `memalign`, tcmalloc's `malloc` and `tc_malloc`) are probed once.
    pub functions: Vec<FoundFunction>,
    /// Names sharing an address with a function above: (alias, name probed).
    pub aliases: Vec<(String, String)>,
    /// Calls to `malloc` can bind here: it exports `malloc`, or it is a static
    /// executable whose symbol table defines it.
    pub defines_malloc: bool,
    /// An executable without a dynamic loader: everything it calls is inside.
    pub static_executable: bool,
    /// It has a symbol table beyond the exported symbols (not stripped).
    pub has_symbol_table: bool,
    /// The executable code, as file offsets `[start, end)`.
    pub text: (u64, u64),
}

impl ObjectScan {
    /// The functions of `families`.
    pub fn of_families<'a>(
        &'a self,
        families: &'a [Family],
    ) -> impl Iterator<Item = &'a FoundFunction> + 'a {
        self.functions
            .iter()
            .filter(|f| families.contains(&f.family))
    }
}

/// Why an object could not be scanned.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// The file could not be read.
    #[error("cannot read {0}: {1}")]
    Read(String, std::io::Error),
    /// Not a 64-bit ELF file.
    #[error("{0} is not an ELF file (a 64-bit program or shared library)")]
    NotElf(String),
}

/// A name found at an address: (name, family, signature, rank, symbol size).
type Named = (String, Family, Signature, usize, Option<usize>);

/// Longest function body read for probe placement; longer ones are read this far and
/// placed at their entry, since branches beyond it could not be checked.
const MAX_FUNCTION_BYTES: usize = 64 * 1024;

/// Scans the object at `path` (`display` in messages) for the known allocator
/// functions and the `custom` ones. `executable`: it is a process's program, whose
/// local symbols count too (a static binary's allocator, a Rust program's prefixed
/// jemalloc).
pub fn scan(
    path: &Path,
    display: &str,
    executable: bool,
    custom: &[CustomFunction],
    mode: PlacementMode,
) -> Result<ObjectScan, ScanError> {
    let file = MappedFile::open(path).map_err(|err| ScanError::Read(display.to_owned(), err))?;
    let bytes = file.bytes();
    let elf =
        ElfFile64::<Endianness>::parse(bytes).map_err(|_| ScanError::NotElf(display.to_owned()))?;
    let segments = Segments::of(&elf);
    let static_executable = executable && !segments.interpreted;
    let has_symbol_table = elf.symbols().next().is_some();
    let names = NamesByAddress::collect(&elf, &segments, executable, static_executable, custom);
    let (functions, aliases) = found_functions(bytes, names.by_address, mode);
    Ok(ObjectScan {
        functions,
        aliases,
        defines_malloc: names.defines_malloc,
        static_executable,
        has_symbol_table,
        text: segments.text,
    })
}

/// What an object's program headers say: where its loaded bytes lie in the file,
/// where its code is, and whether it names a dynamic loader.
struct Segments {
    /// Each `PT_LOAD` segment: (virtual address, size in the file, file offset).
    loads: Vec<(u64, u64, u64)>,
    /// The executable code, as file offsets `[start, end)` (`(0, 0)` if none).
    text: (u64, u64),
    /// It has a `PT_INTERP` header: the dynamic loader starts it.
    interpreted: bool,
}

impl Segments {
    /// Reads the program headers of `elf`.
    fn of(elf: &ElfFile64<'_, Endianness>) -> Self {
        let endian = elf.endian();
        let headers = elf.elf_program_headers();
        let loads = headers
            .iter()
            .filter(|ph| ph.p_type(endian) == PT_LOAD)
            .map(|ph| (ph.p_vaddr(endian), ph.p_filesz(endian), ph.p_offset(endian)))
            .collect();
        let text = headers
            .iter()
            .filter(|ph| ph.p_type(endian) == PT_LOAD && ph.p_flags(endian).contains(PF_X))
            .map(|ph| {
                let start = ph.p_offset(endian);
                (start, start.saturating_add(ph.p_filesz(endian)))
            })
            .reduce(|(a, b), (c, d)| (a.min(c), b.max(d)))
            .unwrap_or((0, 0));
        let interpreted = headers.iter().any(|ph| ph.p_type(endian) == PT_INTERP);
        Self {
            loads,
            text,
            interpreted,
        }
    }

    /// The file offset of virtual `address`, if a loaded segment holds it.
    fn file_offset(&self, address: u64) -> Option<u64> {
        self.loads
            .iter()
            .find(|(vaddr, size, _)| (*vaddr..vaddr.saturating_add(*size)).contains(&address))
            .map(|(vaddr, _, offset)| address - vaddr + offset)
    }
}

/// The names an object defines that are probed, grouped by the file offset of their
/// code.
struct NamesByAddress {
    /// Every defined function with a name we probe, by address.
    by_address: HashMap<u64, Vec<Named>>,
    /// Calls to `malloc` can bind here (see [`ObjectScan::defines_malloc`]).
    defines_malloc: bool,
}

impl NamesByAddress {
    /// Reads the symbols of `elf` for the known allocator functions and the `custom`
    /// ones: its exports, and its symbol table when it may hold what is probed.
    fn collect(
        elf: &ElfFile64<'_, Endianness>,
        segments: &Segments,
        executable: bool,
        static_executable: bool,
        custom: &[CustomFunction],
    ) -> Self {
        let mut by_address: HashMap<u64, Vec<Named>> = HashMap::new();
        let mut defines_malloc = false;
        let exported = elf.dynamic_symbols().map(|s| (s, true));
        // A library's calls come through its exports, unless a custom function may be
        // internal to it; a program's own allocator (static, or a Rust program's prefixed
        // jemalloc) is in its symbol table. Skipping the symbol tables of large libraries
        // (hundreds of thousands of symbols in a compiler's) keeps `--all`'s start fast.
        let read_local = executable || !custom.is_empty();
        let local = elf.symbols().take_while(|_| read_local).map(|s| (s, false));
        for (symbol, is_exported) in exported.chain(local) {
            if !symbol.is_definition() || symbol.kind() != SymbolKind::Text {
                continue;
            }
            let Ok(name) = symbol.name() else { continue };
            let Some((family, signature, rank)) =
                probed_as(name, custom, is_exported || static_executable)
            else {
                continue;
            };
            if family == Family::Standard && name == "malloc" {
                defines_malloc = true;
            }
            let Some(offset) = segments.file_offset(symbol.address()) else {
                continue;
            };
            let size = usize::try_from(symbol.size()).ok();
            let names = by_address.entry(offset).or_default();
            if !names.iter().any(|(n, ..)| n == name) {
                names.push((name.to_owned(), family, signature, rank, size));
            }
        }
        Self {
            by_address,
            defines_malloc,
        }
    }
}

/// How a function named `name` is probed, if it is: (family, signature, rank; a
/// custom function ranks first). `bindable`: calls can bind to this definition (it is
/// exported, or in a static executable).
fn probed_as(
    name: &str,
    custom: &[CustomFunction],
    bindable: bool,
) -> Option<(Family, Signature, usize)> {
    match custom.iter().find(|c| c.name == name) {
        Some(custom) => Some((Family::Custom, custom.signature, 0)),
        None => api::known(name).and_then(|known| {
            // A library's local definition of a C name is not what calls bind to.
            let usable = known.family != Family::Standard || bindable;
            usable.then_some((known.family, known.signature, known.rank + 1))
        }),
    }
}

/// One function per address of `by_address`, in file order, each under its
/// lowest-ranked name and with its probes placed; and the other names as aliases
/// (alias, name probed).
fn found_functions(
    bytes: &[u8],
    by_address: HashMap<u64, Vec<Named>>,
    mode: PlacementMode,
) -> (Vec<FoundFunction>, Vec<(String, String)>) {
    let arch = Arch::of_elf_header(bytes);
    let mut functions = Vec::new();
    let mut aliases = Vec::new();
    let mut offsets: Vec<_> = by_address.into_iter().collect();
    offsets.sort_by_key(|(offset, _)| *offset);
    for (offset, mut names) in offsets {
        names.sort_by_key(|(_, _, _, rank, _)| *rank);
        let Some((name, _, signature, _, size)) = names.first().cloned() else {
            continue;
        };
        // Probed wherever any of its names would be: libmimalloc's `malloc` is its
        // `mi_malloc`, which programs call by that name whichever object serves malloc.
        let family = names
            .iter()
            .map(|(_, family, ..)| *family)
            .max()
            .unwrap_or(Family::Standard);
        for (alias, ..) in names.iter().skip(1) {
            aliases.push((alias.clone(), name.clone()));
        }
        let placement = place(bytes, arch, offset, size, signature, mode);
        let size = names
            .iter()
            .filter_map(|(.., size)| *size)
            .max()
            .filter(|&size| size > 0)
            .map(|size| size as u64);
        functions.push(FoundFunction {
            name,
            family,
            signature,
            offset,
            size,
            frame_bytes: frame_bytes(bytes, arch, offset, size),
            placement,
        });
    }
    (functions, aliases)
}

/// How far below its entry the function at `offset` of `size` bytes moves the stack
/// pointer, where its code can be read and decoded (x86-64, up to
/// [`MAX_FUNCTION_BYTES`]).
fn frame_bytes(bytes: &[u8], arch: Option<Arch>, offset: u64, size: Option<u64>) -> Option<u32> {
    match (arch, size) {
        (Some(Arch::X86_64), Some(size)) if size as usize <= MAX_FUNCTION_BYTES => {
            usize::try_from(offset)
                .ok()
                .and_then(|start| bytes.get(start..start.checked_add(size as usize)?))
                .and_then(super::frame_depth::x86_frame_bytes)
        }
        _ => None,
    }
}

/// Places the probes of the function at file offset `offset` with symbol size `size`.
fn place(
    file: &[u8],
    arch: Option<Arch>,
    offset: u64,
    size: Option<usize>,
    signature: Signature,
    mode: PlacementMode,
) -> Placement {
    // An object of an instruction set we do not decode cannot run here: it is given
    // the host's registers, and its entry.
    let decoded = arch.is_some();
    let arch = arch.unwrap_or(Arch::HOST);
    let start = usize::try_from(offset).unwrap_or(usize::MAX);
    let needs = signature.needs();
    let known_size = size.filter(|&size| size > 0 && size <= MAX_FUNCTION_BYTES);
    // The function's bytes, or at least its first instruction's, to tell whether the
    // kernel emulates it.
    let code = file
        .get(start..)
        .map(|rest| &rest[..rest.len().min(known_size.unwrap_or(16))])
        .unwrap_or_default();
    let entry = |reason: &str| Placement::entry(arch, code, needs, reason);
    if mode == PlacementMode::Entry {
        return entry("entry: --probe-placement=entry");
    }
    if !decoded {
        return entry("entry: instruction set not decoded");
    }
    if known_size.is_none() {
        return entry("entry: the function's size is unknown or too large");
    }
    if code.len() < known_size.unwrap_or(0) {
        return entry("entry: the function lies outside the file");
    }
    placement::place(arch, code, needs, signature.role.returns_a_block())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own_libc() -> std::path::PathBuf {
        let (path, _) = crate::probes::libc::find_in_process(std::process::id())
            .expect("the test binary maps a libc");
        path
    }

    #[test]
    fn finds_the_c_library_functions_once_per_address() {
        let scan = scan(&own_libc(), "libc", false, &[], PlacementMode::Auto).expect("scan");
        assert!(scan.defines_malloc);
        assert!(!scan.static_executable);
        let names: Vec<&str> = scan.functions.iter().map(|f| f.name.as_str()).collect();
        for name in ["malloc", "calloc", "realloc", "free", "posix_memalign"] {
            assert!(names.contains(&name), "{name} in {names:?}");
        }
        let mut offsets: Vec<u64> = scan.functions.iter().map(|f| f.offset).collect();
        offsets.sort_unstable();
        offsets.dedup();
        assert_eq!(offsets.len(), scan.functions.len(), "one probe per address");
        let (start, end) = scan.text;
        assert!(
            scan.functions
                .iter()
                .all(|f| (start..end).contains(&f.probe_offset()))
        );
        // glibc's aligned_alloc is memalign: traced once, under the first name.
        assert!(
            scan.aliases
                .iter()
                .any(|(alias, name)| alias == "memalign" && name == "aligned_alloc"),
            "{:?}",
            scan.aliases
        );
    }

    #[test]
    fn a_program_without_an_allocator_defines_none() {
        let exe = std::env::current_exe().expect("test exe");
        let scan = scan(&exe, "test", true, &[], PlacementMode::Auto).expect("scan");
        assert!(!scan.defines_malloc);
        assert!(
            scan.of_families(&[Family::Standard, Family::Vendor])
                .next()
                .is_none(),
            "{:?}",
            scan.functions
        );
    }

    #[test]
    fn custom_functions_are_found_in_any_object() {
        let custom = [CustomFunction {
            name: "strdup".into(),
            signature: Signature::alloc(0),
        }];
        let scan = scan(&own_libc(), "libc", false, &custom, PlacementMode::Entry).expect("scan");
        let strdup = scan
            .of_families(&[Family::Custom])
            .next()
            .expect("strdup found");
        assert_eq!(strdup.name, "strdup");
        assert_eq!(strdup.placement.offset, 0);
    }

    #[test]
    fn refuses_files_that_are_not_elf() {
        let dir = tempfile::tempdir().expect("tempdir");
        let text = dir.path().join("notes.txt");
        std::fs::write(&text, "hello").expect("write");
        let err = scan(&text, "notes.txt", false, &[], PlacementMode::Auto).expect_err("not ELF");
        assert!(err.to_string().contains("is not an ELF file"), "{err}");
    }
}
