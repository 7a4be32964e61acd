//! What a request gets when the module fails inside it (a panic caught at
//! an entry point, see `lib.rs`, "Fail-safe"): the policy's failure mode
//! for the request's class. The one decision the host makes itself: the
//! core is what failed.

use tenantgate::decision::Decision;
use tenantgate::pipeline::{Directive, Verdict};
use tenantgate::policy::{FailureMode, Policy};
use tenantgate::response;

/// What a request gets when the module fails inside (a caught panic): the
/// policy's failure mode for its class (`failure_mode`, else
/// `sync.failure_mode`, else `fail_open_local`): `fail_closed` answers 503
/// `state_unavailable`, the others let the request on.
#[derive(Debug, Clone)]
pub struct Failure {
    closed_by_default: bool,
    /// Classes whose mode differs from the default.
    differ: Vec<String>,
    reply: response::LocalReply,
}

impl Failure {
    pub fn of(policy: &Policy) -> Failure {
        let default = policy
            .sync
            .as_ref()
            .map_or(FailureMode::FailOpenLocal, |s| s.failure_mode);
        let closed = |m: FailureMode| m == FailureMode::FailClosed;
        let differ = policy
            .route_classes()
            .filter(|c| closed(c.failure_mode.unwrap_or(default)) != closed(default))
            .map(|c| c.name.clone())
            .collect();
        let reply = response::local_reply(&Decision::unavailable(), &policy.version, false, None);
        Failure {
            closed_by_default: closed(default),
            differ,
            reply: reply.unwrap_or(response::LocalReply {
                status: 503,
                headers: Vec::new(),
                body: Vec::new(),
            }),
        }
    }

    /// The directive for a request of `class` (`None`: unknown).
    pub fn directive(&self, class: Option<&str>) -> Directive {
        let differs = class.is_some_and(|c| self.differ.iter().any(|d| d == c));
        let verdict = if self.closed_by_default != differs {
            Verdict::Reply(self.reply.clone())
        } else {
            Verdict::Continue
        };
        Directive {
            verdict,
            record: None,
            mark: None,
            identity_encoding: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(sync: &str) -> Policy {
        let json = format!(
            r#"{{"version": "f-1", "identity": {{"header": "x-tenant-id"}},
                "plans": {{"free": {{"limits": [{{"rate": 1, "per": "1s"}}]}}}},
                "default_plan": "free", "anonymous": {{"plan": "free"}},
                "routes": {{"api": {{"action": "api"}},
                            "strict": {{"action": "strict", "failure_mode": "fail_closed"}},
                            "loose": {{"action": "loose", "failure_mode": "fail_open"}}}},
                "default_route": "api" {sync}}}"#
        );
        Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"))
    }

    fn replied(d: &Directive) -> Option<u32> {
        match &d.verdict {
            Verdict::Reply(r) => Some(r.status),
            _ => None,
        }
    }

    #[test]
    fn a_fail_closed_class_gets_503_state_unavailable_and_the_others_go_on() {
        let f = Failure::of(&policy(""));
        assert_eq!(replied(&f.directive(Some("strict"))), Some(503));
        assert_eq!(replied(&f.directive(Some("api"))), None);
        assert_eq!(replied(&f.directive(Some("loose"))), None);
        assert_eq!(replied(&f.directive(None)), None);
        let reply = match f.directive(Some("strict")).verdict {
            Verdict::Reply(r) => r,
            other => panic!("{other:?}"),
        };
        assert_eq!(reply.header("x-tenantgate-reason"), Some("state_unavailable"));
    }

    #[test]
    fn sync_failure_mode_is_the_default_a_class_overrides() {
        let f = Failure::of(&policy(r#", "sync": {"failure_mode": "fail_closed"}"#));
        assert_eq!(replied(&f.directive(None)), Some(503));
        assert_eq!(replied(&f.directive(Some("api"))), Some(503));
        assert_eq!(replied(&f.directive(Some("strict"))), Some(503));
        assert_eq!(replied(&f.directive(Some("loose"))), None);
    }
}
