//! `tenantgate package`: the filter's .wasm, or a `tenantgate serve`
//! binary, as an OCI image layout (`tenantgate_cli::oci` writes them).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use tenantgate_cli::exit::{self, code};

#[derive(Args)]
pub struct PackageArgs {
    /// The filter's .wasm.
    #[arg(long, default_value = "target/wasm32-wasip1/wasm-release/tenantgate.wasm")]
    wasm: PathBuf,
    /// The OCI image layout directory to write.
    #[arg(long, default_value = "target/oci/tenantgate")]
    out: PathBuf,
    /// The image's tag in the layout (`oci:DIR:TAG`).
    #[arg(long, default_value = env!("CARGO_PKG_VERSION"))]
    tag: String,
    /// Package this `tenantgate` binary (static: `make release`) as the
    /// `tenantgate serve` image (linux/amd64, non-root) instead of the .wasm.
    #[arg(long, value_name = "BINARY", conflicts_with = "wasm")]
    serve: Option<PathBuf>,
}

pub fn run(args: &PackageArgs) -> ExitCode {
    if let Some(binary) = &args.serve {
        return package_service(binary, args);
    }
    let wasm = match std::fs::read(&args.wasm) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("{}: {e} (build it with `make wasm`)", args.wasm.display());
            return code(exit::INVALID);
        }
    };
    match tenantgate_cli::oci::package(&wasm, &args.out, &args.tag) {
        Ok(p) => {
            println!("image: oci:{}:{}", args.out.display(), p.tag);
            println!("digest: {}", p.manifest_digest);
            println!("wasm sha256: {}", p.content_sha256);
            println!(
                "layer: {} ({})",
                p.layer_digest,
                tenantgate_cli::oci::LAYER_MEDIA_TYPE
            );
            code(exit::OK)
        }
        Err(e) => {
            eprintln!("tenantgate package: {}: {e}", args.out.display());
            code(exit::FAILED)
        }
    }
}

fn package_service(binary: &Path, args: &PackageArgs) -> ExitCode {
    let bytes = match std::fs::read(binary) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("{}: {e} (`make release` builds it)", binary.display());
            return code(exit::INVALID);
        }
    };
    let image = tenantgate_cli::oci::ServiceImage {
        binary: &bytes,
        version: env!("CARGO_PKG_VERSION"),
        revision: env!("TENANTGATE_COMMIT"),
    };
    match tenantgate_cli::oci::package_service(&image, &args.out, &args.tag) {
        Ok(p) => {
            println!("image: oci:{}:{}", args.out.display(), p.tag);
            println!("digest: {}", p.manifest_digest);
            println!("binary sha256: {}", p.content_sha256);
            println!(
                "layer: {} ({})",
                p.layer_digest,
                tenantgate_cli::oci::LAYER_MEDIA_TYPE
            );
            code(exit::OK)
        }
        Err(e) if e.kind() == std::io::ErrorKind::Other => {
            eprintln!("tenantgate package: {}: {e}", binary.display());
            code(exit::INVALID)
        }
        Err(e) => {
            eprintln!("tenantgate package: {}: {e}", args.out.display());
            code(exit::FAILED)
        }
    }
}
