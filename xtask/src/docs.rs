//! Checks of the documentation (tests only): every relative link in README.md,
//! CONTRIBUTING.md and docs/*.md leads to a file that exists, and to a heading that
//! exists when it names one; the README's two commands stay on its first screen.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};

use crate::workspace_root;

/// The documentation files: README.md, CONTRIBUTING.md and every docs/*.md.
fn documents() -> Vec<PathBuf> {
    let root = workspace_root();
    let mut files = vec![root.join("README.md"), root.join("CONTRIBUTING.md")];
    let mut docs: Vec<PathBuf> = fs::read_dir(root.join("docs"))
        .expect("docs/ exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The targets of the Markdown links `[text](target)` outside code blocks and code spans.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop code spans: their brackets are not links.
        let prose: String = line
            .split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, part)| part)
            .collect::<Vec<_>>()
            .join(" ");
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            found.push(after[..end].trim().to_owned());
            rest = &after[end..];
        }
    }
    found
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut set = BTreeSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced && line.starts_with('#') {
            let heading = line.trim_start_matches('#');
            if heading.starts_with(' ') {
                let base = slug(heading);
                // Repeated headings get -1, -2, ...: accept the plain form only once.
                let mut name = base.clone();
                let mut n = 0;
                while set.contains(&name) {
                    n += 1;
                    name = format!("{base}-{n}");
                }
                set.insert(name);
            }
        }
    }
    set
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

#[test]
fn relative_links_resolve() {
    let mut broken = Vec::new();
    for doc in documents() {
        let text = read(&doc);
        let dir = doc.parent().expect("a file has a directory");
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = match link.split_once('#') {
                Some((file, anchor)) => (file, Some(anchor)),
                None => (link.as_str(), None),
            };
            let target = if file.is_empty() {
                doc.clone()
            } else {
                dir.join(file)
            };
            if !target.exists() {
                broken.push(format!("{}: {link} (no such file)", doc.display()));
                continue;
            }
            if let Some(anchor) = anchor
                && target.extension().is_some_and(|e| e == "md")
                && !anchors(&read(&target)).contains(anchor)
            {
                broken.push(format!("{}: {link} (no such heading)", doc.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn readme_shows_the_two_commands_first() {
    let readme = read(&workspace_root().join("README.md"));
    let first_screen: String = readme.lines().take(40).collect::<Vec<_>>().join("\n");
    for command in ["cargo xtask run", "cargo xtask test"] {
        assert!(
            first_screen.contains(command),
            "README.md's first 40 lines do not show `{command}`"
        );
    }
}

#[test]
fn link_and_anchor_parsing() {
    let text = "# Reading the output\n## `--pid`, launch & kernel mode\n# Limits\n# Limits\n\
                ```\n# not a heading [x](nope.md)\n```\nsee [a](docs/a.md#x-y) and `[b](c)`";
    assert_eq!(links(text), ["docs/a.md#x-y"]);
    let set = anchors(text);
    for anchor in [
        "reading-the-output",
        "--pid-launch--kernel-mode",
        "limits",
        "limits-1",
    ] {
        assert!(set.contains(anchor), "{anchor} not in {set:?}");
    }
    assert!(!set.contains("not-a-heading"));
}
