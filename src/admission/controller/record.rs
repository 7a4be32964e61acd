//! The controller's state in shared data: [`State`]'s bytes in its
//! record (`tg2|c|<dep>`, kind [`kind::CONTROL`]), versioned.

use super::{Inputs, Move, Phase, State};
use crate::keys::kind;
use crate::table::{self, Record};

/// Version 2 added the noise, the anchor, the recovery level and the
/// refresh's first window; version 1 records still decode (without them).
const VERSION: u8 = 2;

/// Every [`Move`] by its byte.
const MOVES: [Move; 9] = [
    Move::Idle,
    Move::Held,
    Move::Increase,
    Move::Gradient,
    Move::ErrorBackoff,
    Move::QueueBackoff,
    Move::Refresh,
    Move::Measured,
    Move::Probe,
];

impl State {
    pub(in crate::admission) fn encode(&self, out: &mut Vec<u8>) {
        out.push(VERSION);
        for v in [
            self.limit_milli,
            self.baseline_ns,
            self.next_refresh,
            self.last_index,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.push(match self.phase {
            Phase::Normal => 0,
            Phase::Draining => 1,
            Phase::Measuring => 2,
        });
        out.push(self.direction as u8);
        out.extend_from_slice(&self.reversals.to_le_bytes());
        out.extend_from_slice(&self.gradient_ppm.to_le_bytes());
        out.extend_from_slice(&self.noise_ppm.to_le_bytes());
        out.extend_from_slice(&self.refresh_samples.to_le_bytes());
        out.extend_from_slice(&self.held_windows.to_le_bytes());
        out.push(u8::from(self.refresh_on_bad));
        for v in [self.anchor_milli, self.recover_milli, self.refresh_p95_ns] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.push(self.last_move as u8);
        let i = &self.inputs;
        for v in [i.completed, i.error_ppm, i.peak_in_flight, i.cap] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in [i.p95_ns, i.min_ns, i.oldest_queue_ns] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    pub(in crate::admission) fn decode(record: &Record<'_>) -> Option<State> {
        if record.kind != kind::CONTROL {
            return None;
        }
        let mut r = table::layout::Reader(record.state);
        let version = r.u8()?;
        if version != VERSION && version != 1 {
            return None;
        }
        let (limit_milli, baseline_ns, next_refresh, last_index) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
        let phase = match r.u8()? {
            0 => Phase::Normal,
            1 => Phase::Draining,
            2 => Phase::Measuring,
            _ => return None,
        };
        let direction = r.u8()? as i8;
        let reversals = r.u32()?;
        let gradient_ppm = r.u32()?;
        let (noise_ppm, refresh_samples, held_windows, refresh_on_bad) = if version == 1 {
            (0, 0, 0, false)
        } else {
            (r.u32()?, r.u32()?, r.u32()?, r.u8()? != 0)
        };
        let (anchor_milli, recover_milli, refresh_p95_ns) = if version == 1 {
            (0, 0, 0)
        } else {
            (r.u64()?, r.u64()?, r.u64()?)
        };
        let last_move = MOVES.get(usize::from(r.u8()?)).copied()?;
        let (completed, error_ppm, peak_in_flight) = (r.u32()?, r.u32()?, r.u32()?);
        let cap = if version == 1 { 0 } else { r.u32()? };
        let (p95_ns, min_ns, oldest_queue_ns) = (r.u64()?, r.u64()?, r.u64()?);
        r.is_empty().then_some(State {
            limit_milli,
            baseline_ns,
            phase,
            next_refresh,
            last_index,
            direction,
            reversals,
            gradient_ppm,
            held_windows,
            noise_ppm,
            anchor_milli,
            recover_milli,
            refresh_p95_ns,
            refresh_samples,
            refresh_on_bad,
            last_move,
            inputs: Inputs {
                completed,
                p95_ns,
                min_ns,
                error_ppm,
                oldest_queue_ns,
                peak_in_flight,
                cap,
            },
        })
    }
}
