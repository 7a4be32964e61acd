//! The in-memory host: a [`Host`] over headers, properties and a
//! shared-data store with Envoy's compare-and-swap semantics, in process
//! memory. Several hosts can share one store, as the worker VMs of one Envoy
//! share its shared data.
//!
//! Product code, not a test double: `tenantgate policy explain` runs the
//! filter's pipeline on it, the simulator (`central/src/sim/shipped.rs`)
//! runs the shipped engine and sync code of many nodes on it, and the
//! self-time bench build replays a request's calls on it. The core's native
//! tests use it too, with its fault injection (`fail_shared`,
//! `forced_conflicts`, `before_write`) standing in for a broken or racing
//! host.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use crate::host::{CasResult, Host, HostError};
use crate::stats::{Metric, Stats};

/// Envoy's shared data: value + CAS token per key; tokens never repeat.
#[derive(Debug, Clone, Default)]
pub struct SharedStore {
    entries: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
    /// Writes that failed their CAS check.
    pub conflicts: u64,
    /// Writes that landed.
    pub writes: u32,
}

impl SharedStore {
    pub fn new() -> Rc<RefCell<SharedStore>> {
        Rc::new(RefCell::new(SharedStore::default()))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.entries.keys()
    }

    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.entries.get(key).map(|(v, _)| v.as_slice())
    }
}

/// One request's view of the host.
#[derive(Debug, Clone)]
pub struct MemoryHost {
    pub headers: Vec<(String, Vec<u8>)>,
    /// The response's headers, body chunk and trailers (for the response
    /// callbacks), and the request's body chunk.
    pub response_headers: Vec<(String, Vec<u8>)>,
    pub response_body: Vec<u8>,
    pub response_trailers: Vec<(String, Vec<u8>)>,
    pub request_body: Vec<u8>,
    pub properties: Vec<(Vec<String>, Vec<u8>)>,
    pub store: Rc<RefCell<SharedStore>>,
    /// Makes every shared-data call fail, like a broken host.
    pub fail_shared: bool,
    /// Makes the next N writes conflict, like racing workers.
    pub forced_conflicts: Rc<RefCell<u32>>,
    /// Runs before each write, between this request's read and its
    /// compare-and-swap: lets a test slip other workers' requests in there.
    pub before_write: Rc<RefCell<Option<Hook>>>,
}

/// A closure run by [`MemoryHost`] (see `before_write`).
pub struct Hook(pub Box<dyn FnMut()>);

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hook")
    }
}

impl MemoryHost {
    pub fn new(store: Rc<RefCell<SharedStore>>) -> MemoryHost {
        MemoryHost {
            headers: Vec::new(),
            response_headers: Vec::new(),
            response_body: Vec::new(),
            response_trailers: Vec::new(),
            request_body: Vec::new(),
            properties: Vec::new(),
            store,
            fail_shared: false,
            forced_conflicts: Rc::new(RefCell::new(0)),
            before_write: Rc::new(RefCell::new(None)),
        }
    }

    pub fn header(mut self, name: &str, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.to_ascii_lowercase(), value.into()));
        self
    }

    pub fn response_header(mut self, name: &str, value: impl Into<Vec<u8>>) -> Self {
        self.response_headers
            .push((name.to_ascii_lowercase(), value.into()));
        self
    }

    pub fn property(mut self, path: &[&str], value: impl Into<Vec<u8>>) -> Self {
        self.properties
            .push((path.iter().map(|s| s.to_string()).collect(), value.into()));
        self
    }

    /// A request on a route whose `filter_metadata.tenantgate.class` is `class`.
    pub fn route_class(self, class: &str) -> Self {
        self.property(&crate::engine::ROUTE_CLASS_PROPERTY, class)
    }

    pub fn source(self, address: &str) -> Self {
        self.property(&crate::engine::SOURCE_ADDRESS_PROPERTY, address)
    }
}

impl Host for MemoryHost {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        let name = name.to_ascii_lowercase();
        self.response_headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    }

    fn response_body(&self, len: usize) -> Option<Vec<u8>> {
        Some(
            self.response_body
                .get(..len.min(self.response_body.len()))?
                .to_vec(),
        )
    }

    fn response_trailer(&self, name: &str) -> Option<Vec<u8>> {
        let name = name.to_ascii_lowercase();
        self.response_trailers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    }

    fn request_body(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        let end = offset.saturating_add(len).min(self.request_body.len());
        Some(self.request_body.get(offset.min(end)..end)?.to_vec())
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.properties
            .iter()
            .find(|(p, _)| p.iter().map(String::as_str).eq(path.iter().copied()))
            .map(|(_, v)| v.clone())
    }

    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        if self.fail_shared {
            return Err(HostError);
        }
        let store = self.store.borrow();
        Ok(match store.entries.get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        })
    }

    fn shared_get_into(&self, key: &str, out: &mut Vec<u8>) -> Result<Option<u32>, HostError> {
        if self.fail_shared {
            return Err(HostError);
        }
        let store = self.store.borrow();
        out.clear();
        Ok(store.entries.get(key).map(|(v, cas)| {
            out.extend_from_slice(v);
            *cas
        }))
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<CasResult, HostError> {
        if self.fail_shared {
            return Err(HostError);
        }
        // Take the hook out while it runs, so a request it makes cannot
        // re-enter it.
        let hook = self.before_write.borrow_mut().take();
        if let Some(mut hook) = hook {
            (hook.0)();
            *self.before_write.borrow_mut() = Some(hook);
        }
        let mut store = self.store.borrow_mut();
        {
            let mut forced = self.forced_conflicts.borrow_mut();
            if *forced > 0 {
                *forced -= 1;
                store.conflicts += 1;
                return Ok(CasResult::Conflict);
            }
        }
        // Envoy: a non-zero CAS must match an existing entry's token; a
        // zero CAS (None) or a missing key writes unconditionally.
        if let (Some(cas), Some((_, current))) = (cas, store.entries.get(key)) {
            if cas != *current {
                store.conflicts += 1;
                return Ok(CasResult::Conflict);
            }
        }
        store.next_cas = store.next_cas.wrapping_add(1).max(1);
        store.writes = store.writes.wrapping_add(1);
        let token = store.next_cas;
        // Rewrites an existing value in place, like Envoy (and so that a
        // test counting the engine's allocations counts only the engine's).
        match store.entries.get_mut(key) {
            Some(entry) => {
                entry.0.clear();
                entry.0.extend_from_slice(value);
                entry.1 = token;
            }
            None => {
                store.entries.insert(key.to_owned(), (value.to_vec(), token));
            }
        }
        Ok(CasResult::Written)
    }
}

/// Node-wide stats in memory (what `policy explain` prints and the native
/// tests read): every worker's [`MemoryStats`] clone adds to one map, as
/// every worker VM of one Envoy adds to one metric.
#[derive(Debug, Clone, Default)]
pub struct MemoryStats {
    values: Rc<RefCell<HashMap<String, i64>>>,
    name: String,
}

impl MemoryStats {
    /// A metric's value by its full name (0 if never defined or changed).
    pub fn value(&self, name: &str) -> i64 {
        self.values.borrow().get(name).copied().unwrap_or(0)
    }

    /// Every metric defined, by name.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.values.borrow().keys().cloned().collect();
        names.sort();
        names
    }

    fn with(&mut self, metric: &Metric<'_>, f: impl FnOnce(&mut i64)) {
        metric.name(&mut self.name);
        let mut values = self.values.borrow_mut();
        f(values.entry(self.name.clone()).or_insert(0));
    }
}

impl Stats for MemoryStats {
    fn define(&mut self, metric: &Metric<'_>) {
        self.with(metric, |_| {});
    }

    fn add(&mut self, metric: &Metric<'_>, n: i64) {
        self.with(metric, |v| *v = v.saturating_add(n));
    }

    fn set(&mut self, metric: &Metric<'_>, value: u64) {
        self.with(metric, |v| *v = i64::try_from(value).unwrap_or(i64::MAX));
    }

    fn get(&mut self, metric: &Metric<'_>) -> Option<u64> {
        metric.name(&mut self.name);
        self.values
            .borrow()
            .get(&self.name)
            .map(|v| u64::try_from(*v).unwrap_or(0))
    }
}
