//! `tenantgate policy import`: envoyproxy/ratelimit `config.yaml` files
//! (one domain each) as the equivalent tenantgate policy, plus a report of
//! what does not map. It accepts every file envoyproxy/ratelimit's loader
//! accepts and refuses what it refuses, naming the file, the line and the
//! key ([`source`] reads a file as that loader does).
//!
//! Each rate limit becomes a plan (named after the rule's full key,
//! `domain.key_value.key`) with one `fixed_window` limit of
//! `requests_per_unit` per `unit`: envoyproxy/ratelimit counts in windows
//! aligned to the epoch, and so does tenantgate's `fixed_window` (same
//! window starts, same counts), whose rate takes the same range (0 to
//! 2³²−1; 0: every request over the limit, as there). Each descriptor
//! becomes a rule of the policy's `descriptors:` section, in the same tree
//! and order, naming its plan; `tenantgate serve --grpc-listen` answers
//! Envoy's ratelimit filter from them (the mapping rule is in
//! `tenantgate::policy::descriptors`).
//!
//! Key by key:
//! * one to one: `domain`, `key`, `value` (exact and with `*`), nested
//!   `descriptors` (up to `MAX_DEPTH` levels: deeper rules are left out and
//!   reported, as tenantgate's RLS refuses a longer descriptor), `unit`
//!   (second, minute, hour, day, week = 7d, month = 30d, year = 365d, as
//!   envoyproxy/ratelimit counts them), `requests_per_unit`, `unlimited`,
//!   `shadow_mode` (the limit's `shadow`), `rate_limit.name` and
//!   `replaces` (an entry naming no rule of its domain replaces nothing
//!   there either: left out, reported), `share_threshold` (`shared`, when
//!   the `*` is in the value);
//! * mapped and reported: `quota_mode` (the limit's `on_limit: soft`,
//!   which the RLS answers `OK` as envoyproxy/ratelimit answers a quota
//!   descriptor over its limit unless every quota descriptor of the
//!   request is);
//! * reported, not mapped: `detailed_metric` and `value_to_metric`
//!   (metrics per descriptor value: tenantgate's metrics never take a
//!   label per key; `tenantgate top` shows the hottest keys), `metadata`
//!   (envoyproxy/ratelimit adds it to the answer's `dynamic_metadata` only
//!   with its `RESPONSE_DYNAMIC_METADATA` setting; tenantgate's RLS sets
//!   none), and known keys where that loader ignores them.

mod source;

use std::collections::BTreeMap;
use std::fmt::Write as _;

use tenantgate::policy::descriptors::{MAX_DEPTH, MAX_TEXT_LEN};

use self::source::{Desc, Ignored, Limit};

/// The import's result: the policy (YAML text, validated) and the report.
#[derive(Debug)]
pub struct Imported {
    pub policy_yaml: String,
    /// One line per thing that did not map: `FILE:LINE: RULE: what: why`.
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

/// `unit` as tenantgate's `per`, the way envoyproxy/ratelimit divides time
/// (its proto's units, any case).
fn per_of(unit: &str) -> Option<&'static str> {
    Some(match unit.to_ascii_uppercase().as_str() {
        "SECOND" => "1s",
        "MINUTE" => "1m",
        "HOUR" => "1h",
        "DAY" => "1d",
        "WEEK" => "7d",
        "MONTH" => "30d",
        "YEAR" => "365d",
        _ => return None,
    })
}

struct Writer<'a> {
    file: &'a str,
    plans: BTreeMap<String, String>,
    report: Vec<String>,
    rules: usize,
    /// The names of the current domain's rules (what `replaces` can name).
    names: Vec<String>,
}

/// Imports the sources; `version` is the policy's `version`.
pub fn import(sources: &[Source<'_>], version: &str) -> Result<Imported, String> {
    let mut domains: BTreeMap<String, String> = BTreeMap::new();
    let mut w = Writer {
        file: "",
        plans: BTreeMap::new(),
        report: Vec::new(),
        rules: 0,
        names: Vec::new(),
    };
    for src in sources {
        let root = source::read(src.name, src.text)?;
        if root.domain.is_empty() {
            return Err(format!(
                "{}:1: domain: config file cannot have empty domain",
                src.name
            ));
        }
        if domains.contains_key(&root.domain) {
            return Err(format!(
                "{}:1: domain: duplicate domain '{}' in config file",
                src.name, root.domain
            ));
        }
        w.file = src.name;
        w.ignored(&root.ignored, "(file)");
        w.names = Vec::new();
        names_of(&root.descriptors, 1, &mut w.names);
        let mut body = String::new();
        w.level(&root.descriptors, &root.domain, 1, &mut body)?;
        domains.insert(root.domain, body);
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

/// The names of the rules that will be written (down to `MAX_DEPTH`).
fn names_of(descriptors: &[Desc], depth: usize, out: &mut Vec<String>) {
    if depth > MAX_DEPTH {
        return;
    }
    for d in descriptors {
        if let Some(name) = d.rate_limit.as_ref().map(|l| &l.name).filter(|n| !n.is_empty()) {
            out.push(name.clone());
        }
        names_of(&d.descriptors, depth + 1, out);
    }
}

impl Writer<'_> {
    fn note(&mut self, line: usize, rule: &str, what: &str, why: &str) {
        self.report
            .push(format!("{}:{line}: {rule}: {what}: {why}", self.file));
    }

    fn fail(&self, line: usize, rule: &str, message: &str) -> String {
        format!("{}:{line}: {rule}: {message}", self.file)
    }

    fn ignored(&mut self, ignored: &[Ignored], rule: &str) {
        for i in ignored {
            self.note(
                i.line,
                rule,
                &i.key,
                "ignored (envoyproxy/ratelimit reads no such field there either)",
            );
        }
    }

    /// Writes a level's rules (at `depth`, 1 for a domain's) into `out`.
    fn level(
        &mut self,
        descriptors: &[Desc],
        parent: &str,
        depth: usize,
        out: &mut String,
    ) -> Result<(), String> {
        let mut seen: Vec<String> = Vec::new();
        for d in descriptors {
            if d.key.is_empty() {
                return Err(self.fail(d.line, parent, "descriptor has empty key"));
            }
            let composite = if d.value.is_empty() {
                d.key.clone()
            } else {
                format!("{}_{}", d.key, d.value)
            };
            let path = format!("{parent}.{composite}");
            if seen.contains(&composite) {
                return Err(self.fail(
                    d.line,
                    &path,
                    &format!("duplicate descriptor composite key '{path}'"),
                ));
            }
            seen.push(composite);
            if depth > MAX_DEPTH {
                self.note(
                    d.line,
                    &path,
                    "nesting",
                    &format!("left out: deeper than {MAX_DEPTH} levels, which tenantgate's RLS refuses in a request (INVALID_ARGUMENT)"),
                );
                continue;
            }
            self.rule(d, &path, depth, out)?;
        }
        Ok(())
    }

    fn rule(&mut self, d: &Desc, path: &str, depth: usize, out: &mut String) -> Result<(), String> {
        let pad = " ".repeat(4 * depth - 2);
        for (what, text) in [("key", &d.key), ("value", &d.value)] {
            if text.len() > MAX_TEXT_LEN || text.chars().any(char::is_control) {
                return Err(self.fail(
                    d.lines.of(what, d.line),
                    path,
                    &format!("{what}: tenantgate holds 1 to {MAX_TEXT_LEN} bytes without control characters"),
                ));
            }
        }
        let mut fields = Vec::new();
        if !d.value.is_empty() {
            fields.push(format!("value: {}", quote(&d.value)));
        }
        match &d.rate_limit {
            Some(limit) => self.limit(d, limit, path, &mut fields)?,
            None => {
                for (set, what) in [(d.shadow_mode, "shadow_mode"), (d.quota_mode, "quota_mode")] {
                    if set {
                        self.note(
                            d.lines.of(what, d.line),
                            path,
                            what,
                            "no effect: the descriptor has no rate_limit",
                        );
                    }
                }
            }
        }
        self.share(d, path, &mut fields)?;
        self.unmapped(d, path);
        let _ = writeln!(out, "{pad}- key: {}", quote(&d.key));
        for f in &fields {
            let _ = writeln!(out, "{pad}  {f}");
        }
        self.rules += 1;
        let mut children = String::new();
        self.level(&d.descriptors, path, depth + 1, &mut children)?;
        if !children.is_empty() {
            let _ = writeln!(out, "{pad}  descriptors:");
            out.push_str(&children);
        }
        Ok(())
    }

    /// `share_threshold`: the loader wants a `*` in the key or the value.
    fn share(&mut self, d: &Desc, path: &str, fields: &mut Vec<String>) -> Result<(), String> {
        if !d.share_threshold {
            return Ok(());
        }
        if d.value.contains('*') {
            fields.push("shared: true".to_owned());
        } else if d.key.contains('*') {
            self.note(
                d.lines.of("share_threshold", d.line),
                path,
                "share_threshold",
                "not mapped: the `*` is in the key, and tenantgate shares a count by a value's pattern only",
            );
        } else {
            let key = if d.value.is_empty() {
                d.key.clone()
            } else {
                format!("{}_{}", d.key, d.value)
            };
            return Err(self.fail(
                d.lines.of("share_threshold", d.line),
                path,
                &format!("share_threshold: share_threshold can only be used with wildcard values (containing '*'), but found key '{key}'"),
            ));
        }
        Ok(())
    }

    /// The rule's limit fields.
    fn limit(&mut self, d: &Desc, limit: &Limit, path: &str, fields: &mut Vec<String>) -> Result<(), String> {
        self.ignored(&limit.ignored, path);
        if !limit.name.is_empty() {
            if limit.name.len() > MAX_TEXT_LEN || limit.name.chars().any(char::is_control) {
                return Err(self.fail(
                    limit.lines.of("name", limit.line),
                    path,
                    &format!("rate_limit.name: tenantgate holds 1 to {MAX_TEXT_LEN} bytes without control characters"),
                ));
            }
            fields.push(format!("name: {}", quote(&limit.name)));
        }
        let per = per_of(&limit.unit);
        if limit.unlimited && per.is_some() {
            return Err(self.fail(
                limit.lines.of("unit", limit.line),
                path,
                "rate_limit.unit: should not specify rate limit unit when unlimited",
            ));
        }
        if !limit.unlimited && per.is_none() {
            return Err(self.fail(
                limit.lines.of("unit", limit.line),
                path,
                &format!("rate_limit.unit: invalid rate limit unit '{}'", limit.unit),
            ));
        }
        let replaces = self.replaces(limit, path)?;
        if !replaces.is_empty() {
            fields.push(format!("replaces: [{}]", replaces.join(", ")));
        }
        let Some(per) = per.filter(|_| !limit.unlimited) else {
            fields.push("unlimited: true".to_owned());
            for (set, what) in [(d.shadow_mode, "shadow_mode"), (d.quota_mode, "quota_mode")] {
                if set {
                    self.note(
                        d.lines.of(what, d.line),
                        path,
                        what,
                        "no effect on an unlimited rule",
                    );
                }
            }
            return Ok(());
        };
        let mut extra = String::new();
        if d.shadow_mode {
            extra.push_str(", shadow: true");
            if d.quota_mode {
                self.note(
                    d.lines.of("quota_mode", d.line),
                    path,
                    "quota_mode",
                    "no effect beside shadow_mode (a shadow limit never refuses)",
                );
            }
        } else if d.quota_mode {
            extra.push_str(", on_limit: soft");
            self.note(
                d.lines.of("quota_mode", d.line),
                path,
                "quota_mode",
                "mapped to `on_limit: soft` (answered OK over the limit); envoyproxy/ratelimit refuses a request whose every quota descriptor is over its limit, tenantgate's RLS never does",
            );
        }
        let plan = self.plan_name(path);
        self.plans.insert(
            plan.clone(),
            format!(
                "{{ algorithm: fixed_window, rate: {}, per: {per}{extra} }}",
                limit.requests_per_unit
            ),
        );
        fields.push(format!("plan: {plan}"));
        Ok(())
    }

    /// The `replaces` entries that name a rule of the domain.
    fn replaces(&mut self, limit: &Limit, path: &str) -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        for (name, line) in &limit.replaces {
            if name.is_empty() {
                return Err(self.fail(
                    *line,
                    path,
                    "rate_limit.replaces: should not have an empty replaces entry",
                ));
            }
            if *name == limit.name {
                return Err(self.fail(
                    *line,
                    path,
                    "rate_limit.replaces: replaces should not contain name of same descriptor",
                ));
            }
            if self.names.contains(name) {
                out.push(quote(name));
            } else {
                self.note(
                    *line,
                    path,
                    &format!("replaces {name}"),
                    "left out: no rule of the domain has that name, so it replaces nothing (as in envoyproxy/ratelimit)",
                );
            }
        }
        Ok(out)
    }

    fn unmapped(&mut self, d: &Desc, path: &str) {
        const METRICS: &str = "not mapped: tenantgate keeps no metric per descriptor value (bounded labels); `tenantgate top` lists the hottest keys";
        self.ignored(&d.ignored, path);
        if d.detailed_metric {
            self.note(
                d.lines.of("detailed_metric", d.line),
                path,
                "detailed_metric",
                METRICS,
            );
        }
        if d.value_to_metric {
            self.note(
                d.lines.of("value_to_metric", d.line),
                path,
                "value_to_metric",
                METRICS,
            );
        }
        if d.metadata {
            self.note(
                d.lines.of("metadata", d.line),
                path,
                "metadata",
                "not mapped: envoyproxy/ratelimit adds it to the answer's dynamic_metadata (with RESPONSE_DYNAMIC_METADATA); tenantgate's RLS answers carry none",
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
