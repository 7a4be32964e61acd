//! What a request gets when its host fails inside the pipeline (the native
//! module catches a panic at an entry point: `module/src/lib.rs`,
//! "Fail-safe"): the policy's failure mode for the request's class. The
//! rule lives here, beside the pipeline it stands in for, so no host holds
//! a copy of it; the host only asks for the directive, with the class the
//! core's own classifier gives ([`crate::engine::class_of`]).

use super::{Directive, Verdict};
use crate::decision::Decision;
use crate::policy::{FailureMode, Policy};
use crate::response;

/// What a request gets when its host fails inside (a caught panic): the
/// policy's failure mode for its class ([`Policy::failure_mode`]):
/// `fail_closed` answers 503 `state_unavailable`, the others let the
/// request on. Made once per policy (it holds no `Rc`: a host may share it
/// across threads, as the module does).
#[derive(Debug, Clone)]
pub struct Failure {
    closed_by_default: bool,
    /// Classes whose mode differs from the default.
    differ: Vec<String>,
    reply: response::LocalReply,
}

impl Failure {
    pub fn of(policy: &Policy) -> Failure {
        let closed = |m: FailureMode| m == FailureMode::FailClosed;
        let default = policy.failure_mode(None);
        let differ = policy
            .route_classes()
            .filter(|c| closed(policy.failure_mode(Some(c))) != closed(default))
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
        Directive::of(verdict, None)
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
    fn the_class_is_the_cores_default_route_included() {
        // A request of no route the policy names is of `default_route`'s
        // class: a host that classified it by its route name alone would
        // get no class and the default mode (the module's old `class_of`).
        let json = r#"{"version": "f-2", "identity": {"header": "x-tenant-id"},
            "plans": {"free": {"limits": [{"rate": 1, "per": "1s"}]}},
            "default_plan": "free", "anonymous": {"plan": "free"},
            "routes": {"strict": {"action": "strict", "failure_mode": "fail_closed"},
                       "loose": {"action": "loose", "failure_mode": "fail_open"}},
            "default_route": "strict"}"#;
        let p = Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
        let f = Failure::of(&p);
        let host = crate::memory::MemoryHost::new(crate::memory::SharedStore::new());
        let class = crate::engine::class_of(&p, &host).map(|c| c.name.clone());
        assert_eq!(class.as_deref(), Some("strict"));
        assert_eq!(replied(&f.directive(class.as_deref())), Some(503));
        let named = host.route_class("loose");
        let class = crate::engine::class_of(&p, &named).map(|c| c.name.clone());
        assert_eq!(replied(&f.directive(class.as_deref())), None);
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
