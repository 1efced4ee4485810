//! t93: a PostgreSQL source of truth over TLS, as real databases require. A local
//! PostgreSQL serves TLS with a certificate of a CA made for the test and takes TCP
//! connections over TLS only. A `[[reconcile]]` source with
//! `sslmode=verify-full&sslrootcert=CA` reads its totals and corrects the counter;
//! one that trusts another CA is refused in the handshake; one in plaintext is
//! refused by the server. A failed run's error (which names the database's user,
//! host and rules) is shown to an admin token and not to a plain `read` token.

use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tally_auth::Scope;
use tally_tests::{make_certs, Postgres, TestCluster};

const OPS: &str = "tly_t93-ops-000000000000000000000000000000000000000000000000000000";
const READER: &str = "tly_t93-reader-00000000000000000000000000000000000000000000000000";
/// Rows the source holds for the counter.
const ROWS: i64 = 37;
/// How long the test waits for the scheduled runs.
const RUN_WAIT_MS: u64 = 30_000;

/// The runs of `likes:7` on node 1 as `token` reads them.
async fn runs(c: &TestCluster, token: &str) -> Result<Vec<Value>> {
    let r = reqwest::Client::new()
        .get(format!("{}/v1/counters/likes:7/reconciliations", c.node(1).url()))
        .bearer_auth(token)
        .send()
        .await?;
    let v: Value = r.json().await?;
    Ok(v["runs"].as_array().cloned().unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_source_over_tls_checks_the_server_and_keeps_its_errors_from_readers() -> Result<()> {
    let certs = tempfile::tempdir()?;
    let ours = make_certs(certs.path(), "t93 database CA", &["pgserver"])?;
    let other = tempfile::tempdir()?;
    let theirs = make_certs(other.path(), "another CA", &["x"])?;
    let Some(pg) = Postgres::start_tls(&ours.join("pgserver.pem"), &ours.join("pgserver-key.pem"))? else {
        return Ok(());
    };
    // The test's own client fills the table through the server's Unix socket.
    let (db, conn) = tokio_postgres::connect(&pg.socket_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    db.batch_execute("CREATE TABLE likes (post_id bigint, user_id bigint)").await?;
    db.execute("INSERT INTO likes SELECT 7, g FROM generate_series(1, $1::bigint) g", &[&ROWS]).await?;

    let source = |name: &str, params: &str| {
        format!(
            "[[reconcile]]\nname = \"{name}\"\ncounters = \"likes:{{id}}\"\nevery = \"1s\"\n\
             [reconcile.postgres]\nurl = \"{}{params}\"\n\
             query = \"SELECT count(*) FROM likes WHERE post_id = $1\"\nconnect_timeout_ms = 2000\n",
            pg.url()
        )
    };
    let ops = tally_auth::config_lines(OPS, "ops", &[Scope::Admin], &[]).expect("entry");
    let reader = tally_auth::config_lines(READER, "reader", &[Scope::Read], &[]).expect("entry");
    let extra = [
        ops,
        reader,
        source("likes-db", &format!("?sslmode=verify-full&sslrootcert={}", ours.join("ca.pem").display())),
        source(
            "likes-wrong-ca",
            &format!("?sslmode=verify-full&sslrootcert={}", theirs.join("ca.pem").display()),
        ),
        source("likes-plain", ""),
    ]
    .join("\n");
    let c = TestCluster::start_secured(1, &[], &extra, OPS).await?;
    c.put_counter(1, "likes:7", json!({"durability": "sync"})).await?;

    let deadline = Instant::now() + Duration::from_millis(RUN_WAIT_MS);
    let (good, wrong, plain) = loop {
        let runs = runs(&c, OPS).await?;
        let of = |source: &str| runs.iter().find(|r| r["source"] == source).cloned();
        if let (Some(g), Some(w), Some(p)) = (of("likes-db"), of("likes-wrong-ca"), of("likes-plain")) {
            break (g, w, p);
        }
        if Instant::now() > deadline {
            bail!("the sources did not all run: {runs:?}\n{}", c.node(1).log_tail());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(good["authoritative"], ROWS, "the TLS source's total: {good}");
    assert!(good["error"].is_null(), "{good}");
    assert_eq!(c.value(1, "likes:7").await?, ROWS, "corrected to the source's total");
    let wrong_error = wrong["error"].as_str().unwrap_or_default();
    assert!(wrong_error.contains("certificate") || wrong_error.contains("UnknownIssuer"), "{wrong}");
    assert!(wrong["authoritative"].is_null() && wrong["corrected"] == false, "{wrong}");
    let plain_error = plain["error"].as_str().unwrap_or_default();
    assert!(plain_error.contains("pg_hba") || plain_error.contains("encryption"), "{plain}");

    // A read token sees that the runs failed, not why.
    for run in runs(&c, READER).await? {
        let error = run["error"].as_str().unwrap_or_default();
        for secret in ["postgres", "127.0.0.1", "pg_hba", "certificate", ".pem"] {
            assert!(!error.contains(secret), "a read token reads {secret:?} in {run}");
        }
        if run["source"] != "likes-db" {
            assert!(error.contains("admin"), "{run}");
        }
    }
    drop(pg);
    Ok(())
}
