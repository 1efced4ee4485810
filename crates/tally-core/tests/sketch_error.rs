//! Distinct-count accuracy across shard layouts (DESIGN invariant 7: "a distinct
//! estimate stays within the HyperLogLog's stated error whatever the number of
//! shards").
//!
//! Members are spread over 1, 8 and 64 shards by a routing hash independent of the
//! member hash, each shard keeps its own sketch, and the read merges them. Because
//! the register-wise merge loses nothing, the merged sketch must be *identical* to one
//! sketch of all members, and its estimate within three standard errors (≈ 2.4 %) of
//! the truth. Re-inserting members — on the same shard or on another — must change
//! nothing. Observed errors are printed (`cargo test -- --nocapture`).

use tally_core::hash::{hash64, reduce, ROUTE_SEED};
use tally_core::sketch::{member_hash, DistinctSketch};

/// Shard layouts every size is checked under.
const SHARD_COUNTS: [u64; 3] = [1, 8, 64];

/// Accepted distance from the truth, in standard errors.
const ERROR_BOUND_SIGMAS: f64 = 3.0;

/// One distinct member: its sketch hash and the hash that routes it to a shard.
struct Member {
    sketch_hash: u64,
    route_hash: u64,
}

fn members(prefix: &str, n: u64) -> Vec<Member> {
    let mut name = String::new();
    (0..n)
        .map(|i| {
            name.clear();
            name.push_str(prefix);
            name.push_str(&i.to_string());
            Member { sketch_hash: member_hash(&name), route_hash: hash64(ROUTE_SEED, name.as_bytes()) }
        })
        .collect()
}

fn relative_error(estimate: u64, truth: u64) -> f64 {
    (estimate as f64 - truth as f64) / truth as f64
}

/// Builds the per-shard sketches for `members` over `shards` shards, re-inserts every
/// third member (once on its own shard, once on the next), merges, and checks the
/// result against `whole`, the single-sketch reference.
fn check_layout(members: &[Member], shards: u64, whole: &DistinctSketch) -> f64 {
    let mut sketches = vec![DistinctSketch::new(); shards as usize];
    for m in members {
        sketches[reduce(m.route_hash, shards) as usize].insert_hash(m.sketch_hash);
    }
    for m in members.iter().step_by(3) {
        let home = reduce(m.route_hash, shards) as usize;
        assert!(!sketches[home].insert_hash(m.sketch_hash), "a repeat changed its own shard");
        sketches[(home + 1) % shards as usize].insert_hash(m.sketch_hash);
    }
    let mut merged = DistinctSketch::new();
    for s in &sketches {
        merged.merge(s);
    }
    assert_eq!(&merged, whole, "{shards} shards: merged sketch differs from the whole");
    let n = members.len() as u64;
    let e = merged.estimate();
    let err = relative_error(e, n);
    println!("n={n:>9} shards={shards:>2}: estimate {e:>9}, error {:+.3}%", err * 100.0);
    err
}

fn check_size(n: u64) {
    let members = members("member-", n);
    let mut whole = DistinctSketch::new();
    for m in &members {
        whole.insert_hash(m.sketch_hash);
    }
    let bound = ERROR_BOUND_SIGMAS * DistinctSketch::relative_error();
    for shards in SHARD_COUNTS {
        let err = check_layout(&members, shards, &whole);
        assert!(err.abs() <= bound, "n={n} shards={shards}: error {err} beyond {bound}");
    }
    let back = DistinctSketch::from_bytes(&whole.to_bytes()).unwrap();
    assert_eq!(back.estimate(), whole.estimate());
}

#[test]
fn error_within_bound_at_1k_members() {
    check_size(1_000);
}

#[test]
fn error_within_bound_at_100k_members() {
    check_size(100_000);
}

#[test]
fn error_within_bound_at_1m_members() {
    check_size(1_000_000);
}

/// One sample per size says little about bias. Twenty independent member sets at
/// each of several sizes in the dense range (from just past the sparse limit, where the
/// estimator's empty-register correction matters most, to well beyond it): their mean
/// error must be near zero and their spread near the stated standard error.
#[test]
fn estimator_is_unbiased_and_its_spread_matches_the_stated_error() {
    const TRIALS: u64 = 20;
    let sigma = DistinctSketch::relative_error();
    for n in [5_000u64, 12_000, 50_000] {
        let errors: Vec<f64> = (0..TRIALS)
            .map(|t| {
                let mut s = DistinctSketch::new();
                for m in members(&format!("trial{t}-"), n) {
                    s.insert_hash(m.sketch_hash);
                }
                relative_error(s.estimate(), n)
            })
            .collect();
        let mean = errors.iter().sum::<f64>() / TRIALS as f64;
        let rms = (errors.iter().map(|e| e * e).sum::<f64>() / TRIALS as f64).sqrt();
        println!(
            "{TRIALS} trials of {n}: mean error {:+.3}%, rms {:.3}% (stated {:.3}%)",
            mean * 100.0,
            rms * 100.0,
            sigma * 100.0
        );
        // The mean of 20 errors has standard deviation sigma / sqrt(20) ≈ 0.18 %.
        assert!(mean.abs() < 3.0 * sigma / (TRIALS as f64).sqrt(), "n={n} biased: mean {mean}");
        assert!(rms < 1.6 * sigma, "n={n}: spread {rms} well above the stated {sigma}");
    }
}
