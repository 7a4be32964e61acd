//! Where the rate limit service keeps each key's limit records: the
//! records of the filter's key table (`tenantgate::limiter::charge`), as
//! opaque bytes, in the store `tenantgate serve --store` names.
//!
//! * [`MemoryCounters`] (`--store embedded`): in the service's process,
//!   under one lock; at most `max_keys` records, each dropped once idle
//!   for its time to live (a sweep every [`SWEEP_EVERY`] writes).
//! * [`RedisCounters`] (`--store redis://…`): shared by every replica.
//!   Each record is one string, `<prefix>:rls:<key>`: its version (8
//!   random bytes, new at each write: a record that expired and was
//!   written anew never looks unchanged), then its bytes, with Redis's own
//!   expiry. A request is decided in Rust on its records **as this replica
//!   last saw them** (read or written; never seen: absent), then checked
//!   and written by one Lua script ([`DECIDED`], one `EVALSHA`: the text
//!   is sent only to load it) that first checks every version decided on,
//!   then writes all of them (Redis runs a script alone): all or nothing.
//!   If one moved (another replica wrote it, it expired, or this replica
//!   had not seen it), nothing is written and the script answers the
//!   records as they are: the request is re-decided on them, so a call is
//!   one round trip once its records are known here, two otherwise. A
//!   refusal decided on records not read by this call is checked the same
//!   way (the script only compares). Within one replica, requests on the
//!   same keys take turns (one lock per stripe of [`STRIPES`], taken in
//!   order; each stripe remembers the records of [`WAYS`] of its keys, so
//!   at most `STRIPES × WAYS` records are remembered), so versions only move under
//!   a request because of another replica; on such a conflict (a record
//!   read by this call moved) the request is re-decided after a random
//!   pause of up to [`MAX_PAUSE`] × the conflicts (at most 8), after
//!   [`TURN_AFTER`] conflicts it takes its turn on its records, and after
//!   [`MAX_ATTEMPTS`] it fails with a transient
//!   [`StoreError::Contention`] (Envoy then applies its failure mode). An
//!   error forgets the request's records (the script may have run). One
//!   Redis server, not a Redis Cluster (a request's keys span slots), as
//!   the allocator's store.
//!
//! The decision function may run more than once (on a conflict, or on
//! Redis when the records as last seen had moved), so it is
//! a pure function of the records it is given and leaves its results in
//! its captures on every run.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redis::aio::ConnectionManager;
use redis::Client;
use tokio::sync::OnceCell;

use crate::store::{run_script, Lua, StoreError};

/// Conflicts (records read by the request that moved) before giving up.
pub const MAX_ATTEMPTS: u32 = 64;
/// Stripes of the per-replica locks on keys (Redis).
pub const STRIPES: usize = 16_384;
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

/// One call's decision, checked and written. `KEYS` the records, then as
/// many turns. `ARGV[1]` `w` (write) or `c` (only check), `ARGV[2]` the
/// time to live in ms, `ARGV[3]` the caller's turn token ("" if it holds
/// none), then two per record: the version the caller decided on (""
/// when absent) and the new value (its version first; "" with `c`).
/// Every version (and, to write, every turn) is checked before anything
/// is written: another caller's turn on a record, or a version that
/// moved, and nothing is written. Returns `{'1'}` if nothing moved (and,
/// with `w`, all was written and the caller's turns given back), else
/// `{'0', <each record's value, nil when absent>}`: what to decide on next.
/// The records are read with one `MGET`, the turns with one `EXISTS` (or,
/// for a caller holding turns, one `MGET`): 2 + n commands for n records
/// written, not 3n (`make bench-service` prints redis-server's CPU per
/// call).
const DECIDED: &str = r"
local n = #KEYS / 2
local write = ARGV[1] == 'w'
local token = ARGV[3]
local moved = false
if write and token == '' then
  moved = redis.call('EXISTS', unpack(KEYS, n + 1, n * 2)) > 0
elseif write then
  local turns = redis.call('MGET', unpack(KEYS, n + 1, n * 2))
  for i = 1, n do
    if turns[i] and turns[i] ~= token then moved = true end
  end
end
local now = redis.call('MGET', unpack(KEYS, 1, n))
for i = 1, n do
  if (now[i] and string.sub(now[i], 1, 8) or '') ~= ARGV[i * 2 + 2] then moved = true end
end
if moved then
  table.insert(now, 1, '0')
  return now
end
if write then
  for i = 1, n do
    redis.call('SET', KEYS[i], ARGV[i * 2 + 3], 'PX', ARGV[2])
  end
  if token ~= '' then redis.call('DEL', unpack(KEYS, n + 1, n * 2)) end
end
return {'1'}
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

/// The scripts (each loaded once).
struct Scripts {
    decided: Lua,
    take_turn: Lua,
    give_turn: Lua,
}

static SCRIPTS: Scripts = Scripts {
    decided: Lua::new(DECIDED),
    take_turn: Lua::new(TAKE_TURN),
    give_turn: Lua::new(GIVE_TURN),
};

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

    /// One round trip that sent `script_bytes` of script text; the time
    /// since `started` counted if `timed`.
    fn trip(&self, script_bytes: usize, started: Instant, timed: bool) {
        self.round_trips.fetch_add(1, Relaxed);
        self.script_bytes
            .fetch_add(u64::try_from(script_bytes).unwrap_or(u64::MAX), Relaxed);
        if timed {
            self.redis_wait_ns.fetch_add(nanos_since(started), Relaxed);
        }
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

/// A record as this replica last saw it (read or written).
#[derive(Clone)]
struct Seen {
    name: String,
    /// Its version as [`DECIDED`] compares it ("" when absent).
    version: Vec<u8>,
    /// Its bytes (`None`: no record).
    bytes: Option<Vec<u8>>,
}

impl Seen {
    /// `name`'s record from its stored value.
    fn of(name: &str, value: Option<Vec<u8>>) -> Seen {
        let (version, bytes) = match value {
            Some(v) if v.len() >= VERSION_LEN => (v[..VERSION_LEN].to_vec(), Some(v[VERSION_LEN..].to_vec())),
            // Absent, or too short to be ours: written over.
            other => (other.unwrap_or_default(), None),
        };
        Seen {
            name: name.to_owned(),
            version,
            bytes,
        }
    }
}

/// One stripe of a replica's keys: its lock (requests on its keys take
/// turns), and the records of up to [`WAYS`] of its keys as last seen
/// (the latest used last).
#[derive(Default)]
struct Stripe {
    seen: Vec<Seen>,
}

/// Records a stripe remembers (Redis).
pub const WAYS: usize = 2;

impl Stripe {
    fn get(&self, name: &str) -> Option<&Seen> {
        self.seen.iter().find(|s| s.name == name)
    }

    /// Remembers `seen` (`None`: forgets its name's record).
    fn put(&mut self, name: &str, seen: Option<Seen>) {
        self.seen.retain(|s| s.name != name);
        if let Some(s) = seen {
            if self.seen.len() >= WAYS {
                self.seen.remove(0);
            }
            self.seen.push(s);
        }
    }
}

/// The Redis store's records.
pub struct RedisCounters {
    client: Client,
    conn: OnceCell<ConnectionManager>,
    prefix: String,
    /// Where a request's turns are (`<prefix>:rlt:`).
    turn_prefix: String,
    stripes: Vec<tokio::sync::Mutex<Stripe>>,
    /// Compare-and-sets lost to another replica (each one re-decided).
    pub conflicts: AtomicU64,
    /// The most attempts one request took to be written.
    pub max_attempts: AtomicU64,
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

/// A random number (for pauses, turn tokens and versions).
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

/// What [`DECIDED`] answered.
enum Answer {
    /// Nothing had moved: written (or, only checked, the decision stands).
    Done,
    /// Something moved: each record's value now.
    Moved(Vec<Option<Vec<u8>>>),
}

/// One request's names in Redis.
struct Names {
    records: Vec<String>,
    turns: Vec<String>,
    ttl_ms: Vec<u8>,
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
            stripes: (0..STRIPES).map(|_| Default::default()).collect(),
            conflicts: AtomicU64::new(0),
            max_attempts: AtomicU64::new(0),
            profile: Profile::default(),
        })
    }

    async fn conn(&self) -> Result<ConnectionManager, StoreError> {
        crate::store::redis_connection(&self.client, &self.conn).await
    }

    /// Runs one of the scripts, counted in the profile.
    async fn run<T: redis::FromRedisValue>(
        &self,
        conn: &mut ConnectionManager,
        lua: &Lua,
        keys: &[String],
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let mut sent: usize = 0;
        let mut trips: u32 = 0;
        let answer = run_script(conn, lua, keys, args, &mut |bytes| {
            trips = trips.saturating_add(1);
            sent = sent.saturating_add(bytes);
        })
        .await;
        for i in 0..trips {
            // The time is counted once, with the first trip.
            self.profile.trip(if i == 0 { sent } else { 0 }, started, i == 0);
        }
        answer
    }

    /// Runs [`DECIDED`] on what `seen` says: checks it is current and, with
    /// `write` (a value per record), writes.
    async fn decided(
        &self,
        conn: &mut ConnectionManager,
        names: &Names,
        token: &[u8],
        seen: &[Seen],
        write: Option<&[Vec<u8>]>,
    ) -> Result<Answer, StoreError> {
        let mode: &[u8] = if write.is_some() { b"w" } else { b"c" };
        let mut args: Vec<&[u8]> = vec![mode, &names.ttl_ms, token];
        for (i, s) in seen.iter().enumerate() {
            args.push(&s.version);
            args.push(write.and_then(|w| w.get(i)).map_or(b"", Vec::as_slice));
        }
        let keys: Vec<String> = names.records.iter().chain(&names.turns).cloned().collect();
        let mut answer: Vec<Option<Vec<u8>>> = self.run(conn, &SCRIPTS.decided, &keys, &args).await?;
        let status = if answer.is_empty() { None } else { answer.remove(0) };
        match status.as_deref() {
            Some(b"1") => Ok(Answer::Done),
            Some(b"0") if answer.len() == seen.len() => Ok(Answer::Moved(answer)),
            _ => Err(StoreError::Refused(
                "an unexpected answer from the RLS script".to_owned(),
            )),
        }
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
        let names = Names {
            records: keys.iter().map(|k| format!("{}{k}", self.prefix)).collect(),
            turns: keys.iter().map(|k| format!("{}{k}", self.turn_prefix)).collect(),
            ttl_ms: u64::try_from(ttl.as_millis())
                .unwrap_or(u64::MAX)
                .max(1)
                .to_string()
                .into_bytes(),
        };
        let slots: Vec<usize> = keys.iter().map(|k| stripe_of(k)).collect();
        // This replica's turn on every key, stripes in order (no deadlock).
        let mut order = slots.clone();
        order.sort_unstable();
        order.dedup();
        self.profile.calls.fetch_add(1, Relaxed);
        let waited = Instant::now();
        let mut held = BTreeMap::new();
        for i in order {
            if let Some(m) = self.stripes.get(i) {
                held.insert(i, m.lock().await);
            }
        }
        self.profile.lock_wait_ns.fetch_add(nanos_since(waited), Relaxed);
        // Each record as last seen here (never seen: guessed absent); the
        // script tells if that is no longer so.
        let mut seen: Vec<Seen> = names
            .records
            .iter()
            .zip(&slots)
            .map(|(name, slot)| {
                held.get(slot)
                    .and_then(|s| s.get(name))
                    .map_or_else(|| Seen::of(name, None), Seen::clone)
            })
            .collect();
        let token = format!("{:016x}", random(0));
        let mut turn = false;
        let result = self
            .attempts(&mut conn, &names, &token, &mut turn, &mut seen, decide)
            .await;
        if turn && !matches!(result, Ok(true)) {
            // Given back unless the write did (best effort: it lapses).
            let _: Result<i64, _> = self
                .run(&mut conn, &SCRIPTS.give_turn, &names.turns, &[token.as_bytes()])
                .await;
        }
        // Remembered as seen, or (an error: written or not?) forgotten.
        for (s, slot) in seen.into_iter().zip(&slots) {
            if let Some(stripe) = held.get_mut(slot) {
                let name = s.name.clone();
                stripe.put(&name, result.is_ok().then_some(s));
            }
        }
        result.map(|_| ())
    }
}

impl RedisCounters {
    /// Decide on `seen`, then check and write in one script, until written
    /// or refused (`Ok(true)`: written, which gave back any turn;
    /// `Ok(false)`: nothing to write). A decision on records as last seen
    /// here (not read by this call, or read before a pause) that moved is
    /// not a conflict: the script's answer is the read, and the request is
    /// re-decided on it at once; one on records just read that moved is,
    /// and a pause follows (then, as before, the records are as last seen).
    /// `seen` is left as last read or written.
    async fn attempts(
        &self,
        conn: &mut ConnectionManager,
        names: &Names,
        token: &str,
        turn: &mut bool,
        seen: &mut Vec<Seen>,
        decide: &mut Decide<'_>,
    ) -> Result<bool, StoreError> {
        let lease_ms = u64::try_from(TURN_LEASE.as_millis())
            .unwrap_or(u64::MAX)
            .to_string();
        let mut conflicts: u32 = 0;
        let mut read = false;
        while conflicts < MAX_ATTEMPTS {
            if conflicts >= TURN_AFTER && !*turn {
                let taken: i64 = self
                    .run(
                        conn,
                        &SCRIPTS.take_turn,
                        &names.turns,
                        &[token.as_bytes(), lease_ms.as_bytes()],
                    )
                    .await?;
                *turn = taken == 1;
            }
            let records: Vec<Option<Vec<u8>>> = seen.iter().map(|s| s.bytes.clone()).collect();
            let write = decide(&records);
            if write.is_none() && read {
                // Decided on what this call read: nothing to check.
                return Ok(false);
            }
            let values: Option<Vec<Vec<u8>>> = write.map(|w| {
                w.iter()
                    .enumerate()
                    .map(|(i, bytes)| {
                        let mut value = Vec::with_capacity(VERSION_LEN + bytes.len());
                        value.extend_from_slice(&random(u64::try_from(i).unwrap_or(0)).to_be_bytes());
                        value.extend_from_slice(bytes);
                        value
                    })
                    .collect()
            });
            let held = if *turn { token.as_bytes() } else { b"" };
            match self.decided(conn, names, held, seen, values.as_deref()).await? {
                Answer::Done => {
                    let Some(values) = values else {
                        return Ok(false);
                    };
                    for (s, v) in seen.iter_mut().zip(values) {
                        *s = Seen::of(&s.name, Some(v));
                    }
                    self.max_attempts
                        .fetch_max(u64::from(conflicts).saturating_add(1), Relaxed);
                    return Ok(true);
                }
                Answer::Moved(now) => {
                    *seen = seen.iter().zip(now).map(|(s, v)| Seen::of(&s.name, v)).collect();
                    // What was read before a pause is only as last seen.
                    read = !read;
                    if !read {
                        conflicts = conflicts.saturating_add(1);
                        self.conflicts.fetch_add(1, Relaxed);
                        tokio::time::sleep(pause(conflicts)).await;
                    }
                }
            }
        }
        Err(StoreError::Contention {
            record: names.records.first().cloned().unwrap_or_default(),
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
