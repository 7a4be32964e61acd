//! The embedded store: the records in the service's memory, behind sharded
//! mutexes (no lock is held across an `.await`). An update runs under its
//! record's shard lock, so it is atomic and never retried.
//!
//! All or nothing, like the Redis store's compare-and-set: an update runs on
//! a copy of the record, and only an update that returns is written. A sync
//! request ([`Store::update_request`]) holds the sessions' lock and its
//! keys' shard locks for its whole transaction and writes its copies only
//! once every step returned. An
//! update that panics (a bug: every value from the network is bounded
//! before it gets here) leaves the record as it was, and the call fails
//! with [`StoreError::Refused`]; nothing is ever swapped out for a
//! placeholder that a panic could leave behind.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::{Mutex, MutexGuard};

use async_trait::async_trait;

use super::{KeySlot, KeyUpdate, SessionUpdate, Store, StoreError, Txn};
use crate::alloc::{KeyId, KeyState, Session};

const SHARDS: usize = 64;

/// The default store: one process, nothing to start, state lost on exit.
pub struct EmbeddedStore {
    keys: Vec<Mutex<HashMap<KeyId, KeyState>>>,
    sessions: Mutex<HashMap<String, Session>>,
}

impl Default for EmbeddedStore {
    fn default() -> EmbeddedStore {
        EmbeddedStore {
            keys: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            sessions: Mutex::new(HashMap::new()),
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

    fn lock_shard(&self, i: usize) -> MutexGuard<'_, HashMap<KeyId, KeyState>> {
        // A panic while holding the lock cannot leave a record half
        // written: records are replaced whole.
        self.keys[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    fn shard(&self, id: &KeyId) -> MutexGuard<'_, HashMap<KeyId, KeyState>> {
        self.lock_shard(self.shard_of(id))
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
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        let mut slot = sessions.get(node).cloned();
        match run_update(|| f(&mut slot)) {
            None => return Err(panicked(node)),
            Some(false) => return Ok(sessions.len() as u64),
            Some(true) => {}
        }
        match slot {
            Some(s) => {
                sessions.insert(node.to_owned(), s);
            }
            None => {
                sessions.remove(node);
            }
        }
        Ok(sessions.len() as u64)
    }

    async fn update_request(&self, node: &str, txn: &mut (dyn Txn + '_)) -> Result<u64, StoreError> {
        // Locks: the sessions, then the request's key shards in ascending
        // order (the sweep holds one shard at a time, and never the
        // sessions with a shard), so no two requests deadlock. The steps
        // run on copies; only when both return is anything written.
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        let mut session = sessions.get(node).cloned();
        let count = sessions.len() as u64;
        let ids = match run_step(|| txn.begin(&mut session, count)) {
            None => return Err(panicked(node)),
            Some(None) => return Ok(count),
            Some(Some(ids)) => ids,
        };
        let shard_of: Vec<usize> = ids.iter().map(|id| self.shard_of(id)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        let mut shards: BTreeMap<usize, MutexGuard<'_, HashMap<KeyId, KeyState>>> = BTreeMap::new();
        for i in order {
            shards.insert(i, self.lock_shard(i));
        }
        let mut slots: Vec<KeySlot> = ids
            .into_iter()
            .zip(&shard_of)
            .map(|(id, i)| KeySlot {
                record: shards.get(i).and_then(|s| s.get(&id).cloned()),
                id,
                write: false,
            })
            .collect();
        let write_session = match run_step(|| txn.apply(&mut session, &mut slots)) {
            None => return Err(panicked(node)),
            Some(w) => w,
        };
        for (slot, i) in slots.into_iter().zip(&shard_of) {
            let (true, Some(shard)) = (slot.write, shards.get_mut(i)) else {
                continue;
            };
            match slot.record {
                Some(ks) => {
                    shard.insert(slot.id, ks);
                }
                None => {
                    shard.remove(&slot.id);
                }
            }
        }
        if write_session {
            match session {
                Some(s) => {
                    sessions.insert(node.to_owned(), s);
                }
                None => {
                    sessions.remove(node);
                }
            }
        }
        Ok(sessions.len() as u64)
    }

    async fn update_keys(&self, ids: &[KeyId], f: &mut KeyUpdate<'_>) -> Result<(), StoreError> {
        for (i, id) in ids.iter().enumerate() {
            let mut shard = self.shard(id);
            let mut slot = shard.get(id).cloned();
            match run_update(|| f(i, &mut slot)) {
                None => return Err(panicked(&format!("{}|{}", id.0, id.1))),
                Some(false) => continue,
                Some(true) => {}
            }
            match slot {
                Some(s) => {
                    shard.insert(id.clone(), s);
                }
                None => {
                    shard.remove(id);
                }
            }
        }
        Ok(())
    }

    async fn key_ids(&self) -> Result<Vec<KeyId>, StoreError> {
        let mut out = Vec::new();
        for shard in &self.keys {
            let shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            out.extend(shard.keys().cloned());
        }
        Ok(out)
    }

    async fn session_ids(&self) -> Result<Vec<String>, StoreError> {
        Ok(self
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect())
    }

    async fn session_count(&self) -> Result<u64, StoreError> {
        Ok(self.sessions.lock().unwrap_or_else(|e| e.into_inner()).len() as u64)
    }

    async fn key_count(&self) -> Result<u64, StoreError> {
        let mut n = 0;
        for shard in &self.keys {
            n += shard.lock().unwrap_or_else(|e| e.into_inner()).len() as u64;
        }
        Ok(n)
    }
}

/// Runs an update: whether to write its copy, or `None` if it panicked
/// (its copy is then dropped, and the stored record stays as it was).
fn run_update(f: impl FnOnce() -> bool) -> Option<bool> {
    run_step(f)
}

/// Runs a step: its result, or `None` if it panicked.
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
