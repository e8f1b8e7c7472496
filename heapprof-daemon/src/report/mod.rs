//! `heapprofd report`: reading profiles back and turning them into tables,
//! flamegraphs, the legacy text format, timelines, leak suspects and an HTML page.
//!
//! [`model`] reads a file; [`stacks`] names its stacks and sites; one module per
//! output format; [`session`] reads a session's directory of profiles. [`run`] sends
//! each request to [`single`] or to the session-wide formats.

pub mod chart;
pub mod cli;
pub mod collapsed;
pub mod flamegraph;
pub mod html;
pub mod input;
pub mod legacy;
pub mod losses;
pub mod model;
pub mod peak;
pub mod session;
pub mod single;
pub mod sizes;
pub mod stacks;
pub mod suspects;
#[cfg(test)]
pub mod test_profiles;
pub mod timeline;
pub mod top;
pub mod units;

use std::io::Write;

use anyhow::{Context as _, Result};

pub use cli::{Format, ReportArgs};
use stacks::ProcessFilter;

/// Runs `heapprofd report`.
pub fn run(args: &ReportArgs) -> Result<()> {
    // Rendered whole before anything is written: a failed report leaves no partial
    // or empty -o file behind.
    let mut rendered = Vec::new();
    let session_wide =
        args.html.is_some() || matches!(args.format, Format::Timeline | Format::Suspects);
    if session_wide {
        run_session_report(args, &mut rendered)?;
    } else {
        single::run(args, &mut rendered)?;
    }
    match &args.output {
        Some(path) => std::fs::write(path, &rendered)
            .with_context(|| format!("cannot write {}; choose another -o OUT", path.display())),
        None => {
            let mut stdout = std::io::stdout().lock();
            match stdout.write_all(&rendered).and_then(|()| stdout.flush()) {
                // A reader that stopped early (`| head`) is not an error.
                Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
                other => other.context("writing the report"),
            }
        }
    }
}

/// Writes a session-wide report: the timeline or suspects to `out`, or with `--html`
/// the page to its file (and one line on standard error saying where).
fn run_session_report(args: &ReportArgs, out: &mut dyn Write) -> Result<()> {
    let filter = args.pid.map_or(ProcessFilter::All, ProcessFilter::Pid);
    if let Some(page) = &args.html {
        html::write_page(args, filter, page)?;
        eprintln!("heapprofd: wrote {}", page.display());
        return Ok(());
    }
    let session = session::load(&args.input, &args.sample_index, filter, |_, _, _| Ok(()))?;
    match args.format {
        Format::Suspects => suspects::write_table(&session, args.top, out),
        // `run` sends only the session formats here; any other one asked
        // together with a directory gets the timeline, the directory's main table.
        _ => {
            // CSV has no place for it: said on standard error.
            for loss in losses::losses(&session.last.comments) {
                eprintln!("heapprofd: the session's last profile {}", loss.line());
            }
            timeline::write_csv(&session, args.top, out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_directory_gives_its_suspects_and_page() {
        let dir = tempfile::tempdir().expect("tempdir");
        session::tests::write_session(dir.path(), 5);
        let session = session::load(dir.path(), "inuse_space", ProcessFilter::All, |_, _, _| {
            Ok(())
        })
        .expect("loaded");
        let found = suspects::find(&session, 0);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(
            session.site_name(found[0].key.site),
            "malloc in f<std::map<int, int>> <- main"
        );

        // The whole page, through the command's entry point.
        let page = dir.path().join("page.html");
        let args = <ReportArgs as clap::Parser>::try_parse_from([
            "heapprofd report".as_ref(),
            dir.path().as_os_str(),
            "--html".as_ref(),
            page.as_os_str(),
        ])
        .expect("arguments");
        run_session_report(&args, &mut Vec::new()).expect("the page");
        let html = std::fs::read_to_string(&page).expect("the page");
        assert!(html.contains("f&lt;std::map&lt;int, int&gt;&gt;"));
        assert_eq!(
            html.matches("<option ").count(),
            5,
            "a flamegraph per profile"
        );
        assert!(html.contains("2 processes"));
        assert!(html.contains("id=\"processes\""));
    }
}
