//! An empty proxy-wasm HTTP filter, the baseline for `make bench`, and the
//! bench's hostcall probe.
//!
//! With an empty plugin configuration (row (c)) it registers a root context
//! and an HTTP context that override nothing: every callback is the SDK's
//! default, which continues. What it costs per request is the price of
//! having *any* Rust wasm filter in the chain (the context creation and the
//! hostcall round trips Envoy makes into the VM), which tenantgate pays too.
//!
//! With a configuration such as `header,header,header,header` it is the
//! probe: each request makes exactly those hostcalls and nothing else, so
//! its cost over (c), divided by the count, is the price of one hostcall of
//! that kind in this Envoy (`make bench`'s hostcall table). The kinds are
//! the calls tenantgate's decision makes:
//!
//! | kind | hostcall(s) |
//! |---|---|
//! | `clock` | `proxy_get_current_time_nanoseconds` |
//! | `header` | `proxy_get_header_map_value` (`x-tenant-id`; a copy into the VM) |
//! | `metadata` | `proxy_get_property` of the route metadata's `tenantgate.class` |
//! | `route_name` | `proxy_get_property` of `xds.route_name` |
//! | `shared_cas` | `proxy_get_shared_data`, then `proxy_set_shared_data` with its CAS token |
//! | `response_header` | `proxy_add_header_map_value` on the response headers |
//!
//! A failed hostcall is ignored: the probe measures calls, it decides
//! nothing. An unknown kind fails the configuration.
//!
//! Build: `cargo build --target wasm32-wasip1 --profile wasm-release -p tenantgate-bench-empty-filter`
//! (output `target/wasm32-wasip1/wasm-release/empty_filter.wasm`).

#[cfg(target_arch = "wasm32")]
mod filter {
    use std::rc::Rc;

    use proxy_wasm::hostcalls;
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Warn);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
    }}

    /// One hostcall kind of the probe (see the crate's table).
    #[derive(Clone, Copy, PartialEq)]
    enum Call {
        Clock,
        Header,
        Metadata,
        RouteName,
        SharedCas,
        ResponseHeader,
    }

    impl Call {
        fn parse(name: &str) -> Option<Call> {
            Some(match name {
                "clock" => Call::Clock,
                "header" => Call::Header,
                "metadata" => Call::Metadata,
                "route_name" => Call::RouteName,
                "shared_cas" => Call::SharedCas,
                "response_header" => Call::ResponseHeader,
                _ => return None,
            })
        }

        fn make(self) {
            // Results are dropped: the probe prices the call, not its answer.
            let _ = match self {
                Call::Clock => hostcalls::get_current_time().map(drop),
                Call::Header => {
                    hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, "x-tenant-id").map(drop)
                }
                Call::Metadata => hostcalls::get_property(vec![
                    "xds",
                    "route_metadata",
                    "filter_metadata",
                    "tenantgate",
                    "class",
                ])
                .map(drop),
                Call::RouteName => hostcalls::get_property(vec!["xds", "route_name"]).map(drop),
                Call::SharedCas => hostcalls::get_shared_data("probe")
                    .and_then(|(_, cas)| hostcalls::set_shared_data("probe", Some(b"0123456789abcdef"), cas)),
                Call::ResponseHeader => {
                    hostcalls::add_map_value(MapType::HttpResponseHeaders, "x-probe", "1")
                }
            };
        }
    }

    #[derive(Default)]
    struct Root {
        /// The calls each request makes, in order; empty for (c).
        calls: Rc<Vec<Call>>,
    }

    impl Context for Root {}

    impl RootContext for Root {
        fn on_configure(&mut self, _size: usize) -> bool {
            let config = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
                .ok()
                .flatten()
                .unwrap_or_default();
            let text = String::from_utf8_lossy(&config);
            let mut calls = Vec::new();
            for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                match Call::parse(name) {
                    Some(call) => calls.push(call),
                    None => {
                        log::error!("probe: unknown hostcall kind {name:?}");
                        return false;
                    }
                }
            }
            self.calls = Rc::new(calls);
            true
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }

        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            if self.calls.is_empty() {
                Some(Box::new(Pass))
            } else {
                Some(Box::new(Probe {
                    calls: self.calls.clone(),
                }))
            }
        }
    }

    /// (c): every HTTP callback is the SDK default, `Action::Continue`.
    struct Pass;

    impl Context for Pass {}

    impl HttpContext for Pass {}

    /// The probe's stream: its calls, request-side at the request headers and
    /// response headers at the response headers.
    struct Probe {
        calls: Rc<Vec<Call>>,
    }

    impl Context for Probe {}

    impl HttpContext for Probe {
        fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
            for call in self.calls.iter().filter(|c| **c != Call::ResponseHeader) {
                call.make();
            }
            Action::Continue
        }

        fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
            for call in self.calls.iter().filter(|c| **c == Call::ResponseHeader) {
                call.make();
            }
            Action::Continue
        }
    }
}
