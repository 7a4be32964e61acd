//! Circuit breakers on Envoy's streams (the core is
//! [`crate::admission::breaker`]).
//!
//! * Response headers of a stream that holds a slot of a dependency with a
//!   breaker: its `:status` is one signal (5xx an error, 504 a timeout,
//!   anything else a success), added to the worker's tally in memory (no
//!   shared data). A stream without response headers (a client reset) and
//!   tenantgate's own refusals (they hold no slot) count for nothing.
//! * Root tick: per dependency with a breaker, the worker folds its tally
//!   into the node's breaker ([`breaker::fold`]: one read, and a
//!   compare-and-swap only when something changed), keeps the result as its
//!   [`Control`] copy for the next tick's requests, counts the transitions
//!   its fold made and sets the gauges.
//!
//! This is the breaker's own, minimal input path; `WindowSummary`s of
//! `admission::window` can replace the tally (the fold takes an
//! [`Observed`]).
//!
//! Stats per dependency with a breaker: gauges
//! `tenantgate.admission.breaker_state.<dep>` ([`Phase`] as a number) and
//! `tenantgate.admission.breaker_ramp_permille.<dep>`; counters
//! `tenantgate.admission.breaker_{opened,half_opened,ramping,closed}.<dep>`
//! (each transition once per node: by the worker whose write made it) and
//! `tenantgate.admission.breaker_probes.<dep>`.

use std::cell::RefCell;
use std::collections::HashMap;

use proxy_wasm::types::{MapType, MetricType};

use super::abi;
use crate::admission::breaker::{self, Observed, Phase, Transition};
use crate::admission::Control;
use crate::policy::admission::Dependency;
use crate::policy::Policy;
use crate::table;

thread_local! {
    /// Each dependency's control copy (by dependency key), read on the tick.
    static CONTROLS: RefCell<HashMap<String, Control>> = RefCell::new(HashMap::new());
    /// What this worker's streams saw since its last fold (by breaker key).
    static TALLY: RefCell<HashMap<String, Observed>> = RefCell::new(HashMap::new());
    /// Breaker keys of streams resumed from a queue (by context id), for
    /// their response.
    static RESUMED: RefCell<HashMap<u32, String>> = RefCell::new(HashMap::new());
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

/// This worker's copy of a dependency's control state.
pub fn control(dep: &Dependency) -> Control {
    if dep.breaker.is_none() {
        return Control::default();
    }
    CONTROLS.with(|c| {
        c.try_borrow()
            .ok()
            .and_then(|c| c.get(&dep.key).copied())
            .unwrap_or_default()
    })
}

/// Keeps a request's refreshed copy (a probe ticket reads the node's state).
pub fn keep(dep: &Dependency, control: Control) {
    if dep.breaker.is_none() {
        return;
    }
    CONTROLS.with(|c| {
        if let Ok(mut c) = c.try_borrow_mut() {
            c.insert(dep.key.clone(), control);
        }
    });
}

/// The breaker's phase for the decision record (`None`: no breaker).
pub fn phase_name(dep: Option<&Dependency>, now: u64) -> Option<&'static str> {
    let dep = dep?;
    let settings = dep.breaker.as_ref()?;
    let phase = control(dep)
        .breaker
        .map_or(Phase::Closed, |b| b.phase_at(settings, now));
    Some(phase.as_str())
}

/// Counts an admitted probe (`before`: the gate the request met).
pub fn admitted(dep: &Dependency, before: &breaker::Gate, half_opened: bool) {
    if !matches!(before, breaker::Gate::Probe { .. }) && !half_opened {
        return;
    }
    STATS.with(|s| {
        let Ok(stats) = s.try_borrow() else { return };
        let Some(st) = stats.get(&dep.key) else { return };
        if let (Some(id), breaker::Gate::Probe { .. }) = (st.probes, before) {
            let _ = abi::increment_metric(id, 1);
        }
        if half_opened {
            st.count(Transition {
                from: Phase::Open,
                to: Phase::HalfOpen,
            });
        }
    });
}

/// The breaker key a stream's response is a signal for (`None`: no breaker).
pub fn signal_key(dep: &Dependency) -> Option<String> {
    dep.breaker.is_some().then(|| dep.breaker_key.clone())
}

/// A stream resumed from a queue: its response is a signal.
pub fn expect_resumed(context_id: u32, key: String) {
    RESUMED.with(|r| {
        if let Ok(mut r) = r.try_borrow_mut() {
            r.insert(context_id, key);
        }
    });
}

/// A stream ended: forget a resumed stream's pending signal.
pub fn forget(context_id: u32) {
    RESUMED.with(|r| {
        if let Ok(mut r) = r.try_borrow_mut() {
            r.remove(&context_id);
        }
    });
}

/// Response headers: one signal for the stream's breaker, if it has one.
pub fn on_response_headers(signal: Option<String>, context_id: u32) {
    let key = signal.or_else(|| RESUMED.with(|r| r.try_borrow_mut().ok()?.remove(&context_id)));
    let Some(key) = key else { return };
    let status = abi::header(MapType::HttpResponseHeaders, ":status")
        .ok()
        .flatten()
        .and_then(|v| std::str::from_utf8(&v).ok()?.parse::<u16>().ok());
    let Some(status) = status else { return };
    let failed = (500..600).contains(&status);
    TALLY.with(|t| {
        if let Ok(mut t) = t.try_borrow_mut() {
            t.entry(key).or_default().add(Observed {
                completed: 1,
                failures: u64::from(failed),
            });
        }
    });
}

/// The tick (see the module header).
pub fn tick(policy: &Policy, worker_id: u64, now: u64) {
    for dep in policy.dependencies.iter() {
        let Some(settings) = dep.breaker.as_ref() else {
            continue;
        };
        let seen = TALLY
            .with(|t| t.try_borrow_mut().ok()?.remove(&dep.breaker_key))
            .unwrap_or_default();
        let folded = BUFFERS.with(|b| {
            let mut buffers = b.try_borrow_mut().ok()?;
            let seed = worker_id ^ now.rotate_left(17);
            Some(breaker::fold(
                &super::ProxyHost,
                &dep.breaker_key,
                settings,
                seen,
                now,
                seed,
                &mut buffers,
            ))
        });
        let current = match folded {
            Some(Ok(f)) => {
                STATS.with(|s| {
                    if let Some(st) = s.try_borrow().ok().as_ref().and_then(|s| s.get(&dep.key)) {
                        for t in f.transitions.iter() {
                            st.count(t);
                        }
                    }
                });
                Some(f.breaker)
            }
            _ => {
                // Kept for the next tick; the copy from a plain read.
                if !seen.is_empty() {
                    TALLY.with(|t| {
                        if let Ok(mut t) = t.try_borrow_mut() {
                            t.entry(dep.breaker_key.clone()).or_default().add(seen);
                        }
                    });
                }
                breaker::read(&super::ProxyHost, &dep.breaker_key, now)
            }
        };
        let Some(current) = current else { continue };
        let control = Control {
            breaker: Some(current),
        };
        keep(dep, control);
        let gate = current.gate(settings, now);
        STATS.with(|s| {
            let Ok(stats) = s.try_borrow() else { return };
            let Some(st) = stats.get(&dep.key) else { return };
            if let Some(id) = st.state {
                let _ = abi::record_metric(id, current.phase_at(settings, now) as u64);
            }
            if let Some(id) = st.ramp {
                let _ = abi::record_metric(id, u64::from(gate.permille()));
            }
        });
    }
}
