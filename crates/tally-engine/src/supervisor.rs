//! The supervisor: the only actor that starts and stops shard actors.
//!
//! Shards start on demand and stop when idle, so a node holding a million counters
//! runs actors only for the ones in use. Two actors for one shard would each believe
//! they hold its value, so the supervisor keeps exactly one: a shard that is draining
//! to a stop is replaced only after it has terminated, and callers that asked for it
//! meanwhile wait.

use crate::ctx::Ctx;
use crate::error::TallyError;
use crate::messages::{ShardMsg, SpawnReply, SupervisorMsg};
use crate::shard::{ShardActor, ShardArgs};
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use tally_core::meta::CounterMeta;
use tally_core::ShardId;

/// The supervisor actor.
pub(crate) struct Supervisor;

/// What the supervisor tracks.
pub(crate) struct SupervisorState {
    ctx: Weak<Ctx>,
    /// Running shard actors by actor id.
    by_actor: HashMap<ActorId, ShardId>,
    /// Shards draining to a stop, with the requests waiting for them to end.
    draining: HashMap<ShardId, Vec<Waiting>>,
}

enum Waiting {
    Spawn(Arc<CounterMeta>, SpawnReply),
    Stopped(RpcReplyPort<()>),
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = Weak<Ctx>;

    async fn pre_start(
        &self,
        _myself: ActorRef<SupervisorMsg>,
        ctx: Weak<Ctx>,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        Ok(SupervisorState { ctx, by_actor: HashMap::new(), draining: HashMap::new() })
    }

    async fn handle(
        &self,
        myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let Some(ctx) = state.ctx.upgrade() else { return Ok(()) };
        match msg {
            SupervisorMsg::Spawn { id, meta, reply } => {
                if let Some(waiting) = state.draining.get_mut(&id) {
                    waiting.push(Waiting::Spawn(meta, reply));
                } else {
                    state.spawn(&ctx, &myself, id, meta, reply).await;
                }
            }
            SupervisorMsg::Retire { id, actor } => {
                if ctx.directory.get(&id).is_some_and(|a| a.get_id() == actor) {
                    state.begin_drain(&ctx, &id);
                    ctx.stats.shard_retirements.inc();
                }
            }
            SupervisorMsg::Stop { id, reply } => {
                // A first write without an actor (`cold.rs`) is a running shard too:
                // the stop waits for it.
                if let Some(lock) = crate::cold::writer(&ctx, &id) {
                    let me = myself.clone();
                    tokio::spawn(async move {
                        drop(lock.lock().await);
                        let _ = me.send_message(SupervisorMsg::Stop { id, reply });
                    });
                    return Ok(());
                }
                if ctx.directory.contains_key(&id) {
                    state.begin_drain(&ctx, &id);
                }
                match state.draining.get_mut(&id) {
                    Some(waiting) => waiting.push(Waiting::Stopped(reply)),
                    None => {
                        let _ = reply.send(());
                    }
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        evt: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let Some(ctx) = state.ctx.upgrade() else { return Ok(()) };
        let ended = match &evt {
            SupervisionEvent::ActorTerminated(cell, _, _) => Some(cell.get_id()),
            SupervisionEvent::ActorFailed(cell, err) => {
                tracing::error!(actor = %cell.get_id(), error = %err, "shard actor failed");
                Some(cell.get_id())
            }
            _ => None,
        };
        let Some(actor) = ended else { return Ok(()) };
        let Some(id) = state.by_actor.remove(&actor) else { return Ok(()) };
        ctx.directory.remove_if(&id, |_, a| a.get_id() == actor);
        for w in state.draining.remove(&id).unwrap_or_default() {
            match w {
                Waiting::Spawn(meta, reply) => {
                    state.spawn(&ctx, &myself, id.clone(), meta, reply).await;
                }
                Waiting::Stopped(reply) => {
                    let _ = reply.send(());
                }
            }
        }
        Ok(())
    }
}

impl SupervisorState {
    /// Starts shard `id` unless it runs, and answers its actor on `reply`. While a
    /// first write without an actor is under way (`cold.rs`), the start waits for it
    /// and is asked again.
    async fn spawn(
        &mut self,
        ctx: &Arc<Ctx>,
        myself: &ActorRef<SupervisorMsg>,
        id: ShardId,
        meta: Arc<CounterMeta>,
        reply: SpawnReply,
    ) {
        if let Some(a) = ctx.directory.get(&id) {
            let _ = reply.send(Ok(a.clone()));
            return;
        }
        if let Err(lock) = crate::cold::begin_spawn(ctx, &id) {
            let me = myself.clone();
            tokio::spawn(async move {
                drop(lock.lock().await);
                let _ = me.send_message(SupervisorMsg::Spawn { id, meta, reply });
            });
            return;
        }
        let r = self.start(ctx, myself, id.clone(), meta).await;
        crate::cold::end_spawn(ctx, &id);
        let _ = reply.send(r);
    }

    async fn start(
        &mut self,
        ctx: &Arc<Ctx>,
        myself: &ActorRef<SupervisorMsg>,
        id: ShardId,
        meta: Arc<CounterMeta>,
    ) -> Result<ActorRef<ShardMsg>, TallyError> {
        if let Some(a) = ctx.directory.get(&id) {
            return Ok(a.clone());
        }
        // Only the owner runs a shard: once a membership change has moved it, this
        // node never starts it again (its hand-off relies on that).
        if let Some((_, owner)) = ctx.remote(&id) {
            return Err(crate::error::unavailable(&id, &format!("{owner} owns it now")));
        }
        // Start from the newest metadata this node knows.
        let meta = ctx
            .registry
            .get(id.counter.as_str())
            .map(|rt| rt.meta.clone())
            .filter(|m| m.version >= meta.version)
            .unwrap_or(meta);
        let args = ShardArgs { id: id.clone(), meta, ctx: ctx.clone() };
        match Actor::spawn_linked(None, ShardActor, args, myself.get_cell()).await {
            Ok((actor, _)) => {
                self.by_actor.insert(actor.get_id(), id.clone());
                ctx.directory.insert(id, actor.clone());
                Ok(actor)
            }
            Err(e) => {
                // A failed `pre_start` (a record that does not decode, a store read
                // error) is an error of this shard alone: say what it is, not
                // ractor's "panicked during startup".
                let reason = match &e {
                    ractor::SpawnErr::StartupFailed(inner) => inner.to_string(),
                    other => other.to_string(),
                };
                tracing::warn!(shard = %id, error = %reason, "cannot start a shard; requests that need it fail");
                Err(crate::error::unavailable(&id, &format!("cannot start: {reason}")))
            }
        }
    }

    fn begin_drain(&mut self, ctx: &Ctx, id: &ShardId) {
        if let Some((_, actor)) = ctx.directory.remove(id) {
            self.draining.entry(id.clone()).or_default();
            if actor.drain().is_err() {
                // Already stopping; its termination event completes the drain.
                tracing::debug!(shard = %id, "shard already stopping");
            }
        }
    }
}
