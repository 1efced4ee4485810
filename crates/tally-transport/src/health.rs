//! The failure detector, as a pure state machine.
//!
//! ractor_cluster keeps a TCP session "up" for as long as the kernel does, so a paused or
//! partitioned peer looks alive forever. The transport pings every peer's gateway once per
//! heartbeat and feeds each outcome to [`on_ping_result`], which says what the peer's state
//! is now and what the runtime must do about it. No clock, no I/O: the caller passes `now_ms`
//! and executes the returned [`HealthAction`], so every transition is unit-tested below.

/// What this node believes about one peer. The data plane routes only to `Up` peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PeerState {
    /// The last ping was answered by a peer with our cluster-config fingerprint.
    Up,
    /// At least one ping in a row went unanswered, but fewer than the configured maximum:
    /// calls are still attempted (with their timeout), new placement should avoid the peer.
    Suspect,
    /// No session, a refused fingerprint, or too many missed pings: calls fail fast.
    Down,
}

impl PeerState {
    /// Lower-case name for logs and JSON (`up`, `suspect`, `down`).
    pub fn as_str(self) -> &'static str {
        match self {
            PeerState::Up => "up",
            PeerState::Suspect => "suspect",
            PeerState::Down => "down",
        }
    }
}

/// What one heartbeat round against one peer produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PingOutcome {
    /// The peer answered in time, with our fingerprint.
    Answered,
    /// A session exists but the ping was not answered before its deadline (or the answer
    /// was unusable): the peer may be paused, partitioned or overloaded.
    Missed,
    /// There is no authenticated session (or the peer's gateway is not visible yet).
    NoRoute,
    /// The peer answered with a different cluster-config fingerprint (`theirs`).
    Refused {
        /// The fingerprint the peer reported.
        theirs: u64,
    },
}

/// Per-peer detector state. `Copy` so a transition is a pure value-to-value function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerHealth {
    /// The state the data plane sees.
    pub state: PeerState,
    /// Consecutive missed pings; reset by an answer, a teardown or a lost route.
    pub misses: u32,
    /// When (caller's clock, ms) the peer last answered a ping; `None` if never.
    pub last_seen_ms: Option<u64>,
    /// The peer's fingerprint if its last answer refused ours; cleared by a good answer.
    pub refused_fingerprint: Option<u64>,
}

impl PeerHealth {
    /// A peer we have not heard from: `Down` until the first answered ping.
    pub const fn new() -> Self {
        PeerHealth { state: PeerState::Down, misses: 0, last_seen_ms: None, refused_fingerprint: None }
    }
}

impl Default for PeerHealth {
    fn default() -> Self {
        Self::new()
    }
}

/// A ping went over a different session than the previous one (a reconnect happened): the
/// new session gets a full `misses_max` before it is torn down, whatever the old one missed.
pub fn on_new_session(health: PeerHealth) -> PeerHealth {
    PeerHealth { misses: 0, ..health }
}

/// What the runtime must do after a transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthAction {
    /// Nothing changed that anyone needs to hear about.
    Nothing,
    /// The state changed: publish it to subscribers.
    Publish,
    /// Stop every ractor_cluster session to the peer (so the connector dials a fresh one and
    /// stale remote actor ids die with it), then publish. Issued on the `misses_max`-th
    /// consecutive miss and on a refused fingerprint.
    TearDown,
}

/// Advances one peer's detector by one ping outcome observed at `now_ms`.
///
/// Rules:
/// - an answer makes the peer `Up` and clears misses and any refusal;
/// - a miss makes an `Up` peer `Suspect`; the `misses_max`-th consecutive miss makes it `Down`
///   and tears its sessions down (also from `Down`: a session that comes back but never
///   answers is torn down again every `misses_max` misses);
/// - a lost route makes the peer `Down` at once (the session is already gone, nothing to
///   tear down — and tearing down here could kill a reconnect in progress);
/// - a refused fingerprint makes the peer `Down` and tears its sessions down.
///
/// `misses_max` of 0 is treated as 1.
pub fn on_ping_result(
    health: PeerHealth,
    outcome: PingOutcome,
    now_ms: u64,
    misses_max: u32,
) -> (PeerHealth, HealthAction) {
    let misses_max = misses_max.max(1);
    let mut next = health;
    let action = match outcome {
        PingOutcome::Answered => {
            next.state = PeerState::Up;
            next.misses = 0;
            next.last_seen_ms = Some(now_ms);
            next.refused_fingerprint = None;
            changed(health, next)
        }
        PingOutcome::Missed => {
            next.misses = health.misses.saturating_add(1);
            if next.misses >= misses_max {
                next.state = PeerState::Down;
                next.misses = 0;
                HealthAction::TearDown
            } else {
                if health.state == PeerState::Up {
                    next.state = PeerState::Suspect;
                }
                changed(health, next)
            }
        }
        PingOutcome::NoRoute => {
            next.state = PeerState::Down;
            next.misses = 0;
            changed(health, next)
        }
        PingOutcome::Refused { theirs } => {
            next.state = PeerState::Down;
            next.misses = 0;
            next.refused_fingerprint = Some(theirs);
            HealthAction::TearDown
        }
    };
    (next, action)
}

fn changed(before: PeerHealth, after: PeerHealth) -> HealthAction {
    if before.state != after.state || before.refused_fingerprint != after.refused_fingerprint {
        HealthAction::Publish
    } else {
        HealthAction::Nothing
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use HealthAction::*;
    use PeerState::*;
    use PingOutcome::*;

    const MAX: u32 = 3;

    fn run(start: PeerHealth, outcomes: &[PingOutcome]) -> Vec<(PeerState, u32, HealthAction)> {
        let mut h = start;
        let mut out = Vec::new();
        for (i, o) in outcomes.iter().enumerate() {
            let (next, action) = on_ping_result(h, *o, 1000 + i as u64, MAX);
            out.push((next.state, next.misses, action));
            h = next;
        }
        out
    }

    #[test]
    fn starts_down_and_comes_up_on_first_answer() {
        let h = PeerHealth::new();
        assert_eq!(h.state, Down);
        let (next, action) = on_ping_result(h, Answered, 42, MAX);
        assert_eq!((next.state, next.last_seen_ms, action), (Up, Some(42), Publish));
        let (again, action) = on_ping_result(next, Answered, 43, MAX);
        assert_eq!((again.state, again.last_seen_ms, action), (Up, Some(43), Nothing));
    }

    #[test]
    fn misses_go_suspect_then_down_with_teardown_on_the_max_th() {
        let (up, _) = on_ping_result(PeerHealth::new(), Answered, 0, MAX);
        assert_eq!(
            run(up, &[Missed, Missed, Missed]),
            vec![(Suspect, 1, Publish), (Suspect, 2, Nothing), (Down, 0, TearDown)]
        );
    }

    #[test]
    fn an_answer_clears_suspicion() {
        let (up, _) = on_ping_result(PeerHealth::new(), Answered, 0, MAX);
        assert_eq!(
            run(up, &[Missed, Missed, Answered, Missed, Missed]),
            vec![
                (Suspect, 1, Publish),
                (Suspect, 2, Nothing),
                (Up, 0, Publish),
                (Suspect, 1, Publish),
                (Suspect, 2, Nothing)
            ]
        );
    }

    #[test]
    fn a_down_peer_with_a_mute_session_is_torn_down_again_every_max_misses() {
        assert_eq!(
            run(PeerHealth::new(), &[Missed, Missed, Missed, Missed, Missed, Missed]),
            vec![
                (Down, 1, Nothing),
                (Down, 2, Nothing),
                (Down, 0, TearDown),
                (Down, 1, Nothing),
                (Down, 2, Nothing),
                (Down, 0, TearDown)
            ]
        );
    }

    #[test]
    fn losing_the_route_is_down_at_once_without_teardown() {
        let (up, _) = on_ping_result(PeerHealth::new(), Answered, 0, MAX);
        assert_eq!(run(up, &[NoRoute, NoRoute]), vec![(Down, 0, Publish), (Down, 0, Nothing)]);
        let (suspect, _) = on_ping_result(up, Missed, 1, MAX);
        assert_eq!(run(suspect, &[NoRoute]), vec![(Down, 0, Publish)]);
    }

    #[test]
    fn a_refused_fingerprint_is_down_with_teardown_until_a_good_answer() {
        let (up, _) = on_ping_result(PeerHealth::new(), Answered, 0, MAX);
        let (refused, action) = on_ping_result(up, Refused { theirs: 7 }, 1, MAX);
        assert_eq!((refused.state, refused.refused_fingerprint, action), (Down, Some(7), TearDown));
        let (refused_again, action) = on_ping_result(refused, Refused { theirs: 7 }, 2, MAX);
        assert_eq!((refused_again.state, action), (Down, TearDown));
        let (fixed, action) = on_ping_result(refused_again, Answered, 3, MAX);
        assert_eq!((fixed.state, fixed.refused_fingerprint, action), (Up, None, Publish));
    }

    #[test]
    fn last_seen_only_moves_on_answers() {
        let (up, _) = on_ping_result(PeerHealth::new(), Answered, 10, MAX);
        let (s, _) = on_ping_result(up, Missed, 20, MAX);
        let (d, _) = on_ping_result(s, NoRoute, 30, MAX);
        assert_eq!(d.last_seen_ms, Some(10));
    }

    #[test]
    fn a_new_session_gets_a_full_set_of_misses() {
        let (h, _) = on_ping_result(PeerHealth::new(), Missed, 0, MAX);
        let (h, _) = on_ping_result(h, Missed, 1, MAX);
        assert_eq!(h.misses, 2);
        let h = on_new_session(h);
        assert_eq!(
            run(h, &[Missed, Missed, Missed]),
            vec![(Down, 1, Nothing), (Down, 2, Nothing), (Down, 0, TearDown)]
        );
    }

    #[test]
    fn zero_misses_max_behaves_as_one() {
        let (up, _) = on_ping_result(PeerHealth::new(), Answered, 0, 0);
        let (next, action) = on_ping_result(up, Missed, 1, 0);
        assert_eq!((next.state, action), (Down, TearDown));
    }
}
