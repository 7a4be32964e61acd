//! docs/own-envoy.md, run as written: its shell blocks in order (with its
//! first block's paths pointed at the built artefacts and a temporary
//! directory), its YAML blocks written to the files the page names, its
//! `sh start` block as the Envoy it starts, and its ports moved to free
//! ones. The page's checks are its own: `grep` and `set -e` fail the block.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::process::{Child, Command, Stdio};

use tenantgate_integration_tests::{cli_bin, envoy_bin, free_port, repo, wasm_file};

/// One fenced block: its info string and its text.
struct Block {
    info: String,
    text: String,
    /// The `$WORK/NAME` the paragraph before it names, if any.
    file: Option<String>,
}

fn blocks(doc: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut current: Option<Block> = None;
    let mut before = String::new();
    let mut ended = false;
    for line in doc.lines() {
        match (&mut current, line.strip_prefix("```")) {
            (None, Some(info)) => {
                let file = before
                    .rfind("`$WORK/")
                    .map(|i| before[i + 7..].split('`').next().unwrap_or("").to_owned());
                current = Some(Block {
                    info: info.trim().to_owned(),
                    text: String::new(),
                    file,
                });
                before.clear();
                ended = false;
            }
            (Some(_), Some(_)) => out.push(current.take().unwrap()),
            (Some(b), None) => {
                b.text.push_str(line);
                b.text.push('\n');
            }
            (None, None) => {
                // The last paragraph before a block, blank lines aside.
                if line.trim().is_empty() {
                    ended = true;
                } else {
                    if ended {
                        before.clear();
                        ended = false;
                    }
                    before.push_str(line);
                    before.push('\n');
                }
            }
        }
    }
    out
}

struct Stop(Child);

impl Drop for Stop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_own_envoy_page_runs_as_written() {
    let doc = std::fs::read_to_string(repo().join("docs/own-envoy.md")).unwrap();
    let (listener, admin) = (free_port(), free_port());
    let doc = doc
        .replace("10080", &listener.to_string())
        .replace("10081", &admin.to_string());
    let work = std::env::temp_dir().join(format!("tenantgate-own-envoy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let vars = format!(
        "REPO={}\nTG={}\nWASM={}\nENVOY={}\nWORK={}\n",
        repo().display(),
        cli_bin().display(),
        wasm_file().display(),
        envoy_bin().display(),
        work.display()
    );
    let all = blocks(&doc);
    assert!(
        all[0].text.contains("WORK=$(mktemp -d)"),
        "the first block names the paths"
    );
    let run = |script: &str| {
        let out = Command::new("bash")
            .args(["-euo", "pipefail", "-c", &format!("{vars}{script}")])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "docs/own-envoy.md:\n{script}\nstdout:\n{stdout}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let mut envoy: Option<Stop> = None;
    let mut printed = String::new();
    let mut shell_blocks = 0;
    for b in &all[1..] {
        match b.info.as_str() {
            "yaml" => {
                let name = b.file.clone().expect("a YAML block names its $WORK file");
                std::fs::write(work.join(name), &b.text).unwrap();
            }
            "sh start" => {
                let log = std::fs::File::create(work.join("envoy.log")).unwrap();
                let child = Command::new("bash")
                    .args(["-c", &format!("{vars}exec {}", b.text.trim())])
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .unwrap();
                envoy = Some(Stop(child));
            }
            "sh" if b.text.contains("rm -rf \"$WORK\"") => {
                drop(envoy.take());
                run(&b.text);
                assert!(!work.exists(), "cleaned up");
                shell_blocks += 1;
            }
            "sh" => {
                printed.push_str(&run(&b.text));
                shell_blocks += 1;
            }
            other => panic!("a block of kind {other:?}"),
        }
    }
    assert!(shell_blocks >= 5, "{shell_blocks} shell blocks run");
    // The verify step's own words: a burst of 200s, then 429s, then the reload.
    assert!(printed.contains(" 200") && printed.contains(" 429"), "{printed}");
    assert!(printed.contains("reloaded"), "{printed}");
}
