//! The frees no tracepoint shows (`kfree_rcu`, bulk frees): fentry programs where the
//! kernel has BTF and BPF trampolines, kprobes otherwise, and what the session says
//! it undercounts when neither can be used.

use anyhow::{Context as _, Result};
use aya::{
    Btf, Ebpf,
    programs::{FEntry, KProbe, ProgramError},
};
use heapprof_common::kernel::DeferredFreePath;

use super::{
    load::{FUNC_ARG_HELPERS, program},
    verifier_log::verifier_reason,
};
use crate::sys::running_kernel;

/// How a session sees the frees through one deferred path, under a stable name that
/// the profile's comments give (`frees through F seen by [deferred_free_program.F] =
/// NAME`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeferredFreeWatch {
    /// An fentry program.
    Fentry,
    /// A kprobe program (fentry not usable).
    Kprobe,
    /// Not seen: the bulk program needs `bpf_loop()`, which the kernel lacks.
    NeedsBpfLoop,
    /// Not seen: neither program could be attached (why is said in `missing`).
    NotAttached,
}

impl DeferredFreeWatch {
    /// Every watch.
    pub const ALL: [DeferredFreeWatch; 4] = [
        DeferredFreeWatch::Fentry,
        DeferredFreeWatch::Kprobe,
        DeferredFreeWatch::NeedsBpfLoop,
        DeferredFreeWatch::NotAttached,
    ];

    /// Its stable name.
    pub const fn name(self) -> &'static str {
        match self {
            DeferredFreeWatch::Fentry => "fentry",
            DeferredFreeWatch::Kprobe => "kprobe",
            DeferredFreeWatch::NeedsBpfLoop => "needs_bpf_loop",
            DeferredFreeWatch::NotAttached => "not_attached",
        }
    }

    /// The watch named `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|watch| watch.name() == name)
    }
}

/// The profile comment's name for how the frees through `path` are seen.
pub fn watch_key(path: DeferredFreePath) -> String {
    format!("deferred_free_program.{}", path.function())
}

/// The profile comment's name for the objects freed through `path`.
pub fn freed_key(path: DeferredFreePath) -> String {
    format!("deferred_freed.{}", path.function())
}

/// The frees no tracepoint shows, and whether this session sees them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeferredFrees {
    /// How each path's frees are seen, in [`DeferredFreePath::ALL`]'s order.
    pub watches: Vec<(DeferredFreePath, DeferredFreeWatch)>,
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
            frees.watches.push((path, DeferredFreeWatch::NeedsBpfLoop));
            continue;
        }
        let fentry = match &btf {
            Ok(btf) => attach_fentry(ebpf, path.program(), function, btf),
            Err(no_btf) => Err(no_btf.clone()),
        };
        let Err(reason) = fentry else {
            frees.seen.push(function);
            frees.watches.push((path, DeferredFreeWatch::Fentry));
            continue;
        };
        // Kprobes need no BTF nor trampolines (but the kernel skips them, as
        // tracepoint programs, while another tracing program runs on the CPU).
        match attach_kprobe(ebpf, path.kprobe_program(), function) {
            Ok(()) => {
                log::info!("{function}: fentry not usable ({reason}); a kprobe sees its frees");
                frees.seen.push(function);
                frees.kprobes.push(function);
                frees.watches.push((path, DeferredFreeWatch::Kprobe));
            }
            Err(kprobe) => {
                frees.missing.push(format!(
                    "{function}: {reason}; its kprobe: {kprobe:#}; {}",
                    unseen(path)
                ));
                frees.watches.push((path, DeferredFreeWatch::NotAttached));
            }
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
