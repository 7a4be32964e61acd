//! docs/envoy-gateway.md and docs/istio.md, the steps that can run without
//! a cluster, as written: the blocks marked `<!-- runs here -->` run in
//! bash (with `TG`, `WASM`, `REPO` and `WORK` set as the pages'
//! prerequisites set them), then what they wrote is checked without
//! `kubectl`: each manifest parses, is the kind the page applies, names the
//! image by the digest `tenantgate package` printed (and that digest is the
//! image layout's), targets the route or workloads the page names, is under
//! the API server's object size limit, and carries a policy the filter
//! accepts (on Istio, as istiod delivers it: every number a double). Every
//! file a `kubectl` line names was written; every YAML block parses as a
//! Kubernetes object; the headers the pages promise are `policy explain`'s.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use tenantgate::policy::Policy;

/// The API server's limit on one object (etcd's request size, 1.5 MiB).
const MAX_OBJECT_BYTES: usize = 1_572_864;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn blocks<'a>(page: &'a str, fence: &str) -> Vec<(bool, &'a str)> {
    let mut found = Vec::new();
    let mut rest = page;
    while let Some(start) = rest.find(fence) {
        let before = &rest[..start];
        let marked = before
            .trim_end()
            .ends_with("<!-- runs here: cli/tests/task_pages.rs -->");
        let body = &rest[start + fence.len()..];
        let end = body.find("```").unwrap();
        // Indented blocks (inside a list) keep their indentation: strip it.
        found.push((marked, &body[..end]));
        rest = &body[end + 3..];
    }
    found
}

struct Ran {
    work: tempfile::TempDir,
    vars: BTreeMap<String, String>,
    wasm: PathBuf,
}

/// Runs the page's marked blocks; the shell variables they set.
fn run_marked(page: &str, name: &str) -> Ran {
    let work = tempfile::tempdir().unwrap();
    let wasm = match std::env::var_os("TENANTGATE_WASM").map(PathBuf::from) {
        Some(w) if w.exists() => w,
        _ => {
            let w = work.path().join("tenantgate.wasm");
            std::fs::write(&w, b"\0asm\x01\0\0\0 a stand-in module").unwrap();
            w
        }
    };
    let marked: Vec<&str> = blocks(page, "```sh\n")
        .into_iter()
        .filter(|(m, _)| *m)
        .map(|(_, b)| b)
        .collect();
    assert_eq!(marked.len(), 1, "{name}: one block runs here");
    let script = format!(
        "set -euo pipefail\n{}\nfor v in VERSION REGISTRY NAMESPACE DIGEST HTTP_ROUTE APP; do echo \"VAR $v=${{!v:-}}\"; done\n",
        marked[0]
    );
    let out = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(repo())
        .env("TG", env!("CARGO_BIN_EXE_tenantgate"))
        .env("WASM", &wasm)
        .env("REPO", repo())
        .env("WORK", work.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{name}:\n{script}\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let vars = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("VAR "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    Ran { work, vars, wasm }
}

fn manifest(ran: &Ran, file: &str) -> Value {
    let path = ran.work.path().join("manifests").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(text.len() < MAX_OBJECT_BYTES, "{file}: {} bytes", text.len());
    let yaml: serde_norway::Value = serde_norway::from_str(&text).unwrap();
    serde_json::to_value(yaml).unwrap()
}

/// The digest of the image layout the page wrote, as its index names it.
fn layout_digest(ran: &Ran) -> String {
    let index = std::fs::read_to_string(ran.work.path().join("oci/filter/index.json")).unwrap();
    let index: Value = serde_json::from_str(&index).unwrap();
    index["manifests"][0]["digest"].as_str().unwrap().to_owned()
}

fn accepts(policy: &Value, what: &str) {
    let json = serde_json::to_vec(policy).unwrap();
    Policy::from_json(&json).unwrap_or_else(|e| panic!("{what}: the filter refuses the policy: {e}"));
}

/// Every integer a double, as istiod turns a `Struct` into JSON.
fn as_doubles(v: &Value) -> Value {
    match v {
        Value::Number(n) => n.as_f64().map(Value::from).unwrap(),
        Value::Array(items) => Value::Array(items.iter().map(as_doubles).collect()),
        Value::Object(map) => Value::Object(map.iter().map(|(k, v)| (k.clone(), as_doubles(v))).collect()),
        other => other.clone(),
    }
}

/// The checks shared by both pages: the digest, the files `kubectl` lines
/// name, the YAML blocks, the promised headers.
fn common(page: &str, name: &str, ran: &Ran) -> String {
    let digest = &ran.vars["DIGEST"];
    assert!(
        digest.len() == 71 && digest.starts_with("sha256:"),
        "{name}: digest {digest:?}"
    );
    assert_eq!(
        *digest,
        layout_digest(ran),
        "{name}: the printed digest is the layout's"
    );
    for line in page
        .lines()
        .filter(|l| l.contains("kubectl") && l.contains("$WORK/manifests/"))
    {
        let file = line.split("$WORK/manifests/").nth(1).unwrap();
        let file: String = file.chars().take_while(|c| *c != '"').collect();
        assert!(
            ran.work.path().join("manifests").join(&file).exists(),
            "{name}: `{line}` names {file}, which was not written"
        );
    }
    for (_, block) in blocks(page, "```yaml\n") {
        let v: serde_norway::Value =
            serde_norway::from_str(block).unwrap_or_else(|e| panic!("{name}: {e}\n{block}"));
        assert!(
            v["apiVersion"].is_string() && v["kind"].is_string(),
            "{name}: {block}"
        );
    }
    let promised: Vec<&str> = blocks(page, "```text\n")
        .into_iter()
        .flat_map(|(_, b)| b.lines())
        .filter(|l| l.starts_with("ratelimit"))
        .collect();
    let explain = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .args([
            "policy",
            "explain",
            "policies/gateway.yaml",
            "--tenant",
            "demo-paid",
            "--class",
            "api",
        ])
        .current_dir(repo())
        .output()
        .unwrap();
    let explain = String::from_utf8(explain.stdout).unwrap();
    let printed: Vec<&str> = explain
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("ratelimit"))
        .collect();
    assert_eq!(promised, printed, "{name}: the headers it promises");
    format!("{}/filter:{}@{digest}", ran.vars["REGISTRY"], ran.vars["VERSION"])
}

#[test]
fn the_envoy_gateway_page_runs_as_written() {
    let page = std::fs::read_to_string(repo().join("docs/envoy-gateway.md")).unwrap();
    let ran = run_marked(&page, "docs/envoy-gateway.md");
    let image = common(&page, "docs/envoy-gateway.md", &ran);
    let wasm_sha256 = tenantgate_cli::oci::wasm_sha256(&std::fs::read(&ran.wasm).unwrap());
    for file in ["envoy-gateway-image.yaml", "envoy-gateway-http.yaml"] {
        let m = manifest(&ran, file);
        assert_eq!(m["apiVersion"], "gateway.envoyproxy.io/v1alpha1", "{file}");
        assert_eq!(m["kind"], "EnvoyExtensionPolicy", "{file}");
        assert_eq!(
            m["metadata"]["namespace"],
            ran.vars["NAMESPACE"].as_str(),
            "{file}"
        );
        let target = &m["spec"]["targetRefs"][0];
        assert_eq!(target["kind"], "HTTPRoute", "{file}");
        assert_eq!(target["name"], ran.vars["HTTP_ROUTE"].as_str(), "{file}");
        let wasm = &m["spec"]["wasm"][0];
        match wasm["code"]["type"].as_str() {
            Some("Image") => assert_eq!(wasm["code"]["image"]["url"], image.as_str(), "{file}"),
            Some("HTTP") => assert_eq!(wasm["code"]["http"]["sha256"], wasm_sha256.as_str(), "{file}"),
            other => panic!("{file}: code type {other:?}"),
        }
        accepts(&wasm["config"], file);
    }
}

#[test]
fn the_istio_page_runs_as_written() {
    let page = std::fs::read_to_string(repo().join("docs/istio.md")).unwrap();
    let ran = run_marked(&page, "docs/istio.md");
    let image = common(&page, "docs/istio.md", &ran);
    for (file, kind) in [
        ("istio-trafficextension.yaml", "TrafficExtension"),
        ("istio-wasmplugin.yaml", "WasmPlugin"),
    ] {
        let m = manifest(&ran, file);
        assert_eq!(m["apiVersion"], "extensions.istio.io/v1alpha1", "{file}");
        assert_eq!(m["kind"], kind, "{file}");
        assert_eq!(
            m["metadata"]["namespace"],
            ran.vars["NAMESPACE"].as_str(),
            "{file}"
        );
        let spec = &m["spec"];
        assert_eq!(
            spec["selector"]["matchLabels"]["app"],
            ran.vars["APP"].as_str(),
            "{file}"
        );
        // TrafficExtension nests the module's fields under `wasm`.
        let wasm = if kind == "TrafficExtension" {
            &spec["wasm"]
        } else {
            spec
        };
        assert_eq!(wasm["url"], format!("oci://{image}").as_str(), "{file}");
        assert_eq!(wasm["failStrategy"], "FAIL_CLOSE", "{file}");
        accepts(&as_doubles(&wasm["pluginConfig"]), file);
    }
}
