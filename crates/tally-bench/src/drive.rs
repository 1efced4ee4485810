//! The load driver: N writer tasks call one operation as fast as they can for a fixed
//! time, counting acknowledgements and recording latency.

use hdrhistogram::Histogram;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest latency the histograms hold, in nanoseconds (one hour; larger values saturate).
const LATENCY_NS_MAX: u64 = 3_600_000_000_000;

/// One measured operation. `Ok(())` means acknowledged (counted); an error is an
/// operation that was not acknowledged, described for the report.
pub trait Op: Send + Sync + 'static {
    /// Performs the operation once.
    fn call(&self) -> impl Future<Output = Result<(), String>> + Send;
}

/// What the writers of one cell did.
#[derive(Debug)]
pub struct Driven {
    /// Operations acknowledged.
    pub acked: u64,
    /// Operations that returned an error.
    pub errors: u64,
    /// The first error seen.
    pub first_error: Option<String>,
    /// From the first spawn to the last writer's end.
    pub elapsed: Duration,
    /// Latency of the timed calls, in nanoseconds.
    pub latency_ns: Histogram<u64>,
}

impl Driven {
    /// Acknowledged operations per second.
    pub fn rate(&self) -> f64 {
        self.acked as f64 / self.elapsed.as_secs_f64()
    }

    /// A latency quantile in microseconds (NaN when nothing was timed).
    pub fn quantile_us(&self, q: f64) -> f64 {
        if self.latency_ns.is_empty() {
            return f64::NAN;
        }
        self.latency_ns.value_at_quantile(q) as f64 / 1000.0
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, LATENCY_NS_MAX, 3).expect("valid histogram bounds")
}

/// Runs `writers` tasks calling `op` until `duration` has passed. Each writer times one
/// call in `sample_every` on average (1 = every call), with random gaps so that the
/// timed calls do not line up with anything periodic (such as the scheduler's budget). Writers cooperate with the scheduler through
/// [`tokio::task::consume_budget`]: an operation that completes without waiting would
/// otherwise never yield, and two such writers would starve every other task.
pub async fn drive<O: Op>(op: Arc<O>, writers: usize, duration: Duration, sample_every: u64) -> Driven {
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let (op, stop) = (op.clone(), stop.clone());
            let seed = 0x9e37_79b9_7f4a_7c15_u64.wrapping_mul(w as u64 + 1);
            tokio::spawn(async move { writer(&*op, &stop, sample_every, seed).await })
        })
        .collect();
    tokio::time::sleep(duration).await;
    stop.store(true, Relaxed);
    let mut out =
        Driven { acked: 0, errors: 0, first_error: None, elapsed: Duration::ZERO, latency_ns: histogram() };
    for t in tasks {
        let w = t.await.expect("writer task panicked");
        out.acked += w.acked;
        out.errors += w.errors;
        if out.first_error.is_none() {
            out.first_error = w.first_error;
        }
        out.latency_ns.add(&w.latency_ns).expect("histograms share bounds");
    }
    out.elapsed = started.elapsed();
    out
}

struct WriterResult {
    acked: u64,
    errors: u64,
    first_error: Option<String>,
    latency_ns: Histogram<u64>,
}

/// The number of calls before the next timed one: uniform in `0..2 * mean - 1`, so one
/// call in `mean` is timed on average (xorshift64; `state` must not be zero).
fn gap(state: &mut u64, mean: u64) -> u64 {
    if mean <= 1 {
        return 0;
    }
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state % (2 * mean - 1)
}

async fn writer<O: Op>(op: &O, stop: &AtomicBool, sample_every: u64, seed: u64) -> WriterResult {
    let mut r = WriterResult { acked: 0, errors: 0, first_error: None, latency_ns: histogram() };
    let mut rng = seed | 1;
    // Counts down to the next timed call (cheaper than a modulo per call).
    let mut until_timed = gap(&mut rng, sample_every);
    while !stop.load(Relaxed) {
        let result = if until_timed == 0 {
            until_timed = gap(&mut rng, sample_every);
            let t = Instant::now();
            let result = op.call().await;
            r.latency_ns.saturating_record(t.elapsed().as_nanos() as u64);
            result
        } else {
            until_timed -= 1;
            op.call().await
        };
        match result {
            Ok(()) => r.acked += 1,
            Err(e) => {
                r.errors += 1;
                r.first_error.get_or_insert(e);
            }
        }
        tokio::task::consume_budget().await;
    }
    r
}

#[cfg(test)]
mod tests {
    use super::gap;

    #[test]
    fn gaps_average_to_the_sampling_interval() {
        let mut s = 12345;
        assert_eq!(gap(&mut s, 1), 0);
        let n = 100_000;
        let total: u64 = (0..n).map(|_| gap(&mut s, 64) + 1).sum();
        let mean = total as f64 / n as f64;
        assert!((mean - 64.0).abs() < 1.0, "{mean}");
    }
}
