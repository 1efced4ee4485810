//! t76: what the process nemesis (t75) found, each reduced to a plain story on
//! 127.0.0.1 that needs neither root nor namespaces.
//!
//! **Two replaced disks, the first one leading.** With three copies a node may come
//! back with an empty disk and catch up from the others (t35, t45). The nemesis's
//! half-hour run (`TALLY_NEMESIS_SEED=11 TALLY_NEMESIS_MINUTES=30`) lost node3's disk
//! at 754 s and node2's at 890 s; node2 never became healthy again. Its log repeated,
//! for the 90 s the nemesis waited:
//!
//! ```text
//! WARN tally_raft::server: refused a raft RPC node=2 from=3 error=node 3 sent from store
//!   fd74fd69… but is recorded with store c70d94c4…: it must rejoin as a new incarnation
//! ```
//!
//! The emptied node2 replays the metadata log from the start. Once it has applied
//! node3's first store record (`c70d…`, from the cluster's start) and before it
//! reaches node3's second (`fd74…`, written when node3 came back empty), its raft
//! server judges node3's RPCs by that old record (`check_incarnation` in
//! `tally-raft/src/network.rs`, over the follower's applied `state.stores`) and
//! refuses them. When node3 leads the metadata group, those RPCs are the very
//! appends that would bring the newer record: node2 never caught up, and never
//! answered `/healthz` with 200. The story below makes node3 the leader on purpose.
//! A sender now states the log index by which it applied its own store's record
//! (`Guarded::from_applied`), and a receiver that applied less takes its RPCs.

use serde_json::json;
use std::time::{Duration, Instant};
use tally_tests::TestCluster;

/// Three copies of every shard.
const REPLICATED: &str = "cluster.replicas = 3\n";
/// How many times the leader is killed and restarted to hand the leadership to node3
/// (each election between two nodes picks it half the time).
const LEADER_DRAWS_MAX: usize = 12;
/// Counters created before node3's disk is replaced: each PUT is one entry of the
/// metadata log.
const PADDING_COUNTERS: usize = 400;
/// How long replicas of an emptied node may take to catch up.
const CATCH_UP_WAIT_MS: u64 = 60_000;

/// Kills node `i`, deletes its data directory and starts it again; waits until it
/// is healthy (`restart` fails otherwise) and its range replicas caught up.
async fn replace_disk(c: &TestCluster, i: usize) -> anyhow::Result<()> {
    c.node(i).kill();
    c.wipe(i)?;
    c.restart(i).await?;
    let deadline = Instant::now() + Duration::from_millis(CATCH_UP_WAIT_MS);
    'wait: loop {
        anyhow::ensure!(Instant::now() < deadline, "node{i}'s replicas did not catch up");
        for n in 1..=c.len() {
            let view = c.get(n, "/v1/cluster").await?;
            for r in view["ranges"].as_array().into_iter().flatten() {
                let replicas = r["replicas"].as_array().cloned().unwrap_or_default();
                let voters = replicas.iter().filter(|p| p["role"] == json!("voter")).count();
                if r["replicated_here"] == json!(true)
                    && (voters != 3 || replicas.iter().any(|p| p["current"] == json!(false)))
                {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    continue 'wait;
                }
            }
        }
        return Ok(());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_replaced_disk_catches_up_from_a_leader_whose_disk_was_replaced_before() -> anyhow::Result<()>
{
    let c = TestCluster::start_configured(3, &[], REPLICATED).await?;
    c.put_counter(1, "likes", json!({"shards": 8, "durability": "sync"})).await?;
    for n in 0..30 {
        let (status, body) =
            c.incr(1 + n % 3, "likes", json!({"delta": 1, "event_id": format!("e{n}")})).await?;
        anyhow::ensure!(status == 200, "{status} {body}");
    }
    // More metadata entries than one append carries (openraft's 300), so an emptied
    // node replays node3's first store record in an earlier append than its second.
    println!("phase: {PADDING_COUNTERS} counters created, one metadata entry each");
    for i in 0..PADDING_COUNTERS {
        c.put_counter(1 + i % 3, &format!("pad:{i}"), json!({"shards": 1})).await?;
    }
    println!("phase: node3's disk replaced");
    replace_disk(&c, 3).await?;

    println!("phase: node3 made the metadata leader");
    let mut draws = 0;
    loop {
        let leader = c.wait_leader().await?;
        println!("  leader: {leader}");
        if leader == "node3" {
            break;
        }
        anyhow::ensure!(draws < LEADER_DRAWS_MAX, "node3 never won an election in {draws} draws");
        draws += 1;
        let k: usize = leader.trim_start_matches("node").parse()?;
        c.node(k).kill();
        c.wait_leader().await?;
        c.restart(k).await?;
    }

    println!("phase: node1's disk replaced while node3 leads");
    let other = 1;
    replace_disk(&c, other).await?;
    for node in 1..=3 {
        let read = c.fresh(node, "likes").await?;
        assert_eq!((&read["value"], &read["complete"]), (&json!(30), &json!(true)), "node{node}: {read}");
    }
    Ok(())
}
