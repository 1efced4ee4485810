//! How a node's resident memory and disk grow with retained dedup records, with the
//! engine left out: commits shaped like a `sync` counter's (one image and a batch of
//! new event-id records per commit) straight into a [`SledStore`], printing RSS and
//! the store's size as the records accumulate.
//!
//!   cargo run --release -p tally-store --example dedup_rss -- DIR IDS [PER_COMMIT] [CACHE_MB]

use std::time::Instant;
use tally_core::dedup::DedupRecord;
use tally_core::ids::ShardId;
use tally_core::shard::{ShardImage, ShardWrite};
use tally_store::{SledConfig, SledStore, Store};

fn rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).ok_or("usage: dedup_rss DIR IDS [PER_COMMIT] [CACHE_MB]")?;
    let ids: u64 = args.get(2).ok_or("IDS")?.parse()?;
    let per_commit: u64 = args.get(3).map_or(Ok(64), |s| s.parse())?;
    let cache_mb: u64 = args.get(4).map_or(Ok(64), |s| s.parse())?;
    let config = SledConfig { cache_capacity_bytes: cache_mb << 20, ..SledConfig::new(dir) };
    let store = SledStore::open(&config)?;
    let id = ShardId::new(tally_core::CounterName::new("bench:dedup")?, 0, 0);
    let started = Instant::now();
    println!("ids,rss_kb,disk_bytes,seconds");
    println!("0,{},{},0", rss_kb(), store.size_on_disk()?);
    let (mut n, mut value) = (0u64, 0i64);
    let every = (ids / 20).max(1);
    while n < ids {
        let take = per_commit.min(ids - n);
        let dedup_put = (n..n + take)
            .map(|i| (format!("w1764600000-{}-{i}", i % 64), DedupRecord { delta: 1, applied_at_ms: 1 }))
            .collect();
        value += take as i64;
        n += take;
        let write = ShardWrite {
            image: ShardImage { value, sketch: None, frequency: None, windows: None, escrow: None },
            dedup_put,
            dedup_remove: Vec::new(),
        };
        store.commit(&id, &write)?;
        if n % every < take {
            store.flush()?;
            println!("{n},{},{},{:.1}", rss_kb(), store.size_on_disk()?, started.elapsed().as_secs_f64());
        }
    }
    Ok(())
}
