//! Policy golden tests: every policy in `policies/` (and the Istio
//! example's `pluginConfig`) validates; every fixture in
//! `tests/fixtures/invalid/` fails with the message on its first line
//! (`# expect: …`), in the CLI and in the filter's own JSON validation.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::path::{Path, PathBuf};
use std::process::Command;

use tenantgate::policy::{Node, Policy};
use tenantgate_cli::policy_file;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

/// What the filter receives: the document as JSON, via the plugin config.
fn filter_validation(document: &Node) -> Result<Policy, String> {
    Policy::from_json(document.to_json().as_bytes()).map_err(|e| e.to_string())
}

fn cli_check(file: &Path) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .args(["policy", "check"])
        .arg(file)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn every_policy_in_policies_validates_in_the_cli_and_the_filter() {
    let files = yaml_files(&repo().join("policies"));
    assert!(
        files.len() >= 2,
        "policies/ should hold the demo and the examples"
    );
    for file in files {
        let loaded = policy_file::load(&file).unwrap_or_else(|e| panic!("{e}"));
        filter_validation(&loaded.document).unwrap_or_else(|e| panic!("{}: filter: {e}", file.display()));
        let (ok, stdout, stderr) = cli_check(&file);
        assert!(ok, "{}: {stderr}", file.display());
        assert!(stdout.starts_with("ok: "), "{stdout}");
    }
}

#[test]
fn every_invalid_fixture_fails_with_its_expected_message() {
    let files = yaml_files(&repo().join("tests/fixtures/invalid"));
    assert!(
        files.len() >= 25,
        "expected at least 25 invalid fixtures, found {}",
        files.len()
    );
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let expected = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{}: first line must be `# expect: <message>`", file.display()));

        // The CLI binary: exit 1, the message on stderr, prefixed by the
        // file and the line and column of the key its path names.
        let (ok, _, stderr) = cli_check(&file);
        assert!(!ok, "{}: the CLI accepted it", file.display());
        let first = stderr.lines().next().unwrap_or_default();
        let located = first
            .strip_prefix(&format!("{}:", file.display()))
            .unwrap_or_else(|| panic!("{}: not prefixed by its file: {first}", file.display()));
        let (at, message) = match located.strip_prefix(' ') {
            // Only a document with no text has no place to point at.
            Some(message) if text.lines().all(|l| l.trim().is_empty() || l.starts_with('#')) => {
                (None, message)
            }
            _ => {
                let (line, rest) = located.split_once(':').unwrap();
                let (column, rest) = rest.split_once(": ").unwrap();
                let at = (line.parse::<usize>(), column.parse::<usize>());
                let (Ok(line), Ok(column)) = at else {
                    panic!("{}: no line:column: {first}", file.display())
                };
                (Some((line, column)), rest)
            }
        };
        assert_eq!(message, expected, "CLI message for {}", file.display());
        if let Some((line, column)) = at {
            assert_located(&text, line, column, expected, &file);
        }

        // The filter: the same document as JSON gets the same first message.
        let document = policy_file::parse_yaml(&text).unwrap();
        let filter = filter_validation(&document)
            .err()
            .unwrap_or_else(|| panic!("{}: filter accepted", file.display()));
        assert_eq!(
            filter.lines().next(),
            Some(expected),
            "filter message for {}",
            file.display()
        );
    }
}

/// The text at `line:column` (1-based) is the key the error's path ends
/// with (`plans.free.limits[0].rate` → `rate`), or, for a field that is
/// missing, the deepest key or list item of its path that is there.
fn assert_located(text: &str, line: usize, column: usize, expected: &str, file: &Path) {
    let at: String = text
        .lines()
        .nth(line - 1)
        .unwrap_or_else(|| panic!("{}: no line {line}", file.display()))
        .chars()
        .skip(column - 1)
        .collect();
    let path = expected.split(": ").next().unwrap();
    if path == "(policy)" {
        return assert_eq!((line, column), (2, 1), "{}", file.display());
    }
    let steps: Vec<&str> = path.split('.').collect();
    let last = steps.last().unwrap();
    // An item of a list (the path's last step, or the deepest one there).
    if path.contains('[') && (last.ends_with(']') || at.starts_with(['{', '[', '-'])) {
        return;
    }
    let keys = steps
        .iter()
        .map(|s| s.split('[').next().unwrap().trim_matches(['"', '\'']));
    assert!(
        keys.rev()
            .any(|k| at.trim_start_matches(['"', '\'']).starts_with(k)),
        "{}:{line}:{column} points at {at:?}, at no key of `{path}`",
        file.display()
    );
}

#[test]
fn the_cli_reports_every_error_and_checks_every_file() {
    let dir = repo().join("tests/fixtures/invalid");
    let out = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .args(["policy", "check"])
        .arg(repo().join("policies/demo.yaml"))
        .arg(dir.join("zero-rate.yaml"))
        .arg(dir.join("bad-mode.yaml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("zero-rate.yaml:5:23: plans.free.limits[0].rate: must be > 0"),
        "{stderr}"
    );
    assert!(
        stderr.contains("bad-mode.yaml:10:1: mode: unknown variant"),
        "{stderr}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok: "));
}

#[test]
fn compile_prints_the_json_the_filter_reads() {
    let out = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .args(["policy", "compile"])
        .arg(repo().join("policies/demo.yaml"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let policy = Policy::from_json(&out.stdout).unwrap();
    assert_eq!(policy.version, "demo-2026-11-30");
}

#[test]
fn apply_refuses_an_invalid_policy_and_leaves_the_file_alone() {
    let dir = tempfile::tempdir().unwrap();
    let ecds = dir.path().join("ecds.yaml");
    std::fs::write(&ecds, "previous").unwrap();
    let wasm = dir.path().join("f.wasm");
    std::fs::write(&wasm, b"\0asm").unwrap();
    let apply = |policy: &str| {
        Command::new(env!("CARGO_BIN_EXE_tenantgate"))
            .args(["policy", "apply"])
            .arg(repo().join(policy))
            .arg("--ecds")
            .arg(&ecds)
            .arg("--wasm")
            .arg(&wasm)
            .output()
            .unwrap()
    };
    let out = apply("tests/fixtures/invalid/zero-rate.yaml");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(std::fs::read_to_string(&ecds).unwrap(), "previous");

    let ok = apply("policies/demo.yaml");
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let resource: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&ecds).unwrap()).unwrap();
    let config = &resource["resources"][0]["typed_config"]["config"]["configuration"]["value"];
    Policy::from_json(config.as_str().unwrap().as_bytes()).unwrap();
}

/// istiod hands a WasmPlugin's `pluginConfig` (a protobuf Struct) to Envoy as
/// JSON: every number becomes a double. Render the example that way.
fn as_istiod_json(node: &Node) -> String {
    match node {
        Node::Null => "null".into(),
        Node::Bool(b) => b.to_string(),
        Node::U64(n) => render_double(*n as f64),
        Node::I64(n) => render_double(*n as f64),
        Node::F64(n) => render_double(*n),
        Node::Str(s) => serde_json::Value::from(s.as_str()).to_string(),
        Node::Seq(items) => format!(
            "[{}]",
            items.iter().map(as_istiod_json).collect::<Vec<_>>().join(",")
        ),
        Node::Map(entries) => format!(
            "{{{}}}",
            entries
                .iter()
                .map(|(k, v)| format!("{}:{}", serde_json::Value::from(k.as_str()), as_istiod_json(v)))
                .collect::<Vec<_>>()
                .join(",")
        ),
    }
}

/// The least friendly rendering a double may get: exponent form from 1e6.
fn render_double(f: f64) -> String {
    if f.abs() >= 1e6 {
        format!("{f:e}").replace('e', "e+")
    } else {
        format!("{f:?}") // 100.0
    }
}

/// The `pluginConfig` of the Istio example's WasmPlugin.
fn istio_plugin_config() -> Node {
    let text = std::fs::read_to_string(repo().join("envoy/istio/wasmplugin.yaml")).unwrap();
    let mut plugin_configs = Vec::new();
    for doc in text.split("\n---") {
        let node = policy_file::parse_yaml(doc).unwrap();
        let Node::Map(entries) = &node else { continue };
        let kind = entries.iter().find(|(k, _)| k == "kind").map(|(_, v)| v.clone());
        if kind != Some(Node::Str("WasmPlugin".into())) {
            continue;
        }
        let spec = entries.iter().find(|(k, _)| k == "spec").map(|(_, v)| v).unwrap();
        let Node::Map(spec) = spec else {
            panic!("spec is not a mapping")
        };
        let config = spec
            .iter()
            .find(|(k, _)| k == "pluginConfig")
            .map(|(_, v)| v)
            .unwrap();
        plugin_configs.push(config.clone());
    }
    assert_eq!(plugin_configs.len(), 1, "one WasmPlugin in the example");
    plugin_configs.remove(0)
}

#[test]
fn the_istio_wasmplugin_example_validates_as_istiod_delivers_it() {
    let json = as_istiod_json(&istio_plugin_config());
    assert!(
        json.contains(".0") || json.contains("e+"),
        "numbers are doubles: {json}"
    );
    let policy = Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}\n{json}"));
    // And it is the same policy as the demo's, but for the demo's `global`
    // plan (`demo-global`), which needs the central service `make run`
    // starts beside its Envoys (central-mtls.yaml shows it for Istio).
    let demo = policy_file::load(&repo().join("policies/demo.yaml")).unwrap();
    assert_eq!(policy.version, demo.policy.version);
    let local: Vec<_> = demo
        .policy
        .plans()
        .iter()
        .filter(|p| p.name != "global")
        .collect();
    assert_eq!(
        format!("{:?}", policy.plans().iter().collect::<Vec<_>>()),
        format!("{local:?}")
    );
}

/// The EnvoyFilter variant of the Istio example carries the capability
/// allow-list and VM configuration `tenantgate policy apply` writes for its
/// policy, and its policy is the WasmPlugin's.
#[test]
fn the_istio_envoyfilter_example_carries_the_list_policy_apply_writes() {
    use tenantgate_cli::ecds;
    let text = std::fs::read_to_string(repo().join("envoy/istio/envoyfilter.yaml")).unwrap();
    let doc: serde_json::Value = serde_norway::from_str(&text).unwrap();
    let patches = doc["spec"]["configPatches"].as_array().unwrap();
    let patch = |apply_to: &str| {
        let found: Vec<_> = patches.iter().filter(|p| p["applyTo"] == apply_to).collect();
        assert_eq!(found.len(), 1, "one {apply_to} patch");
        found[0]["patch"]["value"].clone()
    };
    let (extension, filter) = (patch("EXTENSION_CONFIG"), patch("HTTP_FILTER"));
    assert_eq!(filter["name"], extension["name"], "the filter names the resource");
    let config = &extension["typed_config"]["config"];
    let policy_json = config["configuration"]["value"].as_str().unwrap();
    let policy = Policy::from_json(policy_json.as_bytes()).unwrap_or_else(|e| panic!("{e}"));

    let caps = ecds::Capabilities::for_events(&tenantgate::pipeline::events(&policy));
    let resource = ecds::Resource {
        name: "tenantgate",
        vm_id: "tenantgate",
        wasm: Path::new("tenantgate.wasm"),
        module: None,
        capabilities: Some(&caps),
    };
    let written: serde_json::Value =
        serde_json::from_str(&resource.render(policy_json, Path::new("/tenantgate.wasm"))).unwrap();
    let vm = &written["resources"][0]["typed_config"]["config"]["vm_config"];
    for field in [
        "capability_restriction_config",
        "configuration",
        "vm_id",
        "runtime",
    ] {
        assert_eq!(config["vm_config"][field], vm[field], "vm_config.{field}");
    }

    let plugin: serde_json::Value = serde_json::from_str(&istio_plugin_config().to_json()).unwrap();
    let carried: serde_json::Value = serde_json::from_str(policy_json).unwrap();
    assert_eq!(carried, plugin, "the WasmPlugin's policy");
}

/// `deploy/wasm/` is what `make manifests` writes from `policies/gateway.yaml`.
#[test]
fn the_deploy_manifests_are_what_policy_apply_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .current_dir(repo())
        .args(["policy", "apply", "policies/gateway.yaml", "--manifests"])
        .arg(tmp.path())
        .args(["--wasm-sha256", &"0".repeat(64)])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let committed = repo().join("deploy/wasm");
    let mut files = 0;
    for entry in std::fs::read_dir(tmp.path()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        let fresh = std::fs::read_to_string(&path).unwrap();
        let kept = std::fs::read_to_string(committed.join(name))
            .unwrap_or_else(|e| panic!("deploy/wasm/{}: {e} (run make manifests)", name.to_string_lossy()));
        assert_eq!(
            fresh,
            kept,
            "deploy/wasm/{} is stale: run make manifests",
            name.to_string_lossy()
        );
        files += 1;
    }
    assert_eq!(files, 4);
}

fn yaml_field<'a>(node: &'a Node, path: &[&str]) -> &'a Node {
    path.iter().fold(node, |n, key| match n {
        Node::Map(entries) => entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
            .unwrap_or_else(|| panic!("no {key}")),
        Node::Seq(items) => &items[key.parse::<usize>().unwrap()],
        _ => panic!("{key}: not a mapping"),
    })
}

/// Each manifest `policy apply --manifests` writes carries exactly the
/// policy JSON that `policy apply --ecds` writes, which is what the
/// real-Envoy tests load: Envoy Gateway's `config` is that JSON (it reaches
/// Envoy as a StringValue of it), and Istio's `pluginConfig`, rendered as
/// istiod renders a Struct, is the same policy to the filter.
#[test]
fn the_manifests_carry_exactly_the_policy_the_ecds_resource_carries() {
    let tmp = tempfile::tempdir().unwrap();
    let ecds = tmp.path().join("ecds.yaml");
    let fake_wasm = tmp.path().join("f.wasm");
    std::fs::write(&fake_wasm, b"\0asm\x01\0\0\0").unwrap();
    for policy in ["policies/gateway.yaml", "policies/demo.yaml"] {
        let dir = tmp.path().join("m");
        let out = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
            .current_dir(repo())
            .args(["policy", "apply", policy, "--ecds"])
            .arg(&ecds)
            .arg("--wasm")
            .arg(&fake_wasm)
            .arg("--manifests")
            .arg(&dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let resource: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&ecds).unwrap()).unwrap();
        let ecds_json = resource["resources"][0]["typed_config"]["config"]["configuration"]["value"]
            .as_str()
            .unwrap()
            .to_owned();
        let ecds_policy = Policy::from_json(ecds_json.as_bytes()).unwrap();
        let ecds_value: serde_json::Value = serde_json::from_str(&ecds_json).unwrap();
        let sha = tenantgate_cli::oci::wasm_sha256(b"\0asm\x01\0\0\0");
        for (file, path) in [
            ("envoy-gateway-image.yaml", &["spec", "wasm", "0", "config"][..]),
            ("envoy-gateway-http.yaml", &["spec", "wasm", "0", "config"][..]),
            ("istio-wasmplugin.yaml", &["spec", "pluginConfig"][..]),
            (
                "istio-trafficextension.yaml",
                &["spec", "wasm", "pluginConfig"][..],
            ),
        ] {
            let text = std::fs::read_to_string(dir.join(file)).unwrap();
            let doc = policy_file::parse_yaml(&text).unwrap();
            let config = yaml_field(&doc, path);
            let as_json: serde_json::Value = serde_json::from_str(&config.to_json()).unwrap();
            assert_eq!(as_json, ecds_value, "{policy}: {file}");
            let delivered = if file.starts_with("istio") {
                as_istiod_json(config)
            } else {
                config.to_json()
            };
            let filter = Policy::from_json(delivered.as_bytes()).unwrap();
            let (diff, differs) = tenantgate_cli::explain::diff(&ecds_policy, &filter);
            assert!(!differs, "{policy}: {file}: {diff}");
            if file == "envoy-gateway-http.yaml" {
                let Node::Str(s) = yaml_field(&doc, &["spec", "wasm", "0", "code", "http", "sha256"]) else {
                    panic!("sha256")
                };
                assert_eq!(*s, sha, "the --wasm file's sha256");
            }
        }
    }
}
