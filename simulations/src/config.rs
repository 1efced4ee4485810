//! What a run is: its seed, cluster size, fault level and length, the fault rates drawn
//! from the seed, and every timing constant of the modelled shells (named, unit last).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt;
use std::str::FromStr;

/// The build settings under which tier 2 repeats exactly. tokio's generator orders
/// the wakers of a `watch` channel (openraft's metrics) and the branches of an
/// unbiased `select!`; only its unstable API (`Builder::rng_seed`) lets a run seed
/// it. The flag is the simulator's alone: in a production build it would also turn
/// on tokio's per-resource tracing, so it goes to a target directory of its own.
pub const SEEDED_TOKIO_BUILD: &str = "RUSTFLAGS='--cfg tokio_unstable' CARGO_TARGET_DIR=target/sim";

/// Whether this build seeds tokio's generator (see [`SEEDED_TOKIO_BUILD`]).
pub const TOKIO_SEEDED: bool = cfg!(tokio_unstable);

/// Shortest one-way network delay between two endpoints, in simulated milliseconds.
pub const NET_DELAY_MS_MIN: u64 = 1;
/// Longest one-way network delay without injected extra delay.
pub const NET_DELAY_MS_MAX: u64 = 3;
/// A shard commits this long after its first pending submission: the batching point.
pub const COMMIT_DELAY_MS: u64 = 1;
/// How long a group-commit flush takes once it starts (the fsync).
pub const FSYNC_MS: u64 = 2;
/// How often a node's aggregator looks for accumulators whose window has ended.
pub const AGGREGATOR_TICK_MS: u64 = 5;
/// How often a node's rollup looks for cached totals that are due.
pub const ROLLUP_TICK_MS: u64 = 10;
/// How often the control plane drives reshardings and membership changes.
pub const COORD_TICK_MS: u64 = 10;
/// A control-plane request not answered within this is sent again.
pub const COORD_RESEND_MS: u64 = 60;
/// How often a previous member of a membership change runs a hand-off pass while
/// it has not reported nothing left behind.
pub const HANDOFF_TICK_MS: u64 = 20;
/// A hand-off pass stops waiting for its adoption requests after this; the
/// unanswered ones count as left behind and the next pass asks again.
pub const HANDOFF_PASS_TIMEOUT_MS: u64 = 150;
/// An adoption's pull not answered within this is sent again.
pub const ADOPT_RESEND_MS: u64 = 40;
/// A client gives up waiting for an answer after this and retries (same event id).
pub const CLIENT_TIMEOUT_MS: u64 = 200;
/// Attempts a client makes for one increment during the chaos phase.
pub const CLIENT_ATTEMPTS_MAX: u32 = 4;
/// Attempts a client makes to learn an unknown outcome once the cluster has healed.
pub const SETTLE_ATTEMPTS_MAX: u32 = 40;
/// Pause before a client retries after a timeout or an unavailable answer.
pub const CLIENT_BACKOFF_MS: u64 = 10;
/// Longest pause between two operations of one client.
pub const CLIENT_THINK_MS_MAX: u64 = 12;
/// A gateway resends a submission refused by a sealed or moving shard after this.
pub const RESUBMIT_BACKOFF_MS: u64 = 15;
/// Most times a gateway resends one submission to a sealed or moving shard.
pub const GATEWAY_HOPS_MAX: u8 = 12;
/// A node whose flush failed (poisoned) is restarted by its operator after this.
pub const POISON_RESTART_MS: u64 = 250;
/// Time between healing the cluster and the settle phase's first step, so buffered
/// sums drain and transitions finish.
pub const SETTLE_QUIET_MS: u64 = 600;
/// A flush in flight when a node crashes: the part of the batched loss window beyond
/// `flush_ms` (commit, flush start and the fsync itself).
pub const FLUSH_IN_FLIGHT_MS: u64 = COMMIT_DELAY_MS + FSYNC_MS + AGGREGATOR_TICK_MS;
/// Time for a drained sum to reach its shard while the network works (resends under
/// message loss included): part of the batched loss window.
pub const DELIVERY_SLACK_MS: u64 = 1_000;
/// Most increments one simulated run may issue, whatever its length: bounds memory.
pub const OPS_MAX: usize = 200_000;

/// How hard the network and the machines misbehave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultLevel {
    /// Rare faults, short outages.
    Light,
    /// Frequent crashes, partitions, pauses, lossy links and failing fsyncs.
    Heavy,
}

impl FaultLevel {
    /// The command-line word.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultLevel::Light => "light",
            FaultLevel::Heavy => "heavy",
        }
    }
}

impl fmt::Display for FaultLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A fault level that is neither `light` nor `heavy`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("fault level must be light or heavy (got {0:?})")]
pub struct BadFaultLevel(pub String);

impl FromStr for FaultLevel {
    type Err = BadFaultLevel;
    fn from_str(s: &str) -> Result<Self, BadFaultLevel> {
        match s {
            "light" => Ok(FaultLevel::Light),
            "heavy" => Ok(FaultLevel::Heavy),
            other => Err(BadFaultLevel(other.to_owned())),
        }
    }
}

/// Which simulation runs: the runtime-free model of the shells (tier 1), the real
/// engine on a paused-time runtime (tier 2), or whole cluster nodes on it (tier 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Tier {
    /// Tier 1: the core's machines in modelled shells on an event queue.
    #[default]
    Model,
    /// Tier 2: real `tally_engine::Tally` engines, their actors and tasks.
    Engine,
    /// Tier 3: whole `tally_cluster::ClusterNode`s: the engine, the metadata group,
    /// the range groups and the transport's contract, over in-memory networks.
    Cluster,
}

impl Tier {
    /// The command-line word.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Model => "model",
            Tier::Engine => "engine",
            Tier::Cluster => "cluster",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A tier that is not `model`, `engine` or `cluster`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tier must be model, engine or cluster (got {0:?})")]
pub struct BadTier(pub String);

impl FromStr for Tier {
    type Err = BadTier;
    fn from_str(s: &str) -> Result<Self, BadTier> {
        match s {
            "model" => Ok(Tier::Model),
            "engine" => Ok(Tier::Engine),
            "cluster" => Ok(Tier::Cluster),
            other => Err(BadTier(other.to_owned())),
        }
    }
}

/// Everything that determines a run. Two runs with equal configs are identical.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// The seed every random choice derives from.
    pub seed: u64,
    /// Nodes in the cluster (all members at the start).
    pub nodes: u8,
    /// How hard faults hit.
    pub faults: FaultLevel,
    /// Concurrent clients.
    pub clients: u16,
    /// Length of the phase with workload and faults, in simulated milliseconds.
    pub chaos_ms: u64,
    /// Reshardings and membership changes requested during the chaos phase.
    pub transitions: u32,
    /// The planted bug of this run, if any.
    #[cfg(feature = "planted-bugs")]
    pub plant: Option<tally_core::planted::Bug>,
    /// Which simulation runs.
    pub tier: Tier,
    /// Copies of every shard (tier 2): above 1, shards live in range groups
    /// (`tally-replica`) of this many nodes whose voters follow membership changes,
    /// and some crashes lose the node's disk.
    pub replicas: u8,
    /// Whether range groups snapshot often, in small frames (replicated runs):
    /// every [`SMALL_SNAPSHOT_ENTRIES`] entries, keeping
    /// [`SMALL_SNAPSHOT_LOGS_KEPT`] behind, in frames of
    /// [`SMALL_SNAPSHOT_FRAME_BYTES`], so that replicas that fall behind or lose
    /// their disk catch up by snapshots of many frames under the run's faults.
    pub small_snapshots: bool,
    /// Whether range messages are bounded to [`SMALL_MESSAGE_BYTES`] (replicated
    /// runs), and the node-to-node transport to that plus its envelopes, so that a
    /// replica that fell behind is sent appends the bound cuts, and a message that
    /// oversteps it is refused by the transport as too large.
    pub small_messages: bool,
    /// Tier 2: the largest offset of a node's wall clock from true time, in
    /// milliseconds (`None`: the fault level's, [`CLOCK_SKEW_MS_HEAVY`] or none).
    /// Each node starts at an offset drawn within ±this and jumps to another one now
    /// and then ([`CLOCK_JUMPS_PER_S`]), backwards too.
    pub clock_skew_ms: Option<u64>,
    /// Tier 2: whether the run adds `short:0`, a `sync` counter whose dedup window
    /// is [`SHORT_DEDUP_WINDOW_S`], so its records expire, are swept and pruned
    /// from sealed generations within the run (`None`: the fault level's; see
    /// [`SimConfig::short_dedup`]).
    pub short_dedup: Option<bool>,
    /// Tier 3: whether the run adds [`RECREATED_COUNTER`], a `sync` counter under a
    /// namespace that an operator deletes now and then while clients still write
    /// to it, so that it is re-created by their next increment under the same
    /// name, and whether metadata RPCs break off (`connection reset`: the caller
    /// resends at once what may have been served) (`None`: every tier-3 run).
    pub deletions: Option<bool>,
    /// Tier 2: one node embedded as a library is (`Tally::open_parts` with neither
    /// a catalog nor a placement): its metadata in its own store, through the
    /// engine's local catalog, crashed, paused and torn like any other node's.
    pub embedded: bool,
}

/// The counter tier 3 deletes and clients re-create (see [`SimConfig::deletions`]).
pub const RECREATED_COUNTER: &str = "del:0";
/// The namespace it lives under: counters created in it are `sync` with event ids.
pub const RECREATED_NAMESPACE: &str = "del:";
/// Deletions of [`RECREATED_COUNTER`] per simulated second of chaos.
pub const DELETIONS_PER_S: f64 = 4.0;
/// Share of the metadata group's messages whose connection breaks instead of
/// arriving, in runs with deletions (apart from those the links lose or cut).
pub const META_RESET_SHARE: f64 = 0.02;
/// Share of the answers to forwarded metadata proposals that break off in runs with
/// deletions: the leader applied the proposal, and its proposer resends it.
pub const META_PROPOSAL_RESET_SHARE: f64 = 0.5;

/// The dedup window of `short:0`, in seconds: a run lasts many of them.
pub const SHORT_DEDUP_WINDOW_S: u32 = 1;
/// Largest clock skew a run with `short:0` may have, in milliseconds: a record is
/// promised to live its window less the skew between two nodes, and clients retry
/// `short:0`'s increments only within half the window.
pub const SHORT_DEDUP_SKEW_MS_MAX: u64 = 100;
/// Seeds the coin that picks a heavy run's clock fault, apart from the run's own
/// generator.
const CLOCK_COIN_SALT: u64 = 0x05ee_dc01;

/// Largest wall-clock offset of a node in a heavy tier-2 run, in milliseconds:
/// seconds of skew, and jumps. Two nodes' clocks are then at most twice this apart:
/// well under the one-minute windows of the workload, so window reads stay checked
/// but for their last seconds (see `check::standing`), and a window limit's spent
/// headroom never comes back within a run. Minutes are a knob away.
pub const CLOCK_SKEW_MS_HEAVY: u64 = 5_000;
/// Largest wall-clock offset a run may ask for (ten minutes).
pub const CLOCK_SKEW_MS_MAX: u64 = 600_000;
/// Clock jumps per node and simulated second in a run with skewed clocks.
pub const CLOCK_JUMPS_PER_S: f64 = 0.25;

/// Entries between two snapshots of a range group, with small snapshots (the
/// cluster's groups snapshot every 5,000, more than a run writes).
pub const SMALL_SNAPSHOT_ENTRIES: u64 = 10;
/// Entries kept behind a snapshot, with small snapshots.
pub const SMALL_SNAPSHOT_LOGS_KEPT: u64 = 2;
/// Bytes of pairs per snapshot frame, with small snapshots (1 MiB in a cluster).
pub const SMALL_SNAPSHOT_FRAME_BYTES: u64 = 512;
/// Largest range append, with small messages (8 MiB less the envelopes in a
/// cluster): a few of a run's entries (they take up to about 800 bytes), so a
/// replica that falls behind by more is sent appends cut to it.
pub const SMALL_MESSAGE_BYTES: usize = 3 << 10;

/// Most copies of a shard a run may ask for (as the cluster allows).
pub const REPLICAS_MAX: u8 = 5;

/// Clients of a standard run.
pub const STANDARD_CLIENTS: u16 = 12;
/// Chaos phase of a standard run, in simulated milliseconds.
pub const STANDARD_CHAOS_MS: u64 = 4_000;
/// Reshardings and membership changes requested in a standard run.
pub const STANDARD_TRANSITIONS: u32 = 4;

/// Fewest nodes a simulated cluster has: a membership change needs two to remain.
pub const NODES_MIN: u8 = 2;
/// Most nodes a simulated cluster has.
pub const NODES_MAX: u8 = 16;

impl SimConfig {
    /// The standard run the command line uses: 4 s of chaos, 12 clients, 4 transitions.
    pub fn standard(seed: u64, nodes: u8, faults: FaultLevel) -> Self {
        Self {
            seed,
            nodes: nodes.clamp(NODES_MIN, NODES_MAX),
            faults,
            clients: STANDARD_CLIENTS,
            chaos_ms: STANDARD_CHAOS_MS,
            transitions: STANDARD_TRANSITIONS,
            #[cfg(feature = "planted-bugs")]
            plant: None,
            tier: Tier::Model,
            replicas: 1,
            small_snapshots: false,
            small_messages: false,
            clock_skew_ms: None,
            short_dedup: None,
            deletions: None,
            embedded: false,
        }
    }

    /// A shorter run for tests in debug builds: 1.2 s of chaos, 6 clients, 2 transitions.
    pub fn short(seed: u64, nodes: u8, faults: FaultLevel) -> Self {
        Self { clients: 6, chaos_ms: 1_200, transitions: 2, ..Self::standard(seed, nodes, faults) }
    }

    /// The same run with `replicas` copies of every shard (tier 2). Two copies are
    /// refused by a cluster's config and by counters (a pair cannot replace a lost
    /// disk), so two runs as three.
    pub fn replicated(self, replicas: u8) -> Self {
        let replicas = match replicas.clamp(1, REPLICAS_MAX) {
            2 => 3,
            r => r,
        };
        Self { replicas, ..self }
    }

    /// The same run with range groups that snapshot often, in small frames.
    pub fn with_small_snapshots(self) -> Self {
        Self { small_snapshots: true, ..self }
    }

    /// The same run with range messages bounded to [`SMALL_MESSAGE_BYTES`].
    pub fn with_small_messages(self) -> Self {
        Self { small_messages: true, ..self }
    }

    /// The same run with nodes' clocks up to `ms` off true time (tier 2).
    pub fn with_clock_skew(self, ms: u64) -> Self {
        Self { clock_skew_ms: Some(ms.min(CLOCK_SKEW_MS_MAX)), ..self }
    }

    /// The same run with (or without) the short-window counter `short:0` (tier 2).
    pub fn with_short_dedup(self, on: bool) -> Self {
        Self { short_dedup: Some(on), ..self }
    }

    /// Whether a heavy run left to its level draws skewed clocks (half of them, by
    /// a coin of the seed) or, with clocks in sync, the short-window counter: a
    /// record's window is only promised less the skew, which must stay well under
    /// a window that expires within a run.
    fn heavy_run_skews_clocks(&self) -> bool {
        ChaCha8Rng::seed_from_u64(self.seed ^ CLOCK_COIN_SALT).random::<bool>()
    }

    /// The largest offset of a node's clock in this run, in milliseconds (tier 2).
    pub fn skew_ms(&self) -> u64 {
        self.clock_skew_ms.unwrap_or(match self.faults {
            FaultLevel::Light => 0,
            FaultLevel::Heavy if self.short_dedup == Some(true) => 0,
            FaultLevel::Heavy if self.short_dedup.is_none() && !self.heavy_run_skews_clocks() => 0,
            FaultLevel::Heavy => CLOCK_SKEW_MS_HEAVY,
        })
    }

    /// Whether this run adds the short-window counter `short:0` (tier 2): as asked,
    /// or in a heavy run of one copy whose clocks are in sync. With range groups an
    /// attempt answered unavailable may still commit seconds later, after a
    /// failover, so two attempts sent within the window may apply more than a
    /// window apart and both count: a record lives its window from when it is
    /// applied, not from when its increment was sent.
    pub fn short_dedup(&self) -> bool {
        self.short_dedup
            .unwrap_or(self.faults == FaultLevel::Heavy && self.replicas == 1 && self.skew_ms() == 0)
    }

    /// The same run with (or without) deletions and re-creations of
    /// [`RECREATED_COUNTER`] and metadata RPCs that break off (tier 3).
    pub fn with_deletions(self, on: bool) -> Self {
        Self { deletions: Some(on), ..self }
    }

    /// Whether this run deletes and re-creates [`RECREATED_COUNTER`] and breaks
    /// metadata RPCs off: as asked, or in every tier-3 run and every embedded one
    /// (whose local catalog has no RPC to break).
    pub fn deletions(&self) -> bool {
        (self.tier == Tier::Cluster || self.embedded) && self.deletions.unwrap_or(true)
    }

    /// The same run on one embedded engine (tier 2, one node, one copy; see
    /// [`SimConfig::embedded`]).
    pub fn embedded(self) -> Self {
        Self { embedded: true, tier: Tier::Engine, nodes: 1, replicas: 1, ..self }
    }

    /// The range groups' settings of this run's nodes (tiers 2 and 3): the
    /// defaults, small snapshots ([`SimConfig::small_snapshots`]) or small messages
    /// ([`SimConfig::small_messages`]).
    pub fn groups_config(&self) -> tally_replica::GroupsConfig {
        let mut config = tally_replica::GroupsConfig::default();
        if self.small_snapshots {
            config = tally_replica::GroupsConfig {
                snapshot_logs_since_last: SMALL_SNAPSHOT_ENTRIES,
                logs_kept: SMALL_SNAPSHOT_LOGS_KEPT,
                snapshot_chunk_bytes: SMALL_SNAPSHOT_FRAME_BYTES,
                ..config
            };
        }
        if self.small_messages {
            config.message_bytes_max = SMALL_MESSAGE_BYTES;
        }
        config
    }

    /// The same run on another tier.
    pub fn on(self, tier: Tier) -> Self {
        Self { tier, ..self }
    }

    /// The command that replays this run.
    pub fn reproduce_command(&self) -> String {
        let mut cmd = format!(
            "cargo run --release -p tally-sim -- --reproduce {} --nodes {} --faults {}",
            self.seed, self.nodes, self.faults
        );
        #[cfg(feature = "planted-bugs")]
        if let Some(bug) = self.plant {
            cmd = format!(
                "cargo run --release -p tally-sim --features planted-bugs -- --reproduce {} --nodes {} --faults {} --plant {bug}",
                self.seed, self.nodes, self.faults
            );
        }
        if self.tier != Tier::Model {
            // Tier 2 repeats exactly only with tokio's generator seeded (see
            // `SEEDED_TOKIO_BUILD`).
            cmd = format!("{SEEDED_TOKIO_BUILD} {cmd}");
            cmd.push_str(&format!(" --tier {}", self.tier));
        }
        if self.replicas > 1 {
            cmd.push_str(&format!(" --replicas {}", self.replicas));
        }
        if self.small_snapshots {
            cmd.push_str(" --small-snapshots");
        }
        if self.small_messages {
            cmd.push_str(" --small-messages");
        }
        if let Some(ms) = self.clock_skew_ms {
            cmd.push_str(&format!(" --clock-skew-ms {ms}"));
        }
        if let Some(on) = self.short_dedup {
            cmd.push_str(&format!(" --short-dedup {on}"));
        }
        if let Some(on) = self.deletions {
            cmd.push_str(&format!(" --deletions {on}"));
        }
        if self.embedded {
            cmd.push_str(" --embedded");
        }
        if self.clients != STANDARD_CLIENTS
            || self.chaos_ms != STANDARD_CHAOS_MS
            || self.transitions != STANDARD_TRANSITIONS
        {
            cmd.push_str(&format!(
                " --clients {} --chaos-ms {} --transitions {}",
                self.clients, self.chaos_ms, self.transitions
            ));
        }
        cmd
    }
}

/// The fault rates of one run, drawn from its seed within its level's ranges, so
/// runs of one level differ in mix and intensity.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultRates {
    /// Node crashes per simulated second, cluster-wide.
    pub crash_per_s: f64,
    /// How long a crashed node stays down, in milliseconds (min, max).
    pub down_ms: (u64, u64),
    /// Network partitions per simulated second.
    pub partition_per_s: f64,
    /// How long a partition lasts (min, max).
    pub partition_ms: (u64, u64),
    /// Probability that a message is lost.
    pub loss: f64,
    /// Probability that a node-to-node message is delivered twice.
    pub duplicate: f64,
    /// Largest extra delay of a message (uniform), which also reorders messages.
    pub delay_extra_ms_max: u64,
    /// Node pauses (a stopped process, a long GC) per simulated second.
    pub pause_per_s: f64,
    /// How long a pause lasts (min, max).
    pub pause_ms: (u64, u64),
    /// Probability that one flush (fsync) fails, poisoning its node.
    pub fsync_fail: f64,
    /// Metadata leader failovers per simulated second.
    pub meta_outage_per_s: f64,
    /// How long metadata writes are unavailable during a failover (min, max).
    pub meta_outage_ms: (u64, u64),
}

impl FaultRates {
    /// Draws this run's rates.
    pub fn sample(level: FaultLevel, rng: &mut ChaCha8Rng) -> Self {
        let mut r = |lo: f64, hi: f64| lo + (hi - lo) * rng.random::<f64>();
        match level {
            FaultLevel::Light => Self {
                crash_per_s: r(0.0, 0.6),
                down_ms: (30, 300),
                partition_per_s: r(0.0, 0.6),
                partition_ms: (20, 300),
                loss: r(0.0, 0.02),
                duplicate: r(0.0, 0.02),
                delay_extra_ms_max: r(0.0, 10.0) as u64,
                pause_per_s: r(0.0, 0.4),
                pause_ms: (10, 150),
                fsync_fail: r(0.0, 0.002),
                meta_outage_per_s: r(0.0, 0.3),
                meta_outage_ms: (20, 200),
            },
            FaultLevel::Heavy => Self {
                crash_per_s: r(0.8, 3.0),
                down_ms: (20, 500),
                partition_per_s: r(0.8, 3.0),
                partition_ms: (20, 600),
                loss: r(0.02, 0.10),
                duplicate: r(0.01, 0.06),
                delay_extra_ms_max: r(5.0, 60.0) as u64,
                pause_per_s: r(0.3, 1.5),
                pause_ms: (10, 300),
                fsync_fail: r(0.001, 0.01),
                meta_outage_per_s: r(0.2, 1.0),
                meta_outage_ms: (20, 400),
            },
        }
    }
}
