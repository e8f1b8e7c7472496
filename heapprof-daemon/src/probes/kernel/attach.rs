//! Attaching the kmem events' programs: the slab frees' raw-tracepoint pairs where
//! the kernel takes them, tracepoint programs otherwise.

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    programs::{RawTracePoint, TracePoint},
};
use heapprof_common::kernel::{EventLayout, KernelEvent};

use super::load::program;

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
