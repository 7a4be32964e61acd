//! The host layer: the only module that names `proxy_wasm`.
//!
//! It implements [`Host`] with hostcalls (always the `Result`-returning
//! ones: the SDK's trait helpers unwrap, and a trap kills the VM for every
//! request on the worker), compiles the policy in `on_configure` (returning
//! `false` so Envoy keeps the previous configuration on any error), and turns
//! each [`Decision`] into an Envoy action, headers and stats.

mod metrics;

use std::rc::Rc;
use std::time::UNIX_EPOCH;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, Status};

use crate::engine::{self, Decision, RateLimitHeaders};
use crate::host::{CasResult, Host, HostError};
use crate::policy::Policy;
use crate::response;
use metrics::Metrics;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::new()) });
}}

/// Nanoseconds since the Unix epoch from the host's wall clock.
fn now_ns() -> Option<u64> {
    let now = hostcalls::get_current_time().ok()?;
    u64::try_from(now.duration_since(UNIX_EPOCH).ok()?.as_nanos()).ok()
}

/// Envoy, through hostcalls.
struct ProxyHost;

impl Host for ProxyHost {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        // The bytes variant: the String one unwraps UTF-8 and would trap on
        // a client's non-UTF-8 header value.
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }

    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        hostcalls::get_shared_data(key).map_err(|_| HostError)
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<CasResult, HostError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(CasResult::Written),
            Err(Status::CasMismatch) => Ok(CasResult::Conflict),
            Err(_) => Err(HostError),
        }
    }
}

/// One per plugin configuration per worker: owns the compiled policy.
struct Root {
    policy: Option<Rc<Policy>>,
    metrics: Rc<Metrics>,
}

impl Root {
    fn new() -> Root {
        Root {
            policy: None,
            metrics: Rc::new(Metrics::define()),
        }
    }
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(bytes) => bytes.unwrap_or_default(),
            Err(status) => {
                log::error!("tenantgate: cannot read the plugin configuration: {status:?}");
                self.metrics.config_rejected();
                return false;
            }
        };
        match Policy::from_json(&config) {
            Ok(mut policy) => {
                policy.effective_from_ns = now_ns().unwrap_or(0);
                log::info!(
                    "tenantgate: policy {} loaded ({} plans, mode {:?})",
                    policy.version,
                    policy.plans().len(),
                    policy.mode
                );
                self.policy = Some(Rc::new(policy));
                self.metrics.config_loaded();
                true
            }
            Err(errors) => {
                for e in &errors.0 {
                    log::error!("tenantgate: policy rejected: {e}");
                }
                self.metrics.config_rejected();
                false
            }
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            policy: self.policy.clone(),
            metrics: self.metrics.clone(),
            response_headers: None,
        }))
    }
}

/// One per HTTP stream.
struct Request {
    policy: Option<Rc<Policy>>,
    metrics: Rc<Metrics>,
    /// `RateLimit` headers to add to an allowed request's response.
    response_headers: Option<RateLimitHeaders>,
}

impl Context for Request {}

impl Request {
    fn decide(&self, policy: &Policy) -> Decision {
        match now_ns() {
            Some(now) => engine::decide(policy, &ProxyHost, now, &mut Vec::new()),
            None => Decision::unavailable(),
        }
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let Some(policy) = self.policy.clone() else {
            return Action::Continue;
        };
        let decision = self.decide(&policy);
        self.metrics.record(&decision);

        let request_id = ProxyHost.request_header("x-request-id");
        let request_id = response::request_id(request_id.as_deref());
        if let Some(reply) =
            response::local_reply(&decision, &policy.version, policy.ratelimit_headers, request_id)
        {
            let headers: Vec<(&str, &str)> = reply.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            match hostcalls::send_http_response(reply.status, headers, Some(reply.body.as_bytes())) {
                Ok(()) => return Action::Pause,
                Err(status) => {
                    // Pausing without a reply would hang the request.
                    log::error!("tenantgate: cannot send the {} reply: {status:?}", reply.status);
                    self.metrics.reply_failed();
                    return Action::Continue;
                }
            }
        }
        if policy.ratelimit_headers {
            self.response_headers = decision.headers;
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        if let Some(h) = self.response_headers.take() {
            for (name, value) in [("ratelimit-policy", &h.policy), ("ratelimit", &h.ratelimit)] {
                if hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value).is_err() {
                    log::warn!("tenantgate: cannot add the {name} response header");
                }
            }
        }
        Action::Continue
    }
}
