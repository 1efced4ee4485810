//! The simulator: a deterministic event queue over simulated time that drives the
//! nodes, the clients, the control plane, the network and the fault injector, records
//! the history and hashes every event it applies.
//!
//! One run is one thread, one seeded RNG (`ChaCha8Rng`), ordered maps only, and events
//! ordered by (time, sequence number): nothing else can influence the order of events.

use crate::check::{self, Violation};
use crate::client::Client;
use crate::config::*;
use crate::coord::Coordinator;
use crate::history::{CounterInfo, Disturbance, FaultKind, History};
use crate::metalog::MetaLog;
use crate::msg::{Addr, Msg, SubmitCtx};
use crate::net::{Fate, Network};
use crate::node::Node;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};
use std::hash::{Hash, Hasher};
use tally_core::meta::MetaCommand;
use tally_core::shard::Submission;

use tally_core::{CounterName, ShardId};
use tally_store::Store;
use xxhash_rust::xxh3::Xxh3;

/// A node's own timers. Each carries the node's incarnation; a timer of an earlier
/// incarnation (before a crash) is ignored.
#[derive(Debug, Clone)]
pub(crate) enum NodeTimer {
    /// Commit a shard's pending submissions.
    Commit(ShardId),
    /// Run the group-commit flush.
    Flush,
    /// The aggregator's tick.
    Aggregator,
    /// The rollup's tick.
    Rollup,
    /// Resend a submission that met a sealed or moving shard.
    Resubmit {
        /// The counter.
        counter: CounterName,
        /// The submission.
        sub: Submission,
        /// Its context.
        ctx: SubmitCtx,
    },
    /// The operator restarts a node whose flush failed.
    PoisonRestart,
    /// Resend an adoption's pull, if it is still outstanding.
    AdoptResend(ShardId),
    /// Run a hand-off pass if this node is a previous member still holding shards.
    HandOff,
}

/// Something the simulator does at a point in time.
#[derive(Debug, Clone)]
pub(crate) enum Event {
    /// A message arrives.
    Deliver { from: Addr, to: Addr, msg: Msg },
    /// A node timer fires.
    Timer { node: u8, incarnation: u64, timer: NodeTimer },
    /// A client starts its next operation.
    ClientNext(u16),
    /// A client's attempt timed out.
    ClientTimeout { client: u16, kind: u8, op: u32, attempt: u32 },
    /// A node crashes.
    Crash(u8),
    /// A crashed node restarts.
    Restart(u8, u64),
    /// A partition starts.
    PartitionStart(usize),
    /// A partition ends.
    PartitionEnd(usize),
    /// A node pauses until the given time.
    Pause(u8, u64),
    /// The metadata leader fails over for the given time.
    MetaOutage(u64),
    /// The workload asks for a resharding or a membership change.
    RequestTransition,
    /// The control plane's tick.
    CoordTick,
    /// Every fault ends.
    Heal,
    /// Clients start resolving unknown outcomes.
    Settle,
}

impl Event {
    fn trace<H: Hasher>(&self, h: &mut H) {
        std::mem::discriminant(self).hash(h);
        match self {
            Event::Deliver { from, to, msg } => (from, to, msg).hash(h),
            Event::Timer { node, incarnation, timer } => {
                (node, incarnation).hash(h);
                match timer {
                    NodeTimer::Commit(s) | NodeTimer::AdoptResend(s) => s.hash(h),
                    NodeTimer::Resubmit { counter, ctx, .. } => (counter, ctx).hash(h),
                    other => std::mem::discriminant(other).hash(h),
                }
            }
            Event::ClientNext(c) => c.hash(h),
            Event::ClientTimeout { client, kind, op, attempt } => (client, kind, op, attempt).hash(h),
            Event::Crash(n) | Event::Pause(n, _) => n.hash(h),
            Event::Restart(n, inc) => (n, inc).hash(h),
            Event::PartitionStart(i) | Event::PartitionEnd(i) => i.hash(h),
            Event::MetaOutage(t) => t.hash(h),
            Event::RequestTransition | Event::CoordTick | Event::Heal | Event::Settle => {}
        }
    }
}

struct Scheduled {
    at: u64,
    seq: u64,
    ev: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Scheduled {
    // Reversed: `BinaryHeap` is a max-heap and the earliest event must come first.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

/// The phase of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Workload and faults.
    Chaos,
    /// Faults over; clients finish and then resolve unknown outcomes.
    Healed,
    /// The settler reconciles and takes the final reads.
    Final,
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// The run's configuration.
    pub config: SimConfig,
    /// Hash of every event applied, in order.
    pub trace_hash: u64,
    /// Simulated time at the end, in milliseconds.
    pub sim_ms: u64,
    /// Events applied.
    pub events: u64,
    /// Faults injected, by kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// Client operations (increments, reads, reconciliations).
    pub ops: u64,
    /// Invariant violations found by the checker.
    pub violations: Vec<Violation>,
    /// The recorded history.
    pub history: History,
}

/// Most events one run may apply: a run that would go on forever is a bug in the
/// simulator, reported instead of hanging.
pub const EVENTS_MAX: u64 = 20_000_000;
/// The run ends at the latest this long after healing, settled or not.
pub const SETTLE_MS_MAX: u64 = 60_000;

/// The whole simulated world.
pub(crate) struct Sim {
    pub(crate) cfg: SimConfig,
    pub(crate) now: u64,
    seq: u64,
    queue: BinaryHeap<Scheduled>,
    pub(crate) rng: ChaCha8Rng,
    pub(crate) rates: FaultRates,
    pub(crate) net: Network,
    pub(crate) meta: MetaLog,
    pub(crate) nodes: Vec<Node>,
    pub(crate) clients: Vec<Client>,
    pub(crate) coord: Coordinator,
    pub(crate) history: History,
    pub(crate) phase: Phase,
    pub(crate) faults: BTreeMap<FaultKind, u64>,
    partitions: Vec<(Vec<(u8, u8)>, u64)>,
    /// Start of each node's current disturbance (down, paused, poisoned), if any.
    pub(crate) disturbed_since: BTreeMap<u8, u64>,
    trace: Xxh3,
    events: u64,
    pub(crate) finished: bool,
    /// Print every event to stderr (`TALLY_SIM_DEBUG=1`; output only, no influence).
    debug: bool,
}

impl Sim {
    pub(crate) fn new(cfg: SimConfig) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        let rates = FaultRates::sample(cfg.faults, &mut rng);
        let net = Network::new(rates.loss, rates.duplicate, rates.delay_extra_ms_max);
        let nodes = (0..cfg.nodes).map(Node::new).collect();
        let meta = MetaLog::new(cfg.nodes);
        let clients = (0..cfg.clients).map(|_| Client::new()).chain([Client::settler()]).collect();
        let history = History { nodes: (0..cfg.nodes).collect(), settle_ms: u64::MAX, ..History::default() };
        Self {
            cfg,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            rng,
            rates,
            net,
            meta,
            nodes,
            clients,
            coord: Coordinator::default(),
            history,
            phase: Phase::Chaos,
            faults: BTreeMap::new(),
            partitions: Vec::new(),
            disturbed_since: BTreeMap::new(),
            trace: Xxh3::new(),
            events: 0,
            finished: false,
            debug: std::env::var_os("TALLY_SIM_DEBUG").is_some(),
        }
    }

    /// Schedules `ev` at `at` (never in the past).
    pub(crate) fn at(&mut self, at: u64, ev: Event) {
        self.seq += 1;
        self.queue.push(Scheduled { at: at.max(self.now), seq: self.seq, ev });
    }

    /// Schedules `ev` after `delay_ms`.
    pub(crate) fn after(&mut self, delay_ms: u64, ev: Event) {
        self.at(self.now + delay_ms, ev);
    }

    /// Schedules a timer of node `n`'s current incarnation.
    pub(crate) fn timer(&mut self, n: u8, delay_ms: u64, timer: NodeTimer) {
        let incarnation = self.nodes[usize::from(n)].incarnation;
        self.after(delay_ms, Event::Timer { node: n, incarnation, timer });
    }

    /// Counts a fault.
    pub(crate) fn count(&mut self, kind: FaultKind) {
        *self.faults.entry(kind).or_default() += 1;
    }

    /// Sends `msg` through the simulated network.
    pub(crate) fn send(&mut self, from: Addr, to: Addr, msg: Msg) {
        match self.net.fate(from, to, &mut self.rng) {
            Fate::Deliver(delays) => {
                if delays.len() > 1 {
                    self.count(FaultKind::MessageDuplicated);
                }
                for d in delays {
                    self.after(d, Event::Deliver { from, to, msg: msg.clone() });
                }
            }
            Fate::Cut => self.count(FaultKind::MessageCut),
            Fate::Lost => self.count(FaultKind::MessageLost),
        }
    }

    /// Whether node `from` can get an answer from node `to` right now (a synchronous
    /// request: both directions work and `to` is up and not paused).
    pub(crate) fn reachable(&self, from: u8, to: u8) -> bool {
        let t = &self.nodes[usize::from(to)];
        t.up && t.paused_until <= self.now && self.net.link_up(from, to) && self.net.link_up(to, from)
    }

    fn uniform(&mut self, (lo, hi): (u64, u64)) -> u64 {
        self.rng.random_range(lo..=hi)
    }

    /// Draws the times of a Poisson process of `rate_per_s` over the chaos phase.
    fn poisson(&mut self, rate_per_s: f64) -> Vec<u64> {
        let mut out = Vec::new();
        if rate_per_s <= 0.0 {
            return out;
        }
        let mut t = 0.0f64;
        loop {
            let u: f64 = self.rng.random::<f64>().max(1e-12);
            t += -u.ln() / rate_per_s * 1000.0;
            if t as u64 >= self.cfg.chaos_ms {
                return out;
            }
            out.push(t as u64);
        }
    }

    fn setup(&mut self) {
        self.create_counters();
        for n in 0..self.cfg.nodes {
            self.start_node_timers(n);
        }
        for c in 0..self.cfg.clients {
            let d = self.rng.random_range(0..=CLIENT_THINK_MS_MAX);
            self.after(d, Event::ClientNext(c));
        }
        // Faults, drawn up front from the seed.
        let nodes = self.cfg.nodes;
        for t in self.poisson(self.rates.crash_per_s) {
            let n = self.rng.random_range(0..nodes);
            self.at(t, Event::Crash(n));
        }
        for t in self.poisson(self.rates.partition_per_s) {
            let links = self.draw_partition();
            let len = self.uniform(self.rates.partition_ms);
            self.partitions.push((links, len));
            let i = self.partitions.len() - 1;
            self.at(t, Event::PartitionStart(i));
        }
        for t in self.poisson(self.rates.pause_per_s) {
            let n = self.rng.random_range(0..nodes);
            let len = self.uniform(self.rates.pause_ms);
            self.at(t, Event::Pause(n, len));
        }
        for t in self.poisson(self.rates.meta_outage_per_s) {
            let len = self.uniform(self.rates.meta_outage_ms);
            self.at(t, Event::MetaOutage(len));
        }
        for _ in 0..self.cfg.transitions {
            let t = self.rng.random_range(self.cfg.chaos_ms / 10..self.cfg.chaos_ms * 8 / 10);
            self.at(t, Event::RequestTransition);
        }
        self.after(COORD_TICK_MS, Event::CoordTick);
        self.at(self.cfg.chaos_ms, Event::Heal);
    }

    /// Links cut by one partition: a node isolated, the cluster split in two, or one
    /// direction of one link.
    fn draw_partition(&mut self) -> Vec<(u8, u8)> {
        let nodes = self.cfg.nodes;
        let mut links = Vec::new();
        match self.rng.random_range(0..3u8) {
            0 => {
                let a = self.rng.random_range(0..nodes);
                for b in (0..nodes).filter(|&b| b != a) {
                    links.push((a, b));
                    links.push((b, a));
                }
            }
            1 => {
                let side: Vec<bool> = (0..nodes).map(|_| self.rng.random::<bool>()).collect();
                for a in 0..nodes {
                    for b in 0..nodes {
                        if side[usize::from(a)] != side[usize::from(b)] {
                            links.push((a, b));
                        }
                    }
                }
            }
            _ => {
                let a = self.rng.random_range(0..nodes);
                let b = (a + self.rng.random_range(1..nodes)) % nodes;
                links.push((a, b));
            }
        }
        links
    }

    fn create_counters(&mut self) {
        let infos = crate::workload::counter_plans(&mut self.rng);
        for (name, role, patch, offline_extra) in infos {
            let cn = CounterName::new(name.clone()).expect("workload names are valid");
            self.meta.counter(&cn, &MetaCommand::Put(patch), 0).expect("setup metadata writes succeed");
            let spec = self.meta.counters[&cn].spec;
            self.history.counters.push(CounterInfo { name, role, spec, offline_extra });
        }
    }

    /// Marks node `n` disturbed from now (down, paused, poisoned).
    pub(crate) fn disturb(&mut self, n: u8) {
        self.disturbed_since.entry(n).or_insert(self.now);
    }

    /// Ends node `n`'s disturbance if it is healthy again.
    pub(crate) fn undisturb(&mut self, n: u8) {
        let node = &self.nodes[usize::from(n)];
        if node.up && !node.poisoned && node.paused_until <= self.now {
            if let Some(from) = self.disturbed_since.remove(&n) {
                self.history.disturbances.push(Disturbance { from_ms: from, to_ms: self.now });
            }
        }
    }

    fn step(&mut self, s: Scheduled) {
        self.now = s.at;
        self.events += 1;
        s.at.hash(&mut self.trace);
        s.ev.trace(&mut self.trace);
        if self.debug {
            eprintln!("{:>6} {:?}", s.at, s.ev);
        }
        match s.ev {
            Event::Deliver { from, to, msg } => match to {
                Addr::Node(n) => {
                    let node = &self.nodes[usize::from(n)];
                    if !node.up {
                        return;
                    }
                    if node.paused_until > self.now {
                        let until = node.paused_until;
                        self.at(until, Event::Deliver { from, to, msg });
                        return;
                    }
                    self.node_deliver(n, from, msg);
                }
                Addr::Client(c) => self.client_deliver(c, msg),
                Addr::Control => self.coord_deliver(from, msg),
            },
            Event::Timer { node, incarnation, timer } => {
                let nd = &self.nodes[usize::from(node)];
                if nd.incarnation != incarnation || !nd.up {
                    return;
                }
                if nd.paused_until > self.now {
                    let until = nd.paused_until;
                    self.at(until, Event::Timer { node, incarnation, timer });
                    return;
                }
                self.node_timer(node, timer);
            }
            Event::ClientNext(c) => self.client_next(c),
            Event::ClientTimeout { client, kind, op, attempt } => {
                self.client_timeout(client, kind, op, attempt)
            }
            Event::Crash(n) => {
                if self.phase == Phase::Chaos && self.nodes[usize::from(n)].up {
                    self.crash(n);
                    let down = self.uniform(self.rates.down_ms);
                    let inc = self.nodes[usize::from(n)].incarnation;
                    self.after(down, Event::Restart(n, inc));
                }
            }
            Event::Restart(n, inc) => {
                let node = &self.nodes[usize::from(n)];
                if !node.up && node.incarnation == inc {
                    self.restart(n);
                }
            }
            Event::PartitionStart(i) => {
                if self.phase == Phase::Chaos {
                    let (links, len) = self.partitions[i].clone();
                    self.net.cut(&links);
                    let kind = if links.len() == 1 {
                        FaultKind::PartitionOneWay
                    } else {
                        FaultKind::PartitionSymmetric
                    };
                    self.count(kind);
                    let mut touched: Vec<u8> = links.iter().flat_map(|&(a, b)| [a, b]).collect();
                    touched.sort_unstable();
                    touched.dedup();
                    self.history.disturbances.push(Disturbance {
                        from_ms: self.now,
                        to_ms: (self.now + len).min(self.cfg.chaos_ms),
                    });
                    self.after(len, Event::PartitionEnd(i));
                }
            }
            Event::PartitionEnd(i) => {
                if self.phase == Phase::Chaos {
                    let links = self.partitions[i].0.clone();
                    self.net.restore(&links);
                }
            }
            Event::Pause(n, len) => {
                let node = &mut self.nodes[usize::from(n)];
                if self.phase == Phase::Chaos && node.up {
                    node.paused_until = node.paused_until.max(self.now + len);
                    self.count(FaultKind::Pause);
                    self.history.disturbances.push(Disturbance { from_ms: self.now, to_ms: self.now + len });
                }
            }
            Event::MetaOutage(len) => {
                if self.phase == Phase::Chaos {
                    self.meta.unavailable_until_ms = self.meta.unavailable_until_ms.max(self.now + len);
                    self.count(FaultKind::MetaOutage);
                    self.history.disturbances.push(Disturbance { from_ms: self.now, to_ms: self.now + len });
                }
            }
            Event::RequestTransition => {
                if self.phase == Phase::Chaos {
                    self.request_transition();
                }
            }
            Event::CoordTick => {
                self.coord_tick();
                if !self.finished {
                    self.after(COORD_TICK_MS, Event::CoordTick);
                }
            }
            Event::Heal => self.heal(),
            Event::Settle => self.settle(),
        }
    }

    fn heal(&mut self) {
        self.phase = Phase::Healed;
        self.history.healed_ms = self.now;
        self.net.heal();
        self.meta.unavailable_until_ms = 0;
        for n in 0..self.cfg.nodes {
            let node = &mut self.nodes[usize::from(n)];
            node.paused_until = node.paused_until.min(self.now);
            if !node.up || node.poisoned {
                if node.up {
                    self.crash(n);
                }
                self.restart(n);
            }
            self.undisturb(n);
        }
        let open: Vec<(u8, u64)> = std::mem::take(&mut self.disturbed_since).into_iter().collect();
        for (_, from) in open {
            self.history.disturbances.push(Disturbance { from_ms: from, to_ms: self.now });
        }
        self.after(SETTLE_QUIET_MS, Event::Settle);
    }

    /// Runs the simulation to its end.
    pub(crate) fn run(mut self) -> RunReport {
        #[cfg(feature = "planted-bugs")]
        tally_core::planted::plant(self.cfg.plant);
        self.setup();
        let deadline = self.cfg.chaos_ms + SETTLE_MS_MAX;
        let mut stalled = None;
        while let Some(s) = self.queue.pop() {
            if self.finished {
                break;
            }
            if s.at > deadline || self.events >= EVENTS_MAX {
                stalled = Some(format!(
                    "the run did not settle: simulated time {} ms, {} events; still resolving: {}",
                    s.at,
                    self.events,
                    self.clients.iter().filter(|c| !c.done).count()
                ));
                break;
            }
            self.step(s);
        }
        if self.debug {
            for shard in self.meta.all_shards() {
                let owner = self.meta.owner(&shard);
                let vals: Vec<String> = self
                    .nodes
                    .iter()
                    .map(|n| n.store.load_shard(&shard).map(|i| i.value.to_string()).unwrap_or_default())
                    .collect();
                eprintln!("final {shard} owner node{} values by node {:?}", owner + 1, vals);
            }
            for op in &self.history.incrs {
                let Some(id) = op.attempts.first().and_then(|a| a.event_id.clone()) else { continue };
                if !matches!(op.status(), crate::history::Status::Applied { .. }) {
                    continue;
                }
                let name = CounterName::new(self.history.counters[op.counter].name.clone()).expect("valid");
                let meta = &self.meta.counters[&name];
                let found = meta.generations().any(|(g, shards)| {
                    let sid = ShardId::new(name.clone(), g, tally_core::router::shard_of_event(&id, shards));
                    let o = self.meta.owner(&sid);
                    self.nodes[usize::from(o)].store.dedup_get(&sid, &id).ok().flatten().is_some()
                });
                if !found {
                    eprintln!("final: applied {id} on {name} has no dedup record at its owner");
                }
            }
        }
        #[cfg(feature = "planted-bugs")]
        tally_core::planted::plant(None);
        let mut violations = check::check_all(&self.history);
        if let Some(msg) = stalled {
            violations.push(Violation { invariant: "liveness", detail: msg });
        }
        let ops = (self.history.incrs.len()
            + self.history.reads.len()
            + self.history.distincts.len()
            + self.history.reconciles.len()) as u64;
        RunReport {
            trace_hash: self.trace.finish(),
            sim_ms: self.now,
            events: self.events,
            faults: self.faults,
            ops,
            violations,
            history: self.history,
            config: self.cfg,
        }
    }
}

/// Runs one seeded simulation. A panic inside the run (an assertion of the core or
/// the store, say) is reported as a violation of the run, with its message.
pub fn run(cfg: SimConfig) -> RunReport {
    guarded(cfg, |c| Sim::new(c).run())
}

/// Runs `body` on `cfg`, turning a panic inside it into a `no-panic` violation of
/// the run (both tiers run this way).
pub(crate) fn guarded(cfg: SimConfig, body: impl FnOnce(SimConfig) -> RunReport) -> RunReport {
    let c = cfg.clone();
    let panics = PanicWatch::start();
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(c)));
    let caught = panics.finish();
    match ran {
        // A panic inside a task (an actor's handler, openraft's core) ends only that
        // task: the run goes on without it, and reports it here.
        Ok(mut r) => {
            let tasks = caught.into_iter().map(|detail| Violation { invariant: "no-panic", detail });
            r.violations.extend(tasks);
            r
        }
        Err(payload) => {
            #[cfg(feature = "planted-bugs")]
            tally_core::planted::plant(None);
            let msg = panic_message(payload.as_ref());
            RunReport::cut_short(cfg, vec![Violation { invariant: "no-panic", detail: msg }])
        }
    }
}

impl RunReport {
    /// The report of a run that ended before it could report anything else.
    fn cut_short(config: SimConfig, violations: Vec<Violation>) -> Self {
        RunReport {
            config,
            trace_hash: 0,
            sim_ms: 0,
            events: 0,
            faults: BTreeMap::new(),
            ops: 0,
            violations,
            history: History::default(),
        }
    }
}

/// Records the panics of one run's thread: every task of a run (actors, range
/// groups, timers) runs on the thread that runs it, and a panic in a task does not
/// unwind to [`guarded`], so a hook collects its message.
struct PanicWatch;

thread_local! {
    /// The messages of this thread's panics during a run; `None` outside a run.
    static PANICS: std::cell::RefCell<Option<Vec<String>>> = const { std::cell::RefCell::new(None) };
}

impl PanicWatch {
    fn start() -> Self {
        static HOOK: std::sync::Once = std::sync::Once::new();
        HOOK.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                let at =
                    info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
                let msg = panic_message(info.payload());
                // `try_with`: a panic while the thread's locals are torn down is
                // only printed.
                let _ = PANICS.try_with(|p| {
                    if let Some(p) = p.borrow_mut().as_mut() {
                        p.push(format!("{msg}{at}"));
                    }
                });
                previous(info);
            }));
        });
        PANICS.with(|p| *p.borrow_mut() = Some(Vec::new()));
        PanicWatch
    }

    /// The panics recorded since [`PanicWatch::start`].
    fn finish(self) -> Vec<String> {
        PANICS.with(|p| p.borrow_mut().take()).unwrap_or_default()
    }
}

/// A panic's message, from its payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FaultLevel;

    /// A run whose body spawns one task, which panics or not.
    fn run_with_task(panics: bool) -> RunReport {
        guarded(SimConfig::short(0, 2, FaultLevel::Light), |c| {
            let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a runtime");
            runtime.block_on(async {
                let task = tokio::spawn(async move { assert!(!panics, "a task's own assertion") });
                let _ = task.await;
            });
            RunReport::cut_short(c, Vec::new())
        })
    }

    #[test]
    fn a_panic_inside_a_task_is_a_violation_of_its_run() {
        let r = run_with_task(true);
        let found =
            r.violations.iter().any(|v| v.invariant == "no-panic" && v.detail.contains("own assertion"));
        assert!(found, "{:?}", r.violations);
        // The next run on this thread starts clean.
        assert!(run_with_task(false).violations.is_empty());
    }
}
