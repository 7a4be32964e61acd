//! A test model of one node: the allowances of every (key, limit) in
//! memory, with a report/apply of its own, to test [`Allowance`] and
//! [`SyncState`] on their own. Test-only: the filter and the simulator run
//! [`super::super::shared`] over shared data (issue 7: one node
//! implementation), never this.

use std::collections::BTreeMap;

use super::{Admitted, Allowance, Counts, Denied, FailureMode};
use crate::sync::cycle::{ApplyError, SyncState};
use crate::sync::protocol::{Report, SyncRequest, SyncResponse, PROTOCOL_VERSION};

const NANOS_PER_MS: u64 = 1_000_000;

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

/// Node-wide counters (for stats and the simulator).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeStats {
    pub reports: u64,
    pub applied: u64,
    pub stale: u64,
    pub late: u64,
    pub timeouts: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    allowance: Allowance,
    /// `lease_used` when the report in flight was sent.
    used_at_send: u64,
}

#[derive(Debug, Clone)]
struct Sent {
    seq: u64,
    sent: Vec<(String, String, Counts)>,
}

/// One node's allowances for every (key, limit) it has seen, in memory
/// (the simulator and tests; the filter keeps the same state in shared
/// data).
#[derive(Debug, Clone)]
pub struct Node {
    cfg: NodeConfig,
    entries: BTreeMap<String, BTreeMap<String, Entry>>,
    sync: SyncState,
    sent: Option<Sent>,
    stats: NodeStats,
}

impl Node {
    pub fn new(cfg: NodeConfig, now: u64) -> Node {
        let sync = SyncState::new(now, cfg.interval_ns, cfg.response_timeout_ns);
        Node {
            cfg,
            entries: BTreeMap::new(),
            sync,
            sent: None,
            stats: NodeStats::default(),
        }
    }

    pub fn config(&self) -> &NodeConfig {
        &self.cfg
    }

    /// The sync interval the service asked for (or the configured one).
    pub fn interval_ns(&self) -> u64 {
        self.sync.interval_ns
    }

    pub fn stats(&self) -> NodeStats {
        self.stats
    }

    /// The `seq` of the report in flight, if any (answered reports are not).
    pub fn in_flight(&self) -> Option<u64> {
        self.sync.in_flight.map(|f| f.seq)
    }

    /// Whether the node applied a response recently enough to expect leases.
    pub fn connected(&self, now: u64) -> bool {
        self.sync.connected(now)
    }

    /// Whether a request of `cost` units for (key, limit) is admitted now.
    pub fn admit(&mut self, key: &str, limit: &str, cost: u64, now: u64) -> bool {
        self.decide(key, limit, cost, now).is_ok()
    }

    /// [`Node::admit`] with the reason.
    pub fn decide(&mut self, key: &str, limit: &str, cost: u64, now: u64) -> Result<Admitted, Denied> {
        let view = self.sync.view(
            self.cfg.failure_mode,
            self.cfg.provisional,
            self.cfg.local_max_ns,
            self.cfg.response_timeout_ns,
            self.cfg.max_ttl_ns,
            now,
        );
        if !self.entries.get(key).is_some_and(|m| m.contains_key(limit)) {
            let by_limit = self.entries.entry(key.to_owned()).or_default();
            by_limit.insert(
                limit.to_owned(),
                Entry {
                    allowance: Allowance::fresh(view.provisional),
                    used_at_send: 0,
                },
            );
        }
        let Some(entry) = self.entry_mut(key, limit) else {
            return Err(Denied::AwaitingLease); // just inserted
        };
        entry.allowance.decide(&view, cost, now)
    }

    /// The batched report to send now, or `None` while the previous one is
    /// in flight and within its timeout. A report is sent even with no
    /// counts: it acknowledges, and it tells the service the node is alive.
    pub fn report(&mut self, now: u64) -> Option<SyncRequest> {
        let (seq, timed_out) = self.sync.begin_report(now, self.cfg.response_timeout_ns)?;
        if timed_out {
            self.stats.timeouts += 1;
        }
        self.forget_idle(now);
        let mut reports = Vec::new();
        let mut sent = Vec::new();
        for (key, by_limit) in &mut self.entries {
            for (limit, entry) in by_limit.iter_mut() {
                entry.used_at_send = entry.allowance.lease_used;
                if !entry.allowance.wants_report(now) {
                    continue;
                }
                let c = entry.allowance.pending;
                reports.push(Report {
                    key: key.clone(),
                    limit: limit.clone(),
                    consumed: c.consumed,
                    unleased: c.unleased,
                    demand: c.demand,
                    failure_mode: None,
                    started_ms: entry.allowance.started_ms(now),
                });
                sent.push((key.clone(), limit.clone(), c));
            }
        }
        self.sent = Some(Sent { seq, sent });
        self.stats.reports += 1;
        Some(SyncRequest {
            version: PROTOCOL_VERSION,
            node_id: self.cfg.node_id.clone(),
            region: self.cfg.region.clone(),
            policy_version: self.cfg.policy_version.clone(),
            seq,
            boot: 0,
            acked_seq: self.sync.acked_seq,
            reports,
            settings: None,
        })
    }

    /// Applies the answer to the report in flight: acknowledges what it
    /// carried and installs its leases. Returns how many leases were taken.
    pub fn apply(&mut self, resp: &SyncResponse, now: u64) -> Result<usize, ApplyError> {
        let f = match self.sync.accept(resp.ack_seq, now, self.cfg.response_timeout_ns) {
            Ok(f) => f,
            Err(e) => {
                match e {
                    ApplyError::Stale => self.stats.stale += 1,
                    ApplyError::Late => self.stats.late += 1,
                }
                return Err(e);
            }
        };
        if let Some(sent) = self.sent.take().filter(|s| s.seq == f.seq) {
            for (key, limit, acked) in &sent.sent {
                if let Some(e) = self.entry_mut(key, limit) {
                    e.allowance.ack(acked);
                }
            }
        }
        let max_ttl = self.cfg.max_ttl_ns;
        let mut longest = 0;
        let mut taken = 0;
        for lease in &resp.leases {
            let ttl_ns = lease.ttl_ms.saturating_mul(NANOS_PER_MS).min(max_ttl);
            let Some(e) = self.entry_mut(&lease.key, &lease.limit) else {
                continue;
            };
            let used = e.allowance.lease_used.wrapping_sub(e.used_at_send);
            let granted = super::Granted::from_wire(lease, ttl_ns);
            e.allowance.install(granted, used, now);
            longest = longest.max(ttl_ns);
            taken += 1;
        }
        self.sync.applied(f.seq, resp.interval_ms, longest, max_ttl, now);
        self.stats.applied += 1;
        Ok(taken)
    }

    /// Tokens left on the live lease of (key, limit), if any (for tests and
    /// stats).
    pub fn lease_tokens(&self, key: &str, limit: &str, now: u64) -> Option<u64> {
        let lease = self.entries.get(key)?.get(limit)?.allowance.lease?;
        (now < lease.expires_at).then_some(lease.tokens_left)
    }

    /// The counts not yet acknowledged for (key, limit).
    pub fn pending(&self, key: &str, limit: &str) -> Counts {
        self.entries
            .get(key)
            .and_then(|m| m.get(limit))
            .map(|e| e.allowance.pending)
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
            by_limit.retain(|_, e| !e.allowance.forgettable(now, keep_ns));
        }
        self.entries.retain(|_, m| !m.is_empty());
    }
}
