//! Running valgrind so that the program sees the environment heapprofd's run gives it.
//!
//! Debian's `/usr/bin/valgrind` is a shell script: it appends `/usr/lib/debug` to
//! `LD_LIBRARY_PATH`, sets `GLIBCXX_FORCE_NEW` and `GLIBCPP_FORCE_NEW`, then runs
//! `valgrind.bin`. A program's allocations can depend on its environment: Python copies
//! each variable into a bytes object, which comes from malloc above 512 bytes and from
//! its own pools below. Under cargo's long `LD_LIBRARY_PATH` (479 bytes in a CI run),
//! those 15 more bytes made one 527-byte block that heapprofd's run of the same program
//! rightly never saw. So the tool binary runs directly where the script wraps it.

use std::{path::PathBuf, process::Command};

/// A command running valgrind itself: `valgrind.bin` beside the `valgrind` on `PATH`
/// when that one is a script wrapping it (Debian's), else `valgrind`.
pub fn command() -> Command {
    Command::new(binary())
}

fn binary() -> PathBuf {
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("valgrind"))
            .find(|candidate| candidate.is_file())
    });
    let Some(script) = on_path else {
        return PathBuf::from("valgrind");
    };
    let wrapped = script.with_file_name("valgrind.bin");
    let is_script = std::fs::read(&script).is_ok_and(|bytes| bytes.starts_with(b"#!"));
    if is_script && wrapped.is_file() {
        wrapped
    } else {
        script
    }
}
