//! A profile read back for reporting: samples with their stacks spelled out as
//! frame names, the process labels, and the memory figures from the comments.

use std::{
    io::Read as _,
    path::{Path, PathBuf},
};

use flate2::read::GzDecoder;
use prost::Message as _;
use thiserror::Error;

use crate::{
    memstats::{KernelMemory, ProcessMemory},
    pprof::proto,
};

/// Why a profile could not be read.
#[derive(Debug, Error)]
pub enum LoadError {
    /// The file could not be read. The cause is the error's source (not repeated here:
    /// `{:#}` prints the chain).
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The bytes are not a (gzip'd) `profile.proto`.
    #[error("{path} is not a pprof profile ({reason}); give a .pb.gz file heapprofd wrote")]
    NotAProfile {
        /// The file.
        path: PathBuf,
        /// What the decoder said.
        reason: String,
    },
    /// A sample type the report needs is missing.
    #[error("{path} has no sample type {wanted}; it has {have}")]
    NoSampleType {
        /// The file.
        path: PathBuf,
        /// The type asked for.
        wanted: String,
        /// The types present.
        have: String,
    },
}

/// One location of a stack: an address and the functions at it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The address in the process (the call instruction for callers; the function's
    /// entry for the allocator leaf); 0 when unknown.
    pub address: u64,
    /// Index into [`Profile::mappings`] of the mapping holding the address.
    pub mapping: Option<usize>,
    /// Function names, innermost (inlined) first. For an address without a symbol
    /// this is one name, `lib+0xOFFSET`, which means the same in every run.
    pub names: Vec<String>,
}

/// One sample: a stack and its values, in the order of [`Profile::sample_types`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// The process (label `pid`), when the profile has one.
    pub pid: Option<u32>,
    /// The command name (label `comm`).
    pub comm: Option<String>,
    /// The slab cache or kmalloc size class of a kernel sample (label `cache`).
    pub cache: Option<String>,
    /// The page order of a kernel page sample (label `order`).
    pub order: Option<i64>,
    /// The smallest request size of the sample's power-of-two size class (label
    /// `size_class`, user-space profiles).
    pub size_class: Option<i64>,
    /// The stack, innermost (the allocator function) first.
    pub locations: Vec<Location>,
    /// One value per sample type.
    pub values: Vec<i64>,
}

impl Sample {
    /// The frame names of the stack, innermost first, inlined functions included.
    pub fn frames(&self) -> impl DoubleEndedIterator<Item = &str> {
        self.locations
            .iter()
            .flat_map(|location| location.names.iter().map(String::as_str))
    }
}

/// A mapping of the profile (a region of a mapped file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    /// Start address.
    pub start: u64,
    /// End address (exclusive).
    pub limit: u64,
    /// Offset in the file of `start`.
    pub file_offset: u64,
    /// The file's path.
    pub path: String,
    /// Its GNU build-id in hex, when known.
    pub build_id: Option<String>,
}

/// A profile as read back from a file.
#[derive(Debug, Clone)]
pub struct Profile {
    /// Where it was read from.
    pub path: PathBuf,
    /// When it was taken, in nanoseconds since the epoch.
    pub time_nanos: i64,
    /// How long the session had run when it was taken.
    pub duration_nanos: i64,
    /// The sample types, e.g. `alloc_objects`, `inuse_space`.
    pub sample_types: Vec<String>,
    /// The sampling period in bytes (1: every allocation was recorded).
    pub period: i64,
    /// The comment lines.
    pub comments: Vec<String>,
    /// The samples.
    pub samples: Vec<Sample>,
    /// The mappings, in the file's order (the first is the main program's).
    pub mappings: Vec<Mapping>,
    /// Per-process memory figures recorded beside the heap.
    pub processes: Vec<ProcessMemory>,
    /// Kernel slab figures (kernel-mode profiles).
    pub kernel_memory: Option<KernelMemory>,
}

impl Profile {
    /// Reads a profile, gzip'd or not.
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let raw = std::fs::read(path).map_err(|source| LoadError::Io {
            path: path.to_owned(),
            source,
        })?;
        let bytes = if raw.starts_with(&[0x1f, 0x8b]) {
            let mut bytes = Vec::new();
            GzDecoder::new(raw.as_slice())
                .read_to_end(&mut bytes)
                .map_err(|err| LoadError::NotAProfile {
                    path: path.to_owned(),
                    reason: format!("bad gzip data: {err}"),
                })?;
            bytes
        } else {
            raw
        };
        let message =
            proto::Profile::decode(bytes.as_slice()).map_err(|err| LoadError::NotAProfile {
                path: path.to_owned(),
                reason: err.to_string(),
            })?;
        Self::from_proto(path, &message).map_err(|reason| LoadError::NotAProfile {
            path: path.to_owned(),
            reason,
        })
    }

    /// Spells out a decoded profile.
    pub fn from_proto(path: &Path, message: &proto::Profile) -> Result<Self, String> {
        let strings = Strings(&message.string_table);
        if message.sample_type.is_empty() {
            return Err("no sample types".into());
        }
        let sample_types = message
            .sample_type
            .iter()
            .map(|t| strings.owned(t.r#type))
            .collect::<Result<Vec<_>, _>>()?;
        let mappings = message
            .mapping
            .iter()
            .map(|m| {
                Ok(Mapping {
                    start: m.memory_start,
                    limit: m.memory_limit,
                    file_offset: m.file_offset,
                    path: strings.owned(m.filename)?,
                    build_id: Some(strings.owned(m.build_id)?).filter(|b| !b.is_empty()),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let locations = read_locations(message, strings, &mappings)?;
        let samples = message
            .sample
            .iter()
            .map(|sample| read_sample(sample, strings, &locations, sample_types.len()))
            .collect::<Result<Vec<_>, _>>()?;
        let comments = message
            .comment
            .iter()
            .map(|&i| strings.owned(i))
            .collect::<Result<Vec<_>, _>>()?;
        let processes = comments
            .iter()
            .filter_map(|c| ProcessMemory::parse_comment(c))
            .collect();
        let kernel_memory = comments.iter().find_map(|c| KernelMemory::parse_comment(c));
        Ok(Self {
            path: path.to_owned(),
            time_nanos: message.time_nanos,
            duration_nanos: message.duration_nanos,
            sample_types,
            period: message.period,
            comments,
            samples,
            mappings,
            processes,
            kernel_memory,
        })
    }

    /// The index of a sample type, or an error naming the ones there are.
    pub fn sample_index(&self, wanted: &str) -> Result<usize, LoadError> {
        self.sample_types
            .iter()
            .position(|t| t == wanted)
            .ok_or_else(|| LoadError::NoSampleType {
                path: self.path.clone(),
                wanted: wanted.to_owned(),
                have: self.sample_types.join(", "),
            })
    }

    /// The sum of one sample type over all samples.
    pub fn total(&self, index: usize) -> i64 {
        self.samples.iter().map(|s| s.values[index]).sum()
    }

    /// The processes the samples belong to, in pid order.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.samples.iter().filter_map(|s| s.pid).collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }
}

/// `libname+0xOFFSET` for an address without a symbol: the file's name and the
/// offset in the file, stable across runs and address-space layouts.
pub fn describe_address(mapping: &Mapping, address: u64) -> String {
    let name = mapping.path.rsplit('/').next().unwrap_or(&mapping.path);
    let offset = address
        .wrapping_sub(mapping.start)
        .wrapping_add(mapping.file_offset);
    format!("{name}+{offset:#x}")
}

/// A profile's string table, read by index.
#[derive(Clone, Copy)]
struct Strings<'a>(&'a [String]);

impl<'a> Strings<'a> {
    fn get(self, index: i64) -> Result<&'a str, String> {
        usize::try_from(index)
            .ok()
            .and_then(|i| self.0.get(i))
            .map(String::as_str)
            .ok_or_else(|| format!("string index {index} out of range"))
    }

    fn owned(self, index: i64) -> Result<String, String> {
        self.get(index).map(str::to_owned)
    }
}

/// The profile's locations by id, each with its functions' names (or its address,
/// described by its mapping, where it has none).
fn read_locations(
    message: &proto::Profile,
    strings: Strings<'_>,
    mappings: &[Mapping],
) -> Result<std::collections::HashMap<u64, Location>, String> {
    // By id, once: a profile of many stacks has tens of thousands of each.
    let function_names: std::collections::HashMap<u64, i64> = message
        .function
        .iter()
        .map(|function| (function.id, function.name))
        .collect();
    let mut locations = std::collections::HashMap::with_capacity(message.location.len());
    for location in &message.location {
        let mapping = message
            .mapping
            .iter()
            .position(|m| m.id == location.mapping_id)
            .filter(|_| location.mapping_id != 0);
        let mut names = location
            .line
            .iter()
            .map(|line| match function_names.get(&line.function_id) {
                Some(&name) => strings.owned(name),
                None => Err(format!("function {} missing", line.function_id)),
            })
            .collect::<Result<Vec<_>, _>>()?;
        if names.is_empty() {
            names.push(match mapping {
                Some(index) => describe_address(&mappings[index], location.address),
                None => format!("{:#x}", location.address),
            });
        }
        locations.insert(
            location.id,
            Location {
                address: location.address,
                mapping,
                names,
            },
        );
    }
    Ok(locations)
}

/// A sample with its stack spelled out and the labels the reports use.
fn read_sample(
    sample: &proto::Sample,
    strings: Strings<'_>,
    locations: &std::collections::HashMap<u64, Location>,
    sample_types: usize,
) -> Result<Sample, String> {
    if sample.value.len() != sample_types {
        return Err("a sample's values do not match the sample types".into());
    }
    let stack = sample
        .location_id
        .iter()
        .map(|id| {
            locations
                .get(id)
                .cloned()
                .ok_or_else(|| format!("location {id} missing"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut read = Sample {
        pid: None,
        comm: None,
        cache: None,
        order: None,
        size_class: None,
        locations: stack,
        values: sample.value.clone(),
    };
    for label in &sample.label {
        match strings.get(label.key)? {
            "pid" => read.pid = u32::try_from(label.num).ok(),
            "comm" => read.comm = Some(strings.owned(label.str)?),
            "cache" => read.cache = Some(strings.owned(label.str)?),
            "order" => read.order = Some(label.num),
            "size_class" => read.size_class = Some(label.num),
            _ => {}
        }
    }
    Ok(read)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        pprof::{LabelValue, MappingKey, ProfileBuilder, builder::SAMPLE_TYPES},
        symbolize::Frame,
    };

    fn frame(name: &str) -> Frame {
        Frame {
            function: name.into(),
            file: None,
            line: 0,
        }
    }

    #[test]
    fn reads_back_what_the_builder_wrote() {
        let mut builder = ProfileBuilder::new(1_000, 2_000, &SAMPLE_TYPES);
        let key = MappingKey {
            space: 1,
            start: 0x1000,
        };
        builder.mapping(key, 0x3000, 0x400, "/usr/lib/libfoo.so", Some("abcd"));
        let malloc = builder.location(1, 0x1100, 1, Some(key), &[frame("malloc")]);
        let inlined = builder.location(1, 0x1200, 0, Some(key), &[frame("b"), frame("a")]);
        let bare = builder.location(1, 0x1300, 0, Some(key), &[]);
        builder.comment(
            &ProcessMemory {
                pid: 7,
                comm: "prog".into(),
                vm_rss: 4096,
                ..ProcessMemory::default()
            }
            .to_comment(),
        );
        let labels = [
            ("pid", LabelValue::Num(7)),
            ("comm", LabelValue::Str("prog")),
        ];
        builder.sample(&[malloc, inlined, bare], &[1, 64, 1, 64], &labels);
        let message = builder.finish().expect("valid");
        let profile = Profile::from_proto(Path::new("p"), &message).expect("read back");
        assert_eq!(profile.sample_types.len(), 4);
        let sample = &profile.samples[0];
        assert_eq!(sample.pid, Some(7));
        assert_eq!(sample.comm.as_deref(), Some("prog"));
        let frames: Vec<&str> = sample.frames().collect();
        assert_eq!(frames, ["malloc", "b", "a", "libfoo.so+0x700"]);
        assert_eq!(
            profile.total(profile.sample_index("inuse_space").expect("type")),
            64
        );
        assert_eq!(profile.processes[0].vm_rss, 4096);
        assert!(profile.sample_index("nope").is_err());
    }
}
