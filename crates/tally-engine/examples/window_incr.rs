//! What a windowed increment costs through the engine, against a plain one: 64 writers
//! for a few seconds on one counter over a sled store in a temporary directory, for a
//! plain counter, one with windows `1m`, `1h`, `24h`, one with `distinct` (every
//! increment with a member), and one with both. Each row runs on a fresh engine; the
//! total is checked against the acknowledged increments with a fresh read.
//!
//! ```text
//! cargo run --release -p tally-engine --example window_incr [-- SECONDS]
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tally_core::window::WindowSet;
use tally_engine::{Consistency, Durability, Increment, SpecPatch, Tally, TallyConfig};

/// Concurrent writers per row.
const WRITERS: u64 = 64;

async fn row(
    seconds: u64,
    durability: Durability,
    windows: bool,
    distinct: bool,
) -> Result<(f64, usize), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let tally = Tally::open(dir.path(), TallyConfig::default()).await?;
    let patch = SpecPatch {
        shards: Some(8),
        durability: Some(durability),
        distinct: Some(distinct),
        windows: windows.then(|| WindowSet::parse(&["1m", "1h", "24h"]).expect("valid windows")),
        ..SpecPatch::default()
    };
    tally.put_counter("c", patch).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (t, stop, acked) = (tally.clone(), stop.clone(), acked.clone());
        writers.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Relaxed) {
                let mut inc = Increment::new(1).writer(format!("w{w}"));
                if distinct {
                    inc = inc.member(format!("m-{}", (w * 7_919 + n * 104_729) % 100_000));
                }
                t.incr("c", inc).await.expect("an increment is acknowledged");
                acked.fetch_add(1, Relaxed);
                n += 1;
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Relaxed);
    for w in writers {
        w.await?;
    }
    let rate = acked.load(Relaxed) as f64 / started.elapsed().as_secs_f64();
    let read = tally.read("c", Consistency::Fresh).await?;
    assert_eq!(read.value, i128::from(acked.load(Relaxed)), "every acknowledged increment counted once");
    let bytes = if windows { tally.window("c", "1h").await?.window_bytes as usize } else { 0 };
    tally.shutdown().await?;
    Ok((rate, bytes))
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let seconds: u64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    println!("{WRITERS} writers, 8 shards, {seconds} s per row, sled in a temporary directory");
    for durability in [Durability::Batched, Durability::Sync] {
        for (label, windows, distinct) in [
            ("plain", false, false),
            ("windows 1m 1h 24h", true, false),
            ("distinct", false, true),
            ("windows 1m 1h 24h + distinct", true, true),
        ] {
            let (rate, bytes) = row(seconds, durability, windows, distinct).await?;
            println!(
                "{:<8} {label:<30} {rate:>12.0} increments/s  {bytes:>9} B of buckets",
                durability.as_str()
            );
        }
    }
    Ok(())
}
