//! A request's decision on its headers (steps 1–6 of the module header of
//! [`super`]), and the answers of refused and held requests.
//!
//! Every refusal is counted (`tenantgate.decisions.<reason>`, and
//! `tenantgate.admission.<outcome>.<criticality>` for admission's), and a
//! class with admission labels gets a decision record. In `mode: shadow`
//! admission's refusals are counted and recorded, never enforced (no slot
//! is taken either), and nothing is held.

use std::rc::Rc;

use super::hold::{NotQueued, Paused, Read};
use super::lease::{NoClock, Now};
use super::stream::{Signal, Stream};
use super::{Answer, BodyEdit, Chunk, Clock, Directive, Pipeline, StreamId, Verdict};
use crate::admission::degraded::{self, Lookup};
use crate::admission::queue::{Held, NotHeld, Offered};
use crate::admission::request::{self, BodyBudget, Declared};
use crate::admission::{
    self, breaker, jittered_retry_after_secs, retry, DecisionRecord, Limited, Refusal, Ticket,
};
use crate::decision::{Decision, LimitName, Reason};
use crate::engine::{self, Prepared};
use crate::host::Host;
use crate::policy::admission::{Dependency, DEFAULT_RETRY_AFTER_WINDOW_NS};
use crate::policy::{Mode, Policy};
use crate::response::{self, LocalReply};
use crate::stats::DegradedStat;
use crate::stats::Metric;

/// What admission control decided for a request.
enum Admitted {
    /// On to the rate limits (with its slots, if it took any).
    Go,
    /// Paused in its dependency's slot lane.
    Held,
    /// Refused: answer with this decision.
    Refused(Decision),
    /// Refused (this decision, counted like any refusal), and answered 200
    /// from its class's degraded-answer cache.
    Degraded(LocalReply, Decision),
}

/// Where a refusal was decided, for its record.
struct Decided {
    in_flight: u32,
    queue_wait_ns: u64,
    limit: Option<LimitName>,
}

/// What the degraded-answer cache has for a refused request.
enum Degrade {
    /// Not a degradable read refused for a shedding reason: its refusal.
    No,
    /// The answer, and its age in milliseconds.
    Answer(LocalReply, u64),
    /// No answer fresh enough: 503 `dependency_unavailable`.
    Unavailable,
}

impl Pipeline {
    /// A request's headers: its whole decision (steps 1–6 of the module
    /// header). `policy` is the one in force for the stream. With soft
    /// limits, the directive also carries the request's routing marker
    /// (see [`super::settle`]).
    pub fn on_request_headers<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        policy: &Rc<Policy>,
        stream: StreamId,
    ) -> Directive {
        let client_copy = policy.has_soft_limits && host.request_header(&policy.soft_limit_header).is_some();
        let mut metered = false;
        let mut directive = self.decide_headers(host, clock, policy, stream, &mut metered);
        // A metered request's answer is read for its usage: uncompressed.
        directive.identity_encoding = metered && !matches!(directive.verdict, Verdict::Reply(_));
        if directive.verdict == Verdict::Continue && self.start_rewrite(host, stream) {
            directive.body = BodyEdit::Unsized;
        }
        let soft = self
            .streams
            .get(&stream)
            .and_then(|s| s.soft.as_ref())
            .map(|(_, limit)| limit.as_str());
        Self::route_mark(policy, &mut directive, soft, client_copy);
        directive
    }

    /// [`Pipeline::on_request_headers`]'s decision (`metered`: the request
    /// is in a settled class's metered operation).
    fn decide_headers<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        policy: &Rc<Policy>,
        stream: StreamId,
        metered: &mut bool,
    ) -> Directive {
        let mut state = Stream::default();
        if policy.limits_endpoint.is_some()
            && super::limits::is_endpoint(policy, host.request_header(":path").as_deref())
        {
            return self.answer_limits(host, clock, policy);
        }
        let mut prepared = match engine::prepare(policy, host) {
            Ok(p) => p,
            Err(reason) => return self.finish(host, policy, stream, state, Decision::passed(reason), None),
        };
        state.input_estimate = Self::estimate(host, policy, &mut prepared);
        *metered = prepared.class.settle.is_some() && prepared.cost > 0;
        let mut now = Now::new(clock);
        let mut record = None;
        if prepared.class.labels.checks_anything() {
            let Some(at) = now.get() else {
                return self.finish(host, policy, stream, state, Decision::unavailable(), None);
            };
            match self.admit(host, policy, &prepared, stream, &mut state, &mut record, at) {
                Admitted::Go => {}
                Admitted::Held => {
                    state.held = true;
                    self.keep(stream, state);
                    return Directive::pause(record);
                }
                Admitted::Refused(decision) => {
                    return self.finish(host, policy, stream, state, decision, record)
                }
                Admitted::Degraded(reply, decision) => {
                    self.pending.decision(&decision);
                    return Directive::reply(reply, record);
                }
            }
        }
        let decision = match self.charge(host, policy, &prepared, &mut now) {
            Ok(d) => d,
            Err(NoClock) => Decision::unavailable(),
        };
        // A denial read the clock (only an admission from a lease does not).
        let now = now.read().unwrap_or(0);
        if decision.deny_status().is_some() {
            // A rate-limit denial gives its slots (and a probe ticket) back
            // at once: the request never reaches the dependency.
            if let Some(ticket) = state.ticket.take() {
                self.cancel(host, ticket, now);
            }
            state.signal = None;
            state.capture = None;
        } else {
            self.count_probe(policy, &prepared, state.ticket.as_ref());
            self.start_settling(policy, &prepared, &decision, now, &mut state);
            if decision.reason == Reason::SoftLimited {
                let at = Decided {
                    in_flight: state.ticket.as_ref().map_or(0, Ticket::in_flight),
                    queue_wait_ns: 0,
                    limit: decision.limit.clone(),
                };
                record = Some(self.record(policy, &prepared, Some(Reason::SoftLimited), &at, now, None));
            }
        }
        if decision.deny_status() == Some(429) {
            let paused = paused(host, policy, &prepared, stream, false);
            match self.hold.offer_rate(paused, &decision, now) {
                Ok(()) => {
                    self.pending.rare(Metric::QueueHeld);
                    state.held = true;
                    self.keep(stream, state);
                    return Directive::pause(record);
                }
                Err(NotQueued::Full) => self.pending.rare(Metric::QueueFull),
                Err(_) => {}
            }
        }
        self.finish(host, policy, stream, state, decision, record)
    }

    /// Counts a streamed request body's chunk against `max_body_bytes`,
    /// reads a settling class's estimate from it, and keeps it for a body
    /// asking for its usage (see [`super::settle`]).
    pub fn on_request_body<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        policy: &Policy,
        stream: StreamId,
        chunk: impl Into<Chunk>,
    ) -> Directive {
        let chunk = chunk.into();
        let bytes = chunk.len;
        let estimating = self
            .streams
            .get(&stream)
            .and_then(|s| s.settling.as_ref())
            .is_some_and(|s| s.estimates_from_body());
        if estimating {
            let now = clock.now().unwrap_or(0);
            if let Some(refused) = self.settling_body(host, policy, stream, chunk, now) {
                if let Some(mut state) = self.streams.remove(&stream) {
                    if let Some(ticket) = state.ticket.take() {
                        self.cancel(host, ticket, now);
                    }
                    state.signal = None;
                    state.capture = None;
                    state.headers = None;
                    self.keep(stream, state);
                }
                return refused;
            }
        }
        let Some(state) = self.streams.get_mut(&stream) else {
            return Directive::go();
        };
        let level = state.level;
        let Some(budget) = state.body.as_mut() else {
            return self.rewrite_body(host, stream, chunk);
        };
        let Err(reason) = budget.add(u64::try_from(bytes).unwrap_or(u64::MAX)) else {
            return self.rewrite_body(host, stream, chunk);
        };
        state.body = None;
        self.pending.admission(Some(reason), level);
        let decision = Decision {
            retry_after_secs: 1,
            ..Decision::passed(reason)
        };
        let state = self.streams.remove(&stream).unwrap_or_default();
        self.finish(host, policy, stream, state, decision, None)
    }

    /// Counts a decision and turns it into the stream's directive: a
    /// denial's local reply (with the request's id), or on its way with its
    /// `RateLimit` headers kept for the response.
    fn finish<H: Host>(
        &mut self,
        host: &H,
        policy: &Policy,
        stream: StreamId,
        mut state: Stream,
        decision: Decision,
        record: Option<String>,
    ) -> Directive {
        self.pending.decision(&decision);
        if decision.deny_status().is_some() {
            // tenantgate answers: not a health signal of the upstream.
            state.signal = None;
            state.capture = None;
            // Only a denial echoes the request id: read it only then.
            let raw = host.request_header("x-request-id");
            let request_id = response::request_id(raw.as_deref());
            let reply =
                response::local_reply(&decision, &policy.version, policy.ratelimit_headers, request_id);
            self.keep(stream, state);
            if let Some(reply) = reply {
                return Directive::reply(reply, record);
            }
            return Directive::of(Verdict::Continue, record);
        }
        if policy.ratelimit_headers {
            state.headers = decision.headers;
        }
        self.keep(stream, state);
        Directive::of(Verdict::Continue, record)
    }

    /// Checks and charges a prepared request's rate limits: from the
    /// worker's lease of its key if it has one ([`super::lease`]), else
    /// with the node's entry, taking a lease if the key is hot. A class
    /// whose cost settles after the response is charged on the exact path
    /// (no lease spent or taken, no refusal remembered: a settlement may
    /// change the key's standing at any moment; see [`crate::cost`]).
    pub(super) fn charge<H: Host>(
        &mut self,
        host: &H,
        policy: &Rc<Policy>,
        prepared: &Prepared,
        now: &mut Now<'_, impl Clock>,
    ) -> Result<Decision, NoClock> {
        if let Some(d) = super::settle::unmetered(prepared) {
            return Ok(d);
        }
        if prepared.class.settle.is_some() {
            let at = now.get().ok_or(NoClock)?;
            let view = self.view(policy);
            return Ok(engine::charge_leased(
                policy,
                prepared,
                host,
                at,
                view.as_ref(),
                prepared.cost,
                &mut self.scratch,
            ));
        }
        let Pipeline {
            leases,
            scratch,
            sync_view,
            ..
        } = self;
        leases.charge(policy, prepared, now, |at, want| {
            // Global limits decide with the node's sync view; limits that
            // are not global never look at it.
            let view = policy.sync.as_ref().and(*sync_view);
            engine::charge_leased(policy, prepared, host, at, view.as_ref(), want, scratch)
        })
    }

    /// Admission control for a request of a class with admission labels
    /// (steps 2–4): `record` gets its decision record.
    #[allow(clippy::too_many_arguments)]
    fn admit<H: Host>(
        &mut self,
        host: &H,
        policy: &Rc<Policy>,
        prepared: &Prepared,
        stream: StreamId,
        state: &mut Stream,
        record: &mut Option<String>,
        now: u64,
    ) -> Admitted {
        let labels = prepared.class.labels;
        let level = labels.criticality;
        state.level = level;
        let shadow = policy.mode == Mode::Shadow;
        let declared = Declared::read(
            host.request_header("content-length").as_deref(),
            labels
                .min_timeout_budget_ns
                .and(host.request_header(request::EXPECTED_TIMEOUT_HEADER))
                .as_deref(),
        );
        if let Err(reason) = request::check(&labels, &declared) {
            self.pending.admission(Some(reason), level);
            *record = Some(self.record(policy, prepared, Some(reason), &Decided::nowhere(), now, None));
            if shadow {
                return Admitted::Go;
            }
            return Admitted::Refused(Decision {
                retry_after_secs: 1,
                subject: prepared.subject.clone(),
                ..Decision::passed(reason)
            });
        }
        if declared.content_length.is_none() && !shadow {
            state.body = BodyBudget::of(&labels);
        }
        let dep = labels.dependency.and_then(|i| policy.dependency(i));
        if dep.is_none() && labels.action_limit.is_none() {
            *record = Some(self.record(policy, prepared, None, &Decided::nowhere(), now, None));
            return Admitted::Go;
        }
        let budget = dep.and_then(|d| d.retry_budget.as_ref());
        let is_retry = budget.is_some_and(|b| retry::is_retry(b, host));
        if let (Some(b), Some(d), true) = (budget, dep, is_retry) {
            if let Err(refused) = self.primaries.take_retry(host, b, now) {
                return self.refuse_retry(host, policy, prepared, d, refused, stream, record, now);
            }
            self.count_retry(&d.name);
        }
        let primary = budget.is_some() && !is_retry;
        let acquired = match self.worker.as_mut() {
            Some(w) => w.acquire(host, policy, &prepared.class, &prepared.subject, now),
            None => Err(Refusal::unavailable(dep)),
        };
        match acquired {
            Ok(ticket) => {
                let read = read_of(host, prepared);
                self.admitted(policy, prepared, state, ticket, primary, read.as_ref(), now);
                let in_flight = state.ticket.as_ref().map_or(0, Ticket::in_flight);
                let at = Decided {
                    in_flight,
                    queue_wait_ns: 0,
                    limit: None,
                };
                *record = Some(self.record(policy, prepared, None, &at, now, None));
                Admitted::Go
            }
            Err(refusal) => self.refused_slot(host, policy, prepared, stream, refusal, primary, record, now),
        }
    }

    /// A request admitted to its slots (on its headers, or from the hold):
    /// counted, its primary noted, its signal started, its capture planned
    /// (`read`: a degradable request's method and path).
    #[allow(clippy::too_many_arguments)]
    fn admitted(
        &mut self,
        policy: &Policy,
        prepared: &Prepared,
        state: &mut Stream,
        ticket: Option<Ticket>,
        primary: bool,
        read: Option<&Read>,
        now: u64,
    ) {
        self.pending.admission(None, prepared.class.labels.criticality);
        let dep = prepared
            .class
            .labels
            .dependency
            .and_then(|i| policy.dependency(i));
        if let (true, Some(b)) = (primary, dep.and_then(|d| d.retry_budget.as_ref())) {
            self.primaries.note(b);
        }
        if let Some(t) = &ticket {
            state.signal = Signal::start(policy, prepared, t, now);
        }
        if let Some(read) = read {
            state.capture = self.plan_capture(prepared, read, now);
        }
        state.ticket = ticket;
    }

    /// A retry its budget refused (or could not count).
    #[allow(clippy::too_many_arguments)]
    fn refuse_retry<H: Host>(
        &mut self,
        host: &H,
        policy: &Policy,
        prepared: &Prepared,
        dep: &Dependency,
        refused: retry::RetryRefusal,
        stream: StreamId,
        record: &mut Option<String>,
        now: u64,
    ) -> Admitted {
        let reason = refused.reason;
        self.pending
            .admission(Some(reason), prepared.class.labels.criticality);
        let at = Decided {
            in_flight: 0,
            queue_wait_ns: 0,
            limit: Some(LimitName::Dependency(dep.name.clone())),
        };
        if policy.mode == Mode::Shadow {
            // Counted and recorded, never enforced (like every shadow
            // refusal: no slot is taken either).
            *record = Some(self.record(policy, prepared, Some(reason), &at, now, None));
            return Admitted::Go;
        }
        let decision = refusal_decision(
            reason,
            LimitName::Dependency(dep.name.clone()),
            refused.retry_after_secs,
            dep.retry_after_window_ns,
            prepared,
            stream,
            now,
        );
        let read = read_of(host, prepared);
        self.refuse(host, policy, prepared, decision, &at, read.as_ref(), record, now)
    }

    /// A request refused a slot: held in its level's slot lane if it has
    /// one and the refusal is `concurrency_limit`, else answered.
    #[allow(clippy::too_many_arguments)]
    fn refused_slot<H: Host>(
        &mut self,
        host: &H,
        policy: &Rc<Policy>,
        prepared: &Prepared,
        stream: StreamId,
        refusal: Refusal,
        primary: bool,
        record: &mut Option<String>,
        now: u64,
    ) -> Admitted {
        let level = prepared.class.labels.criticality;
        let shadow = policy.mode == Mode::Shadow;
        let dep = prepared
            .class
            .labels
            .dependency
            .and_then(|i| policy.dependency(i));
        let mut reason = refusal.reason;
        // A dependency's queue holds a request refused by its action's
        // limit too: the tick retries the whole acquire.
        let queue = dep
            .and_then(|d| d.queues.get(level.index()).copied().map(|q| (d, q)))
            .filter(|(_, q)| reason == Reason::ConcurrencyLimit && !shadow && q.max_queue > 0);
        if let Some((dep, queue)) = queue {
            let held = Held {
                item: paused(host, policy, prepared, stream, primary),
                level,
                tenant: crate::table::fnv1a64(admission::tenant_key(&dep.name, &prepared.subject).as_bytes()),
                enqueued: now,
                deadline: now.saturating_add(queue.max_wait_ns),
            };
            match self.hold.offer_slot(&dep.key, held, queue.max_queue) {
                Ok(offered) => {
                    self.pending.queued(level);
                    if let Offered::Displaced(dropped) = offered {
                        self.fair_drop(host, dropped, now);
                    }
                    return Admitted::Held;
                }
                Err(NotHeld::Full) => reason = Reason::QueueFull,
                Err(NotHeld::NoQueue) => {}
            }
        }
        self.pending.admission(Some(reason), level);
        if refusal.limit == Limited::Dependency {
            self.note_refused(policy, prepared, reason, now);
        }
        let limited = limit_name(policy, prepared, refusal.limit);
        let at = Decided {
            in_flight: refusal.in_flight,
            queue_wait_ns: 0,
            limit: Some(limited.clone()),
        };
        if shadow {
            *record = Some(self.record(policy, prepared, Some(reason), &at, now, None));
            return Admitted::Go;
        }
        let decision = refusal_decision(
            reason,
            limited,
            refusal.retry_after_secs,
            refusal.retry_after_window_ns,
            prepared,
            stream,
            now,
        );
        let read = read_of(host, prepared);
        self.refuse(host, policy, prepared, decision, &at, read.as_ref(), record, now)
    }

    /// A request dropped from the longest tenant line of a full level:
    /// 503 `queue_full`, counted in its tenant's bucket.
    fn fair_drop<H: Host>(&mut self, host: &H, dropped: Held<Paused>, now: u64) {
        let bucket = dropped.tenant % crate::stats::FAIR_DROP_BUCKETS as u64;
        self.pending
            .rare(Metric::FairDrop(u8::try_from(bucket).unwrap_or(0)));
        self.pending.admission(Some(Reason::QueueFull), dropped.level);
        self.answer_held(host, dropped, Reason::QueueFull, 1, now);
    }

    /// Answers a held request with a refusal on its own stream (as an
    /// [`Answer`]); `min_secs`: the refusal's shortest honest `Retry-After`.
    pub(super) fn answer_held<H: Host>(
        &mut self,
        host: &H,
        h: Held<Paused>,
        reason: Reason,
        min_secs: u64,
        now: u64,
    ) {
        let p = h.item;
        let stream = p.stream;
        if let Some(s) = self.streams.get_mut(&stream) {
            s.held = false;
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
        self.note_refused(&p.policy, &p.prepared, reason, now);
        let limited = limit_name(&p.policy, &p.prepared, Limited::Dependency);
        let decision = refusal_decision(
            reason,
            limited.clone(),
            min_secs,
            dep.retry_after_window_ns,
            &p.prepared,
            stream,
            now,
        );
        // Its record's in-flight count: the dependency's, as it is now.
        let live = admission::in_flight(host, &dep.key, now).map_or(0, |c| c.total());
        let at = Decided {
            in_flight: live,
            queue_wait_ns: now.saturating_sub(h.enqueued),
            limit: Some(limited),
        };
        let mut record = None;
        let directive = match self.refuse(
            host,
            &p.policy,
            &p.prepared,
            decision,
            &at,
            p.read.as_ref(),
            &mut record,
            now,
        ) {
            Admitted::Degraded(reply, decision) => {
                self.pending.decision(&decision);
                Directive::reply(reply, record)
            }
            Admitted::Refused(decision) => {
                self.pending.decision(&decision);
                let request_id = response::request_id(p.request_id.as_deref());
                match response::local_reply(
                    &decision,
                    &p.policy.version,
                    p.policy.ratelimit_headers,
                    request_id,
                ) {
                    Some(reply) => Directive::reply(reply, record),
                    None => return,
                }
            }
            Admitted::Go | Admitted::Held => return,
        };
        self.answers.push(Answer { stream, directive });
    }

    /// A refusal's answer: for a degradable read refused for a shedding
    /// reason, the cached answer or 503 `dependency_unavailable`; else the
    /// refusal. Writes the decision record with the final outcome.
    #[allow(clippy::too_many_arguments)]
    fn refuse<H: Host>(
        &mut self,
        host: &H,
        policy: &Policy,
        prepared: &Prepared,
        decision: Decision,
        at: &Decided,
        read: Option<&Read>,
        record: &mut Option<String>,
        now: u64,
    ) -> Admitted {
        let reason = decision.reason;
        match self.degrade(host, prepared, reason, read, now) {
            Degrade::No => {
                *record = Some(self.record(policy, prepared, Some(reason), at, now, None));
                Admitted::Refused(decision)
            }
            Degrade::Answer(reply, age_ms) => {
                *record = Some(self.record(policy, prepared, Some(reason), at, now, Some(age_ms)));
                Admitted::Degraded(reply, decision)
            }
            Degrade::Unavailable => {
                let unavailable = Reason::DependencyUnavailable;
                *record = Some(self.record(policy, prepared, Some(unavailable), at, now, None));
                Admitted::Refused(Decision {
                    reason: unavailable,
                    ..decision
                })
            }
        }
    }

    /// Looks a refused request up in its class's degraded-answer cache.
    fn degrade<H: Host>(
        &mut self,
        host: &H,
        prepared: &Prepared,
        reason: Reason,
        read: Option<&Read>,
        now: u64,
    ) -> Degrade {
        let (Some(deg), Some(read)) = (prepared.class.degradable.as_ref(), read) else {
            return Degrade::No;
        };
        // A write is never answered from the cache: it gets its refusal.
        if !degraded::serves(reason) || !degraded::readable(&read.method) {
            return Degrade::No;
        }
        let Some(key) = degraded::cache_key(deg, &prepared.subject, &read.path) else {
            return Degrade::No;
        };
        match degraded::lookup(host, deg, &key, now) {
            Lookup::Fresh(cached) => {
                let age_ms = now.saturating_sub(cached.captured_at) / 1_000_000;
                self.pending.degraded(DegradedStat::Answered);
                self.pending.degraded(DegradedStat::age(age_ms));
                self.last_degraded_age_ms = Some(age_ms);
                Degrade::Answer(
                    degraded::reply(&cached, reason, now, read.method == b"HEAD"),
                    age_ms,
                )
            }
            Lookup::Stale { .. } => {
                self.pending.degraded(DegradedStat::Unavailable);
                self.pending.degraded(DegradedStat::Stale);
                Degrade::Unavailable
            }
            Lookup::Miss => {
                self.pending.degraded(DegradedStat::Unavailable);
                self.pending.degraded(DegradedStat::Miss);
                Degrade::Unavailable
            }
        }
    }

    /// A request's decision record (see [`DecisionRecord`]).
    fn record(
        &self,
        policy: &Policy,
        prepared: &Prepared,
        outcome: Option<Reason>,
        at: &Decided,
        now: u64,
        degraded_age_ms: Option<u64>,
    ) -> String {
        let labels = prepared.class.labels;
        let dep = labels.dependency.and_then(|i| policy.dependency(i));
        let control = |d: &Dependency| {
            self.worker
                .as_ref()
                .map(|w| w.control(&d.key))
                .unwrap_or_default()
        };
        let controller_limit = dep
            .filter(|d| d.adaptive.is_some())
            .map(|d| admission::effective_limit(d, &control(d)));
        let breaker = dep.and_then(|d| {
            let settings = d.breaker.as_ref()?;
            let phase = control(d)
                .breaker
                .map_or(breaker::Phase::Closed, |b| b.phase_at(settings, now));
            Some(phase.as_str())
        });
        let key = crate::decision::logical_key(&prepared.class.action, &prepared.subject);
        let limit = at
            .limit
            .as_ref()
            .map_or_else(|| String::from("-"), LimitName::record_name);
        DecisionRecord {
            outcome: outcome.map_or("admitted", Reason::as_str),
            criticality: labels.criticality,
            dependency: dep.map_or("-", |d| d.name.as_str()),
            in_flight: at.in_flight,
            queue_wait_ms: at.queue_wait_ns / 1_000_000,
            policy_version: &policy.version,
            limit_key: &key,
            limit: &limit,
            breaker,
            controller_limit,
            degraded_age_ms,
        }
        .render()
    }

    /// A held request got its slot on the tick: charged its rate limits,
    /// then resumed (or answered, if a rate limit denies it now).
    pub(super) fn resume_admitted<H: Host>(
        &mut self,
        host: &H,
        h: Held<Paused>,
        ticket: Option<Ticket>,
        now: u64,
    ) {
        let p = h.item;
        let mut state = self.streams.remove(&p.stream).unwrap_or_default();
        state.held = false;
        self.admitted(
            &p.policy,
            &p.prepared,
            &mut state,
            ticket,
            p.primary,
            p.read.as_ref(),
            now,
        );
        let at = Decided {
            in_flight: state.ticket.as_ref().map_or(0, Ticket::in_flight),
            queue_wait_ns: now.saturating_sub(h.enqueued),
            limit: None,
        };
        let record = Some(self.record(&p.policy, &p.prepared, None, &at, now, None));
        let decision = super::settle::unmetered(&p.prepared).unwrap_or_else(|| {
            engine::charge_synced(
                &p.policy,
                &p.prepared,
                host,
                now,
                self.view(&p.policy).as_ref(),
                &mut self.scratch,
            )
        });
        self.resume_charged(host, p, state, decision, record, now);
    }

    /// A held request whose rate limits were charged on the tick: resumed
    /// if they admit it, else answered (429, or the limit's refusal).
    pub(super) fn resume_charged<H: Host>(
        &mut self,
        host: &H,
        p: Paused,
        mut state: Stream,
        decision: Decision,
        record: Option<String>,
        now: u64,
    ) {
        state.held = false;
        self.pending.decision(&decision);
        let mut directive =
            match response::local_reply(&decision, &p.policy.version, p.policy.ratelimit_headers, None) {
                Some(reply) => {
                    if let Some(ticket) = state.ticket.take() {
                        self.cancel(host, ticket, now);
                    }
                    state.signal = None;
                    state.capture = None;
                    Directive::reply(reply, record)
                }
                None => {
                    self.count_probe(&p.policy, &p.prepared, state.ticket.as_ref());
                    self.start_settling(&p.policy, &p.prepared, &decision, now, &mut state);
                    if p.policy.ratelimit_headers {
                        state.headers = decision.headers.clone();
                    }
                    Directive::of(Verdict::Continue, record)
                }
            };
        // A client's own marker was removed when it was held.
        let soft = state.soft.as_ref().map(|(_, limit)| limit.as_str());
        Self::route_mark(&p.policy, &mut directive, soft, false);
        self.keep(p.stream, state);
        self.answers.push(Answer {
            stream: p.stream,
            directive,
        });
    }
}

impl Decided {
    /// A refusal by a request check, or an admission: no slot, no limit.
    fn nowhere() -> Decided {
        Decided {
            in_flight: 0,
            queue_wait_ns: 0,
            limit: None,
        }
    }
}

impl Refusal {
    /// No worker id yet (shared data refused it): nothing is admitted.
    fn unavailable(dep: Option<&Dependency>) -> Refusal {
        Refusal {
            reason: Reason::StateUnavailable,
            in_flight: 0,
            retry_after_window_ns: dep.map_or(DEFAULT_RETRY_AFTER_WINDOW_NS, |d| d.retry_after_window_ns),
            retry_after_secs: 1,
            limit: Limited::Dependency,
        }
    }
}

/// What a held request needs read now (its answer comes from the tick).
fn paused<H: Host>(
    host: &H,
    policy: &Rc<Policy>,
    prepared: &Prepared,
    stream: StreamId,
    primary: bool,
) -> Paused {
    Paused {
        stream,
        policy: policy.clone(),
        prepared: prepared.clone(),
        primary,
        request_id: host.request_header("x-request-id"),
        read: read_of(host, prepared),
    }
}

/// A degradable class's request method and path (`None` for other classes:
/// nothing is read).
fn read_of<H: Host>(host: &H, prepared: &Prepared) -> Option<Read> {
    prepared.class.degradable.as_ref()?;
    Some(Read {
        method: host.request_header(":method").unwrap_or_default(),
        path: host.request_header(":path").unwrap_or_default(),
    })
}

/// What refused a slot, typed.
fn limit_name(policy: &Policy, prepared: &Prepared, limit: Limited) -> LimitName {
    let dependency = || {
        prepared
            .class
            .labels
            .dependency
            .and_then(|i| policy.dependency(i))
            .map_or_else(|| String::from("-"), |d| d.name.clone())
    };
    match limit {
        Limited::Action => LimitName::Action(prepared.class.action.clone()),
        Limited::Dependency => LimitName::Dependency(dependency()),
        Limited::Tenant => LimitName::Tenant(dependency()),
    }
}

/// A refusal's decision, with its jittered `Retry-After` (at least
/// `min_secs`, spread over the dependency's `retry_after_window`).
fn refusal_decision(
    reason: Reason,
    limit: LimitName,
    min_secs: u64,
    window_ns: u64,
    prepared: &Prepared,
    stream: StreamId,
    now: u64,
) -> Decision {
    let seed = now ^ (u64::from(stream) << 32);
    Decision {
        limit: Some(limit),
        retry_after_secs: jittered_retry_after_secs(min_secs, window_ns, seed),
        subject: prepared.subject.clone(),
        ..Decision::passed(reason)
    }
}
