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
//! | 5 | the address of the thread's [`ReportQueue`] |
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
//! Allocations at a stack the program has walked before need no probe either: the
//! program answers a report with the places of the stack words its walk read
//! ([`StackReply`]), the library keeps them per thread, and an allocation whose
//! caller's registers and those words are unchanged is queued with the stack's hash.
//! The program counts it when it applies the queue, in order with the frees.
//!
//! The C side of this interface is generated from these constants by the daemon's
//! build script (`preload_abi.h`), so this module is its one definition.

/// Words of a thread's report queue.
pub const QUEUE_WORDS: usize = 126;

/// A thread's queued reports, in the preload library's thread-local storage: frees,
/// and allocations at stacks the program has already unwound for this thread (see
/// [`StackReply`]), as records of [`Record`]'s forms, oldest first.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ReportQueue {
    /// How many of `words` are in use (reports also carry it in their meta word). The
    /// library writes it after the words it covers.
    pub len: u32,
    /// Counts the queue's reports: the library empties the queue after each and then
    /// adds 1, so the program can tell a queue it has partly applied (when the thread
    /// was switched out, see [`QueueState`]) from a new one.
    pub generation: u32,
    /// The records.
    pub words: [u64; QUEUE_WORDS],
}

/// What the program keeps of a thread's queue (the `REPORT_QUEUES` map's value): its
/// address, and how much of which generation it has applied. Records reach the
/// program with the thread's reports, and also whenever the thread is switched out
/// (`sched_switch`), so that a thread that allocates and then waits is not left out
/// of interval profiles and in-use peaks, and whenever it calls `futex`: a thread
/// that wakes another through the kernel (a mutex, condition variable or barrier
/// with waiters) calls it first, so a block freed by the woken thread is never taken
/// off the in-use total before one its waker allocated earlier is added.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct QueueState {
    /// The queue's address in the thread's process; 0 from the thread's `execve` until
    /// its old image reports again (a failed exec) or its entry goes (a done one).
    pub address: u64,
    /// The generation `applied` belongs to.
    pub generation: u32,
    /// Words of that generation already applied.
    pub applied: u32,
    /// The block of the thread's last allocation the program applied, until it is
    /// freed or the thread allocates again (0: none): a free of it is a temporary
    /// allocation's.
    pub last_block: u64,
}

/// The forms of a [`ReportQueue`]'s records.
///
/// A word with bit 0 clear is the free of that address (every block the C and C++
/// allocation functions return is at least 8-aligned). A word with bit 0 set opens a
/// three-word record: this header, an address, and a stack hash. The header's bit 1
/// says the record frees the address (an odd one) rather than allocating it; bits 2-7
/// are the allocating function's number ([`FUNCTIONS`]) and bits 8-63 the size.
pub struct Record;

impl Record {
    /// Header bit 0: a three-word record.
    pub const EXTENDED: u64 = 1;
    /// Header bit 1: the record frees its address.
    pub const FREE: u64 = 2;
    /// Header bits 2-7: the function.
    pub const FUNCTION_SHIFT: u32 = 2;
    /// Header bits 2-7, in place.
    pub const FUNCTION_MASK: u64 = 0x3f;
    /// Header bits 8-63: the size.
    pub const SIZE_SHIFT: u32 = 8;
    /// Words of an extended record.
    pub const EXTENDED_WORDS: u32 = 3;
}

/// Stack reads a [`StackReply`] lists at most: deeper walks are not answered.
pub const REPLY_READS: usize = 64;

/// What the program answers (in the thread's slot of `REPLIES`, see [`REPLY_SLOTS`])
/// to an allocation whose stack walk was complete and
/// depended only on the caller's registers and the stack words it read: those words'
/// places. While the caller's return address, stack pointer (and frame pointer, if
/// `uses_fp`) and those words are unchanged, a walk would find the same frames, so
/// the library queues such allocations with `hash` instead of calling the probe site.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StackReply {
    /// The stack's hash (a site key's `stack`).
    pub hash: u64,
    /// [`StackReply::KNOWN`] when answered; the library clears it before each report.
    pub status: u32,
    /// How many of `offsets` are used.
    pub reads: u32,
    /// Whether the walk used the caller's frame pointer register.
    pub uses_fp: u32,
    /// Explicit padding.
    pub _pad: u32,
    /// The words read, as byte offsets from the caller's stack pointer, in walk order.
    pub offsets: [i32; REPLY_READS],
}

impl StackReply {
    /// `status` of an answered report.
    pub const KNOWN: u32 = 1;
}

/// Slots of the `REPLIES` map (a memory-mappable array of [`StackReply`]), where the
/// program answers allocation reports: slot 0 is the library's (its `hash` counts the
/// slots taken), each thread takes one of the others for good, and a thread that
/// finds none left reports every allocation through the probe site.
///
/// The daemon hands the map to the command it launches as file descriptor
/// [`REPLIES_FD`] (named by [`REPLIES_FD_ENV`]), which the library maps; commands the
/// program execs inherit it.
pub const REPLY_SLOTS: u32 = 4096;

/// The file descriptor the launched command finds the `REPLIES` map at.
pub const REPLIES_FD: i32 = 1000;

/// The environment variable naming [`REPLIES_FD`] to the library.
pub const REPLIES_FD_ENV: &str = "HEAPPROFD_REPLIES_FD";

/// What a call of the probe site reports.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An allocation (after the queued records).
    Alloc = 0,
    /// Only the queued records: the queue is full, or the thread is about to fork or exit.
    Flush = 1,
    /// The library serves this process's allocations: the allocator's own probes, if
    /// any are attached, must not count its calls again.
    Hello = 2,
    /// A free that could not be queued (a signal handler's, while the thread it
    /// interrupted was changing its queue): the block is register 0.
    Free = 3,
}

impl Kind {
    /// The kind in a meta word's kind field.
    pub const fn from_u32(value: u32) -> Option<Kind> {
        Some(match value {
            0 => Kind::Alloc,
            1 => Kind::Flush,
            2 => Kind::Hello,
            3 => Kind::Free,
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
    /// Bits 16-23: how many words of the queue are in use.
    pub const COUNT_SHIFT: u32 = 16;
    /// Bit 24: the thread's first report: register its queue's address for its exit.
    pub const REGISTER_QUEUE: u64 = 1 << 24;
    /// Bit 25: the thread's last report (its state goes to another thread): forget its
    /// queue's address after applying the queue.
    pub const UNREGISTER_QUEUE: u64 = 1 << 25;
    /// Bit 26: the thread's queue is being changed (the report comes from a signal
    /// handler that interrupted the library there): the program leaves it alone, and
    /// the records it is getting are applied with a later report.
    pub const QUEUE_BUSY: u64 = 1 << 26;
    /// Bits 32-47: the thread's slot of the `REPLIES` map ([`REPLY_SLOTS`]), 0 if none.
    pub const SLOT_SHIFT: u32 = 32;
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

/// The environment variable with which an injected library follows its process through
/// an exec: `LIBRARY,REPLIES,PIDFD,RATE,CHILDREN`, the descriptors (inherited through
/// the exec) of the library's own file, the answers' map and heapprofd's pidfd, the
/// sample rate, and whether forked children stay joined (1) or not (0). The new image's copy, preloaded from the library's descriptor, removes it.
pub const FOLLOW_ENV: &str = "HEAPPROFD_FOLLOW";

/// The system-wide preload (`heapprofd --all --preload system`): the socket where a
/// running heapprofd answers each new process's copy of the library. A copy that
/// cannot connect (no heapprofd, or one killed) stays inert; one that can joins as an
/// injected copy does. The socket is of type `SOCK_SEQPACKET`, owned by root.
pub const SYSTEM_SOCKET: &str = "/run/heapprofd/system.sock";

/// The environment variable that keeps a program out of the system-wide preload: set
/// to [`SYSTEM_OPT_OUT_VALUE`], the copy `/etc/ld.so.preload` loads into the program
/// never asks to join, and the system-wide heapprofd neither joins nor probes it. Its
/// children and the programs it execs inherit it with the environment. (So that a
/// program can be left to `heapprofd --pid` or launch mode, or to no profiler at all.)
pub const SYSTEM_OPT_OUT_ENV: &str = "HEAPPROFD_SYSTEM_PRELOAD";

/// The value of [`SYSTEM_OPT_OUT_ENV`] that keeps a program out.
pub const SYSTEM_OPT_OUT_VALUE: &str = "off";

/// Where `--preload system` installs its library (root-owned, readable by every
/// program: not in the profiles' directory, which is private; it stays after heapprofd
/// exits, inert, so that an entry left in `/etc/ld.so.preload` never names a missing
/// file).
pub const SYSTEM_LIBRARY: &str = "/var/lib/heapprofd-preload/libheapprofd-system.so";

/// What heapprofd sends a system-preloaded copy that connects: the sample rate and
/// the join's flags, with the answers' map and heapprofd's pidfd as `SCM_RIGHTS`
/// descriptors; the copy answers with its join's result (an `i64`: slots redirected,
/// or negative: why not).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SystemJoin {
    /// Mean bytes between sampled allocations (0: every allocation).
    pub sample_rate: u64,
    /// [`SystemJoin::CHILDREN`] when forked children stay joined.
    pub flags: u64,
}

impl SystemJoin {
    /// Forked children stay joined (heapprofd traces them too).
    pub const CHILDREN: u64 = 1;
}

/// Why the library did not join: the negative results of `heapprofd_join`, of a
/// system-wide copy's answer on [`SYSTEM_SOCKET`] and of `heapprofd_system_ask` (the
/// interposer's `join_error`, generated from this).
#[repr(i64)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JoinRefused {
    /// A copy launched with the program (`LD_PRELOAD`), not one waiting for a join.
    NotInjected = -1,
    /// The copy is joined already.
    Already = -2,
    /// The answers' map and heapprofd's pidfd did not arrive.
    NoDescriptors = -3,
    /// The process binds no `malloc` and `free` of its own.
    NoAllocator = -4,
    /// None of the process's allocator slots (GOT entries) could be redirected.
    NoSlots = -5,
    /// `heapprofd_system_ask` only: the copy never asked (no socket, one that refuses
    /// or is not root's, or a program under valgrind); never sent on the socket.
    NotAsked = -6,
    /// `heapprofd_system_ask` only: the copy's start is asking at this very moment.
    Asking = -7,
}

impl JoinRefused {
    /// Every reason, for the generated C header.
    pub const ALL: [JoinRefused; 7] = [
        JoinRefused::NotInjected,
        JoinRefused::Already,
        JoinRefused::NoDescriptors,
        JoinRefused::NoAllocator,
        JoinRefused::NoSlots,
        JoinRefused::NotAsked,
        JoinRefused::Asking,
    ];

    /// The reason a negative join result stands for, if it is one of these.
    pub fn from_result(result: i64) -> Option<JoinRefused> {
        Self::ALL
            .into_iter()
            .find(|reason| *reason as i64 == result)
    }

    /// Its name in the interposer's C code.
    pub const fn c_name(self) -> &'static str {
        match self {
            JoinRefused::NotInjected => "JOIN_NOT_INJECTED",
            JoinRefused::Already => "JOIN_ALREADY",
            JoinRefused::NoDescriptors => "JOIN_NO_DESCRIPTORS",
            JoinRefused::NoAllocator => "JOIN_NO_ALLOCATOR",
            JoinRefused::NoSlots => "JOIN_NO_SLOTS",
            JoinRefused::NotAsked => "JOIN_NOT_ASKED",
            JoinRefused::Asking => "JOIN_ASKING",
        }
    }

    /// Why, in words for the user.
    pub const fn describe(self) -> &'static str {
        match self {
            JoinRefused::NotInjected => {
                "the library in the process was launched with it, not injected"
            }
            JoinRefused::Already => {
                "heapprofd's library in the process is joined to another heapprofd"
            }
            JoinRefused::NoDescriptors => "the library received no descriptors",
            JoinRefused::NoAllocator => "the process binds no malloc and free",
            JoinRefused::NoSlots => {
                "none of the process's allocator calls could be redirected (no GOT slot names \
                 malloc or free, or their pages could not be made writable)"
            }
            JoinRefused::NotAsked => {
                "the system-wide library did not ask heapprofd (it found no socket it could \
                 join, or the program runs under valgrind)"
            }
            JoinRefused::Asking => "the system-wide library was asking to join at that moment",
        }
    }
}

/// The prefix under which the following library keeps an exec's own `LD_PRELOAD=...`:
/// the new image's copy points the environment back at the text after it.
pub const KEPT_PRELOAD_PREFIX: &str = "HEAPPROFD_KEPT_";

#[cfg(test)]
mod tests {
    use super::JoinRefused;

    #[test]
    fn every_join_refusal_reads_back_from_its_code_and_has_its_own_c_name() {
        for (index, reason) in JoinRefused::ALL.into_iter().enumerate() {
            assert_eq!(JoinRefused::from_result(reason as i64), Some(reason));
            for other in &JoinRefused::ALL[index + 1..] {
                assert_ne!(reason.c_name(), other.c_name());
            }
        }
        // Slots redirected are positive; 0 and unknown codes are no reason.
        assert_eq!(JoinRefused::from_result(3), None);
        assert_eq!(JoinRefused::from_result(0), None);
        assert_eq!(JoinRefused::from_result(-100), None);
    }
}
