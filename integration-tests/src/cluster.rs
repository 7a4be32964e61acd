//! Real central-service replicas (`tenantgate serve`) for multi-node tests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{cli_bin, free_port, request, wait_for, Envoy, NodeSpec};

/// One `tenantgate serve` process on a fixed loopback port; killed on drop.
pub struct Serve {
    child: Option<Child>,
    /// The sync API's port.
    pub port: u16,
    /// Health, readiness and metrics.
    pub admin_port: u16,
    /// Extra arguments (TLS).
    pub extra: Vec<String>,
    policy: PathBuf,
    store: String,
    interval_ms: u64,
    log: PathBuf,
}

impl Serve {
    /// Starts a replica and waits until `/readyz` answers 200.
    pub fn start(policy: &Path, store: &str, interval_ms: u64, port: u16, log: &Path) -> Serve {
        Serve::start_with(policy, store, interval_ms, port, log, &[])
    }

    /// [`Serve::start`] with extra `tenantgate serve` arguments.
    pub fn start_with(
        policy: &Path,
        store: &str,
        interval_ms: u64,
        port: u16,
        log: &Path,
        extra: &[String],
    ) -> Serve {
        let mut serve = Serve {
            child: None,
            port,
            admin_port: crate::free_port(),
            extra: extra.to_vec(),
            policy: policy.to_owned(),
            store: store.to_owned(),
            interval_ms,
            log: log.to_owned(),
        };
        serve.restart();
        serve
    }

    /// `tenantgate serve --grpc-listen` (Envoy's RLS and RLQS) on the
    /// embedded store: `policy` written into `dir` and checked with
    /// `tenantgate policy check` first. Returns the replica and its gRPC
    /// port.
    pub fn grpc(dir: &Path, policy: &str) -> (Serve, u16) {
        let path = dir.join("policy.yaml");
        std::fs::write(&path, policy).expect("write the policy");
        let check = Command::new(cli_bin())
            .args(["policy", "check"])
            .arg(&path)
            .output()
            .expect("tenantgate policy check");
        assert!(
            check.status.success(),
            "{}",
            String::from_utf8_lossy(&check.stderr)
        );
        let grpc = crate::free_port();
        let serve = Serve::start_with(
            &path,
            "embedded",
            1000,
            crate::free_port(),
            &dir.join("serve.log"),
            &["--grpc-listen".to_owned(), format!("127.0.0.1:{grpc}")],
        );
        (serve, grpc)
    }

    pub fn ready(&self) -> bool {
        request(self.admin_port, "GET", "/readyz", &[]).is_ok_and(|r| r.status == 200)
    }

    /// Kills the replica (as a crash would).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and waits until it is ready.
    pub fn restart(&mut self) {
        self.stop();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("serve log");
        let child = Command::new(cli_bin())
            .arg("serve")
            .arg("--policy")
            .arg(&self.policy)
            .arg("--listen")
            .arg(format!("127.0.0.1:{}", self.port))
            .arg("--store")
            .arg(&self.store)
            .arg("--interval-ms")
            .arg(self.interval_ms.to_string())
            .arg("--admin")
            .arg(format!("127.0.0.1:{}", self.admin_port))
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .expect("start tenantgate serve");
        self.child = Some(child);
        let ready = wait_for(Duration::from_secs(20), || self.ready());
        assert!(
            ready,
            "tenantgate serve on {} not ready in 20 s; see {}",
            self.port,
            self.log.display()
        );
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `tenantgate serve` (embedded store, 1 s interval) and its Envoys; the
/// temporary directory is removed on drop.
pub struct Cluster {
    pub serve: Serve,
    pub envoys: Vec<Envoy>,
    pub dir: PathBuf,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `tenantgate serve` with `service_policy` and one Envoy per region in
/// `regions`, every Envoy with `node_policy`.
pub fn cluster(name: &str, regions: &[&str], node_policy: &str, service_policy: &str) -> Cluster {
    let dir = std::env::temp_dir().join(format!("tenantgate-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("policy.yaml");
    std::fs::write(&policy, service_policy).unwrap();
    let port = free_port();
    let serve = Serve::start(&policy, "embedded", 1000, port, &dir.join("serve.log"));
    assert!(wait_for(Duration::from_secs(10), || serve.ready()), "serve ready");
    let envoys = regions
        .iter()
        .enumerate()
        .map(|(i, region)| {
            Envoy::start_node(
                node_policy,
                &NodeSpec {
                    id: format!("envoy-{region}-{i}"),
                    region: Some((*region).into()),
                    sync_ports: vec![port],
                    sync_tls: None,
                },
            )
        })
        .collect();
    Cluster { serve, envoys, dir }
}
