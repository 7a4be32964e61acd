//! `make run` needs no root and no apt (issue 33): its whole dependency
//! chain runs with `apt-get`, `apt`, `dpkg`, `sudo` and `su` shadowed on
//! PATH by scripts that record the call and fail, and its dry run names
//! none of them; the prerequisite checker says what is missing and the
//! one command that fixes it.
//!
//! (Running it as an unprivileged user, `runuser -u nobody`, is not
//! possible where rustup lives under a root-only home, as on the CI
//! machine: the shadowed PATH is the check that runs everywhere.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A directory of `apt-get`, `apt`, `dpkg`, `sudo`, `su` that append their
/// name to `calls` and exit 1.
fn shadow(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let calls = dir.join("calls");
    for name in ["apt-get", "apt", "dpkg", "sudo", "su"] {
        let path = dir.join(name);
        std::fs::write(
            &path,
            format!("#!/bin/sh\necho \"{name} $*\" >> '{}'\nexit 1\n", calls.display()),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    calls
}

fn make(path_env: &str, args: &[&str]) -> Output {
    Command::new("make")
        .current_dir(repo())
        .env("PATH", path_env)
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .args(["--no-print-directory"])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn make_runs_dependency_chain_calls_no_apt_and_no_sudo() {
    let dir = tempfile::tempdir().unwrap();
    let calls = shadow(dir.path());
    let path_env = format!("{}:{}", dir.path().display(), std::env::var("PATH").unwrap());
    for args in [&["-n", "run"][..], &["-n", "run", "HOST=module"], &["-n", "ecds"]] {
        let out = make(&path_env, args);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "make {args:?}:\n{text}");
        for word in ["apt-get", "apt ", "sudo", "dpkg"] {
            assert!(!text.contains(word), "make {args:?} would call {word}:\n{text}");
        }
        assert!(text.contains("envoy/run.py") || args.contains(&"ecds"), "{text}");
    }
    // The install steps themselves, for real (Envoy into .venv if missing).
    let out = make(&path_env, &["setup-run"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "make setup-run:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for step in ["1/4: prerequisites", "2/4: Rust target", "3/4: Envoy"] {
        assert!(text.contains(step), "no line for {step:?}:\n{text}");
    }
    assert!(
        !calls.exists(),
        "called: {}",
        std::fs::read_to_string(&calls).unwrap_or_default()
    );
}

#[test]
fn the_test_services_step_says_it_needs_root() {
    let make_file = std::fs::read_to_string(repo().join("Makefile")).unwrap();
    let apt_lines: Vec<&str> = make_file.lines().filter(|l| l.contains("apt-get")).collect();
    assert!(!apt_lines.is_empty());
    // apt-get appears only in the one helper that says it needs root, and
    // in the help text of setup targets that are not make run's.
    for line in &apt_lines {
        assert!(
            line.contains("needs root") || line.trim_start().starts_with("apt-get update"),
            "an apt-get outside apt_install: {line}"
        );
    }
}

#[test]
fn the_prerequisite_checker_names_each_missing_tool_and_its_fix() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    // A PATH with a shell and a few tools, but no Rust.
    for tool in ["bash", "env", "sort", "head", "awk", "make", "python3"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .unwrap();
        let target = String::from_utf8_lossy(&found.stdout).trim().to_owned();
        if !target.is_empty() {
            symlink(target, dir.path().join(tool)).unwrap();
        }
    }
    let out = Command::new(dir.path().join("bash"))
        .arg(repo().join("envoy/check-prereqs.sh"))
        .env("PATH", dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(1), "{text}");
    for tool in ["cargo", "rustup", "cc"] {
        assert!(text.contains(&format!("MISSING  {tool}")), "{tool}:\n{text}");
    }
    assert!(
        text.contains("fix: curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs"),
        "{text}"
    );
    assert!(text.contains("ok       make"), "{text}");
}
