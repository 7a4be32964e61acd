//! Reading a policy file: YAML (JSON is YAML too) → document → policy.

use std::fmt;
use std::path::{Path, PathBuf};

use tenantgate::policy::{Node, Policy, PolicyErrors};

/// A validated policy and the document it came from.
pub struct Loaded {
    pub document: Node,
    pub policy: Policy,
}

/// Why a policy file was refused; prints one `FILE: path: message` per line.
#[derive(Debug)]
pub enum LoadError {
    /// The file could not be read, or is over the size limit (the message
    /// names the file).
    Read(PathBuf, String),
    Yaml(PathBuf, String),
    Invalid(PathBuf, PolicyErrors),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Read(_, e) => write!(f, "{e}"),
            LoadError::Yaml(p, e) => write!(f, "{}: {e}", p.display()),
            LoadError::Invalid(p, errors) => {
                for (i, e) in errors.0.iter().enumerate() {
                    if i > 0 {
                        writeln!(f)?;
                    }
                    write!(f, "{}: {e}", p.display())?;
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
    let policy = Policy::from_node(&document).map_err(|e| LoadError::Invalid(path.to_owned(), e))?;
    Ok(Loaded { document, policy })
}
