//! The three ways of classifying, in a real Envoy 1.40: route metadata
//! (then the route name), `classify: route_name`, and one filter instance
//! per class enabled per route with Envoy's `FilterConfig`. Only route
//! configuration decides the class: a client's headers never do.
//!
//! Each response's `RateLimit` header tells the class: `search` costs 5 of
//! a fresh tenant's 10, `api` costs 1.

use std::path::Path;
use std::process::Command;

use tenantgate_integration_tests::{cli_bin, free_port, get, wasm_file, Envoy};

const POLICY: &str = r#"
version: "classify"
identity: { header: x-tenant-id }
plans:
  free: { limits: [ { rate: 1, per: 1m, burst: 10 } ] }
default_plan: free
anonymous: { plan: free }
routes:
  api: {}
  search: { cost: 5 }
default_route: api
"#;

fn apply(policy: &Path, ecds: &Path, name: &str, extra: &[&str]) {
    let out = Command::new(cli_bin())
        .args(["policy", "apply"])
        .arg(policy)
        .arg("--ecds")
        .arg(ecds)
        .args(["--wasm"])
        .arg(wasm_file())
        .args(["--name", name])
        .args(extra)
        .output()
        .expect("run tenantgate");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn ecds_filter(name: &str, path: &Path, disabled: bool) -> String {
    format!(
        r#"          - name: {name}
            disabled: {disabled}
            config_discovery:
              config_source: {{ path_config_source: {{ path: {} }}, resource_api_version: V3 }}
              type_urls: ["type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"]
"#,
        path.display()
    )
}

fn listener(name: &str, port: u16, routes: &str, filters: &str) -> String {
    format!(
        r#"  - name: {name}
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
{routes}
          http_filters:
{filters}          - name: envoy.filters.http.router
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}
"#
    )
}

/// A direct-response route; `class` in its metadata, `enable` a filter
/// instance by `FilterConfig`.
fn route(name: &str, prefix: &str, class: Option<&str>, enable: Option<&str>) -> String {
    let mut r = format!("              - name: {name}\n                match: {{ prefix: {prefix} }}\n");
    if let Some(c) = class {
        r +=
            &format!("                metadata: {{ filter_metadata: {{ tenantgate: {{ class: {c} }} }} }}\n");
    }
    if let Some(f) = enable {
        r += &format!(
            "                typed_per_filter_config:\n                  {f}: {{ \"@type\": type.googleapis.com/envoy.config.route.v3.FilterConfig, config: {{}} }}\n"
        );
    }
    r + "                direct_response: { status: 200, body: { inline_string: \"ok\\n\" } }\n"
}

/// The class a request was charged as, from a fresh tenant's `RateLimit`.
fn class_of(port: u16, path: &str, tenant: &str) -> &'static str {
    // The client claims `api` everywhere; it must change nothing.
    let r = get(
        port,
        path,
        &[("x-tenant-id", tenant), ("x-tenantgate-class", "api")],
    );
    assert_eq!(r.status, 200, "{path}");
    match r.header("ratelimit") {
        Some(v) if v.contains(";r=5;") => "search",
        Some(v) if v.contains(";r=9;") => "api",
        Some(v) => panic!("{path}: unexpected ratelimit {v}"),
        None => "unmetered",
    }
}

#[test]
fn each_way_of_classifying_takes_the_class_from_route_configuration_only() {
    let dir = Envoy::temp_dir();
    let policy = dir.join("policy.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let by_name = dir.join("by-name.yaml");
    std::fs::write(&by_name, format!("{POLICY}classify: route_name\n")).unwrap();
    let (meta_ecds, name_ecds, inst_ecds) = (
        dir.join("meta.yaml"),
        dir.join("name.yaml"),
        dir.join("inst.yaml"),
    );
    apply(&policy, &meta_ecds, "tg-meta", &[]);
    apply(&by_name, &name_ecds, "tg-name", &[]);
    apply(&policy, &inst_ecds, "tg-inst", &["--instances"]);
    for class in ["api", "search"] {
        assert!(
            dir.join(format!("inst.{class}.yaml")).exists(),
            "instance file of {class}"
        );
    }

    let (meta_port, name_port, inst_port, admin) = (free_port(), free_port(), free_port(), free_port());
    let meta_routes = [
        route("by-meta", "/meta", Some("search"), None),
        route("search", "/name", None, None),
        route("api", "/both", Some("search"), None),
        route("nameless", "/", None, None),
    ]
    .concat();
    let name_routes = [
        route("search", "/search", Some("api"), None),
        route("other", "/", Some("search"), None),
    ]
    .concat();
    let inst_routes = [
        route("s", "/search", Some("api"), Some("tg-inst.search")),
        route("a", "/api", Some("search"), Some("tg-inst.api")),
        route("none", "/", Some("search"), None),
    ]
    .concat();
    let inst_filters = [
        ecds_filter("tg-inst.api", &dir.join("inst.api.yaml"), true),
        ecds_filter("tg-inst.search", &dir.join("inst.search.yaml"), true),
    ]
    .concat();
    let bootstrap = format!(
        "node: {{ id: classify, cluster: classify }}\nadmin:\n  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}\nstatic_resources:\n  listeners:\n{}{}{}",
        listener("meta", meta_port, &meta_routes, &ecds_filter("tg-meta", &meta_ecds, false)),
        listener("name", name_port, &name_routes, &ecds_filter("tg-name", &name_ecds, false)),
        listener("inst", inst_port, &inst_routes, &inst_filters),
    );
    let envoy = Envoy::launch(dir.clone(), &bootstrap, inst_port, free_port(), admin, inst_ecds);
    let loaded = |name: &str| {
        envoy
            .stat(&format!(
                "extension_config_discovery.http_filter.{name}.config_reload"
            ))
            .unwrap_or(0)
            > 0
    };
    assert!(
        tenantgate_integration_tests::wait_for(std::time::Duration::from_secs(10), || {
            ["tg-meta", "tg-name", "tg-inst.api", "tg-inst.search"]
                .iter()
                .all(|n| loaded(n))
        }),
        "filters not loaded:\n{}",
        envoy.log_tail()
    );

    // Route metadata first, then the route's name, then the default class.
    assert_eq!(class_of(meta_port, "/meta", "m1"), "search");
    assert_eq!(class_of(meta_port, "/name", "m2"), "search");
    assert_eq!(
        class_of(meta_port, "/both", "m3"),
        "search",
        "metadata wins over the name"
    );
    assert_eq!(class_of(meta_port, "/x", "m4"), "api", "default_route");
    // `classify: route_name`: only the route's name; metadata is not read.
    assert_eq!(class_of(name_port, "/search", "n1"), "search");
    assert_eq!(
        class_of(name_port, "/x", "n2"),
        "api",
        "unknown name: default_route"
    );
    // One instance per class: the enabled instance decides, nothing else.
    assert_eq!(class_of(inst_port, "/search", "i1"), "search");
    assert_eq!(class_of(inst_port, "/api", "i2"), "api");
    assert_eq!(
        class_of(inst_port, "/x", "i3"),
        "unmetered",
        "no instance enabled"
    );
    // A client cannot pick an instance or a class: the same tenant on the
    // api route stays api with any header.
    let r = get(
        inst_port,
        "/api",
        &[
            ("x-tenant-id", "i2"),
            ("x-tenantgate-class", "search"),
            ("x-envoy-filter", "tg-inst.search"),
        ],
    );
    assert_eq!(r.header("ratelimit"), Some(r#""free";r=8;t=59"#));
    // The four configurations (same vm_id, code and VM settings) share
    // their VMs: fewer than one per configuration and worker.
    let vms = envoy.stat("wasm.envoy.wasm.runtime.v8.active").unwrap_or(0);
    assert!(
        vms > 0 && vms < 4 * tenantgate_integration_tests::WORKERS,
        "{vms} active VMs"
    );
}
