//! The instruction sets heapprofd understands. Probe placement decodes machine code
//! and the unwind tables number registers by them; kept apart from both so neither
//! imports it from the other.

/// Instruction set of a probed library or an unwound object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// x86-64.
    X86_64,
    /// AArch64 (arm64).
    Aarch64,
}

impl Arch {
    /// The instruction set heapprofd runs on.
    #[cfg(target_arch = "aarch64")]
    pub const HOST: Arch = Arch::Aarch64;
    /// The instruction set heapprofd runs on.
    #[cfg(not(target_arch = "aarch64"))]
    pub const HOST: Arch = Arch::X86_64;

    /// The instruction set of an ELF file from its header, if one we can decode.
    pub fn of_elf_header(header: &[u8]) -> Option<Arch> {
        // e_machine, little-endian, at offset 18.
        match header.get(18..20)? {
            [62, 0] => Some(Arch::X86_64),
            [183, 0] => Some(Arch::Aarch64),
            _ => None,
        }
    }
}
