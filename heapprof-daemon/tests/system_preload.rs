//! `--all --preload system`: the system-wide preload, tried as an operator uses it.
//!
//! It changes how every program on the machine starts, so each test runs heapprofd
//! and its programs in a private mount namespace (`unshare -m`) whose `/etc` and
//! `/var/lib` are overlays and whose `/run/heapprofd` is its own: the entry heapprofd
//! adds to `/etc/ld.so.preload`, the library it installs and its socket vanish with
//! the namespace, whatever happens, and the machine (or CI) never sees them.

mod common;

use std::{path::Path, process::Command};

use common::{compile, counted, last_profile, require_root, samples, scratch, serial};

/// The namespace's mounts, then `body` (bash), with `$D` the scratch directory and
/// `$HEAPPROFD` the binary. Every heapprofd the body starts is killed when it ends.
fn in_private_namespace(dir: &Path, body: &str) -> std::process::Output {
    let script = format!(
        r#"set -u
D={dir}
HEAPPROFD={heapprofd}
mkdir -p $D/ns/etc-up $D/ns/etc-work $D/ns/var-up $D/ns/var-work
mount -t overlay overlay -o lowerdir=/etc,upperdir=$D/ns/etc-up,workdir=$D/ns/etc-work /etc || exit 90
mount -t overlay overlay -o lowerdir=/var/lib,upperdir=$D/ns/var-up,workdir=$D/ns/var-work /var/lib || exit 91
mkdir -p /run/heapprofd && mount -t tmpfs tmpfs /run/heapprofd || exit 92
trap 'pkill -KILL -f "^$HEAPPROFD " 2>/dev/null' EXIT
# Starts heapprofd with the arguments given, waits until it is ready; its pid in $H.
start() {{
    rm -f $D/ready
    $HEAPPROFD --ready-file $D/ready "$@" >>$D/heapprofd.log 2>&1 &
    H=$!
    for i in $(seq 600); do [ -f $D/ready ] && return 0; kill -0 $H 2>/dev/null || break; sleep 0.1; done
    echo "heapprofd did not get ready" >&2; exit 93
}}
lists() {{ grep -c libheapprofd-system /etc/ld.so.preload 2>/dev/null || echo 0; }}
{body}
"#,
        dir = dir.display(),
        heapprofd = env!("CARGO_BIN_EXE_heapprofd"),
    );
    let path = dir.join("script.sh");
    std::fs::write(&path, script).expect("writing the script");
    Command::new("timeout")
        .args(["300", "unshare", "-m", "--propagation", "private", "bash"])
        .arg(&path)
        .output()
        .expect("running unshare (util-linux)")
}

/// The script's `key=value` lines.
fn value<'a>(stdout: &'a str, key: &str) -> &'a str {
    stdout
        .lines()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key}= line in:\n{stdout}"))
}

fn explain(output: &std::process::Output, dir: &Path) -> String {
    format!(
        "script status {:?}\nstdout:\n{}\nstderr:\n{}\nheapprofd's log:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
        std::fs::read_to_string(dir.join("heapprofd.log")).unwrap_or_default()
    )
}

/// A `--stats-json` file, parsed.
fn read_stats(path: &Path) -> serde_json::Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).expect("--stats-json is JSON")
}

/// The `system_preload` figures of a `--stats-json` file.
fn system_figures(path: &Path) -> serde_json::Value {
    read_stats(path)["system_preload"].clone()
}

/// A script (for [`in_private_namespace`]) in which `program` (alloc_abc's `wait`)
/// waits in read() while heapprofd starts: `setup` runs first, `waiting` once the
/// program is ready, `started` once heapprofd is. The program then allocates, and
/// heapprofd stops while its blocks are still live (so the final profile shows them);
/// the script says `heapprofd_status=` and `program_status=`.
fn program_waiting_through_the_start(
    program: &Path,
    setup: &str,
    waiting: &str,
    started: &str,
) -> String {
    format!(
        r#"{setup}
mkfifo $D/in
{program} wait < $D/in > $D/program.out &
P=$!
exec 3>$D/in
for i in $(seq 100); do grep -q ready $D/program.out && break; sleep 0.1; done
{waiting}
start --all --preload system -o $D/out --interval 60s --stats-json $D/stats.json
{started}
echo go >&3
for i in $(seq 100); do grep -q done $D/program.out && break; sleep 0.1; done
kill -TERM $H; wait $H; echo heapprofd_status=$?
exec 3>&-
wait $P; echo program_status=$?
"#,
        program = program.display()
    )
}

/// After [`program_waiting_through_the_start`]: both exited cleanly, and the final
/// profile counts exactly what the program says it allocated.
fn check_waiting_program_counted(what: &str, dir: &Path, stdout: &str, context: &str) {
    assert_eq!(value(stdout, "heapprofd_status"), "0", "{context}");
    assert_eq!(value(stdout, "program_status"), "0", "{context}");
    check_counted(what, dir, "program.out", "out");
}

/// The last profile in `$D/{profiles}` counts exactly what the program printed to
/// `$D/{printed}` (heapprofd's log, `$D/heapprofd.log`, explains a difference).
fn check_counted(what: &str, dir: &Path, printed: &str, profiles: &str) {
    let printed = std::fs::read_to_string(dir.join(printed)).expect("program output");
    let log = std::fs::read_to_string(dir.join("heapprofd.log")).unwrap_or_default();
    counted::check_c_program(
        what,
        &log,
        &printed,
        &samples(&last_profile(&dir.join(profiles))),
    );
}

#[test]
fn programs_started_under_the_system_preload_join_from_their_start_and_count_exactly() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let program = compile(dir.path(), "alloc_abc", "alloc_abc", &["-O1"]);
    let output = in_private_namespace(
        dir.path(),
        &format!(
            r#"start --all --preload system -o $D/out --interval 60s --stats-json $D/stats.json
echo during=$(lists)
[ -S /run/heapprofd/system.sock ] && echo socket=yes || echo socket=no
{program} > $D/program.out; echo program_status=$?
kill -TERM $H; wait $H; echo heapprofd_status=$?
echo after=$(lists)
[ -e /run/heapprofd/system.sock ] && echo socket_after=yes || echo socket_after=no
[ -f /var/lib/heapprofd-preload/libheapprofd-system.so ] && echo library_after=yes || echo library_after=no
"#,
            program = program.display()
        ),
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let context = explain(&output, dir.path());
    assert!(output.status.success(), "{context}");
    assert_eq!(
        value(&stdout, "during"),
        "1",
        "the entry is in the list while heapprofd runs\n{context}"
    );
    assert_eq!(value(&stdout, "socket"), "yes", "{context}");
    assert_eq!(value(&stdout, "program_status"), "0", "{context}");
    assert_eq!(
        value(&stdout, "heapprofd_status"),
        "0",
        "a SIGTERM (systemctl stop) ends it cleanly\n{context}"
    );
    assert_eq!(
        value(&stdout, "after"),
        "0",
        "the entry is removed at exit\n{context}"
    );
    assert_eq!(value(&stdout, "socket_after"), "no", "{context}");
    assert_eq!(
        value(&stdout, "library_after"),
        "yes",
        "the library stays, so that an entry left by a killed heapprofd names a file\n{context}"
    );
    let figures = system_figures(&dir.path().join("stats.json"));
    assert!(
        figures["joined"].as_u64().is_some_and(|joined| joined >= 1),
        "the program joined: {figures}\n{context}"
    );
    check_counted(
        "alloc_abc under the system-wide preload",
        dir.path(),
        "program.out",
        "out",
    );
}

/// A program the system-wide preload joined at its start keeps the files it puts at
/// low descriptor numbers (`configure`'s `exec 5>>config.log 6>&1`): the join's own
/// descriptors sit above them, so the library neither takes the program's file for
/// heapprofd's pidfd nor closes it, and the program's allocations after that are
/// counted.
#[test]
fn a_joined_programs_own_low_descriptors_stay_its_own() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let program = compile(dir.path(), "joined", "joined", &["-O2", "-ldl"]);
    let output = in_private_namespace(
        dir.path(),
        &format!(
            r#"start --all --preload system -o $D/out --interval 60s --stats-json $D/stats.json
echo "descriptors 2000" | {program} > $D/program.out; echo program_status=$?
echo program_said=$(tail -n 1 $D/program.out)
kill -TERM $H; wait $H; echo heapprofd_status=$?
"#,
            program = program.display()
        ),
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let context = explain(&output, dir.path());
    assert!(output.status.success(), "{context}");
    assert_eq!(value(&stdout, "program_status"), "0", "{context}");
    assert_eq!(
        value(&stdout, "program_said"),
        "done",
        "the program's descriptors 3-9 stayed its file (\"lost D\" names one that did not)\n{context}"
    );
    assert_eq!(value(&stdout, "heapprofd_status"), "0", "{context}");
    let figures = system_figures(&dir.path().join("stats.json"));
    assert!(
        figures["joined"].as_u64().is_some_and(|joined| joined >= 1),
        "the program joined: {figures}\n{context}"
    );
    let samples = samples(&last_profile(&dir.path().join("out")));
    let [objects, ..] = common::totals(&samples, |s| {
        s.stack.iter().any(|frame| frame == "low_descriptors")
    });
    assert_eq!(
        objects, 2000,
        "the allocations made after the program's dup2s\n{context}"
    );
}

/// Another heapprofd on the same host counts its own programs exactly while the
/// system-wide preload is active: launch mode starts its command with the opt-out, so
/// the system-wide heapprofd leaves it alone, whether it runs on the launching
/// heapprofd's library or on its allocator's probes.
#[test]
fn another_heapprofd_counts_its_programs_exactly_beside_the_system_preload() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let program = compile(dir.path(), "alloc_abc", "alloc_abc", &["-O1"]);
    let output = in_private_namespace(
        dir.path(),
        &format!(
            r#"start --all --preload system -o $D/out --interval 60s --stats-json $D/stats.json --profiles-json $D/system.jsonl
# Each program waits until the system-wide heapprofd has read its image (and so
# seen its opt-out) before it works and exits: a short program could otherwise be
# gone before a loaded machine's daemon reads it, and say nothing of the opt-out.
launch() {{
    name=$1; shift
    rm -f $D/in; mkfifo $D/in
    $HEAPPROFD -o $D/$name "$@" -- {program} wait < $D/in > $D/$name.out 2>>$D/heapprofd.log &
    L=$!
    exec 3>$D/in
    for i in $(seq 600); do grep -q ready $D/$name.out && break; sleep 0.1; done
    P=$(pgrep -x -P $L alloc_abc)
    for i in $(seq 600); do grep -q "\"kind\":\"image_read\",\"pid\":$P," $D/system.jsonl && break; sleep 0.1; done
    echo ${{name}}_read=$(grep -c "\"pid\":$P," $D/system.jsonl)
    echo go >&3; exec 3>&-
    wait $L; echo ${{name}}_status=$?
}}
launch launched
launch probed --preload off
kill -TERM $H; wait $H; echo heapprofd_status=$?
"#,
            program = program.display()
        ),
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let context = explain(&output, dir.path());
    assert!(output.status.success(), "{context}");
    for key in ["launched_status", "probed_status", "heapprofd_status"] {
        assert_eq!(value(&stdout, key), "0", "{key}\n{context}");
    }
    for key in ["launched_read", "probed_read"] {
        assert_ne!(
            value(&stdout, key),
            "0",
            "the system-wide heapprofd read the program's image ({key})\n{context}"
        );
    }
    for (how, name) in [
        ("launched with its library", "launched"),
        ("on its probes", "probed"),
    ] {
        check_counted(
            &format!("alloc_abc {how}, beside the system-wide preload"),
            dir.path(),
            &format!("{name}.out"),
            name,
        );
    }
    let figures = system_figures(&dir.path().join("stats.json"));
    assert!(
        figures["opted_out"]
            .as_u64()
            .is_some_and(|opted_out| opted_out >= 2),
        "the programs another heapprofd launched were not left to it: {figures}\n{context}"
    );
}

/// `--pid` on a program the system-wide heapprofd joined: a second library is not
/// injected beside its copy (whose wrappers hold the allocator's GOT slots); the
/// program's allocator's probes count it, exactly, and it keeps working.
#[test]
fn pid_mode_on_a_program_the_system_preload_joined_counts_it_on_the_probes() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let program = compile(dir.path(), "alloc_abc", "alloc_abc", &["-O1"]);
    let output = in_private_namespace(
        dir.path(),
        &format!(
            r#"start --all --preload system -o $D/out --interval 60s --stats-json $D/stats.json
mkfifo $D/in
{program} wait < $D/in > $D/program.out &
P=$!
exec 3>$D/in
for i in $(seq 100); do grep -q ready $D/program.out && break; sleep 0.1; done
# Without the fifo's writing end, which would keep the program from its end of input.
$HEAPPROFD --ready-file $D/pid-ready -o $D/pid-out --stats-json $D/pid-stats.json --pid $P 3>&- >>$D/heapprofd.log 2>&1 &
Q=$!
for i in $(seq 600); do [ -f $D/pid-ready ] && break; kill -0 $Q 2>/dev/null || break; sleep 0.1; done
echo second_copies=$(grep -c memfd:heapprofd-preload /proc/$P/maps)
echo go >&3
for i in $(seq 100); do grep -q done $D/program.out && break; sleep 0.1; done
exec 3>&-
wait $P; echo program_status=$?
wait $Q; echo pid_status=$?
kill -TERM $H; wait $H; echo heapprofd_status=$?
"#,
            program = program.display()
        ),
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let context = explain(&output, dir.path());
    assert!(output.status.success(), "{context}");
    for key in ["program_status", "pid_status", "heapprofd_status"] {
        assert_eq!(value(&stdout, key), "0", "{key}\n{context}");
    }
    assert_eq!(
        value(&stdout, "second_copies"),
        "0",
        "no second library was loaded into the program\n{context}"
    );
    let figures = system_figures(&dir.path().join("stats.json"));
    assert!(
        figures["joined"].as_u64().is_some_and(|joined| joined >= 1),
        "the system-wide heapprofd joined the program: {figures}\n{context}"
    );
    let stats = read_stats(&dir.path().join("pid-stats.json"));
    assert_eq!(stats["joined"]["how"], "probes", "{stats}\n{context}");
    check_counted(
        "alloc_abc under --pid, joined by the system-wide preload",
        dir.path(),
        "program.out",
        "pid-out",
    );
    // `--pid` came after the program's exec, so every allocation of its pid in the
    // profile is the program's own: none is the system copy's (its start-up, its
    // records), whose calls the same allocator probes see.
    let printed = counted::parse_printed(
        &std::fs::read_to_string(dir.path().join("program.out")).expect("program output"),
    );
    let samples = samples(&last_profile(&dir.path().join("pid-out")));
    let [objects, bytes, ..] = common::totals(&samples, |s| {
        s.labels.get("pid").is_some_and(|pid| *pid == printed.pid)
    });
    assert_eq!(
        [objects, bytes],
        [printed.total[0], printed.total[1]],
        "allocated objects and bytes of the program's pid, all stacks, against its own \
         count\n{context}"
    );
}

/// A program started with `HEAPPROFD_SYSTEM_PRELOAD=off` keeps out of the system-wide
/// preload: its copy never asks, the system-wide heapprofd neither joins nor probes it
/// (nor one running before it that opted out, which it does not load the library into:
/// its allocations, made while heapprofd runs, are not in its profile), and
/// `heapprofd --pid` joins it in-process and counts it exactly.
#[test]
fn a_program_that_opts_out_is_left_alone_and_pid_mode_joins_it_in_process() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let program = compile(dir.path(), "alloc_abc", "alloc_abc", &["-O1"]);
    let output = in_private_namespace(
        dir.path(),
        &format!(
            r#"mkfifo $D/early-in
HEAPPROFD_SYSTEM_PRELOAD=off {program} wait < $D/early-in > $D/early.out &
E=$!
echo early_pid=$E
exec 4>$D/early-in
# No heapprofd holds a fifo's writing end: it would keep a program from its end of input.
start --all --preload system -o $D/out --interval 60s --stats-json $D/stats.json 4>&-
mkfifo $D/in
HEAPPROFD_SYSTEM_PRELOAD=off {program} wait < $D/in > $D/program.out &
P=$!
exec 3>$D/in
for i in $(seq 100); do grep -q ready $D/program.out && break; sleep 0.1; done
echo early_mapped=$(grep -c libheapprofd-system /proc/$E/maps)
$HEAPPROFD --ready-file $D/pid-ready -o $D/pid-out --stats-json $D/pid-stats.json --pid $P 3>&- 4>&- >>$D/heapprofd.log 2>&1 &
Q=$!
for i in $(seq 600); do [ -f $D/pid-ready ] && break; kill -0 $Q 2>/dev/null || break; sleep 0.1; done
echo go >&3
for i in $(seq 100); do grep -q done $D/program.out && break; sleep 0.1; done
exec 3>&-
wait $P; echo program_status=$?
wait $Q; echo pid_status=$?
# The early program allocates while heapprofd runs, and is still live at its last profile.
echo go >&4
for i in $(seq 100); do grep -q done $D/early.out && break; sleep 0.1; done
kill -TERM $H; wait $H; echo heapprofd_status=$?
exec 4>&-
wait $E; echo early_status=$?
"#,
            program = program.display()
        ),
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let context = explain(&output, dir.path());
    assert!(output.status.success(), "{context}");
    for key in [
        "program_status",
        "pid_status",
        "early_status",
        "heapprofd_status",
    ] {
        assert_eq!(value(&stdout, key), "0", "{key}\n{context}");
    }
    assert_eq!(
        value(&stdout, "early_mapped"),
        "0",
        "heapprofd loaded its library into the program that opted out before it started\n{context}"
    );
    let figures = system_figures(&dir.path().join("stats.json"));
    assert_eq!(
        figures["opted_out"], 2,
        "both programs were left alone as opted out: {figures}\n{context}"
    );
    let early = value(&stdout, "early_pid");
    let counted: Vec<_> = samples(&last_profile(&dir.path().join("out")))
        .into_iter()
        .filter(|s| s.labels.get("pid").is_some_and(|pid| pid == early))
        .collect();
    assert!(
        counted.is_empty(),
        "the system-wide heapprofd counted the program that opted out: {} samples\n{context}",
        counted.len()
    );
    let stats = read_stats(&dir.path().join("pid-stats.json"));
    assert_eq!(stats["joined"]["how"], "injected", "{stats}\n{context}");
    check_counted(
        "alloc_abc under --pid, opted out of the system-wide preload",
        dir.path(),
        "program.out",
        "pid-out",
    );
}

#[test]
fn a_program_running_before_heapprofd_is_joined_through_the_library_and_counts_exactly() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let program = compile(dir.path(), "alloc_abc", "alloc_abc", &["-O1"]);
    // The program waits in read() (and the script's bash in its own waits) when
    // heapprofd starts: both are asked to join through a copy loaded by ptrace.
    let output = in_private_namespace(
        dir.path(),
        &program_waiting_through_the_start(
            &program,
            "",
            "",
            "grep -c libheapprofd-system /proc/$P/maps >/dev/null && echo mapped=yes || echo mapped=no",
        ),
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let context = explain(&output, dir.path());
    assert!(output.status.success(), "{context}");
    assert_eq!(value(&stdout, "mapped"), "yes", "{context}");
    let figures = system_figures(&dir.path().join("stats.json"));
    assert!(
        figures["running_asked"]
            .as_u64()
            .is_some_and(|asked| asked >= 2)
            && figures["joined"].as_u64().is_some_and(|joined| joined >= 2),
        "the program and the script's shell were asked and joined: {figures}\n{context}"
    );
    check_waiting_program_counted(
        "alloc_abc running before heapprofd",
        dir.path(),
        &stdout,
        &context,
    );
}

/// A program started while a killed heapprofd's entry stayed loads the library, which
/// finds no one to join; the next heapprofd asks that copy again. Here the program sees
/// `/var/lib` through an overlay upon the namespace's own (as in a container whose root
/// is one), where `/proc/PID/maps` names the library by another path: the copy must be
/// recognized all the same, or the program is neither joined nor probed.
#[test]
fn a_program_started_under_a_dead_heapprofds_entry_is_joined_by_the_next_one_through_nested_overlays()
 {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let program = compile(dir.path(), "alloc_abc", "alloc_abc", &["-O1"]);
    let output = in_private_namespace(
        dir.path(),
        &program_waiting_through_the_start(
            &program,
            "start --all --preload system -o $D/first --interval 60s
kill -KILL $H; wait $H 2>/dev/null
mkdir -p $D/ns/inner-up $D/ns/inner-work
mount -t overlay overlay -o lowerdir=/var/lib,upperdir=$D/ns/inner-up,workdir=$D/ns/inner-work /var/lib || exit 94",
            "echo maps_path=$(grep -m1 libheapprofd-system /proc/$P/maps | awk '{print $6}')",
            "",
        ),
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let context = explain(&output, dir.path());
    assert!(output.status.success(), "{context}");
    // What makes this case: the path maps shows is not the library's.
    let shown = value(&stdout, "maps_path");
    assert!(
        shown.ends_with("/libheapprofd-system.so")
            && shown != heapprof_common::preload::SYSTEM_LIBRARY,
        "the program maps the library, by another path than {} under the nested overlay: \
         {shown:?}\n{context}",
        heapprof_common::preload::SYSTEM_LIBRARY
    );
    let figures = system_figures(&dir.path().join("stats.json"));
    assert!(
        figures["running_asked"]
            .as_u64()
            .is_some_and(|asked| asked >= 1),
        "the program's copy was asked again: {figures}\n{context}"
    );
    check_waiting_program_counted(
        "alloc_abc started under a dead heapprofd's entry",
        dir.path(),
        &stdout,
        &context,
    );
}

#[test]
fn an_entry_left_by_a_killed_heapprofd_is_inert_and_the_next_heapprofd_takes_it_over() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let program = compile(dir.path(), "alloc_abc", "alloc_abc", &["-O1"]);
    let valgrind = "valgrind --run-libc-freeres=no -q --error-exitcode=99";
    let output = in_private_namespace(
        dir.path(),
        &format!(
            r#"start --all --preload system -o $D/first --interval 60s --sample-rate 512KiB
kill -KILL $H; wait $H 2>/dev/null
echo left=$(lists)
# No heapprofd: the library is loaded, finds no one to join, and changes nothing.
{program} > $D/inert.out; echo inert_status=$?
{valgrind} {program} > $D/inert_valgrind.out; echo inert_valgrind_status=$?
# Nor does it stand between the program and its allocator: the dynamic loader's own
# account of each symbol it binds.
mkdir $D/bindings
LD_DEBUG=bindings LD_DEBUG_OUTPUT=$D/bindings/of {program} > /dev/null; echo bindings_status=$?
# The next heapprofd replaces the dead one's socket and keeps the one entry.
start --all --preload system -o $D/second --interval 60s --stats-json $D/stats.json
echo retaken=$(lists)
{program} > $D/counted.out; echo counted_status=$?
# Under valgrind a program is left alone: a breakpoint would stop its translation.
{valgrind} {program} > $D/valgrind.out; echo valgrind_status=$?
kill -TERM $H; wait $H; echo heapprofd_status=$?
echo after=$(lists)
"#,
            program = program.display()
        ),
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let context = explain(&output, dir.path());
    assert!(output.status.success(), "{context}");
    assert_eq!(
        value(&stdout, "left"),
        "1",
        "SIGKILL leaves the entry\n{context}"
    );
    for (key, file) in [
        ("inert_status", "inert.out"),
        ("inert_valgrind_status", "inert_valgrind.out"),
        ("counted_status", "counted.out"),
        ("valgrind_status", "valgrind.out"),
    ] {
        assert_eq!(value(&stdout, key), "0", "{key}\n{context}");
        let printed = std::fs::read_to_string(dir.path().join(file)).expect("program output");
        let inert = counted::parse_printed(&printed);
        assert!(
            inert.total[0] > 0,
            "{file} counted its allocations:\n{printed}"
        );
    }
    assert_eq!(value(&stdout, "bindings_status"), "0", "{context}");
    check_allocator_bound_past_the_library(&dir.path().join("bindings"));
    assert_eq!(
        value(&stdout, "retaken"),
        "1",
        "one entry, not two\n{context}"
    );
    assert_eq!(value(&stdout, "heapprofd_status"), "0", "{context}");
    assert_eq!(
        value(&stdout, "after"),
        "0",
        "the entry is removed at exit\n{context}"
    );
    let figures = system_figures(&dir.path().join("stats.json"));
    assert!(
        figures["joined"].as_u64().is_some_and(|joined| joined >= 1),
        "the program joined the second heapprofd: {figures}\n{context}"
    );
    // The script's shell ran before both: the first heapprofd loaded the library into
    // it, and the second asks that copy again (its heapprofd is dead).
    assert!(
        figures["running_asked"]
            .as_u64()
            .is_some_and(|asked| asked >= 1),
        "the shell's copy, joined to the killed heapprofd, was asked again: {figures}\n{context}"
    );
}

/// The C allocation functions a program calls.
const ALLOCATOR_SYMBOLS: [&str; 5] = ["malloc", "free", "calloc", "realloc", "posix_memalign"];

/// From the dynamic loader's `LD_DEBUG=bindings` output in `dir` (one file per
/// process): the system-wide library was loaded (it bound symbols of its own), and
/// every allocation function the program called was bound to an object that is not
/// heapprofd's. An inert copy costs a program nothing per call: no call passes
/// through it.
fn check_allocator_bound_past_the_library(dir: &Path) {
    let mut text = String::new();
    for entry in std::fs::read_dir(dir).expect("the bindings directory") {
        let path = entry.expect("a directory entry").path();
        text += &std::fs::read_to_string(&path).expect("a bindings file");
    }
    // "binding file A [0] to B [0]: normal symbol `malloc' [GLIBC_2.2.5]"
    let bindings: Vec<(&str, &str, &str)> = text
        .lines()
        .filter_map(|line| {
            let rest = line.split_once("binding file ")?.1;
            let (from, rest) = rest.split_once(" [")?;
            let to = rest.split_once("] to ")?.1.split_once(" [")?.0;
            let symbol = rest.split_once('`')?.1.split_once('\'')?.0;
            Some((from, to, symbol))
        })
        .collect();
    assert!(
        bindings
            .iter()
            .any(|(from, _, _)| from.contains("heapprofd")),
        "the system-wide library was not loaded into the program:\n{text}"
    );
    let allocator: Vec<_> = bindings
        .iter()
        .filter(|(from, _, symbol)| {
            !from.contains("heapprofd") && ALLOCATOR_SYMBOLS.contains(symbol)
        })
        .collect();
    for symbol in ["malloc", "free"] {
        assert!(
            allocator.iter().any(|(_, _, bound)| *bound == symbol),
            "the program's `{symbol}` was never bound:\n{text}"
        );
    }
    for (from, to, symbol) in allocator {
        assert!(
            !to.contains("heapprofd"),
            "{from}'s `{symbol}` was bound to {to}, not past the inert library"
        );
    }
}

#[test]
fn the_system_preload_is_refused_outside_all_mode_with_one_line() {
    require_root();
    let dir = scratch();
    for args in [
        &["--pid", "1", "--preload", "system"][..],
        &["--kernel", "--preload", "system"][..],
        &["--preload", "system", "--", "true"][..],
    ] {
        let output = common::heapprofd(&dir.path().join("out"))
            .args(args)
            .output()
            .expect("running heapprofd");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr}");
        assert!(
            stderr.contains("--preload system"),
            "{args:?} names the flag: {stderr}"
        );
    }
}

/// heapprofd killed and stopped in turns while a busy process, running before each of
/// them, is joined through the system library each time, and forks shells that join
/// it too: the process keeps working (no block corrupted, every fork's shell exits as
/// told), and after each clean stop it holds the descriptors it held before the first
/// heapprofd (a killed one's are given back when the next one asks it again).
#[test]
fn a_busy_process_outlives_heapprofd_killed_and_stopped_in_turns() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let target = compile(
        dir.path(),
        "stress_target",
        "stress_target",
        &["-O2", "-ldl"],
    );
    let output = in_private_namespace(
        dir.path(),
        &format!(
            r#"mkfifo $D/cmd
{target} 2 < $D/cmd > $D/target.out 2>&1 &
P=$!
trap 'kill -KILL $P 2>/dev/null; pkill -KILL -f "^$HEAPPROFD " 2>/dev/null' EXIT
exec 3>$D/cmd
for i in $(seq 100); do grep -q ready $D/target.out && break; sleep 0.1; done
# A command, then its one-line answer.
ask() {{
    n=$(grep -c '' $D/target.out)
    echo "$1" >&3
    for i in $(seq 400); do [ $(grep -c '' $D/target.out) -gt $n ] && break; sleep 0.05; done
    tail -n 1 $D/target.out
}}
echo fds_before=$(ls /proc/$P/fd | wc -l)
echo forks=$(ask "forks on")
for round in 1 2 3 4; do
    start --all --preload system -o $D/out$round --interval 60s --stats-json $D/stats$round.json
    echo mapped_$round=$(grep -c libheapprofd-system /proc/$P/maps)
    sleep 1
    if [ $((round % 2)) = 1 ]; then
        kill -KILL $H; wait $H 2>/dev/null; echo stop_$round=killed
    else
        kill -TERM $H; wait $H; echo stop_$round=$?
    fi
    echo check_$round=$(ask check | tr ' ' ,)
    echo fds_$round=$(ls /proc/$P/fd | wc -l)
done
echo forks_off=$(ask "forks off" | tr ' ' ,)
echo final=$(ask check | tr ' ' ,)
kill -0 $P 2>/dev/null && echo alive=yes || echo alive=no
kill $P; exec 3>&-
"#,
            target = target.display()
        ),
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let context = explain(&output, dir.path());
    assert!(output.status.success(), "{context}");
    assert_eq!(value(&stdout, "forks"), "forking", "{context}");
    assert_eq!(value(&stdout, "alive"), "yes", "{context}");
    let fds_before = value(&stdout, "fds_before");
    let mut last_rounds = 0;
    let mut last_forks = 0;
    for round in 1..=4 {
        assert_ne!(
            value(&stdout, &format!("mapped_{round}")),
            "0",
            "round {round}: the process was asked through the system library\n{context}"
        );
        // "ok ROUNDS ERRORS FORKS FORK_ERRORS BAD"
        let check = value(&stdout, &format!("check_{round}"));
        let numbers: Vec<i64> = check
            .strip_prefix("ok,")
            .unwrap_or_else(|| panic!("round {round}: check answered {check:?}\n{context}"))
            .split(',')
            .map(|n| n.parse().expect("a number"))
            .collect();
        assert_eq!(
            (numbers[1], numbers[3]),
            (0, 0),
            "round {round}: blocks corrupted, forks gone wrong ({check})\n{context}"
        );
        // Forks completed in every round: a child stuck before its exec (it once waited
        // forever for the loader's lock, inherited held) stops its parent's fork loop.
        assert!(
            numbers[0] > last_rounds && numbers[2] > last_forks,
            "round {round}: the process kept allocating and forking ({check})\n{context}"
        );
        last_rounds = numbers[0];
        last_forks = numbers[2];
        if round % 2 == 0 {
            assert_eq!(
                value(&stdout, &format!("stop_{round}")),
                "0",
                "round {round}: a SIGTERM ends heapprofd cleanly\n{context}"
            );
            assert_eq!(
                value(&stdout, &format!("fds_{round}")),
                fds_before,
                "round {round}: after a clean stop the process holds the descriptors it \
                 held before heapprofd (a killed one's included)\n{context}"
            );
            let figures = system_figures(&dir.path().join(format!("stats{round}.json")));
            assert!(
                figures["running_asked"].as_u64().is_some_and(|n| n >= 1)
                    && figures["joined"].as_u64().is_some_and(|n| n >= 1),
                "round {round}: the process was asked and joined: {figures}\n{context}"
            );
        }
    }
    assert!(
        value(&stdout, "final").starts_with("ok,"),
        "after the last round\n{context}"
    );
}
