//! Tally's client tokens: who may do what to which counters.
//!
//! A node's configuration declares tokens by their hash, never in clear
//! (`[[tokens]]`, see [`TokenConfig`]); each has a name (what the audit trail
//! shows), scopes ([`Scope`]) and optional counter-name prefixes. A client presents
//! the token itself (`Authorization: Bearer TOKEN` on HTTP, `AUTH TOKEN` on RESP);
//! [`Tokens::verify`] hashes it and compares the hash with every declared one in
//! constant time, giving the token's [`Principal`]. [`authorize`] then decides
//! whether that principal may use a scope on a [`Resource`].
//!
//! This crate does no I/O and knows nothing of HTTP: the server's HTTP layer and
//! its RESP listener are thin shells over the same decisions.
//!
//! # Layout
//!
//! One file, `lib.rs`: the token configuration, verification, the authorization
//! rules below, and their tests.
//!
//! # Why SHA-256 and not a password hash
//!
//! Tokens made by [`new_token`] carry 256 random bits, so no dictionary or brute
//! force applies to their hash, and a slow password hash (Argon2, bcrypt) would buy
//! nothing but a CPU cost an unauthenticated client could make a node pay on every
//! request. A config file that leaks gives away only hashes, from which no token can
//! be recovered. The comparison is constant-time ([`subtle`]) anyway, so the time a
//! refusal takes says nothing about how close a guess came.
//!
//! # Rules
//!
//! * `read` reads, `write` increments, `admin` changes specs, deletes, reconciles
//!   and changes the cluster. `admin` implies `read` and `write`: a token that may
//!   delete a counter and set its total by reconciling already holds every power
//!   the other two give.
//! * A token with prefixes touches only counters whose names start with one of
//!   them. Whole-node figures that name arbitrary counters (`/metrics`) and changes
//!   to the cluster itself need a token without prefixes; listings are narrowed to
//!   the token's prefixes instead of refused ([`Principal::narrow`]).
//! * With no tokens declared the node is open: [`Tokens::verify`] is not consulted
//!   and every request acts as [`Principal::open`].

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::sync::Arc;
use subtle::{ConditionallySelectable, ConstantTimeEq};
use tally_core::name::{check_token, NameError, NAME_BYTES_MAX};

/// Most tokens one node may declare: verification compares against every one.
pub const TOKENS_MAX: usize = 256;
/// Longest token name, in bytes (names appear in logs and metrics).
pub const TOKEN_NAME_LEN_MAX: usize = 64;
/// Most counter-name prefixes one token may be limited to.
pub const PREFIXES_PER_TOKEN_MAX: usize = 64;
/// Longest presented token, in bytes; a longer one is refused before it is hashed.
pub const PRESENTED_TOKEN_BYTES_MAX: usize = 512;
/// Random bytes in a token made by [`new_token`] (256 bits).
pub const TOKEN_RANDOM_BYTES: usize = 32;
/// What every token made by [`new_token`] starts with, so that secret scanners and
/// people recognize one.
pub const TOKEN_TEXT_PREFIX: &str = "tly_";
/// The scheme of a declared hash: `sha256:` followed by 64 hex digits.
pub const HASH_SCHEME: &str = "sha256:";
/// The `WWW-Authenticate` realm of HTTP refusals.
pub const REALM: &str = "tally";
/// Longest piece of a client's counter name quoted back in a refusal, in characters.
const QUOTED_NAME_CHARS_MAX: usize = 64;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Read values, specs, shards, listings, the cluster view and statistics.
    Read,
    /// Increment counters (creating an unknown one with the defaults).
    Write,
    /// Create or change specs (resharding included), delete, reconcile, change the
    /// cluster's members and accept a replaced disk's loss. Implies `read` and `write`.
    Admin,
}

impl Scope {
    /// Every scope, in order.
    pub const ALL: [Scope; 3] = [Scope::Read, Scope::Write, Scope::Admin];

    /// The name used in configs and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::Admin => "admin",
        }
    }

    /// The scope named `text`, if any.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == text)
    }

    fn bit(self) -> u8 {
        match self {
            Self::Read => 1,
            Self::Write => 2,
            Self::Admin => 4,
        }
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One `[[tokens]]` entry of a node's configuration, as written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// The token's name: what logs, the audit trail and refusals show (never the
    /// token itself). Unique per node.
    pub name: String,
    /// `sha256:` and the 64 hex digits of the SHA-256 of the token (`tally token new`
    /// prints it).
    pub hash: String,
    /// What the token may do; at least one.
    pub scopes: Vec<Scope>,
    /// If not empty, the token touches only counters whose names start with one of
    /// these.
    #[serde(default)]
    pub prefixes: Vec<String>,
}

/// Why a `[[tokens]]` section was refused. Every variant names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenConfigError {
    /// More than [`TOKENS_MAX`] tokens.
    #[error("tokens: {got} tokens are declared; at most {max} may be")]
    TooMany {
        /// Declared.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// A name is malformed.
    #[error("tokens[{index}].name: {source}")]
    Name {
        /// The entry.
        index: usize,
        /// What is wrong with it.
        source: NameError,
    },
    /// Two entries share a name.
    #[error("tokens[{index}].name: {name:?} appears more than once")]
    DuplicateName {
        /// The second entry.
        index: usize,
        /// The name.
        name: String,
    },
    /// A hash is not `sha256:` and 64 hex digits.
    #[error("tokens[{index}].hash: {reason}")]
    Hash {
        /// The entry.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// Two entries declare the same token.
    #[error("tokens[{index}].hash: the same token as tokens[{first}] (each token is declared once)")]
    DuplicateHash {
        /// The second entry.
        index: usize,
        /// The first entry.
        first: usize,
    },
    /// The scopes are empty or repeat one.
    #[error("tokens[{index}].scopes: {reason}")]
    Scopes {
        /// The entry.
        index: usize,
        /// What is wrong with them.
        reason: String,
    },
    /// A prefix is malformed, or there are too many.
    #[error("tokens[{index}].prefixes: {reason}")]
    Prefixes {
        /// The entry.
        index: usize,
        /// What is wrong with them.
        reason: String,
    },
}

/// The SHA-256 of a token: what a config declares and what verification compares.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TokenHash([u8; 32]);

impl TokenHash {
    /// The hash of `token`.
    pub fn of(token: &str) -> Self {
        use sha2::Digest;
        Self(sha2::Sha256::digest(token.as_bytes()).into())
    }

    /// Parses `sha256:` followed by 64 hex digits (either case).
    pub fn parse(text: &str) -> Result<Self, String> {
        let Some(digits) = text.strip_prefix(HASH_SCHEME) else {
            return Err(format!("must start with {HASH_SCHEME:?} (make one with `tally token new`)"));
        };
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(digits, &mut bytes)
            .map_err(|e| format!("{HASH_SCHEME} must be followed by 64 hex digits: {e}"))?;
        Ok(Self(bytes))
    }

    /// The form a config declares: `sha256:` and 64 lowercase hex digits.
    pub fn to_config(&self) -> String {
        format!("{HASH_SCHEME}{}", hex::encode(self.0))
    }
}

impl std::fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenHash({})", self.to_config())
    }
}

impl ConstantTimeEq for TokenHash {
    fn ct_eq(&self, other: &Self) -> subtle::Choice {
        self.0.ct_eq(&other.0)
    }
}

/// Who a request acts as: a declared token's name, scopes and prefixes, or the
/// open principal of a node without tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The token's name; `None` on a node without tokens.
    name: Option<Arc<str>>,
    /// The scopes, as bits of [`Scope::bit`].
    scopes: u8,
    /// Counter-name prefixes; empty means every counter.
    prefixes: Vec<String>,
}

impl Principal {
    /// The principal of every request on a node without tokens: every scope, every
    /// counter, no name.
    pub fn open() -> Self {
        Self { name: None, scopes: Scope::ALL.iter().fold(0, |b, s| b | s.bit()), prefixes: Vec::new() }
    }

    /// A named principal (what [`Tokens::from_config`] builds for each entry).
    pub fn token(name: &str, scopes: &[Scope], prefixes: &[String]) -> Self {
        Self {
            name: Some(name.into()),
            scopes: scopes.iter().fold(0, |b, s| b | s.bit()),
            prefixes: prefixes.to_vec(),
        }
    }

    /// The token's name, or `None` on an open node.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The name for logs: the token's name, or `-` on an open node.
    pub fn label(&self) -> &str {
        self.name().unwrap_or("-")
    }

    /// Whether the principal holds `scope` (`admin` implies the others).
    pub fn has(&self, scope: Scope) -> bool {
        self.scopes & (scope.bit() | Scope::Admin.bit()) != 0
    }

    /// Whether the principal may touch every counter (it has no prefixes).
    pub fn unrestricted(&self) -> bool {
        self.prefixes.is_empty()
    }

    /// The prefixes the principal is limited to (empty: none).
    pub fn prefixes(&self) -> &[String] {
        &self.prefixes
    }

    /// Whether counter `name` is within the principal's prefixes.
    pub fn sees(&self, name: &str) -> bool {
        self.unrestricted() || self.prefixes.iter().any(|p| name.starts_with(p.as_str()))
    }

    /// The prefixes to list when this principal asks for the names starting with
    /// `requested`: `None` to list `requested` as asked (no prefixes); otherwise
    /// the intersection with the principal's prefixes, in byte order, none a
    /// prefix of another (so their names form disjoint ranges in that order), and
    /// empty when nothing the principal may see starts with `requested`.
    pub fn narrow(&self, requested: &str) -> Option<Vec<String>> {
        if self.unrestricted() {
            return None;
        }
        let mut candidates: Vec<&str> = self
            .prefixes
            .iter()
            .filter_map(|p| {
                if p.starts_with(requested) {
                    Some(p.as_str())
                } else if requested.starts_with(p.as_str()) {
                    Some(requested)
                } else {
                    None
                }
            })
            .collect();
        candidates.sort_unstable();
        let mut out: Vec<String> = Vec::with_capacity(candidates.len());
        for c in candidates {
            // Sorted, a prefix comes right before everything it covers.
            if out.last().is_some_and(|kept| c.starts_with(kept.as_str())) {
                continue;
            }
            out.push(c.to_string());
        }
        Some(out)
    }
}

/// What a request touches, for [`authorize`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource<'a> {
    /// One counter, by name.
    Counter(&'a str),
    /// The cluster itself: its view (any reader) or its membership (an `admin`
    /// without prefixes: a change moves every counter's shards).
    Cluster,
    /// Figures that name any counter (`/metrics`): a token without prefixes.
    AllCounters,
    /// A listing the caller narrows to the principal's prefixes itself
    /// ([`Principal::narrow`], [`Principal::sees`]).
    Narrowed,
}

/// Why a request was refused: not authenticated (401) or not allowed (403).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No token was presented on a node that requires one.
    #[error("this node requires a token: send `Authorization: Bearer TOKEN`")]
    Missing,
    /// The credentials are not of the form `Bearer TOKEN`.
    #[error("the credentials are not of the form `Bearer TOKEN`")]
    Malformed,
    /// The token matches none this node declares.
    #[error("the token is not one this node accepts")]
    UnknownToken,
    /// The token lacks the scope the operation needs.
    #[error("token {token:?} does not have the {needed} scope this operation needs")]
    Scope {
        /// The token's name.
        token: String,
        /// The scope needed.
        needed: Scope,
    },
    /// The counter is outside the token's prefixes.
    #[error("token {token:?} may not touch counter {counter:?}: it is limited to the prefixes {prefixes:?}")]
    Prefix {
        /// The token's name.
        token: String,
        /// The counter asked for as the client gave it (`tally_core::name::shown`),
        /// cut to a few dozen characters.
        counter: String,
        /// The token's prefixes, as its config gives them.
        prefixes: Vec<String>,
    },
    /// The operation touches every counter and the token is limited to prefixes.
    #[error("token {token:?} is limited to counter prefixes; {what} needs a token without prefixes")]
    Restricted {
        /// The token's name.
        token: String,
        /// What was asked for.
        what: &'static str,
    },
}

impl AuthError {
    /// The reason as a stable label (metrics and the audit trail): `missing`,
    /// `malformed`, `unknown_token`, `scope` or `prefix`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Malformed => "malformed",
            Self::UnknownToken => "unknown_token",
            Self::Scope { .. } => "scope",
            Self::Prefix { .. } | Self::Restricted { .. } => "prefix",
        }
    }

    /// Every reason [`Self::reason`] can give, for exporting zeros.
    pub const REASONS: [&'static str; 5] = ["missing", "malformed", "unknown_token", "scope", "prefix"];

    /// Whether the request was not authenticated (HTTP 401) rather than not
    /// allowed (HTTP 403).
    pub fn is_unauthenticated(&self) -> bool {
        matches!(self, Self::Missing | Self::Malformed | Self::UnknownToken)
    }

    /// The token's name, when the refusal is of a known token.
    pub fn token(&self) -> Option<&str> {
        match self {
            Self::Scope { token, .. } | Self::Prefix { token, .. } | Self::Restricted { token, .. } => {
                Some(token)
            }
            _ => None,
        }
    }

    /// The value of the HTTP `WWW-Authenticate` header for this refusal
    /// (RFC 6750 §3).
    pub fn www_authenticate(&self) -> String {
        match self {
            Self::Missing => format!("Bearer realm=\"{REALM}\""),
            Self::Malformed => format!("Bearer realm=\"{REALM}\", error=\"invalid_request\""),
            Self::UnknownToken => format!("Bearer realm=\"{REALM}\", error=\"invalid_token\""),
            Self::Scope { needed, .. } => {
                format!("Bearer realm=\"{REALM}\", error=\"insufficient_scope\", scope=\"{needed}\"")
            }
            Self::Prefix { .. } | Self::Restricted { .. } => {
                format!("Bearer realm=\"{REALM}\", error=\"insufficient_scope\"")
            }
        }
    }
}

/// Whether `principal` may use `scope` on `resource`.
pub fn authorize(principal: &Principal, scope: Scope, resource: Resource<'_>) -> Result<(), AuthError> {
    let token = || principal.label().to_string();
    if !principal.has(scope) {
        return Err(AuthError::Scope { token: token(), needed: scope });
    }
    match resource {
        Resource::Counter(name) if !principal.sees(name) => Err(AuthError::Prefix {
            token: token(),
            counter: tally_core::name::shown(name).chars().take(QUOTED_NAME_CHARS_MAX).collect(),
            prefixes: principal.prefixes.iter().map(|p| tally_core::name::shown(p)).collect(),
        }),
        Resource::Cluster if scope == Scope::Admin && !principal.unrestricted() => {
            Err(AuthError::Restricted { token: token(), what: "changing the cluster" })
        }
        Resource::AllCounters if !principal.unrestricted() => {
            Err(AuthError::Restricted { token: token(), what: "reading figures of every counter" })
        }
        _ => Ok(()),
    }
}

/// The tokens a node accepts. Empty: the node is open.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    entries: Vec<(TokenHash, Arc<Principal>)>,
}

impl Tokens {
    /// Checks the `[[tokens]]` entries and builds the set.
    pub fn from_config(config: &[TokenConfig]) -> Result<Self, TokenConfigError> {
        if config.len() > TOKENS_MAX {
            return Err(TokenConfigError::TooMany { got: config.len(), max: TOKENS_MAX });
        }
        let mut names = BTreeSet::new();
        let mut entries: Vec<(TokenHash, Arc<Principal>)> = Vec::with_capacity(config.len());
        for (index, t) in config.iter().enumerate() {
            validate_entry(index, &t.name, &t.scopes, &t.prefixes)?;
            if !names.insert(t.name.as_str()) {
                return Err(TokenConfigError::DuplicateName { index, name: t.name.clone() });
            }
            let hash =
                TokenHash::parse(&t.hash).map_err(|reason| TokenConfigError::Hash { index, reason })?;
            if let Some(first) = entries.iter().position(|(h, _)| *h == hash) {
                return Err(TokenConfigError::DuplicateHash { index, first });
            }
            // Names are compared in their escaped form (`tally_core::name`), which
            // keeps prefixes.
            let prefixes: Vec<String> =
                t.prefixes.iter().map(|p| tally_core::name::escape(p.as_bytes())).collect();
            entries.push((hash, Arc::new(Principal::token(&t.name, &t.scopes, &prefixes))));
        }
        Ok(Self { entries })
    }

    /// Whether no token is declared (the node is open).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// How many tokens are declared.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The principal of the declared token `presented`. Every declared hash is
    /// compared, in constant time, whichever matches.
    pub fn verify(&self, presented: &str) -> Result<Arc<Principal>, AuthError> {
        if presented.is_empty() || presented.len() > PRESENTED_TOKEN_BYTES_MAX {
            return Err(AuthError::UnknownToken);
        }
        let hash = TokenHash::of(presented);
        // Index + 1 of the match, 0 for none; selected without branching on any hash.
        let mut found: u64 = 0;
        for (i, (declared, _)) in self.entries.iter().enumerate() {
            found.conditional_assign(&(i as u64 + 1), declared.ct_eq(&hash));
        }
        match found.checked_sub(1).and_then(|i| self.entries.get(usize::try_from(i).ok()?)) {
            Some((_, principal)) => Ok(principal.clone()),
            None => Err(AuthError::UnknownToken),
        }
    }

    /// The principal of a request whose credentials are `credentials` (the value
    /// of an `Authorization` header, or `None` when absent). On an open node every
    /// request is [`Principal::open`], whatever it presents.
    pub fn authenticate(&self, credentials: Option<&[u8]>) -> Result<Arc<Principal>, AuthError> {
        if self.is_empty() {
            return Ok(Arc::new(Principal::open()));
        }
        let credentials = credentials.ok_or(AuthError::Missing)?;
        self.verify(bearer(credentials)?)
    }
}

/// The token of `Bearer TOKEN` (the scheme in any case, RFC 7235 §2.1).
pub fn bearer(credentials: &[u8]) -> Result<&str, AuthError> {
    let text = std::str::from_utf8(credentials).map_err(|_| AuthError::Malformed)?;
    let (scheme, token) = text.trim().split_once(' ').ok_or(AuthError::Malformed)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(AuthError::Malformed);
    }
    let token = token.trim();
    if token.is_empty() || token.contains(char::is_whitespace) {
        return Err(AuthError::Malformed);
    }
    Ok(token)
}

fn validate_entry(
    index: usize,
    name: &str,
    scopes: &[Scope],
    prefixes: &[String],
) -> Result<(), TokenConfigError> {
    check_token("token name", name, TOKEN_NAME_LEN_MAX)
        .map_err(|source| TokenConfigError::Name { index, source })?;
    if scopes.is_empty() {
        return Err(TokenConfigError::Scopes {
            index,
            reason: "a token needs at least one of \"read\", \"write\", \"admin\"".into(),
        });
    }
    if let Some(s) = scopes.iter().enumerate().find(|(i, s)| scopes[..*i].contains(s)).map(|(_, s)| s) {
        return Err(TokenConfigError::Scopes { index, reason: format!("{s:?} appears more than once") });
    }
    if prefixes.len() > PREFIXES_PER_TOKEN_MAX {
        return Err(TokenConfigError::Prefixes {
            index,
            reason: format!("{} prefixes; at most {PREFIXES_PER_TOKEN_MAX}", prefixes.len()),
        });
    }
    // A prefix is the start of a name: any text of 1 to NAME_BYTES_MAX bytes.
    for p in prefixes {
        if p.is_empty() || p.len() > NAME_BYTES_MAX {
            let reason = format!("a prefix is 1 to {NAME_BYTES_MAX} bytes (got {} bytes)", p.len());
            return Err(TokenConfigError::Prefixes { index, reason });
        }
    }
    Ok(())
}

/// A new random token: [`TOKEN_TEXT_PREFIX`] and the hex of
/// [`TOKEN_RANDOM_BYTES`] bytes from the operating system's generator.
pub fn new_token() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; TOKEN_RANDOM_BYTES];
    getrandom::fill(&mut bytes)?;
    Ok(format!("{TOKEN_TEXT_PREFIX}{}", hex::encode(bytes)))
}

/// The `[[tokens]]` entry that declares `token` under `name` with `scopes` and
/// `prefixes`, as TOML lines, after checking them as a config load would.
pub fn config_lines(
    token: &str,
    name: &str,
    scopes: &[Scope],
    prefixes: &[String],
) -> Result<String, TokenConfigError> {
    validate_entry(0, name, scopes, prefixes)?;
    let quoted = |items: Vec<&str>| items.iter().map(|s| toml_string(s)).collect::<Vec<_>>().join(", ");
    let mut text = format!(
        "[[tokens]]\nname = \"{name}\"\nhash = \"{}\"\nscopes = [{}]\n",
        TokenHash::of(token).to_config(),
        quoted(scopes.iter().map(|s| s.as_str()).collect()),
    );
    if !prefixes.is_empty() {
        text += &format!("prefixes = [{}]\n", quoted(prefixes.iter().map(String::as_str).collect()));
    }
    Ok(text)
}

/// `s` as a TOML basic string: quoted, with `"`, `\\` and control characters escaped
/// (a prefix may hold any text).
fn toml_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SHA-256 of "abc" (FIPS 180-2, appendix B.1).
    const ABC_SHA256: &str = "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

    fn entry(name: &str, token: &str, scopes: &[Scope], prefixes: &[&str]) -> TokenConfig {
        TokenConfig {
            name: name.into(),
            hash: TokenHash::of(token).to_config(),
            scopes: scopes.to_vec(),
            prefixes: prefixes.iter().map(|p| p.to_string()).collect(),
        }
    }

    fn tokens() -> Tokens {
        Tokens::from_config(&[
            entry("reader", "tok-read", &[Scope::Read], &[]),
            entry("ingest", "tok-likes", &[Scope::Write], &["likes:"]),
            entry("ops", "tok-admin", &[Scope::Admin], &[]),
            entry("likes-admin", "tok-likes-admin", &[Scope::Admin], &["likes:", "views:"]),
        ])
        .expect("valid tokens")
    }

    #[test]
    fn hashes_are_sha256_in_the_declared_form() {
        assert_eq!(TokenHash::of("abc").to_config(), ABC_SHA256);
        assert_eq!(TokenHash::parse(ABC_SHA256), Ok(TokenHash::of("abc")));
        assert_eq!(
            TokenHash::parse(&ABC_SHA256.to_uppercase().replace("SHA256", "sha256")),
            Ok(TokenHash::of("abc"))
        );
        for bad in [
            "",
            "ba7816bf",
            "sha1:ba7816bf",
            "sha256:",
            "sha256:zz",
            &format!("{ABC_SHA256}00"),
            &ABC_SHA256[..70],
        ] {
            assert!(TokenHash::parse(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn verify_finds_the_matching_token_and_only_it() {
        let t = tokens();
        assert_eq!(t.len(), 4);
        assert_eq!(t.verify("tok-read").map(|p| p.label().to_string()), Ok("reader".into()));
        assert_eq!(t.verify("tok-admin").map(|p| p.label().to_string()), Ok("ops".into()));
        // The last entry too: the index selection must not be off by one.
        assert_eq!(t.verify("tok-likes-admin").map(|p| p.label().to_string()), Ok("likes-admin".into()));
        for wrong in ["", "tok-rea", "tok-read ", "TOK-READ", &"x".repeat(PRESENTED_TOKEN_BYTES_MAX + 1)] {
            assert_eq!(t.verify(wrong), Err(AuthError::UnknownToken), "{wrong:?}");
        }
        // The declared hash itself is not a token.
        assert_eq!(t.verify(&TokenHash::of("tok-read").to_config()), Err(AuthError::UnknownToken));
    }

    #[test]
    fn credentials_are_bearer_tokens() {
        let t = tokens();
        let name = |c: &[u8]| t.authenticate(Some(c)).map(|p| p.label().to_string());
        assert_eq!(name(b"Bearer tok-read"), Ok("reader".into()));
        assert_eq!(name(b"bearer   tok-read "), Ok("reader".into()));
        assert_eq!(t.authenticate(None).map(|_| ()), Err(AuthError::Missing));
        for bad in
            [&b"tok-read"[..], b"Basic dG9rOnJlYWQ=", b"Bearer", b"Bearer ", b"Bearer a b", b"\xff\xfe"]
        {
            assert_eq!(t.authenticate(Some(bad)).map(|_| ()), Err(AuthError::Malformed), "{bad:?}");
        }
        assert_eq!(name(b"Bearer nope"), Err(AuthError::UnknownToken));
    }

    #[test]
    fn an_open_node_lets_everything_through() {
        let open = Tokens::default();
        assert!(open.is_empty());
        let p = open.authenticate(None).expect("open");
        assert_eq!((p.name(), p.label()), (None, "-"));
        assert_eq!(open.authenticate(Some(b"Bearer whatever")).map(|p| p.name().is_none()), Ok(true));
        for scope in Scope::ALL {
            for r in
                [Resource::Counter("credits:1"), Resource::Cluster, Resource::AllCounters, Resource::Narrowed]
            {
                assert_eq!(authorize(&p, scope, r), Ok(()));
            }
        }
    }

    #[test]
    fn scopes_decide_and_admin_implies_the_others() {
        let t = tokens();
        let reader = t.verify("tok-read").unwrap();
        let ops = t.verify("tok-admin").unwrap();
        let c = Resource::Counter("credits:7");
        assert_eq!(authorize(&reader, Scope::Read, c), Ok(()));
        let refused = authorize(&reader, Scope::Write, c).unwrap_err();
        assert_eq!(refused, AuthError::Scope { token: "reader".into(), needed: Scope::Write });
        assert_eq!((refused.reason(), refused.is_unauthenticated()), ("scope", false));
        assert!(refused.www_authenticate().contains("scope=\"write\""));
        assert_eq!(authorize(&reader, Scope::Admin, Resource::Cluster).map_err(|e| e.reason()), Err("scope"));
        for scope in Scope::ALL {
            assert_eq!(authorize(&ops, scope, c), Ok(()));
            assert_eq!(authorize(&ops, scope, Resource::Cluster), Ok(()));
            assert_eq!(authorize(&ops, scope, Resource::AllCounters), Ok(()));
        }
        let ingest = t.verify("tok-likes").unwrap();
        assert!(ingest.has(Scope::Write) && !ingest.has(Scope::Read) && !ingest.has(Scope::Admin));
    }

    #[test]
    fn prefixes_fence_counters_and_whole_node_operations() {
        let t = tokens();
        let ingest = t.verify("tok-likes").unwrap();
        assert_eq!(authorize(&ingest, Scope::Write, Resource::Counter("likes:42")), Ok(()));
        let refused = authorize(&ingest, Scope::Write, Resource::Counter("credits:7")).unwrap_err();
        assert_eq!(refused.reason(), "prefix");
        assert_eq!(refused.token(), Some("ingest"));
        // A name that merely contains the prefix is outside it.
        assert!(authorize(&ingest, Scope::Write, Resource::Counter("x-likes:1")).is_err());
        assert!(authorize(&ingest, Scope::Write, Resource::Counter("likes")).is_err());
        let likes_admin = t.verify("tok-likes-admin").unwrap();
        assert_eq!(authorize(&likes_admin, Scope::Admin, Resource::Counter("views:9")), Ok(()));
        assert_eq!(authorize(&likes_admin, Scope::Read, Resource::Cluster), Ok(()));
        assert_eq!(
            authorize(&likes_admin, Scope::Admin, Resource::Cluster).map_err(|e| e.reason()),
            Err("prefix")
        );
        assert_eq!(
            authorize(&likes_admin, Scope::Read, Resource::AllCounters).map_err(|e| e.reason()),
            Err("prefix")
        );
        assert_eq!(authorize(&likes_admin, Scope::Read, Resource::Narrowed), Ok(()));
        // A refusal quotes a long name only in part.
        let long = format!("credits:{}", "9".repeat(200));
        match authorize(&ingest, Scope::Write, Resource::Counter(&long)) {
            Err(AuthError::Prefix { counter, .. }) => {
                assert_eq!(counter.chars().count(), QUOTED_NAME_CHARS_MAX)
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn listings_narrow_to_the_tokens_prefixes() {
        let p = Principal::token("t", &[Scope::Read], &["likes:".into(), "views:1".into(), "likes:4".into()]);
        assert_eq!(Principal::open().narrow("likes:"), None);
        assert_eq!(p.narrow(""), Some(vec!["likes:".to_string(), "views:1".to_string()]));
        assert_eq!(p.narrow("likes:42"), Some(vec!["likes:42".to_string()]));
        assert_eq!(p.narrow("views:"), Some(vec!["views:1".to_string()]));
        assert_eq!(p.narrow("credits:"), Some(vec![]));
        assert!(p.sees("likes:1") && p.sees("views:12") && !p.sees("views:2"));
    }

    #[test]
    fn configs_are_checked_field_by_field() {
        let ok = entry("a", "t", &[Scope::Read], &[]);
        let refused = |mutate: fn(&mut Vec<TokenConfig>)| {
            let mut c = vec![ok.clone(), entry("b", "u", &[Scope::Write], &["likes:"])];
            mutate(&mut c);
            Tokens::from_config(&c).expect_err("refused")
        };
        assert!(matches!(
            refused(|c| c[1].name = "a".into()),
            TokenConfigError::DuplicateName { index: 1, .. }
        ));
        assert!(matches!(
            refused(|c| c[1].name = "has space".into()),
            TokenConfigError::Name { index: 1, .. }
        ));
        assert!(matches!(
            refused(|c| c[1].hash = c[0].hash.clone()),
            TokenConfigError::DuplicateHash { index: 1, first: 0 }
        ));
        assert!(matches!(
            refused(|c| c[0].hash = "plain-token".into()),
            TokenConfigError::Hash { index: 0, .. }
        ));
        assert!(matches!(refused(|c| c[0].scopes.clear()), TokenConfigError::Scopes { index: 0, .. }));
        assert!(matches!(
            refused(|c| c[0].scopes = vec![Scope::Read, Scope::Read]),
            TokenConfigError::Scopes { .. }
        ));
        assert!(matches!(
            refused(|c| c[1].prefixes = vec![String::new()]),
            TokenConfigError::Prefixes { index: 1, .. }
        ));
        assert!(matches!(
            refused(|c| c[1].prefixes = vec!["x".repeat(NAME_BYTES_MAX + 1)]),
            TokenConfigError::Prefixes { .. }
        ));
        let many = vec![ok.clone(); TOKENS_MAX + 1];
        assert!(matches!(Tokens::from_config(&many), Err(TokenConfigError::TooMany { .. })));
        let err = refused(|c| c[0].hash = "plain-token".into()).to_string();
        assert!(err.starts_with("tokens[0].hash:"), "{err}");
    }

    #[test]
    fn new_tokens_are_random_and_their_lines_declare_them() {
        let a = new_token().expect("random");
        let b = new_token().expect("random");
        assert_ne!(a, b);
        assert!(a.starts_with(TOKEN_TEXT_PREFIX));
        assert_eq!(a.len(), TOKEN_TEXT_PREFIX.len() + 2 * TOKEN_RANDOM_BYTES);
        let lines = config_lines(&a, "ingest", &[Scope::Write], &["likes:".into()]).expect("valid");
        assert!(!lines.contains(&a), "the config must not hold the token");
        #[derive(Deserialize)]
        struct File {
            tokens: Vec<TokenConfig>,
        }
        let file: File = toml::from_str(&lines).expect("the lines are TOML");
        let t = Tokens::from_config(&file.tokens).expect("valid");
        let p = t.verify(&a).expect("the token verifies against its own line");
        assert_eq!((p.label(), p.prefixes()), ("ingest", &["likes:".to_string()][..]));
        assert!(t.verify(&b).is_err());
        // A prefix may be any text; the lines quote it, the principal compares it
        // with names in their escaped form.
        let odd = "tenant \"a\"\\/{ü}\t".to_string();
        let lines = config_lines(&a, "odd", &[Scope::Read], std::slice::from_ref(&odd)).expect("valid");
        let file: File = toml::from_str(&lines).expect("the lines are TOML");
        assert_eq!(file.tokens[0].prefixes, vec![odd.clone()]);
        let p = Tokens::from_config(&file.tokens).expect("valid").verify(&a).expect("verifies");
        let inside = tally_core::name::CounterName::from_bytes(format!("{odd}:1").as_bytes()).unwrap();
        let outside = tally_core::name::CounterName::from_bytes(b"tenant b:1").unwrap();
        assert!(p.sees(inside.as_str()) && !p.sees(outside.as_str()));
        // A refusal names the counter and the prefixes as they were given.
        let refused = authorize(&p, Scope::Read, Resource::Counter(outside.as_str())).unwrap_err();
        assert!(matches!(&refused, AuthError::Prefix { counter, prefixes, .. }
            if counter == "tenant b:1" && prefixes == std::slice::from_ref(&odd)));
        let message = refused.to_string();
        assert!(message.contains(r#"counter "tenant b:1""#), "{message}");
        assert!(config_lines(&a, "bad name", &[Scope::Read], &[]).is_err());
        assert!(config_lines(&a, "x", &[], &[]).is_err());
    }
}
