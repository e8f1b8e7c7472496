//! `heapprofd report DIR` over a recorded session: the leak suspects, the timeline and
//! the HTML page, opened in headless Chromium (its script must run without errors and
//! its charts must be drawn in the screenshot).
//!
//! The target is tests/programs/leak_churn.c: `leak_slowly` leaks 4 KiB every 100 ms
//! beside `churn`, whose in-use goes up and down without growing. The session is
//! recorded once (500 ms interval) and shared by the tests; it stays under Cargo's
//! target tmp directory for inspection.

mod common;

use std::{
    fs::File,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use common::*;
use heapprof_daemon::report::html::{LAYOUT, Rect};

/// Chromium, from Debian's `chromium` package.
const CHROMIUM: &str = "/usr/bin/chromium";
/// The screenshot's window: wide enough for both charts side by side.
const WINDOW: (u32, u32) = (1280, 900);
/// A hang guard for one Chromium run (not a performance check).
const CHROMIUM_LIMIT: Duration = Duration::from_secs(300);
/// Least share of coloured pixels in the in-use chart's plot (stacked areas fill it).
const MIN_INUSE_COLOURED: f64 = 0.10;
/// Least share in the RSS chart's plot (the heap's in-use area and the RSS lines).
const MIN_RSS_COLOURED: f64 = 0.03;

/// The session directory, recorded on first use.
fn session() -> &'static Path {
    static SESSION: OnceLock<PathBuf> = OnceLock::new();
    SESSION.get_or_init(record)
}

fn record() -> PathBuf {
    require_root();
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("report_session");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap_or_else(|e| panic!("creating {}: {e}", root.display()));
    let program = compile(&root, "leak_churn", "leak_churn", &["-O0"]);
    let out = root.join("session");
    run_ok(
        heapprofd(&out)
            .args(["--interval", "500ms", "--"])
            .arg(&program),
    );
    let profiles = read_profiles(&out);
    // 3.5 s at 500 ms: about 7 interval profiles and the final one.
    assert!(
        profiles.len() >= 5,
        "a 3.5 s run at --interval 500ms wrote only {} profiles in {}",
        profiles.len(),
        out.display()
    );
    out
}

/// `heapprofd report ARGS`, which must succeed; its standard output.
fn report(args: &[&str]) -> String {
    let output = report_command(args);
    assert!(
        output.status.success(),
        "heapprofd report {args:?} failed ({}):\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn report_command(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_heapprofd"))
        .arg("report")
        .args(args)
        .output()
        .expect("starting heapprofd report")
}

fn session_arg() -> &'static str {
    session().to_str().expect("a UTF-8 path")
}

/// The numbered rows of the suspects table.
fn suspect_rows(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .collect()
}

#[test]
fn suspects_name_the_leak_and_not_the_churn() {
    let text = report(&[session_arg(), "--format", "suspects"]);
    let rows = suspect_rows(&text);
    assert!(!rows.is_empty(), "no suspect:\n{text}");
    assert!(
        rows[0].contains("leak_slowly"),
        "the first suspect is not leak_slowly:\n{text}"
    );
    // The program is called leak_churn; the function churn must not appear.
    assert!(
        !text.replace("leak_churn", "").contains("churn"),
        "churn is a suspect:\n{text}"
    );
}

/// A CSV line split into cells (quoted cells may hold commas and doubled quotes).
fn csv_cells(line: &str) -> Vec<String> {
    let mut cells = vec![String::new()];
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                chars.next();
                cells.last_mut().expect("a cell").push('"');
            }
            ('"', _) => quoted = !quoted,
            (',', false) => cells.push(String::new()),
            _ => cells.last_mut().expect("a cell").push(c),
        }
    }
    cells
}

/// The timeline's rows as maps from column to cell.
fn timeline_rows(text: &str) -> Vec<std::collections::HashMap<String, String>> {
    let mut lines = text.lines();
    let header = csv_cells(lines.next().expect("a header"));
    lines
        .map(|line| {
            let cells = csv_cells(line);
            assert_eq!(cells.len(), header.len(), "a row of another width: {line}");
            header.iter().cloned().zip(cells).collect()
        })
        .collect()
}

fn number(row: &std::collections::HashMap<String, String>, column: &str) -> i64 {
    row[column]
        .parse()
        .unwrap_or_else(|e| panic!("{column} of {row:?}: {e}"))
}

#[test]
fn the_timeline_shows_the_leak_rising() {
    let text = report(&[session_arg(), "--format", "timeline"]);
    let rows = timeline_rows(&text);
    let profiles = read_profiles(session()).len();
    let leak: Vec<i64> = rows
        .iter()
        .filter(|r| r["site"].contains("leak_slowly"))
        .map(|r| number(r, "inuse_bytes"))
        .collect();
    assert_eq!(
        leak.len(),
        profiles,
        "one leak_slowly row per profile:\n{text}"
    );
    assert!(
        leak.windows(2).all(|w| w[0] <= w[1]) && leak[leak.len() - 1] > leak[0],
        "leak_slowly's in-use does not rise: {leak:?}\n{text}"
    );
    let totals: Vec<_> = rows.iter().filter(|r| r["site"] == "*").collect();
    assert_eq!(
        totals.len(),
        profiles,
        "one process row per profile:\n{text}"
    );
    for total in &totals {
        assert!(
            number(total, "inuse_bytes") >= leak[0],
            "a process total below its site: {total:?}"
        );
    }
    // Once the daemon records memory figures, they are in the process rows.
    let recorded = read_profiles(session()).iter().any(|(_, p)| {
        comments(p)
            .iter()
            .any(|c| heapprof_daemon::memstats::ProcessMemory::parse_comment(c).is_some())
    });
    if recorded {
        for total in &totals {
            let (rss, anon) = (number(total, "vm_rss"), number(total, "rss_anon"));
            assert!(rss > 0 && anon > 0 && rss >= anon, "{total:?}");
        }
    }
    // --pid keeps that process only; another pid is an error naming the fix.
    let pid = totals[0]["pid"].clone();
    let one = report(&[session_arg(), "--format", "timeline", "--pid", &pid]);
    assert_eq!(one, text, "the session has only this process");
    let output = report_command(&[session_arg(), "--format", "timeline", "--pid", "1"]);
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("process 1 is in no profile"), "{stderr}");
}

#[test]
fn a_file_or_an_empty_directory_is_one_clear_error() {
    let dir = scratch();
    let file = dir.path().join("heap-20260101T000000.000Z-0001.pb.gz");
    std::fs::write(&file, b"not a profile").expect("writing");
    let output = report_command(&[file.to_str().expect("utf8"), "--format", "suspects"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("heapprofd: error: ")
            && stderr.contains("give the session's output directory"),
        "{stderr}"
    );
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    let output = report_command(&[empty.to_str().expect("utf8"), "--format", "timeline"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no profiles"), "{stderr}");
    // A corrupt profile is skipped with a warning; with nothing else left, an error.
    let output = report_command(&[dir.path().to_str().expect("utf8"), "--format", "timeline"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("warning: skipping") && stderr.contains("could be read"),
        "{stderr}"
    );
}

/// Runs Chromium headless on `page` with `args` (a fresh profile directory each time);
/// its standard output and error.
fn chromium(page: &Path, args: &[&str]) -> (String, String) {
    assert!(
        Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing: apt-get install chromium (cargo xtask setup)"
    );
    let dir = scratch();
    let (stdout_path, stderr_path) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let profile = dir.path().join("profile");
    std::fs::create_dir(&profile).expect("mkdir");
    let mut child = Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--force-device-scale-factor=1",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .stdin(Stdio::null())
        // Files, not pipes: the DOM holds the embedded flamegraphs (megabytes).
        .stdout(File::create(&stdout_path).expect("stdout file"))
        .stderr(File::create(&stderr_path).expect("stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("starting {CHROMIUM}: {e}"));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for chromium") {
            break status;
        }
        if started.elapsed() > CHROMIUM_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "chromium {args:?} hung; its log:\n{}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout =
        String::from_utf8_lossy(&std::fs::read(&stdout_path).expect("stdout")).into_owned();
    let stderr =
        String::from_utf8_lossy(&std::fs::read(&stderr_path).expect("stderr")).into_owned();
    assert!(
        status.success(),
        "chromium {args:?} failed ({status}):\n{stderr}"
    );
    (stdout, stderr)
}

/// The share of coloured pixels (not white, grey or black) in `area` of an RGB(A) PNG.
fn coloured_share(png_path: &Path, area: Rect) -> f64 {
    let file = File::open(png_path).unwrap_or_else(|e| panic!("{}: {e}", png_path.display()));
    let decoder = png::Decoder::new(std::io::BufReader::new(file));
    let mut reader = decoder
        .read_info()
        .unwrap_or_else(|e| panic!("{} is not a PNG: {e}", png_path.display()));
    let mut pixels = vec![0; reader.output_buffer_size().expect("a sane size")];
    let info = reader
        .next_frame(&mut pixels)
        .expect("decoding the screenshot");
    let channels = match (info.color_type, info.bit_depth) {
        (png::ColorType::Rgb, png::BitDepth::Eight) => 3,
        (png::ColorType::Rgba, png::BitDepth::Eight) => 4,
        other => panic!("an unexpected screenshot format: {other:?}"),
    };
    assert!(
        info.width >= area.left + area.width && info.height >= area.top + area.height,
        "the screenshot ({}x{}) does not hold {area:?}",
        info.width,
        info.height
    );
    let mut coloured = 0_u64;
    for y in area.top..area.top + area.height {
        for x in area.left..area.left + area.width {
            let at = (y as usize * info.line_size) + x as usize * channels;
            let rgb = &pixels[at..at + 3];
            let (max, min) = (rgb.iter().max(), rgb.iter().min());
            if let (Some(max), Some(min)) = (max, min)
                && max - min >= 40
            {
                coloured += 1;
            }
        }
    }
    coloured as f64 / f64::from(area.width * area.height)
}

/// Screenshots `page`; the coloured shares of the in-use and RSS plots.
fn chart_shares(page: &Path, png_path: &Path) -> (f64, f64) {
    let _ = std::fs::remove_file(png_path);
    chromium(
        page,
        &[
            // Lets the flamegraph's own script lay it out before the picture.
            "--virtual-time-budget=3000",
            &format!("--window-size={},{}", WINDOW.0, WINDOW.1),
            &format!("--screenshot={}", png_path.display()),
        ],
    );
    (
        coloured_share(png_path, LAYOUT.inuse.plot()),
        coloured_share(png_path, LAYOUT.rss.plot()),
    )
}

#[test]
fn the_html_page_renders_in_chromium() {
    // Beside the session, so that the page and screenshots stay for inspection.
    let dir = session().parent().expect("the session's parent");
    let page = dir.join("page.html");
    let output = report_command(&[session_arg(), "--html", page.to_str().expect("utf8")]);
    assert!(output.status.success(), "report --html failed: {output:?}");
    let html = std::fs::read_to_string(&page).expect("the page");
    for fetch in ["src=\"http", "href=\"http", "url(", "@import"] {
        assert!(!html.contains(fetch), "the page fetches ({fetch})");
    }
    assert!(
        html.contains("id=\"suspects\"") && html.contains("leak_slowly"),
        "no suspects table naming leak_slowly"
    );
    assert!(
        html.contains("<select id=\"flame-select\""),
        "no flamegraph switch"
    );

    // The script ran to its end, without an error (the page records errors in the DOM).
    let (dom, log) = chromium(
        &page,
        &[
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
            "--dump-dom",
        ],
    );
    let console: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("CONSOLE") || l.contains("Uncaught"))
        .collect();
    // The start tag of <html>, where the script leaves its marks.
    let html_tag = dom
        .find("<html")
        .and_then(|start| Some(&dom[start..start + dom[start..].find('>')? + 1]))
        .unwrap_or_else(|| {
            panic!(
                "no <html> in the dumped DOM: {}",
                &dom[..dom.len().min(2000)]
            )
        });
    assert!(
        console.is_empty(),
        "console messages: {console:#?}\n<html> tag: {html_tag}"
    );
    assert!(
        html_tag.contains("data-report-ready=\"yes\"") && !html_tag.contains("data-errors"),
        "the page's script did not finish cleanly: {html_tag}"
    );

    // The charts are drawn where the page lays them out.
    let (inuse, rss) = chart_shares(&page, &dir.join("page.png"));
    eprintln!(
        "coloured: in-use plot {:.1}%, RSS plot {:.1}%",
        inuse * 100.0,
        rss * 100.0
    );
    assert!(
        inuse >= MIN_INUSE_COLOURED && rss >= MIN_RSS_COLOURED,
        "charts look blank: in-use plot {:.1}% coloured (want {:.0}%), RSS plot {:.1}% (want {:.0}%); \
         screenshot {}",
        inuse * 100.0,
        MIN_INUSE_COLOURED * 100.0,
        rss * 100.0,
        MIN_RSS_COLOURED * 100.0,
        dir.join("page.png").display()
    );
    // The same page with its charts hidden fails that check: it can tell blank charts.
    let blank = dir.join("blank.html");
    std::fs::write(
        &blank,
        html.replacen(
            "</head>",
            "<style>#charts svg{visibility:hidden}</style></head>",
            1,
        ),
    )
    .expect("writing the blank page");
    let (inuse, rss) = chart_shares(&blank, &dir.join("blank.png"));
    assert!(
        inuse < MIN_INUSE_COLOURED && rss < MIN_RSS_COLOURED,
        "hidden charts pass the check: {inuse} {rss}"
    );
}
