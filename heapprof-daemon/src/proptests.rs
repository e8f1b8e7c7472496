//! Property tests of every parser of outside input: `/proc/PID/maps` lines, tracefs
//! format files, `/proc/kallsyms`, the command line's values, and ELF files (the
//! header, symbol lookup of a damaged C library, and the instruction decoding of
//! probe placement).
//!
//! Inputs are generated (valid ones, then mutated: bytes flipped, cut, duplicated) by
//! a seeded generator, so a failure is reproducible from the seed it prints.
//! `HEAPPROFD_PROPTEST_CASES` sets the number of cases per property (default 2000,
//! the short run of `cargo xtask test`; raise it for a long run).

use crate::{
    arch::Arch,
    cli::{parse_duration, parse_listen_address, parse_sample_rate},
    placement::{self, PlacementMode},
    probes::libc,
    procmaps::parse_maps_line,
    symbolize::kallsyms::KernelSymbols,
    test_rng::Rng,
    tracefs::format,
};

fn cases() -> u64 {
    std::env::var("HEAPPROFD_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

/// Runs `property` on `cases()` seeds; a panic names the seed.
fn check(name: &str, property: impl Fn(&mut Rng)) {
    for case in 0..cases() {
        let seed = 0x9e37_79b9_7f4a_7c15 ^ (case.wrapping_mul(0x1000_0000_01b3) + 1);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            property(&mut Rng(seed));
        }));
        if let Err(panic) = result {
            panic!("property {name} failed for seed {seed:#x}: {panic:?}");
        }
    }
}

/// Flips, cuts, duplicates or inserts bytes of `text` (kept valid UTF-8).
fn mutate(rng: &mut Rng, text: &str) -> String {
    let mut bytes = text.as_bytes().to_vec();
    for _ in 0..=rng.below(4) {
        if bytes.is_empty() {
            bytes.push(b'x');
        }
        let at = rng.below(bytes.len() as u64) as usize;
        match rng.below(5) {
            0 => bytes[at] = (rng.below(95) + 32) as u8,
            1 => bytes.truncate(at),
            2 => {
                let end = (at + rng.below(16) as usize).min(bytes.len());
                let chunk = bytes[at..end].to_vec();
                bytes.splice(at..at, chunk);
            }
            3 => bytes.insert(
                at,
                *b"\t\n:;[]-0 ".get(rng.below(10) as usize).unwrap_or(&b' '),
            ),
            _ => {
                bytes.remove(at);
            }
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

fn maps_line(rng: &mut Rng) -> (String, u64, u64, u64) {
    let start = rng.below(1 << 47) & !0xfff;
    let end = start + (rng.below(1 << 20) + 1) * 0x1000;
    let offset = rng.below(1 << 32) & !0xfff;
    let perms = rng.pick(&["r-xp", "rw-p", "r--p", "---p", "rwxs"]);
    let path = rng.pick(&[
        "",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "[heap]",
        "/tmp/a b/with spaces (deleted)",
        "/memfd:jit (deleted)",
    ]);
    let line = format!(
        "{start:x}-{end:x} {perms} {offset:08x} fd:01 {} {:>10}{path}",
        rng.below(1 << 24),
        ""
    );
    (line, start, end, offset)
}

#[test]
fn maps_lines_round_trip_and_garbage_never_panics() {
    check("maps", |rng| {
        let (line, start, end, offset) = maps_line(rng);
        let parsed = parse_maps_line(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        assert_eq!(
            (parsed.start, parsed.end, parsed.offset),
            (start, end, offset)
        );
        if let Ok(parsed) = parse_maps_line(&mutate(rng, &line)) {
            assert!(parsed.start <= parsed.end);
        }
    });
}

fn format_file(rng: &mut Rng) -> (String, Vec<(String, u32, u32)>) {
    let mut fields = Vec::new();
    let mut text = format!(
        "name: ev{}\nID: {}\nformat:\n",
        rng.below(100),
        rng.below(5000)
    );
    text.push_str("\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\n");
    let mut offset = 8;
    for index in 0..=rng.below(8) {
        let (decl, size) = match rng.below(5) {
            0 => ("unsigned long", 8),
            1 => ("const void *", 8),
            2 => ("int", 4),
            3 => ("char comm[16]", 16),
            _ => ("__data_loc char[]", 4),
        };
        let name = format!("f{index}");
        let declaration = if let Some(base) = decl.strip_suffix(" comm[16]") {
            format!("{base} {name}[16]")
        } else {
            format!("{decl} {name}")
        };
        text.push_str(&format!(
            "\tfield:{declaration};\toffset:{offset};\tsize:{size};\tsigned:{};\n",
            rng.below(2)
        ));
        fields.push((name, offset, size));
        offset += size;
    }
    text.push_str("\nprint fmt: \"f0=%lu\", REC->f0\n");
    (text, fields)
}

#[test]
fn format_files_round_trip_and_mutations_never_panic() {
    check("tracefs format", |rng| {
        let (text, fields) = format_file(rng);
        let parsed = format::parse(&text).unwrap_or_else(|e| panic!("{text}\n{e}"));
        for (name, offset, size) in &fields {
            let field = parsed
                .field(name)
                .unwrap_or_else(|| panic!("{name} in {text}"));
            assert_eq!((field.offset, field.size), (*offset, *size), "{text}");
        }
        let _ = format::parse(&mutate(rng, &text));
    });
}

#[test]
fn kallsyms_lookups_find_the_nearest_symbol_below() {
    check("kallsyms", |rng| {
        let mut addresses: Vec<u64> = (0..=rng.below(50))
            .map(|_| 0xffff_ffff_8100_0000 + rng.below(1 << 24) * 16)
            .collect();
        addresses.sort_unstable();
        addresses.dedup();
        let text: String = addresses
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{a:016x} {} sym{i}\n", rng.pick(&["t", "T", "W"])))
            .collect();
        let symbols = KernelSymbols::parse(&text, "").unwrap_or_else(|e| panic!("{e}"));
        let probe = addresses[0] + rng.below(1 << 24) * 16 + rng.below(16);
        let expected = addresses.iter().rposition(|&a| a <= probe);
        let found = symbols.lookup(probe).map(|(s, offset)| (s.address, offset));
        // Without range information a symbol extends at most 1 MiB.
        match expected.filter(|&i| probe - addresses[i] < 1 << 20) {
            Some(i) => assert_eq!(found, Some((addresses[i], probe - addresses[i]))),
            None => assert_eq!(found, None),
        }
        let _ = KernelSymbols::parse(
            &mutate(rng, &text),
            &mutate(rng, "m 4096 0 - Live 0xffffffffc0000000\n"),
        );
    });
}

#[test]
fn command_line_values_round_trip_and_never_panic() {
    check("cli values", |rng| {
        let value = rng.below(100_000) + 1;
        let (unit, seconds) = match rng.below(4) {
            0 => ("ms", value as f64 / 1000.0),
            1 => ("s", value as f64),
            2 => ("m", value as f64 * 60.0),
            _ => ("h", value as f64 * 3600.0),
        };
        let text = format!("{value}{unit}");
        let parsed = parse_duration(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert!(
            (parsed.as_secs_f64() - seconds).abs() < 1e-6 * seconds.max(1.0),
            "{text}"
        );
        let _ = parse_duration(&mutate(rng, &text));

        let (unit, shift) = [("", 0), ("KiB", 10), ("MiB", 20), ("k", 10)][rng.below(4) as usize];
        let text = format!("{value}{unit}");
        assert_eq!(parse_sample_rate(&text), Ok(value << shift), "{text}");
        let _ = parse_sample_rate(&mutate(rng, &text));

        let port = rng.below(65536) as u16;
        let text = format!("127.0.0.{}:{port}", rng.below(256));
        let parsed = parse_listen_address(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(parsed.port(), port, "{text}");
        let _ = parse_listen_address(&mutate(rng, &text));
    });
}

#[test]
fn probe_placement_on_any_bytes_stays_inside_the_function() {
    check("placement", |rng| {
        let len = rng.below(96) as usize;
        let code: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        for arch in [Arch::X86_64, Arch::Aarch64] {
            for return_probe in [false, true] {
                let placed = placement::place(
                    arch,
                    &code,
                    placement::Needs {
                        size: Some(0),
                        ptr: Some(1),
                        ..Default::default()
                    },
                    return_probe,
                );
                assert!(
                    placed.offset == 0 || (placed.offset as usize) < code.len(),
                    "{arch:?}: {placed} for {code:02x?}"
                );
                if arch == Arch::Aarch64 {
                    assert_eq!(placed.offset % 4, 0, "{placed}");
                }
            }
        }
        let mut header = vec![0u8; rng.below(64) as usize];
        header.iter_mut().for_each(|b| *b = rng.next() as u8);
        let _ = Arch::of_elf_header(&header);
    });
}

/// A damaged copy of this process's C library: symbol lookup and probe placement
/// report an error or a result, never panic or read outside the file.
#[test]
fn damaged_c_libraries_are_refused_or_resolved_never_a_panic() {
    let (path, _) = libc::find_in_process(std::process::id()).expect("own libc");
    let original = std::fs::read(&path).expect("reading libc");
    let dir = tempfile::tempdir().expect("tempdir");
    let damaged = dir.path().join("libc.so.6");
    // Each case parses a whole library: fewer cases than the text parsers.
    let cases = (cases() / 10).max(10);
    for case in 0..cases {
        let mut rng = Rng(0x5851_f42d_4c95_7f2d ^ (case + 1).wrapping_mul(0x2545_f491));
        let mut bytes = original.clone();
        // The headers, the section table at the end and the dynamic symbols are what
        // is parsed: damage there most.
        for _ in 0..=rng.below(16) {
            let region = match rng.below(3) {
                0 => 0..4096.min(bytes.len()),
                1 => bytes.len().saturating_sub(8192)..bytes.len(),
                _ => 0..bytes.len(),
            };
            let at = region.start + rng.below((region.end - region.start) as u64) as usize;
            bytes[at] = rng.next() as u8;
        }
        if rng.below(8) == 0 {
            bytes.truncate(rng.below(bytes.len() as u64) as usize);
        }
        std::fs::write(&damaged, &bytes).expect("write");
        let result = std::panic::catch_unwind(|| {
            crate::allocators::scan::scan(&damaged, "damaged libc", false, &[], PlacementMode::Auto)
        });
        assert!(
            result.is_ok(),
            "case {case}: resolving a damaged libc panicked"
        );
    }
}
