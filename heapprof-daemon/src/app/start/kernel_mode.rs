//! Kernel mode's start: tracefs and the events' layouts, the kernel programs loaded
//! and attached (deferred frees where the kernel has them), the session ready.

use anyhow::Result;
use heapprof_common::kernel::{EventLayout, KernelEvent};

use super::metrics_endpoint::serve_metrics;
use crate::{
    cli::{Cli, Target},
    health::{self, bpf_log::BpfLog},
    launch::PausedChild,
    metrics::server::Endpoint,
    pprof, probes,
    session::kernel::{KernelSession, KernelSessionConfig},
    stats_file::StartFigures,
    tracefs,
};

/// Kernel mode: tracefs and event layouts, kernel symbols, load, attach.
pub(super) fn start_kernel(
    cli: &Cli,
    target: &Target,
    child: Option<&PausedChild>,
    endpoint: Option<Endpoint>,
) -> Result<(KernelSession, Option<BpfLog>, StartFigures)> {
    let tracing = tracefs::root()?;
    let selection = probes::kernel::EventSelection {
        pages: cli.pages,
        follow_forks: matches!(target, Target::Launch(_)),
    };
    let events = probes::kernel::resolve_events(&tracing, selection)?;
    pprof::writer::prepare_output_dir(&cli.output_dir())?;
    let mut ebpf = load_kernel_bpf(cli, target, &events)?;
    let bpf_log = BpfLog::init(&mut ebpf);
    let config = KernelSessionConfig {
        target: target.clone(),
        output: cli.output_dir(),
        events: events.iter().map(|(event, _)| *event).collect(),
        bpf_stats: cli.bpf_stats,
        sample_rate: cli.sample_rate.unwrap_or(0),
    };
    let mut attached = probes::kernel::attach(&mut ebpf, &events)?;
    let deferred_frees = probes::kernel::attach_deferred_frees(&mut ebpf);
    attached += deferred_frees.seen.len();
    if let Some(undercounted) = deferred_frees.undercounted() {
        log::warn!("{undercounted}");
    }
    let programs = StartFigures::programs_of(&ebpf);
    let mut session = KernelSession::new(config, ebpf, deferred_frees)?;
    let pid = match (target, child) {
        (Target::Pid(pid), _) => Some(*pid),
        (Target::Launch(_), Some(child)) => Some(child.pid),
        _ => None,
    };
    if let Some(pid) = pid {
        session.trace_process(pid)?;
    }
    let map_memory = health::map_memory::tables();
    log::info!("{}", health::map_memory::describe(&map_memory));
    if let Some(endpoint) = endpoint {
        session.export_metrics(serve_metrics(cli, target, endpoint, &map_memory));
    }
    log_ready(cli, target, pid, attached, &events, &session);
    let figures = StartFigures {
        programs,
        kernel_memory: map_memory,
        joining: None,
    };
    Ok((session, bpf_log, figures))
}

/// Loads the kernel programs for `events`, with the capacities, the filters and the
/// sampling the command line asks for.
fn load_kernel_bpf(
    cli: &Cli,
    target: &Target,
    events: &[(KernelEvent, EventLayout)],
) -> Result<aya::Ebpf> {
    let capacities = super::map_capacities(cli);
    let filter = !matches!(target, Target::All);
    let ebpf = probes::kernel::load_bpf_object(
        capacities,
        events,
        filter,
        cli.cgroup_filter()?,
        cli.sample_rate.unwrap_or(0),
    )?;
    if let Some(rate) = cli.sample_rate {
        log::info!(
            "sampling about one kernel allocation per {rate} bytes, decided in the \
             tracepoint programs before the stack is taken; values are scaled estimates"
        );
    }
    Ok(ebpf)
}

/// Says what is probed and where profiles go: the start's last line, once heapprofd is
/// fully ready (tests wait for it).
fn log_ready(
    cli: &Cli,
    target: &Target,
    pid: Option<u32>,
    attached: usize,
    events: &[(KernelEvent, EventLayout)],
    session: &KernelSession,
) {
    let mut names: Vec<&str> = events.iter().map(|(event, _)| event.name()).collect();
    names.extend(session.deferred_frees().seen.iter().copied());
    log::info!(
        "{attached} probes on kernel tracepoints and functions ({}) for {}, profiles every {:?} in {}",
        names.join(" "),
        match target {
            Target::Pid(pid) => format!("pid {pid}"),
            Target::Launch(command) => format!(
                "`{}`, pid {}, and its children",
                command.join(" "),
                pid.unwrap_or(0)
            ),
            Target::All => "all processes".to_owned(),
        },
        cli.interval,
        cli.output_dir().display()
    );
}
