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

use std::collections::HashMap;

use opentelemetry_proto::tonic::{
    collector::profiles::v1development::ExportProfilesServiceRequest,
    common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value::Value},
    profiles::v1development::{
        Function, KeyValueAndUnit, Line, Location, Mapping, Profile as OtlpProfile,
        ProfilesDictionary, ResourceProfiles, Sample as OtlpSample, ScopeProfiles, Stack,
        ValueType as OtlpValueType,
    },
    resource::v1::Resource,
};

use super::series::{SeriesError, Upload, decode};
use crate::pprof::proto::{Profile, ValueType};

/// The request that pushes `upload`.
pub fn export_request(upload: &Upload) -> Result<ExportProfilesServiceRequest, SeriesError> {
    let pprof = decode(&upload.pprof_gz)?;
    let mut translation = Translation::new(&pprof);
    let samples: Vec<(i32, Vec<i32>, &[i64])> = pprof
        .sample
        .iter()
        .map(|sample| {
            let stack = translation.stack(&sample.location_id);
            let attributes = sample
                .label
                .iter()
                .map(|label| translation.attribute(label))
                .collect();
            (stack, attributes, sample.value.as_slice())
        })
        .collect();
    let period_type = pprof.period_type.as_ref().map(value_type);
    let profiles = pprof
        .sample_type
        .iter()
        .enumerate()
        .map(|(i, sample_type)| OtlpProfile {
            sample_type: Some(value_type(sample_type)),
            samples: samples
                .iter()
                .map(|(stack, attributes, values)| OtlpSample {
                    stack_index: *stack,
                    attribute_indices: attributes.clone(),
                    values: vec![values.get(i).copied().unwrap_or(0)],
                    ..OtlpSample::default()
                })
                .collect(),
            time_unix_nano: u64::try_from(pprof.time_nanos).unwrap_or(0),
            duration_nano: u64::try_from(pprof.duration_nanos).unwrap_or(0),
            period_type,
            period: pprof.period,
            profile_id: profile_id(),
            original_payload_format: if i == 0 {
                "pprof".into()
            } else {
                String::new()
            },
            original_payload: if i == 0 {
                upload.pprof_gz.clone()
            } else {
                Vec::new()
            },
            ..OtlpProfile::default()
        })
        .collect();
    Ok(ExportProfilesServiceRequest {
        resource_profiles: vec![ResourceProfiles {
            resource: Some(resource(upload)),
            scope_profiles: vec![ScopeProfiles {
                scope: Some(InstrumentationScope {
                    name: "heapprofd".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..InstrumentationScope::default()
                }),
                profiles,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
        dictionary: Some(translation.finish()),
    })
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
    dictionary: ProfilesDictionary,
    /// pprof location id → index in the location table.
    locations: HashMap<u64, i32>,
    stacks: HashMap<Vec<i32>, i32>,
    attributes: HashMap<(i64, i64, i64, i64), i32>,
}

impl Translation {
    /// The tables of `pprof`; stacks and attributes are added as samples use them.
    fn new(pprof: &Profile) -> Self {
        let mut dictionary = ProfilesDictionary {
            // Index 0 of every table is its zero value, which stands for "none".
            mapping_table: vec![Mapping::default()],
            location_table: vec![Location::default()],
            function_table: vec![Function::default()],
            link_table: vec![Default::default()],
            string_table: pprof.string_table.clone(),
            attribute_table: vec![KeyValueAndUnit::default()],
            stack_table: vec![Stack::default()],
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
            stacks: HashMap::new(),
            attributes: HashMap::new(),
        }
    }

    /// The stack of a sample's locations (leaf first, as in pprof), added once.
    fn stack(&mut self, location_ids: &[u64]) -> i32 {
        let indices: Vec<i32> = location_ids
            .iter()
            .map(|id| self.locations.get(id).copied().unwrap_or(0))
            .collect();
        if let Some(&index) = self.stacks.get(&indices) {
            return index;
        }
        let index = table_index(&self.dictionary.stack_table);
        self.dictionary.stack_table.push(Stack {
            location_indices: indices.clone(),
        });
        self.stacks.insert(indices, index);
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

    fn finish(self) -> ProfilesDictionary {
        self.dictionary
    }
}

/// The index the next entry of `table` gets.
fn table_index<T>(table: &[T]) -> i32 {
    i32::try_from(table.len()).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
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
        let file = builder.finish_compressed().expect("valid");
        let upload = split(&file, None).expect("splits").remove(0);
        let request = export_request(&upload).expect("translates");
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
