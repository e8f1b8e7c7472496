//! The walk cache's arithmetic: heapprof-ebpf's `walk_cache` remembers, per CPU, the
//! walks of recent stacks, so that an allocation at a stack walked before costs a copy
//! of the stack and a hash of the words the walk read instead of a walk. Here are its
//! pure parts, which the BPF side calls and unit tests check without root: where a
//! walk is kept, the hash of its words, where its sites are kept, and which stack
//! words it can check.

/// Sets of remembered walks per CPU (a power of two), placed by the walk's starting
/// registers; each set is two entries, the last used first.
pub const SETS: u32 = 256;

/// Sites a remembered walk keeps, one per size class modulo this: allocations of
/// several sizes at one stack (a buffer that grows, a helper called for several
/// types) are one site per class, each known without a lookup of its key.
pub const SITE_WAYS: usize = 8;

/// A site tag before a site is known (no [`site_tag`] is this).
pub const NO_SITE: u32 = u32::MAX;

/// Where a walk starts: the thread, its process image, the caller's registers, and
/// the daemon's epochs (`WALK_EPOCH`) when it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WalkOrigin {
    /// The thread.
    pub pid_tgid: u64,
    /// The caller's return address.
    pub pc: u64,
    /// The caller's stack pointer.
    pub sp: u64,
    /// The caller's frame pointer.
    pub fp: u64,
    /// The process image.
    pub exec_gen: u32,
    /// The daemon's epochs.
    pub epoch: u64,
}

/// Whether a walk remembered from `remembered` (which read the frame pointer register
/// if `uses_fp`) is the walk a start from `now` would make, as far as registers and
/// mappings go: the same thread, image, return address and stack pointer, the same
/// frame pointer if the walk used it, and no change of mappings (or sites) since. The
/// stack words it read are checked apart ([`mix`]).
#[inline(always)]
pub const fn same_origin(remembered: &WalkOrigin, uses_fp: bool, now: &WalkOrigin) -> bool {
    remembered.pid_tgid == now.pid_tgid
        && remembered.pc == now.pc
        && remembered.sp == now.sp
        && remembered.exec_gen == now.exec_gen
        && remembered.epoch == now.epoch
        && (!uses_fp || remembered.fp == now.fp)
}

/// Adds `value` to a hash of words (order matters: a walk's words are hashed in the
/// order it read them).
#[inline(always)]
pub const fn mix(hash: u64, value: u64) -> u64 {
    let h = (hash ^ value).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^ (h >> 31)
}

/// The first entry of the set of a walk starting with these registers (the thread,
/// the caller's return address and stack pointer): an even index below `2 * SETS`.
#[inline(always)]
pub const fn first_entry(pid_tgid: u64, pc: u64, sp: u64) -> u32 {
    let mix = (pc ^ sp.rotate_left(20) ^ pid_tgid).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    ((mix >> 56) as u32 & (SETS - 1)) * 2
}

/// What, beside the walk, names an allocation's site: its function (a `ProbeSlot`,
/// below [`crate::MAX_PROBE_SLOTS`]) and its size class.
#[inline(always)]
pub const fn site_tag(slot: u32, size_class: u32) -> u32 {
    slot | (size_class << 16)
}

/// Where in a remembered walk's sites the site of an allocation of `size_class` is
/// kept.
#[inline(always)]
pub const fn site_way(size_class: u32) -> usize {
    size_class as usize & (SITE_WAYS - 1)
}

/// The place, in words above the stack pointer, of a stack word the walk read at
/// `offset` bytes above it, if a copy of the `window_bytes` above the stack pointer
/// holds it whole (the word is aligned: the stack pointer is, at a call).
#[inline(always)]
pub const fn stack_place(offset: i32, window_bytes: usize) -> Option<u16> {
    if offset < 0 || offset as usize + 8 > window_bytes || offset & 7 != 0 {
        return None;
    }
    Some((offset / 8) as u16)
}

#[cfg(test)]
mod tests {
    extern crate std;

    use super::*;
    use crate::{MAX_PROBE_SLOTS, SIZE_CLASSES};

    #[test]
    fn a_walk_is_kept_at_the_first_entry_of_a_set() {
        for (pid_tgid, pc, sp) in [
            (0, 0, 0),
            (u64::MAX, u64::MAX, u64::MAX),
            (0x1234_0000_1234, 0x5555_5555_1000, 0x7ffd_0000_0000),
        ] {
            let entry = first_entry(pid_tgid, pc, sp);
            assert_eq!(entry % 2, 0, "a set's first entry");
            assert!(entry < 2 * SETS);
        }
        // Nearby stack pointers (one thread's calls) spread over the sets.
        let sets: std::collections::BTreeSet<u32> = (0..64u64)
            .map(|frame| first_entry(42, 0x5555_0000_1234, 0x7ffd_0000_0000 - frame * 64))
            .collect();
        assert!(sets.len() > 32, "{} sets for 64 frames", sets.len());
    }

    #[test]
    fn a_remembered_walk_holds_only_from_the_same_origin() {
        let origin = WalkOrigin {
            pid_tgid: 7 << 32 | 8,
            pc: 0x5555_0000_1234,
            sp: 0x7ffd_0000_1000,
            fp: 0x7ffd_0000_1040,
            exec_gen: 2,
            epoch: 9,
        };
        assert!(same_origin(&origin, true, &origin));
        let other_fp = WalkOrigin { fp: 0, ..origin };
        assert!(same_origin(&origin, false, &other_fp), "fp unused");
        assert!(!same_origin(&origin, true, &other_fp), "fp used");
        for changed in [
            WalkOrigin {
                pid_tgid: 1,
                ..origin
            },
            WalkOrigin { pc: 1, ..origin },
            WalkOrigin { sp: 1, ..origin },
            WalkOrigin {
                exec_gen: 3,
                ..origin
            },
            WalkOrigin {
                epoch: 10,
                ..origin
            },
        ] {
            assert!(!same_origin(&origin, false, &changed), "{changed:?}");
        }
    }

    #[test]
    fn the_hash_of_the_words_depends_on_each_and_on_their_order() {
        let words = [0x7ffd_1234u64, 0x5555_0000_1000, 0, 1];
        let hash = words.iter().fold(0, |h, &w| mix(h, w));
        let reversed = words.iter().rev().fold(0, |h, &w| mix(h, w));
        assert_ne!(hash, reversed);
        for changed in 0..words.len() {
            let mut other = words;
            other[changed] ^= 8;
            assert_ne!(hash, other.iter().fold(0, |h, &w| mix(h, w)));
        }
    }

    #[test]
    fn each_function_and_size_class_has_its_own_site_tag() {
        let mut seen = std::collections::BTreeSet::new();
        for slot in [0, 1, MAX_PROBE_SLOTS - 1] {
            for class in 0..SIZE_CLASSES {
                assert!(seen.insert(site_tag(slot, class)));
                assert!(site_way(class) < SITE_WAYS);
            }
        }
        assert!(!seen.contains(&NO_SITE));
    }

    #[test]
    fn only_aligned_words_inside_the_window_can_be_checked() {
        assert_eq!(stack_place(0, 4096), Some(0));
        assert_eq!(stack_place(8, 4096), Some(1));
        assert_eq!(stack_place(4088, 4096), Some(511));
        assert_eq!(stack_place(4096, 4096), None, "past the window");
        assert_eq!(stack_place(-8, 4096), None, "below the stack pointer");
        assert_eq!(stack_place(12, 4096), None, "unaligned");
        assert_eq!(stack_place(i32::MAX - 7, 4096), None);
    }
}
