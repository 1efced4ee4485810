//! t10: the sled storage on its own, without a cluster.
//!
//! * openraft's conformance suite (`Suite::test_all`) against [`SledLogStore`] and
//!   [`SledStateMachine`]: log reads, truncation, purging, vote, membership
//!   bookkeeping, apply and snapshot transfer as openraft expects them;
//! * the state machine after a reopen holds exactly what was applied, with its
//!   `last_applied`, so nothing is applied twice;
//! * a snapshot carrying real counters replaces a state machine's whole state.

use openraft::storage::{RaftLogStorage, RaftLogStorageExt, RaftStateMachine};
use openraft::testing::{StoreBuilder, Suite};
use openraft::{
    CommittedLeaderId, Entry, EntryPayload, LogId, RaftLogReader, RaftSnapshotBuilder, StorageError,
};
use tally_core::meta::MetaCommand;
use tally_core::name::CounterName;
use tally_core::spec::SpecPatch;
use tally_raft::{Request, Response, SledLogStore, SledStateMachine, TypeConfig};
use tempfile::TempDir;

struct SledBuilder;

impl StoreBuilder<TypeConfig, SledLogStore, SledStateMachine, TempDir> for SledBuilder {
    async fn build(&self) -> Result<(TempDir, SledLogStore, SledStateMachine), StorageError<u64>> {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = sled::Config::new().path(dir.path()).open().expect("open sled");
        let log = SledLogStore::open(&db).expect("open log trees");
        let sm = SledStateMachine::open(&db)?;
        Ok((dir, log, sm))
    }
}

#[test]
fn t11_openraft_conformance_suite() {
    Suite::test_all(SledBuilder).expect("the sled store passes openraft's suite");
}

fn entry(index: u64, req: Request) -> Entry<TypeConfig> {
    Entry { log_id: LogId::new(CommittedLeaderId::new(1, 1), index), payload: EntryPayload::Normal(req) }
}

fn put(name: &str, shards: u16, now_ms: u64) -> Request {
    Request::Counter {
        name: CounterName::new(name).unwrap(),
        cmd: MetaCommand::Put(SpecPatch { shards: Some(shards), ..Default::default() }),
        now_ms,
    }
}

#[tokio::test]
async fn t12_state_machine_reopens_without_reapplying() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = sled::Config::new().path(dir.path()).open().unwrap();
        let mut log = SledLogStore::open(&db).unwrap();
        let mut sm = SledStateMachine::open(&db).unwrap();
        let entries = vec![
            entry(1, put("a", 2, 10)),
            entry(2, put("a", 4, 11)),
            entry(
                3,
                Request::Counter {
                    name: CounterName::new("a").unwrap(),
                    cmd: MetaCommand::CompleteReshard { generation: 0, sealed_sum: 7 },
                    now_ms: 12,
                },
            ),
            entry(4, Request::SetMembers { from_epoch: 0, previous: vec![], members: vec!["node1".into()] }),
        ];
        log.blocking_append(entries.clone()).await.unwrap();
        let replies = sm.apply(entries).await.unwrap();
        assert!(matches!(replies[2], Response::Counter(Ok(_))), "{replies:?}");
        db.flush_async().await.unwrap();
    }
    let db = reopen(dir.path()).await;
    let mut log = SledLogStore::open(&db).unwrap();
    let mut sm = SledStateMachine::open(&db).unwrap();
    let (applied, _) = sm.applied_state().await.unwrap();
    assert_eq!(applied.map(|l| l.index), Some(4), "last_applied survives with the data");
    let state = sm.shared().read().state.clone();
    assert_eq!(state.applied_requests, 4);
    assert_eq!(state.counters["a"].layout.base, 7, "the reshard was applied exactly once");
    assert_eq!((state.members, state.placement_epoch), (vec!["node1".to_string()], 1));
    assert_eq!(log.get_log_state().await.unwrap().last_log_id.map(|l| l.index), Some(4));
    assert_eq!(log.try_get_log_entries(2..4).await.unwrap().len(), 2);
}

#[tokio::test]
async fn t13_snapshot_replaces_the_whole_state() {
    let (_d1, _l1, mut leader) = SledBuilder.build().await.unwrap();
    let (_d2, _l2, mut follower) = SledBuilder.build().await.unwrap();
    leader
        .apply(vec![
            entry(1, put("kept", 3, 1)),
            entry(2, Request::SetMembers { from_epoch: 0, previous: vec![], members: vec!["n1".into()] }),
        ])
        .await
        .unwrap();
    follower.apply(vec![entry(1, put("stale", 5, 1))]).await.unwrap();

    let snap = leader.get_snapshot_builder().await.build_snapshot().await.unwrap();
    let mut receiving = follower.begin_receiving_snapshot().await.unwrap();
    *receiving = *snap.snapshot;
    follower.install_snapshot(&snap.meta, receiving).await.unwrap();

    let (l, f) = (leader.shared().read().state.clone(), follower.shared().read().state.clone());
    assert_eq!(l, f);
    assert!(f.counters.contains_key("kept") && !f.counters.contains_key("stale"));
    let current = follower.get_current_snapshot().await.unwrap().expect("snapshot kept");
    assert_eq!(current.meta, snap.meta);
}

/// The proposal book outlives a restart and travels in snapshots: a proposal
/// resent to a node that reopened its store, or that installed a snapshot, is
/// answered as the first time and applied nowhere twice.
#[tokio::test]
async fn t14_the_proposal_book_survives_a_reopen_and_a_snapshot() {
    let proposal = |seq, request| Request::Proposal {
        id: tally_raft::ProposalId { proposer: 42, seq },
        request: Box::new(request),
    };
    let delete =
        || Request::Counter { name: CounterName::new("a").unwrap(), cmd: MetaCommand::Delete, now_ms: 2 };
    let dir = tempfile::tempdir().unwrap();
    let first = {
        let db = sled::Config::new().path(dir.path()).open().unwrap();
        let mut sm = SledStateMachine::open(&db).unwrap();
        let replies = sm
            .apply(vec![entry(1, proposal(1, put("a", 2, 1))), entry(2, proposal(2, delete()))])
            .await
            .unwrap();
        db.flush_async().await.unwrap();
        replies[1].clone()
    };
    assert!(matches!(first, Response::Counter(Ok((None, _)))), "{first:?}");
    let db = reopen(dir.path()).await;
    let mut sm = SledStateMachine::open(&db).unwrap();
    let again = sm.apply(vec![entry(3, proposal(2, delete()))]).await.unwrap();
    assert_eq!(again[0], first, "answered as the first time after a reopen");

    let (_d, _l, mut follower) = SledBuilder.build().await.unwrap();
    let snap = sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
    let mut receiving = follower.begin_receiving_snapshot().await.unwrap();
    *receiving = *snap.snapshot;
    follower.install_snapshot(&snap.meta, receiving).await.unwrap();
    let resent = follower.apply(vec![entry(4, proposal(2, delete()))]).await.unwrap();
    assert_eq!(resent[0], first, "answered as the first time after a snapshot");
    let state = follower.shared().read().state.clone();
    assert_eq!(state.tombstones.len(), 1);
    assert_eq!(state.proposals[&42].answered.len(), 2);
}

/// The proposal book as stored holds what memory holds after proposals past both
/// of its bounds (answers forgotten per proposer, quiet proposers dropped), and a
/// proposal writes its own answer: the stored records of the book grow by one per
/// proposal, never by a copy of its proposer's book.
#[tokio::test]
async fn t15_the_proposal_book_reopens_as_it_was_past_its_bounds() {
    use tally_raft::state::{PROPOSALS_REMEMBERED_MAX, PROPOSERS_REMEMBERED_MAX};
    let dir = tempfile::tempdir().unwrap();
    let expected = {
        let db = sled::Config::new().path(dir.path()).open().unwrap();
        let mut sm = SledStateMachine::open(&db).unwrap();
        let mut index = 0;
        let mut next = |proposer: u128, seq: u64| {
            index += 1;
            let name = CounterName::new(format!("c{proposer}-{seq}")).unwrap();
            let request = Request::Counter { name, cmd: MetaCommand::Ensure, now_ms: 1 };
            entry(
                index,
                Request::Proposal {
                    id: tally_raft::ProposalId { proposer, seq },
                    request: Box::new(request),
                },
            )
        };
        // One busy proposer past its answers' bound, then more proposers than the
        // book keeps.
        let busy: Vec<_> = (1..=PROPOSALS_REMEMBERED_MAX as u64 + 10).map(|seq| next(1, seq)).collect();
        for chunk in busy.chunks(100) {
            sm.apply(chunk.to_vec()).await.unwrap();
        }
        let records = |db: &sled::Db| {
            db.open_tree(tally_raft::state_machine::SM_TREE).unwrap().scan_prefix(b"q/").count()
        };
        let before = records(&db);
        sm.apply(vec![next(2, 1)]).await.unwrap();
        assert_eq!(records(&db), before + 1, "one proposal, one more answer record");
        for proposer in 3..(PROPOSERS_REMEMBERED_MAX as u128 + 5) {
            sm.apply(vec![next(proposer, 1), next(proposer, 2)]).await.unwrap();
        }
        db.flush_async().await.unwrap();
        let state = sm.shared().read().state.clone();
        assert_eq!(state.proposals.len(), PROPOSERS_REMEMBERED_MAX);
        assert!(!state.proposals.contains_key(&1), "the busy proposer went quiet and was dropped");
        let answers: usize = state.proposals.values().map(|p| p.answered.len()).sum();
        assert_eq!(records(&db), answers, "no answer of a dropped proposer stays stored");
        state.proposals
    };
    let db = reopen(dir.path()).await;
    let sm = SledStateMachine::open(&db).unwrap();
    assert_eq!(sm.shared().read().state.proposals, expected);
}

/// Creations grouped in one entry answer per counter, and reopen as created one by one.
#[tokio::test]
async fn t16_creations_share_an_entry() {
    let dir = tempfile::tempdir().unwrap();
    let names: Vec<_> = ["x", "y", "x", "z"].iter().map(|n| CounterName::new(*n).unwrap()).collect();
    {
        let db = sled::Config::new().path(dir.path()).open().unwrap();
        let mut sm = SledStateMachine::open(&db).unwrap();
        sm.apply(vec![entry(1, put("y", 3, 1))]).await.unwrap();
        let default = tally_core::namespace::NamespaceSpec::default();
        let replies = sm
            .apply(vec![entry(2, Request::EnsureMany { names: names.clone(), default, now_ms: 5 })])
            .await
            .unwrap();
        let Response::Ensured(answers) = &replies[0] else { panic!("{replies:?}") };
        let effects: Vec<_> = answers.iter().map(|a| a.as_ref().unwrap().1.clone()).collect();
        use tally_raft::Effect;
        assert_eq!(effects, vec![Effect::Created, Effect::Unchanged, Effect::Unchanged, Effect::Created]);
        assert_eq!(answers[1].as_ref().unwrap().0.as_ref().unwrap().spec.shards, 3, "y kept its spec");
        db.flush_async().await.unwrap();
    }
    let db = reopen(dir.path()).await;
    let sm = SledStateMachine::open(&db).unwrap();
    let state = sm.shared().read().state.clone();
    assert_eq!(state.counters.keys().map(|n| n.as_str()).collect::<Vec<_>>(), ["x", "y", "z"]);
    assert_eq!(state.counters["x"].created_at_ms, 5);
}

/// Opens the database at `path` once sled's background threads of the previous
/// handle have let go of its lock (they can outlive the drop by a moment on a busy
/// machine).
async fn reopen(path: &std::path::Path) -> sled::Db {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match sled::Config::new().path(path).open() {
            Ok(db) => return db,
            Err(e) if e.to_string().contains("lock") && std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => panic!("reopening {}: {e}", path.display()),
        }
    }
}
