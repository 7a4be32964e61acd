//! Which of a host's events the pipeline needs for a policy.
//!
//! A host that can leave events out (Envoy skips the VM entry of every
//! proxy-wasm callback a module is not allowed to receive: see
//! `cli/src/ecds.rs`) asks [`events`] which ones a policy's requests can
//! use, and delivers only those. Each answer is read from the policy's
//! structure, for what the pipeline does with the event:
//!
//! * **Request headers** and the **tick**: always (every decision; the
//!   tick flushes the stats, renews slot leases, serves the hold, gives
//!   worker leases back).
//! * **Request body** ([`Pipeline::on_request_body`]): counted against
//!   `max_body_bytes` when a request declares no `content-length`; a class
//!   with `max_body_bytes`.
//! * **Response headers** ([`Pipeline::on_response_headers`]): the
//!   `RateLimit` headers of an admitted request (`ratelimit_headers`), the
//!   time and status a signal window records (a class whose dependency has
//!   an adaptive controller or a circuit breaker), the start of a degraded
//!   capture (a degradable class).
//! * **Response body and trailers** ([`Pipeline::on_response_body`],
//!   [`Pipeline::on_response_trailers`]): a degraded capture's body and its
//!   end; a degradable class; a settled cost's meter (a class with
//!   `settle`).
//! * **Costs settled after the response** (a class with `settle`): its
//!   response headers (a header source; the body's content type), body and
//!   trailers (the meter), its stream end (the settlement), and its request
//!   body when the estimate is a body field. **Soft limits**
//!   (`on_limit: soft`): the response headers (the marker on the response)
//!   and the stream end (the marker kept until then).
//! * **Stream end** ([`Pipeline::on_stream_end`]): whatever a stream keeps
//!   between its callbacks (the pipeline's `Stream`) is let go only there,
//!   so it is needed whenever a stream can keep anything: slots (a class
//!   with a dependency or an action's in-flight limit; a dependency's queue
//!   holds only such classes), a body budget (`max_body_bytes`), a signal
//!   (a dependency with a signal window), a capture (degradable), the
//!   `RateLimit` headers waiting for a response that may never come
//!   (`ratelimit_headers`), a place in the hold (`on_limit: queue`).
//!   Without it a stream that kept something would keep it forever.
//! * **Callout answers** ([`Pipeline::on_sync_answer`]): the node's sync of
//!   its global limits (`sync`, present whenever a limit is global).
//!
//! Leaving out an event the policy needs breaks it (slots never given
//! back); delivering one it does not need costs a VM entry and nothing
//! else. The tests below hold each answer to the case that needs it, and
//! one runs the pipeline to check that a policy without stream end keeps
//! no stream.
//!
//! [`Pipeline::on_request_body`]: super::Pipeline::on_request_body
//! [`Pipeline::on_response_headers`]: super::Pipeline::on_response_headers
//! [`Pipeline::on_response_body`]: super::Pipeline::on_response_body
//! [`Pipeline::on_response_trailers`]: super::Pipeline::on_response_trailers
//! [`Pipeline::on_stream_end`]: super::Pipeline::on_stream_end
//! [`Pipeline::on_sync_answer`]: super::Pipeline::on_sync_answer

use crate::policy::settle::Estimate;
use crate::policy::{OnLimit, Policy, RouteClass};

/// The events a host delivers to the pipeline for one policy (see the
/// module header). Request headers are always needed and not listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Events {
    pub request_body: bool,
    pub response_headers: bool,
    /// Response body chunks and trailers (one need: a capture's body and its end).
    pub response_body: bool,
    pub stream_end: bool,
    pub callout_answers: bool,
    /// Always: the stats reach the host only on the tick.
    pub tick: bool,
}

/// What the classes of a policy need, folded over every class.
#[derive(Debug, Default, Clone, Copy)]
struct ClassNeeds {
    /// A class counts a streamed request body (`max_body_bytes`).
    body_budget: bool,
    /// A class takes slots (a dependency or an action's in-flight limit).
    slots: bool,
    /// A class's dependency records stream-end signals.
    signals: bool,
    /// A class captures its answers for degraded replies.
    degradable: bool,
    /// A class holds requests over their rate limit (`on_limit: queue`).
    rate_queue: bool,
    /// A class settles its cost after the response (`settle`).
    settles: bool,
    /// A class's estimate is a field of the request body.
    estimate_body: bool,
}

impl ClassNeeds {
    fn of(policy: &Policy, class: &RouteClass) -> ClassNeeds {
        let labels = &class.labels;
        let dependency = labels.dependency.and_then(|i| policy.dependency(i));
        ClassNeeds {
            body_budget: labels.max_body_bytes.is_some(),
            slots: dependency.is_some() || labels.action_limit.is_some(),
            signals: dependency.is_some_and(|d| d.signal_window_ns().is_some()),
            degradable: class.degradable.is_some(),
            rate_queue: matches!(class.on_limit, OnLimit::Queue { .. }),
            settles: class.settle.is_some(),
            estimate_body: class
                .settle
                .as_ref()
                .is_some_and(|s| matches!(s.estimate, Estimate::BodyField { .. })),
        }
    }

    fn or(self, other: ClassNeeds) -> ClassNeeds {
        ClassNeeds {
            body_budget: self.body_budget || other.body_budget,
            slots: self.slots || other.slots,
            signals: self.signals || other.signals,
            degradable: self.degradable || other.degradable,
            rate_queue: self.rate_queue || other.rate_queue,
            settles: self.settles || other.settles,
            estimate_body: self.estimate_body || other.estimate_body,
        }
    }
}

/// The events the pipeline needs for `policy`'s requests (see the module
/// header). Every route class counts, whatever the classification (a
/// `class:` instance too): instances of one policy need the same events,
/// so a host can serve them from one VM.
pub fn events(policy: &Policy) -> Events {
    let needs = policy
        .route_classes()
        .map(|c| ClassNeeds::of(policy, c))
        .fold(ClassNeeds::default(), ClassNeeds::or);
    let headers = policy.ratelimit_headers;
    let soft = policy.has_soft_limits;
    Events {
        request_body: needs.body_budget || needs.estimate_body,
        response_headers: headers || needs.signals || needs.degradable || needs.settles || soft,
        response_body: needs.degradable || needs.settles,
        stream_end: headers
            || soft
            || needs.settles
            || needs.slots
            || needs.body_budget
            || needs.signals
            || needs.degradable
            || needs.rate_queue,
        callout_answers: policy.sync.is_some(),
        tick: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A policy's JSON: one plan (10 a second, `global` or not),
    /// `ratelimit_headers` off unless `extra` sets it, and `extra` fields
    /// (JSON, after a comma) beside its `routes`.
    fn json(routes: &str, extra: &str, global: bool) -> String {
        format!(
            r#"{{"version": "events-1", "identity": {{"header": "x-tenant-id"}},
                "plans": {{"free": {{"limits": [{{"rate": 10, "per": "1s", "global": {global}}}]}}}},
                "default_plan": "free", "anonymous": {{"plan": "free"}},
                "routes": {routes}{extra}}}"#
        )
    }

    fn compile(json: &str) -> Policy {
        match Policy::from_json(json.as_bytes()) {
            Ok(p) => p,
            Err(e) => panic!("test policy refused: {e}\n{json}"),
        }
    }

    const NO_HEADERS: &str = r#", "ratelimit_headers": false"#;

    fn policy(routes: &str, extra: &str) -> Policy {
        compile(&json(routes, &format!("{NO_HEADERS}{extra}"), false))
    }

    /// Only what every policy needs: no body, no response, no end, no callout.
    const BARE: Events = Events {
        request_body: false,
        response_headers: false,
        response_body: false,
        stream_end: false,
        callout_answers: false,
        tick: true,
    };

    #[test]
    fn a_policy_without_admission_headers_or_sync_needs_only_its_requests_and_the_tick() {
        let p = policy(r#"{"api": {}, "search": {"cost": 5}}"#, "");
        assert_eq!(events(&p), BARE);
    }

    #[test]
    fn ratelimit_headers_need_the_response_headers_and_the_end_of_a_stream_that_never_got_one() {
        // On by default.
        let e = events(&compile(&json(r#"{"api": {}}"#, "", false)));
        assert!(e.response_headers && e.stream_end);
        assert!(!e.response_body && !e.request_body);
    }

    #[test]
    fn max_body_bytes_needs_the_request_body_and_the_stream_end() {
        let e = events(&policy(r#"{"upload": {"max_body_bytes": 10}, "api": {}}"#, ""));
        assert_eq!(
            e,
            Events {
                request_body: true,
                stream_end: true,
                ..BARE
            }
        );
    }

    #[test]
    fn a_timeout_budget_alone_keeps_nothing_on_the_stream() {
        let e = events(&policy(r#"{"api": {"min_timeout_budget": "200ms"}}"#, ""));
        assert_eq!(e, BARE);
    }

    #[test]
    fn a_dependency_slot_needs_the_stream_end_only() {
        let deps = r#", "dependencies": {"db": {"max_in_flight": 2,
            "queues": {"normal": {"max_queue": 2, "max_wait": "100ms"}}}}"#;
        let e = events(&policy(r#"{"orders": {"dependency": "db"}}"#, deps));
        assert_eq!(
            e,
            Events {
                stream_end: true,
                ..BARE
            }
        );
    }

    #[test]
    fn an_action_limit_needs_the_stream_end() {
        let actions = r#", "actions": {"reports": {"max_in_flight": 3}}"#;
        let e = events(&policy(r#"{"reports": {"action": "reports"}}"#, actions));
        assert_eq!(
            e,
            Events {
                stream_end: true,
                ..BARE
            }
        );
    }

    #[test]
    fn a_settled_cost_needs_the_whole_response_and_the_stream_end() {
        let e = events(&policy(
            r#"{"chat": {"cost": 5, "settle": {"usage": "openai_total", "ceiling": 1000}}}"#,
            "",
        ));
        assert_eq!(
            e,
            Events {
                response_headers: true,
                response_body: true,
                stream_end: true,
                ..BARE
            }
        );
        // An estimate from the request body reads the request body too.
        let e = events(&policy(
            r#"{"chat": {"cost": 5, "settle": {"usage": "openai_total", "ceiling": 1000,
                "estimate_body_field": "max_tokens"}}}"#,
            "",
        ));
        assert!(e.request_body && e.response_body && e.stream_end);
    }

    #[test]
    fn a_soft_limit_needs_the_response_headers_for_its_marker_and_the_stream_end() {
        let json = format!(
            r#"{{"version": "events-1", "identity": {{"header": "x-tenant-id"}},
                "plans": {{"free": {{"limits": [{{"name": "primary", "rate": 10, "per": "1s", "on_limit": "soft"}}]}}}},
                "default_plan": "free", "anonymous": {{"plan": "free"}},
                "routes": {{"api": {{}}}}{NO_HEADERS}}}"#
        );
        let e = events(&compile(&json));
        assert_eq!(
            e,
            Events {
                response_headers: true,
                stream_end: true,
                ..BARE
            }
        );
    }

    #[test]
    fn a_breaker_needs_the_response_headers_for_its_signal() {
        let deps = r#", "dependencies": {"db": {"max_in_flight": 2, "circuit_breaker": {}}}"#;
        let e = events(&policy(r#"{"orders": {"dependency": "db"}}"#, deps));
        assert_eq!(
            e,
            Events {
                response_headers: true,
                stream_end: true,
                ..BARE
            }
        );
    }

    #[test]
    fn an_adaptive_controller_needs_the_response_headers_for_its_signal() {
        let deps = r#", "dependencies": {"db": {"max_in_flight": 20, "adaptive": {}}}"#;
        let e = events(&policy(r#"{"orders": {"dependency": "db"}}"#, deps));
        assert!(e.response_headers && e.stream_end && !e.response_body);
    }

    #[test]
    fn a_signal_window_nobody_uses_asks_for_nothing() {
        // A dependency no class names has no stream.
        let deps = r#", "dependencies": {"db": {"max_in_flight": 2, "circuit_breaker": {}}}"#;
        let e = events(&policy(r#"{"api": {}}"#, deps));
        assert_eq!(e, BARE);
    }

    #[test]
    fn a_degradable_class_needs_the_whole_response() {
        let deps = r#", "dependencies": {"db": {"max_in_flight": 2}}"#;
        let routes = r#"{"catalog": {"dependency": "db", "degradable": {"max_stale": "30s"}}}"#;
        let e = events(&policy(routes, deps));
        assert_eq!(
            e,
            Events {
                response_headers: true,
                response_body: true,
                stream_end: true,
                ..BARE
            }
        );
    }

    #[test]
    fn on_limit_queue_needs_the_stream_end_to_let_a_gone_request_out_of_the_hold() {
        let routes = r#"{"jobs": {"on_limit": "queue", "max_wait": "250ms", "max_queue": 3}}"#;
        let e = events(&policy(routes, ""));
        assert_eq!(
            e,
            Events {
                stream_end: true,
                ..BARE
            }
        );
    }

    #[test]
    fn global_limits_need_the_callout_answers() {
        let p = compile(&json(r#"{"api": {}}"#, NO_HEADERS, true));
        assert_eq!(
            events(&p),
            Events {
                callout_answers: true,
                ..BARE
            }
        );
    }

    #[test]
    fn an_instance_needs_what_its_whole_policy_needs() {
        let routes = r#"{"api": {}, "upload": {"max_body_bytes": 10}}"#;
        let whole = events(&policy(routes, ""));
        let instance = events(&policy(routes, r#", "class": "api""#));
        assert_eq!(whole, instance);
        assert!(instance.request_body);
    }

    /// Every policy of the tests above, as (routes, extra fields, global).
    const CASES: &[(&str, &str, bool)] = &[
        (r#"{"api": {}, "search": {"cost": 5}}"#, NO_HEADERS, false),
        (r#"{"api": {}}"#, "", false),
        (r#"{"upload": {"max_body_bytes": 10}}"#, NO_HEADERS, false),
        (r#"{"api": {"min_timeout_budget": "200ms"}}"#, NO_HEADERS, false),
        (
            r#"{"orders": {"dependency": "db"}}"#,
            r#", "ratelimit_headers": false, "dependencies": {"db": {"max_in_flight": 50}}"#,
            false,
        ),
        (
            r#"{"reports": {"action": "reports"}}"#,
            r#", "ratelimit_headers": false, "actions": {"reports": {"max_in_flight": 50}}"#,
            false,
        ),
        (
            r#"{"orders": {"dependency": "db"}}"#,
            r#", "ratelimit_headers": false, "dependencies": {"db": {"max_in_flight": 50, "circuit_breaker": {}}}"#,
            false,
        ),
        (
            r#"{"api": {}}"#,
            r#", "ratelimit_headers": false, "dependencies": {"db": {"max_in_flight": 2, "circuit_breaker": {}}}"#,
            false,
        ),
        (
            r#"{"catalog": {"dependency": "db", "degradable": {"max_stale": "30s"}}}"#,
            r#", "ratelimit_headers": false, "dependencies": {"db": {"max_in_flight": 50}}"#,
            false,
        ),
        (
            r#"{"jobs": {"on_limit": "queue", "max_wait": "250ms", "max_queue": 3}}"#,
            NO_HEADERS,
            false,
        ),
        (r#"{"api": {}}"#, NO_HEADERS, true),
    ];

    /// The pipeline itself agrees: under a policy that needs no stream end,
    /// no request leaves anything on its stream (so no response, body or
    /// end callback would find anything to do); under one that needs it,
    /// some request does. Each class gets 30 GETs without `content-length`
    /// (over the 10-a-second limit) that never end.
    #[test]
    fn a_policy_without_stream_end_keeps_no_stream_in_the_pipeline() {
        use crate::memory::{MemoryHost, MemoryStats, SharedStore};
        const NOW: u64 = 1_796_000_000 * crate::limiter::NANOS_PER_SEC;
        for (routes, extra, global) in CASES {
            let json = json(routes, extra, *global);
            let store = SharedStore::new();
            let mut pipeline = super::super::Pipeline::default();
            let host = MemoryHost::new(store.clone());
            let policy = match pipeline.configure(&host, &NOW, &mut MemoryStats::default(), json.as_bytes()) {
                Ok(p) => p,
                Err(e) => panic!("{e}\n{json}"),
            };
            let needs = events(&policy);
            let classes: Vec<String> = policy.route_classes().map(|c| c.name.clone()).collect();
            let mut stream = 0;
            for class in &classes {
                for _ in 0..30 {
                    stream += 1;
                    let request = MemoryHost::new(store.clone())
                        .route_class(class)
                        .header("x-tenant-id", "acme")
                        .header(":method", "GET")
                        .header(":path", "/items/1");
                    pipeline.on_request_headers(&request, &NOW, &policy, stream);
                }
            }
            assert_eq!(
                pipeline.streams() > 0,
                needs.stream_end,
                "{} streams kept, events {needs:?}: {json}",
                pipeline.streams()
            );
        }
    }
}
