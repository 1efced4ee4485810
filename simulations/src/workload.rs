//! The workload both tiers run: the counters a run creates and the mix of operations
//! a client draws, each from the run's RNG in a fixed order.

use crate::history::{CounterInfo, Role};
use crate::msg::Consistency;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use tally_core::spec::{CounterSpec, Durability, RouterPolicy, SpecPatch, WindowLimit};
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

/// Tier 2's bounded counters, drawn from `rng` after [`counter_plans`] (so tier 1,
/// which has no escrow to enforce them, draws the same as before): `stock:0` with
/// `min: 0`, supplied early and then mostly drawn down until its supply runs out
/// ([`draw_engine_op`]), with a one-minute window in half the runs; and `quota:0`
/// with a small `max`, fed increments until it fills. Both are `sync` with 2–8
/// shards, so a shard short of headroom borrows from the others; their shard counts
/// never change (bounds fix them). Then `rate:0`, limited to a small `max` per
/// minute (a rate limiter), fed like `quota:0`; a run is shorter than its window, so
/// what the simulation puts to the test is the limit's spending and borrowing under
/// faults, not its buckets' expiry.
pub(crate) fn bounded_plans(rng: &mut ChaCha8Rng) -> Vec<CounterPlan> {
    let plan = |rng: &mut ChaCha8Rng, min: Option<i64>, max: Option<i64>, windowed: bool| SpecPatch {
        shards: Some(rng.random_range(2..=8u16)),
        durability: Some(Durability::Sync),
        rollup_ms: Some(rng.random_range(50..=300u32)),
        router: Some([RouterPolicy::Event, RouterPolicy::Random][rng.random_range(0..2usize)]),
        windows: windowed.then(|| WindowSet::parse(&["1m"]).expect("a valid window")),
        min,
        max,
        ..SpecPatch::default()
    };
    let windowed = rng.random::<bool>();
    let stock = plan(rng, Some(0), None, windowed);
    let quota_max = rng.random_range(QUOTA_MAX_RANGE);
    let quota = plan(rng, None, Some(quota_max), false);
    let rate_max = rng.random_range(RATE_MAX_RANGE);
    let limit = WindowLimit::parse("1m", rate_max).expect("a valid limit");
    let rate = SpecPatch { limit: Some(limit), ..plan(rng, None, None, true) };
    vec![
        ("stock:0".into(), Role::Bounded, stock, 0),
        ("quota:0".into(), Role::Bounded, quota, 0),
        ("rate:0".into(), Role::Bounded, rate, 0),
    ]
}

/// `short:0`, added to a tier-2 run with short dedup windows: a `sync` counter
/// with event routing and 1–4 shards whose dedup window is
/// [`crate::config::SHORT_DEDUP_WINDOW_S`], so its records expire within the run,
/// shards sweep them, and a resharding's sealed generations are pruned of them
/// (`PruneSealed`). Clients retry its increments only within half the window.
pub(crate) fn short_dedup_plan(rng: &mut ChaCha8Rng) -> CounterPlan {
    let p = SpecPatch {
        shards: Some(rng.random_range(1..=4u16)),
        durability: Some(Durability::Sync),
        rollup_ms: Some(rng.random_range(50..=300u32)),
        router: Some(RouterPolicy::Event),
        dedup_window_s: Some(crate::config::SHORT_DEDUP_WINDOW_S),
        ..SpecPatch::default()
    };
    ("short:0".into(), Role::Sync, p, 0)
}

/// The range `rate:0`'s limit per minute is drawn from.
const RATE_MAX_RANGE: std::ops::RangeInclusive<u64> = 40..=150;
/// Largest increment of `rate:0`.
const RATE_STEP_MAX: i64 = 10;
/// Share of operations (percent) on `rate:0`.
const RATE_PERCENT: u32 = 4;

/// The range `quota:0`'s `max` is drawn from.
const QUOTA_MAX_RANGE: std::ops::RangeInclusive<i64> = 50..=200;
/// Largest increment of `quota:0`.
const QUOTA_STEP_MAX: i64 = 30;
/// The first part of the chaos phase, in tenths, in which `stock:0` is supplied.
const SUPPLY_TENTHS: u64 = 1;
/// Share of operations (percent) that supply `stock:0` while it is supplied.
const SUPPLY_PERCENT: u32 = 20;
/// One supply of `stock:0`.
const SUPPLY_STEP: std::ops::RangeInclusive<i64> = 2..=6;
/// Share of operations (percent) on `stock:0` after its supply, and on `quota:0`.
const STOCK_PERCENT: u32 = 12;
/// See [`STOCK_PERCENT`].
const QUOTA_PERCENT: u32 = 4;
/// Of `stock:0`'s operations after its supply, the share (tenths) that restock it
/// by 1–5; the others take 1–3 out.
const RESTOCK_TENTHS: u32 = 1;

/// Draws a tier-2 client's next operation at `now_ms` of a chaos phase of
/// `chaos_ms`: with bounded counters in the plan, 20 % of the operations of the
/// phase's first tenth supply `stock:0` (+2–6); afterwards 12 % go to `stock:0`
/// (nine in ten take 1–3 out, one in ten restocks 1–5: the supply runs out during the
/// run, and the counter then hovers at its bound, its shards borrowing headroom from
/// each other), 4 % to `quota:0` (+1–30) and 4 % to `rate:0` (+1–10). The rest is [`draw_op`]'s mix. Every
/// increment of a bounded counter carries an event id.
pub(crate) fn draw_engine_op(
    rng: &mut ChaCha8Rng,
    counters: &[CounterInfo],
    now_ms: u64,
    chaos_ms: u64,
) -> Draw {
    let bounded = counters_of(counters, Role::Bounded);
    let find = |f: fn(&CounterSpec) -> bool| bounded.iter().copied().find(|&c| f(&counters[c].spec));
    let (Some(stock), Some(quota), Some(rate)) =
        (find(|s| s.min.is_some()), find(|s| s.max.is_some()), find(|s| s.limit.is_some()))
    else {
        return draw_op(rng, counters);
    };
    let roll = rng.random_range(0..100u32);
    let incr = |counter, delta| Draw::Incr { counter, delta, member: None, with_id: true };
    if now_ms < chaos_ms * SUPPLY_TENTHS / 10 {
        if roll < SUPPLY_PERCENT {
            return incr(stock, rng.random_range(SUPPLY_STEP));
        }
    } else if roll < STOCK_PERCENT {
        let delta = if rng.random_range(0..10) < RESTOCK_TENTHS {
            rng.random_range(1..=5)
        } else {
            -rng.random_range(1..=3)
        };
        return incr(stock, delta);
    } else if roll < STOCK_PERCENT + QUOTA_PERCENT {
        return incr(quota, rng.random_range(1..=QUOTA_STEP_MAX));
    } else if roll < STOCK_PERCENT + QUOTA_PERCENT + RATE_PERCENT {
        return incr(rate, rng.random_range(1..=RATE_STEP_MAX));
    }
    draw_op(rng, counters)
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
