//! The `tenantgate` command's library: policy files and ECDS resources.
//! The binary (`main.rs`) is a thin argument parser over these.

pub mod ecds;
pub mod exit;
pub mod explain;
pub mod generate;
pub mod http;
pub mod import;
pub mod locate;
pub mod manifests;
pub mod oci;
pub mod policy_file;
pub mod top;
