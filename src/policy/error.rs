//! Policy errors: every error names the field path it is about.

use core::fmt;

/// One step of a [`FieldPath`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Segment {
    Key(String),
    Index(usize),
}

/// Where in the policy document an error is, e.g. `plans.free.limits[0].rate`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldPath(Vec<Segment>);

impl FieldPath {
    pub fn root() -> Self {
        FieldPath(Vec::new())
    }

    pub fn from_segments(segments: Vec<Segment>) -> Self {
        FieldPath(segments)
    }

    /// The steps from the document's root.
    pub fn segments(&self) -> &[Segment] {
        &self.0
    }

    /// This path extended by a mapping key.
    pub fn key(&self, key: &str) -> Self {
        let mut segments = self.0.clone();
        segments.push(Segment::Key(key.to_owned()));
        FieldPath(segments)
    }

    /// This path extended by a list index.
    pub fn index(&self, index: usize) -> Self {
        let mut segments = self.0.clone();
        segments.push(Segment::Index(index));
        FieldPath(segments)
    }
}

/// Keys that are plain names print bare (`plans.free`); anything else is
/// quoted (`plans["my plan"]`) so the path stays unambiguous.
fn is_bare_key(key: &str) -> bool {
    !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("(policy)");
        }
        for (i, segment) in self.0.iter().enumerate() {
            match segment {
                Segment::Key(k) if is_bare_key(k) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    f.write_str(k)?;
                }
                Segment::Key(k) => write!(f, "[{}]", serde_json::Value::from(k.as_str()))?,
                Segment::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// A problem with one field of a policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    pub path: FieldPath,
    pub message: String,
}

impl PolicyError {
    pub fn new(path: FieldPath, message: impl Into<String>) -> Self {
        PolicyError {
            path,
            message: message.into(),
        }
    }
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Every problem found in a policy (validation does not stop at the first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyErrors(pub Vec<PolicyError>);

impl PolicyErrors {
    pub fn one(path: FieldPath, message: impl Into<String>) -> Self {
        PolicyErrors(vec![PolicyError::new(path, message)])
    }
}

impl fmt::Display for PolicyErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for PolicyErrors {}

/// The errors validation has found so far, in the order found.
pub(super) struct Errors(pub(super) Vec<PolicyError>);

impl Errors {
    pub(super) fn add(&mut self, path: FieldPath, message: impl Into<String>) {
        self.0.push(PolicyError::new(path, message));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_print_like_field_accessors() {
        let p = FieldPath::root()
            .key("plans")
            .key("free")
            .key("limits")
            .index(0)
            .key("rate");
        assert_eq!(p.to_string(), "plans.free.limits[0].rate");
        let q = FieldPath::root().key("plans").key("my plan");
        assert_eq!(q.to_string(), r#"plans["my plan"]"#);
        assert_eq!(FieldPath::root().to_string(), "(policy)");
    }
}
