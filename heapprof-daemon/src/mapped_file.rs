//! Object files mapped read-only for parsing (unwind tables, allocator symbols).

use std::{fs::File, os::fd::AsRawFd as _, ptr::NonNull};

/// An object file mapped read-only for parsing.
pub(crate) struct MappedFile {
    base: NonNull<u8>,
    len: usize,
}

impl MappedFile {
    /// Maps the file at `path`.
    pub(crate) fn open(path: &std::path::Path) -> std::io::Result<Self> {
        let file = File::open(path)?;
        let len = usize::try_from(file.metadata()?.len()).unwrap_or(usize::MAX);
        if len == 0 {
            return Err(std::io::Error::other("empty file"));
        }
        // SAFETY: a private read-only mapping of a regular file; the kernel keeps the
        // pages after `file` is closed. A file truncated meanwhile would fault: objects
        // are mapped by a running process, which would fault first.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base = NonNull::new(base.cast::<u8>()).ok_or_else(|| std::io::Error::other("null"))?;
        Ok(Self { base, len })
    }

    /// The file's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: the whole mapping, alive as long as self.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr(), self.len) }
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `open`, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}
