//! The workload: clients doing `sync` and batched increments (with event ids, and some
//! batched ones without), retrying timed-out increments with the *same* event id;
//! fresh and cached reads; distinct members; and, once the cluster has healed, a
//! settler that resolves nothing itself but reconciles against the authoritative
//! totals and takes the final reads.

use crate::config::*;
use crate::history::{Attempt, DistinctOp, IncrOp, ReadOp, ReconcileOp, Role, Status};
use crate::msg::{Addr, Answer, Consistency, Msg};
use crate::sim::{Event, Phase, Sim};
use crate::workload::{draw_op, member_name, Draw};
use rand::Rng;
use std::collections::VecDeque;
use tally_core::CounterName;

/// Timeout kinds, carried by [`Event::ClientTimeout`].
const KIND_INCR: u8 = 0;
const KIND_READ: u8 = 1;
const KIND_DISTINCT: u8 = 2;
const KIND_RECONCILE: u8 = 3;

/// What a client waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Current {
    Incr { op: usize, attempt: u32 },
    Read { op: usize },
    Distinct { op: usize },
    Reconcile { op: usize },
}

/// One step of the settler's script.
#[derive(Debug, Clone)]
pub(crate) enum Step {
    /// Wait until no resharding or membership change is in progress.
    WaitIdle,
    /// Reconcile a counter against its authoritative total.
    Reconcile(usize),
    /// Read a counter fresh.
    Fresh(usize),
    /// Read a counter's cached total at node 0.
    Cached(usize),
    /// Estimate a counter's distinct members.
    Distinct(usize),
    /// Wait.
    Sleep(u64),
}

/// One client.
#[derive(Debug, Clone)]
pub(crate) struct Client {
    pub(crate) current: Option<Current>,
    /// An increment to attempt again at the next wake-up.
    retry: Option<usize>,
    /// Resolving unknown outcomes (after the cluster healed).
    resolving: bool,
    unresolved: VecDeque<usize>,
    /// Finished: nothing more to do.
    pub(crate) done: bool,
    settler: bool,
    script: VecDeque<Step>,
}

impl Client {
    pub(crate) fn new() -> Self {
        Self {
            current: None,
            retry: None,
            resolving: false,
            unresolved: VecDeque::new(),
            done: false,
            settler: false,
            script: VecDeque::new(),
        }
    }

    pub(crate) fn settler() -> Self {
        Self { settler: true, ..Self::new() }
    }
}

impl Sim {
    fn client(&mut self, c: u16) -> &mut Client {
        &mut self.clients[usize::from(c)]
    }

    fn counter_name(&self, i: usize) -> CounterName {
        CounterName::new(self.history.counters[i].name.clone()).expect("workload names are valid")
    }

    fn counters_of(&self, role: Role) -> Vec<usize> {
        (0..self.history.counters.len()).filter(|&i| self.history.counters[i].role == role).collect()
    }

    fn gateway(&mut self) -> u8 {
        self.rng.random_range(0..self.cfg.nodes)
    }

    fn think(&mut self, c: u16) {
        let d = self.rng.random_range(1..=CLIENT_THINK_MS_MAX);
        self.after(d, Event::ClientNext(c));
    }

    pub(crate) fn client_next(&mut self, c: u16) {
        if self.client(c).current.is_some() || self.client(c).done {
            return;
        }
        if let Some(op) = self.client(c).retry.take() {
            return self.retry_attempt(c, op);
        }
        if self.client(c).settler {
            return self.settler_next(c);
        }
        let resolving = self.clients[usize::from(c)].resolving;
        match self.phase {
            Phase::Chaos if self.history.incrs.len() < OPS_MAX => self.new_op(c),
            _ if resolving => self.resolve_next(c),
            _ => {}
        }
    }

    fn new_op(&mut self, c: u16) {
        let (counter, delta, member, with_id) = match draw_op(&mut self.rng, &self.history.counters) {
            Draw::Incr { counter, delta, member, with_id } => (counter, delta, member, with_id),
            Draw::Read(consistency) => return self.new_read(c, consistency, None, false),
            Draw::Distinct => return self.new_distinct(c, None, false),
        };
        let op = self.history.incrs.len();
        let event_id = with_id.then(|| format!("c{c}-o{op}"));
        self.history.incrs.push(IncrOp {
            client: c,
            counter,
            delta,
            member,
            invoked_ms: self.now,
            attempts: Vec::new(),
        });
        self.send_attempt(c, op, event_id);
    }

    /// Sends the next attempt of increment `op`: a retry carries the event id of the
    /// first attempt.
    fn retry_attempt(&mut self, c: u16, op: usize) {
        let rec = &self.history.incrs[op];
        let attempt = rec.attempts.len();
        let event_id = rec.attempts[0].event_id.clone().map(|id| {
            if bug!(RetryFreshId) {
                format!("{id}-a{attempt}")
            } else {
                id
            }
        });
        self.send_attempt(c, op, event_id);
    }

    fn send_attempt(&mut self, c: u16, op: usize, event_id: Option<String>) {
        let rec = &self.history.incrs[op];
        let attempt = rec.attempts.len() as u32;
        let (counter, delta, member) = (rec.counter, rec.delta, rec.member);
        self.history.incrs[op].attempts.push(Attempt {
            event_id: event_id.clone(),
            sent_ms: self.now,
            answers: Vec::new(),
        });
        let gateway = self.gateway();
        let msg = Msg::Incr {
            client: c,
            op: op as u32,
            attempt,
            counter: self.counter_name(counter),
            delta,
            event_id,
            member: member.map(member_name),
        };
        self.client(c).current = Some(Current::Incr { op, attempt });
        self.send(Addr::Client(c), Addr::Node(gateway), msg);
        self.after(
            CLIENT_TIMEOUT_MS,
            Event::ClientTimeout { client: c, kind: KIND_INCR, op: op as u32, attempt },
        );
    }

    fn new_read(&mut self, c: u16, consistency: Consistency, counter: Option<usize>, settled: bool) {
        let counter = counter.unwrap_or_else(|| self.rng.random_range(0..self.history.counters.len()));
        let op = self.history.reads.len();
        self.history.reads.push(ReadOp {
            counter,
            consistency,
            invoked_ms: self.now,
            done_ms: None,
            value: None,
            settled,
        });
        let gateway = if consistency == Consistency::Cached && settled { 0 } else { self.gateway() };
        let msg = Msg::Read { client: c, op: op as u32, counter: self.counter_name(counter), consistency };
        self.client(c).current = Some(Current::Read { op });
        self.send(Addr::Client(c), Addr::Node(gateway), msg);
        self.after(
            CLIENT_TIMEOUT_MS,
            Event::ClientTimeout { client: c, kind: KIND_READ, op: op as u32, attempt: 0 },
        );
    }

    fn new_distinct(&mut self, c: u16, counter: Option<usize>, settled: bool) {
        let counter = counter.unwrap_or_else(|| self.counters_of(Role::Distinct)[0]);
        let op = self.history.distincts.len();
        self.history.distincts.push(DistinctOp {
            counter,
            invoked_ms: self.now,
            done_ms: None,
            estimate: None,
            settled,
        });
        let gateway = self.gateway();
        let msg = Msg::Distinct { client: c, op: op as u32, counter: self.counter_name(counter) };
        self.client(c).current = Some(Current::Distinct { op });
        self.send(Addr::Client(c), Addr::Node(gateway), msg);
        self.after(
            CLIENT_TIMEOUT_MS,
            Event::ClientTimeout { client: c, kind: KIND_DISTINCT, op: op as u32, attempt: 0 },
        );
    }

    fn new_reconcile(&mut self, c: u16, counter: usize) {
        let info = &self.history.counters[counter];
        let sent: i128 = self
            .history
            .incrs
            .iter()
            .filter(|o| o.counter == counter && matches!(o.status(), Status::Applied { .. }))
            .map(|o| i128::from(o.delta))
            .sum();
        let authoritative = sent + info.offline_extra;
        let op = self.history.reconciles.len();
        self.history.reconciles.push(ReconcileOp {
            counter,
            authoritative,
            invoked_ms: self.now,
            done_ms: None,
            result: None,
        });
        let gateway = self.gateway();
        let msg =
            Msg::Reconcile { client: c, op: op as u32, counter: self.counter_name(counter), authoritative };
        self.client(c).current = Some(Current::Reconcile { op });
        self.send(Addr::Client(c), Addr::Node(gateway), msg);
        self.after(
            CLIENT_TIMEOUT_MS,
            Event::ClientTimeout { client: c, kind: KIND_RECONCILE, op: op as u32, attempt: 0 },
        );
    }

    fn finish(&mut self, c: u16) {
        self.client(c).current = None;
        self.think(c);
    }

    /// After a timeout or an unavailable answer: try again with the same event id, or
    /// give up (the outcome stays unknown).
    fn retry_or_finish(&mut self, c: u16, op: usize) {
        let limit = if self.client(c).resolving { SETTLE_ATTEMPTS_MAX } else { CLIENT_ATTEMPTS_MAX };
        let rec = &self.history.incrs[op];
        let has_id = rec.attempts.first().is_some_and(|a| a.event_id.is_some());
        let attempts = rec.attempts.len() as u32;
        self.client(c).current = None;
        if has_id && attempts < limit {
            self.client(c).retry = Some(op);
            self.after(CLIENT_BACKOFF_MS, Event::ClientNext(c));
        } else {
            self.think(c);
        }
    }

    pub(crate) fn client_deliver(&mut self, c: u16, msg: Msg) {
        let now = self.now;
        let current = self.client(c).current;
        match msg {
            Msg::IncrReply { op, attempt, answer } => {
                let op = op as usize;
                // One request has one response: a copy of an answer (the simulated
                // relay may duplicate one) is not a second answer.
                if let Some(a) =
                    self.history.incrs.get_mut(op).and_then(|o| o.attempts.get_mut(attempt as usize))
                {
                    if a.answers.is_empty() {
                        a.answers.push((now, answer));
                    }
                }
                if current == Some(Current::Incr { op, attempt }) {
                    if answer == Answer::Unavailable {
                        self.retry_or_finish(c, op);
                    } else {
                        self.finish(c);
                    }
                }
            }
            Msg::ReadReply { op, read } => {
                let op = op as usize;
                let rec = &mut self.history.reads[op];
                if rec.done_ms.is_none() && current == Some(Current::Read { op }) {
                    rec.done_ms = Some(now);
                    rec.value = read;
                    self.settler_answered(c, read.is_some_and(|r| r.complete));
                    self.finish(c);
                }
            }
            Msg::DistinctReply { op, estimate } => {
                let op = op as usize;
                let rec = &mut self.history.distincts[op];
                if rec.done_ms.is_none() && current == Some(Current::Distinct { op }) {
                    rec.done_ms = Some(now);
                    rec.estimate = estimate;
                    self.settler_answered(c, estimate.is_some_and(|e| e.1));
                    self.finish(c);
                }
            }
            Msg::ReconcileReply { op, result } => {
                let op = op as usize;
                let rec = &mut self.history.reconciles[op];
                if rec.done_ms.is_none() {
                    rec.done_ms = Some(now);
                    rec.result = result;
                }
                if current == Some(Current::Reconcile { op }) {
                    if result.is_none() {
                        // Not reconciled: the settler tries the same step again.
                        self.client(c).current = None;
                        self.after(CLIENT_BACKOFF_MS, Event::ClientNext(c));
                    } else {
                        self.settler_answered(c, true);
                        self.finish(c);
                    }
                }
            }
            _ => {}
        }
    }

    /// The settler moves to its next step once a step's request was answered fully.
    fn settler_answered(&mut self, c: u16, good: bool) {
        if self.client(c).settler && good {
            self.client(c).script.pop_front();
        }
    }

    pub(crate) fn client_timeout(&mut self, c: u16, kind: u8, op: u32, attempt: u32) {
        let op = op as usize;
        let current = self.client(c).current;
        let matches = match kind {
            KIND_INCR => current == Some(Current::Incr { op, attempt }),
            KIND_READ => current == Some(Current::Read { op }),
            KIND_DISTINCT => current == Some(Current::Distinct { op }),
            _ => current == Some(Current::Reconcile { op }),
        };
        if !matches {
            return;
        }
        if kind == KIND_INCR {
            self.retry_or_finish(c, op);
        } else {
            // A read or reconciliation that timed out: the settler repeats its step,
            // a regular client moves on.
            self.client(c).current = None;
            self.after(CLIENT_BACKOFF_MS, Event::ClientNext(c));
        }
    }

    /// The cluster has healed: every client resolves its increments whose outcome is
    /// unknown by retrying them with the same event id.
    pub(crate) fn settle(&mut self) {
        self.history.settle_ms = self.now;
        for c in 0..self.cfg.clients {
            let unresolved: VecDeque<usize> = (0..self.history.incrs.len())
                .filter(|&i| {
                    let o = &self.history.incrs[i];
                    o.client == c && o.attempts.first().is_some_and(|a| a.event_id.is_some())
                })
                .collect();
            let client = self.client(c);
            client.resolving = true;
            client.unresolved = unresolved;
            if client.current.is_none() && client.retry.is_none() {
                self.after(0, Event::ClientNext(c));
            }
        }
    }

    fn resolve_next(&mut self, c: u16) {
        while let Some(op) = self.client(c).unresolved.pop_front() {
            let rec = &self.history.incrs[op];
            let open = match rec.status() {
                Status::Unknown => true,
                // A refusal before settling is not final (see `Status::Refused`).
                Status::Refused => rec.attempts.last().is_some_and(|a| a.sent_ms < self.history.settle_ms),
                Status::Applied { .. } => false,
            };
            if open && (rec.attempts.len() as u32) < SETTLE_ATTEMPTS_MAX {
                return self.retry_attempt(c, op);
            }
        }
        self.client(c).done = true;
        if self.clients.iter().filter(|cl| !cl.settler).all(|cl| cl.done) {
            self.start_settler();
        }
    }

    fn start_settler(&mut self) {
        self.phase = Phase::Final;
        let mut script = VecDeque::from([Step::WaitIdle]);
        for i in self.counters_of(Role::Recon) {
            script.push_back(Step::Reconcile(i));
            script.push_back(Step::Reconcile(i));
        }
        let all = 0..self.history.counters.len();
        script.extend(all.clone().map(Step::Fresh));
        script.extend(self.counters_of(Role::Distinct).into_iter().map(Step::Distinct));
        script.extend(all.clone().map(Step::Cached));
        let rollup_max = self.history.counters.iter().map(|c| u64::from(c.spec.rollup_ms)).max().unwrap_or(0);
        script.push_back(Step::Sleep(2 * rollup_max + 2 * ROLLUP_TICK_MS));
        script.extend(all.map(Step::Cached));
        let s = self.cfg.clients;
        self.client(s).script = script;
        self.after(0, Event::ClientNext(s));
    }

    fn settler_next(&mut self, c: u16) {
        let Some(step) = self.client(c).script.front().cloned() else {
            self.client(c).done = true;
            self.finished = true;
            return;
        };
        match step {
            Step::WaitIdle => {
                if self.coord.idle() && self.nodes.iter().all(|n| n.up && !n.poisoned) {
                    self.client(c).script.pop_front();
                    self.after(0, Event::ClientNext(c));
                } else {
                    self.after(COORD_RESEND_MS, Event::ClientNext(c));
                }
            }
            Step::Sleep(ms) => {
                self.client(c).script.pop_front();
                self.after(ms, Event::ClientNext(c));
            }
            // Reconcile steps are popped when answered (see `client_deliver`).
            Step::Reconcile(i) => self.new_reconcile(c, i),
            // Read steps too: a read that timed out or missed a shard is taken again.
            Step::Fresh(i) => self.new_read(c, Consistency::Fresh, Some(i), true),
            Step::Cached(i) => self.new_read(c, Consistency::Cached, Some(i), true),
            Step::Distinct(i) => self.new_distinct(c, Some(i), true),
        }
    }
}
