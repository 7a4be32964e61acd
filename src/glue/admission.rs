//! Admission control on Envoy's streams (the core is [`crate::admission`]).
//!
//! * Request headers: the class's request checks, then a slot of its
//!   action's limit and of its dependency ([`Admission::on_request_headers`]); the rate limits are
//!   charged after, and a rate-limit denial gives the slot back at once.
//! * Request body: a body without `content-length` is counted chunk by
//!   chunk against `max_body_bytes`.
//! * Stream end: the slot is released from `on_log` or `on_done`,
//!   whichever comes first (both come for every end: complete, reset by
//!   either side, local reply, client gone); the [`Ticket`] is taken out
//!   of the stream's context, so it is released once.
//! * A `concurrency_limit` refusal at a level with a queue pauses the
//!   request in the worker's [`PriorityQueue`] of its dependency
//!   ([`crate::admission::queue`]); the tick serves it: a request that gets
//!   its slot is charged its rate limits and resumed (its ticket kept by
//!   context id until its stream ends), one whose `max_wait` would pass is
//!   answered 503 `queue_timeout`; a stream that ends while held leaves the
//!   queue.
//! * A dependency's retry budget ([`crate::admission::retry`]): a request
//!   marked as a retry by a trusted signal takes its place in the budget
//!   before its slot (503 `retry_budget` when there is none); an admitted
//!   primary is counted in the worker's memory.
//! * A degradable class ([`crate::admission::degraded`]): a GET/HEAD
//!   refused for a shedding reason (here or from a queue) is answered from
//!   the cache, or 503 `dependency_unavailable`; an admitted GET's 200
//!   response is captured as it passes (headers, then body chunks) and
//!   stored at its end, at most once per `refresh` per key and worker.
//! * Root tick: the worker renews its leases and publishes what a failed
//!   write left dirty, and folds its counted primaries into their budgets;
//!   every 10th tick the in-flight and retry-amplification gauges are set
//!   from shared data (node-wide: every worker sets the same value).
//! * Adaptive dependencies ([`crate::admission::controller`]): a stream
//!   that took a slot of one gets a [`Signal`] (memory only); its response
//!   headers stamp the time and status (one clock read, one header read);
//!   at its end, for a 5xx or no response at all, `response.code_details`
//!   is read (one property) and the [`Outcome`] goes into the worker's
//!   [`Windows`]. The tick runs
//!   [`controller::tick`] (fold, close, apply, read the limit into the
//!   worker's `Control`) and sets the controller's gauges.
//!
//! Stats: `tenantgate.admission.<outcome>.<criticality>` counters
//! (outcomes: `admitted` and every refusal reason), counted in memory and
//! flushed on the tick; the gauges `tenantgate.admission.in_flight.<dependency>`
//! and `tenantgate.admission.action_in_flight.<action>` (an action's
//! `actions.<action>.max_in_flight` slots);
//! per dependency, set on every tick:
//! * `queue_depth.<dependency>`: requests held, **node-wide**: each worker
//!   adds the change of its own queue's length to the one shared gauge;
//! * `queue_oldest_ms.<dependency>`: the oldest held request's age, the
//!   **largest any worker reported** in its last tick: a worker sets it
//!   when its own age is at least the gauge's value, or when the value is
//!   the one it set last (so it can lower it), so the value is at most one
//!   tick (10 ms) stale;
//! * `retries.<dependency>` counter (retries its budget admitted) and
//!   `retry_amplification_permille.<dependency>` gauge;
//! * `degraded.{answered,unavailable,stale,miss,stores,evictions,too_large}`
//!   and `degraded.age_{le_1s,le_10s,le_60s,gt_60s}` counters, the gauge
//!   `degraded.last_age_ms`;
//! * `fair_drops.b<NN>` counters: requests dropped from the longest tenant
//!   line of a full level (see [`crate::admission::queue`]), by tenant
//!   hash bucket ([`FAIR_DROP_BUCKETS`] of them, never one per tenant);
//! * adaptive dependencies only, from the node-wide controller state
//!   (every 10th tick; every worker sets the same values): `limit.<dep>`
//!   (the limit requests see, cut during a baseline refresh),
//!   `baseline_us.<dep>`, and the last window's inputs `latency_p95_us.<dep>`,
//!   `latency_min_us.<dep>`, `error_rate_ppm.<dep>` (errors and timeouts
//!   per million completed), `window_queue_age_ms.<dep>`.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use proxy_wasm::types::{BufferType, MapType, MetricType};

use super::metrics::Metrics;
use super::{abi, ProxyHost};
use crate::admission::degraded::{self, Cached, Lookup};
use crate::admission::queue::{Attempt, Held, NotHeld, Offered, PriorityQueue, Served};
use crate::admission::request::{self, BodyBudget, Declared};
use crate::admission::retry::{self, Primaries};
use crate::admission::window::{self, Outcome, Windows};
use crate::admission::{self, breaker, controller, jittered_retry_after_secs, Limited, Ticket, Worker};
use crate::engine::{Decision, LimitName, Prepared, Reason};
use crate::host::Host;
use crate::policy::admission::Criticality;
use crate::policy::{Mode, Policy, RouteClass};
use crate::response;

thread_local! {
    /// The VM's slots (one worker per VM, whatever the roots).
    static WORKER: RefCell<Option<Worker>> = const { RefCell::new(None) };
    /// Requests waiting for a slot, per dependency key.
    static QUEUES: RefCell<HashMap<String, PriorityQueue<Parked>>> = RefCell::new(HashMap::new());
    /// Slots of requests the queue resumed, by stream context id.
    static ADMITTED: RefCell<HashMap<u32, Ticket>> = RefCell::new(HashMap::new());
    /// Primary requests of retry-budgeted dependencies not yet in shared
    /// data (folded on the tick), and the retries' updates.
    static PRIMARIES: RefCell<Primaries> = RefCell::new(Primaries::default());
    /// Degraded-answer slot key → (cache key hash, when this worker last
    /// stored it): a key is stored at most once per `refresh` per worker.
    static STORED: RefCell<HashMap<String, (u64, u64)>> = RefCell::new(HashMap::new());
    static CACHE_BUFFERS: RefCell<crate::table::Buffers> = RefCell::new(crate::table::Buffers::default());
    /// Captures of requests the queue resumed, by stream context id
    /// (taken by their stream at its response headers).
    static QUEUED_CAPTURES: RefCell<HashMap<u32, Capture>> = RefCell::new(HashMap::new());
    /// Streams of adaptive dependencies, by context id: what their end
    /// records.
    static SIGNALS: RefCell<HashMap<u32, Signal>> = RefCell::new(HashMap::new());
    /// The worker's stream-end windows.
    static WINDOWS: RefCell<Windows> = RefCell::new(Windows::default());
    /// The controller's shared-data buffers.
    static CONTROL_BUFFERS: RefCell<crate::table::Buffers> = RefCell::new(crate::table::Buffers::default());
}

/// What a stream of a dependency with a signal window (a controller's or
/// a breaker's) records at its end.
#[derive(Debug, Clone)]
pub struct Signal {
    /// The dependency's name and window length.
    dependency: String,
    window_ns: u64,
    /// When its slot was taken (headers, or the queue's admission).
    admitted_at: u64,
    /// Its dependency's live slots then, itself included.
    in_flight: u32,
    /// When its response headers came, and their status.
    response_at: Option<u64>,
    status: Option<u32>,
}

/// Starts a stream's signal if its class's dependency has a signal window.
fn start_signal(policy: &Policy, prepared: &Prepared, context_id: u32, ticket: &Ticket, now: u64) {
    let Some(dep) = prepared
        .class
        .labels
        .dependency
        .and_then(|i| policy.dependency(i))
    else {
        return;
    };
    // A controller's or a breaker's dependency.
    let Some(window_ns) = dep.signal_window_ns() else {
        return;
    };
    if ticket.dependency_key().is_none() {
        return;
    }
    let signal = Signal {
        dependency: dep.name.clone(),
        window_ns,
        admitted_at: now,
        in_flight: ticket.in_flight().saturating_add(1),
        response_at: None,
        status: None,
    };
    SIGNALS.with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            s.insert(context_id, signal);
        }
    });
}

/// A request refused for its adaptive dependency's limit: demand the
/// controller counts (memory only).
fn note_refused(policy: &Policy, prepared: &Prepared, reason: Reason, now: u64) {
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
    let Some(a) = dep.adaptive else { return };
    WINDOWS.with(|w| {
        if let Ok(mut w) = w.try_borrow_mut() {
            w.note_refused(&dep.name, a.window_ns, now);
        }
    });
}

/// The response's headers of a stream: stamps its signal (if it has one).
pub fn on_response_headers(context_id: u32) {
    SIGNALS.with(|s| {
        let Ok(mut s) = s.try_borrow_mut() else { return };
        if s.is_empty() {
            return;
        }
        if let Some(sig) = s.get_mut(&context_id) {
            sig.response_at = super::now_ns();
            sig.status = abi::header(MapType::HttpResponseHeaders, ":status")
                .ok()
                .flatten()
                .and_then(|v| std::str::from_utf8(&v).ok()?.parse().ok());
        }
    });
}

/// tenantgate answers the stream itself: its end is not a health signal.
pub fn forget_signal(context_id: u32) {
    SIGNALS.with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            if !s.is_empty() {
                s.remove(&context_id);
            }
        }
    });
}

/// The stream ended: records its outcome in the worker's window.
pub fn end_signal(context_id: u32, now: u64) {
    let signal = SIGNALS.with(|s| {
        let mut s = s.try_borrow_mut().ok()?;
        if s.is_empty() {
            return None;
        }
        s.remove(&context_id)
    });
    let Some(sig) = signal else { return };
    // Below 500 an answer is a success whoever sent it (tenantgate's own
    // replies forgot their signal): Envoy's details are read only for a
    // 5xx or a stream that ended without response headers, to tell the
    // upstream's failures from the rest (one property read fewer per
    // request).
    let details = match sig.status {
        Some(status) if status < 500 => None,
        _ => abi::property(&["response", "code_details"]).ok().flatten(),
    };
    let details = details.as_deref().and_then(|d| std::str::from_utf8(d).ok());
    let outcome = Outcome {
        latency_ns: sig.response_at.unwrap_or(now).saturating_sub(sig.admitted_at),
        kind: window::classify(details, sig.status, false),
        in_flight: sig.in_flight,
    };
    WINDOWS.with(|w| {
        if let Ok(mut w) = w.try_borrow_mut() {
            w.record(&sig.dependency, sig.window_ns, outcome, now);
        }
    });
}

/// The number of tenant buckets fair-queue drops are counted in.
pub const FAIR_DROP_BUCKETS: usize = 16;

/// A per-dependency metric, `tenantgate.admission.<what>.<dependency>`
/// (`None` if Envoy refused to define it: the stat is then not kept).
pub(super) fn dependency_metric(kind: MetricType, what: &str, dependency: &str) -> Option<u32> {
    abi::define_metric(kind, &format!("tenantgate.admission.{what}.{dependency}")).ok()
}

/// The controller's gauges of an adaptive dependency.
struct ControllerGauges {
    limit: Option<u32>,
    baseline_us: Option<u32>,
    p95_us: Option<u32>,
    min_us: Option<u32>,
    error_rate_ppm: Option<u32>,
    queue_age_ms: Option<u32>,
}

impl ControllerGauges {
    fn define(name: &str) -> ControllerGauges {
        let gauge = |what: &str| dependency_metric(MetricType::Gauge, what, name);
        ControllerGauges {
            limit: gauge("limit"),
            baseline_us: gauge("baseline_us"),
            p95_us: gauge("latency_p95_us"),
            min_us: gauge("latency_min_us"),
            error_rate_ppm: gauge("error_rate_ppm"),
            queue_age_ms: gauge("window_queue_age_ms"),
        }
    }

    fn set(&self, state: &controller::State, cap: u32) {
        let i = &state.inputs;
        for (id, value) in [
            (self.limit, u64::from(cap)),
            (self.baseline_us, state.baseline_ns / 1_000),
            (self.p95_us, i.p95_ns / 1_000),
            (self.min_us, i.min_ns / 1_000),
            (self.error_rate_ppm, u64::from(i.error_ppm)),
            (self.queue_age_ms, i.oldest_queue_ns / 1_000_000),
        ] {
            if let Some(id) = id {
                let _ = abi::record_metric(id, value);
            }
        }
    }
}

/// A dependency's gauges (ids) and what this root last gave them.
struct DependencyGauges {
    in_flight: Option<u32>,
    /// Defined once the dependency is adaptive in a loaded policy.
    controller: Option<ControllerGauges>,
    depth: Option<u32>,
    oldest_ms: Option<u32>,
    /// `retries.<dependency>`: retries admitted by its budget.
    retries: Option<u32>,
    pending_retries: Cell<u64>,
    /// `retry_amplification_permille.<dependency>`: attempts ÷ primaries
    /// over the budget's window, node-wide.
    amplification: Option<u32>,
    /// The dependency's budget in the last policy loaded.
    budget: RefCell<Option<crate::policy::admission::RetryBudget>>,
    /// This worker's queue length as last added to `depth`.
    reported_depth: Cell<u64>,
    /// The value this root last set `oldest_ms` to.
    reported_oldest_ms: Cell<u64>,
}

impl DependencyGauges {
    fn define(name: &str) -> DependencyGauges {
        let gauge = |what: &str| dependency_metric(MetricType::Gauge, what, name);
        DependencyGauges {
            in_flight: gauge("in_flight"),
            controller: None,
            depth: gauge("queue_depth"),
            oldest_ms: gauge("queue_oldest_ms"),
            retries: dependency_metric(MetricType::Counter, "retries", name),
            pending_retries: Cell::new(0),
            amplification: gauge("retry_amplification_permille"),
            budget: RefCell::new(None),
            reported_depth: Cell::new(0),
            reported_oldest_ms: Cell::new(0),
        }
    }

    /// Reports this worker's queue (see the module header).
    fn report(&self, depth: u64, oldest_ms: u64) {
        if let Some(id) = self.depth {
            let before = self.reported_depth.get();
            if depth != before {
                let delta = i64::try_from(depth)
                    .unwrap_or(i64::MAX)
                    .saturating_sub(i64::try_from(before).unwrap_or(i64::MAX));
                if abi::increment_metric(id, delta).is_ok() {
                    self.reported_depth.set(depth);
                }
            }
        }
        if let Some(id) = self.oldest_ms {
            let Ok(value) = abi::get_metric(id) else { return };
            let ours = value == self.reported_oldest_ms.get();
            if (oldest_ms >= value || ours)
                && (oldest_ms == value || abi::record_metric(id, oldest_ms).is_ok())
            {
                self.reported_oldest_ms.set(oldest_ms);
            }
        }
    }
}

/// A paused request: what resuming it needs.
#[derive(Debug)]
pub struct Parked {
    context_id: u32,
    policy: Rc<Policy>,
    prepared: Prepared,
    /// A primary request of a retry-budgeted dependency: counted when admitted.
    primary: bool,
}

/// Why a request does not go on at once.
pub enum Refused {
    /// Answer with this decision.
    Reply(Decision),
    /// Paused in its dependency's queue.
    Held,
    /// Refused (this decision, counted in `decisions.<reason>` like any
    /// refusal), and answered 200 from its class's degraded-answer cache.
    Degraded(degraded::Reply, Decision),
}

/// Sends a degraded answer on the current stream; false if Envoy refused it.
pub fn send_degraded(reply: &degraded::Reply) -> bool {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    abi::send_local_response(reply.status, &headers, &reply.body).is_ok()
}

/// Where a refusal was decided, for its record.
struct Decided<'a> {
    in_flight: u32,
    queue_wait_ns: u64,
    limit: &'a str,
}

/// What the degraded-answer cache has for a refused request.
enum Degrade {
    /// Not a degradable read refused for a shedding reason: its refusal.
    No,
    /// The answer, and its age in milliseconds.
    Answer(degraded::Reply, u64),
    /// No answer fresh enough: 503 `dependency_unavailable`.
    Unavailable,
}

/// The degraded-answer counters (`tenantgate.admission.degraded.<name>`).
const DEGRADED_COUNTERS: [&str; 11] = [
    "answered",
    "unavailable",
    "stale",
    "miss",
    "stores",
    "evictions",
    "too_large",
    "age_le_1s",
    "age_le_10s",
    "age_le_60s",
    "age_gt_60s",
];
const ANSWERED: usize = 0;
const UNAVAILABLE: usize = 1;
const STALE: usize = 2;
const MISS: usize = 3;
const STORES: usize = 4;
const EVICTIONS: usize = 5;
const TOO_LARGE: usize = 6;
const AGE_BUCKETS: usize = 7;
/// Upper bounds of the age buckets, in milliseconds (the last is open).
const AGE_BOUNDS_MS: [u64; 3] = [1_000, 10_000, 60_000];
/// Most slots a worker remembers its last store of (then it forgets all).
const MAX_REMEMBERED_STORES: usize = 65_536;

/// A response being captured for its class's degraded-answer cache.
#[derive(Debug)]
pub struct Capture {
    class: Rc<RouteClass>,
    slot: String,
    key: Vec<u8>,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    captured_at: u64,
}

/// The outcomes counted per criticality level.
const OUTCOMES: [Option<Reason>; 15] = [
    None,
    Some(Reason::ConcurrencyLimit),
    Some(Reason::StreamLimit),
    Some(Reason::TenantShare),
    Some(Reason::RequestTooLarge),
    Some(Reason::TimeoutBudget),
    Some(Reason::Contention),
    Some(Reason::StateUnavailable),
    Some(Reason::QueueFull),
    Some(Reason::QueueTimeout),
    Some(Reason::CircuitOpen),
    Some(Reason::CircuitProbeLimit),
    Some(Reason::Paused),
    Some(Reason::RetryBudget),
    Some(Reason::DependencyUnavailable),
];

fn outcome_name(o: Option<Reason>) -> &'static str {
    o.map_or("admitted", Reason::as_str)
}

/// Registers the VM's worker if it has none yet (on configure and on the
/// tick, until it works).
pub fn ensure_worker(now: u64) {
    WORKER.with(|w| {
        let Ok(mut w) = w.try_borrow_mut() else { return };
        if w.is_none() {
            match Worker::register(&ProxyHost, now) {
                Ok(worker) => *w = Some(worker),
                Err(reason) => log::warn!("tenantgate: no admission worker id yet: {}", reason.as_str()),
            }
        }
    });
}

pub(super) fn with_worker<R>(f: impl FnOnce(&mut Worker) -> R) -> Option<R> {
    WORKER.with(|w| w.try_borrow_mut().ok()?.as_mut().map(f))
}

/// Runs a tick of the controller or the breakers with the worker, its
/// signal windows and the control buffers (nothing, if one is borrowed).
fn with_control<R: Default>(f: impl FnOnce(&mut Worker, &mut Windows, &mut crate::table::Buffers) -> R) -> R {
    WINDOWS.with(|windows| {
        CONTROL_BUFFERS.with(|buffers| {
            let (Ok(mut windows), Ok(mut buffers)) = (windows.try_borrow_mut(), buffers.try_borrow_mut())
            else {
                return R::default();
            };
            with_worker(|w| f(w, &mut windows, &mut buffers)).unwrap_or_default()
        })
    })
}

/// Counts a primary request of a retry-budgeted dependency (memory only).
fn note_primary(budget: &crate::policy::admission::RetryBudget) {
    PRIMARIES.with(|p| {
        if let Ok(mut p) = p.try_borrow_mut() {
            p.note(budget);
        }
    });
}

/// The capture planned for a request the queue resumed, if any.
pub fn take_queued_capture(context_id: u32) -> Option<Capture> {
    QUEUED_CAPTURES.with(|c| c.try_borrow_mut().ok()?.remove(&context_id))
}

/// An admitted GET of a degradable class (on the current stream): capture
/// its response unless this worker stored its key within `refresh`.
fn plan_capture(prepared: &Prepared, now: u64) -> Option<Capture> {
    let deg = prepared.class.degradable.as_ref()?;
    if ProxyHost.request_header(":method").as_deref() != Some(b"GET") {
        return None;
    }
    let path = ProxyHost.request_header(":path").unwrap_or_default();
    let key = degraded::cache_key(deg, &prepared.subject, &path)?;
    let slot = degraded::slot_key(deg, &key);
    let hash = crate::table::fnv1a64(&key);
    let recent = STORED.with(|s| {
        s.try_borrow()
            .ok()
            .and_then(|s| s.get(&slot).copied())
            .is_some_and(|(h, at)| h == hash && now.saturating_sub(at) < deg.refresh_ns)
    });
    (!recent).then(|| Capture {
        class: prepared.class.clone(),
        slot,
        key,
        headers: Vec::new(),
        body: Vec::new(),
        captured_at: now,
    })
}

/// Releases a stream's slot.
pub fn release(ticket: Ticket, now: u64) {
    let kept = WORKER.with(|w| match w.try_borrow_mut() {
        Ok(mut guard) => match guard.as_mut() {
            Some(worker) => {
                worker.release(&ProxyHost, ticket, now);
                None
            }
            None => Some(ticket),
        },
        Err(_) => Some(ticket),
    });
    if kept.is_some() {
        // Unreachable: a ticket exists only if the worker does, and the
        // worker is never borrowed across a callback.
        log::error!("tenantgate: an admission slot could not be released");
    }
}

/// Forgets a stream: out of its queue, its resumed slot released.
pub fn stream_done(context_id: u32, now: u64) {
    QUEUES.with(|q| {
        if let Ok(mut queues) = q.try_borrow_mut() {
            for queue in queues.values_mut() {
                queue.remove(|p| p.context_id == context_id);
            }
        }
    });
    let _ = take_queued_capture(context_id);
    let ticket = ADMITTED.with(|a| a.try_borrow_mut().ok()?.remove(&context_id));
    if let Some(t) = ticket {
        release(t, now);
    }
}

/// A stream's admission state.
#[derive(Debug, Default)]
pub struct Stream {
    pub ticket: Option<Ticket>,
    pub body: Option<BodyBudget>,
    pub level: Criticality,
    /// Paused in a dependency's queue, or resumed from it.
    pub queued: bool,
    /// The response is being captured for the degraded-answer cache.
    pub capture: Option<Capture>,
}

/// The filter state the decision record is kept under (`wasm.` + this).
pub const RECORD_PROPERTY: &str = "tenantgate_admission";

/// What refused a slot, as the decision record names it.
fn limit_name(policy: &Policy, prepared: &Prepared, limit: Limited) -> LimitName {
    let labels = prepared.class.labels;
    let dependency = labels
        .dependency
        .and_then(|i| policy.dependency(i))
        .map_or("-", |d| d.name.as_str())
        .to_owned();
    match limit {
        Limited::Action => LimitName::Action(prepared.class.action.clone()),
        Limited::Dependency => LimitName::Dependency(dependency),
        Limited::Tenant => LimitName::Tenant(dependency),
    }
}

/// Writes a request's decision record (on the current stream); `limit`:
/// what refused a slot (see [`admission::DecisionRecord::limit`]).
#[allow(clippy::too_many_arguments)]
fn record(
    policy: &Policy,
    prepared: &Prepared,
    outcome: Option<Reason>,
    in_flight: u32,
    queue_wait_ns: u64,
    limit: &str,
    now: u64,
    degraded_age_ms: Option<u64>,
) {
    let labels = prepared.class.labels;
    let dep = labels.dependency.and_then(|i| policy.dependency(i));
    let dependency = dep.map_or("-", |d| d.name.as_str());
    let key = crate::engine::logical_key(&prepared.class.action, &prepared.subject);
    let controller_limit = labels
        .dependency
        .and_then(|i| policy.dependency(i))
        .filter(|d| d.adaptive.is_some())
        .and_then(|d| with_worker(|w| admission::effective_limit(d, &w.control(&d.key))));
    let text = admission::DecisionRecord {
        outcome: outcome_name(outcome),
        criticality: labels.criticality,
        dependency,
        in_flight,
        queue_wait_ms: queue_wait_ns / 1_000_000,
        policy_version: &policy.version,
        limit_key: &key,
        limit,
        breaker: super::breaker::phase_name(dep, now),
        controller_limit,
        degraded_age_ms,
    }
    .render();
    if abi::set_property(RECORD_PROPERTY, text.as_bytes()).is_err() {
        log::debug!("tenantgate: cannot set the admission record");
    }
}

/// A refusal's decision, with its jittered `Retry-After`; `limit` names
/// what refused (a dependency or an action).
#[allow(clippy::too_many_arguments)]
fn refusal_decision(
    reason: Reason,
    limit: LimitName,
    min_secs: u64,
    window_ns: u64,
    prepared: &Prepared,
    context_id: u32,
    now: u64,
) -> Decision {
    let seed = now ^ (u64::from(context_id) << 32);
    Decision {
        limit: Some(limit),
        retry_after_secs: jittered_retry_after_secs(min_secs, window_ns, seed),
        subject: prepared.subject.clone(),
        ..Decision::passed(reason)
    }
}

/// The root's admission stats and gauges.
pub struct Admission {
    counters: [[Option<u32>; 4]; OUTCOMES.len()],
    pending: [[Cell<u64>; 4]; OUTCOMES.len()],
    /// `admission.queued.<criticality>`: requests paused for a slot.
    queued: [Cell<u64>; 4],
    queued_ids: [Option<u32>; 4],
    /// Dependency key → its gauges, for every dependency of every policy
    /// this root loaded (bounded by the policies).
    gauges: RefCell<HashMap<String, DependencyGauges>>,
    /// Action key → its `action_in_flight` gauge id, for every action limit
    /// of every policy this root loaded (bounded by the policies).
    action_gauges: RefCell<HashMap<String, Option<u32>>>,
    /// `admission.fair_drops.b<NN>`, by tenant hash bucket.
    fair_drops: [Option<u32>; FAIR_DROP_BUCKETS],
    /// `admission.degraded.<name>` ([`DEGRADED_COUNTERS`]).
    degraded_ids: [Option<u32>; DEGRADED_COUNTERS.len()],
    degraded_pending: [Cell<u64>; DEGRADED_COUNTERS.len()],
    /// `admission.degraded.last_age_ms`: the age of the last degraded answer.
    degraded_age: Option<u32>,
    ticks: Cell<u32>,
}

impl Admission {
    pub fn define() -> Admission {
        Admission {
            counters: OUTCOMES.map(|o| {
                Criticality::ALL.map(|c| {
                    let name = format!("tenantgate.admission.{}.{}", outcome_name(o), c.as_str());
                    abi::define_metric(MetricType::Counter, &name).ok()
                })
            }),
            pending: Default::default(),
            queued: Default::default(),
            queued_ids: Criticality::ALL.map(|c| {
                abi::define_metric(
                    MetricType::Counter,
                    &format!("tenantgate.admission.queued.{}", c.as_str()),
                )
                .ok()
            }),
            gauges: RefCell::new(HashMap::new()),
            action_gauges: RefCell::new(HashMap::new()),
            fair_drops: std::array::from_fn(|b| {
                abi::define_metric(
                    MetricType::Counter,
                    &format!("tenantgate.admission.fair_drops.b{b:02}"),
                )
                .ok()
            }),
            degraded_ids: DEGRADED_COUNTERS.map(|name| {
                abi::define_metric(
                    MetricType::Counter,
                    &format!("tenantgate.admission.degraded.{name}"),
                )
                .ok()
            }),
            degraded_pending: Default::default(),
            degraded_age: abi::define_metric(MetricType::Gauge, "tenantgate.admission.degraded.last_age_ms")
                .ok(),
            ticks: Cell::new(0),
        }
    }

    /// Defines the gauges of a newly loaded policy's dependencies and
    /// action limits.
    pub fn configure(&self, policy: &Policy, now: u64) {
        if policy.dependencies.is_empty() && policy.actions.is_empty() {
            return;
        }
        Worker::prepare(&ProxyHost, policy, now);
        super::breaker::configure(policy);
        ensure_worker(now);
        let Ok(mut gauges) = self.gauges.try_borrow_mut() else {
            return;
        };
        for d in &policy.dependencies {
            let g = gauges
                .entry(d.key.clone())
                .or_insert_with(|| DependencyGauges::define(&d.name));
            if let Ok(mut b) = g.budget.try_borrow_mut() {
                b.clone_from(&d.retry_budget);
            }
            if let Some(window_ns) = d.signal_window_ns() {
                window::prepare(&ProxyHost, &d.name, window_ns, now);
            }
            if d.adaptive.is_some() && g.controller.is_none() {
                g.controller = Some(ControllerGauges::define(&d.name));
            }
        }
        let Ok(mut action_gauges) = self.action_gauges.try_borrow_mut() else {
            return;
        };
        for a in &policy.actions {
            action_gauges.entry(a.key.clone()).or_insert_with(|| {
                let name = format!("tenantgate.admission.action_in_flight.{}", a.name);
                abi::define_metric(MetricType::Gauge, &name).ok()
            });
        }
    }

    fn count(&self, outcome: Option<Reason>, level: Criticality) {
        if let Some(c) = OUTCOMES
            .iter()
            .position(|o| *o == outcome)
            .and_then(|i| self.pending.get(i))
            .and_then(|row| row.get(level.index()))
        {
            c.set(c.get().saturating_add(1));
        }
    }

    /// Checks and admits a request of a class with admission labels.
    /// `Err`: the refusal, as a decision to answer with.
    pub fn on_request_headers(
        &self,
        policy: &Rc<Policy>,
        prepared: &Prepared,
        stream: &mut Stream,
        context_id: u32,
        now: u64,
    ) -> Result<(), Refused> {
        let labels = prepared.class.labels;
        let level = labels.criticality;
        stream.level = level;
        // `mode: shadow`: refusals are counted, never enforced.
        let shadow = policy.mode == Mode::Shadow;
        let declared = Declared::read(
            ProxyHost.request_header("content-length").as_deref(),
            labels
                .min_timeout_budget_ns
                .and(ProxyHost.request_header(request::EXPECTED_TIMEOUT_HEADER))
                .as_deref(),
        );
        if let Err(reason) = request::check(&labels, &declared) {
            self.count(Some(reason), level);
            record(policy, prepared, Some(reason), 0, 0, "-", now, None);
            if shadow {
                return Ok(());
            }
            return Err(Refused::Reply(Decision {
                retry_after_secs: 1,
                subject: prepared.subject.clone(),
                ..Decision::passed(reason)
            }));
        }
        if declared.content_length.is_none() && !shadow {
            stream.body = BodyBudget::of(&labels);
        }
        let dep = labels.dependency.and_then(|i| policy.dependency(i));
        if dep.is_none() && labels.action_limit.is_none() {
            record(policy, prepared, None, 0, 0, "-", now, None);
            return Ok(());
        }
        let budget = dep.and_then(|d| d.retry_budget.as_ref());
        let is_retry = budget.is_some_and(|b| retry::is_retry(b, &ProxyHost));
        if let (Some(b), true) = (budget, is_retry) {
            let taken = PRIMARIES.with(|p| match p.try_borrow_mut() {
                Ok(mut p) => p.take_retry(&ProxyHost, b, now),
                Err(_) => Err(retry::RetryRefusal {
                    reason: Reason::StateUnavailable,
                    retry_after_secs: 1,
                    totals: retry::Totals::default(),
                }),
            });
            match taken {
                Ok(_) => self.count_retry(dep),
                Err(refused) => {
                    let reason = refused.reason;
                    self.count(Some(reason), level);
                    let name = dep.map_or("-", |d| d.name.as_str());
                    let limit = format!("dependency:{name}");
                    if shadow {
                        // Counted and recorded, never enforced (like every
                        // shadow refusal: no slot is taken either).
                        record(policy, prepared, Some(reason), 0, 0, &limit, now, None);
                        return Ok(());
                    }
                    let window = dep.map_or(crate::policy::admission::DEFAULT_RETRY_AFTER_WINDOW_NS, |d| {
                        d.retry_after_window_ns
                    });
                    let mut decision = refusal_decision(
                        reason,
                        LimitName::Dependency(name.to_owned()),
                        1,
                        window,
                        prepared,
                        context_id,
                        now,
                    );
                    let seed = now ^ (u64::from(context_id) << 32);
                    decision.retry_after_secs =
                        jittered_retry_after_secs(refused.retry_after_secs, window, seed);
                    let at = Decided {
                        in_flight: 0,
                        queue_wait_ns: 0,
                        limit: &limit,
                    };
                    return Err(self.refuse(policy, prepared, decision, &at, now));
                }
            }
        }
        let primary = budget.filter(|_| !is_retry);
        let acquired =
            with_worker(|w| w.acquire(&ProxyHost, policy, &prepared.class, &prepared.subject, now))
                .unwrap_or(Err(admission::Refusal {
                    reason: Reason::StateUnavailable,
                    in_flight: 0,
                    retry_after_window_ns: dep
                        .map_or(crate::policy::admission::DEFAULT_RETRY_AFTER_WINDOW_NS, |d| {
                            d.retry_after_window_ns
                        }),
                    retry_after_secs: 1,
                    limit: Limited::Dependency,
                }));
        match acquired {
            Ok(ticket) => {
                self.count(None, level);
                if let Some(b) = primary {
                    note_primary(b);
                }
                if let Some(t) = &ticket {
                    start_signal(policy, prepared, context_id, t, now);
                }
                record(
                    policy,
                    prepared,
                    None,
                    ticket.as_ref().map_or(0, Ticket::in_flight),
                    0,
                    "-",
                    now,
                    None,
                );
                stream.capture = plan_capture(prepared, now);
                stream.ticket = ticket;
                Ok(())
            }
            Err(refusal) => {
                let mut reason = refusal.reason;
                // A dependency's queue holds a request refused by its
                // action's limit too: the tick retries the whole acquire.
                let queue = dep
                    .and_then(|d| d.queues.get(level.index()).copied().map(|q| (d, q)))
                    .filter(|_| reason == Reason::ConcurrencyLimit && !shadow);
                if let Some((dep, queue)) = queue.filter(|(_, q)| q.max_queue > 0) {
                    let held = Held {
                        item: Parked {
                            context_id,
                            policy: policy.clone(),
                            prepared: prepared.clone(),
                            primary: primary.is_some(),
                        },
                        level,
                        tenant: crate::table::fnv1a64(
                            admission::tenant_key(&dep.name, &prepared.subject).as_bytes(),
                        ),
                        enqueued: now,
                        deadline: now.saturating_add(queue.max_wait_ns),
                    };
                    let offered = QUEUES.with(|q| match q.try_borrow_mut() {
                        Ok(mut queues) => queues
                            .entry(dep.key.clone())
                            .or_default()
                            .offer(held, queue.max_queue),
                        Err(_) => Err(NotHeld::Full),
                    });
                    match offered {
                        Ok(offered) => {
                            self.count_queued(level);
                            stream.queued = true;
                            if let Offered::Displaced(dropped) = offered {
                                self.fair_drop(dropped, now);
                                // Back on this request's stream.
                                let _ = abi::set_effective_context(context_id);
                            }
                            return Err(Refused::Held);
                        }
                        Err(NotHeld::Full) => reason = Reason::QueueFull,
                        Err(NotHeld::NoQueue) => {}
                    }
                }
                self.count(Some(reason), level);
                if refusal.limit == Limited::Dependency {
                    note_refused(policy, prepared, reason, now);
                }
                let limited = limit_name(policy, prepared, refusal.limit);
                let limit = limited.record_name();
                if shadow {
                    record(
                        policy,
                        prepared,
                        Some(reason),
                        refusal.in_flight,
                        0,
                        &limit,
                        now,
                        None,
                    );
                    return Ok(());
                }
                let decision = refusal_decision(
                    reason,
                    limited,
                    refusal.retry_after_secs,
                    refusal.retry_after_window_ns,
                    prepared,
                    context_id,
                    now,
                );
                let at = Decided {
                    in_flight: refusal.in_flight,
                    queue_wait_ns: 0,
                    limit: &limit,
                };
                Err(self.refuse(policy, prepared, decision, &at, now))
            }
        }
    }

    /// Answers a request dropped from the longest tenant line of a full
    /// level: 503 `queue_full`, counted in its tenant's bucket.
    fn fair_drop(&self, dropped: Held<Parked>, now: u64) {
        let bucket = usize::try_from(dropped.tenant % FAIR_DROP_BUCKETS as u64).unwrap_or(0);
        if let Some(Some(id)) = self.fair_drops.get(bucket) {
            let _ = abi::increment_metric(*id, 1);
        }
        self.count(Some(Reason::QueueFull), dropped.level);
        self.answer_held(dropped, Reason::QueueFull, 1, None, now);
    }

    /// Answers a held request with a refusal (on its own stream).
    /// `min_secs`: the refusal's shortest honest `Retry-After`.
    fn answer_held(
        &self,
        h: Held<Parked>,
        reason: Reason,
        min_secs: u64,
        metrics: Option<&Metrics>,
        now: u64,
    ) {
        let p = h.item;
        if abi::set_effective_context(p.context_id).is_err() {
            return;
        }
        let Some(dep) = p
            .prepared
            .class
            .labels
            .dependency
            .and_then(|i| p.policy.dependency(i))
        else {
            return;
        };
        // A queue is its dependency's: it names what refused.
        note_refused(&p.policy, &p.prepared, reason, now);
        let limited = limit_name(&p.policy, &p.prepared, Limited::Dependency);
        let limit = limited.record_name();
        let decision = refusal_decision(
            reason,
            limited,
            min_secs,
            dep.retry_after_window_ns,
            &p.prepared,
            p.context_id,
            now,
        );
        let at = Decided {
            in_flight: 0,
            queue_wait_ns: now.saturating_sub(h.enqueued),
            limit: &limit,
        };
        let decision = match self.refuse(&p.policy, &p.prepared, decision, &at, now) {
            Refused::Reply(d) => d,
            Refused::Held => return,
            Refused::Degraded(reply, decision) => {
                if let Some(m) = metrics {
                    m.record(&decision);
                }
                if !send_degraded(&reply) {
                    log::warn!("tenantgate: cannot send a degraded answer to a held request");
                }
                return;
            }
        };
        if let Some(m) = metrics {
            m.record(&decision);
        }
        let raw = ProxyHost.request_header("x-request-id");
        if let Some(reply) = response::local_reply(
            &decision,
            &p.policy.version,
            p.policy.ratelimit_headers,
            response::request_id(raw.as_deref()),
        ) {
            match metrics {
                Some(m) => {
                    super::send_reply(&reply, m);
                }
                None => {
                    let headers: Vec<(&str, &str)> =
                        reply.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                    if abi::send_local_response(reply.status, &headers, reply.body.as_bytes()).is_err() {
                        log::warn!("tenantgate: cannot answer a request dropped from a full queue");
                    }
                }
            }
        }
    }

    fn count_degraded(&self, counter: usize) {
        if let Some(c) = self.degraded_pending.get(counter) {
            c.set(c.get().saturating_add(1));
        }
    }

    /// A refusal's answer: for a degradable read refused for a shedding
    /// reason, the cached answer or 503 `dependency_unavailable`; else the
    /// refusal. Writes the decision record with the final outcome.
    fn refuse(
        &self,
        policy: &Policy,
        prepared: &Prepared,
        decision: Decision,
        at: &Decided<'_>,
        now: u64,
    ) -> Refused {
        let reason = decision.reason;
        let rec = |outcome, age| {
            record(
                policy,
                prepared,
                Some(outcome),
                at.in_flight,
                at.queue_wait_ns,
                at.limit,
                now,
                age,
            )
        };
        match self.degrade(prepared, reason, now) {
            Degrade::No => {
                rec(reason, None);
                Refused::Reply(decision)
            }
            Degrade::Answer(reply, age_ms) => {
                rec(reason, Some(age_ms));
                Refused::Degraded(reply, decision)
            }
            Degrade::Unavailable => {
                rec(Reason::DependencyUnavailable, None);
                Refused::Reply(Decision {
                    reason: Reason::DependencyUnavailable,
                    ..decision
                })
            }
        }
    }

    /// Looks a refused request up in its class's degraded-answer cache.
    fn degrade(&self, prepared: &Prepared, reason: Reason, now: u64) -> Degrade {
        let Some(deg) = prepared.class.degradable.as_ref() else {
            return Degrade::No;
        };
        if !degraded::serves(reason) {
            return Degrade::No;
        }
        let method = ProxyHost.request_header(":method").unwrap_or_default();
        // A write is never answered from the cache: it gets its refusal.
        if !degraded::readable(&method) {
            return Degrade::No;
        }
        let path = ProxyHost.request_header(":path").unwrap_or_default();
        let Some(key) = degraded::cache_key(deg, &prepared.subject, &path) else {
            return Degrade::No;
        };
        match degraded::lookup(&ProxyHost, deg, &key, now) {
            Lookup::Fresh(cached) => {
                let age_ms = now.saturating_sub(cached.captured_at) / 1_000_000;
                self.count_degraded(ANSWERED);
                let bucket = AGE_BOUNDS_MS
                    .iter()
                    .position(|b| age_ms <= *b)
                    .unwrap_or(AGE_BOUNDS_MS.len());
                self.count_degraded(AGE_BUCKETS.saturating_add(bucket));
                if let Some(id) = self.degraded_age {
                    let _ = abi::record_metric(id, age_ms);
                }
                Degrade::Answer(degraded::reply(&cached, reason, now, method == b"HEAD"), age_ms)
            }
            Lookup::Stale { .. } => {
                self.count_degraded(UNAVAILABLE);
                self.count_degraded(STALE);
                Degrade::Unavailable
            }
            Lookup::Miss => {
                self.count_degraded(UNAVAILABLE);
                self.count_degraded(MISS);
                Degrade::Unavailable
            }
        }
    }

    /// The response's headers: a 200 is kept on, with its kept headers;
    /// anything else ends the capture.
    pub fn on_response_headers(&self, stream: &mut Stream, end_of_stream: bool, now: u64) {
        let Some(mut c) = stream.capture.take() else {
            return;
        };
        let Some(deg) = c.class.degradable.as_ref() else {
            return;
        };
        let header = |name: &str| abi::header(MapType::HttpResponseHeaders, name).ok().flatten();
        if header(":status").as_deref() != Some(b"200") {
            return;
        }
        // The upstream says its answer must not be stored.
        if header("cache-control")
            .is_some_and(|v| v.to_ascii_lowercase().windows(8).any(|w| w == b"no-store"))
        {
            return;
        }
        let declared = header("content-length").and_then(|v| {
            core::str::from_utf8(&v)
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
        });
        if declared.is_some_and(|n| n > u64::from(deg.max_body_bytes)) {
            self.count_degraded(TOO_LARGE);
            return;
        }
        let mut size = 0usize;
        for name in degraded::kept_headers(deg) {
            if let Some(value) = header(name).and_then(|v| String::from_utf8(v).ok()) {
                size = size.saturating_add(name.len()).saturating_add(value.len());
                c.headers.push((name.to_owned(), value));
            }
        }
        if size > degraded::MAX_KEPT_HEADERS_BYTES {
            self.count_degraded(TOO_LARGE);
            return;
        }
        c.captured_at = now;
        if end_of_stream {
            self.store(c);
        } else {
            stream.capture = Some(c);
        }
    }

    /// A chunk of the response's body (read as it passes: nothing is
    /// buffered or delayed); at its end the answer is stored.
    pub fn on_response_body(&self, stream: &mut Stream, body_size: usize, end_of_stream: bool) {
        let Some(mut c) = stream.capture.take() else {
            return;
        };
        let max = c
            .class
            .degradable
            .as_ref()
            .map_or(0, |d| d.max_body_bytes as usize);
        if body_size > 0 {
            if c.body.len().saturating_add(body_size) > max {
                self.count_degraded(TOO_LARGE);
                return;
            }
            match abi::buffer(BufferType::HttpResponseBody, 0, body_size) {
                Ok(Some(chunk)) => c.body.extend_from_slice(&chunk),
                Ok(None) => {}
                Err(_) => return,
            }
            if c.body.len() > max {
                self.count_degraded(TOO_LARGE);
                return;
            }
        }
        if end_of_stream {
            self.store(c);
        } else {
            stream.capture = Some(c);
        }
    }

    fn store(&self, c: Capture) {
        let Some(deg) = c.class.degradable.as_ref() else {
            return;
        };
        let answer = Cached {
            key: c.key,
            captured_at: c.captured_at,
            headers: c.headers,
            body: c.body,
        };
        let stored = CACHE_BUFFERS.with(|b| match b.try_borrow_mut() {
            Ok(mut buffers) => degraded::store(&ProxyHost, deg, &answer, &mut buffers),
            Err(_) => Err(degraded::NotStored::Failed),
        });
        match stored {
            Ok(s) => {
                self.count_degraded(STORES);
                if s.evicted {
                    self.count_degraded(EVICTIONS);
                }
                let hash = crate::table::fnv1a64(&answer.key);
                STORED.with(|m| {
                    if let Ok(mut m) = m.try_borrow_mut() {
                        if m.len() >= MAX_REMEMBERED_STORES {
                            m.clear();
                        }
                        m.insert(c.slot, (hash, answer.captured_at));
                    }
                });
            }
            Err(degraded::NotStored::TooLarge) => self.count_degraded(TOO_LARGE),
            Err(degraded::NotStored::Failed) => {}
        }
    }

    /// Counts a retry its budget admitted (flushed on the tick).
    fn count_retry(&self, dep: Option<&crate::policy::admission::Dependency>) {
        let Some(dep) = dep else { return };
        if let Ok(gauges) = self.gauges.try_borrow() {
            if let Some(g) = gauges.get(dep.key.as_str()) {
                g.pending_retries.set(g.pending_retries.get().saturating_add(1));
            }
        }
    }

    fn count_queued(&self, level: Criticality) {
        if let Some(c) = self.queued.get(level.index()) {
            c.set(c.get().saturating_add(1));
        }
    }

    /// Serves every dependency's queue (see the module header).
    fn serve_queues(&self, metrics: &Metrics, now: u64) {
        let served: Vec<Served<Parked, Ticket, admission::Refusal>> = QUEUES.with(|q| {
            let Ok(mut queues) = q.try_borrow_mut() else {
                return Vec::new();
            };
            let mut out = Vec::new();
            for queue in queues.values_mut().filter(|q| !q.is_empty()) {
                out.extend(queue.serve(now, super::TICK_NS, |h| {
                    let p = &h.item;
                    let tried = with_worker(|w| {
                        w.acquire(&ProxyHost, &p.policy, &p.prepared.class, &p.prepared.subject, now)
                    });
                    match tried {
                        Some(Ok(Some(ticket))) => Attempt::Admitted(ticket),
                        Some(Err(r)) if r.reason == Reason::TenantShare => Attempt::TenantFull,
                        // Its breaker opened, or it was paused: answered now,
                        // not held until its max_wait.
                        Some(Err(r)) if matches!(r.reason, Reason::CircuitOpen | Reason::Paused) => {
                            Attempt::Refused(r)
                        }
                        _ => Attempt::LevelFull,
                    }
                }));
            }
            out
        });
        for s in served {
            match s {
                Served::Admitted(h, ticket) => {
                    let p = h.item;
                    self.count(None, h.level);
                    if p.primary {
                        let labels = p.prepared.class.labels;
                        if let Some(b) = labels
                            .dependency
                            .and_then(|i| p.policy.dependency(i))
                            .and_then(|d| d.retry_budget.as_ref())
                        {
                            note_primary(b);
                        }
                    }
                    if abi::set_effective_context(p.context_id).is_err() {
                        // The stream ended meanwhile.
                        release(ticket, now);
                        continue;
                    }
                    record(
                        &p.policy,
                        &p.prepared,
                        None,
                        ticket.in_flight(),
                        now.saturating_sub(h.enqueued),
                        "-",
                        now,
                        None,
                    );
                    let decision = super::charge(&p.policy, &p.prepared, now);
                    metrics.record(&decision);
                    match response::local_reply(
                        &decision,
                        &p.policy.version,
                        p.policy.ratelimit_headers,
                        None,
                    ) {
                        Some(reply) => {
                            release(ticket, now);
                            super::send_reply(&reply, metrics);
                        }
                        None => {
                            start_signal(&p.policy, &p.prepared, p.context_id, &ticket, now);
                            ADMITTED.with(|a| {
                                if let Ok(mut a) = a.try_borrow_mut() {
                                    a.insert(p.context_id, ticket);
                                }
                            });
                            if let Some(capture) = plan_capture(&p.prepared, now) {
                                QUEUED_CAPTURES.with(|c| {
                                    if let Ok(mut c) = c.try_borrow_mut() {
                                        c.insert(p.context_id, capture);
                                    }
                                });
                            }
                            if abi::resume_http_request().is_err() {
                                log::warn!("tenantgate: cannot resume a request held for a slot");
                            }
                        }
                    }
                }
                Served::TimedOut(h) => {
                    self.count(Some(Reason::QueueTimeout), h.level);
                    self.answer_held(h, Reason::QueueTimeout, 1, Some(metrics), now);
                }
                Served::Refused(h, r) => {
                    self.count(Some(r.reason), h.level);
                    self.answer_held(h, r.reason, r.retry_after_secs, Some(metrics), now);
                }
            }
        }
    }

    /// The breakers' tick (see [`breaker::tick`]), after the controller's.
    fn breakers(&self, policy: &Policy, controlled: &[controller::Ticked], now: u64) -> Vec<breaker::Ticked> {
        with_control(|w, windows, buffers| {
            breaker::tick(&ProxyHost, policy, w, windows, controlled, now, buffers)
        })
    }

    /// The adaptive controller's tick (see [`controller::tick`]).
    fn control(&self, policy: &Policy, now: u64) -> Vec<controller::Ticked> {
        let ages = QUEUES.with(|q| {
            q.try_borrow()
                .map(|queues| {
                    queues
                        .iter()
                        .filter_map(|(key, queue)| {
                            queue.oldest().map(|at| (key.clone(), now.saturating_sub(at)))
                        })
                        .collect::<HashMap<String, u64>>()
                })
                .unwrap_or_default()
        });
        let age = |d: &crate::policy::admission::Dependency| ages.get(&d.key).copied().unwrap_or(0);
        with_control(|w, windows, buffers| {
            controller::tick(&ProxyHost, policy, w, windows, &age, now, buffers)
        })
    }

    /// Counts a streamed body's chunk; `Err`: over `max_body_bytes`.
    pub fn on_request_body(&self, stream: &mut Stream, bytes: usize) -> Result<(), Decision> {
        let level = stream.level;
        let Some(budget) = stream.body.as_mut() else {
            return Ok(());
        };
        budget
            .add(u64::try_from(bytes).unwrap_or(u64::MAX))
            .map_err(|reason| {
                stream.body = None;
                self.count(Some(reason), level);
                Decision {
                    retry_after_secs: 1,
                    ..Decision::passed(reason)
                }
            })
    }

    /// The root tick: leases, pending stats, gauges, and the adaptive
    /// controller of `policy`'s dependencies.
    pub fn tick(&self, metrics: &Metrics, policy: Option<&Policy>, now: u64) {
        let flush = |id: &Option<u32>, p: &Cell<u64>| {
            let n = p.take();
            if let (Some(id), true) = (id, n > 0) {
                let _ = abi::increment_metric(*id, i64::try_from(n).unwrap_or(i64::MAX));
            }
        };
        for (ids, pending) in self.counters.iter().zip(&self.pending) {
            for (id, p) in ids.iter().zip(pending) {
                flush(id, p);
            }
        }
        for (id, p) in self.queued_ids.iter().zip(&self.queued) {
            flush(id, p);
        }
        for (id, p) in self.degraded_ids.iter().zip(&self.degraded_pending) {
            flush(id, p);
        }
        let (Ok(gauges), Ok(action_gauges)) = (self.gauges.try_borrow(), self.action_gauges.try_borrow())
        else {
            return;
        };
        if gauges.is_empty() && action_gauges.is_empty() {
            return;
        }
        ensure_worker(now);
        with_worker(|w| w.renew(&ProxyHost, now));
        PRIMARIES.with(|p| {
            if let Ok(mut p) = p.try_borrow_mut() {
                p.fold(&ProxyHost, now);
            }
        });
        for g in gauges.values() {
            flush(&g.retries, &g.pending_retries);
        }
        self.serve_queues(metrics, now);
        let ticks = self.ticks.get().wrapping_add(1);
        let ticked = match policy.filter(|p| p.dependencies.iter().any(|d| d.adaptive.is_some())) {
            Some(policy) => self.control(policy, now),
            None => Vec::new(),
        };
        if let Some(policy) = policy.filter(|p| p.dependencies.iter().any(|d| d.breaker.is_some())) {
            for t in self.breakers(policy, &ticked, now) {
                if let Some(dep) = policy.dependency(t.dependency) {
                    super::breaker::report(dep, &t, now);
                }
            }
        }
        if ticks % 10 == 0 {
            for t in &ticked {
                let (Some(dep), Some(state), Some(cap)) =
                    (policy.and_then(|p| p.dependency(t.dependency)), t.state, t.cap)
                else {
                    continue;
                };
                if let Some(c) = gauges.get(&dep.key).and_then(|g| g.controller.as_ref()) {
                    c.set(&state, cap);
                }
            }
        }
        QUEUES.with(|q| {
            let Ok(queues) = q.try_borrow() else { return };
            for (key, g) in gauges.iter() {
                let queue = queues.get(key);
                let depth = queue.map_or(0, |q| q.len() as u64);
                let oldest_ms = queue
                    .and_then(PriorityQueue::oldest)
                    .map_or(0, |at| now.saturating_sub(at) / 1_000_000);
                g.report(depth, oldest_ms);
            }
        });
        self.ticks.set(ticks);
        if ticks % 10 != 0 {
            return;
        }
        for g in gauges.values() {
            let budget = g.budget.try_borrow().ok().and_then(|b| b.clone());
            if let (Some(id), Some(b)) = (g.amplification, budget) {
                if let Some(t) = retry::totals(&ProxyHost, &b, now) {
                    let _ = abi::record_metric(id, t.amplification_permille());
                }
            }
        }
        let in_flight = gauges.iter().map(|(key, g)| (key, g.in_flight));
        for (key, id) in in_flight.chain(action_gauges.iter().map(|(key, id)| (key, *id))) {
            if let (Some(id), Some(live)) = (id, admission::in_flight(&ProxyHost, key, now)) {
                let _ = abi::record_metric(id, u64::from(live.total()));
            }
        }
    }
}
