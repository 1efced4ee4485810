//! [`RaftCatalog`]: the engine's `Catalog` over the metadata group.

use futures::future::BoxFuture;
use std::sync::Arc;
use tally_core::meta::{CounterMeta, MetaCommand, MetaEffect, MetaError};
use tally_core::namespace::NamespaceSpec;
use tally_core::spec::AutoShards;
use tally_core::CounterName;
use tally_engine::{Catalog, EnsureResults, Generations, TallyError};
use tally_raft::{MetaRaft, Rejection, Request};

/// Counter metadata replicated through the cluster's raft group.
pub struct RaftCatalog {
    pub(crate) raft: Arc<MetaRaft>,
}

/// `e` as the engine's error; `name` is the counter the request was for.
fn rejection(e: Rejection, name: &CounterName) -> TallyError {
    match e {
        Rejection::Resharding { target } => MetaError::Resharding { target }.into(),
        Rejection::TooManyGenerations { count } => MetaError::TooManyGenerations { count }.into(),
        Rejection::StaleGeneration { current, got } => MetaError::StaleGeneration { current, got }.into(),
        Rejection::Expired { expires_at_ms } => MetaError::Expired { expires_at_ms }.into(),
        Rejection::AutoStale { version, found } => {
            TallyError::AutoProposalStale { counter: name.to_string(), version, found }
        }
        other => TallyError::Unavailable { shard: "metadata".into(), reason: other.to_string() },
    }
}

/// The answer to a namespace request: whether the prefix was declared before.
fn namespace_answer(response: tally_raft::Response) -> Result<bool, TallyError> {
    match response {
        tally_raft::Response::Namespace(Ok(existed)) => Ok(existed),
        tally_raft::Response::Namespace(Err(why)) => Err(TallyError::Namespace(why)),
        other => Err(TallyError::Unavailable {
            shard: "metadata".into(),
            reason: format!("unexpected answer to a namespace request: {other:?}"),
        }),
    }
}

fn raft_error(e: tally_raft::RaftError) -> TallyError {
    TallyError::Unavailable { shard: "metadata".into(), reason: e.to_string() }
}

impl RaftCatalog {
    /// Replicates a request about counter `name` and returns what applying it answered.
    async fn write_counter(
        &self,
        name: &CounterName,
        req: Request,
    ) -> Result<(Option<CounterMeta>, MetaEffect), TallyError> {
        let response = self.raft.write(req).await.map_err(raft_error)?;
        match response.into_counter_result() {
            Some(Ok(r)) => Ok(r),
            Some(Err(e)) => Err(rejection(e, name)),
            None => {
                Err(TallyError::Unavailable { shard: "metadata".into(), reason: "unexpected answer".into() })
            }
        }
    }
}

impl Catalog for RaftCatalog {
    fn get(&self, name: &str) -> Result<Option<CounterMeta>, TallyError> {
        Ok(self.raft.counter(name))
    }

    fn current<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<CounterMeta>, TallyError>> {
        Box::pin(async move { self.raft.counter_linearizable(name).await.map_err(raft_error) })
    }

    fn apply<'a>(
        &'a self,
        name: &'a CounterName,
        cmd: &'a MetaCommand,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        Box::pin(async move {
            // Refuse a bad command here, with the exact error, before replicating it.
            self.raft.check(name, cmd, now_ms)?;
            self.write_counter(name, Request::Counter { name: name.clone(), cmd: cmd.clone(), now_ms }).await
        })
    }

    fn ensure_many<'a>(
        &'a self,
        names: &'a [CounterName],
        now_ms: u64,
        default: &'a NamespaceSpec,
    ) -> BoxFuture<'a, EnsureResults> {
        Box::pin(async move {
            // Refuse what the state would refuse here, with the exact error, and
            // replicate the rest in one entry.
            let ensure = MetaCommand::EnsureWith(*default);
            // A placeholder for each name to send, replaced by its answer below.
            let mut results: EnsureResults = names
                .iter()
                .map(|n| match self.raft.check(n, &ensure, now_ms) {
                    Ok(()) => Ok((None, MetaEffect::Unchanged)),
                    Err(e) => Err(e.into()),
                })
                .collect();
            let send: Vec<CounterName> =
                names.iter().zip(&results).filter(|(_, r)| r.is_ok()).map(|(n, _)| n.clone()).collect();
            if send.is_empty() {
                return results;
            }
            let mut answers = match self.raft.ensure_many(&send, *default, now_ms).await {
                Ok(answers) => answers.into_iter(),
                Err(e) => {
                    let e = raft_error(e);
                    return results.into_iter().map(|r| r.and_then(|_| Err(e.clone()))).collect();
                }
            };
            for (name, result) in names.iter().zip(results.iter_mut()) {
                if result.is_ok() {
                    let answer = answers.next().expect("one answer per name sent");
                    *result =
                        answer.map(|(meta, effect)| (meta, effect.into())).map_err(|e| rejection(e, name));
                }
            }
            results
        })
    }

    fn auto_shards(&self, name: &str) -> Result<Option<AutoShards>, TallyError> {
        Ok(self.raft.auto_shards(name))
    }

    fn auto_counters(&self) -> Result<Vec<(CounterName, AutoShards)>, TallyError> {
        Ok(self.raft.auto_counters())
    }

    fn apply_auto<'a>(
        &'a self,
        name: &'a CounterName,
        cmd: &'a MetaCommand,
        auto: Option<AutoShards>,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        Box::pin(async move {
            self.raft.check(name, cmd, now_ms)?;
            let req = Request::CounterAuto { name: name.clone(), cmd: cmd.clone(), auto, now_ms };
            self.write_counter(name, req).await
        })
    }

    fn auto_reshard<'a>(
        &'a self,
        name: &'a CounterName,
        version: u64,
        shards: u16,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        Box::pin(async move {
            let req = Request::AutoReshard { name: name.clone(), version, shards, now_ms };
            self.write_counter(name, req).await
        })
    }

    fn pending_reshards(&self) -> Result<Vec<CounterName>, TallyError> {
        Ok(self.raft.pending_reshards())
    }

    fn expired(&self, now_ms: u64, limit: usize) -> Result<Vec<CounterName>, TallyError> {
        Ok(self.raft.expired_counters(now_ms, limit))
    }

    fn reclaims_expired(&self) -> bool {
        self.raft.is_leader()
    }

    fn count(&self) -> Result<(u64, u64), TallyError> {
        Ok(self.raft.counter_count())
    }

    fn namespaces(&self) -> Result<tally_core::namespace::Namespaces, TallyError> {
        Ok(self.raft.namespaces())
    }

    fn put_namespace<'a>(
        &'a self,
        prefix: &'a str,
        spec: tally_core::namespace::NamespaceSpec,
    ) -> BoxFuture<'a, Result<bool, TallyError>> {
        Box::pin(async move {
            let req = Request::PutNamespace { prefix: prefix.to_owned(), spec };
            namespace_answer(self.raft.write(req).await.map_err(raft_error)?)
        })
    }

    fn delete_namespace<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<bool, TallyError>> {
        Box::pin(async move {
            let req = Request::DeleteNamespace { prefix: prefix.to_owned() };
            namespace_answer(self.raft.write(req).await.map_err(raft_error)?)
        })
    }

    fn tombstones(&self) -> Result<Vec<(CounterName, Generations)>, TallyError> {
        Ok(self.raft.tombstones().into_iter().collect())
    }

    fn tombstone(&self, name: &str) -> Result<Option<Generations>, TallyError> {
        Ok(self.raft.tombstones().into_iter().find(|(n, _)| n.as_str() == name).map(|(_, g)| g))
    }

    fn clear_tombstone<'a>(&'a self, name: &'a CounterName) -> BoxFuture<'a, Result<(), TallyError>> {
        Box::pin(async move {
            self.raft.write(Request::ClearTombstone { name: name.clone() }).await.map_err(raft_error)?;
            Ok(())
        })
    }

    fn list(
        &self,
        prefix: &str,
        after: Option<&CounterName>,
        limit: usize,
    ) -> Result<Vec<CounterName>, TallyError> {
        Ok(self.raft.counter_names(prefix, after, limit))
    }
}
