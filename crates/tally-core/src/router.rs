//! Which shard an increment goes to.
//!
//! Increments that carry an event id always route by that id, whatever the counter's
//! policy, so a retry lands on the shard that remembers the first attempt. The other
//! policies only spread anonymous increments.

use crate::hash::{hash64, reduce, ROUTE_SEED};
use crate::spec::RouterPolicy;

/// What the router may look at. Everything nondeterministic (`sequence`, `random`,
/// `affinity`) is supplied by the caller, so a simulation can replay a route.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteKey<'a> {
    /// The increment's event id, if any.
    pub event_id: Option<&'a str>,
    /// The writer id the client sent, if any.
    pub writer: Option<&'a str>,
    /// A stable token for the calling thread or connection, used by the `writer`
    /// policy when the client sent no writer id (so one thread keeps to one shard).
    pub affinity: u64,
    /// A per-counter sequence number, for `round_robin`.
    pub sequence: u64,
    /// A uniformly random number, for `random`.
    pub random: u64,
}

/// The shard (`0..shards`) of an increment carrying `event_id` in a layout of `shards`.
pub fn shard_of_event(event_id: &str, shards: u16) -> u16 {
    index(hash64(ROUTE_SEED, event_id.as_bytes()), shards)
}

/// The shard of a writer id in a layout of `shards`.
pub fn shard_of_writer(writer: &str, shards: u16) -> u16 {
    index(hash64(ROUTE_SEED, writer.as_bytes()), shards)
}

fn index(hash: u64, shards: u16) -> u16 {
    assert!(shards > 0, "a layout has at least one shard");
    reduce(hash, u64::from(shards)) as u16
}

/// Routes one increment to a shard index in `0..shards`.
pub fn route(policy: RouterPolicy, shards: u16, key: &RouteKey<'_>) -> u16 {
    if let Some(id) = key.event_id {
        return shard_of_event(id, shards);
    }
    match policy {
        RouterPolicy::Event | RouterPolicy::Writer => match key.writer {
            Some(w) => shard_of_writer(w, shards),
            None => index(key.affinity, shards),
        },
        RouterPolicy::RoundRobin => (key.sequence % u64::from(shards)) as u16,
        RouterPolicy::Random => index(key.random, shards),
    }
}

/// Routes one increment of a counter that counts distinct members (`member`: its
/// member's hash, for increments that carry one). An increment with a member and no
/// event id goes to the shard that owns the member's registers
/// ([`crate::sketch::shard_of_member`]), whatever the policy: member hashes are
/// uniform, so writes still spread over every shard, and each shard's sketch holds
/// only its slice of the registers, so the shards together cost about one sketch.
/// Event ids still win (a retry must find the shard that remembers it), and the rest
/// follow the policy.
pub fn route_with_member(policy: RouterPolicy, shards: u16, key: &RouteKey<'_>, member: Option<u64>) -> u16 {
    match member {
        Some(hash) if key.event_id.is_none() => crate::sketch::shard_of_member(hash, shards),
        _ => route(policy, shards, key),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key<'a>(event: Option<&'a str>, writer: Option<&'a str>) -> RouteKey<'a> {
        RouteKey { event_id: event, writer, affinity: 99, sequence: 0, random: 0 }
    }

    #[test]
    fn event_id_wins_over_every_policy() {
        let want = shard_of_event("e-1", 64);
        for p in [RouterPolicy::Event, RouterPolicy::Writer, RouterPolicy::RoundRobin, RouterPolicy::Random] {
            let mut k = key(Some("e-1"), Some("w-7"));
            k.sequence = 5;
            k.random = u64::MAX;
            assert_eq!(route(p, 64, &k), want, "{p:?}");
        }
    }

    #[test]
    fn writer_policy_is_sticky_per_writer_and_spreads_writers() {
        let a = route(RouterPolicy::Writer, 16, &key(None, Some("w-1")));
        for _ in 0..10 {
            assert_eq!(route(RouterPolicy::Writer, 16, &key(None, Some("w-1"))), a);
        }
        let used: std::collections::BTreeSet<u16> =
            (0..200).map(|i| route(RouterPolicy::Writer, 16, &key(None, Some(&format!("w-{i}"))))).collect();
        assert_eq!(used.len(), 16, "200 writers should reach all 16 shards");
        // Without a writer id, the caller's affinity token decides.
        let k = RouteKey { affinity: u64::MAX, ..Default::default() };
        assert_eq!(route(RouterPolicy::Writer, 16, &k), 15);
    }

    #[test]
    fn round_robin_cycles_and_random_is_uniform() {
        let seq: Vec<u16> = (0..6)
            .map(|s| route(RouterPolicy::RoundRobin, 3, &RouteKey { sequence: s, ..Default::default() }))
            .collect();
        assert_eq!(seq, [0, 1, 2, 0, 1, 2]);
        let mut hits = [0u32; 8];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..80_000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            hits[route(RouterPolicy::Random, 8, &RouteKey { random: x, ..Default::default() }) as usize] += 1;
        }
        for h in hits {
            assert!((9_000..11_000).contains(&h), "{hits:?}");
        }
    }

    #[test]
    fn event_routes_are_balanced_and_pinned() {
        let mut hits = [0u32; 64];
        for i in 0..64_000 {
            hits[shard_of_event(&format!("e-{i}"), 64) as usize] += 1;
        }
        assert!(hits.iter().all(|&h| (800..1200).contains(&h)), "{hits:?}");
        // Routes are part of the storage format: a changed route strands dedup records.
        assert_eq!(shard_of_event("e-1", 1), 0);
        assert_eq!(shard_of_event("e-1", 1024), shard_of_event("e-1", 1024));
    }

    #[test]
    fn members_route_to_the_owner_of_their_registers_unless_an_event_id_says_otherwise() {
        let h = crate::sketch::member_hash("user-7");
        for p in [RouterPolicy::Event, RouterPolicy::Writer, RouterPolicy::RoundRobin, RouterPolicy::Random] {
            let k = key(None, Some("w-1"));
            assert_eq!(route_with_member(p, 64, &k, Some(h)), crate::sketch::shard_of_member(h, 64), "{p:?}");
            assert_eq!(route_with_member(p, 64, &k, None), route(p, 64, &k), "{p:?}");
            let k = key(Some("e-1"), None);
            assert_eq!(route_with_member(p, 64, &k, Some(h)), shard_of_event("e-1", 64), "{p:?}");
        }
        // Members spread evenly over the shards.
        let mut hits = [0u32; 8];
        for i in 0..8_000 {
            let h = crate::sketch::member_hash(&format!("m{i}"));
            hits[route_with_member(RouterPolicy::Writer, 8, &key(None, Some("w")), Some(h)) as usize] += 1;
        }
        assert!(hits.iter().all(|&n| (800..1_200).contains(&n)), "{hits:?}");
    }
}
