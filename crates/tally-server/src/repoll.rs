//! [`Repoll`]: a future that wakes itself while it runs is polled again at once,
//! instead of going back to the scheduler.
//!
//! hyper's HTTP/1 connection wakes its own task on every request with a body: the
//! handler takes the body's chunk, and the body channel then wakes the connection
//! side (to say there is room for the next chunk), which is the same task, still
//! running. Tokio treats a task woken while it runs as a yield: it goes to the back
//! of the queue and an idle worker is woken to steal it. With one client, that was a
//! futex, an `eventfd` write and a context switch on every increment (2.2 context
//! switches per request against 1.0 for a request without a body), and about twice
//! the CPU of a health check.
//!
//! The wrapper hands the future a waker of its own. A wake that arrives while the
//! future is being polled only marks it; when the poll returns `Pending` with the
//! mark set, the future is polled again, at most [`REPOLLS_MAX`] times in a row
//! before the wake goes to the scheduler after all (so a future that keeps waking
//! itself still yields). A wake at any other time goes straight to the task's waker.
//! Tokio's own request to yield, when a task has spent its cooperative budget, is
//! deferred until the task's poll returns, so it too reaches the task.

use futures::task::AtomicWaker;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

/// Most polls in a row a future that woke itself gets before it yields.
pub const REPOLLS_MAX: u32 = 16;

/// Not being polled: a wake goes to the task.
const IDLE: u8 = 0;
/// Being polled: a wake is only marked.
const POLLING: u8 = 1;
/// Being polled, and woken since the poll began.
const WOKEN: u8 = 2;

/// What the wrapper's waker shares with the wrapper.
struct Shared {
    state: AtomicU8,
    /// The waker of the task that polls the wrapper, registered on every poll.
    task: AtomicWaker,
}

impl Wake for Shared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Mark a poll under way; otherwise wake the task.
        match self.state.compare_exchange(POLLING, WOKEN, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) | Err(WOKEN) => {}
            Err(_) => self.task.wake(),
        }
    }
}

/// `F`, polled again at once when it wakes itself during a poll.
pub struct Repoll<F> {
    inner: Pin<Box<F>>,
    shared: Arc<Shared>,
    waker: Waker,
}

impl<F: Future> Repoll<F> {
    /// Wraps `inner`.
    pub fn new(inner: F) -> Self {
        let shared = Arc::new(Shared { state: AtomicU8::new(IDLE), task: AtomicWaker::new() });
        let waker = Waker::from(shared.clone());
        Self { inner: Box::pin(inner), shared, waker }
    }

    /// The wrapped future, to call its methods between polls.
    pub fn inner(&mut self) -> Pin<&mut F> {
        self.inner.as_mut()
    }
}

impl<F: Future> Future for Repoll<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        this.shared.task.register(cx.waker());
        let mut inner_cx = Context::from_waker(&this.waker);
        for _ in 0..REPOLLS_MAX {
            this.shared.state.store(POLLING, Ordering::Release);
            if let Poll::Ready(out) = this.inner.as_mut().poll(&mut inner_cx) {
                this.shared.state.store(IDLE, Ordering::Release);
                return Poll::Ready(out);
            }
            // Not woken during the poll: wait for a wake, which now goes to the task.
            if this.shared.state.compare_exchange(POLLING, IDLE, Ordering::AcqRel, Ordering::Acquire).is_ok()
            {
                return Poll::Pending;
            }
        }
        // Woken on every poll: yield, and come back.
        this.shared.state.store(IDLE, Ordering::Release);
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Counts the wakes the task gets.
    struct Counter(AtomicUsize);

    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Wakes itself on its first `n` polls, then is ready.
    struct SelfWaking {
        left: u32,
        polls: u32,
    }

    impl Future for SelfWaking {
        type Output = u32;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u32> {
            self.polls += 1;
            if self.left == 0 {
                return Poll::Ready(self.polls);
            }
            self.left -= 1;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    fn counting() -> (Arc<Counter>, Waker) {
        let counter = Arc::new(Counter(AtomicUsize::new(0)));
        (counter.clone(), Waker::from(counter))
    }

    #[test]
    fn a_future_that_wakes_itself_is_polled_again_without_waking_the_task() {
        let (wakes, waker) = counting();
        let mut f = Repoll::new(SelfWaking { left: 3, polls: 0 });
        let out = Pin::new(&mut f).poll(&mut Context::from_waker(&waker));
        assert_eq!(out, Poll::Ready(4));
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_future_that_keeps_waking_itself_still_yields() {
        let (wakes, waker) = counting();
        let mut f = Repoll::new(SelfWaking { left: u32::MAX, polls: 0 });
        let out = Pin::new(&mut f).poll(&mut Context::from_waker(&waker));
        assert!(out.is_pending());
        assert_eq!(f.inner.polls, REPOLLS_MAX);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1, "the task is woken to come back");
    }

    /// Pending until `ready` is set; keeps the waker it was polled with.
    struct Gate {
        ready: bool,
        waker: Option<Waker>,
    }

    impl Future for Gate {
        type Output = ();
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            if self.ready {
                return Poll::Ready(());
            }
            self.waker = Some(cx.waker().clone());
            Poll::Pending
        }
    }

    #[test]
    fn a_wake_between_polls_reaches_the_task() {
        let (wakes, waker) = counting();
        let mut f = Repoll::new(Gate { ready: false, waker: None });
        assert!(Pin::new(&mut f).poll(&mut Context::from_waker(&waker)).is_pending());
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0);
        // Woken later, from elsewhere (another thread here): the task hears it.
        let kept = f.inner.waker.take().unwrap();
        std::thread::spawn(move || kept.wake()).join().unwrap();
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        f.inner.ready = true;
        assert!(Pin::new(&mut f).poll(&mut Context::from_waker(&waker)).is_ready());
    }

    #[test]
    fn a_new_task_waker_replaces_the_old_one() {
        let (first, first_waker) = counting();
        let (second, second_waker) = counting();
        let mut f = Repoll::new(Gate { ready: false, waker: None });
        assert!(Pin::new(&mut f).poll(&mut Context::from_waker(&first_waker)).is_pending());
        assert!(Pin::new(&mut f).poll(&mut Context::from_waker(&second_waker)).is_pending());
        f.inner.waker.take().unwrap().wake();
        assert_eq!((first.0.load(Ordering::SeqCst), second.0.load(Ordering::SeqCst)), (0, 1));
    }
}
