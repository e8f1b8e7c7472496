//! Building a heap profile with interned strings, functions, mappings and locations.

use std::{
    collections::{HashMap, HashSet},
    io::{Read as _, Write as _},
};

use flate2::{Compression, read::GzDecoder, write::GzEncoder};
use prost::Message as _;
use thiserror::Error;

use super::proto::{Function, Label, Line, Location, Mapping, Profile, Sample, ValueType};
use crate::symbolize::Frame;

/// The sample types of a Go heap profile, in Go's order.
pub const SAMPLE_TYPES: [(&str, &str); 4] = [
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
];

/// The sample types of a user-space heap profile: Go's four, then the temporary
/// allocations (freed by their thread before it allocated again, as heaptrack counts
/// them) and what each stack held when its process's in-use total peaked.
pub const USER_SAMPLE_TYPES: [(&str, &str); 8] = [
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
    ("temp_objects", "count"),
    ("temp_space", "bytes"),
    ("peak_inuse_objects", "count"),
    ("peak_inuse_space", "bytes"),
];

/// The sample types of a kernel heap profile: Go's four, where space is the memory
/// handed out (slab-rounded), then the bytes the callers asked for.
pub const KERNEL_SAMPLE_TYPES: [(&str, &str); 6] = [
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
    ("alloc_requested_space", "bytes"),
    ("inuse_requested_space", "bytes"),
];

/// A label value of a sample.
#[derive(Debug, Clone, Copy)]
pub enum LabelValue<'a> {
    /// A string label (e.g. `comm`).
    Str(&'a str),
    /// A numeric label (e.g. `pid`).
    Num(i64),
    /// A numeric label in bytes (e.g. `size_class`).
    Bytes(i64),
}

/// An address space whose addresses the profile holds: one image of one process (a
/// process that calls exec gets a new one), or the kernel. Addresses and mappings
/// are only compared within one space.
pub type AddressSpace = u64;

/// Identity of a mapping in the profile: one region of one address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MappingKey {
    /// The address space.
    pub space: AddressSpace,
    /// Region start address.
    pub start: u64,
}

/// `Profile.sample`'s field number.
const SAMPLE_FIELD: u32 = 2;

/// Accumulates a profile. Ids are assigned densely from 1.
#[derive(Debug)]
pub struct ProfileBuilder {
    profile: Profile,
    /// The samples, encoded and compressed as they are added: `Profile.sample`
    /// fields may come anywhere in the message, so the file is these samples
    /// followed by the rest of the profile, in one gzip stream. A large profile's
    /// samples never exist as message structs all at once, nor even uncompressed.
    samples: GzEncoder<Vec<u8>>,
    /// One sample's encoding, reused.
    sample_bytes: Vec<u8>,
    /// The first rule of the format a sample broke, reported by `finish`.
    broken_sample: Option<String>,
    strings: HashMap<String, i64>,
    functions: HashMap<(String, Option<String>), u64>,
    mappings: HashMap<MappingKey, usize>,
    locations: HashMap<(AddressSpace, u64, u16), u64>,
}

impl ProfileBuilder {
    /// Starts a heap profile taken at `time_nanos` covering `duration_nanos`, with
    /// the given sample types (e.g. [`SAMPLE_TYPES`]; `inuse_space` must be among them).
    pub fn new(time_nanos: i64, duration_nanos: i64, sample_types: &[(&str, &str)]) -> Self {
        let mut builder = Self {
            profile: Profile {
                string_table: vec![String::new()],
                time_nanos,
                duration_nanos,
                period: 1,
                ..Default::default()
            },
            // The fastest level: a dump is on the daemon's clock, and retention bounds
            // the disk. 131,072 samples of 40 frames: 9.0 MB shrink to 1.7 MB; the
            // default level makes 0.66 MB of them but takes about five times as long
            // (0.08 s against 0.38 s).
            samples: GzEncoder::new(Vec::new(), Compression::fast()),
            sample_bytes: Vec::new(),
            broken_sample: None,
            strings: HashMap::from([(String::new(), 0)]),
            functions: HashMap::new(),
            mappings: HashMap::new(),
            locations: HashMap::new(),
        };
        for &(kind, unit) in sample_types {
            let value_type = ValueType {
                r#type: builder.string(kind),
                unit: builder.string(unit),
            };
            builder.profile.sample_type.push(value_type);
        }
        builder.profile.period_type = Some(ValueType {
            r#type: builder.string("space"),
            unit: builder.string("bytes"),
        });
        builder.profile.default_sample_type = builder.string("inuse_space");
        builder
    }

    /// Records that samples were taken once every `bytes` on average (the
    /// period of type space/bytes; 1 means every allocation).
    pub fn period(&mut self, bytes: u64) {
        self.profile.period = i64::try_from(bytes.max(1)).unwrap_or(i64::MAX);
    }

    /// Interns a string.
    pub fn string(&mut self, text: &str) -> i64 {
        if let Some(&index) = self.strings.get(text) {
            return index;
        }
        let index = self.profile.string_table.len() as i64;
        self.profile.string_table.push(text.to_owned());
        self.strings.insert(text.to_owned(), index);
        index
    }

    /// Sets the frames pprof readers drop, with every frame below them (a regular
    /// expression over function names, fully matched).
    pub fn drop_frames(&mut self, regex: &str) {
        self.profile.drop_frames = self.string(regex);
    }

    /// Adds a comment line.
    pub fn comment(&mut self, text: &str) {
        let index = self.string(text);
        self.profile.comment.push(index);
    }

    /// The id of a mapping, adding it on first use. Add the main binary first.
    pub fn mapping(
        &mut self,
        key: MappingKey,
        limit: u64,
        file_offset: u64,
        path: &str,
        build_id: Option<&str>,
    ) -> u64 {
        if let Some(&index) = self.mappings.get(&key) {
            return self.profile.mapping[index].id;
        }
        let id = self.profile.mapping.len() as u64 + 1;
        let mapping = Mapping {
            id,
            memory_start: key.start,
            memory_limit: limit,
            file_offset,
            filename: self.string(path),
            build_id: build_id.map_or(0, |b| self.string(b)),
            ..Default::default()
        };
        self.mappings.insert(key, self.profile.mapping.len());
        self.profile.mapping.push(mapping);
        id
    }

    fn function(&mut self, frame: &Frame) -> u64 {
        let key = (frame.function.clone(), frame.file.clone());
        if let Some(&id) = self.functions.get(&key) {
            return id;
        }
        let id = self.profile.function.len() as u64 + 1;
        let name = self.string(&frame.function);
        let function = Function {
            id,
            name,
            system_name: name,
            filename: frame.file.as_deref().map_or(0, |f| self.string(f)),
            start_line: 0,
        };
        self.profile.function.push(function);
        self.functions.insert(key, id);
        id
    }

    /// The id of the location at `address` in `space`, adding it on first use.
    /// `frames` are innermost first; `mapping` is `None` for addresses outside any
    /// known mapping. `tag` tells apart locations that share an address but are
    /// not the same frame (0 for real frames; the caller's own values for synthetic ones).
    pub fn location(
        &mut self,
        space: AddressSpace,
        address: u64,
        tag: u16,
        mapping: Option<MappingKey>,
        frames: &[Frame],
    ) -> u64 {
        if let Some(&id) = self.locations.get(&(space, address, tag)) {
            return id;
        }
        let id = self.profile.location.len() as u64 + 1;
        let lines: Vec<Line> = frames
            .iter()
            .map(|frame| Line {
                function_id: self.function(frame),
                line: i64::from(frame.line),
                column: 0,
            })
            .collect();
        let mapping_id = match mapping.and_then(|key| self.mappings.get(&key).copied()) {
            Some(index) => {
                let mapping = &mut self.profile.mapping[index];
                if !lines.is_empty() {
                    // Only now: pprof never re-symbolizes a mapping marked as symbolized.
                    mapping.has_functions = true;
                    mapping.has_filenames |= frames.iter().any(|f| f.file.is_some());
                    mapping.has_line_numbers |= frames.iter().any(|f| f.line != 0);
                    mapping.has_inline_frames |= frames.len() > 1;
                }
                mapping.id
            }
            None => 0,
        };
        self.profile.location.push(Location {
            id,
            mapping_id,
            address,
            line: lines,
            is_folded: false,
        });
        self.locations.insert((space, address, tag), id);
        id
    }

    /// Adds a sample: locations leaf first, values in the order of the sample types.
    pub fn sample(
        &mut self,
        location_id: &[u64],
        values: &[u64],
        labels: &[(&str, LabelValue<'_>)],
    ) {
        let label = labels
            .iter()
            .map(|(key, value)| {
                let key = self.string(key);
                match value {
                    LabelValue::Str(text) => Label {
                        key,
                        str: self.string(text),
                        ..Default::default()
                    },
                    LabelValue::Num(num) => Label {
                        key,
                        num: *num,
                        ..Default::default()
                    },
                    LabelValue::Bytes(num) => Label {
                        key,
                        num: *num,
                        num_unit: self.string("bytes"),
                        ..Default::default()
                    },
                }
            })
            .collect();
        let sample = Sample {
            location_id: location_id.to_vec(),
            value: values
                .iter()
                .map(|v| i64::try_from(*v).unwrap_or(i64::MAX))
                .collect(),
            label,
        };
        if self.broken_sample.is_none() {
            self.broken_sample = check_sample(
                &sample,
                self.profile.sample_type.len(),
                self.profile.location.len() as u64,
            );
        }
        self.sample_bytes.clear();
        prost::encoding::message::encode(SAMPLE_FIELD, &sample, &mut self.sample_bytes);
        // Writing to a vector cannot fail.
        let _ = self.samples.write_all(&self.sample_bytes);
    }

    /// The finished profile, checked against the format's rules.
    pub fn finish(mut self) -> Result<Profile, ValidationError> {
        let compressed = self.samples.finish().map_err(compression_error)?;
        let mut encoded = Vec::new();
        GzDecoder::new(compressed.as_slice())
            .read_to_end(&mut encoded)
            .map_err(compression_error)?;
        let samples = Profile::decode(encoded.as_slice())
            .map_err(|err| ValidationError(format!("the samples do not decode: {err}")))?;
        self.profile.sample = samples.sample;
        validate(&self.profile)?;
        Ok(self.profile)
    }

    /// The finished profile, checked against the format's rules, encoded and
    /// gzip'd: what a profile file holds. Its samples never exist as structs all
    /// at once, nor uncompressed.
    pub fn finish_compressed(mut self) -> Result<Vec<u8>, ValidationError> {
        if let Some(broken) = self.broken_sample {
            return Err(ValidationError(broken));
        }
        validate(&self.profile)?;
        self.samples
            .write_all(&self.profile.encode_to_vec())
            .map_err(compression_error)?;
        self.samples.finish().map_err(compression_error)
    }
}

fn compression_error(err: std::io::Error) -> ValidationError {
    ValidationError(format!("compressing the profile: {err}"))
}

/// The rule a sample breaks, if any: as many values as sample types, at least one
/// location, locations that exist (ids are dense from 1, so `locations` is the last).
fn check_sample(sample: &Sample, sample_types: usize, locations: u64) -> Option<String> {
    if sample.value.len() != sample_types {
        return Some(format!(
            "a sample has {} values for {sample_types} sample types",
            sample.value.len()
        ));
    }
    if sample.location_id.is_empty() {
        return Some("a sample has no locations".into());
    }
    sample
        .location_id
        .iter()
        .find(|id| **id == 0 || **id > locations)
        .map(|id| format!("a sample names missing location {id}"))
}

/// A rule of the profile format that a profile breaks.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("invalid profile: {0}")]
pub struct ValidationError(pub String);

/// Checks the rules pprof readers rely on (see profile.proto).
pub fn validate(profile: &Profile) -> Result<(), ValidationError> {
    check_string_indices(profile)?;
    let mappings = unique_ids("mapping", profile.mapping.iter().map(|m| m.id))?;
    let locations = unique_ids("location", profile.location.iter().map(|l| l.id))?;
    let functions = unique_ids("function", profile.function.iter().map(|f| f.id))?;
    for mapping in &profile.mapping {
        if mapping.memory_start >= mapping.memory_limit {
            return Err(ValidationError(format!(
                "mapping {} has an empty address range",
                mapping.id
            )));
        }
    }
    check_locations(profile, &mappings, &functions)?;
    check_samples(profile, &locations)
}

/// The string table starts with the empty string, and every string index in the
/// profile is within it.
fn check_string_indices(profile: &Profile) -> Result<(), ValidationError> {
    if profile.string_table.first().map(String::as_str) != Some("") {
        return Err(ValidationError(
            "string_table[0] must be the empty string".into(),
        ));
    }
    let strings = profile.string_table.len() as i64;
    let string_ok = |index: i64| (0..strings).contains(&index);
    let mut indices = vec![
        profile.default_sample_type,
        profile.drop_frames,
        profile.keep_frames,
    ];
    indices.extend(profile.comment.iter().copied());
    for vt in profile.sample_type.iter().chain(profile.period_type.iter()) {
        indices.extend([vt.r#type, vt.unit]);
    }
    for mapping in &profile.mapping {
        indices.extend([mapping.filename, mapping.build_id]);
    }
    for function in &profile.function {
        indices.extend([function.name, function.system_name, function.filename]);
    }
    for sample in &profile.sample {
        for label in &sample.label {
            indices.extend([label.key, label.str, label.num_unit]);
        }
    }
    if let Some(bad) = indices.iter().find(|i| !string_ok(**i)) {
        return Err(ValidationError(format!(
            "string index {bad} out of range ({strings} strings)"
        )));
    }
    Ok(())
}

/// The `kind` ids, each nonzero and given once.
fn unique_ids(kind: &str, ids: impl Iterator<Item = u64>) -> Result<HashSet<u64>, ValidationError> {
    let mut seen = HashSet::new();
    for id in ids {
        if id == 0 || !seen.insert(id) {
            return Err(ValidationError(format!(
                "{kind} id {id} is zero or repeated"
            )));
        }
    }
    Ok(seen)
}

/// Every location's mapping (0: none) and its lines' functions exist.
fn check_locations(
    profile: &Profile,
    mappings: &HashSet<u64>,
    functions: &HashSet<u64>,
) -> Result<(), ValidationError> {
    for location in &profile.location {
        if location.mapping_id != 0 && !mappings.contains(&location.mapping_id) {
            return Err(ValidationError(format!(
                "location {} names missing mapping {}",
                location.id, location.mapping_id
            )));
        }
        if let Some(line) = location
            .line
            .iter()
            .find(|l| !functions.contains(&l.function_id))
        {
            return Err(ValidationError(format!(
                "location {} names missing function {}",
                location.id, line.function_id
            )));
        }
    }
    Ok(())
}

/// Every sample has a value per sample type, and at least one location, each of
/// which exists.
fn check_samples(profile: &Profile, locations: &HashSet<u64>) -> Result<(), ValidationError> {
    for sample in &profile.sample {
        if sample.value.len() != profile.sample_type.len() {
            return Err(ValidationError(format!(
                "a sample has {} values for {} sample types",
                sample.value.len(),
                profile.sample_type.len()
            )));
        }
        if sample.location_id.is_empty() {
            return Err(ValidationError("a sample has no locations".into()));
        }
        if let Some(id) = sample.location_id.iter().find(|id| !locations.contains(id)) {
            return Err(ValidationError(format!(
                "a sample names missing location {id}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(name: &str) -> Frame {
        Frame {
            function: name.into(),
            file: Some("x.c".into()),
            line: 3,
        }
    }

    #[test]
    fn builds_a_valid_profile() {
        let mut b = ProfileBuilder::new(1, 2, &SAMPLE_TYPES);
        let key = MappingKey {
            space: 1,
            start: 0x1000,
        };
        b.mapping(key, 0x2000, 0, "/bin/x", Some("abcd"));
        let leaf = b.location(1, 0x1100, 1, Some(key), &[frame("malloc")]);
        let caller = b.location(1, 0x1200, 0, Some(key), &[frame("inlined"), frame("main")]);
        assert_eq!(
            b.location(1, 0x1200, 0, Some(key), &[]),
            caller,
            "locations are interned"
        );
        b.sample(
            &[leaf, caller],
            &[1, 16, 1, 16],
            &[("pid", LabelValue::Num(1))],
        );
        b.comment("hello");
        let profile = b.finish().expect("valid");
        assert_eq!(profile.string_table[0], "");
        assert_eq!(profile.sample_type.len(), 4);
        assert!(profile.mapping[0].has_functions && profile.mapping[0].has_inline_frames);
        assert_eq!(profile.function.len(), 3);
    }

    #[test]
    fn the_encoded_profile_decodes_to_the_built_one() {
        let build = || {
            let mut b = ProfileBuilder::new(1, 2, &SAMPLE_TYPES);
            let key = MappingKey {
                space: 1,
                start: 0x1000,
            };
            b.mapping(key, 0x2000, 0, "/bin/x", None);
            let leaf = b.location(1, 0x1100, 1, Some(key), &[frame("malloc")]);
            for caller in 0..3 {
                let site = b.location(1, 0x1200 + caller, 0, Some(key), &[frame("main")]);
                b.sample(
                    &[leaf, site],
                    &[1, 16 + caller, 1, 16],
                    &[("pid", LabelValue::Num(7)), ("comm", LabelValue::Str("x"))],
                );
            }
            b.comment("hello");
            b
        };
        let whole = build().finish().expect("valid");
        let compressed = build().finish_compressed().expect("valid");
        let mut encoded = Vec::new();
        GzDecoder::new(compressed.as_slice())
            .read_to_end(&mut encoded)
            .expect("gzip");
        assert_eq!(Profile::decode(encoded.as_slice()).expect("decodes"), whole);
        assert_eq!(whole.sample.len(), 3);

        let mut broken = ProfileBuilder::new(1, 2, &SAMPLE_TYPES);
        broken.sample(&[5], &[1, 1, 1, 1], &[]);
        assert!(
            broken.finish_compressed().is_err(),
            "a missing location is refused"
        );
        let mut broken = ProfileBuilder::new(1, 2, &SAMPLE_TYPES);
        let loc = broken.location(1, 0x10, 0, None, &[]);
        broken.sample(&[loc], &[1, 1], &[]);
        assert!(
            broken.finish_compressed().is_err(),
            "missing values are refused"
        );
    }

    #[test]
    fn rejects_broken_profiles() {
        let mut b = ProfileBuilder::new(1, 2, &SAMPLE_TYPES);
        let loc = b.location(1, 0x10, 0, None, &[]);
        b.sample(&[loc], &[1, 1, 1, 1], &[]);
        let good = b.finish().expect("valid");

        let mut p = good.clone();
        p.string_table[0] = "x".into();
        assert!(validate(&p).is_err());
        let mut p = good.clone();
        p.sample[0].value.pop();
        assert!(validate(&p).is_err());
        let mut p = good.clone();
        p.sample[0].location_id = vec![99];
        assert!(validate(&p).is_err());
        let mut p = good.clone();
        p.location[0].id = 0;
        assert!(validate(&p).is_err());
        let mut p = good.clone();
        p.location[0].mapping_id = 5;
        assert!(validate(&p).is_err());
        let mut p = good;
        p.comment.push(1000);
        assert!(validate(&p).is_err());
    }
}
