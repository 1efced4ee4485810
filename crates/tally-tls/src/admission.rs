//! Who keeps a connection when a listener is full.
//!
//! A listener that makes newcomers wait while it is full can be locked by anyone
//! who opens enough sockets and says nothing: every slot is then held by a client
//! that never sends a request, and clients that would send one wait in the kernel's
//! backlog until the idle ones time out — and are opened again. An [`Admission`]
//! instead makes room for a newcomer by closing a connection that is doing nothing
//! for anyone:
//!
//! 1. the oldest one that has not yet sent a request ([`Slot::begin`] never called:
//!    a silent or trickling client, or one still in its TLS handshake);
//! 2. else the one idle the longest between requests, once idle for at least
//!    `idle_min` (a client's keep-alive connection it may reuse; it reconnects);
//! 3. else nobody: every connection has a request in flight or just answered one,
//!    and the newcomer waits ([`Admission::admit`]) until one closes or becomes a
//!    candidate.
//!
//! A flood of silent connections therefore churns through the slots of other
//! silent connections, and a client that connects and sends its request at once is
//! served: the connections closed to make room for it are the flood's.
//!
//! The listener drives it: [`Admission::admit`] after each accept gives the
//! connection its [`Slot`], which the connection's task holds until it ends and
//! watches ([`Slot::evicted`]) to close when asked; [`Slot::begin`] marks a request
//! in flight until its guard drops.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// How often a full listener with no candidate to close looks again, in
/// milliseconds (it also wakes at once when a connection ends).
pub const ADMISSION_RECHECK_MS: u64 = 25;

/// What a connection's task and its listener share.
#[derive(Debug)]
struct Shared {
    /// Requests in flight.
    in_flight: AtomicU32,
    /// Whether a request ever began.
    served: AtomicBool,
    /// When the last request ended, in ms since the admission's epoch.
    idle_since_ms: AtomicU64,
    /// Set when the listener closes it to make room.
    evicted: AtomicBool,
    /// Wakes the connection's task when it is evicted.
    notify: Notify,
}

#[derive(Debug, Default)]
struct Table {
    next: u64,
    /// Live connections by admission order.
    slots: BTreeMap<u64, Arc<Shared>>,
}

/// The connections of one listener, at most `cap` of them (see the module docs).
#[derive(Debug)]
pub struct Admission {
    cap: usize,
    idle_min: Duration,
    epoch: Instant,
    table: Mutex<Table>,
    /// Wakes an [`Admission::admit`] waiting for room.
    freed: Notify,
    /// Connections closed to make room, for the listener's metrics.
    evictions: AtomicU64,
}

/// A connection's place in its listener: released when dropped.
#[derive(Debug)]
pub struct Slot {
    id: u64,
    admission: Arc<Admission>,
    shared: Arc<Shared>,
}

/// A request in flight on a [`Slot`]: the connection is no candidate for eviction
/// until it drops (and for `idle_min` after).
#[derive(Debug)]
pub struct Busy(Arc<Shared>, Instant);

impl Admission {
    /// A listener of at most `cap` connections (at least 1) that closes one idle
    /// between requests only after `idle_min`.
    pub fn new(cap: usize, idle_min: Duration) -> Arc<Self> {
        Arc::new(Self {
            cap: cap.max(1),
            idle_min,
            epoch: Instant::now(),
            table: Mutex::new(Table::default()),
            freed: Notify::new(),
            evictions: AtomicU64::new(0),
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Connections held now.
    pub fn len(&self) -> usize {
        self.table().slots.len()
    }

    /// Whether no connection is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Connections closed to make room so far.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// A slot now, making room by evicting a candidate if full; `None` when full
    /// with no candidate.
    pub fn try_admit(self: &Arc<Self>) -> Option<Slot> {
        let now = self.now_ms();
        let idle_min = u64::try_from(self.idle_min.as_millis()).unwrap_or(u64::MAX);
        let mut table = self.table();
        if table.slots.len() >= self.cap {
            let mut silent = None;
            let mut idle: Option<(u64, u64)> = None;
            for (id, s) in &table.slots {
                if s.in_flight.load(Ordering::Acquire) > 0 {
                    continue;
                }
                if !s.served.load(Ordering::Acquire) {
                    silent = Some(*id);
                    break;
                }
                let since = s.idle_since_ms.load(Ordering::Acquire);
                if now.saturating_sub(since) >= idle_min && idle.is_none_or(|(_, best)| since < best) {
                    idle = Some((*id, since));
                }
            }
            let victim = silent.or(idle.map(|(id, _)| id))?;
            if let Some(s) = table.slots.remove(&victim) {
                s.evicted.store(true, Ordering::Release);
                s.notify.notify_one();
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        let id = table.next;
        table.next += 1;
        let shared = Arc::new(Shared {
            in_flight: AtomicU32::new(0),
            served: AtomicBool::new(false),
            idle_since_ms: AtomicU64::new(now),
            evicted: AtomicBool::new(false),
            notify: Notify::new(),
        });
        table.slots.insert(id, shared.clone());
        Some(Slot { id, admission: self.clone(), shared })
    }

    /// A slot, waiting while the listener is full with no candidate to evict (a
    /// connection ending, or one becoming a candidate, makes room).
    pub async fn admit(self: &Arc<Self>) -> Slot {
        loop {
            let freed = self.freed.notified();
            if let Some(slot) = self.try_admit() {
                return slot;
            }
            let _ = tokio::time::timeout(Duration::from_millis(ADMISSION_RECHECK_MS), freed).await;
        }
    }
}

impl Slot {
    /// Marks a request in flight until the guard drops.
    pub fn begin(&self) -> Busy {
        self.shared.served.store(true, Ordering::Release);
        self.shared.in_flight.fetch_add(1, Ordering::AcqRel);
        Busy(self.shared.clone(), self.admission.epoch)
    }

    /// Resolves once the listener evicted this connection to make room: its task
    /// should close it.
    pub async fn evicted(&self) {
        loop {
            let notified = self.shared.notify.notified();
            if self.shared.evicted.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// Whether a request is in flight on it (one may begin just as the listener
    /// chose it: its task then finishes that request before closing).
    pub fn is_busy(&self) -> bool {
        self.shared.in_flight.load(Ordering::Acquire) > 0
    }

    /// Whether the listener evicted this connection.
    pub fn is_evicted(&self) -> bool {
        self.shared.evicted.load(Ordering::Acquire)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.admission.table().slots.remove(&self.id);
        self.admission.freed.notify_waiters();
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let now = u64::try_from(self.1.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.0.idle_since_ms.store(now, Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_full_listener_makes_room_by_closing_the_connection_that_serves_nobody() {
        let a = Admission::new(3, Duration::from_millis(1000));
        let first = a.try_admit().expect("room");
        let second = a.try_admit().expect("room");
        let third = a.try_admit().expect("room");
        // The first and third send requests; the second stays silent.
        let busy = first.begin();
        drop(third.begin());
        let fourth = a.try_admit().expect("the silent one makes room");
        assert!(second.is_evicted() && !first.is_evicted() && !third.is_evicted());
        tokio::time::timeout(Duration::from_millis(1), second.evicted()).await.expect("told");
        assert_eq!((a.len(), a.evictions()), (3, 1));
        // Full again: the fourth is silent, so it goes next.
        let _fifth = a.try_admit().expect("room");
        assert!(fourth.is_evicted());
        // One busy, one just idle, one silent (the fifth): the fifth goes.
        let sixth = a.try_admit().expect("room");
        let _sixth_busy = sixth.begin();
        // One busy (first), one idle for less than idle_min (third), one busy (sixth):
        // nobody is a candidate.
        assert!(a.try_admit().is_none());
        tokio::time::advance(Duration::from_millis(1000)).await;
        let seventh = a.try_admit().expect("the third has idled long enough");
        let _seventh_busy = seventh.begin();
        assert!(third.is_evicted() && !first.is_evicted());
        drop(busy);
        assert!(a.try_admit().is_none(), "the first just finished its request");
        // A connection that ends frees its slot for a waiting newcomer.
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.admit().await }
        });
        tokio::task::yield_now().await;
        drop(first);
        let admitted = tokio::time::timeout(Duration::from_millis(100), waiting).await;
        assert!(matches!(admitted, Ok(Ok(_))), "{admitted:?}");
    }
}
