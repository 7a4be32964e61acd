//! Harness for end-to-end tests: a real Envoy 1.40 running the built
//! `tenantgate.wasm` (or, on the [`Host::Module`] host, the native
//! `libtenantgate_module.so`) with the demo bootstrap (`envoy/demo.yaml`)
//! on free loopback ports, the real `tenantgate` CLI, and a small raw
//! HTTP/1.1 client that can send what real clients send (non-UTF-8 bytes,
//! 64 KiB headers) without a client library normalising it.
//!
//! **Two hosts.** A test written once runs on both with
//! [`on_both_hosts!`]: the harness's host is per test thread
//! ([`with_host`]), and every Envoy a test starts runs tenantgate on it (the
//! ECDS resource from `tenantgate policy apply --wasm` or `--module`; on the
//! module, routes with a class in their metadata also carry it in their
//! per-route config, and Envoy's environment names the node for the sync).
//!
//! Everything is bounded: Envoy start-up, waits for conditions (always with
//! a deadline, never a bare sleep for a condition) and request loops.

pub mod cluster;
pub mod model;
pub mod upstream;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Worker threads of every Envoy the tests start (`--concurrency`).
pub const WORKERS: u64 = 2;
/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn tool(env: &str, default: PathBuf, hint: &str) -> PathBuf {
    let path = std::env::var_os(env).map(PathBuf::from).unwrap_or(default);
    assert!(path.exists(), "{} not found ({env}); {hint}", path.display());
    path
}

pub fn envoy_bin() -> PathBuf {
    tool(
        "ENVOY_BIN",
        repo().join(".venv/bin/envoy"),
        "run `make test`, which installs Envoy 1.40 into .venv",
    )
}

pub fn cli_bin() -> PathBuf {
    tool(
        "TENANTGATE_BIN",
        repo().join("target/debug/tenantgate"),
        "run `make test`, which builds the CLI",
    )
}

pub fn wasm_file() -> PathBuf {
    tool(
        "TENANTGATE_WASM",
        repo().join("target/wasm32-wasip1/wasm-release/tenantgate.wasm"),
        "run `make test`, which builds the filter",
    )
}

/// The native module (`make module`).
pub fn module_file() -> PathBuf {
    tool(
        "TENANTGATE_MODULE",
        repo().join("target/module-release/libtenantgate_module.so"),
        "run `make test`, which builds the module",
    )
}

/// The module built with its test-only fault switch (`make module-faults`).
pub fn module_faults_file() -> PathBuf {
    tool(
        "TENANTGATE_MODULE_FAULTS",
        repo().join("target/faults/debug/libtenantgate_module.so"),
        "run `make module-faults`, which builds the module with its test-only fault switch",
    )
}

/// What runs tenantgate inside the Envoys a test starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Host {
    /// The proxy-wasm filter (`tenantgate.wasm`).
    Wasm,
    /// The Envoy dynamic module (`libtenantgate_module.so`).
    Module,
}

thread_local! {
    static HOST: std::cell::Cell<Host> = const { std::cell::Cell::new(Host::Wasm) };
    /// Extra environment for this test thread's Envoys ([`with_envoy_env`]).
    static ENVOY_ENV: std::cell::RefCell<Vec<(String, String)>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The module library of this test thread's Envoys ([`with_module_file`]).
    static MODULE_FILE: std::cell::RefCell<Option<PathBuf>> = const { std::cell::RefCell::new(None) };
    /// `--concurrency` of this test thread's Envoys ([`with_workers`]).
    static CONCURRENCY: std::cell::Cell<u64> = const { std::cell::Cell::new(WORKERS) };
}

/// Runs `f` with this thread's Envoys loading the module from `file`
/// (e.g. [`module_faults_file`]) instead of [`module_file`].
pub fn with_module_file<R>(file: PathBuf, f: impl FnOnce() -> R) -> R {
    let before = MODULE_FILE.with(|m| m.replace(Some(file)));
    let result = f();
    MODULE_FILE.with(|m| m.replace(before));
    result
}

/// The module library this thread's Envoys load.
fn module_in_use() -> PathBuf {
    MODULE_FILE
        .with(|m| m.borrow().clone())
        .unwrap_or_else(module_file)
}

/// Runs `f` with this thread's Envoys on `workers` worker threads (users
/// run more workers than the cores they get: `--concurrency 4` on this
/// 2-core machine is such a case).
pub fn with_workers<R>(workers: u64, f: impl FnOnce() -> R) -> R {
    let before = CONCURRENCY.with(|c| c.replace(workers));
    let result = f();
    CONCURRENCY.with(|c| c.set(before));
    result
}

/// Runs `f` with these variables in the environment of every Envoy it starts.
pub fn with_envoy_env<R>(env: &[(&str, &str)], f: impl FnOnce() -> R) -> R {
    let vars = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let before = ENVOY_ENV.with(|e| e.replace(vars));
    let result = f();
    ENVOY_ENV.with(|e| e.replace(before));
    result
}

/// The host of this test thread's Envoys ([`Host::Wasm`] unless set).
pub fn host() -> Host {
    HOST.with(std::cell::Cell::get)
}

/// Runs `f` with this thread's Envoys on `host`.
pub fn with_host<R>(host: Host, f: impl FnOnce() -> R) -> R {
    let before = HOST.with(|h| h.replace(host));
    let result = f();
    HOST.with(|h| h.set(before));
    result
}

/// Runs the test function `$name` (no `#[test]` of its own) on both hosts:
/// tests `$name::wasm` and `$name::module`.
#[macro_export]
macro_rules! on_both_hosts {
    ($name:ident) => {
        mod $name {
            #[test]
            fn wasm() {
                $crate::with_host($crate::Host::Wasm, super::$name)
            }
            #[test]
            fn module() {
                $crate::with_host($crate::Host::Module, super::$name)
            }
        }
    };
}

/// The ECDS type of each host's resource.
const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const MODULE_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter";

/// A demo-style bootstrap for `host`: on the module, the ECDS type is the
/// module's, and every route whose metadata names a class also names it in
/// its per-route config (the module's way: no lookup per request).
pub fn bootstrap_for(host: Host, bootstrap: &str) -> String {
    if host == Host::Wasm {
        return bootstrap.to_owned();
    }
    let module = module_in_use();
    let mut out = String::with_capacity(bootstrap.len() * 2);
    for line in bootstrap.split_inclusive('\n') {
        if bootstrap.contains(MODULE_TYPE) {
            out.push_str(line);
        } else {
            out.push_str(&line.replace(WASM_TYPE, MODULE_TYPE));
        }
        let marker = "metadata: { filter_metadata: { tenantgate: { class: ";
        if let Some(at) = line.find(marker) {
            let indent = &line[..line.len() - line.trim_start().len()];
            let class = line[at + marker.len()..]
                .split([' ', '}'])
                .next()
                .unwrap_or_default();
            out.push_str(&format!(
                "{indent}typed_per_filter_config:\n{indent}  tenantgate:\n{indent}    \"@type\": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilterPerRoute\n{indent}    dynamic_module_config: {{ module: {{ local: {{ filename: {} }} }}, do_not_close: true }}\n{indent}    per_route_config_name: tenantgate\n{indent}    filter_config: {{ \"@type\": type.googleapis.com/google.protobuf.StringValue, value: {class} }}\n",
                module.display()
            ));
        }
    }
    out
}

/// Polls `condition` until it holds or `timeout` passes.
pub fn wait_for(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The nearest-rank percentile `pct` (1–100) of `values`: the smallest
/// value at least `pct` % of them are at or below (for 100 values, p99 is
/// the 99th smallest, not the largest); zero for no values.
pub fn percentile(values: impl IntoIterator<Item = Duration>, pct: usize) -> Duration {
    let mut v: Vec<Duration> = values.into_iter().collect();
    v.sort_unstable();
    let rank = (v.len().saturating_mul(pct.min(100))).div_ceil(100);
    v.get(rank.saturating_sub(1)).copied().unwrap_or_default()
}

/// A free loopback port for a server the test starts (see
/// [`tenantgate_central::testing::free_port`]: below the ephemeral range).
pub fn free_port() -> u16 {
    tenantgate_central::testing::free_port().expect("a free loopback port")
}

static NEXT_DIR: AtomicU32 = AtomicU32::new(0);

/// Who an Envoy is, as one node of several (see [`Envoy::start_node`]).
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub id: String,
    pub region: Option<String>,
    /// The `tenantgate` sync cluster's endpoints (loopback ports).
    pub sync_ports: Vec<u16>,
    /// mTLS to the sync service (`envoy/sync-mtls.yaml`).
    pub sync_tls: Option<SyncTls>,
}

/// The files of `envoy/sync-mtls.yaml`: the CA that signed the service's
/// certificate, and the node's certificate and key (`None`: TLS with no
/// client certificate).
#[derive(Debug, Clone)]
pub struct SyncTls {
    pub ca: PathBuf,
    pub client: Option<(PathBuf, PathBuf)>,
}

impl Default for NodeSpec {
    fn default() -> NodeSpec {
        NodeSpec {
            id: "tenantgate-demo".into(),
            region: None,
            sync_ports: vec![free_port()],
            sync_tls: None,
        }
    }
}

/// A running Envoy with the tenantgate filter; killed on drop.
pub struct Envoy {
    child: Child,
    /// What runs tenantgate in it.
    pub host: Host,
    pub dir: PathBuf,
    /// The demo listener (tenant from `x-tenant-id`).
    pub port: u16,
    /// The JWT listener (header stripped, set by jwt_authn from the claim).
    pub jwt_port: u16,
    pub admin: u16,
    pub ecds: PathBuf,
}

impl Envoy {
    /// Starts Envoy (`--concurrency 2`) with `policy_yaml` applied through
    /// the CLI, and waits until it serves. Its `tenantgate` sync cluster
    /// points at a free port nobody listens on.
    pub fn start(policy_yaml: &str) -> Envoy {
        Envoy::start_with_sync(policy_yaml, free_port())
    }

    /// [`Envoy::start`] with the `tenantgate` sync cluster on `sync_port`
    /// (see [`SyncServer`]), plus a `tenantgate_empty` cluster with no
    /// endpoints (no healthy host).
    pub fn start_with_sync(policy_yaml: &str, sync_port: u16) -> Envoy {
        Envoy::start_node(
            policy_yaml,
            &NodeSpec {
                sync_ports: vec![sync_port],
                ..NodeSpec::default()
            },
        )
    }

    /// [`Envoy::start`] as one node of several: its own `node.id` and
    /// region, and a `tenantgate` sync cluster over `sync_ports`.
    pub fn start_node(policy_yaml: &str, node: &NodeSpec) -> Envoy {
        Envoy::start_node_with(policy_yaml, node, |b| b)
    }

    /// [`Envoy::start_node`] with the bootstrap edited by `edit` last.
    pub(crate) fn start_node_with(
        policy_yaml: &str,
        node: &NodeSpec,
        edit: impl FnOnce(String) -> String,
    ) -> Envoy {
        let dir = Envoy::temp_dir();
        let (port, jwt_port, admin) = (free_port(), free_port(), free_port());
        let ecds = dir.join("ecds.yaml");

        let policy = dir.join("policy.yaml");
        std::fs::write(&policy, policy_yaml).expect("write policy");
        let applied = apply_with_cli(host(), &policy, &ecds);
        assert!(applied.0, "initial policy refused: {}", applied.1);

        let demo = std::fs::read_to_string(repo().join("envoy/demo.yaml")).expect("envoy/demo.yaml");
        let mut bootstrap = demo.clone();
        for (from, to) in [
            ("port_value: 10000", format!("port_value: {port}")),
            ("port_value: 10001", format!("port_value: {jwt_port}")),
            ("port_value: 9901", format!("port_value: {admin}")),
            ("path: envoy/run/ecds.yaml", format!("path: {}", ecds.display())),
        ] {
            assert!(
                bootstrap.contains(from),
                "envoy/demo.yaml no longer contains `{from}`"
            );
            bootstrap = bootstrap.replace(from, &to);
        }
        let endpoint = "        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 10002 } } }\n";
        assert!(
            bootstrap.contains(endpoint),
            "envoy/demo.yaml no longer has the sync endpoint line"
        );
        let endpoints: String = node
            .sync_ports
            .iter()
            .map(|p| endpoint.replace("10002", &p.to_string()))
            .collect();
        bootstrap = bootstrap.replace(endpoint, &endpoints);
        assert!(
            bootstrap.contains("  id: tenantgate-demo\n"),
            "envoy/demo.yaml no longer sets node.id"
        );
        let mut identity = format!("  id: {}\n", node.id);
        if let Some(region) = &node.region {
            identity.push_str(&format!("  locality: {{ region: {region} }}\n"));
        }
        bootstrap = bootstrap.replace("  id: tenantgate-demo\n", &identity);
        if let Some(tls) = &node.sync_tls {
            let cluster = "  - name: tenantgate\n    type: STATIC\n";
            assert!(
                bootstrap.contains(cluster),
                "envoy/demo.yaml no longer has the tenantgate cluster"
            );
            let snippet =
                std::fs::read_to_string(repo().join("envoy/sync-mtls.yaml")).expect("envoy/sync-mtls.yaml");
            let mut block: String = snippet
                .lines()
                .filter(|l| !l.trim_start().starts_with('#'))
                .map(|l| format!("{l}\n"))
                .collect();
            block = block.replace("envoy/run/certs/ca.pem", &tls.ca.display().to_string());
            match &tls.client {
                Some((cert, key)) => {
                    block = block
                        .replace("envoy/run/certs/tenantgate-demo.pem", &cert.display().to_string())
                        .replace("envoy/run/certs/tenantgate-demo.key", &key.display().to_string());
                }
                None => {
                    let certs_start = block
                        .find("          tls_certificates:")
                        .expect("tls_certificates in the snippet");
                    let certs_end = block
                        .find("          validation_context:")
                        .expect("validation_context in the snippet");
                    block.replace_range(certs_start..certs_end, "");
                }
            }
            bootstrap = bootstrap.replace(cluster, &format!("{cluster}{block}"));
        }
        bootstrap.push_str(
            "  - name: tenantgate_empty\n    type: STATIC\n    connect_timeout: 0.25s\n    load_assignment: { cluster_name: tenantgate_empty, endpoints: [] }\n",
        );
        let bootstrap = bootstrap_for(host(), &edit(bootstrap));
        let env = node_env(&node.id, node.region.as_deref());
        Envoy::launch_with_env(dir, &bootstrap, port, jwt_port, admin, ecds, &env)
    }

    /// A fresh directory for one Envoy's files.
    pub fn temp_dir() -> PathBuf {
        let n = NEXT_DIR.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("tenantgate-it-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    /// Starts Envoy (`--concurrency` [`WORKERS`], or [`with_workers`]) on a bootstrap of the
    /// caller's, written to `dir`, and waits until it is ready and `port`
    /// accepts connections.
    pub fn launch(
        dir: PathBuf,
        bootstrap: &str,
        port: u16,
        jwt_port: u16,
        admin: u16,
        ecds: PathBuf,
    ) -> Envoy {
        Envoy::launch_with_env(dir, bootstrap, port, jwt_port, admin, ecds, &[])
    }

    /// [`Envoy::launch`] with extra environment variables for Envoy.
    pub fn launch_with_env(
        dir: PathBuf,
        bootstrap: &str,
        port: u16,
        jwt_port: u16,
        admin: u16,
        ecds: PathBuf,
        env: &[(String, String)],
    ) -> Envoy {
        let config = dir.join("bootstrap.yaml");
        std::fs::write(&config, bootstrap).expect("write bootstrap");

        let log = std::fs::File::create(dir.join("envoy.log")).expect("log file");
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&config)
            .args([
                "--concurrency",
                &CONCURRENCY.with(std::cell::Cell::get).to_string(),
                "--disable-hot-restart",
                "-l",
                "info",
                // Access logs written to a file reach it within 50 ms
                // instead of Envoy's default 10 s: the tests that read a
                // decision or cost record waited for the flush, up to 10 s
                // each. What Envoy writes is the same.
                "--file-flush-interval-msec",
                "50",
            ])
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .envs(ENVOY_ENV.with(|e| e.borrow().clone()))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .expect("start envoy");
        let envoy = Envoy {
            child,
            host: host(),
            dir,
            port,
            jwt_port,
            admin,
            ecds,
        };
        let ready = wait_for(Duration::from_secs(30), || {
            envoy.admin_get("/ready").is_some_and(|r| r.status == 200)
                && TcpStream::connect(("127.0.0.1", envoy.port)).is_ok()
        });
        assert!(
            ready,
            "Envoy did not become ready in 30 s; log:\n{}",
            envoy.log_tail()
        );
        envoy
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the Envoy process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Envoy's resident memory (VmRSS), KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }

    pub fn log_tail(&self) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Applies a policy with `tenantgate policy apply`; (success, stderr).
    pub fn apply(&self, policy_yaml: &str) -> (bool, String) {
        let n = NEXT_DIR.fetch_add(1, Ordering::SeqCst);
        let policy = self.dir.join(format!("policy-{n}.yaml"));
        std::fs::write(&policy, policy_yaml).expect("write policy");
        apply_with_cli(self.host, &policy, &self.ecds)
    }

    pub fn admin_get(&self, path: &str) -> Option<Response> {
        request(self.admin, "GET", path, &[]).ok()
    }

    /// A counter or gauge from `/stats`, by exact name.
    pub fn stat(&self, name: &str) -> Option<u64> {
        let body = self
            .admin_get(&format!("/stats?filter=^{}$", name.replace('.', "\\.")))?
            .body;
        let text = String::from_utf8_lossy(&body).into_owned();
        text.lines().find_map(|l| {
            l.strip_prefix(name)
                .and_then(|r| r.strip_prefix(": "))
                .and_then(|v| v.trim().parse().ok())
        })
    }

    /// A tenantgate counter (`wasmcustom.tenantgate.<name>`), 0 if unset,
    /// once settled (see [`Envoy::settle`]).
    pub fn tg_stat(&self, name: &str) -> u64 {
        self.settle();
        self.stat(&format!("wasmcustom.tenantgate.{name}")).unwrap_or(0)
    }

    /// Waits until every worker has given Envoy what it counted so far: the
    /// filter counts per-request stats in the worker and flushes them on its
    /// tick (every 10 ms), so Envoy's counters lag by one tick. Waits (at
    /// most 5 s) for `stats.flushes` to advance by three ticks per worker.
    pub fn settle(&self) {
        let flushes = || self.stat("wasmcustom.tenantgate.stats.flushes").unwrap_or(0);
        let start = flushes();
        wait_for(Duration::from_secs(5), || flushes() >= start + 3 * WORKERS);
    }

    /// Connections each worker has accepted on the demo listener.
    pub fn worker_connections(&self) -> [u64; 2] {
        let s = |w: u32| {
            self.stat(&format!(
                "listener.127.0.0.1_{}.worker_{w}.downstream_cx_total",
                self.port
            ))
            .unwrap_or(0)
        };
        [s(0), s(1)]
    }
}

/// What Envoy logs when the module uses a capability its allow-list left
/// out (proxy-wasm-cpp-host's stubs: `… restricted proxy-wasm capability:
/// proxy_<name>` or `… restricted WASI capability: <name>`).
pub const REFUSED_CAPABILITY: &str = "Attempted call to restricted";

impl Drop for Envoy {
    /// Stops Envoy. Every test runs under the capability allow-list
    /// `policy apply` writes: one that did not fail already fails here if
    /// Envoy refused the module a call.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let log = self.log();
            if let Some(line) = log.lines().find(|l| l.contains(REFUSED_CAPABILITY)) {
                panic!(
                    "Envoy refused the filter a capability its allow-list left out: {line}\n(log in {})",
                    self.dir.display()
                );
            }
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Envoy's environment on the module: who the node is (the ABI cannot
/// read Envoy's `node`; see `module/src/host.rs`). Harmless on wasm.
fn node_env(id: &str, region: Option<&str>) -> Vec<(String, String)> {
    let mut env = vec![("TENANTGATE_NODE_ID".to_owned(), id.to_owned())];
    if let Some(r) = region {
        env.push(("TENANTGATE_REGION".to_owned(), r.to_owned()));
    }
    env
}

/// `tenantgate policy apply` for `host`; (success, stderr).
pub fn apply_with_cli(host: Host, policy: &Path, ecds: &Path) -> (bool, String) {
    let mut cmd = Command::new(cli_bin());
    cmd.args(["policy", "apply"]).arg(policy).arg("--ecds").arg(ecds);
    match host {
        Host::Wasm => cmd.arg("--wasm").arg(wasm_file()),
        Host::Module => cmd.arg("--module").arg(module_in_use()),
    };
    let out = cmd.output().expect("run tenantgate");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// An HTTP response with lower-cased header names.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// `Retry-After` in seconds (0 if absent or not a number).
    pub fn retry_after(&self) -> u64 {
        self.header("retry-after")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// A keep-alive HTTP/1.1 connection.
pub struct Conn {
    reader: BufReader<TcpStream>,
}

impl Conn {
    pub fn open(port: u16) -> std::io::Result<Conn> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.set_nodelay(true)?;
        Ok(Conn {
            reader: BufReader::new(stream),
        })
    }

    /// Sends one request; `path` and header values are raw bytes.
    pub fn send(
        &mut self,
        method: &str,
        path: &[u8],
        headers: &[(&str, &[u8])],
    ) -> std::io::Result<Response> {
        let mut req = Vec::with_capacity(256);
        req.extend_from_slice(method.as_bytes());
        req.push(b' ');
        req.extend_from_slice(path);
        req.extend_from_slice(b" HTTP/1.1\r\nhost: tenantgate.test\r\n");
        for (name, value) in headers {
            req.extend_from_slice(name.as_bytes());
            req.extend_from_slice(b": ");
            req.extend_from_slice(value);
            req.extend_from_slice(b"\r\n");
        }
        req.extend_from_slice(b"\r\n");
        self.reader.get_mut().write_all(&req)?;
        read_response(&mut self.reader)
    }

    pub fn get(&mut self, path: &str, headers: &[(&str, &str)]) -> std::io::Result<Response> {
        let headers: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
        self.send("GET", path.as_bytes(), &headers)
    }

    /// Sends one request with a body (`content-length` set).
    pub fn send_body(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> std::io::Result<Response> {
        let mut req = format!("{method} {path} HTTP/1.1\r\nhost: tenantgate.test\r\n").into_bytes();
        for (name, value) in headers {
            req.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
        }
        req.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
        req.extend_from_slice(body);
        self.reader.get_mut().write_all(&req)?;
        read_response(&mut self.reader)
    }
}

/// One request on a fresh connection (so requests spread over workers).
pub fn request(port: u16, method: &str, path: &str, headers: &[(&str, &str)]) -> std::io::Result<Response> {
    let mut headers: Vec<(&str, &str)> = headers.to_vec();
    headers.push(("connection", "close"));
    let raw: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
    Conn::open(port)?.send(method, path.as_bytes(), &raw)
}

/// `GET path` with a tenant on a fresh connection.
pub fn get(port: u16, path: &str, headers: &[(&str, &str)]) -> Response {
    request(port, "GET", path, headers).unwrap_or_else(|e| panic!("GET {path} on {port}: {e}"))
}

fn invalid(msg: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.to_owned())
}

fn read_response(r: &mut BufReader<TcpStream>) -> std::io::Result<Response> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| invalid(&line))?;
    let mut headers = Vec::new();
    loop {
        let mut h = Vec::new();
        r.read_until(b'\n', &mut h)?;
        let h = String::from_utf8_lossy(&h).trim_end().to_owned();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
    let find = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v): &(String, String)| v.clone())
    };
    let mut body = Vec::new();
    if let Some(len) = find("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body.resize(len, 0);
        r.read_exact(&mut body)?;
    } else if find("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size)?;
            let size = usize::from_str_radix(size.trim(), 16).map_err(|_| invalid("chunk size"))?;
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk)?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else if find("connection").is_some_and(|v| v.eq_ignore_ascii_case("close")) {
        r.read_to_end(&mut body)?;
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// A tiny deterministic PRNG (xorshift64*), so fuzz runs are reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// The demo JWTs (`envoy/demo-tokens.json`).
pub fn demo_token(name: &str) -> String {
    let text =
        std::fs::read_to_string(repo().join("envoy/demo-tokens.json")).expect("envoy/demo-tokens.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("tokens json");
    v[name]
        .as_str()
        .unwrap_or_else(|| panic!("no demo token {name}"))
        .to_owned()
}

/// How the stub sync server answers `POST /v1/sync`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyncMode {
    /// A lease of `tokens` (TTL `ttl_ms`) for every reported (key, limit);
    /// with `once`, only the first time a (key, limit) is reported.
    Leases { tokens: u64, ttl_ms: u64, once: bool },
    /// `200` with a body that is not a sync response.
    Garbage,
    /// Waits this long, then answers like `Leases` would have.
    Slow(Duration, u64),
    /// This status, empty body.
    Status(u16),
    /// Not listening: connections are refused.
    Down,
    /// A `200` with its headers and part of its body, then a TCP reset
    /// (Envoy's callout fails after the response began: no headers reach
    /// the filter).
    ResetAfterHeaders,
    /// A `200` with a body of this many bytes (`[` then spaces: never a
    /// complete answer). Over [`ENVOY_CALLOUT_BUFFER_LIMIT`], Envoy resets
    /// the callout.
    LongBody(usize),
    /// Reads the request, then closes the connection without answering.
    CloseBeforeHeaders,
    /// The first copy of each report (`seq`) waits this long before its
    /// answer (longer than the node's callout timeout: as if it were
    /// lost); a later copy of the same `seq` is answered at once, like
    /// `Leases` (`tokens`, 3 s) would (the node's hedge).
    StallFirstCopy(Duration, u64),
}

/// Envoy's buffer limit for an async-client (callout) response body: 32 MiB
/// (`kBufferLimitForResponse` in `source/common/http/async_client_impl.h`,
/// runtime key `http.async_response_buffer_limit`).
pub const ENVOY_CALLOUT_BUFFER_LIMIT: usize = 32 * 1024 * 1024;

/// A stub of the central service (`tenantgate serve`) on a loopback port:
/// answers sync requests as its [`SyncMode`] says and records them.
pub struct SyncServer {
    pub port: u16,
    mode: std::sync::Arc<std::sync::Mutex<SyncMode>>,
    requests: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    interval_ms: u64,
}

impl SyncServer {
    pub fn start(mode: SyncMode, interval_ms: u64) -> SyncServer {
        SyncServer::start_on(0, mode, interval_ms)
    }

    /// [`SyncServer::start`] on a given port (0: any free one).
    pub fn start_on(port: u16, mode: SyncMode, interval_ms: u64) -> SyncServer {
        use std::sync::{Arc, Mutex};
        let listener = TcpListener::bind(("127.0.0.1", port)).expect("bind the stub sync server");
        let port = listener.local_addr().expect("addr").port();
        let server = SyncServer {
            port,
            mode: Arc::new(Mutex::new(mode)),
            requests: Arc::new(Mutex::new(Vec::new())),
            stop: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            interval_ms,
        };
        let (mode, requests, stop) = (server.mode.clone(), server.requests.clone(), server.stop.clone());
        std::thread::spawn(move || {
            let granted = Arc::new(Mutex::new(std::collections::HashSet::<String>::new()));
            let mut listener = Some(listener);
            while !stop.load(Ordering::SeqCst) {
                let down = *mode.lock().unwrap() == SyncMode::Down;
                if down {
                    listener = None;
                } else if listener.is_none() {
                    listener = TcpListener::bind(("127.0.0.1", port)).ok();
                }
                let Some(l) = &listener else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                l.set_nonblocking(true).expect("nonblocking");
                match l.accept() {
                    Ok((stream, _)) => {
                        let (mode, requests, granted) = (mode.clone(), requests.clone(), granted.clone());
                        std::thread::spawn(move || {
                            serve_sync(stream, &mode, &requests, &granted, interval_ms);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        server
    }

    pub fn set_mode(&self, mode: SyncMode) {
        *self.mode.lock().unwrap() = mode;
    }

    /// Every sync request received so far, parsed.
    pub fn requests(&self) -> Vec<serde_json::Value> {
        self.requests.lock().unwrap().clone()
    }

    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }
}

impl Drop for SyncServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Reads one HTTP/1.1 request head from a keep-alive connection (blank
/// lines before it are skipped); returns its `content-length` (0 if none),
/// or `None` once the connection is closed or fails.
pub(crate) fn read_request_head(reader: &mut BufReader<TcpStream>) -> Option<usize> {
    read_request_line_and_head(reader).map(|(_, len)| len)
}

/// A request's head: its path and its `content-length` (0 without one).
pub(crate) fn read_request_line_and_head(reader: &mut BufReader<TcpStream>) -> Option<(String, usize)> {
    read_request_head_full(reader).map(|h| (h.path, h.content_length))
}

/// A request's head as the test upstreams read it.
pub(crate) struct RequestHead {
    pub path: String,
    pub content_length: usize,
    /// Its `accept-encoding`, if any.
    pub accept_encoding: Option<String>,
    /// Its body comes chunked (`transfer-encoding: chunked`).
    pub chunked: bool,
}

/// A request body of `head` (content-length or chunked, as Envoy sends it).
pub(crate) fn read_request_body(reader: &mut BufReader<TcpStream>, head: &RequestHead) -> Option<Vec<u8>> {
    use std::io::Read;
    if !head.chunked {
        let mut body = vec![0; head.content_length];
        reader.read_exact(&mut body).ok()?;
        return Some(body);
    }
    let mut body = Vec::new();
    loop {
        let mut size = String::new();
        reader.read_line(&mut size).ok()?;
        let n = usize::from_str_radix(size.trim().split(';').next()?.trim(), 16).ok()?;
        let mut data = vec![0; n + 2];
        reader.read_exact(&mut data).ok()?;
        if n == 0 {
            return Some(body);
        }
        body.extend_from_slice(&data[..n]);
    }
}

pub(crate) fn read_request_head_full(reader: &mut BufReader<TcpStream>) -> Option<RequestHead> {
    let mut accept_encoding = None;
    let mut chunked = false;
    let mut content_length = 0usize;
    let mut path = String::new();
    let mut first = true;
    loop {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return None,
            Ok(_) => {}
        }
        let line = line.trim_end();
        if line.is_empty() {
            if first {
                continue;
            }
            return Some(RequestHead {
                path,
                content_length,
                accept_encoding,
                chunked,
            });
        }
        if first {
            path = line.split(' ').nth(1).unwrap_or_default().to_owned();
        }
        first = false;
        if let Some((k, v)) = line.split_once(':') {
            if k.trim().eq_ignore_ascii_case("content-length") {
                content_length = v.trim().parse().unwrap_or(0);
            }
            if k.trim().eq_ignore_ascii_case("accept-encoding") {
                accept_encoding = Some(v.trim().to_owned());
            }
            if k.trim().eq_ignore_ascii_case("transfer-encoding") && v.trim().eq_ignore_ascii_case("chunked")
            {
                chunked = true;
            }
        }
    }
}

fn serve_sync(
    stream: TcpStream,
    mode: &std::sync::Mutex<SyncMode>,
    requests: &std::sync::Mutex<Vec<serde_json::Value>>,
    granted: &std::sync::Mutex<std::collections::HashSet<String>>,
    interval_ms: u64,
) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let mut reader = BufReader::new(stream);
    loop {
        // One request: headers, then a content-length body (Envoy's async
        // client sends one).
        let Some(len) = read_request_head(&mut reader) else {
            return;
        };
        let mut body = vec![0; len];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let req: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
        requests.lock().unwrap().push(req.clone());
        let current = mode.lock().unwrap().clone();
        let leases = |tokens: u64, ttl_ms: u64, once: bool| -> Vec<serde_json::Value> {
            let mut granted = granted.lock().unwrap();
            req["reports"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .filter(|r| {
                    let id = format!("{}/{}", r["key"], r["limit"]);
                    !once || granted.insert(id)
                })
                .map(|r| {
                    serde_json::json!({"key": r["key"], "limit": r["limit"], "tokens": tokens,
                        "share": tokens, "ttl_ms": ttl_ms})
                })
                .collect()
        };
        let answer = |leases: Vec<serde_json::Value>| {
            serde_json::json!({"version": 1, "ack_seq": req["seq"], "interval_ms": interval_ms,
                "leases": leases})
            .to_string()
        };
        let (status, body) = match current {
            SyncMode::Leases { tokens, ttl_ms, once } => (200, answer(leases(tokens, ttl_ms, once))),
            SyncMode::Slow(wait, tokens) => {
                std::thread::sleep(wait);
                (200, answer(leases(tokens, 3_000, false)))
            }
            SyncMode::StallFirstCopy(wait, tokens) => {
                let first = granted.lock().unwrap().insert(format!("seq/{}", req["seq"]));
                if first {
                    std::thread::sleep(wait);
                }
                (200, answer(leases(tokens, 3_000, false)))
            }
            SyncMode::Garbage => (200, String::from("<html>not json</html>")),
            SyncMode::Status(code) => (code, String::new()),
            SyncMode::Down | SyncMode::CloseBeforeHeaders => return,
            SyncMode::ResetAfterHeaders => {
                let body = answer(leases(1, 3_000, false));
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                );
                let stream = reader.get_mut();
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(&body.as_bytes()[..body.len() / 2]);
                let _ = stream.flush();
                // A reset, not a close: linger 0 sends RST on drop.
                let _ = socket2::SockRef::from(&*stream).set_linger(Some(Duration::ZERO));
                return;
            }
            SyncMode::LongBody(len) => {
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n"
                );
                let stream = reader.get_mut();
                if stream.write_all(head.as_bytes()).is_err() {
                    return;
                }
                // Over its limit, Envoy resets the stream: writes then fail.
                let chunk = vec![b' '; 1 << 16];
                let mut left = len.saturating_sub(1);
                let _ = stream.write_all(b"[");
                while left > 0 {
                    let n = left.min(chunk.len());
                    if stream.write_all(&chunk[..n]).is_err() {
                        return;
                    }
                    left -= n;
                }
                return;
            }
        };
        let response = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if reader.get_mut().write_all(response.as_bytes()).is_err() {
            return;
        }
    }
}
