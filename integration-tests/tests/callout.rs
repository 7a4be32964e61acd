//! The sync callout's failure paths in a real Envoy, against stubs of the
//! central service that reset the connection after the response headers,
//! send a body over Envoy's callout buffer limit (or over the filter's own
//! bound), close before answering, answer absurd leases (`u64::MAX`
//! tokens, share and TTL), or stall each report's first copy (the node's
//! hedge brings the lease).
//!
//! Each runs on both hosts. On the native module, "never traps" is no
//! panic caught at the module's boundary (`module.panics` stays 0) and
//! Envoy serving on; the rest holds as written.
//!
//! In each, the wasm VM never traps: Envoy's wasm failure stats for the
//! plugin stay 0, its log shows no wasm runtime error, and every request
//! still gets the filter's decision on both workers (a trapped VM answers
//! 503 under Envoy's default failure policy, with no decision). The failure
//! mode applies, and an absurd lease is clamped to the limit's burst.
//!
//! Envoy 1.40 counts no wasm runtime error under the default failure policy
//! (`FAIL_CLOSED`): its wasm stats are `wasm.envoy.wasm.runtime.v8.created`
//! / `.active` and, per plugin, `wasm.<plugin>.vm_reload{,_success,_failure,
//! _backoff}` (moved by `FAIL_RELOAD`). So the log check is the one that
//! sees a trap; before the glue read callout answers with raw hostcalls,
//! the reset stub trapped the VM here on every callout ("unexpected status:
//! 2" from `get_map_value_bytes`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::time::Duration;

use tenantgate_integration_tests::{
    get, on_both_hosts, wait_for, Envoy, Host, SyncMode, SyncServer, ENVOY_CALLOUT_BUFFER_LIMIT,
};

/// A global limit of 100/s with a burst of 50; `api` fails open, `orders`
/// closed; the breaker out of the way (each failure is looked at alone).
fn policy(interval_ms: u64, timeout_ms: u64) -> String {
    format!(
        r#"
version: "callout-it"
identity: {{ header: x-tenant-id }}
plans:
  free:
    limits:
    - {{ name: node, rate: 10000, per: 1s }}
    - {{ name: global, rate: 100, per: 1s, burst: 50, global: true }}
default_plan: free
anonymous: {{ plan: free }}
routes:
  api: {{}}
  orders: {{ failure_mode: fail_closed }}
sync: {{ cluster: tenantgate, interval: {interval_ms}ms, timeout: {timeout_ms}ms, breaker_failures: 100, provisional: 2, failure_mode: fail_open }}
"#
    )
}

/// `n` requests of `tenant` on fresh connections (both workers): statuses.
fn statuses(envoy: &Envoy, path: &str, tenant: &str, n: usize, every: Duration) -> Vec<u16> {
    (0..n)
        .map(|_| {
            let status = get(envoy.port, path, &[("x-tenant-id", tenant)]).status;
            std::thread::sleep(every);
            status
        })
        .collect()
}

fn admitted(statuses: &[u16]) -> usize {
    statuses.iter().filter(|s| **s == 200).count()
}

/// Decisions the filter made, over every reason, once the workers have
/// flushed what they counted (stats are batched per worker, flushed on the
/// tick).
fn decisions(envoy: &Envoy) -> u64 {
    envoy.settle();
    let body = envoy
        .admin_get("/stats?filter=^wasmcustom\\.tenantgate\\.decisions\\.")
        .unwrap()
        .body;
    String::from_utf8_lossy(&body)
        .lines()
        .filter_map(|l| {
            l.rsplit_once(": ")
                .and_then(|(_, v)| v.trim().parse::<u64>().ok())
        })
        .sum()
}

/// No VM trapped: the plugin's wasm failure stats are 0 and Envoy logged
/// no wasm runtime error.
fn assert_no_trap(envoy: &Envoy) {
    if envoy.host == Host::Module {
        assert_eq!(envoy.tg_stat("module.panics"), 0);
        assert!(
            !envoy.log().contains("panic caught"),
            "the module panicked:\n{}",
            envoy.log_tail()
        );
        return;
    }
    for stat in ["wasm.tenantgate.vm_reload", "wasm.tenantgate.vm_reload_failure"] {
        assert_eq!(envoy.stat(stat), Some(0), "{stat}");
    }
    let log = envoy.log();
    for sign in ["Uncaught RuntimeError", "panicked at", "failed: Uncaught"] {
        assert!(
            !log.contains(sign),
            "the VM trapped ({sign}):\n{}",
            envoy.log_tail()
        );
    }
}

/// With every callout failing as `mode` makes it: no trap, requests flow
/// with a decision each, and the failure mode applies. `signs`: log lines
/// that show the failure took the path meant.
fn failing_callouts_never_trap(mode: SyncMode, interval_ms: u64, timeout_ms: u64, signs: &[&str]) {
    let server = SyncServer::start(mode, interval_ms);
    let envoy = Envoy::start_with_sync(&policy(interval_ms, timeout_ms), server.port);
    // Demand for a key, so every report carries it.
    let _ = statuses(&envoy, "/api/x", "cf-a", 5, Duration::from_millis(10));
    let interval = Duration::from_millis(interval_ms);
    let failed = || envoy.tg_stat("sync.failed") + envoy.tg_stat("sync.timeouts");
    let seen = wait_for(interval * 20, || failed() >= 3 && server.requests().len() >= 3);
    // A trapped VM makes no more callouts: say so first.
    assert_no_trap(&envoy);
    assert!(
        seen,
        "three failed callouts: failed+timeouts {}, stub saw {}",
        failed(),
        server.requests().len()
    );
    assert_eq!(envoy.tg_stat("sync.ok"), 0);
    // The failure mode is in force once the key has had no lease for
    // 2·I + D from its start (docs/global-limits.md); a failed report is
    // retried at once, so three failed callouts can come sooner than that
    // (until then the key awaits: 429 past its provisional allowance).
    let failing_open = wait_for(interval * 20, || {
        get(envoy.port, "/api/x", &[("x-tenant-id", "cf-a")]).status == 200
    });
    assert!(failing_open, "fail_open in force within 2·I + D");

    let before = decisions(&envoy);
    let api = statuses(&envoy, "/api/x", "cf-a", 20, Duration::from_millis(10));
    let orders = statuses(&envoy, "/api/orders", "cf-b", 20, Duration::from_millis(10));
    assert_eq!(admitted(&api), 20, "fail_open: {api:?}");
    assert_eq!(
        admitted(&orders),
        2,
        "fail_closed after the provisional allowance: {orders:?}"
    );
    assert_eq!(
        decisions(&envoy) - before,
        40,
        "every request decided by the filter"
    );
    let [w0, w1] = envoy.worker_connections();
    assert!(w0 > 0 && w1 > 0, "both workers served: {w0} / {w1}");
    assert_no_trap(&envoy);
    let log = envoy.log();
    for sign in signs {
        assert!(
            log.contains(sign),
            "no `{sign}` in the log:\n{}",
            envoy.log_tail()
        );
    }
    println!(
        "sync.sent {}, sync.failed {}, sync.timeouts {}",
        envoy.tg_stat("sync.sent"),
        envoy.tg_stat("sync.failed"),
        envoy.tg_stat("sync.timeouts")
    );
}

on_both_hosts!(a_reset_after_the_response_headers_never_traps_the_vm);
fn a_reset_after_the_response_headers_never_traps_the_vm() {
    failing_callouts_never_trap(
        SyncMode::ResetAfterHeaders,
        500,
        200,
        &["tenantgate: sync callout failed"],
    );
}

on_both_hosts!(a_body_over_envoys_callout_buffer_limit_never_traps_the_vm);
fn a_body_over_envoys_callout_buffer_limit_never_traps_the_vm() {
    // 33 MiB per answer: a longer interval and timeout, so the buffer
    // limit (not the timeout) ends each callout.
    failing_callouts_never_trap(
        SyncMode::LongBody(ENVOY_CALLOUT_BUFFER_LIMIT + (1 << 20)),
        1_500,
        1_200,
        &[
            "the buffer size limit for async client response body has been exceeded",
            "tenantgate: sync callout failed",
        ],
    );
}

on_both_hosts!(a_body_over_the_filters_own_bound_is_refused_unread);
fn a_body_over_the_filters_own_bound_is_refused_unread() {
    // 5 MiB: within Envoy's limit, over the filter's 4 MiB.
    failing_callouts_never_trap(
        SyncMode::LongBody(5 << 20),
        1_000,
        800,
        &["tenantgate: sync answer of 5242880 bytes refused"],
    );
}

on_both_hosts!(a_close_before_the_response_headers_never_traps_the_vm);
fn a_close_before_the_response_headers_never_traps_the_vm() {
    // Envoy's router answers the callout itself (503, upstream reset).
    failing_callouts_never_trap(
        SyncMode::CloseBeforeHeaders,
        500,
        200,
        &["tenantgate: sync answered 503"],
    );
}

on_both_hosts!(absurd_leases_are_clamped_to_the_limits_burst);
fn absurd_leases_are_clamped_to_the_limits_burst() {
    // Every answer: u64::MAX tokens, share and TTL for every key.
    let server = SyncServer::start(
        SyncMode::Leases {
            tokens: u64::MAX,
            ttl_ms: u64::MAX,
            once: false,
        },
        2_000,
    );
    let envoy = Envoy::start_with_sync(&policy(2_000, 500), server.port);
    let _ = statuses(&envoy, "/api/x", "abs-a", 1, Duration::ZERO);
    // The key's report, then its (clamped) lease.
    assert!(
        wait_for(Duration::from_secs(10), || envoy.tg_stat("sync.clamped") >= 1),
        "an answer was clamped"
    );
    let ok = envoy.tg_stat("sync.ok");
    assert!(wait_for(Duration::from_secs(6), || envoy.tg_stat("sync.ok") > ok));
    // A burst of 150 within one interval (2 s): at most one sync lands in
    // it, so at most two leases of the burst (50) admit; unclamped, all 150.
    let burst = statuses(&envoy, "/api/x", "abs-a", 150, Duration::ZERO);
    println!(
        "absurd leases: {} of 150 admitted, sync.clamped {}",
        admitted(&burst),
        envoy.tg_stat("sync.clamped")
    );
    assert!(
        admitted(&burst) <= 100,
        "clamped to the burst: {}",
        admitted(&burst)
    );
    assert!(admitted(&burst) >= 40, "the lease admits: {}", admitted(&burst));
    // tokens, share and ttl of each lease.
    assert!(envoy.tg_stat("sync.clamped") >= 3);
    assert_no_trap(&envoy);
}

on_both_hosts!(a_report_whose_first_copy_stalls_gets_its_lease_from_the_second);
/// Issue 35's hedge in a real Envoy: the stub holds each report's first
/// copy past the callout timeout (as if it were lost) and answers a second
/// copy of the same `seq` at once. The node sends that copy half its
/// timeout after the first, unchanged, and applies its answer: every
/// report is answered, none fails, and the key runs on leases.
fn a_report_whose_first_copy_stalls_gets_its_lease_from_the_second() {
    let server = SyncServer::start(SyncMode::StallFirstCopy(Duration::from_millis(1_500), 5), 1_000);
    let envoy = Envoy::start_with_sync(&policy(1_000, 400), server.port);
    let _ = statuses(&envoy, "/api/x", "hedge-a", 1, Duration::ZERO);
    let answered = wait_for(Duration::from_secs(15), || {
        envoy.tg_stat("sync.ok") >= 3 && envoy.tg_stat("sync.hedged") >= 3
    });
    let requests = server.requests();
    println!(
        "hedge: sync.sent {}, sync.hedged {}, sync.ok {}, sync.failed {}, sync.timeouts {}, breaker {}; the stub saw {} requests",
        envoy.tg_stat("sync.sent"),
        envoy.tg_stat("sync.hedged"),
        envoy.tg_stat("sync.ok"),
        envoy.tg_stat("sync.failed"),
        envoy.tg_stat("sync.timeouts"),
        envoy.tg_stat("sync.breaker"),
        requests.len()
    );
    assert!(answered, "three reports answered through their second copy");
    // Each copy is the same request: the same seq, the same body.
    let mut by_seq: std::collections::BTreeMap<String, Vec<&serde_json::Value>> = Default::default();
    for r in &requests {
        by_seq.entry(r["seq"].to_string()).or_default().push(r);
    }
    let copied: Vec<_> = by_seq.values().filter(|v| v.len() == 2).collect();
    assert!(copied.len() >= 3, "{by_seq:?}");
    for v in &copied {
        assert_eq!(v[0], v[1], "a copy is the same request");
    }
    assert!(by_seq.values().all(|v| v.len() <= 2), "one copy per report");
    // A stalled first copy whose report its copy answered is no failure.
    assert_eq!(envoy.tg_stat("sync.failed") + envoy.tg_stat("sync.timeouts"), 0);
    // The key runs on its leases (5 tokens each), not on its failure mode
    // (fail_open would admit all 20).
    let burst = statuses(&envoy, "/api/x", "hedge-a", 20, Duration::ZERO);
    assert!((1..20).contains(&admitted(&burst)), "on leases: {burst:?}");
    assert_no_trap(&envoy);
}
