//! A format-neutral document tree that the policy is read from.
//!
//! YAML (the CLI) and JSON (the filter's plugin configuration) are both
//! deserialized into [`Node`] first. Unlike `serde_json::Value`, a [`Node`]
//! keeps every entry of a mapping in order, including duplicates, so that a
//! policy with the same key twice is rejected with the key's path instead of
//! silently keeping the last value. The typed policy is then read from the
//! tree by [`super::de`], which tracks the path of every error.

use core::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

/// One value of a policy document.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    Null,
    Bool(bool),
    /// A non-negative integer.
    U64(u64),
    /// A negative integer.
    I64(i64),
    F64(f64),
    Str(String),
    Seq(Vec<Node>),
    /// Entries in document order; duplicates are kept (and rejected later).
    Map(Vec<(String, Node)>),
}

impl Node {
    /// Parses the filter's JSON plugin configuration.
    pub fn from_json(bytes: &[u8]) -> Result<Node, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("invalid JSON: {e}"))
    }

    /// Serializes the document as compact JSON (what the filter reads).
    pub fn to_json(&self) -> String {
        // Serializing a tree of plain values into a String cannot fail: no
        // non-string keys, no I/O. Fall back to `null` rather than panic.
        serde_json::to_string(self).unwrap_or_else(|_| String::from("null"))
    }

    /// A short description of the kind of value, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Node::Null => "null",
            Node::Bool(_) => "a boolean",
            Node::U64(_) | Node::I64(_) => "an integer",
            Node::F64(_) => "a number",
            Node::Str(_) => "a string",
            Node::Seq(_) => "a list",
            Node::Map(_) => "a mapping",
        }
    }
}

impl Serialize for Node {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Node::Null => s.serialize_unit(),
            Node::Bool(b) => s.serialize_bool(*b),
            Node::U64(n) => s.serialize_u64(*n),
            Node::I64(n) => s.serialize_i64(*n),
            Node::F64(n) => s.serialize_f64(*n),
            Node::Str(v) => s.serialize_str(v),
            Node::Seq(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Node::Map(entries) => {
                let mut map = s.serialize_map(Some(entries.len()))?;
                for (k, v) in entries {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Node, D::Error> {
        d.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a policy value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Node, E> {
        Ok(Node::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Node, E> {
        Ok(if v >= 0 { Node::U64(v as u64) } else { Node::I64(v) })
    }
    fn visit_u64<E>(self, v: u64) -> Result<Node, E> {
        Ok(Node::U64(v))
    }
    fn visit_i128<E>(self, v: i128) -> Result<Node, E> {
        Ok(match (u64::try_from(v), i64::try_from(v)) {
            (Ok(u), _) => Node::U64(u),
            (_, Ok(i)) => Node::I64(i),
            // Out of every integer range the schema uses: keep it as a float
            // so the typed read reports it as out of range, with its path.
            _ => Node::F64(v as f64),
        })
    }
    fn visit_u128<E>(self, v: u128) -> Result<Node, E> {
        Ok(u64::try_from(v).map_or(Node::F64(v as f64), Node::U64))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Node, E> {
        Ok(Node::F64(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Node, E> {
        Ok(Node::Str(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Node, E> {
        Ok(Node::Str(v))
    }
    fn visit_none<E>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }
    fn visit_unit<E>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Node, D::Error> {
        Node::deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Node>()? {
            items.push(item);
        }
        Ok(Node::Seq(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Node>()? {
            let key = match key {
                Node::Str(s) => s,
                // YAML allows `1: x` or `true: x`; keys are names here, so a
                // scalar key is read as its text.
                Node::U64(n) => n.to_string(),
                Node::I64(n) => n.to_string(),
                Node::Bool(b) => b.to_string(),
                other => {
                    return Err(de::Error::custom(format_args!(
                        "mapping keys must be strings, found {}",
                        other.kind()
                    )))
                }
            };
            let value = map.next_value::<Node>()?;
            entries.push((key, value));
        }
        Ok(Node::Map(entries))
    }
}
