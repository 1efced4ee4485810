//! t40: the `tallyd` binary as an operator runs it. A node started from a config
//! file serves HTTP; SIGTERM (or SIGINT) stops it cleanly with exit status 0 after
//! flushing, so a restart on the same data directory sees every acknowledged `sync`
//! increment (invariant 1) and every buffered `batched` increment (the signal
//! delivered them, so not even the flush window is lost). Configurations it cannot
//! run are refused with a clear message.

mod common;

use common::*;
use serde_json::json;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::process::{Child, Command};

const TALLYD: &str = env!("CARGO_BIN_EXE_tallyd");
/// How long a node may take to start answering `/healthz` (debug build, busy machine).
const START_WAIT_S: u64 = 60;
/// How long a node may take to exit after a signal.
const EXIT_WAIT_S: u64 = 30;

/// A running `tallyd` process.
struct Tallyd {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

fn write_config(dir: &Path, port: u16) -> PathBuf {
    let (peer, raft) = (free_port(), free_port());
    let text = format!(
        r#"
[cluster]
name = "t40"
secret = "t40-test-secret"

[[cluster.nodes]]
id = "node1"
raft_id = 1
http = "127.0.0.1:{port}"
peer = "127.0.0.1:{peer}"
raft = "127.0.0.1:{raft}"

[node]
id = "node1"
data_dir = "overridden-by-the-command-line"
"#
    );
    let path = dir.join(format!("tallyd-{port}.toml"));
    std::fs::write(&path, text).expect("write config");
    path
}

impl Tallyd {
    /// Starts a node whose data lives in `dir/data`, on a free port.
    async fn start(dir: &Path) -> Self {
        let port = free_port();
        let config = write_config(dir, port);
        let log = dir.join(format!("tallyd-{port}.log"));
        let child = Command::new(TALLYD)
            .arg("--config")
            .arg(&config)
            .arg("--data-dir")
            .arg(dir.join("data"))
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .kill_on_drop(true)
            .spawn()
            .expect("tallyd starts");
        let mut node = Self { child, addr: SocketAddr::from(([127, 0, 0, 1], port)), log };
        if !wait_healthy(node.addr, Duration::from_secs(START_WAIT_S)).await {
            let status = node.child.try_wait().ok().flatten();
            panic!("tallyd did not become healthy (exit: {status:?}); log:\n{}", node.log_text());
        }
        node
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn call(&self, method: &str, path: &str, body: Option<&str>) -> Answer {
        raw_http(self.addr, method, path, body).await.expect("tallyd answers")
    }

    async fn value(&self, counter: &str) -> serde_json::Value {
        let a = self.call("GET", &format!("/v1/counters/{counter}/value?consistency=fresh"), None).await;
        assert_eq!(a.status, 200, "{}", a.text);
        a.json()["value"].clone()
    }

    /// Sends `signal` and waits for the process to exit.
    async fn stop_with(mut self, signal: libc::c_int) -> (ExitStatus, String) {
        let pid = self.child.id().expect("still running");
        let pid = libc::pid_t::try_from(pid).expect("pid fits");
        // SAFETY: kill(2) takes plain integers and touches no memory of ours; the pid
        // is our own child, which has not been reaped (we hold its handle).
        #[allow(unsafe_code)]
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(rc, 0, "kill failed");
        let status = tokio::time::timeout(Duration::from_secs(EXIT_WAIT_S), self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("tallyd did not exit; log:\n{}", self.log_text()))
            .expect("wait");
        (status, self.log_text())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_increments_survive_sigterm_and_restart_and_stay_deduplicated() {
    let dir = tempfile::tempdir().expect("temp dir");
    let node = Tallyd::start(dir.path()).await;
    let a = node.call("PUT", "/v1/counters/orders", Some(r#"{"durability": "sync", "shards": 4}"#)).await;
    assert_eq!(a.status, 201, "{}", a.text);
    let mut want = 0i64;
    for i in 0..20 {
        let body = format!(r#"{{"delta": {}, "event_id": "e{i}"}}"#, i + 1);
        let a = node.call("POST", "/v1/counters/orders/increments", Some(&body)).await;
        assert_eq!(a.json(), json!({"applied": true}), "{}", a.text);
        want += i + 1;
    }
    let batch = json!({"increments": (0..5).map(|i| json!({"counter": "orders", "delta": 100, "event_id": format!("b{i}")})).collect::<Vec<_>>()});
    let a = node.call("POST", "/v1/increments", Some(&batch.to_string())).await;
    assert_eq!(a.json()["results"].as_array().map(Vec::len), Some(5), "{}", a.text);
    want += 500;
    assert_eq!(node.value("orders").await, want);

    let (status, log) = node.stop_with(libc::SIGTERM).await;
    assert!(status.success(), "exit {status:?}; log:\n{log}");
    assert!(log.contains("stopped cleanly"), "{log}");

    let node = Tallyd::start(dir.path()).await;
    assert_eq!(node.value("orders").await, want, "an acknowledged sync increment was lost");
    let spec = node.call("GET", "/v1/counters/orders", None).await.json();
    assert_eq!(
        (spec["spec"]["durability"].clone(), spec["spec"]["shards"].clone()),
        (json!("sync"), json!(4))
    );
    // Retries after the restart are recognized.
    let a =
        node.call("POST", "/v1/counters/orders/increments", Some(r#"{"delta": 4, "event_id": "e3"}"#)).await;
    assert_eq!(a.json(), json!({"applied": false, "duplicate": true}));
    assert_eq!(node.value("orders").await, want);
    let (status, log) = node.stop_with(libc::SIGINT).await;
    assert!(status.success(), "exit {status:?} after SIGINT; log:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_delivers_buffered_batched_increments_before_exiting() {
    let dir = tempfile::tempdir().expect("temp dir");
    let node = Tallyd::start(dir.path()).await;
    // The longest window: nothing reaches the shards on its own during the test.
    let a =
        node.call("PUT", "/v1/counters/views", Some(r#"{"durability": "batched", "flush_ms": 60000}"#)).await;
    assert_eq!(a.status, 201, "{}", a.text);
    for i in 0..100 {
        let body = format!(r#"{{"delta": 1, "writer": "w{}"}}"#, i % 7);
        let a = node.call("POST", "/v1/counters/views/increments", Some(&body)).await;
        assert_eq!(a.json(), json!({"applied": true}), "{}", a.text);
    }
    let batch =
        json!({"increments": (0..50).map(|_| json!({"counter": "views", "delta": 2})).collect::<Vec<_>>()});
    let a = node.call("POST", "/v1/increments", Some(&batch.to_string())).await;
    assert_eq!(a.status, 200, "{}", a.text);
    // No read here: a fresh read would deliver the buffer itself.
    let (status, log) = node.stop_with(libc::SIGTERM).await;
    assert!(status.success(), "exit {status:?}; log:\n{log}");

    let node = Tallyd::start(dir.path()).await;
    assert_eq!(node.value("views").await, 200, "buffered increments were lost at SIGTERM");
    let (status, _) = node.stop_with(libc::SIGTERM).await;
    assert!(status.success());
}

async fn run_to_end(args: &[&str], dir: &Path) -> (Option<i32>, String, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(EXIT_WAIT_S),
        Command::new(TALLYD).args(args).current_dir(dir).env("RUST_LOG", "info").output(),
    )
    .await
    .expect("tallyd exits")
    .expect("tallyd runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_validates_the_built_in_config_and_bad_files_name_their_field() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (code, stdout, stderr) = run_to_end(&["--check"], dir.path()).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("cluster \"single\" (1 node)"), "{stdout}");
    assert!(stdout.contains("http 127.0.0.1:7070") && stdout.contains("data ./data"), "{stdout}");
    assert!(stdout.contains("cluster fingerprint: 0x"), "{stdout}");
    assert!(
        stdout.contains("copies of each shard: 1 (a single node: one copy, no range groups)"),
        "{stdout}"
    );
    let local3 = concat!(env!("CARGO_MANIFEST_DIR"), "/../../cluster-config/local3/node1.toml");
    let (code, stdout, stderr) = run_to_end(&["--config", local3, "--check"], dir.path()).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("copies of each shard: 3 (the default: min(3, initial members)"), "{stdout}");

    let bad = dir.path().join("bad.toml");
    let text = std::fs::read_to_string(write_config(dir.path(), free_port())).expect("config");
    std::fs::write(&bad, text.replace("id = \"node1\"\ndata_dir", "id = \"node9\"\ndata_dir"))
        .expect("write");
    let (code, _, stderr) =
        run_to_end(&["--config", bad.to_str().expect("utf-8"), "--check"], dir.path()).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("node.id \"node9\" is not one of cluster.nodes"), "{stderr}");
    assert!(!stderr.contains("stack backtrace"), "{stderr}");
}
