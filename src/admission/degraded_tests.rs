//! The degraded-answer cache on explicit time, with the in-memory host.

use std::rc::Rc;

use super::*;
use crate::memory::{MemoryHost, SharedStore};
use crate::policy::Policy;

const S: u64 = NANOS_PER_SEC;
const T0: u64 = 1_796_000_000 * S;

fn degradable(extra: &str) -> Degradable {
    let json = format!(
        r#"{{
        "version": "d-1",
        "identity": {{"header": "x-tenant-id"}},
        "plans": {{"free": {{"limits": [{{"rate": 1000000, "per": "1s"}}]}}}},
        "default_plan": "free",
        "anonymous": {{"plan": "free"}},
        "dependencies": {{"cat": {{"max_in_flight": 2}}}},
        "routes": {{"catalog": {{"dependency": "cat", "degradable": {{"max_stale": "30s" {extra}}}}}}}
    }}"#
    );
    let policy = match Policy::from_json(json.as_bytes()) {
        Ok(p) => p,
        Err(e) => panic!("test policy invalid: {e}"),
    };
    policy
        .route_class(Some("catalog"))
        .and_then(|c| c.degradable.clone())
        .unwrap()
}

fn tenant(id: &str) -> Subject {
    Subject::Tenant(Rc::from(id))
}

fn anonymous() -> Subject {
    Subject::Anonymous {
        address: Rc::from("127.0.0.0/24"),
        invalid_identity: false,
    }
}

fn answer(deg: &Degradable, subject: &Subject, path: &str, at: u64, body: &str) -> Cached {
    Cached {
        key: cache_key(deg, subject, path.as_bytes()).unwrap(),
        captured_at: at,
        headers: vec![
            ("content-type".into(), "text/plain".into()),
            ("etag".into(), format!("\"{body}\"")),
        ],
        body: body.as_bytes().to_vec(),
    }
}

fn host(store: &Rc<std::cell::RefCell<SharedStore>>) -> MemoryHost {
    MemoryHost::new(store.clone())
}

#[test]
fn the_policy_defaults_and_errors() {
    let d = degradable("");
    assert_eq!(
        (
            d.max_stale_ns,
            d.version_header.as_str(),
            d.max_body_bytes,
            d.slots,
            d.anonymous,
            d.refresh_ns
        ),
        (30 * S, "etag", 16 * 1024, 64, false, S)
    );
    assert_eq!(
        kept_headers(&degradable(r#", "version_header": "X-Version""#)).collect::<Vec<_>>(),
        [
            "content-type",
            "content-encoding",
            "content-language",
            "last-modified",
            "x-version"
        ]
    );
    let json = |route: &str| {
        format!(
            r#"{{"version": "d-1", "identity": {{"header": "x-tenant-id"}},
            "plans": {{"free": {{"limits": [{{"rate": 10, "per": "1s"}}]}}}}, "default_plan": "free",
            "anonymous": {{"plan": "free"}}, "dependencies": {{"cat": {{"max_in_flight": 2, "max_streams": 2}}}},
            "routes": {{"catalog": {route}}}}}"#
        )
    };
    for (route, error) in [
        (r#"{"degradable": {"max_stale": "1s"}}"#, "routes.catalog.degradable: a degradable class answers from its cache when its dependency refuses it: name a dependency"),
        (r#"{"dependency": "cat", "degradable": {}}"#, "routes.catalog.degradable: missing field `max_stale`"),
        (r#"{"dependency": "cat", "degradable": {"max_stale": "0s"}}"#, "routes.catalog.degradable.max_stale: must be more than 0 and at most 24h"),
        (r#"{"dependency": "cat", "degradable": {"max_stale": "1s", "max_body_bytes": 50000}}"#, "routes.catalog.degradable.max_body_bytes: must be between 0 and 49152"),
        (r#"{"dependency": "cat", "degradable": {"max_stale": "1s", "slots": 0}}"#, "routes.catalog.degradable.slots: must be between 1 and 4096"),
        (r#"{"dependency": "cat", "degradable": {"max_stale": "1s", "version_header": "a b"}}"#, "routes.catalog.degradable.version_header: must be an HTTP header name"),
        (r#"{"dependency": "cat", "streaming": true, "degradable": {"max_stale": "1s"}}"#, "routes.catalog.degradable: a streaming class cannot be degradable"),
    ] {
        let errors = match Policy::from_json(json(route).as_bytes()) {
            Ok(_) => panic!("{route} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(errors.contains(error), "{route}: {errors}");
    }
}

#[test]
fn only_shedding_reasons_and_only_reads_are_answered_from_the_cache() {
    for reason in Reason::ALL {
        let shed = matches!(
            reason,
            Reason::ConcurrencyLimit
                | Reason::QueueFull
                | Reason::QueueTimeout
                | Reason::CircuitOpen
                | Reason::CircuitProbeLimit
                | Reason::Paused
                | Reason::RetryBudget
        );
        assert_eq!(serves(reason), shed, "{reason:?}");
    }
    assert!(readable(b"GET") && readable(b"HEAD"));
    for method in [&b"POST"[..], b"PUT", b"DELETE", b"PATCH", b"get", b"OPTIONS", b""] {
        assert!(!readable(method), "{method:?}");
    }
}

#[test]
fn an_answer_is_served_up_to_max_stale_and_not_one_nanosecond_later() {
    let d = degradable("");
    let shared = SharedStore::new();
    let a = answer(&d, &tenant("acme"), "/items?page=2", T0, "v1");
    assert_eq!(
        store(&host(&shared), &d, &a, &mut Default::default()),
        Ok(Stored { evicted: false })
    );
    let key = cache_key(&d, &tenant("acme"), b"/items?page=2").unwrap();
    assert_eq!(
        lookup(&host(&shared), &d, &key, T0 + 30 * S),
        Lookup::Fresh(a.clone())
    );
    assert_eq!(
        lookup(&host(&shared), &d, &key, T0 + 30 * S + 1),
        Lookup::Stale { age_ns: 30 * S + 1 }
    );
    // The reply: 200, the kept headers, Age, the capture time, the marker.
    let r = reply(&a, Reason::ConcurrencyLimit, T0 + 12 * S + 999_999_999, false);
    assert_eq!(r.status, 200);
    assert_eq!(r.body, b"v1");
    let h = |name: &str| r.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
    assert_eq!(h("age"), Some("12"));
    assert_eq!(h("etag"), Some("\"v1\""));
    assert_eq!(h("content-type"), Some("text/plain"));
    assert_eq!(h("x-tenantgate-degraded"), Some("concurrency_limit"));
    assert_eq!(h("x-tenantgate-captured-at"), Some(http_date(T0 / S).as_str()));
    assert_eq!(h("cache-control"), Some("no-store"));
    // HEAD: the same headers, no body.
    let head = reply(&a, Reason::ConcurrencyLimit, T0, true);
    assert!(head.body.is_empty());
    assert_eq!(head.headers.len(), r.headers.len());
}

#[test]
fn a_tenant_never_gets_another_tenants_answer_and_anonymous_gets_none_by_default() {
    let d = degradable("");
    let shared = SharedStore::new();
    let a = answer(&d, &tenant("acme"), "/items", T0, "acme-secret");
    store(&host(&shared), &d, &a, &mut Default::default()).unwrap();
    for other in [tenant("globex"), tenant("acme\n"), tenant("")] {
        if let Some(key) = cache_key(&d, &other, b"/items") {
            assert_eq!(lookup(&host(&shared), &d, &key, T0), Lookup::Miss, "{other:?}");
        }
    }
    assert_eq!(cache_key(&d, &anonymous(), b"/items"), None);
    assert_eq!(cache_key(&d, &Subject::None, b"/items"), None);
    // With anonymous: true, anonymous clients share one space, apart from
    // every tenant's.
    let open = degradable(r#", "anonymous": true"#);
    let anon_key = cache_key(&open, &anonymous(), b"/items").unwrap();
    assert_ne!(anon_key, cache_key(&open, &tenant("acme"), b"/items").unwrap());
    assert_eq!(lookup(&host(&shared), &open, &anon_key, T0), Lookup::Miss);
    // The path and the query are the key, byte-exact.
    for path in ["/items?", "/items/", "/Items", "/items?a=1"] {
        let key = cache_key(&d, &tenant("acme"), path.as_bytes()).unwrap();
        assert_eq!(lookup(&host(&shared), &d, &key, T0), Lookup::Miss, "{path}");
    }
}

#[test]
fn colliding_keys_overwrite_each_other_and_a_lookup_never_serves_the_other() {
    // One slot: every key collides.
    let d = degradable(r#", "slots": 1"#);
    let shared = SharedStore::new();
    let mut buffers = Default::default();
    let a = answer(&d, &tenant("acme"), "/a", T0, "a");
    let b = answer(&d, &tenant("globex"), "/b", T0 + S, "b");
    assert_eq!(slot_key(&d, &a.key), slot_key(&d, &b.key));
    assert_eq!(
        store(&host(&shared), &d, &a, &mut buffers),
        Ok(Stored { evicted: false })
    );
    // The same key again is a refresh, not an eviction.
    assert_eq!(
        store(&host(&shared), &d, &a, &mut buffers),
        Ok(Stored { evicted: false })
    );
    assert_eq!(
        store(&host(&shared), &d, &b, &mut buffers),
        Ok(Stored { evicted: true })
    );
    assert_eq!(lookup(&host(&shared), &d, &a.key, T0 + S), Lookup::Miss);
    assert_eq!(lookup(&host(&shared), &d, &b.key, T0 + S), Lookup::Fresh(b));
    assert_eq!(shared.borrow().len(), 1);
}

#[test]
fn memory_is_bounded_by_slots_and_sizes() {
    let d = degradable(r#", "slots": 8, "max_body_bytes": 100"#);
    let shared = SharedStore::new();
    let mut buffers = Default::default();
    // 1,000 tenants: never more than 8 entries.
    for i in 0..1000 {
        let a = answer(&d, &tenant(&format!("t{i}")), "/items", T0, "x");
        store(&host(&shared), &d, &a, &mut buffers).unwrap();
    }
    assert!(shared.borrow().len() <= 8, "{}", shared.borrow().len());
    // A body over max_body_bytes, headers over 4 KiB, a key over 2 KiB:
    // not stored.
    let mut big = answer(&d, &tenant("acme"), "/big", T0, "");
    big.body = vec![b'x'; 101];
    assert_eq!(
        store(&host(&shared), &d, &big, &mut buffers),
        Err(NotStored::TooLarge)
    );
    big.body = vec![b'x'; 100];
    assert!(store(&host(&shared), &d, &big, &mut buffers).is_ok());
    big.headers
        .push(("last-modified".into(), "x".repeat(MAX_KEPT_HEADERS_BYTES)));
    assert_eq!(
        store(&host(&shared), &d, &big, &mut buffers),
        Err(NotStored::TooLarge)
    );
    let long = "/".repeat(MAX_CACHE_KEY_LEN);
    assert_eq!(cache_key(&d, &tenant("acme"), long.as_bytes()), None);
    // The largest answer the policy allows fits one record.
    let max = degradable(r#", "max_body_bytes": 49152"#);
    let mut largest = answer(&max, &tenant("acme"), "/", T0, "");
    largest.key = vec![b'k'; MAX_CACHE_KEY_LEN];
    largest.body = vec![b'x'; 49152];
    largest.headers = vec![("content-type".into(), "v".repeat(MAX_KEPT_HEADERS_BYTES - 12))];
    assert!(largest.fits(&max));
    assert_eq!(
        store(&host(&shared), &max, &largest, &mut buffers).map(|_| ()),
        Ok(())
    );
    assert_eq!(
        lookup(&host(&shared), &max, &largest.key, T0),
        Lookup::Fresh(largest)
    );
}

#[test]
fn u64_edge_times_never_overflow() {
    let d = degradable("");
    let shared = SharedStore::new();
    for (at, now, fresh) in [
        (0, 0, true),
        (0, u64::MAX, false),
        (u64::MAX, u64::MAX, true),
        // A clock that went backwards: age 0, fresh.
        (u64::MAX, 0, true),
    ] {
        let a = answer(&d, &tenant("acme"), "/edge", at, "e");
        store(&host(&shared), &d, &a, &mut Default::default()).unwrap();
        let found = lookup(&host(&shared), &d, &a.key, now);
        assert_eq!(matches!(found, Lookup::Fresh(_)), fresh, "{at} {now}: {found:?}");
        let r = reply(&a, Reason::QueueTimeout, now, false);
        assert!(r.headers.iter().any(|(n, _)| n == "age"));
    }
    assert_eq!(http_date(784_111_777), "Sun, 06 Nov 1994 08:49:37 GMT");
    assert_eq!(http_date(0), "Thu, 01 Jan 1970 00:00:00 GMT");
    assert_eq!(http_date(951_782_400), "Tue, 29 Feb 2000 00:00:00 GMT");
    assert!(http_date(u64::MAX / S).ends_with("GMT"));
}

#[test]
fn unreadable_or_foreign_slots_are_misses() {
    let d = degradable("");
    let shared = SharedStore::new();
    let key = cache_key(&d, &tenant("acme"), b"/x").unwrap();
    host(&shared)
        .shared_set(&slot_key(&d, &key), b"garbage", None)
        .unwrap();
    assert_eq!(lookup(&host(&shared), &d, &key, T0), Lookup::Miss);
    let mut failing = host(&shared);
    failing.fail_shared = true;
    assert_eq!(lookup(&failing, &d, &key, T0), Lookup::Miss);
    let a = answer(&d, &tenant("acme"), "/x", T0, "x");
    assert_eq!(
        store(&failing, &d, &a, &mut Default::default()),
        Err(NotStored::Failed)
    );
}
