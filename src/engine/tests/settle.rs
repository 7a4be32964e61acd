//! Late-settled costs through the engine (`engine::settle`) and soft limits:
//! a difference charged or given back to every limit the request was
//! charged against (and its guard), into debt up to `max_debt` with an
//! honest wait, written off beyond; a soft limit admits, marks and is not
//! charged, while a hard limit above it still refuses.

use super::*;

fn settle_policy(limits: &str, extra: &str) -> Policy {
    let json = format!(
        r#"{{
        "version": "settle-1",
        "identity": {{"header": "x-tenant-id"}},
        "plans": {{ "tokens": {{"limits": {limits}}} }},
        "default_plan": "tokens",
        "anonymous": {{"plan": "tokens"}},
        "guards": {{ "gpu": {{"limits": [{{"rate": 1000, "per": "1s"}}]}} }},
        "routes": {{
            "chat": {{"cost": 10, "settle": {{"usage": "openai_total", "ceiling": 100}}}},
            "guarded": {{"action": "chat", "cost": 10, "guard": "gpu",
                         "settle": {{"usage": "openai_total", "ceiling": 100}}}},
            "plain": {{"action": "chat"}}
        }}
        {extra}
    }}"#
    );
    Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"))
}

fn charged_of(d: &Decision, at: u64) -> Charged {
    Charged {
        limits: d.charged,
        guard: d.guard_charged,
        levels: d.levels_charged,
        at,
    }
}

fn prepared(p: &Policy, h: &MemoryHost) -> Prepared {
    prepare(p, h).unwrap()
}

#[test]
fn a_cost_above_the_estimate_is_charged_into_debt_and_the_wait_says_so() {
    // 100 tokens a second, burst 100, debt up to the burst (the default).
    let p = settle_policy(r#"[{"rate": 100, "per": "1s"}]"#, "");
    assert_eq!(p.plans()[0].limits[0].max_debt, 100);
    let store = SharedStore::new();
    let h = req(&store, "chat", "acme");
    let r = prepared(&p, &h);
    let mut scratch = Scratch::default();
    let mut charges = Vec::new();
    for _ in 0..10 {
        let d = charge(&p, &r, &h, T0, &mut scratch);
        assert_eq!(d.reason, Reason::Allowed);
        assert_eq!((d.charged, d.guard_charged), (1, false));
        charges.push(charged_of(&d, T0));
    }
    assert_eq!(charge(&p, &r, &h, T0, &mut scratch).reason, Reason::RateLimited);
    // Every request really cost 25: 15 more each, 150 in all; 100 fit the
    // debt allowance, 50 are written off.
    let mut written_off = 0;
    for c in &charges {
        let a = settle(&p, &r, &h, c, Difference::More(15), T0, &mut scratch);
        assert!(a.written);
        written_off += a.written_off;
    }
    assert_eq!(written_off, 50);
    let d = charge(&p, &r, &h, T0, &mut scratch);
    assert_eq!(d.reason, Reason::RateLimited);
    // The debt (100) and the request's 10 must refill: 1.1 s.
    assert_eq!(d.wait_ns, 1_100_000_000);
    assert_eq!(d.retry_after_secs, 2);
    assert_eq!(
        charge(&p, &r, &h, T0 + 1_100_000_000 - 1, &mut scratch).reason,
        Reason::RateLimited
    );
    assert_eq!(
        charge(&p, &r, &h, T0 + 1_100_000_000, &mut scratch).reason,
        Reason::Allowed
    );
}

#[test]
fn a_cost_below_the_estimate_is_given_back_and_the_key_admits_again() {
    let p = settle_policy(r#"[{"rate": 100, "per": "1m"}]"#, "");
    let store = SharedStore::new();
    let h = req(&store, "chat", "acme");
    let r = prepared(&p, &h);
    let mut scratch = Scratch::default();
    let charges: Vec<Charged> = (0..10)
        .map(|_| charged_of(&charge(&p, &r, &h, T0, &mut scratch), T0))
        .collect();
    assert_eq!(charge(&p, &r, &h, T0, &mut scratch).reason, Reason::RateLimited);
    // Each really cost 4: 6 back each, 60 in all, six more requests.
    for c in &charges {
        settle(&p, &r, &h, c, Difference::Less(6), T0, &mut scratch);
    }
    assert_eq!(admitted(&p, &h, T0, 20), 6);
}

#[test]
fn settling_reaches_every_charged_limit_and_the_guard_and_skips_the_rest() {
    let limits = r#"[{"name": "minute", "rate": 1000, "per": "1m"},
                     {"name": "day", "rate": 5000, "per": "1d", "algorithm": "fixed_window"}]"#;
    let p = settle_policy(limits, "");
    let store = SharedStore::new();
    let h = req(&store, "guarded", "acme");
    let r = prepared(&p, &h);
    let mut scratch = Scratch::default();
    let d = charge(&p, &r, &h, T0, &mut scratch);
    assert_eq!((d.charged, d.guard_charged), (0b11, true));
    let a = settle(
        &p,
        &r,
        &h,
        &charged_of(&d, T0),
        Difference::More(90),
        T0,
        &mut scratch,
    );
    assert_eq!((a.written_off, a.owed), (0, 0));
    let peeked = peek(
        &p,
        &KeyOf {
            action: "chat",
            subject: &r.subject,
            plan: r.plan,
        },
        &h,
        T0,
        None,
        &mut scratch,
    )
    .unwrap();
    assert_eq!(
        peeked.iter().map(|k| k.remaining).collect::<Vec<_>>(),
        [900, 4900]
    );
    // The guard took the 90 too: 1000 − 100 left for everyone.
    let other = req(&store, "guarded", "other");
    let ro = prepared(&p, &other);
    let mut n = 0;
    while charge(&p, &ro, &other, T0, &mut scratch).reason == Reason::Allowed {
        n += 1;
    }
    assert_eq!(n, 90, "900 guard units left at 10 each");
    // Nothing charged, nothing settled (a shadow-mode denial, say).
    let none = Charged {
        limits: 0,
        guard: false,
        levels: Default::default(),
        at: T0,
    };
    let before = store.borrow().writes;
    let a = settle(&p, &r, &h, &none, Difference::More(50), T0, &mut scratch);
    assert_eq!(a.owed, 0);
    assert!(store.borrow().writes <= before + 1);
}

#[test]
fn a_zero_difference_touches_no_shared_data() {
    let p = settle_policy(r#"[{"rate": 100, "per": "1m"}]"#, "");
    let store = SharedStore::new();
    let h = req(&store, "chat", "acme");
    let r = prepared(&p, &h);
    let mut scratch = Scratch::default();
    let d = charge(&p, &r, &h, T0, &mut scratch);
    let before = store.borrow().writes;
    settle(
        &p,
        &r,
        &h,
        &charged_of(&d, T0),
        Difference::More(0),
        T0,
        &mut scratch,
    );
    settle(
        &p,
        &r,
        &h,
        &charged_of(&d, T0),
        Difference::Less(0),
        T0,
        &mut scratch,
    );
    assert_eq!(store.borrow().writes, before);
}

#[test]
fn a_key_whose_slot_was_reclaimed_during_a_long_stream_still_pays_its_settlement() {
    // max_keys 8: one entry of 8 slots.
    let p = settle_policy(
        r#"[{"rate": 100, "per": "1s"}]"#,
        r#","key_table": {"max_keys": 8}"#,
    );
    let store = SharedStore::new();
    let mut scratch = Scratch::default();
    let h = req(&store, "chat", "acme");
    let r = prepared(&p, &h);
    let d = charge(&p, &r, &h, T0, &mut scratch);
    // An hour later its slot is idle and eight other tenants take them all.
    let later = T0 + 3600 * S;
    for i in 0..8 {
        let other = req(&store, "chat", &format!("t{i}"));
        assert_eq!(
            charge(&p, &prepared(&p, &other), &other, later, &mut scratch).reason,
            Reason::Allowed
        );
    }
    assert!(!table_keys(&store).contains(&"chat|t|acme".to_owned()));
    // Settling 80 more takes a slot again (another idle one) and charges it.
    let a = settle(
        &p,
        &r,
        &h,
        &charged_of(&d, T0),
        Difference::More(80),
        later + S,
        &mut scratch,
    );
    assert!(a.written);
    assert!(table_keys(&store).contains(&"chat|t|acme".to_owned()));
    assert_eq!(
        admitted(&p, &h, later + S, 100),
        2,
        "20 tokens left: two requests of 10"
    );
}

#[test]
fn a_soft_limit_admits_and_marks_while_a_hard_limit_above_it_refuses() {
    let limits = r#"[{"name": "primary", "rate": 5, "per": "1m", "on_limit": "soft"},
                     {"name": "ceiling", "rate": 8, "per": "1m"}]"#;
    let json = format!(
        r#"{{"version": "soft-1", "identity": {{"header": "x-tenant-id"}},
            "plans": {{"p": {{"limits": {limits}}}}}, "default_plan": "p",
            "anonymous": {{"plan": "p"}}, "routes": {{"api": {{}}}}}}"#
    );
    let p = Policy::from_json(json.as_bytes()).unwrap();
    assert!(p.has_soft_limits);
    assert_eq!(p.soft_limit_header, "x-tenantgate-soft-limit");
    let store = SharedStore::new();
    let h = req(&store, "api", "acme");
    let reasons: Vec<Reason> = (0..10).map(|_| run(&p, &h, T0).reason).collect();
    assert_eq!(&reasons[..5], [Reason::Allowed; 5]);
    assert_eq!(&reasons[5..8], [Reason::SoftLimited; 3]);
    assert_eq!(&reasons[8..], [Reason::RateLimited; 2]);
    let soft = run(&p, &req(&store, "api", "other"), T0);
    assert_eq!(soft.charged, 0b11);
    let mut d = soft;
    for _ in 0..5 {
        d = run(&p, &req(&store, "api", "other"), T0);
    }
    assert_eq!((d.reason, d.charged), (Reason::SoftLimited, 0b10));
    assert_eq!(d.limit, Some(LimitName::Rate("primary".into())));
    assert_eq!(d.deny_status(), None);
    // The 429 names the hard limit.
    let refused = run(&p, &h, T0);
    assert_eq!(refused.limit, Some(LimitName::Rate("ceiling".into())));
    // In shadow mode a soft limit marks nothing: shadow_limited.
    let shadow = Policy::from_json(
        json.replace(
            r#""version": "soft-1","#,
            r#""version": "soft-1", "mode": "shadow","#,
        )
        .as_bytes(),
    )
    .unwrap();
    let store = SharedStore::new();
    let h = req(&store, "api", "acme");
    let reasons: Vec<Reason> = (0..6).map(|_| run(&shadow, &h, T0).reason).collect();
    assert_eq!(reasons[5], Reason::ShadowLimited);
}
