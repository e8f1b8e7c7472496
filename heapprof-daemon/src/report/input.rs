//! Finding the profiles to read: a file as given, or the profiles of a session's
//! output directory.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};

/// Whether `name` is one of the profiles heapprofd writes (`heap-<time>-<seq>.pb.gz`).
/// Temporary files (`.heap-...tmp`) and anything else are not.
pub fn is_profile_name(name: &str) -> bool {
    name.starts_with("heap-") && name.ends_with(".pb.gz")
}

/// The profiles in `dir`, oldest first: their names sort chronologically.
pub fn profiles_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read the directory {}", dir.display()))?;
    let mut profiles = Vec::new();
    for entry in entries {
        let entry =
            entry.with_context(|| format!("cannot read the directory {}", dir.display()))?;
        if entry.file_name().to_str().is_some_and(is_profile_name) {
            profiles.push(entry.path());
        }
    }
    profiles.sort();
    Ok(profiles)
}

/// The profile a single-profile report reads: `path` itself, or for a directory its
/// newest profile. `announce` is told which file of a directory was chosen.
pub fn single_profile(path: &Path, announce: impl FnOnce(&Path)) -> Result<PathBuf> {
    if !path.is_dir() {
        return Ok(path.to_owned());
    }
    let Some(newest) = profiles_in(path)?.pop() else {
        bail!(
            "{} holds no profile (heap-*.pb.gz); give a profile or a directory heapprofd -o wrote",
            path.display()
        );
    };
    announce(&newest);
    Ok(newest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_gives_its_newest_profile() {
        let dir = tempfile::tempdir().expect("tempdir");
        for name in [
            "heap-20260101T000000.000Z-0002.pb.gz",
            "heap-20260101T000000.000Z-0001.pb.gz",
            ".heap-20260101T000001.000Z-0003.pb.gz.1.0.tmp",
            "notes.txt",
        ] {
            std::fs::write(dir.path().join(name), b"").expect("write");
        }
        let mut told = None;
        let chosen = single_profile(dir.path(), |p| told = Some(p.to_owned())).expect("newest");
        assert_eq!(
            chosen,
            dir.path().join("heap-20260101T000000.000Z-0002.pb.gz")
        );
        assert_eq!(told.as_ref(), Some(&chosen));
        let file = dir.path().join("notes.txt");
        assert_eq!(
            single_profile(&file, |_| panic!("a file")).expect("file"),
            file
        );
    }

    #[test]
    fn an_empty_directory_is_an_error_naming_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = single_profile(dir.path(), |_| {}).expect_err("empty");
        assert!(format!("{err:#}").contains("holds no profile"), "{err:#}");
    }
}
