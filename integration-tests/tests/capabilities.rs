//! The capability allow-list `tenantgate policy apply` writes
//! (`cli/src/ecds.rs`, from the core's `pipeline::events`), in a real
//! Envoy 1.40 (`--concurrency 2`):
//!
//! * its imports are exactly the built module's import section (read here
//!   from the `.wasm` by a small reader of the binary format), and every
//!   callback it may allow is one the module exports;
//! * a policy without admission and with `ratelimit_headers: false` gets
//!   no response, log or done callback, and still limits exactly; a reload
//!   to a policy that needs the response headers gets them (another list,
//!   another VM), and the buckets survive it;
//! * a policy with every feature (admission with a queue, a breaker, an
//!   adaptive controller, a degraded capture, a streamed body limit,
//!   `on_limit: queue`, global limits synced with a (stub) central
//!   service, `RateLimit` headers) gets the callbacks each needs, and each
//!   works.
//!
//! No Envoy logs a refused call (`Attempted call to restricted …`): every
//! real-Envoy test checks it when its Envoy stops (`Envoy`'s `Drop`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::Duration;

use tenantgate_cli::ecds::{self, PROXY_WASM_IMPORTS, WASI_IMPORTS};
use tenantgate_integration_tests::upstream::Upstream;
use tenantgate_integration_tests::{
    get, wait_for, wasm_file, Envoy, NodeSpec, Response, SyncMode, SyncServer, REFUSED_CAPABILITY,
};

const WAIT: Duration = Duration::from_secs(20);

// ------------------------------------------------ the wasm binary format

/// What the tests read of a module: its imports (module, name) and its
/// exports' names.
#[derive(Debug, Default)]
struct Module {
    imports: Vec<(String, String)>,
    exports: Vec<String>,
}

/// A cursor over a module's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn byte(&mut self) -> u8 {
        let b = self.bytes[self.at];
        self.at += 1;
        b
    }

    /// An unsigned LEB128 integer (every count, size and index).
    fn u32(&mut self) -> u32 {
        let (mut value, mut shift) = (0u32, 0);
        loop {
            let b = self.byte();
            value |= u32::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return value;
            }
            shift += 7;
            assert!(shift < 35, "LEB128 too long at {}", self.at);
        }
    }

    fn name(&mut self) -> String {
        let len = self.u32() as usize;
        let s = std::str::from_utf8(&self.bytes[self.at..self.at + len]).expect("a UTF-8 name");
        self.at += len;
        s.to_owned()
    }

    /// A table's or a memory's limits (flag 1 or 3: with a maximum).
    fn limits(&mut self) {
        let flags = self.byte();
        self.u32();
        if flags & 1 == 1 {
            self.u32();
        }
    }
}

/// Reads the import (id 2) and export (id 7) sections of a module and
/// skips the others (the binary format: magic, version, then sections of
/// an id byte and a LEB128 size).
fn read_module(bytes: &[u8]) -> Module {
    assert_eq!(&bytes[..4], b"\0asm", "not a wasm module");
    assert_eq!(&bytes[4..8], &[1, 0, 0, 0], "wasm version 1");
    let mut r = Reader { bytes, at: 8 };
    let mut module = Module::default();
    while r.at < bytes.len() {
        let id = r.byte();
        let size = r.u32() as usize;
        let end = r.at + size;
        match id {
            2 => {
                for _ in 0..r.u32() {
                    let (m, n) = (r.name(), r.name());
                    match r.byte() {
                        0x00 => {
                            r.u32(); // the function's type
                        }
                        0x01 => {
                            r.byte(); // the table's element type
                            r.limits();
                        }
                        0x02 => r.limits(),
                        0x03 => {
                            r.byte(); // the global's type, then its mutability
                            r.byte();
                        }
                        kind => panic!("import {m}.{n}: unknown kind {kind}"),
                    }
                    module.imports.push((m, n));
                }
                assert_eq!(r.at, end, "the import section ends where its size says");
            }
            7 => {
                for _ in 0..r.u32() {
                    module.exports.push(r.name());
                    r.byte();
                    r.u32();
                }
                assert_eq!(r.at, end, "the export section ends where its size says");
            }
            _ => {}
        }
        r.at = end;
    }
    module
}

#[test]
fn the_allow_list_names_every_import_of_the_built_module_and_only_callbacks_it_exports() {
    let bytes = std::fs::read(wasm_file()).unwrap();
    let module = read_module(&bytes);
    let imported = |of: &str| -> BTreeSet<&str> {
        module
            .imports
            .iter()
            .filter(|(m, _)| m == of)
            .map(|(_, n)| n.as_str())
            .collect()
    };
    let modules: BTreeSet<&str> = module.imports.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(
        modules,
        BTreeSet::from(["env", "wasi_snapshot_preview1"]),
        "imports from: {modules:?}"
    );
    assert_eq!(
        imported("env"),
        PROXY_WASM_IMPORTS.iter().copied().collect(),
        "cli/src/ecds.rs PROXY_WASM_IMPORTS is the module's env imports"
    );
    assert_eq!(
        imported("wasi_snapshot_preview1"),
        WASI_IMPORTS.iter().copied().collect(),
        "cli/src/ecds.rs WASI_IMPORTS is the module's WASI imports"
    );
    // Every callback any policy may allow exists, and what Envoy looks up
    // whatever the list says (the allocator, the ABI marker) is there.
    let every = ecds::Events {
        request_body: true,
        response_headers: true,
        response_body: true,
        stream_end: true,
        callout_answers: true,
        tick: true,
    };
    for callback in ecds::callbacks(&every) {
        assert!(
            module.exports.iter().any(|e| e == callback),
            "{callback} exported"
        );
    }
    for ungated in [
        "proxy_on_memory_allocate",
        "proxy_abi_version_0_2_1",
        "memory",
        "_initialize",
    ] {
        assert!(module.exports.iter().any(|e| e == ungated), "{ungated} exported");
    }
    println!(
        "tenantgate.wasm: {} imports, {} exports",
        module.imports.len(),
        module.exports.len()
    );
}

// ------------------------------------------------------------- helpers

/// The names in the allow-list of Envoy's ECDS file.
fn allowed(envoy: &Envoy) -> BTreeSet<String> {
    let text = std::fs::read_to_string(&envoy.ecds).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    doc["resources"][0]["typed_config"]["config"]["vm_config"]["capability_restriction_config"]
        ["allowed_capabilities"]
        .as_object()
        .unwrap_or_else(|| panic!("no allow-list in {text}"))
        .keys()
        .cloned()
        .collect()
}

fn assert_no_refused_call(envoy: &Envoy) {
    let log = envoy.log();
    let refused: Vec<&str> = log.lines().filter(|l| l.contains(REFUSED_CAPABILITY)).collect();
    assert!(refused.is_empty(), "Envoy refused calls: {refused:?}");
}

fn reason(r: &Response) -> Option<&str> {
    r.header("x-tenantgate-reason")
}

// ------------------------------------------------------ a lean policy

/// 3 a minute (no refill within the test), no admission, `RateLimit`
/// headers as `headers` says.
fn lean(version: &str, headers: bool) -> String {
    format!(
        r#"
version: "{version}"
identity: {{ header: x-tenant-id }}
plans:
  free: {{ limits: [ {{ rate: 3, per: 1m }} ] }}
default_plan: free
anonymous: {{ plan: free }}
ratelimit_headers: {headers}
routes:
  api: {{}}
default_route: api
"#
    )
}

#[test]
fn a_lean_policy_gets_no_response_callbacks_and_still_limits_exactly() {
    let envoy = Envoy::start(&lean("caps-lean", false));
    let list = allowed(&envoy);
    for absent in [
        "proxy_on_response_headers",
        "proxy_on_response_body",
        "proxy_on_response_trailers",
        "proxy_on_log",
        "proxy_on_done",
        "proxy_on_request_body",
        "proxy_on_http_call_response",
    ] {
        assert!(!list.contains(absent), "{absent} allowed: {list:?}");
    }
    for present in [
        "proxy_on_request_headers",
        "proxy_on_tick",
        "proxy_get_shared_data",
    ] {
        assert!(list.contains(present), "{present} not allowed: {list:?}");
    }

    // Three of eight pass, on fresh connections (both workers); the rest
    // are refused with their Retry-After.
    let answers: Vec<Response> = (0..8)
        .map(|_| get(envoy.port, "/api/x", &[("x-tenant-id", "lean")]))
        .collect();
    let statuses: Vec<u16> = answers.iter().map(|r| r.status).collect();
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 3, "{statuses:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 5, "{statuses:?}");
    for r in &answers {
        assert!(r.header("ratelimit").is_none(), "no RateLimit headers: {r:?}");
        if r.status == 429 {
            let after = r.header("retry-after").map(|v| v.parse::<u64>().unwrap());
            assert!(after.is_some_and(|s| s >= 1), "{r:?}");
        }
    }
    let [w0, w1] = envoy.worker_connections();
    assert!(w0 > 0 && w1 > 0, "both workers served: {w0} / {w1}");
    assert_eq!(envoy.tg_stat("decisions.allowed"), 3);
    assert_eq!(envoy.tg_stat("decisions.rate_limited"), 5);

    // A reload to a policy that needs the response headers: another list,
    // a VM of its own; its 200s carry the headers, and the tenant's bucket
    // (shared data) is still empty.
    let loads = envoy.tg_stat("config.loads");
    let (ok, err) = envoy.apply(&lean("caps-lean-2", true));
    assert!(ok, "{err}");
    assert!(allowed(&envoy).contains("proxy_on_response_headers"));
    assert!(
        wait_for(WAIT, || envoy.tg_stat("config.loads") >= loads + 2),
        "the new policy loads on both workers"
    );
    assert!(
        wait_for(WAIT, || get(envoy.port, "/api/x", &[("x-tenant-id", "fresh")])
            .header("ratelimit")
            .is_some()),
        "RateLimit headers after the reload"
    );
    assert_eq!(get(envoy.port, "/api/x", &[("x-tenant-id", "lean")]).status, 429);
    assert_no_refused_call(&envoy);
}

// ------------------------------------------------- every feature at once

/// Every feature whose callbacks a list can leave out, one class each.
const ALL: &str = r#"
version: "caps-all"
identity: { header: x-tenant-id }
plans:
  big: { limits: [ { rate: 1000000, per: 1s } ] }
  paced: { limits: [ { rate: 5, per: 1s, burst: 2 } ] }
  world: { limits: [ { name: world, rate: 1000, per: 1s, global: true } ] }
tenants:
  - { id: paced, plan: paced }
  - { id: g1, plan: world }
default_plan: big
anonymous: { plan: big }
sync: { cluster: tenantgate, interval: 200ms, timeout: 100ms, provisional: 2 }
dependencies:
  db: { max_in_flight: 1, queues: { normal: { max_queue: 4, max_wait: 5s } } }
  flaky:
    max_in_flight: 100
    circuit_breaker: { error_rate: 0.5, min_volume: 5, window: 250ms, open_for: 10s }
  adapt: { max_in_flight: 50, adaptive: {} }
  cat: { max_in_flight: 1 }
routes:
  orders: { dependency: db }
  flaky: { dependency: flaky }
  adapt: { dependency: adapt }
  catalog: { dependency: cat, degradable: { max_stale: 30s } }
  upload: { max_body_bytes: 10 }
  jobs: { on_limit: queue, max_wait: 2s, max_queue: 4 }
  api: {}
default_route: api
"#;
const CLASSES: [&str; 7] = ["orders", "flaky", "adapt", "catalog", "upload", "jobs", "api"];

/// A request written raw on its own connection (a chunked body): its
/// status and `x-tenantgate-reason`.
fn raw(port: u16, head: &str, body: &[u8]) -> (u16, Option<String>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    // The filter may answer before the whole body is sent.
    let _ = s.write_all(body);
    let mut text = Vec::new();
    let _ = s.read_to_end(&mut text);
    let text = String::from_utf8_lossy(&text).into_owned();
    let status = text.split(' ').nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
    let reason = text
        .lines()
        .find_map(|l| l.strip_prefix("x-tenantgate-reason: "))
        .map(|v| v.trim().to_owned());
    (status, reason)
}

/// `GET path` as `acme` in its own thread (it may be held); the answer on `tx`.
fn spawn_get(port: u16, path: &'static str, tx: &mpsc::Sender<Response>) {
    let tx = tx.clone();
    std::thread::spawn(move || {
        let _ = tx.send(get(port, path, &[("x-tenant-id", "acme")]));
    });
}

#[test]
fn every_feature_works_under_the_list_its_policy_gets() {
    let upstream = Upstream::start();
    let server = SyncServer::start(
        SyncMode::Leases {
            tokens: 1000,
            ttl_ms: 60_000,
            once: false,
        },
        100,
    );
    let node = NodeSpec {
        sync_ports: vec![server.port],
        ..NodeSpec::default()
    };
    let envoy = Envoy::start_with_upstream_node(ALL, upstream.port, &CLASSES, None, &node);
    let list = allowed(&envoy);
    for needed in [
        "proxy_on_request_body",
        "proxy_on_response_headers",
        "proxy_on_response_body",
        "proxy_on_response_trailers",
        "proxy_on_done",
        "proxy_on_http_call_response",
        "proxy_on_tick",
    ] {
        assert!(list.contains(needed), "{needed} not allowed: {list:?}");
    }
    let port = envoy.port;
    let acme = [("x-tenant-id", "acme")];

    // RateLimit headers on an admitted answer (response headers).
    let r = get(port, "/up/api", &acme);
    assert_eq!(r.status, 200, "{r:?}");
    assert!(
        r.header("ratelimit").is_some() && r.header("ratelimit-policy").is_some(),
        "{r:?}"
    );

    // Global limits: two on the provisional allowance, then more once the
    // service's lease comes back on a sync answer (callout answers).
    let g1 = [("x-tenant-id", "g1")];
    for _ in 0..2 {
        assert_eq!(get(port, "/up/api", &g1).status, 200);
    }
    assert!(
        wait_for(WAIT, || get(port, "/up/api", &g1).status == 200),
        "admitted on the service's lease"
    );
    assert!(envoy.tg_stat("sync.ok") >= 1, "a sync answered");
    assert!(!server.requests().is_empty());

    // A streamed body counted against max_body_bytes (request body).
    let post = "POST /up/upload HTTP/1.1\r\nhost: t\r\nx-tenant-id: acme\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n";
    let (status, why) = raw(port, post, b"8\r\n12345678\r\n8\r\n12345678\r\n0\r\n\r\n");
    assert_eq!((status, why.as_deref()), (413, Some("request_too_large")));
    assert_eq!(raw(port, post, b"4\r\n1234\r\n0\r\n\r\n").0, 200);

    // Admission with a queue: the only slot of `db` taken, the next
    // request held; both answered once the upstream lets the first go (a
    // slot given back at its stream's end).
    let (tx, rx) = mpsc::channel();
    upstream.hold();
    spawn_get(port, "/up/orders", &tx);
    assert!(wait_for(WAIT, || upstream.in_flight() == 1));
    spawn_get(port, "/up/orders", &tx);
    assert!(
        wait_for(WAIT, || envoy
            .stat("wasmcustom.tenantgate.admission.queue_depth.db")
            == Some(1)),
        "the second request is held"
    );
    upstream.release();
    for _ in 0..2 {
        let r = rx.recv_timeout(WAIT).expect("an answer");
        assert_eq!(r.status, 200, "{r:?}");
    }
    assert!(upstream.max_in_flight() <= 1, "never two in flight");
    assert!(
        wait_for(WAIT, || envoy
            .stat("wasmcustom.tenantgate.admission.in_flight.db")
            == Some(0)),
        "both slots given back"
    );

    // on_limit: queue: over the rate, held until a token comes, not refused.
    let paced: Vec<u16> = (0..4)
        .map(|_| get(port, "/up/jobs", &[("x-tenant-id", "paced")]).status)
        .collect();
    assert_eq!(paced, [200; 4]);
    assert!(envoy.tg_stat("queue.held") >= 1);

    // A degraded capture (response headers, body, end), then a refused GET
    // answered from it.
    upstream.set_version(7);
    assert_eq!(get(port, "/up/catalog", &acme).status, 200);
    assert!(
        wait_for(WAIT, || envoy.tg_stat("admission.degraded.stores") >= 1),
        "the answer is captured"
    );
    upstream.hold();
    spawn_get(port, "/up/catalog", &tx);
    assert!(wait_for(WAIT, || upstream.in_flight() == 1));
    let r = get(port, "/up/catalog", &acme);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        r.header("x-tenantgate-degraded"),
        Some("concurrency_limit"),
        "{r:?}"
    );
    assert_eq!(String::from_utf8_lossy(&r.body), "ok v7\n");
    upstream.release();
    assert_eq!(rx.recv_timeout(WAIT).expect("an answer").status, 200);

    // An adaptive controller records each stream's latency (response
    // headers and stream end) into its windows.
    upstream.set_latency(Duration::from_millis(20));
    for _ in 0..20 {
        assert_eq!(get(port, "/up/adapt", &acme).status, 200);
    }
    assert!(
        wait_for(WAIT, || envoy
            .stat("wasmcustom.tenantgate.admission.latency_p95_us.adapt")
            .is_some_and(|us| us >= 15_000)),
        "the controller saw the latency"
    );
    upstream.set_latency(Duration::ZERO);

    // A breaker opens on its dependency's failures (signals).
    upstream.set_status(503);
    let opened = wait_for(WAIT, || {
        reason(&get(port, "/up/flaky", &acme)) == Some("circuit_open")
    });
    assert!(opened, "the breaker opened");
    upstream.set_status(0);

    assert_no_refused_call(&envoy);
}
