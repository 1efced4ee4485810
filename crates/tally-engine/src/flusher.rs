//! Group commit: one fsync serves every write waiting for durability.
//!
//! Shards commit to the store (fast, in memory) and hand the replies of `sync`
//! increments here. The flusher task takes every waiter that has arrived, calls
//! [`Store::flush`] once on a blocking thread, then runs all of them. Waiters that
//! arrive during a flush wait for the next one, which also covers their commits.
//!
//! A failed flush poisons the engine: the operating system may have dropped the
//! unflushed pages, so nothing written since the last good flush can be promised.
//! Every waiter hears the error and the engine refuses writes until reopened.

use crate::stats::Stats;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tally_store::{Store, StoreError};
use tokio::sync::mpsc;

/// Work to run once the writes before it are durable (or the flush failed).
pub(crate) type Waiter = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

/// Most waiters one flush serves; the rest take the next flush.
pub const FLUSH_WAITERS_MAX: usize = 65_536;

/// A handle to the flusher task.
#[derive(Clone)]
pub(crate) struct Flusher {
    tx: mpsc::UnboundedSender<Waiter>,
    poisoned: Arc<AtomicBool>,
}

impl Flusher {
    /// Starts the flusher task.
    pub(crate) fn start(store: Arc<dyn Store>, stats: Arc<Stats>) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Waiter>();
        let poisoned = Arc::new(AtomicBool::new(false));
        let flag = poisoned.clone();
        tokio::spawn(async move {
            let mut batch: Vec<Waiter> = Vec::new();
            while let Some(first) = rx.recv().await {
                batch.push(first);
                while batch.len() < FLUSH_WAITERS_MAX {
                    match rx.try_recv() {
                        Ok(w) => batch.push(w),
                        Err(_) => break,
                    }
                }
                let result = if flag.load(Ordering::SeqCst) {
                    Err(StoreError::Io {
                        op: "flush",
                        message: "an earlier flush failed; reopen the store".into(),
                    })
                } else {
                    let store = store.clone();
                    match tokio::task::spawn_blocking(move || store.flush()).await {
                        Ok(r) => r,
                        Err(e) => {
                            Err(StoreError::Io { op: "flush", message: format!("flush task failed: {e}") })
                        }
                    }
                };
                if let Err(e) = &result {
                    if !flag.swap(true, Ordering::SeqCst) {
                        tracing::error!(error = %e, "store flush failed; refusing writes until restart");
                    }
                }
                stats.flushes.inc();
                stats.flush_waiters.record(batch.len() as u64);
                for w in batch.drain(..) {
                    w(result.clone());
                }
            }
        });
        Self { tx, poisoned }
    }

    /// Runs `waiter` after the next flush that starts after this call.
    pub(crate) fn after_flush(&self, waiter: Waiter) {
        if let Err(e) = self.tx.send(waiter) {
            (e.0)(Err(StoreError::Closed));
        }
    }

    /// Waits for the next flush.
    pub(crate) async fn flush(&self) -> Result<(), StoreError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.after_flush(Box::new(move |r| {
            let _ = tx.send(r);
        }));
        rx.await.unwrap_or(Err(StoreError::Closed))
    }

    /// Whether a flush has failed (the engine then refuses writes).
    pub(crate) fn poisoned(&self) -> bool {
        self.poisoned.load(Ordering::SeqCst)
    }
}
