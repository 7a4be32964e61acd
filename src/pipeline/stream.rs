//! A stream after its decision: its response and its end.
//!
//! * **Signals.** A stream that took a slot of a dependency with a signal
//!   window (an adaptive controller's or a breaker's) carries a [`Signal`]
//!   (memory only). Its response headers stamp the time and the status;
//!   at its end, for a 5xx or no response at all, Envoy's
//!   `response.code_details` is read (one property) to tell the upstream's
//!   failures from the rest, and the [`Outcome`] goes into the worker's
//!   [`crate::admission::window::Windows`]. A stream tenantgate answers
//!   itself has no signal: its end says nothing about the upstream.
//! * **Degraded capture.** An admitted GET of a degradable class whose key
//!   this worker has not stored within `refresh` is captured as it passes:
//!   a 200's kept headers, then its body chunk by chunk (nothing buffered
//!   or delayed), stored at its end; anything but a 200, `no-store`, or a
//!   body or headers over their bounds ends the capture.
//! * **The end**, however it comes (complete, reset by either side, local
//!   reply, client gone; the host calls [`Pipeline::on_stream_end`] once or
//!   more, the first call counts): out of the hold, a settling class's cost
//!   settled if its response never completed (see [`super::settle`]), the
//!   signal recorded, the slots given back exactly once (the [`Ticket`] is
//!   moved out).

use std::rc::Rc;

use super::settle::{self, ResponseBody};
use super::{Clock, Pipeline, StreamId, MAX_REMEMBERED_STORES};
use crate::admission::degraded::{self, Cached};
use crate::admission::request::BodyBudget;
use crate::admission::window::{self, Outcome};
use crate::admission::Ticket;
use crate::decision::{Decision, RateLimitHeaders, Reason};
use crate::engine::Prepared;
use crate::host::Host;
use crate::policy::admission::Criticality;
use crate::policy::{Policy, RouteClass};
use crate::stats::Metric;
use crate::stats::{DegradedStat, NamedCounter};

/// What the pipeline keeps of a stream between its callbacks.
#[derive(Debug, Default)]
pub(super) struct Stream {
    /// The slots it holds.
    pub ticket: Option<Ticket>,
    /// Its body's count against `max_body_bytes` (no `content-length`).
    pub body: Option<BodyBudget>,
    pub level: Criticality,
    pub signal: Option<Signal>,
    pub capture: Option<Capture>,
    /// The `RateLimit` headers for its response.
    pub headers: Option<RateLimitHeaders>,
    /// In the hold.
    pub held: bool,
    /// A class whose cost settles after the response: what to settle.
    pub settling: Option<Box<super::settle::Settling>>,
    /// Over a soft limit: `(soft_limit_header, the limit's name)`, the
    /// response's marker.
    pub soft: Option<(String, String)>,
    /// A settling class's input estimate, added to a body field's value.
    pub input_estimate: u64,
}

impl Stream {
    pub fn is_empty(&self) -> bool {
        self.ticket.is_none()
            && self.body.is_none()
            && self.signal.is_none()
            && self.capture.is_none()
            && self.headers.is_none()
            && !self.held
            && self.settling.is_none()
            && self.soft.is_none()
    }
}

/// What a stream of a dependency with a signal window records at its end.
#[derive(Debug, Clone)]
pub(super) struct Signal {
    /// The dependency's name and window length.
    dependency: String,
    window_ns: u64,
    /// When its slot was taken (headers, or the hold's admission).
    admitted_at: u64,
    /// Its dependency's live slots then, itself included.
    in_flight: u32,
    /// When its response headers came, and their status.
    response_at: Option<u64>,
    status: Option<u32>,
}

impl Signal {
    /// A stream's signal, if its class's dependency has a signal window.
    pub fn start(policy: &Policy, prepared: &Prepared, ticket: &Ticket, now: u64) -> Option<Signal> {
        let dep = prepared
            .class
            .labels
            .dependency
            .and_then(|i| policy.dependency(i))?;
        let window_ns = dep.signal_window_ns()?;
        ticket.dependency_key()?;
        Some(Signal {
            dependency: dep.name.clone(),
            window_ns,
            admitted_at: now,
            in_flight: ticket.in_flight().saturating_add(1),
            response_at: None,
            status: None,
        })
    }
}

/// A response being captured for its class's degraded-answer cache.
#[derive(Debug)]
pub(super) struct Capture {
    class: Rc<RouteClass>,
    slot: String,
    key: Vec<u8>,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    captured_at: u64,
}

/// The `:status` of a response header, parsed.
fn status_of(raw: Option<Vec<u8>>) -> Option<u32> {
    std::str::from_utf8(&raw?).ok()?.parse().ok()
}

/// What the host does on a stream's response headers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseHeaders {
    /// The `RateLimit` headers of its decision.
    pub ratelimit: Option<RateLimitHeaders>,
    /// A soft-limited request's marker: `(soft_limit_header, limit)`.
    pub soft: Option<(String, String)>,
    /// A settled stream's cost record (see [`super::settle::COST_PROPERTY`]).
    pub cost_record: Option<String>,
    /// The pipeline keeps nothing of the stream any more: its response
    /// body, trailers and end would find nothing, so a host may skip those
    /// calls (the native module does: three fewer steps a request).
    pub finished: bool,
}

impl Pipeline {
    /// The response's headers: stamps the stream's signal, starts or ends
    /// its capture, feeds a settling class's meter (settled if the headers
    /// end the response), and returns what to add to the response (the
    /// `RateLimit` headers of its decision, a soft limit's marker) and a
    /// cost record.
    pub fn on_response_headers<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        stream: StreamId,
        end_of_stream: bool,
    ) -> ResponseHeaders {
        let cost_record = self.meter(
            host,
            stream,
            || clock.now().unwrap_or(0),
            |m, s| m.on_headers(s, host, end_of_stream),
        );
        let Some(mut state) = self.streams.remove(&stream) else {
            return ResponseHeaders {
                cost_record,
                finished: true,
                ..ResponseHeaders::default()
            };
        };
        if state.signal.is_some() || state.capture.is_some() {
            let now = clock.now();
            if let Some(sig) = state.signal.as_mut() {
                sig.response_at = now;
                sig.status = status_of(host.response_header(":status"));
            }
            if let Some(c) = state.capture.take() {
                state.capture = self.capture_headers(host, c, end_of_stream, now.unwrap_or(0));
            }
        }
        let ratelimit = state.headers.take();
        let soft = state.soft.take();
        self.keep(stream, &mut state);
        ResponseHeaders {
            ratelimit,
            soft,
            cost_record,
            finished: !self.streams.contains_key(&stream),
        }
    }

    /// A chunk of the response's body (`size` bytes, read as it passes):
    /// at its end a captured answer is stored, and a settling class's cost
    /// settled (its record returned); a settling answer metered as it flows
    /// may end in it ([`ResponseBody::end`]).
    pub fn on_response_body<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        stream: StreamId,
        size: usize,
        end_of_stream: bool,
    ) -> ResponseBody {
        let record = self.meter_body(host, clock, stream, size, end_of_stream);
        let capture = self.streams.get_mut(&stream).and_then(|s| s.capture.take());
        if let Some(capture) = capture {
            let kept = self.capture_body(host, capture, size, end_of_stream);
            if let Some(s) = self.streams.get_mut(&stream) {
                s.capture = kept;
            }
        }
        record
    }

    /// The response's trailers: its body has ended (a cost from a trailer
    /// is read, and settled: its record returned).
    pub fn on_response_trailers<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        stream: StreamId,
    ) -> Option<String> {
        let record = self.meter(
            host,
            stream,
            || clock.now().unwrap_or(0),
            |m, s| m.on_trailers(s, host),
        );
        let capture = self.streams.get_mut(&stream).and_then(|s| s.capture.take());
        if let Some(capture) = capture {
            let kept = self.capture_body(host, capture, 0, true);
            if let Some(s) = self.streams.get_mut(&stream) {
                s.capture = kept;
            }
        }
        record
    }

    /// The stream ended, however it ended (see the module header). The
    /// host may call it more than once (Envoy's `on_log` and `on_done`):
    /// only the first call finds anything. Returns the cost record of a
    /// settling class's stream settled here.
    pub fn on_stream_end<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        stream: StreamId,
    ) -> Option<String> {
        let mut state = self.streams.remove(&stream)?;
        if state.held && self.hold.remove(stream) == Some(true) {
            self.pending.rare(Metric::QueueCancelled);
        }
        let needs_time = state.signal.is_some() || state.ticket.is_some() || state.settling.is_some();
        let now = if needs_time { clock.now().unwrap_or(0) } else { 0 };
        let record = state.settling.take().map(|s| self.settle_at_end(host, s, now));
        if let Some(sig) = state.signal.take() {
            self.end_signal(host, sig, now);
        }
        if let Some(ticket) = state.ticket.take() {
            self.release(host, ticket, now);
        }
        record
    }

    /// Records a signal's outcome in the worker's windows.
    fn end_signal<H: Host>(&mut self, host: &H, sig: Signal, now: u64) {
        // Below 500 an answer is a success whoever sent it (tenantgate's own
        // replies have no signal): Envoy's details are read only for a 5xx
        // or a stream that ended without response headers, to tell the
        // upstream's failures from the rest (one property read fewer per
        // request).
        let details = match sig.status {
            Some(status) if status < 500 => None,
            _ => host.property(&["response", "code_details"]),
        };
        let details = details.as_deref().and_then(|d| std::str::from_utf8(d).ok());
        let outcome = Outcome {
            latency_ns: sig.response_at.unwrap_or(now).saturating_sub(sig.admitted_at),
            kind: window::classify(details, sig.status, false),
            in_flight: sig.in_flight,
        };
        self.windows.record(&sig.dependency, sig.window_ns, outcome, now);
    }

    /// Gives a stream's slots back.
    /// An admitted request: what its response is to carry or settle (a
    /// soft-limited one's marker, a settling class's charge).
    pub(super) fn start_settling(
        &mut self,
        policy: &Rc<Policy>,
        prepared: &Prepared,
        decision: &Decision,
        now: u64,
        state: &mut Stream,
    ) {
        if let Some(marker) = settle::soft_marker(policy, decision) {
            state.soft = Some(marker);
        }
        if let Some(settling) = self.settling_for(policy, prepared, decision, now, state.input_estimate) {
            state.settling = Some(settling);
        }
    }

    pub(super) fn release<H: Host>(&mut self, host: &H, ticket: Ticket, now: u64) {
        match self.worker.as_mut() {
            Some(w) => w.release(host, ticket, now),
            // Unreachable: a ticket exists only if the worker does.
            None => log::error!("tenantgate: an admission slot could not be released"),
        }
    }

    /// Gives back everything a request took that never reached its
    /// dependency: its slots and its probe ticket (see
    /// [`crate::admission::Worker::cancel`]).
    pub(super) fn cancel<H: Host>(&mut self, host: &H, ticket: Ticket, now: u64) {
        match self.worker.as_mut() {
            Some(w) => w.cancel(host, ticket, now),
            None => log::error!("tenantgate: an admission slot could not be released"),
        }
    }

    /// A request goes on to its dependency holding a probe ticket: one
    /// half-open probe (`breaker_probes.<dependency>`).
    pub(super) fn count_probe(&mut self, policy: &Policy, prepared: &Prepared, ticket: Option<&Ticket>) {
        if ticket.and_then(Ticket::probe).is_none() {
            return;
        }
        if let Some(dep) = prepared
            .class
            .labels
            .dependency
            .and_then(|i| policy.dependency(i))
        {
            self.pending.named(NamedCounter::BreakerProbes, &dep.name);
        }
    }

    /// A request refused for its adaptive dependency's limit: demand the
    /// controller counts (memory only).
    pub(super) fn note_refused(&mut self, policy: &Policy, prepared: &Prepared, reason: Reason, now: u64) {
        if !matches!(
            reason,
            Reason::ConcurrencyLimit | Reason::QueueFull | Reason::QueueTimeout
        ) {
            return;
        }
        let Some(dep) = prepared
            .class
            .labels
            .dependency
            .and_then(|i| policy.dependency(i))
        else {
            return;
        };
        if let Some(a) = dep.adaptive {
            self.windows.note_refused(&dep.name, a.window_ns, now);
        }
    }

    /// An admitted GET of a degradable class: its response is captured
    /// unless this worker stored its key within `refresh`.
    pub(super) fn plan_capture(&self, prepared: &Prepared, read: &super::Read, now: u64) -> Option<Capture> {
        let deg = prepared.class.degradable.as_ref()?;
        if read.method != b"GET" {
            return None;
        }
        let key = degraded::cache_key(deg, &prepared.subject, &read.path)?;
        let slot = degraded::slot_key(deg, &key);
        let hash = crate::table::fnv1a64(&key);
        let recent = self
            .stored
            .get(&slot)
            .is_some_and(|(h, at)| *h == hash && now.saturating_sub(*at) < deg.refresh_ns);
        (!recent).then(|| Capture {
            class: prepared.class.clone(),
            slot,
            key,
            headers: Vec::new(),
            body: Vec::new(),
            captured_at: now,
        })
    }

    /// A capture's response headers: a 200 is kept on with its kept
    /// headers; anything else ends it. `None`: the capture ended.
    fn capture_headers<H: Host>(
        &mut self,
        host: &H,
        mut c: Capture,
        end_of_stream: bool,
        now: u64,
    ) -> Option<Capture> {
        let class = c.class.clone();
        let deg = class.degradable.as_ref()?;
        let header = |name: &str| host.response_header(name);
        if header(":status").as_deref() != Some(b"200") {
            return None;
        }
        // The upstream says its answer must not be stored.
        if header("cache-control")
            .is_some_and(|v| v.to_ascii_lowercase().windows(8).any(|w| w == b"no-store"))
        {
            return None;
        }
        let declared =
            header("content-length").and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > u64::from(deg.max_body_bytes)) {
            self.pending.degraded(DegradedStat::TooLarge);
            return None;
        }
        let mut size = 0usize;
        for name in degraded::kept_headers(deg) {
            if let Some(value) = header(name).and_then(|v| String::from_utf8(v).ok()) {
                size = size.saturating_add(name.len()).saturating_add(value.len());
                c.headers.push((name.to_owned(), value));
            }
        }
        if size > degraded::MAX_KEPT_HEADERS_BYTES {
            self.pending.degraded(DegradedStat::TooLarge);
            return None;
        }
        c.captured_at = now;
        if end_of_stream {
            self.store(host, c);
            return None;
        }
        Some(c)
    }

    /// A chunk of a captured body. `None`: the capture ended.
    fn capture_body<H: Host>(
        &mut self,
        host: &H,
        mut c: Capture,
        size: usize,
        end_of_stream: bool,
    ) -> Option<Capture> {
        let max = c
            .class
            .degradable
            .as_ref()
            .map_or(0, |d| d.max_body_bytes as usize);
        if size > 0 {
            if c.body.len().saturating_add(size) > max {
                self.pending.degraded(DegradedStat::TooLarge);
                return None;
            }
            c.body.extend_from_slice(&host.response_body(size)?);
            if c.body.len() > max {
                self.pending.degraded(DegradedStat::TooLarge);
                return None;
            }
        }
        if end_of_stream {
            self.store(host, c);
            return None;
        }
        Some(c)
    }

    /// Stores a captured answer in its class's cache.
    fn store<H: Host>(&mut self, host: &H, c: Capture) {
        let Some(deg) = c.class.degradable.as_ref() else {
            return;
        };
        let answer = Cached {
            key: c.key,
            captured_at: c.captured_at,
            headers: c.headers,
            body: c.body,
        };
        match degraded::store(host, deg, &answer, &mut self.cache_buffers) {
            Ok(s) => {
                self.pending.degraded(DegradedStat::Stores);
                if s.evicted {
                    self.pending.degraded(DegradedStat::Evictions);
                }
                if self.stored.len() >= MAX_REMEMBERED_STORES {
                    self.stored.clear();
                }
                let hash = crate::table::fnv1a64(&answer.key);
                self.stored.insert(c.slot, (hash, answer.captured_at));
            }
            Err(degraded::NotStored::TooLarge) => self.pending.degraded(DegradedStat::TooLarge),
            Err(degraded::NotStored::Failed) => {}
        }
    }

    /// Counts a retry its budget admitted.
    pub(super) fn count_retry(&mut self, dependency: &str) {
        self.pending.named(NamedCounter::Retries, dependency);
    }
}
