//! Golden tests of `tenantgate policy explain` and `tenantgate policy diff`:
//! the binary's output and exit code for the shipped policies, against the
//! expected files in `cli/tests/golden/`. `UPDATE_GOLDEN=1 cargo test -p
//! tenantgate-cli --test explain` rewrites them (then review the diff).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `tenantgate ARGS` from the repository root; checks its exit code,
/// and its stdout against `cli/tests/golden/NAME`.
fn golden(name: &str, args: &[&str], code: i32) {
    let out = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .current_dir(repo())
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.status.code(),
        Some(code),
        "tenantgate {args:?}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file = repo().join("cli/tests/golden").join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&file, &stdout).unwrap();
    }
    let expected = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    assert_eq!(
        stdout,
        expected,
        "tenantgate {args:?} differs from {}",
        file.display()
    );
}

#[test]
fn explain_a_free_tenant_on_orders() {
    golden(
        "explain-demo-free-orders.txt",
        &[
            "policy",
            "explain",
            "policies/demo.yaml",
            "--tenant",
            "demo-free",
            "--class",
            "orders",
        ],
        0,
    );
}

#[test]
fn explain_shows_the_levels_and_which_refuses_first() {
    // A user of a guaranteed team: its plan refuses first.
    golden(
        "explain-nested-search-user.txt",
        &[
            "policy",
            "explain",
            "policies/nested.yaml",
            "--tenant",
            "alice",
            "--class",
            "chat",
            "--level",
            "org=acme",
            "--level",
            "team=search",
        ],
        0,
    );
    // The service account of the capped team: the team's ceiling does.
    golden(
        "explain-nested-batch-service.txt",
        &[
            "policy",
            "explain",
            "policies/nested.yaml",
            "--tenant",
            "batch-runner",
            "--class",
            "chat",
            "--level",
            "org=acme",
            "--level",
            "team=batch",
        ],
        0,
    );
}

#[test]
fn explain_a_class_whose_cost_settles_after_the_response() {
    for (name, tenant, class) in [
        ("explain-llm-acme-chat.txt", "acme", "chat"),
        ("explain-llm-free-priced.txt", "someone", "priced"),
        ("explain-llm-free-embeddings.txt", "someone", "embeddings"),
    ] {
        golden(
            name,
            &[
                "policy",
                "explain",
                "policies/llm.yaml",
                "--tenant",
                tenant,
                "--class",
                class,
            ],
            0,
        );
    }
}

#[test]
fn explain_the_global_tenant() {
    golden(
        "explain-demo-global-orders.txt",
        &[
            "policy",
            "explain",
            "policies/demo.yaml",
            "--tenant",
            "demo-global",
            "--class",
            "orders",
        ],
        0,
    );
    // A cost above the provisional units: denied until the node's first lease.
    golden(
        "explain-demo-global-search.txt",
        &[
            "policy",
            "explain",
            "policies/demo.yaml",
            "--tenant",
            "demo-global",
            "--class",
            "search",
        ],
        0,
    );
}

#[test]
fn explain_an_anonymous_request_on_an_unknown_class() {
    golden(
        "explain-demo-anonymous.txt",
        &["policy", "explain", "policies/demo.yaml", "--class", "nope"],
        0,
    );
}

#[test]
fn explain_reads_the_identity_from_a_header_given_with_header() {
    golden(
        "explain-global-paid-payments.txt",
        &[
            "policy",
            "explain",
            "policies/global.yaml",
            "--class",
            "payments",
            "--header",
            "x-tenant-id=demo-paid",
        ],
        0,
    );
}

#[test]
fn diff_says_what_a_reload_does_to_live_state() {
    golden(
        "diff-demo-reload.txt",
        &[
            "policy",
            "diff",
            "policies/demo.yaml",
            "cli/tests/golden/demo-reload.yaml",
        ],
        4,
    );
    golden(
        "diff-demo-global.txt",
        &["policy", "diff", "policies/demo.yaml", "policies/global.yaml"],
        4,
    );
    golden(
        "diff-same.txt",
        &["policy", "diff", "policies/demo.yaml", "policies/demo.yaml"],
        0,
    );
}

#[test]
fn diff_exits_1_on_an_invalid_policy() {
    let out = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .current_dir(repo())
        .args([
            "policy",
            "diff",
            "policies/demo.yaml",
            "tests/fixtures/invalid/zero-rate.yaml",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("zero-rate.yaml:5:23: plans.free.limits[0].rate: must be > 0"));
}

#[test]
fn explain_shows_a_classs_admission_labels() {
    golden(
        "explain-admission-checkout.txt",
        &[
            "policy",
            "explain",
            "policies/admission.yaml",
            "--tenant",
            "acme",
            "--class",
            "checkout",
        ],
        0,
    );
}

#[test]
fn explain_shows_a_classs_action_limit() {
    golden(
        "explain-admission-reports.txt",
        &[
            "policy",
            "explain",
            "policies/admission.yaml",
            "--tenant",
            "acme",
            "--class",
            "reports",
        ],
        0,
    );
}

/// `explain` of an admission class through the filter's pipeline: the
/// first request, a saturated dependency (critical requests use their
/// reservation, then the pool), one more of each criticality, the breaker.
fn explain_admission(class: &str) {
    golden(
        &format!("explain-admission-{class}.txt"),
        &[
            "policy",
            "explain",
            "policies/admission.yaml",
            "--tenant",
            "acme",
            "--class",
            class,
        ],
        0,
    );
}

#[test]
fn explain_holds_a_normal_request_in_its_queue_until_max_wait() {
    // orders-db's normal queue: the 76th request is held, then answered
    // queue_timeout at its 200 ms deadline.
    explain_admission("orders");
}

#[test]
fn explain_shows_system_traffic_on_its_reservation() {
    explain_admission("health");
}

#[test]
fn explain_counts_streams_against_max_streams() {
    explain_admission("feed");
}

#[test]
fn diff_shows_admission_label_and_dependency_changes() {
    golden(
        "diff-admission-reload.txt",
        &[
            "policy",
            "diff",
            "policies/admission.yaml",
            "cli/tests/golden/admission-reload.yaml",
        ],
        4,
    );
}

/// Every `$ tenantgate …` example in docs/cli.md prints exactly what the
/// binary prints (a trailing `; echo "exit $?"` adds the exit code line).
#[test]
fn docs_cli_examples_are_the_binarys_output() {
    let doc = std::fs::read_to_string(repo().join("docs/cli.md")).unwrap();
    let mut examples = 0;
    for block in doc.split("```console\n").skip(1) {
        let block = block.split("```").next().unwrap_or("");
        for example in block.split("$ tenantgate ").skip(1) {
            let (command, expected) = example.split_once('\n').unwrap();
            let (command, with_exit) = match command.strip_suffix("; echo \"exit $?\"") {
                Some(c) => (c, true),
                None => (command, false),
            };
            let out = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
                .current_dir(repo())
                .args(command.split_whitespace())
                .output()
                .unwrap();
            let mut printed = String::from_utf8_lossy(&out.stdout).into_owned();
            if with_exit {
                printed.push_str(&format!("exit {}\n", out.status.code().unwrap_or(-1)));
            }
            assert_eq!(printed, expected, "docs/cli.md: $ tenantgate {command}");
            examples += 1;
        }
    }
    assert!(examples >= 3, "{examples} examples found in docs/cli.md");
}
