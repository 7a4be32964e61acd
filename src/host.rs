//! What the core needs from the proxy, as a trait: the glue implements it
//! with proxy-wasm hostcalls, the tools and the native tests with the
//! in-memory host ([`crate::memory`]). Every method is infallible or
//! returns a `Result` the core handles; none may trap.

/// The outcome of a compare-and-swap write to shared data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CasResult {
    Written,
    /// Another worker wrote the key since it was read.
    Conflict,
}

/// The host could not perform a shared-data operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostError;

pub trait Host {
    /// A request header's raw bytes (names are matched case-insensitively).
    fn request_header(&self, name: &str) -> Option<Vec<u8>>;

    /// A response header's raw bytes (on the response's callbacks).
    fn response_header(&self, name: &str) -> Option<Vec<u8>>;

    /// The first `len` bytes of the response body chunk being delivered
    /// (on the response body's callback).
    fn response_body(&self, len: usize) -> Option<Vec<u8>>;

    /// A response trailer's raw bytes (on the response trailers' callback).
    fn response_trailer(&self, name: &str) -> Option<Vec<u8>>;

    /// `len` bytes of the request body from `offset`, on the request body's
    /// callback: the chunk being delivered is at the offset the host gave
    /// the core with it (`crate::pipeline::Chunk`; 0 unless the host keeps
    /// earlier chunks the filter asked it to buffer in front of it).
    fn request_body(&self, offset: usize, len: usize) -> Option<Vec<u8>>;

    /// A property's raw bytes, e.g. `["xds", "route_name"]`.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;

    /// Reads a shared-data value and its CAS token (`None` if absent).
    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError>;

    /// Reads a shared-data value into `out` (cleared; left empty if the key
    /// is absent) and returns its CAS token. The default goes through
    /// [`Host::shared_get`]; a host that can fill `out` in place saves the
    /// request path an allocation.
    fn shared_get_into(&self, key: &str, out: &mut Vec<u8>) -> Result<Option<u32>, HostError> {
        let (value, cas) = self.shared_get(key)?;
        match value {
            Some(v) => *out = v,
            None => out.clear(),
        }
        Ok(cas)
    }

    /// Writes a shared-data value if its CAS token still is `cas`. A `None`
    /// token writes unconditionally (the key did not exist when read).
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<CasResult, HostError>;

    /// Writes a key that did not exist when read: `Conflict` if it exists
    /// now. The default is [`Host::shared_set`] with no token, which is all
    /// Envoy's shared data offers a wasm filter (a missing key is written
    /// unconditionally): two workers creating one key at once both write,
    /// and the later write replaces whatever the earlier one and the
    /// updates after it stored (see `crate::table`, "Creating an entry").
    /// A host with a store of its own (the native module) creates a key only
    /// if it is still absent.
    fn shared_create(&self, key: &str, value: &[u8]) -> Result<CasResult, HostError> {
        self.shared_set(key, value, None)
    }
}

/// The host's wall clock, in nanoseconds since the Unix epoch (`None`: the
/// host could not tell). The core reads it only when a step needs the
/// time; a fixed instant is a clock too (the tests' explicit time).
pub trait Clock {
    fn now(&self) -> Option<u64>;
}

impl Clock for u64 {
    fn now(&self) -> Option<u64> {
        Some(*self)
    }
}
