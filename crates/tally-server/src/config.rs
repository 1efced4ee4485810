//! A node's configuration file: TOML in two parts.
//!
//! * `[cluster]` describes the cluster and must be identical on every node. The
//!   cluster transport compares [`ClusterConfig::fingerprint`]s at handshake and
//!   refuses a peer whose cluster section differs, so two nodes can never disagree
//!   about membership, addresses or timing without noticing.
//! * `[node]`, `[http]` and `[engine]` belong to one node: who it is, where its data
//!   lives, and the limits of its HTTP front end and embedded engine.
//!
//! Everything is validated at load ([`Config::validate`]); a bad file is refused with
//! an error that names the field, so a node never starts half-configured. Unknown
//! fields are refused too: a misspelt limit must not silently keep its default.
//! `cluster-config/README.md` documents every field.

use crate::sources::config::{SourceConfig, SourceConfigError, SOURCES_MAX};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tally_auth::{TokenConfig, TokenConfigError, Tokens};
use tally_core::name::{check_token, NameError};
use tally_engine::{SledConfig, TallyConfig};

/// The single-node configuration shipped in `cluster-config/single.toml`, built into
/// the binary so that `tallyd` with no arguments runs a usable node.
pub const SINGLE_NODE_TOML: &str = include_str!("../../../cluster-config/single.toml");

/// The cluster secret of the configurations shipped in `cluster-config/`: public,
/// so a node whose listeners are reachable beyond loopback refuses to run with it.
pub const DEV_SECRET: &str = "tally-dev-secret";

/// Seed of the cluster-section fingerprint ("tallycfg"), distinct from every seed of
/// `tally_core::hash` so a fingerprint never collides with a placement hash by design.
pub const FINGERPRINT_SEED: u64 = 0x7461_6c6c_7963_6667;
/// Version of the fingerprint's canonical encoding; bump it when the encoding
/// changes so that nodes of different builds refuse each other instead of
/// comparing incomparable hashes.
pub const FINGERPRINT_FORMAT: u32 = 1;

/// Longest node id, in bytes (ids appear in metrics labels and shard reports).
pub const NODE_ID_LEN_MAX: usize = 64;
/// Longest cluster name, in bytes.
pub const CLUSTER_NAME_LEN_MAX: usize = 64;
/// Shortest shared secret, in bytes, on loopback: anything shorter is guessable.
pub const SECRET_LEN_MIN: usize = 8;
/// Shortest shared secret of a node with a listener beyond loopback, in bytes: 32
/// random bytes (or 64 hex digits of `openssl rand -hex 32`) cannot be found by
/// trying, even from a captured node-to-node handshake, which a short secret can.
pub const SECRET_LEN_MIN_EXPOSED: usize = 32;
/// Fewest distinct bytes in the secret of a node beyond loopback: a long secret of
/// a few repeated characters is not random (hex digits of a random secret use 16).
pub const SECRET_DISTINCT_BYTES_MIN: usize = 10;
/// Longest shared secret, in bytes.
pub const SECRET_LEN_MAX: usize = 1024;
/// Most nodes in one cluster (the engine's overflow reserve is sized for this many).
pub const NODES_MAX: usize = tally_core::limits::NODES_MAX;
/// Most heartbeats a node may miss before a peer is declared down.
pub const HEARTBEAT_MISSES_MAX_CEILING: u32 = 100;
/// Longest any configurable interval or timeout may be, in milliseconds (one hour):
/// larger values are typos, and would make failures undetectable.
pub const INTERVAL_MS_CEILING: u64 = 3_600_000;
/// Largest request body a node may be configured to accept, in bytes (64 MiB).
pub const BODY_BYTES_MAX_CEILING: u64 = 64 << 20;
/// Smallest request body limit, in bytes: every documented request must fit.
pub const BODY_BYTES_MAX_FLOOR: u64 = 1024;
/// Most items a batch may be configured to hold.
pub const BATCH_ITEMS_MAX_CEILING: u64 = 1_000_000;
/// Most names in `http.allowed_hosts`.
pub const ALLOWED_HOSTS_MAX: usize = 64;
/// Longest host name, in bytes (DNS's limit).
pub const HOST_NAME_LEN_MAX: usize = 253;
/// Most simultaneous HTTP connections a node may be configured to hold.
pub const CONNECTIONS_MAX_CEILING: u64 = 1_000_000;

/// Why a configuration was refused. Every variant names the offending field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {reason}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The operating system's explanation.
        reason: String,
    },
    /// The text is not valid TOML, has an unknown field, or a field of the wrong type
    /// (including an address that is not `ip:port`).
    #[error("invalid configuration: {0}")]
    Parse(String),
    /// `cluster.nodes` is empty or longer than [`NODES_MAX`].
    #[error("cluster.nodes lists {got} nodes; a cluster has 1 to {max}")]
    NodeCount {
        /// Nodes listed.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// A name (cluster name or node id) is malformed.
    #[error("{field}: {source}")]
    InvalidName {
        /// The field, e.g. `cluster.nodes[1].id`.
        field: String,
        /// What is wrong with it.
        source: NameError,
    },
    /// Every entry of `cluster.nodes` says `member = false`.
    #[error("cluster.nodes: at least one node must start as a member (member = true, the default)")]
    NoInitialMember,
    /// Two entries of `cluster.nodes` share an id.
    #[error("cluster.nodes: node id {0:?} appears more than once")]
    DuplicateNodeId(String),
    /// Two entries of `cluster.nodes` share a raft id.
    #[error("cluster.nodes: raft_id {0} appears more than once")]
    DuplicateRaftId(u64),
    /// `cluster.default_spec` would not make a valid counter.
    #[error("cluster.default_spec: {0}")]
    DefaultSpec(String),
    /// Two listeners in the cluster share an address.
    #[error("address {addr} is used by both {first} and {second}")]
    DuplicateAddress {
        /// The address.
        addr: SocketAddr,
        /// The first field using it.
        first: String,
        /// The second field using it.
        second: String,
    },
    /// `node.id` names no entry of `cluster.nodes`.
    #[error("node.id {id:?} is not one of cluster.nodes ({known:?})")]
    UnknownNode {
        /// The id given.
        id: String,
        /// The ids listed.
        known: Vec<String>,
    },
    /// The shared secret is too short or too long.
    #[error("cluster.secret is {len} bytes long; it must be {min} to {max}")]
    SecretLength {
        /// Its length in bytes.
        len: usize,
        /// Shortest allowed.
        min: usize,
        /// Longest allowed.
        max: usize,
    },
    /// Range groups of two voters: they cannot replace a lost disk.
    #[error(
        "cluster.replicas = {replicas} on {members} initial members gives range groups of two voters, \
         which cannot survive a lost disk (every majority of two needs both, so a replaced disk can \
         never rejoin its ranges): use replicas = 3 on three or more members, or replicas = 1"
    )]
    TwoVoters {
        /// The replica count asked for.
        replicas: u8,
        /// The initial members.
        members: usize,
    },
    /// A numeric field is outside its range.
    #[error("{field} must be between {min} and {max} (got {got})")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// What was given.
        got: u64,
        /// Smallest allowed.
        min: u64,
        /// Largest allowed.
        max: u64,
    },
    /// Two timeouts are in the wrong order (for example an engine call that outlives
    /// the HTTP request waiting for it).
    #[error("{shorter} ({shorter_ms} ms) must be less than {longer} ({longer_ms} ms)")]
    TimeoutOrder {
        /// The field that must be shorter.
        shorter: &'static str,
        /// Its value.
        shorter_ms: u64,
        /// The field that must be longer.
        longer: &'static str,
        /// Its value.
        longer_ms: u64,
    },
    /// `node.data_dir` is empty.
    #[error("node.data_dir must not be empty")]
    EmptyDataDir,
    /// A field holds a value of the right type that is not allowed.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field, e.g. `http.allowed_hosts[0]`.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A `[[reconcile]]` section is invalid.
    #[error(transparent)]
    Source(#[from] SourceConfigError),
    /// A `[[tokens]]` entry is invalid.
    #[error(transparent)]
    Tokens(#[from] TokenConfigError),
    /// The node would be reachable beyond loopback without protection.
    #[error(transparent)]
    Exposure(#[from] ExposureError),
    /// The `[tls]` section is invalid.
    #[error(transparent)]
    Tls(#[from] tally_tls::TlsError),
}

/// Why a valid configuration is unsafe to run: a listener reachable beyond
/// loopback with nothing that keeps strangers out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExposureError {
    /// A listener binds a non-loopback address and no client token is declared.
    #[error(
        "{listener} listens on {addr}, beyond loopback, and no [[tokens]] are declared: anyone who \
         reaches it could delete counters and change the cluster. Declare tokens (`tally token new \
         --name NAME --scopes admin` prints a [[tokens]] entry to add), or bind 127.0.0.1"
    )]
    NoTokens {
        /// The listener's field, e.g. `cluster.nodes[0].http (node node1)`.
        listener: String,
        /// Its address.
        addr: SocketAddr,
    },
    /// A listener binds a non-loopback address without TLS, and the node does not
    /// say `node.insecure_plaintext = true`.
    #[error(
        "{listener} listens on {addr}, beyond loopback, without TLS: tokens, the cluster's raft \
         traffic and counter data would cross the network in clear. Add a [tls] section \
         (scripts/tls-local-ca.sh makes a local CA; cluster-config/README.md, [tls]), bind 127.0.0.1, or \
         set node.insecure_plaintext = true on a network you trust"
    )]
    Plaintext {
        /// The listener's field.
        listener: String,
        /// Its address.
        addr: SocketAddr,
    },
    /// A listener binds a non-loopback address with a short or repetitive secret.
    #[error(
        "{listener} listens on {addr}, beyond loopback, with a cluster.secret of {len} bytes and {distinct} \
         distinct ones: it must be at least {SECRET_LEN_MIN_EXPOSED} random bytes ({SECRET_DISTINCT_BYTES_MIN} \
         distinct or more) so it cannot be found by trying; e.g. `openssl rand -hex 32`, the same on every node"
    )]
    WeakSecret {
        /// The listener's field.
        listener: String,
        /// Its address.
        addr: SocketAddr,
        /// The secret's length in bytes.
        len: usize,
        /// How many distinct bytes it has.
        distinct: usize,
    },
    /// A listener binds a non-loopback address with the shipped development secret.
    #[error(
        "{listener} listens on {addr}, beyond loopback, with cluster.secret set to the development \
         secret shipped in cluster-config/ ({DEV_SECRET:?}), which anyone can read. Set cluster.secret \
         to a long random value (the same on every node; e.g. `openssl rand -hex 32`), or bind 127.0.0.1"
    )]
    DevSecret {
        /// The listener's field.
        listener: String,
        /// Its address.
        addr: SocketAddr,
    },
}

/// How an item of [`Config::checklist`] stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckLevel {
    /// As a node reachable by others should be.
    Ok,
    /// Worth knowing; nothing to change.
    Info,
    /// Allowed, but weaker than a production node should run.
    Warn,
    /// The node refuses to start like this.
    Fail,
}

impl CheckLevel {
    /// How the checklist prints it.
    pub fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Info => "info",
            Self::Warn => "warn",
            Self::Fail => "FAIL",
        }
    }
}

/// One item of [`Config::checklist`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// How it stands.
    pub level: CheckLevel,
    /// What it says.
    pub text: String,
}

/// One socket a running node listens on, for the exposure check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    /// The field that configures it, e.g. `cluster.nodes[0].http (node node1)`.
    pub field: String,
    /// The address it binds.
    pub addr: SocketAddr,
}

/// A whole configuration file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// What every node must agree on.
    pub cluster: ClusterConfig,
    /// Who this node is and where it keeps its data.
    pub node: NodeConfig,
    /// Limits of this node's HTTP front end.
    #[serde(default)]
    pub http: HttpConfig,
    /// Limits of this node's Redis-protocol front end (served when this node's
    /// entry in `cluster.nodes` has a `resp` address).
    #[serde(default)]
    pub resp: RespConfig,
    /// Settings of this node's embedded engine.
    #[serde(default)]
    pub engine: EngineConfig,
    /// Sources of truth the node reconciles counters against on a schedule
    /// (`[[reconcile]]`); none by default.
    #[serde(default)]
    pub reconcile: Vec<SourceConfig>,
    /// The client tokens this node accepts, declared by their hash (`[[tokens]]`);
    /// none by default, which leaves the node open (loopback only, see
    /// [`Config::check_exposure`]). Per node: not part of the fingerprint, so tokens
    /// can be rotated one node at a time.
    #[serde(default)]
    pub tokens: Vec<TokenConfig>,
    /// Most counters under a name prefix (`[[quotas]]`): a tenant's, or what a
    /// token with that prefix may fill. Per node, like `engine.counters_max`.
    #[serde(default)]
    pub quotas: Vec<QuotaConfig>,
    /// TLS on this node's listeners and, in a cluster, between nodes (`[tls]`);
    /// plaintext when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<tally_tls::TlsConfig>,
}

/// One `[[quotas]]` entry: at most `counters_max` counters whose names start with
/// `prefix`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaConfig {
    /// The names it covers (`likes:`).
    pub prefix: String,
    /// Most counters with such names.
    pub counters_max: u64,
}

/// Most `[[quotas]]` entries.
pub const QUOTAS_MAX: usize = 256;

/// The cluster-wide section: identical on every node, fingerprinted at handshake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// The cluster's name, so that nodes of two clusters never join by mistake.
    #[serde(default = "default_cluster_name")]
    pub name: String,
    /// The shared secret node-to-node connections authenticate with. It has no
    /// default: a cluster must never run on a secret anyone can read in the source.
    pub secret: String,
    /// Virtual nodes per node on the placement ring: more spreads shards more evenly
    /// at the cost of a larger ring.
    #[serde(default = "default_vnodes_per_node")]
    pub vnodes_per_node: u32,
    /// Interval of node-to-node heartbeats, in milliseconds (cluster phase).
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// Heartbeats a peer may miss in a row before it is declared down; with
    /// `heartbeat_ms` this bounds how long a silent failure goes unnoticed.
    #[serde(default = "default_heartbeat_misses_max")]
    pub heartbeat_misses_max: u32,
    /// Interval of the raft leader's heartbeats, in milliseconds.
    #[serde(default = "default_raft_heartbeat_ms")]
    pub raft_heartbeat_ms: u64,
    /// Shortest raft election timeout, in milliseconds.
    #[serde(default = "default_raft_election_timeout_min_ms")]
    pub raft_election_timeout_min_ms: u64,
    /// Longest raft election timeout, in milliseconds.
    #[serde(default = "default_raft_election_timeout_max_ms")]
    pub raft_election_timeout_max_ms: u64,
    /// Copies of every shard (1, 3, 4 or 5); unset, 3 with three initial members
    /// or more and 1 below (see [`ClusterConfig::replicas`]). 1 keeps one copy, on
    /// the ring owner; more puts each shard in a range group replicated on
    /// `min(replicas, members)` nodes,
    /// whose leader serves it: a node's death or the loss of its disk loses nothing
    /// and shards stay available while a majority of each group is up. Fixed when
    /// the cluster first starts: a node refuses data kept the other way (one copy
    /// against range groups).
    #[serde(default)]
    pub replicas: Option<u8>,
    /// With `replicas` > 1: ranges the ring is cut into per node (1–16, rounded up
    /// to a power of two, at least 4 in all). Each range is one raft group, and a
    /// commit cycle writes one entry per range it touches: fewer ranges carry more
    /// increments per entry (more `sync` throughput), more spread the leaderships
    /// finer. Fixed when the cluster first starts: a node refuses range data cut
    /// another way.
    #[serde(default = "default_ranges_per_node")]
    pub ranges_per_node: u32,
    /// What a counter created implicitly (by its first increment or a `SET`) takes
    /// when its name falls under no namespace: the fields of `PUT /v1/counters/{name}`
    /// (`shards` or `"auto"`, `durability`, bounds, `windows`, `distinct`,
    /// `frequency`, `replicas`, `ttl_ms`), e.g. `default_spec = { durability =
    /// "sync", shards = 4 }`. Unset: the built-in defaults (8 shards, `batched`).
    /// Cluster-wide: a creation carries it, and every node must create alike.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_spec: Option<crate::http::body::SpecBody>,
    /// Every node of the cluster, with its stable identities and addresses.
    pub nodes: Vec<NodeEntry>,
}

/// One member of the cluster as every node knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeEntry {
    /// The node's stable name: shard ownership and metrics are keyed by it.
    pub id: String,
    /// The node's stable raft id (openraft identifies members by `u64`).
    pub raft_id: u64,
    /// The public HTTP address clients use.
    pub http: SocketAddr,
    /// The node-to-node (actor transport) address.
    pub peer: SocketAddr,
    /// The raft RPC address.
    pub raft: SocketAddr,
    /// The Redis-protocol (RESP2/RESP3) address, if the node serves one. Left out of
    /// the canonical encoding when absent, so adding the field changed no existing
    /// cluster's fingerprint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resp: Option<SocketAddr>,
    /// Whether the node holds shards from the start. `false` lists a spare: it
    /// runs and votes in the metadata group, and holds shards once added with
    /// `PUT /v1/cluster/members/{id}` (`tally cluster add`).
    #[serde(default = "default_member")]
    pub member: bool,
}

fn default_member() -> bool {
    true
}

/// The per-node section: who this node is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// This node's id; must name one entry of `cluster.nodes`.
    pub id: String,
    /// Where the node keeps its data (the engine's store is `<data_dir>/store`).
    #[serde(default = "default_data_dir")]
    pub data_dir: PathBuf,
    /// Lets listeners beyond loopback run without TLS (tokens and raft traffic then
    /// cross the network in clear, and a raft proof seen on the wire can be
    /// replayed): for a network the operator trusts. Off by default; when it takes
    /// effect, `tallyd` logs a warning at every start.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure_plaintext: bool,
}

/// Limits of the HTTP front end. Every one bounds what a client can make the node
/// hold or wait for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Largest request body accepted, in bytes; larger bodies get 413.
    pub body_bytes_max: u64,
    /// Longest a request may take from its headers to its answer, in milliseconds;
    /// a slower one gets 408 (body still arriving) or 503 (the node was slow).
    pub request_timeout_ms: u64,
    /// Longest a client may take to send a request's headers, in milliseconds; also
    /// how long an idle keep-alive connection stays open. Slow clients are cut off.
    pub header_read_timeout_ms: u64,
    /// Most items in one `POST /v1/increments` batch; more get 413.
    pub batch_items_max: u64,
    /// Most simultaneous connections; further clients wait in the listen backlog.
    pub connections_max: u64,
    /// Longest a graceful shutdown waits for in-flight requests, in milliseconds.
    pub shutdown_grace_ms: u64,
    /// Whether `GET /metrics` answers without a token on a node that declares
    /// tokens (for a scraper that cannot send one). Off by default: metrics name
    /// counters, so they then need a `read` token without prefixes.
    pub metrics_public: bool,
    /// Host names clients reach this node by, beyond IP literals, `localhost` and
    /// `*.localhost` (always answered). A request naming another host in `Host` is
    /// refused with 421: a web page that points a name of its own at the node (DNS
    /// rebinding) would otherwise be same-origin with it. `["*"]` answers any name.
    pub allowed_hosts: Vec<String>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            body_bytes_max: 1 << 20,
            request_timeout_ms: 10_000,
            header_read_timeout_ms: 5_000,
            batch_items_max: 10_000,
            connections_max: 1024,
            shutdown_grace_ms: 15_000,
            metrics_public: false,
            allowed_hosts: Vec::new(),
        }
    }
}

impl HttpConfig {
    /// [`Self::request_timeout_ms`] as a duration.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
    /// [`Self::header_read_timeout_ms`] as a duration.
    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms)
    }
    /// [`Self::shutdown_grace_ms`] as a duration.
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shutdown_grace_ms)
    }
    /// [`Self::body_bytes_max`] as a `usize` (saturating on 32-bit targets).
    pub fn body_limit_bytes(&self) -> usize {
        usize::try_from(self.body_bytes_max).unwrap_or(usize::MAX)
    }
    /// [`Self::batch_items_max`] as a `usize`.
    pub fn batch_limit_items(&self) -> usize {
        usize::try_from(self.batch_items_max).unwrap_or(usize::MAX)
    }
    /// [`Self::connections_max`] as a `usize`.
    pub fn connection_limit(&self) -> usize {
        usize::try_from(self.connections_max).unwrap_or(usize::MAX)
    }
}

/// Largest RESP request a node may be configured to accept, in bytes (64 MiB, as
/// [`BODY_BYTES_MAX_CEILING`]).
pub const RESP_REQUEST_BYTES_MAX_CEILING: u64 = BODY_BYTES_MAX_CEILING;
/// Smallest RESP request limit, in bytes: every documented command must fit.
pub const RESP_REQUEST_BYTES_MAX_FLOOR: u64 = 1024;
/// Smallest largest-argument limit, in bytes: every name and item must fit.
pub const RESP_ARG_BYTES_MAX_FLOOR: u64 = 1024;
/// Most arguments one RESP command may be configured to carry.
pub const RESP_ARGS_MAX_CEILING: u64 = 1_000_000;

/// Limits of the Redis-protocol front end. Like [`HttpConfig`], every one bounds
/// what a client can make the node hold; the time a command may take is
/// `http.request_timeout_ms`, shared by both front ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RespConfig {
    /// Largest request (one command with all its arguments) and so largest bulk
    /// string, in bytes. A longer declared length is refused as soon as its header
    /// arrives, with an error, and the connection is closed.
    pub request_bytes_max: u64,
    /// Most arguments in one command (the command's name included).
    pub args_max: u64,
    /// Largest single argument, in bytes. No argument of any command needs more than
    /// a few kilobytes (names are at most 255, items 1024); a longer declared length
    /// is refused as soon as its header arrives (`request_too_large`) and the
    /// connection is closed, so a client cannot make the node read, check and keep a
    /// megabyte name (`CLIENT SETNAME`).
    pub arg_bytes_max: u64,
    /// Most simultaneous authenticated RESP connections (on a node without tokens:
    /// connections that sent a command); one more is answered
    /// `-ERR max number of clients reached` and closed, as Redis does.
    pub connections_max: u64,
    /// Most connections waiting to authenticate (on a node without tokens: to send
    /// their first command), TLS handshakes included. They do not count against
    /// `connections_max`, so sockets that say nothing never lock clients out; when
    /// this many wait, a new one closes the oldest waiting one.
    pub connections_unauthenticated_max: u64,
    /// How long a connection may wait to authenticate (to send its first command on
    /// a node without tokens), TLS handshake included, in milliseconds; then it is
    /// closed.
    pub auth_timeout_ms: u64,
    /// How long a command may take to arrive once its first byte has, in
    /// milliseconds: a client that trickles a command (slowloris) is closed.
    pub read_timeout_ms: u64,
    /// How long an authenticated connection may send nothing before it is closed,
    /// in milliseconds; 0 keeps idle connections open forever (Redis's `timeout 0`,
    /// the default: pooled clients keep connections idle). Set it on a node that
    /// clients it does not control reach.
    pub idle_timeout_ms: u64,
}

impl Default for RespConfig {
    fn default() -> Self {
        Self {
            request_bytes_max: 1 << 20,
            args_max: 10_001,
            arg_bytes_max: 64 << 10,
            connections_max: 1024,
            connections_unauthenticated_max: 512,
            auth_timeout_ms: 10_000,
            read_timeout_ms: 10_000,
            idle_timeout_ms: 0,
        }
    }
}

impl RespConfig {
    /// [`Self::request_bytes_max`] as a `usize`.
    pub fn request_limit_bytes(&self) -> usize {
        usize::try_from(self.request_bytes_max).unwrap_or(usize::MAX)
    }
    /// [`Self::args_max`] as a `usize`.
    pub fn args_limit(&self) -> usize {
        usize::try_from(self.args_max).unwrap_or(usize::MAX)
    }
    /// [`Self::arg_bytes_max`] as a `usize`.
    pub fn arg_limit_bytes(&self) -> usize {
        usize::try_from(self.arg_bytes_max).unwrap_or(usize::MAX)
    }
    /// [`Self::connections_max`] as a `usize`.
    pub fn connection_limit(&self) -> usize {
        usize::try_from(self.connections_max).unwrap_or(usize::MAX)
    }
    /// [`Self::connections_unauthenticated_max`] as a `usize`.
    pub fn unauthenticated_limit(&self) -> usize {
        usize::try_from(self.connections_unauthenticated_max).unwrap_or(usize::MAX)
    }
    /// [`Self::auth_timeout_ms`] as a duration.
    pub fn auth_timeout(&self) -> Duration {
        Duration::from_millis(self.auth_timeout_ms)
    }
    /// [`Self::read_timeout_ms`] as a duration.
    pub fn read_timeout(&self) -> Duration {
        Duration::from_millis(self.read_timeout_ms)
    }
    /// [`Self::idle_timeout_ms`] as a duration, `None` for never.
    pub fn idle_timeout(&self) -> Option<Duration> {
        (self.idle_timeout_ms > 0).then(|| Duration::from_millis(self.idle_timeout_ms))
    }
}

/// Settings of the embedded engine (a subset of [`TallyConfig`] plus the store's).
/// Defaults are the engine's own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// How often the aggregator looks for due accumulators, in milliseconds.
    pub aggregator_tick_ms: u64,
    /// A shard actor idle this long stops (its state stays in the store).
    pub shard_idle_stop_ms: u64,
    /// A counter's in-memory accumulators are dropped after this long unused.
    pub counter_idle_evict_ms: u64,
    /// How long a request waits for a shard before answering 503, in milliseconds;
    /// must be shorter than `http.request_timeout_ms`.
    pub call_timeout_ms: u64,
    /// How often the rollup looks for due refreshes, in milliseconds.
    pub rollup_tick_ms: u64,
    /// Most counters whose totals the rollup caches at once.
    pub rollup_tracked_max: u64,
    /// A cached total unread for this long stops being refreshed, in milliseconds.
    pub rollup_idle_evict_ms: u64,
    /// The least time between two sweep passes of a shard's expired dedup records,
    /// in milliseconds (a pass starts once a record is due: `tally_core::sweep`).
    pub dedup_sweep_ms: u64,
    /// Most dedup records one sweep examines.
    pub dedup_sweep_records_max: u64,
    /// Page cache the store may keep in memory, in bytes.
    pub store_cache_bytes: u64,
    /// Period of the store's background fsync, in milliseconds; 0 turns it off (only
    /// the engine's own flushes then make data durable).
    pub store_flush_every_ms: u64,
    /// How often each counter with `shards: "auto"` is sampled, in milliseconds.
    pub auto_sample_ms: u64,
    /// At most one auto resharding per counter in this many milliseconds.
    pub auto_change_interval_ms: u64,
    /// How long an auto counter stays quiet before its shard count is lowered.
    pub auto_quiet_ms: u64,
    /// Consecutive hot samples before an auto counter's shard count is raised.
    pub auto_hot_samples: u32,
    /// Increments per second at one shard that make a sample hot.
    pub auto_rate_up_per_shard: u64,
    /// Increments waiting at one shard at once that make a sample hot.
    pub auto_queue_up: u32,
    /// Most counters on the node (as its catalog counts them: in a cluster, the
    /// cluster's); a creation beyond it answers 507 `quota_exceeded`.
    pub counters_max: u64,
    /// Most event ids a counter keeps within its dedup window, split evenly over
    /// its shards; a new id beyond it answers 507 `quota_exceeded`.
    pub event_ids_per_counter_max: u64,
    /// Most bytes a counter's sketches may take (count-min tables, the distinct
    /// sketch, window buckets); a spec beyond it answers 507 `quota_exceeded`.
    pub sketch_bytes_per_counter_max: u64,
}

impl EngineConfig {
    /// The auto-shard tuning these fields name.
    pub fn auto_tuning(&self) -> tally_core::autoshard::Tuning {
        tally_core::autoshard::Tuning {
            sample_ms: self.auto_sample_ms,
            change_interval_ms: self.auto_change_interval_ms,
            quiet_ms: self.auto_quiet_ms,
            hot_samples: self.auto_hot_samples,
            rate_up_per_shard: self.auto_rate_up_per_shard,
            queue_up: self.auto_queue_up,
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        let t = TallyConfig::default();
        Self {
            aggregator_tick_ms: t.aggregator_tick_ms,
            shard_idle_stop_ms: t.shard_idle_stop_ms,
            counter_idle_evict_ms: t.counter_idle_evict_ms,
            call_timeout_ms: t.call_timeout_ms,
            rollup_tick_ms: t.rollup_tick_ms,
            rollup_tracked_max: t.rollup_tracked_max as u64,
            rollup_idle_evict_ms: t.rollup_idle_evict_ms,
            dedup_sweep_ms: t.dedup_sweep_ms,
            dedup_sweep_records_max: t.dedup_sweep_records_max as u64,
            store_cache_bytes: SledConfig::DEFAULT_CACHE_CAPACITY_BYTES,
            store_flush_every_ms: SledConfig::DEFAULT_FLUSH_EVERY_MS.unwrap_or(0),
            auto_sample_ms: t.autoshard.sample_ms,
            auto_change_interval_ms: t.autoshard.change_interval_ms,
            auto_quiet_ms: t.autoshard.quiet_ms,
            auto_hot_samples: t.autoshard.hot_samples,
            auto_rate_up_per_shard: t.autoshard.rate_up_per_shard,
            auto_queue_up: t.autoshard.queue_up,
            counters_max: t.counters_max,
            event_ids_per_counter_max: t.event_ids_per_counter_max,
            sketch_bytes_per_counter_max: t.sketch_bytes_per_counter_max,
        }
    }
}

fn default_cluster_name() -> String {
    "tally".into()
}
fn default_ranges_per_node() -> u32 {
    tally_core::ranges::RANGES_PER_NODE
}

fn default_vnodes_per_node() -> u32 {
    tally_core::ring::VNODES_PER_NODE_DEFAULT
}
fn default_heartbeat_ms() -> u64 {
    250
}
fn default_heartbeat_misses_max() -> u32 {
    4
}
fn default_raft_heartbeat_ms() -> u64 {
    250
}
fn default_raft_election_timeout_min_ms() -> u64 {
    1000
}
fn default_raft_election_timeout_max_ms() -> u64 {
    2000
}
fn default_data_dir() -> PathBuf {
    PathBuf::from("./data")
}

/// A secret's length and how many distinct bytes it has.
fn secret_strength(secret: &str) -> (usize, usize) {
    let distinct = secret.bytes().collect::<BTreeSet<u8>>().len();
    (secret.len(), distinct)
}

/// Whether `addr` is reachable from this machine only (`127.0.0.0/8`, `::1`, or an
/// IPv4-mapped loopback address). `0.0.0.0` and `::` are every interface: not loopback.
pub fn is_loopback(addr: SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}

fn range(field: &'static str, got: u64, min: u64, max: u64) -> Result<(), ConfigError> {
    if got < min || got > max {
        return Err(ConfigError::OutOfRange { field, got, min, max });
    }
    Ok(())
}

fn ordered(
    shorter: &'static str,
    shorter_ms: u64,
    longer: &'static str,
    longer_ms: u64,
) -> Result<(), ConfigError> {
    if shorter_ms >= longer_ms {
        return Err(ConfigError::TimeoutOrder { shorter, shorter_ms, longer, longer_ms });
    }
    Ok(())
}

fn interval(field: &'static str, ms: u64) -> Result<(), ConfigError> {
    range(field, ms, 1, INTERVAL_MS_CEILING)
}

impl Config {
    /// Parses and validates a configuration.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// Reads, parses and validates the configuration file at `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Read { path: path.to_path_buf(), reason: e.to_string() })?;
        Self::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse(m) => ConfigError::Parse(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// The built-in single-node configuration ([`SINGLE_NODE_TOML`]).
    pub fn single_node() -> Result<Self, ConfigError> {
        Self::from_toml(SINGLE_NODE_TOML)
    }

    /// Checks every field and every relation between fields.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.cluster.validate()?;
        if !self.cluster.nodes.iter().any(|n| n.id == self.node.id) {
            return Err(ConfigError::UnknownNode {
                id: self.node.id.clone(),
                known: self.cluster.nodes.iter().map(|n| n.id.clone()).collect(),
            });
        }
        if self.node.data_dir.as_os_str().is_empty() {
            return Err(ConfigError::EmptyDataDir);
        }
        let h = &self.http;
        range("http.body_bytes_max", h.body_bytes_max, BODY_BYTES_MAX_FLOOR, BODY_BYTES_MAX_CEILING)?;
        interval("http.request_timeout_ms", h.request_timeout_ms)?;
        interval("http.header_read_timeout_ms", h.header_read_timeout_ms)?;
        range("http.batch_items_max", h.batch_items_max, 1, BATCH_ITEMS_MAX_CEILING)?;
        range("http.connections_max", h.connections_max, 1, CONNECTIONS_MAX_CEILING)?;
        interval("http.shutdown_grace_ms", h.shutdown_grace_ms)?;
        range("http.allowed_hosts", h.allowed_hosts.len() as u64, 0, ALLOWED_HOSTS_MAX as u64)?;
        for (i, host) in h.allowed_hosts.iter().enumerate() {
            let bad = host.is_empty()
                || host.len() > HOST_NAME_LEN_MAX
                || !host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._*".contains(&b));
            if bad {
                return Err(ConfigError::Invalid {
                    field: format!("http.allowed_hosts[{i}]"),
                    reason: format!(
                        "{host:?} is not a host name (letters, digits, '-', '.'), nor \"*\" for any"
                    ),
                });
            }
        }
        let r = &self.resp;
        range(
            "resp.request_bytes_max",
            r.request_bytes_max,
            RESP_REQUEST_BYTES_MAX_FLOOR,
            RESP_REQUEST_BYTES_MAX_CEILING,
        )?;
        range("resp.args_max", r.args_max, 2, RESP_ARGS_MAX_CEILING)?;
        range("resp.arg_bytes_max", r.arg_bytes_max, RESP_ARG_BYTES_MAX_FLOOR, r.request_bytes_max)?;
        range("resp.connections_max", r.connections_max, 1, CONNECTIONS_MAX_CEILING)?;
        range(
            "resp.connections_unauthenticated_max",
            r.connections_unauthenticated_max,
            1,
            CONNECTIONS_MAX_CEILING,
        )?;
        interval("resp.auth_timeout_ms", r.auth_timeout_ms)?;
        interval("resp.read_timeout_ms", r.read_timeout_ms)?;
        range("resp.idle_timeout_ms", r.idle_timeout_ms, 0, INTERVAL_MS_CEILING)?;
        if self.reconcile.len() > SOURCES_MAX {
            return Err(ConfigError::OutOfRange {
                field: "reconcile",
                got: self.reconcile.len() as u64,
                min: 0,
                max: SOURCES_MAX as u64,
            });
        }
        let mut names = BTreeSet::new();
        for (i, source) in self.reconcile.iter().enumerate() {
            source.validate(i)?;
            if !names.insert(source.name.as_str()) {
                return Err(SourceConfigError {
                    field: format!("reconcile[{i}].name"),
                    reason: format!("source name {:?} appears more than once", source.name),
                }
                .into());
            }
        }
        Tokens::from_config(&self.tokens)?;
        if let Some(tls) = &self.tls {
            tls.validate()?;
            // Between nodes the cluster CA is the only root: without it a node would
            // either trust nobody or fall back to plaintext.
            if self.cluster.nodes.len() > 1 && tls.cluster_ca.is_none() {
                return Err(tally_tls::TlsError::NoClusterCa.into());
            }
            // Clients get certificates of their own CA: one the cluster CA signed
            // for a client would be one step from a node's.
            if tls.client_ca.is_some() && tls.client_ca == tls.cluster_ca {
                return Err(ConfigError::Invalid {
                    field: "tls.client_ca".into(),
                    reason: "names the cluster CA's file: give clients certificates of a CA of their own \
                             (scripts/tls-local-ca.sh makes client-ca.pem beside ca.pem)"
                        .into(),
                });
            }
            // Each node's certificate names its id, as a DNS name.
            if self.cluster.nodes.len() > 1 {
                for n in &self.cluster.nodes {
                    tally_tls::node_server_name(&n.id)?;
                }
            }
        }
        let e = &self.engine;
        e.auto_tuning().validate().map_err(|t| ConfigError::OutOfRange {
            field: match t.field {
                "sample_ms" => "engine.auto_sample_ms",
                "change_interval_ms" => "engine.auto_change_interval_ms",
                "quiet_ms" => "engine.auto_quiet_ms",
                "hot_samples" => "engine.auto_hot_samples",
                "rate_up_per_shard" => "engine.auto_rate_up_per_shard",
                _ => "engine.auto_queue_up",
            },
            got: t.got,
            min: t.min,
            max: t.max,
        })?;
        interval("engine.aggregator_tick_ms", e.aggregator_tick_ms)?;
        interval("engine.shard_idle_stop_ms", e.shard_idle_stop_ms)?;
        interval("engine.counter_idle_evict_ms", e.counter_idle_evict_ms)?;
        interval("engine.call_timeout_ms", e.call_timeout_ms)?;
        interval("engine.rollup_tick_ms", e.rollup_tick_ms)?;
        range("engine.rollup_tracked_max", e.rollup_tracked_max, 1, u32::MAX.into())?;
        interval("engine.rollup_idle_evict_ms", e.rollup_idle_evict_ms)?;
        interval("engine.dedup_sweep_ms", e.dedup_sweep_ms)?;
        range("engine.dedup_sweep_records_max", e.dedup_sweep_records_max, 1, u32::MAX.into())?;
        range("engine.store_cache_bytes", e.store_cache_bytes, 1 << 20, 1 << 40)?;
        range("engine.store_flush_every_ms", e.store_flush_every_ms, 0, INTERVAL_MS_CEILING)?;
        range("engine.counters_max", e.counters_max, 1, u64::MAX)?;
        range("engine.event_ids_per_counter_max", e.event_ids_per_counter_max, 1, u64::MAX)?;
        range("engine.sketch_bytes_per_counter_max", e.sketch_bytes_per_counter_max, 1, u64::MAX)?;
        range("quotas", self.quotas.len() as u64, 0, QUOTAS_MAX as u64)?;
        for (i, q) in self.quotas.iter().enumerate() {
            // A prefix is the start of a name: any text of 1 to NAME_BYTES_MAX bytes.
            let max = tally_core::name::NAME_BYTES_MAX;
            if q.prefix.is_empty() || q.prefix.len() > max || q.counters_max == 0 {
                return Err(ConfigError::Invalid {
                    field: format!("quotas[{i}]"),
                    reason: format!(
                        "prefix must be 1 to {max} bytes (engine.counters_max bounds every counter) and \
                         counters_max at least 1"
                    ),
                });
            }
        }
        // An engine call must give up before the HTTP request waiting for it does, so
        // the client learns which shard failed instead of seeing a generic timeout;
        // and a graceful shutdown must outlast any request it waits for.
        ordered(
            "engine.call_timeout_ms",
            e.call_timeout_ms,
            "http.request_timeout_ms",
            h.request_timeout_ms,
        )?;
        ordered(
            "http.request_timeout_ms",
            h.request_timeout_ms,
            "http.shutdown_grace_ms",
            h.shutdown_grace_ms,
        )?;
        Ok(())
    }

    /// The sockets this node listens on when it runs: its HTTP address, and in a
    /// cluster of several nodes its peer and raft addresses too (a single node
    /// binds neither). A new listener (another protocol) belongs in this list.
    pub fn listeners(&self) -> Result<Vec<Listener>, ConfigError> {
        let me = self.this_node()?;
        let i = self.cluster.nodes.iter().position(|n| n.id == me.id).unwrap_or(0);
        let field = |name: &str| format!("cluster.nodes[{i}].{name} (node {})", me.id);
        let mut out = vec![Listener { field: field("http"), addr: me.http }];
        if let Some(resp) = me.resp {
            out.push(Listener { field: field("resp"), addr: resp });
        }
        if self.cluster.nodes.len() > 1 {
            out.push(Listener { field: field("peer"), addr: me.peer });
            out.push(Listener { field: field("raft"), addr: me.raft });
        }
        Ok(out)
    }

    /// Refuses a configuration whose listeners are reachable beyond loopback while
    /// it declares no client tokens, or while it keeps the shipped development
    /// secret ([`DEV_SECRET`]). A node on loopback only (the built-in config) may
    /// run open.
    pub fn check_exposure(&self) -> Result<(), ConfigError> {
        for l in self.listeners()? {
            if is_loopback(l.addr) {
                continue;
            }
            if self.tokens.is_empty() {
                return Err(ExposureError::NoTokens { listener: l.field, addr: l.addr }.into());
            }
            if self.cluster.secret == DEV_SECRET {
                return Err(ExposureError::DevSecret { listener: l.field, addr: l.addr }.into());
            }
            let (len, distinct) = secret_strength(&self.cluster.secret);
            if len < SECRET_LEN_MIN_EXPOSED || distinct < SECRET_DISTINCT_BYTES_MIN {
                return Err(
                    ExposureError::WeakSecret { listener: l.field, addr: l.addr, len, distinct }.into()
                );
            }
            if self.tls.is_none() && !self.node.insecure_plaintext {
                return Err(ExposureError::Plaintext { listener: l.field, addr: l.addr }.into());
            }
        }
        Ok(())
    }

    /// The listeners beyond loopback that run in plaintext because of
    /// `node.insecure_plaintext` (what `tallyd` warns about at every start).
    pub fn insecure_listeners(&self) -> Vec<Listener> {
        if self.tls.is_some() || !self.node.insecure_plaintext {
            return Vec::new();
        }
        self.listeners().unwrap_or_default().into_iter().filter(|l| !is_loopback(l.addr)).collect()
    }

    /// What this configuration exposes and what a node reachable by others must set,
    /// item by item: what `tallyd --check-config` prints (README, "Running it safely").
    pub fn checklist(&self) -> Vec<Check> {
        let mut out = Vec::new();
        let mut add = |level: CheckLevel, text: String| out.push(Check { level, text });
        let listeners = self.listeners().unwrap_or_default();
        let exposed: Vec<&Listener> = listeners.iter().filter(|l| !is_loopback(l.addr)).collect();
        for l in &listeners {
            let level = if is_loopback(l.addr) { CheckLevel::Ok } else { CheckLevel::Info };
            let reach = if is_loopback(l.addr) {
                "loopback: this machine's processes only (and web pages its users open, which the browser \
                 guards refuse)"
            } else {
                "beyond loopback: reachable from the network"
            };
            add(level, format!("{} listens on {}: {reach}", l.field, l.addr));
        }
        let any = !exposed.is_empty();
        match (self.tokens.is_empty(), any) {
            (true, true) => {
                add(CheckLevel::Fail, "no [[tokens]]: a listener beyond loopback needs client tokens".into())
            }
            (true, false) => add(
                CheckLevel::Warn,
                "no [[tokens]]: the node is open to every local process (fine for development)".into(),
            ),
            (false, _) => add(CheckLevel::Ok, format!("{} client token(s) declared", self.tokens.len())),
        }
        let (len, distinct) = secret_strength(&self.cluster.secret);
        let strong = len >= SECRET_LEN_MIN_EXPOSED && distinct >= SECRET_DISTINCT_BYTES_MIN;
        let secret = match (self.cluster.secret == DEV_SECRET, strong, any) {
            (true, _, true) => (CheckLevel::Fail, "cluster.secret is the development secret".to_string()),
            (true, _, false) => {
                (CheckLevel::Warn, "cluster.secret is the development secret (loopback only)".into())
            }
            (false, false, true) => (
                CheckLevel::Fail,
                format!("cluster.secret has {len} bytes ({distinct} distinct): 32 random bytes at least"),
            ),
            (false, false, false) => (
                CheckLevel::Warn,
                format!("cluster.secret has {len} bytes: use 32 random ones before exposing the node"),
            ),
            (false, true, _) => (CheckLevel::Ok, format!("cluster.secret: {len} bytes")),
        };
        add(secret.0, secret.1);
        match (&self.tls, self.node.insecure_plaintext, any) {
            (Some(tls), _, _) => {
                add(CheckLevel::Ok, "TLS on every listener; node certificates must name their node ids".into());
                match &tls.client_ca {
                    Some(_) => add(CheckLevel::Ok, "client certificates required (tls.client_ca)".into()),
                    None => add(CheckLevel::Info, "no tls.client_ca: clients authenticate by token only".into()),
                }
            }
            (None, true, true) => add(
                CheckLevel::Warn,
                "node.insecure_plaintext: listeners beyond loopback run without TLS (tokens and raft traffic in clear)"
                    .into(),
            ),
            (None, false, true) => add(CheckLevel::Fail, "no [tls]: a listener beyond loopback needs TLS".into()),
            (None, _, false) => add(CheckLevel::Info, "no [tls]: plaintext on loopback".into()),
        }
        let resp_exposed = exposed.iter().any(|l| l.field.contains(".resp "));
        if resp_exposed && self.resp.idle_timeout_ms == 0 {
            add(
                CheckLevel::Warn,
                "resp.idle_timeout_ms is 0: idle authenticated RESP connections never close".into(),
            );
        }
        if any && self.http.metrics_public {
            add(
                CheckLevel::Warn,
                "http.metrics_public: /metrics (which names counters) needs no token".into(),
            );
        }
        if self.http.allowed_hosts.iter().any(|h| h == "*") {
            add(
                CheckLevel::Warn,
                "http.allowed_hosts has \"*\": DNS rebinding is checked by nothing in front".into(),
            );
        }
        add(
            CheckLevel::Ok,
            "browser guards: Host names, cross-origin writes, JSON POSTs, RESP cross-protocol".into(),
        );
        for (i, source) in self.reconcile.iter().enumerate() {
            let Some(pg) = &source.postgres else { continue };
            if !pg.url.contains("sslmode=verify-") {
                add(
                    CheckLevel::Warn,
                    format!(
                        "reconcile[{i}].postgres.url has no sslmode=verify-full: plaintext to the database"
                    ),
                );
            }
        }
        let e = &self.engine;
        add(
            CheckLevel::Info,
            format!(
                "quotas: {} counters on the node, {} per-prefix rule(s), {} event ids and {} sketch bytes per counter",
                e.counters_max,
                self.quotas.len(),
                e.event_ids_per_counter_max,
                e.sketch_bytes_per_counter_max
            ),
        );
        add(
            CheckLevel::Info,
            format!(
                "connections: HTTP {} (header timeout {} ms), RESP {} + {} unauthenticated (auth timeout {} ms)",
                self.http.connections_max,
                self.http.header_read_timeout_ms,
                self.resp.connections_max,
                self.resp.connections_unauthenticated_max,
                self.resp.auth_timeout_ms
            ),
        );
        out
    }

    /// This node's entry in `cluster.nodes`.
    pub fn this_node(&self) -> Result<&NodeEntry, ConfigError> {
        self.cluster.node(&self.node.id).ok_or_else(|| ConfigError::UnknownNode {
            id: self.node.id.clone(),
            known: self.cluster.nodes.iter().map(|n| n.id.clone()).collect(),
        })
    }

    /// Where the engine's store lives: `<data_dir>/store`. Other subsystems (the
    /// raft log, in the cluster phase) get their own subdirectories.
    pub fn store_dir(&self) -> PathBuf {
        self.node.data_dir.join("store")
    }

    /// The engine settings this configuration asks for.
    pub fn tally_config(&self) -> TallyConfig {
        let e = &self.engine;
        TallyConfig {
            node_id: tally_core::NodeId::new(self.node.id.clone()),
            aggregator_tick_ms: e.aggregator_tick_ms,
            shard_idle_stop_ms: e.shard_idle_stop_ms,
            counter_idle_evict_ms: e.counter_idle_evict_ms,
            call_timeout_ms: e.call_timeout_ms,
            rollup_tick_ms: e.rollup_tick_ms,
            rollup_tracked_max: usize::try_from(e.rollup_tracked_max).unwrap_or(usize::MAX),
            rollup_idle_evict_ms: e.rollup_idle_evict_ms,
            dedup_sweep_ms: e.dedup_sweep_ms,
            dedup_sweep_records_max: usize::try_from(e.dedup_sweep_records_max).unwrap_or(usize::MAX),
            batch_items_max: self.http.batch_limit_items(),
            autoshard: e.auto_tuning(),
            // Checked by `validate`; a config not validated gets the built-in defaults.
            default_spec: self.cluster.default_spec().unwrap_or_default(),
            replicas_default: self.cluster.replicas(),
            counters_max: e.counters_max,
            counter_quotas: self
                .quotas
                .iter()
                .map(|q| tally_engine::CounterQuota {
                    // Names are compared in their escaped form (`tally_core::name`).
                    prefix: tally_core::name::escape(q.prefix.as_bytes()),
                    counters_max: q.counters_max,
                })
                .collect(),
            event_ids_per_counter_max: e.event_ids_per_counter_max,
            sketch_bytes_per_counter_max: e.sketch_bytes_per_counter_max,
            ..TallyConfig::default()
        }
    }

    /// The store settings this configuration asks for.
    pub fn sled_config(&self) -> SledConfig {
        let e = &self.engine;
        SledConfig {
            cache_capacity_bytes: e.store_cache_bytes,
            flush_every_ms: (e.store_flush_every_ms > 0).then_some(e.store_flush_every_ms),
            ..SledConfig::new(self.store_dir())
        }
    }
}

/// What the fingerprint covers, in a fixed order. The secret is left out on purpose:
/// fingerprints travel in handshakes and logs, and a hash of a short secret could be
/// brute-forced offline; a secret mismatch fails authentication anyway.
#[derive(Serialize)]
struct Canonical<'a> {
    format: u32,
    name: &'a str,
    vnodes_per_node: u32,
    heartbeat_ms: u64,
    heartbeat_misses_max: u32,
    raft_heartbeat_ms: u64,
    raft_election_timeout_min_ms: u64,
    raft_election_timeout_max_ms: u64,
    /// Left out when 1, so clusters of one copy kept their fingerprints.
    #[serde(skip_serializing_if = "is_one")]
    replicas: u8,
    /// Left out at the default, so clusters that never set it kept their fingerprints.
    #[serde(skip_serializing_if = "is_default_ranges_per_node")]
    ranges_per_node: u32,
    /// Left out when unset, so clusters that never set it kept their fingerprints.
    #[serde(skip_serializing_if = "Option::is_none")]
    default_spec: Option<tally_core::namespace::NamespaceSpec>,
    nodes: &'a [NodeEntry],
}

fn is_default_ranges_per_node(n: &u32) -> bool {
    *n == tally_core::ranges::RANGES_PER_NODE
}

fn is_one(n: &u8) -> bool {
    *n == 1
}

impl ClusterConfig {
    /// A 64-bit digest of everything in this section except the secret (see
    /// `Canonical` in the source for why), over its canonical binary encoding.
    /// Nodes whose fingerprints differ must not form a cluster. The order of
    /// `nodes` is significant: keep the list in the same order on every node.
    pub fn fingerprint(&self) -> u64 {
        let canonical = Canonical {
            format: FINGERPRINT_FORMAT,
            name: &self.name,
            vnodes_per_node: self.vnodes_per_node,
            heartbeat_ms: self.heartbeat_ms,
            heartbeat_misses_max: self.heartbeat_misses_max,
            raft_heartbeat_ms: self.raft_heartbeat_ms,
            raft_election_timeout_min_ms: self.raft_election_timeout_min_ms,
            raft_election_timeout_max_ms: self.raft_election_timeout_max_ms,
            replicas: self.replicas(),
            ranges_per_node: self.ranges_per_node,
            default_spec: self
                .default_spec()
                .ok()
                .filter(|d| *d != tally_core::namespace::NamespaceSpec::default()),
            nodes: &self.nodes,
        };
        tally_core::hash::hash64(FINGERPRINT_SEED, &tally_core::codec::encode(&canonical))
    }

    /// Copies of every shard: `replicas` as configured, or else
    /// [`REPLICAS_DEFAULT`](tally_core::ranges::REPLICAS_DEFAULT) once the cluster
    /// starts with that many members, and one copy below: two members cannot keep
    /// range groups that survive a lost disk ([`ConfigError::TwoVoters`]). Only the
    /// list's initial members count, so adding nodes later never changes it.
    pub fn replicas(&self) -> u8 {
        self.replicas.unwrap_or_else(|| {
            let members = self.initial_members();
            let default = tally_core::ranges::REPLICAS_DEFAULT;
            if members >= usize::from(default) {
                default
            } else {
                1
            }
        })
    }

    /// What a counter under no namespace takes (`default_spec`, or the built-in
    /// defaults), checked as a creation would check it.
    pub fn default_spec(&self) -> Result<tally_core::namespace::NamespaceSpec, ConfigError> {
        let Some(body) = &self.default_spec else { return Ok(Default::default()) };
        let spec = body.clone().into_namespace().map_err(|e| ConfigError::DefaultSpec(e.to_string()))?;
        spec.counter_spec().map_err(|e| ConfigError::DefaultSpec(e.to_string()))?;
        Ok(spec)
    }

    /// The nodes that start as members (`member = true`), at least one.
    pub fn initial_members(&self) -> usize {
        self.nodes.iter().filter(|n| n.member).count().max(1)
    }

    /// The entry of node `id`.
    pub fn node(&self, id: &str) -> Option<&NodeEntry> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// Checks this section on its own.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_token("cluster name", &self.name, CLUSTER_NAME_LEN_MAX)
            .map_err(|source| ConfigError::InvalidName { field: "cluster.name".into(), source })?;
        let len = self.secret.len();
        if !(SECRET_LEN_MIN..=SECRET_LEN_MAX).contains(&len) {
            return Err(ConfigError::SecretLength { len, min: SECRET_LEN_MIN, max: SECRET_LEN_MAX });
        }
        let vnodes_max = tally_core::ring::VNODES_PER_NODE_MAX;
        range("cluster.vnodes_per_node", self.vnodes_per_node.into(), 1, vnodes_max.into())?;
        if let Some(replicas) = self.replicas {
            range("cluster.replicas", replicas.into(), 1, tally_core::ranges::REPLICAS_MAX.into())?;
        }
        let (replicas, members) = (self.replicas(), self.initial_members());
        if replicas > 1 && tally_core::ranges::group_voters(replicas, members) == 2 || replicas == 2 {
            return Err(ConfigError::TwoVoters { replicas, members });
        }
        let per_node_max = tally_core::ranges::RANGES_PER_NODE_MAX;
        range("cluster.ranges_per_node", self.ranges_per_node.into(), 1, per_node_max.into())?;
        self.default_spec()?;
        interval("cluster.heartbeat_ms", self.heartbeat_ms)?;
        range(
            "cluster.heartbeat_misses_max",
            self.heartbeat_misses_max.into(),
            1,
            HEARTBEAT_MISSES_MAX_CEILING.into(),
        )?;
        interval("cluster.raft_heartbeat_ms", self.raft_heartbeat_ms)?;
        interval("cluster.raft_election_timeout_min_ms", self.raft_election_timeout_min_ms)?;
        interval("cluster.raft_election_timeout_max_ms", self.raft_election_timeout_max_ms)?;
        // A leader must heartbeat several times per election timeout, and openraft
        // draws the timeout from a non-empty range.
        ordered(
            "cluster.raft_heartbeat_ms",
            self.raft_heartbeat_ms,
            "cluster.raft_election_timeout_min_ms",
            self.raft_election_timeout_min_ms,
        )?;
        ordered(
            "cluster.raft_election_timeout_min_ms",
            self.raft_election_timeout_min_ms,
            "cluster.raft_election_timeout_max_ms",
            self.raft_election_timeout_max_ms,
        )?;
        if self.nodes.is_empty() || self.nodes.len() > NODES_MAX {
            return Err(ConfigError::NodeCount { got: self.nodes.len(), max: NODES_MAX });
        }
        if !self.nodes.iter().any(|n| n.member) {
            return Err(ConfigError::NoInitialMember);
        }
        let mut ids = BTreeSet::new();
        let mut raft_ids = BTreeSet::new();
        let mut addrs: BTreeMap<SocketAddr, String> = BTreeMap::new();
        for (i, n) in self.nodes.iter().enumerate() {
            check_token("node id", &n.id, NODE_ID_LEN_MAX).map_err(|source| ConfigError::InvalidName {
                field: format!("cluster.nodes[{i}].id"),
                source,
            })?;
            if !ids.insert(n.id.as_str()) {
                return Err(ConfigError::DuplicateNodeId(n.id.clone()));
            }
            if !raft_ids.insert(n.raft_id) {
                return Err(ConfigError::DuplicateRaftId(n.raft_id));
            }
            let listeners =
                [("http", Some(n.http)), ("peer", Some(n.peer)), ("raft", Some(n.raft)), ("resp", n.resp)];
            for (field, addr) in listeners.into_iter().filter_map(|(f, a)| a.map(|a| (f, a))) {
                let here = format!("cluster.nodes[{i}].{field} (node {})", n.id);
                if let Some(first) = addrs.insert(addr, here.clone()) {
                    return Err(ConfigError::DuplicateAddress { addr, first, second: here });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
        [cluster]
        name = "test"
        secret = "a-long-enough-secret"
        [[cluster.nodes]]
        id = "n1"
        raft_id = 1
        http = "127.0.0.1:7070"
        peer = "127.0.0.1:7170"
        raft = "127.0.0.1:7270"
        [[cluster.nodes]]
        id = "n2"
        raft_id = 2
        http = "127.0.0.1:7071"
        peer = "127.0.0.1:7171"
        raft = "127.0.0.1:7271"
        [node]
        id = "n1"
    "#;

    /// A change to a configuration, for tables of cases.
    type Mutation = Box<dyn FnOnce(&mut Config)>;
    /// A change to a cluster section.
    type ClusterMutation = Box<dyn Fn(&mut ClusterConfig)>;

    fn good() -> Config {
        Config::from_toml(GOOD).expect("the test config is valid")
    }

    fn refused(mutate: impl FnOnce(&mut Config)) -> ConfigError {
        let mut c = good();
        mutate(&mut c);
        c.validate().expect_err("the mutated config must be refused")
    }

    #[test]
    fn defaults_fill_every_optional_field() {
        let c = good();
        assert_eq!(c.cluster.vnodes_per_node, 128);
        assert_eq!((c.cluster.heartbeat_ms, c.cluster.heartbeat_misses_max), (250, 4));
        assert_eq!(c.cluster.raft_election_timeout_min_ms, 1000);
        assert_eq!(c.node.data_dir, PathBuf::from("./data"));
        assert_eq!(c.http, HttpConfig::default());
        assert_eq!(c.engine, EngineConfig::default());
        assert_eq!(c.this_node().map(|n| n.raft_id), Ok(1));
        let t = c.tally_config();
        assert_eq!((t.node_id.as_str(), t.batch_items_max), ("n1", 10_000));
        assert_eq!(c.sled_config().path, PathBuf::from("./data/store"));
    }

    #[test]
    fn replicas_default_to_three_or_the_initial_members() {
        let mut c = good().cluster;
        assert_eq!(c.replicas, None);
        assert_eq!(c.replicas(), 1, "two members: one copy (two voters cannot replace a lost disk)");
        c.replicas = Some(3);
        assert!(matches!(c.validate(), Err(ConfigError::TwoVoters { replicas: 3, members: 2 })));
        c.replicas = None;
        let mut third = c.nodes[1].clone();
        (third.id, third.raft_id) = ("n3".into(), 3);
        third.http.set_port(7072);
        c.nodes.push(third.clone());
        assert_eq!(c.replicas(), 3);
        c.replicas = Some(2);
        let refused = c.validate().unwrap_err().to_string();
        assert!(refused.contains("lost disk") && refused.contains("cluster.replicas = 2"), "{refused}");
        c.replicas = None;
        for i in 4..=6u16 {
            let mut more = third.clone();
            (more.id, more.raft_id) = (format!("n{i}"), u64::from(i));
            c.nodes.push(more);
        }
        assert_eq!(c.replicas(), 3, "never more than three unless configured");
        c.nodes.iter_mut().skip(1).for_each(|n| n.member = false);
        assert_eq!(c.replicas(), 1, "nodes added later do not count");
        c.replicas = Some(5);
        assert_eq!(c.replicas(), 5);
        let mut one = good().cluster;
        one.replicas = Some(1);
        let mut unset = good().cluster;
        unset.nodes.truncate(1);
        one.nodes.truncate(1);
        assert_eq!(unset.fingerprint(), one.fingerprint(), "a single node keeps its fingerprint");
    }

    #[test]
    fn syntax_errors_unknown_fields_and_bad_addresses_are_parse_errors() {
        let cases: Vec<(String, &str)> = vec![
            ("[cluster".into(), ""),
            (GOOD.replace("name = \"test\"", "name = \"test\"\nvnodes = 3"), "vnodes"),
            (GOOD.replace("[node]", "[node]\ndata_dri = \"x\""), "data_dri"),
            (format!("{GOOD}\n[http]\nbody_bytes = 5"), "body_bytes"),
            (format!("{GOOD}\n[engine]\ncall_timeout = 5"), "call_timeout"),
            (format!("{GOOD}\n[extra]\nx = 1"), "extra"),
            (GOOD.replace("\"127.0.0.1:7170\"", "\"127.0.0.1\""), "peer"),
            (GOOD.replace("\"127.0.0.1:7270\"", "\"node1:7270\""), "raft"),
            (GOOD.replace("raft_id = 2", "raft_id = -2"), "raft_id"),
        ];
        for (text, needle) in cases {
            match Config::from_toml(&text) {
                Err(ConfigError::Parse(m)) => assert!(m.contains(needle), "{needle:?} not in {m}"),
                other => panic!("expected a parse error mentioning {needle:?}, got {other:?}"),
            }
        }
    }

    #[test]
    fn missing_required_fields_are_refused() {
        for field in ["secret = \"a-long-enough-secret\"", "id = \"n1\"\n        raft_id = 1"] {
            assert!(matches!(Config::from_toml(&GOOD.replacen(field, "", 1)), Err(ConfigError::Parse(_))));
        }
    }

    #[test]
    fn node_count_is_bounded() {
        assert_eq!(refused(|c| c.cluster.nodes.clear()), ConfigError::NodeCount { got: 0, max: 32 });
        let err = refused(|c| {
            c.cluster.nodes = (0..33u16)
                .map(|i| NodeEntry {
                    id: format!("n{i}"),
                    raft_id: i.into(),
                    http: SocketAddr::from(([127, 0, 0, 1], 10_000 + i)),
                    peer: SocketAddr::from(([127, 0, 0, 1], 20_000 + i)),
                    raft: SocketAddr::from(([127, 0, 0, 1], 30_000 + i)),
                    resp: None,
                    member: true,
                })
                .collect();
        });
        assert_eq!(err, ConfigError::NodeCount { got: 33, max: 32 });
    }

    #[test]
    fn node_ids_raft_ids_and_addresses_are_unique() {
        assert_eq!(
            refused(|c| c.cluster.nodes[1].id = "n1".into()),
            ConfigError::DuplicateNodeId("n1".into())
        );
        assert_eq!(refused(|c| c.cluster.nodes[1].raft_id = 1), ConfigError::DuplicateRaftId(1));
        let err = refused(|c| c.cluster.nodes[1].peer = c.cluster.nodes[0].http);
        assert!(
            matches!(&err, ConfigError::DuplicateAddress { first, second, .. }
                if first.contains("nodes[0].http") && second.contains("nodes[1].peer")),
            "{err}"
        );
        // The optional RESP address is checked like the others.
        let err = refused(|c| c.cluster.nodes[1].resp = Some(c.cluster.nodes[0].raft));
        assert!(
            matches!(&err, ConfigError::DuplicateAddress { first, second, .. }
                if first.contains("nodes[0].raft") && second.contains("nodes[1].resp")),
            "{err}"
        );
        // Within one node, too.
        let err = refused(|c| c.cluster.nodes[0].raft = c.cluster.nodes[0].peer);
        assert!(matches!(err, ConfigError::DuplicateAddress { .. }), "{err}");
    }

    #[test]
    fn spares_are_allowed_but_someone_must_hold_shards() {
        let err = refused(|c| c.cluster.nodes.iter_mut().for_each(|n| n.member = false));
        assert_eq!(err, ConfigError::NoInitialMember);
        let mut spare = good();
        let before = spare.cluster.fingerprint();
        spare.cluster.nodes[1].member = false;
        spare.validate().expect("a spare node is valid");
        assert_ne!(spare.cluster.fingerprint(), before, "the fingerprint covers who starts as a member");
    }

    #[test]
    fn names_are_checked() {
        let err = refused(|c| c.cluster.nodes[1].id = "has space".into());
        assert!(matches!(&err, ConfigError::InvalidName { field, .. } if field == "cluster.nodes[1].id"));
        let err = refused(|c| c.cluster.nodes[1].id = "x".repeat(65));
        assert!(matches!(err, ConfigError::InvalidName { source: NameError::TooLong { .. }, .. }));
        let err = refused(|c| c.cluster.name = String::new());
        assert!(matches!(&err, ConfigError::InvalidName { field, .. } if field == "cluster.name"));
    }

    #[test]
    fn node_id_must_be_a_member() {
        let err = refused(|c| c.node.id = "n9".into());
        assert_eq!(err, ConfigError::UnknownNode { id: "n9".into(), known: vec!["n1".into(), "n2".into()] });
        assert!(err.to_string().contains("n9"));
    }

    #[test]
    fn secret_length_is_bounded() {
        assert_eq!(
            refused(|c| c.cluster.secret = "short".into()),
            ConfigError::SecretLength { len: 5, min: 8, max: 1024 }
        );
        assert!(matches!(refused(|c| c.cluster.secret = "s".repeat(1025)), ConfigError::SecretLength { .. }));
    }

    #[test]
    fn numeric_fields_are_range_checked() {
        let cases: Vec<(&str, Mutation)> = vec![
            ("cluster.vnodes_per_node", Box::new(|c| c.cluster.vnodes_per_node = 0)),
            ("cluster.replicas", Box::new(|c| c.cluster.replicas = Some(0))),
            ("cluster.replicas", Box::new(|c| c.cluster.replicas = Some(6))),
            ("cluster.ranges_per_node", Box::new(|c| c.cluster.ranges_per_node = 0)),
            ("cluster.ranges_per_node", Box::new(|c| c.cluster.ranges_per_node = 17)),
            ("cluster.vnodes_per_node", Box::new(|c| c.cluster.vnodes_per_node = 5000)),
            ("cluster.heartbeat_ms", Box::new(|c| c.cluster.heartbeat_ms = 0)),
            ("cluster.heartbeat_misses_max", Box::new(|c| c.cluster.heartbeat_misses_max = 0)),
            ("http.body_bytes_max", Box::new(|c| c.http.body_bytes_max = 10)),
            ("http.body_bytes_max", Box::new(|c| c.http.body_bytes_max = 1 << 30)),
            ("http.request_timeout_ms", Box::new(|c| c.http.request_timeout_ms = 0)),
            ("http.header_read_timeout_ms", Box::new(|c| c.http.header_read_timeout_ms = 0)),
            ("http.batch_items_max", Box::new(|c| c.http.batch_items_max = 0)),
            ("http.connections_max", Box::new(|c| c.http.connections_max = 0)),
            ("engine.call_timeout_ms", Box::new(|c| c.engine.call_timeout_ms = 0)),
            (
                "engine.shard_idle_stop_ms",
                Box::new(|c| c.engine.shard_idle_stop_ms = INTERVAL_MS_CEILING + 1),
            ),
            ("engine.store_cache_bytes", Box::new(|c| c.engine.store_cache_bytes = 0)),
            ("engine.auto_sample_ms", Box::new(|c| c.engine.auto_sample_ms = 1)),
            ("engine.auto_change_interval_ms", Box::new(|c| c.engine.auto_change_interval_ms = 1)),
            ("engine.auto_queue_up", Box::new(|c| c.engine.auto_queue_up = 1)),
        ];
        for (field, mutate) in cases {
            let err = refused(mutate);
            assert!(matches!(err, ConfigError::OutOfRange { field: f, .. } if f == field), "{field}: {err}");
        }
    }

    #[test]
    fn timeouts_must_be_ordered() {
        let err = refused(|c| c.cluster.raft_heartbeat_ms = 1000);
        assert!(matches!(err, ConfigError::TimeoutOrder { shorter: "cluster.raft_heartbeat_ms", .. }));
        let err = refused(|c| c.cluster.raft_election_timeout_max_ms = 1000);
        assert!(matches!(
            err,
            ConfigError::TimeoutOrder { longer: "cluster.raft_election_timeout_max_ms", .. }
        ));
        let err = refused(|c| c.engine.call_timeout_ms = 10_000);
        assert_eq!(
            err,
            ConfigError::TimeoutOrder {
                shorter: "engine.call_timeout_ms",
                shorter_ms: 10_000,
                longer: "http.request_timeout_ms",
                longer_ms: 10_000
            }
        );
        let err = refused(|c| c.http.shutdown_grace_ms = 5_000);
        assert!(matches!(err, ConfigError::TimeoutOrder { longer: "http.shutdown_grace_ms", .. }));
    }

    #[test]
    fn data_dir_must_not_be_empty() {
        assert_eq!(refused(|c| c.node.data_dir = PathBuf::new()), ConfigError::EmptyDataDir);
    }

    #[test]
    fn load_reports_unreadable_files_and_names_the_file_in_parse_errors() {
        let missing = Path::new("/nonexistent/tally.toml");
        assert!(matches!(Config::load(missing), Err(ConfigError::Read { .. })));
        let dir = std::env::temp_dir().join(format!("tally-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("bad.toml");
        std::fs::write(&path, "[cluster]\nbogus = 1\n").expect("write");
        match Config::load(&path) {
            Err(ConfigError::Parse(m)) => assert!(m.contains("bad.toml"), "{m}"),
            other => panic!("{other:?}"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn fingerprint_covers_the_cluster_section_but_not_the_secret_or_the_node_section() {
        let a = good();
        let mut b = good();
        b.node.id = "n2".into();
        b.node.data_dir = "/elsewhere".into();
        b.http.body_bytes_max = 4096;
        b.engine.call_timeout_ms = 1000;
        b.cluster.secret = "another-long-secret".into();
        assert_eq!(a.cluster.fingerprint(), b.cluster.fingerprint());
        let changes: Vec<ClusterMutation> = vec![
            Box::new(|c| c.name = "other".into()),
            Box::new(|c| c.vnodes_per_node += 1),
            Box::new(|c| c.replicas = Some(3)),
            Box::new(|c| c.ranges_per_node = 1),
            Box::new(|c| c.heartbeat_ms += 1),
            Box::new(|c| c.heartbeat_misses_max += 1),
            Box::new(|c| c.raft_heartbeat_ms += 1),
            Box::new(|c| c.raft_election_timeout_min_ms += 1),
            Box::new(|c| c.raft_election_timeout_max_ms += 1),
            Box::new(|c| c.nodes[1].raft_id = 9),
            Box::new(|c| c.nodes[1].http = SocketAddr::from(([127, 0, 0, 2], 7071))),
            Box::new(|c| c.nodes.swap(0, 1)),
            Box::new(|c| {
                c.nodes.pop();
            }),
        ];
        for (i, change) in changes.iter().enumerate() {
            let mut c = a.cluster.clone();
            change(&mut c);
            assert_ne!(c.fingerprint(), a.cluster.fingerprint(), "change {i} kept the fingerprint");
        }
    }

    #[test]
    fn the_shipped_sources_example_is_valid_and_source_names_are_unique() {
        let example = include_str!("../../../cluster-config/sources.toml.example");
        let c = Config::from_toml(&format!("{GOOD}\n{example}")).expect("the example is valid");
        assert_eq!(c.reconcile.len(), 2);
        assert!(c.reconcile[0].postgres.is_some() && c.reconcile[1].event_log.is_some());
        let mut dup = c.clone();
        dup.reconcile[1].name = dup.reconcile[0].name.clone();
        let err = dup.validate().expect_err("duplicate source names are refused");
        assert!(err.to_string().contains("reconcile[1].name"), "{err}");
        let bad = example.replace("every = \"1h\"", "every = \"1 hour\"");
        let err = Config::from_toml(&format!("{GOOD}\n{bad}")).expect_err("a bad period is refused");
        assert!(err.to_string().starts_with("reconcile[1].every"), "{err}");
        let unknown = example.replace("pool_size = 4", "pool = 4");
        assert!(matches!(Config::from_toml(&format!("{GOOD}\n{unknown}")), Err(ConfigError::Parse(_))));
    }

    #[test]
    fn defaults_written_out_match_defaults_left_out() {
        let explicit =
            GOOD.replace("name = \"test\"", "name = \"test\"\nvnodes_per_node = 128\nheartbeat_ms = 250");
        let explicit = Config::from_toml(&explicit).expect("valid");
        assert_eq!(explicit.cluster.fingerprint(), good().cluster.fingerprint());
    }

    /// A `[[tokens]]` entry for `token`, as `tally token new` prints it.
    fn token_lines(name: &str, token: &str, scopes: &[tally_auth::Scope]) -> String {
        tally_auth::config_lines(token, name, scopes, &[]).expect("valid entry")
    }

    fn exposed(c: &mut Config, field: &str, addr: &str) {
        let n = &mut c.cluster.nodes[0];
        let addr: SocketAddr = addr.parse().expect("address");
        match field {
            "http" => n.http = addr,
            "peer" => n.peer = addr,
            _ => n.raft = addr,
        }
    }

    #[test]
    fn tokens_are_parsed_and_checked_at_load() {
        let text = format!("{GOOD}\n{}", token_lines("ops", "t-admin", &[tally_auth::Scope::Admin]));
        let c = Config::from_toml(&text).expect("valid");
        assert_eq!(c.tokens.len(), 1);
        assert_eq!(c.tokens[0].name, "ops");
        let clear = text.replace(&tally_auth::TokenHash::of("t-admin").to_config(), "t-admin");
        let err = Config::from_toml(&clear).expect_err("a token in clear is refused");
        assert!(
            matches!(err, ConfigError::Tokens(_)) && err.to_string().starts_with("tokens[0].hash"),
            "{err}"
        );
        let unknown = text.replace("scopes = [\"admin\"]", "scopes = [\"root\"]");
        assert!(matches!(Config::from_toml(&unknown), Err(ConfigError::Parse(_))));
        assert!(!c.http.metrics_public);
    }

    #[test]
    fn the_shipped_tokens_example_is_valid() {
        let example = include_str!("../../../cluster-config/tokens.toml.example");
        let c = Config::from_toml(&format!("{GOOD}\n{example}")).expect("the example is valid");
        let names: Vec<&str> = c.tokens.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["ops", "dashboards", "ingest"]);
        let mut exposed_node = c.clone();
        exposed(&mut exposed_node, "http", "0.0.0.0:7070");
        exposed_node.cluster.secret = STRONG.into();
        exposed_node.node.insecure_plaintext = true;
        assert_eq!(exposed_node.check_exposure(), Ok(()));
    }

    #[test]
    fn loopback_nodes_may_run_open_with_the_dev_secret() {
        let mut c = good();
        c.cluster.secret = DEV_SECRET.into();
        assert_eq!(c.check_exposure(), Ok(()));
        let builtin = Config::single_node().expect("built-in config");
        assert!(builtin.tokens.is_empty());
        assert_eq!(builtin.cluster.secret, DEV_SECRET, "the shipped configs use the dev secret");
        assert_eq!(builtin.check_exposure(), Ok(()));
        for addr in ["127.0.0.2:1", "[::1]:1", "[::ffff:127.0.0.1]:1"] {
            exposed(&mut c, "http", addr);
            assert_eq!(c.check_exposure(), Ok(()), "{addr} is loopback");
        }
    }

    /// A secret as `openssl rand -hex 32` makes one.
    const STRONG: &str = "6f1c0e9a4b7d2385f0a1c3e5b7d9f1a2c4e6f8091b3d5f7a9c1e3f5a7b9d1f3a";

    /// `[tls]` files (not read by validation).
    fn with_tls(c: &mut Config) {
        c.tls = Some(tally_tls::TlsConfig {
            cert: "certs/n1.pem".into(),
            key: "certs/n1-key.pem".into(),
            client_ca: None,
            cluster_ca: Some("certs/ca.pem".into()),
        });
    }

    #[test]
    fn beyond_loopback_a_node_needs_tls_and_a_long_random_secret_unless_it_says_insecure_plaintext() {
        for field in ["http", "peer", "raft"] {
            let mut c = Config::from_toml(&format!(
                "{GOOD}\n{}",
                token_lines("ops", "t-admin", &[tally_auth::Scope::Admin])
            ))
            .expect("valid");
            exposed(&mut c, field, "0.0.0.0:7070");
            // Tokens, but a secret of 20 bytes (what GOOD carries), then 32 bytes of one letter.
            for weak in ["a-long-enough-secret", &"x".repeat(40)] {
                c.cluster.secret = weak.to_string();
                let err = c.check_exposure().expect_err("a weak secret");
                assert!(matches!(err, ConfigError::Exposure(ExposureError::WeakSecret { .. })), "{err}");
                assert!(err.to_string().contains("openssl rand -hex 32"), "{err}");
            }
            c.cluster.secret = STRONG.into();
            let err = c.check_exposure().expect_err("plaintext beyond loopback");
            assert!(matches!(err, ConfigError::Exposure(ExposureError::Plaintext { .. })), "{err}");
            assert!(err.to_string().contains("insecure_plaintext"), "{err}");
            assert!(c.insecure_listeners().is_empty());
            let mut insecure = c.clone();
            insecure.node.insecure_plaintext = true;
            assert_eq!(insecure.check_exposure(), Ok(()));
            assert_eq!(insecure.insecure_listeners().len(), 1, "{field}: the one to warn about");
            with_tls(&mut c);
            assert_eq!(c.check_exposure(), Ok(()), "{field} with tokens, a strong secret and TLS");
            assert!(c.insecure_listeners().is_empty());
        }
    }

    #[test]
    fn the_checklist_fails_what_the_node_refuses_and_warns_of_what_it_allows() {
        let levels = |c: &Config, needle: &str| {
            c.checklist().into_iter().filter(|k| k.text.contains(needle)).map(|k| k.level).collect::<Vec<_>>()
        };
        let builtin = Config::single_node().expect("built-in");
        assert!(builtin.checklist().iter().all(|k| k.level != CheckLevel::Fail), "{:?}", builtin.checklist());
        assert_eq!(levels(&builtin, "no [[tokens]]"), [CheckLevel::Warn]);
        assert_eq!(levels(&builtin, "development secret"), [CheckLevel::Warn]);
        let mut exposed = good();
        exposed.cluster.nodes[0].http = "0.0.0.0:7070".parse().expect("address");
        for needle in ["no [[tokens]]", "no [tls]", "cluster.secret has 20 bytes"] {
            assert_eq!(levels(&exposed, needle), [CheckLevel::Fail], "{needle}: {:?}", exposed.checklist());
        }
        exposed.node.insecure_plaintext = true;
        assert_eq!(levels(&exposed, "insecure_plaintext"), [CheckLevel::Warn]);
    }

    #[test]
    fn clients_get_a_ca_of_their_own_and_node_ids_are_names_a_certificate_can_carry() {
        let mut c = good();
        with_tls(&mut c);
        c.validate().expect("valid");
        let tls = c.tls.as_mut().expect("tls");
        tls.client_ca = tls.cluster_ca.clone();
        let err = c.validate().expect_err("the cluster CA as the client CA");
        assert!(matches!(&err, ConfigError::Invalid { field, .. } if field == "tls.client_ca"), "{err}");
        let mut c = good();
        with_tls(&mut c);
        c.cluster.nodes[1].id = "n:2".into();
        c.node.id = "n1".into();
        assert!(matches!(c.validate(), Err(ConfigError::Tls(tally_tls::TlsError::NodeName(_)))));
    }

    #[test]
    fn every_listener_beyond_loopback_needs_tokens_and_a_real_secret() {
        for field in ["http", "peer", "raft"] {
            for addr in ["0.0.0.0:7070", "[::]:7070", "192.0.2.7:7070"] {
                let mut c = good();
                exposed(&mut c, field, addr);
                let err = c.check_exposure().expect_err("exposed without tokens");
                assert!(matches!(err, ConfigError::Exposure(ExposureError::NoTokens { .. })), "{err}");
                let text = err.to_string();
                assert!(text.contains(&format!("cluster.nodes[0].{field}")), "{text}");
                assert!(text.contains("[[tokens]]") && text.contains("tally token new"), "{text}");
                let mut c = Config::from_toml(&format!(
                    "{GOOD}\n{}",
                    token_lines("ops", "t-admin", &[tally_auth::Scope::Admin])
                ))
                .expect("valid");
                exposed(&mut c, field, addr);
                c.cluster.secret = STRONG.into();
                with_tls(&mut c);
                assert_eq!(c.check_exposure(), Ok(()), "{field} {addr} with tokens, a real secret and TLS");
                c.cluster.secret = DEV_SECRET.into();
                let err = c.check_exposure().expect_err("exposed with the dev secret");
                assert!(matches!(err, ConfigError::Exposure(ExposureError::DevSecret { .. })), "{err}");
                assert!(err.to_string().contains("cluster.secret"), "{err}");
            }
        }
    }

    #[test]
    fn a_single_node_binds_only_its_http_and_resp_addresses() {
        let mut c = Config::single_node().expect("built-in config");
        assert_eq!(c.listeners().map(|l| l.len()), Ok(2));
        // Its peer and raft addresses are never bound, so they are not checked.
        c.cluster.nodes[0].peer = "0.0.0.0:7170".parse().expect("address");
        assert_eq!(c.check_exposure(), Ok(()));
        // Its RESP address is: beyond loopback it needs tokens like HTTP.
        c.cluster.nodes[0].resp = Some("0.0.0.0:6380".parse().expect("address"));
        assert!(matches!(
            c.check_exposure(),
            Err(ConfigError::Exposure(ExposureError::NoTokens { ref listener, .. })) if listener.contains("resp")
        ));
        assert_eq!(good().listeners().map(|l| l.len()), Ok(3));
    }
}
