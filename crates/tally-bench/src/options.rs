//! Command-line options, parsed by hand (no clap).

use std::time::Duration;

/// The usage text printed by `--help`.
pub const USAGE: &str = "\
tally-bench: prints a Markdown table of Tally's embedded throughput and latency.

USAGE:
    tally-bench [--quick] [--seconds N] [--only SUBSTRING] [--counters N] [--sample-every N]

OPTIONS:
    --quick             short run for CI smoke (0.5 s per cell, 20,000 counters)
    --seconds N         seconds per cell (default 3; 0.5 with --quick)
    --only SUBSTRING    run only cells whose key contains SUBSTRING (or any of several,
                        comma-separated: --only sync/8sh,bounded,windowed); keys look like
                        batched/8sh/64w, sync/64sh/1w, handle/64sh/64w, baseline/1sh/4w, cached-read/64sh,
                        fresh-read/8sh, memory, hotpath/... (hotpath selects the hot-path
                        cells: hotpath/sync/1sh/1w, hotpath/new-counters/64w, ...).
                        Bounded and windowed counters (8 shards, 1 and 64 writers; their
                        plain references are sync/8sh/... and batched/8sh/...):
                        bounded/8sh/64w (min 0, every shard stocked, writers add -1),
                        bounded-max/8sh/64w (max, writers add +1), bounded-borrow/8sh/64w
                        (min 0, the stock on one shard no writer reaches: every decrement
                        borrows), windowed/8sh/64w and windowed-batched/8sh/64w (windows
                        1m,1h,24h, writers add +1), limited/8sh/64w (the same windows
                        and a limit of 2^40 per 1m, writers add +1)
    --counters N        idle counters for the memory row (default 1,000,000; 20,000 with --quick)
    --sample-every N    time 1 in N calls (random gaps) in the batched rows (default 64)
    -h, --help          this text
";

/// How a run is configured.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Short run for CI smoke.
    pub quick: bool,
    /// Measuring time per cell, in seconds.
    pub seconds: f64,
    /// Run only cells whose key contains this (or any of its comma-separated parts).
    pub only: Option<String>,
    /// Counters created by the memory row.
    pub counters: usize,
    /// The batched rows time one call in this many on average (timing costs about as much as the call).
    pub sample_every: u64,
}

impl Default for Options {
    fn default() -> Self {
        Self { quick: false, seconds: 3.0, only: None, counters: 1_000_000, sample_every: 64 }
    }
}

/// What the command line asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum Parsed {
    /// Run with these options.
    Run(Options),
    /// Print the usage text.
    Help,
}

impl Options {
    /// The quick configuration (CI smoke, `cargo bench`).
    pub fn quick() -> Self {
        Self { quick: true, seconds: 0.5, counters: 20_000, ..Self::default() }
    }

    /// Parses the arguments after the program name.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Parsed, String> {
        let args: Vec<String> = args.into_iter().collect();
        let quick = args.iter().any(|a| a == "--quick");
        let mut o = if quick { Self::quick() } else { Self::default() };
        let mut it = args.into_iter();
        while let Some(a) = it.next() {
            let (flag, inline) = match a.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
                _ => (a.clone(), None),
            };
            let mut value = |name: &str| -> Result<String, String> {
                inline.clone().or_else(|| it.next()).ok_or_else(|| format!("{name} needs a value"))
            };
            match flag.as_str() {
                "--quick" => {}
                "-h" | "--help" => return Ok(Parsed::Help),
                "--seconds" => {
                    let v = value("--seconds")?;
                    o.seconds = v.parse().map_err(|_| format!("--seconds: not a number: {v:?}"))?;
                    if !(o.seconds > 0.0 && o.seconds.is_finite()) {
                        return Err(format!("--seconds must be positive (got {v})"));
                    }
                }
                "--only" => o.only = Some(value("--only")?),
                "--counters" => {
                    let v = value("--counters")?.replace(['_', ','], "");
                    o.counters = v.parse().map_err(|_| format!("--counters: not a count: {v:?}"))?;
                }
                "--sample-every" => {
                    let v = value("--sample-every")?;
                    o.sample_every = v.parse().map_err(|_| format!("--sample-every: not a count: {v:?}"))?;
                    if o.sample_every == 0 {
                        return Err("--sample-every must be at least 1".into());
                    }
                }
                // `cargo bench` passes `--bench` to harness-less targets.
                "--bench" => {}
                other => return Err(format!("unknown argument {other:?}\n\n{USAGE}")),
            }
        }
        Ok(Parsed::Run(o))
    }

    /// Measuring time per cell.
    pub fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.seconds)
    }

    /// Whether the cell with this key is selected: its key contains `only`, or one of
    /// `only`'s comma-separated parts.
    pub fn selects(&self, key: &str) -> bool {
        self.only.as_deref().is_none_or(|s| s.split(',').any(|part| key.contains(part)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Parsed, String> {
        Options::parse(s.split_whitespace().map(String::from))
    }

    #[test]
    fn defaults_and_flags() {
        assert_eq!(parse("").unwrap(), Parsed::Run(Options::default()));
        let Parsed::Run(o) = parse("--seconds 1.5 --quick --only sync --counters 1_000").unwrap() else {
            panic!()
        };
        assert!(o.quick);
        assert_eq!(o.seconds, 1.5);
        assert_eq!(o.counters, 1000);
        assert_eq!(o.only.as_deref(), Some("sync"));
        let Parsed::Run(o) = parse("--quick --seconds=2").unwrap() else { panic!() };
        assert_eq!((o.seconds, o.counters), (2.0, 20_000));
        assert!(parse("--seconds").is_err());
        assert!(parse("--seconds 0").is_err());
        assert!(parse("--frobnicate").is_err());
        assert_eq!(parse("--help").unwrap(), Parsed::Help);
    }

    #[test]
    fn only_filters_by_substring() {
        let o = Options { only: Some("sync/64".into()), ..Options::default() };
        assert!(o.selects("sync/64sh/4w"));
        assert!(!o.selects("sync/8sh/4w"));
        assert!(Options::default().selects("anything"));
        let o = Options { only: Some("sync/8sh,bounded".into()), ..Options::default() };
        assert!(o.selects("sync/8sh/64w"));
        assert!(o.selects("bounded-borrow/8sh/1w"));
        assert!(!o.selects("batched/8sh/64w"));
        assert!(!o.selects("windowed/8sh/64w"));
    }
}
