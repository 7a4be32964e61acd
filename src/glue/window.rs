//! Stream-end signals on Envoy's streams (the core is
//! [`crate::admission::window`]), for dependencies with a signal window
//! ([`Dependency::signal_window_ns`]: a controller or a breaker).
//!
//! * A stream that took a slot of such a dependency carries a [`Signal`]
//!   (its dependency, the instant its slot was taken, the in-flight count).
//!   A rate-limit denial after the slot drops it (tenantgate's own reply
//!   says nothing about the upstream).
//! * Response headers: the instant and `:status` are noted.
//! * Stream end (`on_log` / `on_done`, once): the outcome is classified from
//!   `response.code_details` and the status ([`window::classify`]) and
//!   recorded in the worker's [`Windows`] (memory only).
//! * Root tick: per dependency with a window, the worker folds its samples
//!   into `tg2|w|<dep>`; the one worker that closes a window gets its
//!   [`window::WindowSummary`] and runs the breaker on it
//!   ([`super::breaker::on_window`]); every worker then reads the breaker
//!   into its copy.

use std::cell::RefCell;
use std::collections::HashMap;

use proxy_wasm::types::MapType;

use super::abi;
use crate::admission::window::{self, Outcome, Windows};
use crate::policy::admission::Dependency;
use crate::policy::Policy;

thread_local! {
    /// The worker's samples, by dependency name.
    static WINDOWS: RefCell<Windows> = RefCell::new(Windows::default());
    /// Signals of streams resumed from a queue, by context id.
    static RESUMED: RefCell<HashMap<u32, Signal>> = RefCell::new(HashMap::new());
}

/// What a stream's end will record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signal {
    dependency: String,
    window_ns: u64,
    /// When its slot was taken.
    taken_at: u64,
    /// The dependency's live slots with this one.
    in_flight: u32,
    /// When its response headers came, and their status.
    answered: Option<(u64, u32)>,
}

/// The signal of a stream that took a slot of `dep` at `now` (`None`: the
/// dependency has no signal window).
pub fn signal(dep: &Dependency, in_flight_before: u32, now: u64) -> Option<Signal> {
    let window_ns = dep.signal_window_ns()?;
    Some(Signal {
        dependency: dep.name.clone(),
        window_ns,
        taken_at: now,
        in_flight: in_flight_before.saturating_add(1),
        answered: None,
    })
}

/// Creates the window entries of a newly loaded policy.
pub fn configure(policy: &Policy, now: u64) {
    for d in &policy.dependencies {
        if let Some(window_ns) = d.signal_window_ns() {
            window::prepare(&super::ProxyHost, &d.name, window_ns, now);
        }
    }
}

/// A stream resumed from a queue: its end is a signal.
pub fn expect_resumed(context_id: u32, signal: Signal) {
    RESUMED.with(|r| {
        if let Ok(mut r) = r.try_borrow_mut() {
            r.insert(context_id, signal);
        }
    });
}

fn resumed(context_id: u32) -> Option<Signal> {
    RESUMED.with(|r| r.try_borrow_mut().ok()?.remove(&context_id))
}

/// Response headers: notes when and what the upstream (or Envoy) answered.
pub fn on_response_headers(signal: &mut Option<Signal>, context_id: u32, now: u64) {
    if signal.is_none() {
        *signal = resumed(context_id);
    }
    let Some(s) = signal.as_mut() else { return };
    let status = abi::header(MapType::HttpResponseHeaders, ":status")
        .ok()
        .flatten()
        .and_then(|v| std::str::from_utf8(&v).ok()?.parse::<u32>().ok());
    if let Some(status) = status {
        s.answered = Some((now, status));
    }
}

/// Stream end: records the outcome (once: the signal is taken).
pub fn on_stream_end(signal: Option<Signal>, context_id: u32, now: u64) {
    let Some(s) = signal.or_else(|| resumed(context_id)) else {
        return;
    };
    let details = abi::property(&["response", "code_details"]).ok().flatten();
    let details = details.as_deref().and_then(|d| std::str::from_utf8(d).ok());
    let kind = window::classify(details, s.answered.map(|(_, status)| status), false);
    let end = s.answered.map_or(now, |(at, _)| at);
    let outcome = Outcome {
        latency_ns: end.saturating_sub(s.taken_at),
        kind,
        in_flight: s.in_flight,
    };
    WINDOWS.with(|w| {
        if let Ok(mut w) = w.try_borrow_mut() {
            w.record(&s.dependency, s.window_ns, outcome, now);
        }
    });
}

/// The tick (see the module header).
pub fn tick(policy: &Policy, worker_id: u64, now: u64) {
    for dep in &policy.dependencies {
        let Some(window_ns) = dep.signal_window_ns() else {
            continue;
        };
        let ticked = WINDOWS.with(|w| {
            w.try_borrow_mut()
                .ok()
                .map(|mut w| w.tick(&super::ProxyHost, &dep.name, window_ns, now))
        });
        let closed = ticked.and_then(|t| t.closed);
        super::breaker::on_window(dep, closed.as_ref(), worker_id, now);
    }
}
