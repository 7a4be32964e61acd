//! The filter's stats: every metric it reports, named here once, and the
//! sink a host gives them to.
//!
//! A fixed, small set with bounded names: per reason, criticality,
//! dependency, action (all from the policy) or tenant hash bucket, never
//! one per tenant id. Envoy shows them as `wasmcustom.tenantgate.*` in
//! `/stats` and `tenantgate_*` in `/stats/prometheus`; every worker
//! defining the same name shares one metric, so a gauge is node-wide.
//!
//! **Counted in memory, given on the tick.** A request's counts go into
//! the worker's [`Pending`] (no hostcall on the request path) and reach
//! the sink on the pipeline's tick (every 10 ms) and when the host shuts
//! the worker down: the sink's counters lag the decisions by at most one
//! tick. Gauges are set on the tick.

use crate::decision::{Decision, Reason, Subject};
use crate::policy::admission::Criticality;
use crate::table::TableEvent;

/// The number of tenant buckets fair-queue drops are counted in.
pub const FAIR_DROP_BUCKETS: usize = 16;

/// What a metric is, for the host that defines it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// The degraded-answer counters (`tenantgate.admission.degraded.<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DegradedStat {
    Answered,
    Unavailable,
    Stale,
    Miss,
    Stores,
    Evictions,
    TooLarge,
    /// Answers by age: ≤ 1 s, ≤ 10 s, ≤ 60 s, older (index 0–3).
    Age(u8),
}

impl DegradedStat {
    pub const ALL: [DegradedStat; 11] = [
        DegradedStat::Answered,
        DegradedStat::Unavailable,
        DegradedStat::Stale,
        DegradedStat::Miss,
        DegradedStat::Stores,
        DegradedStat::Evictions,
        DegradedStat::TooLarge,
        DegradedStat::Age(0),
        DegradedStat::Age(1),
        DegradedStat::Age(2),
        DegradedStat::Age(3),
    ];
    /// Upper bounds of the age buckets, in milliseconds (the last is open).
    pub const AGE_BOUNDS_MS: [u64; 3] = [1_000, 10_000, 60_000];

    fn name(self) -> &'static str {
        match self {
            DegradedStat::Answered => "answered",
            DegradedStat::Unavailable => "unavailable",
            DegradedStat::Stale => "stale",
            DegradedStat::Miss => "miss",
            DegradedStat::Stores => "stores",
            DegradedStat::Evictions => "evictions",
            DegradedStat::TooLarge => "too_large",
            DegradedStat::Age(0) => "age_le_1s",
            DegradedStat::Age(1) => "age_le_10s",
            DegradedStat::Age(2) => "age_le_60s",
            DegradedStat::Age(_) => "age_gt_60s",
        }
    }

    /// The age bucket of an answer `age_ms` old.
    pub fn age(age_ms: u64) -> DegradedStat {
        let bucket = Self::AGE_BOUNDS_MS
            .iter()
            .position(|b| age_ms <= *b)
            .unwrap_or(Self::AGE_BOUNDS_MS.len());
        DegradedStat::Age(u8::try_from(bucket).unwrap_or(3))
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|s| *s == self).unwrap_or(0)
    }
}

/// An adaptive controller's gauges (`tenantgate.admission.<what>.<dep>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControllerStat {
    /// The limit requests see (cut during a baseline refresh).
    Limit,
    BaselineUs,
    P95Us,
    MinUs,
    ErrorRatePpm,
    QueueAgeMs,
}

impl ControllerStat {
    pub const ALL: [ControllerStat; 6] = [
        ControllerStat::Limit,
        ControllerStat::BaselineUs,
        ControllerStat::P95Us,
        ControllerStat::MinUs,
        ControllerStat::ErrorRatePpm,
        ControllerStat::QueueAgeMs,
    ];

    fn name(self) -> &'static str {
        match self {
            ControllerStat::Limit => "limit",
            ControllerStat::BaselineUs => "baseline_us",
            ControllerStat::P95Us => "latency_p95_us",
            ControllerStat::MinUs => "latency_min_us",
            ControllerStat::ErrorRatePpm => "error_rate_ppm",
            ControllerStat::QueueAgeMs => "window_queue_age_ms",
        }
    }
}

/// A sync counter or sample (`tenantgate.sync.<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncStat {
    Sent,
    Ok,
    Failed,
    Timeouts,
    BreakerOpened,
    Skipped,
    NoLease,
    Clamped,
    AppliedInSteps,
    ApplyDropped,
    /// Second copies of a report sent (`sync::shared::hedge`).
    Hedged,
    /// Gauge: the node's sync breaker (0 closed, 1 open, 2 half-open).
    Breaker,
    /// Histogram: one step of an answer's application, in microseconds.
    ApplyStepUs,
    /// Histogram: a callout's round trip, in milliseconds.
    LatencyMs,
}

impl SyncStat {
    pub const ALL: [SyncStat; 14] = [
        SyncStat::Sent,
        SyncStat::Ok,
        SyncStat::Failed,
        SyncStat::Timeouts,
        SyncStat::BreakerOpened,
        SyncStat::Skipped,
        SyncStat::NoLease,
        SyncStat::Clamped,
        SyncStat::AppliedInSteps,
        SyncStat::ApplyDropped,
        SyncStat::Hedged,
        SyncStat::Breaker,
        SyncStat::ApplyStepUs,
        SyncStat::LatencyMs,
    ];

    fn name(self) -> &'static str {
        match self {
            SyncStat::Sent => "sent",
            SyncStat::Ok => "ok",
            SyncStat::Failed => "failed",
            SyncStat::Timeouts => "timeouts",
            SyncStat::BreakerOpened => "breaker_opened",
            SyncStat::Skipped => "skipped",
            SyncStat::NoLease => "no_lease",
            SyncStat::Clamped => "clamped",
            SyncStat::AppliedInSteps => "applied_in_steps",
            SyncStat::ApplyDropped => "apply_dropped",
            SyncStat::Hedged => "hedged",
            SyncStat::Breaker => "breaker",
            SyncStat::ApplyStepUs => "apply_step_us",
            SyncStat::LatencyMs => "latency_ms",
        }
    }

    fn kind(self) -> Kind {
        match self {
            SyncStat::Breaker => Kind::Gauge,
            SyncStat::ApplyStepUs | SyncStat::LatencyMs => Kind::Histogram,
            _ => Kind::Counter,
        }
    }
}

/// A circuit breaker's phases, as its transition counters name them (the
/// breaker's own [`crate::admission::breaker::Phase`] maps onto them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerPhase {
    Open,
    HalfOpen,
    Ramping,
    Closed,
}

impl BreakerPhase {
    pub const ALL: [BreakerPhase; 4] = [
        BreakerPhase::Open,
        BreakerPhase::HalfOpen,
        BreakerPhase::Ramping,
        BreakerPhase::Closed,
    ];

    fn entered(self) -> &'static str {
        match self {
            BreakerPhase::Open => "opened",
            BreakerPhase::HalfOpen => "half_opened",
            BreakerPhase::Ramping => "ramping",
            BreakerPhase::Closed => "closed",
        }
    }
}

/// The worker leases' counters (`tenantgate.lease.<name>`, see
/// `crate::pipeline::lease`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseStat {
    /// Requests served from a lease: no shared data.
    Served,
    /// Refusals served from a remembered refusal: no shared data.
    Remembered,
    /// Leases taken (in a request's own update).
    Taken,
    /// Leases given back on the tick (one update each).
    Returned,
    /// Units that could not be given back (under-admission).
    LostUnits,
}

impl LeaseStat {
    pub const ALL: [LeaseStat; 5] = [
        LeaseStat::Served,
        LeaseStat::Remembered,
        LeaseStat::Taken,
        LeaseStat::Returned,
        LeaseStat::LostUnits,
    ];

    fn name(self) -> &'static str {
        match self {
            LeaseStat::Served => "served",
            LeaseStat::Remembered => "refusals_remembered",
            LeaseStat::Taken => "taken",
            LeaseStat::Returned => "returned",
            LeaseStat::LostUnits => "lost_units",
        }
    }
}

/// A route class's late-settled cost counters and sample
/// (`tenantgate.cost.<name>.<class>`, see `crate::cost`): bounded by the
/// policy's classes, never one per tenant (a tenant's costs are in the
/// access log's `tenantgate_cost` record).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostStat {
    /// Units charged on requests as estimates.
    EstimatedUnits,
    /// Real costs settled (after the ceiling and the rule).
    SettledUnits,
    /// Streams settled.
    Settles,
    /// Real costs above their estimates: the units charged at the end.
    OverUnits,
    /// Real costs below their estimates: the units given back.
    UnderUnits,
    /// Figures above the ceiling, cut to it.
    Cut,
    /// Units a limit's debt allowance could not hold.
    WrittenOffUnits,
    /// Settlements that left the key in debt.
    InDebt,
    /// Streams that ended without a usable figure, by cause.
    Unusable(crate::cost::Unusable),
    /// Streamed requests sent upstream asking for their usage
    /// (`settle.include_usage`).
    UsageRequested,
    /// Histogram: the real cost in percent of the estimate (100: exact).
    RatioPct,
    /// Chunks reserved as answers flowed past their reservations.
    Chunks,
    /// Answers the filter ended early (their limits refused a chunk).
    Ended,
}

impl CostStat {
    pub const ALL: [CostStat; 21] = [
        CostStat::EstimatedUnits,
        CostStat::SettledUnits,
        CostStat::Settles,
        CostStat::OverUnits,
        CostStat::UnderUnits,
        CostStat::Cut,
        CostStat::WrittenOffUnits,
        CostStat::InDebt,
        CostStat::Unusable(crate::cost::Unusable::Reset),
        CostStat::Unusable(crate::cost::Unusable::Missing),
        CostStat::Unusable(crate::cost::Unusable::Malformed),
        CostStat::Unusable(crate::cost::Unusable::TooLarge),
        CostStat::Unusable(crate::cost::Unusable::Upstream5xx),
        CostStat::Unusable(crate::cost::Unusable::Upstream4xx),
        CostStat::Unusable(crate::cost::Unusable::LocalReply),
        CostStat::Unusable(crate::cost::Unusable::NoResponse),
        CostStat::Unusable(crate::cost::Unusable::Encoded),
        CostStat::UsageRequested,
        CostStat::RatioPct,
        CostStat::Chunks,
        CostStat::Ended,
    ];

    fn write_name(self, out: &mut String) -> std::fmt::Result {
        use std::fmt::Write;
        match self {
            CostStat::EstimatedUnits => out.write_str("estimated_units"),
            CostStat::SettledUnits => out.write_str("settled_units"),
            CostStat::Settles => out.write_str("settles"),
            CostStat::OverUnits => out.write_str("over_units"),
            CostStat::UnderUnits => out.write_str("under_units"),
            CostStat::Cut => out.write_str("cut_to_ceiling"),
            CostStat::WrittenOffUnits => out.write_str("written_off_units"),
            CostStat::InDebt => out.write_str("in_debt"),
            CostStat::Unusable(u) => write!(out, "unusable_{}", u.as_str()),
            CostStat::UsageRequested => out.write_str("usage_requested"),
            CostStat::RatioPct => out.write_str("ratio_pct"),
            CostStat::Chunks => out.write_str("chunks"),
            CostStat::Ended => out.write_str("ended"),
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|s| *s == self).unwrap_or(0)
    }
}

/// Every metric the filter reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric<'a> {
    /// `tenantgate.stats.flushes`: ticks that gave pending counts to the
    /// sink (tests wait on it to read settled counters).
    Flushes,
    /// `tenantgate.decisions.<reason>`.
    Decision(Reason),
    /// `tenantgate.cas.retries`.
    CasRetries,
    /// `tenantgate.identity.anonymous` / `.invalid`.
    Anonymous,
    InvalidIdentity,
    /// `tenantgate.config.loads` / `.rejections`.
    ConfigLoads,
    ConfigRejections,
    /// `tenantgate.reply_failures`: local replies Envoy refused to send.
    ReplyFailures,
    /// `tenantgate.key_table.inserts` / `.reclaims` / `.overflows`.
    TableInserts,
    TableReclaims,
    TableOverflows,
    /// `tenantgate.guard.refunds`.
    GuardRefunds,
    /// `tenantgate.queue.<held|admitted|rejected|full|cancelled>`: the
    /// rate-limit queue (`on_limit: queue`).
    QueueHeld,
    QueueAdmitted,
    QueueRejected,
    QueueFull,
    QueueCancelled,
    /// `tenantgate.sync.<name>`.
    Sync(SyncStat),
    /// `tenantgate.lease.<name>`.
    Lease(LeaseStat),
    /// `tenantgate.limits_endpoint.answers`: the self-service endpoint's
    /// answers (never counted as decisions).
    LimitsAnswered,
    /// `tenantgate.admission.<outcome>.<criticality>` (`admitted` or a
    /// refusal's reason).
    Admission(Option<Reason>, Criticality),
    /// `tenantgate.admission.queued.<criticality>`: requests held for a slot.
    Queued(Criticality),
    /// `tenantgate.admission.fair_drops.b<NN>`.
    FairDrop(u8),
    /// `tenantgate.admission.degraded.<name>`.
    Degraded(DegradedStat),
    /// `tenantgate.admission.degraded.last_age_ms` (gauge).
    DegradedLastAgeMs,
    /// `tenantgate.admission.in_flight.<dependency>` (gauge, node-wide).
    InFlight(&'a str),
    /// `tenantgate.admission.action_in_flight.<action>` (gauge, node-wide).
    ActionInFlight(&'a str),
    /// `tenantgate.admission.queue_depth.<dependency>` (gauge: each worker
    /// adds the change of its own queue's length).
    QueueDepth(&'a str),
    /// `tenantgate.admission.queue_oldest_ms.<dependency>` (gauge: the
    /// largest any worker reported).
    QueueOldestMs(&'a str),
    /// `tenantgate.admission.retries.<dependency>` (counter).
    Retries(&'a str),
    /// `tenantgate.admission.retry_amplification_permille.<dependency>`.
    RetryAmplification(&'a str),
    /// An adaptive controller's gauges.
    Controller(&'a str, ControllerStat),
    /// `tenantgate.admission.breaker_state.<dependency>` ([`Phase`](crate::admission::breaker::Phase) as a number).
    BreakerState(&'a str),
    /// `tenantgate.admission.breaker_ramp_permille.<dependency>`.
    BreakerRamp(&'a str),
    /// `tenantgate.admission.breaker_<opened|half_opened|ramping|closed>.<dependency>`:
    /// transitions into a phase, each counted once per node.
    BreakerEntered(&'a str, BreakerPhase),
    /// `tenantgate.admission.breaker_probes.<dependency>`: requests let
    /// through as half-open probes.
    BreakerProbes(&'a str),
    /// `tenantgate.cost.<stat>.<class>`: a route class's settled costs.
    Cost(&'a str, CostStat),
}

impl Metric<'_> {
    /// Counter, gauge or histogram.
    pub fn kind(&self) -> Kind {
        match self {
            Metric::Sync(s) => s.kind(),
            Metric::Cost(_, CostStat::RatioPct) => Kind::Histogram,
            Metric::DegradedLastAgeMs
            | Metric::InFlight(_)
            | Metric::ActionInFlight(_)
            | Metric::QueueDepth(_)
            | Metric::QueueOldestMs(_)
            | Metric::RetryAmplification(_)
            | Metric::Controller(..)
            | Metric::BreakerState(_)
            | Metric::BreakerRamp(_) => Kind::Gauge,
            _ => Kind::Counter,
        }
    }

    /// Writes the metric's name into `out` (cleared first).
    pub fn name(&self, out: &mut String) {
        use std::fmt::Write;
        out.clear();
        let _ = match self {
            Metric::Flushes => write!(out, "tenantgate.stats.flushes"),
            Metric::Decision(r) => write!(out, "tenantgate.decisions.{}", r.as_str()),
            Metric::CasRetries => write!(out, "tenantgate.cas.retries"),
            Metric::Anonymous => write!(out, "tenantgate.identity.anonymous"),
            Metric::InvalidIdentity => write!(out, "tenantgate.identity.invalid"),
            Metric::ConfigLoads => write!(out, "tenantgate.config.loads"),
            Metric::ConfigRejections => write!(out, "tenantgate.config.rejections"),
            Metric::ReplyFailures => write!(out, "tenantgate.reply_failures"),
            Metric::TableInserts => write!(out, "tenantgate.key_table.inserts"),
            Metric::TableReclaims => write!(out, "tenantgate.key_table.reclaims"),
            Metric::TableOverflows => write!(out, "tenantgate.key_table.overflows"),
            Metric::GuardRefunds => write!(out, "tenantgate.guard.refunds"),
            Metric::QueueHeld => write!(out, "tenantgate.queue.held"),
            Metric::QueueAdmitted => write!(out, "tenantgate.queue.admitted"),
            Metric::QueueRejected => write!(out, "tenantgate.queue.rejected"),
            Metric::QueueFull => write!(out, "tenantgate.queue.full"),
            Metric::QueueCancelled => write!(out, "tenantgate.queue.cancelled"),
            Metric::Sync(s) => write!(out, "tenantgate.sync.{}", s.name()),
            Metric::Lease(s) => write!(out, "tenantgate.lease.{}", s.name()),
            Metric::LimitsAnswered => write!(out, "tenantgate.limits_endpoint.answers"),
            Metric::Admission(o, c) => write!(
                out,
                "tenantgate.admission.{}.{}",
                o.map_or("admitted", Reason::as_str),
                c.as_str()
            ),
            Metric::Queued(c) => write!(out, "tenantgate.admission.queued.{}", c.as_str()),
            Metric::FairDrop(b) => write!(out, "tenantgate.admission.fair_drops.b{b:02}"),
            Metric::Degraded(s) => write!(out, "tenantgate.admission.degraded.{}", s.name()),
            Metric::DegradedLastAgeMs => write!(out, "tenantgate.admission.degraded.last_age_ms"),
            Metric::InFlight(d) => write!(out, "tenantgate.admission.in_flight.{d}"),
            Metric::ActionInFlight(a) => write!(out, "tenantgate.admission.action_in_flight.{a}"),
            Metric::QueueDepth(d) => write!(out, "tenantgate.admission.queue_depth.{d}"),
            Metric::QueueOldestMs(d) => write!(out, "tenantgate.admission.queue_oldest_ms.{d}"),
            Metric::Retries(d) => write!(out, "tenantgate.admission.retries.{d}"),
            Metric::RetryAmplification(d) => {
                write!(out, "tenantgate.admission.retry_amplification_permille.{d}")
            }
            Metric::Controller(d, s) => write!(out, "tenantgate.admission.{}.{d}", s.name()),
            Metric::BreakerState(d) => write!(out, "tenantgate.admission.breaker_state.{d}"),
            Metric::BreakerRamp(d) => write!(out, "tenantgate.admission.breaker_ramp_permille.{d}"),
            Metric::BreakerEntered(d, p) => write!(out, "tenantgate.admission.breaker_{}.{d}", p.entered()),
            Metric::BreakerProbes(d) => write!(out, "tenantgate.admission.breaker_probes.{d}"),
            Metric::Cost(class, stat) => out
                .write_str("tenantgate.cost.")
                .and_then(|()| stat.write_name(out))
                .and_then(|()| write!(out, ".{class}")),
        };
    }

    /// The metrics every worker defines when it starts (the rest are
    /// defined with the policy that names them: see [`policy_metrics`]).
    pub fn fixed() -> Vec<Metric<'static>> {
        let mut all = vec![
            Metric::Flushes,
            Metric::CasRetries,
            Metric::Anonymous,
            Metric::InvalidIdentity,
            Metric::ConfigLoads,
            Metric::ConfigRejections,
            Metric::ReplyFailures,
            Metric::TableInserts,
            Metric::TableReclaims,
            Metric::TableOverflows,
            Metric::GuardRefunds,
            Metric::QueueHeld,
            Metric::QueueAdmitted,
            Metric::QueueRejected,
            Metric::QueueFull,
            Metric::QueueCancelled,
            Metric::DegradedLastAgeMs,
            Metric::LimitsAnswered,
        ];
        all.extend(Reason::ALL.map(Metric::Decision));
        all.extend(SyncStat::ALL.map(Metric::Sync));
        all.extend(LeaseStat::ALL.map(Metric::Lease));
        for outcome in ADMISSION_OUTCOMES {
            all.extend(Criticality::ALL.map(|c| Metric::Admission(outcome, c)));
        }
        all.extend(Criticality::ALL.map(Metric::Queued));
        all.extend((0..FAIR_DROP_BUCKETS as u8).map(Metric::FairDrop));
        all.extend(DegradedStat::ALL.map(Metric::Degraded));
        all
    }
}

/// The metrics a policy's dependencies and action limits name.
pub fn policy_metrics(policy: &crate::policy::Policy) -> Vec<Metric<'_>> {
    let mut all = Vec::new();
    for d in &policy.dependencies {
        let n = d.name.as_str();
        all.extend([
            Metric::InFlight(n),
            Metric::QueueDepth(n),
            Metric::QueueOldestMs(n),
            Metric::Retries(n),
            Metric::RetryAmplification(n),
        ]);
        if d.adaptive.is_some() {
            all.extend(ControllerStat::ALL.map(|s| Metric::Controller(n, s)));
        }
        if d.breaker.is_some() {
            all.extend([
                Metric::BreakerState(n),
                Metric::BreakerRamp(n),
                Metric::BreakerProbes(n),
            ]);
            all.extend(BreakerPhase::ALL.map(|p| Metric::BreakerEntered(n, p)));
        }
    }
    all.extend(policy.actions.iter().map(|a| Metric::ActionInFlight(&a.name)));
    for class in policy.route_classes().filter(|c| c.settle.is_some()) {
        all.extend(CostStat::ALL.map(|s| Metric::Cost(&class.name, s)));
    }
    all
}

/// Where the stats go: the host's metrics (Envoy's, through hostcalls), or
/// the in-memory stats of the tools and tests ([`crate::memory::MemoryStats`]).
/// Every method is infallible: a stat that cannot be kept is dropped,
/// never a failure of the request.
pub trait Stats {
    /// Makes a metric exist (at 0) before its first change, so that
    /// dashboards and alerts find it.
    fn define(&mut self, metric: &Metric<'_>);
    /// Adds `n` to a counter or a gauge (negative only for a gauge).
    fn add(&mut self, metric: &Metric<'_>, n: i64);
    /// Sets a gauge, or records a histogram's sample.
    fn set(&mut self, metric: &Metric<'_>, value: u64);
    /// A gauge's current value, node-wide (`None`: unknown).
    fn get(&mut self, metric: &Metric<'_>) -> Option<u64>;
}

/// The outcomes counted per criticality level
/// (`tenantgate.admission.<outcome>.<criticality>`).
pub const ADMISSION_OUTCOMES: [Option<Reason>; 15] = [
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

/// A worker's counts not yet given to the sink (see the module header):
/// plain integers, so counting costs a request nothing.
#[derive(Debug, Default)]
pub struct Pending {
    decisions: [u64; Reason::ALL.len()],
    cas_retries: u64,
    anonymous: u64,
    invalid_identity: u64,
    table: [u64; 3],
    refunds: u64,
    no_lease: u64,
    admission: [[u64; 4]; ADMISSION_OUTCOMES.len()],
    queued: [u64; 4],
    degraded: [u64; DegradedStat::ALL.len()],
    /// Rare counters (queue events, fair drops, retries, probes, reply
    /// failures): by metric, summed until the tick.
    rare: Vec<(Metric<'static>, u64)>,
    /// Rare counters named by a dependency: `(metric, dependency)`.
    named: Vec<(NamedCounter, String, u64)>,
    /// Settled-cost counters by route class, and their ratio samples.
    costs: Vec<(String, [u64; CostStat::ALL.len()], Vec<u64>)>,
}

/// The most estimate-ratio samples a worker keeps per class between ticks
/// (beyond: not sampled until the tick).
pub const MAX_RATIO_SAMPLES: usize = 64;

/// A counter of one dependency, kept by name until the tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NamedCounter {
    Retries,
    BreakerProbes,
}

impl Pending {
    /// Counts a decision (its reason, CAS retries, key-table event,
    /// refund, lease and identity).
    pub fn decision(&mut self, d: &Decision) {
        if let Some(i) = Reason::ALL.iter().position(|r| *r == d.reason) {
            bump(&mut self.decisions[i], 1);
        }
        bump(&mut self.cas_retries, u64::from(d.cas_retries));
        match d.table {
            TableEvent::None => {}
            TableEvent::Inserted => bump(&mut self.table[0], 1),
            TableEvent::Reclaimed => bump(&mut self.table[1], 1),
            TableEvent::Overflow => bump(&mut self.table[2], 1),
        }
        bump(&mut self.refunds, u64::from(d.refunded));
        bump(&mut self.no_lease, u64::from(d.no_lease));
        if let Subject::Anonymous { invalid_identity, .. } = d.subject {
            bump(&mut self.anonymous, 1);
            bump(&mut self.invalid_identity, u64::from(invalid_identity));
        }
    }

    /// Counts an admission outcome (`None`: admitted) at a level.
    pub fn admission(&mut self, outcome: Option<Reason>, level: Criticality) {
        if let Some(row) = ADMISSION_OUTCOMES
            .iter()
            .position(|o| *o == outcome)
            .and_then(|i| self.admission.get_mut(i))
        {
            if let Some(c) = row.get_mut(level.index()) {
                bump(c, 1);
            }
        }
    }

    /// Counts a request held for a slot.
    pub fn queued(&mut self, level: Criticality) {
        if let Some(c) = self.queued.get_mut(level.index()) {
            bump(c, 1);
        }
    }

    pub fn degraded(&mut self, stat: DegradedStat) {
        if let Some(c) = self.degraded.get_mut(stat.index()) {
            bump(c, 1);
        }
    }

    /// Counts a rare event (a fixed metric).
    pub fn rare(&mut self, metric: Metric<'static>) {
        match self.rare.iter_mut().find(|(m, _)| *m == metric) {
            Some((_, n)) => bump(n, 1),
            None => self.rare.push((metric, 1)),
        }
    }

    /// Counts a rare event of one dependency.
    pub fn named(&mut self, counter: NamedCounter, dependency: &str) {
        match self
            .named
            .iter_mut()
            .find(|(c, d, _)| *c == counter && d == dependency)
        {
            Some((_, _, n)) => bump(n, 1),
            None => self.named.push((counter, dependency.to_owned(), 1)),
        }
    }

    /// Adds `n` to a class's settled-cost counter (the ratio histogram
    /// takes `n` as one sample).
    pub fn cost(&mut self, class: &str, stat: CostStat, n: u64) {
        let i = match self.costs.iter().position(|(c, _, _)| c == class) {
            Some(i) => i,
            None => {
                self.costs
                    .push((class.to_owned(), [0; CostStat::ALL.len()], Vec::new()));
                self.costs.len() - 1
            }
        };
        let Some((_, counts, samples)) = self.costs.get_mut(i) else {
            return;
        };
        if stat == CostStat::RatioPct {
            if samples.len() < MAX_RATIO_SAMPLES {
                samples.push(n);
            }
        } else if let Some(c) = counts.get_mut(stat.index()) {
            bump(c, n);
        }
    }

    /// Gives every count to `stats` and clears it.
    pub fn flush(&mut self, stats: &mut dyn Stats) {
        let mut give = |m: Metric<'_>, n: &mut u64| {
            let taken = std::mem::take(n);
            if taken > 0 {
                stats.add(&m, i64::try_from(taken).unwrap_or(i64::MAX));
            }
        };
        for (r, n) in Reason::ALL.iter().zip(self.decisions.iter_mut()) {
            give(Metric::Decision(*r), n);
        }
        give(Metric::CasRetries, &mut self.cas_retries);
        give(Metric::Anonymous, &mut self.anonymous);
        give(Metric::InvalidIdentity, &mut self.invalid_identity);
        let [inserts, reclaims, overflows] = &mut self.table;
        give(Metric::TableInserts, inserts);
        give(Metric::TableReclaims, reclaims);
        give(Metric::TableOverflows, overflows);
        give(Metric::GuardRefunds, &mut self.refunds);
        give(Metric::Sync(SyncStat::NoLease), &mut self.no_lease);
        for (outcome, row) in ADMISSION_OUTCOMES.iter().zip(self.admission.iter_mut()) {
            for (level, n) in Criticality::ALL.iter().zip(row.iter_mut()) {
                give(Metric::Admission(*outcome, *level), n);
            }
        }
        for (level, n) in Criticality::ALL.iter().zip(self.queued.iter_mut()) {
            give(Metric::Queued(*level), n);
        }
        for (s, n) in DegradedStat::ALL.iter().zip(self.degraded.iter_mut()) {
            give(Metric::Degraded(*s), n);
        }
        for (m, mut n) in self.rare.drain(..) {
            give(m, &mut n);
        }
        for (c, dep, mut n) in self.named.drain(..) {
            let m = match c {
                NamedCounter::Retries => Metric::Retries(&dep),
                NamedCounter::BreakerProbes => Metric::BreakerProbes(&dep),
            };
            give(m, &mut n);
        }
        for (class, counts, _) in &mut self.costs {
            for (s, n) in CostStat::ALL.iter().zip(counts.iter_mut()) {
                give(Metric::Cost(class, *s), n);
            }
        }
        for (class, _, samples) in &mut self.costs {
            for v in samples.drain(..) {
                stats.set(&Metric::Cost(class, CostStat::RatioPct), v);
            }
        }
    }
}

fn bump(c: &mut u64, n: u64) {
    *c = c.saturating_add(n);
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// Every name is distinct, and the names dashboards use are the ones
    /// the filter has always reported.
    #[test]
    fn names_are_distinct_and_stable() {
        let mut names = HashSet::new();
        let mut buf = String::new();
        for m in Metric::fixed() {
            m.name(&mut buf);
            assert!(names.insert(buf.clone()), "{buf} twice");
        }
        let cases = [
            (
                Metric::Decision(Reason::RateLimited),
                "tenantgate.decisions.rate_limited",
            ),
            (
                Metric::Admission(None, Criticality::Critical),
                "tenantgate.admission.admitted.critical",
            ),
            (Metric::FairDrop(3), "tenantgate.admission.fair_drops.b03"),
            (
                Metric::Degraded(DegradedStat::Age(3)),
                "tenantgate.admission.degraded.age_gt_60s",
            ),
            (
                Metric::Controller("db", ControllerStat::P95Us),
                "tenantgate.admission.latency_p95_us.db",
            ),
            (
                Metric::BreakerEntered("db", BreakerPhase::HalfOpen),
                "tenantgate.admission.breaker_half_opened.db",
            ),
            (
                Metric::Sync(SyncStat::ApplyStepUs),
                "tenantgate.sync.apply_step_us",
            ),
        ];
        for (m, name) in cases {
            m.name(&mut buf);
            assert_eq!(buf, name);
        }
    }

    #[test]
    fn degraded_ages_fall_in_their_buckets() {
        assert_eq!(DegradedStat::age(0), DegradedStat::Age(0));
        assert_eq!(DegradedStat::age(1_000), DegradedStat::Age(0));
        assert_eq!(DegradedStat::age(1_001), DegradedStat::Age(1));
        assert_eq!(DegradedStat::age(60_001), DegradedStat::Age(3));
    }
}
