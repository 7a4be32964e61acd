//! What is generated from the CLI's own definitions, never written by hand:
//! the policy's JSON Schema (from the spec structs the validator reads,
//! `tenantgate::policy::schema`), shell completions and man pages (from the
//! clap definition of `tenantgate` itself). `make release` ships all three.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

pub use clap_complete::Shell;

/// The policy schema as `tenantgate policy schema` prints it and
/// `policies/tenantgate.schema.json` holds it (a test keeps them equal).
pub fn policy_schema() -> String {
    tenantgate::policy::schema::json_schema_text()
}

/// The completion script of `cmd` for `shell`.
pub fn completions(mut cmd: clap::Command, shell: Shell, out: &mut dyn Write) {
    let name = cmd.get_name().to_owned();
    clap_complete::generate(shell, &mut cmd, name, out);
}

/// One man page per command and subcommand (`tenantgate.1`,
/// `tenantgate-policy.1`, `tenantgate-policy-check.1`, …) into `dir`,
/// created if missing; the paths written, in a stable order.
pub fn man_pages(cmd: clap::Command, dir: &Path) -> io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    let mut written = Vec::new();
    write_pages(cmd, dir, &mut written)?;
    Ok(written)
}

fn write_pages(cmd: clap::Command, dir: &Path, written: &mut Vec<PathBuf>) -> io::Result<()> {
    let subcommands: Vec<clap::Command> = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned()
        .collect();
    written.push(clap_mangen::Man::new(cmd).generate_to(dir)?);
    for sub in subcommands {
        write_pages(sub, dir, written)?;
    }
    Ok(())
}
