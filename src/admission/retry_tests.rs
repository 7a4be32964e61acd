//! The retry budget on explicit time, two workers over one shared store.

use std::rc::Rc;

use super::*;
use crate::memory::{MemoryHost, SharedStore};
use crate::policy::Policy;

const S: u64 = NANOS_PER_SEC;
const MS: u64 = 1_000_000;
const T0: u64 = 1_796_000_000 * S;

fn budget(extra: &str) -> RetryBudget {
    let json = format!(
        r#"{{
        "version": "r-1",
        "identity": {{"header": "x-tenant-id"}},
        "plans": {{"free": {{"limits": [{{"rate": 1000000, "per": "1s"}}]}}}},
        "default_plan": "free",
        "anonymous": {{"plan": "free"}},
        "dependencies": {{"db": {{"max_in_flight": 100, "retry_budget": {{"retry_header": "x-attempt" {extra}}}}}}},
        "routes": {{"orders": {{"dependency": "db"}}}}
    }}"#
    );
    let policy = match Policy::from_json(json.as_bytes()) {
        Ok(p) => p,
        Err(e) => panic!("test policy invalid: {e}"),
    };
    policy.dependencies[0].retry_budget.clone().unwrap()
}

#[test]
fn only_a_trusted_attempt_number_of_two_or_more_is_a_retry() {
    for (value, retry) in [
        (&b"2"[..], true),
        (b" 7 ", true),
        (b"99999999999999999999999", true),
        (b"1", false),
        (b"0", false),
        (b"", false),
        (b"yes", false),
        (b"-3", false),
        (b"2x", false),
    ] {
        assert_eq!(attempt_is_retry(value), retry, "{value:?}");
    }
    let store = SharedStore::new();
    let b = budget("");
    assert!(is_retry(
        &b,
        &MemoryHost::new(store.clone()).header("x-attempt", "2")
    ));
    // Envoy's attempt count is not a signal unless the policy says so.
    assert!(!is_retry(
        &b,
        &MemoryHost::new(store.clone()).header("x-envoy-attempt-count", "3")
    ));
    let envoy = budget(r#", "envoy_attempt_count": true"#);
    assert!(is_retry(
        &envoy,
        &MemoryHost::new(store.clone()).header("x-envoy-attempt-count", "3")
    ));
    assert!(!is_retry(
        &envoy,
        &MemoryHost::new(store).header("x-envoy-attempt-count", "1")
    ));
}

#[test]
fn the_policy_defaults_and_errors() {
    let b = budget("");
    assert_eq!(
        (b.ratio_permille, b.min_per_second, b.window_ns, b.key.as_str()),
        (200, 1, 10 * S, "tg2|r|db")
    );
    let json = |budget: &str| {
        format!(
            r#"{{"version": "r-1", "identity": {{"header": "x-tenant-id"}},
            "plans": {{"free": {{"limits": [{{"rate": 10, "per": "1s"}}]}}}}, "default_plan": "free",
            "anonymous": {{"plan": "free"}}, "routes": {{"orders": {{"dependency": "db"}}}},
            "dependencies": {{"db": {{"max_in_flight": 10, "retry_budget": {budget}}}}}}}"#
        )
    };
    for (budget, error) in [
        ("{}", "dependencies.db.retry_budget: no retry signal"),
        (
            r#"{"retry_header": "x a"}"#,
            "dependencies.db.retry_budget.retry_header: must be an HTTP header name",
        ),
        (
            r#"{"envoy_attempt_count": true, "ratio": 1.5}"#,
            "dependencies.db.retry_budget.ratio: must be between 0 and 1",
        ),
        (
            r#"{"envoy_attempt_count": true, "window": "500ms"}"#,
            "dependencies.db.retry_budget.window: must be between 1s and 1m",
        ),
        (
            r#"{"envoy_attempt_count": true, "min_per_second": -1}"#,
            "dependencies.db.retry_budget.min_per_second: must be between 0 and 10000",
        ),
        (r#"{"envoy_attempt_count": true, "burst": 3}"#, "burst"),
    ] {
        let errors = match Policy::from_json(json(budget).as_bytes()) {
            Ok(_) => panic!("{budget} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(errors.contains(error), "{budget}: {errors}");
    }
}

struct Two {
    store: Rc<std::cell::RefCell<SharedStore>>,
    workers: [Primaries; 2],
}

impl Two {
    fn new() -> Two {
        Two {
            store: SharedStore::new(),
            workers: [Primaries::default(), Primaries::default()],
        }
    }
    fn host(&self) -> MemoryHost {
        MemoryHost::new(self.store.clone())
    }
    fn primaries(&mut self, w: usize, n: u64, b: &RetryBudget) {
        for _ in 0..n {
            self.workers[w].note(b);
        }
    }
    fn fold(&mut self, now: u64) {
        let host = self.host();
        for w in &mut self.workers {
            w.fold(&host, now);
        }
    }
    fn retry(&mut self, w: usize, b: &RetryBudget, now: u64) -> Result<Totals, RetryRefusal> {
        let host = self.host();
        self.workers[w].take_retry(&host, b, now)
    }
    /// Retries admitted of `n` tried, alternating workers.
    fn retries(&mut self, n: u64, b: &RetryBudget, now: u64) -> u64 {
        (0..n)
            .filter(|i| self.retry((*i % 2) as usize, b, now).is_ok())
            .count() as u64
    }
}

#[test]
fn retries_are_a_fifth_of_the_primaries_of_both_workers_plus_the_floor() {
    let b = budget(r#", "min_per_second": 1"#);
    let mut n = Two::new();
    // 60 primaries on one worker, 40 on the other, folded on the tick.
    n.primaries(0, 60, &b);
    n.primaries(1, 40, &b);
    // Nothing is in shared data before the tick: only the floor (10).
    assert_eq!(n.workers[0].pending("tg2|r|db"), 60);
    n.fold(T0);
    assert_eq!(n.workers[0].pending("tg2|r|db"), 0);
    // ⌊100 × 0.2⌋ + 1/s × 10 s = 30 retries, node-wide.
    assert_eq!(n.retries(100, &b, T0 + MS), 30);
    let refused = n.retry(0, &b, T0 + 2 * MS).unwrap_err();
    assert_eq!(refused.reason, Reason::RetryBudget);
    assert_eq!(
        refused.totals,
        Totals {
            primaries: 100,
            retries: 30
        }
    );
    // The oldest retries (bucket of T0) leave the window 10 s after it.
    assert!((9..=10).contains(&refused.retry_after_secs), "{refused:?}");
    assert_eq!(refused.totals.amplification_permille(), 1300);
}

#[test]
fn a_retry_folds_its_workers_pending_primaries_in_the_same_update() {
    let b = budget(r#", "min_per_second": 0"#);
    let mut n = Two::new();
    n.primaries(1, 10, &b);
    // Worker 1 has not ticked, but its own retry counts its primaries.
    assert!(n.retry(0, &b, T0).is_err());
    assert_eq!(n.retry(1, &b, T0).map(|t| t.primaries), Ok(10));
    assert_eq!(n.workers[1].pending("tg2|r|db"), 0);
    assert!(n.retry(0, &b, T0).is_ok());
    assert!(n.retry(1, &b, T0).is_err());
}

#[test]
fn the_window_slides_by_buckets_and_old_counts_expire() {
    let b = budget(r#", "min_per_second": 0, "window": "10s""#);
    let mut n = Two::new();
    n.primaries(0, 50, &b);
    n.fold(T0);
    assert_eq!(n.retries(20, &b, T0), 10);
    // 9.9 s later the first bucket is still in the window...
    let edge = (T0 / S) * S + 10 * S - MS;
    assert!(n.retry(0, &b, edge).is_err());
    // ...one bucket later it is not: neither its primaries nor its retries.
    let after = (T0 / S) * S + 10 * S;
    let t = totals(&n.host(), &b, after).unwrap();
    assert_eq!(t, Totals::default());
    assert!(n.retry(0, &b, after).is_err());
    n.primaries(1, 5, &b);
    n.fold(after);
    assert_eq!(n.retries(5, &b, after), 1);
}

#[test]
fn a_client_spraying_retries_gets_only_the_budget() {
    // 100 primaries/s for 30 s, and a client sending 1,000 marked retries
    // per second: retries admitted stay within ratio × primaries + the
    // floor of each window, whatever the retry rate.
    let b = budget("");
    let mut n = Two::new();
    let mut admitted = 0u64;
    let mut primaries = 0u64;
    for tick in 0..3000u64 {
        let now = T0 + tick * 10 * MS;
        n.primaries((tick % 2) as usize, 1, &b);
        primaries += 1;
        n.fold(now);
        admitted += n.retries(10, &b, now);
    }
    // THE BOUND: ratio × P + floor per window × windows, + one window's
    // ratio share at the edge.
    let windows = 3;
    let bound = primaries / 5 + windows * 10 + 1000 / 5;
    assert!(
        admitted <= bound,
        "{admitted} retries for {primaries} primaries (bound {bound})"
    );
    // And the budget is really used (the floor and the ratio both).
    assert!(admitted >= primaries / 5, "{admitted}");
    let amplification = (primaries + admitted) * 1000 / primaries;
    assert!(amplification <= 1300, "{amplification}‰");
}

#[test]
fn the_budget_takes_u64_edge_times_and_counters_saturate() {
    let b = budget(r#", "min_per_second": 10000, "window": "1m""#);
    let mut n = Two::new();
    for now in [0, 1, u64::MAX - 1, u64::MAX] {
        let _ = n.retry(0, &b, now);
        n.primaries(0, 1, &b);
        n.fold(now);
    }
    assert!(allowed(&b, u64::MAX) >= 600_000);
    let t = Totals {
        primaries: 0,
        retries: u64::MAX,
    };
    assert_eq!(t.amplification_permille(), u64::MAX);
}

#[test]
fn contention_refuses_a_retry_never_admits_it() {
    let b = budget("");
    let store = SharedStore::new();
    let mut w = Primaries::default();
    let mut host = MemoryHost::new(store.clone());
    host.fail_shared = true;
    let r = w.take_retry(&host, &b, T0).unwrap_err();
    assert_eq!(r.reason, Reason::StateUnavailable);
    let host = MemoryHost::new(store);
    *host.forced_conflicts.borrow_mut() = 1000;
    let r = w.take_retry(&host, &b, T0).unwrap_err();
    assert_eq!(r.reason, Reason::Contention);
}

#[test]
fn the_bound_holds_in_every_window_under_random_timing_on_two_workers() {
    // Seeded random primaries and marked retries on two workers whose
    // ticks come late at random; every window of 10 buckets is checked
    // against THE BOUND of the module header.
    let b = budget(r#", "min_per_second": 2, "window": "5s""#);
    let bucket = bucket_ns(&b);
    let floor = allowed(&b, 0);
    let mut seed = 0x5eed_u64;
    let mut next = |n: u64| {
        seed = crate::admission::splitmix64(seed);
        seed % n
    };
    let mut n = Two::new();
    // Primaries per bucket as folded, retries per bucket as admitted.
    let mut primaries_at: std::collections::BTreeMap<u64, u64> = Default::default();
    let mut retries_at: std::collections::BTreeMap<u64, u64> = Default::default();
    let mut pending = [0u64; 2];
    for step in 0..6000u64 {
        let now = T0 + step * 10 * MS + next(10 * MS);
        let w = next(2) as usize;
        let current = now / bucket;
        match next(10) {
            0..=3 => {
                n.primaries(w, 1, &b);
                pending[w] += 1;
            }
            4..=8 => {
                let ok = n.retry(w, &b, now).is_ok();
                *primaries_at.entry(current).or_default() += std::mem::take(&mut pending[w]);
                if ok {
                    *retries_at.entry(current).or_default() += 1;
                }
            }
            // A tick, on one worker only (the other is late).
            _ => {
                let host = n.host();
                n.workers[w].fold(&host, now);
                *primaries_at.entry(current).or_default() += std::mem::take(&mut pending[w]);
            }
        }
    }
    let sum = |m: &std::collections::BTreeMap<u64, u64>, last: u64| -> u64 {
        m.range(last.saturating_sub(BUCKETS as u64 - 1)..=last)
            .map(|(_, v)| v)
            .sum()
    };
    let (first, last) = (T0 / bucket, (T0 + 6000 * 10 * MS) / bucket + 1);
    let mut checked = 0;
    for end in first..=last {
        let r = sum(&retries_at, end);
        let Some((&at, _)) = retries_at
            .range(end.saturating_sub(BUCKETS as u64 - 1)..=end)
            .next_back()
        else {
            continue;
        };
        let p = sum(&primaries_at, at);
        assert!(
            r <= p * u64::from(b.ratio_permille) / 1000 + floor,
            "window ending at bucket {end}: {r} retries, {p} primaries in the window of its last retry"
        );
        checked += 1;
    }
    assert!(checked > 100, "{checked}");
    let total_r: u64 = retries_at.values().sum();
    let total_p: u64 = primaries_at.values().sum();
    // The budget was really used, not just closed.
    assert!(
        total_r >= total_p / 5,
        "{total_r} retries for {total_p} primaries"
    );
}
