//! Reload safety through the real engine (see `crate::limiter::algo`, "Reload
//! rule"): two workers on one node's shared data, one still on the old
//! policy and one on the new, charging the same key in turn; queued requests
//! held under the old policy; stored records from a clock excursion or
//! another worker's garbage.

use std::rc::Rc;

use super::*;
use crate::admission::queue::Attempt;
use crate::pipeline::hold::{Hold, Released};
use crate::pipeline::Request;

const MIN: u64 = 60 * S;
const HOUR: u64 = 60 * MIN;

/// One limit named `l` (so its state carries across versions), on route
/// `api` (and `jobs`, which queues for up to 10 s).
pub(super) fn limit_policy(version: &str, limit: &str, effective_from: u64) -> Policy {
    let json = format!(
        r#"{{"version":"{version}","identity":{{"header":"x-tenant-id"}},
        "plans":{{"free":{{"limits":[{{"name":"l",{limit}}}]}}}},
        "default_plan":"free","anonymous":{{"plan":"free"}},
        "routes":{{"api":{{}},"jobs":{{"action":"api","on_limit":"queue","max_wait":"10s","max_queue":1000}}}},"default_route":"api"}}"#
    );
    let mut p = Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{json}: {e}"));
    p.effective_from_ns = effective_from;
    p
}

/// What one version of a limit is, for the bound the test checks.
#[derive(Debug, Clone, Copy)]
pub(super) enum Spec {
    Bucket {
        rate: u64,
        per: u64,
        burst: u64,
    },
    Window {
        algorithm: &'static str,
        rate: u64,
        per: u64,
    },
}

impl Spec {
    pub(super) fn json(&self) -> String {
        match *self {
            Spec::Bucket { rate, per, burst } => {
                format!(r#""rate":{rate},"per":"{}s","burst":{burst}"#, per / S)
            }
            Spec::Window { algorithm, rate, per } => {
                format!(r#""algorithm":"{algorithm}","rate":{rate},"per":"{}s""#, per / S)
            }
        }
    }

    /// The most this limit alone admits in `d` consecutive nanoseconds
    /// (each algorithm's stated bound, see its module header).
    pub(super) fn alone(&self, d: u64) -> u64 {
        match *self {
            Spec::Bucket { rate, per, burst } => burst + d / per.div_ceil(rate),
            // Every window algorithm admits at most `rate` per aligned (fixed,
            // counter) or rolling (log) window, and `d` ns meet at most
            // `1 + ceil((d − 1) / W)` aligned windows.
            Spec::Window { rate, per, .. } => rate * (1 + d.saturating_sub(1).div_ceil(per)),
        }
    }
}

/// THE BOUND the reload rule promises for charges under two versions `a`
/// and `b` of one limit, in any order: in `d` consecutive nanoseconds,
/// * token bucket: `max(burst) + floor(d / min(T))`, what the more generous
///   of the two would admit (a bucket refilling at the faster rate, holding
///   the larger burst);
/// * window algorithms: what `a` alone plus what `b` alone would admit
///   (the record is migrated once, forward, and then only counted under the
///   newer parameters; ping-pong between window lengths would forget counts
///   at every round and beat this over any long interval).
fn bound(a: Spec, b: Spec, d: u64) -> u64 {
    match (a, b) {
        (
            Spec::Bucket {
                rate: ra,
                per: pa,
                burst: ba,
            },
            Spec::Bucket {
                rate: rb,
                per: pb,
                burst: bb,
            },
        ) => ba.max(bb) + d / pa.div_ceil(ra).min(pb.div_ceil(rb)),
        _ => a.alone(d) + b.alone(d),
    }
}

pub(super) use crate::limiter::testkit::max_in;

fn host(store: &Rc<std::cell::RefCell<SharedStore>>, class: &str) -> MemoryHost {
    req(store, class, "acme")
}

/// Charges up to `n` requests at `now`; returns how many were admitted.
fn drain(p: &Policy, h: &MemoryHost, now: u64, n: u64, admitted: &mut Vec<u64>) -> u64 {
    let mut got = 0;
    for _ in 0..n {
        if run(p, h, now).reason == Reason::Allowed {
            admitted.push(now);
            got += 1;
        } else {
            break;
        }
    }
    got
}

/// Worker A stays on `old`; worker B reloads `new` at `T0 + 1 s`. From
/// then on, every `step` the two charge the same key in turn, each
/// draining what it is given, for `rounds` rounds. Returns every
/// admission's instant.
fn ping_pong(old: Spec, new: Spec, step: u64, rounds: u64) -> Vec<u64> {
    let store = SharedStore::new();
    let a = limit_policy("v1", &old.json(), T0 - HOUR);
    let b = limit_policy("v2", &new.json(), T0 + S);
    let (ha, hb) = (host(&store, "api"), host(&store, "api"));
    let cap = 30_000;
    let mut admitted = Vec::new();
    drain(&a, &ha, T0, cap, &mut admitted);
    for i in 0..rounds {
        let now = T0 + 2 * S + i * step;
        // Alternate who goes first, so both orders occur.
        let (first, second) = if i % 2 == 0 {
            ((&a, &ha), (&b, &hb))
        } else {
            ((&b, &hb), (&a, &ha))
        };
        drain(first.0, first.1, now, cap, &mut admitted);
        drain(second.0, second.1, now + 1, cap, &mut admitted);
    }
    admitted
}

fn assert_within(old: Spec, new: Spec, admitted: &[u64], lengths: &[u64]) {
    let span = admitted.last().copied().unwrap_or(0) - admitted.first().copied().unwrap_or(0) + 1;
    for &d in lengths.iter().chain([span].iter()) {
        let got = max_in(admitted, d);
        let allowed = bound(old, new, d);
        assert!(
            got <= allowed,
            "{old:?} -> {new:?}: {got} admitted in {d} ns, the bound is {allowed}"
        );
    }
}

#[test]
fn two_workers_on_two_bucket_policies_never_admit_more_than_the_more_generous_one() {
    // Regression: each worker migrated the other's record as of its own
    // policy's effective_from, so the time since then was credited again on
    // every round: a fresh burst per round.
    let slow = Spec::Bucket {
        rate: 100,
        per: MIN,
        burst: 100,
    };
    let fast = Spec::Bucket {
        rate: 10_000,
        per: MIN,
        burst: 10_000,
    };
    let slow_small = Spec::Bucket {
        rate: 100,
        per: MIN,
        burst: 10,
    };
    let fast_small = Spec::Bucket {
        rate: 10_000,
        per: MIN,
        burst: 50,
    };
    for (old, new) in [
        (slow, fast),
        (fast, slow),
        (slow, slow_small),
        (slow_small, slow),
        (fast, fast_small),
        (fast_small, fast),
        (slow_small, fast_small),
    ] {
        // 300 rounds, or two minutes of rounds (enough for the bound over a
        // minute and over the whole run).
        for step in [37_000_000, S, 7 * S] {
            let admitted = ping_pong(old, new, step, (2 * MIN / step).min(300));
            assert_within(old, new, &admitted, &[S, 10 * S, MIN]);
        }
    }
}

#[test]
fn two_workers_on_two_window_policies_stay_within_both_bounds() {
    for algorithm in ["fixed_window", "sliding_window_log", "sliding_window_counter"] {
        // The log holds at most 1,024 entries per key.
        let big = if algorithm == "sliding_window_log" {
            1_000
        } else {
            10_000
        };
        let w = |rate, per| Spec::Window { algorithm, rate, per };
        for (old, new) in [
            // Raised and lowered, same window.
            (w(100, MIN), w(big, MIN)),
            (w(big, MIN), w(100, MIN)),
            // Another window length, the same or another rate.
            (w(100, MIN), w(100, 10 * S)),
            (w(100, 10 * S), w(100, MIN)),
            (w(100, MIN), w(big, HOUR)),
            (w(big, HOUR), w(100, MIN)),
        ] {
            // 400 rounds, or ten minutes of rounds.
            for step in [S, 7 * S] {
                let admitted = ping_pong(old, new, step, (10 * MIN / step).min(400));
                assert_within(old, new, &admitted, &[10 * S, MIN, HOUR]);
            }
        }
    }
}

/// 50 requests held under `old` (key exhausted at `T0`), `new` loaded at
/// `T0 + 1 s` on another worker that drains the key every 10 ms tick while
/// the old worker serves its queue, until `T0 + 12 s`. Returns every
/// admission's instant.
fn queued_across_a_reload(old: Spec, new: Spec) -> Vec<u64> {
    let store = SharedStore::new();
    let old_policy = Rc::new(limit_policy("v1", &old.json(), T0 - HOUR));
    let new_policy = limit_policy("v2", &new.json(), T0 + S);
    let jobs = host(&store, "jobs");
    let api = host(&store, "api");
    let mut admitted = Vec::new();
    drain(&old_policy, &jobs, T0, 30_000, &mut admitted);
    let prepared = prepare(&old_policy, &jobs).unwrap();
    let mut hold = Hold::default();
    for id in 0..50 {
        let denial = charge(&old_policy, &prepared, &jobs, T0, &mut Scratch::default());
        assert_eq!(denial.reason, Reason::RateLimited);
        let paused = Request {
            stream: id,
            policy: old_policy.clone(),
            prepared: prepared.clone(),
            primary: false,
            request_id: None,
            read: None,
        };
        hold.offer_rate(paused, &denial, T0).unwrap();
    }
    let tick = 10_000_000;
    let mut now = T0 + S;
    while now < T0 + 12 * S {
        now += tick;
        drain(&new_policy, &api, now, 30_000, &mut admitted);
        let served = hold.serve(
            now,
            tick,
            |_| Attempt::<(), ()>::LevelFull,
            |w| charge(&w.policy, &w.prepared, &jobs, now, &mut Scratch::default()),
        );
        for r in served {
            let Released::Charged(_, d) = r else { continue };
            if d.reason == Reason::Allowed {
                admitted.push(now);
            }
            // Held at T0 with a max_wait of 10 s.
            assert!(now <= T0 + 10 * S);
        }
    }
    admitted
}

#[test]
fn a_request_queued_under_the_old_policy_adds_no_tokens_after_the_reload() {
    // Regression: a held request, charged under its old policy after the
    // other worker had written the new one's record, migrated it as of the
    // old policy's load time: an hour of refill, a full old bucket.
    let bucket = |rate, burst| Spec::Bucket {
        rate,
        per: MIN,
        burst,
    };
    for (old, new) in [
        (bucket(100, 100), bucket(100, 10)),
        (bucket(100, 100), bucket(10_000, 10_000)),
        (bucket(10_000, 10_000), bucket(100, 100)),
    ] {
        let admitted = queued_across_a_reload(old, new);
        assert_within(old, new, &admitted, &[S, 10 * S]);
        // Tighter: after the reload, the key holds what it held then
        // (empty at T0, refilled for 1 s at the old rate), capped at the
        // new burst, and refills at the new rate; +1 for the two fractions.
        let (
            Spec::Bucket {
                rate: ro, burst: bn, ..
            },
            Spec::Bucket { rate: rn, .. },
        ) = (old, new)
        else {
            unreachable!()
        };
        let reload = T0 + S;
        let after: Vec<u64> = admitted.iter().copied().filter(|&t| t > reload).collect();
        let last = after.last().copied().unwrap_or(reload);
        let carried = (S / MIN.div_ceil(ro)).min(bn);
        let allowed = carried + (last - reload) / MIN.div_ceil(rn) + 1;
        assert!(
            after.len() as u64 <= allowed,
            "{old:?} -> {new:?}: {} admitted after the reload, at most {allowed}",
            after.len()
        );
    }
}

/// The key's one record, as stored.
fn stored_record(store: &Rc<std::cell::RefCell<SharedStore>>) -> (u8, u64, u64, Vec<u8>) {
    let store = store.borrow();
    let key = store.keys().find(|k| k.starts_with("tg2|k|")).unwrap().clone();
    let slots = crate::table::decode_entry(store.get(&key).unwrap()).unwrap();
    let records = crate::table::decode_records(slots[0].records).unwrap();
    let r = records[0];
    (r.kind, r.p1, r.p2, r.state.to_vec())
}

/// Replaces the key's one record.
fn forge(store: &Rc<std::cell::RefCell<SharedStore>>, kind: u8, p1: u64, p2: u64, state: &[u8]) {
    let key = store
        .borrow()
        .keys()
        .find(|k| k.starts_with("tg2|k|"))
        .unwrap()
        .clone();
    let entry = {
        let s = store.borrow();
        let slots = crate::table::decode_entry(s.get(&key).unwrap()).unwrap();
        let name_hash = crate::table::decode_records(slots[0].records).unwrap()[0].name_hash;
        let mut records = vec![1u8];
        crate::table::push_record(&mut records, name_hash, kind, p1, p2, state);
        let mut out = Vec::new();
        assert!(crate::table::encode_entry(
            [crate::table::Slot {
                key: slots[0].key,
                records: &records,
            }],
            &mut out
        ));
        out
    };
    let h = MemoryHost::new(store.clone());
    assert_eq!(
        crate::host::Host::shared_set(&h, &key, &entry, None),
        Ok(crate::host::CasResult::Written)
    );
}

#[test]
fn a_record_far_in_the_future_never_yields_a_full_bucket() {
    // A TAT a day ahead (a clock excursion, or another worker's write),
    // under the same and under other parameters, with and without a stamp.
    let old = Spec::Bucket {
        rate: 100,
        per: MIN,
        burst: 100,
    };
    let new = Spec::Bucket {
        rate: 10_000,
        per: MIN,
        burst: 10_000,
    };
    for params_of in [old, new] {
        for stamp in [
            None,
            Some((T0 + 86_400 * S, T0 + 86_400 * S)),
            Some((0, u64::MAX)),
            Some((u64::MAX, 0)),
        ] {
            let store = SharedStore::new();
            let p_old = limit_policy("v1", &old.json(), T0 - HOUR);
            let p_new = limit_policy("v2", &new.json(), T0 - S);
            let h = host(&store, "api");
            assert_eq!(admitted(&p_old, &h, T0, 1), 1);
            let (kind, _, _, _) = stored_record(&store);
            let writer = match params_of {
                Spec::Bucket { rate, per, burst } => {
                    crate::limiter::token_bucket::Gcra::new(rate, per, burst).unwrap()
                }
                Spec::Window { .. } => unreachable!(),
            };
            let mut state = (T0 + 86_400 * S).to_le_bytes().to_vec();
            if let Some((epoch, at)) = stamp {
                state.extend_from_slice(&epoch.to_le_bytes());
                state.extend_from_slice(&at.to_le_bytes());
            }
            forge(&store, kind, writer.interval_ns(), writer.tolerance_ns(), &state);
            for p in [&p_new, &p_old] {
                let got = admitted(p, &h, T0, 20_000);
                assert!(got <= 1, "{params_of:?} {stamp:?} v{}: {got} admitted", p.version);
            }
        }
    }
}

#[test]
fn extreme_stored_fields_never_trap() {
    let specs = [
        Spec::Bucket {
            rate: 100,
            per: MIN,
            burst: 100,
        },
        Spec::Window {
            algorithm: "fixed_window",
            rate: 100,
            per: MIN,
        },
        Spec::Window {
            algorithm: "sliding_window_log",
            rate: 100,
            per: MIN,
        },
        Spec::Window {
            algorithm: "sliding_window_counter",
            rate: 100,
            per: MIN,
        },
    ];
    let edges = [0u64, 1, T0, u64::MAX - 1, u64::MAX];
    // Well-formed states at their extremes, with extreme stamps.
    let mut extremes: Vec<Vec<u8>> = Vec::new();
    let max_log = {
        let log = crate::limiter::SlidingWindowLog::new(1, 1).unwrap();
        let crate::limiter::Verdict::Admit { state, .. } = log.check(&Default::default(), u64::MAX, 1) else {
            unreachable!()
        };
        State::SlidingWindowLog(state)
    };
    for state in [
        State::TokenBucket { tat: u64::MAX },
        State::TokenBucket { tat: 0 },
        State::FixedWindow(crate::limiter::fixed_window::State {
            window: u64::MAX,
            count: u64::MAX,
        }),
        State::SlidingWindowCounter(crate::limiter::sliding_window_counter::State {
            last_ns: u64::MAX,
            prev: u64::MAX,
            curr: u64::MAX,
        }),
        max_log,
    ] {
        for (epoch, written_at) in [
            (0, 0),
            (u64::MAX, u64::MAX),
            (0, u64::MAX),
            (u64::MAX, 0),
            (T0, T0),
        ] {
            let mut bytes = Vec::new();
            Algo::encode_stored(
                &state,
                crate::limiter::algo::Stamp { epoch, written_at },
                &mut bytes,
            );
            extremes.push(bytes);
        }
    }
    for spec in specs {
        let p = limit_policy("v", &spec.json(), T0 - S);
        for kind in 1..=4u8 {
            for p1 in edges {
                for p2 in edges {
                    for body in [
                        vec![],
                        u64::MAX.to_le_bytes().to_vec(),
                        0u64.to_le_bytes().to_vec(),
                        [0xff; 24].to_vec(),
                        [0u8; 24].to_vec(),
                        [[0xffu8; 8], [0; 8], [0xff; 8]].concat(),
                        [[0x80u8; 10].as_slice(), &[0x01], &[0xff; 16]].concat(),
                    ]
                    .into_iter()
                    .chain(extremes.iter().cloned())
                    {
                        let store = SharedStore::new();
                        let h = host(&store, "api");
                        assert_eq!(admitted(&p, &h, T0, 1), 1);
                        forge(&store, kind, p1, p2, &body);
                        for now in [0, 1, T0, u64::MAX] {
                            let d = run(&p, &h, now);
                            assert!(
                                matches!(d.reason, Reason::Allowed | Reason::RateLimited),
                                "{spec:?} kind {kind} {p1} {p2} {body:?} at {now}: {d:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_worker_not_yet_reloaded_keeps_the_state_of_a_limit_only_the_new_policy_has() {
    // Regression: the old policy rewrote the key's slot with its own limits
    // only, so a limit the new policy added started fresh on the new
    // policy's next charge: a fresh daily quota per round.
    let store = SharedStore::new();
    let json = |limits: &str| {
        format!(
            r#"{{"version":"v","identity":{{"header":"x-tenant-id"}},
            "plans":{{"free":{{"limits":[{limits}]}}}},
            "default_plan":"free","anonymous":{{"plan":"free"}},"routes":{{"api":{{}}}},"default_route":"api"}}"#
        )
    };
    let mut old = Policy::from_json(json(r#"{"name":"l","rate":10000,"per":"1m"}"#).as_bytes()).unwrap();
    old.effective_from_ns = T0 - HOUR;
    let mut new = Policy::from_json(
        json(r#"{"name":"l","rate":10000,"per":"1m"},{"name":"daily","rate":20,"per":"1d"}"#).as_bytes(),
    )
    .unwrap();
    new.effective_from_ns = T0;
    let (a, b) = (host(&store, "api"), host(&store, "api"));
    assert_eq!(admitted(&new, &b, T0, 100), 20, "the daily quota");
    let mut under_new = 0;
    for i in 1..=200 {
        let now = T0 + i * S;
        assert_eq!(
            run(&old, &a, now).reason,
            Reason::Allowed,
            "the old policy has no daily limit"
        );
        under_new += admitted(&new, &b, now + 1, 100);
    }
    // 200 s of a 20/day quota refill 0.05 units: none.
    assert_eq!(under_new, 0);
    // Both records stay; a still newer policy without `daily` drops it.
    let records = {
        let s = store.borrow();
        let key = s.keys().find(|k| k.starts_with("tg2|k|")).unwrap().clone();
        let slots = crate::table::decode_entry(s.get(&key).unwrap()).unwrap();
        crate::table::decode_records(slots[0].records).unwrap().len()
    };
    assert_eq!(records, 2);
    assert_eq!(run(&old, &a, T0 + 300 * S).reason, Reason::Allowed);
    let mut newest = Policy::from_json(json(r#"{"name":"l","rate":10000,"per":"1m"}"#).as_bytes()).unwrap();
    newest.effective_from_ns = T0 + 301 * S;
    assert_eq!(run(&newest, &a, T0 + 302 * S).reason, Reason::Allowed);
    let s = store.borrow();
    let key = s.keys().find(|k| k.starts_with("tg2|k|")).unwrap().clone();
    let slots = crate::table::decode_entry(s.get(&key).unwrap()).unwrap();
    assert_eq!(
        crate::table::decode_records(slots[0].records).unwrap().len(),
        1,
        "an older policy's extra record is dropped by a newer policy"
    );
}
