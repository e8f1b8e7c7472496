//! The parts of an ELF file the unwind tables are built from: the CFI sections, the base
//! addresses their pointers are relative to, and the executable segments.

use std::{borrow::Cow, io::Read as _};

use object::{
    LittleEndian, Object as _, ObjectSection as _,
    elf::{PF_X, PT_GNU_EH_FRAME, PT_LOAD},
    read::{
        CompressionFormat,
        elf::{ElfFile64, ProgramHeader as _},
    },
};

use super::{BuildStats, UnwindError};

/// Largest `.debug_frame` decompressed: far more than any real object's, and a bound on
/// what a damaged header can make us allocate.
const MAX_DEBUG_FRAME: u64 = 256 << 20;

/// An `.eh_frame`: its bytes and the virtual address they are loaded at (pc-relative
/// pointers are relative to it).
pub(super) struct EhFrame<'a> {
    pub data: &'a [u8],
    pub address: u64,
}

/// What the CFI walk needs from an ELF file.
pub(super) struct CfiSections<'a> {
    pub eh_frame: Option<EhFrame<'a>>,
    /// `.debug_frame`, decompressed when it was compressed.
    pub debug_frame: Option<Cow<'a, [u8]>>,
    /// `.text`'s address, the base of `DW_EH_PE_textrel` pointers.
    pub text: Option<u64>,
    /// `.got`'s address, the base of `DW_EH_PE_datarel` pointers.
    pub got: Option<u64>,
    /// `[start, end)` virtual address ranges of the executable `PT_LOAD` segments,
    /// sorted by start.
    pub code: Vec<(u64, u64)>,
    /// The ELF entry point, where it is in an executable segment.
    pub entry: Option<u64>,
}

impl CfiSections<'_> {
    /// The end of the executable segment holding `address`, if one does.
    pub fn code_end(&self, address: u64) -> Option<u64> {
        let after = self.code.partition_point(|&(s, _)| s <= address);
        let &(_, end) = self.code.get(after.checked_sub(1)?)?;
        (address < end).then_some(end)
    }

    /// Whether `[start, end)` lies inside one executable segment.
    pub fn is_code(&self, start: u64, end: u64) -> bool {
        let after = self.code.partition_point(|&(s, _)| s <= start);
        after
            .checked_sub(1)
            .and_then(|i| self.code.get(i))
            .is_some_and(|&(_, e)| end <= e)
    }
}

/// Finds the CFI sections of a little-endian ELF64 file.
pub(super) fn read<'a>(
    file: &'a [u8],
    stats: &mut BuildStats,
) -> Result<CfiSections<'a>, UnwindError> {
    let elf = ElfFile64::<LittleEndian>::parse(file)?;
    let endian = elf.endian();
    let segments = elf.elf_program_headers();
    let mut code: Vec<(u64, u64)> = segments
        .iter()
        .filter(|ph| ph.p_type(endian) == PT_LOAD && ph.p_flags(endian).contains(PF_X))
        .map(|ph| {
            let start = ph.p_vaddr(endian);
            (start, start.saturating_add(ph.p_memsz(endian)))
        })
        .filter(|&(start, end)| start < end)
        .collect();
    if code.is_empty() {
        return Err(UnwindError::NoExecutableSegment);
    }
    code.sort_unstable();

    let address_of = |name: &str| elf.section_by_name(name).map(|s| s.address());
    let eh_frame = match elf.section_by_name(".eh_frame") {
        // An `.eh_frame` of type NOBITS (a separate debug file) reads as empty.
        Some(section) => Some(EhFrame {
            data: section.data()?,
            address: section.address(),
        }),
        // Stripped of its section headers: the loader's way, through `.eh_frame_hdr`.
        None => eh_frame_from_segments(&elf, file),
    };
    let debug_frame = debug_frame(&elf, stats);
    Ok(CfiSections {
        eh_frame,
        debug_frame,
        text: address_of(".text"),
        got: address_of(".got"),
        entry: Some(elf.entry()).filter(|&entry| {
            entry != 0
                && code
                    .iter()
                    .any(|&(start, end)| (start..end).contains(&entry))
        }),
        code,
    })
}

/// `.eh_frame` found as the runtime unwinder finds it: `PT_GNU_EH_FRAME` locates
/// `.eh_frame_hdr`, whose first pointer is `.eh_frame`'s address. Its size is unknown,
/// so the data runs to the end of the segment holding it (the walk stops at its zero
/// terminator).
fn eh_frame_from_segments<'a>(
    elf: &ElfFile64<'a, LittleEndian>,
    file: &'a [u8],
) -> Option<EhFrame<'a>> {
    let endian = elf.endian();
    let segments = elf.elf_program_headers();
    let hdr = segments
        .iter()
        .find(|ph| ph.p_type(endian) == PT_GNU_EH_FRAME)?;
    let hdr_address = hdr.p_vaddr(endian);
    let hdr_data = file_bytes(file, hdr.p_offset(endian), hdr.p_filesz(endian))?;
    let bases = gimli::BaseAddresses::default().set_eh_frame_hdr(hdr_address);
    let parsed = gimli::EhFrameHdr::new(hdr_data, gimli::LittleEndian)
        .parse(&bases, 8)
        .ok()?;
    let address = match parsed.eh_frame_ptr() {
        gimli::Pointer::Direct(address) => address,
        gimli::Pointer::Indirect(_) => return None,
    };
    // The loaded segment holding that address, and the file bytes from there to its end.
    segments.iter().find_map(|ph| {
        let start = ph.p_vaddr(endian);
        let size = ph.p_filesz(endian);
        if ph.p_type(endian) != PT_LOAD || address < start || address - start >= size {
            return None;
        }
        let skip = address - start;
        let data = file_bytes(file, ph.p_offset(endian).checked_add(skip)?, size - skip)?;
        Some(EhFrame { data, address })
    })
}

/// `len` bytes of the file from `offset`, if the file has them.
fn file_bytes(file: &[u8], offset: u64, len: u64) -> Option<&[u8]> {
    let start = usize::try_from(offset).ok()?;
    let end = start.checked_add(usize::try_from(len).ok()?)?;
    file.get(start..end)
}

/// `.debug_frame`, decompressed if need be. `None` (and `stats.debug_frame_unreadable`
/// when it exists) if it cannot be read: it only completes `.eh_frame`, so the table is
/// still worth building without it.
fn debug_frame<'a>(
    elf: &ElfFile64<'a, LittleEndian>,
    stats: &mut BuildStats,
) -> Option<Cow<'a, [u8]>> {
    let section = elf
        .section_by_name(".debug_frame")
        .or_else(|| elf.section_by_name(".zdebug_frame"))?;
    let data = match section.compressed_data() {
        Ok(compressed) => match compressed.format {
            CompressionFormat::None => Some(Cow::Borrowed(compressed.data)),
            CompressionFormat::Zlib => inflate(compressed.data, compressed.uncompressed_size),
            _ => None,
        },
        Err(_) => None,
    };
    stats.debug_frame_unreadable = data.is_none();
    data
}

/// Decompresses a zlib stream of `size` bytes (object reads compressed sections but
/// decompresses only with a feature this crate does not enable; flate2 is at hand).
fn inflate(data: &[u8], size: u64) -> Option<Cow<'static, [u8]>> {
    if size > MAX_DEBUG_FRAME {
        return None;
    }
    let mut out = Vec::new();
    flate2::read::ZlibDecoder::new(data)
        .take(size)
        .read_to_end(&mut out)
        .ok()?;
    (out.len() as u64 == size).then_some(Cow::Owned(out))
}
