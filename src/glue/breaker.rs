//! Circuit breakers on Envoy's streams (the core is
//! [`crate::admission::breaker`]; its input is the stream-end signal
//! windows of [`super::window`]).
//!
//! * The worker that closes a dependency's signal window runs the breaker
//!   on the window's summary ([`breaker::fold`]: completed, errors +
//!   timeouts), in the compare-and-swap that writes `tg2|b|<dep>`, and
//!   counts the transitions it made; every other worker reads the entry on
//!   its tick (one read). Each keeps the result in its worker's
//!   [`crate::admission::Control`] for its requests until its next tick
//!   (10 ms).
//! * A request's check reads that copy (no hostcall), except a half-open
//!   probe's ticket, which refreshes it.
//!
//! Stats per dependency with a breaker: gauges
//! `tenantgate.admission.breaker_state.<dep>` ([`Phase`] as a number) and
//! `tenantgate.admission.breaker_ramp_permille.<dep>`; counters
//! `tenantgate.admission.breaker_{opened,half_opened,ramping,closed}.<dep>`
//! (each transition once per node: by the worker whose write made it) and
//! `tenantgate.admission.breaker_probes.<dep>`.

use std::cell::RefCell;
use std::collections::HashMap;

use proxy_wasm::types::MetricType;

use super::abi;
use crate::admission::breaker::{self, Observed, Phase, Transition};
use crate::admission::window::WindowSummary;
use crate::policy::admission::Dependency;
use crate::policy::Policy;
use crate::table;

thread_local! {
    /// Stats ids by dependency key.
    static STATS: RefCell<HashMap<String, Stats>> = RefCell::new(HashMap::new());
    static BUFFERS: RefCell<table::Buffers> = RefCell::new(table::Buffers::default());
}

struct Stats {
    state: Option<u32>,
    ramp: Option<u32>,
    opened: Option<u32>,
    half_opened: Option<u32>,
    ramping: Option<u32>,
    closed: Option<u32>,
    probes: Option<u32>,
}

impl Stats {
    fn define(name: &str) -> Stats {
        let metric =
            |t, what: &str| abi::define_metric(t, &format!("tenantgate.admission.{what}.{name}")).ok();
        Stats {
            state: metric(MetricType::Gauge, "breaker_state"),
            ramp: metric(MetricType::Gauge, "breaker_ramp_permille"),
            opened: metric(MetricType::Counter, "breaker_opened"),
            half_opened: metric(MetricType::Counter, "breaker_half_opened"),
            ramping: metric(MetricType::Counter, "breaker_ramping"),
            closed: metric(MetricType::Counter, "breaker_closed"),
            probes: metric(MetricType::Counter, "breaker_probes"),
        }
    }

    fn count(&self, t: Transition) {
        let id = match t.to {
            Phase::Open => self.opened,
            Phase::HalfOpen => self.half_opened,
            Phase::Ramping => self.ramping,
            Phase::Closed => self.closed,
        };
        if let Some(id) = id {
            let _ = abi::increment_metric(id, 1);
        }
    }
}

/// Defines the stats of a newly loaded policy's breakers.
pub fn configure(policy: &Policy) {
    STATS.with(|s| {
        let Ok(mut stats) = s.try_borrow_mut() else { return };
        for d in policy.dependencies.iter().filter(|d| d.breaker.is_some()) {
            stats
                .entry(d.key.clone())
                .or_insert_with(|| Stats::define(&d.name));
        }
    });
}

/// The breaker's phase for the decision record (`None`: no breaker).
pub fn phase_name(dep: Option<&Dependency>, now: u64) -> Option<&'static str> {
    let dep = dep?;
    let settings = dep.breaker.as_ref()?;
    let copy = super::admission::with_worker(|w| w.control(&dep.key).breaker).flatten();
    let phase = copy.map_or(Phase::Closed, |b| b.phase_at(settings, now));
    Some(phase.as_str())
}

/// After a dependency's window tick: the worker that closed a window runs
/// the breaker on its summary (and writes `tg2|b|<dep>`); every worker
/// then holds the node's breaker as its copy and sets the gauges.
pub fn on_window(dep: &Dependency, closed: Option<&WindowSummary>, worker_id: u64, now: u64) {
    let Some(settings) = dep.breaker.as_ref() else {
        return;
    };
    let folded = closed.and_then(|summary| {
        let seen = Observed {
            completed: u64::from(summary.completed),
            failures: u64::from(summary.errors).saturating_add(u64::from(summary.timeouts)),
        };
        let seed = worker_id ^ now.rotate_left(17);
        BUFFERS.with(|b| {
            let mut buffers = b.try_borrow_mut().ok()?;
            breaker::fold(
                &super::ProxyHost,
                &dep.breaker_key,
                settings,
                seen,
                now,
                seed,
                &mut buffers,
            )
            .ok()
        })
    });
    let current = match folded {
        Some(f) => {
            STATS.with(|s| {
                if let Some(st) = s.try_borrow().ok().as_ref().and_then(|s| s.get(&dep.key)) {
                    for t in f.transitions.iter() {
                        st.count(t);
                    }
                }
            });
            Some(f.breaker)
        }
        // Not the closer, or its fold failed (the window's counts are
        // then lost to the breaker: it errs toward staying as it is).
        None => breaker::read(&super::ProxyHost, &dep.breaker_key, now),
    };
    let probes = super::admission::with_worker(|w| w.take_probe_events(&dep.key)).unwrap_or_default();
    let Some(current) = current else { return };
    super::admission::with_worker(|w| w.update_control(&dep.key, |c| c.breaker = Some(current)));
    let gate = current.gate(settings, now);
    STATS.with(|s| {
        let Ok(stats) = s.try_borrow() else { return };
        let Some(st) = stats.get(&dep.key) else { return };
        if let (Some(id), true) = (st.probes, probes.probes > 0) {
            let _ = abi::increment_metric(id, i64::try_from(probes.probes).unwrap_or(i64::MAX));
        }
        for _ in 0..probes.half_opened.min(16) {
            st.count(Transition {
                from: Phase::Open,
                to: Phase::HalfOpen,
            });
        }
        if let Some(id) = st.state {
            let _ = abi::record_metric(id, current.phase_at(settings, now) as u64);
        }
        if let Some(id) = st.ramp {
            let _ = abi::record_metric(id, u64::from(gate.permille()));
        }
    });
}
