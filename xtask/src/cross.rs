//! Static builds for boards: one heapprofd binary (BPF object inside) that needs
//! nothing on the target, whatever its C library (musl, linked by rust-lld); and the
//! glibc build for another architecture, the binary a native build there makes (the
//! arm64 VM test runs it on Debian's arm64 C library).

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};

use crate::{CmdExt as _, cargo, step};

// `cross::Arch` stays a name for it: the architecture lives in its own room so that
// setup (which installs per architecture) and the builds (which call setup) need not
// import each other.
pub use crate::arch::Arch;

/// Builds the static release binary for `arch`; returns its path.
pub fn build_static(arch: Arch) -> Result<PathBuf> {
    let target = arch.musl_target();
    crate::setup::ensure_rust_target(target)?;
    // The build script compiles the preload library with the target's C compiler.
    crate::setup::ensure_cross_packages(Arch::host(), arch)?;
    step(&format!("building a static heapprofd for {target}"));
    let linker_var = format!(
        "CARGO_TARGET_{}_LINKER",
        target.to_uppercase().replace('-', "_")
    );
    cargo()
        .args([
            "build",
            "--release",
            "-p",
            "heapprof-daemon",
            "--bin",
            "heapprofd",
        ])
        .args(["--target", target])
        // The musl targets bring their own C runtime objects: rust-lld links them
        // without a cross C toolchain.
        .env(linker_var, "rust-lld")
        // C code in dependencies (ring's, for the push's TLS) is compiled by Debian's gcc
        // for the architecture: cc-rs would look for a musl-named one
        // (`aarch64-linux-musl-gcc`) that Debian does not package. The code is
        // freestanding, so the glibc toolchain's objects link into the musl binary.
        .env(cc_var(target, "CC"), arch.gcc())
        .env(cc_var(target, "AR"), arch.gcc().replace("-gcc", "-ar"))
        .run()?;
    let binary = crate::target_dir().join(format!("{target}/release/heapprofd"));
    check_static(&binary, arch)?;
    Ok(binary)
}

/// cc-rs's variable `what` (`CC`, `AR`) for `target`.
fn cc_var(target: &str, what: &str) -> String {
    format!("{what}_{}", target.replace('-', "_"))
}

/// Builds the release binary for `arch` against glibc, linked by that architecture's
/// gcc (Debian's cross compiler, or the native one); returns its path.
pub fn build_glibc(arch: Arch) -> Result<PathBuf> {
    let target = arch.gnu_target();
    crate::setup::ensure_rust_target(target)?;
    let host = Arch::host();
    crate::setup::ensure_cross_packages(host, arch)?;
    step(&format!("building heapprofd for {target} (glibc)"));
    let mut cmd = cargo();
    cmd.args([
        "build",
        "--release",
        "-p",
        "heapprof-daemon",
        "--bin",
        "heapprofd",
    ])
    .args(["--target", target]);
    if arch != host {
        // Rust's default linker `cc` links for the host only.
        cmd.env(
            format!(
                "CARGO_TARGET_{}_LINKER",
                target.to_uppercase().replace('-', "_")
            ),
            arch.gcc(),
        );
    }
    cmd.run()?;
    let binary = crate::target_dir().join(format!("{target}/release/heapprofd"));
    if !program_interpreter(&binary, arch)? {
        bail!("{} is not dynamically linked", binary.display());
    }
    Ok(binary)
}

/// Checks that `binary` is an ELF executable for `arch` with no program interpreter
/// (statically linked: it starts on any Linux of that architecture).
pub fn check_static(binary: &Path, arch: Arch) -> Result<()> {
    if program_interpreter(binary, arch)? {
        bail!(
            "{} is dynamically linked (it names a program interpreter)",
            binary.display()
        );
    }
    Ok(())
}

/// Whether `binary`, checked to be a 64-bit little-endian ELF file for `arch`, names a
/// program interpreter (is dynamically linked).
fn program_interpreter(binary: &Path, arch: Arch) -> Result<bool> {
    let bytes = std::fs::read(binary).with_context(|| format!("reading {}", binary.display()))?;
    let u16_at = |at: usize| {
        bytes
            .get(at..at + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    let u64_at = |at: usize| {
        bytes
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    if bytes.get(..5) != Some(b"\x7fELF\x02") || bytes.get(5) != Some(&1) {
        bail!(
            "{} is not a 64-bit little-endian ELF file",
            binary.display()
        );
    }
    let machine = u16_at(18).context("truncated ELF header")?;
    if machine != arch.elf_machine() {
        bail!(
            "{} is for ELF machine {machine}, not {:?}",
            binary.display(),
            arch
        );
    }
    let phoff = u64_at(32).context("truncated ELF header")? as usize;
    let phentsize = usize::from(u16_at(54).context("truncated ELF header")?);
    let phnum = usize::from(u16_at(56).context("truncated ELF header")?);
    for index in 0..phnum {
        let kind = bytes
            .get(phoff + index * phentsize..phoff + index * phentsize + 4)
            .context("truncated program headers")?;
        const PT_INTERP: [u8; 4] = 3u32.to_le_bytes();
        if kind == PT_INTERP {
            return Ok(true);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_and_foreign_binaries_are_told_apart() {
        // This test binary is dynamically linked for the build machine.
        let own = std::env::current_exe().expect("own path");
        let arch = Arch::host();
        let err = check_static(&own, arch).expect_err("a dynamic binary");
        assert!(format!("{err}").contains("dynamically linked"), "{err}");
        let other = if arch == Arch::Aarch64 {
            Arch::X86_64
        } else {
            Arch::Aarch64
        };
        let err = check_static(&own, other).expect_err("another machine");
        assert!(format!("{err}").contains("ELF machine"), "{err}");
        let err = check_static(Path::new("/etc/hostname"), arch).expect_err("not ELF");
        assert!(format!("{err}").contains("not a 64-bit"), "{err}");
    }
}
