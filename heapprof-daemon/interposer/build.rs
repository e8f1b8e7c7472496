//! Build step of the preload library (included by the daemon's build script): writes
//! `preload_abi.h` from `heapprof_common::preload`, the interface's one definition,
//! and compiles the interposer's C parts (`interposer.h` lists them: the wrappers,
//! the queue and reporting, fork safety, joining, `got.c` and `exec_follow.c`) into
//! `$OUT_DIR/libheapprofd_preload.so` for the target's architecture.

use std::{fmt::Write as _, path::Path, process::Command};

use anyhow::{Context as _, Result, bail};
use heapprof_common::preload::{
    FOLLOW_ENV, FUNCTIONS, JoinRefused, KEPT_PRELOAD_PREFIX, Kind, Meta, PROBE_SITE_SYMBOL,
    QUEUE_WORDS, REPLIES_FD_ENV, REPLY_READS, REPLY_SLOTS, Record, ReportQueue, SAMPLE_RATE_ENV,
    SYSTEM_OPT_OUT_ENV, SYSTEM_OPT_OUT_VALUE, SYSTEM_SOCKET, StackReply, SystemJoin,
};

/// The library's file name in `$OUT_DIR`.
const OUTPUT: &str = "libheapprofd_preload.so";

/// The system-wide preload's build of it (`-DHP_SYSTEM_PRELOAD`).
const SYSTEM_OUTPUT: &str = "libheapprofd_system.so";

/// The interposer's folder, from the daemon crate's root.
const DIR: &str = "interposer";

/// Writes the header and compiles the library.
pub fn build(manifest_dir: &Path) -> Result<()> {
    let dir = manifest_dir.join(DIR);
    // A folder is watched whole: a part added or changed rebuilds the library.
    println!("cargo:rerun-if-changed={}", dir.display());
    let sources = c_sources(&dir)?;
    println!("cargo:rerun-if-env-changed=HEAPPROFD_PRELOAD_CC");
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("preload_abi.h"), header()).context("writing preload_abi.h")?;
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH")?;
    let compiler = compiler(&arch)?;
    compile(&compiler, &arch, &out_dir, &sources, &[], OUTPUT)?;
    // The same parts, built for /etc/ld.so.preload: no allocation function is
    // exported (the copy binds nothing until it joins a running heapprofd).
    compile(
        &compiler,
        &arch,
        &out_dir,
        &sources,
        &["-DHP_SYSTEM_PRELOAD=1"],
        SYSTEM_OUTPUT,
    )
}

/// Compiles `sources` into `$OUT_DIR/output`.
fn compile(
    compiler: &str,
    arch: &str,
    out_dir: &Path,
    sources: &[std::path::PathBuf],
    defines: &[&str],
    output: &str,
) -> Result<()> {
    let mut command = Command::new(compiler);
    command
        .args(["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror"])
        .args(["-shared", "-fPIC", "-nostdlib", "-fvisibility=hidden"])
        // The wrappers read the caller's frame pointer from their frame record.
        .args(["-fno-omit-frame-pointer", "-fno-stack-protector"])
        .args(["-fasynchronous-unwind-tables", "-fno-exceptions"])
        .arg("-Wl,-z,nodelete")
        .arg("-Wl,--hash-style=both")
        .args(defines)
        .arg("-I")
        .arg(out_dir)
        .args(sources)
        .arg("-o")
        .arg(out_dir.join(output));
    if arch == "x86_64" {
        // The probe site is called from inline assembly: nothing below the stack
        // pointer may be live.
        command.arg("-mno-red-zone");
    }
    if arch == "aarch64" {
        // Atomics inline: the outline helpers live in libgcc, which is not linked.
        command.arg("-mno-outline-atomics");
    }
    let status = command.status().with_context(|| {
        format!(
            "running the C compiler `{compiler}` for the preload library (install it, \
             or name another with HEAPPROFD_PRELOAD_CC)"
        )
    })?;
    if !status.success() {
        bail!("{compiler} failed to build the preload library {output} ({status})");
    }
    Ok(())
}

/// Every `.c` file of the interposer's folder, sorted (the link order stays fixed).
fn c_sources(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut sources = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry
            .with_context(|| format!("reading {}", dir.display()))?
            .path();
        if path.extension().is_some_and(|extension| extension == "c") {
            sources.push(path);
        }
    }
    sources.sort();
    Ok(sources)
}

/// The C compiler for `arch`: `HEAPPROFD_PRELOAD_CC`, else the host's `cc` for the
/// host's architecture and Debian's cross compiler for another.
fn compiler(arch: &str) -> Result<String> {
    if let Ok(compiler) = std::env::var("HEAPPROFD_PRELOAD_CC") {
        return Ok(compiler);
    }
    let host = std::env::var("HOST")?;
    if host.starts_with(arch) {
        return Ok("cc".into());
    }
    match arch {
        "aarch64" => Ok("aarch64-linux-gnu-gcc".into()),
        "x86_64" => Ok("x86_64-linux-gnu-gcc".into()),
        other => bail!("no preload library for the {other} architecture"),
    }
}

/// `preload_abi.h`: the constants and layouts of `heapprof_common::preload`.
fn header() -> String {
    let mut h = String::from(
        "/* Generated by heapprof-daemon's build script from heapprof-common's preload\n \
         * module: edit that instead. */\n#pragma once\n#include <stdint.h>\n\n",
    );
    names_and_limits(&mut h);
    join_errors(&mut h);
    structures(&mut h);
    record_encoding(&mut h);
    function_indices(&mut h);
    h
}

/// The environment variables, symbols and paths both sides name, and the queues' and
/// replies' sizes.
fn names_and_limits(h: &mut String) {
    let _ = writeln!(h, "#define HP_PROBE_SITE_SYMBOL \"{PROBE_SITE_SYMBOL}\"");
    let _ = writeln!(h, "#define HP_SAMPLE_RATE_ENV \"{SAMPLE_RATE_ENV}\"");
    let _ = writeln!(h, "#define HP_FOLLOW_ENV \"{FOLLOW_ENV}\"");
    let _ = writeln!(
        h,
        "#define HP_KEPT_PRELOAD_PREFIX \"{KEPT_PRELOAD_PREFIX}\""
    );
    let _ = writeln!(h, "#define HP_QUEUE_WORDS {QUEUE_WORDS}");
    let _ = writeln!(h, "#define HP_REPLY_READS {REPLY_READS}");
    let _ = writeln!(h, "#define HP_REPLY_KNOWN {}u", StackReply::KNOWN);
    let _ = writeln!(h, "#define HP_REPLY_SLOTS {REPLY_SLOTS}u");
    let _ = writeln!(h, "#define HP_REPLIES_FD_ENV \"{REPLIES_FD_ENV}\"");
    let _ = writeln!(h, "#define HP_SYSTEM_SOCKET \"{SYSTEM_SOCKET}\"");
    let _ = writeln!(h, "#define HP_SYSTEM_OPT_OUT_ENV \"{SYSTEM_OPT_OUT_ENV}\"");
    let _ = writeln!(
        h,
        "#define HP_SYSTEM_OPT_OUT_VALUE \"{SYSTEM_OPT_OUT_VALUE}\""
    );
    let _ = writeln!(h, "#define HP_JOIN_CHILDREN {}u", SystemJoin::CHILDREN);
}

/// Why a join was refused, as the library's negative results.
fn join_errors(h: &mut String) {
    h.push_str("/* Why a join was refused, as its negative results. */\nenum join_error {\n");
    for reason in JoinRefused::ALL {
        let _ = writeln!(h, "    {} = {},", reason.c_name(), reason as i64);
    }
    h.push_str("};\n");
}

/// The structures the library shares with the daemon, each checked by the C compiler
/// against Rust's size.
fn structures(h: &mut String) {
    h.push_str(
        "struct hp_report_queue {\n    uint32_t len;\n    uint32_t generation;\n    \
         uint64_t words[HP_QUEUE_WORDS];\n};\n\
         struct hp_system_join {\n    uint64_t sample_rate;\n    uint64_t flags;\n};\n\
         struct hp_stack_reply {\n    uint64_t hash;\n    uint32_t status;\n    \
         uint32_t reads;\n    uint32_t uses_fp;\n    uint32_t pad_;\n    \
         int32_t offsets[HP_REPLY_READS];\n};\n",
    );
    // The C compiler checks that it lays the structures out as Rust does.
    for (what, size) in [
        ("struct hp_report_queue", size_of::<ReportQueue>()),
        ("struct hp_stack_reply", size_of::<StackReply>()),
        ("struct hp_system_join", size_of::<SystemJoin>()),
    ] {
        let _ = writeln!(
            h,
            "_Static_assert(sizeof({what}) == {size}, \"{what} differs from heapprof-common\");"
        );
    }
}

/// How a report queue's words encode an allocation or a free.
fn record_encoding(h: &mut String) {
    for (name, value) in [
        ("EXTENDED", Record::EXTENDED),
        ("FREE", Record::FREE),
        ("FUNCTION_SHIFT", u64::from(Record::FUNCTION_SHIFT)),
        ("FUNCTION_MASK", Record::FUNCTION_MASK),
        ("SIZE_SHIFT", u64::from(Record::SIZE_SHIFT)),
        ("EXTENDED_WORDS", u64::from(Record::EXTENDED_WORDS)),
    ] {
        let _ = writeln!(h, "#define HP_RECORD_{name} {value}ULL");
    }
    for (name, kind) in [
        ("ALLOC", Kind::Alloc),
        ("FLUSH", Kind::Flush),
        ("HELLO", Kind::Hello),
        ("FREE", Kind::Free),
    ] {
        let _ = writeln!(h, "#define HP_KIND_{name} {}u", kind as u32);
    }
    let _ = writeln!(h, "#define HP_META_KIND_SHIFT {}", Meta::KIND_SHIFT);
    let _ = writeln!(h, "#define HP_META_COUNT_SHIFT {}", Meta::COUNT_SHIFT);
    let _ = writeln!(
        h,
        "#define HP_META_REGISTER_QUEUE {}ULL",
        Meta::REGISTER_QUEUE
    );
    let _ = writeln!(h, "#define HP_META_SLOT_SHIFT {}", Meta::SLOT_SHIFT);
    let _ = writeln!(
        h,
        "#define HP_META_UNREGISTER_QUEUE {}ULL",
        Meta::UNREGISTER_QUEUE
    );
    let _ = writeln!(h, "#define HP_META_QUEUE_BUSY {}ULL", Meta::QUEUE_BUSY);
}

/// The wrapped functions' indices and names, in `FUNCTIONS` order.
fn function_indices(h: &mut String) {
    let mut names = String::from("static const char *const hp_function_names[] = {\n");
    for (index, (name, _)) in FUNCTIONS.iter().enumerate() {
        if !name.starts_with('_') {
            let _ = writeln!(h, "#define HP_FN_{} {index}", name.to_uppercase());
        }
        let _ = writeln!(names, "    \"{name}\",");
    }
    let first = |prefix: &str| FUNCTIONS.iter().position(|(n, _)| n.starts_with(prefix));
    let _ = writeln!(h, "#define HP_FN_FIRST_NEW {}", first("_Zn").unwrap_or(0));
    let _ = writeln!(
        h,
        "#define HP_FN_FIRST_DELETE {}",
        first("_Zd").unwrap_or(0)
    );
    h.push_str(&names);
    h.push_str("};\n");
}
