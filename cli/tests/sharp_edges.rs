//! The sharp edges a newcomer found (issue 33), each pinned: certs init
//! never overwrites a CA unasked, `policy apply --module` refuses what the
//! module refuses, `serve` with a policy it cannot read exits with the
//! reason, the policy size limit, the Kubernetes object limit, the alias
//! bomb, and one meaning per exit code in every subcommand.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn tenantgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .current_dir(repo())
        .args(args)
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A valid policy to pad: the demo's.
fn small() -> String {
    std::fs::read_to_string(repo().join("policies/demo.yaml")).unwrap()
}

#[test]
fn certs_init_refuses_to_replace_a_ca_without_force() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    assert!(tenantgate(&["certs", "init", "--dir", d]).status.success());
    let ca = std::fs::read(dir.path().join("ca.pem")).unwrap();
    let again = tenantgate(&["certs", "init", "--dir", d]);
    assert_eq!(again.status.code(), Some(1), "{}", stderr(&again));
    assert!(stderr(&again).contains("--force"), "{}", stderr(&again));
    assert_eq!(
        std::fs::read(dir.path().join("ca.pem")).unwrap(),
        ca,
        "the CA is untouched"
    );
    let forced = tenantgate(&["certs", "init", "--dir", d, "--force"]);
    assert!(forced.status.success(), "{}", stderr(&forced));
    assert_ne!(
        std::fs::read(dir.path().join("ca.pem")).unwrap(),
        ca,
        "--force replaces it"
    );
}

#[test]
fn apply_module_refuses_what_the_module_refuses_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let ecds = dir.path().join("ecds.yaml");
    let out = tenantgate(&[
        "policy",
        "apply",
        "policies/jwt-claims.yaml",
        "--ecds",
        ecds.to_str().unwrap(),
        "--module",
        "/nonexistent/libtenantgate_module.so",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the native module") && stderr(&out).contains("identity.jwt"),
        "{}",
        stderr(&out)
    );
    assert!(!ecds.exists(), "nothing written");
    // The wasm filter takes the same policy.
    let wasm = tenantgate(&[
        "policy",
        "apply",
        "policies/jwt-claims.yaml",
        "--ecds",
        ecds.to_str().unwrap(),
    ]);
    assert!(wasm.status.success(), "{}", stderr(&wasm));
}

#[test]
fn serve_exits_with_the_reason_when_it_cannot_read_its_policy() {
    for policy in [
        "/nonexistent/policy.yaml",
        "tests/fixtures/invalid/zero-rate.yaml",
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
            .current_dir(repo())
            .args([
                "serve",
                "--policy",
                policy,
                "--listen",
                "127.0.0.1:0",
                "--admin",
                "127.0.0.1:0",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("serve --policy {policy} kept running");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let out = child.wait_with_output().unwrap();
        assert_eq!(status.code(), Some(1), "{policy}");
        assert!(stderr(&out).contains(policy), "{policy}: {}", stderr(&out));
        if policy.ends_with("zero-rate.yaml") {
            // Located as `policy check` locates it.
            assert!(
                stderr(&out).contains("zero-rate.yaml:5:23: plans.free.limits[0].rate"),
                "{}",
                stderr(&out)
            );
        }
    }
}

#[test]
fn a_policy_over_one_mib_is_refused_with_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.yaml");
    // A valid policy padded with a comment past 1 MiB.
    let pad = format!("# {}\n", "x".repeat(tenantgate::policy::MAX_POLICY_BYTES));
    std::fs::write(&big, format!("{}{pad}", small())).unwrap();
    let started = Instant::now();
    for args in [
        vec!["policy", "check", big.to_str().unwrap()],
        vec![
            "policy",
            "apply",
            big.to_str().unwrap(),
            "--manifests",
            dir.path().join("m").to_str().unwrap(),
            "--wasm-sha256",
            &"0".repeat(64),
        ],
    ] {
        let out = tenantgate(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains("1048576"), "{args:?}: {}", stderr(&out));
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(!dir.path().join("m").exists(), "no manifests written");
    // Just under the limit is accepted.
    let under = dir.path().join("under.yaml");
    let room = tenantgate::policy::MAX_POLICY_BYTES - small().len() - 3;
    std::fs::write(&under, format!("{}# {}\n", small(), "x".repeat(room))).unwrap();
    let out = tenantgate(&["policy", "check", under.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn manifests_stay_under_the_kubernetes_object_limit_or_are_refused() {
    use tenantgate_cli::manifests::{check_sizes, Manifest, MAX_CLIENT_SIDE_APPLY_BYTES, MAX_OBJECT_BYTES};
    let m = |n: usize| Manifest {
        file: "istio-wasmplugin.yaml",
        text: "x".repeat(n),
    };
    assert_eq!(check_sizes(&[m(1000)]), Ok(vec![]));
    assert_eq!(
        check_sizes(&[m(MAX_CLIENT_SIDE_APPLY_BYTES + 1)]),
        Ok(vec!["istio-wasmplugin.yaml"])
    );
    let refused = check_sizes(&[m(MAX_OBJECT_BYTES + 1)]).unwrap_err();
    assert!(
        refused.contains("istio-wasmplugin.yaml") && refused.contains("1.5 MiB"),
        "{refused}"
    );
    // The largest policy the limit admits makes manifests the API server takes.
    let largest = format!(
        "{{\"version\":\"v1\",\"plans\":{{\"free\":{{\"limits\":[{{\"rate\":10,\"per\":\"1m\"}}]}}}},\"default_plan\":\"free\",\"x\":\"{}\"}}",
        "y".repeat(tenantgate::policy::MAX_POLICY_BYTES)
    );
    let code = tenantgate_cli::manifests::Code {
        image: "registry.example/tenantgate/filter@sha256:00",
        wasm_url: "https://example/tenantgate.wasm",
        wasm_sha256: "00",
    };
    let target = tenantgate_cli::manifests::Target {
        namespace: "default",
        http_route: "api",
        app: "api",
    };
    let list = tenantgate_cli::manifests::render(&largest, "p.yaml", &code, &target);
    assert!(list.iter().all(|m| m.text.len() < MAX_OBJECT_BYTES));
}

#[test]
fn the_alias_bomb_is_refused_fast_and_named() {
    let dir = tempfile::tempdir().unwrap();
    let bomb = dir.path().join("bomb.yaml");
    let mut text = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
    for (prev, name) in ["a", "b", "c", "d", "e", "f", "g", "h", "i"]
        .iter()
        .zip(["b", "c", "d", "e", "f", "g", "h", "i", "j"])
    {
        let row = std::iter::repeat_n(format!("*{prev}"), 10)
            .collect::<Vec<_>>()
            .join(", ");
        text.push_str(&format!("{name}: &{name} [{row}]\n"));
    }
    std::fs::write(&bomb, text).unwrap();
    let started = Instant::now();
    let out = tenantgate(&["policy", "check", bomb.to_str().unwrap()]);
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("alias bomb"), "{}", stderr(&out));
}

/// docs/cli.md's table: 0 ok, 1 invalid input, 2 usage, 3 could not run,
/// 4 `policy diff` found differences; the same number means the same in
/// every subcommand.
#[test]
fn exit_codes_mean_the_same_in_every_subcommand() {
    let invalid = "tests/fixtures/invalid/zero-rate.yaml";
    let usage: &[&[&str]] = &[
        &["--no-such-flag"],
        &["policy", "check"],
        &["policy", "check", "--no-such-flag", "x"],
        &["policy", "compile"],
        &["policy", "apply", "policies/demo.yaml"],
        &["policy", "explain", "policies/demo.yaml"],
        &["policy", "diff", "policies/demo.yaml"],
        &["policy", "import"],
        &["sim", "--seed", "x"],
        &["serve"],
        &["certs", "init"],
        &["certs", "node", "--dir", "x"],
        &["quota", "reserve"],
        &["top", "--k", "x"],
        &["package", "--no-such-flag"],
    ];
    for args in usage {
        assert_eq!(tenantgate(args).status.code(), Some(2), "{args:?}");
    }
    let invalid_input: &[&[&str]] = &[
        &["policy", "check", invalid],
        &["policy", "compile", invalid],
        &["policy", "apply", invalid, "--ecds", "/tmp/never-written.yaml"],
        &["policy", "explain", invalid, "--class", "api"],
        &["policy", "diff", "policies/demo.yaml", invalid],
        &["policy", "import", "/nonexistent.yaml"],
        &["serve", "--policy", invalid],
        &["sim", "--scenario", "no-such-scenario"],
        &["package", "--wasm", "/nonexistent.wasm", "--out", "/tmp/never"],
    ];
    for args in invalid_input {
        let out = tenantgate(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
    }
    let could_not_run: &[&[&str]] = &[
        &["top", "--once", "--service", "http://127.0.0.1:1"],
        &["quota", "get", "x", "--service", "127.0.0.1:1"],
    ];
    for args in could_not_run {
        let out = tenantgate(args);
        assert_eq!(out.status.code(), Some(3), "{args:?}: {}", stderr(&out));
    }
    assert_eq!(
        tenantgate(&["policy", "diff", "policies/demo.yaml", "policies/demo.yaml"])
            .status
            .code(),
        Some(0)
    );
    assert_eq!(
        tenantgate(&["policy", "diff", "policies/demo.yaml", "policies/global.yaml"])
            .status
            .code(),
        Some(4)
    );
}
