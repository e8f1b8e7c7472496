//! `heapprofd report`: reading profiles back and turning them into tables,
//! flamegraphs, the legacy text format, timelines, leak suspects and an HTML page.
//!
//! [`model`] reads a file; [`stacks`] names its stacks and sites; one module per
//! output format; [`directory`] handles a session's directory of profiles.

pub mod chart;
pub mod cli;
pub mod collapsed;
pub mod directory;
pub mod flamegraph;
pub mod html;
pub mod input;
pub mod legacy;
pub mod losses;
pub mod model;
pub mod peak;
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

/// Runs `heapprofd report`.
pub fn run(args: &ReportArgs) -> Result<()> {
    // Rendered whole before anything is written: a failed report leaves no partial
    // or empty -o file behind.
    let mut rendered = Vec::new();
    let session_wide =
        args.html.is_some() || matches!(args.format, Format::Timeline | Format::Suspects);
    if session_wide {
        directory::run(args, &mut rendered)?;
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
