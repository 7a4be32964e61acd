use std::sync::Arc;

use tenantgate::engine::{self, Scratch};
use tenantgate::host::{CasResult, Host, HostError};
use tenantgate::memory::{MemoryHost, SharedStore};
use tenantgate::policy::Policy;

use super::Store;

const S: u64 = 1_000_000_000;
const T0: u64 = 1_796_000_000 * S;

/// The store as a host with no stream: what the shipped engine charges
/// through in these tests.
struct StoreHost<'a>(&'a Store);

impl Host for StoreHost<'_> {
    fn request_header(&self, _: &str) -> Option<Vec<u8>> {
        None
    }
    fn response_header(&self, _: &str) -> Option<Vec<u8>> {
        None
    }
    fn response_body(&self, _: usize) -> Option<Vec<u8>> {
        None
    }
    fn response_trailer(&self, _: &str) -> Option<Vec<u8>> {
        None
    }
    fn request_body(&self, _: usize, _: usize) -> Option<Vec<u8>> {
        None
    }
    fn property(&self, _: &[&str]) -> Option<Vec<u8>> {
        None
    }
    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        let mut out = Vec::new();
        let cas = self.0.get_into(key, &mut out)?;
        Ok((cas.map(|_| out), cas))
    }
    fn shared_get_into(&self, key: &str, out: &mut Vec<u8>) -> Result<Option<u32>, HostError> {
        self.0.get_into(key, out)
    }
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<CasResult, HostError> {
        self.0.set(key, value, cas)
    }
    fn shared_create(&self, key: &str, value: &[u8]) -> Result<CasResult, HostError> {
        self.0.create(key, value)
    }
}

/// Envoy's shared-data contract, case by case, on this store and on the
/// in-memory host the core's tests use: the same answers.
#[test]
fn the_compare_and_swap_contract_is_envoys() {
    let native = Store::default();
    let memory = MemoryHost::new(SharedStore::new());
    let hosts: [&dyn Host; 2] = [&StoreHost(&native), &memory];
    for h in hosts {
        assert_eq!(h.shared_get("k").unwrap(), (None, None), "absent");
        // No token, or a token for a key that does not exist: written.
        assert_eq!(h.shared_set("k", b"one", Some(77)).unwrap(), CasResult::Written);
        let (v, first) = h.shared_get("k").unwrap();
        assert_eq!(v.as_deref(), Some(&b"one"[..]));
        let first = first.expect("a token");
        assert_ne!(first, 0, "0 is Envoy's no-token");
        // The token read: written, with a new token.
        assert_eq!(
            h.shared_set("k", b"two!", Some(first)).unwrap(),
            CasResult::Written
        );
        let (v, second) = h.shared_get("k").unwrap();
        assert_eq!(v.as_deref(), Some(&b"two!"[..]));
        assert_ne!(second, Some(first));
        // A stale token: refused, the value unchanged.
        assert_eq!(
            h.shared_set("k", b"lost", Some(first)).unwrap(),
            CasResult::Conflict
        );
        assert_eq!(h.shared_get("k").unwrap().0.as_deref(), Some(&b"two!"[..]));
        // No token: written whatever the key holds.
        assert_eq!(h.shared_set("k", b"", None).unwrap(), CasResult::Written);
        assert_eq!(h.shared_get("k").unwrap().0.as_deref(), Some(&b""[..]));
        // Keys are exact: a prefix or an extension is another key.
        assert_eq!(h.shared_get("").unwrap(), (None, None));
        assert_eq!(h.shared_get("kk").unwrap(), (None, None));
    }
    assert_eq!(native.len(), 1);
}

/// A value rewritten shorter, longer and at the same length reads back
/// whole, for many keys across every shard.
#[test]
fn values_of_any_length_read_back_across_shards() {
    let store = Store::default();
    let mut out = Vec::new();
    for i in 0..2_000u32 {
        let key = format!("tg2|k|{i}");
        for len in [40usize, 8, 8, 300, 0, 41] {
            let value: Vec<u8> = (0..len).map(|b| (b as u32 ^ i) as u8).collect();
            let cas = store.get_into(&key, &mut out).unwrap();
            assert_eq!(store.set(&key, &value, cas).unwrap(), CasResult::Written);
            store.get_into(&key, &mut out).unwrap();
            assert_eq!(out, value, "{key} at {len}");
        }
    }
    assert_eq!(store.len(), 2_000);
}

fn policy_json(limits: &str, cost: u64) -> String {
    format!(
        r#"{{"version": "native-1",
            "identity": {{"header": "x-tenant-id"}},
            "plans": {{"free": {{"limits": [{limits}]}}}},
            "default_plan": "free",
            "anonymous": {{"plan": "free"}},
            "routes": {{"api": {{"action": "api", "cost": {cost}}}}},
            "default_route": "api"}}"#
    )
}

/// `threads` threads, each with its own policy compiled from `json` (a
/// policy holds `Rc`s: nothing of it crosses threads), charging `tenants`
/// in turn `each` times through the shipped engine and `table::update` on
/// one store at `now`. Returns the admissions.
fn race(json: &str, store: &Arc<Store>, threads: usize, each: usize, tenants: &[&str], now: u64) -> u64 {
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let (json, store) = (json.to_owned(), store.clone());
            let tenants: Vec<String> = tenants.iter().map(|t| t.to_string()).collect();
            std::thread::spawn(move || {
                let policy = Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
                let prepared: Vec<_> = tenants
                    .iter()
                    .map(|t| {
                        let h = MemoryHost::new(SharedStore::new()).header("x-tenant-id", t.as_str());
                        engine::prepare(&policy, &h).unwrap()
                    })
                    .collect();
                let host = StoreHost(&store);
                let mut scratch = Scratch::default();
                let mut admitted = 0u64;
                for n in 0..each {
                    let req = &prepared[(i + n) % prepared.len()];
                    let d = engine::charge(&policy, req, &host, now, &mut scratch);
                    // A CAS loop exhausted under this contention denies
                    // (503, counted): never an admission, so the bound holds.
                    if d.deny_status().is_none() {
                        admitted += 1;
                    }
                }
                admitted
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).sum()
}

/// THE BOUND, on this store: eight threads racing for one tenant's bucket
/// (100/min, burst 100; 10,000/min, burst 10,000) at one instant admit
/// exactly the burst, never one more, with costs of 1 and 5; with three
/// tenants, each admits its own burst.
#[test]
fn racing_threads_never_admit_past_the_burst() {
    for (limits, cost, burst) in [
        (r#"{"rate": 100, "per": "1m"}"#, 1u64, 100u64),
        (r#"{"rate": 10000, "per": "1m"}"#, 1, 10_000),
        (r#"{"rate": 100, "per": "1m"}"#, 5, 100),
    ] {
        let json = policy_json(limits, cost);
        let each = usize::try_from(burst / cost).unwrap(); // 8× the burst in all
        let admitted = race(&json, &Arc::new(Store::default()), 8, each, &["acme"], T0);
        assert_eq!(admitted * cost, burst, "{limits} cost {cost}");
        let admitted = race(&json, &Arc::new(Store::default()), 8, each, &["a", "b", "c"], T0);
        assert_eq!(admitted * cost, 3 * burst, "{limits} cost {cost}, three tenants");
    }
}

/// Over time, too: threads charging one tenant at 100/min (burst 100) as
/// the clock moves 10 s in steps admit at most burst + rate × elapsed.
#[test]
fn racing_threads_over_time_stay_within_burst_plus_refill() {
    let json = policy_json(r#"{"rate": 100, "per": "1m"}"#, 1);
    let store = Arc::new(Store::default());
    let mut admitted = 0;
    for step in 0..=10u64 {
        admitted += race(&json, &store, 4, 100, &["acme"], T0 + step * S);
    }
    // 100 + 100/min × 10 s = 116.67: at most 116 whole tokens.
    assert!(admitted <= 116, "{admitted}");
    assert!(admitted >= 115, "{admitted}: refill lost");
}
