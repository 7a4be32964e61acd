//! The policy file's JSON Schema (draft 2020-12), derived by `schemars`
//! from the spec structs serde reads the policy into ([`super::spec`]): the
//! fields, their types, the names of every enumeration, unknown fields
//! refused (`deny_unknown_fields` becomes `additionalProperties: false`),
//! durations as [`super::duration::PATTERN`] and counts in the validator's
//! range. One source: a field added to a spec struct is in the schema.
//!
//! What the schema cannot say, the validator still checks after it: names
//! that must refer to something (a plan, a guard, a dependency), limits
//! compared with each other, sizes of the compiled state. Editors get the
//! first kind of error as you type; `tenantgate policy check` gives both.
//!
//! Only the CLI builds it (feature `schema`): it never reaches the filter.

use serde_json::Value;

/// The schema of a policy file, as JSON.
pub fn json_schema() -> Value {
    let mut schema = schemars::schema_for!(super::spec::PolicySpec);
    schema.insert("title".to_owned(), Value::from("tenantgate policy"));
    let mut value = schema.to_value();
    rate_by_algorithm(&mut value);
    for_editors(&mut value);
    value
}

/// A limit's `rate` range depends on its `algorithm`: a `fixed_window`'s is
/// 0 to [`super::values::MAX_LIMIT`], any other's 1 to it (an
/// `if`/`then`/`else` the derive cannot write).
fn rate_by_algorithm(value: &mut Value) {
    let Some(Value::Object(limit)) = value.pointer_mut("/$defs/LimitSpec") else {
        return;
    };
    let range = |min: i64, max: i64| serde_json::json!({ "properties": { "rate": { "minimum": min, "maximum": max } } });
    limit.insert(
        "if".to_owned(),
        serde_json::json!({
            "properties": { "algorithm": { "const": "fixed_window" } },
            "required": ["algorithm"]
        }),
    );
    limit.insert("then".to_owned(), range(0, super::values::MAX_LIMIT));
    limit.insert("else".to_owned(), range(1, super::values::MAX_LIMIT));
}

/// Descriptions as an editor shows them on hover: the doc comments' line
/// breaks joined (paragraphs kept), rustdoc's link brackets dropped
/// (`` [`Adaptive`] `` reads `` `Adaptive` ``).
fn for_editors(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                match v {
                    Value::String(text) if key == "description" => *text = plain(text),
                    other => for_editors(other),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(for_editors),
        _ => {}
    }
}

fn plain(text: &str) -> String {
    let joined: Vec<String> = text
        .split("\n\n")
        .map(|p| p.split('\n').collect::<Vec<_>>().join(" "))
        .collect();
    joined.join("\n\n").replace("[`", "`").replace("`]", "`")
}

/// [`json_schema`] as the shipped file holds it: indented, one final newline.
pub fn json_schema_text() -> String {
    let mut text = serde_json::to_string_pretty(&json_schema()).unwrap_or_else(|_| String::from("{}"));
    text.push('\n');
    text
}
