//! Unwind tables: each object's call-frame information (CFI) turned into the compact
//! rows and rules the BPF unwinder reads (see `heapprof_common::unwind`).
//!
//! [`build`] reads one ELF object (x86-64 or aarch64) and evaluates every FDE of its
//! `.eh_frame`, then of its `.debug_frame`, with gimli. Each row gimli produces becomes
//! an [`UnwindRule`] (how to find the CFA, the caller's frame pointer and return
//! address), and the rows of all FDEs are laid out as one sorted list of
//! [`UnwindRow`]s: a row's rule holds from its address up to the next row's, and
//! addresses no FDE covers get a [`RULE_NONE`] row. The BPF unwinder binary-searches
//! that list, so [`UnwindTable::rule_at`] does the same search here.
//!
//! Choices the BPF side relies on:
//! - Addresses are the ELF file's virtual addresses (before the load bias), as `u32`.
//! - Only FDEs that lie inside an executable `PT_LOAD` segment count: the others are
//!   placeholders of functions the linker discarded (address 0, or a tombstone value in
//!   `.debug_frame`) and no process ever executes them.
//! - Where FDEs overlap, the one read first wins: `.eh_frame` before `.debug_frame`,
//!   and within a section the one earlier in the section (what a linear FDE search, such
//!   as gimli's `fde_for_address`, finds). The later FDE keeps only the addresses no
//!   earlier one covers.
//! - An entry that cannot be parsed is skipped (its addresses become a gap, or are
//!   filled by `.debug_frame`); the rest of the section is still read, since the length
//!   prefix of each entry says where the next one starts. An FDE whose evaluation fails
//!   part-way keeps the rows evaluated before the failure; the rest of its addresses
//!   are treated as not covered by it.
//! - Consecutive rows with the same rule are merged and rules are deduplicated, so
//!   every rule of [`UnwindTable::rules`] is used by some row.

mod cfi;
mod elf;
mod table;
pub mod table_upload;
#[cfg(test)]
mod tests;

use heapprof_common::unwind::{MAX_OBJECT_ROWS, RULE_NONE, UnwindRow, UnwindRule};

use crate::arch::Arch;

/// An object's unwind table: rows sorted by `pc`, rule indices into `rules` (local to
/// this table) or [`RULE_NONE`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnwindTable {
    /// Rows sorted by strictly increasing `pc`. The last row is always a [`RULE_NONE`]
    /// row (the end of the last FDE); no two consecutive rows have the same rule.
    pub rows: Vec<UnwindRow>,
    /// The distinct rules the rows use, each used by at least one row.
    pub rules: Vec<UnwindRule>,
    /// The object's instruction set (it decides the DWARF register numbers).
    pub arch: Arch,
}

impl UnwindTable {
    /// The rule the BPF unwinder finds for `pc` (an ELF virtual address): the rule of the
    /// last row with `row.pc <= pc`; `None` before the first row, in a gap ([`RULE_NONE`])
    /// and beyond the last FDE.
    pub fn rule_at(&self, pc: u64) -> Option<&UnwindRule> {
        let after = self.rows.partition_point(|row| u64::from(row.pc) <= pc);
        let row = self.rows.get(after.checked_sub(1)?)?;
        if row.rule == RULE_NONE {
            return None;
        }
        self.rules.get(row.rule as usize)
    }
}

/// Counts of what [`build_with_stats`] met, for logs and tests. Row counts are of rows as
/// gimli evaluates them (before clipping overlaps and merging).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BuildStats {
    /// FDEs read from `.eh_frame`, kept or not.
    pub eh_frame_fdes: usize,
    /// FDEs read from `.debug_frame`, kept or not.
    pub debug_frame_fdes: usize,
    /// FDEs that could not be parsed (with their CIE) and were skipped, or whose
    /// evaluation failed part-way and were cut short.
    pub bad_entries: usize,
    /// Whether a section's entries stopped early: an entry's length ran past the end of
    /// the section (truncated or garbled), so what follows it could not be found.
    pub truncated: bool,
    /// FDEs skipped because they cover nothing or lie outside every executable segment.
    pub outside_code: usize,
    /// FDEs that overlap one read before them; they keep only the addresses not covered
    /// yet.
    pub overlapping_fdes: usize,
    /// Whether `.debug_frame` exists but could not be read (compressed with a method
    /// other than zlib, or damaged).
    pub debug_frame_unreadable: bool,
    /// Rows ending the stack ([`CfaRule::End`](heapprof_common::unwind::CfaRule::End)).
    pub end_rows: usize,
    /// Whether the code at the ELF entry point, which no FDE describes, was marked as
    /// the outermost frame (glibc's loader: see `cfi::add_start_code`).
    pub start_code: bool,
    /// Rows of x86-64 PLT entries ([`CfaRule::PltX86`](heapprof_common::unwind::CfaRule::PltX86)).
    pub plt_rows: usize,
    /// Unsupported rows: the CFA is based on a register other than SP and FP.
    pub unsupported_cfa_register: usize,
    /// Unsupported rows: the CFA is a DWARF expression other than the PLT one.
    pub unsupported_cfa_expression: usize,
    /// Unsupported rows: the PLT expression with another threshold than 11 (the lazy
    /// PLT of IBT-enabled x86-64 objects uses 9).
    pub unsupported_plt_threshold: usize,
    /// Unsupported rows: the return address is saved in a way the unwinder cannot
    /// follow (another register, an expression, or an x86-64 offset other than -8).
    pub unsupported_return_address: usize,
    /// Unsupported rows: an offset does not fit 32 bits, or the CIE names an unexpected
    /// return-address column.
    pub unsupported_other: usize,
}

/// Why an object has no unwind table.
#[derive(Debug, thiserror::Error)]
pub enum UnwindError {
    /// Not a little-endian 64-bit ELF file for x86-64 or aarch64.
    #[error("not an ELF file for x86-64 or aarch64")]
    UnsupportedArch,
    /// The ELF file could not be parsed.
    #[error("malformed ELF file: {0}")]
    Elf(#[from] object::read::Error),
    /// The ELF file has no executable `PT_LOAD` segment, so no code to unwind.
    #[error("the ELF file has no executable segment")]
    NoExecutableSegment,
    /// Neither `.eh_frame` nor `.debug_frame` describes any of the object's code.
    #[error("no call-frame information (.eh_frame, .debug_frame) covers the code")]
    NoCfi,
    /// Code described by CFI ends beyond 4 GiB: rows hold 32-bit addresses.
    #[error("call-frame information covers addresses up to {end:#x}, beyond 32 bits")]
    AddressTooLarge {
        /// One past the last address of the FDE that does not fit.
        end: u64,
    },
    /// More rows than an object may have in the BPF table.
    #[error("{rows} unwind rows, more than the {MAX_OBJECT_ROWS} an object may have")]
    TooManyRows {
        /// The number of rows the table would have.
        rows: usize,
    },
}

/// Builds the unwind table of one ELF object (its file's bytes).
pub fn build(elf: &[u8]) -> Result<UnwindTable, UnwindError> {
    build_with_stats(elf).map(|(table, _)| table)
}

/// Builds the unwind table of one ELF object, with counts of what was met on the way
/// (skipped entries, unsupported rules).
pub fn build_with_stats(elf: &[u8]) -> Result<(UnwindTable, BuildStats), UnwindError> {
    let arch = Arch::of_elf_header(elf).ok_or(UnwindError::UnsupportedArch)?;
    let mut stats = BuildStats::default();
    let sections = elf::read(elf, &mut stats)?;
    let mut builder = table::Builder::default();
    cfi::add_sections(arch, &sections, &mut builder, &mut stats)?;
    let (rows, rules) = builder.finish()?;
    Ok((UnwindTable { rows, rules, arch }, stats))
}
