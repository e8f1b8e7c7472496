//! The BPF object the daemon embeds, for the tests that read it without loading it
//! (`bpf_names.rs`, `bpf_stack.rs`).

use object::{ObjectSection, ObjectSymbol, SectionKind, SymbolKind};

/// The object the daemon embeds (see `probes::BPF_OBJECT`).
pub static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/heapprof"));

/// Whether `symbol`, in `section`, is a program: a global function in an executable
/// section other than `.text`, which holds the functions the programs call.
pub fn is_program<'data>(
    symbol: &impl ObjectSymbol<'data>,
    section: &impl ObjectSection<'data>,
) -> bool {
    symbol.kind() == SymbolKind::Text
        && symbol.is_global()
        && section.kind() == SectionKind::Text
        && section.name().unwrap_or_default() != ".text"
}
