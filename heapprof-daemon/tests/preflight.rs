//! Start-up checks on a kernel that lacks what heapprofd needs: a seccomp filter makes
//! bpf() or perf_event_open() fail as such a kernel does, a private mount hides the
//! uprobe PMU or the kmem tracepoints; heapprofd must then print one line naming the
//! missing feature and the config option, and exit with status 2.

mod common;

use std::{ffi::CStr, io, os::unix::process::CommandExt as _, process::Command};

use common::*;

/// A system call made to fail with `errno`, for every call or only when its first
/// argument is `first_arg` (bpf()'s command).
#[derive(Clone, Copy)]
struct Refusal {
    syscall: libc::c_long,
    first_arg: Option<u32>,
    errno: i32,
}

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;

/// Installs a seccomp filter making `refusal`'s system call fail (in the child, before
/// exec: the filter is inherited by heapprofd).
fn refuse(cmd: &mut Command, refusal: Refusal) {
    const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    let op = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    // struct seccomp_data: nr at 0, arch at 4, args[0] at 16 (its low half, little-endian).
    let first_arg = refusal.first_arg;
    let mut program = vec![
        op(LD_W_ABS, 0, 0, 4),
        op(JEQ_K, 1, 0, AUDIT_ARCH),
        op(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
        op(LD_W_ABS, 0, 0, 0),
    ];
    if let Some(arg) = first_arg {
        program.extend([
            op(JEQ_K, 0, 3, refusal.syscall as u32),
            op(LD_W_ABS, 0, 0, 16),
            op(JEQ_K, 0, 1, arg),
        ]);
    } else {
        program.push(op(JEQ_K, 0, 1, refusal.syscall as u32));
    }
    program.extend([
        op(RET_K, 0, 0, libc::SECCOMP_RET_ERRNO | refusal.errno as u32),
        op(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]);
    // SAFETY: between fork and exec the closure makes only async-signal-safe system
    // calls on memory it owns.
    unsafe {
        cmd.pre_exec(move || {
            let fprog = libc::sock_fprog {
                len: program.len() as u16,
                filter: program.as_ptr().cast_mut(),
            };
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                || libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER,
                    std::ptr::from_ref(&fprog),
                ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Runs heapprofd on this test's own process; returns its status code and stderr.
fn start_refused(setup: impl FnOnce(&mut Command)) -> (Option<i32>, String) {
    start_refused_with(&[], setup)
}

/// [`start_refused`] with more arguments (`--kernel`).
fn start_refused_with(args: &[&str], setup: impl FnOnce(&mut Command)) -> (Option<i32>, String) {
    start_refused_as(None, args, setup)
}

/// [`start_refused_with`], as user nobody when `caps` is given, with those capabilities
/// (setpriv's names, "-all" for none) inheritable and ambient: what `setcap` on the
/// binary gives a user.
fn start_refused_as(
    caps: Option<&str>,
    args: &[&str],
    setup: impl FnOnce(&mut Command),
) -> (Option<i32>, String) {
    require_root();
    let dir = scratch();
    let mut heapprofd = heapprofd(&dir.path().join("profiles"));
    heapprofd.args(["--pid", &std::process::id().to_string()]);
    // A run that starts after all ends by itself.
    heapprofd.args(["--duration", "1s"]).args(args);
    let mut cmd = match caps {
        None => heapprofd,
        Some(caps) => {
            // setpriv is util-linux's, in every Debian.
            let mut cmd = Command::new("setpriv");
            cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
                .arg(format!("--inh-caps={caps}"));
            if caps != "-all" {
                cmd.arg(format!("--ambient-caps={caps}"));
            }
            cmd.arg(heapprofd.get_program()).args(heapprofd.get_args());
            cmd
        }
    };
    setup(&mut cmd);
    let output = cmd.output().expect("starting heapprofd");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Status 2 and a single line naming each of `names`.
fn assert_one_line(status: Option<i32>, stderr: &str, names: &[&str]) {
    assert_eq!(status, Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "not one line: {stderr}");
    assert!(stderr.starts_with("heapprofd: error: "), "{stderr}");
    for name in names {
        assert!(stderr.contains(name), "{name} missing: {stderr}");
    }
}

#[test]
fn a_kernel_without_bpf_is_named() {
    let (status, stderr) = start_refused(|cmd| {
        refuse(
            cmd,
            Refusal {
                syscall: libc::SYS_bpf,
                first_arg: None,
                errno: libc::ENOSYS,
            },
        )
    });
    assert_one_line(
        status,
        &stderr,
        &["no BPF system call", "ENOSYS", "CONFIG_BPF_SYSCALL"],
    );
}

#[test]
fn bpf_refused_to_root_names_the_filter() {
    let (status, stderr) = start_refused(|cmd| {
        refuse(
            cmd,
            Refusal {
                syscall: libc::SYS_bpf,
                first_arg: None,
                errno: libc::EPERM,
            },
        )
    });
    assert_one_line(status, &stderr, &["EPERM", "seccomp"]);
}

#[test]
fn a_user_without_capabilities_is_told_them_and_the_sysctl() {
    let (status, stderr) = start_refused_as(Some("-all"), &[], |_| {});
    assert_one_line(
        status,
        &stderr,
        &["missing CAP_BPF and CAP_PERFMON", "root"],
    );
    // The sysctl that refuses bpf() to such a user is named when it does.
    let sysctl = std::fs::read_to_string("/proc/sys/kernel/unprivileged_bpf_disabled")
        .expect("reading kernel.unprivileged_bpf_disabled");
    let named = format!("kernel.unprivileged_bpf_disabled is {}", sysctl.trim());
    assert_eq!(
        stderr.contains(&named),
        sysctl.trim() != "0",
        "{named}: {stderr}"
    );
}

#[test]
fn bpf_refused_to_a_user_granted_the_capabilities_names_the_filter() {
    // Past the sysctls: the user has what they ask for, the refusal is the filter's.
    let (status, stderr) = start_refused_as(Some("+bpf,+perfmon"), &[], |cmd| {
        refuse(
            cmd,
            Refusal {
                syscall: libc::SYS_bpf,
                first_arg: None,
                errno: libc::EPERM,
            },
        )
    });
    assert_one_line(
        status,
        &stderr,
        &["EPERM", "has CAP_BPF and CAP_PERFMON", "seccomp"],
    );
    assert!(!stderr.contains("lacks"), "{stderr}");
}

/// Root without CAP_SYS_ADMIN, as the unit's drop-in of docs/service.md makes it.
fn drop_sys_admin(cmd: &mut Command) {
    const CAP_SYS_ADMIN: libc::c_ulong = 21;
    // SAFETY: between fork and exec the closure makes one system call.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[test]
fn without_cap_sys_admin_only_perf_event_uprobes_are_refused() {
    use heapprof_daemon::probes::{AttachChoice, AttachMethod, attach_method};
    // The trial uprobe is a perf event, which kernels since 2025 open for CAP_SYS_ADMIN
    // only; multi-uprobe links need CAP_BPF and CAP_PERFMON alone.
    let sys_admin_line = ["as a perf event", "CAP_SYS_ADMIN", "--attach perf-events"];
    let (status, stderr) = start_refused(drop_sys_admin);
    match attach_method(AttachChoice::Auto, Some(std::process::id())) {
        AttachMethod::MultiLink => assert_eq!(status, Some(0), "{stderr}"),
        AttachMethod::PerfEvents => assert_one_line(status, &stderr, &sys_admin_line),
    }
    // Perf events chosen: refused with that line, unless this kernel predates the
    // change and opens them for CAP_PERFMON.
    let (status, stderr) = start_refused_with(&["--attach", "perf-events"], drop_sys_admin);
    if status != Some(0) {
        assert_one_line(status, &stderr, &sys_admin_line);
    }
}

#[test]
fn a_kernel_without_bpf_events_is_named() {
    // BPF_PROG_LOAD (5) of a kprobe program fails with EINVAL without CONFIG_BPF_EVENTS.
    let (status, stderr) = start_refused(|cmd| {
        refuse(
            cmd,
            Refusal {
                syscall: libc::SYS_bpf,
                first_arg: Some(5),
                errno: libc::EINVAL,
            },
        )
    });
    assert_one_line(status, &stderr, &["EINVAL", "CONFIG_BPF_EVENTS"]);
}

#[test]
fn a_kernel_without_perf_events_is_named() {
    let (status, stderr) = start_refused(|cmd| {
        refuse(
            cmd,
            Refusal {
                syscall: libc::SYS_perf_event_open,
                first_arg: None,
                errno: libc::ENOSYS,
            },
        )
    });
    assert_one_line(
        status,
        &stderr,
        &["ENOSYS", "CONFIG_PERF_EVENTS", "CONFIG_UPROBE_EVENTS"],
    );
}

#[test]
fn a_kernel_refusing_uprobes_is_named() {
    let (status, stderr) = start_refused(|cmd| {
        refuse(
            cmd,
            Refusal {
                syscall: libc::SYS_perf_event_open,
                first_arg: None,
                errno: libc::EOPNOTSUPP,
            },
        )
    });
    assert_one_line(
        status,
        &stderr,
        &["refuses uprobes", "EOPNOTSUPP", "CONFIG_UPROBE_EVENTS"],
    );
}

/// Runs heapprofd in a private mount namespace where `dir` is an empty tmpfs (holding
/// `subdir` when given).
fn hide(cmd: &mut Command, dir: &'static CStr, subdir: Option<&'static CStr>) {
    // SAFETY: between fork and exec the closure makes only system calls, on
    // NUL-terminated constants.
    unsafe {
        cmd.pre_exec(move || {
            let none = std::ptr::null();
            if libc::unshare(libc::CLONE_NEWNS) != 0
                || libc::mount(
                    none,
                    c"/".as_ptr(),
                    none,
                    libc::MS_REC | libc::MS_PRIVATE,
                    none.cast(),
                ) != 0
                || libc::mount(
                    c"tmpfs".as_ptr(),
                    dir.as_ptr(),
                    c"tmpfs".as_ptr(),
                    0,
                    none.cast(),
                ) != 0
                || subdir.is_some_and(|sub| libc::mkdir(sub.as_ptr(), 0o755) != 0)
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[test]
fn a_kernel_without_kmem_tracepoints_is_named() {
    // Kernel mode on a tracefs without the kmem events: the tracing directory has an
    // empty events/.
    let (status, stderr) = start_refused_with(&["--kernel"], |cmd| {
        hide(
            cmd,
            c"/sys/kernel/tracing",
            Some(c"/sys/kernel/tracing/events"),
        )
    });
    assert_one_line(
        status,
        &stderr,
        &["no kmem tracepoints", "CONFIG_TRACEPOINTS"],
    );
}

#[test]
fn a_kernel_without_the_uprobe_pmu_is_named() {
    // A private mount namespace in which the PMU directory is empty, as on a kernel
    // built without CONFIG_UPROBE_EVENTS.
    let (status, stderr) = start_refused(|cmd| hide(cmd, c"/sys/bus/event_source/devices", None));
    assert_one_line(
        status,
        &stderr,
        &[
            "/sys/bus/event_source/devices/uprobe is missing",
            "CONFIG_UPROBES",
            "CONFIG_UPROBE_EVENTS",
        ],
    );
}
