//! The Redis-protocol front end: RESP2 and RESP3 on the address a node's entry in
//! `cluster.nodes` names as `resp`, so `redis-cli`, `redis-benchmark` and every
//! Redis client library drive counters.
//!
//! # Layout
//!
//! * [`wire`] — requests out of the read buffer (one walk over the length headers
//!   that checks every declared length against the limits and finds each argument
//!   in place; tested against the `redis-protocol` crate's decoder), replies
//!   ([`wire::Reply`]) encoded as RESP2 or RESP3 by that crate.
//! * [`command`] — the command table (arity, flags, the docs `COMMAND DOCS` serves)
//!   and parsing arguments into a [`command::Command`]. Pure.
//! * [`exec`] — running a command against the [`Service`], the same calls the HTTP
//!   handlers make; connection state in [`exec::Session`].
//! * [`auth`] — `AUTH`, `HELLO ... AUTH` and each command's scope, over the node's
//!   token gate (shared with HTTP).
//! * [`registry`] — what a listener keeps about its connections (`CLIENT LIST`,
//!   `CLIENT KILL`) and about `SCAN`'s cursors.
//! * [`glob`] — Redis's glob patterns (`KEYS`, `SCAN ... MATCH`), matched on bytes.
//! * this file — [`serve`]: the accept loop (connection limit, graceful shutdown)
//!   and each connection's read–decode–run–write loop.
//!
//! # Pipelining
//!
//! One read may hold many commands. Every complete command in the buffer (up to
//! [`PIPELINE_COMMANDS_MAX`]) is decoded, run, and its reply appended to one output
//! buffer, which is written with one `write_all`. Consecutive increments
//! (`INCR`…`DECRBY`, `TALLY.INCRBY`) of one pipeline run concurrently, so a `sync`
//! counter gives them one group commit; any other command waits for the increments
//! before it and runs alone, so a `GET` after an `INCR` in the same pipeline sees it.
//! Replies always go out in the order the commands came.
//!
//! # Errors
//!
//! Value errors carry the snake_case codes of the HTTP error bodies as the word
//! after `ERR` (`-ERR invalid_name ...`); Redis's own texts are kept for what Redis
//! has words for (unknown command, arity, syntax). Input that cannot be framed, or
//! that declares a length over `resp.request_bytes_max` / `resp.args_max`, gets
//! `-ERR protocol_error ...` or `-ERR request_too_large ...` and the connection is
//! closed; the node and every other connection go on.

pub mod auth;
pub mod command;
pub mod exec;
pub mod glob;
pub mod registry;
pub mod wire;

use crate::auth::Gate;
use crate::config::RespConfig;
use crate::service::Service;
use exec::{Flow, Front, Session};
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};
use tally_tls::refusals::{self, Reason};
use tally_tls::{Admission, Slot};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use wire::{encode, Reply, WireLimits};

/// Most commands run between two writes of one connection: a longer pipeline is
/// answered in several writes, so the output buffer stays bounded.
pub const PIPELINE_COMMANDS_MAX: usize = 1024;
/// Longest a connection runs commands of one pipeline before it lets the other
/// tasks of its worker run, in microseconds: a pipeline of heavy commands
/// (`COMMAND DOCS`, huge names) would otherwise hold a worker for tens of
/// milliseconds, and the engine's actors that other clients' requests wait on
/// with it.
pub const COMMAND_SLICE_US: u64 = 1_000;
/// Bytes reserved in a connection's read buffer before each read.
pub const READ_CHUNK_BYTES: usize = 16 * 1024;
/// How long the accept loop pauses after an accept error (for example running out
/// of file descriptors), so it does not spin.
const ACCEPT_BACKOFF_MS: u64 = 100;
/// Redis's answer to a client over the connection limit.
const MAX_CLIENTS: &[u8] = b"-ERR max number of clients reached\r\n";
/// Request methods of HTTP/1.1 (RFC 9110 §9 and PATCH): a request line that starts
/// with one and ends in `HTTP/…` is a web client's, not a Redis client's.
const HTTP_METHODS: [&[u8]; 9] =
    [b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"CONNECT", b"OPTIONS", b"TRACE", b"PATCH"];
/// What is logged when a connection is closed as a cross-protocol attack (Redis's
/// own warning, naming this node).
const CROSS_PROTOCOL_WARNING: &str = "Possible SECURITY ATTACK detected. It looks like somebody is sending \
     POST or Host: commands to the RESP port. This is likely due to an attacker attempting to use Cross \
     Protocol Scripting to compromise the node (a web page posting to 127.0.0.1). Connection aborted.";

/// Whether a request is what a browser or any HTTP client sends: a command named
/// `POST` or `Host:` (as Redis checks: every browser request carries a `Host:` line,
/// and a form post or a `fetch` in `no-cors` mode can only `POST`), or an HTTP
/// request line (`GET /x HTTP/1.1`). A web page can make a browser send such bytes
/// to any port on 127.0.0.1, with a body of Redis commands after the headers; the
/// connection is closed before any of them runs.
pub fn is_cross_protocol(args: &[&[u8]]) -> bool {
    let Some(first) = args.first() else { return false };
    if first.eq_ignore_ascii_case(b"post") || first.eq_ignore_ascii_case(b"host:") {
        return true;
    }
    args.len() == 3 && HTTP_METHODS.contains(first) && args[2].starts_with(b"HTTP/")
}

/// Decrements the open-connection count however the connection task ends.
struct Open(Arc<Front>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.connected.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection that has not authenticated yet: its place among those waiting
/// (`resp.connections_unauthenticated_max`) and since when it waits.
struct Waiting {
    slot: Slot,
    since: Instant,
}

/// Why a connection was closed by its listener rather than by its client.
fn closed(reason: Reason, id: u64, timeout: Duration) {
    refusals::count(tally_tls::Listener::Resp, reason);
    refusals::log_limited(|| {
        tracing::info!(
            target: crate::auth::AUDIT_TARGET,
            id,
            outcome = "refused",
            reason = reason.as_str(),
            timeout_ms = timeout.as_millis() as u64,
            "RESP: closed a connection: {}",
            match reason {
                Reason::AuthTimeout => "it did not authenticate (or send a command) in time",
                Reason::ReadTimeout => "its command did not arrive whole in time",
                _ => "a new connection needed its place among those waiting to authenticate",
            }
        );
    });
}

/// Serves RESP on `listener` over `svc` until `shutdown` completes, then lets each
/// connection finish the commands it is running (bounded by `grace`) and returns.
/// Commands run under `command_timeout` (the node's `http.request_timeout_ms`).
pub async fn serve<S: Service>(
    listener: TcpListener,
    svc: S,
    limits: &RespConfig,
    command_timeout: Duration,
    grace: Duration,
    gate: Arc<Gate>,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    let serving = Serving { limits: limits.clone(), command_timeout, grace, gate, tls: None };
    serve_with(listener, svc, serving, shutdown).await
}

/// TLS on the RESP listener: the acceptor of the node's `[tls]` section (see
/// [`tally_tls::stream_acceptor`]) and how long a handshake may take.
#[derive(Clone)]
pub struct RespTls {
    /// Presents the node's certificate; verifies clients' when `tls.client_ca` is set.
    pub acceptor: tally_tls::TlsAcceptor,
    /// How long a connection may take to complete its handshake
    /// (`http.header_read_timeout_ms`, shared with HTTP).
    pub handshake_timeout: Duration,
}

/// What a RESP listener runs under.
pub struct Serving {
    /// The `[resp]` limits.
    pub limits: RespConfig,
    /// How long one command may take.
    pub command_timeout: Duration,
    /// How long connections may finish their commands after shutdown.
    pub grace: Duration,
    /// The node's tokens and audit trail.
    pub gate: Arc<Gate>,
    /// TLS, or plaintext when `None`.
    pub tls: Option<RespTls>,
}

/// [`serve`] with every setting, TLS included. With TLS, each connection first
/// completes a handshake in its own task (counted against `resp.connections_max`,
/// bounded by the handshake timeout); a plaintext client or one without an accepted
/// certificate fails the handshake, is logged at `warn` and closed, and the
/// listener goes on.
pub async fn serve_with<S: Service>(
    listener: TcpListener,
    svc: S,
    serving: Serving,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    let Serving { limits, command_timeout, grace, gate, tls } = serving;
    let limits = &limits;
    let local = listener.local_addr()?;
    let front = Arc::new(Front::new(svc.node_id().to_string(), local, limits.clone(), command_timeout, gate));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    // Connections waiting to authenticate: never more than their own small cap,
    // the oldest closed to make room (none of them has sent a request).
    let lobby = Admission::new(limits.unauthenticated_limit(), Duration::ZERO);
    tokio::pin!(shutdown);
    tracing::info!(%local, tls = tls.is_some(), "serving RESP");
    loop {
        while connections.try_join_next().is_some() {}
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "RESP accept failed; backing off");
                    tokio::time::sleep(Duration::from_millis(ACCEPT_BACKOFF_MS)).await;
                    continue;
                }
            },
        };
        let evicted_before = lobby.evictions();
        let waiting = lobby.admit().await;
        if lobby.evictions() > evicted_before {
            refusals::count(tally_tls::Listener::Resp, Reason::Evicted);
        }
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
        }
        let id = front.last_id.fetch_add(1, Ordering::Relaxed) + 1;
        let front = front.clone();
        let svc = svc.clone();
        let stop = stop_rx.clone();
        let tls = tls.clone();
        connections.spawn(async move {
            let session = Session::connected(&front, id, peer, auth::initial(&front.gate));
            let waiting = Waiting { slot: waiting, since: Instant::now() };
            let deadline = waiting.since + front.limits.auth_timeout();
            match tls {
                None => connection(stream, svc, &front, session, stop, Some(waiting)).await,
                Some(tls) => {
                    // The handshake counts against the wait to authenticate.
                    let shaken = tokio::select! {
                        s = handshake(&tls, stream, peer) => s,
                        _ = waiting.slot.evicted() => None,
                        _ = tokio::time::sleep_until(deadline.into()) => None,
                    };
                    let Some(stream) = shaken else { return };
                    connection(stream, svc, &front, session, stop, Some(waiting)).await
                }
            }
            tracing::debug!(%peer, id, "RESP connection closed");
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let deadline = Instant::now() + grace;
    let drained =
        tokio::time::timeout_at(deadline.into(), async { while connections.join_next().await.is_some() {} })
            .await;
    if drained.is_err() {
        tracing::warn!(left = connections.len(), "RESP shutdown grace elapsed; dropping connections");
        connections.shutdown().await;
    }
    Ok(())
}

/// Runs the TLS handshake of a connection within the handshake timeout; `None`
/// (logged at `warn`) when it fails: a plaintext client, a certificate not signed
/// by `tls.client_ca`, silence.
async fn handshake(
    tls: &RespTls,
    stream: TcpStream,
    peer: std::net::SocketAddr,
) -> Option<tally_tls::TlsStream<TcpStream>> {
    match tokio::time::timeout(tls.handshake_timeout, tls.acceptor.accept(stream)).await {
        Ok(Ok(stream)) => Some(stream),
        Ok(Err(e)) => {
            tally_tls::refused_handshake(tally_tls::Listener::Resp, peer, &e);
            None
        }
        Err(_) => {
            tally_tls::timed_out_handshake(tally_tls::Listener::Resp, peer, tls.handshake_timeout);
            None
        }
    }
}

/// The complete requests at the front of a connection's read buffer: where each
/// one's arguments lie in the buffer, and how many bytes they take.
#[derive(Debug, Default)]
struct Batch {
    /// Every request's arguments, one after another.
    spans: Vec<wire::Span>,
    /// Each request's arguments in `spans`.
    requests: Vec<std::ops::Range<usize>>,
    /// Bytes of the buffer the requests take.
    used: usize,
}

impl Batch {
    fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// The first request that [`is_cross_protocol`], if any.
    fn cross_protocol(&self, buf: &[u8]) -> Option<usize> {
        let mut args = Vec::new();
        (0..self.requests.len()).find(|&i| {
            self.args(i, buf, &mut args);
            is_cross_protocol(&args)
        })
    }

    /// Request `i`'s arguments, read from `buf`, into `args` (emptied first).
    fn args<'b>(&self, i: usize, buf: &'b [u8], args: &mut Vec<&'b [u8]>) {
        args.clear();
        args.extend(self.spans[self.requests[i].clone()].iter().map(|s| &buf[s.clone()]));
    }
}

/// Finds every complete request at the front of `buf` (at most
/// [`PIPELINE_COMMANDS_MAX`]), and the protocol error that stopped decoding, if
/// any. Nothing is copied: the requests are read from `buf` until they ran, and
/// then drained from it.
fn take_batch(buf: &[u8], limits: &WireLimits) -> (Batch, Option<wire::ProtocolError>) {
    let mut batch = Batch::default();
    let mut fatal = None;
    while batch.requests.len() < PIPELINE_COMMANDS_MAX {
        let first = batch.spans.len();
        let at = batch.used;
        match wire::next_request_spans(&buf[at..], limits, &mut batch.spans) {
            Ok(Some(n)) => {
                batch.used += n;
                for span in &mut batch.spans[first..] {
                    *span = span.start + at..span.end + at;
                }
                if batch.spans.len() > first {
                    batch.requests.push(first..batch.spans.len());
                }
            }
            Ok(None) => break,
            Err(e) => {
                fatal = Some(e);
                break;
            }
        }
    }
    (batch, fatal)
}

async fn timed<F: Future<Output = Reply>>(timeout: Duration, f: F) -> Reply {
    tokio::time::timeout(timeout, f).await.unwrap_or_else(|_| {
        Reply::err(
            crate::http::error::codes::TIMEOUT,
            format!(
                "the node did not answer within {} ms; the command may or may not have taken effect \
                 (retry an increment with the same event id)",
                timeout.as_millis()
            ),
        )
    })
}

/// Runs `running` together under one deadline `timeout` from now: a reply each, in
/// order; a command still running at the deadline answers as [`timed`] does.
///
/// Each command is first polled once, in order: a batched increment completes in
/// that poll, so a pipeline of them needs neither a timer nor a place in a set.
/// Only the commands still pending then wait together, in one
/// [`futures::stream::FuturesUnordered`] under one timer (a timer per command was a
/// visible share of a pipeline's cost). Commands come boxed: moving each one's whole
/// state into the set took, before, a third of a pipelined `INCR`'s CPU in `memmove`.
async fn join_timed<F: Future<Output = Reply>>(timeout: Duration, running: Vec<Pin<Box<F>>>) -> Vec<Reply> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut replies: Vec<Option<Reply>> = std::iter::repeat_with(|| None).take(running.len()).collect();
    let mut waiting = Vec::new();
    let mut first = running.into_iter().enumerate();
    std::future::poll_fn(|cx| {
        for (i, mut f) in first.by_ref() {
            match f.as_mut().poll(cx) {
                Poll::Ready(reply) => replies[i] = Some(reply),
                Poll::Pending => waiting.push((i, f)),
            }
        }
        Poll::Ready(())
    })
    .await;
    if !waiting.is_empty() {
        let mut pending: futures::stream::FuturesUnordered<_> =
            waiting.into_iter().map(|(i, f)| async move { (i, f.await) }).collect();
        let deadline = tokio::time::sleep_until(deadline);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                biased;
                next = futures::StreamExt::next(&mut pending) => match next {
                    Some((i, reply)) => replies[i] = Some(reply),
                    None => break,
                },
                _ = &mut deadline => break,
            }
        }
    }
    let mut out = Vec::with_capacity(replies.len());
    for reply in replies {
        out.push(match reply {
            Some(r) => r,
            None => timed(Duration::ZERO, std::future::pending()).await,
        });
    }
    out
}

/// Runs one batch of requests read from `buf`, appending each reply to `out` in
/// order.
async fn run_batch<S: Service>(
    svc: &S,
    front: &Front,
    session: &mut Session,
    (batch, buf): (&Batch, &[u8]),
    out: &mut Vec<u8>,
) -> Flow {
    front.commands.fetch_add(batch.requests.len() as u64, Ordering::Relaxed);
    let timeout = front.command_timeout;
    let gate = &front.gate;
    let mut args = Vec::new();
    let (mut next, mut held) = (0, None);
    let mut slice = Instant::now();
    // Each command is parsed and admitted when its turn comes, in order: an `AUTH`
    // earlier in the pipeline counts only once it ran.
    let mut take = |held: &mut Option<_>| {
        held.take().or_else(|| {
            (next < batch.requests.len()).then(|| {
                batch.args(next, buf, &mut args);
                next += 1;
                command::parse_named(&args)
            })
        })
    };
    while let Some(item) = take(&mut held) {
        let (op, cmd) = match item {
            Ok(named) => named,
            Err(reply) => {
                encode(&session.refused(reply, false), session.proto, out);
                continue;
            }
        };
        let generation = gate.generation();
        if session.auth_generation != generation {
            // The tokens were reloaded: run as a new connection would.
            session.principal = auth::initial(gate);
            session.auth_generation = generation;
        }
        if let Err(reply) = auth::admit(gate, session.principal.as_deref(), op, &cmd) {
            encode(&session.refused(reply, true), session.proto, out);
            continue;
        }
        if cmd.is_increment() && !session.queueing() {
            let mut running = Vec::new();
            let mut incrs = Vec::new();
            // A writer's sequenced increments must reach its shard in order: each
            // one starts once the one before it (same counter, same writer) answered.
            let mut last: HashMap<(String, String), tokio::sync::oneshot::Receiver<()>> = HashMap::new();
            let mut admitted = Ok(cmd);
            loop {
                let c = admitted;
                incrs.push(c.as_ref().ok().and_then(exec::answered_increment));
                let (after, done) = match c.as_ref().ok().and_then(command::Command::sequenced_writer) {
                    Some(writer) => {
                        let (tx, rx) = tokio::sync::oneshot::channel();
                        (last.insert(writer, rx), Some(tx))
                    }
                    None => (None, None),
                };
                running.push(Box::pin(async move {
                    if let Some(before) = after {
                        // An error only means the one before gave up (timed out).
                        let _ = before.await;
                    }
                    let reply = match c {
                        Ok(c) => exec::run_increment(svc, c).await,
                        Err(refused) => refused,
                    };
                    if let Some(done) = done {
                        let _ = done.send(());
                    }
                    reply
                }));
                // Increments that follow run with it; one that is refused keeps its
                // place. Anything else waits for the run, and runs next.
                admitted = match take(&mut held) {
                    Some(Ok((op, c))) if c.is_increment() => {
                        auth::admit(gate, session.principal.as_deref(), op, &c).map(|()| c)
                    }
                    other => {
                        held = other;
                        break;
                    }
                };
            }
            let mut replies = join_timed(timeout, running).await;
            exec::order_answers(&incrs, &mut replies);
            session.note_written(&incrs);
            for reply in &replies {
                encode(reply, session.proto, out);
            }
            continue;
        }
        // A command queued by `MULTI` is audited when `EXEC` runs it.
        let admin = auth::admin_op(&cmd).filter(|_| !session.queueing()).map(|_| cmd.clone());
        let ran = tokio::time::timeout(timeout, exec::run(svc, front, session, op, cmd)).await;
        let (reply, flow) = match ran {
            Ok(done) => done,
            Err(_) => (timed(Duration::ZERO, std::future::pending()).await, Flow::Continue),
        };
        if let Some(cmd) = admin {
            auth::audit_admin(gate, session.principal.as_deref(), op, &cmd, &reply);
        }
        encode(&reply, session.proto, out);
        if flow == Flow::Close {
            return Flow::Close;
        }
        // A pipeline of heavy commands (`COMMAND DOCS`, megabyte names) must not hold
        // a worker for long: every other connection and the engine's actors share it.
        if slice.elapsed() >= Duration::from_micros(COMMAND_SLICE_US) {
            tokio::task::yield_now().await;
            slice = Instant::now();
        }
    }
    Flow::Continue
}

/// One connection: read, decode every complete command, run them, write every
/// reply at once; until the client leaves, `QUIT`, a protocol error, a timeout or
/// shutdown.
///
/// A connection starts `waiting` to authenticate (on a node without tokens, to send
/// its first command): it holds a place among the waiting ones, which a newer one
/// may take, for at most `resp.auth_timeout_ms`. Once authenticated it counts
/// against `resp.connections_max` (one too many is answered Redis's `max number of
/// clients reached` and closed), may stay idle for `resp.idle_timeout_ms` (forever
/// at 0), and a command whose first byte arrived must arrive whole within
/// `resp.read_timeout_ms`.
async fn connection<S: Service, IO: AsyncRead + AsyncWrite + Unpin>(
    mut stream: IO,
    svc: S,
    front: &Arc<Front>,
    mut session: Session,
    mut stop: watch::Receiver<bool>,
    mut waiting: Option<Waiting>,
) {
    let limits = WireLimits {
        request_bytes_max: front.limits.request_limit_bytes(),
        args_max: front.limits.args_limit(),
        arg_bytes_max: front.limits.arg_limit_bytes(),
    };
    let (auth_timeout, read_timeout) = (front.limits.auth_timeout(), front.limits.read_timeout());
    let idle_timeout = front.limits.idle_timeout();
    let mut _open: Option<Open> = None;
    let mut buf: Vec<u8> = Vec::with_capacity(READ_CHUNK_BYTES);
    let mut out: Vec<u8> = Vec::new();
    // When the bytes of the request at the front of the buffer began to arrive, and
    // when the connection last finished a batch.
    let mut partial_since: Option<Instant> = None;
    let mut active = Instant::now();
    loop {
        let (mut batch, fatal) = take_batch(&buf, &limits);
        // Nothing from a cross-protocol request on runs: not it, not what follows.
        let attack = batch.cross_protocol(&buf);
        if let Some(i) = attack {
            batch.requests.truncate(i);
        }
        if batch.is_empty() && fatal.is_none() && attack.is_none() {
            buf.drain(..batch.used);
            if buf.is_empty() {
                partial_since = None;
            }
            buf.reserve(READ_CHUNK_BYTES);
            // When to give up on the connection, and the refusal it counts as (none for
            // an idle one, closed quietly as Redis closes one).
            let deadline = match (&waiting, partial_since) {
                (Some(w), _) => Some((w.since + auth_timeout, Some(Reason::AuthTimeout), auth_timeout)),
                (None, Some(since)) => Some((since + read_timeout, Some(Reason::ReadTimeout), read_timeout)),
                (None, None) => idle_timeout.map(|t| (active + t, None, t)),
            };
            let evicted = async {
                match &waiting {
                    Some(w) => w.slot.evicted().await,
                    None => std::future::pending().await,
                }
            };
            let timer = async {
                match deadline {
                    Some((at, ..)) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s) => return,
                _ = session.killed() => return,
                _ = evicted => {
                    closed(Reason::Evicted, session.id, auth_timeout);
                    return;
                }
                _ = timer => {
                    if let Some((_, Some(reason), timeout)) = deadline {
                        closed(reason, session.id, timeout);
                    }
                }
                read = stream.read_buf(&mut buf) => match read {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        partial_since.get_or_insert_with(Instant::now);
                        continue;
                    }
                },
            }
            // Timed out.
            let _ = stream.shutdown().await;
            return;
        }
        // A node without tokens admits a connection at its first command; one with
        // tokens once it authenticated (below, after the batch that did).
        if waiting.is_some() && session.principal.is_some() && !batch.is_empty() {
            match admit(front) {
                Some(admitted) => (_open, waiting) = (Some(admitted), None),
                None => {
                    let _ = tokio::time::timeout(front.command_timeout, stream.write_all(MAX_CLIENTS)).await;
                    let _ = stream.shutdown().await;
                    return;
                }
            }
        }
        let mut flow = run_batch(&svc, front, &mut session, (&batch, &buf), &mut out).await;
        buf.drain(..batch.used);
        partial_since = (!buf.is_empty()).then(Instant::now);
        active = Instant::now();
        if waiting.is_some() && session.principal.is_some() && flow == Flow::Continue {
            match admit(front) {
                Some(admitted) => (_open, waiting) = (Some(admitted), None),
                None => {
                    out.extend_from_slice(MAX_CLIENTS);
                    flow = Flow::Close;
                }
            }
        }
        if attack.is_some() {
            refusals::count(tally_tls::Listener::Resp, Reason::CrossProtocol);
            refusals::log_limited(|| {
                tracing::warn!(
                    target: crate::auth::AUDIT_TARGET,
                    id = session.id,
                    outcome = "refused",
                    reason = "cross_protocol",
                    "{CROSS_PROTOCOL_WARNING}"
                );
            });
            flow = Flow::Close;
        } else if let Some(e) = fatal {
            tracing::debug!(id = session.id, error = %e, "RESP protocol error; closing");
            encode(&Reply::Error(format!("ERR {e}")), session.proto, &mut out);
            flow = Flow::Close;
        }
        let written = tokio::time::timeout(front.command_timeout, stream.write_all(&out)).await;
        out.clear();
        if !matches!(written, Ok(Ok(()))) || flow == Flow::Close || *stop.borrow() {
            let _ = stream.shutdown().await;
            return;
        }
    }
}

/// Counts an authenticated connection against `resp.connections_max`: its guard,
/// or `None` when the node holds that many already (counted as rejected).
fn admit(front: &Arc<Front>) -> Option<Open> {
    let max = front.limits.connections_max;
    let admitted = front
        .connected
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1))
        .is_ok();
    if !admitted {
        front.rejected.fetch_add(1, Ordering::Relaxed);
        tracing::debug!("RESP connection refused: resp.connections_max reached");
        return None;
    }
    front.accepted.fetch_add(1, Ordering::Relaxed);
    Some(Open(front.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Command `i` of a run: ready at once when even, after `10 × i` ms when odd,
    /// and never when it is `never`.
    fn command(i: i64, never: i64) -> Pin<Box<impl Future<Output = Reply>>> {
        Box::pin(async move {
            if i == never {
                std::future::pending::<()>().await;
            }
            if i % 2 == 1 {
                tokio::time::sleep(Duration::from_millis(10 * i as u64)).await;
            }
            Reply::Int(i)
        })
    }

    #[test]
    fn a_batch_reads_each_request_from_the_buffer_in_order() {
        let limits = WireLimits { request_bytes_max: 1024, args_max: 8, arg_bytes_max: 1024 };
        let buf = b"*2\r\n$4\r\nINCR\r\n$1\r\na\r\n\r\nGET b\r\n*3\r\n$6\r\nINCRBY\r\n$2\r\ncc\r\n$1\r\n5\r\n*1\r\n$4\r\nPI";
        let (batch, fatal) = take_batch(buf, &limits);
        assert!(fatal.is_none());
        assert_eq!(batch.requests.len(), 3, "the blank line is skipped, the partial request waits");
        assert_eq!(&buf[batch.used..], b"*1\r\n$4\r\nPI");
        let mut args = Vec::new();
        let mut all = Vec::new();
        for i in 0..batch.requests.len() {
            batch.args(i, buf, &mut args);
            all.push(args.iter().map(|a| String::from_utf8_lossy(a).into_owned()).collect::<Vec<_>>());
        }
        assert_eq!(all, [vec!["INCR", "a"], vec!["GET", "b"], vec!["INCRBY", "cc", "5"]]);
        // Garbage stops the batch; what came before it still runs.
        let (batch, fatal) = take_batch(b"PING\r\n*x\r\n", &limits);
        assert_eq!((batch.requests.len(), fatal.map(|e| e.code)), (1, Some(wire::PROTOCOL_ERROR)));
    }

    #[test]
    fn what_a_browser_sends_is_told_apart_from_redis_commands() {
        fn words(line: &str) -> Vec<&[u8]> {
            line.split(' ').map(str::as_bytes).collect()
        }
        for line in [
            "POST / HTTP/1.1",
            "post /x",
            "Host: 127.0.0.1:6380",
            "HOST: x",
            "GET / HTTP/1.1",
            "PUT /v1 HTTP/2",
        ] {
            assert!(is_cross_protocol(&words(line)), "{line}");
        }
        for line in ["GET likes:1", "INCR post", "GET /x HTTP", "get / HTTP/1.1", "PING", "SET a HTTP/1.1 x"]
        {
            assert!(!is_cross_protocol(&words(line)), "{line}");
        }
        // In a pipeline, what comes before the attack runs; it and what follows do not.
        let limits = WireLimits { request_bytes_max: 1024, args_max: 8, arg_bytes_max: 1024 };
        let buf = b"PING\r\nPOST / HTTP/1.1\r\nHost: 127.0.0.1:6380\r\n\r\nDEL likes:1\r\n";
        let (batch, fatal) = take_batch(buf, &limits);
        assert!(fatal.is_none());
        assert_eq!((batch.requests.len(), batch.cross_protocol(buf)), (4, Some(1)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_run_answers_in_order_and_times_out_only_what_is_still_running() {
        let started = tokio::time::Instant::now();
        let replies = join_timed(Duration::from_millis(100), (0..8).map(|i| command(i, 6)).collect()).await;
        for (i, reply) in replies.iter().enumerate() {
            if i == 6 {
                assert!(matches!(reply, Reply::Error(e) if e.starts_with("ERR timeout ")), "{reply:?}");
            } else {
                assert_eq!(reply, &Reply::Int(i as i64), "reply {i}");
            }
        }
        // One deadline for the whole run, counted from its start.
        assert_eq!(started.elapsed(), Duration::from_millis(100));

        // A run that finishes before its deadline does not wait for it.
        let started = tokio::time::Instant::now();
        let replies = join_timed(Duration::from_millis(100), (0..8).map(|i| command(i, -1)).collect()).await;
        assert_eq!(replies, (0..8).map(Reply::Int).collect::<Vec<_>>());
        assert_eq!(started.elapsed(), Duration::from_millis(70), "the slowest command, 7, takes 70 ms");
    }
}
