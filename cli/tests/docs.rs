//! The docs a newcomer navigates: every relative link and anchor in
//! README.md and docs/*.md resolves (a file that exists; a heading that
//! exists, by GitHub's anchor rule), and `make help` lists every Makefile
//! target (each has a `## ` description).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// GitHub's anchor of a heading: lower-cased, punctuation dropped (but `-`
/// and `_`), spaces to `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks), with
/// GitHub's `-1`, `-2` suffixes for repeats.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        if let Some(h) = line.strip_prefix('#') {
            let h = h.trim_start_matches('#');
            if !h.starts_with(' ') {
                continue;
            }
            let h = h.replace('`', "");
            let base = slug(&h);
            let mut a = base.clone();
            let mut n = 0;
            while seen.contains(&a) {
                n += 1;
                a = format!("{base}-{n}");
            }
            seen.insert(a);
        }
    }
    seen
}

/// `(target)` of every `[text](target)` outside code blocks and code spans.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop code spans.
        let plain: String = line.split('`').step_by(2).collect::<Vec<_>>().join("");
        let mut rest = plain.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].trim().to_owned());
            rest = &after[end..];
        }
    }
    out
}

fn doc_files() -> Vec<PathBuf> {
    let mut files = vec![repo().join("README.md")];
    if let Ok(dir) = std::fs::read_dir(repo().join("docs")) {
        let mut docs: Vec<PathBuf> = dir
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
            .collect();
        docs.sort();
        files.extend(docs);
    }
    files
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in doc_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let dir = file.parent().unwrap();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = match link.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (link.as_str(), None),
            };
            let target = if path.is_empty() {
                file.clone()
            } else {
                dir.join(path)
            };
            if !target.exists() {
                broken.push(format!(
                    "{}: {link}: no file {}",
                    file.display(),
                    target.display()
                ));
                continue;
            }
            if let Some(a) = anchor {
                let target_text = std::fs::read_to_string(&target).unwrap_or_default();
                if !anchors(&target_text).contains(a) {
                    broken.push(format!("{}: {link}: no heading with anchor #{a}", file.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked >= 5, "only {checked} relative links found");
}

#[test]
fn the_checker_sees_a_broken_anchor() {
    let text = "# Title\n## Global limits across nodes\n```\n# not a heading\n```\n[a](#global-limits-across-nodes) `[b](#x)` [c](#nope)\n";
    assert!(anchors(text).contains("global-limits-across-nodes"));
    assert!(!anchors(text).contains("not-a-heading"));
    assert_eq!(links(text), ["#global-limits-across-nodes", "#nope"]);
}

#[test]
fn make_help_lists_every_target() {
    let makefile = std::fs::read_to_string(repo().join("Makefile")).unwrap();
    let undocumented: Vec<&str> = makefile
        .lines()
        .filter(|l| l.chars().next().is_some_and(|c| c.is_ascii_lowercase()))
        .filter(|l| l.contains(':') && !l.contains(":=") && !l.starts_with("export"))
        .filter(|l| !l.contains("## "))
        .collect();
    assert!(
        undocumented.is_empty(),
        "targets `make help` does not list: {undocumented:?}"
    );
}

#[test]
fn every_policy_field_of_the_schema_is_in_the_policy_reference() {
    let spec = std::fs::read_to_string(repo().join("src/policy/spec.rs")).unwrap();
    let fields: BTreeSet<&str> = spec
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("pub "))
        .filter_map(|l| l.split_once(':').map(|(name, _)| name))
        .filter(|name| name.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .collect();
    assert!(fields.len() >= 20, "{fields:?}");
    let readme = std::fs::read_to_string(repo().join("docs/policy.md")).unwrap();
    let start = readme.find("\n## Policy reference").unwrap();
    let end = readme[start + 1..]
        .find("\n## ")
        .map_or(readme.len(), |e| start + 1 + e);
    let section = &readme[start..end];
    let words: BTreeSet<&str> = section
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .collect();
    let missing: Vec<&&str> = fields.iter().filter(|f| !words.contains(**f)).collect();
    assert!(
        missing.is_empty(),
        "policy fields not in docs/policy.md \"Policy reference\": {missing:?}"
    );
}

/// The first screen (issue 33): what it is in at most 15 lines, then the
/// two commands, a policy that validates, then "Try it"; at most 150 lines.
#[test]
fn the_readme_opens_with_what_it_is_the_commands_a_policy_and_try_it() {
    let text = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() <= 150, "README.md is {} lines", lines.len());
    let heading = |h: &str| {
        lines
            .iter()
            .position(|l| *l == h)
            .unwrap_or_else(|| panic!("no {h}"))
    };
    let (commands, policy, try_it) = (
        heading("## Two commands"),
        heading("## A policy"),
        heading("## Try it"),
    );
    assert!(
        commands <= 16 && commands < policy && policy < try_it,
        "{commands} {policy} {try_it}"
    );
    let yaml = text
        .split("```yaml\n")
        .nth(1)
        .unwrap()
        .split("```")
        .next()
        .unwrap();
    let document = tenantgate_cli::policy_file::parse_yaml(yaml).unwrap();
    tenantgate::policy::Policy::from_node(&document).unwrap();
    assert!(
        yaml.lines().count() <= 15,
        "the policy is {} lines",
        yaml.lines().count()
    );
}
