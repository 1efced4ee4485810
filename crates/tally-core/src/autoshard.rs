//! Shard counts that follow contention: when a counter with `shards: "auto"` should
//! be resharded, to how many shards, and why.
//!
//! One [`AutoShardMachine`] per auto counter. The engine samples the counter's own
//! signals every [`Tuning::sample_ms`] — increments routed to each shard, and the
//! deepest queue of increments waiting at one shard for its answer — and feeds them in
//! as a [`Sample`]; the machine answers with [`AutoEffect`]s. It never reads a clock:
//! `now_ms` is an argument.
//!
//! # The rules
//!
//! * **Up.** A sample is *hot* when the busiest shard takes at least
//!   [`Tuning::rate_up_per_shard`] increments per second, or when some shard has at
//!   least [`Tuning::queue_up`] increments waiting at once. After
//!   [`Tuning::hot_samples`] hot samples in a row the machine proposes
//!   `max(shards × UP_FACTOR, what the rate needs)`, at most `max_shards`. The reason
//!   says which signal fired: [`Reason::QueueDepth`], [`Reason::WriteRate`] (the mean
//!   per shard passed the threshold), or [`Reason::HotShard`] (only the busiest did:
//!   the load is skewed).
//! * **Down.** A sample is *quiet* when the mean rate per shard is below
//!   `rate_up_per_shard / DOWN_DIVISOR` and no shard has more than
//!   `queue_up / DOWN_DIVISOR` increments waiting. After [`Tuning::quiet_ms`] of quiet
//!   samples the machine proposes the count the rate needs at half the threshold per
//!   shard, at least `min_shards` ([`Reason::Quiet`]). Between the two thresholds
//!   nothing happens: that band is the hysteresis, and because a lowered counter
//!   carries at most half the up threshold per shard, lowering never makes it hot.
//! * **Lowering is agreed.** In a cluster every node samples the increments *it*
//!   routes, so one node's quiet says nothing of the others. Before lowering, the
//!   machine asks ([`AutoEffect::Confirm`]) for every other node's [`PeerView`]; it
//!   lowers only if each of them has been quiet for the quiet period too, to the
//!   count the summed rate needs ([`AutoInput::Views`]); a busy node drops the
//!   proposal. A single node answers its own question with no views.
//! * **A raise by the summed rate.** What one node routes is a lower bound of the
//!   counter's load, so a node whose own sample is hot raises at once. A node whose
//!   mean rate per shard would be hot if every one of the [`Sample::nodes`] routed as
//!   much (load spread over the nodes) asks the others after the same streak, and
//!   raises if their summed rate is hot ([`Reason::WriteRate`]).
//! * **Interval.** At most one proposal per counter per [`Tuning::change_interval_ms`]
//!   (a refused one counts, and so does a change seen made by someone else: another
//!   node or a hand). Only a change of the bounds themselves
//!   ([`Reason::Bounds`], a shard count outside `min_shards..=max_shards`) is proposed
//!   at once: the operator asked for it.
//! * **One at a time.** While a proposal is outstanding, or any resharding is in
//!   progress, nothing else is proposed. A sample that shows the proposed count with no
//!   resharding in progress completes the proposal ([`AutoEffect::Changed`]); one that
//!   shows another count without a resharding means someone else changed it, and the
//!   machine follows. [`AutoInput::Refused`] drops a proposal the metadata refused.

use crate::spec::AutoShards;
use serde::{Deserialize, Serialize};

/// A raise multiplies the shard count by at least this.
pub const UP_FACTOR: u16 = 2;
/// The quiet thresholds are the hot ones divided by this: the hysteresis band.
pub const DOWN_DIVISOR: u64 = 4;

/// Default [`Tuning::sample_ms`].
pub const SAMPLE_MS_DEFAULT: u64 = 1_000;
/// Shortest [`Tuning::sample_ms`].
pub const SAMPLE_MS_MIN: u64 = 10;
/// Longest [`Tuning::sample_ms`].
pub const SAMPLE_MS_MAX: u64 = 60_000;
/// Default [`Tuning::change_interval_ms`].
pub const CHANGE_INTERVAL_MS_DEFAULT: u64 = 5_000;
/// Longest [`Tuning::change_interval_ms`] (one hour); the shortest is `sample_ms`.
pub const CHANGE_INTERVAL_MS_MAX: u64 = 3_600_000;
/// Default [`Tuning::quiet_ms`].
pub const QUIET_MS_DEFAULT: u64 = 30_000;
/// Longest [`Tuning::quiet_ms`] (one day).
pub const QUIET_MS_MAX: u64 = 86_400_000;
/// Default [`Tuning::hot_samples`].
pub const HOT_SAMPLES_DEFAULT: u32 = 2;
/// Most [`Tuning::hot_samples`].
pub const HOT_SAMPLES_MAX: u32 = 100;
/// Default [`Tuning::rate_up_per_shard`], increments per second.
pub const RATE_UP_PER_SHARD_DEFAULT: u64 = 20_000;
/// Smallest [`Tuning::rate_up_per_shard`]: below `DOWN_DIVISOR` the quiet threshold
/// would be zero.
pub const RATE_UP_PER_SHARD_MIN: u64 = DOWN_DIVISOR;
/// Largest [`Tuning::rate_up_per_shard`].
pub const RATE_UP_PER_SHARD_MAX: u64 = 100_000_000;
/// Default [`Tuning::queue_up`], increments waiting at one shard.
pub const QUEUE_UP_DEFAULT: u32 = 8;
/// Smallest [`Tuning::queue_up`]: one waiting increment is a single writer, not
/// contention.
pub const QUEUE_UP_MIN: u32 = 2;
/// Largest [`Tuning::queue_up`].
pub const QUEUE_UP_MAX: u32 = 65_536;

/// The thresholds and timers of every auto counter on a node (node configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// How often the engine samples each auto counter, in milliseconds.
    pub sample_ms: u64,
    /// At most one proposed change per counter in this many milliseconds.
    pub change_interval_ms: u64,
    /// How long a counter must stay quiet before its shard count is lowered.
    pub quiet_ms: u64,
    /// Consecutive hot samples before the shard count is raised.
    pub hot_samples: u32,
    /// Increments per second at one shard that make a sample hot.
    pub rate_up_per_shard: u64,
    /// Increments waiting at one shard at once that make a sample hot.
    pub queue_up: u32,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            sample_ms: SAMPLE_MS_DEFAULT,
            change_interval_ms: CHANGE_INTERVAL_MS_DEFAULT,
            quiet_ms: QUIET_MS_DEFAULT,
            hot_samples: HOT_SAMPLES_DEFAULT,
            rate_up_per_shard: RATE_UP_PER_SHARD_DEFAULT,
            queue_up: QUEUE_UP_DEFAULT,
        }
    }
}

/// A tuning value outside its bounds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("autoshard.{field} must be between {min} and {max} (got {got})")]
pub struct TuningError {
    /// The field.
    pub field: &'static str,
    /// Smallest allowed.
    pub min: u64,
    /// Largest allowed.
    pub max: u64,
    /// What was given.
    pub got: u64,
}

fn bound(field: &'static str, got: u64, min: u64, max: u64) -> Result<(), TuningError> {
    if got < min || got > max {
        return Err(TuningError { field, min, max, got });
    }
    Ok(())
}

impl Tuning {
    /// Checks every field against its bounds.
    pub fn validate(&self) -> Result<(), TuningError> {
        bound("sample_ms", self.sample_ms, SAMPLE_MS_MIN, SAMPLE_MS_MAX)?;
        bound("change_interval_ms", self.change_interval_ms, self.sample_ms, CHANGE_INTERVAL_MS_MAX)?;
        bound("quiet_ms", self.quiet_ms, 0, QUIET_MS_MAX)?;
        bound("hot_samples", self.hot_samples.into(), 1, HOT_SAMPLES_MAX.into())?;
        bound("rate_up_per_shard", self.rate_up_per_shard, RATE_UP_PER_SHARD_MIN, RATE_UP_PER_SHARD_MAX)?;
        bound("queue_up", self.queue_up.into(), QUEUE_UP_MIN.into(), QUEUE_UP_MAX.into())?;
        Ok(())
    }

    /// The mean rate per shard below which a sample may be quiet.
    pub fn rate_down_per_shard(&self) -> u64 {
        self.rate_up_per_shard / DOWN_DIVISOR
    }

    /// The deepest queue a quiet sample may show.
    pub fn queue_down(&self) -> u32 {
        self.queue_up / DOWN_DIVISOR as u32
    }
}

/// What the engine measured of one counter since its previous sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sample {
    /// The shard count of the layout taking writes.
    pub shards: u16,
    /// Whether a resharding (anyone's) is in progress.
    pub resharding: bool,
    /// Milliseconds the sample covers.
    pub elapsed_ms: u64,
    /// Increments routed to the counter's shards in that time, on this node.
    pub writes: u64,
    /// Of those, the most routed to one shard.
    pub hottest_writes: u64,
    /// The most increments that waited at one shard at once.
    pub queue_depth_max: u32,
    /// How many nodes route increments to the counter, this one included (1 on a
    /// single node; 0 is taken as 1).
    pub nodes: u16,
}

/// A sample's contention figures, as reported.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Figures {
    /// Mean increments per second per shard.
    pub rate_per_shard: u64,
    /// Increments per second at the busiest shard.
    pub rate_hottest: u64,
    /// Busiest shard's rate ÷ the mean (1.0 = even; 0 when idle).
    pub skew: f64,
    /// The most increments that waited at one shard at once.
    pub queue_depth_max: u32,
    /// Increments per second over all shards.
    pub rate_total: u64,
}

impl Figures {
    fn of(s: &Sample) -> Self {
        let per_s = |n: u64| n.saturating_mul(1000) / s.elapsed_ms.max(1);
        let rate_total = per_s(s.writes);
        let rate_per_shard = rate_total / u64::from(s.shards.max(1));
        let rate_hottest = per_s(s.hottest_writes);
        let skew = if s.writes == 0 {
            0.0
        } else {
            s.hottest_writes as f64 * f64::from(s.shards.max(1)) / s.writes as f64
        };
        Self { rate_per_shard, rate_hottest, skew, queue_depth_max: s.queue_depth_max, rate_total }
    }
}

/// Why a change was proposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Increments queued at a shard.
    QueueDepth,
    /// The mean rate per shard passed the threshold.
    WriteRate,
    /// Only the busiest shard passed it: the load is skewed.
    HotShard,
    /// The counter stayed quiet for the quiet period.
    Quiet,
    /// The shard count was outside the counter's bounds.
    Bounds,
}

impl Reason {
    /// Every reason, for metrics (a bounded label set).
    pub const ALL: [Reason; 5] =
        [Self::QueueDepth, Self::WriteRate, Self::HotShard, Self::Quiet, Self::Bounds];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::QueueDepth => "queue_depth",
            Self::WriteRate => "write_rate",
            Self::HotShard => "hot_shard",
            Self::Quiet => "quiet",
            Self::Bounds => "bounds",
        }
    }
}

/// A proposed or completed change of the shard count.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Change {
    /// The count before.
    pub from: u16,
    /// The count proposed.
    pub to: u16,
    /// Why.
    pub reason: Reason,
    /// When it was proposed, in milliseconds since the Unix epoch.
    pub proposed_at_ms: u64,
    /// When it was seen complete (`None` while proposed).
    pub completed_at_ms: Option<u64>,
    /// The figures of the sample that decided it.
    pub figures: Figures,
}

impl Change {
    /// Whether it raised the count.
    pub fn is_up(&self) -> bool {
        self.to > self.from
    }
}

/// What happened to an auto counter.
#[derive(Debug, Clone, PartialEq)]
pub enum AutoInput {
    /// A fresh sample of its signals.
    Sample(Sample),
    /// Its bounds changed (the counter stays auto).
    Bounds(AutoShards),
    /// The metadata refused the outstanding proposal (a resharding already in
    /// progress, too many sealed generations, the counter changed meanwhile, a store
    /// error).
    Refused {
        /// Why, as the metadata said it.
        reason: String,
    },
    /// The other nodes' views, asked for by [`AutoEffect::Confirm`]: one per node
    /// that answered (a node that cannot be reached routes nothing this node could
    /// count, and is left out).
    Views(Vec<NodeView>),
}

/// What one node has seen of an auto counter: its answer to another node that is
/// about to lower the counter's shard count (or reporting the last change).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct PeerView {
    /// The shard count the node's machine last saw.
    pub shards: u16,
    /// How long its own samples have been quiet, in milliseconds (0: not quiet).
    pub quiet_for_ms: u64,
    /// Increments per second it routed to the counter in its latest sample.
    pub rate_total: u64,
    /// The last change it decided and saw complete.
    pub last_change: Option<Change>,
}

/// One node's answer to [`AutoEffect::Confirm`].
#[derive(Debug, Clone, PartialEq)]
pub struct NodeView {
    /// The node.
    pub node: String,
    /// Its view; `None` when it does not follow the counter (yet).
    pub view: Option<PeerView>,
}

/// What the engine must do.
#[derive(Debug, Clone, PartialEq)]
pub enum AutoEffect {
    /// Reshard the counter from `change.from` to `change.to` shards through the
    /// ordinary resharding, unless its layout moved meanwhile; answer
    /// [`AutoInput::Refused`] if that is refused.
    Propose(Change),
    /// Before proposing `change` (a lowering), ask every other node for its
    /// [`PeerView`] and answer with [`AutoInput::Views`] (no views on a single node).
    Confirm(Change),
    /// The proposal completed (count it, log it).
    Changed(Change),
    /// The outstanding proposal was dropped: refused, or the count changed otherwise.
    Dropped {
        /// The proposal.
        change: Change,
        /// Why it did not happen.
        reason: String,
    },
}

/// A proposal that did not happen, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DroppedChange {
    /// The proposal.
    pub change: Change,
    /// Why it did not happen.
    pub reason: String,
}

/// What `GET …/shards` shows of an auto counter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AutoStatus {
    /// The bounds.
    pub bounds: AutoShards,
    /// The last completed change.
    pub last_change: Option<Change>,
    /// The proposal outstanding.
    pub pending: Option<Change>,
    /// The last proposal that did not happen, and why.
    pub last_dropped: Option<DroppedChange>,
    /// The latest sample's figures.
    pub figures: Option<Figures>,
}

/// The decision state of one auto counter.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoShardMachine {
    tuning: Tuning,
    bounds: AutoShards,
    /// The shard count last seen.
    shards: u16,
    hot_streak: u32,
    /// Samples in a row that would be hot if every node routed as much as this one.
    warm_streak: u32,
    quiet_since_ms: Option<u64>,
    last_proposal_ms: Option<u64>,
    pending: Option<Change>,
    /// A lowering waiting for the other nodes' views.
    confirming: Option<Change>,
    last_change: Option<Change>,
    last_dropped: Option<DroppedChange>,
    figures: Option<Figures>,
}

impl AutoShardMachine {
    /// The machine of a counter with `bounds` and `shards` shards now.
    pub fn new(tuning: Tuning, bounds: AutoShards, shards: u16) -> Self {
        Self {
            tuning,
            bounds,
            shards,
            hot_streak: 0,
            warm_streak: 0,
            quiet_since_ms: None,
            last_proposal_ms: None,
            pending: None,
            confirming: None,
            last_change: None,
            last_dropped: None,
            figures: None,
        }
    }

    /// What is known, for reports.
    pub fn status(&self) -> AutoStatus {
        AutoStatus {
            bounds: self.bounds,
            last_change: self.last_change,
            pending: self.pending,
            last_dropped: self.last_dropped.clone(),
            figures: self.figures,
        }
    }

    /// The bounds it keeps the count within.
    pub fn bounds(&self) -> AutoShards {
        self.bounds
    }

    /// What this node has seen, for another node about to lower the count.
    pub fn view(&self, now_ms: u64) -> PeerView {
        PeerView {
            shards: self.shards,
            quiet_for_ms: self.quiet_since_ms.map_or(0, |since| now_ms.saturating_sub(since)),
            rate_total: self.figures.map_or(0, |f| f.rate_total),
            last_change: self.last_change,
        }
    }

    /// Takes one input at `now_ms`; returns what to do.
    pub fn step(&mut self, now_ms: u64, input: AutoInput) -> Vec<AutoEffect> {
        let effects = match input {
            AutoInput::Sample(s) => self.sample(now_ms, s),
            AutoInput::Views(views) => self.views(now_ms, views),
            AutoInput::Bounds(b) => {
                self.bounds = b;
                self.confirming = None;
                self.forget_streaks();
                match self.pending {
                    Some(_) => Vec::new(),
                    None => self.clamp(now_ms, None),
                }
            }
            AutoInput::Refused { reason } => match self.pending.take() {
                Some(change) => self.dropped(change, reason),
                None => Vec::new(),
            },
        };
        self.check();
        effects
    }

    fn check(&self) {
        assert!(self.bounds.min_shards <= self.bounds.max_shards, "auto bounds inverted: {:?}", self.bounds);
        assert!(
            self.pending.is_none() || self.confirming.is_none(),
            "a proposal is either confirmed or outstanding: {:?} {:?}",
            self.pending,
            self.confirming
        );
        if let Some(c) = &self.confirming {
            assert!(
                (c.to < c.from && c.reason == Reason::Quiet)
                    || (c.to > c.from && c.reason == Reason::WriteRate),
                "a lowering, or a raise by the summed rate, is confirmed: {c:?}"
            );
        }
        if let Some(p) = &self.pending {
            assert!(p.from != p.to, "a proposal changes the count: {p:?}");
            assert!(
                p.reason == Reason::Bounds
                    || (self.bounds.min_shards..=self.bounds.max_shards).contains(&p.to),
                "a proposal stays within the bounds: {p:?} {:?}",
                self.bounds
            );
        }
    }

    fn forget_streaks(&mut self) {
        self.hot_streak = 0;
        self.warm_streak = 0;
        self.quiet_since_ms = None;
    }

    fn interval_passed(&self, now_ms: u64) -> bool {
        self.last_proposal_ms.is_none_or(|t| now_ms.saturating_sub(t) >= self.tuning.change_interval_ms)
    }

    /// A change from the count seen now to `to`, decided at `now_ms`.
    fn change(&self, now_ms: u64, to: u16, reason: Reason, figures: Figures) -> Change {
        Change { from: self.shards, to, reason, proposed_at_ms: now_ms, completed_at_ms: None, figures }
    }

    /// `change` did not happen: remember why and say so.
    fn dropped(&mut self, change: Change, reason: String) -> Vec<AutoEffect> {
        self.last_dropped = Some(DroppedChange { change, reason: reason.clone() });
        vec![AutoEffect::Dropped { change, reason }]
    }

    fn propose(&mut self, now_ms: u64, to: u16, reason: Reason, figures: Figures) -> Vec<AutoEffect> {
        let change = self.change(now_ms, to, reason, figures);
        self.pending = Some(change);
        self.last_proposal_ms = Some(now_ms);
        self.forget_streaks();
        vec![AutoEffect::Propose(change)]
    }

    /// A proposal back into the bounds if the count is outside them.
    fn clamp(&mut self, now_ms: u64, figures: Option<Figures>) -> Vec<AutoEffect> {
        let to = self.shards.clamp(self.bounds.min_shards, self.bounds.max_shards);
        if to == self.shards {
            return Vec::new();
        }
        self.propose(now_ms, to, Reason::Bounds, figures.unwrap_or_default())
    }

    /// The shard count that keeps `rate_total` at half the hot threshold per shard.
    fn needed(&self, rate_total: u64) -> u64 {
        rate_total.div_ceil((self.tuning.rate_up_per_shard / 2).max(1))
    }

    /// Asks the other nodes before a change decided from this node's view alone
    /// (`to` is provisional: the answer decides it). Asking counts as a proposal for
    /// the interval.
    fn confirm(&mut self, now_ms: u64, to: u16, reason: Reason, figures: Figures) -> Vec<AutoEffect> {
        let change = self.change(now_ms, to, reason, figures);
        self.confirming = Some(change);
        self.last_proposal_ms = Some(now_ms);
        vec![AutoEffect::Confirm(change)]
    }

    /// The answers to a raise asked from this node's view: raise if the rates of
    /// every node that answered add up to a hot one.
    fn raise_if_hot_together(&mut self, now_ms: u64, asked: Change, views: &[NodeView]) -> Vec<AutoEffect> {
        if let Some(v) = views.iter().find(|v| v.view.is_some_and(|p| p.shards != asked.from)) {
            return self.dropped(asked, format!("node {} sees another shard count", v.node));
        }
        let figures = summed(&asked, views);
        if figures.rate_per_shard < self.tuning.rate_up_per_shard {
            let reason = format!("the nodes together route {} increments/s: not hot", figures.rate_total);
            return self.dropped(asked, reason);
        }
        let to = self.raised(figures.rate_total);
        self.propose(now_ms, to, Reason::WriteRate, figures)
    }

    /// The count a hot counter at `rate_total` is raised to: at least doubled, and
    /// what the rate needs, at most `max_shards`.
    fn raised(&self, rate_total: u64) -> u16 {
        let doubled = u64::from(self.shards) * u64::from(UP_FACTOR);
        doubled.max(self.needed(rate_total)).min(self.bounds.max_shards.into()) as u16
    }

    /// The count a quiet counter at `rate_total` is lowered to.
    fn lowered(&self, rate_total: u64) -> u16 {
        self.needed(rate_total).clamp(self.bounds.min_shards.into(), u64::from(self.shards) - 1) as u16
    }

    /// The other nodes answered the confirmation of a lowering or of a raise.
    fn views(&mut self, now_ms: u64, views: Vec<NodeView>) -> Vec<AutoEffect> {
        let Some(asked) = self.confirming.take() else { return Vec::new() };
        if asked.to > asked.from {
            return self.raise_if_hot_together(now_ms, asked, &views);
        }
        let busy = views.iter().find_map(|v| match v.view {
            None => Some(format!("node {} does not follow the counter yet", v.node)),
            Some(p) if p.shards != asked.from => Some(format!("node {} sees {} shards", v.node, p.shards)),
            Some(p) if p.quiet_for_ms < self.tuning.quiet_ms => {
                Some(format!("node {} is not quiet ({} increments/s)", v.node, p.rate_total))
            }
            Some(_) => None,
        });
        if let Some(reason) = busy {
            return self.dropped(asked, reason);
        }
        // Every node is quiet: lower to what their summed rate needs, if that is less.
        let figures = summed(&asked, &views);
        if self.needed(figures.rate_total) >= u64::from(asked.from) {
            return self
                .dropped(asked, format!("the nodes together route {} increments/s", figures.rate_total));
        }
        let to = self.lowered(figures.rate_total);
        self.propose(now_ms, to, Reason::Quiet, figures)
    }

    fn sample(&mut self, now_ms: u64, s: Sample) -> Vec<AutoEffect> {
        let mut effects = Vec::new();
        if let Some(p) = self.pending {
            if s.resharding {
                return effects;
            }
            self.pending = None;
            if s.shards == p.to {
                let done = Change { completed_at_ms: Some(now_ms), ..p };
                self.last_change = Some(done);
                effects.push(AutoEffect::Changed(done));
            } else {
                let reason = format!("the counter has {} shards, not the {} proposed", s.shards, p.to);
                effects.extend(self.dropped(p, reason));
            }
            self.shards = s.shards;
            // The sample covers the old layout: start measuring afresh.
            return effects;
        }
        if let Some(c) = self.confirming {
            if !s.resharding && s.shards == c.from {
                // Still asking the other nodes: this sample decides nothing.
                return effects;
            }
            self.confirming = None;
        }
        if s.resharding || s.shards != self.shards {
            // Someone else is changing (or changed) the layout: follow it. Their change
            // counts for the interval (another node's machine, or a hand), so the
            // counter changes at most once per interval whoever decides.
            self.shards = s.shards;
            self.last_proposal_ms = Some(now_ms);
            self.forget_streaks();
            return effects;
        }
        if s.elapsed_ms == 0 || s.shards == 0 {
            return effects;
        }
        let f = Figures::of(&s);
        self.figures = Some(f);
        let out_of_bounds = self.clamp(now_ms, Some(f));
        if !out_of_bounds.is_empty() {
            return out_of_bounds;
        }
        let t = self.tuning;
        let hot = if s.queue_depth_max >= t.queue_up {
            Some(Reason::QueueDepth)
        } else if f.rate_per_shard >= t.rate_up_per_shard {
            Some(Reason::WriteRate)
        } else if f.rate_hottest >= t.rate_up_per_shard {
            Some(Reason::HotShard)
        } else {
            None
        };
        // Hot only if the other nodes route as much: worth asking them.
        let nodes = u64::from(s.nodes.max(1));
        let warm =
            hot.is_none() && nodes > 1 && f.rate_per_shard.saturating_mul(nodes) >= t.rate_up_per_shard;
        if warm {
            self.quiet_since_ms = None;
            self.hot_streak = 0;
            self.warm_streak = self.warm_streak.saturating_add(1);
            if self.warm_streak >= t.hot_samples
                && self.shards < self.bounds.max_shards
                && self.interval_passed(now_ms)
            {
                self.warm_streak = 0;
                return self.confirm(now_ms, self.shards.saturating_add(1), Reason::WriteRate, f);
            }
            return effects;
        }
        self.warm_streak = 0;
        let quiet = f.rate_per_shard < t.rate_down_per_shard() && s.queue_depth_max <= t.queue_down();
        match hot {
            Some(reason) => {
                self.quiet_since_ms = None;
                self.hot_streak = self.hot_streak.saturating_add(1);
                if self.hot_streak >= t.hot_samples
                    && self.shards < self.bounds.max_shards
                    && self.interval_passed(now_ms)
                {
                    let to = self.raised(f.rate_total);
                    return self.propose(now_ms, to, reason, f);
                }
            }
            None if quiet => {
                self.hot_streak = 0;
                let since = *self.quiet_since_ms.get_or_insert(now_ms);
                if now_ms.saturating_sub(since) >= t.quiet_ms
                    && self.shards > self.bounds.min_shards
                    && self.interval_passed(now_ms)
                {
                    // The quiet streak goes on, so a lowering the others refuse is
                    // asked again after the interval.
                    return self.confirm(now_ms, self.lowered(f.rate_total), Reason::Quiet, f);
                }
            }
            None => self.forget_streaks(),
        }
        effects
    }
}

/// The figures of `asked` with the rates of every node that answered added in.
fn summed(asked: &Change, views: &[NodeView]) -> Figures {
    let rate_total = views
        .iter()
        .filter_map(|v| v.view)
        .fold(asked.figures.rate_total, |sum, p| sum.saturating_add(p.rate_total));
    Figures { rate_total, rate_per_shard: rate_total / u64::from(asked.from.max(1)), ..asked.figures }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Tuning = Tuning {
        sample_ms: 100,
        change_interval_ms: 1_000,
        quiet_ms: 3_000,
        hot_samples: 2,
        rate_up_per_shard: 1_000,
        queue_up: 8,
    };
    const B: AutoShards = AutoShards { min_shards: 1, max_shards: 64 };

    /// A 100 ms sample over `shards` shards with `writes` spread evenly.
    fn even(shards: u16, writes: u64, queue: u32) -> AutoInput {
        AutoInput::Sample(Sample {
            shards,
            resharding: false,
            elapsed_ms: 100,
            writes,
            hottest_writes: writes / u64::from(shards),
            queue_depth_max: queue,
            nodes: 1,
        })
    }

    /// One step of a machine that is the only node: a confirmation is answered at
    /// once with no views.
    fn alone(m: &mut AutoShardMachine, now_ms: u64, input: AutoInput) -> Vec<AutoEffect> {
        let effects = m.step(now_ms, input);
        match effects.as_slice() {
            [AutoEffect::Confirm(_)] => m.step(now_ms, AutoInput::Views(Vec::new())),
            _ => effects,
        }
    }

    fn proposal(effects: &[AutoEffect]) -> Option<(u16, u16, Reason)> {
        match effects {
            [AutoEffect::Propose(c)] => Some((c.from, c.to, c.reason)),
            [] => None,
            other => panic!("unexpected effects {other:?}"),
        }
    }

    #[test]
    fn tuning_bounds_are_checked() {
        assert_eq!(Tuning::default().validate(), Ok(()));
        assert_eq!(T.validate(), Ok(()));
        let bad = Tuning { sample_ms: 5, ..T };
        assert_eq!(bad.validate().unwrap_err().field, "sample_ms");
        let bad = Tuning { change_interval_ms: 50, ..T };
        assert_eq!(
            bad.validate().unwrap_err(),
            TuningError { field: "change_interval_ms", min: 100, max: CHANGE_INTERVAL_MS_MAX, got: 50 }
        );
        assert_eq!(Tuning { queue_up: 1, ..T }.validate().unwrap_err().field, "queue_up");
        assert_eq!(Tuning { hot_samples: 0, ..T }.validate().unwrap_err().field, "hot_samples");
        assert_eq!(Tuning { rate_up_per_shard: 3, ..T }.validate().unwrap_err().field, "rate_up_per_shard");
    }

    #[test]
    fn a_queue_raises_after_the_hot_streak_and_doubles() {
        let mut m = AutoShardMachine::new(T, B, 1);
        // One hot sample is not enough (hysteresis in time).
        assert_eq!(proposal(&alone(&mut m, 0, even(1, 10, 8))), None);
        let e = alone(&mut m, 100, even(1, 10, 8));
        assert_eq!(proposal(&e), Some((1, 2, Reason::QueueDepth)));
        let AutoEffect::Propose(c) = &e[0] else { unreachable!() };
        assert_eq!(c.proposed_at_ms, 100);
        assert_eq!(c.figures.queue_depth_max, 8);
        assert_eq!(c.figures.rate_total, 100);
        // Outstanding while the resharding runs: nothing else, however hot.
        let busy = Sample {
            shards: 1,
            resharding: true,
            elapsed_ms: 100,
            writes: 10,
            hottest_writes: 10,
            queue_depth_max: 50,
            nodes: 1,
        };
        assert_eq!(proposal(&alone(&mut m, 200, AutoInput::Sample(busy))), None);
        assert_eq!(m.status().pending.map(|c| c.to), Some(2));
    }

    #[test]
    fn a_hot_streak_is_broken_by_one_calm_sample() {
        let mut m = AutoShardMachine::new(T, B, 1);
        assert_eq!(proposal(&alone(&mut m, 0, even(1, 10, 8))), None);
        assert_eq!(proposal(&alone(&mut m, 100, even(1, 10, 4))), None);
        assert_eq!(proposal(&alone(&mut m, 200, even(1, 10, 8))), None);
        assert_eq!(proposal(&alone(&mut m, 300, even(1, 10, 8))), Some((1, 2, Reason::QueueDepth)));
    }

    #[test]
    fn the_rate_sets_a_raise_beyond_doubling_up_to_max() {
        let mut m = AutoShardMachine::new(T, AutoShards { min_shards: 2, max_shards: 16 }, 2);
        // 1,000 increments in 100 ms = 10,000/s over 2 shards: 5,000/s each. Needed at
        // 500/s per shard: 20 shards, clamped to 16.
        alone(&mut m, 0, even(2, 1_000, 0));
        assert_eq!(proposal(&alone(&mut m, 100, even(2, 1_000, 0))), Some((2, 16, Reason::WriteRate)));
    }

    #[test]
    fn one_hot_shard_raises_with_its_own_reason() {
        let mut m = AutoShardMachine::new(T, B, 4);
        // 120 writes in 100 ms, 110 of them to one shard: mean 300/s, hottest 1,100/s.
        let skewed = AutoInput::Sample(Sample {
            shards: 4,
            resharding: false,
            elapsed_ms: 100,
            writes: 120,
            hottest_writes: 110,
            queue_depth_max: 1,
            nodes: 1,
        });
        alone(&mut m, 0, skewed.clone());
        assert_eq!(proposal(&alone(&mut m, 100, skewed)), Some((4, 8, Reason::HotShard)));
        let f = m.status().pending.unwrap().figures;
        assert_eq!((f.rate_per_shard, f.rate_hottest), (300, 1_100));
        assert!((f.skew - 110.0 * 4.0 / 120.0).abs() < 1e-9);
    }

    #[test]
    fn completion_is_seen_in_a_sample_and_recorded() {
        let mut m = AutoShardMachine::new(T, B, 1);
        alone(&mut m, 0, even(1, 0, 9));
        alone(&mut m, 100, even(1, 0, 9));
        // The resharding is under way: wait.
        let busy = AutoInput::Sample(Sample { shards: 1, resharding: true, ..Default::default() });
        assert_eq!(alone(&mut m, 200, busy), vec![]);
        let e = alone(&mut m, 300, even(2, 0, 9));
        let [AutoEffect::Changed(c)] = e.as_slice() else { panic!("{e:?}") };
        assert_eq!(
            (c.from, c.to, c.reason, c.proposed_at_ms, c.completed_at_ms),
            (1, 2, Reason::QueueDepth, 100, Some(300))
        );
        assert_eq!(m.status().last_change, Some(*c));
        assert_eq!(m.status().pending, None);
    }

    #[test]
    fn at_most_one_proposal_per_interval() {
        let mut m = AutoShardMachine::new(T, B, 1);
        alone(&mut m, 0, even(1, 0, 9));
        assert!(proposal(&alone(&mut m, 100, even(1, 0, 9))).is_some());
        alone(&mut m, 200, even(2, 0, 9)); // completed at 2
                                           // Hot again at once: the streak builds, but the interval (1,000 ms from the
                                           // proposal at 100) holds it back until 1,100.
        for t in [300, 400, 500, 1_000, 1_099] {
            assert_eq!(proposal(&alone(&mut m, t, even(2, 0, 9))), None, "at {t}");
        }
        assert_eq!(proposal(&alone(&mut m, 1_100, even(2, 0, 9))), Some((2, 4, Reason::QueueDepth)));
    }

    #[test]
    fn never_beyond_max_and_never_below_min() {
        let mut m = AutoShardMachine::new(T, AutoShards { min_shards: 2, max_shards: 4 }, 4);
        for t in 0..30 {
            assert_eq!(proposal(&alone(&mut m, t * 100, even(4, 0, 100))), None, "at max already");
        }
        let mut m = AutoShardMachine::new(T, AutoShards { min_shards: 2, max_shards: 4 }, 2);
        for t in 0..100 {
            assert_eq!(proposal(&alone(&mut m, t * 100, even(2, 0, 0))), None, "at min already");
        }
    }

    #[test]
    fn quiet_lowers_after_the_quiet_period_to_what_the_rate_needs() {
        let mut m = AutoShardMachine::new(T, AutoShards { min_shards: 2, max_shards: 64 }, 32);
        // 20 increments per 100 ms = 200/s: below the quiet threshold (250/s per
        // shard), and needs 1 shard at 500/s: the minimum, 2, decides.
        for t in (0..3_000).step_by(100) {
            assert_eq!(proposal(&alone(&mut m, t, even(32, 20, 1))), None, "at {t}");
        }
        assert_eq!(proposal(&alone(&mut m, 3_000, even(32, 20, 1))), Some((32, 2, Reason::Quiet)));
    }

    #[test]
    fn quiet_lowers_only_as_far_as_the_rate_allows() {
        let mut m = AutoShardMachine::new(T, B, 64);
        // 6,000/s over 64 shards = 93/s each (quiet), but it needs 12 shards at 500/s.
        for t in (0..3_000).step_by(100) {
            alone(&mut m, t, even(64, 600, 0));
        }
        assert_eq!(proposal(&alone(&mut m, 3_000, even(64, 600, 0))), Some((64, 12, Reason::Quiet)));
    }

    #[test]
    fn the_band_between_thresholds_changes_nothing_and_resets_quiet() {
        let mut m = AutoShardMachine::new(T, B, 8);
        // 500/s per shard: neither hot (1,000) nor quiet (250).
        for t in (0..10_000).step_by(100) {
            assert_eq!(proposal(&alone(&mut m, t, even(8, 400, 1))), None);
        }
        // Quiet from 10,000: the period counts from there, not from 0.
        for t in (10_000..13_000).step_by(100) {
            assert_eq!(proposal(&alone(&mut m, t, even(8, 0, 0))), None, "at {t}");
        }
        assert_eq!(proposal(&alone(&mut m, 13_000, even(8, 0, 0))), Some((8, 1, Reason::Quiet)));
    }

    #[test]
    fn a_lowered_counter_is_not_hot() {
        // The target of a lowering carries at most half the hot rate per shard.
        let mut m = AutoShardMachine::new(T, B, 64);
        for t in (0..=3_000).step_by(100) {
            alone(&mut m, t, even(64, 1_500, 0));
        }
        let to = m.status().pending.expect("lowered").to;
        assert_eq!(to, 30);
        let per_shard = 15_000 / u64::from(to);
        assert!(per_shard <= T.rate_up_per_shard / 2, "{per_shard}");
    }

    #[test]
    fn a_refused_proposal_is_dropped_and_waits_for_the_interval() {
        let mut m = AutoShardMachine::new(T, B, 1);
        alone(&mut m, 0, even(1, 0, 9));
        alone(&mut m, 100, even(1, 0, 9));
        let e = alone(&mut m, 150, AutoInput::Refused { reason: "resharding".into() });
        let [AutoEffect::Dropped { change, reason }] = e.as_slice() else { panic!("{e:?}") };
        assert_eq!((change.to, reason.as_str()), (2, "resharding"));
        assert_eq!(m.status().pending, None);
        assert_eq!(m.status().last_dropped.map(|d| d.change.to), Some(2));
        for t in (200..1_100).step_by(100) {
            assert_eq!(proposal(&alone(&mut m, t, even(1, 0, 9))), None, "at {t}");
        }
        assert_eq!(proposal(&alone(&mut m, 1_100, even(1, 0, 9))), Some((1, 2, Reason::QueueDepth)));
        // A refusal with nothing outstanding does nothing.
        let mut idle = AutoShardMachine::new(T, B, 1);
        assert_eq!(idle.step(0, AutoInput::Refused { reason: "x".into() }), vec![]);
    }

    #[test]
    fn someone_elses_change_is_followed() {
        let mut m = AutoShardMachine::new(T, B, 4);
        alone(&mut m, 0, even(4, 0, 9));
        // A resharding by hand starts and ends at 16: the streak starts again.
        assert_eq!(
            alone(
                &mut m,
                100,
                AutoInput::Sample(Sample { shards: 4, resharding: true, ..Default::default() })
            ),
            vec![]
        );
        // The change counts for the interval: hot at once, it waits until 1,200.
        for t in (200..1_200).step_by(100) {
            assert_eq!(proposal(&alone(&mut m, t, even(16, 0, 9))), None, "at {t}");
        }
        assert_eq!(proposal(&alone(&mut m, 1_200, even(16, 0, 9))), Some((16, 32, Reason::QueueDepth)));
        // A proposal overtaken by another change is dropped and the count followed.
        let e = alone(&mut m, 1_300, even(8, 0, 0));
        assert!(matches!(e.as_slice(), [AutoEffect::Dropped { change, .. }] if change.to == 32), "{e:?}");
        assert_eq!(proposal(&alone(&mut m, 1_400, even(8, 0, 9))), None);
    }

    #[test]
    fn new_bounds_clamp_at_once_even_within_the_interval() {
        let mut m = AutoShardMachine::new(T, B, 1);
        alone(&mut m, 0, even(1, 0, 9));
        alone(&mut m, 100, even(1, 0, 9));
        alone(&mut m, 200, even(2, 0, 0));
        let e = alone(&mut m, 300, AutoInput::Bounds(AutoShards { min_shards: 8, max_shards: 16 }));
        assert_eq!(proposal(&e), Some((2, 8, Reason::Bounds)));
        alone(&mut m, 400, even(8, 0, 0));
        assert_eq!(m.status().last_change.map(|c| (c.to, c.reason)), Some((8, Reason::Bounds)));
        let e = alone(&mut m, 500, AutoInput::Bounds(AutoShards { min_shards: 1, max_shards: 4 }));
        assert_eq!(proposal(&e), Some((8, 4, Reason::Bounds)));
        // Bounds that already hold the count change nothing.
        let mut m = AutoShardMachine::new(T, B, 4);
        assert_eq!(alone(&mut m, 0, AutoInput::Bounds(AutoShards { min_shards: 2, max_shards: 8 })), vec![]);
        // A count found outside the bounds in a sample is clamped too.
        let mut m = AutoShardMachine::new(T, AutoShards { min_shards: 2, max_shards: 8 }, 2);
        alone(&mut m, 0, even(2, 0, 0));
        alone(&mut m, 100, AutoInput::Sample(Sample { shards: 2, resharding: true, ..Default::default() }));
        alone(&mut m, 200, even(32, 0, 0));
        assert_eq!(proposal(&alone(&mut m, 300, even(32, 0, 0))), Some((32, 8, Reason::Bounds)));
    }

    #[test]
    fn a_sample_of_nothing_decides_nothing() {
        let mut m = AutoShardMachine::new(T, B, 4);
        let empty = AutoInput::Sample(Sample {
            shards: 4,
            elapsed_ms: 0,
            queue_depth_max: 100,
            ..Default::default()
        });
        for t in 0..10 {
            assert_eq!(alone(&mut m, t * 1_000, empty.clone()), vec![]);
        }
        assert_eq!(m.status().figures, None);
    }

    #[test]
    fn one_writer_to_sixty_four_and_back() {
        // The whole story at the sample rate: queue depth follows writers ÷ shards.
        let mut m = AutoShardMachine::new(T, B, 1);
        let mut shards = 1u16;
        let mut pending: Option<u16> = None;
        let mut changes = Vec::new();
        let mut now = 0;
        let mut run = |writers: u32, until: u64, m: &mut AutoShardMachine, now: &mut u64| {
            while *now < until {
                if let Some(to) = pending.take() {
                    shards = to;
                }
                let depth = writers.div_ceil(u32::from(shards));
                for e in alone(m, *now, even(shards, u64::from(writers), depth)) {
                    match e {
                        AutoEffect::Propose(c) => pending = Some(c.to),
                        AutoEffect::Changed(c) => changes.push((c.from, c.to, c.reason)),
                        AutoEffect::Dropped { .. } | AutoEffect::Confirm(_) => panic!("nothing refuses here"),
                    }
                }
                *now += 100;
            }
        };
        run(1, 2_000, &mut m, &mut now);
        run(64, 12_000, &mut m, &mut now);
        run(0, 20_000, &mut m, &mut now);
        assert_eq!(
            changes,
            vec![
                (1, 2, Reason::QueueDepth),
                (2, 4, Reason::QueueDepth),
                (4, 8, Reason::QueueDepth),
                (8, 16, Reason::QueueDepth),
                (16, 1, Reason::Quiet),
            ]
        );
    }

    fn view(node: &str, shards: u16, quiet_for_ms: u64, rate_total: u64) -> NodeView {
        NodeView {
            node: node.into(),
            view: Some(PeerView { shards, quiet_for_ms, rate_total, last_change: None }),
        }
    }

    /// Drives `m` quiet at 8 shards until it asks to lower; returns the question.
    fn asks_to_lower(m: &mut AutoShardMachine) -> Change {
        for t in (0..3_000).step_by(100) {
            assert_eq!(m.step(t, even(8, 0, 0)), vec![], "at {t}");
        }
        let e = m.step(3_000, even(8, 0, 0));
        let [AutoEffect::Confirm(c)] = e.as_slice() else { panic!("{e:?}") };
        assert_eq!((c.from, c.to, c.reason), (8, 1, Reason::Quiet));
        *c
    }

    #[test]
    fn a_lowering_waits_for_every_other_node_to_be_quiet_too() {
        let mut m = AutoShardMachine::new(T, B, 8);
        asks_to_lower(&mut m);
        assert_eq!(m.status().pending, None, "asking is not proposing");
        // While the others are asked, samples decide nothing.
        assert_eq!(m.step(3_050, even(8, 0, 0)), vec![]);
        // One node is busy: nothing is proposed, and the drop says who.
        let e = m.step(3_100, AutoInput::Views(vec![view("n2", 8, 5_000, 0), view("n3", 8, 0, 3_000)]));
        let [AutoEffect::Dropped { change, reason }] = e.as_slice() else { panic!("{e:?}") };
        assert_eq!((change.to, reason.as_str()), (1, "node n3 is not quiet (3000 increments/s)"));
        // Asked again only after the interval; the quiet streak went on meanwhile.
        for t in (3_200..4_000).step_by(100) {
            assert_eq!(m.step(t, even(8, 0, 0)), vec![], "at {t}");
        }
        assert!(matches!(m.step(4_000, even(8, 0, 0)).as_slice(), [AutoEffect::Confirm(_)]));
        // Now every node is quiet: the count their summed rate needs (1,200/s at
        // 500/s per shard: 3) is proposed.
        let e = m.step(4_100, AutoInput::Views(vec![view("n2", 8, 5_000, 700), view("n3", 8, 3_000, 500)]));
        assert_eq!(proposal(&e), Some((8, 3, Reason::Quiet)));
        assert_eq!(m.status().pending.map(|c| c.figures.rate_total), Some(1_200));
    }

    #[test]
    fn a_node_that_does_not_follow_or_sees_another_count_holds_a_lowering_back() {
        let mut m = AutoShardMachine::new(T, B, 8);
        asks_to_lower(&mut m);
        let e = m.step(3_100, AutoInput::Views(vec![NodeView { node: "n2".into(), view: None }]));
        assert!(
            matches!(e.as_slice(), [AutoEffect::Dropped { reason, .. }] if reason.contains("n2")),
            "{e:?}"
        );
        let mut m = AutoShardMachine::new(T, B, 8);
        asks_to_lower(&mut m);
        let e = m.step(3_100, AutoInput::Views(vec![view("n2", 16, 9_000, 0)]));
        assert!(
            matches!(e.as_slice(), [AutoEffect::Dropped { reason, .. }] if reason.contains("16")),
            "{e:?}"
        );
        // Quiet nodes whose rates add up to what 8 shards need lower nothing.
        let mut m = AutoShardMachine::new(T, B, 8);
        asks_to_lower(&mut m);
        let e =
            m.step(3_100, AutoInput::Views(vec![view("n2", 8, 9_000, 1_900), view("n3", 8, 9_000, 1_900)]));
        assert!(
            matches!(e.as_slice(), [AutoEffect::Dropped { reason, .. }] if reason.contains("3800")),
            "{e:?}"
        );
    }

    #[test]
    fn a_question_is_forgotten_when_the_layout_or_the_bounds_change() {
        let mut m = AutoShardMachine::new(T, B, 8);
        asks_to_lower(&mut m);
        // Someone else reshards meanwhile: the answers that come later change nothing.
        assert_eq!(
            m.step(3_100, AutoInput::Sample(Sample { shards: 8, resharding: true, ..Default::default() })),
            vec![]
        );
        assert_eq!(m.step(3_200, AutoInput::Views(Vec::new())), vec![]);
        assert_eq!(m.status().pending, None);
        let mut m = AutoShardMachine::new(T, B, 8);
        asks_to_lower(&mut m);
        assert_eq!(m.step(3_100, AutoInput::Bounds(AutoShards { min_shards: 2, max_shards: 8 })), vec![]);
        assert_eq!(m.step(3_200, AutoInput::Views(Vec::new())), vec![]);
    }

    #[test]
    fn a_view_reports_the_quiet_streak_and_the_latest_rate() {
        let mut m = AutoShardMachine::new(T, B, 8);
        let at = |shards, quiet_for_ms, rate_total| PeerView {
            shards,
            quiet_for_ms,
            rate_total,
            last_change: None,
        };
        assert_eq!(m.view(0), at(8, 0, 0));
        m.step(0, even(8, 400, 1));
        assert_eq!(m.view(50), at(8, 0, 4_000));
        m.step(100, even(8, 10, 0));
        m.step(200, even(8, 10, 0));
        assert_eq!(m.view(900), at(8, 800, 100));
        // A completed change of its own travels with the view.
        let mut m = AutoShardMachine::new(T, B, 1);
        m.step(0, even(1, 0, 9));
        m.step(100, even(1, 0, 9));
        m.step(200, even(2, 0, 0));
        assert_eq!(m.view(300).last_change.map(|c| (c.to, c.completed_at_ms)), Some((2, Some(200))));
    }

    /// A 100 ms sample on one node of `nodes`, with `writes` spread evenly.
    fn on_one_of(nodes: u16, shards: u16, writes: u64) -> AutoInput {
        AutoInput::Sample(Sample {
            shards,
            resharding: false,
            elapsed_ms: 100,
            writes,
            hottest_writes: writes / u64::from(shards),
            queue_depth_max: 0,
            nodes,
        })
    }

    #[test]
    fn a_node_that_sees_a_share_of_a_hot_rate_asks_the_others_and_raises_on_their_sum() {
        let mut m = AutoShardMachine::new(T, B, 2);
        // 700/s per shard here, 1,000 is hot: hot only if the other two route as much.
        assert_eq!(m.step(0, on_one_of(3, 2, 140)), vec![]);
        let e = m.step(100, on_one_of(3, 2, 140));
        let [AutoEffect::Confirm(c)] = e.as_slice() else { panic!("{e:?}") };
        assert_eq!((c.from, c.reason), (2, Reason::WriteRate));
        // Together 1,400 + 1,200 + 1,000 = 3,600/s, 1,800 per shard: raised to what
        // that needs at 500/s per shard.
        let e = m.step(150, AutoInput::Views(vec![view("n2", 2, 0, 1_200), view("n3", 2, 0, 1_000)]));
        assert_eq!(proposal(&e), Some((2, 8, Reason::WriteRate)));
        assert_eq!(m.status().pending.map(|c| c.figures.rate_total), Some(3_600));
    }

    #[test]
    fn a_share_that_is_not_hot_together_raises_nothing_and_is_asked_again_after_the_interval() {
        let mut m = AutoShardMachine::new(T, B, 2);
        m.step(0, on_one_of(3, 2, 140));
        assert!(matches!(m.step(100, on_one_of(3, 2, 140)).as_slice(), [AutoEffect::Confirm(_)]));
        let e = m.step(150, AutoInput::Views(vec![view("n2", 2, 0, 100), view("n3", 2, 0, 0)]));
        let [AutoEffect::Dropped { reason, .. }] = e.as_slice() else { panic!("{e:?}") };
        assert_eq!(reason, "the nodes together route 1500 increments/s: not hot");
        for t in (200..1_100).step_by(100) {
            assert_eq!(m.step(t, on_one_of(3, 2, 140)), vec![], "at {t}");
        }
        assert!(matches!(m.step(1_100, on_one_of(3, 2, 140)).as_slice(), [AutoEffect::Confirm(_)]));
        // A node that sees another count holds it back too.
        let e = m.step(1_150, AutoInput::Views(vec![view("n2", 4, 0, 5_000)]));
        assert!(
            matches!(e.as_slice(), [AutoEffect::Dropped { reason, .. }] if reason.contains("n2")),
            "{e:?}"
        );
        // On a single node the same rate is just calm: nothing is asked.
        let mut alone = AutoShardMachine::new(T, B, 2);
        for t in (0..2_000).step_by(100) {
            assert_eq!(alone.step(t, on_one_of(1, 2, 140)), vec![], "at {t}");
        }
    }
}
