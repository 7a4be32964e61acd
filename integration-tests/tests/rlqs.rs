//! Envoy's rate limit quota service (RLQS) served by `tenantgate serve
//! --grpc-listen`, against two real Envoy 1.40s running the native
//! `envoy.filters.http.rate_limit_quota` filter (no wasm): one tenant's
//! global limit shared by both within the bound the service states
//! (`tenantgate_central::grpc::rlqs`, THE BOUND), the admitted requests
//! reported back and counted; an unlimited rule and a bucket no rule
//! matches answered `ALLOW_ALL`; another tenant's key untouched; and the
//! service down: the filter's own `no_assignment_behavior`.
//!
//! The filter runs at Envoy's defaults (it has no per-request timeout: a
//! request never waits on the stream), and the test fails if either Envoy's
//! `rlqs` cluster counted a timeout, a reset or a lost stream while the
//! service was up.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tenantgate_integration_tests::cluster::Serve;
use tenantgate_integration_tests::upstream::Upstream;
use tenantgate_integration_tests::{free_port, get, request, wait_for, Envoy};

/// 30 per 10 s with a capacity of 6 for each tenant; `vip` unlimited.
const RATE: u64 = 30;
const PER_SECS: u64 = 10;
const BURST: u64 = 6;
const POLICY: &str = r#"
version: "rlqs-1"
identity: { header: x-tenant-id }
plans:
  shared: { limits: [ { rate: 30, per: 10s, burst: 6 } ] }
default_plan: shared
anonymous: { plan: shared }
routes: { api: {} }
default_route: api
descriptors:
  shop:
    - key: tenant
      plan: shared
    - key: tenant
      value: vip
      unlimited: true
"#;
/// How long both Envoys are loaded.
const LOAD: Duration = Duration::from_secs(20);
/// The pace of each Envoy's load (far above its share).
const EVERY: Duration = Duration::from_millis(50);

/// The filter, grouping requests by `x-tenant-id` (bucket `{tenant: …}`)
/// or `x-team` (`{team: …}`, which no rule of the policy names), with
/// `no_assignment_behavior` `no_assignment` until the service's first
/// answer.
fn filter(no_assignment: &str) -> String {
    let bucket = |key: &str, header: &str| {
        format!(
            r#"
                  - predicate:
                      single_predicate:
                        input:
                          name: {key}
                          typed_config:
                            "@type": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput
                            header_name: {header}
                        value_match: {{ safe_regex: {{ google_re2: {{}}, regex: ".+" }} }}
                    on_match:
                      action:
                        name: {key}
                        typed_config:
                          "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings
                          bucket_id_builder:
                            bucket_id_builder:
                              {key}:
                                custom_value:
                                  name: {key}
                                  typed_config:
                                    "@type": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput
                                    header_name: {header}
                          reporting_interval: 5s
                          no_assignment_behavior: {{ fallback_rate_limit: {{ blanket_rule: {no_assignment} }} }}"#
        )
    };
    format!(
        r#"
          - name: envoy.filters.http.rate_limit_quota
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig
              rlqs_server: {{ envoy_grpc: {{ cluster_name: rlqs }} }}
              domain: shop
              bucket_matchers:
                matcher_list:
                  matchers:{tenant}{team}"#,
        tenant = bucket("tenant", "x-tenant-id"),
        team = bucket("team", "x-team"),
    )
}

fn listener(name: &str, port: u16, upstream_filter: &str) -> String {
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
              routes: [ {{ match: {{ prefix: / }}, route: {{ cluster: upstream }} }} ]
          http_filters:{upstream_filter}
          - name: envoy.filters.http.router
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}"#
    )
}

/// One Envoy: `strict` (no assignment: `DENY_ALL`) and `open` (`ALLOW_ALL`)
/// listeners, each its own filter and so its own RLQS stream.
fn bootstrap(node: &str, strict: u16, open: u16, admin: u16, upstream: u16, rlqs: u16) -> String {
    let endpoint = |port: u16| {
        format!("[ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }} }} }} ] }} ]")
    };
    format!(
        r#"
node: {{ id: {node}, cluster: rlqs-test }}
admin: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }} }}
static_resources:
  listeners:{strict}{open}
  clusters:
  - name: upstream
    connect_timeout: 1s
    load_assignment: {{ cluster_name: upstream, endpoints: {up} }}
  - name: rlqs
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment: {{ cluster_name: rlqs, endpoints: {rl} }}
"#,
        strict = listener("strict", strict, &filter("DENY_ALL")),
        open = listener("open", open, &filter("ALLOW_ALL")),
        up = endpoint(upstream),
        rl = endpoint(rlqs),
    )
}

fn metric(admin_port: u16, name: &str) -> u64 {
    let Ok(r) = request(admin_port, "GET", "/metrics", &[]) else {
        return 0;
    };
    String::from_utf8_lossy(&r.body)
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn statuses(port: u16, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
    (0..n).map(|_| get(port, "/", headers).status).collect()
}

/// Whether a request with `headers` is admitted within 3 s (a new
/// bucket's first requests meet `DENY_ALL` until its first assignment).
fn first_admitted(port: u16, headers: &[(&str, &str)]) -> bool {
    wait_for(Duration::from_secs(3), || get(port, "/", headers).status == 200)
}

/// Loads `port` as tenant `a` at [`EVERY`] until `stop`; its 200s.
fn load(port: u16, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut admitted = 0;
        while !stop.load(Ordering::SeqCst) {
            let at = Instant::now();
            if get(port, "/", &[("x-tenant-id", "a")]).status == 200 {
                admitted += 1;
            }
            std::thread::sleep(EVERY.saturating_sub(at.elapsed()));
        }
        admitted
    })
}

#[test]
fn two_envoys_share_one_global_limit_through_rlqs() {
    let dir = Envoy::temp_dir();
    let (mut serve, grpc) = Serve::grpc(&dir, POLICY);
    let upstream = Upstream::start();
    let envoys: Vec<(Envoy, u16, u16)> = ["a", "b"]
        .iter()
        .map(|node| {
            let (strict, open, admin) = (free_port(), free_port(), free_port());
            let d = dir.join(node);
            std::fs::create_dir_all(&d).unwrap();
            let config = bootstrap(node, strict, open, admin, upstream.port, grpc);
            let envoy = Envoy::launch(
                d.clone(),
                &config,
                strict,
                open,
                admin,
                d.join("unused-ecds.yaml"),
            );
            (envoy, strict, open)
        })
        .collect();
    let [(envoy_a, strict_a, open_a), (_, strict_b, _)] = &envoys[..] else {
        unreachable!()
    };

    // Both Envoys loaded as tenant `a`, far above the limit.
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let loads = [load(*strict_a, stop.clone()), load(*strict_b, stop.clone())];
    std::thread::sleep(LOAD);
    stop.store(true, Ordering::SeqCst);
    let per_envoy: Vec<u64> = loads.into_iter().map(|l| l.join().unwrap()).collect();
    let d = started.elapsed();
    let admitted: u64 = per_envoy.iter().sum();

    // THE BOUND for this run: the first Envoy's subscription and the
    // second's join are the run's A = 2 assignments of shares (3 changed
    // token buckets: the first's, then both halves), each at most
    // max(B, S) = 6 fresh tokens; the rates add up to RATE per PER_SECS;
    // one request of overlap while the first learns its half.
    let changed = metric(serve.admin_port, "tenantgate_rlqs_assignments_changed_total");
    assert_eq!(changed, 3, "the run's assignments: {changed}");
    let sets = 2;
    let rate_term = (RATE as f64 * d.as_secs_f64() / PER_SECS as f64).ceil() as u64;
    let bound = sets * BURST.max(2) + rate_term + 1;
    let floor = RATE * LOAD.as_secs() / PER_SECS * 8 / 10;
    println!(
        "RLQS: admitted {admitted} ({per_envoy:?} per Envoy) in {:.1} s; bound {bound}, floor {floor}",
        d.as_secs_f64()
    );
    assert!(admitted <= bound, "admitted {admitted} > bound {bound}");
    assert!(
        admitted >= floor,
        "admitted {admitted} < {floor}: the limit is not used"
    );
    // Shared: each Envoy got a fair part.
    for (i, n) in per_envoy.iter().enumerate() {
        assert!(*n * 4 >= admitted, "Envoy {i} admitted {n} of {admitted}");
    }

    // Every request admitted in a bucket, to find in the usage reports.
    let mut in_buckets = admitted;
    // Another tenant has its own key: after its bucket's first assignment
    // (the first request meets DENY_ALL), its whole burst.
    assert!(
        first_admitted(*strict_a, &[("x-tenant-id", "b")]),
        "{}",
        envoy_a.log_tail()
    );
    assert_eq!(statuses(*strict_a, &[("x-tenant-id", "b")], 4), [200; 4]);
    in_buckets += 5;
    // Unlimited, and a bucket no rule names: ALLOW_ALL, past any burst.
    for headers in [[("x-tenant-id", "vip")], [("x-team", "t1")]] {
        assert!(first_admitted(*strict_b, &headers), "{headers:?}");
        assert_eq!(statuses(*strict_b, &headers, 20), [200; 20], "{headers:?}");
        in_buckets += 21;
    }
    // Tenant `a` is still held to its share on both.
    let after: Vec<u16> = [*strict_a, *strict_b]
        .iter()
        .flat_map(|p| statuses(*p, &[("x-tenant-id", "a")], 10))
        .collect();
    let after_admitted = after.iter().filter(|s| **s == 200).count() as u64;
    assert!(after_admitted <= 2 * 3 + 2, "{after:?}");
    in_buckets += after_admitted;

    // The admitted requests come back in the usage reports (every 5 s in
    // Envoy 1.40) and are counted, every one.
    let reported = || metric(serve.admin_port, "tenantgate_rlqs_requests_allowed_total");
    assert!(
        wait_for(Duration::from_secs(12), || reported() >= in_buckets),
        "reported {} of {in_buckets}",
        reported()
    );
    assert_eq!(reported(), in_buckets);
    assert!(metric(serve.admin_port, "tenantgate_rlqs_requests_denied_total") > 0);
    assert!(metric(serve.admin_port, "tenantgate_rlqs_streams") >= 2);
    for (envoy, _, _) in &envoys {
        for stat in [
            "upstream_rq_timeout",
            "upstream_rq_rx_reset",
            "upstream_rq_tx_reset",
            "upstream_cx_destroy_remote_with_active_rq",
            "upstream_cx_connect_fail",
        ] {
            let name = format!("cluster.rlqs.{stat}");
            assert_eq!(envoy.stat(&name).unwrap_or(0), 0, "{name}\n{}", envoy.log_tail());
        }
    }

    // The service down: a new bucket gets the filter's own
    // no_assignment_behavior, DENY_ALL on one listener, ALLOW_ALL on the
    // other.
    serve.stop();
    assert_eq!(statuses(*strict_a, &[("x-tenant-id", "new1")], 3), [429; 3]);
    let served = upstream.received();
    assert_eq!(statuses(*open_a, &[("x-tenant-id", "new2")], 3), [200; 3]);
    assert_eq!(upstream.received(), served + 3);
    drop(envoys);
}
