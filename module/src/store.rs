//! Node-wide state in process memory: the native host's shared data.
//!
//! The same contract as Envoy's shared data, which the core's
//! [`tenantgate::host::Host`] names and [`tenantgate::table::update`] is
//! written against: a value and a compare-and-swap token per key; a read
//! returns both; a write with a token lands only if the key still has that
//! token (a write with no token, or to a key that does not exist yet,
//! lands unconditionally); every landed write gives the key a new token;
//! there is no delete. So every bound the table proves (its CAS loop, its
//! placement, its overflow) holds on this store unchanged: the table's code
//! is the one that runs.
//!
//! # Shape
//! [`SHARDS`] maps, each behind its own mutex, a key going to the shard of
//! its FNV-1a hash. One operation locks one shard for a copy (a read) or a
//! compare and a copy (a write), so workers on different keys do not wait
//! for each other, and workers on one key serialize exactly where Envoy's
//! single shared-data mutex would serialize them. A poisoned shard (a panic
//! while it was held: it only copies bytes) is used as it is.
//!
//! # Tokens
//! A key's token counts its writes from 1 and skips 0 when it wraps (0 is
//! Envoy's "no token"). A token repeats for a key only after 2³² writes to
//! it; an update that read the key and is then overtaken by exactly 2³²
//! writes before its own write is the only ABA, as with Envoy's counter.
//!
//! # Memory
//! An entry is its key and its value in one allocation (`key ‖ value`) plus
//! its token: 24 bytes in the map, the bytes themselves, the allocator's
//! header. A value rewritten at the same length or shorter is rewritten in
//! place. Like shared data, nothing is ever removed: the key table bounds
//! the number of keys.

use std::sync::{Mutex, MutexGuard, PoisonError};

use hashbrown::HashTable;
use tenantgate::host::{CasResult, HostError};

/// Maps in the store: a power of two, a few times the workers of any
/// machine, so two workers rarely meet on one shard.
pub const SHARDS: usize = 64;

/// One key's entry: `key ‖ value` and the key's length, and its token.
struct Entry {
    bytes: Box<[u8]>,
    key_len: u32,
    cas: u32,
}

impl Entry {
    fn value(&self) -> &[u8] {
        self.bytes.get(self.key_len as usize..).unwrap_or_default()
    }

    fn set(&mut self, key: &str, value: &[u8]) {
        let len = key.len().saturating_add(value.len());
        if self.bytes.len() == len {
            if let Some(v) = self.bytes.get_mut(key.len()..) {
                v.copy_from_slice(value);
                return;
            }
        }
        self.bytes = joined(key, value);
    }

    fn next_cas(&mut self) {
        self.cas = match self.cas.wrapping_add(1) {
            0 => 1,
            n => n,
        };
    }
}

fn joined(key: &str, value: &[u8]) -> Box<[u8]> {
    let mut bytes = Vec::with_capacity(key.len().saturating_add(value.len()));
    bytes.extend_from_slice(key.as_bytes());
    bytes.extend_from_slice(value);
    bytes.into_boxed_slice()
}

/// A shard: entries found by the FNV-1a hash of their key, the key
/// compared on a match.
#[derive(Default)]
struct Shard {
    entries: HashTable<Entry>,
}

impl Entry {
    fn key(&self) -> &[u8] {
        self.bytes.get(..self.key_len as usize).unwrap_or_default()
    }
}

fn hash_of(entry: &Entry) -> u64 {
    tenantgate::table::fnv1a64(entry.key())
}

/// The store (see the module header). `Send + Sync`: one per process.
pub struct Store {
    shards: Box<[Mutex<Shard>]>,
}

impl Default for Store {
    fn default() -> Store {
        Store {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
        }
    }
}

impl Store {
    fn shard(&self, hash: u64) -> Result<MutexGuard<'_, Shard>, HostError> {
        let index = usize::try_from(hash >> 58).unwrap_or(0) % SHARDS;
        let shard = self.shards.get(index).ok_or(HostError)?;
        Ok(shard.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Reads `key` into `out` (cleared; empty if absent) and returns its
    /// token (`None`: absent).
    pub fn get_into(&self, key: &str, out: &mut Vec<u8>) -> Result<Option<u32>, HostError> {
        let hash = tenantgate::table::fnv1a64(key.as_bytes());
        let shard = self.shard(hash)?;
        out.clear();
        Ok(shard.entries.find(hash, |e| e.key() == key.as_bytes()).map(|e| {
            out.extend_from_slice(e.value());
            e.cas
        }))
    }

    /// Writes `value` if `key`'s token still is `cas` (see the module header).
    pub fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<CasResult, HostError> {
        let key_len = u32::try_from(key.len()).map_err(|_| HostError)?;
        let hash = tenantgate::table::fnv1a64(key.as_bytes());
        let mut shard = self.shard(hash)?;
        if let Some(entry) = shard.entries.find_mut(hash, |e| e.key() == key.as_bytes()) {
            if cas.is_some_and(|c| c != entry.cas) {
                return Ok(CasResult::Conflict);
            }
            entry.set(key, value);
            entry.next_cas();
            return Ok(CasResult::Written);
        }
        let entry = Entry {
            bytes: joined(key, value),
            key_len,
            cas: 1,
        };
        shard.entries.insert_unique(hash, entry, hash_of);
        Ok(CasResult::Written)
    }

    /// Keys in the store (tests, stats).
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.lock().unwrap_or_else(PoisonError::into_inner);
                s.entries.len()
            })
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests;
