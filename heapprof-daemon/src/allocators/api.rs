//! The functions of the allocators heapprofd knows, and where each keeps its size,
//! its block and its result.
//!
//! Names come in two families. The **standard** names (C's malloc family, C++'s
//! `operator new`/`delete`) exist in several objects of a process (glibc, a preloaded
//! jemalloc, a static allocator in the program), but calls go to one of them: the one
//! the dynamic linker binds `malloc` to. They are probed there only. The **vendor**
//! names (jemalloc's `mallocx` family and its `_rjem_`/`je_`-prefixed builds, tcmalloc's
//! `tc_*`, mimalloc's `mi_*`) belong to one allocator, and are probed wherever they are
//! defined: a Rust program's statically linked jemalloc is called under `_rjem_` names
//! while the C library still serves `malloc`.

use std::{collections::HashMap, sync::LazyLock};

use heapprof_common::{ProbeRole, ProbeSpec};

use crate::placement::{Needs, ValueRegisters};

/// Where a function's size comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Size {
    /// An argument (0-based).
    Arg(u8),
    /// A constant: a fixed-size pool's block size, or 0 for functions that free.
    Fixed(u64),
}

/// What a function does with memory and which arguments (0-based) say how much.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signature {
    /// Allocates, frees, moves or resizes.
    pub role: ProbeRole,
    /// The size in bytes.
    pub size: Size,
    /// A count the size is multiplied by.
    pub count: Option<u8>,
    /// The block freed, or the block moved or resized.
    pub ptr: Option<u8>,
    /// Where the new block is written (the call returns 0 on success).
    pub out: Option<u8>,
    /// The size is rounded up to whole pages (pvalloc).
    pub round_to_pages: bool,
}

impl Signature {
    const fn new(role: ProbeRole, size: Size) -> Self {
        Self {
            role,
            size,
            count: None,
            ptr: None,
            out: None,
            round_to_pages: false,
        }
    }

    /// Returns a block of the size in argument `size`.
    pub const fn alloc(size: u8) -> Self {
        Self::new(ProbeRole::Alloc, Size::Arg(size))
    }

    /// Returns a block of `count * size` bytes.
    pub const fn alloc_n(count: u8, size: u8) -> Self {
        let mut signature = Self::alloc(size);
        signature.count = Some(count);
        signature
    }

    /// Writes a block of the size in argument `size` through argument `out`, and
    /// returns 0 on success (posix_memalign).
    pub const fn alloc_out(out: u8, size: u8) -> Self {
        let mut signature = Self::alloc(size);
        signature.out = Some(out);
        signature
    }

    /// Returns whole pages (pvalloc).
    pub const fn alloc_pages(size: u8) -> Self {
        let mut signature = Self::alloc(size);
        signature.round_to_pages = true;
        signature
    }

    /// Frees the block in argument `ptr`.
    pub const fn free(ptr: u8) -> Self {
        let mut signature = Self::new(ProbeRole::Free, Size::Fixed(0));
        signature.ptr = Some(ptr);
        signature
    }

    /// Moves the block in argument `ptr` to a new one of the size in argument `size`.
    pub const fn realloc(ptr: u8, size: u8) -> Self {
        let mut signature = Self::new(ProbeRole::Realloc, Size::Arg(size));
        signature.ptr = Some(ptr);
        signature
    }

    /// Moves the block in argument `ptr` to a new one of `count * size` bytes.
    pub const fn realloc_n(ptr: u8, count: u8, size: u8) -> Self {
        let mut signature = Self::realloc(ptr, size);
        signature.count = Some(count);
        signature
    }

    /// Resizes the block in argument `ptr` where it is, returning its usable size.
    pub const fn resize_in_place(ptr: u8, size: u8) -> Self {
        let mut signature = Self::new(ProbeRole::ResizeInPlace, Size::Arg(size));
        signature.ptr = Some(ptr);
        signature
    }

    /// The arguments an entry program reads for this signature.
    pub fn needs(&self) -> Needs {
        Needs {
            size: match self.size {
                Size::Arg(index) => Some(index),
                Size::Fixed(_) => None,
            },
            count: self.count,
            ptr: self.ptr,
            out: self.out,
        }
    }

    /// The programs' form of this signature, for a probe at `probe_offset` where the
    /// values it reads are in `registers` and the stack pointer is `sp_adjust` bytes
    /// below its value at the entry, in an object whose code spans the file offsets
    /// `text`.
    pub fn spec(
        &self,
        probe_offset: u64,
        (registers, sp_adjust): (ValueRegisters, u32),
        text: (u64, u64),
    ) -> ProbeSpec {
        let fixed_size = match self.size {
            Size::Arg(_) => 0,
            Size::Fixed(bytes) => bytes,
        };
        ProbeSpec {
            probe_offset,
            text_start: text.0,
            text_end: text.1,
            function_start: 0,
            function_end: 0,
            fixed_size,
            role: self.role as u32,
            size_reg: registers.size,
            count_reg: registers.count,
            ptr_reg: registers.ptr,
            out_reg: registers.out,
            round_to_pages: u32::from(self.round_to_pages),
            in_use: 1,
            in_library: 0,
            sp_adjust,
            frame_bytes: heapprof_common::UNKNOWN_FRAME_BYTES,
            session: 0,
        }
    }
}

/// Where a function's name says it may be called from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    /// C and C++ names: probed in the object a process's `malloc` binds to.
    Standard,
    /// One allocator's own names: probed wherever defined.
    Vendor,
    /// Named with `--allocator`: probed wherever defined.
    Custom,
}

/// A function heapprofd may probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownFunction {
    /// Its symbol.
    pub name: String,
    /// Where it is probed.
    pub family: Family,
    /// What it does.
    pub signature: Signature,
    /// Its place in the lists: when several names share one address, the function is
    /// probed once, under the lowest rank (`malloc` rather than `mi_malloc`).
    pub rank: usize,
}

const fn f(name: &'static str, signature: Signature) -> (&'static str, Signature) {
    (name, signature)
}

/// C's allocation functions, as glibc, musl and every replacement define them.
const C_FUNCTIONS: &[(&str, Signature)] = &[
    f("malloc", Signature::alloc(0)),
    f("calloc", Signature::alloc_n(0, 1)),
    f("realloc", Signature::realloc(0, 1)),
    f("reallocarray", Signature::realloc_n(0, 1, 2)),
    f("posix_memalign", Signature::alloc_out(0, 2)),
    f("aligned_alloc", Signature::alloc(1)),
    f("memalign", Signature::alloc(1)),
    f("valloc", Signature::alloc(0)),
    f("pvalloc", Signature::alloc_pages(0)),
    f("free", Signature::free(0)),
    f("cfree", Signature::free(0)),
];

/// C++'s replaceable `operator new`/`delete` (Itanium ABI, 64-bit `size_t`). Where the
/// C++ library's own call `malloc`, the call is counted there; allocators that define
/// them (tcmalloc, jemalloc) bypass `malloc`, so they are probed in those.
const CXX_FUNCTIONS: &[(&str, Signature)] = &[
    f("_Znwm", Signature::alloc(0)),
    f("_Znam", Signature::alloc(0)),
    f("_ZnwmRKSt9nothrow_t", Signature::alloc(0)),
    f("_ZnamRKSt9nothrow_t", Signature::alloc(0)),
    f("_ZnwmSt11align_val_t", Signature::alloc(0)),
    f("_ZnamSt11align_val_t", Signature::alloc(0)),
    f("_ZnwmSt11align_val_tRKSt9nothrow_t", Signature::alloc(0)),
    f("_ZnamSt11align_val_tRKSt9nothrow_t", Signature::alloc(0)),
    f("_ZdlPv", Signature::free(0)),
    f("_ZdaPv", Signature::free(0)),
    f("_ZdlPvm", Signature::free(0)),
    f("_ZdaPvm", Signature::free(0)),
    f("_ZdlPvRKSt9nothrow_t", Signature::free(0)),
    f("_ZdaPvRKSt9nothrow_t", Signature::free(0)),
    f("_ZdlPvSt11align_val_t", Signature::free(0)),
    f("_ZdaPvSt11align_val_t", Signature::free(0)),
    f("_ZdlPvmSt11align_val_t", Signature::free(0)),
    f("_ZdaPvmSt11align_val_t", Signature::free(0)),
    f("_ZdlPvSt11align_val_tRKSt9nothrow_t", Signature::free(0)),
    f("_ZdaPvSt11align_val_tRKSt9nothrow_t", Signature::free(0)),
];

/// jemalloc's non-standard API (`nallocx`/`sallocx` only query sizes).
const JEMALLOC_FUNCTIONS: &[(&str, Signature)] = &[
    f("mallocx", Signature::alloc(0)),
    f("rallocx", Signature::realloc(0, 1)),
    f("xallocx", Signature::resize_in_place(0, 1)),
    f("sdallocx", Signature::free(0)),
    f("dallocx", Signature::free(0)),
];

/// Prefixes of jemalloc builds that keep the C names free: `_rjem_` (Rust's
/// tikv-jemallocator), `je_` (`--with-jemalloc-prefix=je_`, as Redis builds it).
const JEMALLOC_PREFIXES: &[&str] = &["_rjem_", "je_"];

/// tcmalloc's own names (gperftools), which its C and C++ names alias.
const TCMALLOC_FUNCTIONS: &[(&str, Signature)] = &[
    f("tc_malloc", Signature::alloc(0)),
    f("tc_malloc_skip_new_handler", Signature::alloc(0)),
    f("tc_calloc", Signature::alloc_n(0, 1)),
    f("tc_realloc", Signature::realloc(0, 1)),
    f("tc_memalign", Signature::alloc(1)),
    f("tc_posix_memalign", Signature::alloc_out(0, 2)),
    f("tc_valloc", Signature::alloc(0)),
    f("tc_pvalloc", Signature::alloc_pages(0)),
    f("tc_free", Signature::free(0)),
    f("tc_free_sized", Signature::free(0)),
    f("tc_cfree", Signature::free(0)),
    f("tc_new", Signature::alloc(0)),
    f("tc_newarray", Signature::alloc(0)),
    f("tc_new_nothrow", Signature::alloc(0)),
    f("tc_newarray_nothrow", Signature::alloc(0)),
    f("tc_new_aligned", Signature::alloc(0)),
    f("tc_newarray_aligned", Signature::alloc(0)),
    f("tc_new_aligned_nothrow", Signature::alloc(0)),
    f("tc_newarray_aligned_nothrow", Signature::alloc(0)),
    f("tc_delete", Signature::free(0)),
    f("tc_deletearray", Signature::free(0)),
    f("tc_delete_sized", Signature::free(0)),
    f("tc_deletearray_sized", Signature::free(0)),
    f("tc_delete_nothrow", Signature::free(0)),
    f("tc_deletearray_nothrow", Signature::free(0)),
    f("tc_delete_aligned", Signature::free(0)),
    f("tc_deletearray_aligned", Signature::free(0)),
    f("tc_delete_sized_aligned", Signature::free(0)),
    f("tc_deletearray_sized_aligned", Signature::free(0)),
    f("tc_delete_aligned_nothrow", Signature::free(0)),
    f("tc_deletearray_aligned_nothrow", Signature::free(0)),
];

/// mimalloc's own names. Left out: `mi_reallocf` (frees the block when it fails) and
/// `mi_expand` (returns the block, not its size), whose results the roles cannot
/// express; `mi_strdup` and the like, whose size is unknown at entry (the `mi_malloc`
/// they call is counted).
const MIMALLOC_FUNCTIONS: &[(&str, Signature)] = &[
    f("mi_malloc", Signature::alloc(0)),
    f("mi_zalloc", Signature::alloc(0)),
    f("mi_calloc", Signature::alloc_n(0, 1)),
    f("mi_mallocn", Signature::alloc_n(0, 1)),
    f("mi_malloc_small", Signature::alloc(0)),
    f("mi_zalloc_small", Signature::alloc(0)),
    f("mi_realloc", Signature::realloc(0, 1)),
    f("mi_reallocn", Signature::realloc_n(0, 1, 2)),
    f("mi_reallocarray", Signature::realloc_n(0, 1, 2)),
    f("mi_malloc_aligned", Signature::alloc(0)),
    f("mi_malloc_aligned_at", Signature::alloc(0)),
    f("mi_zalloc_aligned", Signature::alloc(0)),
    f("mi_calloc_aligned", Signature::alloc_n(0, 1)),
    f("mi_realloc_aligned", Signature::realloc(0, 1)),
    f("mi_posix_memalign", Signature::alloc_out(0, 2)),
    f("mi_memalign", Signature::alloc(1)),
    f("mi_aligned_alloc", Signature::alloc(1)),
    f("mi_valloc", Signature::alloc(0)),
    f("mi_pvalloc", Signature::alloc_pages(0)),
    f("mi_new", Signature::alloc(0)),
    f("mi_new_nothrow", Signature::alloc(0)),
    f("mi_new_aligned", Signature::alloc(0)),
    f("mi_new_aligned_nothrow", Signature::alloc(0)),
    f("mi_new_n", Signature::alloc_n(0, 1)),
    f("mi_new_realloc", Signature::realloc(0, 1)),
    f("mi_new_reallocn", Signature::realloc_n(0, 1, 2)),
    f("mi_heap_malloc", Signature::alloc(1)),
    f("mi_heap_zalloc", Signature::alloc(1)),
    f("mi_heap_calloc", Signature::alloc_n(1, 2)),
    f("mi_heap_mallocn", Signature::alloc_n(1, 2)),
    f("mi_heap_malloc_small", Signature::alloc(1)),
    f("mi_heap_malloc_aligned", Signature::alloc(1)),
    f("mi_heap_realloc", Signature::realloc(1, 2)),
    f("mi_free", Signature::free(0)),
    f("mi_cfree", Signature::free(0)),
    f("mi_free_size", Signature::free(0)),
    f("mi_free_aligned", Signature::free(0)),
    f("mi_free_size_aligned", Signature::free(0)),
];

/// Every known function by name.
static KNOWN: LazyLock<HashMap<String, KnownFunction>> = LazyLock::new(|| {
    let mut all: Vec<(String, Family, Signature)> = Vec::new();
    for (name, signature) in C_FUNCTIONS.iter().chain(CXX_FUNCTIONS) {
        all.push(((*name).to_owned(), Family::Standard, *signature));
    }
    let vendor = JEMALLOC_FUNCTIONS
        .iter()
        .chain(TCMALLOC_FUNCTIONS)
        .chain(MIMALLOC_FUNCTIONS);
    for (name, signature) in vendor {
        all.push(((*name).to_owned(), Family::Vendor, *signature));
    }
    for prefix in JEMALLOC_PREFIXES {
        for (name, signature) in C_FUNCTIONS.iter().chain(JEMALLOC_FUNCTIONS) {
            all.push((format!("{prefix}{name}"), Family::Vendor, *signature));
        }
    }
    all.into_iter()
        .enumerate()
        .map(|(rank, (name, family, signature))| {
            let function = KnownFunction {
                name: name.clone(),
                family,
                signature,
                rank,
            };
            (name, function)
        })
        .collect()
});

/// The known function named `symbol`, if any.
pub fn known(symbol: &str) -> Option<&'static KnownFunction> {
    KNOWN.get(symbol)
}

#[cfg(test)]
mod tests {
    use super::*;
    use heapprof_common::NO_REGISTER;

    use crate::arch::Arch;

    #[test]
    fn standard_names_rank_before_vendor_aliases() {
        let malloc = known("malloc").expect("malloc");
        let mi_malloc = known("mi_malloc").expect("mi_malloc");
        let tc_malloc = known("tc_malloc").expect("tc_malloc");
        assert_eq!(malloc.family, Family::Standard);
        assert_eq!(mi_malloc.family, Family::Vendor);
        assert!(malloc.rank < mi_malloc.rank && malloc.rank < tc_malloc.rank);
    }

    #[test]
    fn prefixed_jemalloc_builds_are_known() {
        for name in ["_rjem_malloc", "_rjem_sdallocx", "_rjem_rallocx", "je_free"] {
            assert_eq!(
                known(name).map(|f| f.family),
                Some(Family::Vendor),
                "{name}"
            );
        }
        assert_eq!(
            known("_rjem_rallocx").map(|f| f.signature),
            Some(Signature::realloc(0, 1))
        );
        assert!(
            known("_rjem_nallocx").is_none(),
            "size queries are not probed"
        );
    }

    #[test]
    fn specs_carry_the_registers_at_the_probe_spot() {
        let spec = |name: &str| {
            let signature = known(name).expect(name).signature;
            let registers = ValueRegisters::at_entry(Arch::X86_64, signature.needs());
            signature.spec(0x10, (registers, 0), (0, 0x100))
        };
        // DWARF numbers: rdi 5, rsi 4, rdx 1.
        let calloc = spec("calloc");
        assert_eq!((calloc.count_reg, calloc.size_reg), (5, 4));
        assert_eq!(calloc.role, ProbeRole::Alloc as u32);
        let free = spec("free");
        assert_eq!(
            (free.ptr_reg, free.size_reg, free.fixed_size),
            (5, NO_REGISTER, 0)
        );
        let memalign = spec("posix_memalign");
        assert_eq!((memalign.out_reg, memalign.size_reg), (5, 1));
        assert_eq!(spec("pvalloc").round_to_pages, 1);
        // Registers a placement moved the values to are what the programs read.
        let malloc = known("malloc").expect("malloc").signature;
        let moved = ValueRegisters {
            size: 0,
            ..ValueRegisters::at_entry(Arch::X86_64, malloc.needs())
        };
        assert_eq!(malloc.spec(0, (moved, 0), (0, 1)).size_reg, 0);
    }
}
