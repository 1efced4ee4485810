//! Which ractor_cluster sessions exist, to which peer, and in what state.
//!
//! ractor_cluster tells us about sessions through [`NodeEventSubscription`] callbacks (run
//! inside the `NodeServer` actor, so they only take a short lock and never block). The table
//! answers the questions the rest of the transport asks: is there a session to this peer, has
//! my dial authenticated, which remote actor ids belong to the current session (ids change on
//! reconnect), and which session actors must be stopped when a peer is declared dead.
//!
//! A session's peer is known from the dial label for outbound sessions (we chose it) and from
//! the authenticated `name@host` for both directions. ractor_cluster has no handshake timeout
//! and no liveness check, so [`Sessions::sweep`] stops sessions stuck in the handshake and
//! kills sessions that did not stop when asked.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ractor::{ActorId, ActorRef, ActorStatus};
use ractor_cluster::node::NodeServerSessionInformation;
use ractor_cluster::{NodeEventSubscription, NodeSessionMessage};
use tokio::sync::watch;

use crate::backoff::{unix_ms, LogLimiter, RECONNECT_LOG_INTERVAL_MS};
use tally_tls::refusals::{self, Listener, Reason, AUDIT_TARGET};

/// Prefix of the label we give outbound streams; ractor_cluster reports it back as the
/// session's `peer_addr`, which is how a dial is matched to its session.
pub const DIAL_LABEL_PREFIX: &str = "tally-dial:";

/// Builds the label for dial number `seq` to `peer`.
pub fn dial_label(peer: &str, seq: u64) -> String {
    format!("{DIAL_LABEL_PREFIX}{peer}#{seq}")
}

/// The peer a dial label names, if it is one of ours.
pub fn dial_label_peer(label: &str) -> Option<&str> {
    label.strip_prefix(DIAL_LABEL_PREFIX)?.rsplit_once('#').map(|(peer, _)| peer)
}

/// Our node id from ractor_cluster's `node_id@host` session name.
pub fn node_of(full_name: &str) -> &str {
    full_name.rsplit_once('@').map_or(full_name, |(node, _)| node)
}

/// One ractor_cluster `NodeSession`.
#[derive(Debug, Clone)]
pub(crate) struct SessionRecord {
    /// The session actor, to stop it.
    pub(crate) actor: ActorRef<NodeSessionMessage>,
    /// ractor_cluster's per-session node id: the `node_id` of every `ActorId::Remote` that
    /// arrived over this session, which is how a pg member is tied to its session.
    pub(crate) session_node_id: u64,
    /// The peer, once known (dial label or authenticated name).
    pub(crate) peer: Option<String>,
    /// Our dial label for outbound sessions.
    pub(crate) dial_label: Option<String>,
    /// True for sessions the peer opened.
    pub(crate) inbound: bool,
    /// Set when ractor_cluster reports the session authenticated (and elected).
    pub(crate) authenticated: bool,
    /// When the session appeared, for the handshake timeout.
    pub(crate) opened: Instant,
    /// When we asked it to stop, for the kill-after-grace fallback.
    pub(crate) stop_requested: Option<Instant>,
    /// Refused once already (a node not in the peer list), so its close is not
    /// counted as a second refusal.
    pub(crate) refused: bool,
}

impl SessionRecord {
    fn live(&self) -> bool {
        self.stop_requested.is_none()
    }
}

/// How a dial is doing, as seen by the connector waiting on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DialState {
    /// The session exists but has not authenticated yet.
    Pending,
    /// Some live session to the peer has authenticated.
    Authenticated,
    /// The dialed session is gone (auth failed, election lost, closed).
    Gone,
}

/// The records, and per-(peer, up/down) limiters so a peer that is refused or flapping
/// logs its session changes once per interval, not once per reconnect.
#[derive(Default)]
struct Table {
    records: HashMap<ActorId, SessionRecord>,
    logs: BTreeMap<(String, bool), LogLimiter>,
}

impl Table {
    /// `Some(suppressed)` if a session up (`up = true`) or down line for `peer` may be logged.
    fn log_allowed(&mut self, peer: &str, up: bool) -> Option<u64> {
        self.logs
            .entry((peer.to_string(), up))
            .or_insert_with(|| LogLimiter::new(RECONNECT_LOG_INTERVAL_MS))
            .allow(unix_ms())
    }
}

/// The session table plus a generation counter bumped on every change, which connectors
/// watch instead of polling.
pub(crate) struct Sessions {
    node_id: String,
    peers: BTreeSet<String>,
    table: Mutex<Table>,
    generation: watch::Sender<u64>,
}

impl Sessions {
    pub(crate) fn new(node_id: String, peers: BTreeSet<String>) -> Self {
        Sessions { node_id, peers, table: Mutex::new(Table::default()), generation: watch::Sender::new(0) }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // A panic while holding this lock cannot leave the map half-updated in a way that
        // matters (each update is one insert/remove/field write), so poisoning is ignored.
        self.table.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn bump(&self) {
        self.generation.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// A receiver that wakes on every session change.
    pub(crate) fn watch(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    fn record_from(ses: &NodeServerSessionInformation) -> SessionRecord {
        let label = ses.peer_addr.clone();
        let dial_peer = dial_label_peer(&label).map(str::to_string);
        SessionRecord {
            actor: ses.actor.clone(),
            session_node_id: ses.node_id,
            peer: dial_peer.clone(),
            dial_label: dial_peer.map(|_| label),
            inbound: ses.is_server,
            authenticated: false,
            opened: Instant::now(),
            stop_requested: None,
            refused: false,
        }
    }

    pub(crate) fn on_opened(&self, ses: NodeServerSessionInformation) {
        let record = Self::record_from(&ses);
        tracing::debug!(
            node = %self.node_id, peer = ?record.peer, inbound = ses.is_server, addr = %ses.peer_addr,
            "session opened, handshaking"
        );
        self.lock().records.insert(ses.actor.get_id(), record);
        self.bump();
    }

    pub(crate) fn on_authenticated(&self, ses: NodeServerSessionInformation) {
        let Some(full_name) = ses.peer_name.as_ref().map(|n| n.name.clone()) else {
            return;
        };
        let peer = node_of(&full_name).to_string();
        {
            let mut guard = self.lock();
            let table = &mut *guard;
            let record = table.records.entry(ses.actor.get_id()).or_insert_with(|| Self::record_from(&ses));
            let dialed = record.dial_label.as_deref().and_then(dial_label_peer).map(str::to_string);
            if !self.peers.contains(&peer) {
                if record.inbound {
                    refusals::count(Listener::Node, Reason::UnknownPeer);
                }
                record.refused = true;
                refusals::log_limited(|| {
                    tracing::warn!(
                        target: AUDIT_TARGET, node = %self.node_id, addr = %ses.peer_addr, outcome = "refused",
                        reason = Reason::UnknownPeer.as_str(), "closing session from {full_name:?}: not in the peer list"
                    )
                });
                record.stop_requested = Some(Instant::now());
                record.actor.stop(Some("tally: unknown peer".into()));
            } else if dialed.as_deref().is_some_and(|d| d != peer) {
                tracing::error!(
                    node = %self.node_id,
                    "dialed {:?} at its configured address but {peer:?} answered; check the peer addresses",
                    dialed.unwrap_or_default()
                );
                record.stop_requested = Some(Instant::now());
                record.actor.stop(Some("tally: wrong peer at address".into()));
            } else {
                record.peer = Some(peer.clone());
                record.authenticated = true;
                let inbound = record.inbound;
                if let Some(suppressed) = table.log_allowed(&peer, true) {
                    tracing::info!(
                        node = %self.node_id, peer = %peer, inbound, suppressed,
                        "session up with {peer} ({})", if inbound { "accepted" } else { "dialed" }
                    );
                }
            }
        }
        self.bump();
    }

    pub(crate) fn on_disconnected(&self, ses: NodeServerSessionInformation) {
        {
            let mut table = self.lock();
            match table.records.remove(&ses.actor.get_id()) {
                Some(SessionRecord { authenticated: true, peer: Some(peer), .. }) => {
                    if let Some(suppressed) = table.log_allowed(&peer, false) {
                        tracing::info!(node = %self.node_id, peer = %peer, suppressed, "session down with {peer}");
                    }
                }
                Some(r) if r.inbound && !r.refused => {
                    // A dialer that could not prove the cluster secret, or stayed
                    // silent until the handshake timeout.
                    refusals::count(Listener::Node, Reason::Unauthenticated);
                    refusals::log_limited(|| {
                        tracing::warn!(
                            target: AUDIT_TARGET, node = %self.node_id, addr = %ses.peer_addr, outcome = "refused",
                            reason = Reason::Unauthenticated.as_str(),
                            "refused an inbound node-to-node session: it closed before proving the cluster secret"
                        )
                    });
                }
                Some(r) => {
                    tracing::debug!(node = %self.node_id, peer = ?r.peer, "session closed before authenticating")
                }
                None => {}
            }
        }
        self.bump();
    }

    /// Is there a live session to `peer`, authenticated or still handshaking?
    pub(crate) fn has_session(&self, peer: &str) -> bool {
        self.lock().records.values().any(|r| r.live() && r.peer.as_deref() == Some(peer))
    }

    /// How the dial labelled `label` to `peer` is doing.
    pub(crate) fn dial_state(&self, peer: &str, label: &str) -> DialState {
        let table = self.lock();
        if table.records.values().any(|r| r.live() && r.authenticated && r.peer.as_deref() == Some(peer)) {
            return DialState::Authenticated;
        }
        if table.records.values().any(|r| r.live() && r.dial_label.as_deref() == Some(label)) {
            DialState::Pending
        } else {
            DialState::Gone
        }
    }

    /// ractor_cluster session node ids of the live authenticated sessions to `peer`, newest
    /// first: a pg member is only trusted if it came over one of these.
    pub(crate) fn route_ids(&self, peer: &str) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .lock()
            .records
            .values()
            .filter(|r| r.live() && r.authenticated && r.peer.as_deref() == Some(peer))
            .map(|r| r.session_node_id)
            .collect();
        ids.sort_unstable_by(|a, b| b.cmp(a));
        ids
    }

    /// Asks every session to `peer` to stop (sweep kills them if they linger). Returns how
    /// many were asked.
    pub(crate) fn stop_peer(&self, peer: &str, reason: &str) -> usize {
        let mut n = 0;
        {
            let mut table = self.lock();
            for r in table.records.values_mut().filter(|r| r.live() && r.peer.as_deref() == Some(peer)) {
                r.stop_requested = Some(Instant::now());
                r.actor.stop(Some(format!("tally: {reason}")));
                n += 1;
            }
        }
        if n > 0 {
            self.bump();
        }
        n
    }

    /// Stops the session of one dial (used when its handshake times out).
    pub(crate) fn stop_dial(&self, label: &str) {
        {
            let mut table = self.lock();
            for r in table.records.values_mut().filter(|r| r.live() && r.dial_label.as_deref() == Some(label))
            {
                r.stop_requested = Some(Instant::now());
                r.actor.stop(Some("tally: handshake timeout".into()));
            }
        }
        self.bump();
    }

    /// Housekeeping, run once per heartbeat: stop sessions stuck in the handshake for longer
    /// than `handshake_timeout` (inbound ones too: ractor_cluster would keep them forever),
    /// kill sessions that ignored a stop for `stop_grace`, and forget sessions whose actor is
    /// dead without a disconnect event.
    pub(crate) fn sweep(&self, handshake_timeout: Duration, stop_grace: Duration) {
        let mut changed = false;
        {
            let mut table = self.lock();
            table.records.retain(|_, r| {
                if r.actor.get_status() == ActorStatus::Stopped {
                    changed = true;
                    return false;
                }
                match r.stop_requested {
                    Some(at) if at.elapsed() > stop_grace => {
                        tracing::debug!(peer = ?r.peer, "session ignored stop; killing it");
                        r.actor.kill();
                    }
                    Some(_) => {}
                    None if !r.authenticated && r.opened.elapsed() > handshake_timeout => {
                        tracing::debug!(peer = ?r.peer, inbound = r.inbound, "handshake timed out; closing");
                        r.stop_requested = Some(Instant::now());
                        r.actor.stop(Some("tally: handshake timeout".into()));
                        changed = true;
                    }
                    None => {}
                }
                true
            });
        }
        if changed {
            self.bump();
        }
    }

    /// Adds authenticated sessions the NodeServer knows but we missed (a connection accepted
    /// before our subscription was registered would otherwise be invisible forever).
    pub(crate) fn reconcile(&self, authenticated: impl IntoIterator<Item = NodeServerSessionInformation>) {
        for ses in authenticated {
            let known = self.lock().records.get(&ses.actor.get_id()).is_some_and(|r| r.authenticated);
            // A session already stopping may have had its disconnect event already.
            if !known && ses.actor.get_status() < ActorStatus::Stopping {
                self.on_authenticated(ses);
            }
        }
    }
}

/// Forwards ractor_cluster's session events into the table.
pub(crate) struct Events(pub(crate) std::sync::Arc<Sessions>);

impl NodeEventSubscription for Events {
    fn node_session_opened(&self, ses: NodeServerSessionInformation) {
        self.0.on_opened(ses);
    }

    fn node_session_disconnected(&self, ses: NodeServerSessionInformation) {
        self.0.on_disconnected(ses);
    }

    fn node_session_authenticated(&self, ses: NodeServerSessionInformation) {
        self.0.on_authenticated(ses);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_names_parse() {
        let l = dial_label("node-2", 17);
        assert_eq!(dial_label_peer(&l), Some("node-2"));
        assert_eq!(dial_label_peer("127.0.0.1:4000"), None);
        assert_eq!(dial_label_peer("tally-dial:no-seq"), None);
        assert_eq!(node_of("node1@node1"), "node1");
        assert_eq!(node_of("plain"), "plain");
    }
}
