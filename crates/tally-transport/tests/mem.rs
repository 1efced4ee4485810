//! The in-memory backend: several nodes in one process, on a current-thread runtime with
//! paused time, with the transport's real checks, limits and failure detector.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tally_transport::gateway::INFLIGHT_CALLS_MAX;
use tally_transport::wire::{REPLY_BYTES_MAX, REQUEST_BYTES_MAX};
use tally_transport::{
    Handler, LinkFate, Links, MemNetwork, PeerState, PeerStatus, Transport, TransportConfig, TransportError,
};
use tokio::sync::watch;
use tokio::time::Instant;

const FINGERPRINT: u64 = 0xfeed;
/// How long every delivered message takes.
const LATENCY: Duration = Duration::from_millis(1);

/// Every message takes [`LATENCY`], except that messages to or from a cut node, and messages
/// on a lost direction, are lost.
#[derive(Default)]
struct TestLinks {
    cut: Mutex<BTreeSet<String>>,
    lost: Mutex<BTreeSet<(String, String)>>,
}

impl TestLinks {
    fn cut(&self, node: &str, cut: bool) {
        let mut set = self.cut.lock().unwrap();
        if cut {
            set.insert(node.to_string());
        } else {
            set.remove(node);
        }
    }

    fn lose(&self, from: &str, to: &str, lose: bool) {
        let mut set = self.lost.lock().unwrap();
        let key = (from.to_string(), to.to_string());
        if lose {
            set.insert(key);
        } else {
            set.remove(&key);
        }
    }
}

impl Links for TestLinks {
    fn fate(&self, from: &str, to: &str) -> LinkFate {
        let cut = self.cut.lock().unwrap();
        let lost = self.lost.lock().unwrap().contains(&(from.to_string(), to.to_string()));
        if lost || cut.contains(from) || cut.contains(to) {
            LinkFate::Lose
        } else {
            LinkFate::Deliver(LATENCY)
        }
    }
}

/// Answers `<label>:<from>:<body>`; `panic` panics, `big` replies too much, a body over a
/// KiB is answered with its length (`len=<n>`) instead, and a body starting with `slow` is
/// answered after a second. Counts the requests it was given.
struct Echo {
    label: String,
    served: AtomicUsize,
}

impl Echo {
    fn new(label: &str) -> Arc<Self> {
        Arc::new(Echo { label: label.to_string(), served: AtomicUsize::new(0) })
    }

    fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }
}

impl Handler for Echo {
    async fn handle(&self, from: &str, request: Vec<u8>) -> Vec<u8> {
        self.served.fetch_add(1, Ordering::SeqCst);
        match request.as_slice() {
            b"panic" => panic!("handler asked to panic"),
            b"big" => vec![0; REPLY_BYTES_MAX + 1],
            body if body.len() > 1024 => {
                [self.label.as_bytes(), b":", from.as_bytes(), b":len=", body.len().to_string().as_bytes()]
                    .concat()
            }
            body => {
                if body.starts_with(b"slow") {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                [self.label.as_bytes(), b":", from.as_bytes(), b":", body].concat()
            }
        }
    }
}

fn addr(node: &str) -> SocketAddr {
    let n: u16 = node.trim_start_matches('n').parse().unwrap();
    SocketAddr::from(([127, 0, 0, 1], 7000 + n))
}

/// The config of `node` in a cluster of `nodes`, pinging every `heartbeat_ms`.
fn config(node: &str, nodes: &[&str], heartbeat_ms: u64) -> TransportConfig {
    TransportConfig {
        node_id: node.to_string(),
        listen: addr(node),
        peers: nodes.iter().filter(|n| **n != node).map(|n| (n.to_string(), addr(n))).collect(),
        secret: "s3cret".into(),
        fingerprint: FINGERPRINT,
        heartbeat_ms,
        heartbeat_misses_max: 3,
        reconnect_backoff_min_ms: 100,
        reconnect_backoff_max_ms: 1_000,
        call_timeout_ms: 1_000,
        tls: None,
    }
}

struct Cluster {
    links: Arc<TestLinks>,
    net: MemNetwork,
    nodes: Vec<(Transport, Arc<Echo>)>,
}

impl Cluster {
    async fn start(names: &[&str], heartbeat_ms: u64) -> Cluster {
        let links = Arc::new(TestLinks::default());
        let net = MemNetwork::new(links.clone());
        let mut nodes = Vec::new();
        for name in names {
            let echo = Echo::new(name);
            let t = Transport::start_in(config(name, names, heartbeat_ms), echo.clone(), net.clone())
                .await
                .expect("start in memory");
            nodes.push((t, echo));
        }
        Cluster { links, net, nodes }
    }

    fn node(&self, i: usize) -> &Transport {
        &self.nodes[i].0
    }

    fn echo(&self, i: usize) -> &Echo {
        &self.nodes[i].1
    }

    /// Waits until every node sees every peer `Up`.
    async fn all_up(&self, within: Duration) {
        for (t, _) in &self.nodes {
            for peer in t.peers() {
                wait_state(t, &peer.node, PeerState::Up, within).await;
            }
        }
    }
}

fn state_of(peers: &[PeerStatus], peer: &str) -> PeerState {
    peers.iter().find(|p| p.node == peer).expect("peer listed").state
}

/// Waits until `t` sees `peer` in `state`, panicking after `within`; returns when it did.
async fn wait_state(t: &Transport, peer: &str, state: PeerState, within: Duration) -> Instant {
    let mut rx = t.subscribe();
    wait_state_rx(&mut rx, peer, state, within).await
}

async fn wait_state_rx(
    rx: &mut watch::Receiver<Vec<PeerStatus>>,
    peer: &str,
    state: PeerState,
    within: Duration,
) -> Instant {
    let deadline = Instant::now() + within;
    loop {
        if state_of(&rx.borrow_and_update(), peer) == state {
            return Instant::now();
        }
        match tokio::time::timeout_at(deadline, rx.changed()).await {
            Ok(Ok(())) => {}
            _ => panic!("{peer} not {state:?} within {within:?}"),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn three_nodes_call_each_other_and_themselves() {
    let names = ["n1", "n2", "n3"];
    let c = Cluster::start(&names, 100).await;
    c.all_up(Duration::from_millis(250)).await;
    for (i, caller) in names.iter().enumerate() {
        let t = c.node(i);
        assert_eq!(t.node_id(), *caller);
        for callee in names {
            let reply = t.call(callee, b"hi".to_vec(), t.default_call_timeout()).await;
            assert_eq!(reply, Ok(format!("{callee}:{caller}:hi").into_bytes()), "{caller} -> {callee}");
        }
        for p in t.peers() {
            assert_eq!(p.state, PeerState::Up, "{caller} sees {}", p.node);
            assert!(p.last_seen_ms.is_some());
        }
    }
    for i in 0..3 {
        assert_eq!(c.echo(i).served(), 3);
    }
    assert_eq!(
        c.node(0).call("nobody", vec![], Duration::from_secs(1)).await,
        Err(TransportError::UnknownNode("nobody".into()))
    );
    assert_eq!(c.node(0).detection_bound(), Duration::from_millis(400));
}

#[tokio::test(start_paused = true)]
async fn an_oversized_request_is_refused_before_sending() {
    let c = Cluster::start(&["n1", "n2"], 100).await;
    c.all_up(Duration::from_millis(250)).await;
    let started = Instant::now();
    let reply = c.node(0).call("n2", vec![0; REQUEST_BYTES_MAX + 1], Duration::from_secs(1)).await;
    assert_eq!(
        reply,
        Err(TransportError::TooLarge {
            what: "request",
            bytes: REQUEST_BYTES_MAX + 1,
            bytes_max: REQUEST_BYTES_MAX
        })
    );
    assert_eq!(started.elapsed(), Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(c.echo(1).served(), 0);
    // The largest allowed request goes through.
    let reply = c.node(0).call("n2", vec![b'x'; REQUEST_BYTES_MAX], Duration::from_secs(1)).await;
    assert_eq!(reply, Ok(format!("n2:n1:len={REQUEST_BYTES_MAX}").into_bytes()));
    assert_eq!(c.echo(1).served(), 1);
}

#[tokio::test(start_paused = true)]
async fn oversized_replies_and_panics_become_typed_errors() {
    let c = Cluster::start(&["n1", "n2"], 100).await;
    c.all_up(Duration::from_millis(250)).await;
    let second = Duration::from_secs(1);
    assert_eq!(
        c.node(0).call("n2", b"big".to_vec(), second).await,
        Err(TransportError::TooLarge {
            what: "reply",
            bytes: REPLY_BYTES_MAX + 1,
            bytes_max: REPLY_BYTES_MAX
        })
    );
    assert_eq!(
        c.node(0).call("n2", b"panic".to_vec(), second).await,
        Err(TransportError::HandlerFailed("n2".into()))
    );
    // Also on a call to itself.
    assert_eq!(
        c.node(0).call("n1", b"panic".to_vec(), second).await,
        Err(TransportError::HandlerFailed("n1".into()))
    );
    // Still serving afterwards.
    assert_eq!(c.node(0).call("n2", b"ok".to_vec(), second).await, Ok(b"n2:n1:ok".to_vec()));
}

#[tokio::test(start_paused = true)]
async fn calls_beyond_the_inflight_limit_are_overloaded() {
    let c = Cluster::start(&["n1", "n2"], 100).await;
    c.all_up(Duration::from_millis(250)).await;
    let extra = 50;
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..INFLIGHT_CALLS_MAX + extra {
        let t = c.node(0).clone();
        calls.spawn(async move { t.call("n2", b"slow".to_vec(), Duration::from_secs(5)).await });
    }
    let (mut ok, mut overloaded) = (0, 0);
    while let Some(outcome) = calls.join_next().await {
        match outcome.expect("call task") {
            Ok(reply) => {
                assert_eq!(reply, b"n2:n1:slow");
                ok += 1;
            }
            Err(TransportError::Overloaded(node)) if node == "n2" => overloaded += 1,
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    assert_eq!((ok, overloaded), (INFLIGHT_CALLS_MAX, extra));
    assert_eq!(c.echo(1).served(), INFLIGHT_CALLS_MAX);
    // The permits come back.
    assert_eq!(c.node(0).call("n2", b"ok".to_vec(), Duration::from_secs(1)).await, Ok(b"n2:n1:ok".to_vec()));
}

#[tokio::test(start_paused = true)]
async fn a_node_with_another_fingerprint_is_refused_and_never_up() {
    let names = ["n1", "n2", "n3"];
    let links = Arc::new(TestLinks::default());
    let net = MemNetwork::new(links);
    let n1 = Transport::start_in(config("n1", &names, 100), Echo::new("n1"), net.clone()).await.unwrap();
    let n2 = Transport::start_in(config("n2", &names, 100), Echo::new("n2"), net.clone()).await.unwrap();
    let mut odd = config("n3", &names, 100);
    odd.fingerprint = 0xbad;
    let n3_echo = Echo::new("n3");
    let n3 = Transport::start_in(odd, n3_echo.clone(), net.clone()).await.unwrap();

    // Record every state n1 and n2 publish for n3 over many heartbeats.
    let mut watchers = Vec::new();
    for t in [&n1, &n2] {
        let mut rx = t.subscribe();
        watchers.push(tokio::spawn(async move {
            let mut seen = BTreeSet::new();
            let until = Instant::now() + Duration::from_secs(2);
            loop {
                seen.insert(state_of(&rx.borrow_and_update(), "n3"));
                if tokio::time::timeout_at(until, rx.changed()).await.is_err() {
                    return seen;
                }
            }
        }));
    }
    wait_state(&n1, "n2", PeerState::Up, Duration::from_millis(250)).await;
    for w in watchers {
        assert_eq!(w.await.unwrap(), [PeerState::Down].into());
    }
    let n3_seen = n1.peers().into_iter().find(|p| p.node == "n3").unwrap();
    assert_eq!((n3_seen.state, n3_seen.refused_fingerprint), (PeerState::Down, Some(0xbad)));
    assert!(matches!(
        n1.call("n3", b"hi".to_vec(), Duration::from_secs(1)).await,
        Err(TransportError::Refused { node, .. }) if node == "n3"
    ));
    let n1_seen = n3.peers().into_iter().find(|p| p.node == "n1").unwrap();
    assert_eq!((n1_seen.state, n1_seen.refused_fingerprint), (PeerState::Down, Some(FINGERPRINT)));
    assert!(matches!(
        n3.call("n1", b"hi".to_vec(), Duration::from_secs(1)).await,
        Err(TransportError::Refused { .. })
    ));
    assert_eq!(n3_echo.served(), 0);
    assert_eq!(n1.call("n2", b"hi".to_vec(), Duration::from_secs(1)).await, Ok(b"n2:n1:hi".to_vec()));
}

#[tokio::test(start_paused = true)]
async fn a_lost_request_times_out_without_reaching_the_handler() {
    // A slow heartbeat, so no ping changes a peer's state during the call.
    let c = Cluster::start(&["n1", "n2"], 1_000).await;
    c.all_up(Duration::from_millis(50)).await;
    c.links.lose("n1", "n2", true);
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    let reply = c.node(0).call("n2", b"hi".to_vec(), timeout).await;
    assert_eq!(reply, Err(TransportError::Timeout { node: "n2".into(), timeout_ms: 300 }));
    assert_eq!(started.elapsed(), timeout);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(c.echo(1).served(), 0);
    c.links.lose("n1", "n2", false);
    assert_eq!(c.node(0).call("n2", b"hi".to_vec(), timeout).await, Ok(b"n2:n1:hi".to_vec()));
}

#[tokio::test(start_paused = true)]
async fn a_lost_answer_times_out_after_the_handler_ran() {
    let c = Cluster::start(&["n1", "n2"], 1_000).await;
    c.all_up(Duration::from_millis(50)).await;
    c.links.lose("n2", "n1", true);
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    let reply = c.node(0).call("n2", b"hi".to_vec(), timeout).await;
    assert_eq!(reply, Err(TransportError::Timeout { node: "n2".into(), timeout_ms: 300 }));
    assert_eq!(started.elapsed(), timeout);
    assert_eq!(c.echo(1).served(), 1);

    // A caller that gives up does not stop the server: the slow request is still served.
    c.links.lose("n2", "n1", false);
    let reply = c.node(0).call("n2", b"slow".to_vec(), timeout).await;
    assert!(matches!(reply, Err(TransportError::Timeout { .. })), "{reply:?}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(c.echo(1).served(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_cut_off_node_goes_suspect_then_down_and_comes_back_when_healed() {
    let names = ["n1", "n2", "n3"];
    let c = Cluster::start(&names, 100).await;
    c.all_up(Duration::from_millis(250)).await;
    let n1 = c.node(0);
    let bound = n1.detection_bound();
    let mut rx = n1.subscribe();

    c.links.cut("n3", true);
    let cut_at = Instant::now();
    let suspect_at = wait_state_rx(&mut rx, "n3", PeerState::Suspect, bound).await;
    // While suspect, a call is attempted and times out (never hangs).
    let timeout = Duration::from_millis(50);
    assert_eq!(
        n1.call("n3", b"hi".to_vec(), timeout).await,
        Err(TransportError::Timeout { node: "n3".into(), timeout_ms: 50 })
    );
    let down_at = wait_state_rx(&mut rx, "n3", PeerState::Down, bound).await;
    assert!(suspect_at < down_at);
    assert!(down_at - cut_at <= bound, "down after {:?}, bound {bound:?}", down_at - cut_at);
    // Down: calls fail at once.
    let started = Instant::now();
    assert_eq!(n1.call("n3", b"hi".to_vec(), timeout).await, Err(TransportError::Unreachable("n3".into())));
    assert_eq!(started.elapsed(), Duration::ZERO);
    // The cut node sees everyone down too; the others still see each other.
    let n3 = c.node(2);
    wait_state(n3, "n1", PeerState::Down, bound).await;
    wait_state(n3, "n2", PeerState::Down, bound).await;
    assert_eq!(state_of(&n1.peers(), "n2"), PeerState::Up);

    // Stay cut for several detection bounds, then heal: up again within a heartbeat or two.
    tokio::time::sleep(bound * 3).await;
    assert_eq!(state_of(&n1.peers(), "n3"), PeerState::Down);
    c.links.cut("n3", false);
    let healed_at = Instant::now();
    let up_at = wait_state_rx(&mut rx, "n3", PeerState::Up, Duration::from_millis(250)).await;
    assert!(up_at - healed_at <= Duration::from_millis(250));
    wait_state(n3, "n1", PeerState::Up, Duration::from_millis(250)).await;
    assert_eq!(n1.call("n3", b"hi".to_vec(), timeout).await, Ok(b"n3:n1:hi".to_vec()));
    assert_eq!(n3.call("n1", b"hi".to_vec(), timeout).await, Ok(b"n1:n3:hi".to_vec()));
}

#[tokio::test(start_paused = true)]
async fn a_shut_down_node_fails_calls_at_once_and_a_restart_is_reachable() {
    let names = ["n1", "n2"];
    let c = Cluster::start(&names, 100).await;
    c.all_up(Duration::from_millis(250)).await;
    let (n1, n2) = (c.node(0), c.node(1));

    // A node id runs once per network.
    let twice = Transport::start_in(config("n2", &names, 100), Echo::new("twin"), c.net.clone()).await;
    assert!(matches!(twice, Err(TransportError::Listen { .. })), "{twice:?}");

    // A call in flight when the callee stops: its session closes under it.
    let slow = tokio::spawn({
        let n1 = n1.clone();
        async move { n1.call("n2", b"slow".to_vec(), Duration::from_secs(5)).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let stopped_at = Instant::now();
    n2.shutdown().await;
    assert_eq!(slow.await.unwrap(), Err(TransportError::Disconnected("n2".into())));
    assert_eq!(stopped_at.elapsed(), Duration::ZERO);
    n2.shutdown().await; // idempotent
    assert_eq!(n2.call("n1", vec![], Duration::from_secs(1)).await, Err(TransportError::ShutDown));
    assert!(n2.peers().iter().all(|p| p.state == PeerState::Down));
    // n1 may still believe n2 is up, but there is no session: the call fails at once.
    assert_eq!(state_of(&n1.peers(), "n2"), PeerState::Up);
    let started = Instant::now();
    assert_eq!(
        n1.call("n2", b"hi".to_vec(), Duration::from_secs(1)).await,
        Err(TransportError::Unreachable("n2".into()))
    );
    assert_eq!(started.elapsed(), Duration::ZERO);
    wait_state(n1, "n2", PeerState::Down, Duration::from_millis(150)).await;

    // Restart n2 (a new handler shows it is the new process answering).
    let again = Echo::new("n2-again");
    let n2b =
        Transport::start_in(config("n2", &names, 100), again.clone(), c.net.clone()).await.expect("restart");
    wait_state(n1, "n2", PeerState::Up, Duration::from_millis(250)).await;
    wait_state(&n2b, "n1", PeerState::Up, Duration::from_millis(250)).await;
    assert_eq!(n1.call("n2", b"hi".to_vec(), Duration::from_secs(1)).await, Ok(b"n2-again:n1:hi".to_vec()));
    assert_eq!(n2b.call("n1", b"hi".to_vec(), Duration::from_secs(1)).await, Ok(b"n1:n2:hi".to_vec()));
    assert_eq!((c.echo(1).served(), again.served()), (1, 1));
}
