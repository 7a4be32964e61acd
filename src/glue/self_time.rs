//! `--features self-time`: the engine's own time per decision inside Envoy's
//! VM, for `make bench` (never in a production build).
//!
//! On each configuration the filter decides `ROUNDS` times for the policy's
//! first tenant over an in-memory host (the in-memory host ([`crate::memory`])),
//! timed with Envoy's clock, then replays the same host calls alone, and
//! logs both at warning level. The difference is what `prepare` and
//! `charge` cost in the VM without any hostcall: the part of a decision
//! that is tenantgate's code, next to the hostcalls `make bench`'s probe
//! prices.

use std::cell::RefCell;

use crate::engine::{self, Scratch};
use crate::host::Clock;
use crate::host::{CasResult, Host, HostError};
use crate::memory::{MemoryHost, SharedStore};
use crate::policy::{self, Policy};

const ROUNDS: u64 = 20_000;

/// One host call a decision made, to replay.
enum Call {
    Header(String),
    Property(Vec<String>),
    Get(String),
    Set(String, Vec<u8>),
}

/// A recorded call, borrowed as the engine passes it.
enum Replay<'a> {
    Header(&'a str),
    Property(Vec<&'a str>),
    Get(&'a str),
    Set(&'a str, &'a [u8]),
}

impl Replay<'_> {
    fn of(call: &Call) -> Replay<'_> {
        match call {
            Call::Header(name) => Replay::Header(name),
            Call::Property(path) => Replay::Property(path.iter().map(String::as_str).collect()),
            Call::Get(key) => Replay::Get(key),
            Call::Set(key, value) => Replay::Set(key, value),
        }
    }
}

/// The in-memory host, recording the calls of one decision.
struct Recording<'a> {
    host: &'a MemoryHost,
    calls: RefCell<Vec<Call>>,
}

impl Host for Recording<'_> {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        self.calls.borrow_mut().push(Call::Header(name.to_owned()));
        self.host.request_header(name)
    }
    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        self.host.response_header(name)
    }
    fn response_body(&self, len: usize) -> Option<Vec<u8>> {
        self.host.response_body(len)
    }
    fn response_trailer(&self, name: &str) -> Option<Vec<u8>> {
        self.host.response_trailer(name)
    }
    fn request_body(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        self.host.request_body(offset, len)
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        let owned = path.iter().map(|p| (*p).to_owned()).collect();
        self.calls.borrow_mut().push(Call::Property(owned));
        Host::property(self.host, path)
    }
    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        self.calls.borrow_mut().push(Call::Get(key.to_owned()));
        self.host.shared_get(key)
    }
    fn shared_get_into(&self, key: &str, out: &mut Vec<u8>) -> Result<Option<u32>, HostError> {
        self.calls.borrow_mut().push(Call::Get(key.to_owned()));
        self.host.shared_get_into(key, out)
    }
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<CasResult, HostError> {
        self.calls
            .borrow_mut()
            .push(Call::Set(key.to_owned(), value.to_vec()));
        self.host.shared_set(key, value, cas)
    }
    fn shared_create(&self, key: &str, value: &[u8]) -> Result<CasResult, HostError> {
        self.shared_set(key, value, None)
    }
}

/// Runs the measurement and logs it (see the module header).
pub fn report(policy: &Policy) {
    let Some((tenant, _)) = policy.tenants().next() else {
        log::warn!("tenantgate self-time: the policy has no tenant");
        return;
    };
    let mut host = MemoryHost::new(SharedStore::new());
    if let policy::Identity::Header(name) = &policy.identity {
        host = host.header(name, tenant.as_bytes());
    }
    // The first class, as route metadata and as the route's name: every
    // way of classifying finds it.
    if let Some(class) = policy.route_classes().next() {
        host = host
            .route_class(&class.name)
            .property(&engine::ROUTE_NAME_PROPERTY, class.name.as_bytes());
    }
    let now = |fallback: u64| super::WallClock.now().unwrap_or(fallback);
    let start = now(0);
    let mut scratch = Scratch::default();
    // One decision inserts the key; the next, recorded, is the steady state.
    let Ok(first) = engine::prepare(policy, &host) else {
        log::warn!("tenantgate self-time: the request is not classified");
        return;
    };
    let _ = engine::charge(policy, &first, &host, start, &mut scratch);
    let recording = Recording {
        host: &host,
        calls: RefCell::new(Vec::new()),
    };
    if let Ok(p) = engine::prepare(policy, &recording) {
        let _ = engine::charge(policy, &p, &recording, start.saturating_add(1_000), &mut scratch);
    }
    let calls = recording.calls.into_inner();

    let t0 = now(start);
    for i in 0..ROUNDS {
        if let Ok(p) = engine::prepare(policy, &host) {
            let at = start.saturating_add(i.saturating_add(2).saturating_mul(1_000));
            std::hint::black_box(engine::charge(policy, &p, &host, at, &mut scratch));
        }
    }
    let t1 = now(t0);
    let mut out = Vec::new();
    // The calls as the engine makes them (borrowed paths), built before the
    // clock runs.
    let replay: Vec<Replay<'_>> = calls.iter().map(Replay::of).collect();
    let t2 = now(t1);
    for _ in 0..ROUNDS {
        for call in &replay {
            match call {
                Replay::Header(name) => drop(std::hint::black_box(host.request_header(name))),
                Replay::Property(path) => drop(std::hint::black_box(Host::property(&host, path))),
                Replay::Get(key) => drop(std::hint::black_box(host.shared_get_into(key, &mut out))),
                Replay::Set(key, value) => drop(std::hint::black_box(host.shared_set(key, value, None))),
            }
        }
    }
    let t3 = now(t2);
    let per = |ns: u64| ns / ROUNDS;
    let decision = per(t1.saturating_sub(t0));
    let host_only = per(t3.saturating_sub(t2));
    log::warn!(
        "tenantgate self-time: policy {} decision {decision} ns, its {} host calls alone {host_only} ns, engine {} ns",
        policy.version,
        calls.len(),
        decision.saturating_sub(host_only)
    );
}
