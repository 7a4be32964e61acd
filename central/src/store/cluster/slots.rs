//! Where a record lives in a Redis Cluster: its hash slot ([`slot_of`]),
//! a request's records grouped by slot ([`by_slot`]), which master serves
//! each slot ([`SlotMap`], from `CLUSTER SLOTS`), and the cluster's own
//! transient errors. Beneath the store (`mod.rs`).

use std::collections::{BTreeMap, HashMap};

use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use redis::{ErrorKind, RedisError, ServerErrorKind, Value};

use crate::store::redis::map_err;
use crate::store::StoreError;

/// One slot's records of a request: the slot, and the records' indexes in
/// the request's order.
pub(super) struct Group {
    pub(super) slot: u16,
    pub(super) members: Vec<usize>,
}

/// Slots in a Redis Cluster.
pub(super) const SLOTS: u16 = 16_384;

/// A record's hash slot, as Redis Cluster computes it: CRC16 (XMODEM) of
/// the hash tag (what is between the first `{` and the first `}` after
/// it, if not empty), else of the whole name, modulo 16,384.
pub(super) fn slot_of(record: &str) -> u16 {
    let b = record.as_bytes();
    let tag = b
        .iter()
        .position(|c| *c == b'{')
        .and_then(|open| {
            let rest = b.get(open + 1..)?;
            let close = rest.iter().position(|c| *c == b'}')?;
            rest.get(..close).filter(|t| !t.is_empty())
        })
        .unwrap_or(b);
    crc16::State::<crc16::XMODEM>::calculate(tag) % SLOTS
}

/// `records` grouped by slot (in the order each slot first appears).
pub(super) fn by_slot(records: &[String]) -> Vec<Group> {
    let mut index: HashMap<u16, usize> = HashMap::with_capacity(records.len());
    let mut groups: Vec<Group> = Vec::new();
    for (i, r) in records.iter().enumerate() {
        let slot = slot_of(r);
        let g = *index.entry(slot).or_insert_with(|| {
            groups.push(Group {
                slot,
                members: Vec::new(),
            });
            groups.len() - 1
        });
        if let Some(g) = groups.get_mut(g) {
            g.members.push(i);
        }
    }
    groups
}

/// Which master serves each slot (`CLUSTER SLOTS`), read once and again
/// after any error: it only *groups* a request's slots by master, one
/// pipeline each. Every pipeline is still routed by its first slot through
/// the client's own map (which follows `MOVED` and failovers), so a stale
/// map costs a `MOVED` answer for a slot that moved (the request fails,
/// `503`, and the map is read again), never a write to the wrong master. A
/// failover moves a master's slots together, so it leaves the groups
/// right.
#[derive(Default)]
pub(super) struct SlotMap {
    /// (first slot, last slot, master's index), sorted by first slot.
    ranges: Vec<(u16, u16, usize)>,
    /// One slot of each master (its lowest), to route a `SCAN` to it.
    pub(super) masters: Vec<u16>,
}

impl SlotMap {
    /// The map `CLUSTER SLOTS` answered (ranges it cannot read are left
    /// out: their slots get a pipeline of their own).
    pub(super) fn parse(v: Value) -> Result<SlotMap, StoreError> {
        let Value::Array(ranges) = v else {
            return Err(StoreError::Refused(format!("CLUSTER SLOTS answered {v:?}")));
        };
        let mut by_master: BTreeMap<String, usize> = BTreeMap::new();
        let mut map = SlotMap::default();
        for range in ranges {
            let Value::Array(fields) = range else { continue };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                continue;
            };
            let (Ok(start), Ok(end)) = (u16::try_from(*start), u16::try_from(*end)) else {
                continue;
            };
            if end < start || end >= SLOTS {
                continue;
            }
            let id = format!("{:?}", master.get(..2));
            let next = by_master.len();
            let m = *by_master.entry(id).or_insert(next);
            if m == map.masters.len() {
                map.masters.push(start);
            }
            if let Some(lowest) = map.masters.get_mut(m) {
                *lowest = (*lowest).min(start);
            }
            map.ranges.push((start, end, m));
        }
        map.ranges.sort_unstable();
        Ok(map)
    }

    pub(super) fn master(&self, slot: u16) -> Option<usize> {
        let i = self.ranges.partition_point(|r| r.0 <= slot);
        let r = self.ranges.get(i.checked_sub(1)?)?;
        (slot <= r.1).then_some(r.2)
    }

    /// `groups` batched by master: each batch the indexes of its groups
    /// (a slot no master is known for: a batch of its own).
    pub(super) fn batches(&self, groups: &[Group]) -> Vec<Vec<usize>> {
        let mut index: HashMap<usize, usize> = HashMap::new();
        let mut out: Vec<Vec<usize>> = Vec::new();
        for (g, group) in groups.iter().enumerate() {
            let b = match self.master(group.slot) {
                Some(m) => *index.entry(m).or_insert_with(|| {
                    out.push(Vec::new());
                    out.len() - 1
                }),
                None => {
                    out.push(Vec::new());
                    out.len() - 1
                }
            };
            if let Some(b) = out.get_mut(b) {
                b.push(g);
            }
        }
        out
    }
}

/// The route to the master that serves `slot`.
pub(super) fn to_master(slot: u16) -> SingleNodeRoutingInfo {
    SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master))
}

/// A reply in a pipeline, typed; a redirection or a cluster that is down
/// is transient (`503`: the node retries).
pub(super) fn reply<T: redis::FromRedisValue>(v: Value) -> Result<T, StoreError> {
    let v = v.extract_error().map_err(cluster_err)?;
    redis::from_redis_value(v).map_err(|e| cluster_err(e.into()))
}

/// [`map_err`], with the cluster's own transient errors (`MOVED`, `ASK`,
/// `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `READONLY`) as unavailable.
pub(super) fn cluster_err(e: RedisError) -> StoreError {
    let failing_over = matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::MasterDown | ServerErrorKind::ReadOnly)
    );
    if e.is_cluster_error() || failing_over {
        StoreError::Unavailable(e.to_string())
    } else {
        map_err(e)
    }
}
