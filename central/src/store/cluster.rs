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
//! (a master at a time, [`RedisClusterStore::masters`]).
//!
//! # A request: one script per slot, each atomic and idempotent
//! A sync request's records span many slots, so it cannot be one
//! transaction. It is read (the session, then every record with one `MGET`
//! per slot, all slots at once), computed in Rust with the allocator's
//! steps, and written with **one Lua script per slot** ([`CAS_SLOT`]),
//! which checks that every record of its slot is still at the version
//! read and only then writes them; the session is written last, by the
//! same script on its own slot. Each script is atomic on its own; the
//! request as a whole is not. What keeps the accounting exact is that
//! every (key, limit) record deduplicates its own node's counts (the
//! node's last applied `seq`, its base and what the record counted since:
//! `alloc::session`'s header): a record that applied a request counts
//! nothing when the same request (or an older one) reaches it again, and a
//! record that missed it counts the node's next report, which carries the
//! same counts, whole. So whichever scripts of a request land:
//! * all of them: the request is answered;
//! * some (another replica moved a record: a version conflict): the whole
//!   request runs again on fresh reads, at most [`MAX_ATTEMPTS`] times; the
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
//! write can lose it to the replica that takes over. So each script is
//! sent in one pipeline with `WAIT <replicas> <timeout>` on the same
//! connection ([`WAIT_MS`]); the request is answered only when every slot's
//! `WAIT` reports the writes on `replicas` replicas (`?replicas=N` in the
//! URL, 1 by default; 0 for a cluster without replicas, which gives this
//! up). A slot whose `WAIT` falls short fails the request (`503`): its
//! writes may or may not survive a failover, and either way the node's
//! retry counts them once. With one replica per master, the replica that
//! acknowledged is the one a failover promotes; with more, set `replicas`
//! to their number (Redis Cluster prefers the replica with the most data,
//! but does not promise it).
//!
//! # Redirections and failover
//! The client (`redis::cluster_async`) follows `MOVED` and `ASK`, refreshes
//! its slot map, and retries a command whose connection broke. A retried
//! script whose first try ran finds its own version: a conflict, and the
//! request's next run counts nothing twice. A slot whose master is down
//! answers errors until its replica is promoted (`cluster-node-timeout`
//! plus an election): those requests answer `503` and nothing is lost.
//!
//! # Sessions counted approximately
//! With no set of nodes, the session count (the session cap, and the
//! allocator's node count hint) is the last `SCAN`'s count plus the
//! sessions this replica created since; the sweep `SCAN`s every interval.
//! So `--max-sessions` may be passed by what the replicas create within one
//! interval.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::try_join_all;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr};
use redis::Value;
use tokio::sync::OnceCell;

use super::redis::{
    cas_cmd, cas_del_cmd, map_err, next_value, push_op, split_value, Names, Op, Version, MAX_ATTEMPTS,
    RESPONSE_TIMEOUT,
};
use super::{decode, KeySlot, KeyUpdate, SessionUpdate, Store, StoreError, Txn};
use crate::alloc::{KeyId, KeyState, Session};

/// How long a script's `WAIT` waits for its replicas before the request
/// fails (`503`): well within the request's deadline.
pub const WAIT_MS: u64 = 100;

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

/// What `--store redis+cluster://…` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    /// Seed nodes, each `redis://[user:pass@]host:port`.
    pub nodes: Vec<String>,
    /// Replicas every write waits for (`WAIT`).
    pub replicas: u64,
}

impl ClusterSpec {
    /// Parses `redis+cluster://[user:pass@]host:port[,host:port…][/][?replicas=N]`.
    pub fn parse(url: &str) -> Result<ClusterSpec, String> {
        let bad =
            |why: &str| format!("{url}: {why} (expected redis+cluster://host:port,host:port[?replicas=N])");
        let rest = url
            .strip_prefix("redis+cluster://")
            .ok_or_else(|| bad("not a redis+cluster:// URL"))?;
        let (hosts, query) = match rest.split_once('?') {
            Some((h, q)) => (h, Some(q)),
            None => (rest, None),
        };
        let hosts = hosts.strip_suffix('/').unwrap_or(hosts);
        let (auth, hosts) = match hosts.rsplit_once('@') {
            Some((a, h)) => (Some(a), h),
            None => (None, hosts),
        };
        let mut nodes = Vec::new();
        for h in hosts.split(',') {
            let valid = h
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !valid {
                return Err(bad(&format!("`{h}` is not host:port")));
            }
            nodes.push(match auth {
                Some(a) => format!("redis://{a}@{h}"),
                None => format!("redis://{h}"),
            });
        }
        let mut replicas = 1;
        for kv in query.into_iter().flat_map(|q| q.split('&')) {
            match kv.split_once('=') {
                Some(("replicas", n)) => {
                    replicas = n
                        .parse::<u64>()
                        .ok()
                        .filter(|n| *n <= 16)
                        .ok_or_else(|| bad("replicas must be 0 to 16"))?;
                }
                _ => return Err(bad(&format!("unknown parameter `{kv}`"))),
            }
        }
        Ok(ClusterSpec { nodes, replicas })
    }
}

pub struct RedisClusterStore {
    client: ClusterClient,
    conn: OnceCell<ClusterConnection>,
    names: Names,
    replicas: u64,
    /// Sessions at the last `SCAN`, plus those this replica created since.
    sessions: AtomicU64,
}

/// One slot's records of a request: their indexes in the request's order.
struct Group {
    members: Vec<usize>,
}

/// `records` grouped by slot (in the order each slot first appears).
fn by_slot(records: &[String]) -> Vec<Group> {
    let mut index: HashMap<Slot, usize> = HashMap::with_capacity(records.len());
    let mut groups: Vec<Group> = Vec::new();
    for (i, r) in records.iter().enumerate() {
        let g = *index.entry(Slot::for_key(r)).or_insert_with(|| {
            groups.push(Group { members: Vec::new() });
            groups.len() - 1
        });
        if let Some(g) = groups.get_mut(g) {
            g.members.push(i);
        }
    }
    groups
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
            .response_timeout(RESPONSE_TIMEOUT.saturating_add(Duration::from_millis(WAIT_MS)))
            .retries(4)
            .min_retry_wait(10)
            .max_retry_wait(100)
            .build()
            .map_err(|e| StoreError::Refused(format!("{:?}: {e}", spec.nodes)))?;
        Ok(RedisClusterStore {
            client,
            conn: OnceCell::new(),
            names: Names::new(prefix),
            replicas: spec.replicas,
            sessions: AtomicU64::new(0),
        })
    }

    async fn conn(&self) -> Result<ClusterConnection, StoreError> {
        let conn = self
            .conn
            .get_or_try_init(|| async { self.client.get_async_connection().await.map_err(map_err) })
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
            let (written,): (i64,) = pipe.query_async(&mut conn).await.map_err(map_err)?;
            return Ok(written == 1);
        }
        pipe.cmd("WAIT").arg(self.replicas).arg(WAIT_MS);
        let (written, acked): (i64, u64) = pipe.query_async(&mut conn).await.map_err(map_err)?;
        if written == 1 && acked < self.replicas {
            return Err(StoreError::Unavailable(format!(
                "a write reached {acked} of {} replicas within {WAIT_MS} ms",
                self.replicas
            )));
        }
        Ok(written == 1)
    }

    /// The records' values, one `MGET` per slot, all slots at once (in
    /// `records`' order).
    async fn read(
        &self,
        conn: &ClusterConnection,
        records: &[String],
        groups: &[Group],
    ) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let reads = groups.iter().map(|g| {
            let mut conn = conn.clone();
            let mut cmd = redis::cmd("MGET");
            for &i in &g.members {
                cmd.arg(&records[i]);
            }
            async move {
                let rows: Vec<Option<Vec<u8>>> = cmd.query_async(&mut conn).await.map_err(map_err)?;
                Ok::<_, StoreError>(rows)
            }
        });
        let mut out: Vec<Option<Vec<u8>>> = vec![None; records.len()];
        for (g, rows) in groups.iter().zip(try_join_all(reads).await?) {
            if rows.len() != g.members.len() {
                return Err(StoreError::Refused(format!(
                    "MGET of {} records answered {}",
                    g.members.len(),
                    rows.len()
                )));
            }
            for (&i, row) in g.members.iter().zip(rows) {
                out[i] = row;
            }
        }
        Ok(out)
    }

    /// One slot of every master (the lowest it serves), to route a `SCAN`
    /// to each master in turn. A master that gives its slots away during a
    /// scan makes that scan miss or repeat records: the sweep and the
    /// gauges run every interval, so the next one sees them.
    async fn masters(&self, conn: &mut ClusterConnection) -> Result<Vec<u16>, StoreError> {
        let v = conn
            .route_command(
                redis::cmd("CLUSTER").arg("SLOTS").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary),
            )
            .await
            .map_err(map_err)?;
        let Value::Array(ranges) = v else {
            return Err(StoreError::Refused(format!("CLUSTER SLOTS answered {v:?}")));
        };
        let mut by_master: BTreeMap<String, u16> = BTreeMap::new();
        for range in ranges {
            let Value::Array(fields) = range else { continue };
            let (Some(Value::Int(start)), Some(Value::Array(master))) = (fields.first(), fields.get(2))
            else {
                continue;
            };
            let id = format!("{:?}", master.get(..2));
            let start = u16::try_from(*start).unwrap_or(0);
            let slot = by_master.entry(id).or_insert(start);
            *slot = (*slot).min(start);
        }
        Ok(by_master.into_values().collect())
    }

    /// Every record name matching `pattern`, by `SCAN` on every master.
    async fn scan(&self, pattern: &str) -> Result<Vec<String>, StoreError> {
        let mut conn = self.conn().await?;
        let mut out = Vec::new();
        for slot in self.masters(&mut conn).await? {
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
                    .map_err(map_err)?;
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
            .map_err(map_err)?;
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
            .map_err(map_err)?;
        let info: String = redis::from_redis_value(v).map_err(|e| StoreError::Refused(e.to_string()))?;
        if info.contains("cluster_state:ok") {
            Ok(())
        } else {
            Err(StoreError::Unavailable("cluster_state is not ok".to_owned()))
        }
    }

    async fn update_session(&self, node: &str, f: &mut SessionUpdate<'_>) -> Result<u64, StoreError> {
        let mut conn = self.conn().await?;
        let record = self.names.session_record(node);
        for _ in 0..MAX_ATTEMPTS {
            let (version, mut slot) = self.read_session(&mut conn, &record).await?;
            let count = self.sessions.load(Relaxed);
            let created = slot.is_none();
            if !f(&mut slot) {
                return Ok(count);
            }
            let (op, after) = match (&slot, version) {
                (None, None) => return Ok(count),
                (None, Some(_)) => (Op::Delete, count.saturating_sub(1)),
                (Some(s), _) => (
                    Op::Write(next_value(&record, version, s)?),
                    count.saturating_add(u64::from(created)),
                ),
            };
            if self
                .write_slot(conn.clone(), Self::single(&record, version, op))
                .await?
            {
                self.sessions.store(after, Relaxed);
                return Ok(after);
            }
        }
        Err(StoreError::Contention {
            record,
            attempts: MAX_ATTEMPTS,
        })
    }

    async fn update_request(&self, node: &str, txn: &mut (dyn Txn + '_)) -> Result<u64, StoreError> {
        let mut conn = self.conn().await?;
        let record = self.names.session_record(node);
        for _ in 0..MAX_ATTEMPTS {
            let (version, mut session) = self.read_session(&mut conn, &record).await?;
            let count = self.sessions.load(Relaxed);
            let Some(ids) = txn.begin(&mut session, count) else {
                return Ok(count);
            };
            let records: Vec<String> = ids.iter().map(|id| self.names.key_record(id)).collect();
            let groups = by_slot(&records);
            let rows = self.read(&conn, &records, &groups).await?;
            let mut versions: Vec<Version> = Vec::with_capacity(rows.len());
            let mut slots: Vec<KeySlot> = Vec::with_capacity(rows.len());
            for ((id, r), value) in ids.into_iter().zip(&records).zip(rows) {
                let (v, b) = split_value(r, value)?;
                versions.push(v);
                slots.push(KeySlot {
                    record: b.map(|b| decode(r, &b)).transpose()?,
                    id,
                    write: false,
                });
            }
            let write_session = txn.apply(&mut session, &mut slots);

            // The records, one script per slot (a slot with nothing to
            // write needs no script: its records are not answered from
            // anything but what it holds).
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
                if writes {
                    scripts.push(self.write_slot(conn.clone(), script));
                }
            }
            let landed = try_join_all(scripts).await?;
            if landed.iter().any(|ok| !ok) {
                // Another replica moved a record: run it all again (the
                // slots that landed count nothing twice).
                continue;
            }

            // The session last.
            let (op, after) = match (write_session, &session, version) {
                (false, _, _) | (true, None, None) => (Op::Check, count),
                (true, Some(s), None) => (
                    Op::Create(next_value(&record, version, s)?),
                    count.saturating_add(1),
                ),
                (true, Some(s), Some(_)) => (Op::Write(next_value(&record, version, s)?), count),
                (true, None, Some(_)) => (Op::Delete, count.saturating_sub(1)),
            };
            if matches!(op, Op::Check) {
                return Ok(after);
            }
            if self
                .write_slot(conn.clone(), Self::single(&record, version, op))
                .await?
            {
                if after > count {
                    self.sessions.fetch_add(1, Relaxed);
                }
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
        let conn = self.conn().await?;
        let records: Vec<String> = ids.iter().map(|id| self.names.key_record(id)).collect();
        let mut pending: Vec<usize> = (0..ids.len()).collect();
        for _ in 0..MAX_ATTEMPTS {
            let names: Vec<String> = pending.iter().map(|&i| records[i].clone()).collect();
            let groups = by_slot(&names);
            let rows = self.read(&conn, &names, &groups).await?;
            // Each record's own compare-and-set, a slot's in one pipeline
            // (the sweep's steps may run again: no `WAIT`).
            let mut pipes: Vec<(Vec<usize>, redis::Pipeline)> = Vec::new();
            for g in &groups {
                let mut pipe = redis::pipe();
                let mut written = Vec::new();
                for &j in &g.members {
                    let i = pending[j];
                    let (version, bytes) = split_value(&records[i], rows[j].clone())?;
                    let mut slot: Option<KeyState> = bytes.map(|b| decode(&records[i], &b)).transpose()?;
                    if !f(i, &mut slot) {
                        continue;
                    }
                    match (slot, version) {
                        (Some(ks), _) => {
                            cas_cmd(
                                &mut pipe,
                                &records[i],
                                version,
                                next_value(&records[i], version, &ks)?,
                            );
                            written.push(i);
                        }
                        (None, Some(v)) => {
                            cas_del_cmd(&mut pipe, &records[i], v);
                            written.push(i);
                        }
                        (None, None) => {}
                    }
                }
                if !written.is_empty() {
                    pipes.push((written, pipe));
                }
            }
            let runs = pipes.iter().map(|(_, pipe)| {
                let mut conn = conn.clone();
                async move {
                    let results: Vec<i64> = pipe.query_async(&mut conn).await.map_err(map_err)?;
                    Ok::<_, StoreError>(results)
                }
            });
            let results = try_join_all(runs).await?;
            pending.clear();
            for ((written, _), results) in pipes.iter().zip(results) {
                for (&i, ok) in written.iter().zip(results) {
                    if ok != 1 {
                        pending.push(i);
                    }
                }
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
        for bad in [
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
        let a = Slot::for_key(names.key_record(&("t|orders".into(), "per-min".into())));
        let b = Slot::for_key(names.key_record(&("t|orders".into(), "per-day".into())));
        assert_eq!(a, b);
        // The slot is CRC16 of the hash tag: `{t|orders}`'s.
        assert_eq!(a, Slot::for_key("{t|orders}"));
        assert_ne!(
            Slot::for_key(names.session_record("n1")),
            Slot::for_key(names.session_record("n2"))
        );
        let records: Vec<String> = ["a", "b", "a"]
            .iter()
            .map(|k| names.key_record(&((*k).into(), "l".into())))
            .collect();
        let groups = by_slot(&records);
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].members, vec![0, 2]);
    }
}
