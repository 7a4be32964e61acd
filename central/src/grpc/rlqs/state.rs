//! The RLQS server's book: which stream holds which bucket, which buckets
//! hold which key, what each holder was last sent and until when Envoy
//! may still enforce it. Pure (time comes in as `now`); the service
//! (`super`) does the I/O with what it returns.
//!
//! A key's holders are kept in the order they joined, so a holder's place
//! in the split (`super::share::split`) moves only when an earlier one
//! leaves. A holder leaves when its bucket is abandoned (idle), moves to
//! another key (a policy reload), or when the last assignment it was sent
//! has expired on Envoy's side (`expires_ns`: sent + TTL + margin) without
//! being refreshed, which is also how a closed stream's shares are
//! released: never before Envoy may have stopped enforcing them.

use std::collections::{BTreeSet, HashMap};

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;

use super::share::{seconds, split, strategy, Grant, KeyRate};

pub type StreamId = u64;
/// A bucket id as its sorted `(key, value)` entries.
pub type BucketName = Vec<(String, String)>;

/// What a bucket's requests are counted under and limited by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Not limited here (no rule, `unlimited`, `mode: off`).
    Allow,
    /// Counted under the key, never limited (`mode: shadow`, only shadow
    /// or soft limits).
    Count { key: String },
    /// Limited: the key's limit is split among its holders.
    Limit { key: String, rate: KeyRate },
}

impl Target {
    fn key(&self) -> Option<&str> {
        match self {
            Target::Allow => None,
            Target::Count { key } | Target::Limit { key, .. } => Some(key),
        }
    }
}

/// One bucket's line of a usage report, resolved.
#[derive(Debug, Clone)]
pub struct Usage {
    pub name: BucketName,
    pub id: BucketId,
    pub target: Target,
    pub allowed: u64,
    pub denied: u64,
}

/// The book's bounds and timings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_buckets_per_stream: usize,
    /// Assignments' time to live, whole seconds (as Envoy reads it).
    pub ttl_secs: u64,
    /// Added to a holder's expiry: Envoy's timer starts when it receives
    /// the assignment, after we sent it.
    pub margin_ns: u64,
    /// Consecutive reports with no request after which a bucket is
    /// abandoned (its share released); 0: never.
    pub idle_reports: u32,
}

/// What the service must do after a change to the book.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Actions to send, by stream.
    pub send: HashMap<StreamId, Vec<BucketAction>>,
    pub denied: u64,
    /// Buckets refused for the stream's bucket cap (no answer: Envoy keeps
    /// its `no_assignment_behavior`).
    pub refused: u64,
    pub abandoned: u64,
    /// Assignments that changed a holder's token bucket (each a fresh
    /// burst on Envoy's side).
    pub changed: u64,
}

struct Tracked {
    target: Target,
    idle: u32,
}

#[derive(Default)]
struct Stream {
    buckets: HashMap<BucketName, Tracked>,
    open: bool,
}

struct Holder {
    stream: StreamId,
    bucket: BucketName,
    id: BucketId,
    /// The grant last sent (`None`: none yet).
    sent: Option<Grant>,
    /// Reported: answered at the next assignment whatever changed.
    due: bool,
    expires_ns: u64,
}

struct Holders {
    rate: KeyRate,
    list: Vec<Holder>,
    /// Until when every holder is sent `DENY_ALL` (another limit of the
    /// plan is exhausted; 0: open).
    closed_until: u64,
}

/// Streams, their buckets, and every limited key's holders.
#[derive(Default)]
pub struct Book {
    streams: HashMap<StreamId, Stream>,
    keys: HashMap<String, Holders>,
}

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// A share's rate in tokens per `per_secs`, rounded up (what it takes
/// from the key while it drains).
fn reserved(s: super::share::Share, per_secs: u64) -> u64 {
    let r = u128::from(s.tokens_per_fill)
        .saturating_mul(u128::from(per_secs.max(1)))
        .div_ceil(u128::from(s.fill_interval_secs.max(1)));
    u64::try_from(r).unwrap_or(u64::MAX)
}

fn action(id: &BucketId, grant: Grant, ttl_secs: u64) -> BucketAction {
    BucketAction {
        bucket_id: Some(id.clone()),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(seconds(ttl_secs, false)),
            rate_limit_strategy: Some(strategy(grant)),
        })),
    }
}

impl Book {
    pub fn streams(&self) -> usize {
        self.streams.values().filter(|s| s.open).count()
    }

    /// Holders of limited keys (live and draining).
    pub fn holders(&self) -> usize {
        self.keys.values().map(|h| h.list.len()).sum()
    }

    pub fn open(&mut self, stream: StreamId) {
        self.streams.insert(
            stream,
            Stream {
                buckets: HashMap::new(),
                open: true,
            },
        );
    }

    /// A stream ended: nothing more is sent on it; its holders stay until
    /// their assignments expire (see [`Book::expire`]).
    pub fn close(&mut self, stream: StreamId) {
        if let Some(s) = self.streams.get_mut(&stream) {
            s.open = false;
            s.buckets.clear();
        }
        let held = self
            .keys
            .values()
            .any(|h| h.list.iter().any(|x| x.stream == stream));
        if !held {
            self.streams.remove(&stream);
        }
    }

    /// One usage report of `stream` (see the module header of `super`).
    pub fn report(&mut self, stream: StreamId, usages: Vec<Usage>, now: u64, limits: Limits) -> Outcome {
        let mut out = Outcome::default();
        let mut dirty: BTreeSet<String> = BTreeSet::new();
        let mut due: Vec<(BucketName, BucketId, Target)> = Vec::new();
        for u in usages {
            let Some(s) = self.streams.get_mut(&stream) else {
                return out;
            };
            let known = s.buckets.contains_key(&u.name);
            if !known && s.buckets.len() >= limits.max_buckets_per_stream {
                out.refused = out.refused.saturating_add(1);
                continue;
            }
            out.denied = out.denied.saturating_add(u.denied);
            let idle = match s.buckets.get(&u.name) {
                Some(t) if u.allowed == 0 && u.denied == 0 => t.idle.saturating_add(1),
                _ => 0,
            };
            let previous = s.buckets.insert(
                u.name.clone(),
                Tracked {
                    target: u.target.clone(),
                    idle,
                },
            );
            if let Some(old) = previous.as_ref().and_then(|p| p.target.key()) {
                if u.target.key() != Some(old) && self.leave(old, stream, &u.name) {
                    dirty.insert(old.to_owned());
                }
            }
            if limits.idle_reports > 0 && idle >= limits.idle_reports {
                self.abandon(stream, &u, &mut out, &mut dirty);
                continue;
            }
            if let Target::Limit { key, rate } = &u.target {
                if self.join(key, *rate, stream, &u.name, &u.id) {
                    dirty.insert(key.clone());
                }
            }
            due.push((u.name, u.id, u.target));
        }
        for (name, id, target) in &due {
            match target {
                Target::Limit { key, .. } => {
                    dirty.insert(key.clone());
                    self.mark_due(key, stream, name);
                }
                Target::Allow | Target::Count { .. } => {
                    out.send
                        .entry(stream)
                        .or_default()
                        .push(action(id, Grant::AllowAll, limits.ttl_secs))
                }
            }
        }
        for key in dirty {
            self.assign(&key, now, limits, &mut out);
        }
        out
    }

    fn abandon(&mut self, stream: StreamId, u: &Usage, out: &mut Outcome, dirty: &mut BTreeSet<String>) {
        if let Some(s) = self.streams.get_mut(&stream) {
            s.buckets.remove(&u.name);
        }
        if let Some(key) = u.target.key() {
            if self.leave(key, stream, &u.name) {
                dirty.insert(key.to_owned());
            }
        }
        out.abandoned = out.abandoned.saturating_add(1);
        out.send.entry(stream).or_default().push(BucketAction {
            bucket_id: Some(u.id.clone()),
            bucket_action: Some(Action::AbandonAction(AbandonAction {})),
        });
    }

    /// Adds a holder (true: the set changed); updates the key's rate.
    fn join(
        &mut self,
        key: &str,
        rate: KeyRate,
        stream: StreamId,
        bucket: &BucketName,
        id: &BucketId,
    ) -> bool {
        let holders = self.keys.entry(key.to_owned()).or_insert_with(|| Holders {
            rate,
            list: Vec::new(),
            closed_until: 0,
        });
        holders.rate = rate;
        if holders
            .list
            .iter()
            .any(|h| h.stream == stream && &h.bucket == bucket)
        {
            return false;
        }
        holders.list.push(Holder {
            stream,
            bucket: bucket.clone(),
            id: id.clone(),
            sent: None,
            due: true,
            expires_ns: 0,
        });
        true
    }

    /// Removes a holder at once (its bucket is gone on Envoy's side).
    fn leave(&mut self, key: &str, stream: StreamId, bucket: &BucketName) -> bool {
        let Some(holders) = self.keys.get_mut(key) else {
            return false;
        };
        let before = holders.list.len();
        holders
            .list
            .retain(|h| !(h.stream == stream && &h.bucket == bucket));
        let changed = holders.list.len() != before;
        if holders.list.is_empty() {
            self.keys.remove(key);
        }
        changed
    }

    /// A reported holder is answered whatever changed (its TTL renewed).
    fn mark_due(&mut self, key: &str, stream: StreamId, bucket: &BucketName) {
        if let Some(h) = self.keys.get_mut(key).and_then(|hs| {
            hs.list
                .iter_mut()
                .find(|h| h.stream == stream && &h.bucket == bucket)
        }) {
            h.due = true;
        }
    }

    /// Splits the key among its holders on open streams (what holders on
    /// closed streams were last sent stays reserved for them until it
    /// expires) and sends every one whose grant changed, or is due.
    fn assign(&mut self, key: &str, now: u64, limits: Limits, out: &mut Outcome) {
        let Some(holders) = self.keys.get_mut(key) else {
            return;
        };
        let streams = &self.streams;
        let open = |h: &Holder| streams.get(&h.stream).is_some_and(|s| s.open);
        let mut left = holders.rate;
        for h in holders.list.iter().filter(|h| !open(h)) {
            if let Some(Grant::Bucket(s)) = h.sent {
                left.rate = left.rate.saturating_sub(reserved(s, left.per_secs));
                left.burst = left.burst.saturating_sub(u64::from(s.max_tokens));
            }
        }
        let live = holders.list.iter().filter(|h| open(h)).count();
        let closed = holders.closed_until > now;
        let ttl_ns = limits.ttl_secs.saturating_mul(NANOS_PER_SEC);
        let mut j = 0;
        for h in holders.list.iter_mut() {
            if !streams.get(&h.stream).is_some_and(|s| s.open) {
                continue;
            }
            let grant = if closed {
                Grant::DenyAll
            } else {
                split(left, live, j)
            };
            j = j.saturating_add(1);
            if h.sent == Some(grant) && !h.due {
                continue;
            }
            if h.sent != Some(grant) {
                out.changed = out.changed.saturating_add(1);
            }
            h.due = false;
            h.sent = Some(grant);
            h.expires_ns = now.saturating_add(ttl_ns).saturating_add(limits.margin_ns);
            out.send
                .entry(h.stream)
                .or_default()
                .push(action(&h.id, grant, limits.ttl_secs));
        }
    }

    /// Another limit of the key's plan refuses until `until`: every holder
    /// is sent `DENY_ALL` until then (the sweep reopens it).
    pub fn close_key(&mut self, key: &str, until: u64, now: u64, limits: Limits) -> Outcome {
        let mut out = Outcome::default();
        let Some(holders) = self.keys.get_mut(key) else {
            return out;
        };
        if until <= holders.closed_until {
            return out;
        }
        let was_open = holders.closed_until <= now;
        holders.closed_until = until;
        if was_open {
            self.assign(key, now, limits, &mut out);
        }
        out
    }

    /// Drops the holders whose assignment has expired on Envoy's side and
    /// re-splits their keys among the rest.
    pub fn expire(&mut self, now: u64, limits: Limits) -> Outcome {
        let mut out = Outcome::default();
        let mut dirty = Vec::new();
        let mut gone: Vec<(StreamId, BucketName)> = Vec::new();
        for (key, holders) in &mut self.keys {
            if holders.closed_until != 0 && holders.closed_until <= now {
                holders.closed_until = 0;
                dirty.push(key.clone());
            }
            let before = holders.list.len();
            holders.list.retain(|h| {
                let live = h.expires_ns == 0 || h.expires_ns > now;
                if !live {
                    gone.push((h.stream, h.bucket.clone()));
                }
                live
            });
            if holders.list.len() != before && dirty.last() != Some(key) {
                dirty.push(key.clone());
            }
        }
        self.keys.retain(|_, h| !h.list.is_empty());
        for (stream, bucket) in gone {
            // A live stream that stopped reporting a bucket re-joins with
            // its next report.
            if let Some(s) = self.streams.get_mut(&stream) {
                s.buckets.remove(&bucket);
            }
        }
        self.streams
            .retain(|id, s| s.open || self.keys.values().any(|h| h.list.iter().any(|x| x.stream == *id)));
        for key in dirty {
            self.assign(&key, now, limits, &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy;

    const S: u64 = NANOS_PER_SEC;
    const RATE: KeyRate = KeyRate {
        rate: 30,
        per_secs: 10,
        burst: 6,
    };
    const LIMITS: Limits = Limits {
        max_buckets_per_stream: 2,
        ttl_secs: 15,
        margin_ns: S,
        idle_reports: 3,
    };

    fn usage(tenant: &str, target: Target, allowed: u64) -> Usage {
        let id = BucketId {
            bucket: [("tenant".to_owned(), tenant.to_owned())].into_iter().collect(),
        };
        Usage {
            name: vec![("tenant".to_owned(), tenant.to_owned())],
            id,
            target,
            allowed,
            denied: 0,
        }
    }

    fn limited(tenant: &str, allowed: u64) -> Usage {
        usage(
            tenant,
            Target::Limit {
                key: format!("k|{tenant}"),
                rate: RATE,
            },
            allowed,
        )
    }

    /// The token buckets (max_tokens, tokens_per_fill) sent to `stream`.
    fn buckets(out: &Outcome, stream: StreamId) -> Vec<(u32, u32)> {
        out.send
            .get(&stream)
            .into_iter()
            .flatten()
            .filter_map(|a| match &a.bucket_action {
                Some(Action::QuotaAssignmentAction(q)) => {
                    match q.rate_limit_strategy.and_then(|s| s.strategy) {
                        Some(Strategy::TokenBucket(tb)) => {
                            Some((tb.max_tokens, tb.tokens_per_fill.map_or(0, |v| v.value)))
                        }
                        _ => None,
                    }
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_second_holder_halves_the_first_at_once() {
        let mut book = Book::default();
        book.open(1);
        book.open(2);
        let out = book.report(1, vec![limited("a", 0)], 0, LIMITS);
        assert_eq!(buckets(&out, 1), [(6, 30)]);
        let out = book.report(2, vec![limited("a", 0)], S, LIMITS);
        // The newcomer answered, the first pushed its half.
        assert_eq!(buckets(&out, 2), [(3, 15)]);
        assert_eq!(buckets(&out, 1), [(3, 15)]);
        assert_eq!(out.changed, 2);
        // A report renews an unchanged share (no change counted).
        let out = book.report(1, vec![limited("a", 4)], 5 * S, LIMITS);
        assert_eq!((buckets(&out, 1), out.changed), (vec![(3, 15)], 0));
        assert!(!out.send.contains_key(&2));
    }

    #[test]
    fn a_closed_streams_share_stays_reserved_until_it_expires() {
        let mut book = Book::default();
        book.open(1);
        book.open(2);
        book.report(1, vec![limited("a", 0)], 0, LIMITS);
        book.report(2, vec![limited("a", 0)], 0, LIMITS);
        book.close(2);
        // Its last assignment (sent at 0) lives 15 s (+1 s margin) in Envoy.
        assert!(book.expire(10 * S, LIMITS).send.is_empty());
        let out = book.report(1, vec![limited("a", 1)], 12 * S, LIMITS);
        assert_eq!(buckets(&out, 1), [(3, 15)]);
        let out = book.expire(16 * S + 1, LIMITS);
        assert_eq!(buckets(&out, 1), [(6, 30)]);
        assert_eq!(book.holders(), 1);
        assert_eq!(book.streams(), 1);
    }

    #[test]
    fn a_newcomer_shares_what_a_draining_holder_leaves() {
        let mut book = Book::default();
        for s in 1..=3 {
            book.open(s);
        }
        book.report(1, vec![limited("a", 0)], 0, LIMITS);
        book.close(1);
        // Holder 1 drains with 30 per 10 s and 6 tokens: nothing is left.
        let out = book.report(2, vec![limited("a", 0)], S, LIMITS);
        assert!(matches!(
            out.send.get(&2).and_then(|a| a.first()).and_then(|a| a.bucket_action),
            Some(Action::QuotaAssignmentAction(q)) if q.rate_limit_strategy == Some(strategy(Grant::DenyAll))
        ));
        // Holder 1 expires at 16 s; holder 2 (sent at 1 s) lives to 17 s.
        let out = book.expire(16 * S + 1, LIMITS);
        assert_eq!(buckets(&out, 2), [(6, 30)]);
    }

    #[test]
    fn an_idle_bucket_is_abandoned_and_its_share_released() {
        let mut book = Book::default();
        book.open(1);
        book.open(2);
        book.report(1, vec![limited("a", 1)], 0, LIMITS);
        book.report(2, vec![limited("a", 1)], 0, LIMITS);
        for i in 1..3 {
            let out = book.report(2, vec![limited("a", 0)], i * 5 * S, LIMITS);
            assert_eq!(out.abandoned, 0);
        }
        let out = book.report(2, vec![limited("a", 0)], 15 * S, LIMITS);
        assert_eq!(out.abandoned, 1);
        assert!(matches!(
            out.send
                .get(&2)
                .and_then(|a| a.first())
                .and_then(|a| a.bucket_action),
            Some(Action::AbandonAction(_))
        ));
        assert_eq!(buckets(&out, 1), [(6, 30)]);
    }

    #[test]
    fn buckets_beyond_the_cap_get_no_answer_and_others_allow_all() {
        let mut book = Book::default();
        book.open(1);
        let out = book.report(
            1,
            vec![
                usage("x", Target::Allow, 0),
                usage("y", Target::Count { key: "k|y".into() }, 0),
                limited("z", 0),
            ],
            0,
            LIMITS,
        );
        assert_eq!(out.refused, 1);
        let sent = out.send.get(&1).map_or(0, Vec::len);
        assert_eq!(sent, 2);
        assert!(out.send.get(&1).into_iter().flatten().all(|a| matches!(
            a.bucket_action,
            Some(Action::QuotaAssignmentAction(q)) if q.rate_limit_strategy == Some(strategy(Grant::AllowAll))
        )));
        assert_eq!(book.holders(), 0);
    }

    #[test]
    fn a_bucket_moved_to_another_key_leaves_the_first() {
        let mut book = Book::default();
        book.open(1);
        book.report(1, vec![limited("a", 0)], 0, LIMITS);
        let moved = usage(
            "a",
            Target::Limit {
                key: "other".into(),
                rate: RATE,
            },
            0,
        );
        let out = book.report(1, vec![moved], S, LIMITS);
        assert_eq!(buckets(&out, 1), [(6, 30)]);
        assert_eq!(book.holders(), 1);
    }
}
