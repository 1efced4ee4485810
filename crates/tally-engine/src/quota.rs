//! Quotas: how many counters may exist (on the node, and under a name prefix), how
//! many event ids a counter keeps, and how many bytes its sketches may take.
//!
//! * **Counters** are checked where a counter is created — its first increment
//!   ([`crate::create::Creator`]) or `PUT` of an unknown name — against counts kept
//!   per rule: counted from the catalog when the engine opens and every
//!   [`QUOTA_RECOUNT_MS`] (which picks up counters created through other nodes of a
//!   cluster, and deletions), and raised by each creation here in between. A cluster
//!   may so overshoot a rule by what other nodes create within one recount.
//! * **Event ids** are checked where a shard adds a dedup record
//!   (`tally_core::shard::decide`): each shard keeps at most its share of the
//!   counter's quota (rounded up), counted from its records when it starts.
//! * **Sketch bytes** are checked when a spec is put: the count-min tables of every
//!   shard, the distinct sketch's bound and the window buckets' totals.
//!
//! A refusal is [`TallyError::QuotaExceeded`] (507 `quota_exceeded`), counted in
//! [`crate::Stats`] by quota.

use crate::catalog::Catalog;
use crate::error::TallyError;
use std::sync::atomic::{AtomicU64, Ordering};
use tally_core::name::quoted;
use tally_core::spec::{CounterSpec, SpecPatch};
use tally_core::CounterName;

/// How often the counts of counters are taken again from the catalog, in
/// milliseconds.
pub const QUOTA_RECOUNT_MS: u64 = 10_000;
/// Names one page of a recount reads from the catalog.
const RECOUNT_PAGE_NAMES: usize = 1000;
/// Names a rule's recount reads per [`QUOTA_RECOUNT_MS`] on average: a rule over
/// more counters is recounted less often, so the recounts of a node of millions of
/// counters stay a small cost.
const RECOUNT_NAMES_PER_INTERVAL: u64 = 100_000;
/// Bytes a distinct counter's sketch may take at most (its dense form, whatever its
/// shard count: members route to the shard that owns their registers).
const DISTINCT_BYTES_BOUND: u64 = tally_core::sketch::DENSE_BYTES as u64;
/// Buckets each window keeps per shard.
const WINDOW_BUCKETS: u64 = 60;
/// Bytes of one window bucket's total.
const WINDOW_BUCKET_BYTES: u64 = 8;

/// A bound on the counters whose names start with `prefix` (`""`: every counter).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CounterQuota {
    /// The names it covers.
    pub prefix: String,
    /// Most counters with such names.
    pub counters_max: u64,
}

/// One quota rule and its count.
#[derive(Debug)]
struct Rule {
    quota: CounterQuota,
    /// What the catalog held at the last recount, plus creations here since.
    count: AtomicU64,
    /// When the rule is next recounted, in the engine clock's milliseconds.
    next_recount_ms: AtomicU64,
}

/// The engine's quotas and their counts (see the module docs).
#[derive(Debug)]
pub(crate) struct Quotas {
    rules: Vec<Rule>,
    event_ids_per_counter_max: u64,
    sketch_bytes_per_counter_max: u64,
}

impl Quotas {
    pub(crate) fn new(config: &crate::TallyConfig) -> Self {
        let node = CounterQuota { prefix: String::new(), counters_max: config.counters_max };
        let rules = std::iter::once(node)
            .chain(config.counter_quotas.iter().cloned())
            .map(|quota| Rule { quota, count: AtomicU64::new(0), next_recount_ms: AtomicU64::new(0) })
            .collect();
        Self {
            rules,
            event_ids_per_counter_max: config.event_ids_per_counter_max,
            sketch_bytes_per_counter_max: config.sketch_bytes_per_counter_max,
        }
    }

    /// Counts the counters of each rule that is due at `now_ms` in `catalog` again (up
    /// to the rule's limit: a full rule needs no more), and when it is next due.
    pub(crate) fn recount(&self, catalog: &dyn Catalog, now_ms: u64) -> Result<(), TallyError> {
        for rule in &self.rules {
            if rule.next_recount_ms.load(Ordering::Acquire) > now_ms {
                continue;
            }
            let mut count = 0u64;
            let mut after: Option<CounterName> = None;
            loop {
                let page = catalog.list(&rule.quota.prefix, after.as_ref(), RECOUNT_PAGE_NAMES)?;
                count += page.len() as u64;
                if page.len() < RECOUNT_PAGE_NAMES || count >= rule.quota.counters_max {
                    break;
                }
                after = page.last().cloned();
            }
            rule.count.store(count, Ordering::Release);
            let intervals = (count / RECOUNT_NAMES_PER_INTERVAL).max(1);
            rule.next_recount_ms.store(now_ms + QUOTA_RECOUNT_MS * intervals, Ordering::Release);
        }
        Ok(())
    }

    /// Whether one more counter named `name` fits every rule that covers it.
    pub(crate) fn admit_counter(&self, name: &CounterName) -> Result<(), TallyError> {
        for rule in self.rules.iter().filter(|r| name.as_str().starts_with(r.quota.prefix.as_str())) {
            if rule.count.load(Ordering::Acquire) >= rule.quota.counters_max {
                let (field, over) = if rule.quota.prefix.is_empty() {
                    ("engine.counters_max", "on this node".to_string())
                } else {
                    ("quotas.counters_max", format!("named {}…", quoted(&rule.quota.prefix)))
                };
                return Err(TallyError::QuotaExceeded {
                    quota: field,
                    what: format!(
                        "counter {} would be one more than the {} counters allowed {over}",
                        quoted(name.as_str()),
                        rule.quota.counters_max
                    ),
                });
            }
        }
        Ok(())
    }

    /// Counts a counter this node created.
    pub(crate) fn created(&self, name: &CounterName) {
        for rule in self.rules.iter().filter(|r| name.as_str().starts_with(r.quota.prefix.as_str())) {
            rule.count.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// A shard's share of the counter's event-id quota: `None` when unbounded.
    pub(crate) fn event_ids_per_shard(&self, shards: u16) -> Option<u64> {
        (self.event_ids_per_counter_max < u64::MAX)
            .then(|| self.event_ids_per_counter_max.div_ceil(u64::from(shards.max(1))))
    }

    /// The counter's event-id quota, for the refusal's message.
    pub(crate) fn event_ids_per_counter(&self) -> u64 {
        self.event_ids_per_counter_max
    }

    /// Whether a counter whose spec is `current` (the defaults for a new one) with
    /// `patch` on top keeps its sketches within the quota.
    pub(crate) fn admit_spec(
        &self,
        name: &CounterName,
        current: &CounterSpec,
        patch: &SpecPatch,
        shards_max: u16,
    ) -> Result<(), TallyError> {
        let shards = u64::from(patch.shards.unwrap_or(current.shards).max(shards_max));
        let frequency = patch.frequency.or(current.frequency);
        let per_shard = match &frequency {
            Some(f) => tally_core::frequency::FrequencySketch::new(f).map_or(0, |s| s.size_bytes() as u64),
            None => 0,
        };
        let distinct = if patch.distinct.unwrap_or(current.distinct) { DISTINCT_BYTES_BOUND } else { 0 };
        let windows = patch.windows.as_ref().unwrap_or(&current.windows).len() as u64;
        let bytes = shards.saturating_mul(per_shard).saturating_add(distinct).saturating_add(
            shards.saturating_mul(windows).saturating_mul(WINDOW_BUCKETS * WINDOW_BUCKET_BYTES),
        );
        if bytes > self.sketch_bytes_per_counter_max {
            return Err(TallyError::QuotaExceeded {
                quota: "engine.sketch_bytes_per_counter_max",
                what: format!(
                    "counter {}'s sketches would take {bytes} bytes ({shards} shards); the quota is {} \
                     (fewer shards, a larger epsilon or delta, or fewer windows fit)",
                    quoted(name.as_str()),
                    self.sketch_bytes_per_counter_max
                ),
            });
        }
        Ok(())
    }
}

/// Recounts the quotas that are due every [`QUOTA_RECOUNT_MS`] while the engine
/// lives (`Quotas::recount`): counters created through other nodes and deletions
/// show in the counts.
pub(crate) fn recount_every_interval(ctx: &std::sync::Arc<crate::ctx::Ctx>) {
    let weak = std::sync::Arc::downgrade(ctx);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(QUOTA_RECOUNT_MS)).await;
            let Some(ctx) = weak.upgrade() else { return };
            let (quotas, catalog, now_ms) = (ctx.quotas.clone(), ctx.catalog.clone(), ctx.now_ms());
            drop(ctx);
            let counted = tokio::task::spawn_blocking(move || quotas.recount(&*catalog, now_ms)).await;
            if let Ok(Err(e)) = counted {
                tracing::warn!(error = %e, "cannot recount the counter quotas; the counts stay as they were");
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_core::frequency::FrequencySpec;

    fn quotas(counters_max: u64, rules: &[(&str, u64)], sketch_bytes: u64) -> Quotas {
        let config = crate::TallyConfig {
            counters_max,
            counter_quotas: rules
                .iter()
                .map(|(p, n)| CounterQuota { prefix: p.to_string(), counters_max: *n })
                .collect(),
            sketch_bytes_per_counter_max: sketch_bytes,
            event_ids_per_counter_max: 1000,
            ..crate::TallyConfig::default()
        };
        Quotas::new(&config)
    }

    fn name(n: &str) -> CounterName {
        CounterName::new(n).expect("name")
    }

    #[test]
    fn counters_are_admitted_within_every_rule_that_covers_them() {
        let q = quotas(3, &[("likes:", 1)], u64::MAX);
        q.admit_counter(&name("likes:1")).expect("room");
        q.created(&name("likes:1"));
        let refused = q.admit_counter(&name("likes:2")).expect_err("the prefix is full");
        assert!(
            matches!(refused, TallyError::QuotaExceeded { quota: "quotas.counters_max", .. }),
            "{refused}"
        );
        assert_eq!(refused.http_status(), 507);
        q.created(&name("views:1"));
        q.created(&name("views:2"));
        let refused = q.admit_counter(&name("views:3")).expect_err("the node is full");
        assert!(
            matches!(refused, TallyError::QuotaExceeded { quota: "engine.counters_max", .. }),
            "{refused}"
        );
        assert_eq!(q.event_ids_per_shard(8), Some(125));
        assert_eq!(q.event_ids_per_shard(7), Some(143), "rounded up");
    }

    #[test]
    fn a_spec_whose_sketches_outgrow_the_quota_is_refused() {
        let q = quotas(u64::MAX, &[], 4 << 20);
        let current = CounterSpec::default();
        let frequency = FrequencySpec { epsilon: 0.001, delta: 0.01 };
        let patch = SpecPatch { frequency: Some(frequency), shards: Some(16), ..SpecPatch::default() };
        q.admit_spec(&name("pages"), &current, &patch, 0).expect("16 shards of a small table fit");
        let patch = SpecPatch { shards: Some(1024), ..patch };
        let refused = q.admit_spec(&name("pages"), &current, &patch, 0).expect_err("1024 do not");
        assert!(refused.to_string().contains("1024 shards"), "{refused}");
    }
}
