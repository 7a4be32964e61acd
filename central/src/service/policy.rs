//! The service's view of a policy file: the same YAML the filter gets
//! (read by the filter crate's own validation), reduced to what the
//! allocator needs: the version and every limit by name.
//!
//! Only limits marked `global: true` are global: a node-local limit that
//! shares a global limit's name in another plan is not the global limit
//! and never changes it. Guards are node-wide by definition and are not.
//! Reports name a limit only by its name, so two plans that define a
//! global limit of the same name with different numbers are ambiguous; the
//! service then takes the strictest of them (lowest rate, lowest burst)
//! and says so in the log.
//!
//! The settings the bound depends on and the nodes enforce (callout
//! timeout `D`, failure mode, `fail_open_local`'s duration) are what each
//! node reports in its requests (`tenantgate::sync::NodeSettings`, see
//! `crate::alloc::NodeTerms`); the policy's `sync:` block, the one the
//! nodes read, supplies them only for a node that reports none, and the
//! defaults are the filter's own (`tenantgate::policy::LOCAL_MAX_NS`),
//! never a second copy: see [`Settings::alloc_config`].

use std::collections::BTreeMap;
use std::path::Path;

use tenantgate::limiter::algo::Algo;
use tenantgate::policy::{Node, Policy, SyncSettings, LOCAL_MAX_NS};

use crate::alloc::{tuning, AllocConfig, GlobalLimit};

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// A validated policy, as the service needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLimits {
    pub version: String,
    pub limits: BTreeMap<String, GlobalLimit>,
    /// The policy's `sync:` block (`None`: it has no global limit).
    pub sync: Option<SyncSettings>,
    /// Limit names defined differently by several plans.
    pub ambiguous: Vec<String>,
    /// The `quotas:` section (the reservation API's resources).
    pub quotas: tenantgate::policy::quota::Quotas,
    /// What the rate limit service (RLS) decides with: `descriptors:` and
    /// the plans they name.
    pub rls: crate::grpc::rls::RlsPolicy,
}

/// Reads and validates a policy file.
pub fn load(path: &Path) -> Result<PolicyLimits, String> {
    let text = read_text(path)?;
    parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// A policy file's text, refused past [`tenantgate::policy::MAX_POLICY_BYTES`]
/// without reading the rest (`PATH: cannot read: ...` or the size error).
pub fn read_text(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let limit = tenantgate::policy::MAX_POLICY_BYTES;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| {
            f.take(u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1))
                .read_to_string(&mut text)
        })
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    if text.len() > limit {
        return Err(format!(
            "{}: (policy): the policy is over {limit} bytes, the limit (1 MiB)",
            path.display()
        ));
    }
    Ok(text)
}

/// A policy's YAML (or JSON) text as a document: the one YAML reader of
/// policies (the CLI's too). Refuses a text over the size limit and says
/// what an alias bomb is rather than the parser's "repetition limit
/// exceeded". An empty text is a null document (refused by validation).
pub fn parse_document(text: &str) -> Result<Node, String> {
    tenantgate::policy::check_size(text.len()).map_err(|e| e.to_string())?;
    if text.trim().is_empty() {
        return Ok(Node::Null);
    }
    serde_norway::from_str(text).map_err(|e| {
        let e = e.to_string();
        if e.contains("repetition limit exceeded") {
            format!(
                "(policy): invalid YAML: its aliases (*name) expand to too many nodes (an alias bomb?); \
                 write the repeated parts out or use fewer nested aliases ({e})"
            )
        } else {
            format!("(policy): invalid YAML: {e}")
        }
    })
}

/// Validates a policy's YAML (or JSON) text.
pub fn parse(text: &str) -> Result<PolicyLimits, String> {
    let doc = parse_document(text)?;
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
    // Plans' global limits and nested levels' (each budget's limits have
    // names of their own: a level's pool, a member's guaranteed share, a
    // member's ceiling).
    let plan_limits = policy.plans().iter().flat_map(|p| p.limits.iter());
    for l in plan_limits.chain(policy.levels.limits()).filter(|l| l.global) {
        let g = GlobalLimit {
            limit: l.rate,
            window_ns: l.per_secs.saturating_mul(NANOS_PER_SEC),
            burst: l.burst,
            // Validation refuses a cost above any plan's burst.
            max_cost: policy.max_cost().min(l.burst),
            month: match &l.algo {
                Algo::FixedWindow(w) => w.calendar_zone().map_or(0, |z| u64::from(z.tag()) + 1),
                _ => 0,
            },
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
                prev.max_cost = prev.max_cost.min(prev.burst);
            }
        }
    }
    Ok(PolicyLimits {
        version: policy.version.clone(),
        limits,
        sync: policy.sync.clone(),
        ambiguous,
        quotas: policy.quotas.clone(),
        rls: crate::grpc::rls::RlsPolicy::of(&policy),
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
    /// The simulator's settings (docs/global-limits.md).
    fn default() -> Settings {
        Settings {
            interval_ns: tuning::INTERVAL_NS,
            lease_ttl_ns: tuning::LEASE_TTL_NS,
            response_timeout_ns: tuning::RESPONSE_TIMEOUT_NS,
        }
    }
}

impl Settings {
    /// The allocator's settings for policy `p`. The shared settings (the
    /// nodes' callout timeout, failure mode and `fail_open_local` duration)
    /// are the policy's `sync:` values, which the nodes enforce; ours apply
    /// only to a policy without a `sync:` block. The failure mode is the
    /// block's default: a route class that overrides it with `fail_closed`
    /// admits less than the bound assumes, never more; one that overrides
    /// it with `fail_open` is outside the `fail_open_local` bound (docs/global-limits.md).
    pub fn alloc_config(&self, p: &PolicyLimits) -> AllocConfig {
        let response_timeout_ns = p.sync.as_ref().map_or(self.response_timeout_ns, |s| s.timeout_ns);
        // The filter's own constant, never a second default.
        let local_max_ns = p.sync.as_ref().map_or(LOCAL_MAX_NS, |s| s.local_max_ns);
        let failure_mode = p
            .sync
            .as_ref()
            .map_or(tenantgate::sync::FailureMode::FailOpenLocal, |s| s.failure_mode);
        AllocConfig {
            policy_version: p.version.clone(),
            limits: p.limits.clone(),
            interval_ns: self.interval_ns,
            lease_ttl_ns: self.lease_ttl_ns,
            response_timeout_ns,
            lease_factor_pct: tuning::LEASE_FACTOR_PCT,
            node_floor: tuning::NODE_FLOOR,
            region_floor: tuning::REGION_FLOOR,
            borrow_ceiling_pct: tuning::BORROW_CEILING_PCT,
            repay_pct: tuning::REPAY_PCT,
            settle_ns: tuning::SETTLE_NS,
            local_max_ns,
            failure_mode,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shipped(name: &str) -> PolicyLimits {
        let path = format!("{}/../policies/{name}", env!("CARGO_MANIFEST_DIR"));
        parse(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    #[test]
    fn only_global_limits_are_global_and_carry_the_largest_route_cost() {
        let p = shipped("global.yaml");
        assert_eq!(p.version, "global-2026-12-01");
        assert_eq!(
            p.limits["free"],
            GlobalLimit {
                limit: 100,
                window_ns: 60 * NANOS_PER_SEC,
                burst: 100,
                max_cost: 5,
                month: 0,
            }
        );
        // `paid-node` and the anonymous plan's limit are node-local.
        assert_eq!(p.limits.keys().collect::<Vec<_>>(), ["free", "paid"]);
        // The demo's only global limit is `demo-global`'s (`make run`).
        assert_eq!(shipped("demo.yaml").limits.keys().collect::<Vec<_>>(), ["global"]);
    }

    #[test]
    fn a_local_limit_of_the_same_name_never_lowers_a_global_one() {
        // Regression: every plan limit was taken as global, and the
        // strictest of two same-named limits won.
        let text = r#"
version: v
identity: { header: x-tenant-id }
plans:
  free:
    limits: [{ name: shared, rate: 100, per: 1m, global: true }]
  other:
    limits: [{ name: shared, rate: 5, per: 1m }]
default_plan: free
anonymous: { plan: other }
routes: { api: {} }
default_route: api
sync: { cluster: tenantgate }
"#;
        let p = parse(text).unwrap();
        assert_eq!(p.limits["shared"].limit, 100);
        assert_eq!(p.limits["shared"].burst, 100);
        assert!(p.ambiguous.is_empty());
    }

    #[test]
    fn the_shared_settings_are_the_policys_sync_block() {
        let p = shipped("global.yaml");
        let cfg = Settings::default().alloc_config(&p);
        let sync = p.sync.as_ref().unwrap();
        assert_eq!(cfg.response_timeout_ns, sync.timeout_ns);
        assert_eq!(cfg.local_max_ns, sync.local_max_ns);
        assert_eq!(cfg.failure_mode, sync.failure_mode);
    }

    #[test]
    fn an_invalid_policy_is_refused_with_its_path() {
        let e = parse("version: x\n").unwrap_err();
        assert!(e.contains("identity"), "{e}");
    }
}
