//! `tally-bench`: measures Tally's embedded engine against a per-increment-flush sled
//! counter and prints a Markdown table on stdout. See `--help`.

use std::process::ExitCode;
use tally_bench::{Options, Parsed, USAGE};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let opts = match Options::parse(args.iter().skip(1).cloned()) {
        Ok(Parsed::Run(o)) => o,
        Ok(Parsed::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tally_bench::runtime() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let report = runtime.block_on(tally_bench::run(&opts, args.join(" ")));
    print!("{}", report.render());
    if report.all_verified() {
        ExitCode::SUCCESS
    } else {
        eprintln!("some cells were NOT verified; see the table");
        ExitCode::FAILURE
    }
}
