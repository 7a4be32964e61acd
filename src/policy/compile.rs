//! Validation of a [`PolicySpec`] and compilation into a [`Policy`].
//!
//! Every default of the schema is applied here, in one place (and listed in
//! the policy reference in docs/policy.md). Validation collects every error it finds.

use std::collections::BTreeMap;
use std::rc::Rc;

use hashbrown::HashMap;

use super::admission::{ActionLimit, Dependency};
use super::duration::parse_duration_ns;
use super::error::{FieldPath, PolicyError, PolicyErrors};
use super::spec::{self, Classify, IdentitySpec, LimitSpec, PolicySpec};
use super::values::{is_header_name, MAX_COUNT, MAX_WINDOW_RATE};
use super::{
    fnv1a32, is_name, tenant_id, Anonymous, Classification, FailureMode, Guard, Identity, Limit, OnLimit,
    Plan, Policy, RouteClass, SyncSettings, DEFAULT_MAX_KEYS, JWT_AUTHN_FILTER, MAX_LIMITS_PER_PLAN,
    MAX_MAX_KEYS,
};
use crate::limiter::algo::Algo;
use crate::limiter::{
    FixedWindow, Gcra, SlidingWindowCounter, SlidingWindowLog, MAX_LOG_ENTRIES, NANOS_PER_SEC,
};
use crate::table::{self, SLOTS_PER_ENTRY};

pub use super::admission::MAX_QUEUE_WAIT_NS;
/// Default `max_queue`: requests held per worker per class.
pub const DEFAULT_MAX_QUEUE: i64 = 100;

/// Default `soft_limit_header`.
pub const DEFAULT_SOFT_LIMIT_HEADER: &str = "x-tenantgate-soft-limit";
/// Longest `per` window, and longest time a bucket may take to refill.
pub const MAX_WINDOW_SECS: u64 = 366 * 86_400;

struct Errors(Vec<PolicyError>);

impl Errors {
    fn add(&mut self, path: FieldPath, message: impl Into<String>) {
        self.0.push(PolicyError::new(path, message));
    }
}

/// Validates a policy and compiles it, step by step in this order (the
/// errors come in the same order): version, identity, plans, tenants, the
/// default plan, anonymous, guards, the key table, dependencies, action
/// limits, route classes, the default route, classification, sync, quotas,
/// descriptors, the limits endpoint.
pub fn compile(spec: PolicySpec) -> Result<Policy, PolicyErrors> {
    let root = FieldPath::root();
    let mut errors = Errors(Vec::new());
    let version = compile_version(&spec.version, &root.key("version"), &mut errors);
    let identity = compile_identity(&spec.identity, &root.key("identity"), &mut errors);
    // Limits owe late-settled costs (a debt allowance by default) only in
    // a policy with a class that settles.
    let settles = spec.routes.values().any(|r| r.settle.is_some());
    let plans = compile_plans(&spec.plans, settles, &root.key("plans"), &mut errors);
    let tenants = compile_tenants(&spec.tenants, &plans, &root.key("tenants"), &mut errors);
    let default_plan = plans.resolve(&spec.default_plan, root.key("default_plan"), &mut errors);
    let anonymous = compile_anonymous(&spec.anonymous, &root.key("anonymous"), &mut errors, &plans);
    let guards = compile_guards(&spec.guards, settles, &root.key("guards"), &mut errors);
    let key_table_entries = compile_key_table(spec.key_table.as_ref(), &root.key("key_table"), &mut errors);
    let dependencies =
        super::admission::compile_dependencies(&spec.dependencies, &root.key("dependencies"), &mut errors.0);
    let route_actions = spec
        .routes
        .iter()
        .map(|(name, r)| r.action.as_deref().unwrap_or(name.as_str()));
    let actions =
        super::admission::compile_actions(&spec.actions, route_actions, &root.key("actions"), &mut errors.0);
    let before = Compiled {
        plans: &plans.plans,
        guards: &guards,
        guard_specs: &spec.guards,
        dependencies: &dependencies,
        actions: &actions,
    };
    let routes = compile_routes(&spec.routes, &before, &root.key("routes"), &mut errors);
    check_default_route(spec.default_route.as_deref(), &spec.routes, &root, &mut errors);
    let classification = compile_classification(&spec, &routes, &root, &mut errors);
    let global_limits = global_limits(&plans.plans);
    let sync = match (&spec.sync, global_limits.is_empty()) {
        (None, true) => None,
        (sync, _) => Some(compile_sync(sync.as_ref(), &root.key("sync"), &mut errors)),
    };
    let quotas = super::quota::compile(&spec.quotas, &root.key("quotas"), &mut errors.0);
    let descriptors = super::descriptors::compile(
        &spec.descriptors,
        &plans.index,
        &root.key("descriptors"),
        &mut errors.0,
    );
    let limits_endpoint = compile_limits_endpoint(
        spec.limits_endpoint.as_deref(),
        &root.key("limits_endpoint"),
        &mut errors,
    );
    let soft_limit_header = compile_soft_limit_header(
        spec.soft_limit_header.as_deref(),
        &root.key("soft_limit_header"),
        &mut errors,
    );
    let has_soft_limits = plans.plans.iter().flat_map(|p| &p.limits).any(|l| l.soft);
    if !errors.0.is_empty() {
        return Err(PolicyErrors(errors.0));
    }
    Ok(Policy {
        version,
        mode: spec.mode,
        identity,
        plans: plans.plans,
        tenants,
        default_plan,
        anonymous,
        routes,
        default_route: spec.default_route,
        classification,
        guards,
        key_table_entries,
        ratelimit_headers: spec.ratelimit_headers.unwrap_or(true),
        limits_endpoint,
        soft_limit_header,
        has_soft_limits,
        sync,
        global_limits,
        effective_from_ns: 0,
        quotas,
        dependencies,
        actions,
        descriptors,
    })
}

/// `limits_endpoint`: an absolute request path, 2 to 256 printable ASCII
/// characters, no query, no fragment, no space.
fn compile_limits_endpoint(path: Option<&str>, at: &FieldPath, errors: &mut Errors) -> Option<String> {
    let path = path?;
    let ok = path.len() >= 2
        && path.len() <= 256
        && path.starts_with('/')
        && path
            .bytes()
            .all(|b| (0x21..0x7f).contains(&b) && b != b'?' && b != b'#');
    if !ok {
        errors.add(
            at.clone(),
            "must be an absolute path of 2 to 256 printable characters, without `?`, `#` or spaces (e.g. /.well-known/ratelimit)",
        );
        return None;
    }
    Some(path.to_owned())
}

/// `soft_limit_header`: a header name (lower-cased), by default
/// [`DEFAULT_SOFT_LIMIT_HEADER`].
fn compile_soft_limit_header(name: Option<&str>, at: &FieldPath, errors: &mut Errors) -> String {
    let Some(name) = name else {
        return DEFAULT_SOFT_LIMIT_HEADER.to_owned();
    };
    if !is_header_name(name) || name.starts_with(':') {
        errors.add(at.clone(), "must be an HTTP header name (letters, digits, - _ .)");
    }
    name.to_ascii_lowercase()
}

/// The policy's `version`: 1 to 64 printable ASCII characters, trimmed.
fn compile_version(version: &str, path: &FieldPath, errors: &mut Errors) -> String {
    let version = version.trim().to_owned();
    if version.is_empty() || version.len() > 64 || !version.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        errors.add(path.clone(), "must be 1 to 64 printable ASCII characters");
    }
    version
}

/// The compiled plans, indexed in name order, and how a plan's name
/// resolves to its index.
struct Plans<'a> {
    plans: Vec<Plan>,
    index: HashMap<String, usize>,
    specs: &'a BTreeMap<String, spec::PlanSpec>,
}

impl Plans<'_> {
    /// The index of plan `name`; an unknown name is an error at `path`
    /// (and resolves to 0, so that validation goes on).
    fn resolve(&self, name: &str, path: FieldPath, errors: &mut Errors) -> usize {
        match self.index.get(name) {
            Some(i) => *i,
            None => {
                errors.add(
                    path,
                    format!("unknown plan `{name}` (plans: {})", known(self.specs.keys())),
                );
                0
            }
        }
    }
}

/// `plans`: at least one, each with a valid name and its limits.
fn compile_plans<'a>(
    specs: &'a BTreeMap<String, spec::PlanSpec>,
    settles: bool,
    path: &FieldPath,
    errors: &mut Errors,
) -> Plans<'a> {
    if specs.is_empty() {
        errors.add(path.clone(), "at least one plan is required");
    }
    let mut plans = Vec::with_capacity(specs.len());
    let mut index = HashMap::new();
    for (name, plan) in specs {
        let path = path.key(name);
        if !is_name(name) {
            errors.add(
                path.clone(),
                "plan names are 1 to 64 characters of A-Z a-z 0-9 _ - .",
            );
        }
        let owner = Owner {
            plan: name,
            limits: plan.limits.len(),
            global_allowed: true,
            settles,
        };
        let limits = compile_limits(&owner, &plan.limits, &path.key("limits"), errors);
        let ratelimit_policy = ratelimit_policy(&limits);
        index.insert(name.clone(), plans.len());
        plans.push(Plan {
            name: name.clone(),
            limits,
            ratelimit_policy,
        });
    }
    Plans { plans, index, specs }
}

/// The tenant directory: valid, unique ids, each with a known plan.
fn compile_tenants(
    specs: &[spec::TenantSpec],
    plans: &Plans<'_>,
    path: &FieldPath,
    errors: &mut Errors,
) -> HashMap<String, usize> {
    let mut tenants: HashMap<String, usize> = HashMap::with_capacity(specs.len());
    let mut first_seen: HashMap<&str, usize> = HashMap::with_capacity(specs.len());
    for (i, t) in specs.iter().enumerate() {
        let path = path.index(i);
        if tenant_id(t.id.as_bytes()).is_none() {
            errors.add(
                path.key("id"),
                "tenant ids are 1 to 128 bytes with no whitespace or control characters",
            );
        }
        if let Some(first) = first_seen.insert(&t.id, i) {
            errors.add(
                path.key("id"),
                format!("duplicate tenant `{}` (also at tenants[{first}])", t.id),
            );
        }
        let plan = plans.resolve(&t.plan, path.key("plan"), errors);
        tenants.insert(t.id.clone(), plan);
    }
    tenants
}

/// `guards`: global guards, indexed in name order, each with its limits
/// (never global: a guard is an aggregate per node).
fn compile_guards(
    specs: &BTreeMap<String, spec::GuardSpec>,
    settles: bool,
    path: &FieldPath,
    errors: &mut Errors,
) -> Vec<Guard> {
    let mut guards = Vec::with_capacity(specs.len());
    for (name, g) in specs {
        let path = path.key(name);
        if !is_name(name) {
            errors.add(
                path.clone(),
                "guard names are 1 to 64 characters of A-Z a-z 0-9 _ - .",
            );
        }
        let owner = Owner {
            plan: name,
            limits: g.limits.len(),
            global_allowed: false,
            settles,
        };
        let limits = compile_limits(&owner, &g.limits, &path.key("limits"), errors);
        let ratelimit_policy = ratelimit_policy(&limits);
        guards.push(Guard {
            name: name.clone(),
            key: crate::keys::guard(name),
            limits,
            ratelimit_policy,
        });
    }
    guards
}

/// `key_table.max_keys`, as a number of shared-data entries.
fn compile_key_table(spec: Option<&spec::KeyTableSpec>, path: &FieldPath, errors: &mut Errors) -> u64 {
    match spec.and_then(|k| k.max_keys) {
        None => DEFAULT_MAX_KEYS,
        Some(n) if n >= SLOTS_PER_ENTRY as i64 && n as u64 <= MAX_MAX_KEYS => n as u64,
        Some(_) => {
            errors.add(
                path.key("max_keys"),
                format!("must be between {SLOTS_PER_ENTRY} and {MAX_MAX_KEYS}"),
            );
            DEFAULT_MAX_KEYS
        }
    }
    .div_ceil(SLOTS_PER_ENTRY as u64)
}

/// What a route class refers to, compiled before the classes.
struct Compiled<'a> {
    plans: &'a [Plan],
    guards: &'a [Guard],
    guard_specs: &'a BTreeMap<String, spec::GuardSpec>,
    dependencies: &'a [Dependency],
    actions: &'a [ActionLimit],
}

/// `routes`: at least one route class.
fn compile_routes(
    specs: &BTreeMap<String, spec::RouteSpec>,
    before: &Compiled<'_>,
    path: &FieldPath,
    errors: &mut Errors,
) -> HashMap<String, Rc<RouteClass>> {
    if specs.is_empty() {
        errors.add(path.clone(), "at least one route class is required");
    }
    specs
        .iter()
        .map(|(name, r)| {
            let class = compile_route(name, r, before, &path.key(name), errors);
            (name.clone(), Rc::new(class))
        })
        .collect()
}

/// One route class: its name, action, guard, cost, `on_limit`, admission
/// labels and degraded answers.
fn compile_route(
    name: &str,
    r: &spec::RouteSpec,
    before: &Compiled<'_>,
    path: &FieldPath,
    errors: &mut Errors,
) -> RouteClass {
    if !is_name(name) {
        errors.add(
            path.clone(),
            "route class names are 1 to 64 characters of A-Z a-z 0-9 _ - .",
        );
    }
    let action = r.action.clone().unwrap_or_else(|| name.to_owned());
    if r.action.is_some() && !is_name(&action) {
        errors.add(
            path.key("action"),
            "actions are 1 to 64 characters of A-Z a-z 0-9 _ - .",
        );
    }
    let guard = r
        .guard
        .as_ref()
        .and_then(|g| match before.guards.iter().position(|x| &x.name == g) {
            Some(i) => Some(i),
            None => {
                errors.add(
                    path.key("guard"),
                    format!(
                        "unknown guard `{g}` (guards: {})",
                        known(before.guard_specs.keys())
                    ),
                );
                None
            }
        });
    let cost = r.cost.unwrap_or(1);
    check_cost(cost, before, guard, &path.key("cost"), errors);
    let on_limit = compile_on_limit(r, path, errors);
    let labels = super::admission::compile_labels(
        r,
        &action,
        before.dependencies,
        before.actions,
        path,
        &mut errors.0,
    );
    let settle = super::settle::compile_settle(r, cost.max(1) as u64, path, &mut errors.0);
    RouteClass {
        name: name.to_owned(),
        action,
        cost: cost.max(1) as u64,
        guard,
        on_limit,
        failure_mode: r.failure_mode,
        labels,
        degradable: super::admission::compile_degradable(name, r, path, &mut errors.0),
        settle,
    }
}

/// A route class's `cost`: in range, and no larger than the burst of any
/// plan's limit or of its guard's (such requests could never be admitted).
fn check_cost(cost: i64, before: &Compiled<'_>, guard: Option<usize>, path: &FieldPath, errors: &mut Errors) {
    if cost <= 0 {
        errors.add(path.clone(), "must be > 0");
        return;
    }
    if cost > MAX_COUNT {
        errors.add(path.clone(), format!("must be at most {MAX_COUNT}"));
        return;
    }
    let plan_limits = before
        .plans
        .iter()
        .map(|p| (format!("plans.{}", p.name), &p.limits));
    let guard_limits = guard
        .and_then(|i| before.guards.get(i))
        .map(|g| (format!("guards.{}", g.name), &g.limits));
    for (owner, limits) in plan_limits.chain(guard_limits) {
        for (i, l) in limits.iter().enumerate() {
            // A window of 0 refuses every request by design (a rule that
            // blocks), not by a cost set too high.
            if l.burst > 0 && cost as u64 > l.burst {
                errors.add(
                    path.clone(),
                    format!(
                        "{cost} exceeds the burst of {owner}.limits[{i}] ({}): such requests could never be admitted",
                        l.burst
                    ),
                );
            }
        }
    }
}

/// `default_route` names a route class.
fn check_default_route(
    default_route: Option<&str>,
    routes: &BTreeMap<String, spec::RouteSpec>,
    root: &FieldPath,
    errors: &mut Errors,
) {
    if let Some(d) = default_route {
        if !routes.contains_key(d) {
            errors.add(
                root.key("default_route"),
                format!("unknown route class `{d}` (routes: {})", known(routes.keys())),
            );
        }
    }
}

/// How a request's class is found: `classify`, or this instance's fixed `class`.
fn compile_classification(
    spec: &PolicySpec,
    routes: &HashMap<String, Rc<RouteClass>>,
    root: &FieldPath,
    errors: &mut Errors,
) -> Classification {
    match (&spec.class, spec.classify) {
        (None, None | Some(Classify::RouteMetadata)) => Classification::RouteMetadata,
        (None, Some(Classify::RouteName)) => Classification::RouteName,
        (Some(_), Some(_)) => {
            errors.add(
                root.key("classify"),
                "`class` fixes this instance's route class: `classify` does not apply",
            );
            Classification::RouteMetadata
        }
        (Some(c), None) => match routes.get(c) {
            Some(class) => Classification::Instance(class.clone()),
            None => {
                errors.add(
                    root.key("class"),
                    format!(
                        "unknown route class `{c}` (routes: {})",
                        known(spec.routes.keys())
                    ),
                );
                Classification::RouteMetadata
            }
        },
    }
}

/// The plans' global limits, by name hash (what the sync reports).
fn global_limits(plans: &[Plan]) -> HashMap<u32, String> {
    plans
        .iter()
        .flat_map(|p| p.limits.iter())
        .filter(|l| l.global)
        .map(|l| (l.name_hash, l.name.clone()))
        .collect()
}

fn known<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let names: Vec<&str> = names.map(String::as_str).collect();
    if names.is_empty() {
        String::from("none defined")
    } else {
        names.join(", ")
    }
}

fn ratelimit_policy(limits: &[Limit]) -> String {
    limits
        .iter()
        .map(|l| format!("\"{}\";q={};w={}", l.name, l.rate, l.per_secs))
        .collect::<Vec<_>>()
        .join(", ")
}

fn compile_anonymous(
    spec: &spec::AnonymousSpec,
    path: &FieldPath,
    errors: &mut Errors,
    plans: &Plans<'_>,
) -> Anonymous {
    let plan = plans.resolve(&spec.plan, path.key("plan"), errors);
    let mut bounded = |field: &str, value: Option<i64>, default: i64, min: i64, max: i64| -> i64 {
        match value {
            None => default,
            Some(v) if (min..=max).contains(&v) => v,
            Some(_) => {
                errors.add(path.key(field), format!("must be between {min} and {max}"));
                default
            }
        }
    };
    Anonymous {
        plan,
        xff_trusted_hops: bounded("xff_trusted_hops", spec.xff_trusted_hops, 0, 0, 10) as u32,
        ipv4_prefix: bounded("ipv4_prefix", spec.ipv4_prefix, 32, 8, 32) as u8,
        ipv6_prefix: bounded("ipv6_prefix", spec.ipv6_prefix, 64, 16, 128) as u8,
    }
}

/// Default `sync.cluster`.
pub const DEFAULT_SYNC_CLUSTER: &str = "tenantgate";
/// Default `sync.interval`, and its bounds.
pub const DEFAULT_SYNC_INTERVAL_NS: u64 = NANOS_PER_SEC;
pub const MIN_SYNC_INTERVAL_NS: u64 = 100_000_000;
pub const MAX_SYNC_INTERVAL_NS: u64 = 600 * NANOS_PER_SEC;
/// Default `sync.timeout`.
pub const DEFAULT_SYNC_TIMEOUT_NS: u64 = 500_000_000;
/// Default `sync.provisional`.
pub const DEFAULT_PROVISIONAL: i64 = 2;
/// Default `sync.breaker_failures`, and its bounds.
pub const DEFAULT_BREAKER_FAILURES: i64 = 3;
pub const MAX_BREAKER_FAILURES: i64 = 100;
/// Default `sync.breaker_max_backoff`, in sync intervals: two, so that
/// after an outage of any length the open breaker probes within two
/// intervals of the service's return and nodes converge within two
/// intervals (the recovery target) while the callout rate during an
/// outage is halved. A longer backoff protects a struggling service more
/// and delays recovery by as much.
pub const DEFAULT_BREAKER_MAX_BACKOFF_INTERVALS: u64 = 2;
pub const MAX_BREAKER_MAX_BACKOFF_NS: u64 = 3600 * NANOS_PER_SEC;
/// How long `fail_open_local` lasts after a lease expired.
pub const LOCAL_MAX_NS: u64 = 60 * NANOS_PER_SEC;
/// Lease TTLs are cut to this many intervals.
pub const MAX_TTL_INTERVALS: u64 = 10;

/// `sync`: the callout's timing, the provisional allowance, the callout's
/// breaker, and the names the node reports under (errors in that order).
fn compile_sync(spec: Option<&spec::SyncSpec>, path: &FieldPath, errors: &mut Errors) -> SyncSettings {
    let interval_ns = sync_interval(spec, path, errors);
    let timeout_ns = sync_timeout(spec, interval_ns, path, errors);
    let provisional = match spec.and_then(|s| s.provisional).unwrap_or(DEFAULT_PROVISIONAL) {
        n @ 0..=MAX_COUNT => n as u64,
        _ => {
            errors.add(
                path.key("provisional"),
                format!("must be between 0 and {MAX_COUNT}"),
            );
            0
        }
    };
    let breaker_failures = match spec
        .and_then(|s| s.breaker_failures)
        .unwrap_or(DEFAULT_BREAKER_FAILURES)
    {
        n @ 1..=MAX_BREAKER_FAILURES => n as u32,
        _ => {
            errors.add(
                path.key("breaker_failures"),
                format!("must be between 1 and {MAX_BREAKER_FAILURES}"),
            );
            DEFAULT_BREAKER_FAILURES as u32
        }
    };
    let breaker_max_backoff_ns = sync_breaker_max_backoff(spec, interval_ns, path, errors);
    let cluster = spec
        .and_then(|s| s.cluster.clone())
        .unwrap_or_else(|| DEFAULT_SYNC_CLUSTER.to_owned());
    let node_id = spec.and_then(|s| s.node_id.clone());
    let region = spec.and_then(|s| s.region.clone());
    for (field, value) in [
        ("cluster", Some(&cluster)),
        ("node_id", node_id.as_ref()),
        ("region", region.as_ref()),
    ] {
        check_sync_name(value, &path.key(field), errors);
    }
    SyncSettings {
        cluster,
        interval_ns,
        timeout_ns,
        provisional,
        failure_mode: spec
            .and_then(|s| s.failure_mode)
            .unwrap_or(FailureMode::FailOpenLocal),
        node_id,
        region,
        local_max_ns: LOCAL_MAX_NS,
        max_ttl_ns: interval_ns.saturating_mul(MAX_TTL_INTERVALS),
        breaker_failures,
        breaker_max_backoff_ns,
    }
}

/// A `sync` duration field: `default` when absent, `None` (with its error)
/// when it does not parse.
fn sync_duration(
    path: &FieldPath,
    field: &str,
    value: Option<&String>,
    default: u64,
    errors: &mut Errors,
) -> Option<u64> {
    match value.map(|v| parse_duration_ns(v)) {
        None => Some(default),
        Some(Ok(ns)) => Some(ns),
        Some(Err(message)) => {
            errors.add(path.key(field), message);
            None
        }
    }
}

/// `sync.interval`: 100 ms to 10 min (the default after an error).
fn sync_interval(spec: Option<&spec::SyncSpec>, path: &FieldPath, errors: &mut Errors) -> u64 {
    let interval = spec.and_then(|s| s.interval.as_ref());
    match sync_duration(path, "interval", interval, DEFAULT_SYNC_INTERVAL_NS, errors) {
        Some(ns) if (MIN_SYNC_INTERVAL_NS..=MAX_SYNC_INTERVAL_NS).contains(&ns) => ns,
        Some(_) => {
            errors.add(path.key("interval"), "must be between 100ms and 10m");
            DEFAULT_SYNC_INTERVAL_NS
        }
        None => DEFAULT_SYNC_INTERVAL_NS,
    }
}

/// `sync.timeout`: more than 0 and shorter than the interval (0 after an error).
fn sync_timeout(
    spec: Option<&spec::SyncSpec>,
    interval_ns: u64,
    path: &FieldPath,
    errors: &mut Errors,
) -> u64 {
    let timeout_ns = sync_duration(
        path,
        "timeout",
        spec.and_then(|s| s.timeout.as_ref()),
        DEFAULT_SYNC_TIMEOUT_NS.min(interval_ns / 2),
        errors,
    );
    match timeout_ns {
        Some(ns) if ns > 0 && ns < interval_ns => ns,
        Some(_) => {
            errors.add(
                path.key("timeout"),
                "must be more than 0 and less than sync.interval",
            );
            0
        }
        None => 0,
    }
}

/// `sync.breaker_max_backoff`: from the interval to 1 h (the interval
/// after an error).
fn sync_breaker_max_backoff(
    spec: Option<&spec::SyncSpec>,
    interval_ns: u64,
    path: &FieldPath,
    errors: &mut Errors,
) -> u64 {
    match sync_duration(
        path,
        "breaker_max_backoff",
        spec.and_then(|s| s.breaker_max_backoff.as_ref()),
        interval_ns.saturating_mul(DEFAULT_BREAKER_MAX_BACKOFF_INTERVALS),
        errors,
    ) {
        Some(ns) if (interval_ns..=MAX_BREAKER_MAX_BACKOFF_NS).contains(&ns) => ns,
        Some(_) => {
            errors.add(
                path.key("breaker_max_backoff"),
                "must be at least sync.interval and at most 1h",
            );
            interval_ns
        }
        None => interval_ns,
    }
}

/// `sync.cluster`, `sync.node_id`, `sync.region` (when set): 1 to 128
/// printable ASCII characters, no spaces.
fn check_sync_name(value: Option<&String>, path: &FieldPath, errors: &mut Errors) {
    let ok = |t: &str| (1..=128).contains(&t.len()) && t.bytes().all(|b| (0x21..0x7f).contains(&b));
    if value.is_some_and(|v| !ok(v)) {
        errors.add(
            path.clone(),
            "must be 1 to 128 printable ASCII characters, no spaces",
        );
    }
}

fn compile_on_limit(r: &spec::RouteSpec, path: &FieldPath, errors: &mut Errors) -> OnLimit {
    match r.on_limit {
        spec::OnLimit::Reject => {
            for (field, set) in [
                ("max_wait", r.max_wait.is_some()),
                ("max_queue", r.max_queue.is_some()),
            ] {
                if set {
                    errors.add(path.key(field), "only applies with `on_limit: queue`");
                }
            }
            OnLimit::Reject
        }
        spec::OnLimit::Queue => {
            let max_wait_ns = match r.max_wait.as_deref().map(parse_duration_ns) {
                None => {
                    errors.add(path.key("max_wait"), "required with `on_limit: queue`");
                    0
                }
                Some(Err(message)) => {
                    errors.add(path.key("max_wait"), message);
                    0
                }
                Some(Ok(ns)) if ns == 0 || ns > MAX_QUEUE_WAIT_NS => {
                    errors.add(path.key("max_wait"), "must be more than 0 and at most 30s");
                    0
                }
                Some(Ok(ns)) => ns,
            };
            let max_queue = match r.max_queue.unwrap_or(DEFAULT_MAX_QUEUE) {
                n @ 1..=10_000 => n as u32,
                _ => {
                    errors.add(path.key("max_queue"), "must be between 1 and 10000");
                    1
                }
            };
            OnLimit::Queue {
                max_wait_ns,
                max_queue,
            }
        }
    }
}

fn compile_identity(spec: &IdentitySpec, path: &FieldPath, errors: &mut Errors) -> Identity {
    match (&spec.header, &spec.jwt) {
        (Some(header), None) => {
            let valid = !header.is_empty()
                && header.len() <= 128
                && header
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
            if !valid {
                errors.add(
                    path.key("header"),
                    "must be an HTTP header name (letters, digits, - _ .)",
                );
            }
            Identity::Header(header.to_ascii_lowercase())
        }
        (None, Some(jwt)) => {
            let jwt_path = path.key("jwt");
            for (field, value) in [
                ("payload_in_metadata", &jwt.payload_in_metadata),
                ("claim", &jwt.claim),
            ] {
                if value.is_empty() {
                    errors.add(jwt_path.key(field), "must not be empty");
                }
            }
            if jwt.filter.as_deref() == Some("") {
                errors.add(jwt_path.key("filter"), "must not be empty");
            }
            Identity::JwtClaim {
                filter: jwt.filter.clone().unwrap_or_else(|| JWT_AUTHN_FILTER.to_owned()),
                payload_in_metadata: jwt.payload_in_metadata.clone(),
                claim: jwt.claim.clone(),
            }
        }
        _ => {
            errors.add(path.clone(), "set exactly one of `header` or `jwt`");
            Identity::Header(String::new())
        }
    }
}

/// The limits of a plan (or a guard, `global_allowed` false): at least one,
/// at most [`MAX_LIMITS_PER_PLAN`], and together small enough for one
/// key-table slot.
fn compile_limits(
    owner: &Owner<'_>,
    specs: &[LimitSpec],
    path: &FieldPath,
    errors: &mut Errors,
) -> Vec<Limit> {
    if specs.is_empty() {
        errors.add(path.clone(), "at least one limit is required");
    }
    if specs.len() > MAX_LIMITS_PER_PLAN {
        errors.add(
            path.clone(),
            format!("at most {MAX_LIMITS_PER_PLAN} limits per plan"),
        );
    }
    let mut limits: Vec<Limit> = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        if let Some(limit) = compile_limit(spec, owner, &limits, &path.index(i), errors) {
            limits.push(limit);
        }
    }
    check_state_fits(&limits, path, errors);
    limits
}

/// The plan or guard a limit belongs to.
struct Owner<'a> {
    plan: &'a str,
    /// How many limits it has.
    limits: usize,
    global_allowed: bool,
    /// Some route class of the policy settles its cost (`max_debt`'s default).
    settles: bool,
}

/// One limit (`None`: it has an error that leaves nothing to compile):
/// its name, its rate, burst and window, its algorithm, `shadow` and `global`.
fn compile_limit(
    spec: &LimitSpec,
    owner: &Owner<'_>,
    before: &[Limit],
    path: &FieldPath,
    errors: &mut Errors,
) -> Option<Limit> {
    let (name, name_hash) = limit_name(spec, owner, before, path, errors)?;
    let rate = if spec.algorithm == spec::Algorithm::FixedWindow {
        window_rate(spec.rate, &path.key("rate"), errors)
    } else {
        count(spec.rate, &path.key("rate"), errors)
    };
    let burst = match spec.burst {
        Some(b) => count(b, &path.key("burst"), errors),
        None => rate,
    };
    let per_secs = limit_per_secs(&spec.per, &path.key("per"), errors);
    let (Some(rate), Some(burst), Some(per_secs)) = (rate, burst, per_secs) else {
        return None;
    };
    let algo = limit_algo(spec, rate, burst, per_secs, path, errors)?;
    let shadow = spec.shadow.unwrap_or(false);
    let global = spec.global.unwrap_or(false);
    if global && !owner.global_allowed {
        errors.add(
            path.key("global"),
            "a guard is an aggregate per node: only plans' limits can be global",
        );
    } else if global && spec.algorithm != spec::Algorithm::TokenBucket {
        errors.add(path.key("global"), "only token_bucket limits can be global");
    }
    let soft = spec.on_limit == Some(spec::LimitOnLimit::Soft);
    if soft && !owner.global_allowed {
        errors.add(
            path.key("on_limit"),
            "a guard is an aggregate per node: only plans' limits can be soft",
        );
    } else if soft && shadow {
        errors.add(
            path.key("on_limit"),
            "a shadow limit never denies: `on_limit: soft` does not apply",
        );
    }
    let (algo, max_debt) = limit_debt(spec, owner, algo, rate, burst, per_secs, path, errors)?;
    Some(Limit {
        name,
        name_hash,
        rate,
        per_secs,
        burst,
        algo,
        shadow,
        global,
        soft,
        max_debt,
    })
}

/// A limit's debt allowance for late-settled costs (`max_debt`): by
/// default its capacity (a token bucket's burst, a window's rate) in a
/// policy with a class that settles, else 0; a sliding log has none (it is
/// exact); a token bucket must repay it within 366 days.
#[allow(clippy::too_many_arguments)]
fn limit_debt(
    spec: &LimitSpec,
    owner: &Owner<'_>,
    algo: Algo,
    rate: u64,
    burst: u64,
    per_secs: u64,
    path: &FieldPath,
    errors: &mut Errors,
) -> Option<(Algo, u64)> {
    let log = spec.algorithm == spec::Algorithm::SlidingWindowLog;
    let max_debt = match spec.max_debt {
        Some(n) if !(0..=MAX_COUNT).contains(&n) => {
            errors.add(path.key("max_debt"), format!("must be between 0 and {MAX_COUNT}"));
            return None;
        }
        Some(n) if n > 0 && log => {
            errors.add(
                path.key("max_debt"),
                "a sliding_window_log is exact and cannot owe: a settled cost fills it up to its rate",
            );
            return None;
        }
        Some(n) => n as u64,
        None if !owner.settles || log => 0,
        None if spec.algorithm == spec::Algorithm::TokenBucket => burst,
        None => rate,
    };
    let fits = |a: &Algo| match a {
        Algo::TokenBucket(g) => {
            g.tolerance_ns()
                .saturating_add(g.max_debt().saturating_mul(g.interval_ns()))
                / NANOS_PER_SEC
                <= MAX_WINDOW_SECS
        }
        _ => true,
    };
    match algo.with_debt(max_debt) {
        Some(a) if fits(&a) => Some((a, max_debt)),
        _ => {
            errors.add(
                path.key("max_debt"),
                format!(
                    "a debt of {max_debt} at {rate} per {per_secs}s (with a burst of {burst}) takes longer than 366d to repay"
                ),
            );
            None
        }
    }
}

/// A limit's name (the plan's, for a plan's only limit) and its hash,
/// unique among `before`; `None` when a name is required and missing.
fn limit_name(
    spec: &LimitSpec,
    owner: &Owner<'_>,
    before: &[Limit],
    path: &FieldPath,
    errors: &mut Errors,
) -> Option<(String, u32)> {
    let name = match (&spec.name, owner.limits) {
        (Some(n), _) => n.clone(),
        (None, 1) => owner.plan.to_owned(),
        (None, _) => {
            errors.add(path.key("name"), "required when a plan has more than one limit");
            return None;
        }
    };
    if !is_name(&name) {
        errors.add(
            path.key("name"),
            "limit names are 1 to 64 characters of A-Z a-z 0-9 _ - .",
        );
    }
    let name_hash = fnv1a32(name.as_bytes());
    if before.iter().any(|l| l.name == name || l.name_hash == name_hash) {
        errors.add(
            path.key("name"),
            format!("duplicate limit name `{name}` in this plan"),
        );
    }
    Some((name, name_hash))
}

/// A limit's `per`: a whole number of seconds, from 1 s to 366 days.
fn limit_per_secs(per: &str, path: &FieldPath, errors: &mut Errors) -> Option<u64> {
    match parse_duration_ns(per) {
        Err(message) => {
            errors.add(path.clone(), message);
            None
        }
        Ok(ns) if ns < NANOS_PER_SEC || ns % NANOS_PER_SEC != 0 => {
            errors.add(
                path.clone(),
                "must be a whole number of seconds, at least 1s (RateLimit-Policy states w= in seconds)",
            );
            None
        }
        Ok(ns) if ns / NANOS_PER_SEC > MAX_WINDOW_SECS => {
            errors.add(path.clone(), "must be at most 366d");
            None
        }
        Ok(ns) => Some(ns / NANOS_PER_SEC),
    }
}

/// A limit's algorithm with its parameters (`None`: they cannot be
/// represented, with the error that says why).
fn limit_algo(
    spec: &LimitSpec,
    rate: u64,
    burst: u64,
    per_secs: u64,
    path: &FieldPath,
    errors: &mut Errors,
) -> Option<Algo> {
    let window_ns = per_secs * NANOS_PER_SEC;
    if spec.algorithm != spec::Algorithm::TokenBucket && spec.burst.is_some() {
        errors.add(
            path.key("burst"),
            "only token_bucket has a burst: a window algorithm admits `rate` per `per`",
        );
        return None;
    }
    let algo = match spec.algorithm {
        spec::Algorithm::TokenBucket => match Gcra::new(rate, window_ns, burst) {
            Some(g) if g.tolerance_ns() / NANOS_PER_SEC <= MAX_WINDOW_SECS => Some(Algo::TokenBucket(g)),
            _ => {
                errors.add(
                    path.key("burst"),
                    format!("a burst of {burst} at {rate} per {per_secs}s takes longer than 366d to refill"),
                );
                return None;
            }
        },
        spec::Algorithm::FixedWindow => FixedWindow::new(rate, window_ns).map(Algo::FixedWindow),
        spec::Algorithm::SlidingWindowCounter => {
            SlidingWindowCounter::new(rate, window_ns).map(Algo::SlidingWindowCounter)
        }
        spec::Algorithm::SlidingWindowLog => match SlidingWindowLog::new(rate, window_ns) {
            Some(a) => Some(Algo::SlidingWindowLog(a)),
            None => {
                errors.add(
                    path.key("rate"),
                    format!(
                        "sliding_window_log keeps one entry per admitted request, at most {MAX_LOG_ENTRIES} per key: lower the rate or use sliding_window_counter"
                    ),
                );
                return None;
            }
        },
    };
    if algo.is_none() {
        // Rates, windows and bursts are validated above; unreachable.
        errors.add(path.clone(), "these parameters cannot be represented");
    }
    algo
}

/// One key's records for all these limits share one key-table slot: their
/// largest state must fit in it.
fn check_state_fits(limits: &[Limit], path: &FieldPath, errors: &mut Errors) {
    let records_len = limits
        .iter()
        .map(|l| {
            let state = if l.global {
                super::MAX_ALLOWANCE_LEN
            } else {
                l.algo.max_stored_len()
            };
            table::RECORD_HEADER_LEN.saturating_add(state)
        })
        .fold(1usize, usize::saturating_add);
    if records_len > table::MAX_RECORDS_LEN {
        errors.add(
            path.clone(),
            format!(
                "these limits need up to {records_len} bytes of state per key, more than the {} a key-table slot holds: use fewer or smaller sliding_window_log limits",
                table::MAX_RECORDS_LEN
            ),
        );
    }
}

/// A `fixed_window` rate: 0 to [`MAX_WINDOW_RATE`].
fn window_rate(value: i64, path: &FieldPath, errors: &mut Errors) -> Option<u64> {
    match value {
        0..=MAX_WINDOW_RATE => Some(value as u64),
        _ => {
            errors.add(
                path.clone(),
                format!("a fixed_window rate is between 0 and {MAX_WINDOW_RATE}"),
            );
            None
        }
    }
}

/// A positive count no larger than [`MAX_COUNT`].
fn count(value: i64, path: &FieldPath, errors: &mut Errors) -> Option<u64> {
    if value <= 0 {
        errors.add(path.clone(), "must be > 0");
        None
    } else if value > MAX_COUNT {
        errors.add(path.clone(), format!("must be at most {MAX_COUNT}"));
        None
    } else {
        Some(value as u64)
    }
}
