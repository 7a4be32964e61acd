//! Queue instead of reject (`on_limit: queue`): requests of a class that
//! can wait are held, paused, until their limit admits them or their
//! `max_wait` runs out.
//!
//! The queue is per worker (each worker VM holds its own) and bounded per
//! route class (`max_queue`). It is served in arrival order on every tick of
//! the root context: the oldest waiting request gets the first token that
//! comes back. A request is answered by its deadline. It is rejected (429)
//! at the first tick from which it could not be retried before its
//! deadline, or as soon as its limit's next admission would fall after its
//! deadline; so it never waits longer than `max_wait` (up to the lateness of
//! the host's timer). A request whose exact wait already exceeds `max_wait`
//! is never queued: it gets its 429 at once.
//!
//! Pure: time comes in as `now`, charging is a callback.

use std::collections::VecDeque;
use std::rc::Rc;

use crate::engine::{Decision, Prepared};
use crate::policy::{OnLimit, Policy};

/// One held request.
#[derive(Debug, Clone)]
pub struct Waiting {
    /// The host's id of the paused stream.
    pub context_id: u32,
    pub policy: Rc<Policy>,
    pub prepared: Prepared,
    /// Answer by then (ns since the epoch).
    pub deadline: u64,
    /// When its limit could admit it, as last computed.
    pub next_try: u64,
}

/// Why a request was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotQueued {
    /// The class rejects at once (`on_limit: reject`).
    NotQueueable,
    /// Its wait is longer than `max_wait`.
    WaitTooLong,
    /// `max_queue` requests of its class are already held on this worker.
    Full,
}

#[derive(Debug, Default)]
pub struct Queue {
    waiting: VecDeque<Waiting>,
}

impl Queue {
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Holds a denied request if its class queues and it can be admitted
    /// within `max_wait`.
    pub fn offer(
        &mut self,
        context_id: u32,
        policy: &Rc<Policy>,
        prepared: &Prepared,
        denial: &Decision,
        now: u64,
    ) -> Result<(), NotQueued> {
        let OnLimit::Queue {
            max_wait_ns,
            max_queue,
        } = prepared.class.on_limit
        else {
            return Err(NotQueued::NotQueueable);
        };
        if denial.wait_ns > max_wait_ns {
            return Err(NotQueued::WaitTooLong);
        }
        let held = self
            .waiting
            .iter()
            .filter(|w| w.prepared.class.name == prepared.class.name)
            .count();
        if held >= max_queue as usize {
            return Err(NotQueued::Full);
        }
        self.waiting.push_back(Waiting {
            context_id,
            policy: policy.clone(),
            prepared: prepared.clone(),
            deadline: now.saturating_add(max_wait_ns),
            next_try: now.saturating_add(denial.wait_ns),
        });
        Ok(())
    }

    /// Forgets a request (its stream ended while it waited).
    pub fn remove(&mut self, context_id: u32) -> bool {
        let before = self.waiting.len();
        self.waiting.retain(|w| w.context_id != context_id);
        before != self.waiting.len()
    }

    /// Serves the queue at `now`; the next tick comes `tick_ns` later.
    /// `charge` checks and charges one request. Returns the requests that
    /// are answered now, oldest first: admitted if the decision does not
    /// deny, rejected otherwise.
    pub fn tick(
        &mut self,
        now: u64,
        tick_ns: u64,
        mut charge: impl FnMut(&Waiting) -> Decision,
    ) -> Vec<(Waiting, Decision)> {
        let mut answered = Vec::new();
        let mut still = VecDeque::with_capacity(self.waiting.len());
        while let Some(mut w) = self.waiting.pop_front() {
            // The last tick that can still answer it in time.
            let last_chance = now.saturating_add(tick_ns) > w.deadline;
            if w.next_try > now && !last_chance {
                still.push_back(w);
                continue;
            }
            let decision = charge(&w);
            let retry_at = now.saturating_add(decision.wait_ns);
            if decision.deny_status().is_none() || last_chance || retry_at > w.deadline {
                answered.push((w, decision));
            } else {
                w.next_try = retry_at;
                still.push_back(w);
            }
        }
        self.waiting = still;
        answered
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{self, Reason};
    use crate::memory::{MemoryHost, SharedStore};

    const MS: u64 = 1_000_000;
    const T0: u64 = 1_796_000_000_000_000_000;
    const TICK: u64 = 10 * MS;

    fn policy() -> Rc<Policy> {
        Rc::new(
            Policy::from_json(
                br#"{"version":"q","identity":{"header":"x-tenant-id"},
                "plans":{"free":{"limits":[{"rate":10,"per":"1s","burst":1}]}},
                "default_plan":"free","anonymous":{"plan":"free"},
                "routes":{"jobs":{"on_limit":"queue","max_wait":"250ms","max_queue":3},"api":{}}}"#,
            )
            .unwrap(),
        )
    }

    #[test]
    fn held_requests_are_admitted_in_order_as_tokens_return_and_never_late() {
        let p = policy();
        let store = SharedStore::new();
        let host = MemoryHost::new(store.clone())
            .route_class("jobs")
            .header("x-tenant-id", "acme");
        let prepared = engine::prepare(&p, &host).unwrap();
        let mut q = Queue::default();
        let charge = |now| engine::charge(&p, &prepared, &host, now, &mut engine::Scratch::default());

        assert_eq!(charge(T0).reason, Reason::Allowed); // the burst of 1
        for id in 1..=4 {
            let denial = charge(T0);
            assert_eq!(denial.reason, Reason::RateLimited);
            let offered = q.offer(id, &p, &prepared, &denial, T0);
            if id <= 3 {
                assert_eq!(offered, Ok(()));
            } else {
                assert_eq!(offered, Err(NotQueued::Full)); // max_queue 3
            }
        }
        // Tokens come back every 100 ms: one request each, oldest first.
        let mut answers = Vec::new();
        let mut now = T0;
        while !q.is_empty() {
            now += TICK;
            for (w, d) in q.tick(now, TICK, |w| {
                engine::charge(
                    &w.policy,
                    &w.prepared,
                    &host,
                    now,
                    &mut engine::Scratch::default(),
                )
            }) {
                assert!(now <= w.deadline, "answered late");
                answers.push((w.context_id, d.reason, now - T0));
            }
        }
        assert_eq!(
            answers,
            [
                (1, Reason::Allowed, 100 * MS),
                (2, Reason::Allowed, 200 * MS),
                // The third could only be admitted at 300 ms, after its
                // 250 ms deadline: rejected as soon as that is known.
                (3, Reason::RateLimited, 200 * MS),
            ]
        );
    }

    #[test]
    fn waits_beyond_max_wait_and_rejecting_classes_are_not_queued() {
        let p = policy();
        let store = SharedStore::new();
        let jobs = MemoryHost::new(store.clone())
            .route_class("jobs")
            .header("x-tenant-id", "acme");
        let prepared = engine::prepare(&p, &jobs).unwrap();
        let mut q = Queue::default();
        let mut denial = engine::charge(&p, &prepared, &jobs, T0, &mut engine::Scratch::default());
        denial.wait_ns = 300 * MS;
        assert_eq!(
            q.offer(1, &p, &prepared, &denial, T0),
            Err(NotQueued::WaitTooLong)
        );
        let api = MemoryHost::new(store)
            .route_class("api")
            .header("x-tenant-id", "acme");
        let prepared = engine::prepare(&p, &api).unwrap();
        assert_eq!(
            q.offer(2, &p, &prepared, &denial, T0),
            Err(NotQueued::NotQueueable)
        );
        assert!(q.is_empty());
    }

    #[test]
    fn a_cancelled_request_leaves_the_queue() {
        let p = policy();
        let store = SharedStore::new();
        let jobs = MemoryHost::new(store)
            .route_class("jobs")
            .header("x-tenant-id", "acme");
        let prepared = engine::prepare(&p, &jobs).unwrap();
        let mut q = Queue::default();
        let mut denial = engine::charge(&p, &prepared, &jobs, T0, &mut engine::Scratch::default());
        denial.wait_ns = MS;
        q.offer(7, &p, &prepared, &denial, T0).unwrap();
        assert!(q.remove(7));
        assert!(!q.remove(7));
        assert!(q.tick(T0 + TICK, TICK, |_| panic!("nothing to serve")).is_empty());
    }
}
