//! Checks made before anything is loaded, each failing with what is missing and how to fix it.

use std::os::fd::{FromRawFd as _, OwnedFd, RawFd};

use anyhow::{Result, bail};

use crate::{probes::AttachMethod, sys::running_kernel};

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
    // The sysctl is why an unprivileged bpf() fails even for what it would allow.
    let sysctl = match sysctl(UNPRIVILEGED_BPF_DISABLED) {
        Some(value) if value != 0 => format!(
            " (kernel.unprivileged_bpf_disabled is {value}: bpf() is refused to users without CAP_BPF)"
        ),
        _ => String::new(),
    };
    bail!(
        "insufficient privileges: missing {}{sysctl}; run heapprofd as root (sudo) or grant CAP_BPF and CAP_PERFMON",
        missing.join(" and ")
    )
}

const UNPRIVILEGED_BPF_DISABLED: &str = "/proc/sys/kernel/unprivileged_bpf_disabled";
const PERF_EVENT_PARANOID: &str = "/proc/sys/kernel/perf_event_paranoid";
/// The uprobe PMU; its `type` file holds the perf event type of uprobes.
const UPROBE_PMU: &str = "/sys/bus/event_source/devices/uprobe";

/// A sysctl's integer value, `None` when the kernel has no such sysctl.
fn sysctl(path: &str) -> Option<i64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The kernel facility a start-up probe tried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Facility {
    /// The bpf() system call (creating a one-entry array map).
    BpfSyscall,
    /// BPF programs on probes and tracepoints (loading a two-instruction kprobe program).
    BpfEvents,
    /// A uprobe opened through perf_event_open and the uprobe PMU.
    Uprobe,
}

/// Who heapprofd runs as, and the sysctls that decide what it may do.
#[derive(Clone, Copy, Debug, Default)]
pub struct Caller {
    /// Effective user id 0.
    pub root: bool,
    /// CAP_BPF (or CAP_SYS_ADMIN) is effective: the sysctl no longer applies.
    pub cap_bpf: bool,
    /// CAP_PERFMON (or CAP_SYS_ADMIN) is effective: perf_event_paranoid no longer applies,
    /// and kprobe programs may be loaded.
    pub cap_perfmon: bool,
    /// CAP_SYS_ADMIN is effective: what uprobes opened as perf events need on current
    /// kernels.
    pub cap_sys_admin: bool,
    /// `kernel.unprivileged_bpf_disabled`, when the kernel has it.
    pub unprivileged_bpf_disabled: Option<i64>,
    /// `kernel.perf_event_paranoid`, when the kernel has it.
    pub perf_event_paranoid: Option<i64>,
    /// The locked-memory limit in bytes, when the kernel charges BPF maps to it (before
    /// 5.11) and it stayed finite.
    pub memlock_limit: Option<u64>,
}

impl Caller {
    fn current() -> Caller {
        let caps = effective_capabilities();
        let has = |cap: u32| caps & (1 << cap) != 0;
        Caller {
            // SAFETY: geteuid cannot fail.
            root: unsafe { libc::geteuid() } == 0,
            cap_bpf: has(CAP_BPF) || has(CAP_SYS_ADMIN),
            cap_perfmon: has(CAP_PERFMON) || has(CAP_SYS_ADMIN),
            cap_sys_admin: has(CAP_SYS_ADMIN),
            unprivileged_bpf_disabled: sysctl(UNPRIVILEGED_BPF_DISABLED),
            perf_event_paranoid: sysctl(PERF_EVENT_PARANOID),
            memlock_limit: memlock_charge_limit(),
        }
    }

    /// Why a refusal is no matter of privileges: "although heapprofd runs as root", or
    /// has the capabilities (a user granted them, e.g. by `setcap`).
    fn although(self) -> &'static str {
        if self.root {
            "although heapprofd runs as root"
        } else {
            "although heapprofd has CAP_BPF and CAP_PERFMON"
        }
    }
}

/// The one line heapprofd prints when the probe of `facility` failed with `errno`: the
/// missing kernel feature and the config option or sysctl to look at.
pub fn kernel_problem(facility: Facility, errno: i32, caller: Caller) -> String {
    let name = errno_name(errno);
    // Privileges are judged by the effective capabilities, not the uid: a user granted
    // CAP_BPF and CAP_PERFMON is past the sysctls, and a refusal then comes from elsewhere.
    let refused_anyway = format!(
        "{}: a seccomp filter (a container's default profile) or a security module forbids \
         it; run heapprofd on the host, or in a container allowed bpf() and perf_event_open()",
        caller.although()
    );
    match (facility, errno) {
        (Facility::BpfSyscall, libc::ENOSYS) => format!(
            "this kernel has no BPF system call (bpf() fails with {name}): heapprofd needs a \
             kernel built with CONFIG_BPF_SYSCALL=y (qemu-user and some seccomp filters hide it too)"
        ),
        (Facility::BpfSyscall, libc::EPERM | libc::EACCES) if !caller.cap_bpf => format!(
            "bpf() is refused ({name}): kernel.unprivileged_bpf_disabled is {}, and heapprofd \
             lacks CAP_BPF; run it as root (sudo) or grant CAP_BPF and CAP_PERFMON",
            caller
                .unprivileged_bpf_disabled
                .map_or_else(|| "unknown".to_owned(), |v| v.to_string())
        ),
        // The kernel loads kprobe programs only for CAP_PERFMON.
        (Facility::BpfEvents, libc::EPERM | libc::EACCES) if !caller.cap_perfmon => format!(
            "loading a BPF program for probes is refused ({name}): heapprofd lacks \
             CAP_PERFMON; run it as root (sudo) or grant CAP_BPF and CAP_PERFMON"
        ),
        (Facility::BpfSyscall | Facility::BpfEvents, libc::EPERM)
            if caller.memlock_limit.is_some() =>
        {
            format!(
                "bpf() is refused ({name}): {}",
                memlock_advice(caller.memlock_limit.unwrap_or(0))
            )
        }
        (Facility::BpfSyscall | Facility::BpfEvents, libc::EPERM | libc::EACCES) => {
            format!("bpf() is refused ({name}) {refused_anyway}")
        }
        (Facility::BpfSyscall, libc::EINVAL) => format!(
            "this kernel rejects a basic BPF array map (bpf() fails with {name}): its BPF \
             support is too old or cut down; heapprofd needs CONFIG_BPF_SYSCALL=y on a kernel such \
             as the vendor 5.10 and 6.1 ones of boards"
        ),
        (Facility::BpfEvents, libc::EINVAL) => format!(
            "this kernel cannot run BPF programs on probes or tracepoints (loading one fails \
             with {name}): heapprofd needs a kernel built with CONFIG_BPF_EVENTS=y"
        ),
        (Facility::Uprobe, libc::ENOSYS) => format!(
            "this kernel has no perf events (perf_event_open() fails with {name}): heapprofd \
             needs a kernel built with CONFIG_PERF_EVENTS=y, CONFIG_UPROBES=y and CONFIG_UPROBE_EVENTS=y"
        ),
        (Facility::Uprobe, libc::EPERM | libc::EACCES) if !caller.cap_perfmon => format!(
            "opening a uprobe is refused ({name}): kernel.perf_event_paranoid is {}, and \
             heapprofd lacks CAP_PERFMON; run it as root (sudo) or grant CAP_BPF and CAP_PERFMON",
            caller
                .perf_event_paranoid
                .map_or_else(|| "unknown".to_owned(), |v| v.to_string())
        ),
        (Facility::Uprobe, libc::EPERM | libc::EACCES) => {
            format!("opening a uprobe is refused ({name}) {refused_anyway}")
        }
        // ENOENT: no such PMU; EINVAL/EOPNOTSUPP/ENOTSUPP (524): the PMU takes no uprobe.
        (Facility::Uprobe, _) => format!(
            "this kernel refuses uprobes (perf_event_open() of the uprobe PMU fails with \
             {name}): heapprofd needs a kernel built with CONFIG_UPROBES=y and CONFIG_UPROBE_EVENTS=y"
        ),
        (Facility::BpfSyscall, _) => format!(
            "the kernel's bpf() fails with {name}: heapprofd needs a kernel built with \
             CONFIG_BPF_SYSCALL=y"
        ),
        (Facility::BpfEvents, _) => format!(
            "loading a BPF program for probes fails with {name}: heapprofd needs a kernel \
             built with CONFIG_BPF_SYSCALL=y and CONFIG_BPF_EVENTS=y"
        ),
    }
}

/// What the trial uprobe failing with `errno` means for a run attaching its probes
/// with `method`: the line to print, or `None` when the failure does not stand in the
/// way.
pub fn uprobe_problem(errno: i32, caller: Caller, method: AttachMethod) -> Option<String> {
    let refused = matches!(errno, libc::EPERM | libc::EACCES);
    if refused && caller.cap_perfmon && !caller.cap_sys_admin {
        // Kernels with "perf: Revert to requiring CAP_SYS_ADMIN for uprobes" (upstream
        // ba677dbe77af, 2025, also in the stable lines) open uprobe perf events for
        // CAP_SYS_ADMIN only; multi-uprobe links need CAP_BPF and CAP_PERFMON alone, so
        // a process without CAP_SYS_ADMIN (the unit's drop-in of docs/service.md) then
        // runs all the same.
        return match method {
            AttachMethod::MultiLink => None,
            AttachMethod::PerfEvents => Some(format!(
                "opening a uprobe as a perf event is refused ({}): this kernel allows it \
                 only with CAP_SYS_ADMIN, and heapprofd attaches its probes as perf events \
                 here (no multi-uprobe links before Linux 6.6, or --attach perf-events); \
                 grant CAP_SYS_ADMIN too, or run heapprofd as root with all its capabilities",
                errno_name(errno)
            )),
        };
    }
    Some(kernel_problem(Facility::Uprobe, errno, caller))
}

/// `ENOSYS (Function not implemented)`: the symbol a kernel developer looks up, and
/// its text.
fn errno_name(errno: i32) -> String {
    let symbol = match errno {
        libc::ENOSYS => "ENOSYS",
        libc::EPERM => "EPERM",
        libc::EACCES => "EACCES",
        libc::EINVAL => "EINVAL",
        libc::ENOENT => "ENOENT",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        // The kernel's internal ENOTSUPP, which some probe paths leak to user space.
        524 => "ENOTSUPP",
        _ => "errno",
    };
    let text = if errno == 524 {
        "Operation is not supported".to_owned()
    } else {
        std::io::Error::from_raw_os_error(errno).to_string()
    };
    // "Function not implemented (os error 38)" -> "Function not implemented"
    let text = text.split(" (os error").next().unwrap_or(&text).to_owned();
    if symbol == "errno" {
        format!("errno {errno} ({text})")
    } else {
        format!("{symbol} ({text})")
    }
}

/// The last OS error's number.
fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// `union bpf_attr` for BPF_MAP_CREATE, the fields heapprofd's probe sets.
#[repr(C)]
#[derive(Default)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
}

/// `union bpf_attr` for BPF_PROG_LOAD, up to `kern_version`.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
}

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_MAP_TYPE_ARRAY: u32 = 2;
const BPF_PROG_TYPE_KPROBE: u32 = 2;

/// bpf(cmd, attr): the new file descriptor, or the errno.
fn bpf<T>(cmd: libc::c_long, attr: &T) -> std::result::Result<OwnedFd, i32> {
    // SAFETY: attr is a valid bpf_attr prefix of size_of::<T>() bytes for `cmd`; the
    // kernel reads it only during the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_ref(attr), size_of::<T>()) };
    if fd < 0 {
        return Err(last_errno());
    }
    // SAFETY: bpf() returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// The last kernel that charges BPF maps and programs to RLIMIT_MEMLOCK (5.11 moved
/// them to the memory cgroup).
const LAST_MEMLOCK_CHARGING_KERNEL: (u32, u32) = (5, 10);

/// On kernels that charge BPF memory to RLIMIT_MEMLOCK, lifts the limit, as libbpf's
/// users do. The charge is per user and freed lazily: the maps of a heapprofd that has
/// just exited still count, so even the one-entry map of [`check_bpf`] would be refused
/// with EPERM, which reads as a seccomp refusal. Children started with `-- CMD` were
/// forked before this and keep their own limit.
fn lift_memlock_limit() {
    if running_kernel().is_none_or(|version| version > LAST_MEMLOCK_CHARGING_KERNEL) {
        return;
    }
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads the struct it is given. A failure (no CAP_SYS_RESOURCE)
    // leaves the limit as it was, and the map creation below then says what is refused.
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) };
}

/// The locked-memory limit BPF maps are charged to, in bytes: `Some` on a kernel that
/// charges them (before 5.11) while the limit is finite.
fn memlock_charge_limit() -> Option<u64> {
    if running_kernel().is_none_or(|version| version > LAST_MEMLOCK_CHARGING_KERNEL) {
        return None;
    }
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0
        || limit.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    Some(limit.rlim_cur)
}

/// What a locked-memory limit of `limit` bytes that heapprofd could not lift means.
fn memlock_advice(limit: u64) -> String {
    format!(
        "this kernel (before 5.11) charges BPF maps to the locked-memory limit \
         (RLIMIT_MEMLOCK), {} KiB here, and heapprofd could not raise it (that needs \
         CAP_SYS_RESOURCE); raise it (`ulimit -l unlimited`, LimitMEMLOCK=infinity in a \
         systemd unit) or run heapprofd as root",
        limit / 1024
    )
}

/// The kernel must run BPF: the bpf() system call (CONFIG_BPF_SYSCALL) and programs on
/// probes and tracepoints (CONFIG_BPF_EVENTS). Both are tried for real, with a one-entry
/// map and a two-instruction program, so that a refusal names the missing feature
/// instead of surfacing from the loader as a bare errno.
pub fn check_bpf() -> Result<()> {
    lift_memlock_limit();
    let map = MapCreateAttr {
        map_type: BPF_MAP_TYPE_ARRAY,
        key_size: 4,
        value_size: 4,
        max_entries: 1,
        ..Default::default()
    };
    if let Err(errno) = bpf(BPF_MAP_CREATE, &map) {
        bail!(kernel_problem(
            Facility::BpfSyscall,
            errno,
            Caller::current()
        ));
    }
    // r0 = 0; exit
    let insns: [u64; 2] = [0x0000_0000_0000_00b7, 0x0000_0000_0000_0095];
    let license = c"GPL";
    let program = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_KPROBE,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        ..Default::default()
    };
    if let Err(errno) = bpf(BPF_PROG_LOAD, &program) {
        bail!(kernel_problem(
            Facility::BpfEvents,
            errno,
            Caller::current()
        ));
    }
    // The trial's map fits where heapprofd's tables may not: the loader would then fail
    // with a bare EPERM.
    if let Some(limit) = memlock_charge_limit() {
        log::warn!(
            "loading may be refused with EPERM: {}",
            memlock_advice(limit)
        );
    }
    Ok(())
}

/// perf_event_open's flag for a close-on-exec descriptor (not in the libc crate).
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;

/// `struct perf_event_attr` up to `config2` (PERF_ATTR_SIZE_VER1).
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    /// `uprobe_path` for the uprobe PMU.
    config1: u64,
    /// `probe_offset` for the uprobe PMU.
    config2: u64,
}

/// The kernel must offer uprobes through perf events (CONFIG_UPROBES and
/// CONFIG_UPROBE_EVENTS): the uprobe PMU must exist, and a uprobe on heapprofd's own
/// executable (at its ELF header, which no one executes; registered for this process
/// only, disabled, and closed at once) must open, unless only the missing CAP_SYS_ADMIN
/// refuses it and heapprofd attaches with `method` multi-uprobe links.
pub fn check_uprobes(method: AttachMethod) -> Result<()> {
    let missing_pmu = || {
        format!(
            "this kernel has no uprobe events ({UPROBE_PMU} is missing): heapprofd needs a \
             kernel built with CONFIG_UPROBES=y and CONFIG_UPROBE_EVENTS=y"
        )
    };
    let kind = std::fs::read_to_string(format!("{UPROBE_PMU}/type"))
        .map_err(|_| anyhow::anyhow!(missing_pmu()))?;
    let kind: u32 = kind
        .trim()
        .parse()
        .map_err(|_| anyhow::anyhow!(missing_pmu()))?;
    let path = c"/proc/self/exe";
    let attr = PerfEventAttr {
        kind,
        size: size_of::<PerfEventAttr>() as u32,
        // disabled
        flags: 1,
        config1: path.as_ptr() as u64,
        config2: 0,
        ..Default::default()
    };
    // SAFETY: attr and the path it points to outlive the call; pid 0 is this process,
    // cpu -1 any CPU, no group.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            std::ptr::from_ref(&attr),
            0,
            -1,
            -1,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        return match uprobe_problem(last_errno(), Caller::current(), method) {
            Some(problem) => bail!(problem),
            None => Ok(()),
        };
    }
    // SAFETY: perf_event_open returned a new descriptor that nothing else owns.
    drop(unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A user without capabilities.
    const USER: Caller = Caller {
        root: false,
        cap_bpf: false,
        cap_perfmon: false,
        cap_sys_admin: false,
        unprivileged_bpf_disabled: Some(2),
        perf_event_paranoid: Some(4),
        memlock_limit: None,
    };
    const ROOT: Caller = Caller {
        root: true,
        cap_bpf: true,
        cap_perfmon: true,
        cap_sys_admin: true,
        ..USER
    };
    /// A user granted CAP_BPF and CAP_PERFMON (`setcap`, a unit's AmbientCapabilities).
    const GRANTED: Caller = Caller {
        root: false,
        cap_sys_admin: false,
        ..ROOT
    };

    /// The message for each case names each of `names`, on one line.
    fn says(facility: Facility, errno: i32, caller: Caller, names: &[&str]) {
        let message = kernel_problem(facility, errno, caller);
        assert!(!message.contains('\n'), "{message}");
        for name in names {
            assert!(
                message.contains(name),
                "{facility:?} {errno}: {name} missing: {message}"
            );
        }
    }

    #[test]
    fn bpf_syscall_errors_name_the_option_or_sysctl() {
        says(
            Facility::BpfSyscall,
            libc::ENOSYS,
            ROOT,
            &[
                "no BPF system call",
                "ENOSYS (Function not implemented)",
                "CONFIG_BPF_SYSCALL=y",
            ],
        );
        says(
            Facility::BpfSyscall,
            libc::EPERM,
            USER,
            &["EPERM", "kernel.unprivileged_bpf_disabled is 2", "CAP_BPF"],
        );
        says(
            Facility::BpfSyscall,
            libc::EPERM,
            ROOT,
            &["EPERM", "seccomp"],
        );
        says(
            Facility::BpfSyscall,
            libc::EINVAL,
            ROOT,
            &["EINVAL", "CONFIG_BPF_SYSCALL", "5.10"],
        );
        says(
            Facility::BpfSyscall,
            libc::ENOMEM,
            ROOT,
            &["errno 12 (Cannot allocate memory)", "CONFIG_BPF_SYSCALL"],
        );
    }

    #[test]
    fn bpf_program_errors_name_bpf_events() {
        says(
            Facility::BpfEvents,
            libc::EINVAL,
            ROOT,
            &["EINVAL", "CONFIG_BPF_EVENTS=y"],
        );
        says(
            Facility::BpfEvents,
            libc::EACCES,
            ROOT,
            &["EACCES", "seccomp"],
        );
        says(
            Facility::BpfEvents,
            libc::E2BIG,
            ROOT,
            &["CONFIG_BPF_EVENTS"],
        );
    }

    #[test]
    fn uprobe_errors_name_the_uprobe_options_or_sysctl() {
        for errno in [libc::ENOENT, libc::EINVAL, libc::EOPNOTSUPP, 524] {
            says(
                Facility::Uprobe,
                errno,
                ROOT,
                &[
                    "refuses uprobes",
                    "CONFIG_UPROBES=y",
                    "CONFIG_UPROBE_EVENTS=y",
                ],
            );
        }
        says(
            Facility::Uprobe,
            524,
            ROOT,
            &["ENOTSUPP (Operation is not supported)"],
        );
        says(
            Facility::Uprobe,
            libc::ENOSYS,
            ROOT,
            &[
                "no perf events",
                "CONFIG_PERF_EVENTS=y",
                "CONFIG_UPROBE_EVENTS=y",
            ],
        );
        says(
            Facility::Uprobe,
            libc::EACCES,
            USER,
            &["EACCES", "kernel.perf_event_paranoid is 4", "CAP_PERFMON"],
        );
        says(Facility::Uprobe, libc::EPERM, ROOT, &["EPERM", "seccomp"]);
    }

    #[test]
    fn a_user_with_the_capabilities_is_not_told_to_get_them() {
        // Past the sysctls: a refusal comes from a filter or a security module.
        for (facility, errno) in [
            (Facility::BpfSyscall, libc::EPERM),
            (Facility::BpfEvents, libc::EPERM),
        ] {
            says(
                facility,
                errno,
                GRANTED,
                &["has CAP_BPF and CAP_PERFMON", "seccomp"],
            );
            let message = kernel_problem(facility, errno, GRANTED);
            assert!(
                !message.contains("lacks")
                    && !message.contains("is 2")
                    && !message.contains("is 4"),
                "{message}"
            );
        }
        // CAP_BPF alone creates maps, but kprobe programs need CAP_PERFMON.
        let bpf_only = Caller {
            cap_bpf: true,
            ..USER
        };
        says(
            Facility::BpfEvents,
            libc::EPERM,
            bpf_only,
            &["EPERM", "lacks CAP_PERFMON"],
        );
    }

    #[test]
    fn a_uprobe_refused_for_want_of_cap_sys_admin_matters_only_for_perf_events() {
        // Root in a unit whose bounding set drops CAP_SYS_ADMIN, or a user granted
        // CAP_BPF and CAP_PERFMON.
        let without_sys_admin = Caller {
            cap_sys_admin: false,
            ..ROOT
        };
        for caller in [without_sys_admin, GRANTED] {
            for errno in [libc::EACCES, libc::EPERM] {
                assert_eq!(
                    uprobe_problem(errno, caller, AttachMethod::MultiLink),
                    None,
                    "{caller:?}"
                );
                let problem = uprobe_problem(errno, caller, AttachMethod::PerfEvents)
                    .expect("perf events need CAP_SYS_ADMIN");
                assert!(!problem.contains('\n'), "{problem}");
                for name in ["CAP_SYS_ADMIN", "as a perf event", "6.6", "--attach"] {
                    assert!(problem.contains(name), "{name}: {problem}");
                }
            }
        }
        // With CAP_SYS_ADMIN a refusal comes from a filter; without CAP_PERFMON, from
        // perf_event_paranoid; a kernel without uprobes has none, whatever the method.
        for method in [AttachMethod::MultiLink, AttachMethod::PerfEvents] {
            let problem = uprobe_problem(libc::EACCES, ROOT, method).expect("refused");
            assert!(problem.contains("seccomp"), "{problem}");
            let problem = uprobe_problem(libc::EACCES, USER, method).expect("refused");
            assert!(problem.contains("perf_event_paranoid is 4"), "{problem}");
            let problem = uprobe_problem(libc::ENOENT, GRANTED, method).expect("no uprobes");
            assert!(problem.contains("CONFIG_UPROBE_EVENTS=y"), "{problem}");
        }
    }

    #[test]
    fn a_locked_memory_limit_left_in_place_is_named_before_a_filter() {
        // A kernel before 5.11, and no CAP_SYS_RESOURCE to lift the limit (a user granted
        // CAP_BPF and CAP_PERFMON, root in a container).
        for caller in [ROOT, GRANTED] {
            let limited = Caller {
                memlock_limit: Some(64 * 1024),
                ..caller
            };
            for facility in [Facility::BpfSyscall, Facility::BpfEvents] {
                says(
                    facility,
                    libc::EPERM,
                    limited,
                    &["EPERM", "RLIMIT_MEMLOCK", "64 KiB", "ulimit -l unlimited"],
                );
                assert!(!kernel_problem(facility, libc::EPERM, limited).contains("seccomp"));
            }
        }
    }

    #[test]
    fn an_unknown_sysctl_is_said_to_be_unknown() {
        let caller = Caller {
            unprivileged_bpf_disabled: None,
            perf_event_paranoid: None,
            ..USER
        };
        says(
            Facility::BpfSyscall,
            libc::EPERM,
            caller,
            &["kernel.unprivileged_bpf_disabled is unknown"],
        );
    }
}
