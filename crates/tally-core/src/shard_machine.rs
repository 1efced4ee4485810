//! The shard as a state machine: every decision of a shard, with no I/O.
//!
//! A shard takes submissions, batches them, looks up the dedup records of their ids,
//! decides the batch ([`decide`]), writes the result atomically and answers — `sync`
//! increments after the flush that follows the write, everything else once it is
//! applied. It can be sealed (a resharding), merge a sketch into its own (a resharding
//! carries a sealed generation's members into the next one), drop expired dedup
//! records, and must forget what it decided when a write fails.
//!
//! [`ShardMachine::step`] takes one [`Input`] and returns the [`Effect`]s to carry out,
//! in order; a shell carries them out and feeds back what they produced (the records
//! found, whether a write was applied). The engine's shard actor is such a shell, and
//! so is the simulator: both run this code, so neither has a shard of its own.
//!
//! The machine has one write in flight at most. While it waits for the records of a
//! batch or for a write to be applied, new submissions queue; they form the next batch.
//!
//! `R` is the shell's handle for answering one submission (a reply port, a message
//! address); the machine only hands it back in an effect, or drops it — a dropped
//! handle tells its caller the shard stopped, and the caller retries with the same
//! event id.

use crate::dedup::{is_mark_id, DedupRecord};
use crate::escrow::{self, Bounds, Durable, Ledger, Tuning};
use crate::frequency::{FrequencySketch, FrequencySpec};
use crate::shard::{
    decide, Outcome, ShardImage, ShardReply, ShardState, ShardWrite, Submission, COMMIT_SUBMISSIONS_MAX,
};
use crate::sketch::DistinctSketch;
use crate::spec::Durability;
use crate::window::{state_for, Window, WindowSet, WindowState};
use std::collections::{BTreeMap, VecDeque};

/// How often a shell sends [`Input::EscrowTick`] to a shard whose escrow is not
/// settled, in milliseconds.
pub const ESCROW_TICK_MS: u64 = 20;

/// What the machine needs of its counter's metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardParams {
    /// `sync` answers single increments after the flush that follows their write.
    pub durability: Durability,
    /// How long the counter's event ids are remembered.
    pub dedup_window_ms: u64,
    /// Whether the counter keeps a distinct-count sketch.
    pub distinct: bool,
    /// The shape of the counter's frequency sketch, if it keeps one.
    pub frequency: Option<FrequencySpec>,
    /// The sliding windows whose buckets the shard keeps.
    pub windows: WindowSet,
    /// The counter's bounds: with either, the shard keeps an escrow ledger
    /// ([`crate::escrow`]) and spends its share for every increment it counts.
    pub bounds: Bounds,
    /// The window a window limit caps: the ledger's upper bound is on that window's
    /// total, and buckets leaving it give their headroom back ([`crate::escrow`]'s
    /// *Window limits*). `None` when `bounds` bound the value.
    pub limit: Option<Window>,
    /// This shard's index in its generation.
    pub shard: u16,
    /// How many shards its generation has.
    pub shards: u16,
    /// The escrow's timers (how long a change at its bound waits for headroom).
    pub escrow: Tuning,
}

impl ShardParams {
    /// The parameters of shard `id` of the counter `meta` describes (a sealed
    /// generation's shard keeps that generation's shard count), with the escrow
    /// timers `escrow`.
    pub fn of(meta: &crate::meta::CounterMeta, id: &crate::ids::ShardId, escrow: Tuning) -> Self {
        let layout = &meta.layout;
        let shards = match layout.sealed.iter().find(|g| g.generation == id.generation) {
            Some(sealed) => sealed.shards,
            None => layout.shards,
        };
        ShardParams {
            durability: meta.spec.durability,
            dedup_window_ms: meta.spec.dedup_window_ms(),
            distinct: meta.spec.distinct,
            frequency: meta.spec.frequency,
            windows: meta.spec.windows,
            bounds: meta.spec.bounds(),
            limit: meta.spec.limit.map(|l| l.window),
            shard: id.index,
            shards,
            escrow,
        }
    }
}

/// A message between two shards of one bounded counter, for shard `.0`.
pub type EscrowSend = (u16, escrow::Message);

/// A submission waiting in a queue: with the time it first found its shard's escrow
/// share short, if it did.
pub type Queued<R> = (Submission, R, Option<u64>);

/// One thing that happened to a shard.
#[derive(Debug)]
pub enum Input<R> {
    /// A submission arrived; `reply` answers it.
    Submit {
        /// What to count.
        sub: Submission,
        /// How to answer it.
        reply: R,
    },
    /// The commit asked for by [`Effect::ScheduleCommit`] is due. `writable` is false
    /// when the store takes no writes (a failed flush): the batch is then dropped
    /// unanswered.
    CommitDue {
        /// Whether the store takes writes.
        writable: bool,
    },
    /// The records asked for by [`Effect::LookUpPriors`], or `None` if some could not
    /// be read (the batch is dropped unanswered; nothing was decided).
    Priors(Option<BTreeMap<String, DedupRecord>>),
    /// Whether the write of [`Effect::Write`] was applied.
    Applied {
        /// Applied (true) or failed, changing nothing (false).
        ok: bool,
    },
    /// The shard as the store holds it, asked for by [`Effect::Reload`]; `None` if it
    /// could not be read.
    Reloaded(Option<(ShardImage, Option<DistinctSketch>)>),
    /// Stop taking writes; what is queued is still committed first.
    Seal,
    /// Merge a resharding's sketches into this shard's: the distinct sketch by union
    /// (idempotent), the frequency sketch and the window buckets once (a repeated
    /// carry changes nothing).
    MergeSketch {
        /// The sealed generation's distinct sketch, if it has one.
        distinct: Option<DistinctSketch>,
        /// The sealed generation's frequency sketch, if it has one.
        frequency: Option<FrequencySketch>,
        /// The sealed generation's window buckets, merged over its shards, if any.
        windows: Option<WindowState>,
    },
    /// Remove these expired dedup records.
    Sweep {
        /// Their ids.
        expired: Vec<String>,
    },
    /// A message from another shard of the same bounded counter.
    Escrow(escrow::Message),
    /// Time passed: submissions waiting for headroom may expire, escrow grants be
    /// resent, borrow requests repeated. A shell sends it every
    /// [`ESCROW_TICK_MS`] while [`ShardMachine::escrow_settled`] is false.
    EscrowTick,
    /// The counter's metadata changed. `sealed` is true once the shard's generation is
    /// no longer the current one.
    MetaChanged {
        /// The new parameters.
        params: ShardParams,
        /// Whether the shard's generation was sealed.
        sealed: bool,
    },
}

/// One thing the shell must do.
#[derive(Debug, PartialEq)]
pub enum Effect<R> {
    /// Deliver [`Input::CommitDue`] after the inputs already queued: submissions that
    /// arrive meanwhile join the batch. That is the batching.
    ScheduleCommit,
    /// Find the dedup records of these ids — this shard's, or its shard's in each
    /// sealed generation still inside the id's window — and answer with
    /// [`Input::Priors`].
    LookUpPriors {
        /// The ids, each once.
        ids: Vec<String>,
    },
    /// Apply `write` through the commit path and answer with [`Input::Applied`].
    /// `durable` answers go out after the flush that follows the write, and are
    /// dropped if the write or the flush fails.
    Write {
        /// The shard's new state and records.
        write: ShardWrite,
        /// Answers that wait for durability.
        durable: Vec<(R, ShardReply)>,
        /// Escrow messages that wait for durability too: the ledger state they come
        /// from is in this write.
        sends: Vec<EscrowSend>,
        /// Absolute change of the value (the rollup counts it before the write).
        change_abs: u64,
        /// Submissions the write decides (0 for a merge or a sweep).
        submissions: usize,
    },
    /// Answer now.
    Reply {
        /// Whom.
        to: R,
        /// What.
        reply: ShardReply,
    },
    /// Answer after the next flush that starts from now (answers of a `sync` batch
    /// that wrote nothing: the records they matched may not be durable yet).
    ReplyAfterFlush(Vec<(R, ShardReply)>),
    /// Send escrow messages to other shards of the counter: now, or (`after_flush`)
    /// after the next flush that starts from now, because the ledger state they come
    /// from is written but may not be durable yet.
    Escrow {
        /// The messages, each for shard `.0`.
        sends: Vec<EscrowSend>,
        /// Whether they wait for a flush.
        after_flush: bool,
    },
    /// Read the shard from the store and answer with [`Input::Reloaded`]: a write
    /// failed, so what the machine decided is not what the store holds.
    Reload,
    /// The seal is in effect and everything queued before it is applied: make it
    /// durable and answer the sealer with this final image.
    Sealed(ShardImage),
    /// The merged sketch is applied: make it durable and answer the merger.
    Merged,
    /// A write failed and the shard cannot be read back: this copy must not decide
    /// again. Stop it; a new copy starts from the store.
    Stop,
}

/// What the machine waits for.
#[derive(Debug)]
enum Phase<R> {
    /// Nothing.
    Idle,
    /// The records of this batch.
    LookingUp(Vec<Queued<R>>),
    /// The write of a batch, whose other answers go out once it is applied.
    Writing(Vec<(R, ShardReply)>),
    /// The write of a merge.
    Merging,
    /// The write of a sweep, removing this many writer marks.
    Sweeping(u64, u64),
    /// The write of the escrow ledger alone.
    Persisting,
    /// The image, after a failed write.
    Reloading,
}

/// A shard's state and decisions.
#[derive(Debug)]
pub struct ShardMachine<R> {
    params: ShardParams,
    state: ShardState,
    /// The encoded sketch, re-encoded only when the sketch changes.
    sketch_bytes: Option<Vec<u8>>,
    /// The encoded frequency sketch, re-encoded only when it changes. Bytes that do not
    /// decode (a shell checks them at load, [`ShardImage::decode_frequency`]) are kept
    /// as stored and not added to.
    frequency_bytes: Option<Vec<u8>>,
    /// The encoded window buckets, re-encoded when they change; like the frequency
    /// sketch, bytes that do not decode are kept as stored and not added to.
    windows_bytes: Option<Vec<u8>>,
    /// Refuses submissions (answers [`ShardReply::Sealed`]); those queued before the
    /// seal are still committed.
    sealed: bool,
    /// A seal is asked for and not yet answered with [`Effect::Sealed`].
    seal_waiting: bool,
    /// Expired records to remove, waiting for the write in flight to end: the
    /// next write removes them, before the next batch (a shard whose commits never
    /// pause still sweeps).
    sweep_waiting: Vec<String>,
    /// A merge waiting for the machine to be idle.
    merge_waiting: Option<DistinctSketch>,
    /// A frequency carry waiting for the machine to be idle (the first one asked for:
    /// a resharding carries the same union every time).
    carry_waiting: Option<FrequencySketch>,
    /// A window carry waiting for the machine to be idle (the first one asked for).
    windows_waiting: Option<WindowState>,
    /// Submissions not yet taken into a batch.
    pending: VecDeque<Queued<R>>,
    /// The escrow ledger of a bounded counter's shard: submissions short of headroom
    /// wait in it.
    escrow: Option<Ledger<Queued<R>>>,
    /// The ledger changed since the last write started: the next write carries it.
    escrow_dirty: bool,
    /// Escrow messages that wait for the next write to start (it carries the ledger
    /// state they come from).
    outbox: Vec<EscrowSend>,
    /// Escrow messages that wait for the write in flight to be applied.
    outbox_applied: Vec<EscrowSend>,
    commit_scheduled: bool,
    phase: Phase<R>,
    /// A failed write could not be undone: nothing more is decided.
    broken: bool,
}

impl<R> ShardMachine<R> {
    /// A shard as the store holds it. `sealed` when its generation is sealed (by the
    /// metadata, or by a durable seal marker).
    pub fn new(params: ShardParams, image: ShardImage, sketch: Option<DistinctSketch>, sealed: bool) -> Self {
        let sketch = sketch.or_else(|| params.distinct.then(DistinctSketch::new));
        let frequency = frequency_of(&params, &image);
        let windows = windows_of(&params, &image);
        let windows_bytes = encoded_windows(&params, &windows, image.windows);
        let escrow = ledger_of(&params, image.escrow.as_deref());
        Self {
            params,
            state: ShardState {
                value: image.value,
                sketch,
                frequency,
                windows,
                writer_marks: 0,
                event_ids: 0,
                event_ids_max: None,
            },
            sketch_bytes: image.sketch,
            frequency_bytes: image.frequency,
            windows_bytes,
            sealed,
            seal_waiting: false,
            sweep_waiting: Vec::new(),
            merge_waiting: None,
            carry_waiting: None,
            windows_waiting: None,
            pending: VecDeque::new(),
            escrow,
            escrow_dirty: false,
            outbox: Vec::new(),
            outbox_applied: Vec::new(),
            commit_scheduled: false,
            phase: Phase::Idle,
            broken: false,
        }
    }

    /// Tells the machine how many writer marks the store holds for this shard (the
    /// shell counts them when the shard starts; see
    /// [`crate::dedup::WRITERS_PER_SHARD_MAX`]).
    pub fn set_writer_marks(&mut self, marks: u64) {
        self.state.writer_marks = marks;
    }

    /// How many writer marks this copy counts.
    pub fn writer_marks(&self) -> u64 {
        self.state.writer_marks
    }

    /// Tells the machine how many event-id records the store holds for this shard
    /// (the shell counts them when the shard starts) and the most it may hold
    /// (`None`: no bound). A new event id beyond it is refused with
    /// [`crate::shard::Outcome::TooManyEventIds`].
    pub fn set_event_ids(&mut self, ids: u64, max: Option<u64>) {
        self.state.event_ids = ids;
        self.state.event_ids_max = max;
    }

    /// How many event-id records this copy counts.
    pub fn event_ids(&self) -> u64 {
        self.state.event_ids
    }

    /// The shard's value as decided.
    pub fn value(&self) -> i64 {
        self.state.value
    }

    /// The shard's image as decided.
    pub fn image(&self) -> ShardImage {
        ShardImage {
            value: self.state.value,
            sketch: self.sketch_bytes.clone(),
            frequency: self.frequency_bytes.clone(),
            windows: self.windows_bytes.clone(),
            escrow: self.escrow.as_ref().map(|l| l.durable().to_bytes()),
        }
    }

    /// The escrow ledger, for a bounded counter's shard.
    pub fn escrow(&self) -> Option<&Ledger<Queued<R>>> {
        self.escrow.as_ref()
    }

    /// Whether the escrow needs no [`Input::EscrowTick`]: nothing waits for headroom,
    /// no transfer is unacknowledged, no escrow message waits to be sent.
    pub fn escrow_settled(&self) -> bool {
        self.escrow.as_ref().is_none_or(Ledger::settled) && !self.escrow_dirty
    }

    /// The shard's window buckets as decided (`None` for a counter without windows,
    /// or stored buckets that did not decode).
    pub fn windows(&self) -> Option<&WindowState> {
        self.state.windows.as_ref()
    }

    /// Whether submissions are refused.
    pub fn sealed(&self) -> bool {
        self.sealed
    }

    /// Whether nothing is queued or in flight: the shard may stop.
    pub fn quiet(&self) -> bool {
        self.drained() && self.escrow_settled()
    }

    /// Whether nothing admitted waits to be written: no submission queued or being
    /// committed, no seal to answer, no ledger change unwritten. A stopping shard
    /// commits until this holds; changes parked for headroom are not waited for (a
    /// borrow may need a shard that is stopping too), their callers hear that the
    /// shard stopped and retry, and unacknowledged transfers are resent by the next
    /// copy from the stored ledger.
    pub fn drained(&self) -> bool {
        self.pending.is_empty()
            && matches!(self.phase, Phase::Idle)
            && !self.seal_waiting
            && !self.escrow_dirty
    }

    /// Whether the shell may hand over the next page of expired records
    /// ([`Input::Sweep`]): the last one is written (or its write is under way), and
    /// this copy is neither sealed nor broken.
    pub fn sweepable(&self) -> bool {
        self.sweep_waiting.is_empty() && !self.sealed && !self.broken
    }

    /// Whether this copy stopped deciding (see [`Effect::Stop`]).
    pub fn broken(&self) -> bool {
        self.broken
    }

    /// Takes one input at `now_ms` and returns what to do, in order.
    pub fn step(&mut self, now_ms: u64, input: Input<R>) -> Vec<Effect<R>> {
        let mut out = Vec::new();
        if self.broken {
            // Every handle in the input is dropped: its caller retries elsewhere.
            return out;
        }
        match input {
            Input::Submit { sub, reply } => {
                if self.sealed {
                    out.push(Effect::Reply { to: reply, reply: ShardReply::Sealed });
                } else {
                    self.pending.push_back((sub, reply, None));
                }
            }
            Input::CommitDue { writable } => {
                self.commit_scheduled = false;
                if matches!(self.phase, Phase::Idle) && !self.pending.is_empty() {
                    let take = self.pending.len().min(COMMIT_SUBMISSIONS_MAX);
                    let batch: Vec<Queued<R>> = self.pending.drain(..take).collect();
                    if writable {
                        let ids = record_ids(&batch);
                        if ids.is_empty() {
                            self.decide(now_ms, batch, &BTreeMap::new(), &mut out);
                        } else {
                            self.phase = Phase::LookingUp(batch);
                            out.push(Effect::LookUpPriors { ids });
                        }
                    }
                }
            }
            Input::Priors(found) => {
                if let Phase::LookingUp(batch) = std::mem::replace(&mut self.phase, Phase::Idle) {
                    if let Some(prior) = found {
                        self.decide(now_ms, batch, &prior, &mut out);
                    }
                }
            }
            Input::Applied { ok } => {
                let phase = std::mem::replace(&mut self.phase, Phase::Idle);
                let written = matches!(
                    phase,
                    Phase::Writing(_) | Phase::Merging | Phase::Sweeping(..) | Phase::Persisting
                );
                if written && ok && !self.outbox_applied.is_empty() {
                    let sends = std::mem::take(&mut self.outbox_applied);
                    out.push(Effect::Escrow { sends, after_flush: true });
                }
                match phase {
                    Phase::Writing(replies) if ok => {
                        out.extend(replies.into_iter().map(|(to, reply)| Effect::Reply { to, reply }));
                    }
                    Phase::Merging if ok => out.push(Effect::Merged),
                    Phase::Sweeping(marks, ids) if ok => {
                        self.state.writer_marks = self.state.writer_marks.saturating_sub(marks);
                        self.state.event_ids = self.state.event_ids.saturating_sub(ids);
                    }
                    Phase::Persisting if ok => {}
                    Phase::Writing(_) | Phase::Merging | Phase::Sweeping(..) | Phase::Persisting => {
                        self.phase = Phase::Reloading;
                        out.push(Effect::Reload);
                    }
                    other => self.phase = other,
                }
            }
            Input::Reloaded(image) => {
                if matches!(self.phase, Phase::Reloading) {
                    self.phase = Phase::Idle;
                    match image {
                        Some((image, sketch)) => {
                            let sketch = sketch.or_else(|| self.params.distinct.then(DistinctSketch::new));
                            let frequency = frequency_of(&self.params, &image);
                            let windows = windows_of(&self.params, &image);
                            // The store's mark count is not read back: the count stays
                            // as decided (at worst high, refusing new writers early).
                            let (writer_marks, event_ids, event_ids_max) =
                                (self.state.writer_marks, self.state.event_ids, self.state.event_ids_max);
                            self.windows_bytes = encoded_windows(&self.params, &windows, image.windows);
                            self.state = ShardState {
                                value: image.value,
                                sketch,
                                frequency,
                                windows,
                                writer_marks,
                                event_ids,
                                event_ids_max,
                            };
                            self.sketch_bytes = image.sketch;
                            self.frequency_bytes = image.frequency;
                            // The ledger goes back to what is stored; messages from
                            // the state that was not are never sent. Submissions that
                            // waited in it wait again.
                            self.reload_escrow(image.escrow.as_deref());
                        }
                        None => {
                            self.broken = true;
                            self.pending.clear();
                            self.escrow = None;
                            self.outbox.clear();
                            self.outbox_applied.clear();
                            self.merge_waiting = None;
                            self.carry_waiting = None;
                            self.windows_waiting = None;
                            return vec![Effect::Stop];
                        }
                    }
                }
            }
            Input::Seal => {
                self.sealed = true;
                self.seal_waiting = true;
                // A sealed copy writes nothing more of its own.
                self.sweep_waiting.clear();
            }
            Input::MergeSketch { distinct, frequency, windows } => {
                if let Some(sketch) = distinct {
                    self.merge_waiting.get_or_insert_with(DistinctSketch::new).merge(&sketch);
                }
                if let Some(f) = frequency {
                    self.carry_waiting.get_or_insert(f);
                }
                if let Some(w) = windows {
                    self.windows_waiting.get_or_insert(w);
                }
            }
            Input::Sweep { expired } => {
                // Written at once between commits, or as the next write (`next`).
                if !self.sealed {
                    self.sweep_waiting = expired;
                }
            }
            Input::Escrow(message) => {
                // A donor gives from what its expired buckets gave back too.
                self.release_expired(now_ms, &mut out);
                if let Some(ledger) = self.escrow.as_mut() {
                    let effects = ledger.step(now_ms, escrow::Input::Receive(message));
                    self.escrow_effects(effects, &mut out);
                }
            }
            Input::EscrowTick => {
                self.release_expired(now_ms, &mut out);
                if let Some(ledger) = self.escrow.as_mut() {
                    let effects = ledger.step(now_ms, escrow::Input::Tick);
                    self.escrow_effects(effects, &mut out);
                }
            }
            Input::MetaChanged { params, sealed } => {
                if params.distinct && self.state.sketch.is_none() {
                    self.state.sketch = Some(DistinctSketch::new());
                }
                // Frequencies turned on: start counting (stored bytes that did not
                // decode stay as they are).
                if self.state.frequency.is_none() && self.frequency_bytes.is_none() {
                    self.state.frequency = params.frequency.and_then(|f| FrequencySketch::new(&f).ok());
                }
                // Windows changed: kept ones keep their buckets (stored bytes that did
                // not decode stay as they are).
                if (params.windows, params.distinct) != (self.params.windows, self.params.distinct)
                    && (self.state.windows.is_some() || self.windows_bytes.is_none())
                {
                    self.state.windows = match self.state.windows.take() {
                        Some(mut w) if !params.windows.is_empty() => {
                            w.respec(&params.windows.windows(), params.distinct);
                            Some(w)
                        }
                        _ => state_for(&params.windows, params.distinct, None).ok().flatten(),
                    };
                    self.windows_bytes = self.state.windows.as_ref().map(WindowState::to_bytes);
                }
                self.params = params;
                self.sealed |= sealed;
            }
        }
        self.next(&mut out);
        self.check();
        out
    }

    /// The machine's invariants, checked after every step, in production too: a
    /// broken one is a bug that would otherwise write or answer from a state the
    /// shard cannot be in.
    fn check(&self) {
        if self.broken {
            assert!(
                self.pending.is_empty()
                    && self.escrow.is_none()
                    && self.outbox.is_empty()
                    && self.outbox_applied.is_empty(),
                "a broken copy holds nothing to decide or send"
            );
            return;
        }
        assert!(!self.seal_waiting || self.sealed, "a seal is answered only by a sealed copy");
        assert!(!self.sealed || self.sweep_waiting.is_empty(), "a sealed copy sweeps nothing");
        if matches!(self.phase, Phase::Idle) {
            assert!(self.sweep_waiting.is_empty(), "an idle copy writes its sweep at once");
            assert!(
                self.pending.is_empty() || self.commit_scheduled,
                "queued submissions wait for a scheduled commit"
            );
        }
        if self.escrow.is_none() {
            assert!(
                !self.escrow_dirty && self.outbox.is_empty() && self.outbox_applied.is_empty(),
                "only a bounded counter's shard has escrow to write or send"
            );
        }
        if let Some(w) = &self.state.windows {
            w.check();
        }
    }

    /// What follows once the current input is handled: the next batch, a waiting
    /// merge, or the answer to a seal.
    fn next(&mut self, out: &mut Vec<Effect<R>>) {
        if !matches!(self.phase, Phase::Idle) {
            return;
        }
        if !self.sweep_waiting.is_empty() {
            // Before the next batch, which waits one write: a shard whose commits
            // follow each other without a pause would otherwise never sweep.
            let expired = std::mem::take(&mut self.sweep_waiting);
            let marks = expired.iter().filter(|id| is_mark_id(id)).count() as u64;
            let ids = expired.iter().filter(|id| crate::dedup::is_client_event_id(id)).count() as u64;
            let write = ShardWrite { image: self.image(), dedup_put: Vec::new(), dedup_remove: expired };
            self.phase = Phase::Sweeping(marks, ids);
            let sends = self.escrow_written();
            out.push(Effect::Write { write, durable: Vec::new(), sends, change_abs: 0, submissions: 0 });
            return;
        }
        if !self.pending.is_empty() {
            if !self.commit_scheduled {
                self.commit_scheduled = true;
                out.push(Effect::ScheduleCommit);
            }
            return;
        }
        if self.escrow_dirty {
            // A transfer granted or credited, or acknowledged: the ledger is written
            // before any message that follows from it goes out.
            self.phase = Phase::Persisting;
            let sends = self.escrow_written();
            let write = ShardWrite { image: self.image(), ..ShardWrite::default() };
            out.push(Effect::Write { write, durable: Vec::new(), sends, change_abs: 0, submissions: 0 });
            return;
        }
        let (distinct, frequency) = (self.merge_waiting.take(), self.carry_waiting.take());
        let windows = self.windows_waiting.take();
        if distinct.is_some() || frequency.is_some() || windows.is_some() {
            let mut changed = false;
            if let (Some(incoming), Some(mine)) = (windows, self.state.windows.as_mut()) {
                // Windows this shard does not keep (the spec changed meanwhile) are
                // not carried; a repeated carry changes nothing.
                if mine.carry(&incoming) {
                    self.windows_bytes = Some(mine.to_bytes());
                    changed = true;
                }
            }
            if let Some(incoming) = distinct {
                let mut merged = self.state.sketch.clone().unwrap_or_default();
                merged.merge(&incoming);
                let bytes = Some(merged.to_bytes());
                if bytes != self.sketch_bytes {
                    self.state.sketch = Some(merged);
                    self.sketch_bytes = bytes;
                    changed = true;
                }
            }
            if let Some(incoming) = frequency {
                // A shard without a frequency sketch of its own (frequencies were not
                // on when it started) takes the carried one as it is.
                let mut mine = match (&self.state.frequency, &self.frequency_bytes) {
                    (Some(f), _) => Some(f.clone()),
                    (None, None) => self.params.frequency.and_then(|f| FrequencySketch::new(&f).ok()),
                    (None, Some(_)) => None,
                };
                // A carry of another shape cannot merge: the sealed sketch is kept in
                // the sealed generation, and this shard counts on from its own.
                if let Some(f) = mine.as_mut() {
                    if f.carry(&incoming).unwrap_or(false) {
                        self.frequency_bytes = Some(f.to_bytes());
                        self.state.frequency = mine;
                        changed = true;
                    }
                }
            }
            if changed {
                self.phase = Phase::Merging;
                out.push(Effect::Write {
                    write: ShardWrite { image: self.image(), ..ShardWrite::default() },
                    durable: Vec::new(),
                    sends: self.escrow_written(),
                    change_abs: 0,
                    submissions: 0,
                });
                return;
            }
            out.push(Effect::Merged);
        }
        if self.seal_waiting {
            self.seal_waiting = false;
            out.push(Effect::Sealed(self.image()));
        }
    }

    /// Decides `batch` against `prior` and emits its write and answers.
    fn decide(
        &mut self,
        now_ms: u64,
        batch: Vec<Queued<R>>,
        prior: &BTreeMap<String, DedupRecord>,
        out: &mut Vec<Effect<R>>,
    ) {
        self.release_expired(now_ms, out);
        let subs: Vec<Submission> = batch.iter().map(|(s, _, _)| s.clone()).collect();
        let before = self.state.value;
        let held = self.limit_held();
        let limit = self.params.limit;
        let d = match self.escrow.as_mut() {
            Some(ledger) => {
                // Under a window limit only additions spend (and come back as their
                // buckets expire); anything else is refused before the ledger sees it.
                let mut spend = |delta: i64| match limit {
                    Some(_) if delta <= 0 => Err(ledger.share(escrow::Side::Up)),
                    _ => ledger.spend(delta),
                };
                decide(&mut self.state, &subs, prior, now_ms, self.params.dedup_window_ms, &mut spend)
            }
            None => {
                decide(&mut self.state, &subs, prior, now_ms, self.params.dedup_window_ms, &mut |_| Ok(()))
            }
        };
        if let (Some(held_before), Some(held_after)) = (held, self.limit_held()) {
            // What was counted and is in no bucket kept — buckets that left the window
            // as new ones began, or an increment stamped behind every kept bucket — is
            // headroom again.
            let counted = i128::from(self.state.value) - i128::from(before);
            self.release(now_ms, counted - (held_after - held_before), out);
        }
        let writes = d.writes(before);
        // Buffered sums were acknowledged already, so they are answered once the write
        // is applied. `sync` single increments wait for the flush: a duplicate's too,
        // since the record it matched may not be durable yet.
        let sync = self.params.durability == Durability::Sync;
        #[cfg(feature = "planted-bugs")]
        let sync = sync && !crate::planted::active(crate::planted::Bug::AckBeforeFlush);
        let (mut now, mut durable, mut short) = (Vec::new(), Vec::new(), Vec::new());
        for (((sub, reply, since), outcome), after) in batch.into_iter().zip(d.outcomes).zip(d.values) {
            if let Outcome::BoundExceeded { .. } = outcome {
                // Short of headroom: nothing was counted; it waits for grants.
                short.push((sub, reply, since));
                continue;
            }
            let done = ShardReply::Done { outcome, value: d.value, after };
            if sync && matches!(sub, Submission::Single { .. }) {
                durable.push((reply, done));
            } else {
                now.push((reply, done));
            }
        }
        self.park(now_ms, short, out);
        if !writes {
            out.extend(now.into_iter().map(|(to, reply)| Effect::Reply { to, reply }));
            if !durable.is_empty() {
                out.push(Effect::ReplyAfterFlush(durable));
            }
            return;
        }
        if d.sketch_changed {
            self.sketch_bytes = self.state.sketch.as_ref().map(DistinctSketch::to_bytes);
        }
        if d.frequency_changed {
            self.frequency_bytes = self.state.frequency.as_ref().map(FrequencySketch::to_bytes);
        }
        if d.windows_changed {
            self.windows_bytes = self.state.windows.as_ref().map(WindowState::to_bytes);
        }
        let sends = self.escrow_written();
        let write = ShardWrite { image: self.image(), dedup_put: d.dedup_put, dedup_remove: Vec::new() };
        self.phase = Phase::Writing(now);
        out.push(Effect::Write { write, durable, sends, change_abs: d.change_abs, submissions: subs.len() });
    }

    /// What the kept buckets of a window limit's window hold (`None` without a limit,
    /// or without window state: bytes that did not decode).
    fn limit_held(&self) -> Option<i128> {
        Some(self.state.windows.as_ref()?.held(self.params.limit?))
    }

    /// Under a window limit, drops the buckets that left their windows at `now_ms`
    /// and gives what the limit's held back to the ledger.
    fn release_expired(&mut self, now_ms: u64, out: &mut Vec<Effect<R>>) {
        let Some(before) = self.limit_held() else { return };
        let Some(w) = self.state.windows.as_mut() else { return };
        if w.expire(now_ms) {
            self.windows_bytes = Some(w.to_bytes());
            let after = self.limit_held().unwrap_or(before);
            self.release(now_ms, before - after, out);
        }
    }

    /// Gives `amount` of a window limit's headroom back to the ledger. Only positive
    /// increments are counted under a limit, so a bucket never holds less than 0 and
    /// nothing leaves the window negative.
    fn release(&mut self, now_ms: u64, amount: i128, out: &mut Vec<Effect<R>>) {
        assert!(amount >= 0, "window limit: buckets that left the window held {amount}");
        let Some(ledger) = self.escrow.as_mut() else { return };
        if amount > 0 {
            let amount = u64::try_from(amount).unwrap_or(u64::MAX);
            let effects = ledger.step(now_ms, escrow::Input::Release { side: escrow::Side::Up, amount });
            self.escrow_effects(effects, out);
        }
    }

    /// Parks submissions short of headroom in the ledger, each since it first was.
    fn park(&mut self, now_ms: u64, short: Vec<Queued<R>>, out: &mut Vec<Effect<R>>) {
        let Some(ledger) = self.escrow.as_mut() else {
            debug_assert!(short.is_empty(), "only an escrow refuses for headroom");
            return;
        };
        let mut effects = Vec::new();
        for (sub, reply, since) in short {
            let Submission::Single { delta, .. } = sub else {
                unreachable!("a drained sum is never refused for headroom")
            };
            if self.params.limit.is_some() && delta <= 0 {
                // Not an addition: no headroom could ever cover it.
                let outcome = Outcome::BoundExceeded { headroom: ledger.share(escrow::Side::Up) };
                let reply_now =
                    ShardReply::Done { outcome, value: self.state.value, after: self.state.value };
                out.push(Effect::Reply { to: reply, reply: reply_now });
                continue;
            }
            let since_ms = since.unwrap_or(now_ms);
            let token = (sub, reply, Some(since_ms));
            effects.extend(ledger.step(now_ms, escrow::Input::Park { delta, token, since_ms }));
        }
        self.escrow_effects(effects, out);
    }

    /// Carries out what the ledger asks: submissions it hands back are decided again
    /// first, refused ones are answered, and messages wait for the ledger state they
    /// come from to be durable.
    fn escrow_effects(&mut self, effects: Vec<escrow::Effect<Queued<R>>>, out: &mut Vec<Effect<R>>) {
        let mut retry = Vec::new();
        let mut now = Vec::new();
        let mut after_flush = Vec::new();
        for e in effects {
            match e {
                escrow::Effect::Retry(queued) => retry.push(queued),
                escrow::Effect::Refuse { token: (_, to, _), headroom } => {
                    let outcome = Outcome::BoundExceeded { headroom };
                    out.push(Effect::Reply {
                        to,
                        reply: ShardReply::Done { outcome, value: self.state.value, after: self.state.value },
                    });
                }
                escrow::Effect::Persist => self.escrow_dirty = true,
                escrow::Effect::Send { to, message } => {
                    if matches!(message, escrow::Message::Borrow { .. }) {
                        // A request carries no state of this shard's.
                        now.push((to, message));
                    } else if self.escrow_dirty {
                        self.outbox.push((to, message));
                    } else if !matches!(self.phase, Phase::Idle) {
                        self.outbox_applied.push((to, message));
                    } else {
                        after_flush.push((to, message));
                    }
                }
            }
        }
        for queued in retry.into_iter().rev() {
            self.pending.push_front(queued);
        }
        if !now.is_empty() {
            out.push(Effect::Escrow { sends: now, after_flush: false });
        }
        if !after_flush.is_empty() {
            out.push(Effect::Escrow { sends: after_flush, after_flush: true });
        }
    }

    /// The messages the write being started carries: the ledger is in it.
    fn escrow_written(&mut self) -> Vec<EscrowSend> {
        self.escrow_dirty = false;
        std::mem::take(&mut self.outbox)
    }

    /// Takes the ledger back to `stored` after a failed write: what was not written
    /// is forgotten, messages from it are dropped, and the submissions that waited in
    /// the forgotten ledger are decided again.
    fn reload_escrow(&mut self, stored: Option<&[u8]>) {
        let Some(old) = self.escrow.take() else { return };
        self.escrow = ledger_of(&self.params, stored);
        self.escrow_dirty = false;
        self.outbox.clear();
        self.outbox_applied.clear();
        for queued in old.into_waiting().into_iter().rev() {
            self.pending.push_front(queued);
        }
    }
}

/// The escrow ledger a bounded counter's shard starts from: the stored one, or its
/// initial share of the headroom when it never wrote one. Stored bytes that do not
/// decode give no headroom at all: the shard refuses what it cannot prove it may
/// admit. `None` for a counter without bounds.
fn ledger_of<R>(params: &ShardParams, stored: Option<&[u8]>) -> Option<Ledger<Queued<R>>> {
    if !params.bounds.any() {
        return None;
    }
    let durable = match stored {
        Some(bytes) => Durable::from_bytes(bytes).unwrap_or_default(),
        None => Durable::initial(params.bounds, params.shard, params.shards).unwrap_or_default(),
    };
    Some(Ledger::new(params.shard, params.shards, params.bounds, params.escrow, durable))
}

/// The frequency sketch a shard starts from: the stored one, or an empty one when the
/// counter keeps frequencies and nothing is stored. `None` for bytes that do not decode
/// (kept as stored, see [`ShardMachine`]).
fn frequency_of(params: &ShardParams, image: &ShardImage) -> Option<FrequencySketch> {
    match image.decode_frequency() {
        Ok(Some(f)) => Some(f),
        Ok(None) => params.frequency.and_then(|f| FrequencySketch::new(&f).ok()),
        Err(_) => None,
    }
}

/// The window buckets a shard starts from: the stored ones following the counter's
/// current windows, or empty ones when it keeps windows and nothing is stored. `None`
/// for bytes that do not decode (kept as stored, see [`ShardMachine`]).
fn windows_of(params: &ShardParams, image: &ShardImage) -> Option<WindowState> {
    state_for(&params.windows, params.distinct, image.windows.as_deref()).ok().flatten()
}

/// The bytes a machine keeps for its window state: the state's own encoding when it
/// changed from what is stored (a respec), else the stored bytes; none once the
/// counter keeps no windows.
fn encoded_windows(
    params: &ShardParams,
    state: &Option<WindowState>,
    stored: Option<Vec<u8>>,
) -> Option<Vec<u8>> {
    if params.windows.is_empty() {
        return None;
    }
    match (state, stored) {
        (Some(w), Some(bytes)) => {
            let ours = w.to_bytes();
            if ours == bytes {
                Some(bytes)
            } else {
                Some(ours)
            }
        }
        (Some(w), None) => Some(w.to_bytes()),
        // Stored bytes that do not decode.
        (None, stored) => stored,
    }
}

/// The dedup ids of a batch (event ids and drain ids), each once, in order.
fn record_ids<R>(batch: &[Queued<R>]) -> Vec<String> {
    let mut seen = std::collections::BTreeSet::new();
    let mut ids = Vec::new();
    for id in batch.iter().filter_map(|(sub, _, _)| sub.record_id()) {
        if seen.insert(id) {
            ids.push(id.to_owned());
        }
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::Outcome;

    const NOW: u64 = 1_000_000;
    const WINDOW: u64 = 60_000;

    fn params(durability: Durability) -> ShardParams {
        ShardParams {
            durability,
            dedup_window_ms: WINDOW,
            distinct: false,
            frequency: None,
            windows: crate::window::WindowSet::NONE,
            bounds: Bounds::default(),
            limit: None,
            shard: 0,
            shards: 1,
            escrow: Tuning::default(),
        }
    }

    fn machine(durability: Durability, value: i64) -> ShardMachine<u32> {
        ShardMachine::new(
            params(durability),
            ShardImage { value, sketch: None, frequency: None, windows: None, escrow: None },
            None,
            false,
        )
    }

    fn single(delta: i64, id: Option<&str>) -> Submission {
        Submission::Single { delta, event_id: id.map(str::to_owned), member: None, item: None, seq: None }
    }

    #[test]
    #[should_panic(expected = "a seal is answered only by a sealed copy")]
    fn a_seal_waiting_on_an_unsealed_copy_stops_on_its_invariant() {
        let mut m = machine(Durability::Sync, 0);
        m.step(0, Input::Submit { sub: single(1, None), reply: 1 });
        m.seal_waiting = true;
        m.step(1, Input::EscrowTick);
    }

    fn buffered(sum: i64, id: &str) -> Submission {
        Submission::Buffered { sum, increments: 3, members: Vec::new(), drain_id: Some(id.to_owned()) }
    }

    fn done(outcome: Outcome, value: i64) -> ShardReply {
        ShardReply::Done { outcome, value, after: value }
    }

    /// An answer within a commit that ends at `value`: the submission left the shard
    /// at `after`.
    fn done_at(outcome: Outcome, value: i64, after: i64) -> ShardReply {
        ShardReply::Done { outcome, value, after }
    }

    fn record(delta: i64) -> DedupRecord {
        DedupRecord { delta, applied_at_ms: NOW }
    }

    #[test]
    fn submissions_queue_until_the_commit_is_due_and_form_one_batch() {
        let mut m = machine(Durability::Batched, 10);
        let first = m.step(NOW, Input::Submit { sub: single(1, None), reply: 1 });
        assert_eq!(first, vec![Effect::ScheduleCommit]);
        assert_eq!(m.step(NOW, Input::Submit { sub: single(2, None), reply: 2 }), vec![]);
        let effects = m.step(NOW, Input::CommitDue { writable: true });
        let write = ShardWrite {
            image: ShardImage { value: 13, sketch: None, frequency: None, windows: None, escrow: None },
            ..ShardWrite::default()
        };
        assert_eq!(
            effects,
            vec![Effect::Write { write, durable: vec![], sends: vec![], change_abs: 3, submissions: 2 }]
        );
        // Batched answers go out once applied; each names the value it produced.
        assert_eq!(
            m.step(NOW, Input::Applied { ok: true }),
            vec![
                Effect::Reply { to: 1, reply: done_at(Outcome::Applied, 13, 11) },
                Effect::Reply { to: 2, reply: done_at(Outcome::Applied, 13, 13) },
            ]
        );
        assert!(m.quiet());
    }

    #[test]
    fn ids_are_looked_up_once_and_sync_answers_wait_for_the_flush() {
        let mut m = machine(Durability::Sync, 0);
        m.step(NOW, Input::Submit { sub: single(5, Some("e1")), reply: 1 });
        m.step(NOW, Input::Submit { sub: single(5, Some("e1")), reply: 2 });
        m.step(NOW, Input::Submit { sub: single(7, Some("e2")), reply: 3 });
        m.step(NOW, Input::Submit { sub: buffered(4, "~drain:a"), reply: 4 });
        let effects = m.step(NOW, Input::CommitDue { writable: true });
        assert_eq!(
            effects,
            vec![Effect::LookUpPriors { ids: vec!["e1".into(), "e2".into(), "~drain:a".into()] }]
        );
        // e2 was applied before with the same delta.
        let prior = BTreeMap::from([("e2".to_owned(), record(7))]);
        let effects = m.step(NOW, Input::Priors(Some(prior)));
        let write = ShardWrite {
            image: ShardImage { value: 9, sketch: None, frequency: None, windows: None, escrow: None },
            dedup_put: vec![("e1".into(), record(5)), ("~drain:a".into(), record(4))],
            dedup_remove: vec![],
        };
        assert_eq!(
            effects,
            vec![Effect::Write {
                write,
                durable: vec![
                    (1, done_at(Outcome::Applied, 9, 5)),
                    (2, done_at(Outcome::Duplicate, 9, 5)),
                    (3, done_at(Outcome::Duplicate, 9, 5)),
                ],
                sends: vec![],
                change_abs: 9,
                submissions: 4,
            }]
        );
        assert_eq!(
            m.step(NOW, Input::Applied { ok: true }),
            vec![Effect::Reply { to: 4, reply: done(Outcome::Applied, 9) }]
        );
    }

    #[test]
    fn a_batch_that_writes_nothing_answers_at_once_or_after_a_flush() {
        let mut m = machine(Durability::Sync, 3);
        m.step(NOW, Input::Submit { sub: single(3, Some("e")), reply: 1 });
        m.step(NOW, Input::CommitDue { writable: true });
        let effects = m.step(NOW, Input::Priors(Some(BTreeMap::from([("e".to_owned(), record(3))]))));
        assert_eq!(effects, vec![Effect::ReplyAfterFlush(vec![(1, done(Outcome::Duplicate, 3))])]);
        let mut m = machine(Durability::Batched, 3);
        m.step(NOW, Input::Submit { sub: single(3, Some("e")), reply: 1 });
        m.step(NOW, Input::CommitDue { writable: true });
        let effects = m.step(NOW, Input::Priors(Some(BTreeMap::from([("e".to_owned(), record(4))]))));
        assert_eq!(
            effects,
            vec![Effect::Reply { to: 1, reply: done(Outcome::Conflict { recorded_delta: 4 }, 3) }]
        );
    }

    #[test]
    fn submissions_during_a_write_form_the_next_batch() {
        let mut m = machine(Durability::Batched, 0);
        m.step(NOW, Input::Submit { sub: single(1, None), reply: 1 });
        m.step(NOW, Input::CommitDue { writable: true });
        // While the write is in flight, nothing is scheduled; after it, the next batch.
        assert_eq!(m.step(NOW, Input::Submit { sub: single(2, None), reply: 2 }), vec![]);
        assert_eq!(m.step(NOW, Input::CommitDue { writable: true }), vec![], "one write in flight at most");
        assert_eq!(
            m.step(NOW, Input::Applied { ok: true }),
            vec![Effect::Reply { to: 1, reply: done(Outcome::Applied, 1) }, Effect::ScheduleCommit]
        );
        let write = ShardWrite {
            image: ShardImage { value: 3, sketch: None, frequency: None, windows: None, escrow: None },
            ..ShardWrite::default()
        };
        assert_eq!(
            m.step(NOW, Input::CommitDue { writable: true }),
            vec![Effect::Write { write, durable: vec![], sends: vec![], change_abs: 2, submissions: 1 }]
        );
    }

    #[test]
    fn a_failed_write_forgets_what_was_decided_or_stops_the_copy() {
        let mut m = machine(Durability::Batched, 10);
        m.step(NOW, Input::Submit { sub: single(5, None), reply: 1 });
        m.step(NOW, Input::CommitDue { writable: true });
        assert_eq!(m.value(), 15);
        assert_eq!(m.step(NOW, Input::Applied { ok: false }), vec![Effect::Reload], "its answer is dropped");
        m.step(NOW, Input::Submit { sub: single(1, None), reply: 2 });
        let effects = m.step(
            NOW,
            Input::Reloaded(Some((
                ShardImage { value: 10, sketch: None, frequency: None, windows: None, escrow: None },
                None,
            ))),
        );
        assert_eq!(effects, vec![Effect::ScheduleCommit]);
        assert_eq!(m.value(), 10);
        m.step(NOW, Input::CommitDue { writable: true });
        assert_eq!(m.step(NOW, Input::Applied { ok: false }), vec![Effect::Reload]);
        assert_eq!(m.step(NOW, Input::Reloaded(None)), vec![Effect::Stop]);
        assert!(m.broken());
        assert_eq!(
            m.step(NOW, Input::Submit { sub: single(1, None), reply: 3 }),
            vec![],
            "a broken copy answers nothing"
        );
    }

    #[test]
    fn a_store_that_takes_no_writes_drops_the_batch_unanswered() {
        let mut m = machine(Durability::Sync, 0);
        m.step(NOW, Input::Submit { sub: single(1, Some("e")), reply: 1 });
        assert_eq!(m.step(NOW, Input::CommitDue { writable: false }), vec![]);
        assert!(m.quiet());
        m.step(NOW, Input::Submit { sub: single(1, Some("e")), reply: 2 });
        m.step(NOW, Input::CommitDue { writable: true });
        assert_eq!(m.step(NOW, Input::Priors(None)), vec![], "records that cannot be read decide nothing");
        assert_eq!(m.value(), 0);
    }

    #[test]
    fn a_seal_commits_what_was_queued_then_refuses_and_answers_the_final_image() {
        let mut m = machine(Durability::Batched, 4);
        assert_eq!(
            m.step(NOW, Input::Submit { sub: single(1, None), reply: 1 }),
            vec![Effect::ScheduleCommit]
        );
        // The commit is scheduled already: the seal waits for it.
        assert_eq!(m.step(NOW, Input::Seal), vec![]);
        assert_eq!(
            m.step(NOW, Input::Submit { sub: single(1, None), reply: 2 }),
            vec![Effect::Reply { to: 2, reply: ShardReply::Sealed }]
        );
        m.step(NOW, Input::CommitDue { writable: true });
        assert_eq!(
            m.step(NOW, Input::Applied { ok: true }),
            vec![
                Effect::Reply { to: 1, reply: done(Outcome::Applied, 5) },
                Effect::Sealed(ShardImage {
                    value: 5,
                    sketch: None,
                    frequency: None,
                    windows: None,
                    escrow: None
                }),
            ]
        );
        assert!(m.sealed() && m.quiet());
        // A shard sealed by its metadata refuses from the start.
        let mut m: ShardMachine<u32> =
            ShardMachine::new(params(Durability::Sync), ShardImage::default(), None, true);
        assert_eq!(
            m.step(NOW, Input::Submit { sub: single(1, None), reply: 9 }),
            vec![Effect::Reply { to: 9, reply: ShardReply::Sealed }]
        );
        assert_eq!(m.step(NOW, Input::Seal), vec![Effect::Sealed(ShardImage::default())]);
    }

    #[test]
    fn a_merge_writes_the_union_once_and_a_repeat_writes_nothing() {
        let p = ShardParams { distinct: true, ..params(Durability::Sync) };
        let mut m: ShardMachine<u32> = ShardMachine::new(
            p,
            ShardImage { value: 7, sketch: None, frequency: None, windows: None, escrow: None },
            None,
            false,
        );
        let mut incoming = DistinctSketch::new();
        incoming.insert_hash(crate::sketch::member_hash("x"));
        let effects = m.step(
            NOW,
            Input::MergeSketch { distinct: Some(incoming.clone()), frequency: None, windows: None },
        );
        let image = ShardImage {
            value: 7,
            sketch: Some(incoming.to_bytes()),
            frequency: None,
            windows: None,
            escrow: None,
        };
        assert_eq!(
            effects,
            vec![Effect::Write {
                write: ShardWrite { image, ..ShardWrite::default() },
                durable: vec![],
                sends: vec![],
                change_abs: 0,
                submissions: 0
            }]
        );
        assert_eq!(m.step(NOW, Input::Applied { ok: true }), vec![Effect::Merged]);
        assert_eq!(
            m.step(NOW, Input::MergeSketch { distinct: Some(incoming), frequency: None, windows: None }),
            vec![Effect::Merged],
            "merging twice changes nothing"
        );
    }

    #[test]
    fn a_sweep_removes_expired_records_with_the_current_image() {
        let mut m = machine(Durability::Batched, 2);
        let effects = m.step(NOW, Input::Sweep { expired: vec!["old".into()] });
        let write = ShardWrite {
            image: ShardImage { value: 2, sketch: None, frequency: None, windows: None, escrow: None },
            dedup_put: vec![],
            dedup_remove: vec!["old".into()],
        };
        assert_eq!(
            effects,
            vec![Effect::Write { write, durable: vec![], sends: vec![], change_abs: 0, submissions: 0 }]
        );
        assert_eq!(m.step(NOW, Input::Applied { ok: true }), vec![]);
        assert!(m.quiet());
    }

    #[test]
    fn a_sweep_during_a_commit_is_the_next_write_before_the_next_batch() {
        let mut m = machine(Durability::Batched, 0);
        assert!(m.sweepable());
        m.step(NOW, Input::Submit { sub: single(1, None), reply: 1 });
        m.step(NOW, Input::CommitDue { writable: true });
        // A write is in flight and the next batch is already queued.
        assert_eq!(m.step(NOW, Input::Sweep { expired: vec!["old".into()] }), vec![]);
        assert!(!m.sweepable(), "the page waits: the shell reads no other");
        m.step(NOW, Input::Submit { sub: single(1, None), reply: 2 });
        let effects = m.step(NOW, Input::Applied { ok: true });
        let write = ShardWrite {
            image: ShardImage { value: 1, sketch: None, frequency: None, windows: None, escrow: None },
            dedup_put: vec![],
            dedup_remove: vec!["old".into()],
        };
        let sweep = Effect::Write { write, durable: vec![], sends: vec![], change_abs: 0, submissions: 0 };
        assert_eq!(effects.last(), Some(&sweep), "{effects:?}");
        assert!(m.sweepable());
        // The commit that came due meanwhile waits for the sweep, then goes.
        assert_eq!(m.step(NOW, Input::CommitDue { writable: true }), vec![]);
        assert_eq!(m.step(NOW, Input::Applied { ok: true }), vec![Effect::ScheduleCommit]);
        let effects = m.step(NOW, Input::CommitDue { writable: true });
        assert!(matches!(effects.as_slice(), [Effect::Write { submissions: 1, .. }]), "{effects:?}");
    }

    #[test]
    fn the_shell_can_see_what_the_machine_waits_for() {
        let mut m = machine(Durability::Batched, 0);
        assert!(m.quiet() && !m.sealed() && !m.broken());
        m.step(NOW, Input::Submit { sub: single(1, None), reply: 1 });
        assert!(!m.quiet(), "a submission is queued");
        m.step(NOW, Input::CommitDue { writable: true });
        assert!(!m.quiet(), "a write is in flight");
        m.step(NOW, Input::Applied { ok: true });
        assert!(m.quiet());
        m.step(NOW, Input::Submit { sub: single(1, Some("e")), reply: 2 });
        m.step(NOW, Input::CommitDue { writable: true });
        assert!(!m.quiet(), "records are being looked up");
        m.step(NOW, Input::Priors(Some(BTreeMap::new())));
        m.step(NOW, Input::Applied { ok: true });
        assert!(m.quiet() && !m.broken());
    }

    #[test]
    fn a_failed_merge_or_sweep_is_forgotten_too() {
        let p = ShardParams { distinct: true, ..params(Durability::Batched) };
        let mut m: ShardMachine<u32> = ShardMachine::new(
            p,
            ShardImage { value: 1, sketch: None, frequency: None, windows: None, escrow: None },
            None,
            false,
        );
        let mut incoming = DistinctSketch::new();
        incoming.insert_hash(crate::sketch::member_hash("x"));
        m.step(NOW, Input::MergeSketch { distinct: Some(incoming), frequency: None, windows: None });
        assert_eq!(m.step(NOW, Input::Applied { ok: false }), vec![Effect::Reload]);
        m.step(
            NOW,
            Input::Reloaded(Some((
                ShardImage { value: 1, sketch: None, frequency: None, windows: None, escrow: None },
                None,
            ))),
        );
        m.step(NOW, Input::Sweep { expired: vec!["old".into()] });
        assert_eq!(m.step(NOW, Input::Applied { ok: false }), vec![Effect::Reload]);
        // Nothing to remove: no write at all.
        m.step(
            NOW,
            Input::Reloaded(Some((
                ShardImage { value: 1, sketch: None, frequency: None, windows: None, escrow: None },
                None,
            ))),
        );
        assert_eq!(m.step(NOW, Input::Sweep { expired: vec![] }), vec![]);
        assert!(m.quiet());
    }

    #[test]
    fn metadata_changes_seal_for_good_and_keep_the_sketch() {
        let p = ShardParams { distinct: true, ..params(Durability::Batched) };
        let mut x = DistinctSketch::new();
        x.insert_hash(crate::sketch::member_hash("x"));
        let image =
            ShardImage { value: 0, sketch: Some(x.to_bytes()), frequency: None, windows: None, escrow: None };
        let mut m: ShardMachine<u32> = ShardMachine::new(p, image, Some(x.clone()), false);
        m.step(NOW, Input::MetaChanged { params: p, sealed: false });
        assert!(!m.sealed());
        // The sketch it had survives a metadata change; a new member joins it.
        let sub = Submission::Single {
            delta: 1,
            event_id: None,
            member: Some(crate::sketch::member_hash("y")),
            item: None,
            seq: None,
        };
        m.step(NOW, Input::Submit { sub, reply: 1 });
        let effects = m.step(NOW, Input::CommitDue { writable: true });
        let Some(Effect::Write { write, .. }) = effects.first() else { panic!("{effects:?}") };
        let written = DistinctSketch::from_bytes(write.image.sketch.as_deref().unwrap()).unwrap();
        assert_eq!(written.estimate(), 2);
        m.step(NOW, Input::Applied { ok: true });
        m.step(NOW, Input::MetaChanged { params: p, sealed: true });
        assert!(m.sealed());
        m.step(NOW, Input::MetaChanged { params: p, sealed: false });
        assert!(m.sealed(), "a seal is never lifted");
    }

    const FREQ: crate::frequency::FrequencySpec =
        crate::frequency::FrequencySpec { epsilon: 0.01, delta: 0.01 };

    fn weighted(delta: i64, item: &str) -> Submission {
        Submission::Single { delta, event_id: None, member: None, item: Some(item.into()), seq: None }
    }

    /// The frequency sketch a write carries.
    fn written_frequency(effects: &[Effect<u32>]) -> FrequencySketch {
        let Some(Effect::Write { write, .. }) = effects.first() else { panic!("{effects:?}") };
        write.image.decode_frequency().unwrap().expect("a frequency sketch in the image")
    }

    #[test]
    fn items_are_weighted_into_the_written_image_and_survive_a_reload() {
        let p = ShardParams { frequency: Some(FREQ), ..params(Durability::Batched) };
        let mut m: ShardMachine<u32> = ShardMachine::new(p, ShardImage::default(), None, false);
        m.step(NOW, Input::Submit { sub: weighted(3, "a"), reply: 1 });
        m.step(NOW, Input::Submit { sub: weighted(2, "b"), reply: 2 });
        // No item: counted in the value, not in the sketch.
        m.step(NOW, Input::Submit { sub: single(5, None), reply: 3 });
        let effects = m.step(NOW, Input::CommitDue { writable: true });
        let f = written_frequency(&effects);
        assert_eq!((f.total(), f.estimate("a", &FREQ).estimate, f.estimate("b", &FREQ).estimate), (5, 3, 2));
        m.step(NOW, Input::Applied { ok: true });
        let image = m.image();
        assert_eq!(image.value, 10);
        // A copy started from the stored image counts on from it.
        let mut again: ShardMachine<u32> = ShardMachine::new(p, image, None, false);
        again.step(NOW, Input::Submit { sub: weighted(1, "a"), reply: 4 });
        let f = written_frequency(&again.step(NOW, Input::CommitDue { writable: true }));
        assert_eq!(f.estimate("a", &FREQ).estimate, 4);
    }

    #[test]
    fn a_carried_frequency_sketch_merges_once() {
        let p = ShardParams { frequency: Some(FREQ), ..params(Durability::Batched) };
        let mut m: ShardMachine<u32> = ShardMachine::new(p, ShardImage::default(), None, false);
        let mut sealed = FrequencySketch::new(&FREQ).unwrap();
        sealed.add("x", 7);
        let effects = m
            .step(NOW, Input::MergeSketch { distinct: None, frequency: Some(sealed.clone()), windows: None });
        assert_eq!(written_frequency(&effects).estimate("x", &FREQ).estimate, 7);
        assert_eq!(m.step(NOW, Input::Applied { ok: true }), vec![Effect::Merged]);
        // The resharding repeats its step (a crash, a lost answer): nothing changes.
        assert_eq!(
            m.step(NOW, Input::MergeSketch { distinct: None, frequency: Some(sealed), windows: None }),
            vec![Effect::Merged]
        );
        let stored = m.image().decode_frequency().unwrap().unwrap();
        assert_eq!(stored.estimate("x", &FREQ).estimate, 7);
    }

    #[test]
    fn frequencies_turned_on_later_start_counting() {
        let mut m: ShardMachine<u32> =
            ShardMachine::new(params(Durability::Batched), ShardImage::default(), None, false);
        m.step(NOW, Input::Submit { sub: weighted(1, "a"), reply: 1 });
        let effects = m.step(NOW, Input::CommitDue { writable: true });
        let Some(Effect::Write { write, .. }) = effects.first() else { panic!("{effects:?}") };
        assert_eq!(write.image.frequency, None, "no sketch while frequencies are off");
        m.step(NOW, Input::Applied { ok: true });
        let p = ShardParams { frequency: Some(FREQ), ..params(Durability::Batched) };
        m.step(NOW, Input::MetaChanged { params: p, sealed: false });
        m.step(NOW, Input::Submit { sub: weighted(2, "a"), reply: 2 });
        let f = written_frequency(&m.step(NOW, Input::CommitDue { writable: true }));
        assert_eq!(f.total(), 2);
    }
}

#[cfg(test)]
mod window_tests {
    use super::*;
    use crate::shard::Outcome;
    use crate::window::{Window, WindowSet};

    const MIN: u64 = 60_000;

    fn params() -> ShardParams {
        ShardParams {
            durability: Durability::Batched,
            dedup_window_ms: MIN,
            distinct: true,
            frequency: None,
            windows: WindowSet::parse(&["1m", "1h"]).unwrap(),
            bounds: Bounds::default(),
            limit: None,
            shard: 0,
            shards: 1,
            escrow: Tuning::default(),
        }
    }

    fn single(delta: i64, member: &str) -> Submission {
        Submission::Single {
            delta,
            event_id: None,
            member: Some(crate::sketch::member_hash(member)),
            item: None,
            seq: None,
        }
    }

    fn commit(m: &mut ShardMachine<u32>, now: u64, subs: &[Submission]) {
        for (i, sub) in subs.iter().enumerate() {
            m.step(now, Input::Submit { sub: sub.clone(), reply: i as u32 });
        }
        let effects = m.step(now, Input::CommitDue { writable: true });
        assert!(matches!(effects.first(), Some(Effect::Write { .. })), "{effects:?}");
        let answers = m.step(now, Input::Applied { ok: true });
        assert!(answers.iter().all(|e| matches!(
            e,
            Effect::Reply { reply: ShardReply::Done { outcome: Outcome::Applied, .. }, .. }
        )));
    }

    #[test]
    fn applied_increments_land_in_the_bucket_of_the_step_time_and_are_stored() {
        let one_min = Window::parse("1m").unwrap();
        let mut m: ShardMachine<u32> = ShardMachine::new(params(), ShardImage::default(), None, false);
        commit(&mut m, 10 * MIN, &[single(2, "a"), single(3, "b")]);
        commit(&mut m, 10 * MIN + 30_000, &[single(5, "a")]);
        commit(&mut m, 11 * MIN + 10_000, &[single(7, "c")]);
        let r = m.windows().unwrap().read(one_min, 11 * MIN + 10_000).unwrap();
        // The one-minute window at 11:10 starts at 10:11: the 10:00 increments left it.
        assert_eq!((r.total, r.span.start_ms), (12, 10 * MIN + 11_000));
        assert_eq!(r.sketch.unwrap().estimate(), 2);
        assert_eq!(m.value(), 17, "the shard's total counts everything");
        // A copy started from the stored image has the same buckets.
        let again: ShardMachine<u32> = ShardMachine::new(params(), m.image(), None, false);
        assert_eq!(again.windows(), m.windows());
        // Windows turned off: the image carries none.
        let mut off = again;
        off.step(
            11 * MIN,
            Input::MetaChanged {
                params: ShardParams { windows: WindowSet::NONE, ..params() },
                sealed: false,
            },
        );
        assert_eq!((off.windows(), off.image().windows), (None, None));
    }

    #[test]
    fn a_carried_window_state_merges_once() {
        let hour = Window::parse("1h").unwrap();
        let mut sealed: ShardMachine<u32> = ShardMachine::new(params(), ShardImage::default(), None, false);
        commit(&mut sealed, 5 * MIN, &[single(4, "x")]);
        let carried = sealed.windows().unwrap().clone();
        let mut next: ShardMachine<u32> = ShardMachine::new(params(), ShardImage::default(), None, false);
        let effects = next.step(
            6 * MIN,
            Input::MergeSketch { distinct: None, frequency: None, windows: Some(carried.clone()) },
        );
        assert!(matches!(effects.as_slice(), [Effect::Write { .. }]), "{effects:?}");
        assert_eq!(next.step(6 * MIN, Input::Applied { ok: true }), vec![Effect::Merged]);
        assert_eq!(
            next.step(
                6 * MIN,
                Input::MergeSketch { distinct: None, frequency: None, windows: Some(carried) }
            ),
            vec![Effect::Merged],
            "a repeated carry changes nothing"
        );
        assert_eq!(next.windows().unwrap().read(hour, 6 * MIN).unwrap().total, 4);
        let stored = next.image().decode_windows().unwrap().unwrap();
        assert_eq!(stored.read(hour, 6 * MIN).unwrap().total, 4);
    }
}

#[cfg(test)]
mod escrow_tests {
    use super::*;
    use crate::escrow::{Message, Side};
    use crate::shard::Outcome;

    const NOW: u64 = 1_000;

    /// Shard `shard` of 3 of a `sync` counter with `min = 0`, holding `value` and a
    /// share of `share`.
    fn bounded(shard: u16, value: i64, share: u64) -> ShardMachine<u32> {
        let params = ShardParams {
            durability: Durability::Sync,
            dedup_window_ms: 60_000,
            distinct: false,
            frequency: None,
            windows: crate::window::WindowSet::NONE,
            bounds: Bounds { min: Some(0), max: None },
            limit: None,
            shard,
            shards: 3,
            escrow: Tuning::default(),
        };
        let ledger = Durable::with_shares([share, 0]);
        let image = ShardImage { value, escrow: Some(ledger.to_bytes()), ..ShardImage::default() };
        ShardMachine::new(params, image, None, false)
    }

    fn single(delta: i64) -> Submission {
        Submission::Single { delta, event_id: None, member: None, item: None, seq: None }
    }

    /// Submits and commits; returns the effects of the commit.
    fn commit(m: &mut ShardMachine<u32>, now: u64, subs: &[(i64, u32)]) -> Vec<Effect<u32>> {
        for (delta, reply) in subs {
            m.step(now, Input::Submit { sub: single(*delta), reply: *reply });
        }
        m.step(now, Input::CommitDue { writable: true })
    }

    fn escrow_of(write: &ShardWrite) -> Durable {
        Durable::from_bytes(write.image.escrow.as_deref().expect("a bounded shard writes its ledger"))
            .unwrap()
    }

    #[test]
    fn a_covered_decrement_spends_the_share_in_the_same_write() {
        let mut m = bounded(0, 10, 4);
        let e = commit(&mut m, NOW, &[(-3, 1), (5, 2)]);
        let [Effect::Write { write, durable, sends, .. }] = e.as_slice() else { panic!("{e:?}") };
        assert_eq!(write.image.value, 12);
        assert_eq!(escrow_of(write).shares, [6, 0], "4 − 3 spent, then 5 earned");
        assert_eq!(durable.len(), 2);
        assert!(sends.is_empty());
    }

    #[test]
    fn a_short_decrement_waits_asks_the_others_and_is_refused_after_the_wait() {
        let mut m = bounded(0, 10, 2);
        let e = commit(&mut m, NOW, &[(-5, 1)]);
        let borrow = Message::Borrow { from: 0, side: Side::Down, amount: 3 };
        assert_eq!(e, vec![Effect::Escrow { sends: vec![(1, borrow), (2, borrow)], after_flush: false }]);
        assert!(!m.escrow_settled() && !m.quiet());
        assert_eq!(m.value(), 10, "nothing counted");
        let wait = Tuning::default().borrow_wait_ms;
        let e = m.step(NOW + wait, Input::EscrowTick);
        let refused =
            ShardReply::Done { outcome: Outcome::BoundExceeded { headroom: 2 }, value: 10, after: 10 };
        assert_eq!(e, vec![Effect::Reply { to: 1, reply: refused }]);
        assert!(m.escrow_settled() && m.quiet());
    }

    #[test]
    fn a_stopping_shard_is_drained_while_a_change_waits_for_headroom() {
        // Parked for a borrow that may need a shard stopping too: a shell that
        // committed until `quiet` would loop for ever; `drained` holds at once.
        let mut m = bounded(0, 10, 2);
        commit(&mut m, NOW, &[(-5, 1)]);
        assert!(!m.quiet() && m.drained());
        assert_eq!(m.step(NOW, Input::CommitDue { writable: true }), vec![], "nothing to commit");
        // A ledger change not yet written is: the next commit writes it.
        let mut donor = bounded(1, 0, 10);
        donor.step(NOW, Input::Escrow(Message::Borrow { from: 0, side: Side::Down, amount: 4 }));
        assert!(!donor.drained(), "its grant's write is in flight");
        donor.step(NOW, Input::Applied { ok: true });
        assert!(donor.drained() && !donor.quiet(), "the grant waits for its ack, not for a commit");
    }

    #[test]
    fn a_grant_admits_the_waiting_decrement_and_its_ack_waits_for_the_write() {
        let mut m = bounded(0, 10, 2);
        commit(&mut m, NOW, &[(-5, 1)]);
        let grant = Message::Grant { from: 2, seq: 0, side: Side::Down, amount: 3, acked_below: 0 };
        let e = m.step(NOW + 5, Input::Escrow(grant));
        assert_eq!(e, vec![Effect::ScheduleCommit], "the decrement is decided again; the ack waits");
        let e = m.step(NOW + 5, Input::CommitDue { writable: true });
        let [Effect::Write { write, durable, sends, .. }] = e.as_slice() else { panic!("{e:?}") };
        assert_eq!(write.image.value, 5);
        assert_eq!(escrow_of(write).shares, [0, 0]);
        assert_eq!(durable.len(), 1);
        assert_eq!(sends, &vec![(2, Message::Ack { from: 0, seq: 0 })], "sent after this write's flush");
    }

    #[test]
    fn a_donor_writes_its_debit_before_the_grant_goes_out() {
        let mut donor = bounded(1, 0, 10);
        let e = donor.step(NOW, Input::Escrow(Message::Borrow { from: 0, side: Side::Down, amount: 4 }));
        let [Effect::Write { write, sends, .. }] = e.as_slice() else { panic!("{e:?}") };
        assert_eq!(escrow_of(write).shares, [6, 0]);
        assert!(matches!(sends.as_slice(), [(0, Message::Grant { amount: 4, .. })]), "{sends:?}");
        // A borrow arriving while that write is in flight is granted from the ledger
        // in memory; its grant waits for the next write, which carries it.
        let e = donor.step(NOW, Input::Escrow(Message::Borrow { from: 2, side: Side::Down, amount: 2 }));
        assert_eq!(e, vec![]);
        let e = donor.step(NOW, Input::Applied { ok: true });
        let [Effect::Write { write, sends, .. }] = e.as_slice() else { panic!("{e:?}") };
        assert_eq!(escrow_of(write).shares, [4, 0]);
        assert!(matches!(sends.as_slice(), [(2, Message::Grant { amount: 2, .. })]), "{sends:?}");
    }

    #[test]
    fn a_failed_write_forgets_the_ledger_it_carried_and_its_messages() {
        let mut donor = bounded(1, 0, 10);
        donor.step(NOW, Input::Escrow(Message::Borrow { from: 0, side: Side::Down, amount: 4 }));
        assert_eq!(donor.step(NOW, Input::Applied { ok: false }), vec![Effect::Reload]);
        let stored = bounded(1, 0, 10).image();
        let e = donor.step(NOW, Input::Reloaded(Some((stored, None))));
        assert_eq!(e, vec![]);
        assert_eq!(donor.escrow().unwrap().share(Side::Down), 10, "the debit was never durable");
        assert!(donor.escrow_settled());
    }

    #[test]
    fn a_lone_shard_refuses_at_once() {
        let mut m = bounded(0, 1, 1);
        m.params.shards = 1;
        m.escrow = ledger_of(&m.params, Some(&Durable::with_shares([1, 0]).to_bytes()));
        let e = commit(&mut m, NOW, &[(-2, 7)]);
        let refused =
            ShardReply::Done { outcome: Outcome::BoundExceeded { headroom: 1 }, value: 1, after: 1 };
        assert_eq!(e, vec![Effect::Reply { to: 7, reply: refused }]);
    }

    #[test]
    fn a_shard_that_never_wrote_starts_from_its_part_of_the_headroom() {
        let params = ShardParams {
            bounds: Bounds { min: None, max: Some(10) },
            shard: 2,
            shards: 4,
            ..bounded(0, 0, 0).params
        };
        let m: ShardMachine<u32> = ShardMachine::new(params, ShardImage::default(), None, false);
        assert_eq!(m.escrow().unwrap().share(Side::Up), 2);
        assert!(m.image().escrow.is_some());
    }

    /// Shard `shard` of 3 of a counter limited to 15 per minute (one-second buckets),
    /// holding a share of `share` of the limit and nothing counted.
    fn limited(shard: u16, share: u64) -> ShardMachine<u32> {
        let windows = crate::window::WindowSet::parse(&["1m"]).unwrap();
        let params = ShardParams {
            durability: Durability::Sync,
            dedup_window_ms: 60_000,
            distinct: false,
            frequency: None,
            windows,
            bounds: Bounds { min: None, max: Some(15) },
            limit: Some(windows.windows()[0]),
            shard,
            shards: 3,
            escrow: Tuning::default(),
        };
        let image =
            ShardImage { escrow: Some(Durable::with_shares([0, share]).to_bytes()), ..ShardImage::default() };
        ShardMachine::new(params, image, None, false)
    }

    /// What a write's window buckets hold for the minute window.
    fn held_of(write: &ShardWrite) -> i128 {
        let bytes = write.image.windows.as_deref().expect("a limited shard writes its buckets");
        let state = WindowState::from_bytes(bytes).unwrap();
        state.held(crate::window::Window::parse("1m").unwrap())
    }

    fn write_of(e: &[Effect<u32>]) -> &ShardWrite {
        e.iter()
            .find_map(|e| match e {
                Effect::Write { write, .. } => Some(write),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no write in {e:?}"))
    }

    #[test]
    fn a_window_limit_spends_the_share_and_gets_it_back_as_buckets_expire() {
        let mut m = limited(0, 5);
        let e = commit(&mut m, 1_000, &[(5, 1)]);
        let w = write_of(&e);
        assert_eq!((escrow_of(w).shares, held_of(w)), ([0, 0], 5), "spent: share + kept buckets = 5");
        m.step(1_000, Input::Applied { ok: true });
        // Still in the window: the next one waits and asks the others.
        let e = commit(&mut m, 60_900, &[(1, 2)]);
        let borrow = Message::Borrow { from: 0, side: Side::Up, amount: 1 };
        assert_eq!(e, vec![Effect::Escrow { sends: vec![(1, borrow), (2, borrow)], after_flush: false }]);
        // The second bucket 1 leaves the window, its 5 are headroom again: the
        // waiting increment is decided, and both shares and buckets are written.
        let e = m.step(61_000, Input::EscrowTick);
        assert!(e.contains(&Effect::ScheduleCommit), "{e:?}");
        let e = m.step(61_000, Input::CommitDue { writable: true });
        let w = write_of(&e);
        assert_eq!((w.image.value, escrow_of(w).shares, held_of(w)), (6, [0, 4], 1));
    }

    #[test]
    fn a_window_limit_refuses_what_is_not_an_addition_at_once() {
        let mut m = limited(0, 5);
        let e = commit(&mut m, 1_000, &[(-2, 1)]);
        let refused =
            ShardReply::Done { outcome: Outcome::BoundExceeded { headroom: 5 }, value: 0, after: 0 };
        assert_eq!(e, vec![Effect::Reply { to: 1, reply: refused }]);
        assert!(m.escrow_settled(), "nothing waits");
    }

    #[test]
    fn an_increment_stamped_behind_every_kept_bucket_gives_its_headroom_back_at_once() {
        let mut m = limited(0, 5);
        commit(&mut m, 200_000, &[(2, 1)]);
        m.step(200_000, Input::Applied { ok: true });
        // The clock went back more than a window: counted, in no bucket.
        let e = commit(&mut m, 100_000, &[(3, 2)]);
        let w = write_of(&e);
        assert_eq!((w.image.value, escrow_of(w).shares, held_of(w)), (5, [0, 3], 2));
    }

    #[test]
    fn a_donor_grants_from_what_its_expired_buckets_gave_back() {
        let mut m = limited(1, 4);
        commit(&mut m, 1_000, &[(4, 1)]);
        m.step(1_000, Input::Applied { ok: true });
        let e = m.step(70_000, Input::Escrow(Message::Borrow { from: 0, side: Side::Up, amount: 2 }));
        let w = write_of(&e);
        assert_eq!((escrow_of(w).shares[1], held_of(w)), (2, 0), "4 came back, 2 went out");
    }
}
