//! Giving back: a request's slots and probe ticket returned (every end of
//! a stream), and the tick's renewal of what this worker publishes. Never
//! fails: the worker's count is right in memory at once; shared data
//! follows now or on the next tick.

use super::held::Publish;
use super::{breaker, Counts, Ticket, Worker, RENEW_BEFORE_NS};
use crate::host::Host;

impl Worker {
    /// Gives back everything a request took that never reached its
    /// dependency (a later check refused it): its slots, and its probe
    /// ticket to the half-open period it was taken in.
    pub fn cancel<H: Host>(&mut self, host: &H, mut ticket: Ticket, now: u64) {
        if let Some(p) = ticket.probe.take() {
            if let Err(f) = breaker::give_back_probe(host, &p.breaker_key, p.period, now, &mut self.buffers) {
                // Lost to its period, which the lost-probe rule ends.
                log::debug!("tenantgate: a probe ticket could not be given back: {f:?}");
            }
        }
        self.release(host, ticket, now);
    }

    /// Gives a stream's slot back (every end of a stream: complete, reset,
    /// local reply, client gone). Never fails: the worker's count is right
    /// in memory at once; shared data follows now or on the next tick.
    pub fn release<H: Host>(&mut self, host: &H, ticket: Ticket, now: u64) {
        let Ticket {
            dependency,
            action,
            tenant,
            level,
            streaming,
            ..
        } = ticket;
        for key in [dependency, action, tenant].into_iter().flatten() {
            self.give(host, &key, now, level, streaming);
        }
    }

    /// On the tick: publishes what is dirty and renews leases with less
    /// than [`RENEW_BEFORE_NS`] left; forgets places it holds nothing in
    /// once shared data agrees.
    pub fn renew<H: Host>(&mut self, host: &H, now: u64) {
        // Every permit goes back (see PERMIT_SHARE); the slots taken this
        // tick say how many to ask for next.
        for h in self.held.values_mut() {
            h.taken_last = std::mem::take(&mut h.taken);
            if !h.permits.is_zero() {
                h.permits = Counts::default();
                h.dirty = true;
            }
        }
        let due: Vec<String> = self
            .held
            .iter()
            .filter(|(_, h)| {
                h.dirty || (!h.counts.is_zero() && h.lease_until < now.saturating_add(RENEW_BEFORE_NS))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in due {
            self.publish(host, &key, now);
        }
        self.held
            .retain(|_, h| h.dirty || !h.counts.is_zero() || h.taken_last > 0);
    }

    /// One slot fewer at `key`: kept as a permit while the place holds
    /// permits of its level (no shared data), else published now if
    /// possible.
    fn give<H: Host>(&mut self, host: &H, key: &str, now: u64, level: usize, streaming: bool) {
        if let Some(h) = self.held.get_mut(key) {
            h.counts.sub(level, streaming);
            let keeps = !streaming && h.permits.levels.get(level).is_some_and(|p| *p > 0);
            if keeps {
                h.permits.add(level, false);
                return;
            }
            h.dirty = true;
        }
        self.publish(host, key, now);
    }

    /// Writes this worker's count at `key` as it is in memory (its permits
    /// included).
    fn publish<H: Host>(&mut self, host: &H, key: &str, now: u64) {
        let Some(h) = self.held.get(key) else { return };
        let (entries, action, counts, published) = (
            h.table_entries,
            h.overflow_action.clone(),
            h.counts,
            h.published(),
        );
        let written = self.write(host, key, entries, &action, now, Publish::Exactly(published));
        self.set(key, entries, &action, counts, now, written.is_err());
    }
}
