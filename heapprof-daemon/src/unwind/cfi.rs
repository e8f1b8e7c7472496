//! Walking the FDEs of `.eh_frame` and `.debug_frame` with gimli, and converting each
//! row gimli evaluates into a rule the BPF unwinder can follow.

use std::collections::HashMap;

use gimli::{
    BaseAddresses, CommonInformationEntry, DebugFrame, EhFrame, EndianSlice, FrameDescriptionEntry,
    LittleEndian, Register, RegisterRule, UnwindContext, UnwindOffset, UnwindSection,
    UnwindTableRow, Vendor,
};
use heapprof_common::unwind::{CfaRule, RegRule, UnwindRule};

use super::{
    Arch, BuildStats, UnwindError,
    elf::CfiSections,
    table::{Builder, FdeRow},
};

/// The reader every CFI section is parsed with (both architectures are little-endian).
pub(super) type Slice<'a> = EndianSlice<'a, LittleEndian>;

/// The DWARF expression x86-64 linkers emit for lazy PLT entries: CFA = rsp + 8, plus 8
/// once the entry's `push` has run, i.e. when `(rip & 15) >= threshold`:
/// `DW_OP_breg7 (rsp) 8; DW_OP_breg16 (rip) 0; DW_OP_lit15; DW_OP_and; DW_OP_lit<threshold>;
/// DW_OP_ge; DW_OP_lit3; DW_OP_shl; DW_OP_plus`. The threshold byte is `PLT_THRESHOLD_AT`.
const PLT_EXPRESSION: [u8; 11] = [
    0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22,
];
const PLT_THRESHOLD_AT: usize = 6;
/// `DW_OP_lit0`; `DW_OP_lit0 + n` pushes n (n < 32).
const DW_OP_LIT0: u8 = 0x30;
/// The threshold the BPF unwinder hardcodes for [`CfaRule::PltX86`]: the classic 16-byte
/// entry `jmp *GOT(%rip)` (6 bytes), `push $n` (5 bytes), `jmp PLT0`.
const PLT_THRESHOLD: u8 = 11;

/// DWARF register numbers of the registers the unwinder follows.
#[derive(Clone, Copy, Debug)]
pub(super) struct Registers {
    /// The stack pointer (rsp 7, sp 31).
    pub sp: Register,
    /// The frame pointer (rbp 6, x29 29).
    pub fp: Register,
    /// The return address column (x86-64's pseudo-register 16, aarch64's x30).
    pub ra: Register,
}

impl Registers {
    /// The registers of `arch`.
    pub fn of(arch: Arch) -> Registers {
        match arch {
            Arch::X86_64 => Registers {
                sp: Register(7),
                fp: Register(6),
                ra: Register(16),
            },
            Arch::Aarch64 => Registers {
                sp: Register(31),
                fp: Register(29),
                ra: Register(30),
            },
        }
    }
}

/// Why a row's rule is [`CfaRule::Unsupported`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Unsupported {
    CfaRegister,
    CfaExpression,
    PltThreshold,
    ReturnAddress,
    Other,
}

/// A row converted: the rule, and why it is unsupported when it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Converted {
    pub rule: UnwindRule,
    pub unsupported: Option<Unsupported>,
}

impl Converted {
    fn rule(cfa: CfaRule, cfa_offset: i32, fp: (RegRule, i32), ra: (RegRule, i32)) -> Self {
        Converted {
            rule: UnwindRule {
                cfa: cfa as u8,
                fp: fp.0 as u8,
                ra: ra.0 as u8,
                _pad: 0,
                cfa_offset,
                fp_offset: fp.1,
                ra_offset: ra.1,
            },
            unsupported: None,
        }
    }

    /// The one rule of every row ending the stack: nothing else about it matters.
    fn end() -> Self {
        Self::rule(CfaRule::End, 0, (RegRule::Same, 0), (RegRule::Same, 0))
    }

    /// The one rule of every row the unwinder cannot follow.
    fn unsupported(why: Unsupported) -> Self {
        Converted {
            unsupported: Some(why),
            ..Self::rule(
                CfaRule::Unsupported,
                0,
                (RegRule::Same, 0),
                (RegRule::Same, 0),
            )
        }
    }
}

/// Converts one gimli row of an FDE whose CIE names `ra_column` as the return address
/// column. `section` holds the row's DWARF expressions.
pub(super) fn convert<'a, S: UnwindSection<Slice<'a>>>(
    arch: Arch,
    ra_column: Register,
    row: &UnwindTableRow<usize>,
    section: &S,
) -> Converted {
    let regs = Registers::of(arch);
    if ra_column != regs.ra {
        return Converted::unsupported(Unsupported::Other);
    }
    let ra_rule = row.register(regs.ra);
    // An undefined return address marks the outermost frame, whatever the CFA.
    if matches!(ra_rule, Some(RegisterRule::Undefined)) {
        return Converted::end();
    }
    let (cfa, cfa_offset) = match row.cfa() {
        gimli::CfaRule::RegisterAndOffset { register, offset } => {
            let Ok(offset) = i32::try_from(*offset) else {
                return Converted::unsupported(Unsupported::Other);
            };
            if *register == regs.sp {
                (CfaRule::SpOffset, offset)
            } else if *register == regs.fp {
                (CfaRule::FpOffset, offset)
            } else {
                return Converted::unsupported(Unsupported::CfaRegister);
            }
        }
        gimli::CfaRule::Expression(expression) => {
            let bytes = expression.get(section).map(|e| e.0.slice()).unwrap_or(&[]);
            match (arch, plt_threshold(bytes)) {
                (Arch::X86_64, Some(PLT_THRESHOLD)) => (CfaRule::PltX86, 0),
                (Arch::X86_64, Some(_)) => {
                    return Converted::unsupported(Unsupported::PltThreshold);
                }
                _ => return Converted::unsupported(Unsupported::CfaExpression),
            }
        }
    };
    let ra = match (arch, ra_rule) {
        (Arch::X86_64, Some(RegisterRule::Offset(-8))) => (RegRule::AtCfa, -8),
        (Arch::X86_64, _) => return Converted::unsupported(Unsupported::ReturnAddress),
        (Arch::Aarch64, Some(RegisterRule::Offset(offset))) => match i32::try_from(offset) {
            Ok(offset) => (RegRule::AtCfa, offset),
            Err(_) => return Converted::unsupported(Unsupported::Other),
        },
        // A leaf function's return address still in the link register (also the
        // initial state of every aarch64 FDE: the CIE gives x30 no rule).
        (Arch::Aarch64, None | Some(RegisterRule::SameValue)) => (RegRule::Same, 0),
        (Arch::Aarch64, Some(_)) => return Converted::unsupported(Unsupported::ReturnAddress),
    };
    let fp = match row.register(regs.fp) {
        None | Some(RegisterRule::SameValue) => (RegRule::Same, 0),
        Some(RegisterRule::Offset(offset)) => match i32::try_from(offset) {
            Ok(offset) => (RegRule::AtCfa, offset),
            Err(_) => (RegRule::Undefined, 0),
        },
        // Lost, or somewhere the unwinder cannot look (another register, an
        // expression): frames further up must do without it.
        Some(_) => (RegRule::Undefined, 0),
    };
    Converted::rule(cfa, cfa_offset, fp, ra)
}

/// The threshold of the PLT expression, if `bytes` is that expression.
fn plt_threshold(bytes: &[u8]) -> Option<u8> {
    if bytes.len() != PLT_EXPRESSION.len() {
        return None;
    }
    let threshold = bytes[PLT_THRESHOLD_AT].checked_sub(DW_OP_LIT0)?;
    let same = bytes
        .iter()
        .zip(PLT_EXPRESSION)
        .enumerate()
        .all(|(i, (&b, e))| i == PLT_THRESHOLD_AT || b == e);
    (same && threshold < 32).then_some(threshold)
}

/// The gimli section objects of `sections`, with the base addresses their pointers are
/// relative to, and the vendor extensions of `arch` (aarch64's `negate_ra_state`).
pub(super) struct Sections<'a> {
    pub eh_frame: Option<(EhFrame<Slice<'a>>, &'a [u8])>,
    pub debug_frame: Option<(DebugFrame<Slice<'a>>, &'a [u8])>,
    pub bases: BaseAddresses,
}

impl<'a> Sections<'a> {
    /// Wraps the sections of `sections` for gimli.
    pub fn new(arch: Arch, sections: &'a CfiSections<'a>) -> Self {
        let vendor = match arch {
            Arch::X86_64 => Vendor::Default,
            Arch::Aarch64 => Vendor::AArch64,
        };
        let mut bases = BaseAddresses::default();
        if let Some(eh_frame) = &sections.eh_frame {
            bases = bases.set_eh_frame(eh_frame.address);
        }
        if let Some(text) = sections.text {
            bases = bases.set_text(text);
        }
        if let Some(got) = sections.got {
            bases = bases.set_got(got);
        }
        let eh_frame = sections.eh_frame.as_ref().map(|eh| {
            let mut section = EhFrame::new(eh.data, LittleEndian);
            section.set_address_size(8);
            section.set_vendor(vendor);
            (section, eh.data)
        });
        let debug_frame = sections.debug_frame.as_deref().map(|data| {
            let mut section = DebugFrame::new(data, LittleEndian);
            section.set_address_size(8);
            section.set_vendor(vendor);
            (section, data)
        });
        Sections {
            eh_frame,
            debug_frame,
            bases,
        }
    }
}

/// Evaluates every FDE of `.eh_frame`, then of `.debug_frame`, into `builder`.
/// The most start code without CFI the ELF entry point may begin: glibc's loader's
/// `_start` and `_dl_start_user` take under 0x60 bytes on x86-64 and arm64.
const MAX_START_CODE: u64 = 0x100;

/// Marks the code at the ELF entry point that no FDE describes as the outermost
/// frame. glibc's dynamic loader enters through `_start` and `_dl_start_user`,
/// hand-written assembly without CFI that calls `_dl_init`: every allocation made by
/// a library's constructor (libstdc++'s emergency pool, in every C++ program) has it
/// as its outermost frame, and without this mark such a stack, found whole, is
/// counted as cut short. Objects without any CFI are left without a table.
fn add_start_code(sections: &CfiSections<'_>, builder: &mut Builder, stats: &mut BuildStats) {
    let Some(entry) = sections.entry else {
        return;
    };
    let Some(segment_end) = sections.code_end(entry) else {
        return;
    };
    let Some(end) = builder
        .uncovered_run(entry, MAX_START_CODE)
        .map(|end| end.min(segment_end))
    else {
        return;
    };
    // Rows hold 32-bit addresses (as every FDE added was checked to).
    if end > u64::from(u32::MAX) {
        return;
    }
    let rule = Converted::end().rule;
    builder.add_fde(
        entry,
        end,
        &[FdeRow {
            start: entry,
            end,
            rule,
        }],
    );
    stats.start_code = true;
}

pub(super) fn add_sections(
    arch: Arch,
    sections: &CfiSections<'_>,
    builder: &mut Builder,
    stats: &mut BuildStats,
) -> Result<(), UnwindError> {
    let gimli_sections = Sections::new(arch, sections);
    let bases = &gimli_sections.bases;
    // One context for every FDE: it is large, and gimli resets it per FDE.
    let mut ctx = Box::new(UnwindContext::new());
    let mut rows = Vec::new();
    if let Some((section, data)) = &gimli_sections.eh_frame {
        let mut fdes = 0;
        for_each_fde(section, data, bases, stats, |fde, stats| {
            fdes += 1;
            add_fde(
                arch, sections, section, bases, &fde, &mut ctx, &mut rows, builder, stats,
            )
        })?;
        stats.eh_frame_fdes = fdes;
    }
    if let Some((section, data)) = &gimli_sections.debug_frame {
        let mut fdes = 0;
        for_each_fde(section, data, bases, stats, |fde, stats| {
            fdes += 1;
            add_fde(
                arch, sections, section, bases, &fde, &mut ctx, &mut rows, builder, stats,
            )
        })?;
        stats.debug_frame_fdes = fdes;
    }
    add_start_code(sections, builder, stats);
    Ok(())
}

/// Calls `f` on every FDE of `section` (whose bytes are `data`), in section order.
///
/// Entries are delimited by their length prefixes here rather than by gimli's entry
/// iterator, which stops at the first entry it cannot parse: an FDE with a bad CIE
/// pointer or an unknown augmentation costs only its own addresses. `.eh_frame` ends at
/// a zero length (its terminator); `.debug_frame` has none, so zero lengths (an
/// assembler bug) are skipped.
pub(super) fn for_each_fde<'a, S, F>(
    section: &S,
    data: &'a [u8],
    bases: &BaseAddresses,
    stats: &mut BuildStats,
    mut f: F,
) -> Result<(), UnwindError>
where
    S: UnwindSection<Slice<'a>> + IsEhFrame,
    F: FnMut(FrameDescriptionEntry<Slice<'a>>, &mut BuildStats) -> Result<(), UnwindError>,
{
    // CIEs are shared by many FDEs: parse each once.
    let mut cies: HashMap<usize, CommonInformationEntry<Slice<'a>>> = HashMap::new();
    let mut offset = 0usize;
    while offset < data.len() {
        let Some(entry) = entry_at(data, offset, S::IS_EH_FRAME) else {
            stats.truncated = true;
            break;
        };
        if entry.length == 0 {
            if S::IS_EH_FRAME {
                break;
            }
            offset = entry.next;
            continue;
        }
        if !entry.is_cie {
            let fde = section
                .partial_fde_from_offset(bases, S::Offset::from(offset))
                .and_then(|partial| {
                    partial.parse(|section, bases, cie_offset| {
                        let key = UnwindOffset::into(cie_offset);
                        if let Some(cie) = cies.get(&key) {
                            return Ok(cie.clone());
                        }
                        let cie = section.cie_from_offset(bases, cie_offset)?;
                        cies.insert(key, cie.clone());
                        Ok(cie)
                    })
                });
            match fde {
                Ok(fde) => f(fde, stats)?,
                Err(e) => {
                    log::debug!("CFI entry at {offset:#x}: {e}");
                    stats.bad_entries += 1;
                }
            }
        }
        offset = entry.next;
    }
    Ok(())
}

/// Whether a section is `.eh_frame` (rather than `.debug_frame`): it decides how CIEs
/// are told from FDEs and what a zero length means.
pub(super) trait IsEhFrame {
    /// `true` for `.eh_frame`.
    const IS_EH_FRAME: bool;
}

impl IsEhFrame for EhFrame<Slice<'_>> {
    const IS_EH_FRAME: bool = true;
}

impl IsEhFrame for DebugFrame<Slice<'_>> {
    const IS_EH_FRAME: bool = false;
}

/// The prefix of one CFI entry.
struct Entry {
    /// The length field (0 for a terminator).
    length: u64,
    /// Whether the entry is a CIE.
    is_cie: bool,
    /// Offset of the next entry.
    next: usize,
}

/// Reads the length and CIE id of the entry at `offset`; `None` if they or the entry
/// run past the end of `data`.
fn entry_at(data: &[u8], offset: usize, eh_frame: bool) -> Option<Entry> {
    let read_u32 = |at: usize| -> Option<u32> {
        let bytes = data.get(at..at.checked_add(4)?)?;
        Some(u32::from_le_bytes(bytes.try_into().ok()?))
    };
    let read_u64 = |at: usize| -> Option<u64> {
        let bytes = data.get(at..at.checked_add(8)?)?;
        Some(u64::from_le_bytes(bytes.try_into().ok()?))
    };
    let length32 = read_u32(offset)?;
    let (length, header, dwarf64) = if length32 == u32::MAX {
        (read_u64(offset.checked_add(4)?)?, 12, true)
    } else {
        (u64::from(length32), 4, false)
    };
    let body = offset.checked_add(header)?;
    let next = body.checked_add(usize::try_from(length).ok()?)?;
    if next > data.len() {
        return None;
    }
    if length == 0 {
        return Some(Entry {
            length,
            is_cie: false,
            next,
        });
    }
    // `.eh_frame`'s CIE id is always 4 bytes and 0; `.debug_frame`'s is all ones, 4 or
    // 8 bytes as the format.
    let is_cie = if eh_frame {
        read_u32(body)? == 0
    } else if dwarf64 {
        read_u64(body)? == u64::MAX
    } else {
        read_u32(body)? == u32::MAX
    };
    Some(Entry {
        length,
        is_cie,
        next,
    })
}

/// Evaluates one FDE and adds its rows to `builder`, if it covers code. `rows` is a
/// buffer reused across FDEs.
#[allow(
    clippy::too_many_arguments,
    reason = "the walk over one section's FDEs hands its state through; a struct of it would be built per call"
)]
fn add_fde<'a, S: UnwindSection<Slice<'a>>>(
    arch: Arch,
    sections: &CfiSections<'_>,
    section: &S,
    bases: &BaseAddresses,
    fde: &FrameDescriptionEntry<Slice<'a>>,
    ctx: &mut UnwindContext<usize>,
    rows: &mut Vec<FdeRow>,
    builder: &mut Builder,
    stats: &mut BuildStats,
) -> Result<(), UnwindError> {
    let start = fde.initial_address();
    let Some(end) = start.checked_add(fde.len()) else {
        stats.outside_code += 1;
        return Ok(());
    };
    if start >= end || !sections.is_code(start, end) {
        stats.outside_code += 1;
        return Ok(());
    }
    if end > u64::from(u32::MAX) {
        return Err(UnwindError::AddressTooLarge { end });
    }
    rows.clear();
    let ra_column = fde.cie().return_address_register();
    let mut table = match fde.rows(section, bases, ctx) {
        Ok(table) => table,
        Err(e) => {
            log::debug!("FDE for {start:#x}..{end:#x}: {e}");
            stats.bad_entries += 1;
            return Ok(());
        }
    };
    let mut row_start = start;
    // Where the FDE's rows end: its end, or where evaluation failed.
    let mut covered_end = end;
    loop {
        let row = match table.next_row() {
            Ok(Some(row)) => row,
            Ok(None) => break,
            // Rows already evaluated are right; what follows is unknown, so the rest of
            // the FDE is left uncovered (a gap, or `.debug_frame`'s). Seen in hand-written
            // assembly: `def_cfa_register` after a CFA expression.
            Err(e) => {
                log::debug!("FDE for {start:#x}..{end:#x}: {e} after {row_start:#x}");
                stats.bad_entries += 1;
                covered_end = row_start;
                break;
            }
        };
        // Rows stay inside the FDE and never go back (gimli's per-address lookup
        // returns the first row containing an address).
        let from = row.start_address().max(row_start);
        let to = row.end_address().min(end);
        if from >= to {
            continue;
        }
        row_start = to;
        let converted = convert(arch, ra_column, row, section);
        count(stats, &converted);
        match rows.last_mut() {
            Some(last) if last.end == from && last.rule == converted.rule => last.end = to,
            _ => rows.push(FdeRow {
                start: from,
                end: to,
                rule: converted.rule,
            }),
        }
    }
    if covered_end <= start {
        return Ok(());
    }
    if builder.add_fde(start, covered_end, rows) {
        stats.overlapping_fdes += 1;
    }
    Ok(())
}

/// Counts a converted row in `stats`.
fn count(stats: &mut BuildStats, converted: &Converted) {
    match converted.unsupported {
        Some(Unsupported::CfaRegister) => stats.unsupported_cfa_register += 1,
        Some(Unsupported::CfaExpression) => stats.unsupported_cfa_expression += 1,
        Some(Unsupported::PltThreshold) => stats.unsupported_plt_threshold += 1,
        Some(Unsupported::ReturnAddress) => stats.unsupported_return_address += 1,
        Some(Unsupported::Other) => stats.unsupported_other += 1,
        None if converted.rule.cfa == CfaRule::End as u8 => stats.end_rows += 1,
        None if converted.rule.cfa == CfaRule::PltX86 as u8 => stats.plt_rows += 1,
        None => {}
    }
}
