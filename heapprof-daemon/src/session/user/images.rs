//! What a session knows of the traced processes: one entry per image (what a process
//! runs between two execs) with its mappings, read from `/proc` when they may have
//! changed, and kept after the image is gone so that its allocations stay symbolized.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::Arc,
    time::{Duration, Instant},
};

use heapprof_common::{ExecEvent, unwind::ForkOrigin};

use crate::{
    aggregate::{Maps, Site},
    cli::Target,
    pprof::builder::AddressSpace,
    procmaps::{
        ObjectCache, ObjectFile, ProcessMaps, forked_without_exec, process_name, started_as,
    },
    unwind::table_upload::TableUploader,
};

/// One image of a process: what runs between two execs. Addresses mean something
/// only within one image, so mappings are kept per image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct Image {
    pub pid: u32,
    pub exec_gen: u32,
}

/// An exec'd image whose mappings were read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ExecImageRead {
    pub image: Image,
    /// Whether a probed allocator is mapped in it.
    pub probed_allocator: bool,
    /// Whether this was its last read, after which an allocator still missing is
    /// missing.
    pub settled: bool,
}

impl Image {
    /// The image a site's allocations were made in.
    pub fn of(key: &heapprof_common::StackKey) -> Self {
        Self {
            pid: key.tgid,
            exec_gen: key.exec_gen,
        }
    }

    /// The image's address space, as the profile builder keys locations.
    pub fn space(self) -> AddressSpace {
        u64::from(self.exec_gen) << 32 | u64::from(self.pid)
    }
}

/// Small numbers for the images met in one pass over the sites (see
/// [`crate::aggregate::stacks::NodeMarks`]).
#[derive(Debug, Default)]
pub(super) struct SpaceNumbers {
    numbers: HashMap<Image, u32>,
    /// The last image asked about: sites come sorted, an image's sites together.
    last: Option<(Image, u32)>,
}

impl SpaceNumbers {
    /// The number of `image`, given on first use.
    pub fn number(&mut self, image: Image) -> u32 {
        if let Some((last, number)) = self.last
            && last == image
        {
            return number;
        }
        let next = self.numbers.len() as u32;
        let number = *self.numbers.entry(image).or_insert(next);
        self.last = Some((image, number));
        number
    }
}

/// What the session knows of a process image; kept after the process exits or
/// replaces the image, so that its allocations stay symbolized in later profiles.
#[derive(Debug, Default, Clone)]
pub(super) struct ProcessInfo {
    pub maps: ProcessMaps,
    pub comm: String,
    pub exe: Option<String>,
    /// The path the executable was started as, where a link gave `exe` another name
    /// (see `procmaps::started_as`).
    pub started_as: Option<String>,
    /// Its cgroup (and container), for the samples' labels.
    pub cgroup: Option<crate::cgroup::Cgroup>,
    /// The process is alive and this is still its image: its mappings can be re-read.
    pub current: bool,
}

impl ProcessInfo {
    /// The path `object` is shown under: the one the process was started as for its
    /// executable (what the user ran, not the file a link points to), else the path
    /// in its maps file.
    pub fn path_of<'a>(&'a self, object: &'a ObjectFile) -> &'a str {
        match &self.started_as {
            Some(started_as) if self.exe.as_ref() == Some(&object.path) => started_as,
            _ => &object.path,
        }
    }
}

/// After an exec, the new image's mappings are read at these delays: at once (the
/// program and the dynamic loader), for an image that exits or execs again quickly;
/// a few milliseconds on, when the loader has usually mapped the libraries (a
/// launched command's child that its library does not serve is probed from then on);
/// and later, for a slow start. Until the probed C library shows up; the last read
/// tells that it did not.
const EXEC_READ_DELAYS: [Duration; 4] = [
    Duration::ZERO,
    Duration::from_millis(10),
    Duration::from_millis(100),
    Duration::from_secs(2),
];

/// Whether image `exec_gen` of `pid` is a fork's, not replaced by an exec since the
/// fork: the kernel still marks the process so, or the fork program recorded where
/// the image came from.
fn is_fork_image(pid: u32, exec_gen: u32, maps: &Maps) -> bool {
    forked_without_exec(pid) == Some(true)
        || maps
            .fork_origin(pid, exec_gen)
            .is_some_and(|origin| origin.tgid != pid)
}

/// Whether fork `pid`, read as its fork image, has begun an exec. From the moment an
/// exec replaces the address space until `sched_process_exec` counts it, `/proc`
/// shows the new image (maps, name, executable) under the old generation: a shell's
/// fork read at its first allocation, right before its exec, got its new program's
/// maps, and the stacks of its fork image lost every frame. Its fork origin stands
/// in for such a read.
fn exec_under_way(pid: u32) -> bool {
    forked_without_exec(pid) == Some(false)
}

/// A read of an image's mappings, due at a time after its exec.
#[derive(Debug, Clone, Copy)]
struct ExecRead {
    due: Instant,
    image: Image,
    attempt: usize,
}

/// The traced processes' images.
pub(super) struct Images {
    target: Target,
    objects: ObjectCache,
    /// Ordered by pid, then generation: a process's images are one range.
    processes: BTreeMap<Image, ProcessInfo>,
    exec_reads: Vec<ExecRead>,
    /// The fork origins of images an exec replaced before their mappings were read
    /// (see [`ExecEvent::replaced_origin`]), until their frames are symbolized.
    replaced_origins: HashMap<Image, ForkOrigin>,
    /// The unwind tables, fed with every current image read (none with `--unwind fp`).
    unwinder: Option<TableUploader>,
}

impl Images {
    /// No image known yet.
    pub fn new(target: Target, unwinder: Option<TableUploader>) -> Self {
        Self {
            target,
            objects: ObjectCache::default(),
            processes: BTreeMap::new(),
            exec_reads: Vec::new(),
            replaced_origins: HashMap::new(),
            unwinder,
        }
    }

    /// The unwind tables, if stacks are unwound with CFI.
    pub fn unwinder(&self) -> Option<&TableUploader> {
        self.unwinder.as_ref()
    }

    /// Where address `pc` of `image` is, for people: `object+0xOFFSET` (the file
    /// offset, which means the same in every run), or the bare address.
    pub fn place(&self, image: Image, pc: u64) -> String {
        let known = self
            .processes
            .get(&image)
            .and_then(|info| Some((info, info.maps.find(pc)?)));
        match known {
            Some((info, region)) => {
                let path = info.path_of(&region.object);
                format!(
                    "{}+{:#x}",
                    path.rsplit('/').next().unwrap_or(path),
                    region.file_offset(pc)
                )
            }
            None => format!("{pc:#x} (pid {}, outside its known mappings)", image.pid),
        }
    }

    /// What is known of `image`.
    pub fn get(&self, image: &Image) -> Option<&ProcessInfo> {
        self.processes.get(image)
    }

    /// Reads the mappings of the processes that exist at attach time, so that
    /// their stacks can be symbolized even if they exit before the first interval.
    /// Returns the images read.
    pub fn prime(&mut self, maps: &Maps) -> Vec<Image> {
        match self.target {
            Target::Pid(pid) => self.refresh(pid, maps).into_iter().collect(),
            Target::All => {
                let own = std::process::id();
                let pids: Vec<u32> = std::fs::read_dir("/proc")
                    .map(|dir| {
                        dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                            .filter(|pid| *pid != own)
                            .collect()
                    })
                    .unwrap_or_default();
                let read: Vec<Image> = pids
                    .into_iter()
                    .filter_map(|pid| self.refresh(pid, maps))
                    .collect();
                // Kernel threads map nothing.
                self.processes
                    .retain(|_, info| !info.maps.regions.is_empty());
                read.into_iter()
                    .filter(|image| self.processes.contains_key(image))
                    .collect()
            }
            // A launched command is read when its loader has mapped it, and at its exit.
            Target::Launch(_) => Vec::new(),
        }
    }

    /// Reads the mappings of `pid`'s current image (the cached ones of its earlier
    /// images, and of an exited process, are kept). Returns the image read.
    pub fn refresh(&mut self, pid: u32, maps: &Maps) -> Option<Image> {
        // The generation is read before and after: an exec in between would give
        // the mappings of one image under the number of another.
        for _ in 0..3 {
            let before = maps.exec_generation(pid);
            let fork = is_fork_image(pid, before, maps);
            let read = self.objects.read_process(pid);
            let comm = process_name(pid);
            let cgroup = crate::cgroup::Cgroup::of_process(pid).ok();
            let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
                .ok()
                .map(|p| p.display().to_string());
            let started_as = exe.as_deref().and_then(|exe| started_as(pid, exe, &comm));
            let after = maps.exec_generation(pid);
            if before != after {
                continue;
            }
            let image = Image {
                pid,
                exec_gen: after,
            };
            self.mark_replaced(pid, after);
            if fork && exec_under_way(pid) {
                log::debug!("pid {pid}: read while exec'ing; its fork origin stands in");
                if let Some(info) = self.processes.get_mut(&image) {
                    info.current = false;
                }
                return None;
            }
            match read {
                // An exited process not yet reaped shows no mappings: keep what was read.
                Ok(read) if read.regions.is_empty() && self.processes.contains_key(&image) => {
                    if let Some(info) = self.processes.get_mut(&image) {
                        info.current = false;
                    }
                    return None;
                }
                Ok(read) => {
                    let info = self.processes.entry(image).or_default();
                    info.maps = read;
                    info.comm = comm;
                    info.exe = exe;
                    info.started_as = started_as;
                    // A process that exited meanwhile keeps what was read before.
                    if cgroup.is_some() {
                        info.cgroup = cgroup;
                    }
                    info.current = true;
                    if let Some(unwinder) = self.unwinder.as_mut() {
                        if let Err(err) = unwinder.load_process(pid, &info.maps) {
                            log::warn!("pid {pid}: {err:#}");
                        }
                        // An exec since the read: those were the old image's mappings.
                        if maps.exec_generation(pid) != image.exec_gen {
                            unwinder.forget_process(pid);
                        }
                    }
                    return Some(image);
                }
                Err(err) => {
                    log::debug!(
                        "pid {pid}: mappings not readable ({err}); keeping the cached ones"
                    );
                    if let Some(info) = self.processes.get_mut(&image) {
                        info.current = false;
                    }
                    return None;
                }
            }
        }
        log::debug!("pid {pid}: exec'ing too fast to read its mappings");
        None
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

    /// The processes with an image known.
    pub fn pids(&self) -> BTreeSet<u32> {
        self.processes.keys().map(|image| image.pid).collect()
    }

    /// Forgets everything known of the processes `pids` (gone for good: see
    /// `--retain-exited`), and closes the object files no image maps any more.
    /// Returns those objects, whose cached symbols the caller drops.
    pub fn forget_processes(&mut self, pids: &HashSet<u32>) -> Vec<Arc<ObjectFile>> {
        self.processes.retain(|image, _| !pids.contains(&image.pid));
        self.exec_reads
            .retain(|read| !pids.contains(&read.image.pid));
        self.replaced_origins
            .retain(|image, _| !pids.contains(&image.pid));
        if let Some(unwinder) = self.unwinder.as_mut() {
            for &pid in pids {
                unwinder.forget_process(pid);
            }
            unwinder.forget_gaps(pids);
        }
        self.objects.release_unused()
    }

    /// Marks every image of the processes `pids` as gone.
    pub fn mark_exited(&mut self, pids: &HashSet<u32>) {
        for pid in pids {
            if let Some(unwinder) = self.unwinder.as_mut() {
                unwinder.forget_process(*pid);
            }
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
    }

    /// A traced process called exec: its earlier images are final, the new one is
    /// read shortly (see [`EXEC_READ_DELAYS`]).
    pub fn exec_seen(&mut self, event: ExecEvent) {
        log::debug!("pid {} exec'd (generation {})", event.tgid, event.exec_gen);
        self.mark_replaced(event.tgid, event.exec_gen);
        let replaced = Image {
            pid: event.tgid,
            exec_gen: event.exec_gen.wrapping_sub(1),
        };
        let mapped = |info: &ProcessInfo| !info.maps.regions.is_empty();
        if event.replaced_origin.tgid != 0 && !self.processes.get(&replaced).is_some_and(mapped) {
            self.replaced_origins
                .insert(replaced, event.replaced_origin);
        }
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

    /// Reads the mappings of exec'd images whose time has come, reading again later
    /// while none of their objects is `probed` (the loader may not have mapped the
    /// allocator yet). Returns the images read.
    pub fn read_due(
        &mut self,
        maps: &Maps,
        probed: impl Fn((u64, u64)) -> bool,
    ) -> Vec<ExecImageRead> {
        let now = Instant::now();
        let (due, later): (Vec<ExecRead>, Vec<ExecRead>) =
            self.exec_reads.drain(..).partition(|r| r.due <= now);
        self.exec_reads = later;
        let mut read_images = Vec::new();
        for read in due {
            let image = read.image;
            if maps.exec_generation(image.pid) != image.exec_gen {
                continue; // replaced again, or gone
            }
            if self.refresh(image.pid, maps).is_none() {
                continue;
            }
            let Some(info) = self.processes.get(&image) else {
                continue;
            };
            let uses_probed = info.maps.regions.iter().any(|r| probed(r.object.id));
            log::debug!(
                "pid {} (exec generation {}): mappings read, {} executable regions, {}",
                image.pid,
                image.exec_gen,
                info.maps.regions.len(),
                if uses_probed {
                    "with a probed allocator"
                } else {
                    "without a probed allocator (yet)"
                }
            );
            let next = EXEC_READ_DELAYS.get(read.attempt + 1);
            read_images.push(ExecImageRead {
                image,
                probed_allocator: uses_probed,
                settled: uses_probed || next.is_none(),
            });
            if let (false, Some(delay)) = (uses_probed, next) {
                self.exec_reads.push(ExecRead {
                    due: now + *delay,
                    attempt: read.attempt + 1,
                    ..read
                });
            }
        }
        read_images
    }

    /// Reads the mappings of the processes with sites in an image not read yet, where
    /// that image is still current (an earlier one's mappings are gone). Returns
    /// the images read.
    pub fn read_unknown(&mut self, sites: &[Site], maps: &Maps) -> Vec<Image> {
        let mut checked = HashSet::new();
        let mut read_images = Vec::new();
        let mut last = None;
        for site in sites {
            let image = Image::of(&site.key);
            // Sites come sorted: an image's sites together.
            if last == Some(image) {
                continue;
            }
            last = Some(image);
            let mapped = |info: &ProcessInfo| !info.maps.regions.is_empty();
            if self.processes.get(&image).is_some_and(mapped) || checked.contains(&image.pid) {
                continue;
            }
            // An earlier image's mappings are gone: only the current one is read,
            // once per process (sites come sorted, the current image after the old).
            if maps.exec_generation(image.pid) == image.exec_gen {
                read_images.extend(self.refresh(image.pid, maps));
                checked.insert(image.pid);
            }
            // Unknown, or read without mappings as it exited (its objects no longer open).
            if !self.processes.get(&image).is_some_and(mapped) {
                self.adopt_fork_origin(image, maps);
            }
        }
        read_images
    }

    /// A fork that exited (or exec'd) before its own mappings were read was unwound
    /// with its origin's (see `heapprof_common::unwind::ForkOrigin`): its frames are
    /// symbolized with them too.
    fn adopt_fork_origin(&mut self, image: Image, maps: &Maps) {
        let replaced = self.replaced_origins.get(&image).copied();
        let Some(origin) = maps.fork_origin(image.pid, image.exec_gen).or(replaced) else {
            return;
        };
        let source = Image {
            pid: origin.tgid,
            exec_gen: origin.exec_gen,
        };
        let Some(shared) = self
            .processes
            .get(&source)
            .filter(|info| !info.maps.regions.is_empty())
            .cloned()
        else {
            return;
        };
        self.replaced_origins.remove(&image);
        log::debug!(
            "pid {} (exec generation {}): gone before its mappings were read; its frames \
             are read with those of pid {}, which it was forked from",
            image.pid,
            image.exec_gen,
            source.pid
        );
        let info = self.processes.entry(image).or_insert_with(|| ProcessInfo {
            current: false,
            ..shared.clone()
        });
        // What was read of it as it exited (its name, cgroup) stays.
        if info.comm.is_empty() {
            info.comm = shared.comm;
        }
        if info.cgroup.is_none() {
            info.cgroup = shared.cgroup;
        }
        info.maps = shared.maps;
        info.exe = shared.exe;
        info.started_as = shared.started_as;
        info.current = false;
    }
}
