//! What the VM tests (x86_vm.rs, arm64_vm.rs) share: their inputs from the
//! environment, the files copied into the VM's root, running qemu to its end, and the
//! profiles the VM prints on its console (`==FILE PATH`, base64, `==END`).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use base64::Engine as _;
use heapprof_daemon::pprof::proto::Profile;

use super::{decode, forward_lines};

/// The path in the environment variable `name`, which `cargo xtask test` and
/// `cargo xtask vm-test` set; `needs` says what the test needs of it when it is not set.
pub fn env_path(name: &str, needs: &str) -> PathBuf {
    match std::env::var_os(name) {
        Some(path) => PathBuf::from(path),
        None => panic!(
            "{name} is not set: {needs}; run it through `cargo xtask test` or `cargo xtask vm-test`"
        ),
    }
}

/// Copies a file into the VM's root.
pub fn copy(from: &Path, to: &Path) {
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("copying {} to {}: {e}", from.display(), to.display()));
}

/// Runs the VM that `qemu` starts until it powers off, and returns its console output,
/// which must show that its script got to the end (`==DONE`). `package` is the Debian
/// package of the qemu binary. `bound` only covers a VM that does not boot at all:
/// the VM's own watchdog powers it off before.
pub fn run_to_end(qemu: &mut Command, package: &str, bound: Duration) -> String {
    let program = qemu.get_program().to_string_lossy().into_owned();
    let mut child = qemu
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("starting {program} (install {package}: cargo xtask setup): {e:?}")
        });
    let stdout = child.stdout.take().expect("stdout");
    let lines = forward_lines(stdout);
    let mut console = Vec::new();
    let deadline = Instant::now() + bound;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => console.push(line),
            Err(_) => break,
        }
    }
    let _ = child.kill();
    let status = child.wait().expect("waiting for qemu");
    let console = console.join("\n");
    assert!(
        console.contains("==DONE"),
        "the VM did not finish (qemu {status}); its console:\n{console}"
    );
    console
}

/// Profiles printed by the VM, by path, decoded and validated. Each is kept in `dir`
/// as its path flattened, after `prefix` (a kernel's release, to keep several VMs'
/// apart).
pub fn profiles_from(console: &str, dir: &Path, prefix: &str) -> BTreeMap<String, Profile> {
    let mut profiles = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    for line in console.lines() {
        let line = line.trim_end_matches('\r');
        if let Some(path) = line.strip_prefix("==FILE ") {
            current = Some((path.to_owned(), String::new()));
        } else if line == "==END" {
            let (path, text) = current.take().expect("==END without ==FILE");
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(text.as_bytes())
                .unwrap_or_else(|e| panic!("{path}: bad base64 from the VM: {e}"));
            let local = dir.join(format!(
                "{prefix}{}",
                path.trim_start_matches('/').replace('/', "_")
            ));
            std::fs::write(&local, bytes).expect("writing a profile");
            profiles.insert(path, decode(&local));
        } else if let Some((_, text)) = current.as_mut() {
            text.push_str(line.trim());
        }
    }
    profiles
}

/// The last profile written under `/tmp/out/SCENARIO/` in the VM (`SCENARIO` may be
/// `ROUND/SCENARIO`).
pub fn last<'a>(profiles: &'a BTreeMap<String, Profile>, scenario: &str) -> &'a Profile {
    let prefix = format!("/tmp/out/{scenario}/");
    profiles
        .iter()
        .rfind(|(path, _)| path.starts_with(&prefix))
        .map(|(_, p)| p)
        .unwrap_or_else(|| panic!("no profile of {scenario}"))
}
