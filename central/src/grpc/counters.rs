//! Where the rate limit service keeps each key's limit records: the
//! records of the filter's key table (`tenantgate::limiter::charge`), as
//! opaque bytes, in the store `tenantgate serve --store` names.
//!
//! * [`MemoryCounters`] (`--store embedded`): in the service's process,
//!   under one lock; at most `max_keys` records, each dropped once idle
//!   for its time to live (a sweep every [`SWEEP_EVERY`] writes).
//! * [`RedisCounters`] (`--store redis://…`): shared by every replica.
//!   Each record is one string, `<prefix>:rls:<key>`: its version (8
//!   bytes), then its bytes, with Redis's own expiry. A request's records
//!   are read (one `MGET`), decided in Rust, and written by one Lua script
//!   that first checks every version read, then writes all of them (Redis
//!   runs a script alone): all or nothing. Within one replica, requests on
//!   the same keys take turns (one lock per stripe of [`STRIPES`], taken in
//!   order), so versions only move under a request because of another
//!   replica; on such a conflict the request is re-read and re-decided
//!   after a random pause of up to [`MAX_PAUSE`] × the attempt (at most
//!   8), at most
//!   [`MAX_ATTEMPTS`] times, then it fails with a transient
//!   [`StoreError::Contention`] (Envoy then applies its failure mode). One
//!   Redis server, not a Redis Cluster (a request's keys span slots), as
//!   the allocator's store.
//!
//! The decision function may run more than once (on a conflict), so it is
//! a pure function of the records it is given and leaves its results in
//! its captures on every run.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redis::aio::ConnectionManager;
use redis::Client;
use tokio::sync::OnceCell;

use crate::store::redis_error as map_err;
use crate::store::StoreError;

/// Attempts of one request's compare-and-set before giving up.
pub const MAX_ATTEMPTS: u32 = 64;
/// Stripes of the per-replica locks on keys (Redis).
pub const STRIPES: usize = 1024;
/// The longest pause after a first conflict (Redis; the n-th waits up to
/// `min(n, 8)` times this).
pub const MAX_PAUSE: Duration = Duration::from_micros(200);
/// Writes between two sweeps of expired records (embedded).
pub const SWEEP_EVERY: u64 = 4096;

/// Decides on the records read (one per key, `None`: no record) and
/// returns the records to write (one per key), or `None`: write nothing.
pub type Decide<'a> = dyn FnMut(&[Option<Vec<u8>>]) -> Option<Vec<Vec<u8>>> + Send + 'a;

/// The rate limit service's records.
#[async_trait]
pub trait Counters: Send + Sync {
    /// `embedded` or `redis`.
    fn kind(&self) -> &'static str;

    /// Reads `keys`' records, runs `decide`, writes what it returns (each
    /// record living `ttl` past `now_ns`), all or nothing.
    async fn update(
        &self,
        keys: &[String],
        ttl: Duration,
        now_ns: u64,
        decide: &mut Decide<'_>,
    ) -> Result<(), StoreError>;
}

struct Entry {
    bytes: Vec<u8>,
    expires_ns: u64,
}

/// The embedded store's records.
pub struct MemoryCounters {
    max_keys: usize,
    inner: Mutex<Memory>,
}

#[derive(Default)]
struct Memory {
    records: HashMap<String, Entry>,
    writes: u64,
}

impl MemoryCounters {
    pub fn new(max_keys: usize) -> MemoryCounters {
        MemoryCounters {
            max_keys: max_keys.max(1),
            inner: Mutex::new(Memory::default()),
        }
    }

    /// Records held (expired ones included until the next sweep).
    pub fn len(&self) -> usize {
        self.inner.lock().map_or(0, |m| m.records.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[async_trait]
impl Counters for MemoryCounters {
    fn kind(&self) -> &'static str {
        "embedded"
    }

    async fn update(
        &self,
        keys: &[String],
        ttl: Duration,
        now_ns: u64,
        decide: &mut Decide<'_>,
    ) -> Result<(), StoreError> {
        let mut m = self
            .inner
            .lock()
            .map_err(|_| StoreError::Unavailable("the records' lock is poisoned".to_owned()))?;
        let read: Vec<Option<Vec<u8>>> = keys
            .iter()
            .map(|k| {
                m.records
                    .get(k)
                    .filter(|e| e.expires_ns > now_ns)
                    .map(|e| e.bytes.clone())
            })
            .collect();
        let Some(write) = decide(&read) else {
            return Ok(());
        };
        let new_keys = keys.iter().filter(|k| !m.records.contains_key(*k)).count();
        if m.records.len().saturating_add(new_keys) > self.max_keys {
            m.records.retain(|_, e| e.expires_ns > now_ns);
            if m.records.len().saturating_add(new_keys) > self.max_keys {
                return Err(StoreError::Unavailable(format!(
                    "the rate limit service holds its maximum of {} keys",
                    self.max_keys
                )));
            }
        }
        let expires_ns = now_ns.saturating_add(u64::try_from(ttl.as_nanos()).unwrap_or(u64::MAX));
        for (k, bytes) in keys.iter().zip(write) {
            m.records.insert(k.clone(), Entry { bytes, expires_ns });
        }
        m.writes = m.writes.wrapping_add(1);
        if m.writes % SWEEP_EVERY == 0 {
            m.records.retain(|_, e| e.expires_ns > now_ns);
        }
        Ok(())
    }
}

/// `KEYS` the records, then as many turns; `ARGV[1]` the time to live in
/// ms, `ARGV[2]` the caller's turn token ("" if it holds none), then two
/// per record: expected version ("" when absent), new value (its version
/// first). Every turn and version is checked before anything is written:
/// another caller's turn on a record, or a version that moved, and nothing
/// is written. Returns 1 if written (the caller's turns given back), 0 if
/// not.
const CAS_ALL: &str = r"
local n = #KEYS / 2
for i = 1, n do
  local t = redis.call('GET', KEYS[n + i])
  if t and t ~= ARGV[2] then return 0 end
  local r = redis.call('GET', KEYS[i])
  if (r and string.sub(r, 1, 8) or '') ~= ARGV[i * 2 + 1] then return 0 end
end
for i = 1, n do
  redis.call('SET', KEYS[i], ARGV[i * 2 + 2], 'PX', ARGV[1])
  if ARGV[2] ~= '' then redis.call('DEL', KEYS[n + i]) end
end
return 1
";

/// `KEYS` the turns of a request's records, `ARGV[1]` the caller's token,
/// `ARGV[2]` how long the turn lasts (ms): takes every turn, or none if
/// another caller holds one. Returns 1 if taken.
const TAKE_TURN: &str = r"
for i = 1, #KEYS do
  local t = redis.call('GET', KEYS[i])
  if t and t ~= ARGV[1] then return 0 end
end
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
end
return 1
";

/// `KEYS` turns, `ARGV[1]` the caller's token: gives back those it holds.
const GIVE_TURN: &str = r"
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
return 1
";

/// Conflicts after which a request takes its turn on its records (then
/// no other replica writes them until it has, or the turn lapses).
pub const TURN_AFTER: u32 = 4;
/// How long a turn lasts if its holder never gives it back.
pub const TURN_LEASE: Duration = Duration::from_millis(100);

const VERSION_LEN: usize = 8;

/// Where the Redis path's time goes, summed over calls (`take` reads and
/// resets): what `make bench-service` prints beside each Redis row.
#[derive(Debug, Default)]
pub struct Profile {
    calls: AtomicU64,
    round_trips: AtomicU64,
    script_bytes: AtomicU64,
    lock_wait_ns: AtomicU64,
    redis_wait_ns: AtomicU64,
}

/// A [`Profile`]'s sums at one moment.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ProfileSums {
    pub calls: u64,
    pub round_trips: u64,
    /// Bytes of script text sent (`EVAL`'s body; 0 for `EVALSHA`).
    pub script_bytes: u64,
    /// Time spent waiting for this replica's stripe locks.
    pub lock_wait_ns: u64,
    /// Time spent waiting for Redis's answers.
    pub redis_wait_ns: u64,
}

impl Profile {
    /// The sums since the last `take`, reset.
    pub fn take(&self) -> ProfileSums {
        ProfileSums {
            calls: self.calls.swap(0, Relaxed),
            round_trips: self.round_trips.swap(0, Relaxed),
            script_bytes: self.script_bytes.swap(0, Relaxed),
            lock_wait_ns: self.lock_wait_ns.swap(0, Relaxed),
            redis_wait_ns: self.redis_wait_ns.swap(0, Relaxed),
        }
    }

    fn trip(&self, script_bytes: usize, started: Instant) {
        self.round_trips.fetch_add(1, Relaxed);
        self.script_bytes
            .fetch_add(u64::try_from(script_bytes).unwrap_or(u64::MAX), Relaxed);
        self.redis_wait_ns.fetch_add(nanos_since(started), Relaxed);
    }
}

fn nanos_since(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

impl std::fmt::Display for ProfileSums {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per = |n: u64| n as f64 / self.calls.max(1) as f64;
        write!(
            f,
            "{} calls: {:.2} round trips/call, {:.0} B of script text/call, stripe lock wait {:.1} µs/call, Redis wait {:.1} µs/call",
            self.calls,
            per(self.round_trips),
            per(self.script_bytes),
            per(self.lock_wait_ns) / 1e3,
            per(self.redis_wait_ns) / 1e3,
        )
    }
}

/// The Redis store's records.
pub struct RedisCounters {
    client: Client,
    conn: OnceCell<ConnectionManager>,
    prefix: String,
    /// Where a request's turns are (`<prefix>:rlt:`).
    turn_prefix: String,
    /// This replica's turns on keys, by stripe.
    stripes: Vec<tokio::sync::Mutex<()>>,
    /// Compare-and-sets lost to another replica (each one re-decided).
    pub conflicts: std::sync::atomic::AtomicU64,
    /// The most attempts one request took to be written.
    pub max_attempts: std::sync::atomic::AtomicU64,
    /// Where the time goes.
    pub profile: Profile,
}

/// A key's stripe (a fixed hash: the same in every run).
fn stripe_of(key: &str) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    key.hash(&mut h);
    usize::try_from(h.finish() % STRIPES as u64).unwrap_or(0)
}

/// A random number (for pauses and turn tokens).
fn random(seed: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(seed);
    h.finish()
}

/// A random pause of up to `MAX_PAUSE × min(attempt, 8)`.
fn pause(attempt: u32) -> Duration {
    let max = u64::try_from(MAX_PAUSE.as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_mul(u64::from(attempt.min(8)));
    Duration::from_nanos(random(u64::from(attempt)) % max.max(1))
}

impl RedisCounters {
    /// Records on `url` under `<prefix>:rls:`; connects on first use.
    pub fn new(url: &str, prefix: &str) -> Result<RedisCounters, StoreError> {
        let client = crate::store::redis_client(url)?;
        Ok(RedisCounters {
            client,
            conn: OnceCell::new(),
            prefix: format!("{prefix}:rls:"),
            turn_prefix: format!("{prefix}:rlt:"),
            stripes: (0..STRIPES).map(|_| tokio::sync::Mutex::new(())).collect(),
            conflicts: std::sync::atomic::AtomicU64::new(0),
            max_attempts: std::sync::atomic::AtomicU64::new(0),
            profile: Profile::default(),
        })
    }

    async fn conn(&self) -> Result<ConnectionManager, StoreError> {
        crate::store::redis_connection(&self.client, &self.conn).await
    }
}

#[async_trait]
impl Counters for RedisCounters {
    fn kind(&self) -> &'static str {
        "redis"
    }

    async fn update(
        &self,
        keys: &[String],
        ttl: Duration,
        _now_ns: u64,
        decide: &mut Decide<'_>,
    ) -> Result<(), StoreError> {
        if keys.is_empty() {
            let _ = decide(&[]);
            return Ok(());
        }
        let mut conn = self.conn().await?;
        let names: Vec<String> = keys.iter().map(|k| format!("{}{k}", self.prefix)).collect();
        let turns: Vec<String> = keys.iter().map(|k| format!("{}{k}", self.turn_prefix)).collect();
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        // This replica's turn on every key, stripes in order (no deadlock).
        let mut stripes: Vec<usize> = keys.iter().map(|k| stripe_of(k)).collect();
        stripes.sort_unstable();
        stripes.dedup();
        self.profile.calls.fetch_add(1, Relaxed);
        let waited = Instant::now();
        let mut held = Vec::with_capacity(stripes.len());
        for i in stripes {
            if let Some(m) = self.stripes.get(i) {
                held.push(m.lock().await);
            }
        }
        self.profile.lock_wait_ns.fetch_add(nanos_since(waited), Relaxed);
        let token = format!("{:016x}", random(0));
        let mut turn = false;
        let result = self
            .attempts(&mut conn, &names, &turns, ttl_ms, &token, &mut turn, decide)
            .await;
        if turn && !matches!(result, Ok(true)) {
            // Given back unless the write did (best effort: it lapses).
            let _ = eval_script(&self.profile, &mut conn, GIVE_TURN, &turns, &[token.as_bytes()]).await;
        }
        match result {
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Runs `script` on `keys` with `args`; its integer answer.
async fn eval_script(
    profile: &Profile,
    conn: &mut ConnectionManager,
    script: &str,
    keys: &[String],
    args: &[&[u8]],
) -> Result<i64, StoreError> {
    let mut eval = redis::cmd("EVAL");
    eval.arg(script).arg(keys.len()).arg(keys);
    for a in args {
        eval.arg(*a);
    }
    let started = Instant::now();
    let answer = eval.query_async(conn).await.map_err(map_err);
    profile.trip(script.len(), started);
    answer
}

/// A request's records as read: their versions ("" when absent), their
/// bytes.
async fn read_records(
    profile: &Profile,
    conn: &mut ConnectionManager,
    names: &[String],
) -> Result<(Vec<Vec<u8>>, Vec<Option<Vec<u8>>>), StoreError> {
    let started = Instant::now();
    let values: Result<Vec<Option<Vec<u8>>>, _> = redis::cmd("MGET").arg(names).query_async(conn).await;
    profile.trip(0, started);
    let values = values.map_err(map_err)?;
    let mut versions = Vec::with_capacity(values.len());
    let mut read = Vec::with_capacity(values.len());
    for v in values {
        match v {
            Some(v) if v.len() >= VERSION_LEN => {
                versions.push(v[..VERSION_LEN].to_vec());
                read.push(Some(v[VERSION_LEN..].to_vec()));
            }
            // Absent, or too short to be ours: written over.
            other => {
                versions.push(other.unwrap_or_default());
                read.push(None);
            }
        }
    }
    Ok((versions, read))
}

impl RedisCounters {
    /// Read, decide, compare-and-set until written or refused (`Ok(true)`:
    /// written, which gave back any turn; `Ok(false)`: nothing to write).
    #[allow(clippy::too_many_arguments)] // one request's state, passed down once
    async fn attempts(
        &self,
        conn: &mut ConnectionManager,
        names: &[String],
        turns: &[String],
        ttl_ms: u64,
        token: &str,
        turn: &mut bool,
        decide: &mut Decide<'_>,
    ) -> Result<bool, StoreError> {
        let lease_ms = u64::try_from(TURN_LEASE.as_millis())
            .unwrap_or(u64::MAX)
            .to_string();
        for attempt in 0..MAX_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(pause(attempt)).await;
            }
            if attempt >= TURN_AFTER && !*turn {
                *turn = eval_script(
                    &self.profile,
                    conn,
                    TAKE_TURN,
                    turns,
                    &[token.as_bytes(), lease_ms.as_bytes()],
                )
                .await?
                    == 1;
            }
            let (versions, read) = read_records(&self.profile, conn, names).await?;
            let Some(write) = decide(&read) else {
                return Ok(false);
            };
            let held = if *turn { token.as_bytes() } else { b"" };
            let mut args: Vec<Vec<u8>> = vec![ttl_ms.to_string().into_bytes(), held.to_vec()];
            for (version, bytes) in versions.iter().zip(&write) {
                let next = <[u8; VERSION_LEN]>::try_from(version.as_slice())
                    .map_or(1, |v| u64::from_be_bytes(v).wrapping_add(1));
                let mut value = Vec::with_capacity(VERSION_LEN + bytes.len());
                value.extend_from_slice(&next.to_be_bytes());
                value.extend_from_slice(bytes);
                args.push(version.clone());
                args.push(value);
            }
            let keys: Vec<String> = names.iter().chain(turns).cloned().collect();
            let refs: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
            if eval_script(&self.profile, conn, CAS_ALL, &keys, &refs).await? == 1 {
                self.max_attempts
                    .fetch_max(u64::from(attempt) + 1, std::sync::atomic::Ordering::Relaxed);
                return Ok(true);
            }
            self.conflicts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Err(StoreError::Contention {
            record: names.first().cloned().unwrap_or_default(),
            attempts: MAX_ATTEMPTS,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn memory_records_expire_and_stay_within_their_cap() {
        let c = MemoryCounters::new(2);
        let keys = |k: &[&str]| k.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let put = |v: u8| move |_: &[Option<Vec<u8>>]| Some(vec![vec![v]]);
        let ttl = Duration::from_secs(1);
        c.update(&keys(&["a"]), ttl, 0, &mut put(1)).await.unwrap();
        c.update(&keys(&["b"]), ttl, 0, &mut put(2)).await.unwrap();
        assert!(
            c.update(&keys(&["c"]), ttl, 10, &mut put(3)).await.is_err(),
            "full"
        );
        let mut seen = None;
        c.update(&keys(&["a"]), ttl, 10, &mut |r: &[Option<Vec<u8>>]| {
            seen = Some(r[0].clone());
            None
        })
        .await
        .unwrap();
        assert_eq!(seen, Some(Some(vec![1])));
        // Past their time to live, a new key takes an expired one's place.
        c.update(&keys(&["c"]), ttl, 2_000_000_000, &mut put(3))
            .await
            .unwrap();
        assert_eq!(c.len(), 1);
    }
}
