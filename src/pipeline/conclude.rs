//! How a request's decision becomes its directive, in one place for a
//! request answered on its headers, a held one answered from the tick and
//! a resumed one ([`Pipeline::conclude`]): the decision counted, what the
//! request took given back if it is refused, what an admitted one carries
//! started (its probe counted, its settling, its soft marker), its decision
//! record written, its reply built ([`Pipeline::answer`]). Also how a
//! refusal is answered ([`Pipeline::refuse`]: the degraded-answer cache for
//! a read refused for a shedding reason) and the decision record itself.
//!
//! Shadow mode is applied before: admission's in [`super::stages`] (a
//! refusal recorded, never enforced), the rate limits' in the engine (a
//! `shadow_limited` decision, never a denial).

use super::request::{Decided, Outcome, Req, Request};
use super::stream::Stream;
use super::{Directive, Pipeline, StreamId, Verdict};
use crate::admission::degraded::{self, Lookup};
use crate::admission::{breaker, jittered_retry_after_secs, DecisionRecord, Ticket};
use crate::decision::{Decision, LimitName, Reason};
use crate::host::Host;
use crate::policy::admission::Dependency;
use crate::policy::Policy;
use crate::response::{self, LocalReply};
use crate::stats::DegradedStat;

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
    /// A request's directive from how its stages ended, at `now` (see the
    /// module header). The stream's state is kept for its later callbacks,
    /// except a request answered from the degraded-answer cache (nothing
    /// of it is left to do).
    pub(super) fn conclude<H: Host>(
        &mut self,
        host: &H,
        req: &mut Req,
        outcome: Outcome,
        now: u64,
    ) -> Directive {
        let decision = match outcome {
            Outcome::Degraded(reply, decision) => {
                self.pending.decision(&decision);
                self.give_back(host, &mut req.took, now);
                return Directive::reply(reply, req.record.take());
            }
            Outcome::Decided(decision) => decision,
        };
        let request_id = if decision.deny_status().is_some() {
            if decision.reason == Reason::RateLimited {
                // A rate limit's refusal is recorded as one, naming the
                // limit (and its level), whatever admission said before.
                let at = Decided {
                    in_flight: req.took.ticket.as_ref().map_or(0, Ticket::in_flight),
                    queue_wait_ns: req.waited_ns,
                    limit: decision.limit.clone(),
                };
                req.record = Some(self.record(req, Some(Reason::RateLimited), &at, now, None));
            }
            self.give_back(host, &mut req.took, now);
            req.request_id(host)
        } else {
            self.admit(req, &decision, now);
            None
        };
        let record = req.record.take();
        self.answer(
            &req.ask.policy,
            req.ask.stream,
            &mut req.took,
            decision,
            record,
            request_id,
        )
    }

    /// What an admitted request carries on: its probe counted, its
    /// settling and soft marker started, a soft-limited one's record.
    fn admit(&mut self, req: &mut Req, decision: &Decision, now: u64) {
        let (policy, prepared) = (&req.ask.policy, &req.ask.prepared);
        self.count_probe(policy, prepared, req.took.ticket.as_ref());
        self.start_settling(policy, prepared, decision, now, &mut req.took);
        if decision.reason == Reason::SoftLimited {
            let at = Decided {
                in_flight: req.took.ticket.as_ref().map_or(0, Ticket::in_flight),
                queue_wait_ns: req.waited_ns,
                limit: decision.limit.clone(),
            };
            req.record = Some(self.record(req, Some(Reason::SoftLimited), &at, now, None));
        }
    }

    /// A decision's directive: counted; a denial's local reply (echoing
    /// `request_id` if it is valid), or on its way with its `RateLimit`
    /// headers kept for the response. The stream's state is kept.
    pub(super) fn answer(
        &mut self,
        policy: &Policy,
        stream: StreamId,
        took: &mut Stream,
        decision: Decision,
        record: Option<String>,
        request_id: Option<Vec<u8>>,
    ) -> Directive {
        self.pending.decision(&decision);
        let reply = response::local_reply(
            &decision,
            &policy.version,
            policy.ratelimit_headers,
            response::request_id(request_id.as_deref()),
        );
        let verdict = match reply {
            Some(reply) => {
                // tenantgate answers: not a health signal of the upstream.
                took.signal = None;
                took.capture = None;
                Verdict::Reply(reply)
            }
            None => {
                if policy.ratelimit_headers {
                    took.headers = decision.headers;
                }
                Verdict::Continue
            }
        };
        self.keep(stream, took);
        Directive::of(verdict, record)
    }

    /// A refusal's outcome: for a degradable read refused for a shedding
    /// reason, the cached answer or 503 `dependency_unavailable`; else the
    /// refusal. Writes the decision record with the final outcome.
    pub(super) fn refuse<H: Host>(
        &mut self,
        host: &H,
        req: &mut Req,
        decision: Decision,
        at: &Decided,
        now: u64,
    ) -> Outcome {
        let reason = decision.reason;
        match self.degrade(host, &req.ask, reason, now) {
            Degrade::No => {
                req.record = Some(self.record(req, Some(reason), at, now, None));
                Outcome::Decided(decision)
            }
            Degrade::Answer(reply, age_ms) => {
                req.record = Some(self.record(req, Some(reason), at, now, Some(age_ms)));
                Outcome::Degraded(reply, decision)
            }
            Degrade::Unavailable => {
                let unavailable = Reason::DependencyUnavailable;
                req.record = Some(self.record(req, Some(unavailable), at, now, None));
                Outcome::Decided(Decision {
                    reason: unavailable,
                    ..decision
                })
            }
        }
    }

    /// Looks a refused request up in its class's degraded-answer cache.
    fn degrade<H: Host>(&mut self, host: &H, ask: &Request, reason: Reason, now: u64) -> Degrade {
        let (Some(deg), Some(read)) = (ask.prepared.class.degradable.as_ref(), ask.read.as_ref()) else {
            return Degrade::No;
        };
        // A write is never answered from the cache: it gets its refusal.
        if !degraded::serves(reason) || !degraded::readable(&read.method) {
            return Degrade::No;
        }
        let Some(key) = degraded::cache_key(deg, &ask.prepared.subject, &read.path) else {
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
    pub(super) fn record(
        &self,
        req: &Req,
        outcome: Option<Reason>,
        at: &Decided,
        now: u64,
        degraded_age_ms: Option<u64>,
    ) -> String {
        let (policy, prepared) = (&req.ask.policy, &req.ask.prepared);
        let labels = prepared.class.labels;
        let dep = req.ask.dependency();
        let control = |d: &Dependency| {
            self.worker
                .as_ref()
                .map(|w| w.control(&d.key))
                .unwrap_or_default()
        };
        let controller_limit = dep
            .filter(|d| d.adaptive.is_some())
            .map(|d| crate::admission::effective_limit(d, &control(d)));
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
            level: at.limit.as_ref().and_then(LimitName::level),
            breaker,
            controller_limit,
            degraded_age_ms,
        }
        .render()
    }
}

/// A refusal's decision, with its jittered `Retry-After` (at least
/// `min_secs`, spread over the dependency's `retry_after_window`).
pub(super) fn refusal_decision(
    reason: Reason,
    limit: LimitName,
    min_secs: u64,
    window_ns: u64,
    ask: &Request,
    now: u64,
) -> Decision {
    let seed = now ^ (u64::from(ask.stream) << 32);
    Decision {
        limit: Some(limit),
        retry_after_secs: jittered_retry_after_secs(min_secs, window_ns, seed),
        subject: ask.prepared.subject.clone(),
        ..Decision::passed(reason)
    }
}
