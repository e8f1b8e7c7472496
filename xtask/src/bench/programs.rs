//! The benchmark's programs, compiled from xtask/workloads/bench_*, and the tools
//! they and the baselines need (g++, tracefs).

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

use crate::{step, workspace_root};

pub(super) fn compile(source: &str, output: &Path, flags: &[&str]) -> Result<()> {
    compile_with("gcc", source, output, flags)
}

pub(super) fn compile_with(
    compiler: &str,
    source: &str,
    output: &Path,
    flags: &[&str],
) -> Result<()> {
    let root = workspace_root();
    let status = Command::new(compiler)
        .args(flags)
        .arg("-o")
        .arg(output)
        .arg(root.join("xtask/workloads").join(source))
        .status()
        .with_context(|| format!("running {compiler}"))?;
    if !status.success() {
        bail!("compiling {source} failed");
    }
    Ok(())
}

/// The benchmark's programs, compiled into target/bench from xtask/workloads/bench_*.
pub(super) struct Programs {
    pub(super) pairs: PathBuf,
    pub(super) churn: PathBuf,
    pub(super) stacks: PathBuf,
    pub(super) stl: PathBuf,
    pub(super) dlopen: PathBuf,
}

impl Programs {
    pub(super) fn compile(dir: &Path) -> Result<Self> {
        step("compiling the benchmark workloads (xtask/workloads/bench_*)");
        let programs = Programs {
            pairs: dir.join("bench_pairs"),
            churn: dir.join("bench_churn"),
            stacks: dir.join("bench_stacks"),
            stl: dir.join("bench_stl"),
            dlopen: dir.join("bench_dlopen"),
        };
        compile("bench_pairs.c", &programs.pairs, &["-O2"])?;
        compile("bench_churn.c", &programs.churn, &["-O2", "-pthread"])?;
        compile(
            "bench_stacks.c",
            &programs.stacks,
            &[
                "-O2",
                "-fno-omit-frame-pointer",
                "-fno-optimize-sibling-calls",
            ],
        )?;
        // Plain -O2: no frame pointers (the x86-64 default), as the true-stacks test builds it.
        compile_with("g++", "bench_stl.cpp", &programs.stl, &["-O2"])?;
        compile("bench_dlopen.c", &programs.dlopen, &["-O2"])?;
        Ok(programs)
    }
}

/// The C++ workload needs g++ (the `gcc` package has no C++ compiler).
pub(super) fn ensure_gxx() -> Result<()> {
    let works = || {
        Command::new("g++")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if works() {
        return Ok(());
    }
    step("installing g++ (the C++ workload) with apt-get");
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends", "g++"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    if !install() {
        let _ = Command::new("apt-get").arg("update").status();
        if !install() {
            bail!("cannot install g++ with apt-get; install it and run again");
        }
    }
    Ok(())
}

/// bpftrace needs tracefs (it detaches uprobes through it).
pub(super) fn ensure_tracefs() -> Result<()> {
    if Path::new("/sys/kernel/tracing/uprobe_events").exists() {
        return Ok(());
    }
    step("mounting tracefs at /sys/kernel/tracing (bpftrace needs it)");
    let status = Command::new("mount")
        .args(["-t", "tracefs", "tracefs", "/sys/kernel/tracing"])
        .status()
        .context("running mount")?;
    if !status.success() {
        bail!("cannot mount tracefs at /sys/kernel/tracing");
    }
    Ok(())
}
