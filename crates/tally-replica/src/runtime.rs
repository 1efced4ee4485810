//! The async runtime of the range groups: openraft's tokio runtime, with the
//! election timeouts drawn from a per-thread generator that a simulation seeds.
//!
//! openraft draws each election timeout from its runtime's thread-local random
//! generator. Tokio's is seeded by the operating system, so two runs of one seed
//! of a simulation (every group of every node on one thread, on paused time)
//! would elect at different instants. [`RangeRuntime`] is tokio in every other
//! respect; its generator starts from the operating system's entropy and
//! [`seed_thread_rng`] restarts it from a seed.

use openraft::{AsyncRuntime, OptionalSend, TokioRuntime};
use rand08::rngs::StdRng;
use rand08::{RngCore, SeedableRng};
use std::cell::RefCell;
use std::future::Future;
use std::time::Duration;

thread_local! {
    static RNG: RefCell<StdRng> = RefCell::new(StdRng::from_entropy());
}

/// Restarts this thread's generator of election timeouts from `seed` (a
/// simulation does it at the start of each run, as it seeds its own draws).
pub fn seed_thread_rng(seed: u64) {
    RNG.with(|r| *r.borrow_mut() = StdRng::seed_from_u64(seed));
}

/// A handle to this thread's generator.
#[derive(Debug, Default, Clone, Copy)]
pub struct ThreadRng;

impl RngCore for ThreadRng {
    fn next_u32(&mut self) -> u32 {
        RNG.with(|r| r.borrow_mut().next_u32())
    }

    fn next_u64(&mut self) -> u64 {
        RNG.with(|r| r.borrow_mut().next_u64())
    }

    fn fill_bytes(&mut self, dest: &mut [u8]) {
        RNG.with(|r| r.borrow_mut().fill_bytes(dest))
    }

    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand08::Error> {
        RNG.with(|r| r.borrow_mut().try_fill_bytes(dest))
    }
}

/// openraft's tokio runtime with [`ThreadRng`].
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RangeRuntime;

impl AsyncRuntime for RangeRuntime {
    type JoinError = <TokioRuntime as AsyncRuntime>::JoinError;
    type JoinHandle<T: OptionalSend + 'static> = <TokioRuntime as AsyncRuntime>::JoinHandle<T>;
    type Sleep = <TokioRuntime as AsyncRuntime>::Sleep;
    type Instant = <TokioRuntime as AsyncRuntime>::Instant;
    type TimeoutError = <TokioRuntime as AsyncRuntime>::TimeoutError;
    type Timeout<R, T: Future<Output = R> + OptionalSend> = <TokioRuntime as AsyncRuntime>::Timeout<R, T>;
    type ThreadLocalRng = ThreadRng;
    type OneshotSender<T: OptionalSend> = <TokioRuntime as AsyncRuntime>::OneshotSender<T>;
    type OneshotReceiverError = <TokioRuntime as AsyncRuntime>::OneshotReceiverError;
    type OneshotReceiver<T: OptionalSend> = <TokioRuntime as AsyncRuntime>::OneshotReceiver<T>;

    fn spawn<T>(future: T) -> Self::JoinHandle<T::Output>
    where
        T: Future + OptionalSend + 'static,
        T::Output: OptionalSend + 'static,
    {
        TokioRuntime::spawn(future)
    }

    fn sleep(duration: Duration) -> Self::Sleep {
        TokioRuntime::sleep(duration)
    }

    fn sleep_until(deadline: Self::Instant) -> Self::Sleep {
        TokioRuntime::sleep_until(deadline)
    }

    fn timeout<R, F: Future<Output = R> + OptionalSend>(
        duration: Duration,
        future: F,
    ) -> Self::Timeout<R, F> {
        TokioRuntime::timeout(duration, future)
    }

    fn timeout_at<R, F: Future<Output = R> + OptionalSend>(
        deadline: Self::Instant,
        future: F,
    ) -> Self::Timeout<R, F> {
        TokioRuntime::timeout_at(deadline, future)
    }

    fn is_panic(join_error: &Self::JoinError) -> bool {
        TokioRuntime::is_panic(join_error)
    }

    fn thread_rng() -> Self::ThreadLocalRng {
        ThreadRng
    }

    fn oneshot<T>() -> (Self::OneshotSender<T>, Self::OneshotReceiver<T>)
    where
        T: OptionalSend,
    {
        TokioRuntime::oneshot()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand08::Rng;

    #[test]
    fn a_seeded_thread_draws_the_same_timeouts_again() {
        let draw = || (0..8).map(|_| RangeRuntime::thread_rng().gen_range(500..900u64)).collect::<Vec<_>>();
        seed_thread_rng(7);
        let first = draw();
        seed_thread_rng(7);
        assert_eq!(draw(), first);
        seed_thread_rng(8);
        assert_ne!(draw(), first);
    }
}
