//! A user-space session: allocator probes in processes to profiles on disk.
//!
//! `images` keeps what is known of the traced processes (their images and mappings);
//! `memory` their RSS and peaks; `profile` turns the site table into profiles and the
//! `--top` summary; `expiry` tells when an exited process is forgotten
//! (`--retain-exited`).

mod expiry;
mod images;
mod memory;
mod metrics;
mod profile;

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{Array, MapData, RingBuf},
};
use heapprof_common::{
    ExecEvent, names,
    unwind::{GapReason, MappingsRequest, RequestReason},
};

use self::{
    expiry::ExitLedger,
    images::{Image, Images, SpaceNumbers},
    memory::MemoryRecords,
};
use super::{Contents, DropLog, DumpTimes, ProfileToWrite, Written, column_totals, write_profile};
use crate::{
    aggregate::{Maps, Site, stacks::NodeMarks},
    allocators::{AllocatorProbes, ProcessView},
    cli::Target,
    health::stats::{self, RunTimeStats, StackLookups},
    metrics::Exporter,
    stats_file::Leaving,
    symbolize::Symbolizer,
    unwind::table_upload::{TableCapacities, TableUploader, TableUsage},
};

/// Settings of a session.
pub struct UserSessionConfig {
    /// What is traced.
    pub target: Target,
    /// Where profiles go.
    pub output: PathBuf,
    /// Mean bytes between sampled allocations; 0 when every allocation is recorded.
    pub sample_rate: u64,
    /// Log the BPF programs' run time with every profile.
    pub bpf_stats: bool,
    /// Capacities of the unwind tables; `None` with `--unwind fp`, which needs none.
    pub unwind_tables: Option<TableCapacities>,
    /// With `--all`: how long an exited process is kept before it is forgotten;
    /// `None` keeps it to the end.
    pub retain_exited: Option<Duration>,
    /// `--preload system`: the system-wide build is this session's own library (its
    /// frames are its own allocations, made while it joins), not another's wrappers.
    pub system_preload: bool,
}

/// A running session. Dropping it detaches every probe.
pub struct UserSession {
    /// `--pid` joined in-process: first, so that the process's calls are put back
    /// before the probe on the library goes.
    joined: JoinedProcess,
    /// `--preload system`: processes joined and declined so far.
    system_figures: crate::stats_file::SystemPreloadFigures,
    config: UserSessionConfig,
    ebpf: Ebpf,
    run_time_stats: Option<RunTimeStats>,
    maps: Maps,
    images: Images,
    /// Exec notifications from the BPF side, until `take_exec_events` hands them out.
    exec_events: Option<RingBuf<MapData>>,
    /// Requests for processes' mappings, until `take_mapping_requests` hands them out.
    mapping_requests: Option<RingBuf<MapData>>,
    /// How many times the programs held a launched command at a loader event, and how
    /// many of those the session has answered.
    loader_syncs: Array<MapData, u64>,
    loader_syncs_answered: u64,
    /// Exec generations when images were last retired.
    retired_generations: HashMap<u32, u32>,
    /// The allocators' probes, joined by those of each new allocator found.
    allocators: AllocatorProbes,
    symbolizer: Symbolizer,
    started: SystemTime,
    started_at: Instant,
    sequence: u32,
    drop_log: DropLog,
    gap_log: GapLog,
    /// The unwind tables' usage when it was last logged.
    logged_usage: TableUsage,
    /// Each process's RSS and in-use peak, for the profiles' comments.
    memory: MemoryRecords,
    /// When the exited processes were found gone (with `--retain-exited`).
    exits: ExitLedger,
    /// Where each profile's figures are published as metrics (`--metrics`).
    metrics: Option<Exporter>,
}

/// Where stacks were cut short, merged over processes: (place, reason) -> count.
pub(super) type StackGaps = Vec<((String, GapReason), u64)>;

/// Logs the places where stacks are cut short, each once.
#[derive(Debug, Default)]
struct GapLog {
    reported: HashSet<(String, GapReason)>,
}

impl GapLog {
    /// Most places logged per profile; the profile's comments list the top ones.
    const PER_DUMP: usize = 5;

    /// Forgets the places of the processes `pids` (addresses outside any known
    /// mapping name their process: see `Images::place`).
    fn forget(&mut self, pids: &HashSet<u32>) {
        self.reported.retain(|(place, _)| {
            let pid = place
                .split_once("(pid ")
                .and_then(|(_, rest)| rest.split_once(','))
                .and_then(|(pid, _)| pid.parse::<u32>().ok());
            !pid.is_some_and(|pid| pids.contains(&pid))
        });
    }

    fn report(&mut self, gaps: &StackGaps) {
        let new: Vec<_> = gaps
            .iter()
            .filter(|(place, _)| !self.reported.contains(place))
            .take(Self::PER_DUMP)
            .collect();
        for ((place, reason), count) in new {
            log::warn!(
                "{count} stacks cut short at {place}: {} (see the profile's comments; --unwind fp follows frame pointers instead)",
                reason.describe()
            );
            self.reported.insert((place.clone(), *reason));
        }
    }
}

impl UserSession {
    /// Wraps loaded, attached BPF programs.
    pub fn new(
        config: UserSessionConfig,
        mut ebpf: Ebpf,
        allocators: AllocatorProbes,
    ) -> Result<Self> {
        let maps = Maps::new(&mut ebpf)?;
        let exec_events = ebpf
            .take_map(names::EXEC_EVENTS)
            .with_context(|| format!("BPF map {} missing from the object", names::EXEC_EVENTS))?;
        let exec_events = RingBuf::try_from(exec_events)
            .with_context(|| format!("BPF map {} has an unexpected type", names::EXEC_EVENTS))?;
        let mapping_requests = ebpf
            .take_map(names::MAPPINGS_REQUESTS)
            .and_then(|map| RingBuf::try_from(map).ok())
            .with_context(|| format!("BPF map {} missing or mistyped", names::MAPPINGS_REQUESTS))?;
        let loader_syncs = ebpf
            .take_map(names::LOADER_SYNCS)
            .and_then(|map| Array::try_from(map).ok())
            .with_context(|| format!("BPF map {} missing or mistyped", names::LOADER_SYNCS))?;
        let unwinder = match config.unwind_tables {
            Some(capacities) => Some(TableUploader::new(&mut ebpf, capacities)?),
            None => None,
        };
        let run_time_stats = if config.bpf_stats {
            Some(RunTimeStats::enable()?)
        } else {
            None
        };
        let images = Images::new(config.target.clone(), unwinder);
        Ok(Self {
            joined: JoinedProcess(None),
            system_figures: crate::stats_file::SystemPreloadFigures::default(),
            config,
            ebpf,
            run_time_stats,
            maps,
            images,
            exec_events: Some(exec_events),
            mapping_requests: Some(mapping_requests),
            loader_syncs,
            loader_syncs_answered: 0,
            retired_generations: HashMap::new(),
            allocators,
            symbolizer: Symbolizer::new(),
            started: SystemTime::now(),
            started_at: Instant::now(),
            sequence: 0,
            drop_log: DropLog::default(),
            gap_log: GapLog::default(),
            logged_usage: TableUsage::default(),
            memory: MemoryRecords::default(),
            exits: ExitLedger::default(),
            metrics: None,
        })
    }

    /// Uprobes attached to allocator functions so far.
    pub fn allocator_probes(&self) -> usize {
        self.allocators.probes()
    }

    /// What could not be probed.
    pub fn allocator_notes(&self) -> &[String] {
        self.allocators.notes()
    }

    /// The probed allocator objects, for messages.
    pub fn allocator_names(&self) -> String {
        self.allocators.object_names()
    }

    /// Publishes the figures of every profile from now on to `exporter`; turns the
    /// BPF run-time statistics on for it.
    pub fn export_metrics(&mut self, exporter: Exporter) {
        super::enable_stats_for_metrics(&mut self.run_time_stats);
        self.metrics = Some(exporter);
    }

    /// The process the preload library joined (`--pid --inject auto`), which it
    /// leaves when the session ends.
    pub fn set_joined(&mut self, joined: Option<crate::inject::Joined>) {
        self.joined = JoinedProcess(joined);
    }

    /// `--pid --inject auto`: leaves the process joined in-process (its calls put
    /// back), before the session ends; returns how, for `--stats-json` (`None` when
    /// none was joined).
    pub fn leave_joined(&mut self) -> Option<Leaving> {
        self.joined.leave()
    }

    /// The preload library loaded into `pid` could not join it: forgotten, and the
    /// process's allocator probed instead.
    pub fn probe_instead_of_preload(&mut self, pid: u32) {
        self.allocators.forget_preload();
        self.refresh_process(pid);
    }

    /// `--preload system`: the processes the system-wide library joins.
    pub fn system_joined(&self) -> crate::system_preload::JoinedSet {
        self.allocators.system_joined()
    }

    /// `--preload system`: `pid` asks to be joined (and counts as served by the library
    /// from then on): its mappings and unwind tables are read now, while it waits.
    pub fn system_join_asked(&mut self, pid: u32) {
        // Probed alone until now (read between its exec and its start's question).
        self.allocators.drop_process_probes(&mut self.ebpf, pid);
        self.refresh_process(pid);
    }

    /// `--preload system`: `pid`'s answer to its join. Returns false when it did not
    /// join: the caller unmarks it, and its allocator's probes then count it.
    pub fn system_join_answered(&mut self, pid: u32, answer: &anyhow::Result<i64>) -> bool {
        let why = match answer {
            Ok(slots) if *slots > 0 => {
                self.system_figures.joined += 1;
                log::debug!("pid {pid}: joined by the system-wide library ({slots} slots)");
                return true;
            }
            Ok(code) => match heapprof_common::preload::JoinRefused::from_result(*code) {
                Some(reason) => reason.describe().to_owned(),
                None => format!("the library refused ({code})"),
            },
            Err(err) => format!("{err:#}"),
        };
        log::debug!(
            "pid {pid}: the system-wide library did not join it ({why}); its allocator's \
             probes count it"
        );
        self.system_figures.declined += 1;
        false
    }

    /// `--preload system`: `pids` ran before heapprofd and are asked to join; until
    /// then (or until they cannot be), they are left alone.
    pub fn await_system_ask(&mut self, pids: &[u32]) {
        self.allocators.await_ask(pids.iter().copied());
    }

    /// `--preload system`: `pid` ran before heapprofd and could not be asked to join.
    pub fn system_not_asked(&mut self, pid: u32, reason: &str) {
        self.allocators.drop_process_probes(&mut self.ebpf, pid);
        log::debug!("pid {pid}: cannot ask it to join ({reason}); its allocator's probes count it");
        self.system_figures.running_not_asked += 1;
    }

    /// `--preload system`: `asked` processes that ran before heapprofd asked to join.
    pub fn system_running_asked(&mut self, asked: usize) {
        self.system_figures.running_asked += asked as u64;
    }

    /// Probes `pid`'s allocator for it alone (a process the library did not join).
    pub fn probe_unjoined(&mut self, pid: u32) {
        self.refresh_process(pid);
    }

    /// `--preload system`: how the processes were served so far.
    pub fn system_figures(&self) -> crate::stats_file::SystemPreloadFigures {
        crate::stats_file::SystemPreloadFigures {
            probed_alone: self.allocators.processes_probed_alone(),
            opted_out: self.allocators.processes_opted_out(),
            ..self.system_figures
        }
    }

    /// Whether the target was joined in-process.
    pub fn joined_in_process(&self) -> bool {
        self.joined.0.is_some()
    }

    /// Reads the mappings of the processes that exist at attach time, so that
    /// their stacks can be symbolized even if they exit before the first interval,
    /// and probes their allocators.
    pub fn prime_processes(&mut self) {
        for image in self.images.prime(&self.maps) {
            self.check_allocators(image, true);
        }
    }

    /// Reads the mappings of `pid`'s current image.
    pub fn refresh_process(&mut self, pid: u32) {
        self.refresh_and_check(pid, true);
    }

    /// Reads `pid`'s mappings and probes the allocators it maps that are new.
    fn refresh_and_check(&mut self, pid: u32, settled: bool) {
        if let Some(image) = self.images.refresh(pid, &self.maps) {
            self.check_allocators(image, settled);
        }
    }

    /// Probes the allocators of `image` not probed yet (see [`AllocatorProbes`]).
    fn check_allocators(&mut self, image: Image, settled: bool) {
        let Some(info) = self.images.get(&image) else {
            return;
        };
        if !info.current {
            return;
        }
        let mut objects: Vec<std::sync::Arc<crate::procmaps::ObjectFile>> = Vec::new();
        for region in &info.maps.regions {
            if !objects.iter().any(|o| o.id == region.object.id) {
                objects.push(std::sync::Arc::clone(&region.object));
            }
        }
        let view = ProcessView {
            pid: image.pid,
            comm: &info.comm,
            exe: info.exe.as_deref(),
            objects: &objects,
            settled,
        };
        self.allocators.check_process(&mut self.ebpf, &view);
    }

    /// Hands out the requests for mappings, to be watched by the caller's event loop.
    pub fn take_mapping_requests(&mut self) -> Option<RingBuf<MapData>> {
        self.mapping_requests.take()
    }

    /// The BPF side asked for a process's mappings (a loader event, or a stack met an
    /// unknown address): reads them, which loads new objects' unwind tables.
    pub fn mappings_requested(&mut self, request: MappingsRequest) {
        log::debug!(
            "pid {}: mappings requested ({})",
            request.tgid,
            if request.reason == RequestReason::Loader as u32 {
                "loader event"
            } else {
                "unknown address"
            }
        );
        // A loader event comes mid-load: the allocator may not be mapped yet.
        self.refresh_and_check(request.tgid, false);
    }

    /// A launched command `pid` stopped at a SIGCONT from the kernel: if the programs
    /// sent it at a loader event, its mappings are read (and its new objects' tables
    /// loaded) before it goes on. Returns whether it was such a hold, whose signal the
    /// caller suppresses.
    pub fn loader_hold(&mut self, pid: u32) -> bool {
        let sent = self.loader_syncs.get(&0, 0).unwrap_or(0);
        if sent <= self.loader_syncs_answered {
            return false;
        }
        self.loader_syncs_answered = sent;
        self.refresh_and_check(pid, false);
        true
    }

    /// A launched command is held right after an exec: its new program is read, and
    /// its allocator probed if it is built in (a static binary), before it runs.
    pub fn exec_hold(&mut self, pid: u32) {
        self.refresh_and_check(pid, false);
    }

    /// A traced process called exec: its new image is read shortly.
    pub fn exec_seen(&mut self, event: ExecEvent) {
        // Probes attached for the process alone would follow it into its new image.
        self.allocators
            .drop_process_probes(&mut self.ebpf, event.tgid);
        self.images.exec_seen(event);
    }

    /// When the next read of an exec'd image is due, if any.
    pub fn next_exec_read(&self) -> Option<Instant> {
        self.images.next_exec_read()
    }

    /// Reads the mappings of exec'd images whose time has come.
    pub fn read_due_images(&mut self) -> Vec<super::ImageRead> {
        let allocators = &self.allocators;
        let read = self
            .images
            .read_due(&self.maps, |object| allocators.is_probed(object));
        read.into_iter()
            .map(|read| {
                self.check_allocators(read.image, read.settled);
                super::ImageRead {
                    pid: read.image.pid,
                    exec_generation: read.image.exec_gen,
                    probed_allocator: read.probed_allocator,
                }
            })
            .collect()
    }

    /// Reads the mappings of every process with sites whose stacks are not all mapped.
    /// Called when a process is about to exit.
    pub fn refresh_unmapped(&mut self) -> Result<()> {
        let sites = self.maps.read_sites()?;
        self.refresh_unmapped_sites(&sites);
        // Its last figures, while it still has its memory.
        self.refresh_memory(&sites);
        Ok(())
    }

    /// Reads the RSS and peak of every process with sites.
    fn refresh_memory(&mut self, sites: &[Site]) {
        let pids: std::collections::BTreeSet<u32> = sites.iter().map(|s| s.key.tgid).collect();
        self.memory.refresh(pids, &self.maps.process_usage());
    }

    /// Reads the mappings of new images and of those with frames outside their
    /// mappings, then symbolizes every site's frames now, while the files are
    /// certainly reachable.
    fn refresh_unmapped_sites(&mut self, sites: &[Site]) {
        self.images.read_unknown(sites, &self.maps);
        let stale = self.symbolize_sites(sites, |_| true);
        if !stale.is_empty() {
            for &pid in &stale {
                self.images.refresh(pid, &self.maps);
            }
            self.symbolize_sites(sites, |pid| stale.contains(&pid));
        }
    }

    /// Symbolizes the frames of the sites of the processes `include` picks, each
    /// frame once per image. Returns the processes whose current image has frames
    /// outside the mappings read (a library loaded since).
    fn symbolize_sites(&mut self, sites: &[Site], include: impl Fn(u32) -> bool) -> HashSet<u32> {
        let stacks = self.maps.stacks();
        // A frame seen means its callers were seen too: stacks share them.
        let mut seen = NodeMarks::new(stacks);
        let mut spaces = SpaceNumbers::default();
        let mut stale = HashSet::new();
        for site in sites {
            let image = Image::of(&site.key);
            if !include(image.pid) {
                continue;
            }
            let Some(info) = self.images.get(&image) else {
                continue;
            };
            let space = spaces.number(image);
            for (node, ret) in stacks.nodes(site.key.stack) {
                if !seen.mark(node, space) {
                    break;
                }
                let addr = ret.wrapping_sub(1);
                match info.maps.find(addr) {
                    Some(region) => {
                        self.symbolizer.frames(region, region.file_offset(addr));
                    }
                    None if info.current => {
                        stale.insert(image.pid);
                    }
                    None => {}
                }
            }
        }
        stale
    }

    /// Where stacks were cut short, most frequent first.
    fn stack_gaps(&self) -> StackGaps {
        let Some(unwinder) = self.images.unwinder() else {
            return Vec::new();
        };
        let mut merged: HashMap<(String, GapReason), u64> = HashMap::new();
        for (gap, count) in unwinder.gaps() {
            let Some(reason) = GapReason::from_u32(gap.reason) else {
                continue;
            };
            *merged
                .entry((
                    self.images.place(
                        Image {
                            pid: gap.tgid,
                            exec_gen: gap.exec_gen,
                        },
                        gap.pc,
                    ),
                    reason,
                ))
                .or_default() += count;
        }
        let mut gaps: StackGaps = merged.into_iter().collect();
        gaps.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.0.cmp(&b.0.0)));
        gaps
    }

    /// Hands out the exec notifications, to be watched by the caller's event loop.
    pub fn take_exec_events(&mut self) -> Option<RingBuf<MapData>> {
        self.exec_events.take()
    }

    /// Marks processes that no longer exist as exited and clears their live blocks from the maps.
    pub fn retire_exited(&mut self) -> Result<()> {
        // Only processes still in the table: the retired ones are done with, and
        // looking again would scan the live table on every interval.
        let dead: HashSet<u32> = self
            .maps
            .traced_pids()?
            .into_iter()
            .filter(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
            .collect();
        // Processes that exec'd and exited without a site left: a reused pid must start
        // from generation 0 with the images of the dead process out of its way.
        for pid in self.maps.exec_generations().into_keys() {
            if !dead.contains(&pid) && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                self.maps.forget_exec_generation(pid);
            }
        }
        self.images.mark_exited(&dead);
        // Probes attached for one process alone (`--preload system`, launch mode's
        // descendants) go with it.
        let gone: HashSet<u32> = self
            .allocators
            .processes_with_own_probes()
            .filter(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
            .collect();
        self.allocators.forget_processes(&mut self.ebpf, &gone);
        // Their peaks, before their entries go.
        self.memory.take_peaks(&self.maps.process_usage());
        self.maps.retire_processes(&dead)?;
        if let Some(retain) = self.config.retain_exited {
            let now = Instant::now();
            for &pid in &dead {
                self.exits.exited(pid, now);
            }
            self.forget_expired(retain, now);
        }
        Ok(())
    }

    /// `--retain-exited`: forgets everything kept of the processes gone for `retain`.
    /// Profiles already written keep their figures.
    fn forget_expired(&mut self, retain: Duration, now: Instant) {
        // Processes known without sites (they never allocated while traced, or their
        // sites did not fit) exit unseen by `retire_exited`: found here.
        let mut known = self.images.pids();
        known.extend(self.memory.pids());
        if let Some(unwinder) = self.images.unwinder() {
            known.extend(unwinder.gaps().into_iter().map(|(gap, _)| gap.tgid));
        }
        for pid in known {
            if !self.exits.contains(pid) && !expiry::alive(pid) {
                self.exits.exited(pid, now);
            }
        }
        let expired = self.exits.take_expired(retain, now, expiry::alive);
        if expired.is_empty() {
            return;
        }
        let sites = self.maps.forget_processes(&expired);
        let objects = self.images.forget_processes(&expired);
        // Before the objects close: their cached symbols are keyed by their address.
        self.symbolizer.forget_objects(&objects);
        self.memory.forget(&expired);
        self.gap_log.forget(&expired);
        log::debug!(
            "forgot {} process(es) gone for {retain:?} or more: {sites} sites, {} object files closed",
            expired.len(),
            objects.len()
        );
    }

    /// Clears the in-use counts of images replaced by exec (their memory went with
    /// them), once per change of the exec generations; `sites`, just read, are
    /// updated to match.
    fn retire_replaced_images(&mut self, sites: &mut [Site]) -> Result<()> {
        let generations = self.maps.exec_generations();
        if generations != self.retired_generations {
            self.maps.retire_replaced_images(&generations, sites)?;
            self.retired_generations = generations;
        }
        Ok(())
    }

    /// Forgets the call state of threads that have exited.
    pub fn remove_exited_threads(&mut self) {
        let left = self.maps.remove_exited_threads();
        log::debug!("{left} threads with allocator call state");
    }

    /// Writes one profile of everything counted so far; returns what it wrote.
    pub fn dump(&mut self) -> Result<Written> {
        let started = Instant::now();
        let mut sites = self.maps.read_sites()?;
        self.retire_replaced_images(&mut sites)?;
        self.refresh_unmapped_sites(&sites);
        self.refresh_memory(&sites);
        let drops = self.maps.read_drops()?;
        self.drop_log.report(&drops);
        let gaps = self.stack_gaps();
        self.gap_log.report(&gaps);
        let read = started.elapsed();
        let profile = self.build_profile(&sites, &drops, &gaps)?;
        // Every frame of the profile is cached by now.
        self.symbolizer.release_parsed_files();
        let built = started.elapsed();
        self.sequence += 1;
        // Lent out for the write: the snapshot reads the rest of the session.
        let mut metrics = self.metrics.take();
        let result = write_profile(
            ProfileToWrite {
                output: &self.config.output,
                sequence: self.sequence,
                profile: &profile,
            },
            DumpTimes {
                started,
                read,
                built,
            },
            metrics.as_mut(),
            || self.metrics_snapshot(&sites, &drops),
            || {
                let [allocated_blocks, allocated_bytes, inuse_blocks, inuse_bytes]: [u64; 4] =
                    column_totals(
                        sites
                            .iter()
                            .map(|site| site.values(self.config.sample_rate)),
                    );
                Contents {
                    sites: sites.len(),
                    allocated_blocks,
                    allocated_bytes,
                    inuse_blocks,
                    inuse_bytes,
                    words: format!(
                        "{} sites, {allocated_blocks} blocks / {allocated_bytes} bytes allocated, \
                         {inuse_blocks} blocks / {inuse_bytes} bytes in use",
                        sites.len(),
                    ),
                }
            },
        );
        self.metrics = metrics;
        let written = result?;
        if let Some(stats) = &self.run_time_stats
            && self.config.bpf_stats
        {
            log::info!("{}", stats::describe(&stats.read(&self.ebpf)));
            match StackLookups::read(&self.ebpf) {
                Ok(lookups) => log::info!("{}", lookups.describe()),
                Err(err) => log::warn!("no count of the stack lookups: {err:#}"),
            }
        }
        if let Some(unwinder) = self.images.unwinder() {
            let usage = unwinder.usage();
            if usage != self.logged_usage {
                log::info!("{}", usage.describe());
                self.logged_usage = usage;
            }
        }
        Ok(written)
    }

    /// The stack lookups (with `--bpf-stats`; `None` if they cannot be read) and the
    /// unwind tables (`None` without CFI unwinding), for `--stats-json`.
    pub fn unwind_figures(&self) -> (Option<crate::stats_file::Lookups>, Option<TableUsage>) {
        let lookups = self
            .config
            .bpf_stats
            .then(|| StackLookups::read(&self.ebpf).ok())
            .flatten()
            .map(Into::into);
        let tables = self.images.unwinder().map(TableUploader::usage);
        (lookups, tables)
    }
}

/// The process the preload library joined; when left, or dropped, the library puts its
/// calls back (if heapprofd cannot reach it, the library leaves by itself once it sees
/// heapprofd gone).
struct JoinedProcess(Option<crate::inject::Joined>);

impl JoinedProcess {
    /// Leaves the process, once; says how in the log and returns it (`None` when
    /// nothing was joined, or it was left already).
    fn leave(&mut self) -> Option<Leaving> {
        let joined = self.0.take()?;
        let pid = joined.pid();
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            return Some(Leaving::Exited);
        }
        Some(match joined.leave() {
            Ok(crate::inject::Left::SlotsRestored(slots)) => {
                log::info!("pid {pid}: left in-process: {slots} allocator slots put back");
                Leaving::SlotsRestored { slots }
            }
            Ok(crate::inject::Left::Replaced) => {
                log::info!(
                    "pid {pid}: exec'd since it was joined; heapprofd's library in its new \
                     image stops by itself now that heapprofd leaves"
                );
                Leaving::Replaced
            }
            Err(reason) => {
                log::warn!(
                    "pid {pid}: cannot leave it in-process now ({reason}); heapprofd's library \
                     there puts its calls back by itself within a few thousand allocations"
                );
                Leaving::NotLeft {
                    reason: reason.to_string(),
                }
            }
        })
    }
}

impl Drop for JoinedProcess {
    fn drop(&mut self) {
        self.leave();
    }
}
