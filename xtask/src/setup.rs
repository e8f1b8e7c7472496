//! Installs what building and testing heapprofd needs, and nothing that is already there.
//!
//! - the pinned stable toolchain (host crates) and the pinned nightly with rust-src and
//!   clippy (BPF crate);
//! - bpf-linker built against the nightly's own libLLVM (their LLVM majors must match);
//! - the Debian packages of [`debian_packages`]: a C compiler for every command, and
//!   what the Debian package, the tests and the benchmark use; a static build for
//!   another architecture adds that architecture's cross C compiler and headers
//!   ([`cross_packages`]). Both lists follow the host's architecture: a name that only
//!   the native compiler provides there is never asked for;
//! - the musl Rust targets of the static builds, when a static build first needs them,
//!   and `aarch64-unknown-linux-gnu` for the arm64 VM test's glibc build.
//!
//! `cargo xtask setup --list` prints all of it ([`list`]), from the same constants, so
//! the documentation never carries a list of its own.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::{CmdExt as _, NIGHTLY, STABLE, arch::Arch, cargo_home, step};

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

/// Runs every install step that is needed on this machine.
pub fn ensure(needs: Needs) -> Result<()> {
    for (toolchain, components) in TOOLCHAINS {
        ensure_toolchain(toolchain, components)?;
    }
    ensure_bpf_linker()?;
    let host = Arch::host();
    ensure_debian_packages(&debian_packages(needs, host), host)
}

/// Installs what a build for `target` compiles with on a `host` machine (nothing when
/// they are the same architecture).
pub fn ensure_cross_packages(host: Arch, target: Arch) -> Result<()> {
    ensure_debian_packages(&cross_packages(host, target), host)
}

/// The Debian packages a build for `target` adds on a `host` machine: the build script
/// compiles launch mode's preload library with the target's C compiler, against its C
/// library headers. The host's own `gcc` builds for the host.
pub fn cross_packages(host: Arch, target: Arch) -> Vec<&'static str> {
    if host == target {
        Vec::new()
    } else {
        target.cross_c_packages().to_vec()
    }
}

/// The Debian packages `needs` asks for on a `host` machine (a package may appear
/// twice: installing deduplicates).
pub fn debian_packages(needs: Needs, host: Arch) -> Vec<&'static str> {
    // gcc builds launch mode's preload library (and the demo's program) for the host.
    let mut packages = vec!["gcc", "libc6-dev"];
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
        // The injection stress test (tests/inject_stress.rs): real services joined and
        // left under load, redis-server under redis-benchmark (redis-tools) and nginx
        // under ab (apache2-utils), and a JVM running a program javac compiles.
        packages.extend([
            "redis-server",
            "redis-tools",
            "nginx",
            "apache2-utils",
            "openjdk-17-jdk-headless",
        ]);
        // The arm64 VM test: the emulator, cpio for its initramfs; ssh for `xtask run
        // --host`. The x86-64 VM test: its emulator, and mke2fs for its bpftrace disk.
        packages.extend([
            "qemu-system-arm",
            "qemu-system-x86",
            "cpio",
            "openssh-client",
            "e2fsprogs",
        ]);
        // The suite's static aarch64 build, the VM test's programs (C and C++), and the
        // unwind tests' objects and libraries of both architectures: built by
        // TRIPLET-gcc and TRIPLET-g++, which the host's gcc and g++ (listed above)
        // provide for its own architecture, and Debian's cross compilers (with the
        // other architecture's libc6 and libstdc++6 cross packages) for the other.
        for target in [Arch::X86_64, Arch::Aarch64] {
            if target != host {
                packages.extend(cross_packages(host, target));
                packages.push(target.cross_cxx_package());
            }
        }
    }
    if needs == Needs::Bench {
        // The benchmark's real service: redis-server (linked with jemalloc) and its
        // redis-benchmark client; its launch-mode section's baseline, heaptrack, and its
        // sqlite3 workload (redis and sqlite3 are test targets too, listed above: listed
        // again so that the benchmark's needs stand on their own).
        packages.extend(["redis-server", "redis-tools", "heaptrack", "sqlite3"]);
    }
    packages
}

/// What setup installs on a `host` machine, one item per line, for `cargo xtask setup
/// --list`: the toolchains and their components, bpf-linker, the Rust targets of the
/// static builds, then every Debian package once, under the first need that asks for
/// it (`build`, the static builds for another architecture as `cross-ARCH`, `package`,
/// `test`, `bench`). Lines that start with `#` are headings; `cargo xtask setup --list
/// | awk '$1 == "deb" {print $2}'` gives the Debian packages alone.
pub fn list(host: Arch) -> String {
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
    let arches = <Arch as clap::ValueEnum>::value_variants();
    for arch in arches {
        out.push_str(&format!("target {}\n", arch.musl_target()));
    }
    if host != Arch::Aarch64 {
        out.push_str(&format!(
            "# and the arm64 VM test's glibc build\ntarget {}\n",
            Arch::Aarch64.gnu_target()
        ));
    }
    out.push_str(&format!(
        "# Debian packages on this {} host (apt-get, through sudo when not root): deb NAME NEED\n",
        host.debian_arch()
    ));
    let mut seen: Vec<&str> = Vec::new();
    let mut section =
        |out: &mut String, name: String, commands: String, packages: Vec<&'static str>| {
            out.push_str(&format!("# {name}: {commands}\n"));
            for package in packages {
                if !seen.contains(&package) {
                    seen.push(package);
                    out.push_str(&format!("deb {package} {name}\n"));
                }
            }
        };
    for needs in Needs::ALL {
        section(
            &mut out,
            needs.name().to_owned(),
            needs.commands().to_owned(),
            debian_packages(needs, host),
        );
        // The cross builds come right after the build need they extend.
        if needs == Needs::Build {
            for &target in arches.iter().filter(|&&a| a != host) {
                let arch = format!("{target:?}").to_lowercase();
                section(
                    &mut out,
                    format!("cross-{arch}"),
                    format!("cargo xtask build --target {arch}, run --host --target {arch}"),
                    cross_packages(host, target),
                );
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

/// The `dpkg-query -W` format [`installed_names`] reads.
const DPKG_FORMAT: &str = "-f=${Status}\t${Package}\t${Architecture}\t${Provides}\n";

/// The names apt counts as installed, from `dpkg-query -W` in [`DPKG_FORMAT`]: every
/// installed package of the host's architecture (or `all`), and every name such a
/// package provides. On arm64, `gcc` provides `gcc-aarch64-linux-gnu`: `apt-get install
/// gcc-aarch64-linux-gnu` then installs nothing, and setup must not ask again.
fn installed_names(dpkg_query: &str, host: Arch) -> Vec<String> {
    let mut names = Vec::new();
    for line in dpkg_query.lines() {
        let mut fields = line.split('\t');
        let (Some(status), Some(package), Some(arch)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        // "install ok installed", "hold ok installed"; not "deinstall ok config-files".
        if status.split_whitespace().last() != Some("installed")
            || (arch != host.debian_arch() && arch != "all")
        {
            continue;
        }
        names.push(package.to_owned());
        // "c-compiler, gcc-aarch64-linux-gnu (= 4:12.2.0-3)"
        let provides = fields.next().unwrap_or("");
        names.extend(
            provides
                .split(',')
                .filter_map(|p| p.split_whitespace().next())
                .map(|p| p.split(':').next().unwrap_or(p).to_owned()),
        );
    }
    names.sort_unstable();
    names.dedup();
    names
}

/// Which of `packages` this `host` machine lacks, as apt judges it (sorted, each once).
fn missing_packages<'a>(packages: &[&'a str], host: Arch) -> Vec<&'a str> {
    if packages.is_empty() {
        return Vec::new();
    }
    // Without dpkg-query nothing counts as installed: apt-get, or the error after it,
    // then says what is missing.
    let installed = Command::new("dpkg-query")
        .args(["-W", DPKG_FORMAT])
        .output()
        .map(|o| installed_names(&String::from_utf8_lossy(&o.stdout), host))
        .unwrap_or_default();
    let mut missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| installed.binary_search_by(|n| n.as_str().cmp(p)).is_err())
        .collect();
    // A package two needs list (sqlite3) is installed once.
    missing.sort_unstable();
    missing.dedup();
    missing
}

fn ensure_debian_packages(packages: &[&str], host: Arch) -> Result<()> {
    let missing = missing_packages(packages, host);
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

    const HOSTS: [Arch; 2] = [Arch::X86_64, Arch::Aarch64];

    #[test]
    fn each_need_includes_the_previous_ones() {
        for host in HOSTS {
            for pair in Needs::ALL.windows(2) {
                let (smaller, larger) = (
                    debian_packages(pair[0], host),
                    debian_packages(pair[1], host),
                );
                for package in smaller {
                    assert!(
                        larger.contains(&package),
                        "{host:?}: {package} of {:?} is missing from {:?}",
                        pair[0],
                        pair[1]
                    );
                }
            }
        }
    }

    #[test]
    fn a_cross_build_installs_the_compiler_and_headers_it_compiles_with() {
        // The preload library's `#include <stdint.h>` needs the cross headers.
        assert_eq!(
            cross_packages(Arch::X86_64, Arch::Aarch64),
            ["gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross"]
        );
        assert_eq!(
            cross_packages(Arch::Aarch64, Arch::X86_64),
            ["gcc-x86-64-linux-gnu", "libc6-dev-amd64-cross"]
        );
        // A build for the host's own architecture uses the native gcc.
        for host in HOSTS {
            assert!(cross_packages(host, host).is_empty(), "{host:?}");
        }
    }

    #[test]
    fn no_need_asks_for_a_name_the_native_compilers_only_provide() {
        // On arm64, gcc and g++ provide gcc-aarch64-linux-gnu and g++-aarch64-linux-gnu
        // (and on amd64 the x86-64 names): dpkg never reports those names installed.
        for host in HOSTS {
            let [native_gcc, _] = host.cross_c_packages();
            let provided = [native_gcc, host.cross_cxx_package()];
            let mut asked: Vec<&str> = Needs::ALL
                .iter()
                .flat_map(|&needs| debian_packages(needs, host))
                .collect();
            for target in HOSTS {
                asked.extend(cross_packages(host, target));
            }
            for name in provided {
                assert!(!asked.contains(&name), "{host:?} asks for {name}");
            }
            // What the test suite compiles with is there all the same.
            let test = debian_packages(Needs::Test, host);
            assert!(test.contains(&"gcc") && test.contains(&"g++"), "{test:?}");
        }
        let on_x86 = debian_packages(Needs::Test, Arch::X86_64);
        for package in [
            "gcc-aarch64-linux-gnu",
            "g++-aarch64-linux-gnu",
            "libc6-dev-arm64-cross",
        ] {
            assert!(on_x86.contains(&package), "{package}: {on_x86:?}");
        }
    }

    #[test]
    fn installed_is_judged_as_apt_judges_it() {
        // dpkg-query -W output on an arm64 host (gcc's Provides as bookworm has them).
        let dpkg = "install ok installed\tgcc\tarm64\tc-compiler, gcc-aarch64-linux-gnu (= 4:12.2.0-3)\n\
                    install ok installed\tg++\tarm64\tc++-compiler, g++-aarch64-linux-gnu (= 4:12.2.0-3)\n\
                    hold ok installed\tlibc6-dev\tarm64\tlibc-dev, libc6-dev-arm64-cross:any\n\
                    install ok installed\tcpio\tarm64\t\n\
                    install ok installed\tpython3\tall\n\
                    deinstall ok config-files\tvalgrind\tarm64\t\n\
                    install ok installed\tbpftrace\tamd64\t\n\
                    unknown ok not-installed\tgolang-go\t\t\n";
        let names = installed_names(dpkg, Arch::Aarch64);
        for name in [
            "gcc",
            "gcc-aarch64-linux-gnu",
            "g++-aarch64-linux-gnu",
            "c-compiler",
            "libc6-dev",
            "libc6-dev-arm64-cross",
            "cpio",
            "python3",
        ] {
            assert!(
                names.iter().any(|n| n == name),
                "{name} not installed: {names:?}"
            );
        }
        // Removed, never installed, or of another architecture.
        for name in ["valgrind", "golang-go", "bpftrace"] {
            assert!(
                !names.iter().any(|n| n == name),
                "{name} installed: {names:?}"
            );
        }
        // The same packages seen from an amd64 host: the amd64 one and the `all` one.
        assert_eq!(installed_names(dpkg, Arch::X86_64), ["bpftrace", "python3"]);
    }

    /// On this machine, through the real dpkg-query: where `gcc` is installed, the name
    /// it provides for the host's own architecture (`gcc-x86-64-linux-gnu` on amd64,
    /// `gcc-aarch64-linux-gnu` on arm64) counts as installed too, as apt counts it.
    #[test]
    fn the_native_compilers_provided_names_count_as_installed() {
        let host = Arch::host();
        if !missing_packages(&["gcc"], host).is_empty() {
            // CI installs gcc (the build needs): there a missing one is a failure.
            assert!(
                std::env::var_os("CI").is_none(),
                "gcc is not installed (dpkg-query)"
            );
            eprintln!("skipping: no gcc installed (dpkg-query)");
            return;
        }
        let [provided, _] = host.cross_c_packages();
        assert_eq!(
            missing_packages(&["gcc", provided], host),
            Vec::<&str>::new()
        );
        // And a name nothing installs is still missing.
        let absent = "heapprofd-no-such-package";
        assert_eq!(missing_packages(&["gcc", absent], host), [absent]);
    }

    #[test]
    fn list_names_every_package_once() {
        for host in HOSTS {
            let list = list(host);
            let debs: Vec<&str> = list
                .lines()
                .filter_map(|l| l.strip_prefix("deb "))
                .filter_map(|l| l.split_whitespace().next())
                .collect();
            let mut all = debian_packages(Needs::Bench, host);
            for target in HOSTS {
                all.extend(cross_packages(host, target));
            }
            all.sort_unstable();
            all.dedup();
            let mut listed = debs.clone();
            listed.sort_unstable();
            assert_eq!(listed, all, "setup --list and the package lists disagree");
            // Under the first need that asks for it.
            assert!(list.contains("deb gcc build\n"), "{list}");
            assert!(list.contains("deb dpkg-dev package\n"), "{list}");
            assert!(list.contains("deb sqlite3 test\n"), "{list}");
            assert!(list.contains("deb redis-server test\n"), "{list}");
            assert!(list.contains("deb heaptrack bench\n"), "{list}");
        }
    }

    #[test]
    fn list_follows_the_host_architecture() {
        let x86 = list(Arch::X86_64);
        assert!(x86.contains("on this amd64 host"), "{x86}");
        assert!(
            x86.contains("deb gcc-aarch64-linux-gnu cross-aarch64\n"),
            "{x86}"
        );
        assert!(
            x86.contains("deb libc6-dev-arm64-cross cross-aarch64\n"),
            "{x86}"
        );
        assert!(x86.contains("deb g++-aarch64-linux-gnu test\n"), "{x86}");
        assert!(x86.contains("target aarch64-unknown-linux-gnu\n"), "{x86}");
        assert!(!x86.contains("x86-64-linux-gnu"), "{x86}");
        let arm = list(Arch::Aarch64);
        assert!(arm.contains("deb g++-x86-64-linux-gnu test\n"), "{arm}");
        assert!(arm.contains("on this arm64 host"), "{arm}");
        assert!(
            arm.contains("deb gcc-x86-64-linux-gnu cross-x86_64\n"),
            "{arm}"
        );
        assert!(
            arm.contains("deb libc6-dev-amd64-cross cross-x86_64\n"),
            "{arm}"
        );
        assert!(!arm.contains("aarch64-linux-gnu"), "{arm}");
        assert!(!arm.contains("arm64-cross"), "{arm}");
        assert!(!arm.contains("aarch64-unknown-linux-gnu"), "{arm}");
    }

    #[test]
    fn list_names_toolchains_tools_and_targets() {
        let list = list(Arch::host());
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
