//! `--format legacy`: gperftools' heap-profile text format (heap-profile-table.cc),
//! which Debian's `google-pprof` and `go tool pprof` read:
//!
//! ```text
//! heap profile:      3:     1200 [     3:     1200] @ heapprofile
//!      1:     1000 [     1:     1000] @ 0x555555555190 0x5555555551c5
//!
//! MAPPED_LIBRARIES:
//! 555555555000-555555556000 r-xp 00001000 00:00 0 /path/to/program
//! ```
//!
//! Each stack line is `inuse_objects: inuse_bytes [alloc_objects: alloc_bytes]` and the
//! stack's addresses innermost first, from the allocator's caller on (see [`addresses`]).
//! The file describes one process, whose mappings follow `MAPPED_LIBRARIES:`.

use std::{
    collections::BTreeSet,
    io::{self, Write},
};

use anyhow::{Context as _, Result, bail};

use super::{
    model::{Profile, Sample},
    stacks::ProcessFilter,
};

/// The sample types of a line, in the order the format writes them.
const TYPES: [&str; 4] = [
    "inuse_objects",
    "inuse_space",
    "alloc_objects",
    "alloc_space",
];

/// The samples the file describes: the one process of the profile, or `pid`.
pub fn process_filter(profile: &Profile, pid: Option<u32>) -> Result<ProcessFilter> {
    let pids = profile.pids();
    match pid {
        Some(pid) if pids.contains(&pid) => Ok(ProcessFilter::Pid(pid)),
        Some(pid) => bail!(
            "pid {pid} is not in {}; it holds {}",
            profile.path.display(),
            list_pids(&pids)
        ),
        None if pids.len() > 1 => bail!(
            "{} holds {} processes ({}) and the legacy format describes one; choose it with --pid PID",
            profile.path.display(),
            pids.len(),
            list_pids(&pids)
        ),
        None => Ok(ProcessFilter::All),
    }
}

/// `pids 1, 2, 3`, or `no pid labels`.
pub fn list_pids(pids: &[u32]) -> String {
    if pids.is_empty() {
        return "no pid labels".to_owned();
    }
    let list: Vec<String> = pids.iter().map(u32::to_string).collect();
    format!("pids {}", list.join(", "))
}

/// One stack line.
struct Line {
    /// In the order of [`TYPES`], as written (sampled counts when the profile is sampled).
    values: [i64; 4],
    /// The value of the chosen sample type in the profile, to sort by.
    key: i64,
    /// Innermost first, from the allocator's caller on (see [`addresses`]).
    addresses: Vec<u64>,
}

/// Writes the samples of the process `pid` chooses (needed when the profile holds
/// several), lines sorted by sample type `index`, most first.
pub fn write(out: &mut dyn Write, profile: &Profile, pid: Option<u32>, index: usize) -> Result<()> {
    let filter = process_filter(profile, pid)?;
    let columns = TYPES
        .iter()
        .map(|t| profile.sample_index(t))
        .collect::<Result<Vec<_>, _>>()
        .context(
            "the legacy format needs inuse_objects, inuse_space, alloc_objects and alloc_space",
        )?;
    let samples: Vec<&Sample> = profile
        .samples
        .iter()
        .filter(|s| filter.admits(s))
        .collect();
    // Go's and gperftools' readers scale the counts of a sampled profile up themselves
    // (heap_v2: Poisson sampling by bytes); the profile's are scaled already.
    let rate = (profile.period > 1).then_some(profile.period);
    let mut lines: Vec<Line> = samples
        .iter()
        .map(|sample| {
            let value = |type_index: usize| sample.values[columns[type_index]];
            let (inuse_objects, inuse_bytes) = unscale(value(0), value(1), rate);
            let (alloc_objects, alloc_bytes) = unscale(value(2), value(3), rate);
            Line {
                values: [inuse_objects, inuse_bytes, alloc_objects, alloc_bytes],
                key: sample.values[index],
                addresses: addresses(sample),
            }
        })
        .collect();
    lines.sort_by(|a, b| {
        b.key
            .cmp(&a.key)
            .then_with(|| a.addresses.cmp(&b.addresses))
    });

    print(out, &lines, rate, profile, &samples).context("writing the legacy profile")
}

/// Writes the header, the stack lines and the mappings.
fn print(
    out: &mut dyn Write,
    lines: &[Line],
    rate: Option<i64>,
    profile: &Profile,
    samples: &[&Sample],
) -> io::Result<()> {
    let mut total = [0; 4];
    for line in lines {
        for (sum, value) in total.iter_mut().zip(line.values) {
            *sum += value;
        }
    }
    let kind = match rate {
        Some(rate) => format!("heap_v2/{rate}"),
        None => "heapprofile".to_owned(),
    };
    writeln!(out, "heap profile: {} @ {kind}", counts(total))?;
    for line in lines {
        write!(out, "{} @", counts(line.values))?;
        for address in &line.addresses {
            write!(out, " {address:#010x}")?;
        }
        writeln!(out)?;
    }
    write_mappings(out, profile, samples)
}

/// `%6d: %8d [%6d: %8d]`, as gperftools prints them.
fn counts([inuse_objects, inuse_bytes, alloc_objects, alloc_bytes]: [i64; 4]) -> String {
    format!("{inuse_objects:6}: {inuse_bytes:8} [{alloc_objects:6}: {alloc_bytes:8}]")
}

/// The addresses of a stack, innermost first, as gperftools' heap profiler records
/// them: from the allocator's caller on (so the functions that called malloc hold the
/// bytes), without callers whose address is unknown (0). Readers take every address
/// but the first for a return address and subtract one (google-pprof; Go's reader
/// subtracts one from the first too), so the first is written as the profile holds it,
/// the call instruction, and the others one byte on, as return addresses. A stack with
/// no known caller keeps the allocator's address so that its bytes still count.
fn addresses(sample: &Sample) -> Vec<u64> {
    let callers = sample.locations.iter().skip(1).map(|l| l.address);
    let mut addresses: Vec<u64> = callers.filter(|&a| a != 0).collect();
    for address in addresses.iter_mut().skip(1) {
        *address = address.wrapping_add(1);
    }
    if addresses.is_empty() {
        addresses.extend(sample.locations.first().map(|l| l.address));
    }
    addresses
}

/// Sampled counts that readers of `heap_v2` scale back to the estimates `objects` and
/// `bytes` (the daemon's, see `aggregate::sampling`): readers multiply both by
/// 1 / (1 - exp(-average/rate)). The objects are the estimate times that probability,
/// rounded; the bytes are then solved for so that the reader's bytes come out as
/// `bytes` (rounding the objects alone would shift the average and the scale).
fn unscale(objects: i64, bytes: i64, rate: Option<i64>) -> (i64, i64) {
    let Some(rate) = rate.map(|r| r as f64) else {
        return (objects, bytes);
    };
    if objects <= 0 || bytes <= 0 {
        return (objects, bytes);
    }
    let probability = |objects: f64, bytes: f64| -(-(bytes / objects) / rate).exp_m1();
    let estimate = bytes as f64;
    let sampled_objects = (objects as f64 * probability(objects as f64, estimate))
        .round()
        .max(1.0);
    // What a reader makes of `sampled` bytes in `sampled_objects` blocks; it grows with
    // `sampled` from sampled_objects * rate up, and is at least `sampled`.
    let read_back = |sampled: f64| sampled / probability(sampled_objects, sampled);
    let sampled_bytes = if estimate <= sampled_objects * rate {
        // No count of bytes reads back this low: keep the average instead.
        estimate * probability(objects as f64, estimate)
    } else {
        let (mut low, mut high) = (0.0, estimate);
        for _ in 0..100 {
            let middle = (low + high) / 2.0;
            if read_back(middle) < estimate {
                low = middle;
            } else {
                high = middle;
            }
        }
        high
    };
    (
        sampled_objects as i64,
        (sampled_bytes.round() as i64).max(1),
    )
}

/// `MAPPED_LIBRARIES:` and a `/proc/PID/maps` line for each mapping the samples' stacks
/// use. The profile does not say which process a mapping belongs to, but the
/// locations of the chosen process's samples are all in its own mappings.
fn write_mappings(out: &mut dyn Write, profile: &Profile, samples: &[&Sample]) -> io::Result<()> {
    let used: BTreeSet<(u64, usize)> = samples
        .iter()
        .flat_map(|s| s.locations.iter())
        .filter_map(|l| l.mapping)
        .filter_map(|index| profile.mappings.get(index).map(|m| (m.start, index)))
        .collect();
    writeln!(out, "\nMAPPED_LIBRARIES:")?;
    for (_, index) in used {
        let mapping = &profile.mappings[index];
        // Readers only take executable lines (`..x.`); device and inode are unknown.
        writeln!(
            out,
            "{:08x}-{:08x} r-xp {:08x} 00:00 0 {}",
            mapping.start, mapping.limit, mapping.file_offset, mapping.path
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        aggregate::sampling,
        report::test_profiles::{
            LIBC, MALLOC_OFFSET, PID, PROGRAM, TEXT_OFFSET, abc_profile, build, call_address,
            libc_start, profile_of, program_start,
        },
    };

    fn text(profile: &Profile, pid: Option<u32>) -> String {
        let mut out = Vec::new();
        let index = profile.sample_index("inuse_space").expect("type");
        write(&mut out, profile, pid, index).expect("legacy");
        String::from_utf8(out).expect("utf8")
    }

    #[test]
    fn writes_gperftools_heap_profile_text() {
        let text = text(&abc_profile(), None);
        let call = |name| call_address(PID, name);
        let ret = |name| call_address(PID, name) + 1;
        let expected = format!(
            "heap profile:      3:     1200 [     3:     1200] @ heapprofile\n\
             \x20    1:     1000 [     1:     1000] @ {:#x} {:#x}\n\
             \x20    1:      100 [     1:      100] @ {:#x} {:#x}\n\
             \x20    1:      100 [     1:      100] @ {:#x} {:#x} {:#x}\n\
             \n\
             MAPPED_LIBRARIES:\n\
             {:08x}-{:08x} r-xp {TEXT_OFFSET:08x} 00:00 0 {PROGRAM}\n\
             {:08x}-{:08x} r-xp 00026000 00:00 0 {LIBC}\n",
            call("a"),
            ret("main"),
            call("b"),
            ret("main"),
            call("b"),
            ret("a"),
            ret("main"),
            program_start(PID),
            program_start(PID) + 0x1000,
            libc_start(PID),
            libc_start(PID) + 0x15_0000,
        );
        assert_eq!(text, expected);
    }

    #[test]
    fn one_process_of_several_with_its_own_mappings() {
        let profile = build(
            &[
                (7, &["malloc", "a", "main"], [2, 64, 1, 32]),
                (9, &["malloc", "b", "main"], [1, 16, 1, 16]),
            ],
            1,
        );
        let err = write(&mut Vec::new(), &profile, None, 3).expect_err("two processes");
        let message = format!("{err:#}");
        assert!(
            message.contains("pids 7, 9") && message.contains("--pid"),
            "{message}"
        );
        let err = write(&mut Vec::new(), &profile, Some(8), 3).expect_err("no pid 8");
        assert!(format!("{err:#}").contains("pid 8 is not in"), "{err:#}");

        let text = text(&profile, Some(9));
        assert!(
            text.starts_with("heap profile:      1:       16 [     1:       16] @ heapprofile\n"),
            "{text}"
        );
        assert_eq!(text.lines().filter(|l| l.contains(" @ 0x")).count(), 1);
        assert!(text.contains(&format!("{:#x}", call_address(9, "b"))));
        let maps: Vec<&str> = text
            .lines()
            .skip_while(|l| *l != "MAPPED_LIBRARIES:")
            .skip(1)
            .collect();
        assert_eq!(maps.len(), 2, "{text}");
        assert!(
            maps[0].starts_with(&format!("{:08x}-", program_start(9))),
            "{text}"
        );
    }

    #[test]
    fn a_sampled_profile_holds_the_sampled_counts_and_its_rate() {
        let rate = 512 * 1024;
        // Two 64-byte blocks recorded, one still in use, as the daemon scales them.
        let (alloc_objects, alloc_bytes) = sampling::scale(2, 128, rate);
        let (inuse_objects, inuse_bytes) = sampling::scale(1, 64, rate);
        let profile = build(
            &[(
                PID,
                &["malloc", "main"],
                [alloc_objects, alloc_bytes, inuse_objects, inuse_bytes],
            )],
            rate,
        );
        let text = text(&profile, None);
        assert!(
            text.starts_with(&format!(
                "heap profile:      1:       64 [     2:      128] @ heap_v2/{rate}\n"
            )),
            "{text}"
        );
    }

    #[test]
    fn sampled_counts_read_back_as_the_estimates() {
        let rate = 512;
        for (objects, bytes) in [(1, 1000), (3, 300), (2, 128), (1000, 64_000), (1, 1)] {
            let (estimate_objects, estimate_bytes) = sampling::scale(objects, bytes, rate);
            let (n, s) = unscale(
                estimate_objects as i64,
                estimate_bytes as i64,
                Some(rate as i64),
            );
            // google-pprof's AdjustSamples for heap_v2.
            let scale = 1.0 / -(-(s as f64 / n as f64) / rate as f64).exp_m1();
            let read = s as f64 * scale;
            assert!(
                (read - estimate_bytes as f64).abs() <= scale,
                "({objects}, {bytes}): wrote ({n}, {s}), read {read}, estimate {estimate_bytes}"
            );
            if objects * rate > 4 * bytes {
                // Small blocks (big estimates): the sampled counts come back, the bytes
                // within the estimates' rounding.
                assert_eq!(n, objects as i64, "({objects}, {bytes})");
                assert!((s - bytes as i64).abs() <= 1, "({objects}, {bytes}): {s}");
            }
        }
    }

    #[test]
    fn a_stack_without_callers_keeps_the_allocator() {
        let profile = profile_of(&[(&["malloc"], [1, 8, 1, 8])]);
        let text = text(&profile, None);
        let malloc = libc_start(PID) + MALLOC_OFFSET - 0x26000;
        assert!(
            text.contains(&format!("[     1:        8] @ {malloc:#x}\n")),
            "{text}"
        );
    }

    #[test]
    fn a_profile_without_the_go_types_is_refused() {
        let mut profile = abc_profile();
        profile.sample_types[2] = "something_else".into();
        let err = write(&mut Vec::new(), &profile, None, 3).expect_err("no inuse_objects");
        assert!(format!("{err:#}").contains("no sample type inuse_objects"));
    }
}
