//! `descriptors:` the rules by which `tenantgate serve` answers Envoy's
//! rate limit service protocol (RLS, `envoy.service.ratelimit.v3`), for
//! Envoys that run the native `envoy.filters.http.ratelimit` filter. The
//! filter only validates this section.
//!
//! # The mapping rule
//! A request names a *domain* and carries descriptors, each a list of
//! `(key, value)` entries. The rules of a domain form a tree written like
//! envoyproxy/ratelimit's `config.yaml` (`tenantgate policy import` writes
//! it from one): each rule has a `key`, an optional `value` (exact, or a
//! pattern where each `*` matches any run of characters), and nested
//! `descriptors`. A descriptor is matched level by level, one entry per
//! level, as envoyproxy/ratelimit matches it:
//! 1. at each level, the rule with the entry's key and exactly its value,
//!    else the first rule (in the order written) with the entry's key whose
//!    pattern matches the value, else the rule with the entry's key and no
//!    value;
//! 2. the descriptor is limited by the rule matched at its **last** entry
//!    (a descriptor longer or shorter than the rule path matches nothing),
//!    if that rule names a `plan` (or says `unlimited`); no match: no limit.
//!
//! A matched rule is a tenantgate key: its **action** is the rule's path
//! (`domain.key_value.key`, envoyproxy/ratelimit's "full key") and its
//! **tenant** is the descriptor's entries, values included (a rule
//! without a value counts every value apart, as a tenant each), except
//! that a rule with `shared: true` counts every value its pattern matches
//! as one. Every limit of the rule's plan applies to that key with the
//! plan's algorithms, all or nothing, exactly as the filter applies a
//! plan to tenant × action. `replaces: [name]` drops, from one request,
//! the rule named `name` when both match (envoyproxy/ratelimit's
//! `replaces`).

use std::collections::BTreeMap;

use hashbrown::HashMap;
use serde::Deserialize;

use super::error::{FieldPath, PolicyError};

/// Deepest rule tree (entries per descriptor). envoyproxy/ratelimit sets
/// no bound; Envoy's descriptors are as long as the route's actions.
pub const MAX_DEPTH: usize = 32;
/// Longest domain, key, value or name, in bytes: 64 KiB, above Envoy's
/// default limit on a request's headers (60 KiB), where values come from.
/// envoyproxy/ratelimit sets no bound. The service's records are named by
/// a digest past a few hundred bytes, so a long value costs no memory per
/// record.
pub const MAX_TEXT_LEN: usize = 65_536;

/// `descriptors.<domain>[i]:` one rule as written.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RuleSpec {
    pub key: String,
    #[serde(default)]
    pub value: Option<String>,
    /// The plan whose limits apply to a descriptor this rule matches.
    #[serde(default)]
    pub plan: Option<String>,
    /// Matched, never limited (envoyproxy/ratelimit's `unlimited: true`).
    #[serde(default)]
    pub unlimited: Option<bool>,
    /// What other rules' `replaces` name.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub replaces: Vec<String>,
    /// Every value the pattern matches shares one count.
    #[serde(default)]
    pub shared: Option<bool>,
    #[serde(default)]
    pub descriptors: Vec<RuleSpec>,
}

/// The compiled `descriptors:` section.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptors {
    domains: HashMap<String, Level>,
}

/// The rules of one level of a domain's tree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Level {
    rules: Vec<Rule>,
    /// `(key, value)` of the rules with an exact value → index.
    exact: HashMap<(String, String), usize>,
    /// The rules with a pattern, in the order written: (key, parts split
    /// on `*`, index).
    patterns: Vec<(String, Vec<String>, usize)>,
    /// key → index of the rule with no value.
    any: HashMap<String, usize>,
}

/// One compiled rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// `domain.key_value.key`: the action of the keys it limits.
    pub path: String,
    /// The plan (index into the policy's plans); `None`: no limit.
    pub plan: Option<usize>,
    pub unlimited: bool,
    pub name: Option<String>,
    pub replaces: Vec<String>,
    /// `shared: true`: the pattern stands for the value in the key.
    shared_pattern: Option<String>,
    children: Level,
}

/// What a descriptor matched: its rule and the key it is counted under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found<'a> {
    pub rule: &'a Rule,
    /// The descriptor's entries as counted (length-prefixed, so no two
    /// descriptors share a key by accident); the tenant part of the key.
    pub tenant: String,
}

impl Descriptors {
    /// Whether any domain has rules.
    pub fn is_empty(&self) -> bool {
        self.domains.is_empty()
    }

    /// Whether `domain` has rules.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The rule a descriptor matches (see the module's mapping rule).
    pub fn find<'a>(&'a self, domain: &str, entries: &[(&str, &str)]) -> Option<Found<'a>> {
        let mut level = self.domains.get(domain)?;
        let last = entries.len().checked_sub(1)?;
        let mut tenant = String::new();
        for (i, (key, value)) in entries.iter().enumerate() {
            let rule = level.matching(key, value)?;
            let counted = rule.shared_pattern.as_deref().unwrap_or(value);
            push_part(&mut tenant, key);
            push_part(&mut tenant, counted);
            if i == last {
                return (rule.plan.is_some() || rule.unlimited).then_some(Found { rule, tenant });
            }
            level = &rule.children;
        }
        None
    }
    /// The rule an unordered set of entries matches (an RLQS `BucketId`, a
    /// map): the entries are put in an order the rule tree reads, one per
    /// level, and then matched as [`Descriptors::find`] matches that
    /// descriptor (same rule, same key). The order is the first found
    /// trying, at each level, the entries not yet placed by their matching
    /// rule's place in the order written (as `find` matches an entry),
    /// backtracking when a choice leaves entries no rule reads; at most
    /// [`MAX_ORDER_STEPS`] tries, then no match.
    pub fn find_unordered<'a>(&'a self, domain: &str, entries: &[(&str, &str)]) -> Option<Found<'a>> {
        let level = self.domains.get(domain)?;
        if entries.is_empty() || entries.len() > MAX_DEPTH {
            return None;
        }
        let mut left: Vec<(&str, &str)> = entries.to_vec();
        left.sort_unstable();
        let mut ordered = Vec::with_capacity(entries.len());
        let mut steps = 0usize;
        if place(level, &mut left, &mut ordered, &mut steps) {
            self.find(domain, &ordered)
        } else {
            None
        }
    }
}

/// Most rule matches one [`Descriptors::find_unordered`] tries.
pub const MAX_ORDER_STEPS: usize = 4096;

/// Places every entry of `left` after `ordered`, one per level from
/// `level` down; the last one's rule has a plan or is `unlimited`.
fn place<'e>(
    level: &Level,
    left: &mut Vec<(&'e str, &'e str)>,
    ordered: &mut Vec<(&'e str, &'e str)>,
    steps: &mut usize,
) -> bool {
    let mut candidates: Vec<(usize, usize)> = left
        .iter()
        .enumerate()
        .filter_map(|(at, (k, v))| level.matching_index(k, v).map(|i| (i, at)))
        .collect();
    candidates.sort_unstable();
    for (i, at) in candidates {
        *steps = steps.saturating_add(1);
        let Some(rule) = level.rules.get(i) else {
            continue;
        };
        if *steps > MAX_ORDER_STEPS || at >= left.len() {
            return false;
        }
        let entry = left.remove(at);
        ordered.push(entry);
        let done = if left.is_empty() {
            rule.plan.is_some() || rule.unlimited
        } else {
            place(&rule.children, left, ordered, steps)
        };
        if done {
            return true;
        }
        ordered.pop();
        left.insert(at, entry);
    }
    false
}

/// Appends `s` length-prefixed.
fn push_part(out: &mut String, s: &str) {
    out.push_str(&s.len().to_string());
    out.push(':');
    out.push_str(s);
}

impl Level {
    fn matching(&self, key: &str, value: &str) -> Option<&Rule> {
        self.matching_index(key, value).and_then(|i| self.rules.get(i))
    }

    /// The index of the rule [`Level::matching`] picks.
    fn matching_index(&self, key: &str, value: &str) -> Option<usize> {
        if let Some(&i) = self.exact.get(&(key.to_owned(), value.to_owned())) {
            return Some(i);
        }
        let pattern = self
            .patterns
            .iter()
            .find(|(k, parts, _)| k == key && wildcard_match(parts, value));
        if let Some((_, _, i)) = pattern {
            return Some(*i);
        }
        self.any.get(key).copied()
    }
}

/// Whether `value` matches a pattern split on `*` (each `*` any run of
/// characters, possibly empty).
pub fn wildcard_match(parts: &[String], value: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else {
        return false;
    };
    if parts.len() == 1 {
        return first == value;
    }
    let fixed: usize = parts.iter().map(String::len).sum();
    if value.len() < fixed || !value.starts_with(first.as_str()) || !value.ends_with(last.as_str()) {
        return false;
    }
    let Some(mut rest) = value.get(first.len()..value.len() - last.len()) else {
        return false;
    };
    for part in parts.iter().take(parts.len() - 1).skip(1) {
        match rest.find(part.as_str()) {
            Some(at) => rest = rest.get(at + part.len()..).unwrap_or(""),
            None => return false,
        }
    }
    true
}

fn is_text(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_TEXT_LEN && !s.chars().any(char::is_control)
}

/// Compiles `descriptors:`; `plans` resolves a plan name to its index.
pub fn compile(
    specs: &BTreeMap<String, Vec<RuleSpec>>,
    plans: &HashMap<String, usize>,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Descriptors {
    let mut domains = HashMap::new();
    for (domain, rules) in specs {
        let at = path.key(domain);
        if !is_text(domain) {
            errors.push(PolicyError::new(
                at.clone(),
                format!("a domain is 1 to {MAX_TEXT_LEN} bytes without control characters"),
            ));
        }
        let mut names = Vec::new();
        let level = compile_level(rules, domain, plans, &at, 1, &mut names, errors);
        check_replaces(&level, &names, &at, errors);
        domains.insert(domain.clone(), level);
    }
    Descriptors { domains }
}

fn compile_level(
    specs: &[RuleSpec],
    parent: &str,
    plans: &HashMap<String, usize>,
    path: &FieldPath,
    depth: usize,
    names: &mut Vec<String>,
    errors: &mut Vec<PolicyError>,
) -> Level {
    let mut level = Level::default();
    if depth > MAX_DEPTH && !specs.is_empty() {
        errors.push(PolicyError::new(
            path.clone(),
            format!("rules nest at most {MAX_DEPTH} levels deep"),
        ));
        return level;
    }
    for (i, spec) in specs.iter().enumerate() {
        let at = path.index(i);
        let Some(rule) = compile_rule(spec, parent, plans, &at, depth, names, errors) else {
            continue;
        };
        let index = level.rules.len();
        let taken = match spec.value.as_deref() {
            None => level.any.insert(spec.key.clone(), index).is_some(),
            Some(v) if v.contains('*') => {
                let dup = level
                    .patterns
                    .iter()
                    .any(|(k, p, _)| *k == spec.key && p.join("*") == v);
                let parts = v.split('*').map(str::to_owned).collect();
                level.patterns.push((spec.key.clone(), parts, index));
                dup
            }
            Some(v) => level
                .exact
                .insert((spec.key.clone(), v.to_owned()), index)
                .is_some(),
        };
        if taken {
            errors.push(PolicyError::new(
                at,
                format!(
                    "another rule of this level has the same key and value (`{}`)",
                    rule.path
                ),
            ));
        }
        level.rules.push(rule);
    }
    level
}

fn compile_rule(
    spec: &RuleSpec,
    parent: &str,
    plans: &HashMap<String, usize>,
    at: &FieldPath,
    depth: usize,
    names: &mut Vec<String>,
    errors: &mut Vec<PolicyError>,
) -> Option<Rule> {
    let mut ok = true;
    let mut fail = |field: &str, message: String| {
        errors.push(PolicyError::new(at.key(field), message));
        ok = false;
    };
    if !is_text(&spec.key) {
        fail(
            "key",
            format!("must be 1 to {MAX_TEXT_LEN} bytes without control characters"),
        );
    }
    if spec.value.as_deref().is_some_and(|v| !is_text(v)) {
        fail(
            "value",
            format!("must be 1 to {MAX_TEXT_LEN} bytes without control characters"),
        );
    }
    let unlimited = spec.unlimited.unwrap_or(false);
    let plan = match (&spec.plan, unlimited) {
        (Some(_), true) => {
            fail(
                "unlimited",
                "a rule is either `unlimited` or has a `plan`".to_owned(),
            );
            None
        }
        (Some(p), false) => match plans.get(p) {
            Some(&i) => Some(i),
            None => {
                fail("plan", format!("unknown plan `{p}`"));
                None
            }
        },
        (None, _) => None,
    };
    let shared = spec.shared.unwrap_or(false);
    let value = spec.value.as_deref();
    if shared && !value.is_some_and(|v| v.contains('*')) {
        fail(
            "shared",
            "only a rule whose value has a `*` can share its count".to_owned(),
        );
    }
    if let Some(name) = &spec.name {
        if !is_text(name) {
            fail(
                "name",
                format!("must be 1 to {MAX_TEXT_LEN} bytes without control characters"),
            );
        } else {
            names.push(name.clone());
        }
    }
    for (j, replaced) in spec.replaces.iter().enumerate() {
        if spec.name.as_ref() == Some(replaced) {
            errors.push(PolicyError::new(
                at.key("replaces").index(j),
                "a rule cannot replace itself",
            ));
            ok = false;
        }
    }
    let path = match value {
        Some(v) => format!("{parent}.{}_{v}", spec.key),
        None => format!("{parent}.{}", spec.key),
    };
    let children = compile_level(
        &spec.descriptors,
        &path,
        plans,
        &at.key("descriptors"),
        depth + 1,
        names,
        errors,
    );
    ok.then(|| Rule {
        path,
        plan,
        unlimited,
        name: spec.name.clone(),
        replaces: spec.replaces.clone(),
        shared_pattern: shared.then(|| value.unwrap_or_default().to_owned()),
        children,
    })
}

/// Every `replaces` names a rule of its domain.
fn check_replaces(level: &Level, names: &[String], at: &FieldPath, errors: &mut Vec<PolicyError>) {
    for rule in &level.rules {
        for replaced in &rule.replaces {
            if !names.contains(replaced) {
                errors.push(PolicyError::new(
                    at.clone(),
                    format!(
                        "rule `{}` replaces `{replaced}`, which no rule of the domain is named",
                        rule.path
                    ),
                ));
            }
        }
        check_replaces(&rule.children, names, at, errors);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(p: &str) -> Vec<String> {
        p.split('*').map(str::to_owned).collect()
    }

    #[test]
    fn wildcards_match_like_envoyproxy_ratelimit() {
        assert!(wildcard_match(&parts("value*"), "value1"));
        assert!(wildcard_match(&parts("value*"), "value"));
        assert!(!wildcard_match(&parts("value*"), "valu"));
        assert!(wildcard_match(&parts("/api/*/action"), "/api/123/action"));
        assert!(!wildcard_match(&parts("/api/*/action"), "/api/123/other"));
        assert!(wildcard_match(
            &parts("/api/*/resource/*/action"),
            "/api/v1/resource/9/action"
        ));
        assert!(!wildcard_match(
            &parts("/api/*/resource/*/action"),
            "/api/v1/action"
        ));
        assert!(!wildcard_match(&parts("a*a"), "a"));
        assert!(wildcard_match(&parts("*"), ""));
        assert!(wildcard_match(&parts("exact"), "exact"));
    }

    fn rule(key: &str, value: Option<&str>, plan: Option<&str>, children: Vec<RuleSpec>) -> RuleSpec {
        RuleSpec {
            key: key.into(),
            value: value.map(Into::into),
            plan: plan.map(Into::into),
            unlimited: None,
            name: None,
            replaces: vec![],
            shared: None,
            descriptors: children,
        }
    }

    fn compiled(rules: Vec<RuleSpec>) -> Descriptors {
        let plans: HashMap<String, usize> = [("p".to_owned(), 0), ("q".to_owned(), 1)].into_iter().collect();
        let mut errors = Vec::new();
        let d = compile(
            &[("dom".to_owned(), rules)].into_iter().collect(),
            &plans,
            &FieldPath::root(),
            &mut errors,
        );
        assert!(errors.is_empty(), "{errors:?}");
        d
    }

    #[test]
    fn the_most_specific_rule_at_the_descriptors_depth_matches() {
        let d = compiled(vec![
            rule("ip", None, Some("p"), vec![]),
            rule("ip", Some("50.0.0.5"), Some("q"), vec![]),
            rule("ip", Some("10.*"), Some("q"), vec![]),
            rule(
                "kind",
                Some("marketing"),
                None,
                vec![rule("to", None, Some("p"), vec![])],
            ),
        ]);
        let f = d.find("dom", &[("ip", "1.2.3.4")]).unwrap();
        assert_eq!((f.rule.path.as_str(), f.rule.plan), ("dom.ip", Some(0)));
        assert_eq!(f.tenant, "2:ip7:1.2.3.4");
        assert_eq!(
            d.find("dom", &[("ip", "50.0.0.5")]).unwrap().rule.path,
            "dom.ip_50.0.0.5"
        );
        assert_eq!(
            d.find("dom", &[("ip", "10.1.1.1")]).unwrap().rule.path,
            "dom.ip_10.*"
        );
        let nested = d.find("dom", &[("kind", "marketing"), ("to", "206")]).unwrap();
        assert_eq!(nested.rule.path, "dom.kind_marketing.to");
        // Shorter or longer than the rule path, another domain: nothing.
        assert!(d.find("dom", &[("kind", "marketing")]).is_none());
        assert!(d.find("dom", &[("ip", "1"), ("x", "y")]).is_none());
        assert!(d.find("other", &[("ip", "1")]).is_none());
        assert!(d.find("dom", &[]).is_none());
    }

    #[test]
    fn unordered_entries_are_read_in_the_rule_trees_order() {
        let d = compiled(vec![
            rule("tenant", None, Some("p"), vec![]),
            rule(
                "route",
                Some("search"),
                None,
                vec![rule("tenant", None, Some("q"), vec![])],
            ),
        ]);
        let nested = d
            .find_unordered("dom", &[("tenant", "a"), ("route", "search")])
            .unwrap();
        assert_eq!(
            nested,
            d.find("dom", &[("route", "search"), ("tenant", "a")]).unwrap()
        );
        assert_eq!(
            d.find_unordered("dom", &[("tenant", "a")]),
            d.find("dom", &[("tenant", "a")])
        );
        // An entry no rule of its level has: nothing.
        assert!(d.find_unordered("dom", &[("tenant", "a"), ("x", "y")]).is_none());
        assert!(d.find_unordered("dom", &[]).is_none());
        assert!(d.find_unordered("other", &[("tenant", "a")]).is_none());
    }

    #[test]
    fn a_shared_pattern_counts_every_matching_value_as_one() {
        let mut r = rule("files", Some("files/*"), Some("p"), vec![]);
        r.shared = Some(true);
        let d = compiled(vec![r, rule("own", Some("own/*"), Some("p"), vec![])]);
        let a = d.find("dom", &[("files", "files/a.pdf")]).unwrap();
        let b = d.find("dom", &[("files", "files/b.csv")]).unwrap();
        assert_eq!(a.tenant, b.tenant);
        let a = d.find("dom", &[("own", "own/a")]).unwrap();
        let b = d.find("dom", &[("own", "own/b")]).unwrap();
        assert_ne!(a.tenant, b.tenant);
    }

    #[test]
    fn invalid_rules_name_their_field() {
        let plans = HashMap::new();
        let mut bad = rule("k", Some("v"), Some("nope"), vec![]);
        bad.shared = Some(true);
        bad.name = Some("n".into());
        bad.replaces = vec!["n".into(), "ghost".into()];
        let dup = rule("k", Some("v"), None, vec![]);
        let mut errors = Vec::new();
        compile(
            &[("dom".to_owned(), vec![bad, dup])].into_iter().collect(),
            &plans,
            &FieldPath::root().key("descriptors"),
            &mut errors,
        );
        let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "descriptors.dom[0].plan: unknown plan `nope`",
                "descriptors.dom[0].shared: only a rule whose value has a `*` can share its count",
                "descriptors.dom[0].replaces[0]: a rule cannot replace itself",
            ]
        );
    }
}
