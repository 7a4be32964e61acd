//! The in-flight core on explicit time, with the in-memory host: two workers
//! (two [`Worker`]s over one [`SharedStore`], like two worker VMs).

use std::cell::RefCell;
use std::rc::Rc;

use super::request::{self, BodyBudget, Declared};
use super::*;
use crate::engine::{self, Prepared};
use crate::memory::{MemoryHost, SharedStore};
use crate::policy::admission::Criticality;
use crate::policy::Policy;
use crate::table::Overflow;

const S: u64 = NANOS_PER_SEC;
const T0: u64 = 1_796_000_000 * S;

/// `db`: 10 slots, 2 reserved for critical, 1 for system (pool G = 7).
fn policy(db_extra: &str) -> Rc<Policy> {
    let json = format!(
        r#"{{
        "version": "adm-1",
        "identity": {{"header": "x-tenant-id"}},
        "plans": {{"free": {{"limits": [{{"rate": 1000000, "per": "1s"}}]}}}},
        "default_plan": "free",
        "anonymous": {{"plan": "free"}},
        "dependencies": {{
            "db": {{"max_in_flight": 10, "reserved": {{"critical": 2, "system": 1}} {db_extra}}},
            "events": {{"max_in_flight": 5, "max_streams": 3}}
        }},
        "routes": {{
            "health": {{"criticality": "system", "dependency": "db"}},
            "pay": {{"criticality": "critical", "dependency": "db"}},
            "orders": {{"dependency": "db"}},
            "orders-retry": {{"dependency": "db", "retryable": true}},
            "reports": {{"criticality": "sheddable", "dependency": "db"}},
            "reports-retry": {{"criticality": "sheddable", "retryable": true, "dependency": "db"}},
            "feed": {{"dependency": "events", "streaming": true}},
            "plain": {{}}
        }}
    }}"#
    );
    match Policy::from_json(json.as_bytes()) {
        Ok(p) => Rc::new(p),
        Err(e) => panic!("test policy invalid: {e}"),
    }
}

struct Node {
    store: Rc<RefCell<SharedStore>>,
}

impl Node {
    fn new() -> Node {
        Node {
            store: SharedStore::new(),
        }
    }

    fn host(&self, class: &str, tenant: &str) -> MemoryHost {
        MemoryHost::new(self.store.clone())
            .route_class(class)
            .header("x-tenant-id", tenant)
    }

    fn prepared(&self, p: &Policy, class: &str, tenant: &str) -> (MemoryHost, Prepared) {
        let host = self.host(class, tenant);
        let prepared = engine::prepare(p, &host).unwrap();
        (host, prepared)
    }

    fn acquire(
        &self,
        w: &mut Worker,
        p: &Policy,
        class: &str,
        tenant: &str,
        now: u64,
    ) -> Result<Ticket, Reason> {
        let (host, prep) = self.prepared(p, class, tenant);
        match w.acquire(&host, p, &prep.class, &prep.subject, now) {
            Ok(Some(t)) => Ok(t),
            Ok(None) => panic!("{class} has no dependency"),
            Err(r) => Err(r.reason),
        }
    }

    fn live(&self, key: &str, now: u64) -> Counts {
        in_flight(&MemoryHost::new(self.store.clone()), key, now).unwrap()
    }

    fn total(&self, now: u64) -> u32 {
        self.live("tg2|d|db", now).in_flight()
    }
}

fn release(node: &Node, w: &mut Worker, t: Ticket, now: u64) {
    w.release(&MemoryHost::new(node.store.clone()), t, now);
}

#[test]
fn a_class_without_admission_labels_takes_nothing_and_writes_nothing() {
    let p = policy("");
    let node = Node::new();
    let mut w = Worker::with_id(1);
    let (host, prep) = node.prepared(&p, "plain", "acme");
    assert!(!prep.class.labels.checks_anything());
    assert_eq!(w.acquire(&host, &p, &prep.class, &prep.subject, T0), Ok(None));
    assert!(node.store.borrow().is_empty());
}

#[test]
fn slots_are_counted_node_wide_across_two_workers_and_come_back() {
    let p = policy("");
    let node = Node::new();
    let (mut a, mut b) = (Worker::with_id(1), Worker::with_id(2));
    let mut tickets = Vec::new();
    // The pool (7) fills from both workers alternately.
    for i in 0..7 {
        let w = if i % 2 == 0 { &mut a } else { &mut b };
        tickets.push((i % 2, node.acquire(w, &p, "orders", "acme", T0).unwrap()));
    }
    assert_eq!(node.total(T0), 7);
    assert_eq!(
        node.acquire(&mut a, &p, "orders", "acme", T0),
        Err(Reason::ConcurrencyLimit)
    );
    assert_eq!(
        node.acquire(&mut b, &p, "orders", "acme", T0),
        Err(Reason::ConcurrencyLimit)
    );
    // A slot freed on one worker is usable from the other.
    let (_, t) = tickets.pop().unwrap();
    release(&node, &mut a, t, T0);
    assert_eq!(node.total(T0), 6);
    tickets.push((1, node.acquire(&mut b, &p, "orders", "acme", T0).unwrap()));
    for (owner, t) in tickets {
        let w = if owner == 0 { &mut a } else { &mut b };
        release(&node, w, t, T0);
    }
    assert_eq!(node.total(T0), 0);
    assert!(a.own("tg2|d|db").is_zero() && b.own("tg2|d|db").is_zero());
}

#[test]
fn reservations_are_never_borrowed_and_system_passes_a_saturated_dependency() {
    let p = policy("");
    let node = Node::new();
    let mut w = Worker::with_id(1);
    let mut held = Vec::new();
    // Normal traffic fills the pool, never the reservations.
    while let Ok(t) = node.acquire(&mut w, &p, "orders", "acme", T0) {
        held.push(t);
    }
    assert_eq!(held.len(), 7);
    assert_eq!(
        node.acquire(&mut w, &p, "reports", "acme", T0),
        Err(Reason::ConcurrencyLimit)
    );
    // Critical gets exactly its reservation, no more.
    for _ in 0..2 {
        held.push(node.acquire(&mut w, &p, "pay", "acme", T0).unwrap());
    }
    assert_eq!(
        node.acquire(&mut w, &p, "pay", "acme", T0),
        Err(Reason::ConcurrencyLimit)
    );
    // System gets its own, while everything else is saturated.
    held.push(node.acquire(&mut w, &p, "health", "acme", T0).unwrap());
    assert_eq!(
        node.acquire(&mut w, &p, "health", "acme", T0),
        Err(Reason::ConcurrencyLimit)
    );
    assert_eq!(node.total(T0), 10);
    for t in held {
        release(&node, &mut w, t, T0);
    }

    // Critical and system fill the pool first: the reservations stay theirs
    // and normal work never gets beyond what is left of the pool.
    let mut held = Vec::new();
    for _ in 0..9 {
        held.push(node.acquire(&mut w, &p, "pay", "acme", T0).unwrap());
    }
    assert_eq!(
        node.acquire(&mut w, &p, "pay", "acme", T0),
        Err(Reason::ConcurrencyLimit)
    );
    assert_eq!(
        node.acquire(&mut w, &p, "orders", "acme", T0),
        Err(Reason::ConcurrencyLimit)
    );
    held.push(node.acquire(&mut w, &p, "health", "acme", T0).unwrap());
    assert_eq!(node.total(T0), 10);
    for t in held {
        release(&node, &mut w, t, T0);
    }
    assert_eq!(node.total(T0), 0);
}

#[test]
fn sheddable_then_normal_and_retryable_first_within_a_level() {
    let p = policy("");
    let node = Node::new();
    let mut w = Worker::with_id(1);
    // Pool 7: ceilings 70 % → 4, 80 % → 5, 90 % → 6, 100 % → 7.
    assert_eq!(p.dependency(0).unwrap().general(), 7);
    assert_eq!(
        [
            ceiling(7, Criticality::Sheddable, true),
            ceiling(7, Criticality::Sheddable, false),
            ceiling(7, Criticality::Normal, true),
            ceiling(7, Criticality::Normal, false)
        ],
        [4, 5, 6, 7]
    );
    // Critical load rises one slot at a time (its 2 reserved first, then
    // the pool); at each step, which classes are refused?
    let order = ["reports-retry", "reports", "orders-retry", "orders"];
    let mut first_refused: Vec<(&str, usize)> = Vec::new();
    let mut held = Vec::new();
    for critical in 0..=9 {
        for class in order {
            match node.acquire(&mut w, &p, class, "acme", T0) {
                Ok(t) => release(&node, &mut w, t, T0),
                Err(r) => {
                    assert_eq!(r, Reason::ConcurrencyLimit);
                    if !first_refused.iter().any(|(c, _)| *c == class) {
                        first_refused.push((class, critical));
                    }
                }
            }
        }
        if critical < 9 {
            held.push(node.acquire(&mut w, &p, "pay", "acme", T0).unwrap());
        }
    }
    // Pool use is critical − 2: each class is refused once it reaches the
    // class's ceiling, in the shedding order.
    assert_eq!(
        first_refused,
        [
            ("reports-retry", 6),
            ("reports", 7),
            ("orders-retry", 8),
            ("orders", 9)
        ]
    );
    for t in held {
        release(&node, &mut w, t, T0);
    }
    assert_eq!(node.total(T0), 0);
}

#[test]
fn one_tenant_never_holds_more_than_its_share_across_workers() {
    // tenant_max_share 0.3 of 10 → 3 slots per tenant.
    let p = policy(r#", "tenant_max_share": 0.3"#);
    let node = Node::new();
    let (mut a, mut b) = (Worker::with_id(1), Worker::with_id(2));
    let t1 = node.acquire(&mut a, &p, "orders", "flood", T0).unwrap();
    let t2 = node.acquire(&mut b, &p, "orders", "flood", T0).unwrap();
    let t3 = node.acquire(&mut a, &p, "pay", "flood", T0).unwrap();
    assert_eq!(
        node.acquire(&mut b, &p, "orders", "flood", T0),
        Err(Reason::TenantShare)
    );
    assert_eq!(
        node.acquire(&mut a, &p, "health", "flood", T0),
        Err(Reason::TenantShare)
    );
    // The refusal gave back nothing it did not take: 3 in flight.
    assert_eq!(node.total(T0), 3);
    // Another tenant is not affected.
    let q = node.acquire(&mut b, &p, "orders", "quiet", T0).unwrap();
    assert_eq!(node.total(T0), 4);
    release(&node, &mut b, t2, T0);
    let t4 = node.acquire(&mut a, &p, "orders", "flood", T0).unwrap();
    for t in [t1, t3, t4] {
        release(&node, &mut a, t, T0);
    }
    release(&node, &mut b, q, T0);
    assert_eq!(node.total(T0), 0);
    let key = tenant_key("db", &Subject::Tenant("flood".into()));
    let host = MemoryHost::new(node.store.clone());
    let updated = table::update(
        &host,
        &Place::Table {
            logical: key.as_bytes(),
            entries: p.key_table_entries,
            overflow: Overflow {
                action: "x",
                plan: "y",
            },
        },
        &Reach::Existing,
        T0,
        &mut table::Buffers::default(),
        |records, _| (Commit::Skip, holders::live(&holders::of_records(records), T0)),
    )
    .unwrap();
    assert!(updated.result.is_zero(), "{:?}", updated.result);
}

#[test]
fn a_dependency_at_its_limit_refuses_on_behalf_of_the_share_and_gives_the_share_back() {
    let p = policy(r#", "tenant_max_share": 5"#);
    let node = Node::new();
    let mut w = Worker::with_id(1);
    let mut held: Vec<Ticket> = (0..7)
        .map(|i| node.acquire(&mut w, &p, "orders", &format!("t{i}"), T0).unwrap())
        .collect();
    assert_eq!(
        node.acquire(&mut w, &p, "orders", "late", T0),
        Err(Reason::ConcurrencyLimit)
    );
    // The tenant's slot taken before the dependency refused was given back.
    let late = tenant_key("db", &Subject::Tenant("late".into()));
    assert!(w.own(&late).is_zero());
    held.push(node.acquire(&mut w, &p, "pay", "late", T0).unwrap());
    for t in held {
        release(&node, &mut w, t, T0);
    }
    assert_eq!(node.total(T0), 0);
}

#[test]
fn streams_have_their_own_budget_and_never_take_request_slots() {
    let p = policy("");
    let node = Node::new();
    let mut w = Worker::with_id(1);
    let streams: Vec<Ticket> = (0..3)
        .map(|_| node.acquire(&mut w, &p, "feed", "acme", T0).unwrap())
        .collect();
    assert_eq!(
        node.acquire(&mut w, &p, "feed", "acme", T0),
        Err(Reason::StreamLimit)
    );
    let live = node.live("tg2|d|events", T0);
    assert_eq!((live.streams, live.in_flight()), (3, 0));
    for t in streams {
        release(&node, &mut w, t, T0);
    }
    assert!(node.live("tg2|d|events", T0).is_zero());
}

#[test]
fn a_worker_that_disappears_has_its_slots_back_within_the_lease() {
    let p = policy("");
    let node = Node::new();
    let mut gone = Worker::with_id(1);
    let mut b = Worker::with_id(2);
    let leaked: Vec<Ticket> = (0..5)
        .map(|_| node.acquire(&mut gone, &p, "orders", "acme", T0).unwrap())
        .collect();
    // The VM crashes: no release, no renewal, ever.
    std::mem::forget(leaked);
    drop(gone);
    // The other worker renews its own slot on its tick all along.
    let mine = node.acquire(&mut b, &p, "orders", "acme", T0).unwrap();
    let mut now = T0;
    let tick = 10_000_000;
    while now <= T0 + LEASE_NS {
        assert_eq!(node.total(now), 6, "at +{} ms", (now - T0) / 1_000_000);
        now += tick;
        b.renew(&MemoryHost::new(node.store.clone()), now);
    }
    // THE BOUND: LEASE_NS after the last publish, the slots are free.
    assert_eq!(node.total(T0 + LEASE_NS + 1), 1);
    let refill: Vec<Ticket> = (0..6)
        .map(|_| {
            node.acquire(&mut b, &p, "orders", "acme", T0 + LEASE_NS + 1)
                .unwrap()
        })
        .collect();
    assert_eq!(node.total(T0 + LEASE_NS + 1), 7);
    // The dead worker's holder was dropped by that write.
    let value = node.store.borrow().get("tg2|d|db").unwrap().to_vec();
    let slots = table::decode_entry(&value).unwrap();
    let listed = holders::of_records(table::decode_records(slots[0].records).as_ref());
    assert_eq!(listed.iter().map(|h| h.worker).collect::<Vec<_>>(), [2]);
    for t in refill.into_iter().chain([mine]) {
        release(&node, &mut b, t, T0 + LEASE_NS + 2);
    }
    assert_eq!(node.total(T0 + LEASE_NS + 2), 0);
}

#[test]
fn a_live_worker_renews_on_its_tick_and_keeps_its_slots_counted() {
    let p = policy("");
    let node = Node::new();
    let mut a = Worker::with_id(1);
    let host = MemoryHost::new(node.store.clone());
    let t = node.acquire(&mut a, &p, "orders", "acme", T0).unwrap();
    let mut now = T0;
    let mut writes = 0;
    while now < T0 + 10 * S {
        now += 10_000_000;
        let before = node.store.borrow().get("tg2|d|db").map(<[u8]>::to_vec);
        a.renew(&host, now);
        writes += usize::from(node.store.borrow().get("tg2|d|db").map(<[u8]>::to_vec) != before);
        assert_eq!(node.total(now), 1);
    }
    // Renewed every LEASE_NS − RENEW_BEFORE_NS (500 ms), not on every tick.
    assert!((19..=21).contains(&writes), "{writes} renewals in 10 s");
    release(&node, &mut a, t, now);
    assert_eq!(node.total(now), 0);
    a.renew(&host, now + 10_000_000);
    assert_eq!(a.places(), 0);
}

#[test]
fn shared_data_failures_refuse_and_a_failed_release_is_published_on_the_tick() {
    let p = policy("");
    let node = Node::new();
    let mut w = Worker::with_id(1);
    // Exhausted compare-and-swap: contention, nothing taken.
    let (host, prep) = node.prepared(&p, "orders", "acme");
    *host.forced_conflicts.borrow_mut() = table::MAX_CAS_ATTEMPTS;
    let refused = w.acquire(&host, &p, &prep.class, &prep.subject, T0).unwrap_err();
    assert_eq!(refused.reason, Reason::Contention);
    assert!(w.own("tg2|d|db").is_zero());
    // A broken host: state_unavailable.
    let mut broken = host.clone();
    broken.fail_shared = true;
    *broken.forced_conflicts.borrow_mut() = 0;
    let refused = w
        .acquire(&broken, &p, &prep.class, &prep.subject, T0)
        .unwrap_err();
    assert_eq!(refused.reason, Reason::StateUnavailable);
    // A release while shared data fails: right in memory at once...
    let t = w
        .acquire(&host, &p, &prep.class, &prep.subject, T0)
        .unwrap()
        .unwrap();
    w.release(&broken, t, T0);
    assert!(w.own("tg2|d|db").is_zero());
    assert_eq!(node.total(T0), 1);
    // ...and in shared data at the next tick that can write.
    w.renew(&broken, T0 + 10_000_000);
    assert_eq!(node.total(T0 + 10_000_000), 1);
    w.renew(&host, T0 + 20_000_000);
    assert_eq!(node.total(T0 + 20_000_000), 0);
    assert_eq!(w.places(), 0);
}

#[test]
fn slots_taken_before_a_reload_are_released_after_it() {
    let old = policy("");
    let new = policy(r#", "tenant_max_share": 4"#);
    let node = Node::new();
    let mut w = Worker::with_id(1);
    let before: Vec<Ticket> = (0..3)
        .map(|_| node.acquire(&mut w, &old, "orders", "acme", T0).unwrap())
        .collect();
    let after: Vec<Ticket> = (0..3)
        .map(|_| node.acquire(&mut w, &new, "orders", "acme", T0).unwrap())
        .collect();
    assert_eq!(node.total(T0), 6);
    for t in before.into_iter().chain(after) {
        release(&node, &mut w, t, T0);
    }
    assert_eq!(node.total(T0), 0);
}

/// A seeded mix of acquires and releases on two workers: the live count
/// always equals what the model holds, never exceeds the limit, and every
/// level's reservation holds; all released, everything is zero.
#[test]
fn random_traffic_on_two_workers_never_leaks_never_goes_negative_never_borrows() {
    let p = policy(r#", "tenant_max_share": 6"#);
    let dep = p.dependency(0).unwrap().clone();
    let node = Node::new();
    let mut workers = [Worker::with_id(1), Worker::with_id(2)];
    let mut held: Vec<(usize, Ticket)> = Vec::new();
    let classes = [
        "health",
        "pay",
        "orders",
        "orders-retry",
        "reports",
        "reports-retry",
    ];
    let tenants = ["a", "b", "c"];
    let mut seed = 42u64;
    let mut next = |n: u64| {
        seed = splitmix64(seed);
        seed % n
    };
    let mut now = T0;
    for step in 0..5_000 {
        now += 1_000_000;
        if next(2) == 0 || held.is_empty() {
            let w = next(2) as usize;
            let class = classes[next(6) as usize];
            let tenant = tenants[next(3) as usize];
            if let Ok(t) = node.acquire(&mut workers[w], &p, class, tenant, now) {
                held.push((w, t));
            }
        } else {
            let (w, t) = held.swap_remove(next(held.len() as u64) as usize);
            release(&node, &mut workers[w], t, now);
        }
        if step % 100 == 0 {
            for w in &mut workers {
                w.renew(&MemoryHost::new(node.store.clone()), now);
            }
        }
        let live = node.live("tg2|d|db", now);
        assert_eq!(live.in_flight() as usize, held.len(), "step {step}");
        assert!(live.in_flight() <= dep.max_in_flight);
        let [d, n, c, s] = live.levels;
        let pool = d + n + c.saturating_sub(dep.reserved_critical) + s.saturating_sub(dep.reserved_system);
        assert!(pool <= dep.general(), "step {step}: {live:?}");
    }
    for (w, t) in held {
        release(&node, &mut workers[w], t, now);
    }
    assert!(node.live("tg2|d|db", now).is_zero());
    for w in &workers {
        assert!(w.own("tg2|d|db").is_zero());
    }
}

#[test]
fn worker_ids_from_the_shared_counter_never_repeat() {
    let store = SharedStore::new();
    let host = MemoryHost::new(store);
    let ids: Vec<u64> = (0..5)
        .map(|i| Worker::register(&host, T0 + i).unwrap().id())
        .collect();
    assert_eq!(ids.iter().map(|id| id >> 32).collect::<Vec<_>>(), [1, 2, 3, 4, 5]);
    // Two VMs that both created the counter (each saw no key, both wrote
    // unconditionally) get the same count but still different ids.
    let (one, other) = (SharedStore::new(), SharedStore::new());
    let a = Worker::register(&MemoryHost::new(one), T0 + 17).unwrap().id();
    let b = Worker::register(&MemoryHost::new(other), T0 + 18).unwrap().id();
    assert_eq!(a >> 32, b >> 32);
    assert_ne!(a, b);
}

#[test]
fn retry_after_is_spread_over_the_window_and_never_below_the_estimate() {
    let window = 10 * S;
    let mut seen = [0u32; 11];
    for i in 0..1_000u64 {
        let v = jittered_retry_after_secs(1, window, T0 + i);
        assert!((1..=10).contains(&v), "{v}");
        seen[v as usize] += 1;
    }
    let most = seen.iter().max().copied().unwrap();
    assert!(most <= 200, "one value for {most} of 1,000: {seen:?}");
    assert!(seen[1..].iter().all(|n| *n > 0), "{seen:?}");
    // A longer real estimate is the floor.
    assert!((0..100).all(|i| jittered_retry_after_secs(30, window, i) >= 30));
}

#[test]
fn declared_size_and_timeout_budget_are_checked_and_bodies_counted_as_they_stream() {
    let json = r#"{
        "version": "v", "identity": {"header": "x-tenant-id"},
        "plans": {"free": {"limits": [{"rate": 10, "per": "1s"}]}},
        "default_plan": "free", "anonymous": {"plan": "free"},
        "routes": {"upload": {"max_body_bytes": 100, "min_timeout_budget": "200ms"}}
    }"#;
    let p = Policy::from_json(json.as_bytes()).unwrap();
    let labels = p.route_class(Some("upload")).unwrap().labels;
    let check = |cl: Option<&str>, t: Option<&str>| {
        request::check(
            &labels,
            &Declared::read(cl.map(str::as_bytes), t.map(str::as_bytes)),
        )
    };
    assert_eq!(check(None, None), Ok(()));
    assert_eq!(check(Some("100"), Some("200")), Ok(()));
    assert_eq!(check(Some("101"), None), Err(Reason::RequestTooLarge));
    assert_eq!(check(None, Some("199")), Err(Reason::TimeoutBudget));
    // Not a number: not a declaration.
    assert_eq!(check(Some("1e9"), Some("-5")), Ok(()));
    assert_eq!(check(Some("99999999999999999999999"), None), Ok(()));
    let mut body = BodyBudget::of(&labels).unwrap();
    assert_eq!(body.add(60), Ok(()));
    assert_eq!(body.add(40), Ok(()));
    assert_eq!(body.add(1), Err(Reason::RequestTooLarge));
    assert_eq!(body.seen(), 101);
    assert_eq!(Reason::RequestTooLarge.deny_status(), Some(413));
    assert_eq!(Reason::TimeoutBudget.deny_status(), Some(503));
}

#[test]
fn forged_criticality_headers_change_nothing() {
    let p = policy("");
    let node = Node::new();
    let mut w = Worker::with_id(1);
    let held: Vec<Ticket> = (0..7)
        .map(|_| node.acquire(&mut w, &p, "orders", "acme", T0).unwrap())
        .collect();
    let host = node
        .host("orders", "acme")
        .header("x-tenantgate-criticality", "system")
        .header("x-criticality", "critical")
        .header("priority", "u=0")
        .header("x-envoy-priority", "high");
    let prep = engine::prepare(&p, &host).unwrap();
    assert_eq!(prep.class.labels.criticality, Criticality::Normal);
    assert_eq!(
        w.acquire(&host, &p, &prep.class, &prep.subject, T0)
            .unwrap_err()
            .reason,
        Reason::ConcurrencyLimit
    );
    for t in held {
        release(&node, &mut w, t, T0);
    }
}

#[test]
fn two_workers_racing_for_the_last_slot_never_both_get_it() {
    let p = policy("");
    let node = Node::new();
    let mut a = Worker::with_id(1);
    let held: Vec<Ticket> = (0..6)
        .map(|_| node.acquire(&mut a, &p, "orders", "acme", T0).unwrap())
        .collect();
    // Worker 2 takes the last slot between worker 1's read and its write.
    let b = Rc::new(RefCell::new(Worker::with_id(2)));
    let won: Rc<RefCell<Vec<Ticket>>> = Rc::default();
    let (host, prep) = node.prepared(&p, "orders", "acme");
    let (b2, won2, store, p2) = (b.clone(), won.clone(), node.store.clone(), p.clone());
    *host.before_write.borrow_mut() = Some(crate::memory::Hook(Box::new(move || {
        if won2.borrow().is_empty() {
            let h = MemoryHost::new(store.clone())
                .route_class("orders")
                .header("x-tenant-id", "acme");
            let prep = engine::prepare(&p2, &h).unwrap();
            if let Ok(Some(t)) = b2.borrow_mut().acquire(&h, &p2, &prep.class, &prep.subject, T0) {
                won2.borrow_mut().push(t);
            }
        }
    })));
    let refused = a.acquire(&host, &p, &prep.class, &prep.subject, T0).unwrap_err();
    assert_eq!(refused.reason, Reason::ConcurrencyLimit);
    assert_eq!(refused.in_flight, 7);
    assert_eq!(won.borrow().len(), 1);
    assert_eq!(node.total(T0), 7);
    for t in held {
        release(&node, &mut a, t, T0);
    }
    for t in won.borrow_mut().drain(..) {
        release(&node, &mut b.borrow_mut(), t, T0);
    }
    assert_eq!(node.total(T0), 0);
}

#[test]
fn a_reload_that_resizes_the_key_table_leaves_no_tenant_count_behind_the_lease() {
    let old = policy(r#", "tenant_max_share": 5"#);
    // The same dependency with a larger key table: the tenant's slot moves.
    let new = {
        let json = r#"{
            "version": "adm-2", "identity": {"header": "x-tenant-id"},
            "plans": {"free": {"limits": [{"rate": 1000000, "per": "1s"}]}},
            "default_plan": "free", "anonymous": {"plan": "free"},
            "key_table": {"max_keys": 4096},
            "dependencies": {"db": {"max_in_flight": 10, "reserved": {"critical": 2, "system": 1}, "tenant_max_share": 5}},
            "routes": {"orders": {"dependency": "db"}}
        }"#;
        Rc::new(Policy::from_json(json.as_bytes()).unwrap())
    };
    assert_ne!(old.key_table_entries, new.key_table_entries);
    let node = Node::new();
    let mut w = Worker::with_id(1);
    let before = node.acquire(&mut w, &old, "orders", "acme", T0).unwrap();
    let after = node.acquire(&mut w, &new, "orders", "acme", T0).unwrap();
    release(&node, &mut w, before, T0);
    release(&node, &mut w, after, T0);
    assert_eq!(node.total(T0), 0);
    // Whatever either place still lists is gone by the lease's end: the
    // tenant can take its whole share under either policy.
    let later = T0 + LEASE_NS + 1;
    for p in [&old, &new] {
        let held: Vec<Ticket> = (0..5)
            .map(|_| node.acquire(&mut w, p, "orders", "acme", later).unwrap())
            .collect();
        assert_eq!(
            node.acquire(&mut w, p, "orders", "acme", later),
            Err(Reason::TenantShare)
        );
        for t in held {
            release(&node, &mut w, t, later);
        }
    }
}

#[test]
fn the_decision_record_is_one_line_of_plain_fields() {
    let r = DecisionRecord {
        outcome: "queue_timeout",
        criticality: Criticality::Sheddable,
        dependency: "db",
        in_flight: 7,
        queue_wait_ms: 390,
        policy_version: "v 1",
        limit_key: "orders|t|acme",
        limit: "action:orders",
        level: None,
        breaker: None,
        degraded_age_ms: None,
        controller_limit: None,
    };
    // A nested level's refusal names the level after the limit.
    assert_eq!(
        DecisionRecord {
            outcome: "rate_limited",
            limit: "org:tokens",
            level: Some("org"),
            ..r
        }
        .render(),
        "outcome=rate_limited criticality=sheddable dependency=db in_flight=7 queue_wait_ms=390 policy=v_1 key=orders|t|acme limit=org:tokens level=org"
    );
    assert_eq!(
        r.render(),
        "outcome=queue_timeout criticality=sheddable dependency=db in_flight=7 queue_wait_ms=390 policy=v_1 key=orders|t|acme limit=action:orders"
    );
    // With a circuit breaker, its phase comes last.
    assert_eq!(
        DecisionRecord {
            breaker: Some("half_open"),
            ..r
        }
        .render(),
        "outcome=queue_timeout criticality=sheddable dependency=db in_flight=7 queue_wait_ms=390 policy=v_1 key=orders|t|acme limit=action:orders breaker=half_open"
    );
    // A degraded answer says so, in a last field.
    let degraded = DecisionRecord {
        degraded_age_ms: Some(1500),
        ..r
    };
    assert_eq!(
        degraded.render(),
        "outcome=queue_timeout criticality=sheddable dependency=db in_flight=7 queue_wait_ms=390 policy=v_1 key=orders|t|acme limit=action:orders degraded_age_ms=1500"
    );
    // An adaptive dependency's record ends with the limit applied.
    let r = DecisionRecord {
        controller_limit: Some(23),
        ..r
    };
    assert!(r.render().ends_with(" limit=action:orders controller_limit=23"));
}

#[test]
fn a_controller_limit_keeps_the_reservations_and_the_shedding_order() {
    // db: 10 slots, 2 reserved for critical, 1 for system. A controller
    // limit of 6 leaves a pool of 3: normal fills it (ceiling 3), sheddable
    // stops at 80 % of it (2); critical still has its 2 reserved slots.
    let p = policy(r#", "adaptive": {"min": 4}"#);
    let node = Node::new();
    let mut w = Worker::with_id(1);
    w.update_control("tg2|d|db", |c| c.limit = Some(6));
    let dep = p.dependency(0).unwrap();
    assert_eq!(effective_limit(dep, &w.control("tg2|d|db")), 6);
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(node.acquire(&mut w, &p, "reports", "acme", T0).unwrap());
    }
    assert_eq!(
        node.acquire(&mut w, &p, "reports", "acme", T0),
        Err(Reason::ConcurrencyLimit)
    );
    held.push(node.acquire(&mut w, &p, "orders", "acme", T0).unwrap());
    assert_eq!(
        node.acquire(&mut w, &p, "orders", "acme", T0),
        Err(Reason::ConcurrencyLimit)
    );
    for _ in 0..2 {
        held.push(node.acquire(&mut w, &p, "pay", "acme", T0).unwrap());
    }
    assert_eq!(
        node.acquire(&mut w, &p, "pay", "acme", T0),
        Err(Reason::ConcurrencyLimit)
    );
    held.push(node.acquire(&mut w, &p, "health", "acme", T0).unwrap());
    assert_eq!(node.total(T0), 6, "in flight = the controller's limit");
    // The limit never passes max_in_flight, and no control: the static one.
    w.update_control("tg2|d|db", |c| c.limit = Some(1000));
    assert_eq!(effective_limit(dep, &w.control("tg2|d|db")), 10);
    w.update_control("tg2|d|db", |c| c.limit = None);
    assert_eq!(w.control("tg2|d|db"), Control::default());
    for t in held {
        release(&node, &mut w, t, T0);
    }
}

#[test]
fn prepared_entries_make_the_first_writes_real_compare_and_swaps() {
    let p = policy("");
    let node = Node::new();
    let host = MemoryHost::new(node.store.clone());
    Worker::prepare(&host, &p, T0);
    // Every key admission writes exists, empty: no live slot, no id taken.
    assert!(node.live("tg2|d|db", T0).is_zero());
    assert!(node.live("tg2|d|events", T0).is_zero());
    assert!(node.store.borrow().get(crate::keys::WORKER_COUNTER).is_some());
    assert_eq!(Worker::register(&host, T0).unwrap().id() >> 32, 1);
    // Preparing again changes nothing that is there.
    let mut w = Worker::with_id(9);
    let t = node.acquire(&mut w, &p, "orders", "acme", T0).unwrap();
    Worker::prepare(&host, &p, T0);
    assert_eq!(node.total(T0), 1);
    release(&node, &mut w, t, T0);
}

/// Without a prepared entry, two workers taking the first slots of a
/// dependency at once can lose one count (both writes are unconditional):
/// the loser's count is back at its next renewal: 500 ms (and a tick).
#[test]
fn a_count_lost_to_the_first_write_race_is_republished_at_the_next_renewal() {
    let p = policy("");
    let node = Node::new();
    let mut a = Worker::with_id(1);
    let mut b = Worker::with_id(2);
    let ta = node.acquire(&mut a, &p, "orders", "acme", T0).unwrap();
    // Worker 2 did not see worker 1's write: it wrote the entry from nothing.
    let fresh = Node::new();
    let tb = fresh.acquire(&mut b, &p, "orders", "acme", T0).unwrap();
    let lost = fresh.store.borrow().get("tg2|d|db").unwrap().to_vec();
    MemoryHost::new(node.store.clone())
        .shared_set("tg2|d|db", &lost, None)
        .unwrap();
    assert_eq!(node.total(T0), 1, "worker 1's count was overwritten");
    let host = MemoryHost::new(node.store.clone());
    let mut now = T0;
    while node.total(now) < 2 {
        now += 10_000_000;
        assert!(
            now <= T0 + LEASE_NS - RENEW_BEFORE_NS + 10_000_000,
            "not republished in time"
        );
        a.renew(&host, now);
        b.renew(&host, now);
    }
    release(&node, &mut a, ta, now);
    release(&node, &mut b, tb, now);
    assert_eq!(node.total(now), 0);
}

/// `search` (action `search`, max 3 in flight) through `db` and without a
/// dependency (`search-bulk`); `orders` fills `db` (pool 7) on its own.
fn action_policy() -> Rc<Policy> {
    let json = r#"{
        "version": "adm-act",
        "identity": {"header": "x-tenant-id"},
        "plans": {"free": {"limits": [{"rate": 1000000, "per": "1s"}]}},
        "default_plan": "free",
        "anonymous": {"plan": "free"},
        "dependencies": {"db": {"max_in_flight": 10, "reserved": {"critical": 2, "system": 1}}},
        "actions": {"search": {"max_in_flight": 3}},
        "routes": {
            "search": {"dependency": "db"},
            "search-bulk": {"action": "search", "criticality": "sheddable"},
            "orders": {"dependency": "db"}
        }
    }"#;
    match Policy::from_json(json.as_bytes()) {
        Ok(p) => Rc::new(p),
        Err(e) => panic!("test policy invalid: {e}"),
    }
}

impl Node {
    fn try_acquire(&self, w: &mut Worker, p: &Policy, class: &str, now: u64) -> Result<Ticket, Refusal> {
        let (host, prep) = self.prepared(p, class, "acme");
        match w.acquire(&host, p, &prep.class, &prep.subject, now) {
            Ok(Some(t)) => Ok(t),
            Ok(None) => panic!("{class} has no limit"),
            Err(r) => Err(r),
        }
    }
}

#[test]
fn an_action_limit_is_counted_node_wide_over_every_class_of_the_action() {
    let p = action_policy();
    let node = Node::new();
    let (mut a, mut b) = (Worker::with_id(1), Worker::with_id(2));
    // Three slots of `search`, from both workers and both classes.
    let t1 = node.try_acquire(&mut a, &p, "search", T0).unwrap();
    let t2 = node.try_acquire(&mut b, &p, "search-bulk", T0).unwrap();
    let t3 = node.try_acquire(&mut b, &p, "search", T0).unwrap();
    assert_eq!(t3.in_flight(), 1, "the dependency's count before it (t1)");
    assert_eq!(node.live("tg2|a|search", T0).total(), 3);
    assert_eq!(node.total(T0), 2, "search-bulk has no dependency");
    for w in [&mut a, &mut b] {
        for class in ["search", "search-bulk"] {
            let refused = node.try_acquire(w, &p, class, T0).unwrap_err();
            assert_eq!(
                (refused.reason, refused.limit, refused.in_flight),
                (Reason::ConcurrencyLimit, Limited::Action, 3),
                "{class}"
            );
            assert_eq!(refused.retry_after_window_ns, 10 * S);
        }
    }
    // A refusal by the action takes nothing from the dependency, and other
    // actions of the dependency are not limited by it.
    assert_eq!(node.total(T0), 2);
    let other = node.try_acquire(&mut a, &p, "orders", T0).unwrap();
    // A slot freed on one worker is usable from the other.
    release(&node, &mut b, t2, T0 + 1);
    let t4 = node.try_acquire(&mut a, &p, "search-bulk", T0 + 2).unwrap();
    assert_eq!(t4.in_flight(), 2, "the action's count, without a dependency");
    release(&node, &mut b, t3, T0 + 3);
    for t in [t1, t4, other] {
        release(&node, &mut a, t, T0 + 3);
    }
    assert!(node.live("tg2|a|search", T0 + 3).is_zero());
    assert!(node.live("tg2|d|db", T0 + 3).is_zero());
    // Nothing held, and nothing taken for a whole tick (a place's last
    // tick says how many permits to ask for): forgotten.
    let host = MemoryHost::new(node.store.clone());
    for now in [T0 + 4, T0 + 5] {
        a.renew(&host, now);
        b.renew(&host, now);
    }
    assert_eq!((a.places(), b.places()), (0, 0));
}

#[test]
fn a_dependency_refusal_gives_the_action_slot_back() {
    let p = action_policy();
    let node = Node::new();
    let (mut a, mut b) = (Worker::with_id(1), Worker::with_id(2));
    // `orders` fills db's pool (7) from worker b.
    let full: Vec<Ticket> = (0..7)
        .map(|_| node.try_acquire(&mut b, &p, "orders", T0).unwrap())
        .collect();
    for now in [T0, T0 + 1, T0 + 2] {
        let refused = node.try_acquire(&mut a, &p, "search", now).unwrap_err();
        assert_eq!(
            (refused.reason, refused.limit),
            (Reason::ConcurrencyLimit, Limited::Dependency)
        );
        assert!(node.live("tg2|a|search", now).is_zero(), "never leaks");
        assert!(a.own("tg2|a|search").is_zero());
    }
    // The action itself still has all three slots.
    let bulk: Vec<Ticket> = (0..3)
        .map(|_| node.try_acquire(&mut a, &p, "search-bulk", T0 + 3).unwrap())
        .collect();
    for t in full {
        release(&node, &mut b, t, T0 + 4);
    }
    for t in bulk {
        release(&node, &mut a, t, T0 + 4);
    }
    assert!(node.live("tg2|a|search", T0 + 4).is_zero());
    assert!(node.live("tg2|d|db", T0 + 4).is_zero());
}

#[test]
fn a_dead_workers_action_slots_stop_counting_after_the_lease() {
    let p = action_policy();
    let node = Node::new();
    let (mut dead, mut live) = (Worker::with_id(1), Worker::with_id(2));
    let leaked: Vec<Ticket> = (0..3)
        .map(|_| node.try_acquire(&mut dead, &p, "search-bulk", T0).unwrap())
        .collect();
    std::mem::forget(leaked);
    // Until the lease passes the dead worker's slots count...
    let refused = node
        .try_acquire(&mut live, &p, "search", T0 + LEASE_NS)
        .unwrap_err();
    assert_eq!(refused.limit, Limited::Action);
    // ...and not a nanosecond after.
    let t = node
        .try_acquire(&mut live, &p, "search", T0 + LEASE_NS + 1)
        .unwrap();
    assert_eq!(node.live("tg2|a|search", T0 + LEASE_NS + 1).total(), 1);
    release(&node, &mut live, t, T0 + LEASE_NS + 2);
    assert!(node.live("tg2|a|search", T0 + LEASE_NS + 2).is_zero());
}

#[test]
fn prepare_creates_the_action_entries() {
    let p = action_policy();
    let node = Node::new();
    Worker::prepare(&MemoryHost::new(node.store.clone()), &p, T0);
    let store = node.store.borrow();
    for key in ["tg2|a|search", "tg2|d|db", crate::keys::WORKER_COUNTER] {
        assert!(store.get(key).is_some(), "{key}");
    }
}
