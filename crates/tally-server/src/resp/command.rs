//! Commands: the table every command is checked against (name, arity, flags, the
//! documentation `COMMAND DOCS` serves to `redis-cli` for its hints), and parsing
//! a request's arguments into a [`Command`]. Pure: no I/O, so every parsing rule
//! is unit-tested here.
//!
//! Errors use Redis's texts where Redis has one (`ERR unknown command ...`,
//! `ERR wrong number of arguments for 'incr' command`, `ERR syntax error`); errors
//! about values carry the public snake_case codes (`ERR invalid_delta ...`).

use super::wire::{quote, Reply};
use crate::http::body::{ShardsField, SpecBody};
use crate::http::error::codes;
use tally_core::expiry::{Condition, When};
use tally_engine::{Consistency, Increment};

/// How a documented argument is typed (the `type` field of `COMMAND DOCS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgKind {
    /// A counter name.
    Key,
    /// A signed integer.
    Integer,
    /// Any string.
    Str,
    /// A keyword alone (`FRESH`).
    Token,
}

impl ArgKind {
    fn name(self) -> &'static str {
        match self {
            ArgKind::Key => "key",
            ArgKind::Integer => "integer",
            ArgKind::Str => "string",
            ArgKind::Token => "pure-token",
        }
    }
}

/// One documented argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArgDoc {
    /// Its name (for a token, the token itself).
    pub name: &'static str,
    /// Its type.
    pub kind: ArgKind,
    /// The keyword before it (`ID` before an event id), if any.
    pub token: Option<&'static str>,
    /// Whether it may be left out.
    pub optional: bool,
    /// Whether it may repeat.
    pub multiple: bool,
}

const fn arg(name: &'static str, kind: ArgKind) -> ArgDoc {
    ArgDoc { name, kind, token: None, optional: false, multiple: false }
}
const fn many(name: &'static str, kind: ArgKind) -> ArgDoc {
    ArgDoc { name, kind, token: None, optional: false, multiple: true }
}
const fn opt(name: &'static str, kind: ArgKind) -> ArgDoc {
    ArgDoc { name, kind, token: None, optional: true, multiple: false }
}
const fn opt_tok(token: &'static str, name: &'static str, kind: ArgKind) -> ArgDoc {
    ArgDoc { name, kind, token: Some(token), optional: true, multiple: false }
}

/// One command of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommandSpec {
    /// Its name, lowercase (as `COMMAND` lists it).
    pub name: &'static str,
    /// Redis's arity: `n` exactly n arguments counting the name, `-n` at least n.
    pub arity: i64,
    /// Redis's command flags (`write`, `readonly`, `fast`, ...).
    pub flags: &'static [&'static str],
    /// Position of the first key, 0 if none.
    pub first_key: i64,
    /// Position of the last key (-1: the last argument).
    pub last_key: i64,
    /// Step between keys.
    pub step: i64,
    /// One line for `COMMAND DOCS` and `redis-cli`'s help.
    pub summary: &'static str,
    /// Redis's command group.
    pub group: &'static str,
    /// Its arguments after the name.
    pub args: &'static [ArgDoc],
}

use ArgKind::{Integer, Key, Str, Token};

const W: &[&str] = &["write", "denyoom", "fast"];
const R: &[&str] = &["readonly", "fast"];
const C: &[&str] = &["fast", "stale", "loading"];

const fn cmd(
    name: &'static str,
    arity: i64,
    flags: &'static [&'static str],
    keys: (i64, i64, i64),
    group: &'static str,
    summary: &'static str,
    args: &'static [ArgDoc],
) -> CommandSpec {
    CommandSpec {
        name,
        arity,
        flags,
        first_key: keys.0,
        last_key: keys.1,
        step: keys.2,
        summary,
        group,
        args,
    }
}

/// Every command this front end serves.
pub const COMMANDS: &[CommandSpec] = &[
    cmd("ping", -1, C, (0, 0, 0), "connection", "Answers PONG, or the message.", &[opt("message", Str)]),
    cmd("echo", 2, C, (0, 0, 0), "connection", "Answers the message.", &[arg("message", Str)]),
    cmd(
        "hello",
        -1,
        C,
        (0, 0, 0),
        "connection",
        "Chooses the protocol (2 or 3) and answers what the server is.",
        &[
            opt("protover", Integer),
            opt_tok("AUTH", "username password", Str),
            opt_tok("SETNAME", "clientname", Str),
        ],
    ),
    cmd(
        "auth",
        -2,
        C,
        (0, 0, 0),
        "connection",
        "Authenticates the connection (no password is configured yet).",
        &[opt("username", Str), arg("password", Str)],
    ),
    cmd(
        "select",
        2,
        C,
        (0, 0, 0),
        "connection",
        "Selects database 0, the only one.",
        &[arg("index", Integer)],
    ),
    cmd(
        "client",
        -2,
        C,
        (0, 0, 0),
        "connection",
        "CLIENT SETNAME name | GETNAME | SETINFO attr value | ID | INFO | LIST | KILL filter.",
        &[arg("subcommand", Str), opt("arguments", Str)],
    ),
    cmd(
        "command",
        -1,
        &["loading", "stale"],
        (0, 0, 0),
        "server",
        "Lists the commands: COMMAND, COMMAND COUNT, COMMAND DOCS [name ...], COMMAND INFO [name ...].",
        &[opt("subcommand", Str)],
    ),
    cmd(
        "info",
        -1,
        &["loading", "stale"],
        (0, 0, 0),
        "server",
        "Server, clients and keyspace figures.",
        &[opt("section", Str)],
    ),
    cmd("quit", -1, C, (0, 0, 0), "connection", "Closes the connection.", &[]),
    cmd(
        "multi",
        1,
        &["noscript", "loading", "stale", "fast", "allow_busy"],
        (0, 0, 0),
        "transactions",
        "Starts a transaction: the commands that follow are queued until EXEC.",
        &[],
    ),
    cmd(
        "exec",
        1,
        &["noscript", "loading", "stale", "skip_slowlog"],
        (0, 0, 0),
        "transactions",
        "Runs the queued commands in order and answers each one's reply (EXECABORT if one was refused while queued).",
        &[],
    ),
    cmd(
        "discard",
        1,
        &["noscript", "loading", "stale", "fast", "allow_busy"],
        (0, 0, 0),
        "transactions",
        "Drops the queued commands.",
        &[],
    ),
    cmd(
        "watch",
        -2,
        &["noscript", "loading", "stale", "fast", "allow_busy"],
        (1, -1, 1),
        "transactions",
        "Not supported: answers an error (counters change without a lock; use event ids for safe retries).",
        &[many("key", Key)],
    ),
    cmd(
        "unwatch",
        1,
        &["noscript", "loading", "stale", "fast", "allow_busy"],
        (0, 0, 0),
        "transactions",
        "Answers OK: nothing is ever watched.",
        &[],
    ),
    cmd(
        "incr",
        2,
        W,
        (1, 1, 1),
        "string",
        "Adds 1 to the counter, creating it with the defaults.",
        &[arg("key", Key)],
    ),
    cmd(
        "incrby",
        3,
        W,
        (1, 1, 1),
        "string",
        "Adds increment to the counter, creating it with the defaults.",
        &[arg("key", Key), arg("increment", Integer)],
    ),
    cmd(
        "decr",
        2,
        W,
        (1, 1, 1),
        "string",
        "Subtracts 1 from the counter, creating it with the defaults.",
        &[arg("key", Key)],
    ),
    cmd(
        "decrby",
        3,
        W,
        (1, 1, 1),
        "string",
        "Subtracts decrement from the counter, creating it with the defaults.",
        &[arg("key", Key), arg("decrement", Integer)],
    ),
    cmd(
        "increx",
        -2,
        &["write", "denyoom", "fast"],
        (1, 1, 1),
        "string",
        "Adds increment (BYINT, 1 by default) if the result stays within LBOUND..UBOUND (else adds nothing, or with SATURATE \
         what reaches the bound) and sets the deadline (EX, PX, EXAT, PXAT, PERSIST; ENX only if it has none); answers \
         [new value, applied increment]. BYFLOAT is refused: counters hold integers.",
        &[
            arg("key", Key),
            opt_tok("BYINT", "increment", Integer),
            opt_tok("LBOUND", "lowerbound", Integer),
            opt_tok("UBOUND", "upperbound", Integer),
            opt("SATURATE", Token),
            opt("EX seconds|PX milliseconds|EXAT unix-time-seconds|PXAT unix-time-milliseconds|PERSIST", Str),
            opt("ENX", Token),
        ],
    ),
    cmd(
        "get",
        2,
        R,
        (1, 1, 1),
        "string",
        "The counter's cached total (fresh without a rollup); nil if unknown.",
        &[arg("key", Key)],
    ),
    cmd("mget", -2, R, (1, -1, 1), "string", "The cached totals of several counters.", &[many("key", Key)]),
    cmd("exists", -2, R, (1, -1, 1), "keyspace", "How many of the counters exist.", &[many("key", Key)]),
    cmd(
        "del",
        -2,
        &["write"],
        (1, -1, 1),
        "keyspace",
        "Deletes counters; answers how many existed.",
        &[many("key", Key)],
    ),
    cmd(
        "expire",
        -3,
        &["write", "fast"],
        (1, 1, 1),
        "generic",
        "Sets the counter's time to live in seconds (NX, XX, GT, LT as Redis); 1 if set.",
        &[arg("key", Key), arg("seconds", Integer), opt("NX|XX|GT|LT", Token)],
    ),
    cmd(
        "pexpire",
        -3,
        &["write", "fast"],
        (1, 1, 1),
        "generic",
        "Sets the counter's time to live in milliseconds; 1 if set.",
        &[arg("key", Key), arg("milliseconds", Integer), opt("NX|XX|GT|LT", Token)],
    ),
    cmd(
        "expireat",
        -3,
        &["write", "fast"],
        (1, 1, 1),
        "generic",
        "Sets the counter's deadline as a Unix time in seconds; 1 if set.",
        &[arg("key", Key), arg("unix-time-seconds", Integer), opt("NX|XX|GT|LT", Token)],
    ),
    cmd(
        "pexpireat",
        -3,
        &["write", "fast"],
        (1, 1, 1),
        "generic",
        "Sets the counter's deadline as a Unix time in milliseconds; 1 if set.",
        &[arg("key", Key), arg("unix-time-milliseconds", Integer), opt("NX|XX|GT|LT", Token)],
    ),
    cmd(
        "ttl",
        2,
        R,
        (1, 1, 1),
        "generic",
        "Seconds the counter has left: -1 without a deadline, -2 if it does not exist.",
        &[arg("key", Key)],
    ),
    cmd(
        "pttl",
        2,
        R,
        (1, 1, 1),
        "generic",
        "Milliseconds the counter has left: -1 without a deadline, -2 if it does not exist.",
        &[arg("key", Key)],
    ),
    cmd(
        "expiretime",
        2,
        R,
        (1, 1, 1),
        "generic",
        "The counter's deadline as a Unix time in seconds: -1 without one, -2 if it does not exist.",
        &[arg("key", Key)],
    ),
    cmd(
        "pexpiretime",
        2,
        R,
        (1, 1, 1),
        "generic",
        "The counter's deadline as a Unix time in milliseconds: -1 without one, -2 if it does not exist.",
        &[arg("key", Key)],
    ),
    cmd(
        "persist",
        2,
        &["write", "fast"],
        (1, 1, 1),
        "generic",
        "Removes the counter's deadline; 1 if it had one.",
        &[arg("key", Key)],
    ),
    cmd(
        "set",
        -3,
        &["write", "denyoom"],
        (1, 1, 1),
        "string",
        "Sets the counter's total (an integer) as one correction; NX, XX, GET, EX, PX, EXAT, PXAT, KEEPTTL as Redis.",
        &[
            arg("key", Key),
            arg("value", Integer),
            opt("NX|XX", Token),
            opt("GET", Token),
            opt("EX seconds|PX milliseconds|EXAT unix-time-seconds|PXAT unix-time-milliseconds|KEEPTTL", Str),
        ],
    ),
    cmd(
        "getset",
        3,
        &["write", "denyoom", "fast"],
        (1, 1, 1),
        "string",
        "Sets the counter's total and answers the total before (nil if it did not exist).",
        &[arg("key", Key), arg("value", Integer)],
    ),
    cmd(
        "getdel",
        2,
        &["write", "fast"],
        (1, 1, 1),
        "string",
        "Answers the counter's total and deletes it (nil if it did not exist).",
        &[arg("key", Key)],
    ),
    cmd(
        "getex",
        -2,
        &["write", "fast"],
        (1, 1, 1),
        "string",
        "Answers the counter's total and sets (EX, PX, EXAT, PXAT) or removes (PERSIST) its deadline.",
        &[arg("key", Key), opt("EX seconds|PX milliseconds|EXAT unix-time-seconds|PXAT unix-time-milliseconds|PERSIST", Str)],
    ),
    cmd(
        "scan",
        -2,
        &["readonly"],
        (0, 0, 0),
        "generic",
        "Pages through counter names: SCAN cursor [MATCH pattern] [COUNT count] [TYPE type]; the cursor is 0 again once done.",
        &[arg("cursor", Integer), opt_tok("MATCH", "pattern", Str), opt_tok("COUNT", "count", Integer), opt_tok("TYPE", "type", Str)],
    ),
    cmd(
        "keys",
        2,
        &["readonly"],
        (0, 0, 0),
        "generic",
        "Every counter name that matches the pattern (use SCAN on large keyspaces).",
        &[arg("pattern", Str)],
    ),
    cmd("type", 2, R, (1, 1, 1), "generic", "string for a counter, none otherwise.", &[arg("key", Key)]),
    cmd("dbsize", 1, R, (0, 0, 0), "server", "How many counters exist.", &[]),
    cmd(
        "config",
        -2,
        &["admin", "noscript", "loading", "stale"],
        (0, 0, 0),
        "server",
        "CONFIG GET parameter ...: the node's settings in Redis's names (CONFIG SET is refused: settings come from the node's config file).",
        &[arg("subcommand", Str), opt("parameter", Str)],
    ),
    cmd(
        "wait",
        3,
        &["noscript"],
        (0, 0, 0),
        "generic",
        "Waits until this connection's increments are on their shards' other copies; answers how many other copies hold them.",
        &[arg("numreplicas", Integer), arg("timeout", Integer)],
    ),
    cmd(
        "pfadd",
        -2,
        W,
        (1, 1, 1),
        "hyperloglog",
        "Counts each member once more (one increment of 1 carrying it) on a distinct counter.",
        &[
            arg("key", Key),
            ArgDoc { name: "element", kind: Str, token: None, optional: true, multiple: true },
        ],
    ),
    cmd(
        "pfcount",
        -2,
        R,
        (1, -1, 1),
        "hyperloglog",
        "The distinct-member estimate of the union of the counters' members.",
        &[many("key", Key)],
    ),
    cmd(
        "pfmerge",
        -2,
        &["write", "denyoom"],
        (1, -1, 1),
        "hyperloglog",
        "Merges the sources' distinct members into the destination counter (created with distinct if unknown).",
        &[arg("destkey", Key), ArgDoc { name: "sourcekey", kind: Key, token: None, optional: true, multiple: true }],
    ),
    cmd(
        "cms.query",
        -3,
        R,
        (1, 1, 1),
        "cms",
        "The count-min estimate of each item's weight on a frequency counter (RedisBloom's shape).",
        &[arg("key", Key), ArgDoc { name: "item", kind: Str, token: None, optional: false, multiple: true }],
    ),
    cmd(
        "cms.initbydim",
        4,
        W,
        (1, 1, 1),
        "cms",
        "Creates a frequency counter whose count-min sketch has at least this width and depth (RedisBloom's shape).",
        &[arg("key", Key), arg("width", Integer), arg("depth", Integer)],
    ),
    cmd(
        "cms.initbyprob",
        4,
        W,
        (1, 1, 1),
        "cms",
        "Creates a frequency counter with this error (epsilon) and probability (delta) (RedisBloom's shape).",
        &[arg("key", Key), arg("error", Str), arg("probability", Str)],
    ),
    cmd(
        "cms.incrby",
        -4,
        W,
        (1, 1, 1),
        "cms",
        "Adds each increment to its item's weight; answers each item's estimate after it.",
        &[arg("key", Key), ArgDoc { name: "item increment", kind: Str, token: None, optional: false, multiple: true }],
    ),
    cmd(
        "cms.info",
        2,
        R,
        (1, 1, 1),
        "cms",
        "The sketch's width, depth and total weight.",
        &[arg("key", Key)],
    ),
    cmd(
        "cms.merge",
        -4,
        &["write", "denyoom"],
        (1, 1, 1),
        "cms",
        "Replaces the destination's frequencies with the (weighted) sum of the sources' (same shape).",
        &[
            arg("destination", Key),
            arg("numKeys", Integer),
            ArgDoc { name: "source", kind: Key, token: None, optional: false, multiple: true },
            opt_tok("WEIGHTS", "weight ...", Integer),
        ],
    ),
    cmd(
        "topk.reserve",
        -3,
        W,
        (1, 1, 1),
        "topk",
        "Creates a frequency counter whose top list keeps at least topk items (RedisBloom's shape; width, depth and decay are accepted and not used).",
        &[arg("key", Key), arg("topk", Integer), opt("width depth decay", Str)],
    ),
    cmd(
        "topk.add",
        -3,
        W,
        (1, 1, 1),
        "topk",
        "Adds 1 to each item's weight; answers nil for each (Tally expels no item one add at a time).",
        &[arg("key", Key), ArgDoc { name: "item", kind: Str, token: None, optional: false, multiple: true }],
    ),
    cmd(
        "topk.incrby",
        -4,
        W,
        (1, 1, 1),
        "topk",
        "Adds each increment to its item's weight; answers nil for each.",
        &[arg("key", Key), ArgDoc { name: "item increment", kind: Str, token: None, optional: false, multiple: true }],
    ),
    cmd(
        "topk.query",
        -3,
        R,
        (1, 1, 1),
        "topk",
        "1 for each item among the k heaviest, 0 otherwise.",
        &[arg("key", Key), ArgDoc { name: "item", kind: Str, token: None, optional: false, multiple: true }],
    ),
    cmd(
        "topk.count",
        -3,
        R,
        (1, 1, 1),
        "topk",
        "Each item's estimated weight.",
        &[arg("key", Key), ArgDoc { name: "item", kind: Str, token: None, optional: false, multiple: true }],
    ),
    cmd(
        "topk.info",
        2,
        R,
        (1, 1, 1),
        "topk",
        "k, width, depth and decay of the counter's top list.",
        &[arg("key", Key)],
    ),
    cmd(
        "topk.list",
        -2,
        R,
        (1, 1, 1),
        "topk",
        "The heaviest items of a frequency counter, heaviest first; WITHCOUNT adds each estimate.",
        &[
            arg("key", Key),
            ArgDoc {
                name: "withcount",
                kind: Str,
                token: Some("WITHCOUNT"),
                optional: true,
                multiple: false,
            },
            opt_tok("K", "k", Integer),
        ],
    ),
    cmd(
        "tally.incrby",
        -3,
        W,
        (1, 1, 1),
        "tally",
        "An increment with an event id (or a writer and its sequence), writer and member; answers applied or duplicate (WITHVALUE: with the total after it and whether that is exact).",
        &[
            arg("key", Key),
            arg("delta", Integer),
            opt_tok("ID", "event_id", Str),
            opt_tok("WRITER", "writer", Str),
            opt_tok("SEQ", "seq", Integer),
            opt_tok("MEMBER", "member", Str),
            opt_tok("ITEM", "item", Str),
            ArgDoc { name: "withvalue", kind: Token, token: Some("WITHVALUE"), optional: true, multiple: false },
        ],
    ),
    cmd(
        "tally.get",
        -2,
        R,
        (1, 1, 1),
        "tally",
        "The total with as_of, staleness, completeness and missing shards.",
        &[arg("key", Key), opt("FRESH|CACHED", Token)],
    ),
    cmd(
        "tally.window",
        3,
        R,
        (1, 1, 1),
        "tally",
        "One of the counter's sliding windows: its total, and its distinct estimate with distinct, with the bucket granularity.",
        &[arg("key", Key), arg("window", Str)],
    ),
    cmd(
        "tally.create",
        -2,
        &["write"],
        (1, 1, 1),
        "tally",
        "Creates or updates a counter's spec.",
        &[
            arg("key", Key),
            opt_tok("SHARDS", "shards|auto", Str),
            opt_tok("MIN", "min_shards", Integer),
            opt_tok("MAX", "max_shards", Integer),
            opt_tok("DURABILITY", "sync|batched", Str),
            opt_tok("FLUSH_MS", "flush_ms", Integer),
            opt_tok("ROLLUP_MS", "rollup_ms", Integer),
            opt_tok("ROUTER", "event|writer|round_robin|random", Str),
            opt_tok("DISTINCT", "true|false", Str),
            opt_tok("DEDUP_WINDOW_S", "dedup_window_s", Integer),
            opt_tok("FREQUENCY", "epsilon delta", Str),
            opt_tok("WINDOWS", "1m,1h,24h", Str),
            opt_tok("FLOOR", "min", Integer),
            opt_tok("CEILING", "max", Integer),
            opt_tok("LIMIT", "max window", Str),
            opt_tok("REPLICAS", "replicas", Integer),
            opt_tok("TTL_MS", "ttl_ms", Integer),
        ],
    ),
    cmd(
        "tally.namespace",
        -2,
        &["write"],
        (0, 0, 0),
        "tally",
        "Namespaces: SET prefix [FIELD value ...] declares the spec counters created implicitly under the prefix take (TALLY.CREATE's fields and TTL_MS); GET, DEL, LIST.",
        &[arg("subcommand", Str), opt("prefix", Str), opt("field value", Str)],
    ),
    cmd(
        "tally.shards",
        2,
        R,
        (1, 1, 1),
        "tally",
        "Per-shard values, owners and write skew.",
        &[arg("key", Key)],
    ),
    cmd(
        "tally.reconcile",
        3,
        &["write"],
        (1, 1, 1),
        "tally",
        "Brings the counter to an authoritative total with an idempotent correction.",
        &[arg("key", Key), arg("authoritative", Integer)],
    ),
];

/// The table entry of `name` (any case).
pub fn lookup(name: &[u8]) -> Option<&'static CommandSpec> {
    position(name).map(|i| &COMMANDS[i])
}

/// Where the command named `name` (any case) is in [`COMMANDS`].
fn position(name: &[u8]) -> Option<usize> {
    COMMANDS.iter().position(|c| c.name.as_bytes().eq_ignore_ascii_case(name))
}

/// A `COMMAND` subcommand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandQuery {
    /// `COMMAND`: every command's info.
    All,
    /// `COMMAND COUNT`.
    Count,
    /// `COMMAND DOCS [name ...]` (every command when none is named).
    Docs(Vec<String>),
    /// `COMMAND INFO [name ...]`.
    Info(Vec<String>),
}

/// A `TALLY.NAMESPACE` subcommand.
#[derive(Debug, Clone, PartialEq)]
pub enum NamespaceOp {
    /// `SET prefix [FIELD value ...]`: declare or replace it.
    Set {
        /// The name prefix.
        prefix: String,
        /// Its spec fields (boxed: the command stays small).
        spec: Box<SpecBody>,
    },
    /// `GET prefix`.
    Get(String),
    /// `DEL prefix`.
    Del(String),
    /// `LIST`.
    List,
}

/// `SCAN`'s arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanArgs {
    /// 0 to start, else a cursor an earlier page answered.
    pub cursor: u64,
    /// `MATCH`'s glob, if any.
    pub pattern: Option<Vec<u8>>,
    /// `COUNT`: names to look at (default [`SCAN_COUNT_DEFAULT`]).
    pub count: usize,
    /// `TYPE`: only counters of this Redis type (`string`: every counter).
    pub kind: Option<String>,
}

/// Names one `SCAN` looks at without `COUNT`, as Redis.
pub const SCAN_COUNT_DEFAULT: usize = 10;

/// Which connections `CLIENT KILL` closes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KillFilter {
    /// `CLIENT KILL ip:port` (the old form, answered OK or an error).
    pub old_form: bool,
    /// `ID id`.
    pub id: Option<u64>,
    /// `ADDR ip:port` (or the old form's address).
    pub addr: Option<String>,
    /// `SKIPME yes|no`: spare the calling connection (default yes).
    pub skip_me: bool,
}

/// What a `SET` (or `GETEX`) does to the counter's deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TtlChange {
    /// Removes it (`SET` without an option; `GETEX ... PERSIST`).
    Clear,
    /// Keeps it (`SET ... KEEPTTL`; `GETEX` without an option).
    Keep,
    /// Sets it (`EX`, `PX`, `EXAT`, `PXAT`).
    Set(When),
}

/// `SET`'s value and options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetArgs {
    /// The total to set.
    pub value: i128,
    /// `NX`: only if the counter does not exist.
    pub nx: bool,
    /// `XX`: only if it exists.
    pub xx: bool,
    /// `GET` (and `GETSET`): answer the total before.
    pub get: bool,
    /// Its deadline after.
    pub ttl: TtlChange,
}

/// `INCREX`'s arguments (Redis 8.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IncrExArgs {
    /// The increment asked for (`BYINT`, 1 without it).
    pub delta: i64,
    /// `LBOUND`, `UBOUND` and `SATURATE`.
    pub within: tally_core::within::Within,
    /// What becomes of the deadline when the increment is not skipped: kept
    /// without an option, cleared by `PERSIST`, set by `EX`/`PX`/`EXAT`/`PXAT`.
    pub ttl: TtlChange,
    /// `ENX`: set the deadline only if the counter has none.
    pub enx: bool,
}

/// How many items `TOPK.LIST` answers without `K`.
pub const TOPK_LIST_DEFAULT: u32 = 10;

/// Most bytes a [`Command`] takes: commands are moved from the parser to their run
/// several times per pipeline, so large fields (a `TALLY.INCRBY`'s increment, a
/// `TALLY.CREATE`'s spec, `HELLO`'s credentials) are boxed.
pub const COMMAND_BYTES_MAX: usize = 64;

/// A parsed command.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// `PING [message]`.
    Ping(Option<Vec<u8>>),
    /// `ECHO message`.
    Echo(Vec<u8>),
    /// `HELLO [protover [AUTH user pass] [SETNAME name]]`.
    Hello {
        /// 2 or 3 (checked when run: Redis answers NOPROTO for others).
        proto: Option<i64>,
        /// Credentials.
        auth: Option<Box<(Vec<u8>, Vec<u8>)>>,
        /// The connection's new name.
        setname: Option<Vec<u8>>,
    },
    /// `AUTH [username] password`.
    Auth {
        /// The user (`default` when left out).
        user: Option<Vec<u8>>,
        /// The password.
        password: Vec<u8>,
    },
    /// `SELECT index`.
    Select(i64),
    /// `CLIENT SETNAME name`.
    ClientSetName(Vec<u8>),
    /// `CLIENT GETNAME`.
    ClientGetName,
    /// `CLIENT SETINFO LIB-NAME|LIB-VER value`.
    ClientSetInfo {
        /// `lib-name` or `lib-ver`, lowercase.
        attr: String,
        /// Its value.
        value: Vec<u8>,
    },
    /// `CLIENT ID`.
    ClientId,
    /// `COMMAND ...`.
    Command(CommandQuery),
    /// `INFO [section]`.
    Info(Option<String>),
    /// `QUIT`.
    Quit,
    /// `MULTI`: start queueing.
    Multi,
    /// `EXEC`: run what was queued.
    Exec,
    /// `DISCARD`: drop what was queued.
    Discard,
    /// `WATCH key ...` (refused: not supported).
    Watch(Vec<String>),
    /// `UNWATCH`.
    Unwatch,
    /// `INCR`, `INCRBY`, `DECR`, `DECRBY`: one increment answering the new total.
    Incr {
        /// The counter.
        key: String,
        /// The signed amount.
        delta: i64,
    },
    /// `INCREX key [BYINT n] [LBOUND l] [UBOUND u] [SATURATE] [EX|PX|EXAT|PXAT t|PERSIST] [ENX]`.
    IncrEx {
        /// The counter.
        key: String,
        /// The rest.
        args: Box<IncrExArgs>,
    },
    /// `GET key`.
    Get(String),
    /// `MGET key ...`.
    MGet(Vec<String>),
    /// `EXISTS key ...`.
    Exists(Vec<String>),
    /// `DEL key ...`.
    Del(Vec<String>),
    /// `EXPIRE`, `PEXPIRE`, `EXPIREAT`, `PEXPIREAT key time [NX|XX|GT|LT]`.
    Expire {
        /// The counter.
        key: String,
        /// The time as written.
        when: When,
        /// The condition on the current deadline.
        cond: Condition,
        /// The command's name, lowercase, for Redis's error text.
        name: &'static str,
    },
    /// `TTL`, `PTTL`, `EXPIRETIME`, `PEXPIRETIME key`.
    Ttl {
        /// The counter.
        key: String,
        /// Milliseconds rather than seconds.
        millis: bool,
        /// The deadline itself rather than what is left of it.
        absolute: bool,
    },
    /// `PERSIST key`.
    Persist(String),
    /// `SET key value [NX|XX] [GET] [EX|PX|EXAT|PXAT time|KEEPTTL]`, and `GETSET`.
    Set {
        /// The counter.
        key: String,
        /// Its options (boxed: the command stays small).
        set: Box<SetArgs>,
    },
    /// `GETDEL key`.
    GetDel(String),
    /// `GETEX key [EX|PX|EXAT|PXAT time|PERSIST]`.
    GetEx {
        /// The counter.
        key: String,
        /// What becomes of its deadline.
        ttl: TtlChange,
    },
    /// `PFADD key member ...`.
    PfAdd {
        /// The counter.
        key: String,
        /// The members.
        members: Vec<String>,
    },
    /// `PFCOUNT key ...`: the estimate of the union of their members.
    PfCount(Vec<String>),
    /// `PFMERGE destkey sourcekey ...`.
    PfMerge {
        /// Where the members go.
        dest: String,
        /// Whose members.
        sources: Vec<String>,
    },
    /// `SCAN cursor [MATCH pattern] [COUNT count] [TYPE type]`.
    Scan(Box<ScanArgs>),
    /// `KEYS pattern`.
    Keys(Vec<u8>),
    /// `TYPE key`.
    Type(String),
    /// `DBSIZE`.
    DbSize,
    /// `CONFIG GET parameter ...` (lowercase patterns).
    ConfigGet(Vec<Vec<u8>>),
    /// `CONFIG SET`, `REWRITE`, `RESETSTAT`: answered with why not.
    ConfigOther(String),
    /// `WAIT numreplicas timeout`.
    Wait {
        /// Copies asked for (the answer says how many there are).
        replicas: i64,
        /// Milliseconds to wait at most; 0 for no bound but the command timeout.
        timeout_ms: i64,
    },
    /// `CMS.INITBYDIM` / `CMS.INITBYPROB`: a counter with this frequency shape.
    CmsInit {
        /// The counter.
        key: String,
        /// The shape.
        shape: tally_core::frequency::FrequencySpec,
    },
    /// `CMS.INCRBY key item increment ...`.
    CmsIncrBy {
        /// The counter.
        key: String,
        /// Each item and its increment.
        items: Vec<(String, i64)>,
    },
    /// `CMS.INFO key`.
    CmsInfo(String),
    /// `CMS.MERGE dest numkeys src ... [WEIGHTS w ...]`.
    CmsMerge {
        /// The destination.
        dest: String,
        /// Each source and its weight.
        sources: Vec<(String, u64)>,
    },
    /// `TOPK.RESERVE key topk [width depth decay]`.
    TopkReserve {
        /// The counter.
        key: String,
        /// How many items its list keeps.
        k: u32,
    },
    /// `TOPK.ADD key item ...` (each by 1) and `TOPK.INCRBY key item increment ...`.
    TopkIncrBy {
        /// The counter.
        key: String,
        /// Each item and its increment.
        items: Vec<(String, i64)>,
    },
    /// `TOPK.QUERY` (in the list?) and `TOPK.COUNT` (estimates) of items.
    TopkQuery {
        /// The counter.
        key: String,
        /// The items.
        items: Vec<String>,
        /// `TOPK.COUNT`: estimates rather than membership.
        count: bool,
    },
    /// `TOPK.INFO key`.
    TopkInfo(String),
    /// `CLIENT LIST`.
    ClientList,
    /// `CLIENT INFO`.
    ClientInfo,
    /// `CLIENT KILL ...`.
    ClientKill(Box<KillFilter>),
    /// `CMS.QUERY key item ...`.
    CmsQuery {
        /// The counter.
        key: String,
        /// The items whose weights are estimated.
        items: Vec<String>,
    },
    /// `TOPK.LIST key [WITHCOUNT] [K k]`.
    TopkList {
        /// The counter.
        key: String,
        /// Whether each item is followed by its estimate.
        with_count: bool,
        /// How many items (default: the k the list was reserved with, else
        /// [`TOPK_LIST_DEFAULT`]).
        k: Option<u32>,
    },
    /// `TALLY.INCRBY key delta [ID e] [WRITER w] [SEQ n] [MEMBER m] [ITEM i] [WITHVALUE]`.
    TallyIncrBy {
        /// The counter.
        key: String,
        /// The increment.
        inc: Box<Increment>,
        /// `WITHVALUE`: answer the total after it and whether it is exact too.
        with_value: bool,
    },
    /// `TALLY.GET key [FRESH|CACHED]`.
    TallyGet {
        /// The counter.
        key: String,
        /// How fresh.
        consistency: Consistency,
    },
    /// `TALLY.WINDOW key window`.
    TallyWindow {
        /// The counter.
        key: String,
        /// One of its windows (`1h`, `24h`, …).
        window: String,
    },
    /// `TALLY.CREATE key [FIELD value ...]`.
    TallyCreate {
        /// The counter.
        key: String,
        /// The spec fields named, as the HTTP body carries them (boxed: the largest
        /// variant by far, and every command of a pipeline is moved a few times).
        spec: Box<SpecBody>,
    },
    /// `TALLY.SHARDS key`.
    TallyShards(String),
    /// `TALLY.NAMESPACE SET|GET|DEL|LIST`.
    TallyNamespace(NamespaceOp),
    /// `TALLY.RECONCILE key authoritative`.
    TallyReconcile {
        /// The counter.
        key: String,
        /// The true total.
        authoritative: i128,
    },
}

impl Command {
    /// Whether the command only adds to counters, so that a run of such commands
    /// in one pipeline may run concurrently (one group commit for all of them)
    /// without any other command seeing a different order.
    pub fn is_increment(&self) -> bool {
        matches!(self, Command::Incr { .. } | Command::TallyIncrBy { .. })
    }

    /// The counter and writer of a sequenced `TALLY.INCRBY`, whose increments must run
    /// in order.
    pub fn sequenced_writer(&self) -> Option<(String, String)> {
        match self {
            Command::TallyIncrBy { key, inc, .. } if inc.seq.is_some() => {
                inc.writer.clone().map(|w| (key.clone(), w))
            }
            _ => None,
        }
    }
}

/// Redis's error for a command it does not know.
pub fn unknown_command(args: &[&[u8]]) -> Reply {
    let mut text = format!("ERR unknown command '{}', with args beginning with: ", quote(args[0]));
    for a in args.iter().skip(1).take(16) {
        text.push_str(&format!("'{}' ", quote(a)));
    }
    Reply::Error(text)
}

/// Redis's arity error.
pub fn wrong_arity(name: &str) -> Reply {
    Reply::Error(format!("ERR wrong number of arguments for '{name}' command"))
}

/// Redis's error for an option it does not understand.
pub fn syntax_error() -> Reply {
    Reply::Error("ERR syntax error".into())
}

/// Redis's syntax error, naming the argument it stopped at.
pub fn syntax_near(arg: &[u8]) -> Reply {
    Reply::Error(format!("ERR syntax error: unexpected '{}'", quote(arg)))
}

/// Redis's syntax error for an option given without its value.
pub fn needs_value(option: &[u8]) -> Reply {
    Reply::Error(format!("ERR syntax error: '{}' needs a value after it", quote(option)))
}

fn spec_float(raw: &[u8], field: &str) -> Result<f64, Reply> {
    std::str::from_utf8(raw)
        .ok()
        .and_then(|t| t.parse::<f64>().ok())
        .filter(|f| f.is_finite())
        .ok_or_else(|| Reply::err("invalid_spec", format!("{field} must be a number (got '{}')", quote(raw))))
}

/// A key: any bytes up to `NAME_BYTES_MAX`, as the counter name's escaped form
/// (`tally_core::name`), which the engine and the HTTP front use too.
fn key(raw: &[u8]) -> Result<String, Reply> {
    tally_core::name::CounterName::from_bytes(raw)
        .map(String::from)
        .map_err(|e| Reply::err("invalid_name", e))
}

fn text(raw: &[u8], what: &str) -> Result<String, Reply> {
    String::from_utf8(raw.to_vec()).map_err(|_| {
        Reply::err(codes::BAD_REQUEST, format!("{what} must be UTF-8 text (got '{}')", quote(raw)))
    })
}

/// Whether `raw` is written like an integer (an optional minus and digits), so a
/// parse failure can only be an overflow.
fn integer_shaped(raw: &[u8]) -> bool {
    let digits = raw.strip_prefix(b"-").unwrap_or(raw);
    !digits.is_empty() && digits.iter().all(u8::is_ascii_digit)
}

/// A 64-bit delta: `invalid_delta` for anything not an integer, `out_of_range`
/// for an integer beyond 64 bits, as the HTTP front end answers.
pub fn delta(raw: &[u8]) -> Result<i64, Reply> {
    let s = std::str::from_utf8(raw).unwrap_or("");
    if let Ok(n) = s.parse::<i64>() {
        if integer_shaped(raw) {
            return Ok(n);
        }
    }
    if integer_shaped(raw) {
        return Err(Reply::err(
            codes::OUT_OF_RANGE,
            format!(
                "value is not an integer or out of range: {} is outside the 64-bit range ±{}",
                quote(raw),
                i64::MAX
            ),
        ));
    }
    Err(Reply::err(
        codes::INVALID_DELTA,
        format!("value is not an integer or out of range (got '{}')", quote(raw)),
    ))
}

fn spec_number(raw: &[u8], field: &str) -> Result<u64, Reply> {
    std::str::from_utf8(raw)
        .ok()
        .filter(|_| raw.iter().all(u8::is_ascii_digit))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            Reply::err(
                "invalid_spec",
                format!("{field} must be a non-negative integer (got '{}')", quote(raw)),
            )
        })
}

fn spec_signed(raw: &[u8], field: &str) -> Result<i64, Reply> {
    std::str::from_utf8(raw).ok().filter(|_| integer_shaped(raw)).and_then(|s| s.parse().ok()).ok_or_else(
        || Reply::err("invalid_spec", format!("{field} must be a 64-bit integer (got '{}')", quote(raw))),
    )
}

fn spec_bool(raw: &[u8], field: &str) -> Result<bool, Reply> {
    match raw.to_ascii_lowercase().as_slice() {
        b"true" | b"yes" | b"1" | b"on" => Ok(true),
        b"false" | b"no" | b"0" | b"off" => Ok(false),
        _ => Err(Reply::err("invalid_spec", format!("{field} must be true or false (got '{}')", quote(raw)))),
    }
}

/// The name command `index` of [`COMMANDS`] is audited and refused under: its
/// table name, uppercased (`INCRBY`), made once for the whole table.
fn audit_name(index: usize) -> &'static str {
    static UPPER: std::sync::LazyLock<Vec<String>> =
        std::sync::LazyLock::new(|| COMMANDS.iter().map(|c| c.name.to_ascii_uppercase()).collect());
    &UPPER[index]
}

/// Parses `args` (the name first, never empty) into a command, checking the
/// command exists and its arity; with the command's uppercase name for the audit
/// trail and refusals.
pub fn parse_named(args: &[&[u8]]) -> Result<(&'static str, Command), Reply> {
    let Some(index) = position(args[0]) else { return Err(unknown_command(args)) };
    parse_spec(&COMMANDS[index], args).map(|cmd| (audit_name(index), cmd))
}

fn parse_spec(spec: &'static CommandSpec, args: &[&[u8]]) -> Result<Command, Reply> {
    let n = args.len() as i64;
    if (spec.arity > 0 && n != spec.arity) || (spec.arity < 0 && n < -spec.arity) {
        return Err(wrong_arity(spec.name));
    }
    let a = &args[1..];
    let upper = |i: usize| a[i].to_ascii_uppercase();
    Ok(match spec.name {
        "ping" => match a {
            [] => Command::Ping(None),
            [m] => Command::Ping(Some(m.to_vec())),
            _ => return Err(wrong_arity("ping")),
        },
        "echo" => Command::Echo(a[0].to_vec()),
        "hello" => parse_hello(a)?,
        "auth" => match a {
            [p] => Command::Auth { user: None, password: p.to_vec() },
            [u, p] => Command::Auth { user: Some(u.to_vec()), password: p.to_vec() },
            _ => return Err(syntax_error()),
        },
        "select" => {
            let s = std::str::from_utf8(a[0]).unwrap_or("");
            Command::Select(
                s.parse().map_err(|_| Reply::Error("ERR value is not an integer or out of range".into()))?,
            )
        }
        "client" => parse_client(a)?,
        "command" => Command::Command(match a {
            [] => CommandQuery::All,
            [sub, rest @ ..] => {
                let names = rest.iter().map(|r| String::from_utf8_lossy(r).to_lowercase()).collect();
                match sub.to_ascii_uppercase().as_slice() {
                    b"COUNT" if rest.is_empty() => CommandQuery::Count,
                    b"COUNT" => return Err(wrong_arity("command|count")),
                    b"DOCS" => CommandQuery::Docs(names),
                    b"INFO" => CommandQuery::Info(names),
                    _ => {
                        return Err(Reply::Error(format!(
                            "ERR unknown subcommand '{}'. Try COMMAND HELP.",
                            quote(sub)
                        )))
                    }
                }
            }
        }),
        "info" => Command::Info(a.first().map(|s| String::from_utf8_lossy(s).to_lowercase())),
        "quit" => Command::Quit,
        "multi" => Command::Multi,
        "exec" => Command::Exec,
        "discard" => Command::Discard,
        "watch" => Command::Watch(a.iter().map(|k| key(k)).collect::<Result<_, _>>()?),
        "unwatch" => Command::Unwatch,
        "incr" => Command::Incr { key: key(a[0])?, delta: 1 },
        "decr" => Command::Incr { key: key(a[0])?, delta: -1 },
        "incrby" => Command::Incr { key: key(a[0])?, delta: redis_int(a[1])? },
        "decrby" => {
            let by = redis_int(a[1])?;
            let delta =
                by.checked_neg().ok_or_else(|| Reply::Error("ERR decrement would overflow".into()))?;
            Command::Incr { key: key(a[0])?, delta }
        }
        "increx" => Command::IncrEx { key: key(a[0])?, args: Box::new(parse_increx(&a[1..])?) },
        "get" => Command::Get(key(a[0])?),
        "mget" => Command::MGet(a.iter().map(|k| key(k)).collect::<Result<_, _>>()?),
        "exists" => Command::Exists(a.iter().map(|k| key(k)).collect::<Result<_, _>>()?),
        "del" => Command::Del(a.iter().map(|k| key(k)).collect::<Result<_, _>>()?),
        "expire" | "pexpire" | "expireat" | "pexpireat" => {
            let t = redis_int(a[1])?;
            let when = match spec.name {
                "expire" => When::InSeconds(t),
                "pexpire" => When::InMillis(t),
                "expireat" => When::AtSeconds(t),
                _ => When::AtMillis(t),
            };
            Command::Expire { key: key(a[0])?, when, cond: expire_condition(&a[2..])?, name: spec.name }
        }
        "ttl" | "pttl" | "expiretime" | "pexpiretime" => Command::Ttl {
            key: key(a[0])?,
            millis: spec.name.starts_with('p'),
            absolute: spec.name.ends_with("time"),
        },
        "persist" => Command::Persist(key(a[0])?),
        "set" => Command::Set { key: key(a[0])?, set: Box::new(parse_set(&a[1..])?) },
        "getset" => Command::Set {
            key: key(a[0])?,
            set: Box::new(SetArgs {
                value: set_value(a[1])?,
                nx: false,
                xx: false,
                get: true,
                ttl: TtlChange::Clear,
            }),
        },
        "getdel" => Command::GetDel(key(a[0])?),
        "getex" => Command::GetEx { key: key(a[0])?, ttl: parse_getex(&a[1..])? },
        "pfadd" => Command::PfAdd {
            key: key(a[0])?,
            members: a[1..].iter().map(|m| member(m, "member")).collect::<Result<_, _>>()?,
        },
        "pfcount" => Command::PfCount(a.iter().map(|k| key(k)).collect::<Result<_, _>>()?),
        "pfmerge" => Command::PfMerge {
            dest: key(a[0])?,
            sources: a[1..].iter().map(|k| key(k)).collect::<Result<_, _>>()?,
        },
        "scan" => Command::Scan(Box::new(parse_scan(a)?)),
        "keys" => Command::Keys(a[0].to_vec()),
        "type" => Command::Type(key(a[0])?),
        "dbsize" => Command::DbSize,
        "config" => match a[0].to_ascii_uppercase().as_slice() {
            b"GET" if a.len() >= 2 => {
                Command::ConfigGet(a[1..].iter().map(|p| p.to_ascii_lowercase()).collect())
            }
            b"GET" => return Err(wrong_arity("config|get")),
            b"SET" | b"RESETSTAT" | b"REWRITE" => {
                Command::ConfigOther(String::from_utf8_lossy(a[0]).to_lowercase())
            }
            _ => {
                return Err(Reply::Error(format!(
                    "ERR unknown subcommand '{}'. Try CONFIG HELP.",
                    quote(a[0])
                )))
            }
        },
        "wait" => {
            let (replicas, timeout_ms) = (redis_int(a[0])?, redis_int(a[1])?);
            if timeout_ms < 0 {
                return Err(Reply::Error("ERR timeout is negative".into()));
            }
            Command::Wait { replicas, timeout_ms }
        }
        "cms.initbydim" => {
            let dim = |raw: &[u8], what: &str| {
                redis_int(raw)
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| Reply::Error(format!("ERR CMS: invalid {what}")))
            };
            let (width, depth) = (dim(a[1], "width")?, dim(a[2], "depth")?);
            // The shape whose table has exactly this width and depth
            // (`CountMin::with_error` rounds ε and δ up to whole counters and rows).
            let epsilon = std::f64::consts::E / width as f64 * (1.0 + 1e-12);
            let delta = (-(depth as f64)).exp() * (1.0 + 1e-9);
            Command::CmsInit {
                key: key(a[0])?,
                shape: tally_core::frequency::FrequencySpec { epsilon, delta },
            }
        }
        "cms.initbyprob" => {
            let prob = |raw: &[u8], what: &str| {
                std::str::from_utf8(raw)
                    .ok()
                    .and_then(|t| t.parse::<f64>().ok())
                    .filter(|p| *p > 0.0 && *p < 1.0)
                    .ok_or_else(|| Reply::Error(format!("ERR CMS: invalid {what} value")))
            };
            let (epsilon, delta) = (prob(a[1], "overestimation")?, prob(a[2], "prob")?);
            Command::CmsInit {
                key: key(a[0])?,
                shape: tally_core::frequency::FrequencySpec { epsilon, delta },
            }
        }
        "cms.incrby" => Command::CmsIncrBy { key: key(a[0])?, items: item_increments(&a[1..], "CMS")? },
        "cms.info" => Command::CmsInfo(key(a[0])?),
        "cms.merge" => {
            let n = redis_int(a[1])
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| Reply::Error("ERR CMS: invalid numkeys".into()))?;
            let n = n as usize;
            let rest = &a[2..];
            if rest.len() < n {
                return Err(wrong_arity("cms.merge"));
            }
            let (names, tail) = rest.split_at(n);
            let weights = match tail {
                [] => vec![1; n],
                [w, ws @ ..] if w.eq_ignore_ascii_case(b"WEIGHTS") && ws.len() == n => ws
                    .iter()
                    .map(|w| redis_int(w).ok().and_then(|w| u64::try_from(w).ok()))
                    .collect::<Option<Vec<u64>>>()
                    .ok_or_else(|| Reply::Error("ERR CMS: invalid weight value".into()))?,
                _ => return Err(syntax_error()),
            };
            let sources = names.iter().map(|k| key(k)).collect::<Result<Vec<_>, _>>()?;
            Command::CmsMerge { dest: key(a[0])?, sources: sources.into_iter().zip(weights).collect() }
        }
        "topk.reserve" => {
            let k = redis_int(a[1])
                .ok()
                .and_then(|k| u32::try_from(k).ok())
                .filter(|k| (1..=tally_core::frequency::TOP_K_MAX).contains(k))
                .ok_or_else(|| {
                    Reply::Error(format!("ERR TopK: invalid k (1 to {})", tally_core::frequency::TOP_K_MAX))
                })?;
            // RedisBloom's width, depth and decay shape its own sketch; Tally's list
            // is exact for the k heaviest within its bounds (docs/SEMANTICS.md).
            match &a[2..] {
                [] => {}
                [w, d, decay] => {
                    redis_int(w)
                        .ok()
                        .filter(|w| *w > 0)
                        .ok_or_else(|| Reply::Error("ERR TopK: invalid width".into()))?;
                    redis_int(d)
                        .ok()
                        .filter(|d| *d > 0)
                        .ok_or_else(|| Reply::Error("ERR TopK: invalid depth".into()))?;
                    spec_float(decay, "decay")
                        .ok()
                        .filter(|d| *d > 0.0 && *d <= 1.0)
                        .ok_or_else(|| Reply::Error("ERR TopK: invalid decay value".into()))?;
                }
                _ => return Err(wrong_arity("topk.reserve")),
            }
            Command::TopkReserve { key: key(a[0])?, k }
        }
        "topk.add" => Command::TopkIncrBy {
            key: key(a[0])?,
            items: a[1..].iter().map(|i| member(i, "item").map(|i| (i, 1))).collect::<Result<_, _>>()?,
        },
        "topk.incrby" => Command::TopkIncrBy { key: key(a[0])?, items: item_increments(&a[1..], "TopK")? },
        "topk.query" | "topk.count" => Command::TopkQuery {
            key: key(a[0])?,
            items: a[1..].iter().map(|i| text(i, "an item")).collect::<Result<_, _>>()?,
            count: spec.name == "topk.count",
        },
        "topk.info" => Command::TopkInfo(key(a[0])?),
        "cms.query" => Command::CmsQuery {
            key: key(a[0])?,
            items: a[1..].iter().map(|i| text(i, "an item")).collect::<Result<_, _>>()?,
        },
        "topk.list" => {
            let (mut with_count, mut k) = (false, None);
            let mut rest = a[1..].iter();
            while let Some(word) = rest.next() {
                match word.to_ascii_uppercase().as_slice() {
                    b"WITHCOUNT" => with_count = true,
                    b"K" => {
                        let n = rest.next().ok_or_else(|| needs_value(word))?;
                        k = Some(std::str::from_utf8(n).ok().and_then(|n| n.parse().ok()).ok_or_else(
                            || Reply::Error("ERR value is not an integer or out of range".into()),
                        )?);
                    }
                    _ => return Err(syntax_near(word)),
                }
            }
            Command::TopkList { key: key(a[0])?, with_count, k }
        }
        "tally.incrby" => {
            let mut inc = Increment::new(delta(a[1])?);
            let mut with_value = false;
            let mut i = 2;
            while i < a.len() {
                if upper(i).as_slice() == b"WITHVALUE" {
                    with_value = true;
                    i += 1;
                    continue;
                }
                let value = a.get(i + 1).ok_or_else(|| needs_value(a[i]))?;
                if upper(i).as_slice() == b"SEQ" {
                    let seq = std::str::from_utf8(value).ok().and_then(|n| n.parse::<u64>().ok());
                    inc.seq =
                        Some(seq.ok_or_else(|| {
                            Reply::Error("ERR value is not an integer or out of range".into())
                        })?);
                    i += 2;
                    continue;
                }
                let slot = match upper(i).as_slice() {
                    b"ID" => &mut inc.event_id,
                    b"WRITER" => &mut inc.writer,
                    b"MEMBER" => &mut inc.member,
                    b"ITEM" => &mut inc.item,
                    _ => return Err(syntax_near(a[i])),
                };
                *slot = Some(text(value, &String::from_utf8_lossy(a[i]).to_lowercase())?);
                i += 2;
            }
            check_increment(&inc)?;
            Command::TallyIncrBy { key: key(a[0])?, inc: Box::new(inc), with_value }
        }
        "tally.get" => Command::TallyGet {
            key: key(a[0])?,
            consistency: match a.get(1).map(|c| c.to_ascii_uppercase()).as_deref() {
                None | Some(b"CACHED") => Consistency::Cached,
                Some(b"FRESH") => Consistency::Fresh,
                Some(_) if a.len() > 2 => return Err(syntax_near(a[2])),
                Some(_) => return Err(syntax_near(a[1])),
            },
        },
        "tally.window" => Command::TallyWindow { key: key(a[0])?, window: text(a[1], "window")? },
        "tally.create" => Command::TallyCreate { key: key(a[0])?, spec: Box::new(spec_fields(&a[1..])?) },
        "tally.namespace" => parse_namespace(a)?,
        "tally.shards" => Command::TallyShards(key(a[0])?),
        "tally.reconcile" => {
            let raw = &a[1];
            let total = std::str::from_utf8(raw).ok().filter(|_| integer_shaped(raw)).map(str::parse::<i128>);
            let authoritative = match total {
                Some(Ok(t)) => t,
                Some(Err(_)) => {
                    return Err(Reply::err(
                        codes::OUT_OF_RANGE,
                        format!("authoritative {} is outside the 128-bit range", quote(raw)),
                    ))
                }
                None => {
                    return Err(Reply::err(
                        codes::INVALID_BODY,
                        format!("authoritative must be an integer (got '{}')", quote(raw)),
                    ))
                }
            };
            Command::TallyReconcile { key: key(a[0])?, authoritative }
        }
        other => {
            // Every name of the table has an arm above; a new entry without one
            // answers like an unknown command rather than failing.
            tracing::error!(command = other, "a command of the table has no parser");
            return Err(unknown_command(args));
        }
    })
}

/// Redis's error for an argument that must be an integer.
pub fn not_an_integer() -> Reply {
    Reply::Error("ERR value is not an integer or out of range".into())
}

/// A 64-bit integer argument, with Redis's error otherwise.
fn redis_int(raw: &[u8]) -> Result<i64, Reply> {
    std::str::from_utf8(raw)
        .ok()
        .filter(|_| integer_shaped(raw))
        .and_then(|s| s.parse().ok())
        .ok_or_else(not_an_integer)
}

/// `SET`'s value: a counter holds an integer (any the 128-bit total takes).
fn set_value(raw: &[u8]) -> Result<i128, Reply> {
    std::str::from_utf8(raw)
        .ok()
        .filter(|_| integer_shaped(raw))
        .and_then(|s| s.parse().ok())
        .ok_or_else(not_an_integer)
}

/// `EXPIRE`'s `NX`, `XX`, `GT`, `LT`, with Redis's errors for combinations.
fn expire_condition(words: &[&[u8]]) -> Result<Condition, Reply> {
    let (mut nx, mut xx, mut gt, mut lt) = (false, false, false, false);
    for w in words {
        match w.to_ascii_uppercase().as_slice() {
            b"NX" => nx = true,
            b"XX" => xx = true,
            b"GT" => gt = true,
            b"LT" => lt = true,
            _ => return Err(Reply::Error(format!("ERR Unsupported option {}", quote(w)))),
        }
    }
    if nx && (xx || gt || lt) {
        return Err(Reply::Error(
            "ERR NX and XX, GT or LT options at the same time are not compatible".into(),
        ));
    }
    if gt && lt {
        return Err(Reply::Error("ERR GT and LT options at the same time are not compatible".into()));
    }
    Ok(match (nx, xx, gt, lt) {
        (true, ..) => Condition::Nx,
        (_, _, true, _) => Condition::Gt,
        (_, _, _, true) => Condition::Lt,
        (_, true, ..) => Condition::Xx,
        _ => Condition::Always,
    })
}

/// A time after `EX`, `PX`, `EXAT` or `PXAT`: a positive integer, else Redis's
/// errors (`command` names the command in them).
fn ttl_time(word: &[u8], raw: Option<&&[u8]>, command: &str) -> Result<When, Reply> {
    let raw = raw.ok_or_else(|| needs_value(word))?;
    let t = redis_int(raw)?;
    if t <= 0 {
        return Err(Reply::Error(format!("ERR invalid expire time in '{command}' command")));
    }
    Ok(match word {
        b"EX" => When::InSeconds(t),
        b"PX" => When::InMillis(t),
        b"EXAT" => When::AtSeconds(t),
        _ => When::AtMillis(t),
    })
}

/// A member or item: UTF-8 text of at most `MEMBER_LEN_MAX` bytes, checked before
/// anything of the command runs (a `PFADD` never counts some members and refuses
/// the rest).
fn member(raw: &[u8], what: &'static str) -> Result<String, Reply> {
    let t = text(raw, what)?;
    tally_core::name::check_len(what, &t, tally_core::name::MEMBER_LEN_MAX)
        .map_err(|e| Reply::err(codes::BAD_REQUEST, e))?;
    Ok(t)
}

/// `item increment` pairs (`CMS.INCRBY`, `TOPK.INCRBY`): increments are positive
/// integers (an item's weight only grows), else RedisBloom's error.
fn item_increments(a: &[&[u8]], module: &str) -> Result<Vec<(String, i64)>, Reply> {
    if a.is_empty() || a.len() % 2 != 0 {
        return Err(Reply::Error(format!(
            "ERR wrong number of arguments for '{}.incrby' command",
            module.to_lowercase()
        )));
    }
    a.chunks(2)
        .map(|pair| {
            let item = member(pair[0], "item")?;
            let by = redis_int(pair[1])
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| Reply::Error(format!("ERR {module}: Cannot parse number")))?;
            Ok((item, by))
        })
        .collect()
}

/// The checks the engine makes of an increment's own fields, made before it runs:
/// the same codes and messages, and a command refused whole.
fn check_increment(inc: &Increment) -> Result<(), Reply> {
    use tally_core::name::{check_len, check_token, EVENT_ID_LEN_MAX, MEMBER_LEN_MAX, WRITER_LEN_MAX};
    let refused = |e: tally_core::name::NameError| Reply::err("invalid_name", e);
    if let Some(id) = &inc.event_id {
        check_token("event id", id, EVENT_ID_LEN_MAX).map_err(refused)?;
    }
    if let Some(w) = &inc.writer {
        check_len("writer", w, WRITER_LEN_MAX).map_err(refused)?;
    }
    for (what, v) in [("member", &inc.member), ("item", &inc.item)] {
        if let Some(v) = v {
            check_len(what, v, MEMBER_LEN_MAX).map_err(refused)?;
        }
    }
    Ok(())
}

/// `SCAN cursor [MATCH pattern] [COUNT count] [TYPE type]`, as Redis parses it.
fn parse_scan(a: &[&[u8]]) -> Result<ScanArgs, Reply> {
    let cursor = std::str::from_utf8(a[0])
        .ok()
        .filter(|t| t.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|t| t.parse::<u64>().ok())
        .ok_or_else(|| Reply::Error("ERR invalid cursor".into()))?;
    let mut scan = ScanArgs { cursor, pattern: None, count: SCAN_COUNT_DEFAULT, kind: None };
    let mut i = 1;
    while i < a.len() {
        let value = a.get(i + 1).ok_or_else(|| needs_value(a[i]))?;
        match a[i].to_ascii_uppercase().as_slice() {
            b"MATCH" => scan.pattern = Some(value.to_vec()),
            b"COUNT" => {
                let n = redis_int(value)?;
                if n < 1 {
                    return Err(syntax_error());
                }
                scan.count = usize::try_from(n).unwrap_or(usize::MAX);
            }
            b"TYPE" => scan.kind = Some(String::from_utf8_lossy(value).to_lowercase()),
            _ => return Err(syntax_near(a[i])),
        }
        i += 2;
    }
    Ok(scan)
}

/// `SET key value ...`'s value and options, as Redis parses them.
fn parse_set(a: &[&[u8]]) -> Result<SetArgs, Reply> {
    let mut set = SetArgs { value: 0, nx: false, xx: false, get: false, ttl: TtlChange::Clear };
    let mut timed = false;
    let mut i = 1;
    while i < a.len() {
        let word = a[i].to_ascii_uppercase();
        match word.as_slice() {
            b"NX" if !set.xx => set.nx = true,
            b"XX" if !set.nx => set.xx = true,
            b"GET" => set.get = true,
            b"KEEPTTL" if !timed => {
                timed = true;
                set.ttl = TtlChange::Keep;
            }
            b"EX" | b"PX" | b"EXAT" | b"PXAT" if !timed => {
                timed = true;
                set.ttl = TtlChange::Set(ttl_time(&word, a.get(i + 1), "set")?);
                i += 1;
            }
            _ => return Err(syntax_near(a[i])),
        }
        i += 1;
    }
    // The value is checked after the options, as Redis finds a syntax error first.
    set.value = set_value(a[0])?;
    Ok(set)
}

/// `INCREX key ...`'s options, in any order, each at most once (Redis 8.8's rules:
/// one increment option, one expiration option, `ENX` only with a time).
fn parse_increx(a: &[&[u8]]) -> Result<IncrExArgs, Reply> {
    let (mut delta, mut by, mut min, mut max, mut saturate, mut enx) = (1, false, None, None, false, false);
    let mut ttl: Option<TtlChange> = None;
    let mut i = 0;
    while i < a.len() {
        let word = a[i].to_ascii_uppercase();
        let value = a.get(i + 1);
        let int = || value.ok_or_else(syntax_error).and_then(|v| redis_int(v));
        match word.as_slice() {
            b"BYINT" if !by => {
                (delta, by) = (int()?, true);
                i += 1;
            }
            b"BYFLOAT" if !by => {
                return Err(Reply::Error(
                    "ERR BYFLOAT is not supported: Tally counters hold integers; use BYINT".into(),
                ))
            }
            b"LBOUND" if min.is_none() => {
                min = Some(int()?);
                i += 1;
            }
            b"UBOUND" if max.is_none() => {
                max = Some(int()?);
                i += 1;
            }
            b"SATURATE" if !saturate => saturate = true,
            b"ENX" if !enx => enx = true,
            b"PERSIST" if ttl.is_none() => ttl = Some(TtlChange::Clear),
            b"EX" | b"PX" | b"EXAT" | b"PXAT" if ttl.is_none() => {
                if value.is_none() {
                    return Err(syntax_error());
                }
                ttl = Some(TtlChange::Set(ttl_time(&word, value, "increx")?));
                i += 1;
            }
            _ => return Err(syntax_error()),
        }
        i += 1;
    }
    match ttl {
        Some(TtlChange::Clear) if enx => return Err(syntax_error()),
        None if enx => return Err(Reply::Error("ERR ENX flag requires an expiration".into())),
        _ => {}
    }
    let within =
        tally_core::within::Within::new(min, max, saturate).map_err(|e| Reply::Error(format!("ERR {e}")))?;
    Ok(IncrExArgs { delta, within, ttl: ttl.unwrap_or(TtlChange::Keep), enx })
}

/// `GETEX key ...`'s option.
fn parse_getex(a: &[&[u8]]) -> Result<TtlChange, Reply> {
    match a {
        [] => Ok(TtlChange::Keep),
        [p] if p.eq_ignore_ascii_case(b"PERSIST") => Ok(TtlChange::Clear),
        [w, t] => {
            let word = w.to_ascii_uppercase();
            if !matches!(word.as_slice(), b"EX" | b"PX" | b"EXAT" | b"PXAT") {
                return Err(syntax_error());
            }
            Ok(TtlChange::Set(ttl_time(&word, Some(t), "getex")?))
        }
        _ => Err(syntax_error()),
    }
}

/// The spec fields of `TALLY.CREATE` (and `TALLY.NAMESPACE SET`), `FIELD value`
/// pairs in any order and case, as the HTTP body carries them.
fn spec_fields(a: &[&[u8]]) -> Result<SpecBody, Reply> {
    let mut spec = SpecBody::default();
    let upper = |i: usize| a[i].to_ascii_uppercase();
    let mut i = 0;
    while i < a.len() {
        let value = a.get(i + 1).ok_or_else(|| needs_value(a[i]))?;
        match upper(i).as_slice() {
            // `SHARDS auto MIN n MAX m`: the count follows contention.
            b"SHARDS" if value.eq_ignore_ascii_case(b"auto") => {
                spec.shards = Some(ShardsField::Word("auto".into()))
            }
            b"SHARDS" => spec.shards = Some(ShardsField::Count(spec_number(value, "shards")?)),
            b"MIN" => spec.min_shards = Some(spec_number(value, "min_shards")?),
            b"MAX" => spec.max_shards = Some(spec_number(value, "max_shards")?),
            b"DURABILITY" => spec.durability = Some(text(value, "durability")?.to_lowercase()),
            b"FLUSH_MS" => spec.flush_ms = Some(spec_number(value, "flush_ms")?),
            b"ROLLUP_MS" => spec.rollup_ms = Some(spec_number(value, "rollup_ms")?),
            b"ROUTER" => spec.router = Some(text(value, "router")?.to_lowercase()),
            b"DISTINCT" => spec.distinct = Some(spec_bool(value, "distinct")?),
            b"DEDUP_WINDOW_S" => spec.dedup_window_s = Some(spec_number(value, "dedup_window_s")?),
            b"REPLICAS" => spec.replicas = Some(spec_number(value, "replicas")?),
            b"TTL_MS" => spec.ttl_ms = Some(spec_number(value, "ttl_ms")?),
            // `FLOOR n` / `CEILING n`: the HTTP body's `min` / `max` (the words
            // MIN and MAX bound an auto counter's shard count).
            b"FLOOR" => spec.min = Some(spec_signed(value, "min")?),
            b"CEILING" => spec.max = Some(spec_signed(value, "max")?),
            // `WINDOWS 1m,1h,24h`: the HTTP body's `windows` list; `""` keeps none.
            b"WINDOWS" => {
                let list = text(value, "windows")?;
                let parts = list.split(',').map(str::trim).filter(|w| !w.is_empty());
                spec.windows = Some(parts.map(str::to_owned).collect());
            }
            // `LIMIT max window`: the HTTP body's `limit` object (a rate limit).
            b"LIMIT" => {
                let window = a.get(i + 2).ok_or_else(|| needs_value(b"LIMIT max"))?;
                let window = text(window, "limit.window")?;
                let max = spec_number(value, "limit.max")?;
                spec.limit = Some(crate::http::body::LimitBody { window, max });
                i += 1;
            }
            // `FREQUENCY epsilon delta`: the HTTP body's `frequency` object.
            b"FREQUENCY" => {
                let delta = a.get(i + 2).ok_or_else(|| needs_value(b"FREQUENCY epsilon"))?;
                let (epsilon, delta) = (spec_float(value, "epsilon")?, spec_float(delta, "delta")?);
                spec.frequency = Some(tally_core::frequency::FrequencySpec { epsilon, delta });
                i += 1;
            }
            _ => return Err(syntax_near(a[i])),
        }
        i += 2;
    }
    Ok(spec)
}

/// `TALLY.NAMESPACE SET prefix [FIELD value ...] | GET prefix | DEL prefix | LIST`.
fn parse_namespace(a: &[&[u8]]) -> Result<Command, Reply> {
    let sub = a[0].to_ascii_uppercase();
    let prefix = |i: usize| {
        a.get(i).ok_or_else(|| wrong_arity("tally.namespace")).map(|p| tally_core::name::escape(p))
    };
    Ok(Command::TallyNamespace(match sub.as_slice() {
        b"SET" => NamespaceOp::Set { prefix: prefix(1)?, spec: Box::new(spec_fields(&a[2..])?) },
        b"GET" if a.len() == 2 => NamespaceOp::Get(prefix(1)?),
        b"DEL" if a.len() == 2 => NamespaceOp::Del(prefix(1)?),
        b"LIST" if a.len() == 1 => NamespaceOp::List,
        b"GET" | b"DEL" | b"LIST" => return Err(wrong_arity("tally.namespace")),
        _ => {
            return Err(Reply::Error(format!(
                "ERR unknown subcommand '{}'. Try SET, GET, DEL or LIST.",
                quote(a[0])
            )))
        }
    }))
}

fn parse_hello(a: &[&[u8]]) -> Result<Command, Reply> {
    let mut proto = None;
    let mut auth = None;
    let mut setname = None;
    let mut i = 0;
    if let Some(first) = a.first() {
        let s = std::str::from_utf8(first).unwrap_or("");
        proto =
            Some(s.parse::<i64>().map_err(|_| {
                Reply::Error("ERR Protocol version is not an integer or out of range".into())
            })?);
        i = 1;
    }
    while i < a.len() {
        match a[i].to_ascii_uppercase().as_slice() {
            b"AUTH" if i + 2 < a.len() => {
                auth = Some(Box::new((a[i + 1].to_vec(), a[i + 2].to_vec())));
                i += 3;
            }
            b"SETNAME" if i + 1 < a.len() => {
                setname = Some(a[i + 1].to_vec());
                i += 2;
            }
            _ => return Err(Reply::Error(format!("ERR Syntax error in HELLO option '{}'", quote(a[i])))),
        }
    }
    Ok(Command::Hello { proto, auth, setname })
}

fn parse_client(a: &[&[u8]]) -> Result<Command, Reply> {
    let sub = a[0].to_ascii_uppercase();
    let rest = &a[1..];
    let arity = |name: &str| wrong_arity(&format!("client|{name}"));
    Ok(match sub.as_slice() {
        b"SETNAME" => match rest {
            [name] => {
                if name.iter().any(|&b| b <= b' ' || b > b'~') {
                    return Err(Reply::Error(
                        "ERR Client names cannot contain spaces, newlines or special characters.".into(),
                    ));
                }
                Command::ClientSetName(name.to_vec())
            }
            _ => return Err(arity("setname")),
        },
        b"GETNAME" if rest.is_empty() => Command::ClientGetName,
        b"GETNAME" => return Err(arity("getname")),
        b"ID" if rest.is_empty() => Command::ClientId,
        b"ID" => return Err(arity("id")),
        b"LIST" => Command::ClientList,
        b"INFO" if rest.is_empty() => Command::ClientInfo,
        b"INFO" => return Err(arity("info")),
        b"KILL" => Command::ClientKill(Box::new(parse_kill(rest)?)),
        b"SETINFO" => match rest {
            [attr, value] => {
                let attr = String::from_utf8_lossy(attr).to_lowercase();
                if attr != "lib-name" && attr != "lib-ver" {
                    return Err(Reply::Error(format!(
                        "ERR Unrecognized option '{}'",
                        quote(attr.as_bytes())
                    )));
                }
                Command::ClientSetInfo { attr, value: value.to_vec() }
            }
            _ => return Err(arity("setinfo")),
        },
        _ => {
            return Err(Reply::Error(format!("ERR unknown subcommand '{}'. Try CLIENT HELP.", quote(a[0]))));
        }
    })
}

/// `CLIENT KILL ip:port` or `CLIENT KILL [ID id] [ADDR ip:port] [SKIPME yes|no]`.
fn parse_kill(a: &[&[u8]]) -> Result<KillFilter, Reply> {
    let mut f = KillFilter { skip_me: true, ..KillFilter::default() };
    if let [addr] = a {
        f.old_form = true;
        f.addr = Some(String::from_utf8_lossy(addr).into_owned());
        f.skip_me = false;
        return Ok(f);
    }
    if a.is_empty() || a.len() % 2 != 0 {
        return Err(syntax_error());
    }
    for pair in a.chunks(2) {
        match pair[0].to_ascii_uppercase().as_slice() {
            b"ID" => {
                let id = std::str::from_utf8(pair[1]).ok().and_then(|t| t.parse::<u64>().ok());
                f.id = Some(id.ok_or_else(|| Reply::Error("ERR client-id should be greater than 0".into()))?);
            }
            b"ADDR" => f.addr = Some(String::from_utf8_lossy(pair[1]).into_owned()),
            b"SKIPME" => match pair[1].to_ascii_lowercase().as_slice() {
                b"yes" => f.skip_me = true,
                b"no" => f.skip_me = false,
                _ => return Err(syntax_error()),
            },
            _ => return Err(syntax_error()),
        }
    }
    Ok(f)
}

/// `COMMAND INFO`'s entry for one command (Redis 7's ten fields).
pub fn info_entry(c: &CommandSpec) -> Reply {
    Reply::Array(vec![
        Reply::text(c.name),
        Reply::Int(c.arity),
        Reply::Array(c.flags.iter().map(|f| Reply::Simple((*f).into())).collect()),
        Reply::Int(c.first_key),
        Reply::Int(c.last_key),
        Reply::Int(c.step),
        Reply::Array(Vec::new()),
        Reply::Array(Vec::new()),
        Reply::Array(Vec::new()),
        Reply::Array(Vec::new()),
    ])
}

/// `COMMAND DOCS`'s entry for one command: summary, since, group, arguments.
pub fn docs_entry(c: &CommandSpec) -> Reply {
    let args = c
        .args
        .iter()
        .map(|a| {
            let mut pairs = vec![
                (Reply::text("name"), Reply::text(a.name)),
                (Reply::text("type"), Reply::text(a.kind.name())),
            ];
            if let Some(t) = a.token {
                pairs.push((Reply::text("token"), Reply::text(t)));
            }
            let mut flags = Vec::new();
            if a.optional {
                flags.push(Reply::Simple("optional".into()));
            }
            if a.multiple {
                flags.push(Reply::Simple("multiple".into()));
            }
            if !flags.is_empty() {
                pairs.push((Reply::text("flags"), Reply::Array(flags)));
            }
            Reply::Map(pairs)
        })
        .collect();
    Reply::map([
        ("summary", Reply::text(c.summary)),
        ("since", Reply::text("1.0.0")),
        ("group", Reply::text(c.group)),
        ("arguments", Reply::Array(args)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&[u8]]) -> Result<Command, Reply> {
        parse_named(args).map(|(_, cmd)| cmd)
    }

    fn args<'a>(words: &[&'a str]) -> Vec<&'a [u8]> {
        words.iter().map(|w| w.as_bytes()).collect()
    }

    fn parsed(words: &[&str]) -> Command {
        parse(&args(words)).unwrap_or_else(|e| panic!("{words:?}: {e:?}"))
    }

    fn refused(words: &[&str]) -> String {
        match parse(&args(words)) {
            Err(Reply::Error(e)) => e,
            other => panic!("{words:?} should be refused, got {other:?}"),
        }
    }

    #[test]
    fn increments_in_every_spelling() {
        assert_eq!(parsed(&["incr", "a"]), Command::Incr { key: "a".into(), delta: 1 });
        assert_eq!(parsed(&["DECR", "a"]), Command::Incr { key: "a".into(), delta: -1 });
        assert_eq!(parsed(&["IncrBy", "a", "-7"]), Command::Incr { key: "a".into(), delta: -7 });
        assert_eq!(parsed(&["decrby", "a", "7"]), Command::Incr { key: "a".into(), delta: -7 });
        assert_eq!(
            parsed(&["incrby", "a", "9223372036854775807"]),
            Command::Incr { key: "a".into(), delta: i64::MAX }
        );
    }

    #[test]
    fn bad_integers_answer_redis_texts_and_tally_commands_the_http_codes() {
        for bad in ["x", "1.5", "+1", "", "9223372036854775808"] {
            assert_eq!(
                refused(&["incrby", "a", bad]),
                "ERR value is not an integer or out of range",
                "{bad:?}"
            );
        }
        assert_eq!(refused(&["decrby", "a", "-9223372036854775808"]), "ERR decrement would overflow");
        assert_eq!(parsed(&["incrby", "a", "0"]), Command::Incr { key: "a".into(), delta: 0 });
        assert!(refused(&["tally.incrby", "a", "x"]).starts_with("ERR invalid_delta value is not an integer"));
        assert!(refused(&["tally.incrby", "a", "9223372036854775808"]).starts_with("ERR out_of_range"));
        // An increment's own fields are checked before anything runs.
        assert!(
            refused(&["tally.incrby", "a", "1", "ID", "no spaces"]).starts_with("ERR invalid_name event id")
        );
        let long = "m".repeat(tally_core::name::MEMBER_LEN_MAX + 1);
        assert!(refused(&["tally.incrby", "a", "1", "MEMBER", &long]).starts_with("ERR invalid_name member"));
        assert!(
            refused(&["pfadd", "a", "ok", &long]).starts_with("ERR bad_request member"),
            "no member is counted"
        );
        assert!(refused(&["tally.reconcile", "a", "1e3"]).starts_with("ERR invalid_body"));
        assert!(refused(&["tally.reconcile", "a", &"9".repeat(50)]).starts_with("ERR out_of_range"));
        let big = i128::MAX.to_string();
        assert_eq!(
            parsed(&["tally.reconcile", "a", &big]),
            Command::TallyReconcile { key: "a".into(), authoritative: i128::MAX }
        );
    }

    #[test]
    fn unknown_commands_and_arity_answer_as_redis_does() {
        assert_eq!(
            refused(&["FOO", "a", "b"]),
            "ERR unknown command 'FOO', with args beginning with: 'a' 'b' "
        );
        assert_eq!(refused(&["incr"]), "ERR wrong number of arguments for 'incr' command");
        assert_eq!(refused(&["incr", "a", "b"]), "ERR wrong number of arguments for 'incr' command");
        assert_eq!(refused(&["mget"]), "ERR wrong number of arguments for 'mget' command");
        assert_eq!(refused(&["ping", "a", "b"]), "ERR wrong number of arguments for 'ping' command");
        assert_eq!(refused(&["client", "id", "x"]), "ERR wrong number of arguments for 'client|id' command");
        assert!(refused(&["client", "pause", "1"]).starts_with("ERR unknown subcommand 'pause'"));
    }

    /// A pipeline moves each command from the parser to its run several times: the
    /// large fields are boxed so a command stays small.
    #[test]
    fn a_command_is_small() {
        assert!(std::mem::size_of::<Command>() <= COMMAND_BYTES_MAX, "{}", std::mem::size_of::<Command>());
    }

    #[test]
    fn tally_commands_take_their_options_in_any_order_and_case() {
        assert_eq!(
            parsed(&["tally.incrby", "c", "5", "member", "u1", "ID", "e-1", "WRITER", "w"]),
            Command::TallyIncrBy {
                key: "c".into(),
                inc: Box::new(Increment::new(5).event_id("e-1").writer("w").member("u1")),
                with_value: false,
            }
        );
        assert_eq!(
            parsed(&["tally.incrby", "c", "5", "seq", "7", "WRITER", "w"]),
            Command::TallyIncrBy {
                key: "c".into(),
                inc: Box::new(Increment::new(5).sequenced("w", 7)),
                with_value: false
            }
        );
        assert_eq!(
            parsed(&["tally.incrby", "c", "5", "withvalue", "ID", "e"]),
            Command::TallyIncrBy {
                key: "c".into(),
                inc: Box::new(Increment::new(5).event_id("e")),
                with_value: true
            }
        );
        assert_eq!(
            refused(&["tally.incrby", "c", "5", "SEQ", "-1"]),
            "ERR value is not an integer or out of range"
        );
        assert_eq!(
            refused(&["tally.incrby", "c", "5", "SEQ"]),
            "ERR syntax error: 'SEQ' needs a value after it"
        );
        assert_eq!(
            refused(&["tally.incrby", "c", "5", "ID"]),
            "ERR syntax error: 'ID' needs a value after it"
        );
        assert_eq!(
            refused(&["tally.incrby", "c", "5", "COLOR", "red"]),
            "ERR syntax error: unexpected 'COLOR'"
        );
        assert_eq!(
            parsed(&["tally.get", "c", "fresh"]),
            Command::TallyGet { key: "c".into(), consistency: Consistency::Fresh }
        );
        assert_eq!(
            parsed(&["tally.get", "c"]),
            Command::TallyGet { key: "c".into(), consistency: Consistency::Cached }
        );
        assert_eq!(refused(&["tally.get", "c", "warm"]), "ERR syntax error: unexpected 'warm'");
        assert_eq!(
            parsed(&["TALLY.WINDOW", "c", "1h"]),
            Command::TallyWindow { key: "c".into(), window: "1h".into() }
        );
        assert_eq!(
            refused(&["tally.window", "c"]),
            "ERR wrong number of arguments for 'tally.window' command"
        );
        let Command::TallyCreate { spec, .. } = parsed(&["tally.create", "c", "windows", "1m, 1h,24h"])
        else {
            panic!("not a create")
        };
        assert_eq!(spec.windows, Some(vec!["1m".to_owned(), "1h".to_owned(), "24h".to_owned()]));
        let Command::TallyCreate { spec, .. } = parsed(&["tally.create", "c", "WINDOWS", ""]) else {
            panic!("not a create")
        };
        assert_eq!(spec.windows, Some(Vec::new()), "an empty list keeps no windows");
        let Command::TallyCreate { spec, .. } =
            parsed(&["tally.create", "c", "WINDOWS", "1m", "LIMIT", "100", "1m", "durability", "sync"])
        else {
            panic!("not a create")
        };
        let limit = crate::http::body::LimitBody { window: "1m".into(), max: 100 };
        assert_eq!((spec.limit, spec.durability.as_deref()), (Some(limit), Some("sync")));
        assert!(
            refused(&["tally.create", "c", "LIMIT", "100"]).contains("syntax"),
            "a limit names its window"
        );
        let Command::TallyCreate { spec, .. } =
            parsed(&["tally.create", "c", "FLOOR", "-5", "ceiling", "100"])
        else {
            panic!("not a create")
        };
        assert_eq!((spec.min, spec.max), (Some(-5), Some(100)));
        assert!(refused(&["tally.create", "c", "FLOOR", "1.5"]).starts_with("ERR invalid_spec"));
        let Command::TallyCreate { spec, .. } = parsed(&["tally.create", "c", "replicas", "3"]) else {
            panic!("not a create")
        };
        assert_eq!(spec.replicas, Some(3));
        assert!(refused(&["tally.create", "c", "REPLICAS", "three"]).starts_with("ERR invalid_spec"));
        let Command::TallyCreate { key, spec } = parsed(&[
            "TALLY.CREATE",
            "c",
            "SHARDS",
            "4",
            "durability",
            "SYNC",
            "distinct",
            "yes",
            "rollup_ms",
            "0",
        ]) else {
            panic!("a create");
        };
        assert_eq!(key, "c");
        let (patch, auto) = spec.into_patch().expect("valid");
        assert!(auto.is_empty());
        assert_eq!(patch.shards, Some(4));
        assert_eq!(patch.durability, Some(tally_engine::Durability::Sync));
        assert_eq!((patch.distinct, patch.rollup_ms), (Some(true), Some(0)));
        assert!(refused(&["tally.create", "c", "SHARDS", "-1"]).starts_with("ERR invalid_spec"));
        assert!(refused(&["tally.create", "c", "DISTINCT", "maybe"]).starts_with("ERR invalid_spec"));
        assert_eq!(
            refused(&["tally.create", "c", "SHARDS"]),
            "ERR syntax error: 'SHARDS' needs a value after it"
        );
        let Ok(Command::TallyCreate { spec, .. }) =
            parse(&args(&["TALLY.CREATE", "c", "SHARDS", "AUTO", "MIN", "2", "max", "16"]))
        else {
            panic!("an auto create");
        };
        let (patch, auto) = spec.into_patch().expect("valid");
        assert_eq!(patch.shards, None);
        assert_eq!(auto, tally_engine::AutoPatch { auto: true, min_shards: Some(2), max_shards: Some(16) });
        assert!(refused(&["tally.create", "c", "MIN", "x"]).starts_with("ERR invalid_spec"));
    }

    #[test]
    fn keys_are_any_bytes_and_connection_commands_parse() {
        // A key is any bytes up to the limit, held in its escaped form.
        let Ok(Command::Get(name)) = parse(&[b"get".as_slice(), &[0xff, b' ', b'{', b'}']]) else {
            panic!("a GET");
        };
        assert_eq!(name, "%FF%20%7B%7D");
        let long = vec![0xC3; tally_core::name::NAME_BYTES_MAX];
        assert!(parse(&[b"incr".as_slice(), &long]).is_ok());
        for bad in [vec![], vec![b'x'; tally_core::name::NAME_BYTES_MAX + 1]] {
            let e = parse(&[b"get".as_slice(), &bad]).expect_err("refused");
            assert!(matches!(e, Reply::Error(ref t) if t.starts_with("ERR invalid_name")), "{e:?}");
        }
        assert_eq!(
            parsed(&["hello", "3", "setname", "me"]),
            Command::Hello { proto: Some(3), auth: None, setname: Some(b"me".to_vec()) }
        );
        assert!(refused(&["hello", "three"]).contains("Protocol version"));
        assert_eq!(parsed(&["auth", "pw"]), Command::Auth { user: None, password: b"pw".to_vec() });
        assert_eq!(
            parsed(&["command", "docs", "GET"]),
            Command::Command(CommandQuery::Docs(vec!["get".into()]))
        );
        assert_eq!(parsed(&["select", "0"]), Command::Select(0));
        assert!(refused(&["client", "setname", "a b"]).contains("cannot contain spaces"));
        assert_eq!(parsed(&["pfcount", "a", "b"]), Command::PfCount(vec!["a".into(), "b".into()]));
    }

    #[test]
    fn every_command_of_the_table_parses_with_its_documented_arguments() {
        // Commands whose string arguments are words or numbers of their own.
        let samples: &[&[&str]] = &[
            &["config", "get", "save"],
            &["tally.namespace", "list"],
            &["cms.initbyprob", "k", "0.01", "0.01"],
            &["cms.incrby", "k", "item", "1"],
            &["topk.incrby", "k", "item", "1"],
            &["cms.merge", "k", "1", "src"],
        ];
        for words in samples {
            assert!(parse(&args(words)).is_ok(), "{words:?}: {:?}", parse(&args(words)));
        }
        for c in COMMANDS {
            if samples.iter().any(|w| w[0] == c.name) {
                continue;
            }
            let mut words = vec![c.name.to_string()];
            for a in c.args.iter().filter(|a| !a.optional) {
                words.push(match a.kind {
                    Integer => "1".into(),
                    Key => "k".into(),
                    _ => {
                        if c.name == "client" {
                            "id".into()
                        } else {
                            "x".into()
                        }
                    }
                });
            }
            let words: Vec<&str> = words.iter().map(String::as_str).collect();
            assert!(parse(&args(&words)).is_ok(), "{words:?}: {:?}", parse(&args(&words)));
        }
    }
}
