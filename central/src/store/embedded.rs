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
//!
//! # Memory
//! Records are kept encoded (format 3, `store::codec`), each in one
//! allocation with its name and version ([`Entry`]), in hash tables of
//! those entries alone: a (key, limit) one node holds takes 188 bytes with
//! its name, version and share of the table (`make bench-service-memory`;
//! decoded records took 4.7 KiB per key, sessions included). A copy is a
//! decode, a write an encode: the same work as the clone it replaces, done
//! once per record a request touches.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

use async_trait::async_trait;
use hashbrown::{DefaultHashBuilder as RandomState, HashTable};

use super::redis::MAX_ATTEMPTS;
use super::{decode, encode_into, KeySlot, KeyUpdate, Record, SessionUpdate, Store, StoreError, Txn};
use crate::alloc::{KeyId, KeyState, Session};

const SHARDS: usize = 64;

/// One record in one allocation: `[key length: u16][limit length: u16]
/// [key][limit][version: u64][format byte][record]` (little-endian). A
/// session's name is its node id, with an empty limit. The version is the
/// one it was last written at, unique across the store: a record deleted
/// and created again never has an old version.
struct Entry(Box<[u8]>);

const HEAD: usize = 4;
const VERSION_LEN: usize = 8;

impl Entry {
    fn new<T: Record>(key: &str, limit: &str, version: u64, record: &T) -> Result<Entry, StoreError> {
        let too_long = || StoreError::Refused(format!("record name {key}|{limit} over 64 KiB"));
        let k = u16::try_from(key.len()).map_err(|_| too_long())?;
        let l = u16::try_from(limit.len()).map_err(|_| too_long())?;
        // Encoded into this thread's scratch buffer, then copied into an
        // allocation of its exact size (shrinking a `Vec` in place cost a
        // `realloc` per record).
        thread_local! {
            static SCRATCH: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
        }
        let mut b = SCRATCH.with(|s| s.take());
        b.clear();
        b.extend_from_slice(&k.to_le_bytes());
        b.extend_from_slice(&l.to_le_bytes());
        b.extend_from_slice(key.as_bytes());
        b.extend_from_slice(limit.as_bytes());
        b.extend_from_slice(&version.to_le_bytes());
        let encoded = encode_into(&mut b, key, record);
        let entry = Entry(Box::from(b.as_slice()));
        SCRATCH.with(|s| s.set(b));
        encoded.map(|()| entry)
    }

    fn lens(&self) -> (usize, usize) {
        let n = |i: usize| usize::from(u16::from_le_bytes([self.0[i], self.0[i + 1]]));
        (n(0), n(2))
    }

    fn name(&self) -> (&[u8], &[u8]) {
        let (k, l) = self.lens();
        (&self.0[HEAD..HEAD + k], &self.0[HEAD + k..HEAD + k + l])
    }

    fn version(&self) -> u64 {
        let (k, l) = self.lens();
        let at = HEAD + k + l;
        let mut v = [0u8; VERSION_LEN];
        v.copy_from_slice(&self.0[at..at + VERSION_LEN]);
        u64::from_le_bytes(v)
    }

    fn decode<T: Record>(&self) -> Result<T, StoreError> {
        let (k, l) = self.lens();
        let (key, _) = self.name();
        decode(
            &String::from_utf8_lossy(key),
            &self.0[HEAD + k + l + VERSION_LEN..],
        )
    }

    /// Bytes it takes in the heap (without malloc's overhead).
    fn size(&self) -> usize {
        self.0.len()
    }
}

/// Entries by name: a hash table of [`Entry`] alone (no separate key).
struct Table {
    entries: HashTable<Entry>,
}

fn name_hash(hasher: &RandomState, key: &[u8], limit: &[u8]) -> u64 {
    let mut h = hasher.build_hasher();
    h.write(key);
    h.write_u8(0xff); // not in UTF-8: ("ab", "c") and ("a", "bc") differ
    h.write(limit);
    h.finish()
}

impl Table {
    fn new() -> Table {
        Table {
            entries: HashTable::new(),
        }
    }

    fn get(&self, hash: u64, key: &str, limit: &str) -> Option<&Entry> {
        self.entries
            .find(hash, |e| e.name() == (key.as_bytes(), limit.as_bytes()))
    }

    /// Writes `entry` under its name (`None`: deletes the name).
    fn put(&mut self, hasher: &RandomState, hash: u64, key: &str, limit: &str, entry: Option<Entry>) {
        let found = self
            .entries
            .find_entry(hash, |e| e.name() == (key.as_bytes(), limit.as_bytes()));
        match (found, entry) {
            (Ok(mut o), Some(e)) => *o.get_mut() = e,
            (Ok(o), None) => {
                o.remove();
            }
            (Err(_), Some(e)) => {
                self.entries.insert_unique(hash, e, |e| {
                    let (k, l) = e.name();
                    name_hash(hasher, k, l)
                });
            }
            (Err(_), None) => {}
        }
    }

    fn len(&self) -> usize {
        self.entries.len()
    }

    fn names(&self) -> impl Iterator<Item = (String, String)> + '_ {
        self.entries.iter().map(|e| {
            let (k, l) = e.name();
            (
                String::from_utf8_lossy(k).into_owned(),
                String::from_utf8_lossy(l).into_owned(),
            )
        })
    }

    /// Heap bytes: every entry's allocation and the table's slots.
    fn bytes(&self) -> usize {
        let entries: usize = self.entries.iter().map(Entry::size).sum();
        entries + self.entries.capacity() * (std::mem::size_of::<Entry>() + 1)
    }
}

/// The default store: one process, nothing to start, state lost on exit.
pub struct EmbeddedStore {
    keys: Vec<Mutex<Table>>,
    sessions: Mutex<Table>,
    next_version: AtomicU64,
    hasher: RandomState,
}

impl Default for EmbeddedStore {
    fn default() -> EmbeddedStore {
        EmbeddedStore {
            keys: (0..SHARDS).map(|_| Mutex::new(Table::new())).collect(),
            sessions: Mutex::new(Table::new()),
            next_version: AtomicU64::new(1),
            // Seeded at random per process: a flood of crafted names
            // cannot pile into one bucket.
            hasher: RandomState::default(),
        }
    }
}

/// Heap bytes the records take (see [`EmbeddedStore::footprint`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Footprint {
    pub keys: u64,
    pub key_bytes: u64,
    pub sessions: u64,
    pub session_bytes: u64,
}

impl EmbeddedStore {
    pub fn new() -> EmbeddedStore {
        EmbeddedStore::default()
    }

    fn hash(&self, id: &KeyId) -> u64 {
        name_hash(&self.hasher, id.0.as_bytes(), id.1.as_bytes())
    }

    fn shard_of(&self, hash: u64) -> usize {
        // The table uses the hash's top bits; the shard its low ones.
        (hash as usize) % self.keys.len()
    }

    fn lock_shard(&self, i: usize) -> MutexGuard<'_, Table> {
        // A panic while holding the lock cannot leave a record half
        // written: entries are replaced whole.
        self.keys[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    fn sessions(&self) -> MutexGuard<'_, Table> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn version(&self) -> u64 {
        self.next_version.fetch_add(1, Relaxed)
    }

    /// The heap bytes of every record with its name, version and table
    /// slot (without malloc's per-allocation overhead, 8 to 16 bytes): what
    /// `make bench-service-memory` divides by the records.
    pub fn footprint(&self) -> Footprint {
        let mut f = Footprint::default();
        for i in 0..self.keys.len() {
            let t = self.lock_shard(i);
            f.keys += t.len() as u64;
            f.key_bytes += t.bytes() as u64;
        }
        let s = self.sessions();
        f.sessions = s.len() as u64;
        f.session_bytes = s.bytes() as u64;
        f
    }

    fn session_hash(&self, node: &str) -> u64 {
        name_hash(&self.hasher, node.as_bytes(), b"")
    }

    /// A decoded copy of an entry and its version.
    fn read<T: Record>(entry: Option<&Entry>) -> Result<(Option<T>, Option<u64>), StoreError> {
        match entry {
            None => Ok((None, None)),
            Some(e) => Ok((Some(e.decode()?), Some(e.version()))),
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
        let hash = self.session_hash(node);
        let mut sessions = self.sessions();
        let (mut slot, _) = Self::read::<Session>(sessions.get(hash, node, ""))?;
        match run_step(|| f(&mut slot)) {
            None => return Err(panicked(node)),
            Some(false) => return Ok(sessions.len() as u64),
            Some(true) => {}
        }
        let entry = slot
            .map(|s| Entry::new(node, "", self.version(), &s))
            .transpose()?;
        sessions.put(&self.hasher, hash, node, "", entry);
        Ok(sessions.len() as u64)
    }

    async fn update_request(&self, node: &str, txn: &mut (dyn Txn + '_)) -> Result<u64, StoreError> {
        let session_hash = self.session_hash(node);
        for _ in 0..MAX_ATTEMPTS {
            // Read: decoded copies and their versions, each under its lock
            // briefly.
            let (mut session, session_version, count) = {
                let sessions = self.sessions();
                let (s, v) = Self::read::<Session>(sessions.get(session_hash, node, ""))?;
                (s, v, sessions.len() as u64)
            };
            let ids = match run_step(|| txn.begin(&mut session, count)) {
                None => return Err(panicked(node)),
                Some(None) => return Ok(count),
                Some(Some(ids)) => ids,
            };
            let hashes: Vec<u64> = ids.iter().map(|id| self.hash(id)).collect();
            let shard_of: Vec<usize> = hashes.iter().map(|&h| self.shard_of(h)).collect();
            let mut versions: Vec<Option<u64>> = Vec::with_capacity(ids.len());
            let mut slots: Vec<KeySlot> = Vec::with_capacity(ids.len());
            for ((id, &i), &h) in ids.into_iter().zip(&shard_of).zip(&hashes) {
                let (record, version) = {
                    let shard = self.lock_shard(i);
                    Self::read::<KeyState>(shard.get(h, &id.0, &id.1))?
                };
                versions.push(version);
                slots.push(KeySlot {
                    record,
                    id,
                    write: false,
                });
            }
            // The steps, with no lock held.
            let write_session = match run_step(|| txn.apply(&mut session, &mut slots)) {
                None => return Err(panicked(node)),
                Some(w) => w,
            };
            // Encode before any lock is taken.
            let version = self.version();
            let mut writes: Vec<Option<Option<Entry>>> = Vec::with_capacity(slots.len());
            for slot in &slots {
                writes.push(if slot.write {
                    Some(
                        slot.record
                            .as_ref()
                            .map(|ks| Entry::new(&slot.id.0, &slot.id.1, version, ks))
                            .transpose()?,
                    )
                } else {
                    None
                });
            }
            let session_write = if write_session {
                Some(
                    session
                        .as_ref()
                        .map(|s| Entry::new(node, "", version, s))
                        .transpose()?,
                )
            } else {
                None
            };
            // Commit: every version as read, then every write.
            let mut sessions = self.sessions();
            let mut order = shard_of.clone();
            order.sort_unstable();
            order.dedup();
            let mut shards: BTreeMap<usize, MutexGuard<'_, Table>> = BTreeMap::new();
            for i in order {
                shards.insert(i, self.lock_shard(i));
            }
            let unmoved = sessions.get(session_hash, node, "").map(Entry::version) == session_version
                && slots.iter().zip(shard_of.iter().zip(&hashes)).zip(&versions).all(
                    |((slot, (i, &h)), read)| {
                        shards
                            .get(i)
                            .is_some_and(|s| s.get(h, &slot.id.0, &slot.id.1).map(Entry::version) == *read)
                    },
                );
            if !unmoved {
                continue;
            }
            for ((slot, write), (i, &h)) in slots.iter().zip(writes).zip(shard_of.iter().zip(&hashes)) {
                if let (Some(entry), Some(shard)) = (write, shards.get_mut(i)) {
                    shard.put(&self.hasher, h, &slot.id.0, &slot.id.1, entry);
                }
            }
            if let Some(entry) = session_write {
                sessions.put(&self.hasher, session_hash, node, "", entry);
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
            let h = self.hash(id);
            let mut shard = self.lock_shard(self.shard_of(h));
            let (mut slot, _) = Self::read::<KeyState>(shard.get(h, &id.0, &id.1))?;
            match run_step(|| f(i, &mut slot)) {
                None => return Err(panicked(&format!("{}|{}", id.0, id.1))),
                Some(false) => continue,
                Some(true) => {}
            }
            let entry = slot
                .map(|ks| Entry::new(&id.0, &id.1, self.version(), &ks))
                .transpose()?;
            shard.put(&self.hasher, h, &id.0, &id.1, entry);
        }
        Ok(())
    }

    async fn key_ids(&self) -> Result<Vec<KeyId>, StoreError> {
        let mut out = Vec::new();
        for i in 0..self.keys.len() {
            out.extend(self.lock_shard(i).names());
        }
        Ok(out)
    }

    async fn session_ids(&self) -> Result<Vec<String>, StoreError> {
        Ok(self.sessions().names().map(|(node, _)| node).collect())
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
                    let h = self.store.hash(&self.id);
                    let mut shard = self.store.lock_shard(self.store.shard_of(h));
                    let mut ks: KeyState = shard.get(h, &self.id.0, &self.id.1).unwrap().decode().unwrap();
                    ks.retarget(limit(7), 1);
                    let e = Entry::new(&self.id.0, &self.id.1, self.store.version(), &ks).unwrap();
                    shard.put(&self.store.hasher, h, &self.id.0, &self.id.1, Some(e));
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
                month: 0,
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
            month: 0,
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
                            month: 0,
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
