//! heapprofd: an eBPF heap profiler writing Go-pprof heap profiles.
//!
//! Uprobes on the C library's allocator feed BPF maps with per-stack live and
//! cumulative counts; this daemon reads them on an interval and at exit, symbolizes
//! the stacks and writes gzip'd `profile.proto` heap profiles.

mod own_allocator;

use std::process::ExitCode;

use clap::Parser as _;
use heapprof_daemon::{
    app::{run, start},
    cli::{Cli, Target},
    launch,
    preload::PreloadLibrary,
    report,
};

/// Exit status for bad input and unmet requirements.
const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    own_allocator::keep_usable_across_fork();
    if std::env::args_os()
        .nth(1)
        .is_some_and(|arg| arg == "report")
    {
        return report();
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return command_line_error(err),
    };
    init_logging();
    let target = match cli.target() {
        Ok(target) => target,
        Err(message) => return usage_error(anyhow::anyhow!(message)),
    };
    // A wrong push URL, header or token file is one line now, before anything is traced.
    let push = match heapprof_daemon::push::PushConfig::from_cli(&cli) {
        Ok(push) => push,
        Err(err) => return usage_error(anyhow::Error::new(err)),
    };
    if cli.push_only()
        && let Err(err) = create_private_dir(&cli.output_dir())
    {
        return usage_error(err);
    }
    // Launch mode's interposer, installed before the command is forked with it.
    let preload = if cli.uses_preload(&target) {
        match PreloadLibrary::install() {
            Ok(library) => Some(library),
            Err(err) => return usage_error(err),
        }
    } else {
        None
    };
    let environment = preload
        .as_ref()
        .map(|library| library.environment(cli.sample_rate.unwrap_or(0)))
        .unwrap_or_default();
    // Fork before any thread exists (the runtime, the tracer).
    let child = match &target {
        Target::Launch(command) => match launch::fork_paused(command, &environment) {
            Ok(child) => Some(child),
            Err(err) => return usage_error(err),
        },
        _ => None,
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => return usage_error(anyhow::Error::new(err).context("starting the runtime")),
    };
    runtime.block_on(async {
        let started = match start(&cli, &target, child, preload) {
            Ok(started) => started,
            Err(err) => return usage_error(err),
        };
        match run(&cli, &target, started, push).await {
            Ok(code) => code,
            Err(err) => {
                eprintln!("heapprofd: error: {err:#}");
                ExitCode::FAILURE
            }
        }
    })
}

/// `--push` without `-o`: the directory profiles pass through on their way to the
/// push, created anew (never one that exists: another user's could be read).
fn create_private_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(dir)
        .map_err(|err| {
            anyhow::anyhow!(
                "cannot create {} for the profiles on their way to --push ({err}); \
                 give a directory with -o DIR, or set TMPDIR",
                dir.display()
            )
        })
}

/// `heapprofd report ...`: reads profiles back; needs no privileges and starts no runtime.
fn report() -> ExitCode {
    let args = match report::ReportArgs::try_parse_from(std::env::args_os().skip(1)) {
        Ok(args) => args,
        Err(err) => return command_line_error(err),
    };
    match report::run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => usage_error(err),
    }
}

/// A bad command line gets one line (clap's own message names the flag and the value)
/// and status 2; help and version are printed as clap prints them.
fn command_line_error(err: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        err.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
    ) {
        let _ = err.print();
        return ExitCode::SUCCESS;
    }
    // clap's message can span lines (a list of missing flags): joined, without its
    // usage and help hints.
    let rendered = err.render().to_string();
    let message = rendered
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    let message = message.strip_prefix("error: ").unwrap_or(&message);
    eprintln!("heapprofd: error: {message}; see heapprofd --help or heapprofd report --help");
    ExitCode::from(EXIT_USAGE)
}

fn usage_error(err: anyhow::Error) -> ExitCode {
    eprintln!("heapprofd: error: {err:#}");
    ExitCode::from(EXIT_USAGE)
}

fn init_logging() {
    use std::io::Write as _;
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format(|buf, record| match record.level() {
            log::Level::Info => writeln!(buf, "heapprofd: {}", record.args()),
            level => writeln!(
                buf,
                "heapprofd: {}: {}",
                level.as_str().to_lowercase(),
                record.args()
            ),
        })
        .init();
}
