//! What every window algorithm must satisfy, checked by each one's tests:
//! the contract of [`Verdict`] (exact `wait_ns`, `remaining` and
//! `reset_ns`), `is_idle` ⇔ equivalent to a fresh state, a lossless
//! encoding, and a traffic simulator with a clock that may step backwards.

use super::Verdict;
use std::fmt::Debug;

pub(crate) const S: u64 = 1_000_000_000;
/// An arbitrary, realistic wall-clock start (2026-11-30).
pub(crate) const T0: u64 = 1_796_000_000 * S;

/// The most admissions (instants, sorted) in any `d` consecutive
/// nanoseconds: what a bound over every interval of length `d` is checked
/// against.
pub(crate) fn max_in(admitted: &[u64], d: u64) -> u64 {
    let mut best = 0;
    let mut first = 0;
    for (i, &t) in admitted.iter().enumerate() {
        while admitted[first] + d <= t {
            first += 1;
        }
        best = best.max(i + 1 - first);
    }
    best as u64
}

/// A deterministic xorshift so the tests need no dependency.
pub(crate) struct XorShift(pub(crate) u64);

impl XorShift {
    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// In `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The shape the window algorithms share, so one set of checks covers all.
pub(crate) trait Algo {
    type State: Clone + Default + PartialEq + Debug;
    fn limit(&self) -> u64;
    fn check(&self, state: &Self::State, now: u64, cost: u64) -> Verdict<Self::State>;
    fn is_idle(&self, state: &Self::State, now: u64) -> bool;
    fn encode(state: &Self::State, out: &mut Vec<u8>);
    fn decode(bytes: &[u8]) -> Option<(Self::State, usize)>;
}

/// Admits `cost` at `now`, updating `state`; true if admitted.
pub(crate) fn take<A: Algo>(a: &A, state: &mut A::State, now: u64, cost: u64) -> bool {
    match a.check(state, now, cost) {
        Verdict::Admit { state: new, .. } => {
            *state = new;
            true
        }
        Verdict::Deny { .. } => false,
    }
}

fn admits<A: Algo>(a: &A, state: &A::State, now: u64, cost: u64) -> bool {
    a.check(state, now, cost).is_admit()
}

/// `remaining` and `reset_ns` mean what they say of `state` at `now`.
fn assert_remaining_and_reset<A: Algo>(a: &A, state: &A::State, now: u64, rem: u64, reset: u64) {
    assert!(admits(a, state, now, rem), "remaining {rem} is not admitted");
    assert!(!admits(a, state, now, rem + 1), "more than {rem} remain");
    if let Some(at) = now.checked_add(reset) {
        assert!(admits(a, state, at, a.limit()), "not full after {reset}");
        if reset > 0 {
            assert!(!admits(a, state, at - 1, a.limit()), "full before {reset}");
        }
    }
}

/// Every promise one `check` of `cost` at `now` makes about `state`.
pub(crate) fn assert_contract<A: Algo>(a: &A, state: &A::State, now: u64, cost: u64) {
    match a.check(state, now, cost) {
        Verdict::Admit {
            state: new,
            remaining,
            reset_ns,
        } => assert_remaining_and_reset(a, &new, now, remaining, reset_ns),
        Verdict::Deny {
            wait_ns,
            remaining,
            reset_ns,
        } => {
            assert_remaining_and_reset(a, state, now, remaining, reset_ns);
            if cost > a.limit() {
                assert_eq!(wait_ns, u64::MAX);
            } else if let Some(at) = now.checked_add(wait_ns) {
                assert!(wait_ns > 0);
                assert!(!admits(a, state, at - 1, cost), "admitted before {wait_ns}");
                assert!(admits(a, state, at, cost), "denied after {wait_ns}");
            }
        }
    }

    let fresh = A::State::default();
    if a.is_idle(state, now) {
        for c in [0, 1, cost, a.limit()] {
            assert_eq!(a.check(state, now, c), a.check(&fresh, now, c));
        }
    } else {
        assert!(!admits(a, state, now, a.limit()), "not idle, yet full");
    }

    let mut bytes = Vec::new();
    A::encode(state, &mut bytes);
    let len = bytes.len();
    bytes.push(0xA5); // decode reports what it consumed, not the rest
    assert_eq!(A::decode(&bytes), Some((state.clone(), len)));
    for cut in 0..len {
        assert_eq!(A::decode(&bytes[..cut]), None, "truncated at {cut}");
    }
}

/// Feeds `decode` random and mutated bytes: it must never panic, and what it
/// accepts must re-encode to exactly the bytes it consumed.
pub(crate) fn fuzz_decode<A: Algo>(rng: &mut XorShift, valid: &[A::State]) {
    let mut inputs: Vec<Vec<u8>> = Vec::new();
    for state in valid {
        let mut bytes = Vec::new();
        A::encode(state, &mut bytes);
        inputs.push(bytes);
    }
    for _ in 0..3000 {
        let mut bytes = if inputs.is_empty() || rng.below(2) == 0 {
            (0..rng.below(40)).map(|_| rng.next() as u8).collect()
        } else {
            inputs[rng.below(inputs.len() as u64) as usize].clone()
        };
        if !bytes.is_empty() {
            let i = rng.below(bytes.len() as u64) as usize;
            bytes[i] ^= 1 << rng.below(8);
        }
        if let Some((state, used)) = A::decode(&bytes) {
            let mut again = Vec::new();
            A::encode(&state, &mut again);
            assert_eq!(again[..], bytes[..used]);
        }
    }
}

/// Simulated traffic: bursts, steady trickles, idle gaps, arrivals placed
/// just before and on window boundaries, and (if `back_steps`) a wall clock
/// that sometimes steps backwards. Checks [`assert_contract`] before each
/// request, calls `observe(now, cost, admitted)` after it, and returns the
/// admissions as `(real time, cost)`: with backward steps the clock the
/// algorithm sees runs behind real time, never ahead.
pub(crate) fn simulate<A: Algo>(
    a: &A,
    rng: &mut XorShift,
    window_ns: u64,
    steps: usize,
    back_steps: bool,
    mut observe: impl FnMut(u64, u64, bool),
) -> Vec<(u64, u64)> {
    let limit = a.limit();
    let mut state = A::State::default();
    let (mut real, mut behind) = (0u64, 0u64);
    let mut admitted = Vec::new();
    for _ in 0..steps {
        let clock = T0 + real - behind;
        let to_boundary = window_ns - clock % window_ns;
        real += match rng.below(16) {
            0 => rng.below(3 * window_ns) + 1,
            1 => to_boundary - 1,
            2 => to_boundary,
            3 => to_boundary + window_ns.saturating_sub(2),
            4..=6 => 0,
            7 if back_steps => {
                behind += rng.below(2 * window_ns) + 1;
                0
            }
            _ => rng.below(2 * window_ns / limit.min(window_ns) + 1),
        };
        let now = T0 + real - behind;
        let cost = match rng.below(20) {
            0 => rng.below(limit + 2),
            1 => 0,
            2..=4 => rng.below(limit.min(4)) + 1,
            _ => 1,
        };
        assert_contract(a, &state, now, cost);
        let admit = match a.check(&state, now, cost) {
            Verdict::Admit { state: new, .. } => {
                state = new;
                admitted.push((real, cost));
                true
            }
            Verdict::Deny { .. } => false,
        };
        observe(now, cost, admit);
    }
    admitted
}

/// The largest admitted total over any rolling window `(t − w, t]`, given
/// admissions `(t, cost)` in non-decreasing time order.
pub(crate) fn max_rolling(admitted: &[(u64, u64)], w: u64) -> u64 {
    let (mut start, mut sum, mut max) = (0, 0u64, 0u64);
    for &(t, cost) in admitted {
        sum += cost;
        while admitted[start].0 + w <= t {
            sum -= admitted[start].1;
            start += 1;
        }
        max = max.max(sum);
    }
    max
}
