//! tenantgate's central cluster: allowance reconciliation across nodes and
//! regions.
//!
//! * [`alloc`]: the allocator. Its header states THE BOUND on what all nodes
//!   together admit, and why it holds.
//! * [`bound`]: the bound's formula as a function, for the simulator and the
//!   README.
//! * [`sim`]: a deterministic simulator (virtual time, seeded PRNG) that runs
//!   the real node code (`tenantgate::sync::node`) against the real
//!   allocator over a lossy, slow network, and measures the bound.
//!
//! Pure like the filter's core: time is always an argument. There is no
//! networking yet (`tenantgate serve` is not built).

pub mod alloc;
pub mod bound;
pub mod error;
pub mod sim;

pub use alloc::{AllocConfig, Allocator, GlobalLimit};
pub use error::{AllocError, ConfigError};
