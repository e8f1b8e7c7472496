//! Debian's archive, as the VM tests' assets are fetched from it: the machine's own
//! archive and sources read from `/etc/apt`, an apt of the tests' own
//! ([`PrivateApt`]) that downloads packages without reading or changing the
//! machine's apt state, and the unpacking of single members of a `.deb` (a kernel
//! package's image among them).

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::CmdExt as _;

/// apt with its own state, cache and sources, for one architecture only: the
/// machine's own apt configuration is neither read nor changed.
pub(crate) struct PrivateApt {
    dir: PathBuf,
    options: Vec<String>,
}

impl PrivateApt {
    /// An apt for `arch` under `dir`, reading the one-line `sources`.
    pub(crate) fn new(dir: &Path, arch: &str, sources: &str) -> Result<Self> {
        for sub in ["state/lists/partial", "cache/archives/partial"] {
            std::fs::create_dir_all(dir.join(sub))?;
        }
        let sources_list = dir.join("sources.list");
        std::fs::write(&sources_list, sources)?;
        let sources = sources_list;
        let options = [
            format!("APT::Architecture={arch}"),
            format!("APT::Architectures={arch}"),
            format!("Dir::State={}", dir.join("state").display()),
            format!("Dir::Cache={}", dir.join("cache").display()),
            format!("Dir::Etc::SourceList={}", sources.display()),
            "Dir::Etc::SourceParts=/nonexistent".to_owned(),
            "Debug::NoLocking=1".to_owned(),
        ];
        Ok(Self {
            dir: dir.to_path_buf(),
            options: options
                .iter()
                .flat_map(|o| ["-o".to_owned(), o.clone()])
                .collect(),
        })
    }

    /// The same apt, seeing nothing installed (an empty dpkg status of its own instead
    /// of the machine's): resolving a package's dependencies then names them all.
    pub(crate) fn without_installed(mut self) -> Result<Self> {
        let status = self.dir.join("status");
        std::fs::write(&status, "")?;
        self.options.push("-o".to_owned());
        self.options
            .push(format!("Dir::State::status={}", status.display()));
        Ok(self)
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.args(&self.options);
        cmd
    }

    /// Reads the sources' package lists.
    pub(crate) fn update(&self) -> Result<()> {
        self.command("apt-get").args(["update", "-qq"]).run()
    }

    /// The kernel image package `metapackage` (`linux-image-amd64/bookworm`: of
    /// one suite) depends on.
    pub(crate) fn depends_on(&self, metapackage: &str) -> Result<String> {
        let output = self
            .command("apt-cache")
            .args(["depends", metapackage])
            .output()?;
        String::from_utf8_lossy(&output.stdout)
            .lines()
            // Debian 13's metapackage depends on linux-base-amd64 first.
            .filter_map(|l| l.trim().strip_prefix("Depends: "))
            .find(|p| p.starts_with("linux-image-"))
            .map(str::to_owned)
            .with_context(|| format!("apt-cache depends {metapackage} names no kernel image"))
    }

    /// Downloads the .debs of `packages` (`name` or `name/suite`) into `into`.
    pub(crate) fn download(&self, into: &Path, packages: &[&str]) -> Result<()> {
        self.command("apt-get")
            .arg("download")
            .args(packages)
            .current_dir(into)
            .run()
    }

    /// Downloads the .debs of `package` and of everything it depends on (recommends
    /// left out) into `into`, as `apt-get install` would resolve them: an apt made
    /// [`Self::without_installed`] fetches them all.
    pub(crate) fn download_with_dependencies(&self, into: &Path, package: &str) -> Result<()> {
        std::fs::create_dir_all(into.join("partial"))?;
        self.command("apt-get")
            .arg("-o")
            .arg(format!("Dir::Cache::archives={}", into.display()))
            .args([
                "install",
                "-y",
                "-qq",
                "--download-only",
                "--no-install-recommends",
            ])
            .arg(package)
            .run()
    }
}

/// The machine's Debian archive (not its security archive): its URI and the
/// `signed-by=...` option of its entry, if any.
pub(crate) fn debian_archive() -> Result<(String, Option<String>)> {
    for line in arm64_sources()?.lines() {
        let Some(rest) = line.strip_prefix("deb [") else {
            continue;
        };
        let Some((options, rest)) = rest.split_once("] ") else {
            continue;
        };
        let Some(uri) = rest.split_whitespace().next() else {
            continue;
        };
        if uri.contains("security") {
            continue;
        }
        let signed = options
            .split_whitespace()
            .find(|o| o.starts_with("signed-by="))
            .map(str::to_owned);
        return Ok((uri.to_owned(), signed));
    }
    bail!("no Debian archive (other than its security updates) in /etc/apt's sources")
}

/// The one-line sources entry of `suite`'s main component in the Debian `archive`
/// for `arch`, with the archive's `signed-by=...` option if it has one.
pub(crate) fn source_line(
    arch: &str,
    archive: &str,
    signed_by: Option<&str>,
    suite: &str,
) -> String {
    let options = match signed_by {
        Some(signed) => format!("[arch={arch} {signed}]"),
        None => format!("[arch={arch}]"),
    };
    format!("deb {options} {archive} {suite} main\n")
}

/// The machine's Debian sources (deb822 or one-line format), as one-line entries for arm64.
pub(crate) fn arm64_sources() -> Result<String> {
    let mut lines = Vec::new();
    if let Ok(text) = std::fs::read_to_string("/etc/apt/sources.list") {
        for line in text.lines().map(str::trim) {
            let mut words = line.split_whitespace().peekable();
            if words.next() != Some("deb") {
                continue;
            }
            // Drop the options (`[arch=amd64 signed-by=...]`), keep URI, suite, components.
            if words.peek().is_some_and(|w| w.starts_with('[')) {
                for word in words.by_ref() {
                    if word.ends_with(']') {
                        break;
                    }
                }
            }
            let rest: Vec<&str> = words.collect();
            if rest.len() >= 3 && rest[0].contains("debian") {
                lines.push(format!("deb [arch=arm64] {}", rest.join(" ")));
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir("/etc/apt/sources.list.d") {
        for entry in entries.filter_map(|e| e.ok()) {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "sources")
                && let Ok(text) = std::fs::read_to_string(&path)
            {
                lines.extend(deb822_to_lines(&text));
            }
        }
    }
    if lines.is_empty() {
        bail!("no Debian sources found in /etc/apt to fetch arm64 packages from");
    }
    Ok(lines.join("\n") + "\n")
}

/// Converts the Debian entries of a deb822 `.sources` file to one-line arm64 entries.
fn deb822_to_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    for stanza in text.split("\n\n") {
        let field = |name: &str| {
            stanza
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        let (Some(uris), Some(suites), Some(components)) =
            (field("URIs"), field("Suites"), field("Components"))
        else {
            continue;
        };
        if field("Types").is_some_and(|t| !t.split_whitespace().any(|t| t == "deb"))
            || field("Enabled").is_some_and(|e| e == "no")
            || !uris.contains("debian")
        {
            continue;
        }
        let signed = field("Signed-By")
            .map(|s| format!(" signed-by={s}"))
            .unwrap_or_default();
        for uri in uris.split_whitespace() {
            for suite in suites.split_whitespace() {
                lines.push(format!(
                    "deb [arch=arm64{signed}] {uri} {suite} {components}"
                ));
            }
        }
    }
    lines
}

/// The .deb in `dir` whose file name starts with `prefix`.
pub(crate) fn find_deb(dir: &Path, prefix: &str) -> Result<PathBuf> {
    std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix) && n.ends_with(".deb"))
        })
        .with_context(|| format!("apt downloaded no {prefix}*.deb into {}", dir.display()))
}

/// An empty directory `dir`, whatever was there before removed: where packages are
/// downloaded or unpacked afresh.
pub(crate) fn fresh_dir(dir: &Path) -> Result<()> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    Ok(())
}

/// The kernel release (as `uname -r` gives it) of the kernel image package `kernel`
/// (`linux-image-<release>`).
pub(crate) fn kernel_release(kernel: &str) -> Result<&str> {
    kernel
        .strip_prefix("linux-image-")
        .context("a kernel package not named linux-image-*")
}

/// Copies the kernel image `vmlinuz` (a member `./...` of the kernel package
/// `kernel`, unpacked under `unpacked`) to `dir/vmlinuz`.
pub(crate) fn copy_vmlinuz(unpacked: &Path, vmlinuz: &str, dir: &Path, kernel: &str) -> Result<()> {
    std::fs::copy(
        unpacked.join(vmlinuz.trim_start_matches("./")),
        dir.join("vmlinuz"),
    )
    .with_context(|| format!("{kernel} has no {vmlinuz}"))?;
    Ok(())
}

/// Whether `deb` holds the file `member` (`./path`).
pub(crate) fn has_member(deb: &Path, member: &str) -> Result<bool> {
    let output = Command::new("dpkg-deb")
        .arg("--contents")
        .arg(deb)
        .output()
        .with_context(|| format!("listing {}", deb.display()))?;
    if !output.status.success() {
        bail!("dpkg-deb --contents {} failed", deb.display());
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .any(|line| line.split_whitespace().nth(5) == Some(member)))
}

/// Unpacks the members of `deb` matching `patterns` (tar wildcards) into `into`:
/// only what the VM needs, not a kernel package's hundreds of MiB of modules.
pub(crate) fn extract(deb: &Path, into: &Path, patterns: &[&str]) -> Result<()> {
    Command::new("sh")
        .arg("-c")
        .arg(r#"deb=$0; into=$1; shift; dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$into" --wildcards "$@""#)
        .arg(deb)
        .arg(into)
        .args(patterns)
        .run()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deb822_sources_become_arm64_lines() {
        let text = "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\n\
                    Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n\
                    Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\n";
        assert_eq!(
            deb822_to_lines(text),
            [
                "deb [arch=arm64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main",
                "deb [arch=arm64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-updates main",
            ]
        );
    }
}
