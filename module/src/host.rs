//! The core's [`Host`] and [`Clock`] over the module's callbacks.
//!
//! [`EnvoyHost`] translates each question the core asks into one callback
//! on the current stream (none on the tick, which has no stream), and
//! shared data into the process-wide [`Store`]. What the core reads as
//! Envoy properties comes from the ABI's own accessors:
//!
//! | the core asks for | the module reads |
//! |---|---|
//! | `xds.route_metadata.filter_metadata.tenantgate.class` | the route's per-route config (`typed_per_filter_config`: the class, no lookup), else the route's metadata |
//! | `xds.route_name` | attribute `xds.route_name` |
//! | `source.address` | attribute `source.address` |
//! | `response.code_details` | attribute `response.code_details` |
//! | `node.id`, `node.locality.region` (and `xds.`-prefixed) | [`Identity`]: Envoy 1.40's ABI has no node attribute (`xds.node` answers nothing), so `TENANTGATE_NODE_ID` / `TENANTGATE_REGION` in Envoy's environment (the policy's `sync.node_id` / `sync.region` win, as on the wasm host) |
//!
//! Anything else is `None`, as a property Envoy does not have.

use tenantgate::engine::{ROUTE_CLASS_PROPERTY, ROUTE_NAME_PROPERTY, SOURCE_ADDRESS_PROPERTY};
use tenantgate::host::{CasResult, Clock, Host, HostError};

use crate::abi::{self, EnvoyBuffer, HttpFilterEnvoy, ModuleBuffer};
use crate::route::RouteConfig;
use crate::store::Store;

/// Who this Envoy is, for the sync (see the module header).
#[derive(Debug, Default, Clone)]
pub struct Identity {
    pub node_id: Option<String>,
    pub region: Option<String>,
}

impl Identity {
    /// From `TENANTGATE_NODE_ID` / `TENANTGATE_REGION` (empty: unset).
    pub fn from_env() -> Identity {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        Identity {
            node_id: var("TENANTGATE_NODE_ID"),
            region: var("TENANTGATE_REGION"),
        }
    }
}

const NODE_ID: [&[&str]; 2] = [&["node", "id"], &["xds", "node", "id"]];
const REGION: [&[&str]; 2] = [
    &["node", "locality", "region"],
    &["xds", "node", "locality", "region"],
];
const CODE_DETAILS: [&str; 2] = ["response", "code_details"];

/// The system's wall clock (nanoseconds since the Unix epoch).
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Option<u64> {
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .ok()?;
        u64::try_from(since.as_nanos()).ok()
    }
}

/// The core's host: one stream's callbacks, or none (the tick).
pub struct EnvoyHost<'a> {
    /// The current stream (`None` on the tick and while configuring).
    pub filter: Option<HttpFilterEnvoy>,
    pub store: &'a Store,
    pub identity: &'a Identity,
}

impl<'a> EnvoyHost<'a> {
    pub fn stream(filter: HttpFilterEnvoy, store: &'a Store, identity: &'a Identity) -> EnvoyHost<'a> {
        EnvoyHost {
            filter: Some(filter),
            store,
            identity,
        }
    }

    pub fn tick(store: &'a Store, identity: &'a Identity) -> EnvoyHost<'a> {
        EnvoyHost {
            filter: None,
            store,
            identity,
        }
    }

    fn header(&self, kind: abi::HeaderType, name: &str) -> Option<Vec<u8>> {
        let filter = self.filter?;
        let lower;
        let name = if name.bytes().any(|b| b.is_ascii_uppercase()) {
            lower = name.to_ascii_lowercase();
            lower.as_str()
        } else {
            name
        };
        let mut value = EnvoyBuffer::EMPTY;
        let mut count = 0usize;
        // SAFETY: `filter` is the current hook's stream; the buffers are ours.
        let ok = unsafe {
            abi::envoy_dynamic_module_callback_http_get_header(
                filter,
                kind,
                ModuleBuffer::of(name.as_bytes()),
                &mut value,
                0,
                &mut count,
            )
        };
        // SAFETY: Envoy's value is valid until this hook returns; copied now.
        (ok && count > 0).then(|| unsafe { value.bytes() }.to_vec())
    }

    fn attribute(&self, id: abi::AttributeId) -> Option<Vec<u8>> {
        let filter = self.filter?;
        let mut value = EnvoyBuffer::EMPTY;
        // SAFETY: as in `header`.
        let ok = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_get_attribute_string(filter, id, &mut value)
        };
        // SAFETY: as in `header`.
        ok.then(|| unsafe { value.bytes() }.to_vec())
    }

    /// The first `len` bytes of the body chunk `kind` being delivered.
    /// `len` bytes of a body from `offset` (across Envoy's slices).
    fn body(&self, kind: abi::BodyType, offset: usize, len: usize) -> Option<Vec<u8>> {
        let filter = self.filter?;
        // SAFETY: as in `header`; `chunks` has room for every buffer.
        let count = unsafe { abi::envoy_dynamic_module_callback_http_get_body_chunks_size(filter, kind) };
        let mut chunks = vec![EnvoyBuffer::EMPTY; count];
        // SAFETY: `chunks` has room for the `count` buffers Envoy reported.
        let ok = unsafe {
            abi::envoy_dynamic_module_callback_http_get_body_chunks(filter, kind, chunks.as_mut_ptr())
        };
        if !ok {
            return None;
        }
        let mut body = Vec::with_capacity(len.min(1 << 16));
        let mut skip = offset;
        for chunk in &chunks {
            // SAFETY: as in `header`.
            let whole = unsafe { chunk.bytes() };
            let bytes = whole.get(skip.min(whole.len())..).unwrap_or_default();
            skip = skip.saturating_sub(whole.len());
            let room = len.saturating_sub(body.len());
            body.extend_from_slice(bytes.get(..room.min(bytes.len())).unwrap_or_default());
        }
        Some(body)
    }

    /// The route's class: its per-route config, else its metadata.
    fn route_class(&self) -> Option<Vec<u8>> {
        let filter = self.filter?;
        // SAFETY: the pointer is ours (`per_route_config_new`), alive while
        // the route is (at least this hook).
        let route = unsafe { abi::envoy_dynamic_module_callback_get_most_specific_route_config(filter) };
        // SAFETY: `route` is ours (`per_route_config_new`) or null.
        if let Some(config) = unsafe { RouteConfig::from_ptr(route) } {
            return Some(config.class.as_bytes().to_vec());
        }
        let [_, _, _, namespace, field] = ROUTE_CLASS_PROPERTY;
        let mut value = EnvoyBuffer::EMPTY;
        // SAFETY: as in `header`.
        let ok = unsafe {
            abi::envoy_dynamic_module_callback_http_get_metadata_string(
                filter,
                abi::METADATA_ROUTE,
                ModuleBuffer::of(namespace.as_bytes()),
                ModuleBuffer::of(field.as_bytes()),
                &mut value,
            )
        };
        // SAFETY: as in `header`.
        ok.then(|| unsafe { value.bytes() }.to_vec())
    }
}

impl Host for EnvoyHost<'_> {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        self.header(abi::HEADER_REQUEST, name)
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        self.header(abi::HEADER_RESPONSE, name)
    }

    fn response_body(&self, len: usize) -> Option<Vec<u8>> {
        self.body(abi::BODY_RECEIVED_RESPONSE, 0, len)
    }

    fn response_trailer(&self, name: &str) -> Option<Vec<u8>> {
        self.header(abi::HEADER_RESPONSE_TRAILER, name)
    }

    fn request_body(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        self.body(abi::BODY_RECEIVED_REQUEST, offset, len)
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        if path == ROUTE_CLASS_PROPERTY {
            self.route_class()
        } else if path == ROUTE_NAME_PROPERTY {
            self.attribute(abi::ATTRIBUTE_XDS_ROUTE_NAME)
        } else if path == SOURCE_ADDRESS_PROPERTY {
            self.attribute(abi::ATTRIBUTE_SOURCE_ADDRESS)
        } else if path == CODE_DETAILS {
            self.attribute(abi::ATTRIBUTE_RESPONSE_CODE_DETAILS)
        } else if NODE_ID.contains(&path) {
            self.identity.node_id.clone().map(String::into_bytes)
        } else if REGION.contains(&path) {
            self.identity.region.clone().map(String::into_bytes)
        } else {
            None
        }
    }

    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        let mut value = Vec::new();
        let cas = self.store.get_into(key, &mut value)?;
        Ok((cas.map(|_| value), cas))
    }

    fn shared_get_into(&self, key: &str, out: &mut Vec<u8>) -> Result<Option<u32>, HostError> {
        self.store.get_into(key, out)
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<CasResult, HostError> {
        self.store.set(key, value, cas)
    }

    fn shared_create(&self, key: &str, value: &[u8]) -> Result<CasResult, HostError> {
        self.store.create(key, value)
    }
}
