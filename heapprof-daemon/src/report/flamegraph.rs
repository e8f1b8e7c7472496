//! Flamegraph SVGs drawn by `inferno` from folded stacks, plain or differential.

use inferno::flamegraph::{Options, from_lines};

/// Draws a flamegraph of `stacks` (folded stack, value) with `title`, counting `unit`
/// (e.g. `bytes`). An empty input gives a valid SVG that says there is nothing to draw.
pub fn render(stacks: &[(String, i64)], title: &str, unit: &str) -> std::io::Result<Vec<u8>> {
    let lines: Vec<String> = stacks
        .iter()
        .filter(|(_, value)| *value > 0)
        .map(|(stack, value)| format!("{stack} {value}"))
        .collect();
    draw(&lines, title, unit)
}

/// Draws a differential flamegraph: frame widths are the new values, colours show the
/// change from `before` (red grew, blue shrank), as in Brendan Gregg's `difffolded`.
/// Values below zero (a sample type that is a difference already) count as zero.
pub fn render_diff(
    stacks: &[(String, i64, i64)],
    title: &str,
    unit: &str,
) -> std::io::Result<Vec<u8>> {
    let lines: Vec<String> = stacks
        .iter()
        .filter(|(_, before, after)| *before > 0 || *after > 0)
        .map(|(stack, before, after)| format!("{stack} {} {}", before.max(&0), after.max(&0)))
        .collect();
    draw(&lines, title, unit)
}

fn draw(lines: &[String], title: &str, unit: &str) -> std::io::Result<Vec<u8>> {
    if lines.is_empty() {
        // inferno refuses an empty input; a page showing a session must still draw.
        return Ok(empty_svg(title).into_bytes());
    }
    let mut options = Options::default();
    options.title = title.to_owned();
    options.count_name = unit.to_owned();
    // The same input gives the same file (no random colours).
    options.deterministic = true;
    let mut svg = Vec::new();
    from_lines(&mut options, lines.iter().map(String::as_str), &mut svg)?;
    Ok(svg)
}

/// A small SVG saying there is nothing to draw.
fn empty_svg(title: &str) -> String {
    let title = title
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    format!(
        "<?xml version=\"1.0\" standalone=\"no\"?>\n\
         <svg version=\"1.1\" width=\"1200\" height=\"60\" xmlns=\"http://www.w3.org/2000/svg\">\
         <text x=\"600\" y=\"24\" text-anchor=\"middle\" font-size=\"17\">{title}</text>\
         <text x=\"600\" y=\"48\" text-anchor=\"middle\" font-size=\"12\">no samples of this type</text></svg>\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_each_frame_and_a_diff() {
        let stacks = vec![("main;a;b;malloc".to_owned(), 4_194_304)];
        let svg =
            String::from_utf8(render(&stacks, "inuse_space", "bytes").expect("svg")).expect("utf8");
        assert!(svg.starts_with("<?xml"), "{}", &svg[..40]);
        for frame in ["main", "a", "b", "malloc"] {
            assert!(svg.contains(&format!(">{frame}<")), "{frame} missing");
        }
        let diff = vec![("main;a;malloc".to_owned(), 8, 24)];
        let svg = render_diff(&diff, "diff", "bytes").expect("svg");
        assert!(String::from_utf8_lossy(&svg).contains(">a<"));
        let empty = render(&[], "nothing", "bytes").expect("svg");
        assert!(String::from_utf8_lossy(&empty).contains("<svg"));
    }
}
