//! The stages of a request's decision on its headers, in order: each takes
//! the request's context ([`Req`]) and returns a [`Step`]; what a stage may
//! touch is its row here, nothing else.
//!
//! | stage | reads | may change |
//! |---|---|---|
//! | [`checks`](Pipeline::checks) | the declared body size, the timeout budget | `took.level`, `took.body` |
//! | [`retry`](Pipeline::retry) | the retry signal, the dependency's budget | the budget's record, `ask.primary` |
//! | [`slots`](Pipeline::slots) | the worker's slots | `took.ticket`, `.signal`, `.capture`; the slot lane |
//! | [`rate_limits`](Pipeline::rate_limits) | the node's keys, the worker's leases, the sync view | the keys, the leases |
//! | [`hold_rate`](Pipeline::hold_rate) | the class's `on_limit` | the rate lane |
//!
//! Every stage may write `record`. An admission refusal goes through one
//! place ([`Pipeline::refused`]): counted, then in `mode: shadow` recorded
//! and not enforced (on to the rate limits, no slot taken), else answered
//! by the conclusion (from the degraded-answer cache if it serves it).

use std::rc::Rc;

use super::conclude::refusal_decision;
use super::lease::{NoClock, Now};
use super::request::{Decided, Req, Request, Step};
use super::stream::{Signal, Stream};
use super::{Clock, Pipeline};
use crate::admission::queue::{Held, NotHeld, Offered};
use crate::admission::request::{self, BodyBudget, Declared};
use crate::admission::{self, retry, Limited, Refusal, Ticket};
use crate::decision::{Decision, LimitName, Reason};
use crate::engine;
use crate::host::Host;
use crate::policy::admission::{Dependency, LevelQueue, DEFAULT_RETRY_AFTER_WINDOW_NS};
use crate::policy::Mode;
use crate::stats::Metric;

use super::hold::NotQueued;

/// An admission stage.
type Stage<H> = fn(&mut Pipeline, &H, &mut Req, u64) -> Step;

impl Pipeline {
    /// Admission control for a class with admission labels: its checks,
    /// its retry budget and its slots, at `now`. [`Step::Next`]: on to the
    /// rate limits.
    pub(super) fn admission<H: Host>(&mut self, host: &H, req: &mut Req, now: u64) -> Step {
        let stages: [Stage<H>; 3] = [Pipeline::checks, Pipeline::retry, Pipeline::slots];
        for stage in stages {
            match stage(self, host, req, now) {
                Step::Next => {}
                Step::Limits => return Step::Next,
                done => return done,
            }
        }
        Step::Next
    }

    /// The request's declared body size and remaining timeout budget (413 /
    /// 503); a body without `content-length` gets its budget, counted as it
    /// comes ([`Pipeline::on_request_body`]).
    fn checks<H: Host>(&mut self, host: &H, req: &mut Req, now: u64) -> Step {
        let labels = req.ask.prepared.class.labels;
        req.took.level = labels.criticality;
        let declared = Declared::read(
            host.request_header("content-length").as_deref(),
            labels
                .min_timeout_budget_ns
                .and(host.request_header(request::EXPECTED_TIMEOUT_HEADER))
                .as_deref(),
        );
        if let Err(reason) = request::check(&labels, &declared) {
            let decision = Decision {
                retry_after_secs: 1,
                subject: req.ask.prepared.subject.clone(),
                ..Decision::passed(reason)
            };
            return self.refused(host, req, decision, Decided::default(), now);
        }
        if declared.content_length.is_none() && req.ask.policy.mode != Mode::Shadow {
            req.took.body = BodyBudget::of(&labels);
        }
        Step::Next
    }

    /// A request a trusted signal marks as a retry takes its place in its
    /// dependency's retry budget (503 `retry_budget`); any other request of
    /// a budgeted dependency is a primary, counted when it is admitted.
    fn retry<H: Host>(&mut self, host: &H, req: &mut Req, now: u64) -> Step {
        let policy = Rc::clone(&req.ask.policy);
        let labels = req.ask.prepared.class.labels;
        let Some(dep) = labels.dependency.and_then(|i| policy.dependency(i)) else {
            return Step::Next;
        };
        let Some(budget) = dep.retry_budget.as_ref() else {
            return Step::Next;
        };
        if !retry::is_retry(budget, host) {
            req.ask.primary = true;
            return Step::Next;
        }
        match self.primaries.take_retry(host, budget, now) {
            Ok(_) => {
                self.count_retry(&dep.name);
                Step::Next
            }
            Err(refused) => {
                let limit = LimitName::Dependency(dep.name.clone());
                let at = Decided {
                    limit: Some(limit.clone()),
                    ..Decided::default()
                };
                let decision = refusal_decision(
                    refused.reason,
                    limit,
                    refused.retry_after_secs,
                    dep.retry_after_window_ns,
                    &req.ask,
                    now,
                );
                self.refused(host, req, decision, at, now)
            }
        }
    }

    /// The request's slots ([`crate::admission::Worker::acquire`]): the
    /// dependency's `paused` and breaker, the tenant's share, the action's
    /// in-flight limit, the dependency's level. A `concurrency_limit` at a
    /// level with a queue holds the request in its dependency's slot lane.
    fn slots<H: Host>(&mut self, host: &H, req: &mut Req, now: u64) -> Step {
        let policy = Rc::clone(&req.ask.policy);
        let labels = req.ask.prepared.class.labels;
        let dep = labels.dependency.and_then(|i| policy.dependency(i));
        if dep.is_none() && labels.action_limit.is_none() {
            req.record = Some(self.record(req, None, &Decided::default(), now, None));
            return Step::Next;
        }
        let acquired = match self.worker.as_mut() {
            Some(w) => w.acquire(
                host,
                &policy,
                &req.ask.prepared.class,
                &req.ask.prepared.subject,
                now,
            ),
            None => Err(Refusal::unavailable(dep)),
        };
        let refusal = match acquired {
            Ok(ticket) => {
                self.admitted(req, ticket, now);
                let at = Decided {
                    in_flight: req.took.ticket.as_ref().map_or(0, Ticket::in_flight),
                    ..Decided::default()
                };
                req.record = Some(self.record(req, None, &at, now, None));
                return Step::Next;
            }
            Err(refusal) => refusal,
        };
        let mut reason = refusal.reason;
        // A dependency's queue holds a request refused by its action's
        // limit too: the tick retries the whole acquire.
        let queue = dep
            .and_then(|d| d.queues.get(labels.criticality.index()).copied().map(|q| (d, q)))
            .filter(|(_, q)| {
                reason == Reason::ConcurrencyLimit && policy.mode != Mode::Shadow && q.max_queue > 0
            });
        if let Some((dep, queue)) = queue {
            match self.hold_slot(host, req, dep, queue, now) {
                Ok(()) => return Step::Hold,
                Err(NotHeld::Full) => reason = Reason::QueueFull,
                Err(NotHeld::NoQueue) => {}
            }
        }
        if refusal.limit == Limited::Dependency {
            self.note_refused(&policy, &req.ask.prepared, reason, now);
        }
        let limited = limit_name(&req.ask, refusal.limit);
        let at = Decided {
            in_flight: refusal.in_flight,
            queue_wait_ns: 0,
            limit: Some(limited.clone()),
        };
        let decision = refusal_decision(
            reason,
            limited,
            refusal.retry_after_secs,
            refusal.retry_after_window_ns,
            &req.ask,
            now,
        );
        self.refused(host, req, decision, at, now)
    }

    /// Holds a request refused a slot in its dependency's slot lane; a
    /// request the full level displaces is answered (503 `queue_full`).
    fn hold_slot<H: Host>(
        &mut self,
        host: &H,
        req: &Req,
        dep: &Dependency,
        queue: LevelQueue,
        now: u64,
    ) -> Result<(), NotHeld> {
        let level = req.ask.prepared.class.labels.criticality;
        let held = Held {
            item: held_request(host, req),
            level,
            tenant: crate::table::fnv1a64(
                admission::tenant_key(&dep.name, &req.ask.prepared.subject).as_bytes(),
            ),
            enqueued: now,
            deadline: now.saturating_add(queue.max_wait_ns),
        };
        let offered = self.hold.offer_slot(&dep.key, held, queue.max_queue)?;
        self.pending.queued(level);
        if let Offered::Displaced(dropped) = offered {
            self.fair_drop(host, dropped, now);
        }
        Ok(())
    }

    /// A request dropped from the longest tenant line of a full level:
    /// 503 `queue_full`, counted in its tenant's bucket.
    fn fair_drop<H: Host>(&mut self, host: &H, dropped: Held<Request>, now: u64) {
        let bucket = dropped.tenant % crate::stats::FAIR_DROP_BUCKETS as u64;
        self.pending
            .rare(Metric::FairDrop(u8::try_from(bucket).unwrap_or(0)));
        self.pending.admission(Some(Reason::QueueFull), dropped.level);
        self.answer_held(host, dropped, Reason::QueueFull, 1, now);
    }

    /// A request admitted to its slots (on its headers, or from the hold):
    /// counted, its primary noted, its signal started, its capture planned.
    pub(super) fn admitted(&mut self, req: &mut Req, ticket: Option<Ticket>, now: u64) {
        let prepared = &req.ask.prepared;
        self.pending.admission(None, prepared.class.labels.criticality);
        let budget = req.ask.dependency().and_then(|d| d.retry_budget.as_ref());
        if let (true, Some(b)) = (req.ask.primary, budget) {
            self.primaries.note(b);
        }
        if let Some(t) = &ticket {
            req.took.signal = Signal::start(&req.ask.policy, prepared, t, now);
        }
        if let Some(read) = &req.ask.read {
            req.took.capture = self.plan_capture(prepared, read, now);
        }
        req.took.ticket = ticket;
    }

    /// An admission refusal (the one place shadow mode applies): counted;
    /// in `mode: shadow` recorded and let through to the rate limits, else
    /// its answer (see [`Pipeline::refuse`]).
    fn refused<H: Host>(
        &mut self,
        host: &H,
        req: &mut Req,
        decision: Decision,
        at: Decided,
        now: u64,
    ) -> Step {
        let reason = decision.reason;
        self.pending
            .admission(Some(reason), req.ask.prepared.class.labels.criticality);
        if req.ask.policy.mode == Mode::Shadow {
            req.record = Some(self.record(req, Some(reason), &at, now, None));
            return Step::Limits;
        }
        Step::Done(Box::new(self.refuse(host, req, decision, &at, now)))
    }

    /// Checks and charges the request's rate limits: from the worker's
    /// lease of its key if it has one ([`super::lease`]), else with the
    /// node's entry, taking a lease if the key is hot. A class whose cost
    /// settles after the response is charged on the exact path (no lease
    /// spent or taken, no refusal remembered: a settlement may change the
    /// key's standing at any moment; see [`crate::cost`]).
    pub(super) fn rate_limits<H: Host>(
        &mut self,
        host: &H,
        req: &Req,
        now: &mut Now<'_, impl Clock>,
    ) -> Result<Decision, NoClock> {
        let (policy, prepared) = (&req.ask.policy, &req.ask.prepared);
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

    /// A 429 of a class with `on_limit: queue`: held in the rate lane if it
    /// can be admitted within `max_wait` ([`super::hold::Hold::offer_rate`]).
    /// Its slots were given back: it holds nothing while it waits.
    pub(super) fn hold_rate<H: Host>(&mut self, host: &H, req: &Req, denial: &Decision, now: u64) -> Step {
        if denial.deny_status() != Some(429) {
            return Step::Next;
        }
        match self.hold.offer_rate(held_request(host, req), denial, now) {
            Ok(()) => {
                self.pending.rare(Metric::QueueHeld);
                Step::Hold
            }
            Err(NotQueued::Full) => {
                self.pending.rare(Metric::QueueFull);
                Step::Next
            }
            Err(_) => Step::Next,
        }
    }

    /// Gives back what a request took that never reached its dependency:
    /// its slots and its probe ticket (see
    /// [`crate::admission::Worker::cancel`]); its signal and capture go
    /// with them (tenantgate answers it: not a health signal of the
    /// upstream).
    pub(super) fn give_back<H: Host>(&mut self, host: &H, took: &mut Stream, now: u64) {
        if let Some(ticket) = took.ticket.take() {
            self.cancel(host, ticket, now);
        }
        took.signal = None;
        took.capture = None;
    }
}

/// What a held request keeps: the request, with its `x-request-id` read
/// now (its answer comes from the tick, where its headers cannot be read).
fn held_request<H: Host>(host: &H, req: &Req) -> Request {
    Request {
        request_id: req.request_id(host),
        ..req.ask.clone()
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

/// What refused a slot, typed.
pub(super) fn limit_name(ask: &Request, limit: Limited) -> LimitName {
    let dependency = || {
        ask.dependency()
            .map_or_else(|| String::from("-"), |d| d.name.clone())
    };
    match limit {
        Limited::Action => LimitName::Action(ask.prepared.class.action.clone()),
        Limited::Dependency => LimitName::Dependency(dependency()),
        Limited::Tenant => LimitName::Tenant(dependency()),
    }
}
