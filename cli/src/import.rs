//! `tenantgate policy import`: an envoyproxy/ratelimit `config.yaml` (one
//! or more files, one domain each) as the equivalent tenantgate policy,
//! plus a report of what does not map.
//!
//! Each rate limit of the source becomes a plan (named after the rule's
//! full key, `domain.key_value.key`) with one `fixed_window` limit of
//! `requests_per_unit` per `unit`: envoyproxy/ratelimit counts in windows
//! aligned to the epoch, and so does tenantgate's `fixed_window` (same
//! window starts, same counts). Each descriptor becomes a rule of the
//! policy's `descriptors:` section, in the same tree and order, naming its
//! plan; `tenantgate serve --grpc-listen` answers Envoy's ratelimit filter
//! from them (the mapping rule is in `tenantgate::policy::descriptors`).
//!
//! What maps one to one: domains, keys, values (exact and with `*`),
//! nested descriptors, `unit` (second, minute, hour, day, week = 7d,
//! month = 30d, year = 365d, as envoyproxy/ratelimit counts them),
//! `requests_per_unit`, `unlimited`, `shadow_mode` (the limit's `shadow`),
//! `rate_limit.name` and `replaces`, `share_threshold` (`shared`). What
//! does not, each line of the report: `detailed_metric` and
//! `value_to_metric` (metrics per descriptor value: tenantgate's metrics
//! never take a label per key; `tenantgate top` shows the hottest keys),
//! `quota_mode`, `metadata`, and `requests_per_unit: 0` (a rule that
//! always refuses: tenantgate has no zero rate; the rule's limit is left
//! out, so the less specific rule of its level applies).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Deserialize;

/// One envoyproxy/ratelimit configuration file (its `validKeys`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SourceFile {
    domain: String,
    #[serde(default)]
    descriptors: Vec<SourceDescriptor>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SourceDescriptor {
    key: String,
    #[serde(default)]
    value: Option<String>,
    #[serde(default)]
    rate_limit: Option<SourceLimit>,
    #[serde(default)]
    descriptors: Vec<SourceDescriptor>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    quota_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    value_to_metric: bool,
    #[serde(default)]
    share_threshold: bool,
    #[serde(default)]
    metadata: Option<serde_norway::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SourceLimit {
    #[serde(default)]
    requests_per_unit: Option<u64>,
    #[serde(default)]
    unit: Option<String>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<SourceReplaces>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SourceReplaces {
    #[serde(default)]
    name: Option<String>,
}

/// The import's result: the policy (YAML text, validated) and the report.
#[derive(Debug)]
pub struct Imported {
    pub policy_yaml: String,
    /// One line per thing that did not map: `FILE: RULE: what: why`.
    pub report: Vec<String>,
    /// Rules and plans written.
    pub rules: usize,
    pub plans: usize,
}

/// A source file: its name (for messages) and its text.
pub struct Source<'a> {
    pub name: &'a str,
    pub text: &'a str,
}

/// The plan every placeholder filter field names (see the header comment
/// the import writes).
pub const UNMATCHED_PLAN: &str = "unmatched";

/// `unit` as tenantgate's `per`, the way envoyproxy/ratelimit divides time.
fn per_of(unit: &str) -> Option<&'static str> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "second" => "1s",
        "minute" => "1m",
        "hour" => "1h",
        "day" => "1d",
        "week" => "7d",
        "month" => "30d",
        "year" => "365d",
        _ => return None,
    })
}

struct Writer<'a> {
    file: &'a str,
    plans: BTreeMap<String, String>,
    report: Vec<String>,
    rules: usize,
}

/// Imports the sources; `version` is the policy's `version`.
pub fn import(sources: &[Source<'_>], version: &str) -> Result<Imported, String> {
    let mut domains: BTreeMap<String, String> = BTreeMap::new();
    let mut w = Writer {
        file: "",
        plans: BTreeMap::new(),
        report: Vec::new(),
        rules: 0,
    };
    for source in sources {
        let file: SourceFile =
            serde_norway::from_str(source.text).map_err(|e| format!("{}: {e}", source.name))?;
        if file.domain.is_empty() {
            return Err(format!("{}: config file cannot have empty domain", source.name));
        }
        if domains.contains_key(&file.domain) {
            return Err(format!("{}: duplicate domain '{}'", source.name, file.domain));
        }
        w.file = source.name;
        let mut body = String::new();
        w.level(&file.descriptors, &file.domain, 2, &mut body)?;
        domains.insert(file.domain, body);
    }
    let policy_yaml = render(sources, version, &w.plans, &domains);
    let doc = crate::policy_file::parse_yaml(&policy_yaml).map_err(|e| format!("(import) {e}"))?;
    if let Err(errors) = tenantgate::policy::Policy::from_node(&doc) {
        let lines: Vec<String> = errors.0.iter().map(|e| format!("(import) {e}")).collect();
        return Err(lines.join("\n"));
    }
    Ok(Imported {
        policy_yaml,
        report: w.report,
        rules: w.rules,
        plans: w.plans.len(),
    })
}

impl Writer<'_> {
    fn note(&mut self, rule: &str, what: &str, why: &str) {
        self.report.push(format!("{}: {rule}: {what}: {why}", self.file));
    }

    /// Writes a level's rules at `indent` (in spaces) into `out`.
    fn level(
        &mut self,
        descriptors: &[SourceDescriptor],
        parent: &str,
        indent: usize,
        out: &mut String,
    ) -> Result<(), String> {
        let mut seen = Vec::new();
        for d in descriptors {
            if d.key.is_empty() {
                return Err(format!("{}: {parent}: descriptor has empty key", self.file));
            }
            let composite = match d.value.as_deref() {
                Some(v) if !v.is_empty() => format!("{}_{v}", d.key),
                _ => d.key.clone(),
            };
            let path = format!("{parent}.{composite}");
            if seen.contains(&composite) {
                return Err(format!(
                    "{}: duplicate descriptor composite key '{path}'",
                    self.file
                ));
            }
            seen.push(composite);
            self.rule(d, &path, indent, out)?;
        }
        Ok(())
    }

    fn rule(
        &mut self,
        d: &SourceDescriptor,
        path: &str,
        indent: usize,
        out: &mut String,
    ) -> Result<(), String> {
        let pad = " ".repeat(indent);
        let value = d.value.as_deref().filter(|v| !v.is_empty());
        let mut fields = Vec::new();
        if let Some(v) = value {
            fields.push(format!("value: {}", quote(v)));
        }
        if let Some(limit) = &d.rate_limit {
            if !self.limit(d, limit, path, &mut fields)? && d.descriptors.is_empty() {
                return Ok(());
            }
        } else if d.shadow_mode {
            self.note(path, "shadow_mode", "no effect: the descriptor has no rate_limit");
        }
        if d.share_threshold {
            if value.is_some_and(|v| v.contains('*')) {
                fields.push("shared: true".to_owned());
            } else {
                return Err(format!(
                    "{}: {path}: share_threshold can only be used with wildcard values",
                    self.file
                ));
            }
        }
        self.unmapped(d, path);
        let _ = writeln!(out, "{pad}- key: {}", quote(&d.key));
        for f in &fields {
            let _ = writeln!(out, "{pad}  {f}");
        }
        self.rules += 1;
        if !d.descriptors.is_empty() {
            let _ = writeln!(out, "{pad}  descriptors:");
            self.level(&d.descriptors, path, indent + 4, out)?;
        }
        Ok(())
    }

    /// The rule's limit fields; `false`: the rule is left out.
    fn limit(
        &mut self,
        d: &SourceDescriptor,
        limit: &SourceLimit,
        path: &str,
        fields: &mut Vec<String>,
    ) -> Result<bool, String> {
        if let Some(name) = limit.name.as_deref().filter(|n| !n.is_empty()) {
            fields.push(format!("name: {}", quote(name)));
        }
        let mut replaces = Vec::new();
        for r in &limit.replaces {
            match r.name.as_deref().filter(|n| !n.is_empty()) {
                Some(n) => replaces.push(quote(n)),
                None => {
                    return Err(format!(
                        "{}: {path}: should not have an empty replaces entry",
                        self.file
                    ))
                }
            }
        }
        if !replaces.is_empty() {
            fields.push(format!("replaces: [{}]", replaces.join(", ")));
        }
        let per = limit
            .unit
            .as_deref()
            .filter(|u| !u.is_empty())
            .map(|u| (u, per_of(u)));
        if limit.unlimited {
            if per.is_some() {
                return Err(format!(
                    "{}: {path}: should not specify rate limit unit when unlimited",
                    self.file
                ));
            }
            fields.push("unlimited: true".to_owned());
            if d.shadow_mode {
                self.note(path, "shadow_mode", "no effect on an unlimited rule");
            }
            return Ok(true);
        }
        let per = match per {
            Some((_, Some(per))) => per,
            Some((unit, None)) => {
                return Err(format!("{}: {path}: invalid rate limit unit '{unit}'", self.file))
            }
            None => return Err(format!("{}: {path}: invalid rate limit unit ''", self.file)),
        };
        let rate = limit.requests_per_unit.unwrap_or(0);
        if rate == 0 {
            self.note(
                path,
                "requests_per_unit: 0",
                "not mapped (tenantgate has no zero rate; block the value in Envoy, e.g. with RBAC): the rule's limit is left out, so the less specific rule of its level applies",
            );
            return Ok(false);
        }
        let plan = self.plan_name(path);
        let shadow = if d.shadow_mode { ", shadow: true" } else { "" };
        self.plans.insert(
            plan.clone(),
            format!("{{ algorithm: fixed_window, rate: {rate}, per: {per}{shadow} }}"),
        );
        fields.push(format!("plan: {plan}"));
        Ok(true)
    }

    fn unmapped(&mut self, d: &SourceDescriptor, path: &str) {
        const METRICS: &str = "not mapped: tenantgate keeps no metric per descriptor value (bounded labels); `tenantgate top` lists the hottest keys";
        if d.detailed_metric {
            self.note(path, "detailed_metric", METRICS);
        }
        if d.value_to_metric {
            self.note(path, "value_to_metric", METRICS);
        }
        if d.quota_mode {
            self.note(path, "quota_mode", "not mapped: decided as an ordinary limit");
        }
        if d.metadata.is_some() {
            self.note(
                path,
                "metadata",
                "not mapped: RLS answers carry no per-rule metadata",
            );
        }
    }

    /// A plan name for rule `path`: its characters outside
    /// `A-Z a-z 0-9 _ - .` as `-`, at most 64, unique.
    fn plan_name(&self, path: &str) -> String {
        let clean: String = path
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.') {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        let base: String = clean.chars().take(60).collect();
        if base == clean && !self.plans.contains_key(&base) && base != UNMATCHED_PLAN {
            return base;
        }
        (2u32..)
            .map(|n| format!("{base}-{n}"))
            .find(|name| !self.plans.contains_key(name))
            .unwrap_or(base)
    }
}

/// A YAML scalar: bare where safe, else double-quoted (JSON escapes are
/// YAML's too).
fn quote(s: &str) -> String {
    let bare = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/'))
        && !s.starts_with(['-', '.'])
        && !matches!(
            s,
            "true" | "false" | "null" | "yes" | "no" | "on" | "off" | "y" | "n" | "~"
        )
        && s.parse::<f64>().is_err();
    if bare {
        s.to_owned()
    } else {
        serde_json::to_string(s).unwrap_or_else(|_| format!("{s:?}"))
    }
}

fn render(
    sources: &[Source<'_>],
    version: &str,
    plans: &BTreeMap<String, String>,
    domains: &BTreeMap<String, String>,
) -> String {
    let mut out = String::new();
    let names: Vec<&str> = sources.iter().map(|s| s.name).collect();
    let _ = writeln!(
        out,
        "# Imported by `tenantgate policy import` from {}.\n\
         # `tenantgate serve --grpc-listen` answers Envoy's ratelimit filter from\n\
         # `descriptors` and `plans` (docs/migrating.md). What did not map is in the\n\
         # import's report.",
        names.join(", ")
    );
    let _ = writeln!(out, "version: {}\nmode: enforce\n", quote(version));
    let _ = writeln!(
        out,
        "# The filter's fields, for step 3 of the migration (the filter in Envoy):\n\
         # placeholders until then; the rate limit service does not read them.\n\
         identity: {{ header: x-tenant-id }}\n\
         default_plan: {UNMATCHED_PLAN}\n\
         anonymous: {{ plan: {UNMATCHED_PLAN} }}\n\
         routes: {{ default: {{}} }}\n\
         default_route: default\n"
    );
    let _ = writeln!(
        out,
        "# One plan per rate limit: fixed windows aligned to the epoch, as\n\
         # envoyproxy/ratelimit counts.\nplans:"
    );
    for (name, limit) in plans {
        let _ = writeln!(out, "  {name}:\n    limits: [ {limit} ]");
    }
    let _ = writeln!(
        out,
        "  {UNMATCHED_PLAN}:   # the filter's placeholder: effectively no limit\n    limits: [ {{ rate: 1000000000, per: 1s }} ]\n"
    );
    let _ = writeln!(out, "descriptors:");
    for (domain, body) in domains {
        let _ = writeln!(out, "  {}:", quote(domain));
        if body.is_empty() {
            let _ = writeln!(out, "    []");
        } else {
            out.push_str(&indent_by(body, 2));
        }
    }
    out
}

fn indent_by(text: &str, n: usize) -> String {
    let pad = " ".repeat(n);
    text.lines().map(|l| format!("{pad}{l}\n")).collect()
}
