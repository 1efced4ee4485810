//! `tally`: the command-line client of a Tally node. See the library docs
//! ([`tally_cli`]) for the commands, the output formats and the exit codes.

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(tally_cli::main_with(tally_cli::cli::Cli::parse()))
}
