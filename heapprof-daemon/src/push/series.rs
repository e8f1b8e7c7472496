//! From a written profile to the uploads of its series: one per process with `--all`
//! (each process its own series, as a backend keys them), the file itself otherwise.
//!
//! A series is named by a service name (the process's systemd service, else its
//! command name, unless `--push-service-name` says) and carries the labels heapprofd
//! puts on its samples: pid, comm, cgroup, container, pod.

use std::io::Read as _;

use bytes::Bytes;
use flate2::read::GzDecoder;
use prost::Message as _;
use serde::{Deserialize, Serialize};

use super::{processes::split_by_pid, profile_error::ProfileError, scan::scan};
use crate::pprof::proto::{Label, Profile};

/// The sample labels that identify a process's series, in the order they are sent.
pub const SERIES_LABELS: [&str; 5] = ["pid", "comm", "cgroup", "container", "pod"];

/// Who a series is: its service name and its labels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Series {
    /// The service (Pyroscope's application name, OTLP's `service.name`).
    pub service_name: String,
    /// `(name, value)` in [`SERIES_LABELS`] order, those the samples carry.
    pub labels: Vec<(String, String)>,
}

/// One push: a series' profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upload {
    /// Its series.
    pub series: Series,
    /// When the profile was taken (the profile's `time_nanos`).
    pub time_nanos: i64,
    /// The time it covers (`duration_nanos`).
    pub duration_nanos: i64,
    /// The gzip'd pprof: the file's own bytes, shared, when the profile is one series.
    pub pprof_gz: Bytes,
}

/// Decodes a gzip'd profile.
pub fn decode(pprof_gz: &[u8]) -> Result<Profile, ProfileError> {
    let mut bytes = Vec::new();
    GzDecoder::new(pprof_gz)
        .read_to_end(&mut bytes)
        .map_err(ProfileError::Gzip)?;
    Ok(Profile::decode(bytes.as_slice())?)
}

/// The uploads of the profile `pprof_gz`: one per process (by the `pid` label), or
/// the file itself, shared, when it holds one process or none. Neither decodes the
/// profile whole (that takes several times its size): a scan of its labels tells
/// one process from several, and a profile of several is cut into theirs as it
/// inflates (`processes`).
pub fn split(pprof_gz: &Bytes, service_name: Option<&str>) -> Result<Vec<Upload>, ProfileError> {
    let scanned = scan(pprof_gz)?;
    let upload = |strings: &Strings<'_>, labels: &[Label], pprof_gz: Bytes| Upload {
        series: series_of(strings, labels, service_name),
        time_nanos: scanned.time_nanos,
        duration_nanos: scanned.duration_nanos,
        pprof_gz,
    };
    if scanned.in_order && scanned.one_value_of("pid") {
        let strings = |index| scanned.string(index);
        return Ok(vec![upload(
            &strings,
            &scanned.first_labels,
            pprof_gz.clone(),
        )]);
    }
    let mut processes = split_by_pid(pprof_gz)?;
    let parts = std::mem::take(&mut processes.parts);
    let strings = |index| processes.string(index);
    Ok(parts
        .into_iter()
        .map(|(labels, part)| {
            let part = part.map_or_else(|| pprof_gz.clone(), Bytes::from);
            upload(&strings, &labels, part)
        })
        .collect())
}

/// A label's string lookup: the profile's string table, or what a scan kept of it.
type Strings<'a> = dyn Fn(i64) -> &'a str + 'a;

/// The series of the process whose sample carries `sample_labels`.
fn series_of<'a>(
    strings: &Strings<'a>,
    sample_labels: &[Label],
    service_name: Option<&str>,
) -> Series {
    let mut labels = Vec::new();
    for name in SERIES_LABELS {
        let Some(label) = sample_labels.iter().find(|l| strings(l.key) == name) else {
            continue;
        };
        // Only the pid is a number; an empty string (a process gone before its
        // name was read) is index 0 as well.
        let value = if name == "pid" {
            label.num.to_string()
        } else {
            strings(label.str).to_owned()
        };
        labels.push((name.to_owned(), value));
    }
    let label = |name: &str| {
        labels
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    let service_name = match service_name {
        Some(name) => name.to_owned(),
        None => label("cgroup")
            .and_then(systemd_service)
            .or_else(|| label("comm").filter(|c| !c.is_empty()))
            .unwrap_or("unknown")
            .to_owned(),
    };
    Series {
        service_name,
        labels,
    }
}

/// The service a cgroup path is a systemd service's (`/system.slice/nginx.service` →
/// `nginx`), which names a fleet's processes better than their command names.
fn systemd_service(cgroup: &str) -> Option<&str> {
    cgroup
        .rsplit('/')
        .next()?
        .strip_suffix(".service")
        .filter(|name| !name.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pprof::{LabelValue, ProfileBuilder};

    fn profile(processes: &[(i64, &str, Option<&str>)]) -> Bytes {
        let mut builder = ProfileBuilder::new(
            1_000,
            10,
            &[("alloc_space", "bytes"), ("inuse_space", "bytes")],
        );
        for (n, &(pid, comm, cgroup)) in processes.iter().enumerate() {
            let frame = crate::symbolize::Frame {
                function: format!("f{n}"),
                file: None,
                line: 0,
            };
            let location = builder.location(1, 0x1000 + n as u64, 0, None, &[frame]);
            let mut labels = vec![
                ("pid", LabelValue::Num(pid)),
                ("comm", LabelValue::Str(comm)),
            ];
            if let Some(cgroup) = cgroup {
                labels.push(("cgroup", LabelValue::Str(cgroup)));
            }
            builder.sample(
                &[location],
                &[10 * pid.unsigned_abs(), pid.unsigned_abs()],
                &labels,
            );
        }
        Bytes::from(builder.finish_compressed().expect("valid profile"))
    }

    #[test]
    fn one_process_is_pushed_as_the_file_itself() {
        let file = profile(&[(7, "app", None), (7, "app", None)]);
        let uploads = split(&file, None).expect("splits");
        assert_eq!(uploads.len(), 1);
        assert_eq!(uploads[0].pprof_gz, file);
        assert_eq!(uploads[0].series.service_name, "app");
        assert_eq!(
            uploads[0].series.labels,
            vec![("pid".into(), "7".into()), ("comm".into(), "app".into())]
        );
        assert_eq!(uploads[0].time_nanos, 1_000);
    }

    #[test]
    fn each_process_is_its_own_series_with_only_its_samples() {
        let file = profile(&[
            (7, "app", None),
            (8, "nginx", Some("/system.slice/nginx.service")),
        ]);
        let uploads = split(&file, None).expect("splits");
        assert_eq!(uploads.len(), 2);
        assert_eq!(uploads[1].series.service_name, "nginx");
        let second = decode(&uploads[1].pprof_gz).expect("decodes");
        assert_eq!(second.sample.len(), 1);
        assert_eq!(second.sample[0].value, vec![80, 8]);
        assert_eq!(second.location.len(), 1);
        assert_eq!(second.location[0].id, 1, "ids numbered anew");
        assert_eq!(second.sample[0].location_id, vec![1]);
        assert_eq!(second.function[0].id, 1);
        assert_eq!(second.function.len(), 1);
        crate::pprof::builder::validate(&second).expect("a valid profile");
        let named = split(&file, Some("fleet")).expect("splits");
        assert!(named.iter().all(|u| u.series.service_name == "fleet"));
    }
}
