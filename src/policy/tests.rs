use super::*;
use crate::limiter::NANOS_PER_SEC;

const VALID: &str = r#"{
    "version": "2026-11-30.1",
    "identity": {"header": "X-Tenant-Id"},
    "plans": {
        "free": {"limits": [{"rate": 100, "per": "1m"}]},
        "paid": {"limits": [{"rate": 10000, "per": "1m", "burst": 500}]}
    },
    "tenants": [{"id": "demo-free", "plan": "free"}, {"id": "demo-paid", "plan": "paid"}],
    "default_plan": "free",
    "anonymous": {"plan": "free"},
    "routes": {"default": {}, "search": {"action": "search", "cost": 5}},
    "default_route": "default"
}"#;

fn errors(json: &str) -> Vec<String> {
    match Policy::from_json(json.as_bytes()) {
        Ok(_) => panic!("expected an error for {json}"),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

fn with(replace: &str, by: &str) -> String {
    assert!(VALID.contains(replace), "fixture text not found: {replace}");
    VALID.replacen(replace, by, 1)
}

#[test]
fn a_valid_policy_compiles_with_its_defaults() {
    let p = Policy::from_json(VALID.as_bytes()).unwrap();
    assert_eq!(p.version, "2026-11-30.1");
    assert_eq!(p.mode, Mode::Enforce);
    assert_eq!(p.identity, Identity::Header("x-tenant-id".into()));
    assert!(p.ratelimit_headers);
    let free = &p.plans()[p.plan_of_tenant("demo-free")];
    assert_eq!(free.name, "free");
    assert_eq!(free.limits[0].name, "free");
    assert_eq!(free.limits[0].burst, 100); // burst defaults to rate
    assert_eq!(free.ratelimit_policy, r#""free";q=100;w=60"#);
    assert_eq!(p.plans()[p.plan_of_tenant("demo-paid")].limits[0].burst, 500);
    assert_eq!(p.plans()[p.plan_of_tenant("someone-else")].name, "free");
    let search = p.route_class(Some("search")).unwrap();
    assert_eq!((search.action.as_str(), search.cost), ("search", 5));
    let default = p.route_class(Some("unknown")).unwrap();
    assert_eq!((default.action.as_str(), default.cost), ("default", 1));
}

#[test]
fn errors_name_their_field_path() {
    assert_eq!(
        errors(&with(r#""rate": 100,"#, r#""rate": 0,"#)),
        ["plans.free.limits[0].rate: must be > 0"]
    );
    assert_eq!(
        errors(&with(r#""rate": 100,"#, r#""rate": -5,"#)),
        ["plans.free.limits[0].rate: must be > 0"]
    );
    assert_eq!(
        errors(&with(r#""per": "1m"}]},"#, r#""per": "1m", "brust": 3}]},"#)),
        ["plans.free.limits[0].brust: unknown field `brust`, expected one of `name`, `algorithm`, `rate`, `per`, `burst`, `shadow`, `global`, `on_limit`, `max_debt`, `time_zone`; did you mean `burst`?"]
    );
    assert_eq!(
        errors(&with(r#""rate": 100,"#, r#""rate": "100","#)),
        [r#"plans.free.limits[0].rate: expected an integer, got "100""#]
    );
    assert_eq!(
        errors(&with(
            r#"{"id": "demo-paid", "plan": "paid"}"#,
            r#"{"id": "demo-free", "plan": "gold"}"#
        )),
        [
            "tenants[1].id: duplicate tenant `demo-free` (also at tenants[0])",
            "tenants[1].plan: unknown plan `gold` (plans: free, paid)",
        ]
    );
    assert_eq!(errors(""), ["(policy): the policy is empty"]);
    assert_eq!(errors("[]"), ["(policy): expected a mapping, found a list"]);
    assert!(errors("{")
        .first()
        .unwrap()
        .starts_with("(policy): invalid JSON:"));
}

#[test]
fn duplicate_json_keys_are_rejected_not_overwritten() {
    let dup = with(
        r#""default_plan": "free","#,
        r#""default_plan": "free", "default_plan": "paid","#,
    );
    assert_eq!(errors(&dup), ["default_plan: duplicate key"]);
}

#[test]
fn istiod_doubles_are_accepted_as_integers() {
    // istiod renders a protobuf Struct's numbers as doubles.
    let p = Policy::from_json(
        with(
            r#""rate": 10000, "per": "1m", "burst": 500"#,
            r#""rate": 1e+04, "per": "1m", "burst": 500.0"#,
        )
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(p.plans()[1].limits[0].rate, 10_000);
    assert_eq!(
        errors(&with(r#""rate": 100,"#, r#""rate": 1.5,"#)),
        ["plans.free.limits[0].rate: expected an integer, got 1.5"]
    );
}

#[test]
fn huge_numbers_are_out_of_range_not_wrapped() {
    assert_eq!(
        errors(&with(r#""rate": 100,"#, r#""rate": 99999999999999999999999,"#)),
        ["plans.free.limits[0].rate: expected an integer, got 100000000000000000000000"]
    );
    assert_eq!(
        errors(&with(r#""rate": 100,"#, r#""rate": 18446744073709551615,"#)),
        ["plans.free.limits[0].rate: expected an integer in -9223372036854775808..=9223372036854775807, got 18446744073709551615"]
    );
    assert_eq!(
        errors(&with(r#""rate": 100,"#, r#""rate": 20000000000000,"#)),
        ["plans.free.limits[0].rate: must be at most 10000000000000"]
    );
    // 10⁹ a second is one unit a nanosecond; 7·10⁸ would refill at 5·10⁸
    // (a step of 2 ns); 7·10⁸ an hour is a step of 5,142.9 ns, held within
    // 0.1 % (5,143); ten million dollars in micro-units a year, 3.2 µs.
    let compiles = |rate: &str, per: &str| {
        let text = with(
            r#""rate": 100, "per": "1m"}"#,
            &format!(r#""rate": {rate}, "per": "{per}", "burst": 10}}"#),
        );
        Policy::from_json(text.as_bytes()).is_ok()
    };
    assert!(compiles("1000000000", "1s"));
    assert!(!compiles("700000000", "1s"));
    assert_eq!(
        errors(&with(r#""rate": 100, "per": "1m"}"#, r#""rate": 700000000, "per": "1s", "burst": 10}"#)),
        ["plans.free.limits[0].rate: 700000000 per 1s needs a step finer than a token bucket's whole nanosecond (it would refill 500000000 per 1s): use a longer `per`, or a rate that divides it into whole nanoseconds"]
    );
    assert!(compiles("700000000", "1h"));
    assert!(compiles("10000000000000", "365d"));
}

fn sync_policy(sync: &str) -> String {
    with(
        r#""default_route": "default""#,
        &format!(r#""default_route": "default", "sync": {sync}"#),
    )
    .replace(
        r#"{"rate": 100, "per": "1m"}"#,
        r#"{"rate": 100, "per": "1m", "global": true}"#,
    )
}

#[test]
fn the_sync_breaker_has_defaults_bounds_and_path_qualified_errors() {
    let p = Policy::from_json(sync_policy("{}").as_bytes()).unwrap();
    let s = p.sync.unwrap();
    assert_eq!(
        (s.breaker_failures, s.breaker_max_backoff_ns),
        (3, 2 * NANOS_PER_SEC)
    );
    // The default backoff cap is two intervals: probes three intervals apart.
    let p = Policy::from_json(sync_policy(r#"{"interval": "1m"}"#).as_bytes()).unwrap();
    assert_eq!(p.sync.unwrap().breaker_max_backoff_ns, 120 * NANOS_PER_SEC);
    let p = Policy::from_json(
        sync_policy(r#"{"interval": "200ms", "breaker_failures": 100, "breaker_max_backoff": "200ms"}"#)
            .as_bytes(),
    )
    .unwrap();
    let s = p.sync.unwrap();
    assert_eq!((s.breaker_failures, s.breaker_max_backoff_ns), (100, 200_000_000));
    for (sync, error) in [
        (
            r#"{"breaker_failures": 0}"#,
            "sync.breaker_failures: must be between 1 and 100",
        ),
        (
            r#"{"breaker_failures": 101}"#,
            "sync.breaker_failures: must be between 1 and 100",
        ),
        (
            r#"{"interval": "2s", "breaker_max_backoff": "1s"}"#,
            "sync.breaker_max_backoff: must be at least sync.interval and at most 1h",
        ),
        (
            r#"{"breaker_max_backoff": "2h"}"#,
            "sync.breaker_max_backoff: must be at least sync.interval and at most 1h",
        ),
    ] {
        assert_eq!(errors(&sync_policy(sync)), [error], "{sync}");
    }
}

#[test]
fn admission_labels_and_dependencies_compile_with_their_defaults() {
    use super::admission::Criticality;
    // Without any admission field every class has the default labels.
    let p = Policy::from_json(VALID.as_bytes()).unwrap();
    assert!(p.dependencies.is_empty());
    assert!(p
        .route_classes()
        .all(|c| c.labels == admission::Labels::default()));
    assert!(!p.route_classes().any(|c| c.labels.checks_anything()));

    let json = with(
        r#""routes": {"default": {}, "search": {"action": "search", "cost": 5}}"#,
        r#""dependencies": {
            "db": {"max_in_flight": 10, "reserved": {"critical": 3, "system": 1}, "tenant_max_share": 0.25},
            "events": {"max_in_flight": 4, "max_streams": 8, "tenant_max_share": 2}
        },
        "routes": {
            "default": {},
            "search": {"action": "search", "cost": 5, "criticality": "sheddable", "retryable": true, "dependency": "db",
                       "max_body_bytes": 1024, "min_timeout_budget": "250ms"},
            "feed": {"dependency": "events", "streaming": true, "criticality": "critical"}
        }"#,
    );
    let p = Policy::from_json(json.as_bytes()).unwrap();
    let db = p.dependency(0).unwrap();
    assert_eq!(
        (db.name.as_str(), db.key.as_str(), db.max_in_flight, db.general()),
        ("db", "tg2|d|db", 10, 6)
    );
    // A fraction is rounded up to whole slots; a count is taken as is.
    assert_eq!(db.tenant_max, Some(3));
    assert_eq!(p.dependency(1).unwrap().tenant_max, Some(2));
    assert_eq!(db.retry_after_window_ns, 10 * NANOS_PER_SEC);
    let search = p.route_class(Some("search")).unwrap().labels;
    assert_eq!(
        search,
        admission::Labels {
            criticality: Criticality::Sheddable,
            retryable: true,
            streaming: false,
            dependency: Some(0),
            max_body_bytes: Some(1024),
            min_timeout_budget_ns: Some(250_000_000),
            action_limit: None,
        }
    );
    assert_eq!(
        p.route_class(Some("default")).unwrap().labels.criticality,
        Criticality::Normal
    );
    assert_eq!(p.route_class(Some("feed")).unwrap().labels.dependency, Some(1));
}

#[test]
fn action_in_flight_limits_compile_onto_every_class_of_the_action() {
    let json = with(
        r#""routes": {"default": {}, "search": {"action": "search", "cost": 5}}"#,
        r#""dependencies": {"db": {"max_in_flight": 10}},
        "actions": {"search": {"max_in_flight": 3}, "default": {"max_in_flight": 1000000}},
        "routes": {
            "default": {},
            "search": {"action": "search", "dependency": "db"},
            "search-v2": {"action": "search"},
            "other": {"dependency": "db"}
        }"#,
    );
    let p = Policy::from_json(json.as_bytes()).unwrap();
    let names: Vec<(&str, &str, u32)> = p
        .actions
        .iter()
        .map(|a| (a.name.as_str(), a.key.as_str(), a.max_in_flight))
        .collect();
    assert_eq!(
        names,
        [
            ("default", "tg2|a|default", 1_000_000),
            ("search", "tg2|a|search", 3)
        ]
    );
    let limit = |class: &str| p.route_class(Some(class)).unwrap().labels.action_limit;
    // Both classes of the action share one limit; a class of another
    // action without one has none.
    assert_eq!((limit("search"), limit("search-v2")), (Some(1), Some(1)));
    assert_eq!((limit("default"), limit("other")), (Some(0), None));
    // An action limit alone is an admission check.
    assert!(p.route_class(Some("search-v2")).unwrap().labels.checks_anything());
}

#[test]
fn action_limit_errors_name_their_field_path() {
    let policy = |actions: &str, route: &str| {
        with(
            r#""routes": {"default": {}, "search": {"action": "search", "cost": 5}}"#,
            &format!(r#""actions": {actions}, "routes": {{"default": {{}}, "r": {route}}}"#),
        )
    };
    for (actions, route, error) in [
        (
            r#"{"r": {"max_in_flight": 0}}"#,
            r#"{}"#,
            "actions.r.max_in_flight: must be between 1 and 1000000",
        ),
        (
            r#"{"r": {"max_in_flight": 1000001}}"#,
            r#"{}"#,
            "actions.r.max_in_flight: must be between 1 and 1000000",
        ),
        (
            r#"{"serch": {"max_in_flight": 2}}"#,
            r#"{"action": "search"}"#,
            "actions.serch: no route class has action `serch` (actions: default, search): set `routes.<class>.action`, or the class name is its action",
        ),
        (
            r#"{"r": {"max_in_flight": 2, "max_queue": 3}}"#,
            r#"{}"#,
            "actions.r.max_queue: unknown field `max_queue`, expected `max_in_flight`",
        ),
        (
            r#"{"r": {}}"#,
            r#"{}"#,
            "actions.r: missing field `max_in_flight`",
        ),
        (
            r#"{"r": {"max_in_flight": 2}}"#,
            r#"{"on_limit": "queue", "max_wait": "1s"}"#,
            "routes.r.on_limit: an in-flight slot is not held across the rate-limit queue yet: action `r` has actions.r.max_in_flight, so its classes cannot use on_limit: queue",
        ),
    ] {
        assert_eq!(errors(&policy(actions, route)), [error], "{actions} {route}");
    }
}

#[test]
fn adaptive_settings_compile_with_their_defaults() {
    use super::admission::Adaptive;
    let p = Policy::from_json(
        with(
            r#""routes": {"default": {}, "search": {"action": "search", "cost": 5}}"#,
            r#""dependencies": {
                "db": {"max_in_flight": 40, "reserved": {"critical": 4, "system": 1}, "adaptive": {}},
                "cache": {"max_in_flight": 100, "adaptive": {"window": "1s", "min": 5, "max": 80, "buffer": 0.1,
                    "dead_zone": 0.05, "smoothing": 0.5, "max_increase": 0.1, "backoff": 0.7, "error_rate": 0.2,
                    "queue_age": "100ms", "baseline_refresh": "1m"}},
                "plain": {"max_in_flight": 10}
            }, "routes": {"default": {}}"#,
        )
        .as_bytes(),
    )
    .unwrap();
    let db = p.dependencies.iter().find(|d| d.name == "db").unwrap();
    assert_eq!(db.adaptive, Some(Adaptive::defaults(40, 5)));
    let d = Adaptive::defaults(40, 5);
    assert_eq!((d.min, d.max, d.window_ns), (6, 40, 500_000_000));
    assert_eq!(
        (d.buffer_ppm, d.dead_zone_ppm, d.smoothing_ppm, d.max_increase_ppm),
        (20_000, 40_000, 250_000, 250_000)
    );
    assert_eq!((d.backoff_ppm, d.error_rate_ppm), (800_000, 100_000));
    assert_eq!(
        (d.queue_age_ns, d.baseline_refresh_ns),
        (250_000_000, 30_000_000_000)
    );
    let cache = p.dependencies.iter().find(|d| d.name == "cache").unwrap();
    assert_eq!(
        cache.adaptive,
        Some(Adaptive {
            window_ns: 1_000_000_000,
            min: 5,
            max: 80,
            buffer_ppm: 100_000,
            dead_zone_ppm: 50_000,
            smoothing_ppm: 500_000,
            max_increase_ppm: 100_000,
            backoff_ppm: 700_000,
            error_rate_ppm: 200_000,
            queue_age_ns: 100_000_000,
            baseline_refresh_ns: 60_000_000_000,
        })
    );
    assert_eq!(
        p.dependencies
            .iter()
            .find(|d| d.name == "plain")
            .unwrap()
            .adaptive,
        None
    );
}

#[test]
fn admission_errors_name_their_field_path() {
    let policy = |deps: &str, route: &str| {
        with(
            r#""routes": {"default": {}, "search": {"action": "search", "cost": 5}}"#,
            &format!(r#""dependencies": {deps}, "routes": {{"default": {{}}, "r": {route}}}"#),
        )
    };
    for (deps, route, error) in [
        (
            r#"{"db": {"max_in_flight": 10}}"#,
            r#"{"dependency": "cache"}"#,
            "routes.r.dependency: unknown dependency `cache` (dependencies: db)",
        ),
        (
            r#"{"db": {"max_in_flight": 4, "reserved": {"critical": 4}}}"#,
            r#"{"dependency": "db"}"#,
            "dependencies.db.reserved: reserved.critical + reserved.system (4) must be less than max_in_flight (4): nothing would be left for normal and sheddable requests",
        ),
        (
            r#"{"db": {"max_in_flight": 4, "tenant_max_share": 5}}"#,
            r#"{}"#,
            "dependencies.db.tenant_max_share: must be a fraction between 0 and 1 (exclusive) or a whole count from 1 to max_in_flight (4)",
        ),
        (
            r#"{"db": {"max_in_flight": 4, "tenant_max_share": 0}}"#,
            r#"{}"#,
            "dependencies.db.tenant_max_share: must be a fraction between 0 and 1 (exclusive) or a whole count from 1 to max_in_flight (4)",
        ),
        (
            r#"{"db": {"max_in_flight": 4}}"#,
            r#"{"streaming": true}"#,
            "routes.r.streaming: a streaming class counts against its dependency's max_streams: name a dependency",
        ),
        (
            r#"{"db": {"max_in_flight": 4, "queues": {"normal": {"max_queue": 1, "max_wait": "31s"}}}}"#,
            r#"{}"#,
            "dependencies.db.queues.normal.max_wait: must be more than 0 and at most 30s",
        ),
        (
            r#"{"db": {"max_in_flight": 4, "max_flight": 3}}"#,
            r#"{}"#,
            "dependencies.db.max_flight: unknown field `max_flight`, expected one of `max_in_flight`, `max_streams`, `reserved`, `tenant_max_share`, `retry_after_window`, `queues`, `paused`, `circuit_breaker`, `retry_budget`, `adaptive`; did you mean `max_in_flight`?",
        ),
        (
            r#"{"db": {"max_in_flight": 40, "adaptive": {"window": "100ms"}}}"#,
            r#"{}"#,
            "dependencies.db.adaptive.window: must be between 250ms and 5s",
        ),
        (
            r#"{"db": {"max_in_flight": 40, "adaptive": {"max": 41}}}"#,
            r#"{}"#,
            "dependencies.db.adaptive.max: must be between 1 and 40",
        ),
        (
            r#"{"db": {"max_in_flight": 40, "reserved": {"critical": 3}, "adaptive": {"min": 3}}}"#,
            r#"{}"#,
            "dependencies.db.adaptive.min: must be between 4 (reserved.critical + reserved.system + 1) and max (40)",
        ),
        (
            r#"{"db": {"max_in_flight": 40, "adaptive": {"min": 20, "max": 10}}}"#,
            r#"{}"#,
            "dependencies.db.adaptive.min: must be between 1 (reserved.critical + reserved.system + 1) and max (10)",
        ),
        (
            r#"{"db": {"max_in_flight": 40, "adaptive": {"backoff": 0.3}}}"#,
            r#"{}"#,
            "dependencies.db.adaptive.backoff: must be a number from 0.5 to 0.99",
        ),
        (
            r#"{"db": {"max_in_flight": 40, "adaptive": {"smoothing": 0}}}"#,
            r#"{}"#,
            "dependencies.db.adaptive.smoothing: must be a number more than 0 to 1",
        ),
        (
            r#"{"db": {"max_in_flight": 40, "adaptive": {"window": "5s", "baseline_refresh": "30s"}}}"#,
            r#"{}"#,
            "dependencies.db.adaptive.baseline_refresh: must be at least 10 windows",
        ),
        (
            r#"{"db": {"max_in_flight": 40, "adaptive": {"gain": 2}}}"#,
            r#"{}"#,
            "dependencies.db.adaptive.gain: unknown field `gain`, expected one of `window`, `min`, `max`, `buffer`, `dead_zone`, `smoothing`, `max_increase`, `backoff`, `error_rate`, `queue_age`, `baseline_refresh`",
        ),
    ] {
        assert_eq!(errors(&policy(deps, route)), [error], "{deps} {route}");
    }
}

#[test]
fn paused_and_the_circuit_breaker_compile_with_their_defaults() {
    use super::admission::BreakerSettings;
    let policy = |db: &str| {
        with(
            r#""routes": {"default": {}, "search": {"action": "search", "cost": 5}}"#,
            &format!(
                r#""dependencies": {{"db": {db}}}, "routes": {{"default": {{}}, "r": {{"dependency": "db"}}}}"#
            ),
        )
    };
    // Without them: not paused, no breaker (admission as in part 1).
    let p = Policy::from_json(policy(r#"{"max_in_flight": 10}"#).as_bytes()).unwrap();
    let db = p.dependency(0).unwrap();
    assert!(!db.paused);
    assert_eq!(db.breaker, None);
    assert_eq!(db.breaker_key, "tg2|b|db");
    // An empty breaker takes every default.
    let p = Policy::from_json(
        policy(r#"{"max_in_flight": 10, "paused": true, "circuit_breaker": {}}"#).as_bytes(),
    )
    .unwrap();
    let db = p.dependency(0).unwrap();
    assert!(db.paused);
    assert_eq!(
        db.breaker,
        Some(BreakerSettings {
            error_permille: 500,
            min_volume: 20,
            window_ns: 10 * NANOS_PER_SEC,
            open_for_ns: 5 * NANOS_PER_SEC,
            max_open_for_ns: 60 * NANOS_PER_SEC,
            probes: 3,
            ramp_ns: 30 * NANOS_PER_SEC,
            ramp_floor_permille: 100,
        })
    );
    assert_eq!(db.breaker, Some(BreakerSettings::default()));
    // Every field set.
    let p = Policy::from_json(
        policy(
            r#"{"max_in_flight": 10, "circuit_breaker": {"error_rate": 0.25, "min_volume": 5, "window": "500ms",
                "open_for": "2s", "max_open_for": "20s", "probes": 1, "ramp": "3s", "ramp_floor": 0.2}}"#,
        )
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(
        p.dependency(0).unwrap().breaker,
        Some(BreakerSettings {
            error_permille: 250,
            min_volume: 5,
            window_ns: 500_000_000,
            open_for_ns: 2 * NANOS_PER_SEC,
            max_open_for_ns: 20 * NANOS_PER_SEC,
            probes: 1,
            ramp_ns: 3 * NANOS_PER_SEC,
            ramp_floor_permille: 200,
        })
    );
    // A long open_for without max_open_for: no backoff past it.
    let p = Policy::from_json(
        policy(r#"{"max_in_flight": 10, "circuit_breaker": {"open_for": "2m"}}"#).as_bytes(),
    )
    .unwrap();
    assert_eq!(
        p.dependency(0).unwrap().breaker.unwrap().max_open_for_ns,
        120 * NANOS_PER_SEC
    );
    let cb = |fields: &str| {
        policy(&format!(
            r#"{{"max_in_flight": 10, "circuit_breaker": {{{fields}}}}}"#
        ))
    };
    for (fields, error) in [
        (r#""error_rate": 0"#, "dependencies.db.circuit_breaker.error_rate: must be a fraction more than 0 and at most 1"),
        (r#""error_rate": 1.01"#, "dependencies.db.circuit_breaker.error_rate: must be a fraction more than 0 and at most 1"),
        (r#""ramp_floor": 0"#, "dependencies.db.circuit_breaker.ramp_floor: must be a fraction more than 0 and at most 1"),
        (r#""min_volume": 0"#, "dependencies.db.circuit_breaker.min_volume: must be between 1 and 1000000"),
        (r#""probes": 1001"#, "dependencies.db.circuit_breaker.probes: must be between 1 and 1000"),
        (r#""window": "50ms""#, "dependencies.db.circuit_breaker.window: must be between 100ms and 1h"),
        (r#""ramp": "2h""#, "dependencies.db.circuit_breaker.ramp: must be between 100ms and 1h"),
        (r#""open_for": "soon""#, r#"dependencies.db.circuit_breaker.open_for: invalid duration "soon": expected a whole number followed by ms, s, m, h or d (e.g. 500ms, 10s, 1m)"#),
        (r#""open_for": "10s", "max_open_for": "5s""#, "dependencies.db.circuit_breaker.max_open_for: must be at least open_for (the first wait)"),
        (r#""probe": 3"#, "dependencies.db.circuit_breaker.probe: unknown field `probe`, expected one of `error_rate`, `min_volume`, `window`, `open_for`, `max_open_for`, `probes`, `ramp`, `ramp_floor`; did you mean `probes`?"),
    ] {
        assert_eq!(errors(&cb(fields)), [error], "{fields}");
    }
    assert_eq!(
        errors(&policy(r#"{"max_in_flight": 10, "paused": "yes"}"#)),
        [r#"dependencies.db.paused: expected a boolean, got "yes""#]
    );
}

#[test]
fn a_policy_over_one_mib_is_refused_before_parsing() {
    let mut json = VALID.to_owned();
    json.push_str(&" ".repeat(MAX_POLICY_BYTES + 1 - json.len()));
    let errors = Policy::from_json(json.as_bytes()).unwrap_err();
    assert!(errors.to_string().contains("limit is 1048576"), "{errors}");
    json.pop();
    assert!(Policy::from_json(json.as_bytes()).is_ok());
}

#[test]
fn a_fixed_window_takes_envoyproxy_ratelimits_whole_range_zero_included() {
    // `requests_per_unit` is a uint32 there, 0 meaning every request is over.
    let fixed = |rate: &str| {
        with(
            r#""rate": 100, "per": "1m"}"#,
            &format!(r#""algorithm": "fixed_window", "rate": {rate}, "per": "1m"}}"#),
        )
    };
    for (rate, want) in [
        ("0", 0u64),
        ("4294967295", u64::from(u32::MAX)),
        ("10000000000000", 10_000_000_000_000),
    ] {
        let p = Policy::from_json(fixed(rate).as_bytes()).unwrap();
        let limit = &p.plans()[0].limits[0];
        assert_eq!(limit.rate, want);
        if want == 0 {
            let crate::limiter::algo::Algo::FixedWindow(w) = limit.algo else {
                panic!("expected a fixed window");
            };
            let state = crate::limiter::fixed_window::State::default();
            assert!(matches!(
                w.check(&state, 0, 1),
                crate::limiter::Verdict::Deny { .. }
            ));
            assert!(matches!(
                w.check(&state, 0, 0),
                crate::limiter::Verdict::Admit { .. }
            ));
        }
    }
    assert_eq!(
        errors(&fixed("10000000000001")),
        ["plans.free.limits[0].rate: a fixed_window rate is between 0 and 10000000000000"]
    );
    assert_eq!(
        errors(&fixed("-1")),
        ["plans.free.limits[0].rate: a fixed_window rate is between 0 and 10000000000000"]
    );
}
