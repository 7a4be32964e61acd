//! The node's session id (`SyncRequest::boot`): one value per Envoy process,
//! the same for every worker, new after a restart.
//!
//! Shared data lives exactly as long as the process (it has no delete and
//! survives plugin reloads), so the id is kept there under [`BOOT_KEY`]: the
//! first worker to sync writes it, every later read returns it. Two workers
//! racing on the very first sync may send two ids for a moment; the service
//! then starts one extra session, which takes the counts whole (an error
//! toward admitting less, never more).
//!
//! The value is the time of that first sync in nanoseconds, mixed
//! (splitmix64) and never 0 (0 means "no session" to the service). It need
//! not be secret: what keeps another party from reporting in a node's name
//! is the service's mTLS identity check, not this id. It only has to differ
//! from the previous process's, which a clock in nanoseconds does.

use crate::host::{Host, HostError};

/// The shared-data key of the session id (8 bytes, little endian).
const BOOT_KEY: &str = crate::keys::SYNC_BOOT;

/// splitmix64's finalizer: spreads a clock reading over all 64 bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn decode(bytes: &[u8]) -> Option<u64> {
    let b: [u8; 8] = bytes.get(..8)?.try_into().ok()?;
    Some(u64::from_le_bytes(b)).filter(|v| *v != 0)
}

/// This process's session id, made at `now` (ns) if there is none yet.
pub fn boot_id<H: Host>(host: &H, now: u64) -> Result<u64, HostError> {
    let (value, cas) = host.shared_get(BOOT_KEY)?;
    if let Some(id) = value.as_deref().and_then(decode) {
        return Ok(id);
    }
    let id = mix(now).max(1);
    host.shared_set(BOOT_KEY, &id.to_le_bytes(), cas)?;
    // Whoever won the write, the stored id is the one every worker sends.
    let (value, _) = host.shared_get(BOOT_KEY)?;
    Ok(value.as_deref().and_then(decode).unwrap_or(id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryHost;

    #[test]
    fn one_id_per_process_and_a_new_one_after_a_restart() {
        let host = MemoryHost::new(Default::default());
        let first = boot_id(&host, 1_000).unwrap();
        assert_ne!(first, 0);
        // Every later sync, on any worker, sends the same id.
        assert_eq!(boot_id(&host, 9_999_999).unwrap(), first);
        // A restarted process has empty shared data: another id.
        let restarted = MemoryHost::new(Default::default());
        assert_ne!(boot_id(&restarted, 2_000).unwrap(), first);
    }
}
