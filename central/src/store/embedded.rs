//! The embedded store: the records in the service's memory, behind sharded
//! mutexes (no lock is held across an `.await`). A single-record update
//! (the sweep's) runs under its record's shard lock, so it is atomic and
//! never retried.
//!
//! A sync request ([`Store::update_request`]) is optimistic, like the
//! Redis store's: it copies the session and its records out (each under its
//! lock, briefly), runs its steps on the copies with no lock held (so
//! requests of different nodes compute in parallel), then takes the
//! sessions' lock and its keys' shard locks (in ascending order: no two
//! requests deadlock, and the sweep holds one shard at a time, never with
//! the sessions) and writes every copy only if no record's version moved
//! since it was read; otherwise it runs again, at most
//! [`super::redis::MAX_ATTEMPTS`] times. All or nothing: an update runs
//! on copies, and only an update that returns is written. An update that
//! panics (a bug: every value from the network is bounded before it gets
//! here) leaves every record as it was, and the call fails with
//! [`StoreError::Refused`]; nothing is ever swapped out for a placeholder
//! that a panic could leave behind.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

use async_trait::async_trait;

use super::redis::MAX_ATTEMPTS;
use super::{KeySlot, KeyUpdate, SessionUpdate, Store, StoreError, Txn};
use crate::alloc::{KeyId, KeyState, Session};

const SHARDS: usize = 64;

/// A record and the version it was last written at (unique across the
/// store: a record deleted and created again never has an old version).
struct Versioned<T> {
    version: u64,
    record: T,
}

type KeyShard = HashMap<KeyId, Versioned<KeyState>>;

/// The default store: one process, nothing to start, state lost on exit.
pub struct EmbeddedStore {
    keys: Vec<Mutex<KeyShard>>,
    sessions: Mutex<HashMap<String, Versioned<Session>>>,
    next_version: AtomicU64,
}

impl Default for EmbeddedStore {
    fn default() -> EmbeddedStore {
        EmbeddedStore {
            keys: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            sessions: Mutex::new(HashMap::new()),
            next_version: AtomicU64::new(1),
        }
    }
}

impl EmbeddedStore {
    pub fn new() -> EmbeddedStore {
        EmbeddedStore::default()
    }

    fn shard_of(&self, id: &KeyId) -> usize {
        let mut h = DefaultHasher::new();
        id.hash(&mut h);
        (h.finish() as usize) % self.keys.len()
    }

    fn lock_shard(&self, i: usize) -> MutexGuard<'_, KeyShard> {
        // A panic while holding the lock cannot leave a record half
        // written: records are replaced whole.
        self.keys[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    fn shard(&self, id: &KeyId) -> MutexGuard<'_, KeyShard> {
        self.lock_shard(self.shard_of(id))
    }

    fn sessions(&self) -> MutexGuard<'_, HashMap<String, Versioned<Session>>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn version(&self) -> u64 {
        self.next_version.fetch_add(1, Relaxed)
    }
}

/// Writes `slot` at `key` of `map` with a new `version` (`None`: delete).
fn put<K: Hash + Eq, T>(map: &mut HashMap<K, Versioned<T>>, key: K, slot: Option<T>, version: u64) {
    match slot {
        Some(record) => {
            map.insert(key, Versioned { version, record });
        }
        None => {
            map.remove(&key);
        }
    }
}

#[async_trait]
impl Store for EmbeddedStore {
    fn kind(&self) -> &'static str {
        "embedded"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn update_session(&self, node: &str, f: &mut SessionUpdate<'_>) -> Result<u64, StoreError> {
        let mut sessions = self.sessions();
        let mut slot = sessions.get(node).map(|v| v.record.clone());
        match run_step(|| f(&mut slot)) {
            None => return Err(panicked(node)),
            Some(false) => return Ok(sessions.len() as u64),
            Some(true) => {}
        }
        put(&mut sessions, node.to_owned(), slot, self.version());
        Ok(sessions.len() as u64)
    }

    async fn update_request(&self, node: &str, txn: &mut (dyn Txn + '_)) -> Result<u64, StoreError> {
        for _ in 0..MAX_ATTEMPTS {
            // Read: copies and their versions, each under its lock briefly.
            let (mut session, session_version, count) = {
                let sessions = self.sessions();
                let v = sessions.get(node);
                (
                    v.map(|v| v.record.clone()),
                    v.map(|v| v.version),
                    sessions.len() as u64,
                )
            };
            let ids = match run_step(|| txn.begin(&mut session, count)) {
                None => return Err(panicked(node)),
                Some(None) => return Ok(count),
                Some(Some(ids)) => ids,
            };
            let shard_of: Vec<usize> = ids.iter().map(|id| self.shard_of(id)).collect();
            let mut versions: Vec<Option<u64>> = Vec::with_capacity(ids.len());
            let mut slots: Vec<KeySlot> = Vec::with_capacity(ids.len());
            for (id, &i) in ids.into_iter().zip(&shard_of) {
                let shard = self.lock_shard(i);
                let v = shard.get(&id);
                versions.push(v.map(|v| v.version));
                slots.push(KeySlot {
                    record: v.map(|v| v.record.clone()),
                    id,
                    write: false,
                });
            }
            // The steps, with no lock held.
            let write_session = match run_step(|| txn.apply(&mut session, &mut slots)) {
                None => return Err(panicked(node)),
                Some(w) => w,
            };
            // Commit: every version as read, then every write.
            let mut sessions = self.sessions();
            let mut order = shard_of.clone();
            order.sort_unstable();
            order.dedup();
            let mut shards: BTreeMap<usize, MutexGuard<'_, KeyShard>> = BTreeMap::new();
            for i in order {
                shards.insert(i, self.lock_shard(i));
            }
            let unmoved = sessions.get(node).map(|v| v.version) == session_version
                && slots
                    .iter()
                    .zip(&shard_of)
                    .zip(&versions)
                    .all(|((slot, i), read)| {
                        shards
                            .get(i)
                            .is_some_and(|s| s.get(&slot.id).map(|v| v.version) == *read)
                    });
            if !unmoved {
                continue;
            }
            let version = self.version();
            for (slot, i) in slots.into_iter().zip(&shard_of) {
                if let (true, Some(shard)) = (slot.write, shards.get_mut(i)) {
                    put(shard, slot.id, slot.record, version);
                }
            }
            if write_session {
                put(&mut sessions, node.to_owned(), session, version);
            }
            return Ok(sessions.len() as u64);
        }
        Err(StoreError::Contention {
            record: node.to_owned(),
            attempts: MAX_ATTEMPTS,
        })
    }

    async fn update_keys(&self, ids: &[KeyId], f: &mut KeyUpdate<'_>) -> Result<(), StoreError> {
        for (i, id) in ids.iter().enumerate() {
            let mut shard = self.shard(id);
            let mut slot = shard.get(id).map(|v| v.record.clone());
            match run_step(|| f(i, &mut slot)) {
                None => return Err(panicked(&format!("{}|{}", id.0, id.1))),
                Some(false) => continue,
                Some(true) => {}
            }
            put(&mut shard, id.clone(), slot, self.version());
        }
        Ok(())
    }

    async fn key_ids(&self) -> Result<Vec<KeyId>, StoreError> {
        let mut out = Vec::new();
        for i in 0..self.keys.len() {
            out.extend(self.lock_shard(i).keys().cloned());
        }
        Ok(out)
    }

    async fn session_ids(&self) -> Result<Vec<String>, StoreError> {
        Ok(self.sessions().keys().cloned().collect())
    }

    async fn session_count(&self) -> Result<u64, StoreError> {
        Ok(self.sessions().len() as u64)
    }

    async fn key_count(&self) -> Result<u64, StoreError> {
        let mut n = 0;
        for i in 0..self.keys.len() {
            n += self.lock_shard(i).len() as u64;
        }
        Ok(n)
    }
}

/// Runs a step: its result, or `None` if it panicked (its copies are then
/// dropped, and the stored records stay as they were).
fn run_step<T>(f: impl FnOnce() -> T) -> Option<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).ok()
}

fn panicked(record: &str) -> StoreError {
    StoreError::Refused(format!(
        "the update of record {record} failed (a bug); the record is unchanged"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GlobalLimit;

    /// A request whose records another writer changed while its steps ran
    /// is run again on fresh copies: the other write is never lost.
    #[tokio::test]
    async fn a_request_runs_again_when_a_record_moved_under_it() {
        struct AddOne<'a> {
            store: &'a EmbeddedStore,
            id: KeyId,
            runs: u32,
        }
        impl Txn for AddOne<'_> {
            fn begin(&mut self, _: &mut Option<Session>, _: u64) -> Option<Vec<KeyId>> {
                Some(vec![self.id.clone()])
            }
            fn apply(&mut self, session: &mut Option<Session>, keys: &mut [KeySlot]) -> bool {
                self.runs += 1;
                if self.runs == 1 {
                    // Another writer lands between our read and our commit.
                    let mut shard = self.store.shard(&self.id);
                    if let Some(v) = shard.get_mut(&self.id) {
                        v.version = self.store.version();
                        v.record.retarget(limit(7), 1);
                    }
                }
                let seen = keys[0].record.as_ref().map(|k| k.limit().limit);
                keys[0].write = true;
                keys[0].record = Some(KeyState::new(limit(seen.unwrap_or(0) + 100), 2));
                *session = Some(Session::new("eu"));
                true
            }
        }
        fn limit(n: u64) -> GlobalLimit {
            GlobalLimit {
                limit: n,
                window_ns: 60_000_000_000,
                burst: 40,
                max_cost: 1,
            }
        }
        let store = EmbeddedStore::new();
        let id: KeyId = ("t|api".into(), "per-min".into());
        store
            .update_keys(std::slice::from_ref(&id), &mut |_, slot| {
                *slot = Some(KeyState::new(limit(5), 0));
                true
            })
            .await
            .unwrap();
        let mut txn = AddOne {
            store: &store,
            id: id.clone(),
            runs: 0,
        };
        assert_eq!(store.update_request("n1", &mut txn).await.unwrap(), 1);
        assert_eq!(txn.runs, 2, "run again after the conflict");
        // Computed from the other writer's record (7), not the stale one (5).
        assert_eq!(store.key(&id).await.unwrap().unwrap().limit().limit, 107);
        assert_eq!(store.session_count().await.unwrap(), 1);
    }

    /// The reported hazard: a panic during an update left a placeholder in
    /// place of the record (reservations and debts forgotten).
    #[tokio::test]
    async fn a_panicking_update_leaves_the_record_as_it_was() {
        let store = EmbeddedStore::new();
        let id: KeyId = ("t|api".into(), "per-min".into());
        let limit = GlobalLimit {
            limit: 100,
            window_ns: 60_000_000_000,
            burst: 40,
            max_cost: 1,
        };
        store
            .update_keys(std::slice::from_ref(&id), &mut |_, slot| {
                *slot = Some(KeyState::new(limit, 5));
                true
            })
            .await
            .unwrap();
        let before = store.key(&id).await.unwrap().unwrap().view();
        let err = store
            .update_keys(std::slice::from_ref(&id), &mut |_, slot| {
                if let Some(ks) = slot.as_mut() {
                    ks.retarget(
                        GlobalLimit {
                            limit: 1,
                            window_ns: 1,
                            burst: 1,
                            max_cost: 1,
                        },
                        9,
                    );
                }
                panic!("a bug in the middle of an update");
            })
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Refused(_)), "{err}");
        let after = store.key(&id).await.unwrap().unwrap();
        assert_eq!(after.view(), before);
        assert_eq!(after.limit(), limit);

        let err = store
            .update_session("n1", &mut |slot| {
                *slot = Some(Session::new("eu"));
                panic!("a bug");
            })
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Refused(_)), "{err}");
        assert_eq!(store.session_count().await.unwrap(), 0);
    }
}
