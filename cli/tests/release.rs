//! Release artefacts (issue 33): `tenantgate --version` names the commit,
//! and the `tenantgate serve` image is what a registry client and a
//! container runtime see: `skopeo inspect` reports the printed digest, a
//! linux/amd64 config that runs as 65532 with the binary as entrypoint,
//! and the entrypoint runs from the unpacked layer.
//!
//! `make release` runs this with TENANTGATE_SERVE_BINARY set to the static
//! (musl) binary it ships: the binary must then have no dynamic loader,
//! and, as root, it is run by `chroot` into the unpacked layer as user
//! 65532 (nothing of the host's filesystem), as `serve` until `/readyz`
//! answers 200. Without it (CI's `make test`), the test's own binary is
//! packaged and its entrypoint run from the layer with the host's libraries.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn field<'a>(text: &'a str, prefix: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} in {text}"))
}

#[test]
fn version_names_the_release_and_the_commit() {
    let out = run(Command::new(env!("CARGO_BIN_EXE_tenantgate")).arg("--version"));
    let expected_commit = Command::new("git")
        .current_dir(repo())
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned());
    let commit = std::env::var("TENANTGATE_COMMIT").unwrap_or(expected_commit);
    assert_eq!(
        out.trim(),
        format!("tenantgate {} (commit {commit})", env!("CARGO_PKG_VERSION"))
    );
}

/// Whether an ELF file names a dynamic loader (a `PT_INTERP` program header).
fn has_interpreter(elf: &[u8]) -> bool {
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let u64_at = |o: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&elf[o..o + 8]);
        u64::from_le_bytes(b) as usize
    };
    assert_eq!(&elf[..5], b"\x7fELF\x02", "a 64-bit ELF");
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    (0..phnum).any(|i| {
        let o = phoff + i * phentsize;
        u32::from_le_bytes([elf[o], elf[o + 1], elf[o + 2], elf[o + 3]]) == 3
    })
}

fn http_status(port: u16, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_whitespace().nth(1)?.parse().ok()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn the_service_image_runs_its_entrypoint_from_its_layer() {
    let released = std::env::var_os("TENANTGATE_SERVE_BINARY").map(PathBuf::from);
    let tmp = tempfile::tempdir().unwrap();
    let binary = released.clone().unwrap_or_else(|| {
        // The test's own binary without its debug info (236 MB with it).
        let stripped = tmp.path().join("tenantgate");
        run(Command::new("strip")
            .arg("--strip-debug")
            .arg("-o")
            .arg(&stripped)
            .arg(env!("CARGO_BIN_EXE_tenantgate")));
        stripped
    });
    let layout = tmp.path().join("image");
    let printed = run(Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .arg("package")
        .arg("--serve")
        .arg(&binary)
        .arg("--out")
        .arg(&layout)
        .args(["--tag", "test"]));
    let digest = field(&printed, "digest: ");
    let reference = format!("oci:{}:test", layout.display());
    let inspected: serde_json::Value =
        serde_json::from_str(&run(Command::new("skopeo").args(["inspect", &reference]))).unwrap();
    assert_eq!(inspected["Digest"], digest, "{inspected}");
    assert_eq!(
        (inspected["Os"].as_str(), inspected["Architecture"].as_str()),
        (Some("linux"), Some("amd64"))
    );
    let config: serde_json::Value = serde_json::from_str(&run(
        Command::new("skopeo").args(["inspect", "--config", &reference])
    ))
    .unwrap();
    assert_eq!(config["config"]["User"], "65532:65532", "{config}");
    let entrypoint = config["config"]["Entrypoint"][0].as_str().unwrap().to_owned();
    assert_eq!(entrypoint, "/usr/local/bin/tenantgate");

    // Unpack the layer as a runtime would.
    let pulled = tmp.path().join("pulled");
    run(Command::new("skopeo").args([
        "copy",
        "--quiet",
        &reference,
        &format!("dir:{}", pulled.display()),
    ]));
    let raw: serde_json::Value =
        serde_json::from_str(&run(Command::new("skopeo").args(["inspect", "--raw", &reference]))).unwrap();
    let layers = raw["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1);
    let layer = pulled.join(
        layers[0]["digest"]
            .as_str()
            .unwrap()
            .trim_start_matches("sha256:"),
    );
    let root = tmp.path().join("rootfs");
    std::fs::create_dir_all(&root).unwrap();
    run(Command::new("tar").arg("-C").arg(&root).arg("-xzf").arg(&layer));
    let unpacked = root.join(entrypoint.trim_start_matches('/'));
    assert_eq!(std::fs::read(&unpacked).unwrap(), std::fs::read(&binary).unwrap());
    let version = run(Command::new(&unpacked).arg("--version"));
    assert!(version.starts_with("tenantgate "), "{version}");

    let Some(released) = released else { return };
    // The shipped binary: static, and it serves from the image alone.
    assert!(
        !has_interpreter(&std::fs::read(&released).unwrap()),
        "{} names a dynamic loader: not static",
        released.display()
    );
    let is_root = run(Command::new("id").arg("-u")).trim() == "0";
    if !is_root {
        eprintln!("not root: the chroot run is skipped (make release runs it as root)");
        return;
    }
    let policy = std::fs::read(repo().join("policies/demo.yaml")).unwrap();
    std::fs::write(root.join("tmp/policy.yaml"), policy).unwrap();
    let (sync, admin) = (free_port(), free_port());
    let mut child = Command::new("chroot")
        .arg("--userspec=65532:65532")
        .arg(&root)
        .arg(&entrypoint)
        .args(["serve", "--policy", "/tmp/policy.yaml"])
        .args([
            "--listen",
            &format!("127.0.0.1:{sync}"),
            "--admin",
            &format!("127.0.0.1:{admin}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let ready = loop {
        if http_status(admin, "/readyz") == Some(200) {
            break true;
        }
        if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert!(
        ready,
        "serve in the image never became ready: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
