//! Nested levels (`levels:`) through the engine: a request is charged at
//! its tenant and every level at once, all or nothing; the first level that
//! would be exceeded refuses and is named; a member's guarantee holds while
//! the rest of its parent is flooded; a ceiling caps a member; values come
//! from the trusted source only; a settled cost reaches every level.

use super::*;
use crate::engine::{settle, Charged, Difference};

const CLAIM: &str = "jwt_payload";

fn claim(name: &str) -> [&str; 5] {
    [
        "metadata",
        "filter_metadata",
        "envoy.filters.http.jwt_authn",
        CLAIM,
        name,
    ]
}

/// Users of 1,000 a minute, in teams of 200 a minute, in organisations of
/// 100 a minute: `search` is guaranteed 30 % of its organisation, `batch`
/// may use at most 50 %.
fn nested(user_rate: u64, extra_route: &str) -> Policy {
    Policy::from_json(
        nested_json(user_rate, "max_min")
            .replace("EXTRA", extra_route)
            .as_bytes(),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// [`nested`]'s policy, its organisation's pool shared by `sharing`
/// (`EXTRA` stands for more routes).
fn nested_json(user_rate: u64, sharing: &str) -> String {
    format!(
        r#"{{"version":"nested-1",
        "identity":{{"jwt":{{"payload_in_metadata":"{CLAIM}","claim":"sub"}}}},
        "plans":{{"user":{{"limits":[{{"rate":{user_rate},"per":"1m"}}]}}}},
        "default_plan":"user","anonymous":{{"plan":"user"}},
        "levels":[
            {{"name":"org","claim":"org","limits":[{{"name":"monthly","rate":100,"per":"1m"}}],"sharing":"{sharing}"}},
            {{"name":"team","parent":"org","claim":"team","limits":[{{"rate":200,"per":"1m"}}],
              "members":{{"search":{{"guarantee":30}},"batch":{{"ceiling":50}}}}}}
        ],
        "routes":{{"chat":{{}}EXTRA}}}}"#
    )
}

fn user(
    store: &std::rc::Rc<std::cell::RefCell<SharedStore>>,
    sub: &str,
    team: &str,
    org: &str,
) -> MemoryHost {
    MemoryHost::new(store.clone())
        .route_class("chat")
        .property(&claim("sub"), sub)
        .property(&claim("team"), team)
        .property(&claim("org"), org)
}

#[test]
fn every_level_is_charged_and_the_first_exceeded_refuses_by_name() {
    let p = nested(1000, "");
    let store = SharedStore::new();
    let h = user(&store, "alice", "web", "acme");
    let d = run(&p, &h, T0);
    assert_eq!(d.reason, Reason::Allowed);
    let headers = d.headers.clone().unwrap();
    assert_eq!(
        headers.policy, r#""user";q=1000;w=60, "team:team";q=200;w=60, "org:monthly";q=70;w=60"#,
        "the organisation's pool is what the 30 % guarantee leaves"
    );
    assert!(
        headers.ratelimit.contains(r#""org:monthly";r=69"#),
        "{}",
        headers.ratelimit
    );
    assert_eq!(admitted(&p, &h, T0, 200), 69, "the pool of 70, less the first");
    let d = run(&p, &h, T0);
    assert_eq!(d.reason, Reason::RateLimited);
    assert_eq!(
        d.limit,
        Some(LimitName::Level {
            level: "org".into(),
            name: "org:monthly".into(),
            fair_share: false,
        })
    );
    assert!(d.retry_after_secs >= 1);
    let reply = response::local_reply(&d, &p.version, true, None).unwrap();
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(body["level"], "org");
    assert_eq!(body["limit"], "org:monthly");
    assert!(reply
        .header("ratelimit")
        .unwrap()
        .starts_with(r#""org:monthly";r=0"#));
}

#[test]
fn a_level_that_refuses_gives_back_the_tenant_and_the_levels_below() {
    let p = nested(10, "");
    let store = SharedStore::new();
    // acme's pool of 70 spent by 7 users of 10 each.
    for i in 0..7 {
        let h = user(&store, &format!("u{i}"), "web", "acme");
        assert_eq!(admitted(&p, &h, T0, 20), 10);
    }
    // dave of team `ops` in acme: refused by acme, charged nothing.
    let dave = user(&store, "dave", "ops", "acme");
    for _ in 0..50 {
        assert_eq!(
            run(&p, &dave, T0)
                .limit
                .and_then(|l| l.level().map(str::to_owned))
                .as_deref(),
            Some("org")
        );
    }
    // In another organisation, dave and `ops` still have everything.
    let dave = user(&store, "dave", "ops", "globex");
    assert_eq!(admitted(&p, &dave, T0, 20), 10, "dave's own 10 were never taken");
}

#[test]
fn a_guaranteed_member_keeps_its_share_while_another_floods() {
    let p = nested(1000, "");
    let store = SharedStore::new();
    // A team without a guarantee floods: it gets the pool, 70.
    let flood = user(&store, "bot", "ads", "acme");
    assert_eq!(admitted(&p, &flood, T0, 500), 70);
    // `search` still has its 30, and not one more.
    let quiet = user(&store, "carol", "search", "acme");
    assert_eq!(admitted(&p, &quiet, T0, 100), 30);
    // The organisation admitted its 100, never more.
    assert_eq!(admitted(&p, &flood, T0, 100) + admitted(&p, &quiet, T0, 100), 0);
    // Refilled, and the flood's demand long faded (it is measured over an
    // eighth of the minute): `search` takes its guarantee first, then the
    // whole pool.
    let later = T0 + 120 * S;
    assert_eq!(admitted(&p, &quiet, later, 500), 100);
    assert_eq!(admitted(&p, &flood, later, 100), 0);
}

/// `ads` asks 300 a minute of acme's pool of 70 and `web` 30: max-min
/// fair, `web` gets all it asks and `ads` the 40 it leaves. First come,
/// `ads` takes most of each refill and `web` is refused.
#[test]
fn the_pool_is_shared_max_min_fairly_while_contended() {
    let run_for = |p: &Policy| -> (usize, usize, u64) {
        let store = SharedStore::new();
        let ads = user(&store, "bot", "ads", "acme");
        let web = user(&store, "alice", "web", "acme");
        let (mut ads_in, mut web_in, mut wait) = (0, 0, 0);
        // 5 minutes, measured over the last 3.
        for tick in 0..600u64 {
            let now = T0 + tick * S / 2;
            let counted = tick >= 240;
            for _ in 0..2 {
                let d = run(p, &ads, now);
                if d.reason == Reason::Allowed && counted {
                    ads_in += 1;
                }
                if d.reason == Reason::RateLimited {
                    wait = wait.max(d.retry_after_secs);
                    if d.limit.as_ref().is_some_and(LimitName::fair_share) {
                        let reply = response::local_reply(&d, &p.version, true, None).unwrap();
                        let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
                        assert_eq!(body["level"], "org");
                        assert!(
                            body["detail"].as_str().unwrap().contains("shared fairly"),
                            "{body}"
                        );
                    }
                }
            }
            if tick % 2 == 0 && run(p, &web, now).reason == Reason::Allowed && counted {
                web_in += 1;
            }
        }
        (ads_in, web_in, wait)
    };
    let fair = nested(1000, "");
    let (ads, web, wait) = run_for(&fair);
    assert!(web >= 86, "web asked 90 in 3 minutes and got {web}");
    assert!(
        (100..=140).contains(&ads),
        "ads got {ads} (its share: 40 a minute)"
    );
    assert!(ads + web <= 70 * 3 + 35, "the pool's bound: {}", ads + web);
    assert!((1..=60).contains(&wait), "{wait}");
    let first_come = Policy::from_json(nested_json(1000, "first_come").replace("EXTRA", "").as_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    let (ads, web, _) = run_for(&first_come);
    assert!(web < 60, "first come, web got {web} of 90 (ads {ads})");
}

#[test]
fn a_ceiling_caps_a_member_within_its_parent() {
    let p = nested(1000, "");
    let store = SharedStore::new();
    let batch = user(&store, "job", "batch", "acme");
    assert_eq!(admitted(&p, &batch, T0, 500), 50, "50 % of acme's 100");
    let other = user(&store, "eve", "web", "acme");
    assert_eq!(
        admitted(&p, &other, T0, 500),
        20,
        "what batch left of the pool of 70"
    );
}

#[test]
fn level_values_come_from_the_verified_payload_only() {
    let p = nested(1000, "");
    let store = SharedStore::new();
    // A client's headers are not the claim: still acme.
    let forged = user(&store, "mallory", "web", "acme")
        .header("org", "fresh-org")
        .header("x-org", "fresh-org");
    assert_eq!(admitted(&p, &forged, T0, 500), 70);
    // Without the claim (or with an unusable value), every such request
    // shares one budget: dropping a claim never escapes a level.
    for (sub, org) in [("m1", None), ("m2", Some("bad value")), ("m3", None)] {
        let mut h = MemoryHost::new(store.clone())
            .route_class("chat")
            .property(&claim("sub"), sub)
            .property(&claim("team"), "web");
        if let Some(org) = org {
            h = h.property(&claim("org"), org);
        }
        let n = admitted(&p, &h, T0, 500);
        assert_eq!(n, if sub == "m1" { 70 } else { 0 }, "{sub}");
    }
}

#[test]
fn values_never_share_a_key_whatever_bytes_they_hold() {
    let p = nested(1000, "");
    let store = SharedStore::new();
    // `a|b` in `c` and `a` in `b|c` are two paths, two keys.
    let one = user(&store, "u1", "a|5:b", "c");
    let two = user(&store, "u2", "a", "1:c|5:b");
    run(&p, &one, T0);
    run(&p, &two, T0);
    let keys: Vec<String> = table_keys(&store)
        .into_iter()
        .filter(|k| k.contains("|l|team|") && !k.ends_with("|f"))
        .collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
}

#[test]
fn a_settled_cost_reaches_every_level_it_was_charged_at() {
    let route = r#","llm":{"action":"chat","cost":10,"settle":{"usage":"openai_total","ceiling":50}}"#;
    let p = nested(1000, route);
    let store = SharedStore::new();
    let h = MemoryHost::new(store.clone())
        .route_class("llm")
        .property(&claim("sub"), "alice")
        .property(&claim("team"), "web")
        .property(&claim("org"), "acme");
    let req = prepare(&p, &h).unwrap();
    let d = charge(&p, &req, &h, T0, &mut Scratch::default());
    assert_eq!(d.reason, Reason::Allowed);
    assert!(d.levels_charged.any());
    let charged = Charged {
        limits: d.charged,
        guard: d.guard_charged,
        levels: d.levels_charged,
        at: T0,
    };
    // Its answer cost 40, not 10: acme's pool of 70 has 30 left.
    settle(
        &p,
        &req,
        &h,
        &charged,
        Difference::More(30),
        T0,
        &mut Scratch::default(),
    );
    let other = user(&store, "bob", "web", "acme");
    assert_eq!(admitted(&p, &other, T0, 100), 30);
}

#[test]
fn anonymous_requests_belong_to_no_level() {
    let p = nested(5, "");
    let store = SharedStore::new();
    let h = MemoryHost::new(store.clone())
        .route_class("chat")
        .source("10.0.0.1:1");
    let req = prepare(&p, &h).unwrap();
    assert!(req.levels.is_empty());
    assert_eq!(admitted(&p, &h, T0, 50), 5, "the anonymous plan alone");
}

#[test]
fn long_values_at_every_level_still_have_keys_of_their_own() {
    let p = nested(1000, "");
    let store = SharedStore::new();
    let long = |c: char| c.to_string().repeat(128);
    // Two 128-byte values: over the key table's 255 bytes, hashed.
    let one = user(&store, "u1", &long('t'), &long('o'));
    let two = user(&store, "u2", &long('u'), &long('o'));
    assert_eq!(admitted(&p, &one, T0, 50), 50);
    assert_eq!(
        admitted(&p, &two, T0, 50),
        20,
        "the same organisation's pool of 70"
    );
    let keys: Vec<String> = table_keys(&store)
        .into_iter()
        .filter(|k| k.contains("|l|team|#"))
        .collect();
    // Two budgets and their pools' fairness tables (`…|f`, hashed too).
    assert_eq!(keys.len(), 4, "{keys:?}");
    assert!(keys.iter().all(|k| k.len() <= crate::table::MAX_KEY_LEN));
}

#[test]
fn a_calendar_month_budget_refuses_until_the_month_ends_in_its_time_zone() {
    let json = format!(
        r#"{{"version":"month-1",
        "identity":{{"jwt":{{"payload_in_metadata":"{CLAIM}","claim":"sub"}}}},
        "plans":{{"user":{{"limits":[{{"rate":1000,"per":"1m"}}]}}}},
        "default_plan":"user","anonymous":{{"plan":"user"}},
        "levels":[{{"name":"org","claim":"org","limits":[
            {{"name":"month","algorithm":"fixed_window","rate":5,"per":"month","time_zone":"+01:00"}}]}}],
        "routes":{{"chat":{{}}}}}}"#
    );
    let p = Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    let store = SharedStore::new();
    let h = MemoryHost::new(store.clone())
        .route_class("chat")
        .property(&claim("sub"), "alice")
        .property(&claim("org"), "acme");
    // T0 is 2026-11-30T00:53:20Z; November ends at 23:00Z in UTC+01:00.
    assert_eq!(admitted(&p, &h, T0, 10), 5);
    let d = run(&p, &h, T0);
    assert_eq!(d.retry_after_secs, 79_600, "{d:?}");
    assert_eq!(admitted(&p, &h, T0 + 79_600 * S - 1, 1), 0);
    assert_eq!(admitted(&p, &h, T0 + 79_600 * S, 10), 5, "December");
}

#[test]
fn a_calendar_month_in_a_zone_with_summer_time_ends_at_its_local_midnight() {
    let json = format!(
        r#"{{"version":"month-2",
        "identity":{{"jwt":{{"payload_in_metadata":"{CLAIM}","claim":"sub"}}}},
        "plans":{{"user":{{"limits":[{{"rate":1000,"per":"1m"}}]}}}},
        "default_plan":"user","anonymous":{{"plan":"user"}},
        "levels":[{{"name":"org","claim":"org","limits":[
            {{"name":"month","algorithm":"fixed_window","rate":5,"per":"month","time_zone":"Europe/Berlin"}}]}}],
        "routes":{{"chat":{{}}}}}}"#
    );
    let p = Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    let h = MemoryHost::new(SharedStore::new())
        .route_class("chat")
        .property(&claim("sub"), "alice")
        .property(&claim("org"), "acme");
    // 2027-03-31T12:00:00Z: Berlin has been on summer time (+02:00) since
    // the 28th, so March ends at 22:00Z, 10 hours on (+01:00 would say 11).
    let noon = 1_806_494_400 * S;
    assert_eq!(admitted(&p, &h, noon, 10), 5);
    let d = run(&p, &h, noon);
    assert_eq!(d.retry_after_secs, 36_000, "{d:?}");
    assert_eq!(admitted(&p, &h, noon + 36_000 * S - 1, 1), 0);
    assert_eq!(admitted(&p, &h, noon + 36_000 * S, 10), 5, "April");
}

#[test]
fn an_organisations_month_of_50000_dollars_in_micro_units_is_a_budget() {
    // 5·10¹⁰ micro-USD a month; each request's estimate the most one may
    // cost, 1,000 USD (10⁹).
    let json = format!(
        r#"{{"version":"month-3",
        "identity":{{"jwt":{{"payload_in_metadata":"{CLAIM}","claim":"sub"}}}},
        "plans":{{"user":{{"limits":[{{"rate":10000000000000,"per":"365d"}}]}}}},
        "default_plan":"user","anonymous":{{"plan":"user"}},
        "levels":[{{"name":"org","claim":"org","limits":[
            {{"name":"usd","algorithm":"fixed_window","rate":50000000000,"per":"month","time_zone":"America/New_York"}}]}}],
        "routes":{{"chat":{{"cost":1000000000}}}}}}"#
    );
    let p = Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    let h = MemoryHost::new(SharedStore::new())
        .route_class("chat")
        .property(&claim("sub"), "alice")
        .property(&claim("org"), "acme");
    assert_eq!(admitted(&p, &h, T0, 60), 50);
    let d = run(&p, &h, T0);
    assert_ne!(d.reason, Reason::Allowed);
    let headers = d.headers.clone().unwrap();
    assert!(
        headers.policy.contains(r#""org:usd";q=50000000000;w=2629746"#),
        "{}",
        headers.policy
    );
    assert!(
        headers.ratelimit.contains(r#""org:usd";r=0"#),
        "{}",
        headers.ratelimit
    );
}
