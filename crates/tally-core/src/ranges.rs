//! The range directory of shard replication: which range of the ring a shard lies
//! in, and which nodes replicate each range.
//!
//! Every shard sits at a point of the ring's 64-bit circle ([`ring::shard_point`](crate::ring::shard_point)).
//! Replication cuts that circle into a bounded number of equal *ranges*; each range
//! is one consensus group replicated on `R` nodes, so the number of groups depends
//! on the cluster's size, never on how many counters or shards exist.
//!
//! # Layout
//!
//! The range count is a power of two, [`RANGES_PER_NODE`] per member rounded up and
//! capped at [`RANGES_MAX`], chosen when the directory is created and kept across
//! membership changes (a membership change moves replicas, never range boundaries).
//! Range `i` of `2^k` covers the points whose top `k` bits are `i`, so a later split
//! of every range into two halves keeps each shard in a half of its old range.
//!
//! # Assignment
//!
//! [`Directory::new`] and [`Directory::rebalance`] are pure functions of the layout,
//! the configured replica count, the member *set* and (for `rebalance`) the previous
//! assignment. They keep what they can, in this order:
//!
//! 1. drop replicas on nodes that left, and trim ranges that have more than `R`
//!    (removing the copy on the busiest node, never the preferred leader);
//! 2. fill ranges with fewer than `R` distinct replicas from the least-loaded nodes;
//! 3. move single replicas from the busiest to the least-loaded node while their
//!    loads differ by more than one (each move strictly lowers the sum of squared
//!    loads, so this ends, and it only ends balanced: a node with more replicas than
//!    another is in some range the other is not);
//! 4. give every range a preferred leader among its replicas and move leaderships
//!    (which moves no data) from the busiest leader to an idle node along chains of
//!    hand-overs while their counts differ by more than one.
//!
//! A join therefore moves only the replicas the newcomer needs to carry its share,
//! and a leave only re-homes the leaver's replicas (plus the few moves that keep the
//! others within one of each other). Ties are broken by a hash of (range, node)
//! under [`RANGE_SEED`], so replica sets spread over node pairs instead of repeating
//! one pattern, and every node computes the same directory.
//!
//! [`changes`] lists what differs between two directories, range by range: the
//! plan of replica additions and removals a membership change causes.

use crate::hash::{hash64, RANGE_SEED};
use crate::ids::{NodeId, ShardId};
use crate::ring::{shard_point, RING_NODES_MAX};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// Ranges per member when a directory is created, unless the cluster says
/// otherwise: a few per node, so that each node leads several groups (a failover
/// spreads their leaderships over the survivors) while heartbeats and elections
/// stay O(nodes). Fewer ranges make fuller raft entries (a commit cycle writes one
/// entry per range it touches), more spread the leaderships finer.
pub const RANGES_PER_NODE: u32 = 4;

/// Most ranges per member a cluster may ask for.
pub const RANGES_PER_NODE_MAX: u32 = 16;

/// Fewest ranges a layout computed for members has.
pub const RANGES_MIN: u32 = 4;

/// Most ranges a layout may have (a power of two). Bounds the groups each node
/// runs (at most `RANGES_MAX * REPLICAS_MAX / members` on average) against a
/// corrupt or enormous membership.
pub const RANGES_MAX: u32 = 1024;

/// Most replicas a range may have.
pub const REPLICAS_MAX: u8 = 5;

/// Replicas per range unless configured otherwise (fewer when the cluster has
/// fewer members).
pub const REPLICAS_DEFAULT: u8 = 3;

/// The voters a range group of `replicas` copies has on `members` members:
/// `min(replicas, members)`, except that a group never has two voters while a third
/// member exists. Two voters cannot replace a lost disk: every majority of two
/// needs both, so once one disk is gone its replacement can never be added under
/// the pair. A count of two (stated by a counter before it was refused) gets three.
/// Two members give two voters whatever is asked; a cluster of two members keeps one
/// copy of each shard (configs that ask for more are refused).
pub fn group_voters(replicas: u8, members: usize) -> usize {
    match usize::from(replicas).min(members) {
        2 if members > 2 => 3,
        r => r,
    }
}

/// The replica class of the cluster's own replica count.
const CLUSTER_CLASS: u8 = crate::ids::CLUSTER_REPLICAS;

/// Bound on the balancing moves of one rebalance, per replica slot: a safety net
/// over a loop that provably ends; it is never reached by a correct directory.
const BALANCE_STEPS_PER_SLOT: usize = 4;

/// One range of the ring in one replica class: an index into its layout (the low
/// 24 bits) and the class of the shards it holds (the high 8 bits,
/// [`crate::ShardId::replicas`]). Counters that state the same replica count share
/// their class's ranges; the ranges of the cluster's class
/// ([`crate::ids::CLUSTER_REPLICAS`], 0) are numbered by their index alone, as they
/// were before classes existed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RangeId(pub u32);

/// Bits of a [`RangeId`] that hold the range's index.
const RANGE_INDEX_BITS: u32 = 24;

impl RangeId {
    /// Range `index` of replica class `class`.
    pub fn new(class: u8, index: u32) -> Self {
        assert!(index < 1 << RANGE_INDEX_BITS, "range index {index} past its bits");
        Self((u32::from(class) << RANGE_INDEX_BITS) | index)
    }

    /// The replica class of the shards the range holds.
    pub fn class(self) -> u8 {
        (self.0 >> RANGE_INDEX_BITS) as u8
    }

    /// The range's index in its layout.
    pub fn index(self) -> u32 {
        self.0 & ((1 << RANGE_INDEX_BITS) - 1)
    }
}

impl fmt::Display for RangeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "range{}", self.index())?;
        if self.class() != crate::ids::CLUSTER_REPLICAS {
            write!(f, "@r{}", self.class())?;
        }
        Ok(())
    }
}

/// The replica classes a range may be of: the cluster's, and each replica count a
/// counter may state.
pub fn replica_classes() -> impl Iterator<Item = u8> {
    std::iter::once(crate::ids::CLUSTER_REPLICAS).chain(1..=REPLICAS_MAX)
}

/// Why a layout or directory could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    /// A range count that is zero, not a power of two or above [`RANGES_MAX`].
    #[error("{count} ranges is not a power of two in 1..={max}")]
    BadRangeCount {
        /// The count offered.
        count: u32,
        /// The limit, [`RANGES_MAX`].
        max: u32,
    },
    /// A replica count outside `1..=`[`REPLICAS_MAX`].
    #[error("{replicas} replicas is outside 1..={max}")]
    BadReplicas {
        /// The count offered.
        replicas: u8,
        /// The limit, [`REPLICAS_MAX`].
        max: u8,
    },
    /// No member to place replicas on.
    #[error("a range directory needs at least one member")]
    NoMembers,
    /// More distinct members than the ring allows.
    #[error("{members} members; the limit is {max}")]
    TooManyMembers {
        /// Distinct members offered.
        members: usize,
        /// The limit, [`RING_NODES_MAX`].
        max: usize,
    },
    /// Two directories with different layouts cannot be compared range by range.
    #[error("layouts differ ({before} and {after} ranges)")]
    LayoutChanged {
        /// Ranges before.
        before: u32,
        /// Ranges after.
        after: u32,
    },
}

/// How the circle is cut: `count` equal ranges, `count` a power of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeLayout {
    count: u32,
}

impl RangeLayout {
    /// A layout of `count` ranges.
    pub fn try_new(count: u32) -> Result<Self, RangeError> {
        if count == 0 || !count.is_power_of_two() || count > RANGES_MAX {
            return Err(RangeError::BadRangeCount { count, max: RANGES_MAX });
        }
        Ok(Self { count })
    }

    /// The layout a directory of `members` members starts with: [`RANGES_PER_NODE`]
    /// per member, rounded up to a power of two, at most [`RANGES_MAX`].
    pub fn for_members(members: usize) -> Self {
        Self::for_members_at(members, RANGES_PER_NODE)
    }

    /// The layout of `members` members at `per_node` ranges each (at least one),
    /// rounded up to a power of two, at least 4 and at most [`RANGES_MAX`].
    pub fn for_members_at(members: usize, per_node: u32) -> Self {
        let members = u32::try_from(members.max(1)).unwrap_or(u32::MAX);
        let wanted = members.saturating_mul(per_node.max(1)).max(RANGES_MIN);
        let count = wanted.checked_next_power_of_two().unwrap_or(RANGES_MAX).min(RANGES_MAX);
        Self { count }
    }

    /// Number of ranges.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Every range of the cluster's class, in order.
    pub fn ranges(&self) -> impl Iterator<Item = RangeId> {
        self.ranges_in(crate::ids::CLUSTER_REPLICAS)
    }

    /// Every range of replica class `class`, in order.
    pub fn ranges_in(&self, class: u8) -> impl Iterator<Item = RangeId> {
        (0..self.count).map(move |i| RangeId::new(class, i))
    }

    /// The range of the cluster's class holding ring point `point`.
    pub fn range_of_point(&self, point: u64) -> RangeId {
        let bits = self.count.trailing_zeros();
        if bits == 0 {
            RangeId(0)
        } else {
            RangeId((point >> (64 - bits)) as u32)
        }
    }

    /// The range holding `shard`: where its point falls, in its replica class.
    pub fn range_of_shard(&self, shard: &ShardId) -> RangeId {
        RangeId::new(shard.replicas, self.range_of_point(shard_point(shard)).index())
    }

    /// The first and last ring point of `range` (both included), or `None` for a
    /// range outside the layout or of a class no counter may have.
    pub fn span(&self, range: RangeId) -> Option<(u64, u64)> {
        if range.index() >= self.count || range.class() > REPLICAS_MAX {
            return None;
        }
        let bits = self.count.trailing_zeros();
        if bits == 0 {
            return Some((0, u64::MAX));
        }
        let width = 1u64 << (64 - bits);
        let start = u64::from(range.index()) * width;
        Some((start, start + (width - 1)))
    }
}

/// What a membership change does to one range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeChange {
    /// The range.
    pub range: RangeId,
    /// Nodes that become replicas (they catch up as learners first).
    pub added: Vec<NodeId>,
    /// Nodes that stop being replicas.
    pub removed: Vec<NodeId>,
    /// The preferred leader before (`None` if it had no replica).
    pub leader_before: Option<NodeId>,
    /// The preferred leader after.
    pub leader_after: NodeId,
}

/// Which nodes replicate each range, and which of them should lead it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Directory {
    layout: RangeLayout,
    /// The configured replica count; ranges have `min(replicas, members)`.
    replicas: u8,
    /// The distinct members, sorted.
    members: Vec<NodeId>,
    /// Per range: the preferred leader first, then the other replicas sorted.
    ranges: Vec<Vec<NodeId>>,
    /// The replica classes of counters that state their own replica count, each
    /// assigned as `ranges` is, with its count: per range, the preferred leader
    /// first. Only the classes some counter uses are listed ([`Directory::with_class`]).
    classes: BTreeMap<u8, Vec<Vec<NodeId>>>,
}

/// The tie-breaker of `node` for range `index` of replica class `class` (the
/// cluster's class hashes the index alone, as before classes existed).
fn tie(class: u8, index: usize, node: &NodeId) -> u64 {
    let range = RangeId::new(class, index as u32).0;
    let mut key = u64::from(range).to_be_bytes().to_vec();
    key.extend_from_slice(node.as_str().as_bytes());
    hash64(RANGE_SEED, &key)
}

/// The distinct, sorted members, checked against the limits.
fn members_of(members: impl IntoIterator<Item = NodeId>) -> Result<Vec<NodeId>, RangeError> {
    let mut members: Vec<NodeId> = members.into_iter().collect();
    members.sort();
    members.dedup();
    if members.is_empty() {
        return Err(RangeError::NoMembers);
    }
    if members.len() > RING_NODES_MAX {
        return Err(RangeError::TooManyMembers { members: members.len(), max: RING_NODES_MAX });
    }
    Ok(members)
}

/// The configured replica count, or the default; checked.
fn replicas_of(replicas: Option<u8>) -> Result<u8, RangeError> {
    let r = replicas.unwrap_or(REPLICAS_DEFAULT);
    if r == 0 || r > REPLICAS_MAX {
        return Err(RangeError::BadReplicas { replicas: r, max: REPLICAS_MAX });
    }
    Ok(r)
}

/// One range while it is being assigned.
struct Slot {
    leader: Option<NodeId>,
    set: BTreeSet<NodeId>,
}

/// The assignment algorithm of the module docs, from `previous` (which may be empty).
fn assign(
    layout: RangeLayout,
    class: u8,
    r: usize,
    members: &[NodeId],
    previous: &[Vec<NodeId>],
) -> Vec<Vec<NodeId>> {
    let tie = |i: usize, n: &NodeId| tie(class, i, n);
    let member_set: BTreeSet<&NodeId> = members.iter().collect();
    let mut slots: Vec<Slot> = (0..layout.count as usize)
        .map(|i| {
            let old = previous.get(i).map(Vec::as_slice).unwrap_or(&[]);
            let set: BTreeSet<NodeId> = old.iter().filter(|n| member_set.contains(n)).cloned().collect();
            let leader = old.first().filter(|n| member_set.contains(n)).cloned();
            Slot { leader, set }
        })
        .collect();
    let mut load: BTreeMap<NodeId, usize> = members.iter().map(|n| (n.clone(), 0)).collect();
    for slot in &slots {
        for n in &slot.set {
            *load.get_mut(n).expect("filtered to members") += 1;
        }
    }

    // 1. Trim ranges with too many replicas: drop the copy on the busiest node.
    for (i, slot) in slots.iter_mut().enumerate() {
        while slot.set.len() > r {
            let victim = slot
                .set
                .iter()
                .filter(|n| slot.leader.as_ref() != Some(*n))
                .max_by_key(|n| (load[*n], tie(i, n)))
                .cloned()
                .expect("r >= 1, so a non-leader exists when there are more than r");
            slot.set.remove(&victim);
            *load.get_mut(&victim).expect("member") -= 1;
        }
    }

    // 2. Fill ranges with too few replicas from the least-loaded nodes.
    for (i, slot) in slots.iter_mut().enumerate() {
        while slot.set.len() < r {
            let pick = members
                .iter()
                .filter(|n| !slot.set.contains(*n))
                .min_by_key(|n| (load[*n], tie(i, n)))
                .cloned()
                .expect("r <= members, so a node outside the set exists");
            *load.get_mut(&pick).expect("member") += 1;
            slot.set.insert(pick);
        }
    }

    // 3. Balance replica loads to within one.
    let steps_max = BALANCE_STEPS_PER_SLOT * slots.len() * r.max(1);
    for _ in 0..steps_max {
        let (busy, busy_load) =
            load.iter().max_by_key(|(n, l)| (**l, std::cmp::Reverse(*n))).expect("members");
        let (idle, idle_load) = load.iter().min_by_key(|(n, l)| (**l, *n)).expect("members");
        if *busy_load <= idle_load + 1 {
            break;
        }
        let (busy, idle) = (busy.clone(), idle.clone());
        // A range with the busy node and without the idle one exists (the busy node
        // is in more ranges); prefer one the busy node does not lead.
        let Some(at) = (0..slots.len())
            .filter(|&i| slots[i].set.contains(&busy) && !slots[i].set.contains(&idle))
            .min_by_key(|&i| (slots[i].leader.as_ref() == Some(&busy), tie(i, &idle)))
        else {
            break;
        };
        let slot = &mut slots[at];
        slot.set.remove(&busy);
        slot.set.insert(idle.clone());
        if slot.leader.as_ref() == Some(&busy) {
            slot.leader = None;
        }
        *load.get_mut(&busy).expect("member") -= 1;
        *load.get_mut(&idle).expect("member") += 1;
    }

    // 4. Preferred leaders: keep valid ones, give leaderless ranges the replica that
    // leads least, then move leaderships from busy leaders to idle replicas.
    let mut leads: BTreeMap<NodeId, usize> = members.iter().map(|n| (n.clone(), 0)).collect();
    for slot in &mut slots {
        if slot.leader.as_ref().is_some_and(|l| !slot.set.contains(l)) {
            slot.leader = None;
        }
        if let Some(l) = &slot.leader {
            *leads.get_mut(l).expect("member") += 1;
        }
    }
    for (i, slot) in slots.iter_mut().enumerate() {
        if slot.leader.is_none() {
            let pick = slot.set.iter().min_by_key(|n| (leads[*n], tie(i, n))).cloned().expect("r >= 1");
            *leads.get_mut(&pick).expect("member") += 1;
            slot.leader = Some(pick);
        }
    }
    for _ in 0..steps_max {
        if !shift_leadership(class, &mut slots, &mut leads) {
            break;
        }
    }

    slots
        .into_iter()
        .map(|slot| {
            let leader = slot.leader.expect("assigned above");
            let mut out = vec![leader.clone()];
            out.extend(slot.set.into_iter().filter(|n| *n != leader));
            out
        })
        .collect()
}

/// Moves one leadership's worth of load from a busiest leader to a node that leads
/// at least two fewer ranges, along the shortest chain of hand-overs (the busiest
/// node hands a range to one of its replicas, which hands one of its own to one of
/// that range's replicas, and so on): the ends change by one, the nodes between keep
/// their count. The busiest nodes are tried in name order, since a chain may start
/// from one and not another. Returns false when no such chain exists.
fn shift_leadership(class: u8, slots: &mut [Slot], leads: &mut BTreeMap<NodeId, usize>) -> bool {
    let Some(&top) = leads.values().max() else {
        return false;
    };
    let busiest: Vec<NodeId> = leads.iter().filter(|(_, l)| **l == top).map(|(n, _)| n.clone()).collect();
    busiest.into_iter().any(|busy| shift_from(class, slots, leads, busy, top))
}

/// [`shift_leadership`] from `busy`, which leads `top` ranges.
fn shift_from(
    class: u8,
    slots: &mut [Slot],
    leads: &mut BTreeMap<NodeId, usize>,
    busy: NodeId,
    top: usize,
) -> bool {
    // Breadth-first over nodes; `via[n]` is the range whose leadership reached `n`.
    let mut via: BTreeMap<NodeId, usize> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([busy.clone()]);
    let mut seen: BTreeSet<NodeId> = BTreeSet::from([busy.clone()]);
    let mut end = None;
    while let Some(at) = queue.pop_front() {
        if at != busy && leads[&at] + 2 <= top {
            end = Some(at);
            break;
        }
        for (i, slot) in slots.iter().enumerate() {
            if slot.leader.as_ref() != Some(&at) {
                continue;
            }
            let mut next: Vec<&NodeId> = slot.set.iter().filter(|n| !seen.contains(*n)).collect();
            next.sort_by_key(|n| (leads[*n], tie(class, i, n)));
            for n in next {
                seen.insert(n.clone());
                via.insert(n.clone(), i);
                queue.push_back(n.clone());
            }
        }
    }
    let Some(end) = end else {
        return false;
    };
    // Walk back from the end, handing each range on the chain to its next node.
    let mut at = end.clone();
    while at != busy {
        let i = via[&at];
        let from = slots[i].leader.replace(at.clone()).expect("leaders assigned");
        at = from;
    }
    *leads.get_mut(&busy).expect("member") -= 1;
    *leads.get_mut(&end).expect("member") += 1;
    true
}

impl Directory {
    /// The directory of a new cluster: [`RangeLayout::for_members`] ranges, each on
    /// `min(replicas, members)` nodes (`replicas` defaults to [`REPLICAS_DEFAULT`]).
    pub fn new(members: impl IntoIterator<Item = NodeId>, replicas: Option<u8>) -> Result<Self, RangeError> {
        let members = members_of(members)?;
        Self::with_layout(RangeLayout::for_members(members.len()), members, replicas)
    }

    /// A new directory over an explicit layout.
    pub fn with_layout(
        layout: RangeLayout,
        members: impl IntoIterator<Item = NodeId>,
        replicas: Option<u8>,
    ) -> Result<Self, RangeError> {
        let members = members_of(members)?;
        let replicas = replicas_of(replicas)?;
        let r = group_voters(replicas, members.len());
        let ranges = assign(layout, CLUSTER_CLASS, r, &members, &[]);
        Ok(Self { layout, replicas, members, ranges, classes: BTreeMap::new() })
    }

    /// This directory with the ranges of replica class `class` (a replica count a
    /// counter states, `1..=`[`REPLICAS_MAX`]) assigned afresh on `members` (the
    /// members the metadata group recorded for the class, [`record_class`]), each
    /// range on `min(class, members)` of them; itself if it lists the class already.
    /// [`Directory::rebalance`] then moves the class onto the current members with
    /// the cluster's.
    pub fn with_class(
        &self,
        class: u8,
        members: impl IntoIterator<Item = NodeId>,
    ) -> Result<Self, RangeError> {
        let count = replicas_of(Some(class))?;
        let members = members_of(members)?;
        let mut next = self.clone();
        let r = group_voters(count, members.len());
        next.classes.entry(class).or_insert_with(|| assign(self.layout, class, r, &members, &[]));
        Ok(next)
    }

    /// Whether the directory assigns the ranges of replica class `class` (the
    /// cluster's class always).
    pub fn has_class(&self, class: u8) -> bool {
        class == CLUSTER_CLASS || self.classes.contains_key(&class)
    }

    /// The replica classes this directory assigns: the cluster's, then the others.
    pub fn classes(&self) -> impl Iterator<Item = u8> + '_ {
        std::iter::once(CLUSTER_CLASS).chain(self.classes.keys().copied())
    }

    /// Every range of every class this directory assigns.
    pub fn all_ranges(&self) -> impl Iterator<Item = RangeId> + '_ {
        self.classes().flat_map(move |class| self.layout.ranges_in(class))
    }

    /// The directory after the members became `members` (and, if given, the replica
    /// count `replicas`), moving as few replicas as it can, with the plan of changes.
    pub fn rebalance(
        &self,
        members: impl IntoIterator<Item = NodeId>,
        replicas: Option<u8>,
    ) -> Result<(Self, Vec<RangeChange>), RangeError> {
        let members = members_of(members)?;
        let replicas = match replicas {
            Some(r) => replicas_of(Some(r))?,
            None => self.replicas,
        };
        let r = group_voters(replicas, members.len());
        let ranges = assign(self.layout, CLUSTER_CLASS, r, &members, &self.ranges);
        let classes = self
            .classes
            .iter()
            .map(|(&class, previous)| {
                let r = group_voters(class, members.len());
                (class, assign(self.layout, class, r, &members, previous))
            })
            .collect();
        let next = Self { layout: self.layout, replicas, members, ranges, classes };
        let plan = changes(self, &next)?;
        Ok((next, plan))
    }

    /// How the circle is cut.
    pub fn layout(&self) -> RangeLayout {
        self.layout
    }

    /// The configured replica count.
    pub fn configured_replicas(&self) -> u8 {
        self.replicas
    }

    /// The replicas each range has: [`group_voters`] of the configured count.
    pub fn replicas_per_range(&self) -> usize {
        group_voters(self.replicas, self.members.len())
    }

    /// The distinct members, sorted.
    pub fn members(&self) -> &[NodeId] {
        &self.members
    }

    /// The replicas of `range`, preferred leader first (empty outside the layout,
    /// or for a class the directory does not assign).
    pub fn replicas(&self, range: RangeId) -> &[NodeId] {
        let ranges = match range.class() {
            CLUSTER_CLASS => &self.ranges,
            class => match self.classes.get(&class) {
                Some(ranges) => ranges,
                None => return &[],
            },
        };
        ranges.get(range.index() as usize).map(Vec::as_slice).unwrap_or(&[])
    }

    /// The preferred leader of `range`.
    pub fn preferred_leader(&self, range: RangeId) -> Option<&NodeId> {
        self.replicas(range).first()
    }

    /// The range holding `shard`.
    pub fn range_of_shard(&self, shard: &ShardId) -> RangeId {
        self.layout.range_of_shard(shard)
    }

    /// The ranges `node` replicates, of every class the directory assigns.
    pub fn ranges_of(&self, node: &NodeId) -> Vec<RangeId> {
        self.all_ranges().filter(|r| self.replicas(*r).contains(node)).collect()
    }

    /// Every range's replicas, of every class.
    fn every_set(&self) -> impl Iterator<Item = &Vec<NodeId>> {
        self.ranges.iter().chain(self.classes.values().flatten())
    }

    /// Replicas per member, over every class (each class is balanced on its own).
    pub fn replica_load(&self) -> BTreeMap<NodeId, usize> {
        let mut load: BTreeMap<NodeId, usize> = self.members.iter().map(|n| (n.clone(), 0)).collect();
        for set in self.every_set() {
            for n in set {
                *load.entry(n.clone()).or_default() += 1;
            }
        }
        load
    }

    /// Preferred leaderships per member, over every class.
    pub fn leader_load(&self) -> BTreeMap<NodeId, usize> {
        let mut load: BTreeMap<NodeId, usize> = self.members.iter().map(|n| (n.clone(), 0)).collect();
        for set in self.every_set() {
            if let Some(l) = set.first() {
                *load.entry(l.clone()).or_default() += 1;
            }
        }
        load
    }
}

/// Records, in `classes` (the replica classes in use, each with the members it was
/// first assigned on), the class of a counter just created: `class` is its
/// [`crate::ShardId::replicas`], `members` the data-plane members at its creation
/// (empty while they are the members every node is configured with, before any
/// membership change). Nothing is recorded for the cluster's class, or a class
/// already recorded. Answers whether it recorded the class.
///
/// The metadata group applies this with every creation, so every node assigns a
/// class on the same members: the class's groups are formed by the preferred
/// leaders among them, exactly once, however late after the cluster's start the
/// first such counter comes.
pub fn record_class<M: Clone>(classes: &mut BTreeMap<u8, Vec<M>>, class: u8, members: &[M]) -> bool {
    if class == CLUSTER_CLASS || classes.contains_key(&class) {
        return false;
    }
    classes.insert(class, members.to_vec());
    true
}

/// What differs between `before` and `after`, range by range (ranges that did not
/// change are left out).
pub fn changes(before: &Directory, after: &Directory) -> Result<Vec<RangeChange>, RangeError> {
    if before.layout != after.layout {
        return Err(RangeError::LayoutChanged { before: before.layout.count, after: after.layout.count });
    }
    let mut out = Vec::new();
    for range in before.all_ranges().filter(|r| after.has_class(r.class())) {
        let (old, new) = (before.replicas(range), after.replicas(range));
        let old_set: BTreeSet<&NodeId> = old.iter().collect();
        let new_set: BTreeSet<&NodeId> = new.iter().collect();
        let added: Vec<NodeId> = new_set.difference(&old_set).map(|n| (*n).clone()).collect();
        let removed: Vec<NodeId> = old_set.difference(&new_set).map(|n| (*n).clone()).collect();
        let leader_before = old.first().cloned();
        let leader_after = new.first().cloned().expect("every range has a replica");
        if added.is_empty() && removed.is_empty() && leader_before.as_ref() == Some(&leader_after) {
            continue;
        }
        out.push(RangeChange { range, added, removed, leader_before, leader_after });
    }
    Ok(out)
}

#[cfg(test)]
mod voter_tests {
    use super::group_voters;

    #[test]
    fn a_group_never_has_two_voters_while_a_third_member_exists() {
        assert_eq!(group_voters(1, 5), 1);
        assert_eq!(group_voters(2, 5), 3);
        assert_eq!(group_voters(2, 3), 3);
        assert_eq!(group_voters(2, 2), 2);
        assert_eq!(group_voters(3, 2), 2);
        assert_eq!(group_voters(3, 1), 1);
        assert_eq!(group_voters(4, 3), 3);
        assert_eq!(group_voters(5, 7), 5);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::name::CounterName;
    use proptest::prelude::*;

    fn node(i: usize) -> NodeId {
        NodeId::new(format!("node{i}"))
    }

    fn nodes(n: usize) -> Vec<NodeId> {
        (1..=n).map(node).collect()
    }

    fn spread(load: &BTreeMap<NodeId, usize>) -> usize {
        load.values().max().unwrap() - load.values().min().unwrap()
    }

    /// Every range has the right number of distinct member replicas.
    fn check_shape(d: &Directory) {
        let r = d.replicas_per_range();
        assert_eq!(d.ranges.len(), d.layout.count() as usize);
        for range in d.layout.ranges() {
            let reps = d.replicas(range);
            let set: BTreeSet<&NodeId> = reps.iter().collect();
            assert_eq!(reps.len(), r, "{range}: {reps:?}");
            assert_eq!(set.len(), r, "{range} repeats a node: {reps:?}");
            assert!(reps.iter().all(|n| d.members.contains(n)), "{range}: {reps:?}");
            let mut rest = reps[1..].to_vec();
            rest.sort();
            assert_eq!(rest, reps[1..], "non-leaders are sorted");
        }
        let classes: usize =
            d.classes.iter().map(|(&c, ranges)| ranges.len() * group_voters(c, d.members.len())).sum();
        assert_eq!(d.replica_load().values().sum::<usize>(), r * d.layout.count() as usize + classes);
    }

    /// Applying `plan` to `before` gives `after`'s replica sets and leaders.
    fn check_plan(before: &Directory, after: &Directory, plan: &[RangeChange]) {
        let by_range: BTreeMap<RangeId, &RangeChange> = plan.iter().map(|c| (c.range, c)).collect();
        for range in before.layout.ranges() {
            let mut set: BTreeSet<NodeId> = before.replicas(range).iter().cloned().collect();
            let mut leader = before.preferred_leader(range).cloned();
            if let Some(c) = by_range.get(&range) {
                for n in &c.removed {
                    assert!(set.remove(n));
                }
                for n in &c.added {
                    assert!(set.insert(n.clone()));
                }
                assert_eq!(c.leader_before, leader);
                leader = Some(c.leader_after.clone());
            }
            let want: BTreeSet<NodeId> = after.replicas(range).iter().cloned().collect();
            assert_eq!(set, want, "{range}");
            assert_eq!(leader.as_ref(), after.preferred_leader(range), "{range}");
        }
    }

    fn replica_moves(plan: &[RangeChange]) -> usize {
        plan.iter().map(|c| c.added.len()).sum()
    }

    #[test]
    fn layout_cuts_the_circle_into_equal_contiguous_ranges() {
        let layout = RangeLayout::try_new(16).unwrap();
        let mut next = 0u64;
        for range in layout.ranges() {
            let (start, end) = layout.span(range).unwrap();
            assert_eq!(start, next, "{range} starts where the previous ended");
            assert_eq!(layout.range_of_point(start), range);
            assert_eq!(layout.range_of_point(end), range);
            assert_eq!(end - start, (1u64 << 60) - 1);
            next = end.wrapping_add(1);
        }
        assert_eq!(next, 0, "the last range ends at the top of the circle");
        assert_eq!(layout.span(RangeId(16)), None);
        let one = RangeLayout::try_new(1).unwrap();
        assert_eq!(one.span(RangeId(0)), Some((0, u64::MAX)));
        assert_eq!(one.range_of_point(u64::MAX), RangeId(0));
    }

    #[test]
    fn shards_spread_over_ranges_and_land_in_their_span() {
        let layout = RangeLayout::try_new(16).unwrap();
        let mut hits = [0u32; 16];
        for c in 0..2_000 {
            let name = CounterName::new(format!("likes:{c}")).unwrap();
            for i in 0..8 {
                let shard = ShardId::new(name.clone(), 0, i);
                let range = layout.range_of_shard(&shard);
                let (start, end) = layout.span(range).unwrap();
                assert!((start..=end).contains(&shard_point(&shard)));
                hits[range.0 as usize] += 1;
            }
        }
        // 16,000 shards over 16 ranges: about 1,000 each.
        assert!(hits.iter().all(|&h| (850..1_150).contains(&h)), "{hits:?}");
    }

    #[test]
    fn layout_sizes_follow_the_members_and_are_bounded() {
        assert_eq!(RangeLayout::for_members(0).count(), 4);
        assert_eq!(RangeLayout::for_members(1).count(), 4);
        assert_eq!(RangeLayout::for_members(3).count(), 16);
        assert_eq!(RangeLayout::for_members(5).count(), 32);
        assert_eq!(RangeLayout::for_members(RING_NODES_MAX).count(), RANGES_MAX);
        assert_eq!(RangeLayout::for_members(usize::MAX).count(), RANGES_MAX);
        assert_eq!(RangeLayout::for_members_at(3, 1).count(), 4);
        assert_eq!(RangeLayout::for_members_at(5, 1).count(), 8);
        assert_eq!(RangeLayout::for_members_at(3, 2).count(), 8);
        assert_eq!(RangeLayout::for_members_at(3, 0).count(), 4);
        assert_eq!(RangeLayout::for_members_at(3, RANGES_PER_NODE), RangeLayout::for_members(3));
        assert_eq!(RangeLayout::for_members_at(RING_NODES_MAX, RANGES_PER_NODE_MAX).count(), RANGES_MAX);
        for bad in [0, 3, 12, RANGES_MAX * 2] {
            assert_eq!(
                RangeLayout::try_new(bad),
                Err(RangeError::BadRangeCount { count: bad, max: RANGES_MAX })
            );
        }
        assert!(RangeLayout::try_new(RANGES_MAX).is_ok());
    }

    #[test]
    fn new_directories_have_distinct_replicas_and_balanced_loads() {
        for n in 1..=9 {
            for r in 1..=REPLICAS_MAX {
                let d = Directory::new(nodes(n), Some(r)).unwrap();
                check_shape(&d);
                assert_eq!(d.replicas_per_range(), group_voters(r, n));
                assert!(spread(&d.replica_load()) <= 1, "n={n} r={r}: {:?}", d.replica_load());
                assert!(spread(&d.leader_load()) <= 1, "n={n} r={r}: {:?}", d.leader_load());
            }
        }
        // The default is three replicas, fewer on smaller clusters.
        assert_eq!(Directory::new(nodes(5), None).unwrap().replicas_per_range(), 3);
        assert_eq!(Directory::new(nodes(2), None).unwrap().replicas_per_range(), 2);
    }

    #[test]
    fn replica_sets_use_many_node_combinations() {
        // With 6 nodes and R = 3, ranges should not all repeat two or three sets.
        let d = Directory::new(nodes(6), Some(3)).unwrap();
        let sets: BTreeSet<BTreeSet<&NodeId>> =
            d.layout.ranges().map(|r| d.replicas(r).iter().collect()).collect();
        assert!(sets.len() >= 8, "{} distinct sets over {} ranges", sets.len(), d.layout.count());
    }

    #[test]
    fn directory_is_a_function_of_the_member_set() {
        let a = Directory::new(nodes(5), Some(3)).unwrap();
        let mut shuffled = nodes(5);
        shuffled.reverse();
        shuffled.push(node(2));
        let b = Directory::new(shuffled, Some(3)).unwrap();
        assert_eq!(a, b);
        let (a2, pa) = a.rebalance(nodes(6), None).unwrap();
        let (b2, pb) = b.rebalance(nodes(6).into_iter().rev(), None).unwrap();
        assert_eq!(a2, b2);
        assert_eq!(pa, pb);
    }

    #[test]
    fn a_join_moves_only_the_newcomers_share_and_only_to_it() {
        for (n, r) in [(3, 3), (3, 2), (5, 3), (4, 1), (7, 5)] {
            let before = Directory::new(nodes(n), Some(r)).unwrap();
            let newcomer = node(n + 1);
            let (after, plan) = before.rebalance(nodes(n + 1), None).unwrap();
            check_shape(&after);
            check_plan(&before, &after, &plan);
            assert!(spread(&after.replica_load()) <= 1, "n={n} r={r}: {:?}", after.replica_load());
            assert!(spread(&after.leader_load()) <= 1, "n={n} r={r}: {:?}", after.leader_load());
            for c in &plan {
                assert!(c.added.iter().all(|a| a == &newcomer), "n={n} r={r}: {c:?}");
                assert!(c.removed.len() == c.added.len());
            }
            let received = after.replica_load()[&newcomer];
            assert_eq!(replica_moves(&plan), received, "n={n} r={r}: every move is one the newcomer needs");
            // The newcomer carries its share: total / (n + 1), rounded either way.
            let total = group_voters(r, n + 1) * after.layout.count() as usize;
            assert!(received >= total / (n + 1), "n={n} r={r}: {received} of {total}");
            println!("join {n}->{}: r={r}, {} replica moves of {total}", n + 1, replica_moves(&plan));
        }
    }

    #[test]
    fn a_leave_re_homes_the_leavers_replicas_and_little_else() {
        for (n, r) in [(4, 3), (5, 3), (6, 2), (6, 5), (4, 1)] {
            let before = Directory::new(nodes(n), Some(r)).unwrap();
            let leaver = node(2);
            let lost = before.replica_load()[&leaver];
            let (after, plan) =
                before.rebalance(nodes(n).into_iter().filter(|x| x != &leaver), None).unwrap();
            check_shape(&after);
            check_plan(&before, &after, &plan);
            assert!(spread(&after.replica_load()) <= 1, "n={n} r={r}: {:?}", after.replica_load());
            assert!(spread(&after.leader_load()) <= 1, "n={n} r={r}: {:?}", after.leader_load());
            assert!(after.ranges_of(&leaver).is_empty());
            let moves = replica_moves(&plan);
            // Each of the leaver's replicas is re-homed; at most one balancing move
            // per remaining node on top.
            assert!(moves >= lost && moves <= lost + (n - 1), "n={n} r={r}: {moves} moves for {lost} lost");
            println!("leave {n}->{}: r={r}, {moves} replica moves for {lost} lost", n - 1);
        }
    }

    #[test]
    fn small_clusters_grow_to_the_configured_replicas() {
        let one = Directory::new(nodes(1), None).unwrap();
        assert_eq!(one.replicas_per_range(), 1);
        let (two, plan) = one.rebalance(nodes(2), None).unwrap();
        assert_eq!(two.replicas_per_range(), 2);
        assert_eq!(replica_moves(&plan), two.layout.count() as usize);
        assert!(plan.iter().all(|c| c.removed.is_empty()), "growing R removes nothing");
        let (three, _) = two.rebalance(nodes(3), None).unwrap();
        check_shape(&three);
        assert_eq!(three.replicas_per_range(), 3);
        // Raising the configured count on the same members adds, never moves.
        let (five, plan) = Directory::new(nodes(5), Some(3)).unwrap().rebalance(nodes(5), Some(5)).unwrap();
        check_shape(&five);
        assert!(plan.iter().all(|c| c.removed.is_empty() && c.added.len() == 2));
    }

    #[test]
    fn unchanged_membership_changes_nothing() {
        let d = Directory::new(nodes(5), Some(3)).unwrap();
        let (same, plan) = d.rebalance(nodes(5), None).unwrap();
        assert_eq!(same, d);
        assert!(plan.is_empty());
    }

    #[test]
    fn limits_are_refused() {
        assert_eq!(Directory::new(Vec::new(), None), Err(RangeError::NoMembers));
        assert_eq!(
            Directory::new(nodes(3), Some(0)),
            Err(RangeError::BadReplicas { replicas: 0, max: REPLICAS_MAX })
        );
        assert_eq!(
            Directory::new(nodes(3), Some(6)),
            Err(RangeError::BadReplicas { replicas: 6, max: REPLICAS_MAX })
        );
        assert_eq!(
            Directory::new(nodes(RING_NODES_MAX + 1), None),
            Err(RangeError::TooManyMembers { members: RING_NODES_MAX + 1, max: RING_NODES_MAX })
        );
        let d = Directory::new(nodes(3), None).unwrap();
        assert_eq!(d.rebalance(Vec::new(), None).unwrap_err(), RangeError::NoMembers);
        let other = Directory::with_layout(RangeLayout::try_new(8).unwrap(), nodes(3), None).unwrap();
        assert_eq!(changes(&d, &other), Err(RangeError::LayoutChanged { before: 16, after: 8 }));
        assert!(d.replicas(RangeId(16)).is_empty());
    }

    #[test]
    fn directory_is_pinned() {
        // If this changes, nodes running different builds disagree about replicas.
        let d = Directory::new(nodes(4), Some(3)).unwrap();
        let got: Vec<String> = (0..4)
            .map(|i| d.replicas(RangeId(i)).iter().map(NodeId::as_str).collect::<Vec<_>>().join(","))
            .collect();
        assert_eq!(got, PINNED_REPLICAS);
    }

    #[test]
    fn leaderships_balance_when_the_first_busiest_node_has_no_way_down() {
        // Found by the property below: two nodes lead two ranges each and one none;
        // the chain of hand-overs starts from whichever busiest node has one.
        let mut members: BTreeSet<NodeId> = nodes(2).into_iter().collect();
        let mut d = Directory::new(members.clone(), Some(1)).unwrap();
        for (toggle, r) in [(6, None), (8, None), (2, None), (9, None), (11, None), (0, None), (4, Some(2))] {
            let n = node(toggle + 1);
            if !members.remove(&n) {
                members.insert(n);
            }
            d = d.rebalance(members.clone(), r).unwrap().0;
            assert!(spread(&d.leader_load()) <= 1, "{:?}", d.leader_load());
            assert!(spread(&d.replica_load()) <= 1, "{:?}", d.replica_load());
        }
    }

    const PINNED_REPLICAS: [&str; 4] =
        ["node2,node1,node3", "node4,node2,node3", "node2,node1,node4", "node3,node1,node4"];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Any sequence of joins, leaves and replica-count changes keeps every range
        /// at R distinct member replicas, loads within one, and plans that turn each
        /// directory into the next.
        #[test]
        fn any_change_sequence_keeps_the_invariants(
            start in 1usize..8,
            r in 1u8..=REPLICAS_MAX,
            steps in proptest::collection::vec((0usize..12, proptest::option::of(1u8..=REPLICAS_MAX)), 1..12),
        ) {
            let mut members: BTreeSet<NodeId> = nodes(start).into_iter().collect();
            let mut d = Directory::new(members.clone(), Some(r)).unwrap();
            check_shape(&d);
            for (toggle, new_r) in steps {
                let n = node(toggle + 1);
                if !members.remove(&n) {
                    members.insert(n);
                }
                if members.is_empty() {
                    members.insert(node(1));
                }
                let (next, plan) = d.rebalance(members.clone(), new_r).unwrap();
                check_shape(&next);
                check_plan(&d, &next, &plan);
                prop_assert!(spread(&next.replica_load()) <= 1, "{:?}", next.replica_load());
                prop_assert!(spread(&next.leader_load()) <= 1, "{:?}", next.leader_load());
                prop_assert!(next.ranges.iter().all(|s| s.iter().all(|x| members.contains(x))));
                d = next;
            }
        }
    }

    /// Per class: every range of the class has `min(class, members)` distinct
    /// member replicas, and the class's replica loads are within one.
    fn check_class(d: &Directory, class: u8) {
        let r = group_voters(class, d.members.len());
        let mut load: BTreeMap<NodeId, usize> = d.members.iter().map(|n| (n.clone(), 0)).collect();
        for range in d.layout.ranges_in(class) {
            let reps = d.replicas(range);
            let set: BTreeSet<&NodeId> = reps.iter().collect();
            assert_eq!((reps.len(), set.len()), (r, r), "{range}: {reps:?}");
            for n in reps {
                *load.get_mut(n).expect("a member") += 1;
            }
        }
        assert!(spread(&load) <= 1, "class {class}: {load:?}");
    }

    #[test]
    fn a_range_names_its_class_and_the_clusters_class_keeps_its_numbers() {
        let r = RangeId::new(3, 17);
        assert_eq!((r.class(), r.index()), (3, 17));
        assert_eq!(r.to_string(), "range17@r3");
        assert_eq!(RangeId::new(0, 17), RangeId(17));
        assert_eq!(RangeId(17).to_string(), "range17");
        let layout = RangeLayout::try_new(8).unwrap();
        let shard = ShardId::new(CounterName::new("likes").unwrap(), 0, 3);
        let plain = layout.range_of_shard(&shard);
        let classed = layout.range_of_shard(&shard.clone().in_class(5));
        assert_eq!((plain.class(), classed.class()), (0, 5));
        assert_eq!(plain.index(), classed.index(), "the same point of the ring");
        assert_eq!(layout.span(plain), layout.span(classed));
        assert_eq!(layout.span(RangeId::new(REPLICAS_MAX + 1, 0)), None, "no counter has that class");
    }

    #[test]
    fn a_class_is_assigned_beside_the_clusters_and_follows_its_members() {
        let d = Directory::new(nodes(5), Some(3)).unwrap();
        let before: Vec<Vec<NodeId>> = d.layout.ranges().map(|r| d.replicas(r).to_vec()).collect();
        assert!(d.replicas(RangeId::new(5, 0)).is_empty(), "no class until one is asked for");
        let d = d.with_class(5, nodes(5)).unwrap().with_class(1, nodes(5)).unwrap();
        let after: Vec<Vec<NodeId>> = d.layout.ranges().map(|r| d.replicas(r).to_vec()).collect();
        assert_eq!(before, after, "a class leaves the cluster's ranges as they were");
        check_shape(&d);
        for class in [1, 5] {
            check_class(&d, class);
        }
        assert_eq!(d.classes().collect::<Vec<_>>(), vec![0, 1, 5]);
        assert_eq!(d.with_class(5, nodes(3)).unwrap(), d, "asking again changes nothing");
        assert!(d.with_class(0, nodes(5)).is_err() && d.with_class(REPLICAS_MAX + 1, nodes(5)).is_err());
        assert!(d.with_class(2, []).is_err(), "a class needs members");
        // Every node replicates every range of class 5, and some of class 1.
        for n in nodes(5) {
            let of = d.ranges_of(&n);
            assert_eq!(of.iter().filter(|r| r.class() == 5).count(), d.layout.count() as usize);
            assert!(of.iter().any(|r| r.class() == 1), "{n} leads a copy of class 1 too");
        }
        // A node leaves: each class is rebalanced on the rest, and the plan lists
        // the ranges of every class it held.
        let (next, plan) = d.rebalance(nodes(4), None).unwrap();
        check_shape(&next);
        for class in [1, 5] {
            check_class(&next, class);
        }
        assert!(next.ranges_of(&node(5)).is_empty());
        for r in d.ranges_of(&node(5)) {
            assert!(plan.iter().any(|c| c.range == r && c.removed == vec![node(5)]), "{r}");
        }
        // Every node computes the same.
        let again = Directory::new(nodes(5), Some(3))
            .unwrap()
            .with_class(1, nodes(5))
            .unwrap()
            .with_class(5, nodes(5))
            .unwrap();
        assert_eq!(again.rebalance(nodes(4), None).unwrap().0, next);
    }

    #[test]
    fn a_class_first_used_after_a_member_left_is_assigned_on_the_members_then() {
        // The cluster started on five nodes; node5 left; then the first counter of
        // class 3 was created, and the metadata group recorded the four members.
        let mut classes: BTreeMap<u8, Vec<NodeId>> = BTreeMap::new();
        assert!(
            !record_class(&mut classes, CLUSTER_CLASS, &nodes(4)),
            "the cluster's class is never recorded"
        );
        assert!(record_class(&mut classes, 3, &nodes(4)));
        assert!(!record_class(&mut classes, 3, &nodes(5)), "the first record stays");
        let initial = Directory::new(nodes(5), Some(3)).unwrap().with_class(3, classes[&3].clone()).unwrap();
        // Every range of the class is formed by a node that is still a member.
        for range in initial.layout.ranges_in(3) {
            assert!(initial.replicas(range).iter().all(|n| *n != node(5)), "{range}");
        }
        let (current, _) = initial.rebalance(nodes(4), None).unwrap();
        check_class(&current, 3);
        for range in initial.layout.ranges_in(3) {
            assert_eq!(current.replicas(range), initial.replicas(range), "nothing of the class moves");
        }
    }
}
