//! Consistent-hash placement of shards on nodes, with virtual nodes.
//!
//! Every node must compute the same owner for every shard from nothing but the
//! membership, without talking to the others, and a membership change must move as
//! few shards as possible (each moved shard is a handover of its value, sketch and
//! dedup records). A consistent-hash ring gives both: nodes and shards are hashed
//! onto the same 64-bit circle and a shard belongs to the first node point at or
//! after its own point, so adding or removing a node only moves the shards on the
//! arcs that node gains or loses.
//!
//! Each node is placed at many points (virtual nodes) so that its share of the circle
//! is the sum of many small arcs and therefore close to `1/n`; with one point per
//! node the arcs, and so the load, differ by large factors.
//!
//! # Determinism
//!
//! The ring is a pure function of the node *set* and the virtual-node count: nodes are
//! sorted and deduplicated, points come from [`hash64`] with [`RING_SEED`] (XXH3-64,
//! specified, never `DefaultHasher`), and two nodes landing on the same point are
//! ordered by node id. No clock, no RNG, no hash-map iteration order.

use crate::hash::{hash64, RING_SEED};
use crate::ids::{NodeId, ShardId};

/// Virtual nodes per physical node unless configured otherwise.
///
/// A node's share of the ring is the sum of its arcs; with `v` points per node its
/// relative standard deviation is about `1/sqrt(v)`, so 128 points keep every node
/// within roughly ±10 % of the mean (measured: see the balance test), while the ring
/// for a 5-node cluster stays at 640 points (10 KiB) and a lookup is a binary search
/// over them. More points buy little balance for linearly more memory per ring.
pub const VNODES_PER_NODE_DEFAULT: u32 = 128;

/// Most nodes a ring may hold. Far above any planned cluster (3–5 nodes); it bounds
/// the ring's memory (`RING_NODES_MAX * VNODES_PER_NODE_MAX` points) against a
/// corrupt membership.
pub const RING_NODES_MAX: usize = 1024;

/// Most virtual nodes per node. Beyond a few hundred the balance gain is negligible;
/// the bound keeps a misconfigured ring from allocating gigabytes.
pub const VNODES_PER_NODE_MAX: u32 = 4096;

/// Byte that separates the counter name from the numeric parts of a shard's ring key.
/// Counter names are restricted to `[A-Za-z0-9._:-]`, so `0xff` can never occur in one
/// and `("a", …)` can never hash the same bytes as `("a\xff…", …)`.
const SHARD_KEY_SEPARATOR: u8 = 0xff;

/// Why a ring could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// More distinct nodes than [`RING_NODES_MAX`].
    #[error("ring has {nodes} nodes; the limit is {max}")]
    TooManyNodes {
        /// Distinct nodes offered.
        nodes: usize,
        /// The limit, [`RING_NODES_MAX`].
        max: usize,
    },
    /// A virtual-node count of zero or above [`VNODES_PER_NODE_MAX`].
    #[error("{vnodes} virtual nodes per node is outside 1..={max}")]
    VnodesOutOfRange {
        /// The count offered.
        vnodes: u32,
        /// The limit, [`VNODES_PER_NODE_MAX`].
        max: u32,
    },
}

/// One point on the ring: a node's virtual node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Point {
    /// Position on the circle.
    position: u64,
    /// Index into [`Ring::nodes`]; second in the ordering, so ties go to the smaller id.
    node: u32,
}

/// A consistent-hash ring over a set of nodes: answers "which node owns this shard"
/// identically on every node that knows the same membership.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ring {
    /// The distinct nodes, sorted; points refer to them by index.
    nodes: Vec<NodeId>,
    /// Every virtual node, sorted by (position, node index).
    points: Vec<Point>,
    /// Virtual nodes per node, kept so two rings built differently compare unequal.
    vnodes_per_node: u32,
}

impl Ring {
    /// Builds the ring for `nodes`, each placed at `vnodes_per_node` points.
    ///
    /// Duplicates are ignored and order does not matter: the ring is a pure function
    /// of the node set. An empty set gives an empty ring, whose lookups answer `None`.
    ///
    /// # Panics
    ///
    /// If the set exceeds [`RING_NODES_MAX`] or `vnodes_per_node` is outside
    /// `1..=`[`VNODES_PER_NODE_MAX`]. Membership is validated before it gets here;
    /// use [`Ring::try_new`] for unvalidated input.
    pub fn new(nodes: impl IntoIterator<Item = NodeId>, vnodes_per_node: u32) -> Self {
        match Self::try_new(nodes, vnodes_per_node) {
            Ok(ring) => ring,
            Err(e) => panic!("invalid ring: {e}"),
        }
    }

    /// Like [`Ring::new`], but refuses out-of-range input with an error.
    pub fn try_new(nodes: impl IntoIterator<Item = NodeId>, vnodes_per_node: u32) -> Result<Self, RingError> {
        if vnodes_per_node == 0 || vnodes_per_node > VNODES_PER_NODE_MAX {
            return Err(RingError::VnodesOutOfRange { vnodes: vnodes_per_node, max: VNODES_PER_NODE_MAX });
        }
        let mut nodes: Vec<NodeId> = nodes.into_iter().collect();
        nodes.sort();
        nodes.dedup();
        if nodes.len() > RING_NODES_MAX {
            return Err(RingError::TooManyNodes { nodes: nodes.len(), max: RING_NODES_MAX });
        }

        let mut points = Vec::with_capacity(nodes.len() * vnodes_per_node as usize);
        let mut key = Vec::new();
        for (index, node) in nodes.iter().enumerate() {
            let node_index = u32::try_from(index).expect("RING_NODES_MAX fits in u32");
            for vnode in 0..vnodes_per_node {
                key.clear();
                key.extend_from_slice(node.as_str().as_bytes());
                key.extend_from_slice(&vnode.to_le_bytes());
                points.push(Point { position: hash64(RING_SEED, &key), node: node_index });
            }
        }
        points.sort_unstable();
        Ok(Self { nodes, points, vnodes_per_node })
    }

    /// The node that owns `shard`, or `None` if the ring is empty.
    pub fn owner(&self, shard: &ShardId) -> Option<&NodeId> {
        self.owner_of_point(shard_point(shard))
    }

    /// The node that owns an arbitrary key (for placing things that are not shards,
    /// such as a counter's rollup), or `None` if the ring is empty.
    pub fn owner_of_key(&self, key: &[u8]) -> Option<&NodeId> {
        self.owner_of_point(hash64(RING_SEED, key))
    }

    /// The distinct nodes on the ring, sorted by id.
    pub fn nodes(&self) -> &[NodeId] {
        &self.nodes
    }

    /// Number of distinct nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when the ring has no node and so cannot place anything.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Virtual nodes per node this ring was built with.
    pub fn vnodes_per_node(&self) -> u32 {
        self.vnodes_per_node
    }

    /// First point clockwise at or after `position`, wrapping past the top.
    fn owner_of_point(&self, position: u64) -> Option<&NodeId> {
        let first = self.points.first()?;
        let at = self.points.partition_point(|p| p.position < position);
        let point = self.points.get(at).unwrap_or(first);
        Some(&self.nodes[point.node as usize])
    }
}

/// A shard's position on the ring: its counter name, a separator, then its
/// generation and index big-endian, hashed with [`RING_SEED`]. The ring's owner and
/// the range directory ([`crate::ranges`]) both place a shard by this point.
pub fn shard_point(shard: &ShardId) -> u64 {
    let name = shard.counter.as_str().as_bytes();
    let mut key = Vec::with_capacity(name.len() + 1 + 4 + 2);
    key.extend_from_slice(name);
    key.push(SHARD_KEY_SEPARATOR);
    key.extend_from_slice(&shard.generation.to_be_bytes());
    key.extend_from_slice(&shard.index.to_be_bytes());
    hash64(RING_SEED, &key)
}

/// The shards among `shards` whose owner differs between `before` and `after`, as
/// `(shard, from, to)` in input order: the handover plan of a membership change.
///
/// A shard without an owner on either side (an empty ring) is not a move: placing
/// shards on a first node, or losing the last one, is not a handover.
pub fn moved<'a>(
    before: &Ring,
    after: &Ring,
    shards: impl IntoIterator<Item = &'a ShardId>,
) -> Vec<(ShardId, NodeId, NodeId)> {
    shards
        .into_iter()
        .filter_map(|shard| {
            let point = shard_point(shard);
            let from = before.owner_of_point(point)?;
            let to = after.owner_of_point(point)?;
            (from != to).then(|| (shard.clone(), from.clone(), to.clone()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::name::CounterName;
    use std::collections::BTreeMap;

    fn node(name: &str) -> NodeId {
        NodeId::new(name)
    }

    fn nodes(n: usize) -> Vec<NodeId> {
        (1..=n).map(|i| node(&format!("node{i}"))).collect()
    }

    /// 100,000 shards: 12,500 counters with 8 shards each, as the default spec makes.
    fn shards() -> Vec<ShardId> {
        (0..12_500)
            .flat_map(|c| {
                let name = CounterName::new(format!("likes:{c}")).unwrap();
                (0..8).map(move |i| ShardId::new(name.clone(), 0, i))
            })
            .collect()
    }

    fn load(ring: &Ring, shards: &[ShardId]) -> BTreeMap<NodeId, usize> {
        let mut load: BTreeMap<NodeId, usize> = ring.nodes().iter().map(|n| (n.clone(), 0)).collect();
        for s in shards {
            *load.get_mut(ring.owner(s).unwrap()).unwrap() += 1;
        }
        load
    }

    /// Largest relative distance of any node's load from the mean.
    fn max_deviation(ring: &Ring, shards: &[ShardId]) -> f64 {
        let load = load(ring, shards);
        let mean = shards.len() as f64 / ring.len() as f64;
        load.values().map(|&l| (l as f64 - mean).abs() / mean).fold(0.0, f64::max)
    }

    /// Bound on a node's distance from the mean load with the default virtual nodes.
    const BALANCE_DEVIATION_MAX: f64 = 0.25;

    #[test]
    fn balance_with_default_vnodes() {
        let shards = shards();
        let ring = Ring::new(nodes(5), VNODES_PER_NODE_DEFAULT);
        let dev = max_deviation(&ring, &shards);
        println!("5 nodes x 128 vnodes, 100k shards: load {:?}", load(&ring, &shards));
        println!("max deviation from mean: {:.1}%", dev * 100.0);
        assert!(dev < BALANCE_DEVIATION_MAX, "deviation {dev}");

        // The bound is meaningful: one point per node is far outside it.
        let broken = Ring::new(nodes(5), 1);
        let broken_dev = max_deviation(&broken, &shards);
        println!("5 nodes x 1 vnode: max deviation {:.1}%", broken_dev * 100.0);
        assert!(broken_dev > BALANCE_DEVIATION_MAX, "1-vnode deviation {broken_dev}");
    }

    #[test]
    fn join_moves_only_to_the_new_node_and_about_one_in_n_plus_one() {
        let shards = shards();
        let before = Ring::new(nodes(5), VNODES_PER_NODE_DEFAULT);
        let after = Ring::new(nodes(6), VNODES_PER_NODE_DEFAULT);
        let plan = moved(&before, &after, &shards);
        let newcomer = node("node6");
        for (shard, from, to) in &plan {
            assert_eq!(to, &newcomer, "{shard} moved {from} -> {to}");
            assert_eq!(before.owner(shard), Some(from));
        }
        let fraction = plan.len() as f64 / shards.len() as f64;
        println!(
            "join 5 -> 6: {} of {} shards moved ({:.1}%, ideal 16.7%)",
            plan.len(),
            shards.len(),
            fraction * 100.0
        );
        let ideal = 1.0 / 6.0;
        assert!((fraction - ideal).abs() < ideal * BALANCE_DEVIATION_MAX, "moved {fraction}");
        // Everything the newcomer owns afterwards came in the plan.
        let owned = shards.iter().filter(|s| after.owner(s) == Some(&newcomer)).count();
        assert_eq!(owned, plan.len());
    }

    #[test]
    fn leave_moves_only_the_leaving_nodes_shards() {
        let shards = shards();
        let before = Ring::new(nodes(5), VNODES_PER_NODE_DEFAULT);
        let leaver = node("node3");
        let after = Ring::new(nodes(5).into_iter().filter(|n| n != &leaver), VNODES_PER_NODE_DEFAULT);
        let plan = moved(&before, &after, &shards);
        for (shard, from, to) in &plan {
            assert_eq!(from, &leaver, "{shard} moved {from} -> {to}");
        }
        let owned_before = shards.iter().filter(|s| before.owner(s) == Some(&leaver)).count();
        assert_eq!(plan.len(), owned_before, "every shard of the leaver moves, nothing else");
        println!(
            "leave 5 -> 4: {} of {} shards moved ({:.1}%, ideal 20%)",
            plan.len(),
            shards.len(),
            plan.len() as f64 * 100.0 / shards.len() as f64
        );
    }

    #[test]
    fn ring_is_a_function_of_the_node_set() {
        let forward = Ring::new(nodes(5), 64);
        let mut shuffled = nodes(5);
        shuffled.reverse();
        shuffled.swap(1, 3);
        shuffled.push(node("node2")); // a duplicate
        let backward = Ring::new(shuffled, 64);
        assert_eq!(forward, backward);
        assert_eq!(forward.len(), 5);
        assert_eq!(forward.nodes(), nodes(5).as_slice());
        for s in shards().iter().take(2_000) {
            assert_eq!(forward.owner(s), backward.owner(s));
        }
        // Different virtual-node counts are different rings.
        assert_ne!(forward, Ring::new(nodes(5), 65));
    }

    #[test]
    fn empty_ring_owns_nothing() {
        let ring = Ring::new(Vec::new(), VNODES_PER_NODE_DEFAULT);
        assert!(ring.is_empty());
        assert_eq!(ring.len(), 0);
        let shard = ShardId::new(CounterName::new("likes:1").unwrap(), 0, 0);
        assert_eq!(ring.owner(&shard), None);
        assert_eq!(ring.owner_of_key(b"anything"), None);
        // Nothing moves into or out of an empty ring.
        let one = Ring::new([node("a")], VNODES_PER_NODE_DEFAULT);
        assert!(moved(&ring, &one, [&shard]).is_empty());
        assert!(moved(&one, &ring, [&shard]).is_empty());
    }

    #[test]
    fn single_node_owns_everything() {
        let ring = Ring::new([node("solo")], 1);
        for s in shards().iter().take(1_000) {
            assert_eq!(ring.owner(s), Some(&node("solo")));
        }
        assert_eq!(ring.owner_of_key(&[0xff; 8]), Some(&node("solo")));
    }

    #[test]
    fn limits_are_refused() {
        assert_eq!(
            Ring::try_new(nodes(2), 0),
            Err(RingError::VnodesOutOfRange { vnodes: 0, max: VNODES_PER_NODE_MAX })
        );
        assert!(Ring::try_new(nodes(2), VNODES_PER_NODE_MAX + 1).is_err());
        assert_eq!(
            Ring::try_new(nodes(RING_NODES_MAX + 1), 1),
            Err(RingError::TooManyNodes { nodes: RING_NODES_MAX + 1, max: RING_NODES_MAX })
        );
        assert!(Ring::try_new(nodes(RING_NODES_MAX), 1).is_ok());
    }

    #[test]
    fn wraps_past_the_top_and_breaks_ties_by_node_id() {
        // Hand-built points: a key beyond the last point belongs to the first one.
        let ring = Ring {
            nodes: vec![node("a"), node("b")],
            points: vec![Point { position: 10, node: 1 }, Point { position: 20, node: 0 }],
            vnodes_per_node: 1,
        };
        assert_eq!(ring.owner_of_point(0), Some(&node("b")));
        assert_eq!(ring.owner_of_point(10), Some(&node("b")));
        assert_eq!(ring.owner_of_point(11), Some(&node("a")));
        assert_eq!(ring.owner_of_point(u64::MAX), Some(&node("b")));
        // Two nodes on one point: sorting puts the smaller id first, and it wins.
        let mut points = vec![Point { position: 5, node: 1 }, Point { position: 5, node: 0 }];
        points.sort_unstable();
        let tie = Ring { nodes: vec![node("a"), node("b")], points, vnodes_per_node: 1 };
        assert_eq!(tie.owner_of_point(5), Some(&node("a")));
    }

    #[test]
    fn owners_are_pinned() {
        // If these change, placement changed: every node would disagree with a node
        // running the previous build. Treat it as a format break.
        let ring = Ring::new(nodes(5), VNODES_PER_NODE_DEFAULT);
        let shard =
            |name: &str, generation, index| ShardId::new(CounterName::new(name).unwrap(), generation, index);
        let got: Vec<String> = [
            shard("likes:42", 0, 0),
            shard("likes:42", 0, 1),
            shard("likes:42", 1, 0),
            shard("views", 0, 7),
            shard("credits:user-9", 3, 1023),
        ]
        .iter()
        .map(|s| ring.owner(s).unwrap().to_string())
        .collect();
        assert_eq!(got, PINNED_OWNERS);
        assert_eq!(shard_point(&shard("likes:42", 0, 0)), PINNED_POINT);
        assert_eq!(ring.owner_of_key(b"rollup:likes:42").unwrap().as_str(), PINNED_KEY_OWNER);
    }

    const PINNED_OWNERS: [&str; 5] = ["node3", "node4", "node3", "node4", "node2"];
    const PINNED_POINT: u64 = 0xf40f_dd98_5d41_70e1;
    const PINNED_KEY_OWNER: &str = "node5";
}
