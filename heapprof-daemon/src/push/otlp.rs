//! OTLP profiles (`opentelemetry.proto.profiles.v1development`, as the
//! `opentelemetry-proto` crate generates it): one upload as an
//! `ExportProfilesServiceRequest`.
//!
//! The pprof is translated into OTLP's dictionary form: pprof's string table is the
//! dictionary's (both keep "" at 0); functions, mappings and locations move into the
//! dictionary's tables behind their zero entry; each sample's locations become a
//! stack and its labels attributes. OTLP gives a profile one sample type, so each of
//! pprof's sample types is one profile of the same scope. The series' labels are
//! resource attributes (semantic conventions: `service.name`, `process.pid`,
//! `process.executable.name`, `process.linux.cgroup`, `container.id`, `k8s.pod.uid`).
//! The gzip'd pprof itself rides along in the first profile's `original_payload`
//! (`original_payload_format = "pprof"`). The profile's comments are not carried
//! (OTLP has no place for them); the pprof keeps them.

use std::{
    collections::HashMap,
    hash::{BuildHasher as _, RandomState},
};

use opentelemetry_proto::tonic::{
    common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value::Value},
    profiles::v1development::{
        Function, KeyValueAndUnit, Line, Location, Mapping, Profile as OtlpProfile,
        ProfilesDictionary, ResourceProfiles, Sample as OtlpSample, ScopeProfiles, Stack,
        ValueType as OtlpValueType,
    },
    resource::v1::Resource,
};
use prost::{
    Message as _,
    encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len},
};

use super::{
    profile_error::ProfileError,
    series::Upload,
    wire::{Fields, LEN},
};
use crate::pprof::proto::{Profile, Sample, ValueType};

/// The field numbers the request is put together with (profiles.proto,
/// profiles_service.proto): each profile's samples are encoded as they are
/// translated, and the messages around them are written around their bytes.
const PPROF_SAMPLE: u64 = 2;
const REQUEST_RESOURCE_PROFILES: u32 = 1;
const REQUEST_DICTIONARY: u32 = 2;
const RESOURCE_SCOPE_PROFILES: u32 = 2;
const SCOPE_PROFILES: u32 = 2;
const PROFILE_SAMPLES: u32 = 2;
const DICTIONARY_STACKS: u32 = 7;

/// The encoded `ExportProfilesServiceRequest` that pushes `upload`, with the gzip'd
/// pprof in the first profile's `original_payload` when `original_payload` says.
///
/// Streamed, for memory: the pprof is read as it inflates, its tables first, then its
/// samples twice, one at a time. The first pass builds the dictionary and measures
/// each profile's samples; the second encodes each sample's OTLP samples straight
/// into their places in the request. Nothing holds the decoded profile, the
/// translated samples or a second copy of the request (a profile of 100k stacks took
/// 300 MiB as messages, then about twice the request's size while it was put
/// together; now little more than the request).
pub fn export_request(upload: &Upload, original_payload: bool) -> Result<Vec<u8>, ProfileError> {
    let mut tables = tables(&upload.pprof_gz)?;
    let mut translation = Translation::new(&mut tables);
    let mut lengths = vec![0usize; tables.sample_type.len()];
    for_each_sample(&upload.pprof_gz, |sample| {
        let translated = translation.sample(sample);
        for (i, length) in lengths.iter_mut().enumerate() {
            *length += field_len(PROFILE_SAMPLES, translated.otlp(sample, i).encoded_len());
        }
        Ok(())
    })?;
    let heads = profile_heads(&tables, upload, original_payload);
    let scope_head = ScopeProfiles {
        scope: Some(InstrumentationScope {
            name: "heapprofd".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            ..InstrumentationScope::default()
        }),
        profiles: Vec::new(),
        schema_url: String::new(),
    }
    .encode_to_vec();
    let resource_head = ResourceProfiles {
        resource: Some(resource(upload)),
        scope_profiles: Vec::new(),
        schema_url: String::new(),
    }
    .encode_to_vec();
    let scope_len = scope_head.len()
        + heads
            .iter()
            .zip(&lengths)
            .map(|(head, samples)| field_len(SCOPE_PROFILES, head.len() + samples))
            .sum::<usize>();
    let resource_len = resource_head.len() + field_len(RESOURCE_SCOPE_PROFILES, scope_len);
    let mut request = Vec::with_capacity(
        field_len(REQUEST_RESOURCE_PROFILES, resource_len)
            + field_len(REQUEST_DICTIONARY, translation.dictionary_len()),
    );
    field_head(REQUEST_RESOURCE_PROFILES, resource_len, &mut request);
    request.extend_from_slice(&resource_head);
    field_head(RESOURCE_SCOPE_PROFILES, scope_len, &mut request);
    request.extend_from_slice(&scope_head);
    // Each profile: its fields but the samples, then room for the samples.
    let mut places = Vec::with_capacity(heads.len());
    for (head, samples) in heads.iter().zip(&lengths) {
        field_head(SCOPE_PROFILES, head.len() + samples, &mut request);
        request.extend_from_slice(head);
        let start = request.len();
        request.resize(start + samples, 0);
        places.push(start..start + samples);
    }
    drop(heads);
    for_each_sample(&upload.pprof_gz, |sample| {
        let translated = translation.sample(sample);
        for (i, place) in places.iter_mut().enumerate() {
            let otlp = translated.otlp(sample, i);
            let end = place.start + field_len(PROFILE_SAMPLES, otlp.encoded_len());
            let Some(mut slot) = request
                .get_mut(place.start..end)
                .filter(|_| end <= place.end)
            else {
                return Err(ProfileError::Malformed(
                    "its samples read differently twice",
                ));
            };
            prost::encoding::message::encode(PROFILE_SAMPLES, &otlp, &mut slot);
            place.start = end;
        }
        Ok(())
    })?;
    if places.iter().any(|place| !place.is_empty()) {
        return Err(ProfileError::Malformed(
            "its samples read differently twice",
        ));
    }
    translation.write_dictionary(&mut request);
    Ok(request)
}

/// Calls `each` with every sample of a gzip'd pprof, in order, one decoded at a time.
fn for_each_sample(
    pprof_gz: &[u8],
    mut each: impl FnMut(&Sample) -> Result<(), ProfileError>,
) -> Result<(), ProfileError> {
    let mut fields = Fields::new(pprof_gz);
    let mut buffer = Vec::new();
    while let Some(key) = fields.next_key()? {
        if key != (PPROF_SAMPLE, LEN) {
            fields.skip(key.1)?;
            continue;
        }
        fields.bytes(&mut buffer)?;
        each(&Sample::decode(buffer.as_slice())?)?;
    }
    Ok(())
}

/// Each profile's fields but its samples, encoded: one profile per sample type.
fn profile_heads(tables: &Profile, upload: &Upload, original_payload: bool) -> Vec<Vec<u8>> {
    let period_type = tables.period_type.as_ref().map(value_type);
    (0..tables.sample_type.len())
        .map(|i| {
            let first = i == 0 && original_payload;
            OtlpProfile {
                sample_type: Some(value_type(&tables.sample_type[i])),
                time_unix_nano: u64::try_from(tables.time_nanos).unwrap_or(0),
                duration_nano: u64::try_from(tables.duration_nanos).unwrap_or(0),
                period_type,
                period: tables.period,
                profile_id: profile_id(),
                original_payload_format: if first { "pprof".into() } else { String::new() },
                original_payload: if first {
                    upload.pprof_gz.to_vec()
                } else {
                    Vec::new()
                },
                ..OtlpProfile::default()
            }
            .encode_to_vec()
        })
        .collect()
}

/// A pprof sample as the dictionary has it: its stack and attributes.
struct TranslatedSample {
    stack_index: i32,
    attribute_indices: Vec<i32>,
}

impl TranslatedSample {
    /// The OTLP sample of the profile of sample type `i`.
    fn otlp(&self, sample: &Sample, i: usize) -> OtlpSample {
        OtlpSample {
            stack_index: self.stack_index,
            attribute_indices: self.attribute_indices.clone(),
            values: vec![sample.value.get(i).copied().unwrap_or(0)],
            ..OtlpSample::default()
        }
    }
}

/// The size of a length-delimited field `tag` of `len` bytes.
fn field_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

/// Writes the key and length of a length-delimited field `tag` of `len` bytes.
fn field_head(tag: u32, len: usize, out: &mut Vec<u8>) {
    encode_key(tag, WireType::LengthDelimited, out);
    encode_varint(len as u64, out);
}

/// The pprof's fields but its samples: its tables, types and times.
fn tables(pprof_gz: &[u8]) -> Result<Profile, ProfileError> {
    let mut fields = Fields::new(pprof_gz);
    let mut kept = Vec::new();
    let mut buffer = Vec::new();
    while let Some(key) = fields.next_key()? {
        if key.0 == PPROF_SAMPLE {
            fields.skip(key.1)?;
        } else {
            fields.copy(key, &mut buffer, &mut kept)?;
        }
    }
    Ok(Profile::decode(kept.as_slice())?)
}

/// The OTLP resource attribute for each series label.
const RESOURCE_ATTRIBUTES: [(&str, &str); 5] = [
    ("pid", "process.pid"),
    ("comm", "process.executable.name"),
    ("cgroup", "process.linux.cgroup"),
    ("container", "container.id"),
    ("pod", "k8s.pod.uid"),
];

fn resource(upload: &Upload) -> Resource {
    let mut attributes = vec![string_attribute(
        "service.name",
        &upload.series.service_name,
    )];
    for (name, value) in &upload.series.labels {
        let Some((_, key)) = RESOURCE_ATTRIBUTES.iter().find(|(n, _)| n == name) else {
            continue;
        };
        attributes.push(match value.parse::<i64>() {
            Ok(number) if *name == "pid" => KeyValue {
                key: (*key).into(),
                value: Some(AnyValue {
                    value: Some(Value::IntValue(number)),
                }),
                ..KeyValue::default()
            },
            _ => string_attribute(key, value),
        });
    }
    Resource {
        attributes,
        ..Resource::default()
    }
}

fn string_attribute(key: &str, value: &str) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue {
            value: Some(Value::StringValue(value.into())),
        }),
        ..KeyValue::default()
    }
}

fn value_type(vt: &ValueType) -> OtlpValueType {
    OtlpValueType {
        type_strindex: string_index(vt.r#type),
        unit_strindex: string_index(vt.unit),
    }
}

/// A pprof string index as the dictionary's (the same table).
fn string_index(i: i64) -> i32 {
    i32::try_from(i).unwrap_or(0)
}

/// A fresh profile id: 16 random bytes (all zero would mean "none").
fn profile_id() -> Vec<u8> {
    let mut id = [0u8; 16];
    // SAFETY: getrandom writes at most `id.len()` bytes into `id`.
    let filled = unsafe { libc::getrandom(id.as_mut_ptr().cast(), id.len(), 0) };
    if filled != 16 || id == [0; 16] {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        id = (nanos | 1).to_le_bytes();
    }
    id.to_vec()
}

/// The dictionary being built from one pprof.
struct Translation {
    /// Every table but the stacks'.
    dictionary: ProfilesDictionary,
    /// pprof location id → index in the location table.
    locations: HashMap<u64, i32>,
    /// The stack table, encoded: each stack's `Stack` message, one after another,
    /// the empty stack (index 0) first. As messages, 100k stacks of 20 frames took
    /// 12 MiB; encoded, about a fifth of that.
    stack_bytes: Vec<u8>,
    /// Where each stack's message ends in `stack_bytes`, by index.
    stack_ends: Vec<usize>,
    /// Indices into the stack table, by the hash of their messages.
    stacks: hashbrown::HashTable<i32>,
    hasher: RandomState,
    /// A sample's location indices, and their `Stack` message, before they are
    /// known to be a new stack.
    scratch: Vec<i32>,
    scratch_bytes: Vec<u8>,
    attributes: HashMap<(i64, i64, i64, i64), i32>,
}

impl Translation {
    /// The tables of `pprof`; stacks and attributes are added as samples use them.
    fn new(pprof: &mut Profile) -> Self {
        let mut dictionary = ProfilesDictionary {
            // Index 0 of every table is its zero value, which stands for "none".
            mapping_table: vec![Mapping::default()],
            location_table: vec![Location::default()],
            function_table: vec![Function::default()],
            link_table: vec![Default::default()],
            string_table: std::mem::take(&mut pprof.string_table),
            attribute_table: vec![KeyValueAndUnit::default()],
            // Kept encoded (`stack_bytes`), index 0 included.
            stack_table: Vec::new(),
        };
        if dictionary.string_table.is_empty() {
            dictionary.string_table.push(String::new());
        }
        let mut mappings = HashMap::new();
        for mapping in &pprof.mapping {
            mappings.insert(mapping.id, table_index(&dictionary.mapping_table));
            dictionary.mapping_table.push(Mapping {
                memory_start: mapping.memory_start,
                memory_limit: mapping.memory_limit,
                file_offset: mapping.file_offset,
                filename_strindex: string_index(mapping.filename),
                attribute_indices: Vec::new(),
            });
        }
        let mut functions = HashMap::new();
        for function in &pprof.function {
            functions.insert(function.id, table_index(&dictionary.function_table));
            dictionary.function_table.push(Function {
                name_strindex: string_index(function.name),
                system_name_strindex: string_index(function.system_name),
                filename_strindex: string_index(function.filename),
                start_line: function.start_line,
            });
        }
        let mut locations = HashMap::new();
        for location in &pprof.location {
            locations.insert(location.id, table_index(&dictionary.location_table));
            dictionary.location_table.push(Location {
                mapping_index: mappings.get(&location.mapping_id).copied().unwrap_or(0),
                address: location.address,
                lines: location
                    .line
                    .iter()
                    .map(|line| Line {
                        function_index: functions.get(&line.function_id).copied().unwrap_or(0),
                        line: line.line,
                        column: line.column,
                    })
                    .collect(),
                attribute_indices: Vec::new(),
            });
        }
        Translation {
            dictionary,
            locations,
            stack_bytes: Stack::default().encode_to_vec(),
            stack_ends: vec![0],
            stacks: hashbrown::HashTable::new(),
            hasher: RandomState::new(),
            scratch: Vec::new(),
            scratch_bytes: Vec::new(),
            attributes: HashMap::new(),
        }
    }

    /// The stack and attributes of a pprof sample, added on first use.
    fn sample(&mut self, sample: &Sample) -> TranslatedSample {
        TranslatedSample {
            stack_index: self.stack(&sample.location_id),
            attribute_indices: sample
                .label
                .iter()
                .map(|label| self.attribute(label))
                .collect(),
        }
    }

    /// The encoded `Stack` message of index `index`.
    fn stack_message(&self, index: usize) -> &[u8] {
        let start = index
            .checked_sub(1)
            .map_or(0, |before| self.stack_ends[before]);
        &self.stack_bytes[start..self.stack_ends[index]]
    }

    /// The stack of a sample's locations (leaf first, as in pprof), added once.
    fn stack(&mut self, location_ids: &[u64]) -> i32 {
        self.scratch.clear();
        self.scratch.extend(
            location_ids
                .iter()
                .map(|id| self.locations.get(id).copied().unwrap_or(0)),
        );
        self.scratch_bytes.clear();
        // As prost encodes a `Stack` (its one field, packed).
        prost::encoding::int32::encode_packed(1, &self.scratch, &mut self.scratch_bytes);
        let hash = self.hasher.hash_one(self.scratch_bytes.as_slice());
        let same = |&index: &i32| self.stack_message(index as usize) == self.scratch_bytes;
        if let Some(&index) = self.stacks.find(hash, same) {
            return index;
        }
        let index = i32::try_from(self.stack_ends.len()).unwrap_or(i32::MAX);
        self.stack_bytes.extend_from_slice(&self.scratch_bytes);
        self.stack_ends.push(self.stack_bytes.len());
        let (hasher, ends, bytes) = (&self.hasher, &self.stack_ends, &self.stack_bytes);
        self.stacks.insert_unique(hash, index, |&index| {
            let index = index as usize;
            let start = index.checked_sub(1).map_or(0, |before| ends[before]);
            hasher.hash_one(&bytes[start..ends[index]])
        });
        index
    }

    /// The attribute of a sample label (a string or a number with its unit), added once.
    fn attribute(&mut self, label: &crate::pprof::proto::Label) -> i32 {
        let key = (label.key, label.str, label.num, label.num_unit);
        if let Some(&index) = self.attributes.get(&key) {
            return index;
        }
        let value = if label.str != 0 {
            let text = usize::try_from(label.str)
                .ok()
                .and_then(|i| self.dictionary.string_table.get(i))
                .cloned()
                .unwrap_or_default();
            Value::StringValue(text)
        } else {
            Value::IntValue(label.num)
        };
        let index = table_index(&self.dictionary.attribute_table);
        self.dictionary.attribute_table.push(KeyValueAndUnit {
            key_strindex: string_index(label.key),
            value: Some(AnyValue { value: Some(value) }),
            unit_strindex: string_index(label.num_unit),
        });
        self.attributes.insert(key, index);
        index
    }

    /// The encoded size of the dictionary, stacks included.
    fn dictionary_len(&self) -> usize {
        self.dictionary.encoded_len()
            + (0..self.stack_ends.len())
                .map(|index| field_len(DICTIONARY_STACKS, self.stack_message(index).len()))
                .sum::<usize>()
    }

    /// Appends the request's `dictionary` field: the tables, then the stacks as
    /// they are kept (a message's fields may come in any order).
    fn write_dictionary(&self, out: &mut Vec<u8>) {
        field_head(REQUEST_DICTIONARY, self.dictionary_len(), out);
        // Writing to a vector cannot run out of room.
        let _ = self.dictionary.encode(out);
        for index in 0..self.stack_ends.len() {
            let stack = self.stack_message(index);
            field_head(DICTIONARY_STACKS, stack.len(), out);
            out.extend_from_slice(stack);
        }
    }
}

/// The index the next entry of `table` gets.
fn table_index<T>(table: &[T]) -> i32 {
    i32::try_from(table.len()).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceRequest;

    use super::*;
    use crate::{
        pprof::{LabelValue, ProfileBuilder},
        push::series::split,
        symbolize::Frame,
    };

    #[test]
    fn every_sample_type_is_a_profile_over_one_dictionary() {
        let mut builder =
            ProfileBuilder::new(5, 10, &[("alloc_space", "bytes"), ("inuse_space", "bytes")]);
        let frame = |name: &str| Frame {
            function: name.into(),
            file: None,
            line: 3,
        };
        let leaf = builder.location(1, 0x10, 0, None, &[frame("malloc")]);
        let caller = builder.location(1, 0x20, 0, None, &[frame("main")]);
        builder.sample(
            &[leaf, caller],
            &[64, 32],
            &[
                ("pid", LabelValue::Num(9)),
                ("comm", LabelValue::Str("app")),
            ],
        );
        let file = bytes::Bytes::from(builder.finish_compressed().expect("valid"));
        let upload = split(&file, None).expect("splits").remove(0);
        let encoded = export_request(&upload, true).expect("translates");
        let request = ExportProfilesServiceRequest::decode(encoded.as_slice()).expect("decodes");
        let without = export_request(&upload, false).expect("translates");
        let without = ExportProfilesServiceRequest::decode(without.as_slice()).expect("decodes");
        let profiles = &without.resource_profiles[0].scope_profiles[0].profiles;
        assert!(profiles[0].original_payload.is_empty());
        assert!(profiles[0].original_payload_format.is_empty());
        assert_eq!(profiles[1].samples[0].values, vec![32]);
        let dictionary = request.dictionary.expect("a dictionary");
        let scope = &request.resource_profiles[0].scope_profiles[0];
        assert_eq!(scope.profiles.len(), 2);
        let strings = &dictionary.string_table;
        let name = |vt: &Option<OtlpValueType>| {
            strings[vt.as_ref().expect("typed").type_strindex as usize].clone()
        };
        assert_eq!(name(&scope.profiles[0].sample_type), "alloc_space");
        assert_eq!(name(&scope.profiles[1].sample_type), "inuse_space");
        assert_eq!(scope.profiles[1].samples[0].values, vec![32]);
        assert_eq!(scope.profiles[0].original_payload, file);
        assert_eq!(scope.profiles[0].original_payload_format, "pprof");
        assert!(scope.profiles[1].original_payload.is_empty());
        let stack = &dictionary.stack_table[scope.profiles[0].samples[0].stack_index as usize];
        let functions: Vec<&str> = stack
            .location_indices
            .iter()
            .map(|&l| {
                let line = &dictionary.location_table[l as usize].lines[0];
                let function = &dictionary.function_table[line.function_index as usize];
                strings[function.name_strindex as usize].as_str()
            })
            .collect();
        assert_eq!(functions, ["malloc", "main"]);
        let resource = request.resource_profiles[0]
            .resource
            .as_ref()
            .expect("a resource");
        assert!(
            resource
                .attributes
                .contains(&string_attribute("service.name", "app"))
        );
        assert_eq!(scope.profiles[0].samples[0].attribute_indices.len(), 2);
    }
}
