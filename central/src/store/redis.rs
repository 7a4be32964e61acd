//! The Redis store: records shared by every service replica.
//!
//! # Layout
//! * `<prefix>:{<key>}:<limit>`: one (key, limit). The hash tag `{<key>}`
//!   keeps every limit of a key in one cluster slot.
//! * `<prefix>:n:{<node>}`: one node's session.
//! * `<prefix>:keys`, `<prefix>:nodes`: sets of the record names, for the
//!   timer's sweep and the metrics (kept with `SADD` after a record is
//!   created; they are indexes, not state).
//!
//! Each record is a hash `{v: version, d: bytes}` (see `store::encode`).
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
//! use the per-record [`CAS`]: each of its steps may run again. The
//! allocation math stays in Rust (`crate::alloc`); the scripts know nothing
//! of it.

use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, RedisError};
use tokio::sync::OnceCell;

use super::{decode, encode, KeySlot, KeyUpdate, SessionUpdate, Store, StoreError, Txn};
use crate::alloc::{KeyId, KeyState, Session};

/// Attempts of one record's compare-and-set before giving up.
pub const MAX_ATTEMPTS: u32 = 16;

/// `KEYS[1]` record; `ARGV` expected version ("" when absent), new version,
/// new bytes. Returns 1 if written, 0 if the version moved.
const CAS: &str = r"
local v = redis.call('HGET', KEYS[1], 'v')
if (v or '') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[2], 'd', ARGV[3])
return 1
";

/// `KEYS[1]` record; `ARGV[1]` expected version. Deletes the record if its
/// version is still that. Returns 1 if deleted, 0 if the version moved.
const CAS_DEL: &str = r"
local v = redis.call('HGET', KEYS[1], 'v')
if (v or '') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
";

/// One sync request's writes, all or nothing. `KEYS[1]` the nodes set,
/// `KEYS[2]` the keys set, then the records (session first). `ARGV`, five
/// per record: expected version ("" when absent), operation (`c` create,
/// `w` write, `d` delete, `-` only check), new version, new bytes, member
/// of its index set (`n|<node>` or `k|<record>`). Every version is checked
/// before anything is written; returns 1 if written, 0 if a version moved.
const CAS_ALL: &str = r"
local n = #KEYS - 2
for i = 1, n do
  local v = redis.call('HGET', KEYS[i + 2], 'v')
  if (v or '') ~= ARGV[(i - 1) * 5 + 1] then return 0 end
end
for i = 1, n do
  local b = (i - 1) * 5
  local op = ARGV[b + 2]
  local set = KEYS[2]
  local member = string.sub(ARGV[b + 5], 3)
  if string.sub(ARGV[b + 5], 1, 1) == 'n' then set = KEYS[1] end
  if op == 'c' or op == 'w' then
    redis.call('HSET', KEYS[i + 2], 'v', ARGV[b + 3], 'd', ARGV[b + 4])
    if op == 'c' then redis.call('SADD', set, member) end
  elseif op == 'd' then
    redis.call('DEL', KEYS[i + 2])
    redis.call('SREM', set, member)
  end
end
return 1
";

/// Every command of a request must answer within this (the node's callout
/// timeout is longer).
const RESPONSE_TIMEOUT: Duration = Duration::from_millis(250);

pub struct RedisStore {
    client: Client,
    conn: OnceCell<ConnectionManager>,
    prefix: String,
}

type Version = Option<u64>;

/// What a write did to a record (and so to the index sets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Created,
    Updated,
    Deleted,
}

impl RedisStore {
    /// A store on `url` (`redis://host:port[/db]`). Connects on first use,
    /// so a service starts (not ready) while Redis is down.
    pub fn new(url: &str, prefix: &str) -> Result<RedisStore, StoreError> {
        let client = Client::open(url).map_err(|e| StoreError::Refused(format!("{url}: {e}")))?;
        Ok(RedisStore {
            client,
            conn: OnceCell::new(),
            prefix: prefix.to_owned(),
        })
    }

    /// A node's session record (its version and value) and the number of
    /// sessions, in one round trip.
    async fn read_session(
        &self,
        conn: &mut ConnectionManager,
        record: &str,
    ) -> Result<(Version, Option<Session>, u64), StoreError> {
        let ((version, bytes), count): ((Version, Option<Vec<u8>>), u64) = redis::pipe()
            .cmd("HMGET")
            .arg(record)
            .arg("v")
            .arg("d")
            .cmd("SCARD")
            .arg(self.nodes_set())
            .query_async(conn)
            .await
            .map_err(map_err)?;
        let session = bytes.map(|b| decode(record, &b)).transpose()?;
        Ok((version, session, count))
    }

    async fn conn(&self) -> Result<ConnectionManager, StoreError> {
        let conn = self
            .conn
            .get_or_try_init(|| async {
                let cfg = ConnectionManagerConfig::new()
                    .set_response_timeout(Some(RESPONSE_TIMEOUT))
                    .set_connection_timeout(Some(RESPONSE_TIMEOUT))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(500));
                self.client
                    .get_connection_manager_with_config(cfg)
                    .await
                    .map_err(map_err)
            })
            .await?;
        Ok(conn.clone())
    }

    fn key_record(&self, id: &KeyId) -> String {
        format!("{}:{{{}}}:{}", self.prefix, id.0, id.1)
    }

    fn key_of_record(&self, record: &str) -> Option<KeyId> {
        // Limit names have no `}` or `:`, so the last `}:` ends the key.
        let rest = record.strip_prefix(&self.prefix)?.strip_prefix(":{")?;
        let (key, limit) = rest.rsplit_once("}:")?;
        Some((key.to_owned(), limit.to_owned()))
    }

    fn session_record(&self, node: &str) -> String {
        format!("{}:n:{{{node}}}", self.prefix)
    }

    fn keys_set(&self) -> String {
        format!("{}:keys", self.prefix)
    }

    fn nodes_set(&self) -> String {
        format!("{}:nodes", self.prefix)
    }
}

fn map_err(e: RedisError) -> StoreError {
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

fn cas_del_cmd(pipe: &mut redis::Pipeline, record: &str, version: u64) {
    pipe.cmd("EVAL")
        .arg(CAS_DEL)
        .arg(1)
        .arg(record)
        .arg(version.to_string());
}

fn cas_cmd(pipe: &mut redis::Pipeline, record: &str, version: Version, bytes: Vec<u8>) {
    let expected = version.map(|v| v.to_string()).unwrap_or_default();
    let next = version.unwrap_or(0) + 1;
    pipe.cmd("EVAL")
        .arg(CAS)
        .arg(1)
        .arg(record)
        .arg(expected)
        .arg(next)
        .arg(bytes);
}

/// What [`CAS_ALL`] does to one record.
enum Op {
    Check,
    Create(Vec<u8>),
    Write(Vec<u8>),
    Delete,
}

fn push_op(script: &mut redis::Cmd, version: Version, op: Op, member: &str) {
    let expected = version.map(|v| v.to_string()).unwrap_or_default();
    let next = (version.unwrap_or(0).saturating_add(1)).to_string();
    let (code, bytes) = match op {
        Op::Check => ("-", Vec::new()),
        Op::Create(b) => ("c", b),
        Op::Write(b) => ("w", b),
        Op::Delete => ("d", Vec::new()),
    };
    script.arg(expected).arg(code).arg(next).arg(bytes).arg(member);
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
        let mut conn = self.conn().await?;
        let record = self.session_record(node);
        for _ in 0..MAX_ATTEMPTS {
            let (version, mut slot, count) = self.read_session(&mut conn, &record).await?;
            let created = slot.is_none();
            if !f(&mut slot) {
                return Ok(count);
            }
            let Some(session) = slot else {
                let Some(v) = version else {
                    return Ok(count);
                };
                // Deleted (expired).
                let mut pipe = redis::pipe();
                cas_del_cmd(&mut pipe, &record, v);
                pipe.cmd("SREM").arg(self.nodes_set()).arg(node).ignore();
                let (deleted,): (i64,) = pipe.query_async(&mut conn).await.map_err(map_err)?;
                if deleted == 1 {
                    return Ok(count.saturating_sub(1));
                }
                continue;
            };
            let mut pipe = redis::pipe();
            cas_cmd(&mut pipe, &record, version, encode(&record, &session)?);
            if created {
                pipe.cmd("SADD").arg(self.nodes_set()).arg(node);
                let (written, added): (i64, i64) = pipe.query_async(&mut conn).await.map_err(map_err)?;
                if written == 1 {
                    return Ok(count.saturating_add(u64::try_from(added).unwrap_or(0)));
                }
            } else {
                let (written,): (i64,) = pipe.query_async(&mut conn).await.map_err(map_err)?;
                if written == 1 {
                    return Ok(count);
                }
            }
        }
        Err(StoreError::Contention {
            record,
            attempts: MAX_ATTEMPTS,
        })
    }

    async fn update_request(&self, node: &str, txn: &mut (dyn Txn + '_)) -> Result<u64, StoreError> {
        let mut conn = self.conn().await?;
        let record = self.session_record(node);
        for _ in 0..MAX_ATTEMPTS {
            let (version, mut session, count) = self.read_session(&mut conn, &record).await?;
            let Some(ids) = txn.begin(&mut session, count) else {
                return Ok(count);
            };
            let records: Vec<String> = ids.iter().map(|id| self.key_record(id)).collect();
            let rows: Vec<(Version, Option<Vec<u8>>)> = if records.is_empty() {
                Vec::new()
            } else {
                let mut read = redis::pipe();
                for r in &records {
                    read.cmd("HMGET").arg(r).arg("v").arg("d");
                }
                read.query_async(&mut conn).await.map_err(map_err)?
            };
            let mut versions: Vec<Version> = Vec::with_capacity(rows.len());
            let mut slots: Vec<KeySlot> = Vec::with_capacity(rows.len());
            for ((id, r), (v, b)) in ids.into_iter().zip(&records).zip(rows) {
                versions.push(v);
                slots.push(KeySlot {
                    record: b.map(|b| decode(r, &b)).transpose()?,
                    id,
                    write: false,
                });
            }
            let write_session = txn.apply(&mut session, &mut slots);

            let mut script = redis::cmd("EVAL");
            script.arg(CAS_ALL).arg(records.len() + 3);
            script.arg(self.nodes_set()).arg(self.keys_set()).arg(&record);
            for r in &records {
                script.arg(r);
            }
            let mut after = count;
            let session_op = match (write_session, &session, version) {
                (false, _, _) | (true, None, None) => Op::Check,
                (true, Some(s), None) => {
                    after = after.saturating_add(1);
                    Op::Create(encode(&record, s)?)
                }
                (true, Some(s), Some(_)) => Op::Write(encode(&record, s)?),
                (true, None, Some(_)) => {
                    after = after.saturating_sub(1);
                    Op::Delete
                }
            };
            push_op(&mut script, version, session_op, &format!("n|{node}"));
            for ((slot, r), v) in slots.iter().zip(&records).zip(&versions) {
                let op = match (slot.write, &slot.record, v) {
                    (false, _, _) | (true, None, None) => Op::Check,
                    (true, Some(ks), None) => Op::Create(encode(r, ks)?),
                    (true, Some(ks), Some(_)) => Op::Write(encode(r, ks)?),
                    (true, None, Some(_)) => Op::Delete,
                };
                push_op(&mut script, *v, op, &format!("k|{r}"));
            }
            let written: i64 = script.query_async(&mut conn).await.map_err(map_err)?;
            if written == 1 {
                return Ok(after);
            }
        }
        Err(StoreError::Contention {
            record,
            attempts: MAX_ATTEMPTS,
        })
    }

    async fn update_keys(&self, ids: &[KeyId], f: &mut KeyUpdate<'_>) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut conn = self.conn().await?;
        let records: Vec<String> = ids.iter().map(|id| self.key_record(id)).collect();
        let mut pending: Vec<usize> = (0..ids.len()).collect();
        for _ in 0..MAX_ATTEMPTS {
            let mut read = redis::pipe();
            for &i in &pending {
                read.cmd("HMGET").arg(&records[i]).arg("v").arg("d");
            }
            let rows: Vec<(Version, Option<Vec<u8>>)> = read.query_async(&mut conn).await.map_err(map_err)?;
            let mut write = redis::pipe();
            let mut written: Vec<(usize, Change)> = Vec::with_capacity(pending.len());
            for (&i, (version, bytes)) in pending.iter().zip(rows) {
                let mut slot: Option<KeyState> = bytes.map(|b| decode(&records[i], &b)).transpose()?;
                let created = slot.is_none();
                if !f(i, &mut slot) {
                    continue;
                }
                match (slot, version) {
                    (Some(ks), _) => {
                        cas_cmd(&mut write, &records[i], version, encode(&records[i], &ks)?);
                        written.push((i, if created { Change::Created } else { Change::Updated }));
                    }
                    (None, Some(v)) => {
                        cas_del_cmd(&mut write, &records[i], v);
                        written.push((i, Change::Deleted));
                    }
                    (None, None) => {}
                }
            }
            if written.is_empty() {
                return Ok(());
            }
            let results: Vec<i64> = write.query_async(&mut conn).await.map_err(map_err)?;
            let mut index = redis::pipe();
            let mut indexed = false;
            pending.clear();
            for ((i, change), ok) in written.into_iter().zip(results) {
                if ok != 1 {
                    pending.push(i);
                } else if change == Change::Created {
                    index.cmd("SADD").arg(self.keys_set()).arg(&records[i]).ignore();
                    indexed = true;
                } else if change == Change::Deleted {
                    index.cmd("SREM").arg(self.keys_set()).arg(&records[i]).ignore();
                    indexed = true;
                }
            }
            if indexed {
                let () = index.query_async(&mut conn).await.map_err(map_err)?;
            }
            if pending.is_empty() {
                return Ok(());
            }
        }
        Err(StoreError::Contention {
            record: pending.first().map(|&i| records[i].clone()).unwrap_or_default(),
            attempts: MAX_ATTEMPTS,
        })
    }

    async fn key_ids(&self) -> Result<Vec<KeyId>, StoreError> {
        let mut conn = self.conn().await?;
        let names: Vec<String> = redis::cmd("SMEMBERS")
            .arg(self.keys_set())
            .query_async(&mut conn)
            .await
            .map_err(map_err)?;
        Ok(names.iter().filter_map(|n| self.key_of_record(n)).collect())
    }

    async fn session_ids(&self) -> Result<Vec<String>, StoreError> {
        let mut conn = self.conn().await?;
        redis::cmd("SMEMBERS")
            .arg(self.nodes_set())
            .query_async(&mut conn)
            .await
            .map_err(map_err)
    }

    async fn session_count(&self) -> Result<u64, StoreError> {
        let mut conn = self.conn().await?;
        redis::cmd("SCARD")
            .arg(self.nodes_set())
            .query_async(&mut conn)
            .await
            .map_err(map_err)
    }

    async fn key_count(&self) -> Result<u64, StoreError> {
        let mut conn = self.conn().await?;
        redis::cmd("SCARD")
            .arg(self.keys_set())
            .query_async(&mut conn)
            .await
            .map_err(map_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_names_round_trip_even_with_braces_in_the_key() {
        let s = RedisStore::new("redis://127.0.0.1:1", "tg").unwrap();
        for key in ["tenant-a|orders", "we}:ird{|x", ""] {
            let id = (key.to_owned(), "per-min".to_owned());
            assert_eq!(s.key_of_record(&s.key_record(&id)), Some(id));
        }
        assert_eq!(s.key_record(&("t|a".into(), "l".into())), "tg:{t|a}:l");
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
