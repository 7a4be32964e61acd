//! The service's Prometheus metrics: a fixed set, no label per tenant or
//! node.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds of the sync latency histogram, in seconds.
const BUCKETS: [f64; 11] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// How a sync request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Stale,
    Invalid,
    NotReady,
    StoreError,
    Timeout,
    Forbidden,
    SeqJump,
    SessionsFull,
    Busy,
    Internal,
}

impl Outcome {
    pub const ALL: [Outcome; 11] = [
        Outcome::Ok,
        Outcome::Stale,
        Outcome::Invalid,
        Outcome::NotReady,
        Outcome::StoreError,
        Outcome::Timeout,
        Outcome::Forbidden,
        Outcome::SeqJump,
        Outcome::SessionsFull,
        Outcome::Busy,
        Outcome::Internal,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Stale => "stale",
            Outcome::Invalid => "invalid",
            Outcome::NotReady => "not_ready",
            Outcome::StoreError => "store_error",
            Outcome::Timeout => "timeout",
            Outcome::Forbidden => "forbidden",
            Outcome::SeqJump => "seq_jump",
            Outcome::SessionsFull => "sessions_full",
            Outcome::Busy => "busy",
            Outcome::Internal => "internal",
        }
    }
}

#[derive(Default)]
pub struct Metrics {
    requests: [AtomicU64; Outcome::ALL.len()],
    pub reports: AtomicU64,
    /// Report counts clamped to the plausible (`service::validate`).
    pub clamped: AtomicU64,
    /// New (key, limit)s refused at the key cap.
    pub keys_refused: AtomicU64,
    /// Records removed by the sweep after inactivity.
    pub expired_sessions: AtomicU64,
    pub expired_keys: AtomicU64,
    pub sweeps_failed: AtomicU64,
    pub leases: AtomicU64,
    pub unknown_limits: AtomicU64,
    pub policy_skew: AtomicU64,
    /// Requests by how their reported settings compare with the policy's.
    pub settings_same: AtomicU64,
    pub settings_differs: AtomicU64,
    pub settings_unreported: AtomicU64,
    pub store_errors_transient: AtomicU64,
    pub store_errors_permanent: AtomicU64,
    pub reloads_ok: AtomicU64,
    pub reloads_failed: AtomicU64,
    pub sweeps: AtomicU64,
    latency: [AtomicU64; BUCKETS.len()],
    latency_count: AtomicU64,
    latency_sum_ns: AtomicU64,
}

/// What /metrics shows beside the counters.
pub struct Gauges<'a> {
    pub keys: Option<u64>,
    pub sessions: Option<u64>,
    pub policy_version: Option<&'a str>,
    pub store: &'a str,
    pub store_up: bool,
}

impl Metrics {
    pub fn request(&self, outcome: Outcome, took: Duration) {
        let i = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0);
        self.requests[i].fetch_add(1, Relaxed);
        let secs = took.as_secs_f64();
        for (b, count) in BUCKETS.iter().zip(&self.latency) {
            if secs <= *b {
                count.fetch_add(1, Relaxed);
            }
        }
        self.latency_count.fetch_add(1, Relaxed);
        self.latency_sum_ns
            .fetch_add(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }

    pub fn requests(&self, outcome: Outcome) -> u64 {
        let i = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0);
        self.requests[i].load(Relaxed)
    }

    pub fn settings(&self, check: crate::alloc::SettingsCheck) {
        use crate::alloc::SettingsCheck;
        let counter = match check {
            SettingsCheck::Same => &self.settings_same,
            SettingsCheck::Differs => &self.settings_differs,
            SettingsCheck::Unreported => &self.settings_unreported,
        };
        counter.fetch_add(1, Relaxed);
    }

    pub fn store_error(&self, transient: bool) {
        if transient {
            self.store_errors_transient.fetch_add(1, Relaxed);
        } else {
            self.store_errors_permanent.fetch_add(1, Relaxed);
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self, g: &Gauges<'_>) -> String {
        let mut out = String::with_capacity(4096);
        self.render_counters(&mut out);
        self.render_latency(&mut out);
        render_gauges(&mut out, g);
        out
    }

    /// The counters, each family with its help and type lines.
    fn render_counters(&self, out: &mut String) {
        let mut counter = |name: &str, help: &str, rows: &[(&str, u64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (labels, v) in rows {
                let _ = writeln!(out, "{name}{labels} {v}");
            }
        };
        let by_outcome: Vec<(String, u64)> = Outcome::ALL
            .iter()
            .map(|o| (format!("{{result=\"{}\"}}", o.label()), self.requests(*o)))
            .collect();
        let rows: Vec<(&str, u64)> = by_outcome.iter().map(|(l, v)| (l.as_str(), *v)).collect();
        counter(
            "tenantgate_sync_requests_total",
            "Sync requests by result.",
            &rows,
        );
        counter(
            "tenantgate_sync_reports_total",
            "Key reports in applied sync requests.",
            &[("", self.reports.load(Relaxed))],
        );
        counter(
            "tenantgate_sync_leases_total",
            "Leases sent.",
            &[("", self.leases.load(Relaxed))],
        );
        counter(
            "tenantgate_sync_unknown_limits_total",
            "Reports naming a limit the service's policy does not have.",
            &[("", self.unknown_limits.load(Relaxed))],
        );
        counter(
            "tenantgate_policy_skew_total",
            "Sync requests whose policy_version differs from the service's.",
            &[("", self.policy_skew.load(Relaxed))],
        );
        counter(
            "tenantgate_sync_settings_total",
            "Sync requests by how the settings their node enforces compare with the policy's (the node's are used; unreported: the policy's are assumed).",
            &[
                ("{result=\"same\"}", self.settings_same.load(Relaxed)),
                ("{result=\"differs\"}", self.settings_differs.load(Relaxed)),
                ("{result=\"unreported\"}", self.settings_unreported.load(Relaxed)),
            ],
        );
        counter(
            "tenantgate_store_errors_total",
            "Store operations that failed, by whether a retry may succeed.",
            &[
                ("{transient=\"true\"}", self.store_errors_transient.load(Relaxed)),
                ("{transient=\"false\"}", self.store_errors_permanent.load(Relaxed)),
            ],
        );
        counter(
            "tenantgate_policy_reloads_total",
            "Policy file changes, by result (a refused policy keeps the old one).",
            &[
                ("{result=\"ok\"}", self.reloads_ok.load(Relaxed)),
                ("{result=\"error\"}", self.reloads_failed.load(Relaxed)),
            ],
        );
        counter(
            "tenantgate_sweeps_total",
            "Timer passes that brought every key to the current interval, by result.",
            &[
                ("{result=\"ok\"}", self.sweeps.load(Relaxed)),
                ("{result=\"error\"}", self.sweeps_failed.load(Relaxed)),
            ],
        );
        counter(
            "tenantgate_sync_clamped_total",
            "Report counts above what the limit and interval allow, clamped.",
            &[("", self.clamped.load(Relaxed))],
        );
        counter(
            "tenantgate_keys_refused_total",
            "New (key, limit)s refused because the service holds its maximum of keys.",
            &[("", self.keys_refused.load(Relaxed))],
        );
        counter(
            "tenantgate_expired_total",
            "Records removed after inactivity, by kind.",
            &[
                ("{record=\"session\"}", self.expired_sessions.load(Relaxed)),
                ("{record=\"key\"}", self.expired_keys.load(Relaxed)),
            ],
        );
    }

    /// The sync requests' latency histogram.
    fn render_latency(&self, out: &mut String) {
        let name = "tenantgate_sync_duration_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Time to answer a sync request.\n# TYPE {name} histogram"
        );
        for (b, count) in BUCKETS.iter().zip(&self.latency) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", count.load(Relaxed));
        }
        let n = self.latency_count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let sum = self.latency_sum_ns.load(Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {n}");
    }
}

/// The gauges read at this scrape.
fn render_gauges(out: &mut String, g: &Gauges<'_>) {
    let mut gauge = |name: &str, help: &str, labels: &str, v: u64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{labels} {v}"
        );
    };
    if let Some(keys) = g.keys {
        gauge("tenantgate_keys", "(key, limit) records in the store.", "", keys);
    }
    if let Some(sessions) = g.sessions {
        gauge("tenantgate_sessions", "Node sessions in the store.", "", sessions);
    }
    gauge(
        "tenantgate_store_up",
        "Whether the store answered this scrape.",
        &format!("{{store=\"{}\"}}", g.store),
        u64::from(g.store_up),
    );
    match g.policy_version {
        Some(v) => gauge(
            "tenantgate_policy_info",
            "The loaded policy's version.",
            &format!("{{version=\"{}\"}}", escape(v)),
            1,
        ),
        None => gauge("tenantgate_policy_info", "No policy loaded.", "{version=\"\"}", 0),
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}
