//! Tests of the unwind tables: against gimli's own per-address evaluation on this
//! machine's libraries, by hand on small objects compiled here (x86-64 and aarch64),
//! the layout of overlapping FDEs, and damaged ELF files.
//!
//! The hand-checked objects are compiled with `x86_64-linux-gnu-gcc` and
//! `aarch64-linux-gnu-gcc` (the native gcc provides the host's own name, Debian's cross
//! compiler the other); system libraries are found per architecture ([`system_lib`]),
//! and other than the host's C library they are skipped when absent, except under
//! `CI=true` where their absence fails the test.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use gimli::{
    BaseAddresses, DebugFrame, EhFrame, FrameDescriptionEntry, Operation, Register, RegisterRule,
    UnwindContext, UnwindSection, UnwindTableRow,
};
use heapprof_common::unwind::{CfaRule, MAX_OBJECT_ROWS, RULE_NONE, RegRule, UnwindRule};
use object::{Object as _, ObjectSection as _, ObjectSegment as _, ObjectSymbol as _};

use super::{
    Arch, BuildStats, UnwindError, UnwindTable, build, build_with_stats,
    cfi::Slice,
    table::{Builder, FdeRow},
};

const PYTHON: &str = "/usr/bin/python3.11";
const LIBLLVM: &str = "libLLVM-15.so.1";
/// Debian 12's x86-64 libgcrypt 1.10.1, whose hand-written assembly has CFI gimli rejects.
const LIBGCRYPT: &str = "libgcrypt.so.20.4.1";
const LIBC: &str = "libc.so.6";
const LIBSTDCXX: &str = "libstdc++.so.6";
const X86_LOADER: &str = "ld-linux-x86-64.so.2";
const ARM64_LOADER: &str = "ld-linux-aarch64.so.1";
/// The compilers of the hand-checked objects, by their multiarch names: on each host
/// one is the native gcc, the other Debian's cross compiler.
const X86_CC: &str = "x86_64-linux-gnu-gcc";
const ARM64_CC: &str = "aarch64-linux-gnu-gcc";

/// The architecture these tests run on.
fn host_arch() -> Arch {
    if cfg!(target_arch = "aarch64") {
        Arch::Aarch64
    } else {
        Arch::X86_64
    }
}

/// Debian's multiarch triplet of `arch`.
fn triplet(arch: Arch) -> &'static str {
    match arch {
        Arch::X86_64 => "x86_64-linux-gnu",
        Arch::Aarch64 => "aarch64-linux-gnu",
    }
}

/// Where the library `name` of `arch` is on a Debian machine: the host's own in its
/// multiarch directory (`/usr/lib/TRIPLET`), another architecture's in its cross
/// toolchain (`/usr/TRIPLET/lib`: libc6-ARCH-cross, libstdc++6-ARCH-cross, installed with
/// the cross gcc and g++ by `cargo xtask setup`).
fn system_lib(arch: Arch, name: &str) -> PathBuf {
    if arch == host_arch() {
        Path::new("/usr/lib").join(triplet(arch)).join(name)
    } else {
        Path::new("/usr").join(triplet(arch)).join("lib").join(name)
    }
}

/// The C library this test process runs with, from its own mappings: always present,
/// whatever the architecture or the distribution's layout.
fn own_libc() -> PathBuf {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("own mappings");
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.rsplit('/').next() == Some(LIBC))
        .map(PathBuf::from)
        .expect("this test process maps a libc.so.6")
}

// ---------------------------------------------------------------------------------
// Helpers

/// A rule from its parts.
fn rule(cfa: CfaRule, cfa_offset: i32, fp: (RegRule, i32), ra: (RegRule, i32)) -> UnwindRule {
    UnwindRule {
        cfa: cfa as u8,
        fp: fp.0 as u8,
        ra: ra.0 as u8,
        _pad: 0,
        cfa_offset,
        fp_offset: fp.1,
        ra_offset: ra.1,
    }
}

/// x86-64: CFA = rsp + `offset`, the return address below it, rbp as given.
fn x86_sp(offset: i32, fp: (RegRule, i32)) -> UnwindRule {
    rule(CfaRule::SpOffset, offset, fp, (RegRule::AtCfa, -8))
}

const SAME: (RegRule, i32) = (RegRule::Same, 0);

fn end_rule() -> UnwindRule {
    rule(CfaRule::End, 0, SAME, SAME)
}

fn unsupported_rule() -> UnwindRule {
    rule(CfaRule::Unsupported, 0, SAME, SAME)
}

/// A system object's bytes; `None` (with a note) when it is not installed, except under
/// `CI=true`, where a missing object fails the test rather than skipping it.
fn system_object(path: &Path) -> Option<Vec<u8>> {
    match std::fs::read(path) {
        Ok(bytes) => Some(bytes),
        Err(e) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("{}: {e} (required in CI)", path.display())
        }
        Err(e) => {
            eprintln!("skipping {}: {e}", path.display());
            None
        }
    }
}

/// Runs a compiler; panics with its output on failure.
fn run(program: &str, args: &[&str], dir: &Path) {
    let output = Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("running {program} (needed by this test): {e}"));
    assert!(
        output.status.success(),
        "{program} {args:?} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Writes `files` into a new temporary directory, runs `program args` there and returns
/// the directory (kept alive by the caller) and the bytes of `output`.
fn compile(
    program: &str,
    files: &[(&str, &str)],
    args: &[&str],
    output: &str,
) -> (tempfile::TempDir, Vec<u8>) {
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).expect("write source");
    }
    run(program, args, dir.path());
    let bytes = std::fs::read(dir.path().join(output)).expect("compiler output");
    (dir, bytes)
}

/// The address of symbol `name` (from `.symtab`, else the dynamic symbols).
fn symbol(elf: &[u8], name: &str) -> u64 {
    let file = object::File::parse(elf).expect("parse ELF");
    file.symbols()
        .chain(file.dynamic_symbols())
        .find(|s| s.name() == Ok(name))
        .unwrap_or_else(|| panic!("no symbol {name}"))
        .address()
}

/// The code bytes of function `name`, with its address.
fn function_code(elf: &[u8], name: &str) -> (u64, Vec<u8>) {
    let file = object::File::parse(elf).expect("parse ELF");
    let sym = file
        .symbols()
        .find(|s| s.name() == Ok(name))
        .unwrap_or_else(|| panic!("no symbol {name}"));
    let section = file.section_by_name(".text").expect("a .text section");
    let code = section
        .data_range(sym.address(), sym.size())
        .expect("in .text")
        .expect("in .text");
    (sym.address(), code.to_vec())
}

/// The address of section `name`.
fn section_address(elf: &[u8], name: &str) -> u64 {
    let file = object::File::parse(elf).expect("parse ELF");
    file.section_by_name(name)
        .unwrap_or_else(|| panic!("no section {name}"))
        .address()
}

/// Everything the BPF side and `rule_at` rely on.
fn check_invariants(table: &UnwindTable) {
    let rows = &table.rows;
    assert!(!rows.is_empty(), "a table has rows");
    assert!(rows.len() <= MAX_OBJECT_ROWS as usize);
    assert_eq!(
        rows.last().map(|r| r.rule),
        Some(RULE_NONE),
        "ends with a gap row"
    );
    for pair in rows.windows(2) {
        assert!(pair[0].pc < pair[1].pc, "rows sorted: {pair:?}");
        assert_ne!(pair[0].rule, pair[1].rule, "rows merged: {pair:?}");
    }
    let mut used = vec![false; table.rules.len()];
    for row in rows {
        if row.rule != RULE_NONE {
            let used = used
                .get_mut(row.rule as usize)
                .unwrap_or_else(|| panic!("rule index out of range: {row:?}"));
            *used = true;
        }
    }
    assert!(used.iter().all(|&u| u), "every rule is used by a row");
    let distinct: HashSet<_> = table.rules.iter().collect();
    assert_eq!(distinct.len(), table.rules.len(), "rules deduplicated");
    for r in &table.rules {
        assert_eq!(r._pad, 0);
        let cfa = CfaRule::from_u8(r.cfa).expect("a CFA rule");
        let fp = RegRule::from_u8(r.fp).expect("an FP rule");
        let ra = RegRule::from_u8(r.ra).expect("an RA rule");
        match cfa {
            CfaRule::End | CfaRule::Unsupported => {
                assert_eq!(*r, rule(cfa, 0, SAME, SAME), "canonical {cfa:?}")
            }
            CfaRule::PltX86 => {
                assert_eq!(table.arch, Arch::X86_64);
                assert_eq!(r.cfa_offset, 0);
            }
            CfaRule::SpOffset | CfaRule::FpOffset => {}
        }
        if fp != RegRule::AtCfa {
            assert_eq!(r.fp_offset, 0, "unused offsets are 0: {r:?}");
        }
        if ra != RegRule::AtCfa {
            assert_eq!(r.ra_offset, 0, "unused offsets are 0: {r:?}");
        }
        if table.arch == Arch::X86_64 && !matches!(cfa, CfaRule::End | CfaRule::Unsupported) {
            assert_eq!((ra, r.ra_offset), (RegRule::AtCfa, -8), "{r:?}");
        }
    }
}

// ---------------------------------------------------------------------------------
// The reference: gimli's own per-address evaluation

/// Which section an FDE of the reference came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Which {
    EhFrame,
    DebugFrame,
}

struct RefFde<'a> {
    start: u64,
    end: u64,
    /// Lower wins: `.eh_frame` before `.debug_frame`, then section order.
    priority: usize,
    which: Which,
    fde: FrameDescriptionEntry<Slice<'a>>,
}

/// An independent lookup of an address's rule: gimli's entry iterator lists the FDEs,
/// the first one (by the builder's priority) containing the address is evaluated from
/// scratch with a fresh context (`unwind_info_for_address`), and its row is converted
/// by [`expected_rule`], not by the production `cfi::convert`.
struct Reference<'a> {
    arch: Arch,
    eh_frame: EhFrame<Slice<'a>>,
    debug_frame: DebugFrame<Slice<'a>>,
    bases: BaseAddresses,
    /// Sorted by start.
    fdes: Vec<RefFde<'a>>,
    /// `max_end[i]`: the largest end of `fdes[..=i]`.
    max_end: Vec<u64>,
    /// Entries gimli's iterator could not parse.
    errors: usize,
}

impl<'a> Reference<'a> {
    fn new(elf: &'a [u8]) -> Reference<'a> {
        let file = object::File::parse(elf).expect("parse ELF");
        let arch = match file.architecture() {
            object::Architecture::X86_64 => Arch::X86_64,
            object::Architecture::Aarch64 => Arch::Aarch64,
            other => panic!("unexpected architecture {other:?}"),
        };
        let vendor = match arch {
            Arch::X86_64 => gimli::Vendor::Default,
            Arch::Aarch64 => gimli::Vendor::AArch64,
        };
        let section = |name: &str| {
            file.section_by_name(name)
                .map(|s| (s.data().expect("section data"), s.address()))
        };
        let (eh_data, eh_address) = section(".eh_frame").unwrap_or((&[], 0));
        let debug_data = section(".debug_frame").map_or(&[][..], |(d, _)| d);
        let mut bases = BaseAddresses::default().set_eh_frame(eh_address);
        if let Some((_, text)) = section(".text") {
            bases = bases.set_text(text);
        }
        if let Some((_, got)) = section(".got") {
            bases = bases.set_got(got);
        }
        let mut eh_frame = EhFrame::new(eh_data, gimli::LittleEndian);
        eh_frame.set_address_size(8);
        eh_frame.set_vendor(vendor);
        let mut debug_frame = DebugFrame::new(debug_data, gimli::LittleEndian);
        debug_frame.set_address_size(8);
        debug_frame.set_vendor(vendor);
        let code: Vec<(u64, u64)> = file
            .segments()
            .filter(|s| {
                matches!(s.flags(), object::SegmentFlags::Elf { p_flags, .. }
                    if p_flags.contains(object::elf::PF_X))
            })
            .map(|s| (s.address(), s.address() + s.size()))
            .collect();
        let in_code = |start: u64, end: u64| code.iter().any(|&(s, e)| s <= start && end <= e);

        let mut reference = Reference {
            arch,
            eh_frame,
            debug_frame,
            bases,
            fdes: Vec::new(),
            max_end: Vec::new(),
            errors: 0,
        };
        let mut fdes = Vec::new();
        let mut errors = 0;
        collect_fdes(
            &reference.eh_frame,
            &reference.bases,
            Which::EhFrame,
            &mut fdes,
            &mut errors,
        );
        collect_fdes(
            &reference.debug_frame,
            &reference.bases,
            Which::DebugFrame,
            &mut fdes,
            &mut errors,
        );
        fdes.retain(|f| f.start < f.end && in_code(f.start, f.end));
        fdes.sort_by_key(|f| (f.start, f.priority));
        let mut max_end = 0;
        reference.max_end = fdes
            .iter()
            .map(|f| {
                max_end = max_end.max(f.end);
                max_end
            })
            .collect();
        reference.fdes = fdes;
        reference.errors = errors;
        reference
    }

    /// The rule of `pc`, as gimli evaluates it.
    fn rule_at(&self, pc: u64) -> Option<UnwindRule> {
        let after = self.fdes.partition_point(|f| f.start <= pc);
        let mut candidates: Vec<&RefFde> = Vec::new();
        for i in (0..after).rev() {
            if self.max_end[i] <= pc {
                break;
            }
            if self.fdes[i].end > pc {
                candidates.push(&self.fdes[i]);
            }
        }
        candidates.sort_by_key(|f| f.priority);
        for candidate in candidates {
            let mut ctx = UnwindContext::new();
            let ra_column = candidate.fde.cie().return_address_register();
            let row = match candidate.which {
                Which::EhFrame => candidate
                    .fde
                    .unwind_info_for_address(&self.eh_frame, &self.bases, &mut ctx, pc)
                    .map(|row| expected_rule(self.arch, ra_column, row, &self.eh_frame)),
                Which::DebugFrame => candidate
                    .fde
                    .unwind_info_for_address(&self.debug_frame, &self.bases, &mut ctx, pc)
                    .map(|row| expected_rule(self.arch, ra_column, row, &self.debug_frame)),
            };
            match row {
                Ok(rule) => return Some(rule),
                Err(gimli::Error::NoUnwindInfoForAddress) => return None,
                // The builder drops FDEs it cannot evaluate: look further.
                Err(_) => continue,
            }
        }
        None
    }
}

// ---------------------------------------------------------------------------------
// The reference's conversion of gimli's rows, written apart from `cfi::convert` from
// the DWARF rules and what the BPF unwinder can follow (heapprof_common::unwind), so
// that a mistake in the production conversion shows as a difference.

/// The DWARF numbers of the stack pointer, the frame pointer and the return-address
/// column in each psABI: x86-64 rsp 7, rbp 6, column 16 (the return address, not a
/// real register); AArch64 sp 31, x29 29, the link register x30.
fn psabi_registers(arch: Arch) -> (Register, Register, Register) {
    match arch {
        Arch::X86_64 => (Register(7), Register(6), Register(16)),
        Arch::Aarch64 => (Register(31), Register(29), Register(30)),
    }
}

/// A rule whose CFA is `cfa` and whose registers are unchanged, offsets 0: what rows
/// ending the stack and rows the unwinder cannot follow all become.
fn bare_rule(cfa: CfaRule) -> UnwindRule {
    UnwindRule {
        cfa: cfa as u8,
        ..UnwindRule::default()
    }
}

/// The threshold of a CFA expression when it is the lazy x86-64 PLT one, read as
/// operations: `rsp + 8`, `rip + 0`, `15`, and, `T`, ge, `3`, shl, plus, i.e.
/// CFA = rsp + 8 + ((rip & 15) >= T) * 8.
fn plt_expression_threshold<'a, S: UnwindSection<Slice<'a>>>(
    expression: &gimli::UnwindExpression<usize>,
    section: &S,
) -> Option<u64> {
    let encoding = gimli::Encoding {
        format: gimli::Format::Dwarf32,
        version: 4,
        address_size: 8,
    };
    let mut operations = expression.get(section).ok()?.operations(encoding);
    let mut parsed = Vec::new();
    while let Some(operation) = operations.next().ok()? {
        parsed.push(operation);
    }
    let register_plus = |operation: &Operation<Slice<'a>>, number: u16, wanted: i64| {
        matches!(operation, Operation::RegisterOffset { register, offset, .. }
            if register.0 == number && *offset == wanted)
    };
    let constant = |operation: &Operation<Slice<'a>>| match operation {
        Operation::UnsignedConstant { value } => Some(*value),
        _ => None,
    };
    let [rsp, rip, mask, and, threshold, ge, three, shl, plus] = parsed.as_slice() else {
        return None;
    };
    let shape = register_plus(rsp, 7, 8)
        && register_plus(rip, 16, 0)
        && constant(mask) == Some(15)
        && matches!(and, Operation::And)
        && matches!(ge, Operation::Ge)
        && constant(three) == Some(3)
        && matches!(shl, Operation::Shl)
        && matches!(plus, Operation::Plus);
    shape.then(|| constant(threshold)).flatten()
}

/// What gimli's `row` (of an FDE whose CIE names `ra_column`) should become in the
/// table, from the meaning of each DWARF rule:
/// - the return address is only looked for in the psABI's column; an undefined return
///   address means there is no caller (the outermost frame), whatever the CFA;
/// - the CFA can be based on the stack or the frame pointer with a 32-bit offset, or be
///   x86-64's PLT expression with the threshold of a 16-byte entry (11);
/// - x86-64's return address is where `call` put it, at CFA - 8, and nowhere else;
///   aarch64's is saved at CFA + n, or still in x30 (no rule, or same value);
/// - the frame pointer is unchanged (no rule, same value), saved at CFA + n, or lost
///   for the frames above (any other rule, or an offset beyond 32 bits).
fn expected_rule<'a, S: UnwindSection<Slice<'a>>>(
    arch: Arch,
    ra_column: Register,
    row: &UnwindTableRow<usize>,
    section: &S,
) -> UnwindRule {
    let unsupported = bare_rule(CfaRule::Unsupported);
    let (sp, fp, ra) = psabi_registers(arch);
    if ra_column != ra {
        return unsupported;
    }
    let return_address = row.register(ra);
    if return_address == Some(RegisterRule::Undefined) {
        return bare_rule(CfaRule::End);
    }
    let (cfa, cfa_offset) = match row.cfa() {
        gimli::CfaRule::RegisterAndOffset { register, offset } => {
            let base = if *register == sp {
                CfaRule::SpOffset
            } else if *register == fp {
                CfaRule::FpOffset
            } else {
                return unsupported;
            };
            match i32::try_from(*offset) {
                Ok(offset) => (base, offset),
                Err(_) => return unsupported,
            }
        }
        gimli::CfaRule::Expression(expression) => {
            match (arch, plt_expression_threshold(expression, section)) {
                (Arch::X86_64, Some(11)) => (CfaRule::PltX86, 0),
                _ => return unsupported,
            }
        }
    };
    let (ra_rule, ra_offset) = match (arch, return_address) {
        (Arch::X86_64, Some(RegisterRule::Offset(-8))) => (RegRule::AtCfa, -8),
        (Arch::Aarch64, None | Some(RegisterRule::SameValue)) => (RegRule::Same, 0),
        (Arch::Aarch64, Some(RegisterRule::Offset(offset))) => match i32::try_from(offset) {
            Ok(offset) => (RegRule::AtCfa, offset),
            Err(_) => return unsupported,
        },
        _ => return unsupported,
    };
    let (fp_rule, fp_offset) = match row.register(fp) {
        None | Some(RegisterRule::SameValue) => (RegRule::Same, 0),
        Some(RegisterRule::Offset(offset)) => {
            i32::try_from(offset).map_or((RegRule::Undefined, 0), |offset| (RegRule::AtCfa, offset))
        }
        Some(_) => (RegRule::Undefined, 0),
    };
    UnwindRule {
        cfa: cfa as u8,
        fp: fp_rule as u8,
        ra: ra_rule as u8,
        _pad: 0,
        cfa_offset,
        fp_offset,
        ra_offset,
    }
}

/// Appends the FDEs of `section` (gimli's entry iterator, in section order).
fn collect_fdes<'a, S: UnwindSection<Slice<'a>>>(
    section: &S,
    bases: &BaseAddresses,
    which: Which,
    out: &mut Vec<RefFde<'a>>,
    errors: &mut usize,
) {
    let mut entries = section.entries(bases);
    loop {
        match entries.next() {
            Ok(None) => break,
            Ok(Some(gimli::CieOrFde::Cie(_))) => {}
            Ok(Some(gimli::CieOrFde::Fde(partial))) => match partial.parse(S::cie_from_offset) {
                Ok(fde) => out.push(RefFde {
                    start: fde.initial_address(),
                    end: fde.initial_address().saturating_add(fde.len()),
                    priority: out.len(),
                    which,
                    fde,
                }),
                Err(_) => *errors += 1,
            },
            Err(_) => {
                *errors += 1;
                break;
            }
        }
    }
}

/// Compares `table.rule_at` with the reference at every FDE's start, middle, last byte
/// and end, at every row's address and the byte before it, and at `strided` addresses
/// spread over the covered range. Returns the number of addresses compared.
fn compare_with_gimli(elf: &[u8], table: &UnwindTable, strided: u64) -> usize {
    let reference = Reference::new(elf);
    assert_eq!(reference.errors, 0, "gimli parses every entry");
    assert!(!reference.fdes.is_empty());
    let mut pcs: Vec<u64> = Vec::new();
    for f in &reference.fdes {
        pcs.extend([f.start, f.start + (f.end - f.start) / 2, f.end - 1, f.end]);
    }
    for row in &table.rows {
        pcs.extend([u64::from(row.pc), u64::from(row.pc).saturating_sub(1)]);
    }
    let low = reference
        .fdes
        .first()
        .map_or(0, |f| f.start)
        .saturating_sub(64);
    let high = reference.max_end.last().copied().unwrap_or(0) + 64;
    let stride = ((high - low) / strided).max(1) | 1;
    pcs.extend((low..high).step_by(stride as usize));
    pcs.extend([0, 1, u64::from(u32::MAX), 1 << 40]);
    pcs.sort_unstable();
    pcs.dedup();

    let mut mismatches = Vec::new();
    let mut covered = 0;
    for &pc in &pcs {
        let expected = reference.rule_at(pc);
        let got = table.rule_at(pc).copied();
        covered += usize::from(expected.is_some());
        if expected != got {
            mismatches.push(format!("{pc:#x}: table {got:?}, gimli {expected:?}"));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} addresses differ, e.g.:\n{}",
        mismatches.len(),
        pcs.len(),
        mismatches[..mismatches.len().min(20)].join("\n")
    );
    assert!(
        covered >= reference.fdes.len(),
        "every FDE's addresses have rules"
    );
    pcs.len()
}

/// Builds `path`'s table, checks it and compares it with gimli; `bad_entries` FDEs
/// are expected to fail evaluation.
fn check_system_object(path: &Path, arch: Arch, bad_entries: usize) {
    let Some(elf) = system_object(path) else {
        return;
    };
    let (table, stats) = build_with_stats(&elf).expect("builds");
    assert_eq!(table.arch, arch);
    check_invariants(&table);
    assert_eq!(stats.bad_entries, bad_entries, "{stats:?}");
    assert!(!stats.truncated, "{stats:?}");
    let compared = compare_with_gimli(&elf, &table, 4000);
    eprintln!(
        "{}: {} rows, {} rules, {compared} addresses agree with gimli; {stats:?}",
        path.display(),
        table.rows.len(),
        table.rules.len()
    );
}

// ---------------------------------------------------------------------------------
// Real objects against gimli

#[test]
fn x86_64_libc_matches_gimli() {
    check_system_object(&system_lib(Arch::X86_64, LIBC), Arch::X86_64, 0);
}

#[test]
fn x86_64_libstdcxx_matches_gimli() {
    check_system_object(&system_lib(Arch::X86_64, LIBSTDCXX), Arch::X86_64, 0);
}

#[test]
fn python_matches_gimli() {
    check_system_object(Path::new(PYTHON), host_arch(), 0);
}

#[test]
fn aarch64_libc_matches_gimli() {
    check_system_object(&system_lib(Arch::Aarch64, LIBC), Arch::Aarch64, 0);
}

#[test]
fn aarch64_libstdcxx_matches_gimli() {
    check_system_object(&system_lib(Arch::Aarch64, LIBSTDCXX), Arch::Aarch64, 0);
}

/// glibc's x86-64 loader enters through `_start` and `_dl_start_user` (hand-written,
/// no CFI), which call `_dl_init`: the stacks of library constructors end there, and
/// the table says so rather than leaving a gap. The arm64 loader's entry code has CFI
/// of its own (the return address undefined), which is left alone.
#[test]
fn the_loaders_entry_code_ends_the_stack() {
    let entry_of = |elf: &[u8]| object::read::File::parse(elf).expect("parses").entry();
    let x86_loader = system_lib(Arch::X86_64, X86_LOADER);
    if let Some(elf) = system_object(&x86_loader) {
        let (table, stats) = build_with_stats(&elf).expect("builds");
        check_invariants(&table);
        let entry = entry_of(&elf);
        // Its start, and the return address of `_dl_start_user`'s call of `_dl_init`.
        for address in [entry, entry + 0x30] {
            let rule = table.rule_at(address).expect("a rule at the entry code");
            assert_eq!(
                rule.cfa,
                CfaRule::End as u8,
                "{} at {address:#x}: {rule:?}; {stats:?}",
                x86_loader.display()
            );
        }
        assert!(stats.start_code, "{stats:?}");
        // Only the code no FDE describes: the function after keeps its rules.
        let next = table
            .rows
            .iter()
            .find(|row| u64::from(row.pc) > entry && row.rule != RULE_NONE)
            .expect("code after the entry");
        let rule = &table.rules[next.rule as usize];
        assert_ne!(rule.cfa, CfaRule::End as u8, "{next:?}");
    }
    if let Some(elf) = system_object(&system_lib(Arch::Aarch64, ARM64_LOADER)) {
        let (table, stats) = build_with_stats(&elf).expect("builds");
        assert_eq!(table.arch, Arch::Aarch64);
        assert!(!stats.start_code, "{stats:?}");
        let entry = entry_of(&elf);
        assert!(table.rule_at(entry).is_some(), "its own CFI: {stats:?}");
    }
}

/// Two FDEs of libgcrypt's hand-written assembly fail evaluation part-way
/// (`def_cfa_register` after a CFA expression, e.g. 0xcb480..0xccad1 fails at 0xccac5,
/// in the epilogue): their rows up to there are kept, as gimli's per-address lookup
/// finds them, and the rest is a gap (the comparison samples every FDE's last byte).
#[test]
fn libgcrypt_partly_evaluated_fdes_match_gimli() {
    // A property of Debian's x86-64 build, which only an x86-64 host has.
    if host_arch() != Arch::X86_64 {
        eprintln!("skipping: {LIBGCRYPT} is checked on x86-64 hosts");
        return;
    }
    check_system_object(&system_lib(Arch::X86_64, LIBGCRYPT), Arch::X86_64, 2);
}

/// The x86-64 PLT rules, on the host's own C library (the cross toolchain's may be
/// linked with other PLT options).
#[test]
fn libc_plt_and_gaps() {
    if host_arch() != Arch::X86_64 {
        eprintln!("skipping: the x86-64 PLT is checked on x86-64 hosts");
        return;
    }
    let elf = std::fs::read(own_libc()).expect("libc");
    let table = build(&elf).expect("builds");
    let plt = section_address(&elf, ".plt");
    // PLT0 pushes the link map (CFA rsp+16), then jumps (rsp+24); the entries use the
    // expression.
    assert_eq!(table.rule_at(plt), Some(&x86_sp(16, SAME)));
    assert_eq!(table.rule_at(plt + 6), Some(&x86_sp(24, SAME)));
    let plt_rule = rule(CfaRule::PltX86, 0, SAME, (RegRule::AtCfa, -8));
    for at in [16, 16 + 10, 16 + 11, 16 + 15, 32] {
        assert_eq!(table.rule_at(plt + at), Some(&plt_rule), "plt+{at}");
    }
    // Before the first row, and far beyond the code.
    assert_eq!(table.rule_at(0), None);
    assert_eq!(table.rule_at(u64::from(u32::MAX)), None);
    assert_eq!(table.rule_at(1 << 40), None);
    // `malloc` starts with the CIE's rule: CFA rsp+8.
    assert_eq!(
        table.rule_at(symbol(&elf, "malloc")),
        Some(&x86_sp(8, SAME))
    );
}

// ---------------------------------------------------------------------------------
// x86-64 by hand

/// A C function whose prologue pushes callee-saved registers, rbp among them, then
/// makes room for a local array.
const PUSHES_C: &str = r#"
extern long ext(long);
extern void fill(long *);
long pushes(long a, long b, long c, long d) {
    long buf[6];
    fill(buf);
    long x = ext(a);
    long y = ext(b + x);
    long z = ext(c * y);
    long w = ext(d ^ z);
    return a + b + c + d + x + y + z + w + buf[0] + buf[5];
}
long leaf(long a, long b) { return a * b + (a >> 3); }
int main(void) { return (int)pushes(1, 2, 3, 4); }
"#;

/// What `PUSHES_C` calls, for executables.
const EXT_C: &str = r#"
long ext(long x) { return x + 1; }
void fill(long *buf) { for (int i = 0; i < 6; i++) buf[i] = i; }
"#;

#[test]
fn x86_prologue_matches_a_hand_simulation() {
    use iced_x86::{Code, Decoder, DecoderOptions, FlowControl, OpKind, Register};
    let (_dir, elf) = compile(
        X86_CC,
        &[("p.c", PUSHES_C)],
        &[
            "-O2",
            "-fomit-frame-pointer",
            "-shared",
            "-fPIC",
            "-o",
            "p.so",
            "p.c",
        ],
        "p.so",
    );
    let table = build(&elf).expect("builds");
    check_invariants(&table);
    compare_with_gimli(&elf, &table, 2000);

    let (address, code) = function_code(&elf, "pushes");
    let mut decoder = Decoder::with_ip(64, &code, address, DecoderOptions::NONE);
    // Bytes between the return address and rsp, and where rbp was saved (from the CFA).
    let mut depth: i32 = 0;
    let mut fp = SAME;
    let (mut pushes, mut checked) = (0, 0);
    while decoder.can_decode() {
        let insn = decoder.decode();
        assert_eq!(
            table.rule_at(insn.ip()),
            Some(&x86_sp(8 + depth, fp)),
            "before {insn:?} at {:#x}",
            insn.ip()
        );
        checked += 1;
        if insn.flow_control() != FlowControl::Next {
            break;
        }
        match insn.code() {
            Code::Push_r64 => {
                depth += 8;
                pushes += 1;
                if insn.op0_register() == Register::RBP {
                    fp = (RegRule::AtCfa, -(8 + depth));
                }
            }
            Code::Sub_rm64_imm8 | Code::Sub_rm64_imm32
                if insn.op0_register() == Register::RSP && insn.op1_kind() != OpKind::Register =>
            {
                depth += insn.immediate(1) as i32;
            }
            _ => assert_ne!(insn.op0_register(), Register::RSP, "{insn:?}: unexpected"),
        }
    }
    assert!(
        pushes >= 4 && fp.0 == RegRule::AtCfa,
        "a prologue worth checking: {pushes} pushes"
    );
    assert!(checked > pushes);

    // A leaf function never moves rsp.
    let (address, code) = function_code(&elf, "leaf");
    for pc in address..address + code.len() as u64 {
        assert_eq!(
            table.rule_at(pc),
            Some(&x86_sp(8, SAME)),
            "leaf+{}",
            pc - address
        );
    }

    // The lazy PLT: PLT0 then entries, the entries by the expression.
    let plt = section_address(&elf, ".plt");
    assert_eq!(table.rule_at(plt), Some(&x86_sp(16, SAME)));
    assert_eq!(table.rule_at(plt + 6), Some(&x86_sp(24, SAME)));
    let plt_rule = rule(CfaRule::PltX86, 0, SAME, (RegRule::AtCfa, -8));
    assert_eq!(table.rule_at(plt + 16), Some(&plt_rule));
    assert_eq!(table.rule_at(plt + 16 + 11), Some(&plt_rule));
}

#[test]
fn x86_start_ends_the_stack() {
    let (_dir, elf) = compile(
        X86_CC,
        &[("p.c", PUSHES_C), ("ext.c", EXT_C)],
        &["-O2", "-o", "p", "p.c", "ext.c"],
        "p",
    );
    let table = build(&elf).expect("builds");
    check_invariants(&table);
    let start = symbol(&elf, "_start");
    assert_eq!(table.rule_at(start), Some(&end_rule()));
    assert_eq!(table.rule_at(start + 4), Some(&end_rule()));
    compare_with_gimli(&elf, &table, 2000);
}

/// Hand-written CFI, one function per case (labels mark the addresses checked).
const HAND_X86_S: &str = r#"
    .text
    .p2align 4
    .globl hc_fp
    .type hc_fp, @function
hc_fp:
    .cfi_startproc
    pushq %rbp
hc_fp_pushed:
    .cfi_def_cfa_offset 16
    .cfi_offset %rbp, -16
    movq %rsp, %rbp
hc_fp_framed:
    .cfi_def_cfa_register %rbp
    nop
    popq %rbp
hc_fp_popped:
    .cfi_def_cfa %rsp, 8
    .cfi_restore %rbp
    ret
    .cfi_endproc
    .size hc_fp, .-hc_fp

    .p2align 4
    .globl hc_nocfi
    .type hc_nocfi, @function
hc_nocfi:
    nop
    nop
hc_nocfi_end:
    ret
    .size hc_nocfi, .-hc_nocfi

    .p2align 4
hc_r12:
    .cfi_startproc
    movq %rsp, %r12
hc_r12_based:
    .cfi_def_cfa_register %r12
    nop
hc_r12_back:
    .cfi_def_cfa_register %rsp
    ret
    .cfi_endproc

    .p2align 4
hc_end:
    .cfi_startproc
    .cfi_undefined %rip
    xorl %ebp, %ebp
    ret
    .cfi_endproc

    .p2align 4
hc_ra_reg:
    .cfi_startproc
    .cfi_register %rip, %rax
    ret
    .cfi_endproc

    .p2align 4
hc_fp_lost:
    .cfi_startproc
    .cfi_undefined %rbp
    nop
hc_fp_in_reg:
    .cfi_register %rbp, %rax
    ret
    .cfi_endproc

    .p2align 4
hc_realign:
    .cfi_startproc
    .cfi_escape 0x0f,0x03,0x76,0x78,0x06
    ret
    .cfi_endproc

    .p2align 4
hc_plt11:
    .cfi_startproc
    .cfi_escape 0x0f,0x0b,0x77,0x08,0x80,0x00,0x3f,0x1a,0x3b,0x2a,0x33,0x24,0x22
    ret
    .cfi_endproc

    .p2align 4
hc_plt9:
    .cfi_startproc
    .cfi_escape 0x0f,0x0b,0x77,0x08,0x80,0x00,0x3f,0x1a,0x39,0x2a,0x33,0x24,0x22
    ret
    .cfi_endproc

    .p2align 4
hc_huge:
    .cfi_startproc
    .cfi_def_cfa_offset 0x100000000
    ret
    .cfi_endproc

    .p2align 4
hc_same_a:
    .cfi_startproc
    ret
    .cfi_endproc
hc_same_b:
    .cfi_startproc
    ret
    .cfi_endproc
"#;

/// A function whose CFI is only in `.debug_frame`.
const DEBUG_ONLY_X86_S: &str = r#"
    .cfi_sections .debug_frame
    .text
    .p2align 4
    .globl hc_dbg
    .type hc_dbg, @function
hc_dbg:
    .cfi_startproc
    pushq %rbx
hc_dbg_pushed:
    .cfi_def_cfa_offset 16
    .cfi_offset %rbx, -16
    popq %rbx
hc_dbg_popped:
    .cfi_def_cfa_offset 8
    ret
    .cfi_endproc
    .size hc_dbg, .-hc_dbg

    # More of the same, so that compressing .debug_frame pays (ld keeps a section
    # uncompressed when compressing would not shrink it).
    .rept 64
    .p2align 4
    .cfi_startproc
    pushq %rbx
    .cfi_def_cfa_offset 16
    .cfi_offset %rbx, -16
    popq %rbx
    .cfi_def_cfa_offset 8
    ret
    .cfi_endproc
    .endr
"#;

fn hand_x86(extra: &[&str]) -> (tempfile::TempDir, Vec<u8>) {
    let mut args = vec!["-shared", "-nostdlib", "-o", "hc.so", "hc.s", "dbg.s"];
    args.extend_from_slice(extra);
    compile(
        X86_CC,
        &[("hc.s", HAND_X86_S), ("dbg.s", DEBUG_ONLY_X86_S)],
        &args,
        "hc.so",
    )
}

#[test]
fn x86_hand_written_cfi() {
    let (_dir, elf) = hand_x86(&[]);
    let (table, stats) = build_with_stats(&elf).expect("builds");
    check_invariants(&table);
    let at = |name: &str| table.rule_at(symbol(&elf, name)).copied();
    let fp_saved = (RegRule::AtCfa, -16);

    assert_eq!(at("hc_fp"), Some(x86_sp(8, SAME)));
    assert_eq!(at("hc_fp_pushed"), Some(x86_sp(16, fp_saved)));
    assert_eq!(
        at("hc_fp_framed"),
        Some(rule(CfaRule::FpOffset, 16, fp_saved, (RegRule::AtCfa, -8)))
    );
    assert_eq!(at("hc_fp_popped"), Some(x86_sp(8, SAME)));

    // No CFI: a gap, between FDEs.
    assert_eq!(at("hc_nocfi"), None);
    assert_eq!(at("hc_nocfi_end"), None);

    assert_eq!(at("hc_r12"), Some(x86_sp(8, SAME)));
    assert_eq!(at("hc_r12_based"), Some(unsupported_rule()));
    assert_eq!(at("hc_r12_back"), Some(x86_sp(8, SAME)));

    assert_eq!(at("hc_end"), Some(end_rule()));
    assert_eq!(at("hc_ra_reg"), Some(unsupported_rule()));

    let lost = (RegRule::Undefined, 0);
    assert_eq!(at("hc_fp_lost"), Some(x86_sp(8, lost)));
    assert_eq!(at("hc_fp_in_reg"), Some(x86_sp(8, lost)));

    assert_eq!(at("hc_realign"), Some(unsupported_rule()));
    assert_eq!(
        at("hc_plt11"),
        Some(rule(CfaRule::PltX86, 0, SAME, (RegRule::AtCfa, -8)))
    );
    assert_eq!(at("hc_plt9"), Some(unsupported_rule()));
    assert_eq!(at("hc_huge"), Some(unsupported_rule()));

    // Two adjacent FDEs with one rule: one row.
    let a = symbol(&elf, "hc_same_a");
    let b = symbol(&elf, "hc_same_b");
    assert_eq!(b, a + 1);
    assert!(table.rows.iter().any(|r| u64::from(r.pc) == a));
    assert!(!table.rows.iter().any(|r| u64::from(r.pc) == b));
    assert_eq!(table.rule_at(b), Some(&x86_sp(8, SAME)));
    assert_eq!(table.rule_at(b + 1), None);

    // `.debug_frame` fills what `.eh_frame` lacks.
    assert_eq!(at("hc_dbg"), Some(x86_sp(8, SAME)));
    assert_eq!(at("hc_dbg_pushed"), Some(x86_sp(16, SAME)));
    assert_eq!(at("hc_dbg_popped"), Some(x86_sp(8, SAME)));
    assert!(stats.debug_frame_fdes >= 1, "{stats:?}");

    assert_eq!(stats.unsupported_cfa_register, 1, "{stats:?}");
    assert_eq!(stats.unsupported_cfa_expression, 1, "{stats:?}");
    assert_eq!(stats.unsupported_plt_threshold, 1, "{stats:?}");
    assert_eq!(stats.unsupported_return_address, 1, "{stats:?}");
    assert_eq!(stats.unsupported_other, 1, "{stats:?}");
    assert_eq!(stats.end_rows, 1, "{stats:?}");
    assert_eq!(stats.plt_rows, 1, "{stats:?}");
    compare_with_gimli(&elf, &table, 2000);
}

#[test]
fn compressed_debug_frame_gives_the_same_table() {
    let (_dir, plain) = hand_x86(&[]);
    let (_dir2, compressed) = hand_x86(&["-Wl,--compress-debug-sections=zlib"]);
    let file = object::File::parse(&*compressed).expect("parse");
    let flags = file
        .section_by_name(".debug_frame")
        .expect(".debug_frame")
        .flags();
    assert!(
        matches!(flags, object::SectionFlags::Elf { sh_flags, .. }
            if sh_flags.contains(object::elf::SHF_COMPRESSED)),
        "the linker compressed .debug_frame"
    );
    let (plain, _) = build_with_stats(&plain).expect("plain");
    let (compressed, stats) = build_with_stats(&compressed).expect("compressed");
    assert!(!stats.debug_frame_unreadable);
    assert_eq!(plain, compressed);
}

#[test]
fn ibt_lazy_plt_threshold_is_unsupported() {
    // Lazy PLT entries of IBT-enabled objects start with endbr64: their push ends at
    // byte 9, and ld describes them with threshold 9, which the BPF side does not know.
    let (_dir, elf) = compile(
        X86_CC,
        &[("p.c", PUSHES_C)],
        &[
            "-O2",
            "-shared",
            "-fPIC",
            "-fcf-protection",
            "-Wl,-z,ibtplt",
            "-o",
            "p.so",
            "p.c",
        ],
        "p.so",
    );
    let (table, stats) = build_with_stats(&elf).expect("builds");
    check_invariants(&table);
    let plt = section_address(&elf, ".plt");
    assert_eq!(table.rule_at(plt + 16), Some(&unsupported_rule()));
    assert_eq!(stats.unsupported_plt_threshold, 1, "{stats:?}");
    assert_eq!(stats.plt_rows, 0, "{stats:?}");
    // .plt.sec entries (endbr64; jmp *GOT) leave the stack as the call did.
    let plt_sec = section_address(&elf, ".plt.sec");
    assert_eq!(table.rule_at(plt_sec), Some(&x86_sp(8, SAME)));
}

// ---------------------------------------------------------------------------------
// aarch64 by hand

/// Decodes `stp Xt, Xt2, [sp, #imm]!` (pre-index, 64-bit): `(t, t2, imm)`.
fn arm64_stp_pre_sp(insn: u32) -> Option<(u32, u32, i32)> {
    if insn & 0xffc0_03e0 != 0xa980_03e0 {
        return None;
    }
    let imm7 = ((insn >> 15) & 0x7f) as i32;
    let imm = ((imm7 << 25) >> 25) * 8;
    Some((insn & 31, (insn >> 10) & 31, imm))
}

/// Decodes `stp Xt, Xt2, [sp, #imm]` (signed offset, 64-bit): `(t, t2, imm)`.
fn arm64_stp_sp(insn: u32) -> Option<(u32, u32, i32)> {
    if insn & 0xffc0_03e0 != 0xa900_03e0 {
        return None;
    }
    let imm7 = ((insn >> 15) & 0x7f) as i32;
    let imm = ((imm7 << 25) >> 25) * 8;
    Some((insn & 31, (insn >> 10) & 31, imm))
}

fn arm64_words(code: &[u8]) -> Vec<u32> {
    let (words, _) = code.as_chunks::<4>();
    words.iter().map(|w| u32::from_le_bytes(*w)).collect()
}

const BL_MASK: u32 = 0xfc00_0000;
const BL: u32 = 0x9400_0000;
const PACIASP: u32 = 0xd503_233f;

fn arm64_sp(offset: i32, fp: (RegRule, i32), ra: (RegRule, i32)) -> UnwindRule {
    rule(CfaRule::SpOffset, offset, fp, ra)
}

fn check_arm64_frame_record(elf: &[u8], table: &UnwindTable) {
    let (address, code) = function_code(elf, "pushes");
    let words = arm64_words(&code);
    let skip = usize::from(words.first() == Some(&PACIASP));
    // Before the frame record is pushed: CFA = sp, the return address in LR.
    assert_eq!(table.rule_at(address), Some(&arm64_sp(0, SAME, SAME)));
    let (t, t2, imm) = arm64_stp_pre_sp(words[skip]).expect("stp x29, x30, [sp, #-N]!");
    assert_eq!((t, t2), (29, 30), "a frame record");
    let n = -imm;
    let after = address + 4 * (skip as u64 + 1);
    assert_eq!(
        table.rule_at(after),
        Some(&arm64_sp(n, (RegRule::AtCfa, -n), (RegRule::AtCfa, -n + 8))),
        "after stp x29, x30, [sp, #-{n}]!"
    );
}

#[test]
fn aarch64_frame_records_by_hand() {
    let (_dir, elf) = compile(
        ARM64_CC,
        &[("p.c", PUSHES_C)],
        &["-O2", "-shared", "-fPIC", "-o", "p.so", "p.c"],
        "p.so",
    );
    let table = build(&elf).expect("builds");
    assert_eq!(table.arch, Arch::Aarch64);
    check_invariants(&table);
    check_arm64_frame_record(&elf, &table);
    compare_with_gimli(&elf, &table, 2000);

    // With pointer authentication the CFI toggles RA_SIGN_STATE; the rules are the same.
    let (_dir, pac) = compile(
        ARM64_CC,
        &[("p.c", PUSHES_C)],
        &[
            "-O2",
            "-mbranch-protection=pac-ret",
            "-shared",
            "-fPIC",
            "-o",
            "p.so",
            "p.c",
        ],
        "p.so",
    );
    let (table, stats) = build_with_stats(&pac).expect("builds");
    check_invariants(&table);
    assert_eq!(
        stats.bad_entries, 0,
        "negate_ra_state is understood: {stats:?}"
    );
    let (address, code) = function_code(&pac, "pushes");
    assert_eq!(arm64_words(&code).first(), Some(&PACIASP));
    check_arm64_frame_record(&pac, &table);
    // Between paciasp and the stp: still CFA = sp, LR holding the (signed) return.
    assert_eq!(table.rule_at(address + 4), Some(&arm64_sp(0, SAME, SAME)));
    compare_with_gimli(&pac, &table, 2000);
}

#[test]
fn aarch64_without_frame_pointers_by_hand() {
    let (_dir, elf) = compile(
        ARM64_CC,
        &[("p.c", PUSHES_C)],
        &[
            "-O2",
            "-fomit-frame-pointer",
            "-shared",
            "-fPIC",
            "-o",
            "p.so",
            "p.c",
        ],
        "p.so",
    );
    let table = build(&elf).expect("builds");
    check_invariants(&table);
    compare_with_gimli(&elf, &table, 2000);

    // Simulate the prologue's stores up to the first call: at the call, the CFA is sp
    // plus what was pushed and the return address is where x30 was stored.
    let (address, code) = function_code(&elf, "pushes");
    assert_eq!(table.rule_at(address), Some(&arm64_sp(0, SAME, SAME)));
    let mut depth = 0;
    let mut ra_at: Option<i32> = None;
    let mut fp_at: Option<i32> = None;
    let mut call = None;
    for (i, &insn) in arm64_words(&code).iter().enumerate() {
        if insn & BL_MASK == BL {
            call = Some(address + 4 * i as u64);
            break;
        }
        let (stored, offset_from_sp) = if let Some((t, t2, imm)) = arm64_stp_pre_sp(insn) {
            depth -= imm;
            ((t, t2), 0)
        } else if let Some((t, t2, imm)) = arm64_stp_sp(insn) {
            ((t, t2), imm)
        } else {
            continue;
        };
        for (reg, slot) in [(stored.0, 0), (stored.1, 8)] {
            let from_cfa = offset_from_sp + slot - depth;
            match reg {
                30 => ra_at = Some(from_cfa),
                29 => fp_at = Some(from_cfa),
                _ => {}
            }
        }
    }
    let call = call.expect("pushes calls fill");
    let ra_at = ra_at.expect("x30 saved before the call");
    let fp = fp_at.map_or(SAME, |at| (RegRule::AtCfa, at));
    assert!(depth > 0);
    assert_eq!(
        table.rule_at(call),
        Some(&arm64_sp(depth, fp, (RegRule::AtCfa, ra_at))),
        "at the first call"
    );

    // A leaf function: the return address stays in LR throughout.
    let (address, code) = function_code(&elf, "leaf");
    for pc in (address..address + code.len() as u64).step_by(4) {
        assert_eq!(table.rule_at(pc), Some(&arm64_sp(0, SAME, SAME)));
    }
}

#[test]
fn aarch64_start_ends_the_stack() {
    let (_dir, elf) = compile(
        ARM64_CC,
        &[("p.c", PUSHES_C), ("ext.c", EXT_C)],
        &["-O2", "-o", "p", "p.c", "ext.c"],
        "p",
    );
    let table = build(&elf).expect("builds");
    check_invariants(&table);
    // `_start`'s CFI marks x30 undefined after its first instruction.
    let start = symbol(&elf, "_start");
    assert_eq!(table.rule_at(start + 4), Some(&end_rule()));
    compare_with_gimli(&elf, &table, 2000);
}

// ---------------------------------------------------------------------------------
// The layout of FDE rows

fn row(start: u64, end: u64, rule: UnwindRule) -> FdeRow {
    FdeRow { start, end, rule }
}

fn finish(builder: Builder) -> UnwindTable {
    let (rows, rules) = builder.finish().expect("rows");
    let table = UnwindTable {
        rows,
        rules,
        arch: Arch::X86_64,
    };
    check_invariants(&table);
    table
}

#[test]
fn overlapping_fdes_first_added_wins() {
    let (a, b, c) = (x86_sp(8, SAME), x86_sp(16, SAME), x86_sp(24, SAME));
    let mut builder = Builder::default();
    assert!(!builder.add_fde(0x1000, 0x1100, &[row(0x1000, 0x1100, a)]));
    // Overlaps the end of the first: keeps [0x1100, 0x1200).
    assert!(builder.add_fde(
        0x1080,
        0x1200,
        &[row(0x1080, 0x1180, b), row(0x1180, 0x1200, c)]
    ));
    // Covers holes on both sides of an existing range and one beyond.
    assert!(!builder.add_fde(0x1300, 0x1380, &[row(0x1300, 0x1380, a)]));
    assert!(builder.add_fde(0x0f00, 0x1400, &[row(0x0f00, 0x1400, c)]));
    // Entirely inside covered addresses: nothing.
    assert!(builder.add_fde(0x1010, 0x1020, &[row(0x1010, 0x1020, b)]));
    let table = finish(builder);
    let expect = [
        (0x0eff, None),
        (0x0f00, Some(c)),
        (0x0fff, Some(c)),
        (0x1000, Some(a)),
        (0x1010, Some(a)),
        (0x10ff, Some(a)),
        (0x1100, Some(b)),
        (0x117f, Some(b)),
        (0x1180, Some(c)),
        (0x12ff, Some(c)),
        (0x1300, Some(a)),
        (0x137f, Some(a)),
        (0x1380, Some(c)),
        (0x13ff, Some(c)),
        (0x1400, None),
    ];
    for (pc, rule) in expect {
        assert_eq!(table.rule_at(pc).copied(), rule, "{pc:#x}");
    }
    assert_eq!(table.rules.len(), 3);
}

#[test]
fn gaps_and_merges() {
    let (a, b) = (x86_sp(8, SAME), x86_sp(16, SAME));
    let mut builder = Builder::default();
    // Added out of address order.
    builder.add_fde(0x40, 0x50, &[row(0x40, 0x50, a)]);
    builder.add_fde(0x10, 0x20, &[row(0x10, 0x18, a), row(0x18, 0x20, b)]);
    builder.add_fde(0x20, 0x30, &[row(0x20, 0x30, b)]);
    builder.add_fde(0x30, 0x38, &[row(0x30, 0x38, a)]);
    let table = finish(builder);
    let rows: Vec<(u32, Option<UnwindRule>)> = table
        .rows
        .iter()
        .map(|r| (r.pc, table.rules.get(r.rule as usize).copied()))
        .collect();
    assert_eq!(
        rows,
        [
            (0x10, Some(a)),
            (0x18, Some(b)),
            (0x30, Some(a)),
            (0x38, None),
            (0x40, Some(a)),
            (0x50, None),
        ]
    );
}

#[test]
fn nothing_covered_is_an_error() {
    assert!(matches!(
        Builder::default().finish(),
        Err(UnwindError::NoCfi)
    ));
    // An object without any CFI.
    let (_dir, elf) = compile(
        X86_CC,
        &[("n.s", ".text\n.globl f\nf: ret\n")],
        &["-shared", "-nostdlib", "-o", "n.so", "n.s"],
        "n.so",
    );
    assert!(
        matches!(build(&elf), Err(UnwindError::NoCfi)),
        "{:?}",
        build(&elf)
    );
    assert!(matches!(
        build(b"not an ELF file at all"),
        Err(UnwindError::UnsupportedArch)
    ));
}

#[test]
fn without_section_headers_eh_frame_is_found_through_eh_frame_hdr() {
    let (_dir, elf) = compile(
        X86_CC,
        &[("p.c", PUSHES_C)],
        &[
            "-O2",
            "-fomit-frame-pointer",
            "-shared",
            "-fPIC",
            "-o",
            "p.so",
            "p.c",
        ],
        "p.so",
    );
    let with_sections = build(&elf).expect("builds");
    // What sstrip does: no section header table (e_shoff, e_shnum, e_shstrndx zeroed).
    let mut stripped = elf.clone();
    stripped[0x28..0x30].fill(0);
    stripped[0x3c..0x40].fill(0);
    assert!(
        object::File::parse(&*stripped)
            .expect("still parses")
            .section_by_name(".eh_frame")
            .is_none()
    );
    let (table, stats) = build_with_stats(&stripped).expect("builds from PT_GNU_EH_FRAME");
    assert_eq!(table, with_sections);
    assert!(!stats.truncated, "stops at the terminator: {stats:?}");
}

#[test]
fn code_beyond_4_gib_is_an_error() {
    let (_dir, elf) = compile(
        X86_CC,
        &[(
            "hi.s",
            ".text\n.globl _start\n_start:\n.cfi_startproc\n.cfi_undefined %rip\nhlt\n.cfi_endproc\n",
        )],
        &[
            "-nostdlib",
            "-static",
            "-no-pie",
            "-Wl,-Ttext-segment=0x200000000",
            "-o",
            "hi",
            "hi.s",
        ],
        "hi",
    );
    assert!(
        matches!(build(&elf), Err(UnwindError::AddressTooLarge { end }) if end > 1 << 32),
        "{:?}",
        build(&elf)
    );
}

// ---------------------------------------------------------------------------------
// Damaged objects

// The property tests' generator, seeded per case so a failure names its seed.
use crate::test_rng::Rng;

fn cases() -> u64 {
    std::env::var("HEAPPROFD_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

/// File ranges worth damaging most: the CFI sections and the headers.
fn hot_ranges(elf: &[u8]) -> Vec<std::ops::Range<usize>> {
    let file = object::File::parse(elf).expect("parse");
    // The ELF header and (usually right after it) the program headers.
    let mut ranges = Vec::new();
    ranges.push(0..elf.len().min(64 + 56 * 12));
    for name in [".eh_frame", ".eh_frame_hdr", ".debug_frame"] {
        if let Some((start, size)) = file.section_by_name(name).and_then(|s| s.file_range()) {
            ranges.push(start as usize..(start + size) as usize);
        }
    }
    ranges.push(elf.len().saturating_sub(4096)..elf.len());
    ranges.push(0..elf.len());
    ranges
}

fn damage(original: &[u8], ranges: &[std::ops::Range<usize>], rng: &mut Rng) -> Vec<u8> {
    let mut bytes = original.to_vec();
    for _ in 0..=rng.below(16) {
        let region = &ranges[rng.below(ranges.len() as u64) as usize];
        if region.is_empty() {
            continue;
        }
        let at = region.start + rng.below(region.len() as u64) as usize;
        match rng.below(4) {
            0 => bytes[at] = rng.next() as u8,
            1 => bytes[at] ^= 1 << rng.below(8),
            // Lengths and LEB128s: the extremes.
            2 => bytes[at] = if rng.below(2) == 0 { 0 } else { 0xff },
            _ => {
                // Copy a few bytes from elsewhere in the region (a duplicated entry).
                let from = region.start + rng.below(region.len() as u64) as usize;
                let len = (rng.below(32) as usize)
                    .min(region.end - from)
                    .min(region.end - at);
                bytes.copy_within(from..from + len, at);
            }
        }
    }
    if rng.below(8) == 0 {
        bytes.truncate(rng.below(bytes.len() as u64) as usize);
    }
    bytes
}

fn damaged_objects_never_panic(name: &str, original: &[u8], cases: u64) {
    let ranges = hot_ranges(original);
    let mut built = 0;
    for case in 0..cases {
        let seed = 0x9e37_79b9_7f4a_7c15 ^ (case.wrapping_mul(0x1000_0000_01b3) + 1);
        let bytes = damage(original, &ranges, &mut Rng(seed));
        let result = std::panic::catch_unwind(|| match build(&bytes) {
            Ok(table) => {
                check_invariants(&table);
                true
            }
            Err(_) => false,
        });
        match result {
            Ok(ok) => built += u64::from(ok),
            Err(_) => panic!("{name}: seed {seed:#x} panicked"),
        }
    }
    eprintln!("{name}: {built} of {cases} damaged copies built a table");
    // Most damage must leave the file readable, or the CFI parser goes untested.
    assert!(built * 4 >= cases, "{name}: only {built} of {cases} built");
}

#[test]
fn damaged_small_objects_never_panic() {
    let (_dir, x86) = hand_x86(&[]);
    damaged_objects_never_panic("hand-written x86 CFI", &x86, cases());
    let (_dir, arm) = compile(
        ARM64_CC,
        &[("p.c", PUSHES_C)],
        &[
            "-O2",
            "-mbranch-protection=pac-ret",
            "-shared",
            "-fPIC",
            "-o",
            "p.so",
            "p.c",
        ],
        "p.so",
    );
    damaged_objects_never_panic("aarch64 PAC object", &arm, cases());
}

#[test]
fn damaged_libc_never_panics() {
    let libc = std::fs::read(own_libc()).expect("libc");
    // Each case builds a whole library's table: fewer cases.
    damaged_objects_never_panic("libc", &libc, (cases() / 100).max(5));
}

// ---------------------------------------------------------------------------------
// Measurements (not pass/fail): `cargo test --release ... -- --ignored --nocapture`

#[test]
#[ignore = "timings; run with --release --ignored --nocapture"]
fn build_times() {
    let host = host_arch();
    for path in [
        own_libc(),
        system_lib(host, LIBSTDCXX),
        PathBuf::from(PYTHON),
        system_lib(host, LIBLLVM),
        system_lib(Arch::X86_64, LIBC),
        system_lib(Arch::Aarch64, LIBC),
        system_lib(Arch::Aarch64, LIBSTDCXX),
    ] {
        let Some(elf) = system_object(&path) else {
            continue;
        };
        let mut best = f64::MAX;
        let mut result = None;
        for _ in 0..5 {
            let started = Instant::now();
            let built = build_with_stats(&elf);
            best = best.min(started.elapsed().as_secs_f64());
            result = Some(built);
        }
        match result {
            Some(Ok((table, stats))) => println!(
                "{}: {:.1} ms, {} rows, {} rules, {} + {} FDEs; {stats:?}",
                path.display(),
                best * 1e3,
                table.rows.len(),
                table.rules.len(),
                stats.eh_frame_fdes,
                stats.debug_frame_fdes
            ),
            Some(Err(e)) => println!("{}: error {e}", path.display()),
            None => {}
        }
    }
}

/// ELF files under `dir` (one level of subdirectories), symlinks skipped.
fn elf_files(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        let path = entry.path();
        if kind.is_dir() && depth > 0 {
            elf_files(&path, depth - 1, out);
        } else if kind.is_file() {
            let mut magic = [0u8; 4];
            let is_elf = std::fs::File::open(&path)
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
                .is_ok()
                && magic == *b"\x7fELF";
            if is_elf {
                out.push(path);
            }
        }
    }
}

#[test]
#[ignore = "a survey of this machine's objects; run with --release --ignored --nocapture"]
fn survey_system_objects() {
    let mut files = Vec::new();
    let mut dirs: Vec<PathBuf> = ["/usr/bin", "/usr/sbin", "/usr/libexec"]
        .into_iter()
        .map(PathBuf::from)
        .collect();
    // Each architecture's libraries, where this host keeps them.
    for arch in [Arch::X86_64, Arch::Aarch64] {
        dirs.push(system_lib(arch, ""));
    }
    for dir in &dirs {
        elf_files(dir, 2, &mut files);
    }
    let started = Instant::now();
    let mut errors: HashMap<String, usize> = HashMap::new();
    let mut total = BuildStats::default();
    let (mut built, mut rows, mut rules) = (0, 0, 0);
    let mut worst: Vec<(usize, String)> = Vec::new();
    let mut slowest: Vec<(f64, String)> = Vec::new();
    let mut largest: Vec<(usize, usize, String)> = Vec::new();
    for path in &files {
        let Ok(elf) = std::fs::read(path) else {
            continue;
        };
        let t = Instant::now();
        match build_with_stats(&elf) {
            Ok((table, stats)) => {
                slowest.push((t.elapsed().as_secs_f64(), path.display().to_string()));
                largest.push((
                    table.rows.len(),
                    table.rules.len(),
                    path.display().to_string(),
                ));
                built += 1;
                rows += table.rows.len();
                rules += table.rules.len();
                let unsupported = stats.unsupported_cfa_register
                    + stats.unsupported_cfa_expression
                    + stats.unsupported_plt_threshold
                    + stats.unsupported_return_address
                    + stats.unsupported_other;
                if unsupported > 0 || stats.bad_entries > 0 || stats.overlapping_fdes > 0 {
                    worst.push((
                        unsupported,
                        format!(
                            "{}: cfa reg {}, cfa expr {}, plt threshold {}, ra {}, other {}, bad entries {}, overlapping {}, outside code {}",
                            path.display(),
                            stats.unsupported_cfa_register,
                            stats.unsupported_cfa_expression,
                            stats.unsupported_plt_threshold,
                            stats.unsupported_return_address,
                            stats.unsupported_other,
                            stats.bad_entries,
                            stats.overlapping_fdes,
                            stats.outside_code,
                        ),
                    ));
                }
                total.eh_frame_fdes += stats.eh_frame_fdes;
                total.debug_frame_fdes += stats.debug_frame_fdes;
                total.bad_entries += stats.bad_entries;
                total.truncated |= stats.truncated;
                total.outside_code += stats.outside_code;
                total.overlapping_fdes += stats.overlapping_fdes;
                total.end_rows += stats.end_rows;
                total.plt_rows += stats.plt_rows;
                total.unsupported_cfa_register += stats.unsupported_cfa_register;
                total.unsupported_cfa_expression += stats.unsupported_cfa_expression;
                total.unsupported_plt_threshold += stats.unsupported_plt_threshold;
                total.unsupported_return_address += stats.unsupported_return_address;
                total.unsupported_other += stats.unsupported_other;
            }
            Err(e) => {
                let kind = format!("{e}").split(':').next().unwrap_or("").to_string();
                *errors.entry(kind).or_default() += 1;
            }
        }
    }
    println!(
        "{} ELF files, {built} tables ({rows} rows, {rules} rules) in {:.2} s",
        files.len(),
        started.elapsed().as_secs_f64()
    );
    println!("errors: {errors:?}");
    println!("totals: {total:?}");
    worst.sort_by_key(|w| std::cmp::Reverse(w.0));
    for (_, line) in worst.iter().take(25) {
        println!("  {line}");
    }
    largest.sort_by_key(|l| std::cmp::Reverse(l.0));
    for (rows, rules, path) in largest.iter().take(5) {
        println!("  largest: {path}: {rows} rows, {rules} rules");
    }
    slowest.sort_by(|a, b| b.0.total_cmp(&a.0));
    for (secs, path) in slowest.iter().take(5) {
        println!("  slowest: {path}: {:.1} ms", secs * 1e3);
    }
}
