//! Per-node request bookkeeping: the order of a node's requests.
//!
//! A node's counts run from its last *acknowledged* report (its
//! `acked_seq`), so a report whose response was lost is merged into the
//! next one. Which of a report's counts are new is decided **per (key,
//! limit) record**, by the node's entry in that record (`NodeKey::intake`
//! in `node_key.rs`): it remembers the last `seq` of the node it applied,
//! the base that `seq` counted from, and what it counted since that base.
//! So each record deduplicates its own counts, and a store that writes a
//! request's records in several transactions (Redis Cluster: one per hash
//! slot) still counts every unit once, whichever of them land (see
//! `crate::store`). The rules, per record:
//!
//! * `acked_seq ==` the last `seq` the record applied: the node got that
//!   response, so its counts are all new (the base moves on);
//! * `acked_seq ==` the record's base: that response was lost; subtract
//!   what the record counted since the base;
//! * anything else (we lost our state, or the node restarted): take the
//!   counts whole. That can count some units twice, never zero times: the
//!   error is toward admitting less;
//! * the same `seq` again (a store ran the record's update twice, a
//!   retried request whose first try landed here, or the node's second
//!   copy of a report, [`SeqCheck::Repeat`]): nothing is counted, and the
//!   lease it answered is sent again, nothing more drawn;
//! * an older `seq` than the record applied: nothing is counted.
//!
//! The session keeps what is about the node as a whole: its `seq` order (a
//! request whose `seq` is below the last applied one arrived out of order;
//! it is refused and counts nothing; the last applied one again, with the
//! same `acked_seq`, is the node's second copy of that report, answered
//! again: see [`SeqCheck::Repeat`]), its `boot`,
//! when it was last heard, the (key, limit)s it holds and its settings.
//!
//! # Sessions (`boot`)
//! A node's `seq`s live within a session that the node starts: the
//! request's `boot`, a value the node picks when it starts. A request with
//! another `boot` than the session's starts a new session (its counts are
//! taken whole, as for an unknown base), so a restarted node is never stuck
//! behind the `seq` of its previous life, nor behind one that somebody else
//! sent in its name. Within a session, a `seq` more than [`MAX_SEQ_STEP`]
//! ahead of the last applied one is refused ([`SeqCheck::Jump`]): a node
//! moves its `seq` by one per report. A node that sends no `boot` (`0`,
//! older nodes) seeds its `seq` from its clock in nanoseconds when it starts
//! and has one session forever; its `seq` is refused when it is more than
//! [`MAX_SEQ_AHEAD_NS`] ahead of the service's clock, so nobody can push it
//! to `u64::MAX` and lock the node out for good.

use std::collections::{BTreeMap, BTreeSet};

use hashbrown::HashMap;

use serde::{Deserialize, Serialize};
use tenantgate::sync::{Counts, SyncRequest};

use super::NodeTerms;

/// A (key, limit).
pub type KeyId = (String, String);

/// Within a session, the furthest a `seq` may move past the last applied
/// one: about twelve days of reports at one a second, with every one of
/// them lost.
pub const MAX_SEQ_STEP: u64 = 1 << 20;

/// With no session (`boot == 0`), how far a `seq` may be ahead of the
/// service's clock (nanoseconds): the nodes' clock offset from the
/// service's. Ten minutes.
pub const MAX_SEQ_AHEAD_NS: u64 = 600 * 1_000_000_000;

/// How a request's `seq` stands against its node's session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// The next request of the session.
    Next,
    /// Another `boot`: a new session starts with this request.
    NewSession,
    /// The last applied request again (its `seq` and `acked_seq`): the
    /// node sent a second copy of a report still unanswered (the node's
    /// hedge, `tenantgate::sync::shared::hedge`), or a store ran it twice.
    /// Answered again: every record sees its `seq` as a duplicate, counts
    /// nothing and sends the lease it granted to it, nothing more drawn.
    Repeat,
    /// Below the last applied `seq`, or the last one with another
    /// `acked_seq`: out of order.
    Stale,
    /// Implausibly far ahead (see the module header).
    Jump,
}

/// What a request brings: its counts per (key, limit), each record to
/// deduplicate them itself.
#[derive(Debug, Clone)]
pub struct Intake {
    /// The counts since the node's acknowledged base, per reported (key,
    /// limit) (a (key, limit) named twice summed), in the request's order.
    pub totals: Vec<(KeyId, Counts)>,
    /// When we applied and answered the node's previous request (service
    /// clock).
    pub prev_heard_at: Option<u64>,
}

/// What the service keeps of one node: the record a store holds and
/// updates atomically. Opaque outside the allocator; serializable so that a
/// shared store can keep it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Session {
    pub region: String,
    /// The session's `boot` (see the module header).
    #[serde(default)]
    boot: u64,
    last_seq: u64,
    /// The last request's `acked_seq` (kept for the record's format).
    base: u64,
    /// Always empty: counts are deduplicated per (key, limit) record since
    /// issue 22 (kept so that records of either version read).
    counted: BTreeMap<KeyId, Tally>,
    /// When the last request was applied (and answered).
    pub heard_at: Option<u64>,
    /// The (key, limit)s this node was ever granted a lease for and that
    /// still hold state.
    pub held: BTreeSet<KeyId>,
    /// The settings the node last reported (`None`: none, the policy's).
    #[serde(default)]
    terms: Option<NodeTerms>,
    /// When the request before the last one was applied (what a repeat of
    /// the last request reports as `Intake::prev_heard_at`, as its first
    /// copy did). Appended last: a record's fields are never reordered
    /// (`crate::codec`, "Evolution").
    #[serde(default)]
    prev_heard_at: Option<u64>,
}

/// A session as format 1 (bincode) stored it, before `boot`.
#[derive(Serialize, Deserialize)]
struct SessionV1 {
    region: String,
    last_seq: u64,
    base: u64,
    counted: BTreeMap<KeyId, Tally>,
    heard_at: Option<u64>,
    held: BTreeSet<KeyId>,
}

/// [`Counts`] as a record stores them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Tally {
    pub(super) consumed: u64,
    pub(super) unleased: u64,
    pub(super) demand: u64,
}

impl Tally {
    pub(super) fn of(c: Counts) -> Tally {
        Tally {
            consumed: c.consumed,
            unleased: c.unleased,
            demand: c.demand,
        }
    }

    /// What `total` adds to this.
    pub(super) fn new_in(&self, total: Counts) -> Counts {
        Counts {
            consumed: total.consumed.saturating_sub(self.consumed),
            unleased: total.unleased.saturating_sub(self.unleased),
            demand: total.demand.saturating_sub(self.demand),
        }
    }
}

impl Session {
    pub fn new(region: &str) -> Session {
        Session {
            region: region.to_owned(),
            boot: 0,
            last_seq: 0,
            base: 0,
            counted: BTreeMap::new(),
            heard_at: None,
            prev_heard_at: None,
            held: BTreeSet::new(),
            terms: None,
        }
    }

    /// Reads a session that format 1 of the stores wrote (bincode, no
    /// `boot`: the node's session of no boot).
    pub fn from_v1_bincode(bytes: &[u8]) -> Result<Session, String> {
        let v1: SessionV1 = bincode::deserialize(bytes).map_err(|e| e.to_string())?;
        Ok(Session {
            region: v1.region,
            boot: 0,
            last_seq: v1.last_seq,
            base: v1.base,
            counted: v1.counted,
            heard_at: v1.heard_at,
            prev_heard_at: None,
            held: v1.held,
            terms: None,
        })
    }

    /// A format-1 record of this session (tests of the read path).
    #[doc(hidden)]
    pub fn v1_bincode_for_tests(&self) -> Vec<u8> {
        let v1 = SessionV1 {
            region: self.region.clone(),
            last_seq: self.last_seq,
            base: self.base,
            counted: self.counted.clone(),
            heard_at: self.heard_at,
            held: self.held.clone(),
        };
        let mut out = vec![1u8];
        out.extend(bincode::serialize(&v1).unwrap_or_default());
        out
    }

    /// Records the settings the node reported.
    pub fn enforced(&mut self, terms: NodeTerms) {
        self.terms = Some(terms);
    }

    /// The settings the node last reported.
    pub fn terms(&self) -> Option<NodeTerms> {
        self.terms
    }

    /// How `req`'s `seq` stands (service clock `now`).
    pub fn seq_check(&self, req: &SyncRequest, now: u64) -> SeqCheck {
        if req.boot != self.boot {
            return SeqCheck::NewSession;
        }
        if req.seq == self.last_seq && req.seq != 0 && req.acked_seq == self.base {
            return SeqCheck::Repeat;
        }
        if req.seq <= self.last_seq {
            return SeqCheck::Stale;
        }
        let jump = if req.boot == 0 {
            req.seq > now.saturating_add(MAX_SEQ_AHEAD_NS)
        } else {
            self.last_seq != 0 && req.seq - self.last_seq > MAX_SEQ_STEP
        };
        if jump {
            SeqCheck::Jump
        } else {
            SeqCheck::Next
        }
    }

    /// Orders `req` after the session's last request and sums its counts
    /// per (key, limit); `None` if it is stale or jumps (see
    /// [`Session::seq_check`]). Which counts are new is each record's to
    /// decide (the module header).
    pub fn intake(&mut self, req: &SyncRequest, now: u64) -> Option<Intake> {
        let repeat = match self.seq_check(req, now) {
            SeqCheck::Stale | SeqCheck::Jump => return None,
            SeqCheck::NewSession => {
                self.boot = req.boot;
                self.last_seq = 0;
                false
            }
            SeqCheck::Next => false,
            SeqCheck::Repeat => true,
        };
        self.base = req.acked_seq;
        // Sessions written before issue 22 counted here: forgotten.
        self.counted.clear();
        // A (key, limit) named twice in one report carries two parts of
        // its counts (two slots, a retried scan): they are summed first.
        // (Each report is looked up once in an index: linear in the
        // report, whatever its duplicates.)
        let mut totals: Vec<(KeyId, Counts)> = Vec::with_capacity(req.reports.len());
        let mut index: HashMap<(&str, &str), usize> = HashMap::with_capacity(req.reports.len());
        for r in &req.reports {
            match index.get(&(r.key.as_str(), r.limit.as_str())) {
                Some(&i) => {
                    if let Some((_, t)) = totals.get_mut(i) {
                        t.consumed = t.consumed.saturating_add(r.consumed);
                        t.unleased = t.unleased.saturating_add(r.unleased);
                        t.demand = t.demand.saturating_add(r.demand);
                    }
                }
                None => {
                    index.insert((r.key.as_str(), r.limit.as_str()), totals.len());
                    totals.push((
                        (r.key.clone(), r.limit.clone()),
                        Counts {
                            consumed: r.consumed,
                            unleased: r.unleased,
                            demand: r.demand,
                        },
                    ));
                }
            }
        }
        if !repeat {
            self.prev_heard_at = self.heard_at;
        }
        let intake = Intake {
            totals,
            prev_heard_at: self.prev_heard_at,
        };
        self.last_seq = req.seq;
        self.heard_at = Some(now);
        self.region.clone_from(&req.region);
        Some(intake)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenantgate::sync::{Report, PROTOCOL_VERSION};

    fn req(seq: u64, acked_seq: u64, consumed: u64) -> SyncRequest {
        SyncRequest {
            version: PROTOCOL_VERSION,
            node_id: "n".into(),
            region: "r".into(),
            policy_version: "v".into(),
            seq,
            boot: 0,
            acked_seq,
            reports: vec![Report {
                key: "k".into(),
                limit: "l".into(),
                consumed,
                unleased: 0,
                demand: consumed,
                failure_mode: None,
                started_ms: None,
            }],
            settings: None,
        }
    }

    fn consumed(i: &Intake) -> u64 {
        i.totals[0].1.consumed
    }

    #[test]
    fn reordered_requests_count_nothing_and_a_repeat_is_the_same_request() {
        let mut s = Session::new("r");
        s.intake(&req(10, 0, 5), 1).unwrap();
        assert_eq!(s.intake(&req(11, 10, 5), 2).unwrap().prev_heard_at, Some(1));
        assert!(s.intake(&req(10, 0, 5), 3).is_none());
        assert!(
            s.intake(&req(11, 0, 5), 3).is_none(),
            "another base: not a repeat"
        );
        // The same request again (the node's second copy): taken, with
        // the previous request's time, as its first copy was; the
        // records decide that it counts nothing.
        assert_eq!(s.seq_check(&req(11, 10, 5), 3), SeqCheck::Repeat);
        assert_eq!(s.intake(&req(11, 10, 5), 3).unwrap().prev_heard_at, Some(1));
        assert_eq!(s.intake(&req(12, 11, 1), 4).unwrap().prev_heard_at, Some(3));
    }

    /// A session a service before issue 35 stored (no `prev_heard_at`)
    /// still reads: the field is appended, so the record's field count
    /// says it is absent (`crate::codec`, "Evolution").
    #[test]
    fn a_session_stored_before_prev_heard_at_still_reads() {
        let mut s = Session::new("r");
        s.intake(&req(10, 0, 5), 1).unwrap();
        let mut bytes = Vec::new();
        crate::codec::to_writer(&mut bytes, &s).unwrap();
        // The field count, then the fields; the last, `None`, one byte.
        assert_eq!((bytes.first(), bytes.last()), (Some(&9), Some(&0)));
        let mut older = bytes.clone();
        older[0] = 8;
        older.pop();
        let back: Session = crate::codec::from_slice(&older).unwrap();
        assert_eq!(
            (back.last_seq, back.heard_at, back.prev_heard_at),
            (10, Some(1), None)
        );
        let back: Session = crate::codec::from_slice(&bytes).unwrap();
        assert_eq!(format!("{back:?}"), format!("{s:?}"));
    }

    #[test]
    fn a_key_named_twice_in_one_report_is_summed() {
        // Regression: the second occurrence was taken as "already counted"
        // and only the difference (here 0) was counted.
        let mut s = Session::new("r");
        let mut r = req(10, 0, 5);
        r.reports.push(r.reports[0].clone());
        let i = s.intake(&r, 1).unwrap();
        assert_eq!(i.totals.len(), 1);
        assert_eq!(consumed(&i), 10);
    }

    #[test]
    fn a_seq_pushed_to_the_maximum_is_refused_and_locks_nobody_out() {
        // The reported lock-out: a request in the node's name with
        // seq u64::MAX made every later report of the node stale.
        let mut s = Session::new("r");
        assert!(s.intake(&req(u64::MAX, 0, 5), 1).is_none());
        assert_eq!(s.seq_check(&req(u64::MAX, 0, 5), 1), SeqCheck::Jump);
        assert_eq!(consumed(&s.intake(&req(10, 0, 5), 2).unwrap()), 5);
    }

    #[test]
    fn a_new_boot_starts_a_new_session_and_a_jump_within_one_is_refused() {
        let with_boot = |seq, acked, consumed, boot| SyncRequest {
            boot,
            ..req(seq, acked, consumed)
        };
        let mut s = Session::new("r");
        s.intake(&with_boot(1_000, 0, 5, 7), 1).unwrap();
        assert_eq!(
            s.seq_check(&with_boot(1_000 + MAX_SEQ_STEP + 1, 1_000, 1, 7), 2),
            SeqCheck::Jump
        );
        assert!(s
            .intake(&with_boot(1_000 + MAX_SEQ_STEP + 1, 1_000, 1, 7), 2)
            .is_none());
        s.intake(&with_boot(1_000 + MAX_SEQ_STEP, 1_000, 2, 7), 2)
            .unwrap();
        // Somebody pushes the session to the end in the node's name with
        // another boot: a session of its own...
        s.intake(&with_boot(u64::MAX, 0, 0, 99), 3).unwrap();
        // ...which the node's next request (its own boot) replaces.
        // Restarted, with seq below its old ones: a new session.
        let i = s.intake(&with_boot(5, 0, 4, 8), 4).unwrap();
        assert_eq!(consumed(&i), 4);
        assert_eq!(s.seq_check(&with_boot(5, 0, 4, 8), 5), SeqCheck::Repeat);
        assert_eq!(s.seq_check(&with_boot(4, 0, 4, 8), 5), SeqCheck::Stale);
        assert_eq!(s.seq_check(&with_boot(6, 5, 4, 8), 5), SeqCheck::Next);
    }

    #[test]
    fn a_session_remembers_no_counts_however_a_node_reports() {
        // Counts are deduplicated per (key, limit) record: a node that
        // never acknowledges, with new keys in every request, grows no
        // session (before issue 22 it remembered up to 16,384 tallies).
        let mut s = Session::new("r");
        for seq in 1..=10u64 {
            let mut r = req(seq, 0, 1);
            r.reports = (0..4096)
                .map(|k| Report {
                    key: format!("k{seq}-{k}"),
                    limit: "l".into(),
                    consumed: 1,
                    unleased: 0,
                    demand: 1,
                    failure_mode: None,
                    started_ms: None,
                })
                .collect();
            s.intake(&r, seq).unwrap();
            assert!(s.counted.is_empty());
        }
    }
}
