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
        ["plans.free.limits[0].brust: unknown field `brust`, expected one of `name`, `algorithm`, `rate`, `per`, `burst`, `shadow`, `global`"]
    );
    assert_eq!(
        errors(&with(r#""rate": 100,"#, r#""rate": "100","#)),
        [r#"plans.free.limits[0].rate: invalid type: string "100", expected i64"#]
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
        ["plans.free.limits[0].rate: invalid type: floating point `1.5`, expected i64"]
    );
}

#[test]
fn huge_numbers_are_out_of_range_not_wrapped() {
    assert_eq!(
        errors(&with(r#""rate": 100,"#, r#""rate": 99999999999999999999999,"#)),
        ["plans.free.limits[0].rate: invalid type: floating point `100000000000000000000000.0`, expected i64"]
    );
    assert_eq!(
        errors(&with(r#""rate": 100,"#, r#""rate": 18446744073709551615,"#)),
        ["plans.free.limits[0].rate: invalid value: integer `18446744073709551615`, expected i64"]
    );
    assert_eq!(
        errors(&with(r#""rate": 100,"#, r#""rate": 2000000000,"#)),
        ["plans.free.limits[0].rate: must be at most 1000000000"]
    );
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
