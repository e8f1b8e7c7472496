//! The interface between heapprofd's preload library (launch mode's interposer) and
//! the BPF program on its probe site.
//!
//! The library wraps the C and C++ allocation functions of the processes heapprofd
//! launches. After an allocation returns it calls one function, the *probe site*: a
//! 5-byte NOP and a `ret` (x86-64; `nop; ret` on arm64), on which heapprofd puts one
//! uprobe. Linux 6.18 turns a uprobe on such a NOP into a call instead of a trap. The
//! call passes, in argument registers (x86-64: rdi, rsi, rdx, rcx, r8, r9, rax; arm64:
//! x0 to x6):
//!
//! | # | value |
//! |---|-------|
//! | 0 | the new block (0 for [`Kind::Flush`]; for [`Kind::Hello`], where the library's code starts) |
//! | 1 | its size in bytes, as the user asked (for [`Kind::Hello`], where its code ends) |
//! | 2 | the wrapper's return address: the allocation site in the caller |
//! | 3 | the caller's stack pointer after that return (the wrapper's CFA) |
//! | 4 | the caller's frame pointer |
//! | 5 | the address of the thread's [`FreeQueue`] |
//! | 6 | the meta word: function, [`Kind`], queued frees, flags ([`Meta`]) |
//!
//! Registers 2 to 4 are what a return probe in the caller would see, so the unwinder
//! starts there and the stack is rooted at the allocation site.
//!
//! Frees need no stack: the library queues them per thread and the program applies
//! the queue before the allocation it comes with (an address the allocator reuses is
//! thus freed before it is allocated again), when the queue fills ([`Kind::Flush`]),
//! or when the thread exits (the exit tracepoint reads the queue through the address
//! registered by the thread's first report).
//!
//! The C side of this interface is generated from these constants by the daemon's
//! build script (`preload_abi.h`), so this module is its one definition.

/// Frees a thread queues before it reports them.
pub const FREE_QUEUE_LEN: usize = 62;

/// A thread's queued frees, in the preload library's thread-local storage.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FreeQueue {
    /// The blocks freed, oldest first.
    pub frees: [u64; FREE_QUEUE_LEN],
    /// How many of `frees` are in use (read by the exit tracepoint only; reports carry
    /// the count in their meta word).
    pub count: u32,
    /// Library-private state after the queue (nesting depth and the like).
    pub _private: u32,
}

/// What a call of the probe site reports.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An allocation (after the queued frees).
    Alloc = 0,
    /// Only the queued frees: the queue is full, or the thread is about to fork or exit.
    Flush = 1,
    /// The library serves this process's allocations: the allocator's own probes, if
    /// any are attached, must not count its calls again.
    Hello = 2,
}

impl Kind {
    /// The kind in a meta word's kind field.
    pub const fn from_u32(value: u32) -> Option<Kind> {
        Some(match value {
            0 => Kind::Alloc,
            1 => Kind::Flush,
            2 => Kind::Hello,
            _ => return None,
        })
    }
}

/// The fields of the meta word (register 6).
pub struct Meta;

impl Meta {
    /// Bits 0-7: the wrapped function, an index into [`FUNCTIONS`].
    pub const FUNCTION_MASK: u64 = 0xff;
    /// Bits 8-15: the [`Kind`].
    pub const KIND_SHIFT: u32 = 8;
    /// Bits 16-23: how many frees are queued.
    pub const COUNT_SHIFT: u32 = 16;
    /// Bit 24: the thread's first report: register its queue's address for its exit.
    pub const REGISTER_QUEUE: u64 = 1 << 24;
}

/// The functions the library wraps, in the order of their function numbers, with the
/// role each has in profiles.
pub const FUNCTIONS: [(&str, crate::ProbeRole); 31] = {
    use crate::ProbeRole::{Alloc, Free, Realloc};
    [
        ("malloc", Alloc),
        ("calloc", Alloc),
        ("realloc", Realloc),
        ("reallocarray", Realloc),
        ("posix_memalign", Alloc),
        ("aligned_alloc", Alloc),
        ("memalign", Alloc),
        ("valloc", Alloc),
        ("pvalloc", Alloc),
        ("free", Free),
        ("cfree", Free),
        ("_Znwm", Alloc),
        ("_Znam", Alloc),
        ("_ZnwmRKSt9nothrow_t", Alloc),
        ("_ZnamRKSt9nothrow_t", Alloc),
        ("_ZnwmSt11align_val_t", Alloc),
        ("_ZnamSt11align_val_t", Alloc),
        ("_ZnwmSt11align_val_tRKSt9nothrow_t", Alloc),
        ("_ZnamSt11align_val_tRKSt9nothrow_t", Alloc),
        ("_ZdlPv", Free),
        ("_ZdaPv", Free),
        ("_ZdlPvm", Free),
        ("_ZdaPvm", Free),
        ("_ZdlPvRKSt9nothrow_t", Free),
        ("_ZdaPvRKSt9nothrow_t", Free),
        ("_ZdlPvSt11align_val_t", Free),
        ("_ZdaPvSt11align_val_t", Free),
        ("_ZdlPvmSt11align_val_t", Free),
        ("_ZdaPvmSt11align_val_t", Free),
        ("_ZdlPvSt11align_val_tRKSt9nothrow_t", Free),
        ("_ZdaPvSt11align_val_tRKSt9nothrow_t", Free),
    ]
};

/// What [`Kind::Hello`] tells of a process (the `PRELOADED` map's value): where the
/// library's code is. Probe hits on the allocator whose return address is there (the
/// library's own calls) or in the allocator's own code (its internal calls) are not
/// the program's calls: the library reports those.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Preloaded {
    /// First address of the library's mapping.
    pub text_start: u64,
    /// End of its code.
    pub text_end: u64,
}

/// The symbol of the probe site in the library.
pub const PROBE_SITE_SYMBOL: &str = "heapprofd_preload_probe";

/// The environment variable that gives the library the sample rate (mean bytes
/// between sampled allocations; absent or 0: every allocation).
pub const SAMPLE_RATE_ENV: &str = "HEAPPROFD_SAMPLE_RATE";
