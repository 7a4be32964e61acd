//! Admission's part of a request's decision record for the access log,
//! and the in-flight gauge's reading of shared data.

use crate::host::Host;
use crate::inflight::{self as holders, Counts};
use crate::policy::admission::Criticality;
use crate::table;

/// The decision record of an admission-controlled request, for Envoy's
/// access log (filter state `wasm.tenantgate_admission`): space-separated
/// `key=value` fields, values from the policy (names) or numbers, so it
/// needs no escaping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecisionRecord<'a> {
    /// `admitted`, or the refusal's reason.
    pub outcome: &'a str,
    pub criticality: Criticality,
    /// `-` without one.
    pub dependency: &'a str,
    /// The dependency's live slots at the decision (before this request).
    pub in_flight: u32,
    /// Time held in a queue, in milliseconds.
    pub queue_wait_ms: u64,
    pub policy_version: &'a str,
    /// The rate-limit key (`action|t|tenant`).
    pub limit_key: &'a str,
    /// What refused a slot: `action:<name>`, `dependency:<name>`,
    /// `tenant:<dependency>`; `-` when admitted or refused by a request
    /// check.
    pub limit: &'a str,
    /// The nested level whose limit refused (`level=`; absent otherwise).
    pub level: Option<&'a str>,
    /// The dependency's breaker phase at the decision (`breaker=`; absent
    /// without a `circuit_breaker`).
    pub breaker: Option<&'a str>,
    /// Refused, and answered 200 from the degraded-answer cache with an
    /// answer this old (see [`super::degraded`]): rendered as a last field
    /// `degraded_age_ms=<n>`, only then.
    pub degraded_age_ms: Option<u64>,
    /// An adaptive dependency's limit as this worker applied it
    /// (`controller_limit=`; the field is absent for other requests).
    pub controller_limit: Option<u32>,
}

impl DecisionRecord<'_> {
    pub fn render(&self) -> String {
        let controller = self
            .controller_limit
            .map_or(String::new(), |l| format!(" controller_limit={l}"));
        let breaker = self.breaker.map(|b| format!(" breaker={b}")).unwrap_or_default();
        let level = self.level.map(|l| format!(" level={l}")).unwrap_or_default();
        let degraded = self
            .degraded_age_ms
            .map_or(String::new(), |age| format!(" degraded_age_ms={age}"));
        format!(
            "outcome={} criticality={} dependency={} in_flight={} queue_wait_ms={} policy={} key={} limit={}{level}{controller}{breaker}{degraded}",
            self.outcome,
            self.criticality.as_str(),
            self.dependency,
            self.in_flight,
            self.queue_wait_ms,
            self.policy_version.replace(' ', "_"),
            self.limit_key,
            self.limit
        )
    }
}

/// The live slots of a dependency, node-wide, as shared data says at `now`
/// (the in-flight gauge). `None`: shared data could not be read.
pub fn in_flight<H: Host>(host: &H, dependency_key: &str, now: u64) -> Option<Counts> {
    let (value, _) = host.shared_get(dependency_key).ok()?;
    let Some(value) = value else {
        return Some(Counts::default());
    };
    let slots = table::decode_entry(&value)?;
    let records = slots.first().and_then(|s| table::decode_records(s.records));
    Some(holders::live(&holders::of_records(records.as_ref()), now))
}
