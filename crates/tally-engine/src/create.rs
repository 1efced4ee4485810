//! Creating counters on their first increment, many per metadata commit.
//!
//! An increment to a counter nobody created gives it the spec of the namespace its
//! name falls under, or the node's default (`MetaCommand::EnsureWith`, resolved by
//! the catalog against the namespaces it holds). Every counter keeps its metadata entry — listing,
//! deletion and resharding see it exactly as if it had been created with `PUT` —
//! but the creations that arrive while one commit is under way wait for the next
//! one and share it: [`Catalog::ensure_many`] writes them together (one store batch
//! and one flush for [`crate::LocalCatalog`]). So a burst of new counters costs one
//! commit per burst, not one per counter.
//!
//! One committer runs at a time: the first creation that finds none running starts
//! it as a task; it takes everything queued (at most [`CREATE_BATCH_MAX`] names per
//! commit), commits, answers, and goes on while more is queued. The queue holds one
//! entry per caller waiting for its counter, so it is bounded by the requests in
//! flight.
//!
//! A catalog that can answer a creation before writing it
//! ([`Catalog::ensure_deferred`]: the node's own catalog, for the `batched` default
//! spec) answers first, and the caller does not queue at all; one writer task at a
//! time ([`Creator::write_soon`]) then writes what was deferred, in one store batch
//! per pass, and goes on while creations were deferred during its pass. The engine
//! awaits [`Catalog::creation_written`] before it writes any shard of a counter, so
//! a shard is never written before its counter's entry even if that task is late.

use crate::catalog::Catalog;
use crate::clock::Clock;
use crate::error::TallyError;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use tally_core::meta::{CounterMeta, MetaEffect};
use tally_core::namespace::NamespaceSpec;
use tally_core::CounterName;
use tokio::sync::oneshot;

/// Most counters one metadata commit creates; the rest wait for the next.
pub const CREATE_BATCH_MAX: usize = 1024;

/// A creation's answer: the counter's metadata, what the commit did to it, and the
/// time taken before that commit (no shard of a counter created by it can hold
/// anything committed before then).
type Answer = Result<(CounterMeta, MetaEffect, u64), TallyError>;

/// The queue of creations and its committer.
pub(crate) struct Creator {
    catalog: Arc<dyn Catalog>,
    clock: Arc<dyn Clock>,
    /// What a counter under no namespace takes (`TallyConfig::default_spec`).
    default: NamespaceSpec,
    queue: Mutex<Vec<(CounterName, oneshot::Sender<Answer>)>>,
    running: AtomicBool,
    /// Creations the catalog deferred ([`Catalog::ensure_deferred`]), counted; the
    /// writer of deferred creations compares it before and after a write.
    deferred: AtomicU64,
    /// Whether a task writing deferred creations runs.
    writing: AtomicBool,
}

impl Creator {
    pub(crate) fn new(catalog: Arc<dyn Catalog>, clock: Arc<dyn Clock>, default: NamespaceSpec) -> Arc<Self> {
        Arc::new(Self {
            catalog,
            clock,
            default,
            queue: Mutex::new(Vec::new()),
            running: AtomicBool::new(false),
            deferred: AtomicU64::new(0),
            writing: AtomicBool::new(false),
        })
    }

    /// `name` exists once this returns: its metadata, whether this call's commit
    /// created it, and when that commit started.
    pub(crate) async fn ensure(self: &Arc<Self>, name: CounterName) -> Answer {
        let before_ms = self.clock.now_ms();
        match self.catalog.ensure_deferred(&name, before_ms, &self.default) {
            Some(Ok((meta, effect))) => {
                if effect == MetaEffect::Created {
                    self.deferred.fetch_add(1, SeqCst);
                    self.write_soon();
                }
                return Ok((meta, effect, before_ms));
            }
            Some(Err(e)) => return Err(e),
            None => {}
        }
        let (tx, rx) = oneshot::channel();
        self.queue.lock().push((name, tx));
        if !self.running.swap(true, SeqCst) {
            tokio::spawn(self.clone().commit_queued());
        }
        rx.await.unwrap_or(Err(TallyError::ShuttingDown))
    }

    /// Writes the deferred creations in a task, one such task at a time, until no
    /// creation was deferred during its last write.
    fn write_soon(self: &Arc<Self>) {
        if self.writing.swap(true, SeqCst) {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                let seen = me.deferred.load(SeqCst);
                let written = me.catalog.write_deferred().await;
                me.writing.store(false, SeqCst);
                if let Err(e) = written {
                    // They stay unwritten: the first write to one of their shards
                    // writes them first, or fails with this.
                    tracing::warn!(error = %e, "cannot write deferred counter creations yet");
                    return;
                }
                // A creation deferred during the write found a writer running and
                // started none: take it over, unless another writer already did.
                if me.deferred.load(SeqCst) == seen || me.writing.swap(true, SeqCst) {
                    return;
                }
            }
        });
    }

    /// Commits what is queued until nothing is.
    async fn commit_queued(self: Arc<Self>) {
        loop {
            let batch: Vec<_> = {
                let mut q = self.queue.lock();
                let n = q.len().min(CREATE_BATCH_MAX);
                q.drain(..n).collect()
            };
            if batch.is_empty() {
                self.running.store(false, SeqCst);
                // A creation queued after the take above and before the store saw
                // `running` set and started nobody: take it over, unless another
                // committer already did.
                if self.queue.lock().is_empty() || self.running.swap(true, SeqCst) {
                    return;
                }
                continue;
            }
            let (names, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            // A catalog that panics fails this batch, not every later creation.
            let before_ms = self.clock.now_ms();
            let commit =
                std::panic::AssertUnwindSafe(self.catalog.ensure_many(&names, before_ms, &self.default));
            let results = futures::FutureExt::catch_unwind(commit).await.unwrap_or_default();
            let mut results = results.into_iter();
            for (name, reply) in names.iter().zip(replies) {
                let answer = match results.next() {
                    Some(Ok((Some(meta), effect))) => Ok((meta, effect, before_ms)),
                    Some(Ok((None, _))) => Err(TallyError::NotFound(name.to_string())),
                    Some(Err(e)) => Err(e),
                    None => Err(TallyError::Unavailable {
                        shard: "metadata".into(),
                        reason: "the catalog answered fewer creations than it was asked".into(),
                    }),
                };
                let _ = reply.send(answer);
            }
        }
    }
}
