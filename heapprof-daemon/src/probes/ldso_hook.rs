//! The dynamic loader's debugger hook, `_dl_debug_state`: glibc's and musl's loaders
//! call it once a program's libraries are mapped (before any of their code runs) and
//! around every `dlopen`/`dlclose`, which is how debuggers learn of new objects.
//! heapprofd probes it to load the unwind tables of new objects as they appear.

use std::path::{Path, PathBuf};

use anyhow::Result;
use blazesym::inspect::{Inspector, source::Elf, source::Source};

use crate::procmaps::parse_maps_line;

/// The function the loader calls after a change of the loaded objects.
const HOOK: &str = "_dl_debug_state";

/// A dynamic loader and where its hook is.
#[derive(Debug, Clone)]
pub struct DynamicLoader {
    /// Path this process can open and attach to.
    pub path: PathBuf,
    /// The path as processes name it, for messages.
    pub display: String,
    /// File offset of `_dl_debug_state`.
    pub hook_offset: u64,
}

/// Whether a file name looks like a dynamic loader (glibc's ld-linux*, musl's ld-musl*).
fn is_loader_name(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.starts_with("ld-linux") || name.starts_with("ld-musl") || name.starts_with("ld.so")
}

/// Where `_dl_debug_state` is in the loader at `path`, if it exports it.
fn resolve(path: &Path, display: &str) -> Option<DynamicLoader> {
    let mut elf = Elf::new(path);
    elf.debug_syms = false;
    let inspector = Inspector::new();
    let found = inspector
        .lookup(&Source::Elf(elf), &[HOOK])
        .map_err(|err| log::debug!("reading the symbols of {display}: {err}"))
        .ok()?;
    let hook_offset = found.first()?.iter().find_map(|sym| sym.file_offset)?;
    Some(DynamicLoader {
        path: path.to_owned(),
        display: display.to_owned(),
        hook_offset,
    })
}

/// The loader process `pid` maps, opened through the process's root like its C library.
pub fn of_process(pid: u32) -> Result<Option<DynamicLoader>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    for line in maps.lines().filter_map(|l| parse_maps_line(l).ok()) {
        if line.executable && is_loader_name(&line.path) && !line.path.ends_with(" (deleted)") {
            let path = super::libc::open_mapped(pid, &line)?;
            return Ok(resolve(&path, &line.path));
        }
    }
    Ok(None)
}

/// The loader an executable names (its `PT_INTERP`): what a launched command will run.
pub fn of_executable(program: &Path) -> Option<DynamicLoader> {
    use object::read::elf::{ElfFile64, ProgramHeader as _};
    let bytes = std::fs::read(program).ok()?;
    let elf = ElfFile64::<object::Endianness>::parse(bytes.as_slice()).ok()?;
    let endian = elf.endian();
    let interpreter = elf.elf_program_headers().iter().find_map(|ph| {
        ph.interpreter(endian, bytes.as_slice())
            .ok()
            .flatten()
            .and_then(|name| std::str::from_utf8(name).ok())
    })?;
    let path = std::fs::canonicalize(interpreter).ok()?;
    resolve(&path, &path.display().to_string())
}

/// The system's loader, for `--all`: the one this process runs on, else the usual paths.
pub fn system() -> Option<DynamicLoader> {
    if let Ok(Some(own)) = of_process(std::process::id()) {
        return Some(own);
    }
    let candidates = [
        "/lib64/ld-linux-x86-64.so.2",
        "/lib/ld-linux-aarch64.so.1",
        "/lib/ld-linux-armhf.so.3",
    ];
    candidates
        .iter()
        .map(Path::new)
        .find(|path| path.is_file())
        .and_then(|path| {
            let path = std::fs::canonicalize(path).ok()?;
            resolve(&path, &path.display().to_string())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_hook_in_this_process_and_in_an_executables_interpreter() {
        let own = of_process(std::process::id())
            .expect("own maps")
            .expect("the test binary runs on a dynamic loader");
        assert!(own.hook_offset > 0, "{own:?}");
        let sh = of_executable(Path::new("/bin/sh")).expect("/bin/sh names a loader");
        assert_eq!(sh.hook_offset, own.hook_offset, "the same loader");
        assert!(is_loader_name(&sh.display), "{sh:?}");
        assert!(of_executable(Path::new("/etc/hostname")).is_none());
    }
}
