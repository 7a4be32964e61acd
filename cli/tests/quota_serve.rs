//! The reservation API end to end: the real `tenantgate serve` binary with
//! `--quota-store` on SQLite and on a real PostgreSQL (started by the test
//! on loopback in a temporary directory): the OpenAPI document's examples
//! against the real answers, `kill -9` and restart mid-load, the database
//! going away, and `tenantgate quota`; and schemathesis (a third-party
//! OpenAPI fuzzer, installed into `.venv` by `make setup-schemathesis`)
//! against the real service, with and without client authentication.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tenantgate_central::testing::PostgresServer;
use tenantgate_cli::http::request;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn free_port() -> u16 {
    tenantgate_central::testing::free_port().unwrap()
}

struct Serve {
    child: Child,
    api: SocketAddr,
}

impl Serve {
    fn start(store: &str, api_port: u16) -> Serve {
        Serve::start_with(store, api_port, &[])
    }

    fn start_with(store: &str, api_port: u16, extra: &[&str]) -> Serve {
        let api: SocketAddr = format!("127.0.0.1:{api_port}").parse().unwrap();
        let admin = format!("127.0.0.1:{}", free_port());
        let child = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
            .args(["serve", "--policy"])
            .arg(repo().join("policies/quotas.yaml"))
            .args([
                "--listen",
                &api.to_string(),
                "--admin",
                &admin,
                "--quota-store",
                store,
                "--region",
                "eu",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let s = Serve { child, api };
        if extra.is_empty() {
            s.wait_ready();
        }
        s
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok((200, _)) = self.get("/v1/quotas/build_minutes?tenant=probe&project=p") {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "tenantgate serve did not answer within 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn get(&self, path: &str) -> Result<(u16, String), String> {
        request(self.api, None, "GET", path, "")
    }

    fn wait_ready_as(&self, token: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while request(
            self.api,
            Some(token),
            "GET",
            "/v1/quotas/build_minutes?tenant=probe&project=p",
            "",
        )
        .map(|r| r.0)
            != Ok(200)
        {
            assert!(Instant::now() < deadline, "not ready within 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn post(&self, path: &str, body: &str) -> (u16, Value) {
        let (s, b) = request(self.api, None, "POST", path, body).unwrap();
        (s, serde_json::from_str(&b).unwrap_or_else(|e| panic!("{b}: {e}")))
    }

    fn kill9(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// `documented` ⊆ `actual`; clock-dependent fields only need to be there.
fn matches(documented: &Value, actual: &Value, at: &str) {
    match (documented, actual) {
        (Value::Object(d), Value::Object(a)) => {
            for (k, v) in d {
                let got = a
                    .get(k)
                    .unwrap_or_else(|| panic!("{at}.{k}: missing in {actual}"));
                if ["expires_at", "created_at", "as_of", "retry_after_ms"].contains(&k.as_str()) {
                    continue;
                }
                matches(v, got, &format!("{at}.{k}"));
            }
        }
        (d, a) => assert_eq!(d, a, "{at}"),
    }
}

struct Example {
    name: String,
    method: String,
    path: String,
    body: Option<Value>,
    status: u16,
    response: Value,
}

fn examples() -> Vec<Example> {
    let text = std::fs::read_to_string(repo().join("docs/openapi/reservations.yaml")).unwrap();
    let doc: Value = serde_norway::from_str(&text).unwrap();
    assert!(
        doc["openapi"].as_str().unwrap().starts_with("3.1."),
        "an OpenAPI 3.1 document"
    );
    let mut out = Vec::new();
    for (_, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            if method == "parameters" {
                continue;
            }
            let req = &op["requestBody"]["content"]["application/json"]["examples"];
            for (status, resp) in op["responses"].as_object().unwrap() {
                let Some(ex) = resp["content"]["application/json"]["examples"].as_object() else {
                    continue;
                };
                for (name, e) in ex {
                    out.push(Example {
                        name: name.clone(),
                        method: method.to_uppercase(),
                        path: e["x-path"].as_str().unwrap().to_owned(),
                        body: req.get(name).map(|r| r["value"].clone()),
                        status: status.parse().unwrap(),
                        response: e["value"].clone(),
                    });
                }
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[test]
fn openapi_examples_match_the_real_responses_and_the_cli_works() {
    let dir = tempfile::tempdir().unwrap();
    let s = Serve::start(&format!("sqlite:{}", dir.path().display()), free_port());
    let all = examples();
    assert!(all.len() >= 14, "{} examples", all.len());
    for e in &all {
        let body = e.body.as_ref().map(Value::to_string).unwrap_or_default();
        let (status, text) = request(s.api, None, &e.method, &e.path, &body).unwrap();
        assert_eq!(status, e.status, "{}: {text}", e.name);
        let actual: Value = serde_json::from_str(&text).unwrap();
        matches(&e.response, &actual, &e.name);
    }
    // The home region: a replica of another region refuses gpu_hours.
    let other = {
        let port = free_port();
        let admin = format!("127.0.0.1:{}", free_port());
        let dir2 = tempfile::tempdir().unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
            .args(["serve", "--policy"])
            .arg(repo().join("policies/quotas.yaml"))
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--admin",
                &admin,
                "--region",
                "us",
            ])
            .arg("--quota-store")
            .arg(format!("sqlite:{}", dir2.path().display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let o = Serve {
            child,
            api: format!("127.0.0.1:{port}").parse().unwrap(),
        };
        o.wait_ready();
        (o, dir2)
    };
    let (st, v) = other.0.post(
        "/v1/reservations",
        r#"{"reservation_id":"x","resource":"gpu_hours","tenant":"acme","project":"p","amount":1}"#,
    );
    assert_eq!(
        (st, v["error"].as_str(), v["home_region"].as_str()),
        (409, Some("wrong_region"), Some("eu"))
    );

    // tenantgate quota: reserve, query, commit, reconcile.
    let cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
            .arg("quota")
            .args(args)
            .args(["--service", &s.api.to_string()])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, out) = cli(&[
        "reserve",
        "--id",
        "cli-1",
        "--resource",
        "build_minutes",
        "--tenant",
        "acme",
        "--project",
        "ci",
        "--amount",
        "30",
    ]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains(r#""state":"reserved""#), "{out}");
    let (code, out) = cli(&["query", "build_minutes", "--tenant", "acme", "--project", "ci"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains(r#""reserved":30"#), "{out}");
    let (code, out) = cli(&["commit", "cli-1", "--amount", "10"]);
    assert_eq!((code, out.contains(r#""returned":20"#)), (Some(0), true), "{out}");
    let (code, out) = cli(&["release", "cli-1"]);
    assert_eq!(code, Some(1), "{out}");
    let (code, out) = cli(&["reconcile"]);
    assert_eq!(
        (code, out.contains(r#""drift_units":0"#)),
        (Some(0), true),
        "{out}"
    );
}

/// Acknowledged reserves and commits, then kill -9 mid-load, restart, and
/// every acknowledged entry is there.
fn kill_and_restart(store: &str) {
    let port = free_port();
    let mut s = Serve::start(store, port);
    let api = s.api;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..4 {
        let stop = stop.clone();
        workers.push(std::thread::spawn(move || {
            let mut acked: Vec<(String, bool)> = Vec::new();
            for i in 0..2000 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let id = format!("k{w}-{i}");
                let body = format!(
                    r#"{{"reservation_id":"{id}","resource":"build_minutes","tenant":"t{w}","project":"p","amount":1,"ttl":3600000}}"#
                );
                match request(api, None, "POST", "/v1/reservations", &body) {
                    Ok((201, _)) => acked.push((id.clone(), false)),
                    _ => break,
                }
                if i % 2 == 0 {
                    match request(api, None, "POST", &format!("/v1/reservations/{id}/commit"), "") {
                        Ok((200, _)) => {
                            if let Some(last) = acked.last_mut() {
                                last.1 = true;
                            }
                        }
                        _ => break,
                    }
                }
            }
            acked
        }));
    }
    // Kill once load is under way.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, body) = s.get("/v1/quotas/build_minutes?tenant=t0&project=p").unwrap();
        let v: Value = serde_json::from_str(&body).unwrap();
        let used = v["levels"]["global"]["reserved"].as_u64().unwrap()
            + v["levels"]["global"]["committed"].as_u64().unwrap();
        if used >= 100 {
            break;
        }
        assert!(Instant::now() < deadline, "no load within 30 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    s.kill9();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let acked: Vec<(String, bool)> = workers.into_iter().flat_map(|w| w.join().unwrap()).collect();
    // The service had counted 100 (a few more than the clients had seen
    // answered when it died): enough load for the check below.
    assert!(acked.len() >= 50, "{} acknowledged", acked.len());
    let s = Serve::start(store, port);
    for (id, committed) in &acked {
        let (st, body) = s.get(&format!("/v1/reservations/{id}")).unwrap();
        assert_eq!(st, 200, "{id} lost: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let want = if *committed { "committed" } else { "reserved" };
        if *committed {
            assert_eq!(v["state"], want, "{id}: {body}");
        } else {
            // Not acknowledged as committed: reserved, or committed if the
            // commit landed just before the kill.
            assert!(
                v["state"] == "reserved" || v["state"] == "committed",
                "{id}: {body}"
            );
        }
    }
    // Counters and ledger agree after the crash: nothing to repair.
    let (st, v) = s.post("/v1/quotas/reconcile", "");
    assert_eq!((st, v["drift_units"].as_u64()), (200, Some(0)), "{v}");
}

#[test]
fn sqlite_kill_9_and_restart_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    kill_and_restart(&format!("sqlite:{}", dir.path().display()));
}

#[test]
fn postgres_kill_9_and_restart_lose_nothing() {
    let pg = PostgresServer::start_with(&["-c fsync=off"])
        .unwrap_or_else(|e| panic!("PostgreSQL did not start: {e}"));
    kill_and_restart(&pg.url());
}

#[test]
fn postgres_unreachable_fails_closed_and_low_risk_queries_estimate() {
    let mut pg = PostgresServer::start_with(&["-c fsync=off"])
        .unwrap_or_else(|e| panic!("PostgreSQL did not start: {e}"));
    let s = Serve::start(&pg.url(), free_port());
    let (st, _) = s.post(
        "/v1/reservations",
        r#"{"reservation_id":"a","resource":"gpu_hours","tenant":"acme","project":"p","amount":3}"#,
    );
    assert_eq!(st, 201);
    let (_, seen) = s.get("/v1/quotas/build_minutes?tenant=acme&project=p").unwrap();
    pg.stop();
    let (st, v) = s.post(
        "/v1/reservations",
        r#"{"reservation_id":"b","resource":"gpu_hours","tenant":"acme","project":"p","amount":3}"#,
    );
    assert_eq!((st, v["error"].as_str()), (503, Some("quota_unavailable")), "{v}");
    let (st, _) = s.post("/v1/reservations/a/commit", "");
    assert_eq!(st, 503);
    let (st, body) = s.get("/v1/quotas/gpu_hours?tenant=acme&project=p").unwrap();
    assert_eq!(st, 503, "a high-risk query fails closed: {body}");
    let (st, body) = s.get("/v1/quotas/build_minutes?tenant=acme&project=p").unwrap();
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let before: Value = serde_json::from_str(&seen).unwrap();
    assert_eq!(v["estimate"], true);
    assert_eq!((&v["levels"], &v["as_of"]), (&before["levels"], &before["as_of"]));
}

#[test]
fn bearer_tokens_map_callers_to_tenants_and_reloads_change_limits() {
    let dir = tempfile::tempdir().unwrap();
    let clients = dir.path().join("clients.yaml");
    std::fs::write(
        &clients,
        "clients:\n  - { token: acme-token, tenants: [acme] }\n  - { token: ops-token, tenants: [\"*\"] }\n",
    )
    .unwrap();
    let policy = dir.path().join("policy.yaml");
    let original = std::fs::read_to_string(repo().join("policies/quotas.yaml")).unwrap();
    std::fs::write(&policy, &original).unwrap();
    let port = free_port();
    let admin = format!("127.0.0.1:{}", free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .args(["serve", "--policy"])
        .arg(&policy)
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--admin",
            &admin,
            "--region",
            "eu",
        ])
        .arg("--quota-store")
        .arg(format!("sqlite:{}", dir.path().join("db").display()))
        .arg("--quota-clients")
        .arg(&clients)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let s = Serve {
        child,
        api: format!("127.0.0.1:{port}").parse().unwrap(),
    };
    let reserve = |token: Option<&str>, id: &str, tenant: &str, amount: u64| {
        let body = format!(
            r#"{{"reservation_id":"{id}","resource":"build_minutes","tenant":"{tenant}","project":"ci","amount":{amount}}}"#
        );
        request(s.api, token, "POST", "/v1/reservations", &body).unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while request(
        s.api,
        Some("ops-token"),
        "GET",
        "/v1/quotas/build_minutes?tenant=a&project=b",
        "",
    )
    .map(|r| r.0)
        != Ok(200)
    {
        assert!(Instant::now() < deadline, "not ready within 30 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(reserve(None, "a1", "acme", 1).0, 401, "no token");
    assert_eq!(reserve(Some("wrong"), "a1", "acme", 1).0, 401, "unknown token");
    assert_eq!(
        reserve(Some("acme-token"), "a1", "globex", 1).0,
        403,
        "another tenant"
    );
    assert_eq!(reserve(Some("acme-token"), "a1", "acme", 1500).0, 201);
    assert_eq!(
        request(s.api, Some("acme-token"), "POST", "/v1/quotas/reconcile", "")
            .unwrap()
            .0,
        403,
        "reconcile needs every tenant"
    );
    assert_eq!(
        request(s.api, Some("ops-token"), "POST", "/v1/quotas/reconcile", "")
            .unwrap()
            .0,
        200
    );
    // A reload lowers the project default below what a1 holds: new
    // reservations are refused at the project level, a1 still commits.
    std::fs::write(
        &policy,
        original.replace("project_default: 2000", "project_default: 1000"),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    for i in 0.. {
        let id = format!("probe-{i}");
        let (st, body) = reserve(Some("acme-token"), &id, "acme", 1);
        if st == 409 {
            assert!(body.contains(r#""level":"project""#), "{body}");
            break;
        }
        assert_eq!(st, 201, "{body}");
        request(
            s.api,
            Some("acme-token"),
            "POST",
            &format!("/v1/reservations/{id}/release"),
            "",
        )
        .unwrap();
        assert!(
            Instant::now() < deadline,
            "the reload did not take effect within 30 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (st, body) = request(
        s.api,
        Some("acme-token"),
        "POST",
        "/v1/reservations/a1/commit",
        "",
    )
    .unwrap();
    assert_eq!(st, 200, "{body}");
}

fn schemathesis_bin() -> PathBuf {
    let path = std::env::var_os("SCHEMATHESIS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".venv/bin/schemathesis"));
    assert!(
        path.exists(),
        "{} not found (SCHEMATHESIS_BIN): run `make setup-schemathesis`, which installs it into .venv",
        path.display()
    );
    path
}

/// Runs schemathesis with every check against `doc` at `s`: documented
/// status codes, content types and response schemas; schema-valid
/// requests accepted (not 400) and schema-violating ones refused; missing
/// or ignored authentication where the document requires it; the
/// stateful phase follows reserve → commit/release/get. Examples per
/// operation and the seed are fixed, so a run takes seconds and repeats
/// (`TG_SCHEMATHESIS_SEED` tries another). Strings are generated in ASCII:
/// the one rule JSON Schema cannot state is the byte length of a
/// multi-byte `tenant` (the document says so).
fn schemathesis(doc: &Path, s: &Serve, headers: &[&str]) {
    let work = tempfile::tempdir().unwrap();
    let seed = std::env::var("TG_SCHEMATHESIS_SEED").unwrap_or_else(|_| "22".to_owned());
    let mut cmd = Command::new(schemathesis_bin());
    cmd.current_dir(work.path())
        .arg("run")
        .arg(doc)
        .args(["--url", &format!("http://{}", s.api)])
        .args(["--checks", "all", "--max-examples", "60", "--seed", &seed])
        .args(["--generation-database", "none", "--generation-codec", "ascii"])
        .args(["--request-timeout", "10", "--no-color"]);
    for h in headers {
        cmd.args(["-H", h]);
    }
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("No issues found"),
        "schemathesis found disagreements between docs/openapi/reservations.yaml and tenantgate serve (seed {seed}):\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn schemathesis_finds_the_document_and_the_service_agree_without_client_authentication() {
    let dir = tempfile::tempdir().unwrap();
    let s = Serve::start(&format!("sqlite:{}", dir.path().display()), free_port());
    schemathesis(&repo().join("docs/openapi/reservations.yaml"), &s, &[]);
}

#[test]
fn schemathesis_finds_the_document_and_the_service_agree_with_bearer_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let clients = dir.path().join("clients.yaml");
    std::fs::write(
        &clients,
        "clients:\n  - { token: ops-token, tenants: [\"*\"] }\n  - { token: acme-token, tenants: [acme] }\n",
    )
    .unwrap();
    // The document as a deployment with --quota-clients serves it: a bearer
    // token required (schemathesis then also checks that a request without
    // one, or with a made-up one, is refused 401).
    let text = std::fs::read_to_string(repo().join("docs/openapi/reservations.yaml")).unwrap();
    let mut doc: Value = serde_norway::from_str(&text).unwrap();
    doc["security"] = serde_json::json!([{ "bearer": [] }]);
    let authed = dir.path().join("reservations-bearer.json");
    std::fs::write(&authed, doc.to_string()).unwrap();
    let s = Serve::start_with(
        &format!("sqlite:{}", dir.path().join("db").display()),
        free_port(),
        &["--quota-clients", clients.to_str().unwrap()],
    );
    s.wait_ready_as("ops-token");
    schemathesis(&authed, &s, &["Authorization: Bearer ops-token"]);
}
