//! Call-frame unwinding tables: built by the daemon from each object's CFI
//! (`.eh_frame`, `.debug_frame`), read by the BPF unwinder at every recorded allocation.
//!
//! The layout, from an address in a process to the rule that unwinds its frame:
//! - `PROCESS_MAPPINGS[tgid]`: the process's executable mappings, sorted by address
//!   ([`ProcessMappings`]); each names an object and its load bias.
//! - `UNWIND_OBJECTS[object]`: where the object's rows are in `UNWIND_ROWS`
//!   ([`UnwindObject`]). One table per object file, shared by every process mapping it.
//! - `UNWIND_ROWS`: per object, [`UnwindRow`]s sorted by address: each row's rule holds
//!   from its address up to the next row's. Gaps (code without CFI) are rows whose rule
//!   is [`RULE_NONE`].
//! - `UNWIND_RULES[rule]`: the deduplicated rules ([`UnwindRule`]); a few thousand
//!   distinct ones cover a whole system.

/// Most executable mappings recorded per process.
pub const MAX_PROCESS_MAPPINGS: usize = 256;

/// Binary-search steps over one object's rows: objects have at most 2^22 rows.
pub const ROW_SEARCH_STEPS: u32 = 22;

/// Largest number of rows of one object (`2^ROW_SEARCH_STEPS`).
pub const MAX_OBJECT_ROWS: u32 = 1 << ROW_SEARCH_STEPS;

/// Binary-search steps over a process's mappings (`2^9 > MAX_PROCESS_MAPPINGS`).
pub const MAPPING_SEARCH_STEPS: u32 = 9;

/// Rule index of a row that starts a range no CFI covers.
pub const RULE_NONE: u32 = u32::MAX;

/// Object index of a mapping that has no unwind table (no CFI, not loaded yet, or the
/// table did not fit): frames in it are unwound with frame pointers, when allowed.
pub const NO_OBJECT: u32 = u32::MAX;

/// How the canonical frame address (CFA, the caller's stack pointer) is found.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CfaRule {
    /// CFA = stack pointer + `cfa_offset`.
    SpOffset = 0,
    /// CFA = frame pointer (rbp, x29) + `cfa_offset`.
    FpOffset = 1,
    /// x86-64 PLT entries: CFA = rsp + 8, + 8 more past the entry's `push` (when the
    /// address's low four bits are 11 or more): the one DWARF expression compilers emit
    /// for ordinary code.
    PltX86 = 2,
    /// The return address is undefined: the outermost frame (`_start`, a thread's start).
    End = 3,
    /// A rule the unwinder cannot follow (another base register, a DWARF expression).
    Unsupported = 4,
}

impl CfaRule {
    /// Converts a value read from a map back into a rule.
    pub const fn from_u8(value: u8) -> Option<CfaRule> {
        Some(match value {
            0 => CfaRule::SpOffset,
            1 => CfaRule::FpOffset,
            2 => CfaRule::PltX86,
            3 => CfaRule::End,
            4 => CfaRule::Unsupported,
            _ => return None,
        })
    }
}

/// Where a register of the caller (its frame pointer, or on arm64 its return address)
/// is found.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RegRule {
    /// Unchanged: the register still holds the caller's value (on arm64, a return
    /// address still in the link register, as in a leaf function).
    Same = 0,
    /// Saved on the stack at CFA + offset.
    AtCfa = 1,
    /// Unknown (not recoverable, or a rule the unwinder cannot follow).
    Undefined = 2,
}

impl RegRule {
    /// Converts a value read from a map back into a rule.
    pub const fn from_u8(value: u8) -> Option<RegRule> {
        Some(match value {
            0 => RegRule::Same,
            1 => RegRule::AtCfa,
            2 => RegRule::Undefined,
            _ => return None,
        })
    }
}

/// How to unwind one frame: find the CFA, then the caller's return address and frame
/// pointer. On x86-64 the return address is always at CFA - 8 (`ra` is [`RegRule::AtCfa`]
/// with offset -8).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UnwindRule {
    /// A [`CfaRule`].
    pub cfa: u8,
    /// A [`RegRule`] for the frame pointer.
    pub fp: u8,
    /// A [`RegRule`] for the return address.
    pub ra: u8,
    /// Explicit padding, always zero.
    pub _pad: u8,
    /// Added to the CFA's base register.
    pub cfa_offset: i32,
    /// Where the frame pointer is saved, from the CFA (with [`RegRule::AtCfa`]).
    pub fp_offset: i32,
    /// Where the return address is saved, from the CFA (with [`RegRule::AtCfa`]).
    pub ra_offset: i32,
}

/// One row of an object's table: from `pc` (an address in the object as its ELF file
/// gives it, i.e. before the load bias) the rule `rule` holds, up to the next row.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UnwindRow {
    /// First address covered.
    pub pc: u32,
    /// Index into `UNWIND_RULES`, or [`RULE_NONE`].
    pub rule: u32,
}

/// Where an object's rows are in `UNWIND_ROWS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindObject {
    /// Index of its first row.
    pub first_row: u32,
    /// Number of rows (at most [`MAX_OBJECT_ROWS`]).
    pub rows: u32,
}

/// One executable mapping of a process.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecMapping {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// Load bias: an address minus the bias is the address in the object's file.
    pub bias: u64,
    /// Index into `UNWIND_OBJECTS`, or [`NO_OBJECT`].
    pub object: u32,
    /// Explicit padding, always zero.
    pub _pad: u32,
}

impl ExecMapping {
    /// Whether `address` is in this mapping.
    #[inline(always)]
    pub const fn contains(&self, address: u64) -> bool {
        self.start <= address && address < self.end
    }
}

impl UnwindRow {
    /// Whether this row, the last one starting at or below `vaddr` (an address in the
    /// object's file), gives `vaddr` a rule: a gap's row gives none.
    #[inline(always)]
    pub const fn covers(&self, vaddr: u64) -> bool {
        self.pc as u64 <= vaddr && self.rule != RULE_NONE
    }
}

/// The address in its object's file of `address`, in a mapping with load bias `bias`,
/// if an object's rows can hold it (their addresses are 32-bit).
#[inline(always)]
pub const fn object_address(address: u64, bias: u64) -> Option<u64> {
    let vaddr = address.wrapping_sub(bias);
    if vaddr > u32::MAX as u64 {
        return None;
    }
    Some(vaddr)
}

/// A binary search, in progress, for the last of some entries sorted by their start
/// whose start is at most a key: that entry, if any, lies in `[low, low + len)`. The
/// BPF unwinder steps it in `bpf_loop` callbacks, at most [`MAPPING_SEARCH_STEPS`]
/// over a process's mappings and [`ROW_SEARCH_STEPS`] over an object's rows, each
/// step branch-free (one path for the verifier).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SearchRange {
    /// First candidate.
    pub low: u32,
    /// Candidates left.
    pub len: u32,
}

impl SearchRange {
    /// A search over `len` entries.
    #[inline(always)]
    pub const fn new(len: u32) -> Self {
        SearchRange { low: 0, len }
    }

    /// Whether one candidate is left: `low` (when it starts at most at the key; the
    /// caller checks).
    #[inline(always)]
    pub const fn done(&self) -> bool {
        self.len <= 1
    }

    /// The entry whose start the next step compares with the key.
    #[inline(always)]
    pub const fn middle(&self) -> u32 {
        self.low + self.len / 2
    }

    /// One step, given the start of the [`middle`](Self::middle) entry: keeps the half
    /// where the last start at most `key` lies.
    #[inline(always)]
    pub fn narrow(&mut self, middle_start: u64, key: u64) {
        let half = self.len / 2;
        self.low += half * u32::from(middle_start <= key);
        self.len -= half;
    }
}

/// A process's executable mappings, sorted by `start`; `count` are in use.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ProcessMappings {
    /// Mappings in use.
    pub count: u32,
    /// Changes with every write of a process's mappings (a counter of the daemon's):
    /// rules cached for an address of the process are valid for one version.
    pub version: u32,
    /// The mappings, sorted by address.
    pub mappings: [ExecMapping; MAX_PROCESS_MAPPINGS],
}

/// How user stacks are unwound (`--unwind`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnwindMode {
    /// CFI where a table covers the address, frame pointers elsewhere (JIT code).
    Auto = 0,
    /// CFI only: a frame without a rule ends the stack.
    Cfi = 1,
    /// Frame pointers only (the kernel's way; the code must keep them).
    FramePointers = 2,
}

/// Key of the table of addresses where stacks were cut short (`UNWIND_GAPS`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UnwindGap {
    /// The process.
    pub tgid: u32,
    /// Its image (see `StackKey::exec_gen`): the address belongs to it.
    pub exec_gen: u32,
    /// The address (in the process) that had no rule.
    pub pc: u64,
    /// Why the stack ended there: a [`GapReason`].
    pub reason: u32,
    /// Explicit padding, always zero.
    pub _pad: u32,
}

/// Why a stack was cut short at an address.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GapReason {
    /// No executable mapping of the process is known there (not loaded yet, or JIT
    /// code without frame pointers).
    NoMapping = 0,
    /// The mapping's object has no table, and frame pointers did not lead on.
    NoTable = 1,
    /// The object's table has no rule for the address.
    NoRule = 2,
    /// The rule cannot be followed (see [`CfaRule::Unsupported`]).
    Unsupported = 3,
    /// A saved register could not be read from the stack.
    Unreadable = 4,
}

impl GapReason {
    /// Converts a value read from a map back into a reason.
    pub const fn from_u32(value: u32) -> Option<GapReason> {
        Some(match value {
            0 => GapReason::NoMapping,
            1 => GapReason::NoTable,
            2 => GapReason::NoRule,
            3 => GapReason::Unsupported,
            4 => GapReason::Unreadable,
            _ => return None,
        })
    }

    /// A short description for logs and profile comments.
    pub const fn describe(self) -> &'static str {
        match self {
            GapReason::NoMapping => "no executable mapping known at the address",
            GapReason::NoTable => "no unwind table for the object",
            GapReason::NoRule => "no CFI rule for the address",
            GapReason::Unsupported => "a CFI rule the unwinder cannot follow",
            GapReason::Unreadable => "a saved register could not be read",
        }
    }
}

/// A request from the BPF side for the daemon to read a process's mappings (again):
/// the dynamic loader mapped or unmapped objects, or a stack met an unknown address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MappingsRequest {
    /// The process.
    pub tgid: u32,
    /// Why: a [`RequestReason`].
    pub reason: u32,
}

/// Where a process forked from a traced one finds its code until its own mappings are
/// loaded (`FORK_ORIGINS`, keyed by the child's tgid). A fork shares its parent's
/// address space layout until it execs or maps something new, so the parent's
/// mappings unwind its stacks: a short-lived child (a shell's fork before its exec, a
/// server's worker at birth) is gone before the daemon could read its own.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForkOrigin {
    /// The process whose mappings the child shares: its parent, or the parent's own
    /// origin when the parent is itself a fork without mappings of its own.
    pub tgid: u32,
    /// That process's exec generation at the fork: the image whose mappings it is.
    pub exec_gen: u32,
    /// The child's exec generation at the fork: the origin holds for that image only.
    pub child_exec_gen: u32,
    /// Padding (zero).
    pub _pad: u32,
}

impl ForkOrigin {
    /// The origin of a child forked by `parent` (at exec generation `parent_exec_gen`)
    /// whose own exec generation is `child_exec_gen`, where `target` is the one
    /// process traced with its forks (0: every process). None when the parent is not
    /// traced (neither the target nor a fork of it). Otherwise the origin the parent
    /// inherited, if it still holds for the parent's image and the parent has no
    /// mappings of its own; else the parent itself, whose mappings may be loaded by
    /// the time the child allocates.
    #[inline(always)]
    pub fn of_fork(
        parent: u32,
        parent_exec_gen: u32,
        parent_has_mappings: bool,
        parent_origin: Option<&ForkOrigin>,
        target: u32,
        child_exec_gen: u32,
    ) -> Option<ForkOrigin> {
        let inherited = parent_origin.filter(|o| o.holds_for(parent_exec_gen));
        if target != 0 && parent != target && inherited.is_none() {
            return None;
        }
        let (tgid, exec_gen) = match inherited {
            Some(inherited) if !parent_has_mappings => (inherited.tgid, inherited.exec_gen),
            _ => (parent, parent_exec_gen),
        };
        Some(ForkOrigin {
            tgid,
            exec_gen,
            child_exec_gen,
            _pad: 0,
        })
    }

    /// The entry of a fork that exec'd, image `exec_gen`: its own mappings from now on.
    /// It stays in the table as the mark of a process descended from the target, so
    /// that its own forks and execs are followed too.
    #[inline(always)]
    pub fn at_exec(tgid: u32, exec_gen: u32) -> ForkOrigin {
        ForkOrigin {
            tgid,
            exec_gen,
            child_exec_gen: exec_gen,
            _pad: 0,
        }
    }

    /// Whether the origin still describes the child's image `exec_gen` (an exec since
    /// the fork replaced the shared code).
    #[inline(always)]
    pub fn holds_for(&self, exec_gen: u32) -> bool {
        self.child_exec_gen == exec_gen
    }
}

/// Why the BPF side asks for a process's mappings.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestReason {
    /// The dynamic loader reported a change (`_dl_debug_state`): libraries were loaded
    /// (at start-up or by `dlopen`) or unloaded.
    Loader = 0,
    /// A stack met an address outside every known mapping (a new process, code mapped
    /// without the loader).
    UnknownAddress = 1,
}

/// Entries of the per-CPU cache of resolved rules (a power of two).
pub const RULE_CACHE_ENTRIES: u32 = 4096;

/// One entry of the per-CPU cache of resolved rules: what unwinding found at an
/// address of a process, for one version of its mappings.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CachedRule {
    /// The address looked up.
    pub pc: u64,
    /// The process.
    pub tgid: u32,
    /// [`ProcessMappings::version`] when it was resolved.
    pub version: u32,
    /// The rule, when `gap` is [`CACHED_RULE_FOUND`].
    pub rule: UnwindRule,
    /// [`CACHED_RULE_FOUND`], or the [`GapReason`] why no rule applies.
    pub gap: u32,
    /// Explicit padding, always zero.
    pub _pad: u32,
}

/// [`CachedRule::gap`] of an entry holding a rule.
pub const CACHED_RULE_FOUND: u32 = u32::MAX;

#[cfg(test)]
mod tests {
    #[test]
    fn a_fork_takes_its_parents_mappings_or_the_origin_the_parent_inherited() {
        // Every process traced: the parent's own mappings, at its image.
        let direct = ForkOrigin::of_fork(10, 2, true, None, 0, 0).expect("an origin");
        assert_eq!(
            (direct.tgid, direct.exec_gen, direct.child_exec_gen),
            (10, 2, 0)
        );
        // A fork of that fork, which has no mappings of its own: the first parent's.
        let grandchild = ForkOrigin::of_fork(11, 0, false, Some(&direct), 0, 0).expect("origin");
        assert_eq!((grandchild.tgid, grandchild.exec_gen), (10, 2));
        // Once the middle one has mappings of its own, its own.
        let own = ForkOrigin::of_fork(11, 0, true, Some(&direct), 0, 0).expect("an origin");
        assert_eq!(own.tgid, 11);
        // The middle one exec'd since: its inherited origin is stale; itself, whose new
        // image's mappings the daemon reads.
        let after_exec = ForkOrigin::of_fork(11, 1, false, Some(&direct), 0, 0).expect("origin");
        assert_eq!((after_exec.tgid, after_exec.exec_gen), (11, 1));
        // No mappings yet and no origin: the parent, whose mappings may come in time.
        let early = ForkOrigin::of_fork(12, 0, false, None, 0, 3).expect("an origin");
        assert_eq!((early.tgid, early.child_exec_gen), (12, 3));
        // The child's own exec ends it.
        assert!(direct.holds_for(0));
        assert!(!direct.holds_for(1));
    }

    #[test]
    fn with_one_target_only_its_forks_and_theirs_get_an_origin() {
        let child = ForkOrigin::of_fork(50, 0, true, None, 50, 0).expect("the target's fork");
        assert_eq!(child.tgid, 50);
        let grandchild =
            ForkOrigin::of_fork(51, 0, false, Some(&child), 50, 0).expect("a fork's fork");
        assert_eq!(grandchild.tgid, 50);
        // Another process of the host, even one with mappings loaded.
        assert_eq!(ForkOrigin::of_fork(60, 0, true, None, 50, 0), None);
        // The target's fork exec'd: its exec made it its own origin, at its new image.
        let exec_mark = ForkOrigin::at_exec(51, 1);
        let after_exec =
            ForkOrigin::of_fork(51, 1, false, Some(&exec_mark), 50, 0).expect("origin");
        assert_eq!((after_exec.tgid, after_exec.exec_gen), (51, 1));
        // An origin that does not hold for the parent's image does not make it traced.
        assert_eq!(ForkOrigin::of_fork(51, 1, false, Some(&child), 50, 0), None);
    }

    extern crate std;

    use std::vec::Vec;

    use super::*;

    /// The search's answer over `len` entries whose starts `start_of` gives, and the
    /// steps it took.
    fn search(len: u32, start_of: impl Fn(u32) -> u64, key: u64) -> (Option<u32>, u32) {
        let mut range = SearchRange::new(len);
        let mut steps = 0;
        while !range.done() {
            let middle = range.middle();
            range.narrow(start_of(middle), key);
            steps += 1;
        }
        let found = (len > 0 && start_of(range.low) <= key).then_some(range.low);
        (found, steps)
    }

    #[test]
    fn the_search_finds_the_last_start_at_most_the_key() {
        let starts: Vec<u64> = (0..200).map(|i| 1000 + i * 16).collect();
        for key in [
            0,
            999,
            1000,
            1001,
            1015,
            1016,
            2000,
            1000 + 199 * 16,
            u64::MAX,
        ] {
            let expected = starts.partition_point(|&s| s <= key).checked_sub(1);
            let (found, _) = search(starts.len() as u32, |i| starts[i as usize], key);
            assert_eq!(found.map(|i| i as usize), expected, "key {key}");
        }
        assert_eq!(search(0, |_| 0, 5).0, None, "no entries");
    }

    #[test]
    fn the_searches_fit_in_their_steps() {
        let mappings = MAX_PROCESS_MAPPINGS as u32;
        for key in [0, 1, mappings / 2, mappings - 1, mappings] {
            let (_, steps) = search(mappings, u64::from, u64::from(key));
            assert!(steps <= MAPPING_SEARCH_STEPS, "{steps} steps");
        }
        for key in [0, 1, MAX_OBJECT_ROWS / 3, MAX_OBJECT_ROWS - 1] {
            let (found, steps) = search(MAX_OBJECT_ROWS, |i| u64::from(i) * 4, u64::from(key) * 4);
            assert_eq!(found, Some(key));
            assert!(steps <= ROW_SEARCH_STEPS, "{steps} steps");
        }
    }

    #[test]
    fn mappings_rows_and_object_addresses() {
        let mapping = ExecMapping {
            start: 0x1000,
            end: 0x2000,
            ..ExecMapping::default()
        };
        assert!(mapping.contains(0x1000) && mapping.contains(0x1fff));
        assert!(!mapping.contains(0xfff) && !mapping.contains(0x2000));
        let row = UnwindRow { pc: 0x40, rule: 3 };
        assert!(row.covers(0x40) && row.covers(0x1000));
        assert!(!row.covers(0x3f), "below the row");
        let gap = UnwindRow {
            pc: 0x40,
            rule: RULE_NONE,
        };
        assert!(!gap.covers(0x40), "a gap has no rule");
        assert_eq!(
            object_address(0x5555_0000_1234, 0x5555_0000_0000),
            Some(0x1234)
        );
        assert_eq!(object_address(0x5555_0000_1234, 0), None, "beyond 32 bits");
        assert_eq!(object_address(0x1000, 0x2000), None, "below the bias");
    }
}
