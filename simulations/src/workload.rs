//! The workload both tiers run: the counters a run creates and the mix of operations
//! a client draws, each from the run's RNG in a fixed order.

use crate::history::{CounterInfo, Role};
use crate::msg::Consistency;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use tally_core::spec::{Durability, RouterPolicy, SpecPatch};
use tally_core::window::WindowSet;

/// Distinct members the workload draws from.
pub(crate) const MEMBERS_MAX: u32 = 2_000;

/// One counter to create: name, role, spec patch and the authoritative amount it
/// never sees (reconciled counters).
pub(crate) type CounterPlan = (String, Role, SpecPatch, i128);

/// The counters of a run, their specs drawn from `rng`: three `sync` counters with
/// event routing (the first keeps a one-minute window, so its shards step window
/// buckets, carry them over reshardings and store them through every fault; tier 2
/// reads it after every fresh read), two batched ones, a distinct one (with a
/// one-minute window of totals and members too), a one-shard
/// counter for huge deltas and a reconciled batched one.
pub(crate) fn counter_plans(rng: &mut ChaCha8Rng) -> Vec<CounterPlan> {
    let mut infos = Vec::new();
    let shards = |rng: &mut ChaCha8Rng| rng.random_range(1..=8u16);
    let rollup = |rng: &mut ChaCha8Rng| rng.random_range(50..=300u32);
    for i in 0..3 {
        let p = SpecPatch {
            shards: Some(shards(rng)),
            durability: Some(Durability::Sync),
            rollup_ms: Some(rollup(rng)),
            router: Some(RouterPolicy::Event),
            windows: (i == 0).then(|| WindowSet::parse(&["1m"]).expect("a valid window")),
            ..SpecPatch::default()
        };
        infos.push((format!("sync:{i}"), Role::Sync, p, 0));
    }
    for i in 0..2 {
        let router = [RouterPolicy::Writer, RouterPolicy::RoundRobin, RouterPolicy::Random]
            [rng.random_range(0..3usize)];
        let p = SpecPatch {
            shards: Some(shards(rng)),
            durability: Some(Durability::Batched),
            flush_ms: Some(rng.random_range(10..=200)),
            rollup_ms: Some(rollup(rng)),
            router: Some(router),
            ..SpecPatch::default()
        };
        infos.push((format!("batched:{i}"), Role::Batched, p, 0));
    }
    let p = SpecPatch {
        shards: Some(shards(rng)),
        durability: Some(Durability::Sync),
        distinct: Some(true),
        rollup_ms: Some(rollup(rng)),
        windows: Some(WindowSet::parse(&["1m"]).expect("a valid window")),
        ..SpecPatch::default()
    };
    infos.push(("distinct:0".into(), Role::Distinct, p, 0));
    let p = SpecPatch {
        shards: Some(1),
        durability: Some(Durability::Sync),
        rollup_ms: Some(rollup(rng)),
        ..SpecPatch::default()
    };
    infos.push(("big:0".into(), Role::Big, p, 0));
    let p = SpecPatch {
        shards: Some(rng.random_range(1..=4)),
        durability: Some(Durability::Batched),
        flush_ms: Some(rng.random_range(10..=100)),
        rollup_ms: Some(rollup(rng)),
        ..SpecPatch::default()
    };
    let extra = rng.random_range(1..=1_000);
    infos.push(("recon:0".into(), Role::Recon, p, extra));
    infos
}

/// The counters of `role`, as indexes into `counters`.
pub(crate) fn counters_of(counters: &[CounterInfo], role: Role) -> Vec<usize> {
    (0..counters.len()).filter(|&i| counters[i].role == role).collect()
}

/// One operation a client chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Draw {
    /// An increment.
    Incr {
        /// Index of the counter.
        counter: usize,
        /// The delta.
        delta: i64,
        /// The distinct member, as a number.
        member: Option<u32>,
        /// Whether it carries an event id.
        with_id: bool,
    },
    /// A read of a random counter.
    Read(Consistency),
    /// A distinct estimate.
    Distinct,
}

/// Draws a client's next operation: 30 % `sync`, 25 % batched (half with event ids),
/// 8 % distinct members, 4 % huge deltas, 6 % reconciled counter, 10 % fresh reads,
/// 10 % cached reads, 7 % distinct estimates.
pub(crate) fn draw_op(rng: &mut ChaCha8Rng, counters: &[CounterInfo]) -> Draw {
    let roll = rng.random_range(0..100u32);
    let pick = |rng: &mut ChaCha8Rng, role| {
        let list = counters_of(counters, role);
        list[rng.random_range(0..list.len())]
    };
    match roll {
        0..30 => {
            let counter = pick(rng, Role::Sync);
            Draw::Incr { counter, delta: rng.random_range(1..=5), member: None, with_id: true }
        }
        30..55 => {
            let mut delta = rng.random_range(-3..=10);
            if delta == 0 {
                delta = 1;
            }
            let counter = pick(rng, Role::Batched);
            Draw::Incr { counter, delta, member: None, with_id: rng.random::<bool>() }
        }
        55..63 => {
            let counter = pick(rng, Role::Distinct);
            Draw::Incr { counter, delta: 1, member: Some(rng.random_range(0..MEMBERS_MAX)), with_id: true }
        }
        63..67 => {
            let magnitude = (1i64 << 61) + rng.random_range(0..1i64 << 40);
            let delta = if rng.random_range(0..10) < 7 { magnitude } else { -magnitude };
            Draw::Incr { counter: pick(rng, Role::Big), delta, member: None, with_id: true }
        }
        67..73 => {
            let counter = pick(rng, Role::Recon);
            Draw::Incr { counter, delta: rng.random_range(1..=5), member: None, with_id: true }
        }
        73..83 => Draw::Read(Consistency::Fresh),
        83..93 => Draw::Read(Consistency::Cached),
        _ => Draw::Distinct,
    }
}

/// The member string of member number `m`.
pub(crate) fn member_name(m: u32) -> String {
    format!("m-{m}")
}
