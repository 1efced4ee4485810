//! Who may call a node's raft endpoints.
//!
//! The raft endpoints can append entries, grant votes, install snapshots and take
//! forwarded writes (create, delete, membership): whoever reaches a node's raft
//! address must be a node of the cluster.
//!
//! * **Under TLS** the caller's certificate proves it: the listener's handshake
//!   lets in only a certificate of the cluster CA that names a node of the cluster
//!   (`tally_tls::ClusterTls`), and [`crate::server::serve`] hands each request the
//!   node it names ([`PeerNode`]). TLS keeps the exchange from being read or
//!   replayed; calls carry no proof of the secret.
//! * **In plaintext** (loopback, or `node.insecure_plaintext`) every RPC carries
//!   [`AUTH_HEADER`]: a proof of `cluster.secret` bound to that one request — an
//!   HMAC-SHA-256, under a key derived from the secret, of the time it was sent, a
//!   nonce, its path and the SHA-256 of its body. The server refuses with 401 and
//!   audits (on [`AUDIT_TARGET`], with the path and the peer) a request without a
//!   proof or with a malformed one before reading its body, one sent more than
//!   [`PROOF_WINDOW_MS`] from its own clock, one whose (time, nonce) it has seen
//!   (it remembers every proof within the window: a replay), and one whose MAC does
//!   not match its secret, path and body (compared in constant time). So a request
//!   seen on the wire can be neither sent again nor altered, and the secret the
//!   node-to-node handshake uses is not revealed. What plaintext still gives an
//!   observer: the content of the metadata it sees. Nodes' clocks must agree within
//!   the window.

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use subtle::ConstantTimeEq;
use tally_tls::refusals::{self, Listener, Reason};

/// The header every plaintext raft RPC carries its proof in.
pub const AUTH_HEADER: &str = "tally-raft-auth";
/// The tracing target refusals are logged on: the server's audit trail
/// (`tally_server::auth::AUDIT_TARGET`).
pub const AUDIT_TARGET: &str = refusals::AUDIT_TARGET;
/// How far a proof's time may be from the receiver's clock, either way, in
/// milliseconds: longer than any RPC takes to arrive, and the most two nodes'
/// clocks may disagree.
pub const PROOF_WINDOW_MS: u64 = 60_000;
/// Most proofs a node remembers to refuse their replay: far more than the raft
/// RPCs of a window. When full, the oldest is forgotten and every proof as old or
/// older is refused from then on.
pub const PROOFS_REMEMBERED_MAX: usize = 1 << 17;
/// Largest body read to check its proof, in bytes (the raft router's own limit).
pub const PROVEN_BODY_BYTES_MAX: usize = crate::types::RAFT_BODY_BYTES_MAX;
/// What the secret is hashed behind, so the key is of no use anywhere else.
const DOMAIN: &[u8] = b"tally raft rpc v2\0";
/// The version word that opens a proof.
const PROOF_VERSION: &str = "v2";

/// One cluster secret as raft RPCs prove it: the key that signs requests, and the
/// proofs seen within the window.
pub struct RaftSecret {
    key: [u8; 32],
    /// Random per process, so two processes never draw the same nonce.
    nonce_seed: u64,
    nonce_next: AtomicU64,
    seen: Mutex<Seen>,
}

/// The proofs seen within the window, by (time, nonce).
#[derive(Default)]
struct Seen {
    proofs: BTreeSet<(u64, [u8; 16])>,
    /// Proofs at or before this time are refused (the oldest forgotten one's).
    floor_ms: u64,
}

/// A copy signs with the same key and nonces of its own, and remembers the proofs
/// it checks itself (a node shares one between its client and its listener).
impl Clone for RaftSecret {
    fn clone(&self) -> Self {
        Self {
            key: self.key,
            nonce_seed: tally_raft_kit::random_u64(),
            nonce_next: AtomicU64::new(0),
            seen: Mutex::default(),
        }
    }
}

impl std::fmt::Debug for RaftSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RaftSecret(..)")
    }
}

/// Why an RPC was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It carried no proof.
    Missing,
    /// Its proof is malformed, or not of this secret, path and body.
    Wrong,
    /// Its proof was seen before, or is older or newer than the window.
    Replayed,
}

/// A proof as it travels: `v2 TIME_MS NONCE_HEX MAC_HEX`.
struct Proof {
    time_ms: u64,
    nonce: [u8; 16],
    mac: [u8; 32],
}

impl Proof {
    fn parse(value: &HeaderValue) -> Option<Self> {
        let text = value.to_str().ok()?;
        let mut words = text.split(' ');
        if words.next()? != PROOF_VERSION {
            return None;
        }
        let time_ms = words.next()?.parse().ok()?;
        let mut nonce = [0u8; 16];
        hex::decode_to_slice(words.next()?, &mut nonce).ok()?;
        let mut mac = [0u8; 32];
        hex::decode_to_slice(words.next()?, &mut mac).ok()?;
        words.next().is_none().then_some(Self { time_ms, nonce, mac })
    }
}

/// HMAC-SHA-256 (RFC 2104) of `parts`, one after another, under `key`.
fn hmac(key: &[u8; 32], parts: &[&[u8]]) -> [u8; 32] {
    let (mut inner_pad, mut outer_pad) = ([0x36u8; 64], [0x5cu8; 64]);
    for (i, k) in key.iter().enumerate() {
        inner_pad[i] ^= k;
        outer_pad[i] ^= k;
    }
    let mut inner = Sha256::new();
    inner.update(inner_pad);
    for part in parts {
        inner.update(part);
    }
    let mut outer = Sha256::new();
    outer.update(outer_pad);
    outer.update(inner.finalize());
    outer.finalize().into()
}

impl RaftSecret {
    /// The key of `secret` (the cluster's `cluster.secret`).
    pub fn new(secret: &str) -> Self {
        let mut hash = Sha256::new();
        hash.update(DOMAIN);
        hash.update(secret.as_bytes());
        let nonce_seed = tally_raft_kit::random_u64();
        Self {
            key: hash.finalize().into(),
            nonce_seed,
            nonce_next: AtomicU64::new(0),
            seen: Mutex::default(),
        }
    }

    fn mac(&self, time_ms: u64, nonce: &[u8; 16], path: &str, body: &[u8]) -> [u8; 32] {
        let digest: [u8; 32] = Sha256::digest(body).into();
        let time = time_ms.to_be_bytes();
        hmac(&self.key, &[&time, nonce, path.as_bytes(), b"\0", &digest])
    }

    /// The proof a request to `path` with `body`, sent at `now_ms` (Unix time),
    /// carries in [`AUTH_HEADER`].
    pub fn sign(&self, path: &str, body: &[u8], now_ms: u64) -> HeaderValue {
        let mut nonce = [0u8; 16];
        nonce[..8].copy_from_slice(&self.nonce_seed.to_be_bytes());
        nonce[8..].copy_from_slice(&self.nonce_next.fetch_add(1, Ordering::Relaxed).to_be_bytes());
        let mac = self.mac(now_ms, &nonce, path, body);
        let text = format!("{PROOF_VERSION} {now_ms} {} {}", hex::encode(nonce), hex::encode(mac));
        HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The first checks of `got`, before the body is read: present, well formed,
    /// within the window of `now_ms`, not seen.
    fn precheck(&self, got: Option<&HeaderValue>, now_ms: u64) -> Result<Proof, Refusal> {
        let proof = Proof::parse(got.ok_or(Refusal::Missing)?).ok_or(Refusal::Wrong)?;
        if proof.time_ms.abs_diff(now_ms) > PROOF_WINDOW_MS {
            return Err(Refusal::Replayed);
        }
        let seen = self.seen();
        if proof.time_ms <= seen.floor_ms || seen.proofs.contains(&(proof.time_ms, proof.nonce)) {
            return Err(Refusal::Replayed);
        }
        Ok(proof)
    }

    /// Whether `got` (the request's [`AUTH_HEADER`]) proves the secret for a
    /// request to `path` with `body`, received at `now_ms`, for the first time; a
    /// proof that passes is remembered, so the same request is refused next time.
    pub fn check(
        &self,
        got: Option<&HeaderValue>,
        path: &str,
        body: &[u8],
        now_ms: u64,
    ) -> Result<(), Refusal> {
        let proof = self.precheck(got, now_ms)?;
        let want = self.mac(proof.time_ms, &proof.nonce, path, body);
        if !bool::from(want.ct_eq(&proof.mac)) {
            return Err(Refusal::Wrong);
        }
        let mut seen = self.seen();
        let oldest = now_ms.saturating_sub(PROOF_WINDOW_MS);
        while seen.proofs.first().is_some_and(|(t, _)| *t < oldest) {
            seen.proofs.pop_first();
        }
        if proof.time_ms <= seen.floor_ms || !seen.proofs.insert((proof.time_ms, proof.nonce)) {
            return Err(Refusal::Replayed);
        }
        while seen.proofs.len() > PROOFS_REMEMBERED_MAX {
            if let Some((t, _)) = seen.proofs.pop_first() {
                seen.floor_ms = seen.floor_ms.max(t);
            }
        }
        Ok(())
    }
}

/// Milliseconds since the Unix epoch by this machine's clock.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The address a raft RPC came from, for refusals: [`crate::server::serve`] puts
/// it in every request's extensions (as `ConnectInfo<RaftPeer>`).
#[derive(Debug, Clone, Copy)]
pub struct RaftPeer(pub SocketAddr);

/// The node a raft connection's certificate names: under TLS,
/// [`crate::server::serve`] puts it in every request's extensions, and it stands
/// for the proof of the secret (the node listener's handshake let in only a
/// certificate of the cluster CA naming a node of the cluster).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerNode(pub String);

/// The middleware in front of every raft endpoint: serves a request only if it
/// comes from a node's certificate (TLS) or proves the secret (plaintext; every
/// request when the node runs without a secret).
pub(crate) async fn authenticated(
    State(secret): State<Option<Arc<RaftSecret>>>,
    request: Request,
    next: Next,
) -> Response {
    if request.extensions().get::<PeerNode>().is_some() {
        return next.run(request).await;
    }
    let Some(secret) = secret else { return next.run(request).await };
    let peer = request.extensions().get::<ConnectInfo<RaftPeer>>().map(|c| c.0 .0.to_string());
    let path = request.uri().path().to_string();
    let refusal = match proven(&secret, request, &path).await {
        Ok(request) => return next.run(request).await,
        Err(refusal) => refusal,
    };
    let peer = peer.as_deref().unwrap_or("unknown");
    let (text, reason) = match refusal {
        Refusal::Missing => ("refused a raft RPC: no proof of the cluster secret", Reason::ProofMissing),
        Refusal::Wrong => ("refused a raft RPC: wrong proof of the cluster secret", Reason::ProofWrong),
        Refusal::Replayed => (
            "refused a raft RPC: its proof was seen before or is out of time (a replay?)",
            Reason::ProofReplayed,
        ),
    };
    refusals::count(Listener::Raft, reason);
    let reason = reason.as_str();
    refusals::log_limited(
        || tracing::warn!(target: AUDIT_TARGET, %path, %peer, reason, outcome = "refused", "{text}"),
    );
    (
        StatusCode::UNAUTHORIZED,
        "the raft RPC does not prove this cluster's secret (cluster.secret) for this request",
    )
        .into_response()
}

/// The request, its body read back in, if its proof passes (see the module docs);
/// what can be judged without the body is, before it is read.
async fn proven(secret: &RaftSecret, request: Request, path: &str) -> Result<Request, Refusal> {
    let now_ms = unix_ms();
    secret.precheck(request.headers().get(AUTH_HEADER), now_ms)?;
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, PROVEN_BODY_BYTES_MAX).await.map_err(|_| Refusal::Wrong)?;
    secret.check(parts.headers.get(AUTH_HEADER), path, &bytes, now_ms)?;
    Ok(Request::from_parts(parts, axum::body::Body::from(bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_800_000_000_000;

    #[test]
    fn a_proof_holds_for_one_request_of_one_secret_once() {
        let ours = RaftSecret::new("a-long-enough-secret");
        let proof = ours.sign("/raft/append", b"{}", NOW);
        assert_eq!(ours.check(Some(&proof), "/raft/append", b"{}", NOW + 5), Ok(()));
        // The same request again, as an observer of the wire would send it.
        assert_eq!(ours.check(Some(&proof), "/raft/append", b"{}", NOW + 10), Err(Refusal::Replayed));
        // Another body, another path, another secret's proof.
        let proof = ours.sign("/raft/append", b"{}", NOW);
        assert_eq!(ours.check(Some(&proof), "/raft/append", b"{\"x\":1}", NOW), Err(Refusal::Wrong));
        assert_eq!(ours.check(Some(&proof), "/raft/vote", b"{}", NOW), Err(Refusal::Wrong));
        let theirs = RaftSecret::new("another-secret-1").sign("/raft/vote", b"{}", NOW);
        assert_eq!(ours.check(Some(&theirs), "/raft/vote", b"{}", NOW), Err(Refusal::Wrong));
        // Out of the window either way, missing, malformed.
        let old = ours.sign("/raft/vote", b"{}", NOW - PROOF_WINDOW_MS - 1);
        assert_eq!(ours.check(Some(&old), "/raft/vote", b"{}", NOW), Err(Refusal::Replayed));
        let ahead = ours.sign("/raft/vote", b"{}", NOW + PROOF_WINDOW_MS + 1);
        assert_eq!(ours.check(Some(&ahead), "/raft/vote", b"{}", NOW), Err(Refusal::Replayed));
        assert_eq!(ours.check(None, "/raft/vote", b"{}", NOW), Err(Refusal::Missing));
        for junk in ["", "a-long-enough-secret", "v2 1 00 00", &"0".repeat(64)] {
            let junk = HeaderValue::from_str(junk).expect("header");
            assert_eq!(ours.check(Some(&junk), "/raft/vote", b"{}", NOW), Err(Refusal::Wrong), "{junk:?}");
        }
        // Each signature differs (its nonce), so none is refused as a replay of another.
        let (a, b) = (ours.sign("/raft/vote", b"{}", NOW), ours.sign("/raft/vote", b"{}", NOW));
        assert_ne!(a, b);
        assert_eq!(
            (ours.check(Some(&a), "/raft/vote", b"{}", NOW), ours.check(Some(&b), "/raft/vote", b"{}", NOW)),
            (Ok(()), Ok(()))
        );
        // The header never holds the secret, and the Debug form hides the key.
        assert!(!a.to_str().unwrap_or_default().contains("secret"));
        assert_eq!(format!("{ours:?}"), "RaftSecret(..)");
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // RFC 4231 test case 2 has a 4-byte key; with a 32-byte key of 0x0b bytes
        // (test case 1 has 20), the HMAC is that of the key padded with zeros.
        let mut key = [0u8; 32];
        key[..20].copy_from_slice(&[0x0b; 20]);
        assert_eq!(
            hex::encode(hmac(&key, &[b"Hi ", b"There"])),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
    }
}
