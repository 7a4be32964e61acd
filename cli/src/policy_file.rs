//! Reading a policy file: YAML (JSON is YAML too) → document → policy.

use std::fmt;
use std::path::{Path, PathBuf};

use tenantgate::policy::{Node, Policy, PolicyErrors};

use crate::locate::{Position, Positions};

/// A validated policy and the document it came from.
pub struct Loaded {
    pub document: Node,
    pub policy: Policy,
}

/// Why a policy file was refused; prints one `FILE:LINE:COLUMN: path:
/// message` per line (`FILE: path: message` when the path has no place in
/// the text, e.g. an empty file).
#[derive(Debug)]
pub enum LoadError {
    /// The file could not be read, or is over the size limit (the message
    /// names the file).
    Read(PathBuf, String),
    Yaml(PathBuf, String),
    Invalid(PathBuf, Refusal),
}

/// A document's errors and where each is in its text.
#[derive(Debug)]
pub struct Refusal {
    pub errors: PolicyErrors,
    /// One per error, in the same order.
    pub positions: Vec<Option<Position>>,
}

impl Refusal {
    /// Locates `errors` in `text`, the YAML they were found in.
    pub fn locate(errors: PolicyErrors, text: &str) -> Refusal {
        let positions = Positions::of(text);
        let positions = errors.0.iter().map(|e| positions.find(&e.path)).collect();
        Refusal { errors, positions }
    }
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Read(_, e) => write!(f, "{e}"),
            LoadError::Yaml(p, e) => write!(f, "{}: {e}", p.display()),
            LoadError::Invalid(p, refusal) => {
                for (i, e) in refusal.errors.0.iter().enumerate() {
                    if i > 0 {
                        writeln!(f)?;
                    }
                    match refusal.positions.get(i).copied().flatten() {
                        Some(at) => write!(f, "{}:{}:{}: {e}", p.display(), at.line, at.column)?,
                        None => write!(f, "{}: {e}", p.display())?,
                    }
                }
                Ok(())
            }
        }
    }
}

/// Parses YAML text into a document (the service's reader: one reader of
/// policies). An empty file is a null document.
pub fn parse_yaml(text: &str) -> Result<Node, String> {
    tenantgate_central::service::policy::parse_document(text)
}

pub fn load(path: &Path) -> Result<Loaded, LoadError> {
    let text = tenantgate_central::service::policy::read_text(path)
        .map_err(|e| LoadError::Read(path.to_owned(), e))?;
    let document = parse_yaml(&text).map_err(|e| LoadError::Yaml(path.to_owned(), e))?;
    let policy = Policy::from_node(&document)
        .map_err(|e| LoadError::Invalid(path.to_owned(), Refusal::locate(e, &text)))?;
    Ok(Loaded { document, policy })
}
