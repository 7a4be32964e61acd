//! Bounded priority queues of requests waiting for a dependency's slot
//! (`dependencies.<name>.queues.<level>`), per worker VM.
//!
//! A request refused with `concurrency_limit` whose level has a queue
//! (`max_queue` > 0) is paused and held here instead of answered. On every
//! tick of its worker the queue is served:
//! * **Deadlines first.** A request that would pass its deadline
//!   (`enqueued + max_wait`) before the next tick is answered now with 503
//!   `queue_timeout`: **no request ever waits longer than its `max_wait`**
//!   (up to the lateness of the host's timer). A full level (`max_queue`
//!   held on this worker) refuses at once with `queue_full`.
//! * **Order by criticality, with aging.** Of the levels with waiting
//!   requests, the one whose oldest request has the highest
//!   `level + waited / AGING_STEP_NS` is tried first (ties: the higher
//!   level), then the next: so critical work goes first, and a request
//!   whose oldest wait exceeds another level's by more than
//!   [`AGING_STEP_NS`] (500 ms) per level between them is tried before it.
//!   A sheddable request is thus never starved by a stream of newer
//!   normal work while there is capacity for it; it still only takes a slot
//!   its level's share of the pool allows (the admission check is the
//!   request's own).
//! * **Per-tenant fairness within a level**: round robin over the tenants
//!   waiting there (deficit round robin with unit costs), one request per
//!   turn. A tenant's flood waits behind its own requests: a quiet tenant's
//!   request is served within (tenants waiting at its level) turns of that
//!   level, whatever the flood's size. A tenant that cannot take a slot
//!   now (it holds its `tenant_max_share`) loses its turn, never blocks
//!   the tenants behind it ([`Attempt::TenantFull`]).
//! * **A full level drops from the longest line.** When `max_queue`
//!   requests of a level are held and a tenant with fewer held there than
//!   the longest line arrives, the newest request of the longest line is
//!   dropped (503 `queue_full`, counted as a fair-queue drop of its
//!   tenant's bucket) and the newcomer is held: a flood cannot fill the
//!   queue and keep a quiet tenant out of it. A newcomer whose own line
//!   is (one of) the longest is refused at once.
//!
//! **Wake-up latency**: a slot freed on any worker is seen by every other
//! worker at its next tick (10 ms): shared data is read, not signalled.
//! New requests try for a slot before queueing, so a queued request may be
//! overtaken by a new one that arrives just as a slot frees.
//!
//! Pure: time is `now`; taking a slot is the caller's closure.

use std::collections::VecDeque;

use crate::limiter::NANOS_PER_SEC;
use crate::policy::admission::Criticality;

/// Waiting this long counts as one level more when choosing what to try.
pub const AGING_STEP_NS: u64 = NANOS_PER_SEC / 2;

/// One held request; `T` is what the caller needs to resume it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held<T> {
    pub item: T,
    pub level: Criticality,
    /// The tenant's (or address group's) hash: the fairness key.
    pub tenant: u64,
    pub enqueued: u64,
    pub deadline: u64,
}

/// What a try to take a slot for a held request gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt<A, R = ()> {
    /// It got its slot.
    Admitted(A),
    /// It is refused for good (its dependency's breaker opened, or the
    /// dependency was paused): answer it now; the next request of the level
    /// is tried.
    Refused(R),
    /// No slot for its level: the level is not tried further this tick.
    LevelFull,
    /// Its tenant cannot take a slot now (`tenant_share`): the tenant
    /// loses its turn and the next tenant of the level is tried.
    TenantFull,
}

/// What holding a request did.
#[derive(Debug, PartialEq, Eq)]
pub enum Offered<T> {
    Held,
    /// Held, and this request of the longest tenant line was dropped to
    /// make room (answer it 503 `queue_full`).
    Displaced(Held<T>),
}

/// Why a request was not held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotHeld {
    /// The level has no queue (`max_queue` 0).
    NoQueue,
    /// `max_queue` requests of the level are held on this worker.
    Full,
}

#[derive(Debug)]
struct TenantLine<T> {
    tenant: u64,
    items: VecDeque<Held<T>>,
}

/// One level: tenants in round-robin order.
#[derive(Debug)]
struct Level<T> {
    lines: VecDeque<TenantLine<T>>,
    len: usize,
}

impl<T> Default for Level<T> {
    fn default() -> Self {
        Level {
            lines: VecDeque::new(),
            len: 0,
        }
    }
}

impl<T> Level<T> {
    fn oldest(&self) -> Option<u64> {
        self.lines
            .iter()
            .filter_map(|l| l.items.front())
            .map(|h| h.enqueued)
            .min()
    }

    /// The next request in round-robin order (not removed).
    fn next(&self) -> Option<&Held<T>> {
        self.lines.front().and_then(|l| l.items.front())
    }

    /// Removes the next request and moves its tenant to the back.
    fn pop(&mut self) -> Option<Held<T>> {
        let mut line = self.lines.pop_front()?;
        let held = line.items.pop_front();
        if !line.items.is_empty() {
            self.lines.push_back(line);
        }
        if held.is_some() {
            self.len = self.len.saturating_sub(1);
        }
        held
    }

    /// Moves the front tenant to the back (it loses its turn).
    fn skip(&mut self) {
        if let Some(line) = self.lines.pop_front() {
            self.lines.push_back(line);
        }
    }

    fn line_len(&self, tenant: u64) -> usize {
        self.lines
            .iter()
            .find(|l| l.tenant == tenant)
            .map_or(0, |l| l.items.len())
    }

    /// Removes the newest request of the longest line if that line is
    /// longer than `than` (ties: the line nearest the back).
    fn drop_longest(&mut self, than: usize) -> Option<Held<T>> {
        let (i, _) = self
            .lines
            .iter()
            .enumerate()
            .max_by_key(|(i, l)| (l.items.len(), *i))
            .filter(|(_, l)| l.items.len() > than)?;
        let line = self.lines.get_mut(i)?;
        let dropped = line.items.pop_back();
        if line.items.is_empty() {
            self.lines.remove(i);
        }
        if dropped.is_some() {
            self.len = self.len.saturating_sub(1);
        }
        dropped
    }

    fn push(&mut self, held: Held<T>) {
        self.len = self.len.saturating_add(1);
        match self.lines.iter_mut().find(|l| l.tenant == held.tenant) {
            Some(line) => line.items.push_back(held),
            None => self.lines.push_back(TenantLine {
                tenant: held.tenant,
                items: VecDeque::from([held]),
            }),
        }
    }

    /// Removes (and returns) every request matching `f`.
    fn take_where(&mut self, mut f: impl FnMut(&Held<T>) -> bool) -> Vec<Held<T>> {
        let mut out = Vec::new();
        for line in &mut self.lines {
            let mut kept = VecDeque::with_capacity(line.items.len());
            while let Some(h) = line.items.pop_front() {
                if f(&h) {
                    out.push(h);
                } else {
                    kept.push_back(h);
                }
            }
            line.items = kept;
        }
        self.lines.retain(|l| !l.items.is_empty());
        self.len = self.len.saturating_sub(out.len());
        out
    }
}

/// One dependency's queues on this worker, by level.
#[derive(Debug)]
pub struct PriorityQueue<T> {
    levels: [Level<T>; 4],
}

impl<T> Default for PriorityQueue<T> {
    fn default() -> Self {
        PriorityQueue {
            levels: Default::default(),
        }
    }
}

/// What serving the queue did with one request.
#[derive(Debug, PartialEq, Eq)]
pub enum Served<T, A, R = ()> {
    /// It got its slot (`A`: what the closure returned).
    Admitted(Held<T>, A),
    /// Refused for good (`R`: what the closure returned): answer it now.
    Refused(Held<T>, R),
    /// Its deadline would pass before the next tick: 503 `queue_timeout`.
    TimedOut(Held<T>),
}

impl<T> PriorityQueue<T> {
    pub fn len(&self) -> usize {
        self.levels.iter().map(|l| l.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Requests held at one level.
    pub fn len_at(&self, level: Criticality) -> usize {
        self.levels.get(level.index()).map_or(0, |l| l.len)
    }

    /// Holds a request if its level has room (`max_queue` per worker), or
    /// if a longer tenant line gives up its newest request (see the
    /// module header).
    pub fn offer(&mut self, held: Held<T>, max_queue: u32) -> Result<Offered<T>, NotHeld> {
        if max_queue == 0 {
            return Err(NotHeld::NoQueue);
        }
        let Some(level) = self.levels.get_mut(held.level.index()) else {
            return Err(NotHeld::NoQueue);
        };
        let mut offered = Offered::Held;
        if level.len >= max_queue as usize {
            let own = level.line_len(held.tenant);
            match level.drop_longest(own.saturating_add(1)) {
                Some(dropped) => offered = Offered::Displaced(dropped),
                None => return Err(NotHeld::Full),
            }
        }
        level.push(held);
        Ok(offered)
    }

    /// The enqueue time of the oldest request held, at any level.
    pub fn oldest(&self) -> Option<u64> {
        self.levels.iter().filter_map(Level::oldest).min()
    }

    /// Forgets the requests matching `f` (their streams ended).
    pub fn remove(&mut self, mut f: impl FnMut(&T) -> bool) -> usize {
        self.levels
            .iter_mut()
            .map(|l| l.take_where(|h| f(&h.item)).len())
            .sum()
    }

    /// The order in which levels are tried at `now` (see the header).
    fn order(&self, now: u64) -> Vec<usize> {
        let mut ranked: Vec<(u64, usize)> = self
            .levels
            .iter()
            .enumerate()
            .filter_map(|(i, l)| {
                let waited = now.saturating_sub(l.oldest()?);
                Some(((i as u64).saturating_add(waited / AGING_STEP_NS), i))
            })
            .collect();
        ranked.sort_by(|a, b| b.cmp(a));
        ranked.into_iter().map(|(_, i)| i).collect()
    }

    /// Serves the queue at `now`; the next tick comes `tick_ns` later.
    /// `admit` tries to take a slot for a request ([`Attempt`]). Each
    /// level is tried in order until no slot is left for it or every
    /// tenant waiting there lost its turn; at most [`PriorityQueue::len`]
    /// admissions and as many skips.
    pub fn serve<A, R>(
        &mut self,
        now: u64,
        tick_ns: u64,
        mut admit: impl FnMut(&Held<T>) -> Attempt<A, R>,
    ) -> Vec<Served<T, A, R>> {
        let next_tick = now.saturating_add(tick_ns);
        let mut served: Vec<Served<T, A, R>> = self
            .levels
            .iter_mut()
            .flat_map(|l| l.take_where(|h| h.deadline < next_tick))
            .map(Served::TimedOut)
            .collect();
        for i in self.order(now) {
            let Some(level) = self.levels.get_mut(i) else {
                continue;
            };
            // Tenants that lost their turn in a row: all of them stops it.
            let mut skipped = 0usize;
            while let Some(next) = level.next() {
                if skipped >= level.lines.len() {
                    break;
                }
                match admit(next) {
                    Attempt::Admitted(a) => {
                        skipped = 0;
                        if let Some(h) = level.pop() {
                            served.push(Served::Admitted(h, a));
                        }
                    }
                    Attempt::Refused(r) => {
                        skipped = 0;
                        if let Some(h) = level.pop() {
                            served.push(Served::Refused(h, r));
                        }
                    }
                    Attempt::LevelFull => break,
                    Attempt::TenantFull => {
                        skipped = skipped.saturating_add(1);
                        level.skip();
                    }
                }
            }
        }
        served
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const T0: u64 = 1_796_000_000 * NANOS_PER_SEC;
    const TICK: u64 = 10 * MS;

    fn held(id: u32, level: Criticality, tenant: u64, at: u64, max_wait: u64) -> Held<u32> {
        Held {
            item: id,
            level,
            tenant,
            enqueued: at,
            deadline: at + max_wait,
        }
    }

    /// Serves with `free` slots: admits while any are left.
    fn serve_with(q: &mut PriorityQueue<u32>, now: u64, free: &mut u32) -> (Vec<u32>, Vec<u32>) {
        let (mut admitted, mut timed_out) = (Vec::new(), Vec::new());
        for s in q.serve(now, TICK, |_| {
            if *free > 0 {
                *free -= 1;
                Attempt::<(), ()>::Admitted(())
            } else {
                Attempt::LevelFull
            }
        }) {
            match s {
                Served::Admitted(h, ()) => admitted.push(h.item),
                Served::TimedOut(h) => timed_out.push(h.item),
                Served::Refused(h, ()) => panic!("{} refused", h.item),
            }
        }
        (admitted, timed_out)
    }

    #[test]
    fn a_request_refused_for_good_leaves_the_queue_and_the_next_is_tried() {
        let mut q = PriorityQueue::default();
        for id in 1..=4 {
            q.offer(held(id, Criticality::Normal, u64::from(id), T0, 10_000 * MS), 10)
                .unwrap();
        }
        // Its breaker opened: every held request is answered at once, in
        // one tick, none kept until its max_wait.
        let served = q.serve(T0 + TICK, TICK, |h| Attempt::<(), u32>::Refused(h.item * 10));
        let refused: Vec<(u32, u32)> = served
            .into_iter()
            .map(|s| match s {
                Served::Refused(h, r) => (h.item, r),
                _ => panic!("not refused"),
            })
            .collect();
        assert_eq!(refused, [(1, 10), (2, 20), (3, 30), (4, 40)]);
        assert!(q.is_empty());
    }

    #[test]
    fn critical_goes_first_then_normal_then_sheddable() {
        let mut q = PriorityQueue::default();
        for (id, level) in [
            (1, Criticality::Sheddable),
            (2, Criticality::Normal),
            (3, Criticality::Critical),
            (4, Criticality::Normal),
            (5, Criticality::System),
        ] {
            q.offer(held(id, level, 7, T0, 10_000 * MS), 10).unwrap();
        }
        let mut order = Vec::new();
        let mut now = T0;
        while !q.is_empty() {
            now += TICK;
            let mut free = 1;
            order.extend(serve_with(&mut q, now, &mut free).0);
        }
        assert_eq!(order, [5, 3, 2, 4, 1]);
    }

    #[test]
    fn a_quiet_tenant_waits_behind_its_own_requests_not_the_flood() {
        let mut q = PriorityQueue::default();
        // The flood queued 50 first, then the quiet tenant 2.
        for id in 0..50 {
            q.offer(held(id, Criticality::Normal, 1, T0, 10_000 * MS), 100)
                .unwrap();
        }
        for id in 100..102 {
            q.offer(held(id, Criticality::Normal, 2, T0 + MS, 10_000 * MS), 100)
                .unwrap();
        }
        let mut order = Vec::new();
        let mut now = T0;
        while order.len() < 52 {
            now += TICK;
            let mut free = 1;
            order.extend(serve_with(&mut q, now, &mut free).0);
        }
        // Two tenants waiting: the quiet one is served every second turn.
        let quiet: Vec<usize> = order
            .iter()
            .enumerate()
            .filter(|(_, id)| **id >= 100)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(quiet, [1, 3], "{order:?}");
    }

    #[test]
    fn aging_serves_an_old_sheddable_request_before_newer_normal_work() {
        let mut q = PriorityQueue::default();
        q.offer(held(1, Criticality::Sheddable, 1, T0, 30_000 * MS), 10)
            .unwrap();
        // Normal work keeps arriving and taking every free slot...
        let mut now = T0;
        let mut next = 100;
        let mut served_at = None;
        while served_at.is_none() {
            now += TICK;
            q.offer(held(next, Criticality::Normal, 2, now, 30_000 * MS), 10_000)
                .unwrap();
            next += 1;
            let mut free = 1;
            if serve_with(&mut q, now, &mut free).0.contains(&1) {
                served_at = Some(now - T0);
            }
            assert!(now < T0 + 30_000 * MS, "starved");
        }
        // ...until the sheddable request has waited more than one aging
        // step per level between them (sheddable → normal: one step, and
        // the normal line is as old as the flood's oldest).
        let waited = served_at.unwrap();
        assert!(
            waited > AGING_STEP_NS && waited <= 2 * AGING_STEP_NS + TICK,
            "{waited}"
        );
    }

    #[test]
    fn nobody_waits_past_max_wait_and_a_full_level_refuses_at_once() {
        let mut q = PriorityQueue::default();
        for id in 0..3 {
            q.offer(
                held(
                    id,
                    Criticality::Normal,
                    id.into(),
                    T0 + u64::from(id) * 7 * MS,
                    95 * MS,
                ),
                3,
            )
            .unwrap();
        }
        assert_eq!(
            q.offer(held(9, Criticality::Normal, 9, T0, 95 * MS), 3),
            Err(NotHeld::Full)
        );
        assert_eq!(
            q.offer(held(9, Criticality::Critical, 9, T0, 95 * MS), 0),
            Err(NotHeld::NoQueue)
        );
        let mut now = T0;
        let mut answered = Vec::new();
        while !q.is_empty() {
            now += TICK;
            let mut free = 0;
            for id in serve_with(&mut q, now, &mut free).1 {
                let deadline = T0 + u64::from(id) * 7 * MS + 95 * MS;
                assert!(now <= deadline, "request {id} answered after its deadline");
                assert!(now + TICK > deadline, "request {id} answered too early");
                answered.push(id);
            }
        }
        assert_eq!(answered, [0, 1, 2]);
    }

    #[test]
    fn a_tenant_at_its_share_loses_its_turn_and_blocks_nobody() {
        let mut q = PriorityQueue::default();
        // The flood (tenant 1) is first in line; the quiet tenant behind it.
        for id in 0..5 {
            q.offer(held(id, Criticality::Sheddable, 1, T0, 10_000 * MS), 100)
                .unwrap();
        }
        q.offer(held(100, Criticality::Sheddable, 2, T0 + MS, 10_000 * MS), 100)
            .unwrap();
        let mut admitted = Vec::new();
        let served = q.serve(T0 + TICK, TICK, |h| {
            if h.tenant == 1 {
                Attempt::<(), ()>::TenantFull
            } else {
                Attempt::Admitted(())
            }
        });
        for s in served {
            if let Served::Admitted(h, ()) = s {
                admitted.push(h.item);
            }
        }
        assert_eq!(admitted, [100]);
        assert_eq!(q.len(), 5);
        // Every tenant at its share: the level stops after one try each.
        let mut tries = 0;
        assert!(q
            .serve(T0 + 2 * TICK, TICK, |_| {
                tries += 1;
                Attempt::<()>::TenantFull
            })
            .is_empty());
        assert_eq!(tries, 1);
    }

    #[test]
    fn a_flood_cannot_fill_the_queue_and_keep_a_quiet_tenant_out() {
        let mut q = PriorityQueue::default();
        for id in 0..4 {
            assert_eq!(
                q.offer(held(id, Criticality::Sheddable, 1, T0, 10_000 * MS), 4),
                Ok(Offered::Held)
            );
        }
        // The flood's own next request is refused at once...
        assert_eq!(
            q.offer(held(4, Criticality::Sheddable, 1, T0, 10_000 * MS), 4),
            Err(NotHeld::Full)
        );
        // ...a quiet tenant's is held, and the flood's newest dropped.
        match q.offer(held(100, Criticality::Sheddable, 2, T0, 10_000 * MS), 4) {
            Ok(Offered::Displaced(d)) => assert_eq!((d.item, d.tenant), (3, 1)),
            other => panic!("{other:?}"),
        }
        assert_eq!(q.len(), 4);
        // Two lines of 3 and 1: the quiet tenant may hold one more (the
        // flood's line stays the longer), then lines are even: refused.
        assert!(matches!(
            q.offer(held(101, Criticality::Sheddable, 2, T0, 10_000 * MS), 4),
            Ok(Offered::Displaced(_))
        ));
        assert_eq!(
            q.offer(held(102, Criticality::Sheddable, 2, T0, 10_000 * MS), 4),
            Err(NotHeld::Full)
        );
        assert_eq!(q.oldest(), Some(T0));
        let mut free = 4;
        let (mut order, _) = serve_with(&mut q, T0 + TICK, &mut free);
        order.sort_unstable();
        assert_eq!(order, [0, 1, 100, 101]);
    }

    #[test]
    fn a_cancelled_request_leaves_its_queue() {
        let mut q = PriorityQueue::default();
        q.offer(held(1, Criticality::Normal, 1, T0, 1000 * MS), 5)
            .unwrap();
        q.offer(held(2, Criticality::Normal, 1, T0, 1000 * MS), 5)
            .unwrap();
        assert_eq!(q.remove(|id| *id == 1), 1);
        assert_eq!(q.len(), 1);
        assert_eq!(q.len_at(Criticality::Normal), 1);
        let mut free = 5;
        assert_eq!(serve_with(&mut q, T0 + TICK, &mut free).0, [2]);
    }
}
