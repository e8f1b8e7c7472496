//! Addresses of traced processes to functions, files and lines (blazesym).
//!
//! An address is first normalized to (object file, file offset) with the process's
//! cached mappings; symbolization works on the object file, so its results are
//! cached across dumps and shared between processes mapping the same file, and it
//! keeps working after the process has exited.

pub mod kallsyms;

use std::{collections::HashMap, sync::Arc};

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer as Blazesym,
    source::{Elf, Source},
};

use crate::procmaps::{ObjectFile, Region};

/// One source-level frame; an address yields several when functions were inlined.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// Function name (demangled).
    pub function: String,
    /// Source file, when debug information has it.
    pub file: Option<String>,
    /// Line number, or 0.
    pub line: u32,
}

/// Frames of one address, innermost inlined function first, the containing function last.
pub type Frames = Arc<[Frame]>;

/// Directories holding separate debug files by build-id (`.build-id/xx/yyyy.debug`),
/// as GDB looks them up; blazesym itself consults them only to resolve a
/// `.gnu_debuglink`, which a plainly stripped file lacks.
const DEBUG_DIRS: [&str; 2] = ["/usr/lib/debug", "/lib/debug"];

/// How an object is symbolized: itself, by file offset; or its separate debug file,
/// by virtual address (a debug file's sections are not where the object's are).
#[derive(Debug, Clone)]
enum SymbolSource {
    Object,
    DebugFile {
        path: std::path::PathBuf,
        /// `(file offset, size, virtual address)` of the object's loadable segments.
        segments: Vec<(u64, u64, u64)>,
    },
}

/// Caches symbolization per (object, file offset).
pub struct Symbolizer {
    blazesym: Blazesym,
    cache: HashMap<(usize, u64), Frames>,
    sources: HashMap<usize, SymbolSource>,
}

impl Default for Symbolizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Symbolizer {
    /// A symbolizer with code info and inlined functions enabled.
    pub fn new() -> Self {
        Self {
            blazesym: new_blazesym(),
            cache: HashMap::new(),
            sources: HashMap::new(),
        }
    }

    /// Lets go of blazesym's parsed files (symbol tables, inflated DWARF sections),
    /// keeping the frames found: only addresses not seen yet open a file again. A
    /// C library's compressed debug file alone took 10 MiB inflated, kept for nothing
    /// once every frame in it was cached.
    pub fn release_parsed_files(&mut self) {
        self.blazesym = new_blazesym();
    }

    /// Where `object`'s symbols come from: its debug file by build-id, if one is
    /// installed, else the object itself (with its own symbols, DWARF and debug link).
    fn source_of(&mut self, object: &ObjectFile) -> SymbolSource {
        let key = object as *const ObjectFile as usize;
        if let Some(source) = self.sources.get(&key) {
            return source.clone();
        }
        let source = object
            .build_id
            .as_deref()
            .filter(|id| id.len() > 2)
            .and_then(|id| {
                DEBUG_DIRS
                    .iter()
                    .map(|dir| {
                        std::path::Path::new(dir)
                            .join(".build-id")
                            .join(&id[..2])
                            .join(format!("{}.debug", &id[2..]))
                    })
                    .find(|path| path.is_file())
            })
            .and_then(|path| {
                let segments = loadable_segments(&object.open_path)?;
                log::debug!("{}: symbols from {}", object.path, path.display());
                Some(SymbolSource::DebugFile { path, segments })
            })
            .unwrap_or(SymbolSource::Object);
        self.sources.insert(key, source.clone());
        source
    }

    /// Symbolizes the given file offsets of one object, filling the cache.
    pub fn prefetch(&mut self, object: &Arc<ObjectFile>, offsets: &[u64]) {
        let id = Arc::as_ptr(object) as usize;
        let missing: Vec<u64> = offsets
            .iter()
            .copied()
            .filter(|o| !self.cache.contains_key(&(id, *o)))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        if missing.is_empty() {
            return;
        }
        let symbolized = match self.source_of(object) {
            SymbolSource::Object => self.blazesym.symbolize(
                &Source::Elf(Elf::new(&object.open_path)),
                Input::FileOffset(&missing),
            ),
            SymbolSource::DebugFile { path, segments } => {
                // An offset outside every segment maps to 0, which has no symbol.
                let addresses: Vec<u64> = missing
                    .iter()
                    .map(|&offset| {
                        segments
                            .iter()
                            .find(|(start, size, _)| (*start..start + size).contains(&offset))
                            .map_or(0, |(start, _, vaddr)| vaddr + (offset - start))
                    })
                    .collect();
                self.blazesym
                    .symbolize(&Source::Elf(Elf::new(&path)), Input::VirtOffset(&addresses))
            }
        };
        let results = match symbolized {
            Ok(results) => results,
            Err(err) => {
                log::debug!("cannot symbolize {}: {err:#}", object.path);
                Vec::new()
            }
        };
        for (index, offset) in missing.iter().enumerate() {
            let frames: Frames = match results.get(index) {
                Some(Symbolized::Sym(sym)) => {
                    let mut frames = Vec::with_capacity(1 + sym.inlined.len());
                    for inlined in sym.inlined.iter().rev() {
                        frames.push(frame(&inlined.name, inlined.code_info.as_ref()));
                    }
                    frames.push(frame(&sym.name, sym.code_info.as_deref()));
                    frames.into()
                }
                _ => Arc::from(Vec::new()),
            };
            self.cache.insert((id, *offset), frames);
        }
    }

    /// Drops everything cached of `objects`, which are about to close: their cached
    /// frames (keyed by the object's address, which a new object may take) and
    /// blazesym's parsed files.
    pub fn forget_objects(&mut self, objects: &[Arc<ObjectFile>]) {
        if objects.is_empty() {
            return;
        }
        let ids: std::collections::HashSet<usize> =
            objects.iter().map(|o| Arc::as_ptr(o) as usize).collect();
        self.cache.retain(|(id, _), _| !ids.contains(id));
        let mut paths: Vec<std::path::PathBuf> =
            objects.iter().map(|o| o.open_path.clone()).collect();
        for id in &ids {
            if let Some(SymbolSource::DebugFile { path, .. }) = self.sources.remove(id) {
                paths.push(path);
            }
        }
        // A debug file another object still uses stays.
        let in_use: std::collections::HashSet<&std::path::Path> = self
            .sources
            .values()
            .filter_map(|source| match source {
                SymbolSource::DebugFile { path, .. } => Some(path.as_path()),
                SymbolSource::Object => None,
            })
            .collect();
        for path in paths.iter().filter(|p| !in_use.contains(p.as_path())) {
            let evict = blazesym::symbolize::evict::Elf::new(path);
            if let Err(err) = self.blazesym.evict(&evict.into()) {
                log::debug!("cannot release the symbols of {}: {err}", path.display());
            }
        }
    }

    /// Frames for a file offset in `region`'s object (empty when unknown).
    pub fn frames(&mut self, region: &Region, file_offset: u64) -> Frames {
        let id = Arc::as_ptr(&region.object) as usize;
        if let Some(frames) = self.cache.get(&(id, file_offset)) {
            return Arc::clone(frames);
        }
        self.prefetch(&region.object, &[file_offset]);
        self.cache
            .get(&(id, file_offset))
            .cloned()
            .unwrap_or_else(|| Arc::from(Vec::new()))
    }
}

fn new_blazesym() -> Blazesym {
    Blazesym::builder()
        .enable_code_info(true)
        .enable_inlined_fns(true)
        // blazesym would demangle every name, and short C names are valid Itanium
        // type codes (`a` -> "signed char"); see `demangle`.
        .enable_demangling(false)
        .build()
}

/// `(file offset, size in the file, virtual address)` of an ELF file's `PT_LOAD`s.
/// The program headers are near the start of the file: only that much is read.
fn loadable_segments(path: &std::path::Path) -> Option<Vec<(u64, u64, u64)>> {
    use std::io::Read as _;

    use object::{
        Endianness,
        elf::{FileHeader64, PT_LOAD},
        read::elf::{FileHeader as _, ProgramHeader as _},
    };
    let mut head = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(64 << 10)
        .read_to_end(&mut head)
        .ok()?;
    let header = FileHeader64::<Endianness>::parse(head.as_slice()).ok()?;
    let endian = header.endian().ok()?;
    Some(
        header
            .program_headers(endian, head.as_slice())
            .ok()?
            .iter()
            .filter(|ph| ph.p_type(endian) == PT_LOAD)
            .map(|ph| (ph.p_offset(endian), ph.p_filesz(endian), ph.p_vaddr(endian)))
            .collect(),
    )
}

fn frame(name: &str, code_info: Option<&blazesym::symbolize::CodeInfo<'_>>) -> Frame {
    let (file, line) = match code_info {
        Some(info) => {
            let path = info.to_path();
            (Some(path.display().to_string()), info.line.unwrap_or(0))
        }
        None => (None, 0),
    };
    Frame {
        function: demangle(name),
        file,
        line,
    }
}

/// Demangles Rust and C++ symbol names; anything else (C) is kept as it is.
pub fn demangle(name: &str) -> String {
    if (name.starts_with("_R") || name.starts_with("_ZN"))
        && let Ok(demangled) = rustc_demangle::try_demangle(name)
    {
        return format!("{demangled:#}");
    }
    if name.starts_with("_Z")
        && let Ok(symbol) = cpp_demangle::Symbol::new(name)
        && let Ok(demangled) = symbol.demangle(&cpp_demangle::DemangleOptions::default())
    {
        return demangled;
    }
    name.to_owned()
}

#[cfg(test)]
mod tests {
    use super::demangle;

    #[test]
    fn demangles_only_mangled_names() {
        assert_eq!(demangle("a"), "a");
        assert_eq!(demangle("b"), "b");
        assert_eq!(demangle("main"), "main");
        assert_eq!(demangle("_ZN3foo3barE"), "foo::bar");
        assert_eq!(demangle("_Z3fooi"), "foo(int)");
        assert_eq!(
            demangle("_ZN4core3fmt5write17h0123456789abcdefE"),
            "core::fmt::write"
        );
    }
}
