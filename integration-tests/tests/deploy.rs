//! The dashboard and alerting rules in `deploy/` name only metrics that
//! exist: a real Envoy with the filter loaded and some traffic (global
//! limits syncing with a real `tenantgate serve`), scraped on its
//! `/stats/prometheus`, and the service's `/metrics`; every `tenantgate_*`
//! and `envoy_*` name in the Grafana dashboard's queries and in the
//! Prometheus rules must be among them. `promtool check rules` validates
//! the rules (Debian's `prometheus` package; `make setup` installs it).

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use tenantgate_integration_tests::cluster::Serve;
use tenantgate_integration_tests::{free_port, get, repo, request, wait_for, Envoy, NodeSpec};

const POLICY: &str = r#"
version: "deploy-1"
identity: { header: x-tenant-id }
plans:
  free: { limits: [ { name: global, rate: 100, per: 1m, global: true } ] }
  local: { limits: [ { name: local, rate: 5, per: 1m } ] }
tenants: [ { id: t-local, plan: local } ]
default_plan: free
anonymous: { plan: local }
routes: { api: {} }
default_route: api
sync: { cluster: tenantgate, interval: 500ms, timeout: 200ms, provisional: 2, failure_mode: fail_open_local }
"#;

/// Metric names in a Prometheus text exposition.
fn exposed(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// `tenantgate_*` and `envoy_*` identifiers in `text`.
fn named(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
        .filter(|t| t.starts_with("tenantgate_") || t.starts_with("envoy_"))
        .map(str::to_owned)
        .collect()
}

fn missing(names: &BTreeSet<String>, scraped: &BTreeSet<String>) -> Vec<String> {
    names.difference(scraped).cloned().collect()
}

fn dashboard_exprs() -> String {
    let text = std::fs::read_to_string(repo().join("deploy/grafana/tenantgate.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut exprs = String::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            exprs.push_str(t["expr"].as_str().unwrap());
            exprs.push('\n');
        }
    }
    exprs
}

#[test]
fn the_dashboard_and_the_rules_name_only_metrics_that_exist() {
    let dir = std::env::temp_dir().join(format!("tenantgate-deploy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("policy.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let serve = Serve::start(&policy, "embedded", 500, free_port(), &dir.join("serve.log"));
    let envoy = Envoy::start_node(
        POLICY,
        &NodeSpec {
            id: "deploy-node".into(),
            region: Some("eu".into()),
            sync_ports: vec![serve.port],
            sync_tls: None,
        },
    );
    // Traffic: a global tenant (syncs), and a local one past its limit.
    for _ in 0..10 {
        get(envoy.port, "/api/x", &[("x-tenant-id", "t-global")]);
        get(envoy.port, "/api/x", &[("x-tenant-id", "t-local")]);
    }
    assert!(
        wait_for(Duration::from_secs(10), || envoy.tg_stat("sync.ok") >= 2),
        "no sync: {}",
        envoy.log_tail()
    );
    let envoy_text =
        String::from_utf8_lossy(&envoy.admin_get("/stats/prometheus").unwrap().body).into_owned();
    let serve_text =
        String::from_utf8_lossy(&request(serve.admin_port, "GET", "/metrics", &[]).unwrap().body)
            .into_owned();
    let mut scraped = exposed(&envoy_text);
    scraped.extend(exposed(&serve_text));
    assert!(
        scraped.contains("tenantgate_decisions_rate_limited"),
        "{envoy_text}"
    );
    assert!(scraped.contains("tenantgate_sync_requests_total"), "{serve_text}");

    // The check itself catches a name that does not exist.
    let bogus: BTreeSet<String> = named("rate(tenantgate_no_such_metric[5m])");
    assert_eq!(missing(&bogus, &scraped), ["tenantgate_no_such_metric"]);

    let dash = named(&dashboard_exprs());
    assert!(dash.len() >= 30, "{dash:?}");
    assert_eq!(
        missing(&dash, &scraped),
        Vec::<String>::new(),
        "the dashboard names metrics that do not exist"
    );
    let rules_path = repo().join("deploy/prometheus/tenantgate-rules.yaml");
    let rules = named(&std::fs::read_to_string(&rules_path).unwrap());
    assert!(rules.len() >= 20, "{rules:?}");
    assert_eq!(
        missing(&rules, &scraped),
        Vec::<String>::new(),
        "the rules name metrics that do not exist"
    );
    // Both cover: decisions by reason, sync health and latency, breaker,
    // key table, service errors and store health.
    for want in [
        "tenantgate_decisions_rate_limited",
        "tenantgate_sync_failed",
        "tenantgate_sync_latency_ms_bucket",
        "tenantgate_sync_breaker_opened",
        "tenantgate_key_table_overflows",
        "tenantgate_sync_requests_total",
        "tenantgate_store_up",
        "tenantgate_store_errors_total",
        "tenantgate_sync_duration_seconds_bucket",
    ] {
        assert!(dash.contains(want) && rules.contains(want), "{want} not in both");
    }
    println!(
        "dashboard: {} metrics, rules: {} metrics, all among {} scraped",
        dash.len(),
        rules.len(),
        scraped.len()
    );

    let promtool = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&rules_path)
        .output()
        .expect("promtool (Debian package `prometheus`; `make setup` installs it)");
    assert!(
        promtool.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&promtool.stdout),
        String::from_utf8_lossy(&promtool.stderr)
    );
}

/// The policy line of a `deploy/wasm/` manifest: its JSON (one line).
fn manifest_policy(file: &str, field: &str) -> String {
    let text = std::fs::read_to_string(repo().join("deploy/wasm").join(file)).unwrap();
    text.lines()
        .find_map(|l| l.trim_start().strip_prefix(field))
        .unwrap_or_else(|| panic!("{file}: no {field}"))
        .to_owned()
}

/// The policy `deploy/wasm/`'s Envoy Gateway and Istio manifests carry,
/// loaded into a real Envoy as ECDS carries it: it limits, answers the
/// limits endpoint, and is the same in all four manifests.
#[test]
fn the_deploy_manifests_policy_runs_in_a_real_envoy() {
    let policy = manifest_policy("envoy-gateway-image.yaml", "config: ");
    for (file, field) in [
        ("envoy-gateway-http.yaml", "config: "),
        ("istio-wasmplugin.yaml", "pluginConfig: "),
        ("istio-trafficextension.yaml", "pluginConfig: "),
    ] {
        assert_eq!(manifest_policy(file, field), policy, "{file}");
    }
    let envoy = Envoy::start(&policy);
    let paid = get(envoy.port, "/api/x", &[("x-tenant-id", "demo-paid")]);
    assert_eq!(paid.status, 200);
    assert_eq!(paid.header("ratelimit-policy"), Some("\"paid\";q=10000;w=60"));
    let free = get(envoy.port, "/api/x", &[("x-tenant-id", "someone")]);
    assert_eq!(free.header("ratelimit-policy"), Some("\"free\";q=100;w=60"));
    let own = get(
        envoy.port,
        "/.well-known/ratelimit",
        &[("x-tenant-id", "demo-paid")],
    );
    assert_eq!(own.status, 200);
    assert_eq!(own.json()["plan"], "paid", "{:?}", own.json());
}
