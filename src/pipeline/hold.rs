//! The one holder of paused requests: every request a worker holds instead
//! of answering, whatever it waits for, with one record per request
//! ([`Request`]: what answering or resuming it needs, read when it was
//! held), one index of held streams, one serve per tick and one
//! removal when a stream ends.
//!
//! A request waits for one of two things, each with its own order:
//! * **A rate limit's next token** (`on_limit: queue` on its class): the
//!   *rate lane*, FIFO over the worker (bounded per class by `max_queue`).
//!   It is served in arrival order on every tick: the oldest waiting
//!   request gets the first token that comes back. It is rejected (429) at
//!   the first tick from which it could not be retried before its
//!   deadline, or as soon as its limit's next admission would fall after
//!   its deadline; so it never waits longer than `max_wait` (up to the
//!   lateness of the host's timer). A request whose exact wait already
//!   exceeds `max_wait` is never held: it gets its 429 at once.
//! * **A slot of its dependency** (a `concurrency_limit` refusal at a level
//!   whose `queues.<level>.max_queue` is not 0): the *slot lanes*, one per
//!   dependency, ordered by criticality with aging and by tenant round
//!   robin within a level, never past `max_wait`, a full level dropping
//!   from its longest tenant line ([`crate::admission::queue`] states the
//!   rules and their bounds).
//!
//! Lanes are per worker: `max_queue` bounds each worker's lane, and the
//! order holds within a worker. A slot freed on another worker is seen at
//! this worker's next tick (10 ms).
//!
//! Pure: time is `now`; taking a slot or charging a limit is the caller's
//! closure.

use std::collections::VecDeque;

use hashbrown::HashMap;

use super::request::Request;
use super::StreamId;
use crate::admission::queue::{Attempt, Held, NotHeld, Offered, PriorityQueue, Served};
use crate::decision::Decision;
use crate::policy::admission::Criticality;
use crate::policy::OnLimit;

/// A request in the rate lane.
#[derive(Debug, Clone)]
struct RateWait {
    paused: Request,
    /// Answer by then (ns since the epoch).
    deadline: u64,
    /// When its limit could admit it, as last computed.
    next_try: u64,
}

/// Why a request was not held in the rate lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotQueued {
    /// The class rejects at once (`on_limit: reject`).
    NotQueueable,
    /// Its wait is longer than `max_wait`.
    WaitTooLong,
    /// `max_queue` requests of its class are already held on this worker.
    Full,
}

/// Which lane a held stream is in.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Lane {
    Rate,
    /// A dependency's slot lane (its shared-data key).
    Slot(String),
}

/// What serving the lanes did with one request.
#[derive(Debug)]
pub enum Released<A, R> {
    /// A slot lane's request got its slot (`A`: what the closure returned).
    Admitted(Held<Request>, A),
    /// A slot lane's request is refused for good (its breaker opened, or
    /// its dependency was paused): answer it now.
    Refused(Held<Request>, R),
    /// A slot lane's request would pass its deadline before the next tick.
    TimedOut(Held<Request>),
    /// A rate lane's request was charged: admitted if `Decision` does not
    /// deny, rejected otherwise.
    Charged(Request, Decision),
}

/// A worker's held requests.
#[derive(Debug, Default)]
pub struct Hold {
    rate: VecDeque<RateWait>,
    slots: HashMap<String, PriorityQueue<Request>>,
    /// Where each held stream is.
    lanes: HashMap<StreamId, Lane>,
}

impl Hold {
    /// Requests held, every lane.
    pub fn len(&self) -> usize {
        self.lanes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lanes.is_empty()
    }

    /// Holds a request denied by a rate limit if its class queues and it can
    /// be admitted within `max_wait`.
    pub fn offer_rate(&mut self, paused: Request, denial: &Decision, now: u64) -> Result<(), NotQueued> {
        let OnLimit::Queue {
            max_wait_ns,
            max_queue,
        } = paused.prepared.class.on_limit
        else {
            return Err(NotQueued::NotQueueable);
        };
        if denial.wait_ns > max_wait_ns {
            return Err(NotQueued::WaitTooLong);
        }
        let class = &paused.prepared.class.name;
        let held = self
            .rate
            .iter()
            .filter(|w| w.paused.prepared.class.name == *class)
            .count();
        if held >= max_queue as usize {
            return Err(NotQueued::Full);
        }
        self.lanes.insert(paused.stream, Lane::Rate);
        self.rate.push_back(RateWait {
            paused,
            deadline: now.saturating_add(max_wait_ns),
            next_try: now.saturating_add(denial.wait_ns),
        });
        Ok(())
    }

    /// Holds a request refused a slot of the dependency `key` at its level
    /// (see [`PriorityQueue::offer`]): a displaced request is taken out of
    /// the hold and returned, to be answered.
    pub fn offer_slot(
        &mut self,
        key: &str,
        held: Held<Request>,
        max_queue: u32,
    ) -> Result<Offered<Request>, NotHeld> {
        let stream = held.item.stream;
        let queue = match self.slots.get_mut(key) {
            Some(q) => q,
            None => self.slots.entry(key.to_owned()).or_default(),
        };
        let offered = queue.offer(held, max_queue)?;
        self.lanes.insert(stream, Lane::Slot(key.to_owned()));
        if let Offered::Displaced(dropped) = &offered {
            self.lanes.remove(&dropped.item.stream);
        }
        Ok(offered)
    }

    /// Forgets a held stream (it ended while it waited); `true` if it was
    /// in the rate lane (counted as cancelled there).
    pub fn remove(&mut self, stream: StreamId) -> Option<bool> {
        let lane = self.lanes.remove(&stream)?;
        match lane {
            Lane::Rate => {
                self.rate.retain(|w| w.paused.stream != stream);
                Some(true)
            }
            Lane::Slot(key) => {
                if let Some(q) = self.slots.get_mut(&key) {
                    q.remove(|p| p.stream == stream);
                }
                Some(false)
            }
        }
    }

    /// Whether a stream is held.
    pub fn holds(&self, stream: StreamId) -> bool {
        self.lanes.contains_key(&stream)
    }

    /// Requests held for a slot of the dependency `key`, and when the
    /// oldest of them was held.
    pub fn slot_lane(&self, key: &str) -> (usize, Option<u64>) {
        self.slots.get(key).map_or((0, None), |q| (q.len(), q.oldest()))
    }

    /// Serves every lane at `now` (the next tick comes `tick_ns` later):
    /// the slot lanes first (`admit` tries to take a request's slot), then
    /// the rate lane (`charge` checks and charges a request's limits).
    /// Returns what was answered or admitted, in that order.
    pub fn serve<A, R>(
        &mut self,
        now: u64,
        tick_ns: u64,
        mut admit: impl FnMut(&Held<Request>) -> Attempt<A, R>,
        mut charge: impl FnMut(&Request) -> Decision,
    ) -> Vec<Released<A, R>> {
        let mut out = Vec::new();
        for queue in self.slots.values_mut().filter(|q| !q.is_empty()) {
            for s in queue.serve(now, tick_ns, &mut admit) {
                out.push(match s {
                    Served::Admitted(h, a) => Released::Admitted(h, a),
                    Served::Refused(h, r) => Released::Refused(h, r),
                    Served::TimedOut(h) => Released::TimedOut(h),
                });
            }
        }
        let mut still = VecDeque::with_capacity(self.rate.len());
        while let Some(mut w) = self.rate.pop_front() {
            // The last tick that can still answer it in time.
            let last_chance = now.saturating_add(tick_ns) > w.deadline;
            if w.next_try > now && !last_chance {
                still.push_back(w);
                continue;
            }
            let decision = charge(&w.paused);
            let retry_at = now.saturating_add(decision.wait_ns);
            if decision.deny_status().is_none() || last_chance || retry_at > w.deadline {
                out.push(Released::Charged(w.paused, decision));
            } else {
                w.next_try = retry_at;
                still.push_back(w);
            }
        }
        self.rate = still;
        for r in &out {
            let stream = match r {
                Released::Admitted(h, _) | Released::Refused(h, _) | Released::TimedOut(h) => h.item.stream,
                Released::Charged(p, _) => p.stream,
            };
            self.lanes.remove(&stream);
        }
        out
    }

    /// The held requests of every slot lane's level, for the gauges.
    pub fn level_len(&self, key: &str, level: Criticality) -> usize {
        self.slots.get(key).map_or(0, |q| q.len_at(level))
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;
    use crate::decision::Reason;
    use crate::engine;
    use crate::engine::Prepared;
    use crate::memory::{MemoryHost, SharedStore};
    use crate::policy::Policy;

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

    fn paused(stream: StreamId, policy: &Rc<Policy>, prepared: &Prepared) -> Request {
        Request {
            stream,
            policy: policy.clone(),
            prepared: prepared.clone(),
            primary: false,
            request_id: None,
            read: None,
        }
    }

    fn no_slots(_: &Held<Request>) -> Attempt<(), ()> {
        Attempt::LevelFull
    }

    #[test]
    fn held_requests_are_admitted_in_order_as_tokens_return_and_never_late() {
        let p = policy();
        let store = SharedStore::new();
        let host = MemoryHost::new(store.clone())
            .route_class("jobs")
            .header("x-tenant-id", "acme");
        let prepared = engine::prepare(&p, &host).unwrap();
        let mut hold = Hold::default();
        let charge = |now| engine::charge(&p, &prepared, &host, now, &mut engine::Scratch::default());

        assert_eq!(charge(T0).reason, Reason::Allowed); // the burst of 1
        for id in 1..=4 {
            let denial = charge(T0);
            assert_eq!(denial.reason, Reason::RateLimited);
            let offered = hold.offer_rate(paused(id, &p, &prepared), &denial, T0);
            if id <= 3 {
                assert_eq!(offered, Ok(()));
            } else {
                assert_eq!(offered, Err(NotQueued::Full)); // max_queue 3
            }
        }
        assert_eq!(hold.len(), 3);
        // Tokens come back every 100 ms: one request each, oldest first.
        let mut answers = Vec::new();
        let mut now = T0;
        while !hold.is_empty() {
            now += TICK;
            let served = hold.serve(now, TICK, no_slots, |w| {
                engine::charge(
                    &w.policy,
                    &w.prepared,
                    &host,
                    now,
                    &mut engine::Scratch::default(),
                )
            });
            for r in served {
                let Released::Charged(w, d) = r else {
                    panic!("a slot lane served")
                };
                assert!(now <= T0 + 250 * MS, "answered late");
                answers.push((w.stream, d.reason, now - T0));
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
    fn waits_beyond_max_wait_and_rejecting_classes_are_not_held() {
        let p = policy();
        let store = SharedStore::new();
        let jobs = MemoryHost::new(store.clone())
            .route_class("jobs")
            .header("x-tenant-id", "acme");
        let prepared = engine::prepare(&p, &jobs).unwrap();
        let mut hold = Hold::default();
        let mut denial = engine::charge(&p, &prepared, &jobs, T0, &mut engine::Scratch::default());
        denial.wait_ns = 300 * MS;
        assert_eq!(
            hold.offer_rate(paused(1, &p, &prepared), &denial, T0),
            Err(NotQueued::WaitTooLong)
        );
        let api = MemoryHost::new(store)
            .route_class("api")
            .header("x-tenant-id", "acme");
        let prepared = engine::prepare(&p, &api).unwrap();
        assert_eq!(
            hold.offer_rate(paused(2, &p, &prepared), &denial, T0),
            Err(NotQueued::NotQueueable)
        );
        assert!(hold.is_empty());
    }

    #[test]
    fn a_cancelled_request_leaves_its_lane_whichever_it_is() {
        let p = policy();
        let store = SharedStore::new();
        let jobs = MemoryHost::new(store)
            .route_class("jobs")
            .header("x-tenant-id", "acme");
        let prepared = engine::prepare(&p, &jobs).unwrap();
        let mut hold = Hold::default();
        let mut denial = engine::charge(&p, &prepared, &jobs, T0, &mut engine::Scratch::default());
        denial.wait_ns = MS;
        hold.offer_rate(paused(7, &p, &prepared), &denial, T0).unwrap();
        let slot = Held {
            item: paused(8, &p, &prepared),
            level: Criticality::Normal,
            tenant: 1,
            enqueued: T0,
            deadline: T0 + 100 * MS,
        };
        assert!(matches!(hold.offer_slot("tg2|d|db", slot, 4), Ok(Offered::Held)));
        assert_eq!(hold.slot_lane("tg2|d|db"), (1, Some(T0)));
        assert_eq!(hold.remove(7), Some(true));
        assert_eq!(hold.remove(8), Some(false));
        assert_eq!(hold.remove(7), None);
        assert!(hold.is_empty());
        let served = hold.serve(T0 + TICK, TICK, no_slots, |_| panic!("nothing to serve"));
        assert!(served.is_empty());
    }
}
