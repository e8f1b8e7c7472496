//! Kernel mode: event layouts from tracefs, loading and attaching the tracepoint programs.

use std::path::Path;

use anyhow::{Context as _, Result, bail};
use aya::{
    Btf, Ebpf, EbpfLoader,
    maps::Queue,
    programs::{FEntry, KProbe, ProgramError, RawTracePoint, TracePoint},
};
use heapprof_common::{
    kernel::{
        ATOMICS_SINCE, DeferredFreePath, EventLayout, FieldRef, FuncArgs, HASHED_PROGRAMS,
        HASHED_SUFFIX, KernelConfig, KernelEvent, names as kernel_names,
    },
    live, names,
};
use thiserror::Error;

use super::{BPF_OBJECT, Capacities};
use crate::{
    sys::{page_size, running_kernel},
    tracefs::{self, EventFormat},
};

/// Why an event's layout cannot be used.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum LayoutError {
    /// The event lacks a field heapprofd needs.
    #[error("{event} has no field `{field}`")]
    MissingField {
        /// `category:name`.
        event: String,
        /// The field.
        field: &'static str,
    },
    /// A field has a size heapprofd cannot read as a number.
    #[error("field `{field}` of {event} is {size} bytes; only 4- or 8-byte fields can be read")]
    BadSize {
        /// `category:name`.
        event: String,
        /// The field.
        field: &'static str,
        /// Its size.
        size: u32,
    },
    /// A field lies beyond what the programs can address.
    #[error("field `{field}` of {event} is at offset {offset}, beyond 65535")]
    BadOffset {
        /// `category:name`.
        event: String,
        /// The field.
        field: &'static str,
        /// Its offset.
        offset: u32,
    },
}

/// Which events a session uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventSelection {
    /// Page allocations and frees as well (`--pages`).
    pub pages: bool,
    /// Follow the children of traced processes (a launched command).
    pub follow_forks: bool,
}

/// The fields of `event` that kernel mode reads, located in its format.
pub fn event_layout(event: KernelEvent, format: &EventFormat) -> Result<EventLayout, LayoutError> {
    let qualified = || format!("{}:{}", event.category(), event.name());
    let get = |name: &'static str, required: bool| -> Result<FieldRef, LayoutError> {
        let Some(field) = format.field(name) else {
            return if required {
                Err(LayoutError::MissingField {
                    event: qualified(),
                    field: name,
                })
            } else {
                Ok(FieldRef::default())
            };
        };
        if !matches!(field.size, 4 | 8) {
            return Err(LayoutError::BadSize {
                event: qualified(),
                field: name,
                size: field.size,
            });
        }
        let offset = u16::try_from(field.offset).map_err(|_| LayoutError::BadOffset {
            event: qualified(),
            field: name,
            offset: field.offset,
        })?;
        Ok(FieldRef {
            offset,
            size: field.size as u16,
        })
    };
    let none = FieldRef::default();
    Ok(match event {
        KernelEvent::Kmalloc
        | KernelEvent::KmallocNode
        | KernelEvent::KmemCacheAlloc
        | KernelEvent::KmemCacheAllocNode => EventLayout {
            ptr: get("ptr", true)?,
            call_site: get("call_site", false)?,
            bytes_req: get("bytes_req", false)?,
            bytes_alloc: get("bytes_alloc", true)?,
            order: none,
            // kmalloc's class is its size; kernels before 6.0 have no name here.
            name: if matches!(
                event,
                KernelEvent::KmemCacheAlloc | KernelEvent::KmemCacheAllocNode
            ) {
                get("name", false)?
            } else {
                none
            },
        },
        KernelEvent::Kfree | KernelEvent::KmemCacheFree => EventLayout {
            ptr: get("ptr", true)?,
            call_site: get("call_site", false)?,
            ..EventLayout::default()
        },
        KernelEvent::PageAlloc => EventLayout {
            ptr: get("pfn", true)?,
            order: get("order", true)?,
            ..EventLayout::default()
        },
        KernelEvent::PageFree | KernelEvent::PageFreeBatched => EventLayout {
            ptr: get("pfn", true)?,
            ..EventLayout::default()
        },
        KernelEvent::ProcessFork => EventLayout {
            ptr: get("child_pid", true)?,
            ..EventLayout::default()
        },
    })
}

/// Whether a session must have `event` (an error when missing) or uses it if present.
fn required(event: KernelEvent, selection: EventSelection) -> Option<bool> {
    match event {
        KernelEvent::Kmalloc
        | KernelEvent::KmemCacheAlloc
        | KernelEvent::Kfree
        | KernelEvent::KmemCacheFree => Some(true),
        KernelEvent::KmallocNode | KernelEvent::KmemCacheAllocNode => Some(false),
        KernelEvent::PageAlloc | KernelEvent::PageFree if selection.pages => Some(true),
        KernelEvent::PageFreeBatched if selection.pages => Some(false),
        KernelEvent::ProcessFork if selection.follow_forks => Some(true),
        _ => None,
    }
}

/// The events this kernel offers for `selection`, with their layouts; an error names
/// the first missing or unreadable one.
pub fn resolve_events(
    tracing: &Path,
    selection: EventSelection,
) -> Result<Vec<(KernelEvent, EventLayout)>> {
    if !tracing.join("events/kmem").is_dir() {
        bail!(
            "this kernel has no kmem tracepoints ({} is missing); heapprofd --kernel needs a \
             kernel built with CONFIG_TRACEPOINTS and the kmem events",
            tracing.join("events/kmem").display()
        );
    }
    let mut events = Vec::new();
    for event in KernelEvent::ALL {
        let Some(must) = required(event, selection) else {
            continue;
        };
        match tracefs::event_format(tracing, event.category(), event.name())? {
            Some(format) => {
                let layout = event_layout(event, &format).with_context(|| {
                    format!(
                        "this kernel's layout of {}:{} is not supported",
                        event.category(),
                        event.name()
                    )
                })?;
                events.push((event, layout));
            }
            None if must => bail!(
                "this kernel has no {}:{} tracepoint; heapprofd --kernel cannot count its heap",
                event.category(),
                event.name()
            ),
            None => {}
        }
    }
    Ok(events)
}

/// Loads the BPF object for kernel mode: the user-mode tables shrink to one entry.
/// `sample_rate` (bytes, 0: every allocation) is `--sample-rate`.
pub fn load_bpf_object(
    capacities: Capacities,
    events: &[(KernelEvent, EventLayout)],
    filter_processes: bool,
    cgroup: Option<crate::cgroup::CgroupFilter>,
    sample_rate: u64,
) -> Result<Ebpf> {
    let func_args = if running_kernel().is_some_and(|v| v >= FUNC_ARG_HELPERS) {
        FuncArgs::Helper
    } else {
        FuncArgs::SavedArray
    };
    let mut config = KernelConfig {
        page_size: page_size(),
        ignore_tgid: std::process::id(),
        filter_processes: u32::from(filter_processes),
        cgroup_id: cgroup.map_or(0, |c| c.id),
        cgroup_level: cgroup.map_or(0, |c| c.level),
        func_args: func_args as u32,
        sample_rate,
        ..KernelConfig::default()
    };

    for (event, layout) in events {
        config.events[*event as usize] = *layout;
    }
    // The live objects go to user mode's live-block table, which reads its size from
    // user mode's settings; or, before 5.12, to KERNEL_LIVE (see `program`).
    let (live_buckets, hashed_blocks) = if live_array() {
        (live::buckets_for(capacities.live_blocks), 1)
    } else {
        (1, capacities.live_blocks)
    };
    let user_config = heapprof_common::Config {
        live_buckets,
        ..heapprof_common::Config::default()
    };
    EbpfLoader::new()
        .override_global(kernel_names::KERNEL_CONFIG, &config, true)
        .override_global(names::CONFIG, &user_config, true)
        .map_max_entries(names::LIVE, live_buckets)
        .map_max_entries(kernel_names::KERNEL_LIVE, hashed_blocks)
        .map_max_entries(kernel_names::KERNEL_SITES, capacities.sites)
        .map_max_entries(kernel_names::KERNEL_SITE_COUNTERS, capacities.sites)
        .map_max_entries(kernel_names::KERNEL_SITE_IDS, capacities.sites)
        .map_max_entries(kernel_names::KERNEL_STACKS, capacities.stacks)
        .map_max_entries(names::SITES, 1)
        .map_max_entries(names::SITE_COUNTERS, 1)
        .map_max_entries(names::SITE_IDS_FREE, 1)
        .map_max_entries(names::STACKS, 1)
        .map_max_entries(names::IN_FLIGHT, 1)
        .map_max_entries(names::EXEC_GEN, 1)
        .map_max_entries(names::PROCESS_MAPPINGS, 1)
        .map_max_entries(names::UNWIND_OBJECTS, 1)
        .map_max_entries(names::UNWIND_ROWS, 1)
        .map_max_entries(names::UNWIND_RULES, 1)
        .map_max_entries(names::UNWIND_GAPS, 1)
        .map_max_entries(names::MAPPINGS_REQUESTED, 1)
        .load(BPF_OBJECT)
        .context("loading the BPF programs into the kernel (needs root or CAP_BPF+CAP_PERFMON)")
        .and_then(|mut ebpf| {
            fill_site_ids(&mut ebpf, capacities.sites)?;
            Ok(ebpf)
        })
}

/// Whether the live objects go to user mode's live-block table, whose atomic
/// instructions the kernel takes (5.12+; an unknown version is taken as new).
fn live_array() -> bool {
    running_kernel().is_none_or(|version| version >= ATOMICS_SINCE)
}

/// The program that does `name`'s work on this kernel: `name` itself, or before
/// 5.12 its copy keeping the live objects in a hash map (`HASHED_PROGRAMS`).
pub fn program(name: &str) -> std::borrow::Cow<'_, str> {
    if !live_array() && HASHED_PROGRAMS.contains(&name) {
        std::borrow::Cow::Owned(format!("{name}{HASHED_SUFFIX}"))
    } else {
        std::borrow::Cow::Borrowed(name)
    }
}

/// Fills `KERNEL_SITE_IDS` with every site index, before any program is attached.
fn fill_site_ids(ebpf: &mut Ebpf, sites: u32) -> Result<()> {
    let map = ebpf
        .map_mut(kernel_names::KERNEL_SITE_IDS)
        .with_context(|| format!("BPF map {} missing", kernel_names::KERNEL_SITE_IDS))?;
    let mut ids: Queue<_, heapprof_common::SiteId> = Queue::try_from(map)
        .with_context(|| format!("BPF map {} is not a queue", kernel_names::KERNEL_SITE_IDS))?;
    for id in 0..sites {
        ids.push(&id, 0)
            .with_context(|| format!("filling {}", kernel_names::KERNEL_SITE_IDS))?;
    }
    Ok(())
}

/// The first kernel with `bpf_get_func_arg()` and `bpf_loop()` (5.17).
const FUNC_ARG_HELPERS: (u32, u32) = (5, 17);

/// The frees no tracepoint shows, and whether this session sees them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeferredFrees {
    /// The kernel functions whose programs are attached (fentry, or kprobes).
    pub seen: Vec<&'static str>,
    /// Those of them seen through kprobes (where fentry cannot be used).
    pub kprobes: Vec<&'static str>,
    /// Why the others are not, one line each (no BTF, a kernel without the function,
    /// the verifier's refusal).
    pub missing: Vec<String>,
}

impl DeferredFrees {
    /// What the profile undercounts as freed, for the log and the profile's comments;
    /// `None` when every deferred free is seen.
    pub fn undercounted(&self) -> Option<String> {
        if self.missing.is_empty() {
            return None;
        }
        Some(format!(
            "objects released with kfree_rcu() or freed in bulk (kmem_cache_free_bulk, \
             kfree_bulk) are not all seen freed, so their sites' in-use is overstated until \
             the address is allocated again: {}",
            self.missing.join("; ")
        ))
    }
}

/// What the profile misses when the program of `path` is not attached.
fn unseen(path: DeferredFreePath) -> &'static str {
    match path {
        DeferredFreePath::Rcu => {
            "objects released with kfree_rcu()/kvfree_rcu() are not seen freed"
        }
        DeferredFreePath::Bulk => {
            "objects freed with kmem_cache_free_bulk()/kfree_bulk() are not seen freed"
        }
    }
}

/// Attaches the fentry programs that see frees without a per-object tracepoint:
/// `kvfree_call_rcu` (`kfree_rcu`) and `kmem_cache_free_bulk` (`kfree_bulk`). They need
/// the kernel's BTF; without it (or where one fails to load or attach) the session
/// goes on and says what it undercounts.
pub fn attach_deferred_frees(ebpf: &mut Ebpf) -> DeferredFrees {
    let mut frees = DeferredFrees::default();
    let btf = Btf::from_sys_fs().map_err(|err| {
        format!("this kernel has no BTF (/sys/kernel/btf/vmlinux: {err}), which fentry needs")
    });
    let kernel = running_kernel();
    for path in DeferredFreePath::ALL {
        let function = path.function();
        // The bulk program walks the array with bpf_loop(), which older kernels lack.
        if path == DeferredFreePath::Bulk
            && let Some((major, minor)) = kernel.filter(|&v| v < FUNC_ARG_HELPERS)
        {
            frees.missing.push(format!(
                "{function}: its program needs bpf_loop() (Linux 5.17+), this kernel is \
                 {major}.{minor}; {}",
                unseen(path)
            ));
            continue;
        }
        let fentry = match &btf {
            Ok(btf) => attach_fentry(ebpf, path.program(), function, btf),
            Err(no_btf) => Err(no_btf.clone()),
        };
        let Err(reason) = fentry else {
            frees.seen.push(function);
            continue;
        };
        // Kprobes need no BTF nor trampolines (but the kernel skips them, as
        // tracepoint programs, while another tracing program runs on the CPU).
        match attach_kprobe(ebpf, path.kprobe_program(), function) {
            Ok(()) => {
                log::info!("{function}: fentry not usable ({reason}); a kprobe sees its frees");
                frees.seen.push(function);
                frees.kprobes.push(function);
            }
            Err(kprobe) => frees.missing.push(format!(
                "{function}: {reason}; its kprobe: {kprobe:#}; {}",
                unseen(path)
            )),
        }
    }
    frees
}

/// Loads kprobe program `program` and attaches it to the entry of `function`.
fn attach_kprobe(ebpf: &mut Ebpf, program: &str, function: &str) -> Result<()> {
    let program = &*self::program(program);
    let kprobe: &mut KProbe = ebpf
        .program_mut(program)
        .with_context(|| format!("BPF program {program} missing from the object"))?
        .try_into()
        .with_context(|| format!("BPF program {program} is not a kprobe program"))?;
    kprobe
        .load()
        .with_context(|| format!("verifying BPF program {program}"))?;
    kprobe
        .attach(function, 0)
        .with_context(|| format!("attaching a kprobe to {function}"))?;
    Ok(())
}

/// The line of a verifier log that says why it refused a program: the first line
/// after the last instruction it walked that is not a register state, a source line
/// or the closing statistics. Lines before the walk (checks of the program's own
/// BTF, `reg type unsupported for arg#0`) are often harmless and only count when the
/// walk gave no reason. `None` when the log holds no such line.
pub fn verifier_reason(log: &str) -> Option<&str> {
    let lines: Vec<&str> = log.lines().map(str::trim).collect();
    let walked = lines.iter().rposition(|line| is_instruction(line));
    let after = walked.map_or(0, |last| last + 1);
    lines[after..]
        .iter()
        .chain(&lines[..after])
        .copied()
        .find(|line| !is_trace(line))
}

/// `12: (79) r1 = *(u64 *)(r1 +8)`: an instruction the verifier walked.
fn is_instruction(line: &str) -> bool {
    line.split_once(": (")
        .is_some_and(|(index, _)| !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether a verifier log line is its trace (instructions, states, source lines,
/// statistics) rather than a message.
fn is_trace(line: &str) -> bool {
    const PREFIXES: [&str; 16] = [
        ";",
        "from ",
        "func#",
        "Func#",
        "Validating ",
        "last_idx ",
        "regs=",
        "parent ",
        "mark_precise",
        "caller:",
        "callee:",
        "returning from callee",
        "to caller at",
        "propagating",
        "processed ",
        "verification time",
    ];
    // `12: ...`: an instruction or the states at one.
    let numbered = line
        .split_once(':')
        .is_some_and(|(head, _)| !head.is_empty() && head.bytes().all(|b| b.is_ascii_digit()));
    // `R1_w=scalar()`, `frame1: R1=...`.
    let state = line.starts_with('R')
        && line.contains('=')
        && line[1..]
            .split(['=', '_'])
            .next()
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    line.is_empty()
        || numbered
        || state
        || line.starts_with("frame")
        || line.starts_with("stack depth")
        // `func 'f' arg0 has btf_id 102 type STRUCT 'callback_head'`: an access allowed.
        || (line.starts_with("func '") && line.contains(" has btf_id "))
        || PREFIXES.iter().any(|prefix| line.starts_with(prefix))
}

/// Loads and attaches fentry program `program` on kernel function `function`; the
/// error is one short reason (the verifier's own words, or what is missing). A
/// refusal's whole verifier log goes to the debug log.
fn attach_fentry(ebpf: &mut Ebpf, program: &str, function: &str, btf: &Btf) -> Result<(), String> {
    let program = &*self::program(program);
    let fentry: &mut FEntry = ebpf
        .program_mut(program)
        .ok_or_else(|| format!("BPF program {program} missing from the object"))?
        .try_into()
        .map_err(|_| format!("BPF program {program} is not an fentry program"))?;
    fentry.load(function, btf).map_err(|err| match err {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            let log = verifier_log.to_string();
            log::debug!("the verifier's log of {program} on {function}:\n{log}");
            match verifier_reason(&log) {
                Some(reason) => format!("the verifier refused its fentry program: {reason}"),
                None => format!(
                    "the kernel refused its fentry program ({}, no verifier message)",
                    io_error
                ),
            }
        }
        other => other.to_string(),
    })?;
    fentry.attach().map_err(|err| {
        // aya's message names the call; the kernel's errno is its source.
        let err = anyhow::Error::new(err);
        let unsupported = err.chain().any(|cause| {
            cause
                .downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.raw_os_error() == Some(ENOTSUPP))
        });
        if unsupported {
            format!(
                "attaching its fentry program: {err:#} (ENOTSUPP: this kernel cannot attach \
                 BPF trampolines to its functions; arm64 has the ftrace direct calls they \
                 need from Linux 6.4)"
            )
        } else {
            format!("attaching its fentry program: {err:#}")
        }
    })?;
    Ok(())
}

/// The kernel's own "not supported" errno, which libc does not name.
const ENOTSUPP: i32 = 524;

/// How many times the kernel skipped each program that has skipped runs, by name:
/// a tracepoint program is not run when another tracing BPF program already runs on
/// that CPU (the kernel's `bpf_prog_active` guard; an interrupt's or softirq's free
/// inside a program's run is lost that way). From `recursion_misses` of the
/// program's `bpf_prog_info` (Linux 5.12+; older kernels count none).
pub fn recursion_misses(ebpf: &Ebpf) -> Vec<(String, u64)> {
    use std::os::fd::{AsFd as _, AsRawFd as _};

    /// `BPF_OBJ_GET_INFO_BY_FD`.
    const OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    /// Offset of `recursion_misses` in `struct bpf_prog_info` (uapi, stable).
    const RECURSION_MISSES: usize = 208;
    #[repr(C)]
    struct InfoAttr {
        fd: u32,
        info_len: u32,
        info: u64,
    }
    let mut misses = Vec::new();
    for (name, program) in ebpf.programs() {
        let Ok(fd) = program.fd() else {
            continue; // not loaded
        };
        // Larger than any kernel's struct: the kernel fills what it has, zeroes stay.
        let mut info = [0u64; 64];
        let mut attr = InfoAttr {
            fd: fd.as_fd().as_raw_fd() as u32,
            info_len: std::mem::size_of_val(&info) as u32,
            info: info.as_mut_ptr() as u64,
        };
        // SAFETY: the attribute and the buffer it points to outlive the call, and
        // info_len is the buffer's size.
        let result = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                OBJ_GET_INFO_BY_FD,
                &raw mut attr,
                std::mem::size_of::<InfoAttr>(),
            )
        };
        let count = info[RECURSION_MISSES / 8];
        if result == 0 && count > 0 {
            misses.push((name.to_owned(), count));
        }
    }
    misses.sort();
    misses
}

/// Attaches the program of every event; returns how many. The slab frees use their
/// raw-tracepoint programs (see [`KernelEvent::raw_programs`]) where the kernel
/// takes them, their tracepoint programs otherwise.
pub fn attach(ebpf: &mut Ebpf, events: &[(KernelEvent, EventLayout)]) -> Result<usize> {
    for (event, _) in events {
        let raw = event.raw_programs();
        if !raw.is_empty() {
            // In order: the second copy must run after the first.
            match raw
                .iter()
                .try_for_each(|program| attach_raw(ebpf, program, event.name()))
            {
                Ok(()) => continue,
                Err(err) => {
                    log::warn!(
                        "the raw tracepoint {} cannot be used ({err:#}); its tracepoint \
                         program is, which the kernel skips while another BPF program runs \
                         on the CPU",
                        event.name()
                    );
                    for program in raw {
                        if let Some(program) = ebpf.program_mut(&self::program(program))
                            && let Ok(program) = <&mut RawTracePoint>::try_from(program)
                        {
                            // Detaches a copy that was attached.
                            let _ = program.unload();
                        }
                    }
                }
            }
        }
        let name = &*program(event.name());
        let program: &mut TracePoint = ebpf
            .program_mut(name)
            .with_context(|| format!("BPF program {name} missing from the object"))?
            .try_into()
            .with_context(|| format!("BPF program {name} is not a tracepoint program"))?;
        program
            .load()
            .with_context(|| format!("verifying BPF program {name}"))?;
        program
            .attach(event.category(), event.name())
            .with_context(|| {
                format!(
                    "attaching to the tracepoint {}:{}",
                    event.category(),
                    event.name()
                )
            })?;
    }
    Ok(events.len())
}

/// Loads raw-tracepoint program `program` and attaches it to tracepoint `tracepoint`.
fn attach_raw(ebpf: &mut Ebpf, program: &str, tracepoint: &str) -> Result<()> {
    let program = &*self::program(program);
    let raw: &mut RawTracePoint = ebpf
        .program_mut(program)
        .with_context(|| format!("BPF program {program} missing from the object"))?
        .try_into()
        .with_context(|| format!("BPF program {program} is not a raw tracepoint program"))?;
    raw.load()
        .with_context(|| format!("verifying BPF program {program}"))?;
    raw.attach(tracepoint)
        .with_context(|| format!("attaching to the raw tracepoint {tracepoint}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(kernel: &str, event: &str) -> EventFormat {
        let path = format!(
            "{}/tests/fixtures/tracefs/{kernel}/{event}.format",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        tracefs::format::parse(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    fn field(offset: u16, size: u16) -> FieldRef {
        FieldRef { offset, size }
    }

    #[test]
    fn layouts_of_linux_5_10() {
        let kmalloc =
            event_layout(KernelEvent::Kmalloc, &fixture("linux-5.10", "kmalloc")).expect("kmalloc");
        assert_eq!(
            (
                kmalloc.call_site,
                kmalloc.ptr,
                kmalloc.bytes_req,
                kmalloc.bytes_alloc
            ),
            (field(8, 8), field(16, 8), field(24, 8), field(32, 8))
        );
        let node = event_layout(
            KernelEvent::KmallocNode,
            &fixture("linux-5.10", "kmalloc_node"),
        )
        .expect("node");
        assert_eq!(node.bytes_alloc, field(32, 8));
        let cache_node = event_layout(
            KernelEvent::KmemCacheAllocNode,
            &fixture("linux-5.10", "kmem_cache_alloc_node"),
        )
        .expect("cache node");
        assert_eq!(cache_node.ptr, field(16, 8));
        let page = event_layout(
            KernelEvent::PageAlloc,
            &fixture("linux-5.10", "mm_page_alloc"),
        )
        .expect("page");
        assert_eq!((page.ptr, page.order), (field(8, 8), field(16, 4)));
        let fork = event_layout(
            KernelEvent::ProcessFork,
            &fixture("linux-5.10", "sched_process_fork"),
        )
        .expect("fork");
        assert_eq!(fork.ptr, field(44, 4));
        let free = event_layout(
            KernelEvent::KmemCacheFree,
            &fixture("linux-5.10", "kmem_cache_free"),
        )
        .expect("free");
        assert_eq!(free.ptr, field(16, 8));
    }

    #[test]
    fn layouts_of_linux_6_1() {
        let cache = event_layout(
            KernelEvent::KmemCacheAlloc,
            &fixture("linux-6.1", "kmem_cache_alloc"),
        )
        .expect("cache");
        assert_eq!(
            (cache.ptr, cache.bytes_req, cache.bytes_alloc, cache.name),
            (
                field(16, 8),
                field(24, 8),
                field(32, 8),
                FieldRef::default()
            )
        );
        let free = event_layout(
            KernelEvent::KmemCacheFree,
            &fixture("linux-6.1", "kmem_cache_free"),
        )
        .expect("free");
        assert_eq!(free.ptr, field(16, 8));
        let page = event_layout(
            KernelEvent::PageAlloc,
            &fixture("linux-6.1", "mm_page_alloc"),
        )
        .expect("page");
        assert_eq!(page.order, field(16, 4));
    }

    #[test]
    fn layouts_of_linux_6_18() {
        // The cache name (a __data_loc string) moved bytes_req and bytes_alloc back by 8.
        let cache = event_layout(
            KernelEvent::KmemCacheAlloc,
            &fixture("linux-6.18", "kmem_cache_alloc"),
        )
        .expect("cache");
        assert_eq!(
            (cache.ptr, cache.name, cache.bytes_req, cache.bytes_alloc),
            (field(16, 8), field(24, 4), field(32, 8), field(40, 8))
        );
        let kmalloc =
            event_layout(KernelEvent::Kmalloc, &fixture("linux-6.18", "kmalloc")).expect("kmalloc");
        assert_eq!(
            (kmalloc.bytes_req, kmalloc.bytes_alloc),
            (field(24, 8), field(32, 8))
        );
        let fork = event_layout(
            KernelEvent::ProcessFork,
            &fixture("linux-6.18", "sched_process_fork"),
        )
        .expect("fork");
        assert_eq!(fork.ptr, field(20, 4));
        let batched = event_layout(
            KernelEvent::PageFreeBatched,
            &fixture("linux-6.18", "mm_page_free_batched"),
        )
        .expect("batched");
        assert_eq!(batched.ptr, field(8, 8));
    }

    /// A tracing directory holding the given events of a fixture kernel.
    fn tracing_dir(kernel: &str, events: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        for event in events {
            let category = if *event == "sched_process_fork" {
                "sched"
            } else {
                "kmem"
            };
            let event_dir = dir.path().join("events").join(category).join(event);
            std::fs::create_dir_all(&event_dir).expect("mkdir");
            let source = format!(
                "{}/tests/fixtures/tracefs/{kernel}/{event}.format",
                env!("CARGO_MANIFEST_DIR")
            );
            std::fs::copy(&source, event_dir.join("format")).expect("copy fixture");
        }
        dir
    }

    const SLAB_EVENTS: [&str; 4] = ["kmalloc", "kmem_cache_alloc", "kfree", "kmem_cache_free"];

    #[test]
    fn resolves_the_events_a_kernel_offers() {
        let plain = EventSelection {
            pages: false,
            follow_forks: false,
        };
        let mut v5 = SLAB_EVENTS.to_vec();
        v5.extend(["kmalloc_node", "kmem_cache_alloc_node"]);
        let dir = tracing_dir("linux-5.10", &v5);
        let events: Vec<KernelEvent> = resolve_events(dir.path(), plain)
            .expect("5.10 resolves")
            .into_iter()
            .map(|(e, _)| e)
            .collect();
        assert!(events.contains(&KernelEvent::KmallocNode) && events.contains(&KernelEvent::Kfree));

        // 6.1 has no _node events: they are optional.
        let dir = tracing_dir("linux-6.1", &SLAB_EVENTS);
        assert_eq!(
            resolve_events(dir.path(), plain)
                .expect("6.1 resolves")
                .len(),
            4
        );

        // --pages needs the page events; a launched command needs the fork event.
        let all = EventSelection {
            pages: true,
            follow_forks: true,
        };
        let err = resolve_events(dir.path(), all).expect_err("no page events");
        assert!(format!("{err:#}").contains("kmem:mm_page_alloc"), "{err:#}");
        let mut v618 = SLAB_EVENTS.to_vec();
        v618.extend([
            "mm_page_alloc",
            "mm_page_free",
            "mm_page_free_batched",
            "sched_process_fork",
        ]);
        let dir = tracing_dir("linux-6.18", &v618);
        assert_eq!(
            resolve_events(dir.path(), all)
                .expect("6.18 resolves")
                .len(),
            8
        );
    }

    #[test]
    fn missing_or_broken_events_are_named() {
        let plain = EventSelection {
            pages: false,
            follow_forks: false,
        };
        let empty = tempfile::tempdir().expect("temp dir");
        let err = resolve_events(empty.path(), plain).expect_err("no kmem");
        assert!(
            format!("{err:#}").contains("no kmem tracepoints"),
            "{err:#}"
        );

        let dir = tracing_dir("linux-6.18", &["kmalloc", "kfree", "kmem_cache_free"]);
        let err = resolve_events(dir.path(), plain).expect_err("no kmem_cache_alloc");
        assert!(
            format!("{err:#}").contains("no kmem:kmem_cache_alloc tracepoint"),
            "{err:#}"
        );

        let dir = tracing_dir("linux-6.18", &SLAB_EVENTS);
        let format = dir.path().join("events/kmem/kmalloc/format");
        std::fs::write(
            &format,
            "name: kmalloc\nformat:\n\tfield:const void * ptr;\toffset:x;\n",
        )
        .expect("write");
        let err = format!(
            "{:#}",
            resolve_events(dir.path(), plain).expect_err("malformed")
        );
        assert!(
            err.contains("kmalloc/format is not a valid tracepoint format file")
                && err.contains("line 3"),
            "{err}"
        );
    }

    #[test]
    fn the_verifiers_reason_is_found_in_its_log() {
        // Linux 6.1 (Debian's 6.1.0-50-amd64) refusing a direct context read of
        // kvfree_call_rcu's callback: the harmless check of the program's own BTF
        // comes first, the reason after the instruction.
        let log = "reg type unsupported for arg#0 function rcu_free#85\n\
                   0: R1=ctx(off=0,imm=0) R10=fp0\n\
                   ; T::from_register(unsafe { *ptr as u64 })\n\
                   0: (79) r2 = *(u64 *)(r1 +8)\n\
                   func 'kvfree_call_rcu' arg1 type FUNC_PROTO is not a struct\n\
                   invalid bpf_context access off=8 size=8\n\
                   verification time 377 usec\n\
                   stack depth 0+0\n\
                   processed 1 insns (limit 1000000) max_states_per_insn 0 total_states 0 \
                   peak_states 0 mark_read 0\n";
        assert_eq!(
            verifier_reason(log),
            Some("func 'kvfree_call_rcu' arg1 type FUNC_PROTO is not a struct")
        );
        // 6.12: an access the verifier allowed, then the refused one.
        let log = "0: R1=ctx() R10=fp0\n\
                   0: (79) r2 = *(u64 *)(r1 +8)          ; R1=ctx() R2_w=scalar()\n\
                   1: (79) r3 = *(u64 *)(r1 +0)\n\
                   func 'kvfree_call_rcu' arg0 has btf_id 102 type STRUCT 'callback_head'\n\
                   2: R1=ctx() R3_w=ptr_callback_head()\n\
                   3: (1f) r1 -= r2\n\
                   math between ptr_ pointer and register with unbounded min value is not allowed\n\
                   verification time 1492 usec\n";
        assert_eq!(
            verifier_reason(log),
            Some("math between ptr_ pointer and register with unbounded min value is not allowed")
        );
        // A helper the kernel lacks, after branch states.
        let log = "func#0 @0\nfunc#1 @40\n0: R1=ctx(id=0,off=0,imm=0) R10=fp0\n\
                   from 3 to 5: R0_w=inv0 R10=fp0\n5: (85) call unknown#181\n\
                   invalid func unknown#181\nprocessed 9 insns\n";
        assert_eq!(verifier_reason(log), Some("invalid func unknown#181"));
        // Refused before any instruction was walked.
        assert_eq!(
            verifier_reason("arg#0 type is not a struct\nR1 type=ctx expected=fp\n"),
            Some("arg#0 type is not a struct")
        );
        assert_eq!(
            verifier_reason("0: R1=ctx() R10=fp0\nprocessed 1 insns\n"),
            None
        );
        assert_eq!(verifier_reason(""), None);
    }

    #[test]
    fn a_layout_without_the_needed_fields_is_refused() {
        let kfree = fixture("linux-6.18", "kfree");
        assert_eq!(
            event_layout(KernelEvent::Kmalloc, &kfree),
            Err(LayoutError::MissingField {
                event: "kmem:kmalloc".into(),
                field: "bytes_alloc"
            })
        );
        let comm_as_pid = tracefs::format::parse(
            "name: sched_process_fork\nformat:\n\tfield:char child_pid[16];\toffset:8;\tsize:16;\tsigned:0;\n",
        )
        .expect("parses");
        assert!(matches!(
            event_layout(KernelEvent::ProcessFork, &comm_as_pid),
            Err(LayoutError::BadSize { size: 16, .. })
        ));
    }
}
