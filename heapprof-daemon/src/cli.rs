//! Command-line interface: flags, their validation and the traced target.

use std::{net::SocketAddr, num::NonZeroUsize, path::PathBuf, time::Duration};

use clap::Parser;

use crate::{
    cgroup::{CgroupError, CgroupFilter},
    inject::InjectMode,
    placement::PlacementMode,
    pprof::retention::RetentionPolicy,
    preload::PreloadMode,
    probes::AttachChoice,
};

/// `--help`'s sections (clap lists them in the order of their first flags).
const TARGET: &str = "What to trace";
const PROFILES: &str = "Profiles";
const PUSH: &str = "Pushing profiles";
const SAMPLING: &str = "Sampling";
const PROBES: &str = "Probes and joining processes";
const CAPACITIES: &str = "Table capacities";
const MONITORING: &str = "Monitoring";

/// eBPF heap profiler: live and cumulative heap usage per call stack, written as Go-pprof heap profiles.
#[derive(Debug, Parser)]
#[command(
    name = "heapprofd",
    version,
    after_help = "Exactly one target: --pid N, --all, or -- COMMAND [ARGS...] (with --kernel, none\n\
                  means every process).\n\
                  Open a profile with: go tool pprof -http=: FILE, or read it with heapprofd report FILE\n\
                  (heapprofd report --help: flamegraphs, diffs, leak suspects, an HTML page)"
)]
pub struct Cli {
    /// Attach to the running process PID (all of its threads).
    #[arg(help_heading = TARGET, short, long, value_name = "PID", conflicts_with = "all")]
    pub pid: Option<u32>,

    /// Trace every process on the machine that uses the C library (samples carry pid/comm labels).
    #[arg(help_heading = TARGET, long)]
    pub all: bool,

    /// Profile the kernel heap (kmalloc, kmem_cache_alloc) from the kmem tracepoints instead
    /// of user space: system-wide, or only allocations made in the context of --pid PID or
    /// of a launched command and its children.
    #[arg(help_heading = TARGET, long)]
    pub kernel: bool,

    /// With --kernel: also count whole pages from the page allocator (mm_page_alloc/free).
    #[arg(help_heading = TARGET, long, requires = "kernel")]
    pub pages: bool,

    /// With --all or --kernel: trace only the processes of this cgroup v2 subtree (one
    /// container, one systemd service), as /proc/PID/cgroup names it
    /// (/system.slice/foo.service) or as a directory of the hierarchy.
    #[arg(help_heading = TARGET, long, value_name = "PATH")]
    pub cgroup: Option<PathBuf>,

    /// Directory for the profiles (created with mode 0700 if missing). Default:
    /// heapprofd-profiles; with --push and no -o, profiles are only pushed.
    #[arg(help_heading = PROFILES, short, long, value_name = "DIR")]
    pub output: Option<PathBuf>,

    /// Push every profile to a continuous-profiling backend (repeatable). The URL picks
    /// the protocol: http(s)://HOST/ingest is Pyroscope's /ingest (pprof);
    /// http(s)://HOST/v1development/profiles is OTLP profiles over HTTP/protobuf;
    /// grpc://HOST:PORT or grpcs://HOST:PORT is OTLP profiles over gRPC. With --all,
    /// each process is its own series.
    #[arg(help_heading = PUSH, long, value_name = "URL")]
    pub push: Vec<String>,

    /// With --push: a header sent with every push, as 'NAME: VALUE' (repeatable), e.g.
    /// 'X-Scope-OrgID: tenant1' or 'Authorization: Basic ...'.
    #[arg(help_heading = PUSH, long, value_name = "HEADER", requires = "push")]
    pub push_header: Vec<String>,

    /// With --push: a file holding a bearer token, sent as 'Authorization: Bearer
    /// TOKEN' (read at start and again before each push, so a rotated token is used).
    #[arg(help_heading = PUSH, long, value_name = "FILE", requires = "push")]
    pub push_token_file: Option<PathBuf>,

    /// With --push: the longest one push may take (connecting included) before it is
    /// retried, e.g. 10s.
    #[arg(help_heading = PUSH, long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration, requires = "push")]
    pub push_timeout: Duration,

    /// With --push: a PEM file of CA certificates trusted for https:// and grpcs://
    /// besides the system's roots (a backend whose certificate a private CA signed).
    #[arg(help_heading = PUSH, long, value_name = "PEM", requires = "push")]
    pub push_ca_file: Option<PathBuf>,

    /// With --push to OTLP: whether each request also carries the gzip'd pprof in its
    /// first profile's original_payload (format "pprof"), for receivers that keep or
    /// convert the original; off sends the translated profile only.
    #[arg(help_heading = PUSH, long, value_name = "on|off", default_value = "on", action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new(), requires = "push")]
    pub push_otlp_original_payload: bool,

    /// With --push: keep the profiles not yet pushed in DIR (one subdirectory per URL)
    /// while a backend is down, and across restarts of heapprofd; without it they wait
    /// in memory (at most 8 MiB per URL) and are lost at exit.
    #[arg(help_heading = PUSH, long, value_name = "DIR", requires = "push")]
    pub push_spool: Option<PathBuf>,

    /// With --push-spool: the most the spool of one URL may hold, e.g. 256MiB; when
    /// full, the oldest profiles are dropped (and counted).
    #[arg(help_heading = PUSH, long, value_name = "BYTES", default_value = "256MiB", value_parser = parse_byte_size, requires = "push_spool")]
    pub push_spool_size: u64,

    /// With --push: the service name of every series (default: the process's systemd
    /// service, else its command name).
    #[arg(help_heading = PUSH, long, value_name = "NAME", requires = "push")]
    pub push_service_name: Option<String>,

    /// Time between profiles, e.g. 10s, 500ms, 2m (100ms to 24h).
    #[arg(help_heading = PROFILES, long, value_name = "DURATION", default_value = "10s", value_parser = parse_interval)]
    pub interval: Duration,

    /// Stop after this long, writing a final profile (default: until the target exits or SIGINT/SIGTERM).
    #[arg(help_heading = PROFILES, long, value_name = "DURATION", value_parser = parse_duration)]
    pub duration: Option<Duration>,

    /// Keep only the N newest profiles in the output directory (those of earlier runs
    /// included): older ones are deleted after each profile is written.
    #[arg(help_heading = PROFILES, long, value_name = "N", value_parser = parse_keep)]
    pub keep: Option<NonZeroUsize>,

    /// Delete profiles older than this from the output directory (by the time in
    /// their names) after each profile is written, e.g. 7d, 12h. The newest stays.
    #[arg(help_heading = PROFILES, long, value_name = "DURATION", value_parser = parse_duration)]
    pub keep_for: Option<Duration>,

    /// With --all: forget processes that exited more than DURATION ago (their sites,
    /// mappings and figures leave later profiles and the daemon's memory), e.g. 1h.
    /// Default: kept to the end of the run.
    #[arg(help_heading = PROFILES, long, value_name = "DURATION", value_parser = parse_duration)]
    pub retain_exited: Option<Duration>,

    /// An allocator library to probe besides those found in the targets' mappings
    /// (heapprofd finds the object each process's malloc binds to by itself).
    #[arg(help_heading = PROBES, long, value_name = "PATH", conflicts_with = "kernel")]
    pub libc: Option<PathBuf>,

    /// Custom allocator functions to probe in any object that defines them, as
    /// ROLE=FUNCTION(FIELDS) items: e.g. 'alloc=pool_alloc(size=arg2,ret)
    /// free=pool_free(ptr=arg2)'. Roles: alloc, free, realloc. Fields: size=argN or
    /// size=BYTES, count=argN, ptr=argN, ret, out=argN. Repeatable; @FILE reads items
    /// from a file.
    #[arg(help_heading = PROBES, long, value_name = "SPEC", value_parser = parse_allocator, conflicts_with = "kernel")]
    pub allocator: Vec<AllocatorSpec>,

    /// Capacity of the live-block table (blocks allocated while tracing and not yet
    /// freed; about 36 bytes of kernel memory each, allocated at start). Default: from
    /// the machine's memory, the largest power of two whose table takes at most 1/128
    /// of it, from 1M to 8M blocks (4M on 24 GiB); the start-up log states the choice.
    #[arg(help_heading = CAPACITIES, long, value_name = "N", value_parser = parse_capacity)]
    pub max_live_blocks: Option<u32>,

    /// Capacity of the per-site counter table (distinct process x stack x function).
    #[arg(help_heading = CAPACITIES, long, value_name = "N", default_value_t = 65536, value_parser = parse_capacity)]
    pub max_sites: u32,

    /// Capacity of the stack-trace map (distinct user stacks).
    #[arg(help_heading = CAPACITIES, long, value_name = "N", default_value_t = 32768, value_parser = parse_capacity)]
    pub max_stacks: u32,

    /// Threads with an allocator call record at once (each thread that allocates keeps
    /// one while it lives): N slots by thread id (rounded up to a power of two), and N
    /// more for threads whose slot is taken.
    #[arg(help_heading = CAPACITIES, long, value_name = "N", default_value_t = 16384, value_parser = parse_capacity)]
    pub max_threads: u32,

    /// Where probes sit in each function: `auto` moves them past instructions the kernel
    /// would single-step (about 10x cheaper) when provably equivalent; `entry` never moves them.
    #[arg(help_heading = PROBES, long, value_name = "MODE", value_enum, default_value_t = PlacementMode::Auto)]
    pub probe_placement: PlacementMode,

    /// How user stacks are unwound: `auto` follows each object's call-frame information
    /// (.eh_frame, .debug_frame), and frame pointers where none covers an address (JIT
    /// code); `cfi` follows CFI only; `fp` follows frame pointers only (the code must
    /// keep them).
    #[arg(help_heading = PROBES, long, value_name = "METHOD", value_enum, default_value_t = UnwindChoice::Auto)]
    pub unwind: UnwindChoice,

    /// Capacity of the unwind rows: the CFI tables of every object together (8 bytes
    /// each, allocated at start; a C++ program with libstdc++ needs ~60k, python3 ~120k).
    #[arg(help_heading = CAPACITIES, long, value_name = "N", default_value_t = 1 << 21, value_parser = parse_capacity)]
    pub max_unwind_rows: u32,

    /// Capacity of the distinct unwind rules of all objects (16 bytes each).
    #[arg(help_heading = CAPACITIES, long, value_name = "N", default_value_t = 65536, value_parser = parse_capacity)]
    pub max_unwind_rules: u32,

    /// Capacity of the objects (executables, libraries) with an unwind table.
    #[arg(help_heading = CAPACITIES, long, value_name = "N", default_value_t = 4096, value_parser = parse_capacity)]
    pub max_unwind_objects: u32,

    /// Capacity of the processes whose mappings the unwinder knows (with --all; 8 KiB
    /// each, allocated when used).
    #[arg(help_heading = CAPACITIES, long, value_name = "N", default_value_t = 4096, value_parser = parse_capacity)]
    pub max_processes: u32,

    /// How uprobes are attached: `auto` uses multi-uprobe links where the kernel has them
    /// (Linux 6.6+; with --pid, kernels whose link filter covers a whole process), and
    /// one perf event per probe otherwise; `perf-events` forces the latter.
    #[arg(help_heading = PROBES, long, value_name = "METHOD", value_enum, default_value_t = AttachChoice::Auto)]
    pub attach: AttachChoice,

    /// Record a sample of allocations instead of every one: on average one per BYTES
    /// allocated (Poisson by bytes, as Go's heap profiler; e.g. 512KiB). Values are scaled
    /// back to estimates. Default: every allocation, exact. In launch mode the preload
    /// library decides in the process, so skipped calls cost nothing; in attach mode (and
    /// with --preload off) every allocator call still traps into the kernel (the probes
    /// decide in there): sampling saves the stack walk and table updates of the calls it
    /// skips, about half of heapprofd's cost, and, on Linux 6.13+ (uprobe session links,
    /// x86-64), the return trap of the allocations it skips; the entry traps stay. With
    /// --kernel the tracepoint
    /// programs decide before taking the stack, and frees are matched for the sampled
    /// objects only.
    #[arg(help_heading = SAMPLING, long, value_name = "BYTES", value_parser = parse_sample_rate)]
    pub sample_rate: Option<u64>,

    /// Do not keep each process's exact in-use peak (recorded in every profile; it
    /// costs an atomic add per allocation and free). Sampled runs never keep it.
    #[arg(help_heading = SAMPLING, long)]
    pub no_peak: bool,

    /// Log the run time of heapprofd's BPF programs (kernel BPF statistics) with each profile.
    #[arg(help_heading = MONITORING, long)]
    pub bpf_stats: bool,

    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9464; 0.0.0.0:9464
    /// for every interface): each process's heap in use, allocated and peak, and
    /// heapprofd's own drops, tables, BPF run time, profile writes and memory, refreshed
    /// with every profile. With --all only the processes seen allocating or freeing
    /// since the last profile are exported, at most --metrics-top of them.
    #[arg(help_heading = MONITORING, long, value_name = "ADDR", value_parser = parse_listen_address)]
    pub metrics: Option<SocketAddr>,

    /// With --metrics: export at most N processes, those with the most bytes in use.
    #[arg(help_heading = MONITORING, long, value_name = "N", default_value_t = 100, requires = "metrics", value_parser = parse_metrics_top)]
    pub metrics_top: usize,

    /// Launch mode: `auto` puts heapprofd's interposer in the command's LD_PRELOAD (an
    /// allocation at a stack already walked costs no probe, others one cheap probe;
    /// sampling is decided in the process); processes it cannot serve (static, setuid,
    /// LD_PRELOAD dropped) fall back to the allocator's probes. `off` uses those probes
    /// only (an entry and a return trap per allocation). With --all, `system` adds the
    /// interposer to /etc/ld.so.preload until heapprofd exits: every dynamic program
    /// started meanwhile joins heapprofd in-process from its start (it costs what launch
    /// mode costs), and each process it does not serve gets the allocator's probes for
    /// itself alone. Left behind by a killed heapprofd, the entry is inert.
    #[arg(help_heading = PROBES, long, value_name = "MODE", value_enum, default_value_t = PreloadMode::Auto)]
    pub preload: PreloadMode,

    /// `--pid`: `auto` loads heapprofd's interposer into the running process (ptrace
    /// on one thread waiting in a system call, dlopen from a memfd) and redirects its
    /// allocator calls there, so it costs what launch mode costs; heapprofd puts the
    /// calls back when it exits. Where it cannot (a static or Go program, ptrace
    /// refused, no thread ever waiting), it says why on one line and uses the
    /// allocator's probes. A program the process execs is followed. `off` uses the
    /// probes only (an entry and a return trap per allocation). With `--all --preload
    /// system` it says the same of the processes running before heapprofd.
    #[arg(help_heading = PROBES, long, value_name = "MODE", value_enum, default_value_t = InjectMode::Auto)]
    pub inject: InjectMode,

    /// Benchmark baseline (`cargo xtask bench`): the probes are attached where they
    /// always are, but their programs do nothing, so only the uprobe traps cost.
    #[arg(long, hide = true, conflicts_with = "stacks_only")]
    pub empty_programs: bool,

    /// Benchmark baseline (`cargo xtask bench`): the probes' programs match returns
    /// to calls and find each allocation's stack, then count nothing (the profile
    /// stays empty): the least an exact profile of stacks costs beyond the traps.
    /// Launched commands get the allocator's probes, as with `--preload off`: the
    /// preload library would count the calls without them.
    #[arg(long, hide = true)]
    pub stacks_only: bool,

    /// For programs that read a run's figures (`cargo xtask bench`, tests): at exit,
    /// write them to FILE as JSON (the final profile's totals, drops by reason, how a
    /// `--pid` target was joined, the BPF maps' kernel memory, single-stepped probes,
    /// the unwind tables, and with --bpf-stats the programs' run time and the stack
    /// lookups), so that they need not read the log.
    #[arg(long, hide = true, value_name = "FILE")]
    pub stats_json: Option<PathBuf>,

    /// For programs that follow the profiles written (`cargo xtask bench`, soak,
    /// tests): create FILE at start and append one JSON line per profile as it is
    /// written (its path, `interval` or `final`, when, its sites and totals, the
    /// dump's times), so that they need not read the log's `wrote` lines.
    #[arg(long, hide = true, value_name = "FILE")]
    pub profiles_json: Option<PathBuf>,

    /// For programs that wait for heapprofd (`cargo xtask bench`, tests): create FILE
    /// once the probes are attached and armed (before a launched command starts), so
    /// that they need not watch the log for it.
    #[arg(long, hide = true, value_name = "FILE")]
    pub ready_file: Option<PathBuf>,

    /// After the final profile, print the N allocation sites holding the most memory.
    #[arg(help_heading = PROFILES, long, value_name = "N", default_value_t = 0)]
    pub top: usize,

    /// Command to launch and trace from its first allocation; heapprofd exits with its status.
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// How to unwind user stacks (`--unwind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum UnwindChoice {
    /// CFI where it covers an address, frame pointers elsewhere.
    Auto,
    /// CFI only.
    Cfi,
    /// Frame pointers only.
    Fp,
}

impl UnwindChoice {
    /// The mode the BPF programs read.
    pub fn mode(self) -> heapprof_common::unwind::UnwindMode {
        use heapprof_common::unwind::UnwindMode;
        match self {
            UnwindChoice::Auto => UnwindMode::Auto,
            UnwindChoice::Cfi => UnwindMode::Cfi,
            UnwindChoice::Fp => UnwindMode::FramePointers,
        }
    }
}

/// What to trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A running process.
    Pid(u32),
    /// A command heapprofd starts.
    Launch(Vec<String>),
    /// Every process using the C library.
    All,
}

impl Cli {
    /// The live-block table's capacity: `--max-live-blocks`, else sized from the
    /// machine's memory (see [`heapprof_common::live::default_capacity`]).
    pub fn live_blocks(&self) -> u32 {
        self.max_live_blocks.unwrap_or_else(|| {
            let mem_total = std::fs::read_to_string("/proc/meminfo")
                .ok()
                .and_then(|meminfo| {
                    meminfo
                        .lines()
                        .find_map(|line| line.strip_prefix("MemTotal:"))
                        .and_then(|rest| rest.split_whitespace().next())
                        .and_then(|kib| kib.parse::<u64>().ok())
                })
                .unwrap_or(0);
            heapprof_common::live::default_capacity(mem_total * 1024)
        })
    }

    /// The single target the flags name, or a message saying how to name one. In
    /// kernel mode no target means every process.
    pub fn target(&self) -> Result<Target, String> {
        let target = self.named_target()?;
        if self.retain_exited.is_some() && (self.kernel || target != Target::All) {
            return Err(
                "--retain-exited applies to --all only (with another target, or in kernel \
                 mode, nothing of exited processes is kept for it to forget): drop it, or \
                 trace with --all"
                    .into(),
            );
        }
        if self.cgroup.is_some() && target != Target::All {
            return Err(
                "--cgroup restricts --all or --kernel (every process) to one cgroup; \
                 --pid and a command already name their process: drop --cgroup, or trace with --all"
                    .into(),
            );
        }
        if self.preload == PreloadMode::System
            && (self.kernel || target != Target::All || self.stacks_only || self.empty_programs)
        {
            return Err(
                "--preload system applies to --all in user mode (it adds heapprofd's library \
                 to /etc/ld.so.preload for every new program): trace with --all, or drop it \
                 (launched commands get the library with --preload auto, --pid with --inject auto)"
                    .into(),
            );
        }
        Ok(target)
    }

    /// Whether `--all` installs the system-wide preload (`--preload system`).
    pub fn system_preload(&self, target: &Target) -> bool {
        matches!(target, Target::All) && !self.kernel && self.preload == PreloadMode::System
    }

    /// Whether launched commands get the preload library (launch mode, user space,
    /// `--preload auto`, not the probes-only `--stacks-only` baseline).
    pub fn uses_preload(&self, target: &Target) -> bool {
        matches!(target, Target::Launch(_))
            && !self.kernel
            && self.preload == PreloadMode::Auto
            && !self.stacks_only
    }

    /// Whether `--pid` tries to load the preload library into the process (user
    /// space, `--inject auto`, not a benchmark baseline).
    pub fn injects(&self, target: &Target) -> bool {
        matches!(target, Target::Pid(_))
            && !self.kernel
            && self.inject == InjectMode::Auto
            && !self.stacks_only
            && !self.empty_programs
    }

    /// The directory profiles are written to: `-o`; with `--push` and no `-o`, a
    /// private directory of this process (each profile is deleted once it is handed to
    /// the push); else `heapprofd-profiles`.
    pub fn output_dir(&self) -> PathBuf {
        match &self.output {
            Some(dir) => dir.clone(),
            None if self.push_only() => {
                std::env::temp_dir().join(format!("heapprofd-push-{}", std::process::id()))
            }
            None => PathBuf::from("heapprofd-profiles"),
        }
    }

    /// The cgroup subtree `--cgroup` names, resolved to what the programs compare.
    pub fn cgroup_filter(&self) -> Result<Option<CgroupFilter>, CgroupError> {
        self.cgroup
            .as_deref()
            .map(CgroupFilter::resolve)
            .transpose()
    }

    /// `--push` without `-o`: profiles are pushed and not kept on disk.
    pub fn push_only(&self) -> bool {
        self.output.is_none() && !self.push.is_empty()
    }

    /// The retention of the output directory the flags ask for.
    pub fn retention(&self) -> RetentionPolicy {
        RetentionPolicy {
            keep: self.keep,
            keep_for: self.keep_for,
        }
    }

    fn named_target(&self) -> Result<Target, String> {
        if self.kernel && self.pid.is_none() && self.command.is_empty() {
            return Ok(Target::All);
        }
        match (self.pid, self.all, self.command.is_empty()) {
            (Some(pid), false, true) => Ok(Target::Pid(pid)),
            (None, true, true) => Ok(Target::All),
            (None, false, false) => Ok(Target::Launch(self.command.clone())),
            (None, false, true) => Err(
                "no target: give --pid PID, --all, or a command after `--` (heapprofd -- ./prog args)"
                    .into(),
            ),
            _ => Err("give only one target: --pid PID, --all, or `-- COMMAND`".into()),
        }
    }
}

/// Parses `10s`, `500ms`, `2m`, `1h`, `7d` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration; write e.g. 10s, 500ms or 2m"))?;
    let seconds = match unit {
        "" | "s" => value,
        "ms" => value / 1000.0,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        "d" => value * 86400.0,
        _ => {
            return Err(format!(
                "unknown unit `{unit}` in `{text}`; use ms, s, m, h or d"
            ));
        }
    };
    if !seconds.is_finite() || seconds <= 0.0 {
        return Err(format!("duration `{text}` must be greater than zero"));
    }
    // (Found by the property tests: a huge number overflows Duration.)
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| format!("duration `{text}` is too long; write e.g. 10s, 500ms or 2m"))
}

fn parse_interval(text: &str) -> Result<Duration, String> {
    let interval = parse_duration(text)?;
    if interval < Duration::from_millis(100) || interval > Duration::from_secs(24 * 3600) {
        return Err(format!(
            "interval `{text}` is out of range; choose between 100ms and 24h"
        ));
    }
    Ok(interval)
}

/// Parses a byte count: `4096`, `64KiB`, `1MiB`, `2GiB` (also k/K/KB, M/MB, G/GB, as
/// binary units).
pub fn parse_sample_rate(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a byte count; write e.g. 512KiB or 4096"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return Err(format!("unknown unit in `{text}`; use KiB, MiB or GiB")),
    };
    let bytes = value
        .checked_mul(1 << shift)
        .filter(|b| (1..=heapprof_common::MAX_SAMPLE_RATE).contains(b))
        .ok_or_else(|| {
            format!("sample rate `{text}` is out of range; choose between 1 byte and 1TiB")
        })?;
    Ok(bytes)
}

/// Parses a size in bytes (`--push-spool-size`): as [`parse_sample_rate`], from 1 KiB
/// to 1 TiB.
fn parse_byte_size(text: &str) -> Result<u64, String> {
    parse_sample_rate(text)
        .ok()
        .filter(|&bytes| bytes >= 1024)
        .ok_or_else(|| format!("`{text}` is not a size between 1KiB and 1TiB; write e.g. 256MiB"))
}

/// Parses the `--metrics` address: `IP:PORT`, `[IPv6]:PORT` or `localhost:PORT`.
pub fn parse_listen_address(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    // Not a name lookup: `localhost` is the one name a listen address commonly uses.
    let local = text
        .strip_prefix("localhost:")
        .map(|port| format!("127.0.0.1:{port}"));
    local.as_deref().unwrap_or(text).parse().map_err(|_| {
        format!(
            "`{text}` is not an address to listen on; write IP:PORT, e.g. 127.0.0.1:9464 \
                 (this machine only) or 0.0.0.0:9464 (every interface)"
        )
    })
}

fn parse_metrics_top(text: &str) -> Result<usize, String> {
    text.trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("`{text}` is not a number of processes to export; give 1 or more"))
}

fn parse_keep(text: &str) -> Result<NonZeroUsize, String> {
    text.trim()
        .parse::<usize>()
        .ok()
        .and_then(NonZeroUsize::new)
        .ok_or_else(|| format!("`{text}` is not a number of profiles to keep; give 1 or more"))
}

/// The functions of one `--allocator` value.
#[derive(Debug, Clone)]
pub struct AllocatorSpec(pub Vec<crate::allocators::spec::CustomFunction>);

fn parse_allocator(text: &str) -> Result<AllocatorSpec, String> {
    crate::allocators::spec::parse_all(&[text.to_owned()])
        .map(AllocatorSpec)
        .map_err(|err| err.to_string())
}

fn parse_capacity(text: &str) -> Result<u32, String> {
    let value: u32 = text
        .parse()
        .map_err(|_| format!("`{text}` is not a whole number"))?;
    if !(16..=1 << 26).contains(&value) {
        return Err(format!(
            "capacity {value} is out of range; choose between 16 and 67108864"
        ));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86400)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("5y").is_err());
        assert!(parse_duration("99999999999999999999999h").is_err());
    }

    #[test]
    fn sample_rates_parse_with_binary_units() {
        assert_eq!(parse_sample_rate("4096"), Ok(4096));
        assert_eq!(parse_sample_rate("512KiB"), Ok(512 * 1024));
        assert_eq!(parse_sample_rate("1MiB"), Ok(1 << 20));
        assert_eq!(parse_sample_rate("2k"), Ok(2048));
        assert!(parse_sample_rate("0").is_err());
        assert!(parse_sample_rate("2TiB").is_err());
        assert!(parse_sample_rate("lots").is_err());
        assert!(parse_sample_rate("5 parsecs").is_err());
    }

    #[test]
    fn retention_flags_parse_and_check_their_target() {
        let cli = |args: &[&str]| Cli::try_parse_from(args).map(|c| (c.target(), c.retention()));
        let (target, policy) =
            cli(&["heapprofd", "--all", "--keep", "3", "--keep-for", "2d"]).expect("valid flags");
        assert_eq!(target, Ok(Target::All));
        assert_eq!(policy.keep.map(NonZeroUsize::get), Some(3));
        assert_eq!(policy.keep_for, Some(Duration::from_secs(2 * 86400)));
        assert!(cli(&["heapprofd", "--all", "--keep", "0"]).is_err());
        assert!(cli(&["heapprofd", "--all", "--keep", "-1"]).is_err());
        assert!(cli(&["heapprofd", "--all", "--keep-for", "0s"]).is_err());
        assert!(cli(&["heapprofd", "--all", "--retain-exited", "soon"]).is_err());
        assert!(matches!(
            cli(&["heapprofd", "--all", "--retain-exited", "10m"]),
            Ok((Ok(Target::All), _))
        ));
        for other in [
            &["heapprofd", "--pid", "7", "--retain-exited", "1h"][..],
            &["heapprofd", "--retain-exited", "1h", "--", "ls"],
            &["heapprofd", "--kernel", "--retain-exited", "1h"],
        ] {
            let Ok((Err(message), _)) = cli(other) else {
                panic!("{other:?} accepted");
            };
            assert!(
                message.contains("--retain-exited applies to --all"),
                "{message}"
            );
        }
    }

    #[test]
    fn metrics_addresses_parse_and_bad_ones_say_how_to_write_them() {
        assert_eq!(
            parse_listen_address("127.0.0.1:9464"),
            Ok(SocketAddr::from(([127, 0, 0, 1], 9464)))
        );
        assert_eq!(
            parse_listen_address("localhost:80"),
            Ok(SocketAddr::from(([127, 0, 0, 1], 80)))
        );
        assert!(parse_listen_address("[::1]:9464").is_ok_and(|a| a.is_ipv6()));
        for bad in [
            "notanaddress",
            "9464",
            "127.0.0.1",
            "127.0.0.1:99999",
            ":9464",
        ] {
            let message = parse_listen_address(bad).expect_err(bad);
            assert!(
                message.contains("write IP:PORT, e.g. 127.0.0.1:9464"),
                "{message}"
            );
        }
        let cli = |args: &[&str]| Cli::try_parse_from(args);
        let parsed = cli(&["heapprofd", "--all", "--metrics", "127.0.0.1:1"]).expect("valid");
        assert_eq!(parsed.metrics_top, 100);
        assert!(
            cli(&["heapprofd", "--all", "--metrics-top", "5"]).is_err(),
            "needs --metrics"
        );
        assert!(
            cli(&[
                "heapprofd",
                "--all",
                "--metrics",
                "127.0.0.1:1",
                "--metrics-top",
                "0"
            ])
            .is_err()
        );
    }

    #[test]
    fn interval_bounds_are_enforced() {
        assert!(parse_interval("50ms").is_err());
        assert!(parse_interval("25h").is_err());
        assert!(parse_interval("1s").is_ok());
    }

    #[test]
    fn exactly_one_target_is_required() {
        let cli = |args: &[&str]| Cli::try_parse_from(args).map(|c| c.target());
        assert_eq!(
            cli(&["heapprofd", "--pid", "7"]).ok(),
            Some(Ok(Target::Pid(7)))
        );
        assert_eq!(cli(&["heapprofd", "--all"]).ok(), Some(Ok(Target::All)));
        assert_eq!(
            cli(&["heapprofd", "--", "ls", "-l"]).ok(),
            Some(Ok(Target::Launch(vec!["ls".into(), "-l".into()])))
        );
        assert!(matches!(cli(&["heapprofd"]), Ok(Err(_))));
        assert!(matches!(
            cli(&["heapprofd", "--all", "--", "ls"]),
            Ok(Err(_))
        ));
        assert!(cli(&["heapprofd", "--pid", "1", "--all"]).is_err());
        assert_eq!(cli(&["heapprofd", "--kernel"]).ok(), Some(Ok(Target::All)));
        assert_eq!(
            cli(&["heapprofd", "--kernel", "--pid", "9"]).ok(),
            Some(Ok(Target::Pid(9)))
        );
        assert!(
            cli(&["heapprofd", "--pages", "--all"]).is_err(),
            "--pages needs --kernel"
        );
        assert!(cli(&["heapprofd", "--kernel", "--sample-rate", "4k"]).is_ok());
    }
}
