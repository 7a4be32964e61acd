//! A streaming JSON scanner: finds the integers at a few JSON pointers in a
//! document fed chunk by chunk, in bounded memory whatever the document's
//! size, never buffering it.
//!
//! It tracks the path of the value being read (each container's current
//! key or index, kept for the first [`MAX_POINTER_SEGMENTS`] + 1 levels, keys
//! of at most [`MAX_SEGMENT_LEN`] bytes) and a stack of container kinds (at
//! most [`MAX_DEPTH`] deep). A scalar that ends at a path equal to one of
//! a field's pointers is that field's value: the last one seen wins. A
//! value there that is not a non-negative integer of at most 2^53 (a
//! string, a fraction, a negative, an exponent) makes the field
//! *malformed*. Syntax errors (and nesting past [`MAX_DEPTH`]) make the
//! document *broken*: scanning stops.
//!
//! A document whose top-level value is an array is also read as a stream
//! of documents, its elements: a pointer matches at its own path and within
//! each element (`/usageMetadata/totalTokenCount` matches
//! `[{"usageMetadata":{…}}, …]` at `/0/usageMetadata/totalTokenCount`, then
//! `/1/…`; the last element's value wins). That is Google Gemini's
//! `streamGenerateContent` without `alt=sse`: a JSON array streamed an
//! element at a time, each with the running `usageMetadata`.
//!
//! It validates only what it needs to (structure and strings; a bare token
//! is any run of number and literal characters), so it accepts some
//! invalid documents, never rejects a valid one, and never reads a value
//! at a path it is not at.

use crate::policy::settle::{Field, MAX_FIELDS, MAX_POINTER_SEGMENTS, MAX_SEGMENT_LEN};

/// Deepest nesting tracked; deeper is broken.
pub const MAX_DEPTH: usize = 64;
/// Longest bare token (a number or a literal) kept.
const MAX_TOKEN: usize = 24;
/// The largest integer read: what a JSON number holds exactly.
pub const MAX_VALUE: u64 = 1 << 53;
/// Levels whose place is tracked: a pointer's, below a top-level array's
/// element.
const TRACKED: usize = MAX_POINTER_SEGMENTS + 1;

/// A container on the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Object,
    Array,
}

/// What the scanner expects next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A value (at the top, after `:` or `[` or an array's `,`).
    Value,
    /// A key or `}` (after `{`).
    KeyOrEnd,
    /// A key (after an object's `,`).
    Key,
    /// `:` after a key.
    Colon,
    /// `,` or the container's end, after a value.
    CommaOrEnd,
    /// Only whitespace: the top-level value is complete.
    Done,
}

/// Where a string being read goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StringOf {
    Key,
    Value,
}

/// One level's place: its key (objects; `key_len > MAX_SEGMENT_LEN` never
/// matches) or its index (arrays).
#[derive(Debug, Clone, Copy)]
struct Place {
    key: [u8; MAX_SEGMENT_LEN],
    key_len: usize,
    index: u64,
}

impl Default for Place {
    fn default() -> Place {
        Place {
            key: [0; MAX_SEGMENT_LEN],
            key_len: 0,
            index: 0,
        }
    }
}

/// What a document said of the fields (see the module header).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Found {
    /// Each field's last value, by the fields' order.
    pub values: [Option<u64>; MAX_FIELDS],
    /// Some field had a value that is not a non-negative integer.
    pub malformed: bool,
}

impl Found {
    /// Takes `other`'s values (the last value seen wins) and its
    /// malformedness; whether it had any value.
    pub fn merge(&mut self, other: &Found) -> bool {
        let mut any = false;
        for (slot, value) in self.values.iter_mut().zip(other.values.iter()) {
            if let Some(v) = value {
                *slot = Some(*v);
                any = true;
            }
        }
        self.malformed |= other.malformed;
        any
    }

    /// The running cost of a stream that said this so far (see
    /// `crate::cost`, "Metered as it flows"), in units: the fields'
    /// weighted values (0 for one not seen yet), and one unit at the
    /// heaviest weight for each of the `since` events since one reported
    /// a value.
    pub fn running(&self, since: u64, fields: &[Field]) -> u64 {
        let mut sum = super::Sum::default();
        let mut heaviest = None;
        for (i, f) in fields.iter().enumerate() {
            sum.add(f, self.values.get(i).copied().flatten().unwrap_or(0));
            if !f.negative && heaviest.is_none_or(|h: &Field| f.weight_milli > h.weight_milli) {
                heaviest = Some(f);
            }
        }
        if let Some(h) = heaviest {
            sum.add(h, since);
        }
        sum.units()
    }
}

/// The scanner (see the module header).
#[derive(Debug, Clone)]
pub struct Scanner {
    stack: [Kind; MAX_DEPTH],
    depth: usize,
    places: [Place; TRACKED],
    expect: Expect,
    /// Inside a string: where it goes, whether the last byte was `\`, and
    /// how many hex digits of a `\u` escape remain.
    string: Option<StringOf>,
    escaped: bool,
    unicode: u8,
    unicode_value: u32,
    /// The key being read (as it will be matched).
    key: [u8; MAX_SEGMENT_LEN],
    key_len: usize,
    /// A bare token being read.
    token: [u8; MAX_TOKEN],
    token_len: usize,
    found: Found,
    broken: bool,
    /// A top-level array's elements read since one gave a field's value,
    /// whether the current one did, and whether one just ended.
    since_usage: u64,
    element_gave: bool,
    element_ended: bool,
}

impl Default for Scanner {
    fn default() -> Scanner {
        Scanner {
            stack: [Kind::Object; MAX_DEPTH],
            depth: 0,
            places: [Place::default(); TRACKED],
            expect: Expect::Value,
            string: None,
            escaped: false,
            unicode: 0,
            unicode_value: 0,
            key: [0; MAX_SEGMENT_LEN],
            key_len: 0,
            token: [0; MAX_TOKEN],
            token_len: 0,
            found: Found::default(),
            broken: false,
            since_usage: 0,
            element_gave: false,
            element_ended: false,
        }
    }
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.')
}

impl Scanner {
    /// Reads the next bytes of the document.
    pub fn feed(&mut self, bytes: &[u8], fields: &[Field]) {
        self.feed_until(bytes, fields, u64::MAX);
    }

    /// Reads the next bytes of the document until an element of a
    /// top-level array (a stream of documents, see the module header)
    /// takes the running cost ([`Scanner::running`]) past `limit`: then
    /// stops right after that element and returns how many bytes it read.
    /// `None`: all were read (or the document broke).
    pub fn feed_until(&mut self, bytes: &[u8], fields: &[Field], limit: u64) -> Option<usize> {
        for (i, &b) in bytes.iter().enumerate() {
            if self.broken {
                return None;
            }
            self.byte(b, fields);
            if std::mem::take(&mut self.element_ended) {
                self.since_usage = if std::mem::take(&mut self.element_gave) {
                    0
                } else {
                    self.since_usage.saturating_add(1)
                };
                if self.running(fields) > limit {
                    return Some(i.saturating_add(1));
                }
            }
        }
        None
    }

    /// The running cost of what has been read (see [`Found::running`]):
    /// a top-level array's elements count as events.
    pub fn running(&self, fields: &[Field]) -> u64 {
        self.found.running(self.since_usage, fields)
    }

    /// The document ended: what it said, if it was whole and well formed
    /// (`None`: broken or cut short).
    pub fn finish(&mut self, fields: &[Field]) -> Option<Found> {
        if self.token_len > 0 {
            self.end_token(fields);
        }
        (self.expect == Expect::Done && !self.broken && self.string.is_none()).then_some(self.found)
    }

    /// What the document said so far (a field's value counts once its
    /// scalar has ended).
    pub fn found(&self) -> &Found {
        &self.found
    }

    /// Whether a syntax error stopped the scan.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    fn byte(&mut self, b: u8, fields: &[Field]) {
        if let Some(of) = self.string {
            self.string_byte(b, of);
            return;
        }
        if self.token_len > 0 {
            if is_token_byte(b) {
                self.push_token(b);
                return;
            }
            self.end_token(fields);
            if self.broken {
                return;
            }
        }
        match b {
            b' ' | b'\t' | b'\n' | b'\r' => {}
            b'{' | b'[' if self.expect == Expect::Value => {
                let kind = if b == b'{' { Kind::Object } else { Kind::Array };
                self.open(kind);
            }
            b'}' | b']' => self.close(b),
            b',' if self.expect == Expect::CommaOrEnd => match self.top() {
                Some(Kind::Object) => self.expect = Expect::Key,
                Some(Kind::Array) => {
                    if let Some(p) = self.place_mut() {
                        p.index = p.index.saturating_add(1);
                    }
                    self.expect = Expect::Value;
                }
                None => self.broken = true,
            },
            b':' if self.expect == Expect::Colon => self.expect = Expect::Value,
            b'"' if matches!(self.expect, Expect::KeyOrEnd | Expect::Key) => {
                self.key_len = 0;
                self.string = Some(StringOf::Key);
            }
            b'"' if self.expect == Expect::Value => {
                // A string value: a field here is malformed.
                self.note_scalar(None, fields);
                self.string = Some(StringOf::Value);
            }
            b if is_token_byte(b) && self.expect == Expect::Value => self.push_token(b),
            _ => self.broken = true,
        }
    }

    fn top(&self) -> Option<Kind> {
        self.depth.checked_sub(1).and_then(|i| self.stack.get(i).copied())
    }

    /// The place of the innermost container, if it is tracked.
    fn place_mut(&mut self) -> Option<&mut Place> {
        self.depth.checked_sub(1).and_then(|i| self.places.get_mut(i))
    }

    fn open(&mut self, kind: Kind) {
        let Some(slot) = self.stack.get_mut(self.depth) else {
            self.broken = true;
            return;
        };
        *slot = kind;
        if let Some(p) = self.places.get_mut(self.depth) {
            *p = Place::default();
        }
        self.depth += 1;
        self.expect = match kind {
            Kind::Object => Expect::KeyOrEnd,
            Kind::Array => Expect::Value,
        };
    }

    fn close(&mut self, b: u8) {
        let want = if b == b'}' { Kind::Object } else { Kind::Array };
        let ok = self.top() == Some(want)
            && match want {
                Kind::Object => matches!(self.expect, Expect::KeyOrEnd | Expect::CommaOrEnd),
                // `[]`, or after a value.
                Kind::Array => matches!(self.expect, Expect::Value | Expect::CommaOrEnd),
            };
        if !ok {
            self.broken = true;
            return;
        }
        self.depth -= 1;
        if self.depth == 1 && self.stack.first() == Some(&Kind::Array) {
            self.element_ended = true;
        }
        self.after_value();
    }

    /// A value ended: what comes next.
    fn after_value(&mut self) {
        self.expect = if self.depth == 0 {
            Expect::Done
        } else {
            Expect::CommaOrEnd
        };
    }

    fn push_token(&mut self, b: u8) {
        match self.token.get_mut(self.token_len) {
            Some(slot) => {
                *slot = b;
                self.token_len += 1;
            }
            // Too long for any number we read: kept as a malformed value.
            None => self.token_len = MAX_TOKEN + 1,
        }
    }

    fn end_token(&mut self, fields: &[Field]) {
        let len = std::mem::take(&mut self.token_len);
        let Some(token) = self.token.get(..len) else {
            // Longer than any number read: a value, not a usable one.
            self.note_scalar(None, fields);
            self.after_value();
            return;
        };
        let literal = matches!(token, b"true" | b"false" | b"null");
        let number = token.first().is_some_and(|b| b.is_ascii_digit() || *b == b'-');
        if !literal && !number {
            self.broken = true;
            return;
        }
        let value = if !token.is_empty() && token.iter().all(u8::is_ascii_digit) {
            std::str::from_utf8(token)
                .ok()
                .and_then(|t| t.parse::<u64>().ok())
                .filter(|v| *v <= MAX_VALUE)
        } else {
            None
        };
        self.note_scalar(value, fields);
        self.after_value();
    }

    /// A scalar ended at the current path: a field here takes it (`None`:
    /// not a usable integer, the field is malformed).
    fn note_scalar(&mut self, value: Option<u64>, fields: &[Field]) {
        for (i, f) in fields.iter().enumerate().take(MAX_FIELDS) {
            if f.pointers.iter().any(|p| self.at(p)) {
                match value {
                    Some(v) => {
                        if let Some(slot) = self.found.values.get_mut(i) {
                            *slot = Some(v);
                            self.element_gave = true;
                        }
                    }
                    None => self.found.malformed = true,
                }
            }
        }
    }

    /// Whether the current path is `pointer`, or, in a top-level array,
    /// `pointer` within one of its elements (see the module header).
    fn at(&self, pointer: &[String]) -> bool {
        self.at_below(pointer, 0) || (self.stack.first() == Some(&Kind::Array) && self.at_below(pointer, 1))
    }

    /// Whether the path below its first `skip` levels is `pointer`.
    fn at_below(&self, pointer: &[String], skip: usize) -> bool {
        if pointer.len().saturating_add(skip) != self.depth || self.depth > TRACKED {
            return false;
        }
        pointer.iter().enumerate().all(|(i, segment)| {
            let level = i.saturating_add(skip);
            let (Some(kind), Some(place)) = (self.stack.get(level), self.places.get(level)) else {
                return false;
            };
            match kind {
                Kind::Object => place.key.get(..place.key_len) == Some(segment.as_bytes()),
                Kind::Array => segment.parse::<u64>().ok() == Some(place.index) && !segment.starts_with('+'),
            }
        })
    }

    fn string_byte(&mut self, b: u8, of: StringOf) {
        if self.unicode > 0 {
            let Some(digit) = (b as char).to_digit(16) else {
                self.broken = true;
                return;
            };
            self.unicode_value = (self.unicode_value << 4) | digit;
            self.unicode -= 1;
            if self.unicode == 0 && of == StringOf::Key {
                // Only ASCII escapes can match a pointer's segment.
                match u8::try_from(self.unicode_value) {
                    Ok(c) if c.is_ascii() => self.push_key(c),
                    _ => self.key_len = MAX_SEGMENT_LEN + 1,
                }
            }
            return;
        }
        if self.escaped {
            self.escaped = false;
            let c = match b {
                b'"' | b'\\' | b'/' => b,
                b'b' => 0x08,
                b'f' => 0x0c,
                b'n' => b'\n',
                b'r' => b'\r',
                b't' => b'\t',
                b'u' => {
                    self.unicode = 4;
                    self.unicode_value = 0;
                    return;
                }
                _ => {
                    self.broken = true;
                    return;
                }
            };
            if of == StringOf::Key {
                self.push_key(c);
            }
            return;
        }
        match b {
            b'\\' => self.escaped = true,
            b'"' => {
                self.string = None;
                match of {
                    StringOf::Key => {
                        let len = self.key_len;
                        let key = self.key;
                        if let Some(p) = self.place_mut() {
                            p.key = key;
                            p.key_len = len;
                        }
                        self.expect = Expect::Colon;
                    }
                    StringOf::Value => self.after_value(),
                }
            }
            0x00..=0x1f => self.broken = true,
            _ if of == StringOf::Key => self.push_key(b),
            _ => {}
        }
    }

    fn push_key(&mut self, b: u8) {
        match self.key.get_mut(self.key_len) {
            Some(slot) => {
                *slot = b;
                self.key_len += 1;
            }
            None => self.key_len = MAX_SEGMENT_LEN + 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::settle::{parse_pointer, WEIGHT_SCALE};

    fn fields(pointers: &[&str]) -> Vec<Field> {
        pointers
            .iter()
            .map(|p| Field {
                name: (*p).to_owned(),
                pointers: vec![parse_pointer(p).unwrap()],
                weight_milli: WEIGHT_SCALE,
                negative: false,
                optional: false,
            })
            .collect()
    }

    /// Scans `doc` in chunks of every size from 1 to its length: the
    /// answer must not depend on where chunks are cut.
    fn scan(doc: &str, f: &[Field]) -> Option<Found> {
        let mut answers = Vec::new();
        for chunk in 1..=doc.len().max(1) {
            let mut s = Scanner::default();
            for part in doc.as_bytes().chunks(chunk) {
                s.feed(part, f);
            }
            answers.push(s.finish(f));
        }
        assert!(answers.windows(2).all(|w| w[0] == w[1]), "{doc}: {answers:?}");
        answers.pop().flatten()
    }

    fn values(doc: &str, pointers: &[&str]) -> Option<Vec<Option<u64>>> {
        let f = fields(pointers);
        scan(doc, &f).map(|found| found.values[..pointers.len()].to_vec())
    }

    #[test]
    fn reads_an_openai_usage_block_anywhere_in_the_document() {
        let doc = r#"{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,
            "message":{"role":"assistant","content":"{\"usage\": {\"total_tokens\": 9}}"}}],
            "usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}"#;
        assert_eq!(
            values(
                doc,
                &[
                    "/usage/total_tokens",
                    "/usage/prompt_tokens",
                    "/usage/completion_tokens"
                ]
            ),
            Some(vec![Some(42), Some(12), Some(30)])
        );
        // A key of the same name elsewhere, or inside a string, never counts.
        let nested = r#"{"choices":[{"usage":{"total_tokens":1}}],"x":{"usage":{"total_tokens":2}}}"#;
        assert_eq!(values(nested, &["/usage/total_tokens"]), Some(vec![None]));
    }

    #[test]
    fn array_indices_escaped_keys_and_the_last_value_seen() {
        let doc = r#"{"a":[{"n":1},{"n":2}],"k\/\u0065y":5,"dup":1,"dup":7}"#;
        assert_eq!(
            values(doc, &["/a/1/n", "/a/0/n", "/k~1ey", "/dup"]),
            Some(vec![Some(2), Some(1), Some(5), Some(7)])
        );
    }

    #[test]
    fn a_top_level_array_is_a_stream_of_documents_and_its_last_element_wins() {
        // Gemini's `streamGenerateContent` without `alt=sse`: running totals.
        let doc = r#"[{"candidates":[{"content":{"parts":[{"text":"Hel"}]}}],
            "usageMetadata":{"promptTokenCount":9,"totalTokenCount":10}},
            {"candidates":[{"content":{"parts":[{"text":"lo"}]},"finishReason":"STOP"}],
            "usageMetadata":{"promptTokenCount":9,"candidatesTokenCount":2,"totalTokenCount":11}}]"#;
        assert_eq!(
            values(
                doc,
                &[
                    "/usageMetadata/totalTokenCount",
                    "/1/usageMetadata/promptTokenCount"
                ]
            ),
            Some(vec![Some(11), Some(9)])
        );
        // Deeper in an element, or in an object's array, never counts.
        let nested = r#"[{"x":{"usageMetadata":{"totalTokenCount":5}}}]"#;
        assert_eq!(
            values(nested, &["/usageMetadata/totalTokenCount"]),
            Some(vec![None])
        );
        let inner = r#"{"a":[{"usageMetadata":{"totalTokenCount":5}}]}"#;
        assert_eq!(
            values(inner, &["/usageMetadata/totalTokenCount"]),
            Some(vec![None])
        );
        // A cut array is not a whole document: nothing (the abort rule).
        assert_eq!(
            values(
                r#"[{"usageMetadata":{"totalTokenCount":5}},"#,
                &["/usageMetadata/totalTokenCount"]
            ),
            None
        );
    }

    #[test]
    fn a_value_that_is_not_a_non_negative_integer_is_malformed() {
        for v in [
            "-1",
            "1.5",
            "1e3",
            "\"12\"",
            "true",
            "null",
            "9007199254740993",
            "123456789012345678901234567890",
        ] {
            let doc = format!(r#"{{"usage":{{"total_tokens":{v}}}}}"#);
            let f = fields(&["/usage/total_tokens"]);
            let found = scan(&doc, &f).unwrap_or_else(|| panic!("{doc} broken"));
            assert!(found.malformed, "{doc}");
            assert_eq!(found.values[0], None, "{doc}");
        }
        // A container there is neither a value nor malformed: missing.
        let found = scan(
            r#"{"usage":{"total_tokens":{"n":1}}}"#,
            &fields(&["/usage/total_tokens"]),
        )
        .unwrap();
        assert_eq!((found.values[0], found.malformed), (None, false));
    }

    #[test]
    fn broken_or_cut_documents_say_nothing() {
        for doc in [
            r#"{"usage":{"total_tokens":42}"#,
            r#"{"usage":{"total_tokens":42}}}"#,
            r#"{"usage" {"total_tokens":42}}"#,
            r#"{"usage":{"total_tokens":42,}}"#,
            r#"[DONE]"#,
            "{\"a\":\"x\u{1}\"}",
            r#"{"a":tru e}"#,
            "",
        ] {
            assert_eq!(values(doc, &["/usage/total_tokens"]), None, "{doc}");
        }
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert_eq!(values(&deep, &["/x"]), None);
        let fine = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert_eq!(values(&fine, &["/x"]), Some(vec![None]));
        assert_eq!(values(" 7 ", &["/x"]), Some(vec![None]));
    }

    #[test]
    fn random_documents_never_panic_and_keep_their_bounds() {
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        let alphabet = br#"{}[]:,"\ 0123456789abcdeuntrlsf-.eE/"#;
        let f = fields(&["/usage/total_tokens", "/a/0"]);
        for _ in 0..2_000 {
            let mut s = Scanner::default();
            let n = (x % 200) as usize;
            let doc: Vec<u8> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    alphabet[(x % alphabet.len() as u64) as usize]
                })
                .collect();
            s.feed(&doc, &f);
            let _ = s.finish(&f);
            assert!(s.depth <= MAX_DEPTH);
        }
    }
}
