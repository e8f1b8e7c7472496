//! A profile of several processes (`--all`) cut into one profile per process (its
//! samples told apart by their `pid` label), without decoding it whole.
//!
//! The gzip'd pprof is read as it inflates, one field at a time: once for the
//! string table (which strings are "pid"), once for the samples (each process's
//! first labels and the locations it uses), once for the locations (numbered anew
//! per process, and the functions and mappings they use), once for the functions
//! and mappings; then once per batch of processes to write their profiles, each
//! sample and table entry decoded alone and written to its process's profile as it
//! is read. Decoded whole, a profile took several times its inflated size, and the
//! copy of its largest process as much again (`docs/performance.md`); this holds
//! the processes' id maps and one batch's profiles while they are written.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    io::Write as _,
};

use flate2::{Compression, write::GzEncoder};
use prost::Message as _;

use super::{
    profile_error::ProfileError,
    wire::{Fields, LEN},
};
use crate::pprof::proto::{Function, Label, Location, Mapping, Sample};

/// `Profile`'s fields (profile.proto's numbers) that are written per process; the
/// others up to [`LAST_FIELD`] are copied to every process's profile as they are.
const SAMPLE: u64 = 2;
const MAPPING: u64 = 3;
const LOCATION: u64 = 4;
const FUNCTION: u64 = 5;
const STRING_TABLE: u64 = 6;
/// `Profile`'s last field (`default_sample_type`): fields after it are unknown to
/// profile.proto and, as a decode would, left out.
const LAST_FIELD: u64 = 14;

/// About the most one writing pass holds of the profiles it writes: a profile of
/// 100k stacks of one process, with the small ones of a few dozen others, is one
/// pass; a host of many large processes takes several passes, each of which inflates
/// the whole profile again.
const BATCH_BYTES: usize = 8 << 20;
/// About what a gzip encoder holds besides its output (miniz_oxide at the default
/// level: the window, its hash chains and the pending symbols). A process's profile
/// smaller than this is written out inflated, then compressed.
const ENCODER_BYTES: usize = 320 << 10;
/// How much smaller than inflated a compressed profile is counted: less than
/// heapprofd's profiles shrink, so that a batch's estimate errs on the large side.
const COMPRESSION_COUNTED: usize = 4;

/// A profile's processes, and the strings their first labels use.
#[derive(Debug)]
pub struct Processes {
    strings: HashMap<i64, String>,
    /// Each process's first sample's labels (its series), and its profile, gzip'd;
    /// `None` when the profile holds one process or none, whose profile is the file.
    pub parts: Vec<(Vec<Label>, Option<Vec<u8>>)>,
}

impl Processes {
    /// The string at `index` of the string table, when the first labels use it.
    pub fn string(&self, index: i64) -> &str {
        self.strings.get(&index).map_or("", String::as_str)
    }
}

/// One process's part of the profile being read.
#[derive(Debug, Default)]
struct Process {
    /// Its first sample's labels.
    labels: Vec<Label>,
    locations: Renumbering,
    functions: Renumbering,
    mappings: Renumbering,
    /// About how large its profile is, inflated: what batches are measured by.
    size: usize,
}

/// The ids a process uses of one table, then each one's new id in its profile:
/// 1, 2, 3... in the table's order (Parca refuses ids that are not), 0 for none.
#[derive(Debug, Default)]
struct Renumbering {
    /// Old id → new id, 0 until the table is read.
    ids: HashMap<u64, u64>,
    numbered: u64,
}

impl Renumbering {
    fn uses(&mut self, id: u64) {
        self.ids.entry(id).or_insert(0);
    }

    /// Numbers `id`, an entry of the table as it is read, when the process uses it.
    fn number(&mut self, id: u64) -> Option<u64> {
        let new = self.ids.get_mut(&id)?;
        self.numbered += 1;
        *new = self.numbered;
        Some(*new)
    }

    /// `id`'s new id; 0 (none) for an id the table does not have.
    fn get(&self, id: u64) -> u64 {
        self.ids.get(&id).copied().unwrap_or(0)
    }
}

/// A sample's locations and labels; prost skips its values.
#[derive(Clone, PartialEq, prost::Message)]
struct SampleKeys {
    #[prost(uint64, repeated, tag = "1")]
    location_id: Vec<u64>,
    #[prost(message, repeated, tag = "3")]
    label: Vec<Label>,
}

/// The processes of the gzip'd profile `pprof_gz`, in the order of their pids (the
/// samples without one first), each with its profile: its samples, the locations,
/// functions and mappings they use, numbered anew, and the rest of the profile
/// (string table kept whole, types, times, comments) as it is.
pub fn split_by_pid(pprof_gz: &[u8]) -> Result<Processes, ProfileError> {
    split_within(pprof_gz, Limits::MEMORY)
}

/// What the writing passes hold.
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// About the most one pass holds of the profiles it writes.
    batch_bytes: usize,
    /// The size from which a process's profile is compressed as it is written.
    compress_from: usize,
}

impl Limits {
    const MEMORY: Limits = Limits {
        batch_bytes: BATCH_BYTES,
        compress_from: ENCODER_BYTES,
    };

    /// What writing a process's profile of about `size` bytes inflated holds.
    fn cost(self, size: usize) -> usize {
        if size < self.compress_from {
            size
        } else {
            ENCODER_BYTES + size / COMPRESSION_COUNTED
        }
    }
}

fn split_within(pprof_gz: &[u8], limits: Limits) -> Result<Processes, ProfileError> {
    let (pid_keys, shared_size) = pid_keys(pprof_gz)?;
    let mut processes = samples(pprof_gz, &pid_keys)?;
    let wanted: HashSet<i64> = processes
        .values()
        .flat_map(|p| &p.labels)
        .flat_map(|label| [label.key, label.str])
        .collect();
    let strings = locations_and_strings(pprof_gz, &mut processes, &wanted)?;
    if processes.len() <= 1 {
        let labels = processes.into_values().next().unwrap_or_default().labels;
        return Ok(Processes {
            strings,
            parts: vec![(labels, None)],
        });
    }
    functions_and_mappings(pprof_gz, &mut processes)?;
    let mut profiles = Vec::with_capacity(processes.len());
    let processes: Vec<_> = processes.into_values().collect();
    let mut first = 0;
    while first < processes.len() {
        let mut end = first + 1;
        let mut held = limits.cost(shared_size + processes[first].size);
        while let Some(next) = processes.get(end) {
            held += limits.cost(shared_size + next.size);
            if held > limits.batch_bytes {
                break;
            }
            end += 1;
        }
        let batch = &processes[first..end];
        profiles.extend(write(pprof_gz, &pid_keys, batch, limits, shared_size)?);
        first = end;
    }
    Ok(Processes {
        strings,
        parts: processes
            .into_iter()
            .map(|p| p.labels)
            .zip(profiles.into_iter().map(Some))
            .collect(),
    })
}

/// The first read: the string table's indices of "pid", and about how many bytes
/// of every process's profile the string table takes.
fn pid_keys(pprof_gz: &[u8]) -> Result<(HashSet<i64>, usize), ProfileError> {
    let mut fields = Fields::new(pprof_gz);
    let mut buffer = Vec::new();
    let mut pid_keys = HashSet::new();
    let mut index = 0;
    let mut size = 0;
    while let Some(key) = fields.next_key()? {
        if key != (STRING_TABLE, LEN) {
            fields.skip(key.1)?;
            continue;
        }
        fields.bytes(&mut buffer)?;
        if buffer == b"pid" {
            pid_keys.insert(index);
        }
        size += field_size(buffer.len());
        index += 1;
    }
    Ok((pid_keys, size))
}

/// A sample's process: its first `pid` label's number (`None` without one).
fn pid_of(labels: &[Label], pid_keys: &HashSet<i64>) -> Option<i64> {
    labels
        .iter()
        .find(|l| pid_keys.contains(&l.key))
        .map(|l| l.num)
}

/// The second read: the processes, by pid, with their first labels and the
/// locations their samples use.
fn samples(
    pprof_gz: &[u8],
    pid_keys: &HashSet<i64>,
) -> Result<BTreeMap<Option<i64>, Process>, ProfileError> {
    let mut fields = Fields::new(pprof_gz);
    let mut buffer = Vec::new();
    let mut processes: BTreeMap<Option<i64>, Process> = BTreeMap::new();
    while let Some(key) = fields.next_key()? {
        if key != (SAMPLE, LEN) {
            fields.skip(key.1)?;
            continue;
        }
        fields.bytes(&mut buffer)?;
        let sample = SampleKeys::decode(buffer.as_slice())?;
        let process = processes
            .entry(pid_of(&sample.label, pid_keys))
            .or_insert_with(|| Process {
                labels: sample.label.clone(),
                ..Process::default()
            });
        for &id in &sample.location_id {
            process.locations.uses(id);
        }
        process.size += field_size(buffer.len());
    }
    Ok(processes)
}

/// The third read: each process's locations numbered, with the functions and
/// mappings they use; and the `wanted` strings.
fn locations_and_strings(
    pprof_gz: &[u8],
    processes: &mut BTreeMap<Option<i64>, Process>,
    wanted: &HashSet<i64>,
) -> Result<HashMap<i64, String>, ProfileError> {
    let mut fields = Fields::new(pprof_gz);
    let mut buffer = Vec::new();
    let mut strings = HashMap::new();
    let mut index = 0;
    while let Some(key) = fields.next_key()? {
        match key {
            (LOCATION, LEN) => {
                fields.bytes(&mut buffer)?;
                let location = Location::decode(buffer.as_slice())?;
                for process in processes.values_mut() {
                    if process.locations.number(location.id).is_some() {
                        process.mappings.uses(location.mapping_id);
                        for line in &location.line {
                            process.functions.uses(line.function_id);
                        }
                        process.size += field_size(buffer.len());
                    }
                }
            }
            (STRING_TABLE, LEN) => {
                if wanted.contains(&index) {
                    fields.bytes(&mut buffer)?;
                    strings.insert(index, String::from_utf8_lossy(&buffer).into_owned());
                } else {
                    fields.skip(LEN)?;
                }
                index += 1;
            }
            (_, wire_type) => fields.skip(wire_type)?,
        }
    }
    Ok(strings)
}

/// The fourth read: each process's functions and mappings numbered.
fn functions_and_mappings(
    pprof_gz: &[u8],
    processes: &mut BTreeMap<Option<i64>, Process>,
) -> Result<(), ProfileError> {
    let mut fields = Fields::new(pprof_gz);
    let mut buffer = Vec::new();
    while let Some(key) = fields.next_key()? {
        let id = match key {
            (FUNCTION, LEN) => {
                fields.bytes(&mut buffer)?;
                Function::decode(buffer.as_slice())?.id
            }
            (MAPPING, LEN) => {
                fields.bytes(&mut buffer)?;
                Mapping::decode(buffer.as_slice())?.id
            }
            (_, wire_type) => {
                fields.skip(wire_type)?;
                continue;
            }
        };
        for process in processes.values_mut() {
            let table = if key.0 == FUNCTION {
                &mut process.functions
            } else {
                &mut process.mappings
            };
            if table.number(id).is_some() {
                process.size += field_size(buffer.len());
            }
        }
    }
    Ok(())
}

/// A profile being written: inflated while small, else compressed as it is written.
enum Sink {
    Inflated(Vec<u8>),
    Compressing(Box<GzEncoder<Vec<u8>>>),
}

impl Sink {
    fn new(size: usize, limits: Limits) -> Self {
        if size < limits.compress_from {
            Sink::Inflated(Vec::with_capacity(size))
        } else {
            Sink::Compressing(Box::new(GzEncoder::new(Vec::new(), Compression::default())))
        }
    }

    fn write(&mut self, bytes: &[u8]) {
        // Writing to memory cannot fail.
        let _ = match self {
            Sink::Inflated(profile) => profile.write_all(bytes),
            Sink::Compressing(encoder) => encoder.write_all(bytes),
        };
    }

    /// The field `tag` holding `message`.
    fn message(&mut self, tag: u64, message: &impl prost::Message, scratch: &mut Vec<u8>) {
        scratch.clear();
        prost::encoding::encode_varint((tag << 3) | LEN, scratch);
        // Encoding into a Vec cannot fail.
        let _ = message.encode_length_delimited(scratch);
        self.write(scratch);
    }

    /// The profile, gzip'd.
    fn finish(self) -> Vec<u8> {
        let encoder = match self {
            Sink::Inflated(profile) => {
                let mut encoder = GzEncoder::new(Vec::new(), Compression::default());
                let _ = encoder.write_all(&profile);
                encoder
            }
            Sink::Compressing(encoder) => *encoder,
        };
        encoder.finish().unwrap_or_default()
    }
}

/// A read per batch: the profiles of `batch`, gzip'd, in its order.
fn write(
    pprof_gz: &[u8],
    pid_keys: &HashSet<i64>,
    batch: &[Process],
    limits: Limits,
    shared_size: usize,
) -> Result<Vec<Vec<u8>>, ProfileError> {
    let mut writer = BatchWriter::new(batch, pid_keys, limits, shared_size);
    let mut fields = Fields::new(pprof_gz);
    let mut buffer = Vec::new();
    let mut copied = Vec::new();
    while let Some(key) = fields.next_key()? {
        match key {
            (SAMPLE, LEN) => {
                fields.bytes(&mut buffer)?;
                writer.sample(&buffer)?;
            }
            (MAPPING, LEN) => {
                fields.bytes(&mut buffer)?;
                writer.mapping(&buffer)?;
            }
            (LOCATION, LEN) => {
                fields.bytes(&mut buffer)?;
                writer.location(&buffer)?;
            }
            (FUNCTION, LEN) => {
                fields.bytes(&mut buffer)?;
                writer.function(&buffer)?;
            }
            (field, wire_type) if field > LAST_FIELD => fields.skip(wire_type)?,
            key => {
                copied.clear();
                fields.copy(key, &mut buffer, &mut copied)?;
                writer.shared(&copied);
            }
        }
    }
    Ok(writer.finish())
}

/// The profiles of one batch as [`write`] builds them, field by field: each table's
/// entries go to the processes that use them, renumbered for each.
struct BatchWriter<'a> {
    batch: &'a [Process],
    pid_keys: &'a HashSet<i64>,
    /// The batch's index of each process, by its pid label.
    by_pid: HashMap<Option<i64>, usize>,
    /// Each process's profile, in the batch's order.
    sinks: Vec<Sink>,
    /// Where each message is encoded before it is written.
    scratch: Vec<u8>,
}

impl<'a> BatchWriter<'a> {
    fn new(
        batch: &'a [Process],
        pid_keys: &'a HashSet<i64>,
        limits: Limits,
        shared_size: usize,
    ) -> Self {
        Self {
            batch,
            pid_keys,
            by_pid: batch
                .iter()
                .enumerate()
                .map(|(i, p)| (pid_of(&p.labels, pid_keys), i))
                .collect(),
            sinks: batch
                .iter()
                .map(|p| Sink::new(shared_size + p.size, limits))
                .collect(),
            scratch: Vec::new(),
        }
    }

    /// A sample goes to its process's profile (none outside the batch), with its
    /// locations renumbered there.
    fn sample(&mut self, bytes: &[u8]) -> Result<(), ProfileError> {
        let mut sample = Sample::decode(bytes)?;
        let Some(&i) = self.by_pid.get(&pid_of(&sample.label, self.pid_keys)) else {
            return Ok(());
        };
        for id in &mut sample.location_id {
            *id = self.batch[i].locations.get(*id);
        }
        self.sinks[i].message(SAMPLE, &sample, &mut self.scratch);
        Ok(())
    }

    /// A mapping goes to each process that uses it, with that process's id.
    fn mapping(&mut self, bytes: &[u8]) -> Result<(), ProfileError> {
        let mapping = Mapping::decode(bytes)?;
        self.send_to_users(MAPPING, mapping, |p| &p.mappings, |m| &mut m.id);
        Ok(())
    }

    /// A location goes to each process that uses it, with that process's ids for it,
    /// its mapping and its lines' functions.
    fn location(&mut self, bytes: &[u8]) -> Result<(), ProfileError> {
        let location = Location::decode(bytes)?;
        for (process, sink) in self.batch.iter().zip(&mut self.sinks) {
            let Some(&id) = process.locations.ids.get(&location.id) else {
                continue;
            };
            let mut renumbered = location.clone();
            renumbered.id = id;
            renumbered.mapping_id = process.mappings.get(location.mapping_id);
            for line in &mut renumbered.line {
                line.function_id = process.functions.get(line.function_id);
            }
            sink.message(LOCATION, &renumbered, &mut self.scratch);
        }
        Ok(())
    }

    /// A function goes to each process that uses it, with that process's id.
    fn function(&mut self, bytes: &[u8]) -> Result<(), ProfileError> {
        let function = Function::decode(bytes)?;
        self.send_to_users(FUNCTION, function, |p| &p.functions, |f| &mut f.id);
        Ok(())
    }

    /// An entry of a table that refers to nothing else by id (a mapping, a function),
    /// in field `tag`: to each process whose `table` has its id, renumbered there.
    fn send_to_users<M: prost::Message>(
        &mut self,
        tag: u64,
        mut entry: M,
        table: fn(&Process) -> &Renumbering,
        id: fn(&mut M) -> &mut u64,
    ) {
        let old = *id(&mut entry);
        for (process, sink) in self.batch.iter().zip(&mut self.sinks) {
            if let Some(&new) = table(process).ids.get(&old) {
                *id(&mut entry) = new;
                sink.message(tag, &entry, &mut self.scratch);
            }
        }
    }

    /// A field every profile holds as it is (the string table, the sample types...).
    fn shared(&mut self, field: &[u8]) {
        for sink in &mut self.sinks {
            sink.write(field);
        }
    }

    /// The profiles, gzip'd, in the batch's order.
    fn finish(self) -> Vec<Vec<u8>> {
        self.sinks.into_iter().map(Sink::finish).collect()
    }
}

/// About the bytes a field of `length` bytes takes with its key and length.
fn field_size(length: usize) -> usize {
    length + 4
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{
        pprof::{LabelValue, MappingKey, ProfileBuilder, proto::Profile},
        push::series::decode,
        symbolize::Frame,
    };

    /// A sample as a reader sees it, ids resolved: each location's mapping file and
    /// address, its frames (function, file, line), the values and the labels.
    type Resolved = (
        Vec<(String, u64, Vec<(String, String, i64)>)>,
        Vec<i64>,
        Vec<String>,
    );

    /// `profile`'s samples resolved, by their pid label.
    fn resolved(profile: &Profile) -> BTreeMap<Option<i64>, Vec<Resolved>> {
        let text = |i: i64| profile.string_table[usize::try_from(i).expect("index")].clone();
        let mut by_pid: BTreeMap<_, Vec<_>> = BTreeMap::new();
        for sample in &profile.sample {
            let stack = sample
                .location_id
                .iter()
                .map(|id| {
                    let location = profile
                        .location
                        .iter()
                        .find(|l| l.id == *id)
                        .expect("a location");
                    let file = profile
                        .mapping
                        .iter()
                        .find(|m| m.id == location.mapping_id)
                        .map_or_else(String::new, |m| text(m.filename));
                    let frames = location
                        .line
                        .iter()
                        .map(|line| {
                            let f = profile
                                .function
                                .iter()
                                .find(|f| f.id == line.function_id)
                                .expect("a function");
                            (text(f.name), text(f.filename), line.line)
                        })
                        .collect();
                    (file, location.address, frames)
                })
                .collect();
            let labels = sample
                .label
                .iter()
                .map(|l| format!("{}={}/{}", text(l.key), text(l.str), l.num))
                .collect();
            let pid = sample
                .label
                .iter()
                .find(|l| text(l.key) == "pid")
                .map(|l| l.num);
            by_pid
                .entry(pid)
                .or_default()
                .push((stack, sample.value.clone(), labels));
        }
        by_pid
    }

    /// Three processes and samples without a pid, sharing some frames, mappings
    /// and a location, in two mappings and outside any.
    fn several_processes() -> Vec<u8> {
        let mut builder = ProfileBuilder::new(
            1_000,
            10,
            &[("alloc_space", "bytes"), ("inuse_space", "bytes")],
        );
        builder.comment("a comment every part keeps");
        let frame = |name: &str, line| Frame {
            function: name.into(),
            file: Some(format!("{name}.c")),
            line,
        };
        let libc = MappingKey {
            space: 1,
            start: 0x1000,
        };
        builder.mapping(libc, 0x2000, 0, "/lib/libc.so.6", None);
        let app = MappingKey {
            space: 2,
            start: 0x5000,
        };
        builder.mapping(app, 0x6000, 0, "/usr/bin/app", Some("abcd"));
        let malloc = builder.location(1, 0x1100, 0, Some(libc), &[frame("malloc", 3)]);
        let inlined = builder.location(
            2,
            0x5100,
            0,
            Some(app),
            &[frame("inner", 10), frame("outer", 20)],
        );
        let main = builder.location(2, 0x5200, 0, Some(app), &[frame("main", 5)]);
        let nowhere = builder.location(3, 0xdead, 0, None, &[]);
        let other = builder.location(3, 0x1100, 0, Some(libc), &[frame("malloc", 3)]);
        for (stack, values, pid, comm) in [
            (&[malloc, inlined, main][..], [100, 10], Some(7), "app"),
            (&[nowhere, other][..], [30, 3], Some(9), "nginx"),
            (&[malloc, main][..], [200, 0], Some(7), "app"),
            (&[other][..], [5, 5], None, ""),
            (&[malloc][..], [1, 1], Some(8), "sh"),
        ] {
            let mut labels = vec![("comm", LabelValue::Str(comm))];
            if let Some(pid) = pid {
                labels.insert(0, ("pid", LabelValue::Num(pid)));
            }
            labels.push(("bytes", LabelValue::Bytes(16)));
            builder.sample(stack, &values, &labels);
        }
        builder.finish_compressed().expect("a valid profile")
    }

    #[test]
    fn each_part_holds_its_process_samples_as_the_whole_profile_has_them() {
        let file = several_processes();
        let whole = decode(&file).expect("decodes");
        let expected = resolved(&whole);
        assert_eq!(expected.len(), 4);
        // One pass holding every part inflated, and one pass per part compressing it.
        let one_pass = Limits::MEMORY;
        let pass_each = Limits {
            batch_bytes: 1,
            compress_from: 0,
        };
        for limits in [one_pass, pass_each] {
            let processes = split_within(&file, limits).expect("splits");
            assert_eq!(processes.parts.len(), expected.len());
            for ((labels, part), (pid, samples)) in processes.parts.iter().zip(&expected) {
                let part = decode(part.as_deref().expect("a part")).expect("decodes");
                crate::pprof::builder::validate(&part).expect("a valid profile");
                assert_eq!(resolved(&part), BTreeMap::from([(*pid, samples.clone())]));
                for table in [
                    part.location.iter().map(|l| l.id).collect::<Vec<_>>(),
                    part.function.iter().map(|f| f.id).collect(),
                    part.mapping.iter().map(|m| m.id).collect(),
                ] {
                    assert_eq!(table, (1..=table.len() as u64).collect::<Vec<_>>());
                }
                assert_eq!(part.string_table, whole.string_table);
                assert_eq!(part.comment, whole.comment);
                assert_eq!(part.sample_type, whole.sample_type);
                assert_eq!(part.time_nanos, whole.time_nanos);
                let first = processes.string(labels[labels.len() - 2].key);
                assert_eq!(first, "comm", "the first labels' strings are kept");
            }
        }
    }

    #[test]
    fn one_process_is_left_whole() {
        let mut builder = ProfileBuilder::new(1_000, 10, &[("inuse_space", "bytes")]);
        let location = builder.location(1, 0x1000, 0, None, &[]);
        builder.sample(&[location], &[1], &[("pid", LabelValue::Num(7))]);
        builder.sample(&[location], &[2], &[("pid", LabelValue::Num(7))]);
        let processes = split_by_pid(&builder.finish_compressed().expect("valid")).expect("splits");
        assert_eq!(processes.parts.len(), 1);
        assert!(processes.parts[0].1.is_none());
        assert_eq!(processes.string(processes.parts[0].0[0].key), "pid");
        assert!(split_by_pid(b"not gzip").is_err());
    }
}
