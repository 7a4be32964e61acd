//! A request's decision, driven: on its headers (steps 1–6 of the module
//! header of [`super`]: classify, then the stages of [`super::stages`] in
//! order, then [`Pipeline::conclude`]), on its body (`max_body_bytes`, a
//! settling class's estimate), and for a held request answered or resumed
//! from the tick.
//!
//! Every refusal is counted (`tenantgate.decisions.<reason>`, and
//! `tenantgate.admission.<outcome>.<criticality>` for admission's), and a
//! class with admission labels gets a decision record. In `mode: shadow`
//! admission's refusals are counted and recorded, never enforced (no slot
//! is taken either), and nothing is held.

use std::rc::Rc;

use super::conclude::refusal_decision;
use super::lease::{NoClock, Now};
use super::request::{Decided, Outcome, Req, Request, Step};
use super::stages::limit_name;
use super::stream::Stream;
use super::{Answer, BodyEdit, Chunk, Clock, Directive, Pipeline, StreamId, Verdict};
use crate::admission::queue::Held;
use crate::admission::{self, Limited, Ticket};
use crate::decision::{Decision, Reason};
use crate::engine;
use crate::host::Host;
use crate::policy::admission::DEFAULT_RETRY_AFTER_WINDOW_NS;
use crate::policy::Policy;

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
        self.mark(policy, stream, &mut directive, client_copy);
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
        if policy.limits_endpoint.is_some()
            && super::limits::is_endpoint(policy, host.request_header(":path").as_deref())
        {
            return self.answer_limits(host, clock, policy);
        }
        let mut prepared = match engine::prepare(policy, host) {
            Ok(p) => p,
            Err(reason) => {
                let decision = Decision::passed(reason);
                let request_id = decision
                    .deny_status()
                    .and_then(|_| host.request_header("x-request-id"));
                return self.answer(policy, stream, &mut Stream::default(), decision, None, request_id);
            }
        };
        let input_estimate = Self::estimate(host, policy, &mut prepared);
        *metered = prepared.class.settle.is_some() && prepared.cost > 0;
        let mut req = Req::on_headers(Request::read(host, policy, prepared, stream));
        req.took.input_estimate = input_estimate;
        let mut now = Now::new(clock);
        if req.ask.prepared.class.labels.checks_anything() {
            let Some(at) = now.get() else {
                return self.conclude(host, &mut req, Outcome::Decided(Decision::unavailable()), 0);
            };
            match self.admission(host, &mut req, at) {
                Step::Next | Step::Limits => {}
                Step::Hold => return self.paused(&mut req),
                Step::Done(outcome) => return self.conclude(host, &mut req, *outcome, at),
            }
        }
        let decision = match self.rate_limits(host, &req, &mut now) {
            Ok(d) => d,
            Err(NoClock) => Decision::unavailable(),
        };
        // A denial read the clock (only an admission from a lease does not).
        let now = now.read().unwrap_or(0);
        if decision.deny_status().is_some() {
            // A rate-limit denial gives its slots (and a probe ticket) back
            // at once, held or not: the request never reaches the dependency.
            self.give_back(host, &mut req.took, now);
            if let Step::Hold = self.hold_rate(host, &req, &decision, now) {
                return self.paused(&mut req);
            }
        }
        self.conclude(host, &mut req, Outcome::Decided(decision), now)
    }

    /// A request a stage put in the hold: its state kept, the stream paused.
    fn paused(&mut self, req: &mut Req) -> Directive {
        req.took.held = true;
        self.keep(req.ask.stream, &mut req.took);
        Directive::pause(req.record.take())
    }

    /// The routing marker of the stream's directive (see
    /// [`Pipeline::route_mark`]).
    fn mark(&self, policy: &Policy, stream: StreamId, directive: &mut Directive, client_copy: bool) {
        let soft = self
            .streams
            .get(&stream)
            .and_then(|s| s.soft.as_ref())
            .map(|(_, limit)| limit.as_str());
        Self::route_mark(policy, directive, soft, client_copy);
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
            if let Some(decision) = self.settling_body(host, stream, chunk, now) {
                // Its estimate grew past what its limits admit: refused
                // before its body reached the upstream.
                let mut took = self.streams.remove(&stream).unwrap_or_default();
                self.give_back(host, &mut took, now);
                took.headers = None;
                let request_id = host.request_header("x-request-id");
                return self.answer(policy, stream, &mut took, decision, None, request_id);
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
        let mut took = self.streams.remove(&stream).unwrap_or_default();
        let request_id = host.request_header("x-request-id");
        self.answer(policy, stream, &mut took, decision, None, request_id)
    }

    /// Answers a held request with a refusal on its own stream (as an
    /// [`Answer`]); `min_secs`: the refusal's shortest honest `Retry-After`.
    pub(super) fn answer_held<H: Host>(
        &mut self,
        host: &H,
        h: Held<Request>,
        reason: Reason,
        min_secs: u64,
        now: u64,
    ) {
        let took = self.streams.remove(&h.item.stream).unwrap_or_default();
        let mut req = Req::resumed(h.item, took, h.enqueued, now);
        // A queue is its dependency's: it names what refused.
        self.note_refused(&req.ask.policy, &req.ask.prepared, reason, now);
        let window_ns = req
            .ask
            .dependency()
            .map_or(DEFAULT_RETRY_AFTER_WINDOW_NS, |d| d.retry_after_window_ns);
        // Its record's in-flight count: the dependency's, as it is now.
        let live = req
            .ask
            .dependency()
            .and_then(|d| admission::in_flight(host, &d.key, now))
            .map_or(0, |c| c.total());
        let limited = limit_name(&req.ask, Limited::Dependency);
        let at = Decided {
            in_flight: live,
            queue_wait_ns: req.waited_ns,
            limit: Some(limited.clone()),
        };
        let decision = refusal_decision(reason, limited, min_secs, window_ns, &req.ask, now);
        let outcome = self.refuse(host, &mut req, decision, &at, now);
        let stream = req.ask.stream;
        let directive = self.conclude(host, &mut req, outcome, now);
        self.answers.push(Answer { stream, directive });
    }

    /// A held request got its slot on the tick: charged its rate limits,
    /// then resumed (or answered, if a rate limit denies it now).
    pub(super) fn resume_admitted<H: Host>(
        &mut self,
        host: &H,
        h: Held<Request>,
        ticket: Option<Ticket>,
        now: u64,
    ) {
        let took = self.streams.remove(&h.item.stream).unwrap_or_default();
        let mut req = Req::resumed(h.item, took, h.enqueued, now);
        self.admitted(&mut req, ticket, now);
        let at = Decided {
            in_flight: req.took.ticket.as_ref().map_or(0, Ticket::in_flight),
            queue_wait_ns: req.waited_ns,
            limit: None,
        };
        req.record = Some(self.record(&req, None, &at, now, None));
        let decision = super::settle::unmetered(&req.ask.prepared).unwrap_or_else(|| {
            engine::charge_synced(
                &req.ask.policy,
                &req.ask.prepared,
                host,
                now,
                self.view(&req.ask.policy).as_ref(),
                &mut self.scratch,
            )
        });
        self.resume(host, req, decision, now);
    }

    /// A request of the rate lane charged on the tick: resumed if its
    /// limits admit it, else answered (429).
    pub(super) fn resume_charged<H: Host>(&mut self, host: &H, ask: Request, decision: Decision, now: u64) {
        let took = self.streams.remove(&ask.stream).unwrap_or_default();
        // Its wait is not in a record: a rate-lane request has none but its
        // admission's, written on its headers.
        let req = Req::resumed(ask, took, now, now);
        self.resume(host, req, decision, now);
    }

    /// A held request's rate-limit decision, concluded and sent on its own
    /// stream.
    fn resume<H: Host>(&mut self, host: &H, mut req: Req, decision: Decision, now: u64) {
        let stream = req.ask.stream;
        let policy = Rc::clone(&req.ask.policy);
        let mut directive = self.conclude(host, &mut req, Outcome::Decided(decision), now);
        // A client's own marker was removed when it was held.
        self.mark(&policy, stream, &mut directive, false);
        self.answers.push(Answer { stream, directive });
    }
}
