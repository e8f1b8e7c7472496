//! `cargo xtask run --target ARCH --host HOST`: run heapprofd on a board over ssh.
//!
//! Copies the static binary with scp, runs it there with sudo, fetches the profiles
//! back into `target/remote/HOST/`. Nothing is installed on the board.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::{CmdExt as _, step, workspace_root};

/// Where the binary and the profiles go on the board.
const REMOTE_DIR: &str = "/tmp/heapprofd-xtask";

/// Runs what follows as root: directly when logged in as root, else through sudo.
const AS_ROOT: &str = "$([ \"$(id -u)\" -eq 0 ] || echo sudo)";

/// Options every ssh/scp call gets: never prompt for a host key or a password
/// (fail instead), and give up on an unreachable host quickly.
const SSH_OPTIONS: [&str; 4] = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"];

/// Runs heapprofd with `args` on `host` (`[user@]host`), as root (through sudo unless
/// logged in as root).
pub fn run(binary: &Path, host: &str, args: &[String]) -> Result<()> {
    check_reachable(host)?;
    step(&format!(
        "copying {} to {host}:{REMOTE_DIR}/",
        binary.display()
    ));
    ssh(host).arg(format!("mkdir -p {REMOTE_DIR}")).run()?;
    Command::new("scp")
        .args(SSH_OPTIONS)
        .arg("-q")
        .arg(binary)
        .arg(format!("{host}:{REMOTE_DIR}/heapprofd"))
        .run()
        .with_context(|| format!("copying heapprofd to {host}"))?;
    let (args, remote_output) = remote_arguments(args);
    let command = std::iter::once(format!("{AS_ROOT} {REMOTE_DIR}/heapprofd"))
        .chain(args.iter().map(|a| shell_quote(a)))
        .collect::<Vec<_>>()
        .join(" ");
    step(&format!("running on {host}: {command}"));
    // -t: sudo may ask for a password on the board's terminal.
    let status = Command::new("ssh")
        .args(["-o", "ConnectTimeout=10", "-t", host, &command])
        .status()
        .with_context(|| format!("running heapprofd on {host}"))?;
    let local = workspace_root()
        .join("target/remote")
        .join(host.replace(['@', '/', ':'], "_"));
    fetch_profiles(host, &remote_output, &local)?;
    if !status.success() {
        bail!(
            "heapprofd on {host} failed ({status}); profiles written before are in {}",
            local.display()
        );
    }
    Ok(())
}

fn ssh(host: &str) -> Command {
    let mut cmd = Command::new("ssh");
    cmd.args(SSH_OPTIONS).arg(host);
    cmd
}

/// Fails with a clear message when `host` cannot be logged into without a prompt.
pub fn check_reachable(host: &str) -> Result<()> {
    let output = ssh(host)
        .arg("true")
        .output()
        .context("cannot run ssh (install openssh-client)")?;
    if !output.status.success() {
        let reason = String::from_utf8_lossy(&output.stderr);
        bail!(
            "cannot reach {host} over ssh ({}); check the address and that `ssh {host}` logs in \
             with a key (no password prompt)",
            reason.trim().lines().last().unwrap_or("no reason given")
        );
    }
    Ok(())
}

/// The arguments to run remotely and the profile directory they name: the user's
/// `-o/--output` if given, else one under [`REMOTE_DIR`]; `--top 10` unless `--top` is given.
pub fn remote_arguments(args: &[String]) -> (Vec<String>, String) {
    let mut args = args.to_vec();
    // Flags end at `--` (what follows is the traced command).
    let flags_end = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let flags = &args[..flags_end];
    let output = flags.iter().enumerate().find_map(|(i, a)| {
        if a == "-o" || a == "--output" {
            flags.get(i + 1).cloned()
        } else {
            a.strip_prefix("--output=").map(str::to_owned)
        }
    });
    let has_top = flags
        .iter()
        .any(|a| a == "--top" || a.starts_with("--top="));
    let mut added = Vec::new();
    let output = match output {
        Some(output) => output,
        None => {
            let output = format!("{REMOTE_DIR}/profiles");
            added.extend(["-o".to_owned(), output.clone()]);
            output
        }
    };
    if !has_top {
        added.extend(["--top".to_owned(), "10".to_owned()]);
    }
    args.splice(0..0, added);
    (args, output)
}

/// Quotes `text` for a POSIX shell.
pub fn shell_quote(text: &str) -> String {
    if !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c))
    {
        return text.to_owned();
    }
    format!("'{}'", text.replace('\'', r"'\''"))
}

fn fetch_profiles(host: &str, remote: &str, local: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(local).with_context(|| format!("creating {}", local.display()))?;
    step(&format!(
        "fetching {host}:{remote} into {}",
        local.display()
    ));
    // The profiles are root's (0600): make them readable for the copy.
    let _ = ssh(host)
        .arg(format!(
            "{AS_ROOT} chown -R \"$(id -u)\" {} 2>/dev/null",
            shell_quote(remote)
        ))
        .status();
    Command::new("scp")
        .args(SSH_OPTIONS)
        .args(["-q", "-r"])
        .arg(format!("{host}:{remote}/."))
        .arg(local)
        .run()
        .with_context(|| format!("fetching the profiles from {host}"))?;
    println!("Profiles from {host}: {}", local.display());
    println!(
        "Open one with:  go tool pprof -http=: {}/FILE",
        local.display()
    );
    Ok(local.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn the_output_directory_is_kept_or_added() {
        let (args, out) = remote_arguments(&strings(&["--pid", "12", "-o", "/tmp/p"]));
        assert_eq!(out, "/tmp/p");
        assert_eq!(
            args,
            strings(&["--top", "10", "--pid", "12", "-o", "/tmp/p"])
        );
        let (args, out) =
            remote_arguments(&strings(&["--kernel", "--top", "3", "--", "ls", "-o", "x"]));
        assert_eq!(out, "/tmp/heapprofd-xtask/profiles");
        assert_eq!(
            args,
            strings(&[
                "-o",
                "/tmp/heapprofd-xtask/profiles",
                "--kernel",
                "--top",
                "3",
                "--",
                "ls",
                "-o",
                "x"
            ])
        );
    }

    #[test]
    fn arguments_are_quoted_for_the_remote_shell() {
        assert_eq!(shell_quote("--pid"), "--pid");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn an_unreachable_host_is_named() {
        let err = check_reachable("nobody@host.invalid").expect_err("unreachable");
        let message = format!("{err:#}");
        assert!(
            message.contains("cannot reach nobody@host.invalid over ssh"),
            "{message}"
        );
    }
}
