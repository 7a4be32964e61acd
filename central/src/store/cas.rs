//! The versioned records the Redis stores share (the single-node store,
//! `redis.rs`, and the Redis Cluster store, `cluster/`), and their three
//! update loops written once: a record's name and its version, the
//! per-record compare-and-set scripts ([`CAS`], [`CAS_DEL`]) and the
//! operations a request's script applies ([`Op`]); the loop of a sync
//! request ([`request`]), of a session update ([`session`]) and of a sweep
//! ([`sweep`]), each over how its store reads and writes ([`RequestIo`],
//! [`SweepIo`]). Beneath both stores.

use async_trait::async_trait;

use super::{decode, KeySlot, KeyUpdate, SessionUpdate, StoreError, Txn};
use crate::alloc::{KeyId, KeyState, Session};

/// Attempts of one record's compare-and-set before giving up.
pub const MAX_ATTEMPTS: u32 = 16;

/// `KEYS[1]` record; `ARGV` expected version ("" when absent), new value
/// (its version first). Returns 1 if written, 0 if the version moved.
pub(super) const CAS: &str = r"
local r = redis.call('GET', KEYS[1])
if (r and string.sub(r, 1, 8) or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
";

/// `KEYS[1]` record; `ARGV[1]` expected version. Deletes the record if its
/// version is still that. Returns 1 if deleted, 0 if the version moved.
pub(super) const CAS_DEL: &str = r"
local r = redis.call('GET', KEYS[1])
if (r and string.sub(r, 1, 8) or '') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
";

pub(super) type Version = Option<u64>;

/// Bytes of a record's version, before its bytes.
const VERSION_LEN: usize = 8;

/// A stored value: its version and its record's bytes (`None`: no record;
/// a value shorter than a version is corrupt).
pub(super) fn split_value(
    record: &str,
    value: Option<Vec<u8>>,
) -> Result<(Version, Option<Vec<u8>>), StoreError> {
    let Some(mut v) = value else {
        return Ok((None, None));
    };
    if v.len() < VERSION_LEN {
        return Err(StoreError::Corrupt {
            record: record.to_owned(),
            reason: format!("{} bytes: no version", v.len()),
        });
    }
    let mut version = [0u8; VERSION_LEN];
    version.copy_from_slice(&v[..VERSION_LEN]);
    v.drain(..VERSION_LEN);
    Ok((Some(u64::from_be_bytes(version)), Some(v)))
}

/// The version as the scripts compare it ("" when absent).
pub(super) fn version_arg(v: Version) -> Vec<u8> {
    v.map(|v| v.to_be_bytes().to_vec()).unwrap_or_default()
}

/// The value that writes `record`'s encoding at the version after `v`.
pub(super) fn next_value<T: super::Record>(
    record: &str,
    v: Version,
    value: &T,
) -> Result<Vec<u8>, StoreError> {
    let next = v.unwrap_or(0).wrapping_add(1);
    let mut out = Vec::with_capacity(VERSION_LEN + 192);
    out.extend_from_slice(&next.to_be_bytes());
    super::encode_into(&mut out, record, value)?;
    Ok(out)
}

/// The records' names under a prefix (shared with the cluster store).
pub(super) struct Names {
    prefix: String,
}

/// One record of a sweep ([`Store::update_keys`](super::Store::update_keys)), read as `value`:
/// `f` sees it as slot `i`; if `f` changed it, its compare-and-set (a
/// write or a delete). `None`: nothing to write.
fn swept(
    record: &str,
    value: Option<Vec<u8>>,
    i: usize,
    f: &mut KeyUpdate<'_>,
) -> Result<Option<redis::Cmd>, StoreError> {
    let (version, bytes) = split_value(record, value)?;
    let mut slot: Option<KeyState> = bytes.map(|b| decode(record, &b)).transpose()?;
    if !f(i, &mut slot) {
        return Ok(None);
    }
    Ok(match (slot, version) {
        (Some(ks), _) => Some(cas_cmd(record, version, next_value(record, version, &ks)?)),
        (None, Some(v)) => Some(cas_del_cmd(record, v)),
        (None, None) => None,
    })
}

/// One record's compare-and-set in a sweep: `at`, its index in the
/// sweep's records; `script`, the [`CAS`] or [`CAS_DEL`] that writes it.
pub(super) struct SweptWrite {
    pub(super) at: usize,
    pub(super) script: redis::Cmd,
}

/// How a store reaches a sweep's records: the one Redis in one pipeline,
/// or a Redis Cluster in one pipeline per master. The loop over them is
/// [`sweep`], the same for both.
#[async_trait]
pub(super) trait SweepIo: Send {
    /// The values of `records[i]` for each `i` of `pending`, in that order.
    async fn read(
        &mut self,
        records: &[String],
        pending: &[usize],
    ) -> Result<Vec<Option<Vec<u8>>>, StoreError>;

    /// Runs `writes` (each its own compare-and-set): whether each landed,
    /// in their order.
    async fn write(&mut self, records: &[String], writes: Vec<SweptWrite>) -> Result<Vec<bool>, StoreError>;
}

/// The sweep's loop ([`Store::update_keys`](super::Store::update_keys) on `records`), one record's
/// compare-and-set at a time: read what is pending, let `f` step each,
/// write what it changed; a record whose version moved is read and
/// stepped again (each of the sweep's steps may run again), at most
/// [`MAX_ATTEMPTS`] times, then a transient [`StoreError::Contention`].
pub(super) async fn sweep(
    io: &mut (dyn SweepIo + '_),
    records: &[String],
    f: &mut KeyUpdate<'_>,
) -> Result<(), StoreError> {
    let mut pending: Vec<usize> = (0..records.len()).collect();
    for _ in 0..MAX_ATTEMPTS {
        let rows = io.read(records, &pending).await?;
        let mut writes: Vec<SweptWrite> = Vec::with_capacity(pending.len());
        for (&i, value) in pending.iter().zip(rows) {
            if let Some(script) = swept(&records[i], value, i, f)? {
                writes.push(SweptWrite { at: i, script });
            }
        }
        if writes.is_empty() {
            return Ok(());
        }
        let written: Vec<usize> = writes.iter().map(|w| w.at).collect();
        let landed = io.write(records, writes).await?;
        pending = written
            .into_iter()
            .zip(landed)
            .filter_map(|(i, ok)| (!ok).then_some(i))
            .collect();
        if pending.is_empty() {
            return Ok(());
        }
    }
    Err(StoreError::Contention {
        record: pending.first().map(|&i| records[i].clone()).unwrap_or_default(),
        attempts: MAX_ATTEMPTS,
    })
}

/// A request's records as read (`rows`, in `records`' order): the
/// version each was read at, and the allocator's slots over them (none
/// written yet). The Redis and the Redis Cluster stores read them alike.
pub(super) fn key_slots(
    ids: Vec<KeyId>,
    records: &[String],
    rows: Vec<Option<Vec<u8>>>,
) -> Result<(Vec<Version>, Vec<KeySlot>), StoreError> {
    let mut versions: Vec<Version> = Vec::with_capacity(rows.len());
    let mut slots: Vec<KeySlot> = Vec::with_capacity(rows.len());
    for ((id, r), value) in ids.into_iter().zip(records).zip(rows) {
        let (v, b) = split_value(r, value)?;
        versions.push(v);
        slots.push(KeySlot {
            record: b.map(|b| decode(r, &b)).transpose()?,
            id,
            write: false,
        });
    }
    Ok((versions, slots))
}

/// The session's write after a request (`write`: the allocator changed
/// it) and the count of sessions after it (`count` before): a new session
/// adds one, a deleted one takes one away.
pub(super) fn session_op(
    write: bool,
    session: &Option<Session>,
    record: &str,
    version: Version,
    count: u64,
) -> Result<(Op, u64), StoreError> {
    Ok(match (write, session, version) {
        (false, _, _) | (true, None, None) => (Op::Check, count),
        (true, Some(s), None) => (
            Op::Create(next_value(record, version, s)?),
            count.saturating_add(1),
        ),
        (true, Some(s), Some(_)) => (Op::Write(next_value(record, version, s)?), count),
        (true, None, Some(_)) => (Op::Delete, count.saturating_sub(1)),
    })
}

impl Names {
    pub(super) fn new(prefix: &str) -> Names {
        Names {
            prefix: prefix.to_owned(),
        }
    }

    pub(super) fn key_record(&self, id: &KeyId) -> String {
        format!("{}:{{{}}}:{}", self.prefix, id.0, id.1)
    }

    pub(super) fn key_of_record(&self, record: &str) -> Option<KeyId> {
        // Limit names have no `}` or `:`, so the last `}:` ends the key.
        let rest = record.strip_prefix(&self.prefix)?.strip_prefix(":{")?;
        let (key, limit) = rest.rsplit_once("}:")?;
        Some((key.to_owned(), limit.to_owned()))
    }

    pub(super) fn session_record(&self, node: &str) -> String {
        format!("{}:n:{{{node}}}", self.prefix)
    }

    /// `SCAN`'s pattern for every (key, limit) record: the prefix (glob
    /// characters escaped), then `:{`.
    pub(super) fn key_pattern(&self) -> String {
        let mut p = glob_escaped(&self.prefix);
        p.push_str(":{*");
        p
    }

    /// `SCAN`'s pattern for every session record.
    pub(super) fn session_pattern(&self) -> String {
        let mut p = glob_escaped(&self.prefix);
        p.push_str(":n:{*");
        p
    }

    /// The node a session record's name names.
    pub(super) fn node_of_session(&self, record: &str) -> Option<String> {
        let rest = record.strip_prefix(&self.prefix)?.strip_prefix(":n:{")?;
        rest.strip_suffix('}').map(str::to_owned)
    }

    pub(super) fn nodes_set(&self) -> String {
        format!("{}:nodes", self.prefix)
    }
}

/// `s` with `SCAN`'s glob characters escaped.
fn glob_escaped(s: &str) -> String {
    let mut p = String::with_capacity(s.len() + 4);
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            p.push('\\');
        }
        p.push(c);
    }
    p
}

/// A node's session as a request reads it: its version, its value, and
/// the number of sessions.
pub(super) struct SessionRead {
    pub(super) version: Version,
    pub(super) session: Option<Session>,
    pub(super) count: u64,
}

/// A session as [`session`]'s step left it: the version and the number
/// of sessions it was read at, whether it was absent then (`created`),
/// and what it is now (`None`: deleted, or still absent).
pub(super) struct SessionWrite {
    pub(super) version: Version,
    pub(super) count: u64,
    pub(super) created: bool,
    pub(super) slot: Option<Session>,
}

/// A sync request read and stepped by the allocator ([`request`]): what
/// its write needs. `session` at `version` and `count` as read,
/// `write_session` whether the allocator changed it; `records` at
/// `versions`, stepped into `slots` (in the same order).
pub(super) struct Stepped<'a> {
    pub(super) node: &'a str,
    pub(super) record: &'a str,
    pub(super) read: SessionRead,
    pub(super) write_session: bool,
    pub(super) records: Vec<String>,
    pub(super) versions: Vec<Version>,
    pub(super) slots: Vec<KeySlot>,
}

/// How a store reaches a sync request's records: the one Redis (one
/// script for the whole request) or a Redis Cluster (a script per slot,
/// then the session). The loop over them is [`request`], the same for
/// both.
#[async_trait]
pub(super) trait RequestIo: Send {
    async fn read_session(&mut self, record: &str) -> Result<SessionRead, StoreError>;

    /// The values of `records`, in their order.
    async fn read(&mut self, records: &[String]) -> Result<Vec<Option<Vec<u8>>>, StoreError>;

    /// Writes the node's session as `f` left it if its version did not
    /// move since it was read: the number of sessions after it, or `None`
    /// (read it and let `f` step it again).
    async fn write_session(
        &mut self,
        node: &str,
        record: &str,
        write: SessionWrite,
    ) -> Result<Option<u64>, StoreError>;

    /// Writes a stepped request if no version moved since it was read:
    /// the number of sessions after it, or `None` (a version moved: read
    /// and step it again).
    async fn write(&mut self, stepped: Stepped<'_>) -> Result<Option<u64>, StoreError>;
}

/// The sync request's loop ([`Store::update_request`](super::Store::update_request) for `node`): read
/// the session, let `txn` begin, read the records it names, let it step
/// them, write; on a conflict all again, at most [`MAX_ATTEMPTS`] times,
/// then a transient [`StoreError::Contention`].
pub(super) async fn request(
    io: &mut (dyn RequestIo + '_),
    names: &Names,
    node: &str,
    txn: &mut (dyn Txn + '_),
) -> Result<u64, StoreError> {
    let record = names.session_record(node);
    for _ in 0..MAX_ATTEMPTS {
        let mut read = io.read_session(&record).await?;
        let Some(ids) = txn.begin(&mut read.session, read.count) else {
            return Ok(read.count);
        };
        let records: Vec<String> = ids.iter().map(|id| names.key_record(id)).collect();
        let rows = io.read(&records).await?;
        let (versions, mut slots) = key_slots(ids, &records, rows)?;
        let write_session = txn.apply(&mut read.session, &mut slots);
        let stepped = Stepped {
            node,
            record: &record,
            read,
            write_session,
            records,
            versions,
            slots,
        };
        if let Some(after) = io.write(stepped).await? {
            return Ok(after);
        }
    }
    Err(StoreError::Contention {
        record,
        attempts: MAX_ATTEMPTS,
    })
}

/// The session's loop ([`Store::update_session`](super::Store::update_session) for `node`): read it,
/// let `f` step it, write it if `f` changed it; on a conflict again, at
/// most [`MAX_ATTEMPTS`] times.
pub(super) async fn session(
    io: &mut (dyn RequestIo + '_),
    names: &Names,
    node: &str,
    f: &mut SessionUpdate<'_>,
) -> Result<u64, StoreError> {
    let record = names.session_record(node);
    for _ in 0..MAX_ATTEMPTS {
        let read = io.read_session(&record).await?;
        let created = read.session.is_none();
        let mut slot = read.session;
        if !f(&mut slot) {
            return Ok(read.count);
        }
        let write = SessionWrite {
            version: read.version,
            count: read.count,
            created,
            slot,
        };
        if let Some(after) = io.write_session(node, &record, write).await? {
            return Ok(after);
        }
    }
    Err(StoreError::Contention {
        record,
        attempts: MAX_ATTEMPTS,
    })
}

/// The [`CAS_DEL`] of `record` at `version`.
pub(super) fn cas_del_cmd(record: &str, version: u64) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(CAS_DEL)
        .arg(1)
        .arg(record)
        .arg(version_arg(Some(version)));
    cmd
}

/// The [`CAS`] that writes `value` to `record` if still at `version`.
pub(super) fn cas_cmd(record: &str, version: Version, value: Vec<u8>) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(CAS)
        .arg(1)
        .arg(record)
        .arg(version_arg(version))
        .arg(value);
    cmd
}

/// What `CAS_ALL` (`redis.rs`) does to one record.
pub(super) enum Op {
    Check,
    Create(Vec<u8>),
    Write(Vec<u8>),
    Delete,
}

pub(super) fn push_op(script: &mut redis::Cmd, version: Version, op: Op) {
    let (code, value) = match op {
        Op::Check => ("-", Vec::new()),
        Op::Create(b) => ("c", b),
        Op::Write(b) => ("w", b),
        Op::Delete => ("d", Vec::new()),
    };
    script.arg(version_arg(version)).arg(code).arg(value);
}
