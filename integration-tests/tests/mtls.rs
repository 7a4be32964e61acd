//! mTLS between real Envoys and `tenantgate serve`, with certificates made
//! by the shipped command (`tenantgate certs`) and the shipped Envoy
//! snippet (`envoy/sync-mtls.yaml`): a node with its certificate syncs; one
//! whose certificate names another node, one with no certificate, and one
//! speaking plain HTTP are refused, and each falls back to its failure
//! mode (its requests are still answered, never trapped or hung).

use std::process::Command;
use std::time::Duration;

use tenantgate_integration_tests::cluster::Serve;
use tenantgate_integration_tests::{cli_bin, free_port, get, request, wait_for, Envoy, NodeSpec, SyncTls};

const POLICY: &str = r#"
version: "mtls-1"
identity: { header: x-tenant-id }
plans:
  free: { limits: [ { name: global, rate: 20, per: 1s, burst: 20, global: true } ] }
default_plan: free
anonymous: { plan: free }
routes: { api: {} }
default_route: api
sync: { cluster: tenantgate, interval: 500ms, timeout: 200ms, provisional: 2, failure_mode: fail_open_local }
"#;

fn certs(args: &[&str]) {
    let out = Command::new(cli_bin())
        .arg("certs")
        .args(args)
        .output()
        .expect("tenantgate certs");
    assert!(
        out.status.success(),
        "tenantgate certs {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn metric(admin_port: u16, line_start: &str) -> u64 {
    let Ok(r) = request(admin_port, "GET", "/metrics", &[]) else {
        return 0;
    };
    String::from_utf8_lossy(&r.body)
        .lines()
        .find_map(|l| l.strip_prefix(line_start))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn node(id: &str, port: u16, tls: Option<SyncTls>) -> NodeSpec {
    NodeSpec {
        id: id.into(),
        region: None,
        sync_ports: vec![port],
        sync_tls: tls,
    }
}

fn answered(envoy: &Envoy, tenant: &str) {
    for _ in 0..5 {
        let status = get(envoy.port, "/api/x", &[("x-tenant-id", tenant)]).status;
        assert!(status == 200 || status == 429, "status {status}");
    }
}

#[test]
fn only_a_node_with_its_own_certificate_syncs() {
    let dir = std::env::temp_dir().join(format!("tenantgate-mtls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.display().to_string();
    certs(&["init", "--dir", &d]);
    certs(&["node", "--dir", &d, "--node-id", "envoy-good"]);
    certs(&["node", "--dir", &d, "--node-id", "someone-else"]);
    let file = |name: &str| dir.join(name);
    let policy = dir.join("policy.yaml");
    std::fs::write(&policy, POLICY).unwrap();

    let port = free_port();
    let tls_args: Vec<String> = [
        "--tls-cert",
        &file("service.pem").display().to_string(),
        "--tls-key",
        &file("service.key").display().to_string(),
        "--client-ca",
        &file("ca.pem").display().to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let serve = Serve::start_with(&policy, "embedded", 500, port, &dir.join("serve.log"), &tls_args);

    let with = |cert: Option<&str>| SyncTls {
        ca: file("ca.pem"),
        client: cert.map(|c| (file(&format!("{c}.pem")), file(&format!("{c}.key")))),
    };
    let good = Envoy::start_node(POLICY, &node("envoy-good", port, Some(with(Some("envoy-good")))));
    let forged = Envoy::start_node(
        POLICY,
        &node("envoy-forged", port, Some(with(Some("someone-else")))),
    );
    let no_cert = Envoy::start_node(POLICY, &node("envoy-no-cert", port, Some(with(None))));
    let plain = Envoy::start_node(POLICY, &node("envoy-plain", port, None));
    let all = [&good, &forged, &no_cert, &plain];
    for e in all {
        answered(e, "mtls-tenant");
    }

    assert!(
        wait_for(Duration::from_secs(10), || good.tg_stat("sync.ok") >= 3),
        "the node with its certificate did not sync: ok {} failed {}; {}",
        good.tg_stat("sync.ok"),
        good.tg_stat("sync.failed"),
        good.log_tail()
    );
    for e in [&forged, &no_cert, &plain] {
        assert!(
            wait_for(Duration::from_secs(10), || e.tg_stat("sync.failed") >= 3),
            "a refused node did not count failures"
        );
        assert_eq!(e.tg_stat("sync.ok"), 0, "a refused node synced");
    }
    // The forged report reached the service and was refused as such.
    assert!(
        metric(
            serve.admin_port,
            "tenantgate_sync_requests_total{result=\"forbidden\"}"
        ) >= 1
    );
    assert!(metric(serve.admin_port, "tenantgate_sync_requests_total{result=\"ok\"}") >= 3);
    // Every node still answers, on its failure mode where refused.
    for e in all {
        answered(e, "mtls-tenant");
    }
    println!(
        "synced: good ok={} | forged failed={} | no cert failed={} | plain failed={}",
        good.tg_stat("sync.ok"),
        forged.tg_stat("sync.failed"),
        no_cert.tg_stat("sync.failed"),
        plain.tg_stat("sync.failed"),
    );
}
