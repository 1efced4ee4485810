//! [`serve`]: accepts HTTP/1.1 connections and drives a router on each, with the
//! limits `axum::serve` does not offer.
//!
//! `axum::serve` has no header-read timeout, so a client that trickles its headers
//! (slowloris) would hold a connection and a task forever. This loop builds each
//! connection with hyper's own HTTP/1 builder instead, which closes a connection
//! whose headers do not arrive within `http.header_read_timeout_ms` (the same bound
//! closes idle keep-alive connections). It also caps simultaneous connections at
//! `http.connections_max` without letting silent sockets lock clients out: a full
//! listener closes the oldest connection that has not sent a request (or one idle
//! between requests for [`IDLE_EVICT_MIN_MS`]) to make room for a new one
//! (`tally_tls::admission`), and waits only while every connection is busy. It
//! shuts down gracefully: on the shutdown signal it stops accepting, lets every
//! in-flight request finish (bounded by `http.shutdown_grace_ms`), then returns.
//!
//! The listener and the shutdown future are passed in (as in mini-redis), so tests
//! bind port 0 and the binary binds the configured address and wires signals.
//!
//! [`serve_tls`] is the same loop with a TLS handshake first on each connection, in
//! the connection's own task and bounded by the header-read timeout, so a plaintext
//! or silent client fails alone (its connection is closed and logged at `warn`)
//! while the listener goes on.
//!
//! hyper 1 talks to sockets through its own `rt` traits; `hyper-util` provides the
//! Tokio adapters but is not a workspace dependency, so the two small adapters it
//! would supply ([`TokioIo`] and [`TokioTimer`]) live here.

use crate::config::HttpConfig;
use crate::repoll::Repoll;
use axum::Router;
use futures::FutureExt;
use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tally_tls::admission::{Admission, Slot};
use tally_tls::refusals;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// How long the accept loop pauses after an accept error (for example running out
/// of file descriptors), so it does not spin.
const ACCEPT_BACKOFF_MS: u64 = 100;
/// How long a connection must have been idle between requests before a full
/// listener may close it to make room, in milliseconds (one that never sent a
/// request may be closed at once): long enough that an answer just handed to
/// hyper has been written.
pub const IDLE_EVICT_MIN_MS: u64 = 1_000;
/// Bytes copied from the socket per read into hyper's buffer.
const READ_CHUNK_BYTES: usize = 8 * 1024;

/// Serves `app` on `listener` until `shutdown` completes, then drains.
///
/// Returns once every connection has closed, or when `http.shutdown_grace_ms` has
/// passed since the signal (remaining connections are then dropped). An `Err` is
/// reserved for failures of the listener itself.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: &HttpConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    serve_with(listener, None, app, limits, shutdown).await
}

/// [`serve`] over TLS: every connection first completes a handshake with
/// `acceptor` (see [`tally_tls::acceptor`]) within `http.header_read_timeout_ms`.
pub async fn serve_tls(
    listener: TcpListener,
    acceptor: tally_tls::TlsAcceptor,
    app: Router,
    limits: &HttpConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    serve_with(listener, Some(acceptor), app, limits, shutdown).await
}

async fn serve_with(
    listener: TcpListener,
    tls: Option<tally_tls::TlsAcceptor>,
    app: Router,
    limits: &HttpConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    let local = listener.local_addr()?;
    let handshake_timeout = limits.header_read_timeout();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer).header_read_timeout(limits.header_read_timeout()).keep_alive(true);
    let builder = Arc::new(builder);
    let admission = Admission::new(limits.connection_limit(), Duration::from_millis(IDLE_EVICT_MIN_MS));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    tracing::info!(%local, tls = tls.is_some(), "serving HTTP");

    loop {
        // Reap finished connection tasks so the set stays as small as the live ones.
        while connections.try_join_next().is_some() {}
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed; backing off");
                    tokio::time::sleep(Duration::from_millis(ACCEPT_BACKOFF_MS)).await;
                    continue;
                }
            },
        };
        // A full listener closes a connection that serves nobody to make room, or
        // waits for one to end (see `tally_tls::admission`).
        let evicted_before = admission.evictions();
        let permit = tokio::select! {
            _ = &mut shutdown => break,
            slot = admission.admit() => Arc::new(slot),
        };
        if admission.evictions() > evicted_before {
            refusals::count(tally_tls::Listener::Http, refusals::Reason::Evicted);
        }
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
        }
        let builder = builder.clone();
        let app = app.clone();
        let mut stop = stop_rx.clone();
        let tls = tls.clone();
        connections.spawn(async move {
            match tls {
                None => drive(stream, peer, &builder, app, &mut stop, permit).await,
                Some(acceptor) => {
                    let shaken = tokio::select! {
                        shaken = tokio::time::timeout(handshake_timeout, acceptor.accept(stream)) => shaken,
                        _ = permit.evicted() => return,
                    };
                    match shaken {
                        Ok(Ok(stream)) => drive(stream, peer, &builder, app, &mut stop, permit).await,
                        Ok(Err(e)) => tally_tls::refused_handshake(tally_tls::Listener::Http, peer, &e),
                        Err(_) => {
                            tally_tls::timed_out_handshake(tally_tls::Listener::Http, peer, handshake_timeout)
                        }
                    }
                }
            }
        });
    }

    drop(listener);
    while connections.try_join_next().is_some() {}
    let open = connections.len();
    tracing::info!(open, "stopped accepting; draining connections");
    let _ = stop_tx.send(true);
    let deadline = Instant::now() + limits.shutdown_grace();
    let drained =
        tokio::time::timeout_at(deadline.into(), async { while connections.join_next().await.is_some() {} })
            .await;
    if drained.is_err() {
        tracing::warn!(left = connections.len(), "shutdown grace elapsed; dropping remaining connections");
        connections.shutdown().await;
    }
    Ok(())
}

/// Serves HTTP/1.1 on one connection until it ends, or drains it once `stop` is
/// set, or drops it when its listener evicts it to make room (only while no
/// request is in flight on it: see `tally_tls::admission`).
async fn drive<S>(
    stream: S,
    peer: std::net::SocketAddr,
    builder: &hyper::server::conn::http1::Builder,
    app: Router,
    stop: &mut watch::Receiver<bool>,
    slot: Arc<Slot>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let marks = slot.clone();
    let service = hyper::service::service_fn(move |req: axum::http::Request<hyper::body::Incoming>| {
        // In flight from its headers to its answer: no candidate for eviction.
        let busy = marks.begin();
        tower::ServiceExt::oneshot(app.clone(), req).map(move |answer| {
            drop(busy);
            answer
        })
    });
    // Repolled: hyper wakes the connection's own task on every request with a body
    // (see `repoll`), which the scheduler would otherwise treat as a yield.
    let mut conn = Repoll::new(builder.serve_connection(TokioIo(stream), service));
    let mut draining = false;
    loop {
        tokio::select! {
            result = &mut conn => {
                if let Err(e) = result {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
                break;
            }
            _ = slot.evicted(), if !draining => {
                tracing::debug!(%peer, "connection closed to make room for a new one");
                if !slot.is_busy() {
                    break;
                }
                // A request began as it was chosen: answer it, then close.
                draining = true;
                conn.inner().graceful_shutdown();
            }
            changed = stop.wait_for(|stop| *stop), if !draining => {
                // Finish the request in flight, if any, then close; an idle
                // connection closes at once. A dropped sender means drain too.
                let _ = changed;
                draining = true;
                conn.inner().graceful_shutdown();
            }
        }
    }
}

/// A Tokio stream (TCP, or TLS over TCP) seen through hyper's I/O traits.
///
/// Reads go through a small stack buffer and `ReadBufCursor::put_slice`, because
/// filling hyper's cursor in place needs `unsafe` (which this workspace denies);
/// the extra copy is negligible next to the system call.
pub struct TokioIo<S = TcpStream>(pub S);

impl<S: AsyncRead + AsyncWrite + Unpin> hyper::rt::Read for TokioIo<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        // Left uninitialized: the socket fills what it reads, and only that is copied
        // (zeroing 8 KiB per read showed as `memset` in the request path's profile).
        let mut chunk = [const { MaybeUninit::<u8>::uninit() }; READ_CHUNK_BYTES];
        let n = buf.remaining().min(READ_CHUNK_BYTES);
        let mut read = ReadBuf::uninit(&mut chunk[..n]);
        match Pin::new(&mut self.get_mut().0).poll_read(cx, &mut read) {
            Poll::Ready(Ok(())) => {
                buf.put_slice(read.filled());
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> hyper::rt::Write for TokioIo<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }
}

/// hyper's timer on Tokio's clock: hyper needs one to enforce the header-read timeout.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioTimer;

impl hyper::rt::Timer for TokioTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(TokioSleep(Box::pin(tokio::time::sleep(duration))))
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(TokioSleep(Box::pin(tokio::time::sleep_until(deadline.into()))))
    }
}

/// A Tokio sleep as hyper's `Sleep`.
struct TokioSleep(Pin<Box<tokio::time::Sleep>>);

impl Future for TokioSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.as_mut().poll(cx)
    }
}

impl hyper::rt::Sleep for TokioSleep {}
