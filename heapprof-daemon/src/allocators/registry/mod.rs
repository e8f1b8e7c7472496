//! The probed functions: their slots in `PROBES`, their probes, and what could not be
//! probed.
//!
//! Probes go on files, so one probe set per allocator object serves every process that
//! maps it: the C library once for all glibc processes, a static binary once for all
//! its runs. Objects join as processes are read (at start, at exec, at loader events),
//! each function's spec written before its probes are attached.

mod page_slots;
mod per_process;
mod process_check;
mod session_links;
mod slots;

use std::{
    collections::{HashMap, HashSet},
    os::fd::OwnedFd,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf,
    maps::{Array, MapData},
    programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope},
};
use std::os::unix::fs::MetadataExt as _;

use heapprof_common::{NO_REGISTER, ProbeSlot, ProbeSpec, names, preload};

pub use self::session_links::session_links;
use self::{page_slots::PageSlots, session_links::SessionProgram};

use super::{
    api::Family,
    scan::{self, FoundFunction, ObjectScan},
    spec::CustomFunction,
};
use crate::{
    placement::PlacementMode,
    preload::PreloadLibrary,
    probes::{AttachMethod, uprobe},
    procmaps::ObjectFile,
};

/// Probes this process placed where the kernel single-steps them, each said in a
/// warning. Counted here, not in a session, as `--stats-json` reports it at exit.
static SINGLE_STEPPED: AtomicUsize = AtomicUsize::new(0);

/// How many probes were placed where the kernel single-steps them, so far.
pub fn single_stepped_probes() -> usize {
    SINGLE_STEPPED.load(Ordering::Relaxed)
}

/// Whether `object` is the preload library of another heapprofd session (one that
/// launched this process), not this session's (`own`). It is not probed: its functions
/// forward to the allocator behind it, whose probes count the same calls, and return
/// probes on them would put the kernel's return trampoline in place of their return
/// addresses, where the other session's unwinder, walking through them, stops.
fn another_sessions_library(object: &ObjectFile, own: Option<(u64, u64)>) -> bool {
    Some(object.id) != own && crate::preload::is_library(&object.path)
}

/// Most notes kept for the profiles' comments.
const MAX_NOTES: usize = 64;

/// What a slot's function is, for profiles.
#[derive(Debug, Clone)]
pub struct SlotInfo {
    /// The function's symbol.
    pub function: String,
    /// Device and inode of its object.
    pub object: (u64, u64),
    /// The object's path as processes map it.
    pub object_path: String,
    /// File offset of the function's first instruction.
    pub offset: u64,
}

/// Where one function's programs attach: its entry program at `entry`, its return
/// probe at `returns` (the entry spot, its exits, or nowhere for a free), as file
/// offsets.
struct ProbePoints {
    slot: ProbeSlot,
    entry: u64,
    returns: Vec<u64>,
}

/// How probes are attached, fixed for the session.
#[derive(Debug, Clone)]
pub struct ProbeSettings {
    /// Functions named with `--allocator`.
    pub custom: Vec<CustomFunction>,
    /// `--probe-placement`.
    pub placement: PlacementMode,
    /// Multi-uprobe links or perf events.
    pub method: AttachMethod,
    /// The one process probed (`--pid`), or `None` for every process.
    pub pid: Option<u32>,
    /// `--all --preload system`: the system-wide library serves the processes it
    /// joins, and each process it does not serve gets its allocator's probes for
    /// itself alone (attached with `process_method`), so that no other process traps.
    pub per_process: Option<AttachMethod>,
    /// Launch mode: the session's links cover the command (`pid`) alone, so each of its
    /// descendants (the only other processes the session reads) that the preload
    /// library does not serve gets its allocator's probes for itself, with `method`.
    pub descendants_alone: bool,
    /// `--sample-rate`: the entry can skip the return of an unsampled call, through a
    /// uprobe session link where the kernel has them.
    pub sampled: bool,
}

/// A process whose allocator was looked for.
pub struct ProcessView<'a> {
    /// Its pid.
    pub pid: u32,
    /// Its name.
    pub comm: &'a str,
    /// Its program's path.
    pub exe: Option<&'a str>,
    /// Its mapped objects, in address order, each once.
    pub objects: &'a [Arc<ObjectFile>],
    /// The process is past its loader's start-up, so a missing allocator is missing
    /// (not yet mapped is no longer an explanation).
    pub settled: bool,
}

/// A scan, or why the object could not be scanned; keyed by object and whether it was
/// scanned as a program.
type ScanCache = HashMap<((u64, u64), bool), Result<Arc<ObjectScan>, String>>;

/// The session's allocator probes.
pub struct AllocatorProbes {
    specs: Array<MapData, ProbeSpec>,
    /// The slots by their probes' page offsets, for the session program.
    page_slots: PageSlots,
    settings: ProbeSettings,
    slots: Vec<SlotInfo>,
    /// Per object and process (0: every process), the file offsets of the functions
    /// attached.
    attached: HashMap<((u64, u64), u32), HashSet<u64>>,
    /// The slot of each function probed, by object and file offset: a function probed
    /// for several processes keeps one slot.
    slot_of: HashMap<((u64, u64), u64), ProbeSlot>,
    /// The links of the probes attached for one process, detached when it exits.
    process_links: HashMap<u32, Vec<(&'static str, UProbeLinkId)>>,
    /// Processes the system-wide library joined (`--preload system`), shared with the
    /// thread that answers them.
    system_joined: crate::system_preload::JoinedSet,
    /// `--preload system`: processes that ran before heapprofd, left alone until their
    /// copy of the library asks to join (or cannot be asked).
    awaiting_ask: HashSet<u32>,
    /// Processes that got probes for themselves alone, over the run.
    processes_probed_alone: u64,
    /// `--preload system`: processes left alone because they opted out of it
    /// (`crate::system_preload::opt_out`), over the run.
    opted_out: HashSet<u32>,
    scans: ScanCache,
    /// Objects each process's `malloc` binds to, by pid (for messages).
    serving: HashMap<u32, (u64, u64)>,
    probes: usize,
    reported: HashSet<String>,
    notes: Vec<String>,
    custom_found: HashSet<String>,
    /// Launch mode's preload library and its file's identity.
    preload: Option<(PreloadLibrary, (u64, u64))>,
    /// Processes told to fall back from the preload library to the probes.
    preload_fallbacks: HashSet<u32>,
    /// The uprobe session program (sampled sessions).
    session_program: SessionProgram,
    /// The session links made, held as long as the probes.
    session_links: Vec<OwnedFd>,
}

impl AllocatorProbes {
    /// Takes the `PROBES` and `SLOT_BY_PAGE_OFFSET` maps out of the loaded programs.
    pub fn new(ebpf: &mut Ebpf, settings: ProbeSettings) -> Result<Self> {
        let specs = ebpf
            .take_map(names::PROBES)
            .and_then(|map| Array::try_from(map).ok())
            .with_context(|| format!("BPF map {} missing or mistyped", names::PROBES))?;
        Ok(Self {
            specs,
            page_slots: PageSlots::new(ebpf)?,
            settings,
            slots: Vec::new(),
            attached: HashMap::new(),
            slot_of: HashMap::new(),
            process_links: HashMap::new(),
            system_joined: crate::system_preload::JoinedSet::default(),
            awaiting_ask: HashSet::new(),
            processes_probed_alone: 0,
            opted_out: HashSet::new(),
            scans: HashMap::new(),
            serving: HashMap::new(),
            probes: 0,
            reported: HashSet::new(),
            notes: Vec::new(),
            custom_found: HashSet::new(),
            preload: None,
            preload_fallbacks: HashSet::new(),
            session_program: SessionProgram::Untried,
            session_links: Vec::new(),
        })
    }

    /// Launch mode's preload library: its functions take the first slots (the BPF
    /// programs expect them there) and its probe site gets the one uprobe that
    /// reads its reports. The library then lives as long as the probes.
    pub fn add_preload(&mut self, ebpf: &mut Ebpf, library: PreloadLibrary) -> Result<()> {
        if !self.slots.is_empty() {
            bail!("the preload library's functions must take the first probe slots");
        }
        let path = library.path().to_owned();
        let metadata =
            std::fs::metadata(&path).with_context(|| format!("reading {}", path.display()))?;
        let id = (metadata.dev(), metadata.ino());
        for (slot, (name, role)) in preload::FUNCTIONS.iter().enumerate() {
            let offset = library
                .functions
                .iter()
                .find(|(function, _)| function == name)
                .map_or(0, |(_, offset)| *offset);
            let spec = ProbeSpec {
                probe_offset: offset,
                role: *role as u32,
                size_reg: NO_REGISTER,
                count_reg: NO_REGISTER,
                ptr_reg: NO_REGISTER,
                out_reg: NO_REGISTER,
                in_use: 1,
                ..ProbeSpec::default()
            };
            self.specs
                .set(slot as ProbeSlot, &spec, 0)
                .context("writing the probe specs")?;
            self.slots.push(SlotInfo {
                function: (*name).to_owned(),
                object: id,
                object_path: path.display().to_string(),
                offset,
            });
        }
        let site = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(library.probe_offset),
            cookie: None,
        };
        // Only this session's command tree maps this copy of the file.
        uprobe(ebpf, names::PROG_PRELOAD)?
            .attach([site], &path, UProbeScope::AllProcesses)
            .with_context(|| format!("attaching the uprobe on {}", path.display()))?;
        self.probes += 1;
        log::debug!(
            "preload library {}: probe site at +{:#x}",
            path.display(),
            library.probe_offset
        );
        self.preload = Some((library, id));
        Ok(())
    }

    /// A preload library that will not serve (it could not join the process it was
    /// loaded into): the process's allocator gets the probes. Its probe stays, idle.
    pub fn forget_preload(&mut self) {
        self.preload = None;
    }

    /// The function of `slot`.
    pub fn slot(&self, slot: ProbeSlot) -> Option<&SlotInfo> {
        self.slots.get(slot as usize)
    }

    /// Uprobes attached so far.
    pub fn probes(&self) -> usize {
        self.probes
    }

    /// Device and inode of every object with probes.
    pub fn probed_objects(&self) -> impl Iterator<Item = &(u64, u64)> {
        self.attached.keys().map(|(object, _)| object)
    }

    /// Whether `object` has probes: an allocator's, or the preload library's site.
    pub fn is_probed(&self, object: (u64, u64)) -> bool {
        self.attached.keys().any(|(id, _)| *id == object)
            || self.preload.as_ref().is_some_and(|(_, id)| *id == object)
    }

    /// What could not be probed, for the profiles' comments.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// The probed objects and their functions, for the profiles' comments.
    pub fn describe(&self) -> Vec<String> {
        let mut by_object: Vec<(&str, Vec<&str>)> = Vec::new();
        for slot in &self.slots {
            match by_object
                .iter_mut()
                .find(|(path, _)| *path == slot.object_path)
            {
                Some((_, functions)) => functions.push(&slot.function),
                None => by_object.push((&slot.object_path, vec![&slot.function])),
            }
        }
        by_object
            .into_iter()
            .map(|(path, functions)| format!("{path}: {}", functions.join(" ")))
            .collect()
    }

    /// Names of the probed objects, for messages.
    pub fn object_names(&self) -> String {
        let mut names: Vec<&str> = Vec::new();
        for slot in &self.slots {
            if !names.contains(&slot.object_path.as_str()) {
                names.push(&slot.object_path);
            }
        }
        if names.is_empty() {
            "no allocator yet".to_owned()
        } else {
            names.join(", ")
        }
    }

    fn scan(&mut self, object: &ObjectFile, executable: bool) -> Result<Arc<ObjectScan>, String> {
        let key = (object.id, executable);
        if let Some(scan) = self.scans.get(&key) {
            return scan.clone();
        }
        let scanned = scan::scan(
            &object.open_path,
            &object.path,
            executable,
            &self.settings.custom,
            self.settings.placement,
        )
        .map(Arc::new)
        .map_err(|err| err.to_string());
        self.scans.insert(key, scanned.clone());
        scanned
    }

    /// Probes the functions of `families` that `object` defines and that are not
    /// probed yet. Returns how many were added.
    pub fn probe_object(
        &mut self,
        ebpf: &mut Ebpf,
        object: &ObjectFile,
        families: &[Family],
        executable: bool,
    ) -> Result<usize> {
        self.probe_object_for(ebpf, object, families, executable, None)
    }

    /// [`Self::probe_object`] for process `only` alone, or for every process (`None`).
    fn probe_object_for(
        &mut self,
        ebpf: &mut Ebpf,
        object: &ObjectFile,
        families: &[Family],
        executable: bool,
        only: Option<u32>,
    ) -> Result<usize> {
        let scan = self
            .scan(object, executable)
            .map_err(|err| anyhow::anyhow!(err))?;
        let key = (object.id, only.unwrap_or(0));
        let new = self.unprobed(&scan, families, key);
        if new.is_empty() {
            return Ok(0);
        }
        self.check_slots_left(object, &new)?;
        for (alias, name) in &scan.aliases {
            log::debug!(
                "{alias} is {name} in {}: traced once, as {name}",
                object.path
            );
        }
        let plan = self.assign_slots(object, &new, executable, scan.text)?;
        self.attach(ebpf, object, &plan.points, only)?;
        self.record_slots(object, plan.fresh);
        self.attached
            .entry(key)
            .or_default()
            .extend(new.iter().map(|f| f.offset));
        Ok(new.len())
    }

    /// The functions of `families` in `scan` not attached yet for `key` (object,
    /// process) nor by the session's links where they cover that process.
    fn unprobed(
        &self,
        scan: &ObjectScan,
        families: &[Family],
        key: ((u64, u64), u32),
    ) -> Vec<FoundFunction> {
        let (object, only) = key;
        // With one target, the session's links are the target's and cover no other
        // process.
        let global = match (only, self.settings.pid) {
            (1.., Some(_)) => None,
            _ => self.attached.get(&(object, 0)),
        };
        let attached = self.attached.get(&key);
        scan.of_families(families)
            .filter(|f| attached.is_none_or(|offsets| !offsets.contains(&f.offset)))
            .filter(|f| global.is_none_or(|offsets| !offsets.contains(&f.offset)))
            .cloned()
            .collect()
    }

    /// Probes an object found without a process: all its functions if `malloc` can
    /// bind to it (a C library, a replacement allocator, a static program) and
    /// `standard` allows (the preload library serves those names), else its vendor and
    /// custom ones.
    pub fn probe_found_object(
        &mut self,
        ebpf: &mut Ebpf,
        object: &ObjectFile,
        executable: bool,
        standard: bool,
    ) -> Result<usize> {
        let scan = self
            .scan(object, executable)
            .map_err(|err| anyhow::anyhow!(err))?;
        let families: &[Family] = if scan.defines_malloc && standard {
            &[Family::Standard, Family::Vendor, Family::Custom]
        } else {
            &[Family::Vendor, Family::Custom]
        };
        self.probe_object(ebpf, object, families, executable)
    }

    /// Attaches `points` of `object`, for process `only` alone (its links kept, to be
    /// detached when it exits) or for the session's scope.
    fn attach(
        &mut self,
        ebpf: &mut Ebpf,
        object: &ObjectFile,
        points: &[ProbePoints],
        only: Option<u32>,
    ) -> Result<()> {
        let (scope, method) = match (
            only.and_then(std::num::NonZeroU32::new),
            self.settings.per_process,
        ) {
            (Some(pid), Some(method)) => (UProbeScope::OneProcess(pid), method),
            (Some(pid), None) => (UProbeScope::OneProcess(pid), self.settings.method),
            _ => match self.settings.pid.and_then(std::num::NonZeroU32::new) {
                Some(pid) => (UProbeScope::OneProcess(pid), self.settings.method),
                None => (UProbeScope::AllProcesses, self.settings.method),
            },
        };
        let mut links: Vec<(&'static str, UProbeLinkId)> = Vec::new();
        let path = &object.open_path;
        let context = || format!("attaching uprobes to the allocator in {}", object.path);
        let entry = |slot: ProbeSlot, offset: u64| UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(offset),
            cookie: Some(u64::from(slot)),
        };
        let returns: Vec<u64> = points
            .iter()
            .flat_map(|p| p.returns.iter().copied())
            .collect();
        // Probes for one process alone keep plain links, which are detached when it
        // exits.
        if only.is_none() && self.attach_session(ebpf, object, points) {
            return Ok(());
        }
        match method {
            AttachMethod::MultiLink => {
                let entries: Vec<_> = points.iter().map(|p| entry(p.slot, p.entry)).collect();
                self.probes += entries.len() + returns.len();
                let link = uprobe(ebpf, names::PROG_ENTRY_MULTI)?
                    .attach(entries, path, scope)
                    .with_context(context)?;
                links.push((names::PROG_ENTRY_MULTI, link));
                if !returns.is_empty() {
                    let returns: Vec<UProbeAttachPoint> = returns
                        .iter()
                        .map(|o| UProbeAttachLocation::AbsoluteOffset(*o).into())
                        .collect();
                    let link = uprobe(ebpf, names::PROG_ALLOC_RETURN_MULTI)?
                        .attach(returns, path, scope)
                        .with_context(context)?;
                    links.push((names::PROG_ALLOC_RETURN_MULTI, link));
                }
            }
            AttachMethod::PerfEvents => {
                for point in points {
                    self.probes += 1;
                    let link = uprobe(ebpf, names::PROG_ENTRY)?
                        .attach([entry(point.slot, point.entry)], path, scope)
                        .with_context(context)?;
                    links.push((names::PROG_ENTRY, link));
                }
                for offset in returns {
                    self.probes += 1;
                    let at = UProbeAttachLocation::AbsoluteOffset(offset);
                    let link = uprobe(ebpf, names::PROG_ALLOC_RETURN)?
                        .attach([at], path, scope)
                        .with_context(context)?;
                    links.push((names::PROG_ALLOC_RETURN, link));
                }
            }
        }
        if let Some(pid) = only {
            let process = self.process_links.entry(pid).or_default();
            if process.is_empty() {
                self.processes_probed_alone += 1;
            }
            process.extend(links);
        }
        Ok(())
    }

    /// Whether process `pid` gets probes for itself alone (`Some(pid)`), or is covered
    /// by the session's links (`None`): `--preload system` probes every process it
    /// does not serve alone, launch mode each descendant of the command.
    fn probed_alone(&self, pid: u32) -> Option<u32> {
        let descendant = self.settings.descendants_alone && self.settings.pid != Some(pid);
        (self.settings.per_process.is_some() || descendant).then_some(pid)
    }

    /// Custom functions not found in any object so far.
    pub fn custom_missing(&self) -> Vec<&str> {
        self.settings
            .custom
            .iter()
            .map(|c| c.name.as_str())
            .filter(|name| !self.custom_found.contains(*name))
            .collect()
    }

    /// Logs `message` once per `cause`, and keeps it for the profiles.
    fn report(&mut self, cause: &str, message: String) {
        if !self.reported.insert(cause.to_owned()) {
            return;
        }
        // `--pid` with nothing to probe stops with this message as its error.
        if self.settings.pid.is_none() || self.probes > 0 {
            log::warn!("{message}");
        }
        if self.notes.len() < MAX_NOTES {
            self.notes.push(message);
        }
    }
}

/// The offsets where a function's return is probed: none for a free, else each exit
/// its placement found (or the entry, for a return probe).
fn return_offsets(function: &scan::FoundFunction) -> Vec<u64> {
    if !function.signature.role.returns_a_block() {
        Vec::new()
    } else if function.placement.exits.is_empty() {
        vec![function.probe_offset()]
    } else {
        function
            .placement
            .exits
            .iter()
            .map(|exit| function.offset + exit)
            .collect()
    }
}
