//! The per-route config: a route names its class in route configuration,
//! the one place a class may come from (clients never choose it):
//!
//! ```yaml
//! typed_per_filter_config:
//!   tenantgate:
//!     "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilterPerRoute
//!     dynamic_module_config: { module: { local: { filename: /path/libtenantgate_module.so } } }
//!     per_route_config_name: tenantgate
//!     filter_config: { "@type": type.googleapis.com/google.protobuf.StringValue, value: orders }
//! ```
//!
//! Envoy hands the module the string's bytes once, when it loads the route
//! table; each request gets the route's parsed config back with one call
//! (`get_most_specific_route_config`), with no metadata lookup. A route
//! without one is classified as on the wasm host: its metadata
//! (`filter_metadata.tenantgate.class`), then its name.

/// The longest class name a route may carry (the policy's names are shorter).
pub const MAX_CLASS_LEN: usize = 128;

/// One route's config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteConfig {
    pub class: String,
}

impl RouteConfig {
    /// The config's bytes: a class name, surrounding whitespace ignored.
    /// `Err`: why Envoy must refuse the route table.
    pub fn parse(bytes: &[u8]) -> Result<RouteConfig, String> {
        let text = std::str::from_utf8(bytes).map_err(|_| String::from("the route's class is not UTF-8"))?;
        let class = text.trim();
        if class.is_empty() {
            return Err(String::from("the route's class is empty"));
        }
        if class.len() > MAX_CLASS_LEN || !class.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!("the route's class {class:?} is not a class name"));
        }
        Ok(RouteConfig {
            class: class.to_owned(),
        })
    }

    /// A leaked box for Envoy to hold (freed by [`RouteConfig::free`]).
    pub fn into_ptr(self) -> *const std::ffi::c_void {
        Box::into_raw(Box::new(self)).cast_const().cast()
    }

    /// The config behind a pointer Envoy hands back (`None`: null).
    ///
    /// # Safety
    /// `ptr` is null or came from [`RouteConfig::into_ptr`] and is not freed.
    pub unsafe fn from_ptr<'a>(ptr: *const std::ffi::c_void) -> Option<&'a RouteConfig> {
        // SAFETY: the caller's promise.
        unsafe { ptr.cast::<RouteConfig>().as_ref() }
    }

    /// Frees a config made by [`RouteConfig::into_ptr`].
    ///
    /// # Safety
    /// `ptr` came from [`RouteConfig::into_ptr`] and is freed once.
    pub unsafe fn free(ptr: *const std::ffi::c_void) {
        if !ptr.is_null() {
            // SAFETY: the caller's promise.
            drop(unsafe { Box::from_raw(ptr.cast::<RouteConfig>().cast_mut()) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_names_one_class() {
        assert_eq!(RouteConfig::parse(b" orders\n").unwrap().class, "orders");
        assert!(RouteConfig::parse(b"").is_err());
        assert!(RouteConfig::parse(b"two words").is_err());
        assert!(RouteConfig::parse(&[0xff, 0xfe]).is_err());
        assert!(RouteConfig::parse("x".repeat(MAX_CLASS_LEN + 1).as_bytes()).is_err());
        let ptr = RouteConfig::parse(b"search").unwrap().into_ptr();
        // SAFETY: just made, freed once below.
        assert_eq!(unsafe { RouteConfig::from_ptr(ptr) }.unwrap().class, "search");
        // SAFETY: made by `into_ptr` above, freed once.
        unsafe { RouteConfig::free(ptr) };
        // SAFETY: null is always accepted.
        assert!(unsafe { RouteConfig::from_ptr(std::ptr::null()) }.is_none());
    }
}
