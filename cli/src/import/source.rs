//! Reading an envoyproxy/ratelimit `config.yaml` as that project's loader
//! reads it (`src/config/config_impl.go`: gopkg.in/yaml.v2 into Go structs
//! after a check of every key), so the import accepts what it accepts and
//! refuses what it refuses, naming the file, the line and the key.
//!
//! What the loader accepts, and so what this reads:
//! * Keys: anywhere, one of its 16 known keys (`domain`, `key`, `value`,
//!   `descriptors`, `rate_limit`, `unit`, `requests_per_unit`,
//!   `unlimited`, `shadow_mode`, `quota_mode`, `name`, `replaces`,
//!   `detailed_metric`, `value_to_metric`, `share_threshold`, `metadata`);
//!   any other is an error, and so is a key that is not a string. A known
//!   key where its struct has no field (`unit` beside `key`) is ignored:
//!   read into [`Ignored`], which the import reports.
//! * Values: a string field takes any scalar's text (`value: 123` is
//!   `"123"`, `value: true` is `"true"`); a boolean is YAML 1.1's (`yes`,
//!   `on`, `y` and their opposites too); `requests_per_unit` is a `uint32`
//!   (0 to 4294967295); null is the zero value; a float anywhere outside
//!   `metadata` is an error, as is a list of anything but mappings.
//! * Depth and length: unbounded.
//!
//! Lines come from the source text: each key is found after the previous
//! one, in document order (the order serde_norway keeps a mapping in).

use serde_norway::{Mapping, Value};

const VALID_KEYS: [&str; 16] = [
    "domain",
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "unit",
    "requests_per_unit",
    "unlimited",
    "shadow_mode",
    "quota_mode",
    "name",
    "replaces",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
];

/// One file: its domain and its rules.
#[derive(Debug, Default)]
pub struct Root {
    pub domain: String,
    pub descriptors: Vec<Desc>,
    pub ignored: Vec<Ignored>,
}

/// One descriptor rule as the loader reads it.
#[derive(Debug, Default)]
pub struct Desc {
    /// Where its first key is.
    pub line: usize,
    pub key: String,
    /// `""`: no value.
    pub value: String,
    pub rate_limit: Option<Limit>,
    pub descriptors: Vec<Desc>,
    pub shadow_mode: bool,
    pub quota_mode: bool,
    pub detailed_metric: bool,
    pub value_to_metric: bool,
    pub share_threshold: bool,
    /// `metadata` is set (a non-empty mapping).
    pub metadata: bool,
    pub ignored: Vec<Ignored>,
    /// The line of each key read.
    pub lines: Lines,
}

/// A `rate_limit` as the loader reads it.
#[derive(Debug, Default)]
pub struct Limit {
    pub line: usize,
    pub requests_per_unit: u32,
    pub unit: String,
    pub unlimited: bool,
    pub name: String,
    /// Each entry's `name` and line.
    pub replaces: Vec<(String, usize)>,
    pub ignored: Vec<Ignored>,
    /// The line of each key read.
    pub lines: Lines,
}

/// The line of each key of a mapping.
#[derive(Debug, Default)]
pub struct Lines(Vec<(String, usize)>);

impl Lines {
    /// The line of `key`, else `fallback`.
    pub fn of(&self, key: &str, fallback: usize) -> usize {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map_or(fallback, |(_, line)| *line)
    }
}

/// A known key where the loader's struct has no field: ignored by it.
#[derive(Debug)]
pub struct Ignored {
    pub key: String,
    pub line: usize,
}

/// Reads `text` (the file `file`) as the loader does.
pub fn read(file: &str, text: &str) -> Result<Root, String> {
    let value: Value = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_norway::from_str(text).map_err(|e| format!("{file}: error loading config file: {e}"))?
    };
    let mut r = Reader {
        file,
        text,
        cursor: 0,
    };
    let mut root = Root::default();
    let map = match &value {
        Value::Null => return Ok(root),
        Value::Mapping(m) => m,
        _ => return Err(r.error(1, "(file)", "error loading config file: expected a mapping")),
    };
    for (name, v) in r.entries(map, "")? {
        let k = r.key(name, "")?;
        match k.name.as_str() {
            "domain" => root.domain = r.text_of(v, &k)?,
            "descriptors" => root.descriptors = r.descriptors(v, &k.path)?,
            _ => root.ignored.push(r.ignore(v, k)?),
        }
    }
    Ok(root)
}

/// A key being read: its name, its path in the file, its line.
struct Key {
    name: String,
    path: String,
    line: usize,
}

struct Reader<'a> {
    file: &'a str,
    text: &'a str,
    /// Where the previous key was found.
    cursor: usize,
}

impl Reader<'_> {
    fn error(&self, line: usize, path: &str, message: &str) -> String {
        format!("{}:{line}: {path}: {message}", self.file)
    }

    /// The line of the next occurrence of `key` followed by `:`, from the
    /// previous key on (the line of the previous key if none is found).
    fn locate(&mut self, key: &str) -> usize {
        let mut from = self.cursor;
        while let Some(at) = self.text.get(from..).and_then(|t| t.find(key)) {
            let start = from + at;
            let end = start + key.len();
            let rest = self.text.get(end..).unwrap_or("");
            let after = rest
                .trim_start_matches(['"', '\''])
                .trim_start_matches([' ', '\t']);
            let before = self.text.get(..start).and_then(|b| b.chars().last());
            let starts_token = before.is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
            if starts_token && after.starts_with(':') {
                self.cursor = end;
                break;
            }
            from = end;
        }
        line_of(self.text, self.cursor)
    }

    /// A mapping's entries, their keys checked to be strings. Each key is
    /// located (and checked to be a known one) by [`Reader::key`] when its
    /// turn comes, after what precedes it has been read.
    fn entries<'v>(&mut self, map: &'v Mapping, parent: &str) -> Result<Vec<(&'v str, &'v Value)>, String> {
        let mut out = Vec::new();
        for (k, v) in map {
            let Value::String(name) = k else {
                let line = line_of(self.text, self.cursor);
                return Err(self.error(
                    line,
                    parent_or_file(parent),
                    &format!("config error, key is not of type string: {}", scalar_text(k)),
                ));
            };
            out.push((name.as_str(), v));
        }
        Ok(out)
    }

    /// Locates key `name` of the mapping at `parent` and checks it is known.
    fn key(&mut self, name: &str, parent: &str) -> Result<Key, String> {
        let line = self.locate(name);
        let path = if parent.is_empty() {
            name.to_owned()
        } else {
            format!("{parent}.{name}")
        };
        if !VALID_KEYS.contains(&name) {
            return Err(self.error(line, &path, &format!("config error, unknown key '{name}'")));
        }
        Ok(Key {
            name: name.to_owned(),
            path,
            line,
        })
    }

    fn descriptors(&mut self, v: &Value, path: &str) -> Result<Vec<Desc>, String> {
        let mut out = Vec::new();
        for (i, item) in self.list(v, path)?.iter().enumerate() {
            let at = format!("{path}[{i}]");
            let Value::Mapping(map) = item else {
                return Err(self.list_error(&at));
            };
            out.push(self.descriptor(map, &at)?);
        }
        Ok(out)
    }

    fn descriptor(&mut self, map: &Mapping, path: &str) -> Result<Desc, String> {
        let mut d = Desc {
            line: line_of(self.text, self.cursor),
            ..Desc::default()
        };
        for (i, (name, v)) in self.entries(map, path)?.into_iter().enumerate() {
            let k = self.key(name, path)?;
            if i == 0 {
                d.line = k.line;
            }
            d.lines.0.push((k.name.clone(), k.line));
            match k.name.as_str() {
                "key" => d.key = self.text_of(v, &k)?,
                "value" => d.value = self.text_of(v, &k)?,
                "rate_limit" => d.rate_limit = self.limit(v, &k)?,
                "descriptors" => d.descriptors = self.descriptors(v, &k.path)?,
                "shadow_mode" => d.shadow_mode = self.flag(v, &k)?,
                "quota_mode" => d.quota_mode = self.flag(v, &k)?,
                "detailed_metric" => d.detailed_metric = self.flag(v, &k)?,
                "value_to_metric" => d.value_to_metric = self.flag(v, &k)?,
                "share_threshold" => d.share_threshold = self.flag(v, &k)?,
                "metadata" => d.metadata = self.metadata(v, &k)?,
                _ => d.ignored.push(self.ignore(v, k)?),
            }
        }
        Ok(d)
    }

    fn limit(&mut self, v: &Value, key: &Key) -> Result<Option<Limit>, String> {
        let map = match v {
            Value::Null => return Ok(None),
            Value::Mapping(m) => m,
            other => return Err(self.type_error(key, other, "a mapping")),
        };
        let mut l = Limit {
            line: key.line,
            ..Limit::default()
        };
        for (name, v) in self.entries(map, &key.path)? {
            let k = self.key(name, &key.path)?;
            l.lines.0.push((k.name.clone(), k.line));
            match k.name.as_str() {
                "requests_per_unit" => l.requests_per_unit = self.uint32(v, &k)?,
                "unit" => l.unit = self.text_of(v, &k)?,
                "unlimited" => l.unlimited = self.flag(v, &k)?,
                "name" => l.name = self.text_of(v, &k)?,
                "replaces" => l.replaces = self.replaces(v, &k)?,
                _ => l.ignored.push(self.ignore(v, k)?),
            }
        }
        Ok(Some(l))
    }

    fn replaces(&mut self, v: &Value, key: &Key) -> Result<Vec<(String, usize)>, String> {
        let mut out = Vec::new();
        for (i, item) in self.list(v, &key.path)?.iter().enumerate() {
            let at = format!("{}[{i}]", key.path);
            let Value::Mapping(map) = item else {
                return Err(self.list_error(&at));
            };
            let mut entry = (String::new(), line_of(self.text, self.cursor));
            for (name, v) in self.entries(map, &at)? {
                let k = self.key(name, &at)?;
                if k.name == "name" {
                    entry = (self.text_of(v, &k)?, k.line);
                } else {
                    // Ignored by the loader (its struct has only `name`);
                    // still checked as it checks every key.
                    self.ignore(v, k)?;
                }
            }
            out.push(entry);
        }
        Ok(out)
    }

    fn list<'v>(&mut self, v: &'v Value, path: &str) -> Result<&'v [Value], String> {
        match v {
            Value::Null => Ok(&[]),
            Value::Sequence(s) => Ok(s),
            other => {
                let line = line_of(self.text, self.cursor);
                Err(self.error(
                    line,
                    path,
                    &format!(
                        "error loading config file: cannot unmarshal {} into a list",
                        kind(other)
                    ),
                ))
            }
        }
    }

    fn list_error(&self, path: &str) -> String {
        let line = line_of(self.text, self.cursor);
        self.error(
            line,
            path,
            "config error, yaml file contains list of type other than map",
        )
    }

    fn type_error(&self, key: &Key, v: &Value, expected: &str) -> String {
        let message = match v {
            Value::Number(n) if n.is_f64() => "error checking config (a float)".to_owned(),
            _ => format!(
                "error loading config file: cannot unmarshal {} `{}` into {expected}",
                kind(v),
                scalar_text(v)
            ),
        };
        self.error(key.line, &key.path, &message)
    }

    /// A Go string field: any scalar's text; null is `""`.
    fn text_of(&self, v: &Value, key: &Key) -> Result<String, String> {
        match v {
            Value::Null => Ok(String::new()),
            Value::String(s) => Ok(s.clone()),
            Value::Bool(b) => Ok(b.to_string()),
            Value::Number(n) if !n.is_f64() => Ok(n.to_string()),
            other => Err(self.type_error(key, other, "a string")),
        }
    }

    /// A Go bool: YAML 1.1's booleans; null is false.
    fn flag(&self, v: &Value, key: &Key) -> Result<bool, String> {
        match v {
            Value::Null => Ok(false),
            Value::Bool(b) => Ok(*b),
            Value::String(s) => match s.as_str() {
                "y" | "Y" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" | "True" | "TRUE" => Ok(true),
                "n" | "N" | "no" | "No" | "NO" | "off" | "Off" | "OFF" | "False" | "FALSE" => Ok(false),
                _ => Err(self.type_error(key, v, "a bool")),
            },
            other => Err(self.type_error(key, other, "a bool")),
        }
    }

    /// A Go `uint32`: YAML 1.1's integers (`1_000`, `0x10`, `010`
    /// octal); null is 0.
    fn uint32(&self, v: &Value, key: &Key) -> Result<u32, String> {
        let n = match v {
            Value::Null => Some(0),
            Value::Number(n) => n.as_u64(),
            Value::String(s) => yaml11_int(s),
            _ => None,
        };
        match n.and_then(|n| u32::try_from(n).ok()) {
            Some(n) => Ok(n),
            None => Err(self.type_error(key, v, "uint32")),
        }
    }

    /// `metadata`: a mapping of anything (the loader does not check its
    /// keys), or null.
    fn metadata(&self, v: &Value, key: &Key) -> Result<bool, String> {
        match v {
            Value::Null => Ok(false),
            Value::Mapping(m) => Ok(!m.is_empty()),
            other => Err(self.type_error(key, other, "a mapping")),
        }
    }

    /// A known key the loader's struct has no field for here: checked as
    /// the loader checks every key, then ignored.
    fn ignore(&mut self, v: &Value, key: Key) -> Result<Ignored, String> {
        self.check_value(v, &key)?;
        Ok(Ignored {
            key: key.path,
            line: key.line,
        })
    }

    fn check_value(&mut self, v: &Value, key: &Key) -> Result<(), String> {
        if key.name == "metadata" {
            return Ok(());
        }
        match v {
            Value::Mapping(m) => {
                for (name, v) in self.entries(m, &key.path)? {
                    let k = self.key(name, &key.path)?;
                    self.check_value(v, &k)?;
                }
                Ok(())
            }
            Value::Sequence(s) => {
                for (i, item) in s.iter().enumerate() {
                    let at = format!("{}[{i}]", key.path);
                    let Value::Mapping(m) = item else {
                        return Err(self.list_error(&at));
                    };
                    for (name, v) in self.entries(m, &at)? {
                        let k = self.key(name, &at)?;
                        self.check_value(v, &k)?;
                    }
                }
                Ok(())
            }
            Value::Number(n) if n.is_f64() => {
                Err(self.error(key.line, &key.path, "error checking config (a float)"))
            }
            Value::Tagged(_) => Err(self.error(key.line, &key.path, "error checking config")),
            _ => Ok(()),
        }
    }
}

fn parent_or_file(parent: &str) -> &str {
    if parent.is_empty() {
        "(file)"
    } else {
        parent
    }
}

/// The 1-based line of byte `at`.
fn line_of(text: &str, at: usize) -> usize {
    text.get(..at).map_or(1, |t| t.matches('\n').count() + 1)
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "!!bool",
        Value::Number(n) if n.is_f64() => "!!float",
        Value::Number(_) => "!!int",
        Value::String(_) => "!!str",
        Value::Sequence(_) => "!!seq",
        Value::Mapping(_) => "!!map",
        Value::Tagged(_) => "a tagged value",
    }
}

fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::Null => "null".to_owned(),
        _ => kind(v).to_owned(),
    }
}

/// A YAML 1.1 integer that YAML 1.2 reads as a string (`1_000`, `0x10`,
/// `0b101`, `010`), as gopkg.in/yaml.v2 resolves it.
fn yaml11_int(s: &str) -> Option<u64> {
    let plain: String = s.chars().filter(|&c| c != '_').collect();
    let plain = plain.strip_prefix('+').unwrap_or(&plain);
    if plain.is_empty() {
        return None;
    }
    if let Some(hex) = plain.strip_prefix("0x") {
        return u64::from_str_radix(hex, 16).ok();
    }
    if let Some(bin) = plain.strip_prefix("0b") {
        return u64::from_str_radix(bin, 2).ok();
    }
    if let Some(oct) = plain.strip_prefix("0o") {
        return u64::from_str_radix(oct, 8).ok();
    }
    if plain.len() > 1 && plain.starts_with('0') {
        return u64::from_str_radix(plain.get(1..)?, 8).ok();
    }
    plain.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_1_1_integers_read_as_yaml_v2_reads_them() {
        assert_eq!(yaml11_int("1_000"), Some(1000));
        assert_eq!(yaml11_int("0x10"), Some(16));
        assert_eq!(yaml11_int("010"), Some(8));
        assert_eq!(yaml11_int("0b101"), Some(5));
        assert_eq!(yaml11_int("ten"), None);
    }

    #[test]
    fn lines_point_at_each_key_in_document_order() {
        let text = "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: fortnight\n";
        let root = read("f.yaml", text).unwrap();
        let d = &root.descriptors[0];
        assert_eq!(d.line, 3);
        assert_eq!(d.rate_limit.as_ref().unwrap().line, 4);
    }
}
