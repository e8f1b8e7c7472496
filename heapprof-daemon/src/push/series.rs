//! From a written profile to the uploads of its series: one per process with `--all`
//! (each process its own series, as a backend keys them), the file itself otherwise.
//!
//! A series is named by a service name (the process's systemd service, else its
//! command name, unless `--push-service-name` says) and carries the labels heapprofd
//! puts on its samples: pid, comm, cgroup, container, pod.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    io::{Read as _, Write as _},
};

use bytes::Bytes;
use flate2::{Compression, read::GzDecoder, write::GzEncoder};
use prost::Message as _;
use serde::{Deserialize, Serialize};

use super::{profile_error::ProfileError, scan::scan};
use crate::pprof::proto::{Label, Profile, Sample};

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
/// the file itself, shared, when it holds one process or none (found by a scan of its
/// labels: a whole decode takes several times the profile's size).
pub fn split(pprof_gz: &Bytes, service_name: Option<&str>) -> Result<Vec<Upload>, ProfileError> {
    let scanned = scan(pprof_gz)?;
    if scanned.in_order && scanned.one_value_of("pid") {
        let strings = |index| scanned.string(index);
        return Ok(vec![Upload {
            series: series_of(&strings, &scanned.first_labels, service_name),
            time_nanos: scanned.time_nanos,
            duration_nanos: scanned.duration_nanos,
            pprof_gz: pprof_gz.clone(),
        }]);
    }
    drop(scanned);
    let profile = decode(pprof_gz)?;
    let strings = |index| string(&profile, index);
    let mut by_pid: BTreeMap<Option<i64>, Vec<&Sample>> = BTreeMap::new();
    for sample in &profile.sample {
        by_pid
            .entry(number_label(&strings, &sample.label, "pid"))
            .or_default()
            .push(sample);
    }
    let upload = |samples: &[&Sample], pprof_gz: Bytes| Upload {
        series: series_of(
            &strings,
            samples.first().map_or(&[][..], |s| s.label.as_slice()),
            service_name,
        ),
        time_nanos: profile.time_nanos,
        duration_nanos: profile.duration_nanos,
        pprof_gz,
    };
    if by_pid.len() <= 1 {
        let samples = by_pid.into_values().next().unwrap_or_default();
        return Ok(vec![upload(&samples, pprof_gz.clone())]);
    }
    Ok(by_pid
        .values()
        .map(|samples| upload(samples, Bytes::from(gzip(&subset(&profile, samples)))))
        .collect())
}

/// The profile with only `samples`, and the locations, functions and mappings they
/// use, numbered anew from 1 (Parca refuses ids that are not 1, 2, 3...). The string
/// table is kept whole: renumbering it would touch every message.
fn subset(profile: &Profile, samples: &[&Sample]) -> Profile {
    let used: HashSet<u64> = samples
        .iter()
        .flat_map(|s| s.location_id.iter().copied())
        .collect();
    let mut location: Vec<_> = profile
        .location
        .iter()
        .filter(|l| used.contains(&l.id))
        .cloned()
        .collect();
    let functions: HashSet<u64> = location
        .iter()
        .flat_map(|l| l.line.iter().map(|line| line.function_id))
        .collect();
    let mappings: HashSet<u64> = location.iter().map(|l| l.mapping_id).collect();
    let mut mapping: Vec<_> = profile
        .mapping
        .iter()
        .filter(|m| mappings.contains(&m.id))
        .cloned()
        .collect();
    let mut function: Vec<_> = profile
        .function
        .iter()
        .filter(|f| functions.contains(&f.id))
        .cloned()
        .collect();
    let mapping_ids = renumber(mapping.iter_mut().map(|m| &mut m.id));
    let function_ids = renumber(function.iter_mut().map(|f| &mut f.id));
    let location_ids = renumber(location.iter_mut().map(|l| &mut l.id));
    // 0 stays 0: "none".
    let new_id = |ids: &HashMap<u64, u64>, id: u64| ids.get(&id).copied().unwrap_or(0);
    for location in &mut location {
        location.mapping_id = new_id(&mapping_ids, location.mapping_id);
        for line in &mut location.line {
            line.function_id = new_id(&function_ids, line.function_id);
        }
    }
    let sample = samples
        .iter()
        .map(|&s| Sample {
            location_id: s
                .location_id
                .iter()
                .map(|&id| new_id(&location_ids, id))
                .collect(),
            ..s.clone()
        })
        .collect();
    // Field by field: a clone of the whole profile would copy every sample.
    Profile {
        sample_type: profile.sample_type.clone(),
        sample,
        mapping,
        location,
        function,
        string_table: profile.string_table.clone(),
        drop_frames: profile.drop_frames,
        keep_frames: profile.keep_frames,
        time_nanos: profile.time_nanos,
        duration_nanos: profile.duration_nanos,
        period_type: profile.period_type,
        period: profile.period,
        comment: profile.comment.clone(),
        default_sample_type: profile.default_sample_type,
    }
}

/// Numbers `ids` 1, 2, 3... in order; returns the old id → new id map.
fn renumber<'a>(ids: impl Iterator<Item = &'a mut u64>) -> HashMap<u64, u64> {
    ids.zip(1..)
        .map(|(id, new)| (std::mem::replace(id, new), new))
        .collect()
}

/// `profile` encoded and gzip'd.
fn gzip(profile: &Profile) -> Vec<u8> {
    let mut encoder = GzEncoder::new(Vec::new(), Compression::default());
    // Writing to memory cannot fail.
    let _ = encoder.write_all(&profile.encode_to_vec());
    encoder.finish().unwrap_or_default()
}

fn string(profile: &Profile, index: i64) -> &str {
    usize::try_from(index)
        .ok()
        .and_then(|i| profile.string_table.get(i))
        .map_or("", String::as_str)
}

/// A label's string lookup: the profile's string table, or what a scan kept of it.
type Strings<'a> = dyn Fn(i64) -> &'a str + 'a;

fn number_label<'a>(strings: &Strings<'a>, labels: &[Label], key: &str) -> Option<i64> {
    labels.iter().find(|l| strings(l.key) == key).map(|l| l.num)
}

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
