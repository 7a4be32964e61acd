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
//! use the per-record `CAS`: each of its steps may run again. The loops
//! (a request, a session update, a sweep) and the records' versions and
//! names are written once, in `cas.rs`, over how a store reads and writes
//! ([`RequestIo`], [`SweepIo`]): the Redis Cluster store runs the same
//! loops over its slots. The
//! allocation math stays in Rust (`crate::alloc`); the scripts know nothing
//! of it.

use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, RedisError};
use tokio::sync::OnceCell;

pub use super::cas::MAX_ATTEMPTS;
use super::cas::{
    cas_cmd, cas_del_cmd, next_value, push_op, request, session, session_op, split_value, sweep, Names, Op,
    RequestIo, SessionRead, SessionWrite, Stepped, SweepIo, SweptWrite, Version,
};
use super::{decode, KeyUpdate, SessionUpdate, Store, StoreError, Txn};
use crate::alloc::{KeyId, Session};

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
