//! Bounded memory on `tenantgate serve`'s listeners (central/src/bounded.rs):
//! the real binary, 1,000 concurrent gRPC messages of the largest size
//! (4 MiB RLS requests of 63 descriptors of 65,000-byte values, over 10
//! HTTP/2 connections) on `--grpc-listen`, then 1,000 concurrent sync
//! bodies of the largest size (`--max-body-bytes`, 2 MiB, one HTTP/1
//! connection each) on `--listen`. Serve's peak resident memory (VmHWM in
//! /proc/<pid>/status) stays under [`MAX_PEAK_BYTES`], the figure
//! docs/central-service.md states, and an ordinary RLS request is answered
//! after each flood (and is tried during it). Prints the figures:
//! `cargo test -p tenantgate-cli --test bounded_memory -- --nocapture`
//! (`BOUNDED_MESSAGES=N` for another count).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The stated bound on serve's peak RSS under this test.
const MAX_PEAK_BYTES: u64 = 256 * 1024 * 1024;
const MESSAGES: usize = 1000;
fn messages() -> usize {
    std::env::var("BOUNDED_MESSAGES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(MESSAGES)
}
const CONNECTIONS: usize = 10;
/// The whole test, floods included.
const DEADLINE: Duration = Duration::from_secs(240);

fn free_port() -> u16 {
    tenantgate_central::testing::free_port().unwrap()
}

struct Serve {
    child: Child,
    grpc: SocketAddr,
    sync: SocketAddr,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn policy_file(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/import/edge.yaml");
    let text = std::fs::read_to_string(src).unwrap();
    let imported = tenantgate_cli::import::import(
        &[tenantgate_cli::import::Source {
            name: "edge.yaml",
            text: &text,
        }],
        "bounded",
    )
    .unwrap();
    let path = dir.join("policy.yaml");
    std::fs::write(&path, imported.policy_yaml).unwrap();
    path
}

fn start(policy: &Path) -> Serve {
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let sync: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let admin = format!("127.0.0.1:{}", free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .args(["serve", "--policy"])
        .arg(policy)
        .args(["--listen", &sync.to_string(), "--admin", &admin])
        .args(["--grpc-listen", &grpc.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Serve { child, grpc, sync }
}

/// `VmHWM` or `VmRSS` of `pid`, in bytes.
fn memory(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap();
    kb * 1024
}

fn varint(mut n: usize, out: &mut Vec<u8>) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// Protobuf field `tag` (length-delimited) holding `body`.
fn field(tag: u8, body: &[u8], out: &mut Vec<u8>) {
    out.push(tag);
    varint(body.len(), out);
    out.extend_from_slice(body);
}

/// A `RateLimitRequest` for domain `edge_proxy`, one descriptor per value
/// (`remote_address` = value), as a gRPC frame.
fn rls_frame(values: &[&[u8]]) -> Bytes {
    let mut msg = Vec::new();
    field(0x0a, b"edge_proxy", &mut msg);
    for v in values {
        let mut entry = Vec::new();
        field(0x0a, b"remote_address", &mut entry);
        field(0x12, v, &mut entry);
        let mut descriptor = Vec::new();
        field(0x0a, &entry, &mut descriptor);
        field(0x12, &descriptor, &mut msg);
    }
    let mut out = vec![0u8];
    out.extend_from_slice(&u32::try_from(msg.len()).unwrap().to_be_bytes());
    out.extend_from_slice(&msg);
    Bytes::from(out)
}

/// The largest message: 63 descriptors of 65,000-byte values, just under 4 MiB.
fn largest_frame() -> Bytes {
    let values: Vec<Vec<u8>> = (0..63u8).map(|i| vec![b'a' + i % 26; 65_000]).collect();
    let refs: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
    let frame = rls_frame(&refs);
    assert!(frame.len() - 5 <= 4 * 1024 * 1024, "{}", frame.len());
    assert!(frame.len() - 5 > 4_000_000);
    frame
}

/// Sends one gRPC request on `client`; its `grpc-status` (None: the
/// stream failed).
async fn call(client: h2::client::SendRequest<Bytes>, addr: SocketAddr, frame: Bytes) -> Option<String> {
    let req = http::Request::post(format!(
        "http://{addr}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap();
    let mut client = client.ready().await.ok()?;
    let (response, mut send) = client.send_request(req, false).ok()?;
    let _ = send.send_data(frame, true);
    let response = response.await.ok()?;
    if let Some(s) = response.headers().get("grpc-status") {
        return Some(s.to_str().ok()?.to_owned());
    }
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.ok()?;
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    let trailers = body.trailers().await.ok()??;
    Some(trailers.get("grpc-status")?.to_str().ok()?.to_owned())
}

async fn connect(addr: SocketAddr) -> h2::client::SendRequest<Bytes> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    client
}

/// An ordinary RLS request on a connection of its own: answered `OK`.
async fn ordinary(addr: SocketAddr) -> Option<String> {
    let tcp = TcpStream::connect(addr).await.ok()?;
    let (client, conn) = h2::client::handshake(tcp).await.ok()?;
    tokio::spawn(conn);
    call(client, addr, rls_frame(&[b"10.0.0.1"])).await
}

async fn ordinary_within(addr: SocketAddr, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if ordinary(addr).await.as_deref() == Some("0") {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// One HTTP/1 POST of `body` to /v1/sync; the status (None: the
/// connection failed).
async fn post_sync(addr: SocketAddr, body: Bytes) -> Option<u16> {
    let mut tcp = TcpStream::connect(addr).await.ok()?;
    let head = format!(
        "POST /v1/sync HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.ok()?;
    let _ = tcp.write_all(&body).await;
    let mut buf = vec![0u8; 512];
    let n = tcp.read(&mut buf).await.ok()?;
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    text.split_whitespace().nth(1)?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_largest_messages_keep_serve_under_its_stated_memory_and_serving() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let serve = start(&policy_file(dir.path()));
    let pid = serve.child.id();
    assert!(
        ordinary_within(serve.grpc, Duration::from_secs(30)).await,
        "serve answers an ordinary RLS request"
    );
    let baseline = memory(pid, "VmRSS");

    // 1,000 concurrent 4 MiB RLS requests over 10 connections.
    let frame = largest_frame();
    let clients: Vec<_> = futures_join(CONNECTIONS, |_| connect(serve.grpc)).await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..messages() {
        let client = clients[i % CONNECTIONS].clone();
        let (addr, frame) = (serve.grpc, frame.clone());
        tasks.spawn(async move { call(client, addr, frame).await });
    }
    let during = ordinary_within(serve.grpc, Duration::from_secs(60)).await;
    let mut statuses = std::collections::BTreeMap::<String, usize>::new();
    while let Some(r) = tokio::time::timeout(DEADLINE.saturating_sub(started.elapsed()), tasks.join_next())
        .await
        .expect("the gRPC flood ends within the deadline")
    {
        let key = r.unwrap().unwrap_or_else(|| "stream failed".to_owned());
        *statuses.entry(key).or_default() += 1;
    }
    let grpc_peak = memory(pid, "VmHWM");
    assert!(
        ordinary_within(serve.grpc, Duration::from_secs(30)).await,
        "an ordinary RLS request is answered after the gRPC flood"
    );

    // 1,000 concurrent 2 MiB sync bodies, one HTTP/1 connection each.
    let body = Bytes::from(vec![b' '; 2 * 1024 * 1024]);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..messages() {
        let (addr, body) = (serve.sync, body.clone());
        tasks.spawn(async move { post_sync(addr, body).await });
    }
    let mut sync_statuses = std::collections::BTreeMap::<String, usize>::new();
    while let Some(r) = tokio::time::timeout(DEADLINE.saturating_sub(started.elapsed()), tasks.join_next())
        .await
        .expect("the sync flood ends within the deadline")
    {
        let key = r
            .unwrap()
            .map_or("connection failed".to_owned(), |s| s.to_string());
        *sync_statuses.entry(key).or_default() += 1;
    }
    let peak = memory(pid, "VmHWM");
    assert!(
        ordinary_within(serve.grpc, Duration::from_secs(30)).await,
        "an ordinary RLS request is answered after both floods"
    );
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "serve RSS: baseline {:.1} MiB; peak (VmHWM) after 1,000 concurrent 4 MiB gRPC messages {:.1} MiB, \
         after 1,000 concurrent 2 MiB sync bodies {:.1} MiB (stated bound {:.0} MiB); \
         gRPC answers {statuses:?}; sync answers {sync_statuses:?}; ordinary request answered during the gRPC flood: {during}; \
         {:.1} s",
        mib(baseline),
        mib(grpc_peak),
        mib(peak),
        mib(MAX_PEAK_BYTES),
        started.elapsed().as_secs_f64()
    );
    assert!(
        peak < MAX_PEAK_BYTES,
        "serve's peak RSS {:.1} MiB is over the stated {:.0} MiB",
        mib(peak),
        mib(MAX_PEAK_BYTES)
    );
}

/// `n` futures made by `f`, awaited in order.
async fn futures_join<F, Fut, T>(n: usize, f: F) -> Vec<T>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        out.push(f(i).await);
    }
    out
}
