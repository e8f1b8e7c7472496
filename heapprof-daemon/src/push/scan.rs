//! Telling a written profile's processes apart without decoding it: the gzip'd pprof
//! is read as a stream of protobuf fields, keeping one sample's labels at a time, a
//! tally of each label key's values, the few strings the labels name, and the
//! profile's times. A profile of 100k stacks inflates to about 10 MiB and decodes
//! into several times that; this holds one sample.

use std::collections::{HashMap, HashSet};

use prost::Message as _;

use super::{
    profile_error::ProfileError,
    wire::{Fields, LEN, VARINT, as_i64},
};
use crate::pprof::proto::Label;

/// `Profile`'s fields the scan reads (profile.proto's numbers).
const SAMPLE: u64 = 2;
const STRING_TABLE: u64 = 6;
const TIME_NANOS: u64 = 9;
const DURATION_NANOS: u64 = 10;

/// What the scan found.
#[derive(Debug, Default)]
pub struct Scanned {
    /// The first sample's labels.
    pub first_labels: Vec<Label>,
    /// The profile's `time_nanos`.
    pub time_nanos: i64,
    /// The profile's `duration_nanos`.
    pub duration_nanos: i64,
    /// The strings the labels use, by index (the keys of all, the values of the first).
    strings: HashMap<i64, String>,
    /// False when a sample came after a string (not as prost encodes a profile): the
    /// strings a later sample names were not kept, and a whole decode must tell.
    pub in_order: bool,
    /// Per label key: the number label's first value, whether every sample carrying
    /// the key had it, and how many carried it.
    numbers: HashMap<i64, KeyTally>,
    samples: u64,
}

#[derive(Debug, Clone, Copy)]
struct KeyTally {
    first: i64,
    same: bool,
    count: u64,
}

impl Scanned {
    /// The string at `index` of the string table, when the labels use it.
    pub fn string(&self, index: i64) -> &str {
        self.strings.get(&index).map_or("", String::as_str)
    }

    /// Whether every sample has the same number label `key` (or none has it).
    pub fn one_value_of(&self, key: &str) -> bool {
        let Some((index, _)) = self.strings.iter().find(|(_, s)| s.as_str() == key) else {
            return true;
        };
        match self.numbers.get(index) {
            None => true,
            Some(tally) => tally.same && tally.count == self.samples,
        }
    }
}

/// A sample's labels (`Sample.label`); prost skips its other fields.
#[derive(Clone, PartialEq, prost::Message)]
struct LabelsOnly {
    #[prost(message, repeated, tag = "3")]
    label: Vec<Label>,
}

/// Scans the gzip'd profile `pprof_gz`.
pub fn scan(pprof_gz: &[u8]) -> Result<Scanned, ProfileError> {
    let mut fields = Fields::new(pprof_gz);
    let mut scanned = Scanned {
        in_order: true,
        ..Scanned::default()
    };
    let mut wanted: HashSet<i64> = HashSet::new();
    let mut sample = Vec::new();
    let mut string_index = 0i64;
    while let Some(key) = fields.next_key()? {
        match key {
            (SAMPLE, LEN) => {
                scanned.in_order &= string_index == 0;
                fields.bytes(&mut sample)?;
                let labels = LabelsOnly::decode(sample.as_slice())?.label;
                tally(&mut scanned, &mut wanted, labels);
            }
            (STRING_TABLE, LEN) => {
                if wanted.contains(&string_index) {
                    fields.bytes(&mut sample)?;
                    let text = String::from_utf8_lossy(&sample).into_owned();
                    scanned.strings.insert(string_index, text);
                } else {
                    fields.skip(LEN)?;
                }
                string_index += 1;
            }
            (TIME_NANOS, VARINT) => scanned.time_nanos = as_i64(fields.varint()?),
            (DURATION_NANOS, VARINT) => scanned.duration_nanos = as_i64(fields.varint()?),
            (_, wire_type) => fields.skip(wire_type)?,
        }
    }
    Ok(scanned)
}

/// Counts one sample's labels in.
fn tally(scanned: &mut Scanned, wanted: &mut HashSet<i64>, labels: Vec<Label>) {
    let mut seen = HashSet::new();
    for label in &labels {
        wanted.insert(label.key);
        // A key twice on one sample: its first value counts, as `number_label` reads it.
        if !seen.insert(label.key) {
            continue;
        }
        scanned
            .numbers
            .entry(label.key)
            .and_modify(|tally| {
                tally.same &= tally.first == label.num;
                tally.count += 1;
            })
            .or_insert(KeyTally {
                first: label.num,
                same: true,
                count: 1,
            });
    }
    if scanned.samples == 0 {
        wanted.extend(labels.iter().map(|l| l.str));
        scanned.first_labels = labels;
    }
    scanned.samples += 1;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pprof::{LabelValue, ProfileBuilder};

    #[test]
    fn the_scan_reads_what_a_whole_decode_reads() {
        let mut builder = ProfileBuilder::new(1_000, 20, &[("inuse_space", "bytes")]);
        let frame = crate::symbolize::Frame {
            function: "f".into(),
            file: None,
            line: 0,
        };
        let location = builder.location(1, 0x1000, 0, None, &[frame]);
        for (pid, comm) in [(7, "app"), (7, "app")] {
            builder.sample(
                &[location],
                &[10],
                &[
                    ("pid", LabelValue::Num(pid)),
                    ("comm", LabelValue::Str(comm)),
                ],
            );
        }
        let one = builder.finish_compressed().expect("valid");
        let scanned = scan(&one).expect("scans");
        assert!(scanned.one_value_of("pid"));
        assert_eq!((scanned.time_nanos, scanned.duration_nanos), (1_000, 20));
        let comm = scanned
            .first_labels
            .iter()
            .find(|l| scanned.string(l.key) == "comm")
            .expect("a comm label");
        assert_eq!(scanned.string(comm.str), "app");

        let mut builder = ProfileBuilder::new(1_000, 20, &[("inuse_space", "bytes")]);
        let location = builder.location(
            1,
            0x1000,
            0,
            None,
            &[crate::symbolize::Frame {
                function: "f".into(),
                file: None,
                line: 0,
            }],
        );
        builder.sample(&[location], &[10], &[("pid", LabelValue::Num(7))]);
        builder.sample(&[location], &[10], &[("pid", LabelValue::Num(8))]);
        let two = builder.finish_compressed().expect("valid");
        assert!(!scan(&two).expect("scans").one_value_of("pid"));
        assert!(scan(b"not gzip").is_err());
    }
}
