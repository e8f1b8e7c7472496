//! heapprofd's developer commands, as a library: what `cargo xtask`'s commands do
//! (`main.rs` only parses the command line and calls in here), and the helpers they
//! share: progress lines, the pinned toolchains' cargo, the workspace's paths.

pub mod arch;
pub mod bench;
pub mod cross;
#[cfg(test)]
mod docs;
pub mod package;
pub mod profiles_json;
pub mod remote;
pub mod setup;
pub mod soak;
pub mod vm;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

/// Toolchain for the host crates (daemon, common, xtask's children).
pub const STABLE: &str = "1.99.1";
/// Toolchain for the BPF crate; bpf-linker is built against its LLVM.
/// Keep in sync with `BPF_TOOLCHAIN` in heapprof-daemon/build.rs.
pub const NIGHTLY: &str = "nightly-2026-10-30";

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
pub fn cargo() -> Command {
    toolchain_cargo(STABLE)
}

/// `cargo` of `toolchain`, with bpf-linker on PATH for aya-build.
pub fn toolchain_cargo(toolchain: &str) -> Command {
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

/// Builds the release heapprofd; returns its path.
pub fn build_release() -> Result<PathBuf> {
    step("building heapprofd (release)");
    cargo()
        .args(["build", "--release", "-p", "heapprof-daemon"])
        .run()?;
    Ok(target_dir().join("release/heapprofd"))
}

/// Runs heapprofd with `args` (through `sudo -E` when not root); returns its exit status.
pub fn run_heapprofd(heapprofd: &Path, args: &[String]) -> Result<std::process::ExitStatus> {
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

/// `cargo xtask run` on this machine: builds the release heapprofd, then profiles the
/// demo workload without `args`, or runs heapprofd with them (its exit status is not
/// the command's: heapprofd has printed why it failed).
pub fn run_here(args: &[String]) -> Result<()> {
    let heapprofd = build_release()?;
    if args.is_empty() {
        demo(&heapprofd)
    } else {
        run_heapprofd(&heapprofd, args).map(|_| ())
    }
}

/// Builds the bundled leaky workload, profiles it and prints the top sites.
pub fn demo(heapprofd: &Path) -> Result<()> {
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
    // heapprofd itself reads its profiles back, so the first suggestions need nothing
    // the demo did not install; go comes last, for those who have it. The profiles are
    // root's (0600), as heapprofd ran through sudo when the user is not root.
    let heapprofd = if is_root() {
        heapprofd.display().to_string()
    } else {
        format!("sudo {}", heapprofd.display())
    };
    let page = out.join("report.html");
    println!();
    println!("Profile: {}", last.display());
    println!(
        "One page of it all, in a browser:  {heapprofd} report {} --html {}",
        profiles.display(),
        page.display()
    );
    println!(
        "Its top sites again:               {heapprofd} report {}",
        last.display()
    );
    println!(
        "With Go installed:                 go tool pprof -http=: {}",
        last.display()
    );
    Ok(())
}

/// The whole suite: formatting, clippy (also on the BPF crate), the tests, the Debian
/// package.
pub fn test() -> Result<()> {
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

/// Only the VM tests (arm64 with and without BTF, arm64 fentry, x86-64 kernels), with
/// the binaries and VM assets they read.
pub fn vm_test() -> Result<()> {
    cargo()
        .args(["test", "-p", "heapprof-daemon", "--test", "arm64_vm"])
        .args(["--test", "arm64_vm_fentry", "--test", "x86_vm"])
        .args(["--", "--nocapture"])
        .envs(vm_test_env()?)
        .run()
}

/// The load tests at full scale (`HEAPPROFD_LOAD=full`), one test at a time; they load
/// BPF programs, so root only.
pub fn stress() -> Result<()> {
    if !is_root() {
        bail!("the stress tests load BPF programs: run them as root (sudo -E cargo xtask stress)");
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
pub fn vm_test_env() -> Result<Vec<(&'static str, PathBuf)>> {
    let binary = cross::build_static(cross::Arch::Aarch64)?;
    let glibc = cross::build_glibc(cross::Arch::Aarch64)?;
    let assets = vm::arm64::ensure_assets()?;
    let x86_binary = cross::build_static(cross::Arch::X86_64)?;
    let x86_assets = vm::x86::ensure_assets()?;
    Ok(vec![
        ("HEAPPROFD_AARCH64_BINARY", binary),
        ("HEAPPROFD_AARCH64_GLIBC_BINARY", glibc),
        ("HEAPPROFD_ARM64_VM_ASSETS", assets),
        ("HEAPPROFD_X86_64_BINARY", x86_binary),
        ("HEAPPROFD_X86_VM_ASSETS", x86_assets),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bpf-linker is built against xtask's nightly and aya-build compiles the BPF crate
    /// with heapprof-daemon/build.rs's: the two must name the same toolchain.
    #[test]
    fn the_bpf_build_uses_the_nightly_xtask_installs() {
        let build = std::fs::read_to_string(workspace_root().join("heapprof-daemon/build.rs"))
            .expect("heapprof-daemon/build.rs");
        let pinned = build
            .lines()
            .find_map(|line| line.strip_prefix("const BPF_TOOLCHAIN: &str = \""))
            .and_then(|rest| rest.strip_suffix("\";"))
            .expect("a BPF_TOOLCHAIN constant in heapprof-daemon/build.rs");
        assert_eq!(pinned, NIGHTLY);
    }
}
