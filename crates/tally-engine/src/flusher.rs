//! The commit path: every shard write, and group commit over them.
//!
//! Shards do not write to the store themselves. They decide a batch, hand the write
//! here and wait until it is *applied* (visible to reads, not yet durable). One task
//! runs cycles: it takes every job that has arrived, applies the writes in one
//! [`Store::commit_many`] on a blocking thread (sled: one atomic batch per tree), tells
//! each shard its write is applied, and then — if anyone waits for durability — calls
//! [`Store::flush`] once and runs the waiters.
//!
//! Why one place: sled serializes writes against flushes (a flush holds the log for
//! its whole write and fsync), so shards that commit on their own threads alternate
//! with the fsyncs and each fsync covers only the few commits that slipped in between.
//! Here the writes of a cycle never wait for a flush, and a shard whose write is
//! applied decides its next batch while the fsync runs: each shard commits once per
//! fsync, and one fsync serves every shard.
//!
//! A shard waits for its write to be applied before it goes on, so the store is never
//! behind what the shard decided: dedup lookups, a restarted actor and fresh reads all
//! see every decided batch.
//!
//! A failed flush poisons the engine: the operating system may have dropped the
//! unflushed pages, so nothing written since the last good flush can be promised.
//! Every waiter hears the error and the engine refuses writes until reopened.

use crate::stats::Stats;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tally_core::ShardId;
use tally_store::{ShardWrite, Store, StoreError};
use tokio::sync::{mpsc, oneshot};

/// Work to run once the writes before it are durable (or the flush failed).
pub(crate) type Waiter = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

/// Most jobs one cycle takes (writes applied and waiters served by one flush); the
/// rest take the next cycle.
pub const CYCLE_JOBS_MAX: usize = 65_536;

// Nearly every job is a commit: boxing its write would cost an allocation per write
// to make the rare `Flush` smaller.
#[allow(clippy::large_enum_variant)]
enum Job {
    /// Apply `write`, report it on `applied`, then run `durable` after the flush.
    Commit {
        id: ShardId,
        write: ShardWrite,
        applied: oneshot::Sender<Result<(), StoreError>>,
        durable: Option<Waiter>,
    },
    /// Run the waiter after the next flush.
    Flush(Waiter),
}

/// The name of the thread that runs the commit cycles of a store that blocks.
pub const COMMIT_THREAD_NAME: &str = "tally-commit";

/// `first` and every job already queued behind it, at most [`CYCLE_JOBS_MAX`].
fn take_more(first: Job, mut next: impl FnMut() -> Option<Job>) -> Vec<Job> {
    let mut jobs = vec![first];
    while jobs.len() < CYCLE_JOBS_MAX {
        match next() {
            Some(j) => jobs.push(j),
            None => break,
        }
    }
    jobs
}

/// A handle to the commit task.
#[derive(Clone)]
pub(crate) struct Flusher {
    tx: mpsc::UnboundedSender<Job>,
    poisoned: Arc<AtomicBool>,
    progress: Arc<Progress>,
}

/// How far the commit path got: writes applied, and applied writes made durable.
#[derive(Default)]
struct Progress {
    applied: AtomicU64,
    durable: AtomicU64,
    /// The flush under way: how many applied writes it covers, and the waiters that
    /// joined it after it started (see [`Flusher::make_durable`]).
    flushing: parking_lot::Mutex<(Option<u64>, Vec<Waiter>)>,
}

fn poison_error() -> StoreError {
    StoreError::Io { op: "flush", message: "an earlier flush failed; reopen the store".into() }
}

impl Flusher {
    /// Starts the commit task.
    pub(crate) fn start(store: Arc<dyn Store>, stats: Arc<Stats>) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
        let poisoned = Arc::new(AtomicBool::new(false));
        let flag = poisoned.clone();
        let progress = Arc::new(Progress::default());
        let seen = progress.clone();
        // A store whose writes wait on other nodes (a replicated one) is driven by a
        // task that awaits them: no thread is held while a quorum answers.
        if store.waits() {
            tokio::spawn(async move {
                while let Some(first) = rx.recv().await {
                    let jobs = take_more(first, || rx.try_recv().ok());
                    let mut cycle = Cycle::new(jobs);
                    let results = if cycle.writes.is_empty() || flag.load(Ordering::SeqCst) {
                        cycle.refused()
                    } else {
                        store.commit_many_async(&cycle.writes).await
                    };
                    let waiting = cycle.applied(results, &stats, &seen);
                    if store.durable_on_commit() {
                        // What was applied is durable: reads need no flush.
                        seen.durable.fetch_max(seen.applied.load(Ordering::SeqCst), Ordering::SeqCst);
                    }
                    if waiting {
                        let covered = Cycle::flush_starts(&seen);
                        let result = if flag.load(Ordering::SeqCst) {
                            Err(poison_error())
                        } else {
                            store.flush_async().await
                        };
                        cycle.flushed(result, covered, &flag, &stats, &seen);
                    }
                }
            });
            return Self { tx, poisoned, progress };
        }
        // A store that never blocks (the in-memory one) is driven inline by a task, so
        // a simulation stays on one thread.
        if !store.blocks() {
            tokio::spawn(async move {
                while let Some(first) = rx.recv().await {
                    let jobs = take_more(first, || rx.try_recv().ok());
                    cycle(&*store, jobs, &flag, &stats, &seen);
                }
            });
            return Self { tx, poisoned, progress };
        }
        // A store that blocks gets a thread of its own that waits on the queue: a
        // task handing each cycle to `spawn_blocking` cost one more thread wake-up
        // per cycle, on the path of every `sync` acknowledgement (a lone `sync`
        // writer paid it once per increment). The thread ends when the last handle
        // is dropped.
        let run = move || {
            while let Some(first) = rx.blocking_recv() {
                let jobs = take_more(first, || rx.try_recv().ok());
                // A panic in the store drops the jobs' senders: every waiter hears
                // `Closed`, which callers treat like a failed write.
                let one = std::panic::AssertUnwindSafe(|| cycle(&*store, jobs, &flag, &stats, &seen));
                if std::panic::catch_unwind(one).is_err() {
                    tracing::error!("commit cycle failed");
                }
            }
        };
        if let Err(e) = std::thread::Builder::new().name(COMMIT_THREAD_NAME.into()).spawn(run) {
            // No thread: every job is refused (its sender is dropped with the closure).
            tracing::error!(error = %e, "cannot start the commit thread");
        }
        Self { tx, poisoned, progress }
    }

    /// Returns once every shard write applied before this call is durable: at once if
    /// it is already, else after the next flush. A read that saw applied values makes
    /// them durable this way before it answers.
    ///
    /// No write is applied while a flush runs (one task applies, then flushes), so
    /// a read that finds a flush under way usually needs nothing more than that flush:
    /// it joins it instead of queueing for the one after, which would start only once
    /// the next cycle's writes are applied.
    pub(crate) async fn make_durable(&self) -> Result<(), StoreError> {
        let applied = self.progress.applied.load(Ordering::SeqCst);
        if self.progress.durable.load(Ordering::SeqCst) >= applied && !self.poisoned() {
            return Ok(());
        }
        let (tx, rx) = oneshot::channel();
        let joined = {
            let mut flushing = self.progress.flushing.lock();
            match flushing.0 {
                Some(covered) if covered >= applied => {
                    flushing.1.push(Box::new(move |r| {
                        let _ = tx.send(r);
                    }));
                    true
                }
                _ => false,
            }
        };
        if joined {
            return rx.await.unwrap_or(Err(StoreError::Closed));
        }
        self.flush().await
    }

    /// Applies `write` to shard `id` and returns once it is applied (readable, not
    /// yet durable). `durable`, if given, runs after the flush that follows, or with
    /// the error if the write or the flush failed.
    pub(crate) async fn commit(
        &self,
        id: ShardId,
        write: ShardWrite,
        durable: Option<Waiter>,
    ) -> Result<(), StoreError> {
        let (applied, rx) = oneshot::channel();
        if let Err(e) = self.tx.send(Job::Commit { id, write, applied, durable }) {
            if let Job::Commit { durable: Some(w), .. } = e.0 {
                w(Err(StoreError::Closed));
            }
            return Err(StoreError::Closed);
        }
        rx.await.unwrap_or(Err(StoreError::Closed))
    }

    /// Runs `waiter` after the next flush that starts after this call.
    pub(crate) fn after_flush(&self, waiter: Waiter) {
        if let Err(e) = self.tx.send(Job::Flush(waiter)) {
            if let Job::Flush(w) = e.0 {
                w(Err(StoreError::Closed));
            }
        }
    }

    /// Waits for the next flush.
    pub(crate) async fn flush(&self) -> Result<(), StoreError> {
        let (tx, rx) = oneshot::channel();
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

/// Where a write's shard hears that it is applied, and what runs once it is durable.
type Reply = (oneshot::Sender<Result<(), StoreError>>, Option<Waiter>);

/// The jobs of one cycle, split into the writes it applies and what waits for them.
struct Cycle {
    writes: Vec<(ShardId, ShardWrite)>,
    replies: Vec<Reply>,
    waiters: Vec<Waiter>,
}

impl Cycle {
    fn new(jobs: Vec<Job>) -> Self {
        let mut cycle = Cycle { writes: Vec::new(), replies: Vec::new(), waiters: Vec::new() };
        for job in jobs {
            match job {
                Job::Commit { id, write, applied, durable } => {
                    cycle.writes.push((id, write));
                    cycle.replies.push((applied, durable));
                }
                Job::Flush(w) => cycle.waiters.push(w),
            }
        }
        cycle
    }

    /// The answers to the cycle's writes when none may be applied (a poisoned engine).
    fn refused(&self) -> Vec<Result<(), StoreError>> {
        self.writes.iter().map(|_| Err(poison_error())).collect()
    }

    /// Answers each write with its result; true if anyone waits for a flush.
    fn applied(&mut self, results: Vec<Result<(), StoreError>>, stats: &Stats, progress: &Progress) -> bool {
        assert_eq!(results.len(), self.writes.len(), "the store answers every write of a cycle");
        let mut applied = 0u64;
        let replies = std::mem::take(&mut self.replies);
        for (((id, _), (reply, durable)), result) in self.writes.iter().zip(replies).zip(results) {
            match result {
                Ok(()) => {
                    applied += 1;
                    progress.applied.fetch_add(1, Ordering::SeqCst);
                    let _ = reply.send(Ok(()));
                    self.waiters.extend(durable);
                }
                Err(e) => {
                    tracing::error!(shard = %id, error = %e, "shard commit failed");
                    if let Some(w) = durable {
                        w(Err(e.clone()));
                    }
                    let _ = reply.send(Err(e));
                }
            }
        }
        stats.cycle_commits.record(applied);
        !self.waiters.is_empty()
    }

    /// A flush starts: it covers everything applied so far, which reads may join.
    fn flush_starts(progress: &Progress) -> u64 {
        let covered = progress.applied.load(Ordering::SeqCst);
        progress.flushing.lock().0 = Some(covered);
        covered
    }

    /// Runs the waiters, with those that joined the flush while it ran, with the
    /// flush's result; `covered` is what was applied before the flush started.
    fn flushed(
        mut self,
        result: Result<(), StoreError>,
        covered: u64,
        poisoned: &AtomicBool,
        stats: &Stats,
        progress: &Progress,
    ) {
        if result.is_ok() {
            progress.durable.fetch_max(covered, Ordering::SeqCst);
        }
        let joined = {
            let mut flushing = progress.flushing.lock();
            flushing.0 = None;
            std::mem::take(&mut flushing.1)
        };
        self.waiters.extend(joined);
        if let Err(e) = &result {
            if !poisoned.swap(true, Ordering::SeqCst) {
                tracing::error!(error = %e, "store flush failed; refusing writes until restart");
            }
        }
        stats.flushes.inc();
        stats.flush_waiters.record(self.waiters.len() as u64);
        for w in self.waiters {
            w(result.clone());
        }
    }
}

/// One cycle: apply every write in arrival order, then flush once for the waiters.
fn cycle(store: &dyn Store, jobs: Vec<Job>, poisoned: &AtomicBool, stats: &Stats, progress: &Progress) {
    let mut cycle = Cycle::new(jobs);
    // Every write of the cycle in one call: the store groups them into as few atomic
    // batches as it can.
    let results = if cycle.writes.is_empty() || poisoned.load(Ordering::SeqCst) {
        cycle.refused()
    } else {
        store.commit_many(&cycle.writes)
    };
    if !cycle.applied(results, stats, progress) {
        return;
    }
    let covered = Cycle::flush_starts(progress);
    let result = if poisoned.load(Ordering::SeqCst) { Err(poison_error()) } else { store.flush() };
    cycle.flushed(result, covered, poisoned, stats, progress);
}
