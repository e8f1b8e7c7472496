//! Bounding the output directory: `--keep N` and `--keep-for DURATION`.
//!
//! After each profile is written, the oldest profiles beyond the limits are deleted.
//! Only regular files with the names heapprofd gives profiles
//! (`heap-YYYYMMDDTHHMMSS.mmmZ-NNNN.pb.gz`) count, those of earlier sessions included:
//! what is bounded is the directory. Anything else (other files, temp files,
//! directories, symlinks) is left alone, and symlinks are never followed.
//!
//! A profile's age is the time in its name rather than its modification time:
//! heapprofd wrote it, it survives copies and restores that reset modification
//! times, and it orders profiles as `heapprofd report DIR` does.

use std::{
    collections::HashSet,
    io,
    num::NonZeroUsize,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use super::writer::parse_profile_file_name;

/// How many profiles, and how old, the output directory keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Keep at most this many profiles.
    pub keep: Option<NonZeroUsize>,
    /// Delete profiles older than this.
    pub keep_for: Option<Duration>,
}

impl RetentionPolicy {
    /// Whether nothing is ever deleted (no limit given).
    pub fn is_unbounded(&self) -> bool {
        self.keep.is_none() && self.keep_for.is_none()
    }

    /// The limits, for people: `the 3 newest profiles and those from the last 1h`.
    pub fn describe(&self) -> String {
        let count = self.keep.map(|n| match n.get() {
            1 => "the newest profile".to_owned(),
            n => format!("the {n} newest profiles"),
        });
        let age = self
            .keep_for
            .map(|d| format!("profiles from the last {}", describe_duration(d)));
        match (count, age) {
            (Some(count), Some(age)) => format!("{count}, and only {age}"),
            (Some(one), None) | (None, Some(one)) => one,
            (None, None) => "every profile".to_owned(),
        }
    }
}

/// `90s`, `15m`, `2h`, `7d`, or seconds with a fraction.
fn describe_duration(duration: Duration) -> String {
    let secs = duration.as_secs();
    if duration.subsec_nanos() != 0 || secs == 0 {
        return format!("{:.3}s", duration.as_secs_f64());
    }
    match secs {
        s if s % 86400 == 0 => format!("{}d", s / 86400),
        s if s % 3600 == 0 => format!("{}h", s / 3600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// A profile found in the output directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfileFile {
    /// Its file name.
    pub name: String,
    /// The time in its name.
    pub time: SystemTime,
    /// The sequence number in its name.
    pub sequence: u32,
}

/// The names of the profiles to delete under `policy` at `now`. `newest`, the profile
/// just written, is never deleted and counts as the newest whatever its name says
/// (a file named with a later time means the clock went back).
pub fn select(
    policy: &RetentionPolicy,
    mut profiles: Vec<ProfileFile>,
    newest: &str,
    now: SystemTime,
) -> Vec<String> {
    profiles.retain(|p| p.name != newest);
    profiles.sort_by(|a, b| (b.time, b.sequence, &b.name).cmp(&(a.time, a.sequence, &a.name)));
    // `newest` takes one of the places.
    let room = policy.keep.map_or(usize::MAX, |n| n.get() - 1);
    let cutoff = policy.keep_for.and_then(|age| now.checked_sub(age));
    profiles
        .into_iter()
        .enumerate()
        .filter(|(rank, profile)| *rank >= room || cutoff.is_some_and(|c| profile.time < c))
        .map(|(_, profile)| profile.name)
        .collect()
}

/// The regular files in `dir` named as heapprofd names profiles. Entries that cannot
/// be read are skipped.
pub fn list_profiles(dir: &Path) -> io::Result<Vec<ProfileFile>> {
    let mut profiles = Vec::new();
    for entry in std::fs::read_dir(dir)?.flatten() {
        // The entry's own type: a symlink is a symlink, never what it points to.
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if let Some((time, sequence)) = parse_profile_file_name(&name) {
            profiles.push(ProfileFile {
                name,
                time,
                sequence,
            });
        }
    }
    Ok(profiles)
}

/// Deletes old profiles after each new one, as a [`RetentionPolicy`] says.
#[derive(Debug)]
pub struct Pruner {
    dir: PathBuf,
    policy: RetentionPolicy,
    /// Whether a deletion was already announced at info level.
    announced: bool,
    /// Causes of failures already warned about, each warned about once.
    warned: HashSet<io::ErrorKind>,
}

impl Pruner {
    /// A pruner of `dir`; it does nothing with an unbounded policy.
    pub fn new(dir: &Path, policy: RetentionPolicy) -> Self {
        Self {
            dir: dir.to_owned(),
            policy,
            announced: false,
            warned: HashSet::new(),
        }
    }

    /// Applies the policy now that `written` (a file in the directory) is the newest
    /// profile. Failures are warnings, each cause once; returns how many profiles
    /// were deleted.
    pub fn after_write(&mut self, written: &Path) -> usize {
        self.prune(written, SystemTime::now())
    }

    fn prune(&mut self, written: &Path, now: SystemTime) -> usize {
        if self.policy.is_unbounded() {
            return 0;
        }
        let Some(newest) = written.file_name().and_then(|n| n.to_str()) else {
            return 0;
        };
        let profiles = match list_profiles(&self.dir) {
            Ok(profiles) => profiles,
            Err(err) => {
                let what = format!("cannot list {} to delete old profiles", self.dir.display());
                self.warn(&what, &err);
                return 0;
            }
        };
        let mut removed = 0;
        for name in select(&self.policy, profiles, newest, now) {
            let path = self.dir.join(&name);
            // unlink(2) removes the name itself: had a symlink taken its place since
            // the listing, the link would go, never its target.
            match std::fs::remove_file(&path) {
                Ok(()) => removed += 1,
                // Gone already (deleted by hand, or by another heapprofd).
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => {
                    let what = format!("cannot delete old profile {}", path.display());
                    self.warn(&what, &err);
                }
            }
        }
        if removed > 0 {
            if self.announced {
                log::debug!("deleted {removed} old profile(s)");
            } else {
                self.announced = true;
                log::info!(
                    "deleted {removed} old profile(s) from {}: it keeps {} (--keep, --keep-for)",
                    self.dir.display(),
                    self.policy.describe()
                );
            }
        }
        removed
    }

    fn warn(&mut self, what: &str, err: &io::Error) {
        if self.warned.insert(err.kind()) {
            log::warn!("{what}: {err} (said once; profiles are still written)");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;
    use crate::pprof::writer::profile_file_name;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
    }

    fn policy(keep: usize, keep_for: Option<u64>) -> RetentionPolicy {
        RetentionPolicy {
            keep: NonZeroUsize::new(keep),
            keep_for: keep_for.map(Duration::from_secs),
        }
    }

    /// Profiles named at times `secs` (sequence = index + 1), in `dir`.
    fn write_profiles(dir: &Path, secs: &[u64]) -> Vec<String> {
        secs.iter()
            .enumerate()
            .map(|(i, &s)| {
                let name = profile_file_name(at(s), i as u32 + 1);
                std::fs::write(dir.join(&name), "p").expect("write");
                name
            })
            .collect()
    }

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("readdir")
            .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
            .collect();
        names.sort();
        names
    }

    #[test]
    fn keeps_the_newest_n() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Written out of order: the order is the names' times.
        let names = write_profiles(dir.path(), &[30, 10, 50, 20, 40]);
        let mut pruner = Pruner::new(dir.path(), policy(3, None));
        assert_eq!(pruner.prune(&dir.path().join(&names[2]), at(60)), 2);
        let mut kept = vec![names[0].clone(), names[2].clone(), names[4].clone()];
        kept.sort();
        assert_eq!(names_in(dir.path()), kept);
        // Nothing more to do.
        assert_eq!(pruner.prune(&dir.path().join(&names[2]), at(60)), 0);
    }

    #[test]
    fn the_profile_just_written_is_kept_whatever_its_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A profile from the future (the clock went back since): still, the one just
        // written is the newest.
        let names = write_profiles(dir.path(), &[1000, 10, 20]);
        let mut pruner = Pruner::new(dir.path(), policy(1, Some(1)));
        assert_eq!(pruner.prune(&dir.path().join(&names[1]), at(5000)), 2);
        assert_eq!(names_in(dir.path()), vec![names[1].clone()]);
    }

    #[test]
    fn keep_for_deletes_by_the_time_in_the_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let names = write_profiles(dir.path(), &[0, 100, 3500, 3600]);
        let mut pruner = Pruner::new(dir.path(), policy(0, Some(3600)));
        // Older than an hour at 3701: the first two.
        assert_eq!(pruner.prune(&dir.path().join(&names[3]), at(3701)), 2);
        assert_eq!(names_in(dir.path()), names[2..].to_vec());
        // Both limits: the stricter one wins.
        let mut both = Pruner::new(dir.path(), policy(1, Some(86400)));
        assert_eq!(both.prune(&dir.path().join(&names[3]), at(3700)), 1);
        assert_eq!(names_in(dir.path()), names[3..].to_vec());
    }

    #[test]
    fn ties_in_time_are_ordered_by_sequence() {
        // 10000 sorts before 9999 as text; the order is the number's.
        let profiles: Vec<ProfileFile> = (9997..=10001)
            .map(|sequence| ProfileFile {
                name: profile_file_name(at(0), sequence),
                time: at(0),
                sequence,
            })
            .collect();
        let newest = profile_file_name(at(0), 10001);
        let deleted = select(&policy(2, None), profiles, &newest, at(1));
        let expected: Vec<String> = [9999, 9998, 9997]
            .into_iter()
            .map(|s| profile_file_name(at(0), s))
            .collect();
        assert_eq!(deleted, expected, "10001 and 10000 kept");
    }

    #[test]
    fn leaves_everything_else_alone() {
        let base = tempfile::tempdir().expect("tempdir");
        let dir = base.path().join("out");
        std::fs::create_dir(&dir).expect("mkdir");
        let names = write_profiles(&dir, &[10, 20, 30]);
        let outside = base.path().join("outside.pb.gz");
        std::fs::write(&outside, "precious").expect("write");
        // A symlink and a directory with profile names, a foreign file, a temp file.
        let link = profile_file_name(at(1), 90);
        std::os::unix::fs::symlink(&outside, dir.join(&link)).expect("symlink");
        let subdir = profile_file_name(at(2), 91);
        std::fs::create_dir(dir.join(&subdir)).expect("mkdir");
        std::fs::write(dir.join(&subdir).join(profile_file_name(at(3), 92)), "x").expect("w");
        std::fs::write(dir.join("notes.txt"), "mine").expect("write");
        let temp = format!(".{}.123.0.tmp", profile_file_name(at(4), 93));
        std::fs::write(dir.join(&temp), "partial").expect("write");

        let mut pruner = Pruner::new(&dir, policy(1, Some(1)));
        assert_eq!(pruner.prune(&dir.join(&names[2]), at(100)), 2);
        let mut expected = vec![
            names[2].clone(),
            link,
            subdir.clone(),
            "notes.txt".to_owned(),
            temp,
        ];
        expected.sort();
        assert_eq!(names_in(&dir), expected);
        assert_eq!(std::fs::read_to_string(&outside).expect("read"), "precious");
        assert_eq!(names_in(&dir.join(&subdir)).len(), 1);
    }

    #[test]
    fn failures_are_not_fatal() {
        let base = tempfile::tempdir().expect("tempdir");
        let missing = base.path().join("gone");
        let mut pruner = Pruner::new(&missing, policy(1, None));
        assert_eq!(pruner.prune(&missing.join("heap-x.pb.gz"), at(0)), 0);
        assert_eq!(pruner.prune(&missing.join("heap-x.pb.gz"), at(0)), 0);
        assert_eq!(pruner.warned.len(), 1, "one warning per cause");
        // Unbounded: the directory is not even read.
        let mut unbounded = Pruner::new(&missing, RetentionPolicy::default());
        assert_eq!(unbounded.prune(&missing.join("heap-x.pb.gz"), at(0)), 0);
        assert!(unbounded.warned.is_empty());
    }

    #[test]
    fn policies_describe_themselves() {
        assert_eq!(policy(3, None).describe(), "the 3 newest profiles");
        assert_eq!(
            policy(1, Some(7 * 86400)).describe(),
            "the newest profile, and only profiles from the last 7d"
        );
        assert_eq!(policy(0, Some(90)).describe(), "profiles from the last 90s");
        assert_eq!(describe_duration(Duration::from_millis(1500)), "1.500s");
    }
}
