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

/// Sends `payload` with `fds` as `SCM_RIGHTS` descriptors on `socket` (one message),
/// with `flags` (`MSG_NOSIGNAL`, ...).
pub fn send_with_descriptors(
    socket: std::os::fd::RawFd,
    payload: &[u8],
    fds: &[std::os::fd::RawFd],
    flags: i32,
) -> std::io::Result<()> {
    let mut io = libc::iovec {
        iov_base: payload.as_ptr().cast_mut().cast(),
        iov_len: payload.len(),
    };
    let bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: a zeroed msghdr is valid; the fields set below point at live buffers.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &raw mut io;
    message.msg_iovlen = 1;
    message.msg_control = control.as_mut_ptr().cast();
    // usize on glibc, u32 on musl.
    message.msg_controllen = space as _;
    // SAFETY: the control buffer holds one header with room for `fds`.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&raw const message);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(bytes as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(header), bytes);
    }
    // SAFETY: the message points at live buffers; sendmsg only reads the payload.
    if unsafe { libc::sendmsg(socket, &raw const message, flags) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
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
