//! `settle.include_usage`: a streamed OpenAI Chat Completions request is
//! sent upstream with `stream_options.include_usage: true`, so that its
//! stream ends with a chunk carrying the usage (without it, a stream has
//! no usage and costs `on_missing`: the ceiling by default).
//!
//! The rewrite is bounded and exact: a body of at most
//! [`MAX_REWRITE_BYTES`] whose top-level value is a JSON object with
//! `"stream": true` gets `stream_options.include_usage` set to `true`
//! (added to an existing `stream_options` object, replacing a value there
//! that is not an object); every other member's value is kept byte for
//! byte, in its order (duplicate keys too: the last one is what JSON
//! readers keep, and the last `stream_options` is the one changed).
//! Anything else (not JSON, not an object, not streamed, already asking
//! for usage, too large) is sent unchanged.
//!
//! The client receives that last chunk too: its `choices` is empty, as
//! OpenAI documents for `include_usage`, and the `openai` SDK reads it
//! (integration-tests/tests/settle.rs).

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// The largest body rewritten: the host holds it whole until it ends
/// (below Envoy's default per-connection buffer limit of 1 MiB, past which
/// Envoy would answer 413 to a body it buffers).
pub const MAX_REWRITE_BYTES: usize = 512 * 1024;

/// A JSON object's members in their order, values unparsed.
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'de: 'a, 'a> Deserialize<'de> for Members<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Members<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Members<'a>, M::Error> {
                let mut members = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, &'a RawValue>()? {
                    members.push((k, v));
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

impl Members<'_> {
    /// The last member named `key` (what JSON readers keep).
    fn last(&self, key: &str) -> Option<usize> {
        self.0.iter().rposition(|(k, _)| k == key)
    }

    /// The object's text, with `replace`'s member (by index) written as
    /// `value`, or `value` appended as `key` when `replace` is `None`.
    fn write(&self, replace: Option<usize>, key: &str, value: &str) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(
            self.0
                .iter()
                .map(|(k, v)| k.len() + v.get().len() + 4)
                .sum::<usize>()
                + 64,
        );
        out.push(b'{');
        let mut first = true;
        let mut member = |out: &mut Vec<u8>, k: &str, v: &str| -> Option<()> {
            if !std::mem::take(&mut first) {
                out.push(b',');
            }
            out.extend_from_slice(serde_json::to_string(k).ok()?.as_bytes());
            out.push(b':');
            out.extend_from_slice(v.as_bytes());
            Some(())
        };
        for (i, (k, v)) in self.0.iter().enumerate() {
            let v = if Some(i) == replace { value } else { v.get() };
            member(&mut out, k, v)?;
        }
        if replace.is_none() {
            member(&mut out, key, value)?;
        }
        out.push(b'}');
        Some(out)
    }
}

/// The body to send instead of `body` (see the module header), or `None`
/// to send it unchanged.
pub fn include_usage(body: &[u8]) -> Option<Vec<u8>> {
    if body.len() > MAX_REWRITE_BYTES {
        return None;
    }
    let top: Members<'_> = serde_json::from_slice(body).ok()?;
    let stream = top.0.get(top.last("stream")?)?.1.get();
    if stream != "true" {
        return None;
    }
    let at = top.last("stream_options");
    let options = match at.and_then(|i| top.0.get(i)) {
        Some((_, raw)) => match serde_json::from_str::<Members<'_>>(raw.get()) {
            Ok(inner) => {
                let usage = inner.last("include_usage");
                if usage
                    .and_then(|i| inner.0.get(i))
                    .is_some_and(|(_, v)| v.get() == "true")
                {
                    return None;
                }
                inner.write(usage, "include_usage", "true")?
            }
            // Not an object (`null`, ...): replaced.
            Err(_) => br#"{"include_usage":true}"#.to_vec(),
        },
        None => br#"{"include_usage":true}"#.to_vec(),
    };
    top.write(at, "stream_options", std::str::from_utf8(&options).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewrite(body: &str) -> Option<String> {
        include_usage(body.as_bytes()).map(|b| String::from_utf8(b).unwrap())
    }

    #[test]
    fn a_streamed_request_asks_for_its_usage_and_keeps_every_other_byte() {
        let body = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"Hi \u00e9 \"x\""}],"stream":true,"temperature":0.70,"seed":123456789012345678901234567890,"max_tokens":1e3}"#;
        let out = rewrite(body).unwrap();
        assert_eq!(
            out,
            r#"{"model":"gpt-4o","messages":[{"role":"user","content":"Hi \u00e9 \"x\""}],"stream":true,"temperature":0.70,"seed":123456789012345678901234567890,"max_tokens":1e3,"stream_options":{"include_usage":true}}"#
        );
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
    }

    #[test]
    fn existing_stream_options_are_kept_and_completed() {
        assert_eq!(
            rewrite(r#"{"stream":true,"stream_options":{"continuous_usage_stats":true}}"#).unwrap(),
            r#"{"stream":true,"stream_options":{"continuous_usage_stats":true,"include_usage":true}}"#
        );
        assert_eq!(
            rewrite(r#"{"stream_options":{"include_usage":false,"x":1},"stream":true}"#).unwrap(),
            r#"{"stream_options":{"include_usage":true,"x":1},"stream":true}"#
        );
        assert_eq!(
            rewrite(r#"{"stream":true,"stream_options":null}"#).unwrap(),
            r#"{"stream":true,"stream_options":{"include_usage":true}}"#
        );
        // The last of duplicated keys is the one JSON readers keep.
        assert_eq!(
            rewrite(r#"{"stream":false,"stream":true,"stream_options":{"include_usage":true},"stream_options":{}}"#)
                .unwrap(),
            r#"{"stream":false,"stream":true,"stream_options":{"include_usage":true},"stream_options":{"include_usage":true}}"#
        );
    }

    #[test]
    fn anything_else_is_sent_unchanged() {
        for body in [
            r#"{"model":"m","messages":[]}"#,
            r#"{"stream":false}"#,
            r#"{"stream":"true"}"#,
            r#"{"stream":true,"stream_options":{"include_usage":true}}"#,
            r#"[{"stream":true}]"#,
            r#"{"stream":true"#,
            "not json",
            "",
        ] {
            assert_eq!(rewrite(body), None, "{body}");
        }
        let big = format!(r#"{{"stream":true,"pad":"{}"}}"#, "x".repeat(MAX_REWRITE_BYTES));
        assert_eq!(rewrite(&big), None);
        // Deep nesting in a member is kept as it is, never recursed into.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(
            rewrite(&format!(r#"{{"stream":true,"d":{deep}}}"#)),
            Some(format!(
                r#"{{"stream":true,"d":{deep},"stream_options":{{"include_usage":true}}}}"#
            ))
        );
    }
}

#[cfg(test)]
mod policy_tests {
    use crate::policy::Policy;

    fn compile(block: &str) -> Result<bool, String> {
        let json = format!(
            r#"{{"version": "r-1", "identity": {{"header": "x-tenant-id"}},
                "plans": {{"p": {{"limits": [{{"rate": 100000, "per": "1m"}}]}}}},
                "default_plan": "p", "anonymous": {{"plan": "p"}},
                "routes": {{"chat": {{"cost": 100, "settle": {block}}}}}}}"#
        );
        let policy = Policy::from_json(json.as_bytes()).map_err(|e| e.to_string())?;
        Ok(policy
            .route_class(Some("chat"))
            .and_then(|c| c.settle.as_ref())
            .is_some_and(|s| s.include_usage))
    }

    #[test]
    fn include_usage_needs_a_body_source_and_is_off_by_default() {
        assert_eq!(compile(r#"{"usage": "openai_total", "ceiling": 800}"#), Ok(false));
        assert_eq!(
            compile(r#"{"usage": "openai_total", "ceiling": 800, "include_usage": true}"#),
            Ok(true)
        );
        let err = compile(r#"{"header": "x-usage", "ceiling": 800, "include_usage": true}"#).unwrap_err();
        assert!(err.contains("routes.chat.settle.include_usage"), "{err}");
        let err =
            compile(r#"{"usage": "openai_total", "ceiling": 800, "include_usage": "yes"}"#).unwrap_err();
        assert!(err.contains("include_usage"), "{err}");
    }
}
