//! Which object serves a process's `malloc`: the one the dynamic linker binds it to.
//!
//! The linker searches the program first, then the `LD_PRELOAD`ed objects, then the
//! libraries in load order. The order heapprofd rebuilds from a process's mappings:
//! - the program (a static binary, or one that exports its own allocator);
//! - objects named in its `LD_PRELOAD` or in `/etc/ld.so.preload`;
//! - the other libraries (a linked jemalloc, tcmalloc or mimalloc), in address order;
//! - the C library (glibc's `libc.so.6`, musl's `libc.so`/`ld-musl-*`);
//! - last, glibc's dynamic loader, whose minimal `malloc` serves only itself before
//!   the C library is relocated.
//!
//! Load order among the libraries is approximated by address order: it differs only
//! for a process mapping two replacement allocators, which is a bug in itself.

use std::sync::Arc;

use crate::{environ::Environ, probes::libc::is_libc_name, procmaps::ObjectFile};

/// Where an object stands in the binding order (lower binds first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Tier {
    Program,
    Preloaded,
    Library,
    CLibrary,
    Loader,
}

/// The file name of a path.
fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// Whether a file name looks like glibc's dynamic loader.
fn is_glibc_loader_name(path: &str) -> bool {
    let name = file_name(path);
    name.starts_with("ld-linux") || name.starts_with("ld.so") || name.starts_with("ld64.so")
}

/// The preloads of process `pid`: its `LD_PRELOAD` (names or paths, separated by
/// spaces or colons, from `environ`, its environment when readable) and the system's
/// `/etc/ld.so.preload`, as seen from its root.
pub fn preloads(pid: u32, environ: Option<&Environ>) -> Vec<String> {
    let mut preloads = Vec::new();
    for value in environ.into_iter().flat_map(|e| e.values("LD_PRELOAD")) {
        let value = String::from_utf8_lossy(value);
        preloads.extend(
            value
                .split([' ', ':'])
                .filter(|s| !s.is_empty())
                .map(str::to_owned),
        );
    }
    if let Ok(system) = std::fs::read_to_string(format!("/proc/{pid}/root/etc/ld.so.preload")) {
        preloads.extend(system.split_whitespace().map(str::to_owned));
    }
    preloads
}

/// Whether a mapped object is the preload named `preload` (a path, or a bare name
/// the loader searched for).
fn is_preload(object: &ObjectFile, preload: &str) -> bool {
    if preload.contains('/') {
        object.path == preload
            || std::fs::canonicalize(preload)
                .is_ok_and(|p| p.to_string_lossy() == object.path.as_str())
    } else {
        file_name(&object.path) == preload
    }
}

/// `objects` (a process's mapped objects, in address order, each once) in the order the
/// dynamic linker binds symbols: `exe` is the program's path, `preloads` its preloads.
pub fn binding_order(
    objects: &[Arc<ObjectFile>],
    exe: Option<&str>,
    preloads: &[String],
) -> Vec<Arc<ObjectFile>> {
    let tier = |object: &ObjectFile| {
        if exe == Some(object.path.as_str()) {
            Tier::Program
        } else if preloads.iter().any(|p| is_preload(object, p)) {
            Tier::Preloaded
        } else if is_libc_name(&object.path) {
            Tier::CLibrary
        } else if is_glibc_loader_name(&object.path) {
            Tier::Loader
        } else {
            Tier::Library
        }
    };
    let mut ordered: Vec<(Tier, usize, Arc<ObjectFile>)> = objects
        .iter()
        .enumerate()
        .map(|(index, object)| (tier(object), index, Arc::clone(object)))
        .collect();
    ordered.sort_by_key(|(tier, index, _)| (*tier, *index));
    ordered.into_iter().map(|(_, _, object)| object).collect()
}

/// The allocator libraries installed at the usual places: musl's C library and the
/// replacement allocators Debian ships (`--all` probes them up front, so that
/// processes that start later are counted from their first call).
pub fn system_allocators() -> Vec<std::path::PathBuf> {
    let arch = std::env::consts::ARCH;
    let triple = format!("{arch}-linux-gnu");
    let mut candidates = vec![format!("/lib/ld-musl-{arch}.so.1")];
    for dir in [
        format!("/usr/lib/{triple}"),
        format!("/lib/{triple}"),
        "/usr/lib".into(),
    ] {
        for name in [
            "libjemalloc.so.2",
            "libtcmalloc.so.4",
            "libtcmalloc_minimal.so.4",
            "libmimalloc.so.2",
        ] {
            candidates.push(format!("{dir}/{name}"));
        }
    }
    let mut found: Vec<std::path::PathBuf> = Vec::new();
    for candidate in candidates {
        let Ok(path) = std::fs::canonicalize(&candidate) else {
            continue;
        };
        if path.is_file() && !found.contains(&path) {
            found.push(path);
        }
    }
    found
}

/// Whether `object` is glibc's loader, whose `malloc` is not the process's allocator.
pub fn is_loader(object: &ObjectFile) -> bool {
    is_glibc_loader_name(&object.path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognizes_glibc_loader_names() {
        assert!(is_glibc_loader_name(
            "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
        ));
        assert!(!is_glibc_loader_name("/usr/lib/libldap.so.2"));
    }

    #[test]
    fn orders_objects_as_the_linker_binds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cache = crate::procmaps::ObjectCache::default();
        let names = [
            "ld-linux-x86-64.so.2",
            "libc.so.6",
            "libstdc++.so.6",
            "libjemalloc.so.2",
            "program",
        ];
        let objects: Vec<Arc<ObjectFile>> = names
            .iter()
            .map(|name| {
                let path = dir.path().join(name);
                std::fs::write(&path, name).expect("write");
                cache
                    .open(&path, &path.display().to_string())
                    .expect("open")
            })
            .collect();
        let exe = dir.path().join("program").display().to_string();
        let order = |preloads: &[String]| -> Vec<&str> {
            binding_order(&objects, Some(&exe), preloads)
                .iter()
                .map(|o| {
                    names
                        .iter()
                        .copied()
                        .find(|n| o.path.ends_with(n))
                        .unwrap_or("?")
                })
                .collect()
        };
        assert_eq!(
            order(&[]),
            [
                "program",
                "libstdc++.so.6",
                "libjemalloc.so.2",
                "libc.so.6",
                "ld-linux-x86-64.so.2"
            ]
        );
        assert_eq!(
            order(&["libjemalloc.so.2".to_owned()]),
            [
                "program",
                "libjemalloc.so.2",
                "libstdc++.so.6",
                "libc.so.6",
                "ld-linux-x86-64.so.2"
            ]
        );
    }
}
