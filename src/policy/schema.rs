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
    schema.to_value()
}

/// [`json_schema`] as the shipped file holds it: indented, one final newline.
pub fn json_schema_text() -> String {
    let mut text = serde_json::to_string_pretty(&json_schema()).unwrap_or_else(|_| String::from("{}"));
    text.push('\n');
    text
}
