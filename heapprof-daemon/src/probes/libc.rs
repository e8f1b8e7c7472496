//! Finding the C library: the one a process maps, or the system's.

use std::path::PathBuf;

use anyhow::{Context as _, Result, bail};

use crate::procmaps::parse_maps_line;

/// Whether a file name looks like a C library (glibc's libc.so.6 / libc-2.x.so, musl's).
pub fn is_libc_name(path: &str) -> bool {
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn recognizes_libc_names() {
        assert!(is_libc_name("/usr/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(is_libc_name("/lib/libc-2.31.so"));
        assert!(is_libc_name("/usr/lib/x86_64-linux-musl/libc.so"));
        assert!(is_libc_name("/lib/ld-musl-aarch64.so.1"));
        assert!(!is_libc_name("/usr/lib/libcrypto.so.3"));
        assert!(!is_libc_name("/usr/lib/libcap.so.2"));
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
}
