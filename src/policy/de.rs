//! Reads typed policy structs from a [`Node`] tree, naming the path of the
//! first error (`plans.free.limits[0].rate: invalid type: …`).
//!
//! serde's derived code reports *what* is wrong ("unknown field `foo`") but
//! not *where*. This deserializer wraps every map value, map key and list
//! element, and prefixes the error with the key or index it was reading as
//! the error travels back up. It also rejects duplicate keys, which the
//! [`Node`] tree preserves on purpose.
//!
//! Numbers: a float with an integral value is accepted where an integer is
//! expected, because istiod turns a `WasmPlugin`'s `pluginConfig` (a
//! `google.protobuf.Struct`) into JSON with every number as a double, and may
//! print `1000000` as `1e+06`.

use core::fmt;

use hashbrown::HashSet;
use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use super::doc::Node;
use super::error::{FieldPath, PolicyError, Segment};

/// Deserializes `T` from `node`; the error names the offending path.
pub fn from_node<'de, T: Deserialize<'de>>(node: &'de Node) -> Result<T, PolicyError> {
    T::deserialize(NodeDe(node)).map_err(|e| {
        let mut segments = e.reversed_path;
        segments.reverse();
        PolicyError::new(FieldPath::from_segments(segments), e.message)
    })
}

/// The deserializer's error: a message plus the path collected so far,
/// innermost segment first.
#[derive(Debug)]
pub struct DeError {
    reversed_path: Vec<Segment>,
    message: String,
}

impl DeError {
    fn at(mut self, segment: Segment) -> Self {
        self.reversed_path.push(segment);
        self
    }
}

impl fmt::Display for DeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DeError {}

impl de::Error for DeError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        DeError {
            reversed_path: Vec::new(),
            message: msg.to_string(),
        }
    }

    /// In the policy's words: `expected an integer, got "ten"`.
    fn invalid_type(unexp: de::Unexpected<'_>, exp: &dyn de::Expected) -> Self {
        de::Error::custom(format_args!(
            "expected {}, got {}",
            expected_words(exp),
            got(&unexp)
        ))
    }

    /// A value of the right kind out of the type's range: the range.
    fn invalid_value(unexp: de::Unexpected<'_>, exp: &dyn de::Expected) -> Self {
        let text = exp.to_string();
        let range = match text.as_str() {
            "i64" => Some(format!("{}..={}", i64::MIN, i64::MAX)),
            "i32" => Some(format!("{}..={}", i32::MIN, i32::MAX)),
            "u64" => Some(format!("0..={}", u64::MAX)),
            "u32" => Some(format!("0..={}", u32::MAX)),
            "u16" => Some(format!("0..={}", u16::MAX)),
            "u8" => Some(format!("0..={}", u8::MAX)),
            _ => None,
        };
        match range {
            Some(r) => de::Error::custom(format_args!("expected an integer in {r}, got {}", got(&unexp))),
            None => de::Error::custom(format_args!(
                "expected {}, got {}",
                expected_words(exp),
                got(&unexp)
            )),
        }
    }

    fn unknown_field(field: &str, expected: &'static [&'static str]) -> Self {
        de::Error::custom(format_args!(
            "unknown field `{field}`, {}{}",
            one_of(expected),
            did_you_mean(field, expected)
        ))
    }

    fn unknown_variant(variant: &str, expected: &'static [&'static str]) -> Self {
        de::Error::custom(format_args!(
            "unknown variant `{variant}`, {}{}",
            one_of(expected),
            did_you_mean(variant, expected)
        ))
    }
}

/// serde's names of Rust types, in the policy's words.
fn expected_words(exp: &dyn de::Expected) -> String {
    let text = exp.to_string();
    match text.as_str() {
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" | "u8" | "u16" | "u32" | "u64" | "u128" | "usize" => {
            "an integer".to_owned()
        }
        "f32" | "f64" => "a number".to_owned(),
        "a map" => "a mapping".to_owned(),
        "a sequence" => "a list".to_owned(),
        _ => text,
    }
}

/// What the policy holds, as it reads in YAML.
fn got(unexp: &de::Unexpected<'_>) -> String {
    use de::Unexpected as U;
    match unexp {
        U::Str(s) => format!("{s:?}"),
        U::Bool(b) => b.to_string(),
        U::Unsigned(n) => n.to_string(),
        U::Signed(n) => n.to_string(),
        U::Float(f) => f.to_string(),
        U::Unit => "null".to_owned(),
        U::Seq => "a list".to_owned(),
        U::Map => "a mapping".to_owned(),
        other => other.to_string(),
    }
}

/// serde's own wording of the names allowed.
fn one_of(expected: &[&str]) -> String {
    match expected {
        [] => "there are none".to_owned(),
        [one] => format!("expected `{one}`"),
        [a, b] => format!("expected `{a}` or `{b}`"),
        many => {
            let list: Vec<String> = many.iter().map(|n| format!("`{n}`")).collect();
            format!("expected one of {}", list.join(", "))
        }
    }
}

/// `; did you mean `rate`?` when one allowed name is a typo away: at most
/// one edit per three characters (a swap of two neighbours is one edit).
fn did_you_mean(given: &str, expected: &[&str]) -> String {
    let limit = (given.chars().count() / 3).max(1);
    expected
        .iter()
        .map(|name| (edits(given, name), *name))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, name)| format!("; did you mean `{name}`?"))
        .unwrap_or_default()
}

/// Edit distance with adjacent swaps (optimal string alignment), bounded
/// in work by the names' lengths (policy field names are short): both are
/// cut at 64 characters, so every value stays at most 128 and every index
/// inside the table.
fn edits(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().take(64).collect();
    let b: Vec<char> = b.chars().take(64).collect();
    let width = b.len() + 1;
    let mut d = vec![0usize; (a.len() + 1) * width];
    for (i, row) in d.chunks_mut(width).enumerate() {
        row[0] = i;
    }
    for (j, cell) in d.iter_mut().take(width).enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[(i - 1) * width + j] + 1)
                .min(d[i * width + j - 1] + 1)
                .min(d[(i - 1) * width + j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[(i - 2) * width + j - 2] + 1);
            }
            d[i * width + j] = best;
        }
    }
    d[a.len() * width + b.len()]
}

#[derive(Clone, Copy)]
struct NodeDe<'de>(&'de Node);

impl<'de> NodeDe<'de> {
    /// An integral float (istiod's doubles) as an integer node, if exact.
    fn integral(self) -> Option<Node> {
        match *self.0 {
            Node::F64(f) if f.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&f) => {
                Some(Node::U64(f as u64))
            }
            Node::F64(f) if f.fract() == 0.0 && (-9_223_372_036_854_775_808.0..0.0).contains(&f) => {
                Some(Node::I64(f as i64))
            }
            _ => None,
        }
    }

    fn any_integer<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self.integral() {
            Some(Node::U64(n)) => visitor.visit_u64(n),
            Some(Node::I64(n)) => visitor.visit_i64(n),
            _ => de::Deserializer::deserialize_any(self, visitor),
        }
    }
}

macro_rules! integer_methods {
    ($($method:ident)*) => {
        $(fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
            self.any_integer(visitor)
        })*
    };
}

impl<'de> de::Deserializer<'de> for NodeDe<'de> {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self.0 {
            Node::Null => visitor.visit_unit(),
            Node::Bool(b) => visitor.visit_bool(*b),
            Node::U64(n) => visitor.visit_u64(*n),
            Node::I64(n) => visitor.visit_i64(*n),
            Node::F64(n) => visitor.visit_f64(*n),
            Node::Str(s) => visitor.visit_borrowed_str(s),
            Node::Seq(items) => visitor.visit_seq(SeqDe {
                items: items.iter(),
                index: 0,
            }),
            Node::Map(entries) => visitor.visit_map(MapDe {
                entries: entries.iter(),
                pending: None,
                seen: HashSet::with_capacity(entries.len()),
            }),
        }
    }

    integer_methods!(deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64
                     deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64);

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self.0 {
            Node::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, DeError> {
        // The schema only uses unit variants (`mode: shadow`).
        match self.0 {
            Node::Str(s) => visitor.visit_enum(s.as_str().into_deserializer()),
            other => Err(de::Error::custom(format_args!(
                "expected a string, found {}",
                other.kind()
            ))),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, DeError> {
        visitor.visit_newtype_struct(self)
    }

    serde::forward_to_deserialize_any! {
        bool i128 u128 f32 f64 char str string bytes byte_buf unit unit_struct
        seq tuple tuple_struct map struct identifier ignored_any
    }
}

struct SeqDe<'de> {
    items: core::slice::Iter<'de, Node>,
    index: usize,
}

impl<'de> SeqAccess<'de> for SeqDe<'de> {
    type Error = DeError;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, DeError> {
        let Some(item) = self.items.next() else {
            return Ok(None);
        };
        let index = self.index;
        self.index += 1;
        seed.deserialize(NodeDe(item))
            .map(Some)
            .map_err(|e| e.at(Segment::Index(index)))
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.items.len())
    }
}

struct MapDe<'de> {
    entries: core::slice::Iter<'de, (String, Node)>,
    pending: Option<&'de (String, Node)>,
    seen: HashSet<&'de str>,
}

impl<'de> MapAccess<'de> for MapDe<'de> {
    type Error = DeError;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, DeError> {
        let Some(entry) = self.entries.next() else {
            return Ok(None);
        };
        let key = entry.0.as_str();
        if !self.seen.insert(key) {
            return Err(<DeError as de::Error>::custom("duplicate key").at(Segment::Key(key.to_owned())));
        }
        self.pending = Some(entry);
        seed.deserialize(de::value::BorrowedStrDeserializer::<DeError>::new(key))
            .map(Some)
            .map_err(|e| e.at(Segment::Key(key.to_owned())))
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, DeError> {
        let Some(entry) = self.pending.take() else {
            return Err(de::Error::custom("value requested before its key"));
        };
        seed.deserialize(NodeDe(&entry.1))
            .map_err(|e| e.at(Segment::Key(entry.0.clone())))
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.entries.len())
    }
}
