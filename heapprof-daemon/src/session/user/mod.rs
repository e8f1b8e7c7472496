//! A user-space session: allocator probes in processes to profiles on disk.
//!
//! `images` keeps what is known of the traced processes (their images and mappings);
//! `profile` turns the site table into profiles and the `--top` summary.

mod images;
mod profile;

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{MapData, RingBuf},
};
use heapprof_common::{ExecEvent, names};

use self::images::{Image, Images};
use super::DropLog;
use crate::{
    aggregate::{Maps, Site},
    cli::Target,
    pprof::writer,
    probes::{
        Libc,
        stats::{self, RunTimeStats},
    },
    symbolize::Symbolizer,
};

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
    images: Images,
    /// Exec notifications from the BPF side, until `take_exec_events` hands them out.
    exec_events: Option<RingBuf<MapData>>,
    /// Exec generations when images were last retired.
    retired_generations: HashMap<u32, u32>,
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
        let images = Images::new(
            config.target.clone(),
            libc_id,
            config.libc.display.clone(),
        );
        Ok(Self {
            config,
            ebpf,
            run_time_stats,
            maps,
            images,
            exec_events: Some(exec_events),
            retired_generations: HashMap::new(),
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
        self.images.prime(&self.maps);
    }

    /// Reads the mappings of `pid`'s current image.
    pub fn refresh_process(&mut self, pid: u32) {
        self.images.refresh(pid, &self.maps);
    }

    /// A traced process called exec: its new image is read shortly.
    pub fn exec_seen(&mut self, event: ExecEvent) {
        self.images.exec_seen(event);
    }

    /// When the next read of an exec'd image is due, if any.
    pub fn next_exec_read(&self) -> Option<Instant> {
        self.images.next_exec_read()
    }

    /// Reads the mappings of exec'd images whose time has come.
    pub fn read_due_images(&mut self) {
        self.images.read_due(&self.maps);
    }

    /// Reads the mappings of every process with sites whose stacks are not all mapped.
    /// Called when a process is about to exit.
    pub fn refresh_unmapped(&mut self) -> Result<()> {
        let sites = self.maps.read_sites()?;
        self.refresh_unmapped_sites(&sites);
        Ok(())
    }

    /// Reads what is unmapped, then symbolizes every site's frames now, while the
    /// files are certainly reachable.
    fn refresh_unmapped_sites(&mut self, sites: &[Site]) {
        self.images.refresh_unmapped(sites, &mut self.maps);
        for site in sites {
            let stack = self.maps.stack(site.key.stack);
            if let Some(info) = self.images.get(&Image::of(&site.key)) {
                for &ret in stack.iter() {
                    let addr = ret.wrapping_sub(1);
                    if let Some(region) = info.maps.find(addr) {
                        self.symbolizer.frames(region, region.file_offset(addr));
                    }
                }
            }
        }
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
        self.images.mark_exited(&dead);
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

}
