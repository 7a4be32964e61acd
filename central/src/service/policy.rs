//! The service's view of a policy file: the same YAML the filter gets
//! (read by the filter crate's own validation), reduced to what the
//! allocator needs: the version and every limit by name.
//!
//! Every limit of every plan is treated as global. Guards are node-wide by
//! definition and are not. Reports name a limit only by its name, so two
//! plans that define a limit of the same name with different numbers are
//! ambiguous; the service then takes the strictest of them (lowest rate,
//! lowest burst) and says so in the log.

use std::collections::BTreeMap;
use std::path::Path;

use tenantgate::policy::{Node, Policy};

use crate::alloc::{AllocConfig, GlobalLimit};

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// A validated policy, as the service needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLimits {
    pub version: String,
    pub limits: BTreeMap<String, GlobalLimit>,
    /// Limit names defined differently by several plans.
    pub ambiguous: Vec<String>,
    /// The `quotas:` section (the reservation API's resources).
    pub quotas: tenantgate::policy::quota::Quotas,
}

/// Reads and validates a policy file.
pub fn load(path: &Path) -> Result<PolicyLimits, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Validates a policy's YAML (or JSON) text.
pub fn parse(text: &str) -> Result<PolicyLimits, String> {
    let doc: Node = if text.trim().is_empty() {
        Node::Null
    } else {
        serde_norway::from_str(text).map_err(|e| format!("(policy): invalid YAML: {e}"))?
    };
    let policy = Policy::from_node(&doc).map_err(|errors| {
        errors
            .0
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("; ")
    })?;
    let mut limits: BTreeMap<String, GlobalLimit> = BTreeMap::new();
    let mut ambiguous = Vec::new();
    for plan in policy.plans() {
        for l in &plan.limits {
            let g = GlobalLimit {
                limit: l.rate,
                window_ns: l.per_secs.saturating_mul(NANOS_PER_SEC),
                burst: l.burst,
            };
            match limits.get_mut(&l.name) {
                None => {
                    limits.insert(l.name.clone(), g);
                }
                Some(prev) if *prev == g => {}
                Some(prev) => {
                    if !ambiguous.contains(&l.name) {
                        ambiguous.push(l.name.clone());
                    }
                    // Strictest: the lower rate (cross-multiplied), the lower burst.
                    let lower = u128::from(g.limit) * u128::from(prev.window_ns)
                        < u128::from(prev.limit) * u128::from(g.window_ns);
                    if lower {
                        prev.limit = g.limit;
                        prev.window_ns = g.window_ns;
                    }
                    prev.burst = prev.burst.min(g.burst);
                }
            }
        }
    }
    Ok(PolicyLimits {
        version: policy.version.clone(),
        limits,
        ambiguous,
        quotas: policy.quotas.clone(),
    })
}

/// The service's reconciliation settings (see `AllocConfig`); the policy
/// supplies the version and the limits.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub interval_ns: u64,
    pub lease_ttl_ns: u64,
    pub response_timeout_ns: u64,
}

impl Default for Settings {
    /// The simulator's settings (README, "Global limits").
    fn default() -> Settings {
        Settings {
            interval_ns: NANOS_PER_SEC,
            lease_ttl_ns: 3 * NANOS_PER_SEC,
            response_timeout_ns: NANOS_PER_SEC / 2,
        }
    }
}

impl Settings {
    pub fn alloc_config(&self, p: &PolicyLimits) -> AllocConfig {
        AllocConfig {
            policy_version: p.version.clone(),
            limits: p.limits.clone(),
            interval_ns: self.interval_ns,
            lease_ttl_ns: self.lease_ttl_ns,
            response_timeout_ns: self.response_timeout_ns,
            lease_factor_pct: 150,
            node_floor: 1,
            region_floor: 5,
            borrow_ceiling_pct: 80,
            repay_pct: 50,
            settle_ns: 5 * NANOS_PER_SEC,
            local_max_ns: 300 * NANOS_PER_SEC,
            failure_mode: tenantgate::sync::FailureMode::FailOpenLocal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_policy_gives_one_global_limit_per_plan_limit() {
        let text =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../policies/demo.yaml")).unwrap();
        let p = parse(&text).unwrap();
        assert_eq!(p.version, "demo-2026-11-30");
        assert_eq!(
            p.limits["paid"],
            GlobalLimit {
                limit: 10_000,
                window_ns: 60 * NANOS_PER_SEC,
                burst: 1000
            }
        );
        assert_eq!(p.limits.len(), 3);
        assert!(p.ambiguous.is_empty());
    }

    #[test]
    fn an_invalid_policy_is_refused_with_its_path() {
        let e = parse("version: x\n").unwrap_err();
        assert!(e.contains("identity"), "{e}");
    }
}
