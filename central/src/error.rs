//! Errors of the central cluster.

use core::fmt;

use tenantgate::sync::ProtocolError;

/// A configuration value out of range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub message: &'static str,
}

impl ConfigError {
    pub fn new(field: impl Into<String>, message: &'static str) -> ConfigError {
        ConfigError {
            field: field.into(),
            message,
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

/// A sync request the allocator does not answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocError {
    /// Not a valid request.
    Protocol(ProtocolError),
    /// Another protocol version.
    Version(u32),
    /// Its `seq` is not above the node's last applied one (a duplicate or
    /// a request overtaken by a newer one): nothing was counted.
    Stale { seq: u64 },
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::Protocol(e) => write!(f, "{e}"),
            AllocError::Version(v) => write!(f, "unsupported sync protocol version {v}"),
            AllocError::Stale { seq } => write!(f, "stale sync request (seq {seq})"),
        }
    }
}

impl std::error::Error for AllocError {}
