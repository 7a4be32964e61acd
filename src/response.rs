//! What a denied request receives: status, headers and an RFC 9457
//! `application/problem+json` body. Built from a [`Decision`]; nothing the
//! client sent reaches the output unless it passed [`request_id`].

use std::borrow::Cow;

use serde::Serialize;

use crate::decision::{Decision, LimitName, Reason};

/// The header naming the stable reason of a denial.
pub const REASON_HEADER: &str = "x-tenantgate-reason";

/// The response headers of draft-ietf-httpapi-ratelimit-headers (see
/// [`crate::decision::RateLimitHeaders`]): the limit's policy, and what is
/// left of it.
pub const RATELIMIT_POLICY_HEADER: &str = "ratelimit-policy";
pub const RATELIMIT_HEADER: &str = "ratelimit";

/// A local reply, ready for the host: a refusal, or a degraded answer
/// from the cache ([`crate::admission::degraded::reply`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    /// Lower-case names.
    pub headers: Vec<(Cow<'static, str>, String)>,
    pub body: Vec<u8>,
}

impl LocalReply {
    /// A header's value, if the reply has it.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The response code details a host gives Envoy for this reply (its
    /// access log's `%RESPONSE_CODE_DETAILS%`): `tenantgate_<reason>`, or
    /// `tenantgate` for a reply without a reason (the limits endpoint).
    pub fn details(&self) -> String {
        self.header(REASON_HEADER)
            .map_or_else(|| String::from("tenantgate"), |r| format!("tenantgate_{r}"))
    }
}

#[derive(Serialize)]
struct Problem<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'static str,
    status: u32,
    detail: String,
    reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    limit: Option<&'a str>,
    /// The nested level (`levels:`) whose limit refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    level: Option<&'a str>,
    retry_after: u64,
    policy_version: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<&'a str>,
}

/// A request id as echoed back: 1 to 128 visible ASCII characters, else
/// dropped (a client can send its own `x-request-id`).
pub fn request_id(raw: Option<&[u8]>) -> Option<&str> {
    let raw = raw?;
    let ok = !raw.is_empty() && raw.len() <= 128 && raw.iter().all(|b| (0x21..0x7f).contains(b));
    if ok {
        core::str::from_utf8(raw).ok()
    } else {
        None
    }
}

/// The reply for a denied decision; `None` if the request is not denied.
pub fn local_reply(
    decision: &Decision,
    policy_version: &str,
    headers_enabled: bool,
    request_id: Option<&str>,
) -> Option<LocalReply> {
    let status = decision.deny_status()?;
    let reason = decision.reason;
    let retry_after = decision.retry_after_secs.max(1);
    let limit = decision.limit.as_ref().map(LimitName::problem_name);
    let (title, detail) = explain(reason, decision.limit.as_ref(), retry_after);
    let problem = Problem {
        kind: format!("urn:tenantgate:problem:{}", reason.as_str()),
        title,
        status,
        detail,
        reason: reason.as_str(),
        limit: limit.as_deref(),
        level: decision.limit.as_ref().and_then(LimitName::level),
        retry_after,
        policy_version,
        request_id,
    };
    let body = serde_json::to_vec(&problem).unwrap_or_default();

    let mut headers: Vec<(Cow<'static, str>, String)> = vec![
        ("content-type".into(), String::from("application/problem+json")),
        ("cache-control".into(), String::from("no-store")),
        ("retry-after".into(), retry_after.to_string()),
        (REASON_HEADER.into(), reason.as_str().to_owned()),
    ];
    if let (true, Some(h)) = (headers_enabled, &decision.headers) {
        headers.push((RATELIMIT_POLICY_HEADER.into(), h.policy.clone()));
        headers.push((RATELIMIT_HEADER.into(), h.ratelimit.clone()));
    }
    if let Some(id) = request_id {
        headers.push(("x-request-id".into(), id.to_owned()));
    }
    Some(LocalReply {
        status,
        headers,
        body,
    })
}

/// The problem's title and its one-sentence detail for a refusal of
/// `reason` by `limit`.
fn explain(reason: Reason, limit: Option<&LimitName>, retry_after: u64) -> (&'static str, String) {
    const UNAVAILABLE: &str = "Service Unavailable";
    let name = limit.map_or("", LimitName::name);
    match reason {
        Reason::RateLimited if limit.is_some_and(LimitName::fair_share) => (
            "Too Many Requests",
            format!(
                "The budget \"{name}\" of this request's level \"{}\" is shared fairly while it runs short, and this request's member has had its share; retry in {retry_after} s.",
                limit.and_then(LimitName::level).unwrap_or_default()
            ),
        ),
        Reason::RateLimited if limit.and_then(LimitName::level).is_some() => (
            "Too Many Requests",
            format!(
                "The budget \"{name}\" of this request's level \"{}\" is exhausted; retry in {retry_after} s.",
                limit.and_then(LimitName::level).unwrap_or_default()
            ),
        ),
        Reason::RateLimited => (
            "Too Many Requests",
            format!("The rate limit \"{name}\" is exhausted; retry in {retry_after} s."),
        ),
        Reason::GlobalGuard => (
            UNAVAILABLE,
            format!(
                "The guard \"{name}\" protecting a shared dependency refused this request (its aggregate limit is reached); retry in {retry_after} s."
            ),
        ),
        Reason::ConcurrencyLimit if matches!(limit, Some(LimitName::Action(_))) => (
            UNAVAILABLE,
            format!("The API action \"{name}\" is at its in-flight limit; retry in {retry_after} s."),
        ),
        Reason::ConcurrencyLimit
        | Reason::StreamLimit
        | Reason::TenantShare
        | Reason::QueueFull
        | Reason::QueueTimeout => (
            UNAVAILABLE,
            format!(
                "The dependency \"{name}\" is at its {} for this request's priority; retry in {retry_after} s.",
                at_its(reason)
            ),
        ),
        Reason::CircuitOpen
        | Reason::CircuitProbeLimit
        | Reason::Paused
        | Reason::RetryBudget
        | Reason::DependencyUnavailable => (
            UNAVAILABLE,
            format!("The dependency \"{name}\" {}; retry in {retry_after} s.", why_unavailable(reason)),
        ),
        Reason::RequestTooLarge => (
            "Content Too Large",
            String::from("The request body is larger than this route accepts."),
        ),
        Reason::TimeoutBudget => (
            UNAVAILABLE,
            format!("The request's remaining timeout is too short for this route; retry in {retry_after} s with a longer timeout."),
        ),
        _ => (
            UNAVAILABLE,
            format!(
                "The rate limiter could not record this request ({}); retry shortly.",
                reason.as_str()
            ),
        ),
    }
}

/// What a dependency is at, for a refusal by one of its limits.
fn at_its(reason: Reason) -> &'static str {
    match reason {
        Reason::StreamLimit => "limit of open streams",
        Reason::TenantShare => "limit for one tenant",
        Reason::QueueFull => "in-flight limit and its queue is full",
        Reason::QueueTimeout => "in-flight limit and no slot came within the queue's max_wait",
        _ => "in-flight limit",
    }
}

/// Why a dependency is unavailable, for a refusal by its breaker, its
/// pause, its retry budget or its empty degraded-answer cache.
fn why_unavailable(reason: Reason) -> &'static str {
    match reason {
        Reason::CircuitOpen => "is failing and its circuit breaker is open",
        Reason::CircuitProbeLimit => "is being probed after failing and its probes are all in flight",
        Reason::Paused => "is paused by the operator",
        Reason::RetryBudget => "has spent its retry budget, so this retry is not sent",
        _ => "is unavailable and no recent enough response can be served in its place",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::Subject;

    #[test]
    fn a_guard_refusal_says_a_guard_protecting_a_dependency_refused() {
        let decision = Decision {
            limit: Some(LimitName::Rate("search-backend".into())),
            retry_after_secs: 2,
            ..Decision::passed(Reason::GlobalGuard)
        };
        let reply = local_reply(&decision, "v1", true, None).unwrap();
        assert_eq!(reply.status, 503);
        let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(
            body["detail"],
            "The guard \"search-backend\" protecting a shared dependency refused this request (its aggregate limit is reached); retry in 2 s."
        );
        assert_eq!(body["reason"], "global_guard");
        // Contention still says the limiter could not record it.
        let contention = Decision {
            subject: Subject::None,
            ..Decision::passed(Reason::Contention)
        };
        let body = String::from_utf8(local_reply(&contention, "v1", true, None).unwrap().body).unwrap();
        assert!(
            body.contains("could not record this request (contention)"),
            "{body}"
        );
    }

    #[test]
    fn an_action_limit_refusal_names_the_action_not_a_dependency() {
        let body = |limit: LimitName| {
            let decision = Decision {
                limit: Some(limit),
                retry_after_secs: 3,
                ..Decision::passed(Reason::ConcurrencyLimit)
            };
            let reply = local_reply(&decision, "v1", true, None).unwrap();
            assert_eq!(reply.status, 503);
            serde_json::from_slice::<serde_json::Value>(&reply.body).unwrap()
        };
        let action = body(LimitName::Action("search".into()));
        assert_eq!(
            action["detail"],
            "The API action \"search\" is at its in-flight limit; retry in 3 s."
        );
        assert_eq!(
            (action["limit"].as_str(), action["reason"].as_str()),
            (Some("action:search"), Some("concurrency_limit"))
        );
        assert_eq!(
            body(LimitName::Dependency("db".into()))["detail"],
            "The dependency \"db\" is at its in-flight limit for this request's priority; retry in 3 s."
        );
    }
}
