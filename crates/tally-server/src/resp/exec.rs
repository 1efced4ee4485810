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

use super::command::{Command, NamespaceOp, SetArgs, TtlChange};

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

/// One connection's state.
#[derive(Debug, Clone, PartialEq)]
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

fn info_text<S: Service>(svc: &S, front: &Front, section: Option<&str>) -> String {
    let (counters, shards) = svc.engine().active();
    let all = matches!(section, None | Some("all" | "default" | "everything"));
    let want = |name: &str| all || section == Some(name);
    let mut out = String::new();
    if want("server") {
        out += &format!(
            "# Server\r\ntally_version:{}\r\nredis_mode:standalone\r\nnode_id:{}\r\nprocess_id:{}\r\n\
             tcp_port:{}\r\nuptime_in_seconds:{}\r\nresp_protocols:2,3\r\n\r\n",
            env!("CARGO_PKG_VERSION"),
            front.node_id,
            std::process::id(),
            front.addr.port(),
            front.started.elapsed().as_secs(),
        );
    }
    if want("clients") {
        out += &format!(
            "# Clients\r\nconnected_clients:{}\r\nmaxclients:{}\r\n\r\n",
            front.connected.load(Ordering::Relaxed),
            front.limits.connections_max,
        );
    }
    if want("stats") {
        out += &format!(
            "# Stats\r\ntotal_connections_received:{}\r\nrejected_connections:{}\r\n\
             total_commands_processed:{}\r\n\r\n",
            front.accepted.load(Ordering::Relaxed),
            front.rejected.load(Ordering::Relaxed),
            front.commands.load(Ordering::Relaxed),
        );
    }
    if want("keyspace") {
        // What the node knows without a scan: counters with state in memory here
        // and the shard actors running; every counter is in database 0.
        out += &format!("# Keyspace\r\nactive_counters:{counters}\r\nrunning_shards:{shards}\r\n\r\n");
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
        Command::Incr { key, delta } => match svc.incr_total(&key, Increment::new(delta)).await {
            Ok((_, IncrTotal::Total(total))) => Reply::Big(total.value),
            Ok((_, IncrTotal::Incomplete(missing))) => counted_incomplete(&missing),
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
            Reply::ok()
        }
        Command::ClientGetName => session.name.clone().map_or(Reply::Null, Reply::Bulk),
        Command::ClientSetInfo { attr, value } => {
            if attr == "lib-name" {
                session.lib_name = Some(value);
            } else {
                session.lib_ver = Some(value);
            }
            Reply::ok()
        }
        Command::ClientId => Reply::Big(session.id.into()),
        Command::Command(CommandQuery::All) => command_info(&[], info_entry, false),
        Command::Command(CommandQuery::Count) => Reply::Int(COMMANDS.len() as i64),
        Command::Command(CommandQuery::Info(names)) => command_info(&names, info_entry, false),
        Command::Command(CommandQuery::Docs(names)) => command_info(&names, docs_entry, true),
        Command::Info(section) => Reply::text(info_text(svc, front, section.as_deref())),
        cmd @ (Command::Incr { .. } | Command::TallyIncrBy { .. }) => run_increment(svc, cmd).await,
        Command::Get(key) => get(svc, &key).await,
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
        Command::PfAdd { key, members } => pfadd(svc, key, members).await,
        Command::PfCount(key) => match svc.distinct(&key).await {
            Ok(d) if d.complete => Reply::Big(d.estimate.into()),
            Ok(d) => Reply::err(INCOMPLETE, format!("shards {:?} did not answer", d.missing_shards)),
            Err(TallyError::NotFound(_)) => Reply::Int(0),
            Err(e) => engine_error(e),
        },
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
        Command::TopkList { key, with_count, k } => match svc.top(&key, k).await {
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
    let mut fields = vec![("prefix", Reply::text(prefix))];
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
            Ok(all) => Reply::Array(all.keys().map(|p| Reply::text(p.clone())).collect()),
            Err(e) => engine_error(e),
        },
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
async fn pfadd<S: Service>(svc: &S, key: String, members: Vec<String>) -> Reply {
    let created = match svc.counter(&key).await {
        Ok(info) if !info.spec.distinct => {
            return Reply::err(
                NOT_DISTINCT,
                format!("counter {key:?} does not keep distinct members (TALLY.CREATE {key} DISTINCT true)"),
            )
        }
        Ok(_) => false,
        Err(TallyError::NotFound(_)) => {
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
