//! t67: a shard record corrupted on disk. A node whose store holds a shard image
//! that no longer decodes keeps running: requests that need that shard get a clear
//! error naming the shard, and every other counter is served as before.

use anyhow::{bail, Result};
use serde_json::json;
use tally_tests::TestCluster;

/// The store key of shard 0 of generation 0 of `name`'s image (the layout pinned in
/// `tally-store`'s `sled_store.rs`: u16 BE name length, name, u32 BE generation,
/// u16 BE index, tag 0).
fn image_key(name: &str) -> Vec<u8> {
    let mut key = (name.len() as u16).to_be_bytes().to_vec();
    key.extend_from_slice(name.as_bytes());
    key.extend_from_slice(&0u32.to_be_bytes());
    key.extend_from_slice(&0u16.to_be_bytes());
    key.push(0);
    key
}

/// Overwrites `name`'s shard-0 image in the (stopped) node's sled store.
fn corrupt_image(store: &std::path::Path, name: &str) -> Result<()> {
    let db = sled::open(store)?;
    let key = image_key(name);
    let mut found = 0;
    for tree in db.tree_names() {
        let tree = db.open_tree(&tree)?;
        if tree.contains_key(&key)? {
            tree.insert(&key, &[0xff, 0xff, 0xff, 0x07, 0x01][..])?;
            found += 1;
        }
    }
    db.flush()?;
    if found != 1 {
        bail!("found {found} images of {name}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_shard_image_is_a_clear_error_and_the_node_stays_up() -> Result<()> {
    let c = TestCluster::start(1).await?;
    for name in ["credits", "likes"] {
        c.put_counter(1, name, json!({"shards": 1, "durability": "sync"})).await?;
        for _ in 0..3 {
            let (status, body) = c.incr(1, name, json!({"delta": 2})).await?;
            assert_eq!(status, 200, "{body}");
        }
    }
    assert_eq!(c.node(1).stop(), Some(0));
    corrupt_image(&c.data_dir(1).join("store"), "credits")?;
    c.restart(1).await?;

    // A fresh read names the shard it could not count (docs/SEMANTICS.md).
    let read = c.fresh(1, "credits").await?;
    assert_eq!(
        (read["complete"].clone(), read["missing_shards"].clone()),
        (json!(false), json!([0])),
        "{read}"
    );
    // Writes to it are refused with an error that says why, again and again.
    for _ in 0..3 {
        let (status, body) = c.incr(1, "credits", json!({"delta": 1})).await?;
        assert!(status >= 500, "{status} {body}");
        let message = body.to_string();
        assert!(message.contains("corrupt data at shard") && message.contains("credits"), "{message}");
        assert!(!message.contains("panicked"), "the answer speaks of a panic: {message}");
    }
    // The node's log names the shard and the decoding error.
    let log = c.log(1);
    assert!(
        log.contains("cannot start a shard") && log.contains("corrupt data at shard"),
        "{}",
        c.node(1).log_tail()
    );
    // The node is up and every other counter is served.
    assert_eq!(c.get(1, "/healthz").await?, json!({"status": "ok"}));
    assert_eq!(c.value(1, "likes").await?, 6);
    let (status, _) = c.incr(1, "likes", json!({"delta": 1})).await?;
    assert_eq!(status, 200);
    assert!(c.node(1).pid().is_some());
    Ok(())
}
