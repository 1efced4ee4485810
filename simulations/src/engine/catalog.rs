//! The metadata catalog of a tier-2 cluster: one log of committed versions, shared,
//! with a per-node view that lags it (and, after a restart, may be stale for a
//! while). Writes go through `tally_core::meta::apply_command`, the function the
//! replicated catalog applies, and fail during a metadata leader failover. After a
//! commit every node is told of the change once its view has caught up, as the
//! cluster's raft apply loop does.

use super::world::{lock, Shared};
use futures::future::BoxFuture;
use std::time::Duration;
use tally_core::meta::{apply_command, CounterMeta, MetaCommand, MetaEffect};
use tally_core::spec::AutoShards;
use tally_core::CounterName;
use tally_engine::{Catalog, Generations, TallyError};

/// One node's view of the catalog.
pub(crate) struct SimCatalog {
    pub(crate) world: Shared,
    pub(crate) node: u8,
}

impl Catalog for SimCatalog {
    fn get(&self, name: &str) -> Result<Option<CounterMeta>, TallyError> {
        Ok(lock(&self.world).meta_view(self.node, name))
    }

    /// The log's latest version, as a leader's read index would give it; refused
    /// while the metadata leader fails over.
    fn current<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<CounterMeta>, TallyError>> {
        Box::pin(async move {
            let mut w = lock(&self.world);
            if w.now() < w.meta_down_until {
                w.note("meta-read-refused", (self.node, name));
                return Err(TallyError::Unavailable {
                    shard: name.to_string(),
                    reason: "metadata leader failing over".into(),
                });
            }
            w.note("meta-read", (self.node, name));
            Ok(w.meta_latest(name))
        })
    }

    fn apply<'a>(
        &'a self,
        name: &'a CounterName,
        cmd: &'a MetaCommand,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        Box::pin(async move {
            let notify = {
                let mut w = lock(&self.world);
                let now = w.now();
                if now < w.meta_down_until {
                    w.note("meta-refused", (self.node, name.as_str()));
                    return Err(TallyError::Unavailable {
                        shard: name.to_string(),
                        reason: "metadata leader failing over".into(),
                    });
                }
                let current = w.meta_latest(name.as_str());
                let (next, effect) = apply_command(current, cmd, now_ms)?;
                let Some(meta) = next.clone() else {
                    return Ok((next, effect));
                };
                if effect == MetaEffect::Created {
                    // As the metadata group records a counter's replica class.
                    let members: Vec<u8> =
                        w.placements.last().expect("the initial placement").members.to_vec();
                    let class = meta.spec.replica_class();
                    if tally_core::ranges::record_class(&mut w.classes, class, &members) {
                        w.note("meta-class", (class, &members));
                    }
                }
                let versions = w.meta.entry(name.to_string()).or_default();
                if versions.last().is_none_or(|v| v.meta.version != meta.version) {
                    versions.push(super::world::MetaVersion { at_ms: now, meta });
                }
                w.note("meta-commit", (self.node, name.as_str(), next.as_ref().map(|m| m.version)));
                let nodes = w.nodes.len() as u8;
                let mut notify = Vec::new();
                for n in 0..nodes {
                    let node = &w.nodes[usize::from(n)];
                    let mut wait = node.meta_lag_ms + 1;
                    if let Some((until, _)) = node.meta_stale {
                        wait = wait.max(until.saturating_sub(now) + 1);
                    }
                    notify.push((n, wait));
                }
                Ok::<_, TallyError>((next, effect, notify))
            };
            let (next, effect, notify) = notify?;
            for (n, wait) in notify {
                let world = self.world.clone();
                let name = name.to_string();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(wait)).await;
                    let tally = lock(&world).nodes[usize::from(n)].tally.clone();
                    if let Some(t) = tally {
                        let _ = t.metadata_changed(&name).await;
                    }
                });
            }
            Ok((next, effect))
        })
    }

    fn auto_shards(&self, name: &str) -> Result<Option<AutoShards>, TallyError> {
        Ok(lock(&self.world).auto.get(name).copied())
    }

    fn auto_counters(&self) -> Result<Vec<(CounterName, AutoShards)>, TallyError> {
        let w = lock(&self.world);
        Ok(w.auto.iter().filter_map(|(n, b)| Some((CounterName::new(n.as_str()).ok()?, *b))).collect())
    }

    /// The command, then the bounds, with no await between: a crash (which aborts a
    /// node's tasks at an await) never separates them.
    fn apply_auto<'a>(
        &'a self,
        name: &'a CounterName,
        cmd: &'a MetaCommand,
        auto: Option<AutoShards>,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        Box::pin(async move {
            let out = self.apply(name, cmd, now_ms).await?;
            let mut w = lock(&self.world);
            w.note("meta-auto", (self.node, name.as_str(), auto));
            match auto {
                Some(b) if out.0.is_some() => w.auto.insert(name.to_string(), b),
                _ => w.auto.remove(name.as_str()),
            };
            Ok(out)
        })
    }

    /// Checked against the log's latest version, as the replicated state machine's
    /// version check would be: two nodes proposing from one version, one wins.
    fn auto_reshard<'a>(
        &'a self,
        name: &'a CounterName,
        version: u64,
        shards: u16,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        Box::pin(async move {
            let cmd =
                MetaCommand::Put(tally_core::spec::SpecPatch { shards: Some(shards), ..Default::default() });
            {
                let mut w = lock(&self.world);
                let found = w.meta_latest(name.as_str()).map(|m| m.version);
                if found != Some(version) || !w.auto.contains_key(name.as_str()) {
                    w.note("auto-stale", (self.node, name.as_str(), version, found));
                    return Err(TallyError::AutoProposalStale { counter: name.to_string(), version, found });
                }
                w.note("auto-reshard", (self.node, name.as_str(), shards));
            }
            // No await between the check and the commit below (the runtime has one
            // thread): nothing can commit in between.
            self.apply(name, &cmd, now_ms).await
        })
    }

    fn pending_reshards(&self) -> Result<Vec<CounterName>, TallyError> {
        let w = lock(&self.world);
        let names: Vec<String> = w.meta.keys().cloned().collect();
        Ok(names
            .into_iter()
            .filter(|n| w.meta_view(self.node, n).is_some_and(|m| m.layout.resharding.is_some()))
            .filter_map(|n| CounterName::new(n).ok())
            .collect())
    }

    // Counters are never deleted in a simulated run.
    fn tombstones(&self) -> Result<Vec<(CounterName, Generations)>, TallyError> {
        Ok(Vec::new())
    }

    fn tombstone(&self, _name: &str) -> Result<Option<Generations>, TallyError> {
        Ok(None)
    }

    fn clear_tombstone<'a>(&'a self, _name: &'a CounterName) -> BoxFuture<'a, Result<(), TallyError>> {
        Box::pin(async { Ok(()) })
    }

    fn list(
        &self,
        prefix: &str,
        after: Option<&CounterName>,
        limit: usize,
    ) -> Result<Vec<CounterName>, TallyError> {
        let w = lock(&self.world);
        Ok(w.meta
            .keys()
            .filter(|n| n.starts_with(prefix) && after.is_none_or(|a| n.as_str() > a.as_str()))
            .filter(|n| w.meta_view(self.node, n).is_some())
            .take(limit)
            .filter_map(|n| CounterName::new(n.as_str()).ok())
            .collect())
    }
}
