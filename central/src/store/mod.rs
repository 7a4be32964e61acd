//! Where the allocator's records live, so that several service replicas can
//! share them.
//!
//! The allocator stays the only place with semantics: a store keeps opaque
//! records ([`Session`] per node, [`KeyState`] per (key, limit), which holds
//! the key's per-region allocation and debt too) and runs the allocator's
//! steps (`crate::alloc::{begin, visit, finish}`) of one sync request as
//! **one transaction** over the node's session and every (key, limit)
//! record the request touches ([`Store::update_request`], a [`Txn`]): all
//! of its writes land, or none (a store error, a conflict past the retries,
//! a panic in a step). So a request that fails mid-way counts nothing, and
//! the node's retry (its counts carried again) counts them exactly once.
//! The timer's sweep updates records one at a time ([`Store::update_keys`]):
//! each of its steps may run again. An update function may run more than
//! once (a store retries it on a conflict), so it must be a pure function
//! of the records it is given and its captured inputs, and it must leave
//! its results in its captures on every run.
//!
//! * [`EmbeddedStore`]: in the service's process (the default). Nothing to
//!   run; state is lost when the process exits.
//! * [`RedisStore`]: shared by every replica, survives their restarts. Each
//!   record is a string (its version, then its bytes); a request's writes
//!   are one Lua script that checks every record's version and then writes
//!   them all (Redis runs a script alone), retried a bounded number of
//!   times.
//! * [`RedisClusterStore`]: the same records over a Redis Cluster. A
//!   request is one script per hash slot, each atomic on its own, not one
//!   transaction: exactness comes from each (key, limit) record
//!   deduplicating its own node's counts (`crate::alloc::session`), so a
//!   request whose slots land in part counts nothing twice and loses
//!   nothing (its module header says how, and how a write is acknowledged
//!   only once replicated).
//!
//! Errors say whether they are transient ([`StoreError::is_transient`]), so
//! the caller can answer "try again" (the node then runs its leases to their
//! expiry and applies its failure mode) rather than "broken".

mod cas;
mod cluster;
mod embedded;
mod redis;

pub(crate) use self::redis::{client as redis_client, connection as redis_connection, run_script, Lua};

use async_trait::async_trait;
use serde::{de::DeserializeOwned, Serialize};

pub use self::redis::RedisStore;
use crate::alloc::{KeyId, KeyState, Session};
pub use cluster::{ClusterSpec, RedisClusterStore, MAX_WAIT_MS, WAIT_MS};
pub use embedded::{EmbeddedStore, Footprint};

/// Update functions: `FnMut(record) -> write?`. `None` in the slot: no
/// record (yet); leaving `None` writes nothing. Setting an existing record
/// to `None` and returning `true` deletes it.
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

/// One (key, limit)'s record inside a [`Txn`]: a copy, written back only
/// if `write` is set when [`Txn::apply`] returns.
#[derive(Debug, Clone)]
pub struct KeySlot {
    pub id: KeyId,
    /// The record (`None`: none yet). Set to `None` with `write`: deleted.
    pub record: Option<KeyState>,
    pub write: bool,
}

/// One sync request as one transaction: the store reads the node's
/// session and calls [`Txn::begin`], reads the records it names and calls
/// [`Txn::apply`], then writes the session and every record marked
/// `write`, **all or nothing**. A store may run both steps again (on a
/// conflict), with fresh copies, so each must be a pure function of the
/// records it is given and its inputs, and leave its results in `self` on
/// every run.
pub trait Txn: Send {
    /// Step 1 on a copy of the node's session; `sessions`: how many nodes
    /// have one (before this request). `None`: stop, write nothing.
    /// Otherwise the (key, limit)s [`Txn::apply`] needs, each once.
    fn begin(&mut self, session: &mut Option<Session>, sessions: u64) -> Option<Vec<KeyId>>;

    /// The remaining steps, on the same session copy and on copies of the
    /// records of `begin`'s ids (in its order). Returns whether to write
    /// the session (`None` in the slot: delete it).
    fn apply(&mut self, session: &mut Option<Session>, keys: &mut [KeySlot]) -> bool;
}

/// Opens the store `--store` names: `embedded`, a `redis://` URL (one
/// Redis, with replicas) or a `redis+cluster://host:port,…` URL (a Redis
/// Cluster, see [`ClusterSpec::parse`]).
pub fn open(spec: &str) -> Result<std::sync::Arc<dyn Store>, String> {
    if spec == "embedded" {
        return Ok(std::sync::Arc::new(EmbeddedStore::new()));
    }
    if spec.starts_with("redis://") {
        return RedisStore::new(spec, "tg")
            .map(|s| std::sync::Arc::new(s) as std::sync::Arc<dyn Store>)
            .map_err(|e| e.to_string());
    }
    if spec.starts_with("redis+cluster://") {
        return RedisClusterStore::new(spec, "tg")
            .map(|s| std::sync::Arc::new(s) as std::sync::Arc<dyn Store>)
            .map_err(|e| e.to_string());
    }
    Err(format!(
        "--store {spec}: expected `embedded`, a redis:// URL or a redis+cluster://host:port,… URL"
    ))
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

    /// Runs one sync request's steps as one transaction (see [`Txn`]):
    /// on an error nothing is written. Returns how many nodes have a
    /// session afterwards.
    async fn update_request(&self, node: &str, txn: &mut (dyn Txn + '_)) -> Result<u64, StoreError>;

    /// Updates each of `ids`' records with `f(index, record)`, each
    /// atomically (not all together). On an error some records may have
    /// been updated and others not: for the sweep, whose every step
    /// (bringing a record to `now`) may run again.
    async fn update_keys(&self, ids: &[KeyId], f: &mut KeyUpdate<'_>) -> Result<(), StoreError>;

    /// Every (key, limit) with a record.
    async fn key_ids(&self) -> Result<Vec<KeyId>, StoreError>;

    /// How many (key, limit)s have a record.
    async fn key_count(&self) -> Result<u64, StoreError>;

    /// How many nodes have a session.
    async fn session_count(&self) -> Result<u64, StoreError>;

    /// Every node with a session.
    async fn session_ids(&self) -> Result<Vec<String>, StoreError>;

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

/// A record a store keeps as bytes: a format byte, then the record.
///
/// * [`FORMAT`] (3): the compact encoding of [`crate::codec`] (varints, no field
///   names, a struct's field count so that fields appended with a serde
///   default still read old records; repeated strings and nearby
///   timestamps written once). About 150 bytes for a (key, limit) one node
///   holds, 30 per key in a session.
/// * 2 (read only): MessagePack with field names (`rmp-serde`), what the
///   previous version wrote (about 740 bytes for the same record).
/// * 1 (read only): `bincode` 1.x, what earlier versions wrote; decoded by
///   [`Record::from_v1`].
///
/// Formats 1 and 2 are written back as format 3 on a record's next update.
pub trait Record: Serialize + DeserializeOwned {
    fn from_v1(bytes: &[u8]) -> Result<Self, String>;

    /// Writes format 3: through serde, unless the type writes its own
    /// ([`crate::codec::Compact`]: the same bytes, faster).
    fn to_format3(&self, out: &mut Vec<u8>) -> Result<(), crate::codec::Error> {
        crate::codec::to_writer(out, self)
    }

    /// Reads format 3 (as [`Record::to_format3`] writes it).
    fn from_format3(bytes: &[u8]) -> Result<Self, crate::codec::Error> {
        crate::codec::from_slice(bytes)
    }
}

/// The record every key report reads and writes: its own code
/// (`crate::alloc::record`).
impl Record for KeyState {
    fn from_v1(bytes: &[u8]) -> Result<KeyState, String> {
        bincode::deserialize(bytes).map_err(|e| e.to_string())
    }

    fn to_format3(&self, out: &mut Vec<u8>) -> Result<(), crate::codec::Error> {
        crate::codec::to_writer_compact(out, self)
    }

    fn from_format3(bytes: &[u8]) -> Result<KeyState, crate::codec::Error> {
        crate::codec::from_slice_compact(bytes)
    }
}

impl Record for Session {
    fn from_v1(bytes: &[u8]) -> Result<Session, String> {
        Session::from_v1_bincode(bytes)
    }
}

/// The format stores write.
const FORMAT: u8 = 3;
const FORMAT_NAMED: u8 = 2;
const FORMAT_V1: u8 = 1;

#[cfg(test)]
fn encode<T: Record>(record: &str, value: &T) -> Result<Vec<u8>, StoreError> {
    let mut out = Vec::with_capacity(192);
    encode_into(&mut out, record, value)?;
    Ok(out)
}

/// Appends the format byte and `value` to `out`.
pub(crate) fn encode_into<T: Record>(out: &mut Vec<u8>, record: &str, value: &T) -> Result<(), StoreError> {
    out.push(FORMAT);
    value.to_format3(out).map_err(|e| StoreError::Corrupt {
        record: record.to_owned(),
        reason: e.to_string(),
    })
}

pub(crate) fn decode<T: Record>(record: &str, bytes: &[u8]) -> Result<T, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        record: record.to_owned(),
        reason,
    };
    match bytes.split_first() {
        Some((&FORMAT, rest)) => T::from_format3(rest).map_err(|e| corrupt(e.to_string())),
        Some((&FORMAT_NAMED, rest)) => rmp_serde::from_slice(rest).map_err(|e| corrupt(e.to_string())),
        Some((&FORMAT_V1, rest)) => T::from_v1(rest).map_err(corrupt),
        Some((other, _)) => Err(corrupt(format!("unknown format {other}"))),
        None => Err(corrupt("empty".to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenantgate::sync::{Report, SyncRequest, PROTOCOL_VERSION};

    #[test]
    fn records_round_trip_and_formats_1_and_2_still_read() {
        let mut session = Session::new("eu");
        let req = SyncRequest {
            version: PROTOCOL_VERSION,
            node_id: "n".into(),
            region: "eu".into(),
            policy_version: "v".into(),
            seq: 5,
            boot: 9,
            acked_seq: 0,
            reports: vec![Report {
                key: "k".into(),
                limit: "l".into(),
                consumed: 3,
                unleased: 0,
                demand: 3,
                failure_mode: None,
                started_ms: None,
            }],
            settings: None,
        };
        session.intake(&req, 1).unwrap();
        let bytes = encode("s", &session).unwrap();
        assert_eq!(bytes[0], 3);
        let back: Session = decode("s", &bytes).unwrap();
        assert_eq!(format!("{back:?}"), format!("{session:?}"));
        let mut v2 = vec![2u8];
        rmp_serde::encode::write_named(&mut v2, &session).unwrap();
        let old: Session = decode("s", &v2).unwrap();
        assert_eq!(format!("{old:?}"), format!("{session:?}"));

        let v1 = Session::v1_bincode_for_tests(&session);
        let old: Session = decode("s", &v1).unwrap();
        assert_eq!(old.region, "eu");
        assert_eq!(old.heard_at, Some(1));

        let ks = KeyState::new(
            crate::GlobalLimit {
                limit: 10,
                window_ns: 1_000,
                burst: 5,
                max_cost: 1,
                month: 0,
            },
            7,
        );
        let mut v1 = vec![1u8];
        v1.extend(bincode::serialize(&ks).unwrap());
        let old: KeyState = decode("k", &v1).unwrap();
        assert_eq!(old.view(), ks.view());
        let new: KeyState = decode("k", &encode("k", &ks).unwrap()).unwrap();
        assert_eq!(new.view(), ks.view());
        assert!(matches!(
            decode::<KeyState>("k", &[9, 1]),
            Err(StoreError::Corrupt { .. })
        ));
    }
}
