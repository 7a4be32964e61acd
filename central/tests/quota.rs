//! Quota reservation scenarios, each written once and run against both
//! stores: SQLite (a file in a temporary directory) and a real PostgreSQL
//! that the test starts on loopback in a temporary directory and stops.
//! If PostgreSQL cannot start, the test fails with the reason (nothing is
//! skipped).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;
use tenantgate::policy::quota::LevelLimits;
use tenantgate_central::quota::api::http_status;
use tenantgate_central::quota::{
    replay, Answer, CounterKey, LedgerKind, Level, PostgresStore, QuotaStore, ReserveRequest, SqliteStore,
    State, Usage,
};
use tenantgate_central::testing::PostgresServer;

/// An answer's HTTP status, as the API writes it: the tests speak in
/// statuses, as its clients do.
trait Status {
    fn status(&self) -> u16;
}

impl Status for Answer {
    fn status(&self) -> u16 {
        http_status(self.kind).as_u16()
    }
}

const SEC: u64 = 1_000_000_000;
const T0: u64 = 1_764_547_200 * SEC;

enum Backend {
    Sqlite(tempfile::TempDir),
    Postgres(PostgresServer),
}

impl Backend {
    fn sqlite() -> Backend {
        Backend::Sqlite(tempfile::tempdir().unwrap())
    }

    fn postgres() -> Backend {
        Backend::Postgres(
            PostgresServer::start_with(&["-c fsync=off"])
                .unwrap_or_else(|e| panic!("PostgreSQL did not start: {e}")),
        )
    }

    /// A store (a new connection pool each time on PostgreSQL: a replica).
    async fn store(&self) -> Arc<dyn QuotaStore> {
        match self {
            Backend::Sqlite(dir) => Arc::new(SqliteStore::open(dir.path()).await.unwrap()),
            Backend::Postgres(pg) => Arc::new(PostgresStore::connect(&pg.url(), 8).await.unwrap()),
        }
    }

    /// `n` replicas: several pools on one database (PostgreSQL); one store
    /// shared (SQLite has one process by design).
    async fn replicas(&self, n: usize) -> Vec<Arc<dyn QuotaStore>> {
        match self {
            Backend::Sqlite(_) => {
                let s = self.store().await;
                vec![s; n]
            }
            Backend::Postgres(_) => {
                let mut v = Vec::new();
                for _ in 0..n {
                    v.push(self.store().await);
                }
                v
            }
        }
    }

    async fn raw(&self, sql: &str) {
        match self {
            Backend::Sqlite(dir) => SqliteStore::open(dir.path())
                .await
                .unwrap()
                .execute_raw(sql)
                .await
                .unwrap(),
            Backend::Postgres(pg) => PostgresStore::connect(&pg.url(), 1)
                .await
                .unwrap()
                .execute_raw(sql)
                .await
                .unwrap(),
        }
    }

    async fn raw_err(&self, sql: &str) -> String {
        let r = match self {
            Backend::Sqlite(dir) => {
                SqliteStore::open(dir.path())
                    .await
                    .unwrap()
                    .execute_raw(sql)
                    .await
            }
            Backend::Postgres(pg) => {
                PostgresStore::connect(&pg.url(), 1)
                    .await
                    .unwrap()
                    .execute_raw(sql)
                    .await
            }
        };
        r.expect_err(sql).to_string()
    }
}

macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Backend::sqlite()).await })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Backend::postgres()).await })*
        }
    };
}

on_both_stores!(
    state_machine_and_idempotency,
    concurrent_identical_reserves_make_one_entry,
    randomized_invariants_hold,
    leaked_reservations_are_reclaimed_after_their_ttl_only,
    commit_and_reclaim_have_one_winner,
    reconciliation_repairs_drift_through_the_ledger,
    the_ledger_refuses_update_and_delete,
    reopening_the_store_loses_nothing,
);

fn req(id: &str, tenant: &str, project: &str, amount: u64) -> ReserveRequest {
    ReserveRequest {
        reservation_id: id.to_owned(),
        resource: "gpu".to_owned(),
        tenant: tenant.to_owned(),
        project: project.to_owned(),
        amount,
        ttl_ms: 60_000,
    }
}

const LIMITS: LevelLimits = LevelLimits {
    global: 100,
    tenant: 50,
    project: 30,
};

fn body(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// Counters = replay of the ledger = Σ of the reservations' states, and
/// `committed + reserved ≤ limit` at every level.
async fn check_invariants(store: &dyn QuotaStore, limits: &dyn Fn(&CounterKey) -> u64) {
    let ledger = store.ledger().await.unwrap();
    let counters = store.counters().await.unwrap();
    let derived = replay(&ledger);
    let nonzero = |m: &BTreeMap<CounterKey, Usage>| -> BTreeMap<CounterKey, Usage> {
        m.iter()
            .filter(|(_, u)| **u != Usage::default())
            .map(|(k, u)| (k.clone(), *u))
            .collect()
    };
    assert_eq!(
        nonzero(&counters),
        nonzero(&derived),
        "replaying the ledger reproduces the counters"
    );
    for (k, u) in &counters {
        assert!(u.used() <= limits(k), "{k:?}: {u:?} over its limit {}", limits(k));
    }
}

async fn state_machine_and_idempotency(b: Backend) {
    let s = b.store().await;
    // Reserve, then the same again: the same answer, byte for byte.
    let a = s
        .reserve(&req("r1", "acme", "build", 20), LIMITS, T0)
        .await
        .unwrap();
    assert_eq!(a.status(), 201, "{}", a.body);
    let v = body(&a.body);
    assert_eq!(v["expires_at"], "2025-12-01T00:01:00.000Z");
    assert_eq!(v["levels"]["project"]["remaining"], 10);
    assert_eq!(v["levels"]["global"]["reserved"], 20);
    let again = s
        .reserve(&req("r1", "acme", "build", 20), LIMITS, T0 + 5 * SEC)
        .await
        .unwrap();
    assert_eq!((again.status(), &again.body), (201, &a.body));
    // Other parameters: 409 conflict naming the first differing field.
    for (r, field) in [
        (req("r1", "acme", "build", 21), "amount"),
        (req("r1", "acme", "other", 20), "project"),
        (req("r1", "globex", "build", 20), "tenant"),
        (
            ReserveRequest {
                ttl_ms: 1,
                ..req("r1", "acme", "build", 20)
            },
            "ttl",
        ),
    ] {
        let c = s.reserve(&r, LIMITS, T0).await.unwrap();
        assert_eq!(c.status(), 409);
        assert_eq!(body(&c.body)["error"], "conflict");
        assert_eq!(body(&c.body)["field"], field);
    }
    // The project level binds first (30), with what is left and a hint.
    let refused = s
        .reserve(&req("r2", "acme", "build", 11), LIMITS, T0)
        .await
        .unwrap();
    assert_eq!(refused.status(), 409);
    let v = body(&refused.body);
    assert_eq!(
        (v["error"].as_str(), v["level"].as_str(), v["remaining"].as_u64()),
        (Some("quota_exceeded"), Some("project"), Some(10))
    );
    assert_eq!(v["retry_after_ms"], 60_000);
    // The tenant level (50) binds across projects; then global (100).
    assert_eq!(
        s.reserve(&req("r3", "acme", "deploy", 30), LIMITS, T0)
            .await
            .unwrap()
            .status(),
        201
    );
    let t = s.reserve(&req("r4", "acme", "x", 1), LIMITS, T0).await.unwrap();
    assert_eq!(body(&t.body)["level"], "tenant");
    assert_eq!(
        s.reserve(&req("r5", "b", "p", 30), LIMITS, T0)
            .await
            .unwrap()
            .status(),
        201
    );
    assert_eq!(
        s.reserve(&req("r6", "c", "p", 20), LIMITS, T0)
            .await
            .unwrap()
            .status(),
        201
    );
    let g = s.reserve(&req("r7", "d", "p", 1), LIMITS, T0).await.unwrap();
    assert_eq!(body(&g.body)["level"], "global");
    // A refusal wrote nothing: no reservation, no ledger row.
    assert!(s.get("r7").await.unwrap().is_none());

    // Partial commit returns the rest at once; committing again: the
    // original answer; another amount: conflict on amount.
    let c = s.commit("r1", Some(15), T0 + SEC).await.unwrap();
    assert_eq!(c.status(), 200);
    assert_eq!(body(&c.body)["returned"], 5);
    let c2 = s.commit("r1", Some(15), T0 + 2 * SEC).await.unwrap();
    assert_eq!((c2.status(), &c2.body), (200, &c.body));
    assert_eq!(
        body(&s.commit("r1", Some(3), T0).await.unwrap().body)["field"],
        "amount"
    );
    let u = s.usage("gpu", "acme", "build").await.unwrap();
    assert_eq!(
        u[2],
        Usage {
            reserved: 0,
            committed: 15
        }
    );
    // Release after commit: 409 already_committed.
    let rel = s.release("r1", T0).await.unwrap();
    assert_eq!(
        (rel.status(), body(&rel.body)["error"].as_str()),
        (409, Some("already_committed"))
    );
    // Release is repeatable; commit after release: 409 released.
    let r3 = s.release("r3", T0).await.unwrap();
    assert_eq!(
        (r3.status(), body(&r3.body)["released"].as_u64()),
        (200, Some(30))
    );
    assert_eq!(s.release("r3", T0).await.unwrap().body, r3.body);
    assert_eq!(
        body(&s.commit("r3", None, T0).await.unwrap().body)["error"],
        "released"
    );
    // A commit at expiry: 409 expired, and the amount returns.
    let late = s.commit("r5", None, T0 + 60 * SEC).await.unwrap();
    assert_eq!(
        (late.status(), body(&late.body)["error"].as_str()),
        (409, Some("expired"))
    );
    assert_eq!(s.get("r5").await.unwrap().unwrap().state, State::Expired);
    assert_eq!(
        body(&s.commit("r5", None, T0).await.unwrap().body)["error"],
        "expired"
    );
    // A commit of more than reserved conflicts with the reservation (409
    // naming amount; the request itself is well-formed).
    let over = s.commit("r6", Some(21), T0).await.unwrap();
    assert_eq!(
        (
            over.status(),
            body(&over.body)["error"].as_str(),
            body(&over.body)["field"].as_str()
        ),
        (409, Some("conflict"), Some("amount"))
    );
    assert_eq!(s.commit("nope", None, T0).await.unwrap().status(), 404);
    // A reload lowers the project limit below what is in use (r6: 20 of
    // c/p): new reservations are refused there, the existing one stays and
    // still commits.
    let lowered = LevelLimits {
        project: 10,
        ..LIMITS
    };
    let r = s.reserve(&req("r8", "c", "p", 1), lowered, T0).await.unwrap();
    assert_eq!(body(&r.body)["level"], "project");
    assert_eq!(s.get("r6").await.unwrap().unwrap().state, State::Reserved);
    assert_eq!(s.commit("r6", None, T0).await.unwrap().status(), 200);
    check_invariants(s.as_ref(), &|k| match k.level() {
        Level::Global => 100,
        Level::Tenant => 50,
        Level::Project => 30,
    })
    .await;
    let kinds: Vec<LedgerKind> = s.ledger().await.unwrap().iter().map(|e| e.kind).collect();
    use LedgerKind::*;
    assert_eq!(
        kinds,
        [Reserve, Reserve, Reserve, Reserve, Commit, Release, Expire, Commit]
    );
}

async fn concurrent_identical_reserves_make_one_entry(b: Backend) {
    let replicas = b.replicas(4).await;
    let limits = LevelLimits {
        global: 1_000_000,
        tenant: 1_000_000,
        project: 1_000_000,
    };
    let (first_tx, first_rx) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    for i in 0..1000usize {
        let s = replicas[i % replicas.len()].clone();
        let first_tx = first_tx.clone();
        tasks.push(tokio::spawn(async move {
            let a = s
                .reserve(&req("same", "acme", "build", 7), limits, T0)
                .await
                .unwrap();
            let _ = first_tx.send(true);
            a
        }));
    }
    // The 10 others once the first identical one has its answer (so the
    // original is the identical one), while the rest are still in flight.
    let mut rx = first_rx;
    rx.wait_for(|v| *v).await.unwrap();
    let mut others = Vec::new();
    for i in 0..10usize {
        let s = replicas[i % replicas.len()].clone();
        others.push(tokio::spawn(async move {
            s.reserve(&req("same", "acme", "build", 8), limits, T0)
                .await
                .unwrap()
        }));
    }
    let mut bodies = std::collections::BTreeSet::new();
    for t in tasks {
        let a = t.await.unwrap();
        assert_eq!(a.status(), 201, "{}", a.body);
        bodies.insert(a.body);
    }
    assert_eq!(bodies.len(), 1, "1,000 identical answers");
    for t in others {
        let a = t.await.unwrap();
        assert_eq!(a.status(), 409);
        assert_eq!(body(&a.body)["field"], "amount");
    }
    let ledger = replicas[0].ledger().await.unwrap();
    assert_eq!(ledger.len(), 1, "exactly one ledger entry");
    assert_eq!(
        replicas[0].usage("gpu", "acme", "build").await.unwrap()[0].reserved,
        7
    );
}

/// A tiny seeded PRNG (xorshift64*), so a failure replays.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The randomized test's size (`QUOTA_RANDOM_OPS` overrides).
fn random_ops() -> u64 {
    std::env::var("QUOTA_RANDOM_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

async fn randomized_invariants_hold(b: Backend) {
    // Three levels: 2 tenants × 3 projects under one pool, tight enough
    // that every level refuses often. Several replicas, 16 workers; each
    // worker's steps: reserve, then commit (all or part), release, or
    // "crash" (walk away: the reservation is left to expire); the clock
    // moves so expiries happen, and the reclaimer runs between rounds.
    let replicas = b.replicas(3).await;
    let limits = LevelLimits {
        global: 400,
        tenant: 220,
        project: 90,
    };
    let limit_of = |k: &CounterKey| match k.level() {
        Level::Global => 3000,
        Level::Tenant => 1700,
        Level::Project => 700,
    };
    let total = random_ops();
    let workers = 16u64;
    let rounds = 50u64;
    let per_round = total.div_ceil(workers * rounds);
    let clock = Arc::new(std::sync::atomic::AtomicU64::new(T0));
    let mut ops = 0u64;
    let mut refusals = [0u64; 3];
    let started = std::time::Instant::now();
    for round in 0..rounds {
        let mut tasks = Vec::new();
        for w in 0..workers {
            let s = replicas[(w as usize) % replicas.len()].clone();
            let clock = clock.clone();
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (round * 1000 + w + 1));
                let mut n = 0u64;
                let mut refused = [0u64; 3];
                let mut i = 0u64;
                while n < per_round {
                    let now = clock.fetch_add(1_000_000, std::sync::atomic::Ordering::Relaxed);
                    // Skewed, so that each level binds in turn.
                    let tenant = if rng.below(10) < 7 { "t0" } else { "t1" };
                    let project = ["p0", "p0", "p0", "p1", "p2"][rng.below(5) as usize];
                    let amount = 1 + rng.below(20);
                    let id = format!("r{round}-{w}-{i}");
                    i += 1;
                    // A fresh pool every round (committed usage only
                    // grows), two independent hierarchies per round.
                    let r = ReserveRequest {
                        ttl_ms: 1 + rng.below(200),
                        resource: format!("gpu{round}-{}", w % 2),
                        ..req(&id, tenant, project, amount)
                    };
                    let a = s.reserve(&r, limits, now).await.unwrap();
                    n += 1;
                    let v = body(&a.body);
                    match a.status() {
                        201 => {
                            // After the step: used ≤ limit at every level.
                            for level in ["global", "tenant", "project"] {
                                let l = &v["levels"][level];
                                let used = l["committed"].as_u64().unwrap() + l["reserved"].as_u64().unwrap();
                                assert!(used <= l["limit"].as_u64().unwrap(), "{level}: {}", a.body);
                            }
                        }
                        409 => {
                            // Every refusal names its level, and it binds there.
                            let level = v["level"].as_str().unwrap_or_else(|| panic!("{}", a.body));
                            let idx = ["global", "tenant", "project"]
                                .iter()
                                .position(|l| *l == level)
                                .unwrap();
                            refused[idx] += 1;
                            assert!(v["remaining"].as_u64().unwrap() < amount, "{}", a.body);
                            continue;
                        }
                        s => panic!("{s}: {}", a.body),
                    }
                    let now = clock.load(std::sync::atomic::Ordering::Relaxed);
                    match rng.below(20) {
                        0 => {
                            // A replica crashes mid-step: the commit's task
                            // is dropped at an arbitrary point (a transaction
                            // in flight rolls back, or has committed).
                            let s2 = s.clone();
                            let id2 = id.clone();
                            let t = tokio::spawn(async move { s2.commit(&id2, None, now).await });
                            for _ in 0..rng.below(4) {
                                tokio::task::yield_now().await;
                            }
                            t.abort();
                            let _ = t.await;
                        }
                        1..=8 => {
                            let part = rng.below(amount + 1);
                            let c = s.commit(&id, Some(part), now).await.unwrap();
                            assert!(
                                c.status() == 200 || body(&c.body)["error"] == "expired",
                                "{}",
                                c.body
                            );
                        }
                        9..=16 => {
                            let c = s.release(&id, now).await.unwrap();
                            assert_eq!(c.status(), 200, "{}", c.body);
                        }
                        _ => {} // crash: never heard of again
                    }
                    n += 1;
                }
                (n, refused)
            }));
        }
        for t in tasks {
            let (n, r) = t.await.unwrap();
            ops += n;
            for (a, b) in refusals.iter_mut().zip(r) {
                *a += b;
            }
        }
        // Leaked reservations expire: the reclaimer, past every TTL.
        let now = clock.fetch_add(200 * 1_000_000, std::sync::atomic::Ordering::Relaxed) + 200 * 1_000_000;
        let mut reclaimed = 0;
        loop {
            let r = replicas[(round as usize) % replicas.len()]
                .reclaim(now, 256)
                .await
                .unwrap();
            reclaimed += r.len();
            if r.is_empty() {
                break;
            }
        }
        let _ = reclaimed;
        if round % 10 == 9 || round == rounds - 1 {
            check_invariants(replicas[0].as_ref(), &limit_of).await;
        }
    }
    check_invariants(replicas[0].as_ref(), &limit_of).await;
    // After every reservation expired: nothing reserved anywhere.
    for (k, u) in replicas[0].counters().await.unwrap() {
        assert_eq!(u.reserved, 0, "{k:?}");
    }
    assert!(ops >= total, "{ops} operations");
    assert!(
        refusals.iter().all(|r| *r > 0),
        "every level refused: {refusals:?}"
    );
    eprintln!(
        "{} ops in {:?}; refusals global/tenant/project {refusals:?}",
        ops,
        started.elapsed()
    );
}

async fn leaked_reservations_are_reclaimed_after_their_ttl_only(b: Backend) {
    let s = b.store().await;
    let limits = LevelLimits {
        global: 1000,
        tenant: 1000,
        project: 1000,
    };
    for i in 0..50u64 {
        let r = ReserveRequest {
            ttl_ms: 1000 + i * 10,
            ..req(&format!("l{i}"), "acme", "build", 1)
        };
        assert_eq!(s.reserve(&r, limits, T0).await.unwrap().status(), 201);
    }
    // One nanosecond before the first expiry: nothing.
    assert!(s.reclaim(T0 + SEC - 1, 1000).await.unwrap().is_empty());
    // At 1.2 s: exactly those with ttl ≤ 1.2 s (21 of them), lag measured.
    let r = s.reclaim(T0 + 1_200_000_000, 1000).await.unwrap();
    assert_eq!(r.len(), 21);
    assert!(r.iter().all(|x| x.lag_ns <= 200_000_000));
    for x in &r {
        let res = s.get(&x.id).await.unwrap().unwrap();
        assert!(res.expires_ns <= T0 + 1_200_000_000);
        assert_eq!(res.state, State::Expired);
    }
    assert_eq!(s.usage("gpu", "acme", "build").await.unwrap()[0].reserved, 29);
    // All within TTL + one reclaimer period (here 1 s).
    let r = s.reclaim(T0 + 1_490_000_000 + SEC, 1000).await.unwrap();
    assert_eq!(r.len(), 29);
    assert_eq!(
        s.usage("gpu", "acme", "build").await.unwrap()[0],
        Usage::default()
    );
}

async fn commit_and_reclaim_have_one_winner(b: Backend) {
    let replicas = b.replicas(2).await;
    let limits = LevelLimits {
        global: 100_000,
        tenant: 100_000,
        project: 100_000,
    };
    let n = 200u64;
    for i in 0..n {
        let r = ReserveRequest {
            ttl_ms: 1000,
            ..req(&format!("w{i}"), "acme", "build", 1)
        };
        replicas[0].reserve(&r, limits, T0).await.unwrap();
    }
    // At the expiry instant, commits race the reclaimer.
    let at = T0 + SEC;
    let reclaimer = {
        let s = replicas[1].clone();
        tokio::spawn(async move {
            let mut all = Vec::new();
            loop {
                let r = s.reclaim(at, 16).await.unwrap();
                if r.is_empty() {
                    break all;
                }
                all.extend(r);
            }
        })
    };
    let mut committed = 0u64;
    let mut expired = 0u64;
    for i in 0..n {
        let a = replicas[0]
            .commit(&format!("w{i}"), None, at - (i % 2))
            .await
            .unwrap();
        match (a.status(), body(&a.body)["error"].as_str()) {
            (200, _) => committed += 1,
            (409, Some("expired")) => expired += 1,
            other => panic!("{other:?}"),
        }
    }
    let reclaimed = reclaimer.await.unwrap().len() as u64;
    // The reclaimer's wins and the late commits' expiries are the same set.
    assert_eq!(committed + expired, n);
    assert!(reclaimed <= expired);
    let ledger = replicas[0].ledger().await.unwrap();
    let expiries = ledger.iter().filter(|e| e.kind == LedgerKind::Expire).count() as u64;
    let commits = ledger.iter().filter(|e| e.kind == LedgerKind::Commit).count() as u64;
    assert_eq!(
        (commits, expiries),
        (committed, expired),
        "one ledger row per reservation's end"
    );
    let u = replicas[0].usage("gpu", "acme", "build").await.unwrap()[0];
    assert_eq!(
        u,
        Usage {
            reserved: 0,
            committed
        }
    );
}

async fn reconciliation_repairs_drift_through_the_ledger(b: Backend) {
    let s = b.store().await;
    s.reserve(&req("a", "acme", "build", 10), LIMITS, T0)
        .await
        .unwrap();
    s.reserve(&req("b", "acme", "build", 5), LIMITS, T0)
        .await
        .unwrap();
    s.commit("a", Some(10), T0).await.unwrap();
    s.release("b", T0).await.unwrap();
    assert!(s.reconcile(T0).await.unwrap().repaired.is_empty());
    let before = s.ledger().await.unwrap().len();
    // Behind the service's back: a lost decrement (the release's, on the
    // project counter) and a duplicated increment (the commit's, global).
    b.raw("UPDATE counters SET reserved = reserved + 5 WHERE tenant = 'acme' AND project = 'build'")
        .await;
    b.raw("UPDATE counters SET committed = committed + 10 WHERE tenant = '' AND project = ''")
        .await;
    let r = s.reconcile(T0 + SEC).await.unwrap();
    assert_eq!(r.repaired.len(), 2, "{r:?}");
    assert_eq!(r.drift_units(), 15);
    let ledger = s.ledger().await.unwrap();
    assert_eq!(
        ledger.len(),
        before + 2,
        "one compensation row per repaired counter"
    );
    let comp: Vec<_> = ledger
        .iter()
        .filter(|e| e.kind == LedgerKind::Compensation)
        .collect();
    assert_eq!((comp[0].d_reserved, comp[0].d_committed), (0, -10));
    assert_eq!((comp[1].d_reserved, comp[1].d_committed), (-5, 0));
    assert!(
        comp[1]
            .note
            .as_deref()
            .unwrap()
            .contains("project counter was reserved=5"),
        "{:?}",
        comp[1].note
    );
    // Repaired to zero: the next pass finds nothing.
    assert!(s.reconcile(T0 + 2 * SEC).await.unwrap().repaired.is_empty());
    assert_eq!(
        s.usage("gpu", "acme", "build").await.unwrap(),
        [Usage {
            reserved: 0,
            committed: 10
        }; 3]
    );
}

async fn the_ledger_refuses_update_and_delete(b: Backend) {
    let s = b.store().await;
    s.reserve(&req("a", "acme", "build", 10), LIMITS, T0)
        .await
        .unwrap();
    for sql in ["UPDATE ledger SET d_reserved = 0", "DELETE FROM ledger"] {
        let e = b.raw_err(sql).await;
        assert!(e.contains("append-only"), "{sql}: {e}");
    }
    assert_eq!(s.ledger().await.unwrap().len(), 1);
}

async fn reopening_the_store_loses_nothing(b: Backend) {
    {
        let s = b.store().await;
        s.reserve(&req("a", "acme", "build", 10), LIMITS, T0)
            .await
            .unwrap();
        s.reserve(&req("b", "acme", "build", 5), LIMITS, T0)
            .await
            .unwrap();
        s.commit("a", Some(7), T0).await.unwrap();
    }
    let s = b.store().await;
    assert_eq!(s.get("a").await.unwrap().unwrap().state, State::Committed);
    assert_eq!(s.get("b").await.unwrap().unwrap().state, State::Reserved);
    assert_eq!(
        s.usage("gpu", "acme", "build").await.unwrap()[2],
        Usage {
            reserved: 5,
            committed: 7
        }
    );
    assert_eq!(s.ledger().await.unwrap().len(), 3);
}
