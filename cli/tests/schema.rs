//! The policy's JSON Schema (`tenantgate policy schema`, derived from the
//! spec structs the validator reads): the shipped copy is the command's
//! output; every shipped policy (policies/, and those in README.md and
//! docs/) names it on its first line and validates against it; and the
//! schema and the validator agree: on a corpus of faults, each written
//! beside a valid value for the same field, both accept the valid one and
//! both refuse the fault; every invalid fixture of a kind the schema can
//! see is refused by it too; and what the schema cannot see (names that
//! must refer to something) is listed, accepted by it and refused by the
//! validator.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use tenantgate::policy::{Node, Policy};
use tenantgate_cli::policy_file;

const SCHEMA_LINE: &str = "# yaml-language-server: $schema=tenantgate.schema.json";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn schema() -> Value {
    let text = std::fs::read_to_string(repo().join("policies/tenantgate.schema.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn validator() -> jsonschema::Validator {
    jsonschema::validator_for(&schema()).unwrap()
}

/// The schema's errors for a document, one line each.
fn schema_errors(v: &jsonschema::Validator, document: &Value) -> Vec<String> {
    v.iter_errors(document)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

fn validator_accepts(document: &Value) -> Result<(), String> {
    let node = Node::from_json(&serde_json::to_vec(document).unwrap()).unwrap();
    Policy::from_node(&node).map(|_| ()).map_err(|e| e.to_string())
}

fn yaml_to_json(text: &str) -> Value {
    serde_json::to_value(policy_file::parse_yaml(text).unwrap()).unwrap()
}

#[test]
fn the_shipped_schema_is_what_policy_schema_prints() {
    let out = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .args(["policy", "schema"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let shipped = std::fs::read_to_string(repo().join("policies/tenantgate.schema.json")).unwrap();
    assert!(
        String::from_utf8(out.stdout).unwrap() == shipped,
        "policies/tenantgate.schema.json is stale: `make schema` regenerates it"
    );
    assert_eq!(
        schema()["$schema"],
        "https://json-schema.org/draft/2020-12/schema"
    );
    assert_eq!(schema()["additionalProperties"], false);
}

/// The policies a user is handed: policies/*.yaml and every YAML block of
/// README.md and docs/*.md that is a whole policy (it has `version:` and
/// `plans:` at its top level).
fn shipped_policies() -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("policies"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for f in files {
        found.push((f.display().to_string(), std::fs::read_to_string(&f).unwrap()));
    }
    let mut docs = vec![repo().join("README.md")];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    docs.extend(pages);
    for doc in docs {
        let text = std::fs::read_to_string(&doc).unwrap();
        for (i, block) in text.split("```yaml\n").skip(1).enumerate() {
            let block = block.split("```").next().unwrap();
            let top = |k: &str| block.lines().any(|l| l.starts_with(k));
            if top("version:") && top("plans:") {
                found.push((
                    format!("{} (yaml block {})", doc.display(), i + 1),
                    block.to_owned(),
                ));
            }
        }
    }
    found
}

#[test]
fn every_shipped_policy_names_the_schema_and_validates_against_it() {
    let v = validator();
    let policies = shipped_policies();
    assert!(policies.len() >= 10, "found {}", policies.len());
    for (name, text) in policies {
        assert_eq!(text.lines().next(), Some(SCHEMA_LINE), "{name}: its first line");
        let errors = schema_errors(&v, &yaml_to_json(&text));
        assert!(errors.is_empty(), "{name}: the schema refuses it: {errors:#?}");
        validator_accepts(&yaml_to_json(&text)).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// What `tenantgate policy import` writes (a window of 0, of 2³²−1, soft
/// and shadow limits, deep rules) validates against the schema too.
#[test]
fn every_imported_policy_validates_against_the_schema() {
    let v = validator();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/import");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if !path.to_string_lossy().ends_with(".expected.yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let errors = schema_errors(&v, &yaml_to_json(&text));
        assert!(
            errors.is_empty(),
            "{}: the schema refuses it: {errors:#?}",
            path.display()
        );
        seen += 1;
    }
    assert!(seen >= 7, "found {seen}");
}

const BASE: &str = r#"
version: "schema-1"
identity: { header: x-tenant-id }
plans:
  free: { limits: [ { rate: 10, per: 1m } ] }
tenants: [ { id: acme, plan: free } ]
default_plan: free
anonymous: { plan: free }
routes:
  api: { cost: 1 }
"#;

/// `document` with the value at `pointer` (`/a/b/0/c`) set to `value`
/// (YAML text), or removed when `None`; missing mappings are made.
fn with(document: &Value, pointer: &str, value: Option<&str>) -> Value {
    let mut doc = document.clone();
    let (parent, last) = pointer.rsplit_once('/').unwrap();
    let mut at = &mut doc;
    for step in parent.split('/').skip(1) {
        at = match at {
            Value::Array(items) => &mut items[step.parse::<usize>().unwrap()],
            Value::Object(map) => map
                .entry(step)
                .or_insert_with(|| Value::Object(Default::default())),
            other => panic!("{pointer}: {other} has no {step}"),
        };
    }
    let value = value.map(|v| yaml_to_json(&format!("v: {v}"))["v"].clone());
    match (at, value) {
        (Value::Array(items), Some(v)) => items[last.parse::<usize>().unwrap()] = v,
        (Value::Object(map), Some(v)) => {
            map.insert(last.to_owned(), v);
        }
        (Value::Object(map), None) => {
            map.remove(last);
        }
        (other, _) => panic!("{pointer}: cannot change {other}"),
    }
    doc
}

/// (what, pointer, a valid value, a fault; `None`: the field removed).
const FAULTS: &[(&str, &str, Option<&str>, Option<&str>)] = &[
    ("unknown top-level field", "/modes", None, Some("enforce")),
    (
        "misspelt limit field",
        "/plans/free/limits/0/rat",
        None,
        Some("10"),
    ),
    (
        "rate as words",
        "/plans/free/limits/0/rate",
        Some("10"),
        Some("ten"),
    ),
    ("zero rate", "/plans/free/limits/0/rate", Some("1"), Some("0")),
    (
        "negative rate",
        "/plans/free/limits/0/rate",
        Some("5"),
        Some("-5"),
    ),
    // (The valid side: 6·10¹⁰ a minute, a token bucket's finest step of
    // one nanosecond; finer ones only the validator refuses.)
    (
        "rate over 10^13",
        "/plans/free/limits/0/rate",
        Some("60000000000"),
        Some("10000000000001"),
    ),
    (
        "duration in words",
        "/plans/free/limits/0/per",
        Some("1m"),
        Some("1 minute"),
    ),
    (
        "duration as a number",
        "/plans/free/limits/0/per",
        Some("60s"),
        Some("60"),
    ),
    (
        "fractional duration",
        "/plans/free/limits/0/per",
        Some("90s"),
        Some("1.5m"),
    ),
    ("unknown mode", "/mode", Some("shadow"), Some("enforcing")),
    (
        "unknown algorithm",
        "/plans/free/limits/0/algorithm",
        Some("fixed_window"),
        Some("leaky_bucket"),
    ),
    (
        "shadow as a string",
        "/plans/free/limits/0/shadow",
        Some("true"),
        Some("\"yes\""),
    ),
    (
        "unknown on_limit",
        "/plans/free/limits/0/on_limit",
        Some("reject"),
        Some("drop"),
    ),
    (
        "missing identity",
        "/identity",
        Some("{ header: x-tenant-id }"),
        None,
    ),
    (
        "missing plans",
        "/plans",
        Some("{ free: { limits: [ { rate: 10, per: 1m } ] } }"),
        None,
    ),
    ("missing default_plan", "/default_plan", Some("free"), None),
    ("null default_plan", "/default_plan", Some("free"), Some("~")),
    (
        "plans as a list",
        "/plans",
        Some("{ free: { limits: [ { rate: 10, per: 1m } ] } }"),
        Some("[ free ]"),
    ),
    (
        "tenant without plan",
        "/tenants",
        Some("[ { id: acme, plan: free } ]"),
        Some("[ { id: acme } ]"),
    ),
    (
        "tenants as a mapping",
        "/tenants",
        Some("[]"),
        Some("{ acme: free }"),
    ),
    ("version as a number", "/version", Some("\"1\""), Some("1")),
    (
        "jwt without claim",
        "/identity",
        Some("{ jwt: { payload_in_metadata: p, claim: tenant } }"),
        Some("{ jwt: { payload_in_metadata: p } }"),
    ),
    (
        "unknown identity source",
        "/identity",
        Some("{ header: x-tenant }"),
        Some("{ cookie: x-tenant }"),
    ),
    ("zero cost", "/routes/api/cost", Some("1"), Some("0")),
    (
        "unknown route on_limit",
        "/routes/api/on_limit",
        Some("reject"),
        Some("drop"),
    ),
    (
        "unknown failure mode",
        "/routes/api/failure_mode",
        Some("fail_closed"),
        Some("fail_sometimes"),
    ),
    (
        "unknown criticality",
        "/routes/api/criticality",
        Some("critical"),
        Some("urgent"),
    ),
    (
        "route field misspelt",
        "/routes/api/retryible",
        None,
        Some("true"),
    ),
    (
        "sync interval with a fraction",
        "/sync",
        Some("{ interval: 1s }"),
        Some("{ interval: 1.5s }"),
    ),
    (
        "sync failure mode",
        "/sync",
        Some("{ failure_mode: fail_open }"),
        Some("{ failure_mode: open }"),
    ),
    (
        "max_keys as words",
        "/key_table",
        Some("{ max_keys: 1000 }"),
        Some("{ max_keys: lots }"),
    ),
    (
        "unknown quota risk",
        "/quotas",
        Some("{ gpu: { unit: gpu, risk: high, limits: { global: 10 } } }"),
        Some("{ gpu: { unit: gpu, risk: medium, limits: { global: 10 } } }"),
    ),
    (
        "quota limits misspelt",
        "/quotas",
        Some("{ gpu: { unit: gpu, risk: low, limits: { global: 10 } } }"),
        Some("{ gpu: { unit: gpu, risk: low, limits: { globl: 10 } } }"),
    ),
    (
        "quota ttl in words",
        "/quotas",
        Some("{ gpu: { unit: gpu, risk: low, limits: { global: 10 }, default_ttl: 5m } }"),
        Some("{ gpu: { unit: gpu, risk: low, limits: { global: 10 }, default_ttl: five } }"),
    ),
    (
        "descriptor rule without key",
        "/descriptors",
        Some("{ edge: [ { key: path, plan: free } ] }"),
        Some("{ edge: [ { value: x, plan: free } ] }"),
    ),
    (
        "nested descriptor misspelt",
        "/descriptors",
        Some("{ edge: [ { key: a, descriptors: [ { key: b, plan: free } ] } ] }"),
        Some("{ edge: [ { key: a, descriptors: [ { key: b, plans: free } ] } ] }"),
    ),
    (
        "in-flight as words",
        "/dependencies",
        Some("{ db: { max_in_flight: 10 } }"),
        Some("{ db: { max_in_flight: many } }"),
    ),
    (
        "breaker window in words",
        "/dependencies",
        Some("{ db: { max_in_flight: 10, circuit_breaker: { window: 10s } } }"),
        Some("{ db: { max_in_flight: 10, circuit_breaker: { window: ten } } }"),
    ),
    (
        "unknown queue level",
        "/dependencies",
        Some("{ db: { max_in_flight: 10, queues: { normal: { max_queue: 5, max_wait: 1s } } } }"),
        Some("{ db: { max_in_flight: 10, queues: { urgent: { max_queue: 5, max_wait: 1s } } } }"),
    ),
    (
        "unknown usage preset",
        "/routes/api/settle",
        Some("{ usage: openai_total, ceiling: 100 }"),
        Some("{ usage: openai_sum, ceiling: 100 }"),
    ),
    (
        "settle without ceiling",
        "/routes/api/settle",
        Some("{ header: x-cost, ceiling: 100 }"),
        Some("{ header: x-cost }"),
    ),
    (
        "unknown outcome charge",
        "/routes/api/settle",
        Some("{ header: x-cost, ceiling: 100, on_outcome: { upstream_5xx: nothing } }"),
        Some("{ header: x-cost, ceiling: 100, on_outcome: { upstream_5xx: half } }"),
    ),
    (
        "timeout budget in words",
        "/routes/api/min_timeout_budget",
        Some("100ms"),
        Some("fast"),
    ),
    (
        "body limit as words",
        "/routes/api/max_body_bytes",
        Some("1024"),
        Some("1KiB"),
    ),
];

#[test]
fn schema_and_validator_refuse_the_same_faults() {
    let v = validator();
    let base = yaml_to_json(BASE);
    validator_accepts(&base).unwrap();
    assert!(schema_errors(&v, &base).is_empty());
    let mut disagreements = Vec::new();
    for (what, pointer, valid, fault) in FAULTS {
        let good = with(&base, pointer, *valid);
        let bad = with(&base, pointer, *fault);
        let schema_good = schema_errors(&v, &good);
        let schema_bad = schema_errors(&v, &bad);
        let validator_good = validator_accepts(&good);
        let validator_bad = validator_accepts(&bad);
        if !schema_good.is_empty() {
            disagreements.push(format!(
                "{what}: the schema refuses the valid value: {schema_good:?}"
            ));
        }
        // The valid value may still be refused by the validator for a
        // reason of its own (e.g. a dependency no route uses); it must not
        // be refused for this field.
        if let Err(e) = &validator_good {
            disagreements.push(format!("{what}: the validator refuses the valid value: {e}"));
        }
        if schema_bad.is_empty() {
            disagreements.push(format!("{what}: the schema accepts the fault"));
        }
        if validator_bad.is_ok() {
            disagreements.push(format!("{what}: the validator accepts the fault"));
        }
    }
    assert!(disagreements.is_empty(), "{disagreements:#?}");
}

/// Faults the schema cannot see (a name that must refer to something, a
/// relation between fields): the schema accepts them, the validator
/// refuses them. Listed so that the division is known (docs/policy.md).
const SEMANTIC_ONLY: &[(&str, &str, &str)] = &[
    ("unknown default plan", "/default_plan", "gold"),
    (
        "tenant on an unknown plan",
        "/tenants",
        "[ { id: acme, plan: gold } ]",
    ),
    ("route on an unknown guard", "/routes/api/guard", "nope"),
    (
        "burst refilling for more than 366 days",
        "/plans/free/limits/0",
        "{ rate: 1, per: 1d, burst: 1000 }",
    ),
];

#[test]
fn what_only_the_validator_sees() {
    let v = validator();
    let base = yaml_to_json(BASE);
    for (what, pointer, fault) in SEMANTIC_ONLY {
        let bad = with(&base, pointer, Some(fault));
        assert!(
            schema_errors(&v, &bad).is_empty(),
            "{what}: the schema refuses it now: move it to FAULTS"
        );
        assert!(
            validator_accepts(&bad).is_err(),
            "{what}: the validator accepts it"
        );
    }
}

/// Every invalid fixture whose error is of a kind the schema states (an
/// unknown field or name, a wrong type, a missing field, a duration's
/// syntax) is refused by the schema too.
#[test]
fn the_schema_refuses_every_structural_invalid_fixture() {
    let v = validator();
    let structural = [
        "unknown field",
        "unknown variant",
        "expected a",
        "expected an",
        "missing field",
        "invalid duration",
    ];
    let dir = repo().join("tests/fixtures/invalid");
    let mut checked = 0;
    let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for file in entries
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
    {
        let text = std::fs::read_to_string(file).unwrap();
        let expected = text.lines().next().unwrap().trim_start_matches("# expect: ");
        if !structural.iter().any(|k| expected.contains(k)) {
            continue;
        }
        let Ok(document) = policy_file::parse_yaml(&text) else {
            continue;
        };
        let json = serde_json::to_value(&document).unwrap();
        assert!(
            !schema_errors(&v, &json).is_empty(),
            "{}: the validator says {expected:?}; the schema accepts it",
            file.display()
        );
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} structural fixtures");
}

/// The schema's duration pattern accepts what the policy's duration parser
/// accepts (magnitude aside: `99999999999999999999d` is the validator's).
#[test]
fn the_duration_pattern_is_the_parsers() {
    let pattern = serde_json::json!({ "type": "string", "pattern": tenantgate::policy::duration::PATTERN });
    let v = jsonschema::validator_for(&pattern).unwrap();
    for text in [
        "500ms",
        "10s",
        "1m",
        "2h",
        "1d",
        "0s",
        "",
        "m",
        "1",
        "1 m",
        "-1s",
        "1.5s",
        "1w",
        "5 minutes",
        "s1",
        "+1s",
        "1ms ",
        " 1s",
        "1S",
        "01s",
        "1sm",
    ] {
        let parsed = tenantgate::policy::duration::parse_duration_ns(text).is_ok();
        assert_eq!(v.is_valid(&Value::from(text)), parsed, "{text:?}");
    }
}
