//! main -> a -> b on tikv-jemallocator (tests/allocators.rs).
//!
//! The global allocator is tikv-jemallocator wrapped in [`Counting`], which counts every
//! call of the whole process through it, std's own included (before and after `main`):
//! each becomes one call of jemalloc's prefixed API (`_rjem_malloc`, `_rjem_mallocx`,
//! `_rjem_calloc`, `_rjem_realloc`, `_rjem_rallocx`, `_rjem_sdallocx`), which heapprofd
//! probes. Counting follows heapprofd's rules: a realloc frees the old block and
//! allocates the new size.
//!
//! Without the default feature `jemalloc`, [`Counting`] wraps `std::alloc::System`, the
//! C library's malloc, calloc, posix_memalign, realloc and free (tests/arm64_vm.rs: a
//! static aarch64 musl build).
//!
//! At exit (from `.fini_array`, after std's own clean-up) it prints, with write(2):
//!   pid=P allocated_objects=N allocated_bytes=B inuse_objects=N inuse_bytes=B
//!   stack=a<-main ...          (the allocations made in `a` itself)
//!   stack=b<-a<-main ...
//!   stack=b<-main ...
//!   stack=other ...            (everything else: std's runtime)
//!   done

use std::alloc::{GlobalAlloc, Layout};
use std::hint::black_box;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering::Relaxed};

#[cfg(not(feature = "jemalloc"))]
use std::alloc::System as Inner;
#[cfg(feature = "jemalloc")]
use tikv_jemallocator::Jemalloc as Inner;

const OTHER: usize = 0;
const A: usize = 1;
const B_FROM_A: usize = 2;
const B_FROM_MAIN: usize = 3;
const SITES: usize = 4;
const SITE_NAMES: [&str; SITES] = ["other", "a<-main", "b<-a<-main", "b<-main"];

/// The site allocating now (the program has one thread).
static SITE: AtomicUsize = AtomicUsize::new(OTHER);

/// Per site: allocated objects, allocated bytes, in-use objects, in-use bytes.
static COUNTS: [[AtomicI64; 4]; SITES] = [const { [const { AtomicI64::new(0) }; 4] }; SITES];

/// The live blocks: address, site, size (address 0: a free entry).
const LIVE: usize = 4096;
static LIVE_PTR: [AtomicUsize; LIVE] = [const { AtomicUsize::new(0) }; LIVE];
static LIVE_SITE: [AtomicUsize; LIVE] = [const { AtomicUsize::new(0) }; LIVE];
static LIVE_SIZE: [AtomicUsize; LIVE] = [const { AtomicUsize::new(0) }; LIVE];
/// Blocks that did not fit the table (the counts would then be wrong: the program fails).
static OVERFLOW: AtomicUsize = AtomicUsize::new(0);

fn counted_alloc(ptr: *mut u8, size: usize) {
    let site = SITE.load(Relaxed);
    let counts = &COUNTS[site];
    counts[0].fetch_add(1, Relaxed);
    counts[1].fetch_add(size as i64, Relaxed);
    counts[2].fetch_add(1, Relaxed);
    counts[3].fetch_add(size as i64, Relaxed);
    for i in 0..LIVE {
        if LIVE_PTR[i].load(Relaxed) == 0 {
            LIVE_PTR[i].store(ptr as usize, Relaxed);
            LIVE_SITE[i].store(site, Relaxed);
            LIVE_SIZE[i].store(size, Relaxed);
            return;
        }
    }
    OVERFLOW.fetch_add(1, Relaxed);
}

fn counted_free(ptr: *mut u8) {
    for i in 0..LIVE {
        if LIVE_PTR[i].load(Relaxed) == ptr as usize {
            let counts = &COUNTS[LIVE_SITE[i].load(Relaxed)];
            counts[2].fetch_sub(1, Relaxed);
            counts[3].fetch_sub(LIVE_SIZE[i].load(Relaxed) as i64, Relaxed);
            LIVE_PTR[i].store(0, Relaxed);
            return;
        }
    }
    OVERFLOW.fetch_add(1, Relaxed);
}

/// tikv-jemallocator (or the C library's malloc), counted.
struct Counting;

#[global_allocator]
static GLOBAL: Counting = Counting;

unsafe impl GlobalAlloc for Counting {
    #[inline(never)]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { Inner.alloc(layout) };
        if !ptr.is_null() {
            counted_alloc(ptr, layout.size());
        }
        ptr
    }

    #[inline(never)]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { Inner.alloc_zeroed(layout) };
        if !ptr.is_null() {
            counted_alloc(ptr, layout.size());
        }
        ptr
    }

    #[inline(never)]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { Inner.dealloc(ptr, layout) };
        counted_free(ptr);
    }

    #[inline(never)]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { Inner.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            counted_free(ptr);
            counted_alloc(new, new_size);
        }
        new
    }
}

/// b: a Vec of 100 bytes (kept), 384 zeroed bytes aligned to 128 (`_rjem_mallocx`,
/// freed), a boxed [u64; 5] (kept), a Vec of 50 grown to 70 (`_rjem_realloc`, kept).
/// From main every size is 8 bytes more (the aligned block 128 more).
#[inline(never)]
fn b(from_main: bool) {
    let previous = SITE.swap(if from_main { B_FROM_MAIN } else { B_FROM_A }, Relaxed);
    let extra = if from_main { 8 } else { 0 };

    let kept: Vec<u8> = Vec::with_capacity(black_box(100 + extra));
    std::mem::forget(black_box(kept));

    let aligned = Layout::from_size_align(384 + 16 * extra, 128).expect("layout");
    // SAFETY: a non-zero size; the block is given back with its layout.
    let block = unsafe { std::alloc::alloc_zeroed(aligned) };
    assert!(!block.is_null());
    black_box(block);

    let boxed = Box::new(black_box([7u64; 5]));
    std::mem::forget(black_box(boxed));

    let mut grown: Vec<u8> = Vec::with_capacity(black_box(50 + extra));
    black_box(&mut grown);
    grown.reserve_exact(black_box(70 + extra));
    std::mem::forget(black_box(grown));

    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(black_box(block), aligned) };
    SITE.store(previous, Relaxed);
}

/// a: a Vec of 1000 bytes (kept), a boxed [u64; 30] (freed), a Vec of 300 grown to
/// 5000 (kept), 200 bytes aligned to 64 (`_rjem_mallocx`, kept), vec![0u8; 777]
/// (`_rjem_calloc`, kept), b, then the free.
#[inline(never)]
fn a() {
    let previous = SITE.swap(A, Relaxed);

    let kept: Vec<u8> = Vec::with_capacity(black_box(1000));
    std::mem::forget(black_box(kept));

    let boxed = Box::new(black_box([3u64; 30]));
    black_box(&boxed);

    let mut grown: Vec<u8> = Vec::with_capacity(black_box(300));
    black_box(&mut grown);
    grown.reserve_exact(black_box(5000));
    std::mem::forget(black_box(grown));

    let aligned = Layout::from_size_align(200, 64).expect("layout");
    // SAFETY: a non-zero size; the block is kept to the end.
    let block = unsafe { std::alloc::alloc(aligned) };
    assert!(!block.is_null());
    black_box(block);

    let zeroed = vec![0u8; black_box(777)];
    std::mem::forget(black_box(zeroed));

    b(false);

    drop(black_box(boxed));
    SITE.store(previous, Relaxed);
}

fn main() {
    for _ in 0..3 {
        a();
    }
    b(true);
    // Not a tail call: main's frame stays on the stacks of b's allocations.
    black_box(SITE.load(Relaxed));
}

// ---------------------------------------------------------------- printing at exit

unsafe extern "C" {
    fn write(fd: i32, buf: *const std::ffi::c_void, count: usize) -> isize;
    fn getpid() -> i32;
}

/// A fixed buffer: formatting into it allocates nothing.
struct Out {
    data: [u8; 2048],
    len: usize,
}

impl std::fmt::Write for Out {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = self.len + s.len();
        if end > self.data.len() {
            return Err(std::fmt::Error);
        }
        self.data[self.len..end].copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

fn put_counts(out: &mut Out, c: [i64; 4]) -> std::fmt::Result {
    use std::fmt::Write as _;
    writeln!(
        out,
        " allocated_objects={} allocated_bytes={} inuse_objects={} inuse_bytes={}",
        c[0], c[1], c[2], c[3]
    )
}

fn format_counts(out: &mut Out) -> std::fmt::Result {
    use std::fmt::Write as _;
    let site = |s: usize| -> [i64; 4] { std::array::from_fn(|i| COUNTS[s][i].load(Relaxed)) };
    let mut total = [0i64; 4];
    for s in 0..SITES {
        for (t, v) in total.iter_mut().zip(site(s)) {
            *t += v;
        }
    }
    // SAFETY: getpid has no preconditions.
    write!(out, "pid={}", unsafe { getpid() })?;
    put_counts(out, total)?;
    for s in [A, B_FROM_A, B_FROM_MAIN, OTHER] {
        write!(out, "stack={}", SITE_NAMES[s])?;
        put_counts(out, site(s))?;
    }
    let overflow = OVERFLOW.load(Relaxed);
    if overflow != 0 {
        writeln!(out, "error: {overflow} blocks did not fit the live table")?;
    }
    writeln!(out, "done")
}

extern "C" fn print_counts() {
    let mut out = Out {
        data: [0; 2048],
        len: 0,
    };
    if format_counts(&mut out).is_err() {
        out.len = 0;
        let _ = std::fmt::Write::write_str(&mut out, "error: output buffer full\n");
    }
    let mut done = 0;
    while done < out.len {
        // SAFETY: the buffer's initialized bytes.
        let n = unsafe { write(1, out.data[done..].as_ptr().cast(), out.len - done) };
        if n <= 0 {
            return;
        }
        done += n as usize;
    }
}

/// Run by the C library at exit, after `main` returned and std cleaned up.
#[used]
#[link_section = ".fini_array"]
static PRINT_AT_EXIT: extern "C" fn() = print_counts;
