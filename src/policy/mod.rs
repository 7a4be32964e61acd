//! Policies: the schema users write, its validation, and the compiled,
//! immutable form the filter decides with.
//!
//! The flow is `bytes → Node → spec (serde) → compile (validate) → Policy`.
//! YAML and JSON share every step after the first, so the CLI and the filter
//! accept and reject exactly the same policies with the same messages.

pub mod adaptive;
pub mod admission;
mod check;
mod compile;
pub mod de;
pub mod degraded;
pub mod descriptors;
pub mod doc;
pub mod duration;
pub mod error;
pub mod levels;
mod limits;
pub mod prices;
pub mod quota;
#[cfg(feature = "schema")]
pub mod schema;
pub mod settle;
pub mod spec;
mod sync;
pub mod values;

use std::rc::Rc;

use hashbrown::HashMap;

use crate::limiter::algo::Algo;
pub use doc::Node;
pub use error::{FieldPath, PolicyError, PolicyErrors};
pub use spec::FailureMode;
pub use spec::{Classify, Mode};
pub use sync::{LOCAL_MAX_NS, MAX_SYNC_INTERVAL_NS, MIN_SYNC_INTERVAL_NS};

/// The largest policy document accepted, in bytes (its YAML or JSON text,
/// as read): 1 MiB. A policy of a few hundred tenants and routes is tens of
/// KiB; the limit keeps a mistaken or hostile file from costing hundreds of
/// MiB to parse (a 10 MB policy took 337 MB and 4 s) and keeps what the
/// Kubernetes manifests carry under the API server's object size limit.
/// Every reader of a policy (the filter, the module, the CLI, the service)
/// checks it through [`check_size`].
pub const MAX_POLICY_BYTES: usize = 1 << 20;

/// Refuses a policy document of `len` bytes over [`MAX_POLICY_BYTES`].
pub fn check_size(len: usize) -> Result<(), PolicyErrors> {
    if len > MAX_POLICY_BYTES {
        return Err(PolicyErrors::one(
            FieldPath::root(),
            format!("the policy is {len} bytes; the limit is {MAX_POLICY_BYTES} (1 MiB)"),
        ));
    }
    Ok(())
}

/// Longest accepted tenant id, in bytes. Longer identities are treated as
/// missing (the request is grouped as anonymous) and counted.
pub const MAX_TENANT_ID_LEN: usize = 128;
/// The most bytes a global limit's allowance takes in its key's slot: its
/// encoding in `crate::sync::stored` (version, flags, fifteen u64 and a
/// u16 with every optional field set), which is tested to fit. The policy
/// checks that a plan's limits fit one slot with it.
pub const MAX_ALLOWANCE_LEN: usize = 2 + 15 * 8 + 2;
/// Most limits one plan may combine (they share one state entry).
pub const MAX_LIMITS_PER_PLAN: usize = crate::table::MAX_RECORDS;
/// Default and bounds of `key_table.max_keys`.
pub const DEFAULT_MAX_KEYS: u64 = 100_000;
pub const MAX_MAX_KEYS: u64 = 16_777_216;
/// The `filter_metadata` namespace routes carry their class under.
pub const ROUTE_METADATA_NAMESPACE: &str = "tenantgate";
/// The field of that namespace that names the route class.
pub const ROUTE_METADATA_CLASS_FIELD: &str = "class";
/// Envoy's jwt_authn filter name: the default dynamic-metadata namespace.
pub const JWT_AUTHN_FILTER: &str = "envoy.filters.http.jwt_authn";

/// A validated, compiled policy. Built once per configuration; shared by
/// every request of a worker.
#[derive(Debug)]
pub struct Policy {
    pub version: String,
    pub mode: Mode,
    pub identity: Identity,
    plans: Vec<Plan>,
    tenants: HashMap<String, usize>,
    default_plan: usize,
    routes: HashMap<String, Rc<RouteClass>>,
    default_route: Option<String>,
    /// How a request's route class is found.
    pub classification: Classification,
    guards: Vec<Guard>,
    /// `levels:` budgets that nest above the tenant, root first.
    pub levels: levels::Levels,
    /// `prices:` the price catalogue (empty without one).
    pub prices: prices::Prices,
    pub anonymous: Anonymous,
    /// Shared-data entries of the key table (`key_table.max_keys` / slots
    /// per entry, rounded up).
    pub key_table_entries: u64,
    pub ratelimit_headers: bool,
    /// `limits_endpoint:` the path answered with the calling tenant's own
    /// limits (`None`: off; see `crate::pipeline::limits`).
    pub limits_endpoint: Option<String>,
    /// `soft_limit_header:` the request (and response) header a soft limit
    /// marks an over-limit request with (lower-cased).
    pub soft_limit_header: String,
    /// Some plan limit is `on_limit: soft` (then every request of the
    /// policy has the client's copy of `soft_limit_header` removed).
    pub has_soft_limits: bool,
    /// How global limits sync with the central cluster (`None`: the policy
    /// has no global limit and no `sync:` block).
    pub sync: Option<SyncSettings>,
    /// The names of the plans' global limits, by name hash.
    global_limits: HashMap<u32, String>,
    /// When this policy took effect on this worker (ns since the epoch).
    /// The glue sets it in `on_configure`; limits that a reload changed
    /// carry their buckets' fill level over as of this instant.
    pub effective_from_ns: u64,
    /// `quotas:` the reservable resources (the central service's; the
    /// filter only validates them).
    pub quotas: quota::Quotas,
    /// `dependencies:` in name order (admission control).
    pub dependencies: Vec<admission::Dependency>,
    /// `actions:` in name order: in-flight limits per API action.
    pub actions: Vec<admission::ActionLimit>,
    /// `descriptors:` the rules of Envoy's rate limit service (the central
    /// service's; the filter only validates them).
    pub descriptors: descriptors::Descriptors,
}

/// How the filter finds a request's route class: always from route
/// configuration, never from anything the client sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Classification {
    /// `classify: route_metadata` (the default): the route's metadata, else its name.
    RouteMetadata,
    /// `classify: route_name`: the route's name only.
    RouteName,
    /// `class: <name>`: this filter instance serves one class (Envoy
    /// enables it per route); nothing is looked up per request.
    Instance(Rc<RouteClass>),
}

/// Where the tenant id comes from: always a source a trusted filter set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// A request header (lower-cased) that an earlier trusted filter sets.
    Header(String),
    /// A claim of the payload jwt_authn wrote to dynamic metadata.
    JwtClaim {
        filter: String,
        payload_in_metadata: String,
        claim: String,
    },
}

impl Identity {
    /// The property path of a [`Identity::JwtClaim`].
    pub fn property_path(&self) -> Option<[&str; 5]> {
        match self {
            Identity::Header(_) => None,
            Identity::JwtClaim {
                filter,
                payload_in_metadata,
                claim,
            } => Some(["metadata", "filter_metadata", filter, payload_in_metadata, claim]),
        }
    }
}

#[derive(Debug)]
pub struct Plan {
    pub name: String,
    pub limits: Vec<Limit>,
    /// The precomputed `RateLimit-Policy` value for all of the plan's limits.
    pub ratelimit_policy: String,
}

#[derive(Debug)]
pub struct Limit {
    /// The policy name shown in `RateLimit` / `RateLimit-Policy`.
    pub name: String,
    /// Identifies the limit's state across reloads (FNV-1a of the name).
    pub name_hash: u32,
    pub rate: u64,
    pub per_secs: u64,
    pub burst: u64,
    pub algo: Algo,
    /// Counted and reported, never denies.
    pub shadow: bool,
    /// Enforced through leases from the central cluster (`global: true`).
    pub global: bool,
    /// `on_limit: soft`: over it a request is admitted, uncharged to this
    /// limit, and marked for a fallback route (never denies).
    pub soft: bool,
    /// How far late-settled costs may take it past its capacity, in units
    /// (`algo` carries it; see `crate::limiter::token_bucket`, "Debt").
    pub max_debt: u64,
}

impl Limit {
    /// This limit's item of a `RateLimit-Policy` header: `"<name>";q=<rate>;w=<per>`.
    pub fn policy_item(&self) -> String {
        format!("\"{}\";q={};w={}", self.name, self.rate, self.per_secs)
    }
}

/// The compiled `sync:` block (defaults applied).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncSettings {
    /// The Envoy cluster of the central service.
    pub cluster: String,
    pub interval_ns: u64,
    /// The callout timeout.
    pub timeout_ns: u64,
    /// Units a node admits for a new (key, limit) before its first lease.
    pub provisional: u64,
    pub failure_mode: FailureMode,
    /// Overrides Envoy's `node.id` / `node.locality.region`.
    pub node_id: Option<String>,
    pub region: Option<String>,
    /// How long `fail_open_local` lasts after a lease expired.
    pub local_max_ns: u64,
    /// Longer lease TTLs are cut to this.
    pub max_ttl_ns: u64,
    /// Failed syncs in a row that open the circuit breaker.
    pub breaker_failures: u32,
    /// The circuit breaker's longest backoff.
    pub breaker_max_backoff_ns: u64,
}

/// The sync circuit breaker's settings (how the node uses them is in
/// the sync module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Failures in a row that open the breaker (at least 1).
    pub failures: u32,
    /// The longest backoff.
    pub max_backoff_ns: u64,
}

impl SyncSettings {
    /// The circuit breaker's settings.
    pub fn breaker(&self) -> BreakerConfig {
        BreakerConfig {
            failures: self.breaker_failures,
            max_backoff_ns: self.breaker_max_backoff_ns,
        }
    }
}

/// A node-wide aggregate limit (`guards.<name>`).
#[derive(Debug)]
pub struct Guard {
    pub name: String,
    /// Its shared-data key (see [`crate::keys::guard`]).
    pub key: String,
    pub limits: Vec<Limit>,
    pub ratelimit_policy: String,
}

/// How anonymous requests are grouped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Anonymous {
    pub plan: usize,
    /// 0: the connection's address as Envoy reports it (`source.address`);
    /// N: the N-th address from the right of `X-Forwarded-For`.
    pub xff_trusted_hops: u32,
    pub ipv4_prefix: u8,
    pub ipv6_prefix: u8,
}

/// What a route class does with a request over its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnLimit {
    Reject,
    /// Hold it up to `max_wait_ns`, at most `max_queue` held per worker.
    Queue {
        max_wait_ns: u64,
        max_queue: u32,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteClass {
    pub name: String,
    pub action: String,
    pub cost: u64,
    /// Index into the policy's guards.
    pub guard: Option<usize>,
    pub on_limit: OnLimit,
    /// Overrides `sync.failure_mode` for this class's global limits.
    pub failure_mode: Option<FailureMode>,
    /// Admission control (criticality, dependency, request checks).
    pub labels: admission::Labels,
    /// `degradable:` answered from the last good response when refused
    /// (see [`crate::admission::degraded`]).
    pub degradable: Option<admission::Degradable>,
    /// `settle:` `cost` is an estimate; the real cost is settled when the
    /// response ends (see [`crate::cost`]).
    pub settle: Option<settle::Settle>,
}

impl Policy {
    /// Reads a policy from the filter's JSON plugin configuration.
    pub fn from_json(bytes: &[u8]) -> Result<Policy, PolicyErrors> {
        check_size(bytes.len())?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(PolicyErrors::one(FieldPath::root(), "the policy is empty"));
        }
        let node = Node::from_json(bytes).map_err(|m| PolicyErrors::one(FieldPath::root(), m))?;
        Policy::from_node(&node)
    }

    /// Validates and compiles a parsed document (YAML or JSON).
    pub fn from_node(node: &Node) -> Result<Policy, PolicyErrors> {
        match node {
            Node::Map(_) => {}
            Node::Null => return Err(PolicyErrors::one(FieldPath::root(), "the policy is empty")),
            other => {
                return Err(PolicyErrors::one(
                    FieldPath::root(),
                    format!("expected a mapping, found {}", other.kind()),
                ))
            }
        }
        let spec: spec::PolicySpec = de::from_node(node).map_err(|e| PolicyErrors(vec![e]))?;
        compile::compile(spec)
    }

    pub fn plan(&self, index: usize) -> Option<&Plan> {
        self.plans.get(index)
    }

    /// The plan of an identified tenant: its directory entry or the default.
    pub fn plan_of_tenant(&self, tenant: &str) -> usize {
        self.tenants.get(tenant).copied().unwrap_or(self.default_plan)
    }

    pub fn anonymous_plan(&self) -> usize {
        self.anonymous.plan
    }

    /// A dependency by index (a class's `labels.dependency`).
    pub fn dependency(&self, index: usize) -> Option<&admission::Dependency> {
        self.dependencies.get(index)
    }

    /// An action's in-flight limit by index (a class's `labels.action_limit`).
    pub fn action_limit(&self, index: usize) -> Option<&admission::ActionLimit> {
        self.actions.get(index)
    }

    pub fn guard(&self, index: usize) -> Option<&Guard> {
        self.guards.get(index)
    }

    /// The class of a route, by name, or the default class.
    pub fn route_class(&self, name: Option<&str>) -> Option<&Rc<RouteClass>> {
        name.and_then(|n| self.routes.get(n))
            .or_else(|| self.default_route.as_deref().and_then(|d| self.routes.get(d)))
    }

    /// The largest cost of any route class (at least 1): what a lease of
    /// any limit must be able to carry for every route to be admissible.
    pub fn max_cost(&self) -> u64 {
        self.routes.values().map(|r| r.cost).max().unwrap_or(1).max(1)
    }

    pub fn plans(&self) -> &[Plan] {
        &self.plans
    }

    /// The tenant directory: every listed tenant and its plan's index.
    pub fn tenants(&self) -> impl Iterator<Item = (&str, usize)> {
        self.tenants.iter().map(|(t, p)| (t.as_str(), *p))
    }

    /// The plan of tenants not in the directory.
    pub fn default_plan(&self) -> usize {
        self.default_plan
    }

    /// Every route class, by name.
    pub fn route_classes(&self) -> impl Iterator<Item = &RouteClass> {
        self.routes.values().map(|r| r.as_ref())
    }

    /// The failure mode of a request of `class` (`None`: unclassified):
    /// the class's `failure_mode`, else `sync.failure_mode`, else
    /// `fail_open_local`. The one place this rule is written: the engine
    /// applies it when a global limit has no lease, a host when it fails
    /// inside ([`crate::pipeline::failure`]).
    pub fn failure_mode(&self, class: Option<&RouteClass>) -> FailureMode {
        class
            .and_then(|c| c.failure_mode)
            .or_else(|| self.sync.as_ref().map(|s| s.failure_mode))
            .unwrap_or(FailureMode::FailOpenLocal)
    }

    /// The class of routes that name none (`default_route`).
    pub fn default_route(&self) -> Option<&str> {
        self.default_route.as_deref()
    }

    /// Whether some plan has a global limit (then the node syncs).
    pub fn has_global_limits(&self) -> bool {
        !self.global_limits.is_empty()
    }

    /// The name of a global limit, from its name hash.
    pub fn global_limit_name(&self, name_hash: u32) -> Option<&str> {
        self.global_limits.get(&name_hash).map(String::as_str)
    }
}

/// A tenant id as the filter accepts it: 1 to [`MAX_TENANT_ID_LEN`] bytes of
/// UTF-8 with no whitespace and no control characters. Anything else from
/// the identity source is treated as no identity.
pub fn tenant_id(bytes: &[u8]) -> Option<&str> {
    if bytes.is_empty() || bytes.len() > MAX_TENANT_ID_LEN {
        return None;
    }
    let id = core::str::from_utf8(bytes).ok()?;
    if id.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return None;
    }
    Some(id)
}

/// Names of plans, limits, route classes and actions: they appear in
/// headers and shared-data keys, so they are kept to a safe alphabet.
pub(crate) fn is_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// The id of a limit's state inside its key's slot.
pub fn limit_name_hash(name: &str) -> u32 {
    fnv1a32(name.as_bytes())
}

/// FNV-1a, 32 bits: a stable id for a limit's name inside its state entry.
pub(crate) fn fnv1a32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

#[cfg(test)]
mod tests;
