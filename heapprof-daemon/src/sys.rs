//! Facts about the machine the daemon runs on, asked of the operating system.
//! Shared by the modules that load BPF programs, fill BPF maps and read the kernel's
//! slab caches, so none of them has to import them from another.

/// The size of a memory page in bytes (4096 if the system does not say).
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { ::libc::sysconf(::libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096)
}

/// The running kernel's version (major, minor), from `/proc/sys/kernel/osrelease`.
pub(crate) fn running_kernel() -> Option<(u32, u32)> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    parse_kernel_release(&release)
}

/// (major, minor) of a kernel release string such as `6.12.95+deb12-amd64`.
fn parse_kernel_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(['.', '-', '+']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_releases_are_parsed() {
        assert_eq!(parse_kernel_release("6.12.95+deb12-amd64\n"), Some((6, 12)));
        assert_eq!(parse_kernel_release("5.10.0-32-amd64"), Some((5, 10)));
        assert_eq!(parse_kernel_release("6.1.0-50-arm64"), Some((6, 1)));
        assert_eq!(parse_kernel_release("6.18"), Some((6, 18)));
        assert_eq!(parse_kernel_release("linux"), None);
    }
}
