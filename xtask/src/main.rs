//! heapprofd's developer commands: `cargo xtask setup | build | run | test | vm-test |
//! stress | soak | bench | package`.
//!
//! Every command first installs what it needs (see `setup`; `cargo xtask setup --list`
//! prints it), so the README's two commands work on a fresh machine with rustup and
//! a C compiler (`gcc`, `libc6-dev`: cargo links xtask itself with it, so setup
//! cannot install it).

use anyhow::{Result, bail};
use clap::{Parser, Subcommand};
use xtask::{
    arch::Arch, bench, build_release, cross, package, remote, run_here, setup, soak, stress, test,
    vm_test,
};

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
        target: Option<Arch>,
    },
    /// Without arguments: profile a bundled leaky program and show the result.
    /// With arguments after `--`: run heapprofd with them (through sudo -E when not root).
    /// With --host: copy a static build to that machine over ssh, run it there with sudo,
    /// and fetch the profiles back into target/remote/HOST/.
    Run {
        /// Architecture of the static build for --host (default aarch64: a Rock 5B).
        #[arg(long, value_enum)]
        target: Option<Arch>,
        /// Run on this machine (`[user@]host`, reachable by ssh with a key).
        #[arg(long, value_name = "HOST")]
        host: Option<String>,
        /// Arguments for heapprofd.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Run the whole test suite: formatting, clippy (also on the BPF crate for the bpf
    /// target), unit and BPF integration tests, the static aarch64 and x86-64 builds,
    /// the arm64 and x86-64 VM tests, and the Debian package.
    Test,
    /// Only the VM tests: the static aarch64 heapprofd under Debian's arm64 6.1
    /// kernel in qemu, with and without BTF, and its kernel mode's fentry programs under
    /// the arm64 6.12 kernel; the static x86-64 heapprofd's kernel mode under Debian's
    /// amd64 5.10, 6.1, 6.12 (with bpftrace beside it) and trixie-backports' (6.18+)
    /// kernels.
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
        /// library, dumps, shutdown, load, redis, nginx, fleet, launch, kernel, and none (the
        /// workloads named alone).
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
            print!("{}", setup::list(Arch::host()));
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
            let binary = cross::build_static(target.unwrap_or(Arch::Aarch64))?;
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
            run_here(&args)
        }
        Cmd::Test => {
            setup::ensure(setup::Needs::Test)?;
            test()
        }
        Cmd::VmTest => {
            setup::ensure(setup::Needs::Test)?;
            vm_test()
        }
        Cmd::Stress => {
            setup::ensure(setup::Needs::Test)?;
            stress()
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
