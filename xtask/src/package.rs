//! `cargo xtask package`: heapprofd as a Debian package, built with the tools every
//! Debian system has (dpkg-deb, and dpkg-shlibdeps from dpkg-dev for `Depends`), so
//! nothing like cargo-deb has to be compiled first.
//!
//! The package holds the binary, the systemd unit `heapprof-daemon/dist/heapprofd.service`
//! and the README. Installing it never enables or starts the service: its maintainer
//! scripts only tell a running systemd that the unit changed, restart the service on an
//! upgrade if it was running, and stop it before removal.
//!
//! [`check`] proves a built package right (contents, modes, control fields, and
//! `systemd-analyze verify` on the unit it carries); the unit tests run it on a package
//! of a stand-in binary, `cargo xtask test` on the real one.

use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::{CmdExt as _, step, workspace_root};

/// The package's name, and the binary's.
pub const NAME: &str = "heapprofd";
/// The version: the workspace's (xtask inherits it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The unit file, relative to the workspace root.
pub const UNIT: &str = "heapprof-daemon/dist/heapprofd.service";
/// Who answers for the package (Debian requires the field; there is no mailing list).
const MAINTAINER: &str = "heapprofd developers <heapprofd@localhost>";

/// Every file in the package with its mode; directories are implied.
pub const FILES: &[(&str, u32)] = &[
    ("usr/bin/heapprofd", 0o755),
    ("lib/systemd/system/heapprofd.service", 0o644),
    ("usr/share/doc/heapprofd/README.md", 0o644),
    ("usr/share/doc/heapprofd/copyright", 0o644),
];

/// Maintainer scripts: `(name, text)`. They act only when systemd is the running init
/// (`/run/systemd/system` exists), so installing into a container or chroot works.
const SCRIPTS: &[(&str, &str)] = &[
    (
        "postinst",
        r#"#!/bin/sh
set -e
# The unit is installed, never enabled or started: `systemctl enable --now heapprofd`.
if [ "$1" = configure ] && [ -d /run/systemd/system ]; then
    systemctl --system daemon-reload >/dev/null || true
    # An upgrade restarts a running daemon on the new binary (try-restart starts nothing).
    if [ -n "$2" ]; then
        systemctl try-restart heapprofd.service >/dev/null || true
    fi
fi
"#,
    ),
    (
        "prerm",
        r#"#!/bin/sh
set -e
# The binary is about to go: stop the daemon (it writes a final profile on SIGTERM).
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
    systemctl stop heapprofd.service >/dev/null || true
fi
"#,
    ),
    (
        "postrm",
        r#"#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
    systemctl --system daemon-reload >/dev/null || true
fi
# Purging removes the profiles too, as Debian policy asks of /var/lib/PACKAGE.
if [ "$1" = purge ]; then
    rm -rf /var/lib/heapprofd
fi
"#,
    ),
];

/// `cargo xtask package`: builds heapprofd (release) and its package in
/// `target/package/`, and with `check` runs [`check`] on it; returns the package's path.
pub fn package(check: bool) -> Result<PathBuf> {
    let binary = crate::build_release()?;
    let out = crate::target_dir().join("package");
    let deb = build_deb(&binary, &out)?;
    step(&format!("built {}", deb.display()));
    if check {
        let scratch = out.join("check");
        if scratch.exists() {
            fs::remove_dir_all(&scratch)
                .with_context(|| format!("removing {}", scratch.display()))?;
        }
        fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
        self::check(&deb, &scratch)?;
        fs::remove_dir_all(&scratch).with_context(|| format!("removing {}", scratch.display()))?;
        step(&format!(
            "checked {}: contents, modes, control fields, systemd-analyze verify",
            deb.display()
        ));
    }
    Ok(deb)
}

/// The Debian architecture of an ELF binary, from its machine field.
pub fn debian_arch(binary: &Path) -> Result<&'static str> {
    let bytes = fs::read(binary).with_context(|| format!("reading {}", binary.display()))?;
    ensure!(
        bytes.get(..6) == Some(b"\x7fELF\x02\x01"),
        "{} is not a 64-bit little-endian ELF file",
        binary.display()
    );
    let machine = bytes
        .get(18..20)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .context("truncated ELF header")?;
    match machine {
        62 => Ok("amd64"),
        183 => Ok("arm64"),
        other => bail!(
            "{} is for ELF machine {other}: no Debian architecture known for it",
            binary.display()
        ),
    }
}

/// Builds `heapprofd_VERSION_ARCH.deb` in `out_dir` around `binary` (the architecture is
/// the binary's); returns its path. Runs again from scratch each time.
pub fn build_deb(binary: &Path, out_dir: &Path) -> Result<PathBuf> {
    let arch = debian_arch(binary)?;
    let root = workspace_root();
    // debhelper's layout: the package tree at debian/PACKAGE beside an (empty)
    // debian/control, which is where dpkg-shlibdeps expects to run.
    let work = out_dir.join(format!("{NAME}_{arch}.work"));
    if work.exists() {
        fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))?;
    }
    let tree = work.join("debian").join(NAME);
    // The first three of FILES are copies; the copyright file is written.
    let sources = [
        binary.to_path_buf(),
        root.join(UNIT),
        root.join("README.md"),
    ];
    for ((path, mode), source) in FILES.iter().zip(&sources) {
        install(source, &tree.join(path), *mode)?;
    }
    write(&tree.join(FILES[3].0), &copyright(), FILES[3].1)?;
    fs::write(work.join("debian/control"), "").context("writing debian/control")?;

    let depends = shlib_depends(&work, &format!("debian/{NAME}/usr/bin/{NAME}"))?;
    let control_dir = tree.join("DEBIAN");
    write(
        &control_dir.join("control"),
        &control(arch, &depends, installed_size_kib(&tree)?),
        0o644,
    )?;
    for (name, text) in SCRIPTS {
        write(&control_dir.join(name), text, 0o755)?;
    }
    open_directories(&tree)?;

    let deb = out_dir.join(format!("{NAME}_{VERSION}_{arch}.deb"));
    step(&format!("packing {}", deb.display()));
    Command::new("dpkg-deb")
        .args(["--root-owner-group", "--build"])
        .arg(&tree)
        .arg(&deb)
        .stdout(std::process::Stdio::null())
        .run()
        .context("dpkg-deb (Debian package dpkg) builds the package")?;
    fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))?;
    Ok(deb)
}

/// Copies `source` to `dest` with `mode`, creating directories (0755).
fn install(source: &Path, dest: &Path, mode: u32) -> Result<()> {
    make_parent(dest)?;
    fs::copy(source, dest)
        .with_context(|| format!("copying {} to {}", source.display(), dest.display()))?;
    fs::set_permissions(dest, fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", dest.display()))
}

fn write(dest: &Path, text: &str, mode: u32) -> Result<()> {
    make_parent(dest)?;
    fs::write(dest, text).with_context(|| format!("writing {}", dest.display()))?;
    fs::set_permissions(dest, fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", dest.display()))
}

fn make_parent(path: &Path) -> Result<()> {
    let parent = path.parent().context("a path with a parent")?;
    fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))
}

/// Sets every directory under `tree` (and itself) to 0755: the umask may have made
/// them narrower, and dpkg-deb packs the modes it finds.
fn open_directories(tree: &Path) -> Result<()> {
    fs::set_permissions(tree, fs::Permissions::from_mode(0o755))
        .with_context(|| format!("setting the mode of {}", tree.display()))?;
    for entry in fs::read_dir(tree).with_context(|| format!("reading {}", tree.display()))? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            open_directories(&entry.path())?;
        }
    }
    Ok(())
}

/// `Depends` from the shared libraries the binary links, as Debian computes it
/// (dpkg-shlibdeps reads the versioned symbols each library provides); empty for a
/// static binary.
fn shlib_depends(work: &Path, binary: &str) -> Result<String> {
    let out = Command::new("dpkg-shlibdeps")
        .args(["-O", binary])
        .current_dir(work)
        .output()
        .context("running dpkg-shlibdeps (Debian package dpkg-dev; cargo xtask setup)")?;
    if !out.status.success() {
        bail!(
            "dpkg-shlibdeps {binary} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix("shlibs:Depends="))
        .unwrap_or_default()
        .trim()
        .to_owned())
}

/// Size of the installed files in KiB, rounded up per file, as `Installed-Size` wants.
fn installed_size_kib(tree: &Path) -> Result<u64> {
    let mut total = 0;
    for (path, _) in FILES {
        let len = fs::metadata(tree.join(path))
            .with_context(|| format!("reading {path}"))?
            .len();
        total += len.div_ceil(1024);
    }
    Ok(total)
}

fn control(arch: &str, depends: &str, installed_size: u64) -> String {
    let mut text = format!(
        "Package: {NAME}\n\
         Version: {VERSION}\n\
         Architecture: {arch}\n\
         Maintainer: {MAINTAINER}\n\
         Installed-Size: {installed_size}\n"
    );
    if !depends.is_empty() {
        text.push_str(&format!("Depends: {depends}\n"));
    }
    text.push_str(
        "Section: devel\n\
         Priority: optional\n\
         Description: eBPF heap profiler writing Go-pprof heap profiles\n \
         heapprofd traces malloc, free and their relatives with uprobes and reports\n \
         live and cumulative heap usage per call stack, for one process or for every\n \
         process on the machine, as gzipped pprof profiles.\n \
         .\n \
         The package ships the systemd unit heapprofd.service (heapprofd --all, a\n \
         profile every minute in /var/lib/heapprofd). It is not enabled on install:\n \
         systemctl enable --now heapprofd\n",
    );
    text
}

fn copyright() -> String {
    let license = env!("CARGO_PKG_LICENSE");
    format!(
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\
         Upstream-Name: {NAME}\n\
         \n\
         Files: *\n\
         Copyright: heapprofd developers\n\
         License: {license}\n \
         heapprofd is dual-licensed under the MIT license and the Apache License,\n \
         Version 2.0, at your option. On Debian systems the Apache License 2.0 is in\n \
         /usr/share/common-licenses/Apache-2.0.\n"
    )
}

/// Checks a built package: exactly [`FILES`] (plus their directories) with their modes,
/// owned by root; the control fields; and `systemd-analyze verify` on the unit it
/// carries, run against the binary it carries. `scratch` is an empty directory to
/// unpack into.
pub fn check(deb: &Path, scratch: &Path) -> Result<()> {
    let info = tool("dpkg-deb", |c| c.arg("--info").arg(deb))?;
    ensure!(
        info.contains("Package: heapprofd"),
        "dpkg-deb --info {}: {info}",
        deb.display()
    );

    let listing = tool("dpkg-deb", |c| c.arg("--contents").arg(deb))?;
    let mut files = Vec::new();
    for line in listing.lines() {
        // -rwxr-xr-x root/root   8528288 2026-11-22 10:25 ./usr/bin/heapprofd
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [perms, owner, _size, _date, _time, path] = fields[..] else {
            bail!("unexpected dpkg-deb --contents line {line:?}");
        };
        ensure!(owner == "root/root", "{path} is owned by {owner}, not root");
        let path = path.trim_start_matches("./");
        if perms.starts_with('d') {
            ensure!(perms == "drwxr-xr-x", "directory {path} has mode {perms}");
        } else {
            files.push((path.to_owned(), perms.to_owned()));
        }
    }
    files.sort();
    let mut expected: Vec<(String, String)> = FILES
        .iter()
        .map(|(path, mode)| ((*path).to_owned(), ls_mode(*mode)))
        .collect();
    expected.sort();
    ensure!(
        files == expected,
        "{} holds {files:?}, not {expected:?}",
        deb.display()
    );

    let field = |name: &str| tool("dpkg-deb", |c| c.arg("--field").arg(deb).arg(name));
    let arch = field("Architecture")?;
    for (name, want) in [("Package", NAME), ("Version", VERSION)] {
        let got = field(name)?;
        ensure!(got.trim() == want, "{name}: {got:?}, not {want:?}");
    }
    ensure!(
        ["amd64", "arm64"].contains(&arch.trim()),
        "Architecture: {arch:?}"
    );
    let depends = field("Depends")?;
    ensure!(
        depends.contains("libc6 (>= 2."),
        "Depends {depends:?} lacks a versioned libc6"
    );
    for name in ["Maintainer", "Description", "Installed-Size"] {
        ensure!(!field(name)?.trim().is_empty(), "no {name} field");
    }

    let unpacked = scratch.join("root");
    tool("dpkg-deb", |c| c.arg("--extract").arg(deb).arg(&unpacked))?;
    let readme = fs::read(unpacked.join("usr/share/doc/heapprofd/README.md"))?;
    ensure!(
        readme == fs::read(workspace_root().join("README.md"))?,
        "the packaged README differs from README.md"
    );
    verify_unit(
        &unpacked.join("lib/systemd/system/heapprofd.service"),
        &unpacked.join("usr/bin/heapprofd"),
        scratch,
    )
}

/// Runs `systemd-analyze verify` on `unit` and fails on any complaint. verify checks
/// that ExecStart's program exists and is executable, so the copy it reads (in `scratch`)
/// points ExecStart at `binary` instead of /usr/bin/heapprofd; nothing else changes.
pub fn verify_unit(unit: &Path, binary: &Path, scratch: &Path) -> Result<()> {
    let text = fs::read_to_string(unit).with_context(|| format!("reading {}", unit.display()))?;
    let installed = "ExecStart=/usr/bin/heapprofd ";
    ensure!(
        text.lines().filter(|l| l.starts_with(installed)).count() == 1
            && text.lines().filter(|l| l.starts_with("ExecStart=")).count() == 1,
        "{} must have one ExecStart, running /usr/bin/heapprofd",
        unit.display()
    );
    let copy = scratch.join("verify/heapprofd.service");
    write(
        &copy,
        &text.replace(installed, &format!("ExecStart={} ", binary.display())),
        0o644,
    )?;
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&copy)
        // Its own environment, whatever the caller's: no user manager, no pager.
        .env("SYSTEMD_PAGER", "")
        .output()
        .context("running systemd-analyze (Debian package systemd; cargo xtask setup)")?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify {} ({}): {said}",
        unit.display(),
        out.status
    );
    Ok(())
}

/// Runs a tool to completion and returns its standard output; fails with its error output.
fn tool(program: &str, args: impl FnOnce(&mut Command) -> &mut Command) -> Result<String> {
    let mut cmd = Command::new(program);
    args(&mut cmd);
    let out: Output = cmd
        .output()
        .with_context(|| format!("running {program} (cargo xtask setup installs it)"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ls -l`'s rendering of a regular file's mode.
fn ls_mode(mode: u32) -> String {
    let mut text = String::from("-");
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        text.push(if bits & 4 != 0 { 'r' } else { '-' });
        text.push(if bits & 2 != 0 { 'w' } else { '-' });
        text.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory for one test, removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir =
                std::env::temp_dir().join(format!("heapprofd-xtask-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).expect("creating a scratch directory");
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// A small dynamically linked program standing in for heapprofd: building the real
    /// one takes minutes, and `cargo xtask test` packages and checks that one too.
    fn stand_in(dir: &Path) -> PathBuf {
        let source = dir.join("stand-in.c");
        fs::write(
            &source,
            "#include <stdio.h>\nint main(void) { puts(\"hi\"); return 0; }\n",
        )
        .expect("writing the stand-in's source");
        let binary = dir.join("heapprofd");
        let status = Command::new("gcc")
            .arg("-o")
            .arg(&binary)
            .arg(&source)
            .status()
            .expect("running gcc (cargo xtask setup installs it)");
        assert!(status.success(), "gcc failed");
        binary
    }

    fn unit_text() -> String {
        fs::read_to_string(workspace_root().join(UNIT)).expect("reading the unit")
    }

    #[test]
    fn package_holds_binary_unit_and_docs() {
        let scratch = Scratch::new("package");
        let binary = stand_in(&scratch.0);
        let out = scratch.0.join("out");
        let deb = build_deb(&binary, &out).expect("building the package");
        let arch = debian_arch(&binary).expect("the stand-in's architecture");
        assert_eq!(deb, out.join(format!("heapprofd_{VERSION}_{arch}.deb")));
        // Again over the first: same result, no leftovers.
        assert_eq!(build_deb(&binary, &out).expect("building it again"), deb);
        let left: Vec<_> = fs::read_dir(&out)
            .expect("listing the output")
            .map(|e| e.expect("an entry").file_name())
            .collect();
        assert_eq!(left, [deb.file_name().expect("a file name")]);

        let check_dir = scratch.0.join("check");
        fs::create_dir_all(&check_dir).expect("creating the check directory");
        check(&deb, &check_dir).unwrap_or_else(|e| panic!("{e:#}"));

        // The maintainer scripts are there, executable, and never enable the unit.
        let control = scratch.0.join("control");
        let listing = tool("dpkg-deb", |c| c.arg("--control").arg(&deb).arg(&control))
            .expect("extracting the control area");
        assert!(listing.is_empty(), "{listing}");
        for (name, _) in SCRIPTS {
            let path = control.join(name);
            let mode = fs::metadata(&path).expect("a script").permissions().mode();
            assert_eq!(mode & 0o777, 0o755, "{name}");
            let text = fs::read_to_string(&path).expect("reading a script");
            let commands = text.lines().filter(|l| !l.trim_start().starts_with('#'));
            for line in commands {
                let starts = ["systemctl enable", "systemctl start", "deb-systemd-helper"];
                assert!(
                    !starts.iter().any(|s| line.contains(s)),
                    "{name} enables or starts the unit: {line}"
                );
            }
            let syntax = Command::new("sh").arg("-n").arg(&path).status();
            assert!(syntax.is_ok_and(|s| s.success()), "{name} is not valid sh");
        }
    }

    #[test]
    fn verify_catches_a_broken_unit() {
        let scratch = Scratch::new("verify");
        let binary = stand_in(&scratch.0);
        let unit = workspace_root().join(UNIT);
        verify_unit(&unit, &binary, &scratch.0).unwrap_or_else(|e| panic!("{e:#}"));
        // systemd-analyze only warns about an unknown key (exit 0): the output must fail it.
        let broken = scratch.0.join("broken.service");
        fs::write(
            &broken,
            unit_text().replace("LockPersonality=yes", "LockPersonalty=yes"),
        )
        .expect("writing the broken unit");
        let err = verify_unit(&broken, &binary, &scratch.0).expect_err("an unknown key");
        assert!(format!("{err:#}").contains("LockPersonalty"), "{err:#}");
    }

    #[test]
    fn unit_runs_all_sandboxed_and_documents_its_capabilities() {
        let text = unit_text();
        let directives: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#') && l.contains('='))
            .collect();
        for want in [
            "ExecStart=/usr/bin/heapprofd --all -o /var/lib/heapprofd --interval 60s --keep 1440 --retain-exited 1h --sample-rate 512KiB",
            "StateDirectory=heapprofd",
            "ProtectSystem=strict",
            "ProtectHome=read-only",
            "PrivateTmp=yes",
            "NoNewPrivileges=yes",
            "WantedBy=multi-user.target",
        ] {
            assert!(directives.contains(&want), "the unit lacks {want}");
        }
        let set = |key: &str| -> Vec<&str> {
            let mut caps: Vec<&str> = directives
                .iter()
                .find_map(|l| l.strip_prefix(key))
                .unwrap_or_else(|| panic!("the unit lacks {key}"))
                .split_whitespace()
                .collect();
            caps.sort_unstable();
            caps
        };
        let bounding = set("CapabilityBoundingSet=");
        assert_eq!(bounding, set("AmbientCapabilities="));
        for cap in ["CAP_BPF", "CAP_PERFMON", "CAP_SYS_PTRACE"] {
            assert!(bounding.contains(&cap), "{cap} missing");
        }
        // Each one's reason is in a comment.
        for cap in &bounding {
            let reason = format!("# - {cap}");
            let listed = text.lines().any(|l| {
                l.starts_with("# - ") && l.split(':').next().is_some_and(|h| h.contains(cap))
            });
            assert!(
                listed,
                "no `{reason}...` comment says why the unit keeps {cap}"
            );
        }
    }

    #[test]
    fn architecture_comes_from_the_elf_header() {
        let own = std::env::current_exe().expect("own path");
        let want = if cfg!(target_arch = "aarch64") {
            "arm64"
        } else {
            "amd64"
        };
        assert_eq!(debian_arch(&own).expect("an ELF file"), want);
        let err = debian_arch(Path::new("/etc/hostname")).expect_err("not ELF");
        assert!(format!("{err}").contains("not a 64-bit"), "{err}");
    }

    #[test]
    fn ls_modes() {
        assert_eq!(ls_mode(0o755), "-rwxr-xr-x");
        assert_eq!(ls_mode(0o644), "-rw-r--r--");
    }
}
