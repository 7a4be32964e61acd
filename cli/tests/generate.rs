//! Shell completions and man pages, generated from the command's clap
//! definition: each is produced, and mentions every subcommand there is.
//! The subcommands are read from `tenantgate --help` itself (and each
//! command's `--help`, recursively), so a new one is checked with no edit
//! here.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::process::{Command, Output};

fn tenantgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .args(args)
        .output()
        .unwrap()
}

/// The names under "Commands:" in a help text (clap's `help` left out).
fn commands_in(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| *l != "Commands:")
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

/// Every command path: `["policy"]`, `["policy", "check"]`, …
fn every_subcommand() -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let mut todo: Vec<Vec<String>> = vec![Vec::new()];
    while let Some(path) = todo.pop() {
        let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
        args.push("--help");
        let out = tenantgate(&args);
        assert!(out.status.success(), "tenantgate {args:?}");
        for name in commands_in(&String::from_utf8(out.stdout).unwrap()) {
            let mut child = path.clone();
            child.push(name);
            todo.push(child.clone());
            found.push(child);
        }
    }
    found.sort();
    found
}

#[test]
fn the_help_lists_the_subcommands_this_test_walks() {
    let all = every_subcommand();
    for expected in [
        vec!["policy", "check"],
        vec!["policy", "schema"],
        vec!["quota", "reserve"],
        vec!["certs", "init"],
        vec!["completions"],
        vec!["man"],
    ] {
        assert!(all.iter().any(|p| *p == expected), "{expected:?} not in {all:?}");
    }
}

#[test]
fn completions_name_every_subcommand_in_every_shell() {
    let all = every_subcommand();
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let out = tenantgate(&["completions", shell]);
        assert_eq!(out.status.code(), Some(0), "{shell}");
        let script = String::from_utf8(out.stdout).unwrap();
        for path in &all {
            let name = path.last().unwrap();
            assert!(
                script.contains(name.as_str()),
                "{shell}: `{}` missing",
                path.join(" ")
            );
        }
        // The subcommands' own flags too, e.g. `policy apply --manifests`.
        assert!(script.contains("manifests"), "{shell}: no --manifests");
    }
    assert_eq!(tenantgate(&["completions", "tcsh"]).status.code(), Some(2));
}

#[test]
fn man_pages_cover_every_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("man1");
    let out = tenantgate(&["man", target.to_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let all = every_subcommand();
    for path in &all {
        let page = target.join(format!("tenantgate-{}.1", path.join("-")));
        let text = std::fs::read_to_string(&page).unwrap_or_else(|e| panic!("{}: {e}", page.display()));
        assert!(
            text.starts_with(".ie \\n(.g .ds Aq"),
            "{}: not roff",
            page.display()
        );
        assert!(text.contains(".SH NAME"), "{}", page.display());
    }
    let main = std::fs::read_to_string(target.join("tenantgate.1")).unwrap();
    for path in all.iter().filter(|p| p.len() == 1) {
        assert!(
            main.contains(&format!("tenantgate\\-{}", path[0])),
            "tenantgate.1 lacks {}",
            path[0]
        );
    }
    let written = String::from_utf8(out.stdout).unwrap();
    assert_eq!(written.lines().count(), all.len() + 1, "{written}");
    // A directory it cannot write into: exit 3, the reason.
    let blocked = dir.path().join("file");
    std::fs::write(&blocked, "").unwrap();
    let out = tenantgate(&["man", blocked.join("man1").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot write into"));
}

/// The bash script completes as bash calls it: `tenantgate policy sch<TAB>`
/// offers `schema`, `tenantgate policy apply --mani<TAB>` `--manifests`.
#[test]
fn bash_completes_a_subcommand_and_a_flag() {
    let script = tenantgate(&["completions", "bash"]).stdout;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tenantgate.bash");
    std::fs::write(&path, script).unwrap();
    for (line, expected) in [
        ("tenantgate policy sch", "schema"),
        ("tenantgate policy apply --mani", "--manifests"),
        ("tenantgate compl", "completions"),
    ] {
        let words: Vec<&str> = line.split(' ').collect();
        let cword = words.len() - 1;
        let call = format!(
            "source {}; COMP_WORDS=({}); COMP_CWORD={cword}; COMP_LINE='{line}'; COMP_POINT=${{#COMP_LINE}}; \
             _tenantgate tenantgate {} {}; echo \"${{COMPREPLY[@]}}\"",
            path.display(),
            words.join(" "),
            words[cword],
            words[cword - 1],
        );
        let out = Command::new("bash").args(["-c", &call]).output().unwrap();
        let offered = String::from_utf8(out.stdout).unwrap();
        assert_eq!(
            offered.trim(),
            expected,
            "{line}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
