//! Where each profile goes once written: `--profiles-json`, the push, and the
//! retention of old profiles; and the count of interval profiles that failed.

use anyhow::{Context as _, Result};

use super::AnySession;
use crate::{
    cli::{Cli, Target},
    health::bpf_log::BpfLog,
    memory_peaks,
    pprof::retention::Pruner,
    profiles_file::{Kind, ProfilesFile},
    push::{PushConfig, PushMetrics, Pusher},
    session::{ImageRead, Written},
    stats_file::PushFigures,
};

/// The destinations of a session's profiles, opened before the session is said ready.
pub(super) struct Outputs {
    profiles_file: Option<ProfilesFile>,
    pusher: Option<Pusher>,
    pruner: Pruner,
    /// Interval profiles not written (the final one's failure ends the run).
    failed_writes: u64,
}

impl Outputs {
    /// Creates `--profiles-json` and starts the push, if asked for. Before the ready
    /// file: a reader that waits for that finds these made.
    pub(super) fn open(cli: &Cli, push: Option<PushConfig>) -> Result<Self> {
        let profiles_file = match &cli.profiles_json {
            Some(path) => Some(ProfilesFile::create(path).context("--profiles-json")?),
            None => None,
        };
        let pusher = match push {
            Some(config) => {
                log::info!("pushing profiles to {}", config.describe());
                Some(Pusher::start(
                    config,
                    PushMetrics::shared(),
                    cli.push_only(),
                )?)
            }
            None => None,
        };
        Ok(Self {
            profiles_file,
            pusher,
            pruner: Pruner::new(&cli.output_dir(), cli.retention()),
            failed_writes: 0,
        })
    }

    /// Interval profiles that could not be written.
    pub(super) fn failed_writes(&self) -> u64 {
        self.failed_writes
    }

    /// Notes the exec'd images read since the last profile in `--profiles-json`.
    pub(super) fn images_read(&mut self, read: Vec<ImageRead>) {
        if let Some(file) = self.profiles_file.as_mut() {
            for image in read {
                file.append_image_read(image);
            }
        }
    }

    /// Writes an interval profile and hands it on; a failure is logged and counted,
    /// and the session goes on.
    pub(super) fn interval_profile(
        &mut self,
        session: &mut AnySession,
        bpf_log: Option<&mut BpfLog>,
        target: &Target,
    ) {
        // The dump and the tidying after it (retiring exited processes reads the live
        // table) are one heavy job: a push's build waits for both.
        let _turn = memory_peaks::one_at_a_time();
        if let Some(log) = bpf_log {
            log.flush();
        }
        match session.dump() {
            Ok(written) => {
                if let Some(file) = self.profiles_file.as_mut() {
                    file.append(&written, Kind::Interval);
                }
                if let Some(pusher) = self.pusher.as_mut() {
                    pusher.offer(&written.path);
                }
                self.pruner.after_write(&written.path);
            }
            Err(err) => {
                log::error!("cannot write a profile: {err:#}");
                self.failed_writes += 1;
                if let Some(file) = self.profiles_file.as_mut() {
                    file.append_failure(&err);
                }
            }
        }
        session.tidy(target);
    }

    /// Records the final profile in `--profiles-json` and prunes the old ones; the push
    /// waits for [`Outputs::finish_push`], after `--stats-json` has read the profile.
    pub(super) fn final_profile(&mut self, written: &Result<Written>) {
        if let Ok(written) = written {
            if let Some(file) = self.profiles_file.as_mut() {
                file.append(written, Kind::Final);
            }
            self.pruner.after_write(&written.path);
        }
    }

    /// Offers the final profile to the push and gives the pushes still waiting the
    /// push timeout to go out; returns what each target did. With `--push` alone the
    /// output directory, then empty, goes too.
    pub(super) fn finish_push(self, cli: &Cli, written: &Result<Written>) -> Vec<PushFigures> {
        let Some(mut pusher) = self.pusher else {
            return Vec::new();
        };
        if let Ok(written) = written {
            pusher.offer(&written.path);
        }
        let figures = pusher.finish();
        if cli.push_only() {
            let _ = std::fs::remove_dir(cli.output_dir());
        }
        figures
    }
}
