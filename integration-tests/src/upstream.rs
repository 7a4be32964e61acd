//! A controllable test upstream: an HTTP/1.1 server on a loopback port
//! whose latency and concurrency capacity can be set during a test (beyond
//! its capacity a request waits, in arrival order, for a free place before its latency
//! starts, like a saturated backend), which can **hold** every
//! request until released, and which records how many requests it had in
//! flight at once. Its answers' status can be set (a failing backend:
//! [`Upstream::set_status`]); each carries the version set by
//! [`Upstream::set_version`] as its `etag` and in its body. A path with a
//! `/model/<answer>` part is answered like a model API instead
//! ([`crate::model`]: JSON with `usage`, server-sent events whose last
//! event carries it, usage missing or malformed, reset mid-stream). With
//! [`Envoy::start_with_upstream`], routes
//! `/up/<class>` (route metadata `class: <class>`) go to it.

use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{Envoy, NodeSpec};

/// The most arrival instants kept (see [`Upstream::record_arrivals`]).
pub const MAX_ARRIVALS: usize = 100_000;

/// The longest a held request waits for [`Upstream::release`].
pub const MAX_HOLD: Duration = Duration::from_secs(30);

#[derive(Default)]
struct State {
    latency_ms: AtomicU64,
    /// The answers' status; 0: 200.
    status: AtomicU64,
    /// The answers' `etag` and body.
    version: AtomicU64,
    /// Requests read (served or not).
    received: AtomicU64,
    /// When each request was read, while [`Upstream::record_arrivals`] is on
    /// (bounded by [`MAX_ARRIVALS`]).
    arrivals: Mutex<Option<Vec<Instant>>>,
    /// Requests served at once; 0: no limit.
    capacity: AtomicU64,
    /// Requests in their latency (under the capacity), and the line of
    /// those waiting for a place.
    line: Mutex<Line>,
    freed: Condvar,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    served: AtomicU64,
    stop: AtomicBool,
    /// Held while true.
    hold: Mutex<bool>,
    /// One more header line for every answer (`name: value`), if set.
    extra_header: Mutex<Option<String>>,
    /// The last request's `accept-encoding`.
    accept_encoding: Mutex<Option<String>>,
    /// The last request's body.
    last_body: Mutex<Option<Vec<u8>>>,
    released: Condvar,
}

/// Beyond its capacity, requests wait in arrival order (like a backend's
/// accept queue): each takes a ticket, and only the oldest waiting ticket
/// may take a freed place, so a request's wait is bounded by the requests
/// ahead of it (a random wake-up order gave unlucky requests unbounded
/// waits and the tests' p99s their noise).
#[derive(Default)]
struct Line {
    busy: u64,
    /// The next ticket to hand out.
    next: u64,
    /// The ticket whose turn it is.
    turn: u64,
    /// Tickets that left before their turn (gave up after [`MAX_HOLD`]).
    left: std::collections::BTreeSet<u64>,
}

impl Line {
    /// `ticket` leaves the line (served or given up): the turn passes on,
    /// over tickets that already left.
    fn leave(&mut self, ticket: u64) {
        if ticket == self.turn {
            self.turn = self.turn.saturating_add(1);
            while self.left.remove(&self.turn) {
                self.turn = self.turn.saturating_add(1);
            }
        } else if ticket > self.turn {
            self.left.insert(ticket);
        }
    }
}

/// The upstream; stops accepting when dropped.
pub struct Upstream {
    pub port: u16,
    state: Arc<State>,
}

impl Upstream {
    pub fn start() -> Upstream {
        let listener = TcpListener::bind(("127.0.0.1", 0)).expect("bind the test upstream");
        let port = listener.local_addr().expect("addr").port();
        listener.set_nonblocking(true).expect("nonblocking");
        let state = Arc::new(State::default());
        let s = state.clone();
        std::thread::spawn(move || {
            while !s.stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let s = s.clone();
                        std::thread::spawn(move || serve(stream, &s));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Upstream { port, state }
    }

    /// Every later request waits this long before its answer.
    pub fn set_latency(&self, latency: Duration) {
        let ms = u64::try_from(latency.as_millis()).unwrap_or(u64::MAX);
        self.state.latency_ms.store(ms, Ordering::SeqCst);
    }

    /// At most `n` requests are served at once (0: no limit); the others
    /// wait for a place (at most [`MAX_HOLD`]).
    pub fn set_capacity(&self, n: u64) {
        self.state.capacity.store(n, Ordering::SeqCst);
        self.state.freed.notify_all();
    }

    /// Every later answer has this status (200 again with `set_status(200)`).
    pub fn set_status(&self, status: u16) {
        self.state.status.store(u64::from(status), Ordering::SeqCst);
    }

    /// Every later answer carries `etag: "v<version>"` and the body
    /// `ok v<version>` (the version starts at 0).
    pub fn set_version(&self, version: u64) {
        self.state.version.store(version, Ordering::SeqCst);
    }

    /// Every later answer carries this header too (`None`: no extra header).
    pub fn set_header(&self, header: Option<(&str, &str)>) {
        *self.state.extra_header.lock().unwrap() = header.map(|(n, v)| format!("{n}: {v}\r\n"));
    }

    /// Requests that reached it (answered or not yet): the upstream attempts.
    pub fn received(&self) -> u64 {
        self.state.received.load(Ordering::SeqCst)
    }

    /// From now on, the instant each request reaches it is kept (at most
    /// [`MAX_ARRIVALS`]); [`Upstream::arrivals`] returns them.
    pub fn record_arrivals(&self) {
        *self.state.arrivals.lock().unwrap() = Some(Vec::new());
    }

    /// The instants requests reached it since [`Upstream::record_arrivals`].
    pub fn arrivals(&self) -> Vec<Instant> {
        self.state.arrivals.lock().unwrap().clone().unwrap_or_default()
    }

    /// Requests wait (at most [`MAX_HOLD`]) until [`Upstream::release`].
    pub fn hold(&self) {
        *self.state.hold.lock().unwrap() = true;
    }

    pub fn release(&self) {
        *self.state.hold.lock().unwrap() = false;
        self.state.released.notify_all();
    }

    /// Requests being served now.
    pub fn in_flight(&self) -> u64 {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    /// The most requests it has served at once.
    pub fn max_in_flight(&self) -> u64 {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }

    pub fn reset_max(&self) {
        self.state.max_in_flight.store(self.in_flight(), Ordering::SeqCst);
    }

    /// The `accept-encoding` of the last request it read (`None`: none).
    pub fn last_accept_encoding(&self) -> Option<String> {
        self.state.accept_encoding.lock().unwrap().clone()
    }

    /// The body of the last request it read.
    pub fn last_body(&self) -> Option<Vec<u8>> {
        self.state.last_body.lock().unwrap().clone()
    }

    /// Requests answered so far.
    pub fn served(&self) -> u64 {
        self.state.served.load(Ordering::SeqCst)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        self.release();
    }
}

/// Serves one keep-alive connection.
fn serve(stream: TcpStream, s: &State) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
    let mut reader = BufReader::new(stream);
    loop {
        let Some(head) = crate::read_request_head_full(&mut reader) else {
            return;
        };
        *s.accept_encoding.lock().unwrap() = head.accept_encoding.clone();
        let Some(body) = crate::read_request_body(&mut reader, &head) else {
            return;
        };
        let path = head.path.clone();
        *s.last_body.lock().unwrap() = Some(body.clone());
        s.received.fetch_add(1, Ordering::SeqCst);
        if let Some(answer) = crate::model::ModelAnswer::of_path(&path) {
            // A model API's answer (crate::model): no latency, no hold.
            let extra = s.extra_header.lock().unwrap().clone().unwrap_or_default();
            let gzip = head
                .accept_encoding
                .as_deref()
                .is_some_and(|a| a.split(',').any(|c| c.trim().starts_with("gzip")));
            match crate::model::answer(reader.get_mut(), answer, &extra, gzip, &body) {
                Ok(true) => {
                    s.served.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                _ => return,
            }
        }
        if let Some(log) = s
            .arrivals
            .lock()
            .unwrap()
            .as_mut()
            .filter(|l| l.len() < MAX_ARRIVALS)
        {
            log.push(Instant::now());
        }
        let now = s.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        s.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let arrived = Instant::now();
        {
            let mut line = s.line.lock().unwrap();
            let ticket = line.next;
            line.next = line.next.saturating_add(1);
            loop {
                let cap = s.capacity.load(Ordering::SeqCst);
                let turn = line.turn == ticket && (cap == 0 || line.busy < cap);
                if turn || arrived.elapsed() >= MAX_HOLD || s.stop.load(Ordering::SeqCst) {
                    break;
                }
                line = s.freed.wait_timeout(line, Duration::from_millis(50)).unwrap().0;
            }
            line.busy += 1;
            line.leave(ticket);
        }
        // The next ticket may have a place too.
        s.freed.notify_all();
        let latency = Duration::from_millis(s.latency_ms.load(Ordering::SeqCst));
        let start = Instant::now();
        {
            let mut held = s.hold.lock().unwrap();
            while *held && start.elapsed() < MAX_HOLD && !s.stop.load(Ordering::SeqCst) {
                held = s
                    .released
                    .wait_timeout(held, Duration::from_millis(50))
                    .unwrap()
                    .0;
            }
        }
        if let Some(rest) = latency.checked_sub(start.elapsed()) {
            std::thread::sleep(rest);
        }
        s.line.lock().unwrap().busy -= 1;
        s.freed.notify_all();
        s.in_flight.fetch_sub(1, Ordering::SeqCst);
        let status = match s.status.load(Ordering::SeqCst) {
            0 => 200,
            n => n,
        };
        let body = format!("ok v{}\n", s.version.load(Ordering::SeqCst));
        let extra = s.extra_header.lock().unwrap().clone().unwrap_or_default();
        let answer = format!(
            "HTTP/1.1 {status} Status\r\ncontent-type: text/plain\r\netag: \"v{}\"\r\n{extra}content-length: {}\r\n\r\n{body}",
            s.version.load(Ordering::SeqCst),
            body.len()
        );
        if reader.get_mut().write_all(answer.as_bytes()).is_err() {
            return;
        }
        s.served.fetch_add(1, Ordering::SeqCst);
    }
}

/// The test upstreams and routes of [`Envoy::start_with_upstreams`].
pub struct Upstreams<'a> {
    /// The `upstream` cluster's port (routes `/up/<class>`).
    pub port: u16,
    pub classes: &'a [&'a str],
    pub access_log: Option<&'a std::path::Path>,
    /// `(header, port)`: requests carrying the header go to the `fallback`
    /// cluster on that port.
    pub fallback: Option<(&'a str, u16)>,
    /// The access log line ends with the cost record.
    pub cost_log: bool,
}

impl Envoy {
    /// [`Envoy::start`] with routes `/up/<class>` for each of `classes`
    /// (route metadata `class: <class>`, 30 s route timeout) to the test
    /// upstream on `upstream_port`, before the demo's routes; the demo
    /// listener balances connections exactly over the workers.
    pub fn start_with_upstream(policy_yaml: &str, upstream_port: u16, classes: &[&str]) -> Envoy {
        Envoy::start_with_upstream_logged(policy_yaml, upstream_port, classes, None)
    }

    /// [`Envoy::start_with_upstream`], with the demo listener's access log
    /// (`envoy/demo.yaml`'s format: `<path> <status> <admission record>`)
    /// written to `access_log` instead of Envoy's stdout.
    pub fn start_with_upstream_logged(
        policy_yaml: &str,
        upstream_port: u16,
        classes: &[&str],
        access_log: Option<&std::path::Path>,
    ) -> Envoy {
        Envoy::start_with_upstream_node(
            policy_yaml,
            upstream_port,
            classes,
            access_log,
            &NodeSpec::default(),
        )
    }

    /// [`Envoy::start_with_upstream_logged`] as the node `node` (its sync
    /// cluster on the ports it names).
    pub fn start_with_upstream_node(
        policy_yaml: &str,
        upstream_port: u16,
        classes: &[&str],
        access_log: Option<&std::path::Path>,
        node: &NodeSpec,
    ) -> Envoy {
        Envoy::start_with_upstreams_node(
            policy_yaml,
            &Upstreams {
                port: upstream_port,
                classes,
                access_log,
                fallback: None,
                cost_log: false,
            },
            node,
        )
    }

    /// [`Envoy::start_with_upstream_logged`] for costs settled after the
    /// response and soft limits: with `cost_log`, the access log line ends
    /// with the cost record (`%FILTER_STATE(wasm.tenantgate_cost:PLAIN)%`);
    /// with a `fallback`, each `/up/<class>` route is preceded by one that
    /// sends requests carrying its header (a soft limit's marker) to the
    /// `fallback` cluster on its port.
    pub fn start_with_upstreams(policy_yaml: &str, up: &Upstreams<'_>) -> Envoy {
        Envoy::start_with_upstreams_node(policy_yaml, up, &NodeSpec::default())
    }

    /// [`Envoy::start_with_upstreams`] as the node `node`.
    pub fn start_with_upstreams_node(policy_yaml: &str, up: &Upstreams<'_>, node: &NodeSpec) -> Envoy {
        let classes: Vec<String> = up.classes.iter().map(|c| (*c).to_owned()).collect();
        let access_log = up.access_log.map(|p| p.display().to_string());
        let fallback = up.fallback.map(|(h, p)| (h.to_owned(), p));
        let upstream_port = up.port;
        let cost_log = up.cost_log;
        Envoy::start_node_with(policy_yaml, node, move |bootstrap| {
            let anchor = "              routes:\n              # The class is trusted route metadata: clients cannot change it.\n";
            assert!(
                bootstrap.contains(anchor),
                "envoy/demo.yaml no longer has the routes anchor"
            );
            let routes: String = classes
                .iter()
                .map(|c| {
                    let marked = fallback.as_ref().map_or(String::new(), |(header, _)| format!(
                        "              - name: up-{c}-fallback\n                match: {{ prefix: /up/{c}, headers: [ {{ name: {header}, present_match: true }} ] }}\n                metadata: {{ filter_metadata: {{ tenantgate: {{ class: {c} }} }} }}\n                route: {{ cluster: fallback, timeout: 30s }}\n"
                    ));
                    format!(
                        "{marked}              - name: up-{c}\n                match: {{ prefix: /up/{c} }}\n                metadata: {{ filter_metadata: {{ tenantgate: {{ class: {c} }} }} }}\n                route: {{ cluster: upstream, timeout: 30s }}\n"
                    )
                })
                .collect();
            let mut b = bootstrap.replacen(anchor, &format!("{anchor}{routes}"), 1);
            // Connections alternate between the workers (tests that show a
            // limit holds node-wide need both workers to take part).
            let listener = "  - name: demo\n";
            assert!(
                b.contains(listener),
                "envoy/demo.yaml no longer names the demo listener"
            );
            b = b.replacen(
                listener,
                &format!("{listener}    connection_balance_config: {{ exact_balance: {{}} }}\n"),
                1,
            );
            // Loopback clients are internal (like a mesh hop): Envoy keeps
            // their `x-envoy-*` headers (`x-envoy-expected-rq-timeout-ms`).
            let remote = "          use_remote_address: true\n";
            assert!(
                b.contains(remote),
                "envoy/demo.yaml no longer sets use_remote_address"
            );
            b = b.replacen(
                remote,
                &format!("{remote}          internal_address_config: {{ cidr_ranges: [ {{ address_prefix: 127.0.0.1, prefix_len: 32 }} ] }}\n"),
                1,
            );
            if let Some(path) = access_log {
                // The demo's own access log (its format), to a file.
                let stdout = "          - name: envoy.access_loggers.stdout\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog\n";
                assert!(
                    b.contains(stdout),
                    "envoy/demo.yaml no longer has the demo listener's stdout access log"
                );
                b = b.replacen(
                    stdout,
                    &format!(
                        "          - name: envoy.access_loggers.file\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog\n              path: {path}\n"
                    ),
                    1,
                );
            }
            if cost_log {
                let format = "%FILTER_STATE(wasm.tenantgate_admission:PLAIN)%\\n";
                assert!(b.contains(format), "envoy/demo.yaml's access log format changed");
                b = b.replacen(
                    format,
                    "%FILTER_STATE(wasm.tenantgate_admission:PLAIN)% %FILTER_STATE(wasm.tenantgate_cost:PLAIN)%\\n",
                    1,
                );
            }
            if let Some((_, port)) = &fallback {
                b.push_str(&format!(
                    "  - name: fallback\n    type: STATIC\n    connect_timeout: 1s\n    load_assignment: {{ cluster_name: fallback, endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }} }} }} ] }} ] }}\n"
                ));
            }
            b.push_str(&format!(
                "  - name: upstream\n    type: STATIC\n    connect_timeout: 1s\n    circuit_breakers: {{ thresholds: [ {{ max_connections: 100000, max_pending_requests: 100000, max_requests: 100000 }} ] }}\n    load_assignment: {{ cluster_name: upstream, endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {upstream_port} }} }} }} }} ] }} ] }}\n"
            ));
            b
        })
    }
}
