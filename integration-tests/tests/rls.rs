//! Envoy's rate limit service (RLS) served by `tenantgate serve
//! --grpc-listen`, against a real Envoy 1.40 running its native
//! `envoy.filters.http.ratelimit` filter (no wasm): limits per descriptor
//! (a tenant each, a more specific rule for one tenant, a nested rule),
//! the cost (`hits_addend`), a shadow limit, the answer's headers (ours and
//! the filter's `x-ratelimit-*` from `limit_remaining` and
//! `duration_until_reset`), and the service down: the filter's own
//! failure mode, open on one listener and closed on the other.

use std::process::Command;
use std::time::Duration;

use tenantgate_integration_tests::cluster::Serve;
use tenantgate_integration_tests::upstream::Upstream;
use tenantgate_integration_tests::{free_port, get, wait_for, Envoy};

const POLICY: &str = r#"
version: "rls-1"
identity: { header: x-tenant-id }
plans:
  per_tenant: { limits: [ { rate: 5, per: 1d } ] }
  vip:        { limits: [ { algorithm: fixed_window, rate: 100, per: 1d } ] }
  search:     { limits: [ { rate: 5, per: 1d } ] }
  watch:      { limits: [ { rate: 2, per: 1d, shadow: true } ] }
default_plan: per_tenant
anonymous: { plan: per_tenant }
routes: { api: {} }
default_route: api
descriptors:
  shop:
    - key: tenant
      plan: per_tenant
    - key: tenant
      value: vip
      plan: vip
    - key: watched
      plan: watch
    - key: route
      value: search
      descriptors:
        - key: tenant
          plan: search
"#;

/// Two listeners with the native ratelimit filter in front of `upstream`:
/// `port` fails open (`failure_mode_deny: false`), `closed_port` fails
/// closed. `/search` sends (route, search), (tenant, T); `x-cost` sets
/// the request's `hits_addend`.
fn bootstrap(port: u16, closed_port: u16, admin: u16, upstream: u16, rls: u16) -> String {
    let listener = |name: &str, port: u16, deny: bool| {
        format!(
            r#"
  - name: {name}
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
              - match: {{ prefix: /search }}
                route:
                  cluster: upstream
                  rate_limits:
                  - actions:
                    - generic_key: {{ descriptor_key: route, descriptor_value: search }}
                    - request_headers: {{ header_name: x-tenant-id, descriptor_key: tenant }}
              - match: {{ prefix: / }}
                route:
                  cluster: upstream
                  rate_limits:
                  - actions:
                    - request_headers: {{ header_name: x-tenant-id, descriptor_key: tenant }}
                  - actions:
                    - request_headers: {{ header_name: x-watch, descriptor_key: watched }}
          http_filters:
          # The cost: Envoy's ratelimit filter sends the filter state
          # `envoy.ratelimit.hits_addend` as the request's `hits_addend`.
          - name: envoy.filters.http.set_filter_state
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.set_filter_state.v3.Config
              on_request_headers:
              - object_key: envoy.ratelimit.hits_addend
                format_string: {{ text_format_source: {{ inline_string: "%REQ(x-cost)%" }} }}
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: shop
              timeout: 2s
              failure_mode_deny: {deny}
              enable_x_ratelimit_headers: DRAFT_VERSION_03
              rate_limit_service:
                transport_api_version: V3
                grpc_service: {{ envoy_grpc: {{ cluster_name: rls }} }}
          - name: envoy.filters.http.router
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}"#
        )
    };
    format!(
        r#"
node: {{ id: rls-test, cluster: rls-test }}
admin: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }} }}
static_resources:
  listeners:{open}{closed}
  clusters:
  - name: upstream
    connect_timeout: 1s
    load_assignment:
      cluster_name: upstream
      endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {upstream} }} }} }} }} ] }} ]
  - name: rls
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: rls
      endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {rls} }} }} }} }} ] }} ]
"#,
        open = listener("open", port, false),
        closed = listener("closed", closed_port, true),
    )
}

fn statuses(port: u16, path: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
    (0..n).map(|_| get(port, path, headers).status).collect()
}

#[test]
fn envoys_native_ratelimit_filter_decides_with_tenantgate_serve() {
    let dir = Envoy::temp_dir();
    let policy = dir.join("policy.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let check = Command::new(tenantgate_integration_tests::cli_bin())
        .args(["policy", "check"])
        .arg(&policy)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    let grpc = free_port();
    let mut serve = Serve::start_with(
        &policy,
        "embedded",
        1000,
        free_port(),
        &dir.join("serve.log"),
        &["--grpc-listen".to_owned(), format!("127.0.0.1:{grpc}")],
    );
    let upstream = Upstream::start();
    let (port, closed, admin) = (free_port(), free_port(), free_port());
    let envoy = Envoy::launch(
        dir.clone(),
        &bootstrap(port, closed, admin, upstream.port, grpc),
        port,
        closed,
        admin,
        dir.join("unused-ecds.yaml"),
    );

    // A tenant each: 5 per day, the 6th refused; another tenant untouched.
    let first = get(port, "/api", &[("x-tenant-id", "a")]);
    assert_eq!(first.status, 200, "{first:?}\n{}", envoy.log_tail());
    assert_eq!(
        first.header("ratelimit-policy"),
        Some("\"per_tenant\";q=5;w=86400"),
        "{first:?}"
    );
    assert_eq!(
        first.header("ratelimit"),
        Some("\"per_tenant\";r=4;t=17280"),
        "{first:?}"
    );
    assert_eq!(first.header("x-ratelimit-remaining"), Some("4"), "{first:?}");
    assert!(
        first
            .header("x-ratelimit-limit")
            .is_some_and(|l| l.starts_with("5")),
        "{first:?}"
    );
    assert_eq!(
        statuses(port, "/api", &[("x-tenant-id", "a")], 5),
        [200, 200, 200, 200, 429]
    );
    let refused = get(port, "/api", &[("x-tenant-id", "a")]);
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("x-envoy-ratelimited"), Some("true"), "{refused:?}");
    assert_eq!(
        refused.header("ratelimit"),
        Some("\"per_tenant\";r=0;t=86400"),
        "{refused:?}"
    );
    assert_eq!(statuses(port, "/api", &[("x-tenant-id", "b")], 5), [200; 5]);
    // The more specific rule: `vip` has 100.
    assert_eq!(statuses(port, "/api", &[("x-tenant-id", "vip")], 8), [200; 8]);

    // The cost (`hits_addend` 2, from the request's x-cost): /search
    // charges 2 of 5 per tenant: two pass, the third not.
    let costly = [("x-tenant-id", "c"), ("x-cost", "2")];
    assert_eq!(statuses(port, "/search", &costly, 3), [200, 200, 429]);

    // A shadow limit (2) is reported, never enforced; the tenant's own
    // limit (5) still is, and both count in one request.
    let watched = [("x-tenant-id", "d"), ("x-watch", "w")];
    assert_eq!(
        statuses(port, "/api", &watched, 6),
        [200, 200, 200, 200, 200, 429]
    );

    // The service down: the filter's own failure mode decides.
    let served = upstream.received();
    serve.stop();
    assert_eq!(
        statuses(port, "/api", &[("x-tenant-id", "e")], 3),
        [200; 3],
        "fails open"
    );
    let closed_answers = statuses(closed, "/api", &[("x-tenant-id", "e")], 3);
    assert!(
        closed_answers.iter().all(|&s| s == 500),
        "fails closed: {closed_answers:?}"
    );
    assert_eq!(
        upstream.received(),
        served + 3,
        "only the open listener's requests went upstream"
    );
    assert!(
        wait_for(Duration::from_secs(5), || envoy
            .stat("cluster.upstream.ratelimit.error")
            .unwrap_or(0)
            >= 6),
        "the filter counted its errors: {:?}",
        envoy.stat("cluster.upstream.ratelimit.error")
    );
}
