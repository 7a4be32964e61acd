//! Where the allocator's records live, so that several service replicas can
//! share them.
//!
//! The allocator stays the only place with semantics: a store keeps opaque
//! records ([`Session`] per node, [`KeyState`] per (key, limit), which holds
//! the key's per-region allocation and debt too) and runs the allocator's
//! steps (`crate::alloc::{begin, visit, finish}`) as **atomic
//! read-modify-writes of one record each**. An update function may run more
//! than once (a store retries it on a conflict), so it must be a pure
//! function of the record it is given and its captured inputs, and it must
//! leave its results in its captures on every run.
//!
//! * [`EmbeddedStore`]: in the service's process (the default). Nothing to
//!   run; state is lost when the process exits.
//! * [`RedisStore`]: shared by every replica, survives their restarts. Each
//!   record is a hash `{v: version, d: bytes}`; a write is a Lua
//!   compare-and-set on `v`, retried a bounded number of times.
//!
//! Errors say whether they are transient ([`StoreError::is_transient`]), so
//! the caller can answer "try again" (the node then runs its leases to their
//! expiry and applies its failure mode) rather than "broken".

mod embedded;
mod redis;

use async_trait::async_trait;
use serde::{de::DeserializeOwned, Serialize};

pub use self::redis::RedisStore;
use crate::alloc::{KeyId, KeyState, Session};
pub use embedded::EmbeddedStore;

/// Update functions: `FnMut(record) -> write?`. `None` in the slot: no
/// record (yet); leaving `None` writes nothing.
pub type SessionUpdate<'a> = dyn FnMut(&mut Option<Session>) -> bool + Send + 'a;
pub type KeyUpdate<'a> = dyn FnMut(usize, &mut Option<KeyState>) -> bool + Send + 'a;

/// A store's failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store cannot be reached, or the connection broke (transient).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store did not answer in time (transient).
    #[error("store timed out: {0}")]
    Timeout(String),
    /// Other replicas kept changing the record (transient).
    #[error("record {record}: {attempts} conflicting updates in a row")]
    Contention { record: String, attempts: u32 },
    /// A record that does not decode: written by something else, or by an
    /// incompatible version (permanent).
    #[error("record {record} is corrupt: {reason}")]
    Corrupt { record: String, reason: String },
    /// The store refused the command (permanent: wrong type, script error,
    /// authentication).
    #[error("store refused: {0}")]
    Refused(String),
}

impl StoreError {
    /// Whether retrying later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable(_) | StoreError::Timeout(_) | StoreError::Contention { .. }
        )
    }
}

/// The allocator's records, shared by the service replicas.
#[async_trait]
pub trait Store: Send + Sync {
    /// `embedded` or `redis`, for logs and metrics.
    fn kind(&self) -> &'static str;

    /// Answers when the store can serve (readiness).
    async fn ping(&self) -> Result<(), StoreError>;

    /// Atomically updates node `node`'s session with `f`. Returns how many
    /// nodes have a session afterwards.
    async fn update_session(&self, node: &str, f: &mut SessionUpdate<'_>) -> Result<u64, StoreError>;

    /// Updates each of `ids`' records with `f(index, record)`, each
    /// atomically (not all together). On an error some records may have
    /// been updated and others not.
    async fn update_keys(&self, ids: &[KeyId], f: &mut KeyUpdate<'_>) -> Result<(), StoreError>;

    /// Every (key, limit) with a record.
    async fn key_ids(&self) -> Result<Vec<KeyId>, StoreError>;

    /// How many (key, limit)s have a record.
    async fn key_count(&self) -> Result<u64, StoreError>;

    /// How many nodes have a session.
    async fn session_count(&self) -> Result<u64, StoreError>;

    /// One (key, limit)'s record, as stored.
    async fn key(&self, id: &KeyId) -> Result<Option<KeyState>, StoreError> {
        let mut out = None;
        self.update_keys(std::slice::from_ref(id), &mut |_, slot| {
            out = slot.clone();
            false
        })
        .await?;
        Ok(out)
    }
}

/// Record encoding for stores that keep bytes: a format byte, then bincode.
const FORMAT: u8 = 1;

pub(crate) fn encode<T: Serialize>(record: &str, value: &T) -> Result<Vec<u8>, StoreError> {
    let mut out = vec![FORMAT];
    bincode::serialize_into(&mut out, value).map_err(|e| StoreError::Corrupt {
        record: record.to_owned(),
        reason: e.to_string(),
    })?;
    Ok(out)
}

pub(crate) fn decode<T: DeserializeOwned>(record: &str, bytes: &[u8]) -> Result<T, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        record: record.to_owned(),
        reason,
    };
    match bytes.split_first() {
        Some((&FORMAT, rest)) => bincode::deserialize(rest).map_err(|e| corrupt(e.to_string())),
        Some((other, _)) => Err(corrupt(format!("unknown format {other}"))),
        None => Err(corrupt("empty".to_owned())),
    }
}
