//! Builds what the daemon embeds: the BPF programs (heapprof-ebpf, with aya-build)
//! and launch mode's preload library (the C interposer in `interposer/`, with the
//! target's C compiler).

use anyhow::Context as _;
use aya_build::{Package, Toolchain};

#[path = "interposer/build.rs"]
mod interposer;

/// Must match the nightly that xtask installs: bpf-linker is built against its LLVM.
const BPF_TOOLCHAIN: &str = "nightly-2026-10-30";

fn main() -> anyhow::Result<()> {
    let manifest_dir = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    interposer::build(&manifest_dir)?;
    let ebpf_dir = manifest_dir
        .parent()
        .context("daemon crate has no parent directory")?
        .join("heapprof-ebpf");
    let ebpf_dir = ebpf_dir
        .to_str()
        .context("non-UTF-8 path to heapprof-ebpf")?;
    aya_build::build_ebpf(
        [Package {
            name: "heapprof-ebpf",
            root_dir: ebpf_dir,
            ..Default::default()
        }],
        Toolchain::Custom(BPF_TOOLCHAIN),
    )
}
