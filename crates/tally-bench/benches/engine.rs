//! `cargo bench -p tally-bench`: the quick benchmark (the cells of `tally-bench --quick`;
//! `--seconds`, `--counters` and `--only` still apply, and a bare word is taken as
//! `--only`), printed as Markdown. Fails if any cell is not verified.

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let mut args = vec!["--quick".to_string()];
    for a in argv.iter().skip(1) {
        if !a.starts_with('-') && args.last().is_none_or(|prev| !prev.starts_with("--") || prev == "--quick")
        {
            args.push("--only".into());
        }
        args.push(a.clone());
    }
    let opts = match tally_bench::Options::parse(args) {
        Ok(tally_bench::Parsed::Run(o)) => o,
        Ok(tally_bench::Parsed::Help) => {
            print!("{}", tally_bench::USAGE);
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let runtime = tally_bench::runtime().expect("tokio runtime");
    let report = runtime.block_on(tally_bench::run(&opts, argv.join(" ")));
    print!("{}", report.render());
    assert!(report.all_verified(), "some cells were NOT verified; see the table");
}
