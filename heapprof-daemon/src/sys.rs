//! Facts about the machine the daemon runs on, asked of the operating system.
//! Shared by the modules that load BPF programs, fill BPF maps and read the kernel's
//! slab caches, so none of them has to import them from another.

/// The size of a memory page in bytes (4096 if the system does not say).
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { ::libc::sysconf(::libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096)
}
