//! [`Replication`]: a node's part in shard replication, over any way to reach its
//! peers. The cluster runs it over the node-to-node sessions; the simulator runs
//! the very same code over its simulated links.
//!
//! * **Directory.** The ring's circle is cut into ranges, each replicated on
//!   `min(R, members)` nodes ([`tally_core::ranges::Directory`]). Every node
//!   computes the same directory: the initial members' one, rebalanced onto the
//!   current members ([`Replication::set_members`]), a pure function of the two
//!   member sets.
//! * **Replica classes.** A counter that states its own replica count has its
//!   shards in ranges of that class ([`tally_core::ranges::RangeId::class`]). The
//!   metadata group records each class with the members at its first counter's
//!   creation ([`tally_core::ranges::record_class`]); a node assigns the class's
//!   ranges on those members, then rebalances them onto the current members with
//!   the cluster's ([`Replication::follow_classes`]). So every node computes the
//!   same class directory, and a class's groups are formed by members that were
//!   there when it was first used.
//! * **Replica ids.** A replica's raft id belongs to its node's store incarnation
//!   ([`Peers::replica_of`]): a node that comes back with an empty disk is a new
//!   replica, which the range's leader adds as a learner and promotes, replacing
//!   the old id, only once it holds everything the leader applied
//!   ([`Replication::tend`]).
//! * **Forming.** A range's group is initialized once, by its preferred leader in
//!   the initial members' directory, when every replica's store is known and every
//!   other replica, of that directory and of the current one, answers that its
//!   group holds nothing yet ([`Peers::formed`]); a node whose peers already formed
//!   the group waits to be added instead, so an emptied node never starts a rival
//!   group.
//! * **Membership.** The leader of each range makes its group's voters the
//!   directory's replicas: it adds the new ones as learners, and once every one of
//!   them holds everything it applied, replaces the voters in one joint change
//!   ([`Replication::tend`]). A node the directory gives a range opens its group
//!   empty and waits to be added; one it takes a range from is removed by that
//!   change, and keeps its copy's data on disk.
//! * **Routing.** A shard's requests go to its range's leader
//!   ([`Replication::owner`]); a node that is not the leader refuses to serve the
//!   shard's state ([`Replication::confirm`]); a request its leader did not serve
//!   goes to the next leader when sending it again cannot count twice
//!   ([`Replication::call`]).

use crate::groups::{GroupMembers, RangeGroups, ReplicaError, FAILOVER_BOUND_MS};
use crate::types::{ReplicaId, ReplicaNode};
use futures::future::BoxFuture;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tally_core::ranges::{Directory, RangeError, RangeId};
use tally_core::{NodeId, ShardId};
use tally_engine::{RangeReport, ReplicaReport, ReplicaRole, ShardRequest, ShardResponse, Tally, TallyError};

/// Longest wait for a range to have a leader before a request gives up: a
/// failover, and a heartbeat for the news to spread.
pub const LEADER_WAIT_MS: u64 = FAILOVER_BOUND_MS + 500;
/// Pause between looks at a range's leader while waiting for one.
pub const LEADER_POLL_MS: u64 = 20;
/// Most leaderships one request is sent to: the first, and a few elected meanwhile
/// (resends to a leadership that did not serve it do not count).
pub const CALL_LEADERSHIPS_MAX: usize = 5;
/// Pause before a request goes again to a leadership that did not serve it twice
/// running (the first resend goes at once): a leader that lost a message or two is
/// asked again rather than waited out until `LEADER_WAIT_MS`; a dead one is asked
/// too, but a newer leadership takes the request from it as soon as it is known.
pub const SAME_LEADER_RESEND_MS: u64 = 2 * crate::groups::HEARTBEAT_MS;
/// Pause between passes that form groups and replace replicas.
pub const TEND_EVERY_MS: u64 = 500;
/// How long a leader outside its group's membership stays closed after it stepped
/// aside: longer than the voters take to elect another (election timeouts are at
/// most 900 ms, and a vote takes a round trip).
pub const STEP_ASIDE_MS: u64 = 2_000;
/// Longest a range's part of one tending pass may take.
pub const TEND_PASS_MAX_MS: u64 = CATCH_UP_WAIT_MS + 1_000;
/// How long a learner may take to catch up before its promotion is tried again
/// on the next pass.
pub const CATCH_UP_WAIT_MS: u64 = 2_000;

/// What a node needs to know of its peers.
pub trait Peers: Send + Sync + 'static {
    /// The replica id node `node` runs now (its store incarnation's), `None` while
    /// the node's store is not known.
    fn replica_of(&self, node: &NodeId) -> Option<ReplicaId>;

    /// Whether `node`'s group of `range` holds a membership already; `None` when
    /// the node did not answer.
    fn formed<'a>(&'a self, node: &'a NodeId, range: RangeId) -> BoxFuture<'a, Option<bool>>;

    /// Whether `node`, as `range`'s leader, lists `replica` in the range's group
    /// ([`Replication::lists`]); `None` when it does not lead the range, a change
    /// is under way, or it did not answer.
    fn lists<'a>(
        &'a self,
        node: &'a NodeId,
        range: RangeId,
        replica: ReplicaId,
    ) -> BoxFuture<'a, Option<bool>>;

    /// The replica classes the metadata group recorded, each with the members it is
    /// assigned on ([`tally_core::ranges::record_class`]), as this node applied them.
    fn replica_classes(&self) -> BTreeMap<u8, Vec<NodeId>>;

    /// The voters the group of `range` (a replica class's) started with, as the
    /// metadata group recorded them and this node applied them; `None` if none is.
    fn formation(&self, range: RangeId) -> Option<Vec<(ReplicaId, ReplicaNode)>>;

    /// Asks the metadata group to record `voters` as the first voters of `range`'s
    /// group unless it has a record: answers the record that stays, `None` if the
    /// write did not go through.
    fn form_range(
        &self,
        range: RangeId,
        voters: Vec<(ReplicaId, ReplicaNode)>,
    ) -> BoxFuture<'_, Option<Vec<(ReplicaId, ReplicaNode)>>>;

    /// Asks `node` to stand for election in `range` once the lease of `departed`,
    /// the range's leader that is leaving it, has run out ([`Replication::campaign`]).
    /// Sent once; an answer is not waited for.
    fn campaign<'a>(&'a self, node: &'a NodeId, range: RangeId, departed: ReplicaId) -> BoxFuture<'a, ()>;
}

/// A node's part in shard replication.
pub struct Replication {
    me: NodeId,
    groups: Arc<RangeGroups>,
    /// How the circle is cut (the same in every directory).
    layout: tally_core::ranges::RangeLayout,
    /// The initial members' directory: who forms each range's group. It gains the
    /// replica classes this node assigns ([`Replication::follow_classes`]).
    initial: parking_lot::RwLock<Directory>,
    /// The replica classes of counters' own counts this node assigns, one bit each:
    /// a look that takes no lock on every routed request.
    classes: std::sync::atomic::AtomicU32,
    /// The current members' directory ([`Replication::set_members`]).
    directory: parking_lot::RwLock<Arc<Directory>>,
    peers: Arc<dyn Peers>,
    /// Ranges whose group removed this node's replica without its having applied
    /// the removal, as the last pass saw them.
    leaving: parking_lot::Mutex<std::collections::BTreeSet<RangeId>>,
    /// Ranges whose group this node closed although the directory wants it, and
    /// until when it stays closed.
    aside: parking_lot::Mutex<BTreeMap<RangeId, tokio::time::Instant>>,
    /// Ranges whose leader changes are being counted.
    watched: parking_lot::Mutex<std::collections::BTreeSet<RangeId>>,
    /// The replica that last served each range this node does not replicate (its
    /// leader, as far as this node learnt): where the range's requests go first.
    hints: parking_lot::Mutex<HashMap<RangeId, NodeId>>,
    /// Leader changes this node observed in the groups it runs.
    failovers: AtomicU64,
    /// Ranges this node led and left ([`Replication::hand_overs`]).
    hand_overs: AtomicU64,
    /// When it last did.
    last_hand_over: parking_lot::Mutex<Option<tokio::time::Instant>>,
    /// Groups this node closed once they no longer listed it ([`Replication::groups_retired`]).
    retired: AtomicU64,
    /// Ranges this node led and handed over when the change removing it committed
    /// ([`Replication::hand_overs`]), until it closes their groups: closing one of
    /// them is not another hand-over. (The group's metrics still name this node
    /// the leader after it stepped down: its vote stays committed.)
    handed_over: parking_lot::Mutex<std::collections::BTreeSet<RangeId>>,
}

/// A range's leader as a node knows it: the leader's node and the term it leads in.
/// What fails to serve a request is a leadership, not a node: a node elected again
/// leads a new term, and may serve what it did not serve before.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leadership {
    /// The leader's node.
    pub node: NodeId,
    /// Its raft term (0 when the term is not known).
    pub term: u64,
}

impl Leadership {
    /// Whether this is a leadership after `failed`: another node, or the same node
    /// in a later term.
    pub fn succeeds(&self, failed: &Leadership) -> bool {
        self.node != failed.node || self.term > failed.term
    }
}

fn unavailable(id: &ShardId, reason: String) -> TallyError {
    TallyError::Unavailable { shard: id.to_string(), reason }
}

/// Whether a request may be sent again after an attempt whose outcome is unknown:
/// everything but a count without an event id or drain id (which could count twice).
pub fn repeatable(request: &ShardRequest) -> bool {
    match request {
        ShardRequest::Submit { sub, .. } => sub.record_id().is_some(),
        _ => true,
    }
}

impl Replication {
    /// Node `me`'s replication over `groups`, cut by `directory`, the initial
    /// members' directory (the current one until [`Replication::set_members`]).
    pub fn new(me: NodeId, groups: Arc<RangeGroups>, directory: Directory, peers: Arc<dyn Peers>) -> Self {
        Self {
            me,
            groups,
            directory: parking_lot::RwLock::new(Arc::new(directory.clone())),
            layout: directory.layout(),
            initial: parking_lot::RwLock::new(directory),
            classes: std::sync::atomic::AtomicU32::new(0),
            peers,
            watched: Default::default(),
            leaving: Default::default(),
            aside: Default::default(),
            hints: parking_lot::Mutex::new(HashMap::new()),
            failovers: AtomicU64::new(0),
            hand_overs: AtomicU64::new(0),
            last_hand_over: parking_lot::Mutex::new(None),
            retired: AtomicU64::new(0),
            handed_over: Default::default(),
        }
    }

    /// The node's range groups.
    pub fn groups(&self) -> &Arc<RangeGroups> {
        &self.groups
    }

    /// The directory of ranges of the current members.
    pub fn directory(&self) -> Arc<Directory> {
        self.directory.read().clone()
    }

    /// Makes `members` the current members: the directory becomes the initial
    /// one rebalanced onto them (every node computes the same one from the same
    /// members, whatever changes it saw on the way). Answers whether it changed.
    /// The groups follow on the next passes of [`Replication::tend`].
    pub fn set_members(&self, members: impl IntoIterator<Item = NodeId>) -> Result<bool, RangeError> {
        let initial = self.initial.read();
        let (next, _) = initial.rebalance(members, None)?;
        let mut current = self.directory.write();
        if **current == next {
            return Ok(false);
        }
        tracing::info!(members = ?next.members(), "range directory follows a membership change");
        *current = Arc::new(next);
        Ok(true)
    }

    /// The range of shard `id` (ranges never move on the circle), in the shard's
    /// replica class. A class this node does not assign yet is looked up in the
    /// metadata it applied ([`Replication::follow_classes`]).
    pub fn range_of(&self, id: &ShardId) -> RangeId {
        let range = self.layout.range_of_shard(id);
        if !self.assigns(range.class()) {
            self.follow_classes();
        }
        range
    }

    /// Whether this node assigns the ranges of replica class `class` (the cluster's
    /// always).
    fn assigns(&self, class: u8) -> bool {
        class == tally_core::ids::CLUSTER_REPLICAS
            || (class < 32 && self.classes.load(Ordering::Acquire) & (1 << class) != 0)
    }

    /// Assigns the replica classes the metadata group recorded that this node does
    /// not assign yet: the initial directory gains each on its recorded members,
    /// and the current one is it rebalanced onto the current members, as
    /// [`Replication::set_members`] computes it. The next tending pass opens the
    /// class's groups this node replicates.
    pub fn follow_classes(&self) {
        for (class, members) in self.peers.replica_classes() {
            if self.assigns(class) {
                continue;
            }
            let mut initial = self.initial.write();
            // Recorded before any membership change: the configured members.
            let members = if members.is_empty() { initial.members().to_vec() } else { members };
            let current = self.directory().members().to_vec();
            let next =
                initial.with_class(class, members).and_then(|i| Ok((i.rebalance(current, None)?.0, i)));
            match next {
                Ok((current, with)) => {
                    *initial = with;
                    *self.directory.write() = Arc::new(current);
                    self.classes.fetch_or(1 << class, Ordering::AcqRel);
                    tracing::info!(class, "assigning the ranges of counters with their own replica count");
                }
                // A record this release cannot assign (a class out of range, or
                // no members): its ranges stay unserved, and this is said once
                // per pass.
                Err(e) => tracing::error!(class, error = %e, "cannot assign a replica class"),
            }
        }
    }

    /// The leadership of `id`'s range, as this node knows it.
    pub fn leadership(&self, id: &ShardId) -> Option<Leadership> {
        let (node, term) = self.groups.leadership(self.range_of(id))?;
        Some(Leadership { node: NodeId::new(node), term })
    }

    /// `node`'s leadership of `range` as this node knows it now (term 0 if this
    /// node knows of no leadership of `node`).
    fn leadership_of(&self, range: RangeId, node: &NodeId) -> Leadership {
        let term = self.groups.leadership(range).filter(|(n, _)| n == node.as_str()).map_or(0, |(_, t)| t);
        Leadership { node: node.clone(), term }
    }

    /// Whether this node runs a replica of `range` that both its group and the
    /// directory count: its group's view of the leader is then current. A
    /// replica of a range this node left is not (its group may never learn that
    /// it was removed, and waits for a leader that never talks to it again).
    fn runs(&self, range: RangeId) -> bool {
        self.groups.is_replica(range) && self.directory().replicas(range).contains(&self.me)
    }

    /// The node that should serve `id` now: the range's leader (on a node that
    /// replicates the range, as its group knows it; elsewhere the replica that
    /// served the range last), or while none is known its preferred leader.
    pub fn owner(&self, id: &ShardId) -> NodeId {
        let range = self.range_of(id);
        let runs = self.runs(range);
        let known = if self.groups.leads(range) {
            // A leader the directory moved out of the range serves it until its
            // group replaces it.
            Some(self.me.clone())
        } else if runs {
            self.groups.leader_node(range).map(NodeId::new)
        } else {
            self.hints.lock().get(&range).cloned()
        };
        known.unwrap_or_else(|| {
            // No leader known: the preferred one — unless that is this node and its
            // replica is not in the group yet (a range the directory just gave it),
            // when another replica knows better.
            let directory = self.directory();
            match directory.preferred_leader(range) {
                Some(p) if *p != self.me || runs => p.clone(),
                _ => directory.replicas(range).iter().find(|n| **n != self.me).unwrap_or(&self.me).clone(),
            }
        })
    }

    /// Waits until `id`'s range has a leader, at most [`LEADER_WAIT_MS`].
    pub async fn next_leader(&self, id: &ShardId) -> Option<Leadership> {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(LEADER_WAIT_MS);
        self.leader_where(id, deadline, |_| true).await
    }

    /// Waits until `id`'s range has a leadership that `accept` takes; `None` once
    /// `deadline` passed.
    async fn leader_where(
        &self,
        id: &ShardId,
        deadline: tokio::time::Instant,
        mut accept: impl FnMut(&Leadership) -> bool,
    ) -> Option<Leadership> {
        loop {
            if let Some(l) = self.leadership(id).filter(|l| accept(l)) {
                return Some(l);
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::debug!(shard = %id, range = %self.range_of(id), "no acceptable leader in time");
                return None;
            }
            tokio::time::sleep(Duration::from_millis(LEADER_POLL_MS)).await;
        }
    }

    /// Confirms that this node leads `id`'s range and has applied everything
    /// committed (a read index): only then may it start the shard's actor or
    /// answer its state. While the range has no leader, waits for one.
    pub async fn confirm(&self, id: &ShardId) -> Result<(), TallyError> {
        let range = self.range_of(id);
        #[cfg(feature = "planted-bugs")]
        if tally_core::planted::active(tally_core::planted::Bug::TwoLeadersAck) && self.groups.leads(range) {
            // Planted: a node that believes it leads serves without asking a quorum.
            return Ok(());
        }
        // A counter created a moment ago may be of a class this node has not applied
        // yet: its record is waited for, as a leader is below.
        let deadline = tokio::time::Instant::now() + Duration::from_millis(LEADER_WAIT_MS);
        while !self.assigns(range.class()) {
            if tokio::time::Instant::now() >= deadline {
                return Err(unavailable(
                    id,
                    format!("the replica class of its range {range} is not known here"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(LEADER_POLL_MS)).await;
            self.follow_classes();
        }
        // A node the directory moved out of the range serves it only while it still
        // leads: once it stepped down it may never hear of the next leader.
        if !self.groups.leads(range) && !self.directory().replicas(range).contains(&self.me) {
            return Err(unavailable(id, format!("this node no longer replicates its range {range}")));
        }
        let leader = self.next_leader(id).await.map(|l| l.node);
        match leader {
            Some(l) if l == self.me => {}
            Some(l) => return Err(unavailable(id, format!("{l} leads its replica group {range}"))),
            None => return Err(unavailable(id, format!("its replica group {range} has no leader"))),
        }
        self.groups.confirm(range).await.map_err(|e| unavailable(id, e.to_string()))
    }

    /// Sends `request` for a replicated shard to `node` with `send`; if its leader
    /// did not serve it, and sending it again cannot count anything twice, sends it
    /// to the range's next leadership once there is one — another node, or the same
    /// node elected again (or serves it on `local`, this node's engine, if that is
    /// this node).
    pub async fn call<'a, F, Fut>(
        &'a self,
        node: &'a NodeId,
        request: ShardRequest,
        local: Option<&'a Tally>,
        send: F,
    ) -> Result<ShardResponse, TallyError>
    where
        F: Fn(NodeId, ShardRequest) -> Fut,
        Fut: Future<Output = Result<ShardResponse, TallyError>>,
    {
        let not_served = |r: &Result<ShardResponse, TallyError>| match r {
            Err(_) => true,
            Ok(ShardResponse::Failed { code, .. }) => code == "shard_unavailable",
            Ok(_) => false,
        };
        // A question for the node itself goes straight to it.
        let Some(id) = request.shard().cloned() else { return send(node.clone(), request).await };
        let range = self.range_of(&id);
        let sent_to = self.leadership_of(range, node);
        let mut first = send(node.clone(), request.clone()).await;
        if !not_served(&first) || !repeatable(&request) {
            if !not_served(&first) && !self.runs(range) {
                self.hints.lock().insert(range, node.clone());
            }
            return first;
        }
        if !self.runs(range) {
            // This node does not know the range's leader: its other replicas are
            // asked in turn, each node at most once, and first any node an answer
            // names as the owner (a leader the directory moved out of the range
            // serves it until its group replaces it, and only its group knows
            // it). The one that serves is remembered.
            let directory = self.directory();
            let mut asked = vec![node.clone()];
            let mut next: VecDeque<NodeId> =
                directory.replicas(range).iter().filter(|r| *r != node && **r != self.me).cloned().collect();
            let mut last = first;
            loop {
                if let Ok(ShardResponse::Failed { owner: Some(owner), .. }) = &last {
                    if *owner != self.me && !asked.contains(owner) {
                        next.retain(|n| n != owner);
                        next.push_front(owner.clone());
                    }
                }
                let Some(to) = next.pop_front() else { break };
                asked.push(to.clone());
                last = send(to.clone(), request.clone()).await;
                if !not_served(&last) {
                    self.hints.lock().insert(range, to);
                    return last;
                }
            }
            // No other node serves it. A node the directory gives the range whose
            // group is not open here yet (a replica class it learnt a moment ago,
            // when the others may already name it the leader) waits for the
            // group's leader below, as a replica does; any other node answers
            // what it heard.
            if !self.directory().replicas(range).contains(&self.me) {
                return last;
            }
            first = last;
        }
        // The leader did not serve it: it lost the request or its answer, or it no
        // longer leads. A new leadership is asked as soon as this node knows it (even
        // while the request is out to the last one); the same one at once, then
        // every `SAME_LEADER_RESEND_MS`, until the wait is over.
        let deadline = tokio::time::Instant::now() + Duration::from_millis(LEADER_WAIT_MS);
        let (mut last, mut failed, mut same_due) = (first, sent_to, tokio::time::Instant::now());
        let mut leaderships = 1;
        loop {
            let accept = |l: &Leadership| l.succeeds(&failed) || tokio::time::Instant::now() >= same_due;
            let Some(next) = self.leader_where(&id, deadline, accept).await else { break };
            if next.succeeds(&failed) {
                if leaderships >= CALL_LEADERSHIPS_MAX {
                    break;
                }
                leaderships += 1;
            }
            if next.node == self.me {
                return match local {
                    Some(engine) => match engine.serve_shard_request(request).await {
                        ShardResponse::Failed { code, message, .. } if code == "shard_unavailable" => {
                            Err(TallyError::Unavailable { shard: id.to_string(), reason: message })
                        }
                        other => Ok(other),
                    },
                    None => last,
                };
            }
            // A leadership that succeeds this one while the request is out takes it
            // at once: a frozen leader would otherwise hold it for a call timeout.
            let superseded = self.leader_where(&id, deadline, |l| l.succeeds(&next));
            tokio::select! {
                biased;
                answer = send(next.node.clone(), request.clone()) => {
                    last = answer;
                    if !not_served(&last) {
                        return last;
                    }
                    same_due = tokio::time::Instant::now() + Duration::from_millis(SAME_LEADER_RESEND_MS);
                }
                Some(newer) = superseded => {
                    last = Err(unavailable(&id, format!("{} leads its replica group {range} now", newer.node)));
                }
            }
            failed = next;
        }
        last
    }

    /// Whether every group of a range the directory gives this node knows a
    /// leader (once true at start, the node's shards can be served). A group it
    /// left is not waited for.
    pub fn every_group_has_a_leader(&self) -> bool {
        let directory = self.directory();
        let mut counted =
            self.groups.ranges().into_iter().filter(|r| directory.replicas(*r).contains(&self.me));
        counted.all(|r| self.groups.leader(r).is_ok_and(|l| l.is_some()))
    }

    /// Answers a peer's question whether this node's group of `range` is formed.
    pub fn formed(&self, range: RangeId) -> bool {
        self.groups.formed(range)
    }

    /// Answers a peer's question whether this node, as `range`'s leader, lists
    /// `replica` in its group: `Some(false)` once it applied a uniform membership
    /// without it ([`RangeGroups::lists`]).
    pub fn lists(&self, range: RangeId, replica: ReplicaId) -> Option<bool> {
        self.groups.lists(range, replica)
    }

    /// Answers a leaving leader's request ([`Peers::campaign`]): once the lease of
    /// `departed` has run out (until then the voters refuse every candidate), this
    /// replica stands for election in `range`, unless a leader other than the one
    /// leaving is known by then. It saves the remaining voters' random election
    /// timeout on a hand-over; openraft 0.9 has no leadership transfer.
    pub fn campaign(self: &Arc<Self>, range: RangeId, departed: ReplicaId) {
        let me = self.clone();
        let config = self.groups.config();
        let after = Duration::from_millis(config.election_timeout_max_ms + config.heartbeat_ms);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let leaderless = me.groups.leader(range).is_ok_and(|l| l.is_none() || l == Some(departed));
            if leaderless && me.groups.is_replica(range) {
                match me.groups.elect(range).await {
                    Ok(()) => {
                        tracing::info!(%range, "standing for election: the range's leader handed it over")
                    }
                    Err(e) => tracing::warn!(%range, error = %e, "cannot stand for election"),
                }
            }
        });
    }

    /// As this node leaves `range`, which it led: counts the hand-over, and asks
    /// `successor` (the voter that holds the most of the log) to stand for
    /// election once its lease ran out.
    fn hand_over(&self, range: RangeId, successor: Option<(ReplicaId, ReplicaNode)>) {
        self.hand_overs.fetch_add(1, Ordering::Relaxed);
        *self.last_hand_over.lock() = Some(tokio::time::Instant::now());
        let Some((_, node)) = successor else { return };
        let (peers, departed) = (self.peers.clone(), self.groups.replica_id());
        tokio::spawn(async move { peers.campaign(&NodeId::new(&node.node), range, departed).await });
    }

    /// Closes this node's group of `range` once the range's leader says the group
    /// no longer lists this replica: a follower is never told of its removal
    /// (openraft stops replicating to it at once), so without asking it would keep
    /// its group open and campaigning in vain. Asks the directory's replicas of the
    /// range (its leader is one of them once the voters moved); answers whether it
    /// closed the group. The copy stays in the store, vote and log included: the
    /// answer may be outdated by the time it arrives (the range moved back, and its
    /// leader added this replica again), and a voter that dropped its log could
    /// elect a leader that lacks committed entries. A closed group costs nothing;
    /// it opens again when the directory gives this node the range, or at start.
    async fn retire(&self, range: RangeId) -> Result<bool, ReplicaError> {
        let me = self.groups.replica_id();
        let directory = self.directory();
        let mut removed = false;
        for node in directory.replicas(range).iter().filter(|n| **n != self.me) {
            if self.peers.lists(node, range, me).await == Some(false) {
                removed = true;
                break;
            }
        }
        // The directory may have given the range back meanwhile.
        if !removed || self.directory().replicas(range).contains(&self.me) {
            return Ok(false);
        }
        self.groups.close_range(range).await?;
        self.retired.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// The replica id each node of `range` in `directory` runs now; `None` while
    /// one is not known.
    fn current_replicas(
        &self,
        directory: &Directory,
        range: RangeId,
    ) -> Option<BTreeMap<ReplicaId, ReplicaNode>> {
        let mut out = BTreeMap::new();
        for node in directory.replicas(range) {
            let id = self.peers.replica_of(node)?;
            out.insert(id, ReplicaNode { node: node.as_str().to_owned() });
        }
        Some(out)
    }

    /// Forms `range`'s group if nobody formed it yet. The voters a group starts with
    /// are recorded by the metadata group ([`Peers::form_range`]: the first proposal
    /// stays), and every node among them forms it with that record (in the cluster's
    /// class, only while none of the others that are still members holds anything of
    /// it), so the group forms even if its proposer dies, and no two nodes ever start
    /// it with different voters (starting one group twice with the same voters is
    /// safe in raft).
    ///
    /// Without a record, one node proposes:
    /// * for the cluster's class, the first replica of the initial directory that the
    ///   current one keeps in the range (the preferred leader first), proposing the
    ///   initial replicas; if the current directory keeps none of them (they all left
    ///   before the group was ever formed), its preferred leader, proposing the
    ///   current replicas. It first asks every replica, of both directories, that is
    ///   still a member whether its group holds anything: a group formed by a
    ///   release that kept no record (or a node that left a range, answering from
    ///   its stored vote) is never formed again;
    /// * for a class of counters' own counts, whose groups are only ever formed from
    ///   a record, the range's preferred leader, proposing the current replicas.
    async fn form(&self, range: RangeId) -> Result<(), ReplicaError> {
        if self.groups.formed(range) {
            return Ok(());
        }
        let first = match self.peers.formation(range) {
            Some(first) => first,
            None => match self.propose(range).await {
                Some(first) => first,
                None => return Ok(()),
            },
        };
        if !first.iter().any(|(id, _)| *id == self.groups.replica_id()) {
            // Not a first voter (or a later incarnation of one): the range's leader
            // adds this replica.
            return Ok(());
        }
        // A first voter of the cluster's class forms the group only while every
        // other one that is still a member holds nothing of it either: a group of
        // that class may have been formed by a release that kept no record, and
        // once a group runs, a voter that lost its copy (its replica id is its
        // store's, so only a broken store could keep the id) waits to be caught up
        // rather than start again. A class of counters' own counts was never formed
        // without its record, and its first voters form it at once.
        if range.class() == tally_core::ids::CLUSTER_REPLICAS {
            let others: Vec<NodeId> = first
                .iter()
                .filter(|(id, _)| *id != self.groups.replica_id())
                .map(|(_, node)| NodeId::new(&node.node))
                .collect();
            if !self.none_formed(range, others.iter()).await {
                return Ok(());
            }
        }
        self.groups.initialize(range, &first).await?;
        tracing::info!(%range, replicas = first.len(), "formed a range group");
        Ok(())
    }

    /// Whether each of `nodes` (other than this one) that is still a member answers
    /// that its group of `range` holds nothing. One that holds something, or does
    /// not answer, is a no: formed elsewhere, this node waits to be added;
    /// unanswered, it asks again on the next pass.
    async fn none_formed(&self, range: RangeId, nodes: impl Iterator<Item = &NodeId>) -> bool {
        let current = self.directory();
        for node in nodes.filter(|n| **n != self.me && current.members().contains(n)) {
            if self.peers.formed(node, range).await != Some(false) {
                return false;
            }
        }
        true
    }

    /// Proposes `range`'s first voters if this node is the one to ([`Replication::form`]):
    /// the record that stays, or `None` when nothing is to be formed from here yet.
    async fn propose(&self, range: RangeId) -> Option<Vec<(ReplicaId, ReplicaNode)>> {
        let current = self.directory();
        let proposal = if range.class() == tally_core::ids::CLUSTER_REPLICAS {
            let initial = self.initial.read().clone();
            let kept = initial.replicas(range).iter().find(|n| current.replicas(range).contains(n));
            let (proposer, from) = match kept {
                Some(kept) => (Some(kept), &initial),
                None => (current.preferred_leader(range), &*current),
            };
            if proposer != Some(&self.me) {
                return None;
            }
            let voters = self.current_replicas(from, range)?;
            let asked: std::collections::BTreeSet<&NodeId> =
                initial.replicas(range).iter().chain(current.replicas(range)).collect();
            if !self.none_formed(range, asked.into_iter()).await {
                return None;
            }
            voters
        } else {
            if current.preferred_leader(range) != Some(&self.me) {
                return None;
            }
            self.current_replicas(&current, range)?
        };
        self.peers.form_range(range, proposal.into_iter().collect()).await
    }

    /// On the leader of `range`: makes the group's voters the directory's
    /// replicas, each as the replica its node runs now. A replica the group lacks
    /// (a node the directory gave the range, or one back with an empty disk, whose
    /// store is a new replica) is added as a learner; once every such learner
    /// holds everything the leader applied, one joint change makes the wanted
    /// replicas the voters and removes the others (a node that left the range, an
    /// incarnation that was replaced). Until then the voters stay as they are.
    async fn reconfigure(&self, range: RangeId) -> Result<(), ReplicaError> {
        if !self.groups.leads(range) {
            return Ok(());
        }
        let directory = self.directory();
        let Some(wanted) = self.current_replicas(&directory, range) else { return Ok(()) };
        let members = self.groups.members(range)?;
        if members.joint {
            // A change left half way (its proposer stopped waiting for it, or lost
            // its leadership) is finished as it was proposed, and the next pass
            // moves on to the directory's replicas. A change from a joint
            // configuration to other voters would pair its second half with them,
            // and one that left this leader out of both halves is a change openraft
            // takes from no one (its leader must be a member of the configuration
            // it changes).
            let target = members.target.clone();
            return self.make_voters(range, target, &members).await;
        }
        let mut learners_added = false;
        for (id, node) in &wanted {
            if !members.voters.contains(id) && !members.learners.contains(id) {
                tracing::info!(%range, replica = id, node = %node.node, "adding a replica as a learner");
                self.groups.add_learner(range, *id, node.clone()).await?;
                learners_added = true;
            }
        }
        let voters: std::collections::BTreeSet<ReplicaId> = wanted.keys().copied().collect();
        if learners_added {
            return Ok(());
        }
        if voters == members.voters && !members.joint {
            // A learner the directory no longer wants (it changed again before the
            // learner was promoted) is dropped.
            let stray: std::collections::BTreeSet<ReplicaId> =
                members.learners.iter().filter(|id| !wanted.contains_key(id)).copied().collect();
            if !stray.is_empty() {
                tracing::info!(%range, learners = ?stray, "removing learners the directory no longer wants");
                self.groups.remove_learners(range, stray).await?;
            }
            return Ok(());
        }
        self.make_voters(range, voters, &members).await
    }

    /// On the leader of `range`: makes `voters` the group's voters by joint
    /// consensus once those that are not voters yet caught up, and hands the
    /// range over if this node is not among them.
    async fn make_voters(
        &self,
        range: RangeId,
        voters: std::collections::BTreeSet<ReplicaId>,
        members: &GroupMembers,
    ) -> Result<(), ReplicaError> {
        for id in voters.difference(&members.voters) {
            self.groups.wait_caught_up(range, *id, Duration::from_millis(CATCH_UP_WAIT_MS)).await?;
        }
        let held = self.groups.replica_nodes(range)?;
        let name =
            |id: &ReplicaId| held.get(id).map_or_else(|| id.to_string(), |n| format!("{}@{id}", n.node));
        tracing::info!(
            %range,
            voters = ?voters.iter().map(name).collect::<Vec<_>>(),
            removed = ?members.voters.difference(&voters).map(name).collect::<Vec<_>>(),
            "making the caught-up replicas the voters"
        );
        let leaving = !voters.contains(&self.groups.replica_id());
        // Chosen before the change, while this node leads and knows every replica's
        // progress.
        let successor = if leaving { self.groups.successor(range, &voters) } else { None };
        self.groups.set_voters(range, voters.clone()).await?;
        if leaving {
            // The membership without this node is committed: openraft 0.9 steps the
            // leader down at once, and the range has no leader until the remaining
            // voters elect one. The hand-over starts now, not when a later pass
            // closes the group.
            self.handed_over.lock().insert(range);
            self.hand_over(range, successor);
        }
        Ok(())
    }

    /// One pass over this node's ranges: opens the groups of ranges the directory
    /// gave this node, forms what needs forming, and on each range it leads makes
    /// the voters the directory's replicas. Failures are retried on the next pass.
    pub async fn tend(&self) {
        self.follow_classes();
        let directory = self.directory();
        // A replica its group removed steps aside: a leader that removed itself
        // still leads (openraft keeps a leader outside its membership leading), and
        // its followers elect one of the voters only once it stops.
        for range in self.groups.ranges() {
            let wanted = directory.replicas(range).contains(&self.me);
            // Closed once the removal is applied here (it is committed), or, for a
            // leader, on the next pass if it never is (a deposed leader no one talks
            // to any more). A follower that saw a removal not yet committed keeps its
            // group: a new leader may still count on its vote. A leader outside its
            // membership that the directory wants back steps aside too: it cannot
            // add itself, and its followers elect only once it stops; the next
            // leader adds it again.
            let leads = self.groups.leads(range);
            let removed = self.groups.removed(range);
            let close = match removed {
                Some(_) if wanted => leads,
                Some(true) => true,
                Some(false) => leads && !self.leaving.lock().insert(range),
                None => false,
            };
            if removed.is_none() {
                self.leaving.lock().remove(&range);
            }
            if close {
                self.leaving.lock().remove(&range);
                let handed = self.handed_over.lock().remove(&range);
                if leads && !handed {
                    let voters = self.groups.members(range).map(|m| m.voters).unwrap_or_default();
                    self.hand_over(range, self.groups.successor(range, &voters));
                }
                if wanted {
                    // Reopened only once the voters had time to elect another
                    // leader: reopened at once, it would resume as the leader its
                    // store says it is.
                    let until = tokio::time::Instant::now() + Duration::from_millis(STEP_ASIDE_MS);
                    self.aside.lock().insert(range, until);
                }
                match self.groups.close_range(range).await {
                    Ok(()) => {
                        self.retired.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(%range, "closed the group of a range this node left");
                    }
                    Err(e) => tracing::warn!(%range, error = %e, "cannot close a range group"),
                }
            }
        }
        // Groups of ranges the directory moved elsewhere that do not know this
        // replica was removed (a follower is never told).
        let stale: Vec<RangeId> = self
            .groups
            .ranges()
            .into_iter()
            .filter(|r| !directory.replicas(*r).contains(&self.me))
            .filter(|r| !self.groups.leads(*r) && self.groups.removed(*r).is_none())
            .collect();
        let retiring = stale.into_iter().map(|range| async move {
            let retire = tokio::time::timeout(Duration::from_millis(TEND_PASS_MAX_MS), self.retire(range));
            match retire.await {
                Ok(Ok(true)) => {
                    tracing::info!(%range, "closed the group of a range whose leader removed this node")
                }
                Ok(Ok(false)) | Err(_) => {}
                Ok(Err(e)) => tracing::warn!(%range, error = %e, "cannot close a range group"),
            }
        });
        futures::future::join_all(retiring).await;
        let open = self.groups.ranges();
        let now = tokio::time::Instant::now();
        self.aside.lock().retain(|_, until| *until > now);
        let aside: Vec<RangeId> = self.aside.lock().keys().copied().collect();
        let closed =
            directory.ranges_of(&self.me).into_iter().filter(|r| !open.contains(r) && !aside.contains(r));
        for range in closed {
            match self.groups.open_range(range).await {
                Ok(()) => tracing::info!(%range, "opened a range the directory gives this node"),
                Err(e) => tracing::warn!(%range, error = %e, "cannot open a range group yet"),
            }
        }
        for range in self.unformed_first_voter_ranges(&directory) {
            match self.groups.open_range(range).await {
                Ok(()) => tracing::info!(%range, "opened a range whose first voters count on this node"),
                Err(e) => tracing::warn!(%range, error = %e, "cannot open a range group yet"),
            }
        }
        // Ranges are tended side by side: one whose peer is slow to answer holds up
        // no other, and none holds up the next pass for longer than
        // `TEND_PASS_MAX_MS` (a membership change whose commit waits for a quorum
        // goes on inside its group; the next pass finds it done, or joint).
        let passes = self.groups.ranges().into_iter().map(|range| async move {
            let pass = async {
                if let Err(e) = self.form(range).await {
                    tracing::warn!(%range, error = %e, "cannot form a range group yet");
                }
                match self.reconfigure(range).await {
                    Ok(()) | Err(ReplicaError::NotCaughtUp { .. }) | Err(ReplicaError::NotLeader { .. }) => {}
                    Err(e) => tracing::warn!(%range, error = %e, "cannot change a range's voters yet"),
                }
            };
            if tokio::time::timeout(Duration::from_millis(TEND_PASS_MAX_MS), pass).await.is_err() {
                tracing::info!(%range, "a range's tending pass timed out; it goes on next pass");
            }
        });
        futures::future::join_all(passes).await;
    }

    /// Ranges the directory no longer gives this node whose recorded first voters
    /// list its replica, and whose store holds nothing of them. Such a replica still
    /// forms its group (the next passes run [`Replication::form`] on it): the
    /// other first voters may count on its vote. One that voted in a first
    /// campaign whose candidate then lost its disk holds a vote and no log, and
    /// with the candidate gone the group has no quorum, and so no leader to move
    /// the range to the directory's replicas, until this one takes part. The
    /// leader it helps elect removes it, and it retires. A replica that took part
    /// once is never opened again this way: its group counts on its store, which
    /// [`RangeGroups::open_stored`] opens at start.
    fn unformed_first_voter_ranges(&self, directory: &Directory) -> Vec<RangeId> {
        let me = self.groups.replica_id();
        tally_core::ranges::replica_classes()
            .flat_map(|class| self.layout.ranges_in(class))
            .filter(|range| !directory.replicas(*range).contains(&self.me))
            .filter(|range| {
                self.peers.formation(*range).is_some_and(|first| first.iter().any(|(id, _)| *id == me))
            })
            .filter(|range| self.groups.holds_nothing(*range))
            .collect()
    }

    /// Tends the groups every [`TEND_EVERY_MS`], and counts the leader changes of
    /// every group this node runs, until the task is dropped.
    pub async fn run(self: Arc<Self>) {
        let mut watching = futures::stream::FuturesUnordered::new();
        loop {
            self.tend().await;
            for range in self.groups.ranges() {
                if self.watched.lock().insert(range) {
                    watching.push(self.watch_leader(range));
                }
            }
            let pause = tokio::time::sleep(Duration::from_millis(TEND_EVERY_MS));
            tokio::pin!(pause);
            loop {
                tokio::select! {
                    _ = &mut pause => break,
                    Some(()) = futures::StreamExt::next(&mut watching) => {}
                }
            }
        }
    }

    /// Counts, in [`Replication::failovers`], every change of leader of `range`'s
    /// group, as its metrics report it; ends when the group stops.
    async fn watch_leader(&self, range: RangeId) {
        let Ok(mut watch) = self.groups.watch(range) else {
            self.watched.lock().remove(&range);
            return;
        };
        let mut last = watch.borrow().current_leader;
        while watch.changed().await.is_ok() {
            let now = watch.borrow().current_leader;
            if is_failover(last, now) {
                self.failovers.fetch_add(1, Ordering::Relaxed);
            }
            last = now.or(last);
        }
        // The group stopped (closed, or the node shuts down): watched again if it
        // opens again.
        self.watched.lock().remove(&range);
    }

    /// Leader changes this node observed in the groups it runs since it started
    /// (a first election is none).
    pub fn failovers(&self) -> u64 {
        self.failovers.load(Ordering::Relaxed)
    }

    /// Ranges this node led and left since it started (the directory moved the
    /// range elsewhere, or the group removed this replica), counted when the change
    /// that removed it committed, or when it closed a group it still led. Each is
    /// a hand-over by election: openraft 0.9 has no leadership transfer,
    /// and the remaining voters refuse to elect anyone while the lease of the
    /// leader they heard last runs, so the range is without a leader for up to a
    /// failover ([`crate::groups::FAILOVER_BOUND_MS`]).
    pub fn hand_overs(&self) -> u64 {
        self.hand_overs.load(Ordering::Relaxed)
    }

    /// Range groups this node closed since it started because the group no longer
    /// listed this replica, as the group said here or as its leader answered a
    /// follower that was never told (the directory had moved the range elsewhere;
    /// or, for a leader the directory wants back, it steps aside).
    pub fn groups_retired(&self) -> u64 {
        self.retired.load(Ordering::Relaxed)
    }

    /// When this node last left a range it led ([`Replication::hand_overs`]).
    pub fn last_hand_over(&self) -> Option<tokio::time::Instant> {
        *self.last_hand_over.lock()
    }

    /// `range`'s group as this node knows it: the group's membership, leader and
    /// term where this node runs a replica (with every replica's progress where it
    /// leads); elsewhere the directory's replicas and the replica that served the
    /// range last.
    pub fn range_report(&self, range: RangeId) -> RangeReport {
        let directory: Vec<String> =
            self.directory().replicas(range).iter().map(|n| n.as_str().to_owned()).collect();
        let Ok(status) = self.groups.status(range) else {
            return RangeReport {
                range: range.index(),
                counter_replicas: Some(range.class()).filter(|c| *c != tally_core::ids::CLUSTER_REPLICAS),
                replicated_here: false,
                replicas: directory
                    .into_iter()
                    .map(|node| ReplicaReport {
                        node,
                        replica: None,
                        role: ReplicaRole::Directory,
                        current: None,
                        matched: None,
                    })
                    .collect(),
                leader: self.hints.lock().get(&range).map(|n| n.as_str().to_owned()),
                term: None,
                joint: false,
                applied: None,
                leader_last_log: None,
                excluded: Vec::new(),
                stopped: None,
            };
        };
        let current = |replica: ReplicaId, node: &str| {
            self.peers.replica_of(&NodeId::new(node)).map(|now| now == replica)
        };
        let matched =
            |replica: ReplicaId| status.matched.as_ref().and_then(|m| m.get(&replica).copied().flatten());
        let roles = status
            .voters
            .iter()
            .map(|(id, node)| (id, node, ReplicaRole::Voter))
            .chain(status.learners.iter().map(|(id, node)| (id, node, ReplicaRole::Learner)));
        let mut replicas: Vec<ReplicaReport> = roles
            .map(|(id, node, role)| ReplicaReport {
                node: node.clone(),
                replica: Some(id.to_string()),
                role,
                current: current(*id, node),
                matched: matched(*id),
            })
            .collect();
        // Voters first, each role by node name.
        replicas.sort_by(|a, b| {
            (a.role != ReplicaRole::Voter, &a.node).cmp(&(b.role != ReplicaRole::Voter, &b.node))
        });
        let excluded = excluded(&directory, &replicas);
        let leads = status.matched.is_some();
        RangeReport {
            range: range.index(),
            counter_replicas: Some(range.class()).filter(|c| *c != tally_core::ids::CLUSTER_REPLICAS),
            replicated_here: true,
            replicas,
            leader: status.leader_node,
            term: Some(status.term),
            joint: status.joint,
            applied: status.last_applied,
            leader_last_log: if leads { status.last_log_index } else { None },
            excluded,
            stopped: status.stopped,
        }
    }

    /// Every range of the directory, as [`Replication::range_report`] tells it.
    pub fn range_reports(&self) -> Vec<RangeReport> {
        self.directory().all_ranges().map(|r| self.range_report(r)).collect()
    }

    /// This node's replication figures, for its metrics.
    pub fn figures(&self) -> ReplicationFigures {
        let mut f = ReplicationFigures {
            failovers: self.failovers(),
            hand_overs: self.hand_overs(),
            groups_retired: self.groups_retired(),
            ..Default::default()
        };
        for range in self.groups.ranges() {
            let Ok(status) = self.groups.status(range) else { continue };
            f.ranges_replicated += 1;
            if status.stopped.is_some() {
                f.ranges_stopped += 1;
            }
            if status.leader.is_none() {
                f.ranges_without_leader += 1;
            }
            f.snapshot_bytes_installed += self.groups.snapshot_bytes_installed(range).unwrap_or(0);
            f.snapshots_installed += self.groups.snapshots_installed(range).unwrap_or(0);
            f.log_bytes_caught_up += self.groups.log_bytes_caught_up(range).unwrap_or(0);
            if status.leader == Some(status.replica) {
                f.ranges_led += 1;
                f.lag_entries_max = f.lag_entries_max.max(voter_lag(&status));
            }
        }
        f
    }
}

/// A node's replication figures ([`Replication::figures`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicationFigures {
    /// Ranges this node runs a replica of.
    pub ranges_replicated: u64,
    /// Of those, the ranges this node leads.
    pub ranges_led: u64,
    /// Of those it runs, the ranges whose group knows no leader here.
    pub ranges_without_leader: u64,
    /// Of those it runs, the ranges whose group here stopped on a fatal error
    /// (a failed write to its store): restart the node.
    pub ranges_stopped: u64,
    /// Over the ranges it leads: the largest gap, in log entries, between its
    /// last log index and a voter's matched index.
    pub lag_entries_max: u64,
    /// Leader changes observed ([`Replication::failovers`]).
    pub failovers: u64,
    /// Ranges led and left ([`Replication::hand_overs`]).
    pub hand_overs: u64,
    /// Groups closed once they no longer listed this replica ([`Replication::groups_retired`]).
    pub groups_retired: u64,
    /// Snapshots its replicas installed (catch-up by snapshot).
    pub snapshots_installed: u64,
    /// Encoded bytes of those snapshots.
    pub snapshot_bytes_installed: u64,
    /// Encoded bytes of the log entries its replicas received as learners
    /// (catch-up through the log).
    pub log_bytes_caught_up: u64,
}

/// Whether a group's leader changing from `last` (the last one known) to `now`
/// is a failover: a leader other than the one known before. A first election,
/// or a spell without a leader that ends with the same one, is not.
pub fn is_failover(last: Option<ReplicaId>, now: Option<ReplicaId>) -> bool {
    matches!((last, now), (Some(a), Some(b)) if a != b)
}

/// On a leader: the largest gap between its last log index and a voter's matched
/// index (a voter known to hold nothing is behind by the whole log).
pub fn voter_lag(status: &crate::groups::GroupStatus) -> u64 {
    let (Some(matched), Some(last)) = (status.matched.as_ref(), status.last_log_index) else { return 0 };
    status
        .voters
        .keys()
        .filter(|id| **id != status.replica)
        .map(|id| {
            matched.get(id).copied().flatten().map_or(last.saturating_add(1), |m| last.saturating_sub(m))
        })
        .max()
        .unwrap_or(0)
}

/// The directory's nodes holding no replica among `replicas`.
fn excluded(directory: &[String], replicas: &[ReplicaReport]) -> Vec<String> {
    directory.iter().filter(|n| !replicas.iter().any(|r| &r.node == *n)).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::groups::GroupStatus;

    #[test]
    fn the_same_node_elected_again_is_a_new_leadership() {
        let at = |node: &str, term| Leadership { node: NodeId::new(node), term };
        let failed = at("node2", 1);
        assert!(at("node3", 1).succeeds(&failed), "another node");
        assert!(at("node2", 4).succeeds(&failed), "the same node, elected again");
        assert!(!at("node2", 1).succeeds(&failed), "the leadership that failed");
        // A term this node did not know when it sent (0) is older than any known.
        assert!(at("node2", 1).succeeds(&at("node2", 0)));
    }

    #[test]
    fn only_a_different_leader_is_a_failover() {
        assert!(!is_failover(None, Some(1)), "a first election");
        assert!(!is_failover(Some(1), Some(1)));
        assert!(!is_failover(Some(1), None), "no leader yet: nothing changed hands");
        assert!(is_failover(Some(1), Some(2)));
    }

    fn leader_status(last: Option<u64>, matched: &[(ReplicaId, Option<u64>)]) -> GroupStatus {
        GroupStatus {
            replica: 1,
            leader: Some(1),
            voters: [(1, "a".to_owned()), (2, "b".to_owned()), (3, "c".to_owned())].into(),
            last_log_index: last,
            matched: Some(matched.iter().copied().collect()),
            ..Default::default()
        }
    }

    #[test]
    fn voter_lag_is_the_furthest_voter_behind_the_leaders_log() {
        let s = leader_status(Some(40), &[(1, Some(40)), (2, Some(38)), (3, Some(31))]);
        assert_eq!(voter_lag(&s), 9);
        let s = leader_status(Some(40), &[(1, Some(40)), (2, Some(40)), (3, Some(40))]);
        assert_eq!(voter_lag(&s), 0);
        // A voter known to hold nothing lacks the whole log (index 0 included).
        let s = leader_status(Some(40), &[(1, Some(40)), (2, Some(40)), (3, None)]);
        assert_eq!(voter_lag(&s), 41);
        // Learners do not count.
        let mut s = leader_status(Some(40), &[(1, Some(40)), (2, Some(40)), (3, Some(40)), (4, Some(2))]);
        s.learners.insert(4, "d".into());
        assert_eq!(voter_lag(&s), 0);
        // Not a leader: no progress known, no lag.
        let s = GroupStatus { matched: None, last_log_index: Some(40), ..leader_status(None, &[]) };
        assert_eq!(voter_lag(&s), 0);
    }

    /// Peers for one node's tests: without a formation record they never answer
    /// (enough for a node that only routes); with one, of one range, they answer
    /// from it, the other first voters hold nothing of it, and no node leads it.
    #[derive(Default)]
    struct TestPeers {
        record: Option<(RangeId, Vec<(ReplicaId, ReplicaNode)>)>,
    }

    impl Peers for TestPeers {
        fn replica_of(&self, node: &NodeId) -> Option<ReplicaId> {
            let (_, first) = self.record.as_ref()?;
            first.iter().find(|(_, n)| n.node == node.as_str()).map(|(id, _)| *id)
        }
        fn formed<'a>(&'a self, _: &'a NodeId, _: RangeId) -> BoxFuture<'a, Option<bool>> {
            let answer = self.record.as_ref().map(|_| false);
            Box::pin(async move { answer })
        }
        fn lists<'a>(&'a self, _: &'a NodeId, _: RangeId, _: ReplicaId) -> BoxFuture<'a, Option<bool>> {
            Box::pin(async { None })
        }
        fn campaign<'a>(&'a self, _: &'a NodeId, _: RangeId, _: ReplicaId) -> BoxFuture<'a, ()> {
            Box::pin(async {})
        }
        fn replica_classes(&self) -> BTreeMap<u8, Vec<NodeId>> {
            BTreeMap::new()
        }
        fn formation(&self, range: RangeId) -> Option<Vec<(ReplicaId, ReplicaNode)>> {
            self.record.as_ref().filter(|(r, _)| *r == range).map(|(_, first)| first.clone())
        }
        fn form_range(
            &self,
            _: RangeId,
            _: Vec<(ReplicaId, ReplicaNode)>,
        ) -> BoxFuture<'_, Option<Vec<(ReplicaId, ReplicaNode)>>> {
            Box::pin(async { None })
        }
    }

    /// A node's range groups on an in-memory store and router, alone.
    async fn one_node_groups(me: &NodeId, layout: tally_core::ranges::RangeLayout) -> Arc<RangeGroups> {
        RangeGroups::open(
            me.as_str(),
            1,
            Arc::new(crate::MemKv::new()),
            Arc::new(crate::MemRouter::new()),
            layout,
            crate::GroupsConfig::default(),
        )
        .await
        .unwrap()
    }

    /// A leader the directory moved out of its range serves it until its group
    /// replaces it, and only the group's replicas know it: a node that does not
    /// replicate the range asks the replicas, and then the leader they name.
    #[tokio::test]
    async fn a_node_outside_a_range_follows_the_owner_its_replicas_name() {
        let members: Vec<NodeId> = (1..=5).map(|i| NodeId::new(format!("node{i}"))).collect();
        let before = Directory::new(members.clone(), Some(3)).unwrap();
        // A range whose replicas lose a node to a membership change: it led the
        // range and leads it still, outside the directory's replicas.
        let range = before.layout().ranges().next().unwrap();
        let leader = before.replicas(range)[0].clone();
        let rest: Vec<NodeId> = members.iter().filter(|m| **m != leader).cloned().collect();
        let (after, _) = before.rebalance(rest, None).unwrap();
        let me =
            members.iter().find(|m| **m != leader && !after.replicas(range).contains(m)).unwrap().clone();
        let groups = one_node_groups(&me, before.layout()).await;
        let replication = Replication::new(me.clone(), groups, before, Arc::new(TestPeers::default()));
        assert!(replication.set_members(after.members().iter().cloned()).unwrap());
        assert!(!replication.runs(range));
        let id = (0..)
            .map(|i| ShardId::new(tally_core::CounterName::new(format!("c{i}")).unwrap(), 0, 0))
            .find(|id| replication.range_of(id) == range)
            .unwrap();
        let asked = parking_lot::Mutex::new(Vec::new());
        let first = replication.owner(&id);
        let answer = replication
            .call(&first, ShardRequest::Read { id: id.clone(), born_ms: 0 }, None, |to: NodeId, _| {
                asked.lock().push(to.clone());
                let answer = if to == leader {
                    ShardResponse::Done
                } else {
                    ShardResponse::Failed {
                        code: "shard_unavailable".into(),
                        message: format!("{leader} owns it now"),
                        owner: Some(leader.clone()),
                    }
                };
                async move { Ok(answer) }
            })
            .await;
        assert_eq!(answer.unwrap(), ShardResponse::Done, "asked {:?}", asked.lock());
        assert_eq!(asked.lock().as_slice(), [first, leader.clone()], "the named owner goes next");
        // The node that served is remembered: the range's requests go there first.
        assert_eq!(replication.owner(&id), leader);
    }

    /// A first voter of a range forms its group even after the directory moved
    /// the range elsewhere (here: the node left the ring), as long as its store
    /// holds nothing of it: the other first voters may need its vote. One of them
    /// voted in a first campaign whose candidate then lost its disk, and without
    /// this replica they are one short of a quorum forever, with no leader to move
    /// the range to the directory's replicas.
    #[tokio::test]
    async fn a_first_voter_the_directory_moved_away_still_forms_its_group() {
        let members: Vec<NodeId> = (1..=5).map(|i| NodeId::new(format!("node{i}"))).collect();
        let before = Directory::new(members.clone(), Some(3)).unwrap();
        let range = before.layout().ranges().next().unwrap();
        let me = before.replicas(range)[1].clone();
        let first: Vec<(ReplicaId, ReplicaNode)> = before
            .replicas(range)
            .iter()
            .zip([2, 1, 3])
            .map(|(node, id)| (id, ReplicaNode { node: node.as_str().to_owned() }))
            .collect();
        let groups = one_node_groups(&me, before.layout()).await;
        let replication = Replication::new(
            me.clone(),
            groups.clone(),
            before,
            Arc::new(TestPeers { record: Some((range, first)) }),
        );
        assert!(replication.set_members(members.iter().filter(|m| **m != me).cloned()).unwrap());
        assert!(!replication.directory().replicas(range).contains(&me));
        replication.tend().await;
        assert!(groups.ranges().contains(&range), "the group is open");
        assert!(groups.formed(range), "and holds the recorded first voters");
        let voters = groups.members(range).unwrap().voters;
        assert_eq!(voters, [1, 2, 3].into());
        // A range whose record does not list this replica is left alone.
        let other = replication.layout.ranges().nth(1).unwrap();
        assert!(!groups.ranges().contains(&other));
    }

    #[test]
    fn excluded_are_the_directory_nodes_without_a_replica() {
        let replica = |node: &str| ReplicaReport {
            node: node.into(),
            replica: Some("1".into()),
            role: ReplicaRole::Voter,
            current: Some(true),
            matched: None,
        };
        let directory = ["a".to_owned(), "b".to_owned(), "c".to_owned()];
        assert_eq!(excluded(&directory, &[replica("a"), replica("b")]), ["c"]);
        assert!(excluded(&directory, &[replica("a"), replica("b"), replica("c")]).is_empty());
    }
}
