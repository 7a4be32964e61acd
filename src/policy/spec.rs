//! The policy schema as users write it (YAML) and as the filter reads it
//! (JSON): raw, unvalidated structs. Every struct denies unknown fields.
//! [`super::compile`] validates them and builds the immutable [`super::Policy`].
//!
//! Integers are read as `i64` so that a negative or zero value gets the
//! schema's own message (`must be > 0`) rather than serde's type error.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// What a node does for a key whose lease expired with no new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Keep enforcing a local limit at the node's outage allowance (its
    /// equal part of the global rate, sent with every lease).
    FailOpenLocal,
    /// Deny.
    FailClosed,
    /// Admit everything.
    FailOpen,
}

/// `mode:` what the filter does with a decision.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Deny requests over their limits (the default).
    #[default]
    Enforce,
    /// Count, add headers and stats as if enforcing, but never deny.
    Shadow,
    /// Pass every request; no state is touched.
    Off,
}

/// `classify:` where the filter reads a request's route class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Classify {
    /// The route's `filter_metadata.tenantgate.class`, else the route's
    /// name (the default).
    #[default]
    RouteMetadata,
    /// Only the route's name: one property read instead of up to two.
    RouteName,
}

/// `plans.<plan>.limits[i].algorithm:`
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    #[default]
    TokenBucket,
    FixedWindow,
    SlidingWindowLog,
    SlidingWindowCounter,
}

/// A tenantgate policy (docs/policy.md).
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    pub version: String,
    #[serde(default)]
    pub mode: Mode,
    pub identity: IdentitySpec,
    pub plans: BTreeMap<String, PlanSpec>,
    #[serde(default)]
    pub tenants: Vec<TenantSpec>,
    pub default_plan: String,
    pub anonymous: AnonymousSpec,
    pub routes: BTreeMap<String, RouteSpec>,
    #[serde(default)]
    pub default_route: Option<String>,
    #[serde(default)]
    pub classify: Option<Classify>,
    /// This filter instance's route class (one instance per class, enabled
    /// per route by Envoy's `FilterConfig`): no per-request lookup.
    #[serde(default)]
    pub class: Option<String>,
    #[serde(default)]
    pub ratelimit_headers: Option<bool>,
    /// A request path the filter answers itself with the calling tenant's
    /// own limits (off when absent).
    #[serde(default)]
    pub limits_endpoint: Option<String>,
    /// The request header a soft limit marks an over-limit request with
    /// (for route configuration to match), and its response.
    #[serde(default)]
    pub soft_limit_header: Option<String>,
    #[serde(default)]
    pub guards: BTreeMap<String, GuardSpec>,
    /// A price catalogue: what a model's tokens cost (`super::prices`).
    #[serde(default)]
    pub prices: Option<PricesSpec>,
    /// Budgets that nest above the tenant (an organisation, its teams),
    /// root first (`super::levels`).
    #[serde(default)]
    pub levels: Vec<LevelSpec>,
    #[serde(default)]
    pub key_table: Option<KeyTableSpec>,
    #[serde(default)]
    pub sync: Option<SyncSpec>,
    /// Reservable amounts for the central service (`super::quota`).
    #[serde(default)]
    pub quotas: BTreeMap<String, super::quota::ResourceSpec>,
    /// Admission control: the upstream dependencies whose in-flight
    /// requests are limited (`super::admission`).
    #[serde(default)]
    pub dependencies: BTreeMap<String, DependencySpec>,
    /// Admission control per API action (a route class's `action`): its
    /// in-flight limit, node-wide (`super::admission`).
    #[serde(default)]
    pub actions: BTreeMap<String, ActionSpec>,
    /// Envoy rate limit service rules by domain, for `tenantgate serve`'s
    /// RLS (`super::descriptors`).
    #[serde(default)]
    pub descriptors: BTreeMap<String, Vec<super::descriptors::RuleSpec>>,
}

/// `actions.<action>:` an API action's admission limits.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ActionSpec {
    pub max_in_flight: i64,
}

/// `routes.<class>.criticality:` how important a class's requests are
/// (trusted: only the policy sets it, never a request header).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Criticality {
    /// Shed first.
    Sheddable,
    /// The default.
    #[default]
    Normal,
    /// Uses its dependency's `reserved.critical` before the shared pool.
    Critical,
    /// Health and management traffic: uses `reserved.system`, admitted
    /// while everything else is saturated.
    System,
}

/// `dependencies.<name>:` an upstream dependency's admission limits.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct DependencySpec {
    pub max_in_flight: i64,
    #[serde(default)]
    pub max_streams: Option<i64>,
    #[serde(default)]
    pub reserved: Option<ReservedSpec>,
    /// A fraction in (0, 1) of `max_in_flight`, or a whole count ≥ 1.
    #[serde(default)]
    pub tenant_max_share: Option<f64>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub retry_after_window: Option<String>,
    #[serde(default)]
    pub queues: Option<LevelQueuesSpec>,
    /// Refuse every request at once (`paused`), hot-reloadable.
    #[serde(default)]
    pub paused: Option<bool>,
    #[serde(default)]
    pub circuit_breaker: Option<CircuitBreakerSpec>,
    #[serde(default)]
    pub retry_budget: Option<RetryBudgetSpec>,
    #[serde(default)]
    pub adaptive: Option<AdaptiveSpec>,
}

/// `dependencies.<name>.circuit_breaker:` open on errors, probe, ramp up
/// (`crate::admission::breaker`). Every field has a default.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CircuitBreakerSpec {
    /// (errors + timeouts) ÷ completed that opens it, in (0, 1].
    #[serde(default)]
    pub error_rate: Option<f64>,
    #[serde(default)]
    pub min_volume: Option<i64>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub window: Option<String>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub open_for: Option<String>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub max_open_for: Option<String>,
    #[serde(default)]
    pub probes: Option<i64>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub ramp: Option<String>,
    /// The ramp's first level, a fraction of the limit in (0, 1].
    #[serde(default)]
    pub ramp_floor: Option<f64>,
}

/// `dependencies.<name>.retry_budget:` how many retries the dependency
/// takes, as a share of its recent primary requests (`crate::admission::retry`).
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RetryBudgetSpec {
    #[serde(default)]
    pub ratio: Option<f64>,
    #[serde(default)]
    pub min_per_second: Option<i64>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub window: Option<String>,
    /// A request header a trusted earlier hop sets to the attempt number.
    #[serde(default)]
    pub retry_header: Option<String>,
    /// Envoy's `x-envoy-attempt-count`, set by an earlier Envoy hop.
    #[serde(default)]
    pub envoy_attempt_count: Option<bool>,
}

/// `dependencies.<name>.adaptive:` the adaptive concurrency controller
/// (defaults and bounds: [`super::admission::Adaptive`]).
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct AdaptiveSpec {
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub window: Option<String>,
    #[serde(default)]
    pub min: Option<i64>,
    #[serde(default)]
    pub max: Option<i64>,
    #[serde(default)]
    pub buffer: Option<f64>,
    #[serde(default)]
    pub dead_zone: Option<f64>,
    #[serde(default)]
    pub smoothing: Option<f64>,
    #[serde(default)]
    pub max_increase: Option<f64>,
    #[serde(default)]
    pub backoff: Option<f64>,
    #[serde(default)]
    pub error_rate: Option<f64>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub queue_age: Option<String>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub baseline_refresh: Option<String>,
}

/// `dependencies.<name>.reserved:` in-flight slots only one level may use.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ReservedSpec {
    #[serde(default)]
    pub critical: Option<i64>,
    #[serde(default)]
    pub system: Option<i64>,
}

/// `dependencies.<name>.queues:` per criticality level.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct LevelQueuesSpec {
    #[serde(default)]
    pub system: Option<LevelQueueSpec>,
    #[serde(default)]
    pub critical: Option<LevelQueueSpec>,
    #[serde(default)]
    pub normal: Option<LevelQueueSpec>,
    #[serde(default)]
    pub sheddable: Option<LevelQueueSpec>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct LevelQueueSpec {
    #[serde(default)]
    pub max_queue: Option<i64>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub max_wait: Option<String>,
}

/// `sync:` how the node syncs its global limits with the central cluster.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct SyncSpec {
    #[serde(default)]
    pub cluster: Option<String>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub interval: Option<String>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub timeout: Option<String>,
    #[serde(default)]
    pub provisional: Option<i64>,
    #[serde(default)]
    pub failure_mode: Option<FailureMode>,
    #[serde(default)]
    pub node_id: Option<String>,
    #[serde(default)]
    pub region: Option<String>,
    #[serde(default)]
    pub breaker_failures: Option<i64>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub breaker_max_backoff: Option<String>,
}

/// An aggregate limit per node, shared by every tenant of the route classes
/// that name it: protects a dependency regardless of who is calling.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct GuardSpec {
    pub limits: Vec<LimitSpec>,
}

/// `prices:` a price catalogue, per million tokens in `currency`.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PricesSpec {
    /// The catalogue's version (shown by explain; keep it with the prices).
    pub version: String,
    /// An ISO 4217 code (`USD`).
    pub currency: String,
    pub models: BTreeMap<String, ModelPriceSpec>,
}

/// `prices.models.<model>`: prices per million tokens (at most three
/// decimals).
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ModelPriceSpec {
    pub input: f64,
    pub output: f64,
    /// Cached input tokens (default: the input price).
    #[serde(default)]
    pub cached_input: Option<f64>,
    /// Tokens written to a prompt cache (default: the input price).
    #[serde(default)]
    pub cache_write: Option<f64>,
}

/// `levels[]`: one level of nested budgets above the tenant. Its value
/// comes from a trusted source (exactly one of `claim` or `header`); every
/// value has its own budget of `limits`.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct LevelSpec {
    pub name: String,
    /// The level this one nests in (absent: the root).
    #[serde(default)]
    pub parent: Option<String>,
    /// A claim of the JWT payload the tenant's identity is read from.
    #[serde(default)]
    pub claim: Option<String>,
    /// A request header a trusted earlier filter sets (only beside a
    /// header identity).
    #[serde(default)]
    pub header: Option<String>,
    /// Every value's budget (optional below the root).
    #[serde(default)]
    pub limits: Vec<LimitSpec>,
    /// Values with a guaranteed share or a ceiling within their parent.
    #[serde(default)]
    pub members: BTreeMap<String, LevelMemberSpec>,
    /// How each value's budget is shared by its members (the values one
    /// level down, or the tenants below the last level) while it is short.
    #[serde(default)]
    pub sharing: Sharing,
}

/// `levels[].sharing:`
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Sharing {
    /// Max-min fair while the budget holds less than half its burst.
    #[default]
    MaxMin,
    /// First come, first served.
    FirstCome,
}

/// `levels[].members.<value>`: a value's share of its parent's budget.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct LevelMemberSpec {
    /// Percent of the parent's limits kept for this value alone.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = 99)))]
    pub guarantee: Option<i64>,
    /// Percent of the parent's limits this value may use at most
    /// (replaces the level's `limits` for it).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = 100)))]
    pub ceiling: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct KeyTableSpec {
    #[serde(default)]
    pub max_keys: Option<i64>,
}

/// `routes.<class>.on_limit:` what happens to a request over its limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum OnLimit {
    /// Answer 429 at once (the default; right for interactive traffic).
    #[default]
    Reject,
    /// Hold the request (paused, bounded queue) until the limit admits it
    /// or `max_wait` passes; for asynchronous work that can wait.
    Queue,
}

/// Exactly one of `header` or `jwt`.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct IdentitySpec {
    #[serde(default)]
    pub header: Option<String>,
    #[serde(default)]
    pub jwt: Option<JwtSpec>,
}

/// A claim of the JWT payload that Envoy's `jwt_authn` filter verified and
/// wrote to dynamic metadata (`payload_in_metadata`).
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct JwtSpec {
    pub payload_in_metadata: String,
    pub claim: String,
    #[serde(default)]
    pub filter: Option<String>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PlanSpec {
    pub limits: Vec<LimitSpec>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub algorithm: Algorithm,
    /// 1 to 10¹³ (a budget of ten million currency units in micro-units);
    /// a `fixed_window`'s may also be 0 (it refuses every request that
    /// costs anything).
    #[cfg_attr(feature = "schema", schemars(range(min = 0, max = super::values::MAX_LIMIT)))]
    pub rate: i64,
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PER_PATTERN)))]
    pub per: String,
    #[serde(default)]
    pub burst: Option<i64>,
    #[serde(default)]
    pub shadow: Option<bool>,
    #[serde(default)]
    pub global: Option<bool>,
    /// `reject` (the default) or `soft`: over this limit a request is
    /// admitted and marked for a fallback route instead.
    #[serde(default)]
    pub on_limit: Option<LimitOnLimit>,
    /// How far late-settled costs may take this limit past its capacity.
    #[serde(default)]
    pub max_debt: Option<i64>,
    /// With `per: month`: the time zone whose calendar months are the
    /// windows: `UTC`, a fixed offset (`+05:30`, `-08:00`) or an IANA
    /// time zone name (`Europe/Berlin`, `America/New_York`), its changes of
    /// clock included.
    #[serde(default)]
    pub time_zone: Option<String>,
}

/// `…limits[].on_limit:` what a limit does with a request over it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum LimitOnLimit {
    /// Refuse it (429, or the route class's queue).
    #[default]
    Reject,
    /// Admit it, uncharged to this limit, and mark it (a request header
    /// that route configuration matches to send it to a fallback cluster).
    Soft,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    pub id: String,
    pub plan: String,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct AnonymousSpec {
    pub plan: String,
    #[serde(default)]
    pub xff_trusted_hops: Option<i64>,
    #[serde(default)]
    pub ipv4_prefix: Option<i64>,
    #[serde(default)]
    pub ipv6_prefix: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    #[serde(default)]
    pub action: Option<String>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = super::values::MAX_COUNT)))]
    pub cost: Option<i64>,
    #[serde(default)]
    pub guard: Option<String>,
    #[serde(default)]
    pub on_limit: OnLimit,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub max_wait: Option<String>,
    #[serde(default)]
    pub max_queue: Option<i64>,
    #[serde(default)]
    pub failure_mode: Option<FailureMode>,
    #[serde(default)]
    pub criticality: Option<Criticality>,
    #[serde(default)]
    pub dependency: Option<String>,
    #[serde(default)]
    pub retryable: Option<bool>,
    #[serde(default)]
    pub streaming: Option<bool>,
    #[serde(default)]
    pub max_body_bytes: Option<i64>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub min_timeout_budget: Option<String>,
    #[serde(default)]
    pub degradable: Option<DegradableSpec>,
    /// The cost is known after the response: `cost` is charged on the
    /// request as an estimate and the real cost settled at its end.
    #[serde(default)]
    pub settle: Option<SettleSpec>,
}

/// `routes.<class>.settle:` where a request's real cost comes from (one of
/// `header`, `trailer`, `usage`, `fields`: the upstream's response only),
/// its ceiling, what a stream without a usable figure costs, and where the
/// estimate charged on the request comes from (`crate::cost`).
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct SettleSpec {
    /// A response header carrying the cost (an integer).
    #[serde(default)]
    pub header: Option<String>,
    /// A response trailer carrying the cost (an integer).
    #[serde(default)]
    pub trailer: Option<String>,
    /// A ready-made set of fields of a JSON (or server-sent events) body.
    #[serde(default)]
    pub usage: Option<UsagePreset>,
    /// Fields of a JSON (or server-sent events) body, weighted and summed.
    #[serde(default)]
    pub fields: Option<Vec<FieldSpec>>,
    /// With `usage`: a model of the price catalogue (`prices.models`): the
    /// cost is the answer's tokens at its prices, in micro-units.
    #[serde(default)]
    pub price: Option<String>,
    /// No response costs more than this.
    pub ceiling: i64,
    /// What a stream that ends without a usable figure costs.
    #[serde(default)]
    pub on_missing: Option<OnMissing>,
    /// Most response body bytes read for the figure.
    #[serde(default)]
    pub max_body_bytes: Option<i64>,
    /// A trusted request header carrying the estimate (else `cost`).
    #[serde(default)]
    pub estimate_header: Option<String>,
    /// A field of the request's JSON body carrying the estimate (a
    /// top-level name such as `max_tokens`, or a JSON pointer; else `cost`).
    #[serde(default)]
    pub estimate_body_field: Option<String>,
    /// Adds an input estimate to the estimate: one unit per this many bytes
    /// of the request's declared `content-length`.
    #[serde(default)]
    pub estimate_input_bytes_per_token: Option<i64>,
    /// The request methods metered (else `[POST]`); others pass uncharged.
    #[serde(default)]
    pub methods: Option<Vec<String>>,
    /// The request path prefixes metered (else every path); others pass
    /// uncharged.
    #[serde(default)]
    pub paths: Option<Vec<String>>,
    /// What an answer without usable usage costs, by its outcome.
    #[serde(default)]
    pub on_outcome: Option<OutcomeSpec>,
    /// Units reserved at a time when a stream's running cost passes what
    /// it reserved (`crate::cost`, "Metered as it flows").
    #[serde(default)]
    pub chunk: Option<i64>,
    /// What happens to a non-streamed answer whose figure is over its
    /// reservation.
    #[serde(default)]
    pub over_reservation: Option<OverReservation>,
    /// Set `stream_options.include_usage: true` on a streamed request's
    /// JSON body (OpenAI Chat Completions), so its stream ends with usage.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `routes.<class>.settle.over_reservation:` a non-streamed (JSON) answer
/// whose figure is over what its request reserved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum OverReservation {
    /// Passed, and its real cost charged (into debt past the limits; the
    /// default).
    #[default]
    Charge,
    /// The difference is reserved from the tenant's limits like a stream's
    /// chunk; if they refuse it, the answer's last chunk is withheld and
    /// the stream reset.
    Refuse,
}

/// `routes.<class>.settle.on_outcome:` the cost of an answer that is not
/// the operation's success, by outcome (each absent: its default).
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct OutcomeSpec {
    /// The upstream answered 500–599.
    #[serde(default)]
    pub upstream_5xx: Option<Charge>,
    /// The upstream answered 400–499.
    #[serde(default)]
    pub upstream_4xx: Option<Charge>,
    /// Envoy answered 400–599 itself (no healthy upstream, a timeout, ...).
    #[serde(default)]
    pub local_reply: Option<Charge>,
    /// The stream ended before any response header.
    #[serde(default)]
    pub no_response: Option<Charge>,
}

/// What an outcome costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Charge {
    /// Nothing: the estimate is given back.
    Nothing,
    /// The estimate charged on the request.
    Estimate,
    /// The ceiling.
    Ceiling,
}

/// `routes.<class>.settle.usage:` the usage fields of well-known model APIs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum UsagePreset {
    /// OpenAI-style `usage.total_tokens`.
    OpenaiTotal,
    /// OpenAI-style `usage.prompt_tokens`.
    OpenaiPrompt,
    /// OpenAI-style `usage.completion_tokens`.
    OpenaiCompletion,
    /// Anthropic-style `usage.input_tokens + usage.output_tokens` (in a
    /// stream, `message.usage.input_tokens` of its first event too).
    Anthropic,
    /// Google Gemini's `usageMetadata.totalTokenCount` (JSON, or the last
    /// event of a `?alt=sse` stream).
    Gemini,
    /// AWS Bedrock Converse's `usage.totalTokens` (JSON; ConverseStream's
    /// binary event stream is not read).
    Bedrock,
}

/// `routes.<class>.settle.fields[]:` one field of the response body.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct FieldSpec {
    /// A JSON pointer (RFC 6901), e.g. `/usage/completion_tokens`.
    pub pointer: String,
    /// Its weight in the sum (at most three decimals).
    #[serde(default)]
    pub weight: Option<f64>,
}

/// `routes.<class>.settle.on_missing:` the cost of an answer that ended
/// without a usable figure (missing field, malformed or too large body, a
/// compressed body). A stream cut short costs the ceiling whatever this
/// says (the abort rule, `crate::cost::Meter::end`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum OnMissing {
    /// The estimate charged on the request: nothing more is settled.
    Estimate,
    /// The ceiling (the default).
    #[default]
    Ceiling,
}

/// `routes.<class>.degradable:` GET/HEAD requests refused by admission
/// control may be answered from the last good response
/// (`crate::admission::degraded`).
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct DegradableSpec {
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub max_stale: String,
    #[serde(default)]
    pub version_header: Option<String>,
    #[serde(default)]
    pub max_body_bytes: Option<i64>,
    #[serde(default)]
    pub slots: Option<i64>,
    #[serde(default)]
    pub anonymous: Option<bool>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub refresh: Option<String>,
}
