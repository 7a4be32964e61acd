//! The batched sync exchange between a node and the central cluster (JSON).
//!
//! Once per sync interval a node sends one [`SyncRequest`] with every
//! (key, limit) it has activity for, and the service answers one
//! [`SyncResponse`] with a [`Lease`] per reported (key, limit).
//!
//! # Semantics of the numbers
//! * `Report::consumed`, `unleased` and `demand` count units **since the
//!   last acknowledged report**: a node resets them only when a response
//!   with `ack_seq` equal to the request's `seq` is applied. A report lost in
//!   flight (request or response) is therefore carried again, merged, by the
//!   next one, and the service subtracts what it already counted for that
//!   node since the node's `acked_seq` (see `tenantgate-central`). Nothing
//!   is lost, and nothing is counted twice while the service keeps its state.
//! * `demand` includes denied requests; `consumed` only admitted ones;
//!   `unleased` is the part of `consumed` admitted with no lease (the
//!   provisional allowance of a new key, or a failure mode after the lease
//!   expired). The service books `unleased` as debt.
//! * `Lease::tokens` is what the node may admit for the (key, limit)
//!   **counted from the moment it sent the request** this answers: on
//!   receipt the node subtracts what it admitted against its lease since
//!   then. The lease expires `ttl_ms` after receipt, in the node's own clock.
//!   A node applies a response only within its callout timeout of sending
//!   the request, so the service knows every lease is dead by
//!   `answered_at + timeout + ttl` in its own clock. No timestamps travel:
//!   the service never trusts a node's clock, and a node's clock offset
//!   cannot change any decision.
//! * `Lease::share` is the node's share of the global rate, in units per
//!   sync interval: how fast its lease grows while the bucket is scarce.
//! * `Lease::outage_milli` is the node's **outage allowance**: what it may
//!   admit per sync interval, in thousandths of a unit, once the lease
//!   expired with no new one (the failure mode `fail_open_local`). The
//!   service keeps the allowances of all nodes summing to at most the
//!   limit's rate, whatever their demand (see `tenantgate-central`'s
//!   `alloc`). A service older than the field sends none: the node then
//!   runs `fail_open_local` at its whole `share`, as nodes did before.
//!
//! # Shared settings
//! The bound the service keeps depends on settings the node enforces, so
//! the node sends them ([`NodeSettings`]): its callout timeout `D` (how
//! late an answer it still applies), how long its `fail_open_local` lasts,
//! its policy's sync interval, and the failure mode of each reported
//! (key, limit) ([`Report::failure_mode`], absent: the request's default),
//! and that it runs `fail_open_local` at each lease's outage allowance
//! ([`NodeSettings::outage_allowance`]; absent: at its share).
//! The service computes each node's lease life and local fallback from
//! these values, not from its own copy of them (see `tenantgate-central`).
//! A node older than these fields sends none; the service then assumes its
//! own policy's values and counts it.
//!
//! # Versioning
//! `version` is [`PROTOCOL_VERSION`]. A message with another version is
//! refused whole ([`ProtocolError::Version`]). Within a version, fields may
//! be added: unknown fields are ignored, so a newer peer can add optional
//! data without breaking an older one (`settings` and `failure_mode` were
//! added so, and are left out when absent).

use core::fmt;

use serde::{Deserialize, Serialize};

use crate::policy::FailureMode;

/// The version this code speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// A full bucket in a lease's `bucket_milli` (thousandths of the burst).
pub const FULL_BUCKET_MILLI: u64 = 1_000;

/// Longest sync interval a response may ask for (one hour).
pub const MAX_INTERVAL_MS: u64 = 3_600_000;

/// Node → service, once per sync interval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncRequest {
    pub version: u32,
    /// Who sends it (later: Envoy's `node.id`).
    pub node_id: String,
    /// Where the node runs (later: Envoy node metadata or locality).
    pub region: String,
    /// The policy version the node enforces.
    pub policy_version: String,
    /// Strictly increasing per node within a session (`boot`); a node seeds
    /// it from its clock when it starts.
    pub seq: u64,
    /// The node's session: a value the node picks when it starts, unknown
    /// to anyone else. A new `boot` starts a new session at the service
    /// (its `seq`s start afresh); within a session the service refuses a
    /// `seq` that jumps implausibly far ahead. `0` (the default, what a node
    /// older than this field sends): no session; then the service bounds
    /// `seq` by its own clock instead (see `tenantgate-central`).
    #[serde(default)]
    pub boot: u64,
    /// The `seq` of the last response this node applied (0: none yet).
    pub acked_seq: u64,
    /// The settings the node enforces (`None`: a node older than this
    /// field; see the module header).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<NodeSettings>,
    pub reports: Vec<Report>,
}

/// The settings a node enforces that the service's bound depends on (the
/// node's compiled `sync:` block). Durations in milliseconds, rounded up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSettings {
    /// `D`, the callout timeout: the node applies no answer received later
    /// than this after it sent the request.
    pub timeout_ms: u64,
    /// How long `fail_open_local` lasts after a lease expired.
    pub local_max_ms: u64,
    /// The policy's `sync.interval` (the node then syncs at the interval
    /// the service's answers ask for).
    pub interval_ms: u64,
    /// The failure mode of a report that names none (`sync.failure_mode`).
    pub failure_mode: FailureMode,
    /// The node runs `fail_open_local` at each lease's
    /// [`Lease::outage_milli`] (`false`, what a node older than the field
    /// sends: at its whole [`Lease::share`]). The service accounts each
    /// node's local limit by what it runs.
    #[serde(default, skip_serializing_if = "is_false")]
    pub outage_allowance: bool,
}

fn is_false(v: &bool) -> bool {
    !*v
}

/// The longest `timeout_ms` and `local_max_ms` a service accepts: ten
/// minutes, the longest `sync.interval` (a callout timeout is shorter).
pub const MAX_SETTING_MS: u64 = 600_000;

impl NodeSettings {
    /// A setting out of the range any policy produces.
    pub fn check(&self) -> Result<(), ProtocolError> {
        if self.timeout_ms == 0 || self.timeout_ms > MAX_SETTING_MS {
            return Err(ProtocolError::Invalid("settings.timeout_ms out of range"));
        }
        if self.local_max_ms > MAX_SETTING_MS {
            return Err(ProtocolError::Invalid("settings.local_max_ms out of range"));
        }
        if self.interval_ms == 0 || self.interval_ms > MAX_INTERVAL_MS {
            return Err(ProtocolError::Invalid("settings.interval_ms out of range"));
        }
        Ok(())
    }
}

/// One (key, limit) in a [`SyncRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// The limit key (tenant × API action).
    pub key: String,
    /// The limit's name in the policy.
    pub limit: String,
    /// Units admitted since the last acknowledged report.
    pub consumed: u64,
    /// Of `consumed`, the units admitted with no lease.
    pub unleased: u64,
    /// Units requested since the last acknowledged report, denied or not.
    pub demand: u64,
    /// What the node does with this (key, limit) once its lease expired
    /// with no new one, when it differs from `settings.failure_mode`
    /// (`None`: that one). The most permissive of the route classes that
    /// charge the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<FailureMode>,
    /// For a key that started on the node (its first request, or its first
    /// since it was forgotten) and has had no lease since: how long before
    /// this report it started, in milliseconds (`None` otherwise, and from
    /// a node older than the field). Its `demand` came within that time:
    /// the service sizes the key's first lease by that rate, so a burst
    /// from cold is leased by what it asks per interval, not by the sliver
    /// of it seen before the node's next report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_ms: Option<u64>,
}

/// Service → node, the answer to one [`SyncRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncResponse {
    pub version: u32,
    /// The `seq` of the request this answers.
    pub ack_seq: u64,
    /// When the node should sync next, in milliseconds.
    pub interval_ms: u64,
    pub leases: Vec<Lease>,
}

/// The node's allowance for one (key, limit).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub key: String,
    pub limit: String,
    /// Units the node may admit, counted from when it sent the request.
    pub tokens: u64,
    /// The node's share of the global rate, units per sync interval.
    pub share: u64,
    /// The same share exactly, in thousandths of a unit per interval
    /// (`share` is it in whole units, the fraction carried from interval to
    /// interval): how fast the node's lease grows while the bucket is
    /// scarce, which a denial's `Retry-After` is computed from. 0 (what an
    /// older service sends): unknown, `share` is used.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub share_milli: u64,
    /// Lifetime from receipt, milliseconds.
    pub ttl_ms: u64,
    /// The node's outage allowance: thousandths of a unit per sync
    /// interval it may admit for this (key, limit) under `fail_open_local`
    /// once this lease expired with no new one (the service gone silent).
    /// The service keeps every node's allowance together within the
    /// limit's rate. `None` (an older service, or a node that did not say
    /// it runs it): the node runs `fail_open_local` at its whole `share`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outage_milli: Option<u64>,
    /// How full the service's bucket of this limit was once this lease
    /// was drawn: the units no node holds in a lease, in thousandths of
    /// the limit's burst (0 to 1,000). A node shares a global pool
    /// max-min fairly only while it is below half, as a local pool is
    /// shared while it holds less than half its burst
    /// ([`crate::limiter::fair`]). `None` (an older service): unknown, the
    /// pool counts as short whenever its members on the node ask more
    /// than the node's share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket_milli: Option<u64>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A message that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProtocolError {
    /// Not JSON of the expected shape.
    Malformed(String),
    /// Another protocol version.
    Version(u32),
    /// A field out of range.
    Invalid(&'static str),
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtocolError::Malformed(e) => write!(f, "malformed sync message: {e}"),
            ProtocolError::Version(v) => {
                write!(
                    f,
                    "sync protocol version {v} (this side speaks {PROTOCOL_VERSION})"
                )
            }
            ProtocolError::Invalid(what) => write!(f, "invalid sync message: {what}"),
        }
    }
}

impl std::error::Error for ProtocolError {}

impl SyncRequest {
    pub fn to_json(&self) -> String {
        // Serializing plain strings and integers cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn from_json(body: &[u8]) -> Result<SyncRequest, ProtocolError> {
        let req: SyncRequest =
            serde_json::from_slice(body).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
        if req.version != PROTOCOL_VERSION {
            return Err(ProtocolError::Version(req.version));
        }
        if req.node_id.is_empty() {
            return Err(ProtocolError::Invalid("node_id is empty"));
        }
        if req.reports.iter().any(|r| r.unleased > r.consumed) {
            return Err(ProtocolError::Invalid("unleased exceeds consumed"));
        }
        if let Some(s) = &req.settings {
            s.check()?;
        }
        Ok(req)
    }
}

impl SyncResponse {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parses and checks a response. A node treats an error like a lost
    /// response: its leases run to their expiry.
    pub fn from_json(body: &[u8]) -> Result<SyncResponse, ProtocolError> {
        let resp: SyncResponse =
            serde_json::from_slice(body).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
        if resp.version != PROTOCOL_VERSION {
            return Err(ProtocolError::Version(resp.version));
        }
        if resp.interval_ms == 0 || resp.interval_ms > MAX_INTERVAL_MS {
            return Err(ProtocolError::Invalid("interval_ms out of range"));
        }
        Ok(resp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> SyncRequest {
        SyncRequest {
            version: PROTOCOL_VERSION,
            node_id: "envoy-1".into(),
            region: "eu-west".into(),
            policy_version: "demo-2026-11-30".into(),
            seq: 7,
            boot: 0,
            acked_seq: 6,
            settings: Some(NodeSettings {
                timeout_ms: 500,
                local_max_ms: 60_000,
                interval_ms: 1_000,
                failure_mode: FailureMode::FailOpenLocal,
                outage_allowance: true,
            }),
            reports: vec![Report {
                key: "t1|orders".into(),
                limit: "free".into(),
                consumed: 10,
                unleased: 2,
                demand: 15,
                failure_mode: None,
                started_ms: Some(250),
            }],
        }
    }

    #[test]
    fn settings_travel_and_an_older_node_sends_none() {
        let mut req = request();
        req.reports[0].failure_mode = Some(FailureMode::FailClosed);
        let json = req.to_json();
        assert!(
            json.contains(r#""settings":{"timeout_ms":500,"local_max_ms":60000,"interval_ms":1000,"failure_mode":"fail_open_local","outage_allowance":true}"#),
            "{json}"
        );
        assert!(json.contains(r#""failure_mode":"fail_closed""#), "{json}");
        assert_eq!(SyncRequest::from_json(json.as_bytes()).unwrap(), req);
        // A node older than the fields: they are absent, and absent ones
        // are left out again.
        let old = r#"{"version":1,"node_id":"n","region":"r","policy_version":"v","seq":2,"acked_seq":1,
            "reports":[{"key":"k","limit":"l","consumed":1,"unleased":0,"demand":1}]}"#;
        let parsed = SyncRequest::from_json(old.as_bytes()).unwrap();
        assert_eq!(parsed.settings, None);
        assert_eq!(parsed.reports[0].failure_mode, None);
        let again = parsed.to_json();
        assert!(
            !again.contains("settings") && !again.contains("failure_mode"),
            "{again}"
        );
        // A service older than the fields ignores them: unknown fields
        // are ignored both ways (a newer node's extra setting here).
        let newer = json.replace(r#""interval_ms":1000"#, r#""interval_ms":1000,"jitter_ms":5"#);
        assert_eq!(SyncRequest::from_json(newer.as_bytes()).unwrap(), req);
    }

    #[test]
    fn settings_out_of_any_policys_range_are_refused() {
        for bad in [
            NodeSettings {
                timeout_ms: 0,
                ..request().settings.unwrap()
            },
            NodeSettings {
                timeout_ms: MAX_SETTING_MS + 1,
                ..request().settings.unwrap()
            },
            NodeSettings {
                local_max_ms: MAX_SETTING_MS + 1,
                ..request().settings.unwrap()
            },
            NodeSettings {
                interval_ms: 0,
                ..request().settings.unwrap()
            },
        ] {
            let mut req = request();
            req.settings = Some(bad);
            assert!(
                matches!(
                    SyncRequest::from_json(req.to_json().as_bytes()),
                    Err(ProtocolError::Invalid(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn request_round_trips_as_json() {
        let req = request();
        let json = req.to_json();
        assert!(json.starts_with(r#"{"version":1,"node_id":"envoy-1","region":"eu-west""#));
        assert!(
            json.contains(r#""failure_mode":"fail_open_local","outage_allowance":true}"#),
            "{json}"
        );
        assert_eq!(SyncRequest::from_json(json.as_bytes()).unwrap(), req);
    }

    #[test]
    fn response_round_trips_and_ignores_unknown_fields() {
        let resp = SyncResponse {
            version: 1,
            ack_seq: 7,
            interval_ms: 1000,
            leases: vec![Lease {
                key: "t1|orders".into(),
                limit: "free".into(),
                tokens: 40,
                share: 25,
                share_milli: 25_000,
                ttl_ms: 3000,
                outage_milli: Some(0),
                bucket_milli: Some(0),
            }],
        };
        let json = resp.to_json();
        // An allowance of 0 travels (it is not "unknown").
        assert!(json.contains(r#""outage_milli":0"#), "{json}");
        // An empty bucket travels too.
        assert!(json.contains(r#""bucket_milli":0"#), "{json}");
        assert_eq!(SyncResponse::from_json(json.as_bytes()).unwrap(), resp);
        // An older service sends neither.
        let old = json
            .replace(r#","outage_milli":0"#, "")
            .replace(r#","bucket_milli":0"#, "");
        let lease = &SyncResponse::from_json(old.as_bytes()).unwrap().leases[0];
        assert_eq!((lease.outage_milli, lease.bucket_milli), (None, None));
        let newer = r#"{"version":1,"ack_seq":1,"interval_ms":500,"leases":[],"hint":"x"}"#;
        assert_eq!(
            SyncResponse::from_json(newer.as_bytes()).unwrap().interval_ms,
            500
        );
    }

    #[test]
    fn other_versions_and_garbage_are_refused() {
        let v2 = r#"{"version":2,"ack_seq":1,"interval_ms":500,"leases":[]}"#;
        assert_eq!(
            SyncResponse::from_json(v2.as_bytes()),
            Err(ProtocolError::Version(2))
        );
        assert!(matches!(
            SyncResponse::from_json(b"<html>502</html>"),
            Err(ProtocolError::Malformed(_))
        ));
        let zero = r#"{"version":1,"ack_seq":1,"interval_ms":0,"leases":[]}"#;
        assert!(matches!(
            SyncResponse::from_json(zero.as_bytes()),
            Err(ProtocolError::Invalid(_))
        ));
        let mut req = request();
        req.reports[0].unleased = 11;
        assert!(matches!(
            SyncRequest::from_json(req.to_json().as_bytes()),
            Err(ProtocolError::Invalid(_))
        ));
    }
}
