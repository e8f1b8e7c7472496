//! The kernel's tracing filesystem: where it is, and the layouts of its events.

pub mod format;

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};

pub use format::{EventFormat, Field, FormatError};

/// Where tracefs is usually mounted, newest convention first.
const CANDIDATES: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// The tracing directory where tracefs is mounted already, if it is.
pub fn mounted() -> Option<PathBuf> {
    CANDIDATES
        .iter()
        .map(Path::new)
        .find(|dir| dir.join("events").is_dir())
        .map(Path::to_path_buf)
}

/// The tracing directory (one with `events/`), mounting tracefs on
/// `/sys/kernel/tracing` when neither usual place has it.
pub fn root() -> Result<PathBuf> {
    if let Some(found) = mounted() {
        return Ok(found);
    }
    let target = Path::new(CANDIDATES[0]);
    if !target.is_dir() {
        bail!(
            "tracefs is not available: {} does not exist (a kernel without CONFIG_TRACING?); \
             heapprofd --kernel needs the kernel's tracepoints",
            target.display()
        );
    }
    mount_tracefs(target).with_context(|| {
        format!(
            "tracefs is not mounted and mounting it failed; mount it with \
             `mount -t tracefs tracefs {}` (as root)",
            target.display()
        )
    })?;
    if !target.join("events").is_dir() {
        bail!(
            "tracefs mounted on {} has no events directory; this kernel has no tracepoints",
            target.display()
        );
    }
    log::info!("mounted tracefs on {}", target.display());
    Ok(target.to_path_buf())
}

fn mount_tracefs(target: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let target = std::ffi::CString::new(target.as_os_str().as_bytes())?;
    let fstype = c"tracefs";
    // SAFETY: NUL-terminated strings that outlive the call; no data argument.
    let result = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if result != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(())
}

/// Reads and parses the format of `category:name`; `Ok(None)` when the kernel has no such event.
pub fn event_format(root: &Path, category: &str, name: &str) -> Result<Option<EventFormat>> {
    let path = root.join("events").join(category).join(name).join("format");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(err) if err.kind() == std::io::ErrorKind::PermissionDenied => bail!(
            "cannot read {} (permission denied); run heapprofd --kernel as root",
            path.display()
        ),
        Err(err) => return Err(err).with_context(|| format!("reading {}", path.display())),
    };
    let format = format::parse(&text).with_context(|| {
        format!(
            "{} is not a valid tracepoint format file; this kernel's layout of \
             {category}:{name} is not understood",
            path.display()
        )
    })?;
    Ok(Some(format))
}
