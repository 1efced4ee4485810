//! What Tally's two openraft users — the metadata group (`tally-raft`) and the
//! range groups (`tally-replica`) — share: an async runtime whose randomness a
//! simulation can seed.
//!
//! openraft draws each election timeout from its runtime's thread-local random
//! generator. Tokio's is seeded by the operating system, so two runs of one seed
//! of a simulation (every node on one thread, on paused time) would elect at
//! different instants. [`SeededRuntime`] is tokio in every other respect; its
//! generator starts from the operating system's entropy and [`seed_thread_rng`]
//! restarts it from a seed. The ids the groups draw (store incarnations, proposer
//! identities) come from the same generator ([`random_u128`], [`random_u64`]), so a
//! seeded simulation draws the same ids again.
//!
//! # Layout
//!
//! * [`seed_thread_rng`], [`ThreadRng`] — this thread's generator and a handle to
//!   it;
//! * [`random_u64`], [`random_u128`] — draws from it;
//! * [`SeededRuntime`] — openraft's tokio runtime with [`ThreadRng`] as its
//!   generator;
//! * [`keep_leading_run`] — what a replication stream's log read may answer: the
//!   entries from its start on, up to the first one missing.

#![forbid(unsafe_code)]

use openraft::{AsyncRuntime, OptionalSend, TokioRuntime};
use rand08::rngs::StdRng;
use rand08::{RngCore, SeedableRng};
use std::cell::RefCell;
use std::future::Future;
use std::time::Duration;

thread_local! {
    static RNG: RefCell<StdRng> = RefCell::new(StdRng::from_entropy());
}

/// Restarts this thread's generator (of election timeouts and of ids) from `seed`
/// (a simulation does it at the start of each run, as it seeds its own draws).
pub fn seed_thread_rng(seed: u64) {
    RNG.with(|r| *r.borrow_mut() = StdRng::seed_from_u64(seed));
}

/// A random number from this thread's generator: from the operating system's
/// entropy (a cryptographically strong generator), unless [`seed_thread_rng`]
/// seeded it.
pub fn random_u64() -> u64 {
    RNG.with(|r| r.borrow_mut().next_u64())
}

/// A random 128-bit number from this thread's generator (see [`random_u64`]).
pub fn random_u128() -> u128 {
    RNG.with(|r| {
        let mut r = r.borrow_mut();
        (u128::from(r.next_u64()) << 64) | u128::from(r.next_u64())
    })
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
pub struct SeededRuntime;

impl AsyncRuntime for SeededRuntime {
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
        let draw = || (0..8).map(|_| SeededRuntime::thread_rng().gen_range(500..900u64)).collect::<Vec<_>>();
        seed_thread_rng(7);
        let first = draw();
        seed_thread_rng(7);
        assert_eq!(draw(), first);
        seed_thread_rng(8);
        assert_ne!(draw(), first);
    }

    #[test]
    fn a_seeded_thread_draws_the_same_ids_again() {
        let draw = || (random_u128(), random_u64(), random_u128());
        seed_thread_rng(7);
        let first = draw();
        assert_ne!(first.0, first.2);
        seed_thread_rng(7);
        assert_eq!(draw(), first);
        seed_thread_rng(8);
        assert_ne!(draw(), first);
    }

    #[test]
    fn unseeded_threads_draw_different_ids() {
        let other = std::thread::spawn(random_u128).join().expect("thread");
        assert_ne!(random_u128(), other);
    }
}

/// Cuts `entries`, read from a raft log in index order for a replication stream
/// (`RaftLogReader::limited_get_log_entries` from `start`), to the run whose
/// indexes follow one another from `start`: nothing if `start` is missing, and
/// nothing past a missing index.
///
/// openraft allows a log read to leave entries out, and a replication stream sends
/// what its read answers as the entries that follow the one before `start`. A
/// stream of a leader that was deposed since it planned its read may find the log
/// purged or truncated and refilled under it; answered the entries past the gap,
/// it would send them as if nothing were missing, and a follower that took them
/// would hold a log with a hole (its group stops when it applies it). Answered
/// nothing, openraft sends a heartbeat instead and plans again.
pub fn keep_leading_run<T>(start: u64, entries: &mut Vec<T>, index: impl Fn(&T) -> u64) {
    let mut next = Some(start);
    let run = entries
        .iter()
        .take_while(|e| {
            let i = index(e);
            let follows = next == Some(i);
            next = i.checked_add(1);
            follows
        })
        .count();
    entries.truncate(run);
}

#[cfg(test)]
mod log_tests {
    use super::*;

    fn run(start: u64, mut entries: Vec<u64>) -> Vec<u64> {
        keep_leading_run(start, &mut entries, |i| *i);
        entries
    }

    #[test]
    fn a_read_keeps_the_entries_that_follow_its_start_without_a_gap() {
        assert_eq!(run(3, vec![3, 4, 5]), vec![3, 4, 5]);
        assert_eq!(run(0, vec![8, 9]), Vec::<u64>::new());
        assert_eq!(run(3, vec![3, 4, 6, 7]), vec![3, 4]);
        assert_eq!(run(3, vec![]), Vec::<u64>::new());
        assert_eq!(run(u64::MAX, vec![u64::MAX]), vec![u64::MAX]);
    }
}
