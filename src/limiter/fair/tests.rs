use super::*;

const MIN: u64 = 60_000_000_000;

fn pool(contended: bool) -> [PoolLimit; 1] {
    [PoolLimit {
        rate: 100,
        per_ns: MIN,
        contended: if contended { Contended::Yes } else { Contended::No },
        window: None,
    }]
}

#[test]
fn the_water_level_meets_small_wants_and_splits_the_rest() {
    assert_eq!(water_level(100, &mut [200, 10, 50]), Some(45));
    assert_eq!(water_level(100, &mut [10, 20]), None);
    assert_eq!(water_level(90, &mut [500, 500, 500]), Some(30));
    assert_eq!(water_level(0, &mut [1, 1]), Some(0));
    assert_eq!(
        water_level(u64::MAX, &mut [u64::MAX, u64::MAX]),
        Some(u64::MAX / 2)
    );
    assert_eq!(water_level(5, &mut []), None);
}

/// A flooding member and a quiet one at 10 units a minute: while the pool
/// is contended the flooder is held to what the quiet one leaves (90 a
/// minute), and the quiet one is never refused.
#[test]
fn a_flooder_is_held_to_its_share_and_a_quiet_member_never_refused() {
    let mut t = FairTable::fresh(1);
    let (flood, quiet) = (FairTable::member_id(b"flood"), FairTable::member_id(b"quiet"));
    let mut flood_used = 0u64;
    // 10 minutes: the flooder asks 10 a second, the quiet one every 6 s.
    for s in 0..600u64 {
        let now = s * 1_000_000_000;
        for _ in 0..10 {
            if t.ask(flood, 1, &pool(true), true, now) == Fairness::Within {
                flood_used += 1;
            }
        }
        if s % 6 == 0 {
            assert_eq!(
                t.ask(quiet, 1, &pool(true), true, now),
                Fairness::Within,
                "at {s} s"
            );
        }
    }
    // Its use converged to its share: 90 a minute (last 5 minutes ~ 450).
    let per_minute = flood_used as f64 / 10.0;
    assert!((85.0..=110.0).contains(&per_minute), "{per_minute}");
}

#[test]
fn nobody_is_refused_while_the_pool_is_not_contended_or_a_member_is_alone() {
    let mut t = FairTable::fresh(1);
    let (a, b) = (FairTable::member_id(b"a"), FairTable::member_id(b"b"));
    for s in 0..300u64 {
        let now = s * 1_000_000_000;
        for _ in 0..10 {
            assert_eq!(t.ask(a, 1, &pool(true), true, now), Fairness::Within);
        }
    }
    let mut t2 = t.clone();
    for i in 0..100u64 {
        assert_eq!(
            t2.ask(b, 1, &pool(false), true, 300_000_000_000 + i),
            Fairness::Within
        );
        assert_eq!(
            t2.ask(a, 1, &pool(false), true, 300_000_000_000 + i),
            Fairness::Within
        );
    }
    // Contended, with `b` asking too: `a` (600 a minute) is over its share.
    t.ask(b, 1, &pool(true), true, 300_000_000_000);
    match t.ask(a, 1, &pool(true), true, 300_000_000_000) {
        // Its use (~596 a minute) decays to its share (100 less `b`'s
        // demand of one unit in an eighth of a minute, 8 a minute: 92) in
        // 60 s × ln(596/92) ≈ 112 s.
        Fairness::Over { limit: 0, wait_ns } => {
            assert!((110..=113).contains(&(wait_ns / 1_000_000_000)), "{wait_ns}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_refused_pool_request_counts_as_demand_only() {
    let mut t = FairTable::fresh(1);
    let a = FairTable::member_id(b"a");
    for _ in 0..5 {
        assert_eq!(t.ask(a, 2, &pool(true), false, 0), Fairness::Within);
    }
    let m = t.members.iter().find(|m| m.id == a).copied().unwrap_or_default();
    assert_eq!((m.demand[0], m.used[0], t.total[0]), (10_000, 0, 10_000));
}

/// More members than entries: the newcomer takes the entry of the one that
/// asked least; the flooder stays tracked; the untracked demand counts.
#[test]
fn the_table_is_bounded_and_keeps_the_heaviest() {
    let mut t = FairTable::fresh(1);
    let flood = FairTable::member_id(b"flood");
    for _ in 0..1000 {
        t.ask(flood, 1, &pool(false), true, 1);
    }
    for u in 0..200u32 {
        t.ask(
            FairTable::member_id(format!("user-{u}").as_bytes()),
            1,
            &pool(false),
            true,
            1,
        );
    }
    assert!(t.members.iter().any(|m| m.id == flood));
    assert_eq!(t.members.iter().filter(|m| m.id != 0).count(), FAIR_MEMBERS);
    assert_eq!(t.total[0], 1_200_000);
    // The flooder is refused while contended: the others' demand counts.
    assert!(matches!(
        t.ask(flood, 1, &pool(true), true, 1),
        Fairness::Over { .. }
    ));
}

#[test]
fn the_table_round_trips_and_refuses_other_formats() {
    let mut t = FairTable::fresh(2);
    let two = [pool(true)[0], pool(false)[0]];
    t.ask(FairTable::member_id(b"a"), 3, &two, true, 5);
    t.ask(FairTable::member_id(b"b"), 4, &two, false, 7);
    let mut bytes = Vec::new();
    t.encode(&mut bytes);
    assert_eq!(FairTable::decode(&bytes), Some(t.clone()));
    assert_eq!(FairTable::decode(&bytes).map(|t| t.limits()), Some(2));
    let mut other = bytes.clone();
    other[0] = 9;
    assert_eq!(FairTable::decode(&other), None, "another version");
    assert_eq!(FairTable::decode(&bytes[..bytes.len() - 1]), None, "cut short");
    let mut longer = bytes.clone();
    longer.push(0);
    assert_eq!(FairTable::decode(&longer), None, "trailing bytes");
    for n in 0..bytes.len() {
        let _ = FairTable::decode(&bytes[..n]);
    }
}

#[test]
fn extreme_costs_and_times_never_trap() {
    let mut t = FairTable::fresh(1);
    let limits = [PoolLimit {
        rate: u64::MAX,
        per_ns: 1,
        contended: Contended::Yes,
        window: Some(Month {
            start: u128::from(u64::MAX),
            end: 0,
        }),
    }];
    for now in [0, u64::MAX, 1, u64::MAX] {
        for m in [b"a", b"b"] {
            let _ = t.ask(FairTable::member_id(m), u64::MAX, &limits, true, now);
            let _ = t.ask(FairTable::member_id(m), u64::MAX, &pool(true), true, now);
        }
    }
    let _ = t.is_idle(1, u64::MAX);
    let _ = t.is_idle(u64::MAX, 0);
}

#[test]
fn the_table_is_idle_once_every_demand_has_decayed() {
    let mut t = FairTable::fresh(1);
    t.ask(FairTable::member_id(b"a"), 100, &pool(false), true, 0);
    assert!(!t.is_idle(MIN, MIN));
    assert!(t.is_idle(MIN, 10 * MIN));
}

/// A calendar month's pool: a flooder held to its share at the month's
/// end asks afresh when the next month starts (its use of the last month
/// is forgotten), and a refusal never waits past the month's end.
#[test]
fn a_new_month_forgets_the_use_of_the_last_one() {
    let december = Month {
        start: 0,
        end: u128::from(60 * MIN),
    };
    let january = Month {
        start: u128::from(60 * MIN),
        end: u128::from(120 * MIN),
    };
    let at = |window| {
        [PoolLimit {
            window: Some(window),
            ..pool(true)[0]
        }]
    };
    let mut t = FairTable::fresh(1);
    let (flooder, quiet) = (FairTable::member_id(b"ads"), FairTable::member_id(b"web"));
    let end = 60 * MIN - 1_000_000_000;
    // December's last minute: the flooder is over its share; its wait
    // (its use decaying to the share) is cut at the month's end.
    let mut over = None;
    for i in 0..300 {
        let now = end - MIN + i * 200_000_000;
        if i % 10 == 0 {
            assert_eq!(t.ask(quiet, 1, &at(december), true, now), Fairness::Within);
        }
        if let Fairness::Over { wait_ns, .. } = t.ask(flooder, 1, &at(december), true, now) {
            over = Some((now, wait_ns));
        }
    }
    let (now, wait_ns) = over.expect("the flooder was held to its share");
    assert!(
        now + wait_ns <= 60 * MIN,
        "{wait_ns} ns waits past the month's end"
    );
    // January's first second: within (its December use is gone).
    let jan = 60 * MIN + 1_000_000_000;
    assert_eq!(t.ask(quiet, 1, &at(january), true, jan), Fairness::Within);
    assert_eq!(t.ask(flooder, 1, &at(january), true, jan), Fairness::Within);
}
