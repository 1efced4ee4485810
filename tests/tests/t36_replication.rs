//! t36: shards replicated on three nodes (`cluster.replicas = 3`).

use serde_json::json;
use tally_tests::TestCluster;

/// What every node of a replicated cluster adds to its config.
const REPLICATED: &str = "cluster.replicas = 3\n";

/// The same with the ring cut into one range group per node (`ranges_per_node = 1`:
/// 4 ranges on 3 nodes, where the default cuts 16).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_counts_and_reads_a_replicated_counter() -> anyhow::Result<()> {
    let config = format!("{REPLICATED}cluster.ranges_per_node = 1\n");
    let c = TestCluster::start_configured(3, &[], &config).await?;
    let ranges = c.get(1, "/v1/cluster").await?["ranges"].as_array().map_or(0, Vec::len);
    assert_eq!(ranges, 4, "one range per node, rounded up to a power of two");
    c.put_counter(1, "likes", json!({"shards": 8, "durability": "sync"})).await?;
    for i in 0..60 {
        let (status, body) =
            c.incr(1 + i % 3, "likes", json!({"delta": 1, "event_id": format!("e{i}")})).await?;
        assert_eq!(status, 200, "{body}");
    }
    for node in 1..=3 {
        let read = c.fresh(node, "likes").await?;
        assert_eq!(read["value"], json!(60), "node{node}: {read}");
        assert_eq!(read["complete"], json!(true), "node{node}: {read}");
    }
    let (_, body) = c.incr(2, "likes", json!({"delta": 1, "event_id": "e7"})).await?;
    assert_eq!(body, json!({"applied": false, "duplicate": true}));
    Ok(())
}

/// Counters that state their own replica count get range groups of that size, apart
/// from the cluster's: `solo` (one copy) and `wide` (three, stated) count and read
/// through every node, each shard's range names its class and holds as many
/// replicas as its counter asked for, and a retried event id is a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_that_state_their_replica_count_get_range_groups_of_that_size() -> anyhow::Result<()> {
    let c = TestCluster::start_configured(3, &[], REPLICATED).await?;
    let counters = [("solo", 1u64), ("wide", 3)];
    for (name, replicas) in counters {
        c.put_counter(1, name, json!({"shards": 4, "durability": "sync", "replicas": replicas})).await?;
        // Another node has it once it applied the creation (the metadata group's
        // followers apply a moment later).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let spec = loop {
            match c.get(2, &format!("/v1/counters/{name}")).await {
                Ok(spec) => break spec,
                Err(_) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e),
            }
        };
        assert_eq!(spec["spec"]["replicas"], json!(replicas), "{spec}");
    }
    // A count's groups are formed, and elect their leaders, as its first counter
    // comes; a node that learns the count after the others waits for its own
    // replica of a group they already name it the leader of, as during a failover,
    // instead of answering 503.
    for i in 0..30 {
        for (name, _) in counters {
            let inc = json!({"delta": 1, "event_id": format!("e{i}")});
            let (status, body) = c.incr(1 + i % 3, name, inc).await?;
            assert_eq!((status, &body), (200, &json!({"applied": true})), "{name}, increment {i}");
        }
    }
    for (name, replicas) in counters {
        for node in 1..=3 {
            let read = c.fresh(node, name).await?;
            assert_eq!((&read["value"], &read["complete"]), (&json!(30), &json!(true)), "node{node}: {read}");
        }
        let (_, body) = c.incr(3, name, json!({"delta": 1, "event_id": "e7"})).await?;
        assert_eq!(body, json!({"applied": false, "duplicate": true}), "{name}");
        for (range, _, r) in agreed_leaders(&c, &[1, 2, 3], name).await? {
            assert_eq!(r["counter_replicas"], json!(replicas), "{name}, range {range}: {r}");
            // Its voters where node 1 runs a replica, else the directory's nodes.
            let copies = r["replicas"].as_array().expect("replicas").iter();
            let copies = copies.filter(|p| p["role"] == json!("voter") || p["role"] == json!("directory"));
            assert_eq!(copies.count() as u64, replicas, "{name}, range {range}: {r}");
        }
    }
    Ok(())
}

/// How long the range leader stays frozen.
const FROZEN: std::time::Duration = std::time::Duration::from_secs(10);
/// Writers during the silent failure.
const WRITERS: usize = 8;

/// A silent failure of a range leader: node 3 (the preferred leader of a third of
/// the ranges) is frozen with `SIGSTOP` for [`FROZEN`] while writers go on through
/// all nodes, then thawed. The others elect new leaders; when node 3 wakes it still
/// believes it leads, and its shard actors still hold what they held, but nothing
/// they commit can overwrite what the new leaders acknowledged: every node's total
/// is the acknowledged sum and every acknowledged id is a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_range_leader_never_makes_an_acknowledged_increment_disappear() -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::{Arc, Mutex};
    let c = Arc::new(TestCluster::start_configured(3, &[], REPLICATED).await?);
    c.put_counter(1, "stock", json!({"shards": 12, "durability": "sync"})).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let frozen = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (c, stop, frozen, acked) = (c.clone(), stop.clone(), frozen.clone(), acked.clone());
        writers.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(SeqCst) {
                let id = format!("w{w}-{i}");
                let mut attempt = 0;
                while !stop.load(SeqCst) {
                    // Through every node, node 3 too except while it is frozen.
                    let node =
                        if frozen.load(SeqCst) { 1 + (w + attempt) % 2 } else { 1 + (w + attempt) % 3 };
                    match c.incr(node, "stock", json!({"delta": 1, "event_id": id})).await {
                        Ok((200, _)) => {
                            acked.lock().unwrap().push(id.clone());
                            break;
                        }
                        Ok((503 | 504, _)) | Err(_) => {
                            tokio::time::sleep(std::time::Duration::from_millis(50)).await
                        }
                        Ok((status, body)) => panic!("unexpected {status} {body}"),
                    }
                    attempt += 1;
                }
                i += 1;
            }
        }));
    }
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    frozen.store(true, SeqCst);
    c.node(3).pause();
    let before = acked.lock().unwrap().len();
    tokio::time::sleep(FROZEN).await;
    let during = acked.lock().unwrap().len() - before;
    c.node(3).resume();
    frozen.store(false, SeqCst);
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    stop.store(true, SeqCst);
    for w in writers {
        w.await?;
    }
    let acked = acked.lock().unwrap().clone();
    println!(
        "range leader frozen {} s: {during} increments acknowledged meanwhile, {} in all",
        FROZEN.as_secs(),
        acked.len()
    );
    if during <= 100 {
        for n in 1..=3 {
            for line in c.log(n).lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).take(12) {
                println!("node{n}: {}", &line[..line.len().min(300)]);
            }
        }
    }
    assert!(during > 100, "writes did not go on around the frozen leader: {during}");
    tally_tests::stories::assert_counted_once(&c, "stock", &acked, WRITERS, 11).await
}

/// How long the groups may take to agree on their leaders (a start, or a failover
/// and the news spreading).
const SETTLE: std::time::Duration = std::time::Duration::from_secs(15);

/// The sample of an unlabelled metric in Prometheus text.
fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Each shard's range and leader as every node in `nodes` reports it, once they
/// all agree on one leader per shard (and it is one of `nodes`); `Err` if they do
/// not within [`SETTLE`]. Every report is checked against the OpenAPI document.
async fn agreed_leaders(
    c: &TestCluster,
    nodes: &[usize],
    counter: &str,
) -> anyhow::Result<Vec<(u64, String, serde_json::Value)>> {
    let deadline = std::time::Instant::now() + SETTLE;
    loop {
        let mut views = Vec::new();
        for &n in nodes {
            let report = c.get(n, &format!("/v1/counters/{counter}/shards")).await?;
            tally_tests::openapi::check("GET", "/v1/counters/{name}/shards", 200, &report)?;
            views.push(report);
        }
        let live: Vec<String> = nodes.iter().map(|n| format!("node{n}")).collect();
        let first = &views[0]["shards"];
        let shards = first.as_array().map_or(0, Vec::len);
        let agreed: Option<Vec<(u64, String, serde_json::Value)>> = (0..shards)
            .map(|i| {
                let r = &first[i]["replication"];
                let leader = r["leader"].as_str()?.to_owned();
                let same = views.iter().all(|v| v["shards"][i]["replication"]["leader"] == r["leader"]);
                (same && live.contains(&leader))
                    .then(|| (r["range"].as_u64().unwrap_or(u64::MAX), leader, r.clone()))
            })
            .collect();
        match agreed {
            Some(a) if shards > 0 => return Ok(a),
            _ if std::time::Instant::now() > deadline => {
                anyhow::bail!("nodes {nodes:?} never agreed on the leaders of {counter}: {views:?}")
            }
            _ => tokio::time::sleep(std::time::Duration::from_millis(200)).await,
        }
    }
}

/// The shard report and the cluster view show each range's three replicas, the
/// one leader every node agrees on, and its term; after the leader of a range is
/// killed, another node leads it and the survivors count a failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_and_cluster_show_replicas_leaders_and_failovers() -> anyhow::Result<()> {
    let c = TestCluster::start_configured(3, &[], REPLICATED).await?;
    c.put_counter(1, "views", json!({"shards": 8, "durability": "sync"})).await?;
    for i in 0..24 {
        let (status, body) =
            c.incr(1 + i % 3, "views", json!({"delta": 1, "event_id": format!("v{i}")})).await?;
        assert_eq!(status, 200, "{body}");
    }
    let leaders = agreed_leaders(&c, &[1, 2, 3], "views").await?;
    for (range, leader, r) in &leaders {
        assert_eq!(r["replicated_here"], json!(true), "{r}");
        let replicas = r["replicas"].as_array().expect("replicas");
        assert_eq!(replicas.len(), 3, "range {range}: {r}");
        let mut nodes: Vec<&str> = replicas.iter().filter_map(|p| p["node"].as_str()).collect();
        nodes.sort();
        assert_eq!(nodes, ["node1", "node2", "node3"], "range {range}: {r}");
        assert!(replicas.iter().all(|p| p["role"] == json!("voter") && p["current"] == json!(true)), "{r}");
        assert!(r["term"].as_u64().is_some_and(|t| t >= 1), "range {range}: {r}");
        assert_eq!(r["excluded"], json!([]), "{r}");
        assert_eq!(r["stopped"], json!(null), "{r}");
        assert!(leader.starts_with("node"), "{r}");
    }

    // The cluster view of every node lists every range; a range's leader fills in
    // every replica's progress, and its voters hold its whole log once idle.
    let mut ranges_led = 0;
    for n in 1..=3 {
        let view = c.get(n, "/v1/cluster").await?;
        tally_tests::openapi::check("GET", "/v1/cluster", 200, &view)?;
        let ranges = view["ranges"].as_array().expect("ranges in a replicated cluster's view");
        assert!(!ranges.is_empty(), "{view}");
        for (range, leader, _) in &leaders {
            let r = ranges.iter().find(|r| r["range"].as_u64() == Some(*range)).expect("every range listed");
            assert_eq!(r["leader"].as_str(), Some(leader.as_str()), "node{n}: {r}");
            if *leader == format!("node{n}") {
                let last = r["leader_last_log"].as_u64().expect("the leader knows its log");
                let settled = r["replicas"]
                    .as_array()
                    .expect("replicas")
                    .iter()
                    .all(|p| p["matched"].as_u64().is_some());
                assert!(settled, "node{n} leads but lacks progress: {r}");
                assert!(last >= 1, "{r}");
            } else {
                assert_eq!(r["leader_last_log"], json!(null), "node{n} does not lead: {r}");
            }
        }
        let metrics = reqwest::get(format!("{}/metrics", c.node(n).url())).await?.text().await?;
        ranges_led += sample(&metrics, "tally_replica_ranges_led").expect("ranges led") as u64;
        assert_eq!(sample(&metrics, "tally_replica_ranges_without_leader"), Some(0.0), "node{n}");
        assert_eq!(sample(&metrics, "tally_replica_ranges_stopped"), Some(0.0), "node{n}");
        assert!(sample(&metrics, "tally_replica_lag_entries").is_some(), "node{n}");
    }
    let ranges = c.get(1, "/v1/cluster").await?["ranges"].as_array().map_or(0, Vec::len) as u64;
    assert_eq!(ranges_led, ranges, "every range is led by exactly one node");

    // Kill the leader of shard 0's range: the other two elect another.
    let (range, old, _) = leaders[0].clone();
    let victim: usize = old.trim_start_matches("node").parse()?;
    let survivors: Vec<usize> = (1..=3).filter(|n| *n != victim).collect();
    let mut before = Vec::new();
    for &n in &survivors {
        let metrics = reqwest::get(format!("{}/metrics", c.node(n).url())).await?.text().await?;
        before.push(sample(&metrics, "tally_replica_failovers_total").expect("failovers counted"));
    }
    c.node(victim).kill();
    let killed = std::time::Instant::now();
    let after = agreed_leaders(&c, &survivors, "views").await?;
    println!(
        "{old} (leader of range {range}) killed: survivors agree on every leader after {:?}",
        killed.elapsed()
    );
    let (_, new, _) = after.iter().find(|(r, _, _)| *r == range).expect("the range is still there");
    assert_ne!(*new, old, "range {range} kept its dead leader");
    for (i, &n) in survivors.iter().enumerate() {
        let metrics = reqwest::get(format!("{}/metrics", c.node(n).url())).await?.text().await?;
        let failovers = sample(&metrics, "tally_replica_failovers_total").expect("failovers counted");
        println!("node{n}: tally_replica_failovers_total {} -> {failovers}", before[i]);
        assert!(failovers > before[i], "node{n} counted no failover: {} then {failovers}", before[i]);
    }
    Ok(())
}

/// A node refuses to start over data kept the other way than its config's
/// `cluster.replicas` asks: one copy per shard, as every cluster of an earlier
/// release kept them by default, against range groups, which is what a config of
/// several members without the line now asks for. It says what to set, changes
/// nothing, and started again as before it reads every counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_data_kept_with_another_number_of_copies() -> anyhow::Result<()> {
    let c = TestCluster::start_configured(3, &[], "cluster.replicas = 1\n").await?;
    c.put_counter(1, "kept", json!({"shards": 4, "durability": "sync"})).await?;
    for i in 0..8 {
        let (status, body) =
            c.incr(1 + i % 3, "kept", json!({"delta": 1, "event_id": format!("k{i}")})).await?;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(c.node(1).stop(), Some(0), "{}", c.node(1).log_tail());
    let config = std::fs::read_to_string(c.config_path(1))?;
    assert!(config.contains("\nreplicas = 1\n"), "{config}");
    for changed in
        [config.replace("\nreplicas = 1\n", "\n"), config.replace("\nreplicas = 1\n", "\nreplicas = 3\n")]
    {
        let path = c.dir().join("node1-changed.toml");
        std::fs::write(&path, &changed)?;
        let run = tokio::process::Command::new(tally_tests::tallyd()?).arg("--config").arg(&path).output();
        let out = tokio::time::timeout(std::time::Duration::from_secs(60), run).await??;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "started over one-copy data with range groups: {stderr}");
        for needle in ["keeps one copy of each shard", "would read as empty", "Put replicas = 1 in [cluster]"]
        {
            assert!(stderr.contains(needle), "{needle:?} not in {stderr}");
        }
    }
    c.restart(1).await?;
    for node in 1..=3 {
        assert_eq!(c.value(node, "kept").await?, 8, "node{node}");
    }
    Ok(())
}

/// Two copies cannot replace a lost disk: a group of two voters needs both for
/// every majority, so once one disk is gone its replacement can never be added
/// under the pair. A counter asking for two copies is refused with the reason, and
/// so is a config that would give range groups of two voters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_are_refused_with_the_reason() -> anyhow::Result<()> {
    let c = TestCluster::start_configured(3, &[], REPLICATED).await?;
    let (status, body) = c.send(1, "PUT", "/v1/counters/pair", json!({"shards": 8, "replicas": 2})).await?;
    assert_eq!(status, 422, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("lost disk"), "{body}");
    let (status, body) = c.send(1, "PUT", "/v1/counters/triple", json!({"shards": 8, "replicas": 3})).await?;
    assert_eq!(status, 201, "{body}");
    // A config with two copies is refused before the node starts.
    assert_eq!(c.node(1).stop(), Some(0), "{}", c.node(1).log_tail());
    let config = std::fs::read_to_string(c.config_path(1))?;
    let path = c.dir().join("node1-two-copies.toml");
    std::fs::write(&path, config.replace("\nreplicas = 3\n", "\nreplicas = 2\n"))?;
    let run = tokio::process::Command::new(tally_tests::tallyd()?).arg("--config").arg(&path).output();
    let out = tokio::time::timeout(std::time::Duration::from_secs(60), run).await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started with two copies: {stderr}");
    assert!(stderr.contains("cluster.replicas") && stderr.contains("lost disk"), "{stderr}");
    Ok(())
}

/// A node becomes ready for the ranges it can serve while another of its ranges
/// cannot form. Five nodes, three copies; node5 is stopped and node1 comes back with
/// an empty disk: every range whose replicas are node1, node5 and one other cannot
/// add node1's new replica (the old pair's majority needs node5), while the metadata
/// group and the other ranges go on. Node1 must answer `/healthz` again and serve
/// the counters whose shards are in ranges it could join.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_ready_while_one_of_its_ranges_cannot_form() -> anyhow::Result<()> {
    let c = TestCluster::start_configured(5, &[], REPLICATED).await?;
    for i in 0..16 {
        c.put_counter(1, &format!("one:{i}"), json!({"shards": 1, "durability": "sync"})).await?;
        let (status, body) = c.incr(1, &format!("one:{i}"), json!({"delta": 1, "event_id": "a"})).await?;
        assert_eq!(status, 200, "{body}");
    }
    c.node(5).stop();
    c.node(1).kill();
    c.wipe(1)?;
    c.restart(1).await?;
    let mut served = 0;
    for i in 0..16 {
        let (status, body) = c.incr(1, &format!("one:{i}"), json!({"delta": 1, "event_id": "b"})).await?;
        match status {
            200 => served += 1,
            503 => {}
            _ => anyhow::bail!("one:{i}: {status} {body}"),
        }
    }
    assert!(served > 0, "no range with a majority served an increment");
    Ok(())
}
