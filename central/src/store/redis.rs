//! The Redis store: records shared by every service replica.
//!
//! # Layout
//! * `<prefix>:{<key>}:<limit>`: one (key, limit). The hash tag `{<key>}`
//!   keeps every limit of a key in one cluster slot.
//! * `<prefix>:n:{<node>}`: one node's session.
//! * `<prefix>:nodes`: the set of node ids with a session, for the session
//!   count each request needs and the session sweep (an index, not state).
//!   There is no index of the (key, limit) records: the sweep finds them
//!   with `SCAN` (a set of a million record names cost Redis about 80
//!   bytes per key, a third of the record itself).
//!
//! Each record is one string: its version (8 bytes, big-endian), then its
//! bytes (`store::encode_into`, format 3): 248 bytes of `MEMORY USAGE` for
//! a (key, limit) one node holds (`make bench-service-memory`).
//!
//! # Atomicity
//! Optimistic compare-and-set. A sync request ([`Store::update_request`])
//! reads the node's session, then every (key, limit) record it names (one
//! pipeline), runs the allocator's steps in Rust, and writes with **one**
//! Lua script ([`CAS_ALL`]) that first checks that every record's `v` is
//! still what was read, then writes them all and their index entries:
//! Redis runs a script alone, so the request lands whole or not at all
//! (no MULTI/EXEC needed: the script is the transaction). A connection
//! that breaks before the script ran writes nothing; one that breaks after
//! it ran loses only the answer (the node's retry is then deduplicated by
//! its session like any lost answer). On a conflict the whole request is
//! re-read and re-run, at most [`MAX_ATTEMPTS`] times, then it fails with a
//! transient [`StoreError::Contention`]: three round trips per request
//! plus three per round of conflicts. The script names every record it
//! touches in `KEYS`, as a script must; all of a request's records are in
//! one Redis (this store speaks to one server, not a Redis Cluster, where
//! a request's keys span slots). The sweep's batches ([`Store::update_keys`])
//! use the per-record [`CAS`]: each of its steps may run again. Both loops
//! ([`request`], [`sweep`]) are written once, here, over how a store reads
//! and writes ([`RequestIo`], [`SweepIo`]): the Redis Cluster store runs
//! the same loops over its slots. The
//! allocation math stays in Rust (`crate::alloc`); the scripts know nothing
//! of it.

use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, RedisError};
use tokio::sync::OnceCell;

use super::{decode, KeySlot, KeyUpdate, SessionUpdate, Store, StoreError, Txn};
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

/// One sync request's writes, all or nothing. `KEYS[1]` the nodes set,
/// then the records (the session first). `ARGV[1]` the node id, then three
/// per record: expected version ("" when absent), operation (`c` create,
/// `w` write, `d` delete, `-` only check), new value (its version first).
/// Every version is checked before anything is written; the session's
/// create and delete also add the node to and remove it from the nodes
/// set. Returns 1 if written, 0 if a version moved.
const CAS_ALL: &str = r"
local n = #KEYS - 1
for i = 1, n do
  local r = redis.call('GET', KEYS[i + 1])
  if (r and string.sub(r, 1, 8) or '') ~= ARGV[(i - 1) * 3 + 2] then return 0 end
end
for i = 1, n do
  local b = (i - 1) * 3 + 1
  local op = ARGV[b + 2]
  if op == 'c' or op == 'w' then
    redis.call('SET', KEYS[i + 1], ARGV[b + 3])
    if op == 'c' and i == 1 then redis.call('SADD', KEYS[1], ARGV[1]) end
  elseif op == 'd' then
    redis.call('DEL', KEYS[i + 1])
    if i == 1 then redis.call('SREM', KEYS[1], ARGV[1]) end
  end
end
return 1
";

/// Every command of a request must answer within this (the node's callout
/// timeout is longer).
pub(super) const RESPONSE_TIMEOUT: Duration = Duration::from_millis(250);

pub struct RedisStore {
    client: Client,
    conn: OnceCell<ConnectionManager>,
    names: Names,
}

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

/// One record of a sweep ([`Store::update_keys`]), read as `value`:
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

/// The sweep's loop ([`Store::update_keys`] on `records`), one record's
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

/// The one Redis's side of a [`sweep`]: each pass one pipeline.
struct OneRedis {
    conn: ConnectionManager,
}

#[async_trait]
impl SweepIo for OneRedis {
    async fn read(
        &mut self,
        records: &[String],
        pending: &[usize],
    ) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let mut read = redis::pipe();
        for &i in pending {
            read.cmd("GET").arg(&records[i]);
        }
        read.query_async(&mut self.conn).await.map_err(map_err)
    }

    async fn write(&mut self, _records: &[String], writes: Vec<SweptWrite>) -> Result<Vec<bool>, StoreError> {
        let mut pipe = redis::pipe();
        for w in writes {
            pipe.add_command(w.script);
        }
        let results: Vec<i64> = pipe.query_async(&mut self.conn).await.map_err(map_err)?;
        Ok(results.into_iter().map(|ok| ok == 1).collect())
    }
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

impl RedisStore {
    /// A store on `url` (`redis://host:port[/db]`). Connects on first use,
    /// so a service starts (not ready) while Redis is down.
    pub fn new(url: &str, prefix: &str) -> Result<RedisStore, StoreError> {
        let client = client(url)?;
        Ok(RedisStore {
            client,
            conn: OnceCell::new(),
            names: Names::new(prefix),
        })
    }

    /// A node's session record (its version and value) and the number of
    /// sessions, in one round trip.
    async fn read_session(
        &self,
        conn: &mut ConnectionManager,
        record: &str,
    ) -> Result<(Version, Option<Session>, u64), StoreError> {
        let (value, count): (Option<Vec<u8>>, u64) = redis::pipe()
            .cmd("GET")
            .arg(record)
            .cmd("SCARD")
            .arg(self.names.nodes_set())
            .query_async(conn)
            .await
            .map_err(map_err)?;
        let (version, bytes) = split_value(record, value)?;
        let session = bytes.map(|b| decode(record, &b)).transpose()?;
        Ok((version, session, count))
    }

    async fn conn(&self) -> Result<ConnectionManager, StoreError> {
        connection(&self.client, &self.conn).await
    }

    /// Every (key, limit) record's name, by `SCAN` (a batch at a time).
    async fn scan_keys(&self, conn: &mut ConnectionManager) -> Result<Vec<String>, StoreError> {
        let pattern = self.names.key_pattern();
        let mut out = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, names): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(conn)
                .await
                .map_err(map_err)?;
            out.extend(names);
            if next == 0 {
                return Ok(out);
            }
            cursor = next;
        }
    }
}

/// The client of `url` with TCP_NODELAY on its connections (redis-rs
/// leaves it off): a script's reply that spans two segments would
/// otherwise wait for Redis's delayed ACK, about 40 ms. The store's and the
/// RLS counters' one way to open a client.
pub(crate) fn client(url: &str) -> Result<Client, StoreError> {
    use redis::IntoConnectionInfo;
    let info = url
        .into_connection_info()
        .map_err(|e| StoreError::Refused(format!("{url}: {e}")))?
        .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
    Client::open(info).map_err(|e| StoreError::Refused(format!("{url}: {e}")))
}

/// The shared connection to `client`, made on first use with the service's
/// Redis settings (a 250 ms response and connect timeout, one retry): the
/// store's and the RLS counters' one way to connect.
pub(crate) async fn connection(
    client: &redis::Client,
    cell: &OnceCell<ConnectionManager>,
) -> Result<ConnectionManager, StoreError> {
    let conn = cell
        .get_or_try_init(|| async {
            let cfg = ConnectionManagerConfig::new()
                .set_response_timeout(Some(RESPONSE_TIMEOUT))
                .set_connection_timeout(Some(RESPONSE_TIMEOUT))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(500));
            client
                .get_connection_manager_with_config(cfg)
                .await
                .map_err(map_err)
        })
        .await?;
    Ok(conn.clone())
}

/// A Lua script run by its SHA1 (`EVALSHA`): its text crosses the network
/// only to load it (`SCRIPT LOAD`, whose answer is the SHA1): on its first
/// use in the process, and when Redis answers `NOSCRIPT` (a server that
/// restarted, a `SCRIPT FLUSH`, another server behind the URL), after
/// which [`run_script`] runs it again, once.
pub(crate) struct Lua {
    text: &'static str,
    sha: std::sync::OnceLock<String>,
}

impl Lua {
    pub(crate) const fn new(text: &'static str) -> Lua {
        Lua {
            text,
            sha: std::sync::OnceLock::new(),
        }
    }

    /// Loads the script into Redis: its SHA1.
    async fn load(
        &self,
        conn: &mut ConnectionManager,
        trip: &mut (dyn FnMut(usize) + Send),
    ) -> Result<String, StoreError> {
        let loaded: Result<String, RedisError> = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(self.text)
            .query_async(conn)
            .await;
        trip(self.text.len());
        let sha = loaded.map_err(map_err)?;
        Ok(self.sha.get_or_init(|| sha).clone())
    }
}

/// Runs `lua` on `keys` with `args`; `trip` is told of each round trip
/// and the bytes of script text it sent (one `EVALSHA`, 0 bytes, once the
/// script is loaded).
pub(crate) async fn run_script<T: redis::FromRedisValue>(
    conn: &mut ConnectionManager,
    lua: &Lua,
    keys: &[String],
    args: &[&[u8]],
    trip: &mut (dyn FnMut(usize) + Send),
) -> Result<T, StoreError> {
    let sha = match lua.sha.get() {
        Some(sha) => sha.clone(),
        None => lua.load(conn, trip).await?,
    };
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha).arg(keys.len()).arg(keys);
    for a in args {
        cmd.arg(*a);
    }
    let first = cmd.query_async(conn).await;
    trip(0);
    match first {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            lua.load(conn, trip).await?;
            let again = cmd.query_async(conn).await;
            trip(0);
            again.map_err(map_err)
        }
        other => other.map_err(map_err),
    }
}

/// A Redis error as a store error: timeouts, lost or refused connections
/// and unrecoverable ones are transient, the rest a refusal.
pub(crate) fn map_err(e: RedisError) -> StoreError {
    if e.is_timeout() {
        StoreError::Timeout(e.to_string())
    } else if e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
    {
        StoreError::Unavailable(e.to_string())
    } else {
        StoreError::Refused(e.to_string())
    }
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

/// The sync request's loop ([`Store::update_request`] for `node`): read
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

/// The session's loop ([`Store::update_session`] for `node`): read it,
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

/// The one Redis's side of a [`request`]: the records read in one
/// pipeline, written with one [`CAS_ALL`].
struct OneRedisRequest<'a> {
    store: &'a RedisStore,
    conn: ConnectionManager,
}

#[async_trait]
impl RequestIo for OneRedisRequest<'_> {
    async fn read_session(&mut self, record: &str) -> Result<SessionRead, StoreError> {
        let (version, session, count) = self.store.read_session(&mut self.conn, record).await?;
        Ok(SessionRead {
            version,
            session,
            count,
        })
    }

    async fn read(&mut self, records: &[String]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let mut read = redis::pipe();
        for r in records {
            read.cmd("GET").arg(r);
        }
        read.query_async(&mut self.conn).await.map_err(map_err)
    }

    async fn write_session(
        &mut self,
        node: &str,
        record: &str,
        write: SessionWrite,
    ) -> Result<Option<u64>, StoreError> {
        let (version, count) = (write.version, write.count);
        let Some(session) = write.slot else {
            let Some(v) = version else {
                return Ok(Some(count));
            };
            // Deleted (expired).
            let mut pipe = redis::pipe();
            pipe.add_command(cas_del_cmd(record, v));
            pipe.cmd("SREM")
                .arg(self.store.names.nodes_set())
                .arg(node)
                .ignore();
            let (deleted,): (i64,) = pipe.query_async(&mut self.conn).await.map_err(map_err)?;
            return Ok((deleted == 1).then(|| count.saturating_sub(1)));
        };
        let mut pipe = redis::pipe();
        pipe.add_command(cas_cmd(record, version, next_value(record, version, &session)?));
        if write.created {
            pipe.cmd("SADD").arg(self.store.names.nodes_set()).arg(node);
            let (written, added): (i64, i64) = pipe.query_async(&mut self.conn).await.map_err(map_err)?;
            Ok((written == 1).then(|| count.saturating_add(u64::try_from(added).unwrap_or(0))))
        } else {
            let (written,): (i64,) = pipe.query_async(&mut self.conn).await.map_err(map_err)?;
            Ok((written == 1).then_some(count))
        }
    }

    async fn write(&mut self, stepped: Stepped<'_>) -> Result<Option<u64>, StoreError> {
        let Stepped {
            node,
            record,
            read,
            write_session,
            records,
            versions,
            slots,
        } = stepped;
        let mut script = redis::cmd("EVAL");
        script.arg(CAS_ALL).arg(records.len() + 2);
        script.arg(self.store.names.nodes_set()).arg(record);
        for r in &records {
            script.arg(r);
        }
        script.arg(node);
        let (session_op, after) = session_op(write_session, &read.session, record, read.version, read.count)?;
        push_op(&mut script, read.version, session_op);
        for ((slot, r), v) in slots.iter().zip(&records).zip(&versions) {
            let op = match (slot.write, &slot.record, v) {
                (false, _, _) | (true, None, None) => Op::Check,
                (true, Some(ks), None) => Op::Create(next_value(r, *v, ks)?),
                (true, Some(ks), Some(_)) => Op::Write(next_value(r, *v, ks)?),
                (true, None, Some(_)) => Op::Delete,
            };
            push_op(&mut script, *v, op);
        }
        let written: i64 = script.query_async(&mut self.conn).await.map_err(map_err)?;
        Ok((written == 1).then_some(after))
    }
}

/// The [`CAS_DEL`] of `record` at `version`.
fn cas_del_cmd(record: &str, version: u64) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(CAS_DEL)
        .arg(1)
        .arg(record)
        .arg(version_arg(Some(version)));
    cmd
}

/// The [`CAS`] that writes `value` to `record` if still at `version`.
fn cas_cmd(record: &str, version: Version, value: Vec<u8>) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(CAS)
        .arg(1)
        .arg(record)
        .arg(version_arg(version))
        .arg(value);
    cmd
}

/// What [`CAS_ALL`] does to one record.
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

#[async_trait]
impl Store for RedisStore {
    fn kind(&self) -> &'static str {
        "redis"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        let _: String = redis::cmd("PING").query_async(&mut conn).await.map_err(map_err)?;
        Ok(())
    }

    async fn update_session(&self, node: &str, f: &mut SessionUpdate<'_>) -> Result<u64, StoreError> {
        let mut io = OneRedisRequest {
            store: self,
            conn: self.conn().await?,
        };
        session(&mut io, &self.names, node, f).await
    }

    async fn update_request(&self, node: &str, txn: &mut (dyn Txn + '_)) -> Result<u64, StoreError> {
        let mut io = OneRedisRequest {
            store: self,
            conn: self.conn().await?,
        };
        request(&mut io, &self.names, node, txn).await
    }

    async fn update_keys(&self, ids: &[KeyId], f: &mut KeyUpdate<'_>) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let records: Vec<String> = ids.iter().map(|id| self.names.key_record(id)).collect();
        let mut io = OneRedis {
            conn: self.conn().await?,
        };
        sweep(&mut io, &records, f).await
    }

    async fn key_ids(&self) -> Result<Vec<KeyId>, StoreError> {
        let mut conn = self.conn().await?;
        let names = self.scan_keys(&mut conn).await?;
        Ok(names.iter().filter_map(|n| self.names.key_of_record(n)).collect())
    }

    async fn session_ids(&self) -> Result<Vec<String>, StoreError> {
        let mut conn = self.conn().await?;
        redis::cmd("SMEMBERS")
            .arg(self.names.nodes_set())
            .query_async(&mut conn)
            .await
            .map_err(map_err)
    }

    async fn session_count(&self) -> Result<u64, StoreError> {
        let mut conn = self.conn().await?;
        redis::cmd("SCARD")
            .arg(self.names.nodes_set())
            .query_async(&mut conn)
            .await
            .map_err(map_err)
    }

    /// By `SCAN` (see the module header): linear in the records, for the
    /// metrics' scrape.
    async fn key_count(&self) -> Result<u64, StoreError> {
        let mut conn = self.conn().await?;
        Ok(self.scan_keys(&mut conn).await?.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_names_round_trip_even_with_braces_in_the_key() {
        let s = Names::new("tg");
        for key in ["tenant-a|orders", "we}:ird{|x", ""] {
            let id = (key.to_owned(), "per-min".to_owned());
            assert_eq!(s.key_of_record(&s.key_record(&id)), Some(id));
        }
        assert_eq!(s.key_record(&("t|a".into(), "l".into())), "tg:{t|a}:l");
        for node in ["n1", "we}ird{"] {
            assert_eq!(s.node_of_session(&s.session_record(node)).as_deref(), Some(node));
        }
    }

    #[test]
    fn transient_errors_are_marked() {
        assert!(StoreError::Unavailable("x".into()).is_transient());
        assert!(StoreError::Contention {
            record: "r".into(),
            attempts: 16
        }
        .is_transient());
        assert!(!StoreError::Refused("x".into()).is_transient());
    }
}
