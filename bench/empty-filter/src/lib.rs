//! An empty proxy-wasm HTTP filter, the baseline for `make bench`.
//!
//! It registers a root context and an HTTP context that override nothing:
//! every callback is the SDK's default, which continues. What it costs per
//! request is the price of having *any* Rust wasm filter in the chain (the
//! context creation and the hostcall round trips Envoy makes into the VM),
//! which tenantgate pays too.
//!
//! Build: `cargo build --target wasm32-wasip1 --profile wasm-release -p tenantgate-bench-empty-filter`
//! (output `target/wasm32-wasip1/wasm-release/empty_filter.wasm`).

#[cfg(target_arch = "wasm32")]
mod filter {
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{ContextType, LogLevel};

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Warn);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
    }}

    struct Root;

    impl Context for Root {}

    impl RootContext for Root {
        fn on_configure(&mut self, _size: usize) -> bool {
            true
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }

        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Pass))
        }
    }

    /// Every HTTP callback is the SDK default: `Action::Continue`.
    struct Pass;

    impl Context for Pass {}

    impl HttpContext for Pass {}
}
