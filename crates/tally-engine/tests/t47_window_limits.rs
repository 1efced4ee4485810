//! t47: window limits — a distributed rate limiter. A counter limited to `max` per
//! window never holds more than `max` in any span its window covers, across shards
//! that borrow each other's headroom; what leaves the window is headroom again.
//!
//! Time is tokio's paused time, so the engine's clock and every timer agree exactly
//! with what the test measures.

mod common;

use common::*;
use std::sync::Arc;
use tally_core::spec::WindowLimit;
use tally_core::window::WindowSet;
use tally_engine::{Clock, Durability, Increment, SpecPatch, TallyError};

const T0: u64 = 1_764_000_000_000 + 12_345;
const LIMIT: u64 = 100;
const MIN: u64 = 60_000;
/// A minute window's bucket width.
const BUCKET: u64 = 1_000;

fn limited(shards: u16) -> SpecPatch {
    SpecPatch {
        windows: Some(WindowSet::parse(&["1m", "1h"]).unwrap()),
        limit: Some(WindowLimit::parse("1m", LIMIT).unwrap()),
        rollup_ms: Some(0),
        ..spec(shards, Durability::Sync)
    }
}

/// The most acknowledged in one span the limit covers: increments submitted at or
/// after `t` and acknowledged by `t + MIN - BUCKET` were all stamped inside those 59
/// seconds, so all of them sat in buckets the shards kept at its end.
fn most_in_a_span(acked: &[(u64, u64)]) -> u64 {
    let starts = acked.iter().map(|(submitted, _)| *submitted);
    starts
        .map(|t| acked.iter().filter(|(s, a)| *s >= t && *a <= t + MIN - BUCKET).count() as u64)
        .max()
        .unwrap_or(0)
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_limit_holds_across_shards_and_comes_back_as_the_window_moves() {
    let (tally, _store, clock) = paused_engine_clock(T0).await;
    tally.put_counter("api", limited(4)).await.unwrap();
    let clock = Arc::new(clock);
    // 16 clients, each asking every 100 ms for three minutes: 160 requests a second
    // against 100 a minute.
    let mut tasks = Vec::new();
    for w in 0..16u32 {
        let (t, clock) = (tally.clone(), clock.clone());
        tasks.push(tokio::spawn(async move {
            let (mut acked, mut refused) = (Vec::new(), 0u64);
            for i in 0..1_800u32 {
                let submitted = clock.now_ms();
                match t.incr("api", Increment::new(1).event_id(format!("req-{w}-{i}"))).await {
                    Ok(o) => {
                        assert!(o.applied && !o.duplicate);
                        acked.push((submitted, clock.now_ms()));
                    }
                    Err(TallyError::BoundExceeded { bound, limit, .. }) => {
                        assert_eq!((bound.as_str(), limit), ("limit per 1m", LIMIT as i64));
                        refused += 1;
                    }
                    Err(e) => panic!("{e}"),
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            (acked, refused)
        }));
    }
    let (mut acked, mut refused) = (Vec::new(), 0);
    for t in tasks {
        let (a, r) = t.await.unwrap();
        acked.extend(a);
        refused += r;
    }
    let elapsed = clock.now_ms() - T0;
    let most = most_in_a_span(&acked);
    println!(
        "{} admitted, {refused} refused over {elapsed} ms; at most {most} in one 59 s span (limit {LIMIT})",
        acked.len()
    );
    assert!(most <= LIMIT, "{most} admitted within one span of the window");
    // The headroom comes back: about LIMIT a minute is admitted, minute after minute.
    let minutes = elapsed / MIN;
    assert!(acked.len() as u64 >= LIMIT * minutes * 9 / 10, "{} in {minutes} minutes", acked.len());
    let r = tally.window("api", "1m").await.unwrap();
    assert_eq!(r.limit, Some(LIMIT));
    assert!(r.value <= LIMIT as i128 && r.complete, "{r:?}");
    assert_eq!(r.remaining, Some(LIMIT - r.value as u64));
    let hour = tally.window("api", "1h").await.unwrap();
    assert_eq!((hour.value, hour.limit, hour.remaining), (acked.len() as i128, None, None), "no limit on 1h");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_limit_takes_additions_only_and_is_set_once() {
    let (tally, _store, _clock) = paused_engine_clock(T0).await;
    tally.put_counter("api", limited(2)).await.unwrap();
    let err = tally.incr("api", Increment::new(-1)).await.unwrap_err();
    assert!(matches!(err, TallyError::LimitNegative { delta: -1, .. }), "{err}");
    assert_eq!(err.code(), "invalid_delta");
    // A request larger than the whole limit is refused, never admitted in part.
    let err = tally.incr("api", Increment::new(LIMIT as i64 + 1)).await.unwrap_err();
    assert_eq!(err.code(), "bound_exceeded", "{err}");
    tally.incr("api", Increment::new(LIMIT as i64 / 2)).await.unwrap();
    let other = SpecPatch { limit: Some(WindowLimit::parse("1m", 5).unwrap()), ..SpecPatch::default() };
    let err = tally.put_counter("api", other).await.unwrap_err();
    assert_eq!(err.code(), "invalid_spec", "{err}");
    let reshard = SpecPatch { shards: Some(8), ..SpecPatch::default() };
    assert_eq!(tally.put_counter("api", reshard).await.unwrap_err().code(), "invalid_spec");
    let drop_window = SpecPatch { windows: Some(WindowSet::parse(&["1h"]).unwrap()), ..SpecPatch::default() };
    assert_eq!(tally.put_counter("api", drop_window).await.unwrap_err().code(), "invalid_spec");
    let batched = SpecPatch { durability: Some(Durability::Batched), ..limited(2) };
    assert_eq!(tally.put_counter("other", batched).await.unwrap_err().code(), "invalid_spec");
    tally.shutdown().await.unwrap();
}
