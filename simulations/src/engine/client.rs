//! The tier-2 clients: tier 1's workload ([`crate::workload`]: the same counters and
//! the same mix of operations) run as tasks that call the engines' embedded API
//! through a client link with delay and loss. A timed-out attempt is retried with the
//! same event id; once the cluster has healed every unknown outcome is resolved and
//! the settler reconciles and takes the final reads, as in tier 1.

use super::world::{lock, now_ms, Shared};
use crate::config::*;
use crate::history::{
    Attempt, CounterInfo, DeleteOp, Deleted, DistinctOp, FaultKind, FrequencyAnswer, FrequencyOp, IncrOp,
    ReadOp, ReconcileOp, Role, Status, WindowOp, WindowValue,
};
use crate::msg::{Answer, Consistency, ReadValue};
use crate::workload::{bounded_plans, counter_plans, counters_of, draw_engine_op, member_name, Draw};
use rand::Rng;
use std::future::Future;
use std::time::Duration;
use tally_engine::{Increment, Tally, TallyError};

/// Setup waits this long after creating the counters, so every node's view has them.
const SETUP_SETTLE_MS: u64 = 100;

/// The workload counter whose shard count follows contention (bounds
/// [`AUTO_BOUNDS`]); its machine reshards it while faults strike, and the checker
/// holds it to the same exact totals as every `sync` counter.
pub(crate) const AUTO_COUNTER: &str = "sync:1";
/// Its bounds.
const AUTO_BOUNDS: tally_engine::AutoPatch =
    tally_engine::AutoPatch { auto: true, min_shards: Some(1), max_shards: Some(8) };

/// Creates the workload's counters through node 1 and records them: tier 1's, then
/// the bounded ones.
pub(crate) async fn create_counters(w: &Shared) -> Result<(), String> {
    let (plans, tally) = {
        let mut g = lock(w);
        let mut plans = counter_plans(&mut g.rng);
        // The distinct counter keeps frequencies too (its members are its items):
        // set without a draw, so every counter is drawn as before.
        for plan in plans.iter_mut().filter(|p| p.1 == Role::Distinct) {
            plan.2.frequency = Some(FREQUENCY);
        }
        plans.extend(bounded_plans(&mut g.rng));
        if g.cfg.short_dedup() {
            plans.push(crate::workload::short_dedup_plan(&mut g.rng));
        }
        if g.cfg.replicas > 1 {
            // Counters keep the cluster's copies or state their own: as many, which
            // puts them in groups of their own, or one on every node of the run.
            let choices = [None, Some(g.cfg.replicas), Some(tally_core::ranges::REPLICAS_MAX)];
            for plan in &mut plans {
                plan.2.replicas = choices[g.rng.random_range(0..choices.len())];
            }
        }
        (plans, g.nodes[0].tally.clone())
    };
    let tally = tally.ok_or("node1 is not open")?;
    for (name, role, patch, offline_extra) in plans {
        let out = if name == AUTO_COUNTER {
            let patch = tally_engine::SpecPatch { shards: None, ..patch };
            tally.put_counter_auto(&name, patch, AUTO_BOUNDS).await
        } else {
            tally.put_counter(&name, patch).await
        }
        .map_err(|e| format!("creating {name}: {e}"))?;
        lock(w).history.counters.push(CounterInfo { name, role, spec: out.counter.spec, offline_extra });
    }
    if lock(w).cfg.deletions() {
        create_recreated(w, &tally).await?;
    }
    tokio::time::sleep(Duration::from_millis(SETUP_SETTLE_MS)).await;
    Ok(())
}

/// The frequency sketch of the distinct counter (tiers 2 and 3).
const FREQUENCY: tally_core::frequency::FrequencySpec =
    tally_core::frequency::FrequencySpec { epsilon: 0.02, delta: 0.02 };
/// Members a frequency read asks for among the heaviest.
const TOP_K: u32 = 10;

/// Clients that write to [`RECREATED_COUNTER`] (beside the run's own).
const RECREATING_CLIENTS: u16 = 2;
/// Share of a re-creating client's operations that are fresh reads, in percent.
const RECREATING_READ_PERCENT: u32 = 20;
/// Largest delta a re-creating client adds.
const RECREATING_DELTA_MAX: i64 = 3;
/// How long the operator waits for a deletion's answer: past the metadata group's
/// retries of its proposal and the engine's cleanup of its shards.
const DELETE_WAIT_MS: u64 = 15_000;

/// Declares [`RECREATED_NAMESPACE`] through `tally` and records
/// [`RECREATED_COUNTER`], which the clients' first increment creates under it: a
/// `sync` counter of 1–4 shards (in replicated runs with the copies drawn as for
/// the other counters).
async fn create_recreated(w: &Shared, tally: &Tally) -> Result<(), String> {
    let spec = {
        let mut g = lock(w);
        let replicas = g.cfg.replicas;
        let mut patch = tally_engine::SpecPatch {
            shards: Some(g.rng.random_range(1..=4)),
            durability: Some(tally_core::spec::Durability::Sync),
            rollup_ms: Some(g.rng.random_range(50..=300)),
            ..Default::default()
        };
        if replicas > 1 {
            let choices = [None, Some(replicas), Some(tally_core::ranges::REPLICAS_MAX)];
            patch.replicas = choices[g.rng.random_range(0..choices.len())];
        }
        tally_core::namespace::NamespaceSpec { patch, auto: None, ttl_ms: None }
    };
    let counter_spec =
        spec.counter_spec().map_err(|e| format!("the namespace {RECREATED_NAMESPACE}: {e}"))?;
    tally
        .put_namespace(RECREATED_NAMESPACE, spec)
        .await
        .map_err(|e| format!("declaring {RECREATED_NAMESPACE}: {e}"))?;
    let info = CounterInfo {
        name: RECREATED_COUNTER.into(),
        role: Role::Recreated,
        spec: counter_spec,
        offline_extra: 0,
    };
    lock(w).history.counters.push(info);
    Ok(())
}

/// Every client of the run: its own and, with deletions, the re-creating ones.
fn all_clients(w: &Shared) -> u16 {
    let g = lock(w);
    g.cfg.clients + if g.cfg.deletions() { RECREATING_CLIENTS } else { 0 }
}

/// Starts the chaos phase's writers of [`RECREATED_COUNTER`] and its operator, who
/// deletes it at times drawn from the run's generator (tier 3 with deletions).
pub(crate) fn start_recreating(w: &Shared) -> Vec<tokio::task::JoinHandle<()>> {
    let (first, counter, deletions) = {
        let mut g = lock(w);
        if !g.cfg.deletions() {
            return Vec::new();
        }
        let chaos_ms = g.cfg.chaos_ms;
        let deletions = super::poisson(&mut g.rng, DELETIONS_PER_S, chaos_ms);
        let counter = counters_of(&g.history.counters, Role::Recreated)[0];
        (g.cfg.clients, counter, deletions)
    };
    let mut tasks: Vec<_> = (first..first + RECREATING_CLIENTS)
        .map(|c| tokio::spawn(recreating_loop(w.clone(), c, counter)))
        .collect();
    tasks.push(tokio::spawn(operator(w.clone(), counter, deletions)));
    tasks
}

/// A client of [`RECREATED_COUNTER`]: increments with event ids, and fresh reads.
async fn recreating_loop(w: Shared, c: u16, counter: usize) {
    let (start, chaos_from, chaos_ms) = {
        let g = lock(&w);
        (g.start, g.chaos_from_ms, g.cfg.chaos_ms)
    };
    loop {
        let reads = {
            let mut g = lock(&w);
            if g.now().saturating_sub(chaos_from) >= chaos_ms || g.history.incrs.len() >= OPS_MAX {
                return;
            }
            g.rng.random_range(0..100) < RECREATING_READ_PERCENT
        };
        if reads {
            read(&w, counter, Consistency::Fresh, false).await;
        } else {
            let op = {
                let mut g = lock(&w);
                let delta = g.rng.random_range(1..=RECREATING_DELTA_MAX);
                let invoked_ms = now_ms(start);
                let op = IncrOp { client: c, counter, delta, member: None, invoked_ms, attempts: Vec::new() };
                g.history.incrs.push(op);
                g.history.incrs.len() - 1
            };
            increment(&w, op, Some(format!("c{c}-o{op}")), CLIENT_ATTEMPTS_MAX).await;
        }
        let think = lock(&w).rng.random_range(1..=CLIENT_THINK_MS_MAX);
        sleep_ms(think).await;
    }
}

/// The operator: deletes `counter` at each of `at` (ms into the chaos phase), each
/// through a node drawn anew, waiting for every answer.
async fn operator(w: Shared, counter: usize, at: Vec<u64>) {
    let (start, chaos_from) = {
        let g = lock(&w);
        (g.start, g.chaos_from_ms)
    };
    let mut waiting = Vec::new();
    for t in at {
        let now = now_ms(start);
        sleep_ms((chaos_from + t).saturating_sub(now)).await;
        waiting.push(tokio::spawn(delete(w.clone(), counter)));
    }
    for d in waiting {
        let _ = d.await;
    }
}

/// Deletes `counter` through a random node and records what came of it.
async fn delete(w: Shared, counter: usize) {
    let n = gateway(&w);
    let (op, name) = {
        let mut g = lock(&w);
        let now = g.now();
        g.history.deletions.push(DeleteOp {
            counter,
            invoked_ms: now,
            done_ms: None,
            outcome: Deleted::Unknown,
        });
        g.note("delete", (counter, n));
        (g.history.deletions.len() - 1, g.history.counters[counter].name.clone())
    };
    let asked = on_node(&w, n, move |t| async move { t.delete_counter(&name).await });
    let reply = tokio::time::timeout(Duration::from_millis(DELETE_WAIT_MS), asked).await.ok();
    let mut g = lock(&w);
    let now = g.now();
    let outcome = match &reply {
        Some(Ok(())) => Deleted::Yes,
        Some(Err(TallyError::NotFound(_))) => Deleted::NotFound,
        Some(Err(_)) | None => Deleted::Unknown,
    };
    g.note("delete-answer", (op, format!("{reply:?}")));
    if outcome == Deleted::Yes {
        g.count(FaultKind::CounterDeleted);
    }
    let rec = &mut g.history.deletions[op];
    rec.done_ms = reply.is_some().then_some(now);
    rec.outcome = outcome;
}

/// Starts the clients of the chaos phase.
pub(crate) fn start(w: &Shared) -> Vec<tokio::task::JoinHandle<()>> {
    let clients = lock(w).cfg.clients;
    (0..clients).map(|c| tokio::spawn(client_loop(w.clone(), c))).collect()
}

async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// Waits while node `n` is paused.
async fn wait_unpaused(w: &Shared, n: u8) {
    loop {
        let (now, until) = {
            let g = lock(w);
            (g.now(), g.nodes[usize::from(n)].paused_until)
        };
        if until <= now {
            return;
        }
        sleep_ms(until - now).await;
    }
}

/// Sends a request to node `n`'s API and waits for its answer. A lost request or
/// answer, or a node that crashed while serving, never answers (the caller times
/// out). The engine serves the request in its own task, as a server does, whether
/// or not the client still waits.
async fn on_node<T, F, Fut>(w: &Shared, n: u8, f: F) -> Result<T, TallyError>
where
    F: FnOnce(Tally) -> Fut,
    Fut: Future<Output = Result<T, TallyError>> + Send + 'static,
    T: Send + 'static,
{
    let (d, lost) = {
        let mut g = lock(w);
        (g.delay(), g.lost())
    };
    if lost {
        lock(w).count(FaultKind::MessageLost);
        return std::future::pending().await;
    }
    sleep_ms(d).await;
    wait_unpaused(w, n).await;
    let (tally, incarnation) = {
        let g = lock(w);
        let node = &g.nodes[usize::from(n)];
        (node.tally.clone(), node.incarnation)
    };
    let Some(tally) = tally else {
        return Err(TallyError::Unavailable {
            shard: format!("node{}", n + 1),
            reason: "connection refused".into(),
        });
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let served = f(tally);
    tokio::spawn(async move {
        let _ = tx.send(served.await);
    });
    let Ok(answer) = rx.await else { return std::future::pending().await };
    let (alive, d, lost) = {
        let mut g = lock(w);
        (g.alive(n, incarnation), g.delay(), g.lost())
    };
    if !alive {
        return std::future::pending().await;
    }
    if lost {
        lock(w).count(FaultKind::MessageLost);
        return std::future::pending().await;
    }
    wait_unpaused(w, n).await;
    sleep_ms(d).await;
    answer
}

/// [`on_node`] within the client's timeout: `None` when it timed out.
async fn ask<T, F, Fut>(w: &Shared, n: u8, f: F) -> Option<Result<T, TallyError>>
where
    F: FnOnce(Tally) -> Fut,
    Fut: Future<Output = Result<T, TallyError>> + Send + 'static,
    T: Send + 'static,
{
    tokio::time::timeout(Duration::from_millis(CLIENT_TIMEOUT_MS), on_node(w, n, f)).await.ok()
}

fn gateway(w: &Shared) -> u8 {
    let mut g = lock(w);
    let nodes = g.cfg.nodes;
    g.rng.random_range(0..nodes)
}

async fn client_loop(w: Shared, c: u16) {
    let (start, chaos_from, chaos_ms) = {
        let g = lock(&w);
        (g.start, g.chaos_from_ms, g.cfg.chaos_ms)
    };
    let first = lock(&w).rng.random_range(0..=CLIENT_THINK_MS_MAX);
    sleep_ms(first).await;
    loop {
        let draw = {
            let mut guard = lock(&w);
            let into_chaos = guard.now().saturating_sub(chaos_from);
            if into_chaos >= chaos_ms || guard.history.incrs.len() >= OPS_MAX {
                return;
            }
            let g = &mut *guard;
            draw_engine_op(&mut g.rng, &g.history.counters, into_chaos, chaos_ms)
        };
        match draw {
            Draw::Incr { counter, delta, member, with_id } => {
                let op = {
                    let mut g = lock(&w);
                    let invoked_ms = now_ms(start);
                    g.history.incrs.push(IncrOp {
                        client: c,
                        counter,
                        delta,
                        member,
                        invoked_ms,
                        attempts: Vec::new(),
                    });
                    g.history.incrs.len() - 1
                };
                let event_id = with_id.then(|| format!("c{c}-o{op}"));
                increment(&w, op, event_id, CLIENT_ATTEMPTS_MAX).await;
            }
            Draw::Read(consistency) => {
                let counter = {
                    let mut g = lock(&w);
                    let n = g.history.counters.len();
                    g.rng.random_range(0..n)
                };
                read(&w, counter, consistency, false).await;
                // Every fresh read is followed by a read of the shortest window of
                // a counter that keeps windows (each in turn), through a node of
                // its own.
                if consistency == Consistency::Fresh {
                    let windowed = {
                        let g = lock(&w);
                        let with: Vec<usize> = (0..g.history.counters.len())
                            .filter(|&c| !g.history.counters[c].spec.windows.is_empty())
                            .collect();
                        (!with.is_empty()).then(|| with[g.history.windows.len() % with.len()])
                    };
                    if let Some(c) = windowed {
                        window(&w, c, false).await;
                    }
                }
            }
            Draw::Distinct => {
                let counter = counters_of(&lock(&w).history.counters, Role::Distinct)[0];
                distinct(&w, counter, false).await;
                // Then its frequencies, through a node of their own.
                frequency(&w, counter).await;
            }
        }
        let think = lock(&w).rng.random_range(1..=CLIENT_THINK_MS_MAX);
        sleep_ms(think).await;
    }
}

/// Attempts increment `op` until it is answered (applied, duplicate or refused), or
/// `limit` attempts were made; only increments with an event id are retried, and on a
/// counter with a short dedup window only within [`retry_span_ms`] of the first.
async fn increment(w: &Shared, op: usize, event_id: Option<String>, limit: u32) {
    loop {
        let answer = attempt(w, op, event_id.clone()).await;
        let (attempts, in_span) = {
            let g = lock(w);
            let rec = &g.history.incrs[op];
            let first = rec.attempts.first().map_or(0, |a| a.sent_ms);
            let span = retry_span_ms(&g.history.counters[rec.counter]);
            (rec.attempts.len() as u32, g.now() < first.saturating_add(span))
        };
        match answer {
            Some(Answer::Unavailable) | None if event_id.is_some() && attempts < limit && in_span => {
                sleep_ms(CLIENT_BACKOFF_MS).await;
            }
            _ => return,
        }
    }
}

/// One attempt of increment `op` through a random node.
async fn attempt(w: &Shared, op: usize, event_id: Option<String>) -> Option<Answer> {
    let (name, inc, n) = {
        let mut g = lock(w);
        let now = g.now();
        let nodes = g.cfg.nodes;
        let n = g.rng.random_range(0..nodes);
        let rec = &mut g.history.incrs[op];
        rec.attempts.push(Attempt { event_id: event_id.clone(), sent_ms: now, answers: Vec::new() });
        let inc = Increment {
            delta: rec.delta,
            event_id: event_id.clone(),
            writer: Some(format!("w{}", rec.client)),
            seq: None,
            member: rec.member.map(member_name),
            item: None,
        };
        let (client, counter) = (rec.client, rec.counter);
        let name = g.history.counters[counter].name.clone();
        g.note("incr", (client, op, &event_id, n));
        (name, inc, n)
    };
    // Each increment goes through one of the engine's doors, chosen by its number
    // (no draw): `incr` as HTTP's increment, `incr_value` as Redis's `INCR` (which
    // answers the total too), `incr_many` as the batch endpoint.
    let reply = ask(w, n, move |t| async move {
        match op % 3 {
            0 => t.incr(&name, inc).await,
            1 => t.incr_value(&name, inc).await.map(|(outcome, _)| outcome),
            _ => {
                let mut one = t.incr_many(vec![(name, inc)]).await?;
                one.pop().unwrap_or(Err(TallyError::ShuttingDown))
            }
        }
    })
    .await;
    let answer = reply.map(|r| match r {
        Ok(o) if o.duplicate => Answer::Duplicate,
        Ok(o) if o.applied => Answer::Applied,
        Ok(_) => Answer::Unavailable,
        Err(TallyError::EventIdConflict { .. }) => Answer::Conflict,
        Err(TallyError::Overflow(_)) => Answer::Overflow,
        // Past a bounded counter's bound: nothing counted, and not retried (the
        // settle phase asks once more, as for every refusal, to make it final).
        Err(TallyError::BoundExceeded { .. }) => Answer::Refused,
        Err(_) => Answer::Unavailable,
    });
    let mut g = lock(w);
    let now = g.now();
    if let Some(a) = answer {
        g.history.incrs[op].attempts.last_mut().expect("pushed above").answers.push((now, a));
    }
    g.note("incr-answer", (op, format!("{answer:?}")));
    answer
}

/// Reads a counter; answers whether the read was complete.
async fn read(w: &Shared, counter: usize, consistency: Consistency, settled: bool) -> bool {
    let (op, name, n) = {
        let mut g = lock(w);
        let now = g.now();
        let nodes = g.cfg.nodes;
        let n = if consistency == Consistency::Cached && settled { 0 } else { g.rng.random_range(0..nodes) };
        g.history.reads.push(ReadOp {
            counter,
            consistency,
            invoked_ms: now,
            done_ms: None,
            value: None,
            settled,
        });
        (g.history.reads.len() - 1, g.history.counters[counter].name.clone(), n)
    };
    let c = match consistency {
        Consistency::Fresh => tally_engine::Consistency::Fresh,
        Consistency::Cached => tally_engine::Consistency::Cached,
    };
    let reply = ask(w, n, move |t| async move { t.read(&name, c).await }).await;
    let mut g = lock(w);
    let now = g.now();
    let Some(reply) = reply else { return false };
    // A counter deleted and not created again reads as a complete 0.
    let recreated = g.history.counters[counter].role == Role::Recreated;
    let reply = match reply {
        Err(TallyError::NotFound(_)) if recreated => {
            let as_of_ms = super::world::EPOCH_MS + now;
            Ok(tally_engine::ValueRead {
                value: 0,
                consistency: c,
                as_of_ms,
                staleness_ms: 0,
                complete: true,
                missing_shards: Vec::new(),
            })
        }
        other => other,
    };
    // A clock behind the run's start stamps before it: such a total counts as taken
    // at the start, its staleness shortened by as much, so that `as_of + staleness`
    // stays the reading clock's time.
    let value = reply.ok().map(|r| {
        let before_start = super::world::EPOCH_MS.saturating_sub(r.as_of_ms);
        ReadValue {
            value: r.value,
            as_of_ms: r.as_of_ms.saturating_sub(super::world::EPOCH_MS),
            staleness_ms: r.staleness_ms.saturating_sub(before_start),
            complete: r.complete,
        }
    });
    g.note("read-answer", (op, format!("{value:?}")));
    let rec = &mut g.history.reads[op];
    rec.done_ms = Some(now);
    rec.value = value;
    value.is_some_and(|v| v.complete)
}

/// Reads the shortest window of a counter with windows (nothing for one without);
/// answers whether the read was complete.
async fn window(w: &Shared, counter: usize, settled: bool) -> bool {
    let (op, name, window, n) = {
        let mut g = lock(w);
        let Some(window) = g.history.counters[counter].spec.windows.texts().into_iter().next() else {
            return true;
        };
        let now = g.now();
        let nodes = g.cfg.nodes;
        let n = g.rng.random_range(0..nodes);
        g.history.windows.push(WindowOp { counter, invoked_ms: now, done_ms: None, value: None, settled });
        (g.history.windows.len() - 1, g.history.counters[counter].name.clone(), window, n)
    };
    let reply = ask(w, n, move |t| async move { t.window(&name, &window).await }).await;
    let mut g = lock(w);
    let now = g.now();
    let Some(reply) = reply else { return false };
    let value = reply.ok().map(|r| WindowValue {
        value: r.value,
        start_ms: r.start_ms as i64 - super::world::EPOCH_MS as i64,
        estimate: r.estimate,
        complete: r.complete,
    });
    g.note("window-answer", (op, format!("{value:?}")));
    let rec = &mut g.history.windows[op];
    rec.done_ms = Some(now);
    rec.value = value;
    value.is_some_and(|v| v.complete)
}

/// Estimates a counter's distinct members; answers whether the estimate was complete.
async fn distinct(w: &Shared, counter: usize, settled: bool) -> bool {
    let (op, name, n) = {
        let mut g = lock(w);
        let now = g.now();
        let nodes = g.cfg.nodes;
        let n = g.rng.random_range(0..nodes);
        g.history.distincts.push(DistinctOp {
            counter,
            invoked_ms: now,
            done_ms: None,
            estimate: None,
            settled,
        });
        (g.history.distincts.len() - 1, g.history.counters[counter].name.clone(), n)
    };
    let reply = ask(w, n, move |t| async move { t.distinct(&name).await }).await;
    let mut g = lock(w);
    let now = g.now();
    let Some(reply) = reply else { return false };
    let estimate = reply.ok().map(|r| (r.estimate, r.complete));
    g.note("distinct-answer", (op, estimate));
    let rec = &mut g.history.distincts[op];
    rec.done_ms = Some(now);
    rec.estimate = estimate;
    estimate.is_some_and(|e| e.1)
}

/// Reads a counter's frequencies: the estimate of the member most recently sent to
/// it, then its [`TOP_K`] heaviest members, through one node (each read in turn
/// through the next). Chosen without a draw, so the run's other draws stay as they
/// were. Answers whether both reads were complete.
async fn frequency(w: &Shared, counter: usize) -> bool {
    let (op, name, member, n) = {
        let mut g = lock(w);
        let Some(member) = g.history.incrs.iter().rev().find(|o| o.counter == counter).and_then(|o| o.member)
        else {
            return false;
        };
        let now = g.now();
        let n = (g.history.frequencies.len() % usize::from(g.cfg.nodes)) as u8;
        g.history.frequencies.push(FrequencyOp {
            counter,
            member,
            invoked_ms: now,
            done_ms: None,
            answer: None,
        });
        (g.history.frequencies.len() - 1, g.history.counters[counter].name.clone(), member, n)
    };
    let item = member_name(member);
    let reply = ask(w, n, move |t| async move {
        let one = t.frequency(&name, &item).await?;
        let top = t.top(&name, TOP_K).await?;
        Ok((one, top))
    })
    .await;
    let mut g = lock(w);
    let now = g.now();
    let Some(Ok((one, top))) = reply else { return false };
    let answer = FrequencyAnswer {
        estimate: one.estimate,
        lower_bound: one.lower_bound,
        top: top
            .items
            .iter()
            .map(|e| {
                let m = e.item.strip_prefix("m-").and_then(|m| m.parse().ok()).unwrap_or(u32::MAX);
                (m, e.estimate, e.lower_bound)
            })
            .collect(),
        total: top.total,
        complete: one.complete && top.complete,
    };
    g.note("frequency-answer", (op, &answer));
    let complete = answer.complete;
    let rec = &mut g.history.frequencies[op];
    rec.done_ms = Some(now);
    rec.answer = Some(answer);
    complete
}

/// Reconciles a counter against its authoritative total: every increment known to be
/// counted plus what it never saw. Answers whether the reconciliation was made.
async fn reconcile(w: &Shared, counter: usize) -> bool {
    let (op, name, authoritative) = {
        let mut g = lock(w);
        let now = g.now();
        let sent: i128 = g
            .history
            .incrs
            .iter()
            .filter(|o| o.counter == counter && matches!(o.status(), Status::Applied { .. }))
            .map(|o| i128::from(o.delta))
            .sum();
        let authoritative = sent + g.history.counters[counter].offline_extra;
        g.history.reconciles.push(ReconcileOp {
            counter,
            authoritative,
            invoked_ms: now,
            done_ms: None,
            result: None,
        });
        (g.history.reconciles.len() - 1, g.history.counters[counter].name.clone(), authoritative)
    };
    let n = gateway(w);
    let reply = ask(w, n, move |t| async move { t.reconcile(&name, authoritative).await }).await;
    let mut g = lock(w);
    let now = g.now();
    let Some(reply) = reply else { return false };
    let result = reply.ok().map(|r| (r.before, r.drift));
    g.note("reconcile-answer", (op, result));
    let rec = &mut g.history.reconciles[op];
    rec.done_ms = Some(now);
    rec.result = result;
    result.is_some()
}

/// How long after its first attempt an increment of `info` may be sent again: a
/// resend must reach the shard while the first attempt's record lives, which is
/// promised for the counter's dedup window (less the clocks' skew, which runs with
/// short windows keep near zero). Half the window leaves the other half for the
/// resend's delivery; a day's window is never reached within a run.
fn retry_span_ms(info: &crate::history::CounterInfo) -> u64 {
    info.spec.dedup_window_ms() / 2
}

/// Whether increment `op` still has an unknown outcome (or was refused only before
/// the cluster settled, which is not final).
fn open(w: &Shared, op: usize) -> bool {
    let g = lock(w);
    let rec = &g.history.incrs[op];
    let open = match rec.status() {
        Status::Unknown => true,
        Status::Refused => rec.attempts.last().is_some_and(|a| a.sent_ms < g.history.settle_ms),
        Status::Applied { .. } => false,
    };
    // Past its retry span an increment stays unknown: a resend could count it again.
    let first = rec.attempts.first();
    let in_span = first
        .is_some_and(|a| g.now() < a.sent_ms.saturating_add(retry_span_ms(&g.history.counters[rec.counter])));
    open && in_span && first.is_some_and(|a| a.event_id.is_some())
}

/// One client resolves its open increments, one at a time.
async fn resolve(w: Shared, c: u16) {
    let ops: Vec<usize> = {
        let g = lock(&w);
        (0..g.history.incrs.len()).filter(|&i| g.history.incrs[i].client == c).collect()
    };
    for op in ops {
        if !open(&w, op) {
            continue;
        }
        let id = lock(&w).history.incrs[op].attempts[0].event_id.clone();
        increment(&w, op, id, SETTLE_ATTEMPTS_MAX).await;
    }
}

/// Whether the cluster is idle: every node up and serving, no resharding pending.
fn idle(w: &Shared) -> bool {
    let g = lock(w);
    g.nodes.iter().all(|n| n.up && !n.poisoned && n.tally.is_some())
        && g.meta.values().all(|v| v.last().is_none_or(|m| m.meta.layout.resharding.is_none()))
        && g.placements.last().is_none_or(|p| p.handoff.is_empty())
        // Tier 3: no membership change is still handed off, as every node sees it.
        && g.nodes.iter().all(|n| n.cluster.as_ref().is_none_or(|c| c.placement().2.is_empty()))
}

/// The settle phase: clients resolve unknown outcomes, then the settler waits for the
/// cluster to be idle, reconciles, and takes the final reads.
pub(crate) async fn settle(w: &Shared) {
    let clients = all_clients(w);
    {
        let mut g = lock(w);
        g.history.settle_ms = g.now();
        g.note("settle", ());
    }
    let tasks: Vec<_> = (0..clients).map(|c| tokio::spawn(resolve(w.clone(), c))).collect();
    for t in tasks {
        let _ = t.await;
    }
    while !idle(w) {
        sleep_ms(COORD_RESEND_MS).await;
    }
    let counters = lock(w).history.counters.clone();
    for i in counters_of(&counters, Role::Recon) {
        for _ in 0..2 {
            while !reconcile(w, i).await {
                sleep_ms(CLIENT_BACKOFF_MS).await;
            }
        }
    }
    for i in 0..counters.len() {
        while !read(w, i, Consistency::Fresh, true).await {
            sleep_ms(CLIENT_BACKOFF_MS).await;
        }
        while !window(w, i, true).await {
            sleep_ms(CLIENT_BACKOFF_MS).await;
        }
    }
    for i in counters_of(&counters, Role::Distinct) {
        while !distinct(w, i, true).await {
            sleep_ms(CLIENT_BACKOFF_MS).await;
        }
    }
    let cached_all = || async {
        for i in 0..counters.len() {
            while !read(w, i, Consistency::Cached, true).await {
                sleep_ms(CLIENT_BACKOFF_MS).await;
            }
        }
    };
    cached_all().await;
    let rollup_max = counters.iter().map(|c| u64::from(c.spec.rollup_ms)).max().unwrap_or(0);
    sleep_ms(2 * rollup_max + 2 * ROLLUP_TICK_MS).await;
    cached_all().await;
}
