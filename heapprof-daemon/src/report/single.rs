//! Reports of one profile (or the newest in a directory): top, collapsed, flamegraph,
//! legacy; the first three also as the difference from a base profile.

use std::{io::Write, path::Path};

use anyhow::{Context as _, Result, bail};

use super::{
    Format, ReportArgs, collapsed, flamegraph, input, legacy,
    model::Profile,
    sizes,
    stacks::{self, ProcessFilter},
    top,
};

/// Writes the report of one profile.
pub fn run(args: &ReportArgs, out: &mut dyn Write) -> Result<()> {
    let profile = load(&args.input)?;
    let index = profile.sample_index(&args.sample_index)?;
    let base = match &args.base {
        Some(path) => Some(load_base(path, &profile)?),
        None => None,
    };
    let filter = process_filter(&profile, base.as_ref(), args.pid)?;
    if matches!(
        args.format,
        Format::Collapsed | Format::Flamegraph | Format::Legacy
    ) {
        // These formats have no place for it: said on standard error, as the
        // timeline does.
        for loss in super::losses::losses(&profile.comments) {
            eprintln!("heapprofd: {} {}", profile.path.display(), loss.line());
        }
    }
    let written = match (args.format, &base) {
        (Format::Top, None) => top::write(out, &profile, index, args.top, filter, args.by),
        (Format::Top, Some(_)) if args.by != stacks::Grouping::Site => {
            bail!(
                "--by applies to one profile, not a difference; compare sites, or leave out --base"
            )
        }
        (Format::Top, Some(base)) => top::write_diff(out, base, &profile, index, args.top, filter),
        (Format::Collapsed, None) => collapsed::write(out, &profile, index, filter),
        (Format::Collapsed, Some(base)) => {
            collapsed::write_diff(out, base, &profile, index, filter)
        }
        (Format::Flamegraph, base) => {
            let svg = draw_flamegraph(&profile, base.as_ref(), index, filter)?;
            out.write_all(&svg)
        }
        (Format::Legacy, None) => return legacy::write(out, &profile, args.pid, index),
        (Format::Legacy, Some(_)) => bail!(
            "--base does not apply to the legacy format (it holds one profile); \
             use --format top, collapsed or flamegraph for a difference"
        ),
        (Format::Sizes, None) => sizes::write(out, &profile, index, args.top, filter),
        (Format::Sizes, Some(_)) => bail!(
            "--base does not apply to the sizes format; compare sites with --format top --base"
        ),
        (Format::Timeline | Format::Suspects, _) => {
            bail!("the timeline and suspects formats read a session's directory, not one profile")
        }
    };
    written.context("writing the report")
}

/// Reads a profile, or the newest of a directory (saying which on standard error).
fn load(path: &Path) -> Result<Profile> {
    let path = input::single_profile(path, |chosen| {
        eprintln!("heapprofd: reading {}", chosen.display());
    })?;
    Ok(Profile::load(&path)?)
}

/// Reads the base of a difference, which must count the same things as `profile`.
fn load_base(path: &Path, profile: &Profile) -> Result<Profile> {
    let base = load(path)?;
    if base.sample_types != profile.sample_types {
        bail!(
            "cannot compare {} ({}) with the base {} ({}); give a base profile of the same kind",
            profile.path.display(),
            base_types(profile),
            base.path.display(),
            base_types(&base)
        );
    }
    Ok(base)
}

/// The sample types of a profile, listed.
fn base_types(profile: &Profile) -> String {
    format!("sample types {}", profile.sample_types.join(", "))
}

/// The samples `--pid` chooses, which must be in the profile (and in the base: pids of
/// different runs never match).
fn process_filter(
    profile: &Profile,
    base: Option<&Profile>,
    pid: Option<u32>,
) -> Result<ProcessFilter> {
    let Some(pid) = pid else {
        return Ok(ProcessFilter::All);
    };
    for side in std::iter::once(profile).chain(base) {
        let pids = side.pids();
        if !pids.contains(&pid) {
            bail!(
                "pid {pid} is not in {}; it holds {}",
                side.path.display(),
                legacy::list_pids(&pids)
            );
        }
    }
    Ok(ProcessFilter::Pid(pid))
}

/// A flamegraph SVG titled with the file and sample type; differential with a base.
fn draw_flamegraph(
    profile: &Profile,
    base: Option<&Profile>,
    index: usize,
    filter: ProcessFilter,
) -> Result<Vec<u8>> {
    let sample_type = &profile.sample_types[index];
    let unit = unit_of(sample_type);
    let svg = match base {
        None => {
            let stacks: Vec<(String, i64)> =
                stacks::folded(profile, index, filter).into_iter().collect();
            let title = format!("{sample_type} of {}", file_name(&profile.path));
            flamegraph::render(&stacks, &title, unit)
        }
        Some(base) => {
            let stacks = stacks::folded_diff(base, profile, index, filter);
            let title = format!(
                "{sample_type}: {} compared with {}",
                file_name(&profile.path),
                file_name(&base.path)
            );
            flamegraph::render_diff(&stacks, &title, unit)
        }
    };
    svg.context("drawing the flamegraph")
}

/// What a sample type counts, for the flamegraph's tooltips.
fn unit_of(sample_type: &str) -> &'static str {
    if sample_type.ends_with("_space") {
        "bytes"
    } else if sample_type.ends_with("_objects") {
        "objects"
    } else {
        "samples"
    }
}

/// The file name of a path (the whole path if it has none).
fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use clap::Parser as _;

    use super::*;

    /// Writes `profile` gzip'd into `dir` as `name`, as the daemon would.
    fn save(dir: &Path, name: &str, profile: &crate::pprof::proto::Profile) -> PathBuf {
        use prost::Message as _;
        let path = dir.join(name);
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder
            .write_all(&profile.encode_to_vec())
            .expect("compressing");
        std::fs::write(&path, encoder.finish().expect("compressing")).expect("writing");
        path
    }

    /// The message behind a test profile (the builder's, rebuilt from the samples).
    fn message(samples: &[(u32, &[&str], [u64; 4])]) -> crate::pprof::proto::Profile {
        crate::report::test_profiles::message(samples, 1)
    }

    fn report(args: &[&str]) -> Result<String> {
        let args =
            ReportArgs::try_parse_from(std::iter::once("report").chain(args.iter().copied()))
                .expect("valid flags");
        let mut out = Vec::new();
        run(&args, &mut out)?;
        Ok(String::from_utf8(out).expect("utf8"))
    }

    fn error(args: &[&str]) -> String {
        let err = report(args).expect_err("an error");
        let message = format!("{err:#}");
        assert!(!message.contains('\n'), "one line: {message}");
        message
    }

    #[test]
    fn every_format_of_a_file_and_of_a_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let abc = [
            (4242, &["malloc", "b", "a", "main"][..], [1, 100, 1, 100]),
            (4242, &["malloc", "a", "main"][..], [1, 1000, 1, 1000]),
            (4242, &["malloc", "b", "main"][..], [1, 100, 1, 100]),
        ];
        save(
            dir.path(),
            "heap-20260101T000000.000Z-0001.pb.gz",
            &message(&abc[..1]),
        );
        let newest = save(
            dir.path(),
            "heap-20260101T000001.000Z-0002.pb.gz",
            &message(&abc),
        );
        let newest = newest.to_str().expect("utf8 path");
        let dir_path = dir.path().to_str().expect("utf8 path");

        let top = report(&[dir_path]).expect("top");
        assert!(
            top.contains("        1000         1          1000          1  malloc in a <- main\n"),
            "{top}"
        );
        assert!(top.contains(newest), "names the newest file: {top}");
        let collapsed = report(&[newest, "--format", "collapsed"]).expect("collapsed");
        assert_eq!(
            collapsed,
            "main;a;b;malloc 100\nmain;a;malloc 1000\nmain;b;malloc 100\n"
        );
        let svg = report(&[
            newest,
            "--format",
            "flamegraph",
            "--sample-index",
            "alloc_objects",
        ])
        .expect("flamegraph");
        assert!(svg.contains("alloc_objects of heap-20260101T000001.000Z-0002.pb.gz"));
        assert!(svg.contains(">malloc<"), "{svg}");
        let legacy = report(&[newest, "--format", "legacy"]).expect("legacy");
        assert!(
            legacy.starts_with("heap profile:      3:     1200"),
            "{legacy}"
        );

        let oldest = dir.path().join("heap-20260101T000000.000Z-0001.pb.gz");
        let oldest = oldest.to_str().expect("utf8 path");
        let diff = report(&[newest, "--base", oldest, "--format", "collapsed"]).expect("diff");
        assert_eq!(
            diff,
            "main;a;b;malloc 100 100\nmain;a;malloc 0 1000\nmain;b;malloc 0 100\n"
        );
        let diff_top = report(&[newest, "--base", oldest]).expect("diff top");
        assert!(
            diff_top
                .contains("       +1000        +1         +1000         +1  malloc in a <- main\n"),
            "{diff_top}"
        );
        assert!(
            !diff_top.contains("b <- a"),
            "unchanged sites are left out: {diff_top}"
        );
        let diff_svg =
            report(&[newest, "--base", oldest, "--format", "flamegraph"]).expect("diff svg");
        assert!(diff_svg.contains("compared with heap-20260101T000000.000Z-0001.pb.gz"));
    }

    #[test]
    fn bad_input_is_one_line_naming_the_fix() {
        let dir = tempfile::tempdir().expect("tempdir");
        let text = dir.path().join("notes.txt");
        std::fs::write(&text, "not a profile\n").expect("writing");
        let text = text.to_str().expect("utf8 path");
        assert!(error(&[text]).contains("is not a pprof profile"));
        let corrupt = dir.path().join("corrupt.pb.gz");
        std::fs::write(&corrupt, [0x1f, 0x8b, 8, 0, 0, 0]).expect("writing");
        assert!(error(&[corrupt.to_str().expect("utf8")]).contains("bad gzip data"));
        let missing = dir.path().join("missing.pb.gz");
        assert!(error(&[missing.to_str().expect("utf8")]).contains("cannot read"));
        let empty = tempfile::tempdir().expect("tempdir");
        assert!(error(&[empty.path().to_str().expect("utf8")]).contains("holds no profile"));

        let one = save(
            dir.path(),
            "one.pb.gz",
            &message(&[(7, &["malloc", "main"][..], [1, 8, 1, 8])]),
        );
        let two = save(
            dir.path(),
            "two.pb.gz",
            &message(&[
                (7, &["malloc", "main"][..], [1, 8, 1, 8]),
                (9, &["malloc", "a", "main"][..], [1, 8, 1, 8]),
            ]),
        );
        let (one, two) = (one.to_str().expect("utf8"), two.to_str().expect("utf8"));
        let unknown = error(&[one, "--sample-index", "bogus"]);
        assert!(
            unknown.contains("no sample type bogus; it has alloc_objects"),
            "{unknown}"
        );
        let pid = error(&[one, "--pid", "8"]);
        assert!(
            pid.contains("pid 8 is not in") && pid.contains("pids 7"),
            "{pid}"
        );
        let base_pid = error(&[two, "--base", one, "--pid", "9"]);
        assert!(
            base_pid.contains(&format!("pid 9 is not in {one}")),
            "{base_pid}"
        );
        let several = error(&[two, "--format", "legacy"]);
        assert!(
            several.contains("pids 7, 9") && several.contains("--pid"),
            "{several}"
        );
        assert!(report(&[two, "--format", "legacy", "--pid", "9"]).is_ok());
        let legacy_base = error(&[two, "--format", "legacy", "--base", one]);
        assert!(
            legacy_base.contains("--base does not apply"),
            "{legacy_base}"
        );
    }

    #[test]
    fn a_base_must_count_the_same_things() {
        let dir = tempfile::tempdir().expect("tempdir");
        let user = save(
            dir.path(),
            "user.pb.gz",
            &message(&[(7, &["malloc", "main"][..], [1, 8, 1, 8])]),
        );
        let mut kernel =
            crate::pprof::ProfileBuilder::new(1, 2, &crate::pprof::builder::KERNEL_SAMPLE_TYPES);
        let location = kernel.location(0, 0x10, 0, None, &[]);
        kernel.sample(&[location], &[1, 8, 1, 8, 8, 8], &[]);
        let kernel = save(dir.path(), "kernel.pb.gz", &kernel.finish().expect("valid"));
        let message = error(&[
            user.to_str().expect("utf8"),
            "--base",
            kernel.to_str().expect("utf8"),
        ]);
        assert!(
            message.contains("cannot compare") && message.contains("inuse_requested_space"),
            "{message}"
        );
    }

    #[test]
    fn units_follow_the_sample_type() {
        assert_eq!(unit_of("inuse_space"), "bytes");
        assert_eq!(unit_of("alloc_objects"), "objects");
        assert_eq!(unit_of("inuse_requested_space"), "bytes");
    }
}
