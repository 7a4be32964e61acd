//! What one node is granted of a (key, limit) ([`super::KeyState::grant`]):
//! its entitlement this interval, the demand it may draw beyond it, and
//! the lease and share recorded on its `NodeKey`.

use super::{Enforced, MILLI};
use crate::alloc::node_key::NodeKey;
use crate::alloc::AllocConfig;

/// What a node is due this interval: its share (whole and in
/// thousandths), its lease's level and the credit it may draw (units).
pub(super) struct Entitlement {
    pub(super) share: u64,
    pub(super) share_milli: u64,
    pub(super) level: u64,
    pub(super) credit: u64,
}

/// What the rate leaves a node's local limit: the outage allowance (an
/// equal split) and the room beside every other node's local limit, both
/// in thousandths per interval.
pub(super) struct Room {
    pub(super) equal_milli: u64,
    pub(super) room_milli: u64,
}

/// The share a lease carries: whole, in thousandths, and the outage
/// allowance (a node whose local limit runs at it).
pub(super) struct SentShare {
    pub(super) share: u64,
    pub(super) share_milli: u64,
    pub(super) outage_milli: Option<u64>,
}

/// What node `nk` is due: its allocated share, or before its first
/// allocation its demand within an equal split of `flow`.
pub(super) fn entitlement(
    nk: &NodeKey,
    flow: u64,
    nodes_hint: u64,
    max_cost: u64,
    cfg: &AllocConfig,
) -> Entitlement {
    match nk.share {
        // A node may draw one interval's share ahead of its credit
        // (its lease must last until the next one arrives).
        Some(share) => Entitlement {
            share,
            share_milli: nk.share_milli,
            level: nk.level,
            credit: u64::try_from(nk.credit.saturating_add_unsigned(nk.share_milli).max(0)).unwrap_or(0)
                / MILLI,
        },
        None => {
            // Not allocated yet this interval: its reported demand,
            // within an equal split, until the next allocation; it
            // draws only from the surplus until then.
            let demand = nk.demand.ceil() as u64;
            let share = demand.min(flow / nodes_hint.max(1)).max(cfg.node_floor);
            let level = share.saturating_mul(cfg.lease_factor_pct).div_ceil(100);
            Entitlement {
                share,
                share_milli: share.saturating_mul(MILLI),
                level: level.max(max_cost),
                credit: 0,
            }
        }
    }
}

/// Beyond its share's level, one interval of the node's demand, out
/// of the surplus only: a full bucket (a cold key's burst) goes to
/// the nodes that ask for it. One interval, not the lease factor's
/// 1.5: a node's next lease tops it up again an interval later,
/// while half an interval more would be taken from nodes whose
/// first report comes later in the interval.
pub(super) fn demand_beyond_share(nk: &NodeKey, burst: u64) -> u64 {
    let by_demand = nk.demand.ceil();
    if by_demand.is_finite() && by_demand > 0.0 {
        (by_demand as u64).min(burst)
    } else {
        0
    }
}

/// Records on `nk` the lease of `tokens` granted now under `enforced`
/// terms, and the share it carries.
pub(super) fn record_lease(
    nk: &mut NodeKey,
    due: &Entitlement,
    tokens: u64,
    enforced: &Enforced,
    room: &Room,
    now: u64,
) -> SentShare {
    nk.reserve = nk.reserve.max(tokens);
    let sent = if enforced.terms.outage_allowance {
        // Its local limit runs at the allowance: the share only paces
        // its lease (and its `Retry-After`).
        let outage = room.equal_milli.min(room.room_milli);
        nk.outage_sent = outage;
        nk.outage_unacked = nk.outage_unacked.max(outage);
        SentShare {
            share: due.share,
            share_milli: due.share_milli,
            outage_milli: Some(outage),
        }
    } else {
        // An older node runs its local limit at its whole share.
        SentShare {
            share: due.share.min(room.room_milli / MILLI),
            share_milli: due.share_milli.min(room.room_milli),
            outage_milli: None,
        }
    };
    nk.share_sent = sent.share;
    nk.share_unacked = nk.share_unacked.max(sent.share);
    nk.lease_tokens = tokens;
    nk.lease_seq = enforced.seq;
    nk.collapsed = false;
    nk.granted_at = now;
    nk.charged_until = now;
    nk.charge_carry = 0;
    nk.terms = Some(enforced.terms);
    nk.mode = Some(enforced.mode);
    sent
}
