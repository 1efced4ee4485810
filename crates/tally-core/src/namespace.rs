//! Namespaces: the spec that counters created implicitly under a name prefix take.
//!
//! An increment to a counter that does not exist creates it (Redis's `INCR`
//! creates a key). Which contract it gets is declared ahead of time per prefix: a
//! namespace `stock:` with `{"durability": "sync", "min": 0}` makes every counter
//! whose name starts with `stock:` a bounded sync counter from its first increment,
//! and again after a `DEL` — a counter's contract is never lost by deleting it. The
//! longest prefix that matches wins; a name under no namespace takes the node's
//! default spec (the node config's `[engine.default_spec]`, carried in each creation
//! command so every replica agrees).
//!
//! The table is metadata: replicated with the counters in a cluster, stored beside
//! them on a single node. Resolving a name is a lookup in the table the creation is
//! applied against, so creating a counter through a namespace costs no metadata
//! round beyond the creation's own.

use crate::spec::{AutoShards, CounterSpec, SpecError, SpecPatch};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most namespaces a cluster keeps: every implicit creation looks its name up in
/// them, and the whole table is held in memory on every node.
pub const NAMESPACES_MAX: usize = 4_096;

/// Longest namespace prefix, in bytes: a counter name's longest.
pub const NAMESPACE_PREFIX_LEN_MAX: usize = crate::name::NAME_LEN_MAX;

/// Longest `ttl_ms` a namespace may give its counters: 10 years.
pub const NAMESPACE_TTL_MS_MAX: u64 = 10 * 365 * 86_400_000;

/// What a counter created under a namespace (or the node default) gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceSpec {
    /// The spec fields, over the defaults (`shards`, `durability`, bounds, windows,
    /// `distinct`, `frequency`, `replicas`, ...).
    pub patch: SpecPatch,
    /// `shards: "auto"` with these bounds: the counter's shard count follows
    /// contention, starting at `min_shards`.
    pub auto: Option<AutoShards>,
    /// The counter expires this long after it is created (a fixed window's length).
    pub ttl_ms: Option<u64>,
}

/// Why a namespace was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NamespaceError {
    /// The spec would not make a valid counter.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The prefix is empty, too long, or not a possible start of a counter name.
    #[error(
        "a namespace prefix is 1 to {NAMESPACE_PREFIX_LEN_MAX} bytes that may start a counter name: {reason}"
    )]
    Prefix {
        /// What is wrong with it.
        reason: String,
    },
    /// `ttl_ms` is 0 or beyond its bound.
    #[error("ttl_ms must be between 1 and {NAMESPACE_TTL_MS_MAX} (got {got})")]
    Ttl {
        /// What was given.
        got: u64,
    },
    /// The table is full.
    #[error("there are {NAMESPACES_MAX} namespaces already; delete one first")]
    TooMany,
}

impl NamespaceSpec {
    /// The counter spec this namespace gives, checked as a creation checks it: the
    /// shard count an auto namespace starts at, bounds that include 0, a `ttl_ms`
    /// within its bound.
    pub fn counter_spec(&self) -> Result<CounterSpec, NamespaceError> {
        if let Some(ttl) = self.ttl_ms {
            if ttl == 0 || ttl > NAMESPACE_TTL_MS_MAX {
                return Err(NamespaceError::Ttl { got: ttl });
            }
        }
        let mut patch = self.patch;
        if let Some(auto) = self.auto {
            auto.validate()?;
            if patch.shards.is_some() {
                return Err(SpecError::AutoAndFixed.into());
            }
            if patch.min.is_some() || patch.max.is_some() || patch.limit.is_some() {
                return Err(SpecError::BoundedAuto.into());
            }
            patch.shards = Some(auto.min_shards);
        }
        let spec = CounterSpec::default().patched(&patch)?;
        if spec.min.is_some_and(|m| m > 0) || spec.max.is_some_and(|m| m < 0) {
            return Err(SpecError::BoundsExcludeZero { min: spec.min, max: spec.max }.into());
        }
        Ok(spec)
    }
}

/// Checks a namespace prefix: what a counter name may start with.
pub fn check_prefix(prefix: &str) -> Result<(), NamespaceError> {
    crate::name::CounterName::new(prefix)
        .map(|_| ())
        .map_err(|e| NamespaceError::Prefix { reason: e.to_string() })
}

/// The namespaces, by prefix.
pub type Namespaces = BTreeMap<String, NamespaceSpec>;

/// The namespace whose prefix is the longest that starts `name`, if any.
pub fn longest_match<'a>(table: &'a Namespaces, name: &str) -> Option<(&'a str, &'a NamespaceSpec)> {
    if table.is_empty() {
        return None;
    }
    // At most one look-up per length of `name`, longest first.
    (1..=name.len())
        .rev()
        .filter(|&len| name.is_char_boundary(len))
        .find_map(|len| table.get_key_value(&name[..len]).map(|(k, v)| (k.as_str(), v)))
}

/// What an implicit creation of `name` gets: its longest namespace's spec, else
/// `default` (the node's default).
pub fn spec_for<'a>(table: &'a Namespaces, name: &str, default: &'a NamespaceSpec) -> &'a NamespaceSpec {
    longest_match(table, name).map_or(default, |(_, spec)| spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Durability;

    fn ns(durability: Durability, min: Option<i64>) -> NamespaceSpec {
        NamespaceSpec {
            patch: SpecPatch { durability: Some(durability), min, ..SpecPatch::default() },
            ..NamespaceSpec::default()
        }
    }

    #[test]
    fn the_longest_prefix_wins_and_others_take_the_default() {
        let mut table = Namespaces::new();
        table.insert("stock:".into(), ns(Durability::Sync, Some(0)));
        table.insert("stock:eu:".into(), ns(Durability::Sync, None));
        table.insert("s".into(), ns(Durability::Batched, None));
        assert_eq!(longest_match(&table, "stock:eu:42").map(|(p, _)| p), Some("stock:eu:"));
        assert_eq!(longest_match(&table, "stock:us:1").map(|(p, _)| p), Some("stock:"));
        assert_eq!(longest_match(&table, "stock:").map(|(p, _)| p), Some("stock:"), "a name equal to it");
        assert_eq!(longest_match(&table, "sales").map(|(p, _)| p), Some("s"));
        assert_eq!(longest_match(&table, "likes:1"), None);
        let default = NamespaceSpec::default();
        assert_eq!(spec_for(&table, "likes:1", &default), &default);
        assert_eq!(spec_for(&table, "stock:us:1", &default).patch.min, Some(0));
    }

    #[test]
    fn a_namespace_refuses_what_a_creation_would() {
        let bounded = ns(Durability::Sync, Some(0));
        // What a creation would refuse is refused when the namespace is declared.
        assert!(ns(Durability::Batched, Some(0)).counter_spec().is_err(), "bounds need sync");
        assert!(ns(Durability::Sync, Some(5)).counter_spec().is_err(), "bounds must include 0");
        let zero = NamespaceSpec { ttl_ms: Some(0), ..NamespaceSpec::default() };
        assert_eq!(zero.counter_spec(), Err(NamespaceError::Ttl { got: 0 }));
        let mut bounded_auto = bounded;
        bounded_auto.auto = Some(AutoShards { min_shards: 1, max_shards: 4 });
        assert!(bounded_auto.counter_spec().is_err(), "a bounded counter has a fixed shard count");
        assert!(check_prefix("stock:").is_ok());
        assert!(check_prefix("").is_err());
    }
}
