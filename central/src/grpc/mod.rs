//! Envoy's rate limit protocols, served by `tenantgate serve --grpc-listen`
//! over gRPC (tonic, HTTP/2): the rate limit service ([`rls`], for Envoy's
//! native `envoy.filters.http.ratelimit`) and the rate limit quota service
//! ([`rlqs`], for its native `envoy.filters.http.rate_limit_quota`), from
//! one policy and one count per key. The protocol types are
//! `envoy-types`' (generated from Envoy's own protos).
//!
//! The gRPC listener follows the sync listener's conventions
//! (`crate::listener`): plain on loopback (h2c), mTLS (ALPN `h2`) with
//! client certificates signed by `--client-ca` elsewhere, and it refuses to
//! start beyond loopback without them unless `--insecure`. Any client the
//! CA signed may ask (RLS requests name no node).

pub mod counters;
pub mod rlqs;
pub mod rls;

use std::sync::{Arc, RwLock};

use self::counters::{Counters, MemoryCounters, RedisCounters};
use self::rls::RlsPolicy;

/// The descriptor rules in force for the RLS and the RLQS, and when they
/// took effect (the reload rule's epoch: a reload of the same rules keeps
/// it).
pub struct PolicyInForce {
    current: RwLock<InForce>,
}

struct InForce {
    policy: Arc<RlsPolicy>,
    effective_from: u64,
}

impl Default for PolicyInForce {
    fn default() -> PolicyInForce {
        PolicyInForce {
            current: RwLock::new(InForce {
                policy: Arc::new(RlsPolicy::default()),
                effective_from: 0,
            }),
        }
    }
}

impl PolicyInForce {
    /// Puts `policy` in force at `now` unless the same rules already are.
    pub fn set(&self, policy: RlsPolicy, now: u64) {
        let mut guard = self.current.write().unwrap_or_else(|e| e.into_inner());
        if *guard.policy != policy {
            *guard = InForce {
                policy: Arc::new(policy),
                effective_from: now,
            };
        }
    }

    /// The rules in force and when they took effect.
    pub fn get(&self) -> (Arc<RlsPolicy>, u64) {
        let guard = self.current.read().unwrap_or_else(|e| e.into_inner());
        (guard.policy.clone(), guard.effective_from)
    }
}

/// The longest record name written as is (see [`record_key`]).
pub const MAX_PLAIN_RECORD_KEY: usize = 512;

/// The name of a matched descriptor's records: `<rule path>|<tenant>`, or,
/// past [`MAX_PLAIN_RECORD_KEY`] bytes (rules and values may be up to 64
/// KiB each), `sha256:` and that text's SHA-256 in hex, so a record's name
/// costs at most a few hundred bytes whatever the descriptor.
pub fn record_key(path: &str, tenant: &str) -> String {
    use sha2::{Digest, Sha256};
    let plain = format!("{path}|{tenant}");
    if plain.len() <= MAX_PLAIN_RECORD_KEY {
        return plain;
    }
    let digest = Sha256::digest(plain.as_bytes());
    let mut out = String::from("sha256:");
    for b in digest.iter() {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// The RLS's records in the store `--store` names (`embedded` or a
/// `redis://` URL), at most `max_keys` of them when embedded.
pub fn open_counters(spec: &str, max_keys: u64) -> Result<Arc<dyn Counters>, String> {
    if spec == "embedded" {
        return Ok(Arc::new(MemoryCounters::new(
            usize::try_from(max_keys).unwrap_or(usize::MAX),
        )));
    }
    if spec.starts_with("redis://") {
        return RedisCounters::new(spec, "tg")
            .map(|s| Arc::new(s) as Arc<dyn Counters>)
            .map_err(|e| e.to_string());
    }
    if spec.starts_with("redis+cluster://") {
        return Err(format!(
            "--store {spec}: --grpc-listen (the RLS) runs on `embedded` or a redis:// URL, not on \
             Redis Cluster (a request's descriptors are charged all or nothing, and their keys span slots)"
        ));
    }
    Err(format!("--store {spec}: expected `embedded` or a redis:// URL"))
}

/// The gRPC services `--grpc-listen` serves.
#[derive(Clone)]
pub struct Services {
    pub rls: Arc<rls::Rls>,
    pub rlqs: Arc<rlqs::Rlqs>,
}

/// The gRPC services as one axum router (tonic's routes), decoding
/// messages of up to [`crate::bounded::DEFAULT_MAX_GRPC_MESSAGE_BYTES`].
pub fn router(services: Services) -> axum::Router {
    router_with(services, crate::bounded::DEFAULT_MAX_GRPC_MESSAGE_BYTES)
}

/// [`router`], decoding messages of up to `max_message_bytes` (a larger
/// one is refused unread, `OUT_OF_RANGE`).
pub fn router_with(services: Services, max_message_bytes: usize) -> axum::Router {
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
    tonic::service::Routes::new(
        RateLimitServiceServer::from_arc(services.rls).max_decoding_message_size(max_message_bytes),
    )
    .add_service(
        RateLimitQuotaServiceServer::new(rlqs::RlqsService(services.rlqs))
            .max_decoding_message_size(max_message_bytes),
    )
    .into_axum_router()
}
