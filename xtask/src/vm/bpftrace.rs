//! bpftrace for the x86-64 VM test, which checks heapprofd's kernel-mode counts
//! against it inside the VM: Debian's own bpftrace (bookworm's, the suite of the
//! 6.1 and 6.12 kernels) and the shared libraries it loads, on an ext4 disk image
//! that only the 6.12 boot attaches (virtio-blk, read-only).
//!
//! bpftrace is linked against LLVM and clang: about 200 MB of libraries. Packed into
//! the initramfs they would be decompressed and copied into memory at every boot
//! (3-6 s more for each kernel under TCG); on a disk, the kernel reads only the pages
//! the loader touches, in the one boot that runs bpftrace.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};
use object::{
    Endianness,
    read::elf::{Dyn as _, ElfFile64, FileHeader as _},
};

use super::debian::PrivateApt;
use crate::CmdExt as _;

/// The suite bpftrace comes from, the one suite of its apt configuration: its
/// dependencies are resolved within it, as an install there would.
pub(crate) const SUITE: &str = "bookworm";

/// The image's name in the assets directory.
pub const IMAGE: &str = "bpftrace.ext4";

/// Where the shared libraries are looked for in the unpacked packages (bookworm's
/// packages are not merged into /usr yet).
const LIBRARY_DIRS: [&str; 2] = ["lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu"];

/// Fetches bpftrace with everything it depends on into `base` (an apt configuration
/// of its own under `base/apt`, the packages unpacked under `base/unpacked`) and
/// writes `image`: `/bin/bpftrace` and, in `/lib`, every shared library it needs
/// (followed through the libraries' own needs), the dynamic loader
/// `ld-linux-x86-64.so.2` among them. The VM runs it as
/// `/mnt/lib/ld-linux-x86-64.so.2 --library-path /mnt/lib /mnt/bin/bpftrace`.
pub fn build_image(base: &Path, sources: &str, image: &Path) -> Result<()> {
    let apt = PrivateApt::new(&base.join("apt"), "amd64", sources)?.without_installed()?;
    apt.update()?;
    let debs = base.join("debs");
    let _ = std::fs::remove_dir_all(&debs);
    apt.download_with_dependencies(&debs, "bpftrace")?;
    let unpacked = base.join("unpacked");
    let _ = std::fs::remove_dir_all(&unpacked);
    std::fs::create_dir_all(&unpacked)?;
    for deb in std::fs::read_dir(&debs)? {
        let deb = deb?.path();
        if deb.extension().is_some_and(|e| e == "deb") {
            Command::new("dpkg-deb")
                .arg("-x")
                .arg(&deb)
                .arg(&unpacked)
                .run()?;
        }
    }
    let tree = base.join("tree");
    let _ = std::fs::remove_dir_all(&tree);
    std::fs::create_dir_all(tree.join("bin"))?;
    std::fs::create_dir_all(tree.join("lib"))?;
    let bpftrace = unpacked.join("usr/bin/bpftrace");
    std::fs::copy(&bpftrace, tree.join("bin/bpftrace"))
        .with_context(|| format!("the bpftrace package has no {}", bpftrace.display()))?;
    let mut seen = BTreeSet::new();
    let mut todo = vec![bpftrace];
    while let Some(object) = todo.pop() {
        for name in needed(&object)? {
            if !seen.insert(name.clone()) {
                continue;
            }
            let library = find_library(&unpacked, &name)?;
            std::fs::copy(&library, tree.join("lib").join(&name))
                .with_context(|| format!("copying {}", library.display()))?;
            todo.push(library);
        }
    }
    if !seen.contains("ld-linux-x86-64.so.2") {
        bail!("bpftrace's libraries do not need the dynamic loader ld-linux-x86-64.so.2: {seen:?}");
    }
    let bytes = tree_bytes(&tree)?;
    // Room for the file system's own blocks (no journal, few inodes).
    let megabytes = bytes / (1 << 20) * 11 / 10 + 16;
    let _ = std::fs::remove_file(image);
    Command::new("mke2fs")
        .args(["-q", "-t", "ext4", "-O", "^has_journal,^metadata_csum"])
        .args(["-L", "bpftrace", "-d"])
        .arg(&tree)
        .arg(image)
        .arg(format!("{megabytes}M"))
        .run()
        .context("making the bpftrace disk image (mke2fs is in e2fsprogs: cargo xtask setup)")?;
    for dir in [&debs, &unpacked, &tree] {
        let _ = std::fs::remove_dir_all(dir);
    }
    Ok(())
}

/// The names an ELF file needs (its `DT_NEEDED` entries).
fn needed(path: &Path) -> Result<Vec<String>> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let file = ElfFile64::<Endianness>::parse(&*data)
        .with_context(|| format!("{} is not a 64-bit ELF file", path.display()))?;
    let endian = file.endian();
    let sections = file
        .elf_header()
        .sections(endian, &*data)
        .with_context(|| format!("{}: its section headers", path.display()))?;
    let Some((entries, link)) = sections
        .dynamic(endian, &*data)
        .with_context(|| format!("{}: its dynamic section", path.display()))?
    else {
        return Ok(Vec::new());
    };
    let strings = sections
        .strings(endian, &*data, link)
        .with_context(|| format!("{}: its dynamic strings", path.display()))?;
    let mut names = Vec::new();
    for entry in entries {
        if entry.tag(endian) == object::elf::DT_NEEDED {
            let name = entry
                .string(endian, strings)
                .with_context(|| format!("{}: a DT_NEEDED name", path.display()))?;
            names.push(String::from_utf8_lossy(name).into_owned());
        }
    }
    Ok(names)
}

/// The file the library `name` is in the unpacked packages, its symbolic links
/// followed inside them (an absolute link names a path in the packages' tree).
fn find_library(unpacked: &Path, name: &str) -> Result<PathBuf> {
    let mut path = LIBRARY_DIRS
        .iter()
        .map(|dir| unpacked.join(dir).join(name))
        .find(|p| p.symlink_metadata().is_ok())
        .with_context(|| {
            format!(
                "bpftrace needs {name}, which no package it depends on holds in {LIBRARY_DIRS:?}"
            )
        })?;
    for _ in 0..16 {
        let Ok(target) = std::fs::read_link(&path) else {
            return Ok(path);
        };
        path = match target.strip_prefix("/") {
            Ok(inside) => unpacked.join(inside),
            Err(_) => path
                .parent()
                .context("a library path without a directory")?
                .join(target),
        };
    }
    bail!("{name}: too many symbolic links")
}

/// The bytes of the regular files under `dir`.
fn tree_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            total += tree_bytes(&entry.path())?;
        } else if kind.is_file() {
            total += entry.metadata()?.len();
        }
    }
    Ok(total)
}
