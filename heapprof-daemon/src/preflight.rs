//! Checks made before anything is loaded, each failing with what is missing and how to fix it.

use anyhow::{Result, bail};

const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;
const CAP_SYS_ADMIN: u32 = 21;

/// Effective capabilities of this process, from /proc/self/status.
fn effective_capabilities() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        })
        .unwrap_or(0)
}

/// heapprofd loads BPF programs and opens uprobe perf events: root, or CAP_BPF and CAP_PERFMON.
pub fn check_privileges() -> Result<()> {
    let caps = effective_capabilities();
    let has = |cap: u32| caps & (1 << cap) != 0;
    if has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON)) {
        return Ok(());
    }
    let missing: Vec<&str> = [(CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON")]
        .into_iter()
        .filter(|(cap, _)| !has(*cap))
        .map(|(_, name)| name)
        .collect();
    bail!(
        "insufficient privileges: missing {}; run heapprofd as root (sudo) or grant CAP_BPF and CAP_PERFMON",
        missing.join(" and ")
    )
}

/// The kernel must have the bpf() system call (CONFIG_BPF_SYSCALL): its sysctl exists
/// exactly when it does.
pub fn check_bpf() -> Result<()> {
    if std::path::Path::new("/proc/sys/kernel/unprivileged_bpf_disabled").exists() {
        return Ok(());
    }
    bail!(
        "this kernel has no BPF system call (CONFIG_BPF_SYSCALL); heapprofd needs a kernel built with BPF"
    )
}

/// The kernel must offer the uprobe perf event type.
pub fn check_uprobes() -> Result<()> {
    if std::path::Path::new("/sys/bus/event_source/devices/uprobe/type").exists() {
        return Ok(());
    }
    bail!(
        "this kernel has no uprobe support (CONFIG_UPROBE_EVENTS); heapprofd needs a kernel built with uprobes"
    )
}

/// The pid must name a live process; a user-space one unless `kernel_threads_allowed`
/// (kernel mode, where a kernel thread's allocations are what a driver developer wants).
pub fn check_pid(pid: u32, kernel_threads_allowed: bool) -> Result<()> {
    let maps = match std::fs::read_to_string(format!("/proc/{pid}/maps")) {
        Ok(maps) => maps,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            bail!("no process with pid {pid}; check the pid (e.g. with `pgrep NAME`)")
        }
        Err(err) => bail!("cannot read /proc/{pid}/maps ({err}); run heapprofd as root"),
    };
    if maps.trim().is_empty() && !kernel_threads_allowed {
        bail!(
            "pid {pid} is a kernel thread (it has no user memory); give the pid of a user-space \
             process, or use --kernel to profile its kernel allocations"
        )
    }
    Ok(())
}
