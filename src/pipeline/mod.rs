//! The request pipeline: one worker's whole decision for every stream, in
//! the order it is made, over any host.
//!
//! A host (the wasm glue, `src/glue/`; a native module) creates one
//! [`Pipeline`] per worker, hands it the events it gets from Envoy, and
//! carries out what the pipeline answers: a [`Directive`] for the current
//! stream (go on, pause it, or reply with a local answer, plus the decision
//! record for the access log), and [`Answer`]s for streams it paused
//! earlier ([`Pipeline::take_answers`]). It decides nothing itself.
//!
//! # The map
//! | file | what it is |
//! |---|---|
//! | `admit.rs` | the driver: a request's headers through the stages to the conclusion; its body; a held request answered or resumed |
//! | `request.rs` | one request's context ([`Request`]: what it asked, read once; what it took; its record), the [`Step`](request::Step) a stage returns |
//! | `stages.rs` | the stages in order, each `fn(&mut Pipeline, &H, &mut Req, now) -> Step`, and what each may touch |
//! | `conclude.rs` | the one conclusion: a decision counted, what a refused request took given back, the record written, the reply built; the degraded-answer cache's answer for a refusal |
//! | `directive.rs` | what the host is asked to do: [`Directive`] and its constructors, [`Answer`], the names a host writes |
//! | `hold.rs` | the one holder of paused requests (the rate lane, the slot lanes) |
//! | `lease.rs` | a hot key's units in the worker's memory |
//! | `stream.rs`, `settle.rs` | a stream after its decision: its response, its meter and settlement, its end |
//! | `tick.rs` | the worker's tick |
//! | `limits.rs`, `failure.rs`, `events.rs` | the limits endpoint, the failure rule both hosts apply, the events a policy needs |
//!
//! # A request's path, top to bottom
//! On its **request headers** ([`Pipeline::on_request_headers`], `admit.rs`,
//! the stages of `stages.rs`, each returning a step: on, held, or done):
//! 1. **Classify and identify** ([`crate::engine::prepare`]): the route
//!    class from trusted route configuration, the tenant from the trusted
//!    identity, its plan. `mode: off` or no class: the request goes on.
//! 2. **Request checks** (a class with admission labels): the declared body
//!    size and the remaining timeout budget (413 / 503).
//! 3. **Retry budget**: a request a trusted signal marks as a retry takes
//!    its place in its dependency's budget (503 `retry_budget`).
//! 4. **Slots** ([`crate::admission::Worker::acquire`]): the dependency's
//!    `paused` and circuit breaker, then the tenant's share, the action's
//!    in-flight limit, the dependency's level. A `concurrency_limit` at a
//!    level with a queue **pauses** the request in the [`hold`]'s slot
//!    lane; other refusals answer 503 (or a degradable GET from the cache).
//! 5. **Rate limits** ([`crate::engine::charge_synced`]): every limit of
//!    the tenant's plan all or nothing, then the class's guard. A denial
//!    gives the slots of step 4 back at once; a 429 of a class with
//!    `on_limit: queue` **pauses** the request in the hold's rate lane. A
//!    class whose cost settles after the response is charged its estimate,
//!    on the exact path ([`settle`]).
//! 6. **Conclusion** (`conclude.rs`, the one place, for a request answered
//!    now, a held one answered from the tick and a resumed one): what a
//!    refused request took given back, the decision record written, a
//!    denial's local reply (status, `Retry-After`, the `RateLimit` headers,
//!    the problem body), or on its way with the `RateLimit` headers kept
//!    for its response; over a soft limit, marked for a fallback route (a
//!    [`RouteMark`]). Shadow mode is applied once for admission (a refusal
//!    counted and recorded, then on to the rate limits) and by the engine
//!    for the rate limits.
//!
//! On its **request body** ([`Pipeline::on_request_body`]): a body without
//! `content-length` counted against `max_body_bytes` (413).
//! On its **response** (`stream.rs`): the signal of an adaptive or breaker
//! dependency stamped, a degradable GET's 200 captured, the `RateLimit`
//! headers added; a settling class's meter fed, and its real cost settled
//! when the response ends ([`settle`]).
//! On its **end**, however it ends ([`Pipeline::on_stream_end`]): out of the
//! hold, a settling class's cost settled by its rule if its response never
//! completed, its slots back (exactly what it took), its outcome recorded
//! for the controller and the breaker, its captured answer stored.
//! On the worker's **tick** every 10 ms ([`Pipeline::on_tick`], `tick.rs`):
//! the pending stats given to the host, slot leases renewed, retry-budget
//! primaries folded, the hold served (slot lanes, then the rate lane: each
//! request admitted, resumed or answered), the adaptive controllers and
//! the breakers, the gauges.
//!
//! # One worker, one pipeline
//! A pipeline holds everything one worker keeps between callbacks: its
//! slots, its held requests, its streams' state, its signal windows, its
//! retry-budget primaries, its degraded-answer bookkeeping, its pending
//! stats. Node-wide state lives in the host's shared data behind
//! [`Host`], changed only through [`crate::table::update`]. Policies
//! belong to the host's configurations (several may share one worker);
//! each call names the one in force for its stream, and a held request
//! keeps the policy it was held under.
//!
//! # The events a policy needs
//! [`events()`] says which of these events a policy's requests can use (a
//! policy without admission, degraded answers, streamed bodies or
//! `RateLimit` headers needs no response and no stream end): a host that
//! can leave events out delivers only those (`policy apply` writes them
//! into Envoy's capability allow-list).
//!
//! Pure: the clock is the host's ([`Clock`]), read only when a step needs
//! it; everything else comes through [`Host`].

mod admit;
mod conclude;
pub mod directive;
pub mod events;
pub mod failure;
pub mod hold;
pub mod lease;
mod limits;
mod request;
pub mod settle;
mod stages;
mod stream;
mod tick;

use std::rc::Rc;

use hashbrown::HashMap;

use crate::admission::retry::Primaries;
use crate::admission::window::Windows;
use crate::admission::Worker;
use crate::engine::Scratch;
pub use crate::host::Clock;
use crate::host::Host;
use crate::policy::admission::RetryBudget;
use crate::policy::{Policy, PolicyErrors};
pub use crate::sync::syncer::Callout;
use crate::sync::syncer::{CalloutAnswer, Syncer};
use crate::sync::SyncState;
use crate::table;

use crate::stats::{self, Metric, Pending, Stats};
pub use directive::{
    Answer, BodyEdit, Chunk, Directive, RouteMark, Verdict, ACCEPT_ENCODING, CONTENT_LENGTH, IDENTITY,
    RECORD_PROPERTY,
};
pub use events::{events, Events};
pub use hold::Hold;
pub use request::{Read, Request};
pub use settle::{EndAnswer, ResponseBody};
pub use stream::ResponseHeaders;
use stream::Stream;

/// The host's id of a stream (Envoy's context id).
pub type StreamId = u32;

/// How often the host calls [`Pipeline::on_tick`], in nanoseconds.
pub const TICK_NS: u64 = 10_000_000;

/// What a worker remembers of a dependency some policy it loaded names:
/// for its gauges.
#[derive(Debug, Clone)]
struct Known {
    name: String,
    budget: Option<RetryBudget>,
    /// This worker's held requests as last added to the `queue_depth` gauge.
    reported_depth: u64,
    /// The value this worker last set `queue_oldest_ms` to.
    reported_oldest_ms: u64,
}

/// Most slots a worker remembers its last degraded store of (then it forgets all).
const MAX_REMEMBERED_STORES: usize = 65_536;

/// One worker's pipeline (see the module header).
#[derive(Debug, Default)]
pub struct Pipeline {
    /// Admission slots: registered on the first policy with admission
    /// control (its id comes from shared data), retried on the tick.
    worker: Option<Worker>,
    hold: Hold,
    /// Streams with something to do later (a slot, a signal, a capture,
    /// headers for the response, a body budget, a place in the hold).
    streams: HashMap<StreamId, Stream>,
    primaries: Primaries,
    windows: Windows,
    /// Degraded slot key → (cache key hash, when this worker last stored
    /// it): a key is stored at most once per `refresh` per worker.
    stored: HashMap<String, (u64, u64)>,
    scratch: Scratch,
    /// Hot keys' units in this worker's memory (see [`lease`]).
    leases: lease::Leases,
    control_buffers: table::Buffers,
    cache_buffers: table::Buffers,
    /// The node's sync state as last read: global limits decide with it.
    sync_view: Option<SyncState>,
    /// This worker's part in the node's sync with the central service.
    sync: Syncer,
    /// Sync reports for the host to send.
    callouts: Vec<Callout>,
    pending: Pending,
    /// Directives for other streams, for the host to apply.
    answers: Vec<Answer>,
    /// Dependency key → its gauges' bookkeeping, for every dependency of
    /// every policy this worker loaded (bounded by the policies).
    dependencies: HashMap<String, Known>,
    /// Action key → its name, for the `action_in_flight` gauges.
    actions: HashMap<String, String>,
    /// The age of the last degraded answer, for its gauge on the tick.
    last_degraded_age_ms: Option<u64>,
    ticks: u32,
}

impl Pipeline {
    /// Compiles a policy from its JSON (the host's plugin configuration) and
    /// prepares what it needs in shared data and in this worker. `Err`: the
    /// policy is refused and the host keeps the one in force.
    pub fn configure<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        stats: &mut dyn Stats,
        json: &[u8],
    ) -> Result<Rc<Policy>, PolicyErrors> {
        let mut policy = match Policy::from_json(json) {
            Ok(p) => p,
            Err(errors) => {
                stats.add(&Metric::ConfigRejections, 1);
                return Err(errors);
            }
        };
        let now = clock.now().unwrap_or(0);
        policy.effective_from_ns = now;
        self.prepare(host, &policy, now);
        self.sync.configure(host, &policy);
        for m in stats::policy_metrics(&policy) {
            stats.define(&m);
        }
        stats.add(&Metric::ConfigLoads, 1);
        Ok(Rc::new(policy))
    }

    /// Makes the shared entries `policy`'s admission control writes, the
    /// worker's id, and the bookkeeping of its dependencies' gauges.
    fn prepare<H: Host>(&mut self, host: &H, policy: &Policy, now: u64) {
        if policy.dependencies.is_empty() && policy.actions.is_empty() {
            return;
        }
        Worker::prepare(host, policy, now);
        self.ensure_worker(host, now);
        for d in &policy.dependencies {
            if let Some(window_ns) = d.signal_window_ns() {
                crate::admission::window::prepare(host, &d.name, window_ns, now);
            }
            let known = self.dependencies.entry(d.key.clone()).or_insert_with(|| Known {
                name: d.name.clone(),
                budget: None,
                reported_depth: 0,
                reported_oldest_ms: 0,
            });
            known.budget.clone_from(&d.retry_budget);
        }
        for a in &policy.actions {
            self.actions
                .entry(a.key.clone())
                .or_insert_with(|| a.name.clone());
        }
    }

    /// Registers this worker's admission id if it has none yet.
    fn ensure_worker<H: Host>(&mut self, host: &H, now: u64) {
        if self.worker.is_some() {
            return;
        }
        match Worker::register(host, now) {
            Ok(w) => self.worker = Some(w),
            Err(reason) => log::warn!("tenantgate: no admission worker id yet: {}", reason.as_str()),
        }
    }

    /// Directives for streams other than the current callback's, oldest
    /// first (the host applies each on its stream).
    pub fn take_answers(&mut self) -> Vec<Answer> {
        std::mem::take(&mut self.answers)
    }

    /// The host could not send a local reply the pipeline asked for
    /// (`tenantgate.reply_failures`).
    pub fn reply_failed(&mut self) {
        self.pending.rare(Metric::ReplyFailures);
    }

    /// Sync reports the tick made, for the host to send (then
    /// [`Pipeline::dispatched`]).
    pub fn take_callouts(&mut self) -> Vec<Callout> {
        std::mem::take(&mut self.callouts)
    }

    /// What the host did with a callout: `Ok(token)` sent, `Err` not.
    pub fn dispatched<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        stats: &mut dyn Stats,
        policy: &Policy,
        callout: &Callout,
        token: Result<u32, ()>,
    ) {
        let now = clock.now().unwrap_or(0);
        self.sync.dispatched(host, stats, policy, callout, token, now);
    }

    /// A sync callout's answer (see [`crate::sync::syncer`]).
    pub fn on_sync_answer<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        stats: &mut dyn Stats,
        policy: &Policy,
        token: u32,
        answer: &impl CalloutAnswer,
    ) {
        if let Some(view) = self.sync.on_answer(host, clock, stats, policy, token, answer) {
            self.sync_view = Some(view);
        }
    }

    /// Gives every pending count to `stats` (the host shuts the worker down).
    pub fn flush(&mut self, stats: &mut dyn Stats) {
        self.pending.flush(stats);
    }

    /// Streams the pipeline keeps state for (tests, stats).
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// Requests held (every lane).
    pub fn held(&self) -> usize {
        self.hold.len()
    }

    /// Units this worker holds in leases (tests, stats).
    pub fn leased_units(&self) -> u64 {
        self.leases.units()
    }

    /// Refusals this worker served from memory since its last tick.
    pub fn remembered_refusals(&self) -> u64 {
        self.leases.remembered()
    }

    /// This worker's admission slots (`None`: not registered yet).
    pub fn worker(&self) -> Option<&Worker> {
        self.worker.as_ref()
    }

    /// The node's sync view for a policy's global limits (`None` without).
    fn view(&self, policy: &Policy) -> Option<SyncState> {
        policy.sync.as_ref().and(self.sync_view)
    }

    /// Keeps a stream's state for its later callbacks (nothing, if it has
    /// none): taken out of `state`, moved only if it is kept.
    fn keep(&mut self, stream: StreamId, state: &mut Stream) {
        if !state.is_empty() {
            self.streams.insert(stream, std::mem::take(state));
        }
    }
}

#[cfg(test)]
mod flow_tests;
#[cfg(test)]
mod lease_reload_tests;
#[cfg(test)]
mod lease_tests;
#[cfg(test)]
mod probe_tests;
#[cfg(test)]
mod settle_tests;
#[cfg(test)]
mod tests;
