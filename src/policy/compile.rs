//! Validation of a [`PolicySpec`] and compilation into a [`Policy`].
//!
//! Every default of the schema is applied here or in the file that compiles
//! its part, once (and listed in the policy reference in docs/policy.md): a
//! plan's limits in [`super::limits`], `sync` in [`super::sync`], admission
//! in [`super::admission`], a settled cost in [`super::settle`]. Validation
//! collects every error it finds.

use std::collections::BTreeMap;
use std::rc::Rc;

use hashbrown::HashMap;

use super::admission::{ActionLimit, Dependency};
use super::duration::parse_duration_ns;
use super::error::{Errors, FieldPath, PolicyErrors};
use super::limits::{compile_limits, Owner};
use super::spec::{self, Classify, IdentitySpec, PolicySpec};
use super::sync::compile_sync;
use super::values::{is_header_name, MAX_COUNT};
use super::{
    is_name, tenant_id, Anonymous, Classification, Guard, Identity, Limit, OnLimit, Plan, Policy, RouteClass,
    DEFAULT_MAX_KEYS, JWT_AUTHN_FILTER, MAX_MAX_KEYS,
};
use crate::table::SLOTS_PER_ENTRY;

pub use super::admission::MAX_QUEUE_WAIT_NS;
/// Default `max_queue`: requests held per worker per class.
pub const DEFAULT_MAX_QUEUE: i64 = 100;

/// Default `soft_limit_header`.
pub const DEFAULT_SOFT_LIMIT_HEADER: &str = "x-tenantgate-soft-limit";

/// Validates a policy and compiles it, step by step in this order (the
/// errors come in the same order): version, identity, plans, tenants, the
/// default plan, anonymous, guards, prices, levels, the key table, dependencies, action
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
    let prices = super::prices::compile(spec.prices.as_ref(), &root.key("prices"), &mut errors.0);
    let levels =
        super::levels::compile_levels(&spec.levels, &identity, settles, &root.key("levels"), &mut errors);
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
        prices: &prices,
    };
    let routes = compile_routes(&spec.routes, &before, &root.key("routes"), &mut errors);
    check_default_route(spec.default_route.as_deref(), &spec.routes, &root, &mut errors);
    let classification = compile_classification(&spec, &routes, &root, &mut errors);
    let global_limits = global_limits(&plans.plans, &levels);
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
        levels,
        prices,
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
            global_refused: None,
            soft_refused: None,
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
            global_refused: Some("a guard is an aggregate per node"),
            soft_refused: Some("a guard is an aggregate per node"),
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
    prices: &'a super::prices::Prices,
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
    let settle = super::settle::compile_settle(r, cost.max(1) as u64, before.prices, path, &mut errors.0);
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
fn global_limits(plans: &[Plan], levels: &super::levels::Levels) -> HashMap<u32, String> {
    plans
        .iter()
        .flat_map(|p| p.limits.iter())
        .chain(levels.limits())
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

pub(super) fn ratelimit_policy(limits: &[Limit]) -> String {
    limits
        .iter()
        .map(Limit::policy_item)
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
