//! Synthetic profiles for the report tests, written with the daemon's own
//! [`ProfileBuilder`] and read back through [`Profile::from_proto`].

use std::path::Path;

use super::model::Profile;
use crate::{
    pprof::{LabelValue, MappingKey, ProfileBuilder, builder::SAMPLE_TYPES, proto},
    symbolize::Frame,
};

/// The pid of single-process test profiles.
pub const PID: u32 = 4242;
/// The program's path in the test profiles' mappings.
pub const PROGRAM: &str = "/tmp/prog";
/// The C library's path in the test profiles' mappings.
pub const LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";
/// Where malloc is in the test C library's file.
pub const MALLOC_OFFSET: u64 = 0x9_8740;
/// Where the program's text starts in its file (and in its load image).
pub const TEXT_OFFSET: u64 = 0x1000;

/// Where the text of process `pid`'s program is mapped (each process has its own layout).
pub fn program_start(pid: u32) -> u64 {
    0x5555_0000_0000 + u64::from(pid) * 0x10_0000 + TEXT_OFFSET
}

/// Where the text of process `pid`'s C library is mapped; it starts at file offset 0x26000.
pub fn libc_start(pid: u32) -> u64 {
    0x7f00_0000_0000 + u64::from(pid) * 0x100_0000 + 0x26000
}

/// The address of the call a frame named `name` makes, in process `pid`: functions are
/// 0x100 bytes apart in the order of `FUNCTIONS`, their calls 0x10 bytes in.
pub fn call_address(pid: u32, name: &str) -> u64 {
    const FUNCTIONS: [&str; 6] = ["main", "a", "b", "c", "d", "e"];
    let slot = FUNCTIONS.iter().position(|f| *f == name).unwrap_or(7) as u64;
    program_start(pid) + 0x100 * slot + 0x10
}

/// A profile of samples (pid, frames innermost first, values in Go's order of
/// alloc_objects, alloc_space, inuse_objects, inuse_space), sampled every `period`
/// bytes. A leading `malloc` frame is the allocator in the C library; other frames are
/// functions of the program; a frame named `?` has no symbol.
pub fn build(samples: &[(u32, &[&str], [u64; 4])], period: u64) -> Profile {
    Profile::from_proto(Path::new("heap.pb.gz"), &message(samples, period))
        .expect("the test profile reads back")
}

/// The `profile.proto` message behind [`build`]'s profile.
pub fn message(samples: &[(u32, &[&str], [u64; 4])], period: u64) -> proto::Profile {
    let mut builder = ProfileBuilder::new(1_000, 2_000, &SAMPLE_TYPES);
    builder.period(period);
    let mut pids: Vec<u32> = samples.iter().map(|s| s.0).collect();
    pids.sort_unstable();
    pids.dedup();
    let keys = |pid: u32| {
        let space = u64::from(pid);
        (
            MappingKey {
                space,
                start: program_start(pid),
            },
            MappingKey {
                space,
                start: libc_start(pid),
            },
        )
    };
    // The program first, as the daemon writes them.
    for &pid in &pids {
        let (program, libc) = keys(pid);
        builder.mapping(
            program,
            program.start + 0x1000,
            TEXT_OFFSET,
            PROGRAM,
            Some("feed"),
        );
        builder.mapping(libc, libc.start + 0x15_0000, 0x26000, LIBC, None);
    }
    for &(pid, frames, values) in samples {
        let (program, libc) = keys(pid);
        let space = u64::from(pid);
        let locations: Vec<u64> = frames
            .iter()
            .map(|&name| {
                let frame = |name: &str| Frame {
                    function: name.into(),
                    file: None,
                    line: 0,
                };
                match name {
                    "malloc" => {
                        let address = libc.start + MALLOC_OFFSET - 0x26000;
                        builder.location(space, address, 1, Some(libc), &[frame(name)])
                    }
                    "?" => builder.location(space, program.start + 0xf00, 0, Some(program), &[]),
                    _ => {
                        let address = call_address(pid, name);
                        builder.location(space, address, 0, Some(program), &[frame(name)])
                    }
                }
            })
            .collect();
        let labels = [
            ("pid", LabelValue::Num(i64::from(pid))),
            ("comm", LabelValue::Str("prog")),
        ];
        builder.sample(&locations, &values, &labels);
    }
    builder.finish().expect("a valid test profile")
}

/// A kernel profile of one process: samples of (frames innermost first, the `cache`
/// label, values in the order of `KERNEL_SAMPLE_TYPES`), kernel addresses made up.
pub fn kernel_profile(samples: &[(&[&str], Option<&str>, [u64; 6])]) -> Profile {
    let mut builder =
        ProfileBuilder::new(1_000, 2_000, &crate::pprof::builder::KERNEL_SAMPLE_TYPES);
    for (index, &(frames, cache, values)) in samples.iter().enumerate() {
        let locations: Vec<u64> = frames
            .iter()
            .enumerate()
            .map(|(depth, &name)| {
                let frame = Frame {
                    function: name.into(),
                    file: None,
                    line: 0,
                };
                let address = 0xffff_ffff_8100_0000 + (index as u64) * 0x1000 + depth as u64;
                builder.location(0, address, 0, None, &[frame])
            })
            .collect();
        let mut labels = vec![("pid", LabelValue::Num(i64::from(PID)))];
        if let Some(cache) = cache {
            labels.push(("cache", LabelValue::Str(cache)));
        }
        builder.sample(&locations, &values, &labels);
    }
    let message = builder.finish().expect("a valid test profile");
    Profile::from_proto(Path::new("kernel.pb.gz"), &message).expect("reads back")
}

/// A profile of one process ([`PID`]), every allocation recorded.
pub fn profile_of(stacks: &[(&[&str], [u64; 4])]) -> Profile {
    let samples: Vec<(u32, &[&str], [u64; 4])> = stacks
        .iter()
        .map(|&(frames, values)| (PID, frames, values))
        .collect();
    build(&samples, 1)
}

/// What tests/programs/stacks.c allocates: b <- a <- main 100 bytes, a <- main 1000
/// bytes, b <- main 100 bytes, all in use.
pub fn abc_profile() -> Profile {
    profile_of(&[
        (&["malloc", "b", "a", "main"], [1, 100, 1, 100]),
        (&["malloc", "a", "main"], [1, 1000, 1, 1000]),
        (&["malloc", "b", "main"], [1, 100, 1, 100]),
    ])
}

/// What a writer wrote into memory, as text.
pub fn text(write: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<()>) -> String {
    let mut out = Vec::new();
    write(&mut out).expect("writing to memory");
    String::from_utf8(out).expect("utf8")
}
