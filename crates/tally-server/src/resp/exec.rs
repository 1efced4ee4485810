//! Running one parsed [`Command`] against the [`Service`]: the same service calls
//! the HTTP handlers make, with the answers shaped as Redis replies. Connection
//! state (protocol, name, id) lives in the [`Session`]; figures every connection
//! shares live in [`Front`].

use super::auth;
use super::command::{docs_entry, info_entry, lookup, CommandQuery, CommandSpec, COMMANDS};
use super::wire::{Proto, Reply};
use crate::auth::{Gate, Principal};
use crate::config::RespConfig;
use crate::http::error::ApiError;
use crate::service::{reconcile_recorded, IncrTotal, Service};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tally_engine::{AutoPatch, Consistency, Increment, SpecPatch, TallyError, ValueRead};

use super::command::{Command, IncrExArgs, NamespaceOp, SetArgs, TtlChange};

/// An auto counter's bounds and last change, for `TALLY.SHARDS`.
fn auto_reply(a: &tally_engine::AutoStatus) -> Reply {
    let change = |c: &tally_engine::AutoChange| {
        Reply::map([
            ("from", Reply::Int(c.from.into())),
            ("to", Reply::Int(c.to.into())),
            ("reason", Reply::text(c.reason.as_str())),
            ("proposed_at_ms", Reply::Big(c.proposed_at_ms.into())),
        ])
    };
    Reply::map([
        ("min_shards", Reply::Int(a.bounds.min_shards.into())),
        ("max_shards", Reply::Int(a.bounds.max_shards.into())),
        ("last_change", a.last_change.as_ref().map_or(Reply::Null, change)),
        ("queue_depth_max", Reply::Int(a.figures.map_or(0, |f| f.queue_depth_max).into())),
        ("rate_per_shard", Reply::Big(a.figures.map_or(0, |f| f.rate_per_shard).into())),
    ])
}

/// The code of a read (or an increment's total) some shards did not answer: the
/// partial sum is never given as a value; `TALLY.GET` shows it with the shards.
pub const INCOMPLETE: &str = "incomplete";
/// The code of `PFADD` to a counter created without `distinct`.
pub const NOT_DISTINCT: &str = "not_distinct";

/// What every connection of one RESP listener shares.
#[derive(Debug)]
pub struct Front {
    /// This node's id, for `INFO`.
    pub node_id: String,
    /// The address served, for `INFO`.
    pub addr: SocketAddr,
    /// The limits connections run under.
    pub limits: RespConfig,
    /// How long one command may take (`http.request_timeout_ms`, shared with HTTP).
    pub command_timeout: Duration,
    /// When the listener started, for `INFO`'s uptime.
    pub started: Instant,
    /// Connections open now.
    pub connected: AtomicU64,
    /// Connections accepted since the start.
    pub accepted: AtomicU64,
    /// Connections refused for `resp.connections_max`.
    pub rejected: AtomicU64,
    /// Commands run since the start.
    pub commands: AtomicU64,
    /// The last connection id handed out (ids start at 1).
    pub last_id: AtomicU64,
    /// The node's tokens, audit trail and auth metrics (shared with HTTP).
    pub gate: Arc<Gate>,
    /// The open connections (`CLIENT LIST`, `CLIENT KILL`).
    pub clients: Arc<super::registry::Clients>,
    /// `SCAN`'s cursors, shared by every connection.
    pub scans: parking_lot::Mutex<super::registry::ScanCursors>,
    /// `GET`s that found their counter (`INFO`'s `keyspace_hits`).
    pub keyspace_hits: AtomicU64,
    /// `GET`s that found none (`keyspace_misses`).
    pub keyspace_misses: AtomicU64,
}

impl Front {
    /// A listener's shared state.
    pub fn new(
        node_id: String,
        addr: SocketAddr,
        limits: RespConfig,
        command_timeout: Duration,
        gate: Arc<Gate>,
    ) -> Self {
        Self {
            gate,
            node_id,
            addr,
            limits,
            command_timeout,
            started: Instant::now(),
            clients: Default::default(),
            scans: Default::default(),
            keyspace_hits: AtomicU64::new(0),
            keyspace_misses: AtomicU64::new(0),
            connected: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            commands: AtomicU64::new(0),
            last_id: AtomicU64::new(0),
        }
    }
}

/// Most commands one transaction queues (`MULTI` … `EXEC`). A pipeline is answered
/// as it is read, but a transaction is held whole until `EXEC`, so this bounds what
/// one connection keeps in memory (each command at most `resp.request_bytes_max`).
/// A command beyond it is refused, which discards the transaction at `EXEC`.
pub const MULTI_COMMANDS_MAX: usize = 16_384;

/// Redis's answer to `EXEC` after a command was refused while queued.
pub const EXECABORT: &str = "EXECABORT Transaction discarded because of previous errors.";

/// Redis's answer to a command queued inside `MULTI`.
pub const QUEUED: &str = "QUEUED";

/// A command queued by `MULTI`, run by `EXEC`.
#[derive(Debug, Clone, PartialEq)]
pub enum Queued {
    /// A command to run, with its audit name.
    Run(&'static str, Command),
    /// A command whose arguments were refused when it was parsed (not an integer, a
    /// syntax error): Redis finds those when it runs the command, so `EXEC` answers
    /// this error in its place and runs the others.
    Failed(Reply),
}

/// A transaction being queued (`MULTI` … `EXEC`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Transaction {
    /// The commands queued, in order.
    pub queued: Vec<Queued>,
    /// A command was refused while queueing (unknown, wrong arity, not permitted,
    /// one too many): `EXEC` discards the transaction with `EXECABORT`.
    pub aborted: bool,
}

/// Most counters a connection remembers writing, for `WAIT`: a connection that
/// writes more is answered for the last ones.
pub const WAIT_TRACKED_COUNTERS_MAX: usize = 64;

/// One connection's state.
#[derive(Debug, Clone)]
pub struct Session {
    /// Its id (`CLIENT ID`, `HELLO`'s `id`).
    pub id: u64,
    /// The protocol replies are encoded in.
    pub proto: Proto,
    /// `CLIENT SETNAME`'s name.
    pub name: Option<Vec<u8>>,
    /// `CLIENT SETINFO lib-name`.
    pub lib_name: Option<Vec<u8>>,
    /// `CLIENT SETINFO lib-ver`.
    pub lib_ver: Option<Vec<u8>>,
    /// Who the connection runs as: `None` until `AUTH` on a node with tokens.
    pub principal: Option<Arc<Principal>>,
    /// The gate's token generation `principal` was decided under
    /// ([`crate::auth::Gate::generation`]).
    pub auth_generation: u64,
    /// The transaction being queued, between `MULTI` and `EXEC` or `DISCARD`.
    pub multi: Option<Transaction>,
    /// Its place in the listener's registry (`CLIENT LIST`); `None` for a session
    /// made without one (tests).
    pub client: Option<Arc<super::registry::ClientGuard>>,
    /// The counters it incremented last, for `WAIT` (at most
    /// [`WAIT_TRACKED_COUNTERS_MAX`], the most recent kept).
    pub written: std::collections::VecDeque<String>,
}

impl Session {
    /// A new RESP2 connection, running as `principal` (see [`auth::initial`]).
    pub fn new(id: u64, principal: Option<Arc<Principal>>) -> Self {
        Self {
            id,
            proto: Proto::Resp2,
            name: None,
            lib_name: None,
            lib_ver: None,
            principal,
            auth_generation: 0,
            multi: None,
            client: None,
            written: Default::default(),
        }
    }

    /// A new connection `id` from `peer`, registered with `front` for its life.
    pub fn connected(front: &Front, id: u64, peer: SocketAddr, principal: Option<Arc<Principal>>) -> Self {
        let guard = super::registry::ClientGuard::register(&front.clients, id, peer, front.addr);
        Self { client: Some(Arc::new(guard)), ..Self::new(id, principal) }
    }

    /// Copies the name, library and protocol into the registry (`CLIENT LIST`).
    fn mirror(&self) {
        if let Some(c) = &self.client {
            *c.record.names.lock() = (self.name.clone(), self.lib_name.clone(), self.lib_ver.clone());
            c.record.resp.store(self.proto.number() as u8, Ordering::Relaxed);
        }
    }

    /// Resolves once `CLIENT KILL` chose this connection (never, without a record).
    pub async fn killed(&self) {
        match &self.client {
            Some(c) => c.record.killed().await,
            None => std::future::pending().await,
        }
    }

    /// Notes the counters a run of increments wrote (for `WAIT`), and the command.
    pub fn note_written(&mut self, incrs: &[Option<(String, i64)>]) {
        for (key, _) in incrs.iter().flatten() {
            if !self.written.contains(key) {
                if self.written.len() >= WAIT_TRACKED_COUNTERS_MAX {
                    self.written.pop_front();
                }
                self.written.push_back(key.clone());
            }
        }
        if let Some(c) = &self.client {
            c.record.seen("INCR");
        }
    }

    /// Whether commands are being queued (after `MULTI`): increments then queue
    /// like every other command instead of running at once.
    pub fn queueing(&self) -> bool {
        self.multi.is_some()
    }

    /// The reply to a command refused before it ran (`refusal`: parsing or
    /// admission). Inside `MULTI`, Redis refuses at queueing time what it can tell
    /// without running the command — an unknown command or subcommand, a wrong
    /// number of arguments, a missing permission — and then discards the whole
    /// transaction at `EXEC`; what it finds only when running (a value that is not
    /// an integer, a syntax error in the options) is queued and answered in its
    /// place by `EXEC`. `admission` says the refusal came from the token gate.
    pub fn refused(&mut self, refusal: Reply, admission: bool) -> Reply {
        let Some(tx) = self.multi.as_mut() else { return refusal };
        let at_queueing = admission
            || matches!(&refusal, Reply::Error(e)
                if e.starts_with("ERR unknown command")
                    || e.starts_with("ERR unknown subcommand")
                    || e.starts_with("ERR wrong number of arguments"));
        if at_queueing || tx.queued.len() >= MULTI_COMMANDS_MAX {
            tx.aborted = true;
            return refusal;
        }
        tx.queued.push(Queued::Failed(refusal));
        Reply::Simple(QUEUED.into())
    }
}

/// What the connection does after a reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Reads the next command.
    Continue,
    /// Writes the reply, then closes (`QUIT`).
    Close,
}

/// An engine error as a reply: `ERR <code> <message>`, the code and message the
/// HTTP error body carries.
pub fn engine_error(e: TallyError) -> Reply {
    let api = ApiError::from(e);
    Reply::err(&api.code, api.message)
}

/// A counter's value as `GET` answers it: a bulk string of its decimal digits, as
/// Redis stores an integer (clients that decode `GET` as text, or parse it, work
/// unchanged).
pub fn value_bulk(value: i128) -> Reply {
    Reply::Bulk(value.to_string().into_bytes())
}

/// `GET key`: the total as this node's `INCR` answers see it, so a client reads its
/// own increments; nil for an unknown counter; an error rather than a partial sum.
async fn get<S: Service>(svc: &S, key: &str) -> Reply {
    match svc.current_total(key).await {
        Ok(IncrTotal::Total(total)) => value_bulk(total.value),
        Ok(IncrTotal::Incomplete(missing)) => Reply::err(
            INCOMPLETE,
            format!("shards {missing:?} did not answer, so the total is unknown (TALLY.GET shows the partial sum)"),
        ),
        Err(TallyError::NotFound(_)) => Reply::Null,
        Err(e) => engine_error(e),
    }
}

fn shards_reply(missing: &[u16]) -> Reply {
    Reply::Array(missing.iter().map(|&s| Reply::Int(s.into())).collect())
}

/// `TALLY.GET`'s answer: the same fields as the HTTP value read.
pub fn read_reply(read: &ValueRead) -> Reply {
    let consistency = match read.consistency {
        Consistency::Cached => "cached",
        Consistency::Fresh => "fresh",
    };
    Reply::map([
        ("value", Reply::Big(read.value)),
        ("consistency", Reply::text(consistency)),
        ("as_of_ms", Reply::Big(read.as_of_ms.into())),
        ("staleness_ms", Reply::Big(read.staleness_ms.into())),
        ("complete", Reply::Bool(read.complete)),
        ("missing_shards", shards_reply(&read.missing_shards)),
    ])
}

/// `TALLY.WINDOW`'s answer: the same fields as the HTTP window read (`estimate` and
/// `relative_error` only for a counter with `distinct`).
pub fn window_reply(read: &tally_engine::WindowRead) -> Reply {
    let mut fields = vec![
        ("window", Reply::text(read.window.clone())),
        ("window_ms", Reply::Big(read.window_ms.into())),
        ("bucket_ms", Reply::Big(read.bucket_ms.into())),
        ("start_ms", Reply::Big(read.start_ms.into())),
        ("end_ms", Reply::Big(read.end_ms.into())),
        ("value", Reply::Big(read.value)),
    ];
    if let (Some(limit), Some(remaining)) = (read.limit, read.remaining) {
        fields.push(("limit", Reply::Big(limit.into())));
        fields.push(("remaining", Reply::Big(remaining.into())));
    }
    if let (Some(estimate), Some(error)) = (read.estimate, read.relative_error) {
        fields.push(("estimate", Reply::Big(estimate.into())));
        fields.push(("relative_error", Reply::Double(error)));
    }
    fields.extend([
        ("window_bytes", Reply::Big(read.window_bytes.into())),
        ("window_bytes_bound", Reply::Big(read.window_bytes_bound.into())),
        ("complete", Reply::Bool(read.complete)),
        ("missing_shards", shards_reply(&read.missing_shards)),
    ]);
    Reply::Map(fields.into_iter().map(|(k, v)| (Reply::text(k), v)).collect())
}

fn hello_reply(session: &Session) -> Reply {
    Reply::map([
        ("server", Reply::text("tally")),
        ("version", Reply::text(env!("CARGO_PKG_VERSION"))),
        ("proto", Reply::Int(session.proto.number())),
        ("id", Reply::Big(session.id.into())),
        ("mode", Reply::text("standalone")),
        ("role", Reply::text("master")),
        ("modules", Reply::Array(Vec::new())),
    ])
}

/// The Redis version whose commands and replies this front end follows: what
/// `INFO`'s `redis_version` says, so clients that check it enable what Tally serves.
pub const REDIS_VERSION: &str = "7.2.0";

/// The resident memory of this process in bytes (Linux's `/proc/self/statm`), or 0.
fn resident_bytes() -> u64 {
    let Ok(statm) = std::fs::read_to_string("/proc/self/statm") else { return 0 };
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    pages * 4096
}

/// `INFO [section]`: Redis's sections with Tally's figures (`tally_*` fields for
/// what Redis has no word for).
async fn info_text<S: Service>(svc: &S, front: &Front, section: Option<&str>) -> String {
    let all = matches!(section, None | Some("all" | "default" | "everything"));
    let want = |name: &str| all || section == Some(name);
    let tally = svc.engine();
    let mut out = String::new();
    if want("server") {
        let uptime = front.started.elapsed().as_secs();
        out += &format!(
            "# Server\r\nredis_version:{REDIS_VERSION}\r\nredis_mode:standalone\r\nos:{}\r\narch_bits:64\r\n\
             process_id:{}\r\ntcp_port:{}\r\nuptime_in_seconds:{uptime}\r\nuptime_in_days:{}\r\n\
             tally_version:{}\r\nnode_id:{}\r\nresp_protocols:2,3\r\n\r\n",
            std::env::consts::OS,
            std::process::id(),
            front.addr.port(),
            uptime / 86_400,
            env!("CARGO_PKG_VERSION"),
            front.node_id,
        );
    }
    if want("clients") {
        out += &format!(
            "# Clients\r\nconnected_clients:{}\r\nmaxclients:{}\r\nblocked_clients:0\r\n\r\n",
            front.connected.load(Ordering::Relaxed),
            front.limits.connections_max,
        );
    }
    if want("memory") {
        let rss = resident_bytes();
        out += &format!("# Memory\r\nused_memory:{rss}\r\nused_memory_rss:{rss}\r\nmaxmemory:0\r\n\r\n");
    }
    if want("stats") {
        let stats = tally.stats();
        out += &format!(
            "# Stats\r\ntotal_connections_received:{}\r\nrejected_connections:{}\r\n\
             total_commands_processed:{}\r\nkeyspace_hits:{}\r\nkeyspace_misses:{}\r\nexpired_keys:{}\r\n\
             tally_increments_sync:{}\r\ntally_increments_batched:{}\r\ntally_dedup_hits:{}\r\n\r\n",
            front.accepted.load(Ordering::Relaxed),
            front.rejected.load(Ordering::Relaxed),
            front.commands.load(Ordering::Relaxed),
            front.keyspace_hits.load(Ordering::Relaxed),
            front.keyspace_misses.load(Ordering::Relaxed),
            stats.expired_reclaimed.get(),
            stats.increments_sync.get(),
            stats.increments_batched.get(),
            stats.dedup_hits.get(),
        );
    }
    if want("replication") {
        let view = svc.cluster().await;
        let up = view.nodes.iter().filter(|n| n.state == crate::service::NodeState::Up).count();
        out += &format!(
            "# Replication\r\nrole:master\r\nconnected_slaves:0\r\nmaster_failover_state:no-failover\r\n\
             tally_nodes:{}\r\ntally_nodes_up:{up}\r\ntally_metadata_leader:{}\r\ntally_term:{}\r\n\
             tally_shard_copies:{}\r\n\r\n",
            view.nodes.len(),
            view.leader.as_deref().unwrap_or(""),
            view.term,
            tally.copies_of(None),
        );
    }
    if want("keyspace") {
        // Every counter is in database 0; avg_ttl is not kept.
        if let Ok((keys, expires)) = tally.count_counters() {
            let (active, shards) = tally.active();
            out += &format!(
                "# Keyspace\r\ndb0:keys={keys},expires={expires},avg_ttl=0\r\n\
                 tally_active_counters:{active}\r\ntally_running_shards:{shards}\r\n\r\n"
            );
        }
    }
    out
}

fn command_info(names: &[String], entry: fn(&CommandSpec) -> Reply, as_map: bool) -> Reply {
    let chosen: Vec<Option<&CommandSpec>> = if names.is_empty() {
        COMMANDS.iter().map(Some).collect()
    } else {
        names.iter().map(|n| lookup(n.as_bytes())).collect()
    };
    if as_map {
        Reply::Map(chosen.into_iter().flatten().map(|c| (Reply::text(c.name), entry(c))).collect())
    } else {
        Reply::Array(chosen.into_iter().map(|c| c.map_or(Reply::Null, entry)).collect())
    }
}

/// The error of an increment that was counted but whose total cannot be given.
fn counted_incomplete(missing: &[u16]) -> Reply {
    Reply::err(
        INCOMPLETE,
        format!(
            "the increment was counted, but shards {missing:?} did not answer the read its total needs: \
             do not retry it"
        ),
    )
}

/// An increment's reply: the new total (`INCR`) or applied/duplicate (`TALLY.INCRBY`;
/// with `WITHVALUE`, also the total and whether it is exact). These run concurrently
/// within a pipeline, so they touch no session state.
pub async fn run_increment<S: Service>(svc: &S, cmd: Command) -> Reply {
    match cmd {
        // Redis answers `INCRBY key 0` with the value, changing nothing.
        Command::Incr { key, delta: 0 } => match svc.current_total(&key).await {
            Ok(IncrTotal::Total(total)) => Reply::Big(total.value),
            Ok(IncrTotal::Incomplete(missing)) => counted_incomplete(&missing),
            Err(TallyError::NotFound(_)) => Reply::Int(0),
            Err(e) => engine_error(e),
        },
        Command::Incr { key, delta } => match svc.incr_total(&key, Increment::new(delta)).await {
            Ok((_, IncrTotal::Total(total))) => Reply::Big(total.value),
            Ok((_, IncrTotal::Incomplete(missing))) => counted_incomplete(&missing),
            Err(TallyError::Overflow(o)) => {
                Reply::Error(format!("ERR increment or decrement would overflow ({o})"))
            }
            Err(e) => engine_error(e),
        },
        Command::TallyIncrBy { key, inc, with_value: false } => match svc.incr(&key, *inc).await {
            Ok(o) if o.applied => Reply::Simple("applied".into()),
            Ok(_) => Reply::Simple("duplicate".into()),
            Err(e) => engine_error(e),
        },
        Command::TallyIncrBy { key, inc, with_value: true } => match svc.incr_total(&key, *inc).await {
            Ok((o, IncrTotal::Total(total))) => Reply::map([
                ("outcome", Reply::text(if o.applied { "applied" } else { "duplicate" })),
                ("value", Reply::Big(total.value)),
                ("exact", Reply::Bool(total.exact)),
            ]),
            Ok((_, IncrTotal::Incomplete(missing))) => counted_incomplete(&missing),
            Err(e) => engine_error(e),
        },
        other => Reply::err("internal", format!("not an increment: {other:?}")),
    }
}

/// The counter and delta of an `INCR`-family command, whose answer takes its place
/// among the run's ([`order_answers`]).
pub fn answered_increment(cmd: &Command) -> Option<(String, i64)> {
    match cmd {
        Command::Incr { key, delta } => Some((key.clone(), *delta)),
        // Named for `WAIT`; a delta of 0 keeps its counter's answers where they are.
        Command::TallyIncrBy { key, .. } => Some((key.clone(), 0)),
        _ => None,
    }
}

/// Puts the answers of a pipeline's run of increments in the order the client sent
/// them. The run's increments are counted concurrently (one group commit on a
/// `sync` counter), so the totals they were answered with come in the order their
/// answers were computed, not sent; a client reads a pipeline as if each command
/// ran after the one before. Per counter (`incrs[i]` names command `i`'s, `None` for
/// other commands), once every one of its increments in the run answered a total:
///
/// * all deltas equal and the totals distinct (a `sync` counter of one shard: the
///   values the shard gave them; a buffered run: the ledger's, already in order):
///   the same totals, sorted the delta's way, so ids issued stay unique;
/// * otherwise, deltas of one sign: counted back from the furthest total, which
///   includes the whole run — the total after command `i` is that total less the
///   deltas sent after `i`: each answer includes its increment and every one sent
///   before it, as Redis's would.
///
/// Mixed signs, or an increment that failed, leave the counter's answers as they are.
pub fn order_answers(incrs: &[Option<(String, i64)>], replies: &mut [Reply]) {
    let mut keys: Vec<&str> = incrs.iter().flatten().map(|(k, _)| k.as_str()).collect();
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        let at: Vec<usize> =
            (0..incrs.len()).filter(|&i| incrs[i].as_ref().is_some_and(|(k, _)| k == key)).collect();
        if at.len() < 2 {
            continue;
        }
        let deltas: Vec<i64> = at.iter().map(|&i| incrs[i].as_ref().map_or(0, |(_, d)| *d)).collect();
        let Some(mut totals) = at
            .iter()
            .map(|&i| match replies[i] {
                Reply::Big(v) => Some(v),
                _ => None,
            })
            .collect::<Option<Vec<i128>>>()
        else {
            continue;
        };
        let up = deltas.iter().all(|d| *d > 0);
        if !up && !deltas.iter().all(|d| *d < 0) {
            continue;
        }
        let mut distinct = totals.clone();
        distinct.sort_unstable();
        distinct.dedup();
        if deltas.iter().all(|d| *d == deltas[0]) && distinct.len() == totals.len() {
            totals = distinct;
            if !up {
                totals.reverse();
            }
        } else {
            let last = if up { distinct[distinct.len() - 1] } else { distinct[0] };
            let mut after = 0i128;
            for (slot, d) in totals.iter_mut().zip(&deltas).rev() {
                *slot = last - after;
                after += i128::from(*d);
            }
        }
        for (&i, total) in at.iter().zip(totals) {
            replies[i] = Reply::Big(total);
        }
    }
}

/// Queues `cmd` (named `op`) in the transaction being queued.
fn queue(tx: &mut Transaction, op: &'static str, cmd: Command) -> Reply {
    if tx.queued.len() >= MULTI_COMMANDS_MAX {
        tx.aborted = true;
        return Reply::Error(format!(
            "ERR a transaction queues at most {MULTI_COMMANDS_MAX} commands; it will be discarded at EXEC"
        ));
    }
    tx.queued.push(Queued::Run(op, cmd));
    Reply::Simple(QUEUED.into())
}

/// `EXEC` of a transaction that was queued whole: every command in order, each
/// admitted again (tokens may have been reloaded meanwhile), a reply each. A run of
/// consecutive increments is counted concurrently, as in a pipeline, and answered
/// in the order queued. A command that closes the connection is not queued
/// (`QUIT` runs at once), so the transaction always runs to its end.
async fn exec_queued<S: Service>(
    svc: &S,
    front: &Front,
    session: &mut Session,
    queued: Vec<Queued>,
) -> Vec<Reply> {
    let gate = &front.gate;
    let mut replies = Vec::with_capacity(queued.len());
    let mut queued = queued.into_iter().peekable();
    while let Some(next) = queued.next() {
        let (op, cmd) = match next {
            Queued::Failed(reply) => {
                replies.push(reply);
                continue;
            }
            Queued::Run(op, cmd) => (op, cmd),
        };
        if let Err(refused) = auth::admit(gate, session.principal.as_deref(), op, &cmd) {
            replies.push(refused);
            continue;
        }
        if cmd.is_increment() {
            let mut run = vec![cmd];
            while let Some(Queued::Run(op, c)) = queued.peek() {
                if !c.is_increment() {
                    break;
                }
                let admitted = auth::admit(gate, session.principal.as_deref(), op, c);
                if admitted.is_err() {
                    break;
                }
                let Some(Queued::Run(_, c)) = queued.next() else { break };
                run.push(c);
            }
            let incrs: Vec<_> = run.iter().map(answered_increment).collect();
            let mut answers = futures::future::join_all(run.into_iter().map(|c| run_increment(svc, c))).await;
            order_answers(&incrs, &mut answers);
            session.note_written(&incrs);
            replies.extend(answers);
            continue;
        }
        let admin = auth::admin_op(&cmd).map(|_| cmd.clone());
        let (reply, _) = Box::pin(run(svc, front, session, op, cmd)).await;
        if let Some(cmd) = admin {
            auth::audit_admin(gate, session.principal.as_deref(), op, &cmd, &reply);
        }
        replies.push(reply);
    }
    replies
}

/// Runs `cmd` (named `op`, for the audit trail), answering its reply and whether the
/// connection goes on. Inside `MULTI` it is queued instead, except for what
/// controls the transaction and `QUIT`.
pub async fn run<S: Service>(
    svc: &S,
    front: &Front,
    session: &mut Session,
    op: &'static str,
    cmd: Command,
) -> (Reply, Flow) {
    if let Some(c) = &session.client {
        c.record.seen(op);
    }
    if let Some(tx) = session.multi.as_mut() {
        match cmd {
            Command::Multi => {
                return (Reply::Error("ERR MULTI calls can not be nested".into()), Flow::Continue)
            }
            Command::Watch(_) => {
                return (Reply::Error("ERR WATCH inside MULTI is not allowed".into()), Flow::Continue)
            }
            Command::Exec | Command::Discard | Command::Quit => {}
            other => return (queue(tx, op, other), Flow::Continue),
        }
    }
    let reply = match cmd {
        Command::Quit => return (Reply::ok(), Flow::Close),
        Command::Multi => {
            session.multi = Some(Transaction::default());
            Reply::ok()
        }
        Command::Discard => match session.multi.take() {
            Some(_) => Reply::ok(),
            None => Reply::Error("ERR DISCARD without MULTI".into()),
        },
        Command::Exec => match session.multi.take() {
            None => Reply::Error("ERR EXEC without MULTI".into()),
            Some(tx) if tx.aborted => Reply::Error(EXECABORT.into()),
            Some(tx) => Reply::Array(exec_queued(svc, front, session, tx.queued).await),
        },
        Command::Watch(_) => Reply::Error(
            "ERR WATCH is not supported: counters change without a lock, so nothing can be watched; \
             a transaction's increments are safe to retry with TALLY.INCRBY key delta ID event-id"
                .into(),
        ),
        Command::Unwatch => Reply::ok(),
        Command::Ping(None) => Reply::Simple("PONG".into()),
        Command::Ping(Some(m)) | Command::Echo(m) => Reply::Bulk(m),
        Command::Hello { proto, auth: credentials, setname } => {
            let next = match proto {
                None => session.proto,
                Some(2) => Proto::Resp2,
                Some(3) => Proto::Resp3,
                Some(_) => {
                    return (Reply::Error("NOPROTO unsupported protocol version".into()), Flow::Continue)
                }
            };
            match credentials.map(|c| *c) {
                Some((_user, password)) => match auth::authenticate(&front.gate, &password) {
                    Ok(principal) => session.principal = Some(principal),
                    Err(reply) => return (reply, Flow::Continue),
                },
                None if session.principal.is_none() => {
                    return (
                        Reply::Error(
                            "NOAUTH HELLO must be called with the client already authenticated, \
                             otherwise the HELLO <proto> AUTH <user> <pass> option can be used"
                                .into(),
                        ),
                        Flow::Continue,
                    )
                }
                None => {}
            }
            session.proto = next;
            if setname.is_some() {
                session.name = setname;
            }
            session.mirror();
            hello_reply(session)
        }
        Command::Auth { user: _, password } => match auth::authenticate(&front.gate, &password) {
            Ok(principal) => {
                session.principal = Some(principal);
                Reply::ok()
            }
            Err(reply) => reply,
        },
        Command::Select(0) => Reply::ok(),
        Command::Select(_) => Reply::Error("ERR DB index is out of range".into()),
        Command::ClientSetName(name) => {
            session.name = (!name.is_empty()).then_some(name);
            session.mirror();
            Reply::ok()
        }
        Command::ClientGetName => session.name.clone().map_or(Reply::Null, Reply::Bulk),
        Command::ClientSetInfo { attr, value } => {
            if attr == "lib-name" {
                session.lib_name = Some(value);
            } else {
                session.lib_ver = Some(value);
            }
            session.mirror();
            Reply::ok()
        }
        Command::ClientId => Reply::Big(session.id.into()),
        Command::Command(CommandQuery::All) => command_info(&[], info_entry, false),
        Command::Command(CommandQuery::Count) => Reply::Int(COMMANDS.len() as i64),
        Command::Command(CommandQuery::Info(names)) => command_info(&names, info_entry, false),
        Command::Command(CommandQuery::Docs(names)) => command_info(&names, docs_entry, true),
        Command::Info(section) => Reply::text(info_text(svc, front, section.as_deref()).await),
        cmd @ (Command::Incr { .. } | Command::TallyIncrBy { .. }) => run_increment(svc, cmd).await,
        Command::Get(key) => {
            let reply = get(svc, &key).await;
            let counted =
                if matches!(reply, Reply::Null) { &front.keyspace_misses } else { &front.keyspace_hits };
            counted.fetch_add(1, Ordering::Relaxed);
            reply
        }
        Command::PfCount(keys) => match svc.engine().distinct_union(&keys).await {
            Ok(d) if d.complete => Reply::Big(d.estimate.into()),
            Ok(d) => Reply::err(INCOMPLETE, format!("shards {:?} did not answer", d.missing_shards)),
            Err(e) => engine_error(e),
        },
        Command::PfMerge { dest, sources } => {
            // Creating an unknown destination (distinct) needs admin, as PFADD's does.
            let (gate, principal, name) = (&front.gate, session.principal.clone(), dest.clone());
            let may_create = move || super::auth::may_create(gate, principal.as_deref(), &name);
            pfmerge(svc, &dest, &sources, may_create).await
        }
        Command::Scan(args) => scan(svc, front, session, *args).await,
        Command::Keys(pattern) => keys(svc, session, &pattern).await,
        Command::Type(key) => match svc.counter(&key).await {
            Ok(_) => Reply::Simple("string".into()),
            Err(TallyError::NotFound(_)) => Reply::Simple("none".into()),
            Err(e) => engine_error(e),
        },
        Command::DbSize => match svc.engine().count_counters() {
            Ok((n, _)) => Reply::Int(n as i64),
            Err(e) => engine_error(e),
        },
        Command::ConfigGet(patterns) => config_get(front, &patterns),
        Command::ConfigOther(sub) => Reply::Error(format!(
            "ERR CONFIG {} is not supported: a node's settings come from its config file (tallyd --config)",
            sub.to_uppercase()
        )),
        Command::Wait { replicas: _, timeout_ms } => wait(svc, session, timeout_ms).await,
        Command::CmsInit { key, shape } => cms_init(svc, &key, shape).await,
        Command::CmsIncrBy { key, items } => frequency_incr(svc, &key, items, true).await,
        Command::TopkIncrBy { key, items } => frequency_incr(svc, &key, items, false).await,
        Command::CmsInfo(key) => match svc.counter(&key).await {
            Ok(info) => match info.spec.frequency {
                Some(shape) => match svc.top(&key, 1).await {
                    Ok(top) => {
                        let (width, depth) = cms_shape(shape);
                        Reply::map([
                            ("width", Reply::Int(width.into())),
                            ("depth", Reply::Int(depth.into())),
                            ("count", Reply::Big(top.total.into())),
                        ])
                    }
                    Err(e) => engine_error(e),
                },
                None => engine_error(TallyError::FrequencyOff(key)),
            },
            Err(TallyError::NotFound(_)) => Reply::Error("ERR CMS: key does not exist".into()),
            Err(e) => engine_error(e),
        },
        Command::CmsMerge { dest, sources } => match svc.engine().merge_frequencies(&dest, &sources).await {
            Ok(()) => Reply::ok(),
            Err(TallyError::NotFound(_)) => Reply::Error("ERR CMS: key does not exist".into()),
            Err(e) => engine_error(e),
        },
        Command::TopkReserve { key, k } => cms_init(svc, &key, topk_shape(k)).await,
        Command::TopkQuery { key, items, count } => topk_query(svc, &key, items, count).await,
        Command::TopkInfo(key) => match svc.counter(&key).await {
            Ok(info) => match info.spec.frequency {
                Some(shape) => {
                    let (width, depth) = cms_shape(shape);
                    Reply::map([
                        ("k", Reply::Int(reserved_k(shape).into())),
                        ("width", Reply::Int(width.into())),
                        ("depth", Reply::Int(depth.into())),
                        ("decay", Reply::Double(TOPK_DECAY)),
                    ])
                }
                None => engine_error(TallyError::FrequencyOff(key)),
            },
            Err(TallyError::NotFound(_)) => Reply::Error("ERR TopK: key does not exist".into()),
            Err(e) => engine_error(e),
        },
        Command::ClientList => {
            let lines: Vec<String> = front.clients.lock().values().map(|r| r.line()).collect();
            Reply::Bulk((lines.join("\n") + "\n").into_bytes())
        }
        Command::ClientInfo => match &session.client {
            Some(c) => Reply::Bulk((c.record.line() + "\n").into_bytes()),
            None => Reply::Bulk(format!("id={} addr=? db=0\n", session.id).into_bytes()),
        },
        Command::ClientKill(filter) => {
            let me = session.id;
            let killed = super::registry::kill(&front.clients, |r| {
                !(filter.skip_me && r.id == me)
                    && filter.id.is_none_or(|id| id == r.id)
                    && filter.addr.as_deref().is_none_or(|a| a == r.addr.to_string())
            });
            match (filter.old_form, killed) {
                (true, 0) => Reply::Error("ERR No such client".into()),
                (true, _) => Reply::ok(),
                (false, n) => Reply::Int(n as i64),
            }
        }
        Command::MGet(keys) => {
            let mut values = Vec::with_capacity(keys.len());
            for key in keys {
                values.push(get(svc, &key).await);
            }
            Reply::Array(values)
        }
        Command::Exists(keys) => {
            let mut n = 0;
            for key in keys {
                match svc.counter(&key).await {
                    Ok(_) => n += 1,
                    Err(TallyError::NotFound(_)) => {}
                    Err(e) => return (engine_error(e), Flow::Continue),
                }
            }
            Reply::Int(n)
        }
        Command::Del(keys) => {
            let mut n = 0;
            for key in keys {
                match svc.delete_counter(&key).await {
                    Ok(()) => n += 1,
                    Err(TallyError::NotFound(_)) => {}
                    Err(e) => return (engine_error(e), Flow::Continue),
                }
            }
            Reply::Int(n)
        }
        Command::Expire { key, when, cond, name } => {
            let now = svc.engine().now_ms();
            match tally_core::expiry::deadline(when, now) {
                Err(_) => Reply::Error(format!("ERR invalid expire time in '{name}' command")),
                Ok(at) => match svc.expire(&key, at, cond).await {
                    Ok(set) => Reply::Int(set.into()),
                    Err(TallyError::NotFound(_)) => Reply::Int(0),
                    Err(e) => engine_error(e),
                },
            }
        }
        Command::Ttl { key, millis, absolute } => match svc.expiry(&key).await {
            Err(TallyError::NotFound(_)) => Reply::Int(-2),
            Err(e) => engine_error(e),
            Ok((None, _)) => Reply::Int(-1),
            Ok((Some(at), now)) => {
                let at = i64::try_from(at).unwrap_or(i64::MAX);
                Reply::Int(match (absolute, millis) {
                    (true, true) => at,
                    (true, false) => at / 1000,
                    (false, true) => tally_core::expiry::remaining(Some(at as u64), now).millis(),
                    (false, false) => tally_core::expiry::remaining(Some(at as u64), now).seconds(),
                })
            }
        },
        Command::Persist(key) => match svc.persist(&key).await {
            Ok(removed) => Reply::Int(removed.into()),
            Err(TallyError::NotFound(_)) => Reply::Int(0),
            Err(e) => engine_error(e),
        },
        Command::Set { key, set } => set_counter(svc, &key, *set).await,
        Command::IncrEx { key, args } => {
            let reply = increx(svc, &key, *args).await;
            // What it counted may wait in this node's buffer: `WAIT` names it.
            session.note_written(&[Some((key, 0))]);
            reply
        }
        Command::GetDel(key) => {
            let before = get(svc, &key).await;
            if !matches!(before, Reply::Bulk(_)) {
                return (before, Flow::Continue);
            }
            match svc.delete_counter(&key).await {
                Ok(()) => before,
                Err(TallyError::NotFound(_)) => Reply::Null,
                Err(e) => engine_error(e),
            }
        }
        Command::GetEx { key, ttl } => {
            let value = get(svc, &key).await;
            if !matches!(value, Reply::Bulk(_)) {
                return (value, Flow::Continue);
            }
            match change_ttl(svc, &key, ttl).await {
                Ok(()) => value,
                Err(reply) => reply,
            }
        }
        Command::PfAdd { key, members } => {
            // Creating an unknown counter (distinct) needs admin: asked only if it is unknown.
            let (gate, principal, name) = (&front.gate, session.principal.clone(), key.clone());
            let may_create = move || super::auth::may_create(gate, principal.as_deref(), &name);
            pfadd(svc, key, members, may_create).await
        }
        Command::CmsQuery { key, items } => {
            let mut counts = Vec::with_capacity(items.len());
            for item in items {
                match svc.frequency(&key, &item).await {
                    Ok(f) if f.complete => counts.push(Reply::Big(f.estimate.into())),
                    Ok(f) => {
                        return (
                            Reply::err(INCOMPLETE, format!("shards {:?} did not answer", f.missing_shards)),
                            Flow::Continue,
                        )
                    }
                    Err(e) => return (engine_error(e), Flow::Continue),
                }
            }
            Reply::Array(counts)
        }
        Command::TopkList { key, with_count, k } => match topk_k(svc, &key, k).await {
            Err(reply) => reply,
            Ok(k) => match svc.top(&key, k).await {
                Ok(top) if top.complete => Reply::Array(
                    top.items
                        .into_iter()
                        .flat_map(|e| {
                            let count = with_count.then(|| Reply::Big(e.estimate.into()));
                            std::iter::once(Reply::text(e.item)).chain(count)
                        })
                        .collect(),
                ),
                Ok(top) => Reply::err(INCOMPLETE, format!("shards {:?} did not answer", top.missing_shards)),
                Err(e) => engine_error(e),
            },
        },
        Command::TallyGet { key, consistency } => match svc.read(&key, consistency).await {
            Ok(read) => read_reply(&read),
            Err(e) => engine_error(e),
        },
        Command::TallyWindow { key, window } => match svc.window(&key, &window).await {
            Ok(read) => window_reply(&read),
            Err(e) => engine_error(e),
        },
        Command::TallyCreate { key, spec } => {
            let ttl = match spec.ttl_ms.map(|t| crate::http::body::ttl_ms_in_range("ttl_ms", t)).transpose() {
                Ok(ttl) => ttl,
                Err(e) => return (engine_error(e), Flow::Continue),
            };
            let put = match spec.into_patch() {
                Ok((patch, auto)) => svc.put_counter(&key, patch, auto).await,
                Err(e) => Err(e),
            };
            let put = match (put, ttl) {
                (Ok(o), Some(ttl)) => {
                    let at = svc.engine().now_ms().saturating_add(ttl as u64);
                    svc.expire(&key, at, tally_core::expiry::Condition::Always).await.map(|_| o)
                }
                (put, _) => put,
            };
            match put {
                Ok(o) => Reply::Simple(if o.created { "created" } else { "updated" }.into()),
                Err(e) => engine_error(e),
            }
        }
        Command::TallyNamespace(op) => namespace(svc, op).await,
        Command::TallyShards(key) => match svc.shards(&key).await {
            Ok(r) => Reply::map([
                ("generation", Reply::Int(r.generation.into())),
                ("base", Reply::Big(r.base)),
                ("skew", Reply::Double(r.skew)),
                (
                    "shards",
                    Reply::Array(
                        r.shards
                            .iter()
                            .map(|s| {
                                Reply::map([
                                    ("index", Reply::Int(s.index.into())),
                                    ("node", Reply::text(s.node.clone())),
                                    ("value", Reply::Int(s.value)),
                                    ("writes", Reply::Big(s.writes.into())),
                                ])
                            })
                            .collect(),
                    ),
                ),
                ("auto", r.auto.as_ref().map_or(Reply::Null, auto_reply)),
            ]),
            Err(e) => engine_error(e),
        },
        Command::TallyReconcile { key, authoritative } => {
            match reconcile_recorded(svc, &key, authoritative).await {
                Ok(r) => Reply::map([
                    ("before", Reply::Big(r.before)),
                    ("drift", Reply::Big(r.drift)),
                    ("corrected", Reply::Bool(r.corrected)),
                ]),
                Err(e) => engine_error(e),
            }
        }
    };
    (reply, Flow::Continue)
}

/// A namespace as `TALLY.NAMESPACE GET` answers it: the fields it names, in
/// `TALLY.CREATE`'s words.
fn namespace_reply(prefix: &str, n: &tally_core::namespace::NamespaceSpec) -> Reply {
    let p = &n.patch;
    let mut fields = vec![("prefix", name_reply(prefix))];
    let num = |v: u64| Reply::Big(v.into());
    if let Some(a) = n.auto {
        fields.push(("shards", Reply::text("auto")));
        fields.push(("min", num(a.min_shards.into())));
        fields.push(("max", num(a.max_shards.into())));
    }
    let named = [
        ("shards", p.shards.map(|v| num(v.into()))),
        ("durability", p.durability.map(|d| Reply::text(d.as_str()))),
        ("flush_ms", p.flush_ms.map(|v| num(v.into()))),
        ("rollup_ms", p.rollup_ms.map(|v| num(v.into()))),
        ("router", p.router.map(|r| Reply::text(r.as_str()))),
        ("distinct", p.distinct.map(Reply::Bool)),
        ("dedup_window_s", p.dedup_window_s.map(|v| num(v.into()))),
        ("frequency", p.frequency.map(|f| Reply::text(format!("{} {}", f.epsilon, f.delta)))),
        ("windows", p.windows.map(|w| Reply::text(w.texts().join(",")))),
        ("floor", p.min.map(|v| Reply::Big(v.into()))),
        ("ceiling", p.max.map(|v| Reply::Big(v.into()))),
        ("limit", p.limit.map(|l| Reply::text(format!("{} {}", l.max, l.window)))),
        ("replicas", p.replicas.map(|v| num(v.into()))),
        ("ttl_ms", n.ttl_ms.map(num)),
    ];
    fields.extend(named.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))));
    Reply::Map(fields.into_iter().map(|(k, v)| (Reply::text(k), v)).collect())
}

/// `TALLY.NAMESPACE`: declares, shows, drops or lists namespaces.
async fn namespace<S: Service>(svc: &S, op: NamespaceOp) -> Reply {
    match op {
        NamespaceOp::Set { prefix, spec } => {
            let put = match spec.into_namespace() {
                Ok(spec) => svc.put_namespace(&prefix, spec).await,
                Err(e) => Err(e),
            };
            match put {
                Ok(created) => Reply::Simple(if created { "created" } else { "updated" }.into()),
                Err(e) => engine_error(e),
            }
        }
        NamespaceOp::Get(prefix) => match svc.engine().namespace(&prefix) {
            Ok(n) => namespace_reply(&prefix, &n),
            Err(e) => engine_error(e),
        },
        NamespaceOp::Del(prefix) => match svc.delete_namespace(&prefix).await {
            Ok(()) => Reply::ok(),
            Err(e) => engine_error(e),
        },
        NamespaceOp::List => match svc.engine().namespaces() {
            Ok(all) => Reply::Array(all.keys().map(|p| name_reply(p)).collect()),
            Err(e) => engine_error(e),
        },
    }
}

/// `PFMERGE dest src ...`: `dest` keeps distinct members (created so if unknown, as
/// `PFADD` creates it, with `may_create`'s leave), and the sources' members are
/// merged into it.
async fn pfmerge<S: Service>(
    svc: &S,
    dest: &str,
    sources: &[String],
    may_create: impl FnOnce() -> Result<(), Reply>,
) -> Reply {
    let created = pfadd(svc, dest.to_owned(), Vec::new(), may_create).await;
    if created.is_error() {
        return created;
    }
    match svc.engine().merge_distinct(dest, sources).await {
        Ok(true) => Reply::ok(),
        Ok(false) => Reply::err(
            INCOMPLETE,
            "some sources' shards did not answer: the merge holds part of their members",
        ),
        Err(e) => engine_error(e),
    }
}

/// The names under `pattern`'s literal prefix the connection may see, one page
/// after `after`: every listing prefix the token's prefixes leave (all of them for
/// a token without), or none when the literal prefix is no possible name's start.
fn scan_page<S: Service>(
    svc: &S,
    session: &Session,
    pattern: Option<&[u8]>,
    after: Option<&str>,
    count: usize,
) -> Result<tally_engine::CounterPage, TallyError> {
    let mut literal = pattern.map(super::glob::literal_prefix).unwrap_or_default();
    // Names are listed by their escaped form, which keeps prefixes (a longer
    // literal than a name can be matches nothing, as the listing answers).
    literal.truncate(tally_core::name::NAME_BYTES_MAX + 1);
    let literal = tally_core::name::escape(&literal);
    let limit = count.clamp(1, tally_engine::LIST_PAGE_COUNTERS_MAX);
    let tally = svc.engine();
    let principal = session.principal.as_deref();
    let page = match principal.and_then(|p| p.narrow(&literal)) {
        Some(prefixes) => crate::http::ops::list_within(tally, &prefixes, after, limit),
        None => tally.list_counters(&literal, after, limit),
    };
    match page {
        Err(TallyError::InvalidListing(_)) => {
            Ok(tally_engine::CounterPage { counters: Vec::new(), next: None })
        }
        other => other,
    }
}

/// Whether a counter named `name` (escaped) is what `SCAN`/`KEYS` asked for: the
/// pattern is matched against the name's own bytes.
fn wanted(name: &str, pattern: Option<&[u8]>, kind: Option<&str>) -> bool {
    kind.is_none_or(|k| k == "string")
        && pattern.is_none_or(|p| super::glob::matches(p, &tally_core::name::unescaped(name)))
}

/// A counter name (escaped) as a reply: its own bytes.
fn name_reply(name: &str) -> Reply {
    Reply::Bulk(tally_core::name::unescaped(name))
}

/// `SCAN cursor [MATCH pattern] [COUNT count] [TYPE type]`: one page of at most
/// `count` names looked at (every counter is a Redis `string`), and the cursor of
/// the next page, 0 once done. Names are listed in byte order, so every counter that
/// exists from the first page to the last is answered exactly once.
async fn scan<S: Service>(
    svc: &S,
    front: &Front,
    session: &Session,
    args: super::command::ScanArgs,
) -> Reply {
    let after = match args.cursor {
        0 => None,
        id => match front.scans.lock().get(id) {
            Some(name) => Some(name.to_owned()),
            None => return Reply::Error("ERR invalid cursor".into()),
        },
    };
    let pattern = args.pattern.as_deref();
    let page = match scan_page(svc, session, pattern, after.as_deref(), args.count) {
        Ok(page) => page,
        Err(e) => return engine_error(e),
    };
    let next = match page.next {
        Some(last) => front.scans.lock().open(last),
        None => 0,
    };
    let names = page
        .counters
        .into_iter()
        .filter(|n| wanted(n, pattern, args.kind.as_deref()))
        .map(|n| name_reply(&n))
        .collect();
    Reply::Array(vec![Reply::text(next.to_string()), Reply::Array(names)])
}

/// Most names one `KEYS` answers: it lists every counter in one reply, so past this
/// it refuses (use `SCAN`) rather than hold a reply of unbounded size.
pub const KEYS_COUNTERS_MAX: usize = 100_000;

/// `KEYS pattern`: every name that matches, in byte order.
async fn keys<S: Service>(svc: &S, session: &Session, pattern: &[u8]) -> Reply {
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = match scan_page(
            svc,
            session,
            Some(pattern),
            after.as_deref(),
            tally_engine::LIST_PAGE_COUNTERS_MAX,
        ) {
            Ok(page) => page,
            Err(e) => return engine_error(e),
        };
        out.extend(page.counters.iter().filter(|n| wanted(n, Some(pattern), None)).map(|n| name_reply(n)));
        if out.len() > KEYS_COUNTERS_MAX {
            return Reply::Error(format!(
                "ERR more than {KEYS_COUNTERS_MAX} counters match: page through them with SCAN"
            ));
        }
        match page.next {
            Some(next) => after = Some(next),
            None => return Reply::Array(out),
        }
        tokio::task::consume_budget().await;
    }
}

/// `CONFIG GET pattern ...`: the node's settings under Redis's names, for what
/// clients and tools ask (`redis-benchmark` reads `save` and `appendonly`).
fn config_get(front: &Front, patterns: &[Vec<u8>]) -> Reply {
    let limits = &front.limits;
    let params: [(&str, String); 13] = [
        ("maxclients", limits.connections_max.to_string()),
        ("port", front.addr.port().to_string()),
        ("bind", front.addr.ip().to_string()),
        ("databases", "1".into()),
        ("save", String::new()),
        ("appendonly", "no".into()),
        ("appendfsync", "no".into()),
        ("maxmemory", "0".into()),
        ("maxmemory-policy", "noeviction".into()),
        ("timeout", "0".into()),
        ("cluster-enabled", "no".into()),
        ("proto-max-bulk-len", limits.request_limit_bytes().to_string()),
        ("client-query-buffer-limit", limits.request_limit_bytes().to_string()),
    ];
    let mut out = Vec::new();
    for (name, value) in &params {
        if patterns.iter().any(|p| super::glob::matches(p, name.as_bytes())) {
            out.push((Reply::text(*name), Reply::text(value.clone())));
        }
    }
    Reply::Map(out)
}

/// `WAIT numreplicas timeout`: delivers what this connection's increments left
/// buffered on this node (a `batched` counter's) to their shards, where a write is
/// acknowledged by a majority of its copies; answers how many copies besides the
/// leader's every one of those counters then has for certain (0 with one copy per
/// shard; 1 of 3, 2 of 5), or 0 if the deliveries did not finish within `timeout`.
async fn wait<S: Service>(svc: &S, session: &Session, timeout_ms: i64) -> Reply {
    let tally = svc.engine();
    let settle = async {
        let mut copies = u8::MAX;
        for name in &session.written {
            match tally.settle_counter(name).await {
                Ok((true, c)) => copies = copies.min(c),
                Ok((false, _)) => return 0,
                Err(TallyError::NotFound(_)) => {}
                Err(_) => return 0,
            }
        }
        if copies == u8::MAX {
            copies = tally.copies_of(None);
        }
        i64::from(majority(copies).saturating_sub(1))
    };
    let acked = if timeout_ms > 0 {
        tokio::time::timeout(Duration::from_millis(timeout_ms as u64), settle).await.unwrap_or(0)
    } else {
        settle.await
    };
    Reply::Int(acked)
}

/// The copies of a group of `copies` that acknowledge a write: a majority.
fn majority(copies: u8) -> u8 {
    copies / 2 + 1
}

/// RedisBloom's `TOPK.INFO` decay: Tally keeps no decaying sketch, so it answers the
/// module's default.
const TOPK_DECAY: f64 = 0.9;

/// The width and depth of the count-min table a frequency shape gives.
fn cms_shape(shape: tally_core::frequency::FrequencySpec) -> (u32, u32) {
    tally_core::cms::CountMin::with_error(shape.epsilon, shape.delta)
        .map_or((0, 0), |c| (c.width(), c.depth()))
}

/// What `TOPK.RESERVE key k` creates: a frequency counter whose ε remembers `k`
/// (ε = 1 / ([`TOPK_EPSILON_BASE`] + k), a count-min table of about 2,700 to 3,400
/// counters a row, 5 rows), so `TOPK.LIST` and `TOPK.QUERY` know the k the list was
/// reserved with without a field of their own in the counter's spec.
fn topk_shape(k: u32) -> tally_core::frequency::FrequencySpec {
    tally_core::frequency::FrequencySpec { epsilon: 1.0 / (TOPK_EPSILON_BASE + f64::from(k)), delta: 0.01 }
}

/// See [`topk_shape`].
const TOPK_EPSILON_BASE: f64 = 1000.0;

/// The `k` a counter's list was reserved with (`TOPK.RESERVE`), or
/// [`TOPK_LIST_DEFAULT`](super::command::TOPK_LIST_DEFAULT) for one made otherwise.
pub fn reserved_k(shape: tally_core::frequency::FrequencySpec) -> u32 {
    let k = (1.0 / shape.epsilon - TOPK_EPSILON_BASE).round();
    let exact = topk_shape(k as u32) == shape;
    if exact && (1.0..=f64::from(tally_core::frequency::TOP_K_MAX)).contains(&k) {
        k as u32
    } else {
        super::command::TOPK_LIST_DEFAULT
    }
}

/// The k of a `TOPK.LIST`: the one asked for, or the one the list was reserved with.
async fn topk_k<S: Service>(svc: &S, key: &str, k: Option<u32>) -> Result<u32, Reply> {
    if let Some(k) = k {
        return Ok(k);
    }
    match svc.counter(key).await {
        Ok(info) => Ok(info.spec.frequency.map_or(super::command::TOPK_LIST_DEFAULT, reserved_k)),
        Err(e) => Err(engine_error(e)),
    }
}

/// `CMS.INITBY*` and `TOPK.RESERVE`: a new counter that keeps frequencies of `shape`
/// (RedisBloom refuses a key that exists).
async fn cms_init<S: Service>(svc: &S, key: &str, shape: tally_core::frequency::FrequencySpec) -> Reply {
    match svc.counter(key).await {
        Ok(_) => return Reply::Error("ERR CMS: key already exists".into()),
        Err(TallyError::NotFound(_)) => {}
        Err(e) => return engine_error(e),
    }
    let patch = SpecPatch { frequency: Some(shape), ..SpecPatch::default() };
    match svc.put_counter(key, patch, AutoPatch::default()).await {
        Ok(_) => Reply::ok(),
        Err(e) => engine_error(e),
    }
}

/// `CMS.INCRBY` (answers each item's estimate after the increments) and
/// `TOPK.ADD`/`TOPK.INCRBY` (answers nil for each: Tally's list expels no item one
/// increment at a time). The increments run as one batch; the counter must exist.
async fn frequency_incr<S: Service>(svc: &S, key: &str, items: Vec<(String, i64)>, estimates: bool) -> Reply {
    match svc.counter(key).await {
        Ok(info) if info.spec.frequency.is_none() => {
            return engine_error(TallyError::FrequencyOff(key.to_owned()))
        }
        Ok(_) => {}
        Err(TallyError::NotFound(_)) => {
            let module = if estimates { "CMS" } else { "TopK" };
            return Reply::Error(format!("ERR {module}: key does not exist"));
        }
        Err(e) => return engine_error(e),
    }
    let batch =
        items.iter().map(|(item, by)| (key.to_owned(), Increment::new(*by).item(item.clone()))).collect();
    match svc.incr_many(batch).await {
        Ok(results) => {
            if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
                return engine_error(e);
            }
        }
        Err(e) => return engine_error(e),
    }
    if !estimates {
        return Reply::Array(items.iter().map(|_| Reply::Null).collect());
    }
    let mut out = Vec::with_capacity(items.len());
    for (item, _) in &items {
        match svc.frequency(key, item).await {
            Ok(f) => out.push(Reply::Big(f.estimate.into())),
            Err(e) => return engine_error(e),
        }
    }
    Reply::Array(out)
}

/// `TOPK.QUERY` (1 for each item among the reserved k heaviest) and `TOPK.COUNT`
/// (each item's estimate).
async fn topk_query<S: Service>(svc: &S, key: &str, items: Vec<String>, count: bool) -> Reply {
    let shape = match svc.counter(key).await {
        Ok(info) => match info.spec.frequency {
            Some(shape) => shape,
            None => return engine_error(TallyError::FrequencyOff(key.to_owned())),
        },
        Err(TallyError::NotFound(_)) => return Reply::Error("ERR TopK: key does not exist".into()),
        Err(e) => return engine_error(e),
    };
    if count {
        let mut out = Vec::with_capacity(items.len());
        for item in &items {
            match svc.frequency(key, item).await {
                Ok(f) => out.push(Reply::Big(f.estimate.into())),
                Err(e) => return engine_error(e),
            }
        }
        return Reply::Array(out);
    }
    match svc.top(key, reserved_k(shape)).await {
        Ok(top) if top.complete => {
            let listed: std::collections::BTreeSet<&str> =
                top.items.iter().map(|e| e.item.as_str()).collect();
            Reply::Array(items.iter().map(|i| Reply::Int(listed.contains(i.as_str()).into())).collect())
        }
        Ok(top) => Reply::err(INCOMPLETE, format!("shards {:?} did not answer", top.missing_shards)),
        Err(e) => engine_error(e),
    }
}

/// Applies `ttl` to the counter's deadline (`SET`, `GETEX`). Clearing costs a
/// metadata change only when there is a deadline to clear.
async fn change_ttl<S: Service>(svc: &S, key: &str, ttl: TtlChange) -> Result<(), Reply> {
    let done = match ttl {
        TtlChange::Keep => return Ok(()),
        TtlChange::Clear => match svc.expiry(key).await {
            Ok((Some(_), _)) => svc.persist(key).await.map(|_| ()),
            Ok((None, _)) => Ok(()),
            Err(e) => Err(e),
        },
        TtlChange::Set(when) => match tally_core::expiry::deadline(when, svc.engine().now_ms()) {
            Ok(at) => svc.expire(key, at, tally_core::expiry::Condition::Always).await.map(|_| ()),
            Err(_) => return Err(Reply::Error("ERR invalid expire time in 'set' command".into())),
        },
    };
    match done {
        Ok(()) | Err(TallyError::NotFound(_)) => Ok(()),
        Err(e) => Err(engine_error(e)),
    }
}

/// `INCREX key ...` (Redis 8.8): the increment kept within the bounds
/// ([`Service::incr_within`]), then its deadline changed as asked unless it was
/// skipped. Answers `[new value, applied increment]`; a skipped increment answers
/// `[current value, 0]` and leaves the counter and its deadline as they were.
/// With `ENX` the deadline is set only if the counter has none, read from this
/// node's metadata first, so a counter that has one costs no metadata round.
async fn increx<S: Service>(svc: &S, key: &str, args: IncrExArgs) -> Reply {
    let out = match svc.incr_within(key, args.delta, args.within).await {
        Ok(out) => out,
        Err(TallyError::Within(e)) => return Reply::Error(format!("ERR {e}")),
        Err(e) => return engine_error(e),
    };
    let value = match out.total {
        IncrTotal::Total(t) => t.value,
        IncrTotal::Incomplete(missing) if out.applied != 0 => return counted_incomplete(&missing),
        IncrTotal::Incomplete(missing) => {
            return Reply::err(
                INCOMPLETE,
                format!("shards {missing:?} did not answer the read the bounds need; nothing was counted"),
            )
        }
    };
    if !out.skipped && out.exists {
        let changed = match args.ttl {
            TtlChange::Keep => Ok(()),
            TtlChange::Clear => change_ttl(svc, key, TtlChange::Clear).await,
            TtlChange::Set(when) => match tally_core::expiry::deadline(when, svc.engine().now_ms()) {
                Err(_) => Err(Reply::Error("ERR invalid expire time in 'increx' command".into())),
                Ok(at) => {
                    let has_one = args.enx && matches!(svc.expiry(key).await, Ok((Some(_), _)));
                    match has_one {
                        true => Ok(()),
                        false => {
                            let cond = match args.enx {
                                true => tally_core::expiry::Condition::Nx,
                                false => tally_core::expiry::Condition::Always,
                            };
                            match svc.expire(key, at, cond).await {
                                Ok(_) | Err(TallyError::NotFound(_)) => Ok(()),
                                Err(e) => Err(engine_error(e)),
                            }
                        }
                    }
                }
            },
        };
        if let Err(reply) = changed {
            return reply;
        }
    }
    Reply::Array(vec![Reply::Big(value), Reply::Int(out.applied)])
}

/// `SET key value ...` (and `GETSET`): the counter's total becomes `value` through
/// one correction ([`Service::set_total`]), created first if unknown (as an
/// increment would create it, so it takes its namespace's spec); its deadline is
/// cleared unless `KEEPTTL` or set by `EX`/`PX`/`EXAT`/`PXAT`. Answers `OK`, or with
/// `GET` the total before (nil if it did not exist); nil when `NX`/`XX` kept it.
/// An absolute write: sending it again leaves the same total, so a retry after a lost
/// answer is safe (`docs/SEMANTICS.md`, "Expiry and absolute writes").
async fn set_counter<S: Service>(svc: &S, key: &str, set: SetArgs) -> Reply {
    let before = get(svc, key).await;
    let exists = match &before {
        Reply::Bulk(_) => true,
        Reply::Null => false,
        error => return error.clone(),
    };
    if (set.nx && exists) || (set.xx && !exists) {
        return if set.get { before } else { Reply::Null };
    }
    if let Err(e) = svc.set_total(key, set.value).await {
        return engine_error(e);
    }
    if let Err(reply) = change_ttl(svc, key, set.ttl).await {
        return reply;
    }
    if set.get {
        before
    } else {
        Reply::ok()
    }
}

/// `PFADD`: each member is one increment of 1 carrying it, on a counter that keeps
/// distinct members (an unknown counter is created with `distinct`). Answers 1 when
/// the counter was created or its estimate moved, 0 otherwise, as Redis does.
async fn pfadd<S: Service>(
    svc: &S,
    key: String,
    members: Vec<String>,
    may_create: impl FnOnce() -> Result<(), Reply>,
) -> Reply {
    let created = match svc.counter(&key).await {
        Ok(info) if !info.spec.distinct => {
            return Reply::err(
                NOT_DISTINCT,
                format!(
                    "counter {} does not keep distinct members (TALLY.CREATE {} DISTINCT true)",
                    tally_core::name::quoted(&key),
                    tally_core::name::shown(&key)
                ),
            )
        }
        Ok(_) => false,
        Err(TallyError::NotFound(_)) => {
            if let Err(refused) = may_create() {
                return refused;
            }
            match svc
                .put_counter(
                    &key,
                    SpecPatch { distinct: Some(true), ..SpecPatch::default() },
                    AutoPatch::default(),
                )
                .await
            {
                Ok(o) => o.created,
                Err(e) => return engine_error(e),
            }
        }
        Err(e) => return engine_error(e),
    };
    if members.is_empty() {
        return Reply::Int(created.into());
    }
    let before = match svc.distinct(&key).await {
        Ok(d) => d.estimate,
        Err(e) => return engine_error(e),
    };
    let items = members.into_iter().map(|m| (key.clone(), Increment::new(1).member(m))).collect();
    match svc.incr_many(items).await {
        Ok(results) => {
            if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
                return engine_error(e);
            }
        }
        Err(e) => return engine_error(e),
    }
    match svc.distinct(&key).await {
        Ok(after) => Reply::Int((created || after.estimate != before).into()),
        Err(e) => engine_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn incr(key: &str, delta: i64) -> Option<(String, i64)> {
        Some((key.to_owned(), delta))
    }

    fn totals(values: &[i128]) -> Vec<Reply> {
        values.iter().map(|v| Reply::Big(*v)).collect()
    }

    #[test]
    fn a_pipelines_answers_come_back_in_the_order_sent() {
        // Ids from a one-shard counter, answered out of order: the same ids, in order.
        let incrs = [incr("ids", 1), incr("ids", 1), None, incr("ids", 1)];
        let mut replies = totals(&[12, 10, 99, 11]);
        order_answers(&incrs, &mut replies);
        assert_eq!(replies, totals(&[10, 11, 99, 12]));
        // Totals computed after several increments had landed repeat: counted back
        // from the one that includes the whole run.
        let incrs = [incr("a", 1), incr("a", 1), incr("a", 1)];
        let mut replies = totals(&[3, 3, 2]);
        order_answers(&incrs, &mut replies);
        assert_eq!(replies, totals(&[1, 2, 3]));
        // Different deltas: the total after each is the last less what came after it.
        let incrs = [incr("b", 1), incr("b", 10), incr("c", -2), incr("c", -2), incr("b", 5)];
        let mut replies = totals(&[16, 11, -2, -4, 16]);
        order_answers(&incrs, &mut replies);
        assert_eq!(replies, totals(&[1, 11, -2, -4, 16]));
        // Mixed signs, or a failed increment: left alone.
        let incrs = [incr("d", 1), incr("d", -1), incr("e", 1), incr("e", 1)];
        let mut replies = totals(&[0, 1, 5, 5]);
        replies[3] = Reply::err("overflow", "refused");
        let before = replies.clone();
        order_answers(&incrs, &mut replies);
        assert_eq!(replies, before);
    }
}
