//! A like storm on one hot counter, embedded: many writers, one `batched` counter
//! with 64 shards, a `sync` credits counter with retries, and a distinct count of
//! likers. Prints the totals and how the engine absorbed the load.
//!
//! ```text
//! cargo run --release -p tally-engine --example like_storm [-- SECONDS]
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tally_engine::{Consistency, Durability, Increment, SpecPatch, Tally, TallyConfig};

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let seconds: u64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    let dir = tempfile::tempdir()?;
    let tally = Tally::open(dir.path(), TallyConfig::default()).await?;

    let likes = SpecPatch { shards: Some(64), distinct: Some(true), ..SpecPatch::default() };
    tally.put_counter("likes:post-42", likes).await?;
    let credits = SpecPatch { shards: Some(8), durability: Some(Durability::Sync), ..SpecPatch::default() };
    tally.put_counter("credits:user-7", credits).await?;

    println!("like storm: 64 writers for {seconds}s on a 64-shard batched counter ...");
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut writers = Vec::new();
    for w in 0..64u64 {
        let (t, stop, acked) = (tally.clone(), stop.clone(), acked.clone());
        writers.push(tokio::spawn(async move {
            let writer = format!("web-{w}");
            let mut n = 0u64;
            while !stop.load(Relaxed) {
                // 100,000 distinct fans, each liking many times.
                let fan = (w * 7_919 + n * 104_729) % 100_000;
                let like = Increment::new(1).writer(writer.clone()).member(format!("fan-{fan}"));
                t.incr("likes:post-42", like).await.unwrap();
                n += 1;
            }
            acked.fetch_add(n, Relaxed);
        }));
    }
    // Meanwhile: credits with event ids, each sent twice as a flaky client would.
    let mut credited = 0;
    while started.elapsed() < Duration::from_secs(seconds) {
        let id = format!("purchase-{credited}");
        tally.incr("credits:user-7", Increment::new(5).event_id(id.clone())).await?;
        let retry = tally.incr("credits:user-7", Increment::new(5).event_id(id)).await?;
        assert!(retry.duplicate);
        credited += 1;
    }
    stop.store(true, Relaxed);
    for w in writers {
        w.await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let acked = acked.load(Relaxed);

    let fresh = tally.read("likes:post-42", Consistency::Fresh).await?;
    let cached = tally.read("likes:post-42", Consistency::Cached).await?;
    let fans = tally.distinct("likes:post-42").await?;
    let shards = tally.shards("likes:post-42").await?;
    let balance = tally.read("credits:user-7", Consistency::Fresh).await?;
    let stats = tally.stats();

    println!("likes acknowledged   {acked} ({:.0}/s)", acked as f64 / elapsed);
    println!("likes (fresh read)   {}", fresh.value);
    println!("likes (cached read)  {} ({} ms stale)", cached.value, cached.staleness_ms);
    println!("distinct fans        ~{} (±{:.1}%)", fans.estimate, fans.relative_error * 100.0);
    println!("shard skew           {:.2} over {} shards", shards.skew, shards.shards.len());
    println!("credits              {} from {credited} purchases sent twice each", balance.value);
    println!("dedup hits           {}", stats.dedup_hits.get());
    println!("store flushes        {}", stats.flushes.get());
    assert_eq!(fresh.value, i128::from(acked as i64), "every acknowledged like is counted once");
    assert_eq!(balance.value, 5 * credited);
    tally.shutdown().await?;
    Ok(())
}
