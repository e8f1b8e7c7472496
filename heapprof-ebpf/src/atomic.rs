//! The atomic instructions the programs use on map values.
//!
//! They are written as instructions: LLVM selects the fetching atomics only when the
//! whole object is built for BPF v3 (`-C target-cpu`, which aya-build does not pass),
//! while the kernel runs them whatever the object was built for (Linux 5.12+). On
//! arm64 the kernel's JIT makes each of them a full barrier.

/// Atomically adds `value` to `*target`; returns the value before.
///
/// # Safety
/// `target` is valid, aligned, and only accessed atomically.
#[inline(always)]
pub unsafe fn fetch_add(target: *mut u64, value: u64) -> u64 {
    let before: u64;
    // SAFETY: as the caller promises.
    unsafe {
        core::arch::asm!(
            "{v} = atomic_fetch_add((u64 *)({p} + 0), {v})",
            p = in(reg) target,
            v = inout(reg) value => before,
            options(nostack),
        );
    }
    before
}

/// Atomically replaces `*target` with `new` if it holds `expected`; returns what it held.
///
/// # Safety
/// `target` is valid, aligned, and only accessed atomically.
#[inline(always)]
pub unsafe fn compare_exchange(target: *mut u64, expected: u64, new: u64) -> u64 {
    let found: u64;
    // SAFETY: as the caller promises. BPF_CMPXCHG compares with and returns in r0.
    unsafe {
        core::arch::asm!(
            "r0 = cmpxchg_64({p} + 0, r0, {n})",
            p = in(reg) target,
            n = in(reg) new,
            inout("r0") expected => found,
            options(nostack),
        );
    }
    found
}

/// Atomically stores `value` in `*target` (an exchange: on arm64 the stores before
/// it are seen first); returns what it held.
///
/// # Safety
/// `target` is valid, aligned, and only accessed atomically.
#[inline(always)]
pub unsafe fn exchange(target: *mut u64, value: u64) -> u64 {
    let before: u64;
    // SAFETY: as the caller promises.
    unsafe {
        core::arch::asm!(
            "{v} = xchg_64({p} + 0, {v})",
            p = in(reg) target,
            v = inout(reg) value => before,
            options(nostack),
        );
    }
    before
}

/// [`compare_exchange`] on a 32-bit word.
///
/// # Safety
/// `target` is valid, aligned, and only accessed atomically.
#[inline(always)]
pub unsafe fn compare_exchange_32(target: *mut u32, expected: u32, new: u32) -> u32 {
    let found: u64;
    // SAFETY: as the caller promises. BPF_CMPXCHG (32-bit) compares with w0 and
    // returns in r0, zero-extended.
    unsafe {
        core::arch::asm!(
            "w0 = cmpxchg32_32(r1 + 0, w0, w2)",
            in("r1") target,
            in("r2") u64::from(new),
            inout("r0") u64::from(expected) => found,
            options(nostack),
        );
    }
    found as u32
}

/// [`exchange`] on a 32-bit word.
///
/// # Safety
/// `target` is valid, aligned, and only accessed atomically.
#[inline(always)]
pub unsafe fn exchange_32(target: *mut u32, value: u32) -> u32 {
    let before: u64;
    // SAFETY: as the caller promises.
    unsafe {
        core::arch::asm!(
            "w2 = xchg32_32(r1 + 0, w2)",
            in("r1") target,
            inout("r2") u64::from(value) => before,
            options(nostack),
        );
    }
    before as u32
}

/// Atomically sets the bits of `value` in the 32-bit word `*target`; returns the
/// value before.
///
/// # Safety
/// `target` is valid, aligned, and only accessed atomically.
#[inline(always)]
pub unsafe fn fetch_or_32(target: *mut u32, value: u32) -> u32 {
    let before: u64;
    // SAFETY: as the caller promises.
    unsafe {
        core::arch::asm!(
            "w2 = atomic_fetch_or((u32 *)(r1 + 0), w2)",
            in("r1") target,
            inout("r2") u64::from(value) => before,
            options(nostack),
        );
    }
    before as u32
}

/// Atomically adds `value` to `*target`, fetching nothing: the `XADD` instruction, which
/// every kernel runs (5.10 included, where the fetching atomics do not exist).
///
/// # Safety
/// `target` is valid, aligned, and only accessed atomically.
#[inline(always)]
pub unsafe fn add_32(target: *mut u32, value: u32) {
    // SAFETY: as the caller promises.
    unsafe {
        core::arch::asm!(
            "lock *(u32 *)({p} + 0) += {v}",
            p = in(reg) target,
            v = in(reg) value,
            options(nostack),
        );
    }
}
