//! The (key, limit) record's format 3 encoding, written by hand.
//!
//! Every key report reads its (key, limit) record and writes it back once,
//! in every store; through serde's visitors that was about two thirds of
//! a key report's CPU (`docs/central-service.md`, "Throughput"). This is
//! the same encoding ([`crate::codec`]) without them: the same
//! bytes, field for field in declaration order, checked against the
//! `Serialize`/`Deserialize` derives, which stay for formats 1 and 2 and
//! as the reference (the tests below). A field added to one of these
//! structs must be added here too, in the same place: the tests fail
//! until it is.

use std::collections::BTreeMap;

use tenantgate::sync::FailureMode;

use super::key::{KeyState, KeyStats, RegionView};
use super::node_key::NodeKey;
use super::session::Tally;
use super::{GlobalLimit, NodeTerms};
use crate::codec::{Compact, Decoder, Encoder, Result};

/// A `u64` field (tagged: see the codec).
impl Compact for u64 {
    fn write(&self, e: &mut Encoder<'_>) {
        e.u64(*self);
    }

    fn read(d: &mut Decoder<'_>) -> Result<u64> {
        d.u64()
    }
}

/// An `Option`, as serde writes it: its tag, then its value.
fn put_opt<T: Compact>(e: &mut Encoder<'_>, v: Option<&T>) {
    e.option(v.is_some());
    if let Some(v) = v {
        v.write(e);
    }
}

fn opt<T: Compact>(d: &mut Decoder<'_>) -> Result<Option<T>> {
    if d.option()? {
        T::read(d).map(Some)
    } else {
        Ok(None)
    }
}

/// A struct of `u64` fields alone, every one in every record (no serde
/// default).
macro_rules! u64_struct {
    ($t:ident { $($f:ident),+ $(,)? }) => {
        impl Compact for $t {
            fn write(&self, e: &mut Encoder<'_>) {
                e.fields([$(stringify!($f)),+].len());
                $(e.u64(self.$f);)+
            }

            fn read(d: &mut Decoder<'_>) -> Result<$t> {
                let mut f = d.fields([$(stringify!($f)),+].len())?;
                Ok($t {
                    $($f: f.required(d, stringify!($f), |d| d.u64())?,)+
                })
            }
        }
    };
}

u64_struct!(KeyStats {
    granted,
    reclaimed,
    written_off,
    precharged,
    debt_booked,
    repaid,
    consumed,
    unleased,
    demand,
});
u64_struct!(RegionView {
    allocated,
    fair,
    debt,
    borrowed_total,
    repaid_total,
});
u64_struct!(Tally {
    consumed,
    unleased,
    demand,
});

/// A `BTreeMap<String, T>`, as serde writes it: its length, then each
/// name and value in order.
fn put_map<T: Compact>(e: &mut Encoder<'_>, map: &BTreeMap<String, T>) {
    e.count(map.len());
    for (name, v) in map {
        e.str(name);
        v.write(e);
    }
}

fn map<T: Compact>(d: &mut Decoder<'_>) -> Result<BTreeMap<String, T>> {
    let n = d.count()?;
    let mut out = BTreeMap::new();
    for _ in 0..n {
        let name = d.string()?;
        let v = T::read(d)?;
        // As serde's: a name written twice keeps its last value.
        out.insert(name, v);
    }
    Ok(out)
}

impl Compact for KeyState {
    fn write(&self, e: &mut Encoder<'_>) {
        e.fields(11);
        self.limit.write(e);
        e.u64(self.bucket);
        e.u64(self.origin);
        e.uint(self.credited);
        put_map(e, &self.nodes);
        put_map(e, &self.regions);
        put_opt(e, self.interval.as_ref());
        put_opt(e, self.advanced_at.as_ref());
        e.u64(self.flow);
        e.u64(self.owed);
        self.stats.write(e);
    }

    fn read(d: &mut Decoder<'_>) -> Result<KeyState> {
        let mut f = d.fields(11)?;
        Ok(KeyState {
            limit: f.required(d, "limit", GlobalLimit::read)?,
            bucket: f.required(d, "bucket", |d| d.u64())?,
            origin: f.required(d, "origin", |d| d.u64())?,
            credited: f.required(d, "credited", |d| d.uint())?,
            nodes: f.required(d, "nodes", map)?,
            regions: f.required(d, "regions", map)?,
            interval: f.required(d, "interval", opt)?,
            advanced_at: f.required(d, "advanced_at", opt)?,
            flow: f.required(d, "flow", |d| d.u64())?,
            owed: f.required(d, "owed", |d| d.u64())?,
            stats: f.required(d, "stats", KeyStats::read)?,
        })
    }
}

impl Compact for GlobalLimit {
    fn write(&self, e: &mut Encoder<'_>) {
        e.fields(5);
        e.u64(self.limit);
        e.u64(self.window_ns);
        e.u64(self.burst);
        e.u64(self.max_cost);
        e.u64(self.month);
    }

    fn read(d: &mut Decoder<'_>) -> Result<GlobalLimit> {
        let mut f = d.fields(5)?;
        Ok(GlobalLimit {
            limit: f.required(d, "limit", |d| d.u64())?,
            window_ns: f.required(d, "window_ns", |d| d.u64())?,
            burst: f.required(d, "burst", |d| d.u64())?,
            // `#[serde(default = "one")]`
            max_cost: f.next(d, |d| d.u64())?.unwrap_or(1),
            // A record written before calendar months: a token bucket.
            month: f.next(d, |d| d.u64())?.unwrap_or(0),
        })
    }
}

impl Compact for NodeTerms {
    fn write(&self, e: &mut Encoder<'_>) {
        e.fields(3);
        e.u64(self.timeout_ns);
        e.u64(self.local_max_ns);
        e.bool(self.outage_allowance);
    }

    fn read(d: &mut Decoder<'_>) -> Result<NodeTerms> {
        let mut f = d.fields(3)?;
        Ok(NodeTerms {
            timeout_ns: f.required(d, "timeout_ns", |d| d.u64())?,
            local_max_ns: f.required(d, "local_max_ns", |d| d.u64())?,
            outage_allowance: f.next(d, |d| d.bool())?.unwrap_or_default(),
        })
    }
}

/// Its variant's index in declaration order, as serde writes a unit
/// variant.
impl Compact for FailureMode {
    fn write(&self, e: &mut Encoder<'_>) {
        e.variant(match self {
            FailureMode::FailOpenLocal => 0,
            FailureMode::FailClosed => 1,
            FailureMode::FailOpen => 2,
        });
    }

    fn read(d: &mut Decoder<'_>) -> Result<FailureMode> {
        match d.variant()? {
            0 => Ok(FailureMode::FailOpenLocal),
            1 => Ok(FailureMode::FailClosed),
            2 => Ok(FailureMode::FailOpen),
            other => Err(Decoder::unknown("failure mode", other)),
        }
    }
}

/// Fields before `share_milli` are in every record; those from it on were
/// appended with `#[serde(default)]`.
const NODE_KEY_FIELDS: usize = 31;

impl Compact for NodeKey {
    fn write(&self, e: &mut Encoder<'_>) {
        e.fields(NODE_KEY_FIELDS);
        e.str(&self.region);
        e.u64(self.reserve);
        e.u64(self.lease_tokens);
        e.u64(self.lease_seq);
        e.bool(self.collapsed);
        e.u64(self.granted_at);
        put_opt(e, self.share.as_ref());
        e.bool(self.kept_local);
        e.u64(self.level);
        e.u64(self.share_sent);
        e.u64(self.share_acked);
        e.u64(self.share_unacked);
        e.f64(self.demand);
        e.u64(self.last_report_at);
        e.u64(self.assumed);
        e.u64(self.charged_until);
        e.uint(self.charge_carry);
        e.u64(self.written_off);
        put_opt(e, self.heard_at.as_ref());
        e.u64(self.share_milli);
        e.u64(self.share_carry);
        e.int(i128::from(self.credit));
        put_opt(e, self.terms.as_ref());
        put_opt(e, self.mode.as_ref());
        e.u64(self.outage_sent);
        e.u64(self.outage_acked);
        e.u64(self.outage_unacked);
        e.u64(self.boot);
        e.u64(self.applied_seq);
        e.u64(self.base);
        self.counted.write(e);
    }

    fn read(d: &mut Decoder<'_>) -> Result<NodeKey> {
        let mut f = d.fields(NODE_KEY_FIELDS)?;
        Ok(NodeKey {
            region: f.required(d, "region", |d| d.string())?,
            reserve: f.required(d, "reserve", |d| d.u64())?,
            lease_tokens: f.required(d, "lease_tokens", |d| d.u64())?,
            lease_seq: f.required(d, "lease_seq", |d| d.u64())?,
            collapsed: f.required(d, "collapsed", |d| d.bool())?,
            granted_at: f.required(d, "granted_at", |d| d.u64())?,
            share: f.required(d, "share", opt)?,
            kept_local: f.required(d, "kept_local", |d| d.bool())?,
            level: f.required(d, "level", |d| d.u64())?,
            share_sent: f.required(d, "share_sent", |d| d.u64())?,
            share_acked: f.required(d, "share_acked", |d| d.u64())?,
            share_unacked: f.required(d, "share_unacked", |d| d.u64())?,
            demand: f.required(d, "demand", |d| d.f64())?,
            last_report_at: f.required(d, "last_report_at", |d| d.u64())?,
            assumed: f.required(d, "assumed", |d| d.u64())?,
            charged_until: f.required(d, "charged_until", |d| d.u64())?,
            charge_carry: f.required(d, "charge_carry", |d| d.uint())?,
            written_off: f.required(d, "written_off", |d| d.u64())?,
            heard_at: f.required(d, "heard_at", opt)?,
            share_milli: f.next(d, |d| d.u64())?.unwrap_or_default(),
            share_carry: f.next(d, |d| d.u64())?.unwrap_or_default(),
            credit: f.next(d, |d| d.int())?.unwrap_or_default(),
            terms: f.next(d, opt)?.unwrap_or_default(),
            mode: f.next(d, opt)?.unwrap_or_default(),
            outage_sent: f.next(d, |d| d.u64())?.unwrap_or_default(),
            outage_acked: f.next(d, |d| d.u64())?.unwrap_or_default(),
            outage_unacked: f.next(d, |d| d.u64())?.unwrap_or_default(),
            boot: f.next(d, |d| d.u64())?.unwrap_or_default(),
            applied_seq: f.next(d, |d| d.u64())?.unwrap_or_default(),
            base: f.next(d, |d| d.u64())?.unwrap_or_default(),
            counted: f.next(d, Tally::read)?.unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{from_slice, from_slice_compact, to_writer, to_writer_compact};

    fn serde_bytes<T: serde::Serialize>(v: &T) -> Vec<u8> {
        let mut out = Vec::new();
        to_writer(&mut out, v).unwrap();
        out
    }

    fn compact_bytes<T: Compact>(v: &T) -> Vec<u8> {
        let mut out = Vec::new();
        to_writer_compact(&mut out, v).unwrap();
        out
    }

    /// A node's share of a key with every field set to something other
    /// than its default, `salt` varying them.
    fn node_key(salt: u64, region: &str) -> NodeKey {
        let t = 1_796_083_200_000_000_000 + salt * 1_000_000_007;
        NodeKey {
            region: region.to_owned(),
            reserve: salt,
            lease_tokens: salt * 3 + 1,
            lease_seq: 40 + salt,
            collapsed: salt % 2 == 0,
            granted_at: t,
            share: (salt % 3 != 0).then_some(salt * 7),
            kept_local: salt % 2 == 1,
            level: u64::MAX - salt,
            share_sent: 5,
            share_acked: 4,
            share_unacked: 6,
            demand: 0.1 * salt as f64 + 1.0 / 3.0,
            last_report_at: t + 2_000_000_000,
            assumed: 9,
            charged_until: t.saturating_sub(1_000_000_000),
            charge_carry: u128::MAX - u128::from(salt),
            written_off: 2,
            heard_at: (salt % 4 != 1).then_some(t + 5),
            share_milli: 33_333,
            share_carry: 333,
            credit: -(salt as i64) * 1_000 - 1,
            terms: (salt % 2 == 0).then_some(NodeTerms {
                timeout_ns: 200_000_000,
                local_max_ns: 300_000_000_000,
                outage_allowance: salt % 4 == 0,
            }),
            mode: match salt % 4 {
                0 => None,
                1 => Some(FailureMode::FailOpenLocal),
                2 => Some(FailureMode::FailClosed),
                _ => Some(FailureMode::FailOpen),
            },
            outage_sent: 10,
            outage_acked: 11,
            outage_unacked: 12,
            boot: t - 7,
            applied_seq: 41 + salt,
            base: 39 + salt,
            counted: Tally {
                consumed: salt,
                unleased: 1,
                demand: salt + 2,
            },
        }
    }

    fn key_state(nodes: u64) -> KeyState {
        let limit = GlobalLimit {
            limit: 10_000,
            window_ns: 60_000_000_000,
            burst: 1_000,
            max_cost: 7,
            month: 0,
        };
        let mut ks = KeyState::new(limit, 1_796_083_200_000_000_000);
        ks.credited = u128::from(u64::MAX) * 3;
        ks.interval = Some(29_934_720);
        ks.flow = 166;
        ks.owed = 3;
        // Every field its own value: a field written out of place shows.
        ks.stats = KeyStats {
            granted: 12,
            reclaimed: 13,
            written_off: 14,
            precharged: 15,
            debt_booked: 16,
            repaid: 17,
            consumed: 18,
            unleased: 19,
            demand: 99,
        };
        for n in 0..nodes {
            let region = format!("region-{}", n % 3);
            ks.nodes.insert(format!("node-{n}"), node_key(n, &region));
            let r = ks.regions.entry(region).or_default();
            r.allocated += n;
            r.fair = 3 + n;
            r.debt = 5 + n * 2;
            r.borrowed_total = 7 + n;
            r.repaid_total = 11 + n;
        }
        ks
    }

    #[test]
    fn the_hand_written_encoding_is_serdes_byte_for_byte() {
        for nodes in [0, 1, 4, 9] {
            let ks = key_state(nodes);
            let by_serde = serde_bytes(&ks);
            assert_eq!(compact_bytes(&ks), by_serde, "{nodes} nodes");
            let back: KeyState = from_slice_compact(&by_serde).unwrap();
            assert_eq!(format!("{back:?}"), format!("{ks:?}"), "{nodes} nodes");
            let by_serde_back: KeyState = from_slice(&by_serde).unwrap();
            assert_eq!(format!("{back:?}"), format!("{by_serde_back:?}"));
        }
        // Records the allocator itself wrote, a token bucket's and a
        // calendar month's (in UTC: its zone's tag, plus one).
        for month in [0, 50_401] {
            let fresh = KeyState::new(
                GlobalLimit {
                    limit: 100,
                    window_ns: 60_000_000_000,
                    burst: 100,
                    max_cost: 1,
                    month,
                },
                5,
            );
            assert_eq!(compact_bytes(&fresh), serde_bytes(&fresh));
            let back: KeyState = from_slice_compact(&serde_bytes(&fresh)).unwrap();
            assert_eq!(back.limit.month, month);
            assert_eq!(back.limit.calendar().is_some(), month != 0);
        }
    }

    #[test]
    fn fields_an_older_record_lacks_take_their_serde_defaults() {
        // A GlobalLimit before `max_cost`, a NodeTerms before
        // `outage_allowance`: both read as serde reads them.
        #[derive(serde::Serialize)]
        struct OldLimit {
            limit: u64,
            window_ns: u64,
            burst: u64,
        }
        #[derive(serde::Serialize)]
        struct OldTerms {
            timeout_ns: u64,
            local_max_ns: u64,
        }
        let old = serde_bytes(&OldLimit {
            limit: 5,
            window_ns: 6,
            burst: 7,
        });
        let l: GlobalLimit = from_slice_compact(&old).unwrap();
        assert_eq!(l, from_slice::<GlobalLimit>(&old).unwrap());
        assert_eq!(l.max_cost, 1);
        let old = serde_bytes(&OldTerms {
            timeout_ns: 1,
            local_max_ns: 2,
        });
        let t: NodeTerms = from_slice_compact(&old).unwrap();
        assert_eq!(t, from_slice::<NodeTerms>(&old).unwrap());
        assert!(!t.outage_allowance);
    }

    #[test]
    fn corrupt_and_newer_records_are_refused_as_serde_refuses_them() {
        let bytes = serde_bytes(&key_state(2));
        // Every truncation, and one byte more.
        for cut in 0..bytes.len() {
            assert!(
                from_slice_compact::<KeyState>(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(from_slice_compact::<KeyState>(&longer).is_err());
        // A struct with a field this build does not know.
        let mut newer = bytes.clone();
        newer[0] = 12;
        assert!(from_slice_compact::<KeyState>(&newer).is_err());
        assert!(from_slice::<KeyState>(&newer).is_err());
        // An unknown failure mode.
        let mut e = Vec::new();
        to_writer(&mut e, &7u32).unwrap();
        assert!(from_slice_compact::<FailureMode>(&e).is_err());
        // Every single-byte corruption either fails or decodes to what
        // serde decodes: the two readers never disagree.
        for i in 0..bytes.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut b = bytes.clone();
                b[i] ^= flip;
                let ours = from_slice_compact::<KeyState>(&b).map(|k| format!("{k:?}"));
                let theirs = from_slice::<KeyState>(&b).map(|k| format!("{k:?}"));
                assert_eq!(ours.is_ok(), theirs.is_ok(), "byte {i} ^ {flip:#x}");
                if let (Ok(a), Ok(b)) = (ours, theirs) {
                    assert_eq!(a, b, "byte {i} ^ {flip:#x}");
                }
            }
        }
    }
}
