//! Regional borrowing (`central/src/quota/borrow.rs`): a home region `eu`
//! on a real PostgreSQL, a borrowing region `us` on SQLite, both serving
//! the reservation API over HTTP on loopback in this process. The home
//! database is stopped and restarted; the test checks THE BOUND (the
//! oversell never exceeds Σ ceilings), that a high-risk resource fails
//! closed, and that the ledgers reconcile with zero drift and no debt left.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::collections::BTreeMap;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tenantgate::policy::Policy;
use tenantgate_central::listener::{Peer, SyncListener};
use tenantgate_central::quota::api::{router, QuotaApi};
use tenantgate_central::quota::borrow::{self, Borrowing};
use tenantgate_central::quota::{replay, CounterKey, PostgresStore, QuotaStore, SqliteStore, Usage};
use tenantgate_central::service::SystemClock;
use tenantgate_central::testing::{http, PostgresServer};

const POLICY: &str = r#"{"version":"b","identity":{"header":"x-tenant-id"},
 "plans":{"free":{"limits":[{"rate":1,"per":"1s"}]}},"default_plan":"free","anonymous":{"plan":"free"},
 "routes":{"api":{}},
 "quotas":{
  "seats":{"unit":"seat","risk":"low","home_region":"eu","limits":{"global":100},
           "borrow":{"ceilings":{"us":10}}},
  "gpu":{"unit":"hour","risk":"high","home_region":"eu","limits":{"global":100}}}}"#;

/// Σ ceilings of `seats`: THE BOUND on its oversell.
const BOUND: u64 = 10;

async fn serve(api: Arc<QuotaApi>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(api).into_make_service_with_connect_info::<Peer>();
    tokio::spawn(axum::serve(SyncListener::plain(listener), app).into_future());
    addr
}

async fn call(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, Value) {
    let (status, text) = http(addr, method, path, body).await.unwrap();
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, v)
}

async fn reserve(addr: SocketAddr, id: &str, resource: &str, amount: u64) -> (u16, Value) {
    reserve_for(addr, id, resource, amount, 60_000).await
}

async fn reserve_for(addr: SocketAddr, id: &str, resource: &str, amount: u64, ttl_ms: u64) -> (u16, Value) {
    let body = format!(
        r#"{{"reservation_id":"{id}","resource":"{resource}","tenant":"acme","project":"web","amount":{amount},"ttl":{ttl_ms}}}"#
    );
    call(addr, "POST", "/v1/reservations", &body).await
}

fn nonzero(m: &BTreeMap<CounterKey, Usage>) -> BTreeMap<CounterKey, Usage> {
    m.iter()
        .filter(|(_, u)| **u != Usage::default())
        .map(|(k, u)| (k.clone(), *u))
        .collect()
}

/// Counters equal the replay of the ledger (zero drift).
async fn zero_drift(store: &dyn QuotaStore, who: &str) {
    let ledger = store.ledger().await.unwrap();
    let counters = store.counters().await.unwrap();
    assert_eq!(
        nonzero(&counters),
        nonzero(&replay(&ledger)),
        "{who}: counters = ledger replay"
    );
}

fn global(m: &BTreeMap<String, Usage>) -> Usage {
    m.get("seats").copied().unwrap_or_default()
}

/// The two regions of the scenario.
struct Regions {
    pg: PostgresServer,
    home: Arc<QuotaApi>,
    home_store: Arc<dyn QuotaStore>,
    eu: SocketAddr,
    us_api: Arc<QuotaApi>,
    account: Arc<SqliteStore>,
    us: SocketAddr,
    _dirs: [tempfile::TempDir; 2],
}

/// Home `eu` on a fresh PostgreSQL, `us` on SQLite with a borrowing
/// account that reaches `eu`.
async fn start() -> Regions {
    let pg = PostgresServer::start_with(&["-c fsync=off"])
        .unwrap_or_else(|e| panic!("PostgreSQL did not start: {e}"));
    let quotas = Policy::from_json(POLICY.as_bytes()).unwrap().quotas;
    let clock = Arc::new(SystemClock::default());
    let home_store: Arc<dyn QuotaStore> = Arc::new(PostgresStore::connect(&pg.url(), 8).await.unwrap());
    let home = Arc::new(QuotaApi::new(
        home_store.clone(),
        clock.clone(),
        None,
        Some("eu".into()),
    ));
    home.set_quotas(quotas.clone());
    let eu = serve(home.clone()).await;
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let account = Arc::new(SqliteStore::open(dirs[1].path()).await.unwrap());
    let us_api = QuotaApi::new(
        Arc::new(SqliteStore::open(dirs[0].path()).await.unwrap()),
        clock,
        None,
        Some("us".into()),
    )
    .with_borrowing(Borrowing {
        account: account.clone(),
        homes: BTreeMap::from([("eu".to_owned(), eu.to_string())]),
    });
    us_api.set_quotas(quotas);
    let us_api = Arc::new(us_api);
    let us = serve(us_api.clone()).await;
    Regions {
        pg,
        home,
        home_store,
        eu,
        us_api,
        account,
        us,
        _dirs: dirs,
    }
}

/// 25 concurrent reserves at `us`: exactly the ceiling is admitted, the
/// rest refused with the reason. Returns the admitted ids.
async fn burst_at_the_ceiling(us: SocketAddr) -> Vec<String> {
    let burst = (0..25).map(|n| async move {
        let id = format!("b{n}");
        let answer = reserve(us, &id, "seats", 1).await;
        (id, answer)
    });
    let mut admitted = Vec::new();
    for (id, (s, v)) in futures_util::future::join_all(burst).await {
        match s {
            201 => {
                assert_eq!(v["borrowed"], true, "{v}");
                admitted.push(id);
            }
            409 => {
                assert_eq!(v["error"], "quota_exceeded", "{v}");
                assert_eq!(v["borrowing_ceiling"], BOUND, "{v}");
            }
            other => panic!("{other}: {v}"),
        }
    }
    assert_eq!(admitted.len() as u64, BOUND, "exactly the ceiling is admitted");
    admitted
}

/// Commit six, release four: the committed debt still counts against the
/// ceiling, so only four more are admitted; three are committed and one
/// is left to expire (the repayer reclaims and repays it).
async fn settle_and_borrow_again(us: SocketAddr, admitted: &[String]) {
    for id in &admitted[..6] {
        let (s, v) = call(us, "POST", &format!("/v1/reservations/{id}/commit"), "").await;
        assert_eq!((s, v["borrowed"].as_bool()), (200, Some(true)), "{v}");
    }
    for id in &admitted[6..] {
        let path = format!("/v1/reservations/{id}/release");
        assert_eq!(call(us, "POST", &path, "").await.0, 200);
    }
    let mut more = 0u64;
    for n in 0..10 {
        let id = format!("c{n}");
        if reserve_for(us, &id, "seats", 1, 1_000).await.0 == 201 {
            more += 1;
            if more < 4 {
                let path = format!("/v1/reservations/{id}/commit");
                assert_eq!(call(us, "POST", &path, "").await.0, 200);
            }
        }
    }
    assert_eq!(more, 4, "the ceiling counts unrepaid committed debt");
}

/// Runs the repayer until the account holds no debt (30 s at most).
async fn repay_everything(r: &Regions) {
    let repayer = tokio::spawn(borrow::repay_every(r.us_api.clone()));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !r.account.debts(256).await.unwrap().is_empty()
        || global(&r.account.totals().await.unwrap()).reserved > 0
    {
        assert!(Instant::now() < deadline, "debts repaid within 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    repayer.abort();
}

/// Repaying again double-counts nothing; both sides have zero drift and
/// the home's ledger holds every borrowed reservation.
async fn idempotent_and_zero_drift(r: &Regions, id: &str, totals: Usage) {
    let again = format!(
        r#"{{"region":"us","reservation_id":"{id}","resource":"seats","tenant":"acme","project":"web","amount":1,"committed":1,"state":"committed"}}"#
    );
    assert_eq!(call(r.eu, "POST", "/v1/quotas/debts", &again).await.0, 200);
    assert_eq!(global(&r.home_store.totals().await.unwrap()), totals);
    assert!(!r.account.mark_repaid(id, 0, 1).await.unwrap());
    zero_drift(r.home_store.as_ref(), "home").await;
    zero_drift(r.account.as_ref(), "account").await;
    assert_eq!(r.home.reconcile_once().await.unwrap().drift_units(), 0);
    let ledger = r.home_store.ledger().await.unwrap();
    let rows = ledger
        .iter()
        .filter(|e| e.reservation_id.as_deref().is_some_and(|i| i.starts_with("us:")))
        .count();
    assert_eq!(
        rows, 28,
        "14 borrowed reservations, reserved and finished at home"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn borrowing_with_the_home_database_stopped_and_restarted_stays_within_the_bound_and_reconciles() {
    let started = Instant::now();
    let mut r = start().await;
    let (eu, us) = (r.eu, r.us);
    // The home answers: 95 of 100 committed there; `us` answers
    // wrong_region and borrows nothing.
    assert_eq!(reserve(eu, "h1", "seats", 95).await.0, 201);
    assert_eq!(call(eu, "POST", "/v1/reservations/h1/commit", "").await.0, 200);
    let (s, v) = reserve(us, "early", "seats", 1).await;
    assert_eq!((s, v["error"].as_str()), (409, Some("wrong_region")), "{v}");

    // The home database stops: the home fails closed; `us` borrows.
    r.pg.stop();
    let (s, v) = reserve(eu, "h2", "seats", 1).await;
    assert_eq!((s, v["error"].as_str()), (503, Some("quota_unavailable")), "{v}");
    let admitted = burst_at_the_ceiling(us).await;
    // A retry of a borrowed id: its original answer.
    let (s, v) = reserve(us, &admitted[0], "seats", 1).await;
    assert_eq!((s, v["borrowed"].as_bool()), (201, Some(true)), "{v}");
    // A high-risk resource never borrows: closed in both regions.
    let (s, v) = reserve(us, "g1", "gpu", 1).await;
    assert_eq!((s, v["error"].as_str()), (409, Some("wrong_region")), "{v}");
    assert_eq!(reserve(eu, "g2", "gpu", 1).await.0, 503);
    settle_and_borrow_again(us, &admitted).await;
    assert_eq!(global(&r.account.totals().await.unwrap()).used(), BOUND);
    assert!(
        borrow::repay_once(&r.us_api).await.is_err(),
        "the home cannot take debts yet"
    );

    // The home database is back: the repayer (backoff included) repays.
    r.pg.restart().unwrap();
    repay_everything(&r).await;
    // The home's totals are what both regions used: 95 + 6 + 3.
    let totals = global(&r.home_store.totals().await.unwrap());
    assert_eq!(
        totals,
        Usage {
            reserved: 0,
            committed: 104
        }
    );
    let oversell = totals.used().saturating_sub(100);
    assert!(oversell <= BOUND, "oversell {oversell} ≤ Σ ceilings {BOUND}");
    // What the home took above its limit stays against `us`'s ceiling;
    // no debt is left unrepaid.
    let kept = global(&r.account.totals().await.unwrap()).used();
    assert_eq!(kept, oversell, "the account keeps exactly the oversell");
    assert_eq!(r.us_api.metrics.borrowed.load(Relaxed), 14);
    assert_eq!(r.us_api.metrics.borrow_repaid.load(Relaxed), 14);
    assert_eq!(r.home.metrics.borrow_over_limit.load(Relaxed), oversell);
    idempotent_and_zero_drift(&r, &admitted[0], totals).await;

    // `us` may borrow again only its ceiling less what it keeps.
    r.pg.stop();
    let mut later = 0u64;
    for n in 0..10 {
        if reserve(us, &format!("d{n}"), "seats", 1).await.0 == 201 {
            later += 1;
        }
    }
    assert_eq!(later, BOUND - oversell);
    eprintln!(
        "borrowing: ceiling {BOUND}, admitted 10 of 25 concurrent + 4 of 10 while eu's database was down, \
         oversell {oversell}, kept {kept}, {} s",
        started.elapsed().as_secs_f64()
    );
}
