//! Leak suspects: sites whose in-use memory keeps growing across a session.
//!
//! Each site of each process is a series of in-use values (the `--sample-index`
//! type, `inuse_space` by default), one per profile in which its process is present.
//! A site is a **suspect** when all of these hold:
//!
//! 1. at least [`MIN_PROFILES`] (3) profiles: fewer cannot tell a trend from chance;
//! 2. it grew: the last value is above the first;
//! 3. it grew steadily: Kendall's rank correlation between time and in-use,
//!    `tau = (concordant pairs - discordant pairs) / (n (n - 1) / 2)` (pairs with equal
//!    values count as neither), is at least [`MIN_TAU`] (0.6). A site that churns —
//!    allocates and frees, its in-use oscillating around a level — has a tau near 0
//!    whatever its first and last values happen to be;
//! 4. the growth is at least [`MIN_RELATIVE_GROWTH`] (10%) of the site's mean in-use,
//!    so a large steady site that drifts up a little is not flagged;
//! 5. it is still growing: the least-squares slope over the later half of its
//!    profiles (the last `ceil(n / 2)`, at least 2) is above 0. A **plateau** — a site
//!    that grew and then stayed flat, like a cache that filled up or a start-up phase
//!    — is not a suspect, even though its tau over the whole session is high; the
//!    timeline still shows it.
//!
//! **Churn** — in-use that goes up and down without growing — is never a suspect once
//! the profiles have seen its pattern repeat: a series that is periodic and spans more
//! than one period fails rule 3 or 5 (the unit tests check random periodic patterns
//! and triangle, sawtooth and sine waves sampled at every phase and rational rate). A
//! session shorter than the churn's cycle sees only a rise, which no statistic can
//! tell from a leak: profile for longer than the program's cycles.
//!
//! Suspects are ranked by **score = slope × tau**: the least-squares slope of in-use
//! over time (bytes per second over the whole series) weighted by its steadiness, so
//! a fast, steady leak comes first and a fast but erratic one falls behind.

use std::io::Write;

use anyhow::{Context as _, Result};

use super::{
    session::{Session, SiteKey},
    units,
};

/// Fewest profiles in which a site's process must be present.
pub const MIN_PROFILES: usize = 3;
/// Least Kendall's tau between time and in-use.
pub const MIN_TAU: f64 = 0.6;
/// Least growth (last minus first) as a fraction of the mean in-use.
pub const MIN_RELATIVE_GROWTH: f64 = 0.1;

/// The trend of one series.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Trend {
    /// Points in the series.
    pub points: usize,
    /// The first value.
    pub first: f64,
    /// The last value.
    pub last: f64,
    /// The mean value.
    pub mean: f64,
    /// Least-squares slope over the whole series (value per second).
    pub slope: f64,
    /// Least-squares slope over the later half.
    pub recent_slope: f64,
    /// Kendall's tau between time and value, in [-1, 1].
    pub tau: f64,
}

/// Why a series is, or is not, a suspect.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// A suspect, with its score (slope × tau).
    Suspect(f64),
    /// Fewer than [`MIN_PROFILES`] points.
    TooFewProfiles,
    /// The last value is not above the first.
    DidNotGrow,
    /// Tau is below [`MIN_TAU`]: it went up and down (churn, noise).
    Unsteady,
    /// The growth is under [`MIN_RELATIVE_GROWTH`] of the mean.
    SmallGrowth,
    /// It grew, then stopped: flat or falling over the later half (a plateau).
    Stopped,
}

impl Trend {
    /// The trend of `series`, (seconds, value) in time order.
    pub fn of(series: &[(f64, f64)]) -> Self {
        let points = series.len();
        let first = series.first().map_or(0.0, |p| p.1);
        let last = series.last().map_or(0.0, |p| p.1);
        let mean = if points == 0 {
            0.0
        } else {
            series.iter().map(|p| p.1).sum::<f64>() / points as f64
        };
        let later = points.div_ceil(2).max(2).min(points);
        Self {
            points,
            first,
            last,
            mean,
            slope: slope(series),
            recent_slope: slope(&series[points - later..]),
            tau: kendall_tau(series),
        }
    }

    /// Whether this trend makes a suspect; see the module's documentation.
    pub fn verdict(&self) -> Verdict {
        let growth = self.last - self.first;
        if self.points < MIN_PROFILES {
            Verdict::TooFewProfiles
        } else if growth <= 0.0 {
            Verdict::DidNotGrow
        } else if self.tau.is_nan() || self.tau < MIN_TAU {
            Verdict::Unsteady
        } else if growth < MIN_RELATIVE_GROWTH * self.mean {
            Verdict::SmallGrowth
        } else if self.recent_slope.is_nan() || self.recent_slope <= 0.0 {
            Verdict::Stopped
        } else if self.slope.is_nan() || self.slope <= 0.0 {
            // Growth with a non-positive slope: the times do not advance.
            Verdict::Unsteady
        } else {
            Verdict::Suspect(self.slope * self.tau)
        }
    }
}

/// The least-squares slope of value over time; NaN for fewer than 2 distinct times.
pub fn slope(series: &[(f64, f64)]) -> f64 {
    let n = series.len() as f64;
    if series.len() < 2 {
        return f64::NAN;
    }
    let mean_t = series.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = series.iter().map(|p| p.1).sum::<f64>() / n;
    let (mut covariance, mut variance) = (0.0, 0.0);
    for &(t, y) in series {
        covariance += (t - mean_t) * (y - mean_y);
        variance += (t - mean_t) * (t - mean_t);
    }
    if variance == 0.0 {
        f64::NAN
    } else {
        covariance / variance
    }
}

/// Kendall's tau-a between time and value: (concordant - discordant) pairs over all
/// pairs; ties in either count as neither. NaN for fewer than 2 points. O(n²), which
/// is fine for the hundreds of profiles a session has.
pub fn kendall_tau(series: &[(f64, f64)]) -> f64 {
    let n = series.len();
    if n < 2 {
        return f64::NAN;
    }
    let mut balance: i64 = 0;
    for (i, a) in series.iter().enumerate() {
        for b in &series[i + 1..] {
            let product = (b.0 - a.0) * (b.1 - a.1);
            if product > 0.0 {
                balance += 1;
            } else if product < 0.0 {
                balance -= 1;
            }
        }
    }
    balance as f64 / (n * (n - 1) / 2) as f64
}

/// A site found to grow.
#[derive(Debug, Clone, PartialEq)]
pub struct Suspect {
    /// The process and site.
    pub key: SiteKey,
    /// Its trend.
    pub trend: Trend,
    /// slope × tau.
    pub score: f64,
}

/// The suspects of a session, highest score first (ties: larger growth, then pid and
/// site), at most `limit` (0: all).
pub fn find(session: &Session, limit: usize) -> Vec<Suspect> {
    let mut suspects: Vec<Suspect> = session
        .site_keys()
        .into_iter()
        .filter_map(|key| {
            let series: Vec<(f64, f64)> = session
                .site_series(key)
                .into_iter()
                .map(|(t, v)| (t, v.tracked as f64))
                .collect();
            let trend = Trend::of(&series);
            match trend.verdict() {
                Verdict::Suspect(score) => Some(Suspect { key, trend, score }),
                _ => None,
            }
        })
        .collect();
    suspects.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then_with(|| (b.trend.last - b.trend.first).total_cmp(&(a.trend.last - a.trend.first)))
            .then_with(|| {
                session
                    .site_name(a.key.site)
                    .cmp(session.site_name(b.key.site))
            })
            .then_with(|| a.key.cmp(&b.key))
    });
    if limit > 0 {
        suspects.truncate(limit);
    }
    suspects
}

/// How the tracked type's values print: bytes for `*_space`, plain counts otherwise.
pub fn amount(tracked: &str, value: f64) -> String {
    if tracked.ends_with("space") {
        units::bytes(value)
    } else {
        format!("{value:.0}")
    }
}

/// Writes the suspects as a table: rank, pid, growth (first -> last), slope per
/// second, tau, site.
pub fn write_table(session: &Session, limit: usize, out: &mut dyn Write) -> Result<()> {
    let suspects = find(session, limit);
    let profiles = session.snapshots.len();
    let mut text = preamble(session);
    let undercounted = super::losses::frees_undercounted(&session.last.comments);
    if suspects.is_empty() {
        text.push_str(if profiles < MIN_PROFILES {
            "No suspects: a trend needs at least 3 profiles; profile longer or with a shorter --interval.\n"
        } else {
            "No suspects: no site's in-use grew steadily across the session.\n"
        });
    } else {
        let rows: Vec<[String; 6]> = suspects
            .iter()
            .enumerate()
            .map(|(rank, suspect)| table_row(session, rank + 1, suspect, undercounted))
            .collect();
        push_aligned(&mut text, &rows);
    }
    out.write_all(text.as_bytes())
        .context("writing the suspects")
}

/// The lines above the table: what was searched and by which rules, then the
/// session's losses.
fn preamble(session: &Session) -> String {
    let tracked = &session.tracked;
    let profiles = session.snapshots.len();
    let mut text = format!(
        "Leak suspects in {}: sites whose {tracked} grew steadily over {profiles} profile{} ({}).\n\
         Score = slope x tau (Kendall's rank correlation of {tracked} with time); suspects need \
         tau >= {MIN_TAU}, growth >= {:.0}% of their mean, growth in the later half, and {MIN_PROFILES}+ profiles.\n",
        session.dir.display(),
        if profiles == 1 { "" } else { "s" },
        units::seconds(session.span_seconds()),
        MIN_RELATIVE_GROWTH * 100.0,
    );
    for loss in super::losses::losses(&session.last.comments) {
        text.push_str(&loss.line());
        text.push('\n');
    }
    text
}

/// The cells of the suspect ranked `rank`; its site marked when the session's frees
/// were undercounted (then its growth may be frees heapprofd missed).
fn table_row(session: &Session, rank: usize, suspect: &Suspect, undercounted: bool) -> [String; 6] {
    let tracked = &session.tracked;
    let t = &suspect.trend;
    [
        rank.to_string(),
        suspect.key.pid.to_string(),
        format!(
            "{} -> {} ({})",
            amount(tracked, t.first),
            amount(tracked, t.last),
            if tracked.ends_with("space") {
                units::bytes_change(t.last - t.first)
            } else {
                format!("{:+.0}", t.last - t.first)
            }
        ),
        format!("{}/s", amount(tracked, t.slope)),
        format!("{:.2}", t.tau),
        if undercounted {
            format!(
                "{} ({})",
                session.site_name(suspect.key.site),
                super::losses::FREES_UNDERCOUNTED
            )
        } else {
            session.site_name(suspect.key.site).to_owned()
        },
    ]
}

/// Appends the header and `rows`, each column as wide as its widest cell (the
/// growth column left-aligned, the numbers right-aligned, the site last, unpadded).
fn push_aligned(text: &mut String, rows: &[[String; 6]]) {
    let header = [
        "rank",
        "pid",
        "growth (first -> last)",
        "slope",
        "tau",
        "site",
    ];
    let widths: Vec<usize> = (0..5)
        .map(|c| {
            rows.iter()
                .map(|r| r[c].chars().count())
                .chain([header[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: [&str; 6]| {
        format!(
            "{:>w0$}  {:>w1$}  {:<w2$}  {:>w3$}  {:>w4$}  {}\n",
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            cells[4],
            cells[5],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
            w3 = widths[3],
            w4 = widths[4],
        )
    };
    text.push_str(&line(header));
    for row in rows {
        text.push_str(&line([
            &row[0], &row[1], &row[2], &row[3], &row[4], &row[5],
        ]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::session::tests::session;

    /// A series with one point per second.
    fn per_second(values: &[f64]) -> Vec<(f64, f64)> {
        values
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as f64, v))
            .collect()
    }

    fn verdict(values: &[f64]) -> Verdict {
        Trend::of(&per_second(values)).verdict()
    }

    #[test]
    fn the_statistics() {
        let line = per_second(&[0.0, 2.0, 4.0, 6.0]);
        assert!((slope(&line) - 2.0).abs() < 1e-9);
        assert!((kendall_tau(&line) - 1.0).abs() < 1e-9);
        let down = per_second(&[3.0, 2.0, 1.0]);
        assert!((kendall_tau(&down) + 1.0).abs() < 1e-9);
        // Ties count as neither: 0,1,1 has 2 concordant pairs of 3.
        assert!((kendall_tau(&per_second(&[0.0, 1.0, 1.0])) - 2.0 / 3.0).abs() < 1e-9);
        assert!(slope(&[(1.0, 5.0)]).is_nan());
        assert!(slope(&[(1.0, 5.0), (1.0, 6.0)]).is_nan());
    }

    #[test]
    fn a_steady_leak_is_a_suspect() {
        let leak: Vec<f64> = (0..10).map(|i| 4096.0 * f64::from(i)).collect();
        let trend = Trend::of(&per_second(&leak));
        assert_eq!(trend.verdict(), Verdict::Suspect(4096.0));
        // Even on top of a large constant base, when it adds 10% of the mean.
        let based: Vec<f64> = (0..10).map(|i| 100_000.0 + 4096.0 * f64::from(i)).collect();
        assert!(matches!(verdict(&based), Verdict::Suspect(_)));
        // Three profiles are enough; two are not.
        assert!(matches!(verdict(&[1.0, 2.0, 3.0]), Verdict::Suspect(_)));
        assert_eq!(verdict(&[1.0, 2.0]), Verdict::TooFewProfiles);
    }

    #[test]
    fn a_leak_with_noise_is_a_suspect_ranked_below_a_clean_one() {
        // 1000 bytes a second plus churn of up to ±700 bytes (a fixed pseudo-random pattern).
        let noise = [
            300.0, -700.0, 650.0, -200.0, 0.0, 500.0, -600.0, 250.0, -400.0, 700.0,
        ];
        let noisy: Vec<f64> = noise
            .iter()
            .enumerate()
            .map(|(i, n)| 5000.0 + 1000.0 * i as f64 + n)
            .collect();
        let trend = Trend::of(&per_second(&noisy));
        let Verdict::Suspect(score) = trend.verdict() else {
            panic!("{trend:?} is {:?}", trend.verdict());
        };
        assert!(trend.tau < 1.0 && trend.tau >= MIN_TAU, "{trend:?}");
        let clean: Vec<f64> = (0..10).map(|i| 5000.0 + 1000.0 * f64::from(i)).collect();
        let Verdict::Suspect(clean_score) = verdict(&clean) else {
            panic!("clean");
        };
        assert!(score < clean_score, "{score} vs {clean_score}");
    }

    /// A series repeating `pattern` from `start`, `length` points long.
    fn periodic(pattern: &[f64], start: usize, length: usize) -> Vec<f64> {
        (0..length)
            .map(|i| pattern[(start + i) % pattern.len()])
            .collect()
    }

    #[test]
    fn churn_is_never_a_suspect() {
        // Oscillating, ending high: the first and last values alone would say "grew".
        let alternating = periodic(&[1000.0, 9000.0], 0, 10);
        assert_eq!(verdict(&alternating), Verdict::Unsteady);
        // Freed between profiles: always 0.
        assert_eq!(verdict(&[0.0; 8]), Verdict::DidNotGrow);

        // Waves sampled at every rational step a/b (b <= 16) and phase: the samples
        // repeat every b profiles; once the session sees more than one repetition,
        // never a suspect.
        type Wave = fn(f64) -> f64;
        let waves: [(&str, Wave); 3] = [
            ("triangle", |x| {
                let phase = x.rem_euclid(1.0);
                if phase < 0.5 { phase } else { 1.0 - phase }
            }),
            ("sawtooth", |x| x.rem_euclid(1.0)),
            ("sine", |x| 0.5 + 0.5 * (std::f64::consts::TAU * x).sin()),
        ];
        for (name, wave) in waves {
            for b in 2..=16_u32 {
                for a in 1..b {
                    let step = f64::from(a) / f64::from(b);
                    for phase in 0..7 {
                        let offset = f64::from(phase) / 7.0 / f64::from(b);
                        let pattern: Vec<f64> = (0..b)
                            .map(|i| 1e5 + 1e6 * wave(step * f64::from(i) + offset))
                            .collect();
                        for length in b as usize + 1..=3 * b as usize {
                            let values = periodic(&pattern, 0, length);
                            let verdict = verdict(&values);
                            assert!(
                                !matches!(verdict, Verdict::Suspect(_)),
                                "{name} at step {a}/{b}, {length} profiles: {values:?} is {verdict:?}"
                            );
                        }
                    }
                }
            }
        }

        // Random periodic patterns (a fixed xorshift sequence), the same way.
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut random = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        for _ in 0..3000 {
            let period = 2 + (random() * 11.0) as usize;
            let mut pattern: Vec<f64> = (0..period).map(|_| random() * 1e6).collect();
            if random() < 0.5 {
                // Mostly rising, then a drop: the hardest shape.
                pattern.sort_by(f64::total_cmp);
            }
            let start = (random() * period as f64) as usize;
            for length in period + 1..=3 * period + 1 {
                let values = periodic(&pattern, start, length);
                let verdict = verdict(&values);
                assert!(
                    !matches!(verdict, Verdict::Suspect(_)),
                    "{values:?} is {verdict:?}"
                );
            }
        }

        // tests/programs/leak_churn.c's churn: a triangle of 13 steps of 100 ms seen
        // every 500 ms, from 4 profiles on (3 can catch its rise only).
        let churn = |x: f64| {
            let phase = x.rem_euclid(1.0);
            if phase < 0.5 { phase } else { 1.0 - phase }
        };
        for start in 0..13 {
            for length in 4..40 {
                let values: Vec<f64> = (0..length)
                    .map(|i| 1e6 * (0.5 + churn((5.0 * f64::from(i) + f64::from(start)) / 13.0)))
                    .collect();
                let verdict = verdict(&values);
                assert!(
                    !matches!(verdict, Verdict::Suspect(_)),
                    "start {start}: {values:?} is {verdict:?}"
                );
            }
        }
    }

    #[test]
    fn a_plateau_is_not_a_suspect() {
        // Grew for the first half, then flat: a cache that filled up.
        let plateau = [0.0, 10.0, 20.0, 30.0, 40.0, 40.0, 40.0, 40.0, 40.0, 40.0];
        let trend = Trend::of(&per_second(&plateau));
        assert!(trend.tau >= MIN_TAU, "tau alone would flag it: {trend:?}");
        assert_eq!(trend.verdict(), Verdict::Stopped);
    }

    #[test]
    fn a_shrinking_site_is_not_a_suspect() {
        let shrinking: Vec<f64> = (0..10).map(|i| 50_000.0 - 4096.0 * f64::from(i)).collect();
        assert_eq!(verdict(&shrinking), Verdict::DidNotGrow);
        // A small rise over a big level is drift, not a leak.
        assert_eq!(
            verdict(&[100_000.0, 100_500.0, 101_000.0, 101_500.0]),
            Verdict::SmallGrowth
        );
    }

    #[test]
    fn the_table_ranks_the_leak_first() {
        let s = session(
            &[
                "malloc in leak <- main",
                "malloc in churn <- main",
                "malloc in slow <- main",
            ],
            &[
                vec![0, 4096, 8192, 12288, 16384],
                vec![9000, 100, 9000, 100, 9000],
                vec![100, 200, 300, 400, 500],
            ],
        );
        let mut out = Vec::new();
        write_table(&s, 20, &mut out).expect("written");
        let text = String::from_utf8(out).expect("utf8");
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
            .collect();
        assert_eq!(rows.len(), 2, "{text}");
        assert!(
            rows[0].contains("leak") && rows[0].contains("0 B -> 16.0 KiB"),
            "{text}"
        );
        assert!(rows[1].contains("slow"), "{text}");
        assert!(!text.contains("churn"), "{text}");
        let mut out = Vec::new();
        write_table(&session(&["a"], &[vec![1, 2]]), 20, &mut out).expect("written");
        assert!(String::from_utf8_lossy(&out).contains("at least 3 profiles"));
    }

    #[test]
    fn the_table_states_what_the_last_profile_lost() {
        let mut s = session(&["a"], &[vec![1, 2, 3]]);
        let full = heapprof_common::DropReason::SiteTableFull.describe();
        s.last.comments.push(format!("dropped: {full} = 7"));
        let mut out = Vec::new();
        write_table(&s, 20, &mut out).expect("written");
        let text = String::from_utf8_lossy(&out);
        assert!(
            text.contains(&format!("lost: 7 events: {full} (raise --max-sites)")),
            "{text}"
        );
        assert!(
            !text.contains(crate::report::losses::FREES_UNDERCOUNTED),
            "{text}"
        );
    }

    #[test]
    fn every_row_says_when_frees_are_undercounted() {
        let mut s = session(
            &[
                "kmem_cache_alloc in do_epoll_ctl",
                "kmalloc in alloc_pipe_info",
            ],
            &[vec![0, 4096, 8192, 12288], vec![100, 200, 300, 400]],
        );
        s.last.comments.push(
            "undercounted: objects released with kfree_rcu() or freed in bulk ...".to_owned(),
        );
        let mut out = Vec::new();
        write_table(&s, 20, &mut out).expect("written");
        let text = String::from_utf8(out).expect("utf8");
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
            .collect();
        assert_eq!(rows.len(), 2, "{text}");
        for row in rows {
            assert!(
                row.ends_with(&format!("({})", crate::report::losses::FREES_UNDERCOUNTED)),
                "{text}"
            );
        }
    }
}
