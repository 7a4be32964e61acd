//! The embedded store: the records in the service's memory, behind sharded
//! mutexes (no lock is held across an `.await`). An update runs under its
//! record's shard lock, so it is atomic and never retried.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Mutex, MutexGuard};

use async_trait::async_trait;

use super::{KeyUpdate, SessionUpdate, Store, StoreError};
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

    fn shard(&self, id: &KeyId) -> MutexGuard<'_, HashMap<KeyId, KeyState>> {
        let mut h = DefaultHasher::new();
        id.hash(&mut h);
        let i = (h.finish() as usize) % self.keys.len();
        // A panic while holding the lock cannot leave a record half
        // written: records are replaced whole.
        self.keys[i].lock().unwrap_or_else(|e| e.into_inner())
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
        let mut slot = sessions.remove(node);
        f(&mut slot);
        if let Some(s) = slot {
            sessions.insert(node.to_owned(), s);
        }
        Ok(sessions.len() as u64)
    }

    async fn update_keys(&self, ids: &[KeyId], f: &mut KeyUpdate<'_>) -> Result<(), StoreError> {
        for (i, id) in ids.iter().enumerate() {
            let mut shard = self.shard(id);
            match shard.get_mut(id) {
                Some(ks) => {
                    let mut slot = Some(std::mem::replace(ks, KeyState::placeholder()));
                    f(i, &mut slot);
                    match slot {
                        Some(s) => *ks = s,
                        None => {
                            shard.remove(id);
                        }
                    }
                }
                None => {
                    let mut slot = None;
                    f(i, &mut slot);
                    if let Some(s) = slot {
                        shard.insert(id.clone(), s);
                    }
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

    async fn key_count(&self) -> Result<u64, StoreError> {
        let mut n = 0;
        for shard in &self.keys {
            n += shard.lock().unwrap_or_else(|e| e.into_inner()).len() as u64;
        }
        Ok(n)
    }
}
