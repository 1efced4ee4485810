//! The command line: global flags, the subcommands and their arguments, and the
//! parsers of values clap does not know (durations like `10s`).

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::time::Duration;

/// The node talked to when neither `--node` nor `TALLY_NODE` says otherwise.
pub const NODE_DEFAULT: &str = "http://127.0.0.1:7070";
/// The environment variable that names the node when `--node` is absent.
pub const NODE_ENV: &str = "TALLY_NODE";
/// The environment variable that holds the client token when `--token` is absent
/// (safer than the flag, which other users of the machine can see in `ps`).
pub const TOKEN_ENV: &str = "TALLY_TOKEN";
/// The environment variable that names the CA file when `--cacert` is absent.
pub const CACERT_ENV: &str = "TALLY_CACERT";
/// Default per-request timeout, in milliseconds.
pub const TIMEOUT_MS_DEFAULT: u64 = 10_000;
/// Longest per-request timeout accepted, in milliseconds (10 minutes).
pub const TIMEOUT_MS_MAX: u64 = 600_000;
/// Default number of concurrent writers of `tally load`.
pub const WRITERS_DEFAULT: u32 = 64;
/// Most concurrent writers of `tally load` (each holds one keep-alive connection;
/// a node accepts 1024 connections by default).
pub const WRITERS_MAX: u32 = 1024;
/// A change of the nodes that hold shards.
#[derive(Debug, Clone, PartialEq, Eq, Subcommand)]
pub enum MembershipChange {
    /// Add a node of the cluster config to the placement ring (PUT /v1/cluster/members/NODE).
    Add {
        /// The node's id.
        #[arg(value_name = "NODE")]
        id: String,
    },
    /// Remove a node from the placement ring; its shards move to the others
    /// (DELETE /v1/cluster/members/NODE).
    Remove {
        /// The node's id.
        #[arg(value_name = "NODE")]
        id: String,
    },
    /// Accept that a node whose disk was replaced lost its shards' earlier values,
    /// so reads count its shards again (POST /v1/cluster/nodes/NODE/accept-loss).
    AcceptLoss {
        /// The node's id.
        #[arg(value_name = "NODE")]
        id: String,
    },
}

/// Most increments in one request of `tally load --batch` (a node's default
/// `http.batch_items_max`).
pub const BATCH_MAX: u32 = 10_000;
/// Longest run of `tally load`.
pub const LOAD_DURATION_MAX: Duration = Duration::from_secs(3600);
/// Most nodes `tally load --nodes` spreads its writers over.
pub const LOAD_NODES_MAX: usize = 64;

const EXIT_CODES_HELP: &str = "\
Exit codes:
  0  success
  1  the node answered with an error (its code and message are printed)
  2  bad command line
  3  the node could not be reached, or did not answer in time
  4  tally load: the verification failed, or nothing was acknowledged";

/// `tally`: talk to a Tally node over its HTTP/JSON API.
#[derive(Debug, Parser)]
#[command(name = "tally", version, about, after_help = EXIT_CODES_HELP)]
pub struct Cli {
    /// The node's base URL (http:// or https://) [env: TALLY_NODE] [default: http://127.0.0.1:7070]
    #[arg(long, global = true, value_name = "URL")]
    pub node: Option<String>,
    /// Print the server's JSON (one object per command) instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// The client token sent as `Authorization: Bearer TOKEN` [env: TALLY_TOKEN]
    #[arg(long, global = true, value_name = "TOKEN")]
    pub token: Option<String>,
    /// Per-request timeout, in milliseconds.
    #[arg(
        long,
        global = true,
        value_name = "MS",
        default_value_t = TIMEOUT_MS_DEFAULT,
        value_parser = clap::value_parser!(u64).range(1..=TIMEOUT_MS_MAX),
    )]
    pub timeout_ms: u64,
    /// The CA certificate (PEM) to verify an https:// node with, instead of the
    /// system's roots [env: TALLY_CACERT].
    #[arg(long, global = true, value_name = "FILE")]
    pub cacert: Option<std::path::PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The node URL as given: `--node`, else `TALLY_NODE`, else [`NODE_DEFAULT`].
    pub fn node_arg(&self) -> String {
        self.node
            .clone()
            .or_else(|| std::env::var(NODE_ENV).ok().filter(|v| !v.trim().is_empty()))
            .unwrap_or_else(|| NODE_DEFAULT.to_string())
    }

    /// The token to send: `--token`, else `TALLY_TOKEN`, else none.
    pub fn token_arg(&self) -> Option<String> {
        self.token
            .clone()
            .or_else(|| std::env::var(TOKEN_ENV).ok())
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
    }

    /// The per-request timeout.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// The CA of `--cacert` (else `TALLY_CACERT`), read and parsed.
    pub fn cacert(&self) -> Result<Option<reqwest::Certificate>, crate::client::CliError> {
        let path = self
            .cacert
            .clone()
            .or_else(|| std::env::var_os(CACERT_ENV).filter(|v| !v.is_empty()).map(std::path::PathBuf::from));
        let Some(path) = path else { return Ok(None) };
        let bad = |why: String| crate::client::CliError::Usage {
            code: crate::client::codes::INVALID_CACERT,
            message: format!("--cacert {}: {why}", path.display()),
        };
        let pem = std::fs::read(&path).map_err(|e| bad(e.to_string()))?;
        reqwest::Certificate::from_pem(&pem).map(Some).map_err(|e| bad(e.to_string()))
    }
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create a counter, or update its spec (PUT /v1/counters/NAME).
    Create(CreateArgs),
    /// Read a counter's value (GET /v1/counters/NAME/value), or one of its sliding
    /// windows with --window (GET /v1/counters/NAME/value?window=W).
    Get {
        /// The counter.
        name: String,
        /// Sum every shard now instead of reading the cached rollup.
        #[arg(long, conflicts_with = "window")]
        fresh: bool,
        /// One of the counter's windows (`1m`, `1h`, `24h`, …): its sliding total,
        /// summed fresh from every shard's buckets.
        #[arg(long)]
        window: Option<String>,
    },
    /// Show a counter's spec and summary (GET /v1/counters/NAME).
    Info {
        /// The counter.
        name: String,
    },
    /// Delete a counter (DELETE /v1/counters/NAME).
    Delete {
        /// The counter.
        name: String,
    },
    /// Add to a counter (POST /v1/counters/NAME/increments).
    Incr(IncrArgs),
    /// Estimate a counter's distinct members (GET /v1/counters/NAME/distinct), or
    /// those of one of its windows with --window.
    Distinct {
        /// The counter.
        name: String,
        /// One of the counter's windows: the members of its sliding span.
        #[arg(long)]
        window: Option<String>,
    },
    /// Estimate an item's frequency (GET /v1/counters/NAME/frequency?item=ITEM).
    Frequency {
        /// The counter (created with --epsilon and --delta).
        name: String,
        /// The item.
        item: String,
    },
    /// List a counter's heaviest items (GET /v1/counters/NAME/top?k=K).
    TopItems {
        /// The counter (created with --epsilon and --delta).
        name: String,
        /// How many items.
        #[arg(short, long, default_value_t = 10)]
        k: u32,
    },
    /// Show a counter's shards and write skew (GET /v1/counters/NAME/shards).
    Shards {
        /// The counter.
        name: String,
    },
    /// List counter names in byte order, paging through GET /v1/counters.
    Ls {
        /// Only names starting with this.
        #[arg(long, value_name = "P")]
        prefix: Option<String>,
        /// Most names to print.
        #[arg(long, value_name = "N", default_value_t = crate::ops::LS_LIMIT_DEFAULT,
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        limit: usize,
    },
    /// A live view of the busiest counters through the node (GET /v1/stats each
    /// second): write rate, value, skew, staleness, drift. Ctrl-C ends it.
    Top {
        /// Counters to show.
        #[arg(long, value_name = "N", default_value_t = crate::ops::TOP_COUNTERS_DEFAULT,
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=crate::ops::TOP_COUNTERS_MAX as u64))]
        count: usize,
        /// Stop after this many screens (default: run until interrupted).
        #[arg(long, value_name = "N")]
        iterations: Option<u64>,
    },
    /// Show the cluster's nodes, leader and term (GET /v1/cluster), or change which
    /// nodes hold shards.
    Cluster {
        /// `add NODE` or `remove NODE`; without one, show the cluster.
        #[command(subcommand)]
        change: Option<MembershipChange>,
    },
    /// Correct a counter's drift against its true total (POST /v1/counters/NAME/reconcile).
    Reconcile {
        /// The counter.
        name: String,
        /// The counter's true total.
        #[arg(long, value_name = "N", allow_negative_numbers = true)]
        authoritative: i128,
    },
    /// Drive concurrent writers at a counter for a while and report rate and latency.
    Load(LoadArgs),
    /// Make client tokens (talks to no node).
    Token {
        /// What to do.
        #[command(subcommand)]
        action: TokenAction,
    },
}

/// `tally token ...`.
#[derive(Debug, Clone, PartialEq, Eq, Subcommand)]
pub enum TokenAction {
    /// Print a new random token and the `[[tokens]]` entry (with its hash, never the
    /// token) to add to the config of every node that should accept it.
    New {
        /// The token's name: what logs and the audit trail show.
        #[arg(long, value_name = "NAME")]
        name: String,
        /// What it may do: read, write, admin (admin implies the others).
        #[arg(long, value_name = "SCOPE,...", value_delimiter = ',', num_args = 1.., required = true)]
        scopes: Vec<ScopeArg>,
        /// Limit it to counters whose names start with this (repeatable).
        #[arg(long = "prefix", value_name = "PREFIX")]
        prefixes: Vec<String>,
    },
}

/// A token scope on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScopeArg {
    /// Read values, specs, listings, the cluster view.
    Read,
    /// Increment counters.
    Write,
    /// Change specs, delete, reconcile, change the cluster.
    Admin,
}

impl ScopeArg {
    /// The scope it names.
    pub fn scope(self) -> tally_auth::Scope {
        match self {
            Self::Read => tally_auth::Scope::Read,
            Self::Write => tally_auth::Scope::Write,
            Self::Admin => tally_auth::Scope::Admin,
        }
    }
}

/// When an increment is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DurabilityArg {
    /// After the shard's write is durable on disk.
    Sync,
    /// When buffered; flushed within flush_ms.
    Batched,
}

impl DurabilityArg {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sync => "sync",
            Self::Batched => "batched",
        }
    }
}

/// How increments without an event id pick their shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RouterArg {
    /// By hash of the event id.
    Event,
    /// By hash of the writer id.
    Writer,
    /// Each increment to the next shard.
    #[value(name = "round_robin")]
    RoundRobin,
    /// A random shard.
    Random,
}

impl RouterArg {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Event => "event",
            Self::Writer => "writer",
            Self::RoundRobin => "round_robin",
            Self::Random => "random",
        }
    }
}

/// `tally create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// The counter.
    pub name: String,
    /// Number of shards (1-1024), or `auto`: the count follows contention between
    /// --min-shards and --max-shards.
    #[arg(long, value_name = "N|auto")]
    pub shards: Option<crate::wire::Shards>,
    /// Fewest shards of an auto counter (where a new one starts).
    #[arg(long, value_name = "N")]
    pub min_shards: Option<u64>,
    /// Most shards of an auto counter.
    #[arg(long, value_name = "N")]
    pub max_shards: Option<u64>,
    /// When increments are acknowledged.
    #[arg(long)]
    pub durability: Option<DurabilityArg>,
    /// Aggregation window of a batched counter, in milliseconds.
    #[arg(long, value_name = "N")]
    pub flush_ms: Option<u64>,
    /// Refresh interval of the cached total, in milliseconds (0 = no rollup).
    #[arg(long, value_name = "N")]
    pub rollup_ms: Option<u64>,
    /// Routing of increments without an event id.
    #[arg(long)]
    pub router: Option<RouterArg>,
    /// Keep a distinct-member sketch.
    #[arg(long, conflicts_with = "no_distinct")]
    pub distinct: bool,
    /// Stop keeping a distinct-member sketch.
    #[arg(long)]
    pub no_distinct: bool,
    /// How long event ids are remembered, in seconds.
    #[arg(long, value_name = "N")]
    pub dedup_window_s: Option<u64>,
    /// Keep per-item frequencies: estimates within EPSILON × total weight...
    #[arg(long, value_name = "EPSILON", requires = "delta")]
    pub epsilon: Option<f64>,
    /// ...with probability 1 − DELTA.
    #[arg(long, value_name = "DELTA", requires = "epsilon")]
    pub delta: Option<f64>,
    /// Sliding windows to keep (at most 4, each 1m to 30d), comma-separated:
    /// `--windows 1m,1h,24h`; `--windows ""` keeps none.
    #[arg(long, value_name = "W,W", value_delimiter = ',')]
    pub windows: Option<Vec<String>>,
    /// The lowest value the counter may take (on create, with `--durability sync`): an
    /// increment that would go lower is refused.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub min: Option<i64>,
    /// The highest value the counter may take (on create, with `--durability sync`).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub max: Option<i64>,
    /// A rate limit: at most MAX in any span of WINDOW, one of `--windows` (on
    /// create, with `--durability sync`): `--limit 100/1m`.
    #[arg(long, value_name = "MAX/WINDOW")]
    pub limit: Option<crate::wire::Limit>,
    /// How many nodes keep a copy of each shard, 1-5 (on create; without it, the
    /// cluster's `replicas`).
    #[arg(long, value_name = "N")]
    pub replicas: Option<u64>,
}

/// `tally incr`.
#[derive(Debug, Args)]
pub struct IncrArgs {
    /// The counter.
    pub name: String,
    /// The amount to add: a non-zero integer, negative to subtract.
    #[arg(long, value_name = "N", default_value_t = 1, allow_negative_numbers = true)]
    pub by: i64,
    /// Idempotency key: a retry with the same id is never counted twice.
    #[arg(long, value_name = "ID")]
    pub event_id: Option<String>,
    /// Writer id, for writer-affinity routing (and the owner of --seq).
    #[arg(long, value_name = "W")]
    pub writer: Option<String>,
    /// The writer's sequence number: idempotent by sequence instead of event id
    /// (needs --writer).
    #[arg(long, value_name = "N", requires = "writer", conflicts_with = "event_id")]
    pub seq: Option<u64>,
    /// Member to count distinctly.
    #[arg(long, value_name = "M")]
    pub member: Option<String>,
    /// Item whose frequency the amount adds to.
    #[arg(long, value_name = "I")]
    pub item: Option<String>,
}

/// `tally load`.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// The counter.
    pub name: String,
    /// Concurrent writers, each with its own keep-alive connection.
    #[arg(
        long,
        value_name = "N",
        default_value_t = WRITERS_DEFAULT,
        value_parser = clap::value_parser!(u32).range(1..=WRITERS_MAX as i64),
    )]
    pub writers: u32,
    /// How long to write, e.g. `10s`, `500ms`, `2m`.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_load_duration)]
    pub duration: Duration,
    /// Increments per request: 1 posts single increments, more posts batches to /v1/increments.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1,
        value_parser = clap::value_parser!(u32).range(1..=BATCH_MAX as i64),
    )]
    pub batch: u32,
    /// Give every increment a unique event id.
    #[arg(long)]
    pub event_ids: bool,
    /// Give every increment its writer's next sequence number instead (a new writer
    /// id per writer and run; a failed request is resent with the same sequences).
    #[arg(long, conflicts_with = "event_ids")]
    pub seq: bool,
    /// Spread the writers round-robin over these nodes (default: --node).
    #[arg(long, value_name = "URL,URL,...", value_delimiter = ',', num_args = 1..)]
    pub nodes: Vec<String>,
    /// Create (or update) the counter first with this many shards.
    #[arg(long, value_name = "N")]
    pub create_shards: Option<u64>,
    /// Create (or update) the counter first with this durability.
    #[arg(long)]
    pub durability: Option<DurabilityArg>,
    /// Create (or update) the counter first with this flush window, in milliseconds.
    #[arg(long, value_name = "N")]
    pub flush_ms: Option<u64>,
    /// After the run, check with a fresh read that the counter grew by exactly the
    /// acknowledged increments.
    #[arg(long)]
    pub verify: bool,
    /// Do not draw the progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

/// Parses a duration: a number with a unit `ms`, `s`, `m` or `h` (a bare number is
/// seconds), e.g. `10s`, `250ms`, `1.5m`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration: use a number with ms, s, m or h (e.g. 10s)"))?;
    let seconds_per_unit = match unit.trim() {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        other => return Err(format!("unknown duration unit {other:?}: use ms, s, m or h")),
    };
    Duration::try_from_secs_f64(number * seconds_per_unit).map_err(|e| format!("{text:?}: {e}"))
}

/// [`parse_duration`], bounded to a positive duration of at most [`LOAD_DURATION_MAX`].
fn parse_load_duration(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    if d.is_zero() {
        return Err("the duration must be positive".into());
    }
    if d > LOAD_DURATION_MAX {
        return Err(format!("the duration may be at most {} s", LOAD_DURATION_MAX.as_secs()));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn membership_changes_keep_the_global_node_url() {
        let cli =
            Cli::try_parse_from(["tally", "--node", "http://h:1", "cluster", "remove", "node2"]).unwrap();
        assert_eq!(cli.node.as_deref(), Some("http://h:1"));
        assert!(matches!(cli.command, Command::Cluster { change: Some(MembershipChange::Remove { ref id }) }
            if id == "node2"));
        let cli = Cli::try_parse_from(["tally", "cluster"]).unwrap();
        assert!(matches!(cli.command, Command::Cluster { change: None }));
    }

    #[test]
    fn token_flags_parse() {
        let cli = Cli::try_parse_from([
            "tally",
            "token",
            "new",
            "--name",
            "ingest",
            "--scopes",
            "write,read",
            "--prefix",
            "likes:",
            "--prefix",
            "views:",
        ])
        .expect("parses");
        let Command::Token { action: TokenAction::New { name, scopes, prefixes } } = cli.command else {
            panic!("not token new")
        };
        assert_eq!(name, "ingest");
        assert_eq!(scopes, vec![ScopeArg::Write, ScopeArg::Read]);
        assert_eq!(prefixes, vec!["likes:".to_string(), "views:".to_string()]);
        assert!(
            Cli::try_parse_from(["tally", "token", "new", "--name", "x"]).is_err(),
            "scopes are required"
        );
        assert!(Cli::try_parse_from(["tally", "token", "new", "--name", "x", "--scopes", "root"]).is_err());
        let cli = Cli::try_parse_from(["tally", "--token", "tly_abc", "get", "x"]).expect("parses");
        assert_eq!(cli.token_arg().as_deref(), Some("tly_abc"));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5m"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("-1s").is_err());
        assert!(parse_load_duration("0s").is_err());
        assert!(parse_load_duration("2h").is_err());
    }

    #[test]
    fn load_flags_parse() {
        let cli = Cli::try_parse_from([
            "tally",
            "load",
            "likes",
            "--writers",
            "8",
            "--duration",
            "2s",
            "--batch",
            "100",
            "--nodes",
            "http://127.0.0.1:1,http://127.0.0.1:2",
            "--json",
        ])
        .expect("parses");
        assert!(cli.json);
        let Command::Load(args) = cli.command else { panic!("not load") };
        assert_eq!((args.writers, args.batch, args.duration), (8, 100, Duration::from_secs(2)));
        assert_eq!(args.nodes.len(), 2);
        assert!(Cli::try_parse_from(["tally", "load", "x", "--writers", "0"]).is_err());
        assert!(Cli::try_parse_from(["tally", "load", "x", "--batch", "10001"]).is_err());
    }

    #[test]
    fn negative_amounts_parse() {
        let cli = Cli::try_parse_from(["tally", "incr", "x", "--by", "-3"]).expect("parses");
        let Command::Incr(args) = cli.command else { panic!("not incr") };
        assert_eq!(args.by, -3);
        let cli = Cli::try_parse_from(["tally", "reconcile", "x", "--authoritative", "-5"]).expect("parses");
        assert!(matches!(cli.command, Command::Reconcile { authoritative: -5, .. }));
    }
}
