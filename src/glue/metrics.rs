//! The filter's Envoy stats: a fixed, small set of counters with bounded
//! names (never one per tenant). Envoy shows them as
//! `wasmcustom.tenantgate.*` in `/stats` and `tenantgate_*` in
//! `/stats/prometheus`; every worker VM defining the same name shares one
//! counter.
//!
//! The per-request counters (decisions, CAS retries, identity, key table,
//! refunds, `sync.no_lease`) are counted in the worker's memory and **flushed on the root
//! tick** (every 10 ms) and when the VM shuts down, so a request costs no
//! stats hostcall: Envoy's counters lag the decisions by at most one tick.
//! The other counters are rare and go to Envoy at once.

use std::cell::Cell;

use proxy_wasm::types::MetricType;

use super::abi;

use crate::engine::{Decision, Reason, Subject, TableEvent};
use crate::sync::node::BreakerState;

/// Per-request counts not yet given to Envoy.
#[derive(Default)]
struct Pending {
    decisions: [Cell<u64>; Reason::ALL.len()],
    cas_retries: Cell<u64>,
    anonymous: Cell<u64>,
    invalid_identity: Cell<u64>,
    table_inserts: Cell<u64>,
    table_reclaims: Cell<u64>,
    table_overflows: Cell<u64>,
    refunds: Cell<u64>,
    sync_no_lease: Cell<u64>,
}

fn bump(c: &Cell<u64>, n: u64) {
    c.set(c.get().saturating_add(n));
}

pub struct Metrics {
    pending: Pending,
    /// Flushes of the pending counts (one per worker tick): tests wait on
    /// it to read settled counters.
    flushes: Option<u32>,
    decisions: [Option<u32>; Reason::ALL.len()],
    cas_retries: Option<u32>,
    anonymous: Option<u32>,
    invalid_identity: Option<u32>,
    config_loads: Option<u32>,
    config_rejections: Option<u32>,
    reply_failures: Option<u32>,
    table_inserts: Option<u32>,
    table_reclaims: Option<u32>,
    table_overflows: Option<u32>,
    refunds: Option<u32>,
    queue_held: Option<u32>,
    queue_admitted: Option<u32>,
    queue_rejected: Option<u32>,
    queue_full: Option<u32>,
    queue_cancelled: Option<u32>,
    sync_sent: Option<u32>,
    sync_ok: Option<u32>,
    sync_failed: Option<u32>,
    sync_timeouts: Option<u32>,
    sync_latency: Option<u32>,
    sync_breaker_opened: Option<u32>,
    /// Gauge: the node's sync breaker (0 closed, 1 open, 2 half-open).
    sync_breaker: Option<u32>,
    /// What this root last set `sync_breaker` to.
    sync_breaker_set: Cell<Option<u64>>,
    sync_skipped: Option<u32>,
    sync_no_lease: Option<u32>,
    sync_clamped: Option<u32>,
    sync_applied_in_steps: Option<u32>,
    sync_apply_dropped: Option<u32>,
    sync_apply_step: Option<u32>,
}

fn counter(name: &str) -> Option<u32> {
    match abi::define_metric(MetricType::Counter, name) {
        Ok(id) => Some(id),
        Err(status) => {
            log::warn!("tenantgate: cannot define metric {name}: {status:?}");
            None
        }
    }
}

fn gauge(name: &str) -> Option<u32> {
    match abi::define_metric(MetricType::Gauge, name) {
        Ok(id) => Some(id),
        Err(status) => {
            log::warn!("tenantgate: cannot define gauge {name}: {status:?}");
            None
        }
    }
}

fn histogram(name: &str) -> Option<u32> {
    match abi::define_metric(MetricType::Histogram, name) {
        Ok(id) => Some(id),
        Err(status) => {
            log::warn!("tenantgate: cannot define histogram {name}: {status:?}");
            None
        }
    }
}

fn add(id: Option<u32>, n: u32) {
    add_u64(id, u64::from(n));
}

fn add_u64(id: Option<u32>, n: u64) {
    if let (Some(id), true) = (id, n > 0) {
        // A failed stat update must never fail the request.
        let _ = abi::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// Gives a pending count to Envoy and clears it.
fn flush_one(id: Option<u32>, pending: &Cell<u64>) {
    add_u64(id, pending.take());
}

impl Metrics {
    pub fn define() -> Metrics {
        Metrics {
            pending: Pending::default(),
            flushes: counter("tenantgate.stats.flushes"),
            decisions: Reason::ALL.map(|r| counter(&format!("tenantgate.decisions.{}", r.as_str()))),
            cas_retries: counter("tenantgate.cas.retries"),
            anonymous: counter("tenantgate.identity.anonymous"),
            invalid_identity: counter("tenantgate.identity.invalid"),
            config_loads: counter("tenantgate.config.loads"),
            config_rejections: counter("tenantgate.config.rejections"),
            reply_failures: counter("tenantgate.reply_failures"),
            table_inserts: counter("tenantgate.key_table.inserts"),
            table_reclaims: counter("tenantgate.key_table.reclaims"),
            table_overflows: counter("tenantgate.key_table.overflows"),
            refunds: counter("tenantgate.guard.refunds"),
            queue_held: counter("tenantgate.queue.held"),
            queue_admitted: counter("tenantgate.queue.admitted"),
            queue_rejected: counter("tenantgate.queue.rejected"),
            queue_full: counter("tenantgate.queue.full"),
            queue_cancelled: counter("tenantgate.queue.cancelled"),
            sync_sent: counter("tenantgate.sync.sent"),
            sync_ok: counter("tenantgate.sync.ok"),
            sync_failed: counter("tenantgate.sync.failed"),
            sync_timeouts: counter("tenantgate.sync.timeouts"),
            sync_breaker_opened: counter("tenantgate.sync.breaker_opened"),
            sync_breaker: gauge("tenantgate.sync.breaker"),
            sync_breaker_set: Cell::new(None),
            sync_skipped: counter("tenantgate.sync.skipped"),
            sync_no_lease: counter("tenantgate.sync.no_lease"),
            sync_clamped: counter("tenantgate.sync.clamped"),
            sync_applied_in_steps: counter("tenantgate.sync.applied_in_steps"),
            sync_apply_dropped: counter("tenantgate.sync.apply_dropped"),
            sync_apply_step: histogram("tenantgate.sync.apply_step_us"),
            sync_latency: histogram("tenantgate.sync.latency_ms"),
        }
    }

    /// Counts a decision in the worker's memory (see the module header).
    pub fn record(&self, d: &Decision) {
        let p = &self.pending;
        if let Some(c) = Reason::ALL
            .iter()
            .position(|r| *r == d.reason)
            .and_then(|i| p.decisions.get(i))
        {
            bump(c, 1);
        }
        bump(&p.cas_retries, u64::from(d.cas_retries));
        match d.table {
            TableEvent::None => {}
            TableEvent::Inserted => bump(&p.table_inserts, 1),
            TableEvent::Reclaimed => bump(&p.table_reclaims, 1),
            TableEvent::Overflow => bump(&p.table_overflows, 1),
        }
        bump(&p.refunds, u64::from(d.refunded));
        bump(&p.sync_no_lease, u64::from(d.no_lease));
        if let Subject::Anonymous { invalid_identity, .. } = d.subject {
            bump(&p.anonymous, 1);
            bump(&p.invalid_identity, u64::from(invalid_identity));
        }
    }

    /// Gives the counts of [`Metrics::record`] to Envoy: on the tick and
    /// when the VM shuts down.
    pub fn flush(&self) {
        let p = &self.pending;
        for (id, c) in self.decisions.iter().zip(&p.decisions) {
            flush_one(*id, c);
        }
        flush_one(self.cas_retries, &p.cas_retries);
        flush_one(self.anonymous, &p.anonymous);
        flush_one(self.invalid_identity, &p.invalid_identity);
        flush_one(self.table_inserts, &p.table_inserts);
        flush_one(self.table_reclaims, &p.table_reclaims);
        flush_one(self.table_overflows, &p.table_overflows);
        flush_one(self.refunds, &p.refunds);
        flush_one(self.sync_no_lease, &p.sync_no_lease);
        add(self.flushes, 1);
    }

    pub fn config_loaded(&self) {
        add(self.config_loads, 1);
    }

    pub fn config_rejected(&self) {
        add(self.config_rejections, 1);
    }

    pub fn queue_held(&self) {
        add(self.queue_held, 1);
    }

    pub fn queue_answered(&self, admitted: bool) {
        add(
            if admitted {
                self.queue_admitted
            } else {
                self.queue_rejected
            },
            1,
        );
    }

    pub fn queue_full(&self) {
        add(self.queue_full, 1);
    }

    pub fn queue_cancelled(&self) {
        add(self.queue_cancelled, 1);
    }

    pub fn sync_sent(&self) {
        add(self.sync_sent, 1);
    }

    pub fn sync_ok(&self) {
        add(self.sync_ok, 1);
    }

    pub fn sync_failed(&self) {
        add(self.sync_failed, 1);
    }

    pub fn sync_timeout(&self) {
        add(self.sync_timeouts, 1);
    }

    pub fn sync_breaker_opened(&self) {
        add(self.sync_breaker_opened, 1);
    }

    /// The node's sync breaker as this worker last read it (set when it
    /// changes: every worker reads the same node-wide state).
    pub fn sync_breaker(&self, state: BreakerState) {
        let value = match state {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        };
        if self.sync_breaker_set.get() == Some(value) {
            return;
        }
        if let Some(id) = self.sync_breaker {
            if abi::record_metric(id, value).is_ok() {
                self.sync_breaker_set.set(Some(value));
            }
        }
    }

    pub fn sync_skipped(&self) {
        add(self.sync_skipped, 1);
    }

    /// Values of a sync answer clamped to what the policy allows.
    pub fn sync_clamped(&self, values: u32) {
        add(self.sync_clamped, values);
    }

    pub fn sync_latency_ms(&self, ms: u64) {
        if let Some(id) = self.sync_latency {
            let _ = abi::record_metric(id, ms);
        }
    }

    /// An answer whose application took more than one worker callback.
    pub fn sync_applied_in_steps(&self) {
        add(self.sync_applied_in_steps, 1);
    }

    /// An answer whose application was dropped before its end (its keys
    /// keep their counts).
    pub fn sync_apply_dropped(&self) {
        add(self.sync_apply_dropped, 1);
    }

    /// How long one step of an answer's application took.
    pub fn sync_apply_step_us(&self, us: u64) {
        if let Some(id) = self.sync_apply_step {
            let _ = abi::record_metric(id, us);
        }
    }

    pub fn reply_failed(&self) {
        add(self.reply_failures, 1);
    }
}
