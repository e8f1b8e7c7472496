//! heapprofd's own allocator: memory from `mmap`, never the C library's `malloc`.
//!
//! With `--all` the allocator's probes sit in the C library every process maps,
//! heapprofd included. Its BPF programs leave heapprofd's own calls out, but each
//! call still traps into the kernel first, on every allocation of a dump, a
//! symbolization or a push: splitting a pushed profile took 3.0-3.9 s traced against
//! 0.4-0.5 s untraced (docs/performance.md). Code of heapprofd's own is never probed.
//!
//! Blocks under [`LARGE_BLOCK`] come from dlmalloc, which keeps what is freed for
//! reuse. Larger ones get mappings of their own, unmapped when freed: a dump's lists
//! of sites and a push's request would otherwise stay resident between dumps, where
//! the next push's buffers add to them (the reason heapprofd once fixed glibc's mmap
//! threshold at the same 1 MiB).

use std::{
    alloc::{GlobalAlloc, Layout},
    ptr,
};

use dlmalloc::GlobalDlmalloc;

#[global_allocator]
static ALLOCATOR: OwnAllocator = OwnAllocator;

/// Blocks of this size and more are mapped on their own.
const LARGE_BLOCK: usize = 1 << 20;

/// Pages of every Linux heapprofd runs on are at least this large, so a mapping is
/// aligned to it.
const MIN_PAGE: usize = 4096;

/// Keeps the allocator usable in a child heapprofd forks: dlmalloc's lock is held
/// across `fork`, so a child never inherits it locked by a thread it does not have.
/// Called first in `main`.
pub fn keep_usable_across_fork() {
    // SAFETY: registers fork handlers that take and release dlmalloc's lock; called
    // once, from main, before heapprofd starts a thread of its own.
    unsafe { dlmalloc::enable_alloc_after_fork() }
}

/// dlmalloc for small blocks, a mapping each for large ones.
struct OwnAllocator;

/// Whether a block of this layout is (or would be) mapped on its own. The same layout
/// comes back at `dealloc`, so this tells where a block came from.
fn is_large(size: usize, align: usize) -> bool {
    size >= LARGE_BLOCK && align <= MIN_PAGE
}

/// A fresh zero-filled mapping of `size` bytes, or null.
unsafe fn map(size: usize) -> *mut u8 {
    // SAFETY: an anonymous private mapping at an address the kernel picks.
    let addr = unsafe {
        libc::mmap(
            ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        ptr::null_mut()
    } else {
        addr.cast()
    }
}

// SAFETY: small blocks are dlmalloc's (itself a GlobalAlloc); large ones are page-
// aligned mappings of at least their size, told apart by their layout alone.
unsafe impl GlobalAlloc for OwnAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if is_large(layout.size(), layout.align()) {
            // SAFETY: see map.
            unsafe { map(layout.size()) }
        } else {
            // SAFETY: forwarded with the caller's layout.
            unsafe { GlobalDlmalloc.alloc(layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if is_large(layout.size(), layout.align()) {
            // SAFETY: see map (anonymous mappings are zero-filled).
            unsafe { map(layout.size()) }
        } else {
            // SAFETY: forwarded with the caller's layout.
            unsafe { GlobalDlmalloc.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        if is_large(layout.size(), layout.align()) {
            // SAFETY: the block is a mapping of this size (its layout says so). A
            // failed munmap leaves it mapped: lost memory, never a wrong block.
            unsafe { libc::munmap(block.cast(), layout.size()) };
        } else {
            // SAFETY: a dlmalloc block of this layout.
            unsafe { GlobalDlmalloc.dealloc(block, layout) }
        }
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let align = layout.align();
        match (is_large(layout.size(), align), is_large(new_size, align)) {
            (false, false) => {
                // SAFETY: a dlmalloc block of this layout, resized within dlmalloc.
                unsafe { GlobalDlmalloc.realloc(block, layout, new_size) }
            }
            (true, true) => {
                // SAFETY: the block is a mapping of layout.size() bytes; the kernel
                // moves or extends it, keeping its contents.
                let moved = unsafe {
                    libc::mremap(block.cast(), layout.size(), new_size, libc::MREMAP_MAYMOVE)
                };
                if moved == libc::MAP_FAILED {
                    ptr::null_mut()
                } else {
                    moved.cast()
                }
            }
            _ => {
                // Between the two kinds: a new block, the contents copied.
                // SAFETY: a valid layout (the caller's alignment, a size it vouches for).
                let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, align) };
                // SAFETY: allocated and freed through this allocator, each with its layout.
                unsafe {
                    let new_block = self.alloc(new_layout);
                    if !new_block.is_null() {
                        ptr::copy_nonoverlapping(block, new_block, layout.size().min(new_size));
                        self.dealloc(block, layout);
                    }
                    new_block
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks on both sides of the threshold keep their contents through every
    /// kind of resize, and come back zeroed when asked.
    #[test]
    fn blocks_keep_their_contents_across_the_threshold() {
        let allocator = OwnAllocator;
        let small = Layout::from_size_align(1000, 8).expect("layout");
        // SAFETY: every block is used within its size and freed once, with its layout.
        unsafe {
            let block = allocator.alloc(small);
            assert!(!block.is_null());
            for i in 0..1000 {
                *block.add(i) = (i % 251) as u8;
            }
            // Small to large, large to larger (mremap), large to small.
            let sizes = [LARGE_BLOCK + 12_345, 3 * LARGE_BLOCK, 700];
            let mut layout = small;
            let mut block = block;
            for size in sizes {
                block = allocator.realloc(block, layout, size);
                assert!(!block.is_null());
                for i in 0..700 {
                    assert_eq!(
                        *block.add(i),
                        (i % 251) as u8,
                        "byte {i} after resize to {size}"
                    );
                }
                layout = Layout::from_size_align(size, 8).expect("layout");
            }
            allocator.dealloc(block, layout);

            let zeroed = Layout::from_size_align(2 * LARGE_BLOCK, 64).expect("layout");
            let block = allocator.alloc_zeroed(zeroed);
            assert!(!block.is_null());
            assert_eq!(block as usize % 64, 0);
            assert!((0..zeroed.size()).step_by(4093).all(|i| *block.add(i) == 0));
            allocator.dealloc(block, zeroed);
        }
    }

    #[test]
    fn only_page_aligned_large_blocks_are_mapped_alone() {
        assert!(!is_large(LARGE_BLOCK - 1, 8));
        assert!(is_large(LARGE_BLOCK, 8));
        assert!(is_large(LARGE_BLOCK, MIN_PAGE));
        assert!(!is_large(LARGE_BLOCK, 2 * MIN_PAGE));
    }
}
