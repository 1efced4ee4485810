//! t45: a node's disk is replaced. Node3 of three is killed with SIGKILL, its data
//! directory deleted, and it is started again with an empty disk. It must not rejoin
//! the metadata group under its old identity (the leader would see a voter whose log
//! is shorter than what it acknowledged), and no read may report the shards it lost
//! as a complete total. After the operator accepts the loss, the node serves again.

use serde_json::json;
use std::time::{Duration, Instant};
use tally_tests::TestCluster;

const INCREMENTS: usize = 200;

fn panics(c: &TestCluster) -> Vec<String> {
    (1..=c.len())
        .flat_map(|i| {
            c.log(i)
                .lines()
                .filter(|l| l.contains("panicked"))
                .map(|l| format!("node{i}: {l}"))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Fresh reads of `name` on every running node: none may say complete with a total
/// other than `want` (when given) — a complete read of a short total is a lie.
async fn check_reads(c: &TestCluster, name: &str, want: Option<i64>) -> anyhow::Result<usize> {
    let mut incomplete = 0;
    for i in 1..=c.len() {
        if c.node(i).pid().is_none() {
            continue;
        }
        let Ok(v) = c.fresh(i, name).await else { continue };
        if v["complete"] == json!(true) {
            if let Some(want) = want {
                anyhow::ensure!(v["value"] == json!(want), "node{i} read a complete but wrong total: {v}");
            }
        } else {
            anyhow::ensure!(
                !v["missing_shards"].as_array().map(Vec::is_empty).unwrap_or(true),
                "node{i}: an incomplete read names no missing shard: {v}"
            );
            incomplete += 1;
        }
    }
    Ok(incomplete)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_a_replaced_disk_never_rejoins_under_its_old_identity() -> anyhow::Result<()> {
    let c = TestCluster::start(3).await?;
    c.put_counter(1, "likes", json!({"shards": 16, "durability": "sync"})).await?;
    for n in 0..INCREMENTS {
        let node = 1 + n % 3;
        let id = format!("e-{n}");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match c.incr(node, "likes", json!({"delta": 1, "event_id": id})).await {
                Ok((200, _)) => break,
                other if Instant::now() < deadline => {
                    eprintln!("retrying {id}: {other:?}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => anyhow::bail!("increment {id} never acknowledged: {other:?}"),
            }
        }
    }
    let total = INCREMENTS as i64;
    assert_eq!(c.value(1, "likes").await?, total);

    // The disk is replaced.
    c.node(3).kill();
    c.wipe(3)?;
    c.spawn(3)?;

    // For a while, every fresh read is either complete and exact, or says which shards
    // are missing; metadata writes keep working; nothing panics.
    let watch = Instant::now() + Duration::from_secs(12);
    let mut puts = 0;
    while Instant::now() < watch {
        check_reads(&c, "likes", Some(total)).await?;
        let (status, body) = c.send(1, "PUT", &format!("/v1/counters/during-{puts}"), json!({})).await?;
        anyhow::ensure!(status == 201 || status == 200, "metadata write refused: {status} {body}");
        puts += 1;
        let p = panics(&c);
        anyhow::ensure!(p.is_empty(), "a node panicked:\n{}", p.join("\n"));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // The replaced node catches up and becomes ready again, but its lost shards are
    // reported missing until the loss is accepted.
    c.wait_healthy(3).await?;
    c.wait_connected().await?;
    let incomplete = check_reads(&c, "likes", Some(total)).await?;
    assert_eq!(incomplete, 3, "every node must report the lost shards as missing");
    let v = c.fresh(1, "likes").await?;
    assert_eq!(v["complete"], json!(false), "{v}");

    // The operator accepts the loss; from then on the node's shards count again, from
    // zero.
    let (status, body) = c.send(2, "POST", "/v1/cluster/nodes/node3/accept-loss", json!({})).await?;
    assert_eq!(status, 200, "{body}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let after = loop {
        let reads: Vec<_> = futures_reads(&c).await;
        if reads.iter().all(|v| v["complete"] == json!(true)) {
            break reads[0]["value"].as_i64().unwrap_or(-1);
        }
        anyhow::ensure!(Instant::now() < deadline, "reads stay incomplete after accept-loss: {reads:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!((0..total).contains(&after), "the lost shards' values are gone: {after} of {total}");
    for n in 0..30 {
        let (status, body) =
            c.incr(3, "likes", json!({"delta": 1, "event_id": format!("after-{n}")})).await?;
        assert_eq!(status, 200, "{body}");
    }
    for i in 1..=3 {
        assert_eq!(c.value(i, "likes").await?, after + 30, "node{i}");
    }

    // Node3 is a voter again: with node2 stopped, node1 and node3 still commit
    // metadata writes.
    c.node(2).stop();
    c.wait_leader().await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, _) = c.send(1, "PUT", "/v1/counters/after-replace", json!({})).await?;
        if status == 201 || status == 200 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "no quorum without node2: node3 is no voter");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let p = panics(&c);
    assert!(p.is_empty(), "a node panicked:\n{}", p.join("\n"));
    Ok(())
}

async fn futures_reads(c: &TestCluster) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for i in 1..=c.len() {
        out.push(c.fresh(i, "likes").await.unwrap_or(serde_json::Value::Null));
    }
    out
}

/// Runs node `i`'s `tallyd` on its config in the foreground and answers whether it
/// exited, with its standard error; `None` if it was still running after `wait`
/// (then it is killed).
async fn run_to_exit(c: &TestCluster, i: usize, wait: Duration) -> anyhow::Result<Option<String>> {
    let mut child = tokio::process::Command::new(tally_tests::tallyd()?)
        .arg("--config")
        .arg(c.config_path(i))
        .current_dir(c.dir())
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    match tokio::time::timeout(wait, child.wait()).await {
        Ok(status) => {
            let status = status?;
            let mut stderr = String::new();
            if let Some(mut e) = child.stderr.take() {
                tokio::io::AsyncReadExt::read_to_string(&mut e, &mut stderr).await?;
            }
            anyhow::ensure!(!status.success(), "it exited with success: {stderr}");
            Ok(Some(stderr))
        }
        Err(_) => {
            child.kill().await?;
            Ok(None)
        }
    }
}

/// A node whose data directory lost one of its stores but kept the others (the
/// range replicas' `replica`, the shard store `store` or the metadata store `raft`,
/// emptied alone) must not start: under its old identity a replica with no vote and no log
/// could vote for a stale candidate, and entries only it and the old leader held
/// would be lost; an emptied shard store would read as complete zeros. It refuses,
/// says to start with a whole empty directory, and once it is given one it rejoins
/// as a new incarnation and every acknowledged increment is still counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_lost_part_of_its_data_directory_refuses_its_old_identity() -> anyhow::Result<()> {
    let c = TestCluster::start_configured(3, &[], "cluster.replicas = 3\n").await?;
    c.put_counter(1, "parts", json!({"shards": 8, "durability": "sync"})).await?;
    for n in 0..60 {
        let (status, body) =
            c.incr(1 + n % 3, "parts", json!({"delta": 1, "event_id": format!("p{n}")})).await?;
        assert_eq!(status, 200, "{body}");
    }
    for part in ["replica", "store", "raft"] {
        c.node(3).kill();
        let kept = c.dir().join(format!("kept-{part}"));
        std::fs::rename(c.data_dir(3).join(part), &kept)?;
        let stderr = run_to_exit(&c, 3, Duration::from_secs(60))
            .await?
            .ok_or_else(|| anyhow::anyhow!("node3 started with its `{part}` store emptied alone"))?;
        for needle in [part, "empty data directory"] {
            assert!(stderr.contains(needle), "{needle:?} not in {stderr}");
        }
        // Put back (over what the refused start created), the node starts as before.
        let _ = std::fs::remove_dir_all(c.data_dir(3).join(part));
        std::fs::rename(&kept, c.data_dir(3).join(part))?;
        c.restart(3).await?;
    }
    // With the whole directory emptied it is a new incarnation; nothing is lost.
    c.node(3).kill();
    c.wipe(3)?;
    c.restart(3).await?;
    for i in 1..=3 {
        assert_eq!(c.value(i, "parts").await?, 60, "node{i}");
    }
    let p = panics(&c);
    assert!(p.is_empty(), "a node panicked:\n{}", p.join("\n"));
    Ok(())
}
