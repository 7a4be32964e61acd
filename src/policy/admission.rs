//! Admission control in the policy: the `dependencies:` and `actions:` maps
//! and the labels
//! a route class carries (`criticality`, `dependency`, `retryable`,
//! `streaming`, `max_body_bytes`, `min_timeout_budget`), validated and
//! compiled. Every default of these fields is defined here, once, but for a
//! dependency's `adaptive:` ([`super::adaptive`]) and a class's
//! `degradable:` ([`super::degraded`]).
//!
//! Everything is optional: a policy that names none of these fields
//! compiles to [`Labels::default`] on every class and no dependency, and
//! the filter's request path does exactly what it did before (see
//! [`Labels::checks_anything`]). How the filter uses them is in
//! [`crate::admission`].

use std::collections::BTreeMap;

pub use super::adaptive::Adaptive;
use super::adaptive::{compile_adaptive, DEFAULT_ADAPTIVE_WINDOW_NS};
use super::check::{add, duration_in, in_range};
pub use super::degraded::{compile_degradable, Degradable};
use super::error::{FieldPath, PolicyError};
use super::is_name;
pub use super::spec::Criticality;
use super::spec::{
    ActionSpec, CircuitBreakerSpec, DependencySpec, LevelQueueSpec, RetryBudgetSpec, RouteSpec,
};
use super::values::is_header_name;
use crate::limiter::NANOS_PER_SEC;

/// Longest `max_wait` of a queue: a route class's (`on_limit: queue`) or a
/// dependency level's.
pub const MAX_QUEUE_WAIT_NS: u64 = 30 * NANOS_PER_SEC;

/// Largest `max_in_flight` and `max_streams`.
pub const MAX_IN_FLIGHT: i64 = 1_000_000;
/// Largest `max_body_bytes` (1 TiB).
pub const MAX_BODY_BYTES: i64 = 1 << 40;
/// Longest `min_timeout_budget`.
pub const MAX_TIMEOUT_BUDGET_NS: u64 = 3600 * NANOS_PER_SEC;
/// Default `retry_after_window`, and its bounds.
pub const DEFAULT_RETRY_AFTER_WINDOW_NS: u64 = 10 * NANOS_PER_SEC;
pub const MIN_RETRY_AFTER_WINDOW_NS: u64 = NANOS_PER_SEC;
pub const MAX_RETRY_AFTER_WINDOW_NS: u64 = 300 * NANOS_PER_SEC;
/// Bounds of `queues.<level>.max_queue` (default 0: reject at once).
pub const MAX_LEVEL_QUEUE: i64 = 10_000;

/// `circuit_breaker:` defaults (one place; `docs/policy.md` lists them).
/// Error rate that opens the breaker, in permille (50 %).
pub const DEFAULT_BREAKER_ERROR_PERMILLE: u32 = 500;
pub const DEFAULT_BREAKER_MIN_VOLUME: u32 = 20;
pub const DEFAULT_BREAKER_WINDOW_NS: u64 = 10 * NANOS_PER_SEC;
pub const DEFAULT_BREAKER_OPEN_FOR_NS: u64 = 5 * NANOS_PER_SEC;
pub const DEFAULT_BREAKER_MAX_OPEN_FOR_NS: u64 = 60 * NANOS_PER_SEC;
pub const DEFAULT_BREAKER_PROBES: u32 = 3;
pub const DEFAULT_BREAKER_RAMP_NS: u64 = 30 * NANOS_PER_SEC;
/// The ramp's first level, in permille of the limit (10 %).
pub const DEFAULT_BREAKER_RAMP_FLOOR_PERMILLE: u32 = 100;
/// Bounds: `min_volume`, `probes`; the durations' shortest and longest.
pub const MAX_BREAKER_MIN_VOLUME: i64 = 1_000_000;
pub const MAX_BREAKER_PROBES: i64 = 1_000;
pub const MIN_BREAKER_DURATION_NS: u64 = 100 * 1_000_000;
pub const MAX_BREAKER_DURATION_NS: u64 = 3600 * NANOS_PER_SEC;

/// A compiled `dependencies.<name>.circuit_breaker` (semantics in
/// [`crate::admission::breaker`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerSettings {
    /// (errors + timeouts) ÷ completed, in permille, that opens it (1–1000).
    pub error_permille: u32,
    /// Completed requests a window needs before its error rate counts.
    pub min_volume: u32,
    pub window_ns: u64,
    /// The first wait before half-open (doubled at each re-open).
    pub open_for_ns: u64,
    pub max_open_for_ns: u64,
    /// Most probes (upstream calls) per half-open window, node-wide.
    pub probes: u32,
    /// Slow start: from `ramp_floor_permille` of the limit to all of it.
    pub ramp_ns: u64,
    pub ramp_floor_permille: u32,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        BreakerSettings {
            error_permille: DEFAULT_BREAKER_ERROR_PERMILLE,
            min_volume: DEFAULT_BREAKER_MIN_VOLUME,
            window_ns: DEFAULT_BREAKER_WINDOW_NS,
            open_for_ns: DEFAULT_BREAKER_OPEN_FOR_NS,
            max_open_for_ns: DEFAULT_BREAKER_MAX_OPEN_FOR_NS,
            probes: DEFAULT_BREAKER_PROBES,
            ramp_ns: DEFAULT_BREAKER_RAMP_NS,
            ramp_floor_permille: DEFAULT_BREAKER_RAMP_FLOOR_PERMILLE,
        }
    }
}

impl Criticality {
    /// Lowest first: the index of a level in per-level arrays.
    pub const ALL: [Criticality; 4] = [
        Criticality::Sheddable,
        Criticality::Normal,
        Criticality::Critical,
        Criticality::System,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Criticality::Sheddable => "sheddable",
            Criticality::Normal => "normal",
            Criticality::Critical => "critical",
            Criticality::System => "system",
        }
    }

    /// Its position in [`Criticality::ALL`].
    pub fn index(self) -> usize {
        match self {
            Criticality::Sheddable => 0,
            Criticality::Normal => 1,
            Criticality::Critical => 2,
            Criticality::System => 3,
        }
    }
}

/// A route class's admission labels (defaults: `normal`, not retryable, not
/// streaming, no dependency, no size or budget check).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Labels {
    pub criticality: Criticality,
    pub retryable: bool,
    /// Counted against the dependency's `max_streams`, not `max_in_flight`.
    pub streaming: bool,
    /// Index into the policy's dependencies.
    pub dependency: Option<usize>,
    pub max_body_bytes: Option<u64>,
    pub min_timeout_budget_ns: Option<u64>,
    /// Index into the policy's action limits: the class's `action` has an
    /// in-flight limit (`actions.<action>.max_in_flight`).
    pub action_limit: Option<usize>,
}

impl Labels {
    /// Whether a request of this class has any admission check: when not,
    /// the filter does nothing more than without admission control.
    pub fn checks_anything(&self) -> bool {
        self.dependency.is_some()
            || self.action_limit.is_some()
            || self.max_body_bytes.is_some()
            || self.min_timeout_budget_ns.is_some()
    }
}

/// A criticality level's queue at a dependency (`max_queue` 0: refuse at
/// once; see [`crate::admission::queue`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LevelQueue {
    pub max_queue: u32,
    pub max_wait_ns: u64,
}

/// A compiled `dependencies.<name>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dependency {
    pub name: String,
    /// Its shared-data key (see [`crate::keys::dependency`]).
    pub key: String,
    pub max_in_flight: u32,
    /// The separate budget of streaming classes (`None`: no streaming
    /// class may name this dependency).
    pub max_streams: Option<u32>,
    pub reserved_critical: u32,
    pub reserved_system: u32,
    /// Most in-flight requests (and streams) of one tenant, node-wide
    /// (`tenant_max_share` as a count; `None`: no per-tenant cap).
    pub tenant_max: Option<u32>,
    /// Rejections' `Retry-After` is spread over this window.
    pub retry_after_window_ns: u64,
    /// Indexed by [`Criticality::index`].
    pub queues: [LevelQueue; 4],
    /// `paused: true`: every request is refused at once (`paused`).
    pub paused: bool,
    pub breaker: Option<BreakerSettings>,
    /// Its breaker's shared-data key (see [`crate::keys::breaker`]).
    pub breaker_key: String,
    /// `retry_budget:` (see [`crate::admission::retry`]).
    pub retry_budget: Option<RetryBudget>,
    /// The adaptive controller (`None`: `max_in_flight` is the limit).
    pub adaptive: Option<Adaptive>,
}

impl Dependency {
    /// The shared pool: what neither reservation holds.
    pub fn general(&self) -> u32 {
        self.max_in_flight
            .saturating_sub(self.reserved_critical)
            .saturating_sub(self.reserved_system)
    }

    /// The length of its stream-end signal windows
    /// ([`crate::admission::window`]), `None` without a consumer: the
    /// controller's `adaptive.window`, else (a breaker alone) the breaker's
    /// `window` up to [`DEFAULT_ADAPTIVE_WINDOW_NS`], so it is judged at
    /// least every 500 ms over its own (longer) window.
    pub fn signal_window_ns(&self) -> Option<u64> {
        self.adaptive
            .map(|a| a.window_ns)
            .or_else(|| self.breaker.map(|b| b.window_ns.min(DEFAULT_ADAPTIVE_WINDOW_NS)))
    }
}

/// A compiled `actions.<action>`: an API action's in-flight limit,
/// counted node-wide over every class with that `action` (requests and
/// streams together), in the same slots as a dependency's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionLimit {
    pub name: String,
    /// Its shared-data key (see [`crate::keys::action`]).
    pub key: String,
    pub max_in_flight: u32,
}

/// `actions:` in name order (a class's `action_limit` is an index).
/// `route_actions`: every route class's action (an entry naming none is an
/// error: it would limit nothing).
pub fn compile_actions<'a>(
    specs: &BTreeMap<String, ActionSpec>,
    route_actions: impl Iterator<Item = &'a str> + Clone,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Vec<ActionLimit> {
    specs
        .iter()
        .map(|(name, spec)| {
            let at = path.key(name);
            if !route_actions.clone().any(|a| a == name) {
                let mut known: Vec<&str> = route_actions.clone().collect();
                known.sort_unstable();
                known.dedup();
                add(
                    errors,
                    at.clone(),
                    format!(
                        "no route class has action `{name}` (actions: {}): set `routes.<class>.action`, or the class name is its action",
                        known.join(", ")
                    ),
                );
            }
            let max_in_flight = compile_max_in_flight(spec.max_in_flight, &at, errors);
            ActionLimit {
                name: name.clone(),
                key: crate::keys::action(name),
                max_in_flight,
            }
        })
        .collect()
}

/// `<path>.max_in_flight` (a dependency's or an action's): 1 to
/// [`MAX_IN_FLIGHT`]; 1 after an error.
fn compile_max_in_flight(value: i64, path: &FieldPath, errors: &mut Vec<PolicyError>) -> u32 {
    in_range(value, 1, MAX_IN_FLIGHT, &path.key("max_in_flight"), errors).unwrap_or(1)
}

/// `dependencies:` in name order (a route's `dependency` is an index).
pub fn compile_dependencies(
    specs: &BTreeMap<String, DependencySpec>,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Vec<Dependency> {
    specs
        .iter()
        .map(|(name, spec)| compile_dependency(name, spec, &path.key(name), errors))
        .collect()
}

/// One `dependencies.<name>`: its slots (`max_in_flight`, `max_streams`,
/// the reservations), the tenant's share, `Retry-After`'s window, the
/// level queues, then its breaker, controller and retry budget; errors in
/// that order.
fn compile_dependency(
    name: &str,
    spec: &DependencySpec,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Dependency {
    if !is_name(name) {
        add(
            errors,
            path.clone(),
            "dependency names are 1 to 64 characters of A-Z a-z 0-9 _ - .",
        );
    }
    let max_in_flight = compile_max_in_flight(spec.max_in_flight, path, errors);
    let max_streams = spec
        .max_streams
        .and_then(|n| in_range(n, 1, MAX_IN_FLIGHT, &path.key("max_streams"), errors));
    let reserved = compile_reserved(spec, max_in_flight, &path.key("reserved"), errors);
    let tenant_max = spec
        .tenant_max_share
        .and_then(|share| compile_tenant_max(share, max_in_flight, &path.key("tenant_max_share"), errors));
    let retry_after_window_ns = duration_in(
        spec.retry_after_window.as_deref(),
        DEFAULT_RETRY_AFTER_WINDOW_NS,
        (MIN_RETRY_AFTER_WINDOW_NS, MAX_RETRY_AFTER_WINDOW_NS),
        "must be between 1s and 5m",
        &path.key("retry_after_window"),
        errors,
    );
    let queues = compile_queues(spec, &path.key("queues"), errors);
    let breaker = spec
        .circuit_breaker
        .as_ref()
        .map(|b| compile_breaker(b, &path.key("circuit_breaker"), errors));
    let adaptive = spec
        .adaptive
        .as_ref()
        .map(|a| compile_adaptive(a, max_in_flight, reserved.total(), &path.key("adaptive"), errors));
    Dependency {
        name: name.to_owned(),
        key: crate::keys::dependency(name),
        max_in_flight,
        max_streams,
        reserved_critical: reserved.critical,
        reserved_system: reserved.system,
        tenant_max,
        retry_after_window_ns,
        queues,
        paused: spec.paused.unwrap_or(false),
        breaker,
        breaker_key: crate::keys::breaker(name),
        retry_budget: spec
            .retry_budget
            .as_ref()
            .map(|b| compile_retry_budget(name, b, &path.key("retry_budget"), errors)),
        adaptive,
    }
}

/// A dependency's reservations (`reserved.critical`, `reserved.system`).
struct Reserved {
    critical: u32,
    system: u32,
}

impl Reserved {
    fn total(&self) -> u32 {
        self.critical.saturating_add(self.system)
    }
}

/// `reserved:`: each in range, and together less than `max_in_flight`
/// (something must be left for normal and sheddable requests).
fn compile_reserved(
    spec: &DependencySpec,
    max_in_flight: u32,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Reserved {
    let reserved = spec.reserved.as_ref();
    let mut reservation = |field: &str, value: Option<i64>| {
        value.map_or(0, |n| {
            in_range(n, 0, MAX_IN_FLIGHT, &path.key(field), errors).unwrap_or(0)
        })
    };
    let reserved = Reserved {
        critical: reservation("critical", reserved.and_then(|r| r.critical)),
        system: reservation("system", reserved.and_then(|r| r.system)),
    };
    let total = reserved.total();
    if total >= max_in_flight && total > 0 {
        add(
            errors,
            path.clone(),
            format!(
                "reserved.critical + reserved.system ({total}) must be less than max_in_flight ({max_in_flight}): nothing would be left for normal and sheddable requests"
            ),
        );
    }
    reserved
}

/// `tenant_max_share`: a fraction of `max_in_flight` (at least one slot)
/// or a whole count of slots.
fn compile_tenant_max(
    share: f64,
    max_in_flight: u32,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Option<u32> {
    if share > 0.0 && share < 1.0 {
        // A fraction: at least one slot.
        let slots = (share * f64::from(max_in_flight)).ceil();
        Some((slots as u32).clamp(1, max_in_flight))
    } else if share >= 1.0 && share.fract() == 0.0 && share <= f64::from(max_in_flight) {
        Some(share as u32)
    } else {
        add(
            errors,
            path.clone(),
            format!(
                "must be a fraction between 0 and 1 (exclusive) or a whole count from 1 to max_in_flight ({max_in_flight})"
            ),
        );
        None
    }
}

/// `queues:`, one per criticality level (indexed by `Criticality::index`;
/// a level without one refuses at once).
fn compile_queues(spec: &DependencySpec, path: &FieldPath, errors: &mut Vec<PolicyError>) -> [LevelQueue; 4] {
    let mut queues = [LevelQueue::default(); 4];
    if let Some(q) = &spec.queues {
        let levels = [
            (Criticality::Sheddable, &q.sheddable),
            (Criticality::Normal, &q.normal),
            (Criticality::Critical, &q.critical),
            (Criticality::System, &q.system),
        ];
        for (level, queue) in levels {
            if let (Some(queue), Some(slot)) = (queue, queues.get_mut(level.index())) {
                *slot = compile_level_queue(queue, &path.key(level.as_str()), errors);
            }
        }
    }
    queues
}

/// A fraction in (0, 1] as permille (rounded to nearest, at least 1).
fn fraction_permille(value: f64, path: &FieldPath, errors: &mut Vec<PolicyError>) -> Option<u32> {
    if value > 0.0 && value <= 1.0 {
        Some(((value * 1000.0).round() as u32).clamp(1, 1000))
    } else {
        add(
            errors,
            path.clone(),
            "must be a fraction more than 0 and at most 1",
        );
        None
    }
}

/// A breaker duration, [`MIN_BREAKER_DURATION_NS`]–[`MAX_BREAKER_DURATION_NS`].
fn breaker_duration(
    text: Option<&str>,
    default: u64,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> u64 {
    duration_in(
        text,
        default,
        (MIN_BREAKER_DURATION_NS, MAX_BREAKER_DURATION_NS),
        "must be between 100ms and 1h",
        path,
        errors,
    )
}

fn compile_breaker(
    spec: &CircuitBreakerSpec,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> BreakerSettings {
    let d = BreakerSettings::default();
    let error_permille = spec
        .error_rate
        .and_then(|r| fraction_permille(r, &path.key("error_rate"), errors))
        .unwrap_or(d.error_permille);
    let min_volume = spec
        .min_volume
        .and_then(|n| in_range(n, 1, MAX_BREAKER_MIN_VOLUME, &path.key("min_volume"), errors))
        .unwrap_or(d.min_volume);
    let probes = spec
        .probes
        .and_then(|n| in_range(n, 1, MAX_BREAKER_PROBES, &path.key("probes"), errors))
        .unwrap_or(d.probes);
    let window_ns = breaker_duration(spec.window.as_deref(), d.window_ns, &path.key("window"), errors);
    let open_for_ns = breaker_duration(
        spec.open_for.as_deref(),
        d.open_for_ns,
        &path.key("open_for"),
        errors,
    );
    // Without `max_open_for`, at least `open_for` (no backoff past it).
    let max_default = d.max_open_for_ns.max(open_for_ns);
    let max_open_for_ns = breaker_duration(
        spec.max_open_for.as_deref(),
        max_default,
        &path.key("max_open_for"),
        errors,
    );
    if max_open_for_ns < open_for_ns {
        add(
            errors,
            path.key("max_open_for"),
            "must be at least open_for (the first wait)",
        );
    }
    let ramp_ns = breaker_duration(spec.ramp.as_deref(), d.ramp_ns, &path.key("ramp"), errors);
    let ramp_floor_permille = spec
        .ramp_floor
        .and_then(|f| fraction_permille(f, &path.key("ramp_floor"), errors))
        .unwrap_or(d.ramp_floor_permille);
    BreakerSettings {
        error_permille,
        min_volume,
        window_ns,
        open_for_ns,
        max_open_for_ns: max_open_for_ns.max(open_for_ns),
        probes,
        ramp_ns,
        ramp_floor_permille,
    }
}

fn compile_level_queue(spec: &LevelQueueSpec, path: &FieldPath, errors: &mut Vec<PolicyError>) -> LevelQueue {
    let max_queue = spec.max_queue.map_or(0, |n| {
        in_range(n, 0, MAX_LEVEL_QUEUE, &path.key("max_queue"), errors).unwrap_or(0)
    });
    let max_wait_ns = duration_in(
        spec.max_wait.as_deref(),
        0,
        (1, MAX_QUEUE_WAIT_NS),
        "must be more than 0 and at most 30s",
        &path.key("max_wait"),
        errors,
    );
    if max_queue > 0 && spec.max_wait.is_none() {
        add(
            errors,
            path.key("max_wait"),
            "required when max_queue is more than 0",
        );
    }
    LevelQueue {
        max_queue,
        max_wait_ns,
    }
}

/// A route class's labels; `dependencies` and `actions` are the compiled
/// ones, `action` the class's action.
pub fn compile_labels(
    spec: &RouteSpec,
    action: &str,
    dependencies: &[Dependency],
    actions: &[ActionLimit],
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Labels {
    let action_limit = actions.iter().position(|a| a.name == action);
    if action_limit.is_some() && spec.on_limit == super::spec::OnLimit::Queue {
        add(
            errors,
            path.key("on_limit"),
            format!(
                "an in-flight slot is not held across the rate-limit queue yet: action `{action}` has actions.{action}.max_in_flight, so its classes cannot use on_limit: queue"
            ),
        );
    }
    let dependency = spec.dependency.as_ref().and_then(|d| {
        let found = dependencies.iter().position(|x| &x.name == d);
        if found.is_none() {
            let names: Vec<&str> = dependencies.iter().map(|x| x.name.as_str()).collect();
            let known = if names.is_empty() {
                String::from("none defined")
            } else {
                names.join(", ")
            };
            add(
                errors,
                path.key("dependency"),
                format!("unknown dependency `{d}` (dependencies: {known})"),
            );
        }
        found
    });
    if dependency.is_some() && spec.on_limit == super::spec::OnLimit::Queue {
        add(
            errors,
            path.key("dependency"),
            "an in-flight slot is not held across the rate-limit queue yet: a class with a dependency cannot use on_limit: queue",
        );
    }
    let streaming = spec.streaming.unwrap_or(false);
    if streaming {
        match dependency.and_then(|i| dependencies.get(i)) {
            None => add(
                errors,
                path.key("streaming"),
                "a streaming class counts against its dependency's max_streams: name a dependency",
            ),
            Some(d) if d.max_streams.is_none() => add(
                errors,
                path.key("streaming"),
                format!("dependency `{}` has no max_streams for streaming classes", d.name),
            ),
            Some(_) => {}
        }
    }
    let max_body_bytes = spec.max_body_bytes.and_then(|n| {
        if (1..=MAX_BODY_BYTES).contains(&n) {
            u64::try_from(n).ok()
        } else {
            add(
                errors,
                path.key("max_body_bytes"),
                format!("must be between 1 and {MAX_BODY_BYTES}"),
            );
            None
        }
    });
    let min_timeout_budget_ns = match duration_in(
        spec.min_timeout_budget.as_deref(),
        0,
        (1, MAX_TIMEOUT_BUDGET_NS),
        "must be more than 0 and at most 1h",
        &path.key("min_timeout_budget"),
        errors,
    ) {
        0 => None,
        ns => Some(ns),
    };
    Labels {
        criticality: spec.criticality.unwrap_or_default(),
        retryable: spec.retryable.unwrap_or(false),
        streaming,
        dependency,
        max_body_bytes,
        min_timeout_budget_ns,
        action_limit,
    }
}

/// Default `retry_budget.ratio`, as parts per thousand (0.2).
pub const DEFAULT_RETRY_RATIO_PERMILLE: u32 = 200;
/// Default `retry_budget.min_per_second`.
pub const DEFAULT_RETRY_MIN_PER_SECOND: u32 = 1;
/// Largest `retry_budget.min_per_second`.
pub const MAX_RETRY_MIN_PER_SECOND: i64 = 10_000;
/// Default `retry_budget.window`, and its bounds.
pub const DEFAULT_RETRY_WINDOW_NS: u64 = 10 * NANOS_PER_SEC;
pub const MIN_RETRY_WINDOW_NS: u64 = NANOS_PER_SEC;
pub const MAX_RETRY_WINDOW_NS: u64 = 60 * NANOS_PER_SEC;
/// Envoy's attempt-count request header (`include_request_attempt_count`).
pub const ENVOY_ATTEMPT_COUNT_HEADER: &str = "x-envoy-attempt-count";

/// A compiled `dependencies.<name>.retry_budget`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryBudget {
    /// Its shared-data key (see [`crate::keys::retry_budget`]).
    pub key: String,
    /// Retries per thousand recent primary admissions.
    pub ratio_permille: u32,
    /// Retries per second the window allows on top (the floor).
    pub min_per_second: u32,
    pub window_ns: u64,
    /// The trusted retry signals: a header holding the attempt number
    /// (lower-cased), and/or [`ENVOY_ATTEMPT_COUNT_HEADER`].
    pub retry_header: Option<String>,
    pub envoy_attempt_count: bool,
}

fn compile_retry_budget(
    dependency: &str,
    spec: &RetryBudgetSpec,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> RetryBudget {
    let ratio_permille = match spec.ratio {
        None => DEFAULT_RETRY_RATIO_PERMILLE,
        Some(r) if (0.0..=1.0).contains(&r) => (r * 1000.0).round() as u32,
        Some(_) => {
            add(errors, path.key("ratio"), "must be between 0 and 1");
            DEFAULT_RETRY_RATIO_PERMILLE
        }
    };
    let min_per_second = spec.min_per_second.map_or(DEFAULT_RETRY_MIN_PER_SECOND, |n| {
        in_range(
            n,
            0,
            MAX_RETRY_MIN_PER_SECOND,
            &path.key("min_per_second"),
            errors,
        )
        .unwrap_or(DEFAULT_RETRY_MIN_PER_SECOND)
    });
    let window_ns = duration_in(
        spec.window.as_deref(),
        DEFAULT_RETRY_WINDOW_NS,
        (MIN_RETRY_WINDOW_NS, MAX_RETRY_WINDOW_NS),
        "must be between 1s and 1m",
        &path.key("window"),
        errors,
    );
    let retry_header = spec.retry_header.as_ref().map(|h| {
        if !is_header_name(h) {
            add(
                errors,
                path.key("retry_header"),
                "must be an HTTP header name (letters, digits, - _ .)",
            );
        }
        h.to_ascii_lowercase()
    });
    let envoy_attempt_count = spec.envoy_attempt_count.unwrap_or(false);
    if retry_header.is_none() && !envoy_attempt_count {
        add(
            errors,
            path.clone(),
            "no retry signal: set `retry_header` (a header a trusted earlier hop sets) and/or `envoy_attempt_count: true`",
        );
    }
    RetryBudget {
        key: crate::keys::retry_budget(dependency),
        ratio_permille,
        min_per_second,
        window_ns,
        retry_header,
        envoy_attempt_count,
    }
}
