//! Nested levels in a real Envoy 1.40 (`--concurrency 2`), on both hosts:
//! an organisation's budget shared by its teams, the values read from a
//! verified JWT's claims (jwt_authn's `claim_to_headers` after the
//! client's copies were removed, envoy/demo.yaml's port 10001), a flooding
//! team held to the pool while a guaranteed team keeps its share, the
//! refusing level named in the answer and in the access log's decision
//! record, and a client's forged level header ignored. On the wasm filter, the same with the levels read from
//! the claims themselves (`identity.jwt`, `claim:`). An organisation's
//! money budget per calendar month in New York, refused until the month
//! ends there (Python's `zoneinfo` says when).

use std::time::{Duration, Instant};

use tenantgate_integration_tests::cluster::cluster;
use tenantgate_integration_tests::{demo_token, get, on_both_hosts, wait_for, Conn, Envoy, Host, Response};

/// Organisations of 20 requests a minute; `search` is guaranteed 25 % (5),
/// the pool is 15.
const POLICY: &str = r#"
version: "nested-it"
identity: { header: x-tenant-id }
plans: { user: { limits: [ { rate: 1000, per: 1m } ] } }
default_plan: user
anonymous: { plan: user }
levels:
  - { name: org, header: x-org, limits: [ { name: requests, rate: 20, per: 1m } ] }
  - name: team
    parent: org
    header: x-team
    members: { search: { guarantee: 25 } }
routes: { api: {} }
default_route: api
"#;

/// The same tree read from the verified payload itself (wasm only).
const CLAIMS_POLICY: &str = r#"
version: "nested-claims-it"
identity: { jwt: { payload_in_metadata: jwt_payload, claim: tenant } }
plans: { user: { limits: [ { rate: 1000, per: 1m } ] } }
default_plan: user
anonymous: { plan: user }
levels:
  - { name: org, claim: org, limits: [ { name: requests, rate: 20, per: 1m } ] }
  - name: team
    parent: org
    claim: team
    members: { search: { guarantee: 25 } }
routes: { api: {} }
default_route: api
"#;

/// `n` requests with `token`'s identity (and `extra` headers); the answers.
fn send(conn: &mut Conn, token: &str, extra: &[(&str, &str)], n: usize) -> Vec<Response> {
    let bearer = format!("Bearer {}", demo_token(token));
    let mut headers = vec![("authorization", bearer.as_str())];
    headers.extend_from_slice(extra);
    (0..n)
        .map(|_| conn.get("/api/orders", &headers).unwrap())
        .collect()
}

fn admitted(answers: &[Response]) -> usize {
    answers.iter().filter(|r| r.status == 200).count()
}

/// The scenario both policies must pass, on Envoy's JWT listener.
fn a_flooding_team_leaves_the_guaranteed_one_its_share(envoy: &Envoy) {
    let mut conn = Conn::open(envoy.jwt_port).unwrap();
    // `ads` floods acme: the pool of 15, then 429s naming the level.
    let flood = send(&mut conn, "acme-ads-bot", &[], 30);
    assert_eq!(admitted(&flood), 15);
    let first = &flood[0];
    assert_eq!(
        first.header("ratelimit-policy"),
        Some(r#""user";q=1000;w=60, "org:requests";q=15;w=60"#)
    );
    let refused = &flood[15];
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("x-tenantgate-reason"), Some("rate_limited"));
    let body = refused.json();
    assert_eq!(body["level"], "org", "{body}");
    assert_eq!(body["limit"], "org:requests");
    assert!(refused
        .header("ratelimit")
        .unwrap()
        .starts_with(r#""org:requests";r=0"#));
    // Another user of `ads`, and `ads` claiming another organisation in a
    // header of its own: still acme, still nothing.
    assert_eq!(admitted(&send(&mut conn, "acme-ads-bot2", &[], 5)), 0);
    let forged = [("x-org", "globex"), ("x-team", "search")];
    assert_eq!(admitted(&send(&mut conn, "acme-ads-bot", &forged, 5)), 0);
    // `search` keeps its guaranteed 5, and not one more.
    assert_eq!(admitted(&send(&mut conn, "acme-search-carol", &[], 10)), 5);
    // Another organisation has its own budget.
    let globex = send(&mut conn, "globex-ads-bot", &[], 20);
    assert_eq!(
        admitted(&globex),
        15,
        "{} {:?} {}",
        envoy.host == Host::Wasm,
        globex[0].headers,
        String::from_utf8_lossy(&globex[0].body)
    );
}

/// Max-min fairness of initech's pool of 15 (`sharing: max_min`, the
/// default): `ads` takes 10 alone; once `web` asks too and the pool holds
/// less than half its burst, `ads` is over its fair share (7.5 of 15) and
/// refused with tokens still in the pool, which go to `web`. Its
/// `Retry-After` is when its use (10) decays to its share: 60 s × ln(10 /
/// 7.5) ≈ 17.3 s.
fn the_pool_goes_to_the_team_within_its_fair_share(envoy: &Envoy) {
    let from = |team| [("x-tenant-id", "u"), ("x-org", "initech"), ("x-team", team)];
    let ads = from("ads");
    let web = from("web");
    for _ in 0..10 {
        assert_eq!(get(envoy.port, "/api/orders", &ads).status, 200);
    }
    assert_eq!(get(envoy.port, "/api/orders", &web).status, 200);
    let over = get(envoy.port, "/api/orders", &ads);
    assert_eq!(over.status, 429, "{}", String::from_utf8_lossy(&over.body));
    assert_eq!(over.json()["level"], "org");
    let wait = over.retry_after();
    assert!((17..=18).contains(&wait), "Retry-After {wait}");
    let web_in = (0..5)
        .filter(|_| get(envoy.port, "/api/orders", &web).status == 200)
        .count();
    assert_eq!(web_in, 4, "the pool's last 4 go to `web`");
}

on_both_hosts!(nested_levels_from_verified_claims);
fn nested_levels_from_verified_claims() {
    let envoy = Envoy::start(POLICY);
    a_flooding_team_leaves_the_guaranteed_one_its_share(&envoy);
    // The demo listener (headers as sent: a trusted hop's) logs each
    // request's decision record: a level's refusal names the level.
    let acme = [("x-tenant-id", "bot"), ("x-org", "acme"), ("x-team", "ads")];
    assert_eq!(get(envoy.port, "/api/orders", &acme).status, 429);
    let logged = wait_for(Duration::from_secs(5), || {
        envoy.log().lines().any(|l| {
            l.starts_with("/api/orders 429 outcome=rate_limited ")
                && l.ends_with(" limit=org:requests level=org")
        })
    });
    assert!(
        logged,
        "no decision record naming the level: {}",
        envoy.log_tail()
    );
    the_pool_goes_to_the_team_within_its_fair_share(&envoy);
    if envoy.host == Host::Module {
        // The module reads no claim inside jwt_authn's payload: a policy
        // with claim levels (and a JWT identity) is refused, saying why.
        let (applied, why) = envoy.apply(CLAIMS_POLICY);
        assert!(!applied, "policy apply --module accepted claim levels");
        assert!(why.contains("claim_to_headers"), "{why}");
        return;
    }
    drop(envoy);
    let envoy = Envoy::start(CLAIMS_POLICY);
    a_flooding_team_leaves_the_guaranteed_one_its_share(&envoy);
}

/// An organisation's money budget per calendar month in New York: 5,500
/// USD in micro-units (over the 2³² a window counted before), requests
/// estimated at 1,000 USD each (the most one request may cost).
const MONTH_POLICY: &str = r#"
version: "month-it"
identity: { header: x-tenant-id }
plans: { user: { limits: [ { rate: 10000000000000, per: 365d } ] } }
default_plan: user
anonymous: { plan: user }
levels:
  - name: org
    header: x-org
    limits:
      - { name: usd, algorithm: fixed_window, rate: 5500000000, per: month, time_zone: America/New_York }
routes: { api: { cost: 1000000000 } }
default_route: api
"#;

/// When the month after `now` (UTC seconds) starts in `zone`, as Python's
/// `zoneinfo` reads the machine's time-zone database (not the filter's
/// table).
fn next_month_in(zone: &str, now: u64) -> u64 {
    let python = std::env::var("TENANTGATE_PYTHON")
        .unwrap_or_else(|_| format!("{}/../.venv/bin/python", env!("CARGO_MANIFEST_DIR")));
    let script = "import datetime as d, sys, zoneinfo\n\
        z = zoneinfo.ZoneInfo(sys.argv[1])\n\
        t = d.datetime.fromtimestamp(int(sys.argv[2]), z)\n\
        y, m = (t.year + 1, 1) if t.month == 12 else (t.year, t.month + 1)\n\
        print(int(d.datetime(y, m, 1, tzinfo=z).timestamp()))";
    let out = std::process::Command::new(&python)
        .args(["-c", script, zone, &now.to_string()])
        .output()
        .unwrap_or_else(|e| panic!("{python}: {e}"));
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)))
}

/// Seconds since the epoch, now.
fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

on_both_hosts!(a_monthly_money_budget_ends_at_midnight_in_its_time_zone);
fn a_monthly_money_budget_ends_at_midnight_in_its_time_zone() {
    let envoy = Envoy::start(MONTH_POLICY);
    let acme = [("x-tenant-id", "alice"), ("x-org", "acme")];
    let first = get(envoy.port, "/api/orders", &acme);
    assert_eq!(first.status, 200);
    assert_eq!(
        first.header("ratelimit-policy"),
        Some(r#""user";q=10000000000000;w=31536000, "org:usd";q=5500000000;w=2629746"#)
    );
    for _ in 0..4 {
        assert_eq!(get(envoy.port, "/api/orders", &acme).status, 200);
    }
    let now = unix_secs();
    let refused = get(envoy.port, "/api/orders", &acme);
    assert_eq!(refused.status, 429, "{}", String::from_utf8_lossy(&refused.body));
    assert_eq!(refused.json()["limit"], "org:usd");
    let wait = refused.retry_after();
    let expect = next_month_in("America/New_York", now) - now;
    eprintln!("the month's last 500 USD refused; Retry-After {wait} s, zoneinfo says {expect} s");
    assert!(
        expect.abs_diff(wait) <= 2,
        "Retry-After {wait}, the month ends in {expect} s"
    );
    let ratelimit = refused.header("ratelimit").unwrap_or_default();
    assert!(ratelimit.contains(r#""org:usd";r=500000000;t="#), "{ratelimit}");
}

/// Global levels: organisations of 120 a minute whose `search` team is
/// guaranteed 25 % (30 a minute, the pool 90), users of 30 a minute, all
/// allocated over the nodes by `tenantgate serve`; `fail_closed`, so the
/// bound has no outage term.
const GLOBAL_POLICY: &str = r#"
version: "nested-global-it"
identity: { header: x-tenant-id }
plans: { user: { limits: [ { name: user, rate: 30, per: 1m, global: true } ] } }
default_plan: user
anonymous: { plan: user }
levels:
  - { name: org, header: x-org, limits: [ { name: requests, rate: 120, per: 1m, global: true } ] }
  - name: team
    parent: org
    header: x-team
    members: { search: { guarantee: 25 } }
routes: { api: {} }
default_route: api
sync: { cluster: tenantgate, interval: 1s, timeout: 500ms, provisional: 2, failure_mode: fail_closed }
"#;

/// The stated bound of one budget of `limit` a minute (burst `limit`) over
/// `secs` seconds on `nodes` nodes with `P` = 2 and `S` = 1, `fail_closed`:
/// what the whole run may admit (`L + B + N·S·P` per window, the refill
/// over the rest of the run; docs/global-limits.md, "Nested levels").
fn run_bound(limit: u64, secs: u64, nodes: u64) -> u64 {
    limit + limit * secs / 60 + nodes * 2
}

on_both_hosts!(global_levels_hold_their_bound_across_nodes_and_keep_the_guarantee);
/// Three Envoys in two regions and `tenantgate serve`, for 12 s: team `ads`
/// of acme floods from eight users, each spreading its requests over the
/// three Envoys; carol of `search` asks once a second on one Envoy; a
/// globex user sprays 150 requests over the nodes against its own 30 a
/// minute. Acme's pool, carol's guarantee and the sprayer's limit hold
/// their bound, and carol is never refused.
fn global_levels_hold_their_bound_across_nodes_and_keep_the_guarantee() {
    let c = cluster("nested", &["r1", "r1", "r2"], GLOBAL_POLICY, GLOBAL_POLICY);
    let ports: Vec<u16> = c.envoys.iter().map(|e| e.port).collect();
    let run = Duration::from_secs(12);
    let start = Instant::now();
    let ask = |port: u16, user: &str, org: &str, team: &str| {
        get(
            port,
            "/api/x",
            &[("x-tenant-id", user), ("x-org", org), ("x-team", team)],
        )
        .status
            == 200
    };
    let flood = std::thread::scope(|s| {
        let flood = s.spawn(|| {
            let (mut admitted, mut sent) = (0u64, 0u64);
            while start.elapsed() < run && sent < 3_000 {
                let user = format!("ads-{}", sent % 8);
                admitted += u64::from(ask(ports[(sent as usize) % 3], &user, "acme", "ads"));
                sent += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            (admitted, sent)
        });
        let spray = s.spawn(|| {
            let (mut admitted, mut sent) = (0u64, 0u64);
            while start.elapsed() < run && sent < 150 {
                admitted += u64::from(ask(ports[(sent as usize) % 3], "sprayer", "globex", "ads"));
                sent += 1;
                std::thread::sleep(Duration::from_millis(70));
            }
            (admitted, sent)
        });
        let mut carol = (0u64, 0u64);
        while start.elapsed() < run {
            carol.0 += u64::from(ask(ports[0], "carol", "acme", "search"));
            carol.1 += 1;
            std::thread::sleep(Duration::from_secs(1));
        }
        (flood.join().unwrap(), spray.join().unwrap(), carol)
    });
    let ((ads, ads_sent), (sprayed, spray_sent), (carol, carol_sent)) = flood;
    let secs = start.elapsed().as_secs() + 1;
    eprintln!(
        "nested global: ads {ads}/{ads_sent} (pool bound {}), sprayer {sprayed}/{spray_sent} (bound {}), carol {carol}/{carol_sent}",
        run_bound(90, secs, 3),
        run_bound(30, secs, 3)
    );
    assert!(ads_sent > 300, "the flood sent only {ads_sent}");
    assert!(ads <= run_bound(90, secs, 3), "acme's pool admitted {ads}");
    assert!(ads >= 60, "acme's pool admitted only {ads} of its 90");
    assert!(sprayed <= run_bound(30, secs, 3), "the sprayer got {sprayed}");
    assert!(sprayed >= 20, "the sprayer got only {sprayed} of its 30");
    assert_eq!(
        carol, carol_sent,
        "carol stayed within her guarantee and was refused"
    );
    // `tenantgate top --once`: the service's view, the level budgets
    // grouped by level (acme's pool, refusing the flood).
    let url = format!("http://127.0.0.1:{}", c.serve.admin_port);
    let top = std::process::Command::new(tenantgate_integration_tests::cli_bin())
        .args(["top", "--service", url.as_str(), "--once"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&top.stdout);
    eprintln!("{text}");
    assert!(top.status.success(), "{}", String::from_utf8_lossy(&top.stderr));
    let by_level: Vec<&str> = text.lines().skip_while(|l| !l.contains("by level")).collect();
    assert!(
        by_level.iter().any(|l| l.trim() == "org (api)")
            && by_level.iter().any(|l| l.trim_start().starts_with("acme ")),
        "top groups acme's budgets by level:\n{text}"
    );
}

/// An organisation's budget of 40 requests a calendar month (UTC),
/// allocated over two Envoys by `tenantgate serve`.
const GLOBAL_MONTH_POLICY: &str = r#"
version: "global-month-it"
identity: { header: x-tenant-id }
plans: { user: { limits: [ { rate: 1000, per: 1m } ] } }
default_plan: user
anonymous: { plan: user }
levels:
  - name: org
    header: x-org
    limits: [ { name: month, algorithm: fixed_window, rate: 40, per: month, time_zone: UTC, global: true } ]
routes: { api: {} }
default_route: api
sync: { cluster: tenantgate, interval: 1s, timeout: 500ms, provisional: 2, failure_mode: fail_closed }
"#;

on_both_hosts!(a_global_monthly_budget_is_spent_once_across_nodes);
/// Two Envoys in two regions: acme asks on both, 20 ms apart, for 8 s (at
/// most 400 requests). The month's 40 are admitted once over the nodes
/// (the bound: the budget, plus each node's provisional 2 before its first
/// lease; no refill until the month ends), no refusal's `Retry-After`
/// passes the month's end (Python's `zoneinfo` says when), and once the
/// month is spent it is the month's end.
fn a_global_monthly_budget_is_spent_once_across_nodes() {
    let c = cluster("month", &["r1", "r2"], GLOBAL_MONTH_POLICY, GLOBAL_MONTH_POLICY);
    let envoys = &c.envoys;
    let acme = [("x-tenant-id", "alice"), ("x-org", "acme")];
    let month_end = next_month_in("UTC", unix_secs());
    let start = Instant::now();
    let (mut admitted, mut sent, mut refused, mut longest) = (0u64, 0u64, 0u64, 0u64);
    while start.elapsed() < Duration::from_secs(8) && sent < 400 {
        let r = get(envoys[(sent % 2) as usize].port, "/api/x", &acme);
        sent += 1;
        match r.status {
            200 => admitted += 1,
            429 => {
                refused += 1;
                let wait = r.retry_after();
                assert!(
                    unix_secs() + wait <= month_end + 2,
                    "Retry-After {wait} passes the month's end"
                );
                longest = longest.max(wait);
            }
            other => panic!("{other}: {}", String::from_utf8_lossy(&r.body)),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "global month: {admitted} of 40 admitted over 2 nodes ({sent} sent, {refused} refused, bound 44); longest Retry-After {longest} s"
    );
    assert!((36..=44).contains(&admitted), "{admitted} admitted");
    assert!(refused > 100, "{refused} refused");
    // Once the service said the month is spent (nothing left in its
    // bucket or any lease), a refusal waits until the month's end.
    let to_end = month_end.saturating_sub(unix_secs());
    assert!(
        longest + 5 >= to_end,
        "longest Retry-After {longest} s, the month ends in {to_end} s"
    );
}
