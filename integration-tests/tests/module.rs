//! The native module's own contract with Envoy 1.40 (the tests of the
//! pipeline itself run on both hosts: `on_both_hosts!` in the other files).
//!
//! * The ABI version: Envoy logs that the module's `v0.2.0` matched. A
//!   module answering another version is loaded with a warning (Envoy 1.40
//!   refuses only a null version or a missing symbol); a module built
//!   against a callback this Envoy lacks (one callback's name changed in a
//!   copy of the library) is refused at load (`-z now`), and the policy in
//!   force keeps serving.
//! * Fail-safe: with the test-only fault switch on, a panic at each entry
//!   point (request headers, response headers, stream end, the tick)
//!   never takes Envoy down; the request gets its class's failure mode
//!   (503 `state_unavailable` for `fail_closed`, on its way otherwise); the
//!   worker it interrupted is made new, answering the requests it held; the
//!   filter keeps limiting afterwards.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tenantgate_integration_tests::upstream::Upstream;
use tenantgate_integration_tests::{
    cli_bin, get, module_faults_file, module_file, wait_for, with_envoy_env, with_host, with_module_file,
    Conn, Envoy, Host, Response,
};

const POLICY: &str = r#"
version: "it-module-1"
identity: { header: x-tenant-id }
plans:
  free: { limits: [ { rate: 10, per: 1s, burst: 5 } ] }
default_plan: free
anonymous: { plan: free }
# `api` holds an in-flight slot to its stream's end, so that end is a step
# of the pipeline (a stream it keeps nothing of after its response headers
# is not, and its fault point would never be reached).
actions:
  api: { max_in_flight: 1000 }
routes:
  api: { action: api }
  strict: { action: strict, failure_mode: fail_closed }
  export: { action: export, on_limit: queue, max_wait: 5s, max_queue: 10 }
default_route: api
"#;

/// A copy of the module with `from` replaced by `to` (same length), beside
/// the Envoy's files.
fn patched(dir: &Path, name: &str, from: &[u8], to: &[u8]) -> PathBuf {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(module_file()).unwrap();
    let mut found = 0;
    let mut at = 0;
    while let Some(i) = bytes[at..].windows(from.len()).position(|w| w == from) {
        bytes[at + i..at + i + to.len()].copy_from_slice(to);
        at += i + to.len();
        found += 1;
    }
    assert!(found > 0, "{} not in the module", String::from_utf8_lossy(from));
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Points the Envoy's ECDS resource at another build of the module.
fn apply_module(envoy: &Envoy, module: &Path) {
    let policy = envoy.dir.join("module-policy.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let out = Command::new(cli_bin())
        .args(["policy", "apply"])
        .arg(&policy)
        .arg("--ecds")
        .arg(&envoy.ecds)
        .arg("--module")
        .arg(module)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn ecds_stat(envoy: &Envoy, name: &str) -> u64 {
    envoy
        .stat(&format!(
            "extension_config_discovery.http_filter.tenantgate.{name}"
        ))
        .unwrap_or(0)
}

#[test]
fn envoy_loads_the_module_at_its_abi_version_and_refuses_a_build_missing_a_callback() {
    with_host(Host::Module, || {
        let envoy = Envoy::start(POLICY);
        assert!(
            envoy.log().contains("Dynamic module ABI version v0.2.0 matched."),
            "{}",
            envoy.log_tail()
        );
        let tenant = [("x-tenant-id", "abi")];
        assert_eq!(get(envoy.port, "/api/x", &tenant).status, 200);

        // Another version string: Envoy 1.40 warns and loads it.
        let other = patched(&envoy.dir, "libother-version.so", b"v0.2.0\0", b"v0.1.9\0");
        let success = ecds_stat(&envoy, "update_success");
        apply_module(&envoy, &other);
        assert!(
            wait_for(Duration::from_secs(10), || ecds_stat(&envoy, "update_success")
                > success),
            "{}",
            envoy.log_tail()
        );
        assert!(envoy
            .log()
            .contains("Dynamic module ABI version v0.1.9 is deprecated"));
        assert_eq!(get(envoy.port, "/api/x", &tenant).status, 200);

        // A callback this Envoy does not have: refused at load, no crash,
        // the module in force keeps limiting.
        let missing = patched(
            &envoy.dir,
            "libmissing-callback.so",
            b"envoy_dynamic_module_callback_http_send_response\0",
            b"envoy_dynamic_module_callback_http_send_respons_\0",
        );
        let rejected = ecds_stat(&envoy, "update_rejected");
        apply_module(&envoy, &missing);
        assert!(
            wait_for(Duration::from_secs(10), || ecds_stat(&envoy, "update_rejected")
                > rejected),
            "{}",
            envoy.log_tail()
        );
        assert!(envoy
            .log()
            .contains("envoy_dynamic_module_callback_http_send_respons_"));
        let statuses: Vec<u16> = (0..8)
            .map(|_| get(envoy.port, "/api/x", &[("x-tenant-id", "after")]).status)
            .collect();
        assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 5, "{statuses:?}");
        assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 3, "{statuses:?}");
    });
}

/// A request asking the test-only switch to fail at `point`.
fn fault(conn: &mut Conn, path: &str, tenant: &str, point: &str) -> Response {
    conn.get(
        path,
        &[("x-tenant-id", tenant), ("x-tenantgate-test-fault", point)],
    )
    .unwrap()
}

#[test]
fn the_shipped_module_has_no_fault_switch() {
    // The switch is compiled only with the test-faults feature, which the
    // release profiles never enable: neither its header nor its variable is
    // in the library `make module` ships; the test build has both.
    let shipped = std::fs::read(module_file()).unwrap();
    let faults = std::fs::read(module_faults_file()).unwrap();
    for needle in [&b"x-tenantgate-test-fault"[..], b"TENANTGATE_MODULE_TEST_FAULTS"] {
        let has = |bytes: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
        assert!(
            !has(&shipped),
            "the shipped module contains {}",
            String::from_utf8_lossy(needle)
        );
        assert!(
            has(&faults),
            "the test build lacks {}",
            String::from_utf8_lossy(needle)
        );
    }
}

#[test]
fn a_panic_at_any_entry_point_never_brings_envoy_down() {
    with_host(Host::Module, || {
        with_module_file(module_faults_file(), || {
            with_envoy_env(&[("TENANTGATE_MODULE_TEST_FAULTS", "1")], || {
                let upstream = Upstream::start();
                let mut envoy =
                    Envoy::start_with_upstream(POLICY, upstream.port, &["api", "strict", "export"]);
                let pid = envoy.pid();
                let panics = |e: &Envoy| e.tg_stat("module.panics");
                assert_eq!(panics(&envoy), 0);

                // Two requests held for a token (`export`, burst 5 spent), one
                // on each worker (exact balance), their connections kept open.
                let exhausted = (0..5)
                    .filter(|_| get(envoy.port, "/up/export", &[("x-tenant-id", "held")]).status == 200)
                    .count();
                assert_eq!(exhausted, 5);
                let held: Vec<_> = (0..2)
                    .map(|_| {
                        let port = envoy.port;
                        std::thread::spawn(move || {
                            let started = Instant::now();
                            let mut c = Conn::open(port).unwrap();
                            let r = c.get("/up/export", &[("x-tenant-id", "held")]).unwrap();
                            (r.status, started.elapsed())
                        })
                    })
                    .collect();
                assert!(wait_for(Duration::from_secs(5), || envoy.tg_stat("queue.held") >= 2));

                // A panic in each worker's request path (two keep-alive
                // connections, one per worker): the default class goes on, the
                // fail_closed one gets 503; both workers are made new and
                // answer what they held (fail-open: on its way, long before
                // the 5 s max_wait).
                let (mut a, mut b) = (Conn::open(envoy.port).unwrap(), Conn::open(envoy.port).unwrap());
                assert_eq!(fault(&mut a, "/up/api", "f", "request_headers").status, 200);
                let r = fault(&mut b, "/up/strict", "f", "request_headers");
                assert_eq!(r.status, 503);
                assert_eq!(r.header("x-tenantgate-reason"), Some("state_unavailable"));
                for h in held {
                    let (status, waited) = h.join().unwrap();
                    assert_eq!(status, 200);
                    assert!(
                        waited < Duration::from_secs(4),
                        "held {waited:?}: not answered by the reset"
                    );
                }
                // In the response path and at the stream's end: the answer is
                // the upstream's.
                assert_eq!(fault(&mut a, "/up/api", "f", "response_headers").status, 200);
                assert_eq!(fault(&mut b, "/up/api", "f", "stream_complete").status, 200);
                // In a tick: the next one panics; ticks go on.
                assert_eq!(fault(&mut a, "/up/api", "f", "tick").status, 200);
                assert!(wait_for(Duration::from_secs(5), || panics(&envoy) >= 5));
                let flushes = envoy.tg_stat("stats.flushes");
                assert!(wait_for(Duration::from_secs(5), || envoy
                    .tg_stat("stats.flushes")
                    > flushes + 10));
                assert_eq!(panics(&envoy), 5);
                assert!(envoy.log().contains("tenantgate test fault at request_headers"));

                // The same process, still limiting with fresh workers.
                assert!(envoy.alive());
                assert_eq!(envoy.pid(), pid);
                let statuses: Vec<u16> = (0..8)
                    .map(|_| get(envoy.port, "/up/api", &[("x-tenant-id", "after")]).status)
                    .collect();
                assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 5, "{statuses:?}");
                assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 3, "{statuses:?}");
            })
        });
    });
}
