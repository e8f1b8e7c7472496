//! A process's cgroup, and the container and pod it belongs to, for sample labels.
//!
//! The cgroup is the v2 path (`0::/path` in `/proc/PID/cgroup`), or on a v1-only
//! system the path of a controller every container runtime sets up (`pids`, then
//! `memory`, then `name=systemd`). Hybrid systems have both: v2 is used when the
//! process's v2 path says more than `/`.
//!
//! The container id is the 64-hex-digit id that docker, containerd, cri-o and podman
//! put in the names of the cgroups they create, with either cgroup driver:
//! `/docker/ID`, `/system.slice/docker-ID.scope`, `/kubepods/burstable/podUID/ID`,
//! `.../cri-containerd-ID.scope`, `.../crio-ID.scope`, `/machine.slice/libpod-ID.scope`.
//! Kubernetes pods add their uid (`podUID`, or `kubepods-QOS-podUID.slice` with the
//! dashes of the uid written as underscores).

use std::{
    fs, io,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use thiserror::Error;

/// Where a process sits in the cgroup tree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cgroup {
    /// The cgroup path, e.g. `/system.slice/docker-0123...ef.scope`.
    pub path: String,
    /// The container id parsed from the path, when it names one.
    pub container: Option<String>,
    /// The Kubernetes pod uid parsed from the path, when it names one.
    pub pod: Option<String>,
}

impl Cgroup {
    /// Reads `/proc/PID/cgroup`.
    pub fn of_process(pid: u32) -> io::Result<Self> {
        let text = fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
        Ok(Self::from_path(cgroup_path(&text).unwrap_or("/")))
    }

    /// The cgroup at `path`, with the container and pod it names.
    pub fn from_path(path: &str) -> Self {
        Self {
            path: path.to_owned(),
            container: container_id(path),
            pod: pod_uid(path),
        }
    }
}

/// A cgroup v2 subtree to trace (`--cgroup`): the BPF programs compare the ancestor
/// of the current task at `level` with `id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CgroupFilter {
    /// The cgroup's id (the inode number of its directory in the v2 hierarchy).
    pub id: u64,
    /// Its depth below the hierarchy's root (the root is 0).
    pub level: u32,
}

/// Why `--cgroup` could not be resolved.
#[derive(Debug, Error)]
pub enum CgroupError {
    /// No cgroup v2 hierarchy is mounted.
    #[error(
        "--cgroup needs the cgroup v2 hierarchy, and none is mounted (mount -t cgroup2 none /sys/fs/cgroup)"
    )]
    NoHierarchy,
    /// The path names no cgroup.
    #[error(
        "--cgroup {given}: no such cgroup in the v2 hierarchy at {mount}; give its path as /proc/PID/cgroup shows it (e.g. /system.slice/foo.service)"
    )]
    NotFound {
        /// What the user gave.
        given: String,
        /// Where the hierarchy is mounted.
        mount: PathBuf,
    },
}

impl CgroupFilter {
    /// Resolves a cgroup given as a path of the v2 hierarchy (`/system.slice/x`, as
    /// `/proc/PID/cgroup` and the samples' labels show it) or as a directory under its
    /// mount point (`/sys/fs/cgroup/system.slice/x`).
    pub fn resolve(given: &Path) -> Result<Self, CgroupError> {
        let mount = cgroup2_mount().ok_or(CgroupError::NoHierarchy)?;
        let not_found = || CgroupError::NotFound {
            given: given.display().to_string(),
            mount: mount.clone(),
        };
        let relative = match given.strip_prefix(&mount) {
            Ok(inside) => inside.to_owned(),
            Err(_) => given.strip_prefix("/").unwrap_or(given).to_owned(),
        };
        if relative
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(not_found());
        }
        let dir = mount.join(&relative);
        let metadata = fs::metadata(&dir).map_err(|_| not_found())?;
        if !metadata.is_dir() || !dir.join("cgroup.procs").exists() {
            return Err(not_found());
        }
        Ok(Self {
            id: metadata.ino(),
            level: u32::try_from(relative.components().count()).map_err(|_| not_found())?,
        })
    }
}

/// Where the cgroup v2 hierarchy is mounted (`/sys/fs/cgroup`, or
/// `/sys/fs/cgroup/unified` on a hybrid system).
pub fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(fields[1]))
    })
}

/// The path to report from the contents of `/proc/PID/cgroup`.
pub fn cgroup_path(text: &str) -> Option<&str> {
    let mut v2 = None;
    let mut v1: [Option<&str>; 3] = [None; 3];
    for line in text.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            v2 = Some(path);
            continue;
        }
        for (rank, wanted) in ["pids", "memory", "name=systemd"].iter().enumerate() {
            if controllers.split(',').any(|c| c == *wanted) {
                v1[rank] = Some(path);
            }
        }
    }
    // The first controller whose path says where the process is, else any.
    let v1 = v1
        .iter()
        .flatten()
        .find(|p| **p != "/")
        .or(v1.iter().flatten().next())
        .copied();
    match (v2, v1) {
        (Some(v2), _) if v2 != "/" => Some(v2),
        (v2, Some(v1)) => Some(v1).filter(|p| *p != "/").or(v2).or(Some(v1)),
        (v2, None) => v2,
    }
}

/// Prefixes that container runtimes give the cgroups of containers (systemd driver).
const RUNTIME_PREFIXES: [&str; 6] = [
    "docker-",
    "cri-containerd-",
    "crio-",
    "libpod-",
    "containerd-",
    "nerdctl-",
];

/// The container id a cgroup path names: its innermost component that is a
/// container's cgroup. Monitor processes' cgroups (`crio-conmon-ID`,
/// `libpod-conmon-ID`) are not containers.
pub fn container_id(path: &str) -> Option<String> {
    path.split('/').rev().find_map(|component| {
        let name = component.strip_suffix(".scope").unwrap_or(component);
        if name.contains("-conmon-") {
            return None;
        }
        let id = RUNTIME_PREFIXES
            .iter()
            .find_map(|prefix| name.strip_prefix(prefix))
            .unwrap_or(name);
        is_container_id(id).then(|| id.to_owned())
    })
}

/// Whether `text` is a full container id: 64 lowercase hex digits.
fn is_container_id(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The Kubernetes pod uid a cgroup path names (`podUID`, or the systemd driver's
/// `kubepods-QOS-podUID.slice` with underscores for dashes), with dashes.
pub fn pod_uid(path: &str) -> Option<String> {
    path.split('/').find_map(|component| {
        let name = component.strip_suffix(".slice").unwrap_or(component);
        let uid = name
            .rsplit_once("-pod")
            .map_or_else(|| name.strip_prefix("pod"), |(_, uid)| Some(uid))?;
        let uid = uid.replace('_', "-");
        is_uuid(&uid).then_some(uid)
    })
}

/// Whether `text` is a UUID in its 8-4-4-4-12 form.
fn is_uuid(text: &str) -> bool {
    let groups: Vec<&str> = text.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, len)| g.len() == len && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f9c2d8e1b7a4c6d5e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d";
    const UID: &str = "8a3e4d2b-1c5f-4e6a-9b7d-0f1e2d3c4b5a";

    #[test]
    fn container_ids_of_the_five_runtimes() {
        let uid_ = UID.replace('-', "_");
        let cases = [
            // docker, cgroupfs and systemd drivers
            format!("/docker/{ID}"),
            format!("/system.slice/docker-{ID}.scope"),
            // containerd under Kubernetes, both drivers; plain containerd (nerdctl)
            format!("/kubepods/burstable/pod{UID}/{ID}"),
            format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-{ID}.scope"
            ),
            format!("/default/{ID}"),
            // cri-o
            format!(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/crio-{ID}.scope"
            ),
            // podman, root and rootless
            format!("/machine.slice/libpod-{ID}.scope"),
            format!(
                "/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope/container"
            ),
            // kubepods with the cgroupfs driver, guaranteed QoS
            format!("/kubepods/pod{UID}/{ID}"),
        ];
        for path in &cases {
            assert_eq!(container_id(path).as_deref(), Some(ID), "{path}");
        }
        for path in &cases[2..6] {
            if path.contains("pod") {
                assert_eq!(pod_uid(path).as_deref(), Some(UID), "{path}");
            }
        }
        assert_eq!(pod_uid(&cases[6]), None);
    }

    #[test]
    fn no_container_where_there_is_none() {
        for path in [
            "/",
            "/user.slice/user-1000.slice/session-3.scope",
            "/system.slice/ssh.service",
            // A container runtime's monitor is not a container.
            &format!("/machine.slice/libpod-conmon-{ID}.scope"),
            &format!("/kubepods.slice/crio-conmon-{ID}.scope"),
            // Too short, or not hex.
            "/docker/3f9c2d8e1b7a",
            &format!("/docker/{}", ID.to_uppercase()),
        ] {
            assert_eq!(container_id(path), None, "{path}");
        }
        assert_eq!(pod_uid("/kubepods/podnot-a-uid/x"), None);
    }

    #[test]
    fn the_path_prefers_v2_unless_it_says_nothing() {
        let hybrid =
            "9:name=systemd:/user.slice\n8:pids:/user.slice/x\n4:memory:/m\n0::/test-group\n";
        assert_eq!(cgroup_path(hybrid), Some("/test-group"));
        let hybrid_root = "8:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n";
        assert_eq!(cgroup_path(hybrid_root), Some("/docker/abc"));
        let only_memory = "8:pids:/\n4:memory:/job/7\n0::/\n";
        assert_eq!(cgroup_path(only_memory), Some("/job/7"));
        let v1 = "12:memory:/kube/x\n11:cpu,cpuacct:/kube/y\n";
        assert_eq!(cgroup_path(v1), Some("/kube/x"));
        assert_eq!(cgroup_path("0::/a/b\n"), Some("/a/b"));
        assert_eq!(cgroup_path("0::/\n"), Some("/"));
        assert_eq!(cgroup_path("garbage"), None);
    }

    #[test]
    fn resolves_paths_of_the_hierarchy_and_refuses_others() {
        let mount = cgroup2_mount().expect("a cgroup2 hierarchy on this machine");
        let root = CgroupFilter::resolve(Path::new("/")).expect("the root");
        assert_eq!(root.level, 0);
        assert_eq!(
            CgroupFilter::resolve(&mount).expect("the mount point is the root"),
            root
        );
        for bad in ["/no/such/cgroup", "/../etc", "relative/../.."] {
            let err = CgroupFilter::resolve(Path::new(bad))
                .expect_err(bad)
                .to_string();
            assert!(err.contains("no such cgroup"), "{err}");
        }
    }

    #[test]
    fn reads_this_process() {
        let cgroup = Cgroup::of_process(std::process::id()).expect("own cgroup");
        assert!(cgroup.path.starts_with('/'), "{cgroup:?}");
    }
}
