//! Regional borrowing end to end with the real binary: a home `tenantgate
//! serve --region eu` on a real PostgreSQL and a borrowing `--region us`
//! replica (`--borrow-store`, `--home-region-url`), both on loopback. The
//! home database stops: `us` borrows exactly its ceiling; it restarts: the
//! repayer moves the debt home. The bound and the ledgers are checked in
//! detail by `central/tests/borrow.rs`; this checks the flags and the
//! repayer the service starts.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tenantgate_central::testing::{free_port, PostgresServer};
use tenantgate_cli::http::request;

const POLICY: &str = r#"{"version":"b","identity":{"header":"x-tenant-id"},
 "plans":{"free":{"limits":[{"rate":1,"per":"1s"}]}},"default_plan":"free","anonymous":{"plan":"free"},
 "routes":{"api":{}},
 "quotas":{"seats":{"unit":"seat","risk":"low","home_region":"eu","limits":{"global":100},
                    "borrow":{"ceilings":{"us":10}}}}}"#;

struct Child9(Child);

impl Drop for Child9 {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(policy: &std::path::Path, api: SocketAddr, admin: SocketAddr, args: &[&str]) -> Child9 {
    Child9(
        Command::new(env!("CARGO_BIN_EXE_tenantgate"))
            .args(["serve", "--policy"])
            .arg(policy)
            .args(["--listen", &api.to_string(), "--admin", &admin.to_string()])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

fn addr() -> SocketAddr {
    format!("127.0.0.1:{}", free_port().unwrap()).parse().unwrap()
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ok() {
        assert!(Instant::now() < deadline, "{what} within 30 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn reserve(api: SocketAddr, id: &str) -> (u16, Value) {
    let body = format!(
        r#"{{"reservation_id":"{id}","resource":"seats","tenant":"acme","project":"web","amount":1}}"#
    );
    let (s, b) = request(api, None, "POST", "/v1/reservations", &body).unwrap();
    (s, serde_json::from_str(&b).unwrap())
}

fn committed_at(api: SocketAddr) -> Option<u64> {
    let (s, b) = request(api, None, "GET", "/v1/quotas/seats?tenant=acme&project=web", "").ok()?;
    let v: Value = serde_json::from_str(&b).ok()?;
    (s == 200 && v["estimate"] == false).then(|| v["levels"]["global"]["committed"].as_u64())?
}

fn metric(admin: SocketAddr, name: &str) -> Option<u64> {
    let (_, text) = request(admin, None, "GET", "/metrics", "").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn serve_borrows_its_ceiling_while_the_home_database_is_down_and_repays_when_it_is_back() {
    let mut pg = PostgresServer::start_with(&["-c fsync=off"])
        .unwrap_or_else(|e| panic!("PostgreSQL did not start: {e}"));
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let (eu, eu_admin, us, us_admin) = (addr(), addr(), addr(), addr());
    let _home = serve(
        &policy,
        eu,
        eu_admin,
        &["--region", "eu", "--quota-store", &pg.url()],
    );
    let main = format!("sqlite:{}", dir.path().join("main").display());
    let borrow = dir.path().join("borrow").display().to_string();
    let home_url = format!("eu=http://{eu}");
    let _us = serve(
        &policy,
        us,
        us_admin,
        &[
            "--region",
            "us",
            "--quota-store",
            &main,
            "--borrow-store",
            &borrow,
            "--home-region-url",
            &home_url,
        ],
    );
    wait_for("the home answers", || committed_at(eu) == Some(0));
    wait_for("us answers", || {
        metric(us_admin, "tenantgate_quota_borrowed_total") == Some(0)
    });
    let (s, v) = reserve(us, "early");
    assert_eq!((s, v["error"].as_str()), (409, Some("wrong_region")), "{v}");

    pg.stop();
    let mut admitted = 0;
    for n in 0..12 {
        let (s, v) = reserve(us, &format!("b{n}"));
        if s == 201 {
            assert_eq!(v["borrowed"], true, "{v}");
            admitted += 1;
            let path = format!("/v1/reservations/b{n}/commit");
            assert_eq!(request(us, None, "POST", &path, "").unwrap().0, 200);
        } else {
            assert_eq!((s, v["borrowing_ceiling"].as_u64()), (409, Some(10)), "{v}");
        }
    }
    assert_eq!(admitted, 10, "exactly the ceiling");

    pg.restart().unwrap();
    wait_for("the debt is repaid home", || committed_at(eu) == Some(10));
    wait_for("us holds no debt", || {
        metric(us_admin, "tenantgate_quota_borrow_debt_units") == Some(0)
    });
    assert_eq!(metric(us_admin, "tenantgate_quota_borrow_repaid_total"), Some(10));
}
