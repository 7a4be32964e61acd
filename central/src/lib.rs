//! tenantgate's central cluster: allowance reconciliation across nodes and
//! regions.
//!
//! * [`alloc`]: the allocator. Its header states THE BOUND on what all nodes
//!   together admit, and why it holds.
//! * [`bound`]: the bound's formula as a function, for the simulator and the
//!   docs (docs/global-limits.md).
//! * [`sim`]: a deterministic simulator (virtual time, seeded PRNG) that runs
//!   the real node code (`tenantgate::sync::node`) against the real
//!   allocator over a lossy, slow network, and measures the bound.
//!
//! * [`store`]: where the allocator's records live (embedded, Redis,
//!   Redis Cluster).
//! * [`service`]: `tenantgate serve`, the allocator over HTTP/JSON.
//! * [`grpc`]: Envoy's rate limit protocols (RLS, RLQS) over gRPC.
//! * [`quota`]: quota reservations (the decisions, the SQLite and
//!   PostgreSQL stores, regional borrowing) and their HTTP API.
//! * [`codec`]: format 3, the compact encoding of the stores' records and
//!   of the allocator's hand-written (key, limit) record (beneath both).
//! * [`clock`], [`listener`] and [`bounded`]: plumbing beneath both APIs
//!   (the service's clock; the API listener, its mTLS identity and
//!   in-flight default; the serve loop every listener runs, with its caps
//!   on connections, streams, message sizes and bytes in flight).
//!
//! The allocator is pure like the filter's core: time is always an
//! argument; the service supplies its own clock.

pub mod alloc;
pub mod bound;
pub mod bounded;
pub mod clock;
pub mod codec;
pub mod error;
pub mod grpc;
pub mod listener;
pub mod quota;
pub mod service;
pub mod sim;
pub mod store;
/// Test and benchmark support (a throwaway `redis-server`, free ports, a
/// bare HTTP client): compiled only for this crate's own tests and for
/// crates that ask for the `testing` feature (tests, benchmarks), never
/// part of the service's API or of `tenantgate`'s build.
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use alloc::{AllocConfig, Allocator, GlobalLimit};

pub use error::{AllocError, ConfigError};
/// The global allocator of `tenantgate` (the CLI, which runs the service)
/// and of the service's benchmarks, declared by each binary as
/// `#[global_allocator] static A: ServiceAllocator = ServiceAllocator;`.
/// mimalloc: a key report allocates and frees about 45 small blocks (its
/// records' strings and maps), and glibc's malloc made the embedded store
/// about 1.3x slower (`docs/central-service.md`, "Throughput").
pub use mimalloc::MiMalloc as ServiceAllocator;
