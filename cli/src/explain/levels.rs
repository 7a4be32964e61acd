//! `policy explain`'s nested levels: the request's place in the tree (its
//! value at each level, where it was read, the key and the budgets it
//! takes), and which level refuses it first when it repeats.

use std::fmt::Write;

use tenantgate::engine::{self, Prepared, Subject};
use tenantgate::memory::MemoryHost;
use tenantgate::policy::levels::{write_key, Budget, Level, LevelSource};
use tenantgate::policy::Policy;

use super::{limit_line, EXPLAIN_NOW_NS};

/// How many requests [`first_refusal`] repeats at most.
const MAX_REPEATS: u64 = 100_000;

/// The request's levels, from the tenant up (the order they are charged
/// in), each with its value, its source, its key and the budgets it takes.
pub(super) fn explain(policy: &Policy, prepared: &Prepared, out: &mut String) {
    let chain = &policy.levels.chain;
    if chain.is_empty() {
        return;
    }
    if !matches!(prepared.subject, Subject::Tenant(_)) {
        let _ = writeln!(out, "levels: none (an anonymous request belongs to no level)");
        return;
    }
    let _ = writeln!(
        out,
        "levels (from the tenant up; charged with the plan, all or nothing; the first that would be exceeded refuses):"
    );
    let mut key = String::new();
    for (l, level) in chain.iter().enumerate().rev() {
        let value = prepared.levels.get(l).and_then(|v| v.as_deref());
        let source = match &level.source {
            LevelSource::Header(h) => format!("the header {h}"),
            LevelSource::Claim { claim, .. } => format!("the JWT claim {claim}"),
        };
        let shown = value.map_or_else(
            || String::from("- (missing or unusable: every such request shares one budget)"),
            str::to_owned,
        );
        let parent = l
            .checked_sub(1)
            .and_then(|p| chain.get(p))
            .map_or_else(|| String::from("the root"), |p| format!("in {}", p.name));
        let _ = writeln!(out, "  {} = {shown} (from {source}; {parent})", level.name);
        // The budgets the engine charges, in its order (`level_budgets`).
        let mut none = true;
        for (budget, share) in engine::level_budgets(level, l, &prepared.levels) {
            none = false;
            let what = match budget {
                Budget::Guaranteed { member } => format!("{member}'s guaranteed share, first"),
                _ if !std::ptr::eq(share, &level.pool) => String::from("its ceiling"),
                _ => pool_line(level),
            };
            write_key(
                &mut key,
                &prepared.class.action,
                l,
                &policy.levels,
                &prepared.levels,
                budget,
            );
            let _ = writeln!(out, "    {what}: key {key}");
            for limit in &share.limits {
                let _ = writeln!(out, "      {}, cost {}", limit_line(limit), prepared.cost);
            }
        }
        if none {
            let _ = writeln!(out, "    no budget of its own (its parent's shares apply)");
        }
    }
}

/// How a level's pool is shared, as `explain` says it.
fn pool_line(level: &Level) -> String {
    let pool = if level.guaranteed.is_empty() {
        "its budget"
    } else {
        "the pool (what the guarantees leave)"
    };
    let sharing = if level.fair {
        "shared max-min fairly by its members while short"
    } else {
        "shared first come"
    };
    format!("{pool}, {sharing}")
}

/// Repeats the request (after the first) until something refuses it, and
/// names what: the tenant's plan, a level, or the guard.
pub(super) fn first_refusal(policy: &Policy, prepared: &Prepared, host: &MemoryHost, out: &mut String) {
    if policy.levels.chain.is_empty() || !matches!(prepared.subject, Subject::Tenant(_)) {
        return;
    }
    let mut scratch = engine::Scratch::default();
    for n in 1..=MAX_REPEATS {
        let d = engine::charge(policy, prepared, host, EXPLAIN_NOW_NS, &mut scratch);
        if d.deny_status().is_none() {
            continue;
        }
        let by = match d.limit.as_ref() {
            Some(l) => match l.level() {
                Some(level) => format!("level {level} (limit {})", l.problem_name()),
                None => format!("the tenant's plan or the guard (limit {})", l.problem_name()),
            },
            None => String::from("no limit (it could not be decided)"),
        };
        let _ = writeln!(
            out,
            "repeated at the same instant: request {} is refused first, by {by}: status {}, retry-after {}",
            n + 1,
            d.deny_status().unwrap_or_default(),
            d.retry_after_secs
        );
        return;
    }
    let _ = writeln!(
        out,
        "repeated at the same instant: {} more requests all admitted",
        MAX_REPEATS
    );
}
