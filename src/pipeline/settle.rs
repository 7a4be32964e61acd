//! A class whose cost settles after the response, in the pipeline (the
//! rule and THE BOUND: [`crate::cost`]), and soft limits' markers.
//!
//! * **On the request headers**: a request outside the class's metered
//!   operation (`settle.methods`, default `POST`, and `settle.paths`)
//!   passes charged nothing ([`unmetered`]); otherwise its estimate (`cost`, or a trusted
//!   header's integer) becomes the request's charge ([`Prepared::cost`]),
//!   charged on the exact path (never a worker lease); admitted, the stream
//!   keeps a `Settling`: what it was charged, when, and its [`Meter`].
//! * **On the request body** (`estimate_body_field`): the field's integer,
//!   read as the body passes, re-estimates it: the difference is given back,
//!   or charged with admission (refused 429 if it does not fit: its
//!   estimate from the headers is given back too).
//! * **On the response** (headers, each body chunk, trailers): the meter
//!   reads the figure; once the response has ended, the difference to the
//!   estimate is settled ([`crate::engine::settle`]), counted, and its
//!   record (`tenantgate_cost`) handed to the host for the access log.
//! * **At the stream's end**, if the response never completed: settled by
//!   the rule ([`crate::cost::Unusable::Reset`]).
//!
//! A request over a soft limit carries the policy's `soft_limit_header`
//! (its limit's name) to routing ([`RouteMark`]) and to its response;
//! every other request of a policy with soft limits has a client's own
//! copy removed, so only the filter picks the fallback route.

use std::rc::Rc;

use super::{BodyEdit, Chunk, Directive, Pipeline, RouteMark, Verdict};
use crate::cost::{self, json::Scanner, Figure, Flow, Meter};
use crate::decision::{Decision, Reason};
use crate::engine::{self, Charged, Difference, Prepared};
use crate::host::Host;
use crate::policy::settle::{Estimate, Field, Settle};
use crate::policy::Policy;
use crate::stats::CostStat;

/// The filter state a settled stream's cost record is kept under
/// (`wasm.` + this in Envoy's access log).
pub const COST_PROPERTY: &str = "tenantgate_cost";

/// Most request body bytes read for `estimate_body_field`.
pub const MAX_ESTIMATE_BODY_BYTES: u64 = 64 * 1024;

/// What a stream of a settling class keeps until it is settled.
#[derive(Debug)]
pub(super) struct Settling {
    policy: Rc<Policy>,
    /// Its key, and its charge (`cost`: the estimate).
    prepared: Prepared,
    charged: Charged,
    meter: Meter,
    /// Units reserved at a time as its answer flows past its reservation
    /// (`settle.chunk`, cut to what its limits can ever admit).
    chunk: u64,
    /// Reading the request body for `estimate_body_field`.
    body_estimate: Option<Box<BodyEstimate>>,
    /// The request body kept so far, to ask for its usage
    /// (`include_usage`: [`cost::rewrite`]).
    rewrite: Option<Vec<u8>>,
}

/// What the host does with a response body chunk.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseBody {
    /// A settled stream's cost record (see [`COST_PROPERTY`]).
    pub cost_record: Option<String>,
    /// End the answer in this chunk (see "Metered as it flows" in
    /// [`crate::cost`]).
    pub end: Option<EndAnswer>,
}

/// The answer ends in the current chunk: the host passes its first `keep`
/// bytes, then `terminal`, and drops every later byte of the answer (its
/// response ends when the upstream's does); `reset`: it resets the stream
/// at once instead (`docs/policy.md` says how each host does it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndAnswer {
    pub keep: usize,
    pub terminal: &'static [u8],
    pub reset: bool,
}

/// A further charge of a settling request.
enum More {
    /// Charged to the same limits as its estimate.
    Charged,
    /// Admitted, but by other limits (a soft limit passed in between):
    /// given back.
    Elsewhere,
    /// Refused (given back).
    Refused(Decision),
}

/// The request body's scan for its estimate field.
#[derive(Debug)]
struct BodyEstimate {
    field: [Field; 1],
    scanner: Scanner,
    read: u64,
    /// The input estimate added to the field's value.
    input: u64,
}

impl Settling {
    fn settle_rule(&self) -> Option<&Settle> {
        self.prepared.class.settle.as_ref()
    }

    /// It still reads its estimate from the request body.
    pub(super) fn estimates_from_body(&self) -> bool {
        self.body_estimate.is_some()
    }
}

/// A soft-limited request's marker for its response: `(the policy's
/// soft_limit_header, the limit's name)`.
pub(super) fn soft_marker(policy: &Policy, decision: &Decision) -> Option<(String, String)> {
    if decision.reason != Reason::SoftLimited {
        return None;
    }
    let limit = decision.limit.as_ref()?;
    Some((policy.soft_limit_header.clone(), limit.name().to_owned()))
}

/// The decision of a request of a settled class outside its metered
/// operation (`settle.methods`, `settle.paths`: its estimate is 0, which no
/// metered request's is): passed, charged nothing, nothing to settle.
pub(super) fn unmetered(prepared: &Prepared) -> Option<Decision> {
    (prepared.class.settle.is_some() && prepared.cost == 0)
        .then(|| Decision::pass(crate::decision::Reason::Unmetered, prepared.subject.clone()))
}

/// The largest estimate a request may be charged: the ceiling, and no more
/// than any of its limits can ever admit (its plan's and guard's bursts).
fn max_estimate(policy: &Policy, prepared: &Prepared, settle: &Settle) -> u64 {
    let plan = policy
        .plan(prepared.plan)
        .map(|p| p.limits.as_slice())
        .unwrap_or_default();
    let guard = prepared
        .class
        .guard
        .and_then(|g| policy.guard(g))
        .map(|g| g.limits.as_slice())
        .unwrap_or_default();
    plan.iter()
        .chain(guard)
        .map(|l| l.burst)
        .fold(settle.ceiling, u64::min)
        .max(1)
}

/// The input estimate of a request (`estimate_input_bytes_per_token`): its
/// declared `content-length` (Envoy holds a body to it) in units, rounded
/// up; 0 without either.
fn input_estimate<H: Host>(host: &H, settle: &Settle) -> u64 {
    let Some(per) = settle.input_bytes_per_token else {
        return 0;
    };
    declared_length(host).map_or(0, |len| len.div_ceil(per.max(1)))
}

/// The request's declared `content-length`, if it has a valid one.
fn declared_length<H: Host>(host: &H) -> Option<u64> {
    let raw = host.request_header("content-length")?;
    std::str::from_utf8(&raw).ok()?.trim().parse::<u64>().ok()
}

impl Pipeline {
    /// A settling class's request: its estimate from a trusted header, if
    /// the policy names one (else `cost`, as prepared), and its input
    /// estimate added (returned, for a body field's value).
    pub(super) fn estimate<H: Host>(host: &H, policy: &Policy, prepared: &mut Prepared) -> u64 {
        let Some(settle) = prepared.class.settle.as_ref() else {
            return 0;
        };
        let method = host.request_header(":method").unwrap_or_default();
        let path = host.request_header(":path").unwrap_or_default();
        if !settle.meters(&method, &path) {
            // Outside the metered operation: no cost (see [`unmetered`]).
            prepared.cost = 0;
            return 0;
        }
        let max = max_estimate(policy, prepared, settle);
        if let Estimate::Header(name) = &settle.estimate {
            if let Some(e) = host
                .request_header(name)
                .and_then(|raw| cost::estimate_of(&raw, max))
            {
                prepared.cost = e;
            }
        }
        let input = input_estimate(host, settle);
        if input > 0 {
            prepared.cost = prepared.cost.saturating_add(input).clamp(1, max);
        }
        input
    }

    /// An admitted request of a settling class: what it was charged, to be
    /// settled at its end (`input_estimate`: the stream's, see
    /// [`Self::estimate`]). `None`: nothing to settle.
    pub(super) fn settling_for(
        &mut self,
        policy: &Rc<Policy>,
        prepared: &Prepared,
        decision: &Decision,
        now: u64,
        input_estimate: u64,
    ) -> Option<Box<Settling>> {
        let settle = prepared.class.settle.as_ref()?;
        if decision.deny_status().is_some()
            || (decision.charged == 0 && !decision.guard_charged && !decision.levels_charged.any())
        {
            return None;
        }
        self.pending
            .cost(&prepared.class.name, CostStat::EstimatedUnits, prepared.cost);
        let body_estimate = match &settle.estimate {
            Estimate::BodyField { name, pointer } => Some(Box::new(BodyEstimate {
                field: [Field {
                    name: name.clone(),
                    pointers: vec![pointer.clone()],
                    weight_milli: crate::policy::settle::WEIGHT_SCALE,
                    negative: false,
                    optional: false,
                }],
                scanner: Scanner::default(),
                read: 0,
                input: input_estimate,
            })),
            _ => None,
        };
        Some(Box::new(Settling {
            policy: policy.clone(),
            prepared: prepared.clone(),
            charged: Charged {
                limits: decision.charged,
                guard: decision.guard_charged,
                levels: decision.levels_charged,
                at: now,
            },
            meter: Meter::default(),
            chunk: settle.chunk.min(max_estimate(policy, prepared, settle)),
            body_estimate,
            rewrite: None,
        }))
    }

    /// A request admitted at its headers, of a class with
    /// `include_usage`, whose body can be kept whole
    /// ([`cost::rewrite::MAX_REWRITE_BYTES`], by its `content-length`):
    /// its body is kept to ask for its usage. `true`: the host is to remove
    /// `content-length` ([`BodyEdit::Unsized`]).
    pub(super) fn start_rewrite<H: Host>(&mut self, host: &H, stream: super::StreamId) -> bool {
        let Some(s) = self.streams.get_mut(&stream).and_then(|s| s.settling.as_mut()) else {
            return false;
        };
        if !s.settle_rule().is_some_and(|r| r.include_usage) {
            return false;
        }
        let declared = declared_length(host);
        let max = u64::try_from(cost::rewrite::MAX_REWRITE_BYTES).unwrap_or(u64::MAX);
        if declared.is_some_and(|n| n == 0 || n > max) {
            return false;
        }
        s.rewrite = Some(Vec::new());
        true
    }

    /// A request body chunk of a body kept to ask for its usage: kept
    /// ([`Verdict::Buffer`]) until the body ends, then replaced if it is a
    /// streamed request that did not ask ([`cost::rewrite`]). A body that
    /// grows past [`cost::rewrite::MAX_REWRITE_BYTES`] goes on unchanged.
    pub(super) fn rewrite_body<H: Host>(
        &mut self,
        host: &H,
        stream: super::StreamId,
        chunk: Chunk,
    ) -> Directive {
        let Some(s) = self.streams.get_mut(&stream).and_then(|s| s.settling.as_mut()) else {
            return Directive::go();
        };
        let Some(kept) = s.rewrite.as_mut() else {
            return Directive::go();
        };
        if kept.len().saturating_add(chunk.len) > cost::rewrite::MAX_REWRITE_BYTES {
            s.rewrite = None;
            return Directive::go();
        }
        kept.extend_from_slice(&host.request_body(chunk.offset, chunk.len).unwrap_or_default());
        if !chunk.end_of_stream {
            return Directive {
                verdict: Verdict::Buffer,
                ..Directive::go()
            };
        }
        let kept = s.rewrite.take().unwrap_or_default();
        let Some(body) = cost::rewrite::include_usage(&kept) else {
            return Directive::go();
        };
        let class = s.prepared.class.name.clone();
        self.pending.cost(&class, CostStat::UsageRequested, 1);
        Directive {
            body: BodyEdit::Replace(body),
            ..Directive::go()
        }
    }

    /// A chunk of the request body of a settling class with
    /// `estimate_body_field`: once the field has come, the estimate is
    /// replaced by it (see the module header). `Some`: the request is
    /// refused.
    pub(super) fn estimate_from_body<H: Host>(
        &mut self,
        host: &H,
        s: &mut Settling,
        chunk: Chunk,
        now: u64,
    ) -> Option<Decision> {
        let b = s.body_estimate.as_mut()?;
        b.read = b
            .read
            .saturating_add(u64::try_from(chunk.len).unwrap_or(u64::MAX));
        if b.read > MAX_ESTIMATE_BODY_BYTES {
            s.body_estimate = None;
            return None;
        }
        let chunk = host.request_body(chunk.offset, chunk.len).unwrap_or_default();
        b.scanner.feed(&chunk, &b.field);
        let value = b.scanner.found().values[0]?.saturating_add(b.input);
        s.body_estimate = None;
        let settle = s.settle_rule()?;
        let e = value.clamp(1, max_estimate(&s.policy, &s.prepared, settle));
        let before = s.prepared.cost;
        if e < before {
            let a = engine::settle(
                &s.policy,
                &s.prepared,
                host,
                &s.charged,
                Difference::Less(before - e),
                now,
                &mut self.scratch,
            );
            if a.written {
                s.prepared.cost = e;
            }
            return None;
        }
        if e == before {
            return None;
        }
        match self.charge_more(host, s, e - before, now) {
            More::Charged => {
                s.prepared.cost = e;
                None
            }
            // The estimate stays.
            More::Elsewhere => None,
            More::Refused(d) => {
                // Refused: the headers' estimate goes back too; nothing to
                // settle.
                engine::settle(
                    &s.policy,
                    &s.prepared,
                    host,
                    &s.charged,
                    Difference::Less(before),
                    now,
                    &mut self.scratch,
                );
                s.charged.limits = 0;
                s.charged.guard = false;
                Some(d)
            }
        }
    }

    /// Charges a settling request `units` more, with admission, through
    /// the one charge path (a larger estimate from its body, or a chunk of
    /// its answer as it flows): kept only if charged to the same limits as
    /// its estimate.
    fn charge_more<H: Host>(&mut self, host: &H, s: &Settling, units: u64, now: u64) -> More {
        let mut more = s.prepared.clone();
        more.cost = units;
        let view = self.view(&s.policy);
        let d = engine::charge_synced(&s.policy, &more, host, now, view.as_ref(), &mut self.scratch);
        let same = d.charged == s.charged.limits && d.guard_charged == s.charged.guard;
        if d.deny_status().is_none() && same {
            self.pending
                .cost(&s.prepared.class.name, CostStat::EstimatedUnits, units);
            return More::Charged;
        }
        // Charged other limits than the estimate's (a soft limit passed in
        // between), or refused: the extra is given back.
        let extra = Charged {
            limits: d.charged,
            guard: d.guard_charged,
            levels: d.levels_charged,
            at: now,
        };
        engine::settle(
            &s.policy,
            &more,
            host,
            &extra,
            Difference::Less(units),
            now,
            &mut self.scratch,
        );
        if d.deny_status().is_some() {
            More::Refused(d)
        } else {
            More::Elsewhere
        }
    }

    /// The request body of a stream that may re-estimate from it.
    pub(super) fn settling_body<H: Host>(
        &mut self,
        host: &H,
        stream: super::StreamId,
        chunk: Chunk,
        now: u64,
    ) -> Option<Decision> {
        let mut s = self.streams.get_mut(&stream)?.settling.take()?;
        let refused = self.estimate_from_body(host, &mut s, chunk, now);
        let Some(decision) = refused else {
            if let Some(state) = self.streams.get_mut(&stream) {
                state.settling = Some(s);
            }
            return None;
        };
        Some(decision)
    }

    /// The response's headers, a body chunk or its trailers went by the
    /// stream's meter (`part`); settled once the response has ended.
    /// Returns the cost record for the host to keep.
    pub(super) fn meter<H: Host>(
        &mut self,
        host: &H,
        stream: super::StreamId,
        now: impl FnOnce() -> u64,
        part: impl FnOnce(&mut Meter, &Settle),
    ) -> Option<String> {
        let state = self.streams.get_mut(&stream)?;
        let s = state.settling.as_mut()?;
        let class = s.prepared.class.clone();
        part(&mut s.meter, class.settle.as_ref()?);
        let figure = s.meter.figure()?;
        let s = state.settling.take()?;
        Some(self.settle(host, *s, figure, now()))
    }

    /// A response body chunk of a settling stream, metered as it flows
    /// (see "Metered as it flows" in [`crate::cost`]): when its running
    /// cost passes what it reserved, `settle.chunk` more is reserved at a
    /// time, through the one charge path; if its limits refuse, the answer
    /// ends there and is settled at what passed. Settled once the response
    /// has ended.
    pub(super) fn meter_body<H: Host>(
        &mut self,
        host: &H,
        clock: &impl super::Clock,
        stream: super::StreamId,
        size: usize,
        end_of_stream: bool,
    ) -> ResponseBody {
        let Some(mut s) = self.streams.get_mut(&stream).and_then(|st| st.settling.take()) else {
            return ResponseBody::default();
        };
        let class = s.prepared.class.clone();
        let Some(rule) = class.settle.as_ref() else {
            return ResponseBody::default();
        };
        let mut meter = std::mem::take(&mut s.meter);
        let mut now = None;
        let reserved = s.prepared.cost;
        let flow = meter.on_body_flow(rule, host, size, end_of_stream, reserved, &mut |running| {
            // No answer costs more than the ceiling: one past it ends there.
            let room = rule.ceiling.saturating_sub(s.prepared.cost);
            if room == 0 {
                return None;
            }
            let missing = running.saturating_sub(s.prepared.cost);
            let units = missing.div_ceil(s.chunk.max(1)).saturating_mul(s.chunk).min(room);
            let at = *now.get_or_insert_with(|| clock.now().unwrap_or(0));
            match self.charge_more(host, &s, units, at) {
                More::Charged => {
                    s.prepared.cost = s.prepared.cost.saturating_add(units);
                    self.pending.cost(&class.name, CostStat::Chunks, 1);
                    Some(s.prepared.cost)
                }
                More::Elsewhere | More::Refused(_) => None,
            }
        });
        s.meter = meter;
        let end = match flow {
            Flow::Pass => None,
            Flow::End {
                keep,
                terminal,
                reset,
            } => {
                self.pending.cost(&class.name, CostStat::Ended, 1);
                Some(EndAnswer {
                    keep,
                    terminal,
                    reset,
                })
            }
        };
        let Some(figure) = s.meter.figure() else {
            if let Some(state) = self.streams.get_mut(&stream) {
                state.settling = Some(s);
            }
            return ResponseBody {
                cost_record: None,
                end,
            };
        };
        let at = now.unwrap_or_else(|| clock.now().unwrap_or(0));
        ResponseBody {
            cost_record: Some(self.settle(host, *s, figure, at)),
            end,
        }
    }

    /// Settles a stream that ended before its response did; returns its
    /// cost record.
    pub(super) fn settle_at_end<H: Host>(&mut self, host: &H, settling: Box<Settling>, now: u64) -> String {
        let mut s = settling;
        let figure = s.meter.end();
        self.settle(host, *s, figure, now)
    }

    /// Settles a stream's real cost against its estimate (see the module
    /// header) and counts it; returns its cost record.
    fn settle<H: Host>(&mut self, host: &H, s: Settling, figure: Figure, now: u64) -> String {
        let class = s.prepared.class.name.as_str();
        let estimate = s.prepared.cost;
        let Some(rule) = s.settle_rule() else {
            return String::new();
        };
        let real = cost::real_cost(rule, figure, estimate);
        let difference = if real.cost >= estimate {
            Difference::More(real.cost - estimate)
        } else {
            Difference::Less(estimate - real.cost)
        };
        let charged = s.charged.limits != 0 || s.charged.guard;
        let adjusted = if charged {
            engine::settle(
                &s.policy,
                &s.prepared,
                host,
                &s.charged,
                difference,
                now,
                &mut self.scratch,
            )
        } else {
            engine::Adjusted::default()
        };
        let p = &mut self.pending;
        p.cost(class, CostStat::Settles, 1);
        p.cost(class, CostStat::SettledUnits, real.cost);
        match difference {
            Difference::More(n) => p.cost(class, CostStat::OverUnits, n),
            Difference::Less(n) => p.cost(class, CostStat::UnderUnits, n),
        }
        let ratio = u128::from(real.cost) * 100 / u128::from(estimate.max(1));
        p.cost(
            class,
            CostStat::RatioPct,
            u64::try_from(ratio).unwrap_or(u64::MAX),
        );
        if real.cut {
            p.cost(class, CostStat::Cut, 1);
        }
        if let Some(why) = real.unusable {
            p.cost(class, CostStat::Unusable(why), 1);
        }
        if adjusted.written_off > 0 {
            p.cost(class, CostStat::WrittenOffUnits, adjusted.written_off);
        }
        if adjusted.owed > 0 {
            p.cost(class, CostStat::InDebt, 1);
        }
        let figure = match figure {
            Figure::Cost(c) => c.to_string(),
            Figure::Ended(c) => format!("ended:{c}"),
            Figure::Unusable(why) => format!("unusable:{}", why.as_str()),
        };
        format!(
            "class={class} key={} estimate={estimate} figure={figure} cost={} written_off={} owed={}",
            crate::decision::logical_key(&s.prepared.class.action, &s.prepared.subject),
            real.cost,
            adjusted.written_off,
            adjusted.owed
        )
    }

    /// The routing marker of a request of a policy with soft limits: the
    /// soft limit's name on a soft-limited request, else the removal of a
    /// client's own copy (`client_copy`: it sent one).
    pub(super) fn route_mark(
        policy: &Policy,
        directive: &mut Directive,
        state_soft: Option<&str>,
        client_copy: bool,
    ) {
        if !policy.has_soft_limits || matches!(directive.verdict, Verdict::Reply(_)) {
            return;
        }
        let value = state_soft.map(str::to_owned);
        if value.is_some() || client_copy {
            directive.mark = Some(RouteMark {
                header: policy.soft_limit_header.clone(),
                value,
            });
        }
    }
}
