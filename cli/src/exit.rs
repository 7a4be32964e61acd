//! The exit codes of every `tenantgate` subcommand (docs/cli.md): one
//! meaning per number, whatever the subcommand.

use std::process::ExitCode;

/// Done.
pub const OK: u8 = 0;
/// Refused: invalid input (a policy, file or value the command reads), a
/// request the service refused (`quota`: a non-2xx answer), or a check that
/// failed (`sim`: a run above its bound). The message says what and why.
pub const INVALID: u8 = 1;
/// Usage: an unknown subcommand or flag, a missing or malformed argument
/// (clap's own code, kept for ours).
pub const USAGE: u8 = 2;
/// Could not run: a file that cannot be written, a service that cannot be
/// reached, a listener that cannot bind, a service that stopped on an error.
pub const FAILED: u8 = 3;
/// `policy diff` only: the policies differ (it exits [`OK`] when they do not).
pub const DIFFERS: u8 = 4;

/// The process's exit code for one of the constants above.
pub fn code(c: u8) -> ExitCode {
    ExitCode::from(c)
}
