//! Commands of the product that this version does not have yet: they fail plainly.

use crate::commands::ExitStatus;

pub fn not_yet(command: &str, what: &str) -> anyhow::Result<ExitStatus> {
    eprintln!("error: `scfoundry {command}` is not implemented in scfoundry {} yet", env!("CARGO_PKG_VERSION"));
    eprintln!("hint: {what}");
    Ok(ExitStatus::Failure)
}
