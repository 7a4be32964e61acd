//! Nested levels in a real Envoy 1.40 (`--concurrency 2`), on both hosts:
//! an organisation's budget shared by its teams, the values read from a
//! verified JWT's claims (jwt_authn's `claim_to_headers` after the
//! client's copies were removed, envoy/demo.yaml's port 10001), a flooding
//! team held to the pool while a guaranteed team keeps its share, the
//! refusing level named in the answer and in the access log's decision
//! record, and a client's forged level header ignored. On the wasm filter, the same with the levels read from
//! the claims themselves (`identity.jwt`, `claim:`).

use std::time::Duration;

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
