//! The entry in `/etc/ld.so.preload`: added atomically (the new list written beside the
//! file, then renamed over it, so a program starting meanwhile reads the old list or
//! the new, never half of one), and removed the same way.
//!
//! The list names objects separated by white space or colons (see ld.so(8)); the entry
//! is the library's path as one of them. Other entries are kept as they are.

use std::{
    io::Write as _,
    os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _},
    path::Path,
};

use anyhow::{Context as _, Result};

/// The list with `library` added, or `None` if it names it already.
pub fn with_entry(list: &str, library: &str) -> Option<String> {
    if names(list, library) {
        return None;
    }
    let mut new = list.to_owned();
    if !new.is_empty() && !new.ends_with('\n') {
        new.push('\n');
    }
    new.push_str(library);
    new.push('\n');
    Some(new)
}

/// The list without `library` (every time it is named), or `None` if it does not
/// name it. Lines that named only it go whole.
pub fn without_entry(list: &str, library: &str) -> Option<String> {
    if !names(list, library) {
        return None;
    }
    let mut new = String::with_capacity(list.len());
    for line in list.split_inclusive('\n') {
        if !names(line, library) {
            new.push_str(line);
            continue;
        }
        let kept: Vec<&str> = line
            .split(is_separator)
            .filter(|name| !name.is_empty() && *name != library)
            .collect();
        if !kept.is_empty() {
            new.push_str(&kept.join(" "));
            if line.ends_with('\n') {
                new.push('\n');
            }
        }
    }
    Some(new)
}

/// The list's separators: white space and colons.
fn is_separator(c: char) -> bool {
    c.is_whitespace() || c == ':'
}

/// Whether the list names `library`.
fn names(list: &str, library: &str) -> bool {
    list.split(is_separator).any(|name| name == library)
}

/// Adds `library` to the list at `file` (created if missing); returns whether it
/// added it (false: the list named it already, left by a heapprofd that was killed).
pub fn add(file: &Path, library: &str) -> Result<bool> {
    let (list, mode) = read(file)?;
    match with_entry(&list, library) {
        Some(new) => {
            replace(file, &new, mode)?;
            Ok(true)
        }
        None => Ok(false),
    }
}

/// Removes `library` from the list at `file`; the file goes if nothing else is in it.
pub fn remove(file: &Path, library: &str) -> Result<()> {
    let (list, mode) = read(file)?;
    let Some(new) = without_entry(&list, library) else {
        return Ok(());
    };
    if new.trim().is_empty() {
        match std::fs::remove_file(file) {
            Ok(()) => return Ok(()),
            // A list bind-mounted into a sandbox (see docs/service.md) stays, empty.
            Err(err) if err.raw_os_error() == Some(libc::EBUSY) => {}
            Err(err) => return Err(err).with_context(|| format!("removing {}", file.display())),
        }
    }
    replace(file, &new, mode)
}

/// The list and its file's mode (empty and 0644 when there is no file).
fn read(file: &Path) -> Result<(String, u32)> {
    match std::fs::read_to_string(file) {
        Ok(list) => {
            let mode = std::fs::metadata(file)
                .with_context(|| format!("reading {}", file.display()))?
                .permissions()
                .mode()
                & 0o7777;
            Ok((list, mode))
        }
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok((String::new(), 0o644)),
        Err(err) => Err(err).with_context(|| format!("reading {}", file.display())),
    }
}

/// Writes `list` beside `file`, then renames it over `file`; where `file` is a mount
/// point (bind-mounted into a sandbox, whose `/etc` is read-only) or its directory is
/// read-only, rewrites it in place with one write (a program starting meanwhile reads
/// the old list, an empty one, or the new one: never a wrong entry).
fn replace(file: &Path, list: &str, mode: u32) -> Result<()> {
    match replace_by_rename(file, list, mode) {
        Err(err)
            if err.raw_os_error().is_some_and(|errno| {
                [libc::EBUSY, libc::EROFS, libc::EACCES, libc::EPERM].contains(&errno)
            }) && file.exists() =>
        {
            let mut out = std::fs::OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(file)
                .with_context(|| format!("writing {}", file.display()))?;
            out.write_all(list.as_bytes())
                .with_context(|| format!("writing {}", file.display()))
        }
        other => other.with_context(|| format!("writing {}", file.display())),
    }
}

/// Writes `list` beside `file`, then renames it over `file`.
fn replace_by_rename(file: &Path, list: &str, mode: u32) -> std::io::Result<()> {
    let name = file
        .file_name()
        .ok_or_else(|| std::io::Error::other(format!("{} names no file", file.display())))?;
    let mut partial_name = std::ffi::OsString::from(".");
    partial_name.push(name);
    partial_name.push(format!(".heapprofd-{}", std::process::id()));
    let partial = file.with_file_name(partial_name);
    let written = (|| {
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&partial)?;
        out.write_all(list.as_bytes())?;
        out.sync_all()?;
        std::fs::rename(&partial, file)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIB: &str = "/var/lib/heapprofd-preload/libheapprofd-system.so";

    #[test]
    fn an_entry_is_added_once_after_the_operators_own() {
        assert_eq!(
            with_entry("", LIB).as_deref(),
            Some(format!("{LIB}\n").as_str())
        );
        assert_eq!(
            with_entry("/usr/lib/libfoo.so", LIB).as_deref(),
            Some(format!("/usr/lib/libfoo.so\n{LIB}\n").as_str())
        );
        assert_eq!(with_entry(&format!("/a.so:{LIB} /b.so\n"), LIB), None);
    }

    #[test]
    fn removing_the_entry_keeps_everything_else() {
        let list = format!("# keep\n/a.so\n{LIB}\n/b.so:{LIB}\n\n");
        assert_eq!(
            without_entry(&list, LIB).as_deref(),
            Some("# keep\n/a.so\n/b.so\n\n")
        );
        assert_eq!(without_entry("/a.so\n", LIB), None);
        assert_eq!(without_entry(&format!("{LIB}\n"), LIB).as_deref(), Some(""));
    }

    #[test]
    fn the_file_is_replaced_whole_and_removed_when_empty() {
        let dir = std::env::temp_dir().join(format!("heapprofd-entry-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("ld.so.preload");
        let _ = std::fs::remove_file(&file);
        assert!(add(&file, LIB).expect("add"));
        assert!(!add(&file, LIB).expect("again"));
        assert_eq!(
            std::fs::read_to_string(&file).expect("read"),
            format!("{LIB}\n")
        );
        remove(&file, LIB).expect("remove");
        assert!(!file.exists(), "a list heapprofd emptied goes");
        std::fs::write(&file, "/a.so\n").expect("write");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        add(&file, LIB).expect("add");
        let mode = std::fs::metadata(&file).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the list keeps its mode");
        remove(&file, LIB).expect("remove");
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "/a.so\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
