//! A kernel session: kmem tracepoints to kernel heap profiles on disk.

use std::{
    collections::HashMap,
    path::PathBuf,
    time::{Instant, SystemTime},
};

use anyhow::{Context as _, Result};
use aya::Ebpf;
use heapprof_common::kernel::{
    DeferredFreePath, KernelAllocKind, KernelEvent, allocator_frames_regex,
};

use super::{
    Contents, DropLog, Drops, DumpTimes, ProfileToWrite, Written, column_totals, comment_drops,
    epoch_nanos, program_figures, write_profile,
};
use crate::{
    aggregate::kernel::{KernelMaps, KernelSite},
    cli::Target,
    health::stats::{self, RunTimeStats},
    metrics::{Exporter, ProcessFigures, Snapshot, TableFigure},
    pprof::keyed_comments::keyed,
    pprof::{
        LabelValue, MappingKey, ProfileBuilder,
        builder::{AddressSpace, KERNEL_SAMPLE_TYPES},
    },
    probes::kernel::{DeferredFreeWatch, DeferredFrees, freed_key, watch_key},
    report::losses::undercounted_comment,
    symbolize::{
        Frame,
        kallsyms::{KERNEL_MODULE, KernelSymbols},
    },
};

/// What the kernel's skipped runs of the programs lose, one line; `None` when it
/// skipped none that lose an event.
fn skipped_runs(ebpf: &Ebpf) -> Option<String> {
    describe_skipped(crate::health::skipped_runs::recursion_misses(ebpf))
}

/// [`skipped_runs`] from each program's skipped runs. The two copies of a raw free
/// program see every event, and one loses it only when both skipped it: at most the
/// smaller of their counts.
fn describe_skipped(mut misses: Vec<(String, u64)>) -> Option<String> {
    let mut lost: Vec<String> = Vec::new();
    for event in KernelEvent::ALL {
        let copies = event.raw_programs();
        if copies.is_empty() {
            continue;
        }
        let mut counts = Vec::new();
        misses.retain(|(name, count)| {
            let copy = copies.contains(&name.as_str());
            if copy {
                counts.push(*count);
            }
            !copy
        });
        // A copy without skipped runs is absent: then no event was lost.
        if counts.len() == copies.len()
            && let Some(&least) = counts.iter().min()
        {
            lost.push(format!("{} at most {least}", event.name()));
        }
    }
    lost.extend(misses.iter().map(|(name, count)| format!("{name} {count}")));
    if lost.is_empty() {
        return None;
    }
    Some(format!(
        "the kernel skipped runs of the BPF programs whose event came while a BPF \
         program was running on that CPU (in an interrupt, or the programs' own map \
         allocations), and those events are not counted (a skipped free leaves its \
         object in use): {}",
        lost.join(", ")
    ))
}

/// Kernel addresses: one address space for every process.
const KERNEL_SPACE: AddressSpace = 0;

/// Location tags: real frames, then one per allocation kind, then the call-site fallback.
const TAG_FRAME: u16 = 0;
const TAG_CALL_SITE: u16 = 100;

/// Settings of a kernel session.
pub struct KernelSessionConfig {
    /// Whose allocations count.
    pub target: Target,
    /// Where profiles go.
    pub output: PathBuf,
    /// The tracepoints attached.
    pub events: Vec<KernelEvent>,
    /// Log the BPF programs' run time with every profile.
    pub bpf_stats: bool,
    /// `--sample-rate` in bytes (0: every allocation): the profile's values are
    /// scaled back to estimates.
    pub sample_rate: u64,
}

/// A running kernel session. Dropping it detaches every program.
pub struct KernelSession {
    config: KernelSessionConfig,
    ebpf: Ebpf,
    maps: KernelMaps,
    symbols: KernelSymbols,
    /// `/proc/modules` when `symbols` was read: reloaded when modules come or go.
    modules_seen: String,
    /// Frames by kernel address, kept across reloads so unloaded modules stay named.
    frames: HashMap<u64, Option<Frame>>,
    run_time_stats: Option<RunTimeStats>,
    started: SystemTime,
    started_at: Instant,
    sequence: u32,
    drop_log: DropLog,
    /// Where each profile's figures are published as metrics (`--metrics`).
    metrics: Option<Exporter>,
    /// Which frees without a tracepoint are seen.
    deferred_frees: DeferredFrees,
}

impl KernelSession {
    /// Wraps loaded, attached programs; reads the kernel's symbols.
    pub fn new(
        config: KernelSessionConfig,
        mut ebpf: Ebpf,
        deferred_frees: DeferredFrees,
    ) -> Result<Self> {
        let maps = KernelMaps::new(&mut ebpf)?;
        let symbols = KernelSymbols::load()?;
        let run_time_stats = if config.bpf_stats {
            Some(RunTimeStats::enable()?)
        } else {
            None
        };
        Ok(Self {
            config,
            ebpf,
            maps,
            symbols,
            modules_seen: std::fs::read_to_string("/proc/modules").unwrap_or_default(),
            frames: HashMap::new(),
            run_time_stats,
            started: SystemTime::now(),
            started_at: Instant::now(),
            sequence: 0,
            drop_log: DropLog::default(),
            metrics: None,
            deferred_frees,
        })
    }

    /// Which frees without a per-object tracepoint this session sees.
    pub fn deferred_frees(&self) -> &DeferredFrees {
        &self.deferred_frees
    }

    /// Publishes the figures of every profile from now on to `exporter`; turns the
    /// BPF run-time statistics on for it.
    pub fn export_metrics(&mut self, exporter: Exporter) {
        super::enable_stats_for_metrics(&mut self.run_time_stats);
        self.metrics = Some(exporter);
    }

    /// The metrics of the profile built from `sites` and `drops`: the kernel heap as
    /// one process, pid 0 named `kernel` (kernel objects outlive the processes in
    /// whose context they were allocated, so per-process figures would mislead).
    fn metrics_snapshot(&self, sites: &[KernelSite], drops: &Drops) -> Snapshot {
        let mut kernel = ProcessFigures {
            pid: 0,
            comm: "kernel".to_owned(),
            ..ProcessFigures::default()
        };
        for site in sites {
            let [alloc_objects, alloc_bytes, inuse_objects, inuse_bytes, _, _] =
                site.scaled_values(self.config.sample_rate);
            kernel.allocated_objects += alloc_objects;
            kernel.allocated_bytes += alloc_bytes;
            kernel.inuse_objects += inuse_objects;
            kernel.inuse_bytes += inuse_bytes;
            kernel.activity += site.counters.alloc_objects + site.counters.free_objects;
        }
        let occupancy = self.maps.occupancy(sites);
        Snapshot {
            processes: vec![kernel],
            drops: *drops,
            tables: TableFigure::of_occupancy(&occupancy),
            programs: program_figures(self.run_time_stats.as_ref(), &self.ebpf),
        }
    }

    /// Counts the kernel allocations made in the context of `pid` (and, when forks are
    /// followed, of its future children).
    pub fn trace_process(&mut self, pid: u32) -> Result<()> {
        self.maps.trace_process(pid)
    }

    /// Re-reads the kernel's symbols when the set of loaded modules changed.
    fn refresh_symbols(&mut self) {
        let modules = std::fs::read_to_string("/proc/modules").unwrap_or_default();
        if modules == self.modules_seen {
            return;
        }
        match KernelSymbols::load() {
            Ok(symbols) => {
                self.symbols = symbols;
                self.modules_seen = modules;
                // Addresses of a new module may have been unknown before.
                self.frames.retain(|_, frame| frame.is_some());
            }
            Err(err) => log::warn!("cannot re-read the kernel symbols: {err:#}"),
        }
    }

    /// The function and module at a kernel code address.
    fn frame(&mut self, address: u64) -> Option<Frame> {
        if let Some(frame) = self.frames.get(&address) {
            return frame.clone();
        }
        let frame = self.symbols.lookup(address).map(|(symbol, _)| Frame {
            function: symbol.name.to_string(),
            file: Some(symbol.module.to_string()),
            line: 0,
        });
        self.frames.insert(address, frame.clone());
        frame
    }

    /// The frames of a stack worth showing: without the tracing machinery the stack was
    /// taken from (arm64 unwinds from inside the tracepoint's iterator), and without the
    /// allocator frame it repeats right above it.
    fn visible_frames(&mut self, stack: &[u64]) -> Vec<u64> {
        const TRACING: [&str; 5] = [
            "__traceiter_",
            "__bpf_trace_",
            "bpf_trace_run",
            "perf_trace_",
            "trace_call_bpf",
        ];
        let mut frames: Vec<u64> = stack
            .iter()
            .copied()
            .skip_while(|&ret| {
                self.frame(ret.wrapping_sub(1))
                    .is_some_and(|f| TRACING.iter().any(|p| f.function.starts_with(p)))
            })
            .collect();
        if frames.len() >= 2 {
            let first = self.frame(frames[0].wrapping_sub(1)).map(|f| f.function);
            let second = self.frame(frames[1].wrapping_sub(1)).map(|f| f.function);
            if first.is_some() && first == second {
                frames.remove(0);
            }
        }
        frames
    }

    /// Symbolizes every frame of the current sites now, while their modules are loaded.
    fn symbolize_sites(&mut self, sites: &[KernelSite]) {
        for site in sites {
            let stack: Vec<u64> = self.maps.stacks().frames(site.key.stack).collect();
            for ret in stack {
                self.frame(ret.wrapping_sub(1));
            }
            if site.key.call_site != 0 {
                self.frame(site.key.call_site.wrapping_sub(1));
            }
        }
    }

    /// Writes one profile of everything counted so far; returns what it wrote.
    pub fn dump(&mut self) -> Result<Written> {
        let started = Instant::now();
        self.refresh_symbols();
        let sites = self.maps.read_sites()?;
        self.symbolize_sites(&sites);
        let drops = self.maps.read_drops()?;
        self.drop_log.report(&drops);
        let deferred = self.maps.read_deferred_frees()?;
        let skipped = skipped_runs(&self.ebpf);
        let read = started.elapsed();
        let profile = self.build_profile(&sites, &drops, &deferred, skipped.as_deref())?;
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
                let totals: [u64; 6] = column_totals(
                    sites
                        .iter()
                        .map(|site| site.scaled_values(self.config.sample_rate)),
                );
                Contents {
                    sites: sites.len(),
                    allocated_blocks: totals[0],
                    allocated_bytes: totals[1],
                    inuse_blocks: totals[2],
                    inuse_bytes: totals[3],
                    words: format!(
                        "{} kernel sites, {} objects / {} bytes allocated ({} requested), \
                         {} objects / {} bytes in use ({} requested)",
                        sites.len(),
                        totals[0],
                        totals[1],
                        totals[4],
                        totals[2],
                        totals[3],
                        totals[5],
                    ),
                }
            },
        );
        self.metrics = metrics;
        let written = result?;
        if let Some(freed) = self.describe_deferred_frees(&deferred) {
            log::info!("deferred and bulk frees seen: {freed}");
        }
        if let Some(skipped) = &skipped {
            log::warn!("{skipped}");
        }
        if let Some(stats) = &self.run_time_stats
            && self.config.bpf_stats
        {
            log::info!("{}", stats::describe(&stats.read(&self.ebpf)));
        }
        Ok(written)
    }

    /// The objects each attached fentry program freed: `kvfree_call_rcu 12 objects,
    /// kmem_cache_free_bulk 3 objects`; `None` when none is attached.
    fn describe_deferred_frees(&self, freed: &[u64; DeferredFreePath::COUNT]) -> Option<String> {
        let parts: Vec<String> = DeferredFreePath::ALL
            .iter()
            .filter(|path| self.deferred_frees.seen.contains(&path.function()))
            .map(|path| format!("{} {} objects", path.function(), freed[*path as usize]))
            .collect();
        (!parts.is_empty()).then(|| parts.join(", "))
    }

    fn add_mapping(&self, builder: &mut ProfileBuilder, address: u64) -> Option<MappingKey> {
        let range = self.symbols.range_of(address)?;
        let key = MappingKey {
            space: KERNEL_SPACE,
            start: range.start,
        };
        builder.mapping(key, range.end, 0, &range.name, None);
        Some(key)
    }

    /// The location of a kernel code address (a return address minus one).
    fn location(&mut self, builder: &mut ProfileBuilder, address: u64, tag: u16) -> u64 {
        let frame = self.frame(address);
        let mapping = self.add_mapping(builder, address);
        let frames: Vec<Frame> = frame.into_iter().collect();
        builder.location(KERNEL_SPACE, address, tag, mapping, &frames)
    }

    fn build_profile(
        &mut self,
        sites: &[KernelSite],
        drops: &Drops,
        deferred: &[u64; DeferredFreePath::COUNT],
        skipped: Option<&str>,
    ) -> Result<Vec<u8>> {
        let mut builder = ProfileBuilder::new(
            epoch_nanos(SystemTime::now()),
            self.started_at.elapsed().as_nanos() as i64,
            &KERNEL_SAMPLE_TYPES,
        );
        self.comment_session(&mut builder, drops, deferred, skipped);
        // The core kernel first: pprof takes the first mapping as the program.
        if let Some(start) = self.kernel_text_start() {
            self.add_mapping(&mut builder, start);
        }
        let mut comms: HashMap<u32, String> = HashMap::new();
        for site in sites.iter().filter(|site| site.counters.alloc_objects != 0) {
            self.add_sample(&mut builder, site, &mut comms);
        }
        builder.finish_compressed().context("building the profile")
    }

    /// The profile's comments on the session: the version, the target and events, how
    /// deferred frees are seen and what was undercounted, sampling, when tracing began,
    /// what was dropped, and the kernel's own slab totals.
    fn comment_session(
        &self,
        builder: &mut ProfileBuilder,
        drops: &Drops,
        deferred: &[u64; DeferredFreePath::COUNT],
        skipped: Option<&str>,
    ) {
        builder.comment(&format!("heapprofd {}", env!("CARGO_PKG_VERSION")));
        // `go tool pprof -top` then puts the flat cost on the allocator's caller; the
        // allocator frames stay in the stacks for every other reader.
        let mut allocator_frames = String::new();
        if allocator_frames_regex(&mut allocator_frames).is_ok() {
            builder.drop_frames(&allocator_frames);
        }
        builder.comment(&match &self.config.target {
            Target::Pid(pid) => {
                format!("target: kernel heap, allocations in the context of pid {pid}")
            }
            Target::Launch(cmd) => format!(
                "target: kernel heap, allocations in the context of `{}` and its children",
                cmd.join(" ")
            ),
            Target::All => "target: kernel heap, all processes".to_owned(),
        });
        let events: Vec<String> = self
            .config
            .events
            .iter()
            .map(|e| format!("{}:{}", e.category(), e.name()))
            .collect();
        builder.comment(&format!("tracepoints: {}", events.join(" ")));
        // Keyed by stable names: the VM tests and any other reader find them so.
        for &(path, watch) in &self.deferred_frees.watches {
            let function = path.function();
            builder.comment(&keyed(
                &format!("deferred frees through {function} seen by"),
                &watch_key(path),
                watch.name(),
            ));
            if matches!(watch, DeferredFreeWatch::Fentry | DeferredFreeWatch::Kprobe) {
                builder.comment(&keyed(
                    &format!("objects freed through {function}"),
                    &freed_key(path),
                    deferred[path as usize],
                ));
            }
        }
        if let Some(undercounted) = self.deferred_frees.undercounted() {
            builder.comment(&undercounted_comment(&undercounted));
        }
        if let Some(skipped) = skipped {
            builder.comment(&undercounted_comment(skipped));
        }
        let rate = self.config.sample_rate;
        if rate > 0 {
            builder.period(rate);
            builder.comment(&format!(
                "sampled: one allocation per {rate} bytes on average (Poisson, decided \
                 before the stack is taken); values are scaled estimates; frees are \
                 matched for the sampled objects only"
            ));
        }
        builder.comment(
            "alloc_space/inuse_space: bytes handed out (slab-rounded, or whole pages); \
             alloc_requested_space/inuse_requested_space: bytes the callers asked for",
        );
        builder.comment(&format!(
            "traced since {} ns after the epoch",
            epoch_nanos(self.started)
        ));
        comment_drops(builder, drops);
        // The slab totals beside the traced heap: what the kernel holds in all.
        match crate::memstats::KernelMemory::read() {
            Ok(memory) => builder.comment(&memory.to_comment()),
            Err(err) => log::debug!("cannot read /proc/meminfo: {err}"),
        }
    }

    /// Adds `site` as a sample: the allocating function, then its stack (or its call
    /// site where no stack was taken), labelled with its process (`comms` caches their
    /// names), module, cache and page order.
    fn add_sample(
        &mut self,
        builder: &mut ProfileBuilder,
        site: &KernelSite,
        comms: &mut HashMap<u32, String>,
    ) {
        let kind = KernelAllocKind::from_u32(site.key.kind).unwrap_or(KernelAllocKind::Kmalloc);
        let leaf = Frame {
            function: kind.function().to_owned(),
            file: None,
            line: 0,
        };
        let mut locations = vec![builder.location(KERNEL_SPACE, 0, 1 + kind as u16, None, &[leaf])];
        let stack: Vec<u64> = self.maps.stacks().frames(site.key.stack).collect();
        let stack = self.visible_frames(&stack);
        let mut module = None;
        for &ret in stack.iter() {
            let address = ret.wrapping_sub(1);
            locations.push(self.location(builder, address, TAG_FRAME));
            if module.is_none()
                && let Some(Frame {
                    file: Some(file), ..
                }) = self.frame(address)
                && file != KERNEL_MODULE
            {
                module = Some(file);
            }
        }
        if stack.is_empty() && site.key.call_site != 0 {
            let address = site.key.call_site.wrapping_sub(1);
            locations.push(self.location(builder, address, TAG_CALL_SITE));
        }
        let pid = site.key.tgid;
        let comm = comms
            .entry(pid)
            .or_insert_with(|| self.maps.comm(pid).unwrap_or_default());
        let mut labels = vec![
            ("pid", LabelValue::Num(i64::from(pid))),
            ("comm", LabelValue::Str(comm)),
        ];
        if let Some(module) = &module {
            labels.push(("module", LabelValue::Str(module)));
        }
        let cache = self.maps.cache(&site.key, crate::sys::page_size());
        if let Some(cache) = &cache {
            labels.push(("cache", LabelValue::Str(cache)));
        }
        if kind == KernelAllocKind::Pages {
            labels.push(("order", LabelValue::Num(site.key.class as i64)));
        }
        builder.sample(
            &locations,
            &site.scaled_values(self.config.sample_rate),
            &labels,
        );
    }

    fn kernel_text_start(&self) -> Option<u64> {
        self.symbols
            .ranges()
            .iter()
            .find(|r| &*r.name == KERNEL_MODULE)
            .map(|r| r.start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn misses(list: &[(&str, u64)]) -> Vec<(String, u64)> {
        list.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect()
    }

    #[test]
    fn skipped_runs_of_both_free_copies_bound_the_lost_frees() {
        assert_eq!(describe_skipped(Vec::new()), None);
        // The first copy skipped, the second never: nothing lost.
        assert_eq!(
            describe_skipped(misses(&[("kmem_cache_free_raw", 900)])),
            None
        );
        let text = describe_skipped(misses(&[
            ("kmalloc", 336),
            ("kmem_cache_free_raw", 900),
            ("kmem_cache_free_raw_nested", 20),
        ]))
        .expect("a loss");
        assert!(
            text.ends_with(": kmem_cache_free at most 20, kmalloc 336"),
            "{text}"
        );
    }
}
