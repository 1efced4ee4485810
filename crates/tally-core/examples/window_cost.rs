//! What a windowed increment costs a shard over a plain one, in the core alone: the
//! plain path adds a delta to the shard's value; the windowed path also adds it to
//! the bucket of each window (`1m`, `1h`, `24h`), and with `distinct` the member to
//! each bucket's sketch. Clock steps of 1 ms per increment, so buckets roll over and
//! expire as they would under load.
//!
//! `cargo run --release -p tally-core --example window_cost`

use std::hint::black_box;
use std::time::Instant;
use tally_core::sketch::member_hash;
use tally_core::window::{parse_windows, WindowState};

/// Increments per measurement.
const INCREMENTS: u64 = 2_000_000;

fn per_increment_ns(f: &mut dyn FnMut(u64)) -> f64 {
    let start = Instant::now();
    for i in 0..INCREMENTS {
        f(i);
    }
    start.elapsed().as_nanos() as f64 / INCREMENTS as f64
}

/// Microseconds one `to_bytes` of `st` takes, over a few hundred encodings.
fn encode_us(st: &WindowState) -> f64 {
    const ROUNDS: u32 = 200;
    let start = Instant::now();
    for _ in 0..ROUNDS {
        black_box(st.to_bytes());
    }
    start.elapsed().as_secs_f64() * 1e6 / f64::from(ROUNDS)
}

/// Encoded bytes of a totals-only state driven like the measurement's.
fn st_bytes(windows: &[tally_core::window::Window], distinct: bool, t0: u64) -> usize {
    let mut st = WindowState::new(windows, distinct);
    for i in 0..INCREMENTS {
        st.add(t0 + i, 1, &[]);
    }
    st.to_bytes().len()
}

fn main() {
    let windows = parse_windows(&["1m", "1h", "24h"]).expect("valid windows");
    let t0 = 1_764_450_000_000u64;
    let members: Vec<u64> = (0..4096).map(|i| member_hash(&format!("user-{i}"))).collect();

    let mut value = 0i64;
    let plain = per_increment_ns(&mut |i| value = black_box(value.wrapping_add(black_box(i as i64 & 7) + 1)));

    let mut st = WindowState::new(&windows, false);
    let windowed = per_increment_ns(&mut |i| st.add(t0 + i, 1, &[]));
    let total_bytes = st.size_bytes();
    let total_encode = encode_us(&st);

    let mut st = WindowState::new(&windows, true);
    let distinct = per_increment_ns(&mut |i| st.add(t0 + i, 1, &[members[(i % 4096) as usize]]));
    let distinct_bytes = st.size_bytes();
    let distinct_encode = encode_us(&st);

    println!("increments per run: {INCREMENTS}, windows 1m 1h 24h");
    println!("plain add:                        {plain:>8.1} ns/increment");
    println!(
        "windowed total:                   {windowed:>8.1} ns/increment ({total_bytes} B of window state)"
    );
    println!(
        "windowed total + distinct member: {distinct:>8.1} ns/increment ({distinct_bytes} B of window state)"
    );
    // A shard commit that changed the buckets writes them whole: once per commit (a
    // batch of increments), not once per increment.
    println!(
        "encoding the buckets for a commit:  {total_encode:>8.1} µs (totals, {} B), {distinct_encode:.1} µs (with distinct, {} B)",
        st_bytes(&windows, false, t0),
        st.to_bytes().len()
    );
    println!(
        "bound per shard: {} B (totals), {} B (with distinct)",
        WindowState::bound_bytes(3, false),
        WindowState::bound_bytes(3, true)
    );
    black_box(value);
}
