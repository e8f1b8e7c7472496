//! A user-space session: allocator probes in processes to profiles on disk.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{MapData, RingBuf},
};
use heapprof_common::{AllocKind, ExecEvent, names};

use super::{DropLog, Drops, TopSite, TopSites, comment_drops};
use crate::{
    aggregate::{Maps, Site},
    cli::Target,
    pprof::{
        LabelValue, MappingKey, ProfileBuilder,
        builder::{AddressSpace, SAMPLE_TYPES},
        writer,
    },
    probes::{
        Libc,
        stats::{self, RunTimeStats},
    },
    procmaps::{ObjectCache, ProcessMaps, process_name},
    symbolize::{Frame, Symbolizer},
};

/// One image of a process: what runs between two execs. Addresses mean something
/// only within one image, so mappings are kept per image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Image {
    pid: u32,
    exec_gen: u32,
}

impl Image {
    fn of(key: &heapprof_common::StackKey) -> Self {
        Self {
            pid: key.tgid,
            exec_gen: key.exec_gen,
        }
    }

    fn space(self) -> AddressSpace {
        u64::from(self.exec_gen) << 32 | u64::from(self.pid)
    }
}

/// What the session knows of a process image; kept after the process exits or
/// replaces the image, so that its allocations stay symbolized in later profiles.
#[derive(Debug, Default)]
struct ProcessInfo {
    maps: ProcessMaps,
    comm: String,
    exe: Option<String>,
    /// The process is alive and this is still its image: its mappings can be re-read.
    current: bool,
}

/// After an exec, the new image's mappings are read at these delays: at once (the
/// program and the dynamic loader), for an image that exits or execs again quickly,
/// and later, once the loader has mapped the libraries. Until the probed C library
/// shows up; the last read tells that it did not.
const EXEC_READ_DELAYS: [Duration; 3] = [
    Duration::ZERO,
    Duration::from_millis(100),
    Duration::from_secs(2),
];

/// A read of an image's mappings, due at a time after its exec.
#[derive(Debug, Clone, Copy)]
struct ExecRead {
    due: Instant,
    image: Image,
    attempt: usize,
}

/// Location tags: real frames, the allocator entry point of each kind, an unknown stack.
const TAG_FRAME: u16 = 0;
const TAG_UNKNOWN_STACK: u16 = u16::MAX;

/// Settings of a session.
pub struct SessionConfig {
    /// What is traced.
    pub target: Target,
    /// Where profiles go.
    pub output: PathBuf,
    /// The C library probed.
    pub libc: Libc,
    /// The path of that library as the traced processes' maps name it.
    pub libc_maps_path: String,
    /// Mean bytes between sampled allocations; 0 when every allocation is recorded.
    pub sample_rate: u64,
    /// Log the BPF programs' run time with every profile.
    pub bpf_stats: bool,
}

/// A running session. Dropping it detaches every probe.
pub struct Session {
    config: SessionConfig,
    ebpf: Ebpf,
    run_time_stats: Option<RunTimeStats>,
    maps: Maps,
    objects: ObjectCache,
    /// Ordered by pid, then generation: a process's images are one range.
    processes: BTreeMap<Image, ProcessInfo>,
    /// Exec notifications from the BPF side, until `take_exec_events` hands them out.
    exec_events: Option<RingBuf<MapData>>,
    exec_reads: Vec<ExecRead>,
    /// Exec generations when images were last retired.
    retired_generations: HashMap<u32, u32>,
    /// Images that exec'd into a program not using the probed C library (not traced).
    untraced_images: Vec<(Image, String)>,
    /// Device and inode of the probed C library.
    libc_id: Option<(u64, u64)>,
    symbolizer: Symbolizer,
    started: SystemTime,
    started_at: Instant,
    sequence: u32,
    drop_log: DropLog,
}

impl Session {
    /// Wraps loaded, attached BPF programs.
    pub fn new(config: SessionConfig, mut ebpf: Ebpf) -> Result<Self> {
        let maps = Maps::new(&mut ebpf)?;
        let exec_events = ebpf
            .take_map(names::EXEC_EVENTS)
            .with_context(|| format!("BPF map {} missing from the object", names::EXEC_EVENTS))?;
        let exec_events = RingBuf::try_from(exec_events)
            .with_context(|| format!("BPF map {} has an unexpected type", names::EXEC_EVENTS))?;
        let libc_id = std::fs::metadata(&config.libc.path).ok().map(|m| {
            (
                std::os::unix::fs::MetadataExt::dev(&m),
                std::os::unix::fs::MetadataExt::ino(&m),
            )
        });
        let run_time_stats = if config.bpf_stats {
            Some(RunTimeStats::enable()?)
        } else {
            None
        };
        Ok(Self {
            config,
            ebpf,
            run_time_stats,
            maps,
            objects: ObjectCache::default(),
            processes: BTreeMap::new(),
            exec_events: Some(exec_events),
            exec_reads: Vec::new(),
            retired_generations: HashMap::new(),
            untraced_images: Vec::new(),
            libc_id,
            symbolizer: Symbolizer::new(),
            started: SystemTime::now(),
            started_at: Instant::now(),
            sequence: 0,
            drop_log: DropLog::default(),
        })
    }

    /// The probed C library, for messages.
    pub fn libc_display(&self) -> &str {
        &self.config.libc.display
    }

    /// Reads the mappings of the processes that exist at attach time, so that
    /// their stacks can be symbolized even if they exit before the first interval.
    pub fn prime_processes(&mut self) {
        match self.config.target {
            Target::Pid(pid) => self.refresh_process(pid),
            Target::All => {
                let own = std::process::id();
                let pids: Vec<u32> = std::fs::read_dir("/proc")
                    .map(|dir| {
                        dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                            .filter(|pid| *pid != own)
                            .collect()
                    })
                    .unwrap_or_default();
                for pid in pids {
                    self.refresh_process(pid);
                }
                // Kernel threads map nothing.
                self.processes
                    .retain(|_, info| !info.maps.regions.is_empty());
            }
            // A launched command is read when it is held at its exit.
            Target::Launch(_) => {}
        }
    }

    /// Reads the mappings of `pid`'s current image (the cached ones of its earlier
    /// images, and of an exited process, are kept).
    pub fn refresh_process(&mut self, pid: u32) {
        // The generation is read before and after: an exec in between would give
        // the mappings of one image under the number of another.
        for _ in 0..3 {
            let before = self.maps.exec_generation(pid);
            let read = self.objects.read_process(pid);
            let comm = process_name(pid);
            let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
                .ok()
                .map(|p| p.display().to_string());
            let after = self.maps.exec_generation(pid);
            if before != after {
                continue;
            }
            let image = Image {
                pid,
                exec_gen: after,
            };
            self.mark_replaced(pid, after);
            match read {
                // An exited process not yet reaped shows no mappings: keep what was read.
                Ok(maps) if maps.regions.is_empty() && self.processes.contains_key(&image) => {
                    if let Some(info) = self.processes.get_mut(&image) {
                        info.current = false;
                    }
                }
                Ok(maps) => {
                    let info = self.processes.entry(image).or_default();
                    info.maps = maps;
                    info.comm = comm;
                    info.exe = exe;
                    info.current = true;
                }
                Err(err) => {
                    log::debug!(
                        "pid {pid}: mappings not readable ({err}); keeping the cached ones"
                    );
                    if let Some(info) = self.processes.get_mut(&image) {
                        info.current = false;
                    }
                }
            }
            return;
        }
        log::debug!("pid {pid}: exec'ing too fast to read its mappings");
    }

    /// Marks the images of `pid` before generation `current` as replaced.
    fn mark_replaced(&mut self, pid: u32, current: u32) {
        let earlier = Image { pid, exec_gen: 0 }..Image {
            pid,
            exec_gen: current,
        };
        for info in self.processes.range_mut(earlier).map(|(_, info)| info) {
            info.current = false;
        }
    }

    /// Hands out the exec notifications, to be watched by the caller's event loop.
    pub fn take_exec_events(&mut self) -> Option<RingBuf<MapData>> {
        self.exec_events.take()
    }

    /// A traced process called exec: its earlier images are final, the new one is
    /// read shortly (see [`EXEC_READ_DELAYS`]).
    pub fn exec_seen(&mut self, event: ExecEvent) {
        log::debug!("pid {} exec'd (generation {})", event.tgid, event.exec_gen);
        self.mark_replaced(event.tgid, event.exec_gen);
        let now = Instant::now();
        self.exec_reads.push(ExecRead {
            due: now + EXEC_READ_DELAYS[0],
            image: Image {
                pid: event.tgid,
                exec_gen: event.exec_gen,
            },
            attempt: 0,
        });
    }

    /// When the next read of an exec'd image is due, if any.
    pub fn next_exec_read(&self) -> Option<Instant> {
        self.exec_reads.iter().map(|r| r.due).min()
    }

    /// Reads the mappings of exec'd images whose time has come, and tells when one
    /// of them does not use the probed C library (its allocations are not traced).
    pub fn read_due_images(&mut self) {
        let now = Instant::now();
        let (due, later): (Vec<ExecRead>, Vec<ExecRead>) =
            self.exec_reads.drain(..).partition(|r| r.due <= now);
        self.exec_reads = later;
        for read in due {
            let image = read.image;
            if self.maps.exec_generation(image.pid) != image.exec_gen {
                continue; // replaced again, or gone
            }
            self.refresh_process(image.pid);
            let Some(info) = self.processes.get(&image) else {
                continue;
            };
            let uses_libc = info
                .maps
                .regions
                .iter()
                .any(|r| Some(r.object.id) == self.libc_id);
            log::debug!(
                "pid {} (exec generation {}): mappings read, {} executable regions, {}",
                image.pid,
                image.exec_gen,
                info.maps.regions.len(),
                if uses_libc {
                    "with the probed C library"
                } else {
                    "without the probed C library (yet)"
                }
            );
            if uses_libc {
                continue;
            }
            match EXEC_READ_DELAYS.get(read.attempt + 1) {
                Some(delay) => self.exec_reads.push(ExecRead {
                    due: now + *delay,
                    attempt: read.attempt + 1,
                    ..read
                }),
                None => {
                    let program = info.exe.clone().unwrap_or_else(|| info.comm.clone());
                    let message = format!(
                        "pid {} exec'd {program}, which does not use {}: its allocations are no \
                         longer traced (profiles keep everything counted before the exec); to \
                         profile it, run heapprofd --pid {} --libc PATH with the allocator it uses",
                        image.pid, self.config.libc.display, image.pid
                    );
                    if matches!(self.config.target, Target::All) {
                        log::debug!("{message}");
                    } else {
                        log::warn!("{message}");
                        self.untraced_images.push((image, program));
                    }
                }
            }
        }
    }

    /// Reads the mappings of every process with sites whose stacks are not all mapped.
    /// Called on each dump and when a process is about to exit.
    pub fn refresh_unmapped(&mut self) -> Result<()> {
        let sites = self.maps.read_sites()?;
        self.refresh_unmapped_sites(&sites);
        Ok(())
    }

    fn refresh_unmapped_sites(&mut self, sites: &[Site]) {
        let mut checked = HashSet::new();
        let mut generations = HashMap::new();
        for site in sites {
            let image = Image::of(&site.key);
            if checked.contains(&image.pid) {
                continue;
            }
            let stack = self.maps.stack(site.key.stack);
            let needs_refresh = match self.processes.get(&image) {
                // Only the current image can be read: an earlier one's mappings are gone.
                None => {
                    let maps = &self.maps;
                    *generations
                        .entry(image.pid)
                        .or_insert_with(|| maps.exec_generation(image.pid))
                        == image.exec_gen
                }
                Some(info) => {
                    info.current
                        && stack
                            .iter()
                            .any(|&ret| info.maps.find(ret.wrapping_sub(1)).is_none())
                }
            };
            if needs_refresh {
                self.refresh_process(image.pid);
                checked.insert(image.pid);
            }
        }
        // Symbolize now, while the files are certainly reachable.
        for site in sites {
            let stack = self.maps.stack(site.key.stack);
            if let Some(info) = self.processes.get(&Image::of(&site.key)) {
                for &ret in stack.iter() {
                    let addr = ret.wrapping_sub(1);
                    if let Some(region) = info.maps.find(addr) {
                        self.symbolizer.frames(region, region.file_offset(addr));
                    }
                }
            }
        }
    }

    /// Marks processes that no longer exist as exited and clears their live blocks from the maps.
    pub fn retire_exited(&mut self) -> Result<()> {
        // Only processes still in the table: the retired ones are done with, and
        // looking again would scan the live table on every interval.
        let dead: HashSet<u32> = self
            .maps
            .traced_pids()
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
        for pid in &dead {
            let images = Image {
                pid: *pid,
                exec_gen: 0,
            }..=Image {
                pid: *pid,
                exec_gen: u32::MAX,
            };
            for info in self.processes.range_mut(images).map(|(_, info)| info) {
                info.current = false;
            }
        }
        self.maps.retire_processes(&dead)
    }

    /// Clears the in-use counts of images replaced by exec (their memory went with
    /// them), once per change of the exec generations.
    fn retire_replaced_images(&mut self) -> Result<()> {
        let generations = self.maps.exec_generations();
        if generations != self.retired_generations {
            self.maps.retire_replaced_images(&generations)?;
            self.retired_generations = generations;
        }
        Ok(())
    }

    /// Forgets the call state of threads that have exited.
    pub fn remove_exited_threads(&mut self) {
        let left = self.maps.remove_exited_threads();
        log::debug!("{left} threads with allocator call state");
    }

    /// Writes one profile of everything counted so far; returns its path.
    pub fn dump(&mut self) -> Result<PathBuf> {
        let started = Instant::now();
        self.retire_replaced_images()?;
        let sites = self.maps.read_sites()?;
        self.refresh_unmapped_sites(&sites);
        let drops = self.maps.read_drops()?;
        self.drop_log.report(&drops);
        let read = started.elapsed();
        let profile = self.build_profile(&sites, &drops)?;
        let built = started.elapsed();
        self.sequence += 1;
        let name = writer::profile_file_name(SystemTime::now(), self.sequence);
        let path = writer::write_profile(&self.config.output, &name, &profile)?;
        let written = started.elapsed();
        let mut totals = [0u64; 4];
        for site in &sites {
            for (total, value) in totals.iter_mut().zip(site.values(self.config.sample_rate)) {
                *total += value;
            }
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        log::info!(
            "wrote {}: {} sites, {} blocks / {} bytes allocated, {} blocks / {} bytes in use; \
             {:.1} ms (read {:.1}, symbolize+build {:.1}, encode+write {:.1})",
            path.display(),
            sites.len(),
            totals[0],
            totals[1],
            totals[2],
            totals[3],
            ms(written),
            ms(read),
            ms(built - read),
            ms(written - built),
        );
        if let Some(stats) = &self.run_time_stats {
            log::info!("{}", stats::describe(&stats.read(&self.ebpf)));
        }
        Ok(path)
    }

    fn build_profile(
        &mut self,
        sites: &[Site],
        drops: &Drops,
    ) -> Result<crate::pprof::proto::Profile> {
        let now = SystemTime::now();
        let nanos = |t: SystemTime| {
            t.duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as i64)
        };
        let mut builder = ProfileBuilder::new(
            nanos(now),
            self.started_at.elapsed().as_nanos() as i64,
            &SAMPLE_TYPES,
        );
        builder.comment(&format!("heapprofd {}", env!("CARGO_PKG_VERSION")));
        builder.comment(&match &self.config.target {
            Target::Pid(pid) => format!("target: pid {pid}"),
            Target::Launch(cmd) => format!("target: {}", cmd.join(" ")),
            Target::All => "target: all processes".to_owned(),
        });
        builder.comment(&format!("libc: {}", self.config.libc.display));
        let rate = self.config.sample_rate;
        if rate > 0 {
            builder.period(rate);
            builder.comment(&format!(
                "sampled: one allocation per {rate} bytes on average (Poisson); values are scaled estimates"
            ));
        }
        builder.comment(&format!(
            "traced since {} ns after the epoch",
            nanos(self.started)
        ));
        comment_drops(&mut builder, drops);
        for (image, program) in &self.untraced_images {
            builder.comment(&format!(
                "pid {}: not traced after it exec'd {program}, which does not use {}",
                image.pid, self.config.libc.display
            ));
        }

        // The main binary of each image first: pprof takes the first mapping as the program.
        let images: std::collections::BTreeSet<Image> =
            sites.iter().map(|s| Image::of(&s.key)).collect();
        let mut unread = 0;
        for image in &images {
            match self.processes.get(image) {
                Some(info) => {
                    for region in &info.maps.regions {
                        if Some(&region.object.path) == info.exe.as_ref() {
                            add_mapping(&mut builder, *image, region);
                        }
                    }
                }
                None => unread += 1,
            }
        }
        if unread > 0 {
            builder.comment(&format!(
                "{unread} process image(s) exec'd or exited before their mappings could be read: \
                 their frames are shown as addresses"
            ));
        }

        for site in sites {
            if site.counters.alloc_objects == 0 {
                continue;
            }
            let image = Image::of(&site.key);
            let pid = image.pid;
            let space = image.space();
            let stack = self.maps.stack(site.key.stack);
            let empty = ProcessInfo::default();
            let info = self.processes.get(&image).unwrap_or(&empty);
            let mut locations = Vec::with_capacity(stack.len() + 1);
            locations.push(self.allocator_location(&mut builder, image, info, site.key.kind));
            // Frame-pointer walks end in code without frame pointers (libc's start
            // code); frames below the last mapped one are noise.
            let mapped_len = stack
                .iter()
                .rposition(|&ret| info.maps.find(ret.wrapping_sub(1)).is_some())
                .map_or(0, |i| i + 1);
            for &ret in &stack[..mapped_len] {
                // Return addresses point after the call; the call instruction is one byte back.
                let addr = ret.wrapping_sub(1);
                let id = match info.maps.find(addr) {
                    Some(region) => {
                        let frames = self.symbolizer.frames(region, region.file_offset(addr));
                        let key = add_mapping(&mut builder, image, region);
                        builder.location(space, addr, TAG_FRAME, Some(key), &frames)
                    }
                    None => builder.location(space, addr, TAG_FRAME, None, &[]),
                };
                locations.push(id);
            }
            if stack.is_empty() {
                let frame = Frame {
                    function: "[stack not recorded]".into(),
                    file: None,
                    line: 0,
                };
                locations.push(builder.location(space, 0, TAG_UNKNOWN_STACK, None, &[frame]));
            }
            let labels = [
                ("pid", LabelValue::Num(i64::from(pid))),
                ("comm", LabelValue::Str(info.comm.clone())),
            ];
            builder.sample(locations, &site.values(rate), &labels);
        }
        builder.finish().context("building the profile")
    }

    /// The leaf location of a sample: the allocator function the program called,
    /// at its exact entry address in the process.
    fn allocator_location(
        &self,
        builder: &mut ProfileBuilder,
        image: Image,
        info: &ProcessInfo,
        kind: u32,
    ) -> u64 {
        let kind = AllocKind::from_u32(kind).unwrap_or(AllocKind::Malloc);
        let frame = Frame {
            function: kind.symbol().to_owned(),
            file: None,
            line: 0,
        };
        let file_offset = self.config.libc.offset_of(kind);
        let region = file_offset.and_then(|offset| {
            info.maps
                .regions
                .iter()
                .find(|r| {
                    (Some(r.object.id) == self.libc_id
                        || r.object.path == self.config.libc_maps_path)
                        && (r.offset..r.offset + (r.end - r.start)).contains(&offset)
                })
                .map(|r| (r, r.start + offset - r.offset))
        });
        let tag = 1 + kind as u16;
        match region {
            Some((region, address)) => {
                let key = add_mapping(builder, image, region);
                builder.location(image.space(), address, tag, Some(key), &[frame])
            }
            None => builder.location(image.space(), 0, tag, None, &[frame]),
        }
    }
}

impl Session {
    /// The `limit` call sites holding the most memory (then allocating the most),
    /// sites with the same description merged.
    pub fn top_sites(&mut self, limit: usize) -> Result<Vec<TopSite>> {
        let mut merged = TopSites::default();
        for site in self.maps.read_sites()? {
            let stack = self.maps.stack(site.key.stack);
            let kind = AllocKind::from_u32(site.key.kind).map_or("?", AllocKind::symbol);
            let mut names = Vec::new();
            if let Some(info) = self.processes.get(&Image::of(&site.key)) {
                // Innermost first, inlined functions included: the first one made the call.
                'frames: for &ret in stack.iter() {
                    let addr = ret.wrapping_sub(1);
                    let Some(region) = info.maps.find(addr) else {
                        break;
                    };
                    let frames = self.symbolizer.frames(region, region.file_offset(addr));
                    if frames.is_empty() {
                        names.push(format!("{addr:#x}"));
                    }
                    for frame in frames.iter() {
                        if names.is_empty() {
                            let file = frame
                                .file
                                .as_deref()
                                .map(|f| f.rsplit('/').next().unwrap_or(f));
                            names.push(match file {
                                Some(file) => format!("{} ({file}:{})", frame.function, frame.line),
                                None => frame.function.clone(),
                            });
                        } else {
                            names.push(frame.function.clone());
                        }
                        if names.len() == 4 {
                            break 'frames;
                        }
                    }
                }
            }
            if names.is_empty() {
                names.push("[unknown]".into());
            }
            let description = format!("{kind} in {}", names.join(" <- "));
            merged.add(description, site.values(self.config.sample_rate));
        }
        Ok(merged.top(limit))
    }
}

fn add_mapping(
    builder: &mut ProfileBuilder,
    image: Image,
    region: &crate::procmaps::Region,
) -> MappingKey {
    let key = MappingKey {
        space: image.space(),
        start: region.start,
    };
    let object: &Arc<_> = &region.object;
    builder.mapping(
        key,
        region.end,
        region.offset,
        &object.path,
        object.build_id.as_deref(),
    );
    key
}
