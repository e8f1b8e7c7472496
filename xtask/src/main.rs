//! heapprofd's developer commands: `cargo xtask setup | build | run | test | vm-test |
//! stress | soak | bench | package`.
//!
//! Every command first installs what it needs (see `setup`; `cargo xtask setup --list`
//! prints it), so the README's two commands work on a fresh machine with only rustup.

mod bench;
mod cross;
#[cfg(test)]
mod docs;
mod package;
mod remote;
mod setup;
mod soak;
mod vm;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};

/// Toolchain for the host crates (daemon, common, xtask's children).
pub const STABLE: &str = "1.99.1";
/// Toolchain for the BPF crate; bpf-linker is built against its LLVM.
/// Keep in sync with `BPF_TOOLCHAIN` in heapprof-daemon/build.rs.
pub const NIGHTLY: &str = "nightly-2026-10-30";

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Build, demo and test heapprofd")]
struct Args {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install toolchains, bpf-linker and the Debian packages the tests need (idempotent).
    Setup {
        /// Only print what setup and the other commands install (toolchains, cargo tools,
        /// Rust targets, and Debian packages, each under the need that first asks for it:
        /// build, package, test, bench); install nothing.
        #[arg(long)]
        list: bool,
    },
    /// Build heapprofd (release) into target/release/heapprofd, or with --target a
    /// static binary for that architecture into target/<arch>-unknown-linux-musl/release/.
    Build {
        /// Build one static binary (BPF object inside) for this architecture.
        #[arg(long, value_enum)]
        target: Option<cross::Arch>,
    },
    /// Without arguments: profile a bundled leaky program and show the result.
    /// With arguments after `--`: run heapprofd with them (through sudo -E when not root).
    /// With --host: copy a static build to that machine over ssh, run it there with sudo,
    /// and fetch the profiles back into target/remote/HOST/.
    Run {
        /// Architecture of the static build for --host (default aarch64: a Rock 5B).
        #[arg(long, value_enum)]
        target: Option<cross::Arch>,
        /// Run on this machine (`[user@]host`, reachable by ssh with a key).
        #[arg(long, value_name = "HOST")]
        host: Option<String>,
        /// Arguments for heapprofd.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Run the whole test suite: formatting, clippy (also on the BPF crate for the bpf
    /// target), unit and BPF integration tests, the static aarch64 build, the arm64 VM
    /// test, and the Debian package.
    Test,
    /// Only the arm64 VM test: the static aarch64 heapprofd under Debian's arm64 6.1
    /// kernel in qemu, with and without BTF.
    VmTest,
    /// The load tests at full scale (8 threads x 1M allocations, 1M live blocks), with
    /// their figures. Needs root.
    Stress,
    /// Run a churn workload under heapprofd for N minutes, recording its memory and
    /// table occupancy each interval; fails if its memory grows. Needs root.
    Soak {
        /// How long.
        #[arg(long, default_value_t = 10)]
        minutes: u32,
        /// Processes coming and going under `heapprofd --all --retain-exited` instead
        /// of one churning process.
        #[arg(long)]
        all: bool,
    },
    /// Measure heapprofd's overhead against bare runs, empty probes and a bpftrace
    /// memleak script; writes target/bench/summary.{txt,json}. Needs root.
    Bench {
        /// Runs of each workload in each mode (medians and ranges are reported).
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Smaller workloads and a shorter daemon-load run.
        #[arg(long)]
        quick: bool,
        /// Only this workload or section (repeatable): workloads pairs, churn, perl,
        /// cxx_stl, python3 (the sections run too unless some are named); sections
        /// library, dumps, shutdown, load, redis, launch, and none (the workloads
        /// named alone).
        #[arg(long, value_name = "WORKLOAD")]
        only: Vec<String>,
    },
    /// Build a Debian package of heapprofd (release binary, systemd unit, README) into
    /// target/package/heapprofd_VERSION_ARCH.deb and print its path.
    Package {
        /// Also check it: contents, modes, control fields, and `systemd-analyze verify`
        /// on its unit.
        #[arg(long)]
        check: bool,
    },
}

fn main() {
    if let Err(err) = run(Args::parse()) {
        eprintln!("xtask: error: {err:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    match args.command {
        Cmd::Setup { list: true } => {
            print!("{}", setup::list(cross::Arch::host()));
            Ok(())
        }
        Cmd::Setup { list: false } => setup::ensure(setup::Needs::Test),
        Cmd::Build { target: None } => {
            setup::ensure(setup::Needs::Build)?;
            build_release().map(|_| ())
        }
        Cmd::Build { target: Some(arch) } => {
            setup::ensure(setup::Needs::Build)?;
            let binary = cross::build_static(arch)?;
            println!("{}", binary.display());
            Ok(())
        }
        Cmd::Run {
            target,
            host: Some(host),
            args,
        } => {
            setup::ensure(setup::Needs::Build)?;
            let binary = cross::build_static(target.unwrap_or(cross::Arch::Aarch64))?;
            remote::run(&binary, &host, &args)
        }
        Cmd::Run {
            target: Some(_),
            host: None,
            ..
        } => bail!("--target needs --host: give the board to run on (e.g. --host rock@rock5b)"),
        Cmd::Run {
            target: None,
            host: None,
            args,
        } => {
            setup::ensure(setup::Needs::Build)?;
            let heapprofd = build_release()?;
            if args.is_empty() {
                demo(&heapprofd)
            } else {
                run_heapprofd(&heapprofd, &args).map(|_| ())
            }
        }
        Cmd::Test => {
            setup::ensure(setup::Needs::Test)?;
            test()
        }
        Cmd::VmTest => {
            setup::ensure(setup::Needs::Test)?;
            cargo()
                .args(["test", "-p", "heapprof-daemon", "--test", "arm64_vm"])
                .args(["--", "--nocapture"])
                .envs(vm_test_env()?)
                .run()
        }
        Cmd::Stress => {
            setup::ensure(setup::Needs::Test)?;
            if !is_root() {
                bail!(
                    "the stress tests load BPF programs: run them as root (sudo -E cargo xtask stress)"
                );
            }
            cargo()
                .args([
                    "test",
                    "--release",
                    "-p",
                    "heapprof-daemon",
                    "--test",
                    "load",
                    "--test",
                    "inject_stress",
                ])
                .args(["--", "--nocapture", "--test-threads", "1"])
                .env("HEAPPROFD_LOAD", "full")
                .run()
        }
        Cmd::Soak { minutes, all } => {
            setup::ensure(setup::Needs::Build)?;
            let heapprofd = build_release()?;
            soak::soak(&heapprofd, minutes, all)
        }
        Cmd::Bench { runs, quick, only } => {
            setup::ensure(setup::Needs::Bench)?;
            let heapprofd = build_release()?;
            bench::bench(&heapprofd, &bench::Options { runs, quick, only })
        }
        Cmd::Package { check } => {
            setup::ensure(setup::Needs::Package)?;
            let deb = package::package(check)?;
            println!("{}", deb.display());
            Ok(())
        }
    }
}

/// Prints a progress line.
pub fn step(message: &str) {
    eprintln!("xtask: {message}");
}

/// Whether we run as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `$CARGO_HOME`, defaulting as cargo does.
pub fn cargo_home() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| home().join(".cargo"))
}

fn home() -> PathBuf {
    std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from)
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` when set (relative to the workspace),
/// else `target/` in the workspace.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => workspace_root().join(dir),
        _ => workspace_root().join("target"),
    }
}

/// The repository's top directory.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// Runs commands, failing with the command line when they fail.
pub trait CmdExt {
    /// Runs to completion; an error names the command and its status.
    fn run(&mut self) -> Result<()>;
}

impl CmdExt for Command {
    fn run(&mut self) -> Result<()> {
        let status = self
            .status()
            .with_context(|| format!("cannot start {:?}", self.get_program()))?;
        if !status.success() {
            bail!("{self:?} failed ({status})");
        }
        Ok(())
    }
}

/// `cargo` of the pinned stable toolchain, with bpf-linker on PATH for aya-build.
fn cargo() -> Command {
    toolchain_cargo(STABLE)
}

/// `cargo` of `toolchain`, with bpf-linker on PATH for aya-build.
fn toolchain_cargo(toolchain: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", toolchain, "cargo"]);
    // Variables that `cargo xtask` itself set for this process would leak into the child build.
    for var in [
        "RUSTUP_TOOLCHAIN",
        "CARGO",
        "RUSTC",
        "RUSTDOC",
        "CARGO_MANIFEST_DIR",
        "CARGO_PKG_NAME",
    ] {
        cmd.env_remove(var);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![cargo_home().join("bin")];
    paths.extend(std::env::split_paths(&path));
    if let Ok(joined) = std::env::join_paths(paths) {
        cmd.env("PATH", joined);
    }
    cmd.current_dir(workspace_root());
    cmd
}

fn build_release() -> Result<PathBuf> {
    step("building heapprofd (release)");
    cargo()
        .args(["build", "--release", "-p", "heapprof-daemon"])
        .run()?;
    Ok(target_dir().join("release/heapprofd"))
}

fn run_heapprofd(heapprofd: &Path, args: &[String]) -> Result<std::process::ExitStatus> {
    let mut cmd = if is_root() {
        Command::new(heapprofd)
    } else {
        let mut sudo = Command::new("sudo");
        sudo.arg("-E").arg(heapprofd);
        sudo
    };
    cmd.args(args);
    cmd.status()
        .with_context(|| format!("cannot start {}", heapprofd.display()))
}

/// Builds the bundled leaky workload, profiles it and prints the top sites.
fn demo(heapprofd: &Path) -> Result<()> {
    let root = workspace_root();
    let out = root.join("target/demo");
    std::fs::create_dir_all(&out)?;
    let workload = out.join("leaky");
    step("compiling the demo workload xtask/workloads/leaky.c");
    Command::new("gcc")
        .args(["-O1", "-g", "-fno-omit-frame-pointer", "-pthread", "-o"])
        .arg(&workload)
        .arg(root.join("xtask/workloads/leaky.c"))
        .run()?;
    let profiles = out.join("profiles");
    let _ = std::fs::remove_dir_all(&profiles);
    step("profiling it: heapprofd --top 8 -o target/demo/profiles -- target/demo/leaky");
    let args: Vec<String> = vec![
        "--top".into(),
        "8".into(),
        "-o".into(),
        profiles.display().to_string(),
        "--".into(),
        workload.display().to_string(),
    ];
    let status = run_heapprofd(heapprofd, &args)?;
    if !status.success() {
        bail!("heapprofd failed ({status})");
    }
    let mut written: Vec<PathBuf> = std::fs::read_dir(&profiles)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "gz"))
        .collect();
    written.sort();
    let last = written.last().context("heapprofd wrote no profile")?;
    println!();
    println!("Profile: {}", last.display());
    println!("Open it with:  go tool pprof -http=: {}", last.display());
    println!(
        "Or in text:    go tool pprof -top -sample_index=inuse_space {}",
        last.display()
    );
    Ok(())
}

fn test() -> Result<()> {
    step("checking formatting");
    cargo().args(["fmt", "--all", "--", "--check"]).run()?;
    step("running clippy");
    cargo()
        .args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ])
        .run()?;
    for arch in BPF_TARGET_ARCHES {
        step(&format!(
            "running clippy on the BPF programs (bpf_target_arch {arch})"
        ));
        bpf_clippy(arch).run()?;
    }
    let vm_env = vm_test_env()?;
    step("running the tests (the BPF integration tests need root)");
    cargo()
        .args(["test", "--workspace"])
        .env("RUST_BACKTRACE", "1")
        .envs(vm_env)
        .run()?;
    // The unit tests check the package's layout around a stand-in binary; this is the
    // real `cargo xtask package`, checked the same way.
    step("building the Debian package and checking it");
    package::package(true).map(|_| ())
}

/// The `bpf_target_arch` values the BPF programs are checked for: the daemon's targets
/// (heapprof-ebpf/src/regs.rs reads registers by architecture).
const BPF_TARGET_ARCHES: [&str; 2] = ["x86_64", "aarch64"];

/// Clippy on the BPF crate, and on heapprof-common as built for it, warnings denied.
/// `clippy --workspace` sees none of the BPF code, which only compiles for the bpf
/// target; this builds it as aya-build does (`--release`, `--cfg bpf_target_arch`),
/// in a target directory of its own for each architecture.
fn bpf_clippy(arch: &str) -> Command {
    let mut cmd = toolchain_cargo(NIGHTLY);
    cmd.args([
        "clippy",
        "--package",
        "heapprof-ebpf",
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        "--release",
        "--target-dir",
    ])
    .arg(target_dir().join("bpf-clippy").join(arch))
    .args(["--", "-D", "warnings"])
    .env(
        "CARGO_ENCODED_RUSTFLAGS",
        format!("--cfg=bpf_target_arch=\"{arch}\""),
    );
    cmd
}

/// What the arm64 VM test needs, as the environment it reads: the static aarch64
/// binary, the glibc one (what a native build on a board makes), and the VM's kernel,
/// busybox and C library.
fn vm_test_env() -> Result<Vec<(&'static str, PathBuf)>> {
    let binary = cross::build_static(cross::Arch::Aarch64)?;
    let glibc = cross::build_glibc(cross::Arch::Aarch64)?;
    let assets = vm::ensure_assets()?;
    Ok(vec![
        ("HEAPPROFD_AARCH64_BINARY", binary),
        ("HEAPPROFD_AARCH64_GLIBC_BINARY", glibc),
        ("HEAPPROFD_ARM64_VM_ASSETS", assets),
    ])
}
