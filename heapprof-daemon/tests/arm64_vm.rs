//! The static aarch64 heapprofd in an arm64 VM: Debian's arm64 6.1 kernel (the Rock 5B
//! BSP line) under qemu-system-aarch64, booted from an initramfs holding heapprofd,
//! busybox, the arm64 C library and the test programs built by the cross compiler.
//!
//! The VM runs every scenario twice, the second time with `/sys/kernel/btf/vmlinux`
//! hidden (an empty file bind-mounted over it), and prints each profile as base64
//! between markers; this test decodes them and checks them like the x86 tests do.
//!
//! CFI unwinding on aarch64: the true-stacks programs (tests/programs/cxx_stl.cpp and
//! wrappers.c) are cross-built with `-O2 -g -fomit-frame-pointer` and profiled in the
//! VM; meanwhile the host builds them natively with the same flags and runs them under
//! valgrind's DHAT (which the VM does not have). Inlining differs between the two
//! compilers, so each stack is reduced to the program's own functions (see
//! [`CfiProgram::reduce`]): the arm64 chains, with their bytes and blocks, must equal
//! DHAT's, and every arm64 stack must be unwound to its end: through main to the
//! program's `_start`, or, for code run before main, to the loader's start code.
//!
//! Allocators other than the system glibc's dynamic malloc (tests/allocators.rs): a
//! static glibc program (`aarch64-linux-gnu-gcc -static`, tests/programs/alloc_abc.c)
//! and a static musl one (tests/programs/rust_jemalloc on the C library's malloc, built
//! for aarch64-unknown-linux-musl, whose C library Rust brings) print their own counts;
//! the profiles' totals and main/a/b stacks must equal them.
//!
//! `--pid` injection with heapprofd SIGKILLed in the middle of each of its calls into
//! a waiting process (from the second call on: the first maps the return stub's
//! pages): the arm64 return stub must resume the held thread every time, and the
//! process then works and ends with status 0.
//!
//! heapprofd's glibc build, the binary a native `cargo xtask build` on a board makes,
//! runs there too, once, on Debian's arm64 C library: the exact totals of the
//! malloc-family program and the main/a/b stacks.
//!
//! `cargo xtask test` and `cargo xtask vm-test` provide both binaries and the VM's
//! kernel and libraries (HEAPPROFD_AARCH64_BINARY, HEAPPROFD_AARCH64_GLIBC_BINARY,
//! HEAPPROFD_ARM64_VM_ASSETS).

mod common;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use common::{
    dhat,
    vm::{self, copy, env_path, profiles_from, run_to_end},
    *,
};
use heapprof_common::kernel::DeferredFreePath;
use heapprof_daemon::{
    pprof::keyed_comments,
    probes::kernel::{DeferredFreeWatch, watch_key},
    report::losses,
};

/// What the test needs of the environment.
const NEEDS: &str = "the arm64 VM test needs the static aarch64 build and the VM's kernel";

/// The VM's script: two rounds of the scenarios, then power off.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
mount -t tracefs tracefs /sys/kernel/tracing
mount -t bpf bpf /sys/fs/bpf
mkdir -p /dev/shm && mount -t tmpfs shm /dev/shm
echo "==KERNEL $(uname -r) $(uname -m)"
# A real module for kernel mode: the RAM disk driver, one 8 MiB disk.
insmod /modules/brd.ko rd_nr=1 rd_size=8192
echo "==INSMOD brd $?"
# Whatever hangs, the VM ends and the host sees how far it got.
(sleep 600; echo "==WATCHDOG: the scenarios took too long"; poweroff -f) &

scenarios() {
    round=$1
    out=/tmp/out/$round
    mkdir -p $out
    /heapprofd -o $out/family -- /t/family 2 100 2>&1
    echo "==STATUS $round family $?"
    /heapprofd -o $out/stacks-O0 -- /t/stacks-O0 2>&1
    echo "==STATUS $round stacks-O0 $?"
    /heapprofd -o $out/stacks-O2 -- /t/stacks-O2 2>&1
    echo "==STATUS $round stacks-O2 $?"
    # Static programs with their own allocator (tests/allocators.rs's cases): glibc's
    # malloc linked in, musl's (a Rust program). Each prints its own count.
    for prog in abc-static rust-musl; do
        /heapprofd -o $out/$prog -- /t/$prog > /tmp/$prog.out 2> /tmp/$prog.log
        echo "==STATUS $round $prog $?"
        echo "==LOG $round $prog"
        cat /tmp/$prog.log
        echo "==OUTPUT $round $prog"
        cat /tmp/$prog.out
        echo "==OUTPUT-END"
    done
    # --pid: attach to a waiting process, let it work, end with it.
    rm -f /tmp/fifo && mkfifo /tmp/fifo
    /t/waiter 1000 48 < /tmp/fifo > /tmp/waiter.out &
    waiter=$!
    exec 3> /tmp/fifo
    # (without fd 3: holding the fifo open would keep the waiter from ever seeing its end)
    rm -f /tmp/pid.ready
    /heapprofd -o $out/pid --interval 200ms --inject auto --ready-file /tmp/pid.ready --stats-json /tmp/pid.json --pid $waiter > /tmp/pid.log 2>&1 3>&- &
    heapprofd=$!
    tries=0
    until [ -e /tmp/pid.ready ] || [ $tries -ge 600 ]; do sleep 0.1; tries=$((tries + 1)); done
    echo go >&3
    tries=0
    until grep -q done /tmp/waiter.out || [ $tries -ge 600 ]; do sleep 0.1; tries=$((tries + 1)); done
    exec 3>&-
    wait $heapprofd
    echo "==STATUS $round pid $?"
    cat /tmp/pid.log
    echo "==PIDSTATS $round"
    cat /tmp/pid.json
    echo "==PIDSTATS-END"
    # CFI unwinding: the true-stacks programs built without frame pointers. Their
    # stdout goes to a file, as the host's DHAT run gives them a pipe: stdio sizes a
    # stream's buffer by its st_blksize, 4096 for a file, a pipe (and this console),
    # so printf's buffer is the same on both sides.
    /heapprofd -o $out/cxx_stl -- /t/cxx_stl > /tmp/cxx_stl.out
    echo "==STATUS $round cxx_stl $?"
    mkdir -p /tmp/wrappers
    /heapprofd -o $out/wrappers -- /t/wrappers /tmp/wrappers > /tmp/wrappers.out
    echo "==STATUS $round wrappers $?"
    # Kernel mode, launch: the pipes workload opens 50 pipes, closes them, exits.
    printf 'open\nclose\n' | /heapprofd --kernel -o $out/kernel -- /t/pipes 50 2>&1
    echo "==STATUS $round kernel $?"
    # Kernel mode: everything made is freed again (epoll items go through kfree_rcu).
    /heapprofd --kernel -o $out/release -- /t/release_all 500 3 2>&1
    echo "==STATUS $round release $?"
    # Kernel mode with pages: writes to the RAM disk, written back by fsync in dd's
    # own context, allocate the disk's pages in brd (each round writes its own 2 MiB:
    # a page the disk has already is not allocated again).
    case $round in btf) seek=0 ;; *) seek=64 ;; esac
    /heapprofd --kernel --pages -o $out/brd -- dd if=/dev/urandom of=/dev/ram0 bs=64k count=32 seek=$seek conv=fsync 2>&1
    echo "==STATUS $round brd $?"
    for f in $(find $out -name '*.pb.gz' | sort); do
        echo "==FILE $f"
        base64 $f
        echo "==END"
    done
}

scenarios btf
# The glibc build (dynamically linked, as a native build on a board makes it).
mkdir -p /tmp/out/glibc
/heapprofd-glibc -o /tmp/out/glibc/family -- /t/family 2 100 2>&1
echo "==STATUS glibc family $?"
/heapprofd-glibc -o /tmp/out/glibc/stacks-O2 -- /t/stacks-O2 2>&1
echo "==STATUS glibc stacks-O2 $?"
for f in $(find /tmp/out/glibc -name '*.pb.gz' | sort); do
    echo "==FILE $f"
    base64 $f
    echo "==END"
done
# heapprofd SIGKILLed in the middle of its Nth call into a process it joins: the call
# returns into the return stub, which resumes the thread where it was held; the
# process then works and ends as it should. First into new processes, N = 2, 3, ...
# (the 1st maps the stub's pages) until a run makes fewer calls; then, N = 1, 2, ...,
# into one that has the library from an earlier session.
kill_in_call() { # N PID: 0 if heapprofd died in its Nth call, 1 if it made fewer
    rm -f /tmp/kill.ready
    HEAPPROFD_TEST_KILL_IN_REMOTE_CALL=$1 /heapprofd -o /tmp/out/kill --interval 1h --inject auto --ready-file /tmp/kill.ready --pid $2 > /tmp/kill.log 2>&1 4>&- &
    k=$!
    tries=0
    until ! kill -0 $k 2>/dev/null || [ -e /tmp/kill.ready ] || [ $tries -ge 600 ]; do sleep 0.1; tries=$((tries + 1)); done
    if kill -0 $k 2>/dev/null; then
        kill -INT $k
        wait $k
        return 1
    fi
    wait $k
    return 0
}
start_waiter() {
    rm -f /tmp/kfifo && mkfifo /tmp/kfifo
    /t/waiter 1000 48 < /tmp/kfifo > /tmp/kwaiter.out &
    kwaiter=$!
    exec 4> /tmp/kfifo
}
end_waiter() { # NAME: the waiter works, ends, and says so
    echo go >&4
    tries=0
    until grep -q done /tmp/kwaiter.out || [ $tries -ge 300 ]; do sleep 0.1; tries=$((tries + 1)); done
    exec 4>&-
    wait $kwaiter
    echo "==STATUS $1 $?"
}
killed=0
call=2
while [ $call -le 30 ]; do
    start_waiter
    kill_in_call $call $kwaiter || { end_waiter "new-$call"; break; }
    killed=$call
    end_waiter "new-$call"
    call=$((call + 1))
done
echo "==KILLED-UP-TO new $killed"
start_waiter
kill_in_call 1000 $kwaiter
loaded=0
call=1
while [ $call -le 30 ] && kill_in_call $call $kwaiter; do
    kill -0 $kwaiter 2>/dev/null || break
    loaded=$call
    call=$((call + 1))
done
end_waiter "loaded"
echo "==KILLED-UP-TO loaded $loaded"
if [ -e /sys/kernel/btf/vmlinux ]; then
    : > /tmp/empty
    mount --bind /tmp/empty /sys/kernel/btf/vmlinux
    echo "==BTF hidden: $(wc -c < /sys/kernel/btf/vmlinux) bytes"
fi
scenarios nobtf
echo "==DONE"
poweroff -f
"#;

/// A program of the true-stacks tests (tests/true_stacks.rs), built with [`CFI_FLAGS`]
/// for the VM and for the host: without frame pointers, its stacks on arm64 come only
/// from CFI, and DHAT's on the host are the expected ones.
struct CfiProgram {
    /// Its name: `/t/NAME` in the VM, its profiles in `/tmp/out/ROUND/NAME/`.
    name: &'static str,
    /// Its source in tests/programs.
    source: &'static str,
    /// The host's compiler and the cross compiler.
    compilers: (&'static str, &'static str),
    /// The program's own functions (last components of the names): what stays of a
    /// stack when it is reduced to the architecture-independent chain.
    own: &'static [&'static str],
    /// It takes a directory to write its files in (the VM passes `/tmp/wrappers`).
    takes_dir: bool,
}

const CFI_FLAGS: &[&str] = &["-O2", "-g", "-fomit-frame-pointer"];

/// The reduced chain of a stack without any of the program's functions.
const NONE_OF_THE_PROGRAM: &str = "(none of the program's functions)";

const CFI_PROGRAMS: [CfiProgram; 2] = [
    CfiProgram {
        name: "cxx_stl",
        source: "cxx_stl.cpp",
        compilers: ("g++", "aarch64-linux-gnu-g++"),
        // `workload::*` (each noinline except make_values, which either compiler may
        // inline: both tools then name it from the debug info's inline records) and main.
        own: dhat::CXX_STL_FUNCTIONS,
        takes_dir: false,
    },
    CfiProgram {
        name: "wrappers",
        source: "wrappers.c",
        compilers: ("gcc", "aarch64-linux-gnu-gcc"),
        own: dhat::WRAPPERS_FUNCTIONS,
        takes_dir: true,
    },
];

impl CfiProgram {
    /// Whether a normalized frame name is one of the program's own functions: a C name,
    /// `main`, a `workload::` function, or an inlined frame's bare name.
    fn is_own(&self, name: &str) -> bool {
        let last = name.rsplit("::").next().unwrap_or(name);
        self.own.contains(&last) && (name == last || name.starts_with("workload::"))
    }

    /// `stacks` reduced to the program's own frames (last components), bytes and
    /// blocks summed per reduced chain. A stack without any (code run before main)
    /// becomes [`NONE_OF_THE_PROGRAM`].
    fn reduce(&self, stacks: &dhat::StackMap) -> dhat::StackMap {
        let mut reduced = dhat::StackMap::new();
        for (stack, (bytes, blocks)) in stacks {
            let mut chain: Vec<String> = stack
                .iter()
                .filter(|f| self.is_own(f))
                .map(|f| f.rsplit("::").next().unwrap_or(f).to_owned())
                .collect();
            if chain.is_empty() {
                chain.push(NONE_OF_THE_PROGRAM.to_owned());
            }
            let entry = reduced.entry(chain).or_default();
            entry.0 += bytes;
            entry.1 += blocks;
        }
        reduced
    }
}

/// The expected chains: each [`CfiProgram`] built for the host and run under DHAT,
/// its normalized stacks (for messages) and their reduction, by program name.
fn host_dhat_stacks(dir: &Path) -> BTreeMap<&'static str, (dhat::StackMap, dhat::StackMap)> {
    CFI_PROGRAMS
        .iter()
        .map(|program| {
            let work = dir.join(format!("x86-{}", program.name));
            std::fs::create_dir_all(&work).expect("creating the DHAT directory");
            let binary = compile_exact(
                program.compilers.0,
                &work,
                program.source,
                program.name,
                CFI_FLAGS,
            );
            let files = work.join("files");
            std::fs::create_dir_all(&files).expect("creating the program's directory");
            let args: Vec<&std::ffi::OsStr> = if program.takes_dir {
                vec![files.as_os_str()]
            } else {
                Vec::new()
            };
            let truth = dhat::run(&binary, &args, &[], &work).stacks();
            let reduced = program.reduce(&truth);
            (program.name, (truth, reduced))
        })
        .collect()
}

/// Builds the initramfs: busybox, the C library, heapprofd (static, and the glibc
/// build as `/heapprofd-glibc`), the test programs, /init.
fn initramfs(dir: &Path, heapprofd: &Path, glibc: &Path, assets: &Path) -> PathBuf {
    let root = dir.join("root");
    for sub in ["bin", "t", "proc", "sys", "dev", "tmp", "modules"] {
        std::fs::create_dir_all(root.join(sub)).expect("mkdir");
    }
    copy(&assets.join("bin/busybox"), &root.join("bin/busybox"));
    let libstdcxx = assets.join("lib/aarch64-linux-gnu/libstdc++.so.6");
    assert!(
        libstdcxx.exists(),
        "{} is missing: the VM's assets predate the C++ program; `cargo xtask vm-test` \
         fetches them again",
        libstdcxx.display()
    );
    let status = Command::new("cp")
        .arg("-a")
        .arg(assets.join("lib"))
        .arg(&root)
        .status()
        .expect("cp");
    assert!(status.success(), "copying the C library");
    copy(heapprofd, &root.join("heapprofd"));
    copy(glibc, &root.join("heapprofd-glibc"));
    let brd = assets.join("modules/brd.ko");
    assert!(
        brd.exists(),
        "{} is missing: the VM's assets predate the module test; `cargo xtask vm-test` \
         fetches them again",
        brd.display()
    );
    copy(&brd, &root.join("modules/brd.ko"));
    let cc = "aarch64-linux-gnu-gcc";
    for (source, name, flags) in [
        ("family", "family", "-O0"),
        ("stacks", "stacks-O0", "-O0"),
        ("stacks", "stacks-O2", "-O2"),
        ("waiter", "waiter", "-O0"),
        ("pipes", "pipes", "-O1"),
        ("release_all", "release_all", "-O1"),
    ] {
        let binary = compile_with(cc, dir, source, name, &[flags]);
        copy(&binary, &root.join("t").join(name));
    }
    // The allocator cases: alloc_abc.c on static glibc, the Rust program on static
    // musl (its C library's malloc; linked by GNU ld through the cross gcc).
    let abc_static = compile_with(cc, dir, "alloc_abc", "abc-static", &["-O2", "-static"]);
    copy(&abc_static, &root.join("t/abc-static"));
    let rust_musl = counted::rust_program(
        false,
        Some("aarch64-unknown-linux-musl"),
        counted::Linker::GnuLd,
    );
    copy(&rust_musl, &root.join("t/rust-musl"));
    for program in &CFI_PROGRAMS {
        let binary = compile_exact(
            program.compilers.1,
            dir,
            program.source,
            program.name,
            CFI_FLAGS,
        );
        copy(&binary, &root.join("t").join(program.name));
    }
    let init = root.join("init");
    std::fs::write(&init, INIT).expect("writing /init");
    let status = Command::new("chmod")
        .arg("755")
        .arg(&init)
        .status()
        .expect("chmod");
    assert!(status.success());
    let image = dir.join("initramfs.cpio.gz");
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "cd {} && find . | cpio -o -H newc --quiet | gzip -1 > {}",
            root.display(),
            image.display()
        ))
        .status()
        .expect("running cpio (install it: cargo xtask setup)");
    assert!(status.success(), "building the initramfs");
    image
}

/// Boots the VM and returns its console output.
fn boot(kernel: &Path, initramfs: &Path) -> String {
    // TCG emulation: both rounds take about 140 s here (with the architected pointer
    // authentication, over 500 s); the VM's own watchdog powers it off at 600 s, this
    // bound only covers a VM that does not boot at all.
    let bound = Duration::from_secs(720);
    run_to_end(
        Command::new("qemu-system-aarch64")
            // `pauth-impdef`: Debian's kernel signs return addresses, and TCG's emulation of
            // the architected QARMA algorithm makes every kernel call several times slower.
            .args([
                "-M",
                "virt",
                "-cpu",
                "max,pauth-impdef=on",
                "-smp",
                "2",
                "-m",
                "2048",
            ])
            .args(["-nographic", "-no-reboot", "-nic", "none"])
            .arg("-kernel")
            .arg(kernel)
            .arg("-initrd")
            .arg(initramfs)
            .args(["-append", "console=ttyAMA0 rdinit=/init panic=-1 quiet"]),
        "qemu-system-arm",
        bound,
    )
}

/// The last profile of one scenario of one round.
fn last<'a>(
    profiles: &'a BTreeMap<String, heapprof_daemon::pprof::proto::Profile>,
    round: &str,
    scenario: &str,
) -> &'a heapprof_daemon::pprof::proto::Profile {
    vm::last(profiles, &format!("{round}/{scenario}"))
}

/// The reason heapprofd counts a stack under when its unwinder stopped before the end.
const CUT_STACKS: heapprof_common::DropReason = heapprof_common::DropReason::StackIncomplete;

/// The dynamic loader, in the VM and in the assets.
const LOADER: &str = "lib/aarch64-linux-gnu/ld-linux-aarch64.so.1";

/// How far past the loader's entry point (`_start`) its `_dl_start_user` calls
/// `_dl_init` at most: glibc's aarch64 `_start` (sysdeps/aarch64/dl-start.S) is a few
/// instructions before that call, which returns to entry + 0x38 in Debian's 2.36.
const LOADER_START_SPAN: u64 = 0x80;

/// The loader's entry point (an address of the file: its first segment maps offset 0
/// at address 0), read from the assets' copy of the VM's loader.
fn loader_entry(assets: &Path) -> u64 {
    use object::Object as _;
    let path = assets.join(LOADER);
    let data = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    object::File::parse(data.as_slice())
        .unwrap_or_else(|e| panic!("{} is not an ELF file: {e}", path.display()))
        .entry()
}

/// Checks that every stack of `profile` (a run of `program`) was unwound to its end: its
/// outermost frame is the program's `_start` and the stack goes through `main`, or,
/// for code run before main (libstdc++'s emergency exception pool, allocated by its
/// initializer, which `_dl_init` calls), the loader's own start code after its entry
/// point. The loader in the VM has no symbols, so that frame is known by its address.
fn check_stack_ends(
    what: &str,
    profile: &heapprof_daemon::pprof::proto::Profile,
    program: &CfiProgram,
    loader_entry: u64,
) {
    let string = |i: i64| profile.string_table[i as usize].as_str();
    let points = dhat::heapprofd_points(profile);
    let aliases = dhat::Aliases::default();
    let mut wrong = Vec::new();
    for (sample, point) in profile.sample.iter().zip(&points) {
        let stack = dhat::normalize_stack(&point.frames, &aliases);
        let outermost = sample
            .location_id
            .last()
            .and_then(|id| profile.location.iter().find(|l| l.id == *id))
            .expect("a sample's locations are in the profile");
        let mapping = profile
            .mapping
            .iter()
            .find(|m| m.id == outermost.mapping_id);
        let file = mapping.map_or("", |m| string(m.filename));
        let name = outermost
            .line
            .last()
            .and_then(|line| profile.function.iter().find(|f| f.id == line.function_id))
            .map_or("", |f| string(f.name));
        let at_program_start = file == format!("/t/{}", program.name) && name == "_start";
        let at_loader_start = file == format!("/{LOADER}")
            && mapping.is_some_and(|m| {
                let address = outermost
                    .address
                    .wrapping_sub(m.memory_start)
                    .wrapping_add(m.file_offset);
                (loader_entry..loader_entry + LOADER_START_SPAN).contains(&address)
            });
        if at_program_start && stack.last().is_some_and(|f| f == "main") {
            continue;
        }
        if at_loader_start && !stack.iter().any(|f| f == "main") {
            continue;
        }
        wrong.push(format!(
            "  {} B in {} blocks, outermost frame {name:?} at {:#x} in {file:?}: {}",
            point.bytes,
            point.blocks,
            outermost.address,
            dhat::show(&stack)
        ));
    }
    assert!(
        wrong.is_empty(),
        "{what}: stacks that end neither at the program's _start through main nor at the \
         loader's start code (entry {loader_entry:#x} + {LOADER_START_SPAN:#x}):\n{}",
        wrong.join("\n")
    );
}

/// The CFI scenarios of one round: every stack unwound to its end (no stack counted as
/// cut short, the outermost frame a start routine, see [`check_stack_ends`]), and the
/// program's own call chains with the bytes and blocks of x86 DHAT's. Nothing is left
/// out: the one allocation sized by the environment, stdout's buffer (by st_blksize,
/// under `_IO_file_doallocate`), is the same in the VM and on the host (see [`INIT`]).
fn check_cfi(
    profiles: &BTreeMap<String, heapprof_daemon::pprof::proto::Profile>,
    round: &str,
    expected: &BTreeMap<&str, (dhat::StackMap, dhat::StackMap)>,
    loader_entry: u64,
) {
    for program in &CFI_PROGRAMS {
        let what = format!(
            "{round}: {} ({} {})",
            program.name,
            program.compilers.1,
            CFI_FLAGS.join(" ")
        );
        let profile = last(profiles, round, program.name);
        let stacks = dhat::normalize(&dhat::heapprofd_points(profile), &dhat::Aliases::default());
        assert_eq!(
            drop_count(profile, CUT_STACKS),
            0,
            "{what}: the unwinder stopped early; its stacks:\n{}",
            dhat::render(&stacks)
        );
        check_stack_ends(&what, profile, program, loader_entry);
        let (truth, chains) = &expected[program.name];
        let ours = program.reduce(&stacks);
        if ours == *chains {
            eprintln!(
                "{what}: reduced chains, arm64 heapprofd = x86 DHAT:\n{}",
                dhat::render(&ours)
            );
        } else {
            eprintln!(
                "{what}: whole stacks, arm64 heapprofd:\n{}x86 DHAT:\n{}",
                dhat::render(&stacks),
                dhat::render(truth)
            );
        }
        dhat::assert_same_stacks(&what, chains, &ours, program.own);
    }
}

/// Exact totals of every family function (tests/exact.rs has the derivation).
fn check_family(profiles: &BTreeMap<String, heapprof_daemon::pprof::proto::Profile>, round: &str) {
    let family = samples(last(profiles, round, "family"));
    let (threads, iterations, page) = (2i64, 100i64, 4096i64);
    let calls = threads * iterations;
    let bytes_per_thread: i64 = (0..iterations)
        .map(|i| (16 + i) + 4 * (8 + i) + 32 + (64 + i) + 30 + 100 + 128 + 48 + 200 + page)
        .sum();
    let ours = |s: &Sample| s.stack.iter().any(|f| f == "exercise");
    assert_eq!(
        totals(&family, ours),
        [
            10 * calls,
            threads * bytes_per_thread,
            2 * calls,
            calls * (200 + page)
        ],
        "{round}: family totals (allocated objects/bytes, in use objects/bytes)"
    );
}

/// The three stacks of main/a/b in each of `scenarios`, the caller frame included.
fn check_abc(
    profiles: &BTreeMap<String, heapprof_daemon::pprof::proto::Profile>,
    round: &str,
    scenarios: &[&str],
) {
    for scenario in scenarios {
        let (stacks, _) = abc_stacks(&samples(last(profiles, round, scenario)));
        assert_eq!(stacks, expected_abc_stacks(), "{round}: {scenario}");
    }
}

fn check_round(
    profiles: &BTreeMap<String, heapprof_daemon::pprof::proto::Profile>,
    round: &str,
    expected: &BTreeMap<&str, (dhat::StackMap, dhat::StackMap)>,
    loader_entry: u64,
    console: &str,
) {
    check_cfi(profiles, round, expected, loader_entry);
    check_family(profiles, round);
    check_abc(profiles, round, &["stacks-O0", "stacks-O2"]);

    // --pid joins the waiter in-process (the preload library injected by ptrace, the
    // arm64 remote calls), as its --stats-json says, and counts as the probes would.
    let pid_log = console
        .split_once(&format!("==STATUS {round} pid "))
        .map(|(_, after)| after.split("==STATUS").next().unwrap_or(after))
        .unwrap_or_default();
    let pid_stats = console
        .split_once(&format!("==PIDSTATS {round}"))
        .and_then(|(_, after)| after.split_once("==PIDSTATS-END"))
        .map(|(stats, _)| stats)
        .unwrap_or_default();
    let joined: serde_json::Value = serde_json::from_str(pid_stats).unwrap_or_else(|e| {
        panic!("{round}: the --stats-json is not JSON ({e}):\n{pid_stats}\n{pid_log}")
    });
    assert_eq!(
        joined["joined"]["how"], "injected",
        "{round}: --pid did not join the waiter in-process:\n{pid_stats}\n{pid_log}"
    );
    // --pid: work() made 1000 allocations of 48 bytes and freed every other one.
    let pid = samples(last(profiles, round, "pid"));
    assert_eq!(
        totals(&pid, |s| s.stack.get(1).is_some_and(|f| f == "work")),
        [1000, 48_000, 500, 24_000],
        "{round}: --pid"
    );

    // Kernel mode: the pipes' kernel stacks, named.
    let kernel = last(profiles, round, "kernel");
    let kernel_samples = samples(kernel);
    let pipe_allocations: i64 = kernel
        .sample
        .iter()
        .zip(&kernel_samples)
        .filter(|(_, s)| s.stack.iter().any(|f| f.contains("pipe")))
        .map(|(raw, _)| raw.value[0])
        .sum();
    assert!(
        pipe_allocations >= 6 * 50,
        "{round}: kernel allocations in pipe stacks: {pipe_allocations}"
    );
    assert!(
        kernel_samples
            .iter()
            .flat_map(|s| &s.stack)
            .all(|f| !f.starts_with("0x") && !f.starts_with("__traceiter_")),
        "{round}: kernel frames are named and start below the tracepoint"
    );

    check_deferred_frees(last(profiles, round, "release"), round);
    check_module(last(profiles, round, "brd"), round);

    // Static programs with their own allocator: the totals and main/a/b stacks of their
    // own counts (see tests/allocators.rs). Both are checked before either fails.
    let section =
        |marker: &str, name: &str| section(console, &format!("=={marker} {round} {name}"));
    let static_glibc = std::panic::catch_unwind(|| {
        counted::check_c_program(
            &format!("{round}: static glibc (aarch64-linux-gnu-gcc -static)"),
            &section("LOG", "abc-static"),
            &section("OUTPUT", "abc-static"),
            &samples(last(profiles, round, "abc-static")),
        )
    });
    let static_musl = std::panic::catch_unwind(|| {
        counted::check_rust_program(
            &format!("{round}: static musl (Rust, aarch64-unknown-linux-musl)"),
            &section("LOG", "rust-musl"),
            &section("OUTPUT", "rust-musl"),
            &samples(last(profiles, round, "rust-musl")),
        )
    });
    for result in [static_glibc, static_musl] {
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }
}

/// After release_all freed everything it made: with deferred frees seen (fentry on
/// this kernel), do_epoll_ctl holds at most 5% of what it allocated; without, the
/// profile says what it undercounts.
fn check_deferred_frees(profile: &heapprof_daemon::pprof::proto::Profile, round: &str) {
    let notes = comments(profile);
    let epoll: Vec<&heapprof_daemon::pprof::proto::Sample> = profile
        .sample
        .iter()
        .zip(samples(profile))
        .filter(|(_, s)| s.stack.iter().any(|f| f == "do_epoll_ctl"))
        .map(|(raw, _)| raw)
        .collect();
    let sum = |index: usize| epoll.iter().map(|s| s.value[index]).sum::<i64>();
    assert!(sum(0) >= 500, "{round}: epoll allocations {}", sum(0));
    // Seen when the kvfree_call_rcu program is attached (the profile's keyed comment).
    let seen = matches!(
        keyed_comments::value(&notes, &watch_key(DeferredFreePath::Rcu))
            .and_then(DeferredFreeWatch::from_name),
        Some(DeferredFreeWatch::Fentry | DeferredFreeWatch::Kprobe)
    );
    if seen {
        assert!(
            sum(3) * 20 <= sum(1),
            "{round}: do_epoll_ctl holds {} of {} bytes after everything was freed",
            sum(3),
            sum(1)
        );
    } else {
        assert!(
            losses::frees_undercounted(&notes),
            "{round}: neither deferred frees nor an undercount: {notes:?}"
        );
    }
    eprintln!(
        "arm64 VM {round}: deferred frees {}; do_epoll_ctl holds {} of {} bytes{}",
        if seen { "seen" } else { "not seen" },
        sum(3),
        sum(1),
        losses::losses(&notes)
            .iter()
            .map(|loss| format!("; {}", loss.line()))
            .collect::<String>()
    );
}

/// Writes to the RAM disk: page samples whose stacks pass through the brd module,
/// named as its frames (`brd_*`) and labelled `module=[brd]`.
fn check_module(profile: &heapprof_daemon::pprof::proto::Profile, round: &str) {
    let through_brd: Vec<Sample> = samples(profile)
        .into_iter()
        .filter(|s| s.labels.get("module").is_some_and(|m| m == "[brd]"))
        .collect();
    assert!(
        !through_brd.is_empty(),
        "{round}: no sample labelled module=[brd]"
    );
    for sample in &through_brd {
        assert!(
            sample.stack.iter().any(|f| f.starts_with("brd_")),
            "{round}: a [brd] sample without a brd frame: {:?}",
            sample.stack
        );
    }
    assert!(
        through_brd
            .iter()
            .any(|s| s.stack.first().is_some_and(|f| f == "alloc_pages")),
        "{round}: brd allocated no pages: {through_brd:?}"
    );
}

/// The console's lines after the line `start`, up to the next line starting with `==`.
fn section(console: &str, start: &str) -> String {
    let mut lines = console.lines().map(|l| l.trim_end_matches('\r'));
    if !lines.any(|l| l == start) {
        panic!("no {start:?} in the VM's console:\n{console}");
    }
    let mut text = String::new();
    for line in lines.take_while(|l| !l.starts_with("==")) {
        text.push_str(line);
        text.push('\n');
    }
    text
}

#[test]
fn arm64_vm_with_and_without_btf() {
    let heapprofd = env_path("HEAPPROFD_AARCH64_BINARY", NEEDS);
    let glibc = env_path("HEAPPROFD_AARCH64_GLIBC_BINARY", NEEDS);
    let assets = env_path("HEAPPROFD_ARM64_VM_ASSETS", NEEDS);
    let dir = scratch();
    // The expected chains come from DHAT on the host, while the VM runs.
    let (expected, console) = std::thread::scope(|scope| {
        let host = scope.spawn(|| host_dhat_stacks(dir.path()));
        let image = initramfs(dir.path(), &heapprofd, &glibc, &assets);
        let console = boot(&assets.join("vmlinuz"), &image);
        (host.join().expect("the host's DHAT runs failed"), console)
    });
    let statuses: Vec<&str> = console
        .lines()
        .filter(|l| l.starts_with("==STATUS"))
        .collect();
    // The kill-in-call rounds: one status per new process, then the loaded one's.
    let kill_rounds = statuses
        .iter()
        .filter(|l| l.starts_with("==STATUS new-") || l.starts_with("==STATUS loaded "))
        .count();
    assert!(
        console.contains("==INSMOD brd 0"),
        "the RAM disk module did not load:\n{console}"
    );
    assert_eq!(
        statuses.len() - kill_rounds,
        24,
        "scenario statuses: {statuses:?}\n{console}"
    );
    for status in &statuses {
        assert!(
            status.trim_end().ends_with(" 0"),
            "a scenario failed in the VM: {status}; console:\n{console}"
        );
    }
    // heapprofd killed in each of its calls into a new process (from the second: the
    // first maps the stub's pages), and into one with the library (from the first),
    // every waiter alive and ending with status 0 above.
    let killed = |phase: &str| -> u32 {
        console
            .lines()
            .find_map(|l| l.strip_prefix(&format!("==KILLED-UP-TO {phase} ")))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no kill-in-call round ({phase}):\n{console}"))
    };
    let (new, loaded) = (killed("new"), killed("loaded"));
    assert!(
        new >= 4 && loaded >= 1,
        "heapprofd was killed in calls 2 to {new} of new processes and 1 to {loaded} \
         of one with the library: too few calls\n{console}"
    );
    assert!(
        console.contains("==BTF hidden: 0 bytes"),
        "BTF was not hidden for the second round:\n{console}"
    );
    let profiles = profiles_from(&console, dir.path(), "");
    for round in ["btf", "nobtf"] {
        check_round(&profiles, round, &expected, loader_entry(&assets), &console);
    }
    // The glibc build: launch mode on the same programs.
    check_family(&profiles, "glibc");
    check_abc(&profiles, "glibc", &["stacks-O2"]);
    eprintln!(
        "arm64 VM: {} profiles checked; heapprofd killed in calls 2 to {new} (new \
         processes) and 1 to {loaded} (the library loaded); {}",
        profiles.len(),
        console
            .lines()
            .find(|l| l.starts_with("==KERNEL"))
            .unwrap_or("")
    );
}
