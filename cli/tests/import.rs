//! `tenantgate policy import` goldens: each envoyproxy/ratelimit
//! configuration in `cli/tests/golden/import/` (written from that
//! project's documented format) imports to exactly `<stem>.expected.yaml`
//! with exactly the report `<stem>.report`; each `invalid-*.yaml` fails
//! with the message on its first line. `UPDATE_GOLDEN=1 cargo test -p
//! tenantgate-cli --test import` rewrites the expected files.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::path::{Path, PathBuf};
use std::process::Command;

use tenantgate::policy::Policy;
use tenantgate_cli::import::{import, Source};
use tenantgate_cli::policy_file;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/import")
}

/// The source fixtures: `*.yaml` that are not expected outputs.
fn sources() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.ends_with(".yaml") && !name.ends_with(".expected.yaml")
        })
        .collect();
    files.sort();
    files
}

fn name(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

fn golden(path: &Path, actual: &str) {
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 writes it)", path.display()));
    assert_eq!(
        actual,
        expected,
        "{} differs (UPDATE_GOLDEN=1 rewrites it)",
        path.display()
    );
}

#[test]
fn every_configuration_imports_to_its_golden_policy_and_report() {
    let mut valid = 0;
    for file in sources() {
        let n = name(&file);
        let text = std::fs::read_to_string(&file).unwrap();
        let stem = n.trim_end_matches(".yaml");
        let result = import(
            &[Source {
                name: &n,
                text: &text,
            }],
            "imported",
        );
        if let Some(expect) = text.lines().next().and_then(|l| l.strip_prefix("# expect: ")) {
            let err = result.expect_err(&n);
            assert!(err.contains(expect), "{n}: got {err:?}, expected {expect:?}");
            continue;
        }
        let imported = result.unwrap_or_else(|e| panic!("{n}: {e}"));
        golden(
            &dir().join(format!("{stem}.expected.yaml")),
            &imported.policy_yaml,
        );
        let mut report = imported.report.join("\n");
        report.push('\n');
        golden(&dir().join(format!("{stem}.report")), &report);
        // The output is a policy the CLI and the filter both accept.
        let doc = policy_file::parse_yaml(&imported.policy_yaml).unwrap();
        Policy::from_json(doc.to_json().as_bytes()).unwrap_or_else(|e| panic!("{n}: filter: {e}"));
        valid += 1;
    }
    assert!(valid >= 3, "the valid fixtures");
}

fn edge_policy() -> Policy {
    let text = std::fs::read_to_string(dir().join("edge.yaml")).unwrap();
    let imported = import(
        &[Source {
            name: "edge.yaml",
            text: &text,
        }],
        "v",
    )
    .unwrap();
    Policy::from_node(&policy_file::parse_yaml(&imported.policy_yaml).unwrap()).unwrap()
}

/// The imported rules decide like the source's: the matched rule and the
/// plan of each descriptor of envoyproxy/ratelimit's examples.
#[test]
fn the_imported_rules_match_descriptors_as_the_source_does() {
    let p = edge_policy();
    let plan_of = |entries: &[(&str, &str)]| {
        p.descriptors.find("edge_proxy", entries).map(|f| {
            (
                f.rule.path.clone(),
                f.rule.plan.map(|i| p.plans()[i].name.clone()),
            )
        })
    };
    let (path, plan) = plan_of(&[("remote_address", "1.2.3.4")]).unwrap();
    assert_eq!(
        (path.as_str(), plan.as_deref()),
        ("edge_proxy.remote_address", Some("edge_proxy.remote_address"))
    );
    // The blocked address has its own rule: a window of 0, every request over.
    let (path, plan) = plan_of(&[("remote_address", "50.0.0.5")]).unwrap();
    assert_eq!(path, "edge_proxy.remote_address_50.0.0.5");
    let plan = p.plans().iter().find(|x| Some(&x.name) == plan.as_ref()).unwrap();
    assert_eq!((plan.limits[0].rate, plan.limits[0].per_secs), (0, 1));
    let shadow = plan_of(&[("service", "auth"), ("user", "user-a")])
        .unwrap()
        .1
        .unwrap();
    let plan = p.plans().iter().find(|x| x.name == shadow).unwrap();
    assert!(plan.limits[0].shadow);
    assert_eq!(plan.limits[0].per_secs, 1);
    // Shorter than its rule path: no limit.
    assert!(plan_of(&[("service", "auth")]).is_none());
    let replaced = p
        .descriptors
        .find("edge_proxy", &[("key_1", "value_1"), ("user", "bkthomps")])
        .unwrap();
    assert_eq!(replaced.rule.name.as_deref(), Some("specific_limit"));
    let replacing = p
        .descriptors
        .find("edge_proxy", &[("key_2", "value_2"), ("user", "bkthomps")])
        .unwrap();
    assert_eq!(replacing.rule.replaces, ["specific_limit"]);
    assert_eq!(
        plan_of(&[("path", "/api/7/action")]).unwrap().0,
        "edge_proxy.path_/api/*/action"
    );
    assert!(plan_of(&[("path", "/api/7/other")]).is_none());
    let a = p
        .descriptors
        .find("edge_proxy", &[("files", "files/a.pdf")])
        .unwrap();
    let b = p
        .descriptors
        .find("edge_proxy", &[("files", "files/b.csv")])
        .unwrap();
    assert_eq!(a.tenant, b.tenant, "share_threshold: one count");
}

/// The command: several files into one policy, the report on stderr, the
/// policy through `--out`, then `policy check` accepts it.
#[test]
fn the_command_imports_several_files_into_one_policy() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("imported.yaml");
    let run = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .args(["policy", "import", "--version", "from-rls"])
        .args(["database.yaml", "messaging.yaml", "edge.yaml"].map(|f| dir().join(f)))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(stderr.contains("not mapped: "), "{stderr}");
    assert!(stderr.contains("imported: "), "{stderr}");
    let loaded = policy_file::load(&out).unwrap();
    assert_eq!(loaded.policy.version, "from-rls");
    for domain in ["mongo_cps", "messaging", "edge_proxy"] {
        assert!(loaded.policy.descriptors.has_domain(domain), "{domain}");
    }
    let check = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .args(["policy", "check"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(check.status.success());
    // The same domain twice is refused, as envoyproxy/ratelimit refuses it.
    let twice = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .args(["policy", "import"])
        .args(["database.yaml", "database.yaml"].map(|f| dir().join(f)))
        .output()
        .unwrap();
    assert!(!twice.status.success());
    assert!(String::from_utf8_lossy(&twice.stderr).contains("duplicate domain 'mongo_cps'"));
}
