//! The allocators probed before anything runs: `--libc`, the launched program and the
//! system's C library, or for `--all` the allocator libraries installed at the usual
//! places. The rest are found as processes are read.

use anyhow::{Context as _, Result, bail};

use crate::{
    allocators::AllocatorProbes,
    cli::{Cli, Target},
    probes,
    procmaps::ObjectCache,
};

/// Probes the allocators known before anything runs ([`initial_allocators`]); `--libc`
/// naming a library without an allocator is an error.
pub(super) fn probe_initial_allocators(
    cli: &Cli,
    target: &Target,
    program: Option<&std::path::Path>,
    preloading: bool,
    ebpf: &mut aya::Ebpf,
    allocators: &mut AllocatorProbes,
) -> Result<()> {
    let mut objects = ObjectCache::default();
    // The system-wide preload probes each process it does not serve for itself alone,
    // as it is read: nothing for every process (the C library's vendor functions, say,
    // would trap in the joined processes too). `--libc`, named by the user, stays.
    let system = cli.system_preload(target);
    for (path, executable) in initial_allocators(cli, target, program)? {
        if system && cli.libc.as_deref() != Some(path.as_path()) {
            continue;
        }
        let label = path.display().to_string();
        let object = objects
            .open(&path, &label)
            .with_context(|| format!("opening {label}"))?;
        let probed = allocators
            .probe_found_object(ebpf, &object, executable, executable || !preloading)
            .with_context(|| format!("probing the allocator in {label}"))?;
        if probed == 0 && !preloading && cli.libc.as_deref() == Some(path.as_path()) {
            bail!(
                "{label} has no malloc/free symbols; point --libc at the library that \
                 provides the program's allocator"
            );
        }
    }
    Ok(())
}

/// Allocator objects probed before anything runs, with whether each is a program:
/// `--libc`; for a launched command, its program (a static binary, a statically linked
/// allocator) and the system's C library; for `--all`, the system's C library and the
/// allocator libraries installed at the usual places, so that processes starting later
/// are counted from their first call. Everything else joins as processes are read.
fn initial_allocators(
    cli: &Cli,
    target: &Target,
    program: Option<&std::path::Path>,
) -> Result<Vec<(std::path::PathBuf, bool)>> {
    let mut objects = Vec::new();
    if let Some(libc) = &cli.libc {
        if !libc.is_file() {
            bail!(
                "--libc {}: no such file; give the path of the allocator library",
                libc.display()
            );
        }
        objects.push((libc.clone(), false));
    }
    if matches!(target, Target::Pid(_)) {
        return Ok(objects);
    }
    // The system's C library, the one heapprofd runs on (a static heapprofd has none).
    let own = probes::libc::find_in_process(std::process::id())
        .map(|(_, maps_path)| std::path::PathBuf::from(maps_path));
    match own.or_else(|_| probes::libc::find_system()) {
        Ok(libc) => objects.push((libc, false)),
        Err(err) => log::debug!("{err:#}"),
    }
    match target {
        Target::Launch(_) => {
            if let Some(program) = program {
                objects.push((program.to_owned(), true));
            }
        }
        Target::All => objects.extend(
            crate::allocators::serving::system_allocators()
                .into_iter()
                .map(|path| (path, false)),
        ),
        Target::Pid(_) => {}
    }
    let mut seen = std::collections::HashSet::new();
    objects.retain(|(path, _)| seen.insert(std::fs::canonicalize(path).unwrap_or(path.clone())));
    Ok(objects)
}
