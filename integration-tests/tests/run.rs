//! `make run` end to end, through the same supervisor script the Makefile
//! runs (`envoy/run.py`), on free ports passed through its environment
//! variables: it starts two Envoys in two regions and `tenantgate serve`
//! (mTLS, certificates from `tenantgate certs`); the README's demo-contract
//! lines hold on the first Envoy; `demo-global` is limited across both
//! Envoys within its bound; SIGINT (Ctrl-C) leaves no process behind; a
//! busy port is refused with a message naming it.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tenantgate_integration_tests::{
    cli_bin, envoy_bin, free_port, get, host, module_file, on_both_hosts, repo, wait_for, wasm_file, Host,
};

const PORT_VARS: [&str; 8] = [
    "TG_RUN_PORT_A",
    "TG_RUN_JWT_PORT_A",
    "TG_RUN_ADMIN_A",
    "TG_RUN_PORT_B",
    "TG_RUN_JWT_PORT_B",
    "TG_RUN_ADMIN_B",
    "TG_RUN_SYNC_PORT",
    "TG_RUN_SERVE_ADMIN",
];

struct Run {
    child: Child,
    out: Arc<Mutex<String>>,
    ports: Vec<(&'static str, u16)>,
}

impl Run {
    fn start(ports: Vec<(&'static str, u16)>, dir: &std::path::Path) -> Run {
        let mut cmd = Command::new("python3");
        cmd.arg(repo().join("envoy/run.py"))
            .env("ENVOY_BIN", envoy_bin())
            .env("TENANTGATE_BIN", cli_bin())
            .env("TENANTGATE_WASM", wasm_file())
            .env("TG_RUN_DIR", dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (var, port) in &ports {
            cmd.env(var, port.to_string());
        }
        if host() == Host::Module {
            cmd.env("TG_RUN_HOST", "module")
                .env("TENANTGATE_MODULE", module_file());
        }
        let mut child = cmd.spawn().expect("python3 envoy/run.py");
        let out = Arc::new(Mutex::new(String::new()));
        for stream in [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let out = Arc::clone(&out);
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    out.lock().unwrap().push_str(&format!("{line}\n"));
                }
            });
        }
        Run { child, out, ports }
    }

    fn output(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    fn port(&self, var: &str) -> u16 {
        self.ports.iter().find(|(v, _)| *v == var).unwrap().1
    }

    /// The pids the script says it started.
    fn pids(&self) -> Vec<u32> {
        self.output()
            .lines()
            .filter_map(|l| l.strip_prefix("started "))
            .filter_map(|l| l.split(" pid ").nth(1))
            .filter_map(|l| l.split_whitespace().next())
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        // If an assertion failed, still stop everything (the script does).
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        if self.wait_exit(Duration::from_secs(15)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn free_ports() -> Vec<(&'static str, u16)> {
    PORT_VARS.iter().map(|v| (*v, free_port())).collect()
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

fn tenant(t: &str) -> [(&str, &str); 1] {
    [("x-tenant-id", t)]
}

on_both_hosts!(make_run_starts_the_whole_system_and_ctrl_c_stops_it);
fn make_run_starts_the_whole_system_and_ctrl_c_stops_it() {
    let dir = std::env::temp_dir().join(format!("tenantgate-run-{}-{:?}", std::process::id(), host()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut run = Run::start(free_ports(), &dir);
    assert!(
        wait_for(Duration::from_secs(60), || run
            .output()
            .lines()
            .any(|l| l == "ready")),
        "make run's script did not get ready:\n{}",
        run.output()
    );
    let out = run.output();
    assert!(out.contains("made certificates with `tenantgate certs`"), "{out}");
    let (a, b) = (run.port("TG_RUN_PORT_A"), run.port("TG_RUN_PORT_B"));
    assert!(out.contains(&format!("http://127.0.0.1:{a}")) && out.contains(&format!("http://127.0.0.1:{b}")));
    let pids = run.pids();
    assert_eq!(pids.len(), 3, "serve and two Envoys: {out}");

    // The demo contract (README "Try it"), on Envoy A.
    let first = get(a, "/api/orders", &tenant("demo-free"));
    assert_eq!(first.status, 200);
    assert_eq!(first.header("ratelimit-policy"), Some("\"free\";q=100;w=60"));
    assert_eq!(first.header("ratelimit"), Some("\"free\";r=99;t=0"));
    let admitted = 1
        + (0..119)
            .filter(|_| get(a, "/api/orders", &tenant("demo-free")).status == 200)
            .count();
    assert!(
        (100..=102).contains(&admitted),
        "demo-free admitted {admitted} of 120"
    );
    let denied = get(a, "/api/orders", &tenant("demo-free"));
    assert_eq!(denied.status, 429);
    assert_eq!(denied.header("x-tenantgate-reason"), Some("rate_limited"));
    assert!(denied.header("retry-after").is_some());
    let paid = get(a, "/api/orders", &tenant("demo-paid"));
    assert_eq!(paid.header("ratelimit-policy"), Some("\"paid\";q=10000;w=60"));
    let search = get(a, "/api/search", &tenant("demo-free"));
    assert_eq!(search.header("ratelimit"), Some("\"free\";r=95;t=0"));

    // demo-global: one budget of 100/min (burst 100) across both Envoys.
    // Bound over a stretch t shorter than the window, from a full bucket:
    // B + r·t + N·P (N = 2 nodes, P = 2 provisional units each).
    let start = Instant::now();
    let (mut at_a, mut at_b, mut sent) = (0u64, 0u64, 0u64);
    while sent < 600 && start.elapsed() < Duration::from_secs(8) {
        for (port, count) in [(a, &mut at_a), (b, &mut at_b)] {
            if get(port, "/api/orders", &tenant("demo-global")).status == 200 {
                *count += 1;
            }
            sent += 1;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let elapsed = start.elapsed().as_secs_f64();
    let bound = 100 + 2 * 2 + (100.0 * elapsed / 60.0).ceil() as u64;
    println!(
        "demo-global: sent {sent} over {elapsed:.1} s; admitted {at_a} at A + {at_b} at B = {} (bound {bound}; per-node limits would admit 200)",
        at_a + at_b
    );
    assert!(at_a + at_b <= bound, "admitted {} > bound {bound}", at_a + at_b);
    assert!(
        at_a >= 1 && at_b >= 1,
        "each Envoy admits its part: {at_a} / {at_b}"
    );
    let serve_admin = run.port("TG_RUN_SERVE_ADMIN");
    let metrics = get(serve_admin, "/metrics", &[]);
    let body = String::from_utf8_lossy(&metrics.body).into_owned();
    let ok_syncs: u64 = body
        .lines()
        .find_map(|l| l.strip_prefix("tenantgate_sync_requests_total{result=\"ok\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(ok_syncs >= 2, "both Envoys sync over mTLS: {ok_syncs}");

    // `tenantgate top --once --json`: the service's bounded top-K, per
    // region, has demo-global first by demand and by denials in both.
    let url = format!("http://127.0.0.1:{serve_admin}");
    let top_once = |json: bool| {
        let mut args = vec!["top", "--service", url.as_str(), "--once"];
        if json {
            args.push("--json");
        }
        let out = Command::new(cli_bin()).args(&args).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let mut top = serde_json::Value::Null;
    let both = wait_for(Duration::from_secs(10), || {
        top = serde_json::from_str(&top_once(true)).unwrap();
        let regions = top["regions"].as_array().cloned().unwrap_or_default();
        ["eu", "us"].iter().all(|want| {
            regions.iter().any(|r| {
                r["region"] == *want
                    && r["by_demand"][0]["key"] == "orders|t|demo-global"
                    && r["by_denials"][0]["key"] == "orders|t|demo-global"
            })
        })
    });
    assert!(both, "top: {top:#}");
    assert!(top["sync_requests"]["ok"].as_u64().unwrap() >= 2);
    assert_eq!(top["capacity"], 256);
    println!("{}", top_once(false));

    // Ctrl-C: everything it started is stopped and reaped.
    let status = Command::new("kill")
        .args(["-INT", &run.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(
        run.wait_exit(Duration::from_secs(20)),
        Some(0),
        "{}",
        run.output()
    );
    for pid in pids {
        assert!(!alive(pid), "pid {pid} is still running after Ctrl-C");
    }
    for (var, port) in &run.ports {
        assert!(
            TcpListener::bind(("127.0.0.1", *port)).is_ok(),
            "{var} ({port}) still bound after Ctrl-C"
        );
    }
}

#[test]
fn a_busy_port_is_named_and_nothing_starts() {
    let dir = std::env::temp_dir().join(format!("tenantgate-run-busy-{}", std::process::id()));
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap().port();
    let mut ports = free_ports();
    ports[3].1 = busy; // TG_RUN_PORT_B
    let mut run = Run::start(ports, &dir);
    assert_eq!(run.wait_exit(Duration::from_secs(20)), Some(2));
    let out = run.output();
    assert!(
        out.contains(&format!(
            "127.0.0.1:{busy} (Envoy B listener; set TG_RUN_PORT_B=PORT"
        )),
        "{out}"
    );
    assert!(run.pids().is_empty(), "{out}");
}
