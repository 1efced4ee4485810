//! Re-adding a node whose disk was replaced, run by the leader.
//!
//! The leader's replication state for a voter remembers what that voter
//! acknowledged. A voter that comes back with an empty log under the same id
//! contradicts it (openraft asserts it cannot happen), so the old incarnation is
//! first removed from the raft membership, which drops that state. Then:
//!
//! 1. [`Request::ReplaceStore`] records the new incarnation and that its earlier
//!    data is lost (the RPC guard now lets the leader reach it);
//! 2. the node is added as a learner and caught up from the log or a snapshot;
//! 3. it is promoted to voter.
//!
//! Every step is idempotent and the caller retries the whole request, so an
//! interrupted replacement (a leader crash, a timeout) resumes where it stopped.

use crate::rpc::ReplaceRequest;
use crate::state_machine::Shared;
use crate::types::{Raft, Request, Response};
use openraft::{BasicNode, ChangeMembers};
use std::collections::BTreeSet;

/// Runs the replacement of `req.node` by its new incarnation `req.store` on this
/// node, which must lead. An error explains what to retry.
pub(crate) async fn replace_voter(raft: &Raft, shared: &Shared, req: &ReplaceRequest) -> Result<(), String> {
    raft.ensure_linearizable().await.map_err(|e| format!("not the leader: {e}"))?;
    let node = req.node;
    let one: BTreeSet<u64> = [node].into();
    let (recorded, membership) = {
        let metrics = raft.metrics().borrow().clone();
        let recorded = shared.read().state.stores.get(&node).copied();
        (recorded, metrics.membership_config.membership().clone())
    };
    let is_voter = membership.voter_ids().any(|v| v == node);
    let is_learner = membership.learner_ids().any(|v| v == node);
    if recorded.map(|r| r.store) != Some(req.store) {
        if is_voter {
            tracing::warn!(node, store = %req.store, "removing the old incarnation of a voter whose disk was replaced");
            raft.change_membership(ChangeMembers::RemoveVoters(one.clone()), false)
                .await
                .map_err(|e| format!("cannot remove the old incarnation: {e}"))?;
        } else if is_learner {
            raft.change_membership(ChangeMembers::RemoveNodes(one.clone()), false)
                .await
                .map_err(|e| format!("cannot remove the old incarnation: {e}"))?;
        }
        let written = raft
            .client_write(Request::ReplaceStore { node, store: req.store })
            .await
            .map_err(|e| format!("cannot record the new incarnation: {e}"))?;
        if !matches!(written.data, Response::Store(Ok(_))) {
            return Err(format!("recording the new incarnation answered {:?}", written.data));
        }
    } else if is_voter {
        return Ok(());
    }
    tracing::info!(node, store = %req.store, addr = %req.addr, "adding the new incarnation as a learner");
    raft.add_learner(node, BasicNode { addr: req.addr.clone() }, true)
        .await
        .map_err(|e| format!("cannot add the new incarnation as a learner: {e}"))?;
    raft.change_membership(ChangeMembers::AddVoterIds(one), false)
        .await
        .map_err(|e| format!("cannot promote the new incarnation: {e}"))?;
    tracing::info!(node, store = %req.store, "the new incarnation is a voter");
    Ok(())
}
