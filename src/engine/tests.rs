use super::*;
use crate::memory::{MemoryHost, SharedStore};
use crate::policy::Policy;
use crate::response;

const S: u64 = 1_000_000_000;
const T0: u64 = 1_796_000_000 * S;

fn policy(extra: &str) -> Policy {
    let json = format!(
        r#"{{
        "version": "test-1",
        "identity": {{"header": "x-tenant-id"}},
        "plans": {{
            "free": {{"limits": [{{"rate": 10, "per": "1s", "burst": 5}}]}},
            "paid": {{"limits": [{{"rate": 1000, "per": "1s"}}]}},
            "anon": {{"limits": [{{"rate": 2, "per": "1s", "burst": 5}}]}},
            "combo": {{"limits": [
                {{"name": "per_second", "rate": 10, "per": "1s"}},
                {{"name": "per_minute", "rate": 15, "per": "1m"}}
            ]}}
        }},
        "tenants": [
            {{"id": "acme", "plan": "free"}},
            {{"id": "bigco", "plan": "paid"}},
            {{"id": "combo", "plan": "combo"}}
        ],
        "default_plan": "free",
        "anonymous": {{"plan": "anon"}},
        "routes": {{
            "api": {{"action": "api"}},
            "orders": {{"action": "orders"}},
            "search": {{"action": "search", "cost": 5}}
        }}
        {extra}
    }}"#
    );
    match Policy::from_json(json.as_bytes()) {
        Ok(p) => p,
        Err(e) => panic!("test policy invalid: {e}"),
    }
}

fn req(store: &std::rc::Rc<std::cell::RefCell<SharedStore>>, class: &str, tenant: &str) -> MemoryHost {
    MemoryHost::new(store.clone())
        .route_class(class)
        .header("x-tenant-id", tenant)
        .source("10.1.2.3:5555")
}

/// Every logical key held in the store's key-table entries.
fn table_keys(store: &std::rc::Rc<std::cell::RefCell<SharedStore>>) -> Vec<String> {
    let store = store.borrow();
    let mut keys: Vec<String> = store
        .keys()
        .filter(|k| k.starts_with("tg2|k|"))
        .flat_map(|k| {
            crate::table::decode_entry(store.get(k).unwrap())
                .unwrap()
                .iter()
                .map(|s| String::from_utf8_lossy(s.key).into_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    keys.sort();
    keys
}

fn run(p: &Policy, host: &MemoryHost, now: u64) -> Decision {
    decide(p, host, now, &mut Scratch::default())
}

fn admitted(p: &Policy, host: &MemoryHost, now: u64, n: usize) -> usize {
    (0..n)
        .filter(|_| run(p, host, now).reason == Reason::Allowed)
        .count()
}

#[test]
fn a_tenant_gets_its_burst_then_429_with_exact_retry_after_and_headers() {
    let p = policy("");
    let store = SharedStore::new();
    let h = req(&store, "api", "acme");
    assert_eq!(admitted(&p, &h, T0, 5), 5);
    let d = run(&p, &h, T0);
    assert_eq!(d.reason, Reason::RateLimited);
    assert_eq!(d.deny_status(), Some(429));
    assert_eq!(d.limit.as_ref().map(LimitName::name), Some("free"));
    // 10/s: the next token is 100 ms away; Retry-After rounds up to 1 s.
    assert_eq!(d.retry_after_secs, 1);
    let headers = d.headers.clone().unwrap();
    assert_eq!(headers.policy, r#""free";q=10;w=1"#);
    assert_eq!(headers.ratelimit, r#""free";r=0;t=1"#);
    // Exactly when one token is back, one request is admitted.
    assert_eq!(run(&p, &h, T0 + 100_000_000 - 1).reason, Reason::RateLimited);
    assert_eq!(run(&p, &h, T0 + 100_000_000).reason, Reason::Allowed);
}

#[test]
fn allowed_responses_carry_remaining_and_reset() {
    let p = policy("");
    let store = SharedStore::new();
    let d = run(&p, &req(&store, "api", "acme"), T0);
    assert_eq!(d.reason, Reason::Allowed);
    let h = d.headers.unwrap();
    assert_eq!(h.policy, r#""free";q=10;w=1"#);
    // draft-11's `t`: no more than 4 within it. The next token is 0.1 s
    // away, so only t=0 is true (t=1 would allow 4 + 9).
    assert_eq!(h.ratelimit, r#""free";r=4;t=0"#);
}

/// draft-11 `t` at r=0 is the time until the next unit, never more than
/// Retry-After, and a client that waits `t` seconds is admitted (issue 32:
/// `r=0;t=60` beside `retry-after: 1`).
#[test]
fn a_client_that_waits_t_seconds_is_admitted() {
    let p = policy("");
    let store = SharedStore::new();
    let h = req(&store, "api", "combo");
    assert_eq!(admitted(&p, &h, T0, 15), 10);
    assert_eq!(admitted(&p, &h, T0 + S, 10), 5);
    let d = run(&p, &h, T0 + 2 * S);
    assert_eq!(d.reason, Reason::RateLimited);
    let ratelimit = d.headers.clone().unwrap().ratelimit;
    // per_minute (15/min, a token every 4 s) is empty and binds: its next
    // token is back at T0+4s, 2 s from now.
    assert_eq!(ratelimit, r#""per_minute";r=0;t=2"#);
    let t: u64 = ratelimit.rsplit("t=").next().unwrap().parse().unwrap();
    assert!(
        t <= d.retry_after_secs,
        "t {t} > retry-after {}",
        d.retry_after_secs
    );
    assert_eq!(run(&p, &h, T0 + 2 * S + t * S).reason, Reason::Allowed);
}

#[test]
fn tenants_and_actions_never_share_a_bucket() {
    let p = policy("");
    let store = SharedStore::new();
    assert_eq!(admitted(&p, &req(&store, "api", "acme"), T0, 20), 5);
    // Another tenant on the same plan, and the same tenant on another action.
    assert_eq!(admitted(&p, &req(&store, "api", "other"), T0, 20), 5);
    assert_eq!(admitted(&p, &req(&store, "orders", "acme"), T0, 20), 5);
    assert_eq!(admitted(&p, &req(&store, "api", "bigco"), T0, 2000), 1000);
    assert_eq!(
        table_keys(&store),
        ["api|t|acme", "api|t|bigco", "api|t|other", "orders|t|acme"]
    );
}

#[test]
fn route_class_comes_from_metadata_then_route_name_never_headers() {
    let p = policy(r#", "default_route": "api""#);
    let store = SharedStore::new();
    // Route name fallback: a route named "search" costs 5.
    let by_name = MemoryHost::new(store.clone())
        .property(&ROUTE_NAME_PROPERTY, "search")
        .header("x-tenant-id", "acme");
    assert_eq!(admitted(&p, &by_name, T0, 3), 1);
    // Client headers naming a class or plan change nothing.
    let forged = req(&store, "api", "acme")
        .header("x-tenantgate-class", "orders")
        .header("x-tenant-plan", "paid")
        .header("x-priority", "critical");
    assert_eq!(admitted(&p, &forged, T0, 20), 5);
    // An unknown class falls back to the default route.
    let unknown = req(&store, "no-such-class", "zed");
    assert_eq!(admitted(&p, &unknown, T0, 20), 5);
    assert!(table_keys(&store).contains(&"api|t|zed".to_owned()));
}

#[test]
fn classify_route_name_reads_only_the_route_name() {
    let p = policy(r#", "classify": "route_name""#);
    assert_eq!(p.classification, crate::policy::Classification::RouteName);
    let store = SharedStore::new();
    // Metadata naming `search` is not read: the route named `orders` decides.
    let h = MemoryHost::new(store.clone())
        .route_class("search")
        .property(&ROUTE_NAME_PROPERTY, "orders")
        .header("x-tenant-id", "acme")
        .header("x-tenantgate-class", "search");
    assert_eq!(admitted(&p, &h, T0, 20), 5);
    assert_eq!(table_keys(&store), vec!["orders|t|acme".to_owned()]);
    // A route with metadata but no (known) name is unclassified.
    let meta_only = req(&store, "api", "acme");
    assert_eq!(run(&p, &meta_only, T0).reason, Reason::Unclassified);
}

#[test]
fn an_instance_class_is_fixed_by_the_plugin_configuration() {
    let p = policy(r#", "class": "search""#);
    let store = SharedStore::new();
    // Neither route metadata, the route name nor a client header moves it.
    let h = MemoryHost::new(store.clone())
        .route_class("api")
        .property(&ROUTE_NAME_PROPERTY, "orders")
        .header("x-tenant-id", "acme")
        .header("x-tenantgate-class", "api");
    assert_eq!(admitted(&p, &h, T0, 3), 1, "search costs 5 of the burst of 5");
    assert_eq!(table_keys(&store), vec!["search|t|acme".to_owned()]);
    let bare = MemoryHost::new(store.clone()).header("x-tenant-id", "bigco");
    assert_eq!(run(&p, &bare, T0).reason, Reason::Allowed);
}

#[test]
fn without_a_default_route_unclassified_requests_pass_and_are_labelled() {
    let p = policy("");
    let store = SharedStore::new();
    let h = MemoryHost::new(store.clone()).header("x-tenant-id", "acme");
    let d = run(&p, &h, T0);
    assert_eq!(d.reason, Reason::Unclassified);
    assert!(store.borrow().is_empty());
}

#[test]
fn cost_is_charged_and_must_fit() {
    let p = policy("");
    let store = SharedStore::new();
    let h = req(&store, "search", "acme");
    assert_eq!(run(&p, &h, T0).reason, Reason::Allowed); // 5 of 5
    let d = run(&p, &h, T0);
    assert_eq!(d.reason, Reason::RateLimited);
    assert_eq!(d.retry_after_secs, 1); // 5 tokens × 100 ms = 500 ms → 1 s
}

#[test]
fn missing_or_invalid_identity_is_anonymous_by_client_address() {
    let p = policy("");
    let store = SharedStore::new();
    let none = MemoryHost::new(store.clone())
        .route_class("api")
        .source("192.0.2.7:40000");
    let d = run(&p, &none, T0);
    assert_eq!(
        d.subject,
        Subject::Anonymous {
            address: "192.0.2.7".into(),
            invalid_identity: false
        }
    );
    assert_eq!(admitted(&p, &none, T0, 10), 4); // anon: burst 5, one used above
                                                // Oversized and non-UTF-8 ids count as invalid, grouped with the address.
    for bad in [
        vec![b'a'; 65_536],
        vec![0xff, 0xfe, 0x00],
        b"has space".to_vec(),
        b"\x07bell".to_vec(),
    ] {
        let h = MemoryHost::new(store.clone())
            .route_class("api")
            .header("x-tenant-id", bad)
            .source("192.0.2.7:1");
        let d = run(&p, &h, T0);
        assert_eq!(d.reason, Reason::RateLimited);
        assert_eq!(
            d.subject,
            Subject::Anonymous {
                address: "192.0.2.7".into(),
                invalid_identity: true
            }
        );
    }
    let v6 = MemoryHost::new(store.clone())
        .route_class("api")
        .source("[2001:db8::1]:443");
    assert!(
        matches!(run(&p, &v6, T0).subject, Subject::Anonymous { ref address, .. } if &**address == "2001:db8::/64")
    );
}

#[test]
fn ipv4_mapped_ipv6_clients_are_grouped_by_their_ipv4_address() {
    // Regression: a dual-stack listener reports IPv4 clients as
    // `[::ffff:a.b.c.d]:port`; masked to /64 they all became `::/64`, one
    // anonymous bucket for every IPv4 client.
    let p = policy("");
    let store = SharedStore::new();
    let subject = |source: &str| {
        let h = MemoryHost::new(store.clone()).route_class("api").source(source);
        match run(&p, &h, T0).subject {
            Subject::Anonymous { address, .. } => address.to_string(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(subject("[::ffff:192.0.2.7]:40000"), "192.0.2.7");
    assert_eq!(subject("[::ffff:198.51.100.9]:40000"), "198.51.100.9");
    assert_eq!(subject("[::ffff:c000:207]:1"), "192.0.2.7", "the hex form too");
    // The same client over IPv4 shares the bucket.
    assert_eq!(subject("192.0.2.7:1"), "192.0.2.7");
    // Plain IPv6 keeps its /64.
    assert_eq!(subject("[2001:db8::1]:443"), "2001:db8::/64");
}

#[test]
fn jwt_claim_identity_reads_dynamic_metadata_not_headers() {
    let p = {
        let mut json = String::from(
            r#"{"version":"v","identity":{"jwt":{"payload_in_metadata":"jwt_payload","claim":"tenant"}},
            "plans":{"free":{"limits":[{"rate":1,"per":"1s"}]},"paid":{"limits":[{"rate":100,"per":"1s"}]}},
            "tenants":[{"id":"good","plan":"paid"}],"default_plan":"free","anonymous":{"plan":"free"},
            "routes":{"api":{}}}"#,
        );
        json.retain(|c| c != '\n');
        Policy::from_json(json.as_bytes()).unwrap()
    };
    let store = SharedStore::new();
    let claim = [
        "metadata",
        "filter_metadata",
        "envoy.filters.http.jwt_authn",
        "jwt_payload",
        "tenant",
    ];
    let h = MemoryHost::new(store.clone())
        .route_class("api")
        .property(&claim, "good")
        .header("x-tenant-id", "forged");
    let d = run(&p, &h, T0);
    assert_eq!(d.subject, Subject::Tenant("good".into()));
    assert_eq!(admitted(&p, &h, T0, 200), 99);
}

#[test]
fn several_limits_are_all_or_nothing() {
    let p = policy("");
    let store = SharedStore::new();
    let h = req(&store, "api", "combo");
    // 10/s burst 10 and 15/min: the minute limit binds after 15.
    assert_eq!(admitted(&p, &h, T0, 10), 10);
    assert_eq!(
        run(&p, &h, T0).limit.as_ref().map(LimitName::name),
        Some("per_second")
    );
    assert_eq!(admitted(&p, &h, T0 + S, 10), 5);
    let d = run(&p, &h, T0 + 2 * S);
    assert_eq!(d.reason, Reason::RateLimited);
    assert_eq!(d.limit.as_ref().map(LimitName::name), Some("per_minute"));
    // 15/min is 4 s a token; the minute bucket is full at T0+60s, so the
    // next token is back at T0+4s: 2 s from now.
    assert_eq!(d.retry_after_secs, 2);
    // Denied requests charged nothing: when the minute limit has a token
    // again (T0+4s), the second limit still has all but this one.
    let d = run(&p, &h, T0 + 4 * S);
    assert_eq!(d.reason, Reason::Allowed);
    assert_eq!(
        d.headers.unwrap().ratelimit,
        r#""per_second";r=9;t=0, "per_minute";r=0;t=4"#
    );
}

#[test]
fn shadow_mode_never_denies_but_reports() {
    let p = policy(r#", "mode": "shadow""#);
    let store = SharedStore::new();
    let h = req(&store, "api", "acme");
    let reasons: Vec<Reason> = (0..8).map(|_| run(&p, &h, T0).reason).collect();
    assert_eq!(reasons.iter().filter(|r| **r == Reason::Allowed).count(), 5);
    assert_eq!(reasons.iter().filter(|r| **r == Reason::ShadowLimited).count(), 3);
    assert!(reasons.iter().all(|r| r.deny_status().is_none()));
}

#[test]
fn mode_off_touches_nothing() {
    let p = policy(r#", "mode": "off""#);
    let store = SharedStore::new();
    assert_eq!(run(&p, &req(&store, "api", "acme"), T0).reason, Reason::Disabled);
    assert!(store.borrow().is_empty());
}

#[test]
fn cas_conflicts_are_retried_and_exhaustion_denies_with_503() {
    let p = policy("");
    let store = SharedStore::new();
    let h = req(&store, "api", "acme");
    *h.forced_conflicts.borrow_mut() = 3;
    let d = run(&p, &h, T0);
    assert_eq!(d.reason, Reason::Allowed);
    assert_eq!(d.cas_retries, 3);
    *h.forced_conflicts.borrow_mut() = MAX_CAS_ATTEMPTS;
    let d = run(&p, &h, T0);
    assert_eq!(d.reason, Reason::Contention);
    assert_eq!(d.deny_status(), Some(503));
    // The exhausted request charged nothing: 4 tokens remain.
    assert_eq!(admitted(&p, &h, T0, 10), 4);
}

#[test]
fn a_broken_host_store_denies_and_says_so() {
    let p = policy("");
    let mut h = req(&SharedStore::new(), "api", "acme");
    h.fail_shared = true;
    let d = run(&p, &h, T0);
    assert_eq!(d.reason, Reason::StateUnavailable);
    assert_eq!(d.deny_status(), Some(503));
}

#[test]
fn interleaved_workers_never_admit_more_than_the_bucket_allows() {
    // Two "workers" share the store; each reads, then the other writes in
    // between (a forced interleaving), for a thousand requests.
    let p = policy("");
    let store = SharedStore::new();
    let a = req(&store, "api", "acme");
    let b = req(&store, "api", "acme");
    let mut admitted = 0;
    let mut now = T0;
    for i in 0..1000u64 {
        now += 37_000_000; // 37 ms apart: 10/s refills 0.37 tokens per step
        let h = if i % 2 == 0 { &a } else { &b };
        if i % 3 == 0 {
            *h.forced_conflicts.borrow_mut() = 2;
        }
        if run(&p, h, now).reason == Reason::Allowed {
            admitted += 1;
        }
    }
    let elapsed = now - T0;
    assert!(admitted <= 5 + elapsed / 100_000_000, "admitted {admitted}");
    assert!(admitted >= elapsed / 100_000_000 - 1, "admitted {admitted}");
}

#[test]
fn a_reload_with_changed_limits_keeps_the_bucket_level() {
    let store = SharedStore::new();
    let before = policy("");
    let h = req(&store, "api", "acme");
    assert_eq!(admitted(&before, &h, T0, 10), 5);
    // Same plan, raised 10× (burst 50): the empty bucket stays empty.
    let mut after = Policy::from_json(
        br#"{"version":"test-2","identity":{"header":"x-tenant-id"},
        "plans":{"free":{"limits":[{"rate":100,"per":"1s","burst":50}]},"anon":{"limits":[{"rate":2,"per":"1s","burst":5}]}},
        "default_plan":"free","anonymous":{"plan":"anon"},"routes":{"api":{}}}"#,
    )
    .unwrap();
    after.effective_from_ns = T0;
    assert_eq!(run(&after, &h, T0).reason, Reason::RateLimited);
    // And refills at the new rate: 10 ms per token.
    assert_eq!(admitted(&after, &h, T0 + 100_000_000, 100), 10);
}

#[test]
fn denial_replies_are_problem_json_with_every_header() {
    let p = policy("");
    let store = SharedStore::new();
    let h = req(&store, "api", "acme");
    admitted(&p, &h, T0, 5);
    let d = run(&p, &h, T0);
    let reply = response::local_reply(&d, &p.version, true, response::request_id(Some(b"req-1"))).unwrap();
    assert_eq!(reply.status, 429);
    let get = |n: &str| {
        reply
            .headers
            .iter()
            .find(|(k, _)| *k == n)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(get("content-type"), Some("application/problem+json"));
    assert_eq!(get("retry-after"), Some("1"));
    assert_eq!(get("x-tenantgate-reason"), Some("rate_limited"));
    assert_eq!(get("ratelimit-policy"), Some(r#""free";q=10;w=1"#));
    assert_eq!(get("ratelimit"), Some(r#""free";r=0;t=1"#));
    assert_eq!(get("x-request-id"), Some("req-1"));
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(body["status"], 429);
    assert_eq!(body["reason"], "rate_limited");
    assert_eq!(body["limit"], "free");
    assert_eq!(body["retry_after"], 1);
    assert_eq!(body["policy_version"], "test-1");
    assert_eq!(body["request_id"], "req-1");
    assert_eq!(body["type"], "urn:tenantgate:problem:rate_limited");
    // Hostile request ids are dropped, not echoed.
    assert_eq!(response::request_id(Some(b"a\r\nset-cookie: x")), None);
    assert_eq!(response::request_id(Some(&[b'x'; 129])), None);
    assert_eq!(response::request_id(Some(&[0xff])), None);
}

#[test]
fn client_addresses_are_parsed_defensively() {
    assert_eq!(client_ip(b"127.0.0.1:80"), Some("127.0.0.1"));
    assert_eq!(client_ip(b"[::1]:80"), Some("::1"));
    assert_eq!(client_ip(b"::1"), Some("::1"));
    assert_eq!(client_ip(b"10.0.0.1"), Some("10.0.0.1"));
    assert_eq!(client_ip(b"pipe:/tmp/x"), None);
    assert_eq!(client_ip(&[0xff, b':', b'1']), None);
    assert_eq!(client_ip(b""), None);
}

#[test]
fn a_wall_clock_step_backwards_costs_at_most_one_refill() {
    let p = policy("");
    let store = SharedStore::new();
    let h = req(&store, "api", "acme");
    assert_eq!(admitted(&p, &h, T0, 5), 5);
    let back = T0 - 3600 * S;
    let d = run(&p, &h, back);
    assert_eq!(d.reason, Reason::RateLimited);
    assert_eq!(d.retry_after_secs, 1);
    // 100 ms after the step one token is back, not an hour later.
    assert_eq!(run(&p, &h, back + 100_000_000).reason, Reason::Allowed);
}

#[test]
fn a_reload_takes_effect_from_its_load_time_even_for_untouched_keys() {
    // Regression: migration used to apply the old rate until the key's first
    // write after the reload.
    let store = SharedStore::new();
    let before = policy("");
    let h = req(&store, "api", "acme");
    assert_eq!(admitted(&before, &h, T0, 5), 5); // empty at T0, 100 ms/token
    let mut after = Policy::from_json(
        br#"{"version":"test-2","identity":{"header":"x-tenant-id"},
        "plans":{"free":{"limits":[{"rate":1,"per":"1s","burst":5}]},"anon":{"limits":[{"rate":2,"per":"1s","burst":5}]}},
        "default_plan":"free","anonymous":{"plan":"anon"},"routes":{"api":{}}}"#,
    )
    .unwrap();
    after.effective_from_ns = T0 + 200_000_000; // 2 old tokens accrued by then
                                                // At T0+1s: 2 tokens carried over + 0.8 s at the new 1/s = 2 tokens.
    assert_eq!(admitted(&after, &h, T0 + S, 10), 2);
}

/// A policy with free = 10/s burst 5, the given routes and extra fields.
fn policy_with(routes: &str, tail: &str) -> Policy {
    let json = format!(
        r#"{{"version":"t","identity":{{"header":"x-tenant-id"}},
        "plans":{{"free":{{"limits":[{{"rate":10,"per":"1s","burst":5}}]}}}},
        "default_plan":"free","anonymous":{{"plan":"free"}},"routes":{routes},"default_route":"api"{tail}}}"#
    );
    Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn the_key_table_never_grows_past_max_keys_and_reclaims_idle_slots() {
    // 64 keys: 8 entries of 8 slots.
    let p = policy_with(r#"{"api":{}}"#, r#","key_table":{"max_keys":64}"#);
    let store = SharedStore::new();
    let mut events = std::collections::HashMap::new();
    for i in 0..2_000u64 {
        // One request per tenant, 2 ms apart: a bucket (10/s, one token
        // used) is idle again 100 ms after its request.
        let h = req(&store, "api", &format!("tenant-{i}"));
        let d = run(&p, &h, T0 + i * 2_000_000);
        assert!(
            d.reason == Reason::Allowed || d.reason == Reason::RateLimited,
            "{d:?}"
        );
        *events.entry(format!("{:?}", d.table)).or_insert(0) += 1;
    }
    let entries = store.borrow().keys().filter(|k| k.starts_with("tg2|k|")).count();
    assert!(entries <= 8, "{entries} entries");
    assert!(table_keys(&store).len() <= 64);
    assert_eq!(events.get("Inserted"), Some(&64), "{events:?}");
    assert!(
        events.get("Reclaimed").copied().unwrap_or(0) > 1_000,
        "{events:?}"
    );
}

#[test]
fn a_full_table_charges_the_overflow_bucket_never_a_silent_allow() {
    let p = policy_with(r#"{"api":{}}"#, r#","key_table":{"max_keys":8}"#);
    let store = SharedStore::new();
    // Eight busy tenants fill the table (two probes of one entry).
    for i in 0..8 {
        assert_eq!(
            run(&p, &req(&store, "api", &format!("busy-{i}")), T0).table,
            TableEvent::Inserted
        );
    }
    // Newcomers share the overflow bucket of (api, free): 5 in all.
    let overflowed: Vec<Decision> = (0..20)
        .map(|i| run(&p, &req(&store, "api", &format!("new-{i}")), T0))
        .collect();
    assert!(overflowed.iter().all(|d| d.table == TableEvent::Overflow));
    assert_eq!(
        overflowed.iter().filter(|d| d.reason == Reason::Allowed).count(),
        5
    );
    assert!(store.borrow().get("tg2|o|api|free").is_some());
    // Once the busy tenants are idle, a newcomer gets its own slot again.
    assert_eq!(
        run(&p, &req(&store, "api", "later"), T0 + S).table,
        TableEvent::Reclaimed
    );
}

#[test]
fn a_key_keeps_its_slot_when_its_home_entry_fills_up() {
    let p = policy_with(r#"{"api":{}}"#, r#","key_table":{"max_keys":16}"#);
    let store = SharedStore::new();
    let h = req(&store, "api", "sticky");
    assert_eq!(admitted(&p, &h, T0, 3), 3);
    for i in 0..40 {
        run(&p, &req(&store, "api", &format!("filler-{i}")), T0);
    }
    // Still its own bucket: two tokens left, not a fresh one or the overflow.
    assert_eq!(admitted(&p, &h, T0, 10), 2);
    assert_eq!(
        table_keys(&store).iter().filter(|k| *k == "api|t|sticky").count(),
        1
    );
}

#[test]
fn the_global_guard_limits_all_tenants_together_and_refunds_the_tenant() {
    let p = policy_with(
        r#"{"api":{"guard":"db"},"free":{}}"#,
        r#","guards":{"db":{"limits":[{"rate":4,"per":"1s"}]}}"#,
    );
    let store = SharedStore::new();
    let reasons: Vec<Reason> = (0..6)
        .map(|i| run(&p, &req(&store, "api", &format!("t{i}")), T0).reason)
        .collect();
    assert_eq!(reasons.iter().filter(|r| **r == Reason::Allowed).count(), 4);
    let d = run(&p, &req(&store, "api", "t9"), T0);
    assert_eq!(d.reason, Reason::GlobalGuard);
    assert_eq!(d.deny_status(), Some(503));
    assert_eq!(d.limit.as_ref().map(LimitName::name), Some("db"));
    assert!(d.refunded);
    // t9 was refunded: its own bucket is still full (5) once the guard allows.
    let later = T0 + S;
    let d = run(&p, &req(&store, "api", "t9"), later);
    assert_eq!(d.reason, Reason::Allowed);
    assert_eq!(d.headers.unwrap().ratelimit, r#""free";r=4;t=0"#);
    // Classes without the guard are not affected by it.
    assert_eq!(admitted(&p, &req(&store, "free", "t9"), T0, 10), 5);
}

#[test]
fn a_shadow_limit_reports_but_never_denies() {
    let p = Policy::from_json(
        br#"{"version":"t","identity":{"header":"x-tenant-id"},
        "plans":{"free":{"limits":[{"name":"enforced","rate":10,"per":"1s"},{"name":"trial","rate":3,"per":"1s","shadow":true}]}},
        "default_plan":"free","anonymous":{"plan":"free"},"routes":{"api":{}},"default_route":"api"}"#,
    )
    .unwrap();
    let store = SharedStore::new();
    let h = req(&store, "api", "acme");
    let reasons: Vec<Reason> = (0..12).map(|_| run(&p, &h, T0).reason).collect();
    assert_eq!(&reasons[..3], &[Reason::Allowed; 3]);
    assert_eq!(&reasons[3..10], &[Reason::ShadowLimited; 7]);
    assert_eq!(reasons[10], Reason::RateLimited); // the enforced limit still binds
    let d = run(&p, &h, T0);
    assert_eq!(d.limit.as_ref().map(LimitName::name), Some("enforced"));
}

fn anon(
    p: &Policy,
    store: &std::rc::Rc<std::cell::RefCell<SharedStore>>,
    source: &str,
    xff: Option<&str>,
) -> Subject {
    let mut h = MemoryHost::new(store.clone()).route_class("api").source(source);
    if let Some(x) = xff {
        h = h.header("x-forwarded-for", x);
    }
    run(p, &h, T0).subject
}

fn address(s: Subject) -> String {
    match s {
        Subject::Anonymous { address, .. } => address.to_string(),
        other => panic!("not anonymous: {other:?}"),
    }
}

#[test]
fn anonymous_clients_by_trusted_xff_hops_and_prefix() {
    let store = SharedStore::new();
    let direct = policy_with(r#"{"api":{}}"#, "");
    // No trusted hops: XFF is ignored, the connection's address counts.
    assert_eq!(
        address(anon(&direct, &store, "192.0.2.1:5", Some("203.0.113.9"))),
        "192.0.2.1"
    );
    let p = Policy::from_json(
        br#"{"version":"t","identity":{"header":"x-tenant-id"},
        "plans":{"free":{"limits":[{"rate":10,"per":"1s"}]}},"default_plan":"free",
        "anonymous":{"plan":"free","xff_trusted_hops":2,"ipv4_prefix":24,"ipv6_prefix":48},
        "routes":{"api":{}},"default_route":"api"}"#,
    )
    .unwrap();
    // Two trusted hops: the second address from the right.
    assert_eq!(
        address(anon(
            &p,
            &store,
            "10.0.0.1:1",
            Some("1.1.1.1, 198.51.100.77, 10.9.9.9")
        )),
        "198.51.100.0/24"
    );
    assert_eq!(
        address(anon(
            &p,
            &store,
            "10.0.0.1:1",
            Some("[2001:db8:aa:bb::1]:443, 10.9.9.9")
        )),
        "2001:db8:aa::/48"
    );
    // Too short, or garbage: the connection's address.
    assert_eq!(
        address(anon(&p, &store, "10.0.0.1:1", Some("10.9.9.9"))),
        "10.0.0.0/24"
    );
    assert_eq!(
        address(anon(&p, &store, "10.0.0.1:1", Some("nonsense, \u{7f}"))),
        "10.0.0.0/24"
    );
    // Clients in one /24 share one bucket.
    let a = address(anon(&p, &store, "10.0.0.1:1", Some("198.51.100.1, x")));
    let b = address(anon(&p, &store, "10.0.0.1:1", Some("198.51.100.200, y")));
    assert_eq!(a, b);
}

#[test]
fn several_limits_stay_all_or_nothing_when_workers_interleave_at_random() {
    // Four workers share one store. Between any worker's read and its
    // compare-and-swap, other workers' whole requests may slip in (random,
    // seeded). Time stands still, so every admission consumes for good:
    // with all-or-nothing, each limit has consumed exactly the admitted
    // cost, and the admitted cost is exactly the smallest burst.
    let p = Policy::from_json(
        br#"{"version":"t","identity":{"header":"x-tenant-id"},
        "plans":{"p":{"limits":[{"name":"a","rate":10,"per":"1s","burst":37},
                               {"name":"b","algorithm":"fixed_window","rate":50,"per":"1m"},
                               {"name":"c","rate":1,"per":"1s","burst":45}]}},
        "default_plan":"p","anonymous":{"plan":"p"},"routes":{"api":{},"big":{"action":"api","cost":3}},"default_route":"api"}"#,
    )
    .unwrap();
    let p = std::rc::Rc::new(p);
    for seed in 1..=25u64 {
        let store = SharedStore::new();
        let workers: Vec<MemoryHost> = (0..4)
            .map(|_| {
                MemoryHost::new(store.clone())
                    .header("x-tenant-id", "hot")
                    .source("10.0.0.1:1")
            })
            .collect();
        let rng = std::rc::Rc::new(std::cell::Cell::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1));
        let next = {
            let rng = rng.clone();
            move || {
                let mut x = rng.get();
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                rng.set(x);
                x
            }
        };
        let admitted_cost = std::rc::Rc::new(std::cell::Cell::new(0u64));
        // A request of cost 1 (class api) or 3 (class big), on a worker.
        let request = {
            let (p, admitted_cost) = (p.clone(), admitted_cost.clone());
            move |w: &MemoryHost, big: bool| {
                let h = w.clone().route_class(if big { "big" } else { "api" });
                let d = run(&p, &h, T0);
                assert_ne!(d.reason, Reason::Contention);
                if d.reason == Reason::Allowed {
                    admitted_cost.set(admitted_cost.get() + if big { 3 } else { 1 });
                }
            }
        };
        // The entry exists before the race starts: Envoy has no
        // create-if-absent, so racing creators can lose each other's first
        // writes (documented, and pinned by the next test).
        request(&workers[0], false);
        for (i, w) in workers.iter().enumerate() {
            let others: Vec<MemoryHost> = workers
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, o)| o.clone())
                .collect();
            let (request, next) = (request.clone(), next.clone());
            *w.before_write.borrow_mut() = Some(crate::memory::Hook(Box::new(move || {
                for _ in 0..next() % 3 {
                    let o = &others[(next() % others.len() as u64) as usize];
                    request(o, next() % 4 == 0);
                }
            })));
        }
        for _ in 0..100 {
            let w = &workers[(next() % 4) as usize];
            request(w, next() % 4 == 0);
        }
        // Consumed per limit, read back from the stored state.
        assert_eq!(table_keys(&store), ["api|t|hot"]);
        let store = store.borrow();
        let entry = store
            .keys()
            .find(|k| k.starts_with("tg2|k|"))
            .and_then(|k| store.get(k))
            .unwrap();
        let slots = crate::table::decode_entry(entry).unwrap();
        let records = crate::table::decode_records(slots[0].records).unwrap();
        let consumed: Vec<u64> = p.plans()[0]
            .limits
            .iter()
            .map(|l| {
                let r = records.iter().find(|r| r.name_hash == l.name_hash).unwrap();
                match l.algo.load(Some(r), T0, T0).state {
                    crate::limiter::algo::State::TokenBucket { tat } => {
                        let crate::limiter::algo::Algo::TokenBucket(g) = l.algo else {
                            unreachable!()
                        };
                        (tat - T0) / g.interval_ns()
                    }
                    crate::limiter::algo::State::FixedWindow(s) => s.count,
                    other => panic!("{other:?}"),
                }
            })
            .collect();
        let admitted = admitted_cost.get();
        assert_eq!(
            consumed, [admitted; 3],
            "seed {seed}: each limit consumed exactly what was admitted"
        );
        assert_eq!(admitted, 37, "seed {seed}: the smallest burst, no more, no less");
    }
}

#[test]
fn racing_creators_of_a_new_entry_lose_at_most_one_request_each() {
    // Documented bound: Envoy's shared data has no create-if-absent, so two
    // workers that both read a new entry as absent both write it
    // unconditionally; the first write is lost. Only when the entry is
    // first created, and at most one request's cost per racing worker.
    let p = policy("");
    let store = SharedStore::new();
    let a = req(&store, "api", "acme");
    let b = req(&store, "api", "acme");
    let (p2, b2) = (std::rc::Rc::new(policy("")), b.clone());
    *a.before_write.borrow_mut() = Some(crate::memory::Hook(Box::new(move || {
        assert_eq!(run(&p2, &b2, T0).reason, Reason::Allowed);
    })));
    assert_eq!(run(&p, &a, T0).reason, Reason::Allowed);
    *a.before_write.borrow_mut() = None;
    // Two admitted, one recorded: the burst of 5 admits 4 more, 6 in all.
    assert_eq!(admitted(&p, &a, T0, 10), 4);
    // Once the entry exists, interleaved writes conflict and retry: exact.
    let (p3, b3) = (std::rc::Rc::new(policy("")), b.clone());
    let once = std::cell::Cell::new(true);
    *a.before_write.borrow_mut() = Some(crate::memory::Hook(Box::new(move || {
        if once.replace(false) {
            assert_eq!(run(&p3, &b3, T0 + 10 * S).reason, Reason::Allowed);
        }
    })));
    let d = run(&p, &a, T0 + 10 * S);
    assert_eq!(d.reason, Reason::Allowed);
    assert_eq!(d.cas_retries, 1, "the interleaved write made this one retry");
    *a.before_write.borrow_mut() = None;
    assert_eq!(admitted(&p, &a, T0 + 10 * S, 10), 3, "both counted: 5 − 2");
}

mod alloc;
mod levels;
mod reload;
mod settle;
mod stale;

#[test]
fn without_ratelimit_headers_no_header_is_formatted() {
    let p = policy(r#","ratelimit_headers": false"#);
    let store = SharedStore::new();
    let h = req(&store, "api", "acme");
    let decisions: Vec<Decision> = (0..8).map(|_| run(&p, &h, T0)).collect();
    assert!(decisions.iter().any(|d| d.reason == Reason::Allowed));
    assert!(decisions.iter().any(|d| d.reason == Reason::RateLimited));
    assert!(decisions.iter().all(|d| d.headers.is_none()));
    // The denial's answer is complete without them.
    let denied = decisions
        .iter()
        .find(|d| d.reason == Reason::RateLimited)
        .unwrap();
    assert_eq!(denied.limit.as_ref().map(LimitName::name), Some("free"));
    assert!(denied.retry_after_secs >= 1);
}
