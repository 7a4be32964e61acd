//! Links the module with `-z now`: Envoy `dlopen`s it lazily, so without it
//! a callback missing from the Envoy that loads it would be found only when
//! first called (a crash inside Envoy); with it, the module fails to load
//! and Envoy refuses the configuration (src/abi.rs).
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,now");
}
