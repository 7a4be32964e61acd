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
//!   runs a script alone): all or nothing. On a conflict the request is
//!   re-read and re-decided, at most [`MAX_ATTEMPTS`] times, then it fails
//!   with a transient [`StoreError::Contention`]. One Redis server, not a
//!   Redis Cluster (a request's keys span slots), as the allocator's store.
//!
//! The decision function may run more than once (on a conflict), so it is
//! a pure function of the records it is given and leaves its results in
//! its captures on every run.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Client;
use tokio::sync::OnceCell;

use crate::store::StoreError;

/// Attempts of one request's compare-and-set before giving up.
pub const MAX_ATTEMPTS: u32 = 16;
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

/// `KEYS` the records; `ARGV[1]` the time to live in ms, then two per
/// record: expected version ("" when absent), new value (its version
/// first). Every version is checked before anything is written. Returns 1
/// if written, 0 if a version moved.
const CAS_ALL: &str = r"
for i = 1, #KEYS do
  local r = redis.call('GET', KEYS[i])
  if (r and string.sub(r, 1, 8) or '') ~= ARGV[i * 2] then return 0 end
end
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], ARGV[i * 2 + 1], 'PX', ARGV[1])
end
return 1
";

/// Every command must answer within this (Envoy's ratelimit filter waits
/// 20 ms by default; a slower store answers `UNAVAILABLE`).
const RESPONSE_TIMEOUT: Duration = Duration::from_millis(250);
const VERSION_LEN: usize = 8;

/// The Redis store's records.
pub struct RedisCounters {
    client: Client,
    conn: OnceCell<ConnectionManager>,
    prefix: String,
}

impl RedisCounters {
    /// Records on `url` under `<prefix>:rls:`; connects on first use.
    pub fn new(url: &str, prefix: &str) -> Result<RedisCounters, StoreError> {
        let client = Client::open(url).map_err(|e| StoreError::Refused(format!("{url}: {e}")))?;
        Ok(RedisCounters {
            client,
            conn: OnceCell::new(),
            prefix: format!("{prefix}:rls:"),
        })
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
}

fn map_err(e: redis::RedisError) -> StoreError {
    if e.is_timeout() {
        StoreError::Timeout(e.to_string())
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        StoreError::Unavailable(e.to_string())
    } else {
        StoreError::Refused(e.to_string())
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
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        for _ in 0..MAX_ATTEMPTS {
            let values: Vec<Option<Vec<u8>>> = redis::cmd("MGET")
                .arg(&names)
                .query_async(&mut conn)
                .await
                .map_err(map_err)?;
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
            let Some(write) = decide(&read) else {
                return Ok(());
            };
            let mut eval = redis::cmd("EVAL");
            eval.arg(CAS_ALL).arg(names.len());
            let mut args: Vec<Vec<u8>> = vec![ttl_ms.to_string().into_bytes()];
            for ((name, version), bytes) in names.iter().zip(&versions).zip(&write) {
                let next = version
                    .get(..VERSION_LEN)
                    .and_then(|v| <[u8; 8]>::try_from(v).ok())
                    .map_or(1, |v| u64::from_be_bytes(v).wrapping_add(1));
                let mut value = Vec::with_capacity(VERSION_LEN + bytes.len());
                value.extend_from_slice(&next.to_be_bytes());
                value.extend_from_slice(bytes);
                eval.arg(name);
                args.push(version.clone());
                args.push(value);
            }
            for a in &args {
                eval.arg(a.as_slice());
            }
            let written: i64 = eval.query_async(&mut conn).await.map_err(map_err)?;
            if written == 1 {
                return Ok(());
            }
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
