//! Time charts as inline SVG, drawn in Rust so that the HTML page needs no script to
//! show them: stacked areas (in-use by site or process), lines over them (RSS), a
//! marked point (the peak), axes with round ticks.

use std::fmt::Write as _;

use super::units::{self, escape_html};

/// Space around the plot inside a chart, in pixels: left, right, top, bottom.
pub const MARGINS: (u32, u32, u32, u32) = (76, 16, 36, 34);

/// A filled band or a line.
#[derive(Debug, Clone)]
pub struct Series {
    /// Its name (legend, tooltip).
    pub label: String,
    /// One value per time; `None` where not recorded (lines only: a gap).
    pub values: Vec<Option<f64>>,
    /// A CSS colour.
    pub color: String,
    /// Dashed (lines only).
    pub dashed: bool,
}

/// A point to mark, with a label.
#[derive(Debug, Clone)]
pub struct Marker {
    /// When.
    pub seconds: f64,
    /// The value.
    pub value: f64,
    /// The text beside it.
    pub label: String,
}

/// What the values count: bytes get binary-unit ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Bytes.
    Bytes,
    /// Objects or other counts.
    Count,
}

/// A chart of values over time.
#[derive(Debug, Clone)]
pub struct Chart {
    /// The `id` of the `<svg>` element.
    pub id: String,
    /// The title above the plot.
    pub title: String,
    /// Size in pixels.
    pub width: u32,
    /// Size in pixels.
    pub height: u32,
    /// Seconds since the session's first profile, one per point, increasing.
    pub times: Vec<f64>,
    /// Filled bands stacked from the bottom, in order.
    pub stacked: Vec<Series>,
    /// Lines drawn over the bands, not stacked.
    pub lines: Vec<Series>,
    /// A point to mark.
    pub marker: Option<Marker>,
    /// A note written over the plot (e.g. what was not recorded).
    pub note: Option<String>,
    /// What the values count.
    pub unit: Unit,
}

/// Maps data to pixels.
struct Scale {
    left: f64,
    top: f64,
    width: f64,
    height: f64,
    t0: f64,
    t1: f64,
    max: f64,
}

impl Scale {
    fn x(&self, t: f64) -> f64 {
        self.left + (t - self.t0) / (self.t1 - self.t0) * self.width
    }

    fn y(&self, value: f64) -> f64 {
        self.top + self.height - (value / self.max).clamp(0.0, 1.0) * self.height
    }
}

/// A round step near `raw`: 1, 2 or 5 times a power of ten.
fn nice_step(raw: f64) -> f64 {
    if raw <= 0.0 || !raw.is_finite() {
        return 1.0;
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    let fraction = raw / magnitude;
    let nice = if fraction <= 1.0 {
        1.0
    } else if fraction <= 2.0 {
        2.0
    } else if fraction <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

/// A round step for about 5 ticks up to `max`, in `unit`'s terms (bytes: round in
/// KiB, MiB... rather than in decimal).
fn value_step(max: f64, unit: Unit) -> f64 {
    match unit {
        Unit::Count => nice_step(max / 5.0),
        Unit::Bytes => {
            let mut scale = 1.0;
            while max / scale >= 1024.0 {
                scale *= 1024.0;
            }
            nice_step(max / scale / 5.0) * scale
        }
    }
}

fn value_label(value: f64, unit: Unit) -> String {
    match unit {
        Unit::Bytes => units::bytes(value),
        Unit::Count => format!("{value:.0}"),
    }
}

impl Chart {
    /// The sums of the stacked bands at each time.
    fn stack_tops(&self) -> Vec<f64> {
        (0..self.times.len())
            .map(|i| {
                self.stacked
                    .iter()
                    .map(|s| s.values.get(i).copied().flatten().unwrap_or(0.0).max(0.0))
                    .sum()
            })
            .collect()
    }

    /// The chart as an `<svg>` element.
    pub fn svg(&self) -> String {
        let (ml, mr, mt, mb) = MARGINS;
        let tops = self.stack_tops();
        let line_max = self
            .lines
            .iter()
            .flat_map(|s| s.values.iter().flatten().copied())
            .fold(0.0, f64::max);
        let data_max = tops
            .iter()
            .copied()
            .fold(line_max, f64::max)
            .max(self.marker.as_ref().map_or(0.0, |m| m.value));
        let step = value_step(data_max.max(1.0), self.unit);
        let max = ((data_max.max(1.0) * 1.05) / step).ceil() * step;
        let (mut t0, mut t1) = (
            self.times.first().copied().unwrap_or(0.0),
            self.times.last().copied().unwrap_or(0.0),
        );
        if t1 <= t0 {
            // One profile: a span around it, drawn as a bar.
            t0 -= 0.5;
            t1 = t0 + 1.0;
        }
        let scale = Scale {
            left: f64::from(ml),
            top: f64::from(mt),
            width: f64::from(self.width - ml - mr),
            height: f64::from(self.height - mt - mb),
            t0,
            t1,
            max,
        };
        let mut svg = format!(
            "<svg id=\"{}\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" \
             viewBox=\"0 0 {} {}\" font-family=\"sans-serif\" font-size=\"11\">\
             <rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\
             <text x=\"{}\" y=\"20\" font-size=\"14\" font-weight=\"bold\">{}</text>",
            escape_html(&self.id),
            self.width,
            self.height,
            self.width,
            self.height,
            ml,
            escape_html(&self.title)
        );
        self.axes(&mut svg, &scale, step);
        self.bands(&mut svg, &scale);
        for line in &self.lines {
            draw_line(&mut svg, &scale, &self.times, line);
        }
        if let Some(marker) = &self.marker {
            draw_marker(&mut svg, &scale, marker);
        }
        if let Some(note) = &self.note {
            let _ = write!(
                svg,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"13\" fill=\"#555\">{}</text>",
                scale.left + scale.width / 2.0,
                scale.top + 18.0,
                escape_html(note)
            );
        }
        svg.push_str("</svg>");
        svg
    }

    /// Grid lines, tick labels and the frame.
    fn axes(&self, svg: &mut String, scale: &Scale, step: f64) {
        let mut value = 0.0;
        while value <= scale.max + step / 2.0 {
            let y = scale.y(value);
            let _ = write!(
                svg,
                "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#eee\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#444\">{}</text>",
                scale.left,
                scale.left + scale.width,
                scale.left - 6.0,
                y + 4.0,
                value_label(value, self.unit)
            );
            value += step;
        }
        let span = scale.t1 - scale.t0;
        let t_step = nice_step(span / 6.0);
        let mut t = (scale.t0 / t_step).ceil() * t_step;
        // Only times the profiles cover (one profile gets a span around it).
        let first = self.times.first().copied().unwrap_or(scale.t0);
        let last = self.times.last().copied().unwrap_or(scale.t1);
        while t <= scale.t1 + t_step * 1e-9 {
            if t < first - t_step * 1e-9 || t > last + t_step * 1e-9 {
                t += t_step;
                continue;
            }
            let x = scale.x(t);
            let _ = write!(
                svg,
                "<line x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#444\"/>\
                 <text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#444\">{}</text>",
                scale.top + scale.height,
                scale.top + scale.height + 4.0,
                scale.top + scale.height + 16.0,
                units::seconds(t)
            );
            t += t_step;
        }
        let _ = write!(
            svg,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#444\">since the first profile</text>\
             <rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"none\" stroke=\"#444\"/>",
            scale.left + scale.width,
            scale.top + scale.height + 30.0,
            scale.left,
            scale.top,
            scale.width,
            scale.height
        );
    }

    /// The stacked bands: polygons, or bars for a single profile.
    fn bands(&self, svg: &mut String, scale: &Scale) {
        let n = self.times.len();
        let mut below = vec![0.0; n];
        for band in &self.stacked {
            let above: Vec<f64> = (0..n)
                .map(|i| {
                    below[i]
                        + band
                            .values
                            .get(i)
                            .copied()
                            .flatten()
                            .unwrap_or(0.0)
                            .max(0.0)
                })
                .collect();
            let title = format!("<title>{}</title>", escape_html(&band.label));
            if n == 1 {
                let x = scale.x(self.times[0]);
                let _ = write!(
                    svg,
                    "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\">{title}</rect>",
                    x - scale.width * 0.2,
                    scale.y(above[0]),
                    scale.width * 0.4,
                    (scale.y(below[0]) - scale.y(above[0])).max(0.0),
                    escape_html(&band.color)
                );
            } else if n > 1 {
                let mut points = String::new();
                // Along the top left to right, back along the bottom.
                let top = self.times.iter().zip(&above);
                let bottom = self.times.iter().zip(&below).rev();
                for (&t, &value) in top.chain(bottom) {
                    let _ = write!(points, "{:.1},{:.1} ", scale.x(t), scale.y(value));
                }
                let _ = write!(
                    svg,
                    "<polygon points=\"{}\" fill=\"{}\" stroke=\"{}\" stroke-width=\"0.5\">{title}</polygon>",
                    points.trim_end(),
                    escape_html(&band.color),
                    escape_html(&band.color)
                );
            }
            below = above;
        }
    }
}

/// A line, broken where values are missing; single points become dots.
fn draw_line(svg: &mut String, scale: &Scale, times: &[f64], line: &Series) {
    let color = escape_html(&line.color);
    let dash = if line.dashed {
        " stroke-dasharray=\"6 4\""
    } else {
        ""
    };
    let mut runs: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
    for (t, value) in times.iter().zip(&line.values) {
        match value {
            Some(v) => runs.last_mut().map_or((), |run| {
                run.push((scale.x(*t), scale.y(*v)));
            }),
            None => runs.push(Vec::new()),
        }
    }
    let title = escape_html(&line.label);
    for run in runs.iter().filter(|r| !r.is_empty()) {
        if let [(x, y)] = run.as_slice() {
            let _ = write!(
                svg,
                "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"{color}\"><title>{title}</title></circle>"
            );
            continue;
        }
        let points: Vec<String> = run.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let _ = write!(
            svg,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"2.5\"{dash}><title>{title}</title></polyline>",
            points.join(" ")
        );
    }
}

/// A vertical line at the marker's time, a ring at its value and its label.
fn draw_marker(svg: &mut String, scale: &Scale, marker: &Marker) {
    let x = scale.x(marker.seconds.clamp(scale.t0, scale.t1));
    let y = scale.y(marker.value);
    // The label goes on the side with more room.
    let anchor = if x > scale.left + scale.width / 2.0 {
        ("end", -8.0)
    } else {
        ("start", 8.0)
    };
    let _ = write!(
        svg,
        "<g id=\"peak-marker\"><line x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#b00020\" stroke-width=\"1.5\" stroke-dasharray=\"4 3\"/>\
         <circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"5\" fill=\"none\" stroke=\"#b00020\" stroke-width=\"2.5\"/>\
         <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"{}\" fill=\"#b00020\" font-weight=\"bold\">{}</text></g>",
        scale.top,
        scale.top + scale.height,
        x + anchor.1,
        (y - 8.0).max(scale.top + 12.0),
        anchor.0,
        escape_html(&marker.label)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(label: &str, values: &[f64]) -> Series {
        Series {
            label: label.into(),
            values: values.iter().map(|&v| Some(v)).collect(),
            color: "#e4572e".into(),
            dashed: false,
        }
    }

    #[test]
    fn draws_bands_lines_and_the_marker() {
        let chart = Chart {
            id: "c".into(),
            title: "in-use <bytes>".into(),
            width: 600,
            height: 320,
            times: vec![0.0, 1.0, 2.0],
            stacked: vec![series("f<int, &x>", &[0.0, 1024.0, 2048.0])],
            lines: vec![Series {
                values: vec![Some(4096.0), None, Some(5000.0)],
                ..series("rss", &[])
            }],
            marker: Some(Marker {
                seconds: 2.0,
                value: 3000.0,
                label: "peak".into(),
            }),
            note: None,
            unit: Unit::Bytes,
        };
        let svg = chart.svg();
        assert!(svg.contains("<polygon"), "{svg}");
        assert!(svg.contains("<title>f&lt;int, &amp;x&gt;</title>"), "{svg}");
        assert!(svg.contains("in-use &lt;bytes&gt;"));
        // The gap splits the line into two dots.
        assert_eq!(svg.matches("<circle").count(), 3, "{svg}");
        assert!(svg.contains("peak-marker"));
        assert!(svg.contains(">4.0 KiB<"), "round ticks in KiB: {svg}");
        let one = Chart {
            times: vec![5.0],
            stacked: vec![series("a", &[10.0])],
            lines: vec![],
            marker: None,
            ..chart
        };
        assert!(
            one.svg()
                .contains("fill=\"#e4572e\"><title>a</title></rect>"),
            "a bar for one profile"
        );
    }

    #[test]
    fn round_steps() {
        assert_eq!(nice_step(0.7), 1.0);
        assert_eq!(nice_step(3.0), 5.0);
        assert_eq!(nice_step(130.0), 200.0);
        assert_eq!(
            value_step(5.0 * 1024.0 * 1024.0, Unit::Bytes),
            1024.0 * 1024.0
        );
    }
}
