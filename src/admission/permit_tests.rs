//! Permits (see [`PERMIT_SHARE`]) on explicit time, two workers over one
//! store: in flight never exceeds a limit (permits are published), permits
//! hold at most a quarter of a level's ceiling node-wide, a refusal comes
//! only when streams hold at least three quarters of it, every permit goes
//! back on the tick, and a hot dependency far from its limit is decided
//! mostly without shared data.

use std::cell::RefCell;
use std::rc::Rc;

use super::limits::pool_use;
use super::*;
use crate::engine;
use crate::memory::{MemoryHost, SharedStore};
use crate::policy::admission::Criticality;

const S: u64 = NANOS_PER_SEC;
const MS: u64 = 1_000_000;
const T0: u64 = 1_796_000_000 * S;

fn policy() -> Rc<Policy> {
    let json = r#"{"version": "permits-1", "identity": {"header": "x-tenant-id"},
        "plans": {"free": {"limits": [{"rate": 1000000000, "per": "1s"}]}},
        "default_plan": "free", "anonymous": {"plan": "free"},
        "dependencies": {"db": {"max_in_flight": 400, "reserved": {"critical": 40}}},
        "routes": {"orders": {"dependency": "db"}, "pay": {"criticality": "critical", "dependency": "db"}}}"#;
    Rc::new(Policy::from_json(json.as_bytes()).unwrap())
}

struct Node {
    store: Rc<RefCell<SharedStore>>,
}

impl Node {
    fn host(&self, class: &str) -> MemoryHost {
        MemoryHost::new(self.store.clone())
            .route_class(class)
            .header("x-tenant-id", "acme")
    }

    fn acquire(&self, w: &mut Worker, p: &Policy, class: &str, now: u64) -> Result<Ticket, Reason> {
        let host = self.host(class);
        let prep = engine::prepare(p, &host).unwrap();
        match w.acquire(&host, p, &prep.class, &prep.subject, now) {
            Ok(Some(t)) => Ok(t),
            Ok(None) => panic!("no dependency"),
            Err(r) => Err(r.reason),
        }
    }

    fn published(&self, now: u64) -> Counts {
        in_flight(&MemoryHost::new(self.store.clone()), "tg2|d|db", now).unwrap()
    }

    /// Shared-data writes so far (the store's compare-and-swap counter).
    fn writes(&self) -> u32 {
        self.store.borrow().writes
    }
}

#[test]
fn permits_never_let_in_flight_past_a_limit_and_refuse_only_near_it() {
    let p = policy();
    // The normal level's ceiling: the pool (400 − 40 reserved).
    let ceiling = 360u32;
    for seed in 0..10u64 {
        let node = Node {
            store: SharedStore::new(),
        };
        let mut workers = [Worker::with_id(1), Worker::with_id(2)];
        let mut held: Vec<(usize, Ticket)> = Vec::new();
        let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = || {
            rng = splitmix64(rng);
            rng
        };
        let mut refusals = 0;
        for t in 0..3_000u64 {
            let now = T0 + t * MS / 4;
            // Load that rises to the limit and falls back, in waves.
            let target = (t % 1_000) * 450 / 1_000;
            if (held.len() as u64) < target || next() % 3 == 0 {
                let w = (next() % 2) as usize;
                match node.acquire(&mut workers[w], &p, "orders", now) {
                    Ok(ticket) => held.push((w, ticket)),
                    Err(reason) => {
                        assert_eq!(reason, Reason::ConcurrencyLimit);
                        // Refused only when streams hold three quarters.
                        let streams = held.len() as u32;
                        assert!(
                            streams >= ceiling - ceiling / PERMIT_SHARE,
                            "seed {seed}: refused with {streams} in flight"
                        );
                        refusals += 1;
                    }
                }
            }
            if !held.is_empty() && (held.len() as u64 > target || next() % 2 == 0) {
                let i = (next() as usize) % held.len();
                let (w, ticket) = held.swap_remove(i);
                workers[w].release(&MemoryHost::new(node.store.clone()), ticket, now);
            }
            let published = node.published(now);
            // Published slots (streams and permits) never pass the limit,
            // nor the normal level's ceiling: permits are counted.
            assert!(published.in_flight() <= 400, "seed {seed}: {published:?}");
            assert!(pool_use(&Limits::of(p.dependency(0).unwrap()), &published) <= u64::from(ceiling));
            let permits = published.in_flight() - held.len() as u32;
            assert!(
                permits <= ceiling / PERMIT_SHARE,
                "seed {seed}: {permits} permits"
            );
            if t % 40 == 0 {
                let host = MemoryHost::new(node.store.clone());
                for w in &mut workers {
                    w.renew(&host, now);
                }
                // Every permit back on the tick.
                assert_eq!(node.published(now).in_flight(), held.len() as u32);
            }
        }
        assert!(refusals > 0, "seed {seed}: the waves reach the limit");
    }
}

#[test]
fn a_hot_dependency_far_from_its_limit_is_decided_mostly_without_shared_data() {
    let p = policy();
    let node = Node {
        store: SharedStore::new(),
    };
    let mut w = Worker::with_id(1);
    let host = MemoryHost::new(node.store.clone());
    let mut now = T0;
    // A tick of traffic (10 requests at a time, each ended at once) to
    // learn its rate, then the steady state.
    let decide = |w: &mut Worker, now: u64| {
        for _ in 0..200 {
            let t = node.acquire(w, &p, "orders", now).unwrap();
            w.release(&host, t, now);
        }
    };
    decide(&mut w, now);
    now += 10 * MS;
    w.renew(&host, now);
    let before = node.writes();
    for _ in 0..10 {
        decide(&mut w, now);
        now += 10 * MS;
        w.renew(&host, now);
    }
    let writes = node.writes() - before;
    println!("2,000 admissions and releases: {writes} shared-data writes");
    assert!(writes <= 40, "{writes} writes for 2,000 requests");
    // Critical (a reserved level) never takes permits.
    let c = node.acquire(&mut w, &p, "pay", now).unwrap();
    assert_eq!(node.published(now).levels[Criticality::Critical.index()], 1);
    w.release(&host, c, now);
}
