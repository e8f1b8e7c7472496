//! Loading unwind tables into the BPF maps, and telling the unwinder where each
//! process's objects are.
//!
//! One table per object file, keyed by device and inode, so a library mapped by a
//! thousand processes costs its rows once. Rows and rules live in memory-mapped BPF
//! arrays: a table is copied in with one `memcpy` instead of a system call per row, and
//! published by writing its `UnwindObject` last (a map update, which orders the copy
//! before it). Rules are deduplicated across objects. What does not fit is reported and
//! left to the frame-pointer fallback, never silently dropped.

use std::{
    collections::HashMap,
    marker::PhantomData,
    os::fd::{AsFd as _, AsRawFd as _},
    sync::Arc,
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf,
    maps::{Array, HashMap as BpfHashMap, Map, MapData},
};
use heapprof_common::{
    WalkEpoch, names,
    unwind::{
        ExecMapping, MAX_PROCESS_MAPPINGS, NO_OBJECT, ProcessMappings, RULE_NONE, UnwindGap,
        UnwindObject, UnwindRow, UnwindRule,
    },
};

use crate::{
    mapped_file::MappedFile,
    procmaps::{ObjectFile, ProcessMaps},
};

/// Capacities of the unwind tables (from the command line).
#[derive(Debug, Clone, Copy)]
pub struct TableCapacities {
    /// Rows of all objects together.
    pub rows: u32,
    /// Distinct rules.
    pub rules: u32,
    /// Objects.
    pub objects: u32,
}

/// A BPF array map created with `BPF_F_MMAPABLE`, written through a mapping of the
/// pages a write touches. The mapping is made for each write and undone after it:
/// a mapping of the whole array would count its every page (16 MiB for the rows)
/// in the daemon's resident memory for as long as it runs, on top of the kernel's
/// own copy being the same pages.
struct MappedArray<T> {
    map: MapData,
    len: usize,
    _values: PhantomData<T>,
}

impl<T: Copy> MappedArray<T> {
    fn new(ebpf: &mut Ebpf, name: &str) -> Result<Self> {
        let map = match ebpf.take_map(name) {
            Some(Map::Array(map)) => map,
            Some(_) => bail!("BPF map {name} is not an array"),
            None => bail!("BPF map {name} missing from the object"),
        };
        let info = map
            .info()
            .with_context(|| format!("reading BPF map {name}"))?;
        // The kernel lays values out 8-byte aligned: this is a plain `[T]` only then.
        if info.value_size() as usize != size_of::<T>() || !size_of::<T>().is_multiple_of(8) {
            bail!("BPF map {name} has values of {} bytes", info.value_size());
        }
        Ok(Self {
            map,
            len: info.max_entries() as usize,
            _values: PhantomData,
        })
    }

    /// Copies `values` to `index..index + values.len()`.
    fn write(&mut self, index: usize, values: &[T]) -> Result<()> {
        if index
            .checked_add(values.len())
            .is_none_or(|end| end > self.len)
        {
            bail!("writing past the end of a BPF array");
        }
        if values.is_empty() {
            return Ok(());
        }
        let page = crate::sys::page_size() as usize;
        let start = index * size_of::<T>();
        let end = start + size_of_val(values);
        let map_start = start / page * page;
        let map_bytes = end.next_multiple_of(page) - map_start;
        // SAFETY: a shared, writable mapping of whole pages of the map's values, which
        // the kernel allows for BPF_F_MMAPABLE arrays at any page offset within them
        // (the range is inside the array: checked above); unmapped below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.map.fd().as_fd().as_raw_fd(),
                map_start as libc::off_t,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mapping a BPF array into memory");
        }
        // SAFETY: `start - map_start` and the values' length stay inside the mapping
        // just made; T is plain data; the mapping is undone once, here.
        unsafe {
            std::ptr::copy_nonoverlapping(
                values.as_ptr(),
                base.cast::<u8>().add(start - map_start).cast::<T>(),
                values.len(),
            );
            libc::munmap(base, map_bytes);
        }
        Ok(())
    }
}

/// An object's loadable segments, to turn a mapping's file offset into its load bias.
#[derive(Debug, Clone, Default)]
struct Segments(Vec<Segment>);

/// One `PT_LOAD`.
#[derive(Debug, Clone, Copy)]
struct Segment {
    offset: u64,
    size_in_file: u64,
    vaddr: u64,
    executable: bool,
}

impl Segments {
    /// The `PT_LOAD`s of an ELF file.
    fn of(elf: &[u8]) -> Option<Self> {
        use object::{
            Endianness,
            elf::{PF_X, PT_LOAD},
            read::elf::{ElfFile64, ProgramHeader as _},
        };
        let file = ElfFile64::<Endianness>::parse(elf).ok()?;
        let endian = file.endian();
        Some(Self(
            file.elf_program_headers()
                .iter()
                .filter(|ph| ph.p_type(endian) == PT_LOAD)
                .map(|ph| Segment {
                    offset: ph.p_offset(endian),
                    size_in_file: ph.p_filesz(endian),
                    vaddr: ph.p_vaddr(endian),
                    executable: ph.p_flags(endian).contains(PF_X),
                })
                .collect(),
        ))
    }

    /// The load bias of an executable mapping at `start..end` of the file from
    /// `offset`. Its code is the executable segment's: a page-aligned mapping can also
    /// hold the tail of the segment before, whose addresses are offset differently when
    /// the linker does not keep addresses and file offsets congruent (LLD, Rust's
    /// default linker, puts code one page above its file offset).
    fn bias(&self, start: u64, end: u64, offset: u64) -> Option<u64> {
        let mapped = offset..offset.saturating_add(end.saturating_sub(start));
        let overlaps = |s: &&Segment| {
            s.offset < mapped.end && mapped.start < s.offset.saturating_add(s.size_in_file)
        };
        let segment = self
            .0
            .iter()
            .filter(overlaps)
            .find(|s| s.executable)
            .or_else(|| {
                self.0
                    .iter()
                    .find(|s| (s.offset..s.offset + s.size_in_file).contains(&offset))
            })?;
        // The mapping's first byte is the file's `offset`, at address `start`.
        Some(
            start.wrapping_sub(
                segment
                    .vaddr
                    .wrapping_add(offset.wrapping_sub(segment.offset)),
            ),
        )
    }
}

/// What became of an object.
#[derive(Debug, Clone)]
enum ObjectState {
    /// Its table is loaded at this index.
    Loaded { index: u32, segments: Segments },
    /// It has no table (no CFI, unreadable, or it did not fit): frame pointers only.
    Unavailable { segments: Segments },
}

impl ObjectState {
    fn segments(&self) -> &Segments {
        match self {
            ObjectState::Loaded { segments, .. } | ObjectState::Unavailable { segments } => {
                segments
            }
        }
    }
}

/// How much of the tables is in use (logged, and in `--stats-json` as `unwind_tables`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TableUsage {
    /// Objects with a table.
    pub objects: u32,
    /// Rows of all tables.
    pub rows: u32,
    /// Distinct rules.
    pub rules: u32,
    /// Objects without a table because their CFI was missing or unreadable.
    pub without_cfi: u32,
    /// Objects without a table because a capacity was reached.
    pub not_fitting: u32,
    /// Bytes of BPF map memory the tables use.
    pub bytes: u64,
    /// Milliseconds spent building and loading tables.
    pub build_ms: u64,
}

impl TableUsage {
    /// One log line: what the tables hold and cost.
    pub fn describe(&self) -> String {
        format!(
            "unwind tables: {} objects, {} rows, {} rules, {} KiB of BPF map memory in use, \
             built in {} ms; {} objects without CFI, {} that did not fit",
            self.objects,
            self.rows,
            self.rules,
            self.bytes.div_ceil(1024),
            self.build_ms,
            self.without_cfi,
            self.not_fitting
        )
    }
}

/// The unwind tables and process mappings in the BPF maps.
pub struct TableUploader {
    process_mappings: BpfHashMap<MapData, u32, ProcessMappings>,
    objects_map: Array<MapData, UnwindObject>,
    rows: MappedArray<UnwindRow>,
    rules: MappedArray<UnwindRule>,
    gaps: BpfHashMap<MapData, UnwindGap, u64>,
    capacities: TableCapacities,
    objects: HashMap<(u64, u64), ObjectState>,
    rule_index: HashMap<UnwindRule, u32>,
    usage: TableUsage,
    /// Whether the tables' filling up was said.
    warned_full: bool,
    /// The version of the last mappings written (see `ProcessMappings::version`).
    version: u32,
    /// Mapping writes so far, published in `WALK_EPOCH` after each: walks the
    /// programs remembered before a write are not trusted after it.
    walk_epoch: crate::bpf_array::MappedArray<u64>,
    epoch: u64,
}

impl TableUploader {
    /// Takes the unwind maps out of the loaded BPF object.
    pub fn new(ebpf: &mut Ebpf, capacities: TableCapacities) -> Result<Self> {
        let take = |ebpf: &mut Ebpf, name: &str| {
            ebpf.take_map(name)
                .with_context(|| format!("BPF map {name} missing from the object"))
        };
        let process_mappings = BpfHashMap::try_from(take(ebpf, names::PROCESS_MAPPINGS)?)
            .context("BPF map PROCESS_MAPPINGS has an unexpected type")?;
        let objects_map = Array::try_from(take(ebpf, names::UNWIND_OBJECTS)?)
            .context("BPF map UNWIND_OBJECTS has an unexpected type")?;
        let gaps = BpfHashMap::try_from(take(ebpf, names::UNWIND_GAPS)?)
            .context("BPF map UNWIND_GAPS has an unexpected type")?;
        let walk_epoch = crate::bpf_array::MappedArray::map(ebpf, names::WALK_EPOCH)?;
        Ok(Self {
            process_mappings,
            objects_map,
            rows: MappedArray::new(ebpf, names::UNWIND_ROWS)?,
            rules: MappedArray::new(ebpf, names::UNWIND_RULES)?,
            gaps,
            capacities,
            objects: HashMap::new(),
            rule_index: HashMap::new(),
            usage: TableUsage::default(),
            warned_full: false,
            version: 0,
            walk_epoch,
            epoch: 0,
        })
    }

    /// How much of the tables is in use.
    pub fn usage(&self) -> TableUsage {
        self.usage
    }

    /// Loads the tables of the objects `maps` names (those not loaded yet) and writes
    /// the process's executable mappings for the unwinder.
    pub fn load_process(&mut self, pid: u32, maps: &ProcessMaps) -> Result<()> {
        let mut mappings: Vec<ExecMapping> = Vec::with_capacity(maps.regions.len());
        for region in &maps.regions {
            let state = self.object(&region.object);
            let bias = state
                .segments()
                .bias(region.start, region.end, region.offset);
            let object = match (state, bias) {
                (ObjectState::Loaded { index, .. }, Some(_)) => *index,
                _ => NO_OBJECT,
            };
            mappings.push(ExecMapping {
                start: region.start,
                end: region.end,
                bias: bias.unwrap_or(0),
                object,
                _pad: 0,
            });
        }
        mappings.extend(maps.anonymous_code.iter().map(|&(start, end)| ExecMapping {
            start,
            end,
            bias: 0,
            object: NO_OBJECT,
            _pad: 0,
        }));
        mappings.sort_by_key(|m| m.start);
        if mappings.len() > MAX_PROCESS_MAPPINGS {
            log::warn!(
                "pid {pid} has {} executable mappings; stacks are unwound through the first {MAX_PROCESS_MAPPINGS}",
                mappings.len()
            );
            mappings.truncate(MAX_PROCESS_MAPPINGS);
        }
        self.version = self.version.wrapping_add(1);
        let mut value = Box::new(ProcessMappings {
            count: mappings.len() as u32,
            version: self.version,
            mappings: [ExecMapping::default(); MAX_PROCESS_MAPPINGS],
        });
        value.mappings[..mappings.len()].copy_from_slice(&mappings);
        self.process_mappings
            .insert(&pid, value.as_ref(), 0)
            .with_context(|| format!("writing the mappings of pid {pid} for the unwinder"))?;
        self.epoch += 1;
        if let Some(epoch) = self.walk_epoch.word(WalkEpoch::Mappings as usize, 0) {
            epoch.store(self.epoch, std::sync::atomic::Ordering::Release);
        }
        Ok(())
    }

    /// Forgets a process's mappings (it exec'd or exited).
    pub fn forget_process(&mut self, pid: u32) {
        let _ = self.process_mappings.remove(&pid);
    }

    /// Forgets where the stacks of processes `pids` were cut short (they are
    /// forgotten: see `--retain-exited`).
    pub fn forget_gaps(&mut self, pids: &std::collections::HashSet<u32>) {
        let keys: Vec<UnwindGap> = self
            .gaps
            .keys()
            .filter_map(Result::ok)
            .filter(|gap| pids.contains(&gap.tgid))
            .collect();
        for key in keys {
            let _ = self.gaps.remove(&key);
        }
    }

    /// The addresses where stacks were cut short, with their counts.
    pub fn gaps(&self) -> Vec<(UnwindGap, u64)> {
        self.gaps.iter().filter_map(Result::ok).collect()
    }

    /// The state of `object`, building and loading its table the first time.
    fn object(&mut self, object: &Arc<ObjectFile>) -> &ObjectState {
        if !self.objects.contains_key(&object.id) {
            let state = self.load_object(object);
            self.objects.insert(object.id, state);
        }
        &self.objects[&object.id]
    }

    fn load_object(&mut self, object: &ObjectFile) -> ObjectState {
        let started = Instant::now();
        let file = match MappedFile::open(&object.open_path) {
            Ok(file) => file,
            Err(err) => {
                log::debug!("{}: cannot read it ({err}); no unwind table", object.path);
                self.usage.without_cfi += 1;
                return ObjectState::Unavailable {
                    segments: Segments::default(),
                };
            }
        };
        let segments = Segments::of(file.bytes()).unwrap_or_default();
        let state = match super::build(file.bytes()) {
            Ok(table) => match self.insert_table(&table) {
                Ok(index) => {
                    log::debug!(
                        "{}: unwind table of {} rows, {} rules, in {:.1} ms",
                        object.path,
                        table.rows.len(),
                        table.rules.len(),
                        started.elapsed().as_secs_f64() * 1e3
                    );
                    ObjectState::Loaded { index, segments }
                }
                Err(full) => {
                    self.usage.not_fitting += 1;
                    if !self.warned_full {
                        self.warned_full = true;
                        log::warn!(
                            "the unwind tables are full ({full}): {} and later objects are unwound with frame pointers only; raise --max-unwind-rows/--max-unwind-rules/--max-unwind-objects",
                            object.path
                        );
                    }
                    ObjectState::Unavailable { segments }
                }
            },
            Err(err) => {
                log::debug!("{}: no unwind table ({err})", object.path);
                self.usage.without_cfi += 1;
                ObjectState::Unavailable { segments }
            }
        };
        self.usage.build_ms += started.elapsed().as_millis() as u64;
        state
    }

    /// Copies a table into the maps; `Err` names the capacity that was reached.
    fn insert_table(&mut self, table: &super::UnwindTable) -> Result<u32, &'static str> {
        if self.usage.objects >= self.capacities.objects {
            return Err("objects");
        }
        let first_row = self.usage.rows;
        let rows = u32::try_from(table.rows.len()).map_err(|_| "rows")?;
        if first_row
            .checked_add(rows)
            .is_none_or(|end| end > self.capacities.rows)
        {
            return Err("rows");
        }
        let new_rules = table
            .rules
            .iter()
            .filter(|rule| !self.rule_index.contains_key(rule))
            .count() as u32;
        if self.usage.rules + new_rules > self.capacities.rules {
            return Err("rules");
        }
        // The table's rule indices, in the shared rule array; new rules go after the
        // rules in use, in one write.
        let mut global = Vec::with_capacity(table.rules.len());
        let mut added = Vec::new();
        for rule in &table.rules {
            let index = match self.rule_index.get(rule) {
                Some(index) => *index,
                None => {
                    let index = self.usage.rules + added.len() as u32;
                    self.rule_index.insert(*rule, index);
                    added.push(*rule);
                    index
                }
            };
            global.push(index);
        }
        if let Err(err) = self.rules.write(self.usage.rules as usize, &added) {
            log::debug!("writing unwind rules: {err:#}");
            for rule in &added {
                self.rule_index.remove(rule);
            }
            return Err("rules");
        }
        self.usage.rules += added.len() as u32;
        let rows_out: Vec<UnwindRow> = table
            .rows
            .iter()
            .map(|row| UnwindRow {
                pc: row.pc,
                rule: if row.rule == RULE_NONE {
                    RULE_NONE
                } else {
                    global.get(row.rule as usize).copied().unwrap_or(RULE_NONE)
                },
            })
            .collect();
        self.rows
            .write(first_row as usize, &rows_out)
            .map_err(|_| "rows")?;
        let index = self.usage.objects;
        // Written last: once the unwinder can find the object, its rows are in place.
        self.objects_map
            .set(index, &UnwindObject { first_row, rows }, 0)
            .map_err(|_| "objects")?;
        self.usage.objects += 1;
        self.usage.rows += rows;
        self.usage.bytes = u64::from(self.usage.rows) * size_of::<UnwindRow>() as u64
            + u64::from(self.usage.rules) * size_of::<UnwindRule>() as u64
            + u64::from(self.usage.objects) * size_of::<UnwindObject>() as u64;
        Ok(index)
    }
}
