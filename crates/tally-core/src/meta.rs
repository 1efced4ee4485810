//! Counter metadata — the spec and the shard layout — and its transitions.
//!
//! The same transition functions run in the embedded catalog and in the replicated
//! state machine of a cluster, so both agree on what every command means.
//!
//! # Resharding by generations
//!
//! A counter's shards form a *generation*. Changing `shards` on a live counter never
//! moves values or dedup records between shards; it seals the current generation and
//! opens a new one:
//!
//! 1. [`CounterMeta::update`] records the target shard count (`resharding`); writes
//!    still go to the current generation.
//! 2. The engine seals every shard of the current generation (each answers with its
//!    final value and refuses later writes) and merges their sketches into the new
//!    generation (merging a sketch twice changes nothing, so this step may repeat).
//! 3. [`CounterMeta::complete_reshard`] opens the new generation in one step and adds
//!    the sealed generation's sum to `base`. Reads sum `base` and the current
//!    generation, so every increment is counted exactly once before, during and after.
//! 4. Sealed generations stay listed until every record in them has expired (the
//!    dedup window, or the drain ids' window if longer): an event id is looked up in
//!    its shard of every listed sealed generation (they never change again, so the
//!    lookup needs no lock), which keeps retries deduplicated across a resharding.
//!    The engine deletes their data, then [`CounterMeta::prune_sealed`] drops them.

use crate::shard::DRAIN_DEDUP_WINDOW_MS;
use crate::spec::{CounterSpec, SpecError, SpecPatch};
use serde::{Deserialize, Serialize};

/// Most sealed generations a counter may keep at once; a resharding beyond this waits
/// until older generations leave their dedup window.
pub const SEALED_GENERATIONS_MAX: usize = 16;

/// A generation that no longer takes writes but still answers dedup lookups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealedGeneration {
    /// Its generation number.
    pub generation: u32,
    /// Its shard count (event ids route within it).
    pub shards: u16,
    /// When it was sealed; its records expire a dedup window later.
    pub sealed_at_ms: u64,
}

/// Where a counter's value lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// The generation that takes writes.
    pub generation: u32,
    /// Its shard count.
    pub shards: u16,
    /// Sum of every sealed generation's final values.
    pub base: i128,
    /// Sealed generations still inside their dedup window, oldest first.
    pub sealed: Vec<SealedGeneration>,
    /// The target shard count of a resharding in progress.
    pub resharding: Option<u16>,
}

/// Everything the cluster agrees on about one counter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterMeta {
    /// The contract. `spec.shards` is the requested shard count; while a resharding is
    /// in progress the layout still has the old one.
    pub spec: CounterSpec,
    /// Where the value lives.
    pub layout: Layout,
    /// When the counter was created, in milliseconds since the Unix epoch.
    pub created_at_ms: u64,
    /// Bumped by every transition, so caches can tell stale copies apart.
    pub version: u64,
    /// When the counter stops existing, in milliseconds since the Unix epoch
    /// ([`crate::expiry`]); `None` for never. Set by `EXPIRE` and its family, or at
    /// creation by a namespace's `ttl_ms`.
    pub expires_at_ms: Option<u64>,
}

/// Why a metadata transition was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetaError {
    /// The patch breaks the spec's bounds.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// A second resharding was asked for while one is in progress.
    #[error("counter is being resharded to {target} shards; retry when it completes")]
    Resharding {
        /// The shard count being moved to.
        target: u16,
    },
    /// Too many sealed generations are still inside their dedup window.
    #[error("counter was resharded {count} times within its dedup window; retry later")]
    TooManyGenerations {
        /// How many are sealed.
        count: usize,
    },
    /// A completion named a generation that is not the one being sealed.
    #[error("generation {got} is not being resharded (current generation {current})")]
    StaleGeneration {
        /// The counter's current generation.
        current: u32,
        /// The generation named.
        got: u32,
    },
    /// The counter expired: it exists no more for any command but its deletion
    /// (`DeleteExpired`), which must run first (its shards' data goes with it).
    #[error("the counter expired at {expires_at_ms} ms since the Unix epoch")]
    Expired {
        /// Its deadline.
        expires_at_ms: u64,
    },
}

impl CounterMeta {
    /// A new counter with `spec` (validated).
    pub fn create(spec: CounterSpec, now_ms: u64) -> Result<Self, MetaError> {
        spec.validate()?;
        if spec.min.is_some_and(|m| m > 0) || spec.max.is_some_and(|m| m < 0) {
            return Err(SpecError::BoundsExcludeZero { min: spec.min, max: spec.max }.into());
        }
        Ok(Self {
            spec,
            layout: Layout {
                generation: 0,
                shards: spec.shards,
                base: 0,
                sealed: Vec::new(),
                resharding: None,
            },
            created_at_ms: now_ms,
            version: 1,
            expires_at_ms: None,
        })
    }

    /// Whether the counter has expired at `now_ms` ([`crate::expiry::expired`]).
    pub fn expired(&self, now_ms: u64) -> bool {
        crate::expiry::expired(self.expires_at_ms, now_ms)
    }

    /// This new counter moved past every generation of `tombstone`, the deleted
    /// counter of the same name whose data may still exist somewhere (its deletion
    /// not finished): its shards' ids then never name a shard of that counter, so
    /// the cleanup of the old one can never delete the new one's data, and the new
    /// one never reads what the old one left. `None` if no generation is left past
    /// them.
    pub fn born_after(mut self, tombstone: &[(u32, u16)]) -> Option<Self> {
        assert_eq!(self.version, 1, "only a counter just created is moved");
        let last = tombstone.iter().map(|(word, _)| crate::ids::split_generation_word(*word).0).max();
        if let Some(last) = last {
            let first = last.checked_add(1).filter(|g| *g <= crate::ids::GENERATION_MAX)?;
            self.layout.generation = first;
        }
        Some(self)
    }

    /// A new counter's metadata under namespace `ns` at `now_ms` (with its deadline
    /// when the namespace has a `ttl_ms`), or why it cannot be made.
    pub fn under(ns: &crate::namespace::NamespaceSpec, now_ms: u64) -> Result<Self, MetaError> {
        let spec = ns.counter_spec().map_err(|e| match e {
            crate::namespace::NamespaceError::Spec(e) => MetaError::Spec(e),
            // Checked when the namespace was declared; a table never holds one.
            other => MetaError::Spec(SpecError::UnknownWord {
                field: "namespace",
                found: other.to_string(),
                expected: &[],
            }),
        })?;
        let mut meta = Self::create(spec, now_ms)?;
        meta.expires_at_ms = ns.ttl_ms.map(|ttl| now_ms.saturating_add(ttl));
        Ok(meta)
    }

    /// A counter created with the defaults plus `patch`.
    pub fn create_patched(patch: &SpecPatch, now_ms: u64) -> Result<Self, MetaError> {
        Self::create(CounterSpec::default().patched(patch)?, now_ms)
    }

    /// Applies `patch`. A changed shard count starts a resharding; everything else
    /// takes effect at once. Returns whether anything changed.
    pub fn update(&mut self, patch: &SpecPatch) -> Result<bool, MetaError> {
        let next = self.spec.updated(patch)?;
        if next == self.spec {
            return Ok(false);
        }
        if next.shards != self.spec.shards {
            if self.layout.generation >= crate::ids::GENERATION_MAX {
                return Err(SpecError::GenerationsExhausted { max: crate::ids::GENERATION_MAX }.into());
            }
            if let Some(target) = self.layout.resharding {
                return Err(MetaError::Resharding { target });
            }
            if self.layout.sealed.len() >= SEALED_GENERATIONS_MAX {
                return Err(MetaError::TooManyGenerations { count: self.layout.sealed.len() });
            }
            if next.shards != self.layout.shards {
                self.layout.resharding = Some(next.shards);
            }
        }
        self.spec = next;
        self.version += 1;
        Ok(true)
    }

    /// Opens the next generation after every shard of `generation` was sealed with
    /// final values summing to `sealed_sum`.
    pub fn complete_reshard(
        &mut self,
        generation: u32,
        sealed_sum: i128,
        now_ms: u64,
    ) -> Result<(), MetaError> {
        let current = self.layout.generation;
        let Some(target) = self.layout.resharding.filter(|_| generation == current) else {
            return Err(MetaError::StaleGeneration { current, got: generation });
        };
        self.layout.sealed.push(SealedGeneration {
            generation,
            shards: self.layout.shards,
            sealed_at_ms: now_ms,
        });
        self.layout.base += sealed_sum;
        self.layout.generation += 1;
        self.layout.shards = target;
        self.layout.resharding = None;
        self.version += 1;
        Ok(())
    }

    /// How long a sealed generation stays listed: until every record in it has
    /// expired — its event ids after the counter's dedup window, its drain ids after
    /// theirs ([`DRAIN_DEDUP_WINDOW_MS`]), whichever is longer.
    pub fn sealed_retention_ms(&self) -> u64 {
        self.spec.dedup_window_ms().max(DRAIN_DEDUP_WINDOW_MS)
    }

    /// Whether some sealed generation has left its retention, so that
    /// [`CounterMeta::prune_sealed`] would drop it.
    pub fn prune_due(&self, now_ms: u64) -> bool {
        let retention_ms = self.sealed_retention_ms();
        self.layout.sealed.iter().any(|g| crate::dedup::expired(g.sealed_at_ms, now_ms, retention_ms))
    }

    /// Drops sealed generations whose retention has passed, returning them so their
    /// shards' data can be deleted.
    pub fn prune_sealed(&mut self, now_ms: u64) -> Vec<SealedGeneration> {
        let retention_ms = self.sealed_retention_ms();
        let (gone, kept): (Vec<_>, Vec<_>) = self
            .layout
            .sealed
            .iter()
            .partition(|g| crate::dedup::expired(g.sealed_at_ms, now_ms, retention_ms));
        if !gone.is_empty() {
            self.layout.sealed = kept;
            self.version += 1;
        }
        gone
    }

    /// The generation a resharding in progress opens, with its shard count: it
    /// takes no writes yet, but its shards already take the merged sketches.
    pub fn opening(&self) -> Option<(u32, u16)> {
        self.layout.resharding.map(|target| (self.layout.generation + 1, target))
    }

    /// Shard `index` of generation `generation` of this counter, named `name`, in
    /// the counter's replica class.
    pub fn shard_id(&self, name: &crate::CounterName, generation: u32, index: u16) -> crate::ShardId {
        crate::ShardId::new(name.clone(), generation, index).in_class(self.spec.replica_class())
    }

    /// Every generation whose shards hold data, as a tombstone keeps them: the
    /// generation's word, which carries the replica class
    /// ([`crate::ShardId::generation_word`]), and its shard count.
    pub fn generation_words(&self) -> Vec<(u32, u16)> {
        let class = self.spec.replica_class();
        self.generations()
            .map(|(generation, shards)| (crate::ids::generation_word(generation, class), shards))
            .collect()
    }

    /// Whether shard `id` is one of this counter's: of a generation whose shards hold
    /// data (sealed or current) or of the one a resharding opens, in the counter's
    /// replica class.
    pub fn holds(&self, id: &crate::ShardId) -> bool {
        let class = self.spec.replica_class();
        self.generations().chain(self.opening()).any(|(g, shards)| {
            crate::ids::generation_word(g, class) == id.generation_word() && id.index < shards
        })
    }

    /// Every generation whose shards hold data: sealed ones, then the current one.
    pub fn generations(&self) -> impl Iterator<Item = (u32, u16)> + '_ {
        self.layout
            .sealed
            .iter()
            .map(|g| (g.generation, g.shards))
            .chain(std::iter::once((self.layout.generation, self.layout.shards)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> CounterMeta {
        CounterMeta::create(CounterSpec::default(), 1_000).unwrap()
    }

    #[test]
    fn a_namespace_makes_the_counters_a_creation_would() {
        use crate::namespace::NamespaceSpec;
        use crate::spec::{AutoShards, Durability};
        let bounded = NamespaceSpec {
            patch: SpecPatch { durability: Some(Durability::Sync), min: Some(0), ..SpecPatch::default() },
            ..NamespaceSpec::default()
        };
        let meta = CounterMeta::under(&bounded, 1_000).unwrap();
        assert_eq!(
            (meta.spec.durability, meta.spec.min, meta.expires_at_ms),
            (Durability::Sync, Some(0), None)
        );
        let window = NamespaceSpec { ttl_ms: Some(60_000), ..NamespaceSpec::default() };
        assert_eq!(CounterMeta::under(&window, 1_000).unwrap().expires_at_ms, Some(61_000));
        let auto =
            NamespaceSpec { auto: Some(AutoShards { min_shards: 2, max_shards: 16 }), ..Default::default() };
        assert_eq!(
            CounterMeta::under(&auto, 1).unwrap().spec.shards,
            2,
            "an auto counter starts at its lower bound"
        );
    }

    #[test]
    fn non_shard_updates_apply_at_once() {
        let mut m = meta();
        let changed = m.update(&SpecPatch { flush_ms: Some(50), ..Default::default() }).unwrap();
        assert!(changed);
        assert_eq!(m.spec.flush_ms, 50);
        assert_eq!(m.layout.resharding, None);
        assert!(!m.update(&SpecPatch { flush_ms: Some(50), ..Default::default() }).unwrap());
    }

    #[test]
    fn resharding_seals_a_generation_and_carries_its_sum() {
        let mut m = meta();
        m.update(&SpecPatch { shards: Some(64), ..Default::default() }).unwrap();
        assert_eq!((m.layout.shards, m.layout.resharding, m.spec.shards), (8, Some(64), 64));
        assert_eq!(
            m.update(&SpecPatch { shards: Some(2), ..Default::default() }),
            Err(MetaError::Resharding { target: 64 })
        );
        assert!(matches!(m.complete_reshard(7, 0, 2_000), Err(MetaError::StaleGeneration { .. })));
        m.complete_reshard(0, 1234, 2_000).unwrap();
        assert_eq!((m.layout.generation, m.layout.shards, m.layout.base), (1, 64, 1234));
        assert_eq!(m.layout.sealed, vec![SealedGeneration { generation: 0, shards: 8, sealed_at_ms: 2_000 }]);
        assert_eq!(m.generations().collect::<Vec<_>>(), vec![(0, 8), (1, 64)]);
        // Completing twice is refused, so a sum is never added twice.
        assert!(m.complete_reshard(0, 1234, 2_000).is_err());
        assert_eq!(m.layout.base, 1234);
    }

    #[test]
    fn sealed_generations_leave_after_their_window() {
        let mut m = meta();
        m.update(&SpecPatch { shards: Some(2), dedup_window_s: Some(10), ..Default::default() }).unwrap();
        m.complete_reshard(0, 5, 2_000).unwrap();
        // The drain ids' window is longer than this counter's: it decides.
        let retention = DRAIN_DEDUP_WINDOW_MS;
        assert!(!m.prune_due(2_000 + retention - 1));
        assert!(m.prune_sealed(2_000 + retention - 1).is_empty());
        assert!(m.prune_due(2_000 + retention));
        assert_eq!(m.prune_sealed(2_000 + retention).len(), 1);
        assert!(m.layout.sealed.is_empty());
        assert_eq!(m.layout.base, 5, "pruning keeps the sealed sum");
        // A longer dedup window decides when it is the longer one.
        m.update(&SpecPatch { shards: Some(3), dedup_window_s: Some(3_600), ..Default::default() }).unwrap();
        m.complete_reshard(1, 0, 10_000).unwrap();
        assert!(!m.prune_due(10_000 + 3_599_999));
        assert!(m.prune_due(10_000 + 3_600_000));
    }

    #[test]
    fn reshard_back_to_the_current_count_is_a_no_op_layout_change() {
        let mut m = meta();
        m.update(&SpecPatch { shards: Some(8), ..Default::default() }).unwrap();
        assert_eq!(m.layout.resharding, None);
    }

    #[test]
    fn sealed_generations_are_bounded() {
        let mut m = meta();
        for i in 0..SEALED_GENERATIONS_MAX {
            let target = if i % 2 == 0 { 4 } else { 8 };
            m.update(&SpecPatch { shards: Some(target), ..Default::default() }).unwrap();
            m.complete_reshard(m.layout.generation, 0, 1_000).unwrap();
        }
        let r = m.update(&SpecPatch { shards: Some(3), ..Default::default() });
        assert_eq!(r, Err(MetaError::TooManyGenerations { count: SEALED_GENERATIONS_MAX }));
    }
}

/// A metadata change, as stored in the local catalog or replicated through a log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaCommand {
    /// Create the counter with defaults plus the patch, or update it with the patch.
    Put(SpecPatch),
    /// Create the counter with defaults unless it exists (an increment to an unknown
    /// counter creates it).
    Ensure,
    /// Open the next generation after sealing `generation` with `sealed_sum`.
    CompleteReshard {
        /// The sealed generation.
        generation: u32,
        /// Sum of its final shard values.
        sealed_sum: i128,
    },
    /// Drop sealed generations whose dedup window has passed.
    PruneSealed,
    /// Delete the counter.
    Delete,
    /// Set the counter's deadline to `at_ms` if `when` allows it (`EXPIRE` and its
    /// family); a deadline at or before the command's time deletes the counter.
    Expire {
        /// The deadline, in milliseconds since the Unix epoch.
        at_ms: u64,
        /// `NX`, `XX`, `GT`, `LT` or none.
        when: crate::expiry::Condition,
    },
    /// Remove the counter's deadline (`PERSIST`).
    Persist,
    /// Delete the counter if it has expired by the command's time, else nothing: the
    /// reclaim of an expired counter, which never deletes one whose deadline moved
    /// meanwhile.
    DeleteExpired,
    /// Create the counter unless it exists (an increment to an unknown counter), with
    /// the spec of the longest namespace its name falls under in the table the
    /// command is applied against ([`apply_command_in`]), else this one: the
    /// proposing node's default. `Ensure` is this with the built-in defaults.
    EnsureWith(crate::namespace::NamespaceSpec),
}

/// What a command did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaEffect {
    /// The counter was created.
    Created,
    /// The counter changed.
    Updated,
    /// Nothing changed.
    Unchanged,
    /// Sealed generations left; their shards' data may be deleted.
    Pruned(Vec<SealedGeneration>),
    /// The counter was deleted; every listed generation's shards may be deleted.
    /// Each is named by its word ([`crate::ShardId::generation_word`]: the class of
    /// the counter's shards rides in its top bits) and its shard count.
    Deleted(Vec<(u32, u16)>),
    /// The counter did not exist.
    Missing,
}

/// Applies `cmd` to a counter's current metadata (`None` if it does not exist) at
/// `now_ms`, returning its next metadata and what happened. Pure: the catalog and a
/// replicated state machine both call exactly this.
pub fn apply_command(
    current: Option<CounterMeta>,
    cmd: &MetaCommand,
    now_ms: u64,
) -> Result<(Option<CounterMeta>, MetaEffect), MetaError> {
    // An expired counter exists only to be deleted: every other command about it is
    // answered as about a missing one (the expiry commands), or refused until it is
    // deleted (a creation or update would meet its old shards' data).
    if let Some(m) = current.as_ref().filter(|m| m.expired(now_ms)) {
        let at = m.expires_at_ms.unwrap_or_default();
        match cmd {
            MetaCommand::Delete | MetaCommand::DeleteExpired => {
                return Ok((None, MetaEffect::Deleted(m.generation_words())))
            }
            MetaCommand::Expire { .. } | MetaCommand::Persist => return Ok((current, MetaEffect::Missing)),
            MetaCommand::Put(_) | MetaCommand::Ensure | MetaCommand::EnsureWith(_) => {
                return Err(MetaError::Expired { expires_at_ms: at })
            }
            // What the engine does to a counter's layout goes on until it is deleted.
            MetaCommand::CompleteReshard { .. } | MetaCommand::PruneSealed => {}
        }
    }
    match (current, cmd) {
        (None, MetaCommand::Put(patch)) => {
            Ok((Some(CounterMeta::create_patched(patch, now_ms)?), MetaEffect::Created))
        }
        (None, MetaCommand::Ensure) => {
            Ok((Some(CounterMeta::create(CounterSpec::default(), now_ms)?), MetaEffect::Created))
        }
        (None, MetaCommand::EnsureWith(spec)) => {
            Ok((Some(CounterMeta::under(spec, now_ms)?), MetaEffect::Created))
        }
        (None, _) => Ok((None, MetaEffect::Missing)),
        (Some(mut m), MetaCommand::Put(patch)) => {
            let changed = m.update(patch)?;
            Ok((Some(m), if changed { MetaEffect::Updated } else { MetaEffect::Unchanged }))
        }
        (Some(m), MetaCommand::Ensure | MetaCommand::EnsureWith(_)) => Ok((Some(m), MetaEffect::Unchanged)),
        (Some(mut m), MetaCommand::CompleteReshard { generation, sealed_sum }) => {
            m.complete_reshard(*generation, *sealed_sum, now_ms)?;
            Ok((Some(m), MetaEffect::Updated))
        }
        (Some(mut m), MetaCommand::PruneSealed) => {
            let gone = m.prune_sealed(now_ms);
            let effect = if gone.is_empty() { MetaEffect::Unchanged } else { MetaEffect::Pruned(gone) };
            Ok((Some(m), effect))
        }
        (Some(m), MetaCommand::Delete) => Ok((None, MetaEffect::Deleted(m.generation_words()))),
        (Some(mut m), MetaCommand::Expire { at_ms, when }) => {
            if !when.allows(m.expires_at_ms, *at_ms) {
                return Ok((Some(m), MetaEffect::Unchanged));
            }
            if *at_ms <= now_ms {
                // A deadline already passed: the counter goes at once, as Redis
                // deletes a key given a timeout of zero or less.
                return Ok((None, MetaEffect::Deleted(m.generation_words())));
            }
            if m.expires_at_ms == Some(*at_ms) {
                return Ok((Some(m), MetaEffect::Unchanged));
            }
            m.expires_at_ms = Some(*at_ms);
            m.version += 1;
            Ok((Some(m), MetaEffect::Updated))
        }
        (Some(mut m), MetaCommand::Persist) => {
            if m.expires_at_ms.take().is_none() {
                return Ok((Some(m), MetaEffect::Unchanged));
            }
            m.version += 1;
            Ok((Some(m), MetaEffect::Updated))
        }
        // Not expired (that was answered above): it stays.
        (Some(m), MetaCommand::DeleteExpired) => Ok((Some(m), MetaEffect::Unchanged)),
    }
}

/// [`apply_command`] for counter `name`, against the namespaces `namespaces`: an
/// implicit creation (`Ensure`, `EnsureWith`) takes the spec of the longest
/// namespace `name` falls under, else the command's default. What the catalog and
/// the replicated state machine call, each with the table it holds, so a creation
/// through a namespace needs no metadata round of its own.
pub fn apply_command_in(
    name: &str,
    current: Option<CounterMeta>,
    cmd: &MetaCommand,
    now_ms: u64,
    namespaces: &crate::namespace::Namespaces,
) -> Result<(Option<CounterMeta>, MetaEffect), MetaError> {
    let default = match cmd {
        MetaCommand::Ensure => crate::namespace::NamespaceSpec::default(),
        MetaCommand::EnsureWith(d) => *d,
        other => return apply_command(current, other, now_ms),
    };
    let spec = crate::namespace::spec_for(namespaces, name, &default);
    apply_command(current, &MetaCommand::EnsureWith(*spec), now_ms)
}

/// The auto bounds a counter created by `cmd` under `namespaces` takes (an implicit
/// creation under a namespace, or with a default, that says `shards: "auto"`).
pub fn creation_auto(
    name: &str,
    cmd: &MetaCommand,
    namespaces: &crate::namespace::Namespaces,
) -> Option<crate::spec::AutoShards> {
    match cmd {
        MetaCommand::Ensure => crate::namespace::longest_match(namespaces, name).and_then(|(_, s)| s.auto),
        MetaCommand::EnsureWith(d) => crate::namespace::spec_for(namespaces, name, d).auto,
        _ => None,
    }
}

#[cfg(test)]
mod command_tests {
    use super::*;

    #[test]
    fn commands_walk_a_counter_through_its_life() {
        let (m, e) = apply_command(None, &MetaCommand::Ensure, 5).unwrap();
        assert_eq!(e, MetaEffect::Created);
        let m = m.unwrap();
        assert_eq!(m.spec, CounterSpec::default());
        let (m2, e) = apply_command(Some(m.clone()), &MetaCommand::Ensure, 6).unwrap();
        assert_eq!((m2.as_ref(), e), (Some(&m), MetaEffect::Unchanged));
        let patch = SpecPatch { shards: Some(2), ..Default::default() };
        let (m3, e) = apply_command(m2, &MetaCommand::Put(patch), 7).unwrap();
        assert_eq!(e, MetaEffect::Updated);
        let cmd = MetaCommand::CompleteReshard { generation: 0, sealed_sum: 9 };
        let (m4, _) = apply_command(m3, &cmd, 8).unwrap();
        assert_eq!(m4.as_ref().unwrap().layout.base, 9);
        let (gone, e) = apply_command(m4, &MetaCommand::Delete, 9).unwrap();
        assert_eq!((gone, e), (None, MetaEffect::Deleted(vec![(0, 8), (1, 2)])));
        assert_eq!(apply_command(None, &MetaCommand::Delete, 9).unwrap().1, MetaEffect::Missing);
    }

    #[test]
    fn a_counter_with_its_own_replicas_names_its_shards_and_tombstone_in_its_class() {
        let patch = SpecPatch { replicas: Some(3), shards: Some(2), ..Default::default() };
        let (m, _) = apply_command(None, &MetaCommand::Put(patch), 5).unwrap();
        let m = m.unwrap();
        let name = crate::CounterName::new("likes").unwrap();
        let id = m.shard_id(&name, 0, 1);
        assert_eq!((id.replicas, id.generation, id.index), (3, 0, 1));
        let (_, e) = apply_command(Some(m), &MetaCommand::Delete, 6).unwrap();
        let MetaEffect::Deleted(words) = e else { panic!("deleted") };
        let back: Vec<crate::ShardId> =
            words.iter().map(|&(w, _)| crate::ShardId::from_word(name.clone(), w, 1)).collect();
        assert_eq!(back, vec![id], "the tombstone names the shards in their class");
    }

    #[test]
    fn a_deadline_is_set_kept_and_reached_as_redis_states_it() {
        use crate::expiry::Condition::*;
        let expire = |at_ms, when| MetaCommand::Expire { at_ms, when };
        let (m, _) = apply_command(None, &MetaCommand::Ensure, 1_000).unwrap();
        assert_eq!(apply_command(None, &expire(5_000, Always), 1_000).unwrap().1, MetaEffect::Missing);
        // XX needs a deadline, NX none; a set one moves the version.
        assert_eq!(apply_command(m.clone(), &expire(5_000, Xx), 1_000).unwrap().1, MetaEffect::Unchanged);
        let (m, e) = apply_command(m, &expire(5_000, Nx), 1_000).unwrap();
        let version = m.as_ref().unwrap().version;
        assert_eq!((e, m.as_ref().unwrap().expires_at_ms, version), (MetaEffect::Updated, Some(5_000), 2));
        assert_eq!(apply_command(m.clone(), &expire(9_000, Nx), 1_000).unwrap().1, MetaEffect::Unchanged);
        assert_eq!(apply_command(m.clone(), &expire(4_000, Gt), 1_000).unwrap().1, MetaEffect::Unchanged);
        assert_eq!(apply_command(m.clone(), &expire(5_000, Always), 1_000).unwrap().1, MetaEffect::Unchanged);
        let (m, _) = apply_command(m, &expire(6_000, Gt), 1_000).unwrap();
        assert_eq!(m.as_ref().unwrap().expires_at_ms, Some(6_000));
        // Before its deadline nothing reclaims it; PERSIST removes the deadline once.
        assert_eq!(
            apply_command(m.clone(), &MetaCommand::DeleteExpired, 5_999).unwrap().1,
            MetaEffect::Unchanged
        );
        let (kept, e) = apply_command(m.clone(), &MetaCommand::Persist, 2_000).unwrap();
        assert_eq!((e, kept.as_ref().unwrap().expires_at_ms), (MetaEffect::Updated, None));
        assert_eq!(apply_command(kept, &MetaCommand::Persist, 2_000).unwrap().1, MetaEffect::Unchanged);
        // From its deadline on it exists only to be deleted.
        assert_eq!(apply_command(m.clone(), &MetaCommand::Persist, 6_000).unwrap().1, MetaEffect::Missing);
        assert_eq!(
            apply_command(m.clone(), &MetaCommand::Ensure, 6_000),
            Err(MetaError::Expired { expires_at_ms: 6_000 }),
            "a creation must wait for its old data to go"
        );
        assert_eq!(
            apply_command(m.clone(), &MetaCommand::DeleteExpired, 6_000).unwrap(),
            (None, MetaEffect::Deleted(vec![(0, 8)]))
        );
        // A deadline already passed deletes at once (Redis's non-positive timeout).
        assert_eq!(
            apply_command(m, &expire(500, Always), 1_000).unwrap(),
            (None, MetaEffect::Deleted(vec![(0, 8)]))
        );
    }

    #[test]
    fn an_implicit_creation_takes_its_namespaces_spec_again_after_a_delete() {
        use crate::namespace::{NamespaceSpec, Namespaces};
        use crate::spec::Durability;
        let mut table = Namespaces::new();
        let stock = NamespaceSpec {
            patch: SpecPatch { durability: Some(Durability::Sync), min: Some(0), ..Default::default() },
            ..Default::default()
        };
        table.insert("stock:".into(), stock);
        let (m, e) = apply_command_in("stock:1", None, &MetaCommand::Ensure, 5, &table).unwrap();
        let m = m.unwrap();
        assert_eq!((e, m.spec.min, m.spec.durability), (MetaEffect::Created, Some(0), Durability::Sync));
        let (gone, _) = apply_command_in("stock:1", Some(m), &MetaCommand::Delete, 6, &table).unwrap();
        assert!(gone.is_none());
        let (again, _) = apply_command_in("stock:1", None, &MetaCommand::Ensure, 7, &table).unwrap();
        assert_eq!(again.unwrap().spec.min, Some(0), "deleting a counter never loses its contract");
        // A name under no namespace takes the proposer's default.
        let default = NamespaceSpec {
            patch: SpecPatch { shards: Some(2), ..Default::default() },
            ttl_ms: Some(1_000),
            ..Default::default()
        };
        let (m, _) = apply_command_in("likes:1", None, &MetaCommand::EnsureWith(default), 9, &table).unwrap();
        let m = m.unwrap();
        assert_eq!((m.spec.shards, m.expires_at_ms), (2, Some(1_009)));
        let (m, _) = apply_command_in("stock:2", None, &MetaCommand::EnsureWith(default), 9, &table).unwrap();
        assert_eq!(m.unwrap().spec.min, Some(0), "a namespace wins over the default");
        let auto = NamespaceSpec {
            auto: Some(crate::spec::AutoShards { min_shards: 2, max_shards: 9 }),
            ..Default::default()
        };
        table.insert("hot:".into(), auto);
        assert_eq!(creation_auto("hot:1", &MetaCommand::Ensure, &table), auto.auto);
        assert_eq!(creation_auto("stock:1", &MetaCommand::Ensure, &table), None);
        assert_eq!(creation_auto("hot:1", &MetaCommand::Delete, &table), None);
    }

    #[test]
    fn a_bad_patch_changes_nothing() {
        let (m, _) = apply_command(None, &MetaCommand::Ensure, 5).unwrap();
        let bad = SpecPatch { shards: Some(0), ..Default::default() };
        assert!(apply_command(m, &MetaCommand::Put(bad), 6).is_err());
        assert!(apply_command(None, &MetaCommand::Put(bad), 6).is_err());
    }

    #[test]
    fn every_transition_moves_the_version_by_one() {
        let mut m = CounterMeta::create(CounterSpec::default(), 1_000).unwrap();
        assert_eq!(m.version, 1);
        m.update(&SpecPatch { shards: Some(4), dedup_window_s: Some(0), ..Default::default() }).unwrap();
        assert_eq!(m.version, 2);
        m.complete_reshard(0, 3, 1_000).unwrap();
        assert_eq!(m.version, 3);
        assert_eq!(m.prune_sealed(1_000 + DRAIN_DEDUP_WINDOW_MS).len(), 1);
        assert_eq!(m.version, 4);
        assert!(m.prune_sealed(1_000 + DRAIN_DEDUP_WINDOW_MS).is_empty());
        assert_eq!(m.version, 4, "nothing pruned, nothing changed");
    }
}
