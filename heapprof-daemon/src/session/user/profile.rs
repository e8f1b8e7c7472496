//! Building a profile from the site table: samples, locations, mappings, comments;
//! and the `--top` summary.

use std::{sync::Arc, time::SystemTime};

use super::{
    StackGaps, UserSession,
    images::{Image, ProcessInfo, SpaceNumbers},
};
use crate::{
    aggregate::Site,
    cli::Target,
    pprof::{LabelValue, MappingKey, ProfileBuilder, builder::USER_SAMPLE_TYPES},
    session::{Drops, comment_drops, epoch_nanos},
    symbolize::Frame,
};
use anyhow::{Context as _, Result};

/// Places where stacks were cut short listed in a profile's comments.
const MAX_GAP_COMMENTS: usize = 20;

/// Location tags: real frames, the allocator entry point of each kind, an unknown stack.
const TAG_FRAME: u16 = 0;
const TAG_UNKNOWN_STACK: u16 = u16::MAX;

/// Each site's stack as the profile's locations. A frame's location is worked out
/// once per image and address: stacks share their callers, and a program has far
/// fewer call sites than frames.
#[derive(Default)]
struct StackLocations {
    frame_locations: hashbrown::HashMap<(u32, u64), u64>,
    allocator_locations: hashbrown::HashMap<(u32, u32), u64>,
    spaces: SpaceNumbers,
    /// The site's frames: each one's location, or its address when it is outside every
    /// mapping.
    frames: Vec<Result<u64, u64>>,
    /// The last site's locations, leaf first.
    locations: Vec<u64>,
}

impl UserSession {
    pub(super) fn build_profile(
        &mut self,
        sites: &[Site],
        drops: &Drops,
        gaps: &StackGaps,
    ) -> Result<Vec<u8>> {
        let mut builder = ProfileBuilder::new(
            epoch_nanos(SystemTime::now()),
            self.started_at.elapsed().as_nanos() as i64,
            &USER_SAMPLE_TYPES,
        );
        self.comment_session(&mut builder, drops, gaps);
        self.add_images(&mut builder, sites);
        let rate = self.config.sample_rate;
        let empty = ProcessInfo::default();
        let mut stacks = StackLocations::default();
        for site in sites.iter().filter(|site| site.counters.alloc_objects != 0) {
            self.stack_locations(&mut builder, site, &mut stacks);
            let image = Image::of(&site.key);
            let info = self.images.get(&image).unwrap_or(&empty);
            let labels = site_labels(image.pid, info, site.key.size_class);
            builder.sample(&stacks.locations, &site.values(rate), &labels);
        }
        builder.finish_compressed().context("building the profile")
    }

    /// The profile's comments on the session: the version, the target, the allocators,
    /// sampling, when tracing began, what was dropped and where stacks were cut short.
    fn comment_session(&self, builder: &mut ProfileBuilder, drops: &Drops, gaps: &StackGaps) {
        builder.comment(&format!("heapprofd {}", env!("CARGO_PKG_VERSION")));
        builder.comment(&match &self.config.target {
            Target::Pid(pid) => format!("target: pid {pid}"),
            Target::Launch(cmd) => format!("target: {}", cmd.join(" ")),
            Target::All => "target: all processes".to_owned(),
        });
        for probed in self.allocators.describe() {
            builder.comment(&format!("allocator: {probed}"));
        }
        for note in self.allocators.notes() {
            builder.comment(note);
        }
        let missing = self.allocators.custom_missing();
        if !missing.is_empty() {
            builder.comment(&format!(
                "--allocator functions not found in any object yet: {}",
                missing.join(" ")
            ));
        }
        let rate = self.config.sample_rate;
        if rate > 0 {
            builder.period(rate);
            builder.comment(&format!(
                "sampled: one allocation per {rate} bytes on average (Poisson); values are scaled estimates"
            ));
            builder.comment(
                "sampled: temp_* count the sampled blocks freed before their thread allocated \
                 again (with the preload library: before its next sampled allocation, an upper \
                 bound); peak_inuse_* are not kept (0)",
            );
        }
        builder.comment(&format!(
            "traced since {} ns after the epoch",
            epoch_nanos(self.started)
        ));
        comment_drops(builder, drops);
        for ((place, reason), count) in gaps.iter().take(MAX_GAP_COMMENTS) {
            builder.comment(&format!(
                "stacks cut short: {count} at {place} ({})",
                reason.describe()
            ));
        }
        if gaps.len() > MAX_GAP_COMMENTS {
            builder.comment(&format!(
                "stacks cut short at {} more places",
                gaps.len() - MAX_GAP_COMMENTS
            ));
        }
    }

    /// The images (process and executable) of `sites`: each process's memory as a
    /// comment, and each image's main binary as the first of its mappings (pprof takes
    /// the first mapping as the program).
    fn add_images(&self, builder: &mut ProfileBuilder, sites: &[Site]) {
        let images: std::collections::BTreeSet<Image> =
            sites.iter().map(|s| Image::of(&s.key)).collect();
        // RSS beside the heap (and the exact peak), one line per process.
        let pids: std::collections::BTreeSet<u32> = images.iter().map(|i| i.pid).collect();
        for pid in pids {
            if let Some(memory) = self.memory.get(pid) {
                builder.comment(&memory.to_comment());
            }
        }
        let mut unread = 0;
        for image in &images {
            match self.images.get(image) {
                Some(info) => {
                    for region in &info.maps.regions {
                        if Some(&region.object.path) == info.exe.as_ref() {
                            add_mapping(builder, *image, info, region);
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
    }

    /// Puts `site`'s stack, as locations leaf first (the allocator function first), in
    /// `stacks.locations`.
    fn stack_locations(
        &mut self,
        builder: &mut ProfileBuilder,
        site: &Site,
        stacks: &mut StackLocations,
    ) {
        let empty = ProcessInfo::default();
        let image = Image::of(&site.key);
        let space = image.space();
        let number = stacks.spaces.number(image);
        let info = self.images.get(&image).unwrap_or(&empty);
        stacks.frames.clear();
        for ret in self.maps.stacks().frames(site.key.stack) {
            // Return addresses point after the call; the call instruction is one byte back.
            let addr = ret.wrapping_sub(1);
            // Another session's interposer called the allocator on the program's
            // behalf (a launched or joined process seen by --all or by probes, a
            // program joined by a system-wide heapprofd): its wrapper's frame is not
            // the program's, the stack starts at the wrapper's caller. (The session
            // that serves the system-wide build keeps its frames: there they are the
            // build's own allocations, made while it joins.)
            let another_interposer = |path: &str| {
                crate::preload::is_library(path)
                    || (!self.config.system_preload && crate::preload::is_interposer(path))
            };
            if stacks.frames.is_empty()
                && info
                    .maps
                    .find(addr)
                    .is_some_and(|region| another_interposer(&region.object.path))
            {
                continue;
            }
            let id = *stacks
                .frame_locations
                .entry((number, addr))
                .or_insert_with(|| match info.maps.find(addr) {
                    Some(region) => {
                        let symbols = self.symbolizer.frames(region, region.file_offset(addr));
                        let key = add_mapping(builder, image, info, region);
                        builder.location(space, addr, TAG_FRAME, Some(key), &symbols)
                    }
                    None => 0,
                });
            stacks.frames.push(if id == 0 { Err(addr) } else { Ok(id) });
        }
        // Frame-pointer walks end in code without frame pointers (libc's start
        // code); frames below the last mapped one are noise.
        let mapped_len = stacks
            .frames
            .iter()
            .rposition(Result::is_ok)
            .map_or(0, |i| i + 1);
        stacks.locations.clear();
        let allocator = *stacks
            .allocator_locations
            .entry((number, site.key.slot))
            .or_insert_with(|| self.allocator_location(builder, image, info, site.key.slot));
        stacks.locations.push(allocator);
        for frame in &stacks.frames[..mapped_len] {
            stacks.locations.push(match *frame {
                Ok(id) => id,
                Err(addr) => builder.location(space, addr, TAG_FRAME, None, &[]),
            });
        }
        if stacks.frames.is_empty() {
            let frame = Frame {
                function: "[stack not recorded]".into(),
                file: None,
                line: 0,
            };
            let unknown = builder.location(space, 0, TAG_UNKNOWN_STACK, None, &[frame]);
            stacks.locations.push(unknown);
        }
    }

    /// The leaf location of a sample: the allocator function the program called,
    /// at its exact entry address in the process.
    fn allocator_location(
        &self,
        builder: &mut ProfileBuilder,
        image: Image,
        info: &ProcessInfo,
        slot: u32,
    ) -> u64 {
        let function = self.allocators.slot(slot);
        let frame = Frame {
            function: function.map_or_else(|| "[allocator]".to_owned(), |f| f.function.clone()),
            file: None,
            line: 0,
        };
        let region = function.and_then(|function| {
            info.maps
                .regions
                .iter()
                .find(|r| {
                    r.object.id == function.object
                        && (r.offset..r.offset + (r.end - r.start)).contains(&function.offset)
                })
                .map(|r| (r, r.start + function.offset - r.offset))
        });
        // Tags tell the functions apart where their addresses are unknown.
        let tag = u16::try_from(slot).map_or(u16::MAX - 1, |slot| slot.saturating_add(1));
        match region {
            Some((region, address)) => {
                let key = add_mapping(builder, image, info, region);
                builder.location(image.space(), address, tag, Some(key), &[frame])
            }
            None => builder.location(image.space(), 0, tag, None, &[frame]),
        }
    }
}

/// A sample's labels: its process, and its size class as a byte count; its cgroup,
/// container and pod where known.
fn site_labels<'a>(
    pid: u32,
    info: &'a ProcessInfo,
    size_class: u32,
) -> Vec<(&'static str, LabelValue<'a>)> {
    let floor = heapprof_common::size_class_floor(size_class);
    let mut labels = vec![
        ("pid", LabelValue::Num(i64::from(pid))),
        ("comm", LabelValue::Str(&info.comm)),
        (
            "size_class",
            LabelValue::Bytes(i64::try_from(floor).unwrap_or(i64::MAX)),
        ),
    ];
    if let Some(cgroup) = &info.cgroup {
        labels.push(("cgroup", LabelValue::Str(&cgroup.path)));
        if let Some(container) = &cgroup.container {
            labels.push(("container", LabelValue::Str(container)));
        }
        if let Some(pod) = &cgroup.pod {
            labels.push(("pod", LabelValue::Str(pod)));
        }
    }
    labels
}

/// The mapping of `region`, named as the process knows its object (see
/// [`ProcessInfo::path_of`]).
fn add_mapping(
    builder: &mut ProfileBuilder,
    image: Image,
    info: &ProcessInfo,
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
        info.path_of(object),
        object.build_id.as_deref(),
    );
    key
}
