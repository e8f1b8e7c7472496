//! Numbers as the session reports print them: bytes in binary units, seconds, CSV cells.

/// The percentage of `allocated` bytes nobody asked for (slab waste); `None` without
/// allocated bytes.
pub fn waste_percent(requested: i64, allocated: i64) -> Option<f64> {
    (allocated > 0).then(|| (allocated - requested).max(0) as f64 * 100.0 / allocated as f64)
}

/// `1.5 MiB`, `512 B`: bytes in the largest binary unit that keeps the number at
/// least 1, one decimal above bytes. Negative values keep their sign.
pub fn bytes(value: f64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let sign = if value < 0.0 { "-" } else { "" };
    let mut magnitude = value.abs();
    let mut unit = 0;
    while magnitude >= 1024.0 && unit + 1 < UNITS.len() {
        magnitude /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{sign}{magnitude:.0} B")
    } else {
        format!("{sign}{magnitude:.1} {}", UNITS[unit])
    }
}

/// `+1.5 MiB` or `-2 B`: a change in bytes, always signed.
pub fn bytes_change(value: f64) -> String {
    if value >= 0.0 {
        format!("+{}", bytes(value))
    } else {
        bytes(value)
    }
}

/// `12.5 s`, `3 min 4 s`: a time since the session's first profile.
pub fn seconds(value: f64) -> String {
    if value.abs() < 120.0 {
        format!("{value:.1} s")
    } else {
        let whole = value.round() as i64;
        format!("{} min {} s", whole / 60, whole % 60)
    }
}

/// One CSV cell (RFC 4180): quoted when it holds a comma, a quote or a line break,
/// because site names do (`std::map<int, int>`).
pub fn csv_cell(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_owned()
    }
}

/// Escapes text for HTML and XML, in element content and in quoted attributes alike.
pub fn escape_html(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&#39;"),
            _ => escaped.push(c),
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_numbers() {
        assert_eq!(bytes(512.0), "512 B");
        assert_eq!(bytes(1536.0), "1.5 KiB");
        assert_eq!(bytes(-3.0 * 1024.0 * 1024.0), "-3.0 MiB");
        assert_eq!(bytes_change(2048.0), "+2.0 KiB");
        assert_eq!(seconds(3.25), "3.2 s");
        assert_eq!(seconds(184.0), "3 min 4 s");
        assert_eq!(csv_cell("malloc in a <- main"), "malloc in a <- main");
        assert_eq!(
            csv_cell("f<std::map<int, int>> \"x\""),
            "\"f<std::map<int, int>> \"\"x\"\"\""
        );
        assert_eq!(
            escape_html("a<b>&\"'"),
            "a&lt;b&gt;&amp;&quot;&#39;".to_owned()
        );
    }
}
