//! Installs what building and testing heapprofd needs, and nothing that is already there.
//!
//! - the pinned stable toolchain (host crates) and the pinned nightly with rust-src and
//!   clippy (BPF crate);
//! - bpf-linker built against the nightly's own libLLVM (their LLVM majors must match);
//! - the Debian packages of [`debian_packages`]: a C compiler for every command, and
//!   what the Debian package, the tests and the benchmark use;
//! - the musl Rust targets of the static builds, when a static build first needs them.
//!
//! `cargo xtask setup --list` prints all of it ([`list`]), from the same constants, so
//! the documentation never carries a list of its own.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::{CmdExt as _, NIGHTLY, STABLE, cargo_home, step};

const BPF_LINKER_VERSION: &str = "0.13.0";

/// What to install.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Needs {
    /// Toolchains, bpf-linker, a C compiler: enough to build and run.
    Build,
    /// Also what the tests use.
    Test,
    /// What the benchmark uses (the same as the tests).
    Bench,
    /// What building and checking the Debian package uses: Build's, dpkg-dev, systemd.
    Package,
}

impl Needs {
    /// Every need, each one's packages a superset of the previous one's.
    pub const ALL: [Needs; 4] = [Needs::Build, Needs::Package, Needs::Test, Needs::Bench];

    /// Its name in `setup --list`.
    fn name(self) -> &'static str {
        match self {
            Needs::Build => "build",
            Needs::Package => "package",
            Needs::Test => "test",
            Needs::Bench => "bench",
        }
    }

    /// The commands that install this need's packages (for `setup --list`).
    fn commands(self) -> &'static str {
        match self {
            Needs::Build => "every command (build, run, soak)",
            Needs::Package => "cargo xtask package, and those below",
            Needs::Test => "cargo xtask setup, test, vm-test, stress, and bench",
            Needs::Bench => "cargo xtask bench only",
        }
    }
}

/// The Rust toolchains setup installs, each with its components.
pub const TOOLCHAINS: [(&str, &[&str]); 2] = [
    (STABLE, &["clippy", "rustfmt"]),
    (NIGHTLY, &["rust-src", "clippy"]),
];

/// Runs every install step that is needed.
pub fn ensure(needs: Needs) -> Result<()> {
    for (toolchain, components) in TOOLCHAINS {
        ensure_toolchain(toolchain, components)?;
    }
    ensure_bpf_linker()?;
    ensure_debian_packages(&debian_packages(needs))
}

/// The Debian packages `needs` asks for (a package may appear twice: installing
/// deduplicates).
pub fn debian_packages(needs: Needs) -> Vec<&'static str> {
    // gcc builds launch mode's preload library; the arm64 cross compiler builds it for
    // the board (`cargo xtask run --arch aarch64`).
    let mut packages = vec!["gcc", "libc6-dev", "gcc-aarch64-linux-gnu"];
    if needs != Needs::Build {
        // The Debian package: dpkg-shlibdeps computes its Depends, systemd-analyze
        // verifies its unit.
        packages.extend(["dpkg-dev", "systemd"]);
    }
    if matches!(needs, Needs::Test | Needs::Bench) {
        packages.extend(["golang-go", "valgrind", "bpftrace", "bpftool"]);
        // The metrics test: a real Prometheus server scrapes heapprofd.
        packages.push("prometheus");
        // The true-stacks tests: a C++ program (g++), Debian's python3 and sqlite3 as
        // real targets, glibc's separate debug symbols (valgrind depends on them too),
        // binutils for stripping a program and splitting its debug file.
        packages.extend(["g++", "python3", "sqlite3", "libc6-dbg", "binutils"]);
        // The allocator tests (tests/allocators.rs): jemalloc, tcmalloc and mimalloc
        // (preloaded and linked), musl-gcc (musl programs, dynamic and static); make
        // builds jemalloc from source for the Rust program on tikv-jemallocator.
        packages.extend([
            "libjemalloc2",
            "libtcmalloc-minimal4",
            "libmimalloc2.0",
            "musl-tools",
            "make",
        ]);
        // The report tests: google-pprof reads the legacy text format; headless
        // chromium renders the HTML page.
        packages.extend(["google-perftools", "chromium"]);
        // The arm64 VM test: the emulator, cross compilers (C and C++) for its test
        // programs, cpio for its initramfs; ssh for `xtask run --host`. The x86-64
        // VM test: its emulator.
        packages.extend([
            "qemu-system-arm",
            "qemu-system-x86",
            "gcc-aarch64-linux-gnu",
            "g++-aarch64-linux-gnu",
            "libc6-dev-arm64-cross",
            "cpio",
            "openssh-client",
        ]);
    }
    if needs == Needs::Bench {
        // The benchmark's real service: redis-server (linked with jemalloc) and its
        // redis-benchmark client; its launch-mode section's baseline, heaptrack, and its
        // sqlite3 workload (also a test target, listed above: listed again so that the
        // benchmark's needs stand on their own).
        packages.extend(["redis-server", "redis-tools", "heaptrack", "sqlite3"]);
    }
    packages
}

/// What setup installs, one item per line, for `cargo xtask setup --list`: the
/// toolchains and their components, bpf-linker, the Rust targets of the static builds,
/// then every Debian package once, under the first need that asks for it. Lines that
/// start with `#` are headings; `cargo xtask setup --list | awk '$1 == "deb" {print $2}'`
/// gives the Debian packages alone.
pub fn list() -> String {
    let mut out =
        String::from("# What cargo xtask setup and the other commands install when missing.\n");
    out.push_str("# Rust toolchains (rustup) and their components\n");
    for (toolchain, components) in TOOLCHAINS {
        out.push_str(&format!("toolchain {toolchain} {}\n", components.join(" ")));
    }
    out.push_str("# cargo tools\n");
    out.push_str(&format!(
        "cargo-install bpf-linker {BPF_LINKER_VERSION} (built against {NIGHTLY}'s libLLVM)\n"
    ));
    out.push_str(&format!(
        "# Rust targets of the static builds (toolchain {STABLE}), added by the first static build\n"
    ));
    for arch in <crate::cross::Arch as clap::ValueEnum>::value_variants() {
        out.push_str(&format!("target {}\n", arch.musl_target()));
    }
    out.push_str("# Debian packages (apt-get, through sudo when not root): deb NAME NEED\n");
    let mut seen: Vec<&str> = Vec::new();
    for needs in Needs::ALL {
        out.push_str(&format!("# {}: {}\n", needs.name(), needs.commands()));
        for package in debian_packages(needs) {
            if !seen.contains(&package) {
                seen.push(package);
                out.push_str(&format!("deb {package} {}\n", needs.name()));
            }
        }
    }
    out
}

/// Installs the standard library of `target` for the pinned stable toolchain (static
/// builds for boards).
pub fn ensure_rust_target(target: &str) -> Result<()> {
    let installed = rustup()
        .args(["target", "list", "--installed", "--toolchain", STABLE])
        .output()
        .context("listing the installed Rust targets")?;
    if String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|l| l.trim() == target)
    {
        return Ok(());
    }
    step(&format!("installing the Rust target {target} for {STABLE}"));
    rustup()
        .args(["target", "add", target, "--toolchain", STABLE])
        .run()
}

fn rustup() -> Command {
    let mut cmd = Command::new("rustup");
    cmd.env_remove("RUSTUP_TOOLCHAIN");
    cmd
}

fn ensure_toolchain(toolchain: &str, components: &[&str]) -> Result<()> {
    let installed = rustup()
        .args(["run", toolchain, "rustc", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    let listed = |kind: &str| -> Result<String> {
        let out = rustup()
            .args(["component", "list", "--installed", "--toolchain", toolchain])
            .output()
            .with_context(|| format!("listing {kind} of {toolchain}"))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    if installed {
        let have = listed("components")?;
        let missing: Vec<&&str> = components
            .iter()
            .filter(|c| {
                !have
                    .lines()
                    .any(|l| l.starts_with(&format!("{c}-")) || l == **c)
            })
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        step(&format!("adding {missing:?} to toolchain {toolchain}"));
        let mut cmd = rustup();
        cmd.args(["component", "add", "--toolchain", toolchain]);
        cmd.args(missing.iter().map(|c| **c));
        return cmd.run();
    }
    step(&format!(
        "installing Rust toolchain {toolchain} (with {components:?})"
    ));
    let mut cmd = rustup();
    cmd.args([
        "toolchain",
        "install",
        toolchain,
        "--profile",
        "minimal",
        "--no-self-update",
    ]);
    for component in components {
        cmd.args(["-c", component]);
    }
    cmd.run()
}

fn sysroot(toolchain: &str) -> Result<PathBuf> {
    let out = rustup()
        .args(["run", toolchain, "rustc", "--print", "sysroot"])
        .output()
        .context("asking rustc for its sysroot")?;
    if !out.status.success() {
        bail!("rustc {toolchain} has no sysroot");
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// The nightly's libLLVM file (its SONAME) and LLVM major version.
fn nightly_llvm() -> Result<(PathBuf, String)> {
    let lib = sysroot(NIGHTLY)?.join("lib");
    let file = std::fs::read_dir(&lib)
        .with_context(|| format!("reading {}", lib.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM.so."))
        })
        .with_context(|| format!("{NIGHTLY} ships no libLLVM.so.* in {}", lib.display()))?;
    let out = rustup().args(["run", NIGHTLY, "rustc", "-vV"]).output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let major = text
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .context("rustc -vV did not report its LLVM version")?
        .to_owned();
    Ok((file, major))
}

fn ensure_bpf_linker() -> Result<()> {
    let (llvm_lib, major) = nightly_llvm()?;
    let soname = llvm_lib
        .file_name()
        .and_then(|n| n.to_str())
        .context("libLLVM file name")?
        .to_owned();
    let linker = cargo_home().join("bin/bpf-linker");
    let works = Command::new("ldd").arg(&linker).output().is_ok_and(|o| {
        let text = String::from_utf8_lossy(&o.stdout);
        o.status.success() && text.contains(&soname) && !text.contains("not found")
    });
    if works {
        return Ok(());
    }
    step(&format!(
        "building bpf-linker {BPF_LINKER_VERSION} against {NIGHTLY}'s LLVM {major} (about a minute)"
    ));
    // bpf-linker links libLLVM.so at build time and finds it at run time through its
    // RUNPATH: give it a stable prefix whose lib/ holds both names of the nightly's library.
    let prefix = cargo_home().join(format!("heapprofd-llvm/{NIGHTLY}"));
    let prefix_lib = prefix.join("lib");
    std::fs::create_dir_all(&prefix_lib)
        .with_context(|| format!("creating {}", prefix_lib.display()))?;
    for name in ["libLLVM.so", soname.as_str()] {
        let link = prefix_lib.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&llvm_lib, &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    rustup()
        .args([
            "run",
            STABLE,
            "cargo",
            "install",
            "bpf-linker",
            "--force",
            "--locked",
        ])
        .args(["--version", BPF_LINKER_VERSION, "--no-default-features"])
        .args(["--features", &format!("llvm-{major}")])
        .env("LLVM_PREFIX", &prefix)
        .run()
}

fn has_package(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

fn ensure_debian_packages(packages: &[&str]) -> Result<()> {
    let mut missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| !has_package(p))
        .collect();
    // A package two needs list (sqlite3) is installed once.
    missing.sort_unstable();
    missing.dedup();
    if missing.is_empty() {
        return Ok(());
    }
    if !Path::new("/usr/bin/apt-get").exists() {
        bail!("missing packages {missing:?} and no apt-get to install them: install them by hand");
    }
    step(&format!("installing Debian packages {missing:?}"));
    let root = crate::is_root();
    let apt = |args: &[&str]| {
        let mut cmd = if root {
            Command::new("apt-get")
        } else {
            Command::new("sudo")
        };
        if !root {
            cmd.arg("apt-get");
        }
        cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    };
    apt(&["update", "-qq"]).run()?;
    let mut install = apt(&["install", "-y", "-qq", "--no-install-recommends"]);
    install.args(&missing);
    install.run()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_need_includes_the_previous_ones() {
        for pair in Needs::ALL.windows(2) {
            let (smaller, larger) = (debian_packages(pair[0]), debian_packages(pair[1]));
            for package in smaller {
                assert!(
                    larger.contains(&package),
                    "{package} of {:?} is missing from {:?}",
                    pair[0],
                    pair[1]
                );
            }
        }
    }

    #[test]
    fn list_names_every_package_once() {
        let list = list();
        let debs: Vec<&str> = list
            .lines()
            .filter_map(|l| l.strip_prefix("deb "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        let mut all = debian_packages(Needs::Bench);
        all.sort_unstable();
        all.dedup();
        let mut listed = debs.clone();
        listed.sort_unstable();
        assert_eq!(listed, all, "setup --list and debian_packages disagree");
        // Under the first need that asks for it.
        assert!(list.contains("deb gcc build\n"), "{list}");
        assert!(list.contains("deb dpkg-dev package\n"), "{list}");
        assert!(list.contains("deb sqlite3 test\n"), "{list}");
        assert!(list.contains("deb redis-server bench\n"), "{list}");
    }

    #[test]
    fn list_names_toolchains_tools_and_targets() {
        let list = list();
        assert!(list.contains(&format!("toolchain {STABLE} clippy rustfmt\n")));
        assert!(list.contains(&format!("toolchain {NIGHTLY} rust-src clippy\n")));
        assert!(list.contains(&format!("cargo-install bpf-linker {BPF_LINKER_VERSION} ")));
        assert!(list.contains("target aarch64-unknown-linux-musl\n"));
        assert!(list.contains("target x86_64-unknown-linux-musl\n"));
        for line in list.lines() {
            assert!(
                line.starts_with('#') || line.split_whitespace().count() >= 2,
                "line without a name: {line:?}"
            );
        }
    }
}
