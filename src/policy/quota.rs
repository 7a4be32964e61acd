//! `quotas:` reservable amounts (concurrent jobs, bytes, GPU hours, seats)
//! that the central service hands out by reservation (`tenantgate serve`,
//! `POST /v1/reservations`). The filter only validates this section.
//!
//! Each resource has limits at three levels, always checked in this order:
//! **global** (the whole pool), **tenant** (a default for every tenant,
//! overridden per tenant) and **project** (a default for every project of a
//! tenant, overridden per `tenant/project`). A level with no limit written
//! is unlimited. `tenant_share_pct` caps every tenant's limit at that share
//! of the global pool, so one tenant cannot take the whole pool even where
//! its own limit (or the absence of one) would let it.
//!
//! Amounts are whole units (`unit` only names them), 1 to
//! [`MAX_QUOTA_AMOUNT`]; sums of three levels' amounts stay far below
//! `i64::MAX`, the databases' integer.
//!
//! Hot reload: a new limit applies to reservations made after it; lowering
//! a limit below what is already reserved or committed refuses new
//! reservations at that level until usage falls below it, and never
//! cancels or shrinks an existing reservation.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::duration::parse_duration_ns;
use super::error::{FieldPath, PolicyError};
use super::{is_name, tenant_id};

/// The largest limit or amount: 10^15 units.
pub const MAX_QUOTA_AMOUNT: u64 = 1_000_000_000_000_000;
/// Default and bounds of a reservation's time to live.
pub const DEFAULT_TTL_NS: u64 = 300 * NANOS_PER_SEC;
pub const DEFAULT_MAX_TTL_NS: u64 = 86_400 * NANOS_PER_SEC;
pub const MIN_TTL_NS: u64 = NANOS_PER_SEC;
pub const MAX_MAX_TTL_NS: u64 = 30 * 86_400 * NANOS_PER_SEC;
const NANOS_PER_SEC: u64 = 1_000_000_000;

/// `quotas.<resource>.risk:` what the service does when its database is
/// unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Risk {
    /// Fail closed: `503 quota_unavailable`, nothing debited, no estimate.
    High,
    /// Reservations still fail closed; queries may answer the last known
    /// figures marked `estimate: true`.
    Low,
}

impl Risk {
    pub fn as_str(self) -> &'static str {
        match self {
            Risk::High => "high",
            Risk::Low => "low",
        }
    }
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ResourceSpec {
    pub unit: String,
    pub risk: Risk,
    pub limits: LimitsSpec,
    #[serde(default)]
    pub tenant_share_pct: Option<i64>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub default_ttl: Option<String>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(pattern(super::duration::PATTERN)))]
    pub max_ttl: Option<String>,
    #[serde(default)]
    pub home_region: Option<String>,
    /// Regional borrowing while the home region cannot be reached.
    #[serde(default)]
    pub borrow: Option<BorrowSpec>,
}

/// `quotas.<resource>.borrow:` how much each named region other than the
/// home region may reserve on its own while the home region does not
/// answer (its borrowing ceiling, outstanding debt included).
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct BorrowSpec {
    /// Region → ceiling in units.
    pub ceilings: BTreeMap<String, i64>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct LimitsSpec {
    pub global: i64,
    #[serde(default)]
    pub tenant_default: Option<i64>,
    #[serde(default)]
    pub tenants: BTreeMap<String, i64>,
    #[serde(default)]
    pub project_default: Option<i64>,
    /// Keyed `tenant/project`.
    #[serde(default)]
    pub projects: BTreeMap<String, i64>,
}

/// The compiled `quotas:` section, by resource name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Quotas {
    pub resources: BTreeMap<String, Resource>,
}

/// One reservable resource, defaults applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    pub name: String,
    pub unit: String,
    pub risk: Risk,
    pub global: u64,
    /// `None`: unlimited at that level (before `tenant_share_pct`).
    pub tenant_default: Option<u64>,
    pub tenants: BTreeMap<String, u64>,
    pub project_default: Option<u64>,
    /// Keyed by (tenant, project).
    pub projects: BTreeMap<(String, String), u64>,
    pub tenant_share_pct: Option<u64>,
    pub default_ttl_ns: u64,
    pub max_ttl_ns: u64,
    /// The only region whose replicas accept reservations of it (`None`:
    /// every region).
    pub home_region: Option<String>,
    /// Region → borrowing ceiling: what a replica of that region may
    /// reserve on its own while the home region does not answer (empty:
    /// no borrowing). Only `risk: low` resources with a `home_region`.
    pub borrow: BTreeMap<String, u64>,
}

/// The limits in force for one (tenant, project): what a reservation is
/// checked against, in the fixed order global, tenant, project.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LevelLimits {
    pub global: u64,
    pub tenant: u64,
    pub project: u64,
}

impl Resource {
    /// The limits for `tenant`'s `project` (unlimited levels are
    /// [`MAX_QUOTA_AMOUNT`]).
    pub fn limits_for(&self, tenant: &str, project: &str) -> LevelLimits {
        let mut t = self
            .tenants
            .get(tenant)
            .copied()
            .or(self.tenant_default)
            .unwrap_or(MAX_QUOTA_AMOUNT);
        if let Some(pct) = self.tenant_share_pct {
            let share = u64::try_from(u128::from(self.global) * u128::from(pct) / 100).unwrap_or(u64::MAX);
            t = t.min(share);
        }
        let p = self
            .projects
            .get(&(tenant.to_owned(), project.to_owned()))
            .copied()
            .or(self.project_default)
            .unwrap_or(MAX_QUOTA_AMOUNT);
        LevelLimits {
            global: self.global,
            tenant: t,
            project: p,
        }
    }

    /// The oversell bound of regional borrowing: Σ of the ceilings (the
    /// most the home region's counters can exceed a limit by once every
    /// debt is repaid).
    pub fn borrow_bound(&self) -> u64 {
        self.borrow.values().fold(0u64, |a, c| a.saturating_add(*c))
    }
}

fn amount(value: i64, path: FieldPath, errors: &mut Vec<PolicyError>) -> u64 {
    match u64::try_from(value) {
        Ok(v) if v > 0 && v <= MAX_QUOTA_AMOUNT => v,
        Ok(0) | Err(_) => {
            errors.push(PolicyError::new(path, "must be > 0"));
            1
        }
        Ok(_) => {
            errors.push(PolicyError::new(
                path,
                format!("must be at most {MAX_QUOTA_AMOUNT}"),
            ));
            1
        }
    }
}

/// `quotas:`: every resource, by name.
pub(super) fn compile(
    spec: &BTreeMap<String, ResourceSpec>,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Quotas {
    let resources = spec
        .iter()
        .map(|(name, r)| (name.clone(), compile_resource(name, r, &path.key(name), errors)))
        .collect();
    Quotas { resources }
}

/// One resource: its name and unit, its limits per level, the tenants'
/// share, its TTLs and home region (errors in that order).
fn compile_resource(
    name: &str,
    r: &ResourceSpec,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Resource {
    if !is_name(name) {
        errors.push(PolicyError::new(
            path.clone(),
            "resource names are 1 to 64 characters of A-Z a-z 0-9 _ - .",
        ));
    }
    if r.unit.is_empty() || r.unit.len() > 32 || !r.unit.bytes().all(|b| (0x21..0x7f).contains(&b)) {
        errors.push(PolicyError::new(
            path.key("unit"),
            "must be 1 to 32 visible ASCII characters",
        ));
    }
    let lp = path.key("limits");
    let global = amount(r.limits.global, lp.key("global"), errors);
    let tenant_default = r
        .limits
        .tenant_default
        .map(|v| amount(v, lp.key("tenant_default"), errors));
    let project_default = r
        .limits
        .project_default
        .map(|v| amount(v, lp.key("project_default"), errors));
    let tenants = tenant_limits(&r.limits.tenants, &lp.key("tenants"), errors);
    let projects = project_limits(&r.limits.projects, &lp.key("projects"), errors);
    let tenant_share_pct = match r.tenant_share_pct {
        None => None,
        Some(v @ 1..=100) => Some(v as u64),
        Some(_) => {
            errors.push(PolicyError::new(
                path.key("tenant_share_pct"),
                "must be between 1 and 100",
            ));
            None
        }
    };
    let default_ttl_ns = ttl(
        r.default_ttl.as_ref(),
        DEFAULT_TTL_NS,
        &path.key("default_ttl"),
        errors,
    );
    let max_ttl_ns = ttl(
        r.max_ttl.as_ref(),
        DEFAULT_MAX_TTL_NS,
        &path.key("max_ttl"),
        errors,
    );
    if default_ttl_ns > max_ttl_ns {
        errors.push(PolicyError::new(
            path.key("default_ttl"),
            "must not be longer than max_ttl",
        ));
    }
    if let Some(region) = &r.home_region {
        if !is_name(region) {
            errors.push(PolicyError::new(
                path.key("home_region"),
                "regions are 1 to 64 characters of A-Z a-z 0-9 _ - .",
            ));
        }
    }
    let borrow = r
        .borrow
        .as_ref()
        .map(|b| borrow_ceilings(r, b, &path.key("borrow"), errors))
        .unwrap_or_default();
    Resource {
        name: name.to_owned(),
        unit: r.unit.clone(),
        risk: r.risk,
        global,
        tenant_default,
        tenants,
        project_default,
        projects,
        tenant_share_pct,
        default_ttl_ns,
        max_ttl_ns,
        home_region: r.home_region.clone(),
        borrow,
    }
}

/// `borrow:`: a ceiling per region other than the home region; only a
/// `risk: low` resource with a `home_region` may borrow (a high-risk one
/// keeps failing closed).
fn borrow_ceilings(
    r: &ResourceSpec,
    b: &BorrowSpec,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> BTreeMap<String, u64> {
    if r.risk == Risk::High {
        errors.push(PolicyError::new(
            path.clone(),
            "a high-risk resource never borrows (it fails closed): remove borrow or set risk: low",
        ));
    }
    let Some(home) = &r.home_region else {
        errors.push(PolicyError::new(
            path.clone(),
            "borrowing needs a home_region to borrow from",
        ));
        return BTreeMap::new();
    };
    let cp = path.key("ceilings");
    if b.ceilings.is_empty() {
        errors.push(PolicyError::new(cp.clone(), "name at least one region"));
    }
    let mut out = BTreeMap::new();
    for (region, v) in &b.ceilings {
        let rp = cp.key(region);
        if !is_name(region) {
            errors.push(PolicyError::new(
                rp.clone(),
                "regions are 1 to 64 characters of A-Z a-z 0-9 _ - .",
            ));
        } else if region == home {
            errors.push(PolicyError::new(
                rp.clone(),
                "the home region does not borrow from itself",
            ));
        }
        out.insert(region.clone(), amount(*v, rp, errors));
    }
    out
}

/// `limits.tenants`: a limit per valid tenant id.
fn tenant_limits(
    spec: &BTreeMap<String, i64>,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> BTreeMap<String, u64> {
    let mut tenants = BTreeMap::new();
    for (t, v) in spec {
        let tp = path.key(t);
        if tenant_id(t.as_bytes()).is_none() {
            errors.push(PolicyError::new(
                tp.clone(),
                "tenant ids are 1 to 128 bytes with no whitespace or control characters",
            ));
        }
        tenants.insert(t.clone(), amount(*v, tp, errors));
    }
    tenants
}

/// `limits.projects`: a limit per `tenant/project` key.
fn project_limits(
    spec: &BTreeMap<String, i64>,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> BTreeMap<(String, String), u64> {
    let mut projects = BTreeMap::new();
    for (key, v) in spec {
        let pp = path.key(key);
        match key.split_once('/') {
            Some((t, p)) if tenant_id(t.as_bytes()).is_some() && project_id(p).is_some() => {
                projects.insert((t.to_owned(), p.to_owned()), amount(*v, pp, errors));
            }
            _ => errors.push(PolicyError::new(
                pp,
                "project keys are `tenant/project` (each 1 to 128 bytes, no whitespace, no `/` in the project)",
            )),
        }
    }
    projects
}

/// A reservation TTL field: `default` when absent or invalid, 1 s to 30 days.
fn ttl(value: Option<&String>, default: u64, path: &FieldPath, errors: &mut Vec<PolicyError>) -> u64 {
    let Some(text) = value else {
        return default;
    };
    match parse_duration_ns(text) {
        Ok(ns) if (MIN_TTL_NS..=MAX_MAX_TTL_NS).contains(&ns) => ns,
        Ok(_) => {
            errors.push(PolicyError::new(path.clone(), "must be between 1s and 30d"));
            default
        }
        Err(m) => {
            errors.push(PolicyError::new(path.clone(), m));
            default
        }
    }
}

/// A project id: 1 to 128 bytes, no whitespace, control characters or `/`.
pub fn project_id(s: &str) -> Option<&str> {
    tenant_id(s.as_bytes()).filter(|p| !p.contains('/'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Policy;

    const BASE: &str = r#"{"version":"q","identity":{"header":"x-tenant-id"},"plans":{"free":{"limits":[{"rate":1,"per":"1s"}]}},"default_plan":"free","anonymous":{"plan":"free"},"routes":{"api":{}}"#;

    fn with_quotas(q: &str) -> Result<Policy, String> {
        Policy::from_json(format!("{BASE},\"quotas\":{q}}}").as_bytes()).map_err(|e| e.to_string())
    }

    #[test]
    fn limits_per_level_with_defaults_overrides_and_the_share_cap() {
        let p = with_quotas(
            r#"{"gpu":{"unit":"hour","risk":"high","tenant_share_pct":40,
                "limits":{"global":1000,"tenant_default":100,"tenants":{"acme":900},
                          "project_default":50,"projects":{"acme/build":70}}}}"#,
        )
        .unwrap();
        let r = &p.quotas.resources["gpu"];
        assert_eq!(
            r.limits_for("acme", "build"),
            LevelLimits {
                global: 1000,
                tenant: 400, // 900 capped at 40% of the pool
                project: 70
            }
        );
        assert_eq!(
            r.limits_for("other", "x"),
            LevelLimits {
                global: 1000,
                tenant: 100,
                project: 50
            }
        );
        assert_eq!(r.default_ttl_ns, DEFAULT_TTL_NS);
    }

    #[test]
    fn unlimited_levels_and_errors_name_their_path() {
        let p = with_quotas(r#"{"seats":{"unit":"seat","risk":"low","limits":{"global":5}}}"#).unwrap();
        assert_eq!(
            p.quotas.resources["seats"].limits_for("a", "b").project,
            MAX_QUOTA_AMOUNT
        );
        let e = with_quotas(
            r#"{"seats":{"unit":"seat","risk":"low","limits":{"global":0,"projects":{"nope":1}}}}"#,
        )
        .unwrap_err();
        assert!(e.contains("quotas.seats.limits.global: must be > 0"), "{e}");
        assert!(
            e.contains("quotas.seats.limits.projects.nope: project keys"),
            "{e}"
        );
    }

    #[test]
    fn borrowing_ceilings_per_region_and_their_bound() {
        let p = with_quotas(
            r#"{"seats":{"unit":"seat","risk":"low","home_region":"eu","limits":{"global":100},
                "borrow":{"ceilings":{"us":10,"ap":5}}}}"#,
        )
        .unwrap();
        let r = &p.quotas.resources["seats"];
        assert_eq!(r.borrow.get("us"), Some(&10));
        assert_eq!(r.borrow_bound(), 15);
    }

    #[test]
    fn a_high_risk_resource_or_one_without_a_home_never_borrows() {
        let e = with_quotas(
            r#"{"gpu":{"unit":"h","risk":"high","home_region":"eu","limits":{"global":9},
                "borrow":{"ceilings":{"us":1}}}}"#,
        )
        .unwrap_err();
        assert!(
            e.contains("quotas.gpu.borrow: a high-risk resource never borrows"),
            "{e}"
        );
        let e = with_quotas(
            r#"{"s":{"unit":"s","risk":"low","limits":{"global":9},"borrow":{"ceilings":{"us":1}}}}"#,
        )
        .unwrap_err();
        assert!(
            e.contains("quotas.s.borrow: borrowing needs a home_region"),
            "{e}"
        );
        let e = with_quotas(
            r#"{"s":{"unit":"s","risk":"low","home_region":"eu","limits":{"global":9},
                "borrow":{"ceilings":{"eu":1,"us":0}}}}"#,
        )
        .unwrap_err();
        assert!(e.contains("quotas.s.borrow.ceilings.eu: the home region"), "{e}");
        assert!(e.contains("quotas.s.borrow.ceilings.us: must be > 0"), "{e}");
    }
}
