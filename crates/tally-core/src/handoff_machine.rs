//! Moving shards after a membership change, as state machines: the new owner's
//! *adoption* of one shard, the previous owner's *answer* to one pull, and the
//! previous owner's *hand-off pass* over every shard it holds but no longer owns.
//!
//! A membership change gives some shards a new owner. Nothing moves by itself: the
//! new owner adopts a shard before it serves it for the first time, by pulling the
//! previous owner's copy page by page (image, seal, dedup records), and the previous
//! owner hands off every shard it holds but no longer owns (its data, or only the
//! seal marker of a shard sealed before its first write), by asking each new owner to
//! adopt it and deleting its own copy once the new owner has it durably.
//!
//! Why nothing is lost or counted twice:
//!
//! * The previous owner answers a pull only after it has applied the change (so it
//!   refuses the shard's requests from then on), has stopped the shard's writer (which
//!   commits what it took) and has made its state durable: only what a crash cannot
//!   take back leaves it ([`PullAnswer`]).
//! * The new owner deletes what an interrupted import left, imports every page (with
//!   the seal, if a resharding sealed the shard), makes it durable, and only then
//!   writes the adoption marker and makes that durable. A crash before the marker
//!   repeats the same import; after it, the shard is never imported again
//!   ([`Adoption`]).
//! * The previous owner deletes its copy only after the new owner confirmed the
//!   adoption, and reports what is left ([`HandOffPass`]); the metadata refuses the
//!   next membership change until every previous member reported nothing left, so
//!   each shard has exactly one previous owner to pull from.
//! * An adoption re-checks, once it holds the shard's adoption slot, that the change
//!   is still in progress: if it completed meanwhile, the previous owner held nothing
//!   of the shard (it would have waited for the adoption), and importing now would
//!   write under a writer that already serves the shard ([`admit`]).
//!
//! No clock, no I/O: the engine's hand-off code (`tally-engine/src/handoff.rs`) and
//! the simulator's nodes carry out the effects. The records a page carries are
//! opaque `(key, DedupRecord)` pairs in key order; the machines never look inside.

use crate::dedup::DedupRecord;
use crate::shard::{ShardImage, ShardWrite};
use crate::ShardId;
use std::collections::{BTreeMap, BTreeSet};

/// Most dedup records one hand-off page carries; larger shards take several pages.
pub const HANDOFF_RECORDS_MAX: usize = 4_096;

/// Most shard ids one step of a [`HandOffPass`] reads from the store at a time.
pub const HANDOFF_SCAN_PAGE: usize = 1_024;

/// Whether a planted bug is switched on (never without the `planted-bugs` feature).
fn planted(bug: PlantedBug) -> bool {
    #[cfg(feature = "planted-bugs")]
    {
        use crate::planted::{active, Bug};
        match bug {
            PlantedBug::DeletesEarly => active(Bug::HandoffDeletesEarly),
            PlantedBug::ForgetsSeal => active(Bug::HandoffForgetsSeal),
        }
    }
    #[cfg(not(feature = "planted-bugs"))]
    {
        let _ = bug;
        false
    }
}

#[derive(Clone, Copy)]
enum PlantedBug {
    DeletesEarly,
    ForgetsSeal,
}

/// The prefix of every seal marker's key.
pub const SEAL_MARKER_PREFIX: &[u8] = b"sealed:";

/// The store key of shard `id`'s seal marker.
pub fn seal_marker(id: &ShardId) -> Vec<u8> {
    let mut key = SEAL_MARKER_PREFIX.to_vec();
    key.extend_from_slice(id.to_string().as_bytes());
    key
}

/// The shard whose seal marker `key` is ([`seal_marker`]'s inverse); `None` for
/// any other key.
pub fn shard_of_seal_marker(key: &[u8]) -> Option<ShardId> {
    let text = std::str::from_utf8(key.strip_prefix(SEAL_MARKER_PREFIX)?).ok()?;
    let (name, rest) = text.rsplit_once("#g")?;
    let (generation, rest) = rest.split_once('/')?;
    let (index, replicas) = match rest.split_once("@r") {
        Some((index, replicas)) => (index, replicas.parse().ok()?),
        None => (rest, crate::ids::CLUSTER_REPLICAS),
    };
    let name = crate::name::CounterName::new(name).ok()?;
    Some(ShardId::new(name, generation.parse().ok()?, index.parse().ok()?).in_class(replicas))
}

/// The store key that records the adoption of shard `id` at placement `epoch`.
pub fn adoption_marker(epoch: u64, id: &ShardId) -> Vec<u8> {
    let mut key = b"adopted:".to_vec();
    key.extend_from_slice(&epoch.to_be_bytes());
    key.extend_from_slice(id.to_string().as_bytes());
    key
}

/// One page of a shard handed off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandOffPage {
    /// The shard's state.
    pub image: ShardImage,
    /// A page of its dedup records, in key order.
    pub records: Vec<(String, DedupRecord)>,
    /// Whether more records follow (pull again after the last one).
    pub more: bool,
    /// Whether the shard is sealed: its new owner must keep it sealed.
    pub sealed: bool,
}

/// What one hand-off pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HandoffReport {
    /// Shards adopted by their new owners and deleted here.
    pub moved: u64,
    /// Shards whose new owner did not confirm; a later pass retries them.
    pub failed: u64,
}

// ------------------------------------------------------------------ admission

/// What a request for a shard this node owns must do before it is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission<N> {
    /// Serve it.
    Serve,
    /// The change completed while an adoption of the shard was in flight: wait for
    /// that import to land (it is not redone), then serve.
    AwaitInFlight,
    /// Adopt it from its previous owner first.
    Adopt {
        /// The previous owner.
        from: N,
        /// The placement epoch of the change.
        epoch: u64,
    },
}

/// Whether a shard this node owns must be adopted before it serves it: `previous`
/// is its previous owner while the change that moved it is being handed off,
/// `adopted` whether this node adopted it at that epoch, `in_flight` whether an
/// adoption of it is running.
pub fn admit<N>(previous: Option<(N, u64)>, adopted: bool, in_flight: bool) -> Admission<N> {
    match previous {
        None if in_flight => Admission::AwaitInFlight,
        None => Admission::Serve,
        Some(_) if adopted => Admission::Serve,
        Some((from, epoch)) => Admission::Adopt { from, epoch },
    }
}

// ------------------------------------------------------------------- adoption

/// What happened to an adoption.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdoptInput {
    /// The shell holds the shard's adoption slot (no other adoption of it runs) and
    /// looked again: whether the shard is adopted at this epoch by now, and whether
    /// the change is still being handed off (the shard still has this previous owner).
    Begun {
        /// Adopted at this epoch meanwhile.
        adopted: bool,
        /// The change is still in progress.
        still_previous: bool,
    },
    /// Whether the adoption marker is in the store.
    Marker {
        /// It is.
        present: bool,
    },
    /// The previous owner answered the pull of the records after `after`.
    Page {
        /// The `after` of the pull it answers.
        after: Option<String>,
        /// The page.
        page: HandOffPage,
        /// Whether this node still owns the shard, looked at as the page arrived.
        owns: bool,
    },
    /// An answer is overdue: pull again.
    Resend,
}

/// One thing an adoption does. The shell carries them out in order; if one fails,
/// the adoption is abandoned and a later one starts again from the beginning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdoptEffect<N> {
    /// Nothing to adopt (adopted already, or the change completed meanwhile): serve.
    Skip,
    /// Read this key (the adoption marker) and answer [`AdoptInput::Marker`].
    ReadMarker(Vec<u8>),
    /// Delete whatever this node holds of the shard: an import cut short by a crash
    /// may have left pages, and the shard must become exactly what is handed off.
    DeleteShard,
    /// Ask the previous owner for the page after `after`; answer [`AdoptInput::Page`].
    Pull {
        /// The previous owner.
        from: N,
        /// The placement epoch of the change.
        epoch: u64,
        /// The last record key of the previous page.
        after: Option<String>,
    },
    /// Commit this write to the shard.
    Import(ShardWrite),
    /// Write the shard's seal marker: its value is in a resharding's sealed sum, and
    /// a write it took here would be counted nowhere.
    Seal,
    /// Make everything written so far durable.
    Flush,
    /// Write this key (the adoption marker).
    WriteMarker(Vec<u8>),
    /// The shard is adopted at this epoch: remember it, and serve.
    Adopted {
        /// Whether this adoption imported it (false: a marker showed an earlier one).
        imported: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum AdoptStage {
    Begin,
    Marker,
    Pulling { after: Option<String> },
    Finished,
}

/// The adoption of one shard at one placement epoch, by its new owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adoption<N> {
    shard: ShardId,
    from: N,
    epoch: u64,
    stage: AdoptStage,
}

impl<N: Clone> Adoption<N> {
    /// The adoption of `shard` from `from` at `epoch`; its first input is
    /// [`AdoptInput::Begun`].
    pub fn new(shard: ShardId, from: N, epoch: u64) -> Self {
        Self { shard, from, epoch, stage: AdoptStage::Begin }
    }

    /// The shard.
    pub fn shard(&self) -> &ShardId {
        &self.shard
    }

    /// The placement epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether it is over (skipped or adopted).
    pub fn finished(&self) -> bool {
        self.stage == AdoptStage::Finished
    }

    fn pull(&self, after: Option<String>) -> AdoptEffect<N> {
        AdoptEffect::Pull { from: self.from.clone(), epoch: self.epoch, after }
    }

    /// Takes one input; returns what is now to do. An input that does not fit the
    /// stage (a late or repeated answer) changes nothing.
    pub fn step(&mut self, input: AdoptInput) -> Vec<AdoptEffect<N>> {
        match (&self.stage, input) {
            (AdoptStage::Begin, AdoptInput::Begun { adopted, still_previous }) => {
                if adopted || !still_previous {
                    self.stage = AdoptStage::Finished;
                    return vec![AdoptEffect::Skip];
                }
                self.stage = AdoptStage::Marker;
                vec![AdoptEffect::ReadMarker(adoption_marker(self.epoch, &self.shard))]
            }
            (AdoptStage::Marker, AdoptInput::Marker { present: true }) => {
                self.stage = AdoptStage::Finished;
                vec![AdoptEffect::Adopted { imported: false }]
            }
            (AdoptStage::Marker, AdoptInput::Marker { present: false }) => {
                self.stage = AdoptStage::Pulling { after: None };
                vec![AdoptEffect::DeleteShard, self.pull(None)]
            }
            (AdoptStage::Pulling { after }, AdoptInput::Page { after: answered, page, owns }) => {
                if *after != answered {
                    return Vec::new();
                }
                // The change completed during this adoption (its previous owner held
                // nothing) and a next one took the shard away: importing now would
                // leave a copy here that no owner asks for, and the next hand-off
                // could never report it gone.
                if !owns {
                    self.stage = AdoptStage::Finished;
                    return vec![AdoptEffect::Skip];
                }
                let next = page.records.last().map(|(key, _)| key.clone()).or(answered);
                let mut effects = vec![AdoptEffect::Import(ShardWrite {
                    image: page.image,
                    dedup_put: page.records,
                    dedup_remove: Vec::new(),
                })];
                if page.sealed && !planted(PlantedBug::ForgetsSeal) {
                    effects.push(AdoptEffect::Seal);
                }
                if page.more {
                    effects.push(self.pull(next.clone()));
                    self.stage = AdoptStage::Pulling { after: next };
                    return effects;
                }
                // The state first, then the marker: a crash in between imports again.
                self.stage = AdoptStage::Finished;
                effects.extend([
                    AdoptEffect::Flush,
                    AdoptEffect::WriteMarker(adoption_marker(self.epoch, &self.shard)),
                    AdoptEffect::Flush,
                    AdoptEffect::Adopted { imported: true },
                ]);
                effects
            }
            (AdoptStage::Pulling { after }, AdoptInput::Resend) => vec![self.pull(after.clone())],
            _ => Vec::new(),
        }
    }
}

// ---------------------------------------------------------------- pull answer

/// What happened to the previous owner's answer to one pull.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullInput {
    /// The pull arrived, and this node has applied the change it names: whether this
    /// node still owns the shard, and whether its store lost the shards' earlier
    /// values (a replaced disk whose loss is not accepted). Either refuses the pull:
    /// a lost shard handed over would reach its new owner as a complete value.
    Asked {
        /// This node owns the shard.
        owns: bool,
        /// This node's shards lack values they had.
        lost: bool,
    },
    /// Whether making the state durable succeeded.
    Durable {
        /// It did.
        ok: bool,
    },
    /// The shard's state as the store holds it, with a page of its records.
    Read {
        /// Its image.
        image: ShardImage,
        /// Whether its seal marker is present.
        sealed: bool,
        /// Its records after the pull's `after`, at most [`HANDOFF_RECORDS_MAX`].
        records: Vec<(String, DedupRecord)>,
    },
}

/// One thing the answer to a pull does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullEffect {
    /// Refuse the pull (this node owns the shard, or cannot make it durable).
    Refuse,
    /// Stop the shard's writer here and wait until it ended (it commits what it
    /// took first); none can start again, since this node no longer owns the shard.
    StopShard,
    /// Make every applied write durable; answer [`PullInput::Durable`].
    MakeDurable,
    /// Read the shard's image, its seal marker and its records after `after`;
    /// answer [`PullInput::Read`].
    Read {
        /// The last record key of the previous page.
        after: Option<String>,
        /// Most records to read.
        limit: usize,
    },
    /// Answer this page.
    Answer(HandOffPage),
}

/// The previous owner's answer to one pull of a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullAnswer {
    after: Option<String>,
}

impl PullAnswer {
    /// The answer to a pull of the records after `after` (`None`: the first page).
    pub fn new(after: Option<String>) -> Self {
        Self { after }
    }

    /// Takes one input; returns what is now to do.
    pub fn step(&mut self, input: PullInput) -> Vec<PullEffect> {
        match input {
            PullInput::Asked { owns: true, .. } | PullInput::Asked { lost: true, .. } => {
                vec![PullEffect::Refuse]
            }
            PullInput::Asked { .. } if self.after.is_none() => {
                vec![PullEffect::StopShard, PullEffect::MakeDurable]
            }
            PullInput::Asked { .. } => vec![PullEffect::MakeDurable],
            // Only what a crash cannot take back leaves this node: the new owner
            // keeps what it imports, while a state this node then lost would differ.
            PullInput::Durable { ok: false } => vec![PullEffect::Refuse],
            PullInput::Durable { ok: true } => {
                vec![PullEffect::Read { after: self.after.clone(), limit: HANDOFF_RECORDS_MAX }]
            }
            PullInput::Read { image, sealed, records } => {
                let more = records.len() >= HANDOFF_RECORDS_MAX;
                vec![PullEffect::Answer(HandOffPage { image, records, more, sealed })]
            }
        }
    }
}

// ------------------------------------------------------------- hand-off pass

/// What happened to a hand-off pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PassInput<N> {
    /// The pass starts: the placement epoch this node has applied, and the shards
    /// whose writers run here, each with its owner if another node owns it.
    Start {
        /// The epoch applied here.
        applied: u64,
        /// Running shards and their remote owners.
        running: Vec<(ShardId, Option<N>)>,
    },
    /// A page of the shard ids the store holds (after the last one asked for), each
    /// with its owner if another node owns it.
    Scanned(Vec<(ShardId, Option<N>)>),
    /// A page of the shards the store holds a seal marker for (after the last one
    /// asked for), each with its owner if another node owns it.
    ScannedSeals(Vec<(ShardId, Option<N>)>),
    /// A new owner answered the request to adopt `shard`.
    Adopted {
        /// The shard.
        shard: ShardId,
        /// It confirmed a durable adoption.
        ok: bool,
    },
    /// Stop waiting for answers: the unanswered requests failed.
    GiveUp,
}

/// One thing a hand-off pass does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PassEffect<N> {
    /// This node has not applied the change yet: the pass cannot run.
    NotApplied,
    /// Stop the writer of this shard and wait until it ended.
    Stop(ShardId),
    /// Read the next page of shard ids the store holds; answer [`PassInput::Scanned`].
    Scan {
        /// The last id of the previous page.
        after: Option<ShardId>,
        /// Most ids to read.
        limit: usize,
    },
    /// Read the next page of seal markers the store holds, in key order
    /// ([`SEAL_MARKER_PREFIX`]); answer [`PassInput::ScannedSeals`]. A shard sealed
    /// before it took any write has a marker and nothing else.
    ScanSeals {
        /// The shard of the last marker of the previous page.
        after: Option<ShardId>,
        /// Most markers to read.
        limit: usize,
    },
    /// Ask `owner` to adopt `shard` at `epoch`; answer [`PassInput::Adopted`].
    AskAdopt {
        /// The shard.
        shard: ShardId,
        /// Its new owner.
        owner: N,
        /// The placement epoch.
        epoch: u64,
    },
    /// Delete this node's copy of the shard (data, records and seal).
    Delete(ShardId),
    /// Make every deletion durable.
    Flush,
    /// The pass is over: what it moved and what it left behind.
    Report(HandoffReport),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum PassStage {
    Idle,
    Scanning,
    ScanningSeals,
    Waiting,
    Finished,
}

/// One hand-off pass of a previous owner over every shard it holds but no longer
/// owns at `epoch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandOffPass<N> {
    epoch: u64,
    stage: PassStage,
    asked: BTreeMap<ShardId, N>,
    /// Every shard asked for so far: one that has both data and a seal marker is
    /// asked for once.
    considered: BTreeSet<ShardId>,
    report: HandoffReport,
}

impl<N: Clone> HandOffPass<N> {
    /// A pass at `epoch`; its first input is [`PassInput::Start`].
    pub fn new(epoch: u64) -> Self {
        Self {
            epoch,
            stage: PassStage::Idle,
            asked: BTreeMap::new(),
            considered: BTreeSet::new(),
            report: HandoffReport::default(),
        }
    }

    /// The placement epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether it has reported.
    pub fn finished(&self) -> bool {
        self.stage == PassStage::Finished
    }

    /// The requests not answered yet.
    pub fn asked(&self) -> impl Iterator<Item = (&ShardId, &N)> {
        self.asked.iter()
    }

    /// Takes one input; returns what is now to do. An input that does not fit the
    /// stage (a late or repeated answer) changes nothing.
    pub fn step(&mut self, input: PassInput<N>) -> Vec<PassEffect<N>> {
        match (&self.stage, input) {
            (PassStage::Idle, PassInput::Start { applied, running }) => {
                if applied < self.epoch {
                    self.stage = PassStage::Finished;
                    return vec![PassEffect::NotApplied];
                }
                // The store lists only shards with a committed write: a shard whose
                // first write is still with its writer would be missed. So every
                // writer of a shard this node no longer owns stops first (it commits
                // what it took, and none starts again here).
                let mut stop: Vec<ShardId> =
                    running.into_iter().filter(|(_, owner)| owner.is_some()).map(|(id, _)| id).collect();
                stop.sort();
                self.stage = PassStage::Scanning;
                let mut effects: Vec<PassEffect<N>> = stop.into_iter().map(PassEffect::Stop).collect();
                effects.push(PassEffect::Scan { after: None, limit: HANDOFF_SCAN_PAGE });
                effects
            }
            (PassStage::Scanning, PassInput::Scanned(page)) => self.scanned(page, false),
            (PassStage::ScanningSeals, PassInput::ScannedSeals(page)) => self.scanned(page, true),
            (
                PassStage::Scanning | PassStage::ScanningSeals | PassStage::Waiting,
                PassInput::Adopted { shard, ok },
            ) => {
                if self.asked.remove(&shard).is_none() {
                    return Vec::new();
                }
                let mut effects = Vec::new();
                if ok {
                    self.report.moved += 1;
                    effects.push(PassEffect::Delete(shard));
                } else {
                    self.report.failed += 1;
                }
                if self.stage == PassStage::Waiting {
                    effects.extend(self.finish_if_answered());
                }
                effects
            }
            (PassStage::Scanning | PassStage::ScanningSeals | PassStage::Waiting, PassInput::GiveUp) => {
                self.report.failed += self.asked.len() as u64;
                self.asked.clear();
                self.stage = PassStage::Finished;
                vec![PassEffect::Flush, PassEffect::Report(self.report)]
            }
            _ => Vec::new(),
        }
    }

    /// A page of shard ids (`seals`: of seal markers) read: asks for the foreign ones,
    /// then reads on, turns to the seal markers, or waits for the answers.
    fn scanned(&mut self, page: Vec<(ShardId, Option<N>)>, seals: bool) -> Vec<PassEffect<N>> {
        let full = page.len() >= HANDOFF_SCAN_PAGE;
        let last = page.last().map(|(id, _)| id.clone());
        let mut effects = self.ask(page);
        let limit = HANDOFF_SCAN_PAGE;
        match (full, seals) {
            (true, false) => effects.push(PassEffect::Scan { after: last, limit }),
            (false, false) => {
                self.stage = PassStage::ScanningSeals;
                effects.push(PassEffect::ScanSeals { after: None, limit });
            }
            (true, true) => effects.push(PassEffect::ScanSeals { after: last, limit }),
            (false, true) => {
                self.stage = PassStage::Waiting;
                effects.extend(self.finish_if_answered());
            }
        }
        effects
    }

    /// Asks each new owner in `page` to adopt its shard, once per shard.
    fn ask(&mut self, page: Vec<(ShardId, Option<N>)>) -> Vec<PassEffect<N>> {
        let mut effects = Vec::new();
        for (shard, owner) in page {
            let Some(owner) = owner else { continue };
            if !self.considered.insert(shard.clone()) {
                continue;
            }
            if planted(PlantedBug::DeletesEarly) {
                effects.push(PassEffect::Delete(shard.clone()));
            }
            self.asked.insert(shard.clone(), owner.clone());
            effects.push(PassEffect::AskAdopt { shard, owner, epoch: self.epoch });
        }
        effects
    }

    fn finish_if_answered(&mut self) -> Vec<PassEffect<N>> {
        if !self.asked.is_empty() {
            return Vec::new();
        }
        self.stage = PassStage::Finished;
        vec![PassEffect::Flush, PassEffect::Report(self.report)]
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_seal_marker_names_its_shard_back() {
        let id = ShardId::new(crate::name::CounterName::new("page:views").unwrap(), 7, 12);
        assert_eq!(super::shard_of_seal_marker(&super::seal_marker(&id)), Some(id.clone()));
        let classed = id.in_class(3);
        assert_eq!(super::shard_of_seal_marker(&super::seal_marker(&classed)), Some(classed));
        assert_eq!(super::shard_of_seal_marker(b"adopted:x"), None);
        assert_eq!(super::shard_of_seal_marker(b"sealed:likes#g1"), None);
    }

    use super::*;
    use crate::CounterName;

    fn shard(i: u16) -> ShardId {
        ShardId::new(CounterName::new("c").unwrap(), 0, i)
    }

    fn rec(delta: i64) -> DedupRecord {
        DedupRecord { delta, applied_at_ms: 7 }
    }

    fn image(value: i64) -> ShardImage {
        ShardImage { value, sketch: None, frequency: None, windows: None, escrow: None }
    }

    fn records(keys: &[&str]) -> Vec<(String, DedupRecord)> {
        keys.iter().map(|k| ((*k).to_owned(), rec(1))).collect()
    }

    fn page(value: i64, keys: &[&str], more: bool, sealed: bool) -> HandOffPage {
        HandOffPage { image: image(value), records: records(keys), more, sealed }
    }

    fn import(value: i64, keys: &[&str]) -> AdoptEffect<&'static str> {
        AdoptEffect::Import(ShardWrite {
            image: image(value),
            dedup_put: records(keys),
            dedup_remove: vec![],
        })
    }

    fn pull(after: Option<&str>) -> AdoptEffect<&'static str> {
        AdoptEffect::Pull { from: "b", epoch: 3, after: after.map(str::to_owned) }
    }

    /// An adoption of shard 0 from node "b" at epoch 3, past its marker check.
    fn pulling() -> Adoption<&'static str> {
        let mut a = Adoption::new(shard(0), "b", 3);
        a.step(AdoptInput::Begun { adopted: false, still_previous: true });
        a.step(AdoptInput::Marker { present: false });
        a
    }

    #[test]
    fn markers_are_the_store_keys_the_engine_has_always_written() {
        let id = shard(2);
        assert_eq!(seal_marker(&id), [b"sealed:".as_slice(), id.to_string().as_bytes()].concat());
        let mut want = b"adopted:".to_vec();
        want.extend_from_slice(&5u64.to_be_bytes());
        want.extend_from_slice(id.to_string().as_bytes());
        assert_eq!(adoption_marker(5, &id), want);
        assert_ne!(adoption_marker(5, &id), adoption_marker(6, &id), "one marker per epoch");
    }

    #[test]
    fn admission_adopts_only_while_the_change_is_handed_off() {
        assert_eq!(admit::<&str>(None, false, false), Admission::Serve);
        assert_eq!(admit(Some(("b", 3)), true, false), Admission::Serve);
        assert_eq!(admit(Some(("b", 3)), true, true), Admission::Serve);
        assert_eq!(admit(Some(("b", 3)), false, false), Admission::Adopt { from: "b", epoch: 3 });
        assert_eq!(admit(Some(("b", 3)), false, true), Admission::Adopt { from: "b", epoch: 3 });
    }

    /// Fixed defect: the change completed while an adoption of the shard was still
    /// importing, and a request that saw it complete started a writer beside the
    /// import. It must wait for the import instead; and an adoption that begins after
    /// the change completed must not import at all (it would write under that writer).
    #[test]
    fn a_change_completed_during_an_adoption_waits_for_it_and_a_later_one_skips() {
        assert_eq!(admit::<&str>(None, false, true), Admission::AwaitInFlight);
        let mut a = Adoption::new(shard(0), "b", 3);
        assert_eq!(
            a.step(AdoptInput::Begun { adopted: false, still_previous: false }),
            vec![AdoptEffect::Skip]
        );
        assert!(a.finished());
        assert_eq!(a.step(AdoptInput::Marker { present: false }), vec![], "nothing after a skip");
        let mut a = Adoption::new(shard(0), "b", 3);
        assert_eq!(
            a.step(AdoptInput::Begun { adopted: true, still_previous: true }),
            vec![AdoptEffect::Skip]
        );
    }

    #[test]
    fn an_adoption_with_its_marker_present_imports_nothing() {
        let mut a = Adoption::new(shard(0), "b", 3);
        assert_eq!(a.shard(), &shard(0));
        assert_eq!(a.epoch(), 3);
        assert_eq!(
            a.step(AdoptInput::Begun { adopted: false, still_previous: true }),
            vec![AdoptEffect::ReadMarker(adoption_marker(3, &shard(0)))]
        );
        assert!(!a.finished());
        assert_eq!(
            a.step(AdoptInput::Marker { present: true }),
            vec![AdoptEffect::Adopted { imported: false }]
        );
        assert!(a.finished());
        assert_eq!(a.step(AdoptInput::Resend), vec![], "nothing to resend once adopted");
    }

    /// Fixed defect: an import cut short by a crash left records that the previous
    /// owner no longer has; the adoption deletes what is there before its first pull.
    #[test]
    fn an_adoption_without_its_marker_starts_clean_and_pulls_the_first_page() {
        let mut a = Adoption::new(shard(0), "b", 3);
        a.step(AdoptInput::Begun { adopted: false, still_previous: true });
        assert_eq!(a.step(AdoptInput::Marker { present: false }), vec![AdoptEffect::DeleteShard, pull(None)]);
    }

    #[test]
    fn the_last_page_is_made_durable_before_the_marker_and_the_marker_before_serving() {
        let mut a = pulling();
        assert_eq!(
            a.step(AdoptInput::Page { after: None, page: page(5, &["x", "y"], false, false), owns: true }),
            vec![
                import(5, &["x", "y"]),
                AdoptEffect::Flush,
                AdoptEffect::WriteMarker(adoption_marker(3, &shard(0))),
                AdoptEffect::Flush,
                AdoptEffect::Adopted { imported: true },
            ]
        );
        assert!(a.finished());
    }

    #[test]
    fn pages_are_pulled_after_the_last_record_and_stale_answers_are_ignored() {
        let mut a = pulling();
        assert_eq!(
            a.step(AdoptInput::Page { after: None, page: page(5, &["a", "b"], true, false), owns: true }),
            vec![import(5, &["a", "b"]), pull(Some("b"))]
        );
        assert_eq!(a.step(AdoptInput::Resend), vec![pull(Some("b"))], "resent as it stands");
        // The first page again (a duplicate, or the answer to a resend) is not imported twice.
        assert_eq!(
            a.step(AdoptInput::Page { after: None, page: page(5, &["a", "b"], true, false), owns: true }),
            vec![]
        );
        // A full page without records (they went meanwhile) pulls from the same place.
        assert_eq!(
            a.step(AdoptInput::Page { after: Some("b".into()), page: page(6, &[], true, false), owns: true }),
            vec![import(6, &[]), pull(Some("b"))]
        );
        let last = a.step(AdoptInput::Page {
            after: Some("b".into()),
            page: page(6, &["c"], false, false),
            owns: true,
        });
        assert_eq!(last.first(), Some(&import(6, &["c"])));
        assert_eq!(last.last(), Some(&AdoptEffect::Adopted { imported: true }));
        assert_eq!(a.step(AdoptInput::Resend), vec![]);
    }

    /// Fixed defect: a sealed shard lost its seal at its new owner, which then took
    /// writes its successor generation never counts.
    #[test]
    fn a_sealed_shard_is_sealed_at_its_new_owner() {
        let mut a = pulling();
        let effects = a.step(AdoptInput::Page { after: None, page: page(5, &["x"], true, true), owns: true });
        assert_eq!(effects, vec![import(5, &["x"]), AdoptEffect::Seal, pull(Some("x"))]);
        let effects =
            a.step(AdoptInput::Page { after: Some("x".into()), page: page(5, &[], false, true), owns: true });
        assert_eq!(effects[..2], [import(5, &[]), AdoptEffect::Seal]);
        assert_eq!(effects[2], AdoptEffect::Flush, "the seal is durable before the marker");
    }

    /// Found by the simulator: an adoption still in flight when its change completed
    /// and the next change gave the shard to another node imported its page there,
    /// leaving a copy that node's next hand-off could never hand to anyone.
    #[test]
    fn an_adoption_overtaken_by_the_next_change_imports_nothing() {
        let mut a = pulling();
        assert_eq!(
            a.step(AdoptInput::Page { after: None, page: page(0, &[], false, false), owns: false }),
            vec![AdoptEffect::Skip]
        );
        assert!(a.finished());
        assert_eq!(a.step(AdoptInput::Resend), vec![]);
    }

    #[test]
    fn inputs_out_of_order_change_nothing() {
        let mut a = Adoption::new(shard(0), "b", 3);
        assert_eq!(a.step(AdoptInput::Marker { present: false }), vec![]);
        assert_eq!(
            a.step(AdoptInput::Page { after: None, page: page(1, &[], false, false), owns: true }),
            vec![]
        );
        assert_eq!(a.step(AdoptInput::Resend), vec![]);
        a.step(AdoptInput::Begun { adopted: false, still_previous: true });
        assert_eq!(a.step(AdoptInput::Begun { adopted: false, still_previous: true }), vec![]);
        assert_eq!(
            a.step(AdoptInput::Page { after: None, page: page(1, &[], false, false), owns: true }),
            vec![]
        );
    }

    #[test]
    fn a_pull_is_refused_by_the_owner_and_the_first_stops_the_writer() {
        let asked = |owns| PullInput::Asked { owns, lost: false };
        assert_eq!(PullAnswer::new(None).step(asked(true)), vec![PullEffect::Refuse]);
        assert_eq!(
            PullAnswer::new(None).step(asked(false)),
            vec![PullEffect::StopShard, PullEffect::MakeDurable]
        );
        assert_eq!(
            PullAnswer::new(Some("k".into())).step(asked(false)),
            vec![PullEffect::MakeDurable],
            "later pages find the writer stopped"
        );
    }

    /// Fixed defect: a previous owner whose disk was replaced (its loss not accepted)
    /// handed over its empty shards, which then read as complete zeros on the new
    /// owner.
    #[test]
    fn a_pull_from_a_node_that_lost_its_data_is_refused() {
        for after in [None, Some("k".to_owned())] {
            let mut p = PullAnswer::new(after);
            assert_eq!(p.step(PullInput::Asked { owns: false, lost: true }), vec![PullEffect::Refuse]);
        }
    }

    /// Fixed defect: a previous owner whose flush had failed (poisoned) answered
    /// state it had applied but not made durable, and could lose it afterwards.
    #[test]
    fn a_pull_answers_only_durable_state() {
        let mut p = PullAnswer::new(Some("k".into()));
        assert_eq!(p.step(PullInput::Durable { ok: false }), vec![PullEffect::Refuse]);
        assert_eq!(
            p.step(PullInput::Durable { ok: true }),
            vec![PullEffect::Read { after: Some("k".into()), limit: HANDOFF_RECORDS_MAX }]
        );
        assert_eq!(
            p.step(PullInput::Read { image: image(4), sealed: true, records: records(&["m"]) }),
            vec![PullEffect::Answer(page(4, &["m"], false, true))]
        );
    }

    #[test]
    fn a_full_page_says_more_follow() {
        let keyed = |n: usize| -> Vec<(String, DedupRecord)> {
            (0..n).map(|i| (format!("{i:05}"), rec(1))).collect()
        };
        let mut p = PullAnswer::new(None);
        let answer = |p: &mut PullAnswer, n| match p
            .step(PullInput::Read { image: image(0), sealed: false, records: keyed(n) })
            .as_slice()
        {
            [PullEffect::Answer(page)] => page.more,
            other => panic!("{other:?}"),
        };
        assert!(answer(&mut p, HANDOFF_RECORDS_MAX));
        assert!(!answer(&mut p, HANDOFF_RECORDS_MAX - 1));
    }

    #[test]
    fn a_pass_waits_for_the_change_and_stops_foreign_writers_before_it_scans() {
        let mut p = HandOffPass::<&str>::new(2);
        assert_eq!(p.epoch(), 2);
        assert_eq!(p.step(PassInput::Start { applied: 1, running: vec![] }), vec![PassEffect::NotApplied]);
        assert!(p.finished());
        let mut p = HandOffPass::new(2);
        let running = vec![(shard(3), Some("c")), (shard(1), None), (shard(0), Some("b"))];
        assert_eq!(
            p.step(PassInput::Start { applied: 2, running }),
            vec![
                PassEffect::Stop(shard(0)),
                PassEffect::Stop(shard(3)),
                PassEffect::Scan { after: None, limit: HANDOFF_SCAN_PAGE }
            ]
        );
        assert!(!p.finished());
    }

    /// The planted `handoff-deletes-early` breaks this: the copy here is deleted only once its new owner confirmed the adoption, and a refusal
    /// leaves it in place and in the report.
    #[test]
    fn a_pass_deletes_only_what_was_adopted_and_reports_what_is_left() {
        let mut p = HandOffPass::new(2);
        p.step(PassInput::Start { applied: 4, running: vec![] });
        let page = vec![(shard(0), Some("b")), (shard(1), None), (shard(2), Some("c"))];
        assert_eq!(
            p.step(PassInput::Scanned(page)),
            vec![
                PassEffect::AskAdopt { shard: shard(0), owner: "b", epoch: 2 },
                PassEffect::AskAdopt { shard: shard(2), owner: "c", epoch: 2 },
                PassEffect::ScanSeals { after: None, limit: HANDOFF_SCAN_PAGE },
            ]
        );
        assert_eq!(p.step(PassInput::ScannedSeals(vec![])), vec![]);
        assert_eq!(p.asked().count(), 2);
        assert_eq!(p.step(PassInput::Adopted { shard: shard(2), ok: false }), vec![]);
        assert_eq!(p.step(PassInput::Adopted { shard: shard(2), ok: true }), vec![], "answered once");
        assert_eq!(p.step(PassInput::Adopted { shard: shard(1), ok: true }), vec![], "never asked");
        assert_eq!(
            p.step(PassInput::Adopted { shard: shard(0), ok: true }),
            vec![
                PassEffect::Delete(shard(0)),
                PassEffect::Flush,
                PassEffect::Report(HandoffReport { moved: 1, failed: 1 })
            ]
        );
        assert!(p.finished());
        assert_eq!(p.step(PassInput::GiveUp), vec![]);
    }

    #[test]
    fn a_pass_with_nothing_foreign_reports_at_once() {
        let mut p = HandOffPass::<&str>::new(2);
        p.step(PassInput::Start { applied: 2, running: vec![] });
        assert_eq!(
            p.step(PassInput::Scanned(vec![(shard(1), None)])),
            vec![PassEffect::ScanSeals { after: None, limit: HANDOFF_SCAN_PAGE }]
        );
        assert_eq!(
            p.step(PassInput::ScannedSeals(vec![(shard(1), None)])),
            vec![PassEffect::Flush, PassEffect::Report(HandoffReport::default())]
        );
    }

    #[test]
    fn a_full_scan_page_reads_on_and_answers_during_the_scan_wait_for_its_end() {
        let mut p = HandOffPass::new(2);
        p.step(PassInput::Start { applied: 2, running: vec![] });
        let mut page: Vec<(ShardId, Option<&str>)> =
            (0..HANDOFF_SCAN_PAGE as u16).map(|i| (shard(i), None)).collect();
        page[0].1 = Some("b");
        let effects = p.step(PassInput::Scanned(page));
        assert_eq!(
            effects,
            vec![
                PassEffect::AskAdopt { shard: shard(0), owner: "b", epoch: 2 },
                PassEffect::Scan {
                    after: Some(shard(HANDOFF_SCAN_PAGE as u16 - 1)),
                    limit: HANDOFF_SCAN_PAGE
                },
            ]
        );
        // Answered before the scan ended: deleted, but not reported yet.
        assert_eq!(
            p.step(PassInput::Adopted { shard: shard(0), ok: true }),
            vec![PassEffect::Delete(shard(0))]
        );
        assert_eq!(
            p.step(PassInput::Scanned(vec![])),
            vec![PassEffect::ScanSeals { after: None, limit: HANDOFF_SCAN_PAGE }]
        );
        assert_eq!(
            p.step(PassInput::ScannedSeals(vec![])),
            vec![PassEffect::Flush, PassEffect::Report(HandoffReport { moved: 1, failed: 0 })]
        );
    }

    /// A shard sealed before its first write has a seal marker and no data: the pass
    /// hands it off from the markers, and a shard with both is asked for once.
    #[test]
    fn a_shard_known_only_by_its_seal_marker_is_handed_off_too() {
        let mut p = HandOffPass::new(2);
        p.step(PassInput::Start { applied: 2, running: vec![] });
        assert_eq!(
            p.step(PassInput::Scanned(vec![(shard(0), Some("b"))])),
            vec![
                PassEffect::AskAdopt { shard: shard(0), owner: "b", epoch: 2 },
                PassEffect::ScanSeals { after: None, limit: HANDOFF_SCAN_PAGE },
            ]
        );
        assert_eq!(p.step(PassInput::Adopted { shard: shard(0), ok: false }), vec![]);
        let mut seals: Vec<(ShardId, Option<&str>)> =
            (0..HANDOFF_SCAN_PAGE as u16).map(|i| (shard(i), None)).collect();
        seals[0].1 = Some("b");
        seals[1].1 = Some("c");
        assert_eq!(
            p.step(PassInput::ScannedSeals(seals)),
            vec![
                PassEffect::AskAdopt { shard: shard(1), owner: "c", epoch: 2 },
                PassEffect::ScanSeals {
                    after: Some(shard(HANDOFF_SCAN_PAGE as u16 - 1)),
                    limit: HANDOFF_SCAN_PAGE
                },
            ]
        );
        assert_eq!(p.step(PassInput::ScannedSeals(vec![])), vec![]);
        assert_eq!(
            p.step(PassInput::Adopted { shard: shard(1), ok: true }),
            vec![
                PassEffect::Delete(shard(1)),
                PassEffect::Flush,
                PassEffect::Report(HandoffReport { moved: 1, failed: 1 })
            ]
        );
    }

    #[test]
    fn giving_up_counts_every_unanswered_request_as_left_behind() {
        let mut p = HandOffPass::new(2);
        p.step(PassInput::Start { applied: 2, running: vec![] });
        p.step(PassInput::Scanned(vec![(shard(0), Some("b")), (shard(1), Some("b"))]));
        assert_eq!(
            p.step(PassInput::Adopted { shard: shard(1), ok: true }),
            vec![PassEffect::Delete(shard(1))]
        );
        assert_eq!(
            p.step(PassInput::GiveUp),
            vec![PassEffect::Flush, PassEffect::Report(HandoffReport { moved: 1, failed: 1 })]
        );
        assert_eq!(p.step(PassInput::Adopted { shard: shard(0), ok: true }), vec![], "too late");
    }

    #[cfg(feature = "planted-bugs")]
    #[test]
    fn the_planted_hand_off_bugs_live_here() {
        use crate::planted::{plant, Bug};
        plant(Some(Bug::HandoffDeletesEarly));
        let mut p = HandOffPass::new(2);
        p.step(PassInput::Start { applied: 2, running: vec![] });
        assert_eq!(
            p.step(PassInput::Scanned(vec![(shard(0), Some("b"))]))[0],
            PassEffect::Delete(shard(0)),
            "deleted before it is adopted"
        );
        plant(Some(Bug::HandoffForgetsSeal));
        let mut a = pulling();
        let effects = a.step(AdoptInput::Page { after: None, page: page(5, &[], false, true), owns: true });
        assert!(!effects.contains(&AdoptEffect::Seal));
        plant(None);
    }
}
