//! What a node needs to know to talk to the rest of the cluster, validated before anything
//! binds a socket.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::error::TransportError;

/// Longest accepted node name, in bytes (the same bound as counter names).
pub const NODE_ID_BYTES_MAX: usize = 255;
/// Shortest accepted heartbeat interval, in ms: below this a busy 2-core machine would
/// declare healthy peers dead.
pub const HEARTBEAT_MS_MIN: u64 = 10;
/// Largest accepted number of peers: every peer costs a heartbeat task and, for the dialing
/// side, a connector task.
pub const PEERS_MAX: usize = 256;

/// How this node joins the cluster. The cluster-wide part (secret, fingerprint, timing) must
/// be identical on every node; `node_id` and `listen` are per node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportConfig {
    /// This node's stable name. Peers address it by this name; it must match the key under
    /// which every other node lists it in `peers`, and must survive restarts, because
    /// ractor's remote actor ids do not.
    pub node_id: String,
    /// Where this node's ractor_cluster `NodeServer` listens; the other nodes dial it.
    pub listen: SocketAddr,
    /// Every other node: name -> address. Only these names may hold a session with us.
    pub peers: BTreeMap<String, SocketAddr>,
    /// Shared cookie for ractor_cluster's challenge-response handshake; a node with another
    /// secret never completes a handshake.
    pub secret: String,
    /// Fingerprint of the cluster-wide config. Every ping and call carries it; a peer with a
    /// different one is refused (and logged with both values) so two differently configured
    /// nodes never exchange data.
    pub fingerprint: u64,
    /// Ping interval, in ms; each ping's deadline is also one interval.
    pub heartbeat_ms: u64,
    /// Consecutive missed pings after which the peer is `Down` and its session is torn down.
    pub heartbeat_misses_max: u32,
    /// First reconnect delay, in ms.
    pub reconnect_backoff_min_ms: u64,
    /// Longest reconnect delay, in ms.
    pub reconnect_backoff_max_ms: u64,
    /// Default deadline for [`crate::Transport::call`], in ms (see
    /// [`crate::Transport::default_call_timeout`]).
    pub call_timeout_ms: u64,
    /// Mutual TLS on every session, with the cluster CA as the only root: a peer
    /// whose certificate another CA signed never reaches the secret handshake.
    /// Plaintext when `None`.
    pub tls: Option<tally_tls::ClusterTls>,
}

impl TransportConfig {
    /// Deadline of one ping: one heartbeat interval (an answer slower than the interval is as
    /// useless to the detector as no answer).
    pub fn ping_timeout(&self) -> Duration {
        Duration::from_millis(self.heartbeat_ms)
    }

    /// Worst-case time from a peer going silent to this node declaring it `Down` and tearing
    /// its session down: the `misses_max` pings that must miss, each issued one interval
    /// apart, plus the deadline of the last one — `heartbeat_ms × (misses_max + 1)`, plus
    /// timer and scheduling latency (a few ms when the machine is not overloaded). A crashed
    /// process (closed socket) is usually detected within one interval.
    pub fn detection_bound(&self) -> Duration {
        Duration::from_millis(
            self.heartbeat_ms.saturating_mul(u64::from(self.heartbeat_misses_max.max(1)).saturating_add(1)),
        )
    }

    /// How long a dialed (or accepted) session may take to authenticate before it is killed:
    /// the detection bound, since a peer that cannot finish a handshake in that time would be
    /// declared dead anyway (a paused process still accepts TCP connections into its backlog).
    pub fn handshake_timeout(&self) -> Duration {
        self.detection_bound()
    }

    /// Checks everything that would otherwise fail later and less clearly.
    pub fn validate(&self) -> Result<(), TransportError> {
        let bad = |m: String| Err(TransportError::Config(m));
        check_name("node_id", &self.node_id)?;
        for name in self.peers.keys() {
            check_name("peer name", name)?;
        }
        if self.peers.len() > PEERS_MAX {
            return bad(format!("{} peers, more than the limit of {PEERS_MAX}", self.peers.len()));
        }
        if self.peers.contains_key(&self.node_id) {
            return bad(format!("peers lists this node itself ({:?})", self.node_id));
        }
        if self.listen.port() == 0 {
            return bad("listen port 0 is not allowed: peers must know where to dial".into());
        }
        if self.secret.is_empty() {
            return bad("secret is empty".into());
        }
        if self.heartbeat_ms < HEARTBEAT_MS_MIN {
            return bad(format!(
                "heartbeat_ms {} is below the minimum {HEARTBEAT_MS_MIN}",
                self.heartbeat_ms
            ));
        }
        if self.heartbeat_misses_max == 0 {
            return bad("heartbeat_misses_max must be at least 1".into());
        }
        if self.reconnect_backoff_min_ms == 0 || self.reconnect_backoff_min_ms > self.reconnect_backoff_max_ms
        {
            return bad(format!(
                "reconnect backoff must satisfy 0 < min ({}) <= max ({})",
                self.reconnect_backoff_min_ms, self.reconnect_backoff_max_ms
            ));
        }
        if self.call_timeout_ms == 0 {
            return bad("call_timeout_ms must be positive".into());
        }
        Ok(())
    }
}

/// Node names end up inside ractor_cluster's `name@host` and in our dial labels, so `@` and
/// `#` are refused along with anything that is not a plain identifier.
fn check_name(what: &str, name: &str) -> Result<(), TransportError> {
    let ok = !name.is_empty()
        && name.len() <= NODE_ID_BYTES_MAX
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(TransportError::Config(format!(
            "{what} {name:?} must be 1-{NODE_ID_BYTES_MAX} bytes of [A-Za-z0-9._:-]"
        )))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample() -> TransportConfig {
        TransportConfig {
            node_id: "node1".into(),
            listen: "127.0.0.1:7001".parse().unwrap(),
            peers: [("node2".to_string(), "127.0.0.1:7002".parse().unwrap())].into_iter().collect(),
            secret: "s3cret".into(),
            fingerprint: 0xfeed,
            heartbeat_ms: 200,
            heartbeat_misses_max: 3,
            reconnect_backoff_min_ms: 100,
            reconnect_backoff_max_ms: 1_000,
            call_timeout_ms: 1_000,
            tls: None,
        }
    }

    #[test]
    fn sample_is_valid_and_bound_is_interval_times_misses_plus_one() {
        let c = sample();
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.detection_bound(), Duration::from_millis(800));
        assert_eq!(c.ping_timeout(), Duration::from_millis(200));
    }

    #[test]
    fn refuses_what_would_break_later() {
        type Mutation = fn(&mut TransportConfig);
        let cases: [(&str, Mutation); 11] = [
            ("empty id", |c| c.node_id.clear()),
            ("@ in id", |c| c.node_id = "a@b".into()),
            ("# in peer", |c| c.peers = [("x#1".to_string(), c.listen)].into()),
            ("self in peers", |c| {
                c.peers.insert("node1".into(), c.listen);
            }),
            ("port 0", |c| c.listen.set_port(0)),
            ("no secret", |c| c.secret.clear()),
            ("fast heartbeat", |c| c.heartbeat_ms = 1),
            ("no misses", |c| c.heartbeat_misses_max = 0),
            ("backoff order", |c| c.reconnect_backoff_min_ms = 5_000),
            ("zero backoff", |c| c.reconnect_backoff_min_ms = 0),
            ("zero call timeout", |c| c.call_timeout_ms = 0),
        ];
        for (what, mutate) in cases {
            let mut c = sample();
            mutate(&mut c);
            assert!(matches!(c.validate(), Err(TransportError::Config(_))), "{what} accepted");
        }
    }
}
