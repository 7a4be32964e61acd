//! Test and benchmark support: a throwaway `redis-server` on loopback,
//! and [`free_port`] for every server a test starts.
//!
//! The service tests and `make bench-service` run against a real Redis.
//! [`RedisServer::start`] runs one on a free port with persistence off, in a
//! temporary directory, and kills it when dropped. If `redis-server` is not
//! installed it fails with a message saying how to install it (tests do
//! not skip).

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Ports below this are never handed out by [`free_port`].
const LOWEST_PORT: u32 = 10_000;

/// A free loopback port for a server a test starts later (Envoy, Redis,
/// PostgreSQL, `tenantgate serve`), taken **below the kernel's ephemeral
/// range** (`net.ipv4.ip_local_port_range`, 32768–60999 by default). A
/// port from `bind(0)` is in that range, and so is the local port of every
/// client connection a test makes: between the check and the server's own
/// bind, one of the thousands of connections a test suite opens can take
/// it (CI saw Envoy fail with "Address already in use" that way). Below
/// the range only servers bind, and this process hands each port out
/// once. Falls back to `bind(0)` if the range leaves no room below it.
pub fn free_port() -> Result<u16, String> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let high = ephemeral_low().min(u32::from(u16::MAX));
    if high > LOWEST_PORT + 1_000 {
        let span = high - LOWEST_PORT;
        // Processes start at different places (the tests of several
        // binaries may run at once), then walk the range.
        let start = std::process::id().wrapping_mul(7_919) % span;
        for _ in 0..span.min(4_096) {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let port = LOWEST_PORT + start.wrapping_add(n) % span;
            let Ok(port) = u16::try_from(port) else { continue };
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free loopback port: {e}"))
}

/// The lowest ephemeral port (Linux; 32768 if it cannot be read).
fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A `redis-server` child process.
pub struct RedisServer {
    child: Option<Child>,
    dir: PathBuf,
    pub port: u16,
}

/// `$TENANTGATE_REDIS_SERVER`, else `/usr/bin/redis-server` if present,
/// else `redis-server` from `PATH`.
fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("TENANTGATE_REDIS_SERVER") {
        return PathBuf::from(p);
    }
    let debian = PathBuf::from("/usr/bin/redis-server");
    if debian.exists() {
        return debian;
    }
    PathBuf::from("redis-server")
}

impl RedisServer {
    /// Starts one and waits (at most 10 s) until it accepts connections.
    pub fn start() -> Result<RedisServer, String> {
        let port = free_port()?;
        let dir = std::env::temp_dir().join(format!("tenantgate-redis-{}-{port}", std::process::id()));
        RedisServer::start_in(dir, port, &[])
    }

    /// Starts one on `port` with its files in `dir` and `extra` options.
    fn start_in(dir: PathBuf, port: u16, extra: &[String]) -> Result<RedisServer, String> {
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let bin = binary();
        let child = Command::new(&bin)
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(&dir)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                format!(
                    "cannot run {}: {e}. The Redis store's tests need redis-server: \
                     `apt-get install -y redis-server` (make setup-redis does it), \
                     or set TENANTGATE_REDIS_SERVER",
                    bin.display()
                )
            })?;
        let mut server = RedisServer {
            child: Some(child),
            dir,
            port,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(Ok(Some(status))) = server.child.as_mut().map(|c| c.try_wait()) {
                return Err(format!("redis-server exited at start: {status}"));
            }
            if Instant::now() > deadline {
                return Err(format!("redis-server did not listen on {port} within 10 s"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills it now (to test a store outage).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The CPU time (user and system, all its threads) the Redis server at
/// `url` has used so far, in ns (`INFO cpu`): what the benchmarks print
/// per call beside the service's own.
pub fn redis_cpu_ns(url: &str) -> Result<u64, String> {
    let mut c = redis::Client::open(url)
        .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
        .map_err(|e| format!("{url}: {e}"))?;
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query(&mut c)
        .map_err(|e| format!("{url}: {e}"))?;
    let secs: f64 = info
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            ["used_cpu_user", "used_cpu_sys"]
                .contains(&k)
                .then(|| v.trim().parse::<f64>().ok())?
        })
        .sum();
    Ok((secs * 1e9) as u64)
}

/// A Redis Cluster on loopback: three masters, each with one replica
/// (`redis-server --cluster-enabled yes`, formed by `redis-cli --cluster
/// create … --cluster-replicas 1`), persistence off, a node timeout of one
/// second so a killed master's replica takes over within a few seconds.
/// Killed and removed when dropped.
pub struct RedisCluster {
    nodes: Vec<ClusterNode>,
}

struct ClusterNode {
    server: Option<RedisServer>,
    dir: PathBuf,
    port: u16,
    bus_port: u16,
}

impl ClusterNode {
    fn args(&self) -> Vec<String> {
        vec![
            "--cluster-enabled".into(),
            "yes".into(),
            "--cluster-config-file".into(),
            self.dir.join("nodes.conf").to_string_lossy().into_owned(),
            "--cluster-node-timeout".into(),
            "1000".into(),
            // Its own bus port: `port + 10000` could be another test's.
            "--cluster-port".into(),
            self.bus_port.to_string(),
        ]
    }

    fn start(&mut self) -> Result<(), String> {
        let mut server = RedisServer::start_in(self.dir.clone(), self.port, &self.args())?;
        // The node's files (its nodes.conf) stay for a restart: the
        // cluster removes them when dropped.
        server.dir = PathBuf::new();
        self.server = Some(server);
        Ok(())
    }

    fn query(&self, cmd: &mut redis::Cmd) -> Result<redis::Value, String> {
        let mut c = redis::Client::open(format!("redis://127.0.0.1:{}", self.port))
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
            .map_err(|e| format!("node {}: {e}", self.port))?;
        cmd.query(&mut c).map_err(|e| format!("node {}: {e}", self.port))
    }

    /// A command's text answer ("" if the node does not answer).
    fn text(&self, cmd: &mut redis::Cmd) -> String {
        self.query(cmd)
            .ok()
            .and_then(|v| redis::from_redis_value::<String>(v).ok())
            .unwrap_or_default()
    }

    fn cluster_info(&self) -> String {
        self.text(redis::cmd("CLUSTER").arg("INFO"))
    }

    fn replication(&self) -> String {
        self.text(redis::cmd("INFO").arg("replication"))
    }
}

impl RedisCluster {
    /// Starts six nodes, forms the cluster and waits (at most 30 s) until
    /// every slot is served and every master's replica is in sync.
    pub fn start() -> Result<RedisCluster, String> {
        let mut nodes = Vec::new();
        for _ in 0..6 {
            let port = free_port()?;
            let bus_port = free_port()?;
            let dir = std::env::temp_dir().join(format!("tenantgate-rc-{}-{port}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let mut node = ClusterNode {
                server: None,
                dir,
                port,
                bus_port,
            };
            node.start()?;
            nodes.push(node);
        }
        let cluster = RedisCluster { nodes };
        let cli = std::env::var_os("TENANTGATE_REDIS_CLI").unwrap_or_else(|| "redis-cli".into());
        let out = Command::new(&cli)
            .arg("--cluster")
            .arg("create")
            .args(cluster.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| {
                format!(
                    "cannot run {}: {e} (it comes with redis-server)",
                    cli.to_string_lossy()
                )
            })?;
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create: {}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout)
            ));
        }
        cluster.wait_healthy(Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// `redis+cluster://` with every node as a seed.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    /// Every node's `redis://` URL (running or not).
    pub fn node_urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect()
    }

    /// Waits until every running node says `cluster_state:ok` and every
    /// master has a replica online that is caught up.
    pub fn wait_healthy(&self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            let running: Vec<&ClusterNode> = self.nodes.iter().filter(|n| n.server.is_some()).collect();
            let ok = running
                .iter()
                .all(|n| n.cluster_info().contains("cluster_state:ok"));
            let replicated = running.iter().all(|n| {
                let r = n.replication();
                !r.contains("role:master") || r.contains("state=online")
            });
            let masters = running
                .iter()
                .filter(|n| n.replication().contains("role:master"))
                .count();
            if ok && replicated && masters == 3 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("the cluster did not become healthy within {within:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills (SIGKILL) the master that serves `key`'s slot; returns its
    /// index for [`RedisCluster::failed_over`] and [`RedisCluster::restart`].
    pub fn kill_master_of(&mut self, key: &str) -> Result<usize, String> {
        let slot = self.slot_of(key)?;
        let i = self
            .master_of(slot)
            .ok_or_else(|| format!("no running master serves slot {slot}"))?;
        if let Some(mut s) = self.nodes[i].server.take() {
            s.stop();
        }
        Ok(i)
    }

    fn slot_of(&self, key: &str) -> Result<i64, String> {
        let node = self
            .nodes
            .iter()
            .find(|n| n.server.is_some())
            .ok_or("no node runs")?;
        node.query(redis::cmd("CLUSTER").arg("KEYSLOT").arg(key))
            .and_then(|v| redis::from_redis_value(v).map_err(|e| e.to_string()))
    }

    /// The running node that says it is the master serving `slot`.
    fn master_of(&self, slot: i64) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| n.server.is_some() && serves(&n.text(redis::cmd("CLUSTER").arg("NODES")), slot))
    }

    /// Whether a node other than `killed` now serves `key`'s slot as its
    /// master, and every running node says every slot is served. (Until
    /// then, a master restarted without persistence would come back with
    /// its slots and no data, and its replica would copy the emptiness: the
    /// classic way to lose a Redis master's data, which this waits out.)
    pub fn failed_over(&self, key: &str, killed: usize) -> bool {
        let Ok(slot) = self.slot_of(key) else {
            return false;
        };
        self.master_of(slot).is_some_and(|m| m != killed)
            && self
                .nodes
                .iter()
                .filter(|n| n.server.is_some())
                .all(|n| n.cluster_info().contains("cluster_state:ok"))
    }

    /// Starts moving `key`'s slot to another master, as `redis-cli
    /// --cluster reshard` does: the slot `MIGRATING` on its master and
    /// `IMPORTING` on the other, its keys still where they were (a client
    /// that asks the old master for a key already moved is answered
    /// `ASK`). Then [`RedisCluster::migrate_keys`] and
    /// [`RedisCluster::finish_migration`].
    pub fn begin_migration(&self, key: &str) -> Result<Migration, String> {
        let slot = self.slot_of(key)?;
        let from = self
            .master_of(slot)
            .ok_or_else(|| format!("no running master serves slot {slot}"))?;
        let to = (0..self.nodes.len())
            .find(|&i| {
                i != from
                    && self.nodes[i].server.is_some()
                    && self.nodes[i].replication().contains("role:master")
            })
            .ok_or("no other master")?;
        let id = |i: usize| self.nodes[i].text(redis::cmd("CLUSTER").arg("MYID"));
        let m = Migration {
            slot,
            from,
            to,
            from_id: id(from),
            to_id: id(to),
        };
        let set = |node: usize, state: &str, other: &str| {
            self.nodes[node]
                .query(
                    redis::cmd("CLUSTER")
                        .arg("SETSLOT")
                        .arg(slot)
                        .arg(state)
                        .arg(other),
                )
                .map(|_| ())
        };
        set(m.to, "IMPORTING", &m.from_id)?;
        set(m.from, "MIGRATING", &m.to_id)?;
        Ok(m)
    }

    /// Moves every key of the migrating slot to its new master (`MIGRATE`).
    pub fn migrate_keys(&self, m: &Migration) -> Result<usize, String> {
        let from = &self.nodes[m.from];
        let mut moved = 0;
        loop {
            let keys: Vec<String> = from
                .query(redis::cmd("CLUSTER").arg("GETKEYSINSLOT").arg(m.slot).arg(100))
                .and_then(|v| redis::from_redis_value(v).map_err(|e| e.to_string()))?;
            if keys.is_empty() {
                return Ok(moved);
            }
            let mut cmd = redis::cmd("MIGRATE");
            cmd.arg("127.0.0.1")
                .arg(self.nodes[m.to].port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys);
            from.query(&mut cmd)?;
            moved += keys.len();
        }
    }

    /// Gives the slot to its new master on every master (`SETSLOT NODE`).
    pub fn finish_migration(&self, m: &Migration) -> Result<(), String> {
        for i in [m.to, m.from] {
            self.nodes[i]
                .query(
                    redis::cmd("CLUSTER")
                        .arg("SETSLOT")
                        .arg(m.slot)
                        .arg("NODE")
                        .arg(&m.to_id),
                )
                .map(|_| ())?;
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if i != m.to && i != m.from && n.replication().contains("role:master") {
                n.query(
                    redis::cmd("CLUSTER")
                        .arg("SETSLOT")
                        .arg(m.slot)
                        .arg("NODE")
                        .arg(&m.to_id),
                )
                .map(|_| ())?;
            }
        }
        Ok(())
    }

    /// Kills every node (an outage of the whole cluster).
    pub fn stop_all(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut s) = n.server.take() {
                s.stop();
            }
        }
    }

    /// Starts node `i` again (with its cluster state: it rejoins, as a
    /// replica of whoever took its slots).
    pub fn restart(&mut self, i: usize) -> Result<(), String> {
        let node = self.nodes.get_mut(i).ok_or("no such node")?;
        node.start()
    }
}

/// A slot on its way from one master to another
/// ([`RedisCluster::begin_migration`]).
pub struct Migration {
    pub slot: i64,
    from: usize,
    to: usize,
    from_id: String,
    to_id: String,
}

/// Whether `CLUSTER NODES`' `myself` line is a master that serves `slot`.
fn serves(nodes: &str, slot: i64) -> bool {
    nodes
        .lines()
        .find(|l| l.contains("myself") && l.contains("master"))
        .is_some_and(|l| {
            l.split_whitespace().skip(8).any(|range| {
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                matches!((a.parse::<i64>(), b.parse::<i64>()), (Ok(a), Ok(b)) if (a..=b).contains(&slot))
            })
        })
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut s) = n.server.take() {
                s.stop();
            }
            let _ = std::fs::remove_dir_all(&n.dir);
        }
    }
}

/// A minimal HTTP/1.1 client for tests and benchmarks: one request per
/// connection, answered within 5 s. Returns the status and the body.
pub async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    // A server may answer before it read the whole body (413) and close:
    // then the write fails, and the answer is still there to read.
    let written = s.write_all(req.as_bytes()).await;
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
        .await
        .map_err(|_| String::from("no answer within 5 s"))?;
    if out.is_empty() {
        written.map_err(|e| format!("write: {e}"))?;
        read.map_err(|e| format!("read: {e}"))?;
    }
    let text = String::from_utf8_lossy(&out);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("no end of headers")?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or("no status")?;
    Ok((status, body.to_owned()))
}

/// A throwaway PostgreSQL server on loopback, in a temporary directory that
/// the `postgres` user owns (PostgreSQL refuses to run as root: as root, its
/// commands run through `runuser -u postgres --`). Stopped (`pg_ctl stop -m
/// immediate`) and removed when dropped. Binaries from
/// `$TENANTGATE_PG_BIN`, else `/usr/lib/postgresql/15/bin`.
pub struct PostgresServer {
    dir: PathBuf,
    bin: PathBuf,
    as_postgres: bool,
    port: u16,
    running: bool,
    /// The server options it was started with (a restart uses them again).
    opts: String,
}

impl PostgresServer {
    fn command(&self, tool: &str) -> Command {
        let exe = self.bin.join(tool);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(exe);
            c
        } else {
            Command::new(exe)
        }
    }

    fn run(&self, tool: &str, args: &[&str]) -> Result<(), String> {
        let out = self
            .command(tool)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| {
                format!(
                    "cannot run {tool} from {}: {e}. The PostgreSQL quota tests need the Debian \
                     `postgresql` package (make setup installs it), or TENANTGATE_PG_BIN",
                    self.bin.display()
                )
            })?;
        if !out.status.success() {
            return Err(format!(
                "{tool} {}: {}\n{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(())
    }

    /// Initializes a cluster and starts it with PostgreSQL's defaults;
    /// waits (at most 30 s) until it accepts connections.
    pub fn start() -> Result<PostgresServer, String> {
        PostgresServer::start_with(&[])
    }

    /// [`PostgresServer::start`] with extra server options (`-c name=value`).
    /// The tests pass `-c fsync=off`: they test the service's transactions
    /// and its crashes, not PostgreSQL's own durability on power loss.
    pub fn start_with(extra: &[&str]) -> Result<PostgresServer, String> {
        let port = free_port()?;
        let dir = std::env::temp_dir().join(format!("tenantgate-pg-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let as_postgres = Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
            .unwrap_or(false);
        if as_postgres {
            let ok = Command::new("chown")
                .arg("postgres:postgres")
                .arg(&dir)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if !ok {
                return Err(format!("cannot chown {} to the postgres user", dir.display()));
            }
        }
        let bin = std::env::var_os("TENANTGATE_PG_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"));
        let mut server = PostgresServer {
            dir,
            bin,
            as_postgres,
            port,
            running: false,
            opts: String::new(),
        };
        let data = server.dir.join("data");
        let data = data.to_string_lossy().into_owned();
        server.run(
            "initdb",
            &[
                "-D",
                &data,
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        )?;
        server.opts = format!(
            "-c listen_addresses=127.0.0.1 -p {port} -k {} -c max_connections=200 {}",
            server.dir.display(),
            extra.join(" ")
        );
        server.restart()?;
        Ok(server)
    }

    /// Starts it again after [`PostgresServer::stop`] (same port, same
    /// data); waits (at most 30 s) until it accepts connections.
    pub fn restart(&mut self) -> Result<(), String> {
        let data = self.dir.join("data").to_string_lossy().into_owned();
        let log = self.dir.join("log").to_string_lossy().into_owned();
        let opts = self.opts.clone();
        self.run(
            "pg_ctl",
            &["-D", &data, "-l", &log, "-w", "-t", "30", "-o", &opts, "start"],
        )?;
        self.running = true;
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if Instant::now() > deadline {
                return Err(format!("postgres did not listen on {} within 30 s", self.port));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// A libpq-style connection string for the `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops it at once (to test an unreachable database).
    pub fn stop(&mut self) {
        if self.running {
            let data = self.dir.join("data").to_string_lossy().into_owned();
            let _ = self.run("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]);
            self.running = false;
        }
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
