//! Shared fixtures: a real Tally node over the in-memory store, served on a
//! loopback port, and a runner for the built `tally` binary.
#![allow(dead_code)]

use serde_json::Value;
use std::net::SocketAddr;
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;
use tally_engine::{MemStore, SystemClock, Tally, TallyConfig};
use tally_server::{router, serve, HttpConfig, NodeEntry, SingleNode};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Longest any one `tally` invocation may take in a test before it is killed.
pub const RUN_LIMIT: Duration = Duration::from_secs(20);

/// A node serving HTTP on 127.0.0.1 until stopped.
pub struct Node {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Node {
    /// Starts a single node over the in-memory store on a free loopback port.
    pub async fn start() -> Node {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
        let addr = listener.local_addr().expect("local addr");
        let entry = NodeEntry {
            id: "node1".into(),
            raft_id: 1,
            http: addr,
            peer: "127.0.0.1:7170".parse().expect("addr"),
            raft: "127.0.0.1:7270".parse().expect("addr"),
            resp: None,
            member: true,
        };
        let config = TallyConfig { node_id: tally_core::NodeId::new("node1"), ..TallyConfig::default() };
        let tally = Tally::open_with(Arc::new(MemStore::new()), Arc::new(SystemClock), config)
            .await
            .expect("the engine opens");
        let limits = HttpConfig::default();
        let app = router(SingleNode::new(tally, entry), &limits);
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            serve(listener, app, &limits, async {
                let _ = rx.await;
            })
            .await
        });
        Node { addr, stop: Some(tx), task }
    }

    /// The node's base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Runs `tally --node URL ARGS...` and waits for it.
    pub async fn tally(&self, args: &[&str]) -> Run {
        let url = self.url();
        let mut all = vec!["--node", url.as_str()];
        all.extend_from_slice(args);
        tally(&all).await
    }

    /// Stops serving and waits for the server to return.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(20), self.task).await;
    }
}

/// What a `tally` run printed and how it exited.
#[derive(Debug)]
pub struct Run {
    /// The exit code (`None` if killed by a signal).
    pub code: Option<i32>,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl Run {
    /// Asserts a zero exit and returns standard output.
    #[track_caller]
    pub fn ok(&self) -> &str {
        assert_eq!(self.code, Some(0), "tally failed: {self:?}");
        &self.stdout
    }

    /// Asserts a zero exit and parses standard output as one JSON object.
    #[track_caller]
    pub fn json(&self) -> Value {
        let text = self.ok();
        assert_eq!(text.trim().lines().count(), 1, "one line of JSON: {text}");
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
    }
}

impl From<Output> for Run {
    fn from(o: Output) -> Self {
        Run {
            code: o.status.code(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

/// Runs the built `tally` with `args` (and no `TALLY_NODE` from the environment).
pub async fn tally(args: &[&str]) -> Run {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(args)
        .env_remove("TALLY_NODE")
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(RUN_LIMIT, child)
        .await
        .unwrap_or_else(|_| panic!("tally {args:?} ran longer than {RUN_LIMIT:?}"))
        .expect("tally runs")
        .into()
}
