//! A user-space session: allocator probes in processes to profiles on disk.

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result};
use aya::Ebpf;
use heapprof_common::AllocKind;

use super::{DropLog, Drops, TopSite, TopSites, comment_drops};
use crate::{
    aggregate::{Maps, Site},
    cli::Target,
    pprof::{LabelValue, MappingKey, ProfileBuilder, builder::SAMPLE_TYPES, writer},
    probes::{
        Libc,
        stats::{self, RunTimeStats},
    },
    procmaps::{ObjectCache, ProcessMaps, process_name},
    symbolize::{Frame, Symbolizer},
};

/// What the session knows of a traced process; kept after it exits so its
/// allocations stay symbolized in later profiles.
#[derive(Debug, Default)]
struct ProcessInfo {
    maps: ProcessMaps,
    comm: String,
    exe: Option<String>,
    alive: bool,
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
    processes: HashMap<u32, ProcessInfo>,
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
            processes: HashMap::new(),
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
                    if self
                        .processes
                        .get(&pid)
                        .is_some_and(|p| p.maps.regions.is_empty())
                    {
                        self.processes.remove(&pid); // kernel threads
                    }
                }
            }
            // A launched command is read when it is held at its exit.
            Target::Launch(_) => {}
        }
    }

    /// Re-reads the mappings of `pid` while it is alive (the cached ones are kept otherwise).
    pub fn refresh_process(&mut self, pid: u32) {
        let info = self.processes.entry(pid).or_default();
        match self.objects.read_process(pid) {
            Ok(maps) => {
                info.maps = maps;
                info.comm = process_name(pid);
                info.exe = std::fs::read_link(format!("/proc/{pid}/exe"))
                    .ok()
                    .map(|p| p.display().to_string());
                info.alive = true;
            }
            Err(err) => {
                log::debug!("pid {pid}: mappings not readable ({err}); keeping the cached ones");
                info.alive = false;
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
        for site in sites {
            let pid = site.key.tgid;
            if checked.contains(&pid) {
                continue;
            }
            let stack = self.maps.stack(site.key.stack);
            let needs_refresh = match self.processes.get(&pid) {
                None => true,
                Some(info) => {
                    info.alive
                        && stack
                            .iter()
                            .any(|&ret| info.maps.find(ret.wrapping_sub(1)).is_none())
                }
            };
            if needs_refresh {
                self.refresh_process(pid);
                checked.insert(pid);
            }
        }
        // Symbolize now, while the files are certainly reachable.
        for site in sites {
            let stack = self.maps.stack(site.key.stack);
            if let Some(info) = self.processes.get(&site.key.tgid) {
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
        let sites = self.maps.read_sites()?;
        let dead: HashSet<u32> = sites
            .iter()
            .map(|s| s.key.tgid)
            .filter(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
            .collect();
        for pid in &dead {
            if let Some(info) = self.processes.get_mut(pid) {
                info.alive = false;
            }
        }
        self.maps.retire_processes(&dead)
    }

    /// Forgets the call state of threads that have exited.
    pub fn remove_exited_threads(&mut self) {
        let left = self.maps.remove_exited_threads();
        log::debug!("{left} threads with allocator call state");
    }

    /// Writes one profile of everything counted so far; returns its path.
    pub fn dump(&mut self) -> Result<PathBuf> {
        let started = Instant::now();
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

        // The main binary of each process first: pprof takes the first mapping as the program.
        let pids: Vec<u32> = sites
            .iter()
            .map(|s| s.key.tgid)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        for pid in &pids {
            if let Some(info) = self.processes.get(pid) {
                for region in &info.maps.regions {
                    if Some(&region.object.path) == info.exe.as_ref() {
                        add_mapping(&mut builder, *pid, region);
                    }
                }
            }
        }

        for site in sites {
            if site.counters.alloc_objects == 0 {
                continue;
            }
            let pid = site.key.tgid;
            let stack = self.maps.stack(site.key.stack);
            let empty = ProcessInfo::default();
            let info = self.processes.get(&pid).unwrap_or(&empty);
            let mut locations = Vec::with_capacity(stack.len() + 1);
            locations.push(self.allocator_location(&mut builder, pid, info, site.key.kind));
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
                        let key = add_mapping(&mut builder, pid, region);
                        builder.location(pid, addr, TAG_FRAME, Some(key), &frames)
                    }
                    None => builder.location(pid, addr, TAG_FRAME, None, &[]),
                };
                locations.push(id);
            }
            if stack.is_empty() {
                let frame = Frame {
                    function: "[stack not recorded]".into(),
                    file: None,
                    line: 0,
                };
                locations.push(builder.location(pid, 0, TAG_UNKNOWN_STACK, None, &[frame]));
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
        pid: u32,
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
                    r.object.path == self.config.libc_maps_path
                        && (r.offset..r.offset + (r.end - r.start)).contains(&offset)
                })
                .map(|r| (r, r.start + offset - r.offset))
        });
        let tag = 1 + kind as u16;
        match region {
            Some((region, address)) => {
                let key = add_mapping(builder, pid, region);
                builder.location(pid, address, tag, Some(key), &[frame])
            }
            None => builder.location(pid, 0, tag, None, &[frame]),
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
            if let Some(info) = self.processes.get(&site.key.tgid) {
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
    pid: u32,
    region: &crate::procmaps::Region,
) -> MappingKey {
    let key = MappingKey {
        pid,
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
