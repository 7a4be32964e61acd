//! `tenantgate --version`: the package version and the git commit it was
//! built from (`TENANTGATE_COMMIT`). The commit comes from, in order: the
//! environment variable `TENANTGATE_COMMIT` (a packager's override),
//! `git rev-parse HEAD` in the source tree, or `unknown` when there is no
//! git (a source tarball). Only the commit goes in, never a time or a
//! host, so a rebuild of the same commit is the same binary.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

fn main() {
    println!("cargo:rerun-if-env-changed=TENANTGATE_COMMIT");
    let commit = std::env::var("TENANTGATE_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=TENANTGATE_COMMIT={commit}");
    // Rebuild when HEAD moves: HEAD itself (a checkout) and the ref it names
    // (a commit), in this worktree's git directory and the common one.
    // Only files that exist: a missing one would rerun this every build.
    let head_ref = git(&["symbolic-ref", "-q", "HEAD"]);
    for dir in [
        git(&["rev-parse", "--path-format=absolute", "--git-dir"]),
        git(&["rev-parse", "--path-format=absolute", "--git-common-dir"]),
    ]
    .into_iter()
    .flatten()
    {
        let dir = std::path::Path::new(&dir);
        let files = [Some("HEAD"), head_ref.as_deref(), Some("packed-refs")];
        for file in files.into_iter().flatten().map(|f| dir.join(f)) {
            if file.exists() {
                println!("cargo:rerun-if-changed={}", file.display());
            }
        }
    }
}
