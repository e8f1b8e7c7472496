//! Writing profiles: gzip'd protobuf, through a temp file renamed into place, mode 0600.
//!
//! A reader never sees a partial file and an earlier profile is never damaged:
//! the temp file is created exclusively (never through a symlink) in the output
//! directory, synced, then renamed.

use std::{
    fs::{File, OpenOptions},
    io::Write as _,
    os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, bail};
use flate2::{Compression, write::GzEncoder};
use prost::Message as _;

use super::proto::Profile;

/// Creates the output directory (mode 0700) if it is missing and checks it is writable.
pub fn prepare_output_dir(dir: &Path) -> Result<()> {
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| {
                format!(
                    "cannot create output directory {}; choose another with -o DIR",
                    dir.display()
                )
            })?;
    }
    if !dir.is_dir() {
        bail!(
            "output path {} is not a directory; choose a directory with -o DIR",
            dir.display()
        );
    }
    let probe = dir.join(format!(".heapprofd-probe-{}", std::process::id()));
    let created = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&probe);
    match created {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(err) => bail!(
            "output directory {} is not writable ({err}); choose another with -o DIR",
            dir.display()
        ),
    }
}

/// Names profiles so that lexical order is chronological order: UTC time, then a sequence number.
pub fn profile_file_name(time: SystemTime, sequence: u32) -> String {
    let since_epoch = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since_epoch.as_secs();
    let (days, rem) = (secs / 86400, secs % 86400);
    let (year, month, day) = civil_from_days(days as i64);
    format!(
        "heap-{year:04}{month:02}{day:02}T{:02}{:02}{:02}.{:03}Z-{sequence:04}.pb.gz",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        since_epoch.subsec_millis()
    )
}

/// The time and sequence number in a name [`profile_file_name`] made, or `None` for
/// any other name (the strict inverse: other files in the directory are not profiles).
pub fn parse_profile_file_name(name: &str) -> Option<(SystemTime, u32)> {
    let rest = name.strip_prefix("heap-")?.strip_suffix(".pb.gz")?;
    let (stamp, sequence) = rest.split_once("Z-")?;
    let digits = |s: &str, len: usize| -> Option<u64> {
        if s.len() == len && s.bytes().all(|b| b.is_ascii_digit()) {
            s.parse().ok()
        } else {
            None
        }
    };
    let (date, time) = stamp.split_once('T')?;
    let (hms, millis) = time.split_once('.')?;
    let date = digits(date, 8)?;
    let hms = digits(hms, 6)?;
    let millis = digits(millis, 3)?;
    if sequence.len() < 4 || !sequence.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let sequence: u32 = sequence.parse().ok()?;
    let (year, month, day) = (date / 10_000, date / 100 % 100, date % 100);
    let (hour, minute, second) = (hms / 10_000, hms / 100 % 100, hms % 100);
    if !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 59
    {
        return None;
    }
    let days = u64::try_from(days_from_civil(year as i64, month as u32, day as u32)).ok()?;
    let secs = days * 86400 + hour * 3600 + minute * 60 + second;
    let time = UNIX_EPOCH
        + std::time::Duration::from_secs(secs)
        + std::time::Duration::from_millis(millis);
    Some((time, sequence))
}

/// (year, month, day) in the proleptic Gregorian calendar to days since 1970-01-01.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let month = i64::from(month);
    let doy = (153 * (if month > 2 { month - 3 } else { month + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Encodes, compresses and atomically writes `profile` as `dir/name`.
pub fn write_profile(dir: &Path, name: &str, profile: &Profile) -> Result<PathBuf> {
    write_encoded(dir, name, &profile.encode_to_vec())
}

/// Compresses and atomically writes an encoded profile as `dir/name`.
pub fn write_encoded(dir: &Path, name: &str, encoded: &[u8]) -> Result<PathBuf> {
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(encoded)?;
    write_compressed(dir, name, &gz.finish()?)
}

/// Atomically writes a profile already gzip'd (see
/// [`super::ProfileBuilder::finish_compressed`]) as `dir/name`.
pub fn write_compressed(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf> {
    let final_path = dir.join(name);
    let mut last_error = None;
    // A name already taken (a leftover, or a planted symlink) is never opened: the
    // next name is tried.
    for attempt in 0..TEMP_ATTEMPTS {
        let temp_path = temp_name(dir, name, attempt);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&temp_path);
        let file = match file {
            Ok(file) => file,
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {
                last_error = Some(anyhow::Error::new(err).context(format!(
                    "creating {} (the name is taken)",
                    temp_path.display()
                )));
                continue;
            }
            Err(err) => {
                return Err(err).with_context(|| format!("creating {}", temp_path.display()));
            }
        };
        let result = finish(file, bytes, &temp_path, &final_path, dir);
        if result.is_err() {
            let _ = std::fs::remove_file(&temp_path);
        }
        return result.map(|()| final_path);
    }
    Err(last_error.unwrap_or_else(|| anyhow::anyhow!("no temp file name left")))
}

/// Temp names tried per profile before giving up.
const TEMP_ATTEMPTS: u32 = 8;

fn temp_name(dir: &Path, name: &str, attempt: u32) -> PathBuf {
    dir.join(format!(".{name}.{}.{attempt}.tmp", std::process::id()))
}

/// Writes, syncs and renames the temp file into place. The rename replaces whatever
/// has the final name (a symlink included) without following it.
fn finish(
    mut file: File,
    bytes: &[u8],
    temp_path: &Path,
    final_path: &Path,
    dir: &Path,
) -> Result<()> {
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", temp_path.display()))?;
    std::fs::rename(temp_path, final_path)
        .with_context(|| format!("renaming to {}", final_path.display()))?;
    if let Ok(dir) = File::open(dir) {
        let _ = dir.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::{os::unix::fs::PermissionsExt as _, time::Duration};

    use super::*;

    #[test]
    fn file_names_sort_chronologically() {
        let t = UNIX_EPOCH + Duration::from_millis(1_795_000_000_123);
        assert_eq!(
            profile_file_name(t, 7),
            "heap-20261118T110640.123Z-0007.pb.gz"
        );
        let later = profile_file_name(t + Duration::from_secs(1), 8);
        assert!(profile_file_name(t, 7) < later);
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11016), (2000, 2, 29));
    }

    #[test]
    fn file_names_parse_back() {
        let t = UNIX_EPOCH + Duration::from_millis(1_795_000_000_123);
        assert_eq!(
            parse_profile_file_name(&profile_file_name(t, 7)),
            Some((t, 7))
        );
        let leap = UNIX_EPOCH + Duration::from_secs(11016 * 86400 + 86399);
        assert_eq!(
            parse_profile_file_name(&profile_file_name(leap, 12345)),
            Some((leap, 12345))
        );
        for days in [0, 59, 60, 365, 10_957, 20_000, 50_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
        for other in [
            "heap-20261118T110640.123Z-0007.pb",
            "heap-20261118T110640.123Z-7.pb.gz",
            "heap-20261318T110640.123Z-0007.pb.gz",
            "heap-2026111T110640.123Z-0007.pb.gz",
            "heap-20261118T110640.12Z-0007.pb.gz",
            "heap-20261118T116040.123Z-0007.pb.gz",
            "heap-20261118T110640.123Z-00x7.pb.gz",
            ".heap-20261118T110640.123Z-0007.pb.gz.1.0.tmp",
            "notes.txt",
        ] {
            assert_eq!(parse_profile_file_name(other), None, "{other}");
        }
    }

    #[test]
    fn writes_private_files_and_creates_private_dirs() {
        let base = tempfile::tempdir().expect("tempdir");
        let dir = base.path().join("new/profiles");
        prepare_output_dir(&dir).expect("created");
        let mode = std::fs::metadata(&dir).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let path = write_profile(&dir, "p.pb.gz", &Profile::default()).expect("written");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .expect("readdir")
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
    }

    #[test]
    fn never_writes_through_a_planted_symlink() {
        let base = tempfile::tempdir().expect("tempdir");
        let dir = base.path().join("out");
        prepare_output_dir(&dir).expect("created");
        let victim = base.path().join("victim");
        std::fs::write(&victim, "precious").expect("write");
        let name = "heap-x.pb.gz";
        // At the temp name heapprofd tries first, and at the final name.
        std::os::unix::fs::symlink(&victim, temp_name(&dir, name, 0)).expect("symlink");
        std::os::unix::fs::symlink(&victim, dir.join(name)).expect("symlink");
        let path = write_profile(&dir, name, &Profile::default()).expect("written");
        assert_eq!(std::fs::read_to_string(&victim).expect("read"), "precious");
        let meta = std::fs::symlink_metadata(&path).expect("meta");
        assert!(
            meta.file_type().is_file(),
            "the final name is now a regular file"
        );
        // Every temp name taken: the write fails, still without touching the victim.
        for attempt in 1..TEMP_ATTEMPTS {
            std::os::unix::fs::symlink(&victim, temp_name(&dir, name, attempt)).expect("symlink");
        }
        let err = write_profile(&dir, name, &Profile::default()).expect_err("no name left");
        assert!(format!("{err:#}").contains("the name is taken"), "{err:#}");
        assert_eq!(std::fs::read_to_string(&victim).expect("read"), "precious");
    }

    #[test]
    fn rejects_a_file_as_output_dir() {
        let base = tempfile::tempdir().expect("tempdir");
        let file = base.path().join("f");
        std::fs::write(&file, "x").expect("write");
        let err = prepare_output_dir(&file)
            .expect_err("not a dir")
            .to_string();
        assert!(err.contains("not a directory"), "{err}");
    }
}
