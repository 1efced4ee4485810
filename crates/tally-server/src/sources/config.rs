//! The `[[reconcile]]` sections of a node config: which counters a source of truth
//! covers (a name pattern), when it runs (a schedule), and where the authoritative
//! totals come from (a PostgreSQL query or an event-log directory).
//!
//! Everything is checked at load by [`SourceConfig::validate`], so a node never
//! starts with a schedule it cannot keep or a pattern it cannot match.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use tally_core::name::{check_token, NAME_BYTES_MAX};

/// Longest a source's name may be, in bytes (it appears in run records and logs).
pub const SOURCE_NAME_LEN_MAX: usize = 64;
/// Most sources of truth one node may be configured with.
pub const SOURCES_MAX: usize = 64;
/// Shortest schedule period, in milliseconds: more often would turn reconciliation
/// into a second write path.
pub const EVERY_MS_MIN: u64 = 1_000;
/// Longest schedule period, in milliseconds (one week).
pub const EVERY_MS_MAX: u64 = 7 * 86_400_000;
/// Most placeholders (`{id}`) a counter pattern may hold; each becomes `$1`, `$2`, ….
pub const PATTERN_PLACEHOLDERS_MAX: usize = 8;
/// Longest a PostgreSQL connect (and a wait for a pooled connection) may be
/// configured to take, in milliseconds.
pub const PG_CONNECT_TIMEOUT_MS_MAX: u64 = 60_000;
/// Longest one PostgreSQL query may be configured to take, in milliseconds.
pub const PG_QUERY_TIMEOUT_MS_MAX: u64 = 600_000;
/// Most connections one source's pool may be configured to hold.
pub const PG_POOL_SIZE_MAX: u64 = 64;
/// Longest query text, in bytes.
pub const PG_QUERY_BYTES_MAX: usize = 16 * 1024;

/// Why a `[[reconcile]]` section was refused: the field and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct SourceConfigError {
    /// The field, e.g. `reconcile[0].every`.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

/// One source of truth, `[[reconcile]]`: the counters it is authoritative for, its
/// schedule, and exactly one of `[reconcile.postgres]` or `[reconcile.event_log]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// The source's name, recorded with every run it makes.
    pub name: String,
    /// The counters it covers: a name with `{placeholders}`, such as `likes:{id}`
    /// (every existing counter that matches), or a plain name (that one counter).
    pub counters: String,
    /// The schedule's period, such as `"30s"`, `"15m"`, `"1h"` or `"1d"`.
    pub every: String,
    /// Time of day (UTC, `"HH:MM"` or `"HH:MM:SS"`) runs are aligned to, such as
    /// `"03:00"` with `every = "1d"` for a nightly run. Exclusive with `offset`.
    #[serde(default)]
    pub at: Option<String>,
    /// Shift of the runs from multiples of `every` since the Unix epoch, such as
    /// `"5m"`. Exclusive with `at`.
    #[serde(default)]
    pub offset: Option<String>,
    /// A PostgreSQL query returning each counter's authoritative total.
    #[serde(default)]
    pub postgres: Option<PostgresSource>,
    /// A directory of JSON-lines event files recounted on every run.
    #[serde(default)]
    pub event_log: Option<EventLogSource>,
}

/// `[reconcile.postgres]`: a parameterized query whose one row and column is the
/// authoritative total of the counter whose placeholders fill `$1`, `$2`, ….
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresSource {
    /// A libpq-style connection string or `postgres://` URL. With
    /// `sslmode=verify-full` (or `verify-ca`) and `sslrootcert=FILE`, TLS that checks
    /// the server's certificate; `prefer` and `require`, which check nothing, are
    /// refused.
    pub url: String,
    /// The query, e.g. `SELECT count(*) FROM likes WHERE post_id = $1`.
    pub query: String,
    /// Longest a connect, or a wait for a pooled connection, may take, in milliseconds.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Longest one query (prepare included) may take, in milliseconds.
    #[serde(default = "default_query_timeout_ms")]
    pub query_timeout_ms: u64,
    /// Most connections the source's pool holds.
    #[serde(default = "default_pool_size")]
    pub pool_size: u64,
}

/// `[reconcile.event_log]`: a directory of `*.jsonl` files, one event
/// `{"event_id": …, "counter": …, "delta": …}` per line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventLogSource {
    /// The directory; its `*.jsonl` files are read in name order.
    pub dir: PathBuf,
}

fn default_connect_timeout_ms() -> u64 {
    5_000
}
fn default_query_timeout_ms() -> u64 {
    30_000
}
fn default_pool_size() -> u64 {
    4
}

/// When a source runs: at every instant `t` (Unix milliseconds) with
/// `t % every_ms == offset_ms`, so every node computes the same instants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    /// The period, in milliseconds.
    pub every_ms: u64,
    /// The shift from multiples of the period, in milliseconds (less than it).
    pub offset_ms: u64,
}

impl Schedule {
    /// The first run instant strictly after `now_ms`.
    pub fn next_after(&self, now_ms: u64) -> u64 {
        let base = now_ms - now_ms % self.every_ms + self.offset_ms;
        if base > now_ms {
            base
        } else {
            base + self.every_ms
        }
    }
}

/// A counter pattern: literal text with `{name}` placeholders, each matching a
/// non-empty part of a counter name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    /// Literal text before each placeholder, then the text after the last one.
    literals: Vec<String>,
}

impl Pattern {
    /// Parses `text`; placeholders must be closed, named and not adjacent.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut literals = vec![String::new()];
        let mut rest = text;
        while let Some(open) = rest.find(['{', '}']) {
            if rest.as_bytes()[open] == b'}' {
                return Err("a '}' without its '{'".into());
            }
            let Some(close) = rest[open..].find('}') else { return Err("a '{' without its '}'".into()) };
            let name = &rest[open + 1..open + close];
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(format!("placeholder {{{name}}} must be a non-empty [A-Za-z0-9_] name"));
            }
            if let Some(l) = literals.last_mut() {
                l.push_str(&rest[..open]);
            }
            if literals.len() > 1 && literals.last().is_some_and(String::is_empty) {
                return Err("two placeholders must be separated by literal text".into());
            }
            literals.push(String::new());
            rest = &rest[open + close + 1..];
        }
        if let Some(l) = literals.last_mut() {
            l.push_str(rest);
        }
        let p = Self { literals };
        if p.placeholders() > PATTERN_PLACEHOLDERS_MAX {
            return Err(format!("at most {PATTERN_PLACEHOLDERS_MAX} placeholders"));
        }
        let probe: String = p.literals.join("x");
        check_token("counter pattern", &probe, NAME_BYTES_MAX).map_err(|e| e.to_string())?;
        Ok(p)
    }

    /// How many placeholders (query parameters) the pattern has.
    pub fn placeholders(&self) -> usize {
        self.literals.len() - 1
    }

    /// The literal text every matching name starts with (what to list by).
    pub fn prefix(&self) -> &str {
        &self.literals[0]
    }

    /// The placeholders' values if `name` matches, in order. Each placeholder takes
    /// the shortest non-empty text up to the next literal; the last takes the rest.
    pub fn matches(&self, name: &str) -> Option<Vec<String>> {
        let mut rest = name.strip_prefix(self.literals[0].as_str())?;
        let n = self.placeholders();
        if n == 0 {
            return rest.is_empty().then(Vec::new);
        }
        let mut values = Vec::with_capacity(n);
        for (i, lit) in self.literals[1..].iter().enumerate() {
            if i + 1 == n {
                let value = rest.strip_suffix(lit.as_str())?;
                if value.is_empty() {
                    return None;
                }
                values.push(value.to_string());
                return Some(values);
            }
            let at = rest.get(1..)?.find(lit.as_str())? + 1;
            values.push(rest[..at].to_string());
            rest = &rest[at + lit.len()..];
        }
        None
    }
}

/// Parses a duration such as `"500ms"`, `"30s"`, `"15m"`, `"1h"` or `"1d"` into
/// milliseconds.
pub fn parse_duration_ms(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    let (num, unit) = t.split_at(digits);
    let n: u64 = num.parse().map_err(|_| format!("{text:?} is not a duration such as \"30s\" or \"1h\""))?;
    let scale = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(format!("{text:?}: the unit must be ms, s, m, h or d")),
    };
    n.checked_mul(scale).ok_or_else(|| format!("{text:?} is too long"))
}

/// Parses a UTC time of day `"HH:MM"` or `"HH:MM:SS"` into milliseconds after midnight.
pub fn parse_time_of_day_ms(text: &str) -> Result<u64, String> {
    let bad = || format!("{text:?} is not a UTC time of day such as \"03:00\"");
    let parts: Vec<&str> = text.split(':').collect();
    if !(2..=3).contains(&parts.len()) || parts.iter().any(|p| p.len() != 2) {
        return Err(bad());
    }
    let nums: Vec<u64> =
        parts.iter().map(|p| p.parse::<u64>().map_err(|_| bad())).collect::<Result<_, _>>()?;
    let (h, m, s) = (nums[0], nums[1], nums.get(2).copied().unwrap_or(0));
    if h > 23 || m > 59 || s > 59 {
        return Err(bad());
    }
    Ok(((h * 60 + m) * 60 + s) * 1_000)
}

impl SourceConfig {
    /// The schedule, once validated.
    pub fn schedule(&self) -> Result<Schedule, String> {
        let every_ms = parse_duration_ms(&self.every)?;
        let offset_ms = match (&self.at, &self.offset) {
            (Some(_), Some(_)) => return Err("give `at` or `offset`, not both".into()),
            (Some(at), None) => parse_time_of_day_ms(at)?,
            (None, Some(off)) => parse_duration_ms(off)?,
            (None, None) => 0,
        };
        Ok(Schedule { every_ms, offset_ms })
    }

    /// The counter pattern, once validated.
    pub fn pattern(&self) -> Result<Pattern, String> {
        Pattern::parse(&self.counters)
    }

    /// Checks the section; `at` is its index in `[[reconcile]]` for the messages.
    pub fn validate(&self, at: usize) -> Result<(), SourceConfigError> {
        let err = |field: &str, reason: String| SourceConfigError {
            field: format!("reconcile[{at}].{field}"),
            reason,
        };
        check_token("source name", &self.name, SOURCE_NAME_LEN_MAX)
            .map_err(|e| err("name", e.to_string()))?;
        self.pattern().map_err(|e| err("counters", e))?;
        let every_ms = parse_duration_ms(&self.every).map_err(|e| err("every", e))?;
        if !(EVERY_MS_MIN..=EVERY_MS_MAX).contains(&every_ms) {
            return Err(err("every", format!("must be between {EVERY_MS_MIN} ms and {EVERY_MS_MAX} ms")));
        }
        let field = if self.at.is_some() { "at" } else { "offset" };
        let schedule = self.schedule().map_err(|e| err(field, e))?;
        if schedule.offset_ms >= schedule.every_ms {
            return Err(err(field, format!("must be less than `every` ({every_ms} ms)")));
        }
        match (&self.postgres, &self.event_log) {
            (Some(pg), None) => pg.validate().map_err(|(f, r)| err(&format!("postgres.{f}"), r)),
            (None, Some(log)) => {
                if log.dir.as_os_str().is_empty() {
                    return Err(err("event_log.dir", "must not be empty".into()));
                }
                Ok(())
            }
            _ => Err(err(
                "postgres",
                "give exactly one of [reconcile.postgres] or [reconcile.event_log]".into(),
            )),
        }
    }
}

impl PostgresSource {
    fn validate(&self) -> Result<(), (&'static str, String)> {
        let params = super::pg_tls::TlsParams::split(&self.url).map_err(|e| ("url", e))?;
        params
            .url
            .parse::<tokio_postgres::Config>()
            .map_err(|e| ("url", format!("not a connection string: {e}")))?;
        if self.query.trim().is_empty() || self.query.len() > PG_QUERY_BYTES_MAX {
            return Err(("query", format!("must be 1 to {PG_QUERY_BYTES_MAX} bytes")));
        }
        let ranges = [
            ("connect_timeout_ms", self.connect_timeout_ms, PG_CONNECT_TIMEOUT_MS_MAX),
            ("query_timeout_ms", self.query_timeout_ms, PG_QUERY_TIMEOUT_MS_MAX),
            ("pool_size", self.pool_size, PG_POOL_SIZE_MAX),
        ];
        for (field, got, max) in ranges {
            if !(1..=max).contains(&got) {
                return Err((field, format!("must be between 1 and {max} (got {got})")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_and_capture() {
        let p = Pattern::parse("likes:{id}").unwrap();
        assert_eq!((p.prefix(), p.placeholders()), ("likes:", 1));
        assert_eq!(p.matches("likes:42"), Some(vec!["42".into()]));
        assert_eq!(p.matches("likes:"), None);
        assert_eq!(p.matches("views:42"), None);
        let p = Pattern::parse("t:{tenant}:q:{item}.v").unwrap();
        assert_eq!(p.matches("t:a:b:q:7.v"), Some(vec!["a:b".into(), "7".into()]));
        assert_eq!(p.matches("t:a:q:7"), None);
        let exact = Pattern::parse("credits:7").unwrap();
        assert_eq!(exact.matches("credits:7"), Some(vec![]));
        assert_eq!(exact.matches("credits:77"), None);
        for bad in ["x{", "x}", "{}", "a{b}{c}", "a {b}", "{a-b}"] {
            assert!(Pattern::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations_times_and_schedules() {
        assert_eq!(parse_duration_ms("1h"), Ok(3_600_000));
        assert_eq!(parse_duration_ms("250ms"), Ok(250));
        assert!(parse_duration_ms("1 hour").is_err());
        assert!(parse_duration_ms("h").is_err());
        assert!(parse_duration_ms("99999999999999999d").is_err());
        assert_eq!(parse_time_of_day_ms("03:00"), Ok(3 * 3_600_000));
        assert!(parse_time_of_day_ms("24:00").is_err());
        assert!(parse_time_of_day_ms("3:00").is_err());
        let s = Schedule { every_ms: 86_400_000, offset_ms: 3 * 3_600_000 };
        let day = 20_000 * 86_400_000;
        assert_eq!(s.next_after(day), day + 3 * 3_600_000);
        assert_eq!(s.next_after(day + 3 * 3_600_000), day + 86_400_000 + 3 * 3_600_000);
        assert_eq!(s.next_after(day + 5 * 3_600_000), day + 86_400_000 + 3 * 3_600_000);
    }

    fn source() -> SourceConfig {
        SourceConfig {
            name: "likes-db".into(),
            counters: "likes:{id}".into(),
            every: "1d".into(),
            at: Some("03:00".into()),
            offset: None,
            postgres: Some(PostgresSource {
                url: "postgres://tally@127.0.0.1:5432/app".into(),
                query: "SELECT count(*) FROM likes WHERE post_id = $1".into(),
                connect_timeout_ms: 5_000,
                query_timeout_ms: 30_000,
                pool_size: 4,
            }),
            event_log: None,
        }
    }

    #[test]
    fn sections_are_validated_with_the_field_named() {
        assert_eq!(source().validate(0), Ok(()));
        type Mutation = Box<dyn Fn(&mut SourceConfig)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("reconcile[0].name", Box::new(|s| s.name = "has space".into())),
            ("reconcile[0].counters", Box::new(|s| s.counters = "likes:{".into())),
            ("reconcile[0].every", Box::new(|s| s.every = "10ms".into())),
            ("reconcile[0].every", Box::new(|s| s.every = "soon".into())),
            ("reconcile[0].at", Box::new(|s| s.every = "1h".into())),
            ("reconcile[0].at", Box::new(|s| s.offset = Some("5m".into()))),
            ("reconcile[0].postgres", Box::new(|s| s.postgres = None)),
            ("reconcile[0].postgres", Box::new(|s| s.event_log = Some(EventLogSource { dir: "/x".into() }))),
            ("reconcile[0].postgres.url", Box::new(|s| s.postgres.as_mut().unwrap().url = "x=".into())),
            ("reconcile[0].postgres.pool_size", Box::new(|s| s.postgres.as_mut().unwrap().pool_size = 0)),
            ("reconcile[0].postgres.query", Box::new(|s| s.postgres.as_mut().unwrap().query = " ".into())),
        ];
        for (field, mutate) in cases {
            let mut s = source();
            mutate(&mut s);
            let e = s.validate(0).expect_err(field);
            assert_eq!(e.field, field, "{e}");
        }
    }
}
