//! The decision vocabulary: why a request got its verdict ([`Reason`]), who
//! it was counted against ([`Subject`]), which limit refused it
//! ([`LimitName`]), and the verdict itself ([`Decision`]).
//!
//! Beneath every module that decides (the engine's rate limits, admission
//! control, the pipeline) and every module that answers (the local reply,
//! the decision record, the stats): it imports nothing of theirs. A limit
//! stays typed until the one place that writes it out.

use std::borrow::Cow;
use std::rc::Rc;

use crate::table::{TableEvent, MAX_RECORDS};

/// Why a request got its verdict; `as_str` is the stable machine-readable
/// reason (the `x-tenantgate-reason` header, the problem body, stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Within every limit.
    Allowed,
    /// Over a limit: 429.
    RateLimited,
    /// Over a limit in shadow mode (or over a shadow limit): allowed, counted.
    ShadowLimited,
    /// Over a soft limit (`on_limit: soft`): allowed, uncharged to it, and
    /// marked for a fallback route.
    SoftLimited,
    /// Over a global guard (an aggregate limit per node): 503.
    GlobalGuard,
    /// The route has no class and the policy has no `default_route`.
    Unclassified,
    /// A request of a class with `settle` outside its metered operation
    /// (`settle.methods`, `settle.paths`): passed, charged nothing.
    Unmetered,
    /// `mode: off`.
    Disabled,
    /// The CAS bound was exhausted: 503.
    Contention,
    /// Shared data could not be read or written: 503.
    StateUnavailable,
    /// Admission: the dependency's in-flight slots for this level are full: 503.
    ConcurrencyLimit,
    /// Admission: the dependency's `max_streams` streams are open: 503.
    StreamLimit,
    /// Admission: the tenant holds its `tenant_max_share`: 503.
    TenantShare,
    /// The declared or streamed body is over `max_body_bytes`: 413.
    RequestTooLarge,
    /// The remaining timeout budget is below `min_timeout_budget`: 503.
    TimeoutBudget,
    /// Admission: the level's queue at the dependency is full: 503.
    QueueFull,
    /// Admission: no slot came within the level's `max_wait`: 503.
    QueueTimeout,
    /// Admission: the dependency's circuit breaker is open: 503.
    CircuitOpen,
    /// Admission: the breaker is half-open and its probes are all in flight: 503.
    CircuitProbeLimit,
    /// Admission: the dependency is `paused: true` in the policy: 503.
    Paused,
    /// Admission: a retry over the dependency's retry budget: 503.
    RetryBudget,
    /// A degradable request found no response fresh enough to answer
    /// from while its dependency refused it: 503.
    DependencyUnavailable,
}

impl Reason {
    pub const ALL: [Reason; 22] = [
        Reason::Allowed,
        Reason::RateLimited,
        Reason::ShadowLimited,
        Reason::SoftLimited,
        Reason::GlobalGuard,
        Reason::Unclassified,
        Reason::Unmetered,
        Reason::Disabled,
        Reason::Contention,
        Reason::StateUnavailable,
        Reason::ConcurrencyLimit,
        Reason::StreamLimit,
        Reason::TenantShare,
        Reason::RequestTooLarge,
        Reason::TimeoutBudget,
        Reason::QueueFull,
        Reason::QueueTimeout,
        Reason::CircuitOpen,
        Reason::CircuitProbeLimit,
        Reason::Paused,
        Reason::RetryBudget,
        Reason::DependencyUnavailable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Allowed => "allowed",
            Reason::RateLimited => "rate_limited",
            Reason::ShadowLimited => "shadow_limited",
            Reason::SoftLimited => "soft_limited",
            Reason::GlobalGuard => "global_guard",
            Reason::Unclassified => "unclassified",
            Reason::Unmetered => "unmetered",
            Reason::Disabled => "disabled",
            Reason::Contention => "contention",
            Reason::StateUnavailable => "state_unavailable",
            Reason::ConcurrencyLimit => "concurrency_limit",
            Reason::StreamLimit => "stream_limit",
            Reason::TenantShare => "tenant_share",
            Reason::RequestTooLarge => "request_too_large",
            Reason::TimeoutBudget => "timeout_budget",
            Reason::QueueFull => "queue_full",
            Reason::QueueTimeout => "queue_timeout",
            Reason::CircuitOpen => "circuit_open",
            Reason::CircuitProbeLimit => "circuit_probe_limit",
            Reason::Paused => "paused",
            Reason::RetryBudget => "retry_budget",
            Reason::DependencyUnavailable => "dependency_unavailable",
        }
    }

    /// The HTTP status of a denial, `None` if the request goes on.
    pub fn deny_status(self) -> Option<u32> {
        match self {
            Reason::RateLimited => Some(429),
            Reason::RequestTooLarge => Some(413),
            Reason::GlobalGuard
            | Reason::Contention
            | Reason::StateUnavailable
            | Reason::ConcurrencyLimit
            | Reason::StreamLimit
            | Reason::TenantShare
            | Reason::TimeoutBudget
            | Reason::QueueFull
            | Reason::QueueTimeout
            | Reason::CircuitOpen
            | Reason::CircuitProbeLimit
            | Reason::Paused
            | Reason::RetryBudget
            | Reason::DependencyUnavailable => Some(503),
            _ => None,
        }
    }
}

/// Who the request was counted against (shared text: a decision copies
/// it without allocating).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// Not looked up (unclassified or disabled).
    None,
    Tenant(Rc<str>),
    /// No usable identity: grouped by client address.
    Anonymous {
        address: Rc<str>,
        invalid_identity: bool,
    },
}

/// The `t` parameter of a `RateLimit` item in whole seconds, from its exact
/// value (`Algo::quota_window_ns`), as draft-ietf-httpapi-ratelimit-headers-11
/// defines it (no more than `r` units within `t`) and -10 reads it (the
/// time until more quota): rounded down while units remain (so no more
/// than `r` fit in it), up at `r = 0` (a client that waits `t` seconds
/// finds a unit; never later than `Retry-After`, which rounds the same or
/// a longer wait up).
pub fn t_secs(remaining: u64, window_ns: u64) -> u64 {
    if remaining == 0 {
        window_ns.div_ceil(crate::limiter::NANOS_PER_SEC)
    } else {
        window_ns / crate::limiter::NANOS_PER_SEC
    }
}

/// The `RateLimit` / `RateLimit-Policy` field values (draft-10 syntax).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitHeaders {
    pub policy: String,
    pub ratelimit: String,
}

impl RateLimitHeaders {
    /// Appends one limit's item of the `RateLimit` header (draft 10:
    /// `"name";r=remaining;t=secs`, `t` from [`t_secs`]), after a `, ` if
    /// `out` has items.
    /// Written by hand: the request path writes one or two a request, and
    /// `format!` costs several times as much.
    pub fn push_item(out: &mut String, name: &str, remaining: u64, t_secs: u64) {
        if !out.is_empty() {
            out.push_str(", ");
        }
        out.push('"');
        out.push_str(name);
        out.push_str("\";r=");
        push_decimal(out, remaining);
        out.push_str(";t=");
        push_decimal(out, t_secs);
    }
}

/// Appends `n` in decimal, as `write!(out, "{n}")` would.
pub fn push_decimal(out: &mut String, mut n: u64) {
    let mut digits = [b'0'; 20];
    let mut start = digits.len();
    while let Some(i) = start.checked_sub(1) {
        if let Some(d) = digits.get_mut(i) {
            *d = b'0' + (n % 10) as u8;
        }
        start = i;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.push_str(std::str::from_utf8(digits.get(start..).unwrap_or_default()).unwrap_or_default());
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub reason: Reason,
    pub subject: Subject,
    /// The denying (or would-be denying) limit.
    pub limit: Option<LimitName>,
    /// Whole seconds until the request would be admitted (denials only).
    pub retry_after_secs: u64,
    pub headers: Option<RateLimitHeaders>,
    /// CAS conflicts this request retried through.
    pub cas_retries: u32,
    /// Exact nanoseconds until the request would be admitted (denials).
    pub wait_ns: u64,
    /// What the key table did for this request.
    pub table: TableEvent,
    /// A guard denied after the tenant was charged: the charge was given back.
    pub refunded: bool,
    /// A global limit got no lease in time and decided by its failure mode
    /// (see `sync::node`, "Never waiting forever").
    pub no_lease: bool,
    /// Units charged beyond the request's cost, for the worker's lease
    /// (see `crate::pipeline::lease`).
    pub leased: u64,
    /// With a lease: what each limit of the key has left on the node after
    /// it, for the `RateLimit` headers of the requests the lease serves.
    pub standings: Option<Box<Standings>>,
    /// Bit i: the plan's limit i was charged (what a late-settled cost is
    /// settled against, see `crate::cost`).
    pub charged: u32,
    /// The class's guard was charged too.
    pub guard_charged: bool,
    /// What each nested level (`levels:`) was charged.
    pub levels_charged: LevelsCharged,
}

/// The most nested levels a policy may have (`levels:`).
pub const MAX_LEVELS: usize = 4;

/// What a request was charged at each nested level (in the policy's
/// order, root first): what a refusal later in the chain gives back and a
/// late-settled cost is settled against.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LevelsCharged {
    /// Bit i of entry l: limit i of what level l charged.
    pub limits: [u32; MAX_LEVELS],
    /// Entry l: level l charged the guaranteed share of the request's
    /// member below it, not the level's pool.
    pub guaranteed: [bool; MAX_LEVELS],
}

impl LevelsCharged {
    /// Whether any level was charged.
    pub fn any(&self) -> bool {
        self.limits.iter().any(|&bits| bits != 0)
    }
}

/// Each limit's standing on the node after a charge, in the plan's order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Standings {
    pub remaining: [u64; MAX_RECORDS],
    /// Each limit's exact `t` (see [`t_secs`]).
    pub t_ns: [u64; MAX_RECORDS],
    pub len: usize,
}

impl Decision {
    /// A decision of `reason` for `subject`, with nothing else known yet.
    pub fn pass(reason: Reason, subject: Subject) -> Decision {
        Decision {
            reason,
            subject,
            limit: None,
            retry_after_secs: 0,
            headers: None,
            cas_retries: 0,
            wait_ns: 0,
            table: TableEvent::None,
            refunded: false,
            no_lease: false,
            leased: 0,
            standings: None,
            charged: 0,
            guard_charged: false,
            levels_charged: LevelsCharged {
                limits: [0; MAX_LEVELS],
                guaranteed: [false; MAX_LEVELS],
            },
        }
    }

    /// A final decision that needs no state (see [`crate::engine::prepare`]).
    pub fn passed(reason: Reason) -> Decision {
        Decision::pass(reason, Subject::None)
    }

    /// The host could not give the time or state needed to decide: 503.
    pub fn unavailable() -> Decision {
        Decision {
            retry_after_secs: 1,
            ..Decision::pass(Reason::StateUnavailable, Subject::None)
        }
    }

    /// The status of the local reply, if the request is denied.
    pub fn deny_status(&self) -> Option<u32> {
        self.reason.deny_status()
    }
}

/// The logical key of one (subject × action): what a key-table slot holds.
/// Actions are names (no `|`), tenant ids have no whitespace, addresses
/// are hex, dots, colons and a `/prefix`.
pub fn logical_key(action: &str, subject: &Subject) -> String {
    let mut key = String::new();
    write_logical_key(&mut key, action, subject);
    key
}

/// [`logical_key`] into a reused buffer.
pub fn write_logical_key(out: &mut String, action: &str, subject: &Subject) {
    out.clear();
    out.push_str(action);
    match subject {
        Subject::Tenant(id) => {
            out.push_str("|t|");
            out.push_str(id);
        }
        Subject::Anonymous { address, .. } => {
            out.push_str("|a|");
            out.push_str(address);
        }
        Subject::None => out.push_str("|-"),
    }
}

/// Which limit refused (or would refuse) a request: typed until the edge,
/// where [`LimitName::problem_name`] writes it into the reply and
/// [`LimitName::record_name`] into the decision record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitName {
    /// A plan's or a guard's rate limit (`limits[].name`).
    Rate(String),
    /// An API action's in-flight limit (`actions.<name>.max_in_flight`).
    Action(String),
    /// A dependency's in-flight or stream limit, breaker, queue, pause or
    /// retry budget (`dependencies.<name>`).
    Dependency(String),
    /// A dependency's cap per tenant (`dependencies.<name>.tenant_max_share`).
    Tenant(String),
    /// A nested level's rate limit (`levels[].limits[]`): `name` is the
    /// limit as its `RateLimit` item names it, `<level>:<limit>`.
    /// `fair_share`: the budget had units left, but the request's member
    /// was over its fair share of it while it was contended
    /// (`sharing: max_min`).
    Level {
        level: Rc<str>,
        name: String,
        fair_share: bool,
    },
}

/// How the reply and the record name an action's limit: `action:<name>`
/// (no dependency name has a `:`).
const ACTION_PREFIX: &str = "action:";

impl LimitName {
    /// The name a refused client reads (the problem's `limit`): a rate
    /// limit's or a dependency's name, `action:<name>` for an action's.
    pub fn problem_name(&self) -> Cow<'_, str> {
        match self {
            LimitName::Rate(n)
            | LimitName::Dependency(n)
            | LimitName::Tenant(n)
            | LimitName::Level { name: n, .. } => Cow::Borrowed(n),
            LimitName::Action(n) => Cow::Owned(format!("{ACTION_PREFIX}{n}")),
        }
    }

    /// A level's refusal of a member over its fair share of the pool.
    pub fn fair_share(&self) -> bool {
        matches!(self, LimitName::Level { fair_share: true, .. })
    }

    /// The nested level whose limit this is (the problem's `level`).
    pub fn level(&self) -> Option<&str> {
        match self {
            LimitName::Level { level, .. } => Some(level),
            _ => None,
        }
    }

    /// The decision record's `limit=`: `action:<name>`, `dependency:<name>`,
    /// `tenant:<dependency>`, or the rate limit's name.
    pub fn record_name(&self) -> String {
        match self {
            LimitName::Rate(n) | LimitName::Level { name: n, .. } => n.clone(),
            LimitName::Action(n) => format!("{ACTION_PREFIX}{n}"),
            LimitName::Dependency(n) => format!("dependency:{n}"),
            LimitName::Tenant(n) => format!("tenant:{n}"),
        }
    }

    /// The bare name, whatever kind of limit it is.
    pub fn name(&self) -> &str {
        match self {
            LimitName::Rate(n)
            | LimitName::Action(n)
            | LimitName::Dependency(n)
            | LimitName::Tenant(n)
            | LimitName::Level { name: n, .. } => n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratelimit_items_are_written_as_format_would() {
        for n in [
            0,
            1,
            9,
            10,
            99,
            100,
            12_345,
            u64::from(u32::MAX),
            u64::MAX - 1,
            u64::MAX,
        ] {
            let mut out = String::from("x");
            push_decimal(&mut out, n);
            assert_eq!(out, format!("x{n}"));
        }
        let mut out = String::new();
        RateLimitHeaders::push_item(&mut out, "gold-s", 99, 1);
        RateLimitHeaders::push_item(&mut out, "gold-d", u64::MAX, 86_400);
        assert_eq!(
            out,
            format!("\"gold-s\";r=99;t=1, \"gold-d\";r={};t=86400", u64::MAX)
        );
    }

    #[test]
    fn limits_are_named_for_the_client_and_the_record() {
        let cases = [
            (LimitName::Rate("free".into()), "free", "free"),
            (
                LimitName::Action("search".into()),
                "action:search",
                "action:search",
            ),
            (LimitName::Dependency("db".into()), "db", "dependency:db"),
            (LimitName::Tenant("db".into()), "db", "tenant:db"),
        ];
        for (limit, problem, record) in cases {
            assert_eq!(limit.problem_name(), problem);
            assert_eq!(limit.record_name(), record);
        }
    }

    #[test]
    fn logical_keys_separate_tenants_addresses_and_nobody() {
        let tenant = Subject::Tenant(Rc::from("acme"));
        let anon = Subject::Anonymous {
            address: Rc::from("203.0.113.0/24"),
            invalid_identity: false,
        };
        assert_eq!(logical_key("orders", &tenant), "orders|t|acme");
        assert_eq!(logical_key("orders", &anon), "orders|a|203.0.113.0/24");
        assert_eq!(logical_key("orders", &Subject::None), "orders|-");
    }
}
