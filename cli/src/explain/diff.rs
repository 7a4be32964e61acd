//! `tenantgate policy diff`: what a reload from one policy to another does
//! to live state. Each limit is classified with [`Algo::carry_from`], the
//! rule the engine's state loader applies; every listing is sorted.

use std::collections::BTreeMap;
use std::fmt::Write;

use tenantgate::keys::kind;
use tenantgate::limiter::algo::{Algo, Carry};
use tenantgate::policy::admission::Labels;
use tenantgate::policy::{Policy, RouteClass};

use super::{failure_mode, join, limit_line, mode, on_limit};

/// The text of a diff, and whether anything it reports differs.
#[derive(Default)]
struct Report {
    out: String,
    differs: bool,
}

impl Report {
    /// A line that says something differs.
    fn change(&mut self, line: &str) {
        self.differs = true;
        let _ = writeln!(self.out, "{line}");
    }

    /// A heading and its lines, if there are any.
    fn section(&mut self, heading: &str, lines: &[String]) {
        if lines.is_empty() {
            return;
        }
        self.change(heading);
        for l in lines {
            let _ = writeln!(self.out, "{l}");
        }
    }
}

/// What a reload from `old` to `new` does, as text; `true` if they differ
/// in anything it reports. In order: version and mode, each plan's limits,
/// tenants that change plan, route classes, then sync, dependencies and
/// action limits.
pub fn diff(old: &Policy, new: &Policy) -> (String, bool) {
    let mut report = Report::default();
    if old.version != new.version {
        report.change(&format!("version: {} -> {}", old.version, new.version));
    }
    if old.mode != new.mode {
        report.change(&format!("mode: {} -> {}", mode(old), mode(new)));
    }
    let (old_plans, new_plans) = (limit_names(old), limit_names(new));
    for plan in union(old_plans.keys(), new_plans.keys()) {
        let status = match (old_plans.contains_key(plan), new_plans.contains_key(plan)) {
            (false, true) => " (added)",
            (true, false) => " (removed)",
            _ => "",
        };
        let names = union(
            old_plans.get(plan).into_iter().flatten(),
            new_plans.get(plan).into_iter().flatten(),
        );
        let lines: Vec<String> = names
            .into_iter()
            .filter_map(|name| limit_change(old, new, plan, name))
            .collect();
        if !lines.is_empty() || !status.is_empty() {
            report.change(&format!("plan {plan}{status}:"));
            for l in lines {
                let _ = writeln!(report.out, "{l}");
            }
        }
    }
    let moved = tenants_moved(old, new, &old_plans, &new_plans);
    report.section("tenants that change plan:", &moved);
    report.section("route classes:", &class_changes(old, new));
    if old.sync != new.sync {
        report.change("sync: changed (global limits use the new settings from the next sync)");
    }
    if old.dependencies != new.dependencies {
        let names = |p: &Policy| {
            p.dependencies
                .iter()
                .map(|d| d.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        report.change(&format!(
            "dependencies: changed ({} -> {}): slots in flight carry over and count against the new limits",
            names(old),
            names(new)
        ));
    }
    if old.actions != new.actions {
        let limits = |p: &Policy| {
            p.actions
                .iter()
                .map(|a| format!("{} {}", a.name, a.max_in_flight))
                .collect::<Vec<_>>()
                .join(", ")
        };
        report.change(&format!(
            "actions: in-flight limits changed ({} -> {}): slots in flight carry over and count against the new limits",
            limits(old),
            limits(new)
        ));
    }
    if !report.differs {
        let _ = writeln!(report.out, "no change to live state");
    }
    (report.out, report.differs)
}

/// The names in either list, sorted, once each.
fn union<'a>(a: impl Iterator<Item = &'a String>, b: impl Iterator<Item = &'a String>) -> Vec<&'a String> {
    let mut names: Vec<&String> = a.chain(b).collect();
    names.sort();
    names.dedup();
    names
}

/// Each plan's limit names (a key's state is matched by limit name within
/// its plan).
fn limit_names(p: &Policy) -> BTreeMap<String, Vec<String>> {
    p.plans()
        .iter()
        .map(|plan| {
            (
                plan.name.clone(),
                plan.limits.iter().map(|l| l.name.clone()).collect(),
            )
        })
        .collect()
}

/// A limit as its key's record sees it.
struct Found {
    /// The record's kind: a global limit's is its allowance, whatever its
    /// algorithm; a local one's, its algorithm's.
    kind: u8,
    line: String,
    algo: Algo,
}

fn find_limit(p: &Policy, plan: &str, limit: &str) -> Option<Found> {
    let plan = p.plans().iter().find(|x| x.name == plan)?;
    let l = plan.limits.iter().find(|l| l.name == limit)?;
    let kind = if l.global {
        kind::GLOBAL_ALLOWANCE
    } else {
        l.algo.kind()
    };
    Some(Found {
        kind,
        line: limit_line(l),
        algo: l.algo,
    })
}

/// What the reload does to limit `name` of `plan` (`None`: nothing).
fn limit_change(old: &Policy, new: &Policy, plan: &str, name: &str) -> Option<String> {
    let (b, a) = match (find_limit(old, plan, name), find_limit(new, plan, name)) {
        (Some(b), Some(a)) => (b, a),
        (None, Some(a)) => return Some(format!("  {name}: starts fresh (a new name)\n    + {}", a.line)),
        (Some(b), None) => {
            return Some(format!(
                "  {name}: removed (its state is no longer read)\n    - {}",
                b.line
            ))
        }
        (None, None) => return None,
    };
    let global = a.kind == kind::GLOBAL_ALLOWANCE;
    let carry = if b.kind != a.kind {
        Carry::Fresh
    } else if global {
        Carry::Keeps
    } else {
        a.algo.carry_from(b.algo.kind(), b.algo.params())
    };
    let what = match carry {
        Carry::Keeps if global && b.line != a.line => {
            "keeps its allowance; the service splits the new limit from the next sync"
        }
        Carry::Keeps if b.line == a.line => return None,
        Carry::Keeps => "keeps its state",
        Carry::Migrated => "keeps its fill level, capped to the new burst (never adds tokens)",
        _ if b.kind == kind::GLOBAL_ALLOWANCE || a.kind == kind::GLOBAL_ALLOWANCE => {
            "starts fresh (local <-> global)"
        }
        _ => "starts fresh (the algorithm changed)",
    };
    Some(format!("  {name}: {what}\n    - {}\n    + {}", b.line, a.line))
}

/// Tenants whose plan changes (listed ones, and the default), with which
/// limit states carry over (by name in the new plan).
fn tenants_moved(
    old: &Policy,
    new: &Policy,
    old_plans: &BTreeMap<String, Vec<String>>,
    new_plans: &BTreeMap<String, Vec<String>>,
) -> Vec<String> {
    let plan_name = |p: &Policy, i: usize| p.plan(i).map_or_else(|| String::from("?"), |x| x.name.clone());
    let directory = |p: &Policy| -> BTreeMap<String, String> {
        p.tenants()
            .map(|(t, i)| (t.to_owned(), plan_name(p, i)))
            .collect()
    };
    let (old_dir, new_dir) = (directory(old), directory(new));
    let (old_default, new_default) = (
        plan_name(old, old.default_plan()),
        plan_name(new, new.default_plan()),
    );
    let mut moved = Vec::new();
    for t in union(old_dir.keys(), new_dir.keys()) {
        let b = old_dir.get(t).unwrap_or(&old_default);
        let a = new_dir.get(t).unwrap_or(&new_default);
        if a == b {
            continue;
        }
        let before = old_plans.get(b).cloned().unwrap_or_default();
        let after = new_plans.get(a).cloned().unwrap_or_default();
        let (kept, fresh): (Vec<&String>, Vec<&String>) = after.iter().partition(|l| before.contains(l));
        let mut what = Vec::new();
        if !kept.is_empty() {
            what.push(format!("carries the state of {}", join(&kept)));
        }
        if !fresh.is_empty() {
            what.push(format!("{} starts fresh", join(&fresh)));
        }
        moved.push(format!("  {t}: {b} -> {a} ({})", what.join("; ")));
    }
    if old_default != new_default {
        moved.push(format!(
            "  (unlisted tenants, default_plan): {old_default} -> {new_default}"
        ));
    }
    moved
}

/// Route classes added, removed or changed, and the default route.
fn class_changes(old: &Policy, new: &Policy) -> Vec<String> {
    let summaries = |p: &Policy| -> BTreeMap<String, String> {
        p.route_classes()
            .map(|c| (c.name.clone(), class_summary(p, c)))
            .collect()
    };
    let (old_classes, new_classes) = (summaries(old), summaries(new));
    let mut lines = Vec::new();
    for c in union(old_classes.keys(), new_classes.keys()) {
        match (old_classes.get(c), new_classes.get(c)) {
            (None, Some(a)) => lines.push(format!("  {c}: added ({a})")),
            (Some(b), None) => lines.push(format!(
                "  {c}: removed (was {b}); its routes fall to default_route"
            )),
            (Some(b), Some(a)) if a != b => lines.push(format!("  {c}: changed\n    - {b}\n    + {a}")),
            _ => {}
        }
    }
    if old.default_route() != new.default_route() {
        lines.push(format!(
            "  default_route: {} -> {}",
            old.default_route().unwrap_or("none"),
            new.default_route().unwrap_or("none")
        ));
    }
    lines
}

/// One line of everything a route class decides with: action, cost,
/// guard, `on_limit`, failure mode, admission labels, degraded answers.
fn class_summary(p: &Policy, c: &RouteClass) -> String {
    let guard = c
        .guard
        .and_then(|g| p.guard(g))
        .map_or("none", |g| g.name.as_str());
    let mode = c.failure_mode.map_or("sync.failure_mode", failure_mode);
    let mut summary = format!(
        "action {}, cost {}, guard {guard}, on limit {}, failure mode {mode}",
        c.action,
        c.cost,
        on_limit(c.on_limit)
    );
    let l = c.labels;
    if l != Labels::default() {
        let dependency = l
            .dependency
            .and_then(|d| p.dependency(d))
            .map_or("none", |d| d.name.as_str());
        let _ = write!(
            summary,
            ", criticality {}, retryable {}, streaming {}, dependency {dependency}, max_body_bytes {}, min_timeout_budget {}",
            l.criticality.as_str(),
            l.retryable,
            l.streaming,
            l.max_body_bytes.map_or_else(|| "none".to_owned(), |n| n.to_string()),
            l.min_timeout_budget_ns
                .map_or_else(|| "none".to_owned(), |ns| format!("{} ms", ns / 1_000_000)),
        );
        if let Some(a) = l.action_limit.and_then(|i| p.action_limit(i)) {
            let _ = write!(summary, ", action max_in_flight {}", a.max_in_flight);
        }
    }
    if let Some(d) = &c.degradable {
        let _ = write!(
            summary,
            ", degradable max_stale {} ms, version_header {}, max_body_bytes {}, slots {}, anonymous {}, refresh {} ms",
            d.max_stale_ns / 1_000_000,
            d.version_header,
            d.max_body_bytes,
            d.slots,
            d.anonymous,
            d.refresh_ns / 1_000_000
        );
    }
    summary
}
