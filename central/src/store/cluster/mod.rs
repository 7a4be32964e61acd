//! The Redis Cluster store: the Redis store's records spread over the
//! masters of a Redis Cluster, for a platform that outgrew one Redis.
//!
//! # Layout
//! The records and their encoding are the Redis store's
//! ([`super::redis`]): `<prefix>:{<key>}:<limit>` for a (key, limit), so
//! the hash tag keeps every limit of one sync key in **one slot**, and
//! `<prefix>:n:{<node>}` for a node's session (a slot of its own). There is
//! no index at all: no set of nodes, no set of records. The sweep, the
//! sessions' expiry and the gauges find records with `SCAN` on every master
//! (a master at a time, found by `CLUSTER SLOTS`: [`SlotMap`]).
//!
//! # A request: one script per slot, each atomic and idempotent
//! A sync request's records span many slots, so it cannot be one
//! transaction. It is read (the session, then every record with one `MGET`
//! per slot), computed in Rust with the allocator's steps, and written with
//! **one Lua script per slot** ([`CAS_SLOT`]), which checks that every
//! record of its slot is still at the version read and only then writes
//! them; the session is written last, by the same script on its own slot.
//! The reads, and then the scripts, travel as **one pipeline per master**
//! (all masters at once): a request of 100 keys on three masters is three
//! pipelines of reads and three of scripts, not 100 of each. Each script is atomic on its own; the
//! request as a whole is not. What keeps the accounting exact is that
//! every (key, limit) record deduplicates its own node's counts (the
//! node's last applied `seq`, its base and what the record counted since:
//! `alloc::session`'s header): a record that applied a request counts
//! nothing when the same request (or an older one) reaches it again, and a
//! record that missed it counts the node's next report, which carries the
//! same counts, whole. So whichever scripts of a request land:
//! * all of them: the request is answered;
//! * some (another replica moved a record: a version conflict): the whole
//!   request runs again on fresh reads, at most [`MAX_ATTEMPTS`](super::cas::MAX_ATTEMPTS) times; the
//!   records that landed see their own `seq` again and count nothing (they
//!   grant the node's lease again, from what they hold, which is what the
//!   answer then carries);
//! * some, then an error (a master down, a timeout): the node gets `503`,
//!   and its next report (the same counts since its acknowledged base) is
//!   counted once by every record, landed or not (tested with a master
//!   killed mid-run, `central/tests/service.rs`).
//!
//! A record's scripts never answer for a lease that is not written: a
//! lease is answered only from the run in which every slot landed, and a
//! grant written in a run that is not answered only reserves more for the
//! node than it holds (conservative; reclaimed at its next acknowledged
//! report, as for any lost answer).
//!
//! # Acknowledged means replicated
//! Redis replicates asynchronously: a master that fails right after a
//! write can lose it to the replica that takes over. So each master's
//! pipeline of scripts ends with `WAIT <replicas> <timeout>` on the same
//! connection (the timeout [`WAIT_MS`] by default, `?wait_ms=N`), which
//! waits for every write before it on that connection; the request is
//! answered only when every master's `WAIT` reports the writes on
//! `replicas` replicas (`?replicas=N` in the URL, 1 by default; 0 for a
//! cluster without replicas, which gives this up). A master whose `WAIT` falls short fails the request (`503`): its
//! writes may or may not survive a failover, and either way the node's
//! retry counts them once. A run of a request that follows one whose
//! writes landed writes every record it visits again (its `Duplicate`
//! steps too), so its own `WAIT` covers the earlier writes: a master
//! replicates its writes in order. With one replica per master, the replica that
//! acknowledged is the one a failover promotes; with more, set `replicas`
//! to their number (Redis Cluster prefers the replica with the most data,
//! but does not promise it).
//!
//! # Redirections and failover
//! The client (`redis::cluster_async`) routes each pipeline by its first
//! slot with its own slot map, follows `MOVED` and `ASK` for it, refreshes
//! its map, and retries a command whose connection broke. A retried script
//! whose first try ran finds its own version: a conflict, and the
//! request's next run counts nothing twice. Which slots share a pipeline
//! comes from this store's [`SlotMap`]: a slot that moved to another
//! master since it was read answers `MOVED` inside the pipeline, which
//! fails the request (`503`) and drops the map, read again by the next
//! request. A slot whose master is down answers errors until its replica
//! is promoted (`cluster-node-timeout` plus an election): those requests
//! answer `503` and nothing is lost.
//!
//! # Sessions counted approximately
//! With no set of nodes, the session count (the session cap, and the
//! allocator's node count hint) is the last `SCAN`'s count plus the
//! sessions this replica created since; the sweep `SCAN`s every interval.
//! So `--max-sessions` may be passed by what the replicas create within one
//! interval.
//!
//! Files: this one holds the store and its side of the update loops (the
//! loops of a request and of a sweep are the Redis store's, run over this
//! store's reads and writes: `super::cas::{request, session, sweep}`); `slots.rs` where
//! a record lives (hash slots, the slot map, the cluster's errors);
//! `spec.rs` the URL.

mod slots;
mod spec;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::try_join_all;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::Value;
use tokio::sync::OnceCell;

use super::cas::{
    next_value, push_op, request, session, session_op, split_value, sweep, Names, Op, RequestIo, SessionRead,
    SessionWrite, Stepped, SweepIo, SweptWrite, Version,
};
use super::redis::RESPONSE_TIMEOUT;
use super::{decode, KeyUpdate, SessionUpdate, Store, StoreError, Txn};
use crate::alloc::{KeyId, Session};

use self::slots::*;
pub use self::spec::{ClusterSpec, MAX_WAIT_MS, WAIT_MS};

/// `SCAN`'s batch.
const SCAN_COUNT: u64 = 1_000;

/// The writes of one slot, all or nothing: `KEYS` the slot's records;
/// three `ARGV` per record: expected version ("" when absent), operation
/// (`c` create, `w` write, `d` delete, `-` only check), new value (its
/// version first). Every version is checked before anything is written.
/// Returns 1 if written, 0 if a version moved.
const CAS_SLOT: &str = r"
for i = 1, #KEYS do
  local r = redis.call('GET', KEYS[i])
  if (r and string.sub(r, 1, 8) or '') ~= ARGV[(i - 1) * 3 + 1] then return 0 end
end
for i = 1, #KEYS do
  local op = ARGV[(i - 1) * 3 + 2]
  if op == 'c' or op == 'w' then
    redis.call('SET', KEYS[i], ARGV[(i - 1) * 3 + 3])
  elseif op == 'd' then
    redis.call('DEL', KEYS[i])
  end
end
return 1
";

pub struct RedisClusterStore {
    client: ClusterClient,
    conn: OnceCell<ClusterConnection>,
    names: Names,
    replicas: u64,
    wait_ms: u64,
    /// Sessions at the last `SCAN`, plus those this replica created since.
    sessions: AtomicU64,
    /// Which master serves each slot (`None`: read it again).
    map: Mutex<Option<Arc<SlotMap>>>,
}

impl RedisClusterStore {
    /// A store on the cluster `url` names (see [`ClusterSpec::parse`]).
    /// Connects on first use, so a service starts (not ready) while the
    /// cluster is down.
    pub fn new(url: &str, prefix: &str) -> Result<RedisClusterStore, StoreError> {
        let spec = ClusterSpec::parse(url).map_err(StoreError::Refused)?;
        RedisClusterStore::with_spec(&spec, prefix)
    }

    pub fn with_spec(spec: &ClusterSpec, prefix: &str) -> Result<RedisClusterStore, StoreError> {
        let client = ClusterClient::builder(spec.nodes.clone())
            .connection_timeout(RESPONSE_TIMEOUT)
            .response_timeout(RESPONSE_TIMEOUT.saturating_add(Duration::from_millis(spec.wait_ms)))
            .retries(4)
            // As for the single-node client: replies never wait for a delayed ACK.
            .tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true))
            .min_retry_wait(10)
            .max_retry_wait(100)
            .build()
            .map_err(|e| StoreError::Refused(format!("{:?}: {e}", spec.nodes)))?;
        Ok(RedisClusterStore {
            client,
            conn: OnceCell::new(),
            names: Names::new(prefix),
            replicas: spec.replicas,
            wait_ms: spec.wait_ms,
            sessions: AtomicU64::new(0),
            map: Mutex::new(None),
        })
    }

    async fn conn(&self) -> Result<ClusterConnection, StoreError> {
        let conn = self
            .conn
            .get_or_try_init(|| async { self.client.get_async_connection().await.map_err(cluster_err) })
            .await?;
        Ok(conn.clone())
    }

    /// One slot's writes and, on the same connection right after, the
    /// `WAIT` for its replicas: `Ok(true)` written and replicated,
    /// `Ok(false)` a version moved (nothing written).
    async fn write_slot(&self, mut conn: ClusterConnection, script: redis::Cmd) -> Result<bool, StoreError> {
        let mut pipe = redis::pipe();
        pipe.add_command(script);
        if self.replicas == 0 {
            let (written,): (i64,) = pipe.query_async(&mut conn).await.map_err(cluster_err)?;
            return Ok(written == 1);
        }
        pipe.cmd("WAIT").arg(self.replicas).arg(self.wait_ms);
        let (written, acked): (i64, u64) = pipe.query_async(&mut conn).await.map_err(cluster_err)?;
        if written == 1 && acked < self.replicas {
            return Err(StoreError::Unavailable(format!(
                "a write reached {acked} of {} replicas within {} ms",
                self.replicas, self.wait_ms
            )));
        }
        Ok(written == 1)
    }

    /// The slot map (read now if this replica has none).
    async fn slot_map(&self, conn: &mut ClusterConnection) -> Result<Arc<SlotMap>, StoreError> {
        if let Some(map) = self.map.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Ok(map);
        }
        let v = conn
            .route_command(
                redis::cmd("CLUSTER").arg("SLOTS").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary),
            )
            .await
            .map_err(cluster_err)?;
        let map = Arc::new(SlotMap::parse(v)?);
        *self.map.lock().unwrap_or_else(|e| e.into_inner()) = Some(map.clone());
        Ok(map)
    }

    /// Drops the slot map, so the next request reads it again.
    fn forget_map(&self) {
        *self.map.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// One pipeline to the master that serves `slot`: every reply, in
    /// order (an error reply is the caller's to type). Any failure drops
    /// the slot map.
    async fn pipeline(
        &self,
        mut conn: ClusterConnection,
        slot: u16,
        pipe: redis::Pipeline,
        count: usize,
    ) -> Result<Vec<Value>, StoreError> {
        let replies = conn
            .route_pipeline(pipe, 0, count, to_master(slot))
            .await
            .map_err(cluster_err);
        if replies.as_ref().map_or(true, |r| r.len() != count) {
            self.forget_map();
        }
        let replies = replies?;
        if replies.len() != count {
            return Err(StoreError::Refused(format!(
                "a pipeline of {count} commands answered {}",
                replies.len()
            )));
        }
        Ok(replies)
    }

    /// The records' values (in `records`' order): one `MGET` per slot, one
    /// pipeline per master, all masters at once.
    async fn read(
        &self,
        conn: &ClusterConnection,
        map: &SlotMap,
        records: &[String],
        groups: &[Group],
    ) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let batches = map.batches(groups);
        let reads = batches.iter().filter_map(|batch| {
            let first = groups.get(*batch.first()?)?.slot;
            let mut pipe = redis::pipe();
            for g in batch.iter().filter_map(|&g| groups.get(g)) {
                pipe.cmd("MGET");
                for &i in &g.members {
                    pipe.arg(&records[i]);
                }
            }
            Some(self.pipeline(conn.clone(), first, pipe, batch.len()))
        });
        let mut out: Vec<Option<Vec<u8>>> = vec![None; records.len()];
        for (batch, replies) in batches.iter().zip(try_join_all(reads).await?) {
            for (&g, v) in batch.iter().zip(replies) {
                let rows: Vec<Option<Vec<u8>>> = reply(v).inspect_err(|_| self.forget_map())?;
                let members = groups.get(g).map_or(&[][..], |g| &g.members[..]);
                if rows.len() != members.len() {
                    return Err(StoreError::Refused(format!(
                        "MGET of {} records answered {}",
                        members.len(),
                        rows.len()
                    )));
                }
                for (&i, row) in members.iter().zip(rows) {
                    out[i] = row;
                }
            }
        }
        Ok(out)
    }

    /// Every slot's script of a request, one pipeline per master (all
    /// masters at once), each closed by `WAIT` for `replicas` (see the
    /// module header): `Ok(true)` every script wrote and every write is
    /// replicated, `Ok(false)` some version moved (the scripts that found
    /// theirs wrote, replicated or not).
    async fn write_slots(
        &self,
        conn: &ClusterConnection,
        map: &SlotMap,
        groups: &[Group],
        scripts: Vec<Option<redis::Cmd>>,
    ) -> Result<bool, StoreError> {
        let mut scripts = scripts;
        let runs = map.batches(groups).into_iter().filter_map(|batch| {
            let mut pipe = redis::pipe();
            let mut first = None;
            let mut count = 0;
            for g in batch {
                if let (Some(group), Some(script)) =
                    (groups.get(g), scripts.get_mut(g).and_then(Option::take))
                {
                    first.get_or_insert(group.slot);
                    pipe.add_command(script);
                    count += 1;
                }
            }
            let first = first?;
            if self.replicas > 0 {
                pipe.cmd("WAIT").arg(self.replicas).arg(self.wait_ms);
            }
            let total = count + usize::from(self.replicas > 0);
            Some(async move {
                let replies = self.pipeline(conn.clone(), first, pipe, total).await?;
                let mut landed = true;
                let mut wrote = false;
                for (n, v) in replies.into_iter().enumerate() {
                    if n < count {
                        let ok = reply::<i64>(v).inspect_err(|_| self.forget_map())? == 1;
                        landed &= ok;
                        wrote |= ok;
                    } else {
                        let acked: u64 = reply(v)?;
                        if wrote && acked < self.replicas {
                            return Err(StoreError::Unavailable(format!(
                                "a write reached {acked} of {} replicas within {} ms",
                                self.replicas, self.wait_ms
                            )));
                        }
                    }
                }
                Ok::<_, StoreError>(landed)
            })
        });
        Ok(try_join_all(runs).await?.into_iter().all(|landed| landed))
    }

    /// Every record name matching `pattern`, by `SCAN` on every master.
    async fn scan(&self, pattern: &str) -> Result<Vec<String>, StoreError> {
        let mut conn = self.conn().await?;
        let mut out = Vec::new();
        // A fresh map: a master that gives its slots away during a scan
        // makes that scan miss or repeat records; the sweep and the gauges
        // run every interval, so the next one sees them.
        self.forget_map();
        let map = self.slot_map(&mut conn).await?;
        for &slot in &map.masters {
            let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
                slot,
                SlotAddr::Master,
            )));
            let mut cursor: u64 = 0;
            loop {
                let v = conn
                    .route_command(
                        redis::cmd("SCAN")
                            .arg(cursor)
                            .arg("MATCH")
                            .arg(pattern)
                            .arg("COUNT")
                            .arg(SCAN_COUNT)
                            .clone(),
                        route.clone(),
                    )
                    .await
                    .map_err(cluster_err)?;
                let (next, names): (u64, Vec<String>) =
                    redis::from_redis_value(v).map_err(|e| StoreError::Refused(e.to_string()))?;
                out.extend(names);
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(out)
    }

    /// A session's version and value.
    async fn read_session(
        &self,
        conn: &mut ClusterConnection,
        record: &str,
    ) -> Result<(Version, Option<Session>), StoreError> {
        let value: Option<Vec<u8>> = redis::cmd("GET")
            .arg(record)
            .query_async(conn)
            .await
            .map_err(cluster_err)?;
        let (version, bytes) = split_value(record, value)?;
        Ok((version, bytes.map(|b| decode(record, &b)).transpose()?))
    }

    /// The script that writes one record (or only checks it).
    fn single(record: &str, version: Version, op: Op) -> redis::Cmd {
        let mut script = redis::cmd("EVAL");
        script.arg(CAS_SLOT).arg(1).arg(record);
        push_op(&mut script, version, op);
        script
    }
}

#[async_trait]
impl Store for RedisClusterStore {
    fn kind(&self) -> &'static str {
        "redis-cluster"
    }

    /// Every slot served (`cluster_state:ok`).
    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        let v = conn
            .route_command(
                redis::cmd("CLUSTER").arg("INFO").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary),
            )
            .await
            .map_err(cluster_err)?;
        let info: String = redis::from_redis_value(v).map_err(|e| StoreError::Refused(e.to_string()))?;
        if info.contains("cluster_state:ok") {
            Ok(())
        } else {
            Err(StoreError::Unavailable("cluster_state is not ok".to_owned()))
        }
    }

    async fn update_session(&self, node: &str, f: &mut SessionUpdate<'_>) -> Result<u64, StoreError> {
        let mut io = ClusterRequest {
            conn: self.conn().await?,
            store: self,
            layout: None,
        };
        session(&mut io, &self.names, node, f).await
    }

    async fn update_request(&self, node: &str, txn: &mut (dyn Txn + '_)) -> Result<u64, StoreError> {
        let mut io = ClusterRequest {
            conn: self.conn().await?,
            store: self,
            layout: None,
        };
        request(&mut io, &self.names, node, txn).await
    }

    async fn update_keys(&self, ids: &[KeyId], f: &mut KeyUpdate<'_>) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut io = ClusterSweep {
            conn: self.conn().await?,
            store: self,
        };
        let records: Vec<String> = ids.iter().map(|id| self.names.key_record(id)).collect();
        sweep(&mut io, &records, f).await
    }

    async fn key_ids(&self) -> Result<Vec<KeyId>, StoreError> {
        let names = self.scan(&self.names.key_pattern()).await?;
        Ok(names.iter().filter_map(|n| self.names.key_of_record(n)).collect())
    }

    async fn key_count(&self) -> Result<u64, StoreError> {
        Ok(self.scan(&self.names.key_pattern()).await?.len() as u64)
    }

    async fn session_ids(&self) -> Result<Vec<String>, StoreError> {
        let names = self.scan(&self.names.session_pattern()).await?;
        let nodes: Vec<String> = names
            .iter()
            .filter_map(|n| self.names.node_of_session(n))
            .collect();
        self.sessions.store(nodes.len() as u64, Relaxed);
        Ok(nodes)
    }

    async fn session_count(&self) -> Result<u64, StoreError> {
        let n = self.scan(&self.names.session_pattern()).await?.len() as u64;
        self.sessions.store(n, Relaxed);
        Ok(n)
    }
}

/// The cluster's side of a sweep ([`sweep`]): each pass reads with one
/// `MGET` per slot and writes each record's own compare-and-set, one
/// pipeline per master, all masters at once (the sweep's steps may run
/// again: no `WAIT`).
struct ClusterSweep<'a> {
    store: &'a RedisClusterStore,
    conn: ClusterConnection,
}

#[async_trait]
impl SweepIo for ClusterSweep<'_> {
    async fn read(
        &mut self,
        records: &[String],
        pending: &[usize],
    ) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let names: Vec<String> = pending.iter().map(|&i| records[i].clone()).collect();
        let groups = by_slot(&names);
        let map = self.store.slot_map(&mut self.conn).await?;
        self.store.read(&self.conn, &map, &names, &groups).await
    }

    async fn write(&mut self, records: &[String], writes: Vec<SweptWrite>) -> Result<Vec<bool>, StoreError> {
        let names: Vec<String> = writes.iter().map(|w| records[w.at].clone()).collect();
        let groups = by_slot(&names);
        let map = self.store.slot_map(&mut self.conn).await?;
        let mut scripts: Vec<Option<redis::Cmd>> = writes.into_iter().map(|w| Some(w.script)).collect();
        let mut runs = Vec::new();
        for batch in map.batches(&groups) {
            let mut pipe = redis::pipe();
            let mut members: Vec<usize> = Vec::new();
            let mut first = None;
            for g in batch.iter().filter_map(|&g| groups.get(g)) {
                for &k in &g.members {
                    if let Some(script) = scripts.get_mut(k).and_then(Option::take) {
                        pipe.add_command(script);
                        members.push(k);
                        first.get_or_insert(g.slot);
                    }
                }
            }
            if let Some(first) = first {
                let count = members.len();
                let run = self.store.pipeline(self.conn.clone(), first, pipe, count);
                runs.push(async move { Ok::<_, StoreError>((members, run.await?)) });
            }
        }
        let mut landed = vec![false; names.len()];
        for (members, replies) in try_join_all(runs).await? {
            for (k, v) in members.into_iter().zip(replies) {
                let ok = reply::<i64>(v).inspect_err(|_| self.store.forget_map())? == 1;
                if let Some(l) = landed.get_mut(k) {
                    *l = ok;
                }
            }
        }
        Ok(landed)
    }
}

/// Where a request's records were read: the slot map then, and the
/// records by slot. Its write goes the same way.
struct Layout {
    map: Arc<SlotMap>,
    groups: Vec<Group>,
}

/// The cluster's side of a sync request ([`request`]): the records read
/// with one `MGET` per slot, written with one script per slot (one
/// pipeline per master), then the session.
struct ClusterRequest<'a> {
    store: &'a RedisClusterStore,
    conn: ClusterConnection,
    layout: Option<Layout>,
}

#[async_trait]
impl RequestIo for ClusterRequest<'_> {
    async fn read_session(&mut self, record: &str) -> Result<SessionRead, StoreError> {
        let (version, session) = self.store.read_session(&mut self.conn, record).await?;
        Ok(SessionRead {
            version,
            session,
            count: self.store.sessions.load(Relaxed),
        })
    }

    async fn read(&mut self, records: &[String]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let groups = by_slot(records);
        let map = self.store.slot_map(&mut self.conn).await?;
        let rows = self.store.read(&self.conn, &map, records, &groups).await?;
        self.layout = Some(Layout { map, groups });
        Ok(rows)
    }

    async fn write_session(
        &mut self,
        _node: &str,
        record: &str,
        write: SessionWrite,
    ) -> Result<Option<u64>, StoreError> {
        let (version, count, created) = (write.version, write.count, write.created);
        let (op, after) = match (&write.slot, version) {
            (None, None) => return Ok(Some(count)),
            (None, Some(_)) => (Op::Delete, count.saturating_sub(1)),
            (Some(s), _) => (
                Op::Write(next_value(record, version, s)?),
                count.saturating_add(u64::from(created)),
            ),
        };
        let single = RedisClusterStore::single(record, version, op);
        if !self.store.write_slot(self.conn.clone(), single).await? {
            return Ok(None);
        }
        self.store.sessions.store(after, Relaxed);
        Ok(Some(after))
    }

    async fn write(&mut self, stepped: Stepped<'_>) -> Result<Option<u64>, StoreError> {
        let Some(Layout { map, groups }) = self.layout.take() else {
            return Err(StoreError::Refused(
                "a request written before it was read".to_owned(),
            ));
        };
        let Stepped {
            record,
            read,
            write_session,
            records,
            versions,
            slots,
            ..
        } = stepped;
        // The records, one script per slot (a slot with nothing to
        // write needs no script: its records are not answered from
        // anything but what it holds), one pipeline per master.
        let mut scripts = Vec::with_capacity(groups.len());
        for g in &groups {
            let mut script = redis::cmd("EVAL");
            script.arg(CAS_SLOT).arg(g.members.len());
            for &i in &g.members {
                script.arg(&records[i]);
            }
            let mut writes = false;
            for &i in &g.members {
                let (slot, r, v) = (&slots[i], &records[i], versions[i]);
                let op = match (slot.write, &slot.record, v) {
                    (false, _, _) | (true, None, None) => Op::Check,
                    (true, Some(ks), _) => Op::Write(next_value(r, v, ks)?),
                    (true, None, Some(_)) => Op::Delete,
                };
                writes |= !matches!(op, Op::Check);
                push_op(&mut script, v, op);
            }
            scripts.push(writes.then_some(script));
        }
        if !self.store.write_slots(&self.conn, &map, &groups, scripts).await? {
            // Another replica moved a record: run it all again (the
            // slots that landed count nothing twice).
            return Ok(None);
        }

        // The session last.
        let (op, after) = session_op(write_session, &read.session, record, read.version, read.count)?;
        if matches!(op, Op::Check) {
            return Ok(Some(after));
        }
        let single = RedisClusterStore::single(record, read.version, op);
        if !self.store.write_slot(self.conn.clone(), single).await? {
            return Ok(None);
        }
        if after > read.count {
            self.store.sessions.fetch_add(1, Relaxed);
        }
        Ok(Some(after))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_names_its_seeds_and_replicas() {
        let s = ClusterSpec::parse("redis+cluster://127.0.0.1:7000,127.0.0.1:7001/?replicas=2").unwrap();
        assert_eq!(s.nodes, vec!["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]);
        assert_eq!(s.replicas, 2);
        let s = ClusterSpec::parse("redis+cluster://u:p@h1:1,h2:2").unwrap();
        assert_eq!(s.nodes, vec!["redis://u:p@h1:1", "redis://u:p@h2:2"]);
        assert_eq!(s.replicas, 1);
        assert_eq!(s.wait_ms, WAIT_MS);
        let s = ClusterSpec::parse("redis+cluster://h:1?replicas=1&wait_ms=1000").unwrap();
        assert_eq!((s.replicas, s.wait_ms), (1, 1000));
        for bad in [
            "redis+cluster://h:1?wait_ms=0",
            "redis+cluster://h:1?wait_ms=1001",
            "redis+cluster://h:1?wait_ms=x",
            "redis://h:1",
            "redis+cluster://h",
            "redis+cluster://h:1?replicas=x",
            "redis+cluster://h:1?wait=1",
        ] {
            assert!(ClusterSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_limit_of_a_key_shares_its_slot_and_sessions_spread() {
        let names = Names::new("tg");
        let a = slot_of(&names.key_record(&("t|orders".into(), "per-min".into())));
        let b = slot_of(&names.key_record(&("t|orders".into(), "per-day".into())));
        assert_eq!(a, b);
        // The slot is CRC16 of the hash tag: `{t|orders}`'s.
        assert_eq!(a, slot_of("{t|orders}"));
        assert_ne!(
            slot_of(&names.session_record("n1")),
            slot_of(&names.session_record("n2"))
        );
        // Redis Cluster's own rule, as the client computes it (an empty
        // tag, a tag never closed, braces in the key).
        for key in [
            "tg:{t|orders}:per-min",
            "foo",
            "{}x",
            "a{b",
            "x{}{y}",
            "{{a}}",
            "tg:{we}:ird{|x}:l",
            "",
        ] {
            assert_eq!(
                Route::new(slot_of(key), SlotAddr::Master),
                Route::with_slot(redis::cluster_routing::Slot::for_key(key), SlotAddr::Master),
                "{key}"
            );
        }
        // `CLUSTER SLOTS`' ranges grouped by master.
        let node = |port: i64| Value::Array(vec![Value::BulkString(b"127.0.0.1".to_vec()), Value::Int(port)]);
        let range = |a: i64, b: i64, port: i64| Value::Array(vec![Value::Int(a), Value::Int(b), node(port)]);
        let map = SlotMap::parse(Value::Array(vec![
            range(10_923, 16_383, 3),
            range(0, 5_460, 1),
            range(5_461, 10_922, 2),
            range(100, 99, 1),
        ]))
        .unwrap();
        assert_eq!(map.master(0), map.master(5_460));
        assert_ne!(map.master(5_460), map.master(5_461));
        assert_eq!(map.master(16_383), map.master(10_923));
        assert_eq!(map.masters.len(), 3);
        let groups: Vec<Group> = [0, 16_000, 1, 6_000, 11_000]
            .iter()
            .map(|&slot| Group {
                slot,
                members: vec![],
            })
            .collect();
        assert_eq!(map.batches(&groups), vec![vec![0, 2], vec![1, 4], vec![3]]);
        let records: Vec<String> = ["a", "b", "a"]
            .iter()
            .map(|k| names.key_record(&((*k).into(), "l".into())))
            .collect();
        let groups = by_slot(&records);
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].members, vec![0, 2]);
    }
}
