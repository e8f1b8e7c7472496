//! Errors as the push's log lines show them: one line with every cause.

/// An error and its sources, as one line (a source its error already quotes is not
/// repeated).
pub fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(next) = source {
        let next_text = next.to_string();
        if !text.contains(&next_text) {
            text.push_str(": ");
            text.push_str(&next_text);
        }
        source = next.source();
    }
    text
}
