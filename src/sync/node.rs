//! The node side of allowance reconciliation: what one Envoy node may admit
//! for each (key, limit) between two syncs with the central cluster.
//!
//! # State per (key, limit)
//! * a **lease**: tokens left and an expiry in the node's own clock
//!   (receipt + `ttl_ms`). While it lives, it is the only source of
//!   admissions: an exhausted live lease denies.
//! * a **provisional allowance** of [`NodeConfig::provisional`] units for a
//!   key the node has not seen (or has forgotten, below), so the first
//!   request never waits for the central cluster. What it admits is reported
//!   as `unleased` and the service books it as debt.
//! * **counts since the last acknowledged report**: `consumed`, `unleased`
//!   and `demand` (demand includes denials).
//! * the node's last **share** (units per sync interval), for
//!   `fail_open_local`.
//!
//! # Reports and acknowledgement
//! [`Node::report`] builds one batched [`SyncRequest`] with every (key,
//! limit) whose counts are not zero, and remembers the counts it sent. At
//! most one report is in flight: `report` returns `None` until the previous
//! one is answered or its callout timeout has passed. Counts are reset only
//! by [`Node::apply`] of the response with `ack_seq` equal to that report's
//! `seq`, and only by what that report carried, so admissions made while it
//! was in flight stay counted. A report lost in either direction, a response
//! to an older report, or a response later than the timeout changes nothing:
//! the next report carries the same counts again, plus the new ones. The
//! request's `acked_seq` tells the service which counts it may already hold.
//!
//! # Leases
//! `tokens` count from when the request was sent: on receipt the node
//! subtracts what it admitted against its previous lease since then, and
//! the new lease replaces the old one. So from any report's sending on, the
//! node admits at most `max(what the old lease had left, tokens)` on leases,
//! which is the service's accounting rule.
//!
//! # When the lease expired and no new one came
//! A key whose lease expired with every count acknowledged, on a node that
//! is *connected* (it applied a response within the longest lease TTL of
//! that response, or started less than one interval plus the callout
//! timeout ago), is idle, not cut off: it is forgotten and starts afresh
//! with a provisional allowance. Otherwise the failure mode applies:
//! * `fail_closed`: deny;
//! * `fail_open`: admit everything (reported as `unleased`);
//! * `fail_open_local`: a local token bucket at the last share (rate `share`
//!   per sync interval, capacity `share`), starting **empty**, for at most
//!   [`NodeConfig::local_max_ns`] after the lease expired; then fail closed.
//!   Only for a lease that expired with no response applied since (the node
//!   was cut off while holding it); otherwise it denies.
//!   The service keeps that share reserved for a silent node for as long,
//!   and sums of shares never exceed the global rate, so local limits
//!   together admit at most the global rate plus one interval's shares.
//!
//! A key that never had a lease and has used its provisional allowance is
//! denied while the node is connected (its lease is on the way); on a node
//! cut off, the failure mode applies to it too (with no share,
//! `fail_open_local` denies).
//!
//! Pure: no clock, no I/O. `now` is the node's wall clock in nanoseconds;
//! only differences of it are used, so a node's clock offset changes
//! nothing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::protocol::{Report, SyncRequest, SyncResponse, PROTOCOL_VERSION};
use crate::limiter::token_bucket::{Check, Gcra};

const NANOS_PER_MS: u64 = 1_000_000;

/// What a node does for a key whose lease expired with no new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Keep enforcing a local limit derived from the node's last share.
    FailOpenLocal,
    /// Deny.
    FailClosed,
    /// Admit everything.
    FailOpen,
}

/// A node's sync settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    pub node_id: String,
    pub region: String,
    pub policy_version: String,
    /// Units admitted for a new (key, limit) before its first lease.
    pub provisional: u64,
    pub failure_mode: FailureMode,
    /// The callout timeout: a response applied later than this after its
    /// request was sent is ignored, and a new report may be sent.
    pub response_timeout_ns: u64,
    /// The sync interval until the service sends one.
    pub interval_ns: u64,
    /// Longer `ttl_ms` are cut to this.
    pub max_ttl_ns: u64,
    /// How long `fail_open_local` lasts after a lease expired.
    pub local_max_ns: u64,
}

/// Why a request was admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    Lease,
    Provisional,
    FailOpenLocal,
    FailOpen,
}

/// Why a request was denied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denied {
    /// The live lease has fewer tokens than the cost.
    LeaseExhausted,
    /// Connected, no lease yet, provisional allowance used up.
    AwaitingLease,
    /// The lease expired and the mode is `fail_closed` (or `fail_open_local`
    /// ran out of time).
    FailClosed,
    /// `fail_open_local`'s local limit is exhausted (or there is no share).
    LocalLimit,
}

/// Why a response was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyError {
    /// It does not answer the report in flight.
    Stale,
    /// It came after the callout timeout.
    Late,
}

/// Counts since the last acknowledged report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub consumed: u64,
    pub unleased: u64,
    pub demand: u64,
}

impl Counts {
    fn is_zero(&self) -> bool {
        *self == Counts::default()
    }

    fn minus(&self, acked: &Counts) -> Counts {
        Counts {
            consumed: self.consumed.saturating_sub(acked.consumed),
            unleased: self.unleased.saturating_sub(acked.unleased),
            demand: self.demand.saturating_sub(acked.demand),
        }
    }
}

/// Node-wide counters (for stats and the simulator).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeStats {
    pub reports: u64,
    pub applied: u64,
    pub stale: u64,
    pub late: u64,
    pub timeouts: u64,
}

#[derive(Debug, Clone, Copy)]
struct Lease {
    tokens_left: u64,
    expires_at: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    lease: Option<Lease>,
    provisional_left: u64,
    pending: Counts,
    /// Units admitted on a lease since the report in flight was sent.
    lease_since_send: u64,
    share: u64,
    /// `fail_open_local`'s bucket: its parameters and TAT, once started.
    local: Option<(Gcra, u64)>,
}

impl Entry {
    fn fresh(provisional: u64) -> Entry {
        Entry {
            lease: None,
            provisional_left: provisional,
            pending: Counts::default(),
            lease_since_send: 0,
            share: 0,
            local: None,
        }
    }
}

#[derive(Debug, Clone)]
struct InFlight {
    seq: u64,
    sent_at: u64,
    sent: Vec<(String, String, Counts)>,
}

/// One node's allowances for every (key, limit) it has seen.
#[derive(Debug, Clone)]
pub struct Node {
    cfg: NodeConfig,
    entries: BTreeMap<String, BTreeMap<String, Entry>>,
    next_seq: u64,
    acked_seq: u64,
    in_flight: Option<InFlight>,
    interval_ns: u64,
    /// Connected while `now` is before this.
    contact_until: Option<u64>,
    /// When the last response was applied.
    last_applied_at: Option<u64>,
    stats: NodeStats,
}

impl Node {
    /// `now` seeds `seq`, so it keeps increasing across restarts as long as
    /// the clock does not step back further than the node ran.
    pub fn new(cfg: NodeConfig, now: u64) -> Node {
        let interval_ns = cfg.interval_ns.max(NANOS_PER_MS);
        let cfg_timeout = cfg.response_timeout_ns;
        Node {
            cfg,
            entries: BTreeMap::new(),
            next_seq: now.max(1),
            acked_seq: 0,
            in_flight: None,
            interval_ns,
            // A starting node waits one interval (plus the callout timeout)
            // for its first leases before it counts as cut off.
            contact_until: Some(now.saturating_add(interval_ns).saturating_add(cfg_timeout)),
            last_applied_at: None,
            stats: NodeStats::default(),
        }
    }

    pub fn config(&self) -> &NodeConfig {
        &self.cfg
    }

    /// The sync interval the service asked for (or the configured one).
    pub fn interval_ns(&self) -> u64 {
        self.interval_ns
    }

    pub fn stats(&self) -> NodeStats {
        self.stats
    }

    /// The `seq` of the report in flight, if any (answered reports are not).
    pub fn in_flight(&self) -> Option<u64> {
        self.in_flight.as_ref().map(|f| f.seq)
    }

    /// Whether the node applied a response recently enough to expect leases.
    pub fn connected(&self, now: u64) -> bool {
        self.contact_until.is_some_and(|until| now < until)
    }

    /// Whether a request of `cost` units for (key, limit) is admitted now.
    pub fn admit(&mut self, key: &str, limit: &str, cost: u64, now: u64) -> bool {
        self.decide(key, limit, cost, now).is_ok()
    }

    /// [`Node::admit`] with the reason.
    pub fn decide(&mut self, key: &str, limit: &str, cost: u64, now: u64) -> Result<Admitted, Denied> {
        let connected = self.connected(now);
        let last_applied_at = self.last_applied_at;
        let mode = self.cfg.failure_mode;
        let local_max = self.cfg.local_max_ns;
        let interval = self.interval_ns;
        let provisional = self.cfg.provisional;
        if !self.entries.get(key).is_some_and(|m| m.contains_key(limit)) {
            let by_limit = self.entries.entry(key.to_owned()).or_default();
            by_limit.insert(limit.to_owned(), Entry::fresh(provisional));
        }
        let Some(entry) = self.entries.get_mut(key).and_then(|m| m.get_mut(limit)) else {
            return Err(Denied::AwaitingLease); // just inserted
        };
        entry.pending.demand = entry.pending.demand.saturating_add(cost);

        let expired_at = match entry.lease {
            Some(ref mut lease) if now < lease.expires_at => {
                if lease.tokens_left < cost {
                    return Err(Denied::LeaseExhausted);
                }
                lease.tokens_left -= cost;
                entry.pending.consumed = entry.pending.consumed.saturating_add(cost);
                entry.lease_since_send = entry.lease_since_send.saturating_add(cost);
                return Ok(Admitted::Lease);
            }
            Some(lease) => Some(lease.expires_at),
            None => None,
        };
        // Idle, not cut off: this request's demand is the only count.
        if expired_at.is_some()
            && connected
            && entry.pending
                == (Counts {
                    demand: cost,
                    ..Counts::default()
                })
        {
            let share = entry.share;
            *entry = Entry::fresh(provisional);
            entry.share = share;
            entry.pending.demand = cost;
        }
        if entry.lease.is_none() && entry.provisional_left >= cost {
            entry.provisional_left -= cost;
            entry.pending.consumed = entry.pending.consumed.saturating_add(cost);
            entry.pending.unleased = entry.pending.unleased.saturating_add(cost);
            return Ok(Admitted::Provisional);
        }
        if connected {
            return Err(Denied::AwaitingLease);
        }
        let admitted = match mode {
            FailureMode::FailClosed => return Err(Denied::FailClosed),
            FailureMode::FailOpen => Admitted::FailOpen,
            FailureMode::FailOpenLocal => {
                // Only a lease that expired with no response since (the
                // node was cut off while it held it): the service reserves
                // the shares of nodes it has not heard from since their
                // grant, and of no others.
                let Some(expired_at) = entry.lease.map(|l| l.expires_at) else {
                    return Err(Denied::LocalLimit);
                };
                if last_applied_at.is_some_and(|a| a >= expired_at) {
                    return Err(Denied::LocalLimit);
                }
                if now >= expired_at.saturating_add(local_max) {
                    return Err(Denied::FailClosed);
                }
                if entry.local.is_none() {
                    // Starts empty: it admits only what accrues from now on.
                    let Some(gcra) = Gcra::new(entry.share, interval, entry.share) else {
                        return Err(Denied::LocalLimit);
                    };
                    entry.local = Some((gcra, now.saturating_add(gcra.tolerance_ns())));
                }
                let Some((gcra, tat)) = entry.local.as_mut() else {
                    return Err(Denied::LocalLimit);
                };
                match gcra.check(*tat, now, cost) {
                    Check::Admit { new_tat, .. } => *tat = new_tat,
                    Check::Deny { .. } => {
                        *tat = gcra.saturate(*tat, now);
                        return Err(Denied::LocalLimit);
                    }
                }
                Admitted::FailOpenLocal
            }
        };
        entry.pending.consumed = entry.pending.consumed.saturating_add(cost);
        entry.pending.unleased = entry.pending.unleased.saturating_add(cost);
        Ok(admitted)
    }

    /// The batched report to send now, or `None` while the previous one is
    /// in flight and within its timeout. A report is sent even with no
    /// counts: it acknowledges, and it tells the service the node is alive.
    pub fn report(&mut self, now: u64) -> Option<SyncRequest> {
        if let Some(f) = &self.in_flight {
            if now.saturating_sub(f.sent_at) <= self.cfg.response_timeout_ns {
                return None;
            }
            self.in_flight = None;
            self.stats.timeouts += 1;
        }
        self.forget_idle(now);
        let seq = self.next_seq;
        self.next_seq = self.next_seq.saturating_add(1);
        let mut reports = Vec::new();
        let mut sent = Vec::new();
        for (key, by_limit) in &mut self.entries {
            for (limit, entry) in by_limit.iter_mut() {
                entry.lease_since_send = 0;
                if entry.pending.is_zero() {
                    continue;
                }
                let c = entry.pending;
                reports.push(Report {
                    key: key.clone(),
                    limit: limit.clone(),
                    consumed: c.consumed,
                    unleased: c.unleased,
                    demand: c.demand,
                });
                sent.push((key.clone(), limit.clone(), c));
            }
        }
        self.in_flight = Some(InFlight {
            seq,
            sent_at: now,
            sent,
        });
        self.stats.reports += 1;
        Some(SyncRequest {
            version: PROTOCOL_VERSION,
            node_id: self.cfg.node_id.clone(),
            region: self.cfg.region.clone(),
            policy_version: self.cfg.policy_version.clone(),
            seq,
            acked_seq: self.acked_seq,
            reports,
        })
    }

    /// Applies the answer to the report in flight: acknowledges what it
    /// carried and installs its leases. Returns how many leases were taken.
    pub fn apply(&mut self, resp: &SyncResponse, now: u64) -> Result<usize, ApplyError> {
        let Some(f) = self.in_flight.take_if(|f| f.seq == resp.ack_seq) else {
            self.stats.stale += 1;
            return Err(ApplyError::Stale);
        };
        if now.saturating_sub(f.sent_at) > self.cfg.response_timeout_ns {
            self.stats.late += 1;
            return Err(ApplyError::Late);
        }
        for (key, limit, acked) in &f.sent {
            if let Some(e) = self.entry_mut(key, limit) {
                e.pending = e.pending.minus(acked);
            }
        }
        self.acked_seq = f.seq;
        self.interval_ns = resp.interval_ms.saturating_mul(NANOS_PER_MS).max(NANOS_PER_MS);
        let mut contact_ns = self.interval_ns.saturating_mul(3).min(self.cfg.max_ttl_ns);
        let mut taken = 0;
        for lease in &resp.leases {
            let ttl_ns = lease.ttl_ms.saturating_mul(NANOS_PER_MS).min(self.cfg.max_ttl_ns);
            let Some(e) = self.entry_mut(&lease.key, &lease.limit) else {
                continue;
            };
            e.lease = Some(Lease {
                tokens_left: lease.tokens.saturating_sub(e.lease_since_send),
                expires_at: now.saturating_add(ttl_ns),
            });
            e.share = lease.share;
            e.local = None;
            contact_ns = contact_ns.max(ttl_ns);
            taken += 1;
        }
        self.contact_until = Some(now.saturating_add(contact_ns));
        self.last_applied_at = Some(now);
        self.stats.applied += 1;
        Ok(taken)
    }

    /// Tokens left on the live lease of (key, limit), if any (for tests and
    /// stats).
    pub fn lease_tokens(&self, key: &str, limit: &str, now: u64) -> Option<u64> {
        let lease = self.entries.get(key)?.get(limit)?.lease?;
        (now < lease.expires_at).then_some(lease.tokens_left)
    }

    /// The counts not yet acknowledged for (key, limit).
    pub fn pending(&self, key: &str, limit: &str) -> Counts {
        self.entries
            .get(key)
            .and_then(|m| m.get(limit))
            .map(|e| e.pending)
            .unwrap_or_default()
    }

    fn entry_mut(&mut self, key: &str, limit: &str) -> Option<&mut Entry> {
        self.entries.get_mut(key)?.get_mut(limit)
    }

    /// Drops entries with nothing to report whose lease expired longer ago
    /// than `fail_open_local` could still use it: memory stays bounded by
    /// the keys in use.
    fn forget_idle(&mut self, now: u64) {
        let keep_ns = self.cfg.local_max_ns;
        for by_limit in self.entries.values_mut() {
            by_limit.retain(|_, e| {
                let gone = e
                    .lease
                    .is_some_and(|l| now >= l.expires_at.saturating_add(keep_ns));
                !(gone && e.pending.is_zero())
            });
        }
        self.entries.retain(|_, m| !m.is_empty());
    }
}

#[cfg(test)]
mod tests;
