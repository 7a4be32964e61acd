//! Validation of a [`PolicySpec`] and compilation into a [`Policy`].
//!
//! Every default of the schema is applied here, in one place (and listed in
//! the README's policy reference). Validation collects every error it finds.

use hashbrown::HashMap;

use super::duration::parse_duration_ns;
use super::error::{FieldPath, PolicyError, PolicyErrors};
use super::spec::{IdentitySpec, LimitSpec, PolicySpec};
use super::{
    fnv1a32, is_name, tenant_id, Identity, Limit, Plan, Policy, RouteClass, JWT_AUTHN_FILTER,
    MAX_LIMITS_PER_PLAN,
};
use crate::limiter::{Gcra, NANOS_PER_SEC};

/// Largest `rate`, `burst` and `cost` accepted.
pub const MAX_COUNT: i64 = 1_000_000_000;
/// Longest `per` window, and longest time a bucket may take to refill.
pub const MAX_WINDOW_SECS: u64 = 366 * 86_400;

struct Errors(Vec<PolicyError>);

impl Errors {
    fn add(&mut self, path: FieldPath, message: impl Into<String>) {
        self.0.push(PolicyError::new(path, message));
    }
}

pub fn compile(spec: PolicySpec) -> Result<Policy, PolicyErrors> {
    let root = FieldPath::root();
    let mut errors = Errors(Vec::new());

    let version = spec.version.trim().to_owned();
    if version.is_empty() || version.len() > 64 || !version.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        errors.add(root.key("version"), "must be 1 to 64 printable ASCII characters");
    }

    let identity = compile_identity(&spec.identity, &root.key("identity"), &mut errors);

    // Plans, indexed in name order.
    let plans_path = root.key("plans");
    if spec.plans.is_empty() {
        errors.add(plans_path.clone(), "at least one plan is required");
    }
    let mut plans = Vec::with_capacity(spec.plans.len());
    let mut plan_index = HashMap::new();
    for (name, plan) in &spec.plans {
        let path = plans_path.key(name);
        if !is_name(name) {
            errors.add(
                path.clone(),
                "plan names are 1 to 64 characters of A-Z a-z 0-9 _ - .",
            );
        }
        let limits = compile_limits(name, &plan.limits, &path.key("limits"), &mut errors);
        let ratelimit_policy = limits
            .iter()
            .map(|l| format!("\"{}\";q={};w={}", l.name, l.rate, l.per_secs))
            .collect::<Vec<_>>()
            .join(", ");
        plan_index.insert(name.clone(), plans.len());
        plans.push(Plan {
            name: name.clone(),
            limits,
            ratelimit_policy,
        });
    }
    let plan_ref = |name: &str, path: FieldPath, errors: &mut Errors| -> usize {
        match plan_index.get(name) {
            Some(i) => *i,
            None => {
                errors.add(
                    path,
                    format!("unknown plan `{name}` (plans: {})", known(spec.plans.keys())),
                );
                0
            }
        }
    };

    let mut tenants: HashMap<String, usize> = HashMap::with_capacity(spec.tenants.len());
    let mut first_seen: HashMap<&str, usize> = HashMap::with_capacity(spec.tenants.len());
    for (i, t) in spec.tenants.iter().enumerate() {
        let path = root.key("tenants").index(i);
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
        let plan = plan_ref(&t.plan, path.key("plan"), &mut errors);
        tenants.insert(t.id.clone(), plan);
    }
    let default_plan = plan_ref(&spec.default_plan, root.key("default_plan"), &mut errors);
    let anonymous_plan = plan_ref(
        &spec.anonymous.plan,
        root.key("anonymous").key("plan"),
        &mut errors,
    );

    // Route classes.
    let routes_path = root.key("routes");
    if spec.routes.is_empty() {
        errors.add(routes_path.clone(), "at least one route class is required");
    }
    let mut routes = HashMap::with_capacity(spec.routes.len());
    for (name, r) in &spec.routes {
        let path = routes_path.key(name);
        if !is_name(name) {
            errors.add(
                path.clone(),
                "route class names are 1 to 64 characters of A-Z a-z 0-9 _ - .",
            );
        }
        let action = r.action.clone().unwrap_or_else(|| name.clone());
        if r.action.is_some() && !is_name(&action) {
            errors.add(
                path.key("action"),
                "actions are 1 to 64 characters of A-Z a-z 0-9 _ - .",
            );
        }
        let cost = r.cost.unwrap_or(1);
        if cost <= 0 {
            errors.add(path.key("cost"), "must be > 0");
        } else if cost > MAX_COUNT {
            errors.add(path.key("cost"), format!("must be at most {MAX_COUNT}"));
        } else {
            // A cost above some plan's burst could never be admitted.
            for plan in &plans {
                for (i, l) in plan.limits.iter().enumerate() {
                    if cost as u64 > l.burst {
                        errors.add(
                            path.key("cost"),
                            format!(
                                "{cost} exceeds the burst of plans.{}.limits[{i}] ({}): such requests could never be admitted",
                                plan.name, l.burst
                            ),
                        );
                    }
                }
            }
        }
        routes.insert(
            name.clone(),
            RouteClass {
                name: name.clone(),
                action,
                cost: cost.max(1) as u64,
            },
        );
    }
    if let Some(d) = &spec.default_route {
        if !spec.routes.contains_key(d) {
            errors.add(
                root.key("default_route"),
                format!(
                    "unknown route class `{d}` (routes: {})",
                    known(spec.routes.keys())
                ),
            );
        }
    }

    if !errors.0.is_empty() {
        return Err(PolicyErrors(errors.0));
    }
    Ok(Policy {
        version,
        mode: spec.mode,
        identity,
        plans,
        tenants,
        default_plan,
        anonymous_plan,
        routes,
        default_route: spec.default_route,
        ratelimit_headers: spec.ratelimit_headers.unwrap_or(true),
        effective_from_ns: 0,
    })
}

fn known<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let names: Vec<&str> = names.map(String::as_str).collect();
    if names.is_empty() {
        String::from("none defined")
    } else {
        names.join(", ")
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

fn compile_limits(plan: &str, specs: &[LimitSpec], path: &FieldPath, errors: &mut Errors) -> Vec<Limit> {
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
        let path = path.index(i);
        let name = match (&spec.name, specs.len()) {
            (Some(n), _) => n.clone(),
            (None, 1) => plan.to_owned(),
            (None, _) => {
                errors.add(path.key("name"), "required when a plan has more than one limit");
                continue;
            }
        };
        if !is_name(&name) {
            errors.add(
                path.key("name"),
                "limit names are 1 to 64 characters of A-Z a-z 0-9 _ - .",
            );
        }
        let name_hash = fnv1a32(name.as_bytes());
        if limits.iter().any(|l| l.name == name || l.name_hash == name_hash) {
            errors.add(
                path.key("name"),
                format!("duplicate limit name `{name}` in this plan"),
            );
        }

        let rate = count(spec.rate, &path.key("rate"), errors);
        let burst = match spec.burst {
            Some(b) => count(b, &path.key("burst"), errors),
            None => rate,
        };
        let per_secs = match parse_duration_ns(&spec.per) {
            Err(message) => {
                errors.add(path.key("per"), message);
                None
            }
            Ok(ns) if ns < NANOS_PER_SEC || ns % NANOS_PER_SEC != 0 => {
                errors.add(
                    path.key("per"),
                    "must be a whole number of seconds, at least 1s (RateLimit-Policy states w= in seconds)",
                );
                None
            }
            Ok(ns) if ns / NANOS_PER_SEC > MAX_WINDOW_SECS => {
                errors.add(path.key("per"), "must be at most 366d");
                None
            }
            Ok(ns) => Some(ns / NANOS_PER_SEC),
        };
        let (Some(rate), Some(burst), Some(per_secs)) = (rate, burst, per_secs) else {
            continue;
        };
        let gcra = match Gcra::new(rate, per_secs * NANOS_PER_SEC, burst) {
            Some(g) if g.tolerance_ns() / NANOS_PER_SEC <= MAX_WINDOW_SECS => g,
            _ => {
                errors.add(
                    path.key("burst"),
                    format!(
                        "a burst of {burst} at {rate} per {}s takes longer than 366d to refill",
                        per_secs
                    ),
                );
                continue;
            }
        };
        limits.push(Limit {
            name,
            name_hash,
            rate,
            per_secs,
            burst,
            gcra,
        });
    }
    limits
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
